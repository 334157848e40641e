/* Internal view of an endpoint for moeep-bench's references, which run
 * their own kernels on the same mapped buffers. Not exported from
 * libmoeep.so (links only into programs that link libmoeep statically). */
#ifndef MOEEP_EP_INTERNAL_H
#define MOEEP_EP_INTERNAL_H

#include <stdbool.h>
#include <sys/queue.h>

#include "cumem.h"
#include "kernels.h"
#include "moeep_ep.h"

struct moeep_ep_handle {
        struct moeep_ep *ep;      /* not owning */
        struct moeep_route route; /* arrays inside dev_mem */
        void *dev_mem;            /* owning: cudaMalloc */
        int *expert_counts_host;  /* owning: [local experts] */
        int num_recv;             /* -1 when only the device knows it */
        int max_total_tokens;     /* largest whole dispatch of any rank (rounds), from notify */
        int recv_per_rank[MOEEP_KERNEL_MAX_RANKS]; /* rows from each source rank, when num_recv >= 0 */
        int num_topk;
        /* Used while its stream captured a graph: the graph's replays write
         * or read its route for as long as the graph lives, so once freed it
         * serves only later captures (the endpoint frees it). */
        bool captured;
        SLIST_ENTRY(moeep_ep_handle) free_entry;
};

struct moeep_ep {
        struct moeep_client *client; /* not owning */
        const struct cumem_api *cu;
        struct moeep_ctx ctx;     /* passed to every kernel by value */
        struct cumem_mapping own; /* our buffer */
        struct cumem_mapping peer_maps[MOEEP_KERNEL_MAX_RANKS];
        struct moeep_notify_host *host; /* owning: cudaHostAlloc, mapped */
        cudaEvent_t notify_done;
        int device;
        uint64_t region_id; /* our buffer at the broker; 0 = not registered */
        bool control_page_registered;
        void *control_page; /* not owning: the client's mapping, NULL when the client has none */
        /* Freed handles by their `captured`: [true] serve captures only. */
        SLIST_HEAD(, moeep_ep_handle) free_handles[2];
        unsigned ll_calls; /* low-latency dispatches so far: picks the buffer set */
        uint32_t remote;   /* bit r: rank r is at another daemon (ctx.px.remote, also without a proxy path) */
        char error[512];
};

#define CUDA_TRY(ep, call)                                                                   \
        do {                                                                                 \
                cudaError_t e_ = (call);                                                     \
                if (e_ != cudaSuccess)                                                       \
                        return ep_fail((ep), -EIO, "%s: %s", #call, cudaGetErrorString(e_)); \
        } while (0)

/* Sets the endpoint's error text and returns r. */
int ep_fail(struct moeep_ep *ep, int r, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

/* 0, or -EIO naming `what` and the CUDA error of a failed launch. */
int launch_result(struct moeep_ep *ep, const char *what, int r);

/* 0 while the job lives, else -ENOTCONN (the daemon aborted it: a rank
 * was lost) or -ECONNRESET (moeepd is gone) with the error text set.
 * Every data call starts with it, so it launches nothing on a dead job.
 * `elastic`: the call goes on when ranks were lost (not when the daemon
 * stops). */
int ep_check_live(struct moeep_ep *ep, bool elastic);

/* 0 for a known index type, else -EINVAL with the error text set. */
int check_index_type(struct moeep_ep *ep, enum moeep_index_type t);

/* Copies the kernel context of `ep` (mapped buffers of every rank, layout,
 * state) into ret. */
int ep_internal_ctx(const struct moeep_ep *ep, struct moeep_ctx *ret);

/* The internode proxy path (client/lib/ep-px.c): registers (or reuses) the
 * job's proxy regions and ring for the ranks in `remote` and fills
 * ep->ctx.px; _detach frees what the endpoint holds (the regions stay with
 * the job); _error names a MOEEP_KERR_PROXY failure. */
int ep_px_attach(struct moeep_ep *ep, uint32_t remote);
void ep_px_detach(struct moeep_ep *ep);
int ep_px_error(struct moeep_ep *ep, int peer);

#endif
