/* Normal-mode combine: every rank sends each row it received back to the
 * row's source rank, into the slot (our rank, source token) of the source's
 * combine area, and counts it on the source's arrival counter of that
 * token's chunk; meanwhile every rank reduces its own tokens chunk by chunk
 * as their rows arrive, so the sum overlaps the transfer.
 *
 * Roles inside each block (one block per SM, all resident):
 *   warps 0..SEND_WARPS-1   send: claim rows source by source (each warp
 *                           starts at another source so that every peer's
 *                           ingress is busy at once), copy, count;
 *   warps SEND_WARPS..30    reduce consumers: sum the staged rows of a
 *                           (token, 2 KiB slice) from shared memory, write out;
 *   warp 31                 reduce producer: waits for a chunk's counter and
 *                           bulk-copies (TMA) the slices of its rows into a
 *                           ring of shared-memory stages.
 * Buffers: x (the caller's expert outputs) is read once; comb slots
 * (peers[s] + comb_x) are written only by their contributing rank and read
 * only by their owner after the chunk counter; out is written once. */
#include <cuda_bf16.h>

#include "kernels.h"
#include "ptx.cuh"

enum {
        COMBINE_THREADS = 1024,
        SEND_WARPS = 27,
        CONSUMER_WARPS = 4,
        PRODUCER_WARP = 31,
        SLICE_BYTES = CONSUMER_WARPS * 32 * 16, /* one int4 per consumer thread */
        MAX_STAGES = 16,
        STAGE_SMEM = 128 * 1024,               /* ring of stages, each ranks x SLICE_BYTES */
        CLAIM_ROWS = 4,                        /* rows a send warp claims at once */
};

struct stage_info {
        int token;
        int slice;
        int nrows;
        int bytes;
};

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

/* Send role: rows back to their sources. */
__device__ __forceinline__ void combine_send(const struct moeep_ctx &ctx, const int4 *x, const float *weights, int K,
                                             const struct moeep_route &route, const int *s_prefix) {
        const int lane = threadIdx.x % 32, R = ctx.ranks, me = ctx.rank;
        const int sw = blockIdx.x * SEND_WARPS + threadIdx.x / 32;
        const size_t row_bytes = (size_t)ctx.hidden * 2;
        const int n16 = (int)(row_bytes / 16);

        for (int k = 0; k < R; k++) {
                const int s = (me + sw + k) % R;
                const int count = s_prefix[s + 1] - s_prefix[s];
                for (;;) {
                        int base = 0;
                        if (lane == 0)
                                base = (int)atomicAdd(&ctx.state->claim[s], (unsigned)CLAIM_ROWS);
                        base = __shfl_sync(0xffffffffu, base, 0);
                        if (base >= count)
                                break;
                        for (int q = base; q < min(base + CLAIM_ROWS, count); q++) {
                                const int p = s_prefix[s] + q;
                                const int t = route.recv_src[p] & 0xffffff;
                                const size_t slot = (size_t)me * ctx.max_tokens + t;
                                int4 *dst = (int4 *)(ctx.peers[s] + ctx.layout.comb_x + slot * row_bytes);
                                const int4 *src = x + (size_t)p * n16;

                                for (int i = lane; i < n16; i += 32 * 4) {
                                        int4 v[4];
#pragma unroll
                                        for (int u = 0; u < 4; u++)
                                                if (i + u * 32 < n16)
                                                        v[u] = ld_nc_v4(src + i + u * 32);
#pragma unroll
                                        for (int u = 0; u < 4; u++)
                                                if (i + u * 32 < n16)
                                                        st_na_v4(dst + i + u * 32, v[u]);
                                }
                                if (weights && lane < K)
                                        ((float *)(ctx.peers[s] + ctx.layout.comb_weights))[slot * ctx.max_topk + lane] =
                                                weights[(size_t)p * K + lane];
                                /* The row (all lanes' stores, ordered by the warp
                                 * barrier) is visible before the count. */
                                __syncwarp();
                                if (lane == 0)
                                        red_release_sys_add(&sync_of(ctx, s)->comb_chunk[t / MOEEP_COMBINE_CHUNK], 1);
                        }
                }
        }
}

/* Tokens [lo, hi) of this block: whole chunks, so that exactly one block
 * waits for (and resets) each chunk counter. */
