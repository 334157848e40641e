/* Elastic ranks on GPUs (issue 29): low-latency calls that go on without a
 * lost rank, checked against a CPU reference that leaves the lost rank out.
 *
 * Every case runs in a job of its own; every endpoint is elastic
 * (ll_shrink). The victim is the last rank; with MOEEP_HARNESS_NODES=2 it is
 * at the second daemon.
 *
 *   kill in dispatch   the victim is SIGKILLed while the others wait for it
 *                      in a low-latency dispatch
 *   kill in combine    the same in a combine
 *   kill in a loop     every rank runs dispatch/combine rounds back to back
 *                      (the victim without checking, so that it is mostly
 *                      inside a call); a thread of the victim kills it at a
 *                      random moment; the survivors run LOOP_ROUNDS rounds
 *   silent rank        the victim is alive but skips a dispatch: the others
 *                      mask it after the shrink timeout (SILENT_TIMEOUT_MS)
 *   skipped clean      the victim skips moeep_ll_clean: the others' clean
 *                      masks it after the shrink timeout
 *   daemon killed      (two daemons only) the first moeepd is SIGKILLed at a
 *                      random moment of the loop: the ranks at the second go
 *                      on without its ranks (which lose their daemon, get an
 *                      error on a later call and stop)
 *   normal rebuild     normal mode fails fast as before: the victim is
 *                      killed in a dispatch and the others' call fails
 *                      within 100 ms; they destroy the endpoint, leave, form
 *                      a job of the survivors in the same processes against
 *                      the same daemons, and dispatch and combine correctly
 *
 * For every survivor, every call of the elastic cases must return 0 and
 * moeep_ep_check() 0 (a hang is killed by the harness), and:
 *   - dispatch: each local expert's slots hold exactly the expected pairs
 *     of the sources taken, from slot 0 on, each source's run where
 *     layout_range says (sources in rank order, this daemon's first), rows
 *     bitwise; a source masked before the call is absent, a source masked
 *     during it is either wholly there or absent, every other one is there;
 *     recv_count is the sum;
 *   - combine: each token is the weighted sum of its experts' outputs
 *     leaving out the experts of ranks masked before the call; for ranks
 *     masked during it, each 512-channel piece with or without them;
 *   - afterwards the endpoint's mask (moeep_ll_mask_query) holds the lost
 *     ranks and no others, and moeep_ep_lost_ranks() the dead ones.
 * Times, from the death (CLOCK_MONOTONIC taken just before the kill) to the
 * lost rank's bit in the survivor's control page (a thread polls it) and to
 * the end of the call the survivor was in: printed per case (worst over the
 * survivors); the first must be at most MASK_LIMIT_MS.
 *
 * Usage: ep_shrink_test [--ranks LIST] [--seed N] [--moeepd PATH]. Exits
 * 77 (meson: skipped) without a GPU; ranks beyond the GPUs share them. */
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <cuda_runtime_api.h>

#include "harness.h"
#include "moeep_ep.h"
#include "ref.h"
#include "shrink-round.h"
#include "suite.h"

#define MASK_LIMIT_MS 10.0
#define DETECT_LIMIT_MS 100.0 /* normal mode: the error after the kill */
#define VICTIM_DELAY_MS 50
#define SILENT_TIMEOUT_MS 300
#define LOOP_ROUNDS 20 /* rounds a survivor runs at least in the loops */
#define LOOP_AFTER 5   /* ... and after the loss showed */
#define LOOP_MAX 300   /* every survivor stops there when the word never came (and fails) */

enum shrink_case {
        KILL_IN_DISPATCH,
        KILL_IN_COMBINE,
        KILL_IN_LOOP,
        SILENT_RANK,
        SKIPPED_CLEAN,
        DAEMON_KILLED,
        NORMAL_REBUILD,
        NCASES,
};

static const char *const case_names[] = {
        [KILL_IN_DISPATCH] = "kill in dispatch",
        [KILL_IN_COMBINE] = "kill in combine",
        [KILL_IN_LOOP] = "kill in a loop",
        [SILENT_RANK] = "silent rank (shrink timeout 300 ms)",
        [SKIPPED_CLEAN] = "skipped clean (shrink timeout 300 ms)",
        [DAEMON_KILLED] = "daemon killed",
        [NORMAL_REBUILD] = "normal mode: error, then rebuilt over the survivors",
};

