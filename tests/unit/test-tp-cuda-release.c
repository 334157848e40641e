/* When the cuda transport lets go of other daemons' GPU memory (issue 19):
 * every import of a rank's region (fake_imports counts what the libcuda
 * stand-in imported and not yet released) must go promptly once its last
 * user is gone, with both daemons still running, in the ways a job ends
 * badly on GPUs:
 *  - the mesh loses the peer daemon (proxy_peer_fail, as datapath.c does
 *    on the mesh's word): the imports of its regions go, and the
 *    connection is shut down at both ends;
 *  - writes never complete, the proxy fails the peer on its timeout, and
 *    then every rank leaves as datapath.c makes them leave (rings removed,
 *    regions deregistered): nothing stays imported on either side;
 *  - a fetch times out (the peer's server stalled): the answer that comes
 *    late, with the region's fd in it, is not left in our socket;
 *  - the peer does not read its revocations: the connection is shut down
 *    rather than the import kept.
 * Each bounded wait is well under a second of polling. */
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>
#include <cmocka.h>

#include "datapath/proxy.h"
#include "datapath/tp-cuda-internal.h"
#include "driver.h"
#include "tp-cuda-fake.h"

#define SIZE TPC_MAP_ALIGN

/* What a test found imported when it started: one that failed before
 * leaves its transports open, and the next counts from there. */
static int imports_base;

static int imports(void) {
        return __atomic_load_n(&fake_imports, __ATOMIC_ACQUIRE) - imports_base;
}

static int setup(void **state) {
        imports_base = __atomic_load_n(&fake_imports, __ATOMIC_ACQUIRE);
        fake_lag = 0;
        return 0;
}

static uint32_t conns(struct tp *tp) {
        uint32_t n;

        pthread_mutex_lock(&tp->lock);
        n = tp->nconns;
        pthread_mutex_unlock(&tp->lock);
        return n;
}

static void sleep_ms(int ms) {
        nanosleep(&(struct timespec){ .tv_sec = ms / 1000, .tv_nsec = (long)(ms % 1000) * 1000000 }, NULL);
}

/* Waits up to `ms` (polling `tp` when not NULL, as its proxy thread would)
 * until fake_imports is `want` and `server` (when not NULL) has `nconns`
 * connections. */
static bool settles(struct tp *tp, int want, struct tp *server, uint32_t nconns, int ms) {
        struct tp_completion c[16];
        uint64_t end = drv_now_ns() + (uint64_t)ms * 1000000u;

        do {
                if (imports() == want && (!server || conns(server) == nconns))
                        return true;
                for (int i = 0; tp && i < 256; i++)
                        tp_cuda_ops.poll(tp, c, 16);
                sleep_ms(1);
        } while (drv_now_ns() < end);
        return imports() == want && (!server || conns(server) == nconns);
}

/* One rank's three proxy regions at one daemon, as datapath.c registers
 * them (cuMem fds standing for GPU memory). */
struct rank {
        int fd[3];
        struct tp_mr *send, *recv, *counters;
        struct tp_rkey rk_recv, rk_counters;
};

static void rank_register(struct tp *tp, struct rank *r) {
        char errmsg[ERRMSG_MAX];
        struct tp_mr **mr[3] = { &r->send, &r->recv, &r->counters };
        static const char *const names[3] = { "send", "recv", "counters" };

        for (int i = 0; i < 3; i++) {
                struct tp_mem m = { .kind = TP_MEM_CUMEM, .length = SIZE, .name = names[i] };

                r->fd[i] = cumem_fake(SIZE);
                m.fd = r->fd[i];
                assert_int_equal(tp_cuda_ops.mr_new(tp, &m, mr[i], errmsg), 0);
        }
        tp_cuda_ops.mr_rkey(r->recv, &r->rk_recv);
        tp_cuda_ops.mr_rkey(r->counters, &r->rk_counters);
}

static void rank_close_fds(struct rank *r) {
        for (int i = 0; i < 3; i++)
                close(r->fd[i]);
}

/* The next proxy event of type `type` within `ms`, or false. */
static bool event_wait(struct proxy *px, enum proxy_event_type type, struct proxy_event *ret, int ms) {
        uint64_t end = drv_now_ns() + (uint64_t)ms * 1000000u;

        do {
                while (proxy_event_next(px, ret))
                        if (ret->type == type)
                                return true;
                sleep_ms(1);
        } while (drv_now_ns() < end);
        return false;
}

