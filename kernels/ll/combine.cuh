/* The combine phases of the low-latency kernels (ll.cu): expert outputs
 * back to their tokens' ranks (ll_combine_send) and the weighted sum there
 * (ll_combine_recv). Included by ll.cu after the helpers both modes share
 * (ll_warp_index, the buffer layout of ll.cu's top comment); not a header
 * of its own. */
#pragma once

/* Loads one chunk of a row for the combine send: int4 base + u * 32 + lane
 * of the row into v[u] (what is past the row stays unset). */
__device__ __forceinline__ void ll_load_chunk(const int4 *row, int base, int n16, int4 v[LL_COMBINE_SEND_UNROLL]) {
        const int lane = threadIdx.x % 32;
#pragma unroll
        for (int u = 0; u < LL_COMBINE_SEND_UNROLL; u++)
                if (base + u * 32 + lane < n16)
                        v[u] = ld_nc_v4(row + base + u * 32 + lane);
}

/* Expert outputs back to the tokens' ranks: slot (le, pos) of set b goes to
 * row (token, k) of its source's combine area; then the block arrives at
 * every rank (ll_arrive). `seq` is the sequence number of this combine on
 * set b (the block's copy + 1, which the kernel stores at its end). With
 * `local`, the slots of our own tokens stay: the receive phase of this
 * launch reads them in place (ll_combine_recv). */
