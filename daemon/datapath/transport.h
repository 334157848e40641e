/* Transports: the one small interface through which the proxy threads
 * (proxy.c) move bytes to other nodes. Four backends implement it:
 * tp-fabric.c (libfabric: efa, verbs, tcp), tp-verbs.c (libibverbs RC),
 * tp-cuda.c (a GPU-capable NIC simulated with CUDA copies between daemons of
 * one host) and tp-loop.c (same-process memcpy that completes at once; used
 * to measure the proxy alone and to test it without a network).
 *
 * Threads: open, close, mr_free, mr_rkey, peer_new and peer_connect run on
 * the event loop thread while one proxy thread calls write, poll, peer_fail
 * and peer_free; mr_new runs on clientfd's checker threads (datapath.c:
 * pinning takes long), several at once for several uids, while the loop
 * and the proxy make their calls. A backend makes that safe: libfabric's
 * domain is FI_THREAD_SAFE (and fi_mr_reg a control call, thread safe in
 * any model; tp-fabric takes its keys atomically), libibverbs is thread
 * safe (tp-verbs keeps no state of its own in mr_new), tp-cuda makes its
 * context current on the calling thread and locks its list of regions,
 * tp-loop locks its registry; tp_mem_map() is a plain mmap(). The proxy
 * keeps the loop and its thread off the same peer index at once: an index
 * is the loop's from peer_new until it lets go of the connection, then the
 * proxy thread's until peer_free returned (proxy.h, "Transport peers").
 * write and poll themselves are called by one thread at a time.
 *
 * Errors: 0 or -errno; the calls that take an `errmsg` (ERRMSG_MAX bytes, may
 * be NULL) fill it with a message naming the object (device, provider,
 * region, peer) and do not log. */
#ifndef MOEEPD_TRANSPORT_H
#define MOEEPD_TRANSPORT_H

#include <stddef.h>
#include <stdint.h>

struct tp;    /* one opened device/provider; backend-defined */
struct tp_mr; /* one registered memory region; backend-defined */

/* Largest address blob a backend exchanges out of band (tp_ops.peer_new). */
#define TP_ADDR_MAX 256

/* Peer indexes a backend serves at once: 0 .. TP_MAX_PEERS - 1. The proxy
 * hands them out and takes them back (proxy.h, "Transport peers"): a
 * failed peer's index is reused once its resources are freed, so this
 * bounds the connections alive at once, not the connections ever made. */
#define TP_MAX_PEERS 512

/* What to open. Strings are borrowed for the duration of open. */
struct tp_config {
        const char *backend;  /* "fabric", "verbs", "cuda" or "loop" */
        const char *provider; /* fabric: libfabric provider ("efa", "verbs", "tcp"); others: unused */
        const char *device;   /* fabric: domain (e.g. "lo"), verbs: device (e.g. "mlx5_0"), cuda: device
                           * ordinal (e.g. "1"); NULL or "" = first */
        const char *node;     /* fabric: local address to bind (e.g. "127.0.0.1"); NULL = provider's choice */
        uint32_t gid_index;   /* verbs: GID table index of the port (RoCE); unused by the others */
        uint32_t port;        /* verbs: port number (1-based); 0 = 1 */
        uint32_t queue_depth; /* writes in flight at once; 0 = 1024 (loop: 8192) */
};

/* Where registered memory comes from. */
enum tp_mem_kind {
        TP_MEM_HOST,   /* a host pointer the caller keeps mapped (addr, length) */
        TP_MEM_MEMFD,  /* host memory behind a memfd: the backend maps it (fd, offset, length); a
                        * client's memfd must carry F_SEAL_SHRINK, or shrinking it makes the
                        * daemon fault (SIGBUS) when the transport reads it */
        TP_MEM_DMABUF, /* device memory exported as a dma-buf (fd, offset, length): GPU memory */
        TP_MEM_CUMEM,  /* device memory as a cuMem POSIX fd (fd, offset 0, length): GPU memory that
                        * only a backend with a CUDA context can import (cuda) */
};
const char *tp_mem_kind_to_string(enum tp_mem_kind k);

struct tp_mem {
        enum tp_mem_kind kind;
        void *addr;       /* TP_MEM_HOST only */
        int fd;           /* TP_MEM_MEMFD, TP_MEM_DMABUF: borrowed; the backend dups what it keeps */
        uint64_t offset;  /* into the fd */
        uint64_t length;  /* bytes; > 0 */
        const char *name; /* for messages, e.g. "job 3 rank 1 send region"; borrowed */
};

