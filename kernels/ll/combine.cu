/* Low-latency combine (ll.cuh says what lies where): expert outputs back
 * to their tokens' ranks (ll_combine_send) and the weighted sum there
 * (ll_combine_recv), with their launcher. */
#include <cuda_bf16.h>

#include "common/launch.cuh"
#include "ll/ll.cuh"
#include "ll/shrink.cuh"

/* Loads one chunk of a row for the combine send: int4 base + u * 32 + lane
 * of the row into v[u] (what is past the row stays unset). */
__device__ __forceinline__ void ll_load_chunk(const int4 *row, int base, int n16, int4 v[LL_COMBINE_SEND_UNROLL]) {
        const int lane = threadIdx.x % 32;
#pragma unroll
        for (int u = 0; u < LL_COMBINE_SEND_UNROLL; u++)
                if (base + u * 32 + lane < n16)
                        v[u] = ld_nc_v4(row + base + u * 32 + lane);
}

/* out[i] = sum over the k of `mask` of w[k] * rows[k][i] (bf16 rows,
 * float sums), for this lane's int4 i of [i0, i1), where lane k holds
 * w[k] in `wl` and rows[k] in `row`: the K rows of a position are loaded
 * together. The combine's sum, at the token's rank (ll_combine_recv) and,
 * summed, at the expert's (ll_combine_send_summed). */
__device__ __forceinline__ void ll_weighted_sum(float wl, const int4 *row, uint32_t mask, int i0, int i1, int4 *out) {
        float w[MOEEP_KERNEL_MAX_TOPK];
        const int4 *rows[MOEEP_KERNEL_MAX_TOPK];
#pragma unroll
        for (int k = 0; k < MOEEP_KERNEL_MAX_TOPK; k++) {
                w[k] = __shfl_sync(0xffffffffu, wl, k);
                rows[k] = (const int4 *)__shfl_sync(0xffffffffu, (unsigned long long)row, k);
        }
        for (int i = i0 + threadIdx.x % 32; i < i1; i += 32) {
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
                                acc[2 * j] += w[k] * f.x;
                                acc[2 * j + 1] += w[k] * f.y;
                        }
                }
                int4 o;
                __nv_bfloat162 *oh = (__nv_bfloat162 *)&o;
#pragma unroll
                for (int j = 0; j < 4; j++)
                        oh[j] = __floats2bfloat162_rn(acc[2 * j], acc[2 * j + 1]);
                st_na_v4(out + i, o);
        }
}

/* The tokens of the step whose combine this is: every source's count of
 * set b's dispatch, which reached every rank with its counts
 * (moeep_ll_sums_step). */
__device__ __forceinline__ long ll_step_tokens(const struct moeep_ctx &ctx, int b) {
        const struct moeep_ll_sync *my = ll_sync_of(ctx, ctx.rank);
        long n = 0;

        for (int s = 0; s < ctx.ranks; s++)
                n += min(max(__ldcg(&my->tokens[b][s]), 0), ctx.ll.max_tokens);
        return n;
}

/* First step of a combine send where combines may sum (moeep_ll_summed):
 * with `push` (the step sums: moeep_ll_sums_step) our top-k weights to
 * every other rank (their `weights` area, row src = us) and its
 * weights_flag for us at `seq`; always, to every rank, whether this send
 * sums (comb_mode). Block d % gridDim.x serves rank d. */
__device__ __forceinline__ void ll_push_weights(const struct moeep_ctx &ctx, const float *weights, int num_tokens,
                                                int K, int b, uint64_t seq, bool push, bool sums) {
        const int me = ctx.rank, n = num_tokens * K;

        for (int d = blockIdx.x; d < ctx.ranks; d += gridDim.x) {
                struct moeep_ll_sync *at = ll_sync_of(ctx, d);
                if (push && d != me) {
                        float *dst = (float *)(ctx.peers[d] + ctx.ll.weights[b]) +
                                     (size_t)me * ctx.ll.max_tokens * ctx.max_topk;
                        for (int i = threadIdx.x; i < n; i += blockDim.x)
                                dst[(size_t)(i / K) * ctx.max_topk + i % K] = weights[i];
                        __syncthreads();
                        if (threadIdx.x == 0)
                                st_release_sys(&at->weights_flag[b][me], seq);
                }
                if (threadIdx.x == 0) /* ordered before our arrival there */
                        at->comb_mode[b][me] = 2 * seq + (sums ? 1 : 0);
        }
}

