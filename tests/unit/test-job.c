/* The job state machine (daemon/state/job.c) driven directly: members are plain
 * tokens and the callbacks record what the job told them. */
#include <errno.h>
#include <fcntl.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cmocka.h>

#include "config.h"
#include "errors.h"
#include "state/job.h"
#include "unit.h"

/* One owner per would-be rank; the callbacks write into them. */
struct owner {
        int barrier_done;     /* times barrier_done was called */
        int barrier_error;    /* its last error */
        uint64_t barrier_rid; /* its last request id */
        int peer_lost;        /* times peer_lost was called */
        uint32_t lost_rank;
};

static void cb_barrier_done(void *owner, const struct job *job, uint64_t request_id, int error) {
        struct owner *o = owner;

        o->barrier_done++;
        o->barrier_error = error;
        o->barrier_rid = request_id;
}

static void cb_peer_lost(void *owner, const struct job *job, uint32_t rank, const char *reason) {
        struct owner *o = owner;

        o->peer_lost++;
        o->lost_rank = rank;
}

static const struct job_callbacks callbacks = { cb_barrier_done, cb_peer_lost };

struct fixture {
        struct config config;
        struct jobs *jobs;
        struct owner owners[MOEEP_MAX_RANKS + 2];
        int creator;
        int fds_before;
};

static int setup(void **state) {
        struct fixture *f = calloc(1, sizeof(*f));

        if (!f)
                return -1;
        f->fds_before = unit_count_fds();
        if (config_init(&f->config) < 0 || jobs_new(&f->config, &callbacks, NULL, &f->jobs) < 0)
                return -1;
        *state = f;
        return 0;
}

static int teardown(void **state) {
        struct fixture *f = *state;

        jobs_free(f->jobs);
        config_done(&f->config);
        assert_int_equal(unit_count_fds(), f->fds_before);
        free(f);
        return 0;
}

static struct job *create(struct fixture *f, uint32_t world, uint8_t uid[static JOB_UNIQUE_ID_BYTES]) {
        char errmsg[ERRMSG_MAX];
        struct job *job = NULL;

        assert_int_equal(jobs_create(f->jobs, "unit job", world, 1000, &f->creator, &job, errmsg), 0);
        job_unique_id(job, uid);
        return job;
}

static int join(struct fixture *f, const uint8_t *uid, uint32_t rank, uint32_t world, int owner,
                struct job_member **ret) {
        char errmsg[ERRMSG_MAX] = "";
        struct job_member *m = NULL;
        int r = jobs_join(f->jobs, uid, JOB_UNIQUE_ID_BYTES, rank, world, "GPU-0", &f->owners[owner], &m,
                          errmsg);

        if (r < 0)
                assert_true(errmsg[0]); /* every refusal explains itself */
        if (r == 0 && ret)
                *ret = m;
        return r;
}

static void test_create_validation(void **state) {
        struct fixture *f = *state;
        char errmsg[ERRMSG_MAX], long_name[MOEEP_JOB_NAME_MAX + 2];
        struct job *job;

        memset(long_name, 'x', sizeof(long_name) - 1);
        long_name[sizeof(long_name) - 1] = '\0';
        assert_int_equal(jobs_create(f->jobs, "", 2, 1000, f, &job, errmsg), -ERROR_KIND_INVALID_ARGUMENT);
        assert_int_equal(jobs_create(f->jobs, long_name, 2, 1000, f, &job, errmsg),
                         -ERROR_KIND_INVALID_ARGUMENT);
        assert_int_equal(jobs_create(f->jobs, "bad\nname", 2, 1000, f, &job, errmsg),
                         -ERROR_KIND_INVALID_ARGUMENT);
        assert_int_equal(jobs_create(f->jobs, "ok", 0, 1000, f, &job, errmsg), -ERROR_KIND_INVALID_ARGUMENT);
        assert_int_equal(jobs_create(f->jobs, "ok", MOEEP_MAX_RANKS + 1, 1000, f, &job, errmsg),
                         -ERROR_KIND_INVALID_ARGUMENT);
        assert_non_null(strstr(errmsg, "9")); /* names the value */
        long_name[MOEEP_JOB_NAME_MAX] = '\0';
        assert_int_equal(jobs_create(f->jobs, long_name, MOEEP_MAX_RANKS, 1000, f, &job, errmsg), 0);
        assert_int_equal(f->jobs->count, 1);
}

