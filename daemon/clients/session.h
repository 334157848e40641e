/* Sessions: one per client connection, and the registry that holds them.
 * This is the connection layer only (tmux's server-client.c): a session
 * owns its socket, its read event, and a queue of encoded records (with
 * duplicated fds, charged to its uid through clientfd.h) waiting to be
 * written; write interest is armed only while that queue is not empty.
 * Every way a session ends goes through session_fail(). Sessions are
 * refcounted and freed from the loop (the registry's ev_reap), never inside
 * one of their own callbacks.
 *
 * Who calls what:
 *  - daemon.c makes the registry (sessions_new) with the one callback
 *    below and hands every accepted connection to session_new().
 *  - session.c calls upward only through that callback, as tmux's peer has
 *    one dispatch callback: a received record goes to it, and so does the
 *    end of a session (the request layer, requests.c).
 *  - requests.c and membership.c reply with session_send(),
 *    session_respond(), session_send_ok() and session_send_error().
 *
 * Who owns which field of struct session: session.c writes everything but
 * `member` and the READY state, which membership.c writes at join and leave
 * (with session_state_set()). */
#ifndef MOEEPD_SESSION_H
#define MOEEPD_SESSION_H

#include <stdbool.h>
#include <stdint.h>
#include <sys/queue.h>
#include <sys/socket.h>
#include <sys/types.h>

#include <protobuf-c/protobuf-c.h>

#include "clients/uids.h"
#include "moeep.pb-c.h"

struct clientfds;
struct config;
struct metrics;
struct event;
struct event_base;
struct job_member;
struct moeep_record;

enum session_state {
        SESSION_NEW,    /* connected; the first request must be Hello */
        SESSION_HELLO,  /* welcomed; not a job member */
        SESSION_READY,  /* a member of a job */
        SESSION_CLOSED, /* failed or ending: reads nothing, flushes its output, then dies */
};

const char *session_state_to_string(enum session_state s);

struct session_out; /* one queued record */
TAILQ_HEAD(session_out_list, session_out);

#define SESSION_NAME_MAX 64

struct session {
        uint64_t id;          /* registry-wide unique */
        struct sessions *reg; /* not owning; the registry it is in */
        int fd;               /* owns; -1 once dead */
        enum session_state state;
        unsigned references; /* the registry's list holds one until death */
        struct ucred cred;   /* SO_PEERCRED at accept */
        bool admin;          /* accepted on the admin socket: decided at accept, never changes */
        gid_t *groups;       /* owns; SO_PEERGROUPS at accept (supplementary groups) */
        size_t ngroups;
        char name[SESSION_NAME_MAX + 1]; /* Hello.client_name, sanitised (session_welcome()) */
        uint64_t features;               /* agreed in Welcome (session_welcome()) */
        struct job_member *member;       /* owns the membership; NULL unless READY; written by membership.c */
        struct event *ev_read;           /* owns */
        struct event *ev_write;          /* owns; pending only while `out` is not empty */
        struct event *ev_linger;         /* owns; bounds how long a CLOSED session flushes */
        struct event *ev_hello;          /* owns; ends a session that says no Hello in time */
        struct session_out_list out;     /* owns */
        uint32_t out_count;
        uint32_t out_fds; /* duplicates in `out`, charged to cred.uid (clientfd.h) */
        size_t out_bytes;
        const char *broken; /* static; set when output overflowed, acted on from the loop */
        bool paused;        /* reads nothing until session_resume() (a request in progress) */
        /* Not owning: the registry's entry of its uid (its share of the
         * loop, its failed joins); NULL for admin sessions, which are never
         * throttled. */
        struct client_uid *uid_state;
        bool throttled;             /* in the registry's `throttled`: held (its uid's share of the loop
                                     * is spent, or its next record's fds do not fit yet) */
        uint64_t hold_until_us;     /* held at least until then (CLOCK_MONOTONIC us) */
        uint64_t fds_wait_since_us; /* its next record's fds do not fit since then; 0 = they do */
        bool fds_allowed;           /* welcomed on a listener that refuses fds: it takes them now */
        TAILQ_ENTRY(session) entry;
        TAILQ_ENTRY(session) throttle_entry;
};

TAILQ_HEAD(session_list, session);

/* How the connection layer reaches the request layer above it, on the
 * loop with `ctx`: the one callback. With `rec`, a record arrived on `s`
 * (not CLOSED) and passed the framing checks; the callback owns nothing of
 * it (session.c closes its fds afterwards) and returns 1 to read on, 0
 * when `s` failed. With `rec` NULL, `s` ends (session_fail(), `why` says
 * why): it leaves its job as a lost rank and gives up the jobs it created;
 * the return value is not read. */
typedef int session_dispatch_fn(void *ctx, struct session *s, struct moeep_record *rec, const char *why);

/* SO_PASSRIGHTS (Linux 6.16, asm-generic/socket.h): whether a socket
 * takes SCM_RIGHTS; accepted sockets inherit the listener's. */
#ifdef SO_PASSRIGHTS
#define SESSION_SO_PASSRIGHTS SO_PASSRIGHTS
#else
#define SESSION_SO_PASSRIGHTS 83
#endif

/* Admin sessions at once: the operator's own small cap, apart from the
 * client caps, so that no number of client sessions can lock it out. */
#define SESSIONS_ADMIN_MAX 16

