/* Host launchers of moeep's CUDA kernels: the launch API of the product
 * library. Plain C, included by client/lib/ep*.c and by the .cu files. The
 * buffers the kernels share and their layout are in common/buffers.h, every
 * limit and tunable in common/params.h; the benchmarks' kernels are apart,
 * in bench/bench_kernels.h. */
#ifndef MOEEP_KERNELS_H
#define MOEEP_KERNELS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <cuda_runtime_api.h>

#include "common/buffers.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Diagnostic switches that leave out parts of a kernel, to time the rest;
 * the results are wrong while one is set (unless its note says not). */
enum moeep_kernel_debug {
        MOEEP_DEBUG_NO_REDUCE = 1, /* combine: senders only */
        MOEEP_DEBUG_NO_COUNTS = 2, /* combine: no arrival counting, the reduce does not wait */
        MOEEP_DEBUG_NO_SEND = 4,   /* combine: reduce only (use with NO_COUNTS) */
        /* Combine, and the low-latency dispatch: our own rows go the way a
         * peer's go (into the comb slots; waited for through our own flag),
         * so that one rank times what more ranks do (results stay right). */
        MOEEP_DEBUG_COPY_SELF = 8,
        /* Waits do not read the job's abort word (a mapped host page): to
         * time what those reads cost (results stay right; a lost rank is
         * then seen by the timeout only). */
        MOEEP_DEBUG_NO_ABORT_POLL = 16,
        /* Low-latency combine: every expert output goes back as a row of
         * its own (DeepEP's way) instead of one weighted sum per token and
         * expert rank (moeep_ll_summed): to time the difference (results stay
         * right). Every rank of the job must set it alike. */
        MOEEP_DEBUG_LL_PER_PAIR = 32,
        /* Low-latency dispatch: every pair's row goes to its slot from the
         * source (DeepEP's way) instead of each token once to each other
         * rank (moeep_ll_dedup): to time the difference (results stay
         * right). */
        MOEEP_DEBUG_LL_NO_DEDUP = 64,
        /* The normal dispatch and combine kernels are launched after
         * notify or the barrier, and the low-latency kernels after whatever
         * kernel comes before them, as plain launches, not as programmatic
         * dependents (launch_kernel's `after`): to time the difference
         * (results stay right). */
        MOEEP_DEBUG_NO_PDL = 128,
        /* Normal dispatch: the token rows (x) for our own rank, or for the
         * other ranks, are not written (their metadata still is, and the
         * flags work as always): to time what each stream of stores costs. */
        MOEEP_DEBUG_DISPATCH_NO_SELF = 256,
        MOEEP_DEBUG_DISPATCH_NO_PEERS = 512,
        /* Low-latency launches of both phases stay cooperative, not plain
         * on the stream that ran a cooperative one (common/coop.cuh): to time
         * the difference (results stay right). */
        MOEEP_DEBUG_LL_COOP = 1024,
};

/* Tokens per combine arrival counter and reduce chunk: smaller from 3
 * ranks, where a chunk's rows come from more sources and its sum, the
 * reduce's last work after the last row lands, is larger (4 x H200,
 * moeep-bench --ranks 4: 510.3-511.6 us against 516.9-517.1 with 16
 * tokens; at 2 ranks 8 tokens cost 234.1 against 226.7, and this choice
 * keeps 225.7). */
MOEEP_HD int moeep_combine_chunk(int ranks) {
        return ranks <= 2 ? MOEEP_COMBINE_CHUNK : MOEEP_COMBINE_CHUNK_MANY;
}

/* Whether the combine may sum at the expert's rank: for each source token,
 * the outputs of the experts of one rank go back as one row, weighted with
 * the top-k weights the source sends first (moeep_ll_layout.weights), which
 * moves up to K / (expert ranks of the token) times fewer bytes than a row
 * per pair. The dispatch then notes each pair's slot at its expert's rank
 * (pair_slot), and every combine of a step that sums (moeep_ll_sums_step)
 * sends its weights. Its combine launches with both phases sum; a hook's
 * send (which must not wait for the other
 * ranks' weights) sends a row per pair, and says which in comb_mode. Not
 * with ranks behind the proxy or an elastic endpoint (their paths move a
 * row per pair), nor with MOEEP_DEBUG_LL_PER_PAIR; the same on every rank
 * of a job. The kernels ask it, and so does moeep-bench for its floors. */
