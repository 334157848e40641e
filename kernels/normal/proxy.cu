/* Normal mode across daemons (kernels.h, "The internode proxy path"). The
 * intranode kernels skip ranks at other daemons; these kernels carry what
 * they would have written there:
 *
 *   dispatch: px_dispatch_stage writes our rows for each remote rank d into
 *             our segment for d at the row notify gave them (send_pos: 0..
 *             count - 1), then ships it; px_dispatch_relay waits for each
 *             remote source's segment here and places its rows at the
 *             source's rows of our receive area (rank_prefix), as its NVLink
 *             writes would have. Then moeep_launch_dispatch runs.
 *   combine:  px_combine_stage writes the rows we received from each remote
 *             source back into our segment for it (with the token they
 *             belong to), ships it; px_combine_relay places remote ranks'
 *             rows into our combine slots and counts them on the chunk
 *             counters. Then moeep_launch_combine runs.
 *
 * Stage kernels never wait; relays wait only for remote segments, which the
 * remote rank's stage kernel (queued before its relay) ships: no cycle. */
#include "common/launch.cuh"
#include "common/ptx.cuh"
#include "common/px.cuh"
#include "common/wait.cuh"
#include "kernels.h"

/* The staged rows' layouts (px_pair, px_comb_row_bytes) and the segment
 * header bits (PX_SEG_*) are in buffers.h. */
__device__ __forceinline__ int px_warp(void) {
        return (int)(blockIdx.x * PX_WARPS + threadIdx.x / 32);
}

template <typename Idx>
__global__ void __launch_bounds__(PX_THREADS, 1)
        px_dispatch_stage(struct moeep_ctx ctx, struct moeep_dispatch_launch a, struct moeep_route route) {
        const int lane = threadIdx.x % 32, R = ctx.ranks, epr = ctx.num_experts / R;
        const int warps = gridDim.x * PX_WARPS;
        const size_t row_bytes = (size_t)ctx.hidden * a.elem_size;
        const int n_scales = a.x_scales ? ctx.hidden / MOEEP_SCALE_BLOCK : 0;
        const int K = a.topk_idx ? a.num_topk : 0;
        const struct px_pair_layout pl = px_pair(row_bytes, n_scales, K);
        const Idx *topk_idx = (const Idx *)a.topk_idx;

        for (int t = px_warp(); t < route.num_tokens; t += warps) {
                const int4 *src = (const int4 *)((const char *)a.x + (size_t)t * row_bytes);
                for (int d = 0; d < R; d++) {
                        if (!px_remote(ctx, d))
                                continue;
                        const int pos = route.send_pos[(size_t)t * R + d];
                        if (pos < 0)
                                continue;
                        char *pair = px_send_seg(ctx, ctx.px.nm_dispatch, ctx.px.nm_dispatch_seg, d) +
                                     MOEEP_PX_SEG_HDR + (size_t)pos * pl.bytes;
                        for (int i = lane; i < (int)(row_bytes / 16); i += 32)
                                st_na_v4((int4 *)pair + i, ld_nc_v4(src + i));
                        for (int j = lane; j < n_scales; j += 32)
                                ((float *)(pair + pl.scales))[j] =
                                        a.x_scales[(size_t)t * a.scale_stride_t + (size_t)j * a.scale_stride_j];
                        if (lane < K) {
                                const int64_t e = (int64_t)topk_idx[(size_t)t * K + lane];
                                const int64_t local =
                                        e >= (int64_t)d * epr && e < (int64_t)(d + 1) * epr ? e - (int64_t)d * epr : -1;
                                const float w = a.topk_weights ? a.topk_weights[(size_t)t * K + lane] : 0.0f;
                                ((int64_t *)(pair + pl.idx))[lane] = local;
                                ((float *)(pair + pl.weights))[lane] = local >= 0 ? w : 0.0f;
                        }
                        if (lane == 0) {
                                *(int32_t *)(pair + pl.src) = t;
                                atomicAdd(&ctx.px.state->nm_claim[d], 1u);
                        }
                }
        }
        if (!last_block_done(ctx))
                return;
        if (threadIdx.x == 0)
                px_ship(ctx, ctx.px.nm_dispatch, ctx.px.nm_dispatch_seg, ctx.px.state->nm_claim, pl.bytes,
                        MOEEP_PX_COUNTER_NM_DISPATCH(0),
                        px_seg_info(ctx.px.epoch + ctx.state->seq, (uint32_t)row_bytes, (uint32_t)K,
                                    (n_scales > 0 ? PX_SEG_SCALES : 0) | (sizeof(Idx) == 4 ? PX_SEG_IDX32 : 0)));
}