/* The registry: every session. It counts its connections, its sessions by
 * state and its Error responses in struct metrics (metrics.h). One, owned
 * by daemon.c; only the loop thread touches it. */
struct sessions {
        struct event_base *base;     /* not owning */
        const struct config *config; /* not owning; the live configuration (caps) */
        struct clientfds *clientfds; /* not owning; checks, counts and closes client fds */
        struct metrics *metrics;     /* not owning; where it counts */
        session_dispatch_fn *dispatch;
        void *dispatch_ctx;       /* not owning; the request layer (struct requests) */
        struct event *ev_reap;    /* owns; frees dead sessions from the loop */
        struct session_list list; /* owns; live sessions, CLOSED ones that still flush included */
        struct session_list dead; /* owns; closed sessions waiting to be freed */
        uint32_t count;           /* length of `list` */
        uint32_t nadmin;          /* of them, sessions accepted on the admin socket */
        uint64_t next_id;
        bool stopping; /* sessions_shutdown() ran: everybody gets Shutdown */
        /* The client listener refuses fds (SO_PASSRIGHTS off, Linux 6.16+;
         * daemon.c): a client session takes them only once welcomed, and a
         * socket turned away before closes at once. */
        bool fds_after_welcome;
        struct uids uids;              /* owns; per client uid (uids.h) */
        struct session_list throttled; /* not owning; sessions waiting for their uid's share */
        struct event *ev_throttle;     /* owns; reads them again once it has grown back */
        uint64_t throttles;            /* times a session waited for its uid's share */
};

/* Makes the registry. Returns 0 with *ret, or -ENOMEM. */
int sessions_new(struct event_base *base, const struct config *config, struct clientfds *clientfds,
                 struct metrics *metrics, session_dispatch_fn *dispatch, void *dispatch_ctx,
                 struct sessions **ret);

/* Frees the registry; every session must be dead and unreferenced by now
 * (sessions_close_all(), then sessions_reap()). Accepts NULL. */
void sessions_free(struct sessions *reg);

/* Accepts the connection `fd` (owned from now on, closed off the loop on
 * error: a client can queue records with fds on it before accept()), which
 * came through the admin socket when `admin`. The socket is charged to the
 * peer's uid like every fd the daemon holds for it. Client sessions count
 * against max_sessions and max_sessions_per_uid; admin sessions only
 * against SESSIONS_ADMIN_MAX. */
int session_new(struct sessions *reg, int fd, bool admin, struct session **ret_session);

/* Sends a record to `s` now when nothing is queued and the socket takes
 * it, else queues it with duplicates of `fds` (the caller keeps its own),
 * charged to the session's uid. Returns 0, or -ENOBUFS when the peer does
 * not read (the session is then failed from the loop), -EDQUOT or -EMFILE
 * when the duplicates would pass the session's or the uid's fd cap or the
 * daemon's fd budget (session_send_why() says which), -EMSGSIZE or
 * -ENOMEM. */
int session_send(struct session *s, uint16_t type, uint64_t request_id, const ProtobufCMessage *msg,
                 const int *fds, size_t nfds);

/* Why the last session_send() refused its fds (static text). */
const char *session_send_why(void);

/* Queues a Response whose type is its body case. */
int session_respond(struct session *s, uint64_t request_id, Moeep__V1__Response *resp, const int *fds,
                    size_t nfds);

/* Queues Response.ok. */
int session_send_ok(struct session *s, uint64_t request_id);

/* Queues Response.error (and counts it in the registry's errors). */
int session_send_error(struct session *s, uint64_t request_id, int code, const char *message);

/* The one way a session ends: logs `why` once, queues Error(`code`) when
 * `code` is not 0, stops reading, leaves its job as a lost rank (the
 * dispatch callback, with no record), and closes once the output is
 * flushed (or after a short linger).
 * Safe to call twice. */
void session_fail(struct session *s, int code, uint64_t request_id, const char *fmt, ...)
        __attribute__((format(printf, 4, 5)));

/* Closes the socket now, dropping unsent output, and moves the session to
 * the dead list. Call session_fail() first so that it leaves its job. */
void session_close_now(struct session *s);

/* Stops reading `s` until session_resume(): a request whose reply comes
 * later (RegionRegister with `take`) keeps the next requests behind it, so
 * that they see its outcome and one session has one such request at a
 * time. Resuming a CLOSED session does nothing. */
void session_pause(struct session *s);
void session_resume(struct session *s);

/* Takes and drops a reference; the session is freed from the loop once
 * dead and unreferenced. */
void session_ref(struct session *s);
void session_unref(struct session *s);

/* Moves `s` to state `to`, keeping the registry's count of live sessions
 * by state (struct metrics' `sessions`) true: a session counts from
 * session_new() until it is CLOSED. */
void session_state_set(struct session *s, enum session_state to);

/* Hello was accepted: keeps the client's name (sanitised for display) and
 * the agreed features, moves `s` from NEW to HELLO and stops the Hello
 * deadline. */
void session_welcome(struct session *s, const char *client_name, uint64_t features);

/* Frees every dead, unreferenced session (the registry's ev_reap calls it). */
void sessions_reap(struct sessions *reg);

/* Ends every session at shutdown: sets `stopping`, queues Shutdown, flushes
 * what the socket takes now, closes. */
void sessions_shutdown(struct sessions *reg, const char *reason);

/* Fails and closes every session at once, unsent output dropped (the
 * daemon exits). */
void sessions_close_all(struct sessions *reg, const char *reason);

#endif
