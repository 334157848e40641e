/* How the proxy shares its in-flight slots among rings, and what a late
 * write fails (daemon/datapath/proxy.h, "Sharing" and "Failure"), over a
 * transport of this file whose writes complete only when the test lets
 * them: a ring alone uses every slot; a ring that holds them all when
 * another wakes takes none until below its share; a ring has at most
 * 256 MiB of payload in flight; a write past the timeout fails its own ring,
 * not the peer, and the ring is removed only once the write completes. */
#include <errno.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cmocka.h>

#include "datapath/proxy.h"
#include "datapath/transport.h"
#include "driver.h"
#include "held-tp.h"

#define SLOTS 1024u
#define RING_CAP 4096u
#define WAIT_NS 2000000000ull
#define RINGS 3

/* ------------------------------------------------------------ set-up */

struct fixture {
        struct tp tp;
        struct transport t;
        struct proxy *px;
        struct tp_mr src[RINGS];
        struct drv_ring ring[RINGS];
        int fd[RINGS];
        int nrings;
};

/* A proxy of `slots` slots with `nrings` rings to one peer. */
static struct fixture *fixture_make(uint32_t timeout_ms, uint32_t slots, int nrings) {
        struct proxy_params params = { .max_inflight = slots, .timeout_ms = timeout_ms, .idle_spins = 100 };
        struct proxy_route route = { 0 };
        struct fixture *f = calloc(1, sizeof(*f));
        char err[ERRMSG_MAX];
        uint8_t blob[TP_ADDR_MAX];
        size_t len;

        pthread_mutex_init(&f->tp.lock, NULL);
        f->t = (struct transport){ .ops = &held_ops, .tp = &f->tp };
        assert_int_equal(proxy_new(&f->t, &params, "test", &f->px, err), 0);
        assert_int_equal(proxy_peer_new(f->px, "peer", &route.tp_peer, &route.tp_gen, blob, &len, err), 0);
        f->nrings = nrings;
        for (int r = 0; r < nrings; r++) {
                void *map;

                f->src[r].ring = r;
                assert_int_equal(proxy_ring_create(RING_CAP, &f->fd[r], err), 0);
                assert_int_equal(proxy_ring_add(f->px, (uint64_t)r + 1, f->fd[r], &f->src[r], &route, 1, err),
                                 0);
                map = mmap(NULL, PROXY_RING_BYTES(RING_CAP), PROT_READ | PROT_WRITE, MAP_SHARED, f->fd[r], 0);
                assert_true(map != MAP_FAILED);
                drv_ring_init(&f->ring[r], map);
        }
        return f;
}

static struct fixture *fixture_new(uint32_t timeout_ms) {
        return fixture_make(timeout_ms, SLOTS, 2);
}

static void fixture_free(struct fixture *f) {
        proxy_free(f->px);
        for (int r = 0; r < f->nrings; r++) {
                munmap(f->ring[r].hdr, PROXY_RING_BYTES(RING_CAP));
                close(f->fd[r]);
        }
        free(f);
}

/* Pushes `n` descriptors of `len` bytes (no signal) to ring `r`. */
static void push(struct fixture *f, int r, uint32_t n, uint32_t len) {
        for (uint32_t i = 0; i < n; i++) {
                struct proxy_desc d = { .length = len };

                assert_int_equal(drv_push(&f->ring[r], &d, drv_now_ns() + WAIT_NS), 0);
        }
}

static uint64_t head(struct fixture *f, int r) {
        return DRV_LOAD_ACQ(&f->ring[r].hdr->head);
}

static uint64_t done(struct fixture *f, int r) {
        return DRV_LOAD_ACQ(&f->ring[r].hdr->done);
}

/* Waits until ring `r`'s head reaches `want`; returns it. */
static uint64_t head_wait(struct fixture *f, int r, uint64_t want) {
        uint64_t end = drv_now_ns() + WAIT_NS;

        while (head(f, r) < want && drv_now_ns() < end)
                usleep(100);
        return head(f, r);
}

