/* Unit tests of the cuda transport's backend without a GPU: two
 * instances in this process over a libcuda stand-in whose cuMem memory is
 * memfds (tp-cuda-fake.h): imports, fetches, writes, completions in posting
 * order behind pending events, -EACCES for unknown and revoked keys, the
 * byte counters, a superseded peer's imports and connection released, and
 * the real proxy thread over it with the payload checked at every counter
 * it signals. Where an fd travels, an independent mapping of it is the
 * reference. */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>
#include <cmocka.h>

#include "datapath/proxy.h"
#include "datapath/tp-cuda-internal.h"
#include "driver.h"
#include "tp-cuda-fake.h"
#include "unit.h"

static void test_backend_writes(void **state) {
        const size_t size = TPC_MAP_ALIGN;
        struct tp_completion c[16];
        struct tp_mr *send, *recv, *counters, *staging, *unused;
        struct tp_rkey rk_recv, rk_counters, bogus;
        struct tp_stats st;
        uint64_t *stage = NULL;
        char errmsg[ERRMSG_MAX];
        struct pair p;
        int fd_send = cumem_fake(size), fd_recv = cumem_fake(size), fd_counters = cumem_fake(size);
        uint8_t *ref_send, *ref_recv;
        uint64_t *ref_counters;

        pair_open(&p);
        ref_send = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd_send, 0);
        ref_recv = mmap(NULL, size, PROT_READ, MAP_SHARED, fd_recv, 0);
        ref_counters = mmap(NULL, size, PROT_READ, MAP_SHARED, fd_counters, 0);
        for (size_t i = 0; i < 8192; i++)
                ref_send[i] = (uint8_t)(i * 7 + 3);
        assert_int_equal(posix_memalign((void **)&stage, 4096, 4096), 0);

        struct tp_mem m = { .kind = TP_MEM_CUMEM, .fd = fd_send, .length = size, .name = "send" };
        assert_int_equal(tp_cuda_ops.mr_new(p.a, &m, &send, errmsg), 0);
        m = (struct tp_mem){ .kind = TP_MEM_CUMEM, .fd = fd_recv, .length = 1000000, .name = "recv" };
        assert_int_equal(tp_cuda_ops.mr_new(p.b, &m, &recv, errmsg), 0);
        m = (struct tp_mem){ .kind = TP_MEM_CUMEM, .fd = fd_counters, .length = 64, .name = "counters" };
        assert_int_equal(tp_cuda_ops.mr_new(p.b, &m, &counters, errmsg), 0);
        m = (struct tp_mem){ .kind = TP_MEM_HOST, .addr = stage, .length = 4096, .name = "staging" };
        assert_int_equal(tp_cuda_ops.mr_new(p.a, &m, &staging, errmsg), 0);
        assert_null(tp_cuda_ops.mr_addr(recv));
        assert_ptr_equal(tp_cuda_ops.mr_addr(staging), stage);
        /* A dma-buf is the verbs transport's; a cuMem fd whose allocation is
         * smaller than the region fails at registration, naming it. */
        m = (struct tp_mem){ .kind = TP_MEM_DMABUF, .fd = fd_send, .length = 4096, .name = "job 1 rank 0 x" };
        assert_int_equal(tp_cuda_ops.mr_new(p.a, &m, &unused, errmsg), -EOPNOTSUPP);
        assert_non_null(strstr(errmsg, "job 1 rank 0 x"));
        m = (struct tp_mem){ .kind = TP_MEM_CUMEM, .fd = fd_send, .length = size + 1, .name = "too big" };
        assert_int_equal(tp_cuda_ops.mr_new(p.a, &m, &unused, errmsg), -EINVAL);
        assert_non_null(strstr(errmsg, "too big"));

        tp_cuda_ops.mr_rkey(recv, &rk_recv);
        tp_cuda_ops.mr_rkey(counters, &rk_counters);
        assert_int_not_equal(rk_recv.key, rk_counters.key);
        assert_int_equal(rk_recv.length, 1000000);

        /* Data, then its signal, as the proxy posts them; completions wait
         * for their events and come in posting order. */
        fake_lag = 3;
        stage[1] = 0xfeed0001;
        assert_int_equal(tp_cuda_ops.write(p.a, p.a_peer, send, 100, &rk_recv, 5000, 4096, 10, 0, 0), 0);
        assert_int_equal(
                tp_cuda_ops.write(p.a, p.a_peer, staging, 8, &rk_counters, 16, 8, 11, 0, TP_WRITE_ORDERED),
                0);
        assert_int_equal(tp_cuda_ops.poll(p.a, c, 16), 0); /* events not passed yet */
        assert_int_equal(poll_n(p.a, c, 2), 2);
        assert_int_equal(c[0].cookie, 10);
        assert_int_equal(c[0].status, 0);
        assert_int_equal(c[1].cookie, 11);
        assert_int_equal(c[1].status, 0);
        assert_memory_equal(ref_recv + 5000, ref_send + 100, 4096);
        assert_int_equal(ref_counters[2], 0xfeed0001);
        assert_int_equal(fake_imports, 3 + 2); /* 3 regions + A's 2 imports of B's */

        /* Hostile or stale writes: a range past the region is refused at
         * once; an unknown key completes with -EACCES in its turn. */
        assert_int_equal(tp_cuda_ops.write(p.a, p.a_peer, send, 0, &rk_recv, 1000000 - 10, 11, 12, 0, 0),
                         -EINVAL);
        assert_int_equal(tp_cuda_ops.write(p.a, p.a_peer, send, size, &rk_recv, 0, 1, 12, 0, 0), -EINVAL);
        assert_int_equal(tp_cuda_ops.write(p.a, 77, send, 0, &rk_recv, 0, 1, 12, 0, 0), -ENOTCONN);
        assert_int_equal(tp_cuda_ops.write(p.a, p.a_peer, send, 0, &rk_recv, 0, 1, 12, 7, TP_WRITE_IMM),
                         -EOPNOTSUPP);
        fake_lag = 5;
        bogus = rk_recv;
        bogus.key ^= 1;
        assert_int_equal(tp_cuda_ops.write(p.a, p.a_peer, send, 0, &rk_recv, 0, 64, 20, 0, 0), 0);
        assert_int_equal(tp_cuda_ops.write(p.a, p.a_peer, send, 0, &bogus, 0, 64, 21, 0, 0), 0);
        bogus = rk_recv;
        bogus.length = 999;
        assert_int_equal(tp_cuda_ops.write(p.a, p.a_peer, send, 0, &bogus, 0, 64, 22, 0, 0), 0);
        assert_int_equal(poll_n(p.a, c, 3), 3);
        assert_int_equal(c[0].cookie, 20);
        assert_int_equal(c[0].status, 0);
        assert_int_equal(c[1].cookie, 21);
        assert_int_equal(c[1].status, -EACCES);
        assert_int_equal(c[2].cookie, 22);
        assert_int_equal(c[2].status, -EACCES);

        /* The queue holds depth (8) writes; the ninth waits. */
        fake_lag = 1000000;
        for (int i = 0; i < 8; i++)
                assert_int_equal(tp_cuda_ops.write(p.a, p.a_peer, send, 0, &rk_recv, 0, 8, 30 + i, 0, 0), 0);
        assert_int_equal(tp_cuda_ops.write(p.a, p.a_peer, send, 0, &rk_recv, 0, 8, 38, 0, 0), -EAGAIN);
        for (int i = 0; i < fake_nevents; i++)
                fake_events[i] = 0;
        assert_int_equal(poll_n(p.a, c, 8), 8);
        for (int i = 0; i < 8; i++)
                assert_int_equal(c[i].cookie, 30 + i);
        fake_lag = 0;

        tp_cuda_ops.stats(p.a, &st);
        assert_int_equal(st.writes, 2 + 1 + 8);
        assert_int_equal(st.device, 4096 + 64 + 8 * 8);
        assert_int_equal(st.daemon, 8);
        assert_int_equal(st.host, 0);

        /* B deregisters its receive region: A drops its import on the
         * REVOKE, and a write into the key fails as a remote access error. */
        tp_cuda_ops.mr_free(p.b, recv);
        for (int i = 0; i < 20000 && fake_imports != 3; i++) { /* poll reads peers every 256 calls */
                tp_cuda_ops.poll(p.a, c, 16);
                if (i % 256 == 255)
                        nanosleep(&(struct timespec){ .tv_nsec = 1000000 }, NULL);
        }
        assert_int_equal(fake_imports, 3); /* A: send and B's counters; B: counters */
        assert_int_equal(tp_cuda_ops.write(p.a, p.a_peer, send, 0, &rk_recv, 0, 8, 40, 0, 0), 0);
        assert_int_equal(poll_n(p.a, c, 1), 1);
        assert_int_equal(c[0].status, -EACCES);

        tp_cuda_ops.mr_free(p.a, send);
        tp_cuda_ops.mr_free(p.a, staging);
        tp_cuda_ops.close(p.a);
        tp_cuda_ops.close(p.b);
        assert_int_equal(fake_imports, 0);
        free(stage);
        munmap(ref_send, size);
        munmap(ref_recv, size);
        munmap(ref_counters, size);
        close(fd_send);
        close(fd_recv);
        close(fd_counters);
}

