/* Sessions: one per client connection; see session.h. */
#include <errno.h>
#include <event2/event.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "admin.h"
#include "broker.h"
#include "clientfd.h"
#include "daemon.h"
#include "datapath.h"
#include "errors.h"
#include "log.h"
#include "moeep-config.h"
#include "query.h"
#include "record.h"
#include "mesh-jobs.h"
#include "mesh.h"
#include "session.h"

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

/* Features this daemon offers in Welcome. */
#define SESSION_FEATURES                                                                               \
        ((uint64_t)MOEEP__V1__FEATURE__FEATURE_REGIONS |                                               \
         (uint64_t)MOEEP__V1__FEATURE__FEATURE_CONTROL_PAGE |                                          \
         (uint64_t)MOEEP__V1__FEATURE__FEATURE_OPERATOR | (uint64_t)MOEEP__V1__FEATURE__FEATURE_MESH | \
         (uint64_t)MOEEP__V1__FEATURE__FEATURE_PROXY)

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

/* The protocol's code for a handler's refusal: errors.h decides, in one
 * table, so that an errno from a system call is never read as a refusal
 * that means something else (EACCES from mmap() is not a bad secret). */
Moeep__V1__ErrorCode session_error_code(int r) {
        return error_code(r);
}

/* moeep_record_recv() names what was wrong only in text; descriptor
 * problems get their own code so clients can tell them apart. */
static Moeep__V1__ErrorCode record_error_code(const char *why) {
        if (!why)
                return MOEEP__V1__ERROR_CODE__ERROR_BAD_RECORD;
        if (strcmp(why, "unknown record type") == 0)
                return MOEEP__V1__ERROR_CODE__ERROR_UNKNOWN_TYPE;
        if (strstr(why, "descriptor"))
                return MOEEP__V1__ERROR_CODE__ERROR_BAD_FDS;
        return MOEEP__V1__ERROR_CODE__ERROR_BAD_RECORD;
}

/* ------------------------------------------------------------ output */

/* Frees a record taken off the queue. Its duplicates may be the last
 * references to files a client sent (a region released meanwhile), so
 * they are closed off the loop; their charge goes with them. */
