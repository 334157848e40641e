/* Normal-mode dispatch: every token is written once to each rank that holds
 * one of its experts, straight into that rank's receive area at the row the
 * notify kernel computed (send_pos), so the receiver's recv_x is ordered by
 * source rank, then source token, with no copy on arrival.
 *
 * Buffers: x/scales/topk are the caller's (read-only here); the receive
 * area rank d picked for this call (peers[d] + dst_area[d] * area_bytes +
 * layout.recv_*) is written by its sources only at rows reserved for them,
 * and read by its owner after the flags. */
#include "common/launch.cuh"
#include "common/ptx.cuh"
#include "common/px.cuh"
#include "common/wait.cuh"
#include "kernels.h"

/* pos[d] of a token: its row in rank d's receive area, with the area in
 * the bits from AREA_SHIFT up (rows < MOEEP_KERNEL_MAX_RANKS *
 * MOEEP_KERNEL_MAX_TOKENS fit under it). */
#define AREA_SHIFT 24
static_assert(MOEEP_KERNEL_MAX_RANKS * MOEEP_KERNEL_MAX_TOKENS <= (1 << AREA_SHIFT), "rows overflow into the area");
static_assert(MOEEP_MAX_RECV_AREAS <= (1 << (31 - AREA_SHIFT)), "areas overflow the sign bit");

/* Row `pos` (area and row, as above) of the array at `array` (area 0's
 * offset) with `row_bytes` per row, in rank d's buffer. */
__device__ __forceinline__ char *area_row(const struct moeep_ctx &ctx, int d, int pos, size_t array, size_t row_bytes) {
        return ctx.peers[d] + (size_t)(pos >> AREA_SHIFT) * ctx.layout.area_bytes + array +
               (size_t)(pos & ((1 << AREA_SHIFT) - 1)) * row_bytes;
}

