/* Low-latency dispatch (ll.cuh says what lies where): the send phase,
 * every (token, expert) pair to a slot of its expert's rank, and the
 * receive phase, with their launcher. */
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include "common/launch.cuh"
#include "ll/ll.cuh"
#include "ll/shrink.cuh"

/* Notes where pair (t, k) of ours went when its expert e is ours: slot
 * (local expert, pos) of set b, which the combine of this dispatch reads
 * in place instead of the row coming back (moeep_ll_layout.ref); -1 for
 * every other pair (another rank's expert, masked: LL_NO_EXPERT, or no
 * slot: pos < 0). */
__device__ __forceinline__ void ll_note_ref(const struct moeep_ctx &ctx, int b, int t, int k, uint32_t e, int pos,
                                            size_t slots) {
        const int epr = ctx.num_experts / ctx.ranks;
        const bool ours = e != LL_NO_EXPERT && pos >= 0 && (int)(e / epr) == ctx.rank;

        ((int32_t *)(ctx.peers[ctx.rank] + ctx.ll.ref[b]))[(size_t)t * ctx.max_topk + k] =
                ours ? (int32_t)((e % epr) * slots + pos) : -1;
}

/* FP8 cast of 16 bf16 channels (two int4 of a row) into one int4 of e4m3,
 * with the scale of their 128-channel group: the 8 lanes of an aligned
 * lane octet hold one group (amax / MOEEP_E4M3_MAX, or its power of two above when
 * round_scale). Every lane of the warp must call it. */
__device__ __forceinline__ int4 ll_cast16(int4 a, int4 b, bool round_scale, float *ret_scale) {
        const __nv_bfloat162 *h[2] = { (const __nv_bfloat162 *)&a, (const __nv_bfloat162 *)&b };
        float f[16], amax = 0.0f;
#pragma unroll
        for (int j = 0; j < 8; j++) {
                float2 p = __bfloat1622float2(h[j / 4][j % 4]);
                f[2 * j] = p.x;
                f[2 * j + 1] = p.y;
                amax = fmaxf(amax, fmaxf(fabsf(p.x), fabsf(p.y)));
        }
#pragma unroll
        for (int o = 4; o >= 1; o /= 2)
                amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
        float scale = amax > 0.0f ? amax / MOEEP_E4M3_MAX : 1.0f;
        if (round_scale)
                scale = exp2f(ceilf(log2f(scale)));
        const float inv = 1.0f / scale;
        int4 q;
        __nv_fp8x2_storage_t *qq = (__nv_fp8x2_storage_t *)&q;
#pragma unroll
        for (int j = 0; j < 8; j++)
                qq[j] = __nv_cvt_float2_to_fp8x2(make_float2(f[2 * j] * inv, f[2 * j + 1] * inv), __NV_SATFINITE,
                                                 __NV_E4M3);
        *ret_scale = scale;
        return q;
}

/* Loads four steps of a row from int4 `base` on: the int4 pair of step u
 * of this lane into v[2u], v[2u + 1] (what is past the row stays unset). */
__device__ __forceinline__ void ll_load_steps(const int4 *row, int base, int n16, int4 v[8]) {
        const int lane = threadIdx.x % 32;
#pragma unroll
        for (int u = 0; u < 4; u++)
                if (base + u * 64 + 2 * lane < n16) {
                        v[2 * u] = ld_nc_v4(row + base + u * 64 + 2 * lane);
                        v[2 * u + 1] = ld_nc_v4(row + base + u * 64 + 2 * lane + 1);
                }
}

/* The pairs before `item` that go to expert e (s_eid: every pair's
 * expert), counted by one warp, eight 16-bit ids per lane and round: a
 * pair's position among our pairs for its expert, the same in every block
 * without a claim in global memory. */
__device__ __forceinline__ uint32_t ll_pairs_before(const uint16_t *s_eid, int item, uint32_t e) {
        uint32_t c = 0;
        for (int j0 = threadIdx.x % 32 * 8; j0 < item; j0 += 256) {
                const uint4 w = *(const uint4 *)(s_eid + j0);
                const uint32_t ws[4] = { w.x, w.y, w.z, w.w };
#pragma unroll
                for (int q = 0; q < 8; q++)
                        c += j0 + q < item && ((ws[q / 2] >> (16 * (q % 2))) & 0xffffu) == e;
        }
        return __reduce_add_sync(0xffffffffu, c);
}

/* The top-k ids of the pairs a thread takes in ll_exchange_counts (pair
 * threadIdx.x + j * LL_THREADS in ids[j]), loaded at the start of a
 * dispatch that counts positions in shared memory, ahead of the row loads
 * and the first barrier. */
constexpr int LL_IDS = LL_SCAN_PAIRS / LL_THREADS;

template <typename Idx> __device__ __forceinline__ void ll_load_ids(const Idx *topk_idx, int n, int64_t ids[LL_IDS]) {
#pragma unroll
        for (int j = 0; j < LL_IDS; j++) {
                const int i = threadIdx.x + j * LL_THREADS;
                ids[j] = i < n ? (int64_t)topk_idx[i] : -1;
        }
}

