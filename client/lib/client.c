/* libmoeep control plane: one synchronous connection to moeepd.
 *
 * A call sends one Request with a fresh request id and then reads records
 * until the Response with that id arrives. Events that arrive in between
 * (and those found by moeep_event_next()) go into a small ring. There is no
 * global state: everything lives in struct moeep_client (client-handle.h),
 * so independent handles in one process do not interact. The requests about
 * the joined job are in client-job.c, those about regions and the proxy path
 * in client-region.c. */
#include <errno.h>
#include <poll.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "client-handle.h"
#include "moeep-config.h"

#define CLOSED_TEXT "moeepd closed the connection (daemon stopped or restarted?)"

int client_error_set(struct moeep_client *c, int r, const char *fmt, ...) {
        va_list ap;

        va_start(ap, fmt);
        vsnprintf(c->error, sizeof(c->error), fmt, ap);
        va_end(ap);
        return r;
}

const char *moeep_client_error(const struct moeep_client *c) {
        if (!c)
                return "client handle is NULL";
        return c->error;
}

int moeep_client_fd(const struct moeep_client *c) {
        if (!c)
                return -EINVAL;
        return c->sock;
}

uint64_t client_events_dropped(const struct moeep_client *c) {
        return c ? c->events_dropped : 0;
}

const char *client_socket_path(const struct moeep_client *c) {
        return c ? c->socket_path : NULL;
}

const char *client_daemon_version(const struct moeep_client *c) {
        return c ? c->daemon_version : NULL;
}

uint64_t client_features(const struct moeep_client *c) {
        return c ? c->features : 0;
}

uint64_t client_session_id(const struct moeep_client *c) {
        return c ? c->session_id : 0;
}

int client_error_code_to_errno(int code) {
        /* Every code has its row in proto/errors.def (-Wswitch holds us to
         * it); the rows say what libmoeep returns. */
        switch ((Moeep__V1__ErrorCode)code) {
#define MOEEP_ERROR_REFUSAL(CODE, ERRNO, TEXT)    \
        case MOEEP__V1__ERROR_CODE__ERROR_##CODE: \
                return -ERRNO;
#define MOEEP_ERROR_OTHER MOEEP_ERROR_REFUSAL
#include "errors.def"
#undef MOEEP_ERROR_OTHER
#undef MOEEP_ERROR_REFUSAL
        case MOEEP__V1__ERROR_CODE__ERROR_UNSPECIFIED:
        case _MOEEP__V1__ERROR_CODE_IS_INT_SIZE:
                return -EIO;
        }
        return -EIO; /* a code newer than this library */
}

const char *client_error_code_to_string(int code) {
        const ProtobufCEnumValue *v =
                protobuf_c_enum_descriptor_get_value(&moeep__v1__error_code__descriptor, code);

        return v ? v->name : "ERROR_UNKNOWN";
}

/* Marks the connection unusable: every later call fails with `r` and the
 * current error text. Returns r. */
static int client_break(struct moeep_client *c, int r) {
        if (!c->broken)
                c->broken = r;
        return r;
}

/* Sets the error text and marks the connection unusable; returns r. */
__attribute__((format(printf, 3, 4))) static int client_fail(struct moeep_client *c, int r, const char *fmt,
                                                             ...) {
        va_list ap;

        va_start(ap, fmt);
        vsnprintf(c->error, sizeof(c->error), fmt, ap);
        va_end(ap);
        return client_break(c, r);
}

static int client_check_usable(struct moeep_client *c) {
        if (!c->broken)
                return 0;
        if (c->broken == -ECONNRESET)
                return client_error_set(c, -ECONNRESET, "%s; connect again", CLOSED_TEXT);
        /* Keep the text of the failure that broke the handle. */
        return c->broken;
}

