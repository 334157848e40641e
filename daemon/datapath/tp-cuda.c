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
 *   key the first time it writes there (the peer socket, at the end).
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
#include <fcntl.h>
#include <inttypes.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "datapath/tp-cuda-internal.h"
#include "fdorder.h"

static int tpc_cuda_errmsg(const struct tp *tp, char *errmsg, int r, tpc_result cr, const char *fmt, ...)
        __attribute__((format(printf, 5, 6)));
static int tpc_mapping_import(struct tp *tp, int fd, bool memfd, uint64_t length, const char *name,
                              struct tpc_mapping *ret, char *errmsg);
static void tpc_mapping_release(struct tp *tp, struct tpc_mapping *m);

/* The peer socket (below, after the backend). */
static int tpc_server_start(struct tp *tp, char *errmsg);
static void tpc_server_stop(struct tp *tp);
static void tpc_revoke_broadcast(struct tp *tp, uint64_t key);
static int tpc_peer_new(struct tp *tp, uint32_t peer, void *ret_blob, size_t *ret_len, char *errmsg);
static int tpc_peer_connect(struct tp *tp, uint32_t peer, const void *blob, size_t len, char *errmsg);
/* Proxy thread: the import of `key` at `peer`, fetched on first use; NULL
 * with *ret_error -EACCES (the peer has no such region) or another -errno
 * (the connection failed: the peer is dead now). */
static struct tpc_remote *tpc_remote_get(struct tp *tp, uint32_t peer, uint64_t key, int *ret_error);
/* Proxy thread: tp_ops.peer_fail; the proxy failed `peer` (the mesh lost its
 * daemon, or a write to it failed): its imports go now and its connection
 * is shut down, so that the peer's server drops it too. */
static void tpc_peer_fail(struct tp *tp, uint32_t peer);
/* Proxy thread: tp_ops.peer_free; the index may be handed out again. */
static void tpc_peer_free(struct tp *tp, uint32_t peer);
/* Proxy thread: reads what peers sent unasked (REVOKE, a late WELCOME, EOF). */
static void tpc_peers_drain(struct tp *tp);
static void tpc_peers_free(struct tp *tp);