__device__ __forceinline__ void block_tokens(int num_tokens, int *lo, int *hi) {
        const int chunks = (num_tokens + MOEEP_COMBINE_CHUNK - 1) / MOEEP_COMBINE_CHUNK;
        const int per = (chunks + gridDim.x - 1) / gridDim.x;
        *lo = min(num_tokens, (int)blockIdx.x * per * MOEEP_COMBINE_CHUNK);
        *hi = min(num_tokens, ((int)blockIdx.x + 1) * per * MOEEP_COMBINE_CHUNK);
}

/* Producer role (warp 31): the whole warp reads the chunk's routing, lane 0
 * waits for the chunk's rows and issues the bulk copies. */
__device__ __forceinline__ void combine_produce(const struct moeep_ctx &ctx, const struct moeep_route &route,
                                                char *stages, uint64_t *full, uint64_t *empty,
                                                struct stage_info *info, int nstages, size_t stage_bytes) {
        const int lane = threadIdx.x % 32, R = ctx.ranks;
        const int row_bytes = ctx.hidden * 2, slices = (row_bytes + SLICE_BYTES - 1) / SLICE_BYTES;
        const char *slots = ctx.peers[ctx.rank] + ctx.layout.comb_x;
        int lo, hi, stage = 0;
        uint32_t phase = 0;
        bool ok = true;

        block_tokens(route.num_tokens, &lo, &hi);
        for (int c0 = lo; c0 < hi; c0 += MOEEP_COMBINE_CHUNK) {
                const int t = c0 + lane, c = c0 / MOEEP_COMBINE_CHUNK;
                uint32_t mask = 0;
                if (t < hi)
                        for (int r = 0; r < R; r++)
                                mask |= (route.send_pos[(size_t)t * R + r] >= 0 ? 1u : 0u) << r;
                if (lane == 0) {
                        uint32_t *counter = &sync_of(ctx, ctx.rank)->comb_chunk[c];
                        const uint32_t want = (uint32_t)route.chunk_expect[c];
                        const uint64_t start = globaltimer_ns();
                        while (ok && ld_acquire_sys_u32(counter) < want) {
                                if (ctx.abort_word && ld_volatile_u32(ctx.abort_word)) {
                                        record_error(ctx, MOEEP_KERR_ABORT, -1);
                                        ok = false;
                                } else if (*(volatile uint32_t *)&ctx.state->error ||
                                           globaltimer_ns() - start > ctx.timeout_ns) {
                                        record_error(ctx, MOEEP_KERR_TIMEOUT, -1);
                                        ok = false;
                                }
                        }
                        /* Every row of this round arrived: no more adds come
                         * until our next combine, which starts after a barrier. */
                        *counter = 0;
                        fence_proxy_async_global();
                }
                for (int i = 0; i < MOEEP_COMBINE_CHUNK && c0 + i < hi; i++) {
                        const uint32_t m = __shfl_sync(0xffffffffu, mask, i);
                        if (lane != 0)
                                continue;
                        const int tok = c0 + i, n = ok ? __popc(m) : 0;
                        for (int j = 0; j < slices; j++) {
                                const int bytes = min(SLICE_BYTES, row_bytes - j * SLICE_BYTES);
                                mbar_wait(&empty[stage], phase ^ 1);
                                info[stage] = (struct stage_info){ tok, j, n, bytes };
                                if (n == 0) {
                                        mbar_arrive(&full[stage]);
                                } else {
                                        int k = 0;
                                        mbar_arrive_expect_tx(&full[stage], (uint32_t)(n * bytes));
                                        for (uint32_t mm = m; mm; mm &= mm - 1, k++) {
                                                const int r = __ffs(mm) - 1;
                                                const char *src = slots + ((size_t)r * ctx.max_tokens + tok) * row_bytes +
                                                                  (size_t)j * SLICE_BYTES;
                                                tma_load_1d(stages + stage * stage_bytes + (size_t)k * SLICE_BYTES, src,
                                                            (uint32_t)bytes, &full[stage]);
                                        }
                                }
                                if (++stage == nstages) {
                                        stage = 0;
                                        phase ^= 1;
                                }
                        }
                }
                __syncwarp();
        }
}

/* Consumer role: sums each staged (token, slice) and writes it out; the
 * weights of a token are summed with its first slice. */
