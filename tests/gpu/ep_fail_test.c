/* Failures on GPUs (issue 7): a rank killed with SIGKILL while the others
 * wait in a dispatch or combine (normal and low-latency mode), a rank that
 * stops calling, and moeepd stopped with SIGTERM or SIGKILL under a live job.
 *
 * Each case runs in a job of its own. What is checked:
 *  - every survivor's call fails with the error that names the lost rank
 *    (or the timeout, or the lost daemon) within 100 ms of the failure
 *    (a hung rank: within 100 ms of the configured timeout); the largest
 *    delay is printed;
 *  - the survivors then destroy the endpoint, get their GPU memory back and
 *    run work on the same CUDA context;
 *  - after the daemon restarts, the same processes attach to a new job and
 *    run a checked dispatch and combine;
 *  - after each case a fresh job on the same GPUs dispatches and combines
 *    correctly, and moeepd holds as many descriptors as before the case.
 *
 * With MOEEP_HARNESS_NODES=2 the upper half of the ranks is at a second
 * daemon (two simulated nodes): the killed rank is there, and in the
 * daemon cases (the first daemon restarted) the ranks there get the job's
 * abort naming a lost rank and join the next job through their own daemon.
 *
 * Usage: ep_fail_test [--ranks LIST] [--seed N] [--moeepd PATH]. Exits 77
 * (meson: skipped) without a GPU; ranks beyond the GPUs share them. */
#include <dirent.h>
#include <errno.h>
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

#define DETECT_LIMIT_MS 100.0
#define HUNG_TIMEOUT_MS 300
#define VICTIM_DELAY_MS 50

enum fail_case {
        KILL_IN_DISPATCH,
        KILL_IN_COMBINE,
        KILL_IN_LL_DISPATCH,
        KILL_IN_LL_COMBINE,
        HUNG_RANK,
        DAEMON_SIGTERM,
        DAEMON_SIGKILL,
        NCASES,
        HEALTHY = NCASES, /* the fresh job after each case */
};

static const char *const case_names[] = {
        [KILL_IN_DISPATCH] = "rank killed in dispatch",
        [KILL_IN_COMBINE] = "rank killed in combine",
        [KILL_IN_LL_DISPATCH] = "rank killed in low-latency dispatch",
        [KILL_IN_LL_COMBINE] = "rank killed in low-latency combine",
        [HUNG_RANK] = "rank stops calling (timeout_ms 300)",
        [DAEMON_SIGTERM] = "moeepd stopped (SIGTERM) and started again",
        [DAEMON_SIGKILL] = "moeepd killed (SIGKILL) and started again",
        [HEALTHY] = "fresh job afterwards (alone: the two-node warm-up)",
};

/* MAP_SHARED between the driver and the ranks of one job. */
struct shared {
        int ci;
        uint64_t seed;
        char socket[128];
        char socket_b[128];           /* two nodes: the second daemon's, "" otherwise */
        volatile int64_t fail_ns;     /* CLOCK_MONOTONIC when the victim died / moeepd was stopped */
        volatile int daemon_signal;   /* set by rank 0: the driver stops moeepd with it */
        volatile int daemon_restarts; /* bumped by the driver once moeepd is back */
        volatile int job_ready;
        volatile int destroyed;     /* survivors that freed their endpoint */
        volatile int left;          /* survivors that left the job */
        volatile int checked;       /* survivors that checked their GPU memory came back */
        volatile int allocated;     /* ranks whose context and test buffers exist */
        struct moeep_unique_id job; /* the job made after the restart */
        int rc[MOEEP_MAX_RANKS];    /* 0 pass, 1 fail, -1 not reached */
        double delay_ms[MOEEP_MAX_RANKS];
        char msg[MOEEP_MAX_RANKS][240];
};

#define FAIL(...)                                                        \
        do {                                                             \
                snprintf(sh->msg[me], sizeof(sh->msg[me]), __VA_ARGS__); \
                goto out;                                                \
        } while (0)

