/* The proxy's transport peers (daemon/datapath/proxy.h, "Transport peers")
 * over the held transport (held-tp.h), whose writes complete when the test
 * says:
 *  - a failed peer's index is handed out again only once its writes
 *    drained (completed, or given up on after timeout_ms) and its owner
 *    let it go, with the next generation;
 *  - an old ring's descriptors on a route to the failed generation are
 *    refused and told (ring, route, peer), also once the index serves
 *    another peer, which gets none of them; a ring added with the old
 *    route is refused the same; completions of the given-up writes that
 *    come after the slots were taken by the new peer's writes are ignored;
 *  - a peer the proxy fails itself waits for its owner;
 *  - a write left out by a descriptor whose other write failed alone
 *    fails its peer after 10 timeouts, as a late write does;
 *  - at most PROXY_PEERS_PER_NAME per name and TP_MAX_PEERS in all, with
 *    errors that say so;
 *  - a thousand rounds of connecting and failing leave the table, the
 *    transport and the process's fds as they were. */
#include <errno.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cmocka.h>

#include "datapath/proxy.h"
#include "datapath/transport.h"
#include "driver.h"
#include "held-tp.h"
#include "unit.h"

#define RING_CAP 64u
#define WAIT_NS 2000000000ull

struct fixture {
        struct tp tp;
        struct transport t;
        struct proxy *px;
};

static struct fixture *fixture_new(uint32_t timeout_ms) {
        struct proxy_params params = { .max_inflight = 64, .timeout_ms = timeout_ms, .idle_spins = 100 };
        struct fixture *f = calloc(1, sizeof(*f));
        char err[ERRMSG_MAX];

        assert_non_null(f);
        pthread_mutex_init(&f->tp.lock, NULL);
        f->t = (struct transport){ .ops = &held_ops, .tp = &f->tp };
        assert_int_equal(proxy_new(&f->t, &params, "test", &f->px, err), 0);
        return f;
}

static void fixture_free(struct fixture *f) {
        proxy_free(f->px);
        pthread_mutex_lock(&f->tp.lock);
        for (uint32_t i = 0; i < TP_MAX_PEERS; i++)
                assert_false(f->tp.used[i]); /* proxy_free gave back what it held */
        assert_int_equal(f->tp.stray, 0);
        pthread_mutex_unlock(&f->tp.lock);
        free(f);
}

/* A transport peer named `name`, connected: its index and *ret_gen. */
static uint32_t peer_new(struct fixture *f, const char *name, uint32_t *ret_gen) {
        uint8_t blob[TP_ADDR_MAX];
        char err[ERRMSG_MAX];
        uint32_t peer;
        size_t len;

        assert_int_equal(proxy_peer_new(f->px, name, &peer, ret_gen, blob, &len, err), 0);
        assert_true(peer < TP_MAX_PEERS);
        assert_int_equal(proxy_peer_connect(f->px, peer, *ret_gen, blob, len, err), 0);
        return peer;
}

/* A ring `id` whose writes come from test source `src` (held-tp's ring
 * number) and go to (`peer`, `gen`), data key `key`, counter key key + 1. */
struct ring {
        uint64_t id;
        int fd;
        struct tp_mr src;
        struct drv_ring r;
};

static void ring_open(struct fixture *f, struct ring *rg, uint64_t id, int src, uint32_t peer, uint32_t gen,
                      uint64_t key) {
        struct proxy_route route = { .tp_peer = peer,
                                     .tp_gen = gen,
                                     .data = { .key = key, .length = 1 << 20 },
                                     .counters = { .key = key + 1, .length = 4096 } };
        char err[ERRMSG_MAX];
        void *map;

        rg->id = id;
        rg->src.ring = src;
        assert_int_equal(proxy_ring_create(RING_CAP, &rg->fd, err), 0);
        assert_int_equal(proxy_ring_add(f->px, id, rg->fd, &rg->src, &route, 1, err), 0);
        map = mmap(NULL, PROXY_RING_BYTES(RING_CAP), PROT_READ | PROT_WRITE, MAP_SHARED, rg->fd, 0);
        assert_true(map != MAP_FAILED);
        drv_ring_init(&rg->r, map);
}

static void ring_close(struct ring *rg) {
        munmap(rg->r.hdr, PROXY_RING_BYTES(RING_CAP));
        close(rg->fd);
}

