/* The NVLink buffer every rank owns, and what lives in it: its layout
 * (offsets derived from the configuration, the same on every rank), the
 * flags and counters peers exchange in it, the proxy path's staging
 * segments, and the kernels' own device state. Host side: the structures
 * and the functions that compute the offsets (kernels/common/buffer_layout.c).
 * Device side (nvcc only, at the end): the accessors the kernels reach
 * these areas through. Plain C for the host; included by kernels.h.
 *
 * Every rank owns one NVLink buffer (cuMemCreate, mapped by every rank of
 * the job). Peers write into it; its owner reads it. Offsets are the same on
 * every rank because every rank derives them from the same configuration:
 *
 *   [sync area]            flags and counts, struct moeep_sync (zeroed at attach)
 *   [dispatch receive] x areas   rows from every source rank, ordered by source
 *                          rank then source token: x, scales, top-k ids,
 *                          weights, source token index (ranks * max_tokens
 *                          rows); `areas` copies of it, one after the other
 *                          (area a at layout.recv_* + a * layout.area_bytes).
 *                          The owner picks the area of each dispatch (one
 *                          whose earlier outputs nobody holds any more) and
 *                          tells its sources in the dispatch's barrier, so
 *                          that a caller may keep a dispatch's outputs as
 *                          views while later dispatches land elsewhere
 *   [combine receive]      one row slot per (contributing rank, own token):
 *                          x [ranks][max_tokens][hidden] bf16, weights
 *                          [ranks][max_tokens][topk] float
 *   [low-latency]          struct moeep_ll_layout, when the endpoint has it
 *
 * Every array starts at a multiple of MOEEP_BUFFER_ALIGN (params.h). */
#ifndef MOEEP_KERNEL_BUFFERS_H
#define MOEEP_KERNEL_BUFFERS_H

#include <stddef.h>
#include <stdint.h>

#include "common/params.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Flags and counts exchanged between ranks; lives at offset 0 of every
 * NVLink buffer. Written remotely by peers with release stores, read locally
 * with acquire loads. Every flag holds the sequence number of the last
 * operation the writing rank reached; sequence numbers grow by one per
 * collective call and are the same on every rank because every rank makes
 * the same calls in the same order. */
struct moeep_sync {
        uint64_t barrier_flag[MOEEP_KERNEL_MAX_RANKS];  /* [src]: src entered barrier seq */
        uint64_t dispatch_flag[MOEEP_KERNEL_MAX_RANKS]; /* [src]: src's dispatch rows for seq landed */
        /* Combine arrival counters, one per moeep_combine_chunk() of our tokens: every row a
         * rank sends back adds 1 (release) to the counter of the row's token;
         * our reduce consumes a chunk once its count reaches the number of
         * rows expected (route.chunk_expect), then zeroes it. */
        uint32_t comb_chunk[MOEEP_COMBINE_CHUNKS];
        /* Counts of a dispatch, double-buffered by seq parity so that a fast
         * peer writing round n+1 cannot overwrite round n before we read it. */
        int32_t rank_counts[2][MOEEP_KERNEL_MAX_RANKS][MOEEP_KERNEL_MAX_RANKS];     /* [par][src][dst] */
        int32_t expert_counts[2][MOEEP_KERNEL_MAX_RANKS][MOEEP_KERNEL_MAX_EXPERTS]; /* [par][src][local e] */
        /* [par][src]: tokens of src's whole dispatch (rounds) */
        int32_t total_tokens[2][MOEEP_KERNEL_MAX_RANKS];
        /* [par][src]: the receive area src picked for the call of that
         * sequence number (moeep_ctx.recv_area), written by src before its
         * barrier flag: a dispatch's rows for src go into that area. */
        int32_t recv_area[2][MOEEP_KERNEL_MAX_RANKS];
};

