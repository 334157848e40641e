/* The internode proxy; see proxy.h for the ring layout and the ordering
 * rules. The thread owns the rings, the slots and the staging words; the
 * loop thread reaches it only through the command queue (cmd_fd) and reads
 * what it reports through the event queue (event_fd). The loop thread's
 * side first (ring creation, proxy_new/proxy_free, the queues), then the
 * thread: ring polling, descriptor execution, completions and timeouts. */
#include <assert.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/queue.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "datapath/proxy.h"

#ifndef TAILQ_FOREACH_SAFE
#define TAILQ_FOREACH_SAFE(var, head, field, tvar) \
        for ((var) = TAILQ_FIRST(head); (var) && ((tvar) = TAILQ_NEXT(var, field), 1); (var) = (tvar))
#endif

#define PROXY_MAX_ROUTES 4096
/* Slots at most: a write's cookie holds slot * 2 + 1 in 32 bits and the
 * slot's generation in the other 32. */
#define PROXY_MAX_INFLIGHT (1u << 20)
#define PROXY_POLL_MAX 64
/* Fair share: a ring holds at most max_inflight / (rings with work) slots,
 * and never fewer than this; rings are tenants' (a job's rank's channel). */
#define PROXY_RING_MIN_SLOTS 16
/* Payload bytes one ring may have in flight (one descriptor alone may
 * exceed it): a flooding ring waits for its own writes, it does not fill
 * the connection every job shares until writes time out. */
#define PROXY_RING_INFLIGHT_BYTES (256ull << 20)

/* Atomic access to the shared header words, which are plain uint64_t in the
 * documented layout (the GPU side cannot use C11 atomics). */
#define LOAD_ACQ(p) __atomic_load_n((p), __ATOMIC_ACQUIRE)
#define STORE_REL(p, v) __atomic_store_n((p), (v), __ATOMIC_RELEASE)

/* What the thread knows of one route of a ring beyond its proxy_route. */
struct route_state {
        int error; /* -errno once its transport peer failed (the route is dead), else 0 */
        bool told; /* a ROUTE_DEAD event about it was sent */
};

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
        struct route_state *rstate; /* owns; one per route */
        uint32_t nroutes;
        uint32_t inflight;       /* slots busy for this ring */
        uint64_t inflight_bytes; /* payload bytes of those slots */
        bool waiting;            /* descriptors were left in it on the last poll */
        bool removing;
        bool reported; /* a RING_ERROR event was sent */
};

enum slot_state {
        SLOT_FREE,
        SLOT_BUSY,
        SLOT_ABANDONED
};

/* One descriptor in flight: up to two writes (data, then signal). The
 * cookie of a write is the slot's generation << 32 | slot index * 2 + (0
 * data, 1 signal): the generation grows each time the slot is taken, so a
 * completion that comes after its slot was given up on (a cancelled write
 * of a failed peer) names an old generation and is ignored. */
/* A write this many timeouts late fails its transport peer (one timeout
 * fails only its ring). */
#define PROXY_DEAD_TIMEOUTS 10

struct slot {
        enum slot_state state;
        uint32_t gen;      /* grows each time the slot is taken (cookies) */
        struct ring *ring; /* borrowed; NULL once abandoned */
        uint64_t seq;
        uint64_t posted_ns;
        uint32_t route;
        uint32_t tp_peer;   /* counted in peers[tp_peer].inflight until the slot is free */
        uint32_t signal_id; /* counter index of a signal still to post */
        uint32_t length;    /* payload bytes, charged to ring->inflight_bytes */
        uint8_t pending;    /* writes posted and not completed */
        bool need_signal;   /* signal write refused with -EAGAIN; retried */
        bool late;          /* past timeout_ms: its ring failed, the slot waits for the writes */
};

enum cmd_type {
        CMD_RING_ADD,
        CMD_RING_REMOVE,
        CMD_PEER_ADD,   /* transport peer (`tp_peer`, `gen`) named `name` was handed out */
        CMD_PEER_FAIL,  /* its owner lets go of (`tp_peer`, `gen`), failing it with `error` */
        CMD_ROUTE_DROP, /* ring `ring_id`'s route `tp_peer` leads nowhere from now on */
};

struct cmd {
        TAILQ_ENTRY(cmd) entry;
        enum cmd_type type;
        struct ring *ring; /* owns until the thread takes it (CMD_RING_ADD) */
        uint64_t ring_id;
        uint32_t tp_peer;
        uint32_t gen;
        int error;
        char name[PROXY_PEER_NAME_MAX];
};

/* A transport peer index as the proxy thread sees it. */
enum peer_state {
        PEER_FREE,     /* no connection: routes to it are refused */
        PEER_LIVE,     /* handed out: writes go */
        PEER_DRAINING, /* failed: waits for its writes in flight (timeout_ms, then cancels them) */
        PEER_DRAINED,  /* failed, nothing in flight: waits for its owner to let go */
};

struct peer {
        enum peer_state state;
        uint32_t gen;       /* of the last hand-out; routes to another are refused */
        int error;          /* -errno once failed, kept until the index is handed out again */
        bool released;      /* its owner let go (CMD_PEER_FAIL) */
        uint32_t inflight;  /* slots, busy or abandoned, holding writes to it */
        uint32_t cancelled; /* writes given up on when it drained */
        uint64_t failed_ns;
        char name[PROXY_PEER_NAME_MAX];
};

/* A transport peer index as the loop thread sees it. */
struct peer_owner {
        bool held;           /* handed out (proxy_peer_new) and not freed yet (PEER_FREED) */
        bool released;       /* proxy_peer_fail() was called for `gen` */
        bool failed;         /* the thread reported it failed (PEER_FAILED) */
        uint32_t gen;        /* of the last hand-out; the first is 1 */
        struct cmd *release; /* owns; the CMD_PEER_FAIL that proxy_peer_fail() queues */
        char name[PROXY_PEER_NAME_MAX];
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

        /* The loop thread's alone. */
        struct peer_owner *owners; /* owns; TP_MAX_PEERS */

        /* The thread's alone. */
        TAILQ_HEAD(, ring) rings;
        uint32_t nactive;     /* rings with slots busy or descriptors waiting, on the last pass */
        struct slot *slots;   /* owns; max_inflight */
        uint32_t *free_slots; /* owns; stack of free slot indexes */
        uint32_t nfree;
        uint32_t *retry; /* owns; slots whose signal write waits */
        uint32_t nretry;
        uint64_t *staging;        /* owns; signal values, one per slot */
        struct tp_mr *staging_mr; /* owns */
        struct peer *peers;       /* owns; TP_MAX_PEERS */
        uint32_t ndraining;       /* peers DRAINING or DRAINED */
        bool drain_due;           /* a draining peer's last write ended: peers_drain() */
        uint64_t last_scan_ns;

        struct {
                atomic_uint_fast64_t descriptors, writes, completions, eagain, stale, cancelled;
        } stats;
};

static void *proxy_main(void *arg);

