/* Data plane endpoint: NVLink buffers brokered by moeepd, and the normal
 * mode dispatch/combine entry points. See include/moeep_ep.h. */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/queue.h>
#include <unistd.h>

#include "client-internal.h"
#include "cumem.h"
#include "ep-internal.h"
#include "kernels.h"
#include "moeep_ep.h"

#define NVL_REGION_TAG 0 /* tag of the NVLink buffer among a rank's regions */

static int handle_get(struct moeep_ep *ep, cudaStream_t stream, struct moeep_ep_handle **ret);
int ep_fail(struct moeep_ep *ep, int r, const char *fmt, ...) {
        va_list ap;

        va_start(ap, fmt);
        vsnprintf(ep->error, sizeof(ep->error), fmt, ap);
        va_end(ap);
        return r;
}

int launch_result(struct moeep_ep *ep, const char *what, int r) {
        if (r == 0)
                return 0;
        return ep_fail(ep, -EIO, "%s: kernel launch failed: %s", what, cudaGetErrorString((cudaError_t)r));
}

const char *moeep_ep_error(const struct moeep_ep *ep) {
        return ep ? ep->error : "no endpoint";
}

size_t moeep_ep_buffer_bytes(const struct moeep_ep *ep) {
        return ep ? ep->own.size : 0;
}

int moeep_ep_rank(const struct moeep_ep *ep) {
        return ep ? ep->ctx.rank : -EINVAL;
}

int moeep_ep_num_ranks(const struct moeep_ep *ep) {
        return ep ? ep->ctx.ranks : -EINVAL;
}

static int config_check(struct moeep_ep *ep, const struct moeep_ep_config *c, int ranks) {
        if (c->max_tokens_per_rank < 1 || c->max_tokens_per_rank > MOEEP_KERNEL_MAX_TOKENS)
                return ep_fail(ep, -EINVAL, "max_tokens_per_rank %d is outside 1..%d", c->max_tokens_per_rank,
                               MOEEP_KERNEL_MAX_TOKENS);
        if (c->hidden < MOEEP_HIDDEN_MULTIPLE || c->hidden > MOEEP_KERNEL_MAX_HIDDEN ||
            c->hidden % MOEEP_HIDDEN_MULTIPLE)
                return ep_fail(ep, -EINVAL, "hidden %d is not a multiple of %d in %d..%d", c->hidden,
                               MOEEP_HIDDEN_MULTIPLE, MOEEP_HIDDEN_MULTIPLE, MOEEP_KERNEL_MAX_HIDDEN);
        if (c->num_experts < 1 || c->num_experts > MOEEP_KERNEL_MAX_EXPERTS || c->num_experts % ranks)
                return ep_fail(ep, -EINVAL, "num_experts %d must be in 1..%d and divisible by the %d ranks",
                               c->num_experts, MOEEP_KERNEL_MAX_EXPERTS, ranks);
        if (c->max_topk < 1 || c->max_topk > MOEEP_KERNEL_MAX_TOPK)
                return ep_fail(ep, -EINVAL, "max_topk %d is outside 1..%d", c->max_topk,
                               MOEEP_KERNEL_MAX_TOPK);
        if (c->num_sms < 0 || c->num_sms > MOEEP_KERNEL_MAX_SMS)
                return ep_fail(ep, -EINVAL, "num_sms %d is outside 0..%d", c->num_sms, MOEEP_KERNEL_MAX_SMS);
        if (c->ll_max_tokens < 0 || c->ll_max_tokens > MOEEP_LL_MAX_TOKENS)
                return ep_fail(ep, -EINVAL, "ll_max_tokens %d is outside 0..%d", c->ll_max_tokens,
                               MOEEP_LL_MAX_TOKENS);
        if (c->timeout_ms < 0)
                return ep_fail(ep, -EINVAL, "timeout_ms %d is negative", c->timeout_ms);
        if (c->recv_areas < 0 || c->recv_areas > MOEEP_MAX_RECV_AREAS)
                return ep_fail(ep, -EINVAL, "recv_areas %d is outside 0..%d", c->recv_areas,
                               MOEEP_MAX_RECV_AREAS);
        if (c->ll_shrink != 0 && c->ll_shrink != 1)
                return ep_fail(ep, -EINVAL, "ll_shrink %d is neither 0 nor 1", c->ll_shrink);
        if (c->ll_shrink && !c->ll_max_tokens)
                return ep_fail(ep, -EINVAL, "ll_shrink needs low-latency buffers (ll_max_tokens > 0)");
        if (c->shrink_timeout_ms < 0)
                return ep_fail(ep, -EINVAL, "shrink_timeout_ms %d is negative", c->shrink_timeout_ms);
        return 0;
}

/* Maps the NVLink buffer of every other rank at this daemon, as brokered
 * by it; ranks in `remote` are at other daemons and reached through the
 * proxy path. */