/* The head once it stopped moving (20 ms unchanged). */
static uint64_t head_settled(struct fixture *f, int r) {
        uint64_t h;

        do {
                h = head(f, r);
                usleep(20000);
        } while (head(f, r) != h);
        return h;
}

/* Ring `r`'s head reaches `want` and stays there. */
static void head_is(struct fixture *f, int r, uint64_t want) {
        assert_int_equal(head_wait(f, r, want), want);
        assert_int_equal(head_settled(f, r), want);
}

static bool event_wait(struct proxy *px, enum proxy_event_type type, struct proxy_event *ev, uint64_t ns) {
        uint64_t end = drv_now_ns() + ns;

        while (drv_now_ns() < end) {
                while (proxy_event_next(px, ev)) {
                        assert_int_not_equal(ev->type, PROXY_EVENT_PEER_FAILED);
                        if (ev->type == type)
                                return true;
                }
                usleep(1000);
        }
        return false;
}

/* ------------------------------------------------------------ the tests */

/* A ring alone takes every slot; none is kept for rings that are idle. */
static void test_alone_takes_all(void **state) {
        struct fixture *f = fixture_new(0);

        (void)state;
        push(f, 0, 2 * SLOTS, 8);
        head_is(f, 0, SLOTS);
        release(&f->tp, 0, 2 * SLOTS);
        assert_int_equal(head_wait(f, 0, 2 * SLOTS), 2 * SLOTS);
        fixture_free(f);
}

/* Ring 0 holds every slot when ring 1 wakes: the slots ring 0's writes
 * free go to ring 1 until both hold their half. */
static void test_share_after_wake(void **state) {
        struct fixture *f = fixture_new(0);

        (void)state;
        push(f, 0, 3 * SLOTS, 8);
        assert_int_equal(head_wait(f, 0, SLOTS), SLOTS);
        push(f, 1, SLOTS, 8);
        assert_int_equal(head_settled(f, 1), 0); /* nothing free */
        release(&f->tp, 0, SLOTS / 2);
        assert_int_equal(head_wait(f, 1, SLOTS / 2), SLOTS / 2);
        assert_int_equal(head_settled(f, 0), SLOTS);                             /* ring 0 took none back */
        assert_int_equal(head(f, 0) - done(f, 0), SLOTS / 2);                    /* its half */
        assert_int_equal(head_settled(f, 1), SLOTS / 2);                         /* and ring 1 its half */
        release(&f->tp, 0, SLOTS / 4);                                           /* ring 0 below its share: */
        assert_int_equal(head_wait(f, 0, SLOTS + SLOTS / 4), SLOTS + SLOTS / 4); /* it takes them back */
        release(&f->tp, 1, SLOTS);
        assert_int_equal(head_wait(f, 1, SLOTS), SLOTS);
        fixture_free(f);
}

/* At most 256 MiB of one ring's payload in flight; a larger descriptor
 * alone goes, one at a time. */
static void test_bytes(void **state) {
        struct fixture *f = fixture_new(0);

        (void)state;
        push(f, 0, 10, 64u << 20);
        head_is(f, 0, 4);
        release(&f->tp, 0, 1);
        head_is(f, 0, 5);
        push(f, 1, 3, 300u << 20);
        head_is(f, 1, 1);
        release(&f->tp, 1, 1);
        head_is(f, 1, 2);
        release(&f->tp, 1, 1);
        assert_int_equal(head_wait(f, 1, 3), 3);
        fixture_free(f);
}

/* A write past the timeout fails its ring (-ETIMEDOUT, RING_ERROR), not
 * the peer: another ring to the same peer goes on. The ring's removal
 * waits until the late write completes. */