/* One proxy over `tp` (side_open) whose ring reads `from`'s send region
 * and writes into `to`'s receive region and counters at transport peer
 * (`peer`, `gen`) (side_ring). */
struct side {
        struct transport t;
        struct proxy *px;
        int ring_fd;
        void *map;
        struct drv_ring ring;
};

static void side_open(struct side *s, struct tp *tp, uint32_t timeout_ms) {
        struct proxy_params params = { .max_inflight = 16, .idle_spins = 100, .timeout_ms = timeout_ms };
        char errmsg[ERRMSG_MAX];

        s->t = (struct transport){ .ops = &tp_cuda_ops, .tp = tp };
        assert_int_equal(proxy_new(&s->t, &params, "test", &s->px, errmsg), 0);
}

static void side_ring(struct side *s, uint32_t peer, uint32_t gen, const struct rank *from,
                      const struct rank *to) {
        struct proxy_route routes[2] = { { .tp_peer = PROXY_ROUTE_NONE },
                                         { .tp_peer = peer, .tp_gen = gen } };
        char errmsg[ERRMSG_MAX];

        routes[1].data = to->rk_recv;
        routes[1].counters = to->rk_counters;
        assert_int_equal(proxy_ring_create(64, &s->ring_fd, errmsg), 0);
        s->map = mmap(NULL, PROXY_RING_BYTES(64), PROT_READ | PROT_WRITE, MAP_SHARED, s->ring_fd, 0);
        assert_true(s->map != MAP_FAILED);
        drv_ring_init(&s->ring, s->map);
        assert_int_equal(proxy_ring_add(s->px, 1, s->ring_fd, from->send, routes, 2, errmsg), 0);
}

static void side_push(struct side *s, int n) {
        for (int i = 0; i < n; i++) {
                struct proxy_desc d = { .src_offset = (uint64_t)i * 64,
                                        .dst_offset = (uint64_t)i * 64,
                                        .signal_value = 1 + (uint64_t)i,
                                        .length = 64,
                                        .peer = 1,
                                        .signal_id = (uint32_t)i,
                                        .flags = PROXY_DESC_SIGNAL };

                assert_int_equal(drv_push(&s->ring, &d, drv_now_ns() + 2000000000ull), 0);
        }
}

static void side_close(struct side *s) {
        proxy_free(s->px);
        munmap(s->map, PROXY_RING_BYTES(64));
        close(s->ring_fd);
}

/* The mesh loses the peer daemon, which is still alive (a partition, or a
 * daemon that stopped answering): datapath_peer_fail reaches the proxy.
 * The transport peer is never written to again, so the imports of that
 * daemon's regions go at once, not when a revocation or the daemon's exit
 * happens to close the connection; the connection is shut down, so that
 * the peer's server frees the slot too. */
static void test_mesh_lost_peer(void **state) {
        struct rank ra, rb;
        struct side sa;
        struct proxy_event ev;
        struct pair p;

        pair_transports(&p);
        rank_register(p.a, &ra);
        rank_register(p.b, &rb);
        assert_int_equal(imports(), 6);
        side_open(&sa, p.a, 0);
        pair_connect(&p, sa.px, NULL);
        side_ring(&sa, p.a_peer, p.a_gen, &ra, &rb);
        side_push(&sa, 4);
        assert_int_equal(drv_wait_done(&sa.ring, 4, drv_now_ns() + 2000000000ull), 0);
        assert_int_equal(imports(), 8); /* A holds B's receive region and counters */
        assert_int_equal(conns(p.b), 1);

        assert_int_equal(proxy_peer_fail(sa.px, p.a_peer, p.a_gen, -ECONNRESET), 0);
        assert_int_equal(proxy_peer_fail(sa.px, p.a_peer, p.a_gen, -ECONNRESET), -ESTALE); /* once */
        assert_true(event_wait(sa.px, PROXY_EVENT_PEER_FAILED, &ev, 1000));
        assert_int_equal(ev.tp_peer, p.a_peer);
        assert_int_equal(ev.tp_gen, p.a_gen);
        if (!settles(NULL, 6, p.b, 0, 500))
                fail_msg("after the peer failed: %d imports (want 6: A's import of B's two regions gone), "
                         "B serves %u connections (want 0)",
                         imports(), conns(p.b));
        /* Nothing was in flight: the peer is freed at once, its connection
         * closed and its token forgotten, and the index is A's to hand
         * out again. */
        assert_true(event_wait(sa.px, PROXY_EVENT_PEER_FREED, &ev, 1000));
        assert_int_equal(ev.tp_peer, p.a_peer);
        assert_int_equal(p.a->peers[p.a_peer].fd, -1);
        assert_int_equal(atomic_load(&p.a->peers[p.a_peer].state), TPC_PEER_FREE);
        /* The ring's next descriptor to the failed peer fails at once. */
        side_push(&sa, 1);
        assert_int_equal(drv_wait_done(&sa.ring, 5, drv_now_ns() + 2000000000ull), -ECONNRESET);

        side_close(&sa);
        tp_cuda_ops.close(p.a);
        tp_cuda_ops.close(p.b);
        assert_int_equal(imports(), 0);
        rank_close_fds(&ra);
        rank_close_fds(&rb);
}