static int map_peers(struct moeep_ep *ep, uint32_t remote) {
        const int expect = ep->ctx.ranks - 1 - __builtin_popcount(remote);
        struct moeep_region *regions = NULL;
        size_t n = 0;
        int r;

        r = moeep_regions_fetch(ep->client, -1, NVL_REGION_TAG, &regions, &n);
        if (r < 0)
                return ep_fail(ep, r, "fetching the peers' NVLink buffers: %s",
                               moeep_client_error(ep->client));
        for (size_t i = 0; i < n; i++) {
                const struct moeep_region *g = &regions[i];
                CUresult cr;

                if (g->fd < 0 && g->rank >= 0 && g->rank < ep->ctx.ranks && ((remote >> g->rank) & 1))
                        continue; /* metadata of a remote rank's buffer */

                if (g->rank < 0 || g->rank >= ep->ctx.ranks || g->rank == ep->ctx.rank ||
                    ep->peer_maps[g->rank].ptr || g->kind != MOEEP_REGION_CUMEM_FD ||
                    g->size != ep->own.size) {
                        r = ep_fail(ep, -EPROTO,
                                    "peer buffer %zu (rank %d, kind %d, %llu bytes) does not match ours (%zu "
                                    "bytes)",
                                    i, g->rank, (int)g->kind, (unsigned long long)g->size, ep->own.size);
                        goto out;
                }
                cr = cumem_import(ep->cu, g->fd, g->size, ep->device, &ep->peer_maps[g->rank]);
                if (cr != CUDA_SUCCESS) {
                        r = ep_fail(ep, -EIO, "mapping rank %d's buffer: %s", g->rank,
                                    cumem_strerror(ep->cu, cr));
                        goto out;
                }
                ep->ctx.peers[g->rank] = (char *)(uintptr_t)ep->peer_maps[g->rank].ptr;
        }
        for (int p = 0; p < ep->ctx.ranks; p++)
                if (p != ep->ctx.rank && !((remote >> p) & 1) && !ep->ctx.peers[p]) {
                        r = ep_fail(ep, -EPROTO,
                                    "daemon returned %zu peer buffers, none of rank %d (expected %d)", n, p,
                                    expect);
                        goto out;
                }
        r = 0;
out:
        moeep_regions_free(regions, n);
        return r;
}

/* Lets kernels watch the job's abort word through a mapped host pointer.
 * Optional: without it device waits end by their timeout only. */
static void map_control_page(struct moeep_ep *ep) {
        const volatile struct moeep_control_page *page = moeep_job_control_page(ep->client);
        void *dev = NULL;

        if (!page)
                return;
        ep->control_page = (void *)page;
        if (cudaHostRegister((void *)page, MOEEP_CONTROL_PAGE_SIZE,
                             cudaHostRegisterMapped | cudaHostRegisterReadOnly) != cudaSuccess) {
                (void)cudaGetLastError();
                return;
        }
        ep->control_page_registered = true;
        if (cudaHostGetDevicePointer(&dev, (void *)page, 0) != cudaSuccess) {
                (void)cudaGetLastError();
                return;
        }
        ep->ctx.abort_word =
                (const volatile uint32_t *)((char *)dev + offsetof(struct moeep_control_page, abort));
        /* lost_ranks and stopping, one 8-byte word for the kernels. */
        _Static_assert(offsetof(struct moeep_control_page, stopping) ==
                                       offsetof(struct moeep_control_page, lost_ranks) + 4 &&
                               offsetof(struct moeep_control_page, lost_ranks) % 8 == 0,
                       "lost word layout");
        if (page->version >= 2)
                ep->ctx.lost_word =
                        (const volatile uint64_t *)((char *)dev +
                                                    offsetof(struct moeep_control_page, lost_ranks));
}

static int ep_attach(struct moeep_ep *ep, const struct moeep_ep_config *c) {
        const char *why = NULL;
        uint32_t remote = 0;
        int fd = -1, r;
        CUresult cr;

        r = cumem_api_get(&ep->cu, &why);
        if (r < 0)
                return ep_fail(ep, r, "CUDA driver unavailable: %s", why);
        CUDA_TRY(ep, cudaGetDevice(&ep->device));
        /* Low-latency calls are latency-bound with a few hundred rows in
         * flight: they spread over every SM, as DeepEP's do (2 ranks, 128
         * tokens: dispatch + combine 92 us on 24 SMs, 79 us on 132). */
        CUDA_TRY(ep, cudaDeviceGetAttribute(&ep->ctx.ll_num_sms, cudaDevAttrMultiProcessorCount, ep->device));
        if (ep->ctx.ll_num_sms > LL_MAX_BLOCKS) /* each block keeps its own sequence numbers */
                ep->ctx.ll_num_sms = LL_MAX_BLOCKS;
        CUDA_TRY(ep, cudaFree(NULL)); /* creates the primary context the driver calls use */

        moeep_buffer_layout_compute(&ep->ctx.layout, ep->ctx.ranks, c->max_tokens_per_rank, c->hidden,
                                    c->max_topk, c->recv_areas);
        moeep_ll_layout_compute(&ep->ctx.ll, ep->ctx.layout.total, ep->ctx.ranks, c->ll_max_tokens, c->hidden,
                                c->num_experts, c->max_topk);
        cr = cumem_alloc_exportable(ep->cu, ep->device, ep->ctx.ll.total, &ep->own, &fd);
        if (cr != CUDA_SUCCESS)
                return ep_fail(ep, -ENOMEM, "allocating the %zu-byte NVLink buffer on device %d: %s",
                               ep->ctx.ll.total, ep->device, cumem_strerror(ep->cu, cr));
        ep->ctx.peers[ep->ctx.rank] = (char *)(uintptr_t)ep->own.ptr;
        /* Flags must be zero before any peer can see the buffer. */
        CUDA_TRY(ep,
                 cudaMemset(ep->ctx.peers[ep->ctx.rank] + ep->ctx.layout.sync, 0, sizeof(struct moeep_sync)));
        if (c->ll_max_tokens) {
                CUDA_TRY(ep, cudaMemset(ep->ctx.peers[ep->ctx.rank] + ep->ctx.ll.sync, 0,
                                        sizeof(struct moeep_ll_sync)));
                /* Tagged with dispatch sequence numbers, which start again
                 * at 1 in every endpoint: no entry of an earlier one may
                 * look current. */
                const size_t entries = (size_t)ep->ctx.ranks * (size_t)c->ll_max_tokens * (size_t)c->max_topk;
                for (int b = 0; b < 2; b++)
                        CUDA_TRY(ep, cudaMemset(ep->ctx.peers[ep->ctx.rank] + ep->ctx.ll.pair_slot[b], 0,
                                                entries * sizeof(uint64_t)));
        }
        CUDA_TRY(ep, cudaDeviceSynchronize());

        r = moeep_region_register(ep->client, fd, MOEEP_REGION_CUMEM_FD, ep->own.size, NVL_REGION_TAG,
                                  &ep->region_id);
        close(fd);
        if (r < 0)
                return ep_fail(ep, r, "registering the NVLink buffer: %s", moeep_client_error(ep->client));
        r = moeep_job_barrier(ep->client);
        if (r < 0)
                return ep_fail(ep, r, "barrier after registering: %s", moeep_client_error(ep->client));
        /* After the barrier every rank joined: which are at other daemons. */
        r = moeep_job_ranks(ep->client, NULL, &remote);
        if (r < 0)
                return ep_fail(ep, r, "asking which ranks are remote: %s", moeep_client_error(ep->client));
        r = map_peers(ep, remote);
        if (r < 0)
                return r;
        if (remote && (r = ep_px_attach(ep, remote)) < 0)
                return r;
        ep->remote = remote;

        CUDA_TRY(ep, cudaMalloc((void **)&ep->ctx.state, sizeof(struct moeep_local_state)));
        CUDA_TRY(ep, cudaMemset(ep->ctx.state, 0, sizeof(struct moeep_local_state)));
        CUDA_TRY(ep, cudaHostAlloc((void **)&ep->host, sizeof(*ep->host), cudaHostAllocMapped));
        CUDA_TRY(ep, cudaEventCreateWithFlags(&ep->notify_done, cudaEventDisableTiming));
        CUDA_TRY(ep, (cudaError_t)moeep_kernels_init());
        /* Two handles up front, so that dispatch allocates nothing in the
         * usual dispatch/combine cycle. */
        for (int i = 0; i < 2; i++) {
                struct moeep_ep_handle *h;
                if ((r = handle_get(ep, NULL, &h)) < 0)
                        return r;
                moeep_ep_handle_free(h);
        }
        map_control_page(ep);
        CUDA_TRY(ep, cudaDeviceSynchronize());

        /* Nobody may start a collective before every rank mapped every buffer. */
        r = moeep_job_barrier(ep->client);
        if (r < 0)
                return ep_fail(ep, r, "barrier after mapping: %s", moeep_client_error(ep->client));
        return 0;
}