/* MAP_SHARED between the driver and the ranks of one job. */
struct shared {
        int ci;
        uint64_t seed;
        char socket[128];
        char socket_b[128];          /* two nodes: the second daemon's, "" otherwise */
        volatile int64_t fail_ns;    /* CLOCK_MONOTONIC just before the kill */
        volatile int64_t kill_at_ns; /* daemon case: when the driver kills the first daemon */
        volatile int daemon_killed;  /* set by the driver */
        volatile int survivors_done; /* survivors past their last call */
        volatile int stop_round;     /* loops: the last round every survivor runs, 0 while unknown */
        volatile int job_ready;      /* rebuild: rank 0 made the survivors' job */
        struct moeep_unique_id job;  /* rebuild */
        int rc[MOEEP_MAX_RANKS];     /* 0 pass, 1 fail, -1 not reached */
        double lost_ms[MOEEP_MAX_RANKS];
        double done_ms[MOEEP_MAX_RANKS];
        char msg[MOEEP_MAX_RANKS][240];
};

static struct moeep_ep_config ll_config(int R, int timeout_ms) {
        return (struct moeep_ep_config){
                .max_tokens_per_rank = MAX_T,
                .hidden = H,
                .num_experts = EPR * R,
                .max_topk = K,
                .timeout_ms = 20000,
                .ll_max_tokens = MAX_T,
                .ll_shrink = 1,
                .shrink_timeout_ms = timeout_ms,
        };
}

/* ---- The death's times. ---- */

struct poller {
        pthread_t thread;
        const volatile struct moeep_control_page *page;
        uint32_t want;
        volatile int stop;
        volatile int64_t seen_ns;
};

/* Polls the control page's lost ranks (every 20 us: the ranks' and the
 * daemons' threads share the CPUs) until `want` is there. */
static void *poll_lost(void *arg) {
        struct poller *p = arg;

        while (!p->stop) {
                if ((__atomic_load_n(&p->page->lost_ranks, __ATOMIC_ACQUIRE) & p->want) == p->want) {
                        p->seen_ns = now_ns();
                        return NULL;
                }
                nanosleep(&(struct timespec){ .tv_nsec = 20000 }, NULL);
        }
        return NULL;
}

static int poller_start(struct rk *k, struct poller *p, uint32_t want) {
        memset(p, 0, sizeof(*p));
        p->page = moeep_job_control_page(k->c);
        p->want = want;
        if (!p->page || p->page->version < 2)
                FAIL("the job's control page has no lost ranks (version %u)", p->page ? p->page->version : 0);
        if (pthread_create(&p->thread, NULL, poll_lost, p) != 0)
                FAIL("pthread_create failed");
        return 0;
}

/* Joins the poller and records the times since the death: `done_ns` is
 * when the survivor's call in flight ended. */
static int poller_finish(struct rk *k, struct poller *p, int64_t done_ns) {
        for (int i = 0; i < 5000 && !p->seen_ns; i++)
                sleep_ms(1);
        p->stop = 1;
        pthread_join(p->thread, NULL);
        if (!p->seen_ns)
                FAIL("the lost rank's bit (0x%x) never showed in the control page", p->want);
        k->sh->lost_ms[k->me] = (double)(p->seen_ns - k->sh->fail_ns) / 1e6;
        k->sh->done_ms[k->me] = (double)(done_ns - k->sh->fail_ns) / 1e6;
        if (k->sh->lost_ms[k->me] > MASK_LIMIT_MS)
                FAIL("the lost rank's bit came %.2f ms after the death (limit %.0f ms)",
                     k->sh->lost_ms[k->me], MASK_LIMIT_MS);
        return 0;
}

/* ---- The cases. ---- */

static void *victim_timer(void *arg) {
        struct shared *sh = arg;
        struct rng r = rng_make(sh->seed, 99, 5);

        sleep_ms(20 + (int)(rng_next(&r) % 130));
        sh->fail_ns = now_ns();
        raise(SIGKILL);
        return NULL;
}

/* After the elastic cases: the mask holds exactly the lost ranks, the
 * daemon's word the dead ones. */
static int final_masks(struct rk *k, uint32_t lost, bool dead) {
        uint32_t m = 0, daemon = 0;

        if (mask_bits(k, &m) < 0)
                return -1;
        if (m != lost)
                FAIL("the mask is 0x%x, want 0x%x", m, lost);
        if (moeep_ep_lost_ranks(k->ep, &daemon) < 0)
                FAIL("moeep_ep_lost_ranks: %s", moeep_ep_error(k->ep));
        if (dead && (daemon & lost) != lost)
                FAIL("the daemon marked 0x%x lost, want 0x%x", daemon, lost);
        return 0;
}