/* Where our pairs start in every expert's slots: after the pairs of the
 * ranks below us, whose counts every rank broadcasts first (table rows and
 * token counts, released by count_flag). Block 0 counts our pairs per
 * expert (a few thousand ids, in shared memory) and broadcasts them, with
 * our token count (n / K); every block sums the rows of the ranks below
 * us. s_begin[e] is our first slot at expert e.
 * With s_eid, every block also keeps every pair's expert there
 * (LL_NO_EXPERT when masked), from the ids ll_load_ids loaded.
 *
 * Elastic (ctx.shrink): block 0 also decides the ranks the call leaves out
 * and the lower ranks whose counts our pairs go after (ll/shrink.cuh), and
 * the other blocks take its decision (s_dec: skip, view) instead of
 * waiting for the counts themselves. A pair for a rank left out is masked
 * (LL_NO_EXPERT) and not counted; neither our counts nor our flag go to
 * such a rank. */
template <typename Idx>
__device__ __forceinline__ void ll_exchange_counts(const struct moeep_ctx &ctx, const Idx *topk_idx, int n, int K,
                                                   int b, uint64_t seq, int *s_begin, uint16_t *s_eid,
                                                   const int64_t ids[LL_IDS], uint32_t *s_dec, int use_fp8,
                                                   bool staged) {
        struct moeep_ll_sync *my = ll_sync_of(ctx, ctx.rank);
        const int tid = threadIdx.x, R = ctx.ranks, E = ctx.num_experts, me = ctx.rank, epr = E / R;
        /* f(pair, expert id) for every pair of this thread. */
        auto each_pair = [&](auto f) {
                if (s_eid) {
#pragma unroll
                        for (int j = 0; j < LL_IDS; j++)
                                if (tid + j * LL_THREADS < n)
                                        f(tid + j * LL_THREADS, ids[j]);
                } else {
                        for (int i = tid; i < n; i += blockDim.x)
                                f(i, (int64_t)topk_idx[i]);
                }
        };
        /* Pairs for ranks left out become masked ones (elastic). */
        auto drop_skipped = [&](uint32_t skip) {
                if (!skip)
                        return;
                for (int e = tid; e < E; e += blockDim.x)
                        if (skip >> (e / epr) & 1)
                                s_begin[e] = 0;
                if (s_eid)
                        for (int i = tid; i < n; i += blockDim.x)
                                if (s_eid[i] != LL_NO_EXPERT && (skip >> (s_eid[i] / epr) & 1))
                                        s_eid[i] = LL_NO_EXPERT;
        };

        if (blockIdx.x == 0) {
                /* The daemon's word, a PCIe load: issued first, used after
                 * the counting. */
                const uint64_t lost = ctx.shrink && tid == 0 ? ll_lost_word(ctx) : 0;
                for (int e = tid; e < E; e += blockDim.x)
                        s_begin[e] = 0; /* our counts first */
                __syncthreads();
                each_pair([&](int i, int64_t e) {
                        const bool valid = e >= 0 && e < E;
                        if (valid)
                                atomicAdd(&s_begin[e], 1);
                        if (s_eid)
                                s_eid[i] = valid ? (uint16_t)e : LL_NO_EXPERT;
                });
                if (ctx.shrink) {
                        if (tid == 0)
                                s_dec[0] = ll_skip_of(ctx, lost);
                        __syncthreads();
                        drop_skipped(s_dec[0]);
                }
                __syncthreads();
                const uint32_t skip = ctx.shrink ? s_dec[0] : 0;
                for (int i = tid; i < R * E; i += blockDim.x) {
                        const int d = i / E;
                        if (skip >> d & 1)
                                continue;
                        if (!px_remote(ctx, d))
                                ll_sync_of(ctx, d)->table[b][me][i % E] = s_begin[i % E];
                        else if (i % E / epr == d) /* d's experts, ahead of the pairs staged for d */
                                ((int32_t *)(px_send_seg(ctx, ctx.px.ll_dispatch[b], ctx.px.ll_dispatch_seg, d) +
                                             MOEEP_PX_SEG_HDR))[i % E % epr] = s_begin[i % E];
                }
                /* The release stores below cover the table rows the block
                 * wrote (ordered before them by the barrier); the counts
                 * staged in host memory for the proxy are fenced by
                 * last_block_done before they are shipped. */
                __syncthreads();
                if (tid < R && !px_remote(ctx, tid) && !(skip >> tid & 1)) {
                        ll_sync_of(ctx, tid)->tokens[b][me] = n / max(K, 1);
                        ll_sync_of(ctx, tid)->staged[b][me] = staged;
                        uint64_t *flag = &ll_sync_of(ctx, tid)->count_flag[b][me];
                        if (tid == me) /* read on this GPU only (ll_arrive) */
                                st_release_gpu(flag, seq);
                        else
                                st_release_sys(flag, seq);
                }
        } else if (s_eid && !ctx.shrink) {
                each_pair([&](int i, int64_t e) { s_eid[i] = e >= 0 && e < E ? (uint16_t)e : LL_NO_EXPERT; });
        }
        uint32_t view = (1u << me) - 1; /* not elastic: every lower rank */
        if (ctx.shrink && blockIdx.x == 0) {
                /* The lower ranks whose counts came (a rank whose counts do
                 * not come is masked, and left out from now on). */
                if (tid == 0)
                        s_dec[1] = 0;
                __syncthreads();
                if (tid < me && !px_remote(ctx, tid) && ll_counts_present(ctx, b, seq, tid, s_dec[0] >> tid & 1))
                        atomicOr(&s_dec[1], 1u << tid);
                __syncthreads();
                if (tid == 0) {
                        s_dec[0] |= ll_skip_now(ctx);
                        publish_decision(&ctx.state->ll_send_view[b], seq,
                                         s_dec[1] | s_dec[0] << 8 | (use_fp8 ? LL_DEC_FP8 : 0));
                }
                __syncthreads();
                drop_skipped(s_dec[0]);
                view = s_dec[1];
        } else if (ctx.shrink) {
                if (tid == 0) {
                        const uint32_t w = wait_decision(ctx, &ctx.state->ll_send_view[b], seq);
                        s_dec[0] = LL_DEC_SKIP(w);
                        s_dec[1] = LL_DEC_VIEW(w);
                }
                __syncthreads();
                view = s_dec[1];
                if (s_eid)
                        each_pair([&](int i, int64_t e) {
                                s_eid[i] = e >= 0 && e < E && !(s_dec[0] >> (e / epr) & 1) ? (uint16_t)e : LL_NO_EXPERT;
                        });
        } else if (tid < me && !px_remote(ctx, tid)) {
                wait_flag(ctx, &my->count_flag[b][tid], seq, tid);
        }
        __syncthreads();
        for (int e = tid; e < E; e += blockDim.x) {
                int begin = 0;
                for (int s = 0; s < me; s++)
                        if (!px_remote(ctx, s) && (view >> s & 1))
                                begin += *(volatile int32_t *)&my->table[b][s][e];
                s_begin[e] = begin;
        }
        __syncthreads();
}

