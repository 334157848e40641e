/* Notify: the barrier that opens every dispatch and combine, and for a
 * dispatch with fresh routing the count exchange that tells every rank where
 * its rows land in every peer's receive area. One block. */
#include "kernels.h"
#include "ptx.cuh"

enum { NOTIFY_THREADS = 1024, NOTIFY_WARPS = NOTIFY_THREADS / 32 };

/* Bit d set when token t goes to rank d: from is_token_in_rank when given,
 * else from the token's top-k experts. */
template <typename Idx>
__device__ __forceinline__ uint32_t token_mask(const uint8_t *in_rank, const Idx *topk_idx, int t, int num_topk,
                                               int ranks, int experts_per_rank) {
        uint32_t mask = 0;

        if (in_rank) {
                for (int d = 0; d < ranks; d++)
                        mask |= (in_rank[(size_t)t * ranks + d] ? 1u : 0u) << d;
                return mask;
        }
        for (int k = 0; k < num_topk; k++) {
                int64_t e = (int64_t)topk_idx[(size_t)t * num_topk + k];

                if (e >= 0 && e < (int64_t)experts_per_rank * ranks)
                        mask |= 1u << (e / experts_per_rank);
        }
        return mask;
}

/* Every rank tells every peer it reached `seq` and waits for all of them.
 * The flag means "my stream finished everything before this call", so after
 * the wait each peer's buffers may be overwritten. */
__device__ __forceinline__ void barrier_all(const struct moeep_ctx &ctx, uint64_t seq) {
        int tid = threadIdx.x;

        if (tid < ctx.ranks)
                st_release_sys(&sync_of(ctx, tid)->barrier_flag[ctx.rank], seq);
        if (tid < ctx.ranks)
                wait_flag(ctx, &sync_of(ctx, ctx.rank)->barrier_flag[tid], seq, tid);
        __syncthreads();
}