static int case_kill(struct rk *k, int ci) {
        const int victim = k->R - 1;
        const uint32_t vb = 1u << victim;
        struct round rd;
        struct poller p;
        int64_t done;

        if (ll_round(k, 0, 0, false, false) < 0)
                return -1;
        /* In combine: every rank dispatches, the victim dies before its
         * combine, which the others are waiting in. */
        if (ci == KILL_IN_COMBINE && half_dispatch(k, &rd, 1, 0, false, true) < 0)
                return -1;
        if (moeep_job_barrier(k->c) < 0)
                FAIL("barrier: %s", moeep_client_error(k->c));
        if (k->me == victim) {
                sleep_ms(VICTIM_DELAY_MS);
                k->sh->fail_ns = now_ns();
                raise(SIGKILL);
        }
        if (poller_start(k, &p, vb) < 0)
                return -1;
        if (ci == KILL_IN_COMBINE) {
                if (half_combine(k, &rd, vb) < 0)
                        return -1;
                done = rd.t_done;
        } else {
                if (half_dispatch(k, &rd, 1, vb, false, false) < 0)
                        return -1;
                done = rd.t_done;
                if (half_combine(k, &rd, vb) < 0)
                        return -1;
        }
        if (poller_finish(k, &p, done) < 0 || ll_round(k, 2, 0, false, false) < 0 ||
            ll_round(k, 3, 0, false, true) < 0)
                return -1;
        return final_masks(k, vb, true);
}

/* A survivor's loop: rounds back to back, hook and not in turn, at least
 * LOOP_ROUNDS and LOOP_AFTER after the daemon's word came (at most
 * LOOP_MAX). Every survivor must make the same calls: the first to see the
 * word sets the last round for all (stop_round); the others are at most one
 * round ahead or behind (every round waits for all of them), so all read it
 * in time. `done`: the end of the first round that ended after the word. */