/* What a remote side needs to write into a region: sent out of band, next to
 * the address blob. `base` is what offset 0 of the region is called on the
 * wire (a virtual address or 0, per backend); the writer adds its offset. */
struct tp_rkey {
        uint64_t base;
        uint64_t key;
        uint64_t length;
};

/* Flags of tp_ops.write. */
enum {
        /* Place this write after every earlier write to the same peer: the
         * proxy's counter writes rely on it (see proxy.h, "Ordering"). */
        TP_WRITE_ORDERED = 1u << 0,
        /* Carry `imm` to the peer as remote CQ data / immediate: the target
         * sees a completion (fi_writedata, IBV_WR_RDMA_WRITE_WITH_IMM). */
        TP_WRITE_IMM = 1u << 1,
};

/* What tp_ops.stats counts: how written bytes travelled. A write whose
 * source and target are both device memory counts in `device`; one that
 * reads or writes a client's host memory (a memfd region) in `host`; one
 * whose source is the daemon's own host memory (the proxy's 8-byte signal
 * values, TP_MEM_HOST) in `daemon`. With GPU regions end to end, `host`
 * stays 0: no payload byte went through host memory. */
struct tp_stats {
        uint64_t writes;
        uint64_t device;
        uint64_t host;
        uint64_t daemon;
};

/* One completion from tp_ops.poll. */
struct tp_completion {
        uint64_t cookie; /* what write was given; for a remote TP_WRITE_IMM, the imm */
        int status;      /* 0 or -errno (e.g. -ECONNRESET when the peer went away) */
        int remote;      /* 1 when this is the target side of a TP_WRITE_IMM */
        uint32_t peer;   /* the peer of the write (for remote, UINT32_MAX when unknown) */
};

struct tp_ops {
        /* Backend name, as in tp_config.backend. */
        const char *name;

        /* Opens the device/provider named by `cfg` and creates what every
         * peer shares (fabric: fabric, domain, CQ, AV, endpoint; verbs:
         * context, PD, CQ). On success *ret is owned by the caller and freed
         * with close. -ENODEV when no such device/provider exists. */
        int (*open)(const struct tp_config *cfg, struct tp **ret, char *errmsg);

        /* Frees everything open created, every peer and every region left.
         * In-flight writes are dropped. Accepts NULL. */
        void (*close)(struct tp *tp);

        /* Registers memory for local reads (source of writes) and remote
         * writes (target). On success *ret lives until mr_free or close.
         * -EOPNOTSUPP when the backend cannot register that kind (e.g.
         * TP_MEM_DMABUF on tcp). Called on any thread, never logs (see
         * Threads above). */
        int (*mr_new)(struct tp *tp, const struct tp_mem *mem, struct tp_mr **ret, char *errmsg);

        /* Deregisters; the caller has no write in flight that uses it.
         * Accepts NULL. */
        void (*mr_free)(struct tp *tp, struct tp_mr *mr);

        /* Fills what a peer needs to write into `mr`. */
        void (*mr_rkey)(const struct tp_mr *mr, struct tp_rkey *ret);

        /* Host address of offset 0 of `mr` when the region is host memory
         * (TP_MEM_HOST, TP_MEM_MEMFD), NULL for device memory. */
        void *(*mr_addr)(const struct tp_mr *mr);

        /* Creates the local half of a connection to one more peer under
         * index `peer` (< TP_MAX_PEERS; free: never used, or given back by
         * peer_free), by which every other call names it, and writes its
         * address blob (at most TP_ADDR_MAX bytes) for the peer to receive
         * out of band. fabric: the endpoint name (the same for every peer);
         * verbs: an RC QP's (lid, qpn, psn, gid); cuda: our socket's name
         * and a fresh token. On failure it holds nothing for `peer`. The
         * proxy calls it (proxy_peer_new()), on the loop thread. */
        int (*peer_new)(struct tp *tp, uint32_t peer, void *ret_blob, size_t *ret_len, char *errmsg);

        /* Completes the connection with the peer's blob (from its peer_new).
         * fabric: inserts the address into the AV; verbs: moves the QP
         * through INIT, RTR to RTS. After it, write may target the peer.
         * -EALREADY when it is connected already. */
        int (*peer_connect)(struct tp *tp, uint32_t peer, const void *blob, size_t len, char *errmsg);

