/* libmoeep control plane: one synchronous connection to moeepd.
 *
 * A call sends one Request with a fresh request id and then reads records
 * until the Response with that id arrives. Events that arrive in between
 * (and those found by moeep_event_next()) go into a small ring. There is no
 * global state: everything lives in struct moeep_client, so independent
 * handles in one process do not interact. */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <poll.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "client-internal.h"
#include "moeep-config.h"

#define JOB_NAME_MAX 64
#define GPU_UUID_MAX 64
#define CLOSED_TEXT "moeepd closed the connection (daemon stopped or restarted?)"

struct moeep_client {
        int sock;          /* owns; the connection to moeepd */
        char *socket_path; /* owns */
        uint64_t last_request_id;
        int broken; /* 0, or the -errno every later call fails with */

        /* From Welcome. */
        uint64_t session_id;
        uint64_t features;
        char daemon_version[64];

        /* The joined job; control_page is NULL while not in a job. */
        struct moeep_control_page *control_page; /* owns the mapping */
        uint64_t job_id;
        int rank;
        int world_size;

        /* Ring of pending events, oldest at events_head. */
        struct moeep_event events[MOEEP_CLIENT_EVENT_QUEUE];
        size_t events_head;
        size_t events_count;
        uint64_t events_dropped;

        struct moeep_record *rec; /* owns; receive buffer, holds the last reply's fds */
        char error[256];