static void test_create_cap(void **state) {
        struct fixture *f = *state;
        char errmsg[ERRMSG_MAX];
        struct job *job;

        f->config.max_jobs_per_uid = 2;
        assert_int_equal(jobs_create(f->jobs, "a", 1, 1000, f, &job, errmsg), 0);
        assert_int_equal(jobs_create(f->jobs, "b", 1, 1000, f, &job, errmsg), 0);
        assert_int_equal(jobs_create(f->jobs, "c", 1, 1000, f, &job, errmsg), -ERROR_KIND_LIMIT_EXCEEDED);
        assert_non_null(strstr(errmsg, "max_jobs_per_uid"));
        assert_int_equal(jobs_create(f->jobs, "c", 1, 1001, f, &job, errmsg), 0); /* another uid */
        assert_int_equal(jobs_count_uid(f->jobs, 1000), 2);
}

static void test_unique_id_and_control_page(void **state) {
        struct fixture *f = *state;
        uint8_t uid[JOB_UNIQUE_ID_BYTES];
        struct job *job = create(f, 4, uid);
        const struct moeep_control_page *page;
        int fd = job_control_fd(job), seals;

        assert_int_equal(uid[0], JOB_UNIQUE_ID_VERSION);
        assert_int_equal(uid[1], (uint8_t)job->id);
        assert_memory_equal(uid + 9, job->secret, JOB_SECRET_BYTES);

        assert_int_equal(lseek(fd, 0, SEEK_END), MOEEP_CONTROL_PAGE_SIZE);
        seals = fcntl(job->control_fd, F_GET_SEALS);
        assert_true(seals & F_SEAL_SHRINK);
        assert_true(seals & F_SEAL_GROW);
        assert_true(seals & F_SEAL_SEAL);
        /* Clients can map it only read-only. */
        assert_true(mmap(NULL, MOEEP_CONTROL_PAGE_SIZE, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0) ==
                    MAP_FAILED);
        page = mmap(NULL, MOEEP_CONTROL_PAGE_SIZE, PROT_READ, MAP_SHARED, fd, 0);
        assert_true(page != MAP_FAILED);
        assert_int_equal(page->magic, MOEEP_CONTROL_PAGE_MAGIC);
        assert_int_equal(page->version, MOEEP_CONTROL_PAGE_VERSION);
        assert_int_equal(page->version, 2);
        assert_int_equal(page->abort, 0);
        assert_int_equal(page->lost_rank, -1);
        assert_int_equal(page->job_id, job->id);
        assert_int_equal(page->lost_ranks, 0);
        assert_int_equal(page->stopping, 0);
        /* Version 2 adds fields at the end: version 1's offsets stay. */
        assert_int_equal(offsetof(struct moeep_control_page, abort), 8);
        assert_int_equal(offsetof(struct moeep_control_page, lost_rank), 12);
        assert_int_equal(offsetof(struct moeep_control_page, job_id), 16);
        assert_int_equal(offsetof(struct moeep_control_page, lost_ranks), 24);
        assert_int_equal(offsetof(struct moeep_control_page, stopping), 28);
        munmap((void *)page, MOEEP_CONTROL_PAGE_SIZE);
}

