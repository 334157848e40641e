/* Notify: the barrier that opens every dispatch and combine, and for a
 * dispatch with fresh routing the count exchange that tells every rank where
 * its rows land in every peer's receive area. One block, or for a large
 * routing call one exchanging and several walking the tokens
 * (notify_blocks). */
#include "common/launch.cuh"
#include "common/ptx.cuh"
#include "common/px.cuh"
#include "common/wait.cuh"
#include "kernels.h"

static_assert(32 % MOEEP_COMBINE_CHUNK == 0 && 32 % MOEEP_COMBINE_CHUNK_MANY == 0,
              "notify counts whole combine chunks per warp round of 32 tokens");

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
 * the wait each peer's buffers may be overwritten. With the flag goes the
 * receive area we picked for this call (ctx.recv_area), written by the
 * same thread before its release; after the wait (an acquire by the same
 * thread) each peer's pick lands in state->dst_area, where the dispatch
 * that follows finds it. The areas are double-buffered by seq parity: a
 * peer writes parity p again only at seq + 2, after our flag of seq + 1,
 * which we raise after reading. */
/* Ranks at other daemons get the barrier as a signal through the proxy,
 * with our counts segment for them when `counts` (staged in our segment
 * before, fenced); their rows for us are placed by our relay, into our own
 * area, so they need not know it. */
__device__ __forceinline__ void barrier_all(const struct moeep_ctx &ctx, uint64_t seq, bool counts) {
        __shared__ uint32_t s_slots[MOEEP_KERNEL_MAX_RANKS];
        const int tid = threadIdx.x, R = ctx.ranks, par = (int)(seq & 1);

        if (tid < R && !px_remote(ctx, tid)) {
                sync_of(ctx, tid)->recv_area[par][ctx.rank] = ctx.recv_area;
                st_release_sys(&sync_of(ctx, tid)->barrier_flag[ctx.rank], seq);
        }
        if (ctx.px.remote) {
                if (tid < R)
                        s_slots[tid] = counts ? 1 : 0;
                __syncthreads();
                if (tid == 0)
                        px_ship(ctx, ctx.px.nm_sync, ctx.px.nm_sync_seg, s_slots,
                                (size_t)(R + ctx.num_experts / R + 1) * sizeof(int32_t), MOEEP_PX_COUNTER_NM_SYNC(0),
                                px_seg_info(ctx.px.epoch + seq, 0, 0, 0));
        }
        if (tid < R && !px_remote(ctx, tid)) {
                wait_flag(ctx, &sync_of(ctx, ctx.rank)->barrier_flag[tid], seq, tid);
                ctx.state->dst_area[tid] = *(const volatile int32_t *)&sync_of(ctx, ctx.rank)->recv_area[par][tid];
        }
        if (tid < R && px_remote(ctx, tid)) {
                px_wait(ctx, MOEEP_PX_COUNTER_NM_SYNC(tid), ctx.px.epoch + seq, tid);
                ctx.state->dst_area[tid] = 0;
        }
        __syncthreads();
}

/* Blocks of a notify that routes: block 0 does the count exchange, blocks
 * 1.. walk the tokens (block 0 too when it is the only one). A call of
 * NOTIFY_BLOCK_TOKENS tokens or fewer is one block, larger ones one more
 * block per NOTIFY_BLOCK_TOKENS, up to MOEEP_NOTIFY_MAX_BLOCKS: one SM walking
 * 4096 tokens took 11 of notify's 19 us (2 x H200). */
static int notify_blocks(int num_tokens) {
        const int walkers = (num_tokens + NOTIFY_BLOCK_TOKENS - 1) / NOTIFY_BLOCK_TOKENS;
        if (walkers <= 1)
                return 1;
        return min(1 + walkers, MOEEP_NOTIFY_MAX_BLOCKS);
}

/* Every block of the grid waits here for all the others (the launch is
 * cooperative, so all are resident, and none waits for anything before it
 * arrives: the spin is bounded by the slowest block's passes); their
 * writes before it are visible after it. */
__device__ __forceinline__ void grid_barrier(const struct moeep_ctx &ctx) {
        __syncthreads();
        if (threadIdx.x == 0) {
                volatile uint32_t *gen = &ctx.state->notify_gen;
                const uint32_t g = *gen;
                __threadfence();
                if (atomicAdd(&ctx.state->notify_arrived, 1u) == gridDim.x - 1) {
                        ctx.state->notify_arrived = 0;
                        __threadfence();
                        *gen = g + 1;
                } else {
                        while (*gen == g)
                                ;
                }
                __threadfence();
        }
        __syncthreads();
}

