/* Low-latency (decode) mode: every (token, expert) pair goes to the expert's
 * rank into a packed per-expert receive slot, FP8-cast on the way when
 * asked; combine sends each expert output back to its token's rank, which
 * sums them with the top-k weights.
 *
 * Every call uses one of two buffer sets, chosen by the host (b); calls on
 * one set must follow the rule of moeep_ep.h (dispatch n+2 after combine n),
 * which is what makes the resets below safe.
 *
 * Buffers of set b in every rank's NVLink buffer (struct moeep_ll_layout):
 *   x, scales, src   [local expert][ranks * max_tokens] slots, written by the
 *                    senders at the slot the receiver's counter gave them;
 *   comb             [max_tokens][max_topk] rows, written by the expert ranks;
 *   counter[b][le]   slots taken of local expert le (remote atomics), read
 *                    and zeroed by the receive kernel;
 *   count[b][le]     the received counts, for the caller and combine;
 *   flags            per source rank, the set's sequence number, released
 *                    after the source's rows landed. */
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include "kernels.h"
#include "ptx.cuh"

enum { LL_THREADS = 512, LL_WARPS = LL_THREADS / 32 };

__device__ __forceinline__ struct moeep_ll_sync *ll_sync_of(const struct moeep_ctx &ctx, int rank) {
        return (struct moeep_ll_sync *)(ctx.peers[rank] + ctx.ll.sync);
}

__device__ __forceinline__ size_t ll_slot_count(const struct moeep_ctx &ctx) {
        return (size_t)ctx.ranks * ctx.ll.max_tokens;
}

/* Warps numbered across blocks first: the few hundred work items of a
 * decode step spread over every SM instead of filling the first blocks. */
__device__ __forceinline__ int ll_warp_index(void) {
        return (int)(threadIdx.x / 32 * gridDim.x + blockIdx.x);
}

/* Shared memory of one warp's FP8 staging: the e4m3 row, then its scales. */
__host__ __device__ __forceinline__ size_t ll_stage_bytes(int hidden) {
        return ((size_t)hidden + (size_t)hidden / MOEEP_SCALE_BLOCK * sizeof(float) + 15) / 16 * 16;
}

/* FP8 cast of one bf16 row into shared memory: e4m3 bytes [hidden] then
 * one float scale per 128 channels (amax / 448, or its power of two above
 * when round_scale). Lane i handles int4 chunks i, i + 32, ...; the 16 lanes
 * of a half-warp cover one 128-channel group. */
__device__ __forceinline__ void ll_cast_fp8(const int4 *row, int hidden, bool round_scale, uint8_t *stage) {
        const int lane = threadIdx.x % 32, n16 = hidden / 8;
        float *scales = (float *)(stage + hidden);

        /* Four loads in flight per lane before the first use (n16 is a
         * multiple of 32, so every condition below is warp-uniform). */
        for (int base = lane; base < n16; base += 32 * 4) {
        int4 vv[4];
#pragma unroll
        for (int u = 0; u < 4; u++)
                if (base + 32 * u < n16)
                        vv[u] = ld_nc_v4(row + base + 32 * u);
#pragma unroll
        for (int u = 0; u < 4; u++) {
                const int i = base + 32 * u;
                if (i >= n16)
                        break;
                const __nv_bfloat162 *h = (const __nv_bfloat162 *)&vv[u];
                float f[8], amax = 0.0f;
#pragma unroll
                for (int j = 0; j < 4; j++) {
                        float2 p = __bfloat1622float2(h[j]);
                        f[2 * j] = p.x;
                        f[2 * j + 1] = p.y;
                        amax = fmaxf(amax, fmaxf(fabsf(p.x), fabsf(p.y)));
                }
#pragma unroll
                for (int o = 8; o >= 1; o /= 2)
                        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
                float scale = amax > 0.0f ? amax / 448.0f : 1.0f;
                if (round_scale)
                        scale = exp2f(ceilf(log2f(scale)));
                const float inv = 1.0f / scale;
                uint2 q;
                __nv_fp8x2_storage_t *qq = (__nv_fp8x2_storage_t *)&q;
#pragma unroll
                for (int j = 0; j < 4; j++)
                        qq[j] = __nv_cvt_float2_to_fp8x2(make_float2(f[2 * j] * inv, f[2 * j + 1] * inv), __NV_SATFINITE,
                                                         __NV_E4M3);
                *(uint2 *)(stage + (size_t)i * 8) = q;
                if (lane % 16 == 0)
                        scales[i / 16] = scale;
        }
        }
        __syncwarp();
}

/* Waits (in one block) for every source's rows of set b, sequence seq,
 * publishes the counts and zeroes the counters for the set's next use. */