static void ep_free(struct moeep_ep *ep) {
        struct moeep_ep_handle *h;

        if (!ep)
                return;
        if (ep->cu)
                cudaDeviceSynchronize();
        /* Later endpoints of this job must not be handed our old buffer. */
        if (ep->region_id)
                moeep_region_release(ep->client, ep->region_id);
        for (int c = 0; c < 2; c++)
                while ((h = SLIST_FIRST(&ep->free_handles[c]))) {
                        SLIST_REMOVE_HEAD(&ep->free_handles[c], free_entry);
                        cudaFree(h->dev_mem);
                        free(h->expert_counts_host);
                        free(h);
                }
        if (ep->notify_done)
                cudaEventDestroy(ep->notify_done);
        if (ep->host)
                cudaFreeHost(ep->host);
        if (ep->ctx.state)
                cudaFree(ep->ctx.state);
        ep_px_detach(ep);
        cudaFree(ep->ctx.trace);
        if (ep->control_page_registered)
                cudaHostUnregister(ep->control_page);
        if (ep->cu) {
                for (int i = 0; i < MOEEP_KERNEL_MAX_RANKS; i++)
                        cumem_mapping_release(ep->cu, &ep->peer_maps[i]);
                cumem_mapping_release(ep->cu, &ep->own);
        }
        free(ep);
}

/* The shrink timeout: the configuration's, else $MOEEP_SHRINK_TIMEOUT_MS
 * (for programs that cannot pass it, e.g. DeepEP's tests), else the
 * default. */
static int shrink_timeout_ms(const struct moeep_ep_config *c) {
        const char *env = getenv("MOEEP_SHRINK_TIMEOUT_MS");

        if (c->shrink_timeout_ms)
                return c->shrink_timeout_ms;
        if (env && atoi(env) > 0)
                return atoi(env);
        return MOEEP_DEFAULT_SHRINK_TIMEOUT_MS;
}