static void test_backend_memfd(void **state) {
        struct tp_completion c[4];
        struct tp_mr *src, *dst;
        struct tp_rkey rk;
        struct tp_stats st;
        char errmsg[ERRMSG_MAX];
        struct pair p;
        int fd_src = unit_memfd(8192, "host-staged payload"), fd_dst = unit_memfd(8192, "");
        char *ref;

        pair_open(&p);
        struct tp_mem m = { .kind = TP_MEM_MEMFD, .fd = fd_src, .length = 8192, .name = "src" };
        assert_int_equal(tp_cuda_ops.mr_new(p.a, &m, &src, errmsg), 0);
        m = (struct tp_mem){ .kind = TP_MEM_MEMFD, .fd = fd_dst, .length = 8192, .name = "dst" };
        assert_int_equal(tp_cuda_ops.mr_new(p.b, &m, &dst, errmsg), 0);
        tp_cuda_ops.mr_rkey(dst, &rk);
        assert_int_equal(tp_cuda_ops.write(p.a, p.a_peer, src, 0, &rk, 100, 19, 1, 0, 0), 0);
        assert_int_equal(poll_n(p.a, c, 1), 1);
        assert_int_equal(c[0].status, 0);
        ref = mmap(NULL, 8192, PROT_READ, MAP_SHARED, fd_dst, 0);
        assert_memory_equal(ref + 100, "host-staged payload", 19);
        tp_cuda_ops.stats(p.a, &st);
        assert_int_equal(st.host, 19);
        assert_int_equal(st.device, 0);
        munmap(ref, 8192);
        tp_cuda_ops.mr_free(p.a, src);
        tp_cuda_ops.mr_free(p.b, dst);
        tp_cuda_ops.close(p.a);
        tp_cuda_ops.close(p.b);
        close(fd_src);
        close(fd_dst);
}