static void test_timeout_fails_ring(void **state) {
        struct fixture *f =
                fixture_new(200); /* its write held well under 10 timeouts (test_dead_connection) */
        struct proxy_event ev;

        (void)state;
        push(f, 0, 1, 8);
        assert_true(event_wait(f->px, PROXY_EVENT_RING_ERROR, &ev, WAIT_NS));
        assert_int_equal(ev.ring_id, 1);
        assert_int_equal(ev.error, -ETIMEDOUT);
        assert_non_null(strstr(ev.msg, "write not completed in time"));
        assert_int_equal(DRV_LOAD_ACQ(&f->ring[0].hdr->error), -ETIMEDOUT);
        assert_int_equal(done(f, 0), 0);
        push(f, 1, 100, 8);
        assert_int_equal(head_wait(f, 1, 100), 100);
        release(&f->tp, 1, 100);
        assert_int_equal(drv_wait_done(&f->ring[1], 100, drv_now_ns() + WAIT_NS), 0);
        assert_int_equal(DRV_LOAD_ACQ(&f->ring[1].hdr->error), 0);
        assert_int_equal(proxy_ring_remove(f->px, 1), 0);
        assert_false(event_wait(f->px, PROXY_EVENT_RING_REMOVED, &ev, 200000000ull));
        release(&f->tp, 0, 1);
        assert_true(event_wait(f->px, PROXY_EVENT_RING_REMOVED, &ev, WAIT_NS));
        assert_int_equal(ev.ring_id, 1);
        while (proxy_event_next(f->px, &ev))
                assert_int_not_equal(ev.type, PROXY_EVENT_PEER_FAILED);
        fixture_free(f);
}

/* A write still not completed after 10 timeouts fails its transport peer:
 * the connection is taken for dead (else every ring to it would go late
 * in turn and hold every tenant's slots). */
static void test_dead_connection(void **state) {
        struct fixture *f = fixture_new(20);
        struct proxy_event ev;
        uint64_t end = drv_now_ns() + WAIT_NS;
        bool ring_error = false, peer_failed = false;

        (void)state;
        push(f, 0, 1, 8);
        while (!peer_failed && drv_now_ns() < end) {
                while (proxy_event_next(f->px, &ev)) {
                        ring_error |= ev.type == PROXY_EVENT_RING_ERROR;
                        if (ev.type == PROXY_EVENT_PEER_FAILED) {
                                assert_true(ring_error); /* the ring first, at one timeout */
                                assert_int_equal(ev.error, -ETIMEDOUT);
                                assert_non_null(strstr(ev.msg, "10 times the timeout"));
                                peer_failed = true;
                        }
                }
                usleep(1000);
        }
        assert_true(peer_failed);
        release(&f->tp, 0, 1);
        fixture_free(f);
}

/* More rings busy than slots / 16 (32 slots, 3 rings: each share is at
 * least 16, so two busy rings' shares take every slot): the rings take
 * turns at the slots that come free, and the third is not starved. */
static void test_no_starving(void **state) {
        struct fixture *f = fixture_make(0, 32, 3);
        uint64_t pushed[2] = { 64, 64 };

        (void)state;
        push(f, 0, 64, 8);
        push(f, 1, 64, 8);
        head_settled(f, 0);
        push(f, 2, 10, 8);
        for (int k = 0; k < 300 && head(f, 2) < 10; k++) {
                for (int r = 0; r < 2; r++) { /* rings 0 and 1 stay busy */
                        release(&f->tp, r, 4);
                        if (pushed[r] - head(f, r) < 32) {
                                push(f, r, 32, 8);
                                pushed[r] += 32;
                        }
                }
                usleep(1000);
        }
        assert_int_equal(head(f, 2), 10);
        release(&f->tp, 0, 100000);
        release(&f->tp, 1, 100000);
        release(&f->tp, 2, 100000);
        fixture_free(f);
}

int main(void) {
        const struct CMUnitTest tests[] = {
                cmocka_unit_test(test_alone_takes_all), cmocka_unit_test(test_share_after_wake),
                cmocka_unit_test(test_bytes),           cmocka_unit_test(test_timeout_fails_ring),
                cmocka_unit_test(test_dead_connection), cmocka_unit_test(test_no_starving),
        };

        return cmocka_run_group_tests(tests, NULL, NULL);
}