static int tpc_cuda_errmsg(const struct tp *tp, char *errmsg, int r, tpc_result cr, const char *fmt, ...) {
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

static int tpc_mapping_import(struct tp *tp, int fd, bool memfd, uint64_t length, const char *name,
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

static void tpc_mapping_release(struct tp *tp, struct tpc_mapping *m) {
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

/* Runs on clientfd's checker threads (transport.h): each CUDA call comes
 * after ctx_set_current() of the daemon's context on the calling thread
 * (tpc_mapping_import() and the host case below), and the list of regions
 * is taken under tp->lock. */
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
        .peer_free = tpc_peer_free,
};

/* ------------------------------------------------------------ the peer socket */

/* tp-cuda between daemons of one host: how daemon A's proxy reaches the
 * GPU memory registered at daemon B (the backend is above).
 *
 * B listens on an abstract SOCK_SEQPACKET socket with a random name. For
 * each peer, peer_new puts that name, B's pid and uid and a fresh 32-byte
 * token into the blob that the mesh carries to A (authenticated with the
 * cluster key). A connects, checks with SO_PEERCRED that the listener is
 * B's pid and uid (a process that took the name after B died gets nothing
 * of A's), and sends HELLO with the token. B's server thread checks the
 * connecting uid, then the token: an unknown token, a token presented
 * before, or anything but HELLO first closes the connection; one that does
 * not say HELLO within TPC_HELLO_TIMEOUT_MS is closed too, and at most
 * TPC_MAX_CONNS connections are open at once. An authenticated connection
 * may FETCH a key: B answers REGION with a dup of the region's fd
 * (SCM_RIGHTS), and REVOKE when the region is deregistered.
 *
 * What a token grants: what an RC connection and an rkey grant on a NIC,
 * the right to write into regions registered at B. Keys are 64 random
 * bits and travel only over the mesh. */
static uint64_t now_ms(void) {
        struct timespec ts;

        clock_gettime(CLOCK_MONOTONIC, &ts);
        return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

static socklen_t abstract_addr(const char *name, size_t len, struct sockaddr_un *ret) {
        *ret = (struct sockaddr_un){ .sun_family = AF_UNIX };
        memcpy(ret->sun_path + 1, name, len);
        return (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + len);
}

/* Sends one message (and `pass_fd` when >= 0) without blocking. */
static int msg_send(int fd, const struct tpc_msg *m, int pass_fd) {
        char cbuf[CMSG_SPACE(sizeof(int))] = { 0 };
        struct iovec iov = { .iov_base = (void *)m, .iov_len = sizeof(*m) };
        struct msghdr mh = { .msg_iov = &iov, .msg_iovlen = 1 };

        if (pass_fd >= 0) {
                struct cmsghdr *c;

                mh.msg_control = cbuf;
                mh.msg_controllen = sizeof(cbuf);
                c = CMSG_FIRSTHDR(&mh);
                c->cmsg_level = SOL_SOCKET;
                c->cmsg_type = SCM_RIGHTS;
                c->cmsg_len = CMSG_LEN(sizeof(int));
                memcpy(CMSG_DATA(c), &pass_fd, sizeof(int));
        }
        return sendmsg(fd, &mh, MSG_DONTWAIT | MSG_NOSIGNAL) == (ssize_t)sizeof(*m) ? 0
               : -errno                                                             ? -errno
                                                                                    : -EIO;
}

/* Receives and checks one message; *ret_fd gets the fd a REGION carries
 * (else -1). -EAGAIN when none waits, -ECONNRESET at EOF, -EPROTO (with
 * every fd closed) for a message tpc_msg_check refuses. */
static int msg_recv(int fd, bool from_server, struct tpc_msg *ret, int *ret_fd, const char **ret_why) {
        char cbuf[CMSG_SPACE(4 * sizeof(int))];
        uint8_t buf[TPC_MSG_BYTES + 1];
        struct iovec iov = { .iov_base = buf, .iov_len = sizeof(buf) };
        struct msghdr mh = {
                .msg_iov = &iov, .msg_iovlen = 1, .msg_control = cbuf, .msg_controllen = sizeof(cbuf)
        };
        int fds[4], nfds = 0, r;
        ssize_t n;

        *ret_fd = -1;
        *ret_why = "connection closed";
        n = recvmsg(fd, &mh, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
        if (n < 0)
                return errno == EAGAIN || errno == EWOULDBLOCK ? -EAGAIN : -ECONNRESET;
        for (struct cmsghdr *c = CMSG_FIRSTHDR(&mh); c; c = CMSG_NXTHDR(&mh, c))
                if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS)
                        for (size_t k = 0; k < (c->cmsg_len - CMSG_LEN(0)) / sizeof(int) && nfds < 4; k++)
                                memcpy(&fds[nfds++], CMSG_DATA(c) + k * sizeof(int), sizeof(int));
        if (n == 0) {
                r = -ECONNRESET;
                goto fail;
        }
        if (mh.msg_flags & (MSG_CTRUNC | MSG_TRUNC)) {
                *ret_why = "truncated message or too many fds";
                r = -EPROTO;
                goto fail;
        }
        if (tpc_msg_check(buf, (size_t)n, (size_t)nfds, from_server, ret, ret_why) < 0) {
                r = -EPROTO;
                goto fail;
        }
        if (nfds)
                *ret_fd = fds[0];
        return 0;

fail:
        for (int k = 0; k < nfds; k++)
                close(fds[k]);
        return r;
}

/* ------------------------------------------------------------ server (B) */

static void conn_drop(struct tp *tp, uint32_t i) {
        pthread_mutex_lock(&tp->lock);
        close(tp->conns[i].fd);
        tp->conns[i] = tp->conns[--tp->nconns];
        pthread_mutex_unlock(&tp->lock);
}

static void conn_accept(struct tp *tp) {
        struct ucred cred;
        socklen_t len = sizeof(cred);
        int fd = accept4(tp->listen_fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);

        if (fd < 0)
                return;
        /* Only our own uid: daemons of one host run as the same user. */
        if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) < 0 || cred.uid != tp->self.uid ||
            tp->nconns >= TPC_MAX_CONNS) {
                log_notice("%s: connection to the peer socket refused (%s)", tp->who,
                           tp->nconns >= TPC_MAX_CONNS ? "too many connections" : "another uid");
                close(fd);
                return;
        }
        fd = fd_to_top(fd); /* fdorder.h; a refused connection is not worth the fcntl() */
        pthread_mutex_lock(&tp->lock);
        tp->conns[tp->nconns++] = (struct tpc_conn){ .fd = fd, .peer = -1, .since_ms = now_ms() };
        pthread_mutex_unlock(&tp->lock);
}

/* Answers one message of connection i; false to drop the connection. */
static bool conn_serve(struct tp *tp, uint32_t i) {
        struct tpc_conn *c = &tp->conns[i];
        struct tpc_msg m, reply = { .magic = TPC_MSG_MAGIC };
        const char *why;
        struct tp_mr *mr;
        int fd, r, found;

        r = msg_recv(c->fd, false, &m, &fd, &why);
        if (r == -EAGAIN)
                return true;
        if (r < 0) {
                if (r == -EPROTO)
                        log_notice("%s: peer connection dropped: %s", tp->who, why);
                return false;
        }
        if (m.type == TPC_MSG_HELLO) {
                if (c->peer >= 0) {
                        log_notice("%s: peer %d said HELLO twice", tp->who, c->peer);
                        return false;
                }
                pthread_mutex_lock(&tp->lock);
                found = tpc_token_find((const uint8_t(*)[TPC_TOKEN_BYTES])tp->tokens, tp->token_used,
                                       TPC_MAX_PEERS, m.token);
                if (found >= 0) {
                        tp->token_used[found] = true;
                        c->peer = found;
                }
                reply.type = TPC_MSG_WELCOME;
                reply.status = found >= 0 ? 0 : -EACCES;
                r = msg_send(c->fd, &reply, -1);
                pthread_mutex_unlock(&tp->lock);
                if (found < 0)
                        log_notice("%s: peer connection refused: %s token", tp->who,
                                   found == -EALREADY ? "a used" : "an unknown");
                return found >= 0 && r == 0;
        }
        /* FETCH */
        if (c->peer < 0) {
                log_notice("%s: peer connection dropped: %s before HELLO", tp->who,
                           tpc_msg_type_to_string((enum tpc_msg_type)m.type));
                return false;
        }
        reply.type = TPC_MSG_REGION;
        reply.key = m.key;
        pthread_mutex_lock(&tp->lock);
        TAILQ_FOREACH (mr, &tp->mrs, entry)
                if (mr->key == m.key && mr->fd >= 0)
                        break;
        if (mr) {
                reply.kind = mr->kind == TP_MEM_CUMEM ? TPC_REGION_CUMEM : TPC_REGION_MEMFD;
                reply.length = mr->length;
        } else {
                reply.status = -ENOENT;
        }
        r = msg_send(c->fd, &reply, mr ? mr->fd : -1);
        pthread_mutex_unlock(&tp->lock);
        return r == 0;
}

static void *server_main(void *arg) {
        struct tp *tp = arg;
        struct pollfd pfd[2 + TPC_MAX_CONNS];

        for (;;) {
                uint32_t n;
                uint64_t now;

                /* Only this thread adds or drops connections: the list is
                 * stable between the poll and the loop below. */
                n = tp->nconns;
                pfd[0] = (struct pollfd){ .fd = tp->stop_fd, .events = POLLIN };
                pfd[1] = (struct pollfd){ .fd = tp->listen_fd, .events = POLLIN };
                for (uint32_t i = 0; i < n; i++)
                        pfd[2 + i] = (struct pollfd){ .fd = tp->conns[i].fd, .events = POLLIN };
                if (poll(pfd, 2 + n, 100) < 0 && errno != EINTR)
                        break;
                if (pfd[0].revents)
                        break;
                now = now_ms();
                /* Backwards, so that dropping i (the last moves to i)
                 * leaves the entries still to visit in place. */
                for (uint32_t i = n; i-- > 0;) {
                        bool keep = true;

                        if (pfd[2 + i].revents)
                                keep = conn_serve(tp, i);
                        if (keep && tp->conns[i].peer < 0 &&
                            now - tp->conns[i].since_ms > TPC_HELLO_TIMEOUT_MS) {
                                log_notice("%s: peer connection dropped: no HELLO within %d ms", tp->who,
                                           TPC_HELLO_TIMEOUT_MS);
                                keep = false;
                        }
                        if (!keep)
                                conn_drop(tp, i);
                }
                if (pfd[1].revents)
                        conn_accept(tp);
        }
        return NULL;
}

static int tpc_server_start(struct tp *tp, char *errmsg) {
        struct sockaddr_un addr;
        uint64_t nonce;
        socklen_t alen;
        int r;

        tp->self.magic = TPC_BLOB_MAGIC;
        tp->self.version = TPC_BLOB_VERSION;
        tp->self.pid = (uint32_t)getpid();
        tp->self.uid = (uint32_t)geteuid();
        if (getrandom(&nonce, sizeof(nonce), 0) != sizeof(nonce))
                return errmsg_set(errmsg, -errno, "%s: getrandom: %s", tp->who, strerror(errno));
        tpc_name_make(&tp->self, tp->self.pid, nonce);
        tp->listen_fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
        if (tp->listen_fd < 0)
                return errmsg_set(errmsg, -errno, "%s: socket: %s", tp->who, strerror(errno));
        alen = abstract_addr(tp->self.name, tp->self.name_len, &addr);
        if (bind(tp->listen_fd, (struct sockaddr *)&addr, alen) < 0 || listen(tp->listen_fd, 16) < 0)
                return errmsg_set(errmsg, -errno, "%s: peer socket @%s: %s", tp->who, tp->self.name,
                                  strerror(errno));
        tp->stop_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
        if (tp->stop_fd < 0)
                return errmsg_set(errmsg, -errno, "%s: eventfd: %s", tp->who, strerror(errno));
        r = pthread_create(&tp->server, NULL, server_main, tp);
        if (r)
                return errmsg_set(errmsg, -r, "%s: pthread_create: %s", tp->who, strerror(r));
        tp->server_started = true;
        return 0;
}

static void tpc_server_stop(struct tp *tp) {
        uint64_t one = 1;

        if (tp->server_started) {
                if (write(tp->stop_fd, &one, sizeof(one)) < 0) {
                        /* An eventfd at 0 takes it; nothing else to do. */
                }
                pthread_join(tp->server, NULL);
                tp->server_started = false;
        }
        for (uint32_t i = 0; i < tp->nconns; i++)
                close(tp->conns[i].fd);
        tp->nconns = 0;
        if (tp->listen_fd >= 0)
                close(tp->listen_fd);
        if (tp->stop_fd >= 0)
                close(tp->stop_fd);
        tp->listen_fd = tp->stop_fd = -1;
}

static void tpc_revoke_broadcast(struct tp *tp, uint64_t key) {
        struct tpc_msg m = { .magic = TPC_MSG_MAGIC, .type = TPC_MSG_REVOKE, .key = key };

        /* Every authenticated connection: which of them fetched the key is
         * theirs to know. One that cannot take the message now (its buffer
         * full: that daemon is not reading) would keep its import of the
         * region, and so the rank's GPU memory, for as long as the
         * connection lasts: it is shut down instead (we do not wait on a
         * peer from the event loop). Its daemon reads EOF, drops every
         * import it made through it and fails the transport peer; the mesh
         * then connects a fresh one. The server thread, which alone drops
         * connections, frees the slot on the hangup. */
        pthread_mutex_lock(&tp->lock);
        for (uint32_t i = 0; i < tp->nconns; i++)
                if (tp->conns[i].peer >= 0 && !tp->conns[i].shut && msg_send(tp->conns[i].fd, &m, -1) < 0) {
                        log_warn("%s: peer %d: revocation of a region not taken; connection shut down",
                                 tp->who, tp->conns[i].peer);
                        shutdown(tp->conns[i].fd, SHUT_RDWR);
                        tp->conns[i].shut = true;
                }
        pthread_mutex_unlock(&tp->lock);
}

static int tpc_peer_new(struct tp *tp, uint32_t peer, void *ret_blob, size_t *ret_len, char *errmsg) {
        struct tpc_blob b = tp->self;

        _Static_assert(TPC_BLOB_BYTES <= TP_ADDR_MAX, "the blob fits the mesh's address field");
        if (peer >= TPC_MAX_PEERS || atomic_load(&tp->peers[peer].state) != TPC_PEER_FREE)
                return errmsg_set(errmsg, -EINVAL, "%s: peer %u: not a free index", tp->who, peer);
        pthread_mutex_lock(&tp->lock);
        if (getrandom(tp->tokens[peer], TPC_TOKEN_BYTES, 0) != TPC_TOKEN_BYTES) {
                memset(tp->tokens[peer], 0, TPC_TOKEN_BYTES);
                pthread_mutex_unlock(&tp->lock);
                return errmsg_set(errmsg, -EIO, "%s: getrandom for a peer token failed", tp->who);
        }
        memcpy(b.token, tp->tokens[peer], TPC_TOKEN_BYTES);
        tp->token_used[peer] = false;
        atomic_store(&tp->peers[peer].state, TPC_PEER_NEW);
        pthread_mutex_unlock(&tp->lock);
        *ret_len = tpc_blob_encode(&b, ret_blob);
        return 0;
}

/* ------------------------------------------------------------ client (A) */

static int tpc_peer_connect(struct tp *tp, uint32_t peer, const void *blob, size_t len, char *errmsg) {
        struct tpc_msg hello = { .magic = TPC_MSG_MAGIC, .type = TPC_MSG_HELLO };
        struct epoll_event ev = { .events = EPOLLIN, .data.u32 = peer };
        struct tpc_peer *p;
        struct sockaddr_un addr;
        struct ucred cred;
        socklen_t clen = sizeof(cred);
        const char *why;
        struct tpc_blob b;
        int fd, r;

        if (peer >= TPC_MAX_PEERS || atomic_load(&tp->peers[peer].state) == TPC_PEER_FREE)
                return errmsg_set(errmsg, -EINVAL, "%s: peer %u: unknown", tp->who, peer);
        p = &tp->peers[peer];
        if (atomic_load(&p->state) != TPC_PEER_NEW)
                return errmsg_set(errmsg, -EALREADY, "%s: peer %u: already connected", tp->who, peer);
        if (tpc_blob_decode(blob, len, &b, &why) < 0)
                return errmsg_set(errmsg, -EINVAL, "%s: peer %u: bad address blob (%zu bytes): %s", tp->who,
                                  peer, len, why);
        if (b.uid != tp->self.uid)
                return errmsg_set(
                        errmsg, -EPERM,
                        "%s: peer %u: its daemon runs as uid %u, this one as %u: the cuda transport "
                        "joins daemons of one host and one user",
                        tp->who, peer, b.uid, tp->self.uid);
        fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
        if (fd < 0)
                return errmsg_set(errmsg, -errno, "%s: socket: %s", tp->who, strerror(errno));
        fd = fd_to_top(fd); /* fdorder.h */
        if (connect(fd, (struct sockaddr *)&addr, abstract_addr(b.name, b.name_len, &addr)) < 0) {
                r = errmsg_set(errmsg, -errno,
                               "%s: peer %u: connect to @%s: %s (is that daemon on this host and in this "
                               "network namespace?)",
                               tp->who, peer, b.name, strerror(errno));
                goto fail;
        }
        /* The listener must be the daemon that sent the blob, not a
         * process that took the name after that daemon went. */
        if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &clen) < 0 || cred.pid != (pid_t)b.pid ||
            cred.uid != b.uid) {
                r = errmsg_set(errmsg, -EPERM, "%s: peer %u: @%s is not served by pid %u uid %u", tp->who,
                               peer, b.name, b.pid, b.uid);
                goto fail;
        }
        /* A new mesh connection to the same daemon supersedes the old
         * transport peer (the proxy failed it already): shutting its
         * socket down frees the slot at the server, and the proxy thread,
         * reading EOF, drops what it imported through it. Under the lock:
         * the proxy thread closes a freed peer's fd under it. */
        pthread_mutex_lock(&tp->lock);
        for (uint32_t i = 0; i < TPC_MAX_PEERS; i++)
                if (i != peer &&
                    atomic_load_explicit(&tp->peers[i].state, memory_order_acquire) == TPC_PEER_CONNECTED &&
                    tp->peers[i].blob.pid == b.pid && strcmp(tp->peers[i].blob.name, b.name) == 0)
                        shutdown(tp->peers[i].fd, SHUT_RDWR);
        pthread_mutex_unlock(&tp->lock);
        memcpy(hello.token, b.token, TPC_TOKEN_BYTES);
        r = msg_send(fd, &hello, -1);
        if (r < 0) {
                r = errmsg_set(errmsg, r, "%s: peer %u: HELLO to @%s: %s", tp->who, peer, b.name,
                               strerror(-r));
                goto fail;
        }
        if (!p->remotes && !(p->remotes = calloc(TPC_MAX_REMOTES, sizeof(*p->remotes)))) {
                r = errmsg_set(errmsg, -ENOMEM, "%s: peer %u: out of memory", tp->who, peer);
                goto fail;
        }
        p->blob = b;
        p->fd = fd;
        /* tpc_peers_drain skips it until the state below says CONNECTED. */
        if (epoll_ctl(tp->epoll_fd, EPOLL_CTL_ADD, fd, &ev) < 0) {
                p->fd = -1;
                r = errmsg_set(errmsg, -errno, "%s: peer %u: epoll: %s", tp->who, peer, strerror(errno));
                goto fail;
        }
        /* The proxy thread reads fd, blob and remotes after it sees this. */
        atomic_store_explicit(&p->state, TPC_PEER_CONNECTED, memory_order_release);
        return 0;