static void test_join_errors(void **state) {
        struct fixture *f = *state;
        uint8_t uid[JOB_UNIQUE_ID_BYTES], bad[JOB_UNIQUE_ID_BYTES];
        uint8_t padded[MOEEP_UNIQUE_ID_BYTES] = { 0 };
        struct job *job = create(f, 2, uid);
        struct job_member *m0, *m1;
        char errmsg[ERRMSG_MAX];

        /* Malformed ids. */
        assert_int_equal(
                jobs_join(f->jobs, uid, JOB_UNIQUE_ID_BYTES - 1, 0, 2, NULL, &f->owners[0], &m0, errmsg),
                -ERROR_KIND_INVALID_ARGUMENT);
        memcpy(bad, uid, sizeof(bad));
        bad[0] = 9;
        assert_int_equal(join(f, bad, 0, 2, 0, NULL), -ERROR_KIND_INVALID_ARGUMENT);
        /* No such job. */
        memcpy(bad, uid, sizeof(bad));
        bad[1] ^= 0x40;
        assert_int_equal(join(f, bad, 0, 2, 0, NULL), -ERROR_KIND_NO_SUCH_JOB);
        /* Wrong secret: every byte of it counts, and it is answered as an
         * unknown id is, so that a guesser cannot tell which ids exist. */
        for (int i = 9; i < JOB_UNIQUE_ID_BYTES; i += 7) {
                memcpy(bad, uid, sizeof(bad));
                bad[i] ^= 1;
                assert_int_equal(join(f, bad, 0, 2, 0, NULL), -ERROR_KIND_NO_SUCH_JOB);
        }
        assert_int_equal(join(f, uid, 0, 3, 0, NULL), -ERROR_KIND_WORLD_SIZE_MISMATCH);
        assert_int_equal(join(f, uid, 2, 2, 0, NULL), -ERROR_KIND_RANK_OUT_OF_RANGE);
        assert_int_equal(join(f, uid, UINT32_MAX, 2, 0, NULL), -ERROR_KIND_RANK_OUT_OF_RANGE);
        /* A bad GPU uuid. */
        assert_int_equal(jobs_join(f->jobs, uid, sizeof(uid), 0, 2, "GPU 0", &f->owners[0], &m0, errmsg),
                         -ERROR_KIND_INVALID_ARGUMENT);

        assert_int_equal(join(f, uid, 0, 2, 0, &m0), 0);
        assert_int_equal(job->state, JOB_FORMING);
        assert_int_equal(join(f, uid, 0, 2, 1, NULL), -ERROR_KIND_RANK_TAKEN);
        assert_int_equal(join(f, uid, 1, 2, 0, NULL), -ERROR_KIND_ALREADY_IN_JOB); /* owner 0 is already in */
        /* The client's zero-padded 128-byte copy is accepted too. */
        memcpy(padded, uid, sizeof(uid));
        assert_int_equal(jobs_join(f->jobs, padded, sizeof(padded), 1, 2, "", &f->owners[1], &m1, errmsg), 0);
        assert_int_equal(job->state, JOB_READY);
        assert_int_equal(job->njoined, 2);
        job_member_leave(m0);
        job_member_leave(m1);
}

static void test_leave_and_rejoin(void **state) {
        struct fixture *f = *state;
        uint8_t uid[JOB_UNIQUE_ID_BYTES];
        struct job *job = create(f, 2, uid);
        struct job_member *m0, *m1;

        assert_int_equal(join(f, uid, 0, 2, 0, &m0), 0);
        assert_int_equal(join(f, uid, 1, 2, 1, &m1), 0);
        assert_int_equal(job->state, JOB_READY);
        job_member_leave(m1);
        assert_int_equal(job->state, JOB_FORMING);
        assert_int_equal(f->owners[0].peer_lost, 0); /* an orderly leave is no loss */
        assert_int_equal(join(f, uid, 1, 2, 2, &m1), 0);
        assert_int_equal(job->state, JOB_READY);
        job_member_leave(m0);
        job_member_leave(m1);
        assert_int_equal(f->jobs->count, 1); /* the creator still holds it */
        jobs_creator_gone(f->jobs, &f->creator);
        assert_int_equal(f->jobs->count, 0);
}

static void test_barrier_generations(void **state) {
        struct fixture *f = *state;
        uint8_t uid[JOB_UNIQUE_ID_BYTES];
        struct job *job = create(f, 3, uid);
        struct job_member *m[3];
        char errmsg[ERRMSG_MAX];

        for (int r = 0; r < 3; r++)
                assert_int_equal(join(f, uid, (uint32_t)r, 3, r, &m[r]), 0);
        for (uint64_t gen = 0; gen < 3; gen++) {
                assert_int_equal(job_barrier(m[2], 100 + gen, errmsg), 0);
                assert_int_equal(job_barrier(m[2], 100 + gen, errmsg), -ERROR_KIND_INVALID_ARGUMENT);
                assert_int_equal(job_barrier(m[0], 200 + gen, errmsg), 0);
                assert_int_equal(f->owners[0].barrier_done, (int)gen); /* held back */
                assert_int_equal(job->barrier_generation, gen);
                assert_int_equal(job_barrier(m[1], 300 + gen, errmsg), 0);
                assert_int_equal(job->barrier_generation, gen + 1);
                for (int r = 0; r < 3; r++) {
                        assert_int_equal(f->owners[r].barrier_done, (int)gen + 1);
                        assert_int_equal(f->owners[r].barrier_error, 0);
                        assert_false(m[r]->in_barrier);
                }
                assert_int_equal(f->owners[0].barrier_rid, 200 + gen); /* each gets its own request id */
                assert_int_equal(f->owners[2].barrier_rid, 100 + gen);
        }
        for (int r = 0; r < 3; r++)
                job_member_leave(m[r]);
        jobs_creator_gone(f->jobs, &f->creator);
}

