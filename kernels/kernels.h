/* Host launchers of moeep's CUDA kernels and the layout of the NVLink buffer
 * they share. Plain C, included by client/lib/ep.c and by the .cu files.
 *
 * Every rank owns one NVLink buffer (cuMemCreate, mapped by every rank of
 * the job). Peers write into it; its owner reads it. Offsets are the same on
 * every rank because every rank derives them from the same configuration:
 *
 *   [sync area]            flags and counts, struct moeep_sync (zeroed at attach)
 *   [dispatch receive]     rows from every source rank, ordered by source rank
 *                          then source token: x, scales, top-k ids, weights,
 *                          source token index (ranks * max_tokens rows)
 *   [combine receive]      one row slot per (contributing rank, own token):
 *                          x [ranks][max_tokens][hidden] bf16, weights
 *                          [ranks][max_tokens][topk] float
 */
#ifndef MOEEP_KERNELS_H
#define MOEEP_KERNELS_H

#include <stddef.h>
#include <stdint.h>

#include <cuda_runtime_api.h>

#ifdef __cplusplus
extern "C" {
#endif

#define MOEEP_KERNEL_MAX_RANKS 8
#define MOEEP_KERNEL_MAX_EXPERTS 512
#define MOEEP_KERNEL_MAX_TOPK 9
#define MOEEP_SCALE_BLOCK 128 /* FP8: one float scale per 128 channels */
#define MOEEP_KERNEL_MAX_TOKENS 65536
#define MOEEP_LL_FP8_MAX_HIDDEN 8192 /* low-latency FP8: largest hidden size supported (and tested) */
#define MOEEP_COMBINE_CHUNK 32       /* tokens per combine arrival counter */
#define MOEEP_COMBINE_CHUNKS (MOEEP_KERNEL_MAX_TOKENS / MOEEP_COMBINE_CHUNK)

/* Flags and counts exchanged between ranks; lives at offset 0 of every
 * NVLink buffer. Written remotely by peers with release stores, read locally
 * with acquire loads. Every flag holds the sequence number of the last
 * operation the writing rank reached; sequence numbers grow by one per
 * collective call and are the same on every rank because every rank makes
 * the same calls in the same order. */
struct moeep_sync {
        uint64_t barrier_flag[MOEEP_KERNEL_MAX_RANKS];  /* [src]: src entered barrier seq */
        uint64_t dispatch_flag[MOEEP_KERNEL_MAX_RANKS]; /* [src]: src's dispatch rows for seq landed */
        /* Combine arrival counters, one per MOEEP_COMBINE_CHUNK of our tokens: every row a
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
};

/* Per-rank state that only the owning GPU touches (cudaMalloc'ed). */
struct moeep_local_state {
        uint64_t seq;         /* last sequence number used; bumped by the barrier kernel */
        uint32_t blocks_done; /* last-block detection of the data kernels; back to 0 after each */
        /* combine: rows of each source claimed so far; back to 0 after each */
        uint32_t claim[MOEEP_KERNEL_MAX_RANKS];
        uint32_t error;     /* MOEEP_KERR_*: first failure of a device wait, sticky */
        int32_t error_rank; /* the peer that was waited for */
        int32_t pad;
        uint64_t ll_seq[2];      /* low-latency: sequence number of the last dispatch on each buffer set */
        uint64_t ll_comb_seq[2]; /* low-latency: sequence number of the last combine on each buffer set */
        /* Low-latency dispatch: pairs of ours claimed so far per (set, global
         * expert), the position of a pair among our pairs for its expert;
         * back to 0 after each dispatch. */
        uint32_t ll_pos[2][MOEEP_KERNEL_MAX_EXPERTS];
};

/* Diagnostic switches that leave out parts of combine, to time the rest;
 * the results are wrong while one is set. */
enum moeep_kernel_debug {
        MOEEP_DEBUG_NO_REDUCE = 1, /* combine: senders only */
        MOEEP_DEBUG_NO_COUNTS = 2, /* combine: no arrival counting, the reduce does not wait */
        MOEEP_DEBUG_NO_SEND = 4,   /* combine: reduce only (use with NO_COUNTS) */
        MOEEP_DEBUG_COPY_SELF =
                8, /* combine: our own rows go through the comb slots like a peer's (results stay right) */
};

enum moeep_kernel_error {
        MOEEP_KERR_NONE = 0,
        MOEEP_KERR_TIMEOUT = 1,  /* a peer's flag did not arrive within the wait bound */
        MOEEP_KERR_ABORT = 2,    /* the daemon set the job's abort word */
        MOEEP_KERR_OVERFLOW = 3, /* low-latency: an expert got more pairs than it has slots */
        MOEEP_KERR_PROXY = 4,    /* the proxy ring to a remote rank failed (its error word), or was full too long */
};

/* Offsets inside every NVLink buffer, derived from the configuration. */
struct moeep_buffer_layout {
        size_t sync;              /* struct moeep_sync */
        size_t recv_x;            /* [ranks * max_tokens][hidden] bf16 or fp8 */
        size_t recv_scales;       /* [ranks * max_tokens][hidden / 128] float */
        size_t recv_topk_idx;     /* [ranks * max_tokens][topk] int64 (or int32) */
        size_t recv_topk_weights; /* [ranks * max_tokens][topk] float */
        size_t recv_src;          /* [ranks * max_tokens] int32: source token index */
        size_t comb_x;            /* [ranks][max_tokens][hidden] bf16 */
        size_t comb_weights;      /* [ranks][max_tokens][topk] float */
        size_t total;
};

void moeep_buffer_layout_compute(struct moeep_buffer_layout *l, int ranks, int max_tokens, int hidden, int max_topk);

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
        uint64_t count_flag[2][MOEEP_KERNEL_MAX_RANKS];    /* [src]: src's table row of set b landed (seq) */
        uint64_t dispatch_flag[2][MOEEP_KERNEL_MAX_RANKS]; /* [src]: src's pairs of set b landed (seq) */
        /* [src]: src's expert outputs of set b landed (combine seq) */
        uint64_t combine_flag[2][MOEEP_KERNEL_MAX_RANKS];
};

/* Offsets of the low-latency buffers (after the normal-mode ones). */
struct moeep_ll_layout {
        int max_tokens;   /* tokens per rank per call; 0 = no low-latency buffers */
        size_t sync;      /* struct moeep_ll_sync */
        size_t x[2];      /* [local expert][ranks * max_tokens] rows: bf16, or fp8 with stride hidden */
        size_t scales[2]; /* [local expert][ranks * max_tokens][hidden / 128] float */
        size_t src[2];    /* [local expert][slots] int32: the source token index (DeepEP's src_info) */
        size_t kinfo[2];  /* [local expert][slots] int32: (source rank << 8) | k, for combine */
        size_t range[2];  /* [local expert][ranks] int64: begin << 32 | count of each source's slots */
        size_t comb[2];   /* [max_tokens][max_topk] bf16 rows: expert outputs back at the token's rank */
        size_t total;     /* end of the low-latency part */
};

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
        uint32_t scales;    /* normal-mode dispatch: PX_SEG_* bits (kernels/px_normal.cu) */
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
#define MOEEP_PX_COUNTERS (7 * MOEEP_KERNEL_MAX_RANKS)

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
        int ll_num_sms;          /* blocks of the low-latency kernels: every SM */
        int combine_send_blocks; /* 0: half the blocks send, half reduce; < 0: every block does both; else that many send */
        uint64_t *trace;         /* diagnostics: [block][4] globaltimer stamps of combine, or NULL */
        int debug;               /* MOEEP_DEBUG_* bits (diagnostics, from $MOEEP_KERNEL_DEBUG) */
        uint64_t timeout_ns;     /* bound of every spin-wait (globaltimer ns) */
        struct moeep_px px;      /* ranks at other daemons; px.remote 0 when none */
};