/* Loads the row steps of warp-step batch j0 of this warp (steps wib +
 * (j0 + u) * LL_WARPS, u < 4, of 64 int4 each) into v[2u], v[2u + 1]. */
__device__ __forceinline__ void ll_load_token_steps(const int4 *row, int j0, int n16, int4 v[8]) {
        const int lane = threadIdx.x % 32, wib = threadIdx.x / 32;
#pragma unroll
        for (int u = 0; u < 4; u++) {
                const int c = (wib + (j0 + u) * LL_WARPS) * 64 + 2 * lane;
                if (c < n16) {
                        v[2 * u] = ld_nc_v4(row + c);
                        v[2 * u + 1] = ld_nc_v4(row + c + 1);
                }
        }
}

/* How pair k of a token moves in ll_send_tokens (s_how). */
enum ll_how {
        LL_HOW_NONE = 0, /* not at all: masked, overflowing, or carried by another pair's row */
        LL_HOW_SLOT,     /* its row to its slot */
        LL_HOW_TOKEN,    /* the token's row to its rank's token rows (moeep_ll_dedup), for every pair there */
};

/* The send phase token by token, when every destination is mapped and
 * the positions are counted in shared memory: a block takes a token (the
 * first, t0, from block 0 last), its warps a share of the row's 64-int4
 * steps each, and each step is loaded and cast once for all K pairs of
 * the token instead of once per pair. Warp k counts pair k's slot first
 * (-1: masked or overflowing) for the whole block. v holds the first
 * token's first batch of steps, loaded by the caller.
 * With `dedup` (moeep_ll_dedup), a token goes once to each other rank
 * that holds one of its experts, into row (us, t) of that rank's token
 * rows, carried by the first of its pairs there; each pair's entry at
 * that rank says so (LL_PAIR_STAGED) and the rank's receive copies the
 * row to the pair's slot (ll_expand_tokens). Our own pairs go to their
 * slots. */
