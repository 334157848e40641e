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
 *   count[b][le]     the received counts, for the caller and combine;
 *   flags            per source rank, the set's sequence number, released
 *                    after the source's rows landed. */
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include "kernels.h"
#include "ptx.cuh"
#include "px.cuh"
#include "wait.cuh"

/* Warps numbered across blocks first: the few hundred work items of a
 * decode step spread over every SM instead of filling the first blocks. */
__device__ __forceinline__ int ll_warp_index(void) {
        return (int)(threadIdx.x / 32 * gridDim.x + blockIdx.x);
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

/* The receive phase, in one block: waits for every source's pairs of set
 * b, sequence seq, then publishes the counts (count[b]), each source's
 * range of slots (DeepEP's layout_range: begin << 32 | count, sources in
 * rank order) and the statistics. Remote sources' pairs were placed by the
 * relay after every local source's, one run per source, in rank order. */
__device__ __forceinline__ void ll_recv_counts(const struct moeep_ctx &ctx, int b, uint64_t seq, int *stats) {
        struct moeep_ll_sync *my = ll_sync_of(ctx, ctx.rank);
        const int tid = threadIdx.x, R = ctx.ranks, epr = ctx.num_experts / R;
        int64_t *range = (int64_t *)(ctx.peers[ctx.rank] + ctx.ll.range[b]);

        if (tid < R && !px_remote(ctx, tid)) /* remote sources: the relay placed their pairs */
                wait_flag(ctx, &my->dispatch_flag[b][tid], seq, tid);
        __syncthreads();
        for (int le = tid; le < epr; le += blockDim.x) {
                const int e = ctx.rank * epr + le;
                int64_t begin = 0;
                for (int pass = 0; pass < 2; pass++) /* local sources in rank order, then remote ones */
                        for (int s = 0; s < R; s++) {
                                if (px_remote(ctx, s) != (pass == 1))
                                        continue;
                                const int32_t c = *(volatile int32_t *)&my->table[b][s][e];
                                range[(size_t)le * R + s] = moeep_ll_range_pack(begin, c);
                                begin += c;
                                if (pass == 1)
                                        my->table[b][s][e] = 0; /* the relay adds into it */
                        }
                my->count[b][le] = (int32_t)begin;
                if (stats)
                        stats[le] += (int)begin;
        }
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

/* Where our pairs start in every expert's slots: after the pairs of the
 * ranks below us, whose counts every rank broadcasts first (table rows,
 * released by count_flag). Block 0 counts our pairs per expert (a few
 * thousand ids, in shared memory) and broadcasts them; every block sums
 * the rows of the ranks below us. s_begin[e] is our first slot at expert e.
 * With s_eid, every block also keeps every pair's expert there
 * (LL_NO_EXPERT when masked). */
template <typename Idx>
__device__ __forceinline__ void ll_exchange_counts(const struct moeep_ctx &ctx, const Idx *topk_idx, int n, int b,
                                                   uint64_t seq, int *s_begin, uint16_t *s_eid) {
        struct moeep_ll_sync *my = ll_sync_of(ctx, ctx.rank);
        const int tid = threadIdx.x, R = ctx.ranks, E = ctx.num_experts, me = ctx.rank;

        if (blockIdx.x == 0) {
                for (int e = tid; e < E; e += blockDim.x)
                        s_begin[e] = 0; /* our counts first */
                __syncthreads();
                for (int i = tid; i < n; i += blockDim.x) {
                        const int64_t e = (int64_t)topk_idx[i];
                        const bool valid = e >= 0 && e < E;
                        if (valid)
                                atomicAdd(&s_begin[e], 1);
                        if (s_eid)
                                s_eid[i] = valid ? (uint16_t)e : LL_NO_EXPERT;
                }
                __syncthreads();
                const int epr = E / R;
                for (int i = tid; i < R * E; i += blockDim.x) {
                        const int d = i / E;
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
                if (tid < R && !px_remote(ctx, tid))
                        st_release_sys(&ll_sync_of(ctx, tid)->count_flag[b][me], seq);
        } else if (s_eid) {
                for (int i = tid; i < n; i += blockDim.x) {
                        const int64_t e = (int64_t)topk_idx[i];
                        s_eid[i] = e >= 0 && e < E ? (uint16_t)e : LL_NO_EXPERT;
                }
        }
        if (tid < me && !px_remote(ctx, tid))
                wait_flag(ctx, &my->count_flag[b][tid], seq, tid);
        __syncthreads();
        for (int e = tid; e < E; e += blockDim.x) {
                int begin = 0;
                for (int s = 0; s < me; s++)
                        if (!px_remote(ctx, s))
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

/* The send phase token by token, when every destination is mapped and
 * the positions are counted in shared memory: a block takes a token (the
 * first, t0, from block 0 last), its warps a share of the row's 64-int4
 * steps each, and each step is loaded and cast once for all K pairs of
 * the token instead of once per pair. Warp k counts pair k's slot first
 * (-1: masked or overflowing) for the whole block. v holds the first
 * token's first batch of steps, loaded by the caller. */
__device__ __forceinline__ void ll_send_tokens(const struct moeep_ctx &ctx, const int4 *x, int num_tokens, int K, int b,
                                               size_t slots, int use_fp8, int round_scale, const int *s_begin,
                                               const uint16_t *s_eid, int t0, int4 v[8]) {
        __shared__ int s_slot[MOEEP_KERNEL_MAX_TOPK];
        const int lane = threadIdx.x % 32, wib = threadIdx.x / 32, me = ctx.rank, H = ctx.hidden;
        const int epr = ctx.num_experts / ctx.ranks, n16 = H / 8, nws = (n16 + 63) / 64;
        const int nscales = H / MOEEP_SCALE_BLOCK;
        const size_t xrow = (size_t)H * (use_fp8 ? 1 : 2);

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
                        if (lane == 0)
                                s_slot[wib] = pos;
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
                                        const int pos = s_slot[k];
                                        if (pos < 0)
                                                continue;
                                        const uint32_t e = s_eid[t * K + k];
                                        const int d = (int)(e / epr), le = (int)(e % epr);
                                        const size_t slot = (size_t)le * slots + pos;
                                        int4 *dst = (int4 *)(ctx.peers[d] + ctx.ll.x[b] + slot * xrow);
                                        if (use_fp8) {
                                                st_na_v4(dst + c / 2, q);
                                                if (lane % 8 == 0)
                                                        ((float *)(ctx.peers[d] + ctx.ll.scales[b]))
                                                                [((size_t)le * nscales + c / 16) * slots + pos] = scale;
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
                        ((int32_t *)(ctx.peers[d] + ctx.ll.src[b]))[slot] = t;
                        ((int32_t *)(ctx.peers[d] + ctx.ll.kinfo[b]))[slot] = moeep_ll_kinfo_pack(me, lane);
                }
                __syncthreads(); /* s_slot is the next token's */
        }
}

/* Dispatch. Send phase: one warp per (token, k) pair takes the pair's slot
 * at the expert's rank (our first slot there plus a position among our
 * pairs from a local counter) and streams the row there, cast to FP8 on
 * the way when asked, scales column-major per expert ([scale][slot], as
 * DeepEP returns them). The K warps of a token read the same row (from L2
 * after the first); with tokens for half the blocks or more, the send goes
 * token by token instead (ll_send_tokens). Receive phase (alone in one block for a hook, else by
 * the send phase's last block): ll_recv_counts. */
template <typename Idx, bool ByToken>
__device__ __forceinline__ void ll_dispatch(const struct moeep_ctx &ctx, const int4 *x, int num_tokens,
                                            const Idx *topk_idx, int K, int b, int S, int use_fp8, int round_scale,
                                            int phases, int *stats) {
        __shared__ int s_begin[MOEEP_KERNEL_MAX_EXPERTS];
        const int lane = threadIdx.x % 32, R = ctx.ranks, me = ctx.rank, H = ctx.hidden, epr = ctx.num_experts / R;
        const int warps = gridDim.x * LL_WARPS, gwarp = ll_warp_index(), n16 = H / 8;
        const size_t slots = (size_t)S, xrow = (size_t)H * (use_fp8 ? 1 : 2);
        const int nscales = H / MOEEP_SCALE_BLOCK;

        if (!(phases & MOEEP_LL_SEND)) {
                ll_recv_counts(ctx, b, ctx.state->ll_seq[b], stats);
                return;
        }
        const uint64_t seq = ctx.state->ll_seq[b] + 1;
        const int pairs = num_tokens * K;

        /* ByToken (moeep_launch_ll_dispatch chose it): the send goes token by
         * token (ll_send_tokens), each row loaded and cast once for its K
         * pairs, slots counted in shared memory. Otherwise the pair loop
         * below. The two are instances of their own: the token path's
         * registers and shared memory made every launch of the kernel
         * slower, the receive alone included. */
        __shared__ __align__(16) uint16_t s_eid[ByToken ? LL_SCAN_PAIRS : 8];
        static_assert(MOEEP_KERNEL_MAX_EXPERTS < LL_NO_EXPERT, "expert ids fit 16 bits");
        constexpr bool by_token = ByToken;
        const int t0 = (blockIdx.x + gridDim.x - 1) % gridDim.x; /* block 0 last */
        int4 v[8];
        if (by_token && t0 < num_tokens) /* the row does not depend on the counts */
                ll_load_token_steps(x + (size_t)t0 * n16, 0, n16, v);
        ll_exchange_counts(ctx, topk_idx, pairs, b, seq, s_begin, by_token ? s_eid : (uint16_t *)nullptr);
        if (by_token)
                ll_send_tokens(ctx, x, num_tokens, K, b, slots, use_fp8, round_scale, s_begin, s_eid, t0, v);

        /* A pair is moved by a group of G warps of one block, each taking a
         * share of the row's 2048-channel steps (whole 128-channel scale
         * groups): with few pairs (a decode step of a few tokens) a warp
         * then has one round of loads in flight instead of a row's four in
         * a chain. The group's first warp claims the slot and passes it on
         * through shared memory and the group's named barrier (ids 1..16 /
         * G). G is the same in every block; groups are numbered across
         * blocks first, block 0 (which broadcast the counts first) last. */
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
                const int64_t e = (int64_t)topk_idx[item];
                if (e < 0 || e >= ctx.num_experts)
                        continue; /* the same for every warp of the group */
                const int d = (int)(e / epr), le = (int)(e % epr);
                const bool remote = px_remote(ctx, d);
                const int4 *row = x + (size_t)t * n16;
                /* The first step's loads go out before the slot is known. */
                ll_load_steps(row, s0 * 256, n16, v);
                uint32_t pos = 0;
                if (share == 0 && lane == 0)
                        pos = remote ? atomicAdd(&ctx.px.state->ll_claim[b][d], 1u)
                                     : (uint32_t)s_begin[e] + atomicAdd(&ctx.state->ll_pos[b][e], 1u);
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
                        if (share == 0 && lane == 0)
                                record_error(ctx, MOEEP_KERR_OVERFLOW, d);
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
                        if (remote) {
                                info[0] = le;
                                info[1] = moeep_px_src_pack(me, k, t);
                        } else {
                                *info = t;
                                ((int32_t *)(ctx.peers[d] + ctx.ll.kinfo[b]))[slot] = moeep_ll_kinfo_pack(me, k);
                        }
                }
        }
        if (!last_block_done(ctx))
                return;
        /* Every pair of ours is placed: the claimed positions start again
         * at 0 (the pair loop's; ll_send_tokens claims none). */
        if (!by_token)
                for (int e = threadIdx.x; e < ctx.num_experts; e += blockDim.x)
                        ctx.state->ll_pos[b][e] = 0;
        if (threadIdx.x == 0)
                ctx.state->ll_seq[b] = seq;
        if (threadIdx.x < R && !px_remote(ctx, threadIdx.x))
                st_release_sys(&ll_sync_of(ctx, threadIdx.x)->dispatch_flag[b][me], seq);
        if (ctx.px.remote && threadIdx.x == 0) {
                /* A copy: px_ship takes its context by reference and is not
                 * inlined, which would otherwise move the kernel's parameter
                 * into local memory for every thread of every launch. */
                const struct moeep_ctx c = ctx;
                px_ship(c, c.px.ll_dispatch[b], c.px.ll_dispatch_seg, c.px.state->ll_claim[b], px_pair_bytes(xrow, H),
                        MOEEP_PX_COUNTER_LL_DISPATCH(b, 0), px_seg_info(c.px.epoch + seq, (uint32_t)xrow, 0, 0),
                        MOEEP_PX_LL_COUNTS);
        }
        /* Without a hook the last block goes on with the receive phase: it
         * waits only for other GPUs, never for blocks of this grid. */
        if (phases & MOEEP_LL_RECV)
                ll_recv_counts(ctx, b, seq, stats);
}

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
 * row (token, k) of its source's combine area. `seq` is the sequence number
 * of this combine on set b (ll_comb_seq[b] + 1, read when the launch began:
 * the last block stores it). */
__device__ __forceinline__ void ll_combine_send(const struct moeep_ctx &ctx, const int4 *y, int b, int S,
                                                uint64_t seq) {
        const struct moeep_ll_sync *my = ll_sync_of(ctx, ctx.rank);
        const int lane = threadIdx.x % 32, R = ctx.ranks, me = ctx.rank, H = ctx.hidden, epr = ctx.num_experts / R;
        const int warps = gridDim.x * LL_WARPS, gwarp = ll_warp_index();
        const size_t slots = (size_t)S;
        const int32_t *src = (const int32_t *)(ctx.peers[me] + ctx.ll.src[b]);
        const int32_t *kinfo = (const int32_t *)(ctx.peers[me] + ctx.ll.kinfo[b]);

        /* The slots in use are the first count[le] of each expert; warps walk
         * them as one list (prefix over the experts in shared memory). The
         * scan is one expert per thread, in one round of loads: a loop of
         * one thread over the experts cost a chain of L2 round trips (about
         * 18 at 288 experts) before any row moved. */
        __shared__ int s_prefix[MOEEP_KERNEL_MAX_EXPERTS + 1];
        __shared__ int s_warp_sum[LL_WARPS];
        static_assert(MOEEP_KERNEL_MAX_EXPERTS <= LL_THREADS, "the scan takes one local expert per thread");
        {
                const int le = threadIdx.x, w = threadIdx.x / 32;
                const int c = le < epr ? my->count[b][le] : 0;
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
                const int le = lo, pos = q - s_prefix[lo];
                const size_t slot = (size_t)le * slots + pos;
                const int4 *row = y + slot * n16;
                /* The first chunk's loads go out before the slot's source is
                 * read, so that both are in flight together. */
                int4 v[LL_COMBINE_SEND_UNROLL];
                ll_load_chunk(row, c0 * chunk, n16, v);
                const int t = src[slot], ki = kinfo[slot];
                const int s = moeep_ll_kinfo_rank(ki), k = moeep_ll_kinfo_k(ki);
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
        if (!last_block_done(ctx))
                return;
        if (threadIdx.x == 0)
                ctx.state->ll_comb_seq[b] = seq;
        if (threadIdx.x < R && !px_remote(ctx, threadIdx.x))
                st_release_sys(&ll_sync_of(ctx, threadIdx.x)->combine_flag[b][me], seq);
        if (ctx.px.remote && threadIdx.x == 0) {
                const struct moeep_ctx c = ctx; /* see dispatch */
                px_ship(c, c.px.ll_combine[b], c.px.ll_combine_seg, c.px.state->ll_comb_claim[b], c.px.ll_row,
                        MOEEP_PX_COUNTER_LL_COMBINE(b, 0), px_seg_info(c.px.epoch + seq, (uint32_t)H * 2, 0, 0));
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
        const uint64_t seq = ctx.state->ll_seq[b];
        char *own = ctx.peers[ctx.rank];

        /* Remote sources' pairs go after every local source's, one run of
         * slots per source, in rank order: each starts after the local
         * sources' counts (their table rows) and the earlier remote
         * sources' (the counts ahead of their staged pairs). */
        __shared__ int s_base[MOEEP_KERNEL_MAX_EXPERTS];
        if (threadIdx.x < R && !px_remote(ctx, threadIdx.x))
                wait_flag(ctx, &my->count_flag[b][threadIdx.x], seq, threadIdx.x);
        __syncthreads();
        for (int le = threadIdx.x; le < epr; le += blockDim.x) {
                int local = 0;
                for (int r = 0; r < R; r++)
                        if (!px_remote(ctx, r))
                                local += *(volatile int32_t *)&my->table[b][r][ctx.rank * epr + le];
                s_base[le] = local;
        }
        __syncthreads();

        for (int s = 0; s < ctx.ranks; s++) {
                if (!px_remote(ctx, s))
                        continue;
                const struct moeep_px_seg *h = px_block_wait(ctx, ctx.px.ll_dispatch[b], ctx.px.ll_dispatch_seg,
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
        ll_recv_counts(ctx, b, seq, stats);
}

/* Places the expert outputs remote ranks staged for our tokens (set b)
 * into our combine rows; the receive phase of combine follows. */
__global__ void __launch_bounds__(LL_THREADS, 1) ll_rows_relay(struct moeep_ctx ctx, int b) {
        const int H = ctx.hidden;
        const int warps = gridDim.x * LL_WARPS, gwarp = ll_warp_index();
        const uint64_t seq = ctx.state->ll_comb_seq[b];
        char *comb = ctx.peers[ctx.rank] + ctx.ll.comb[b];

        for (int s = 0; s < ctx.ranks; s++) {
                if (!px_remote(ctx, s))
                        continue;
                const struct moeep_px_seg *h = px_block_wait(ctx, ctx.px.ll_combine[b], ctx.px.ll_combine_seg,
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
 * add nothing. */
template <typename Idx>
__device__ __forceinline__ void ll_combine_recv(const struct moeep_ctx &ctx, const Idx *topk_idx, const float *weights,
                                                int num_tokens, int K, int b, uint64_t seq, int4 *out) {
        const struct moeep_ll_sync *my = ll_sync_of(ctx, ctx.rank);
        const int lane = threadIdx.x % 32, H = ctx.hidden;
        const int warps = gridDim.x * LL_WARPS, gwarp = ll_warp_index();
        const char *comb = ctx.peers[ctx.rank] + ctx.ll.comb[b];

        /* Work items (token, 512 channels of the row), so that a few tokens
         * still keep every warp busy; the K rows of a position are loaded
         * together. The ids and weights of a warp's first item (the
         * caller's, not another rank's) are read while the flags are
         * waited for. */
        const int n16 = H / 8, pieces = (n16 + LL_RECV_PIECE - 1) / LL_RECV_PIECE;
        const int items = num_tokens * pieces;
        int64_t e_first = -1;
        float wt_first = 0.0f;
        if (gwarp < items && lane < K) { /* both loads in flight together: the weight is read even when masked */
                e_first = (int64_t)topk_idx[(size_t)(gwarp / pieces) * K + lane];
                wt_first = weights[(size_t)(gwarp / pieces) * K + lane];
        }
        if (threadIdx.x < ctx.ranks && !px_remote(ctx, threadIdx.x)) /* remote ranks: ll_rows_relay ran before */
                wait_flag(ctx, &my->combine_flag[b][threadIdx.x], seq, threadIdx.x);
        __syncthreads();
        for (int item = gwarp; item < items; item += warps) {
                const int t = item / pieces, i0 = (item % pieces) * LL_RECV_PIECE, i1 = min(n16, i0 + LL_RECV_PIECE);
                float w = 0.0f;
                uint32_t valid = 0;
                if (lane < K) {
                        const int64_t e = item == gwarp ? e_first : (int64_t)topk_idx[(size_t)t * K + lane];
                        const float wt = item == gwarp ? wt_first : weights[(size_t)t * K + lane];
                        valid = e >= 0 && e < ctx.num_experts;
                        w = valid ? wt : 0.0f;
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

namespace moeep_ll {

/* The kernels DeepEP's profilers see: one name per operation, each phase
 * (send, receive, or both) one launch. */
template <typename Idx, bool ByToken>
__global__ void __launch_bounds__(LL_THREADS, 1)
        dispatch(struct moeep_ctx ctx, const int4 *x, int num_tokens, const Idx *topk_idx, int K, int b, int S,
                 int use_fp8, int round_scale, int phases, int *stats) {
        ll_dispatch<Idx, ByToken>(ctx, x, num_tokens, topk_idx, K, b, S, use_fp8, round_scale, phases, stats);
}

/* Combine: the send phase, the receive phase (the sum), or both. With both,
 * every block waits in the receive for the flags that the send's last block
 * releases, so the launch is cooperative (every block resident at once);
 * the sequence number is read once here, before that last block stores
 * the new one. */
template <typename Idx>
__global__ void __launch_bounds__(LL_THREADS, 1)
        combine(struct moeep_ctx ctx, const int4 *y, int b, int S, int phases, const Idx *topk_idx,
                const float *weights, int num_tokens, int K, int4 *out) {
        const uint64_t seq = ctx.state->ll_comb_seq[b] + ((phases & MOEEP_LL_SEND) ? 1 : 0);

        if (phases & MOEEP_LL_SEND)
                ll_combine_send(ctx, y, b, S, seq);
        if (phases & MOEEP_LL_RECV)
                ll_combine_recv<Idx>(ctx, topk_idx, weights, num_tokens, K, b, seq, out);
}

} /* namespace moeep_ll */

template <typename Idx, bool ByToken>
static void ll_dispatch_launch(const struct moeep_ctx *ctx, const void *x, int num_tokens, const void *topk_idx,
                               int num_topk, int set, int slots, int use_fp8, int round_scale, int phases, int *stats,
                               int blocks, cudaStream_t stream) {
        moeep_ll::dispatch<Idx, ByToken><<<blocks, LL_THREADS, 0, stream>>>(*ctx, (const int4 *)x, num_tokens,
                                                                            (const Idx *)topk_idx, num_topk, set, slots,
                                                                            use_fp8, round_scale, phases, stats);
}

extern "C" int moeep_launch_ll_dispatch(const struct moeep_ctx *ctx, const void *x, int num_tokens,
                                        const void *topk_idx, int idx_is_int64, int num_topk, int set, int slots,
                                        int use_fp8, int round_scale, int phases, int *stats, cudaStream_t stream) {
        MOEEP_CUDA_LAUNCH_BEGIN();
        /* The receive phase alone is one block's work. The send goes token
         * by token with tokens for at least half the blocks (fewer: pairs
         * spread over more warps cost less than one token per block, which
         * leaves most SMs idle), every rank mapped (ranks behind the proxy
         * claim staging slots per pair) and up to LL_SCAN_PAIRS pairs. A
         * receive alone (a hook, given the send's token and top-k counts)
         * runs the instance its send ran, so that a call shape shows one
         * kernel name: DeepEP's profiling counts the names that contain
         * "dispatch" and wants exactly one. */
        const int blocks = (phases & MOEEP_LL_SEND) ? ctx->ll_num_sms : 1;
        const bool by_token =
                !ctx->px.remote && (long)num_tokens * num_topk <= LL_SCAN_PAIRS && 2 * num_tokens >= ctx->ll_num_sms;
        if (idx_is_int64 && by_token)
                ll_dispatch_launch<int64_t, true>(ctx, x, num_tokens, topk_idx, num_topk, set, slots, use_fp8,
                                                  round_scale, phases, stats, blocks, stream);
        else if (idx_is_int64)
                ll_dispatch_launch<int64_t, false>(ctx, x, num_tokens, topk_idx, num_topk, set, slots, use_fp8,
                                                   round_scale, phases, stats, blocks, stream);
        else if (by_token)
                ll_dispatch_launch<int32_t, true>(ctx, x, num_tokens, topk_idx, num_topk, set, slots, use_fp8,
                                                  round_scale, phases, stats, blocks, stream);
        else
                ll_dispatch_launch<int32_t, false>(ctx, x, num_tokens, topk_idx, num_topk, set, slots, use_fp8,
                                                   round_scale, phases, stats, blocks, stream);
        MOEEP_CUDA_LAUNCH_CHECK();
        return 0;
}

/* One launch of moeep_ll::combine: cooperative when it does both phases
 * (its blocks wait for each other through the combine flag), which the
 * runtime refuses rather than run with blocks that cannot all be resident. */
template <typename Idx>
static cudaError_t ll_combine_launch(const struct moeep_ctx *ctx, const void *y, int set, int slots, int phases,
                                     const void *topk_idx, const float *weights, int num_tokens, int num_topk,
                                     void *out, cudaStream_t stream) {
        cudaLaunchConfig_t cfg = {};
        cudaLaunchAttribute attr[1];

        cfg.gridDim = dim3((unsigned)ctx->ll_num_sms);
        cfg.blockDim = dim3(LL_THREADS);
        cfg.stream = stream;
        attr[0].id = cudaLaunchAttributeCooperative;
        attr[0].val.cooperative = phases == (MOEEP_LL_SEND | MOEEP_LL_RECV);
        cfg.attrs = attr;
        cfg.numAttrs = 1;
        return cudaLaunchKernelEx(&cfg, moeep_ll::combine<Idx>, *ctx, (const int4 *)y, set, slots, phases,
                                  (const Idx *)topk_idx, weights, num_tokens, num_topk, (int4 *)out);
}

extern "C" int moeep_launch_ll_combine(const struct moeep_ctx *ctx, const void *y, int set, int slots, int phases,
                                       const void *topk_idx, int idx_is_int64, const float *weights, int num_tokens,
                                       int num_topk, void *out, cudaStream_t stream) {
        MOEEP_CUDA_LAUNCH_BEGIN();
        cudaError_t e = idx_is_int64 ? ll_combine_launch<int64_t>(ctx, y, set, slots, phases, topk_idx, weights,
                                                                  num_tokens, num_topk, out, stream)
                                     : ll_combine_launch<int32_t>(ctx, y, set, slots, phases, topk_idx, weights,
                                                                  num_tokens, num_topk, out, stream);
        if ((e == cudaErrorCooperativeLaunchTooLarge || e == cudaErrorNotSupported) &&
            phases == (MOEEP_LL_SEND | MOEEP_LL_RECV)) {
                /* Where a cooperative launch is refused (too few SMs free
                 * for the grid, or not supported here), one launch per
                 * phase as before: the same results, one launch more. */
                (void)cudaGetLastError();
                e = cudaSuccess;
                for (int p = MOEEP_LL_SEND; p <= MOEEP_LL_RECV && e == cudaSuccess; p <<= 1)
                        e = idx_is_int64 ? ll_combine_launch<int64_t>(ctx, y, set, slots, p, topk_idx, weights,
                                                                      num_tokens, num_topk, out, stream)
                                         : ll_combine_launch<int32_t>(ctx, y, set, slots, p, topk_idx, weights,
                                                                      num_tokens, num_topk, out, stream);
        }
        if (e != cudaSuccess)
                return (int)e;
        MOEEP_CUDA_LAUNCH_CHECK();
        return 0;
}

extern "C" int moeep_launch_ll_dispatch_relay(const struct moeep_ctx *ctx, int set, int slots, int *stats,
                                              cudaStream_t stream) {
        MOEEP_CUDA_LAUNCH_BEGIN();
        ll_pairs_relay<<<ctx->ll_num_sms, LL_THREADS, 0, stream>>>(*ctx, set, slots, stats);
        MOEEP_CUDA_LAUNCH_CHECK();
        return 0;
}

extern "C" int moeep_launch_ll_combine_relay(const struct moeep_ctx *ctx, int set, cudaStream_t stream) {
        MOEEP_CUDA_LAUNCH_BEGIN();
        ll_rows_relay<<<ctx->ll_num_sms, LL_THREADS, 0, stream>>>(*ctx, set);
        MOEEP_CUDA_LAUNCH_CHECK();
        return 0;
}
