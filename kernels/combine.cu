/* Normal-mode combine: each rank sends every row it received back to the
 * row's source rank, into the slot (our rank, source token) of the source's
 * combine area; the source then sums the slots of the ranks the token went
 * to. Slots are written only by their contributing rank and read only by
 * their owner, after the combine flags. */
#include <cuda_bf16.h>

#include "kernels.h"
#include "ptx.cuh"

enum { COMBINE_THREADS = 1024, COMBINE_UNROLL = 4, REDUCE_UNROLL = 2 };

__device__ __forceinline__ void add_bf16x8(float *acc, int4 v) {
        const __nv_bfloat162 *h = (const __nv_bfloat162 *)&v;
#pragma unroll
        for (int j = 0; j < 4; j++) {
                float2 f = __bfloat1622float2(h[j]);
                acc[2 * j] += f.x;
                acc[2 * j + 1] += f.y;
        }
}

__device__ __forceinline__ int4 pack_bf16x8(const float *acc) {
        int4 v;
        __nv_bfloat162 *h = (__nv_bfloat162 *)&v;
#pragma unroll
        for (int j = 0; j < 4; j++)
                h[j] = __floats2bfloat162_rn(acc[2 * j], acc[2 * j + 1]);
        return v;
}

__global__ void __launch_bounds__(COMBINE_THREADS, 1)
        combine_kernel(struct moeep_ctx ctx, const int4 *x, const float *weights, int num_topk,
                       struct moeep_route route, int4 *out, float *out_weights) {
        __shared__ int s_last;
        const int tid = threadIdx.x, lane = tid % 32;
        const int R = ctx.ranks, me = ctx.rank, K = num_topk;
        const int warps = gridDim.x * (COMBINE_THREADS / 32);
        const int gwarp = blockIdx.x * (COMBINE_THREADS / 32) + tid / 32;
        const size_t row_bytes = (size_t)ctx.hidden * 2;
        const int n16 = (int)(row_bytes / 16);
        const uint64_t seq = ctx.state->seq;
        const int num_recv = *route.num_recv;
        const bool failed = *(volatile uint32_t *)&ctx.state->error != 0;

        /* Phase 1: rows back to their sources. */
        for (int p = gwarp; p < num_recv && !failed; p += warps) {
                int packed = route.recv_src[p];
                int s = packed >> 24, t = packed & 0xffffff;
                size_t slot = (size_t)me * ctx.max_tokens + t;
                int4 *dst = (int4 *)(ctx.peers[s] + ctx.layout.comb_x + slot * row_bytes);
                const int4 *src = x + (size_t)p * n16;

                for (int i = lane; i < n16; i += 32 * COMBINE_UNROLL) {
                        int4 v[COMBINE_UNROLL];
#pragma unroll
                        for (int u = 0; u < COMBINE_UNROLL; u++)
                                if (i + u * 32 < n16)
                                        v[u] = ld_nc_v4(src + i + u * 32);
#pragma unroll
                        for (int u = 0; u < COMBINE_UNROLL; u++)
                                if (i + u * 32 < n16)
                                        st_na_v4(dst + i + u * 32, v[u]);
                }
                if (weights && lane < K)
                        ((float *)(ctx.peers[s] + ctx.layout.comb_weights))[slot * ctx.max_topk + lane] =
                                weights[(size_t)p * K + lane];
        }

        /* Same last-block signalling as dispatch (see there). */
        __threadfence_system();
        __syncthreads();
        if (tid == 0) {
                s_last = atomicAdd(&ctx.state->blocks_done, 1u) == gridDim.x - 1;
                __threadfence_system();
        }
        __syncthreads();
        if (s_last) {
                if (tid == 0)
                        ctx.state->blocks_done = 0;
                if (tid < R)
                        st_release_sys(&sync_of(ctx, tid)->combine_flag[me], seq);
        }

        /* Phase 2: every block waits for every contributor, then reduces its
         * share of our tokens. All blocks are resident (one per SM). */
        if (tid < R)
                wait_flag(ctx, &sync_of(ctx, me)->combine_flag[tid], seq, tid);
        __syncthreads();
        if (*(volatile uint32_t *)&ctx.state->error)
                return;

        const char *slots = ctx.peers[me] + ctx.layout.comb_x;
        const float *wslots = (const float *)(ctx.peers[me] + ctx.layout.comb_weights);
        for (int t = gwarp; t < route.num_tokens; t += warps) {
                int my_pos = lane < R ? route.send_pos[(size_t)t * R + lane] : -1;
                uint32_t mask = __ballot_sync(0xffffffffu, my_pos >= 0);

                for (int i = lane; i < n16; i += 32 * REDUCE_UNROLL) {
                        float acc[REDUCE_UNROLL][8];
#pragma unroll
                        for (int u = 0; u < REDUCE_UNROLL; u++)
#pragma unroll
                                for (int j = 0; j < 8; j++)
                                        acc[u][j] = 0.0f;
                        for (uint32_t m = mask; m; m &= m - 1) {
                                int r = __ffs(m) - 1;
                                const int4 *row = (const int4 *)(slots + ((size_t)r * ctx.max_tokens + t) * row_bytes);
#pragma unroll
                                for (int u = 0; u < REDUCE_UNROLL; u++)
                                        if (i + u * 32 < n16)
                                                add_bf16x8(acc[u], __ldcg(row + i + u * 32));
                        }
#pragma unroll
                        for (int u = 0; u < REDUCE_UNROLL; u++)
                                if (i + u * 32 < n16)
                                        out[(size_t)t * n16 + i + u * 32] = pack_bf16x8(acc[u]);
                }
                if (out_weights && lane < K) {
                        float w = 0.0f;
                        for (uint32_t m = mask; m; m &= m - 1) {
                                int r = __ffs(m) - 1;
                                w += __ldcg(wslots + ((size_t)r * ctx.max_tokens + t) * ctx.max_topk + lane);
                        }
                        out_weights[(size_t)t * K + lane] = w;
                }
        }
}

extern "C" int moeep_launch_combine(const struct moeep_ctx *ctx, const void *x, const float *topk_weights,
                                    int num_topk, const struct moeep_route *route, void *out, float *out_weights,
                                    cudaStream_t stream) {
        combine_kernel<<<ctx->num_sms, COMBINE_THREADS, 0, stream>>>(*ctx, (const int4 *)x, topk_weights, num_topk,
                                                                    *route, (int4 *)out, out_weights);
        MOEEP_CUDA_LAUNCH_CHECK();
        return 0;
}