fail:
        close(fd);
        return r;
}

/* Drops every message still queued on a dead peer's connection, closing
 * the fds they carry: a REGION that came after its fetch timed out holds a
 * reference to that rank's GPU memory for as long as it sits there. The
 * socket itself stays open until peer_free (the loop thread may still name
 * its fd in tpc_peer_connect; peer_free closes it under the lock). */
static void peer_queue_drop(int fd) {
        char cbuf[CMSG_SPACE(4 * sizeof(int))];
        uint8_t buf[TPC_MSG_BYTES + 1];

        /* Bounded: after the shutdown nothing more can arrive. */
        for (int n = 0; n < 4096; n++) {
                struct iovec iov = { .iov_base = buf, .iov_len = sizeof(buf) };
                struct msghdr mh = {
                        .msg_iov = &iov, .msg_iovlen = 1, .msg_control = cbuf, .msg_controllen = sizeof(cbuf)
                };

                if (recvmsg(fd, &mh, MSG_DONTWAIT | MSG_CMSG_CLOEXEC) <= 0)
                        return;
                for (struct cmsghdr *c = CMSG_FIRSTHDR(&mh); c; c = CMSG_NXTHDR(&mh, c))
                        if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS)
                                for (size_t k = 0; k < (c->cmsg_len - CMSG_LEN(0)) / sizeof(int); k++) {
                                        int passed;

                                        memcpy(&passed, CMSG_DATA(c) + k * sizeof(int), sizeof(int));
                                        close(passed);
                                }
        }
}