__device__ __forceinline__ void ll_send_tokens(const struct moeep_ctx &ctx, const int4 *x, int num_tokens, int K, int b,
                                               uint64_t seq, size_t slots, int use_fp8, int round_scale,
                                               const int *s_begin, const uint16_t *s_eid, int t0, int4 v[8],
                                               bool dedup) {
        __shared__ int s_slot[MOEEP_KERNEL_MAX_TOPK];
        __shared__ int s_how[MOEEP_KERNEL_MAX_TOPK];
        const int lane = threadIdx.x % 32, wib = threadIdx.x / 32, me = ctx.rank, H = ctx.hidden;
        const int epr = ctx.num_experts / ctx.ranks, n16 = H / 8, nws = (n16 + 63) / 64;
        const int nscales = H / MOEEP_SCALE_BLOCK;
        const size_t xrow = (size_t)H * (use_fp8 ? 1 : 2), trow = MOEEP_LL_TOK_ROW(H);
        const size_t tok_of_us = ctx.ll.tok[b] + (size_t)me * ctx.ll.max_tokens * trow; /* our rows at any rank */

        for (int t = t0; t < num_tokens; t += gridDim.x) {
                const int4 *row = x + (size_t)t * n16;
                if (t != t0)
                        ll_load_token_steps(row, 0, n16, v);
                if (wib < K) {
                        const int item = t * K + wib;
                        const uint32_t e = s_eid[item];
                        int pos = -1;
                        if (e != LL_NO_EXPERT) {
                                const uint32_t p = (uint32_t)s_begin[e] + ll_pairs_before(s_eid, item, e);
                                if ((size_t)p < slots)
                                        pos = (int)p;
                                else if (lane == 0) /* only when a token names one expert twice */
                                        record_error(ctx, MOEEP_KERR_OVERFLOW, (int)(e / epr));
                        }
                        if (lane == 0) {
                                s_slot[wib] = pos;
                                ll_note_ref(ctx, b, t, wib, e, pos, slots);
                        }
                }
                __syncthreads();
                if (wib == 0) {
                        /* One row per other rank: the first of its pairs
                         * there carries it (the lowest lane of a match). */
                        const int pos = lane < K ? s_slot[lane] : -1;
                        const int d = pos >= 0 ? (int)(s_eid[t * K + lane] / epr) : -1;
                        const bool staged = dedup && pos >= 0 && d != me;
                        const uint32_t same = __match_any_sync(0xffffffffu, staged ? d : -1 - lane);
                        if (lane < K)
                                s_how[lane] = pos < 0                        ? LL_HOW_NONE
                                              : !staged                      ? LL_HOW_SLOT
                                              : __ffs(same) - 1 == (int)lane ? LL_HOW_TOKEN
                                                                             : LL_HOW_NONE;
                }
                __syncthreads();
                for (int j0 = 0; wib + j0 * LL_WARPS < nws; j0 += 4) {
                        if (j0 > 0)
                                ll_load_token_steps(row, j0, n16, v);
#pragma unroll
                        for (int u = 0; u < 4; u++) {
                                const int st = wib + (j0 + u) * LL_WARPS;
                                if (st >= nws)
                                        break;                    /* warp-uniform */
                                const int c = st * 64 + 2 * lane; /* first int4 of the lane's pair */
                                float scale = 1.0f;
                                int4 q = v[2 * u];
                                if (use_fp8)
                                        q = ll_cast16(v[2 * u], v[2 * u + 1], round_scale, &scale);
                                if (c >= n16)
                                        continue;
                                for (int k = 0; k < K; k++) {
                                        const int how = s_how[k];
                                        if (how == LL_HOW_NONE)
                                                continue;
                                        const uint32_t e = s_eid[t * K + k];
                                        const int d = (int)(e / epr), le = (int)(e % epr);
                                        const size_t slot = (size_t)le * slots + s_slot[k];
                                        int4 *dst;
                                        float *sc;
                                        if (how == LL_HOW_TOKEN) {
                                                dst = (int4 *)(ctx.peers[d] + tok_of_us + (size_t)t * trow);
                                                sc = (float *)((char *)dst + xrow) + c / 16;
                                        } else {
                                                dst = (int4 *)(ctx.peers[d] + ctx.ll.x[b] + slot * xrow);
                                                sc = (float *)(ctx.peers[d] + ctx.ll.scales[b]) +
                                                     ((size_t)le * nscales + c / 16) * slots + s_slot[k];
                                        }
                                        if (use_fp8) {
                                                st_na_v4(dst + c / 2, q);
                                                if (lane % 8 == 0)
                                                        *sc = scale;
                                        } else {
                                                st_na_v4(dst + c, v[2 * u]);
                                                st_na_v4(dst + c + 1, v[2 * u + 1]);
                                        }
                                }
                        }
                }
                if (wib == 0 && lane < K && s_slot[lane] >= 0) {
                        const uint32_t e = s_eid[t * K + lane];
                        const int d = (int)(e / epr), le = (int)(e % epr);
                        const size_t slot = (size_t)le * slots + s_slot[lane];
                        const bool staged = dedup && d != me;
                        if (!staged) { /* a staged pair's receive writes them */
                                ((int32_t *)(ctx.peers[d] + ctx.ll.src[b]))[slot] = t;
                                ((int32_t *)(ctx.peers[d] + ctx.ll.kinfo[b]))[slot] = moeep_ll_kinfo_pack(me, lane);
                        }
                        ll_note_pair_slot(ctx, d, b, seq, t, lane, slot, staged);
                }
                __syncthreads(); /* s_slot, s_how are the next token's */
        }
}

/* The receive's copy of the tokens that came once per rank (moeep_ll_dedup):
 * for each source s of `sources` (those that staged their tokens here,
 * whose rows all landed) and token t < s's tokens, each pair whose
 * entry here (current dispatch seq, LL_PAIR_STAGED) names a slot gets the
 * row (and its FP8 scales, its source token and (s, k)) copied there from
 * token row (s, t). Work items are (source token, piece of 64 int4 of the
 * row), over every warp of the launch. */
