/* tp-cuda: a transport that behaves like a GPU-capable NIC between daemons
 * of one host (transport.h), so that the GPUDirect path (kernels' send and
 * receive regions in GPU memory, nothing staged in host memory) runs end to
 * end where no RDMA NIC is: two daemons on one host stand for two nodes.
 *
 * - libcuda.so.1 is loaded with dlopen when this backend opens, never
 *   before: moeepd has no link-time CUDA dependency, and a host without the
 *   driver gets "transport cuda: cannot load libcuda.so.1: ...".
 * - mr_new imports a rank's cuMem POSIX fd (TP_MEM_CUMEM, the fd ranks
 *   register) into the daemon's context on its device (the primary context
 *   of `transport_device`, default 0), or registers host memory (a memfd,
 *   or the proxy's own signal staging) with cuMemHostRegister.
 * - A peer daemon's regions are reached through its fds: peer_new's blob
 *   names our abstract Unix socket and a fresh token; the peer connects,
 *   presents the token (one connection per token) and fetches the fd of a
 *   key the first time it writes there (tp-cuda-peer.c).
 * - write is a copy on one daemon stream (cuMemcpyDtoDAsync between device
 *   regions) followed by an event; a stream runs its copies in order, so
 *   the proxy's signal write, posted after the data, lands after it: the
 *   ordering an RC QP gives. poll returns completions as their events pass,
 *   in posting order.
 * - A region deregistered at the peer is revoked here (its import dropped
 *   once the stream is idle); a later write into its key fails with
 *   -EACCES, as a NIC reports a remote access error. */
#include <dlfcn.h>
#include <errno.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <unistd.h>
#include <fcntl.h>

#include "tp-cuda-internal.h"

int tpc_cuda_errmsg(const struct tp *tp, char *errmsg, int r, tpc_result cr, const char *fmt, ...) {
        const char *s = NULL;
        char what[ERRMSG_MAX];
        va_list ap;

        va_start(ap, fmt);
        vsnprintf(what, sizeof(what), fmt, ap);
        va_end(ap);
        if (tp->api.get_error_string(cr, &s) != TPC_SUCCESS || !s)
                s = "unknown CUDA driver error";
        return errmsg_set(errmsg, r, "%s: %s: %s (CUDA error %d)", tp->who, what, s, cr);
}

static int cuda_api_load(struct tp *tp, char *errmsg) {
        static const char *const names[] = { TPC_API_SYMBOLS };
        void **slot = (void **)&tp->api;

        _Static_assert(sizeof(struct tpc_api) == sizeof(names) / sizeof(names[0]) * sizeof(void *),
                       "one symbol name per entry point");
        tp->lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
        if (!tp->lib)
                return errmsg_set(errmsg, -ENODEV, "transport cuda: cannot load libcuda.so.1: %s", dlerror());
        for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
                slot[i] = dlsym(tp->lib, names[i]);
                if (!slot[i])
                        return errmsg_set(errmsg, -ENODEV,
                                          "transport cuda: libcuda.so.1 lacks %s (the driver is older than "
                                          "CUDA 11.3)",
                                          names[i]);
        }
        return 0;
}

/* "" or NULL: 0; else a decimal ordinal. */
static int ordinal_parse(const char *s, int *ret) {
        long v;
        char *end;

        if (!s || !s[0]) {
                *ret = 0;
                return 0;
        }
        if (s[0] < '0' || s[0] > '9')
                return -EINVAL;
        errno = 0;
        v = strtol(s, &end, 10);
        if (errno || *end || v > 1024)
                return -EINVAL;
        *ret = (int)v;
        return 0;
}