/* Proxy thread: the connection to `peer` failed or was superseded, or the
 * proxy failed the peer. Its imports go once the stream no longer copies
 * into them, so that a daemon that died, reconnected or was given up on
 * does not leave its ranks' GPU memory held here; the connection is shut
 * down (the peer's server sees EOF and frees the slot) and what it still
 * queued is dropped. */
static void peer_dead(struct tp *tp, uint32_t peer, const char *why) {
        struct tpc_peer *p = &tp->peers[peer];

        if (atomic_load(&p->state) == TPC_PEER_DEAD)
                return;
        log_warn("%s: peer %u (@%s): %s", tp->who, peer, p->blob.name, why);
        epoll_ctl(tp->epoll_fd, EPOLL_CTL_DEL, p->fd, NULL);
        atomic_store(&p->state, TPC_PEER_DEAD);
        shutdown(p->fd, SHUT_RDWR);
        peer_queue_drop(p->fd);
        if (p->nremotes) {
                tp->api.ctx_set_current(tp->ctx);
                tp->api.stream_synchronize(tp->stream);
                for (uint32_t i = 0; i < p->nremotes; i++)
                        tpc_mapping_release(tp, &p->remotes[i].m);
                p->nremotes = 0;
        }
}

/* Drops the import of `key` (REVOKE) once no copy of the stream uses it. */
static void remote_revoke(struct tp *tp, struct tpc_peer *p, uint64_t key) {
        for (uint32_t i = 0; i < p->nremotes; i++)
                if (p->remotes[i].key == key) {
                        tp->api.ctx_set_current(tp->ctx);
                        tp->api.stream_synchronize(tp->stream);
                        tpc_mapping_release(tp, &p->remotes[i].m);
                        p->remotes[i] = p->remotes[--p->nremotes];
                        return;
                }
}