/* `n` descriptors of 8 bytes to route 0, no signal. */
static void push(struct ring *rg, uint32_t n) {
        for (uint32_t i = 0; i < n; i++) {
                struct proxy_desc d = { .length = 8 };

                assert_int_equal(drv_push(&rg->r, &d, drv_now_ns() + WAIT_NS), 0);
        }
}

static uint64_t done(struct ring *rg) {
        return DRV_LOAD_ACQ(&rg->r.hdr->done);
}

static int ring_error(struct ring *rg) {
        return (int)DRV_LOAD_ACQ(&rg->r.hdr->error);
}

/* Waits until `*word` (head or done) reaches `want`; returns it. */
static uint64_t word_wait(struct ring *rg, const uint64_t *word, uint64_t want) {
        uint64_t end = drv_now_ns() + WAIT_NS;

        while (DRV_LOAD_ACQ(word) < want && drv_now_ns() < end)
                usleep(100);
        (void)rg;
        return DRV_LOAD_ACQ(word);
}

/* The next event of `type` within `ns` (others are skipped), or false. */
static bool event_wait(struct proxy *px, enum proxy_event_type type, struct proxy_event *ev, uint64_t ns) {
        uint64_t end = drv_now_ns() + ns;

        do {
                while (proxy_event_next(px, ev))
                        if (ev->type == type)
                                return true;
                usleep(200);
        } while (drv_now_ns() < end);
        return false;
}

/* Waits (bounded) until the ring `ring_id` was removed and transport
 * peer generation `gen` freed, in whichever order the proxy tells them. */
static bool removed_and_freed(struct proxy *px, uint64_t ring_id, uint32_t gen) {
        uint64_t end = drv_now_ns() + WAIT_NS;
        bool removed = !ring_id, freed = false;
        struct proxy_event ev;

        do {
                while (proxy_event_next(px, &ev)) {
                        removed |= ev.type == PROXY_EVENT_RING_REMOVED && ev.ring_id == ring_id;
                        freed |= ev.type == PROXY_EVENT_PEER_FREED && ev.tp_gen == gen;
                }
                if (removed && freed)
                        return true;
                usleep(200);
        } while (drv_now_ns() < end);
        return false;
}

static uint64_t stat_wait(struct proxy *px, size_t offset, uint64_t want) {
        uint64_t end = drv_now_ns() + WAIT_NS;
        struct proxy_stats st;

        do {
                proxy_stats_get(px, &st);
                if (*(uint64_t *)((char *)&st + offset) >= want)
                        break;
                usleep(200);
        } while (drv_now_ns() < end);
        return *(uint64_t *)((char *)&st + offset);
}

/* ------------------------------------------------------------ the tests */

/* The review's case: an old ring still routes to an index that failed and
 * was handed out again. */