/* Per-rank state that only the owning GPU touches (cudaMalloc'ed). */
struct moeep_local_state {
        uint64_t seq;         /* last sequence number used; bumped by the barrier kernel */
        uint32_t blocks_done; /* last-block detection of the data kernels; back to 0 after each */
        /* combine: rows of each source claimed so far; back to 0 after each */
        uint32_t claim[MOEEP_KERNEL_MAX_RANKS];
        uint32_t error;     /* MOEEP_KERR_*: first failure of a device wait, sticky */
        int32_t error_rank; /* the peer that was waited for */
        /* normal dispatch: tokens claimed so far after each warp's first;
         * back to 0 after each */
        uint32_t dispatch_claim;
        /* notify with several blocks: each block's tokens per rank and per
         * expert, and the grid barrier between its passes (arrivals, back
         * to 0 by the last; generations) */
        int32_t notify_total[MOEEP_NOTIFY_MAX_BLOCKS][MOEEP_KERNEL_MAX_RANKS];
        int32_t notify_hist[MOEEP_NOTIFY_MAX_BLOCKS][MOEEP_KERNEL_MAX_EXPERTS];
        uint32_t notify_arrived;
        uint32_t notify_gen;
        /* Low-latency: the sequence number of the last dispatch (combine) on
         * each buffer set, one copy per block of the launches (ll_seq_of):
         * a block reads its own at its start and stores the next at its end,
         * so that no block waits for another to number the call. */
        uint64_t ll_seq[2][LL_MAX_BLOCKS];
        uint64_t ll_comb_seq[2][LL_MAX_BLOCKS];
        /* Low-latency dispatch with more pairs than LL_SCAN_PAIRS, or ranks
         * behind the proxy: pairs of ours claimed so far per (set, global
         * expert), the position of a pair among our pairs for its expert;
         * back to 0 after each dispatch. */
        uint32_t ll_pos[2][MOEEP_KERNEL_MAX_EXPERTS];
        /* The receive area each rank picked at the last barrier (notify):
         * the dispatch that follows writes rank d's rows into its area
         * dst_area[d]. */
        int32_t dst_area[MOEEP_KERNEL_MAX_RANKS];
        /* Elastic endpoints (ctx.shrink): DeepEP's mask buffer, rank r is
         * masked when mask[r] != 0 (1 as written by moeep): no call sends to
         * it or waits for it, its pairs are dropped from dispatch and its
         * experts' outputs left out of combine. Set by a wait that gave up on
         * the rank (the daemon marked it lost, or the shrink timeout), by a
         * send launch for the ranks the daemon marked lost, and by the host
         * (moeep_ll_mask_update). */
        int32_t mask[MOEEP_KERNEL_MAX_RANKS];
        /* Decisions one block of a launch takes for every block, and for the
         * launches after it, each (seq & 0xffffffff) << 32 | bits (LL_DEC_* in
         * kernels/ll/shrink.cuh): the dispatch send's view of the counts it
         * placed its pairs after and the ranks it left out; the dispatch receive's
         * (or relay's) sources whose counts it placed and the remote sources
         * the relay placed; the remote sources the combine relay placed. */
        uint64_t ll_send_view[2];
        uint64_t ll_recv_view[2];
        uint64_t ll_comb_view[2];
        uint64_t ll_clean_seq; /* clean barriers passed */
        /* Whether the last dispatch send on each set sent FP8 rows: the
         * format of the token rows its receive copies (moeep_ll_dedup),
         * for a receive alone (a hook), which is not told. */
        uint32_t ll_fp8[2];
};

/* Offsets inside every NVLink buffer, derived from the configuration. */
struct moeep_buffer_layout {
        size_t sync;              /* struct moeep_sync */
        size_t recv_x;            /* [ranks * max_tokens][hidden] bf16 or fp8 */
        size_t recv_scales;       /* [ranks * max_tokens][hidden / 128] float */
        size_t recv_topk_idx;     /* [ranks * max_tokens][topk] int64 (or int32) */
        size_t recv_topk_weights; /* [ranks * max_tokens][topk] float */
        size_t recv_src;          /* [ranks * max_tokens] int32: source token index */
        size_t area_bytes;        /* from one receive area to the next (the recv_* above are area 0's) */
        int areas;                /* receive areas, 1..MOEEP_MAX_RECV_AREAS */
        size_t comb_x;            /* [ranks][max_tokens][hidden] bf16 */
        size_t comb_weights;      /* [ranks][max_tokens][topk] float */
        size_t total;
};

void moeep_buffer_layout_compute(struct moeep_buffer_layout *l, int ranks, int max_tokens, int hidden, int max_topk,
                                 int areas);