/* Handles a message that came unasked; false when it ends the peer. */
static bool peer_handle(struct tp *tp, uint32_t peer, const struct tpc_msg *m) {
        struct tpc_peer *p = &tp->peers[peer];

        switch ((enum tpc_msg_type)m->type) {
        case TPC_MSG_WELCOME:
                if (m->status < 0 || p->welcomed) {
                        peer_dead(tp, peer,
                                  m->status < 0 ? "the peer refused our token" : "a second WELCOME");
                        return false;
                }
                p->welcomed = true;
                return true;
        case TPC_MSG_REVOKE:
                remote_revoke(tp, p, m->key);
                return true;
        case TPC_MSG_REGION:
                peer_dead(tp, peer, "a region that was not asked for");
                return false;
        case TPC_MSG_HELLO:
        case TPC_MSG_FETCH:
                break; /* tpc_msg_check refused these already */
        }
        return false;
}

/* Reads every waiting message of `peer`; false when it died. */
static bool peer_read(struct tp *tp, uint32_t peer) {
        struct tpc_peer *p = &tp->peers[peer];
        struct tpc_msg m;
        const char *why;
        int fd, r;

        for (;;) {
                r = msg_recv(p->fd, true, &m, &fd, &why);
                if (r == -EAGAIN)
                        return true;
                if (r < 0) {
                        peer_dead(tp, peer, why);
                        return false;
                }
                if (fd >= 0)
                        close(fd);
                if (!peer_handle(tp, peer, &m))
                        return false;
        }
}