int moeep_ep_create(struct moeep_client *client, const struct moeep_ep_config *config,
                    struct moeep_ep **ret_ep) {
        char why[sizeof(((struct moeep_ep *)0)->error)];
        struct moeep_ep *ep;
        uint64_t job_id;
        int rank, ranks, r;

        if (!client || !config || !ret_ep)
                return -EINVAL;
        r = moeep_job_info(client, &job_id, &rank, &ranks);
        if (r < 0)
                return r;
        ep = calloc(1, sizeof(*ep));
        if (!ep)
                return -ENOMEM;
        SLIST_INIT(&ep->free_handles[false]);
        SLIST_INIT(&ep->free_handles[true]);
        ep->client = client;
        r = config_check(ep, config, ranks);
        if (r < 0)
                goto fail;
        ep->ctx.rank = rank;
        ep->ctx.ranks = ranks;
        ep->ctx.num_experts = config->num_experts;
        ep->ctx.hidden = config->hidden;
        ep->ctx.max_tokens = config->max_tokens_per_rank;
        ep->ctx.max_topk = config->max_topk;
        ep->ctx.num_sms = config->num_sms ? config->num_sms : MOEEP_DEFAULT_NUM_SMS;
        /* Diagnostics only (docs/benchmarks.md): which part of combine runs,
         * and a fixed split of its blocks between sending and reducing. */
        if (getenv("MOEEP_KERNEL_DEBUG"))
                ep->ctx.debug = atoi(getenv("MOEEP_KERNEL_DEBUG"));
        if (getenv("MOEEP_KERNEL_TRACE") &&
            cudaMalloc((void **)&ep->ctx.trace, MOEEP_TRACE_WORDS * sizeof(uint64_t)) == cudaSuccess)
                cudaMemset(ep->ctx.trace, 0, MOEEP_TRACE_WORDS * sizeof(uint64_t));
        if (getenv("MOEEP_COMBINE_SEND_BLOCKS"))
                ep->ctx.combine_send_blocks = atoi(getenv("MOEEP_COMBINE_SEND_BLOCKS"));
        ep->ctx.timeout_ns =
                (uint64_t)(config->timeout_ms ? config->timeout_ms : MOEEP_DEFAULT_TIMEOUT_MS) * 1000000;
        ep->ctx.shrink = config->ll_shrink;
        ep->ctx.shrink_timeout_ns = (uint64_t)shrink_timeout_ms(config) * 1000000;
        r = ep_attach(ep, config);
        if (r < 0)
                goto fail;
        *ret_ep = ep;
        return 0;
fail:
        /* The endpoint and its error text go away: the reason stays on the
         * client handle (moeep_client_error()), set once ep_free's own calls
         * to the daemon (which clear the client's error) are done. */
        snprintf(why, sizeof(why), "%s", ep->error);
        ep_free(ep);
        return client_error_set(client, r, "rank %d: %s", rank, why);
}

void moeep_ep_destroy(struct moeep_ep *ep) {
        ep_free(ep);
}

int moeep_ep_set_num_sms(struct moeep_ep *ep, int num_sms) {
        if (!ep)
                return -EINVAL;
        if (num_sms < 1 || num_sms > MOEEP_KERNEL_MAX_SMS)
                return ep_fail(ep, -EINVAL, "num_sms %d is outside 1..%d", num_sms, MOEEP_KERNEL_MAX_SMS);
        ep->ctx.num_sms = num_sms;
        return 0;
}

static int ep_aborted(struct moeep_ep *ep, int peer) {
        const volatile struct moeep_control_page *page = ep->control_page;
        const int lost = page ? page->lost_rank : peer;

        if (lost < 0)
                return ep_fail(ep, -ENOTCONN, "rank %d: job aborted by moeepd (the daemon is stopping)",
                               ep->ctx.rank);
        return ep_fail(ep, -ENOTCONN, "rank %d: job aborted by moeepd (rank %d lost)", ep->ctx.rank, lost);
}

int ep_check_live(struct moeep_ep *ep, bool elastic) {
        const volatile struct moeep_control_page *page = ep->control_page;
        int r;

        /* An elastic call goes on after ranks were lost; not after the
         * daemon stopped, nor with a page that cannot say which it is. */
        if (page && page->abort && (!elastic || page->version < 2 || page->stopping))
                return ep_aborted(ep, -1);
        if ((r = client_check_alive(ep->client)) < 0)
                return ep_fail(ep, r, "rank %d: %s; the job is gone: destroy the endpoint and attach again",
                               ep->ctx.rank, moeep_client_error(ep->client));
        return 0;
}

/* The counts of a fresh dispatch as the host read them, before a caller
 * sizes tensors or indexes by them: rows from each source within one
 * call's share, summing to the rows received. */
static int check_recv_counts(struct moeep_ep *ep, const struct moeep_ep_handle *h) {
        int sum = 0;

        for (int s = 0; s < ep->ctx.ranks; s++) {
                const int n = h->recv_per_rank[s];
                if (n < 0 || n > ep->ctx.max_tokens)
                        return ep_fail(ep, -EPROTO,
                                       "rank %d: the count exchange has %d rows from rank %d (0..%d)",
                                       ep->ctx.rank, n, s, ep->ctx.max_tokens);
                sum += n;
        }
        if (sum != h->num_recv)
                return ep_fail(ep, -EPROTO,
                               "rank %d: the count exchange has %d rows from the ranks but %d in all",
                               ep->ctx.rank, sum, h->num_recv);
        return 0;
}

static int state_error(struct moeep_ep *ep, uint32_t err, int peer) {
        switch ((enum moeep_kernel_error)err) {
        case MOEEP_KERR_NONE:
                return 0;
        case MOEEP_KERR_TIMEOUT:
                return ep_fail(ep, -ETIMEDOUT, "rank %d: waited more than %llu ms for rank %d", ep->ctx.rank,
                               (unsigned long long)(ep->ctx.timeout_ns / 1000000), peer);
        case MOEEP_KERR_OVERFLOW:
                return ep_fail(ep, -EINVAL,
                               "rank %d: a low-latency expert on rank %d got more pairs than its %d slots "
                               "(a token names one expert twice?)",
                               ep->ctx.rank, peer, ep->ctx.ranks * ep->ctx.ll.max_tokens);
        case MOEEP_KERR_ABORT:
                return ep_aborted(ep, peer);
        case MOEEP_KERR_PROXY:
                return ep_px_error(ep, peer);
        case MOEEP_KERR_SHRINK_VIEW:
                return ep_fail(
                        ep, -EPROTO,
                        "rank %d: rank %d placed its low-latency pairs after counts this rank did not see "
                        "(a rank died while its counts were reaching some ranks only): the dispatch's "
                        "outputs are undefined; rebuild the job",
                        ep->ctx.rank, peer);
        }
        return ep_fail(ep, -EIO, "rank %d: device error code %u", ep->ctx.rank, err);
}