static void test_reuse_stale_route(void **state) {
        struct fixture *f = fixture_new(300); /* writes of a failed peer get 300 ms */
        struct ring r1, r2, r3;
        struct proxy_event ev;
        struct proxy_stats st;
        uint32_t g1, g2, gb, other;

        (void)state;
        assert_int_equal(peer_new(f, "daemon-a", &g1), 0);
        ring_open(f, &r1, 1, 0, 0, g1, 111);
        push(&r1, 3);
        assert_int_equal(word_wait(&r1, &r1.r.hdr->head, 3), 3);
        assert_int_equal(held_key_writes(&f->tp, 0, 111), 3);

        /* The mesh loses daemon-a: its routes are dead at once. */
        assert_int_equal(proxy_peer_fail(f->px, 0, g1, -ECONNRESET), 0);
        assert_true(event_wait(f->px, PROXY_EVENT_PEER_FAILED, &ev, WAIT_NS));
        assert_int_equal(ev.tp_peer, 0);
        assert_int_equal(ev.tp_gen, g1);
        assert_non_null(strstr(ev.msg, "transport peer 0 (daemon-a, generation"));
        assert_int_equal(ring_error(&r1), -ECONNRESET);
        assert_int_equal(word_wait(&r1, &r1.r.hdr->done, 3), 3); /* its descriptors ended */

        /* Its writes are still on their way: the index is not free. */
        assert_false(event_wait(f->px, PROXY_EVENT_PEER_FREED, &ev, 100000000ull));
        other = peer_new(f, "daemon-b", &gb);
        assert_int_not_equal(other, 0);
        release(&f->tp, 0, 1); /* one completes; the other two never do */
        assert_true(event_wait(f->px, PROXY_EVENT_PEER_FREED, &ev, WAIT_NS));
        assert_int_equal(ev.tp_peer, 0);
        assert_non_null(strstr(ev.msg, "2 writes to it never completed"));
        proxy_stats_get(f->px, &st);
        assert_int_equal(st.cancelled, 2);
        assert_int_equal(f->tp.freed[0], 1);

        /* The index serves another daemon now, in the next generation. */
        assert_int_equal(peer_new(f, "daemon-c", &g2), 0);
        assert_int_not_equal(g2, g1);
        ring_open(f, &r2, 2, 1, 0, g2, 222);

        /* The old ring writes on: refused, told, nothing reaches index 0. */
        push(&r1, 2);
        assert_int_equal(word_wait(&r1, &r1.r.hdr->done, 5), 5);
        assert_true(event_wait(f->px, PROXY_EVENT_ROUTE_DEAD, &ev, WAIT_NS));
        assert_int_equal(ev.ring_id, 1);
        assert_int_equal(ev.tp_gen, g1);
        assert_int_equal(ev.error, -ECONNRESET);
        assert_non_null(strstr(ev.msg, "ring 1 route 0: transport peer 0 generation"));
        assert_non_null(strstr(ev.msg, "is gone"));
        assert_int_equal(held_key_writes(&f->tp, 0, 111), 3);

        /* A ring made with the old route after the reuse: the same. */
        ring_open(f, &r3, 3, 2, 0, g1, 333);
        push(&r3, 1);
        assert_int_equal(word_wait(&r3, &r3.r.hdr->done, 1), 1);
        assert_int_equal(ring_error(&r3), -ENOTCONN);
        assert_true(event_wait(f->px, PROXY_EVENT_ROUTE_DEAD, &ev, WAIT_NS));
        assert_int_equal(ev.ring_id, 3);
        assert_int_equal(held_key_writes(&f->tp, 0, 333), 0);

        /* The new peer's writes go, and take the slots the given-up writes
         * left (the free slots are a stack). Those writes' completions
         * now come late: they must not end the new peer's descriptors. */
        push(&r2, 2);
        assert_int_equal(word_wait(&r2, &r2.r.hdr->head, 2), 2);
        assert_int_equal(held_key_writes(&f->tp, 0, 222), 2);
        release(&f->tp, 0, 2);
        assert_int_equal(stat_wait(f->px, offsetof(struct proxy_stats, stale), 2), 2);
        usleep(20000);
        assert_int_equal(done(&r2), 0);
        assert_int_equal(ring_error(&r2), 0);
        release(&f->tp, 1, 2);
        assert_int_equal(drv_wait_done(&r2.r, 2, drv_now_ns() + WAIT_NS), 0);

        ring_close(&r1);
        ring_close(&r2);
        ring_close(&r3);
        fixture_free(f);
}

/* Writes in flight that complete after the failure: the peer is freed as
 * soon as the last one does, well before the timeout, nothing given up. */
static void test_drain_by_completion(void **state) {
        struct fixture *f = fixture_new(5000);
        struct proxy_event ev;
        struct proxy_stats st;
        struct ring r;
        uint32_t gen;
        uint64_t t0;

        (void)state;
        assert_int_equal(peer_new(f, "daemon-a", &gen), 0);
        ring_open(f, &r, 1, 0, 0, gen, 111);
        push(&r, 2);
        assert_int_equal(word_wait(&r, &r.r.hdr->head, 2), 2);
        assert_int_equal(proxy_peer_fail(f->px, 0, gen, -ECONNRESET), 0);
        assert_false(event_wait(f->px, PROXY_EVENT_PEER_FREED, &ev, 100000000ull));
        t0 = drv_now_ns();
        release(&f->tp, 0, 2);
        assert_true(event_wait(f->px, PROXY_EVENT_PEER_FREED, &ev, WAIT_NS));
        assert_true(drv_now_ns() - t0 < 1000000000ull);
        assert_null(strstr(ev.msg, "given up"));
        proxy_stats_get(f->px, &st);
        assert_int_equal(st.cancelled, 0);
        assert_int_equal(st.stale, 0);
        ring_close(&r);
        fixture_free(f);
}

/* A write completes with a connection error: the proxy fails the peer
 * itself, and the index waits for its owner to let go (the mesh, told by
 * the PEER_FAILED event). Letting go twice, or connecting what was let
 * go, is refused. */