/* Routing state of one dispatch, kept for combine and for a cached dispatch.
 * Device arrays, owned by the handle (see client/lib/ep.c). */
struct moeep_route {
        int32_t *send_pos;           /* [num_tokens][ranks]: row among our rows at dst, -1 = not sent */
        int32_t *dst_base;           /* [ranks]: first row of ours in each dst's receive area */
        int32_t *recv_src;           /* [ranks * max_tokens]: (src rank << 24) | src token, per received row */
        int32_t *rank_prefix;        /* [ranks + 1]: first received row of each source rank */
        int32_t *expert_counts;      /* [local experts]: received tokens per local expert (aligned) */
        int32_t *num_recv;           /* [1] */
        int32_t *chunk_expect;       /* [ceil(num_tokens / MOEEP_COMBINE_CHUNK)]: rows combine returns per chunk */
        int32_t *rank_prefix_matrix; /* [ranks][ranks]: rows src' <= src sent to dst, [src][dst] (DeepEP's) */
        int num_tokens;
};

/* Host-mapped results of the notify kernel, read after an event wait. */
struct moeep_notify_host {
        uint32_t error; /* moeep_local_state.error when notify ended */
        int32_t error_rank;
        int32_t num_recv;
        int32_t max_total_tokens; /* the largest whole dispatch of any rank (rounds) */
        int32_t expert_counts[MOEEP_KERNEL_MAX_EXPERTS];
};