template <typename Idx>
__global__ void __launch_bounds__(NOTIFY_THREADS, 1)
        notify_kernel(struct moeep_ctx ctx, const uint8_t *in_rank, const Idx *topk_idx, int num_tokens, int num_topk,
                      const int *tokens_per_expert, int total_tokens, int alignment, struct moeep_route route,
                      int with_route, struct moeep_notify_host *host_out) {
        /* The data kernel after us (a programmatic dependent) may take its SMs
         * now and wait there for our end. */
        grid_dep_launch();
        __shared__ int s_warp_sum[NOTIFY_WARPS][MOEEP_KERNEL_MAX_RANKS];
        __shared__ int s_total[MOEEP_KERNEL_MAX_RANKS]; /* this block's tokens per rank, then every block's */
        __shared__ int s_base[MOEEP_KERNEL_MAX_RANKS];  /* rows of the blocks before ours, per rank */
        __shared__ int s_hist[MOEEP_KERNEL_MAX_EXPERTS];
        const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
        const int R = ctx.ranks, me = ctx.rank, E = ctx.num_experts, epr = E / R;
        const uint64_t seq = ctx.state->seq + 1;
        const int par = (int)(seq & 1);
        const int G = gridDim.x, blk = blockIdx.x;
        uint64_t *trace = ctx.trace && with_route && blk == 0 ? ctx.trace + MOEEP_TRACE_NOTIFY : NULL;
        trace_stamp(trace, 0);
        if (!with_route) {
                barrier_all(ctx, seq, false);
                if (tid == 0)
                        ctx.state->seq = seq;
                return;
        }

        /* The walking blocks share the tokens out in contiguous runs, one
         * per warp, each a multiple of the combine chunk (32), walked 32
         * tokens at a time, lane i on token t0 + i: loads and stores of
         * neighbouring lanes touch neighbouring tokens, and a warp's run is
         * one scan step. */
        const int walkers = G > 1 ? G - 1 : 1, walker = G > 1 ? blk - 1 : 0;
        const int run = (num_tokens + walkers * NOTIFY_WARPS * 32 - 1) / (walkers * NOTIFY_WARPS * 32) * 32;
        const int wlo = walker < 0 ? num_tokens : min((walker * NOTIFY_WARPS + warp) * run, num_tokens);
        const int whi = min(wlo + run, num_tokens);
        const uint32_t lanes_below = (1u << lane) - 1;

        for (int i = tid; i < E; i += NOTIFY_THREADS)
                s_hist[i] = 0;
        {
                int cnt[MOEEP_KERNEL_MAX_RANKS] = {};
                for (int t0 = wlo; t0 < whi; t0 += 32) {
                        const uint32_t m =
                                t0 + lane < whi ? token_mask(in_rank, topk_idx, t0 + lane, num_topk, R, epr) : 0;
#pragma unroll
                        for (int d = 0; d < MOEEP_KERNEL_MAX_RANKS; d++)
                                cnt[d] += __popc(__ballot_sync(0xffffffffu, (m >> d) & 1));
                }
                if (lane == 0)
#pragma unroll
                        for (int d = 0; d < MOEEP_KERNEL_MAX_RANKS; d++)
                                if (d < R)
                                        s_warp_sum[warp][d] = cnt[d];
        }
        __syncthreads();
        trace_stamp(trace, 1);
        if (tokens_per_expert) { /* the caller's counts (DeepEP takes them even when no top-k travels) */
                if (blk == 0)
                        for (int i = tid; i < E; i += NOTIFY_THREADS)
                                s_hist[i] = tokens_per_expert[i];
        } else if (topk_idx && walker >= 0) {
                /* The walkers share the ids out, NOTIFY_HIST_LOADS in flight
                 * per thread before their counts. */
                const int n = num_tokens * num_topk, step = walkers * NOTIFY_THREADS;
                for (int i0 = walker * NOTIFY_THREADS + tid; i0 < n; i0 += step * NOTIFY_HIST_LOADS) {
                        int64_t e[NOTIFY_HIST_LOADS];
#pragma unroll
                        for (int u = 0; u < NOTIFY_HIST_LOADS; u++)
                                e[u] = i0 + u * step < n ? (int64_t)topk_idx[i0 + u * step] : -1;
#pragma unroll
                        for (int u = 0; u < NOTIFY_HIST_LOADS; u++)
                                if (e[u] >= 0 && e[u] < E)
                                        atomicAdd(&s_hist[e[u]], 1);
                }
        }

        /* Exclusive scan of the warps' counts by warp 0. */
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
        if (G > 1) { /* the blocks' counts meet in our state: block 0 sums them, the others take their bases */
                struct moeep_local_state *st = ctx.state;
                if (tid < R)
                        st->notify_total[blk][tid] = s_total[tid];
                for (int i = tid; i < E; i += NOTIFY_THREADS)
                        st->notify_hist[blk][i] = s_hist[i];
                grid_barrier(ctx);
                if (tid < R) {
                        int base = 0, sum = 0;
                        for (int k = 0; k < G; k++) {
                                const int c = __ldcg(&st->notify_total[k][tid]);
                                base += k < blk ? c : 0;
                                sum += c;
                        }
                        s_base[tid] = base;
                        s_total[tid] = sum;
                }
                if (blk == 0)
                        for (int i = tid; i < E; i += NOTIFY_THREADS) {
                                int c = 0;
                                for (int k = 0; k < G; k++)
                                        c += __ldcg(&st->notify_hist[k][i]);
                                s_hist[i] = c;
                        }
        } else if (tid < R) {
                s_base[tid] = 0;
        }
        __syncthreads();
        trace_stamp(trace, 2);

        /* Positions relative to the start of our rows at each destination
         * (the dispatch kernel adds dst_base), and the rows each chunk of our
         * tokens will get back in combine. Block 0 of several exchanges the
         * counts meanwhile (below), and walks no tokens. */
        {
                const int chunk = moeep_combine_chunk(R);
                int next[MOEEP_KERNEL_MAX_RANKS];
#pragma unroll
                for (int d = 0; d < MOEEP_KERNEL_MAX_RANKS; d++)
                        next[d] = d < R ? s_base[d] + s_warp_sum[warp][d] : 0;
                for (int t0 = wlo; t0 < whi; t0 += 32) {
                        const int t = t0 + lane;
                        const uint32_t m = t < whi ? token_mask(in_rank, topk_idx, t, num_topk, R, epr) : 0;
                        int pos[MOEEP_KERNEL_MAX_RANKS];
#pragma unroll
                        for (int d = 0; d < MOEEP_KERNEL_MAX_RANKS; d++) {
                                const uint32_t b = __ballot_sync(0xffffffffu, (m >> d) & 1);
                                pos[d] = (m >> d) & 1 ? next[d] + __popc(b & lanes_below) : -1;
                                next[d] += __popc(b);
                        }
                        int rows = __popc(m); /* summed over each chunk's lanes */
                        for (int o = chunk / 2; o > 0; o /= 2)
                                rows += __shfl_xor_sync(0xffffffffu, rows, o);
                        if (t >= whi)
                                continue;
                        if (lane % chunk == 0)
                                route.chunk_expect[t / chunk] = rows;
                        int32_t *row = route.send_pos + (size_t)t * R;
                        if (R == 4) {
                                *(int4 *)row = make_int4(pos[0], pos[1], pos[2], pos[3]);
                        } else if (R == 8) {
                                ((int4 *)row)[0] = make_int4(pos[0], pos[1], pos[2], pos[3]);
                                ((int4 *)row)[1] = make_int4(pos[4], pos[5], pos[6], pos[7]);
                        } else {
#pragma unroll
                                for (int d = 0; d < MOEEP_KERNEL_MAX_RANKS; d++)
                                        if (d < R)
                                                row[d] = pos[d];
                        }
                }
        }
        if (blk != 0)
                return;

        trace_stamp(trace, 3);
        /* All-gather of the rank counts (every rank needs the whole matrix to
         * find its base in each destination) and the per-expert counts to the
         * owners of the experts. */
        /* Ranks at other daemons get theirs in our counts segment for them:
         * our rank counts, then the counts of their experts. */
        for (int i = tid; i < R * R; i += NOTIFY_THREADS) {
                const int d = i / R;
                if (px_remote(ctx, d))
                        px_counts_out(ctx, d)[i % R] = s_total[i % R];
                else
                        sync_of(ctx, d)->rank_counts[par][me][i % R] = s_total[i % R];
        }
        for (int i = tid; i < E; i += NOTIFY_THREADS) {
                const int d = i / epr, c = topk_idx || tokens_per_expert ? s_hist[i] : 0;
                if (px_remote(ctx, d))
                        px_counts_out(ctx, d)[R + i % epr] = c;
                else
                        sync_of(ctx, d)->expert_counts[par][me][i % epr] = c;
        }
        if (tid < R) { /* our whole dispatch's size, for the number of rounds */
                if (px_remote(ctx, tid))
                        px_counts_out(ctx, tid)[R + epr] = total_tokens;
                else
                        sync_of(ctx, tid)->total_tokens[par][me] = total_tokens;
        }
        __threadfence_system();
        __syncthreads();
        barrier_all(ctx, seq, true);
        trace_stamp(trace, 4);

        struct moeep_sync *my = sync_of(ctx, me);
        /* The counts of ranks at other daemons, from their segments here. */
        for (int s = 0; s < R; s++) {
                if (!px_remote(ctx, s))
                        continue;
                const int32_t *c =
                        (const int32_t *)(px_recv_seg(ctx, ctx.px.nm_sync, ctx.px.nm_sync_seg, s) + MOEEP_PX_SEG_HDR);
                for (int i = tid; i <= R + epr; i += NOTIFY_THREADS) {
                        if (i < R)
                                my->rank_counts[par][s][i] = __ldcv(c + i);
                        else if (i < R + epr)
                                my->expert_counts[par][s][i - R] = __ldcv(c + i);
                        else
                                my->total_tokens[par][s] = __ldcv(c + i);
                }
        }
        __syncthreads();
        if (tid < R) {
                int base = 0;
                for (int s = 0; s < me; s++)
                        base += *(const volatile int32_t *)&my->rank_counts[par][s][tid];
                route.dst_base[tid] = base;
        }
        if (tid < R) { /* column tid of DeepEP's rank_prefix_matrix */
                int sum = 0;
                for (int s = 0; s < R; s++) {
                        sum += *(const volatile int32_t *)&my->rank_counts[par][s][tid];
                        route.rank_prefix_matrix[s * R + tid] = sum;
                }
        }
        if (tid == 0) {
                int sum = 0;
                for (int s = 0; s < R; s++) {
                        const int n = *(const volatile int32_t *)&my->rank_counts[par][s][me];
                        route.rank_prefix[s] = sum;
                        sum += n;
                        if (host_out)
                                host_out->recv_per_rank[s] = n;
                }
                route.rank_prefix[R] = sum;
                *route.num_recv = sum;
                int most = 0;
                for (int s = 0; s < R; s++)
                        most = max(most, *(const volatile int32_t *)&my->total_tokens[par][s]);
                if (host_out) {
                        host_out->num_recv = sum;
                        host_out->max_total_tokens = most;
                }
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
        trace_stamp(trace, 5);
        if (tid == 0) {
                ctx.state->seq = seq;
                if (host_out) {
                        host_out->error = *(volatile uint32_t *)&ctx.state->error;
                        host_out->error_rank = ctx.state->error_rank;
                }
        }
}

/* One launch of notify_kernel; without a route, the barrier alone. */
static int notify_launch(const struct moeep_ctx *ctx, const struct moeep_notify_launch *a,
                         const struct moeep_route *route, struct moeep_notify_host *host_out, cudaStream_t stream) {
        MOEEP_CUDA_LAUNCH_BEGIN();
        coop_note(stream); /* it waits for the other ranks */
        struct moeep_route none = {};
        const struct moeep_route &r = route ? *route : none;

        const int blocks = route ? notify_blocks(a->num_tokens) : 1;
        const cudaError_t e = with_index_type(a->idx_is_int64, [&](auto idx) {
                using Idx = decltype(idx);
                auto launch = [&](int g) {
                        return launch_kernel(notify_kernel<Idx>, (unsigned)g, NOTIFY_THREADS, 0, stream, g > 1, false,
                                             *ctx, a->is_token_in_rank, (const Idx *)a->topk_idx, a->num_tokens,
                                             a->num_topk, a->tokens_per_expert, a->total_tokens, a->alignment, r,
                                             (int)(route != NULL), host_out);
                };
                cudaError_t le = launch(blocks);
                /* Where the blocks cannot all be resident (a small partition
                 * of the GPU), one block walks every token. */
                if ((le == cudaErrorCooperativeLaunchTooLarge || le == cudaErrorNotSupported) && blocks > 1) {
                        (void)cudaGetLastError();
                        le = launch(1);
                }
                return le;
        });
        if (e != cudaSuccess)
                return (int)e;
        MOEEP_CUDA_LAUNCH_CHECK();
        return 0;
}

extern "C" int moeep_launch_barrier(const struct moeep_ctx *ctx, cudaStream_t stream) {
        struct moeep_notify_launch a = {};

        a.idx_is_int64 = 1; /* the instance every barrier runs */
        return notify_launch(ctx, &a, NULL, NULL, stream);
}

extern "C" int moeep_launch_notify(const struct moeep_ctx *ctx, const struct moeep_notify_launch *a,
                                   const struct moeep_route *route, struct moeep_notify_host *host_out,
                                   cudaStream_t stream) {
        return notify_launch(ctx, a, route, host_out, stream);
}
