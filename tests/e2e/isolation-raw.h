/* The shared side of moeep-e2e-isolation (isolation.c): its caps and uids,
 * the run's state (temporary directory, daemon and job A processes, failure
 * count), say() and CHECK(), cleanup on every exit path, running a function
 * as another uid, and a session spoken to with raw records. Included by
 * isolation.c only; test code. */
#ifndef MOEEP_E2E_ISOLATION_RAW_H
#define MOEEP_E2E_ISOLATION_RAW_H

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

#endif
