/* Low-latency (decode) mode: every (token, expert) pair goes to the expert's
 * rank into a packed per-expert receive slot, FP8-cast on the way when
 * asked; combine sends each expert output back to its token's rank, which
 * sums them with the top-k weights.
 *
 * Every call uses one of two buffer sets, chosen by the host (b); calls on
 * one set must follow the rule of moeep_ep.h (dispatch n+2 after combine n),
 * which is what makes the kernels' resets of their counters safe.
 *
 * Buffers of set b in every rank's NVLink buffer (struct moeep_ll_layout):
 *   x, scales, src   [local expert][ranks * max_tokens] slots, written by the
 *                    senders: after the lower ranks' pairs (the table),
 *                    at the pair's position among the sender's own;
 *   comb             [max_tokens][max_topk] rows, written by the expert ranks;
 *   count[b][le]     the received counts, for the caller and combine;
 *   count_flag       per source rank, the set's sequence number, released
 *                    after the source's table row landed;
 *   dispatch_flag,   per source rank, the arrivals of the source's blocks
 *   combine_flag     (ll_arrive): no block of a launch waits for another
 *                    to signal that the launch's rows landed.
 *
 * What the files of ll/ share: warps numbered across blocks, the blocks'
 * sequence numbers, the arrival at every rank (ll_arrive), and the receive
 * phase of the dispatch (ll_recv_counts), which the dispatch (dispatch.cu)
 * and its relay (relay.cu) both end with. */
#pragma once

#include "common/ptx.cuh"
#include "common/px.cuh"
#include "common/wait.cuh"
#include "kernels.h"

/* The pair-slot entry of source `src`'s pair (t, k) in rank d's buffer. */
__device__ __forceinline__ uint64_t *ll_pair_slot(const struct moeep_ctx &ctx, int d, int b, int src, int t, int k) {
        return (uint64_t *)(ctx.peers[d] + ctx.ll.pair_slot[b]) + ((size_t)src * ctx.ll.max_tokens + t) * ctx.max_topk +
               k;
}

/* A pair-slot entry's bit for a pair whose row went once for its token
 * to rank d's token rows, which d's receive copies to the slot
 * (moeep_ll_dedup). */
#define LL_PAIR_STAGED 0x80000000u

/* The slot of a pair-slot entry. */
__device__ __forceinline__ uint32_t ll_pair_slot_index(uint64_t entry) {
        return (uint32_t)entry & ~LL_PAIR_STAGED;
}

/* Notes, at rank d, that pair (t, k) of ours in dispatch seq went to slot
 * `slot` there (moeep_ll_summed), or that its row waits in d's token rows
 * for the receive to copy it there (`staged`: moeep_ll_dedup). */
__device__ __forceinline__ void ll_note_pair_slot(const struct moeep_ctx &ctx, int d, int b, uint64_t seq, int t, int k,
                                                  size_t slot, bool staged = false) {
        if (staged || moeep_ll_summed(&ctx))
                *ll_pair_slot(ctx, d, b, ctx.rank, t, k) =
                        (seq & 0xffffffffull) << 32 | (uint32_t)slot | (staged ? LL_PAIR_STAGED : 0u);
}

/* Warps numbered across blocks first: the few hundred work items of a
 * decode step spread over every SM instead of filling the first blocks. */
__device__ __forceinline__ int ll_warp_index(void) {
        return (int)(threadIdx.x / 32 * gridDim.x + blockIdx.x);
}

/* The sources' tokens of set b's current dispatch at this rank as work
 * items of the launch's warps: (source s, token t, piece) for every s of
 * `sources`, t below s's token count (which its dispatch sent with its
 * counts) and `pieces` pieces of a token, sources in turn from the rank
 * after ours: the combine's first round of items then goes to a
 * different rank from each sender, where in rank order every sender's
 * went to rank 0 (1 for rank 0) first and the others' links idled. For an item
 * whose pair-slot entries here name a pair of dispatch `dseq` with every
 * bit of `bits` (lane k: pair (t, k), k < K), calls f(s, t, piece, mask,
 * entry): mask has the lanes whose entry does, entry is the lane's. */
