/* moeep-bench: normal-mode dispatch/combine figures in DeepEP's convention,
 * with the NVLink floor and an NCCL all-to-all reference measured in the
 * same run on the same GPUs, and beside each moeep figure its memory floor:
 * the bytes the call must read and write in one GPU's memory over that
 * GPU's device-to-device copy speed, plus its kernel launches, both
 * measured at the start of the run (struct device_speed).
 *
 * One process per GPU, each attached through a private moeepd (or the one
 * at --socket). Times are taken with CUDA events around each call, per
 * rank: after a daemon barrier, the call is queued behind a 500 us busy
 * kernel (so the host's launch latency is not counted) and a barrier
 * kernel across the GPUs (so every rank's call starts at the same time,
 * not skewed by when each process left the daemon barrier; --host-start
 * leaves it out). The table shows min/median/max over ranks of each
 * rank's median over --iters runs.
 *
 *   dispatch GB/s = bytes of recv_x on a rank (own tokens included) / time
 *   combine  GB/s = bytes of the rows a rank sends back / time
 *   FP8 counts the FP8 bytes plus the float scales. */
#include <dlfcn.h>
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>

#include <cuda_runtime_api.h>
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wstrict-prototypes"
#include <nccl.h> /* types only: libnccl is dlopen()ed */
#pragma GCC diagnostic pop

#include "ep-internal.h"
#include "harness.h"
#include "bench_kernels.h"
#include "moeep_ep.h"

#define MAX_RESULTS 64
#define MAX_ITERS 1000
/* Each timed call is queued behind a kernel that keeps the GPU busy this
 * long, so that events measure GPU time, not host launch latency. */
#define QUEUE_DELAY_NS 500000

enum op {
        OP_DISPATCH_BF16,
        OP_DISPATCH_FP8,
        OP_DISPATCH_CACHED,
        OP_COMBINE,
        OP_NVL_FLOOR,
        OP_NVL_FLOOR_ALL,
        OP_NCCL_DISPATCH,
        OP_NCCL_DATA,
        OP_NCCL_COMBINE,
        OP_LL_DISPATCH,
        OP_LL_COMBINE,
        OP_LL_BOTH,
        OP_LL_DISPATCH_SEND,
        OP_LL_DISPATCH_RECV,
        OP_LL_COMBINE_SEND,
        OP_LL_COMBINE_RECV,
};

static const char *op_to_string(enum op o) {
        switch (o) {
        case OP_DISPATCH_BF16:
                return "dispatch bf16";
        case OP_DISPATCH_FP8:
                return "dispatch fp8";
        case OP_DISPATCH_CACHED:
                return "dispatch bf16 cached";
        case OP_COMBINE:
                return "combine bf16";
        case OP_NVL_FLOOR:
                return "nvlink floor (same SMs)";
        case OP_NVL_FLOOR_ALL:
                return "nvlink floor (all SMs)";
        case OP_NCCL_DISPATCH:
                return "nccl dispatch (counts+pack+a2a)";
        case OP_NCCL_DATA:
                return "nccl a2a data only";
        case OP_NCCL_COMBINE:
                return "nccl combine (a2a+sum)";
        case OP_LL_DISPATCH:
                return "ll dispatch fp8";
        case OP_LL_COMBINE:
                return "ll combine bf16";
        case OP_LL_BOTH:
                return "ll dispatch + combine";
        case OP_LL_DISPATCH_SEND:
                return "ll dispatch send (hook)";
        case OP_LL_DISPATCH_RECV:
                return "ll dispatch recv (hook)";
        case OP_LL_COMBINE_SEND:
                return "ll combine send (hook)";
        case OP_LL_COMBINE_RECV:
                return "ll combine recv (hook)";
        }
        return "?";
}

struct result {
        enum op op;
        int tokens, sms;
        double us[MOEEP_MAX_RANKS];    /* per-rank median */
        double bytes[MOEEP_MAX_RANKS]; /* per-rank bytes of the convention */
        /* The operation's memory floor on each rank: the bytes it must read
         * and write in that GPU's memory (each input read once, each output
         * written once), and the kernel launches it cannot do without.
         * moved 0: no floor is defined (phases, references). */
        double moved[MOEEP_MAX_RANKS];
        int launches;
};

/* What one GPU can do, measured by each rank in the same run: a large
 * device-to-device copy (bytes read + bytes written over its time) and
 * the event-timed cost of one empty kernel. */
struct device_speed {
        double copy_gbps, launch_us;
};

struct shared {
        ncclUniqueId nccl_id;
        int nccl_ready;
        int nres;
        size_t buffer_bytes; /* NVLink buffer of one rank */
        struct device_speed speed[MOEEP_MAX_RANKS];
        struct result res[MAX_RESULTS];
};

struct opts {
        int ranks, tokens, hidden, topk, experts, sms, iters, warmup;
        bool sweep, json, nccl, ll, host_start;
        uint64_t seed;
        int nodes; /* daemons the ranks are spread over ($MOEEP_HARNESS_NODES) */
};

/* ---------------------------------------------------------------- NCCL, loaded at run time */

struct nccl_api {
        ncclResult_t (*get_unique_id)(ncclUniqueId *);
        ncclResult_t (*comm_init_rank)(ncclComm_t *, int, ncclUniqueId, int);
        ncclResult_t (*comm_destroy)(ncclComm_t);
        ncclResult_t (*group_start)(void);
        ncclResult_t (*group_end)(void);
        ncclResult_t (*send)(const void *, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t);
        ncclResult_t (*recv)(void *, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t);
};

