/* The internode proxy path of an endpoint (kernels.h, "The internode proxy
 * path"): when some ranks of the job are at another daemon, this rank
 * registers three regions with its daemon (send, receive, counters), opens
 * a channel and maps its descriptor ring (a memfd, cudaHostRegister). The
 * kernels stage what goes to remote ranks in the send region and write the
 * ring; the daemons' proxies carry it into the receiver's receive region
 * and counters.
 *
 * Where the regions live: in GPU memory when the daemon's transport writes
 * GPU memory (the GPUDirect path: no payload byte in host memory, and the
 * kernels poll their counters in their own memory), registered as its cuMem
 * POSIX fd (the cuda transport imports it) or else as a dma-buf (a NIC's
 * transport registers it: verbs, libfabric with FI_MR_DMABUF); else in host memory (sealed memfds mapped for the GPU
 * with cudaHostRegister; the host-staged path of libfabric tcp), chosen
 * per transport: by default (MOEEP_PX_MEMORY unset or =auto) GPU memory is
 * tried first and the daemon's refusal falls back to host memory; =gpu
 * fails instead of falling back, =host never tries GPU memory. The kernels
 * are the same for both.
 *
 * The daemon keeps a rank's proxy regions and rings until the rank leaves
 * the job, so they are the job's, not the endpoint's: the first endpoint
 * creates them (sized for itself) and hangs them on the client handle, later
 * endpoints of the job reuse them. Signal values carry an epoch that grows
 * with every endpoint, so a counter never looks reached by an earlier one's
 * signal. */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "client-internal.h"
#include "ep-internal.h"
#include "proto/ring.h"

enum {
        PX_SEND,
        PX_RECV,
        PX_COUNTERS,
        PX_RING,
        PX_MAPS
};

/* One region: a mapped memfd registered for the device, or GPU memory. */
struct px_map {
        int fd;
        void *host; /* NULL for GPU memory */
        size_t size;
        bool registered;          /* cudaHostRegister */
        struct cumem_mapping gpu; /* GPU memory (gpu.ptr != 0): cuMem, exported as `fd` */
        void *dev;
};

/* The job's proxy state on the client handle. */
struct px_job {
        const struct cumem_api *cu; /* for releasing GPU regions */
        bool gpu;                   /* the regions are GPU memory */
        struct px_map map[PX_MAPS];
        uint32_t ring_cap;
        uint64_t endpoints; /* endpoints that used it: the signal epoch */
};

/* Tag of the proxy regions among a rank's regions (the NVLink buffer's is 0). */
#define PX_REGION_TAG 0x7078u
/* The ring's capacity: a few descriptors per call (one per remote rank). */
#define PX_RING_CAPACITY 256
/* The epoch's place in a signal value: 2^40 calls per endpoint. */
#define PX_EPOCH_SHIFT 40

static void px_map_release(const struct cumem_api *cu, struct px_map *m) {
        if (m->gpu.ptr)
                cumem_mapping_release(cu, &m->gpu);
        if (m->registered)
                cudaHostUnregister(m->host);
        if (m->host)
                munmap(m->host, m->size);
        if (m->fd >= 0)
                close(m->fd);
        *m = (struct px_map){ .fd = -1 };
}

static void px_job_free(void *data) {
        struct px_job *j = data;

        for (int i = 0; i < PX_MAPS; i++)
                px_map_release(j->cu, &j->map[i]);
        free(j);
}

/* Maps fd (size bytes) shared and registers it for the device. */
static int px_map_device(struct moeep_ep *ep, struct px_map *m, const char *what) {
        cudaError_t e;

        m->host = mmap(NULL, m->size, PROT_READ | PROT_WRITE, MAP_SHARED, m->fd, 0);
        if (m->host == MAP_FAILED) {
                m->host = NULL;
                return ep_fail(ep, -errno, "mapping the proxy %s region (%zu bytes): %s", what, m->size,
                               strerror(errno));
        }
        e = cudaHostRegister(m->host, m->size, cudaHostRegisterMapped);
        if (e != cudaSuccess)
                return ep_fail(ep, -EIO, "registering the proxy %s region (%zu bytes) with CUDA: %s", what,
                               m->size, cudaGetErrorString(e));
        m->registered = true;
        e = cudaHostGetDevicePointer(&m->dev, m->host, 0);
        if (e != cudaSuccess)
                return ep_fail(ep, -EIO, "device pointer of the proxy %s region: %s", what,
                               cudaGetErrorString(e));
        return 0;
}