int tpc_open(const struct tp_config *cfg, const struct tpc_api *api, struct tp **ret, char *errmsg) {
        struct tp *tp = calloc(1, sizeof(*tp));
        int count = 0, r;
        tpc_result cr;

        if (!tp)
                return errmsg_set(errmsg, -ENOMEM, "transport cuda: out of memory");
        tp->listen_fd = tp->stop_fd = tp->epoll_fd = -1;
        pthread_mutex_init(&tp->lock, NULL);
        TAILQ_INIT(&tp->mrs);
        if (ordinal_parse(cfg->device, &tp->ordinal) < 0) {
                r = errmsg_set(
                        errmsg, -EINVAL,
                        "transport cuda: transport_device '%s': need a CUDA device ordinal (0, 1, ...)",
                        cfg->device);
                goto fail;
        }
        snprintf(tp->who, sizeof(tp->who), "transport cuda device %d", tp->ordinal);
        if (api)
                tp->api = *api;
        else if ((r = cuda_api_load(tp, errmsg)) < 0)
                goto fail;
        cr = tp->api.init(0);
        if (cr != TPC_SUCCESS) {
                r = tpc_cuda_errmsg(tp, errmsg, -ENODEV, cr, "cuInit (no usable CUDA device or driver)");
                goto fail;
        }
        cr = tp->api.device_get_count(&count);
        if (cr != TPC_SUCCESS || tp->ordinal >= count) {
                r = errmsg_set(errmsg, -ENODEV, "transport cuda: no CUDA device %d (this host has %d)",
                               tp->ordinal, cr == TPC_SUCCESS ? count : 0);
                goto fail;
        }
        if ((cr = tp->api.device_get(&tp->dev, tp->ordinal)) != TPC_SUCCESS ||
            (cr = tp->api.primary_ctx_retain(&tp->ctx, tp->dev)) != TPC_SUCCESS) {
                r = tpc_cuda_errmsg(tp, errmsg, -ENODEV, cr, "primary context");
                goto fail;
        }
        if ((cr = tp->api.ctx_set_current(tp->ctx)) != TPC_SUCCESS ||
            (cr = tp->api.stream_create(&tp->stream, TPC_STREAM_NON_BLOCKING)) != TPC_SUCCESS) {
                r = tpc_cuda_errmsg(tp, errmsg, -EIO, cr, "stream");
                goto fail;
        }
        tp->depth = 1;
        while (tp->depth < (cfg->queue_depth ? cfg->queue_depth : 2048))
                tp->depth <<= 1;
        tp->events = calloc(tp->depth, sizeof(*tp->events));
        tp->ops = calloc(tp->depth, sizeof(*tp->ops));
        tp->peers = calloc(TPC_MAX_PEERS, sizeof(*tp->peers));
        tp->tokens = calloc(TPC_MAX_PEERS, sizeof(*tp->tokens));
        tp->token_used = calloc(TPC_MAX_PEERS, sizeof(*tp->token_used));
        if (!tp->events || !tp->ops || !tp->peers || !tp->tokens || !tp->token_used) {
                r = errmsg_set(errmsg, -ENOMEM, "%s: out of memory", tp->who);
                goto fail;
        }
        for (uint32_t i = 0; i < TPC_MAX_PEERS; i++)
                tp->peers[i].fd = -1;
        for (uint32_t i = 0; i < tp->depth; i++) {
                cr = tp->api.event_create(&tp->events[i], TPC_EVENT_DISABLE_TIMING);
                if (cr != TPC_SUCCESS) {
                        r = tpc_cuda_errmsg(tp, errmsg, -ENOMEM, cr, "event %u of %u", i, tp->depth);
                        goto fail;
                }
        }
        tp->epoll_fd = epoll_create1(EPOLL_CLOEXEC);
        if (tp->epoll_fd < 0) {
                r = errmsg_set(errmsg, -errno, "%s: epoll_create1: %s", tp->who, strerror(errno));
                goto fail;
        }
        r = tpc_server_start(tp, errmsg);
        if (r < 0)
                goto fail;
        *ret = tp;
        return 0;

fail:
        tp_cuda_ops.close(tp);
        return r;
}

static int cuda_open(const struct tp_config *cfg, struct tp **ret, char *errmsg) {
        return tpc_open(cfg, NULL, ret, errmsg);
}

static void cuda_mr_free(struct tp *tp, struct tp_mr *mr);

static void cuda_close(struct tp *tp) {
        struct tp_mr *mr;

        if (!tp)
                return;
        tpc_server_stop(tp);
        if (tp->ctx) {
                tp->api.ctx_set_current(tp->ctx);
                if (tp->stream)
                        tp->api.stream_synchronize(tp->stream);
        }
        tpc_peers_free(tp);
        while ((mr = TAILQ_FIRST(&tp->mrs)))
                cuda_mr_free(tp, mr);
        for (uint32_t i = 0; tp->events && i < tp->depth; i++)
                if (tp->events[i])
                        tp->api.event_destroy(tp->events[i]);
        if (tp->stream)
                tp->api.stream_destroy(tp->stream);
        if (tp->ctx)
                tp->api.primary_ctx_release(tp->dev);
        if (tp->epoll_fd >= 0)
                close(tp->epoll_fd);
        /* libcuda stays loaded: the driver does not support being unloaded
         * and loaded again within a process. */
        free(tp->events);
        free(tp->ops);
        free(tp->peers);
        free(tp->tokens);
        free(tp->token_used);
        pthread_mutex_destroy(&tp->lock);
        free(tp);
}