static void test_barrier_waits_for_missing_ranks(void **state) {
        struct fixture *f = *state;
        uint8_t uid[JOB_UNIQUE_ID_BYTES];
        struct job_member *m0, *m1;
        char errmsg[ERRMSG_MAX];

        create(f, 2, uid);
        assert_int_equal(join(f, uid, 0, 2, 0, &m0), 0);
        assert_int_equal(job_barrier(m0, 1, errmsg), 0);
        assert_int_equal(f->owners[0].barrier_done, 0);
        assert_int_equal(join(f, uid, 1, 2, 1, &m1), 0);
        assert_int_equal(f->owners[0].barrier_done, 0);
        /* A member that leaves while waiting gets its barrier cancelled. */
        job_member_leave(m0);
        assert_int_equal(f->owners[0].barrier_done, 1);
        assert_int_equal(f->owners[0].barrier_error, -ERROR_KIND_NOT_IN_JOB);
        assert_int_equal(join(f, uid, 0, 2, 0, &m0), 0);
        assert_int_equal(job_barrier(m1, 2, errmsg), 0);
        assert_int_equal(job_barrier(m0, 3, errmsg), 0);
        assert_int_equal(f->owners[1].barrier_done, 1);
        assert_int_equal(f->owners[1].barrier_error, 0);
        job_member_leave(m0);
        job_member_leave(m1);
}

static void test_abort_on_member_loss(void **state) {
        struct fixture *f = *state;
        uint8_t uid[JOB_UNIQUE_ID_BYTES];
        struct job *job = create(f, 3, uid);
        const struct moeep_control_page *page;
        struct job_member *m[3];
        char errmsg[ERRMSG_MAX];

        page = mmap(NULL, MOEEP_CONTROL_PAGE_SIZE, PROT_READ, MAP_SHARED, job_control_fd(job), 0);
        assert_true(page != MAP_FAILED);
        for (int r = 0; r < 3; r++)
                assert_int_equal(join(f, uid, (uint32_t)r, 3, r, &m[r]), 0);
        assert_int_equal(job_barrier(m[0], 7, errmsg), 0);

        job_member_lost(m[1], "test: socket closed");
        assert_int_equal(job->state, JOB_ABORTED);
        assert_int_equal(job->lost_rank, 1);
        assert_int_equal(page->abort, 1);
        assert_int_equal(page->lost_rank, 1);
        assert_int_equal(page->lost_ranks, 1u << 1);
        assert_int_equal(page->stopping, 0);
        /* The others are told; the waiter's barrier fails. */
        assert_int_equal(f->owners[0].peer_lost, 1);
        assert_int_equal(f->owners[0].lost_rank, 1);
        assert_int_equal(f->owners[2].peer_lost, 1);
        assert_int_equal(f->owners[1].peer_lost, 0);
        assert_int_equal(f->owners[0].barrier_done, 1);
        assert_int_equal(f->owners[0].barrier_error, -ERROR_KIND_PEER_LOST);
        assert_int_equal(f->owners[0].barrier_rid, 7);
        assert_int_equal(f->owners[2].barrier_done, 0);
        /* Aborted is final. */
        assert_int_equal(job_barrier(m[2], 8, errmsg), -ERROR_KIND_PEER_LOST);
        assert_int_equal(join(f, uid, 1, 3, 1, NULL), -ERROR_KIND_PEER_LOST);
        /* A second loss keeps the first lost rank, and is marked lost too
         * (elastic endpoints go on after the first). */
        job_member_lost(m[2], "test: killed");
        assert_int_equal(page->lost_rank, 1);
        assert_int_equal(page->lost_ranks, 1u << 1 | 1u << 2);
        /* Told again of rank 2 (a mirror hears of it from its home too):
         * nothing changes; the daemon stopping sets stopping only. */
        job_abort(job, 2, "test: again");
        assert_int_equal(f->owners[0].peer_lost, 2);
        job_abort(job, JOB_NO_RANK, "test: the daemon is stopping");
        assert_int_equal(page->stopping, 1);
        assert_int_equal(page->lost_ranks, 1u << 1 | 1u << 2);
        assert_int_equal(page->lost_rank, 1);
        assert_int_equal(f->owners[0].peer_lost, 2);
        assert_int_equal(f->owners[0].lost_rank, 2);

        /* Freed once the last member and the creator are gone. */
        jobs_creator_gone(f->jobs, &f->creator);
        assert_int_equal(f->jobs->count, 1);
        job_member_leave(m[0]);
        assert_int_equal(f->jobs->count, 0);
        munmap((void *)page, MOEEP_CONTROL_PAGE_SIZE);
}