int client_check_alive(struct moeep_client *c) {
        struct pollfd p = { .fd = c->sock, .events = POLLRDHUP };
        struct timespec ts;
        uint64_t now;

        if (c->broken)
                return client_check_usable(c);
        clock_gettime(CLOCK_MONOTONIC, &ts);
        now = (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
        if (now - c->alive_checked_ns < CLIENT_ALIVE_POLL_NS)
                return 0;
        c->alive_checked_ns = now;
        if (poll(&p, 1, 0) > 0 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR)))
                return client_fail(c, -ECONNRESET, CLOSED_TEXT);
        return 0;
}

static void event_push(struct moeep_client *c, const struct moeep_event *ev) {
        if (c->events_count == MOEEP_CLIENT_EVENT_QUEUE) {
                c->events_head = (c->events_head + 1) % MOEEP_CLIENT_EVENT_QUEUE;
                c->events_count--;
                c->events_dropped++;
        }
        c->events[(c->events_head + c->events_count) % MOEEP_CLIENT_EVENT_QUEUE] = *ev;
        c->events_count++;
}

static bool event_pop(struct moeep_client *c, struct moeep_event *ret_event) {
        if (c->events_count == 0)
                return false;
        *ret_event = c->events[c->events_head];
        c->events_head = (c->events_head + 1) % MOEEP_CLIENT_EVENT_QUEUE;
        c->events_count--;
        return true;
}

/* Decodes the Event in c->rec and queues it. */
static int client_queue_event(struct moeep_client *c) {
        Moeep__V1__Event *m = moeep_record_decode_event(c->rec);
        struct moeep_event ev = { 0 };
        const char *reason = "";

        if (!m)
                return client_fail(c, -EPROTO, "moeepd sent an undecodable event of type %u",
                                   c->rec->hdr.type);
        switch (m->body_case) {
        case MOEEP__V1__EVENT__BODY_PEER_LOST:
                ev.type = MOEEP_EVENT_PEER_LOST;
                ev.job_id = m->peer_lost->job_id;
                ev.rank = (int)m->peer_lost->rank;
                reason = m->peer_lost->reason;
                break;
        case MOEEP__V1__EVENT__BODY_SHUTDOWN:
                ev.type = MOEEP_EVENT_SHUTDOWN;
                ev.rank = -1;
                reason = m->shutdown->reason;
                break;
        case MOEEP__V1__EVENT__BODY__NOT_SET:
        case _MOEEP__V1__EVENT__BODY__CASE_IS_INT_SIZE:
                /* moeep_record_decode_event() already matched the body case
                 * against a known header type, so this cannot happen. */
                moeep__v1__event__free_unpacked(m, NULL);
                return client_fail(c, -EPROTO, "moeepd sent an empty event");
        }
        snprintf(ev.reason, sizeof(ev.reason), "%s", reason ? reason : "");
        moeep__v1__event__free_unpacked(m, NULL);
        event_push(c, &ev);
        return 0;
}

/* Receives one record into c->rec. Events are queued at once (returns 0);
 * a Response is left in c->rec (returns 1). */
/* Receives one record. When the daemon closed a session whose receive
 * queue still held our request, the kernel reports ECONNRESET once before
 * the records the daemon queued ahead of its close (such as the Error that
 * says why): so after a reset, look once more. */
static int client_recv_record(struct moeep_client *c, const char **ret_why) {
        int r = moeep_record_recv(c->sock, c->rec, ret_why);

        if (r == -ECONNRESET)
                r = moeep_record_recv(c->sock, c->rec, ret_why);
        return r;
}