/* ---- One checked normal-mode round, and the buffers it uses. ---- */

enum {
        H = 7168,
        K = 4,
        MAX_T = 256,
        EPR = 8 /* experts per rank */
};

struct io {
        void *x, *idx, *y, *out;
        int T;
        uint16_t *hx;  /* host x */
        int64_t *hidx; /* host top-k */
};

static void io_free(struct io *io) {
        cudaFree(io->x);
        cudaFree(io->idx);
        cudaFree(io->y);
        cudaFree(io->out);
        free(io->hx);
        free(io->hidx);
        memset(io, 0, sizeof(*io));
}

/* Fresh random tokens: x in multiples of 1/8 (sums stay exact in bf16). */
static int io_fill(struct io *io, int me, int R, uint64_t seed, int round) {
        struct rng g = rng_make(seed, (uint64_t)me + 1, (uint64_t)round + 100);
        int E = EPR * R;

        io->T = 1 + (int)(rng_next(&g) % MAX_T);
        for (size_t i = 0; i < (size_t)io->T * H; i++)
                io->hx[i] = float_to_bf16((float)((int)(rng_next(&g) % 17) - 8) / 8.0f);
        for (int t = 0; t < io->T; t++)
                draw_topk(&g, io->hidx + (size_t)t * K, K, 0, E, 0.1);
        if (cudaMemcpy(io->x, io->hx, (size_t)io->T * H * 2, cudaMemcpyHostToDevice) != cudaSuccess ||
            cudaMemcpy(io->idx, io->hidx, (size_t)io->T * K * 8, cudaMemcpyHostToDevice) != cudaSuccess ||
            cudaMemset(io->out, 0xff, (size_t)MAX_T * H * 2) != cudaSuccess)
                return -1;
        return 0;
}

static int io_alloc(struct io *io, int R) {
        memset(io, 0, sizeof(*io));
        io->hx = malloc((size_t)MAX_T * H * 2);
        io->hidx = malloc((size_t)MAX_T * K * 8);
        if (!io->hx || !io->hidx || cudaMalloc(&io->x, (size_t)MAX_T * H * 2) != cudaSuccess ||
            cudaMalloc(&io->idx, (size_t)MAX_T * K * 8) != cudaSuccess ||
            cudaMalloc(&io->y, (size_t)R * MAX_T * H * 2) != cudaSuccess ||
            cudaMalloc(&io->out, (size_t)MAX_T * H * 2) != cudaSuccess)
                return -1;
        return 0;
}

static struct moeep_dispatch_args dispatch_args(const struct io *io) {
        return (struct moeep_dispatch_args){
                .x = io->x,
                .x_type = MOEEP_DTYPE_BF16,
                .num_tokens = io->T,
                .topk_idx = io->idx,
                .topk_idx_type = MOEEP_INDEX_INT64,
                .num_topk = K,
                .expert_alignment = 1,
        };
}

/* Dispatch and combine (y = the received rows): every token comes back
 * as x times the number of ranks it reached. 0, or -1 with msg set. */