/* Low-latency flags and counters, in every NVLink buffer when the
 * endpoint has low-latency buffers; index [b] is the buffer set. */
struct moeep_ll_sync {
        /* pairs of remote sources placed per local expert (relay) */
        uint32_t counter[2][MOEEP_KERNEL_MAX_EXPERTS];
        int32_t count[2][MOEEP_KERNEL_MAX_EXPERTS]; /* received per local expert (owner only) */
        /* [src][global expert]: pairs src sends to the expert in the set's
         * current dispatch. Every source writes its whole row to every rank
         * (before count_flag), so that each rank knows where its pairs start
         * in every expert's slots (after the pairs of the ranks below it),
         * and the owner knows each source's range. The relay adds remote
         * sources' counts into their rows here (zeroed after reading). */
        int32_t table[2][MOEEP_KERNEL_MAX_RANKS][MOEEP_KERNEL_MAX_EXPERTS];
        /* [src]: the tokens of src's current dispatch on set b, written
         * with its table row (the summed combine's sources' tokens) */
        int32_t tokens[2][MOEEP_KERNEL_MAX_RANKS];
        /* [src]: 1 when src's current dispatch on set b sent its tokens
         * once per rank, into our token rows (moeep_ll_dedup), else 0;
         * written with its table row */
        int32_t staged[2][MOEEP_KERNEL_MAX_RANKS];
        uint64_t count_flag[2][MOEEP_KERNEL_MAX_RANKS]; /* [src]: src's table row of set b landed (seq) */
        /* [src]: the arrivals of src's blocks (ll_arrive): seq << 32 once
         * every block of src's dispatch (combine) seq on set b placed its
         * pairs (expert outputs) here. Sums, never cleaned: the blocks of
         * a launch add exactly 1 << 32 together. */
        uint64_t dispatch_flag[2][MOEEP_KERNEL_MAX_RANKS];
        uint64_t combine_flag[2][MOEEP_KERNEL_MAX_RANKS];
        /* Elastic endpoints (ctx.shrink) only. [src]: a digest of where src
         * put its pairs of dispatch seq at our experts, ll_send_digests(),
         * written by src's block 0 before its arrival: the receiver checks it
         * against the places it computes, so that ranks that saw a dying
         * rank's counts differently are caught instead of mixing rows. */
        uint64_t begin_digest[2][MOEEP_KERNEL_MAX_RANKS];
        /* [src]: the last clean barrier src reached (moeep_ll_clean). */
        uint64_t clean_flag[MOEEP_KERNEL_MAX_RANKS];
        /* [src]: src's combine weights of set b landed in our `weights`
         * area (the combine's sequence number); summed combine only
         * (moeep_ll_summed). */
        uint64_t weights_flag[2][MOEEP_KERNEL_MAX_RANKS];
        /* [src]: 2 * seq + 1 when src's combine seq of set b sent us sums,
         * 2 * seq when it sent a row per pair (a hook's send: it does not
         * wait for our weights); written before src's arrival. */
        uint64_t comb_mode[2][MOEEP_KERNEL_MAX_RANKS];
};

/* Offsets of the low-latency buffers (after the normal-mode ones). */
struct moeep_ll_layout {
        int max_tokens;   /* tokens per rank per call; 0 = no low-latency buffers */
        size_t sync;      /* struct moeep_ll_sync */
        size_t x[2];      /* [local expert][ranks * max_tokens] rows: bf16, or fp8 with stride hidden */
        size_t scales[2]; /* [local expert][ranks * max_tokens][hidden / 128] float */
        size_t src[2];    /* [local expert][slots] int32: the source token index (DeepEP's src_info) */
        size_t kinfo[2];  /* [local expert][slots] int32: moeep_ll_kinfo_pack(source rank, k), for combine */
        size_t range[2];  /* [local expert][ranks] int64: moeep_ll_range_pack(begin, count) of each source's slots */
        size_t comb[2];   /* [max_tokens][max_topk] bf16 rows: expert outputs back at the token's rank */
        size_t ref[2];    /* [max_tokens][max_topk] int32: where the dispatch put each of our pairs whose
                           * expert is ours (local expert * slots + position), else -1: the combine
                           * reads those expert outputs in place */
        /* Summed combine (moeep_ll_summed), written by the sources: */
        size_t pair_slot[2]; /* [ranks][max_tokens][max_topk] uint64: (dispatch seq & 0xffffffff) << 32 | slot
                              * of the source's pair (token, k) at our experts, written by its dispatch
                              * (other entries hold an older seq: zeroed at creation) */
        size_t weights[2];   /* [ranks][max_tokens][max_topk] float: each source's combine top-k weights */
        /* [ranks][max_tokens] rows of MOEEP_LL_TOK_ROW(hidden) bytes: each
         * source's tokens, sent once to each rank that holds one of their
         * experts (moeep_ll_dedup): the row (FP8 or bf16), then its FP8
         * scales; the receive copies them to the slots its pair_slot
         * entries name */
        size_t tok[2];
        size_t total; /* end of the low-latency part */
};