static void test_owner_lets_go_after(void **state) {
        struct fixture *f = fixture_new(5000);
        uint8_t blob[4] = "held";
        struct proxy_event ev;
        struct ring r;
        char err[ERRMSG_MAX];
        uint32_t gen, connected, draining;

        (void)state;
        assert_int_equal(peer_new(f, "daemon-a", &gen), 0);
        ring_open(f, &r, 1, 0, 0, gen, 111);
        push(&r, 1);
        assert_int_equal(word_wait(&r, &r.r.hdr->head, 1), 1);
        release_with(&f->tp, 0, 1, -ECONNRESET);
        assert_true(event_wait(f->px, PROXY_EVENT_PEER_FAILED, &ev, WAIT_NS));
        assert_int_equal(ev.tp_gen, gen);
        proxy_peers_count(f->px, &connected, &draining);
        assert_int_equal(connected, 0);
        assert_int_equal(draining, 1);
        assert_false(event_wait(f->px, PROXY_EVENT_PEER_FREED, &ev, 100000000ull));
        assert_int_equal(f->tp.freed[0], 0);

        assert_int_equal(proxy_peer_fail(f->px, 0, gen + 1, -ECONNRESET), -ESTALE);
        assert_int_equal(proxy_peer_fail(f->px, 0, gen, -ECONNRESET), 0);
        assert_int_equal(proxy_peer_fail(f->px, 0, gen, -ECONNRESET), -ESTALE);
        assert_int_equal(proxy_peer_connect(f->px, 0, gen, blob, sizeof(blob), err), -ESTALE);
        assert_non_null(strstr(err, "transport peer 0 generation"));
        assert_true(event_wait(f->px, PROXY_EVENT_PEER_FREED, &ev, WAIT_NS));
        proxy_peers_count(f->px, &connected, &draining);
        assert_int_equal(connected + draining, 0);
        ring_close(&r);
        fixture_free(f);
}

/* A descriptor's data write fails alone (-EACCES: the ring fails) while
 * its signal write never completes: the slot it holds counts towards the
 * 10 timeouts like a late write, and the peer fails then, is drained (the
 * signal given up on) and freed once let go, instead of holding the slot
 * for as long as the peer lives. */
static void test_abandoned_write_hangs(void **state) {
        struct fixture *f = fixture_new(20);
        struct proxy_desc d = { .length = 8, .flags = PROXY_DESC_SIGNAL, .signal_value = 1 };
        struct proxy_event ev;
        struct proxy_stats st;
        struct ring r;
        uint32_t gen;

        (void)state;
        assert_int_equal(peer_new(f, "daemon-a", &gen), 0);
        ring_open(f, &r, 1, 0, 0, gen, 111);
        assert_int_equal(drv_push(&r.r, &d, drv_now_ns() + WAIT_NS), 0);
        assert_int_equal(word_wait(&r, &r.r.hdr->head, 1), 1);
        release_with(&f->tp, 0, 1, -EACCES);
        assert_true(event_wait(f->px, PROXY_EVENT_RING_ERROR, &ev, WAIT_NS));
        assert_int_equal(ev.error, -EACCES);
        assert_true(event_wait(f->px, PROXY_EVENT_PEER_FAILED, &ev, WAIT_NS));
        assert_int_equal(ev.error, -ETIMEDOUT);
        assert_non_null(strstr(ev.msg, "10 times the timeout"));
        assert_int_equal(proxy_peer_fail(f->px, 0, gen, -ECONNRESET), 0);
        assert_true(event_wait(f->px, PROXY_EVENT_PEER_FREED, &ev, WAIT_NS));
        proxy_stats_get(f->px, &st);
        assert_int_equal(st.cancelled, 1);
        assert_int_equal(held_count(&f->tp), 1); /* the signal, never completed */
        ring_close(&r);
        fixture_free(f);
}

/* The caps: PROXY_PEERS_PER_NAME per name, TP_MAX_PEERS in all, each
 * refusal saying which; a transport that refuses peer_new leaves the
 * index free. */