static int round_normal(struct moeep_ep *ep, struct io *io, int me, int R, uint64_t seed, int round,
                        char *msg, size_t len) {
        struct moeep_dispatch_args a;
        struct moeep_dispatch_result res;
        uint16_t *got = NULL;
        int r, bad = 0;

        if (io_fill(io, me, R, seed, round) < 0)
                return snprintf(msg, len, "uploading inputs failed"), -1;
        a = dispatch_args(io);
        if ((r = moeep_dispatch(ep, &a, &res, 0)) < 0)
                return snprintf(msg, len, "dispatch: %s", moeep_ep_error(ep)), -1;
        if (res.num_recv_tokens > 0 && cudaMemcpy(io->y, res.recv_x, (size_t)res.num_recv_tokens * H * 2,
                                                  cudaMemcpyDeviceToDevice) != cudaSuccess)
                return snprintf(msg, len, "copying recv_x failed"), -1;
        struct moeep_combine_args c = { .x = io->y, .handle = res.handle, .out = io->out };
        if ((r = moeep_combine(ep, &c, 0)) < 0 || (r = moeep_ep_check(ep)) < 0) {
                snprintf(msg, len, "combine: %s", moeep_ep_error(ep));
                moeep_ep_handle_free(res.handle);
                return -1;
        }
        moeep_ep_handle_free(res.handle);
        got = malloc((size_t)io->T * H * 2);
        if (!got || cudaMemcpy(got, io->out, (size_t)io->T * H * 2, cudaMemcpyDeviceToHost) != cudaSuccess) {
                free(got);
                return snprintf(msg, len, "reading out failed"), -1;
        }
        for (int t = 0; t < io->T && !bad; t++) {
                unsigned hit = 0;
                for (int k = 0; k < K; k++)
                        if (io->hidx[(size_t)t * K + k] >= 0)
                                hit |= 1u << (io->hidx[(size_t)t * K + k] / EPR);
                for (int ch = 0; ch < H; ch++) {
                        float want =
                                bf16_to_float(io->hx[(size_t)t * H + ch]) * (float)__builtin_popcount(hit);
                        float have = bf16_to_float(got[(size_t)t * H + ch]);
                        if (have != want) {
                                snprintf(msg, len, "round %d: out[%d][%d] = %g, want %g", round, t, ch, have,
                                         want);
                                bad = 1;
                                break;
                        }
                }
        }
        free(got);
        return bad ? -1 : 0;
}

static struct moeep_ep_config ep_config(int R, bool ll, int timeout_ms) {
        return (struct moeep_ep_config){
                .max_tokens_per_rank = MAX_T,
                .hidden = H,
                .num_experts = EPR * R,
                .max_topk = K,
                .timeout_ms = timeout_ms,
                .ll_max_tokens = ll ? MAX_T : 0,
        };
}

static size_t gpu_free_bytes(void) {
        size_t f = 0, t = 0;
        cudaMemGetInfo(&f, &t);
        return f;
}

#define MEM_SLACK (4u << 20)

/* How long a daemon keeps a receive or counters registration that its rank
 * let go (DATAPATH_MR_LINGER_MS, daemon/datapath/datapath.h), so that
 * writes other daemons had in flight to it land: with the cuda transport
 * the registration is an import of the rank's GPU memory, which comes back
 * only then. */
#define LINGER_MS 10000

/* Whether the daemons run the cuda transport with the proxy regions in GPU
 * memory (tests/gpu/cuda-transport.sh). */
static bool px_in_gpu(void) {
        const char *px = getenv("MOEEP_PX_MEMORY"), *tp = getenv("MOEEP_HARNESS_TRANSPORT");

        return tp && !strcmp(tp, "cuda") && !(px && !strcmp(px, "host"));
}

/* How long the checks wait for what a case held to come back: with the
 * proxy regions in GPU memory, past the daemons' linger. */
static int settle_ms(void) {
        return px_in_gpu() ? LINGER_MS + 2000 : 2000;
}

/* Whether every GPU of R ranks has its free memory of `before` back (less
 * a slack), after[] filled; true where it cannot be read. */
static bool gpus_back(const size_t *before, size_t *after, int R) {
        if (harness_gpu_free(after, R) < 0)
                return true;
        for (int g = 0; g < R; g++)
                if (after[g] + MEM_SLACK < before[g])
                        return false;
        return true;
}

/* Polls (settle_ms()) until free GPU memory is back to free_before (less a
 * slack); -1 with the message naming `when` otherwise. */
static int memory_back(size_t free_before, const char *when, char *msg, size_t len) {
        size_t free_after = 0;

        for (int i = 0; i < settle_ms() / 10; i++) {
                free_after = gpu_free_bytes();
                if (free_after + MEM_SLACK >= free_before)
                        return 0;
                sleep_ms(10);
        }
        snprintf(msg, len, "GPU memory not returned %s: %zu MiB free before the endpoint, %zu after", when,
                 free_before >> 20, free_after >> 20);
        return -1;
}

