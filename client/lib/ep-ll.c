/* Low-latency mode of the data plane; see include/moeep_ep.h. */
#include <errno.h>
#include <string.h>

#include "ep-internal.h"

enum {
        HOOK_NONE = 0,
        HOOK_DISPATCH = 1,
        HOOK_COMBINE = 2
};

static int ll_check(struct moeep_ep *ep, const void *topk_idx, enum moeep_index_type idx_type, int num_tokens,
                    int num_topk) {
        int r;

        if ((r = ep_check_live(ep, ep->ctx.shrink)) < 0)
                return r;
        if (!ep->ctx.ll.max_tokens)
                return ep_fail(ep, -EINVAL, "the endpoint has no low-latency buffers (ll_max_tokens 0)");
        if (num_tokens < 0 || num_tokens > ep->ctx.ll.max_tokens)
                return ep_fail(ep, -EINVAL, "low-latency num_tokens %d is outside 0..%d", num_tokens,
                               ep->ctx.ll.max_tokens);
        if (num_topk < 1 || num_topk > ep->ctx.max_topk)
                return ep_fail(ep, -EINVAL, "low-latency num_topk %d is outside 1..%d", num_topk,
                               ep->ctx.max_topk);
        if ((r = check_index_type(ep, idx_type)) < 0)
                return r;
        if (num_tokens > 0 && !topk_idx)
                return ep_fail(ep, -EINVAL, "low-latency call without topk_idx");
        return 0;
}

/* The kernel context of one call: the endpoint's, or a copy with the
 * call's active_ranks and shrink timeout (elastic endpoints only). */
static int ll_call_ctx(struct moeep_ep *ep, const int32_t *active, int timeout_us, struct moeep_ctx *tmp,
                       const struct moeep_ctx **ret) {
        if (!active && timeout_us <= 0) {
                *ret = &ep->ctx;
                return 0;
        }
        if (!ep->ctx.shrink)
                return ep_fail(ep, -EINVAL,
                               "active_ranks and timeout_us need an elastic endpoint (ll_shrink, DeepEP's "
                               "enable_shrink)");
        *tmp = ep->ctx;
        tmp->active = (int32_t *)active;
        if (timeout_us > 0)
                tmp->shrink_timeout_ns = (uint64_t)timeout_us * 1000;
        *ret = tmp;
        return 0;
}

/* The launch of a low-latency dispatch whose receive `h` describes: its
 * phases, and for the send the rows of `send` (NULL for the receive
 * alone). */
static struct moeep_ll_dispatch_launch ll_dispatch_launch_of(const struct moeep_ll_hook *h,
                                                             const struct moeep_ll_dispatch_args *send,
                                                             int phases) {
        struct moeep_ll_dispatch_launch l = {
                .idx_is_int64 = h->idx_is_int64,
                .num_tokens = h->num_tokens,
                .num_topk = h->num_topk,
                .set = h->set,
                .slots = h->slots,
                .phases = phases,
                .stats = h->stats,
        };

        if (send) {
                l.x = send->x;
                l.topk_idx = send->topk_idx;
                l.use_fp8 = send->use_fp8;
                l.round_scale = send->round_scale;
        }
        return l;
}

/* The launch of a low-latency combine whose receive `h` describes: its
 * phases, and for the send the expert outputs y (NULL for the receive
 * alone). */
static struct moeep_ll_combine_launch ll_combine_launch_of(const struct moeep_ll_hook *h, const void *y,
                                                           int phases) {
        return (struct moeep_ll_combine_launch){
                .y = y,
                .topk_idx = h->topk_idx,
                .idx_is_int64 = h->idx_is_int64,
                .weights = h->topk_weights,
                .num_tokens = h->num_tokens,
                .num_topk = h->num_topk,
                .set = h->set,
                .slots = h->slots,
                .phases = phases,
                .out = h->out,
        };
}