/* Bytes of a token row of moeep_ll_layout.tok. */
#define MOEEP_LL_TOK_ROW(hidden) ((size_t)(hidden)*2 + (size_t)((hidden) / MOEEP_SCALE_BLOCK) * sizeof(float))

/* Appends the low-latency buffers at offset `start` (0 tokens: none). */
void moeep_ll_layout_compute(struct moeep_ll_layout *l, size_t start, int ranks, int max_tokens, int hidden,
                             int num_experts, int max_topk);

/* The internode proxy path of the low-latency kernels (proto/ring.h,
 * client/lib/ep-px.c): ranks at another daemon are not mapped; what goes to
 * them is staged in our send region (host memory, mapped for the device),
 * one segment per (buffer set, destination), and shipped by the daemon's
 * proxy with one descriptor per segment into the same segment of the
 * destination's receive region (indexed there by the source), followed by
 * a signal into the destination's counters. The receiver's relay kernels
 * copy the staged pairs into its own buffers as an NVLink peer would have
 * written them, so results are the same.
 *
 * A segment: struct moeep_px_seg, then `count` slots of ll_pair (dispatch:
 * row, scales, local expert, source info) or ll_row (combine: bf16 row,
 * token, k) bytes. */
#define MOEEP_PX_SEG_HDR 64
/* Low-latency dispatch segments: after the header, the sender's pair count
 * for each of the destination's local experts (int32), then the pairs, so
 * the receiver can give each remote source its own run of slots. */
#define MOEEP_PX_LL_COUNTS (MOEEP_KERNEL_MAX_EXPERTS * 4)
struct moeep_px_seg {
        uint32_t count;     /* slots that follow */
        uint32_t row_bytes; /* dispatch: bytes of each staged row (hidden, or 2 hidden for bf16) */
        uint64_t value;     /* the signal value it was shipped with */
        uint32_t topk;      /* normal mode: top-k entries per row (ids and weights, or combine weights) */
        uint32_t scales;    /* normal-mode dispatch: PX_SEG_* bits (below) */
};
/* Counter (8 bytes each in the counters region) that the source's segment
 * of set b signals: dispatch, then combine. */
#define MOEEP_PX_COUNTER_LL_DISPATCH(b, src) ((b)*MOEEP_KERNEL_MAX_RANKS + (src))
#define MOEEP_PX_COUNTER_LL_COMBINE(b, src) ((2 + (b)) * MOEEP_KERNEL_MAX_RANKS + (src))
/* Normal mode: the barrier of every notify (with the counts when it routes),
 * the dispatch rows, the combine rows. */
#define MOEEP_PX_COUNTER_NM_SYNC(src) (4 * MOEEP_KERNEL_MAX_RANKS + (src))
#define MOEEP_PX_COUNTER_NM_DISPATCH(src) (5 * MOEEP_KERNEL_MAX_RANKS + (src))
#define MOEEP_PX_COUNTER_NM_COMBINE(src) (6 * MOEEP_KERNEL_MAX_RANKS + (src))
/* Elastic endpoints: the clean barrier (moeep_ll_clean), a header only. */
#define MOEEP_PX_COUNTER_LL_CLEAN(src) (7 * MOEEP_KERNEL_MAX_RANKS + (src))
#define MOEEP_PX_COUNTERS (8 * MOEEP_KERNEL_MAX_RANKS)

/* Device memory, ours only: the ring's producer state and the slots staged
 * for each remote rank by the running kernel. */