__device__ __forceinline__ void ll_expand_tokens(const struct moeep_ctx &ctx, int b, uint64_t seq, size_t slots,
                                                 int use_fp8, uint32_t sources) {
        const int lane = threadIdx.x % 32, me = ctx.rank, H = ctx.hidden, T = ctx.ll.max_tokens;
        const size_t xrow = (size_t)H * (use_fp8 ? 1 : 2), trow = MOEEP_LL_TOK_ROW(H);
        const int nx = (int)(xrow / 16), pieces = (nx + 63) / 64, nscales = H / MOEEP_SCALE_BLOCK;

        ll_for_each_pair_item(
                ctx, b, (uint32_t)seq, sources, pieces, ctx.max_topk, LL_PAIR_STAGED,
                [&](int s, int t, int piece, uint32_t mask, uint64_t entry) {
                        const uint32_t my_slot = ll_pair_slot_index(entry);
                        const char *trw = ctx.peers[me] + ctx.ll.tok[b] + ((size_t)s * T + t) * trow;
                        const int c = piece * 64 + 2 * lane;
                        int4 v0 = {}, v1 = {};
                        if (c < nx) {
                                v0 = __ldcg((const int4 *)trw + c);
                                if (c + 1 < nx)
                                        v1 = __ldcg((const int4 *)trw + c + 1);
                        }
                        static_assert(MOEEP_LL_FP8_MAX_HIDDEN / MOEEP_SCALE_BLOCK <= 64, "two scales per lane");
                        float sc[2] = {};
                        if (use_fp8 && piece == 0)
                                for (int j = lane, i = 0; j < nscales && i < 2; j += 32, i++)
                                        sc[i] = __ldcg((const float *)(trw + xrow) + j);
                        for (uint32_t m = mask; m; m &= m - 1) {
                                const int k = __ffs(m) - 1;
                                const uint32_t slot = __shfl_sync(0xffffffffu, my_slot, k);
                                int4 *dst = (int4 *)(ctx.peers[me] + ctx.ll.x[b] + (size_t)slot * xrow);
                                if (c < nx)
                                        st_na_v4(dst + c, v0);
                                if (c + 1 < nx)
                                        st_na_v4(dst + c + 1, v1);
                                if (piece != 0)
                                        continue;
                                const size_t le = slot / slots, pos = slot % slots;
                                if (use_fp8)
                                        for (int j = lane, i = 0; j < nscales && i < 2; j += 32, i++)
                                                ((float *)(ctx.peers[me] +
                                                           ctx.ll.scales[b]))[(le * nscales + j) * slots + pos] = sc[i];
                                if (lane == 0) {
                                        ((int32_t *)(ctx.peers[me] + ctx.ll.src[b]))[slot] = t;
                                        ((int32_t *)(ctx.peers[me] + ctx.ll.kinfo[b]))[slot] =
                                                moeep_ll_kinfo_pack(s, k);
                                }
                        }
                });
}

/* The receive phase when not elastic: block 0 publishes the counts and
 * waits for every source (ll_recv_counts); where tokens may come once per
 * rank (moeep_ll_dedup), every block then waits for every other mapped
 * source's arrival and copies its share of their tokens to the slots
 * (ll_expand_tokens). `in_send`: the send's own launch (ll_recv_counts). */
__device__ __forceinline__ void ll_recv(const struct moeep_ctx &ctx, int b, uint64_t seq, int *stats, size_t slots,
                                        int use_fp8, bool in_send) {
        struct moeep_ll_sync *my = ll_sync_of(ctx, ctx.rank);
        __shared__ uint32_t s_staged; /* the sources whose tokens came once per rank */
        const int s = threadIdx.x;
        const bool other = s < ctx.ranks && s != ctx.rank && !px_remote(ctx, s);

        if (blockIdx.x == 0)
                ll_recv_counts(ctx, b, seq, stats, in_send); /* waits for every source */
        if (!moeep_ll_dedup(&ctx))
                return;
        if (s == 0)
                s_staged = 0;
        __syncthreads();
        /* The other blocks wait for a source's rows only when it staged
         * them: its counts say so, and come first. */
        if (other && (blockIdx.x == 0 || wait_flag(ctx, &my->count_flag[b][s], seq, s)) && __ldcg(&my->staged[b][s]) &&
            (blockIdx.x == 0 || wait_flag(ctx, &my->dispatch_flag[b][s], seq << 32, s)))
                atomicOr(&s_staged, 1u << s);
        __syncthreads();
        if (s_staged)
                ll_expand_tokens(ctx, b, seq, slots, use_fp8, s_staged);
}

/* How the dispatch send finds its pairs' slots; moeep_launch_ll_dispatch
 * picks one, and each is a kernel instance of its own. */
enum ll_path {
        LL_PATH_CLAIM,  /* pair loop, positions claimed from counters in global memory */
        LL_PATH_PAIRS,  /* pair loop, positions counted in shared memory (s_eid) */
        LL_PATH_TOKENS, /* token by token (ll_send_tokens), counted likewise */
};

/* Dispatch. Send phase: one warp per (token, k) pair takes the pair's slot
 * at the expert's rank (our first slot there plus a position among our
 * pairs) and streams the row there, cast to FP8 on the way when asked,
 * scales column-major per expert ([scale][slot], as DeepEP returns them).
 * The K warps of a token read the same row (from L2 after the first); with
 * tokens for half the blocks or more, the send goes token by token instead
 * (ll_send_tokens). Each block then arrives at every rank (ll_arrive).
 * Receive phase (alone in one block for a hook, else by block 0 after its
 * share of the send): ll_recv_counts. */