int moeep_ep_lost_ranks(const struct moeep_ep *ep, uint32_t *ret_lost) {
        const volatile struct moeep_control_page *page;

        if (!ep || !ret_lost)
                return -EINVAL;
        page = ep->control_page;
        if (!page || page->version < 2)
                return -EOPNOTSUPP;
        *ret_lost = __atomic_load_n(&page->lost_ranks, __ATOMIC_ACQUIRE);
        return 0;
}

int moeep_ep_check(struct moeep_ep *ep) {
        struct moeep_local_state s;

        if (!ep)
                return -EINVAL;
        CUDA_TRY(ep, cudaDeviceSynchronize());
        CUDA_TRY(ep, cudaMemcpy(&s, ep->ctx.state, sizeof(s), cudaMemcpyDeviceToHost));
        return state_error(ep, s.error, s.error_rank);
}

int check_index_type(struct moeep_ep *ep, enum moeep_index_type t) {
        switch (t) {
        case MOEEP_INDEX_INT64:
        case MOEEP_INDEX_INT32:
                return 0;
        }
        return ep_fail(ep, -EINVAL, "topk index type %d is neither MOEEP_INDEX_INT64 nor MOEEP_INDEX_INT32",
                       (int)t);
}

static int check_tokens(struct moeep_ep *ep, int num_tokens, int num_topk, bool need_topk) {
        if (num_tokens < 0 || num_tokens > ep->ctx.max_tokens)
                return ep_fail(ep, -EINVAL, "num_tokens %d is outside 0..%d (max_tokens_per_rank)",
                               num_tokens, ep->ctx.max_tokens);
        if (need_topk && (num_topk < 1 || num_topk > ep->ctx.max_topk))
                return ep_fail(ep, -EINVAL, "num_topk %d is outside 1..%d (max_topk)", num_topk,
                               ep->ctx.max_topk);
        return 0;
}

int moeep_get_dispatch_layout(struct moeep_ep *ep, const void *topk_idx, enum moeep_index_type idx_type,
                              int num_tokens, int num_topk, int *num_tokens_per_rank,
                              int *num_tokens_per_expert, uint8_t *is_token_in_rank, cudaStream_t stream) {
        int r;

        if (!ep)
                return -EINVAL;
        if ((r = check_index_type(ep, idx_type)) < 0 ||
            (r = check_tokens(ep, num_tokens, num_topk, true)) < 0)
                return r;
        if ((num_tokens > 0 && (!topk_idx || !is_token_in_rank)) || !num_tokens_per_rank ||
            !num_tokens_per_expert)
                return ep_fail(ep, -EINVAL, "get_dispatch_layout: a required pointer is NULL");
        return launch_result(ep, "layout",
                             moeep_launch_layout(topk_idx, idx_type == MOEEP_INDEX_INT64, num_tokens,
                                                 num_topk, ep->ctx.num_experts, ep->ctx.ranks,
                                                 num_tokens_per_rank, num_tokens_per_expert, is_token_in_rank,
                                                 stream));
}

/* A new handle sized for the endpoint. */
static int handle_new(struct moeep_ep *ep, struct moeep_ep_handle **ret) {
        int R = ep->ctx.ranks, T = ep->ctx.max_tokens, L = ep->ctx.num_experts / R;
        size_t n_send = (size_t)T * R, n_recv = (size_t)T * R;
        size_t n_chunks = ((size_t)T + MOEEP_COMBINE_CHUNK_MIN - 1) / MOEEP_COMBINE_CHUNK_MIN;
        struct moeep_ep_handle *h;
        char *p;

        h = calloc(1, sizeof(*h));
        if (!h)
                return ep_fail(ep, -ENOMEM, "out of memory for a dispatch handle");
        h->expert_counts_host = calloc((size_t)L, sizeof(int));
        if (!h->expert_counts_host ||
            cudaMalloc(&h->dev_mem, (n_send + n_recv + R + 1 + R + L + 1 + n_chunks + (size_t)R * R) *
                                            sizeof(int32_t)) != cudaSuccess) {
                (void)cudaGetLastError();
                free(h->expert_counts_host);
                free(h);
                return ep_fail(ep, -ENOMEM, "out of device memory for a dispatch handle");
        }
        h->ep = ep;
        p = h->dev_mem;
        h->route.send_pos = (int32_t *)p;
        p += n_send * sizeof(int32_t);
        h->route.recv_src = (int32_t *)p;
        p += n_recv * sizeof(int32_t);
        h->route.rank_prefix = (int32_t *)p;
        p += (size_t)(R + 1) * sizeof(int32_t);
        h->route.dst_base = (int32_t *)p;
        p += (size_t)R * sizeof(int32_t);
        h->route.expert_counts = (int32_t *)p;
        p += (size_t)L * sizeof(int32_t);
        h->route.num_recv = (int32_t *)p;
        p += sizeof(int32_t);
        h->route.chunk_expect = (int32_t *)p;
        p += n_chunks * sizeof(int32_t);
        h->route.rank_prefix_matrix = (int32_t *)p;
        *ret = h;
        return 0;
}

/* Whether `stream` is capturing a CUDA graph. */
static bool capturing(cudaStream_t stream) {
        enum cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;

        return cudaStreamIsCapturing(stream, &cs) == cudaSuccess && cs != cudaStreamCaptureStatusNone;
}

/* A handle for a fresh dispatch on `stream`. Handles a graph captured are
 * the graph's (its replays rewrite and read their routing), so they serve
 * only later captures, whose replays run in order with it on the stream;
 * other dispatches take the free list. A new one is allocated where none
 * is free, during a capture too (the allocation is no stream work, so the
 * thread's capture mode is relaxed for it). */
