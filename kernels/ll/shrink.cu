/* The elastic endpoints' own launches (ll/shrink.cuh says how the
 * low-latency kernels go on without a masked rank): the clean barrier and
 * the mask, with their launchers (kernels.h). */
#include "common/launch.cuh"
#include "ll/ll.cuh"
#include "ll/shrink.cuh"

/* One block. The barrier of moeep_ll_clean: our clean flag (or, for a
 * remote rank, a header-only segment with its signal) to every rank not
 * left out, then a bounded wait for theirs (a rank that does not come
 * within the shrink timeout is masked, as DeepEP's clean does); then the
 * dispatch's claim counters of both sets go back to zero. */
__global__ void __launch_bounds__(LL_THREADS, 1) ll_clean_barrier(struct moeep_ctx ctx) {
        __shared__ uint32_t s_skip;
        __shared__ uint32_t s_zero[MOEEP_KERNEL_MAX_RANKS];
        const int tid = threadIdx.x, me = ctx.rank;
        const uint64_t seq = ctx.state->ll_clean_seq + 1;

        if (tid == 0)
                s_skip = ll_skip_of(ctx, ll_lost_word(ctx));
        if (tid < MOEEP_KERNEL_MAX_RANKS)
                s_zero[tid] = 0;
        __syncthreads();
        const uint32_t skip = s_skip;
        if (tid < ctx.ranks && tid != me && !px_remote(ctx, tid) && !(skip >> tid & 1))
                st_release_sys(&ll_sync_of(ctx, tid)->clean_flag[me], seq);
        if (tid == 0 && ctx.px.remote) {
                const struct moeep_ctx c = ctx; /* see the dispatch's px_ship */
                px_ship(c, c.px.ll_clean, MOEEP_PX_SEG_HDR, s_zero, 0, MOEEP_PX_COUNTER_LL_CLEAN(0),
                        px_seg_info(c.px.epoch + seq, 0, 0, 0), 0, skip);
        }
        if (tid < ctx.ranks && tid != me && !(skip >> tid & 1)) {
                const uint64_t *flag = px_remote(ctx, tid) ? &ctx.px.counters[MOEEP_PX_COUNTER_LL_CLEAN(tid)]
                                                           : &ll_sync_of(ctx, me)->clean_flag[tid];
                wait_peer(ctx, flag, px_remote(ctx, tid) ? ctx.px.epoch + seq : seq, tid, ctx.shrink_timeout_ns);
        }
        __syncthreads();
        for (int i = tid; i < 2 * MOEEP_KERNEL_MAX_EXPERTS; i += blockDim.x)
                ctx.state->ll_pos[i / MOEEP_KERNEL_MAX_EXPERTS][i % MOEEP_KERNEL_MAX_EXPERTS] = 0;
        if (tid == 0)
                ctx.state->ll_clean_seq = seq;
}

/* The mask, stream-ordered (DeepEP's query / update / clean of its mask
 * buffer). One warp. */
__global__ void ll_mask_op(struct moeep_ctx ctx, int op, int rank, int value, int32_t *out) {
        const int r = threadIdx.x;

        if (r >= ctx.ranks)
                return;
        switch (op) {
        case MOEEP_LL_MASK_QUERY:
                out[r] = *(volatile int32_t *)&ctx.state->mask[r];
                break;
        case MOEEP_LL_MASK_SET:
                if (r == rank)
                        atomicExch(&ctx.state->mask[r], value);
                break;
        case MOEEP_LL_MASK_CLEAN:
                atomicExch(&ctx.state->mask[r], 0);
                break;
        }
}

extern "C" int moeep_launch_ll_clean(const struct moeep_ctx *ctx, cudaStream_t stream) {
        MOEEP_CUDA_LAUNCH_BEGIN();
        coop_note(stream);
        ll_clean_barrier<<<1, LL_THREADS, 0, stream>>>(*ctx);
        MOEEP_CUDA_LAUNCH_CHECK();
        return 0;
}

extern "C" int moeep_launch_ll_mask(const struct moeep_ctx *ctx, int op, int rank, int value, int32_t *out,
                                    cudaStream_t stream) {
        MOEEP_CUDA_LAUNCH_BEGIN();
        ll_mask_op<<<1, 32, 0, stream>>>(*ctx, op, rank, value, out);
        MOEEP_CUDA_LAUNCH_CHECK();
        return 0;
}
