/* Sessions: one per client connection, and their registry; see
 * session.h. Nothing here knows what a request means: records go up
 * through the registry's dispatch callback. At the end, the sessions held back: not
 * read while their uid's share of the loop is spent (uids.h), or while
 * the descriptors their next record may bring do not fit yet
 * (clientfd.h); and the records refused unread because of that. */
#include <errno.h>
#include <event2/event.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "clients/session.h"
#include "config.h"
#include "errors.h"
#include "log.h"
#include "messages.h"
#include "ops/metrics.h"
#include "record.h"
#include "state/clientfd.h"

/* Sessions held back (at the end of this file). */
static uint64_t session_thread_cpu_us(void);
static void session_hold(struct session *s, uint64_t until_us);
static void session_unhold(struct session *s);
static void sessions_hold_cb(evutil_socket_t fd, short what, void *arg);
static int session_read_admitted(struct session *s);

/* Output a session may queue before we decide its peer does not read: a
 * slow peer must not make the daemon buffer without bound. */
#define SESSION_OUT_MAX_RECORDS 256
#define SESSION_OUT_MAX_BYTES (4u << 20)
/* Records handled per read callback, so one chatty peer cannot starve the
 * others. */
#define SESSION_READ_BATCH 16
/* How long a failed session may take to flush its last error. */
#define SESSION_LINGER_MS 1000
/* Duplicated fds a session may have waiting in unsent records: four full
 * Regions replies. Past it (or past its uid's max_fds_per_uid) requests
 * that would queue more are refused. */
#define SESSION_OUT_MAX_FDS (4 * MOEEP_RECORD_MAX_FDS)
/* How long a connection may stay without saying Hello: libmoeep sends it
 * right after connect(). */
#define SESSION_HELLO_DEADLINE_MS 5000
struct session_out {
        TAILQ_ENTRY(session_out) entry;
        size_t len;
        size_t nfds;
        int fds[MOEEP_RECORD_MAX_FDS]; /* owns the first nfds: duplicates made at queueing */
        uint8_t buf[];                 /* the encoded record */
};

/* One receive buffer for every session: the loop is single-threaded and a
 * record is handled completely before the next is read. */
static struct moeep_record rx;

const char *session_state_to_string(enum session_state s) {
        switch (s) {
        case SESSION_NEW:
                return "new";
        case SESSION_HELLO:
                return "hello";
        case SESSION_READY:
                return "ready";
        case SESSION_CLOSED:
                return "closed";
        }
        return "unknown";
}

/* ------------------------------------------------------------ sockets */

/* How a socket accepted on the client (`admin` false) or admin listener
 * closes before it became a session: one of the client listener cannot
 * hold fds when the listener refuses them (SO_PASSRIGHTS off). */
static unsigned accepted_close_flags(const struct sessions *reg, bool admin) {
        return !admin && reg->fds_after_welcome ? CLIENTFD_SESSION_NO_FDS : 0;
}

/* How the socket of `s` closes: counted while it was a client session,
 * and at once when its peer could never send it fds. */
static unsigned session_close_flags(const struct session *s) {
        unsigned flags = s->admin ? 0 : CLIENTFD_SESSION_COUNTED;

        if (!s->fds_allowed)
                flags |= accepted_close_flags(s->reg, s->admin);
        return flags;
}

/* ------------------------------------------------------------ output */

/* Frees a record taken off the queue. Its duplicates may be the last
 * references to files a client sent (a region released meanwhile), so
 * they are closed off the loop; their charge goes with them. */
static void out_free(struct session *s, struct session_out *o) {
        for (size_t i = 0; i < o->nfds; i++)
                clientfd_close(s->reg->clientfds, s->cred.uid, o->fds[i]);
        s->out_fds -= (uint32_t)o->nfds;
        free(o);
}

static void out_clear(struct session *s) {
        struct session_out *o;

        while ((o = TAILQ_FIRST(&s->out))) {
                TAILQ_REMOVE(&s->out, o, entry);
                out_free(s, o);
        }
        s->out_count = 0;
        s->out_bytes = 0;
}

/* Closes, off the loop, every fd a received record still owns. They were
 * charged to the session's uid when they arrived. */
static void session_release_fds(struct session *s, struct moeep_record *rec) {
        for (size_t i = 0; i < rec->nfds; i++) {
                clientfd_close(s->reg->clientfds, s->cred.uid, rec->fds[i]);
                rec->fds[i] = -1;
        }
        rec->nfds = 0;
}

static char send_why[ERRMSG_MAX];