template <typename Idx, int Path>
__device__ __forceinline__ void ll_dispatch(const struct moeep_ctx &ctx, const int4 *x, int num_tokens,
                                            const Idx *topk_idx, int K, int b, int S, int use_fp8, int round_scale,
                                            int phases, int *stats) {
        __shared__ int s_begin[MOEEP_KERNEL_MAX_EXPERTS];
        const int lane = threadIdx.x % 32, R = ctx.ranks, me = ctx.rank, H = ctx.hidden, epr = ctx.num_experts / R;
        const int warps = gridDim.x * LL_WARPS, gwarp = ll_warp_index(), n16 = H / 8;
        const size_t slots = (size_t)S, xrow = (size_t)H * (use_fp8 ? 1 : 2);
        const int nscales = H / MOEEP_SCALE_BLOCK;

        if (!(phases & MOEEP_LL_SEND)) {
                const uint64_t seq = *ll_seq_of(ctx, false, b);
                if (ctx.shrink)
                        ll_recv_shrink(ctx, b, seq, stats, slots, ll_decision_of(ctx, &ctx.state->ll_send_view[b], seq),
                                       false, false);
                else
                        ll_recv(ctx, b, seq, stats, slots, ctx.state->ll_fp8[b], false);
                return;
        }
        const uint64_t seq = *ll_seq_of(ctx, false, b) + 1;
        const int pairs = num_tokens * K;
        __shared__ uint32_t s_dec[2]; /* elastic: the ranks left out, the view (ll_exchange_counts) */

        /* With every rank mapped and up to LL_SCAN_PAIRS pairs, every block
         * keeps every pair's expert in shared memory (s_eid) and counts a
         * pair's position among ours for its expert there: no claim, no
         * counter to reset, no block waits for another. By token, the send
         * goes token by token (ll_send_tokens), each row loaded and cast
         * once for its K pairs. Otherwise the pair loop below. The paths
         * are instances of their own: the token path's registers and
         * shared memory made every launch of the kernel slower, the
         * receive alone included. */
        constexpr bool scan = Path != LL_PATH_CLAIM, by_token = Path == LL_PATH_TOKENS;
        __shared__ __align__(16) uint16_t s_eid[scan ? LL_SCAN_PAIRS : 8];
        static_assert(MOEEP_KERNEL_MAX_EXPERTS < LL_NO_EXPERT, "expert ids fit 16 bits");
        const int t0 = (blockIdx.x + gridDim.x - 1) % gridDim.x; /* block 0 last */
        int64_t ids[LL_IDS];
        static_assert(LL_SCAN_PAIRS % LL_THREADS == 0, "ll_load_ids: whole rounds");
        if (scan) /* first: the counts wait for them, the rows only later */
                ll_load_ids(topk_idx, pairs, ids);
        int4 v[8];
        if (by_token && t0 < num_tokens) /* the row does not depend on the counts */
                ll_load_token_steps(x + (size_t)t0 * n16, 0, n16, v);
        const bool dedup = by_token && moeep_ll_dedup(&ctx);
        ll_exchange_counts(ctx, topk_idx, pairs, K, b, seq, s_begin, scan ? s_eid : (uint16_t *)nullptr, ids, s_dec,
                           use_fp8, dedup);
        const uint32_t skip = ctx.shrink ? s_dec[0] : 0;
        if (by_token)
                ll_send_tokens(ctx, x, num_tokens, K, b, seq, slots, use_fp8, round_scale, s_begin, s_eid, t0, v,
                               dedup);

        /* A pair is moved by a group of G warps of one block, each taking a
         * share of the row's 2048-channel steps (whole 128-channel scale
         * groups): with few pairs (a decode step of a few tokens) a warp
         * then has one round of loads in flight instead of a row's four in
         * a chain. The group's first warp finds the slot and passes it on
         * through shared memory and the group's named barrier (ids 1..16 /
         * G). G is the same in every block; groups are numbered across
         * blocks first, block 0 (which broadcast the counts first, and
         * receives) last. */
        const int nsteps = (n16 + 255) / 256;
        const int G = pairs * 4 <= warps ? 4 : pairs * 2 <= warps ? 2 : 1;
        const int wib = threadIdx.x / 32, group = wib / G, share = wib % G;
        const int groups = gridDim.x * (LL_WARPS / G);
        const int ggroup = group * gridDim.x + (blockIdx.x + gridDim.x - 1) % gridDim.x;
        const int s0 = share * nsteps / G, s1 = (share + 1) * nsteps / G;
        __shared__ uint32_t s_pos[LL_WARPS / 2][2]; /* [group][parity of the group's barriers]: the claimed slot */
        static_assert(LL_WARPS / 2 + 1 <= 16, "named barriers: one per group of a block, after barrier 0");

        int phase = 0; /* barriers this group passed */
        for (int item = by_token ? pairs : ggroup; item < pairs; item += groups) {
                const int t = item / K, k = item % K;
                const int64_t e = !scan ? (int64_t)topk_idx[item] : s_eid[item] == LL_NO_EXPERT ? -1 : s_eid[item];
                /* the same for every warp of the group; s_eid has no pair for a rank left out */
                if (e < 0 || e >= ctx.num_experts || (skip >> (e / epr) & 1)) {
                        if (share == 0 && lane == 0)
                                ll_note_ref(ctx, b, t, k, LL_NO_EXPERT, -1, slots);
                        continue;
                }
                const int d = (int)(e / epr), le = (int)(e % epr);
                const bool remote = px_remote(ctx, d);
                const int4 *row = x + (size_t)t * n16;
                /* The first step's loads go out before the slot is known. */
                ll_load_steps(row, s0 * 256, n16, v);
                uint32_t pos = 0;
                if (scan) { /* every rank mapped; the whole first warp counts */
                        if (share == 0)
                                pos = (uint32_t)s_begin[e] + ll_pairs_before(s_eid, item, (uint32_t)e);
                } else if (share == 0 && lane == 0) {
                        pos = remote ? atomicAdd(&ctx.px.state->ll_claim[b][d], 1u)
                                     : (uint32_t)s_begin[e] + atomicAdd(&ctx.state->ll_pos[b][e], 1u);
                }
                if (G > 1) {
                        /* Two slots by barrier parity: the first warp writes
                         * a slot again only after the group's next barrier,
                         * where every warp arrives after reading it. */
                        if (share == 0 && lane == 0)
                                s_pos[group][phase & 1] = pos;
                        asm volatile("bar.sync %0, %1;" ::"r"(1 + group), "r"(G * 32) : "memory");
                        pos = s_pos[group][phase & 1];
                        phase++;
                } else {
                        pos = __shfl_sync(0xffffffffu, pos, 0);
                }
                if ((size_t)pos >= (remote ? (size_t)ctx.px.ll_slots : slots)) {
                        /* Only possible when a token names one expert twice. */
                        if (share == 0 && lane == 0) {
                                record_error(ctx, MOEEP_KERR_OVERFLOW, d);
                                ll_note_ref(ctx, b, t, k, LL_NO_EXPERT, -1, slots);
                        }
                        continue;
                }
                const size_t slot = (size_t)le * slots + pos;
                char *dst;
                float *sc;
                size_t sc_stride; /* between the scales of one slot */
                int32_t *info;
                if (remote) { /* staged: row, scales, then (local expert, packed source info) */
                        dst = px_send_seg(ctx, ctx.px.ll_dispatch[b], ctx.px.ll_dispatch_seg, d) + MOEEP_PX_SEG_HDR +
                              MOEEP_PX_LL_COUNTS + pos * px_pair_bytes(xrow, H);
                        sc = (float *)(dst + xrow);
                        sc_stride = 1;
                        info = (int32_t *)(sc + (use_fp8 ? nscales : 0));
                } else {
                        dst = ctx.peers[d] + ctx.ll.x[b] + slot * xrow;
                        sc = (float *)(ctx.peers[d] + ctx.ll.scales[b]) + (size_t)le * nscales * slots + pos;
                        sc_stride = slots;
                        info = (int32_t *)(ctx.peers[d] + ctx.ll.src[b]) + slot;
                }
                for (int st = s0; st < s1; st++) {
                        const int base = st * 256; /* int4 of the row: four warp steps of 64 */
                        if (st > s0)               /* the first step was loaded above */
                                ll_load_steps(row, base, n16, v);
#pragma unroll
                        for (int u = 0; u < 4; u++) {
                                const int c = base + u * 64 + 2 * lane; /* first int4 of the pair */
                                if (base + u * 64 >= n16)
                                        break; /* warp-uniform: n16 is a multiple of 32 */
                                if (use_fp8) {
                                        float scale;
                                        const int4 q = ll_cast16(v[2 * u], v[2 * u + 1], round_scale, &scale);
                                        if (c < n16) {
                                                st_na_v4((int4 *)dst + c / 2, q);
                                                if (lane % 8 == 0)
                                                        sc[(size_t)(c / 16) * sc_stride] = scale;
                                        }
                                } else if (c < n16) {
                                        st_na_v4((int4 *)dst + c, v[2 * u]);
                                        st_na_v4((int4 *)dst + c + 1, v[2 * u + 1]);
                                }
                        }
                }
                if (share == 0 && lane == 0) {
                        ll_note_ref(ctx, b, t, k, (uint32_t)e, (int)pos, slots);
                        if (remote) {
                                info[0] = le;
                                info[1] = moeep_px_src_pack(me, k, t);
                        } else {
                                *info = t;
                                ((int32_t *)(ctx.peers[d] + ctx.ll.kinfo[b]))[slot] = moeep_ll_kinfo_pack(me, k);
                                ll_note_pair_slot(ctx, d, b, seq, t, k, slot);
                        }
                }
        }
        /* With the receive in this launch our own pairs are not waited for
         * (ll_recv_counts). */
        const bool own_in_launch = (phases & MOEEP_LL_RECV) && !(ctx.debug & MOEEP_DEBUG_COPY_SELF);
        /* Elastic: where our pairs went, for each receiver's check; our own
         * arrival orders our pairs, which the receive may have to move. */
        if (ctx.shrink && blockIdx.x == 0)
                ll_send_digests(ctx, b, seq, s_begin, skip);
        ll_arrive(ctx, false, b, !own_in_launch || ctx.shrink, skip);
        if (!scan && last_block_done(ctx)) {
                /* Every pair of ours is placed: the claimed positions start
                 * again at 0, and what is staged for remote ranks ships. */
                for (int e = threadIdx.x; e < ctx.num_experts; e += blockDim.x)
                        ctx.state->ll_pos[b][e] = 0;
                if (ctx.px.remote && threadIdx.x == 0) {
                        /* A copy: px_ship takes its context by reference and
                         * is not inlined, which would otherwise move the
                         * kernel's parameter into local memory for every
                         * thread of every launch. */
                        const struct moeep_ctx c = ctx;
                        px_ship(c, c.px.ll_dispatch[b], c.px.ll_dispatch_seg, c.px.state->ll_claim[b],
                                px_pair_bytes(xrow, H), MOEEP_PX_COUNTER_LL_DISPATCH(b, 0),
                                px_seg_info(c.px.epoch + seq, (uint32_t)xrow, 0, 0), MOEEP_PX_LL_COUNTS, skip);
                }
        }
        if (threadIdx.x == 0)
                *ll_seq_of(ctx, false, b) = seq;
        if (threadIdx.x == 0 && blockIdx.x == 0)
                ctx.state->ll_fp8[b] = (uint32_t)use_fp8; /* for a receive alone */
        /* Without a hook block 0 goes on with the receive phase, which
         * waits for the other ranks' pairs (ours land before the launch
         * ends), and where tokens may come once per rank every block then
         * copies them to their slots (ll_recv: the launch is cooperative). */
        if ((phases & MOEEP_LL_RECV) && ctx.shrink && blockIdx.x == 0)
                ll_recv_shrink(ctx, b, seq, stats, slots, s_dec[1] | skip << 8 | (use_fp8 ? LL_DEC_FP8 : 0), false,
                               own_in_launch);
        else if ((phases & MOEEP_LL_RECV) && !ctx.shrink)
                ll_recv(ctx, b, seq, stats, slots, use_fp8, own_in_launch);
}

