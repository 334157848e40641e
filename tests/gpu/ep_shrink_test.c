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

enum {
        H = 2048,
        K = 6,
        EPR = 6, /* experts per rank */
        MAX_T = 48,
        PIECE = 512, /* channels of one piece of the combine receive (LL_RECV_PIECE int4) */
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

/* ---- Inputs: every rank can make every rank's, for the references. ---- */

struct input {
        int T;
        int64_t idx[MAX_T * K];
        float w[MAX_T * K];
        uint16_t x[MAX_T * H];
};

static void gen_input(struct input *in, uint64_t seed, int ci, int s, int R, int round) {
        struct rng r = rng_make(seed, (uint64_t)ci * 64 + (uint64_t)s, 11 + 17 * (uint64_t)round);

        in->T = 1 + (int)(rng_next(&r) % MAX_T);
        for (int t = 0; t < in->T; t++) {
                draw_topk(&r, in->idx + (size_t)t * K, K, 0, EPR * R, 0.1);
                for (int k = 0; k < K; k++)
                        in->w[(size_t)t * K + k] = (float)rng_unit(&r);
        }
        for (size_t i = 0; i < (size_t)in->T * H; i++)
                in->x[i] = float_to_bf16((float)((int)(rng_next(&r) % 33) - 16) / 16.0f);
}

/* ---- One rank's state. ---- */

struct rk {
        struct shared *sh;
        struct moeep_client *c;
        struct moeep_ep *ep;
        int me, R, L, S;
        bool two; /* two daemons */
        cudaStream_t st;
        void *x, *idx, *out;
        void *y; /* normal mode: the received rows, as combine input */
        float *w;
        int32_t *mask_dev;
        uint16_t *got; /* host: combine output */
        uint8_t *rx;   /* host: received rows of one expert */
        int *src;
        int64_t *range;
        struct input *in; /* [R] */
        char *msg;
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

static int rk_alloc(struct rk *k) {
        k->in = calloc((size_t)k->R, sizeof(*k->in));
        k->got = malloc((size_t)MAX_T * H * 2);
        k->rx = malloc((size_t)k->S * H * 2);
        k->src = malloc((size_t)k->S * sizeof(int));
        k->range = malloc((size_t)k->L * k->R * sizeof(int64_t));
        if (!k->in || !k->got || !k->rx || !k->src || !k->range || cudaStreamCreate(&k->st) != cudaSuccess ||
            cudaMalloc(&k->x, (size_t)MAX_T * H * 2) != cudaSuccess ||
            cudaMalloc(&k->idx, (size_t)MAX_T * K * 8) != cudaSuccess ||
            cudaMalloc((void **)&k->w, (size_t)MAX_T * K * 4) != cudaSuccess ||
            cudaMalloc(&k->out, (size_t)MAX_T * H * 2) != cudaSuccess ||
            cudaMalloc(&k->y, (size_t)k->R * MAX_T * H * 2) != cudaSuccess ||
            cudaMalloc((void **)&k->mask_dev, MOEEP_MAX_RANKS * sizeof(int32_t)) != cudaSuccess)
                return -1;
        return 0;
}

static void rk_free(struct rk *k) {
        cudaFree(k->x);
        cudaFree(k->idx);
        cudaFree(k->w);
        cudaFree(k->out);
        cudaFree(k->y);
        cudaFree(k->mask_dev);
        if (k->st)
                cudaStreamDestroy(k->st);
        free(k->in);
        free(k->got);
        free(k->rx);
        free(k->src);
        free(k->range);
}

#define FAIL(...)                                   \
        do {                                        \
                snprintf(k->msg, 240, __VA_ARGS__); \
                return -1;                          \
        } while (0)

/* The endpoint's mask as bits; 0 on failure (with msg). */
static int mask_bits(struct rk *k, uint32_t *ret) {
        int32_t m[MOEEP_MAX_RANKS];

        if (moeep_ll_mask_query(k->ep, k->mask_dev, k->st) < 0 ||
            cudaStreamSynchronize(k->st) != cudaSuccess ||
            cudaMemcpy(m, k->mask_dev, sizeof(int32_t) * k->R, cudaMemcpyDeviceToHost) != cudaSuccess)
                FAIL("mask query: %s", moeep_ep_error(k->ep));
        *ret = 0;
        for (int r = 0; r < k->R; r++)
                if (m[r])
                        *ret |= 1u << r;
        return 0;
}

static int upload(struct rk *k, const struct input *in) {
        if (cudaMemcpy(k->x, in->x, (size_t)in->T * H * 2, cudaMemcpyHostToDevice) != cudaSuccess ||
            cudaMemcpy(k->idx, in->idx, (size_t)in->T * K * 8, cudaMemcpyHostToDevice) != cudaSuccess ||
            cudaMemcpy(k->w, in->w, (size_t)in->T * K * 4, cudaMemcpyHostToDevice) != cudaSuccess ||
            cudaMemset(k->out, 0xff, (size_t)MAX_T * H * 2) != cudaSuccess)
                FAIL("uploading the inputs failed");
        return 0;
}

/* Pairs of source s for global expert e. */
static int pairs_of(const struct input *in, int e) {
        int n = 0;

        for (int i = 0; i < in->T * K; i++)
                n += in->idx[i] == e;
        return n;
}

/* Checks the receive side (see the top): sources in `must_absent` must be
 * absent, in `may_absent` may be, the others present. Returns the sources
 * found absent (that had pairs for us) in *ret_absent. */
static int verify_dispatch(struct rk *k, const struct moeep_ll_dispatch_result *res, uint32_t must_absent,
                           uint32_t may_absent, uint32_t *ret_absent) {
        const int R = k->R, L = k->L, S = k->S, me = k->me;
        uint32_t present = 0, absent = 0;
        int counts[EPR * MOEEP_MAX_RANKS];

        if (cudaMemcpy(k->range, res->layout_range, sizeof(int64_t) * L * R, cudaMemcpyDeviceToHost) !=
                    cudaSuccess ||
            cudaMemcpy(counts, res->recv_count, sizeof(int) * L, cudaMemcpyDeviceToHost) != cudaSuccess)
                FAIL("reading layout_range / recv_count failed");
        /* Sources in rank order, this daemon's first. */
        int order[MOEEP_MAX_RANKS], no = 0;
        for (int pass = 0; pass < 2; pass++)
                for (int s = 0; s < R; s++)
                        if ((k->two && harness_node_of(s, R) != harness_node_of(me, R)) == (pass == 1))
                                order[no++] = s;
        for (int le = 0; le < L; le++) {
                const int e = me * L + le;
                int begin = 0;
                for (int oi = 0; oi < R; oi++) {
                        const int s = order[oi], want = pairs_of(&k->in[s], e);
                        const int64_t v = k->range[(size_t)le * R + s];
                        const int got = (int)(v & 0xffffffff);
                        if (want == 0 && got == 0)
                                continue;
                        if (got == want) {
                                present |= 1u << s;
                        } else if (got == 0) {
                                absent |= 1u << s;
                                continue;
                        } else {
                                FAIL("expert %d: layout_range of rank %d counts %d pairs, want %d or 0", e, s,
                                     got, want);
                        }
                        if ((v >> 32) != begin)
                                FAIL("expert %d: rank %d's run starts at %lld, want %d (runs from slot 0 on, "
                                     "in "
                                     "rank order)",
                                     e, s, (long long)(v >> 32), begin);
                        begin += got;
                }
                if (counts[le] != begin)
                        FAIL("expert %d: recv_count %d, the runs add up to %d", e, counts[le], begin);
                if (cudaMemcpy(k->rx, (const char *)res->recv_x + (size_t)le * S * H * 2,
                               (size_t)begin * H * 2, cudaMemcpyDeviceToHost) != cudaSuccess ||
                    cudaMemcpy(k->src, res->recv_src_info + (size_t)le * S, sizeof(int) * begin,
                               cudaMemcpyDeviceToHost) != cudaSuccess)
                        FAIL("reading expert %d's slots failed", e);
                for (int oi = 0; oi < R; oi++) {
                        const int s = order[oi];
                        const int64_t v = k->range[(size_t)le * R + s];
                        const int first = (int)(v >> 32), n = (int)(v & 0xffffffff);
                        uint8_t seen[MAX_T] = { 0 };
                        for (int p = first; p < first + n; p++) {
                                const int t = k->src[p];
                                if (t < 0 || t >= k->in[s].T || seen[t]++)
                                        FAIL("expert %d slot %d: token %d of rank %d is not expected there "
                                             "(or "
                                             "twice)",
                                             e, p, t, s);
                                bool has = false;
                                for (int j = 0; j < K; j++)
                                        has |= k->in[s].idx[(size_t)t * K + j] == e;
                                if (!has || memcmp(k->rx + (size_t)p * H * 2, k->in[s].x + (size_t)t * H,
                                                   (size_t)H * 2))
                                        FAIL("expert %d slot %d (rank %d token %d): %s", e, p, s, t,
                                             has ? "row differs" : "no such pair");
                        }
                }
        }
        if (present & absent)
                FAIL("ranks 0x%x are there at some experts and absent at others", present & absent);
        if (absent & ~(must_absent | may_absent))
                FAIL("ranks 0x%x are absent, only 0x%x may be", absent, must_absent | may_absent);
        if (present & must_absent)
                FAIL("ranks 0x%x masked before the call are there", present & must_absent);
        *ret_absent = absent;
        return 0;
}

/* Checks the combine output: per 512-channel piece of each token, the
 * weighted sum of its experts' outputs (every expert is the identity: the
 * combine reads the dispatch's slots in place, zero copy) without the
 * experts of ranks in `out` and of any subset of `maybe`. */
static int verify_combine(struct rk *k, uint32_t out, uint32_t maybe) {
        const struct input *in = &k->in[k->me];
        int mr[MOEEP_MAX_RANKS], nm = 0;

        for (int r = 0; r < k->R; r++)
                if ((maybe >> r & 1) && !(out >> r & 1))
                        mr[nm++] = r;
        if (cudaMemcpy(k->got, k->out, (size_t)in->T * H * 2, cudaMemcpyDeviceToHost) != cudaSuccess)
                FAIL("reading the combine output failed");
        for (int t = 0; t < in->T; t++)
                for (int c0 = 0; c0 < H; c0 += PIECE) {
                        bool ok = false;
                        for (int sub = 0; sub < 1 << nm && !ok; sub++) {
                                uint32_t left_out = out;
                                for (int j = 0; j < nm; j++)
                                        if (sub >> j & 1)
                                                left_out |= 1u << mr[j];
                                ok = true;
                                for (int c = c0; c < c0 + PIECE && ok; c++) {
                                        double ref = 0;
                                        for (int j = 0; j < K; j++) {
                                                const int64_t e = in->idx[(size_t)t * K + j];
                                                if (e < 0 || (left_out >> (e / EPR) & 1))
                                                        continue;
                                                ref += (double)in->w[(size_t)t * K + j] *
                                                       bf16_to_float(in->x[(size_t)t * H + c]);
                                        }
                                        const float g = bf16_to_float(k->got[(size_t)t * H + c]);
                                        ok = fabs(g - ref) <= fmax(fabs(ref), 1.0) / 64.0;
                                }
                        }
                        if (!ok)
                                FAIL("combine token %d channels %d..%d: no reference leaving out ranks 0x%x "
                                     "(and any "
                                     "of 0x%x) matches",
                                     t, c0, c0 + PIECE - 1, out, maybe);
                }
        return 0;
}

/* A round in two halves, so that a rank can die between them: the
 * dispatch (every rank's inputs of round `round`), then the combine of
 * its slots in place. `lost_ok`: ranks that may be lost during the call.
 * With `quiet` (a rank that is about to die), calls only, no checks. */
struct round {
        struct moeep_ll_dispatch_result res;
        uint32_t mask; /* the mask before the half under way */
        bool quiet, hook;
        int n;
        int64_t t_done; /* when the last half's call ended (before its checks) */
};

static int half_dispatch(struct rk *k, struct round *rd, int round, uint32_t lost_ok, bool quiet, bool hook) {
        struct moeep_ll_hook hk = { 0 };
        uint32_t after = 0, absent = 0;

        *rd = (struct round){ .quiet = quiet, .hook = hook, .n = round };
        for (int s = 0; s < k->R; s++)
                if (!quiet || s == k->me)
                        gen_input(&k->in[s], k->sh->seed, k->sh->ci, s, k->R, round);
        if (upload(k, &k->in[k->me]) < 0 || (!quiet && mask_bits(k, &rd->mask) < 0))
                return -1;
        struct moeep_ll_dispatch_args da = { .x = k->x,
                                             .num_tokens = k->in[k->me].T,
                                             .topk_idx = k->idx,
                                             .topk_idx_type = MOEEP_INDEX_INT64,
                                             .num_topk = K,
                                             .return_recv_hook = hook };
        if (moeep_ll_dispatch(k->ep, &da, &rd->res, &hk, k->st) < 0 ||
            (hook && moeep_ll_hook_run(k->ep, &hk, k->st) < 0))
                FAIL("round %d: dispatch: %s", round, moeep_ep_error(k->ep));
        if (cudaStreamSynchronize(k->st) != cudaSuccess || moeep_ep_check(k->ep) < 0)
                FAIL("round %d: dispatch failed on the device: %s", round, moeep_ep_error(k->ep));
        rd->t_done = now_ns();
        if (quiet)
                return 0;
        if (mask_bits(k, &after) < 0)
                return -1;
        if (after & ~(rd->mask | lost_ok))
                FAIL("round %d: dispatch masked ranks 0x%x, only 0x%x may go", round, after & ~rd->mask,
                     lost_ok);
        if (verify_dispatch(k, &rd->res, rd->mask, after & ~rd->mask, &absent) < 0)
                return -1;
        rd->mask = after;
        return 0;
}

static int half_combine(struct rk *k, struct round *rd, uint32_t lost_ok) {
        struct moeep_ll_hook hk = { 0 };
        uint32_t after = 0;

        if (!rd->quiet && mask_bits(k, &rd->mask) < 0)
                return -1;
        struct moeep_ll_combine_args ca = { .x = rd->res.combine_buffer,
                                            .topk_idx = k->idx,
                                            .topk_idx_type = MOEEP_INDEX_INT64,
                                            .topk_weights = k->w,
                                            .num_topk = K,
                                            .handle = &rd->res.handle,
                                            .out = k->out,
                                            .return_recv_hook = rd->hook };
        if (moeep_ll_combine(k->ep, &ca, &hk, k->st) < 0 ||
            (rd->hook && moeep_ll_hook_run(k->ep, &hk, k->st) < 0))
                FAIL("round %d: combine: %s", rd->n, moeep_ep_error(k->ep));
        if (cudaStreamSynchronize(k->st) != cudaSuccess || moeep_ep_check(k->ep) < 0)
                FAIL("round %d: combine failed on the device: %s", rd->n, moeep_ep_error(k->ep));
        rd->t_done = now_ns();
        if (rd->quiet)
                return 0;
        if (mask_bits(k, &after) < 0)
                return -1;
        if (after & ~(rd->mask | lost_ok))
                FAIL("round %d: combine masked ranks 0x%x, only 0x%x may go", rd->n, after & ~rd->mask,
                     lost_ok);
        return verify_combine(k, rd->mask, after & ~rd->mask);
}

static int ll_round(struct rk *k, int round, uint32_t lost_ok, bool quiet, bool hook) {
        struct round rd;

        if (half_dispatch(k, &rd, round, lost_ok, quiet, hook) < 0)
                return -1;
        return half_combine(k, &rd, lost_ok);
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
                        struct rng r = rng_make(k->sh->seed, 98, 5);
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

        gen_input(in, k->sh->seed, k->sh->ci, k->me, R, 100 + round);
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
        struct rk k = { .sh = sh, .c = c, .me = me, .R = R, .L = EPR, .S = R * MAX_T, .msg = sh->msg[me] };
        struct moeep_ep_config cfg =
                ll_config(R, ci == SILENT_RANK || ci == SKIPPED_CLEAN ? SILENT_TIMEOUT_MS : 0);
        int r = -1;
        (void)arg;

        sh->rc[me] = 1;
        k.two = sh->socket_b[0] != '\0';
        if (ci == NORMAL_REBUILD)
                cfg.ll_shrink = 1; /* normal mode of an elastic endpoint */
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