const char *proxy_event_type_to_string(enum proxy_event_type t) {
        switch (t) {
        case PROXY_EVENT_RING_REMOVED:
                return "ring-removed";
        case PROXY_EVENT_PEER_FAILED:
                return "peer-failed";
        case PROXY_EVENT_RING_ERROR:
                return "ring-error";
        case PROXY_EVENT_ROUTE_DEAD:
                return "route-dead";
        case PROXY_EVENT_PEER_FREED:
                return "peer-freed";
        }
        return "unknown";
}

int proxy_ring_create(uint32_t capacity, int *ret_fd, char *errmsg) {
        struct proxy_ring_hdr *hdr;
        uint64_t bytes;
        int fd, r;

        if (capacity == 0 || capacity > PROXY_RING_MAX_CAPACITY || (capacity & (capacity - 1)))
                return errmsg_set(errmsg, -EINVAL, "proxy ring: capacity %u: need a power of two up to %u",
                                  capacity, PROXY_RING_MAX_CAPACITY);
        bytes = PROXY_RING_BYTES(capacity);
        fd = memfd_create("moeep-ring", MFD_CLOEXEC | MFD_ALLOW_SEALING);
        if (fd < 0)
                return errmsg_set(errmsg, -errno, "proxy ring: memfd_create: %s", strerror(errno));
        if (ftruncate(fd, (off_t)bytes) < 0) {
                r = errmsg_set(errmsg, -errno, "proxy ring: ftruncate to %" PRIu64 " bytes: %s", bytes,
                               strerror(errno));
                goto err_fd;
        }
        hdr = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (hdr == MAP_FAILED) {
                r = errmsg_set(errmsg, -errno, "proxy ring: mmap: %s", strerror(errno));
                goto err_fd;
        }
        hdr->magic = PROXY_RING_MAGIC;
        hdr->version = PROXY_RING_VERSION;
        hdr->capacity = capacity;
        hdr->error_peer = UINT32_MAX;
        munmap(hdr, bytes);
        if (fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) < 0) {
                r = errmsg_set(errmsg, -errno, "proxy ring: sealing: %s", strerror(errno));
                goto err_fd;
        }
        *ret_fd = fd;
        return 0;

err_fd:
        close(fd);
        return r;
}

/* The loop thread's record of ring ids in use; called with p->lock held. */
static struct ring_id *ring_id_find(struct proxy *p, uint64_t id) {
        struct ring_id *it;

        TAILQ_FOREACH (it, &p->ids, entry)
                if (it->id == id)
                        return it;
        return NULL;
}

/* Frees `ring` (its mapping, arrays and its id in p->ids, under p->lock).
 * Called by the proxy thread once a removed ring is idle, and by
 * proxy_free() after the thread has stopped. */
static void ring_drop(struct proxy *p, struct ring *ring) {
        struct ring_id *rid;

        pthread_mutex_lock(&p->lock);
        rid = ring_id_find(p, ring->id);
        if (rid) {
                TAILQ_REMOVE(&p->ids, rid, entry);
                free(rid);
        }
        pthread_mutex_unlock(&p->lock);
        munmap(ring->hdr, ring->map_len);
        free(ring->finished);
        free(ring->routes);
        free(ring->rstate);
        free(ring);
}

/* Frees what proxy_new allocated besides the thread, the staging
 * registration and the queues; then `p` itself. */
static void proxy_arrays_free(struct proxy *p) {
        for (uint32_t i = 0; p->owners && i < TP_MAX_PEERS; i++)
                free(p->owners[i].release);
        free(p->owners);
        free(p->slots);
        free(p->free_slots);
        free(p->retry);
        free(p->peers);
        free(p->staging);
        if (p->event_fd >= 0)
                close(p->event_fd);
        pthread_mutex_destroy(&p->lock);
        free(p);
}

int proxy_new(const struct transport *t, const struct proxy_params *params, const char *name,
              struct proxy **ret, char *errmsg) {
        struct tp_mem mem = { .kind = TP_MEM_HOST };
        struct proxy *p;
        int r;

        if (!t || !t->ops || !t->tp || !name)
                return errmsg_set(errmsg, -EINVAL, "proxy: no transport or name");
        p = calloc(1, sizeof(*p));
        if (!p)
                return errmsg_set(errmsg, -ENOMEM, "proxy %s: out of memory", name);
        snprintf(p->name, sizeof(p->name), "%s", name);
        p->ops = t->ops;
        p->tp = t->tp;
        p->params = params ? *params : (struct proxy_params){ 0 };
        if (!p->params.max_inflight)
                p->params.max_inflight = 1024;
        if (p->params.max_inflight > PROXY_MAX_INFLIGHT) {
                free(p);
                return errmsg_set(errmsg, -EINVAL, "proxy %s: max_inflight %u: at most %u", name,
                                  params->max_inflight, PROXY_MAX_INFLIGHT);
        }
        if (!p->params.batch)
                p->params.batch = 32;
        if (!p->params.timeout_ms)
                p->params.timeout_ms = 5000;
        if (!p->params.idle_spins)
                p->params.idle_spins = 20000;
        pthread_mutex_init(&p->lock, NULL);
        TAILQ_INIT(&p->cmds);
        TAILQ_INIT(&p->events);
        TAILQ_INIT(&p->ids);
        TAILQ_INIT(&p->rings);
        p->event_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
        if (p->event_fd < 0) {
                r = errmsg_set(errmsg, -errno, "proxy %s: eventfd: %s", name, strerror(errno));
                goto err_arrays;
        }
        p->slots = calloc(p->params.max_inflight, sizeof(*p->slots));
        p->free_slots = calloc(p->params.max_inflight, sizeof(*p->free_slots));
        p->retry = calloc(p->params.max_inflight, sizeof(*p->retry));
        p->peers = calloc(TP_MAX_PEERS, sizeof(*p->peers));
        p->owners = calloc(TP_MAX_PEERS, sizeof(*p->owners));
        if (posix_memalign((void **)&p->staging, 4096, (size_t)p->params.max_inflight * 8) != 0)
                p->staging = NULL;
        if (!p->slots || !p->free_slots || !p->retry || !p->peers || !p->owners || !p->staging) {
                r = errmsg_set(errmsg, -ENOMEM, "proxy %s: out of memory for %u slots", name,
                               p->params.max_inflight);
                goto err_arrays;
        }
        for (uint32_t i = 0; i < p->params.max_inflight; i++)
                p->free_slots[p->nfree++] = p->params.max_inflight - 1 - i;
        mem.addr = p->staging;
        mem.length = (uint64_t)p->params.max_inflight * 8;
        mem.name = "proxy signal staging";
        r = p->ops->mr_new(p->tp, &mem, &p->staging_mr, errmsg);
        if (r < 0)
                goto err_arrays;
        r = pthread_create(&p->thread, NULL, proxy_main, p);
        if (r) {
                r = errmsg_set(errmsg, -r, "proxy %s: pthread_create: %s", name, strerror(r));
                goto err_mr;
        }
        *ret = p;
        return 0;

err_mr:
        p->ops->mr_free(p->tp, p->staging_mr);
err_arrays:
        proxy_arrays_free(p);
        return r;
}