        /* Posts one RDMA write of `len` bytes from `src` at `src_off` to the
         * peer's region `dst` at `dst_off`. `cookie` comes back in exactly
         * one completion. Returns 0, -EAGAIN when the queue is full (poll,
         * then retry), -EINVAL for a range outside a region, -ENOTCONN for a
         * peer not connected, or another -errno. No errmsg: this is the hot
         * path; the proxy names the descriptor. */
        int (*write)(struct tp *tp, uint32_t peer, struct tp_mr *src, uint64_t src_off,
                     const struct tp_rkey *dst, uint64_t dst_off, uint64_t len, uint64_t cookie, uint64_t imm,
                     unsigned flags);

        /* Makes progress (both as initiator and as target: libfabric tcp
         * moves target-side data only while the target polls) and returns up
         * to `max` completions in `out`: their number, 0, or -errno when the
         * queue itself failed. */
        int (*poll)(struct tp *tp, struct tp_completion *out, int max);

        /* Optional (NULL where the backend does not count): bytes written
         * so far, by where they were; read from any thread (relaxed). */
        void (*stats)(const struct tp *tp, struct tp_stats *ret);

        /* Optional (NULL where the backend has nothing to stop): the proxy
         * gave up on `peer` for good (its daemon died or reconnected, a
         * write failed or timed out) and will not write to it again, so the
         * backend ends what is on its way to it and drops what it need not
         * keep until peer_free: verbs moves the QP to the error state
         * (its writes complete at once, flushed), cuda drops its imports of
         * that daemon's ranks' GPU memory. Called by the thread that calls
         * write and poll; writes to the peer fail from then on. */
        void (*peer_fail)(struct tp *tp, uint32_t peer);

        /* Frees everything held for `peer` (verbs: its QP; fabric: its AV
         * entry; cuda: its connection, its token and what the other daemon
         * connected with it), so that peer_new may hand out the index
         * again. Called by the thread that calls write and poll, after
         * peer_fail, once the proxy has no write to `peer` it still waits
         * for: a completion of a write it gave up on may still come from
         * poll later (with the old cookie; the proxy ignores it) and must
         * not touch what was freed. Accepts a peer never connected. */
        void (*peer_free)(struct tp *tp, uint32_t peer);
};

extern const struct tp_ops tp_fabric_ops;
extern const struct tp_ops tp_verbs_ops;
extern const struct tp_ops tp_loop_ops;
extern const struct tp_ops tp_cuda_ops;

/* For backends. Checks `mem` (not empty) and gives the host address of
 * offset 0 in *ret_addr: mem->addr for TP_MEM_HOST, a new shared mapping of
 * the memfd for TP_MEM_MEMFD (then also in *ret_map, which the backend owns
 * and gives back with tp_mem_unmap(map, mem->length)); NULL for
 * TP_MEM_DMABUF. `who` names the transport in messages ("transport fabric
 * 'tcp'"). */
int tp_mem_map(const struct tp_mem *mem, const char *who, void **ret_addr, void **ret_map, char *errmsg);

/* For backends: undoes tp_mem_map's mapping `map` of `length` bytes (the
 * region's); nothing when it made none (NULL). */
void tp_mem_unmap(void *map, uint64_t length);

/* For backends: whether [src_off, src_off + len) fits in src_len bytes and
 * [dst_off, dst_off + len) in dst_len, without overflow. */
static inline int tp_range_ok(uint64_t src_len, uint64_t src_off, uint64_t dst_len, uint64_t dst_off,
                              uint64_t len) {
        return src_off <= src_len && len <= src_len - src_off && dst_off <= dst_len &&
               len <= dst_len - dst_off;
}

/* The backend named `name` ("fabric", "verbs", "cuda", "loop"), or NULL. */
const struct tp_ops *tp_ops_find(const char *name);

/* A transport instance as the rest of the daemon holds it: the vtable and
 * the object it opened. */
struct transport {
        const struct tp_ops *ops; /* static */
        struct tp *tp;            /* owns */
};

/* Opens cfg->backend. Returns 0, -ENOENT for an unknown backend, or what the
 * backend's open returned. */
int transport_open(const struct tp_config *cfg, struct transport *ret, char *errmsg);

/* Closes and zeroes `t`. Accepts a zeroed struct. */
void transport_close(struct transport *t);

#endif