static void out_free(struct session *s, struct session_out *o) {
        for (size_t i = 0; i < o->nfds; i++)
                clientfd_close(s->daemon->clientfds, s->cred.uid, o->fds[i]);
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
                clientfd_close(s->daemon->clientfds, s->cred.uid, rec->fds[i]);
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
                r = clientfds_charge(s->daemon->clientfds, s->cred.uid, (uint32_t)nfds, send_why);
                if (r < 0)
                        return r;
        }
        o = malloc(sizeof(*o) + (size_t)len);
        if (!o) {
                clientfds_uncharge(s->daemon->clientfds, s->cred.uid, (uint32_t)nfds);
                return -ENOMEM;
        }
        memcpy(o->buf, scratch, (size_t)len);
        o->len = (size_t)len;
        s->out_fds += (uint32_t)nfds;
        for (o->nfds = 0; o->nfds < nfds; o->nfds++) {
                o->fds[o->nfds] = fcntl(fds[o->nfds], F_DUPFD_CLOEXEC, 3);
                if (o->fds[o->nfds] < 0) {
                        int r = -errno;

                        clientfds_uncharge(s->daemon->clientfds, s->cred.uid, (uint32_t)(nfds - o->nfds));
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

int session_send_error(struct session *s, uint64_t request_id, int code, const char *message) {
        Moeep__V1__Error err = MOEEP__V1__ERROR__INIT;
        Moeep__V1__Response resp = MOEEP__V1__RESPONSE__INIT;

        err.code = code;
        err.message = (char *)message;
        resp.body_case = MOEEP__V1__RESPONSE__BODY_ERROR;
        resp.error = &err;
        metrics_count_error(&s->daemon->metrics, code);
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
                event_active(s->daemon->ev_reap, EV_TIMEOUT, 0);
}

static void session_free(struct session *s) {
        out_clear(s);
        clientfd_close_session(s->daemon->clientfds, s->cred.uid, s->fd);
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

void sessions_reap(struct daemon *d) {
        struct session *s, *next;

        for (s = TAILQ_FIRST(&d->dead); s; s = next) {
                next = TAILQ_NEXT(s, entry);
                if (s->references > 0)
                        continue;
                TAILQ_REMOVE(&d->dead, s, entry);
                session_free(s);
        }
}

/* Leaves the job (as a lost rank when `lost`) and gives up the jobs this
 * session created. */
static void session_detach(struct session *s, bool lost, const char *reason) {
        struct daemon *d = s->daemon;

        if (s->member) {
                datapath_member_gone(d->datapath, s->member);
                broker_drop_member(d->broker, s->member);
                mesh_jobs_member_gone(d->mesh_jobs, s->member, lost, reason);
                if (lost)
                        job_member_lost(s->member, reason);
                else
                        job_member_leave(s->member);
                s->member = NULL;
        }
        jobs_creator_gone(d->jobs, s);
        daemon_status_changed(d);
}

void session_close_now(struct session *s) {
        struct daemon *d = s->daemon;

        if (s->fd < 0)
                return;
        s->state = SESSION_CLOSED;
        event_del(s->ev_read);
        event_del(s->ev_write);
        event_del(s->ev_linger);
        event_del(s->ev_hello);
        out_clear(s);
        /* Closing the socket closes what the peer queued on it unread,
         * fds it attached included: off the loop. */
        clientfd_close_session(d->clientfds, s->cred.uid, s->fd);
        s->fd = -1;
        TAILQ_REMOVE(&d->sessions, s, entry);
        d->nsessions--;
        d->nadmin -= s->admin;
        TAILQ_INSERT_TAIL(&d->dead, s, entry);
        daemon_status_changed(d);
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
        session_detach(s, true, why);
        s->state = SESSION_CLOSED;
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

/* ------------------------------------------------------------ requests */

/* Copies a client-chosen string for display: at most `size - 1` bytes,
 * non-printable bytes replaced. */
static void copy_printable(char *dst, size_t size, const char *src) {
        size_t i;

        for (i = 0; i + 1 < size && src && src[i]; i++)
                dst[i] = (src[i] >= 0x20 && src[i] <= 0x7e) ? src[i] : '?';
        dst[i] = '\0';
}

static int handle_hello(struct session *s, uint64_t rid, const Moeep__V1__Request *req,
                        struct moeep_record *rec, char *errmsg) {
        const Moeep__V1__Hello *hello = req->hello;
        Moeep__V1__Welcome welcome = MOEEP__V1__WELCOME__INIT;
        Moeep__V1__Response resp = MOEEP__V1__RESPONSE__INIT;

        if (s->state != SESSION_NEW)
                return errmsg_set(errmsg, -EINVAL, "session %" PRIu64 ": Hello already received", s->id);
        if (hello->major != MOEEP_PROTOCOL_MAJOR) {
                session_fail(s, MOEEP__V1__ERROR_CODE__ERROR_VERSION_MISMATCH, rid,
                             "Hello with protocol major %" PRIu32 ": the daemon speaks %d", hello->major,
                             MOEEP_PROTOCOL_MAJOR);
                return 0;
        }
        copy_printable(s->name, sizeof(s->name), hello->client_name);
        s->features = hello->features & SESSION_FEATURES;
        s->state = SESSION_HELLO;
        event_del(s->ev_hello);
        log_info("session %" PRIu64 " (pid %d uid %u gid %u): hello from '%s', protocol %" PRIu32 ".%" PRIu32,
                 s->id, (int)s->cred.pid, (unsigned)s->cred.uid, (unsigned)s->cred.gid, s->name, hello->major,
                 hello->minor);

        welcome.major = MOEEP_PROTOCOL_MAJOR;
        welcome.minor = MOEEP_PROTOCOL_MINOR;
        welcome.features = s->features;
        welcome.daemon_version = (char *)MOEEP_VERSION;
        welcome.session_id = s->id;
        resp.body_case = MOEEP__V1__RESPONSE__BODY_WELCOME;
        resp.welcome = &welcome;
        return session_respond(s, rid, &resp, NULL, 0);
}

static int handle_job_create(struct session *s, uint64_t rid, const Moeep__V1__Request *req,
                             struct moeep_record *rec, char *errmsg) {
        const Moeep__V1__JobCreate *jc = req->job_create;
        Moeep__V1__JobCreated created = MOEEP__V1__JOB_CREATED__INIT;
        Moeep__V1__Response resp = MOEEP__V1__RESPONSE__INIT;
        uint8_t uid[MOEEP_UNIQUE_ID_BYTES];
        struct job *job;
        int r;

        if (s->daemon->stopping)
                return errmsg_set(errmsg, -ESHUTDOWN, "the daemon is shutting down: no new jobs");
        if (s->daemon->draining)
                return errmsg_set(errmsg, -ESHUTDOWN,
                                  "the daemon is draining: no new jobs (an admin ends it with "
                                  "'moeepctl drain --off')");
        r = jobs_create(s->daemon->jobs, jc->name, jc->world_size, s->cred.uid, s, &job, errmsg);
        if (r < 0)
                return r;
        s->daemon->metrics.jobs_created++;
        log_info("session %" PRIu64 " (uid %u): created job %" PRIu64 " '%s' of %" PRIu32 " ranks", s->id,
                 (unsigned)s->cred.uid, job->id, job->name, job->world_size);
        daemon_status_changed(s->daemon);

        created.unique_id.data = uid;
        created.unique_id.len = job_unique_id_with_node(job, mesh_address(s->daemon->mesh), uid);
        created.job_id = job->id;
        resp.body_case = MOEEP__V1__RESPONSE__BODY_JOB_CREATED;
        resp.job_created = &created;
        r = session_respond(s, rid, &resp, NULL, 0);
        explicit_bzero(uid, sizeof(uid));
        return r;
}

static int handle_job_join(struct session *s, uint64_t rid, const Moeep__V1__Request *req,
                           struct moeep_record *rec, char *errmsg) {
        const Moeep__V1__JobJoin *jj = req->job_join;
        const char *here = mesh_address(s->daemon->mesh);
        char home[JOB_NODE_MAX + 1];
        struct job_member *m;
        int r;

        if (s->member)
                return errmsg_set(errmsg, -EISCONN,
                                  "session %" PRIu64 " is already rank %" PRIu32 " of job %" PRIu64, s->id,
                                  s->member->rank, s->member->job->id);
        /* A job created at another daemon is joined there (mesh-jobs.c); this
         * daemon named in any spelling is this daemon. */
        if (job_unique_id_node(jj->unique_id.data, jj->unique_id.len, home) == 0 && home[0] &&
            (!here || !mesh_address_is_self(s->daemon->mesh, home)))
                return mesh_jobs_join_forward(s->daemon->mesh_jobs, s, rid, jj, home, errmsg);
        r = jobs_join(s->daemon->jobs, jj->unique_id.data, jj->unique_id.len, jj->rank, jj->world_size,
                      jj->gpu_uuid, s, &m, errmsg);
        if (r < 0)
                return r;
        r = session_joined(s, rid, m);
        mesh_jobs_changed(s->daemon->mesh_jobs, m->job);
        return r;
}

int session_joined(struct session *s, uint64_t rid, struct job_member *m) {
        Moeep__V1__JobJoined joined = MOEEP__V1__JOB_JOINED__INIT;
        Moeep__V1__Response resp = MOEEP__V1__RESPONSE__INIT;
        int fd;

        s->member = m;
        s->state = SESSION_READY;
        log_info("session %" PRIu64 " (pid %d uid %u): joined job %" PRIu64 " as rank %" PRIu32 "/%" PRIu32
                 " gpu '%s' (%s%s%s)",
                 s->id, (int)s->cred.pid, (unsigned)s->cred.uid, m->job->id, m->rank, m->job->world_size,
                 m->gpu_uuid, job_state_to_string(m->job->state), m->job->home[0] ? ", home " : "",
                 m->job->home);

        joined.job_id = m->job->id;
        joined.world_size = m->job->world_size;
        joined.rank = m->rank;
        resp.body_case = MOEEP__V1__RESPONSE__BODY_JOB_JOINED;
        resp.job_joined = &joined;
        fd = job_control_fd(m->job);
        return session_respond(s, rid, &resp, &fd, 1);
}

static int handle_job_leave(struct session *s, uint64_t rid, const Moeep__V1__Request *req,
                            struct moeep_record *rec, char *errmsg) {
        log_info("session %" PRIu64 ": left job %" PRIu64 " (rank %" PRIu32 ")", s->id, s->member->job->id,
                 s->member->rank);
        datapath_member_gone(s->daemon->datapath, s->member);
        broker_drop_member(s->daemon->broker, s->member);
        mesh_jobs_member_gone(s->daemon->mesh_jobs, s->member, false, "left");
        job_member_leave(s->member);
        s->member = NULL;
        s->state = SESSION_HELLO;
        return session_send_ok(s, rid);
}

static int handle_barrier(struct session *s, uint64_t rid, const Moeep__V1__Request *req,
                          struct moeep_record *rec, char *errmsg) {
        /* 0: the reply comes from session_barrier_done(); 1: from the
         * job's home daemon, through the mesh. */
        int r = job_barrier(s->member, rid, errmsg);

        if (r == 1) {
                mesh_jobs_barrier(s->daemon->mesh_jobs, s->member);
                r = 0;
        }
        return r;
}

static int handle_region_register(struct session *s, uint64_t rid, const Moeep__V1__Request *req,
                                  struct moeep_record *rec, char *errmsg) {
        const Moeep__V1__RegionRegister *rr = req->region_register;
        Moeep__V1__RegionRegistered registered = MOEEP__V1__REGION_REGISTERED__INIT;
        Moeep__V1__Response resp = MOEEP__V1__RESPONSE__INIT;
        int r;

        if (rr->proxy != MOEEP__V1__PROXY_ROLE__PROXY_ROLE_NONE) {
                /* Rule 5 of proto/README.md for a field: only after the
                 * feature was agreed. */
                if (!(s->features & MOEEP__V1__FEATURE__FEATURE_PROXY))
                        return errmsg_set(errmsg, -EINVAL,
                                          "RegionRegister: proxy role %d, but session %" PRIu64
                                          " did not offer FEATURE_PROXY in Hello",
                                          (int)rr->proxy, s->id);
                r = datapath_region_register(s->daemon->datapath, s->daemon->broker, s->member, s->cred.uid,
                                             rr, &rec->fds[0], &registered.region_id, errmsg);
        } else {
                r = broker_register(s->daemon->broker, s->member, s->cred.uid, rr->kind, rr->size, rr->tag,
                                    rec->fds[0], &registered.region_id, errmsg);
                if (r == 0)
                        mesh_jobs_region_changed(s->daemon->mesh_jobs, s->member, registered.region_id, rr->tag,
                                            (uint32_t)rr->kind, rr->size, false, 0, NULL);
        }
        if (r < 0)
                return r;
        rec->fds[0] = -1; /* the broker owns it now */
        s->daemon->metrics.regions_registered++;
        resp.body_case = MOEEP__V1__RESPONSE__BODY_REGION_REGISTERED;
        resp.region_registered = &registered;
        return session_respond(s, rid, &resp, NULL, 0);
}

static int handle_regions_fetch(struct session *s, uint64_t rid, const Moeep__V1__Request *req,
                                struct moeep_record *rec, char *errmsg) {
        const Moeep__V1__RegionsFetch *rf = req->regions_fetch;
        Moeep__V1__RegionInfo infos[MOEEP_RECORD_MAX_FDS];
        Moeep__V1__RegionInfo *ptrs[MOEEP_RECORD_MAX_FDS];
        Moeep__V1__Regions regions = MOEEP__V1__REGIONS__INIT;
        Moeep__V1__Response resp = MOEEP__V1__RESPONSE__INIT;
        int fds[MOEEP_RECORD_MAX_FDS];
        const struct job *job = s->member->job;
        const struct job_remote_region *remote;
        struct region **found = NULL;
        size_t n = 0, nfds;
        uint32_t nremote;
        int r;

        r = broker_fetch(s->member, rf->rank, rf->tag, MOEEP_RECORD_MAX_FDS, &found, &n, errmsg);
        if (r < 0)
                return r;
        for (size_t i = 0; i < n; i++) {
                moeep__v1__region_info__init(&infos[i]);
                infos[i].rank = found[i]->owner->rank;
                infos[i].tag = found[i]->tag;
                infos[i].kind = found[i]->kind;
                infos[i].size = found[i]->size;
                infos[i].region_id = found[i]->id;
                ptrs[i] = &infos[i];
                fds[i] = found[i]->fd;
        }
        free(found);
        nfds = n;
        /* Ranks at other daemons: metadata only, to clients that know the
         * field (their memory is reached through the transports). */
        remote = mesh_jobs_remote_regions(job, &nremote);
        for (uint32_t i = 0; i < nremote && (s->features & MOEEP__V1__FEATURE__FEATURE_MESH); i++) {
                const struct job_remote_region *rr = &remote[i];

                if ((rf->rank >= 0 ? rr->rank != (uint32_t)rf->rank : rr->rank == s->member->rank) ||
                    (rf->tag >= 0 && rr->tag != (uint64_t)rf->tag))
                        continue;
                if (n == MOEEP_RECORD_MAX_FDS)
                        return errmsg_set(errmsg, -E2BIG,
                                          "more than %d regions match (rank %" PRId32 ", tag %" PRId64 ")",
                                          MOEEP_RECORD_MAX_FDS, rf->rank, rf->tag);
                moeep__v1__region_info__init(&infos[n]);
                infos[n].rank = rr->rank;
                infos[n].tag = rr->tag;
                infos[n].kind = (Moeep__V1__RegionKind)rr->kind;
                infos[n].size = rr->size;
                infos[n].region_id = rr->region_id;
                infos[n].remote = true;
                ptrs[n] = &infos[n];
                n++;
        }
        regions.n_regions = n;
        regions.regions = ptrs;
        resp.body_case = MOEEP__V1__RESPONSE__BODY_REGIONS;
        resp.regions = &regions;
        r = session_respond(s, rid, &resp, fds, nfds);
        if (r == -EDQUOT || r == -EMFILE) /* a cap of the uid or the daemon's budget: both a limit to the client */
                return errmsg_set(errmsg, -EDQUOT, "RegionsFetch: %s", send_why);
        return r;
}

static int handle_region_release(struct session *s, uint64_t rid, const Moeep__V1__Request *req,
                                 struct moeep_record *rec, char *errmsg) {
        uint64_t id = req->region_release->region_id;
        int r = datapath_region_release(s->daemon->datapath, s->member, id, errmsg);

        if (r == 0)
                r = broker_release(s->daemon->broker, s->member, id, errmsg);
        if (r < 0)
                return r;
        mesh_jobs_region_changed(s->daemon->mesh_jobs, s->member, id, 0, 0, 0, true, 0, NULL);
        return session_send_ok(s, rid);
}

static int handle_status_get(struct session *s, uint64_t rid, const Moeep__V1__Request *req,
                             struct moeep_record *rec, char *errmsg) {
        return query_status(s, rid, errmsg);
}

static int handle_jobs_list(struct session *s, uint64_t rid, const Moeep__V1__Request *req,
                            struct moeep_record *rec, char *errmsg) {
        return query_jobs(s, rid, errmsg);
}

static int handle_clients_list(struct session *s, uint64_t rid, const Moeep__V1__Request *req,
                               struct moeep_record *rec, char *errmsg) {
        return query_clients(s, rid, errmsg);
}

static int handle_metrics_get(struct session *s, uint64_t rid, const Moeep__V1__Request *req,
                              struct moeep_record *rec, char *errmsg) {
        return query_metrics(s, rid, errmsg);
}

static int handle_nics_list(struct session *s, uint64_t rid, const Moeep__V1__Request *req,
                            struct moeep_record *rec, char *errmsg) {
        return query_nics(s, rid, errmsg);
}

static int handle_log_level_set(struct session *s, uint64_t rid, const Moeep__V1__Request *req,
                                struct moeep_record *rec, char *errmsg) {
        return admin_log_level_set(s, rid, req->log_level_set->level, errmsg);
}

static int handle_drain(struct session *s, uint64_t rid, const Moeep__V1__Request *req,
                        struct moeep_record *rec, char *errmsg) {
        return admin_drain(s, rid, req->drain->on, errmsg);
}

static int handle_mesh_list(struct session *s, uint64_t rid, const Moeep__V1__Request *req,
                            struct moeep_record *rec, char *errmsg) {
        return query_mesh(s, rid, errmsg);
}

static int handle_channel_open(struct session *s, uint64_t rid, const Moeep__V1__Request *req,
                               struct moeep_record *rec, char *errmsg) {
        Moeep__V1__ChannelOpened opened = MOEEP__V1__CHANNEL_OPENED__INIT;
        Moeep__V1__Response resp = MOEEP__V1__RESPONSE__INIT;
        int fd, r;

        r = datapath_channel_open(s->daemon->datapath, s->member, req->channel_open->capacity, &fd,
                                  &opened.ring_id, &opened.capacity, errmsg);
        if (r < 0)
                return r;
        opened.routes = s->member->job->world_size;
        resp.body_case = MOEEP__V1__RESPONSE__BODY_CHANNEL_OPENED;
        resp.channel_opened = &opened;
        /* The session sends a duplicate; the proxy mapped the ring already.
         * A ring the client never receives goes when its member goes. */
        r = session_respond(s, rid, &resp, &fd, 1);
        close(fd);
        if (r == -EDQUOT || r == -EMFILE)
                return errmsg_set(errmsg, -EDQUOT, "ChannelOpen: %s", send_why);
        return r;
}

/* The dispatch table, indexed by request type (= Request body case). A
 * handler returns 0 once it queued its reply (or when the reply is held
 * back, Barrier), or -errno with `errmsg` filled, which the dispatcher turns
 * into Error. */
static const struct handler {
        const char *name;
        bool needs_job;   /* answered ERROR_NOT_IN_JOB outside a job */
        uint64_t feature; /* FEATURE_* bit the session's Hello must have had, 0 for none */
        int (*fn)(struct session *s, uint64_t rid, const Moeep__V1__Request *req, struct moeep_record *rec,
                  char *errmsg);
} handlers[MOEEP_TYPE_REQUEST_MAX + 1] = {
        [MOEEP__V1__REQUEST__BODY_HELLO] = { "Hello", false, 0, handle_hello },
        [MOEEP__V1__REQUEST__BODY_JOB_CREATE] = { "JobCreate", false, 0, handle_job_create },
        [MOEEP__V1__REQUEST__BODY_JOB_JOIN] = { "JobJoin", false, 0, handle_job_join },
        [MOEEP__V1__REQUEST__BODY_JOB_LEAVE] = { "JobLeave", true, 0, handle_job_leave },
        [MOEEP__V1__REQUEST__BODY_BARRIER] = { "Barrier", true, 0, handle_barrier },
        [MOEEP__V1__REQUEST__BODY_REGION_REGISTER] = { "RegionRegister", true, 0, handle_region_register },
        [MOEEP__V1__REQUEST__BODY_REGIONS_FETCH] = { "RegionsFetch", true, 0, handle_regions_fetch },
        [MOEEP__V1__REQUEST__BODY_STATUS_GET] = { "StatusGet", false, 0, handle_status_get },
        [MOEEP__V1__REQUEST__BODY_JOBS_LIST] = { "JobsList", false, 0, handle_jobs_list },
        [MOEEP__V1__REQUEST__BODY_CLIENTS_LIST] = { "ClientsList", false, 0, handle_clients_list },
        [MOEEP__V1__REQUEST__BODY_REGION_RELEASE] = { "RegionRelease", true, 0, handle_region_release },
        [MOEEP__V1__REQUEST__BODY_METRICS_GET] = { "MetricsGet", false, MOEEP__V1__FEATURE__FEATURE_OPERATOR,
                                                   handle_metrics_get },
        [MOEEP__V1__REQUEST__BODY_NICS_LIST] = { "NicsList", false, MOEEP__V1__FEATURE__FEATURE_OPERATOR,
                                                 handle_nics_list },
        [MOEEP__V1__REQUEST__BODY_LOG_LEVEL_SET] = { "LogLevelSet", false,
                                                     MOEEP__V1__FEATURE__FEATURE_OPERATOR,
                                                     handle_log_level_set },
        [MOEEP__V1__REQUEST__BODY_DRAIN] = { "Drain", false, MOEEP__V1__FEATURE__FEATURE_OPERATOR,
                                             handle_drain },
        [MOEEP__V1__REQUEST__BODY_MESH_LIST] = { "MeshList", false, MOEEP__V1__FEATURE__FEATURE_MESH,
                                                 handle_mesh_list },
        [MOEEP__V1__REQUEST__BODY_CHANNEL_OPEN] = { "ChannelOpen", true, MOEEP__V1__FEATURE__FEATURE_PROXY,
                                                    handle_channel_open },
};

/* Handles one received record. Returns 1 to go on reading, 0 when the
 * session failed. */
static int session_dispatch(struct session *s, struct moeep_record *rec) {
        uint16_t type = rec->hdr.type;
        uint64_t rid = rec->hdr.request_id;
        char errmsg[ERRMSG_MAX] = "";
        const struct handler *h;
        Moeep__V1__Request *req;
        int r;

        /* moeep_record_recv() let only known types through: a response or
         * event type from a client is a known message in the wrong place. */
        if (type < MOEEP_TYPE_REQUEST_MIN || type > MOEEP_TYPE_REQUEST_MAX) {
                session_fail(s, MOEEP__V1__ERROR_CODE__ERROR_BAD_RECORD, rid,
                             "record type %u is a response or event, not a request", type);
                return 0;
        }
        if (!handlers[type].fn) {
                session_fail(s, MOEEP__V1__ERROR_CODE__ERROR_UNKNOWN_TYPE, rid,
                             "request type %u is not known", type);
                return 0;
        }
        h = &handlers[type];
        s->daemon->metrics.requests[type]++;
        if (s->state == SESSION_NEW && type != MOEEP__V1__REQUEST__BODY_HELLO) {
                session_fail(s, MOEEP__V1__ERROR_CODE__ERROR_NOT_WELCOMED, rid,
                             "%s (request %" PRIu64 ") before Hello", h->name, rid);
                return 0;
        }
        req = moeep_record_decode_request(rec);
        if (!req) {
                session_fail(s, MOEEP__V1__ERROR_CODE__ERROR_BAD_RECORD, rid,
                             "%s request (type %u) of %" PRIu32 " payload bytes does not decode", h->name,
                             type, rec->hdr.length);
                return 0;
        }
        if (h->needs_job && !s->member)
                r = errmsg_set(errmsg, -ENOTCONN, "%s: session %" PRIu64 " is not in a job", h->name, s->id);
        else if ((s->features & h->feature) != h->feature)
                /* Rule 5 of proto/README.md: the Hello did not offer it. */
                r = errmsg_set(errmsg, -EINVAL,
                               "%s: session %" PRIu64 " did not offer feature bit %" PRIu64 " in Hello",
                               h->name, s->id, h->feature);
        else
                r = h->fn(s, rid, req, rec, errmsg);
        if (r < 0 && s->state != SESSION_CLOSED) {
                if (!errmsg[0])
                        snprintf(errmsg, sizeof(errmsg), "%s: %s", h->name, strerror(-r));
                log_debug("session %" PRIu64 ": %s (request %" PRIu64 ") refused: %s", s->id, h->name, rid,
                          errmsg);
                if (r == -ENOBUFS || session_send_error(s, rid, session_error_code(r), errmsg) < 0)
                        log_debug("session %" PRIu64 ": could not queue the error for request %" PRIu64,
                                  s->id, rid);
        }
        moeep__v1__request__free_unpacked(req, NULL);
        return s->state != SESSION_CLOSED;
}

/* Receives and handles one record. Returns 1 to go on, 0 to stop. */
static int session_read_one(struct session *s) {
        char errmsg[ERRMSG_MAX];
        const char *why = NULL;
        uint64_t rid;
        int r;

        /* A uid whose fds do not close (its own FUSE server, SO_LINGER)
         * gets nothing more read: each record could bring 253 more. */
        if (clientfds_closing_check(s->daemon->clientfds, s->cred.uid, errmsg) < 0) {
                session_fail(s, MOEEP__V1__ERROR_CODE__ERROR_LIMIT_EXCEEDED, 0, "%s", errmsg);
                return 0;
        }
        memset(&rx.hdr, 0, sizeof(rx.hdr));
        r = moeep_record_recv_keep(s->fd, &rx, &why);
        /* Whatever arrived is the daemon's to close now, and the sender's
         * to pay for until it is closed. */
        clientfds_charge_held(s->daemon->clientfds, s->cred.uid, (uint32_t)rx.nfds);
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
                session_fail(s, record_error_code(why), rid, "bad record: %s", why ? why : "malformed");
                return 0;
        default: /* -errno from recvmsg */
                session_fail(s, 0, 0, "receiving: %s", strerror(-r));
                return 0;
        }
        r = session_dispatch(s, &rx);
        session_release_fds(s, &rx);
        return r;
}

static void session_read_cb(evutil_socket_t fd, short what, void *arg) {
        struct session *s = arg;

        session_ref(s);
        for (int i = 0; i < SESSION_READ_BATCH && s->state != SESSION_CLOSED; i++)
                if (!session_read_one(s))
                        break;
        session_unref(s);
}

/* ------------------------------------------------------------ job callbacks */

static void session_barrier_done(void *owner, const struct job *job, uint64_t request_id, int error) {
        struct session *s = owner;
        char why[ERRMSG_MAX];

        if (error == 0) {
                session_send_ok(s, request_id);
                return;
        }
        if (error == -EPIPE)
                snprintf(why, sizeof(why), "barrier of job %" PRIu64 ": rank %" PRId32 " was lost", job->id,
                         job->lost_rank);
        else
                snprintf(why, sizeof(why), "barrier of job %" PRIu64 ": left the job while waiting", job->id);
        session_send_error(s, request_id, session_error_code(error), why);
}

static void session_peer_lost(void *owner, const struct job *job, uint32_t rank, const char *reason) {
        struct session *s = owner;
        Moeep__V1__PeerLost lost = MOEEP__V1__PEER_LOST__INIT;
        Moeep__V1__Event ev = MOEEP__V1__EVENT__INIT;

        /* The job is aborted: the proxy stops reading its channels. */
        datapath_member_aborted(s->daemon->datapath, s->member);
        if (s->daemon->stopping) /* everybody gets Shutdown instead */
                return;
        lost.job_id = job->id;
        lost.rank = rank;
        lost.reason = (char *)reason;
        ev.body_case = MOEEP__V1__EVENT__BODY_PEER_LOST;
        ev.peer_lost = &lost;
        session_send(s, MOEEP__V1__EVENT__BODY_PEER_LOST, 0, &ev.base, NULL, 0);
}

const struct job_callbacks session_job_callbacks = {
        .barrier_done = session_barrier_done,
        .peer_lost = session_peer_lost,
};

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
static uint32_t sessions_count_uid(const struct daemon *d, uid_t uid) {
        const struct session *s;
        uint32_t n = 0;

        TAILQ_FOREACH (s, &d->sessions, entry)
                n += s->cred.uid == uid && !s->admin;
        return n;
}

/* Turns a connection away with an error it can read, without making a
 * session: a fresh socket's buffer always takes one small record. */
static int session_refuse(struct daemon *d, int fd, uid_t uid, int r, const char *why) {
        Moeep__V1__Error err = MOEEP__V1__ERROR__INIT;
        Moeep__V1__Response resp = MOEEP__V1__RESPONSE__INIT;

        d->metrics.sessions_refused++;
        metrics_count_error(&d->metrics, MOEEP__V1__ERROR_CODE__ERROR_LIMIT_EXCEEDED);

        err.code = MOEEP__V1__ERROR_CODE__ERROR_LIMIT_EXCEEDED;
        err.message = (char *)why;
        resp.body_case = MOEEP__V1__RESPONSE__BODY_ERROR;
        resp.error = &err;
        (void)moeep_record_send(fd, MOEEP__V1__RESPONSE__BODY_ERROR, 0, &resp.base, NULL, 0);
        clientfd_close_session(d->clientfds, uid, fd);
        return r;
}

int session_new(struct daemon *d, int fd, bool admin, struct session **ret_session) {
        const struct timeval hello_deadline = { .tv_sec = SESSION_HELLO_DEADLINE_MS / 1000,
                                                .tv_usec = (SESSION_HELLO_DEADLINE_MS % 1000) * 1000 };
        char why[ERRMSG_MAX];
        struct session *s;
        struct ucred cred;
        socklen_t len = sizeof(cred);
        uint32_t n;

        if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) < 0) {
                int r = -errno;

                clientfd_close_session(d->clientfds, 65534, fd); /* whose it is is unknown: overflowuid */
                return r;
        }
        if (admin && d->nadmin >= DAEMON_ADMIN_SESSIONS_MAX) {
                snprintf(why, sizeof(why), "%" PRIu32 " admin sessions connected (at most %d)", d->nadmin,
                         DAEMON_ADMIN_SESSIONS_MAX);
                log_notice("refusing pid %d uid %u on the admin socket: %s", (int)cred.pid,
                           (unsigned)cred.uid, why);
                return session_refuse(d, fd, cred.uid, -EDQUOT, why);
        }
        /* Client sessions count against the daemon's fd budget, whose
         * reserve keeps accept() and the operator's sessions working. */
        if (!admin && (clientfds_budget_check(d->clientfds, d->nsessions + 1, why) < 0 ||
                       clientfds_closing_check(d->clientfds, cred.uid, why) < 0)) {
                log_notice("refusing pid %d uid %u: %s", (int)cred.pid, (unsigned)cred.uid, why);
                return session_refuse(d, fd, cred.uid, -EDQUOT, why);
        }
        if (!admin && d->nsessions - d->nadmin >= d->config.max_sessions) {
                snprintf(why, sizeof(why), "%" PRIu32 " sessions connected (max_sessions = %" PRIu32 ")",
                         d->nsessions - d->nadmin, d->config.max_sessions);
                log_notice("refusing pid %d uid %u: %s", (int)cred.pid, (unsigned)cred.uid, why);
                return session_refuse(d, fd, cred.uid, -EDQUOT, why);
        }
        n = admin ? 0 : sessions_count_uid(d, cred.uid);
        if (!admin && n >= d->config.max_sessions_per_uid) {
                snprintf(why, sizeof(why),
                         "uid %u has %" PRIu32 " sessions (max_sessions_per_uid = %" PRIu32 ")",
                         (unsigned)cred.uid, n, d->config.max_sessions_per_uid);
                log_notice("refusing pid %d: %s", (int)cred.pid, why);
                return session_refuse(d, fd, cred.uid, -EDQUOT, why);
        }

        s = calloc(1, sizeof(*s));
        if (!s) {
                clientfd_close_session(d->clientfds, cred.uid, fd);
                return -ENOMEM;
        }
        s->fd = fd;
        s->daemon = d;
        s->cred = cred;
        s->admin = admin;
        s->state = SESSION_NEW;
        s->references = 1;
        TAILQ_INIT(&s->out);
        s->ev_read = event_new(d->base, fd, EV_READ | EV_PERSIST, session_read_cb, s);
        s->ev_write = event_new(d->base, fd, EV_WRITE | EV_PERSIST, session_write_cb, s);
        s->ev_linger = evtimer_new(d->base, session_linger_cb, s);
        s->ev_hello = evtimer_new(d->base, session_hello_cb, s);
        if (!s->ev_read || !s->ev_write || !s->ev_linger || !s->ev_hello || event_add(s->ev_read, NULL) < 0 ||
            event_add(s->ev_hello, &hello_deadline) < 0) {
                session_free(s);
                return -ENOMEM;
        }
        session_read_groups(s);
        s->id = d->next_session_id++;
        d->metrics.sessions_accepted++;
        TAILQ_INSERT_TAIL(&d->sessions, s, entry);
        d->nsessions++;
        d->nadmin += admin;
        log_debug("session %" PRIu64 ": connected%s, pid %d uid %u gid %u, %zu groups", s->id,
                  admin ? " on the admin socket" : "", (int)cred.pid, (unsigned)cred.uid, (unsigned)cred.gid,
                  s->ngroups);
        daemon_status_changed(d);
        *ret_session = s;
        return 0;
}

void sessions_shutdown(struct daemon *d, const char *reason) {
        Moeep__V1__Shutdown sd = MOEEP__V1__SHUTDOWN__INIT;
        Moeep__V1__Event ev = MOEEP__V1__EVENT__INIT;
        struct session *s, *next;

        d->stopping = true;
        sd.reason = (char *)reason;
        ev.body_case = MOEEP__V1__EVENT__BODY_SHUTDOWN;
        ev.shutdown = &sd;
        for (s = TAILQ_FIRST(&d->sessions); s; s = next) {
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