void proxy_free(struct proxy *p) {
        struct ring *ring;
        struct cmd *c;
        struct evt *e;
        struct ring_id *rid;

        if (!p)
                return;
        atomic_store(&p->stop, true);
        pthread_join(p->thread, NULL);
        while ((ring = TAILQ_FIRST(&p->rings))) {
                TAILQ_REMOVE(&p->rings, ring, entry);
                ring_drop(p, ring);
        }
        while ((c = TAILQ_FIRST(&p->cmds))) {
                TAILQ_REMOVE(&p->cmds, c, entry);
                if (c->ring)
                        ring_drop(p, c->ring);
                free(c);
        }
        while ((e = TAILQ_FIRST(&p->events))) {
                TAILQ_REMOVE(&p->events, e, entry);
                free(e);
        }
        while ((rid = TAILQ_FIRST(&p->ids))) {
                TAILQ_REMOVE(&p->ids, rid, entry);
                free(rid);
        }
        /* The transport peers it handed out go back too (the thread is
         * gone: nothing writes to them). */
        for (uint32_t i = 0; i < TP_MAX_PEERS; i++)
                if (p->owners[i].held && p->ops->peer_free)
                        p->ops->peer_free(p->tp, i);
        p->ops->mr_free(p->tp, p->staging_mr);
        proxy_arrays_free(p);
}

static void cmd_push(struct proxy *p, struct cmd *c) {
        pthread_mutex_lock(&p->lock);
        TAILQ_INSERT_TAIL(&p->cmds, c, entry);
        atomic_fetch_add_explicit(&p->ncmds, 1, memory_order_release);
        pthread_mutex_unlock(&p->lock);
}

int proxy_ring_add(struct proxy *p, uint64_t ring_id, int ring_fd, struct tp_mr *src,
                   const struct proxy_route *routes, uint32_t nroutes, char *errmsg) {
        struct ring *ring = NULL;
        struct ring_id *rid;
        struct cmd *c = NULL;
        struct stat st;
        uint32_t cap;
        int r;

        if (!p || !src || (!routes && nroutes) || nroutes > PROXY_MAX_ROUTES)
                return errmsg_set(errmsg, -EINVAL, "proxy: ring %" PRIu64 ": bad arguments (%u routes)",
                                  ring_id, nroutes);
        for (uint32_t i = 0; i < nroutes; i++)
                if (routes[i].tp_peer >= TP_MAX_PEERS && routes[i].tp_peer != PROXY_ROUTE_NONE)
                        return errmsg_set(errmsg, -EINVAL,
                                          "proxy %s: ring %" PRIu64 ": route %u: transport peer %u "
                                          "out of range",
                                          p->name, ring_id, i, routes[i].tp_peer);
        if (fstat(ring_fd, &st) < 0)
                return errmsg_set(errmsg, -errno, "proxy %s: ring %" PRIu64 ": fd %d: %s", p->name, ring_id,
                                  ring_fd, strerror(errno));
        ring = calloc(1, sizeof(*ring));
        rid = calloc(1, sizeof(*rid));
        c = calloc(1, sizeof(*c));
        if (!ring || !rid || !c) {
                r = errmsg_set(errmsg, -ENOMEM, "proxy %s: ring %" PRIu64 ": out of memory", p->name,
                               ring_id);
                goto err_alloc;
        }
        if ((uint64_t)st.st_size < PROXY_RING_HDR_BYTES) {
                r = errmsg_set(errmsg, -EINVAL, "proxy %s: ring %" PRIu64 ": fd of %lld bytes is no ring",
                               p->name, ring_id, (long long)st.st_size);
                goto err_alloc;
        }
        ring->map_len = (size_t)st.st_size;
        ring->hdr = mmap(NULL, ring->map_len, PROT_READ | PROT_WRITE, MAP_SHARED, ring_fd, 0);
        if (ring->hdr == MAP_FAILED) {
                r = errmsg_set(errmsg, -errno, "proxy %s: ring %" PRIu64 ": mmap: %s", p->name, ring_id,
                               strerror(errno));
                goto err_alloc;
        }
        cap = ring->hdr->capacity;
        if (ring->hdr->magic != PROXY_RING_MAGIC || ring->hdr->version != PROXY_RING_VERSION || cap == 0 ||
            cap > PROXY_RING_MAX_CAPACITY || (cap & (cap - 1)) ||
            PROXY_RING_BYTES(cap) != (uint64_t)st.st_size) {
                r = errmsg_set(errmsg, -EINVAL,
                               "proxy %s: ring %" PRIu64 ": bad header (magic %#" PRIx64
                               ", version %u, capacity %u, %lld bytes)",
                               p->name, ring_id, ring->hdr->magic, ring->hdr->version, cap,
                               (long long)st.st_size);
                goto err_map;
        }
        ring->id = ring_id;
        ring->cap = cap;
        ring->mask = cap - 1;
        ring->desc = (struct proxy_desc *)((char *)ring->hdr + PROXY_RING_HDR_BYTES);
        ring->head = ring->done = LOAD_ACQ(&ring->hdr->head);
        STORE_REL(&ring->hdr->done, ring->done);
        ring->src = src;
        ring->nroutes = nroutes;
        ring->finished = calloc(cap, 1);
        ring->routes = calloc(nroutes ? nroutes : 1, sizeof(*routes));
        ring->rstate = calloc(nroutes ? nroutes : 1, sizeof(*ring->rstate));
        if (!ring->finished || !ring->routes || !ring->rstate) {
                r = errmsg_set(errmsg, -ENOMEM, "proxy %s: ring %" PRIu64 ": out of memory", p->name,
                               ring_id);
                goto err_arrays;
        }
        if (nroutes)
                memcpy(ring->routes, routes, nroutes * sizeof(*routes));
        rid->id = ring_id;
        pthread_mutex_lock(&p->lock);
        if (ring_id_find(p, ring_id)) {
                pthread_mutex_unlock(&p->lock);
                r = errmsg_set(errmsg, -EEXIST, "proxy %s: ring %" PRIu64 ": already added", p->name,
                               ring_id);
                goto err_arrays;
        }
        TAILQ_INSERT_TAIL(&p->ids, rid, entry);
        pthread_mutex_unlock(&p->lock);
        c->type = CMD_RING_ADD;
        c->ring = ring;
        cmd_push(p, c);
        return 0;

err_arrays:
        free(ring->finished);
        free(ring->routes);
        free(ring->rstate);
err_map:
        munmap(ring->hdr, ring->map_len);
err_alloc:
        free(ring);
        free(rid);
        free(c);
        return r;
}

/* Queues command `type` about ring `ring_id` (`arg` in its tp_peer). */
static int ring_cmd(struct proxy *p, enum cmd_type type, uint64_t ring_id, uint32_t arg) {
        struct cmd *c;
        bool known;

        pthread_mutex_lock(&p->lock);
        known = ring_id_find(p, ring_id) != NULL;
        pthread_mutex_unlock(&p->lock);
        if (!known)
                return -ENOENT;
        c = calloc(1, sizeof(*c));
        if (!c)
                return -ENOMEM;
        c->type = type;
        c->ring_id = ring_id;
        c->tp_peer = arg;
        cmd_push(p, c);
        return 0;
}