namespace moeep_ll {

/* The kernels DeepEP's profilers see: one name per operation, each phase
 * (send, receive, or both) one launch. */
template <typename Idx, int Path>
__global__ void __launch_bounds__(LL_THREADS, 1)
        dispatch(struct moeep_ctx ctx, const int4 *x, int num_tokens, const Idx *topk_idx, int K, int b, int S,
                 int use_fp8, int round_scale, int phases, int *stats) {
        grid_dep_wait();   /* the kernel before us (launch_kernel): its writes */
        grid_dep_launch(); /* the next may take our SMs as our blocks end */
        ll_dispatch<Idx, Path>(ctx, x, num_tokens, topk_idx, K, b, S, use_fp8, round_scale, phases, stats);
}

} /* namespace moeep_ll */

extern "C" int moeep_launch_ll_dispatch(const struct moeep_ctx *ctx, const struct moeep_ll_dispatch_launch *a,
                                        cudaStream_t stream) {
        MOEEP_CUDA_LAUNCH_BEGIN();
        /* Positions are counted in shared memory with every rank mapped
         * (ranks behind the proxy claim staging slots per pair) and up to
         * LL_SCAN_PAIRS pairs; the send then goes token by token with
         * tokens for at least half the blocks (moeep_ll_by_token; fewer:
         * pairs spread over more warps cost less than one token per block,
         * which leaves most SMs idle). A receive alone (a hook, given the
         * send's token and top-k counts) runs the instance its send ran, so
         * that a call shape shows one kernel name: DeepEP's profiling counts
         * the names that contain "dispatch" and wants exactly one. The
         * receive alone is one block's work, or every block's where tokens
         * may come once per rank (moeep_ll_dedup): then every block of a
         * launch with both phases waits for the other ranks, and the launch
         * is cooperative or plain (launch_phases). */
        const bool dedup = moeep_ll_dedup(ctx);
        const bool scan = !ctx->px.remote && (long)a->num_tokens * a->num_topk <= LL_SCAN_PAIRS;
        const int path = !scan                                                ? LL_PATH_CLAIM
                         : moeep_ll_by_token(ctx, a->num_tokens, a->num_topk) ? LL_PATH_TOKENS
                                                                              : LL_PATH_PAIRS;
        auto launch = [&](int p, bool cooperative) {
                return with_index_type(a->idx_is_int64, [&](auto idx) {
                        using Idx = decltype(idx);
                        auto *kernel = path == LL_PATH_TOKENS  ? moeep_ll::dispatch<Idx, LL_PATH_TOKENS>
                                       : path == LL_PATH_PAIRS ? moeep_ll::dispatch<Idx, LL_PATH_PAIRS>
                                                               : moeep_ll::dispatch<Idx, LL_PATH_CLAIM>;
                        const unsigned blocks = (p & MOEEP_LL_SEND) || dedup ? (unsigned)ctx->ll_num_sms : 1u;
                        return launch_kernel(kernel, blocks, LL_THREADS, 0, stream, cooperative,
                                             !(ctx->debug & MOEEP_DEBUG_NO_PDL), *ctx, (const int4 *)a->x,
                                             a->num_tokens, (const Idx *)a->topk_idx, a->num_topk, a->set, a->slots,
                                             a->use_fp8, a->round_scale, p, a->stats);
                });
        };
        const cudaError_t e = launch_phases(ctx, stream, launch, a->phases, MOEEP_LL_SEND, MOEEP_LL_RECV, dedup);
        if (e != cudaSuccess)
                return (int)e;
        MOEEP_CUDA_LAUNCH_CHECK();
        return 0;
}