/* The copies stall, each proxy fails the ring that posted them on the
 * write timeout (the job is aborted by that), not its peer, and then every rank leaves, in datapath.c's
 * order: rings removed, receive and counter regions deregistered, the send
 * region once the proxy reports the ring removed. With both daemons still
 * up, nothing of any rank stays imported anywhere. */
static void test_timeout_all_leave(void **state) {
        struct rank ra, rb;
        struct side sa, sb;
        struct proxy_event ev;
        struct pair p;

        pair_transports(&p);
        rank_register(p.a, &ra);
        rank_register(p.b, &rb);
        side_open(&sa, p.a, 100);
        side_open(&sb, p.b, 100);
        pair_connect(&p, sa.px, sb.px);
        side_ring(&sa, p.a_peer, p.a_gen, &ra, &rb);
        side_ring(&sb, p.b_peer, p.b_gen, &rb, &ra);
        side_push(&sa, 2);
        side_push(&sb, 2);
        assert_int_equal(drv_wait_done(&sa.ring, 2, drv_now_ns() + 2000000000ull), 0);
        assert_int_equal(drv_wait_done(&sb.ring, 2, drv_now_ns() + 2000000000ull), 0);
        assert_int_equal(imports(), 6 + 4); /* each side imported the other's two regions */

        /* Copies that never finish: both proxies give up on the ring. */
        fake_lag = 1000000000;
        side_push(&sa, 1);
        side_push(&sb, 1);
        assert_true(event_wait(sa.px, PROXY_EVENT_RING_ERROR, &ev, 3000));
        assert_int_equal(ev.error, -ETIMEDOUT);
        assert_true(event_wait(sb.px, PROXY_EVENT_RING_ERROR, &ev, 3000));
        assert_int_equal(ev.error, -ETIMEDOUT);
        for (int i = 0; i < fake_nevents; i++)
                __atomic_store_n(&fake_events[i], 0, __ATOMIC_RELEASE);
        fake_lag = 0;

        /* Every rank leaves (datapath_member_gone). */
        struct side *sides[2] = { &sa, &sb };
        struct rank *ranks[2] = { &ra, &rb };
        struct tp *tps[2] = { p.a, p.b };
        for (int k = 0; k < 2; k++) {
                assert_int_equal(proxy_ring_remove(sides[k]->px, 1), 0);
                tp_cuda_ops.mr_free(tps[k], ranks[k]->recv);
                tp_cuda_ops.mr_free(tps[k], ranks[k]->counters);
        }
        for (int k = 0; k < 2; k++) {
                assert_true(event_wait(sides[k]->px, PROXY_EVENT_RING_REMOVED, &ev, 1000));
                tp_cuda_ops.mr_free(tps[k], ranks[k]->send);
        }
        if (!settles(NULL, 0, NULL, 0, 500))
                fail_msg("every rank left, both daemons run: %d imports still held", imports());

        side_close(&sa);
        side_close(&sb);
        tp_cuda_ops.close(p.a);
        tp_cuda_ops.close(p.b);
        rank_close_fds(&ra);
        rank_close_fds(&rb);
}

/* Holds B's lock (its server thread stalls on the next fetch) for 2.3 s. */
static void *stall_server(void *arg) {
        struct tp *b = arg;

        pthread_mutex_lock(&b->lock);
        sleep_ms(2300);
        pthread_mutex_unlock(&b->lock);
        return NULL;
}

/* A fetch that gets no answer within TPC_FETCH_TIMEOUT_MS ends the peer;
 * the answer that comes after, carrying the region's fd (a reference to
 * the rank's GPU memory), must not wait in our socket until the daemon
 * exits, nor may B's server keep the connection. */