static void tpc_peer_fail(struct tp *tp, uint32_t peer) {
        /* A peer still NEW has no connection and no import, and the loop
         * thread may be connecting it: left alone (the proxy never writes
         * to it again either way). */
        if (peer < TPC_MAX_PEERS &&
            atomic_load_explicit(&tp->peers[peer].state, memory_order_acquire) == TPC_PEER_CONNECTED)
                peer_dead(tp, peer, "failed by the proxy");
}

static void tpc_peer_free(struct tp *tp, uint32_t peer) {
        struct tpc_peer *p;

        if (peer >= TPC_MAX_PEERS || atomic_load(&tp->peers[peer].state) == TPC_PEER_FREE)
                return;
        p = &tp->peers[peer];
        if (atomic_load(&p->state) == TPC_PEER_CONNECTED)
                peer_dead(tp, peer, "freed");
        pthread_mutex_lock(&tp->lock);
        if (p->fd >= 0)
                close(p->fd);
        p->fd = -1;
        free(p->remotes);
        p->remotes = NULL;
        p->nremotes = 0;
        p->welcomed = false;
        memset(&p->blob, 0, sizeof(p->blob));
        /* Its token is presented no more, and the other daemon's
         * connection that presented it goes: nothing it fetched through
         * this peer outlives it, nor can it fetch under the next. */
        memset(tp->tokens[peer], 0, TPC_TOKEN_BYTES);
        tp->token_used[peer] = false;
        for (uint32_t i = 0; i < tp->nconns; i++)
                if (tp->conns[i].peer == (int)peer && !tp->conns[i].shut) {
                        shutdown(tp->conns[i].fd, SHUT_RDWR);
                        tp->conns[i].shut = true;
                }
        atomic_store(&p->state, TPC_PEER_FREE);
        pthread_mutex_unlock(&tp->lock);
}

