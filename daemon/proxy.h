/* The internode proxy: a thread per NIC that polls descriptor rings in
 * shared memory, posts the RDMA writes they describe through a transport
 * (transport.h), polls completions and makes arrival visible at the receiver
 * by writing a counter there after the data.
 *
 * Who talks to whom: the event loop thread creates the proxy, registers
 * memory and connects peers through the transport, then hands rings over
 * with proxy_ring_add(). From then on the proxy thread alone owns each ring
 * (its mapping, its in-flight writes); the loop only queues commands
 * (ring add/remove, peer failure) and reads events (ring removed, peer
 * failed, ring error) through an eventfd and a queue each way. No session
 * or job state is shared.
 *
 * Ring layout (one memfd per ring, PROXY_RING_BYTES(capacity) bytes, mapped
 * by the producer (the client, kernels through cudaHostRegister) and by the
 * daemon):
 *
 *   offset    0: struct proxy_ring_hdr, 4 cache lines
 *                line 0: magic, version, capacity (set once by proxy_ring_create)
 *                line 1: tail  - producer-owned: descriptors ever published
 *                line 2: head  - proxy-owned: descriptors ever consumed
 *                        done  - proxy-owned: descriptors whose writes ended
 *                line 3: error, error_peer, error_seq - proxy-owned
 *   offset  256: struct proxy_desc desc[capacity]; descriptor number s lives
 *                in desc[s & (capacity - 1)]
 *
 * Indices are free-running 64-bit counts; capacity is a power of two.
 * Each index has one writer and sits on its own cache line so the producer
 * and the proxy never write the same line.
 *
 * Memory ordering (C11 names; on the GPU st.release.sys / ld.acquire.sys or
 * __threadfence_system() around volatile accesses):
 *  1. The producer may fill slot s only when s - acquire(head) < capacity.
 *  2. It writes the payload into its send region and the descriptor into
 *     desc[s & mask], then release-stores tail = s + 1. One producer per
 *     ring (one ring per client channel).
 *  3. The proxy acquire-loads tail, copies descriptors [head, tail), then
 *     release-stores head past them: their slots may be reused at once.
 *  4. The payload of descriptor s may be reused once acquire(done) > s:
 *     done advances in descriptor order when every write of a descriptor has
 *     completed locally (or failed).
 *  5. Errors: the proxy writes error_peer and error_seq, then release-stores
 *     error (-errno, first failure only). Every wait on this ring (for head,
 *     done, or for counters fed by the same peers) must also watch error.
 *
 * Ordering at the receiver ("Ordering" in the docs): for a descriptor with
 * PROXY_DESC_SIGNAL the proxy posts the data write, then an 8-byte write of
 * signal_value into counter[signal_id] of the route's counter region, with
 * TP_WRITE_ORDERED on the same peer. The transport guarantees the counter
 * write is placed after the data (libfabric FI_ORDER_WAW, or FI_FENCE when
 * the provider lacks it; verbs RC in-order execution and placement on one
 * QP). A receiver that acquire-loads counter[id] >= value may read the data.
 * With libfabric tcp the target's provider copies both writes into memory
 * with the CPU, in order; that the receiver sees them in that order too
 * relies on the host's store ordering (x86 TSO). A NIC writes through PCIe
 * posted writes, which stay in order.
 *
 * Failure: a write that never completes (the transport gives neither success
 * nor error) keeps its slot after the proxy failed its peer on the timeout;
 * a transport that drops such writes silently leaks slots until proxy_free.
 */
#ifndef MOEEPD_PROXY_H
#define MOEEPD_PROXY_H

#include <stdbool.h>
#include <stdint.h>

#include "log.h"
#include "transport.h"

#define PROXY_RING_MAGIC 0x676e697270656f6dull /* "moepring" little-endian */
#define PROXY_RING_VERSION 1
#define PROXY_RING_HDR_BYTES 256
#define PROXY_RING_MAX_CAPACITY (1u << 20)
#define PROXY_RING_BYTES(cap) (PROXY_RING_HDR_BYTES + (uint64_t)(cap) * sizeof(struct proxy_desc))

/* The shared header; see the layout above. */
struct proxy_ring_hdr {
        /* Line 0: written once by proxy_ring_create, read-only after. */
        uint64_t magic;    /* PROXY_RING_MAGIC */
        uint32_t version;  /* PROXY_RING_VERSION */
        uint32_t capacity; /* descriptors; a power of two */
        uint8_t pad0[48];
        /* Line 1: the producer's. */
        _Alignas(64) uint64_t tail; /* descriptors published; release-stored by the producer */
        uint8_t pad1[56];
        /* Line 2: the proxy's. */
        _Alignas(64) uint64_t head; /* descriptors consumed; release-stored by the proxy */
        uint64_t done;              /* descriptors finished, in order; release-stored by the proxy */
        uint8_t pad2[48];
        /* Line 3: the proxy's; the first failure on this ring. */
        _Alignas(64) int32_t error; /* 0, or -errno; release-stored after the two below */
        uint32_t error_peer;        /* desc.peer (route index) that failed, UINT32_MAX when none */
        uint64_t error_seq;         /* descriptor number that failed */
        uint8_t pad3[48];
};
_Static_assert(sizeof(struct proxy_ring_hdr) == PROXY_RING_HDR_BYTES, "ring header is 4 cache lines");

/* desc.flags */
enum {
        /* After the data (if any), write signal_value into counter
         * signal_id of the route's counter region. */
        PROXY_DESC_SIGNAL = 1u << 0,
};

