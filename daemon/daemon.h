/* The daemon object: event base, listening socket, signals, systemd
 * notification, and the registries everything else hangs off. There is one,
 * owned by main(); the event loop thread is the only thread. */
#ifndef MOEEPD_DAEMON_H
#define MOEEPD_DAEMON_H

#include <stdbool.h>
#include <stdint.h>
#include <sys/queue.h>
#include <time.h>

#include "config.h"

struct event;
struct event_base;
struct session;

TAILQ_HEAD(session_list, session);

/* What the command line said; it wins over the file, also after SIGHUP. */
struct daemon_options {
        const char *config_path; /* not owning; NULL = embedded defaults only */
        const char *socket;      /* not owning; NULL = from the configuration */
        const char *log_level;   /* not owning; NULL = from the configuration */
};

struct daemon {
        struct event_base *base; /* owns */
        struct daemon_options options;
        struct config config;    /* the live configuration */
        int listen_fd;           /* owns */
        char *bound_path;        /* owns; the path we bound (unlinked at exit), NULL when socket-activated */
        struct event *ev_listen; /* owns */
        struct event *ev_accept_resume; /* owns; re-enables accepting after EMFILE */
        struct event *ev_signal[3];     /* owns; SIGTERM, SIGINT, SIGHUP */
        struct event *ev_watchdog;      /* owns; NULL without WatchdogSec */
        struct event *ev_reap;          /* owns; frees dead sessions from the loop */
        struct jobs *jobs;              /* owns */
        struct broker *broker;          /* owns */
        struct session_list sessions;   /* owns; live sessions, CLOSED ones that still flush included */
        struct session_list dead;       /* owns; closed sessions waiting to be freed */
        uint32_t nsessions;             /* length of `sessions` */
        uint64_t next_session_id;
        struct timespec started;  /* CLOCK_MONOTONIC */
        uint32_t status_sessions; /* what the last STATUS= said, to send only changes */
        uint32_t status_jobs;
        bool status_sent;
        bool stopping;
};

/* Loads the configuration, sets up the listener, signals and notification.
 * Logs what went wrong and returns -errno. */
int daemon_init(struct daemon *d, const struct daemon_options *options);

/* Runs the loop until SIGTERM/SIGINT; then tells sessions and systemd. */
int daemon_run(struct daemon *d);

/* Frees everything; unlinks a self-bound socket. Accepts a zeroed struct. */
void daemon_done(struct daemon *d);

/* Updates systemd's STATUS= line after sessions or jobs changed. */
void daemon_status_changed(struct daemon *d);

/* Milliseconds since start-up. */
uint64_t daemon_uptime_ms(const struct daemon *d);

#endif