        /* The data plane's state for the joined job (client_job_data). */
        void *job_data;
        void (*job_data_free)(void *data);
};

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
        switch ((Moeep__V1__ErrorCode)code) {
        case MOEEP__V1__ERROR_CODE__ERROR_BAD_RECORD:
                return -EPROTO;
        case MOEEP__V1__ERROR_CODE__ERROR_VERSION_MISMATCH:
                return -EPROTONOSUPPORT;
        case MOEEP__V1__ERROR_CODE__ERROR_NOT_WELCOMED:
                return -EPROTO;
        case MOEEP__V1__ERROR_CODE__ERROR_INVALID_ARGUMENT:
                return -EINVAL;
        case MOEEP__V1__ERROR_CODE__ERROR_NO_SUCH_JOB:
                return -ENOENT;
        case MOEEP__V1__ERROR_CODE__ERROR_BAD_SECRET:
                return -EACCES;
        case MOEEP__V1__ERROR_CODE__ERROR_RANK_OUT_OF_RANGE:
                return -ERANGE;
        case MOEEP__V1__ERROR_CODE__ERROR_RANK_TAKEN:
                return -EEXIST;
        case MOEEP__V1__ERROR_CODE__ERROR_WORLD_SIZE_MISMATCH:
                return -EINVAL;
        case MOEEP__V1__ERROR_CODE__ERROR_LIMIT_EXCEEDED:
                return -EUSERS;
        case MOEEP__V1__ERROR_CODE__ERROR_PERMISSION_DENIED:
                return -EPERM;
        case MOEEP__V1__ERROR_CODE__ERROR_NOT_IN_JOB:
                return -ENOTCONN;
        case MOEEP__V1__ERROR_CODE__ERROR_ALREADY_IN_JOB:
                return -EISCONN;
        case MOEEP__V1__ERROR_CODE__ERROR_BAD_FDS:
                return -EBADF;
        case MOEEP__V1__ERROR_CODE__ERROR_PEER_LOST:
                return -ENOTCONN;
        case MOEEP__V1__ERROR_CODE__ERROR_DRAINING:
        case MOEEP__V1__ERROR_CODE__ERROR_NOT_READY:
                return -EAGAIN;
        case MOEEP__V1__ERROR_CODE__ERROR_UNSPECIFIED:
        case MOEEP__V1__ERROR_CODE__ERROR_INTERNAL:
        case MOEEP__V1__ERROR_CODE__ERROR_UNKNOWN_TYPE:
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

        if (c->broken)
                return client_check_usable(c);
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

/* Forgets the joined job locally and unmaps its control page. */
static void client_job_forget(struct moeep_client *c) {
        if (c->job_data_free)
                c->job_data_free(c->job_data);
        c->job_data = NULL;
        c->job_data_free = NULL;
        if (c->control_page)
                munmap(c->control_page, MOEEP_CONTROL_PAGE_SIZE);
        c->control_page = NULL;
        c->job_id = 0;
        c->rank = -1;
        c->world_size = 0;
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
                         MOEEP__V1__FEATURE__FEATURE_PROXY;
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

int moeep_connect(const char *socket_path, struct moeep_client **ret_client) {
        return client_connect(socket_path, NULL, ret_client, NULL, 0);
}

static bool name_valid(const char *name) {
        size_t n = strlen(name);

        if (n < 1 || n > JOB_NAME_MAX)
                return false;
        for (size_t i = 0; i < n; i++)
                if ((unsigned char)name[i] < 0x20 || (unsigned char)name[i] > 0x7e)
                        return false;
        return true;
}

static int check_world_size(struct moeep_client *c, int world_size) {
        if (world_size < 1 || world_size > MOEEP_MAX_RANKS)
                return client_error_set(c, -EINVAL, "world size %d is out of range (1..%d)", world_size,
                                        MOEEP_MAX_RANKS);
        return 0;
}

int moeep_job_create(struct moeep_client *c, const char *name, int world_size,
                     struct moeep_unique_id *ret_id) {
        Moeep__V1__JobCreate jc = MOEEP__V1__JOB_CREATE__INIT;
        Moeep__V1__Request req = MOEEP__V1__REQUEST__INIT;
        Moeep__V1__Response *resp;
        ProtobufCBinaryData *uid;
        int r;

        if (!c)
                return -EINVAL;
        if (!name || !ret_id)
                return client_error_set(c, -EINVAL, "job create: %s is NULL", !name ? "name" : "ret_id");
        if (!name_valid(name))
                return client_error_set(c, -EINVAL,
                                        "job name '%.80s' is invalid (1..%d printable ASCII bytes)", name,
                                        JOB_NAME_MAX);
        r = check_world_size(c, world_size);
        if (r < 0)
                return r;

        jc.name = (char *)name;
        jc.world_size = (uint32_t)world_size;
        req.body_case = MOEEP__V1__REQUEST__BODY_JOB_CREATE;
        req.job_create = &jc;
        r = client_call(c, &req, MOEEP__V1__RESPONSE__BODY_JOB_CREATED, NULL, 0, &resp);
        if (r < 0)
                return r;
        uid = &resp->job_created->unique_id;
        if (uid->len == 0 || uid->len > MOEEP_UNIQUE_ID_BYTES) {
                r = client_error_set(c, -EPROTO, "moeepd returned a unique id of %zu bytes (expected 1..%d)",
                                     uid->len, MOEEP_UNIQUE_ID_BYTES);
                goto out;
        }
        /* Zero-padded to the full size; moeep_job_join() sends all of it. */
        memset(ret_id, 0, sizeof(*ret_id));
        memcpy(ret_id->bytes, uid->data, uid->len);
out:
        moeep__v1__response__free_unpacked(resp, NULL);
        return r;
}

/* Maps the control page the daemon sent with JobJoined (read-only) and
 * checks it. Takes ownership of nothing: the caller closes `fd`. */
static int control_page_map(struct moeep_client *c, int fd, struct moeep_control_page **ret_page) {
        struct moeep_control_page *page = NULL;
        struct stat st;

        if (fstat(fd, &st) < 0)
                return client_error_set(c, -errno, "cannot stat the job's control page (fd %d): %m", fd);
        if (st.st_size < MOEEP_CONTROL_PAGE_SIZE)
                return client_error_set(c, -EPROTO, "moeepd sent a control page of %lld bytes (expected %d)",
                                        (long long)st.st_size, MOEEP_CONTROL_PAGE_SIZE);
        page = mmap(NULL, MOEEP_CONTROL_PAGE_SIZE, PROT_READ, MAP_SHARED, fd, 0);
        if (page == MAP_FAILED)
                return client_error_set(c, -errno, "cannot map the job's control page (fd %d): %m", fd);
        if (page->magic != MOEEP_CONTROL_PAGE_MAGIC) {
                uint32_t magic = page->magic;

                munmap(page, MOEEP_CONTROL_PAGE_SIZE);
                return client_error_set(c, -EPROTO, "job control page has magic 0x%08x (expected 0x%08x)",
                                        magic, MOEEP_CONTROL_PAGE_MAGIC);
        }
        *ret_page = page;
        return 0;
}

static int client_simple_call(struct moeep_client *c, Moeep__V1__Request *req) {
        Moeep__V1__Response *resp;
        int r;

        r = client_call(c, req, MOEEP__V1__RESPONSE__BODY_OK, NULL, 0, &resp);
        if (r < 0)
                return r;
        moeep__v1__response__free_unpacked(resp, NULL);
        return 0;
}

static int client_leave_call(struct moeep_client *c) {
        Moeep__V1__JobLeave jl = MOEEP__V1__JOB_LEAVE__INIT;
        Moeep__V1__Request req = MOEEP__V1__REQUEST__INIT;

        req.body_case = MOEEP__V1__REQUEST__BODY_JOB_LEAVE;
        req.job_leave = &jl;
        return client_simple_call(c, &req);
}

int moeep_job_join(struct moeep_client *c, const struct moeep_unique_id *id, int rank, int world_size,
                   const char *gpu_uuid) {
        Moeep__V1__JobJoin jj = MOEEP__V1__JOB_JOIN__INIT;
        Moeep__V1__Request req = MOEEP__V1__REQUEST__INIT;
        struct moeep_control_page *page = NULL;
        Moeep__V1__Response *resp;
        Moeep__V1__JobJoined *joined;
        size_t nfds;
        int *fds, r;

        if (!c)
                return -EINVAL;
        if (!id)
                return client_error_set(c, -EINVAL, "job join: unique id is NULL");
        r = check_world_size(c, world_size);
        if (r < 0)
                return r;
        if (rank < 0 || rank >= world_size)
                return client_error_set(c, -ERANGE, "rank %d is out of range (0..%d)", rank, world_size - 1);
        if (gpu_uuid && strlen(gpu_uuid) > GPU_UUID_MAX)
                return client_error_set(c, -EINVAL, "GPU UUID '%.80s' is longer than %d bytes", gpu_uuid,
                                        GPU_UUID_MAX);
        if (c->control_page)
                return client_error_set(c, -EISCONN, "this session already joined job %llu as rank %d",
                                        (unsigned long long)c->job_id, c->rank);

        /* The whole zero-padded id; the daemon ignores trailing zeros. */
        jj.unique_id.data = (uint8_t *)id->bytes;
        jj.unique_id.len = sizeof(id->bytes);
        jj.rank = (uint32_t)rank;
        jj.world_size = (uint32_t)world_size;
        jj.gpu_uuid = (char *)(gpu_uuid ? gpu_uuid : "");
        req.body_case = MOEEP__V1__REQUEST__BODY_JOB_JOIN;
        req.job_join = &jj;
        r = client_call(c, &req, MOEEP__V1__RESPONSE__BODY_JOB_JOINED, NULL, 0, &resp);
        if (r < 0)
                return r;
        joined = resp->job_joined;
        fds = client_reply_fds(c, &nfds);
        if (joined->rank != (uint32_t)rank || joined->world_size != (uint32_t)world_size) {
                r = client_error_set(c, -EPROTO,
                                     "moeepd joined us as rank %u of %u, we asked for rank %d of %d",
                                     joined->rank, joined->world_size, rank, world_size);
                goto undo;
        }
        /* The record layer guarantees JobJoined carries exactly one fd. */
        r = control_page_map(c, fds[0], &page);
        if (r < 0)
                goto undo;
        c->control_page = page;
        c->job_id = joined->job_id;
        c->rank = rank;
        c->world_size = world_size;
        moeep__v1__response__free_unpacked(resp, NULL);
        moeep_record_release(c->rec);
        return 0;

undo:
        /* The daemon counts us as joined; leave, keeping the first error. */
        moeep__v1__response__free_unpacked(resp, NULL);
        {
                char saved[sizeof(c->error)];

                memcpy(saved, c->error, sizeof(saved));
                (void)client_leave_call(c);
                memcpy(c->error, saved, sizeof(saved));
        }
        return r;
}

static int client_require_job(struct moeep_client *c, const char *what) {
        if (c->control_page)
                return 0;
        return client_error_set(c, -ENOTCONN, "%s: this session has not joined a job", what);
}

int moeep_job_leave(struct moeep_client *c) {
        int r;

        if (!c)
                return -EINVAL;
        r = client_require_job(c, "job leave");
        if (r < 0)
                return r;
        r = client_leave_call(c);
        /* Forget the job unless the daemon still counts us in it: when it says
         * we are not in a job, or is gone, there is nothing left to leave. */
        if (r == 0 || r == -ENOTCONN || c->broken)
                client_job_forget(c);
        return r;
}

int moeep_job_barrier(struct moeep_client *c) {
        Moeep__V1__Barrier b = MOEEP__V1__BARRIER__INIT;
        Moeep__V1__Request req = MOEEP__V1__REQUEST__INIT;
        int r;

        if (!c)
                return -EINVAL;
        r = client_require_job(c, "barrier");
        if (r < 0)
                return r;
        req.body_case = MOEEP__V1__REQUEST__BODY_BARRIER;
        req.barrier = &b;
        return client_simple_call(c, &req);
}

int moeep_job_info(const struct moeep_client *c, uint64_t *ret_job_id, int *ret_rank, int *ret_world_size) {
        if (!c)
                return -EINVAL;
        if (!c->control_page)
                return -ENOTCONN;
        if (ret_job_id)
                *ret_job_id = c->job_id;
        if (ret_rank)
                *ret_rank = c->rank;
        if (ret_world_size)
                *ret_world_size = c->world_size;
        return 0;
}

int moeep_job_ranks(struct moeep_client *c, uint32_t *ret_local, uint32_t *ret_remote) {
        Moeep__V1__JobsList list = MOEEP__V1__JOBS_LIST__INIT;
        Moeep__V1__Request req = MOEEP__V1__REQUEST__INIT;
        Moeep__V1__Response *resp;
        uint32_t local = 0, remote = 0;
        bool found = false;
        int r;

        if (!c)
                return -EINVAL;
        r = client_require_job(c, "job ranks");
        if (r < 0)
                return r;
        req.body_case = MOEEP__V1__REQUEST__BODY_JOBS_LIST;
        req.jobs_list = &list;
        r = client_call(c, &req, MOEEP__V1__RESPONSE__BODY_JOBS, NULL, 0, &resp);
        if (r < 0)
                return r;
        for (size_t i = 0; i < resp->jobs->n_jobs && !found; i++) {
                const Moeep__V1__JobInfo *ji = resp->jobs->jobs[i];

                if (ji->job_id != c->job_id)
                        continue;
                found = true;
                for (size_t k = 0; k < ji->n_joined_ranks; k++)
                        if (ji->joined_ranks[k] < 32)
                                local |= 1u << ji->joined_ranks[k];
                for (size_t k = 0; k < ji->n_remote_ranks; k++)
                        if (ji->remote_ranks[k] < 32)
                                remote |= 1u << ji->remote_ranks[k];
        }
        moeep__v1__response__free_unpacked(resp, NULL);
        if (!found)
                return client_error_set(c, -ENOTCONN, "job ranks: the daemon lists no job %" PRIu64,
                                        c->job_id);
        if (ret_local)
                *ret_local = local & ~remote;
        if (ret_remote)
                *ret_remote = remote;
        return 0;
}

const volatile struct moeep_control_page *moeep_job_control_page(const struct moeep_client *c) {
        return c ? c->control_page : NULL;
}

/* Returns the protocol's kind, or REGION_KIND_UNSPECIFIED for a value that
 * is not one of ours (the caller's int may hold anything). */
static Moeep__V1__RegionKind region_kind_to_proto(enum moeep_region_kind kind) {
        switch (kind) {
        case MOEEP_REGION_CUMEM_FD:
                return MOEEP__V1__REGION_KIND__REGION_KIND_CUMEM_FD;
        case MOEEP_REGION_DMABUF:
                return MOEEP__V1__REGION_KIND__REGION_KIND_DMABUF;
        case MOEEP_REGION_MEMFD:
                return MOEEP__V1__REGION_KIND__REGION_KIND_MEMFD;
        }
        return MOEEP__V1__REGION_KIND__REGION_KIND_UNSPECIFIED;
}

/* RegionRegister of `fd` with proxy role `proxy` (PROXY_ROLE_NONE for an
 * ordinary region). */
static int region_register_call(struct moeep_client *c, int fd, Moeep__V1__RegionKind kind, uint64_t size,
                                uint32_t tag, Moeep__V1__ProxyRole proxy, uint64_t *ret_region_id) {
        Moeep__V1__RegionRegister rr = MOEEP__V1__REGION_REGISTER__INIT;
        Moeep__V1__Request req = MOEEP__V1__REQUEST__INIT;
        Moeep__V1__Response *resp;
        int r;

        if (fd < 0 || fcntl(fd, F_GETFD) < 0)
                return client_error_set(c, -EBADF, "region fd %d is not an open descriptor", fd);
        if (size == 0)
                return client_error_set(c, -EINVAL, "region size 0 (fd %d) is invalid", fd);
        r = client_require_job(c, "region register");
        if (r < 0)
                return r;

        rr.kind = kind;
        rr.size = size;
        rr.tag = tag;
        rr.proxy = proxy;
        req.body_case = MOEEP__V1__REQUEST__BODY_REGION_REGISTER;
        req.region_register = &rr;
        r = client_call(c, &req, MOEEP__V1__RESPONSE__BODY_REGION_REGISTERED, &fd, 1, &resp);
        if (r < 0)
                return r;
        if (ret_region_id)
                *ret_region_id = resp->region_registered->region_id;
        moeep__v1__response__free_unpacked(resp, NULL);
        return 0;
}

int moeep_region_register(struct moeep_client *c, int fd, enum moeep_region_kind kind, uint64_t size,
                          uint32_t tag, uint64_t *ret_region_id) {
        Moeep__V1__RegionKind k = region_kind_to_proto(kind);

        if (!c)
                return -EINVAL;
        if (k == MOEEP__V1__REGION_KIND__REGION_KIND_UNSPECIFIED)
                return client_error_set(c, -EINVAL, "region kind %d is unknown", (int)kind);
        return region_register_call(c, fd, k, size, tag, MOEEP__V1__PROXY_ROLE__PROXY_ROLE_NONE,
                                    ret_region_id);
}

/* The daemon takes proxy regions and channels only after agreeing on
 * FEATURE_PROXY (protocol 1.3). */
static int client_require_proxy(struct moeep_client *c, const char *what) {
        if (!(c->features & MOEEP__V1__FEATURE__FEATURE_PROXY))
                return client_error_set(c, -EOPNOTSUPP,
                                        "%s: moeepd %s at %s does not offer the internode proxy path "
                                        "(it needs protocol 1.3)",
                                        what, c->daemon_version, c->socket_path);
        return 0;
}

void *client_job_data(const struct moeep_client *c) {
        return c->job_data;
}

void client_job_data_set(struct moeep_client *c, void *data, void (*free_fn)(void *data)) {
        c->job_data = data;
        c->job_data_free = free_fn;
}

int client_proxy_region_register(struct moeep_client *c, int memfd, uint64_t size, enum moeep_proxy_role role,
                                 uint32_t tag, uint64_t *ret_region_id) {
        Moeep__V1__ProxyRole proxy;
        int r;

        if (!c)
                return -EINVAL;
        switch (role) {
        case MOEEP_PROXY_SEND:
                proxy = MOEEP__V1__PROXY_ROLE__PROXY_ROLE_SEND;
                break;
        case MOEEP_PROXY_RECV:
                proxy = MOEEP__V1__PROXY_ROLE__PROXY_ROLE_RECV;
                break;
        case MOEEP_PROXY_COUNTERS:
                proxy = MOEEP__V1__PROXY_ROLE__PROXY_ROLE_COUNTERS;
                break;
        default: /* the caller's int may hold anything */
                return client_error_set(c, -EINVAL, "proxy role %d is unknown", (int)role);
        }
        r = client_require_proxy(c, "proxy region register");
        if (r < 0)
                return r;
        return region_register_call(c, memfd, MOEEP__V1__REGION_KIND__REGION_KIND_MEMFD, size, tag, proxy,
                                    ret_region_id);
}

int client_proxy_channel_open(struct moeep_client *c, uint32_t capacity, int *ret_ring_fd,
                              uint64_t *ret_ring_id, uint32_t *ret_capacity) {
        Moeep__V1__ChannelOpen co = MOEEP__V1__CHANNEL_OPEN__INIT;
        Moeep__V1__Request req = MOEEP__V1__REQUEST__INIT;
        Moeep__V1__Response *resp;
        size_t nfds = 0;
        int *fds, r;

        if (!c || !ret_ring_fd)
                return -EINVAL;
        r = client_require_proxy(c, "channel open");
        if (r == 0)
                r = client_require_job(c, "channel open");
        if (r < 0)
                return r;
        co.capacity = capacity;
        req.body_case = MOEEP__V1__REQUEST__BODY_CHANNEL_OPEN;
        req.channel_open = &co;
        r = client_call(c, &req, MOEEP__V1__RESPONSE__BODY_CHANNEL_OPENED, NULL, 0, &resp);
        if (r < 0)
                return r;
        fds = client_reply_fds(c, &nfds);
        if (nfds != 1 || fds[0] < 0) {
                moeep__v1__response__free_unpacked(resp, NULL);
                return client_error_set(c, -EPROTO, "channel open: the reply carried %zu ring fds, not 1",
                                        nfds);
        }
        *ret_ring_fd = fds[0];
        fds[0] = -1; /* ours now */
        if (ret_ring_id)
                *ret_ring_id = resp->channel_opened->ring_id;
        if (ret_capacity)
                *ret_capacity = resp->channel_opened->capacity;
        moeep__v1__response__free_unpacked(resp, NULL);
        return 0;
}

int moeep_region_release(struct moeep_client *c, uint64_t region_id) {
        Moeep__V1__RegionRelease rr = MOEEP__V1__REGION_RELEASE__INIT;
        Moeep__V1__Request req = MOEEP__V1__REQUEST__INIT;
        Moeep__V1__Response *resp;
        int r;

        if (!c)
                return -EINVAL;
        r = client_require_job(c, "region release");
        if (r < 0)
                return r;
        rr.region_id = region_id;
        req.body_case = MOEEP__V1__REQUEST__BODY_REGION_RELEASE;
        req.region_release = &rr;
        r = client_call(c, &req, MOEEP__V1__RESPONSE__BODY_OK, NULL, 0, &resp);
        if (r < 0)
                return r;
        moeep__v1__response__free_unpacked(resp, NULL);
        return 0;
}

static int region_kind_from_proto(Moeep__V1__RegionKind kind, enum moeep_region_kind *ret_kind) {
        switch (kind) {
        case MOEEP__V1__REGION_KIND__REGION_KIND_CUMEM_FD:
                *ret_kind = MOEEP_REGION_CUMEM_FD;
                return 0;
        case MOEEP__V1__REGION_KIND__REGION_KIND_DMABUF:
                *ret_kind = MOEEP_REGION_DMABUF;
                return 0;
        case MOEEP__V1__REGION_KIND__REGION_KIND_MEMFD:
                *ret_kind = MOEEP_REGION_MEMFD;
                return 0;
        case MOEEP__V1__REGION_KIND__REGION_KIND_UNSPECIFIED:
        case _MOEEP__V1__REGION_KIND_IS_INT_SIZE:
                break;
        }
        return -EPROTO;
}

int moeep_regions_fetch(struct moeep_client *c, int rank, int64_t tag, struct moeep_region **ret_regions,
                        size_t *ret_count) {
        Moeep__V1__RegionsFetch rf = MOEEP__V1__REGIONS_FETCH__INIT;
        Moeep__V1__Request req = MOEEP__V1__REQUEST__INIT;
        struct moeep_region *regions = NULL;
        Moeep__V1__Response *resp;
        Moeep__V1__Regions *m;
        size_t nfds, nlocal = 0;
        int *fds, r;

        if (!c)
                return -EINVAL;
        if (!ret_regions || !ret_count)
                return client_error_set(c, -EINVAL, "regions fetch: %s is NULL",
                                        !ret_regions ? "ret_regions" : "ret_count");
        if (tag < -1 || tag > UINT32_MAX)
                return client_error_set(c, -EINVAL, "region tag %lld is out of range (-1..%u)",
                                        (long long)tag, UINT32_MAX);
        r = client_require_job(c, "regions fetch");
        if (r < 0)
                return r;
        if (rank < -1 || rank >= c->world_size)
                return client_error_set(c, -ERANGE, "rank %d is out of range (-1..%d)", rank,
                                        c->world_size - 1);

        rf.rank = rank;
        rf.tag = tag;
        req.body_case = MOEEP__V1__REQUEST__BODY_REGIONS_FETCH;
        req.regions_fetch = &rf;
        r = client_call(c, &req, MOEEP__V1__RESPONSE__BODY_REGIONS, NULL, 0, &resp);
        if (r < 0)
                return r;
        m = resp->regions;
        fds = client_reply_fds(c, &nfds);
        for (size_t i = 0; i < m->n_regions; i++)
                nlocal += !m->regions[i]->remote;
        if (nlocal != nfds) {
                r = client_error_set(c, -EPROTO,
                                     "moeepd sent %zu regions of local ranks with %zu descriptors", nlocal,
                                     nfds);
                goto out;
        }
        /* At least one element, so that success never returns NULL. */
        regions = calloc(m->n_regions ? m->n_regions : 1, sizeof(*regions));
        if (!regions) {
                r = client_error_set(c, -ENOMEM, "out of memory for %zu regions", m->n_regions);
                goto out;
        }
        for (size_t i = 0; i < m->n_regions; i++) {
                const Moeep__V1__RegionInfo *ri = m->regions[i];

                r = region_kind_from_proto(ri->kind, &regions[i].kind);
                if (r < 0) {
                        client_error_set(c, r, "moeepd sent region %llu of unknown kind %d",
                                         (unsigned long long)ri->region_id, (int)ri->kind);
                        goto out;
                }
                regions[i].rank = (int)ri->rank;
                regions[i].tag = ri->tag;
                regions[i].size = ri->size;
                regions[i].id = ri->region_id;
        }
        /* Only now that nothing can fail: the fds move to the caller, in
         * order, to the regions of local ranks; remote ranks' get -1. */
        for (size_t i = 0, k = 0; i < m->n_regions; i++) {
                regions[i].fd = -1;
                if (m->regions[i]->remote)
                        continue;
                regions[i].fd = fds[k];
                fds[k++] = -1;
        }
        *ret_regions = regions;
        *ret_count = m->n_regions;
        regions = NULL;
        r = 0;
out:
        free(regions);
        moeep__v1__response__free_unpacked(resp, NULL);
        moeep_record_release(c->rec);
        return r;
}

void moeep_regions_free(struct moeep_region *regions, size_t count) {
        if (!regions)
                return;
        for (size_t i = 0; i < count; i++)
                if (regions[i].fd >= 0)
                        close(regions[i].fd);
        free(regions);
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
