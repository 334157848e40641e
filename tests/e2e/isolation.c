/* moeep-e2e-isolation: one job must not be reachable by anyone else.
 *
 * A real moeepd (optionally under a wrapper such as valgrind) runs on a
 * socket that every uid may connect to (socket_mode 0666) with small caps.
 * Job A (2 ranks, uid ISO_UID_A, one process, a thread per rank) registers
 * memfd regions and then loops Barrier + RegionsFetch, checking its peer's
 * bytes every round, for the whole test. Meanwhile, as separate processes:
 *
 *   - a client of the same uid with no job, and one of another uid
 *     (ISO_UID_B), try to read job A's regions (RegionsFetch, RegionRelease,
 *     /proc/DAEMON/fd), join with a wrong secret, another job id, a cut id,
 *     a taken rank (a replayed id), and list status/jobs/clients: every try
 *     is refused with its typed error and the listings show nothing of A;
 *   - they make a job B of their own: fetching from it never yields A's
 *     regions;
 *   - where the daemon knows the operator requests (LogLevelSet, Drain),
 *     non-admins are refused ERROR_PERMISSION_DENIED and nothing changes;
 *   - uid B exhausts every cap: sessions, jobs, regions per session, fds
 *     per uid, bytes per uid (each refused ERROR_LIMIT_EXCEEDED, the cap
 *     holds exactly), and sends a record with 64 fds (ERROR_BAD_FDS);
 *   - after job A has ended, its id replayed gets ERROR_NO_SUCH_JOB.
 *
 * Job A must keep making progress during the attacks and find its data
 * intact; the daemon's descriptor count must be back to its baseline after
 * each attack; SIGTERM must stop the daemon with status 0 (with valgrind as
 * the wrapper: no errors, no definite or indirect leaks).
 *
 * Needs root (to switch uids); skipped (77) otherwise.
 *
 * usage: moeep-e2e-isolation MOEEPD [WRAPPER ARGS...]
 *        (the daemon runs as WRAPPER ARGS... MOEEPD -c CONFIG) */

/* The shared side of moeep-e2e-isolation (isolation.c): its caps and uids,
 * the run's state (temporary directory, daemon and job A processes, failure
 * count), say() and CHECK(), cleanup on every exit path, running a function
 * as another uid, and a session spoken to with raw records. */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <inttypes.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "../cleanup.h"
#include "../tmpdir.h"
#include "isolation-proc.h"
#include "moeep.h"
#include "record.h"
#include "say.h"

#define ISO_UID_A 64000 /* job A's uid, and the same-uid outsider's */
#define ISO_UID_B 65534 /* another uid (nobody) */
/* The caps the daemon runs with (see write_config). */
#define CAP_SESSIONS_PER_UID 8
#define CAP_JOBS_PER_UID 2
#define CAP_REGIONS_PER_SESSION 4
#define CAP_FDS_PER_UID 6  /* regions; the daemon's cap also holds the jobs' control pages: */
#define CONTROL_PAGE_FDS 2 /* job.h's JOB_CONTROL_FDS, charged per job to its creator's uid */
#define CAP_FDS_CONFIG (CAP_FDS_PER_UID + CONTROL_PAGE_FDS * CAP_JOBS_PER_UID)
#define CAP_BYTES_PER_UID (1u << 20)
#define REGION_BYTES 4096
#define TOTAL_TIMEOUT_S 280
#define START_TIMEOUT_MS 60000 /* valgrind starts slowly */

static char tmpdir[64];
static char sock_path[96], conf_path[96], log_path[96];
static pid_t daemon_pid = -1, job_a_pid = -1;
static int failures;

/* Shared with job A's process (MAP_SHARED before fork). */
struct job_a_state {
        atomic_uint rounds; /* barrier rounds both ranks completed and verified */
        atomic_uint bad;    /* rounds whose data or calls were wrong */
        atomic_int ready;   /* 1 once both ranks joined and registered */
        atomic_int stop;    /* set by the parent */
        uint8_t unique_id[MOEEP_UNIQUE_ID_BYTES];
        uint64_t region_ids[2];
        char error[256];
};
static struct job_a_state *job_a;

/* ---------------------------------------------------------------- helpers */