__device__ __forceinline__ void combine_consume(const struct moeep_ctx &ctx, const struct moeep_route &route,
                                                const char *stages, uint64_t *full, uint64_t *empty,
                                                const struct stage_info *info, int nstages, size_t stage_bytes,
                                                int4 *out, float *out_weights, int K) {
        const int ct = threadIdx.x - SEND_WARPS * 32, lane = ct % 32, R = ctx.ranks;
        const int row_bytes = ctx.hidden * 2, slices = (row_bytes + SLICE_BYTES - 1) / SLICE_BYTES;
        const float *wslots = (const float *)(ctx.peers[ctx.rank] + ctx.layout.comb_weights);
        int lo, hi, stage = 0;
        uint32_t phase = 0;

        block_tokens(route.num_tokens, &lo, &hi);
        for (int t = lo; t < hi; t++)
                for (int j = 0; j < slices; j++) {
                        mbar_wait(&full[stage], phase);
                        const struct stage_info si = info[stage];
                        if (ct * 16 < si.bytes) {
                                float acc[8] = {};
                                for (int k = 0; k < si.nrows; k++)
                                        add_bf16x8(acc, *(const int4 *)(stages + stage * stage_bytes +
                                                                        (size_t)k * SLICE_BYTES + ct * 16));
                                out[((size_t)t * row_bytes + (size_t)j * SLICE_BYTES) / 16 + ct] = pack_bf16x8(acc);
                        }
                        if (j == 0 && out_weights && ct < K) {
                                float w = 0.0f;
                                if (si.nrows > 0)
                                        for (int r = 0; r < R; r++)
                                                if (route.send_pos[(size_t)t * R + r] >= 0)
                                                        w += __ldcg(wslots + ((size_t)r * ctx.max_tokens + t) * ctx.max_topk + ct);
                                out_weights[(size_t)t * K + ct] = w;
                        }
                        __syncwarp();
                        if (lane == 0)
                                mbar_arrive(&empty[stage]);
                        if (++stage == nstages) {
                                stage = 0;
                                phase ^= 1;
                        }
                }
}

__global__ void __launch_bounds__(COMBINE_THREADS, 1)
        combine_kernel(struct moeep_ctx ctx, const int4 *x, const float *weights, int num_topk,
                       struct moeep_route route, int4 *out, float *out_weights, int nstages) {
        extern __shared__ __align__(1024) char stages[];
        __shared__ uint64_t full[MAX_STAGES], empty[MAX_STAGES];
        __shared__ struct stage_info info[MAX_STAGES];
        __shared__ int s_prefix[MOEEP_KERNEL_MAX_RANKS + 1];
        const int tid = threadIdx.x, warp = tid / 32;
        const size_t stage_bytes = (size_t)ctx.ranks * SLICE_BYTES;

        if (tid <= ctx.ranks)
                s_prefix[tid] = route.rank_prefix[tid];
        if (tid < nstages) {
                mbar_init(&full[tid], 1);
                mbar_init(&empty[tid], CONSUMER_WARPS);
        }
        fence_mbar_init();
        __syncthreads();

        if (warp < SEND_WARPS) {
                if (!*(volatile uint32_t *)&ctx.state->error)
                        combine_send(ctx, x, weights, num_topk, route, s_prefix);
                /* Last sender block resets the claim counters for the next call. */
                asm volatile("bar.sync 1, %0;" ::"n"(SEND_WARPS * 32));
                if (tid == 0 && atomicAdd(&ctx.state->blocks_done, 1u) == gridDim.x - 1) {
                        for (int s = 0; s < ctx.ranks; s++)
                                ctx.state->claim[s] = 0;
                        ctx.state->blocks_done = 0;
                }
        } else if (warp == PRODUCER_WARP) {
                combine_produce(ctx, route, stages, full, empty, info, nstages, stage_bytes);
        } else {
                combine_consume(ctx, route, stages, full, empty, info, nstages, stage_bytes, out, out_weights,
                                num_topk);
        }
}

extern "C" int moeep_launch_combine(const struct moeep_ctx *ctx, const void *x, const float *topk_weights,
                                    int num_topk, const struct moeep_route *route, void *out, float *out_weights,
                                    cudaStream_t stream) {
        const size_t stage_bytes = (size_t)ctx->ranks * SLICE_BYTES;
        const int nstages = (int)min((size_t)MAX_STAGES, STAGE_SMEM / stage_bytes);
        cudaError_t e;

        MOEEP_CUDA_LAUNCH_BEGIN();
        e = cudaFuncSetAttribute(combine_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, STAGE_SMEM);
        if (e != cudaSuccess)
                return (int)e;
        combine_kernel<<<ctx->num_sms, COMBINE_THREADS, nstages * stage_bytes, stream>>>(
                *ctx, (const int4 *)x, topk_weights, num_topk, *route, (int4 *)out, out_weights, nstages);
        MOEEP_CUDA_LAUNCH_CHECK();
        return 0;
}