template <typename Idx>
__global__ void __launch_bounds__(DISPATCH_THREADS, 1)
        dispatch_kernel(struct moeep_ctx ctx, struct moeep_dispatch_launch a, int num_tokens,
                        struct moeep_route route) {
        __shared__ int s_prefix[MOEEP_KERNEL_MAX_RANKS + 1];
        grid_dep_wait(); /* notify (or the barrier) before us: its route, seq and areas */
        const int tid = threadIdx.x, lane = tid % 32;
        uint64_t *trace = ctx.trace ? ctx.trace + MOEEP_TRACE_DISPATCH + blockIdx.x * MOEEP_TRACE_STAMPS : NULL;
        trace_stamp(trace, 0);
        const int R = ctx.ranks, me = ctx.rank, epr = ctx.num_experts / R;
        /* A warp's unit of work is a part of a token's row (`parts` per
         * row; the first part also carries the token's scales, top-k and
         * source). Each warp starts on one unit (unit u on block u % grid,
         * so that a call of fewer units than warps spreads over every SM)
         * and then claims the next from a counter: SMs do not store to
         * NVLink at one speed (blocks given the same share of a call ended
         * from 134 to 212 us into it, 2 x H200), and with fixed shares the
         * slowest set the call's time. Parts of rows make the last units,
         * which end the call, short (4 parts: 8 were 1 us faster in BF16
         * at 24 SMs, 4 us slower in FP8 and 20 us at 8 SMs, where a
         * unit's fixed costs weigh more); a call with no more tokens than warps
         * gives each token a warp of its own instead (a second unit after
         * the first would only lengthen the chain of its warp). */
        const int warps = gridDim.x * (DISPATCH_THREADS / 32);
        const int gwarp = (tid / 32) * gridDim.x + blockIdx.x;
        const size_t row_bytes = (size_t)ctx.hidden * a.elem_size;
        const int n16 = (int)(row_bytes / 16);
        const int n_scales = ctx.hidden / MOEEP_SCALE_BLOCK;
        const int K = a.num_topk;
        const uint64_t seq = ctx.state->seq;
        const Idx *topk_idx = (const Idx *)a.topk_idx;
        const bool failed = *(volatile uint32_t *)&ctx.state->error != 0;

        const int my_base = lane < R ? route.dst_base[lane] : 0;
        /* Rank d's rows go into the receive area d picked (notify's
         * barrier), carried in the top bits of pos[d] (area_row). */
        const int my_area = lane < R ? ctx.state->dst_area[lane] << AREA_SHIFT : 0;
        /* Ranks whose x rows are left out (MOEEP_DEBUG_DISPATCH_NO_*). */
        const uint32_t skip_x = (ctx.debug & MOEEP_DEBUG_DISPATCH_NO_SELF ? 1u << me : 0u) |
                                (ctx.debug & MOEEP_DEBUG_DISPATCH_NO_PEERS ? ~(1u << me) : 0u);

        const int parts = num_tokens > warps ? DISPATCH_PARTS : 1;
        const int units = num_tokens * parts;
        const int part16 = (n16 + parts - 1) / parts;
        /* Lane d < R: the token's row in rank d's receive area as notify
         * gave it (-1 when the token skips d; ranks at other daemons: staged
         * by px_dispatch_stage). Loaded a unit ahead, while the unit before
         * stores its rows, so that it is mostly there when the unit starts. */
        auto route_of = [&](int unit) {
                return unit < units && lane < R && !px_remote(ctx, lane)
                               ? route.send_pos[(size_t)(unit / parts) * R + lane]
                               : -1;
        };
        /* pos[d]: the row in rank d's receive area, with its area. */
        auto positions = [&](int raw, int(&pos)[MOEEP_KERNEL_MAX_RANKS]) {
                const int p = raw >= 0 ? (raw + my_base) | my_area : -1;
#pragma unroll
                for (int d = 0; d < MOEEP_KERNEL_MAX_RANKS; d++)
                        pos[d] = __shfl_sync(0xffffffffu, p, d);
        };
        int unit = failed ? units : gwarp, raw = route_of(unit);
        while (unit < units) {
                /* The warp's next unit, claimed now and read at the end. */
                const int next = units <= warps ? units
                                 : lane == 0    ? warps + (int)atomicAdd(&ctx.state->dispatch_claim, 1u)
                                                : 0;
                const int t = unit / parts, part = unit % parts;
                int pos[MOEEP_KERNEL_MAX_RANKS];
                const int4 *src = (const int4 *)((const char *)a.x + (size_t)t * row_bytes);
                const int hi = min(n16, (part + 1) * part16);
                /* Before the loop, whose trip count is a lane's own: the
                 * shuffles need every lane (the route came a unit ahead). */
                positions(raw, pos);
                for (int i = part * part16 + lane; i < hi; i += 32 * DISPATCH_UNROLL) {
                        int4 v[DISPATCH_UNROLL];
#pragma unroll
                        for (int u = 0; u < DISPATCH_UNROLL; u++)
                                if (i + u * 32 < hi)
                                        v[u] = ld_nc_v4(src + i + u * 32);
#pragma unroll
                        for (int d = 0; d < MOEEP_KERNEL_MAX_RANKS; d++) {
                                if (d >= R || pos[d] < 0 || (skip_x >> d & 1))
                                        continue;
                                int4 *dst = (int4 *)(area_row(ctx, d, pos[d], ctx.layout.recv_x, row_bytes));
#pragma unroll
                                for (int u = 0; u < DISPATCH_UNROLL; u++)
                                        if (i + u * 32 < hi)
                                                st_na_v4(dst + i + u * 32, v[u]);
                        }
                }
                unit = __shfl_sync(0xffffffffu, next, 0);
                raw = route_of(unit);
                if (part != 0)
                        continue;
                if (a.x_scales)
                        for (int j = lane; j < n_scales; j += 32) {
                                float s = a.x_scales[(size_t)t * a.scale_stride_t + (size_t)j * a.scale_stride_j];
                                for (int d = 0; d < R; d++)
                                        if (pos[d] >= 0)
                                                ((float *)area_row(ctx, d, pos[d], ctx.layout.recv_scales,
                                                                   n_scales * sizeof(float)))[j] = s;
                        }
                if (topk_idx && lane < K) {
                        int64_t e = (int64_t)topk_idx[(size_t)t * K + lane];
                        float w = a.topk_weights ? a.topk_weights[(size_t)t * K + lane] : 0.0f;
                        for (int d = 0; d < R; d++) {
                                if (pos[d] < 0)
                                        continue;
                                /* Expert ids become the destination's local ids; experts
                                 * elsewhere read -1 with weight 0. */
                                int64_t local =
                                        e >= (int64_t)d * epr && e < (int64_t)(d + 1) * epr ? e - (int64_t)d * epr : -1;
                                ((Idx *)area_row(ctx, d, pos[d], ctx.layout.recv_topk_idx, K * sizeof(Idx)))[lane] =
                                        (Idx)local;
                                ((float *)area_row(ctx, d, pos[d], ctx.layout.recv_topk_weights,
                                                   K * sizeof(float)))[lane] = local >= 0 ? w : 0.0f;
                        }
                }
                if (lane == 0)
                        for (int d = 0; d < R; d++)
                                if (pos[d] >= 0)
                                        *(int32_t *)area_row(ctx, d, pos[d], ctx.layout.recv_src, sizeof(int32_t)) = t;
        }

        if (trace && lane == 0)
                atomicMax((unsigned long long *)&trace[1], (unsigned long long)globaltimer_ns());
        /* The last block to finish tells every destination that our rows
         * landed. */
        if (!last_block_done(ctx))
                return;
        if (tid == 0) /* every warp's last claim is behind last_block_done's barrier */
                ctx.state->dispatch_claim = 0;
        /* Rows from ranks at other daemons: px_dispatch_relay placed them before. */
        if (tid < R && !px_remote(ctx, tid))
                st_release_sys(&sync_of(ctx, tid)->dispatch_flag[me], seq);
        if (tid < R && !px_remote(ctx, tid))
                wait_flag(ctx, &sync_of(ctx, me)->dispatch_flag[tid], seq, tid);
        if (tid <= R)
                s_prefix[tid] = route.rank_prefix[tid];
        __syncthreads();
        trace_stamp(trace, 2);

        /* Receive metadata for combine: (source rank, source token) per row. */
        const int32_t *buf_src =
                (const int32_t *)(ctx.peers[me] + (size_t)ctx.recv_area * ctx.layout.area_bytes + ctx.layout.recv_src);
        const int num_recv = *route.num_recv;
        /* DISPATCH_SRC_UNROLL loads in flight per thread: one at a time, the
         * pass was a chain of memory round trips (about 5 us for 8192 rows). */
        for (int p0 = tid; p0 < num_recv; p0 += DISPATCH_THREADS * DISPATCH_SRC_UNROLL) {
                int32_t t[DISPATCH_SRC_UNROLL];
#pragma unroll
                for (int u = 0; u < DISPATCH_SRC_UNROLL; u++)
                        if (p0 + u * DISPATCH_THREADS < num_recv)
                                t[u] = __ldcg(buf_src + p0 + u * DISPATCH_THREADS);
#pragma unroll
                for (int u = 0; u < DISPATCH_SRC_UNROLL; u++) {
                        const int p = p0 + u * DISPATCH_THREADS;
                        if (p >= num_recv)
                                break;
                        int s = 0;
                        while (s + 1 < R && p >= s_prefix[s + 1])
                                s++;
                        route.recv_src[p] = moeep_recv_src_pack(s, t[u]);
                }
        }
        if (trace) {
                __syncthreads();
                trace_stamp(trace, 3);
        }
}