const char *session_send_why(void) {
        return send_why;
}

int session_send(struct session *s, uint16_t type, uint64_t request_id, const ProtobufCMessage *msg,
                 const int *fds, size_t nfds) {
        static uint8_t scratch[MOEEP_RECORD_MAX];
        struct session_out *o;
        int len;

        if (s->fd < 0)
                return -EPIPE;
        if (s->broken)
                return -ENOBUFS;
        len = moeep_record_encode(scratch, type, request_id, msg, nfds);
        if (len < 0)
                return len;
        if (s->out_count >= SESSION_OUT_MAX_RECORDS || s->out_bytes + (size_t)len > SESSION_OUT_MAX_BYTES) {
                /* Failing here could pull the session out of a job while
                 * job.c iterates over it; let the loop do it. */
                s->broken = "output queue full: the peer does not read";
                event_active(s->ev_write, EV_WRITE, 0);
                return -ENOBUFS;
        }
        /* Nothing queued: the record goes now, and its fds with it, with
         * no duplicate kept. Any error is met again by the flush, which
         * fails the session from the loop. */
        if (TAILQ_EMPTY(&s->out) && moeep_record_send_raw(s->fd, scratch, (size_t)len, fds, nfds) == 0)
                return 0;
        if (nfds > 0) {
                int r;

                if (s->out_fds + nfds > SESSION_OUT_MAX_FDS)
                        return errmsg_set(send_why, -EDQUOT,
                                          "session %" PRIu64 " has %" PRIu32
                                          " descriptors in unsent replies; %zu "
                                          "more would pass %d: read the replies",
                                          s->id, s->out_fds, nfds, SESSION_OUT_MAX_FDS);
                r = clientfds_charge(s->reg->clientfds, s->cred.uid, (uint32_t)nfds, send_why);
                if (r < 0)
                        return r;
        }
        o = malloc(sizeof(*o) + (size_t)len);
        if (!o) {
                clientfds_uncharge(s->reg->clientfds, s->cred.uid, (uint32_t)nfds);
                return -ENOMEM;
        }
        memcpy(o->buf, scratch, (size_t)len);
        o->len = (size_t)len;
        s->out_fds += (uint32_t)nfds;
        for (o->nfds = 0; o->nfds < nfds; o->nfds++) {
                o->fds[o->nfds] = fcntl(fds[o->nfds], F_DUPFD_CLOEXEC, 3);
                if (o->fds[o->nfds] < 0) {
                        int r = -errno;

                        clientfds_uncharge(s->reg->clientfds, s->cred.uid, (uint32_t)(nfds - o->nfds));
                        s->out_fds -= (uint32_t)(nfds - o->nfds);
                        out_free(s, o);
                        return r;
                }
        }
        if (TAILQ_EMPTY(&s->out))
                event_add(s->ev_write, NULL);
        TAILQ_INSERT_TAIL(&s->out, o, entry);
        s->out_count++;
        s->out_bytes += o->len;
        return 0;
}

int session_respond(struct session *s, uint64_t request_id, Moeep__V1__Response *resp, const int *fds,
                    size_t nfds) {
        return session_send(s, (uint16_t)resp->body_case, request_id, &resp->base, fds, nfds);
}

/* Fills `resp` with Error `code` and `message` (borrowed; `err` holds
 * them) and counts the code in the registry's errors. */
static void error_fill(struct sessions *reg, int code, const char *message, Moeep__V1__Error *err,
                       Moeep__V1__Response *resp) {
        moeep__v1__error__init(err);
        moeep__v1__response__init(resp);
        err->code = code;
        err->message = (char *)message;
        resp->body_case = MOEEP__V1__RESPONSE__BODY_ERROR;
        resp->error = err;
        if (code > 0 && code < METRICS_ERROR_CODES)
                reg->metrics->errors[code]++;
}

int session_send_error(struct session *s, uint64_t request_id, int code, const char *message) {
        Moeep__V1__Error err;
        Moeep__V1__Response resp;

        error_fill(s->reg, code, message, &err, &resp);
        return session_respond(s, request_id, &resp, NULL, 0);
}

int session_send_ok(struct session *s, uint64_t request_id) {
        Moeep__V1__Ok ok = MOEEP__V1__OK__INIT;
        Moeep__V1__Response resp = MOEEP__V1__RESPONSE__INIT;

        resp.body_case = MOEEP__V1__RESPONSE__BODY_OK;
        resp.ok = &ok;
        return session_respond(s, request_id, &resp, NULL, 0);
}

/* ------------------------------------------------------------ lifetime */

