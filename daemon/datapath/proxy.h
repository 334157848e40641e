/* The internode proxy: one thread (moeepd starts one, on the one transport
 * datapath.c opens) that polls descriptor rings in shared memory, posts the
 * RDMA writes they describe through that transport (transport.h), polls
 * completions and makes arrival visible at the receiver by writing a counter
 * there after the data.
 *
 * Who talks to whom: the event loop thread creates the proxy, registers
 * memory and connects peers through the transport, then hands rings over
 * with proxy_ring_add(). From then on the proxy thread alone owns each ring
 * (its mapping, its in-flight writes); the loop only queues commands
 * (ring add/remove, peer failure) and reads events (ring removed, peer
 * failed, ring error) through an eventfd and a queue each way. No session
 * or job state is shared.
 *
 * The ring's layout and memory-ordering rules are in proto/ring.h, which
 * the kernels include too.
 *
 * Sharing: the slots (max_inflight) are shared by every ring. A ring holds
 * at most its fair share, max_inflight / (rings that have slots busy or
 * descriptors waiting), at least 16: a ring alone may use every slot, and
 * idle rings take no share. It also has at most 256 MiB of payload in
 * flight (one larger descriptor alone may exceed that). Past either it
 * waits for its own writes (back-pressure on its ring: its head stops
 * advancing); a ring that held more than its share when others became
 * busy takes no slot until it is below it, so the others get the slots
 * its writes free.
 *
 * Failure: a write not completed within timeout_ms fails the ring that
 * posted it (-ETIMEDOUT, a RING_ERROR event), not its transport peer: a
 * completion error about the connection, proxy_peer_fail(), or a write
 * still not completed after 10 timeouts fails the peer and every ring
 * routing there. The late write keeps its slot, and its ring (whose
 * removal waits for it), until it completes or the peer fails.
 *
 * Transport peers: the proxy hands out the transport's peer indexes
 * (proxy_peer_new()) and takes them back. Each hand-out has a generation,
 * which grows every time the index is handed out again, and a route names
 * both: (index, generation). A peer fails by proxy_peer_fail() or by the
 * proxy's own finding (a write refused, one completed with an error about
 * the connection, one 10 timeouts late). Then, in this order:
 *  1. Every route to that generation is marked dead: rings routing there
 *     get the error in their error word, each later descriptor on such a
 *     route fails at once, and the first on each route of a ring is
 *     reported (PROXY_EVENT_ROUTE_DEAD, naming ring, route, peer, its
 *     name and generation). A ring added later with a route to a failed
 *     or older generation gets the same.
 *  2. Its writes in flight drain: the transport's peer_fail ends them
 *     (verbs flushes the QP), and those still not completed after
 *     timeout_ms are cancelled: their slots go back, and a completion
 *     that comes later names the slot's old generation and is ignored.
 *  3. Once drained, and let go by its owner (proxy_peer_fail() for that
 *     generation), the thread frees what the transport holds for it
 *     (tp_ops.peer_free) and PROXY_EVENT_PEER_FREED tells the loop; the
 *     next proxy_peer_new() may hand the index out again, with the next
 *     generation. A route to an older generation is refused whatever the
 *     index serves now: no stale ring, pending write or late completion
 *     reaches the connection that took the index over.
 * At most PROXY_PEERS_PER_NAME indexes are held under one name (the other
 * daemon's address) and TP_MAX_PEERS in all, connected or draining, so
 * that a daemon that keeps connecting and failing holds a bounded share.
 */
#ifndef MOEEPD_PROXY_H
#define MOEEPD_PROXY_H

#include <stdbool.h>
#include <stdint.h>

#include "datapath/transport.h"
#include "log.h"
#include "ring.h"

/* Where descriptor peer i of a ring goes: the transport peer (the remote
 * daemon's connection) and the receiver's two regions, as that daemon
 * registered them and sent them out of band. */
struct proxy_route {
        uint32_t tp_peer;        /* transport peer index (proxy_peer_new()), or PROXY_ROUTE_NONE */
        uint32_t tp_gen;         /* its generation, as proxy_peer_new() gave it */
        struct tp_rkey data;     /* receiver's data region */
        struct tp_rkey counters; /* receiver's counter region: uint64_t[] */
};

/* proxy_route.tp_peer of a route that leads nowhere: a descriptor naming it
 * fails its ring with -EINVAL and a RING_ERROR event, as one out of range
 * does. moeepd leaves the ranks at its own node unrouted (NVLink reaches
 * them); their rkeys are ignored. */
#define PROXY_ROUTE_NONE UINT32_MAX
/* proxy_route.tp_peer of a route proxy_route_drop() dropped. */
#define PROXY_ROUTE_GONE (UINT32_MAX - 1)

/* Tunables; zero fields take the defaults in brackets. */
struct proxy_params {
        uint32_t max_inflight; /* descriptors with writes in flight [1024] */
        uint32_t batch;        /* descriptors taken from one ring before the next [32] */
        uint32_t timeout_ms;   /* a write not completed by then fails its ring with -ETIMEDOUT [5000] */
        uint32_t idle_spins;   /* idle loops before sleeping 20 us each; UINT32_MAX = always spin [20000] */
};

