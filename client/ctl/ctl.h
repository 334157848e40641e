/* moeepctl: shared declarations of the subcommands and the output helpers. */
#ifndef MOEEP_CTL_H
#define MOEEP_CTL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "client-internal.h"

struct ctl {
        struct moeep_client *client; /* owns */
        bool admin;                  /* `client` is connected to the admin socket */
        bool client_only;            /* --client: the client socket, even when the admin socket is ours */
        char admin_error[512];       /* why the admin socket was not used, "" when it was or not tried */
        bool json;                   /* --json: machine-readable output */
        bool off;                    /* --off (drain only) */
        char **args;                 /* not owning; the subcommand's arguments (argv) */
        size_t nargs;
};

/* One subcommand: ctl.c holds the table of them, each lives in its own file.
 * run() prints its result to stdout, or its error to stderr, and returns the
 * process exit status. */
struct ctl_subcommand {
        const char *name;
        const char *args; /* synopsis of its arguments for --help, "" for none */
        size_t nargs;     /* arguments it takes (exactly) */
        bool takes_off;   /* accepts --off */
        const char *summary;
        int (*run)(struct ctl *ctl);
};

int ctl_status(struct ctl *ctl);
int ctl_jobs(struct ctl *ctl);
int ctl_clients(struct ctl *ctl);
int ctl_nics(struct ctl *ctl);
int ctl_mesh(struct ctl *ctl);
int ctl_metrics(struct ctl *ctl);
int ctl_log_level(struct ctl *ctl);
int ctl_drain(struct ctl *ctl);

/* Whether the daemon offers FEATURE_OPERATOR (protocol 1.1); otherwise
 * prints that `command` needs it and returns false. */
bool ctl_require_operator(struct ctl *ctl, const char *command);

/* Runs an admin request answered Ok (log-level, drain): checks the
 * feature, sends it, then prints the status, which shows the effect.
 * Returns the exit status. */
int ctl_admin(struct ctl *ctl, const char *command, const Moeep__V1__Request *req);

/* After an admin command failed: when the admin socket was not used, says
 * why on stderr (the client socket refuses admin commands). */
void ctl_admin_hint(const struct ctl *ctl);

/* Sends `req` and waits for a Response of body case `expect`; on failure
 * prints "moeepctl: <error>" to stderr and returns -errno. */
int ctl_query(struct ctl *ctl, const Moeep__V1__Request *req, Moeep__V1__Response__BodyCase expect,
              Moeep__V1__Response **ret_resp);

/* ---------------------------------------------------------------- output
 *
 * A subcommand describes its columns once and adds typed rows; the table
 * then prints either as aligned human text or as JSON, so both outputs
 * always carry the same fields. */

enum ctl_value_type {
        CTL_STRING,      /* s; human "-" when empty */
        CTL_UINT,        /* u */
        CTL_ID,          /* u; 0 means none: human "-", JSON null */
        CTL_UID,         /* u; UINT32_MAX (no uid, e.g. a mirror's owner) means none: "-", null */
        CTL_RANK,        /* i; < 0 means none: human "-", JSON null */
        CTL_RANKS,       /* list[n]; human "0,1,3", JSON array */
        CTL_DURATION_MS, /* u milliseconds; human "1h 2m 3s", JSON number */
        CTL_BOOL,        /* u != 0; human "yes"/"no", JSON true/false */
};

struct ctl_column {
        const char *header; /* human column header or label */
        const char *key;    /* JSON member name */
        enum ctl_value_type type;
};

struct ctl_value {
        const char *s;
        uint64_t u;
        int64_t i;
        const uint32_t *list;
        size_t n;
};

struct ctl_table {
        const struct ctl_column *columns; /* does not own */
        size_t ncolumns;
        size_t nrows;
        char **human; /* owns; nrows * ncolumns formatted cells */
        char **json;  /* owns; the same cells as JSON values */
};

void ctl_table_init(struct ctl_table *t, const struct ctl_column *columns, size_t ncolumns);
/* Formats one row (ncolumns values). Returns 0 or -ENOMEM. */
int ctl_table_add(struct ctl_table *t, const struct ctl_value *row);
/* Prints every row: a table with a header line (human), or a JSON array of
 * objects. */
void ctl_table_print_list(const struct ctl_table *t, bool json, FILE *f);
/* Prints every row as a JSON array of objects, without a newline after it,
 * for output that embeds it in an object. */
void ctl_table_print_json(const struct ctl_table *t, FILE *f);
/* Prints the first row as "label: value" lines or as one JSON object. */
void ctl_table_print_object(const struct ctl_table *t, bool json, FILE *f);
/* Frees the cells. Accepts a table that was only initialised. */
void ctl_table_done(struct ctl_table *t);
/* Ends a subcommand: unless `r` (the last ctl_table_add()) failed, prints
 * the table to stdout (as a list, or as one object when `object`); frees
 * the table and `resp`. Returns the exit status. */
int ctl_table_finish(struct ctl_table *t, int r, bool json, bool object, Moeep__V1__Response *resp);

/* Prints a note after a human table (to stdout, so that it travels with
 * the table), e.g. why the table is empty. */
void ctl_note(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/* Writes `s` as a JSON string literal (quoted; control characters, quotes,
 * backslashes escaped; invalid UTF-8 replaced by U+FFFD). */
void ctl_json_string(FILE *f, const char *s);

#endif