void session_ref(struct session *s) {
        s->references++;
}

void session_unref(struct session *s) {
        if (--s->references == 0)
                event_active(s->reg->ev_reap, EV_TIMEOUT, 0);
}

static void session_free(struct session *s) {
        out_clear(s);
        /* Only a session that never made it into the list still has its
         * socket here: not counted. */
        clientfd_close_session(s->reg->clientfds, s->cred.uid, s->fd,
                               session_close_flags(s) & ~CLIENTFD_SESSION_COUNTED);
        if (s->ev_read)
                event_free(s->ev_read);
        if (s->ev_write)
                event_free(s->ev_write);
        if (s->ev_linger)
                event_free(s->ev_linger);
        if (s->ev_hello)
                event_free(s->ev_hello);
        free(s->groups);
        free(s);
}

void sessions_reap(struct sessions *reg) {
        struct session *s, *next;

        for (s = TAILQ_FIRST(&reg->dead); s; s = next) {
                next = TAILQ_NEXT(s, entry);
                if (s->references > 0)
                        continue;
                TAILQ_REMOVE(&reg->dead, s, entry);
                session_free(s);
        }
}

void session_close_now(struct session *s) {
        struct sessions *reg = s->reg;

        if (s->fd < 0)
                return;
        session_state_set(s, SESSION_CLOSED);
        event_del(s->ev_read);
        event_del(s->ev_write);
        event_del(s->ev_linger);
        event_del(s->ev_hello);
        out_clear(s);
        session_unhold(s);
        uids_session_remove(&reg->uids, s->uid_state);
        s->uid_state = NULL;
        /* Closing the socket closes what the peer queued on it unread,
         * fds it attached included: off the loop. */
        clientfd_close_session(reg->clientfds, s->cred.uid, s->fd, session_close_flags(s));
        s->fd = -1;
        TAILQ_REMOVE(&reg->list, s, entry);
        reg->count--;
        reg->nadmin -= s->admin;
        TAILQ_INSERT_TAIL(&reg->dead, s, entry);
        session_unref(s); /* the list's reference */
}

/* Writes queued records until the socket is full. Returns 0, or -errno
 * after the session died. */
static int session_flush(struct session *s) {
        struct session_out *o;
        int r;

        while ((o = TAILQ_FIRST(&s->out))) {
                r = moeep_record_send_raw(s->fd, o->buf, o->len, o->fds, o->nfds);
                if (r == -EAGAIN)
                        return 0;
                if (r < 0) {
                        if (s->state == SESSION_CLOSED)
                                session_close_now(s);
                        else
                                session_fail(s, 0, 0, "sending a record of %zu bytes: %s", o->len,
                                             strerror(-r));
                        return r;
                }
                TAILQ_REMOVE(&s->out, o, entry);
                s->out_count--;
                s->out_bytes -= o->len;
                out_free(s, o);
        }
        event_del(s->ev_write);
        if (s->state == SESSION_CLOSED)
                session_close_now(s);
        return 0;
}

void session_fail(struct session *s, int code, uint64_t request_id, const char *fmt, ...) {
        char why[ERRMSG_MAX];
        struct timeval linger = { .tv_sec = SESSION_LINGER_MS / 1000,
                                  .tv_usec = (SESSION_LINGER_MS % 1000) * 1000 };
        va_list ap;

        if (s->state == SESSION_CLOSED || s->fd < 0)
                return;
        va_start(ap, fmt);
        vsnprintf(why, sizeof(why), fmt, ap);
        va_end(ap);
        if (code)
                log_notice("session %" PRIu64 " (pid %d uid %u): failed: %s", s->id, (int)s->cred.pid,
                           (unsigned)s->cred.uid, why);
        else
                log_info("session %" PRIu64 " (pid %d uid %u): closed: %s", s->id, (int)s->cred.pid,
                         (unsigned)s->cred.uid, why);
        if (code && !s->broken)
                session_send_error(s, request_id, code, why);
        /* Leaves the job as a lost rank, gives up the jobs it created. */
        s->reg->dispatch(s->reg->dispatch_ctx, s, NULL, why);
        session_state_set(s, SESSION_CLOSED);
        event_del(s->ev_read);
        if (s->broken)
                out_clear(s);
        if (TAILQ_EMPTY(&s->out)) {
                session_close_now(s);
                return;
        }
        event_add(s->ev_linger, &linger);
        session_flush(s);
}