static int nccl_load(struct nccl_api *n) {
        void *lib = dlopen("libnccl.so.2", RTLD_NOW | RTLD_LOCAL);
        if (!lib)
                return -ENOENT;
        *(void **)&n->get_unique_id = dlsym(lib, "ncclGetUniqueId");
        *(void **)&n->comm_init_rank = dlsym(lib, "ncclCommInitRank");
        *(void **)&n->comm_destroy = dlsym(lib, "ncclCommDestroy");
        *(void **)&n->group_start = dlsym(lib, "ncclGroupStart");
        *(void **)&n->group_end = dlsym(lib, "ncclGroupEnd");
        *(void **)&n->send = dlsym(lib, "ncclSend");
        *(void **)&n->recv = dlsym(lib, "ncclRecv");
        return n->get_unique_id && n->comm_init_rank && n->comm_destroy && n->group_start && n->group_end &&
                               n->send && n->recv
                       ? 0
                       : -ENOSYS;
}

/* ---------------------------------------------------------------- per-rank work */

struct rank_env {
        const struct opts *o;
        struct shared *sh;
        struct moeep_client *c;
        struct moeep_ep *ep;
        int rank, ranks;
        cudaStream_t st;
        cudaEvent_t e0, e1;
        double samples[MAX_ITERS];
};

static uint64_t mix(uint64_t *s) {
        uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
        return z ^ (z >> 31);
}

/* Routing as DeepEP's tests: top-k of |randn| + 1 scores, about 1% of the
 * entries masked to -1. */
static void make_routing(int64_t *idx, int T, int K, int E, uint64_t seed) {
        float *score = malloc(sizeof(float) * (size_t)E);
        for (int t = 0; t < T; t++) {
                for (int e = 0; e < E; e++) {
                        double u1 = ((mix(&seed) >> 11) + 1.0) / 9007199254740993.0,
                               u2 = (mix(&seed) >> 11) / 9007199254740992.0;
                        score[e] = (float)(fabs(sqrt(-2 * log(u1)) * cos(2 * M_PI * u2)) + 1.0);
                }
                for (int k = 0; k < K; k++) {
                        int best = 0;
                        for (int e = 1; e < E; e++)
                                if (score[e] > score[best])
                                        best = e;
                        idx[(size_t)t * K + k] = best;
                        score[best] = -1;
                }
                for (int k = 0; k < K; k++)
                        if (mix(&seed) % 100 == 0)
                                idx[(size_t)t * K + k] = -1;
        }
        free(score);
}

static int cmp_double(const void *a, const void *b) {
        double x = *(const double *)a, y = *(const double *)b;
        return x < y ? -1 : x > y;
}