/* The proxy thread (proxy.c) over the cuda transport, fed from the CPU
 * as the kernels feed it: each descriptor's payload arrives, and its
 * counter is never seen before the payload (checked at every counter
 * value, with completions held back by pending events). */
static void test_proxy_over_cuda(void **state) {
        const size_t size = TPC_MAP_ALIGN;
        const int count = 300;
        struct proxy_params params = { .max_inflight = 16, .idle_spins = 100 };
        int fd_send = cumem_fake(size), fd_recv = cumem_fake(size), fd_counters = cumem_fake(size);
        struct tp_mr *send, *recv, *counters;
        struct proxy_route routes[2];
        struct transport t;
        struct drv_ring ring;
        struct proxy *px;
        struct tp_stats st;
        char errmsg[ERRMSG_MAX];
        struct pair p;
        uint8_t *src, *dst;
        uint64_t *ctr, ring_id = 1;
        int ring_fd;
        void *ring_map;

        pair_transports(&p);
        t = (struct transport){ .ops = &tp_cuda_ops, .tp = p.a };
        assert_int_equal(proxy_new(&t, &params, "test", &px, errmsg), 0);
        pair_connect(&p, px, NULL);
        fake_lag = 2;
        src = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd_send, 0);
        dst = mmap(NULL, size, PROT_READ, MAP_SHARED, fd_recv, 0);
        ctr = mmap(NULL, size, PROT_READ, MAP_SHARED, fd_counters, 0);
        struct tp_mem m = { .kind = TP_MEM_CUMEM, .fd = fd_send, .length = size, .name = "send" };
        assert_int_equal(tp_cuda_ops.mr_new(p.a, &m, &send, errmsg), 0);
        m = (struct tp_mem){ .kind = TP_MEM_CUMEM, .fd = fd_recv, .length = size, .name = "recv" };
        assert_int_equal(tp_cuda_ops.mr_new(p.b, &m, &recv, errmsg), 0);
        m = (struct tp_mem){
                .kind = TP_MEM_CUMEM, .fd = fd_counters, .length = 8 * count, .name = "counters"
        };
        assert_int_equal(tp_cuda_ops.mr_new(p.b, &m, &counters, errmsg), 0);
        routes[0] = (struct proxy_route){ .tp_peer = PROXY_ROUTE_NONE };
        routes[1] = (struct proxy_route){ .tp_peer = p.a_peer, .tp_gen = p.a_gen };
        tp_cuda_ops.mr_rkey(recv, &routes[1].data);
        tp_cuda_ops.mr_rkey(counters, &routes[1].counters);

        assert_int_equal(proxy_ring_create(64, &ring_fd, errmsg), 0);
        ring_map = mmap(NULL, PROXY_RING_BYTES(64), PROT_READ | PROT_WRITE, MAP_SHARED, ring_fd, 0);
        assert_true(ring_map != MAP_FAILED);
        drv_ring_init(&ring, ring_map);
        assert_int_equal(proxy_ring_add(px, ring_id, ring_fd, send, routes, 2, errmsg), 0);

        for (int i = 0; i < count; i++) {
                struct proxy_desc d = { .src_offset = (uint64_t)i * 1024,
                                        .dst_offset = (uint64_t)i * 1024,
                                        .signal_value = 1000 + (uint64_t)i,
                                        .length = 1024,
                                        .peer = 1,
                                        .signal_id = (uint32_t)i,
                                        .flags = PROXY_DESC_SIGNAL };

                memset(src + (size_t)i * 1024, i & 0xff, 1024);
                assert_int_equal(drv_push(&ring, &d, drv_now_ns() + 5000000000ull), 0);
        }
        /* The receiver's side: whenever a counter holds its value, the
         * payload it signals is complete. */
        for (int i = 0; i < count; i++) {
                assert_int_equal(
                        drv_wait_counter(&ctr[i], 1000 + (uint64_t)i, ring.hdr, drv_now_ns() + 5000000000ull),
                        0);
                for (int k = 0; k < 1024; k++)
                        if (dst[(size_t)i * 1024 + k] != (uint8_t)(i & 0xff))
                                fail_msg("descriptor %d: byte %d is %d before or after its signal", i, k,
                                         dst[(size_t)i * 1024 + k]);
        }
        assert_int_equal(drv_wait_done(&ring, count, drv_now_ns() + 5000000000ull), 0);
        tp_cuda_ops.stats(p.a, &st);
        assert_int_equal(st.device, (uint64_t)count * 1024);
        assert_int_equal(st.daemon, (uint64_t)count * 8);
        assert_int_equal(st.host, 0);

        proxy_free(px);
        munmap(ring_map, PROXY_RING_BYTES(64));
        close(ring_fd);
        tp_cuda_ops.close(p.a);
        tp_cuda_ops.close(p.b);
        fake_lag = 0;
        munmap(src, size);
        munmap(dst, size);
        munmap(ctr, size);
        close(fd_send);
        close(fd_recv);
        close(fd_counters);
}