static int handle_get(struct moeep_ep *ep, cudaStream_t stream, struct moeep_ep_handle **ret) {
        const bool graph = capturing(stream);
        const bool pool = graph && !SLIST_EMPTY(&ep->free_handles[true]);
        struct moeep_ep_handle *h;
        int r;

        if ((h = SLIST_FIRST(&ep->free_handles[pool]))) {
                SLIST_REMOVE_HEAD(&ep->free_handles[pool], free_entry);
        } else {
                enum cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
                if (graph)
                        cudaThreadExchangeStreamCaptureMode(&mode);
                r = handle_new(ep, &h);
                if (graph)
                        cudaThreadExchangeStreamCaptureMode(&mode);
                if (r < 0)
                        return r;
        }
        h->captured = graph;
        *ret = h;
        return 0;
}

void moeep_ep_handle_free(struct moeep_ep_handle *h) {
        if (!h)
                return;
        SLIST_INSERT_HEAD(&h->ep->free_handles[h->captured], h, free_entry);
}

int moeep_ep_handle_num_tokens(const struct moeep_ep_handle *h) {
        return h ? h->route.num_tokens : -EINVAL;
}

static int check_dtype(struct moeep_ep *ep, enum moeep_dtype t) {
        switch (t) {
        case MOEEP_DTYPE_BF16:
        case MOEEP_DTYPE_FP8_E4M3:
                return 0;
        }
        return ep_fail(ep, -EINVAL, "x_type %d is neither MOEEP_DTYPE_BF16 nor MOEEP_DTYPE_FP8_E4M3", (int)t);
}

int moeep_ep_max_recv_tokens(const struct moeep_ep *ep) {
        return ep ? ep->ctx.ranks * ep->ctx.max_tokens : -EINVAL;
}

int moeep_ep_recv_buffers(const struct moeep_ep *ep, struct moeep_dispatch_result *ret) {
        size_t bytes;

        return moeep_ep_recv_area(ep, 0, ret, &bytes);
}

/* Receive area `area` of our own buffer (its offsets: ctx.layout). */
static char *area_base(const struct moeep_ep *ep, int area) {
        return ep->ctx.peers[ep->ctx.rank] + (size_t)area * ep->ctx.layout.area_bytes;
}

/* 0, or -EINVAL naming a receive area outside the endpoint's. */
static int check_area(struct moeep_ep *ep, int area) {
        if (area < 0 || area >= ep->ctx.layout.areas)
                return ep_fail(ep, -EINVAL, "recv_area %d is outside 0..%d", area, ep->ctx.layout.areas - 1);
        return 0;
}

int moeep_ep_recv_area(const struct moeep_ep *ep, int area, struct moeep_dispatch_result *ret,
                       size_t *ret_bytes) {
        char *own;

        if (!ep || !ret || !ret_bytes || area < 0 || area >= ep->ctx.layout.areas)
                return -EINVAL;
        own = area_base(ep, area);
        *ret_bytes = ep->ctx.layout.recv_src + (size_t)ep->ctx.ranks * ep->ctx.max_tokens * sizeof(int32_t) -
                     ep->ctx.layout.recv_x;
        *ret = (struct moeep_dispatch_result){
                .recv_x = own + ep->ctx.layout.recv_x,
                .recv_x_scales = (float *)(own + ep->ctx.layout.recv_scales),
                .recv_topk_idx = own + ep->ctx.layout.recv_topk_idx,
                .recv_topk_weights = (float *)(own + ep->ctx.layout.recv_topk_weights),
                .num_local_experts = ep->ctx.num_experts / ep->ctx.ranks,
        };
        return 0;
}

/* The top-k width that travels with the dispatch, 0 for none. A rank with
 * no tokens may have no topk_idx array (an empty tensor's data pointer is
 * NULL) while its peers send theirs: its num_topk says top-k travels. */
static int dispatch_topk(const struct moeep_dispatch_args *a) {
        return a->topk_idx || (a->num_tokens == 0 && a->num_topk > 0) ? a->num_topk : 0;
}

static int dispatch_check(struct moeep_ep *ep, const struct moeep_dispatch_args *a) {
        int r;

        if ((r = ep_check_live(ep, false)) < 0 || (r = check_dtype(ep, a->x_type)) < 0)
                return r;
        if (a->handle && a->handle->ep != ep)
                return ep_fail(ep, -EINVAL, "the handle belongs to another endpoint");
        if (a->handle && a->num_tokens != a->handle->route.num_tokens)
                return ep_fail(ep, -EINVAL, "num_tokens %d differs from the handle's %d", a->num_tokens,
                               a->handle->route.num_tokens);
        if ((r = check_tokens(ep, a->num_tokens, a->num_topk, dispatch_topk(a) > 0)) < 0)
                return r;
        if (a->topk_idx && (r = check_index_type(ep, a->topk_idx_type)) < 0)
                return r;
        if (a->num_tokens > 0 && !a->x)
                return ep_fail(ep, -EINVAL, "x is NULL with %d tokens", a->num_tokens);
        if (a->x_type == MOEEP_DTYPE_FP8_E4M3 && a->num_tokens > 0 && !a->x_scales)
                return ep_fail(ep, -EINVAL, "FP8 dispatch needs x_scales");
        if (a->x_type == MOEEP_DTYPE_BF16 && a->x_scales)
                return ep_fail(ep, -EINVAL, "x_scales given for BF16 x");
        if (a->topk_weights && !a->topk_idx)
                return ep_fail(ep, -EINVAL, "topk_weights given without topk_idx");
        if (!a->handle && !a->is_token_in_rank && !a->topk_idx && a->num_tokens > 0)
                return ep_fail(ep, -EINVAL, "no routing: give is_token_in_rank, topk_idx or a handle");
        if (a->expert_alignment < 0 || a->expert_alignment > MOEEP_MAX_EXPERT_ALIGNMENT)
                return ep_fail(ep, -EINVAL, "expert_alignment %d is outside 0..%d", a->expert_alignment,
                               MOEEP_MAX_EXPERT_ALIGNMENT);
        if (a->num_worst_tokens < 0 || a->num_worst_tokens > ep->ctx.ranks * ep->ctx.max_tokens)
                return ep_fail(ep, -EINVAL, "num_worst_tokens %d is outside 0..%d", a->num_worst_tokens,
                               ep->ctx.ranks * ep->ctx.max_tokens);
        if (a->handle && a->handle->num_topk != dispatch_topk(a))
                return ep_fail(ep, -EINVAL, "num_topk %d differs from the handle's %d", dispatch_topk(a),
                               a->handle->num_topk);
        if (a->x_scales && a->num_tokens > 0 &&
            (a->x_scales_token_stride < 0 || a->x_scales_block_stride < 0 ||
             (a->x_scales_token_stride == 0) != (a->x_scales_block_stride == 0)))
                return ep_fail(ep, -EINVAL,
                               "x_scales strides %lld, %lld: both 0 (row-major) or both positive",
                               (long long)a->x_scales_token_stride, (long long)a->x_scales_block_stride);
        return check_area(ep, a->recv_area);
}