static void test_creator_gone_frees_empty_jobs(void **state) {
        struct fixture *f = *state;
        uint8_t uid[JOB_UNIQUE_ID_BYTES];
        struct job_member *m;
        int other_creator;
        struct job *job;
        char errmsg[ERRMSG_MAX];

        create(f, 2, uid);
        create(f, 2, uid); /* the second one gets a member */
        assert_int_equal(jobs_create(f->jobs, "other", 1, 1000, &other_creator, &job, errmsg), 0);
        assert_int_equal(join(f, uid, 0, 2, 0, &m), 0);
        jobs_creator_gone(f->jobs, &f->creator);
        assert_int_equal(f->jobs->count, 2); /* the joined one and the other creator's */
        job_member_lost(m, "test");
        assert_int_equal(f->jobs->count, 1);
        jobs_creator_gone(f->jobs, &other_creator);
        assert_int_equal(f->jobs->count, 0);
}

/* Joins owner `owner` (uid 0) as `rank` of 2 of the mirror of job `id` at
 * `home`. */
static int join_mirror(struct fixture *f, const char *home, uint64_t id, uint32_t rank, int owner,
                       struct job_member **ret, char *errmsg) {
        errmsg[0] = '\0';
        return jobs_join_mirror(f->jobs, home, id, "remote job", 2, rank, "GPU-0", &f->owners[owner], 0, ret,
                                errmsg);
}

/* Mirrors are nobody's: more of them than max_jobs_per_uid (made by
 * uid 0's sessions, and of jobs that another uid created at the home) leave
 * uid 0 its whole allowance. Their own cap, per home, holds. */
static void test_mirrors_count_against_no_uid(void **state) {
        struct fixture *f = *state;
        const char *home = "127.0.0.2:7000", *other = "127.0.0.3:7000";
        struct job_member *m[6];
        struct job *job;
        char errmsg[ERRMSG_MAX];

        f->config.max_jobs_per_uid = 2;
        f->config.max_mirrors_per_peer = 3;
        for (int i = 0; i < 3; i++) {
                assert_int_equal(join_mirror(f, home, 100 + (uint64_t)i, 1, i, &m[i], errmsg), 0);
                assert_int_equal(m[i]->job->owner_uid, JOB_OWNER_NONE);
        }
        assert_int_equal(jobs_count_uid(f->jobs, 0), 0);
        assert_int_equal(jobs_count_uid(f->jobs, JOB_OWNER_NONE), 0);
        assert_int_equal(jobs_count_mirrors(f->jobs, home), 3);

        /* uid 0 creates its own jobs up to its cap, which still holds. */
        assert_int_equal(jobs_create(f->jobs, "root 1", 1, 0, &f->creator, &job, errmsg), 0);
        assert_int_equal(jobs_create(f->jobs, "root 2", 1, 0, &f->creator, &job, errmsg), 0);
        assert_int_equal(jobs_create(f->jobs, "root 3", 1, 0, &f->creator, &job, errmsg),
                         -ERROR_KIND_LIMIT_EXCEEDED);
        assert_non_null(strstr(errmsg, "uid 0 already has 2 jobs"));

        /* A fourth job of the same home is refused, naming the home and
         * the cap; a second rank of a mirror it has is not a new mirror;
         * another home has a cap of its own. */
        assert_int_equal(join_mirror(f, home, 103, 1, 4, &m[4], errmsg), -ERROR_KIND_LIMIT_EXCEEDED);
        assert_non_null(strstr(errmsg, "job 103 at 127.0.0.2:7000: 3 jobs of that daemon"));
        assert_non_null(strstr(errmsg, "max_mirrors_per_peer = 3"));
        assert_int_equal(join_mirror(f, home, 100, 0, 3, &m[3], errmsg), 0);
        assert_ptr_equal(m[3]->job, m[0]->job);
        assert_int_equal(join_mirror(f, other, 100, 1, 5, &m[5], errmsg), 0);
        assert_int_equal(jobs_count_mirrors(f->jobs, home), 3);
        assert_int_equal(jobs_count_mirrors(f->jobs, other), 1);

        /* A mirror whose last rank here leaves is gone, and makes room. */
        job_member_leave(m[1]);
        assert_int_equal(jobs_count_mirrors(f->jobs, home), 2);
        assert_int_equal(join_mirror(f, home, 103, 1, 4, &m[4], errmsg), 0);
        for (int i = 0; i < 6; i++)
                if (i != 1)
                        job_member_leave(m[i]);
        jobs_creator_gone(f->jobs, &f->creator);
        assert_int_equal(f->jobs->count, 0);
}