/* The mesh reconnects: a second transport peer to the same daemon
 * supersedes the first, whose connection closes at both ends and whose
 * imports go, so that reconnections leak neither server slots nor GPU
 * memory; the new peer carries writes. */
static void test_peer_superseded(void **state) {
        const size_t size = TPC_MAP_ALIGN;
        struct tp_completion c[4];
        struct tp_mr *src, *dst;
        struct tp_rkey rk;
        uint8_t blob_a[TP_ADDR_MAX], blob_b[TP_ADDR_MAX];
        char errmsg[ERRMSG_MAX];
        uint32_t a2 = 1, b2 = 1, conns = 0;
        size_t la, lb;
        struct pair p;
        int fd_src = cumem_fake(size), fd_dst = cumem_fake(size), r = 0;

        pair_open(&p);
        pair_first_write(&p, fd_src, fd_dst, size, &src, &dst, &rk);
        assert_int_equal(fake_imports, 3);

        assert_int_equal(tp_cuda_ops.peer_new(p.a, a2, blob_a, &la, errmsg), 0);
        assert_int_equal(tp_cuda_ops.peer_new(p.b, b2, blob_b, &lb, errmsg), 0);
        assert_int_equal(tp_cuda_ops.peer_connect(p.a, a2, blob_b, lb, errmsg), 0);
        assert_int_equal(tp_cuda_ops.peer_connect(p.b, b2, blob_a, la, errmsg), 0);
        for (int i = 0; i < 20000 && (fake_imports != 2 || conns != 1); i++) {
                tp_cuda_ops.poll(p.a, c, 4);
                pthread_mutex_lock(&p.b->lock);
                conns = p.b->nconns;
                pthread_mutex_unlock(&p.b->lock);
                if (i % 256 == 255)
                        nanosleep(&(struct timespec){ .tv_nsec = 1000000 }, NULL);
        }
        assert_int_equal(fake_imports, 2); /* A's import of dst went with the old peer */
        assert_int_equal(conns, 1);        /* B's server dropped A's old connection, serves the new one */
        assert_int_equal(tp_cuda_ops.write(p.a, p.a_peer, src, 0, &rk, 0, 64, 2, 0, 0), -ECONNRESET);
        for (int i = 0; i < 300 && (r = tp_cuda_ops.write(p.a, a2, src, 0, &rk, 0, 64, 3, 0, 0)) == 0; i++) {
                assert_int_equal(poll_n(p.a, c, 1), 1);
                if (c[0].status == 0)
                        break;
                nanosleep(&(struct timespec){ .tv_nsec = 10000000 }, NULL);
        }
        assert_int_equal(r, 0);
        assert_int_equal(c[0].status, 0);
        assert_int_equal(c[0].cookie, 3);
        tp_cuda_ops.close(p.a);
        tp_cuda_ops.close(p.b);
        assert_int_equal(fake_imports, 0);
        close(fd_src);
        close(fd_dst);
}

int main(void) {
        const struct CMUnitTest tests[] = {
                cmocka_unit_test(test_backend_writes),
                cmocka_unit_test(test_backend_memfd),
                cmocka_unit_test(test_proxy_over_cuda),
                cmocka_unit_test(test_peer_superseded),
        };

        return cmocka_run_group_tests(tests, NULL, NULL);
}
