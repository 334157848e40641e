/* moeep-bench (bench.c): the NVLink floor, what plain stores to every
 * peer at once achieve, measured in the same run as the figures: for normal
 * mode its own rows; for low-latency mode the store speed and the flag
 * round trip that each low-latency figure's NVLink floor is made of. */
#include <stdint.h>

#include "bench.h"
#include "ep-internal.h"
#include "bench/bench_kernels.h"

/* The low-latency store speed: every rank stores its slot of each peer's
 * combine area (max_tokens rows) PUT_PASSES_LO times over, then
 * PUT_EXTRA_BYTES more (PUT_EXTRA_PASSES passes at least); the speed is
 * the extra bytes over the extra time, so the launch does not count. */
#define PUT_PASSES_LO 2
#define PUT_EXTRA_PASSES 16
#define PUT_EXTRA_BYTES ((size_t)32 << 20)
/* The flag round trip: batches of round trips, each timed as one. */
#define PINGPONG_BATCHES 64
#define PINGPONG_PER_BATCH 16
#define PINGPONG_TIMEOUT_NS 2000000000ull

struct floor_arg {
        struct moeep_ctx *ctx;
        size_t bytes;
        int blocks, passes;
};

static int op_floor(struct rank_env *env, void *arg) {
        struct floor_arg *f = arg;
        return moeep_launch_p2p_put(f->ctx, f->bytes, f->blocks, f->passes, env->st) ? -1 : 0;
}

/* NVLink floor: every rank writes the same bytes a dispatch of T tokens
 * sends to each peer, with the dispatch's SM budget and with every SM;
 * reported in the dispatch convention (bytes a rank receives in total,
 * own share included, per second). */
int bench_floor(struct rank_env *env, int *slot, int T) {
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
        f = (struct floor_arg){ .ctx = &ctx, .bytes = bytes, .blocks = o->sms, .passes = 1 };
        us = time_op(env, op_floor, &f, &err);
        record(env, (*slot)++, OP_NVL_FLOOR, T, o->sms, us, total);
        f.blocks = nsm;
        us = time_op(env, op_floor, &f, &err);
        record(env, (*slot)++, OP_NVL_FLOOR_ALL, T, nsm, us, total);
        return err;
}

/* The flag round trip between ranks 0 and 1 (the others only take part in
 * the barriers), into shared.flag_rtt_us on rank 0. The flag words are the
 * first word of each one's normal-mode combine area, which no call uses
 * while this runs; each rank zeroes its own before anyone pings. */
static int measure_flag_rtt(struct rank_env *env, const struct moeep_ctx *ctx) {
        int64_t out[1 + PINGPONG_BATCHES], *out_dev = NULL;
        double rtt[PINGPONG_BATCHES];
        const int peer = 1 - env->rank;
        uint64_t *mine = (uint64_t *)(ctx->peers[env->rank] + ctx->layout.comb_x);
        int err = 0;

        /* The first barrier: no peer's store into the area is still
         * running; the second: every flag is 0 before anyone pings. */
        moeep_job_barrier(env->c);
        if (cudaMemset(mine, 0, sizeof(*mine)) != cudaSuccess || cudaDeviceSynchronize() != cudaSuccess ||
            (env->rank < 2 && cudaMalloc((void **)&out_dev, sizeof(out)) != cudaSuccess)) {
                fprintf(stderr, "rank %d: preparing the flag ping-pong: %s\n", env->rank,
                        cudaGetErrorString(cudaGetLastError()));
                err = -1;
        }
        moeep_job_barrier(env->c);
        if (env->rank < 2 && !err) {
                uint64_t *theirs = (uint64_t *)(ctx->peers[peer] + ctx->layout.comb_x);
                if (moeep_launch_flag_pingpong(mine, theirs, env->rank == 0, PINGPONG_BATCHES,
                                               PINGPONG_PER_BATCH, PINGPONG_TIMEOUT_NS, out_dev, env->st)) {
                        fprintf(stderr, "rank %d: the flag ping-pong failed to launch\n", env->rank);
                        err = -1;
                } else if (cudaMemcpyAsync(out, out_dev, sizeof(out), cudaMemcpyDeviceToHost, env->st) !=
                                   cudaSuccess ||
                           cudaStreamSynchronize(env->st) != cudaSuccess) {
                        fprintf(stderr, "rank %d: the flag ping-pong: %s\n", env->rank,
                                cudaGetErrorString(cudaGetLastError()));
                        err = -1;
                } else if (out[0] < 0) {
                        fprintf(stderr, "rank %d: the flag ping-pong with rank %d timed out\n", env->rank,
                                peer);
                        err = -1;
                }
        }
        cudaFree(out_dev);
        moeep_job_barrier(env->c);
        if (env->rank == 0 && !err) {
                for (int b = 0; b < PINGPONG_BATCHES; b++)
                        rtt[b] = (double)out[1 + b] / 1e3 / PINGPONG_PER_BATCH;
                env->sh->flag_rtt_us = median(rtt, PINGPONG_BATCHES);
        }
        return err;
}

int measure_nvlink(struct rank_env *env) {
        struct moeep_ctx ctx;
        struct floor_arg f;
        int err = 0, extra;
        double lo, hi;

        if (env->ranks < 2 || ep_internal_ctx(env->ep, &ctx) < 0 ||
            ctx.px.remote) /* NVLink to every rank only */
                return 0;
        /* One source slot of the combine area; the put reads as much of our
         * receive area, which holds a slot per rank. */
        f = (struct floor_arg){ .ctx = &ctx,
                                .bytes = (size_t)ctx.max_tokens * ctx.hidden * 2 / 16 * 16,
                                .blocks = ctx.ll_num_sms,
                                .passes = PUT_PASSES_LO };
        extra = (int)((PUT_EXTRA_BYTES + f.bytes - 1) / f.bytes);
        if (extra < PUT_EXTRA_PASSES)
                extra = PUT_EXTRA_PASSES;
        lo = time_op(env, op_floor, &f, &err);
        f.passes = PUT_PASSES_LO + extra;
        hi = time_op(env, op_floor, &f, &err);
        if (!err && hi > lo)
                env->sh->speed[env->rank].nvl_gbps =
                        (double)f.bytes * (env->ranks - 1) * extra / ((hi - lo) * 1e3);
        if (env->rank == 0)
                env->sh->nvl_sms = ctx.ll_num_sms;
        return measure_flag_rtt(env, &ctx) < 0 || err ? -1 : 0;
}