/* A sealed memfd of `size` bytes, mapped, registered with the daemon as `role`. */
static int px_region(struct moeep_ep *ep, struct px_map *m, size_t size, enum moeep_proxy_role role,
                     const char *what) {
        uint64_t id;
        int r;

        m->size = size;
        m->fd = memfd_create(what, MFD_CLOEXEC | MFD_ALLOW_SEALING);
        if (m->fd < 0 || ftruncate(m->fd, (off_t)size) < 0 ||
            fcntl(m->fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) < 0)
                return ep_fail(ep, -errno, "proxy %s region (%zu bytes): %s", what, size, strerror(errno));
        if ((r = px_map_device(ep, m, what)) < 0)
                return r;
        r = client_proxy_region_register(ep->client, m->fd, size, role, PX_REGION_TAG, &id);
        if (r < 0)
                return ep_fail(ep, r, "registering the proxy %s region: %s", what,
                               moeep_client_error(ep->client));
        return 0;
}

/* A GPU region of at least `size` bytes (cuMem, rounded up to the
 * allocation granularity), zeroed, registered with the daemon as `role`. */
static int px_region_gpu(struct moeep_ep *ep, struct px_map *m, size_t size, enum moeep_proxy_role role,
                         const char *what) {
        char why[256];
        uint64_t id;
        CUresult cr;
        int r, dmabuf = -1;

        cr = cumem_alloc_exportable(ep->cu, ep->device, size, &m->gpu, &m->fd);
        if (cr != CUDA_SUCCESS)
                return ep_fail(ep, -ENOMEM, "allocating the %zu-byte proxy %s region on device %d: %s", size,
                               what, ep->device, cumem_strerror(ep->cu, cr));
        m->size = m->gpu.size;
        m->dev = (void *)(uintptr_t)m->gpu.ptr;
        /* A counter must start below every signal value, and cuMemCreate
         * does not clear what it hands out. */
        CUDA_TRY(ep, cudaMemset(m->dev, 0, m->size));
        CUDA_TRY(ep, cudaDeviceSynchronize());
        r = client_proxy_region_register_gpu(ep->client, m->fd, m->size, role, PX_REGION_TAG, &id);
        if (r == 0)
                return 0;
        /* A NIC's transport (verbs, libfabric) takes GPU memory as a
         * dma-buf, not as a cuMem fd, which needs a CUDA context to import.
         * The daemon keeps its own reference to the dma-buf. */
        snprintf(why, sizeof(why), "%s", moeep_client_error(ep->client));
        cr = cumem_export_dmabuf(ep->cu, &m->gpu, &dmabuf);
        if (cr != CUDA_SUCCESS)
                return ep_fail(ep, r,
                               "registering the proxy %s region (GPU memory): as a cuMem fd: %s; as a "
                               "dma-buf: cannot export one: %s",
                               what, why, cumem_strerror(ep->cu, cr));
        r = client_proxy_region_register_dmabuf(ep->client, dmabuf, m->size, role, PX_REGION_TAG, &id);
        close(dmabuf);
        if (r < 0)
                return ep_fail(
                        ep, r,
                        "registering the proxy %s region (GPU memory): as a cuMem fd: %s; as a dma-buf: %s",
                        what, why, moeep_client_error(ep->client));
        return 0;
}

/* The three regions, in GPU memory where the daemon takes it (see the top
 * of this file). */
static int px_regions(struct moeep_ep *ep, struct px_job *j, size_t bytes) {
        const char *mode = getenv("MOEEP_PX_MEMORY");
        const size_t counters = MOEEP_PX_COUNTERS * sizeof(uint64_t);
        int r;

        if (mode && mode[0] && strcmp(mode, "gpu") != 0 && strcmp(mode, "host") != 0 &&
            strcmp(mode, "auto") != 0)
                return ep_fail(ep, -EINVAL, "MOEEP_PX_MEMORY='%s': need gpu, host or auto", mode);
        if (!mode || strcmp(mode, "host") != 0) { /* gpu, auto or unset (auto) */
                r = px_region_gpu(ep, &j->map[PX_SEND], bytes, MOEEP_PROXY_SEND, "send");
                if (r == 0) {
                        j->gpu = true;
                        if ((r = px_region_gpu(ep, &j->map[PX_RECV], bytes, MOEEP_PROXY_RECV, "receive")) <
                                    0 ||
                            (r = px_region_gpu(ep, &j->map[PX_COUNTERS], counters, MOEEP_PROXY_COUNTERS,
                                               "counters")) < 0)
                                return r;
                        return 0;
                }
                if (mode && strcmp(mode, "gpu") == 0)
                        return r;
                /* The daemon's transport reads host memory only (or this
                 * GPU cannot export cuMem fds): the host-staged path. */
                px_map_release(j->cu, &j->map[PX_SEND]);
        }
        if ((r = px_region(ep, &j->map[PX_SEND], bytes, MOEEP_PROXY_SEND, "send")) < 0 ||
            (r = px_region(ep, &j->map[PX_RECV], bytes, MOEEP_PROXY_RECV, "receive")) < 0 ||
            (r = px_region(ep, &j->map[PX_COUNTERS], counters, MOEEP_PROXY_COUNTERS, "counters")) < 0)
                return r;
        return 0;
}