int proxy_ring_remove(struct proxy *p, uint64_t ring_id) {
        if (!p)
                return -EINVAL;
        return ring_cmd(p, CMD_RING_REMOVE, ring_id, 0);
}

int proxy_route_drop(struct proxy *p, uint64_t ring_id, uint32_t route) {
        if (!p || route >= PROXY_MAX_ROUTES)
                return -EINVAL;
        return ring_cmd(p, CMD_ROUTE_DROP, ring_id, route);
}

/* The transport peers held under `name` (all of them when NULL), and of
 * those how many are connected and how many drain. */
static uint32_t owners_count(const struct proxy *p, const char *name, uint32_t *ret_connected,
                             uint32_t *ret_draining) {
        uint32_t held = 0, connected = 0;

        for (uint32_t i = 0; i < TP_MAX_PEERS; i++) {
                const struct peer_owner *o = &p->owners[i];

                if (!o->held || (name && strcmp(o->name, name) != 0))
                        continue;
                held++;
                connected += !o->released && !o->failed;
        }
        *ret_connected = connected;
        *ret_draining = held - connected;
        return held;
}

int proxy_peer_new(struct proxy *p, const char *name, uint32_t *ret_peer, uint32_t *ret_gen, void *ret_blob,
                   size_t *ret_len, char *errmsg) {
        char n[PROXY_PEER_NAME_MAX];
        struct cmd *add, *release;
        struct peer_owner *o = NULL;
        uint32_t connected, draining;
        int r;

        if (!p || !name || !p->ops->peer_new)
                return errmsg_set(errmsg, -EINVAL, "proxy: transport peer: bad arguments");
        snprintf(n, sizeof(n), "%s", name);
        if (owners_count(p, n, &connected, &draining) >= PROXY_PEERS_PER_NAME)
                return errmsg_set(errmsg, -EUSERS,
                                  "proxy %s: no transport peer for %s: it holds %u already (%u connected, %u "
                                  "failed and not freed yet); at most %d per daemon",
                                  p->name, n, connected + draining, connected, draining,
                                  PROXY_PEERS_PER_NAME);
        for (uint32_t i = 0; i < TP_MAX_PEERS && !o; i++)
                if (!p->owners[i].held)
                        o = &p->owners[i];
        if (!o) {
                owners_count(p, NULL, &connected, &draining);
                return errmsg_set(errmsg, -ENOSPC,
                                  "proxy %s: no transport peer for %s: all %d are held (%u connected, %u "
                                  "failed and not freed yet)",
                                  p->name, n, TP_MAX_PEERS, connected, draining);
        }
        add = calloc(1, sizeof(*add));
        release = calloc(1, sizeof(*release));
        if (!add || !release) {
                free(add);
                free(release);
                return errmsg_set(errmsg, -ENOMEM, "proxy %s: transport peer for %s: out of memory", p->name,
                                  n);
        }
        r = p->ops->peer_new(p->tp, (uint32_t)(o - p->owners), ret_blob, ret_len, errmsg);
        if (r < 0) {
                free(add);
                free(release);
                return r;
        }
        if (++o->gen == 0) /* generation 0 is never handed out: a zeroed route names none */
                o->gen = 1;
        o->held = true;
        o->released = o->failed = false;
        o->release = release;
        memcpy(o->name, n, sizeof(n));
        add->type = CMD_PEER_ADD;
        add->tp_peer = (uint32_t)(o - p->owners);
        add->gen = o->gen;
        memcpy(add->name, n, sizeof(n));
        *ret_peer = add->tp_peer;
        *ret_gen = o->gen;
        cmd_push(p, add); /* the thread's from here on: not to be read again */
        return 0;
}

/* The owner's record of (`tp_peer`, `gen`) while it may still use it, or
 * NULL. */
static struct peer_owner *owner_get(struct proxy *p, uint32_t tp_peer, uint32_t gen) {
        struct peer_owner *o = tp_peer < TP_MAX_PEERS ? &p->owners[tp_peer] : NULL;

        return o && o->held && o->gen == gen && !o->released ? o : NULL;
}

int proxy_peer_connect(struct proxy *p, uint32_t tp_peer, uint32_t gen, const void *blob, size_t len,
                       char *errmsg) {
        if (!p)
                return errmsg_set(errmsg, -EINVAL, "proxy: transport peer: bad arguments");
        if (!owner_get(p, tp_peer, gen))
                return errmsg_set(errmsg, -ESTALE,
                                  "proxy %s: transport peer %u generation %u: not held (let go already)",
                                  p->name, tp_peer, gen);
        return p->ops->peer_connect(p->tp, tp_peer, blob, len, errmsg);
}

int proxy_peer_fail(struct proxy *p, uint32_t tp_peer, uint32_t gen, int error) {
        struct peer_owner *o;
        struct cmd *c;

        if (!p || tp_peer >= TP_MAX_PEERS || error >= 0)
                return -EINVAL;
        o = owner_get(p, tp_peer, gen);
        if (!o)
                return -ESTALE;
        o->released = true;
        c = o->release;
        o->release = NULL;
        c->type = CMD_PEER_FAIL;
        c->tp_peer = tp_peer;
        c->gen = gen;
        c->error = error;
        cmd_push(p, c);
        return 0;
}

void proxy_peers_count(const struct proxy *p, uint32_t *ret_connected, uint32_t *ret_draining) {
        *ret_connected = *ret_draining = 0;
        if (p)
                owners_count(p, NULL, ret_connected, ret_draining);
}

int proxy_event_fd(const struct proxy *p) {
        return p->event_fd;
}

bool proxy_event_next(struct proxy *p, struct proxy_event *ret) {
        struct evt *e;
        uint64_t v;

        pthread_mutex_lock(&p->lock);
        e = TAILQ_FIRST(&p->events);
        if (e)
                TAILQ_REMOVE(&p->events, e, entry);
        else if (read(p->event_fd, &v, sizeof(v)) < 0) {
                /* EAGAIN: already reset. */
        }
        pthread_mutex_unlock(&p->lock);
        if (!e)
                return false;
        *ret = e->ev;
        free(e);
        /* The owners' record follows what the thread did with a peer. */
        if (ret->tp_peer < TP_MAX_PEERS && p->owners[ret->tp_peer].gen == ret->tp_gen) {
                if (ret->type == PROXY_EVENT_PEER_FAILED)
                        p->owners[ret->tp_peer].failed = true;
                else if (ret->type == PROXY_EVENT_PEER_FREED)
                        p->owners[ret->tp_peer].held = false;
        }
        return true;
}