static void test_caps(void **state) {
        struct fixture *f = fixture_new(5000);
        uint8_t blob[TP_ADDR_MAX];
        char err[ERRMSG_MAX], name[32];
        struct proxy_event ev;
        uint32_t peer, gen, gens[PROXY_PEERS_PER_NAME], connected, draining;
        size_t len;

        (void)state;
        for (uint32_t i = 0; i < PROXY_PEERS_PER_NAME; i++)
                assert_int_equal(peer_new(f, "flapper", &gens[i]), i);
        assert_int_equal(proxy_peer_new(f->px, "flapper", &peer, &gen, blob, &len, err), -EUSERS);
        assert_non_null(strstr(err, "no transport peer for flapper: it holds 4 already (4 connected"));
        assert_non_null(strstr(err, "at most 4 per daemon"));
        /* Failed ones count until freed. */
        assert_int_equal(proxy_peer_fail(f->px, 0, gens[0], -ECONNRESET), 0);
        assert_true(event_wait(f->px, PROXY_EVENT_PEER_FAILED, &ev, WAIT_NS));
        assert_true(event_wait(f->px, PROXY_EVENT_PEER_FREED, &ev, WAIT_NS));
        assert_int_equal(peer_new(f, "flapper", &gens[0]), 0);

        /* The transport refuses: nothing is held. */
        f->tp.peer_new_error = -EIO;
        assert_int_equal(proxy_peer_new(f->px, "refused", &peer, &gen, blob, &len, err), -EIO);
        f->tp.peer_new_error = 0;
        for (uint32_t i = PROXY_PEERS_PER_NAME; i < TP_MAX_PEERS; i++) {
                snprintf(name, sizeof(name), "daemon-%u", i);
                assert_int_equal(peer_new(f, name, &gen), i);
        }
        assert_int_equal(proxy_peer_new(f->px, "one-more", &peer, &gen, blob, &len, err), -ENOSPC);
        assert_non_null(strstr(err, "all 512 are held (512 connected, 0 failed"));
        proxy_peers_count(f->px, &connected, &draining);
        assert_int_equal(connected, TP_MAX_PEERS);
        assert_int_equal(draining, 0);
        fixture_free(f);
}

/* A daemon that connects and fails a thousand times, half of them with a
 * write on its way when it fails: each round takes index 0 again (the
 * table does not grow), the transport holds nothing after, no fd stays
 * open, no write was given up on, and an old ring that routes to the
 * first generation stays refused throughout. */
static void test_thousand_rounds(void **state) {
        struct fixture *f = fixture_new(5000);
        struct proxy_event ev;
        struct proxy_stats st;
        struct ring old, r;
        uint32_t gen, first, connected, draining;
        int fds;

        (void)state;
        assert_int_equal(peer_new(f, "flapper", &first), 0);
        ring_open(f, &old, 1, 0, 0, first, 111);
        assert_int_equal(proxy_peer_fail(f->px, 0, first, -ECONNRESET), 0);
        assert_true(event_wait(f->px, PROXY_EVENT_PEER_FREED, &ev, WAIT_NS));
        fds = unit_count_fds();
        for (uint32_t round = 1; round <= 1000; round++) {
                assert_int_equal(peer_new(f, "flapper", &gen), 0);
                assert_int_equal(gen, first + round);
                if (round % 2) {
                        ring_open(f, &r, 1 + round, 1, 0, gen, 222);
                        push(&r, 1);
                        assert_int_equal(word_wait(&r, &r.r.hdr->head, 1), 1);
                }
                assert_int_equal(proxy_peer_fail(f->px, 0, gen, -ECONNRESET), 0);
                if (round % 2) {
                        release(&f->tp, 1, 1);
                        assert_int_equal(proxy_ring_remove(f->px, 1 + round), 0);
                }
                assert_true(removed_and_freed(f->px, round % 2 ? 1 + round : 0, gen));
                if (round % 2)
                        ring_close(&r);
        }
        push(&old, 1);
        assert_int_equal(word_wait(&old, &old.r.hdr->done, 1), 1);
        assert_int_equal(held_key_writes(&f->tp, 0, 111), 0);
        proxy_peers_count(f->px, &connected, &draining);
        assert_int_equal(connected + draining, 0);
        assert_int_equal(f->tp.freed[0], 1001);
        assert_false(f->tp.used[0]);
        assert_int_equal(held_count(&f->tp), 0);
        proxy_stats_get(f->px, &st);
        assert_int_equal(st.cancelled, 0);
        assert_int_equal(unit_count_fds(), fds);
        ring_close(&old);
        fixture_free(f);
}

int main(void) {
        const struct CMUnitTest tests[] = {
                cmocka_unit_test(test_reuse_stale_route),
                cmocka_unit_test(test_drain_by_completion),
                cmocka_unit_test(test_owner_lets_go_after),
                cmocka_unit_test(test_abandoned_write_hangs),
                cmocka_unit_test(test_caps),
                cmocka_unit_test(test_thousand_rounds),
        };

        return cmocka_run_group_tests(tests, NULL, NULL);
}
