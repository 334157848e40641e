/* The relays of the low-latency mode with ranks at other daemons
 * (ctx->px.remote; ll.cuh says what lies where): between the phases, they
 * place what remote ranks staged for us as their NVLink writes would have,
 * the pairs of a dispatch (ll_pairs_relay, which then does the receive
 * phase) and the rows of a combine (ll_rows_relay). */
#include "common/launch.cuh"
#include "ll/ll.cuh"
#include "ll/shrink.cuh"

/* Places the pairs remote sources staged for us (set b) at slots claimed
 * from our own counters, as their NVLink writes would have, then the last
 * block does the receive phase. */
__global__ void __launch_bounds__(LL_THREADS, 1) ll_pairs_relay(struct moeep_ctx ctx, int b, int S, int *stats) {
        struct moeep_ll_sync *my = ll_sync_of(ctx, ctx.rank);
        const int lane = threadIdx.x % 32, H = ctx.hidden, nscales = H / MOEEP_SCALE_BLOCK, R = ctx.ranks;
        const int warps = gridDim.x * LL_WARPS, gwarp = ll_warp_index(), epr = ctx.num_experts / R;
        const size_t slots = (size_t)S;
        const uint64_t seq = *ll_seq_of(ctx, false, b);
        char *own = ctx.peers[ctx.rank];

        /* Remote sources' pairs go after every local source's, one run of
         * slots per source, in rank order: each starts after the local
         * sources' counts (their table rows) and the earlier remote
         * sources' (the counts ahead of their staged pairs). */
        __shared__ int s_base[MOEEP_KERNEL_MAX_EXPERTS];
        /* Elastic: block 0 decides whose counts the layout is after (cv)
         * and which remote sources' pairs are placed (ll/shrink.cuh); the
         * others take its decision. */
        __shared__ uint32_t s_dec;
        uint32_t cv = ~0u, remote_in = ~0u;
        if (!ctx.shrink) {
                if (threadIdx.x < R && !px_remote(ctx, threadIdx.x))
                        wait_flag(ctx, &my->count_flag[b][threadIdx.x], seq, threadIdx.x);
        } else if (blockIdx.x == 0) {
                const uint32_t send_dec = ll_decision_of(ctx, &ctx.state->ll_send_view[b], seq);
                const uint32_t c = ll_decide_cv(ctx, b, seq, send_dec), skip = LL_DEC_SKIP(send_dec);
                if (threadIdx.x == 0)
                        s_dec = c;
                __syncthreads();
                /* twice the timeout: the sender may have waited one for counts */
                if (threadIdx.x < R && px_remote(ctx, threadIdx.x) && !(skip >> threadIdx.x & 1) &&
                    !ll_masked(ctx, threadIdx.x) &&
                    wait_peer(ctx, &ctx.px.counters[MOEEP_PX_COUNTER_LL_DISPATCH(b, threadIdx.x)], ctx.px.epoch + seq,
                              threadIdx.x, 2 * ctx.shrink_timeout_ns))
                        atomicOr(&s_dec, 1u << (8 + threadIdx.x));
                __syncthreads();
                if (threadIdx.x == 0)
                        publish_decision(&ctx.state->ll_recv_view[b], seq, s_dec);
        } else if (threadIdx.x == 0) {
                s_dec = wait_decision(ctx, &ctx.state->ll_recv_view[b], seq);
        }
        __syncthreads();
        if (ctx.shrink) {
                cv = LL_DEC_CV(s_dec);
                remote_in = LL_DEC_REMOTE(s_dec);
        }
        for (int le = threadIdx.x; le < epr; le += blockDim.x) {
                int local = 0;
                for (int r = 0; r < R; r++)
                        if (!px_remote(ctx, r) && (cv >> r & 1))
                                local += *(volatile int32_t *)&my->table[b][r][ctx.rank * epr + le];
                s_base[le] = local;
        }
        __syncthreads();

        for (int s = 0; s < ctx.ranks; s++) {
                if (!px_remote(ctx, s) || !(remote_in >> s & 1))
                        continue;
                /* Elastic: block 0 saw its signal already. */
                const struct moeep_px_seg *h =
                        ctx.shrink ? (const struct moeep_px_seg *)px_recv_seg(ctx, ctx.px.ll_dispatch[b],
                                                                              ctx.px.ll_dispatch_seg, s)
                                   : px_block_wait(ctx, ctx.px.ll_dispatch[b], ctx.px.ll_dispatch_seg,
                                                   MOEEP_PX_COUNTER_LL_DISPATCH(b, s), ctx.px.epoch + seq, s);
                if (!h)
                        break;
                const int32_t *counts = (const int32_t *)((const char *)h + MOEEP_PX_SEG_HDR);
                const uint32_t n = min(__ldcv((const int *)&h->count), (int)ctx.px.ll_slots);
                const size_t xrow = (size_t)__ldcv((const int *)&h->row_bytes), pair_bytes = px_pair_bytes(xrow, H);
                const bool fp8 = xrow == (size_t)H;
                for (uint32_t q = gwarp; q < n; q += warps) {
                        const char *pair = (const char *)h + MOEEP_PX_SEG_HDR + MOEEP_PX_LL_COUNTS + q * pair_bytes;
                        const float *sc = (const float *)(pair + xrow);
                        const int32_t *info = (const int32_t *)(sc + (fp8 ? nscales : 0));
                        const int le = __ldcv(info), src_info = __ldcv(info + 1);
                        if (le < 0 || le >= epr)
                                continue; /* cannot come from our kernels */
                        uint32_t pos = 0;
                        if (lane == 0) /* table[b][s] of a remote s: the pairs placed so far, then its count */
                                pos = (uint32_t)s_base[le] + atomicAdd(&my->table[b][s][ctx.rank * epr + le], 1);
                        pos = __shfl_sync(0xffffffffu, pos, 0);
                        if ((size_t)pos >= slots) {
                                if (lane == 0)
                                        record_error(ctx, MOEEP_KERR_OVERFLOW, ctx.rank);
                                continue;
                        }
                        const size_t slot = (size_t)le * slots + pos;
                        px_copy((int4 *)(own + ctx.ll.x[b] + slot * xrow), (const int4 *)pair, xrow);
                        if (fp8)
                                for (int j = lane; j < nscales; j += 32)
                                        ((float *)(own + ctx.ll.scales[b]))[((size_t)le * nscales + j) * slots + pos] =
                                                __ldcv(sc + j);
                        if (lane == 0) {
                                const int src_rank = moeep_px_src_rank(src_info), k = moeep_px_src_k(src_info);
                                ((int32_t *)(own + ctx.ll.src[b]))[slot] = moeep_px_src_token(src_info);
                                ((int32_t *)(own + ctx.ll.kinfo[b]))[slot] = moeep_ll_kinfo_pack(src_rank, k);
                        }
                }
                __syncthreads(); /* s_base is read above by every warp of the block */
                for (int le = threadIdx.x; le < epr; le += blockDim.x)
                        s_base[le] += __ldcv(counts + le);
                __syncthreads();
        }
        if (!last_block_done(ctx))
                return;
        if (ctx.shrink)
                ll_recv_shrink(ctx, b, seq, stats, slots, ll_decision_of(ctx, &ctx.state->ll_send_view[b], seq), true,
                               false);
        else
                ll_recv_counts(ctx, b, seq, stats);
}