__device__ __forceinline__ void ll_recv_counts(const struct moeep_ctx &ctx, int b, uint64_t seq, int *stats) {
        struct moeep_ll_sync *my = ll_sync_of(ctx, ctx.rank);
        const int tid = threadIdx.x, epr = ctx.num_experts / ctx.ranks;

        if (tid < ctx.ranks)
                wait_flag(ctx, &my->dispatch_flag[b][tid], seq, tid);
        __syncthreads();
        for (int le = tid; le < epr; le += blockDim.x) {
                const uint32_t c = *(volatile uint32_t *)&my->counter[b][le];
                my->count[b][le] = (int32_t)c;
                my->counter[b][le] = 0;
                if (stats)
                        stats[le] += (int)c;
        }
}

/* The receive phase alone (a hook): one block. */
__global__ void ll_dispatch_recv(struct moeep_ctx ctx, int b, int *stats) {
        ll_recv_counts(ctx, b, ctx.state->ll_seq[b], stats);
}

template <typename Idx>
__global__ void __launch_bounds__(LL_THREADS, 1)
        ll_dispatch_send(struct moeep_ctx ctx, const int4 *x, int num_tokens, const Idx *topk_idx, int K, int b,
                         int use_fp8, int round_scale, int recv, int *stats) {
        extern __shared__ __align__(16) uint8_t ll_stage[];
        const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
        const int R = ctx.ranks, me = ctx.rank, H = ctx.hidden, epr = ctx.num_experts / R;
        const int warps = gridDim.x * LL_WARPS, gwarp = ll_warp_index();
        const size_t slots = ll_slot_count(ctx), xrow = (size_t)H * (use_fp8 ? 1 : 2);
        const int nscales = H / MOEEP_SCALE_BLOCK;
        const uint64_t seq = ctx.state->ll_seq[b] + 1;
        uint8_t *stage = ll_stage + (size_t)warp * ll_stage_bytes(H);

        for (int t = gwarp; t < num_tokens; t += warps) {
                const int4 *row = x + (size_t)t * H / 8;
                if (use_fp8)
                        ll_cast_fp8(row, H, round_scale, stage);
                /* Lane k claims the slot of expert k at its rank: the K
                 * remote atomics are in flight together. */
                int my_pos = -1;
                int64_t my_e = -1;
                if (lane < K) {
                        my_e = (int64_t)topk_idx[(size_t)t * K + lane];
                        if (my_e >= 0 && my_e < ctx.num_experts)
                                my_pos = (int)atomicAdd_system(
                                        &ll_sync_of(ctx, (int)(my_e / epr))->counter[b][my_e % epr], 1u);
                }
                for (int k = 0; k < K; k++) {
                        const int64_t e = __shfl_sync(0xffffffffu, my_e, k);
                        const int pos = __shfl_sync(0xffffffffu, my_pos, k);
                        if (pos < 0)
                                continue;
                        const int d = (int)(e / epr), le = (int)(e % epr);
                        if ((size_t)pos >= slots) {
                                /* Only possible when a token names one expert twice. */
                                if (lane == 0)
                                        record_error(ctx, MOEEP_KERR_OVERFLOW, d);
                                continue;
                        }
                        const size_t slot = (size_t)le * slots + pos;
                        char *dst = ctx.peers[d] + ctx.ll.x[b] + slot * xrow;
                        if (use_fp8) {
                                for (int i = lane; i < H / 16; i += 32)
                                        st_na_v4((int4 *)dst + i, *(const int4 *)(stage + (size_t)i * 16));
                                float *sc = (float *)(ctx.peers[d] + ctx.ll.scales[b]) + slot * nscales;
                                for (int i = lane; i < nscales; i += 32)
                                        sc[i] = ((const float *)(stage + H))[i];
                        } else {
                                for (int i = lane; i < H / 8; i += 32 * 4) {
                                        int4 v[4];
#pragma unroll
                                        for (int u = 0; u < 4; u++)
                                                if (i + u * 32 < H / 8)
                                                        v[u] = ld_nc_v4(row + i + u * 32);
#pragma unroll
                                        for (int u = 0; u < 4; u++)
                                                if (i + u * 32 < H / 8)
                                                        st_na_v4((int4 *)dst + i + u * 32, v[u]);
                                }
                        }
                        if (lane == 0)
                                ((int32_t *)(ctx.peers[d] + ctx.ll.src[b]))[slot] = (me << 28) | (k << 20) | t;
                }
                __syncwarp();
        }
        if (!last_block_done(ctx))
                return;
        if (threadIdx.x == 0)
                ctx.state->ll_seq[b] = seq;
        if (threadIdx.x < R)
                st_release_sys(&ll_sync_of(ctx, threadIdx.x)->dispatch_flag[b][me], seq);
        /* Without a hook the last block goes on with the receive phase: it
         * waits only for other GPUs, never for blocks of this grid. */
        if (recv)
                ll_recv_counts(ctx, b, seq, stats);
}