/* The mesh address a unique id carries, and the validators (names.h) it
 * and a GPU UUID go through: printable ASCII without spaces. */
static void test_unique_id_node(void **state) {
        struct fixture *f = *state;
        uint8_t uid[JOB_UNIQUE_ID_BYTES], buf[MOEEP_UNIQUE_ID_BYTES];
        char node[JOB_NODE_MAX + 1], uuid[MOEEP_GPU_UUID_MAX + 2];
        struct job *job = create(f, 2, uid);
        size_t len;

        assert_int_equal(job_unique_id_node(uid, sizeof(uid), node), 0);
        assert_string_equal(node, "");
        len = job_unique_id_with_node(job, "127.0.0.1:7000", buf);
        assert_int_equal(len, JOB_UNIQUE_ID_BYTES + 1 + 14);
        assert_int_equal(job_unique_id_node(buf, len, node), 0);
        assert_string_equal(node, "127.0.0.1:7000");
        assert_int_equal(job_unique_id_node(buf, len - 1, node), -EINVAL); /* cut short */
        for (int bad = 0; bad < 4; bad++) {
                static const uint8_t bytes[] = { 0x20, 0x7f, 0x80, 0x00 };

                len = job_unique_id_with_node(job, "127.0.0.1:7000", buf);
                buf[JOB_UNIQUE_ID_NODE_OFFSET + 3] = bytes[bad];
                assert_int_equal(job_unique_id_node(buf, len, node), -EINVAL);
        }
        memset(uuid, 'a', sizeof(uuid));
        uuid[MOEEP_GPU_UUID_MAX] = '\0';
        assert_true(moeep_gpu_uuid_valid(uuid));
        assert_true(moeep_gpu_uuid_valid(""));
        uuid[MOEEP_GPU_UUID_MAX] = 'a';
        uuid[MOEEP_GPU_UUID_MAX + 1] = '\0';
        assert_false(moeep_gpu_uuid_valid(uuid));
        assert_false(moeep_gpu_uuid_valid("GPU 0"));
        assert_false(moeep_gpu_uuid_valid("GPU-\x80"));
        assert_true(moeep_gpu_uuid_valid("GPU-0123abcd-~!"));
}

int main(void) {
#define T(f) cmocka_unit_test_setup_teardown(f, setup, teardown)
        const struct CMUnitTest tests[] = {
                T(test_create_validation),
                T(test_create_cap),
                T(test_unique_id_and_control_page),
                T(test_join_errors),
                T(test_unique_id_node),
                T(test_leave_and_rejoin),
                T(test_barrier_generations),
                T(test_barrier_waits_for_missing_ranks),
                T(test_abort_on_member_loss),
                T(test_creator_gone_frees_empty_jobs),
                T(test_mirrors_count_against_no_uid),
        };

        return cmocka_run_group_tests(tests, NULL, NULL);
}