/* Summed combine, the send: for each (source s, token t < s's tokens) with
 * pairs at our experts (pair_slot entries of the current dispatch), their outputs
 * weighted with s's top-k weights and summed in float, one bf16 row to
 * s's comb row (t, k0), k0 the first k of those pairs; then the arrival
 * at every rank (ll_arrive). The token's rank adds the rows of its
 * experts' ranks (ll_combine_recv). Work items are (source token, piece
 * of the row), so that a decode step of a few tokens keeps every warp
 * busy. A warp waits for a source's weights once. With `local`
 * our own tokens are left to the receive, which sums them in place. */
__device__ __forceinline__ void ll_combine_send_summed(const struct moeep_ctx &ctx, const int4 *y, const float *weights,
                                                       int K, int b, uint64_t seq, bool local) {
        const int lane = threadIdx.x % 32, R = ctx.ranks, me = ctx.rank, H = ctx.hidden;
        const int n16 = H / 8, pieces = (n16 + LL_RECV_PIECE - 1) / LL_RECV_PIECE;
        const uint32_t dseq = (uint32_t)*ll_seq_of(ctx, false, b); /* the dispatch this combine answers */
        struct moeep_ll_sync *my = ll_sync_of(ctx, me);
        const float *pushed = (const float *)(ctx.peers[me] + ctx.ll.weights[b]);
        uint32_t ready = 1u << me; /* sources whose weights this warp saw land */
        /* The sources' tokens, ours left to the receive with `local`. */
        const uint32_t sources = ((1u << R) - 1) & ~(local ? 1u << me : 0u);

        ll_for_each_pair_item(
                ctx, b, dseq, sources, pieces, K, 0u, [&](int s, int t, int piece, uint32_t mask, uint64_t entry) {
                        const bool valid = mask >> lane & 1;
                        if (!(ready >> s & 1)) {
                                if (lane == 0)
                                        wait_flag(ctx, &my->weights_flag[b][s], seq, s); /* a failure is recorded */
                                __syncwarp();
                                ready |= 1u << s;
                        }
                        float w = 0.0f;
                        if (valid)
                                w = s == me ? weights[(size_t)t * K + lane]
                                            : __ldcg(pushed + ((size_t)s * ctx.ll.max_tokens + t) * ctx.max_topk +
                                                     lane);
                        const int4 *row = y + (size_t)ll_pair_slot_index(entry) * n16;
                        const int k0 = __ffs(mask) - 1, i0 = piece * LL_RECV_PIECE;
                        int4 *dst = (int4 *)(ctx.peers[s] + ctx.ll.comb[b] +
                                             ((size_t)t * ctx.max_topk + k0) * (size_t)H * 2);
                        ll_weighted_sum(w, row, mask, i0, min(n16, i0 + LL_RECV_PIECE), dst);
                });
        ll_arrive(ctx, true, b, !local);
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
        const bool summed = moeep_ll_summed(&ctx);

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
        __shared__ uint32_t s_sums; /* the sources that sent sums (moeep_ll_summed) */
        if (threadIdx.x == 0)
                s_sums = 0;
        __syncthreads();
        if (summed && threadIdx.x < ctx.ranks && (*(volatile uint64_t *)&my->comb_mode[b][threadIdx.x] & 1))
                atomicOr(&s_sums, 1u << threadIdx.x);
        __syncthreads();
        const uint32_t sums = s_sums;
        if (ctx.shrink)
                in = s_in;
        for (int item = gwarp; item < items; item += warps) {
                const int t = item / pieces, i0 = (item % pieces) * LL_RECV_PIECE, i1 = min(n16, i0 + LL_RECV_PIECE);
                float w = 0.0f;
                bool valid = false;
                int owner = -1;            /* lane k's expert's rank, when valid */
                const int4 *row = nullptr; /* lane k's: where expert output k is */
                if (lane < K) {
                        const bool first = item == gwarp;
                        const int64_t e = first ? e_first : (int64_t)topk_idx[(size_t)t * K + lane];
                        const float wt = first ? wt_first : weights[(size_t)t * K + lane];
                        const int32_t r = !local ? -1 : first ? ref_first : ref[(size_t)t * ctx.max_topk + lane];
                        valid = e >= 0 && e < ctx.num_experts && (in >> (e / epr) & 1);
                        w = valid ? wt : 0.0f;
                        owner = valid ? (int)(e / epr) : -1;
                        /* In place when the dispatch put this pair at one of
                         * our slots of the same expert. */
                        if (r >= 0 && r / S < epr && e == (int64_t)me * epr + r / S)
                                row = y + (size_t)r * n16;
                        else
                                row = (const int4 *)(comb + ((size_t)t * ctx.max_topk + lane) * (size_t)H * 2);
                }
                if (sums) {
                        /* An expert rank that summed sent one row, at the
                         * row of the first k of its experts; ours are read
                         * in place when this launch kept them. */
                        const uint32_t same = __match_any_sync(0xffffffffu, owner);
                        if (valid && (sums >> owner & 1) && !(local && owner == me)) {
                                valid = __ffs(same) - 1 == lane;
                                w = 1.0f;
                        }
                }
                const uint32_t mask = __ballot_sync(0xffffffffu, valid);
                ll_weighted_sum(w, row, mask, i0, i1, out + (size_t)t * n16);
        }
}