static void session_linger_cb(evutil_socket_t fd, short what, void *arg) {
        struct session *s = arg;

        session_ref(s);
        log_debug("session %" PRIu64 ": dropping %" PRIu32 " unsent records after %d ms", s->id, s->out_count,
                  SESSION_LINGER_MS);
        session_close_now(s);
        session_unref(s);
}

static void session_hello_cb(evutil_socket_t fd, short what, void *arg) {
        struct session *s = arg;

        session_ref(s);
        if (s->state == SESSION_NEW)
                session_fail(s, MOEEP__V1__ERROR_CODE__ERROR_NOT_WELCOMED, 0, "no Hello within %d ms",
                             SESSION_HELLO_DEADLINE_MS);
        session_unref(s);
}

static void session_write_cb(evutil_socket_t fd, short what, void *arg) {
        struct session *s = arg;

        session_ref(s);
        if (s->broken)
                session_fail(s, 0, 0, "%s", s->broken);
        else if (s->fd >= 0)
                session_flush(s);
        session_unref(s);
}

/* Receives and handles one record. Returns 1 to go on, 0 to stop. */
static int session_read_one(struct session *s) {
        const char *why = NULL;
        uint64_t rid;
        int r;

        /* A record may bring up to 253 fds (session_read_admitted()). */
        if (!session_read_admitted(s))
                return 0;
        memset(&rx.hdr, 0, sizeof(rx.hdr));
        r = moeep_record_recv_keep(s->fd, &rx, &why);
        /* Whatever arrived is the daemon's to close now, and the sender's
         * to pay for until it is closed. */
        clientfds_charge_held(s->reg->clientfds, s->cred.uid, (uint32_t)rx.nfds);
        if (r < 0)
                session_release_fds(s, &rx);
        if (r == -EAGAIN)
                return 0;
        /* The header's request id is echoed when the header itself was
         * readable. */
        rid = rx.hdr.magic == MOEEP_RECORD_MAGIC ? rx.hdr.request_id : 0;
        switch (r) {
        case 0:
                break;
        case -ECONNRESET:
                session_fail(s, 0, 0, "peer closed the connection");
                return 0;
        case -EPROTONOSUPPORT:
                session_fail(s, MOEEP__V1__ERROR_CODE__ERROR_VERSION_MISMATCH, rid,
                             "record with protocol major %u: the daemon speaks %d", rx.hdr.major,
                             MOEEP_PROTOCOL_MAJOR);
                return 0;
        case -EBADMSG:
                /* The framing says which code: descriptor problems have
                 * their own, so that clients can tell them apart. */
                session_fail(s, rx.error_code, rid, "bad record: %s", why ? why : "malformed");
                return 0;
        default: /* -errno from recvmsg */
                session_fail(s, 0, 0, "receiving: %s", strerror(-r));
                return 0;
        }
        r = s->reg->dispatch(s->reg->dispatch_ctx, s, &rx, NULL);
        session_release_fds(s, &rx);
        return r;
}

void session_pause(struct session *s) {
        s->paused = true;
        event_del(s->ev_read);
}

void session_resume(struct session *s) {
        s->paused = false;
        if (s->state != SESSION_CLOSED && s->fd >= 0 && !s->throttled)
                event_add(s->ev_read, NULL);
}

/* Handles up to SESSION_READ_BATCH records, each charged to the uid's
 * share of the loop (uids.h): a uid whose share is spent waits, however
 * many sessions it has, and nobody else does. */
static void session_read_cb(evutil_socket_t fd, short what, void *arg) {
        struct session *s = arg;
        struct client_uid *cu = s->uid_state;

        session_ref(s);
        for (int i = 0; i < SESSION_READ_BATCH && s->state != SESSION_CLOSED && !s->paused; i++) {
                uint64_t t0;
                int r;

                if (cu && !uid_loop_ok(cu, uids_now_us())) {
                        session_hold(s, 0);
                        break;
                }
                t0 = session_thread_cpu_us();
                r = session_read_one(s);
                if (cu)
                        uid_loop_charge(cu, session_thread_cpu_us() - t0);
                if (!r)
                        break;
        }
        session_unref(s);
}

/* ------------------------------------------------------------ accept */

/* Reads the peer's supplementary groups as they were at connect() time
 * (SO_PEERGROUPS, Linux 4.13+): unlike /proc/PID/status this cannot race
 * with the pid being reused. Leaves ngroups 0 where unsupported. */