/* The row layout comes from each segment's header: a source's rows look
 * as its NVLink writes would (its top-k count is the row stride of the
 * top-k arrays and its index type theirs, as in dispatch_kernel). */
__global__ void __launch_bounds__(PX_THREADS, 1) px_dispatch_relay(struct moeep_ctx ctx, struct moeep_route route) {
        const int lane = threadIdx.x % 32, warps = gridDim.x * PX_WARPS;
        /* Our receive area of this call: where an NVLink source would write. */
        char *own = ctx.peers[ctx.rank] + (size_t)ctx.recv_area * ctx.layout.area_bytes;

        for (int s = 0; s < ctx.ranks; s++) {
                if (!px_remote(ctx, s))
                        continue;
                const struct moeep_px_seg *h =
                        px_block_wait(ctx, ctx.px.nm_dispatch, ctx.px.nm_dispatch_seg, MOEEP_PX_COUNTER_NM_DISPATCH(s),
                                      ctx.px.epoch + ctx.state->seq, s);
                if (!h)
                        break;
                const int base = route.rank_prefix[s];
                const int n = min(__ldcv((const int *)&h->count), route.rank_prefix[s + 1] - base);
                const size_t row_bytes = (size_t)__ldcv((const int *)&h->row_bytes);
                const int K = min(__ldcv((const int *)&h->topk), MOEEP_KERNEL_MAX_TOPK);
                const int bits = __ldcv((const int *)&h->scales);
                const int n_scales = bits & PX_SEG_SCALES ? ctx.hidden / MOEEP_SCALE_BLOCK : 0;
                const struct px_pair_layout pl = px_pair(row_bytes, n_scales, K);
                if (row_bytes != (size_t)ctx.hidden && row_bytes != (size_t)ctx.hidden * 2)
                        break; /* cannot come from our kernels */
                for (int q = px_warp(); q < n; q += warps) {
                        const char *pair = (const char *)h + MOEEP_PX_SEG_HDR + (size_t)q * pl.bytes;
                        const size_t p = (size_t)base + q;
                        px_copy((int4 *)(own + ctx.layout.recv_x + p * row_bytes), (const int4 *)pair, row_bytes);
                        for (int j = lane; j < n_scales; j += 32)
                                ((float *)(own + ctx.layout.recv_scales))[p * n_scales + j] =
                                        __ldcv((const float *)(pair + pl.scales) + j);
                        if (lane < K) {
                                const long long e = __ldcv((const long long *)(pair + pl.idx) + lane);
                                if (bits & PX_SEG_IDX32)
                                        ((int32_t *)(own + ctx.layout.recv_topk_idx))[p * K + lane] = (int32_t)e;
                                else
                                        ((int64_t *)(own + ctx.layout.recv_topk_idx))[p * K + lane] = e;
                                ((float *)(own + ctx.layout.recv_topk_weights))[p * K + lane] =
                                        __ldcv((const float *)(pair + pl.weights) + lane);
                        }
                        if (lane == 0)
                                ((int32_t *)(own + ctx.layout.recv_src))[p] = __ldcv((const int *)(pair + pl.src));
                }
        }
}

__global__ void __launch_bounds__(PX_THREADS, 1)
        px_combine_stage(struct moeep_ctx ctx, const int4 *x, const float *weights, int K, struct moeep_route route) {
        const int lane = threadIdx.x % 32, warps = gridDim.x * PX_WARPS, H = ctx.hidden;
        if (!weights)
                K = 0;
        const size_t rb = px_comb_row_bytes(H, K);

        for (int s = 0; s < ctx.ranks; s++) {
                if (!px_remote(ctx, s))
                        continue;
                const int base = route.rank_prefix[s], n = route.rank_prefix[s + 1] - base;
                char *seg = px_send_seg(ctx, ctx.px.nm_combine, ctx.px.nm_combine_seg, s) + MOEEP_PX_SEG_HDR;
                for (int q = px_warp(); q < n; q += warps) {
                        const size_t p = (size_t)base + q;
                        char *row = seg + (size_t)q * rb;
                        for (int i = lane; i < H / 8; i += 32)
                                st_na_v4((int4 *)row + i, ld_nc_v4(x + p * (H / 8) + i));
                        if (lane < K)
                                ((float *)(row + (size_t)H * 2))[lane] = weights[p * K + lane];
                        if (lane == 0)
                                *(int32_t *)(row + (size_t)H * 2 + (size_t)K * sizeof(float)) =
                                        moeep_recv_src_token(route.recv_src[p]);
                }
        }
        if (!last_block_done(ctx))
                return;
        if (threadIdx.x < ctx.ranks && px_remote(ctx, threadIdx.x))
                ctx.px.state->nm_claim[threadIdx.x] =
                        route.rank_prefix[threadIdx.x + 1] - route.rank_prefix[threadIdx.x];
        __syncthreads();
        if (threadIdx.x == 0)
                px_ship(ctx, ctx.px.nm_combine, ctx.px.nm_combine_seg, ctx.px.state->nm_claim, rb,
                        MOEEP_PX_COUNTER_NM_COMBINE(0), px_seg_info(ctx.px.epoch + ctx.state->seq, 0, (uint32_t)K, 0));
}

