/* The handle broker (daemon/state/broker.c): registration checks and caps, and
 * that a member only ever gets regions of its own job. */
#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "config.h"
#include "errors.h"
#include "state/broker.h"
#include "state/clientfd.h"
#include "state/job.h"
#include "unit.h"

#define MEMFD REGION_KIND_MEMFD

static void cb_barrier_done(void *owner, const struct job *job, uint64_t request_id, int error) {
}

static void cb_peer_lost(void *owner, const struct job *job, uint32_t rank, const char *reason) {
}

static const struct job_callbacks callbacks = { cb_barrier_done, cb_peer_lost };

/* Two jobs of two ranks each; member [j][r] is rank r of job j. */
struct fixture {
        struct config config;
        struct jobs *jobs;
        struct clientfds *fds; /* closes at once: no event base */
        struct broker *broker;
        struct job_member *m[2][2];
        int owners[2][2];
        int fds_before;
};

static int setup(void **state) {
        struct fixture *f = calloc(1, sizeof(*f));
        char errmsg[ERRMSG_MAX];

        if (!f)
                return -1;
        f->fds_before = unit_count_fds();
        if (config_init(&f->config) < 0 || jobs_new(&f->config, &callbacks, NULL, &f->jobs) < 0 ||
            clientfds_new(NULL, &f->config, &f->fds) < 0 || broker_new(&f->config, f->fds, &f->broker) < 0)
                return -1;
        for (int j = 0; j < 2; j++) {
                uint8_t uid[JOB_UNIQUE_ID_BYTES];
                struct job *job;

                if (jobs_create(f->jobs, "broker", 2, 1000, f, &job, errmsg) < 0)
                        return -1;
                job_unique_id(job, uid);
                for (uint32_t r = 0; r < 2; r++)
                        if (jobs_join(f->jobs, uid, sizeof(uid), r, 2, NULL, &f->owners[j][r], &f->m[j][r],
                                      errmsg) < 0)
                                return -1;
        }
        *state = f;
        return 0;
}

static int teardown(void **state) {
        struct fixture *f = *state;

        for (int j = 0; j < 2; j++)
                for (int r = 0; r < 2; r++) {
                        broker_drop_member(f->broker, f->m[j][r]);
                        job_member_leave(f->m[j][r]);
                }
        assert_int_equal(f->broker->nregions, 0);
        assert_true(LIST_EMPTY(&f->broker->usage));
        jobs_creator_gone(f->jobs, f);
        assert_int_equal(f->jobs->count, 0);
        broker_free(f->broker);
        assert_int_equal(clientfds_held(f->fds, 1000), 0);
        clientfds_free(f->fds, 0);
        jobs_free(f->jobs);
        config_done(&f->config);
        assert_int_equal(unit_count_fds(), f->fds_before);
        free(f);
        return 0;
}

/* Registers a memfd region, charged as the session charges what it
 * receives; on failure the fd is ours to close. */
static int reg(struct fixture *f, struct job_member *m, uint64_t size, uint32_t tag, const char *text) {
        char errmsg[ERRMSG_MAX] = "";
        int fd = unit_memfd(4096, text);
        uint64_t id;
        int r;

        clientfds_charge_held(f->fds, 1000, 1);
        r = broker_register(f->broker, m, 1000, MEMFD, size, tag, fd, &id, errmsg);
        if (r < 0) {
                assert_true(errmsg[0]);
                clientfd_close(f->fds, 1000, fd);
        }
        return r;
}

/* The fd's kind and size are clientfd_check()'s, off the loop, before the
 * broker sees it (test-clientfd.c); the broker refuses what it decides. */
static void test_register_checks(void **state) {
        struct fixture *f = *state;

        assert_int_equal(reg(f, f->m[0][0], 0, 0, NULL), -ERROR_KIND_INVALID_ARGUMENT);
        assert_int_equal(reg(f, f->m[0][0], 4096, 0, NULL), 0);
        assert_int_equal(f->m[0][0]->nregions, 1);
}

static void test_caps(void **state) {
        struct fixture *f = *state;

        f->config.max_regions_per_session = 2;
        assert_int_equal(reg(f, f->m[0][0], 100, 0, NULL), 0);
        assert_int_equal(reg(f, f->m[0][0], 100, 1, NULL), 0);
        assert_int_equal(reg(f, f->m[0][0], 100, 2, NULL), -ERROR_KIND_LIMIT_EXCEEDED);
        f->config.max_region_bytes_per_uid = 300;
        assert_int_equal(reg(f, f->m[0][1], 100, 0, NULL), 0);
        assert_int_equal(reg(f, f->m[0][1], 1, 0, NULL), -ERROR_KIND_LIMIT_EXCEEDED);
        f->config.max_region_bytes_per_uid = UINT64_MAX;
        f->config.max_fds_per_uid = 3;
        assert_int_equal(reg(f, f->m[1][0], 1, 0, NULL), -ERROR_KIND_LIMIT_EXCEEDED);
        /* Dropping a member gives its share back. */
        broker_drop_member(f->broker, f->m[0][0]);
        assert_int_equal(reg(f, f->m[1][0], 1, 0, NULL), 0);
}