/* Expert outputs back to the tokens' ranks: slot (le, pos) of set b goes to
 * row (token, k) of its source's combine area. */
__global__ void __launch_bounds__(LL_THREADS, 1)
        ll_combine_send(struct moeep_ctx ctx, const int4 *y, int b) {
        const struct moeep_ll_sync *my = ll_sync_of(ctx, ctx.rank);
        const int lane = threadIdx.x % 32, R = ctx.ranks, me = ctx.rank, H = ctx.hidden, epr = ctx.num_experts / R;
        const int warps = gridDim.x * LL_WARPS, gwarp = ll_warp_index();
        const size_t slots = ll_slot_count(ctx);
        const uint64_t seq = ctx.state->ll_seq[b];
        const int32_t *src = (const int32_t *)(ctx.peers[me] + ctx.ll.src[b]);

        /* The slots in use are the first count[le] of each expert; warps walk
         * them as one list (prefix over the experts in shared memory). */
        __shared__ int s_prefix[MOEEP_KERNEL_MAX_EXPERTS + 1];
        if (threadIdx.x == 0) {
                int sum = 0;
                for (int le = 0; le < epr; le++) {
                        s_prefix[le] = sum;
                        sum += my->count[b][le];
                }
                s_prefix[epr] = sum;
        }
        __syncthreads();
        {
                for (int q = gwarp; q < s_prefix[epr]; q += warps) {
                        int lo = 0, hi = epr - 1;
                        while (lo < hi) { /* last expert whose prefix <= q */
                                const int mid = (lo + hi + 1) / 2;
                                if (s_prefix[mid] <= q)
                                        lo = mid;
                                else
                                        hi = mid - 1;
                        }
                        const int le = lo, pos = q - s_prefix[lo];
                        const size_t slot = (size_t)le * slots + pos;
                        const int info = src[slot];
                        const int s = (info >> 28) & 0xf, k = (info >> 20) & 0xff, t = info & 0xfffff;
                        int4 *dst = (int4 *)(ctx.peers[s] + ctx.ll.comb[b] +
                                             ((size_t)t * ctx.max_topk + k) * (size_t)H * 2);
                        const int4 *row = y + slot * H / 8;
                        for (int i = lane; i < H / 8; i += 32 * 8) {
                                int4 v[8];
#pragma unroll
                                for (int u = 0; u < 8; u++)
                                        if (i + u * 32 < H / 8)
                                                v[u] = ld_nc_v4(row + i + u * 32);
#pragma unroll
                                for (int u = 0; u < 8; u++)
                                        if (i + u * 32 < H / 8)
                                                st_na_v4(dst + i + u * 32, v[u]);
                        }
                }
        }
        if (!last_block_done(ctx))
                return;
        if (threadIdx.x < R)
                st_release_sys(&ll_sync_of(ctx, threadIdx.x)->combine_flag[b][me], seq);
}

/* Sums each token's expert outputs with its top-k weights (float), after
 * every rank's rows of set b landed. Experts masked (-1) add nothing. */
template <typename Idx>
__global__ void __launch_bounds__(LL_THREADS, 1)
        ll_combine_recv(struct moeep_ctx ctx, const Idx *topk_idx, const float *weights, int num_tokens, int K,
                        int b, int4 *out) {
        const struct moeep_ll_sync *my = ll_sync_of(ctx, ctx.rank);
        const int lane = threadIdx.x % 32, H = ctx.hidden;
        const int warps = gridDim.x * LL_WARPS, gwarp = ll_warp_index();
        const uint64_t seq = ctx.state->ll_seq[b];
        const char *comb = ctx.peers[ctx.rank] + ctx.ll.comb[b];

        if (threadIdx.x < ctx.ranks)
                wait_flag(ctx, &my->combine_flag[b][threadIdx.x], seq, threadIdx.x);
        __syncthreads();
        /* Work items (token, quarter of the row), so that a few tokens still
         * keep every warp busy; the K rows of a position are loaded together. */
        const int n16 = H / 8, quarter = (n16 + 3) / 4;
        for (int item = gwarp; item < num_tokens * 4; item += warps) {
                const int t = item / 4, i0 = (item % 4) * quarter, i1 = min(n16, i0 + quarter);
                float w = 0.0f;
                uint32_t valid = 0;
                if (lane < K) {
                        const int64_t e = (int64_t)topk_idx[(size_t)t * K + lane];
                        valid = e >= 0 && e < ctx.num_experts;
                        w = valid ? weights[(size_t)t * K + lane] : 0.0f;
                }
                const uint32_t mask = __ballot_sync(0xffffffffu, valid);
                float wk[MOEEP_KERNEL_MAX_TOPK];
#pragma unroll
                for (int k = 0; k < MOEEP_KERNEL_MAX_TOPK; k++)
                        wk[k] = __shfl_sync(0xffffffffu, w, k);
                const int4 *rows = (const int4 *)(comb + (size_t)t * ctx.max_topk * (size_t)H * 2);
                for (int i = i0 + lane; i < i1; i += 32) {
                        float acc[8] = {};
                        int4 v[MOEEP_KERNEL_MAX_TOPK];
#pragma unroll
                        for (int k = 0; k < MOEEP_KERNEL_MAX_TOPK; k++)
                                if ((mask >> k) & 1)
                                        v[k] = __ldcg(rows + (size_t)k * n16 + i);
#pragma unroll
                        for (int k = 0; k < MOEEP_KERNEL_MAX_TOPK; k++) {
                                if (!((mask >> k) & 1))
                                        continue;
                                const __nv_bfloat162 *h = (const __nv_bfloat162 *)&v[k];
#pragma unroll
                                for (int j = 0; j < 4; j++) {
                                        float2 f = __bfloat1622float2(h[j]);
                                        acc[2 * j] += wk[k] * f.x;
                                        acc[2 * j + 1] += wk[k] * f.y;
                                }
                        }
                        int4 o;
                        __nv_bfloat162 *oh = (__nv_bfloat162 *)&o;
#pragma unroll
                        for (int j = 0; j < 4; j++)
                                oh[j] = __floats2bfloat162_rn(acc[2 * j], acc[2 * j + 1]);
                        out[(size_t)t * H / 8 + i] = o;
                }
        }
}

