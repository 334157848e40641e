/* Sessions: one per client connection. A session owns its socket, its
 * read event, and a queue of encoded records (with duplicated fds) waiting
 * to be written; write interest is armed only while that queue is not
 * empty. Every way a session ends goes through session_fail(). Sessions are
 * refcounted and freed from the loop (daemon->ev_reap), never inside one of
 * their own callbacks. */
#ifndef MOEEPD_SESSION_H
#define MOEEPD_SESSION_H

#include <stdbool.h>
#include <stdint.h>
#include <sys/queue.h>
#include <sys/socket.h>
#include <sys/types.h>

#include <protobuf-c/protobuf-c.h>

#include "daemon.h"
#include "job.h"
#include "moeep.pb-c.h"

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
        uint64_t id;           /* daemon-wide unique */
        struct daemon *daemon; /* not owning */
        int fd;                /* owns; -1 once dead */
        enum session_state state;
        unsigned references; /* the daemon's list holds one until death */
        struct ucred cred;   /* SO_PEERCRED at accept */
        bool admin;          /* accepted on the admin socket: decided at accept, never changes */
        gid_t *groups;       /* owns; SO_PEERGROUPS at accept (supplementary groups) */
        size_t ngroups;
        char name[SESSION_NAME_MAX + 1]; /* Hello.client_name, sanitised */
        uint64_t features;               /* agreed in Welcome */
        struct job_member *member;       /* owns the membership; NULL unless READY */
        struct event *ev_read;           /* owns */
        struct event *ev_write;          /* owns; pending only while `out` is not empty */
        struct event *ev_linger;         /* owns; bounds how long a CLOSED session flushes */
        struct event *ev_hello;          /* owns; ends a session that says no Hello in time */
        struct session_out_list out;     /* owns */
        uint32_t out_count;
        uint32_t out_fds; /* duplicates in `out`, charged to cred.uid (clientfd.h) */
        size_t out_bytes;
        const char *broken; /* static; set when output overflowed, acted on from the loop */
        TAILQ_ENTRY(session) entry;
};

/* Accepts the connection `fd` (owned from now on, closed off the loop on
 * error: a client can queue records with fds on it before accept()), which
 * came through the admin socket when `admin`. The socket is charged to the
 * peer's uid like every fd the daemon holds for it. Client sessions count
 * against max_sessions and max_sessions_per_uid; admin sessions only
 * against DAEMON_ADMIN_SESSIONS_MAX. */
int session_new(struct daemon *d, int fd, bool admin, struct session **ret_session);

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

/* Queues Response.error (and counts it in the metrics). */
int session_send_error(struct session *s, uint64_t request_id, int code, const char *message);

/* The one way a session ends: logs `why` once, queues Error(`code`) when
 * `code` is not 0, stops reading, leaves its job as a lost rank, and closes
 * once the output is flushed (or after a short linger). Safe to call twice. */
void session_fail(struct session *s, int code, uint64_t request_id, const char *fmt, ...)
        __attribute__((format(printf, 4, 5)));

/* Closes the socket now, dropping unsent output, and moves the session to
 * the dead list. Call session_fail() first so that it leaves its job. */
void session_close_now(struct session *s);

/* Takes and drops a reference; the session is freed from the loop once dead and
 * unreferenced. */
void session_ref(struct session *s);
void session_unref(struct session *s);

/* Frees every dead, unreferenced session (daemon->ev_reap calls it). */
void sessions_reap(struct daemon *d);

/* Ends every session at shutdown: queues Shutdown, flushes what the socket
 * takes now, closes. */
void sessions_shutdown(struct daemon *d, const char *reason);

/* The ErrorCode for a handler's return value (an error kind or -errno;
 * errors.h maps them). */
Moeep__V1__ErrorCode session_error_code(int r);

/* `s` became member `m` (a local join, or one its job's home daemon
 * accepted): the session is READY and JobJoined (request `rid`) with the
 * control page is queued. Returns 0 or -errno from session_respond(). */
int session_joined(struct session *s, uint64_t rid, struct job_member *m);

/* The callbacks jobs use to reach sessions. */
extern const struct job_callbacks session_job_callbacks;

#endif