struct moeep_px_state {
        void *ring_hdr;    /* struct proxy_ring_hdr *: device pointer of the mapped ring */
        uint32_t ring_cap; /* descriptors, a power of two */
        uint32_t pad;
        uint64_t ring_tail;                                /* descriptors published */
        uint64_t ring_head;                                /* the proxy's head as last read */
        uint32_t ll_claim[2][MOEEP_KERNEL_MAX_RANKS];      /* dispatch pairs staged, per set and destination */
        uint32_t ll_comb_claim[2][MOEEP_KERNEL_MAX_RANKS]; /* combine rows staged */
        uint32_t nm_claim[MOEEP_KERNEL_MAX_RANKS];         /* normal mode: rows staged by the running kernel */
        uint32_t nm_blocks;                                /* normal mode: blocks done staging */
};

struct moeep_px {
        uint32_t remote; /* bit r: rank r is at another daemon; 0: no proxy path */
        char *send;      /* device pointers of the mapped send and receive regions */
        const char *recv;
        const uint64_t *counters; /* device pointer of the mapped counters */
        struct moeep_px_state *state;
        uint64_t epoch;        /* added to every signal value: endpoints of one job reuse the regions */
        size_t ll_pair;        /* bytes of a staged dispatch pair, at most (a BF16 row; FP8 pairs are smaller) */
        size_t ll_row;         /* bytes of a staged combine row */
        uint32_t ll_slots;     /* slots of a segment: ll max_tokens * max_topk */
        size_t ll_dispatch[2]; /* offsets of set b's segments, [rank] of ll_dispatch_seg bytes */
        size_t ll_combine[2];
        size_t ll_dispatch_seg, ll_combine_seg;
        size_t ll_clean; /* the clean barrier's segments, [rank] of MOEEP_PX_SEG_HDR bytes (a header only) */
        /* Normal mode, one segment per peer each: counts (notify), rows
         * (dispatch: row, scales, top-k ids int64 and weights, source token;
         * combine: bf16 row, weights, token), max_tokens rows. */
        size_t nm_sync, nm_dispatch, nm_combine;
        size_t nm_sync_seg, nm_dispatch_seg, nm_combine_seg;
        size_t nm_pair, nm_row; /* bytes of a staged dispatch row (at most) and combine row */
        size_t bytes;           /* of the send region and of the receive region (same layout) */
};

/* Fills the proxy layout for the normal-mode buffers (max_tokens rows per
 * peer) and the low-latency buffers of `ll` (sizes only; pointers and
 * `remote` are the caller's). */
void moeep_px_layout_compute(struct moeep_px *px, int ranks, int max_tokens, int num_experts,
                             const struct moeep_ll_layout *ll, int hidden, int max_topk);

/* Everything a kernel needs to reach the job: the mapped buffers of every
 * rank (peers[rank] is our own), passed by value. */
struct moeep_ctx {
        char *peers[MOEEP_KERNEL_MAX_RANKS];
        struct moeep_buffer_layout layout;
        struct moeep_ll_layout ll;
        struct moeep_local_state *state;     /* device memory, ours only */
        const volatile uint32_t *abort_word; /* device pointer to the control page's abort, or NULL */
        int rank;
        int ranks;
        int num_experts;
        int hidden;
        int max_tokens;
        int max_topk;
        int num_sms;             /* blocks of normal-mode dispatch/combine */
        int recv_area;           /* normal mode: the receive area of our next dispatch (told at its barrier) */
        int ll_num_sms;          /* blocks of the low-latency kernels: every SM */
        int combine_send_blocks; /* 0: half the blocks send, half reduce; < 0: every block does both; else that many send */
        uint64_t *trace;         /* diagnostics: MOEEP_TRACE_WORDS globaltimer stamps (params.h), or NULL */
        int debug;               /* MOEEP_DEBUG_* bits (diagnostics, from $MOEEP_KERNEL_DEBUG) */
        uint64_t timeout_ns;     /* bound of every spin-wait (globaltimer ns) */
        struct moeep_px px;      /* ranks at other daemons; px.remote 0 when none */
        /* Elastic (shrink-mode) low-latency calls (moeep_ep_config.ll_shrink):
         * a peer that does not come is masked (state->mask) instead of
         * failing the call. Normal-mode kernels ignore these. */
        int shrink;
        uint64_t shrink_timeout_ns; /* a wait for a peer's counts masks it after this, for its rows after twice this */
        /* Device pointer to the control page's lost_ranks (low 32 bits) and
         * stopping (high 32 bits), read as one word; NULL without a version 2
         * page. */
        const volatile uint64_t *lost_word;
        int32_t *active; /* this call's active_ranks (1 = active, 0 = masked for the call), or NULL */
};