/* The endpoint is gone on every survivor: our GPU memory comes back (once
 * the peers' mappings and the daemon's descriptor of it are gone too; the
 * modules are loaded eagerly, so nothing else should stay), all of it once
 * the rank left the job, and the context still runs work. A rank's proxy
 * regions are the job's, not the endpoint's (ep-px.c: later endpoints of
 * the job reuse them, freed at leave): with the host-staged transports
 * they are host memory, with the cuda transport GPU memory (unless
 * MOEEP_PX_MEMORY=host), and only then is the check at destroy skipped,
 * leaving the one after leave (as moeep.Buffer.destroy() leaves; a session
 * whose daemon is gone forgets the job). */
static int after_destroy(struct moeep_client *c, struct shared *sh, int survivors, size_t free_before,
                         char *msg, size_t len) {
        const int wait_ms = 10000 + settle_ms(); /* the others may wait for the linger first */
        void *p = NULL;
        int r = 0;

        __atomic_add_fetch(&sh->destroyed, 1, __ATOMIC_ACQ_REL);
        if (!wait_shared(&sh->destroyed, survivors, 10000))
                return snprintf(msg, len, "the other survivors did not free their endpoints"), -1;
        if (!px_in_gpu())
                r = memory_back(free_before, "after the endpoint", msg, len);
        moeep_job_leave(c);
        __atomic_add_fetch(&sh->left, 1, __ATOMIC_ACQ_REL);
        if (!wait_shared(&sh->left, survivors, wait_ms) && r == 0) {
                snprintf(msg, len, "the other survivors did not leave the job");
                r = -1;
        }
        if (r == 0)
                r = memory_back(free_before, "after leaving the job", msg, len);
        /* Ranks sharing a GPU see each other's memory: nobody goes on (to
         * allocate again) until every survivor has looked. */
        __atomic_add_fetch(&sh->checked, 1, __ATOMIC_ACQ_REL);
        if (!wait_shared(&sh->checked, survivors, wait_ms) && r == 0) {
                snprintf(msg, len, "the other survivors did not check their GPU memory");
                r = -1;
        }
        if (r < 0)
                return r;
        if (cudaMalloc(&p, 1 << 20) != cudaSuccess || cudaMemset(p, 0, 1 << 20) != cudaSuccess ||
            cudaDeviceSynchronize() != cudaSuccess || cudaFree(p) != cudaSuccess)
                return snprintf(msg, len, "the CUDA context is unusable: %s",
                                cudaGetErrorString(cudaGetLastError())),
                       -1;
        return 0;
}

/* ---- The cases, as run by every rank. ---- */

/* The call that the victim never makes: survivors wait in it. */
static int call_stuck(struct moeep_ep *ep, int ci, struct io *io, struct moeep_ep_handle *h,
                      const struct moeep_ll_dispatch_result *lres) {
        struct moeep_dispatch_args a = dispatch_args(io);
        struct moeep_dispatch_result res;
        int r;

        switch (ci) {
        case KILL_IN_DISPATCH:
        case HUNG_RANK:
        case DAEMON_SIGTERM:
        case DAEMON_SIGKILL:
                r = moeep_dispatch(ep, &a, &res, 0);
                if (r == 0)
                        moeep_ep_handle_free(res.handle);
                break;
        case KILL_IN_COMBINE: {
                struct moeep_combine_args c = { .x = io->y, .handle = h, .out = io->out };
                r = moeep_combine(ep, &c, 0);
                break;
        }
        case KILL_IN_LL_DISPATCH: {
                struct moeep_ll_dispatch_args la = { .x = io->x,
                                                     .num_tokens = io->T,
                                                     .topk_idx = io->idx,
                                                     .topk_idx_type = MOEEP_INDEX_INT64,
                                                     .num_topk = K };
                struct moeep_ll_dispatch_result lr;
                r = moeep_ll_dispatch(ep, &la, &lr, NULL, 0);
                break;
        }
        default: {
                /* Zero copy from the dispatch's slots; y (zeroed) as weights. */
                struct moeep_ll_combine_args lc = { .x = lres->recv_x,
                                                    .topk_idx = io->idx,
                                                    .topk_idx_type = MOEEP_INDEX_INT64,
                                                    .topk_weights = (const float *)io->y,
                                                    .num_topk = K,
                                                    .handle = &lres->handle,
                                                    .out = io->out };
                r = moeep_ll_combine(ep, &lc, NULL, 0);
                break;
        }
        }
        return r < 0 ? r : moeep_ep_check(ep);
}