static void session_read_groups(struct session *s) {
#ifdef SO_PEERGROUPS
        socklen_t len = 64 * sizeof(gid_t);

        for (int tries = 0; tries < 2; tries++) {
                gid_t *g = malloc(len);

                if (!g)
                        return;
                if (getsockopt(s->fd, SOL_SOCKET, SO_PEERGROUPS, g, &len) == 0) {
                        s->groups = g;
                        s->ngroups = len / sizeof(gid_t);
                        return;
                }
                free(g);
                /* ERANGE tells the size needed; NGROUPS_MAX bounds it. */
                if (errno != ERANGE || len > 65536 * sizeof(gid_t))
                        return;
        }
#endif
}

/* Client sessions of `uid` (admin sessions have their own cap). */
static uint32_t sessions_count_uid(const struct sessions *reg, uid_t uid) {
        const struct session *s;
        uint32_t n = 0;

        TAILQ_FOREACH (s, &reg->list, entry)
                n += s->cred.uid == uid && !s->admin;
        return n;
}

/* Turns a connection away with an error it can read, without making a
 * session: a fresh socket's buffer always takes one small record. */
static int session_refuse(struct sessions *reg, int fd, bool admin, uid_t uid, int r, const char *why) {
        Moeep__V1__Error err;
        Moeep__V1__Response resp;

        reg->metrics->sessions_refused++;
        error_fill(reg, MOEEP__V1__ERROR_CODE__ERROR_LIMIT_EXCEEDED, why, &err, &resp);
        (void)moeep_record_send(fd, MOEEP__V1__RESPONSE__BODY_ERROR, 0, &resp.base, NULL, 0);
        clientfd_close_session(reg->clientfds, uid, fd, accepted_close_flags(reg, admin));
        return r;
}

int session_new(struct sessions *reg, int fd, bool admin, struct session **ret_session) {
        const struct timeval hello_deadline = { .tv_sec = SESSION_HELLO_DEADLINE_MS / 1000,
                                                .tv_usec = (SESSION_HELLO_DEADLINE_MS % 1000) * 1000 };
        char why[ERRMSG_MAX];
        struct session *s;
        struct ucred cred;
        socklen_t len = sizeof(cred);
        uint32_t n;

        if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) < 0) {
                int r = -errno;

                /* Whose it is is unknown: overflowuid's. */
                clientfd_close_session(reg->clientfds, 65534, fd, accepted_close_flags(reg, admin));
                return r;
        }
        if (admin && reg->nadmin >= SESSIONS_ADMIN_MAX) {
                snprintf(why, sizeof(why), "%" PRIu32 " admin sessions connected (at most %d)", reg->nadmin,
                         SESSIONS_ADMIN_MAX);
                log_notice("refusing pid %d uid %u on the admin socket: %s", (int)cred.pid,
                           (unsigned)cred.uid, why);
                return session_refuse(reg, fd, admin, cred.uid, -EDQUOT, why);
        }
        /* Client sessions count against the daemon's fd budget, whose
         * reserve keeps accept() and the operator's sessions working. */
        if (!admin && (clientfds_budget_check(reg->clientfds, 1, why) < 0 ||
                       clientfds_closing_check(reg->clientfds, cred.uid, why) < 0)) {
                log_notice("refusing pid %d uid %u: %s", (int)cred.pid, (unsigned)cred.uid, why);
                return session_refuse(reg, fd, admin, cred.uid, -EDQUOT, why);
        }
        if (!admin && reg->count - reg->nadmin >= reg->config->max_sessions) {
                snprintf(why, sizeof(why), "%" PRIu32 " sessions connected (max_sessions = %" PRIu32 ")",
                         reg->count - reg->nadmin, reg->config->max_sessions);
                log_notice("refusing pid %d uid %u: %s", (int)cred.pid, (unsigned)cred.uid, why);
                return session_refuse(reg, fd, admin, cred.uid, -EDQUOT, why);
        }
        n = admin ? 0 : sessions_count_uid(reg, cred.uid);
        if (!admin && n >= reg->config->max_sessions_per_uid) {
                snprintf(why, sizeof(why),
                         "uid %u has %" PRIu32 " sessions (max_sessions_per_uid = %" PRIu32 ")",
                         (unsigned)cred.uid, n, reg->config->max_sessions_per_uid);
                log_notice("refusing pid %d: %s", (int)cred.pid, why);
                return session_refuse(reg, fd, admin, cred.uid, -EDQUOT, why);
        }

        s = calloc(1, sizeof(*s));
        if (!s) {
                clientfd_close_session(reg->clientfds, cred.uid, fd, accepted_close_flags(reg, admin));
                return -ENOMEM;
        }
        s->fd = fd;
        s->reg = reg;
        s->cred = cred;
        s->admin = admin;
        s->state = SESSION_NEW;
        s->references = 1;
        TAILQ_INIT(&s->out);
        s->ev_read = event_new(reg->base, fd, EV_READ | EV_PERSIST, session_read_cb, s);
        s->ev_write = event_new(reg->base, fd, EV_WRITE | EV_PERSIST, session_write_cb, s);
        s->ev_linger = evtimer_new(reg->base, session_linger_cb, s);
        s->ev_hello = evtimer_new(reg->base, session_hello_cb, s);
        if (!s->ev_read || !s->ev_write || !s->ev_linger || !s->ev_hello || event_add(s->ev_read, NULL) < 0 ||
            event_add(s->ev_hello, &hello_deadline) < 0) {
                session_free(s);
                return -ENOMEM;
        }
        if (!admin) {
                s->uid_state = uids_session_add(&reg->uids, cred.uid);
                if (!s->uid_state) {
                        session_free(s);
                        return -ENOMEM;
                }
        } else {
                /* The operator's requests go first when the loop is busy
                 * (the admin socket's listener does too, daemon.c). */
                event_priority_set(s->ev_read, 0);
                event_priority_set(s->ev_write, 0);
        }
        session_read_groups(s);
        if (!admin)
                clientfds_session_opened(reg->clientfds);
        s->id = reg->next_id++;
        reg->metrics->sessions_accepted++;
        TAILQ_INSERT_TAIL(&reg->list, s, entry);
        reg->count++;
        reg->metrics->sessions[SESSION_NEW]++;
        reg->nadmin += admin;
        log_debug("session %" PRIu64 ": connected%s, pid %d uid %u gid %u, %zu groups", s->id,
                  admin ? " on the admin socket" : "", (int)cred.pid, (unsigned)cred.uid, (unsigned)cred.gid,
                  s->ngroups);
        *ret_session = s;
        return 0;
}

