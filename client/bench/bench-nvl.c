/* moeep-bench (bench.c): the NVLink floor, what plain stores to every
 * peer at once achieve, measured in the same run as the figures. */
#include <stdint.h>

#include "bench.h"
#include "ep-internal.h"
#include "bench_kernels.h"

struct floor_arg {
        struct moeep_ctx *ctx;
        size_t bytes;
        int blocks;
};

static int op_floor(struct rank_env *env, void *arg) {
        struct floor_arg *f = arg;
        return moeep_launch_p2p_put(f->ctx, f->bytes, f->blocks, 1, env->st) ? -1 : 0;
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
        f = (struct floor_arg){ .ctx = &ctx, .bytes = bytes, .blocks = o->sms };
        us = time_op(env, op_floor, &f, &err);
        record(env, (*slot)++, OP_NVL_FLOOR, T, o->sms, us, total);
        f.blocks = nsm;
        us = time_op(env, op_floor, &f, &err);
        record(env, (*slot)++, OP_NVL_FLOOR_ALL, T, nsm, us, total);
        return err;
}