static int client_recv_one(struct moeep_client *c) {
        const char *why = NULL;
        int r;

        moeep_record_release(c->rec);
        r = client_recv_record(c, &why);
        if (r == -ECONNRESET)
                return client_fail(c, -ECONNRESET, CLOSED_TEXT);
        if (r == -EAGAIN)
                return client_fail(c, -ETIMEDOUT, "moeepd at %s did not answer in time", c->socket_path);
        if (r == -EPROTONOSUPPORT)
                return client_fail(c, r, "moeepd at %s speaks another protocol major (ours is %d)",
                                   c->socket_path, MOEEP_PROTOCOL_MAJOR);
        if (r == -EBADMSG)
                return client_fail(c, -EPROTO, "moeepd sent a bad record: %s", why ? why : "unknown reason");
        if (r < 0)
                return client_fail(c, r, "cannot receive from moeepd at %s: %s", c->socket_path,
                                   strerror(-r));
        if (c->rec->hdr.type >= MOEEP_TYPE_EVENT_MIN && c->rec->hdr.type <= MOEEP_TYPE_EVENT_MAX) {
                r = client_queue_event(c);
                return r < 0 ? r : 0;
        }
        if (c->rec->hdr.type >= MOEEP_TYPE_RESPONSE_MIN && c->rec->hdr.type <= MOEEP_TYPE_RESPONSE_MAX)
                return 1;
        return client_fail(c, -EPROTO, "moeepd sent a record of request type %u", c->rec->hdr.type);
}

/* Turns an Error response into -errno and the handle's error text. */
static int client_error_from_response(struct moeep_client *c, const Moeep__V1__Error *e) {
        int r = client_error_code_to_errno(e->code);

        if (e->message && e->message[0])
                client_error_set(c, r, "moeepd: %s", e->message);
        else
                client_error_set(c, r, "moeepd: %s", client_error_code_to_string(e->code));
        return r;
}

int client_call(struct moeep_client *c, const Moeep__V1__Request *req, Moeep__V1__Response__BodyCase expect,
                const int *fds, size_t nfds, Moeep__V1__Response **ret_resp) {
        Moeep__V1__Response *resp;
        uint64_t id;
        int r;

        r = client_check_usable(c);
        if (r < 0)
                return r;
        moeep_record_release(c->rec);

        id = ++c->last_request_id;
        r = moeep_record_send(c->sock, (uint16_t)req->body_case, id, &req->base, fds, nfds);
        /* A closed connection falls through to the receive below: the daemon
         * may have queued an Error about the whole session (request id 0,
         * e.g. a cap refused at accept) before closing, and the receive
         * reports it, or the close. The peer is gone: it does not block. */
        if (r < 0 && r != -EPIPE && r != -ECONNRESET)
                return client_error_set(c, r, "cannot send request of type %d to moeepd at %s: %s",
                                        (int)req->body_case, c->socket_path, strerror(-r));

        for (;;) {
                r = client_recv_one(c);
                if (r < 0)
                        return r;
                if (r == 0)
                        continue;
                resp = moeep_record_decode_response(c->rec);
                if (!resp)
                        return client_fail(c, -EPROTO, "moeepd sent an undecodable response of type %u",
                                           c->rec->hdr.type);
                /* The daemon echoes our id; an Error with id 0 is about the
                 * session as a whole (it could not read our header). */
                if (c->rec->hdr.request_id != id &&
                    !(c->rec->hdr.request_id == 0 && resp->body_case == MOEEP__V1__RESPONSE__BODY_ERROR)) {
                        moeep__v1__response__free_unpacked(resp, NULL);
                        return client_fail(
                                c, -EPROTO, "moeepd answered request id %llu while we wait for %llu",
                                (unsigned long long)c->rec->hdr.request_id, (unsigned long long)id);
                }
                break;
        }

        if (resp->body_case == MOEEP__V1__RESPONSE__BODY_ERROR) {
                r = client_error_from_response(c, resp->error);
                if (c->rec->hdr.request_id == 0)
                        client_break(c, r);
                goto fail;
        }
        if (resp->body_case != expect) {
                r = client_fail(c, -EPROTO, "moeepd answered request type %d with type %d, expected %d",
                                (int)req->body_case, (int)resp->body_case, (int)expect);
                goto fail;
        }
        c->error[0] = '\0'; /* the handle's error is that of the last call */
        *ret_resp = resp;
        return 0;

fail:
        moeep__v1__response__free_unpacked(resp, NULL);
        moeep_record_release(c->rec);
        return r;
}

int *client_reply_fds(struct moeep_client *c, size_t *ret_nfds) {
        *ret_nfds = c->rec->nfds;
        return c->rec->fds;
}