void sessions_shutdown(struct sessions *reg, const char *reason) {
        Moeep__V1__Shutdown sd = MOEEP__V1__SHUTDOWN__INIT;
        Moeep__V1__Event ev = MOEEP__V1__EVENT__INIT;
        struct session *s, *next;

        reg->stopping = true;
        sd.reason = (char *)reason;
        ev.body_case = MOEEP__V1__EVENT__BODY_SHUTDOWN;
        ev.shutdown = &sd;
        for (s = TAILQ_FIRST(&reg->list); s; s = next) {
                next = TAILQ_NEXT(s, entry);
                session_ref(s);
                if (s->state != SESSION_CLOSED)
                        session_send(s, MOEEP__V1__EVENT__BODY_SHUTDOWN, 0, &ev.base, NULL, 0);
                session_fail(s, 0, 0, "%s", reason);
                if (s->fd >= 0) /* the peer did not read: give up on it */
                        session_close_now(s);
                session_unref(s);
        }
}

void sessions_close_all(struct sessions *reg, const char *reason) {
        struct session *s, *next;

        reg->stopping = true;
        for (s = TAILQ_FIRST(&reg->list); s; s = next) {
                next = TAILQ_NEXT(s, entry);
                session_fail(s, 0, 0, "%s", reason);
                session_close_now(s);
        }
}

/* Copies a client-chosen string for display: at most `size - 1` bytes,
 * non-printable bytes replaced. */
static void copy_printable(char *dst, size_t size, const char *src) {
        size_t i;

        for (i = 0; i + 1 < size && src && src[i]; i++)
                dst[i] = (src[i] >= 0x20 && src[i] <= 0x7e) ? src[i] : '?';
        dst[i] = '\0';
}

_Static_assert(SESSION_NEW == 0 && SESSION_HELLO == 1 && SESSION_READY == 2 &&
                       SESSION_CLOSED == METRICS_SESSION_STATES,
               "struct metrics counts the states before CLOSED by their values");

void session_state_set(struct session *s, enum session_state to) {
        if (s->state != SESSION_CLOSED)
                s->reg->metrics->sessions[s->state]--;
        s->state = to;
        if (to != SESSION_CLOSED)
                s->reg->metrics->sessions[to]++;
}

void session_welcome(struct session *s, const char *client_name, uint64_t features) {
        const int on = 1;

        /* From now on it may send fds (the listener refused them). */
        if (s->reg->fds_after_welcome && !s->admin &&
            setsockopt(s->fd, SOL_SOCKET, SESSION_SO_PASSRIGHTS, &on, sizeof(on)) == 0)
                s->fds_allowed = true;
        copy_printable(s->name, sizeof(s->name), client_name);
        s->features = features;
        session_state_set(s, SESSION_HELLO);
        event_del(s->ev_hello);
}