static void test_fetch_timeout(void **state) {
        struct tp_completion c[4];
        struct rank ra, rb;
        struct pair p;
        pthread_t th;
        char byte;
        int fd;

        pair_open(&p);
        rank_register(p.a, &ra);
        rank_register(p.b, &rb);
        assert_int_equal(tp_cuda_ops.write(p.a, p.a_peer, ra.send, 0, &rb.rk_counters, 0, 8, 1, 0, 0), 0);
        assert_int_equal(poll_n(p.a, c, 1), 1);
        assert_int_equal(c[0].status, 0);
        assert_int_equal(imports(), 7);

        assert_int_equal(pthread_create(&th, NULL, stall_server, p.b), 0);
        sleep_ms(50);
        assert_int_equal(tp_cuda_ops.write(p.a, p.a_peer, ra.send, 0, &rb.rk_recv, 0, 8, 2, 0, 0),
                         -ETIMEDOUT);
        assert_int_equal(imports(), 6); /* the dead peer's import of the counters went */
        pthread_join(th, NULL);
        /* B's server answers the fetch now. */
        fd = p.a->peers[p.a_peer].fd;
        if (!settles(NULL, 6, p.b, 0, 500))
                fail_msg("B still serves %u connection(s) of the peer A gave up on", conns(p.b));
        if (recv(fd, &byte, 1, MSG_PEEK | MSG_DONTWAIT) > 0)
                fail_msg("a message (the late REGION and its fd) waits in the dead peer's socket");

        tp_cuda_ops.close(p.a);
        tp_cuda_ops.close(p.b);
        assert_int_equal(imports(), 0);
        rank_close_fds(&ra);
        rank_close_fds(&rb);
}

/* B deregisters regions while A is not reading (its proxy busy): the
 * revocations B cannot send must not leave A holding the imports for as
 * long as the connection lasts. B's socket buffer is made small so that
 * a few messages fill it. */
static void test_revocation_not_taken(void **state) {
        enum {
                N = 32
        };
        struct tp_completion c[4];
        struct tp_mr *mr[N];
        struct tp_rkey rk;
        struct rank ra;
        char errmsg[ERRMSG_MAX];
        struct pair p;
        int fds[N], one = 1;

        pair_open(&p);
        rank_register(p.a, &ra);
        for (int i = 0; i < N; i++) {
                struct tp_mem m = { .kind = TP_MEM_CUMEM, .length = SIZE, .name = "recv" };

                fds[i] = cumem_fake(SIZE);
                m.fd = fds[i];
                assert_int_equal(tp_cuda_ops.mr_new(p.b, &m, &mr[i], errmsg), 0);
                tp_cuda_ops.mr_rkey(mr[i], &rk);
                assert_int_equal(tp_cuda_ops.write(p.a, p.a_peer, ra.send, 0, &rk, 0, 8, (uint64_t)i, 0, 0),
                                 0);
                assert_int_equal(poll_n(p.a, c, 1), 1);
                assert_int_equal(c[0].status, 0);
        }
        assert_int_equal(imports(), 3 + 2 * N);
        pthread_mutex_lock(&p.b->lock);
        assert_int_equal(p.b->nconns, 1);
        assert_int_equal(setsockopt(p.b->conns[0].fd, SOL_SOCKET, SO_SNDBUF, &one, sizeof(one)), 0);
        pthread_mutex_unlock(&p.b->lock);

        for (int i = 0; i < N; i++)
                tp_cuda_ops.mr_free(p.b, mr[i]);
        assert_int_equal(imports(), 3 + N); /* B's own went; A's wait for A to read */
        if (!settles(p.a, 3, NULL, 0, 500))
                fail_msg("B deregistered all %d regions: A still imports %d of them", N, imports() - 3);

        tp_cuda_ops.close(p.a);
        tp_cuda_ops.close(p.b);
        assert_int_equal(imports(), 0);
        rank_close_fds(&ra);
        for (int i = 0; i < N; i++)
                close(fds[i]);
}

int main(void) {
        const struct CMUnitTest tests[] = {
                cmocka_unit_test_setup(test_mesh_lost_peer, setup),
                cmocka_unit_test_setup(test_timeout_all_leave, setup),
                cmocka_unit_test_setup(test_fetch_timeout, setup),
                cmocka_unit_test_setup(test_revocation_not_taken, setup),
        };

        return cmocka_run_group_tests(tests, NULL, NULL);
}