static int rank_case(struct moeep_client *c, int me, int R, void *shared, void *arg) {
        struct shared *sh = shared;
        const int ci = sh->ci, victim = R - 1;
        const bool ll = ci == KILL_IN_LL_DISPATCH || ci == KILL_IN_LL_COMBINE;
        const bool daemon_case = ci == DAEMON_SIGTERM || ci == DAEMON_SIGKILL;
        /* Two nodes (MOEEP_HARNESS_NODES=2): the upper ranks are at the second daemon. */
        const bool at_b = sh->socket_b[0] && harness_node_of(me, R);
        struct moeep_ep_config cfg = ep_config(R, ll, ci == HUNG_RANK ? HUNG_TIMEOUT_MS : 0);
        struct moeep_client *c2 = NULL, *creator = NULL;
        struct moeep_ep *ep = NULL;
        struct moeep_dispatch_result dres = { 0 };
        struct moeep_ll_dispatch_result lres;
        struct io io;
        size_t free0;
        int r;
        (void)arg;

        sh->rc[me] = 1;
        if (io_alloc(&io, R) < 0)
                FAIL("allocating test buffers failed");
        /* The baseline once every rank's context and buffers exist: ranks
         * sharing a GPU see each other's memory in cudaMemGetInfo. */
        __atomic_add_fetch(&sh->allocated, 1, __ATOMIC_ACQ_REL);
        if (!wait_shared(&sh->allocated, R, 10000))
                FAIL("the other ranks did not allocate their test buffers");
        free0 = gpu_free_bytes();
        if (moeep_ep_create(c, &cfg, &ep) < 0)
                FAIL("endpoint: %s", moeep_client_error(c));
        if (round_normal(ep, &io, me, R, sh->seed, 0, sh->msg[me], sizeof(sh->msg[me])) < 0)
                goto out;
        if (ci == HEALTHY) {
                sh->rc[me] = 0;
                goto out;
        }

        /* The call the survivors will be stuck in needs its inputs (and, for
         * a combine, a completed dispatch) first. */
        if (io_fill(&io, me, R, sh->seed, 1) < 0)
                FAIL("uploading inputs failed");
        if (ci == KILL_IN_COMBINE) {
                struct moeep_dispatch_args a = dispatch_args(&io);
                if (moeep_dispatch(ep, &a, &dres, 0) < 0)
                        FAIL("dispatch before the kill: %s", moeep_ep_error(ep));
        } else if (ci == KILL_IN_LL_DISPATCH || ci == KILL_IN_LL_COMBINE) {
                struct moeep_ll_dispatch_args la = { .x = io.x,
                                                     .num_tokens = io.T,
                                                     .topk_idx = io.idx,
                                                     .topk_idx_type = MOEEP_INDEX_INT64,
                                                     .num_topk = K };
                if (moeep_ll_dispatch(ep, &la, &lres, NULL, 0) < 0 || moeep_ep_check(ep) < 0)
                        FAIL("low-latency dispatch before the kill: %s", moeep_ep_error(ep));
                if (cudaMemset(io.y, 0, (size_t)R * MAX_T * H * 2) != cudaSuccess)
                        FAIL("cudaMemset failed");
        }
        if (moeep_job_barrier(c) < 0)
                FAIL("barrier: %s", moeep_client_error(c));

        if (me == victim && ci != HUNG_RANK && !daemon_case) {
                sleep_ms(VICTIM_DELAY_MS);
                sh->fail_ns = now_ns();
                raise(SIGKILL);
        }
        if (me == victim && ci == HUNG_RANK) {
                sleep_ms(3 * HUNG_TIMEOUT_MS); /* "busy in user code" */
                moeep_ep_destroy(ep);
                ep = NULL;
                if (after_destroy(c, sh, R, free0, sh->msg[me], sizeof(sh->msg[me])) == 0)
                        sh->rc[me] = 0;
                goto out;
        }
        if (daemon_case) {
                if (me == 0)
                        __atomic_store_n(&sh->daemon_signal, ci == DAEMON_SIGTERM ? SIGTERM : SIGKILL,
                                         __ATOMIC_RELEASE);
                if (!wait_shared(&sh->daemon_restarts, 1, 20000))
                        FAIL("moeepd was not restarted within 20 s");
        }

        int64_t t0 = now_ns();
        r = call_stuck(ep, ci, &io, dres.handle, &lres);
        int64_t t1 = now_ns();
        double since = (double)(t1 - (ci == HUNG_RANK || daemon_case ? t0 : sh->fail_ns)) / 1e6;
        const char *err = moeep_ep_error(ep);
        char want[64];

        sh->delay_ms[me] = ci == HUNG_RANK ? since - HUNG_TIMEOUT_MS : since;
        if (daemon_case && at_b) /* two nodes: our daemon stays; the job lost the ranks at the stopped one */
                snprintf(want, sizeof(want), "lost)");
        else if (ci == HUNG_RANK)
                snprintf(want, sizeof(want), "for rank %d", victim);
        else if (ci == DAEMON_SIGKILL)
                snprintf(want, sizeof(want), "moeepd closed the connection");
        else if (ci == DAEMON_SIGTERM) /* the abort word, or the socket when it is seen first */
                snprintf(want, sizeof(want),
                         strstr(err, "stopping") ? "the daemon is stopping" : "moeepd closed the connection");
        else
                snprintf(want, sizeof(want), "(rank %d lost)", victim);
        if (r == 0)
                FAIL("the call succeeded (after %.1f ms)", since);
        if (ci == HUNG_RANK && r != -ETIMEDOUT)
                FAIL("error %d (%s), want -ETIMEDOUT", r, err);
        if (!strstr(err, want))
                FAIL("error text \"%s\" lacks \"%s\"", err, want);
        if (ci != HUNG_RANK && !daemon_case && t1 < sh->fail_ns)
                FAIL("the call failed before rank %d died: %s", victim, err);
        if (sh->delay_ms[me] < -1.0 || sh->delay_ms[me] > DETECT_LIMIT_MS)
                FAIL("error after %.1f ms (limit %.0f): %s", since, DETECT_LIMIT_MS, err);
        if (dres.handle)
                moeep_ep_handle_free(dres.handle);
        dres.handle = NULL;
        moeep_ep_destroy(ep);
        ep = NULL;
        if (after_destroy(c, sh, ci == HUNG_RANK || daemon_case ? R : R - 1, free0, sh->msg[me],
                          sizeof(sh->msg[me])) < 0)
                goto out;
        if (!daemon_case) {
                sh->rc[me] = 0;
                goto out;
        }

        /* The daemon is back: attach again, in the same process (two nodes:
         * at our own daemon, whose mesh connection to the restarted one may
         * take a moment to come back). */
        if (moeep_connect(at_b ? sh->socket_b : sh->socket, &c2) < 0)
                FAIL("connect after the restart failed");
        if (me == 0) {
                if (moeep_connect(sh->socket, &creator) < 0 ||
                    moeep_job_create(creator, "ep_fail_test-again", R, &sh->job) < 0)
                        FAIL("job create after the restart: %s", creator ? moeep_client_error(creator) : "");
                __atomic_store_n(&sh->job_ready, 1, __ATOMIC_RELEASE);
        } else if (!wait_shared(&sh->job_ready, 1, 20000)) {
                FAIL("rank 0 made no job after the restart");
        }
        for (int i = 0; moeep_job_join(c2, &sh->job, me, R, NULL) < 0; i++) {
                if (!at_b || i == 100)
                        FAIL("join after the restart: %s", moeep_client_error(c2));
                moeep_client_free(c2);
                c2 = NULL;
                nanosleep(&(struct timespec){ .tv_nsec = 100 * 1000 * 1000 }, NULL);
                if (moeep_connect(sh->socket_b, &c2) < 0)
                        FAIL("connect after the restart failed");
        }
        if (moeep_ep_create(c2, &cfg, &ep) < 0)
                FAIL("endpoint after the restart: %s", moeep_client_error(c2));
        if (round_normal(ep, &io, me, R, sh->seed, 2, sh->msg[me], sizeof(sh->msg[me])) < 0)
                goto out;
        sh->rc[me] = 0;
out:
        if (dres.handle)
                moeep_ep_handle_free(dres.handle);
        moeep_ep_destroy(ep);
        io_free(&io);
        if (c2)
                moeep_job_leave(c2);
        moeep_client_free(c2);
        moeep_client_free(creator);
        return sh->rc[me];
}