static int set_rcvtimeo(int sock, unsigned timeout_ms) {
        struct timeval tv = {
                .tv_sec = timeout_ms / 1000,
                .tv_usec = (timeout_ms % 1000) * 1000,
        };

        if (setsockopt(sock, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv)) < 0)
                return -errno;
        return 0;
}

int client_set_timeout(struct moeep_client *c, unsigned timeout_ms) {
        int r;

        if (!c)
                return -EINVAL;
        r = set_rcvtimeo(c->sock, timeout_ms);
        if (r < 0)
                return client_error_set(c, r, "cannot set a receive timeout of %u ms: %s", timeout_ms,
                                        strerror(-r));
        return 0;
}

void moeep_client_free(struct moeep_client *c) {
        if (!c)
                return;
        client_job_forget(c);
        if (c->rec) {
                moeep_record_release(c->rec);
                free(c->rec);
        }
        if (c->sock >= 0)
                close(c->sock);
        free(c->socket_path);
        free(c);
}

static const char *resolve_socket_path(const char *socket_path) {
        const char *env;

        if (socket_path)
                return socket_path;
        env = secure_getenv("MOEEP_SOCKET");
        if (env && env[0])
                return env;
        return MOEEP_DEFAULT_SOCKET;
}

static int client_hello(struct moeep_client *c, const char *client_name) {
        Moeep__V1__Hello hello = MOEEP__V1__HELLO__INIT;
        Moeep__V1__Request req = MOEEP__V1__REQUEST__INIT;
        Moeep__V1__Response *resp;
        Moeep__V1__Welcome *w;
        int r;

        hello.major = MOEEP_PROTOCOL_MAJOR;
        hello.minor = MOEEP_PROTOCOL_MINOR;
        hello.features = MOEEP__V1__FEATURE__FEATURE_REGIONS | MOEEP__V1__FEATURE__FEATURE_CONTROL_PAGE |
                         MOEEP__V1__FEATURE__FEATURE_OPERATOR | MOEEP__V1__FEATURE__FEATURE_MESH |
                         MOEEP__V1__FEATURE__FEATURE_PROXY | MOEEP__V1__FEATURE__FEATURE_PIDFD;
        hello.pid = (uint32_t)getpid();
        hello.client_name = (char *)(client_name ? client_name : "libmoeep/" MOEEP_VERSION);
        req.body_case = MOEEP__V1__REQUEST__BODY_HELLO;
        req.hello = &hello;

        r = set_rcvtimeo(c->sock, MOEEP_CLIENT_HELLO_TIMEOUT_MS);
        if (r < 0)
                return client_error_set(c, r, "cannot set a receive timeout on the socket to %s: %s",
                                        c->socket_path, strerror(-r));
        r = client_call(c, &req, MOEEP__V1__RESPONSE__BODY_WELCOME, NULL, 0, &resp);
        if (r < 0)
                return r;
        w = resp->welcome;
        if (w->major != MOEEP_PROTOCOL_MAJOR) {
                r = client_error_set(
                        c, -EPROTONOSUPPORT, "moeepd at %s speaks protocol %u.%u, this libmoeep speaks %d.%d",
                        c->socket_path, w->major, w->minor, MOEEP_PROTOCOL_MAJOR, MOEEP_PROTOCOL_MINOR);
                goto out;
        }
        c->session_id = w->session_id;
        c->features = w->features;
        snprintf(c->daemon_version, sizeof(c->daemon_version), "%s",
                 w->daemon_version ? w->daemon_version : "");
        r = set_rcvtimeo(c->sock, 0);
        if (r < 0)
                client_error_set(c, r, "cannot clear the receive timeout on the socket to %s: %s",
                                 c->socket_path, strerror(-r));
out:
        moeep__v1__response__free_unpacked(resp, NULL);
        return r;
}