int moeep_ll_dispatch(struct moeep_ep *ep, const struct moeep_ll_dispatch_args *a,
                      struct moeep_ll_dispatch_result *ret, struct moeep_ll_hook *ret_hook,
                      cudaStream_t stream) {
        const struct moeep_ctx *ctx;
        struct moeep_ctx tmp;
        char *own;
        int r, set, slots, idx64;

        if (!ep)
                return -EINVAL;
        if (!a || !ret || (a->return_recv_hook && !ret_hook))
                return ep_fail(ep, -EINVAL, "low-latency dispatch: args, result or hook is NULL");
        if ((r = ll_check(ep, a->topk_idx, a->topk_idx_type, a->num_tokens, a->num_topk)) < 0)
                return r;
        if (a->num_tokens > 0 && !a->x)
                return ep_fail(ep, -EINVAL, "low-latency dispatch: x is NULL with %d tokens", a->num_tokens);
        if (a->use_fp8 && ep->ctx.hidden > MOEEP_LL_FP8_MAX_HIDDEN)
                return ep_fail(ep, -EINVAL, "low-latency FP8 dispatch supports hidden up to %d, not %d",
                               MOEEP_LL_FP8_MAX_HIDDEN, ep->ctx.hidden);
        if (!a->use_fp8 && a->round_scale)
                return ep_fail(ep, -EINVAL, "low-latency dispatch: round_scale needs use_fp8");

        if (a->num_max_tokens < 0 || a->num_max_tokens > ep->ctx.ll.max_tokens ||
            (a->num_max_tokens && a->num_tokens > a->num_max_tokens))
                return ep_fail(ep, -EINVAL, "low-latency num_max_tokens %d is outside %d..%d",
                               a->num_max_tokens, a->num_tokens, ep->ctx.ll.max_tokens);
        slots = ep->ctx.ranks * (a->num_max_tokens ? a->num_max_tokens : ep->ctx.ll.max_tokens);
        idx64 = a->topk_idx_type == MOEEP_INDEX_INT64;
        if ((r = ll_call_ctx(ep, a->active_ranks, a->timeout_us, &tmp, &ctx)) < 0)
                return r;

        set = (int)(ep->ll_calls & 1);
        const struct moeep_ll_hook hook = {
                .kind = HOOK_DISPATCH,
                .set = set,
                .stats = a->cumulative_local_expert_recv_stats,
                .idx_is_int64 = idx64,
                .num_tokens = a->num_tokens,
                .num_topk = a->num_topk,
                .slots = slots,
                .active_ranks = a->active_ranks,
                .timeout_us = a->timeout_us,
        };
        /* Without a hook, one launch does both phases. */
        const struct moeep_ll_dispatch_launch l = ll_dispatch_launch_of(
                &hook, a, MOEEP_LL_SEND | (!a->return_recv_hook && !ep->ctx.px.remote ? MOEEP_LL_RECV : 0));
        r = launch_result(ep, "low-latency dispatch", moeep_launch_ll_dispatch(ctx, &l, stream));
        if (r == 0 && !a->return_recv_hook && ep->ctx.px.remote) /* remote pairs: the relay receives */
                r = launch_result(ep, "low-latency dispatch relay",
                                  moeep_launch_ll_dispatch_relay(
                                          ctx, set, slots, a->cumulative_local_expert_recv_stats, stream));
        if (r < 0)
                return r;
        ep->ll_calls++;
        if (a->return_recv_hook)
                *ret_hook = hook;

        own = ep->ctx.peers[ep->ctx.rank];
        *ret = (struct moeep_ll_dispatch_result){
                .recv_x = own + ep->ctx.ll.x[set],
                .recv_x_scales = a->use_fp8 ? (float *)(own + ep->ctx.ll.scales[set]) : NULL,
                .recv_count = ((const struct moeep_ll_sync *)(own + ep->ctx.ll.sync))->count[set],
                .recv_src_info = (const int *)(own + ep->ctx.ll.src[set]),
                .num_local_experts = ep->ctx.num_experts / ep->ctx.ranks,
                .slots_per_expert = slots,
                .handle = { .set = set, .num_tokens = a->num_tokens, .slots_per_expert = slots },
                .layout_range = (const int64_t *)(own + ep->ctx.ll.range[set]),
                .combine_buffer = own + ep->ctx.ll.x[set],
        };
        return 0;
}