MOEEP_HD bool moeep_ll_summed(const struct moeep_ctx *ctx) {
        return !ctx->shrink && !ctx->px.remote && !(ctx->debug & MOEEP_DEBUG_LL_PER_PAIR);
}

/* Whether a low-latency dispatch of `num_tokens` tokens sends each token
 * once to each other rank that holds one of its experts, into that rank's
 * token rows (moeep_ll_layout.tok), where the receive copies it to its
 * experts' slots, instead of once per pair across NVLink: with top-8 of
 * 288 at 2 ranks about four times fewer bytes. With the token-by-token
 * send only (moeep_ll_by_token); not with
 * ranks behind the proxy or an elastic endpoint, nor with
 * MOEEP_DEBUG_LL_NO_DEDUP. Each source decides for itself (its pairs'
 * entries say which way they went); every receive copies what came. */
MOEEP_HD bool moeep_ll_dedup(const struct moeep_ctx *ctx) {
        return !ctx->shrink && !ctx->px.remote && !(ctx->debug & MOEEP_DEBUG_LL_NO_DEDUP);
}

/* Whether the low-latency dispatch's send goes token by token: every rank
 * mapped, positions counted in shared memory (up to LL_SCAN_PAIRS pairs)
 * and tokens for half the blocks or more (moeep_launch_ll_dispatch). */
MOEEP_HD bool moeep_ll_by_token(const struct moeep_ctx *ctx, long num_tokens, int num_topk) {
        return !ctx->px.remote && num_tokens * num_topk <= LL_SCAN_PAIRS && 2 * num_tokens >= ctx->ll_num_sms;
}

/* Whether a dispatch of this shape sends its tokens once per rank. */
MOEEP_HD bool moeep_ll_dedup_call(const struct moeep_ctx *ctx, long num_tokens, int num_topk) {
        return moeep_ll_dedup(ctx) && moeep_ll_by_token(ctx, num_tokens, num_topk);
}

/* The fewest tokens per rank, on average over a step's ranks, for which
 * its combine sums: below that a step moves a few rows, and the weights'
 * round trip before the first sum costs more than the rows it saves (2 x
 * H200, dispatch + combine in a graph: 1 token a rank, summed 21.2 us
 * against 19.8 a row per pair; 16 tokens, 22.9 against 23.3). */
#define MOEEP_LL_SUM_MIN_TOKENS 16

/* Whether the combine of a step with `step_tokens` tokens (every rank's,
 * summed: each rank's dispatch tells every rank its count, so every rank
 * decides alike) sums (moeep_ll_summed). When it does not, no combine of
 * the step sends weights or waits for them. */
MOEEP_HD bool moeep_ll_sums_step(const struct moeep_ctx *ctx, long step_tokens) {
        return moeep_ll_summed(ctx) && step_tokens >= (long)MOEEP_LL_SUM_MIN_TOKENS * ctx->ranks;
}

enum moeep_kernel_error {
        MOEEP_KERR_NONE = 0,
        MOEEP_KERR_TIMEOUT = 1,  /* a peer's flag did not arrive within the wait bound */
        MOEEP_KERR_ABORT = 2,    /* the daemon set the job's abort word */
        MOEEP_KERR_OVERFLOW = 3, /* low-latency: an expert got more pairs than it has slots */
        MOEEP_KERR_PROXY = 4,    /* the proxy ring to a remote rank failed (its error word), or was full too long */
        /* Elastic endpoints: a source put its pairs where our view of the
         * ranks' counts does not (a rank died while its counts were reaching
         * some ranks but not others): the dispatch's outputs are undefined. */
        MOEEP_KERR_SHRINK_VIEW = 5,
};

/* Routing state of one dispatch, kept for combine and for a cached dispatch.
 * Device arrays, owned by the handle (see client/lib/ep.c). */
struct moeep_route {
        int32_t *send_pos;      /* [num_tokens][ranks]: row among our rows at dst, -1 = not sent */
        int32_t *dst_base;      /* [ranks]: first row of ours in each dst's receive area */
        int32_t *recv_src;      /* [ranks * max_tokens]: moeep_recv_src_pack(src rank, src token) per received row */
        int32_t *rank_prefix;   /* [ranks + 1]: first received row of each source rank */
        int32_t *expert_counts; /* [local experts]: received tokens per local expert (aligned) */
        int32_t *num_recv;      /* [1] */
        int32_t *chunk_expect;  /* [ceil(num_tokens / moeep_combine_chunk())]: rows combine returns per chunk */
        int32_t *rank_prefix_matrix; /* [ranks][ranks]: rows src' <= src sent to dst, [src][dst] (DeepEP's) */
        int num_tokens;
};

/* Host-mapped results of the notify kernel, read after an event wait. */
struct moeep_notify_host {
        uint32_t error; /* moeep_local_state.error when notify ended */
        int32_t error_rank;
        int32_t num_recv;
        int32_t max_total_tokens;                      /* the largest whole dispatch of any rank (rounds) */
        int32_t recv_per_rank[MOEEP_KERNEL_MAX_RANKS]; /* rows received from each source rank */
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

/* Barrier with every rank (bumps seq): one launch of the notify kernel
 * without a route. */
int moeep_launch_barrier(const struct moeep_ctx *ctx, cudaStream_t stream);

/* What notify routes: the tokens of one dispatch (a round of a larger one
 * when total_tokens > num_tokens). */
struct moeep_notify_launch {
        const uint8_t *is_token_in_rank; /* [num_tokens][ranks], or NULL: the ranks come from topk_idx */
        const void *topk_idx;            /* [num_tokens][num_topk] */
        int idx_is_int64;                /* topk_idx is int64_t (else int32_t) */
        int num_tokens, num_topk;
        const int *tokens_per_expert; /* [experts]: the caller's counts, or NULL: counted from topk_idx */
        int total_tokens;             /* the whole dispatch this call is a round of */
        int alignment;                /* per-expert counts are rounded up to a multiple of this */
};

/* The barrier of moeep_launch_barrier, and the routing of a dispatch into
 * `route`: per-token positions from is_token_in_rank (or topk_idx), the
 * count exchange, prefixes and per-expert counts, and the exchange of
 * every rank's total_tokens (the maximum lands in host_out); copies
 * num_recv and the counts to `host_out` when it is not NULL. */
int moeep_launch_notify(const struct moeep_ctx *ctx, const struct moeep_notify_launch *a,
                        const struct moeep_route *route, struct moeep_notify_host *host_out, cudaStream_t stream);

struct moeep_dispatch_launch {
        const void *x;         /* [num_tokens][hidden], row bytes = hidden * elem_size */
        int elem_size;         /* 2 = bf16, 1 = fp8 */
        const float *x_scales; /* [num_tokens][hidden / 128] or NULL; scale j of token t at
                                * x_scales[t * scale_stride_t + j * scale_stride_j] */
        int64_t scale_stride_t, scale_stride_j;
        const void *topk_idx; /* [num_tokens][num_topk] or NULL */
        int idx_is_int64;
        const float *topk_weights; /* [num_tokens][num_topk] or NULL */
        int num_topk;
};

/* Sends every token to the ranks the route says, then waits until every
 * source rank's rows landed here and copies the receive metadata into the
 * route. Must follow moeep_launch_notify() on the same stream. */
int moeep_launch_dispatch(const struct moeep_ctx *ctx, const struct moeep_dispatch_launch *a,
                          const struct moeep_route *route, cudaStream_t stream);

/* Copies rows 0..rows-1 of a dispatch's received top-k ids (int64 or
 * int32) and weights, [rows][num_topk] each, into idx_out and weights_out;
 * rows at or past *num_recv (device) get -1 and 0. Follows the dispatch on
 * the same stream. */
int moeep_launch_copy_topk(const struct moeep_ctx *ctx, const void *idx, int idx_is_int64, const float *weights,
                           const int *num_recv, int rows, int num_topk, void *idx_out, float *weights_out,
                           cudaStream_t stream);

/* Sends each received row (x: [num_recv][hidden] bf16, weights optional)
 * back to its source rank, waits for every rank's rows, and reduces them
 * into out [num_tokens][hidden] (and out_weights [num_tokens][num_topk]). */
int moeep_launch_combine(const struct moeep_ctx *ctx, const void *x, const float *topk_weights, int num_topk,
                         const struct moeep_route *route, void *out, float *out_weights, cudaStream_t stream);

/* Low-latency mode (kernels/ll/: dispatch.cu, combine.cu, the relays in
 * relay.cu). `phases` (MOEEP_LL_SEND, _RECV or both) are done by one
 * launch of the kernel moeep_ll::dispatch or moeep_ll::combine (DeepEP's
 * profilers count kernels by those names); combine with both phases is a
 * cooperative launch. */
enum {
        MOEEP_LL_SEND = 1,
        MOEEP_LL_RECV = 2
};

/* One low-latency dispatch call, or one of its phases. */
struct moeep_ll_dispatch_launch {
        const void *x;        /* [num_tokens][hidden] bf16 (the send) */
        const void *topk_idx; /* [num_tokens][num_topk] (the send) */
        int idx_is_int64;     /* topk_idx is int64_t (else int32_t) */
        int num_tokens, num_topk;
        int set;   /* the buffer set, 0 or 1 */
        int slots; /* slots per expert of the call (ranks * its max tokens): the stride of every per-expert array */
        int use_fp8, round_scale;
        int phases;
        int *stats; /* [local experts]: the received counts are added, or NULL */
};
int moeep_launch_ll_dispatch(const struct moeep_ctx *ctx, const struct moeep_ll_dispatch_launch *a,
                             cudaStream_t stream);

/* One low-latency combine call, or one of its phases. */
struct moeep_ll_combine_launch {
        const void *y;        /* [local experts][slots][hidden] bf16: the expert outputs (the send) */
        const void *topk_idx; /* [num_tokens][num_topk] (the receive) */
        int idx_is_int64;     /* topk_idx is int64_t (else int32_t) */
        const float *weights; /* [num_tokens][num_topk] (the receive) */
        int num_tokens, num_topk;
        int set, slots; /* as the dispatch's */
        int phases;
        void *out; /* [num_tokens][hidden] bf16 (the receive) */
};
int moeep_launch_ll_combine(const struct moeep_ctx *ctx, const struct moeep_ll_combine_launch *a, cudaStream_t stream);

/* With ranks at other daemons (ctx->px.remote): after dispatch send, waits
 * for every remote source's staged pairs, places them like NVLink writes,
 * then does the receive phase; after combine send, places the remote
 * expert outputs before the receive phase of moeep_launch_ll_combine. */
int moeep_launch_ll_dispatch_relay(const struct moeep_ctx *ctx, int set, int slots, int *stats, cudaStream_t stream);
int moeep_launch_ll_combine_relay(const struct moeep_ctx *ctx, int set, cudaStream_t stream);

/* Elastic endpoints (ctx->shrink). The clean barrier: with every rank
 * that is not masked (one that does not come within the shrink timeout is
 * masked), then the dispatch's claim counters are zeroed. The mask:
 * MOEEP_LL_MASK_QUERY copies it into out [ranks] (int32), _SET sets
 * mask[rank] to value, _CLEAN zeroes it; on the stream, one tiny launch. */
int moeep_launch_ll_clean(const struct moeep_ctx *ctx, cudaStream_t stream);
enum {
        MOEEP_LL_MASK_QUERY = 1,
        MOEEP_LL_MASK_SET = 2,
        MOEEP_LL_MASK_CLEAN = 3
};
int moeep_launch_ll_mask(const struct moeep_ctx *ctx, int op, int rank, int value, int32_t *out, cudaStream_t stream);

/* Normal mode with ranks at other daemons (kernels/normal/proxy.cu), queued
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

#ifdef __cplusplus
}
#endif

#endif