void proxy_stats_get(const struct proxy *p, struct proxy_stats *ret) {
        ret->descriptors = atomic_load_explicit(&p->stats.descriptors, memory_order_relaxed);
        ret->writes = atomic_load_explicit(&p->stats.writes, memory_order_relaxed);
        ret->completions = atomic_load_explicit(&p->stats.completions, memory_order_relaxed);
        ret->eagain = atomic_load_explicit(&p->stats.eagain, memory_order_relaxed);
        ret->stale = atomic_load_explicit(&p->stats.stale, memory_order_relaxed);
        ret->cancelled = atomic_load_explicit(&p->stats.cancelled, memory_order_relaxed);
}

/* ------------------------------------------------------------ the thread */

/* The proxy thread polls the rings, starts their descriptors as transport
 * writes, handles completions, timeouts and failed peers, and runs the
 * commands the loop thread queues. */

static uint64_t now_ns(void) {
        struct timespec ts;

        clock_gettime(CLOCK_MONOTONIC, &ts);
        return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* Queues an event for the daemon's loop. `fmt` says what happened; the
 * message gets the proxy's name in front of it. */
static void event_push(struct proxy *p, enum proxy_event_type type, uint64_t ring_id, uint32_t tp_peer,
                       uint32_t tp_gen, int error, const char *fmt, ...)
        __attribute__((format(printf, 7, 8)));

static void event_push(struct proxy *p, enum proxy_event_type type, uint64_t ring_id, uint32_t tp_peer,
                       uint32_t tp_gen, int error, const char *fmt, ...) {
        struct evt *e = calloc(1, sizeof(*e));
        uint64_t one = 1;
        va_list ap;
        int n;

        if (!e)
                return; /* the ring's error word still tells the client */
        e->ev.type = type;
        e->ev.ring_id = ring_id;
        e->ev.tp_peer = tp_peer;
        e->ev.tp_gen = tp_gen;
        e->ev.error = error;
        /* The proxy's name, then what happened: a reader that names the
         * proxy otherwise takes only the latter (ev.what). */
        n = snprintf(e->ev.msg, sizeof(e->ev.msg), "proxy %s: ", p->name);
        e->ev.what = n < 0 ? 0 : (size_t)n < sizeof(e->ev.msg) ? (size_t)n : sizeof(e->ev.msg) - 1;
        va_start(ap, fmt);
        vsnprintf(e->ev.msg + e->ev.what, sizeof(e->ev.msg) - e->ev.what, fmt, ap);
        va_end(ap);
        pthread_mutex_lock(&p->lock);
        TAILQ_INSERT_TAIL(&p->events, e, entry);
        pthread_mutex_unlock(&p->lock);
        if (write(p->event_fd, &one, sizeof(one)) < 0) {
                /* The counter cannot overflow at one per event; nothing to do. */
        }
}

/* Records the first failure of a ring in its shared header (rule 5). */
static void ring_set_error(struct ring *ring, uint64_t seq, uint32_t route, int error) {
        if (LOAD_ACQ(&ring->hdr->error) != 0)
                return;
        ring->hdr->error_peer = route;
        ring->hdr->error_seq = seq;
        STORE_REL(&ring->hdr->error, error);
}

/* Descriptor `seq` of `ring` has no write left: advance done in order
 * (rule 4). */
static void ring_finish(struct ring *ring, uint64_t seq) {
        ring->finished[seq & ring->mask] = 1;
        if (seq != ring->done)
                return;
        while (ring->finished[ring->done & ring->mask]) {
                ring->finished[ring->done & ring->mask] = 0;
                ring->done++;
        }
        STORE_REL(&ring->hdr->done, ring->done);
}

static void slot_release(struct proxy *p, uint32_t i) {
        struct slot *s = &p->slots[i];
        struct peer *pp = &p->peers[s->tp_peer];

        s->state = SLOT_FREE;
        p->free_slots[p->nfree++] = i;
        if (--pp->inflight == 0 && pp->state == PEER_DRAINING)
                p->drain_due = true;
}

/* The cookie of slot i's data (k 0) or signal (k 1) write. */
static uint64_t slot_cookie(const struct proxy *p, uint32_t i, uint32_t k) {
        return (uint64_t)p->slots[i].gen << 32 | (i * 2 + k);
}

/* The slot's descriptor is over (success or not); the slot itself is freed
 * unless a write of it may still complete. */
static void slot_finish(struct proxy *p, uint32_t i, bool abandon) {
        struct slot *s = &p->slots[i];

        s->ring->inflight--;
        s->ring->inflight_bytes -= s->length;
        ring_finish(s->ring, s->seq);
        s->ring = NULL;
        if (abandon && s->pending > 0)
                s->state = SLOT_ABANDONED;
        else
                slot_release(p, i);
}

/* Transport peer `tp_peer` failed (proxy.h, "Transport peers", steps 1
 * and 2): its routes are marked dead, its descriptors in flight end, the
 * transport stops what is on its way, and its writes drain from here. */
static void peer_failed(struct proxy *p, uint32_t tp_peer, int error, const char *why) {
        struct peer *pp = tp_peer < TP_MAX_PEERS ? &p->peers[tp_peer] : NULL;
        struct ring *ring;

        if (!pp || pp->state != PEER_LIVE)
                return;
        pp->state = PEER_DRAINING;
        pp->error = error;
        pp->failed_ns = now_ns();
        p->ndraining++;
        /* First the routes: nothing is posted to this generation again. */
        TAILQ_FOREACH (ring, &p->rings, entry)
                for (uint32_t r = 0; r < ring->nroutes; r++)
                        if (ring->routes[r].tp_peer == tp_peer && ring->routes[r].tp_gen == pp->gen &&
                            !ring->rstate[r].error) {
                                ring->rstate[r].error = error;
                                ring_set_error(ring, ring->head, r, error);
                        }
        /* Nothing more will arrive from or for this peer: end its
         * descriptors now so that done advances and removals finish. Their
         * slots wait for the writes (abandoned) while the peer drains. */
        for (uint32_t i = 0; i < p->params.max_inflight; i++)
                if (p->slots[i].state == SLOT_BUSY && p->slots[i].tp_peer == tp_peer) {
                        ring_set_error(p->slots[i].ring, p->slots[i].seq, p->slots[i].route, error);
                        p->slots[i].need_signal = false;
                        slot_finish(p, i, true);
                }
        /* The transport ends what is on its way (verbs flushes the QP)
         * and drops what need not wait for peer_free (cuda: imports of
         * the other daemon's GPU memory). */
        if (p->ops->peer_fail)
                p->ops->peer_fail(p->tp, tp_peer);
        event_push(p, PROXY_EVENT_PEER_FAILED, 0, tp_peer, pp->gen, error,
                   "transport peer %u (%s, generation %u) failed: %s (%s)", tp_peer, pp->name, pp->gen,
                   strerror(-error), why);
        p->drain_due = true;
}

/* Step 2's end: the writes of draining peer `tp_peer` still in flight after
 * timeout_ms are given up on; their slots go back (a completion that
 * comes later names the old slot generation and is ignored). */
static void peer_cancel(struct proxy *p, uint32_t tp_peer) {
        struct peer *pp = &p->peers[tp_peer];
        uint32_t n = 0;

        for (uint32_t i = 0; i < p->params.max_inflight && pp->inflight; i++)
                if (p->slots[i].state == SLOT_ABANDONED && p->slots[i].tp_peer == tp_peer) {
                        slot_release(p, i);
                        n++;
                }
        pp->cancelled += n;
        atomic_fetch_add_explicit(&p->stats.cancelled, n, memory_order_relaxed);
}

/* Step 3: transport peer `tp_peer`, drained and let go by its owner, is
 * freed; its index may be handed out again. Its generation and error stay
 * for what names them later (an old route). */
static void peer_free(struct proxy *p, uint32_t tp_peer) {
        struct peer *pp = &p->peers[tp_peer];

        if (p->ops->peer_free)
                p->ops->peer_free(p->tp, tp_peer);
        pp->state = PEER_FREE;
        p->ndraining--;
        if (pp->cancelled)
                event_push(p, PROXY_EVENT_PEER_FREED, 0, tp_peer, pp->gen, 0,
                           "transport peer %u (%s, generation %u) freed: %u writes to it never completed "
                           "and were given up on",
                           tp_peer, pp->name, pp->gen, pp->cancelled);
        else
                event_push(p, PROXY_EVENT_PEER_FREED, 0, tp_peer, pp->gen, 0,
                           "transport peer %u (%s, generation %u) freed", tp_peer, pp->name, pp->gen);
}

/* Moves the failed peers on: drained once nothing of theirs is in
 * flight (their in-flight writes cancelled timeout_ms after the failure),
 * then freed once their owner let go too. */
static void peers_drain(struct proxy *p, uint64_t now) {
        uint64_t limit = (uint64_t)p->params.timeout_ms * 1000000u;

        p->drain_due = false;
        for (uint32_t i = 0; i < TP_MAX_PEERS && p->ndraining; i++) {
                struct peer *pp = &p->peers[i];

                if (pp->state == PEER_DRAINING && pp->inflight && now - pp->failed_ns > limit)
                        peer_cancel(p, i);
                if (pp->state == PEER_DRAINING && !pp->inflight)
                        pp->state = PEER_DRAINED;
                if (pp->state == PEER_DRAINED && pp->released)
                        peer_free(p, i);
        }
}

static void ring_bad_desc(struct proxy *p, struct ring *ring, uint64_t seq, uint32_t route, int error,
                          const char *what) {
        ring_set_error(ring, seq, route, error);
        if (!ring->reported) {
                ring->reported = true;
                event_push(p, PROXY_EVENT_RING_ERROR, ring->id, UINT32_MAX, 0, error,
                           "ring %" PRIu64 " descriptor %" PRIu64 " (peer %u): %s", ring->id, seq, route,
                           what);
        }
}

/* A post for slot i failed at once with `r` (not -EAGAIN): a range outside
 * a region fails the descriptor; anything else is the transport giving up
 * on the peer (e.g. -ECONNRESET once its connection is gone). */
static void post_failed(struct proxy *p, uint32_t i, int r) {
        struct slot *s = &p->slots[i];
        uint32_t tp_peer = s->tp_peer;

        if (r == -EINVAL)
                ring_bad_desc(p, s->ring, s->seq, s->route, r, "range outside a region");
        if (s->pending == 0)
                slot_finish(p, i, false);
        if (r != -EINVAL)
                peer_failed(p, tp_peer, r, "the transport refused a write");
}

static int post_signal(struct proxy *p, uint32_t i, const struct proxy_route *route, uint32_t signal_id) {
        return p->ops->write(p->tp, route->tp_peer, p->staging_mr, (uint64_t)i * 8, &route->counters,
                             (uint64_t)signal_id * 8, 8, slot_cookie(p, i, 1), 0, TP_WRITE_ORDERED);
}

/* Descriptor `seq` of `ring` names route `r`, whose transport peer failed
 * (or an older generation of its index): it fails the ring at once, and
 * the first on each route is told, naming ring, route and peer. Not a
 * RING_ERROR: the writer did nothing wrong, the other daemon went (and
 * the mesh's loss of it ends the job, or an elastic job goes on). */
static void route_dead(struct proxy *p, struct ring *ring, uint64_t seq, uint32_t r) {
        const struct proxy_route *route = &ring->routes[r];
        struct route_state *rs = &ring->rstate[r];
        const struct peer *pp = &p->peers[route->tp_peer];

        ring_set_error(ring, seq, r, rs->error);
        if (rs->told)
                return;
        rs->told = true;
        if (pp->gen == route->tp_gen)
                event_push(p, PROXY_EVENT_ROUTE_DEAD, ring->id, route->tp_peer, route->tp_gen, rs->error,
                           "ring %" PRIu64 " route %u: transport peer %u (%s, generation %u) failed (%s): "
                           "descriptor %" PRIu64 " and every later one on this route refused",
                           ring->id, r, route->tp_peer, pp->name, route->tp_gen, strerror(-rs->error), seq);
        else
                event_push(p, PROXY_EVENT_ROUTE_DEAD, ring->id, route->tp_peer, route->tp_gen, rs->error,
                           "ring %" PRIu64 " route %u: transport peer %u generation %u is gone (the index "
                           "serves generation %u now): descriptor %" PRIu64
                           " and every later one on this route refused",
                           ring->id, r, route->tp_peer, route->tp_gen, pp->gen, seq);
}

/* The most slots one ring may hold now: an equal part among the rings that
 * have work (all of them for a ring alone; idle rings take nothing). */
static uint32_t ring_share(const struct proxy *p) {
        uint32_t share = p->params.max_inflight / (p->nactive > 1 ? p->nactive : 1);

        return share > PROXY_RING_MIN_SLOTS ? share : PROXY_RING_MIN_SLOTS;
}

/* Starts descriptor `seq`. Returns 0 when it is consumed (posted, or failed
 * and finished) or -EAGAIN to try it again later. */
static int desc_start(struct proxy *p, struct ring *ring, uint64_t seq, const struct proxy_desc *d) {
        const struct proxy_route *route;
        struct slot *s;
        uint32_t i;
        int r;

        if (d->peer >= ring->nroutes || (d->flags & ~(uint32_t)PROXY_DESC_SIGNAL) ||
            (d->length == 0 && !(d->flags & PROXY_DESC_SIGNAL))) {
                ring_bad_desc(p, ring, seq, d->peer, -EINVAL,
                              d->peer >= ring->nroutes ? "peer out of range" : "bad flags or empty");
                ring_finish(ring, seq);
                return 0;
        }
        route = &ring->routes[d->peer];
        if (route->tp_peer == PROXY_ROUTE_GONE) {
                ring_bad_desc(p, ring, seq, d->peer, -EINVAL,
                              "the receiving rank released its region (or left the job)");
                ring_finish(ring, seq);
                return 0;
        }
        if (route->tp_peer == PROXY_ROUTE_NONE) {
                ring_bad_desc(p, ring, seq, d->peer, -EINVAL,
                              "peer not routed: a rank at the ring's own daemon (NVLink reaches it)");
                ring_finish(ring, seq);
                return 0;
        }
        /* A route to a failed peer was marked dead when it failed (or when
         * the ring came); the generation check refuses anything older
         * whatever happened since. */
        if (!ring->rstate[d->peer].error && p->peers[route->tp_peer].gen != route->tp_gen)
                ring->rstate[d->peer].error = -ENOTCONN;
        if (ring->rstate[d->peer].error) {
                route_dead(p, ring, seq, d->peer);
                ring_finish(ring, seq);
                return 0;
        }
        /* Back-pressure on this ring alone: past its share of the slots,
         * or of bytes in flight, it waits for its own writes. */
        if (p->nfree == 0 || ring->inflight >= ring_share(p) ||
            (ring->inflight && ring->inflight_bytes + d->length > PROXY_RING_INFLIGHT_BYTES))
                return -EAGAIN;
        i = p->free_slots[--p->nfree];
        s = &p->slots[i];
        *s = (struct slot){ .state = SLOT_BUSY,
                            .gen = s->gen + 1,
                            .ring = ring,
                            .seq = seq,
                            .route = d->peer,
                            .tp_peer = route->tp_peer,
                            .length = d->length };
        p->peers[route->tp_peer].inflight++;
        ring->inflight++;
        ring->inflight_bytes += d->length;
        if (d->length) {
                r = p->ops->write(p->tp, route->tp_peer, ring->src, d->src_offset, &route->data,
                                  d->dst_offset, d->length, slot_cookie(p, i, 0), 0, 0);
                if (r == -EAGAIN) {
                        atomic_fetch_add_explicit(&p->stats.eagain, 1, memory_order_relaxed);
                        ring->inflight--;
                        ring->inflight_bytes -= d->length;
                        slot_release(p, i);
                        return -EAGAIN;
                }
                if (r < 0) {
                        post_failed(p, i, r);
                        return 0;
                }
                s->pending++;
                atomic_fetch_add_explicit(&p->stats.writes, 1, memory_order_relaxed);
        }
        s->posted_ns = 0; /* stamped by the timeout scan */
        if (d->flags & PROXY_DESC_SIGNAL) {
                p->staging[i] = d->signal_value;
                s->need_signal = true;
                s->signal_id = d->signal_id;
                r = post_signal(p, i, route, d->signal_id);
                if (r == -EAGAIN) {
                        atomic_fetch_add_explicit(&p->stats.eagain, 1, memory_order_relaxed);
                        p->retry[p->nretry++] = i;
                        return 0;
                }
                s->need_signal = false;
                if (r < 0) {
                        post_failed(p, i, r);
                        return 0;
                }
                s->pending++;
                atomic_fetch_add_explicit(&p->stats.writes, 1, memory_order_relaxed);
        }
        return 0;
}

/* Posts the signal writes that the transport refused earlier. */
static int retry_signals(struct proxy *p) {
        uint32_t kept = 0, n = p->nretry;
        int r;

        for (uint32_t k = 0; k < n; k++) {
                uint32_t i = p->retry[k];
                struct slot *s = &p->slots[i];

                if (s->state != SLOT_BUSY || !s->need_signal)
                        continue;
                r = post_signal(p, i, &s->ring->routes[s->route], s->signal_id);
                if (r == -EAGAIN) {
                        p->retry[kept++] = i;
                        continue;
                }
                s->need_signal = false;
                if (r < 0) {
                        post_failed(p, i, r);
                        continue;
                }
                s->pending++;
                atomic_fetch_add_explicit(&p->stats.writes, 1, memory_order_relaxed);
        }
        p->nretry = kept;
        return (int)(n - kept);
}

/* Takes up to `batch` descriptors from one ring (rules 1-3); counts it in
 * `active` when it has slots busy or descriptors left. */
static int ring_poll(struct proxy *p, struct ring *ring, uint32_t *active) {
        uint64_t tail;
        uint32_t n = 0;

        if (ring->removing) {
                if (ring->inflight == 0) {
                        uint64_t id = ring->id;

                        TAILQ_REMOVE(&p->rings, ring, entry);
                        ring_drop(p, ring);
                        event_push(p, PROXY_EVENT_RING_REMOVED, id, UINT32_MAX, 0, 0,
                                   "ring %" PRIu64 " removed", id);
                        return 1;
                }
                return 0;
        }
        tail = LOAD_ACQ(&ring->hdr->tail);
        while (ring->head != tail && n < p->params.batch && ring->head - ring->done < ring->cap) {
                struct proxy_desc d = ring->desc[ring->head & ring->mask];

                if (desc_start(p, ring, ring->head, &d) < 0)
                        break;
                ring->head++;
                n++;
        }
        ring->waiting = ring->head != tail;
        if (ring->inflight || ring->waiting)
                (*active)++;
        if (n) {
                STORE_REL(&ring->hdr->head, ring->head);
                atomic_fetch_add_explicit(&p->stats.descriptors, n, memory_order_relaxed);
        }
        return (int)n;
}

/* Whether a completion's error is about that write alone (a key or range
 * the target refused) rather than the connection: the transports say so
 * with these (tp-cuda: -EACCES for a key its peer does not know). */
static bool completion_error_is_write_s(int status) {
        return status == -EINVAL || status == -EACCES || status == -EPERM || status == -EFAULT ||
               status == -ENOKEY || status == -ERANGE;
}

static void complete(struct proxy *p, const struct tp_completion *c) {
        uint32_t i = (uint32_t)c->cookie / 2;
        struct slot *s;

        if (c->remote || i >= p->params.max_inflight)
                return;
        s = &p->slots[i];
        atomic_fetch_add_explicit(&p->stats.completions, 1, memory_order_relaxed);
        /* A write given up on (its peer failed and drained without it):
         * its slot went back, and may serve another peer's write now. */
        if (s->state == SLOT_FREE || s->gen != (uint32_t)(c->cookie >> 32)) {
                atomic_fetch_add_explicit(&p->stats.stale, 1, memory_order_relaxed);
                return;
        }
        if (s->state == SLOT_ABANDONED) {
                if (--s->pending == 0)
                        slot_release(p, i);
                return;
        }
        s->pending--;
        if (c->status < 0) {
                /* An error about this write alone (a key or a range the
                 * target refused) fails the write's own ring: its job
                 * ends, naming the writer. Any other (the connection) fails
                 * the peer, and with it every ring routing there, naming
                 * no writer: when the peer is another daemon that died, an
                 * elastic job goes on without its ranks, and a writer here
                 * did nothing wrong (blaming it, a survivor was masked). */
                if (completion_error_is_write_s(c->status)) {
                        ring_bad_desc(p, s->ring, s->seq, s->route, c->status,
                                      "a write completed with an error");
                        s->need_signal = false;
                        slot_finish(p, i, true);
                        return;
                }
                peer_failed(p, s->tp_peer, c->status, "write completed with an error");
                return; /* peer_failed ended the slot */
        }
        if (s->pending == 0 && !s->need_signal)
                slot_finish(p, i, false);
}

/* Fails the rings of writes older than timeout_ms. A slot is stamped on the
 * first scan that sees it, so the bound is timeout_ms plus one scan period.
 * Only the ring that posted the write fails (its job ends, naming its rank):
 * a slow write is a tenant's doing as often as the connection's (a flood of
 * large descriptors), and failing the transport peer would abort every job
 * between the two daemons. A dead connection shows as a completion error or
 * the mesh's loss of the peer (proxy_peer_fail()). The slot stays busy, and
 * counted in its ring, until its writes complete or the peer fails: the
 * ring (and so its send region) is not removed while the transport may
 * still read from it. A slot abandoned with a write still out (its other
 * write failed alone) counts the same towards the 10 timeouts: else a write
 * that never completes would hold its slot for as long as its peer lives. */
static void scan_timeouts(struct proxy *p, uint64_t now) {
        uint64_t limit = (uint64_t)p->params.timeout_ms * 1000000u;

        for (uint32_t i = 0; i < p->params.max_inflight; i++) {
                struct slot *s = &p->slots[i];

                if (s->state == SLOT_FREE)
                        continue;
                if (s->posted_ns == 0)
                        s->posted_ns = now;
                else if (s->state == SLOT_BUSY && !s->late && now - s->posted_ns > limit) {
                        s->late = true;
                        ring_bad_desc(p, s->ring, s->seq, s->route, -ETIMEDOUT,
                                      "write not completed in time");
                } else if ((s->late || s->state == SLOT_ABANDONED) &&
                           now - s->posted_ns > PROXY_DEAD_TIMEOUTS * limit)
                        /* Not one tenant's backlog any more (the fair
                         * share bounds that): the connection is taken for
                         * dead, or every ring to it would go late in turn
                         * and hold the slots of every tenant. */
                        peer_failed(p, s->tp_peer, -ETIMEDOUT,
                                    "a write not completed in 10 times the timeout");
        }
}

/* A ring comes: its routes to a peer that is not live in the generation
 * they name are dead from the start (the peer failed between the route's
 * making and now), and its error word says so. */
static void ring_routes_check(struct proxy *p, struct ring *ring) {
        for (uint32_t r = 0; r < ring->nroutes; r++) {
                const struct proxy_route *route = &ring->routes[r];
                const struct peer *pp;

                if (route->tp_peer >= TP_MAX_PEERS) /* PROXY_ROUTE_NONE */
                        continue;
                pp = &p->peers[route->tp_peer];
                if (pp->state == PEER_LIVE && pp->gen == route->tp_gen)
                        continue;
                ring->rstate[r].error = pp->gen == route->tp_gen && pp->error ? pp->error : -ENOTCONN;
                ring_set_error(ring, ring->head, r, ring->rstate[r].error);
        }
}

static void run_commands(struct proxy *p) {
        TAILQ_HEAD(, cmd) todo = TAILQ_HEAD_INITIALIZER(todo);
        struct cmd *c;
        struct ring *ring;
        struct peer *pp;

        pthread_mutex_lock(&p->lock);
        TAILQ_CONCAT(&todo, &p->cmds, entry);
        atomic_store(&p->ncmds, 0);
        pthread_mutex_unlock(&p->lock);
        while ((c = TAILQ_FIRST(&todo))) {
                TAILQ_REMOVE(&todo, c, entry);
                switch (c->type) {
                case CMD_RING_ADD:
                        TAILQ_INSERT_TAIL(&p->rings, c->ring, entry);
                        ring_routes_check(p, c->ring);
                        break;
                case CMD_RING_REMOVE:
                        TAILQ_FOREACH (ring, &p->rings, entry)
                                if (ring->id == c->ring_id)
                                        ring->removing = true;
                        break;
                case CMD_PEER_ADD:
                        pp = &p->peers[c->tp_peer];
                        assert(pp->state == PEER_FREE && pp->inflight == 0);
                        *pp = (struct peer){ .state = PEER_LIVE, .gen = c->gen };
                        memcpy(pp->name, c->name, sizeof(pp->name));
                        break;
                case CMD_PEER_FAIL:
                        pp = &p->peers[c->tp_peer];
                        if (pp->gen != c->gen || pp->released)
                                break;
                        pp->released = true;
                        peer_failed(p, c->tp_peer, c->error, "reported by the daemon");
                        p->drain_due = true;
                        break;
                case CMD_ROUTE_DROP:
                        TAILQ_FOREACH (ring, &p->rings, entry)
                                if (ring->id == c->ring_id && c->tp_peer < ring->nroutes &&
                                    ring->routes[c->tp_peer].tp_peer != PROXY_ROUTE_NONE)
                                        ring->routes[c->tp_peer].tp_peer = PROXY_ROUTE_GONE;
                        break;
                }
                free(c);
        }
}

/* The proxy thread's body; proxy_new() starts it with `p` and proxy_free()
 * stops it through p->stop. */
static void *proxy_main(void *arg) {
        struct proxy *p = arg;
        struct tp_completion comps[PROXY_POLL_MAX];
        uint32_t idle = 0;
        uint64_t iter = 0;

        while (!atomic_load_explicit(&p->stop, memory_order_relaxed)) {
                struct ring *ring, *next;
                uint32_t active = 0;
                int work = 0, n;

                if (atomic_load_explicit(&p->ncmds, memory_order_acquire))
                        run_commands(p);
                if (p->nretry)
                        work += retry_signals(p);
                TAILQ_FOREACH_SAFE (ring, &p->rings, entry, next)
                        work += ring_poll(p, ring, &active);
                /* The next pass starts at the next ring: with more rings
                 * busy than slots / 16 (the least share) the shares add up
                 * to more than the slots, and a fixed order gave the first
                 * rings every slot that came free. */
                if ((ring = TAILQ_FIRST(&p->rings)) && TAILQ_NEXT(ring, entry)) {
                        TAILQ_REMOVE(&p->rings, ring, entry);
                        TAILQ_INSERT_TAIL(&p->rings, ring, entry);
                }
                p->nactive = active;
                n = p->ops->poll(p->tp, comps, PROXY_POLL_MAX);
                for (int k = 0; k < n; k++)
                        complete(p, &comps[k]);
                if (n > 0)
                        work += n;
                if (p->drain_due)
                        peers_drain(p, now_ns());
                if ((++iter & 1023) == 0) {
                        uint64_t now = now_ns();

                        if (now - p->last_scan_ns > 1000000u) {
                                p->last_scan_ns = now;
                                scan_timeouts(p, now);
                                if (p->ndraining)
                                        peers_drain(p, now);
                        }
                }
                if (work) {
                        idle = 0;
                } else if (p->params.idle_spins != UINT32_MAX && ++idle > p->params.idle_spins) {
                        struct timespec ts = { 0, 20000 };

                        nanosleep(&ts, NULL);
                        iter |= 1023; /* sleeping loops are slow: scan on the next one */
                }
        }
        return NULL;
}