extern "C" int moeep_ll_init(void) {
        const int smem = (int)(LL_WARPS * ll_stage_bytes(MOEEP_LL_FP8_MAX_HIDDEN));
        cudaError_t e = cudaFuncSetAttribute(ll_dispatch_send<int64_t>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
        if (e == cudaSuccess)
                e = cudaFuncSetAttribute(ll_dispatch_send<int32_t>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
        return (int)e;
}

extern "C" int moeep_launch_ll_dispatch_send(const struct moeep_ctx *ctx, const void *x, int num_tokens,
                                             const void *topk_idx, int idx_is_int64, int num_topk, int set, int use_fp8,
                                             int round_scale, int recv, int *stats, cudaStream_t stream) {
        const size_t smem = use_fp8 ? LL_WARPS * ll_stage_bytes(ctx->hidden) : 0;

        MOEEP_CUDA_LAUNCH_BEGIN();
        if (idx_is_int64)
                ll_dispatch_send<int64_t><<<ctx->ll_num_sms, LL_THREADS, smem, stream>>>(
                        *ctx, (const int4 *)x, num_tokens, (const int64_t *)topk_idx, num_topk, set, use_fp8, round_scale, recv,
                        stats);
        else
                ll_dispatch_send<int32_t><<<ctx->ll_num_sms, LL_THREADS, smem, stream>>>(
                        *ctx, (const int4 *)x, num_tokens, (const int32_t *)topk_idx, num_topk, set, use_fp8, round_scale, recv,
                        stats);
        MOEEP_CUDA_LAUNCH_CHECK();
        return 0;
}

extern "C" int moeep_launch_ll_dispatch_recv(const struct moeep_ctx *ctx, int set, int *stats, cudaStream_t stream) {
        MOEEP_CUDA_LAUNCH_BEGIN();
        ll_dispatch_recv<<<1, 256, 0, stream>>>(*ctx, set, stats);
        MOEEP_CUDA_LAUNCH_CHECK();
        return 0;
}

extern "C" int moeep_launch_ll_combine_send(const struct moeep_ctx *ctx, const void *y, int set, cudaStream_t stream) {
        MOEEP_CUDA_LAUNCH_BEGIN();
        ll_combine_send<<<ctx->ll_num_sms, LL_THREADS, 0, stream>>>(*ctx, (const int4 *)y, set);
        MOEEP_CUDA_LAUNCH_CHECK();
        return 0;
}

extern "C" int moeep_launch_ll_combine_recv(const struct moeep_ctx *ctx, const void *topk_idx, int idx_is_int64,
                                            const float *weights, int num_tokens, int num_topk, int set, void *out,
                                            cudaStream_t stream) {
        MOEEP_CUDA_LAUNCH_BEGIN();
        if (idx_is_int64)
                ll_combine_recv<int64_t><<<ctx->ll_num_sms, LL_THREADS, 0, stream>>>(
                        *ctx, (const int64_t *)topk_idx, weights, num_tokens, num_topk, set, (int4 *)out);
        else
                ll_combine_recv<int32_t><<<ctx->ll_num_sms, LL_THREADS, 0, stream>>>(
                        *ctx, (const int32_t *)topk_idx, weights, num_tokens, num_topk, set, (int4 *)out);
        MOEEP_CUDA_LAUNCH_CHECK();
        return 0;
}