static void sessions_reap_cb(evutil_socket_t fd, short what, void *arg) {
        sessions_reap(arg);
}

int sessions_new(struct event_base *base, const struct config *config, struct clientfds *clientfds,
                 struct metrics *metrics, session_dispatch_fn *dispatch, void *dispatch_ctx,
                 struct sessions **ret) {
        struct sessions *reg = calloc(1, sizeof(*reg));

        if (!reg)
                return -ENOMEM;
        reg->base = base;
        reg->config = config;
        reg->clientfds = clientfds;
        reg->metrics = metrics;
        reg->dispatch = dispatch;
        reg->dispatch_ctx = dispatch_ctx;
        reg->next_id = 1;
        TAILQ_INIT(&reg->list);
        TAILQ_INIT(&reg->dead);
        TAILQ_INIT(&reg->throttled);
        uids_init(&reg->uids);
        reg->ev_reap = event_new(base, -1, 0, sessions_reap_cb, reg);
        reg->ev_throttle = evtimer_new(base, sessions_hold_cb, reg);
        if (!reg->ev_reap || !reg->ev_throttle) {
                if (reg->ev_reap)
                        event_free(reg->ev_reap);
                free(reg);
                return -ENOMEM;
        }
        *ret = reg;
        return 0;
}

void sessions_free(struct sessions *reg) {
        if (!reg)
                return;
        /* A session still referenced here is leaked rather than freed
         * under its holder, as before the registry had its own object. */
        event_free(reg->ev_reap);
        event_free(reg->ev_throttle);
        uids_done(&reg->uids);
        free(reg);
}

/* ------------------------------------------------------------ sessions held back */

/* A record whose fds do not fit yet, while closes that would make room are
 * under way, is tried again every SESSION_FDS_RETRY_US for at most
 * SESSION_FDS_WAIT_MS; then the session ends. */
#define SESSION_FDS_RETRY_US 2000
#define SESSION_FDS_WAIT_MS 1000
/* Held sessions (throttled, or waiting for fds) are looked at again at
 * least this often. */
#define SESSION_HOLD_TICK_US 5000

/* CPU time of the loop thread, in microseconds: what handling a record
 * cost, whatever else ran on the machine meanwhile. */
static uint64_t session_thread_cpu_us(void) {
        struct timespec ts;

        clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
        return (uint64_t)ts.tv_sec * 1000000u + (uint64_t)ts.tv_nsec / 1000u;
}

/* Arms the registry's timer that reads held sessions again, at most
 * SESSION_HOLD_TICK_US away. */
static void sessions_hold_arm(struct sessions *reg, uint64_t wait_us) {
        struct timeval tv;

        if (wait_us > SESSION_HOLD_TICK_US)
                wait_us = SESSION_HOLD_TICK_US;
        tv = (struct timeval){ .tv_sec = 0, .tv_usec = (suseconds_t)wait_us };
        if (!evtimer_pending(reg->ev_throttle, NULL))
                evtimer_add(reg->ev_throttle, &tv);
}

/* Stops reading `s` until `until_us` has come and its uid's share of the
 * loop has grown back (sessions_hold_cb). */
static void session_hold(struct session *s, uint64_t until_us) {
        struct sessions *reg = s->reg;
        uint64_t now = uids_now_us(), wait = uid_loop_wait_us(s->uid_state, now);

        if (until_us > now && until_us - now > wait)
                wait = until_us - now;
        if (!s->uid_state->throttled && !uid_loop_ok(s->uid_state, now))
                log_debug("uid %u: its share of the loop is spent: its sessions wait %" PRIu64 " us",
                          (unsigned)s->cred.uid, wait);
        s->uid_state->throttled = true;
        s->throttled = true;
        s->hold_until_us = until_us;
        reg->throttles++;
        event_del(s->ev_read);
        TAILQ_INSERT_TAIL(&reg->throttled, s, throttle_entry);
        sessions_hold_arm(reg, wait);
}

/* Takes `s` off the held list (it closes, or is read again). */
static void session_unhold(struct session *s) {
        if (!s->throttled)
                return;
        TAILQ_REMOVE(&s->reg->throttled, s, throttle_entry);
        s->throttled = false;
        if (s->uid_state)
                s->uid_state->throttled = false;
}