int moeep_dispatch(struct moeep_ep *ep, const struct moeep_dispatch_args *a,
                   struct moeep_dispatch_result *ret, cudaStream_t stream) {
        struct moeep_ep_handle *h = NULL;
        bool fresh = false;
        char *own;
        int r;

        if (!ep)
                return -EINVAL;
        if (!a || !ret)
                return ep_fail(ep, -EINVAL, "dispatch: args or result is NULL");
        if ((r = dispatch_check(ep, a)) < 0)
                return r;
        int idx64 = a->topk_idx && a->topk_idx_type == MOEEP_INDEX_INT64;

        /* Told to our sources by the barrier of notify, used by the relay
         * and the dispatch kernel's receive side. */
        ep->ctx.recv_area = a->recv_area;
        if (a->handle) {
                h = a->handle;
                h->captured |= capturing(stream); /* a graph's routing from now on */
                r = launch_result(ep, "barrier", moeep_launch_barrier(&ep->ctx, stream));
                if (r < 0)
                        return r;
        } else {
                if ((r = handle_get(ep, stream, &h)) < 0)
                        return r;
                fresh = true;
                h->route.num_tokens = a->num_tokens;
                h->num_topk = dispatch_topk(a);
                const struct moeep_notify_launch nl = {
                        .is_token_in_rank = a->is_token_in_rank,
                        .topk_idx = a->topk_idx,
                        .idx_is_int64 = idx64,
                        .num_tokens = a->num_tokens,
                        .num_topk = a->num_topk,
                        .tokens_per_expert = a->num_tokens_per_expert,
                        .total_tokens = a->total_tokens > 0 ? a->total_tokens : a->num_tokens,
                        .alignment = a->expert_alignment,
                };
                r = launch_result(ep, "notify",
                                  moeep_launch_notify(&ep->ctx, &nl, &h->route,
                                                      a->num_worst_tokens ? NULL : ep->host, stream));
                if (r < 0)
                        goto fail;
                h->num_recv = -1;
                if (!a->num_worst_tokens && cudaEventRecord(ep->notify_done, stream) != cudaSuccess) {
                        r = ep_fail(ep, -EIO, "recording the count exchange: %s",
                                    cudaGetErrorString(cudaGetLastError()));
                        goto fail;
                }
        }

        struct moeep_dispatch_launch l = {
                .x = a->x,
                .elem_size = a->x_type == MOEEP_DTYPE_BF16 ? 2 : 1,
                .x_scales = a->x_scales,
                .scale_stride_t = a->x_scales_token_stride ? a->x_scales_token_stride
                                                           : ep->ctx.hidden / MOEEP_SCALE_BLOCK,
                .scale_stride_j = a->x_scales_token_stride ? a->x_scales_block_stride : 1,
                .topk_idx = a->topk_idx,
                .idx_is_int64 = idx64,
                .topk_weights = a->topk_weights,
                .num_topk = dispatch_topk(a),
        };
        if (ep->remote) { /* rows for ranks at other daemons: staged, shipped, placed (kernels/normal/proxy.cu) */
                r = launch_result(ep, "dispatch staging",
                                  moeep_launch_px_dispatch_stage(&ep->ctx, &l, &h->route, stream));
                if (r == 0)
                        r = launch_result(ep, "dispatch relay",
                                          moeep_launch_px_dispatch_relay(&ep->ctx, &h->route, stream));
                if (r < 0)
                        goto fail;
        }
        /* The data kernel is queued before the host waits for the counts, so
         * the GPU goes straight from the count exchange to the payload. */
        r = launch_result(ep, "dispatch", moeep_launch_dispatch(&ep->ctx, &l, &h->route, stream));
        if (r < 0)
                goto fail;
        if (fresh && !a->num_worst_tokens) {
                if (cudaEventSynchronize(ep->notify_done) != cudaSuccess) {
                        r = ep_fail(ep, -EIO, "waiting for the count exchange: %s",
                                    cudaGetErrorString(cudaGetLastError()));
                        goto fail;
                }
                if ((r = state_error(ep, ep->host->error, ep->host->error_rank)) < 0)
                        goto fail;
                h->num_recv = ep->host->num_recv;
                h->max_total_tokens = ep->host->max_total_tokens;
                memcpy(h->recv_per_rank, ep->host->recv_per_rank, sizeof(int) * (size_t)ep->ctx.ranks);
                if ((r = check_recv_counts(ep, h)) < 0)
                        goto fail;
                memcpy(h->expert_counts_host, ep->host->expert_counts,
                       sizeof(int) * (size_t)(ep->ctx.num_experts / ep->ctx.ranks));
        }

        own = area_base(ep, a->recv_area);
        *ret = (struct moeep_dispatch_result){
                .recv_x = own + ep->ctx.layout.recv_x,
                .recv_x_scales = a->x_type == MOEEP_DTYPE_FP8_E4M3
                                         ? (float *)(own + ep->ctx.layout.recv_scales)
                                         : NULL,
                .recv_topk_idx = dispatch_topk(a) ? own + ep->ctx.layout.recv_topk_idx : NULL,
                .recv_topk_weights =
                        dispatch_topk(a) ? (float *)(own + ep->ctx.layout.recv_topk_weights) : NULL,
                .recv_src_info = h->route.recv_src,
                .num_recv_tokens = h->num_recv,
                .num_recv_tokens_dev = h->route.num_recv,
                .num_recv_tokens_per_expert = h->num_recv >= 0 ? h->expert_counts_host : NULL,
                .num_recv_tokens_per_expert_dev = h->route.expert_counts,
                .num_local_experts = ep->ctx.num_experts / ep->ctx.ranks,
                .handle = h,
                .rank_prefix_matrix = h->route.rank_prefix_matrix,
                .max_total_tokens = fresh && !a->num_worst_tokens ? h->max_total_tokens : -1,
                .num_recv_tokens_per_rank = h->num_recv >= 0 ? h->recv_per_rank : NULL,
                .send_pos = h->route.send_pos,
        };
        return 0;
fail:
        if (fresh)
                moeep_ep_handle_free(h);
        return r;
}