/* Launchers return 0, or the cudaError_t of a launch that failed. */

/* Once per process and device, before any launch (sets kernel attributes,
 * which must not happen while a stream is being captured). */
int moeep_kernels_init(void);

/* Layout (DeepEP's get_dispatch_layout): outputs are fully written. */
int moeep_launch_layout(const void *topk_idx, int idx_is_int64, int num_tokens, int num_topk, int num_experts,
                        int ranks, int *num_tokens_per_rank, int *num_tokens_per_expert, uint8_t *is_token_in_rank,
                        cudaStream_t stream);

/* Barrier with every rank (bumps seq). When `route` is not NULL, also
 * computes the routing of a dispatch: per-token positions from
 * is_token_in_rank (or topk_idx when is_token_in_rank is NULL), the count
 * exchange, prefixes and per-expert counts (aligned to `alignment`; the
 * caller's tokens_per_expert [experts] when not NULL, else from topk_idx),
 * and the exchange of every rank's total_tokens (the whole dispatch that
 * this call is a round of; the maximum lands in host_out); copies
 * num_recv and the counts to `host_out` when it is not NULL. */
int moeep_launch_notify(const struct moeep_ctx *ctx, const uint8_t *is_token_in_rank, const void *topk_idx,
                        int idx_is_int64, int num_tokens, int num_topk, const int *tokens_per_expert, int total_tokens,
                        int alignment, const struct moeep_route *route, struct moeep_notify_host *host_out,
                        cudaStream_t stream);

struct moeep_dispatch_launch {
        const void *x;         /* [num_tokens][hidden], row bytes = hidden * elem_size */
        int elem_size;         /* 2 = bf16, 1 = fp8 */
        const float *x_scales; /* [num_tokens][hidden / 128] or NULL */
        const void *topk_idx;  /* [num_tokens][num_topk] or NULL */
        int idx_is_int64;
        const float *topk_weights; /* [num_tokens][num_topk] or NULL */
        int num_topk;
};

/* Sends every token to the ranks the route says, then waits until every
 * source rank's rows landed here and copies the receive metadata into the
 * route. Must follow moeep_launch_notify() on the same stream. */
int moeep_launch_dispatch(const struct moeep_ctx *ctx, const struct moeep_dispatch_launch *a,
                          const struct moeep_route *route, cudaStream_t stream);

/* Sends each received row (x: [num_recv][hidden] bf16, weights optional)
 * back to its source rank, waits for every rank's rows, and reduces them
 * into out [num_tokens][hidden] (and out_weights [num_tokens][num_topk]). */
int moeep_launch_combine(const struct moeep_ctx *ctx, const void *x, const float *topk_weights, int num_topk,
                         const struct moeep_route *route, void *out, float *out_weights, cudaStream_t stream);

/* Low-latency mode (kernels/ll.cu). `set` is the buffer set (0 or 1);
 * `slots` the slots per expert of the call (ranks * its max tokens), the
 * stride of every per-expert array. Each phase is one launch of the
 * kernel moeep_ll::dispatch or moeep_ll::combine (DeepEP's profilers count
 * kernels by those names). */