/* Weights per row come from each segment's header (the sender's, as its
 * NVLink writes would). */
__global__ void __launch_bounds__(PX_THREADS, 1) px_combine_relay(struct moeep_ctx ctx) {
        const int lane = threadIdx.x % 32, warps = gridDim.x * PX_WARPS, H = ctx.hidden;
        char *own = ctx.peers[ctx.rank];
        struct moeep_sync *my = sync_of(ctx, ctx.rank);

        for (int s = 0; s < ctx.ranks; s++) {
                if (!px_remote(ctx, s))
                        continue;
                const struct moeep_px_seg *h =
                        px_block_wait(ctx, ctx.px.nm_combine, ctx.px.nm_combine_seg, MOEEP_PX_COUNTER_NM_COMBINE(s),
                                      ctx.px.epoch + ctx.state->seq, s);
                if (!h)
                        break;
                const int n = min(__ldcv((const int *)&h->count), ctx.max_tokens);
                const int K = min(__ldcv((const int *)&h->topk), ctx.max_topk);
                const size_t rb = px_comb_row_bytes(H, K);
                for (int q = px_warp(); q < n; q += warps) {
                        const char *row = (const char *)h + MOEEP_PX_SEG_HDR + (size_t)q * rb;
                        const int t = __ldcv((const int *)(row + (size_t)H * 2 + (size_t)K * sizeof(float)));
                        if (t < 0 || t >= ctx.max_tokens)
                                continue; /* cannot come from our kernels */
                        const size_t slot = (size_t)s * ctx.max_tokens + t;
                        px_copy((int4 *)(own + ctx.layout.comb_x + slot * H * 2), (const int4 *)row, (size_t)H * 2);
                        if (lane < K)
                                ((float *)(own + ctx.layout.comb_weights))[slot * ctx.max_topk + lane] =
                                        __ldcv((const float *)(row + (size_t)H * 2) + lane);
                        /* As combine's senders count a row: every lane's stores, then the release. */
                        __syncwarp();
                        if (lane == 0)
                                red_release_sys_add(&my->comb_chunk[t / moeep_combine_chunk(ctx.ranks)], 1);
                }
        }
}

static int px_blocks(const struct moeep_ctx *ctx) {
        return ctx->num_sms;
}

extern "C" int moeep_launch_px_dispatch_stage(const struct moeep_ctx *ctx, const struct moeep_dispatch_launch *a,
                                              const struct moeep_route *route, cudaStream_t stream) {
        MOEEP_CUDA_LAUNCH_BEGIN();
        with_index_type(a->idx_is_int64 || !a->topk_idx, [&](auto idx) {
                px_dispatch_stage<decltype(idx)><<<px_blocks(ctx), PX_THREADS, 0, stream>>>(*ctx, *a, *route);
        });
        MOEEP_CUDA_LAUNCH_CHECK();
        return 0;
}

extern "C" int moeep_launch_px_dispatch_relay(const struct moeep_ctx *ctx, const struct moeep_route *route,
                                              cudaStream_t stream) {
        MOEEP_CUDA_LAUNCH_BEGIN();
        coop_note(stream);
        px_dispatch_relay<<<px_blocks(ctx), PX_THREADS, 0, stream>>>(*ctx, *route);
        MOEEP_CUDA_LAUNCH_CHECK();
        return 0;
}

extern "C" int moeep_launch_px_combine_stage(const struct moeep_ctx *ctx, const void *x, const float *topk_weights,
                                             int num_topk, const struct moeep_route *route, cudaStream_t stream) {
        MOEEP_CUDA_LAUNCH_BEGIN();
        px_combine_stage<<<px_blocks(ctx), PX_THREADS, 0, stream>>>(*ctx, (const int4 *)x, topk_weights, num_topk,
                                                                    *route);
        MOEEP_CUDA_LAUNCH_CHECK();
        return 0;
}

extern "C" int moeep_launch_px_combine_relay(const struct moeep_ctx *ctx, cudaStream_t stream) {
        MOEEP_CUDA_LAUNCH_BEGIN();
        coop_note(stream);
        px_combine_relay<<<px_blocks(ctx), PX_THREADS, 0, stream>>>(*ctx);
        MOEEP_CUDA_LAUNCH_CHECK();
        return 0;
}