extern "C" int moeep_launch_dispatch(const struct moeep_ctx *ctx, const struct moeep_dispatch_launch *a,
                                     const struct moeep_route *route, cudaStream_t stream) {
        MOEEP_CUDA_LAUNCH_BEGIN();
        coop_note(stream); /* it waits for the other ranks' rows */
        /* A programmatic dependent of notify or the barrier (launched just
         * before on the same stream): its blocks wait on the SMs for notify's
         * end instead of being launched after it. */
        const cudaError_t e = with_index_type(a->idx_is_int64 || !a->topk_idx, [&](auto idx) {
                return launch_kernel(dispatch_kernel<decltype(idx)>, (unsigned)ctx->num_sms, DISPATCH_THREADS, 0,
                                     stream, false, !(ctx->debug & MOEEP_DEBUG_NO_PDL), *ctx, *a, route->num_tokens,
                                     *route);
        });
        if (e != cudaSuccess)
                return (int)e;
        MOEEP_CUDA_LAUNCH_CHECK();
        return 0;
}

/* The received top-k ids and weights of a dispatch (its receive area's
 * [rows][K] arrays) copied into the caller's arrays: rows at or past the
 * received count read -1 and 0 (a num_worst_tokens dispatch, whose count
 * only the device knows). */
template <typename Idx>
__global__ void __launch_bounds__(COPY_TOPK_THREADS)
        copy_topk_kernel(const Idx *idx, const float *weights, const int *num_recv, int rows, int K, Idx *idx_out,
                         float *weights_out) {
        grid_dep_wait(); /* the dispatch before us: its rows and its count */
        const size_t n = (size_t)max(0, min(*num_recv, rows)) * K, total = (size_t)rows * K;

        for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (size_t)gridDim.x * blockDim.x) {
                idx_out[i] = i < n ? idx[i] : (Idx)-1;
                weights_out[i] = i < n ? weights[i] : 0.0f;
        }
}

extern "C" int moeep_launch_copy_topk(const struct moeep_ctx *ctx, const void *idx, int idx_is_int64,
                                      const float *weights, const int *num_recv, int rows, int num_topk, void *idx_out,
                                      float *weights_out, cudaStream_t stream) {
        const size_t total = (size_t)rows * num_topk;
        const unsigned blocks = (unsigned)min((total + COPY_TOPK_THREADS - 1) / COPY_TOPK_THREADS, (size_t)1024);

        MOEEP_CUDA_LAUNCH_BEGIN();
        if (total == 0)
                return 0;
        /* A programmatic dependent of the dispatch: placed while it ends. */
        const cudaError_t e = with_index_type(idx_is_int64, [&](auto i) {
                using Idx = decltype(i);
                return launch_kernel(copy_topk_kernel<Idx>, blocks, COPY_TOPK_THREADS, 0, stream, false,
                                     !(ctx->debug & MOEEP_DEBUG_NO_PDL), (const Idx *)idx, weights, num_recv, rows,
                                     num_topk, (Idx *)idx_out, weights_out);
        });
        if (e != cudaSuccess)
                return (int)e;
        MOEEP_CUDA_LAUNCH_CHECK();
        return 0;
}
