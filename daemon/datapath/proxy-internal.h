/* What the proxy's two files share: proxy.c (the loop thread's side: ring
 * creation, proxy_new/proxy_free and the command and event queues) and
 * proxy-ring.c (the proxy thread: ring polling, descriptor execution,
 * completions and timeouts). Not for any other file: the rest of the daemon
 * uses proxy.h. */
#ifndef MOEEPD_PROXY_INTERNAL_H
#define MOEEPD_PROXY_INTERNAL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <sys/queue.h>

#include "datapath/proxy.h"

#ifndef TAILQ_FOREACH_SAFE
#define TAILQ_FOREACH_SAFE(var, head, field, tvar) \
        for ((var) = TAILQ_FIRST(head); (var) && ((tvar) = TAILQ_NEXT(var, field), 1); (var) = (tvar))
#endif

#define PROXY_MAX_TP_PEERS 4096
#define PROXY_MAX_ROUTES 4096
#define PROXY_POLL_MAX 64

/* Atomic access to the shared header words, which are plain uint64_t in the
 * documented layout (the GPU side cannot use C11 atomics). */
#define LOAD_ACQ(p) __atomic_load_n((p), __ATOMIC_ACQUIRE)
#define STORE_REL(p, v) __atomic_store_n((p), (v), __ATOMIC_RELEASE)

struct ring {
        TAILQ_ENTRY(ring) entry;
        uint64_t id;
        struct proxy_ring_hdr *hdr; /* owns the mapping (map_len bytes) */
        struct proxy_desc *desc;    /* inside the mapping */
        size_t map_len;
        uint32_t cap, mask;
        uint64_t head;              /* our copy of hdr->head */
        uint64_t done;              /* our copy of hdr->done */
        uint8_t *finished;          /* owns; finished[s & mask] for s in [done, head] */
        struct tp_mr *src;          /* borrowed: the loop keeps it registered */
        struct proxy_route *routes; /* owns */
        uint32_t nroutes;
        uint32_t inflight; /* slots busy for this ring */
        bool removing;
        bool reported; /* a RING_ERROR event was sent */
};

enum slot_state {
        SLOT_FREE,
        SLOT_BUSY,
        SLOT_ABANDONED
};

/* One descriptor in flight: up to two writes (data, then signal). The
 * cookie of a write is slot index * 2 + (0 data, 1 signal). */
struct slot {
        enum slot_state state;
        struct ring *ring; /* borrowed; NULL once abandoned */
        uint64_t seq;
        uint64_t posted_ns;
        uint32_t route;
        uint32_t tp_peer;
        uint32_t signal_id; /* counter index of a signal still to post */
        uint8_t pending;    /* writes posted and not completed */
        bool need_signal;   /* signal write refused with -EAGAIN; retried */
};

enum cmd_type {
        CMD_RING_ADD,
        CMD_RING_REMOVE,
        CMD_PEER_FAIL,
        CMD_ROUTE_DROP, /* ring `ring_id`'s route `tp_peer` leads nowhere from now on */
};

struct cmd {
        TAILQ_ENTRY(cmd) entry;
        enum cmd_type type;
        struct ring *ring; /* owns until the thread takes it (CMD_RING_ADD) */
        uint64_t ring_id;
        uint32_t tp_peer;
        int error;
};

struct evt {
        TAILQ_ENTRY(evt) entry;
        struct proxy_event ev;
};

struct ring_id {
        TAILQ_ENTRY(ring_id) entry;
        uint64_t id;
};

struct proxy {
        char name[64];
        const struct tp_ops *ops; /* borrowed */
        struct tp *tp;            /* borrowed */
        struct proxy_params params;
        pthread_t thread;
        atomic_bool stop;

        /* Shared with the loop thread, under lock. */
        pthread_mutex_t lock;
        TAILQ_HEAD(, cmd) cmds;
        atomic_uint ncmds; /* commands queued: the thread's cheap check */
        TAILQ_HEAD(, evt) events;
        TAILQ_HEAD(, ring_id) ids; /* ring ids added and not yet removed */
        int event_fd;              /* owns */

        /* The thread's alone. */
        TAILQ_HEAD(, ring) rings;
        struct slot *slots;   /* owns; max_inflight */
        uint32_t *free_slots; /* owns; stack of free slot indexes */
        uint32_t nfree;
        uint32_t *retry; /* owns; slots whose signal write waits */
        uint32_t nretry;
        uint64_t *staging;        /* owns; signal values, one per slot */
        struct tp_mr *staging_mr; /* owns */
        int *peer_error;          /* owns; per transport peer, 0 or -errno */
        uint64_t last_scan_ns;

        struct {
                atomic_uint_fast64_t descriptors, writes, completions, eagain;
        } stats;
};

/* ------------------------------------------- proxy.c: the loop's side */

/* Frees `ring` (its mapping, arrays and its id in p->ids, under p->lock).
 * Called by the proxy thread once a removed ring is idle, and by
 * proxy_free() after the thread has stopped. */
void ring_drop(struct proxy *p, struct ring *ring);

/* ------------------------------------------ proxy-ring.c: the thread */

/* The proxy thread's body; proxy_new() starts it with `p` and proxy_free()
 * stops it through p->stop. */
void *proxy_main(void *arg);

#endif