template <typename F>
__device__ __forceinline__ void ll_for_each_pair_item(const struct moeep_ctx &ctx, int b, uint32_t dseq,
                                                      uint32_t sources, int pieces, int K, uint32_t bits, F f) {
        const struct moeep_ll_sync *my = ll_sync_of(ctx, ctx.rank);
        const int lane = threadIdx.x % 32, R = ctx.ranks, warps = gridDim.x * LL_WARPS;
        int first[MOEEP_KERNEL_MAX_RANKS + 1]; /* [i]: the first item of source (rank + 1 + i) % R */
        first[0] = 0;
        for (int i = 0, s = (ctx.rank + 1) % R; i < R; i++, s = (s + 1) % R)
                first[i + 1] =
                        first[i] + (sources >> s & 1 ? min(max(__ldcg(&my->tokens[b][s]), 0), ctx.ll.max_tokens) : 0);

        for (int item = ll_warp_index(); item < first[R] * pieces; item += warps) {
                const int q = item / pieces, piece = item % pieces;
                int i = 0;
                while (first[i + 1] <= q)
                        i++;
                const int s = (ctx.rank + 1 + i) % R, t = q - first[i];
                uint64_t entry = 0;
                if (lane < K)
                        entry = __ldcg((const unsigned long long *)ll_pair_slot(ctx, ctx.rank, b, s, t, lane));
                const bool valid = lane < K && (uint32_t)(entry >> 32) == dseq && ((uint32_t)entry & bits) == bits;
                const uint32_t mask = __ballot_sync(0xffffffffu, valid);
                if (mask)
                        f(s, t, piece, mask, entry);
        }
}

/* This block's copy of set b's dispatch (combine) sequence number (struct
 * moeep_local_state). Every launch has ll_num_sms blocks, or one (the
 * dispatch receive alone, which reads block 0's). */
__device__ __forceinline__ uint64_t *ll_seq_of(const struct moeep_ctx &ctx, bool combine, int b) {
        return combine ? &ctx.state->ll_comb_seq[b][blockIdx.x] : &ctx.state->ll_seq[b][blockIdx.x];
}

/* The arrival of this block's rows at every mapped rank, called by every
 * thread after its stores: rank d's dispatch_flag (combine_flag) of set b
 * for us gets the block's share of the launch's 1 << 32, block 0's
 * 1 << 32 less one per other block, every other block's 1. The flag thus
 * reaches seq << 32 once every block of launch seq arrived, whatever the
 * sender's grid, and no block of the launch waits for another. The barrier
 * orders the block's stores before each release add (cumulativity, as in
 * a cooperative grid sync). A launch that failed part way leaves the sum
 * short of every later target: later waits time out, never pass early.
 * Our own flag is read on this GPU only: its release is at GPU scope. It
 * orders nothing (!ordered) where no one waits on it for rows: a combine
 * that reads ours in place, or a receive in the same launch, for which
 * the launch's end orders them. An elastic call does not arrive at the
 * ranks it leaves out (`skip`: the same for every block of the launch). */
__device__ __forceinline__ void ll_arrive(const struct moeep_ctx &ctx, bool combine, int b, bool ordered = true,
                                          uint32_t skip = 0) {
        const int d = threadIdx.x, me = ctx.rank;

        __syncthreads();
        if (d < ctx.ranks && !px_remote(ctx, d) && !(skip >> d & 1)) {
                struct moeep_ll_sync *s = ll_sync_of(ctx, d);
                uint64_t *flag = combine ? &s->combine_flag[b][me] : &s->dispatch_flag[b][me];
                const uint64_t share = blockIdx.x == 0 ? (1ull << 32) - (gridDim.x - 1) : 1ull;
                if (d != me)
                        red_release_sys_add_u64(flag, share);
                else if (ordered)
                        red_release_gpu_add_u64(flag, share);
                else
                        red_relaxed_gpu_add_u64(flag, share);
        }
}

/* The receive phase, in one block: waits for every source's table row of
 * set b, sequence seq, publishes the counts (count[b]), each source's
 * range of slots (DeepEP's layout_range: begin << 32 | count, sources in
 * rank order) and the statistics, then waits for the sources' pairs to
 * land. Remote sources' pairs were placed by the relay after every local
 * source's, one run per source, in rank order. In block 0 of the send's
 * own launch (`in_send`) our own source is not waited for: this block
 * wrote our table row, and our pairs land before the launch ends, which
 * is all that the caller's later work needs. */
__device__ __forceinline__ void ll_recv_counts(const struct moeep_ctx &ctx, int b, uint64_t seq, int *stats,
                                               bool in_send = false) {
        struct moeep_ll_sync *my = ll_sync_of(ctx, ctx.rank);
        const int tid = threadIdx.x, R = ctx.ranks, epr = ctx.num_experts / R;
        int64_t *range = (int64_t *)(ctx.peers[ctx.rank] + ctx.ll.range[b]);
        /* remote sources: the relay placed their pairs */
        const bool wait = tid < R && !px_remote(ctx, tid) && !(in_send && tid == ctx.rank);

        if (wait)
                wait_flag(ctx, &my->count_flag[b][tid], seq, tid);
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
        if (wait)
                wait_flag(ctx, &my->dispatch_flag[b][tid], seq << 32, tid);
}