/* The registry's ev_throttle: reads held sessions again when they may. */
static void sessions_hold_cb(evutil_socket_t fd, short what, void *arg) {
        struct sessions *reg = arg;
        uint64_t now = uids_now_us(), wait = UINT64_MAX;
        struct session *s, *next;

        for (s = TAILQ_FIRST(&reg->throttled); s; s = next) {
                next = TAILQ_NEXT(s, throttle_entry);
                if (now < s->hold_until_us || !uid_loop_ok(s->uid_state, now)) {
                        uint64_t w = uid_loop_wait_us(s->uid_state, now);

                        if (now < s->hold_until_us && s->hold_until_us - now > w)
                                w = s->hold_until_us - now;
                        wait = w < wait ? w : wait;
                        continue;
                }
                session_unhold(s);
                session_resume(s);
        }
        if (wait != UINT64_MAX)
                sessions_hold_arm(reg, wait);
}

/* A record whose fds did not fit was dropped unread (clientfd.h): refused
 * as its framing would have been (a record of zero bytes reads as the end,
 * descriptors its type may not carry are ERROR_BAD_FDS and end the
 * session), else with ERROR_LIMIT_EXCEEDED, and the session reads on. */
static void session_discarded(void *ctx, const struct moeep_record_header *hdr, long len,
                              const char *errmsg) {
        struct session *s = ctx;
        uint64_t rid = hdr && hdr->magic == MOEEP_RECORD_MAGIC ? hdr->request_id : 0;
        int expected = hdr ? moeep_record_fds_expected(hdr->type) : 0;

        if (s->state == SESSION_CLOSED) {
                session_unref(s);
                return;
        }
        if (len <= 0)
                session_fail(s, 0, 0, len == 0 ? "peer closed the connection" : "receiving: %s",
                             strerror((int)-len));
        else if (!hdr || hdr->magic != MOEEP_RECORD_MAGIC)
                session_fail(s, MOEEP__V1__ERROR_CODE__ERROR_BAD_RECORD, 0, "bad record: %s",
                             hdr ? "bad magic" : "record shorter than its header");
        else if (hdr->nfds > MOEEP_RECORD_MAX_FDS || (expected >= 0 && hdr->nfds != expected) ||
                 (expected == MOEEP_FDS_ONE_OR_NONE && hdr->nfds > 1))
                session_fail(s, MOEEP__V1__ERROR_CODE__ERROR_BAD_FDS, rid,
                             "bad record: %" PRIu16 " descriptors on a record of type %" PRIu16
                             ", dropped unread: %s",
                             hdr->nfds, hdr->type, errmsg);
        else {
                log_info("session %" PRIu64 " (pid %d uid %u): request %" PRIu64 " refused unread: %s", s->id,
                         (int)s->cred.pid, (unsigned)s->cred.uid, rid, errmsg);
                session_send_error(s, rid, MOEEP__V1__ERROR_CODE__ERROR_LIMIT_EXCEEDED, errmsg);
                session_resume(s);
        }
        session_unref(s);
}

/* Before reading a record of `s`: 1 to read it, or 0 when it is not read
 * now: `s` is held (fds that would make room are being closed), or the
 * record is being refused unread (its fds released by a closer, never
 * taken; the session is paused until then), or `s` failed. */
static int session_read_admitted(struct session *s) {
        char errmsg[ERRMSG_MAX];
        int r;

        /* A record may bring up to 253 fds: read only while they fit its
         * uid's cap and the daemon's budget, or when it brings none. While
         * closes that would make room are under way, it waits a moment; a
         * uid whose fds do not close (its own FUSE server) gets nothing
         * more. */
        r = clientfds_read_check(s->reg->clientfds, s->cred.uid, s->fd, errmsg);
        if (r == -EAGAIN && s->uid_state) {
                uint64_t now = uids_now_us();

                if (!s->fds_wait_since_us)
                        s->fds_wait_since_us = now;
                if (now - s->fds_wait_since_us < SESSION_FDS_WAIT_MS * 1000u) {
                        session_hold(s, now + SESSION_FDS_RETRY_US);
                        return 0;
                }
        }
        s->fds_wait_since_us = 0;
        /* Refused unread: a closer drops it, its fds never taken, and the
         * session goes on once that is done (session_discarded()). */
        if (r < 0) {
                session_ref(s);
                session_pause(s);
                if (clientfd_discard_record(s->reg->clientfds, s->cred.uid, s->fd, errmsg, session_discarded,
                                            s) < 0) {
                        session_resume(s);
                        session_unref(s);
                        session_fail(s, MOEEP__V1__ERROR_CODE__ERROR_LIMIT_EXCEEDED, 0, "%s", errmsg);
                }
                return 0;
        }
        return 1;
}