int client_connect(const char *socket_path, const char *client_name, struct moeep_client **ret_client,
                   char *errbuf, size_t errlen) {
        struct sockaddr_un sa = { .sun_family = AF_UNIX };
        struct moeep_client *c;
        const char *path;
        int r;

        if (!ret_client) {
                if (errbuf && errlen)
                        snprintf(errbuf, errlen, "ret_client is NULL");
                return -EINVAL;
        }
        c = calloc(1, sizeof(*c));
        if (!c) {
                if (errbuf && errlen)
                        snprintf(errbuf, errlen, "out of memory allocating a client handle");
                return -ENOMEM;
        }
        c->sock = -1;
        c->rank = -1;
        path = resolve_socket_path(socket_path);
        c->socket_path = strdup(path);
        c->rec = calloc(1, sizeof(*c->rec));
        if (!c->socket_path || !c->rec) {
                r = client_error_set(c, -ENOMEM, "out of memory allocating a client handle");
                goto fail;
        }
        if (path[0] == '\0' || strlen(path) >= sizeof(sa.sun_path)) {
                r = client_error_set(c, -EINVAL, "socket path '%s' is empty or longer than %zu bytes", path,
                                     sizeof(sa.sun_path) - 1);
                goto fail;
        }
        memcpy(sa.sun_path, path, strlen(path) + 1);

        c->sock = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
        if (c->sock < 0) {
                r = client_error_set(c, -errno, "cannot create a socket for %s: %m", path);
                goto fail;
        }
        if (connect(c->sock, (struct sockaddr *)&sa, sizeof(sa)) < 0) {
                r = client_error_set(c, -errno, "cannot connect to moeepd at %s: %m", path);
                goto fail;
        }
        r = client_hello(c, client_name);
        if (r < 0)
                goto fail;
        *ret_client = c;
        return 0;

fail:
        if (errbuf && errlen)
                snprintf(errbuf, errlen, "%s", c->error);
        moeep_client_free(c);
        return r;
}

int client_peer_uid(const struct moeep_client *client, uid_t *ret_uid) {
        struct ucred cred;
        socklen_t len = sizeof(cred);

        if (getsockopt(client->sock, SOL_SOCKET, SO_PEERCRED, &cred, &len) < 0)
                return -errno;
        *ret_uid = cred.uid;
        return 0;
}

int moeep_connect(const char *socket_path, struct moeep_client **ret_client) {
        return client_connect(socket_path, NULL, ret_client, NULL, 0);
}

int moeep_event_next(struct moeep_client *c, struct moeep_event *ret_event) {
        int r;

        if (!c)
                return -EINVAL;
        if (!ret_event)
                return client_error_set(c, -EINVAL, "event next: ret_event is NULL");

        /* Drain whatever the socket holds, without blocking. */
        while (!c->broken) {
                struct pollfd p = { .fd = c->sock, .events = POLLIN };

                r = poll(&p, 1, 0);
                if (r < 0 && errno == EINTR)
                        continue;
                if (r < 0)
                        return client_error_set(c, -errno, "cannot poll the socket to %s: %m",
                                                c->socket_path);
                if (r == 0)
                        break;
                r = client_recv_one(c);
                if (r == 1) {
                        /* Only an Error about the whole session may come
                         * unasked; anything else means we lost track. */
                        Moeep__V1__Response *resp = moeep_record_decode_response(c->rec);

                        if (resp && resp->body_case == MOEEP__V1__RESPONSE__BODY_ERROR &&
                            c->rec->hdr.request_id == 0)
                                client_break(c, client_error_from_response(c, resp->error));
                        else
                                client_fail(c, -EPROTO,
                                            "moeepd sent an unasked response "
                                            "(type %u, request id %llu)",
                                            c->rec->hdr.type, (unsigned long long)c->rec->hdr.request_id);
                        if (resp)
                                moeep__v1__response__free_unpacked(resp, NULL);
                        moeep_record_release(c->rec);
                }
        }

        /* Events that arrived before a failure are still delivered first. */
        if (event_pop(c, ret_event))
                return 1;
        r = client_check_usable(c);
        return r < 0 ? r : 0;
}
