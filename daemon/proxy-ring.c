/* The proxy thread: polls the rings, starts their descriptors as transport
 * writes, handles completions, timeouts and failed peers, and runs the
 * commands the loop thread queues; see proxy.h for the ring layout and the
 * ordering rules, proxy.c for the loop thread's side. */
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

static uint64_t now_ns(void) {
        struct timespec ts;

        clock_gettime(CLOCK_MONOTONIC, &ts);
        return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* Queues an event for the daemon's loop. `fmt` says what happened; the
 * message gets the proxy's name in front of it. */
static void event_push(struct proxy *p, enum proxy_event_type type, uint64_t ring_id, uint32_t tp_peer,
                       int error, const char *fmt, ...) __attribute__((format(printf, 6, 7)));

static void event_push(struct proxy *p, enum proxy_event_type type, uint64_t ring_id, uint32_t tp_peer,
                       int error, const char *fmt, ...) {
        struct evt *e = calloc(1, sizeof(*e));
        uint64_t one = 1;
        va_list ap;
        int n;

        if (!e)
                return; /* the ring's error word still tells the client */
        e->ev.type = type;
        e->ev.ring_id = ring_id;
        e->ev.tp_peer = tp_peer;
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
        p->slots[i].state = SLOT_FREE;
        p->free_slots[p->nfree++] = i;
}

/* The slot's descriptor is over (success or not); the slot itself is freed
 * unless a write of it may still complete. */
static void slot_finish(struct proxy *p, uint32_t i, bool abandon) {
        struct slot *s = &p->slots[i];

        s->ring->inflight--;
        ring_finish(s->ring, s->seq);
        s->ring = NULL;
        if (abandon && s->pending > 0)
                s->state = SLOT_ABANDONED;
        else
                slot_release(p, i);
}

static void peer_failed(struct proxy *p, uint32_t tp_peer, int error, const char *why) {
        struct ring *ring;

        if (tp_peer >= PROXY_MAX_TP_PEERS || p->peer_error[tp_peer])
                return;
        p->peer_error[tp_peer] = error;
        TAILQ_FOREACH (ring, &p->rings, entry)
                for (uint32_t r = 0; r < ring->nroutes; r++)
                        if (ring->routes[r].tp_peer == tp_peer) {
                                ring_set_error(ring, ring->head, r, error);
                                break;
                        }
        /* Nothing more will arrive from or for this peer: end its
         * descriptors now so that done advances and removals finish. */
        for (uint32_t i = 0; i < p->params.max_inflight; i++)
                if (p->slots[i].state == SLOT_BUSY && p->slots[i].tp_peer == tp_peer) {
                        ring_set_error(p->slots[i].ring, p->slots[i].seq, p->slots[i].route, error);
                        p->slots[i].need_signal = false;
                        slot_finish(p, i, true);
                }
        /* The peer is never written to again (peer_error stays): what the
         * transport holds for it (cuda: imports of the other daemon's GPU
         * memory) goes now, not when the transport closes at shutdown. */
        if (p->ops->peer_fail)
                p->ops->peer_fail(p->tp, tp_peer);
        event_push(p, PROXY_EVENT_PEER_FAILED, 0, tp_peer, error, "transport peer %u failed: %s (%s)",
                   tp_peer, strerror(-error), why);
}

static void ring_bad_desc(struct proxy *p, struct ring *ring, uint64_t seq, uint32_t route, int error,
                          const char *what) {
        ring_set_error(ring, seq, route, error);
        if (!ring->reported) {
                ring->reported = true;
                event_push(p, PROXY_EVENT_RING_ERROR, ring->id, UINT32_MAX, error,
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
                             (uint64_t)signal_id * 8, 8, (uint64_t)i * 2 + 1, 0, TP_WRITE_ORDERED);
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
        if (p->peer_error[route->tp_peer]) {
                ring_set_error(ring, seq, d->peer, p->peer_error[route->tp_peer]);
                ring_finish(ring, seq);
                return 0;
        }
        if (p->nfree == 0)
                return -EAGAIN;
        i = p->free_slots[--p->nfree];
        s = &p->slots[i];
        *s = (struct slot){
                .state = SLOT_BUSY, .ring = ring, .seq = seq, .route = d->peer, .tp_peer = route->tp_peer
        };
        ring->inflight++;
        if (d->length) {
                r = p->ops->write(p->tp, route->tp_peer, ring->src, d->src_offset, &route->data,
                                  d->dst_offset, d->length, (uint64_t)i * 2, 0, 0);
                if (r == -EAGAIN) {
                        atomic_fetch_add_explicit(&p->stats.eagain, 1, memory_order_relaxed);
                        ring->inflight--;
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

/* Takes up to `batch` descriptors from one ring (rules 1-3). */
static int ring_poll(struct proxy *p, struct ring *ring) {
        uint64_t tail;
        uint32_t n = 0;

        if (ring->removing) {
                if (ring->inflight == 0) {
                        uint64_t id = ring->id;

                        TAILQ_REMOVE(&p->rings, ring, entry);
                        ring_drop(p, ring);
                        event_push(p, PROXY_EVENT_RING_REMOVED, id, UINT32_MAX, 0, "ring %" PRIu64 " removed",
                                   id);
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
        uint64_t i = c->cookie / 2;
        struct slot *s;

        if (c->remote || i >= p->params.max_inflight)
                return;
        s = &p->slots[i];
        atomic_fetch_add_explicit(&p->stats.completions, 1, memory_order_relaxed);
        if (s->state == SLOT_ABANDONED) {
                if (--s->pending == 0)
                        slot_release(p, (uint32_t)i);
                return;
        }
        if (s->state != SLOT_BUSY)
                return;
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
                        slot_finish(p, (uint32_t)i, true);
                        return;
                }
                peer_failed(p, s->tp_peer, c->status, "write completed with an error");
                return; /* peer_failed ended the slot */
        }
        if (s->pending == 0 && !s->need_signal)
                slot_finish(p, (uint32_t)i, false);
}

/* Fails the peers of writes older than timeout_ms. A slot is stamped on the
 * first scan that sees it, so the bound is timeout_ms plus one scan period. */
static void scan_timeouts(struct proxy *p, uint64_t now) {
        uint64_t limit = (uint64_t)p->params.timeout_ms * 1000000u;

        for (uint32_t i = 0; i < p->params.max_inflight; i++) {
                struct slot *s = &p->slots[i];

                if (s->state != SLOT_BUSY)
                        continue;
                if (s->posted_ns == 0)
                        s->posted_ns = now;
                else if (now - s->posted_ns > limit)
                        peer_failed(p, s->tp_peer, -ETIMEDOUT, "write not completed in time");
        }
}

static void run_commands(struct proxy *p) {
        TAILQ_HEAD(, cmd) todo = TAILQ_HEAD_INITIALIZER(todo);
        struct cmd *c;
        struct ring *ring;

        pthread_mutex_lock(&p->lock);
        TAILQ_CONCAT(&todo, &p->cmds, entry);
        atomic_store(&p->ncmds, 0);
        pthread_mutex_unlock(&p->lock);
        while ((c = TAILQ_FIRST(&todo))) {
                TAILQ_REMOVE(&todo, c, entry);
                switch (c->type) {
                case CMD_RING_ADD:
                        TAILQ_INSERT_TAIL(&p->rings, c->ring, entry);
                        for (uint32_t r = 0; r < c->ring->nroutes; r++)
                                if (c->ring->routes[r].tp_peer != PROXY_ROUTE_NONE &&
                                    p->peer_error[c->ring->routes[r].tp_peer]) {
                                        ring_set_error(c->ring, c->ring->head, r,
                                                       p->peer_error[c->ring->routes[r].tp_peer]);
                                        break;
                                }
                        break;
                case CMD_RING_REMOVE:
                        TAILQ_FOREACH (ring, &p->rings, entry)
                                if (ring->id == c->ring_id)
                                        ring->removing = true;
                        break;
                case CMD_PEER_FAIL:
                        peer_failed(p, c->tp_peer, c->error, "reported by the daemon");
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

void *proxy_main(void *arg) {
        struct proxy *p = arg;
        struct tp_completion comps[PROXY_POLL_MAX];
        uint32_t idle = 0;
        uint64_t iter = 0;

        while (!atomic_load_explicit(&p->stop, memory_order_relaxed)) {
                struct ring *ring, *next;
                int work = 0, n;

                if (atomic_load_explicit(&p->ncmds, memory_order_acquire))
                        run_commands(p);
                if (p->nretry)
                        work += retry_signals(p);
                TAILQ_FOREACH_SAFE (ring, &p->rings, entry, next)
                        work += ring_poll(p, ring);
                n = p->ops->poll(p->tp, comps, PROXY_POLL_MAX);
                for (int k = 0; k < n; k++)
                        complete(p, &comps[k]);
                if (n > 0)
                        work += n;
                if ((++iter & 1023) == 0) {
                        uint64_t now = now_ns();

                        if (now - p->last_scan_ns > 1000000u) {
                                p->last_scan_ns = now;
                                scan_timeouts(p, now);
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