__device__ __forceinline__ void ll_combine_send(const struct moeep_ctx &ctx, const int4 *y, int b, int S, uint64_t seq,
                                                bool local) {
        const struct moeep_ll_sync *my = ll_sync_of(ctx, ctx.rank);
        const int lane = threadIdx.x % 32, R = ctx.ranks, me = ctx.rank, H = ctx.hidden, epr = ctx.num_experts / R;
        const int warps = gridDim.x * LL_WARPS, gwarp = ll_warp_index();
        const size_t slots = (size_t)S;
        const int32_t *src = (const int32_t *)(ctx.peers[me] + ctx.ll.src[b]);
        const int32_t *kinfo = (const int32_t *)(ctx.peers[me] + ctx.ll.kinfo[b]);
        const int64_t *range = (const int64_t *)(ctx.peers[me] + ctx.ll.range[b]);
        __shared__ uint32_t s_skip; /* elastic: the ranks this call leaves out */
        if (threadIdx.x == 0)
                s_skip = ctx.shrink ? ll_skip_now(ctx) : 0;

        /* The slots in use are the first count[le] of each expert, less our
         * own run with `local` (our range there, which the dispatch receive
         * published); warps walk them as one list (prefix over the experts
         * in shared memory). The scan is one expert per thread, in one
         * round of loads: a loop of one thread over the experts cost a
         * chain of L2 round trips (about 18 at 288 experts) before any row
         * moved. */
        __shared__ int s_prefix[MOEEP_KERNEL_MAX_EXPERTS + 1];
        __shared__ int2 s_own[MOEEP_KERNEL_MAX_EXPERTS]; /* with local: our run (first slot, count) */
        __shared__ int s_warp_sum[LL_WARPS];
        static_assert(MOEEP_KERNEL_MAX_EXPERTS <= LL_THREADS, "the scan takes one local expert per thread");
        {
                const int le = threadIdx.x, w = threadIdx.x / 32;
                int c = le < epr ? my->count[b][le] : 0;
                if (local && le < epr) {
                        /* Clamped: the range is in the caller's handle. */
                        const int64_t r = range[(size_t)le * R + me];
                        const int n = min(max((int)(uint32_t)r, 0), max(c, 0));
                        const int first = min(max((int)(r >> 32), 0), c - n);
                        s_own[le] = make_int2(first, n);
                        c -= n;
                }
                int incl = c;
#pragma unroll
                for (int o = 1; o < 32; o *= 2) {
                        const int v = __shfl_up_sync(0xffffffffu, incl, o);
                        if (lane >= o)
                                incl += v;
                }
                if (lane == 31)
                        s_warp_sum[w] = incl;
                __syncthreads();
                for (int j = 0; j < w; j++)
                        incl += s_warp_sum[j];
                if (le < epr)
                        s_prefix[le] = incl - c;
                if (le == epr - 1)
                        s_prefix[epr] = incl;
        }
        __syncthreads();
        /* Work items are (slot, piece of its row): with few rows (a decode
         * step of a few tokens) each row is split over several warps so that
         * a warp has one or two rounds of loads in flight rather than a row's
         * four in a chain; with a row per warp or more, items are whole rows.
         * Rows staged for a remote rank stay whole (their staging slot is
         * claimed once per row). Every block computes the same split. */
        const int n16 = H / 8, chunk = 32 * LL_COMBINE_SEND_UNROLL, nch = (n16 + chunk - 1) / chunk;
        const int rows = s_prefix[epr];
        const int pieces = ctx.px.remote || rows == 0 ? 1 : max(1, min(nch, warps / rows));
        const uint32_t skip = s_skip;
        for (int item = gwarp; item < rows * pieces; item += warps) {
                const int q = item / pieces, piece = item % pieces;
                const int c0 = piece * nch / pieces, c1 = (piece + 1) * nch / pieces;
                int lo = 0, hi = epr - 1;
                while (lo < hi) { /* last expert whose prefix <= q */
                        const int mid = (lo + hi + 1) / 2;
                        if (s_prefix[mid] <= q)
                                lo = mid;
                        else
                                hi = mid - 1;
                }
                const int le = lo;
                int pos = q - s_prefix[lo];
                if (local && pos >= s_own[le].x) /* past our own run */
                        pos += s_own[le].y;
                const size_t slot = (size_t)le * slots + pos;
                const int4 *row = y + slot * n16;
                /* The first chunk's loads go out before the slot's source is
                 * read, so that both are in flight together. */
                int4 v[LL_COMBINE_SEND_UNROLL];
                ll_load_chunk(row, c0 * chunk, n16, v);
                const int t = src[slot], ki = kinfo[slot];
                const int s = moeep_ll_kinfo_rank(ki), k = moeep_ll_kinfo_k(ki);
                if (skip >> s & 1) /* elastic: nothing goes to a rank left out */
                        continue;
                int4 *dst;
                if (px_remote(ctx, s)) { /* staged: row, then (token, k) */
                        uint32_t p = 0;
                        if (lane == 0)
                                p = atomicAdd(&ctx.px.state->ll_comb_claim[b][s], 1u);
                        p = __shfl_sync(0xffffffffu, p, 0);
                        char *srow = px_send_seg(ctx, ctx.px.ll_combine[b], ctx.px.ll_combine_seg, s) +
                                     MOEEP_PX_SEG_HDR + p * ctx.px.ll_row;
                        if (lane == 0) {
                                ((int32_t *)(srow + (size_t)H * 2))[0] = t;
                                ((int32_t *)(srow + (size_t)H * 2))[1] = k;
                        }
                        dst = (int4 *)srow;
                } else {
                        dst = (int4 *)(ctx.peers[s] + ctx.ll.comb[b] + ((size_t)t * ctx.max_topk + k) * (size_t)H * 2);
                }
                for (int c = c0; c < c1; c++) {
                        if (c > c0) /* the first chunk was loaded above */
                                ll_load_chunk(row, c * chunk, n16, v);
#pragma unroll
                        for (int u = 0; u < LL_COMBINE_SEND_UNROLL; u++) {
                                const int i = c * chunk + u * 32 + lane;
                                if (i < n16)
                                        st_na_v4(dst + i, v[u]);
                        }
                }
        }
        ll_arrive(ctx, true, b, !local, skip);
        if (ctx.px.remote && last_block_done(ctx) && threadIdx.x == 0) { /* every staged row is fenced */
                const struct moeep_ctx c = ctx;                          /* see dispatch */
                px_ship(c, c.px.ll_combine[b], c.px.ll_combine_seg, c.px.state->ll_comb_claim[b], c.px.ll_row,
                        MOEEP_PX_COUNTER_LL_COMBINE(b, 0), px_seg_info(c.px.epoch + seq, (uint32_t)H * 2, 0, 0), 0,
                        skip);
        }
}

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

/* Sums each token's expert outputs with its top-k weights (float), after
 * every rank's rows of set b, combine `seq`, landed. Experts masked (-1)
 * add nothing; in an elastic call, neither do the experts of a rank whose
 * rows this block did not take (masked, inactive, or not arrived within
 * twice the shrink timeout, which masks it). With `local` (the send phase
 * of this launch kept them), the outputs of our own experts are read in
 * place from y, at the slots the dispatch noted (moeep_ll_layout.ref), and
 * our own arrival is not waited for. */