static int loop_survivor(struct rk *k, struct poller *p, uint32_t lost) {
        int64_t done = 0;

        for (int round = 1; round <= LOOP_MAX; round++) {
                const int last = __atomic_load_n(&k->sh->stop_round, __ATOMIC_ACQUIRE);
                if (last && round > last)
                        break;
                if (ll_round(k, round, lost, false, round % 2) < 0)
                        return -1;
                if (p->seen_ns && !done) {
                        int none = 0;
                        done = now_ns();
                        __atomic_compare_exchange_n(&k->sh->stop_round, &none,
                                                    round + LOOP_AFTER > LOOP_ROUNDS ? round + LOOP_AFTER
                                                                                     : LOOP_ROUNDS,
                                                    false, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
                }
        }
        if (poller_finish(k, p, done ? done : now_ns()) < 0)
                return -1;
        return final_masks(k, lost, true);
}

static int case_loop(struct rk *k) {
        const int victim = k->R - 1;
        const uint32_t vb = 1u << victim;
        struct poller p;
        pthread_t timer;

        if (ll_round(k, 0, 0, false, false) < 0)
                return -1;
        if (moeep_job_barrier(k->c) < 0)
                FAIL("barrier: %s", moeep_client_error(k->c));
        if (k->me == victim) {
                if (pthread_create(&timer, NULL, victim_timer, k->sh) != 0)
                        FAIL("pthread_create failed");
                for (int round = 1;; round++)
                        if (ll_round(k, round, 0, true, round % 2) < 0)
                                return -1; /* the survivors' view of a failure here is what counts */
        }
        if (poller_start(k, &p, vb) < 0)
                return -1;
        return loop_survivor(k, &p, vb);
}

static int case_silent(struct rk *k, int ci) {
        const int victim = k->R - 1;
        const uint32_t vb = 1u << victim;
        int64_t t0, t1;

        if (ll_round(k, 0, 0, false, false) < 0)
                return -1;
        if (moeep_job_barrier(k->c) < 0)
                FAIL("barrier: %s", moeep_client_error(k->c));
        if (k->me == victim) {
                /* Alive, busy elsewhere: the others go on without us. */
                if (!wait_shared(&k->sh->survivors_done, k->R - 1, 60000))
                        FAIL("the survivors did not finish");
                return 0;
        }
        t0 = now_ns();
        if (ci == SILENT_RANK) {
                if (ll_round(k, 1, vb, false, false) < 0)
                        return -1;
        } else if (moeep_ll_clean(k->ep) < 0) {
                FAIL("clean: %s", moeep_ep_error(k->ep));
        }
        t1 = now_ns();
        k->sh->done_ms[k->me] = (double)(t1 - t0) / 1e6;
        /* Counts are waited for one timeout, rows (and the clean) no longer
         * than another two. */
        if (k->sh->done_ms[k->me] < SILENT_TIMEOUT_MS * 0.9 ||
            k->sh->done_ms[k->me] > 3 * SILENT_TIMEOUT_MS + 1000)
                FAIL("the call took %.0f ms, want about the shrink timeout (%d ms)", k->sh->done_ms[k->me],
                     SILENT_TIMEOUT_MS);
        if (final_masks(k, vb, false) < 0 || ll_round(k, 2, 0, false, true) < 0 ||
            ll_round(k, 3, 0, false, false) < 0)
                return -1;
        __atomic_add_fetch(&k->sh->survivors_done, 1, __ATOMIC_ACQ_REL);
        return final_masks(k, vb, false);
}

static int case_daemon(struct rk *k) {
        const int R = k->R;
        uint32_t lost = 0;
        struct poller p;

        for (int r = 0; r < R; r++)
                if (!harness_node_of(r, R))
                        lost |= 1u << r;
        if (ll_round(k, 0, 0, false, false) < 0)
                return -1;
        if (moeep_job_barrier(k->c) < 0)
                FAIL("barrier: %s", moeep_client_error(k->c));
        if (!harness_node_of(k->me, R)) {
                /* Our daemon goes: calls go on until one fails (its socket
                 * closed), and nothing hangs. */
                if (k->me == 0) {
                        struct rng r = rng_make(k->seed, 98, 5);
                        k->sh->kill_at_ns = now_ns() + (int64_t)(20 + rng_next(&r) % 130) * 1000000;
                }
                for (int round = 1; round <= LOOP_MAX && !k->sh->daemon_killed; round++)
                        if (ll_round(k, round, ~0u, true, round % 2) < 0)
                                break;
                return 0;
        }
        if (poller_start(k, &p, lost) < 0)
                return -1;
        return loop_survivor(k, &p, lost);
}

/* ---- Normal mode: fail fast, rebuild over the survivors. ---- */

static int round_normal(struct rk *k, int round, int R) {
        struct input *in = &k->in[k->me];
        struct moeep_dispatch_result res;

        gen_input(in, k->seed, k->ci, k->me, R, 100 + round);
        if (upload(k, in) < 0)
                return -1;
        struct moeep_dispatch_args a = { .x = k->x,
                                         .x_type = MOEEP_DTYPE_BF16,
                                         .num_tokens = in->T,
                                         .topk_idx = k->idx,
                                         .topk_idx_type = MOEEP_INDEX_INT64,
                                         .num_topk = K,
                                         .expert_alignment = 1 };
        if (moeep_dispatch(k->ep, &a, &res, k->st) < 0)
                FAIL("normal dispatch: %s", moeep_ep_error(k->ep));
        if (res.num_recv_tokens > 0 && cudaMemcpyAsync(k->y, res.recv_x, (size_t)res.num_recv_tokens * H * 2,
                                                       cudaMemcpyDeviceToDevice, k->st) != cudaSuccess)
                FAIL("copying recv_x failed");
        struct moeep_combine_args c = { .x = k->y, .handle = res.handle, .out = k->out };
        const int r = moeep_combine(k->ep, &c, k->st);
        moeep_ep_handle_free(res.handle);
        if (r < 0 || cudaStreamSynchronize(k->st) != cudaSuccess || moeep_ep_check(k->ep) < 0)
                FAIL("normal combine: %s", moeep_ep_error(k->ep));
        if (cudaMemcpy(k->got, k->out, (size_t)in->T * H * 2, cudaMemcpyDeviceToHost) != cudaSuccess)
                FAIL("reading out failed");
        /* Each token comes back as x times the number of ranks it reached. */
        for (int t = 0; t < in->T; t++) {
                unsigned hit = 0;
                for (int j = 0; j < K; j++)
                        if (in->idx[(size_t)t * K + j] >= 0)
                                hit |= 1u << (in->idx[(size_t)t * K + j] / EPR);
                for (int ch = 0; ch < H; ch++) {
                        const float want =
                                bf16_to_float(in->x[(size_t)t * H + ch]) * (float)__builtin_popcount(hit);
                        const float have = bf16_to_float(k->got[(size_t)t * H + ch]);
                        if (have != want)
                                FAIL("normal round %d: out[%d][%d] = %g, want %g", round, t, ch, have, want);
                }
        }
        return 0;
}

static int case_rebuild(struct rk *k) {
        const int victim = k->R - 1, R1 = k->R - 1;
        struct moeep_ep_config cfg = ll_config(k->R, 0);

        cfg.ll_max_tokens = 0;
        cfg.ll_shrink = 0;
        /* The elastic endpoint's normal-mode calls fail fast too. */
        if (round_normal(k, 0, k->R) < 0)
                return -1;
        if (moeep_job_barrier(k->c) < 0)
                FAIL("barrier: %s", moeep_client_error(k->c));
        if (k->me == victim) {
                sleep_ms(VICTIM_DELAY_MS);
                k->sh->fail_ns = now_ns();
                raise(SIGKILL);
        }
        const int r = round_normal(k, 1, k->R);
        const double since = (double)(now_ns() - k->sh->fail_ns) / 1e6;
        k->sh->done_ms[k->me] = since;
        if (r == 0)
                FAIL("the normal-mode call succeeded without rank %d", victim);
        if (!strstr(moeep_ep_error(k->ep), "lost"))
                FAIL("error \"%s\" does not name the lost rank", moeep_ep_error(k->ep));
        if (since > DETECT_LIMIT_MS)
                FAIL("the error came %.1f ms after the death (limit %.0f ms)", since, DETECT_LIMIT_MS);

        /* Rebuild: the same processes, the same daemons, a job of the
         * survivors (ranks 0..R-2 keep their numbers). */
        moeep_ep_destroy(k->ep);
        k->ep = NULL;
        if (moeep_job_leave(k->c) < 0)
                FAIL("leaving the old job: %s", moeep_client_error(k->c));
        if (k->me == 0) {
                if (moeep_job_create(k->c, "ep_shrink_test-survivors", R1, &k->sh->job) < 0)
                        FAIL("creating the survivors' job: %s", moeep_client_error(k->c));
                __atomic_store_n(&k->sh->job_ready, 1, __ATOMIC_RELEASE);
        } else if (!wait_shared(&k->sh->job_ready, 1, 20000)) {
                FAIL("rank 0 made no survivors' job");
        }
        if (moeep_job_join(k->c, &k->sh->job, k->me, R1, NULL) < 0)
                FAIL("joining the survivors' job: %s", moeep_client_error(k->c));
        cfg = ll_config(R1, 0);
        cfg.ll_max_tokens = 0;
        cfg.ll_shrink = 0;
        if (moeep_ep_create(k->c, &cfg, &k->ep) < 0)
                FAIL("endpoint over the survivors: %s", moeep_client_error(k->c));
        for (int round = 2; round < 4; round++)
                if (round_normal(k, round, R1) < 0)
                        return -1;
        return 0;
}

static int rank_case(struct moeep_client *c, int me, int R, void *shared, void *arg) {
        struct shared *sh = shared;
        const int ci = sh->ci;
        struct rk k = { .sh = sh,
                        .seed = sh->seed,
                        .ci = sh->ci,
                        .c = c,
                        .me = me,
                        .R = R,
                        .L = EPR,
                        .S = R * MAX_T,
                        .msg = sh->msg[me] };
        struct moeep_ep_config cfg =
                ll_config(R, ci == SILENT_RANK || ci == SKIPPED_CLEAN ? SILENT_TIMEOUT_MS : 0);
        int r = -1;
        (void)arg;

        sh->rc[me] = 1;
        k.two = sh->socket_b[0] != '\0';
        if (rk_alloc(&k) < 0) {
                snprintf(k.msg, 240, "allocating test buffers failed");
                goto out;
        }
        if (moeep_ep_create(c, &cfg, &k.ep) < 0) {
                snprintf(k.msg, 240, "endpoint: %s", moeep_client_error(c));
                goto out;
        }
        switch ((enum shrink_case)ci) {
        case KILL_IN_DISPATCH:
        case KILL_IN_COMBINE:
                r = case_kill(&k, ci);
                break;
        case KILL_IN_LOOP:
                r = case_loop(&k);
                break;
        case SILENT_RANK:
        case SKIPPED_CLEAN:
                r = case_silent(&k, ci);
                break;
        case DAEMON_KILLED:
                r = case_daemon(&k);
                break;
        case NORMAL_REBUILD:
                r = case_rebuild(&k);
                break;
        case NCASES:
                break;
        }
        if (r == 0)
                sh->rc[me] = 0;
out:
        moeep_ep_destroy(k.ep);
        rk_free(&k);
        return sh->rc[me];
}

/* The driver's part of the daemon case: SIGKILL the first moeepd when rank
 * 0 said, start it again (the harness goes on with it). */
static void watch(struct harness *h, void *arg) {
        struct shared *sh = h->shared;
        (void)arg;

        if (sh->ci != DAEMON_KILLED || sh->daemon_killed || !sh->kill_at_ns || now_ns() < sh->kill_at_ns)
                return;
        sh->fail_ns = now_ns();
        if (harness_daemon_stop(h, SIGKILL) < 0)
                fprintf(stderr, "ep_shrink_test: killing moeepd failed\n");
        __atomic_store_n(&sh->daemon_killed, 1, __ATOMIC_RELEASE);
        if (harness_daemon_start(h) < 0)
                fprintf(stderr, "ep_shrink_test: moeepd did not start again\n");
}

static int run_case(struct harness *h, int R, int ci, uint64_t seed) {
        struct shared *sh = h->shared;
        const bool daemon = ci == DAEMON_KILLED;
        double lost = 0, done = 0;
        int bad = 0, expect_lost = 0;

        memset(sh, 0, sizeof(*sh));
        sh->ci = ci;
        sh->seed = seed + (uint64_t)ci * 1000;
        snprintf(sh->socket, sizeof(sh->socket), "%s", h->socket);
        snprintf(sh->socket_b, sizeof(sh->socket_b), "%s", h->nodes == 2 ? h->socket_b : "");
        for (int r = 0; r < R; r++)
                sh->rc[r] = -1;
        const int failed = harness_run_watched(h, R, "ep_shrink_test", rank_case, NULL, 300, watch);
        for (int r = 0; r < R; r++) {
                const bool survivor = daemon ? harness_node_of(r, R) : r < R - 1;
                const bool killed = !daemon && ci != SILENT_RANK && ci != SKIPPED_CLEAN;
                if (!survivor) {
                        expect_lost += killed;
                        continue; /* the victims' own view is not what is tested */
                }
                if (sh->rc[r] != 0) {
                        bad = 1;
                        printf("  rank %d (%s): %s\n", r, case_names[ci],
                               sh->rc[r] < 0 ? "did not run" : sh->msg[r]);
                }
                lost = fmax(lost, sh->lost_ms[r]);
                done = fmax(done, sh->done_ms[r]);
        }
        if (failed != expect_lost) {
                bad = 1;
                printf("  %s: %d rank processes failed, want %d (the killed ones)\n", case_names[ci], failed,
                       expect_lost);
        }
        if (ci == SILENT_RANK || ci == SKIPPED_CLEAN)
                printf("%s ranks=%d %s: the call ended after %.0f ms\n", bad ? "FAIL" : "ok  ", R,
                       case_names[ci], done);
        else if (ci == NORMAL_REBUILD)
                printf("%s ranks=%d %s: error %.1f ms after the death\n", bad ? "FAIL" : "ok  ", R,
                       case_names[ci], done);
        else
                printf("%s ranks=%d %s: death to mask %.2f ms (limit %.0f), death to the end of the call in "
                       "flight "
                       "%.1f ms\n",
                       bad ? "FAIL" : "ok  ", R, case_names[ci], lost, MASK_LIMIT_MS, done);
        fflush(stdout);
        return bad;
}

int main(int argc, char **argv) {
        struct suite_args a;
        struct harness h;
        int passed = 0, failed = 0, R, rc;

        rc = suite_start("ep_shrink_test", "2,4", false, argc, argv, sizeof(struct shared), &h, &a);
        if (rc != 0)
                return rc;
        for (const char *q = a.ranks; suite_next_ranks(&q, &R);) {
                if (R < 2 || R > MOEEP_MAX_RANKS) {
                        printf("SKIP ranks=%d: the cases need 2..%d ranks\n", R, MOEEP_MAX_RANKS);
                        continue;
                }
                for (int ci = 0; ci < NCASES; ci++) {
                        if (ci == DAEMON_KILLED && h.nodes != 2) {
                                printf("SKIP ranks=%d %s: needs two daemons (MOEEP_HARNESS_NODES=2)\n", R,
                                       case_names[ci]);
                                continue;
                        }
                        run_case(&h, R, ci, a.seed) ? failed++ : passed++;
                }
        }
        harness_fini(&h);
        printf("%d passed, %d failed\n", passed, failed);
        return failed ? 1 : 0;
}