#ifdef __cplusplus
}
#endif

#ifdef __CUDACC__
/* ---- Device side: where the kernels find each area. */

__device__ __forceinline__ struct moeep_sync *sync_of(const struct moeep_ctx &ctx, int rank) {
        return (struct moeep_sync *)(ctx.peers[rank] + ctx.layout.sync);
}

__device__ __forceinline__ struct moeep_ll_sync *ll_sync_of(const struct moeep_ctx &ctx, int rank) {
        return (struct moeep_ll_sync *)(ctx.peers[rank] + ctx.ll.sync);
}

/* True when `rank` is at another daemon: reached through the proxy path. */
__device__ __forceinline__ bool px_remote(const struct moeep_ctx &ctx, int rank) {
        return (ctx.px.remote >> rank) & 1;
}

/* Our staging segment for `peer` (send), or `peer`'s segment here (receive). */
__device__ __forceinline__ char *px_send_seg(const struct moeep_ctx &ctx, size_t area, size_t seg, int peer) {
        return ctx.px.send + area + (size_t)peer * seg;
}
__device__ __forceinline__ const char *px_recv_seg(const struct moeep_ctx &ctx, size_t area, size_t seg, int peer) {
        return ctx.px.recv + area + (size_t)peer * seg;
}

/* Low-latency: bytes of one staged dispatch pair: the row as sent (xrow:
 * hidden bytes for FP8, 2 hidden for BF16), its scales when FP8, then the
 * local expert and the source info (two int32, moeep_px_src_pack), rounded
 * to 16. */
__device__ __forceinline__ size_t px_pair_bytes(size_t xrow, int H) {
        const size_t scales = xrow == (size_t)H ? (size_t)(H / MOEEP_SCALE_BLOCK) * sizeof(float) : 0;
        return (xrow + scales + 8 + 15) / 16 * 16;
}

/* Normal mode: moeep_px_seg.scales bits of a dispatch segment: FP8 scales
 * follow the rows; the sender's top-k ids are int32 (the receive array
 * holds the sender's type, as its NVLink writes would). */
enum {
        PX_SEG_SCALES = 1,
        PX_SEG_IDX32 = 2
};

/* Normal mode: a staged dispatch row: the row (row_bytes), its scales
 * (FP8), the top-k ids as the destination's local ids (int64), the weights,
 * the source token; rounded to 16 bytes. */
struct px_pair_layout {
        size_t scales, idx, weights, src, bytes;
};

__device__ __forceinline__ struct px_pair_layout px_pair(size_t row_bytes, int n_scales, int K) {
        struct px_pair_layout l;
        l.scales = row_bytes;
        l.idx = l.scales + (size_t)n_scales * sizeof(float);
        l.weights = l.idx + (size_t)K * sizeof(int64_t);
        l.src = l.weights + (size_t)K * sizeof(float);
        l.bytes = (l.src + sizeof(int32_t) + 15) / 16 * 16;
        return l;
}

/* Normal mode: a staged combine row: bf16 row, K weights, the token;
 * rounded to 16. */
__device__ __forceinline__ size_t px_comb_row_bytes(int H, int K) {
        return ((size_t)H * 2 + (size_t)K * sizeof(float) + sizeof(int32_t) + 15) / 16 * 16;
}

/* Normal mode: our counts segment for remote rank d: our rank counts [R],
 * then the counts of d's experts, then our whole dispatch's size. */
__device__ __forceinline__ int32_t *px_counts_out(const struct moeep_ctx &ctx, int d) {
        return (int32_t *)(px_send_seg(ctx, ctx.px.nm_sync, ctx.px.nm_sync_seg, d) + MOEEP_PX_SEG_HDR);
}
#endif

#endif