/* Opens the channel; a rank at the other daemon may not have been seen
 * there yet (ERROR_NOT_READY): retried for a few seconds. */
static int px_channel(struct moeep_ep *ep, struct px_job *j) {
        struct px_map *m = &j->map[PX_RING];
        uint64_t ring_id;
        int r;

        for (int i = 0;; i++) {
                r = client_proxy_channel_open(ep->client, PX_RING_CAPACITY, &m->fd, &ring_id, &j->ring_cap);
                if (r != -EAGAIN || i == 500)
                        break;
                nanosleep(&(struct timespec){ .tv_nsec = 10 * 1000 * 1000 }, NULL);
        }
        if (r < 0)
                return ep_fail(ep, r, "opening the proxy channel: %s", moeep_client_error(ep->client));
        m->size = PROXY_RING_BYTES(j->ring_cap);
        return px_map_device(ep, m, "ring");
}

static int px_job_create(struct moeep_ep *ep, size_t bytes, struct px_job **ret) {
        struct px_job *j = calloc(1, sizeof(*j));
        int r;

        if (!j)
                return ep_fail(ep, -ENOMEM, "out of memory for the proxy path");
        j->cu = ep->cu;
        for (int i = 0; i < PX_MAPS; i++)
                j->map[i].fd = -1;
        if ((r = px_regions(ep, j, bytes)) < 0)
                goto fail;
        /* Every rank's regions must have reached every daemon before a channel opens. */
        r = moeep_job_barrier(ep->client);
        if (r < 0) {
                r = ep_fail(ep, r, "barrier after the proxy regions: %s", moeep_client_error(ep->client));
                goto fail;
        }
        if ((r = px_channel(ep, j)) < 0)
                goto fail;
        *ret = j;
        return 0;
fail:
        px_job_free(j);
        return r;
}

int ep_px_attach(struct moeep_ep *ep, uint32_t remote) {
        struct moeep_px *px = &ep->ctx.px;
        struct px_job *j = client_job_data(ep->client);
        const struct proxy_ring_hdr *hdr;
        struct moeep_px_state st = { 0 };
        int r;

        moeep_px_layout_compute(px, ep->ctx.ranks, ep->ctx.max_tokens, ep->ctx.num_experts, &ep->ctx.ll,
                                ep->ctx.hidden, ep->ctx.max_topk);
        if (!j) {
                if ((r = px_job_create(ep, px->bytes, &j)) < 0)
                        return r;
                client_job_data_set(ep->client, j, px_job_free);
        } else if (j->map[PX_SEND].size < px->bytes) {
                return ep_fail(
                        ep, -EINVAL,
                        "this endpoint needs %zu bytes of proxy staging, the job's first endpoint registered "
                        "%zu (create the largest endpoint of a job first)",
                        px->bytes, j->map[PX_SEND].size);
        }
        px->remote = remote;
        px->send = j->map[PX_SEND].dev;
        px->recv = j->map[PX_RECV].dev;
        px->counters = j->map[PX_COUNTERS].dev;
        px->epoch = ++j->endpoints << PX_EPOCH_SHIFT;

        /* The producer goes on where the previous endpoint's kernels left the ring. */
        hdr = j->map[PX_RING].host;
        st.ring_hdr = j->map[PX_RING].dev;
        st.ring_cap = j->ring_cap;
        st.ring_tail = __atomic_load_n(&hdr->tail, __ATOMIC_ACQUIRE);
        st.ring_head = __atomic_load_n(&hdr->head, __ATOMIC_ACQUIRE);
        CUDA_TRY(ep, cudaMalloc((void **)&px->state, sizeof(st)));
        CUDA_TRY(ep, cudaMemcpy(px->state, &st, sizeof(st), cudaMemcpyHostToDevice));
        return 0;
}

void ep_px_detach(struct moeep_ep *ep) {
        cudaFree(ep->ctx.px.state);
        ep->ctx.px.state = NULL;
}

int ep_px_error(struct moeep_ep *ep, int peer) {
        const struct px_job *j = client_job_data(ep->client);
        const struct proxy_ring_hdr *hdr = j ? j->map[PX_RING].host : NULL;
        int32_t e = hdr ? __atomic_load_n(&hdr->error, __ATOMIC_ACQUIRE) : 0;

        if (e)
                return ep_fail(ep, -ECONNABORTED, "rank %d: the proxy path to rank %d failed: %s",
                               ep->ctx.rank, peer, strerror(-e));
        return ep_fail(ep, -ETIMEDOUT,
                       "rank %d: the proxy ring stayed full for more than %llu ms (sending to rank %d)",
                       ep->ctx.rank, (unsigned long long)(ep->ctx.timeout_ns / 1000000), peer);
}