enum {
        MOEEP_LL_SEND = 1,
        MOEEP_LL_RECV = 2
};
int moeep_launch_ll_dispatch(const struct moeep_ctx *ctx, const void *x, int num_tokens, const void *topk_idx,
                             int idx_is_int64, int num_topk, int set, int slots, int use_fp8, int round_scale,
                             int phases, int *stats, cudaStream_t stream);
int moeep_launch_ll_combine(const struct moeep_ctx *ctx, const void *y, int set, int slots, int phases,
                            const void *topk_idx, int idx_is_int64, const float *weights, int num_tokens, int num_topk,
                            void *out, cudaStream_t stream);
/* With ranks at other daemons (ctx->px.remote): after dispatch send, waits
 * for every remote source's staged pairs, places them like NVLink writes,
 * then does the receive phase; after combine send, places the remote
 * expert outputs before the receive phase of moeep_launch_ll_combine. */
int moeep_launch_ll_dispatch_relay(const struct moeep_ctx *ctx, int set, int slots, int *stats, cudaStream_t stream);
int moeep_launch_ll_combine_relay(const struct moeep_ctx *ctx, int set, cudaStream_t stream);

/* Normal mode with ranks at other daemons (kernels/px_normal.cu), queued
 * around the intranode kernels, which skip remote ranks: dispatch stages
 * and ships our rows for remote ranks, then the relay places the rows
 * remote ranks sent us, then moeep_launch_dispatch does the NVLink part;
 * combine alike. Neither waits for anything but remote ranks' segments. */
int moeep_launch_px_dispatch_stage(const struct moeep_ctx *ctx, const struct moeep_dispatch_launch *a,
                                   const struct moeep_route *route, cudaStream_t stream);
int moeep_launch_px_dispatch_relay(const struct moeep_ctx *ctx, const struct moeep_route *route, cudaStream_t stream);
int moeep_launch_px_combine_stage(const struct moeep_ctx *ctx, const void *x, const float *topk_weights, int num_topk,
                                  const struct moeep_route *route, cudaStream_t stream);
int moeep_launch_px_combine_relay(const struct moeep_ctx *ctx, cudaStream_t stream);

/* Benchmark references (kernels/bench.cu). */

/* Busy-waits `ns` on the stream (timing: queue the measured work behind it). */
int moeep_launch_delay(uint64_t ns, cudaStream_t stream);

/* NVLink floor: every rank stores `bytes` into every peer at once. */
int moeep_launch_p2p_put(const struct moeep_ctx *ctx, size_t bytes, int blocks, cudaStream_t stream);

/* What a user would run around an NCCL all-to-all: positions of each token
 * in a send buffer grouped by destination, the pack, and the sum of the
 * rows that come back (offsets: device [ranks], first row of each dst). */
int moeep_launch_ref_scan(const uint8_t *is_token_in_rank, int num_tokens, int ranks, int32_t *pos, int32_t *counts,
                          cudaStream_t stream);
int moeep_launch_ref_pack(const void *x, size_t row_bytes, int num_tokens, int ranks, const int32_t *pos,
                          const int32_t *offsets, void *sendbuf, int blocks, cudaStream_t stream);
int moeep_launch_ref_unpack(const void *back, int hidden, int num_tokens, int ranks, const int32_t *pos,
                            const int32_t *offsets, void *out, int blocks, cudaStream_t stream);

/* moeep-proxy-bench's GPU producer (see ring_bench_kernel). ring_hdr, counters
 * and ping are device pointers to mapped host memory; out is device memory
 * of 1 + n int64 (out[0]: 0 or -errno). */
enum {
        MOEEP_RING_BENCH_RATE,
        MOEEP_RING_BENCH_LATENCY,
        MOEEP_RING_BENCH_PINGPONG
};
#define MOEEP_RING_BENCH_BATCH 32 /* RATE: descriptors per published tail */
int moeep_launch_ring_bench(void *ring_hdr, uint64_t *counters, uint64_t *ping, int mode, uint32_t n, uint32_t size,
                            uint32_t region, int signal, int64_t *out, cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif
