/* libmoeep data plane: expert-parallel dispatch and combine over NVLink.
 *
 * An endpoint (struct moeep_ep) is one rank's attachment to the job's NVLink
 * buffers: it allocates its own buffer with cuMemCreate, registers the POSIX
 * fd with moeepd, receives the peers' fds through the daemon and maps them.
 * Kernels run on the caller's stream; the daemon is not on the data path.
 *
 * Every rank of the job must make the same sequence of collective calls
 * (moeep_ep_create, moeep_dispatch, moeep_combine, moeep_ep_destroy).
 * An endpoint is used from one thread and one stream at a time.
 *
 * Supported shapes (checked; anything else is -EINVAL, never a wrong answer):
 *   ranks 1..8; hidden a multiple of 256 in 256..16384 (e.g. 2048, 4096,
 *   5120, 7168); top-k 1..9; experts 1..512 and divisible by the ranks;
 *   0..max_tokens_per_rank tokens per call (max 65536).
 */
#ifndef MOEEP_EP_H
#define MOEEP_EP_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <cuda_runtime_api.h>

#include "moeep.h"

#ifdef __cplusplus
extern "C" {
#endif

#define MOEEP_DEFAULT_NUM_SMS 24
#define MOEEP_DEFAULT_TIMEOUT_MS 10000
#define MOEEP_LL_MAX_TOKENS 1024
/* Elastic endpoints: how long a low-latency call waits for a rank that
 * neither comes nor is known lost before it masks it (see "Elastic ranks"
 * below for why this value). */
#define MOEEP_DEFAULT_SHRINK_TIMEOUT_MS 3000

struct moeep_ep;
struct moeep_ep_handle;

enum moeep_dtype {
        MOEEP_DTYPE_BF16 = 1,
        MOEEP_DTYPE_FP8_E4M3 = 2, /* with one float scale per 128 channels */
};

enum moeep_index_type {
        MOEEP_INDEX_INT64 = 1,
        MOEEP_INDEX_INT32 = 2,
};

struct moeep_ep_config {
        int max_tokens_per_rank; /* tokens one rank may dispatch per call */
        int hidden;              /* channels per token */
        int num_experts;         /* experts of the layer, over all ranks */
        int max_topk;            /* largest top-k a call will use */
        int num_sms;             /* blocks of normal-mode dispatch/combine; 0 = MOEEP_DEFAULT_NUM_SMS
                                  * (low-latency kernels use every SM of the device) */
        int timeout_ms;          /* bound of every device wait; 0 = MOEEP_DEFAULT_TIMEOUT_MS */
        int ll_max_tokens; /* low-latency mode: tokens per rank per call (0..1024); 0 = no low-latency buffers */
        /* Normal-mode receive areas (0 = 1, at most 8; the same on every
         * rank): each dispatch lands in the area its args name, so that the
         * outputs of earlier dispatches in other areas stay intact (a
         * caller that hands them out as views picks an area nobody holds). */
        int recv_areas;
        /* Elastic ranks (DeepEP's enable_shrink): 1 = the low-latency calls
         * go on without ranks that are lost or masked (see "Elastic ranks"
         * below); needs ll_max_tokens. Every rank of the job sets the same. */
        int ll_shrink;
        /* Elastic: the shrink timeout; 0 = $MOEEP_SHRINK_TIMEOUT_MS when set,
         * else MOEEP_DEFAULT_SHRINK_TIMEOUT_MS. */
        int shrink_timeout_ms;
};

/* Attaches to the job `client` joined (collective over the job's ranks) on
 * the current CUDA device. On failure the reason is the client's error text
 * (moeep_client_error()). */
int moeep_ep_create(struct moeep_client *client, const struct moeep_ep_config *config,
                    struct moeep_ep **ret_ep);

/* Unmaps and frees everything (synchronises the device). Accepts NULL. */
void moeep_ep_destroy(struct moeep_ep *ep);

/* Text of the last error on this endpoint ("" when none). */
const char *moeep_ep_error(const struct moeep_ep *ep);

/* Bytes of this rank's NVLink buffer (the same on every rank). */
size_t moeep_ep_buffer_bytes(const struct moeep_ep *ep);

int moeep_ep_rank(const struct moeep_ep *ep);
int moeep_ep_num_ranks(const struct moeep_ep *ep);

/* Changes the number of SMs (blocks) used by normal-mode dispatch and
 * combine; must be the same on every rank. */
int moeep_ep_set_num_sms(struct moeep_ep *ep, int num_sms);

/* Waits for the device and reports a failure of an earlier device wait
 * (-ETIMEDOUT, or -ENOTCONN when the job was aborted; -EPROTO when an
 * elastic dispatch found ranks placing pairs by different views, see
 * "Elastic ranks"); 0 when healthy. */
int moeep_ep_check(struct moeep_ep *ep);

/* Layout of a routing, as DeepEP's get_dispatch_layout: from topk_idx
 * [num_tokens][num_topk] (-1 = masked) computes num_tokens_per_rank [ranks],
 * num_tokens_per_expert [experts] and is_token_in_rank [num_tokens][ranks]
 * (0/1 bytes). All device pointers; every output is fully written. */
int moeep_get_dispatch_layout(struct moeep_ep *ep, const void *topk_idx, enum moeep_index_type idx_type,
                              int num_tokens, int num_topk, int *num_tokens_per_rank,
                              int *num_tokens_per_expert, uint8_t *is_token_in_rank, cudaStream_t stream);

struct moeep_dispatch_args {
        const void *x; /* [num_tokens][hidden], bf16 or fp8 e4m3 */
        enum moeep_dtype x_type;
        const float *x_scales; /* fp8 only: [num_tokens][hidden / 128], row-major unless the strides say */
        int num_tokens;
        /* Routing: is_token_in_rank [num_tokens][ranks] (0/1 bytes) when not
         * NULL, else the ranks of the top-k experts. Ignored with a handle. */
        const uint8_t *is_token_in_rank;
        const void *topk_idx; /* [num_tokens][num_topk], -1 = masked; optional (NULL with
                                         * num_tokens 0 and num_topk set: a rank with no tokens
                                         * in a dispatch whose top-k travels) */
        enum moeep_index_type topk_idx_type;
        const float *topk_weights; /* [num_tokens][num_topk]; optional, only with topk_idx */
        int num_topk;
        int expert_alignment; /* per-expert counts rounded up to this; 0 or 1 = exact */
        /* > 0: no host synchronisation at all (graph capturable); the caller
         * sizes for this many received tokens (at most ranks * max_tokens,
         * which is what the buffer holds) and reads the real count from
         * num_recv_tokens_dev. 0: the host waits for the count. */
        int num_worst_tokens;
        /* Non-NULL: reuse the routing of an earlier dispatch with the same
         * topk (cached mode): no layout, no count exchange. */
        struct moeep_ep_handle *handle;
        /* Optional device [num_experts]: tokens this rank sends to each
         * expert (DeepEP's num_tokens_per_expert); when given, the received
         * per-expert counts are summed from it (also without topk_idx). */
        const int *num_tokens_per_expert;
        /* A caller that sends a dispatch larger than max_tokens_per_rank in
         * rounds (each a moeep_dispatch of at most max_tokens_per_rank
         * tokens) passes the whole dispatch's tokens here; the largest over
         * the ranks comes back in max_total_tokens, so every rank can run
         * the same number of rounds. 0 = num_tokens. */
        int total_tokens;
        /* Receive area of this dispatch, 0..recv_areas - 1, chosen by each
         * rank for itself (its sources learn it in the dispatch's barrier). */
        int recv_area;
        /* Elements from one token's scales to the next and from one scale
         * of a token to its next; 0, 0 = row-major. DeepEP's callers pass
         * them column-major (token stride 1, block stride num_tokens). */
        int64_t x_scales_token_stride, x_scales_block_stride;
};

/* Outputs of a dispatch. The device arrays live in this rank's NVLink
 * buffer, in the receive area the args named: they are valid until the
 * next dispatch into the same area. */
struct moeep_dispatch_result {
        void *recv_x;         /* [num_recv][hidden], ordered by source rank then token */
        float *recv_x_scales; /* fp8: [num_recv][hidden / 128]; else NULL */
        void *recv_topk_idx;  /* [num_recv][num_topk] local expert ids (-1 elsewhere); NULL without topk */
        float *recv_topk_weights;       /* [num_recv][num_topk], 0 for experts elsewhere; NULL without topk */
        const int *recv_src_info;       /* [num_recv]: (source rank << 24) | source token */
        int num_recv_tokens;            /* -1 with num_worst_tokens */
        const int *num_recv_tokens_dev; /* device int */
        /* Received tokens per local expert (aligned): host copy (NULL with
         * num_worst_tokens) and device array, both [num_local_experts];
         * owned by the handle. */
        const int *num_recv_tokens_per_expert;
        const int *num_recv_tokens_per_expert_dev;
        int num_local_experts;
        /* The routing, for combine and cached dispatch. A new handle unless
         * one was passed in; free with moeep_ep_handle_free(). */
        struct moeep_ep_handle *handle;
        /* Device arrays owned by the handle: [ranks][ranks] int32, element
         * [s][d] the rows ranks 0..s send to rank d (DeepEP's
         * rank_prefix_matrix; recv rows from source s start at [s-1][me]);
         * [num_tokens][ranks] int32: the row of each token among ours at
         * each destination, -1 when not sent. */
        const int *rank_prefix_matrix;
        const int *send_pos;
        int max_total_tokens; /* largest total_tokens of any rank; -1 with num_worst_tokens or a handle */
        /* Host [ranks], owned by the handle: rows received from each source
         * rank (the differences of column `me` of rank_prefix_matrix); NULL
         * where the host does not know them (num_worst_tokens, and a cached
         * dispatch of such a handle). */
        const int *num_recv_tokens_per_rank;
};

int moeep_dispatch(struct moeep_ep *ep, const struct moeep_dispatch_args *args,
                   struct moeep_dispatch_result *ret_result, cudaStream_t stream);

/* Copies the top-k ids and weights a dispatch received (rows 0..rows-1 of
 * its recv_topk_idx and recv_topk_weights, the handle's num_topk entries a
 * row, ids of idx_type: the dispatch's) from receive area recv_area (the
 * dispatch's) into the caller's device arrays, so that a caller who keeps
 * them need not keep the area. rows is the received count, or with
 * num_worst_tokens that count (rows past the real count, which only the
 * device knows, read -1 and 0, as DeepEP's). One kernel on `stream`, after
 * the dispatch; before the next dispatch into the area. */
int moeep_dispatch_copy_topk(struct moeep_ep *ep, const struct moeep_ep_handle *handle, int recv_area,
                             enum moeep_index_type idx_type, int rows, void *topk_idx_out,
                             float *topk_weights_out, cudaStream_t stream);

struct moeep_combine_args {
        const void *x;             /* bf16 [num_recv][hidden]: one row per received row, same order */
        const float *topk_weights; /* optional [num_recv][num_topk] */
        int num_topk;
        struct moeep_ep_handle *handle;
        void *out;               /* bf16 [num_tokens][hidden] of the dispatch */
        float *out_topk_weights; /* optional [num_tokens][num_topk]: sum over ranks */
};

/* Receive area 0 of the endpoint, with room for moeep_ep_max_recv_tokens()
 * rows: for callers that wrap it in their own tensors or poison it before a
 * test. The num_* fields are 0 and handle is NULL. */
int moeep_ep_recv_buffers(const struct moeep_ep *ep, struct moeep_dispatch_result *ret_result);

/* The same for receive area `area` (0..recv_areas - 1), and the bytes from
 * its first array (recv_x) to the end of its last one: every array of the
 * area lies inside [recv_x, recv_x + *ret_bytes). */
int moeep_ep_recv_area(const struct moeep_ep *ep, int area, struct moeep_dispatch_result *ret_result,
                       size_t *ret_bytes);

/* ranks * max_tokens_per_rank: the most rows one dispatch can deliver. */
int moeep_ep_max_recv_tokens(const struct moeep_ep *ep);

/* Sends the rows back and sums every token's contributions into out. */
int moeep_combine(struct moeep_ep *ep, const struct moeep_combine_args *args, cudaStream_t stream);

/* Number of tokens the handle's dispatch sent from this rank. */
int moeep_ep_handle_num_tokens(const struct moeep_ep_handle *handle);

/* Returns the handle to its endpoint. Kernels already queued on the
 * endpoint's stream may still use it. A handle used by a dispatch or
 * combine captured in a CUDA graph stays the graph's (its replays rewrite
 * or read its routing): it serves only later captures and goes with the
 * endpoint. Accepts NULL. */
void moeep_ep_handle_free(struct moeep_ep_handle *handle);

/* ------------------------------------------------------------------ low-latency mode
 *
 * Decode-sized calls, with DeepEP's layout. Each (token, expert) pair of a
 * dispatch lands at the expert's rank in a per-expert slot:
 * recv_x[local expert][slot], slots 0..recv_count[local expert]-1 in use,
 * holding each source rank's tokens together, sources in rank order
 * (layout_range says where each source's run starts; with ranks at other
 * daemons, this daemon's sources come first), so the output feeds
 * a masked grouped GEMM directly. Everything stays on the device (no host
 * synchronisation, fixed shapes): dispatch and combine, with or without
 * the receive hook, can be captured in a CUDA graph.
 *
 * Two buffer sets alternate between dispatches (the set is picked at each
 * dispatch, in call order, identically on every rank). Rule: dispatch n+2
 * is issued only after dispatch n's receive phase ran everywhere (its hook,
 * when it has one); the outputs of dispatch n stay valid until dispatch
 * n+2. A dispatch need not be combined, and one may be combined more than
 * once. A token must not name one expert twice in its top-k. FP8 dispatch
 * supports hidden sizes up to 8192. */

/* What a receive phase still has to do: returned when a call asks for the
 * hook, run later with moeep_ll_hook_run(). Plain data, copyable. */
struct moeep_ll_hook {
        int kind; /* 1 = dispatch receive, 2 = combine receive, 0 = nothing pending */
        int set;
        int *stats;
        const void *topk_idx;
        int idx_is_int64;
        const float *topk_weights;
        int num_tokens, num_topk;
        void *out;
        int slots;                   /* slots per expert of the dispatch */
        const int32_t *active_ranks; /* elastic: the call's, for its receive */
        int timeout_us;
};

/* Routing of one low-latency dispatch, for its combine. Plain data. */
struct moeep_ll_handle {
        int set; /* buffer set of the dispatch */
        int num_tokens;
        int slots_per_expert; /* ranks * the dispatch's num_max_tokens */
};

struct moeep_ll_dispatch_args {
        const void *x;        /* bf16 [num_tokens][hidden] */
        int num_tokens;       /* 0..ll_max_tokens */
        const void *topk_idx; /* [num_tokens][num_topk], -1 = masked */
        enum moeep_index_type topk_idx_type;
        int num_topk;                            /* 1..max_topk */
        bool use_fp8;                            /* cast to e4m3 with one float scale per 128 channels */
        bool round_scale;                        /* fp8: scales rounded up to powers of two */
        bool return_recv_hook;                   /* only the send phase now; the rest in *ret_hook */
        int *cumulative_local_expert_recv_stats; /* optional device [local experts]: += received per expert */
        int num_max_tokens; /* slots per expert = ranks * this (num_tokens..ll_max_tokens);
                                                 * 0 = ll_max_tokens */
        /* Elastic endpoints only (NULL / 0 otherwise). Device int32 [ranks],
         * the caller's view of the live ranks as Mooncake EP takes it: a rank
         * at 0 is left out of this call (as if masked); moeep writes 0 for
         * every rank the call masks. Same contents on every rank. */
        const int32_t *active_ranks;
        int timeout_us; /* > 0: this call's shrink timeout; 0 (or < 0): the endpoint's */
};

/* Device arrays in the endpoint's NVLink buffer (set `handle.set`). */
struct moeep_ll_dispatch_result {
        void *recv_x; /* [local experts][slots_per_expert][hidden]: bf16, or e4m3 with stride hidden */
        float *recv_x_scales;     /* fp8: [local experts][hidden / 128][slots_per_expert] (column-major per
                                     * expert, as DeepEP); else NULL */
        const int *recv_count;    /* [local experts]: slots in use */
        const int *recv_src_info; /* [local experts][slots_per_expert]: the source token index */
        int num_local_experts;
        int slots_per_expert; /* ranks * num_max_tokens */
        struct moeep_ll_handle handle;
        const int64_t
                *layout_range; /* [local experts][ranks]: first slot << 32 | count of each source rank */
        void *combine_buffer;  /* bf16 [local experts][slots_per_expert][hidden]: combine input in
                                     * place (zero copy; overwrites recv_x of this dispatch) */
};

int moeep_ll_dispatch(struct moeep_ep *ep, const struct moeep_ll_dispatch_args *args,
                      struct moeep_ll_dispatch_result *ret_result, struct moeep_ll_hook *ret_hook,
                      cudaStream_t stream);

struct moeep_ll_combine_args {
        /* Expert outputs, bf16 [local experts][slots_per_expert][hidden] in the
         * dispatch's layout; only the slots in use are read. Any device
         * memory works, combine_buffer of the dispatch included (zero copy).
         * Read by the call's launch only: with a hook by the send (x may be
         * reused before the hook runs); without one, our own tokens'
         * outputs are read in place by the receive of the same launch. */
        const void *x;
        const void *topk_idx; /* the dispatch's [num_tokens][num_topk] */
        enum moeep_index_type topk_idx_type;
        const float *topk_weights; /* [num_tokens][num_topk] */
        int num_topk;
        const struct moeep_ll_handle *handle;
        void *out; /* bf16 [num_tokens][hidden]: sum over k of weight * expert output */
        bool return_recv_hook;
        const int32_t *active_ranks; /* elastic: as in moeep_ll_dispatch_args */
        int timeout_us;
};

int moeep_ll_combine(struct moeep_ep *ep, const struct moeep_ll_combine_args *args,
                     struct moeep_ll_hook *ret_hook, cudaStream_t stream);

/* Runs the receive phase a hook describes (no-op for an empty hook). */
int moeep_ll_hook_run(struct moeep_ep *ep, const struct moeep_ll_hook *hook, cudaStream_t stream);

/* Resets the low-latency counters of both sets (collective: every rank
 * calls it while no low-latency call is in flight anywhere). Elastic: a
 * barrier on the device with every rank that is not masked, where a rank
 * that does not come within the shrink timeout is masked (DeepEP's
 * clean_low_latency_buffer with shrink); synchronises the device. */
int moeep_ll_clean(struct moeep_ep *ep);

/* ------------------------------------------------------------------ elastic ranks
 *
 * An endpoint created with ll_shrink = 1 is elastic: its low-latency calls
 * go on without ranks that are masked, as DeepEP's do with enable_shrink.
 * The endpoint keeps a mask of ranks (DeepEP's mask buffer, on the device):
 *
 *  - Masked ranks' pairs are dropped in dispatch (not sent, not counted in
 *    recv_count or layout_range: each expert's slots hold the other
 *    sources' pairs from slot 0 on) and their experts' outputs left out of
 *    combine (as if those top-k entries were -1). Nothing is written into a
 *    masked rank's buffers.
 *  - A rank is masked by a call that needed it and did not get it: the
 *    daemon marked it lost (its process died, or its daemon, or the mesh
 *    link to its daemon: the job's control page says so within
 *    milliseconds, and a call waiting for it ends at once), or it did not
 *    come within the shrink timeout (alive but silent: it skipped the
 *    call). Every dispatch also masks the ranks the daemon marked lost
 *    before it starts. Calls that were in flight complete.
 *  - The shrink timeout (shrink_timeout_ms, $MOEEP_SHRINK_TIMEOUT_MS,
 *    default MOEEP_DEFAULT_SHRINK_TIMEOUT_MS = 3 s; DeepEP's is 100 s)
 *    only has to catch ranks that are alive but silent, since the daemon
 *    reports dead ones: it must be longer than anything that can hold a
 *    healthy rank back from a call (a decode step is tens of ms; a first
 *    call may wait up to 2 s for a transport between daemons to open) and
 *    short enough that a stuck rank costs seconds, not minutes. A wait for
 *    a rank's counts masks it after the timeout, a wait for its rows after
 *    twice it (its sender may have waited one timeout for counts first).
 *  - Masks are per rank: every rank masks a dead rank, but a timeout is
 *    each rank's own. Ranks whose masks differ (one masked a rank that the
 *    others saw alive) keep working as long as what they send agrees; if a
 *    dispatch finds a source that placed its pairs by counts it did not see
 *    (a rank died while its counts reached some ranks and not others), the
 *    call fails (-EPROTO from moeep_ep_check) instead of mixing rows.
 *  - Normal-mode calls of an elastic endpoint fail when a rank is lost, as
 *    any endpoint's do: rebuild the job over the survivors (docs/
 *    reliability.md, "Rebuilding over the survivors").
 *  - A masked rank can be unmasked (moeep_ll_mask_update) only when it made
 *    the same low-latency calls as the others meanwhile (every call is
 *    numbered); a rank that missed calls is rejoined by rebuilding. */

/* Copies the mask into device int32 mask_status[ranks] (1 = masked) on
 * `stream`. -EINVAL on an endpoint that is not elastic. */
int moeep_ll_mask_query(struct moeep_ep *ep, int32_t *mask_status, cudaStream_t stream);

/* Masks (mask true) or unmasks `rank`, on `stream`. */
int moeep_ll_mask_update(struct moeep_ep *ep, int rank, bool mask, cudaStream_t stream);

/* Unmasks every rank, on `stream`. */
int moeep_ll_mask_clean(struct moeep_ep *ep, cudaStream_t stream);

/* The ranks the daemon marked lost in the job's control page (bit r: rank
 * r), read now on the host. -EOPNOTSUPP when the daemon's control page has
 * no such word (an older moeepd). */
int moeep_ep_lost_ranks(const struct moeep_ep *ep, uint32_t *ret_lost);

#ifdef __cplusplus
}
#endif

#endif
