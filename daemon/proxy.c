/* The internode proxy; see proxy.h for the ring layout and the ordering
 * rules. The thread owns the rings, the slots and the staging words; the
 * loop thread reaches it only through the command queue (cmd_fd) and reads
 * what it reports through the event queue (event_fd). This file is the loop
 * thread's side (ring creation, proxy_new/proxy_free, the queues); the
 * thread itself is in proxy-ring.c. */
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

#include "proxy-internal.h"

const char *proxy_event_type_to_string(enum proxy_event_type t) {
        switch (t) {
        case PROXY_EVENT_RING_REMOVED:
                return "ring-removed";
        case PROXY_EVENT_PEER_FAILED:
                return "peer-failed";
        case PROXY_EVENT_RING_ERROR:
                return "ring-error";
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

void ring_drop(struct proxy *p, struct ring *ring) {
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
        free(ring);
}

/* Frees what proxy_new allocated besides the thread, the staging
 * registration and the queues; then `p` itself. */
static void proxy_arrays_free(struct proxy *p) {
        free(p->slots);
        free(p->free_slots);
        free(p->retry);
        free(p->peer_error);
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
        p->peer_error = calloc(PROXY_MAX_TP_PEERS, sizeof(*p->peer_error));
        if (posix_memalign((void **)&p->staging, 4096, (size_t)p->params.max_inflight * 8) != 0)
                p->staging = NULL;
        if (!p->slots || !p->free_slots || !p->retry || !p->peer_error || !p->staging) {
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
                if (routes[i].tp_peer >= PROXY_MAX_TP_PEERS && routes[i].tp_peer != PROXY_ROUTE_NONE)
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
        if (!ring->finished || !ring->routes) {
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

int proxy_peer_fail(struct proxy *p, uint32_t tp_peer, int error) {
        struct cmd *c;

        if (!p || tp_peer >= PROXY_MAX_TP_PEERS || error >= 0)
                return -EINVAL;
        c = calloc(1, sizeof(*c));
        if (!c)
                return -ENOMEM;
        c->type = CMD_PEER_FAIL;
        c->tp_peer = tp_peer;
        c->error = error;
        cmd_push(p, c);
        return 0;
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
        return true;
}

void proxy_stats_get(const struct proxy *p, struct proxy_stats *ret) {
        ret->descriptors = atomic_load_explicit(&p->stats.descriptors, memory_order_relaxed);
        ret->writes = atomic_load_explicit(&p->stats.writes, memory_order_relaxed);
        ret->completions = atomic_load_explicit(&p->stats.completions, memory_order_relaxed);
        ret->eagain = atomic_load_explicit(&p->stats.eagain, memory_order_relaxed);
}