/* One descriptor: one cache line, written by the producer, read by the
 * proxy. A descriptor with length 0 and PROXY_DESC_SIGNAL is a pure signal. */
struct proxy_desc {
        uint64_t src_offset;   /* into the ring's send region */
        uint64_t dst_offset;   /* into the route's data region at the receiver */
        uint64_t signal_value; /* value the receiver's counter takes (64-bit, set, not added) */
        uint32_t length;       /* payload bytes; 0 = none */
        uint32_t peer;         /* route index (proxy_ring_add's routes), not a transport peer */
        uint32_t signal_id;    /* counter index in the route's counter region (8 bytes each) */
        uint32_t flags;        /* PROXY_DESC_* */
        uint8_t reserved[24];  /* zero */
};
_Static_assert(sizeof(struct proxy_desc) == 64, "a descriptor is one cache line");

/* Where descriptor peer i of a ring goes: the transport peer (the remote
 * daemon's connection) and the receiver's two regions, as that daemon
 * registered them and sent them out of band. */
struct proxy_route {
        uint32_t tp_peer;        /* transport peer index (tp_ops.peer_new), or PROXY_ROUTE_NONE */
        struct tp_rkey data;     /* receiver's data region */
        struct tp_rkey counters; /* receiver's counter region: uint64_t[] */
};

/* proxy_route.tp_peer of a route that leads nowhere: a descriptor naming it
 * fails its ring with -EINVAL and a RING_ERROR event, as one out of range
 * does. moeepd leaves the ranks at its own node unrouted (NVLink reaches
 * them); their rkeys are ignored. */
#define PROXY_ROUTE_NONE UINT32_MAX

/* Tunables; zero fields take the defaults in brackets. */
struct proxy_params {
        uint32_t max_inflight; /* descriptors with writes in flight [1024] */
        uint32_t batch;        /* descriptors taken from one ring before the next [32] */
        uint32_t timeout_ms;   /* a write not completed by then fails its peer with -ETIMEDOUT [5000] */
        uint32_t idle_spins;   /* idle loops before sleeping 20 us each; UINT32_MAX = always spin [20000] */
};

enum proxy_event_type {
        PROXY_EVENT_RING_REMOVED, /* proxy_ring_remove finished: nothing of the ring is in flight */
        PROXY_EVENT_PEER_FAILED,  /* a transport peer failed; every ring routing to it has its error set */
        PROXY_EVENT_RING_ERROR,   /* a ring's descriptor was invalid (error set on the ring) */
};
const char *proxy_event_type_to_string(enum proxy_event_type t);

struct proxy_event {
        enum proxy_event_type type;
        uint64_t ring_id;  /* RING_REMOVED, RING_ERROR */
        uint32_t tp_peer;  /* PEER_FAILED */
        int error;         /* -errno (PEER_FAILED, RING_ERROR) */
        char msg[ERRMSG_MAX];
};

struct proxy;

/* Creates a ring memfd of `capacity` descriptors (power of two, up to
 * PROXY_RING_MAX_CAPACITY), header initialised, size sealed. *ret_fd is the
 * caller's. */
int proxy_ring_create(uint32_t capacity, int *ret_fd, char *errmsg);

/* Starts a proxy thread named `name` (for messages) over `t`, which must
 * outlive it. Registers its own 8-byte staging slots with the transport.
 * *ret is freed with proxy_free. */
int proxy_new(const struct transport *t, const struct proxy_params *params, const char *name, struct proxy **ret,
              char *errmsg);

/* Stops and joins the thread, drops every ring (unmapping them) and frees
 * what proxy_new made. Writes still in flight are abandoned: close the
 * transport after this. Accepts NULL. */
void proxy_free(struct proxy *p);

/* Hands ring `ring_fd` (borrowed; the proxy maps it) to the proxy under
 * `ring_id` (unique per proxy). Its descriptors read from `src` (borrowed,
 * must stay registered until PROXY_EVENT_RING_REMOVED) and go to `routes`
 * (copied; descriptor peer i uses routes[i]; a route may be
 * PROXY_ROUTE_NONE). -EINVAL for a ring fd that is not a ring, -EEXIST for
 * a ring_id in use. */
int proxy_ring_add(struct proxy *p, uint64_t ring_id, int ring_fd, struct tp_mr *src,
                   const struct proxy_route *routes, uint32_t nroutes, char *errmsg);

/* Asks the thread to stop reading ring `ring_id`; PROXY_EVENT_RING_REMOVED
 * follows once nothing of it is in flight. -ENOENT when unknown. */
int proxy_ring_remove(struct proxy *p, uint64_t ring_id);

/* Tells the proxy that transport peer `tp_peer` is gone (e.g. the mesh lost
 * that daemon): every ring routing to it gets `error` (-errno), and its
 * descriptors to that peer fail from now on, so waiters on both sides end. */
int proxy_peer_fail(struct proxy *p, uint32_t tp_peer, int error);

/* Readable (EPOLLIN) when events are queued; the loop watches it. */
int proxy_event_fd(const struct proxy *p);

/* Takes the next event: true and *ret filled, or false when none. Resets
 * the eventfd when the queue is empty. */
bool proxy_event_next(struct proxy *p, struct proxy_event *ret);

/* Counters for benchmarks and metrics, read without locking (relaxed). */
struct proxy_stats {
        uint64_t descriptors; /* consumed */
        uint64_t writes;      /* posted */
        uint64_t completions; /* local completions */
        uint64_t eagain;      /* posts refused with -EAGAIN */
};
void proxy_stats_get(const struct proxy *p, struct proxy_stats *ret);

#endif