#define CHECK(cond, ...)                                                       \
        do {                                                                   \
                if (!(cond)) {                                                 \
                        printf("FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond); \
                        printf(__VA_ARGS__);                                   \
                        putchar('\n');                                         \
                        fflush(stdout);                                        \
                        failures++;                                            \
                }                                                              \
        } while (0)

/* Job A, the daemon and the temporary directory go on every way out
 * (tests/cleanup.h), within TOTAL_TIMEOUT_S. */
static void cleanup_setup(void) {
        cleanup_add_pid(&job_a_pid);
        cleanup_add_pid(&daemon_pid);
        cleanup_add_file(sock_path);
        cleanup_add_file(conf_path);
        cleanup_add_file(log_path);
        cleanup_arm(TOTAL_TIMEOUT_S, "isolation: timed out\n");
}

static void show_log(void) {
        char cmd[256];

        printf("--- last lines of the moeepd log\n");
        fflush(stdout);
        snprintf(cmd, sizeof(cmd), "tail -n 60 '%s'", log_path);
        (void)!system(cmd);
}

static int memfd_with(const char *text, size_t size) {
        int fd = memfd_create("isolation", MFD_CLOEXEC);

        if (fd < 0 || ftruncate(fd, (off_t)size) < 0)
                return -1;
        if (text && pwrite(fd, text, strlen(text) + 1, 0) < 0)
                return -1;
        return fd;
}

/* Runs fn() in a child process as uid/gid `uid` with no supplementary
 * groups; returns the number of failures it counted (its exit status). */
static int run_as(uid_t uid, const char *what, int (*fn)(void)) {
        pid_t pid;
        int st;

        fflush(stdout);
        pid = fork();
        if (pid < 0)
                return 1;
        if (pid == 0) {
                if (setgroups(0, NULL) < 0 || setresgid(uid, uid, uid) < 0 || setresuid(uid, uid, uid) < 0) {
                        printf("FAIL %s: cannot switch to uid %u: %s\n", what, (unsigned)uid,
                               strerror(errno));
                        _exit(1);
                }
                failures = 0;
                fn();
                fflush(stdout);
                _exit(failures > 100 ? 100 : failures);
        }
        if (waitpid(pid, &st, 0) < 0 || !WIFEXITED(st)) {
                printf("FAIL %s: the attacker process died (status 0x%x)\n", what, st);
                return 1;
        }
        if (WEXITSTATUS(st) == 0)
                say("ok: %s", what);
        return WEXITSTATUS(st);
}

/* ---------------------------------------------------------------- raw client */

/* A session spoken to with raw records (proto/record.h), for requests
 * libmoeep does not expose (listings, operator requests) and broken ones. */
struct raw {
        int fd;
        uint64_t rid;
        struct moeep_record rec;
};

static int raw_connect(struct raw *r) {
        struct sockaddr_un sa = { .sun_family = AF_UNIX };
        struct timeval tv = { .tv_sec = 20 };

        r->rid = 0;
        r->rec.nfds = 0;
        r->fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
        if (r->fd < 0)
                return -errno;
        setsockopt(r->fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
        snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", sock_path);
        if (connect(r->fd, (struct sockaddr *)&sa, sizeof(sa)) < 0) {
                int e = -errno;

                close(r->fd);
                r->fd = -1;
                return e;
        }
        return 0;
}

static void raw_close(struct raw *r) {
        moeep_record_release(&r->rec);
        if (r->fd >= 0)
                close(r->fd);
        r->fd = -1;
}

/* Receives the next Response (events are skipped). NULL when the daemon
 * closed the session or sent something undecodable. */
static Moeep__V1__Response *raw_response(struct raw *r) {
        for (;;) {
                moeep_record_release(&r->rec);
                if (moeep_record_recv(r->fd, &r->rec, NULL) < 0)
                        return NULL;
                if (r->rec.hdr.type >= MOEEP_TYPE_EVENT_MIN)
                        continue;
                return moeep_record_decode_response(&r->rec);
        }
}

/* Sends `req` and returns the response (free with
 * moeep__v1__response__free_unpacked), or NULL. */
static Moeep__V1__Response *raw_call(struct raw *r, Moeep__V1__Request *req, const int *fds, size_t nfds) {
        if (moeep_record_send(r->fd, (uint16_t)req->body_case, ++r->rid, &req->base, fds, nfds) < 0)
                return NULL;
        return raw_response(r);
}

/* Sends an encoded Request of type `type` whose payload the caller wrote
 * (for messages newer than this test's generated code). */
static Moeep__V1__Response *raw_call_bytes(struct raw *r, uint16_t type, const uint8_t *payload, size_t len) {
        struct moeep_record_header hdr = {
                .magic = MOEEP_RECORD_MAGIC,
                .major = MOEEP_PROTOCOL_MAJOR,
                .type = type,
                .length = (uint32_t)len,
                .request_id = ++r->rid,
        };
        uint8_t buf[512];

        memcpy(buf, &hdr, sizeof(hdr));
        memcpy(buf + sizeof(hdr), payload, len);
        if (moeep_record_send_raw(r->fd, buf, sizeof(hdr) + len, NULL, 0) < 0)
                return NULL;
        return raw_response(r);
}

/* The error code of a response (0 when it is not an Error); frees it. */
static int code_of(Moeep__V1__Response *resp) {
        int code;

        if (!resp)
                return -1;
        code = resp->body_case == MOEEP__V1__RESPONSE__BODY_ERROR ? (int)resp->error->code : 0;
        moeep__v1__response__free_unpacked(resp, NULL);
        return code;
}

static int raw_hello(struct raw *r) {
        Moeep__V1__Hello h = MOEEP__V1__HELLO__INIT;
        Moeep__V1__Request req = MOEEP__V1__REQUEST__INIT;
        Moeep__V1__Response *resp;

        h.major = MOEEP_PROTOCOL_MAJOR;
        h.minor = 1;
        h.features = ~(uint64_t)0; /* everything this test may try */
        h.client_name = "isolation";
        req.body_case = MOEEP__V1__REQUEST__BODY_HELLO;
        req.hello = &h;
        resp = raw_call(r, &req, NULL, 0);
        if (!resp)
                return -1;
        if (resp->body_case != MOEEP__V1__RESPONSE__BODY_WELCOME) {
                moeep__v1__response__free_unpacked(resp, NULL);
                return -1;
        }
        moeep__v1__response__free_unpacked(resp, NULL);
        return 0;
}

static Moeep__V1__Response *raw_simple(struct raw *r, Moeep__V1__Request__BodyCase what) {
        static Moeep__V1__StatusGet st = MOEEP__V1__STATUS_GET__INIT;
        static Moeep__V1__JobsList jl = MOEEP__V1__JOBS_LIST__INIT;
        static Moeep__V1__ClientsList cl = MOEEP__V1__CLIENTS_LIST__INIT;
        static Moeep__V1__Barrier bar = MOEEP__V1__BARRIER__INIT;
        static Moeep__V1__JobLeave leave = MOEEP__V1__JOB_LEAVE__INIT;
        Moeep__V1__Request req = MOEEP__V1__REQUEST__INIT;

        req.body_case = what;
        switch (what) {
        case MOEEP__V1__REQUEST__BODY_STATUS_GET:
                req.status_get = &st;
                break;
        case MOEEP__V1__REQUEST__BODY_JOBS_LIST:
                req.jobs_list = &jl;
                break;
        case MOEEP__V1__REQUEST__BODY_CLIENTS_LIST:
                req.clients_list = &cl;
                break;
        case MOEEP__V1__REQUEST__BODY_BARRIER:
                req.barrier = &bar;
                break;
        case MOEEP__V1__REQUEST__BODY_JOB_LEAVE:
                req.job_leave = &leave;
                break;
        default:
                return NULL;
        }
        return raw_call(r, &req, NULL, 0);
}

static int raw_fetch(struct raw *r, int32_t rank, int64_t tag, size_t *ret_n) {
        Moeep__V1__RegionsFetch rf = MOEEP__V1__REGIONS_FETCH__INIT;
        Moeep__V1__Request req = MOEEP__V1__REQUEST__INIT;
        Moeep__V1__Response *resp;

        rf.rank = rank;
        rf.tag = tag;
        req.body_case = MOEEP__V1__REQUEST__BODY_REGIONS_FETCH;
        req.regions_fetch = &rf;
        resp = raw_call(r, &req, NULL, 0);
        if (resp && resp->body_case == MOEEP__V1__RESPONSE__BODY_REGIONS) {
                *ret_n = resp->regions->n_regions;
                moeep__v1__response__free_unpacked(resp, NULL);
                return 0;
        }
        return code_of(resp);
}

static int raw_release(struct raw *r, uint64_t id) {
        Moeep__V1__RegionRelease rel = MOEEP__V1__REGION_RELEASE__INIT;
        Moeep__V1__Request req = MOEEP__V1__REQUEST__INIT;

        rel.region_id = id;
        req.body_case = MOEEP__V1__REQUEST__BODY_REGION_RELEASE;
        req.region_release = &rel;
        return code_of(raw_call(r, &req, NULL, 0));
}

/* ---------------------------------------------------------------- job A */

struct rank_arg {
        int rank;
        pthread_barrier_t *local;
        struct moeep_client *client;
};

static void job_a_bad(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void job_a_bad(const char *fmt, ...) {
        va_list ap;

        va_start(ap, fmt);
        vsnprintf(job_a->error, sizeof(job_a->error), fmt, ap);
        va_end(ap);
        atomic_fetch_add(&job_a->bad, 1);
}

/* One rank of job A: barrier, fetch the peer's region, check its bytes;
 * until the parent says stop (decided between two local barriers so that
 * both ranks stop after the same round). */
static void *job_a_rank(void *p) {
        struct rank_arg *a = p;
        char want[64], got[64];
        int peer = 1 - a->rank;

        snprintf(want, sizeof(want), "job A rank %d data", peer);
        for (;;) {
                struct moeep_region *regs = NULL;
                size_t n = 0;
                int r;

                r = moeep_job_barrier(a->client);
                if (r < 0)
                        job_a_bad("rank %d: barrier: %s", a->rank, moeep_client_error(a->client));
                r = moeep_regions_fetch(a->client, -1, -1, &regs, &n);
                if (r < 0 || n != 1 || regs[0].rank != peer ||
                    pread(regs[0].fd, got, sizeof(got), 0) != (ssize_t)sizeof(got) || strcmp(got, want) != 0)
                        job_a_bad("rank %d: fetch: r=%d n=%zu: %s", a->rank, r, n,
                                  moeep_client_error(a->client));
                moeep_regions_free(regs, n);
                if (a->rank == 0)
                        atomic_fetch_add(&job_a->rounds, 1);
                pthread_barrier_wait(a->local);
                if (a->rank == 0)
                        job_a->ready = atomic_load(&job_a->stop) ? 2 : 1;
                pthread_barrier_wait(a->local);
                if (job_a->ready == 2)
                        break;
                sleep_ms(2);
        }
        if (moeep_job_control_page(a->client)->abort != 0)
                job_a_bad("rank %d: the control page says aborted", a->rank);
        if (moeep_job_leave(a->client) < 0)
                job_a_bad("rank %d: leave: %s", a->rank, moeep_client_error(a->client));
        return NULL;
}

static int job_a_main(void) {
        struct moeep_client *c[2] = { NULL, NULL };
        struct rank_arg args[2];
        pthread_barrier_t local;
        pthread_t th[2];
        struct moeep_unique_id id;

        for (int r = 0; r < 2; r++)
                if (moeep_connect(sock_path, &c[r]) < 0) {
                        job_a_bad("rank %d: connect failed", r);
                        return 1;
                }
        if (moeep_job_create(c[0], "job-A", 2, &id) < 0) {
                job_a_bad("create: %s", moeep_client_error(c[0]));
                return 1;
        }
        memcpy(job_a->unique_id, id.bytes, sizeof(id.bytes));
        for (int r = 0; r < 2; r++) {
                char text[64];
                int fd;

                snprintf(text, sizeof(text), "job A rank %d data", r);
                fd = memfd_with(text, REGION_BYTES);
                if (moeep_job_join(c[r], &id, r, 2, NULL) < 0 ||
                    moeep_region_register(c[r], fd, MOEEP_REGION_MEMFD, REGION_BYTES, 0,
                                          &job_a->region_ids[r]) < 0) {
                        job_a_bad("rank %d: join/register: %s", r, moeep_client_error(c[r]));
                        return 1;
                }
                close(fd);
        }
        pthread_barrier_init(&local, NULL, 2);
        job_a->ready = 1;
        for (int r = 0; r < 2; r++) {
                args[r] = (struct rank_arg){ .rank = r, .local = &local, .client = c[r] };
                pthread_create(&th[r], NULL, job_a_rank, &args[r]);
        }
        for (int r = 0; r < 2; r++)
                pthread_join(th[r], NULL);
        for (int r = 0; r < 2; r++)
                moeep_client_free(c[r]);
        return 0;
}

/* ---------------------------------------------------------------- attacks */

/* A unique id that names job A but differs in `how`. */
static void id_variant(struct moeep_unique_id *id, int how) {
        memcpy(id->bytes, job_a->unique_id, sizeof(id->bytes));
        switch (how) {
        case 0: /* one secret bit */
                id->bytes[9 + 17] ^= 0x10;
                break;
        case 1: /* another job id, same secret */
                id->bytes[1] ^= 0x40;
                break;
        case 2: /* all-zero secret */
                memset(id->bytes + 9, 0, 32);
                break;
        }
}

/* Everything an outsider (in no job) can try; the same for both uids. */
static int attack_outsider(void) {
        struct moeep_client *c = NULL;
        struct moeep_unique_id id;
        struct moeep_region *regs = NULL;
        Moeep__V1__Response *resp;
        struct raw raw;
        size_t n = 99;
        int r;

        CHECK(moeep_connect(sock_path, &c) == 0, "connect");
        if (!c)
                return 1;
        /* Reading A's regions without being in a job. */
        r = moeep_regions_fetch(c, 0, -1, &regs, &n);
        CHECK(r == -ENOTCONN, "fetch rank 0 outside a job: %d", r);
        r = moeep_regions_fetch(c, -1, -1, &regs, &n);
        CHECK(r == -ENOTCONN, "fetch all outside a job: %d", r);
        for (int i = 0; i < 2; i++) {
                r = moeep_region_release(c, job_a->region_ids[i]);
                CHECK(r == -ENOTCONN, "release A's region %" PRIu64 ": %d", job_a->region_ids[i], r);
        }
        CHECK(moeep_job_barrier(c) == -ENOTCONN, "barrier outside a job");
        CHECK(moeep_job_leave(c) == -ENOTCONN, "leave outside a job");

        /* Wrong secrets, other ids, cut ids: typed refusals; the session
         * stays usable (a refused join is a content error). */
        for (int how = 0; how < 3; how++) {
                id_variant(&id, how);
                r = moeep_job_join(c, &id, 0, 2, NULL);
                CHECK(r == -ENOENT, "join with id variant %d: %d (%s)", how, r, moeep_client_error(c));
        }
        /* Guessing: refused alike, a wrong secret as an unknown id; past
         * the uid's allowance of wrong joins (32 at once, 8 a second),
         * unchecked. */
        for (int i = 0, unchecked = 0; i < 64; i++) {
                memcpy(id.bytes, job_a->unique_id, sizeof(id.bytes));
                for (int b = 9; b < 41; b++)
                        id.bytes[b] = (uint8_t)rand();
                r = moeep_job_join(c, &id, i % 2, 2, NULL);
                unchecked += r == -EUSERS;
                CHECK(r == -ENOENT || (i >= 32 - 3 && r == -EUSERS), "guessed secret %d: %d (%s)", i, r,
                      moeep_client_error(c));
                CHECK(i < 63 || unchecked > 0, "64 wrong joins at once, none refused by the allowance");
        }
        usleep(500 * 1000); /* the allowance grows back: joins are checked again */
        /* A replayed (valid) id for the ranks already taken. */
        memcpy(id.bytes, job_a->unique_id, sizeof(id.bytes));
        for (int rank = 0; rank < 2; rank++) {
                r = moeep_job_join(c, &id, rank, 2, NULL);
                CHECK(r == -EEXIST, "replayed id for taken rank %d: %d (%s)", rank, r, moeep_client_error(c));
        }
        CHECK(moeep_job_join(c, &id, 2, 2, NULL) == -ERANGE, "replayed id, rank 2 of 2");
        CHECK(moeep_job_join(c, &id, 0, 3, NULL) == -EINVAL, "replayed id, world size 3");
        moeep_client_free(c);

        /* Raw: a cut unique id; listings show nothing of job A. */
        CHECK(raw_connect(&raw) == 0 && raw_hello(&raw) == 0, "raw hello");
        {
                Moeep__V1__JobJoin jj = MOEEP__V1__JOB_JOIN__INIT;
                Moeep__V1__Request req = MOEEP__V1__REQUEST__INIT;

                jj.unique_id.data = job_a->unique_id;
                jj.unique_id.len = 20;
                jj.rank = 0;
                jj.world_size = 2;
                req.body_case = MOEEP__V1__REQUEST__BODY_JOB_JOIN;
                req.job_join = &jj;
                r = code_of(raw_call(&raw, &req, NULL, 0));
                CHECK(r == MOEEP__V1__ERROR_CODE__ERROR_INVALID_ARGUMENT, "join with a cut id: code %d", r);
        }
        /* libmoeep refuses job requests outside a job by itself; the
         * daemon must too. */
        r = raw_fetch(&raw, 0, -1, &n);
        CHECK(r == MOEEP__V1__ERROR_CODE__ERROR_NOT_IN_JOB, "raw fetch outside a job: code %d", r);
        r = raw_fetch(&raw, -1, -1, &n);
        CHECK(r == MOEEP__V1__ERROR_CODE__ERROR_NOT_IN_JOB, "raw fetch all outside a job: code %d", r);
        for (int i = 0; i < 2; i++) {
                r = raw_release(&raw, job_a->region_ids[i]);
                CHECK(r == MOEEP__V1__ERROR_CODE__ERROR_NOT_IN_JOB, "raw release of A's region: code %d", r);
        }
        r = code_of(raw_simple(&raw, MOEEP__V1__REQUEST__BODY_BARRIER));
        CHECK(r == MOEEP__V1__ERROR_CODE__ERROR_NOT_IN_JOB, "raw barrier outside a job: code %d", r);
        r = code_of(raw_simple(&raw, MOEEP__V1__REQUEST__BODY_JOB_LEAVE));
        CHECK(r == MOEEP__V1__ERROR_CODE__ERROR_NOT_IN_JOB, "raw leave outside a job: code %d", r);
        resp = raw_simple(&raw, MOEEP__V1__REQUEST__BODY_STATUS_GET);
        CHECK(resp && resp->body_case == MOEEP__V1__RESPONSE__BODY_STATUS, "status");
        if (resp && resp->body_case == MOEEP__V1__RESPONSE__BODY_STATUS)
                CHECK(resp->status->sessions == 1 && resp->status->jobs == 0,
                      "status shows %u sessions, %u jobs to an outsider (want 1, 0)", resp->status->sessions,
                      resp->status->jobs);
        if (resp)
                moeep__v1__response__free_unpacked(resp, NULL);
        resp = raw_simple(&raw, MOEEP__V1__REQUEST__BODY_JOBS_LIST);
        CHECK(resp && resp->body_case == MOEEP__V1__RESPONSE__BODY_JOBS && resp->jobs->n_jobs == 0,
              "jobs list of an outsider is not empty");
        if (resp)
                moeep__v1__response__free_unpacked(resp, NULL);
        resp = raw_simple(&raw, MOEEP__V1__REQUEST__BODY_CLIENTS_LIST);
        CHECK(resp && resp->body_case == MOEEP__V1__RESPONSE__BODY_CLIENTS && resp->clients->n_clients == 1 &&
                      resp->clients->clients[0]->pid == (uint32_t)getpid(),
              "clients list of an outsider shows others");
        if (resp)
                moeep__v1__response__free_unpacked(resp, NULL);
        raw_close(&raw);

        /* The daemon's descriptors (job A's regions among them) are not
         * reachable through /proc either. */
        for (int fd = 0; fd < 64; fd++) {
                char path[64];
                int f;

                snprintf(path, sizeof(path), "/proc/%d/fd/%d", (int)daemon_pid, fd);
                f = open(path, O_RDONLY | O_CLOEXEC);
                CHECK(f < 0, "opened %s", path);
                if (f >= 0)
                        close(f);
        }
        return failures;
}

/* An outsider with a job of its own (job B): fetching and releasing only
 * ever reach job B. */
static int attack_own_job(void) {
        struct moeep_client *c = NULL;
        struct moeep_unique_id id;
        Moeep__V1__Response *resp;
        struct raw raw;
        size_t n = 99;
        uint64_t mine = 0;
        int fd, r;

        CHECK(raw_connect(&raw) == 0 && raw_hello(&raw) == 0, "raw hello");
        CHECK(moeep_connect(sock_path, &c) == 0, "connect");
        if (!c || raw.fd < 0)
                return 1;
        CHECK(moeep_job_create(c, "job-B", 2, &id) == 0, "create job B: %s", moeep_client_error(c));
        CHECK(moeep_job_join(c, &id, 0, 2, NULL) == 0, "join job B: %s", moeep_client_error(c));
        fd = memfd_with("job B data", REGION_BYTES);
        CHECK(moeep_region_register(c, fd, MOEEP_REGION_MEMFD, REGION_BYTES, 0, &mine) == 0, "register in B");
        close(fd);
        /* Joining A while in B. */
        {
                struct moeep_unique_id a;

                memcpy(a.bytes, job_a->unique_id, sizeof(a.bytes));
                r = moeep_job_join(c, &a, 0, 2, NULL);
                CHECK(r == -EISCONN || r == -EEXIST, "join A while in B: %d", r);
        }
        {
                Moeep__V1__JobJoin jj = MOEEP__V1__JOB_JOIN__INIT;
                Moeep__V1__Request req = MOEEP__V1__REQUEST__INIT;

                jj.unique_id.data = id.bytes;
                jj.unique_id.len = MOEEP_UNIQUE_ID_BYTES;
                jj.rank = 1;
                jj.world_size = 2;
                req.body_case = MOEEP__V1__REQUEST__BODY_JOB_JOIN;
                req.job_join = &jj;
                r = code_of(raw_call(&raw, &req, NULL, 0));
                CHECK(r == 0, "raw join of job B rank 1: code %d", r);
        }
        /* Every fetch the member of B can make: B's regions only. */
        CHECK(raw_fetch(&raw, -1, -1, &n) == 0 && n == 1, "fetch all in B: n=%zu", n);
        CHECK(raw_fetch(&raw, 0, -1, &n) == 0 && n == 1, "fetch rank 0 of B: n=%zu", n);
        CHECK(raw_fetch(&raw, 1, -1, &n) == 0 && n == 0, "fetch own rank in B: n=%zu", n);
        r = raw_fetch(&raw, 2, -1, &n);
        CHECK(r == MOEEP__V1__ERROR_CODE__ERROR_RANK_OUT_OF_RANGE, "fetch rank 2 of B: code %d", r);
        r = raw_fetch(&raw, -1, (int64_t)1 << 40, &n);
        CHECK(r == MOEEP__V1__ERROR_CODE__ERROR_INVALID_ARGUMENT, "fetch tag 2^40: code %d", r);
        /* A's region ids (and every small id) are not ours to release. */
        for (int i = 0; i < 2; i++) {
                r = raw_release(&raw, job_a->region_ids[i]);
                CHECK(r == MOEEP__V1__ERROR_CODE__ERROR_INVALID_ARGUMENT, "release A's region: code %d", r);
        }
        for (uint64_t i = 0; i < 64; i++)
                if (i != mine) {
                        r = raw_release(&raw, i);
                        CHECK(r == MOEEP__V1__ERROR_CODE__ERROR_INVALID_ARGUMENT,
                              "release region %" PRIu64 " as a member of B: code %d", i, r);
                }
        resp = raw_simple(&raw, MOEEP__V1__REQUEST__BODY_JOBS_LIST);
        CHECK(resp && resp->body_case == MOEEP__V1__RESPONSE__BODY_JOBS && resp->jobs->n_jobs == 1 &&
                      strcmp(resp->jobs->jobs[0]->name, "job-B") == 0,
              "a member of B sees a job other than B");
        if (resp)
                moeep__v1__response__free_unpacked(resp, NULL);
        resp = raw_simple(&raw, MOEEP__V1__REQUEST__BODY_CLIENTS_LIST);
        CHECK(resp && resp->body_case == MOEEP__V1__RESPONSE__BODY_CLIENTS && resp->clients->n_clients == 2,
              "a member of B sees clients outside B");
        if (resp)
                moeep__v1__response__free_unpacked(resp, NULL);
        raw_close(&raw);
        moeep_client_free(c);
        return failures;
}

/* Operator requests, where the daemon knows them: refused to non-admins.
 * Encoded by hand (field numbers from moeep.proto) so that this test builds
 * against a proto without them. */
static int attack_operator(void) {
        /* Request.log_level_set (14) = LogLevelSet{level (1) = "debug"} */
        static const uint8_t log_level[] = { 0x72, 0x07, 0x0a, 0x05, 'd', 'e', 'b', 'u', 'g' };
        /* Request.drain (15) = Drain{on (1) = true} */
        static const uint8_t drain[] = { 0x7a, 0x02, 0x08, 0x01 };
        struct raw raw;
        int r;

        CHECK(raw_connect(&raw) == 0 && raw_hello(&raw) == 0, "raw hello");
        r = code_of(raw_call_bytes(&raw, 14, log_level, sizeof(log_level)));
        CHECK(r == MOEEP__V1__ERROR_CODE__ERROR_PERMISSION_DENIED, "LogLevelSet by a non-admin: code %d", r);
        r = code_of(raw_call_bytes(&raw, 15, drain, sizeof(drain)));
        CHECK(r == MOEEP__V1__ERROR_CODE__ERROR_PERMISSION_DENIED, "Drain by a non-admin: code %d", r);
        raw_close(&raw);
        /* Not draining: a new job can still be made. */
        {
                struct moeep_client *c = NULL;
                struct moeep_unique_id id;

                CHECK(moeep_connect(sock_path, &c) == 0, "connect");
                r = c ? moeep_job_create(c, "after-drain", 1, &id) : -1;
                CHECK(r == 0, "JobCreate after a refused Drain: %d", r);
                moeep_client_free(c);
        }
        return failures;
}

/* uid B exhausts every cap. */
static int attack_caps(void) {
        struct moeep_client *c[CAP_SESSIONS_PER_UID] = { NULL };
        struct moeep_client *extra = NULL;
        struct moeep_unique_id id1, id2, spare;
        uint64_t rid[CAP_FDS_PER_UID + 1];
        struct raw raw;
        int fd, r, nregs = 0;

        /* Sessions: CAP_SESSIONS_PER_UID connect, the next is refused
         * before Hello with an Error it can read. */
        for (int i = 0; i < CAP_SESSIONS_PER_UID; i++)
                CHECK(moeep_connect(sock_path, &c[i]) == 0, "session %d of %d", i + 1, CAP_SESSIONS_PER_UID);
        CHECK(raw_connect(&raw) == 0, "raw connect over the cap");
        {
                Moeep__V1__Response *resp = raw_response(&raw);

                r = code_of(resp);
                CHECK(r == MOEEP__V1__ERROR_CODE__ERROR_LIMIT_EXCEEDED && raw.rec.hdr.request_id == 0,
                      "session over max_sessions_per_uid: code %d", r);
                CHECK(raw_response(&raw) == NULL, "the refused session stays open");
        }
        raw_close(&raw);
        /* Through libmoeep the refusal is typed too: whether its Hello went
         * out before the daemon closed or not, it reads the queued Error. */
        r = moeep_connect(sock_path, &extra);
        CHECK(r == -EUSERS, "moeep_connect over max_sessions_per_uid: %d, want -EUSERS", r);
        moeep_client_free(extra);
        for (int i = 3; i < CAP_SESSIONS_PER_UID; i++) {
                moeep_client_free(c[i]);
                c[i] = NULL;
        }

        /* Jobs: CAP_JOBS_PER_UID, then refused. */
        CHECK(moeep_job_create(c[0], "caps-1", 2, &id1) == 0, "job 1");
        CHECK(moeep_job_create(c[0], "caps-2", 1, &id2) == 0, "job 2");
        r = moeep_job_create(c[1], "caps-3", 1, &spare);
        CHECK(r == -EUSERS, "job over max_jobs_per_uid: %d", r);

        /* Regions per session: c[0] registers up to the cap. */
        CHECK(moeep_job_join(c[0], &id1, 0, 2, NULL) == 0, "join caps-1 rank 0");
        CHECK(moeep_job_join(c[1], &id1, 1, 2, NULL) == 0, "join caps-1 rank 1");
        CHECK(moeep_job_join(c[2], &id2, 0, 1, NULL) == 0, "join caps-2 rank 0");
        fd = memfd_with("caps", 2u << 20);
        for (int i = 0; i < CAP_REGIONS_PER_SESSION; i++) {
                r = moeep_region_register(c[0], fd, MOEEP_REGION_MEMFD, REGION_BYTES, 0, &rid[nregs]);
                CHECK(r == 0, "region %d of %d: %d", i + 1, CAP_REGIONS_PER_SESSION, r);
                nregs += r == 0;
        }
        r = moeep_region_register(c[0], fd, MOEEP_REGION_MEMFD, REGION_BYTES, 0, &rid[nregs]);
        CHECK(r == -EUSERS, "region over max_regions_per_session: %d", r);
        /* Fds per uid: the other sessions fill the uid's cap. */
        while (nregs < CAP_FDS_PER_UID) {
                r = moeep_region_register(c[1 + nregs % 2], fd, MOEEP_REGION_MEMFD, REGION_BYTES, 0,
                                          &rid[nregs]);
                CHECK(r == 0, "region %d of uid cap %d: %d", nregs + 1, CAP_FDS_PER_UID, r);
                if (r < 0)
                        break;
                nregs++;
        }
        r = moeep_region_register(c[2], fd, MOEEP_REGION_MEMFD, REGION_BYTES, 0, &rid[nregs]);
        CHECK(r == -EUSERS, "region over max_fds_per_uid: %d", r);
        /* Bytes per uid: free one fd, then ask for more than the cap. */
        CHECK(moeep_region_release(c[0], rid[0]) == 0, "release one region");
        r = moeep_region_register(c[0], fd, MOEEP_REGION_MEMFD, 2u << 20, 0, &rid[0]);
        CHECK(r == -EUSERS, "region of 2 MiB over max_region_bytes_per_uid: %d", r);
        r = moeep_region_register(c[0], fd, MOEEP_REGION_MEMFD, CAP_BYTES_PER_UID - 4 * REGION_BYTES, 0,
                                  &rid[0]);
        CHECK(r == -EUSERS, "region reaching past max_region_bytes_per_uid: %d", r);
        r = moeep_region_register(c[0], fd, MOEEP_REGION_MEMFD, CAP_BYTES_PER_UID - 5 * REGION_BYTES, 0,
                                  &rid[0]);
        CHECK(r == 0, "region filling max_region_bytes_per_uid exactly: %d", r);
        /* Lying about the size of a memfd. */
        r = moeep_region_register(c[1], fd, MOEEP_REGION_MEMFD, 4u << 20, 0, &rid[1]);
        CHECK(r == -EINVAL || r == -EUSERS, "region larger than its memfd: %d", r);
        close(fd);

        /* A flood of descriptors on one record: refused, session closed. */
        CHECK(raw_connect(&raw) == 0 && raw_hello(&raw) == 0, "raw hello");
        {
                Moeep__V1__RegionRegister rr = MOEEP__V1__REGION_REGISTER__INIT;
                Moeep__V1__Request req = MOEEP__V1__REQUEST__INIT;
                int fds[MOEEP_RECORD_MAX_FDS];

                for (int i = 0; i < MOEEP_RECORD_MAX_FDS; i++)
                        fds[i] = memfd_with(NULL, REGION_BYTES);
                rr.kind = MOEEP__V1__REGION_KIND__REGION_KIND_MEMFD;
                rr.size = REGION_BYTES;
                req.body_case = MOEEP__V1__REQUEST__BODY_REGION_REGISTER;
                req.region_register = &rr;
                r = code_of(raw_call(&raw, &req, fds, MOEEP_RECORD_MAX_FDS));
                CHECK(r == MOEEP__V1__ERROR_CODE__ERROR_BAD_FDS, "64 fds on RegionRegister: code %d", r);
                CHECK(raw_response(&raw) == NULL, "session open after a bad record");
                for (int i = 0; i < MOEEP_RECORD_MAX_FDS; i++)
                        close(fds[i]);
        }
        raw_close(&raw);
        for (int i = 0; i < 3; i++)
                moeep_client_free(c[i]);
        return failures;
}

/* Job A is gone: its id names nothing. */
static int attack_replay_after_end(void) {
        struct moeep_client *c = NULL;
        struct moeep_unique_id id;
        int r;

        memcpy(id.bytes, job_a->unique_id, sizeof(id.bytes));
        CHECK(moeep_connect(sock_path, &c) == 0, "connect");
        if (!c)
                return 1;
        for (int rank = 0; rank < 2; rank++) {
                r = moeep_job_join(c, &id, rank, 2, NULL);
                CHECK(r == -ENOENT, "replayed id of the ended job A, rank %d: %d", rank, r);
        }
        moeep_client_free(c);
        return failures;
}

/* ---------------------------------------------------------------- main */

static int write_config(void) {
        FILE *f = fopen(conf_path, "w");

        if (!f)
                return -1;
        fprintf(f,
                "[moeepd]\n"
                "socket = %s\n"
                "socket_mode = 0666\n"
                "admin_group =\n"
                "log_level = info\n"
                "max_sessions_per_uid = %d\n"
                "max_jobs_per_uid = %d\n"
                "max_regions_per_session = %d\n"
                "max_fds_per_uid = %d\n"
                "max_region_bytes_per_uid = %u\n",
                sock_path, CAP_SESSIONS_PER_UID, CAP_JOBS_PER_UID, CAP_REGIONS_PER_SESSION, CAP_FDS_CONFIG,
                CAP_BYTES_PER_UID);
        return fclose(f);
}

static int start_daemon(char **wrapper, int nwrapper, const char *moeepd) {
        char **argv = calloc((size_t)nwrapper + 4, sizeof(char *));
        int n = 0;

        if (!argv)
                return -1;
        for (int i = 0; i < nwrapper; i++)
                argv[n++] = wrapper[i];
        argv[n++] = (char *)moeepd;
        argv[n++] = "-c";
        argv[n++] = conf_path;
        daemon_pid = proc_spawn_logged(argv, log_path);
        free(argv);
        if (daemon_pid < 0)
                return -1;
        for (int waited = 0; waited < START_TIMEOUT_MS; waited += 50) {
                struct raw raw;

                if (waitpid(daemon_pid, NULL, WNOHANG) == daemon_pid) {
                        daemon_pid = -1;
                        return -1;
                }
                if (raw_connect(&raw) == 0) {
                        int ok = raw_hello(&raw) == 0;

                        raw_close(&raw);
                        if (ok)
                                return 0;
                }
                sleep_ms(50);
        }
        return -1;
}

static int stop_daemon(void) {
        int st = 0;

        kill(daemon_pid, SIGTERM);
        for (int i = 0; i < 1200; i++) {
                if (waitpid(daemon_pid, &st, WNOHANG) == daemon_pid) {
                        daemon_pid = -1;
                        return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
                }
                sleep_ms(50);
        }
        return -1;
}

/* Runs one attack and checks that job A kept going and the daemon's fds
 * came back. */
static void attack(uid_t uid, const char *what, int (*fn)(void), int fds_base) {
        unsigned before = atomic_load(&job_a->rounds);
        int n;

        failures += run_as(uid, what, fn);
        n = proc_fds_settle(daemon_pid, fds_base);
        CHECK(n == fds_base, "after '%s' the daemon holds %d fds, %d before", what, n, fds_base);
        for (int i = 0; i < 400 && atomic_load(&job_a->rounds) < before + 3; i++)
                sleep_ms(25);
        CHECK(atomic_load(&job_a->rounds) >= before + 3, "job A made no progress during '%s'", what);
        CHECK(atomic_load(&job_a->bad) == 0, "job A went wrong during '%s': %s", what, job_a->error);
}

int main(int argc, char **argv) {
        int fds_idle, fds_base, st, rc;

        if (argc < 2) {
                fprintf(stderr, "usage: %s MOEEPD [WRAPPER ARGS...]\n", argv[0]);
                return 2;
        }
        if (geteuid() != 0) {
                say("isolation: needs root to run clients as other uids; skipped");
                return 77;
        }
        setvbuf(stdout, NULL, _IOLBF, 0);
        cleanup_setup();
        signal(SIGPIPE, SIG_IGN);
        srand(7);
        test_tmp_path(tmpdir, sizeof(tmpdir), "moeep-isolation.XXXXXX");
        if (!mkdtemp(tmpdir) || chmod(tmpdir, 0711) < 0) {
                perror("isolation: temp dir");
                return 1;
        }
        cleanup_add_dir(tmpdir);
        snprintf(sock_path, sizeof(sock_path), "%s/moeepd.sock", tmpdir);
        snprintf(conf_path, sizeof(conf_path), "%s/moeepd.conf", tmpdir);
        snprintf(log_path, sizeof(log_path), "%s/moeepd.log", tmpdir);
        job_a = mmap(NULL, sizeof(*job_a), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
        if (job_a == MAP_FAILED || write_config() < 0) {
                perror("isolation: setup");
                return 1;
        }
        memset(job_a, 0, sizeof(*job_a));
        if (start_daemon(argv + 2, argc - 2, argv[1]) < 0) {
                say("FAIL: moeepd did not start");
                show_log();
                return 1;
        }
        sleep_ms(100);
        fds_idle = proc_count_fds(daemon_pid);

        fflush(stdout);
        job_a_pid = fork();
        if (job_a_pid == 0) {
                if (setgroups(0, NULL) < 0 || setresgid(ISO_UID_A, ISO_UID_A, ISO_UID_A) < 0 ||
                    setresuid(ISO_UID_A, ISO_UID_A, ISO_UID_A) < 0)
                        _exit(1);
                _exit(job_a_main());
        }
        for (int i = 0; i < 1200 && job_a->ready == 0 && atomic_load(&job_a->bad) == 0; i++)
                sleep_ms(50);
        if (job_a->ready == 0 || atomic_load(&job_a->bad) != 0) {
                say("FAIL: job A did not start: %s", job_a->error);
                show_log();
                return 1;
        }
        for (int i = 0; i < 400 && atomic_load(&job_a->rounds) < 3; i++)
                sleep_ms(25);
        fds_base = proc_count_fds(daemon_pid);
        say("ok: job A (uid %d, 2 ranks) runs: %u rounds; moeepd holds %d fds (%d idle)", ISO_UID_A,
            atomic_load(&job_a->rounds), fds_base, fds_idle);

        attack(ISO_UID_A, "same uid, no job: every read, join and listing refused", attack_outsider,
               fds_base);
        attack(ISO_UID_B, "other uid, no job: every read, join and listing refused", attack_outsider,
               fds_base);
        attack(ISO_UID_A, "same uid, own job B: fetch and release reach only B", attack_own_job, fds_base);
        attack(ISO_UID_B, "other uid, own job B: fetch and release reach only B", attack_own_job, fds_base);
        if (moeep_record_type_known(14) && moeep_record_type_known(15))
                attack(ISO_UID_B, "operator requests (LogLevelSet, Drain) refused to non-admins",
                       attack_operator, fds_base);
        else
                say("skip: this protocol has no LogLevelSet/Drain: operator requests not tested");
        attack(ISO_UID_B, "other uid: every cap refused at its limit (sessions, jobs, regions, fds, bytes)",
               attack_caps, fds_base);
        /* The same again: caps are given back when their holders go. */
        attack(ISO_UID_B, "other uid: caps again, after everything was given back", attack_caps, fds_base);

        atomic_store(&job_a->stop, 1);
        if (waitpid(job_a_pid, &st, 0) == job_a_pid)
                job_a_pid = -1;
        CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0 && atomic_load(&job_a->bad) == 0,
              "job A ended badly (status 0x%x): %s", st, job_a->error);
        say("ok: job A made %u barrier+fetch rounds, every one with its peer's data intact",
            atomic_load(&job_a->rounds));
        rc = proc_fds_settle(daemon_pid, fds_idle);
        CHECK(rc == fds_idle, "moeepd holds %d fds after job A ended, %d when idle", rc, fds_idle);
        failures +=
                run_as(ISO_UID_B, "replayed id of an ended job: ERROR_NO_SUCH_JOB", attack_replay_after_end);

        rc = stop_daemon();
        CHECK(rc == 0, "moeepd exited with status %d after SIGTERM", rc);
        if (failures) {
                show_log();
                say("isolation: %d checks failed", failures);
                return 1;
        }
        say("isolation: all checks passed");
        return 0;
}