template <typename Idx>
__device__ __forceinline__ void ll_combine_recv(const struct moeep_ctx &ctx, const Idx *topk_idx, const float *weights,
                                                int num_tokens, int K, int b, uint64_t seq, int4 *out, const int4 *y,
                                                int S, bool local) {
        const struct moeep_ll_sync *my = ll_sync_of(ctx, ctx.rank);
        const int lane = threadIdx.x % 32, H = ctx.hidden, me = ctx.rank, epr = ctx.num_experts / ctx.ranks;
        const int warps = gridDim.x * LL_WARPS, gwarp = ll_warp_index();
        const char *comb = ctx.peers[me] + ctx.ll.comb[b];
        const int32_t *ref = (const int32_t *)(ctx.peers[me] + ctx.ll.ref[b]);

        /* Work items (token, 512 channels of the row), so that a few tokens
         * still keep every warp busy; the K rows of a position are loaded
         * together. The ids and weights of a warp's first item (the
         * caller's, not another rank's) are read while the flags are
         * waited for. */
        const int n16 = H / 8, pieces = (n16 + LL_RECV_PIECE - 1) / LL_RECV_PIECE;
        const int items = num_tokens * pieces;
        int64_t e_first = -1;
        float wt_first = 0.0f;
        int32_t ref_first = -1;
        if (gwarp < items && lane < K) { /* the loads in flight together: the weight is read even when masked */
                const size_t j = (size_t)(gwarp / pieces) * K + lane;
                e_first = (int64_t)topk_idx[j];
                wt_first = weights[j];
                if (local)
                        ref_first = ref[(size_t)(gwarp / pieces) * ctx.max_topk + lane];
        }
        /* Remote ranks: ll_rows_relay ran before. Elastic: the sources
         * whose outputs this block sums (`in`): us, the remote ones the relay
         * placed, and the ones whose arrival it saw within twice the timeout
         * (a source may have waited one in its dispatch). */
        __shared__ uint32_t s_in, s_skip;
        uint32_t in = ~0u;
        if (!ctx.shrink) {
                if (threadIdx.x < ctx.ranks && !px_remote(ctx, threadIdx.x) && !(local && threadIdx.x == me))
                        wait_flag(ctx, &my->combine_flag[b][threadIdx.x], seq << 32, threadIdx.x);
        } else {
                if (threadIdx.x == 0) {
                        s_in = 1u << me |
                               (ctx.px.remote ? LL_DEC_REMOTE(ll_decision_of(ctx, &ctx.state->ll_comb_view[b], seq))
                                              : 0);
                        s_skip = ll_skip_now(ctx);
                }
                __syncthreads();
                const int s = threadIdx.x;
                if (s == me && !local)
                        ll_wait_own(ctx, &my->combine_flag[b][me], seq << 32);
                else if (s < ctx.ranks && s != me && !px_remote(ctx, s) && !(s_skip >> s & 1) &&
                         wait_peer(ctx, &my->combine_flag[b][s], seq << 32, s, 2 * ctx.shrink_timeout_ns))
                        atomicOr(&s_in, 1u << s);
        }
        __syncthreads();
        if (ctx.shrink)
                in = s_in;
        for (int item = gwarp; item < items; item += warps) {
                const int t = item / pieces, i0 = (item % pieces) * LL_RECV_PIECE, i1 = min(n16, i0 + LL_RECV_PIECE);
                float w = 0.0f;
                uint32_t valid = 0;
                const int4 *row = nullptr; /* lane k's: where expert output k is */
                if (lane < K) {
                        const bool first = item == gwarp;
                        const int64_t e = first ? e_first : (int64_t)topk_idx[(size_t)t * K + lane];
                        const float wt = first ? wt_first : weights[(size_t)t * K + lane];
                        const int32_t r = !local ? -1 : first ? ref_first : ref[(size_t)t * ctx.max_topk + lane];
                        valid = e >= 0 && e < ctx.num_experts && (in >> (e / epr) & 1);
                        w = valid ? wt : 0.0f;
                        /* In place when the dispatch put this pair at one of
                         * our slots of the same expert. */
                        if (r >= 0 && r / S < epr && e == (int64_t)me * epr + r / S)
                                row = y + (size_t)r * n16;
                        else
                                row = (const int4 *)(comb + ((size_t)t * ctx.max_topk + lane) * (size_t)H * 2);
                }
                const uint32_t mask = __ballot_sync(0xffffffffu, valid);
                float wk[MOEEP_KERNEL_MAX_TOPK];
                const int4 *rows[MOEEP_KERNEL_MAX_TOPK];
#pragma unroll
                for (int k = 0; k < MOEEP_KERNEL_MAX_TOPK; k++) {
                        wk[k] = __shfl_sync(0xffffffffu, w, k);
                        rows[k] = (const int4 *)__shfl_sync(0xffffffffu, (unsigned long long)row, k);
                }
                for (int i = i0 + lane; i < i1; i += 32) {
                        float acc[8] = {};
                        int4 v[MOEEP_KERNEL_MAX_TOPK];
#pragma unroll
                        for (int k = 0; k < MOEEP_KERNEL_MAX_TOPK; k++)
                                if ((mask >> k) & 1)
                                        v[k] = __ldcg(rows[k] + i);
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