/* Transport peers one name may hold at once, connected or draining: the
 * connection in use and a few failed ones whose writes still drain. */
#define PROXY_PEERS_PER_NAME 4
/* Bytes of a transport peer's name (proxy_peer_new()), NUL included. */
#define PROXY_PEER_NAME_MAX 80

enum proxy_event_type {
        PROXY_EVENT_RING_REMOVED, /* proxy_ring_remove finished: nothing of the ring is in flight */
        PROXY_EVENT_PEER_FAILED,  /* a transport peer failed; every ring routing to it has its error set */
        PROXY_EVENT_RING_ERROR,   /* a ring's descriptor was invalid, or its write failed (error set on
                                   * the ring) */
        PROXY_EVENT_ROUTE_DEAD,   /* a ring's descriptor named a route to a failed transport peer (or an
                                   * older generation of its index) and failed; told once per route */
        PROXY_EVENT_PEER_FREED,   /* a failed transport peer drained and was freed: its index may be
                                   * handed out again (proxy_peer_new()) */
};
const char *proxy_event_type_to_string(enum proxy_event_type t);

struct proxy_event {
        enum proxy_event_type type;
        uint64_t ring_id;     /* RING_REMOVED, RING_ERROR, ROUTE_DEAD */
        uint32_t tp_peer;     /* PEER_FAILED, ROUTE_DEAD, PEER_FREED */
        uint32_t tp_gen;      /* PEER_FAILED, ROUTE_DEAD, PEER_FREED: the generation of tp_peer meant */
        int error;            /* -errno (PEER_FAILED, RING_ERROR, ROUTE_DEAD) */
        char msg[ERRMSG_MAX]; /* "proxy NAME: what happened" */
        size_t what;          /* offset in msg of "what happened", after the proxy's name */
};

struct proxy;

/* Creates a ring memfd of `capacity` descriptors (power of two, up to
 * PROXY_RING_MAX_CAPACITY), header initialised, size sealed. *ret_fd is the
 * caller's. */
int proxy_ring_create(uint32_t capacity, int *ret_fd, char *errmsg);

/* Starts a proxy thread named `name` (for messages) over `t`, which must
 * outlive it. Registers its own 8-byte staging slots with the transport.
 * *ret is freed with proxy_free. */
int proxy_new(const struct transport *t, const struct proxy_params *params, const char *name,
              struct proxy **ret, char *errmsg);

/* Stops and joins the thread, drops every ring (unmapping them), gives
 * the transport peers it handed out back to the transport (peer_free) and
 * frees what proxy_new made. Writes still in flight are abandoned: close
 * the transport after this. Accepts NULL. */
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

/* The receiver of route `route` of ring `ring_id` let its regions go (a
 * released recv or counter region, a rank that left): from now on a
 * descriptor naming that route fails the ring (-EINVAL, "released"),
 * never reaching a region its daemon no longer knows, which some
 * transports answer by closing the connection that every job shares.
 * -ENOENT when the ring is unknown. */
int proxy_route_drop(struct proxy *p, uint64_t ring_id, uint32_t route);

/* Loop thread: makes the local half of a connection to one more peer
 * named `name` (the other daemon's address, for messages and the cap per
 * name) through the transport (tp_ops.peer_new) under a free index, and
 * writes its address blob (TP_ADDR_MAX bytes at most) for the peer.
 * *ret_peer and *ret_gen are what routes to it name. -EUSERS when `name`
 * holds PROXY_PEERS_PER_NAME indexes already, -ENOSPC when all
 * TP_MAX_PEERS are held (both say how many are connected and how many
 * still drain), or the transport's error. */
int proxy_peer_new(struct proxy *p, const char *name, uint32_t *ret_peer, uint32_t *ret_gen, void *ret_blob,
                   size_t *ret_len, char *errmsg);

/* Loop thread: connects transport peer (`tp_peer`, `gen`) with the peer's
 * blob (tp_ops.peer_connect). -ESTALE when that generation was let go. */
int proxy_peer_connect(struct proxy *p, uint32_t tp_peer, uint32_t gen, const void *blob, size_t len,
                       char *errmsg);

/* Loop thread: the owner lets go of transport peer (`tp_peer`, `gen`),
 * e.g. the mesh lost that daemon: unless the proxy failed it already,
 * every ring routing to it gets `error` (-errno) and its descriptors to
 * that peer fail from now on, so waiters on both sides end; once its
 * writes drained, its index is freed (see "Transport peers"). Every
 * proxy_peer_new() is let go exactly once; -ESTALE for a generation that
 * was let go already or is not the index's, -EINVAL for bad arguments. */
int proxy_peer_fail(struct proxy *p, uint32_t tp_peer, uint32_t gen, int error);

/* Loop thread: the transport peers held now: connected (handed out, not
 * failed) and draining (failed: their writes still drain, or their owner
 * has not let go yet). */
void proxy_peers_count(const struct proxy *p, uint32_t *ret_connected, uint32_t *ret_draining);

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
        uint64_t stale;       /* completions of writes given up on (a failed peer's), ignored */
        uint64_t cancelled;   /* writes of failed peers that never completed and were given up on */
};
void proxy_stats_get(const struct proxy *p, struct proxy_stats *ret);

#endif