static void tpc_peers_drain(struct tp *tp) {
        struct epoll_event ev[16];
        int n = epoll_wait(tp->epoll_fd, ev, 16, 0);

        for (int i = 0; i < n; i++)
                if (ev[i].data.u32 < TPC_MAX_PEERS &&
                    atomic_load_explicit(&tp->peers[ev[i].data.u32].state, memory_order_acquire) ==
                            TPC_PEER_CONNECTED)
                        peer_read(tp, ev[i].data.u32);
}

static struct tpc_remote *tpc_remote_get(struct tp *tp, uint32_t peer, uint64_t key, int *ret_error) {
        struct tpc_peer *p = &tp->peers[peer];
        struct tpc_msg m = { .magic = TPC_MSG_MAGIC, .type = TPC_MSG_FETCH, .key = key };
        uint64_t deadline = now_ms() + TPC_FETCH_TIMEOUT_MS;
        char errmsg[ERRMSG_MAX], name[96];
        struct tpc_remote *rem;
        const char *why;
        int fd = -1, r;

        for (uint32_t i = 0; i < p->nremotes; i++)
                if (p->remotes[i].key == key)
                        return &p->remotes[i];
        if (p->nremotes >= TPC_MAX_REMOTES) {
                log_warn("%s: peer %u: more than %d regions imported", tp->who, peer, TPC_MAX_REMOTES);
                *ret_error = -EACCES;
                return NULL;
        }
        if (msg_send(p->fd, &m, -1) < 0) {
                peer_dead(tp, peer, "cannot send a fetch");
                *ret_error = -ECONNRESET;
                return NULL;
        }
        /* The one blocking step of the proxy thread, once per region of a
         * peer: the peer's server thread answers at once. Messages that
         * come first (WELCOME, REVOKE) are handled in order. */
        for (;;) {
                struct pollfd pfd = { .fd = p->fd, .events = POLLIN };
                uint64_t now = now_ms();

                if (now >= deadline || poll(&pfd, 1, (int)(deadline - now)) == 0) {
                        peer_dead(tp, peer, "no answer to a fetch within 2 s");
                        *ret_error = -ETIMEDOUT;
                        return NULL;
                }
                r = msg_recv(p->fd, true, &m, &fd, &why);
                if (r == -EAGAIN)
                        continue;
                if (r < 0) {
                        peer_dead(tp, peer, why);
                        *ret_error = -ECONNRESET;
                        return NULL;
                }
                if (m.type == TPC_MSG_REGION && m.key == key)
                        break;
                if (fd >= 0)
                        close(fd);
                if (m.type == TPC_MSG_REGION || !peer_handle(tp, peer, &m)) {
                        peer_dead(tp, peer, "an answer to a fetch not asked for");
                        *ret_error = -ECONNRESET;
                        return NULL;
                }
        }
        if (m.status < 0) {
                *ret_error = -EACCES; /* no such region there (any more): a remote access error */
                return NULL;
        }
        rem = &p->remotes[p->nremotes];
        *rem = (struct tpc_remote){ .key = key, .length = m.length };
        snprintf(name, sizeof(name), "peer %u region %016" PRIx64, peer, key);
        r = tpc_mapping_import(tp, fd, m.kind == TPC_REGION_MEMFD, m.length, name, &rem->m, errmsg);
        close(fd);
        if (r < 0) {
                log_warn("%s", errmsg);
                *ret_error = -EACCES;
                return NULL;
        }
        p->nremotes++;
        return rem;
}

static void tpc_peers_free(struct tp *tp) {
        for (uint32_t i = 0; tp->peers && i < TPC_MAX_PEERS; i++) {
                struct tpc_peer *p = &tp->peers[i];

                for (uint32_t k = 0; k < p->nremotes; k++)
                        tpc_mapping_release(tp, &p->remotes[k].m);
                free(p->remotes);
                if (p->fd >= 0)
                        close(p->fd);
        }
}
