/* Client tests that need no real daemon: argument checks, error mapping,
 * and several handles in one process against a small fake moeepd that runs
 * in threads of this process and speaks the real protocol (record framing
 * and protobuf) on a private socket. */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "../tmpdir.h"
#include "client-internal.h"

static int failures;

#define CHECK(cond)                                                                              \
        do {                                                                                     \
                if (!(cond)) {                                                                   \
                        fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #cond); \
                        failures++;                                                              \
                }                                                                                \
        } while (0)

#define CHECK_ERR(expr, err)                                                                        \
        do {                                                                                        \
                int r_ = (expr);                                                                    \
                if (r_ != (err)) {                                                                  \
                        fprintf(stderr, "%s:%d: %s returned %d (%s), expected %d (%s)\n", __FILE__, \
                                __LINE__, #expr, r_, strerror(-r_), err, strerror(-(err)));         \
                        failures++;                                                                 \
                }                                                                                   \
        } while (0)

/* ---------------------------------------------------------------- fake moeepd */

#define FAKE_SECRET "fake-secret-of-job-7"
#define FAKE_JOB_ID 7
#define FAKE_EVENTS_RANK1 70 /* more than the client's queue holds */

struct fake_region {
        int rank;
        int fd; /* owns */
};

static struct fake {
        pthread_mutex_t lock;
        int listen_fd;
        int world_size;
        unsigned joined; /* bit per rank */
        struct fake_region regions[16];
        size_t nregions;
        uint64_t next_session;
} fake = { .lock = PTHREAD_MUTEX_INITIALIZER, .listen_fd = -1 };

static void fake_send(int sock, uint64_t id, Moeep__V1__Response *resp, const int *fds, size_t nfds) {
        int r = moeep_record_send(sock, (uint16_t)resp->body_case, id, &resp->base, fds, nfds);

        if (r < 0)
                fprintf(stderr, "fake moeepd: send failed: %s\n", strerror(-r));
}

static void fake_error(int sock, uint64_t id, Moeep__V1__ErrorCode code, const char *msg) {
        Moeep__V1__Error e = MOEEP__V1__ERROR__INIT;
        Moeep__V1__Response resp = MOEEP__V1__RESPONSE__INIT;

        e.code = code;
        e.message = (char *)msg;
        resp.body_case = MOEEP__V1__RESPONSE__BODY_ERROR;
        resp.error = &e;
        fake_send(sock, id, &resp, NULL, 0);
}

static void fake_ok(int sock, uint64_t id) {
        Moeep__V1__Ok ok = MOEEP__V1__OK__INIT;
        Moeep__V1__Response resp = MOEEP__V1__RESPONSE__INIT;

        resp.body_case = MOEEP__V1__RESPONSE__BODY_OK;
        resp.ok = &ok;
        fake_send(sock, id, &resp, NULL, 0);
}

static int fake_control_page(void) {
        struct moeep_control_page page = {
                .magic = MOEEP_CONTROL_PAGE_MAGIC, .version = 1, .lost_rank = -1, .job_id = FAKE_JOB_ID
        };
        int fd = memfd_create("moeep-control", MFD_CLOEXEC);

        if (fd < 0 || ftruncate(fd, MOEEP_CONTROL_PAGE_SIZE) < 0 || pwrite(fd, &page, sizeof(page), 0) < 0)
                abort();
        return fd;
}

static void fake_join(int sock, uint64_t id, const Moeep__V1__JobJoin *jj, int *my_rank) {
        Moeep__V1__JobJoined joined = MOEEP__V1__JOB_JOINED__INIT;
        Moeep__V1__Response resp = MOEEP__V1__RESPONSE__INIT;
        size_t n = strlen(FAKE_SECRET);
        int fd;

        /* The client sends the id zero-padded to 128 bytes. */
        if (jj->unique_id.len != MOEEP_UNIQUE_ID_BYTES || memcmp(jj->unique_id.data, FAKE_SECRET, n) != 0) {
                fake_error(sock, id, MOEEP__V1__ERROR_CODE__ERROR_BAD_SECRET,
                           "unique id does not match job 7");
                return;
        }
        for (size_t i = n; i < jj->unique_id.len; i++)
                if (jj->unique_id.data[i]) {
                        fake_error(sock, id, MOEEP__V1__ERROR_CODE__ERROR_BAD_SECRET, "padding is not zero");
                        return;
                }
        pthread_mutex_lock(&fake.lock);
        if (fake.joined & (1u << jj->rank)) {
                pthread_mutex_unlock(&fake.lock);
                fake_error(sock, id, MOEEP__V1__ERROR_CODE__ERROR_RANK_TAKEN, "rank 1 of job 7 is taken");
                return;
        }
        fake.joined |= 1u << jj->rank;
        pthread_mutex_unlock(&fake.lock);
        *my_rank = (int)jj->rank;

        fd = fake_control_page();
        joined.job_id = FAKE_JOB_ID;
        joined.rank = jj->rank;
        joined.world_size = jj->world_size;
        resp.body_case = MOEEP__V1__RESPONSE__BODY_JOB_JOINED;
        resp.job_joined = &joined;
        fake_send(sock, id, &resp, &fd, 1);
        close(fd);
}

static void fake_fetch(int sock, uint64_t id, int my_rank) {
        Moeep__V1__RegionInfo infos[16], *ptrs[16];
        Moeep__V1__Regions regions = MOEEP__V1__REGIONS__INIT;
        Moeep__V1__Response resp = MOEEP__V1__RESPONSE__INIT;
        int fds[16];
        size_t n = 0;

        pthread_mutex_lock(&fake.lock);
        for (size_t i = 0; i < fake.nregions; i++) {
                if (fake.regions[i].rank == my_rank)
                        continue;
                moeep__v1__region_info__init(&infos[n]);
                infos[n].rank = (uint32_t)fake.regions[i].rank;
                infos[n].kind = MOEEP__V1__REGION_KIND__REGION_KIND_MEMFD;
                infos[n].size = 4096;
                infos[n].region_id = 100 + i;
                ptrs[n] = &infos[n];
                fds[n++] = fake.regions[i].fd;
        }
        regions.n_regions = n;
        regions.regions = ptrs;
        resp.body_case = MOEEP__V1__RESPONSE__BODY_REGIONS;
        resp.regions = &regions;
        fake_send(sock, id, &resp, fds, n);
        pthread_mutex_unlock(&fake.lock);
}

static void fake_barrier(int sock, uint64_t id, int my_rank) {
        Moeep__V1__PeerLost pl = MOEEP__V1__PEER_LOST__INIT;
        Moeep__V1__Event ev = MOEEP__V1__EVENT__INIT;
        int n = my_rank == 1 ? FAKE_EVENTS_RANK1 : 1;

        /* Events before the answer: the client must queue them. */
        ev.body_case = MOEEP__V1__EVENT__BODY_PEER_LOST;
        ev.peer_lost = &pl;
        pl.job_id = FAKE_JOB_ID;
        pl.reason = (char *)"test event";
        for (int i = 0; i < n; i++) {
                pl.rank = (uint32_t)i;
                moeep_record_send(sock, (uint16_t)ev.body_case, 0, &ev.base, NULL, 0);
        }
        fake_ok(sock, id);
}

/* Listings with strings that test moeepctl's escaping: quotes, a control
 * character, valid UTF-8 and an invalid byte; and a mirror of a job of
 * another daemon, which has no owner here. */
static void fake_jobs(int sock, uint64_t id) {
        static uint32_t ranks[] = { 0, 1 };
        Moeep__V1__JobInfo j = MOEEP__V1__JOB_INFO__INIT, mirror = MOEEP__V1__JOB_INFO__INIT;
        Moeep__V1__JobInfo *jp[] = { &j, &mirror };
        Moeep__V1__Jobs jobs = MOEEP__V1__JOBS__INIT;
        Moeep__V1__Response resp = MOEEP__V1__RESPONSE__INIT;

        j.job_id = FAKE_JOB_ID;
        j.name = (char *)"say \"hi\"\\\x01 \xc3\xa9\xff";
        j.world_size = 2;
        j.joined_ranks = ranks;
        j.n_joined_ranks = 2;
        j.state = (char *)"ready";
        j.owner_uid = 1000;
        mirror.job_id = FAKE_JOB_ID + 1;
        mirror.name = (char *)"remote";
        mirror.world_size = 2;
        mirror.joined_ranks = &ranks[1];
        mirror.n_joined_ranks = 1;
        mirror.state = (char *)"forming";
        mirror.owner_uid = UINT32_MAX; /* no uid */
        mirror.home = (char *)"127.0.0.1:9";
        jobs.jobs = jp;
        jobs.n_jobs = 2;
        resp.body_case = MOEEP__V1__RESPONSE__BODY_JOBS;
        resp.jobs = &jobs;
        fake_send(sock, id, &resp, NULL, 0);
}

static void fake_clients(int sock, uint64_t id) {
        Moeep__V1__ClientInfo c[2] = { MOEEP__V1__CLIENT_INFO__INIT, MOEEP__V1__CLIENT_INFO__INIT };
        Moeep__V1__ClientInfo *cp[2] = { &c[0], &c[1] };
        Moeep__V1__Clients clients = MOEEP__V1__CLIENTS__INIT;
        Moeep__V1__Response resp = MOEEP__V1__RESPONSE__INIT;

        c[0].session_id = 1;
        c[0].pid = 4242;
        c[0].uid = 1000;
        c[0].job_id = FAKE_JOB_ID;
        c[0].rank = 0;
        c[0].gpu_uuid = (char *)"GPU-00000000-0000-0000-0000-000000000000";
        c[0].state = (char *)"ready";
        c[0].name = (char *)"libmoeep/0.1.0";
        c[0].regions = 2;
        c[1].session_id = 2;
        c[1].pid = 4343;
        c[1].rank = -1;
        c[1].state = (char *)"ready";
        c[1].name = (char *)"moeepctl";
        clients.clients = cp;
        clients.n_clients = 2;
        resp.body_case = MOEEP__V1__RESPONSE__BODY_CLIENTS;
        resp.clients = &clients;
        fake_send(sock, id, &resp, NULL, 0);
}

/* Answers one request; returns -1 to close the connection. */
static int fake_handle(int sock, const struct moeep_record *rec, int *my_rank) {
        Moeep__V1__Request *req = moeep_record_decode_request(rec);
        Moeep__V1__Response resp = MOEEP__V1__RESPONSE__INIT;
        uint64_t id = rec->hdr.request_id;
        int ret = 0;

        if (!req) {
                fake_error(sock, id, MOEEP__V1__ERROR_CODE__ERROR_BAD_RECORD, "undecodable request");
                return -1;
        }
        switch (req->body_case) {
        case MOEEP__V1__REQUEST__BODY_HELLO: {
                Moeep__V1__Welcome w = MOEEP__V1__WELCOME__INIT;

                w.major = MOEEP_PROTOCOL_MAJOR;
                w.daemon_version = (char *)"fake";
                pthread_mutex_lock(&fake.lock);
                w.session_id = ++fake.next_session;
                pthread_mutex_unlock(&fake.lock);
                resp.body_case = MOEEP__V1__RESPONSE__BODY_WELCOME;
                resp.welcome = &w;
                fake_send(sock, id, &resp, NULL, 0);
                break;
        }
        case MOEEP__V1__REQUEST__BODY_JOB_CREATE: {
                Moeep__V1__JobCreated jc = MOEEP__V1__JOB_CREATED__INIT;

                if (strcmp(req->job_create->name, "close-me") == 0) {
                        ret = -1;
                        break;
                }
                pthread_mutex_lock(&fake.lock);
                fake.world_size = (int)req->job_create->world_size;
                pthread_mutex_unlock(&fake.lock);
                jc.unique_id.data = (uint8_t *)FAKE_SECRET;
                jc.unique_id.len = strlen(FAKE_SECRET);
                jc.job_id = FAKE_JOB_ID;
                resp.body_case = MOEEP__V1__RESPONSE__BODY_JOB_CREATED;
                resp.job_created = &jc;
                fake_send(sock, id, &resp, NULL, 0);
                break;
        }
        case MOEEP__V1__REQUEST__BODY_JOB_JOIN:
                fake_join(sock, id, req->job_join, my_rank);
                break;
        case MOEEP__V1__REQUEST__BODY_REGION_REGISTER: {
                Moeep__V1__RegionRegistered rr = MOEEP__V1__REGION_REGISTERED__INIT;

                pthread_mutex_lock(&fake.lock);
                fake.regions[fake.nregions].rank = *my_rank;
                fake.regions[fake.nregions].fd = dup(rec->fds[0]);
                rr.region_id = 100 + fake.nregions++;
                pthread_mutex_unlock(&fake.lock);
                resp.body_case = MOEEP__V1__RESPONSE__BODY_REGION_REGISTERED;
                resp.region_registered = &rr;
                fake_send(sock, id, &resp, NULL, 0);
                break;
        }
        case MOEEP__V1__REQUEST__BODY_REGIONS_FETCH:
                fake_fetch(sock, id, *my_rank);
                break;
        case MOEEP__V1__REQUEST__BODY_BARRIER:
                fake_barrier(sock, id, *my_rank);
                break;
        case MOEEP__V1__REQUEST__BODY_JOB_LEAVE:
        case MOEEP__V1__REQUEST__BODY_REGION_RELEASE:
                fake_ok(sock, id);
                break;
        case MOEEP__V1__REQUEST__BODY_STATUS_GET: {
                Moeep__V1__Status st = MOEEP__V1__STATUS__INIT;

                st.daemon_version = (char *)"fake";
                st.major = MOEEP_PROTOCOL_MAJOR;
                st.pid = (uint32_t)getpid();
                resp.body_case = MOEEP__V1__RESPONSE__BODY_STATUS;
                resp.status = &st;
                fake_send(sock, id, &resp, NULL, 0);
                break;
        }
        case MOEEP__V1__REQUEST__BODY_JOBS_LIST:
                fake_jobs(sock, id);
                break;
        case MOEEP__V1__REQUEST__BODY_CLIENTS_LIST:
                fake_clients(sock, id);
                break;
        case MOEEP__V1__REQUEST__BODY_METRICS_GET:
        case MOEEP__V1__REQUEST__BODY_NICS_LIST:
        case MOEEP__V1__REQUEST__BODY_LOG_LEVEL_SET:
        case MOEEP__V1__REQUEST__BODY_DRAIN:
        case MOEEP__V1__REQUEST__BODY_MESH_LIST:
        case MOEEP__V1__REQUEST__BODY_CHANNEL_OPEN:
                /* The fake is a 1.0 daemon: it offers no FEATURE_OPERATOR. */
                fake_error(sock, id, MOEEP__V1__ERROR_CODE__ERROR_UNKNOWN_TYPE, "request type unknown");
                ret = -1;
                break;
        case MOEEP__V1__REQUEST__BODY__NOT_SET:
        case _MOEEP__V1__REQUEST__BODY__CASE_IS_INT_SIZE:
                fake_error(sock, id, MOEEP__V1__ERROR_CODE__ERROR_INTERNAL, "the fake does not do that");
                break;
        }
        moeep__v1__request__free_unpacked(req, NULL);
        return ret;
}

static void *fake_session(void *arg) {
        int sock = (int)(intptr_t)arg, my_rank = -1;
        struct moeep_record *rec = calloc(1, sizeof(*rec));

        if (!rec)
                abort();
        while (moeep_record_recv(sock, rec, NULL) == 0) {
                int r = fake_handle(sock, rec, &my_rank);

                moeep_record_release(rec);
                if (r < 0)
                        break;
        }
        free(rec);
        close(sock);
        return NULL;
}

static void *fake_accept(void *arg) {
        for (;;) {
                pthread_t t;
                int s = accept4(fake.listen_fd, NULL, NULL, SOCK_CLOEXEC);

                if (s < 0)
                        return NULL;
                if (pthread_create(&t, NULL, fake_session, (void *)(intptr_t)s) != 0)
                        abort();
                pthread_detach(t);
        }
}

static void fake_start(const char *path) {
        struct sockaddr_un sa = { .sun_family = AF_UNIX };
        pthread_t t;

        snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", path);
        fake.listen_fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
        if (fake.listen_fd < 0 || bind(fake.listen_fd, (struct sockaddr *)&sa, sizeof(sa)) < 0 ||
            listen(fake.listen_fd, 16) < 0) {
                perror("fake moeepd");
                exit(1);
        }
        if (pthread_create(&t, NULL, fake_accept, NULL) != 0)
                abort();
        pthread_detach(t);
}

/* ---------------------------------------------------------------- tests */

static void test_no_daemon(void) {
        struct moeep_client *c = (struct moeep_client *)0x1;
        char err[256], longpath[200];

        CHECK_ERR(client_connect("/nonexistent/moeepd.sock", NULL, &c, err, sizeof(err)), -ENOENT);
        CHECK(c == (struct moeep_client *)0x1); /* ret_* untouched on failure */
        CHECK(strstr(err, "/nonexistent/moeepd.sock") != NULL);
        CHECK(strstr(err, "No such file or directory") != NULL);

        memset(longpath, 'x', sizeof(longpath) - 1);
        longpath[0] = '/';
        longpath[sizeof(longpath) - 1] = '\0';
        CHECK_ERR(client_connect(longpath, NULL, &c, err, sizeof(err)), -EINVAL);
        CHECK(strstr(err, "longer than") != NULL);
        CHECK_ERR(moeep_connect("/run/moeep/unused.sock", NULL), -EINVAL);

        /* $MOEEP_SOCKET picks the default path. */
        setenv("MOEEP_SOCKET", "/nonexistent/env.sock", 1);
        CHECK_ERR(client_connect(NULL, NULL, &c, err, sizeof(err)), -ENOENT);
        CHECK(strstr(err, "/nonexistent/env.sock") != NULL);
        unsetenv("MOEEP_SOCKET");
}

static void test_null_handle(void) {
        struct moeep_unique_id id = { { 0 } };
        struct moeep_region *regions;
        struct moeep_event ev;
        size_t n;

        CHECK_ERR(moeep_job_create(NULL, "x", 1, &id), -EINVAL);
        CHECK_ERR(moeep_job_join(NULL, &id, 0, 1, NULL), -EINVAL);
        CHECK_ERR(moeep_job_leave(NULL), -EINVAL);
        CHECK_ERR(moeep_job_barrier(NULL), -EINVAL);
        CHECK_ERR(moeep_job_info(NULL, NULL, NULL, NULL), -EINVAL);
        CHECK_ERR(moeep_region_register(NULL, 0, MOEEP_REGION_MEMFD, 1, 0, NULL), -EINVAL);
        CHECK_ERR(moeep_regions_fetch(NULL, -1, -1, &regions, &n), -EINVAL);
        CHECK_ERR(moeep_event_next(NULL, &ev), -EINVAL);
        CHECK_ERR(moeep_client_fd(NULL), -EINVAL);
        CHECK(moeep_job_control_page(NULL) == NULL);
        CHECK(moeep_client_error(NULL)[0] != '\0');
        moeep_client_free(NULL);
        moeep_regions_free(NULL, 3);
}

static void test_error_mapping(void) {
        static const struct {
                int code, err;
        } map[] = {
                { MOEEP__V1__ERROR_CODE__ERROR_BAD_RECORD, -EPROTO },
                { MOEEP__V1__ERROR_CODE__ERROR_VERSION_MISMATCH, -EPROTONOSUPPORT },
                { MOEEP__V1__ERROR_CODE__ERROR_NOT_WELCOMED, -EPROTO },
                { MOEEP__V1__ERROR_CODE__ERROR_INVALID_ARGUMENT, -EINVAL },
                { MOEEP__V1__ERROR_CODE__ERROR_NO_SUCH_JOB, -ENOENT },
                { MOEEP__V1__ERROR_CODE__ERROR_BAD_SECRET, -EACCES },
                { MOEEP__V1__ERROR_CODE__ERROR_RANK_OUT_OF_RANGE, -ERANGE },
                { MOEEP__V1__ERROR_CODE__ERROR_RANK_TAKEN, -EEXIST },
                { MOEEP__V1__ERROR_CODE__ERROR_WORLD_SIZE_MISMATCH, -EINVAL },
                { MOEEP__V1__ERROR_CODE__ERROR_LIMIT_EXCEEDED, -EUSERS },
                { MOEEP__V1__ERROR_CODE__ERROR_PERMISSION_DENIED, -EPERM },
                { MOEEP__V1__ERROR_CODE__ERROR_NOT_IN_JOB, -ENOTCONN },
                { MOEEP__V1__ERROR_CODE__ERROR_ALREADY_IN_JOB, -EISCONN },
                { MOEEP__V1__ERROR_CODE__ERROR_BAD_FDS, -EBADF },
                { MOEEP__V1__ERROR_CODE__ERROR_PEER_LOST, -ENOTCONN },
                { MOEEP__V1__ERROR_CODE__ERROR_INTERNAL, -EIO },
                { MOEEP__V1__ERROR_CODE__ERROR_DRAINING, -EAGAIN },
                { MOEEP__V1__ERROR_CODE__ERROR_UNKNOWN_TYPE, -EIO },
                { MOEEP__V1__ERROR_CODE__ERROR_NOT_READY, -EAGAIN },
                { MOEEP__V1__ERROR_CODE__ERROR_UNSPECIFIED, -EIO },
                { 12345, -EIO },
        };

        for (size_t i = 0; i < sizeof(map) / sizeof(map[0]); i++)
                CHECK_ERR(client_error_code_to_errno(map[i].code), map[i].err);
        CHECK(strcmp(client_error_code_to_string(MOEEP__V1__ERROR_CODE__ERROR_RANK_TAKEN),
                     "ERROR_RANK_TAKEN") == 0);
        CHECK(strcmp(client_error_code_to_string(12345), "ERROR_UNKNOWN") == 0);
}

static int region_memfd(const char *content) {
        int fd = memfd_create("test-region", MFD_CLOEXEC);

        if (fd < 0 || ftruncate(fd, 4096) < 0 || pwrite(fd, content, strlen(content) + 1, 0) < 0)
                abort();
        return fd;
}

static void test_arguments(struct moeep_client *c) {
        struct moeep_unique_id id = { { 0 } };
        struct moeep_region *regions;
        char name[80];
        size_t n;

        CHECK_ERR(moeep_job_create(c, "job", 0, &id), -EINVAL);
        CHECK(strstr(moeep_client_error(c), "world size 0") != NULL);
        CHECK_ERR(moeep_job_create(c, "job", MOEEP_MAX_RANKS + 1, &id), -EINVAL);
        CHECK_ERR(moeep_job_create(c, "", 1, &id), -EINVAL);
        CHECK_ERR(moeep_job_create(c, "bad\nname", 1, &id), -EINVAL);
        memset(name, 'a', 65);
        name[65] = '\0';
        CHECK_ERR(moeep_job_create(c, name, 1, &id), -EINVAL);
        CHECK_ERR(moeep_job_create(c, NULL, 1, &id), -EINVAL);
        CHECK_ERR(moeep_job_create(c, "job", 1, NULL), -EINVAL);
        CHECK_ERR(moeep_job_join(c, NULL, 0, 1, NULL), -EINVAL);
        CHECK_ERR(moeep_job_join(c, &id, 2, 2, NULL), -ERANGE);
        CHECK_ERR(moeep_job_join(c, &id, -1, 2, NULL), -ERANGE);
        CHECK_ERR(moeep_job_leave(c), -ENOTCONN);
        CHECK_ERR(moeep_job_barrier(c), -ENOTCONN);
        CHECK_ERR(moeep_job_info(c, NULL, NULL, NULL), -ENOTCONN);
        CHECK_ERR(moeep_regions_fetch(c, -1, -1, &regions, &n), -ENOTCONN);
        CHECK_ERR(moeep_regions_fetch(c, -1, -2, &regions, &n), -EINVAL);
        CHECK_ERR(moeep_region_register(c, -1, MOEEP_REGION_MEMFD, 4096, 0, NULL), -EBADF);
        CHECK_ERR(moeep_region_register(c, 0, (enum moeep_region_kind)9, 4096, 0, NULL), -EINVAL);
        CHECK_ERR(moeep_region_register(c, 0, MOEEP_REGION_MEMFD, 0, 0, NULL), -EINVAL);
}

static void test_job(const char *path) {
        struct moeep_client *a = NULL, *b = NULL, *x = NULL;
        struct moeep_unique_id id, wrong;
        struct moeep_region *regions = NULL;
        const volatile struct moeep_control_page *page;
        struct moeep_event ev;
        uint64_t job_id = 0, region_id = 0;
        int rank = -1, world = 0, fa, fb, n_events;
        char buf[16] = "";
        size_t n = 0;

        CHECK_ERR(moeep_connect(path, &a), 0);
        CHECK_ERR(moeep_connect(path, &b), 0);
        CHECK_ERR(moeep_connect(path, &x), 0);
        if (!a || !b || !x)
                return;
        CHECK(client_session_id(a) != client_session_id(b));
        CHECK(moeep_client_fd(a) >= 0 && moeep_client_fd(a) != moeep_client_fd(b));
        test_arguments(a);

        CHECK_ERR(moeep_job_create(a, "test-job", 2, &id), 0);
        CHECK(memcmp(id.bytes, FAKE_SECRET, strlen(FAKE_SECRET)) == 0);
        CHECK(id.bytes[strlen(FAKE_SECRET)] == 0 && id.bytes[MOEEP_UNIQUE_ID_BYTES - 1] == 0);

        CHECK_ERR(moeep_job_join(a, &id, 0, 2, "GPU-00000000-0000-0000-0000-000000000000"), 0);
        CHECK_ERR(moeep_job_join(b, &id, 1, 2, NULL), 0);
        CHECK_ERR(moeep_job_join(b, &id, 1, 2, NULL), -EISCONN);

        wrong = id;
        wrong.bytes[0] ^= 1;
        CHECK_ERR(moeep_job_join(x, &wrong, 1, 2, NULL), -EACCES);
        CHECK(strcmp(moeep_client_error(x), "moeepd: unique id does not match job 7") == 0);
        CHECK_ERR(moeep_job_join(x, &id, 1, 2, NULL), -EEXIST);
        CHECK(strstr(moeep_client_error(x), "moeepd: rank 1") == moeep_client_error(x));
        CHECK_ERR(moeep_event_next(x, &ev), 0);
        CHECK(moeep_client_error(x)[0] != '\0'); /* kept until the next call */
        CHECK_ERR(moeep_job_create(x, "other", 1, &wrong), 0);
        CHECK(moeep_client_error(x)[0] == '\0'); /* cleared by a successful call */

        CHECK_ERR(moeep_job_info(a, &job_id, &rank, &world), 0);
        CHECK(job_id == FAKE_JOB_ID && rank == 0 && world == 2);
        page = moeep_job_control_page(a);
        CHECK(page && page->magic == MOEEP_CONTROL_PAGE_MAGIC && page->abort == 0 && page->lost_rank == -1);
        CHECK_ERR(moeep_regions_fetch(a, 2, -1, &regions, &n), -ERANGE);

        fa = region_memfd("rank0");
        fb = region_memfd("rank1");
        CHECK_ERR(moeep_region_register(a, fa, MOEEP_REGION_MEMFD, 4096, 0, &region_id), 0);
        CHECK(region_id == 100);
        CHECK_ERR(moeep_region_register(b, fb, MOEEP_REGION_MEMFD, 4096, 0, NULL), 0);
        CHECK(fcntl(fa, F_GETFD) >= 0); /* still ours */
        close(fa);
        close(fb);

        CHECK_ERR(moeep_regions_fetch(a, -1, -1, &regions, &n), 0);
        CHECK(n == 1);
        if (n == 1) {
                CHECK(regions[0].rank == 1 && regions[0].kind == MOEEP_REGION_MEMFD &&
                      regions[0].size == 4096);
                CHECK(pread(regions[0].fd, buf, sizeof(buf), 0) > 0 && strcmp(buf, "rank1") == 0);
                CHECK((fcntl(regions[0].fd, F_GETFD) & FD_CLOEXEC) != 0);
        }
        moeep_regions_free(regions, n);

        /* The events the fake sends before answering the barrier are queued. */
        CHECK_ERR(moeep_event_next(a, &ev), 0);
        CHECK_ERR(moeep_job_barrier(a), 0);
        CHECK_ERR(moeep_event_next(a, &ev), 1);
        CHECK(ev.type == MOEEP_EVENT_PEER_LOST && ev.rank == 0 && ev.job_id == FAKE_JOB_ID);
        CHECK(strcmp(ev.reason, "test event") == 0);
        CHECK_ERR(moeep_event_next(a, &ev), 0);

        /* A full queue drops the oldest events and counts them. */
        CHECK_ERR(moeep_job_barrier(b), 0);
        CHECK(client_events_dropped(b) == FAKE_EVENTS_RANK1 - MOEEP_CLIENT_EVENT_QUEUE);
        n_events = 0;
        while (moeep_event_next(b, &ev) == 1) {
                CHECK(ev.rank == FAKE_EVENTS_RANK1 - MOEEP_CLIENT_EVENT_QUEUE + n_events);
                n_events++;
        }
        CHECK(n_events == MOEEP_CLIENT_EVENT_QUEUE);

        CHECK_ERR(moeep_job_leave(a), 0);
        CHECK_ERR(moeep_job_info(a, NULL, NULL, NULL), -ENOTCONN);
        CHECK(moeep_job_control_page(a) == NULL);

        /* A daemon that goes away: -ECONNRESET now and on every later call. */
        CHECK_ERR(moeep_job_create(x, "close-me", 1, &id), -ECONNRESET);
        CHECK(strstr(moeep_client_error(x), "moeepd closed the connection") != NULL);
        CHECK_ERR(moeep_job_create(x, "again", 1, &id), -ECONNRESET);
        CHECK_ERR(moeep_event_next(x, &ev), -ECONNRESET);

        moeep_client_free(a);
        moeep_client_free(b); /* leaves implicitly, unmaps the page */
        moeep_client_free(x);
}

int main(int argc, char **argv) {
        char dir[64], path[108];

        /* test-client --serve PATH: only the fake daemon, for test-ctl.sh. */
        if (argc == 3 && strcmp(argv[1], "--serve") == 0) {
                fake_start(argv[2]);
                for (;;)
                        pause();
        }

        test_no_daemon();
        test_null_handle();
        test_error_mapping();

        test_tmp_path(dir, sizeof(dir), "moeep-test-client-XXXXXX");
        if (!mkdtemp(dir)) {
                perror("mkdtemp");
                return 1;
        }
        snprintf(path, sizeof(path), "%s/moeepd.sock", dir);
        fake_start(path);
        test_job(path);
        unlink(path);
        rmdir(dir);

        if (failures) {
                fprintf(stderr, "%d checks failed\n", failures);
                return 1;
        }
        printf("all client checks passed\n");
        return 0;
}