/* The driver's part of the daemon cases: stop moeepd as rank 0 asked,
 * start it again, tell the ranks. */
static void watch(struct harness *h, void *arg) {
        struct shared *sh = h->shared;
        int sig = __atomic_load_n(&sh->daemon_signal, __ATOMIC_ACQUIRE);
        (void)arg;

        if (!sig)
                return;
        sh->daemon_signal = 0;
        if (harness_daemon_stop(h, sig) < 0)
                fprintf(stderr, "ep_fail_test: stopping moeepd with signal %d failed\n", sig);
        sh->fail_ns = now_ns();
        if (harness_daemon_start(h) < 0)
                fprintf(stderr, "ep_fail_test: moeepd did not start again\n");
        __atomic_store_n(&sh->daemon_restarts, 1, __ATOMIC_RELEASE);
}

static int daemon_fds(const struct harness *h) {
        char path[64];
        int n = 0;

        snprintf(path, sizeof(path), "/proc/%d/fd", (int)h->daemon_pid);
        DIR *d = opendir(path);
        if (!d)
                return -1;
        while (readdir(d))
                n++;
        closedir(d);
        return n;
}

/* Runs case ci on R ranks, then a fresh job; prints one line per case. */
static int run_case(struct harness *h, int R, int ci, uint64_t seed) {
        struct shared *sh = h->shared;
        const bool daemon_case = ci == DAEMON_SIGTERM || ci == DAEMON_SIGKILL;
        const bool killed = ci <= KILL_IN_LL_COMBINE;
        int fds0 = daemon_fds(h), fds1 = -1, bad = 0;
        size_t gpu0[MOEEP_MAX_RANKS], gpu1[MOEEP_MAX_RANKS];
        double worst = 0;

        if (harness_gpu_free(gpu0, R) < 0)
                memset(gpu0, 0, sizeof(gpu0));

        for (int pass = 0; pass < 2; pass++) {
                int c = pass ? HEALTHY : ci;
                memset(sh, 0, sizeof(*sh));
                sh->ci = c;
                sh->seed = seed + (uint64_t)ci * 1000 + (uint64_t)pass;
                snprintf(sh->socket, sizeof(sh->socket), "%s", h->socket);
                snprintf(sh->socket_b, sizeof(sh->socket_b), "%s", h->nodes == 2 ? h->socket_b : "");
                for (int r = 0; r < R; r++)
                        sh->rc[r] = -1;
                int lost = harness_run_watched(h, R, "ep_fail_test", rank_case, NULL, 60, watch);
                for (int r = 0; r < R; r++) {
                        if (c != HEALTHY && killed && r == R - 1)
                                continue; /* the victim */
                        if (sh->rc[r] != 0) {
                                bad = 1;
                                printf("  rank %d (%s): %s\n", r, case_names[c],
                                       sh->rc[r] < 0 ? "did not run" : sh->msg[r]);
                        }
                        if (c != HEALTHY && sh->delay_ms[r] > worst)
                                worst = sh->delay_ms[r];
                }
                if (lost != (c != HEALTHY && killed ? 1 : 0)) {
                        bad = 1;
                        printf("  %s: %d rank processes failed\n", case_names[c], lost);
                }
        }
        /* The daemon lets go of everything the jobs held (bounded wait for
         * it to see the last disconnects). Not comparable across a restart. */
        /* The two-node warm-up (ci HEALTHY) is what opens the daemons'
         * transport connections: its count is the baseline, not checked. */
        /* Fewer than before is no leak: the baseline may count a descriptor
         * the daemon's closer threads were still closing (a session of the
         * case before). */
        /* With the proxy regions in GPU memory, the daemons' descriptors of
         * them and the memory go after their linger (settle_ms()). */
        const bool check_fds = !daemon_case && ci != HEALTHY;
        bool back = false;
        for (int i = 0; i < settle_ms() / 10; i++) {
                if (check_fds)
                        fds1 = daemon_fds(h);
                back = gpus_back(gpu0, gpu1, R);
                if ((!check_fds || fds1 <= fds0) && back)
                        break;
                sleep_ms(10);
        }
        if (check_fds && fds1 > fds0) {
                bad = 1;
                printf("  moeepd holds %d descriptors, %d before the case\n", fds1, fds0);
        }
        /* Every GPU has its memory back once the job's processes are gone. */
        if (!back)
                for (int g = 0; g < R; g++)
                        if (gpu1[g] + MEM_SLACK < gpu0[g]) {
                                bad = 1;
                                printf("  GPU %d: %zu MiB free after the case, %zu before\n", g,
                                       gpu1[g] >> 20, gpu0[g] >> 20);
                        }
        printf("%s ranks=%d %s: %s %.1f ms\n", bad ? "FAIL" : "ok  ", R, case_names[ci],
               ci == HUNG_RANK ? "error past the timeout after"
               : daemon_case   ? "next call failed in"
                               : "error after",
               worst);
        fflush(stdout);
        return bad;
}