namespace moeep_ll {

/* Combine: the send phase, the receive phase (the sum), or both. With both,
 * every block waits in the receive for every block's arrival (ll_arrive),
 * so the launch is cooperative (every block resident at once). `local`
 * (both phases in one call, y valid for its receive): the outputs of our
 * own tokens are read in place, not sent to ourselves. */
template <typename Idx>
__global__ void __launch_bounds__(LL_THREADS, 1)
        combine(struct moeep_ctx ctx, const int4 *y, int b, int S, int phases, int local, const Idx *topk_idx,
                const float *weights, int num_tokens, int K, int4 *out) {
        grid_dep_wait();   /* the kernel before us (launch_kernel): its writes */
        grid_dep_launch(); /* the next may take our SMs as our blocks end */
        const uint64_t seq = *ll_seq_of(ctx, true, b) + ((phases & MOEEP_LL_SEND) ? 1 : 0);

        /* Sums where the step has enough tokens (the same answer at every
         * rank) and this launch also receives (its ranks wait for each
         * other anyway); a hook's send does not wait for anyone, but
         * pushes its weights for the others' sums. */
        const bool step_sums = (phases & MOEEP_LL_SEND) && moeep_ll_sums_step(&ctx, ll_step_tokens(ctx, b));
        const bool sums = step_sums && phases == (MOEEP_LL_SEND | MOEEP_LL_RECV);
        if ((phases & MOEEP_LL_SEND) && moeep_ll_summed(&ctx))
                ll_push_weights(ctx, weights, num_tokens, K, b, seq, step_sums, sums);
        if ((phases & MOEEP_LL_SEND) && sums)
                ll_combine_send_summed(ctx, y, weights, K, b, seq, local);
        else if (phases & MOEEP_LL_SEND)
                ll_combine_send(ctx, y, b, S, seq, local);
        if (phases & MOEEP_LL_RECV)
                ll_combine_recv<Idx>(ctx, topk_idx, weights, num_tokens, K, b, seq, out, y, S, local);
        if ((phases & MOEEP_LL_SEND) && threadIdx.x == 0)
                *ll_seq_of(ctx, true, b) = seq;
}

} /* namespace moeep_ll */

extern "C" int moeep_launch_ll_combine(const struct moeep_ctx *ctx, const struct moeep_ll_combine_launch *a,
                                       cudaStream_t stream) {
        const int both = MOEEP_LL_SEND | MOEEP_LL_RECV;

        MOEEP_CUDA_LAUNCH_BEGIN();
        /* Both phases in one call: our own tokens' outputs are read in place
         * (y is the caller's until the call ends; a hook's receive comes
         * later and gets them sent like every other rank's). */
        const int local = a->phases == both && !(ctx->debug & MOEEP_DEBUG_COPY_SELF);
        /* One launch of moeep_ll::combine doing phases p; with both, its
         * blocks wait in the receive for every other rank's blocks
         * (launch_phases: cooperative or plain). */
        auto launch = [&](int p, bool cooperative) {
                return with_index_type(a->idx_is_int64, [&](auto idx) {
                        using Idx = decltype(idx);
                        return launch_kernel(moeep_ll::combine<Idx>, (unsigned)ctx->ll_num_sms, LL_THREADS, 0, stream,
                                             cooperative, !(ctx->debug & MOEEP_DEBUG_NO_PDL), *ctx, (const int4 *)a->y,
                                             a->set, a->slots, p, local, (const Idx *)a->topk_idx, a->weights,
                                             a->num_tokens, a->num_topk, (int4 *)a->out);
                });
        };
        const cudaError_t e = launch_phases(ctx, stream, launch, a->phases, MOEEP_LL_SEND, MOEEP_LL_RECV, true);
        if (e != cudaSuccess)
                return (int)e;
        MOEEP_CUDA_LAUNCH_CHECK();
        return 0;
}