static void test_fetch_stays_in_job(void **state) {
        struct fixture *f = *state;
        struct region **found;
        char errmsg[ERRMSG_MAX];
        size_t n;

        for (int j = 0; j < 2; j++)
                for (int r = 0; r < 2; r++) {
                        assert_int_equal(reg(f, f->m[j][r], 64, 1, NULL), 0);
                        assert_int_equal(reg(f, f->m[j][r], 64, 2, NULL), 0);
                }
        /* Every other rank: only rank 1 of job 0, registration order. */
        assert_int_equal(broker_fetch(f->m[0][0], -1, -1, 64, &found, &n, errmsg), 0);
        assert_int_equal(n, 2);
        for (size_t i = 0; i < n; i++) {
                assert_ptr_equal(found[i]->owner, f->m[0][1]);
                assert_int_equal(found[i]->tag, i + 1);
        }
        free(found);
        /* One's own rank is allowed. */
        assert_int_equal(broker_fetch(f->m[0][0], 0, 2, 64, &found, &n, errmsg), 0);
        assert_int_equal(n, 1);
        assert_ptr_equal(found[0]->owner, f->m[0][0]);
        free(found);
        /* By tag. */
        assert_int_equal(broker_fetch(f->m[1][1], -1, 2, 64, &found, &n, errmsg), 0);
        assert_int_equal(n, 1);
        assert_ptr_equal(found[0]->owner, f->m[1][0]);
        free(found);
        /* Nothing matches. */
        assert_int_equal(broker_fetch(f->m[1][1], -1, 9, 64, &found, &n, errmsg), 0);
        assert_int_equal(n, 0);
        /* Ranks outside the job, bad tags, too many for one reply. */
        assert_int_equal(broker_fetch(f->m[0][0], 2, -1, 64, &found, &n, errmsg),
                         -ERROR_KIND_RANK_OUT_OF_RANGE);
        assert_int_equal(broker_fetch(f->m[0][0], -2, -1, 64, &found, &n, errmsg),
                         -ERROR_KIND_RANK_OUT_OF_RANGE);
        assert_int_equal(broker_fetch(f->m[0][0], -1, -5, 64, &found, &n, errmsg),
                         -ERROR_KIND_INVALID_ARGUMENT);
        assert_int_equal(broker_fetch(f->m[0][0], -1, (int64_t)UINT32_MAX + 1, 64, &found, &n, errmsg),
                         -ERROR_KIND_INVALID_ARGUMENT);
        assert_int_equal(broker_fetch(f->m[0][0], -1, -1, 1, &found, &n, errmsg), -ERROR_KIND_LIMIT_EXCEEDED);
}

static void test_regions_go_with_owner(void **state) {
        struct fixture *f = *state;
        struct region **found;
        char errmsg[ERRMSG_MAX];
        int before = unit_count_fds();
        size_t n;

        assert_int_equal(reg(f, f->m[0][1], 64, 0, "x"), 0);
        assert_int_equal(reg(f, f->m[0][1], 64, 0, "y"), 0);
        assert_int_equal(unit_count_fds(), before + 2); /* the broker holds them */
        broker_drop_member(f->broker, f->m[0][1]);
        assert_int_equal(unit_count_fds(), before);
        assert_int_equal(broker_fetch(f->m[0][0], -1, -1, 64, &found, &n, errmsg), 0);
        assert_int_equal(n, 0);
}

static void test_release(void **state) {
        struct fixture *f = *state;
        char errmsg[ERRMSG_MAX];
        int before = unit_count_fds();
        int fd = unit_memfd(4096, NULL);
        uint64_t id;

        assert_int_equal(broker_register(f->broker, f->m[0][1], 1000, MEMFD, 64, 0, fd, &id, errmsg), 0);
        /* Only the owner can release it. */
        assert_int_equal(broker_release(f->broker, f->m[0][0], id, errmsg), -ERROR_KIND_INVALID_ARGUMENT);
        assert_int_equal(broker_release(f->broker, f->m[1][1], id, errmsg), -ERROR_KIND_INVALID_ARGUMENT);
        assert_int_equal(broker_release(f->broker, f->m[0][1], id, errmsg), 0);
        assert_int_equal(broker_release(f->broker, f->m[0][1], id, errmsg), -ERROR_KIND_INVALID_ARGUMENT);
        assert_int_equal(f->m[0][1]->nregions, 0);
        assert_int_equal(unit_count_fds(), before);
}

static void test_aborted_job_refuses(void **state) {
        struct fixture *f = *state;

        f->m[0][1]->job->state = JOB_ABORTED;
        assert_int_equal(reg(f, f->m[0][1], 64, 0, NULL), -ERROR_KIND_PEER_LOST);
        f->m[0][1]->job->state = JOB_READY;
}

int main(void) {
#define T(f) cmocka_unit_test_setup_teardown(f, setup, teardown)
        const struct CMUnitTest tests[] = {
                T(test_register_checks),       T(test_caps),    T(test_fetch_stays_in_job),
                T(test_regions_go_with_owner), T(test_release), T(test_aborted_job_refuses),
        };

        return cmocka_run_group_tests(tests, NULL, NULL);
}