/* Places the expert outputs remote ranks staged for our tokens (set b)
 * into our combine rows; the receive phase of combine follows. */
__global__ void __launch_bounds__(LL_THREADS, 1) ll_rows_relay(struct moeep_ctx ctx, int b) {
        const int H = ctx.hidden;
        const int warps = gridDim.x * LL_WARPS, gwarp = ll_warp_index();
        const uint64_t seq = *ll_seq_of(ctx, true, b);
        char *comb = ctx.peers[ctx.rank] + ctx.ll.comb[b];
        /* Elastic: block 0 decides which remote sources' rows are placed,
         * for every block and for the receive (state->ll_comb_view). */
        __shared__ uint32_t s_in;
        uint32_t remote_in = ~0u;
        if (ctx.shrink) {
                if (blockIdx.x == 0) {
                        if (threadIdx.x == 0)
                                s_in = 0;
                        __syncthreads();
                        const int r = threadIdx.x;
                        if (r < ctx.ranks && px_remote(ctx, r) && !(ll_skip_now(ctx) >> r & 1) &&
                            wait_peer(ctx, &ctx.px.counters[MOEEP_PX_COUNTER_LL_COMBINE(b, r)], ctx.px.epoch + seq, r,
                                      2 * ctx.shrink_timeout_ns))
                                atomicOr(&s_in, 1u << r);
                        __syncthreads();
                        if (threadIdx.x == 0)
                                publish_decision(&ctx.state->ll_comb_view[b], seq, s_in << 8);
                } else if (threadIdx.x == 0) {
                        s_in = LL_DEC_REMOTE(wait_decision(ctx, &ctx.state->ll_comb_view[b], seq));
                }
                __syncthreads();
                remote_in = s_in;
        }

        for (int s = 0; s < ctx.ranks; s++) {
                if (!px_remote(ctx, s) || !(remote_in >> s & 1))
                        continue;
                const struct moeep_px_seg *h =
                        ctx.shrink ? (const struct moeep_px_seg *)px_recv_seg(ctx, ctx.px.ll_combine[b],
                                                                              ctx.px.ll_combine_seg, s)
                                   : px_block_wait(ctx, ctx.px.ll_combine[b], ctx.px.ll_combine_seg,
                                                   MOEEP_PX_COUNTER_LL_COMBINE(b, s), ctx.px.epoch + seq, s);
                if (!h)
                        break;
                const uint32_t n = min(__ldcv((const int *)&h->count), (int)ctx.px.ll_slots);
                for (uint32_t q = gwarp; q < n; q += warps) {
                        const char *row = (const char *)h + MOEEP_PX_SEG_HDR + q * ctx.px.ll_row;
                        const int t = __ldcv((const int *)(row + (size_t)H * 2));
                        const int k = __ldcv((const int *)(row + (size_t)H * 2) + 1);
                        if (t < 0 || t >= ctx.ll.max_tokens || k < 0 || k >= ctx.max_topk)
                                continue; /* cannot come from our kernels */
                        px_copy((int4 *)(comb + ((size_t)t * ctx.max_topk + k) * (size_t)H * 2), (const int4 *)row,
                                (size_t)H * 2);
                }
        }
}

extern "C" int moeep_launch_ll_dispatch_relay(const struct moeep_ctx *ctx, int set, int slots, int *stats,
                                              cudaStream_t stream) {
        MOEEP_CUDA_LAUNCH_BEGIN();
        coop_note(stream);
        ll_pairs_relay<<<ctx->ll_num_sms, LL_THREADS, 0, stream>>>(*ctx, set, slots, stats);
        MOEEP_CUDA_LAUNCH_CHECK();
        return 0;
}

extern "C" int moeep_launch_ll_combine_relay(const struct moeep_ctx *ctx, int set, cudaStream_t stream) {
        MOEEP_CUDA_LAUNCH_BEGIN();
        coop_note(stream);
        ll_rows_relay<<<ctx->ll_num_sms, LL_THREADS, 0, stream>>>(*ctx, set);
        MOEEP_CUDA_LAUNCH_CHECK();
        return 0;
}