int moeep_dispatch_copy_topk(struct moeep_ep *ep, const struct moeep_ep_handle *handle, int recv_area,
                             enum moeep_index_type idx_type, int rows, void *topk_idx_out,
                             float *topk_weights_out, cudaStream_t stream) {
        const int most = ep ? ep->ctx.ranks * ep->ctx.max_tokens : 0;
        const char *area;
        int r;

        if (!ep)
                return -EINVAL;
        if (!handle || handle->ep != ep)
                return ep_fail(ep, -EINVAL, "copy_topk: %s",
                               handle ? "the handle belongs to another endpoint"
                                      : "needs the dispatch's handle");
        if ((r = check_index_type(ep, idx_type)) < 0)
                return r;
        if (handle->num_topk < 1)
                return ep_fail(ep, -EINVAL, "copy_topk: the handle's dispatch sent no top-k");
        if ((r = check_area(ep, recv_area)) < 0)
                return r;
        if (rows < 0 || rows > most || (handle->num_recv >= 0 && rows != handle->num_recv))
                return ep_fail(ep, -EINVAL, "copy_topk: %d rows, the dispatch received %d (at most %d)", rows,
                               handle->num_recv, most);
        if (rows > 0 && (!topk_idx_out || !topk_weights_out))
                return ep_fail(ep, -EINVAL, "copy_topk: an output is NULL");
        area = area_base(ep, recv_area);
        return launch_result(ep, "copy_topk",
                             moeep_launch_copy_topk(&ep->ctx, area + ep->ctx.layout.recv_topk_idx,
                                                    idx_type == MOEEP_INDEX_INT64,
                                                    (const float *)(area + ep->ctx.layout.recv_topk_weights),
                                                    handle->route.num_recv, rows, handle->num_topk,
                                                    topk_idx_out, topk_weights_out, stream));
}

int moeep_combine(struct moeep_ep *ep, const struct moeep_combine_args *a, cudaStream_t stream) {
        int r;

        if (!ep)
                return -EINVAL;
        if (!a || !a->handle)
                return ep_fail(ep, -EINVAL, "combine needs a dispatch handle");
        if ((r = ep_check_live(ep, false)) < 0)
                return r;
        if (a->handle->ep != ep)
                return ep_fail(ep, -EINVAL, "the handle belongs to another endpoint");
        if (a->handle->num_recv != 0 && !a->x)
                return ep_fail(ep, -EINVAL, "combine: x is NULL");
        if (a->handle->route.num_tokens > 0 && !a->out)
                return ep_fail(ep, -EINVAL, "combine: out is NULL");
        if ((a->topk_weights || a->out_topk_weights) && (a->num_topk < 1 || a->num_topk > ep->ctx.max_topk))
                return ep_fail(ep, -EINVAL, "combine: num_topk %d is outside 1..%d", a->num_topk,
                               ep->ctx.max_topk);
        if (a->out_topk_weights && !a->topk_weights)
                return ep_fail(ep, -EINVAL, "combine: out_topk_weights needs topk_weights");
        a->handle->captured |= capturing(stream); /* a graph's routing from now on */
        r = launch_result(ep, "barrier", moeep_launch_barrier(&ep->ctx, stream));
        if (r < 0)
                return r;
        if (ep->remote) { /* rows of ranks at other daemons: staged, shipped, placed (kernels/normal/proxy.cu) */
                const int k = a->topk_weights ? a->num_topk : 0;
                r = launch_result(ep, "combine staging",
                                  moeep_launch_px_combine_stage(&ep->ctx, a->x, a->topk_weights, k,
                                                                &a->handle->route, stream));
                if (r == 0)
                        r = launch_result(ep, "combine relay",
                                          moeep_launch_px_combine_relay(&ep->ctx, stream));
                if (r < 0)
                        return r;
        }
        return launch_result(ep, "combine",
                             moeep_launch_combine(&ep->ctx, a->x, a->topk_weights,
                                                  a->topk_weights ? a->num_topk : 0, &a->handle->route,
                                                  a->out, a->out_topk_weights, stream));
}

int ep_internal_ctx(const struct moeep_ep *ep, struct moeep_ctx *ret) {
        if (!ep || !ret)
                return -EINVAL;
        *ret = ep->ctx;
        return 0;
}