/* ------------------------------------------------------------ memory */

int tpc_mapping_import(struct tp *tp, int fd, bool memfd, uint64_t length, const char *name,
                       struct tpc_mapping *ret, char *errmsg) {
        struct tpc_access_desc access = { TPC_LOCATION_DEVICE, tp->ordinal, TPC_ACCESS_READWRITE };
        struct tpc_mapping m = { 0 };
        tpc_result cr;

        tp->api.ctx_set_current(tp->ctx);
        if (memfd) {
                m.map = mmap(NULL, length, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
                if (m.map == MAP_FAILED)
                        return errmsg_set(errmsg, -errno, "%s: %s: mmap of memfd %d (%" PRIu64 " bytes): %s",
                                          tp->who, name, fd, length, strerror(errno));
                m.map_len = length;
                m.host_addr = m.map;
                m.host = true;
                cr = tp->api.host_register(m.host_addr, length,
                                           TPC_HOST_REGISTER_PORTABLE | TPC_HOST_REGISTER_DEVICEMAP);
                if (cr == TPC_SUCCESS)
                        cr = tp->api.host_get_device_pointer(&m.ptr, m.host_addr, 0);
                if (cr != TPC_SUCCESS) {
                        munmap(m.map, m.map_len);
                        return tpc_cuda_errmsg(tp, errmsg, -EIO, cr,
                                               "%s: registering %" PRIu64 " bytes of host memory", name,
                                               length);
                }
                *ret = m;
                return 0;
        }
        m.cumem_size = (size_t)((length + TPC_MAP_ALIGN - 1) / TPC_MAP_ALIGN * TPC_MAP_ALIGN);
        cr = tp->api.import_handle(&m.handle, (void *)(uintptr_t)fd, TPC_HANDLE_POSIX_FD);
        if (cr != TPC_SUCCESS)
                return tpc_cuda_errmsg(tp, errmsg, -EINVAL, cr,
                                       "%s: fd %d is no cuMem allocation this driver can import", name, fd);
        cr = tp->api.address_reserve(&m.ptr, m.cumem_size, 0, 0, 0);
        if (cr != TPC_SUCCESS)
                goto fail_release;
        cr = tp->api.map(m.ptr, m.cumem_size, 0, m.handle, 0);
        if (cr != TPC_SUCCESS)
                goto fail_free;
        cr = tp->api.set_access(m.ptr, m.cumem_size, &access, 1);
        if (cr != TPC_SUCCESS)
                goto fail_unmap;
        *ret = m;
        return 0;

fail_unmap:
        tp->api.unmap(m.ptr, m.cumem_size);
fail_free:
        tp->api.address_free(m.ptr, m.cumem_size);
fail_release:
        tp->api.release(m.handle);
        return tpc_cuda_errmsg(
                tp, errmsg, -EINVAL, cr,
                "%s: mapping %zu bytes of fd %d (the allocation must hold the region's %" PRIu64
                " bytes, rounded up to 2 MiB)",
                name, m.cumem_size, fd, length);
}

void tpc_mapping_release(struct tp *tp, struct tpc_mapping *m) {
        tp->api.ctx_set_current(tp->ctx);
        if (m->cumem_size) {
                tp->api.unmap(m->ptr, m->cumem_size);
                tp->api.address_free(m->ptr, m->cumem_size);
                tp->api.release(m->handle);
        }
        if (m->host_addr)
                tp->api.host_unregister(m->host_addr);
        if (m->map)
                munmap(m->map, m->map_len);
        *m = (struct tpc_mapping){ 0 };
}

static int cuda_mr_new(struct tp *tp, const struct tp_mem *mem, struct tp_mr **ret, char *errmsg) {
        const char *name = mem->name ? mem->name : "region";
        struct tp_mr *mr;
        tpc_result cr;
        int r;

        if (mem->length == 0)
                return errmsg_set(errmsg, -EINVAL, "%s: %s: empty", tp->who, name);
        if (mem->kind == TP_MEM_DMABUF)
                return errmsg_set(errmsg, -EOPNOTSUPP,
                                  "%s: %s: cannot import a dma-buf; register the cuMem POSIX fd (cumem-fd)",
                                  tp->who, name);
        if (mem->kind != TP_MEM_HOST && mem->offset != 0)
                return errmsg_set(errmsg, -EINVAL, "%s: %s: offset %" PRIu64 ": only whole fds are imported",
                                  tp->who, name, mem->offset);
        mr = calloc(1, sizeof(*mr));
        if (!mr)
                return errmsg_set(errmsg, -ENOMEM, "%s: %s: out of memory", tp->who, name);
        mr->kind = mem->kind;
        mr->length = mem->length;
        mr->fd = -1;
        do {
                if (getrandom(&mr->key, sizeof(mr->key), 0) != sizeof(mr->key)) {
                        r = errmsg_set(errmsg, -errno, "%s: %s: getrandom: %s", tp->who, name,
                                       strerror(errno));
                        goto fail;
                }
        } while (mr->key == 0);
        switch (mem->kind) {
        case TP_MEM_HOST:
                if (!mem->addr) {
                        r = errmsg_set(errmsg, -EINVAL, "%s: %s: no address", tp->who, name);
                        goto fail;
                }
                tp->api.ctx_set_current(tp->ctx);
                mr->m.host = true;
                mr->m.host_addr = mem->addr;
                cr = tp->api.host_register(mem->addr, mem->length,
                                           TPC_HOST_REGISTER_PORTABLE | TPC_HOST_REGISTER_DEVICEMAP);
                if (cr != TPC_SUCCESS)
                        mr->m.host_addr = NULL; /* nothing to unregister */
                else
                        cr = tp->api.host_get_device_pointer(&mr->m.ptr, mem->addr, 0);
                if (cr != TPC_SUCCESS) {
                        r = tpc_cuda_errmsg(tp, errmsg, -EIO, cr, "%s: registering host memory", name);
                        goto fail;
                }
                break;
        case TP_MEM_MEMFD:
        case TP_MEM_CUMEM:
                /* Our own reference, which peers fetch: the broker's may
                 * be closed once it releases the region. */
                mr->fd = fcntl(mem->fd, F_DUPFD_CLOEXEC, 3);
                if (mr->fd < 0) {
                        r = errmsg_set(errmsg, -errno, "%s: %s: dup of fd %d: %s", tp->who, name, mem->fd,
                                       strerror(errno));
                        goto fail;
                }
                r = tpc_mapping_import(tp, mr->fd, mem->kind == TP_MEM_MEMFD, mem->length, name, &mr->m,
                                       errmsg);
                if (r < 0)
                        goto fail;
                break;
        case TP_MEM_DMABUF:
                break; /* refused above */
        }
        pthread_mutex_lock(&tp->lock);
        TAILQ_INSERT_TAIL(&tp->mrs, mr, entry);
        pthread_mutex_unlock(&tp->lock);
        *ret = mr;
        return 0;

fail:
        tpc_mapping_release(tp, &mr->m);
        if (mr->fd >= 0)
                close(mr->fd);
        free(mr);
        return r;
}

static void cuda_mr_free(struct tp *tp, struct tp_mr *mr) {
        if (!mr)
                return;
        pthread_mutex_lock(&tp->lock);
        TAILQ_REMOVE(&tp->mrs, mr, entry);
        pthread_mutex_unlock(&tp->lock);
        if (mr->fd >= 0)
                tpc_revoke_broadcast(tp, mr->key);
        tpc_mapping_release(tp, &mr->m);
        if (mr->fd >= 0)
                close(mr->fd);
        free(mr);
}

static void cuda_mr_rkey(const struct tp_mr *mr, struct tp_rkey *ret) {
        ret->base = 0;
        ret->key = mr->key;
        ret->length = mr->length;
}

static void *cuda_mr_addr(const struct tp_mr *mr) {
        return mr->m.host ? mr->m.host_addr : NULL;
}

/* ------------------------------------------------------------ data */

static int cuda_write(struct tp *tp, uint32_t peer, struct tp_mr *src, uint64_t src_off,
                      const struct tp_rkey *dst, uint64_t dst_off, uint64_t len, uint64_t cookie,
                      uint64_t imm, unsigned flags) {
        struct tpc_remote *remote;
        struct tpc_op *op;
        uint64_t slot;
        tpc_result cr;
        int state, err;

        (void)imm;
        if (flags & TP_WRITE_IMM)
                return -EOPNOTSUPP; /* no remote completions: the proxy signals with counters */
        if (peer >= TPC_MAX_PEERS)
                return -ENOTCONN;
        state = atomic_load_explicit(&tp->peers[peer].state, memory_order_acquire);
        if (state == TPC_PEER_DEAD)
                return -ECONNRESET;
        if (state != TPC_PEER_CONNECTED)
                return -ENOTCONN;
        if (!tp_range_ok(src->length, src_off, dst->length, dst_off, len))
                return -EINVAL;
        if (tp->tail - tp->head >= tp->depth)
                return -EAGAIN;
        slot = tp->tail & (tp->depth - 1);
        op = &tp->ops[slot];
        *op = (struct tpc_op){ .cookie = cookie, .peer = peer };
        remote = tpc_remote_get(tp, peer, dst->key, &err);
        if (!remote) {
                if (err != -EACCES)
                        return err; /* the connection failed: the peer is dead now */
                op->status = -EACCES;
                tp->tail++;
                return 0;
        }
        if (remote->length != dst->length) {
                op->status = -EACCES; /* an rkey that does not describe the region */
                tp->tail++;
                return 0;
        }
        tp->api.ctx_set_current(tp->ctx);
        if (!src->m.host && !remote->m.host)
                cr = tp->api.memcpy_dtod_async(remote->m.ptr + dst_off, src->m.ptr + src_off, len,
                                               tp->stream);
        else
                cr = tp->api.memcpy_async(remote->m.ptr + dst_off, src->m.ptr + src_off, len, tp->stream);
        if (cr == TPC_SUCCESS)
                cr = tp->api.event_record(tp->events[slot], tp->stream);
        if (cr != TPC_SUCCESS) {
                op->status = -EIO;
                tp->tail++;
                return 0;
        }
        op->has_event = true;
        tp->tail++;
        atomic_fetch_add_explicit(&tp->stats.writes, 1, memory_order_relaxed);
        if (src->kind == TP_MEM_HOST)
                atomic_fetch_add_explicit(&tp->stats.daemon, len, memory_order_relaxed);
        else if (src->m.host || remote->m.host)
                atomic_fetch_add_explicit(&tp->stats.host, len, memory_order_relaxed);
        else
                atomic_fetch_add_explicit(&tp->stats.device, len, memory_order_relaxed);
        return 0;
}

static int cuda_poll(struct tp *tp, struct tp_completion *out, int max) {
        int n = 0;

        /* Revocations and failed connections are rare and not urgent
         * (mesh.c notices a dead daemon too): an epoll check every 256
         * polls keeps a syscall off most turns of the proxy's loop. */
        if ((++tp->polls & 255) == 0)
                tpc_peers_drain(tp);
        if (tp->head != tp->tail)
                tp->api.ctx_set_current(tp->ctx);
        while (n < max && tp->head != tp->tail) {
                uint64_t slot = tp->head & (tp->depth - 1);
                struct tpc_op *op = &tp->ops[slot];
                int status = op->status;

                if (op->has_event) {
                        tpc_result cr = tp->api.event_query(tp->events[slot]);

                        if (cr == TPC_ERROR_NOT_READY)
                                break;
                        if (cr != TPC_SUCCESS)
                                status = -EIO;
                }
                out[n++] = (struct tp_completion){ .cookie = op->cookie, .status = status, .peer = op->peer };
                tp->head++;
        }
        return n;
}

static void cuda_stats(const struct tp *tp, struct tp_stats *ret) {
        ret->writes = atomic_load_explicit(&tp->stats.writes, memory_order_relaxed);
        ret->device = atomic_load_explicit(&tp->stats.device, memory_order_relaxed);
        ret->host = atomic_load_explicit(&tp->stats.host, memory_order_relaxed);
        ret->daemon = atomic_load_explicit(&tp->stats.daemon, memory_order_relaxed);
}

const struct tp_ops tp_cuda_ops = {
        .name = "cuda",
        .open = cuda_open,
        .close = cuda_close,
        .mr_new = cuda_mr_new,
        .mr_free = cuda_mr_free,
        .mr_rkey = cuda_mr_rkey,
        .mr_addr = cuda_mr_addr,
        .peer_new = tpc_peer_new,
        .peer_connect = tpc_peer_connect,
        .write = cuda_write,
        .poll = cuda_poll,
        .stats = cuda_stats,
        .peer_fail = tpc_peer_fail,
};