int main(int argc, char **argv) {
        struct suite_args a;
        struct harness h;
        int passed = 0, failed = 0, R, rc;

        /* Every kernel loaded up front, so GPU memory is comparable before
         * and after an endpoint. */
        setenv("CUDA_MODULE_LOADING", "EAGER", 1);
        rc = suite_start("ep_fail_test", "2,4", false, argc, argv, sizeof(struct shared), &h, &a);
        if (rc != 0)
                return rc;
        for (const char *q = a.ranks; suite_next_ranks(&q, &R);) {
                /* Ranks beyond the GPUs share them (harness_run). */
                if (R < 2 || R > MOEEP_MAX_RANKS) {
                        printf("SKIP ranks=%d: the failure cases need 2..%d ranks\n", R, MOEEP_MAX_RANKS);
                        continue;
                }
                /* Two nodes: a healthy job first, so that the transport
                 * connections between the daemons (libfabric opens them at
                 * the first transfer, then keeps them) are in the count of
                 * descriptors every case is compared with. */
                if (h.nodes == 2)
                        run_case(&h, R, HEALTHY, a.seed) ? failed++ : passed++;
                for (int ci = 0; ci < NCASES; ci++)
                        run_case(&h, R, ci, a.seed) ? failed++ : passed++;
        }
        harness_fini(&h);
        printf("%d passed, %d failed\n", passed, failed);
        return failed ? 1 : 0;
}