template <typename Idx>
__global__ void __launch_bounds__(NOTIFY_THREADS, 1)
        notify_kernel(struct moeep_ctx ctx, const uint8_t *in_rank, const Idx *topk_idx, int num_tokens,
                      int num_topk, int alignment, struct moeep_route route, int with_route,
                      struct moeep_notify_host *host_out) {
        __shared__ int s_warp_sum[NOTIFY_WARPS][MOEEP_KERNEL_MAX_RANKS];
        __shared__ int s_total[MOEEP_KERNEL_MAX_RANKS];
        __shared__ int s_hist[MOEEP_KERNEL_MAX_EXPERTS];
        __shared__ int s_chunk[MOEEP_COMBINE_CHUNKS]; /* rows combine returns per chunk of MOEEP_COMBINE_CHUNK tokens */
        const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
        const int R = ctx.ranks, me = ctx.rank, E = ctx.num_experts, epr = E / R;
        const uint64_t seq = ctx.state->seq + 1;
        const int par = (int)(seq & 1);

        if (!with_route) {
                barrier_all(ctx, seq);
                if (tid == 0)
                        ctx.state->seq = seq;
                return;
        }

        /* Tokens are split into contiguous chunks, one per thread, so that a
         * scan over thread order is a scan over token order. */
        const int chunk = (num_tokens + NOTIFY_THREADS - 1) / NOTIFY_THREADS;
        const int lo = min(tid * chunk, num_tokens), hi = min(lo + chunk, num_tokens);
        int cnt[MOEEP_KERNEL_MAX_RANKS];

#pragma unroll
        for (int d = 0; d < MOEEP_KERNEL_MAX_RANKS; d++)
                cnt[d] = 0;
        for (int t = lo; t < hi; t++) {
                uint32_t m = token_mask(in_rank, topk_idx, t, num_topk, R, epr);
#pragma unroll
                for (int d = 0; d < MOEEP_KERNEL_MAX_RANKS; d++)
                        cnt[d] += (m >> d) & 1;
        }
        for (int i = tid; i < E; i += NOTIFY_THREADS)
                s_hist[i] = 0;
        for (int i = tid; i * MOEEP_COMBINE_CHUNK < num_tokens; i += NOTIFY_THREADS)
                s_chunk[i] = 0;
        __syncthreads();
        if (topk_idx)
                for (int i = tid; i < num_tokens * num_topk; i += NOTIFY_THREADS) {
                        int64_t e = (int64_t)topk_idx[i];
                        if (e >= 0 && e < E)
                                atomicAdd(&s_hist[e], 1);
                }

        /* Exclusive scan of cnt[d] over threads: warp scan, then a scan of the
         * warp sums by warp 0. */
        int incl[MOEEP_KERNEL_MAX_RANKS];
#pragma unroll
        for (int d = 0; d < MOEEP_KERNEL_MAX_RANKS; d++) {
                int v = cnt[d];
#pragma unroll
                for (int o = 1; o < 32; o *= 2) {
                        int n = __shfl_up_sync(0xffffffffu, v, o);
                        if (lane >= o)
                                v += n;
                }
                incl[d] = v;
                if (lane == 31 && d < R)
                        s_warp_sum[warp][d] = v;
        }
        __syncthreads();
        if (warp == 0) {
                for (int d = 0; d < R; d++) {
                        int v = s_warp_sum[lane][d], x = v;
#pragma unroll
                        for (int o = 1; o < 32; o *= 2) {
                                int n = __shfl_up_sync(0xffffffffu, x, o);
                                if (lane >= o)
                                        x += n;
                        }
                        s_warp_sum[lane][d] = x - v; /* exclusive prefix of warp sums */
                        if (lane == 31)
                                s_total[d] = x;
                }
        }
        __syncthreads();

        /* Positions relative to the start of our rows at each destination
         * (the dispatch kernel adds dst_base), and the rows each chunk of our
         * tokens will get back in combine. */
        {
                int next[MOEEP_KERNEL_MAX_RANKS];
#pragma unroll
                for (int d = 0; d < MOEEP_KERNEL_MAX_RANKS; d++)
                        next[d] = d < R ? s_warp_sum[warp][d] + incl[d] - cnt[d] : 0;
                for (int t = lo; t < hi; t++) {
                        uint32_t m = token_mask(in_rank, topk_idx, t, num_topk, R, epr);
                        for (int d = 0; d < R; d++)
                                route.send_pos[(size_t)t * R + d] = (m >> d) & 1 ? next[d]++ : -1;
                        atomicAdd(&s_chunk[t / MOEEP_COMBINE_CHUNK], __popc(m));
                }
        }

        /* All-gather of the rank counts (every rank needs the whole matrix to
         * find its base in each destination) and the per-expert counts to the
         * owners of the experts. */
        for (int i = tid; i < R * R; i += NOTIFY_THREADS)
                sync_of(ctx, i / R)->rank_counts[par][me][i % R] = s_total[i % R];
        for (int i = tid; i < E; i += NOTIFY_THREADS)
                sync_of(ctx, i / epr)->expert_counts[par][me][i % epr] = topk_idx ? s_hist[i] : 0;
        __threadfence_system();
        __syncthreads();
        barrier_all(ctx, seq);

        const struct moeep_sync *my = sync_of(ctx, me);
        if (tid < R) {
                int base = 0;
                for (int s = 0; s < me; s++)
                        base += *(const volatile int32_t *)&my->rank_counts[par][s][tid];
                route.dst_base[tid] = base;
        }
        if (tid == 0) {
                int sum = 0;
                for (int s = 0; s < R; s++) {
                        route.rank_prefix[s] = sum;
                        sum += *(const volatile int32_t *)&my->rank_counts[par][s][me];
                }
                route.rank_prefix[R] = sum;
                *route.num_recv = sum;
                if (host_out)
                        host_out->num_recv = sum;
        }
        for (int l = tid; l < epr; l += NOTIFY_THREADS) {
                int c = 0;
                for (int s = 0; s < R; s++)
                        c += *(const volatile int32_t *)&my->expert_counts[par][s][l];
                if (alignment > 1)
                        c = (c + alignment - 1) / alignment * alignment;
                route.expert_counts[l] = c;
                if (host_out)
                        host_out->expert_counts[l] = c;
        }
        for (int c = tid; c * MOEEP_COMBINE_CHUNK < num_tokens; c += NOTIFY_THREADS)
                route.chunk_expect[c] = s_chunk[c];
        if (tid == 0) {
                ctx.state->seq = seq;
                if (host_out) {
                        host_out->error = *(volatile uint32_t *)&ctx.state->error;
                        host_out->error_rank = ctx.state->error_rank;
                }
        }
}

extern "C" int moeep_launch_notify(const struct moeep_ctx *ctx, const uint8_t *is_token_in_rank,
                                   const void *topk_idx, int idx_is_int64, int num_tokens, int num_topk,
                                   int alignment, const struct moeep_route *route,
                                   struct moeep_notify_host *host_out, cudaStream_t stream) {
        MOEEP_CUDA_LAUNCH_BEGIN();
        struct moeep_route none = {};
        const struct moeep_route &r = route ? *route : none;

        if (idx_is_int64)
                notify_kernel<int64_t><<<1, NOTIFY_THREADS, 0, stream>>>(*ctx, is_token_in_rank,
                                                                        (const int64_t *)topk_idx, num_tokens,
                                                                        num_topk, alignment, r, route != NULL,
                                                                        host_out);
        else
                notify_kernel<int32_t><<<1, NOTIFY_THREADS, 0, stream>>>(*ctx, is_token_in_rank,
                                                                        (const int32_t *)topk_idx, num_tokens,
                                                                        num_topk, alignment, r, route != NULL,
                                                                        host_out);
        MOEEP_CUDA_LAUNCH_CHECK();
        return 0;
}
