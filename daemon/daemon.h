/* The daemon object: the top of moeepd. It owns the event base, the
 * listening sockets, the signals and every object below, creates them in
 * order at start, handing each the objects it calls (and the session
 * registry its dispatch callback); no object reaches a sibling through
 * struct daemon. There
 * is one, owned by main(), and only the event loop thread touches it (the
 * proxy's and clientfd's threads have state of their own). Its fields are
 * written only by daemon.c. */
#ifndef MOEEPD_DAEMON_H
#define MOEEPD_DAEMON_H

#include <stdbool.h>
#include <stdint.h>
#include <sys/queue.h>
#include <time.h>

#include "clients/requests.h"
#include "clients/sockdir.h"
#include "config.h"
#include "ops/metrics.h"
#include "ops/notify.h"

struct event;
struct clientfds;
struct event_base;
struct http;
struct sessions;

/* What the command line said; it wins over the file, also after SIGHUP. */
struct daemon_options {
        const char *config_path;    /* not owning; NULL = MOEEP_DEFAULT_CONFIG when it exists */
        bool no_config;             /* --no-config: embedded defaults only, no file at all */
        const char *socket;         /* not owning; NULL = from the configuration */
        const char *admin_socket;   /* not owning; NULL = from the configuration */
        const char *log_level;      /* not owning; NULL = from the configuration */
        const char *metrics_listen; /* not owning; NULL = from the configuration */
};

/* One listening socket. The client socket (0660, group moeep) is what
 * containers are given; the admin socket (0600, the daemon's uid) is the
 * operator's and is never mounted into containers. A session is an admin
 * session when, and only when, it was accepted on the admin socket: the
 * decision is made once, at accept, and no credential changes it. */
struct daemon_listener {
        struct daemon *daemon;   /* not owning */
        bool admin;              /* the operator socket */
        int fd;                  /* owns; -1 when none */
        bool bound;              /* we bound it (in `dir`, removed at exit); false when socket-activated */
        struct sockdir dir;      /* owns; the directory we bound it in (sockdir.h) */
        struct event *ev;        /* owns */
        struct event *ev_resume; /* owns; re-enables accepting after EMFILE */
};

struct daemon {
        struct event_base *base; /* owns */
        struct daemon_options options;
        struct config config;          /* the live configuration */
        struct daemon_listener listen; /* the client socket */
        struct daemon_listener admin;  /* the operator socket */
        struct event *ev_signal[3];    /* owns; SIGTERM, SIGINT, SIGHUP */
        struct notify notify;          /* owns; sd_notify (notify.h) */
        struct jobs *jobs;             /* owns */
        struct broker *broker;         /* owns */
        struct clientfds *clientfds;   /* owns; checks, counts and closes client fds (clientfd.h) */
        struct sessions *sessions;     /* owns; the connections (session.h) */
        struct requests requests;      /* owns; the request layer (requests.h) */
        struct http *http;             /* owns; NULL unless metrics_listen is set */
        struct mesh *mesh;             /* owns; NULL unless mesh_listen is set */
        struct mesh_jobs *mesh_jobs;   /* owns; jobs across daemons over `mesh`, NULL with it */
        struct datapath *datapath;     /* owns; NULL unless mesh_listen is set */
        struct metrics metrics;        /* the counters, and what a snapshot reads (metrics.h) */
        bool stopping;
};

/* Builds a configuration as start-up and SIGHUP do: embedded defaults, the
 * file (options->config_path, else MOEEP_DEFAULT_CONFIG when it exists,
 * none with no_config), then the command line. Returns 0 or -errno with
 * errmsg naming the file, line, key and value. `moeepd --check-config`
 * calls it alone. */
int daemon_config_build(const struct daemon_options *o, struct config *ret_config, char *errmsg);

/* The configuration file daemon_config_build() reads, or NULL for none. */
const char *daemon_config_path(const struct daemon_options *o);

/* Loads the configuration, sets up the listeners, signals and notification.
 * Logs what went wrong and returns -errno. */
int daemon_init(struct daemon *d, const struct daemon_options *options);

/* Runs the loop until SIGTERM/SIGINT; then tells sessions and systemd. */
int daemon_run(struct daemon *d);

/* Frees everything; unlinks a self-bound socket. Accepts a zeroed struct. */
void daemon_done(struct daemon *d);

#endif