static double median(double *v, int n) {
        qsort(v, (size_t)n, sizeof(double), cmp_double);
        return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

typedef int (*op_fn)(struct rank_env *env, void *arg);

/* Lines every rank's next call up: a daemon barrier, the busy kernel, and
 * unless --host-start a barrier kernel across the GPUs, so that the GPUs
 * leave it within an NVLink flag's latency of each other. */
static void start_together(struct rank_env *env) {
        struct moeep_ctx ctx;

        moeep_job_barrier(env->c);
        moeep_launch_delay(QUEUE_DELAY_NS, env->st);
        if (!env->o->host_start && ep_internal_ctx(env->ep, &ctx) == 0)
                moeep_launch_notify(&ctx, NULL, NULL, 0, 0, 0, NULL, 0, 0, NULL, NULL, env->st);
}

/* Times fn: warm-ups, then iters runs, each started on every rank together
 * (start_together); returns the median in microseconds. */
static double time_op(struct rank_env *env, op_fn fn, void *arg, int *ret_err) {
        int n = env->o->iters;
        for (int i = 0; i < env->o->warmup + n; i++) {
                float ms = 0;
                start_together(env);
                cudaEventRecord(env->e0, env->st);
                if (fn(env, arg) < 0) {
                        *ret_err = -1;
                        return 0;
                }
                cudaEventRecord(env->e1, env->st);
                if (cudaEventSynchronize(env->e1) != cudaSuccess) {
                        *ret_err = -1;
                        return 0;
                }
                cudaEventElapsedTime(&ms, env->e0, env->e1);
                if (i >= env->o->warmup)
                        env->samples[i - env->o->warmup] = ms * 1000.0;
        }
        return median(env->samples, n);
}

static void record(struct rank_env *env, int slot, enum op op, int tokens, int sms, double us, double bytes) {
        struct result *r = &env->sh->res[slot];
        if (env->rank == 0) {
                r->op = op;
                r->tokens = tokens;
                r->sms = sms;
                r->launches = 0;
        }
        r->us[env->rank] = us;
        r->bytes[env->rank] = bytes;
        r->moved[env->rank] = 0;
}

/* Gives the result in slot its memory floor: moved bytes and launches. */
static void record_floor(struct rank_env *env, int slot, double moved, int launches) {
        env->sh->res[slot].moved[env->rank] = moved;
        if (env->rank == 0)
                env->sh->res[slot].launches = launches;
}

/* Arguments of one configuration of the moeep operations. */
struct moe_case {
        struct moeep_dispatch_args da;
        struct moeep_dispatch_result dr;
        struct moeep_combine_args ca;
};

static int op_dispatch(struct rank_env *env, void *arg) {
        struct moe_case *m = arg;
        struct moeep_dispatch_result r;
        int rc = moeep_dispatch(env->ep, &m->da, &r, env->st);
        if (rc < 0) {
                fprintf(stderr, "rank %d: dispatch: %s\n", env->rank, moeep_ep_error(env->ep));
                return rc;
        }
        if (m->da.handle == NULL) {
                moeep_ep_handle_free(m->dr.handle);
                m->dr = r;
        }
        return 0;
}

/* With $MOEEP_KERNEL_TRACE, rank 0 prints when each block of its last
 * combine ended its roles (us after the first block started). */
static void print_trace(struct rank_env *env, int T, int sms) {
        struct moeep_ctx ctx;
        uint64_t t[4 * 64], t0 = UINT64_MAX;

        if (env->rank != 0 || ep_internal_ctx(env->ep, &ctx) < 0 || !ctx.trace || sms > 64)
                return;
        cudaDeviceSynchronize();
        cudaMemcpy(t, ctx.trace, sizeof(uint64_t) * 4 * (size_t)sms, cudaMemcpyDeviceToHost);
        for (int b = 0; b < sms; b++)
                if (t[4 * b] && t[4 * b] < t0)
                        t0 = t[4 * b];
        fprintf(stderr, "trace tokens %d: block start/send/produce/consume us:", T);
        for (int b = 0; b < sms; b++) {
                fprintf(stderr, " [%d %.0f", b, (t[4 * b] - t0) / 1e3);
                for (int k = 1; k < 4; k++)
                        if (t[4 * b + k] > t0)
                                fprintf(stderr, " %.0f", (t[4 * b + k] - t0) / 1e3);
                fprintf(stderr, "]");
        }
        fprintf(stderr, "\n");
        cudaMemset(ctx.trace, 0, sizeof(uint64_t) * 4 * (size_t)sms);
}

static int op_combine(struct rank_env *env, void *arg) {
        struct moe_case *m = arg;
        int rc = moeep_combine(env->ep, &m->ca, env->st);
        if (rc < 0)
                fprintf(stderr, "rank %d: combine: %s\n", env->rank, moeep_ep_error(env->ep));
        return rc;
}

struct floor_arg {
        struct moeep_ctx *ctx;
        size_t bytes;
        int blocks;
};

static int op_floor(struct rank_env *env, void *arg) {
        struct floor_arg *f = arg;
        return moeep_launch_p2p_put(f->ctx, f->bytes, f->blocks, env->st) ? -1 : 0;
}

struct copy_arg {
        void *dst, *src;
        size_t bytes;
};

static int op_copy(struct rank_env *env, void *arg) {
        struct copy_arg *c = arg;
        return cudaMemcpyAsync(c->dst, c->src, c->bytes, cudaMemcpyDeviceToDevice, env->st) == cudaSuccess
                       ? 0
                       : -1;
}

static int op_launch(struct rank_env *env, void *arg) {
        (void)arg;
        return moeep_launch_delay(0, env->st) ? -1 : 0;
}

struct nccl_case {
        struct nccl_api *api;
        ncclComm_t comm;
        const uint8_t *in_rank;
        const void *x;
        int T, hidden, ranks;
        int32_t *pos, *counts_dev, *recv_counts_dev, *offsets_dev;
        int counts[MOEEP_MAX_RANKS], recv_counts[MOEEP_MAX_RANKS];
        void *sendbuf, *recvbuf, *backbuf, *out;
        int sms;
};

static void nccl_a2a(struct nccl_case *n, const void *send, const int *scount, void *recv, const int *rcount,
                     size_t row, cudaStream_t st) {
        size_t so = 0, ro = 0;
        n->api->group_start();
        for (int d = 0; d < n->ranks; d++) {
                n->api->send((const char *)send + so * row, (size_t)scount[d] * row, ncclUint8, d, n->comm,
                             st);
                n->api->recv((char *)recv + ro * row, (size_t)rcount[d] * row, ncclUint8, d, n->comm, st);
                so += (size_t)scount[d];
                ro += (size_t)rcount[d];
        }
        n->api->group_end();
}

/* What a user writes: count exchange (device all-to-all, then a host copy),
 * pack by destination, data all-to-all. */
static int op_nccl_dispatch(struct rank_env *env, void *arg) {
        struct nccl_case *n = arg;
        int offs[MOEEP_MAX_RANKS], sum = 0;
        size_t row = (size_t)n->hidden * 2;

        moeep_launch_ref_scan(n->in_rank, n->T, n->ranks, n->pos, n->counts_dev, env->st);
        n->api->group_start();
        for (int d = 0; d < n->ranks; d++) {
                n->api->send(n->counts_dev + d, 1, ncclInt32, d, n->comm, env->st);
                n->api->recv(n->recv_counts_dev + d, 1, ncclInt32, d, n->comm, env->st);
        }
        n->api->group_end();
        cudaMemcpyAsync(n->counts, n->counts_dev, sizeof(int) * n->ranks, cudaMemcpyDeviceToHost, env->st);
        cudaMemcpyAsync(n->recv_counts, n->recv_counts_dev, sizeof(int) * n->ranks, cudaMemcpyDeviceToHost,
                        env->st);
        cudaStreamSynchronize(env->st);
        for (int d = 0; d < n->ranks; d++) {
                offs[d] = sum;
                sum += n->counts[d];
        }
        cudaMemcpyAsync(n->offsets_dev, offs, sizeof(offs), cudaMemcpyHostToDevice, env->st);
        moeep_launch_ref_pack(n->x, row, n->T, n->ranks, n->pos, n->offsets_dev, n->sendbuf, n->sms, env->st);
        nccl_a2a(n, n->sendbuf, n->counts, n->recvbuf, n->recv_counts, row, env->st);
        return 0;
}

static int op_nccl_data(struct rank_env *env, void *arg) {
        struct nccl_case *n = arg;
        nccl_a2a(n, n->sendbuf, n->counts, n->recvbuf, n->recv_counts, (size_t)n->hidden * 2, env->st);
        return 0;
}

static int op_nccl_combine(struct rank_env *env, void *arg) {
        struct nccl_case *n = arg;
        nccl_a2a(n, n->recvbuf, n->recv_counts, n->backbuf, n->counts, (size_t)n->hidden * 2, env->st);
        moeep_launch_ref_unpack(n->backbuf, n->hidden, n->T, n->ranks, n->pos, n->offsets_dev, n->out, n->sms,
                                env->st);
        return 0;
}

#define CUDA_OK(call)                                                                                   \
        do {                                                                                            \
                cudaError_t e_ = (call);                                                                \
                if (e_ != cudaSuccess) {                                                                \
                        fprintf(stderr, "rank %d: %s: %s\n", env->rank, #call, cudaGetErrorString(e_)); \
                        return -1;                                                                      \
                }                                                                                       \
        } while (0)

/* Inputs of one token count, on the device. */
struct inputs {
        void *x, *xq;
        float *sc;
        int64_t *idx;
        float *w;
        uint8_t *in_rank;
        int *per_rank, *per_expert;
        void *y, *out;
};

static int inputs_make(struct rank_env *env, struct inputs *in, int T) {
        const struct opts *o = env->o;
        size_t nx = (size_t)T * o->hidden;
        uint16_t *hx = malloc(nx * 2 + 2);
        int64_t *hidx = malloc(sizeof(int64_t) * (size_t)T * o->topk + 8);
        float *hw = malloc(sizeof(float) * (size_t)T * o->topk + 4);
        uint64_t s = o->seed ^ ((uint64_t)env->rank << 32) ^ (uint64_t)T;

        for (size_t i = 0; i < nx; i++)
                hx[i] = (uint16_t)(0x3c00 + (mix(&s) & 0x3ff) -
                                   (mix(&s) & 0x8000)); /* random bf16 in about ±[0.0078, 0.016) */
        for (size_t i = 0; i < (size_t)T * o->topk; i++)
                hw[i] = (float)((mix(&s) >> 40) / 16777216.0);
        make_routing(hidx, T, o->topk, o->experts, s);
        CUDA_OK(cudaMalloc(&in->x, nx * 2 + 16));
        CUDA_OK(cudaMalloc(&in->xq, nx + 16));
        CUDA_OK(cudaMalloc((void **)&in->sc, sizeof(float) * (size_t)T * (o->hidden / 128) + 16));
        CUDA_OK(cudaMalloc((void **)&in->idx, sizeof(int64_t) * (size_t)T * o->topk + 16));
        CUDA_OK(cudaMalloc((void **)&in->w, sizeof(float) * (size_t)T * o->topk + 16));
        CUDA_OK(cudaMalloc((void **)&in->in_rank, (size_t)T * env->ranks + 16));
        CUDA_OK(cudaMalloc((void **)&in->per_rank, sizeof(int) * MOEEP_MAX_RANKS));
        CUDA_OK(cudaMalloc((void **)&in->per_expert, sizeof(int) * (size_t)o->experts));
        CUDA_OK(cudaMalloc(&in->y, (size_t)env->ranks * T * o->hidden * 2 + 16));
        CUDA_OK(cudaMalloc(&in->out, nx * 2 + 16));
        CUDA_OK(cudaMemcpy(in->x, hx, nx * 2, cudaMemcpyHostToDevice));
        CUDA_OK(cudaMemcpy(in->xq, hx, nx, cudaMemcpyHostToDevice)); /* any bytes: fp8 payload */
        CUDA_OK(cudaMemset(in->sc, 0, sizeof(float) * (size_t)T * (o->hidden / 128)));
        CUDA_OK(cudaMemcpy(in->idx, hidx, sizeof(int64_t) * (size_t)T * o->topk, cudaMemcpyHostToDevice));
        CUDA_OK(cudaMemcpy(in->w, hw, sizeof(float) * (size_t)T * o->topk, cudaMemcpyHostToDevice));
        CUDA_OK(cudaMemset(in->y, 0x3c, (size_t)env->ranks * T * o->hidden * 2));
        free(hx);
        free(hidx);
        free(hw);
        if (moeep_get_dispatch_layout(env->ep, in->idx, MOEEP_INDEX_INT64, T, o->topk, in->per_rank,
                                      in->per_expert, in->in_rank, env->st) < 0)
                return -1;
        CUDA_OK(cudaStreamSynchronize(env->st));
        return 0;
}

static void inputs_free(struct inputs *in) {
        void *p[] = { in->x,       in->xq,       in->sc,         in->idx, in->w,
                      in->in_rank, in->per_rank, in->per_expert, in->y,   in->out };
        for (size_t i = 0; i < sizeof(p) / sizeof(p[0]); i++)
                cudaFree(p[i]);
        memset(in, 0, sizeof(*in));
}

/* Measures this rank's device_speed, timed like the operations. The copy
 * moves 256 MiB each way, far past the L2, so it runs at memory speed. */
static int measure_speed(struct rank_env *env) {
        struct copy_arg c = { .bytes = (size_t)256 << 20 };
        struct device_speed *d = &env->sh->speed[env->rank];
        int err = 0;
        double us;

        CUDA_OK(cudaMalloc(&c.dst, c.bytes));
        CUDA_OK(cudaMalloc(&c.src, c.bytes));
        CUDA_OK(cudaMemset(c.src, 0x5a, c.bytes));
        us = time_op(env, op_copy, &c, &err);
        d->copy_gbps = us > 0 ? 2.0 * (double)c.bytes / (us * 1e3) : 0;
        d->launch_us = time_op(env, op_launch, NULL, &err);
        cudaFree(c.dst);
        cudaFree(c.src);
        return err ? -1 : 0;
}

/* The moeep figures of one (tokens, SMs) point. */
static int bench_moeep(struct rank_env *env, int *slot, int T, int sms, bool full) {
        const struct opts *o = env->o;
        struct inputs in = { 0 };
        struct moe_case m = { 0 };
        int err = 0, nrecv;
        double us, fp8_row = o->hidden + (o->hidden / 128) * 4.0;

        if (moeep_ep_set_num_sms(env->ep, sms) < 0 || inputs_make(env, &in, T) < 0)
                return -1;
        m.da = (struct moeep_dispatch_args){
                .x = in.x,
                .x_type = MOEEP_DTYPE_BF16,
                .num_tokens = T,
                .is_token_in_rank = in.in_rank,
                .topk_idx = in.idx,
                .topk_idx_type = MOEEP_INDEX_INT64,
                .topk_weights = in.w,
                .num_topk = o->topk,
        };
        us = time_op(env, op_dispatch, &m, &err);
        nrecv = m.dr.num_recv_tokens;
        record(env, *slot, OP_DISPATCH_BF16, T, sms, us, (double)nrecv * o->hidden * 2);
        record_floor(env, (*slot)++, (double)(T + nrecv) * o->hidden * 2, 1);

        m.ca = (struct moeep_combine_args){ .x = in.y, .handle = m.dr.handle, .out = in.out };
        us = time_op(env, op_combine, &m, &err);
        record(env, *slot, OP_COMBINE, T, sms, us, (double)nrecv * o->hidden * 2);
        record_floor(env, (*slot)++, (double)(T + nrecv) * o->hidden * 2, 1);
        print_trace(env, T, sms);
        if (full) {
                struct moeep_ep_handle *h = m.dr.handle;
                m.da.handle = h;
                us = time_op(env, op_dispatch, &m, &err);
                record(env, *slot, OP_DISPATCH_CACHED, T, sms, us, (double)nrecv * o->hidden * 2);
                record_floor(env, (*slot)++, (double)(T + nrecv) * o->hidden * 2, 1);
                m.da.handle = NULL;
                m.da.x = in.xq;
                m.da.x_type = MOEEP_DTYPE_FP8_E4M3;
                m.da.x_scales = in.sc;
                us = time_op(env, op_dispatch, &m, &err);
                record(env, *slot, OP_DISPATCH_FP8, T, sms, us, (double)m.dr.num_recv_tokens * fp8_row);
                record_floor(env, (*slot)++, (double)(T + m.dr.num_recv_tokens) * fp8_row, 1);
        }
        moeep_ep_handle_free(m.dr.handle);
        inputs_free(&in);
        return err;
}

static int bench_nccl(struct rank_env *env, int *slot, int T) {
        const struct opts *o = env->o;
        struct nccl_api api;
        struct nccl_case n = { .api = &api, .T = T, .hidden = o->hidden, .ranks = env->ranks, .sms = o->sms };
        struct inputs in = { 0 };
        int err = 0, nrecv = 0;
        double us;
        size_t rowsz = (size_t)o->hidden * 2, cap = (size_t)T * env->ranks;

        if (nccl_load(&api) < 0) {
                if (env->rank == 0)
                        fprintf(stderr, "moeep-bench: libnccl.so.2 not found; no NCCL reference\n");
                return 0;
        }
        if (env->rank == 0) {
                api.get_unique_id(&env->sh->nccl_id);
                __atomic_store_n(&env->sh->nccl_ready, 1, __ATOMIC_RELEASE);
        }
        moeep_job_barrier(env->c);
        if (api.comm_init_rank(&n.comm, env->ranks, env->sh->nccl_id, env->rank) != ncclSuccess) {
                fprintf(stderr, "rank %d: ncclCommInitRank failed\n", env->rank);
                return -1;
        }
        if (inputs_make(env, &in, T) < 0)
                return -1;
        n.in_rank = in.in_rank;
        n.x = in.x;
        CUDA_OK(cudaMalloc((void **)&n.pos, sizeof(int32_t) * (size_t)T * env->ranks + 16));
        CUDA_OK(cudaMalloc((void **)&n.counts_dev, 64));
        CUDA_OK(cudaMalloc((void **)&n.recv_counts_dev, 64));
        CUDA_OK(cudaMalloc((void **)&n.offsets_dev, 64));
        CUDA_OK(cudaMalloc(&n.sendbuf, cap * rowsz + 16));
        CUDA_OK(cudaMalloc(&n.recvbuf, cap * rowsz + 16));
        CUDA_OK(cudaMalloc(&n.backbuf, cap * rowsz + 16));
        n.out = in.out;

        us = time_op(env, op_nccl_dispatch, &n, &err);
        for (int d = 0; d < env->ranks; d++)
                nrecv += n.recv_counts[d];
        record(env, (*slot)++, OP_NCCL_DISPATCH, T, 0, us, (double)nrecv * rowsz);
        us = time_op(env, op_nccl_data, &n, &err);
        record(env, (*slot)++, OP_NCCL_DATA, T, 0, us, (double)nrecv * rowsz);
        us = time_op(env, op_nccl_combine, &n, &err);
        record(env, (*slot)++, OP_NCCL_COMBINE, T, 0, us, (double)nrecv * rowsz);

        cudaStreamSynchronize(env->st);
        api.comm_destroy(n.comm);
        cudaFree(n.pos);
        cudaFree(n.counts_dev);
        cudaFree(n.recv_counts_dev);
        cudaFree(n.offsets_dev);
        cudaFree(n.sendbuf);
        cudaFree(n.recvbuf);
        cudaFree(n.backbuf);
        inputs_free(&in);
        return err;
}

/* NVLink floor: every rank writes the same bytes a dispatch of T tokens
 * sends to each peer, with the dispatch's SM budget and with every SM;
 * reported in the dispatch convention (bytes a rank receives in total,
 * own share included, per second). */
static int bench_floor(struct rank_env *env, int *slot, int T) {
        const struct opts *o = env->o;
        struct moeep_ctx ctx;
        struct floor_arg f;
        int err = 0, nsm = 0, dev = 0;
        size_t bytes = (size_t)T * o->hidden * 2 * 9 / 10; /* about what each peer gets with top-8 of 256 */
        double us, total;

        if (env->ranks < 2 || ep_internal_ctx(env->ep, &ctx) < 0 ||
            ctx.px.remote) /* NVLink to every rank only */
                return 0;
        bytes = bytes / 16 * 16;
        total = (double)bytes * env->ranks; /* one share from each rank, own included */
        cudaGetDevice(&dev);
        cudaDeviceGetAttribute(&nsm, cudaDevAttrMultiProcessorCount, dev);
        f = (struct floor_arg){ .ctx = &ctx, .bytes = bytes, .blocks = o->sms };
        us = time_op(env, op_floor, &f, &err);
        record(env, (*slot)++, OP_NVL_FLOOR, T, o->sms, us, total);
        f.blocks = nsm;
        us = time_op(env, op_floor, &f, &err);
        record(env, (*slot)++, OP_NVL_FLOOR_ALL, T, nsm, us, total);
        return err;
}

/* Low-latency figures at T tokens: dispatch (FP8) and combine (BF16) timed
 * apart and together, and the four phases of the hook mode. Each
 * iteration is dispatch + combine, as in a decode step. */
static int bench_ll(struct rank_env *env, int *slot, int T) {
        const struct opts *o = env->o;
        const int L = o->experts / env->ranks, S = env->ranks * (o->sweep ? 256 : o->tokens), H = o->hidden;
        double t_phase[7][MAX_ITERS];
        struct inputs in = { 0 };
        cudaEvent_t ev[5];
        int pairs_in = 0, *counts = calloc((size_t)L, sizeof(int)), err = 0;
        void *y = NULL;

        if (inputs_make(env, &in, T) < 0)
                return -1;
        CUDA_OK(cudaMalloc(&y, (size_t)L * S * H * 2));
        CUDA_OK(cudaMemset(y, 0x3c, (size_t)L * S * H * 2));
        for (int i = 0; i < 5; i++)
                CUDA_OK(cudaEventCreate(&ev[i]));
        struct moeep_ll_dispatch_args da = {
                .x = in.x,
                .num_tokens = T,
                .topk_idx = in.idx,
                .topk_idx_type = MOEEP_INDEX_INT64,
                .num_topk = o->topk,
                .use_fp8 = true,
        };
        struct moeep_ll_combine_args ca = {
                .x = y,
                .topk_idx = in.idx,
                .topk_idx_type = MOEEP_INDEX_INT64,
                .topk_weights = in.w,
                .num_topk = o->topk,
                .out = in.out,
        };
        struct moeep_ll_dispatch_result res;
        struct moeep_ll_hook hook;

        for (int mode = 0; mode < 2 && !err; mode++) {
                da.return_recv_hook = ca.return_recv_hook = mode == 1;
                for (int i = 0; i < o->warmup + o->iters && !err; i++) {
                        float ms[4] = { 0 };
                        start_together(env);
                        cudaEventRecord(ev[0], env->st);
                        err |= moeep_ll_dispatch(env->ep, &da, &res, &hook, env->st) < 0;
                        cudaEventRecord(ev[1], env->st);
                        if (mode == 1)
                                err |= moeep_ll_hook_run(env->ep, &hook, env->st) < 0;
                        cudaEventRecord(ev[2], env->st);
                        ca.handle = &res.handle;
                        err |= moeep_ll_combine(env->ep, &ca, &hook, env->st) < 0;
                        cudaEventRecord(ev[3], env->st);
                        if (mode == 1)
                                err |= moeep_ll_hook_run(env->ep, &hook, env->st) < 0;
                        cudaEventRecord(ev[4], env->st);
                        if (cudaEventSynchronize(ev[4]) != cudaSuccess)
                                err = 1;
                        for (int k = 0; k < 4; k++)
                                cudaEventElapsedTime(&ms[k], ev[k], ev[k + 1]);
                        if (i < o->warmup)
                                continue;
                        int j = i - o->warmup;
                        if (mode == 0) {
                                t_phase[0][j] = ms[0] * 1e3;
                                t_phase[1][j] = (ms[2] + ms[3]) * 1e3;
                                t_phase[2][j] = (ms[0] + ms[1] + ms[2] + ms[3]) * 1e3;
                        } else
                                for (int k = 0; k < 4; k++)
                                        t_phase[3 + k][j] = ms[k] * 1e3;
                }
        }
        if (err) {
                fprintf(stderr, "rank %d: low-latency call failed: %s\n", env->rank, moeep_ep_error(env->ep));
                return -1;
        }
        cudaMemcpy(counts, res.recv_count, sizeof(int) * L, cudaMemcpyDeviceToHost);
        for (int le = 0; le < L; le++)
                pairs_in += counts[le];
        /* Bytes: FP8 rows + scales received; BF16 rows sent back. */
        const double disp_bytes = (double)pairs_in * (H + H / 128 * 4), comb_bytes = (double)pairs_in * H * 2;
        const enum op ops[7] = { OP_LL_DISPATCH,      OP_LL_COMBINE,       OP_LL_BOTH,
                                 OP_LL_DISPATCH_SEND, OP_LL_DISPATCH_RECV, OP_LL_COMBINE_SEND,
                                 OP_LL_COMBINE_RECV };
        const double bytes[7] = { disp_bytes, comb_bytes, disp_bytes + comb_bytes, disp_bytes, disp_bytes,
                                  comb_bytes, comb_bytes };
        struct moeep_ctx ctx = { 0 };
        ep_internal_ctx(env->ep, &ctx); /* the low-latency kernels' SM count */
        /* Floors of the whole calls: dispatch reads the BF16 tokens once and
         * writes the FP8 pairs and scales; combine reads the expert outputs
         * once and writes the BF16 tokens. The hook phases get none. */
        const double x_bytes = (double)T * H * 2, moved[3] = { x_bytes + disp_bytes, comb_bytes + x_bytes,
                                                               2 * x_bytes + disp_bytes + comb_bytes };
        for (int k = 0; k < 7; k++) {
                record(env, *slot, ops[k], T, ctx.ll_num_sms, median(t_phase[k], o->iters), bytes[k]);
                if (k < 3)
                        record_floor(env, *slot, moved[k], k == 2 ? 2 : 1);
                (*slot)++;
        }
        for (int i = 0; i < 5; i++)
                cudaEventDestroy(ev[i]);
        cudaFree(y);
        free(counts);
        inputs_free(&in);
        return 0;
}

static int rank_fn(struct moeep_client *c, int rank, int ranks, void *shared, void *arg) {
        const struct opts *o = arg;
        struct rank_env *env = calloc(1, sizeof(*env));
        int max_tokens = o->sweep ? (o->tokens > 8192 ? o->tokens : 8192) : o->tokens, slot = 0, err = 0;
        struct moeep_ep_config cfg = {
                .max_tokens_per_rank = max_tokens,
                .hidden = o->hidden,
                .num_experts = o->experts,
                .max_topk = o->topk,
                .num_sms = o->sms,
        };
        if (o->ll) {
                /* Low-latency buffers for the largest call; normal buffers
                 * only as big as the NCCL reference's layout needs. */
                cfg.max_tokens_per_rank = cfg.ll_max_tokens = o->sweep ? 256 : o->tokens;
        }

        env->o = o;
        env->sh = shared;
        env->c = c;
        env->rank = rank;
        env->ranks = ranks;
        if (moeep_ep_create(c, &cfg, &env->ep) < 0)
                return 1;
        if (rank == 0)
                env->sh->buffer_bytes = moeep_ep_buffer_bytes(env->ep);
        CUDA_OK(cudaStreamCreateWithFlags(&env->st, cudaStreamNonBlocking));
        CUDA_OK(cudaEventCreate(&env->e0));
        CUDA_OK(cudaEventCreate(&env->e1));
        err |= measure_speed(env);

        if (o->ll) {
                static const int toks[] = { 1, 16, 64, 128, 256 };
                err |= bench_ll(env, &slot, o->tokens);
                if (o->nccl)
                        err |= bench_nccl(env, &slot, o->tokens);
                for (size_t i = 0; o->sweep && i < sizeof(toks) / sizeof(toks[0]); i++)
                        if (toks[i] != o->tokens)
                                err |= bench_ll(env, &slot, toks[i]);
                goto done;
        }
        err |= bench_moeep(env, &slot, o->tokens, o->sms, true);
        err |= bench_floor(env, &slot, o->tokens);
        if (o->nccl)
                err |= bench_nccl(env, &slot, o->tokens);
        if (o->sweep) {
                static const int toks[] = { 512, 1024, 2048, 4096, 8192 };
                static const int sms[] = { 8, 16, 24, 32 };
                for (size_t i = 0; i < sizeof(toks) / sizeof(toks[0]); i++)
                        err |= bench_moeep(env, &slot, toks[i], o->sms, false);
                for (size_t i = 0; i < sizeof(sms) / sizeof(sms[0]); i++)
                        err |= bench_moeep(env, &slot, o->tokens, sms[i], false);
        }
done:
        if (rank == 0)
                env->sh->nres = slot;
        err |= moeep_ep_check(env->ep) < 0;
        if (err)
                fprintf(stderr, "rank %d: %s\n", rank, moeep_ep_error(env->ep));
        moeep_job_barrier(c);
        moeep_ep_destroy(env->ep);
        free(env);
        return err ? 1 : 0;
}

/* ---------------------------------------------------------------- report */

static void stats(const double *v, int n, double *mn, double *md, double *mx) {
        double t[MOEEP_MAX_RANKS];
        memcpy(t, v, sizeof(double) * (size_t)n);
        *md = median(t, n);
        *mn = t[0];
        *mx = t[n - 1];
}

static void report(const struct opts *o, const struct shared *sh, int ranks) {
        if (o->json)
                printf("{\"ranks\": %d, \"hidden\": %d, \"topk\": %d, \"experts\": %d, \"iters\": %d, "
                       "\"seed\": %" PRIu64 ", \"buffer_bytes\": %zu, \"start\": \"%s\", \"copy_gbps\": "
                       "%.1f, \"launch_us\": %.2f, "
                       "\"results\": [\n",
                       ranks, o->hidden, o->topk, o->experts, o->iters, o->seed, sh->buffer_bytes,
                       o->host_start ? "host" : "gpu", sh->speed[0].copy_gbps, sh->speed[0].launch_us);
        else
                printf("moeep-bench: %d ranks, hidden %d, top-%d of %d experts, %d iters (median per rank; "
                       "min/median/max over ranks)\n"
                       "NVLink buffer: %.1f MiB per rank; each call starts after %s\n"
                       "memory floor = bytes the call must read and write in one GPU's memory / device copy "
                       "speed\n"
                       "+ its kernel launches; rank 0: copy %.0f GB/s (read + write), one launch %.1f us\n"
                       "%-34s %6s %4s %26s %26s %9s %7s\n",
                       ranks, o->hidden, o->topk, o->experts, o->iters, sh->buffer_bytes / 1048576.0,
                       o->host_start ? "a daemon barrier (--host-start)" : "a GPU barrier",
                       sh->speed[0].copy_gbps, sh->speed[0].launch_us, "operation", "tokens", "SMs",
                       "time us (min/med/max)", "GB/s (min/med/max)", "floor us", "x floor");
        if (!o->json && o->nodes == 2)
                printf("ranks 0..%d at daemon A, %d..%d at daemon B (two simulated nodes): NVLink inside a "
                       "node, the "
                       "proxy path (libfabric tcp over 127.0.0.1) between them\n",
                       ranks - ranks / 2 - 1, ranks - ranks / 2, ranks - 1);
        for (int i = 0; i < sh->nres; i++) {
                const struct result *r = &sh->res[i];
                double gb[MOEEP_MAX_RANKS], fl[MOEEP_MAX_RANKS], xf[MOEEP_MAX_RANKS], tmn, tmd, tmx, gmn, gmd,
                        gmx, fmd = 0, xmd = 0, dummy;
                bool has_floor = true;
                for (int k = 0; k < ranks; k++) {
                        const struct device_speed *d = &sh->speed[k];
                        gb[k] = r->us[k] > 0 ? r->bytes[k] / (r->us[k] * 1e3) : 0;
                        has_floor &= r->moved[k] > 0 && d->copy_gbps > 0;
                        fl[k] = has_floor ? r->moved[k] / (d->copy_gbps * 1e3) + r->launches * d->launch_us
                                          : 0;
                        xf[k] = has_floor ? r->us[k] / fl[k] : 0;
                }
                stats(r->us, ranks, &tmn, &tmd, &tmx);
                stats(gb, ranks, &gmn, &gmd, &gmx);
                if (has_floor) {
                        stats(fl, ranks, &dummy, &fmd, &dummy);
                        stats(xf, ranks, &dummy, &xmd, &dummy);
                }
                if (o->json)
                        printf("  {\"op\": \"%s\", \"tokens\": %d, \"sms\": %d, \"us\": [%.1f, %.1f, %.1f], "
                               "\"gbps\": [%.1f, %.1f, %.1f], "
                               "\"floor_us\": %.2f, \"x_floor\": %.2f}%s\n",
                               op_to_string(r->op), r->tokens, r->sms, tmn, tmd, tmx, gmn, gmd, gmx, fmd, xmd,
                               i + 1 < sh->nres ? "," : "");
                else if (has_floor)
                        printf("%-34s %6d %4d %8.1f /%8.1f /%8.1f %8.1f /%8.1f /%8.1f %9.1f %7.2f\n",
                               op_to_string(r->op), r->tokens, r->sms, tmn, tmd, tmx, gmn, gmd, gmx, fmd,
                               xmd);
                else
                        printf("%-34s %6d %4d %8.1f /%8.1f /%8.1f %8.1f /%8.1f /%8.1f %9s %7s\n",
                               op_to_string(r->op), r->tokens, r->sms, tmn, tmd, tmx, gmn, gmd, gmx, "-",
                               "-");
        }
        if (o->json)
                printf("]}\n");
}

static void usage(FILE *f) {
        fprintf(f, "usage: moeep-bench [ll] [--ranks N] [--tokens N] [--hidden N] [--topk N] [--experts N] "
                   "[--sms N]\n"
                   "                   [--iters N] [--warmup N] [--sweep] [--no-nccl] [--json] [--seed N] "
                   "[--host-start]\n"
                   "                   [--moeepd PATH | --socket PATH]\n");
}

int main(int argc, char **argv) {
        struct opts o = { .tokens = 4096,
                          .hidden = 7168,
                          .topk = 8,
                          .experts = 256,
                          .sms = MOEEP_DEFAULT_NUM_SMS,
                          .iters = 30,
                          .warmup = 5,
                          .nccl = true };
        const char *moeepd = NULL, *socket = NULL;
        struct harness h;
        int opt, ngpu, failed;
        bool tokens_set = false, experts_set = false;
        static const struct option lo[] = {
                { "ranks", required_argument, NULL, 'r' },
                { "tokens", required_argument, NULL, 't' },
                { "hidden", required_argument, NULL, 'H' },
                { "topk", required_argument, NULL, 'k' },
                { "experts", required_argument, NULL, 'e' },
                { "sms", required_argument, NULL, 'm' },
                { "iters", required_argument, NULL, 'i' },
                { "warmup", required_argument, NULL, 'w' },
                { "sweep", no_argument, NULL, 'S' },
                { "no-nccl", no_argument, NULL, 'N' },
                { "json", no_argument, NULL, 'j' },
                { "seed", required_argument, NULL, 's' },
                { "moeepd", required_argument, NULL, 'd' },
                { "socket", required_argument, NULL, 'x' },
                { "host-start", no_argument, NULL, 'B' },
                { "help", no_argument, NULL, 'h' },
                { NULL, 0, NULL, 0 },
        };

        while ((opt = getopt_long(argc, argv, "", lo, NULL)) != -1) {
                switch (opt) {
                case 'r':
                        o.ranks = atoi(optarg);
                        break;
                case 't':
                        o.tokens = atoi(optarg);
                        tokens_set = true;
                        break;
                case 'H':
                        o.hidden = atoi(optarg);
                        break;
                case 'k':
                        o.topk = atoi(optarg);
                        break;
                case 'e':
                        o.experts = atoi(optarg);
                        experts_set = true;
                        break;
                case 'm':
                        o.sms = atoi(optarg);
                        break;
                case 'i':
                        o.iters = atoi(optarg);
                        break;
                case 'w':
                        o.warmup = atoi(optarg);
                        break;
                case 'S':
                        o.sweep = true;
                        break;
                case 'N':
                        o.nccl = false;
                        break;
                case 'B':
                        o.host_start = true;
                        break;
                case 'j':
                        o.json = true;
                        break;
                case 's':
                        o.seed = strtoull(optarg, NULL, 0);
                        break;
                case 'd':
                        moeepd = optarg;
                        break;
                case 'x':
                        socket = optarg;
                        break;
                case 'h':
                        usage(stdout);
                        return 0;
                default:
                        usage(stderr);
                        return 2;
                }
        }
        if (optind < argc && strcmp(argv[optind], "ll") == 0) {
                /* Low-latency mode: the standard shape of BENCHMARKS.md unless given. */
                o.ll = true;
                if (!tokens_set)
                        o.tokens = 128;
                if (!experts_set)
                        o.experts = 288;
                optind++;
        }
        if (optind < argc) {
                usage(stderr);
                return 2;
        }
        if (o.iters < 1 || o.iters > MAX_ITERS || o.warmup < 0 || o.tokens < 1) {
                fprintf(stderr, "moeep-bench: --iters must be in 1..%d, --warmup >= 0, --tokens >= 1\n",
                        MAX_ITERS);
                return 2;
        }
        ngpu = harness_gpu_count();
        if (ngpu < 1) {
                fprintf(stderr, "moeep-bench: no CUDA device\n");
                return 1;
        }
        if (o.ranks == 0)
                o.ranks = ngpu > MOEEP_MAX_RANKS ? MOEEP_MAX_RANKS : ngpu;
        /* More ranks than GPUs share them; the harness warns that the
         * times are then no performance figures. */
        if (o.ranks > MOEEP_MAX_RANKS) {
                fprintf(stderr, "moeep-bench: --ranks %d, at most %d\n", o.ranks, MOEEP_MAX_RANKS);
                return 2;
        }
        if (!o.seed && getrandom(&o.seed, sizeof(o.seed), 0) != sizeof(o.seed))
                o.seed = 1;
        if (harness_init(&h, moeepd, socket, sizeof(struct shared)) < 0)
                return 1;
        /* Across daemons the GPU start barrier cannot reach every rank. */
        o.nodes = h.nodes;
        if (o.nodes == 2)
                o.host_start = true;
        failed = harness_run(&h, o.ranks, "moeep-bench", rank_fn, &o, 1800);
        if (!failed)
                report(&o, h.shared, o.ranks);
        harness_fini(&h);
        if (failed)
                fprintf(stderr, "moeep-bench: %d ranks failed\n", failed);
        return failed ? 1 : 0;
}