int moeep_ll_combine(struct moeep_ep *ep, const struct moeep_ll_combine_args *a,
                     struct moeep_ll_hook *ret_hook, cudaStream_t stream) {
        int r;

        if (!ep)
                return -EINVAL;
        if (!a || !a->handle || (a->return_recv_hook && !ret_hook))
                return ep_fail(ep, -EINVAL, "low-latency combine: args, handle or hook is NULL");
        if (a->handle->set != 0 && a->handle->set != 1)
                return ep_fail(ep, -EINVAL, "low-latency combine: handle names buffer set %d",
                               a->handle->set);
        if ((r = ll_check(ep, a->topk_idx, a->topk_idx_type, a->handle->num_tokens, a->num_topk)) < 0)
                return r;
        if (!a->x || (a->handle->num_tokens > 0 && (!a->out || !a->topk_weights)))
                return ep_fail(ep, -EINVAL, "low-latency combine: x, out or topk_weights is NULL");
        if (a->handle->slots_per_expert < ep->ctx.ranks ||
            a->handle->slots_per_expert > ep->ctx.ranks * ep->ctx.ll.max_tokens ||
            a->handle->slots_per_expert % ep->ctx.ranks)
                return ep_fail(ep, -EINVAL, "low-latency combine: handle has %d slots per expert",
                               a->handle->slots_per_expert);

        const int idx64 = a->topk_idx_type == MOEEP_INDEX_INT64;
        const struct moeep_ctx *ctx;
        struct moeep_ctx tmp;
        if ((r = ll_call_ctx(ep, a->active_ranks, a->timeout_us, &tmp, &ctx)) < 0)
                return r;
        /* Without a hook and without remote ranks (whose rows a relay kernel
         * places between the phases), one launch does both phases. */
        const int both = !a->return_recv_hook && !ep->ctx.px.remote;
        const struct moeep_ll_hook hook = {
                .kind = HOOK_COMBINE,
                .set = a->handle->set,
                .slots = a->handle->slots_per_expert,
                .topk_idx = a->topk_idx,
                .idx_is_int64 = idx64,
                .topk_weights = a->topk_weights,
                .num_tokens = a->handle->num_tokens,
                .num_topk = a->num_topk,
                .out = a->out,
                .active_ranks = a->active_ranks,
                .timeout_us = a->timeout_us,
        };
        const struct moeep_ll_combine_launch l =
                ll_combine_launch_of(&hook, a->x, MOEEP_LL_SEND | (both ? MOEEP_LL_RECV : 0));
        r = launch_result(ep, "low-latency combine", moeep_launch_ll_combine(ctx, &l, stream));
        if (r < 0 || both)
                return r;
        if (a->return_recv_hook) {
                *ret_hook = hook;
                return 0;
        }
        return moeep_ll_hook_run(ep, &hook, stream);
}

int moeep_ll_hook_run(struct moeep_ep *ep, const struct moeep_ll_hook *h, cudaStream_t stream) {
        const struct moeep_ctx *ctx;
        struct moeep_ctx tmp;
        int r;

        if (!ep)
                return -EINVAL;
        if (!h)
                return ep_fail(ep, -EINVAL, "low-latency hook is NULL");
        if (h->kind != HOOK_NONE && (r = ll_call_ctx(ep, h->active_ranks, h->timeout_us, &tmp, &ctx)) < 0)
                return r;
        switch (h->kind) {
        case HOOK_NONE:
                return 0;
        case HOOK_DISPATCH: {
                if (ep->ctx.px.remote)
                        return launch_result(
                                ep, "low-latency dispatch relay",
                                moeep_launch_ll_dispatch_relay(ctx, h->set, h->slots, h->stats, stream));
                const struct moeep_ll_dispatch_launch l = ll_dispatch_launch_of(h, NULL, MOEEP_LL_RECV);
                return launch_result(ep, "low-latency dispatch receive",
                                     moeep_launch_ll_dispatch(ctx, &l, stream));
        }
        case HOOK_COMBINE: {
                if (ep->ctx.px.remote) {
                        r = launch_result(ep, "low-latency combine relay",
                                          moeep_launch_ll_combine_relay(ctx, h->set, stream));
                        if (r < 0)
                                return r;
                }
                const struct moeep_ll_combine_launch l = ll_combine_launch_of(h, NULL, MOEEP_LL_RECV);
                return launch_result(ep, "low-latency combine receive",
                                     moeep_launch_ll_combine(ctx, &l, stream));
        }
        }
        return ep_fail(ep, -EINVAL, "low-latency hook of unknown kind %d", h->kind);
}

/* Elastic: the clean barrier on the device (moeep_launch_ll_clean), which
 * needs no daemon barrier (the job may have lost ranks: its daemon barriers
 * fail then). */
static int ll_clean_elastic(struct moeep_ep *ep) {
        int r;

        if ((r = ep_check_live(ep, true)) < 0)
                return r;
        if (cudaDeviceSynchronize() != cudaSuccess)
                return ep_fail(ep, -EIO, "cleaning the low-latency buffers: %s",
                               cudaGetErrorString(cudaGetLastError()));
        r = launch_result(ep, "low-latency clean barrier", moeep_launch_ll_clean(&ep->ctx, 0));
        return r < 0 ? r : moeep_ep_check(ep);
}

int moeep_ll_clean(struct moeep_ep *ep) {
        char *own;
        int r;

        if (!ep)
                return -EINVAL;
        if (!ep->ctx.ll.max_tokens)
                return ep_fail(ep, -EINVAL, "the endpoint has no low-latency buffers (ll_max_tokens 0)");
        if (ep->ctx.shrink)
                return ll_clean_elastic(ep);
        own = ep->ctx.peers[ep->ctx.rank];
        /* Counters and counts only: flags carry sequence numbers and never
         * need it. */
        if (cudaDeviceSynchronize() != cudaSuccess ||
            cudaMemset(own + ep->ctx.ll.sync, 0, offsetof(struct moeep_ll_sync, count_flag)) != cudaSuccess ||
            cudaMemset(ep->ctx.state->ll_pos, 0, sizeof(ep->ctx.state->ll_pos)) != cudaSuccess ||
            cudaDeviceSynchronize() != cudaSuccess)
                return ep_fail(ep, -EIO, "cleaning the low-latency buffers: %s",
                               cudaGetErrorString(cudaGetLastError()));
        r = moeep_job_barrier(ep->client);
        if (r < 0)
                return ep_fail(ep, r, "barrier after cleaning: %s", moeep_client_error(ep->client));
        return 0;
}

/* ------------------------------------------------------------------ elastic ranks: the mask */

static int mask_op(struct moeep_ep *ep, int op, int rank, int value, int32_t *out, cudaStream_t stream,
                   const char *what) {
        if (!ep)
                return -EINVAL;
        if (!ep->ctx.shrink)
                return ep_fail(ep, -EINVAL,
                               "%s: the endpoint is not elastic (ll_shrink, DeepEP's enable_shrink)", what);
        return launch_result(ep, what, moeep_launch_ll_mask(&ep->ctx, op, rank, value, out, stream));
}

int moeep_ll_mask_query(struct moeep_ep *ep, int32_t *mask_status, cudaStream_t stream) {
        if (ep && !mask_status)
                return ep_fail(ep, -EINVAL, "low-latency mask query: mask_status is NULL");
        return mask_op(ep, MOEEP_LL_MASK_QUERY, 0, 0, mask_status, stream, "low-latency mask query");
}

int moeep_ll_mask_update(struct moeep_ep *ep, int rank, bool mask, cudaStream_t stream) {
        if (ep && (rank < 0 || rank >= ep->ctx.ranks))
                return ep_fail(ep, -EINVAL, "low-latency mask update: rank %d is outside 0..%d", rank,
                               ep->ctx.ranks - 1);
        return mask_op(ep, MOEEP_LL_MASK_SET, rank, mask ? 1 : 0, NULL, stream, "low-latency mask update");
}

int moeep_ll_mask_clean(struct moeep_ep *ep, cudaStream_t stream) {
        return mask_op(ep, MOEEP_LL_MASK_CLEAN, 0, 0, NULL, stream, "low-latency mask clean");
}
