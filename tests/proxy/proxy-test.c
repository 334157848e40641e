/* Proxy tests on one host (no GPU, no RDMA NIC): CPU producers write the
 * descriptor rings the kernels will write; proxies move the bytes.
 *
 *   moeep-proxy-test loop     one process, tp-loop: bytes, counters, done,
 *                             a bad descriptor, ring removal, a write into a
 *                             deregistered region fails
 *   moeep-proxy-test fabric   two processes over libfabric tcp on 127.0.0.1,
 *                             each sending to the other: every byte, every counter
 *   moeep-proxy-test kill     the same, then one side is SIGKILLed mid-transfer:
 *                             the survivor's producer and counter waiter end
 *                             with an error within a bounded time
 *   moeep-proxy-test released the receiver deregisters its receive region;
 *                             the writer's next write into it fails its ring and
 *                             the peer (docs/protocol.md), never "done"
 *   moeep-proxy-test stall    the receiver is stopped (SIGSTOP) with 199 writes to it
 *                             on their way: the writer fails its transport peer,
 *                             which is freed once timeout_ms gave the writes up;
 *                             index 0 then serves a new peer (to the writer itself)
 *                             that moves every byte and counter while the receiver,
 *                             resumed, completes the old writes late; the old
 *                             ring's next descriptor is refused
 *   moeep-proxy-test verbs    opens the verbs backend; skips (77) without a device
 *
 * Exit 0 pass, 1 fail, 77 skip. */
#include <errno.h>
#include <inttypes.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "datapath/proxy.h"
#include "datapath/transport.h"
#include "driver.h"

#define SLOT 4096u     /* payload slot size */
#define SEND_SLOTS 64u /* send region: SEND_SLOTS * SLOT */
#define NCOUNTERS 512u
#define SEC 1000000000ull

#define FAIL(...)                                                    \
        do {                                                         \
                fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__); \
                fprintf(stderr, __VA_ARGS__);                        \
                fprintf(stderr, "\n");                               \
                exit(1);                                             \
        } while (0)

static uint8_t pattern(uint64_t seq, uint32_t k) {
        return (uint8_t)(seq * 131u + k * 7u + (seq >> 8));
}

static uint32_t length_of(uint64_t seq) {
        return 1 + (uint32_t)((seq * 2654435761u) % SLOT);
}

/* A memfd of `len` bytes and our own mapping of it (the client's view). */
static int memfd_map(const char *name, size_t len, void **ret_map) {
        int fd = memfd_create(name, MFD_CLOEXEC);

        if (fd < 0 || ftruncate(fd, (off_t)len) < 0)
                FAIL("memfd %s: %s", name, strerror(errno));
        *ret_map = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (*ret_map == MAP_FAILED)
                FAIL("mmap %s: %s", name, strerror(errno));
        return fd;
}

/* One side: a transport, three regions, a proxy, one ring to the peer. */
struct side {
        struct transport t;
        struct tp_mr *send_mr, *recv_mr, *ctr_mr;
        uint8_t *send, *recv;
        uint64_t *ctr;
        size_t recv_len;
        uint32_t tp_peer, tp_gen;
        struct proxy *proxy;
        int ring_fd;
        struct drv_ring ring;
        uint64_t count; /* descriptors to send */
};

static struct tp_mr *reg(struct side *s, int fd, size_t len, const char *name) {
        struct tp_mem mem = { .kind = TP_MEM_MEMFD, .fd = fd, .length = len, .name = name };
        char err[ERRMSG_MAX];
        struct tp_mr *mr;
        int r = s->t.ops->mr_new(s->t.tp, &mem, &mr, err);

        if (r < 0)
                FAIL("%s", err);
        close(fd);
        return mr;
}

/* What one side sends the other out of band. */
struct oob {
        uint32_t blob_len;
        uint8_t blob[TP_ADDR_MAX];
        struct tp_rkey recv, ctr;
};

static void xfer(int sock, struct oob *mine, struct oob *theirs) {
        if (write(sock, mine, sizeof(*mine)) != (ssize_t)sizeof(*mine) ||
            read(sock, theirs, sizeof(*theirs)) != (ssize_t)sizeof(*theirs))
                FAIL("out-of-band exchange: %s", strerror(errno));
}

static void side_setup(struct side *s, const struct tp_config *cfg, int sock, uint64_t count,
                       uint32_t timeout_ms) {
        struct proxy_params params = { .timeout_ms = timeout_ms, .idle_spins = 2000 };
        struct oob mine = { 0 }, theirs;
        struct proxy_route route;
        char err[ERRMSG_MAX];
        size_t len;
        void *map;
        int fd, r;

        s->count = count;
        r = transport_open(cfg, &s->t, err);
        if (r == -ENODEV || r == -ENOENT) {
                printf("SKIP: %s\n", err);
                exit(77);
        }
        if (r < 0)
                FAIL("%s", err);
        fd = memfd_map("send", SEND_SLOTS * SLOT, &map);
        s->send = map;
        s->send_mr = reg(s, fd, SEND_SLOTS * SLOT, "test send region");
        s->recv_len = (size_t)count * SLOT;
        fd = memfd_map("recv", s->recv_len, &map);
        s->recv = map;
        s->recv_mr = reg(s, fd, s->recv_len, "test receive region");
        fd = memfd_map("counters", NCOUNTERS * 8, &map);
        s->ctr = map;
        s->ctr_mr = reg(s, fd, NCOUNTERS * 8, "test counters");

        if (proxy_new(&s->t, &params, "test", &s->proxy, err) < 0)
                FAIL("%s", err);
        if (proxy_peer_new(s->proxy, "the other side", &s->tp_peer, &s->tp_gen, mine.blob, &len, err) < 0)
                FAIL("%s", err);
        mine.blob_len = (uint32_t)len;
        s->t.ops->mr_rkey(s->recv_mr, &mine.recv);
        s->t.ops->mr_rkey(s->ctr_mr, &mine.ctr);
        if (sock >= 0)
                xfer(sock, &mine, &theirs);
        else
                theirs = mine; /* loop: send to ourselves */
        if (proxy_peer_connect(s->proxy, s->tp_peer, s->tp_gen, theirs.blob, theirs.blob_len, err) < 0)
                FAIL("%s", err);
        if (proxy_ring_create(256, &s->ring_fd, err) < 0)
                FAIL("%s", err);
        route = (struct proxy_route){
                .tp_peer = s->tp_peer, .tp_gen = s->tp_gen, .data = theirs.recv, .counters = theirs.ctr
        };
        if (proxy_ring_add(s->proxy, 1, s->ring_fd, s->send_mr, &route, 1, err) < 0)
                FAIL("%s", err);
        map = mmap(NULL, PROXY_RING_BYTES(256), PROT_READ | PROT_WRITE, MAP_SHARED, s->ring_fd, 0);
        if (map == MAP_FAILED)
                FAIL("mmap ring: %s", strerror(errno));
        drv_ring_init(&s->ring, map);
}

static void side_teardown(struct side *s) {
        proxy_free(s->proxy);
        s->t.ops->mr_free(s->t.tp, s->send_mr);
        s->t.ops->mr_free(s->t.tp, s->recv_mr);
        s->t.ops->mr_free(s->t.tp, s->ctr_mr);
        transport_close(&s->t);
        munmap(s->ring.hdr, PROXY_RING_BYTES(256));
        close(s->ring_fd);
}

/* The producer: descriptor i carries length_of(i) pattern bytes from send
 * slot i % SEND_SLOTS to receive slot i and sets counter i % NCOUNTERS to
 * i + 1. `count` = UINT64_MAX sends until an error. Returns 0 or -errno. */
static int produce(struct side *s, uint64_t count, uint64_t deadline) {
        for (uint64_t i = 0; i < count; i++) {
                uint32_t len = length_of(i);
                uint8_t *src = s->send + (i % SEND_SLOTS) * SLOT;
                struct proxy_desc d = { 0 };
                int r;

                /* The send slot is ours again once its last user is done. */
                if (i >= SEND_SLOTS && (r = drv_wait_done(&s->ring, i - SEND_SLOTS + 1, deadline)) < 0)
                        return r;
                for (uint32_t k = 0; k < len; k++)
                        src[k] = pattern(i, k);
                d.src_offset = (i % SEND_SLOTS) * SLOT;
                d.dst_offset = (i * SLOT) % s->recv_len;
                d.length = len;
                d.peer = 0;
                d.flags = PROXY_DESC_SIGNAL;
                d.signal_id = (uint32_t)(i % NCOUNTERS);
                d.signal_value = i + 1;
                if ((r = drv_push(&s->ring, &d, deadline)) < 0)
                        return r;
        }
        return drv_wait_done(&s->ring, count, deadline);
}

static void *produce_thread(void *arg) {
        struct side *s = arg;

        return (void *)(intptr_t)produce(s, s->count, drv_now_ns() + 60 * SEC);
}

/* The receiver: waits for counter i % NCOUNTERS >= i + 1, then checks every
 * byte of descriptor i. */
static void consume(struct side *s, uint64_t count) {
        uint64_t deadline = drv_now_ns() + 60 * SEC;

        for (uint64_t i = 0; i < count; i++) {
                int r = drv_wait_counter(&s->ctr[i % NCOUNTERS], i + 1, s->ring.hdr, deadline);
                const uint8_t *dst = s->recv + i * SLOT;

                if (r < 0)
                        FAIL("descriptor %" PRIu64 ": counter %" PRIu64 " never reached %" PRIu64 ": %s", i,
                             i % NCOUNTERS, i + 1, strerror(-r));
                for (uint32_t k = 0; k < length_of(i); k++)
                        if (dst[k] != pattern(i, k))
                                FAIL("descriptor %" PRIu64 " byte %u: got %#x, want %#x", i, k, dst[k],
                                     pattern(i, k));
        }
        for (uint64_t j = 0; j < NCOUNTERS && j < count; j++) {
                uint64_t last = count - 1 - ((count - 1 - j) % NCOUNTERS);

                if (s->ctr[j] != last + 1)
                        FAIL("counter %" PRIu64 ": %" PRIu64 ", want %" PRIu64, j, s->ctr[j], last + 1);
        }
}

static int test_loop(void) {
        struct tp_config cfg = { .backend = "loop" };
        struct proxy_desc bad = { .length = 8, .peer = 7 };
        struct proxy_event ev;
        struct side s = { 0 };
        pthread_t th;
        void *ret;
        int r;

        side_setup(&s, &cfg, -1, 20000, 5000);
        pthread_create(&th, NULL, produce_thread, &s);
        consume(&s, s.count);
        pthread_join(th, &ret);
        if ((intptr_t)ret != 0)
                FAIL("producer: %s", strerror(-(int)(intptr_t)ret));
        printf("loop: %" PRIu64 " descriptors, every byte and counter arrived\n", s.count);

        /* A descriptor naming a route that does not exist sets the ring's
         * error and is reported; it does not stop the proxy. */
        if ((r = drv_push(&s.ring, &bad, drv_now_ns() + 5 * SEC)) < 0)
                FAIL("push: %s", strerror(-r));
        r = drv_wait_done(&s.ring, s.count + 1, drv_now_ns() + 5 * SEC);
        if (r != -EINVAL || s.ring.hdr->error_seq != s.count || s.ring.hdr->error_peer != 7)
                FAIL("bad descriptor: got %d seq %" PRIu64 " peer %u", r, s.ring.hdr->error_seq,
                     s.ring.hdr->error_peer);
        for (uint64_t t0 = drv_now_ns(); !proxy_event_next(s.proxy, &ev);)
                if (drv_now_ns() - t0 > 5 * SEC)
                        FAIL("no ring-error event");
        if (ev.type != PROXY_EVENT_RING_ERROR || ev.error != -EINVAL)
                FAIL("event %s %d: %s", proxy_event_type_to_string(ev.type), ev.error, ev.msg);
        printf("loop: bad descriptor -> %s\n", ev.msg);

        if (proxy_ring_remove(s.proxy, 1) < 0 || proxy_ring_remove(s.proxy, 99) != -ENOENT)
                FAIL("ring remove");
        for (uint64_t t0 = drv_now_ns(); !proxy_event_next(s.proxy, &ev);)
                if (drv_now_ns() - t0 > 5 * SEC)
                        FAIL("no ring-removed event");
        if (ev.type != PROXY_EVENT_RING_REMOVED || ev.ring_id != 1)
                FAIL("event %s: %s", proxy_event_type_to_string(ev.type), ev.msg);
        printf("loop: %s\n", ev.msg);
        side_teardown(&s);

        /* A write into a region deregistered meanwhile fails (a remote
         * access error, as a NIC reports it): its own ring fails, the peer
         * does not (an error about that write alone: another job's rings
         * to the same peer go on); it does not copy into memory that is
         * gone. */
        {
                struct proxy_desc d = {
                        .length = 64, .flags = PROXY_DESC_SIGNAL, .signal_id = 1, .signal_value = 99
                };
                struct side s2 = { 0 };
                bool seen = false, peer_failed = false;

                side_setup(&s2, &cfg, -1, 10, 5000);
                if ((r = produce(&s2, 10, drv_now_ns() + 5 * SEC)) < 0)
                        FAIL("released: the first 10: %s", strerror(-r));
                consume(&s2, 10);
                s2.t.ops->mr_free(s2.t.tp, s2.recv_mr);
                s2.recv_mr = NULL;
                if ((r = drv_push(&s2.ring, &d, drv_now_ns() + 5 * SEC)) < 0)
                        FAIL("released: push: %s", strerror(-r));
                r = drv_wait_done(&s2.ring, 11, drv_now_ns() + 5 * SEC);
                if (r != -EACCES)
                        FAIL("released: a write into a deregistered region ended with %d (%s), want -EACCES",
                             r, strerror(-r));
                for (uint64_t t0 = drv_now_ns(); !seen && drv_now_ns() - t0 < 5 * SEC;)
                        while (proxy_event_next(s2.proxy, &ev)) {
                                seen |= ev.type == PROXY_EVENT_RING_ERROR && ev.error == -EACCES;
                                peer_failed |= ev.type == PROXY_EVENT_PEER_FAILED;
                        }
                if (!seen || peer_failed)
                        FAIL("released: ring-error event %s, peer-failed event %s: want the first only",
                             seen ? "seen" : "missing", peer_failed ? "seen" : "missing");
                printf("loop: a write into a deregistered region: %s, its ring failed, its peer did not\n",
                       strerror(-r));
                side_teardown(&s2);
        }
        return 0;
}

static const struct tp_config fabric_cfg = { .backend = "fabric", .provider = "tcp", .node = "127.0.0.1" };

/* Both processes: set up, send `count` to the other while checking what
 * the other sends, then agree to stop. */
static int fabric_side(int sock, uint64_t count) {
        struct side s = { 0 };
        pthread_t th;
        void *ret;
        char done = 'd';

        side_setup(&s, &fabric_cfg, sock, count, 10000);
        pthread_create(&th, NULL, produce_thread, &s);
        consume(&s, count);
        pthread_join(th, &ret);
        if ((intptr_t)ret != 0)
                FAIL("producer: %s", strerror(-(int)(intptr_t)ret));
        /* Keep progressing (the proxy polls) until the other side has all. */
        if (write(sock, &done, 1) != 1 || read(sock, &done, 1) != 1)
                FAIL("final handshake: %s", strerror(errno));
        printf("fabric tcp (pid %d): sent %" PRIu64 " descriptors; received %" PRIu64
               ", every byte and counter arrived\n",
               (int)getpid(), count, count);
        side_teardown(&s);
        return 0;
}

static int run_two(int (*fn)(int sock, uint64_t count, pid_t other), uint64_t count) {
        int sv[2], status, r;
        pid_t child;

        if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) < 0)
                FAIL("socketpair: %s", strerror(errno));
        child = fork();
        if (child == 0) {
                close(sv[0]);
                r = fn(sv[1], count, 0);
                fflush(stdout);
                _exit(r);
        }
        close(sv[1]);
        status = fn(sv[0], count, child);
        if (status == 77) {
                kill(child, SIGKILL);
                waitpid(child, NULL, 0);
                return 77;
        }
        if (waitpid(child, &status, 0) < 0)
                FAIL("waitpid");
        if (WIFEXITED(status) && WEXITSTATUS(status) == 0)
                return 0;
        if (WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL)
                return 0; /* the kill test's victim */
        FAIL("child: status %#x", status);
}

static int fabric_both(int sock, uint64_t count, pid_t other) {
        (void)other;
        return fabric_side(sock, count);
}

static void probe_fabric(void) {
        struct transport t;
        char err[ERRMSG_MAX];
        int r = transport_open(&fabric_cfg, &t, err);

        if (r < 0) {
                printf("SKIP: libfabric tcp on 127.0.0.1 unavailable: %s\n", err);
                exit(77);
        }
        transport_close(&t);
}

/* The survivor (other != 0) waits until the victim got 500 descriptors
 * through, kills it and measures how long its producer and its counter
 * waiter take to see the error. The victim just runs until killed. */
static int kill_side(int sock, uint64_t count, pid_t other) {
        struct side s = { 0 };
        uint64_t t_kill, t_prod = 0, t_wait = 0, deadline;
        struct pollfd pfd = { .fd = sock, .events = POLLIN };
        int r_prod = 0, r_wait = 0;
        bool told = false;

        (void)count;
        side_setup(&s, &fabric_cfg, sock, 4096, 2000);
        if (!other) {
                produce(&s, UINT64_MAX, drv_now_ns() + 120 * SEC);
                pause();
                return 0;
        }
        deadline = drv_now_ns() + 60 * SEC;
        if (drv_wait_counter(&s.ctr[499], 500, s.ring.hdr, deadline) < 0)
                FAIL("the victim's first 500 descriptors did not arrive");
        for (uint64_t i = 0; i < 500; i++) {
                struct proxy_desc d = { .src_offset = 0,
                                        .dst_offset = i * 64,
                                        .length = 64,
                                        .flags = PROXY_DESC_SIGNAL,
                                        .signal_id = 0,
                                        .signal_value = i + 1 };
                if (drv_push(&s.ring, &d, deadline) < 0)
                        FAIL("push before the kill");
        }
        if (drv_wait_done(&s.ring, 500, deadline) < 0)
                FAIL("our first 500 descriptors did not complete");
        kill(other, SIGKILL);
        t_kill = drv_now_ns();
        /* Keep sending as a kernel would, waiting for each to be done; and,
         * as the mesh would, tell the proxy when the peer's socket closes.
         * The producer must see an error: from the transport, the proxy's
         * write timeout, or the mesh report, whichever comes first. */
        for (uint64_t i = 500; !t_prod; i++) {
                struct proxy_desc d = { .dst_offset = (i % 1000) * 64,
                                        .length = 64,
                                        .flags = PROXY_DESC_SIGNAL,
                                        .signal_value = i + 1 };

                r_prod = drv_push(&s.ring, &d, t_kill + 30 * SEC);
                if (r_prod == 0)
                        r_prod = drv_wait_done(&s.ring, i + 1, drv_now_ns() + 100000000ull);
                if (r_prod != 0 && r_prod != -ETIMEDOUT)
                        t_prod = drv_now_ns();
                else if (drv_now_ns() > t_kill + 30 * SEC)
                        FAIL("producer: no error 30 s after the peer was killed");
                if (!told && poll(&pfd, 1, 0) == 1 && drv_now_ns() > t_kill + 3 * SEC) {
                        /* Give the transport 3 s to notice on its own first. */
                        proxy_peer_fail(s.proxy, s.tp_peer, s.tp_gen, -ECONNRESET);
                        told = true;
                }
        }
        /* The receive side: a counter the dead peer will never set. */
        r_wait = drv_wait_counter(&s.ctr[NCOUNTERS - 1], UINT64_MAX, s.ring.hdr, drv_now_ns() + 10 * SEC);
        t_wait = drv_now_ns();
        printf("kill: producer got %s after %.3f s (error_peer %u, %s); counter waiter got %s\n",
               strerror(-r_prod), (double)(t_prod - t_kill) / 1e9, s.ring.hdr->error_peer,
               told ? "reported by the mesh stand-in" : "found by the proxy", strerror(-r_wait));
        if (r_wait == -ETIMEDOUT || r_wait == 0)
                FAIL("counter waiter did not see the error");
        if (t_wait - t_kill > 15 * SEC)
                FAIL("errors took %.1f s", (double)(t_wait - t_kill) / 1e9);
        {
                /* The proxy sets the ring's error before it queues the
                 * event: wait for it as the event loop would. */
                struct pollfd efd = { .fd = proxy_event_fd(s.proxy), .events = POLLIN };
                struct proxy_event ev;
                bool seen = false;

                for (uint64_t t0 = drv_now_ns(); !seen && drv_now_ns() - t0 < 5 * SEC;) {
                        poll(&efd, 1, 100);
                        while (proxy_event_next(s.proxy, &ev))
                                if (ev.type == PROXY_EVENT_PEER_FAILED) {
                                        printf("kill: event: %s\n", ev.msg);
                                        seen = true;
                                }
                }
                if (!seen)
                        FAIL("no peer-failed event within 5 s of the error");
        }
        side_teardown(&s);
        return 0;
}

/* A region released while the other side still writes into it (the
 * documented failure, docs/protocol.md "A region a rank releases while
 * others still write into it fails the transport connection"): the
 * receiver (other == 0) takes 100 descriptors, then deregisters its receive
 * region and says so; the writer's next descriptor into it must end with an
 * error on its ring within 15 s, and the proxy must report the peer failed.
 * A write that is reported done writes nowhere the receiver can see. */
static int released_side(int sock, uint64_t count, pid_t other) {
        struct side s = { 0 };
        uint64_t deadline, t0;
        struct proxy_desc d = { .src_offset = 0,
                                .dst_offset = 0,
                                .length = 64,
                                .flags = PROXY_DESC_SIGNAL,
                                .signal_id = 1,
                                .signal_value = 1000 };
        char c = 'r';
        int r;

        (void)count;
        side_setup(&s, &fabric_cfg, sock, 100, 10000);
        deadline = drv_now_ns() + 60 * SEC;
        if (!other) {
                /* The receiver: the first 100, then the release. */
                consume(&s, 100);
                s.t.ops->mr_free(s.t.tp, s.recv_mr);
                s.recv_mr = NULL;
                if (write(sock, &c, 1) != 1 || read(sock, &c, 1) != 1)
                        FAIL("release handshake: %s", strerror(errno));
                side_teardown(&s);
                return 0;
        }
        if ((r = produce(&s, 100, deadline)) < 0)
                FAIL("the first 100 descriptors: %s", strerror(-r));
        if (read(sock, &c, 1) != 1)
                FAIL("release handshake: %s", strerror(errno));
        t0 = drv_now_ns();
        if ((r = drv_push(&s.ring, &d, t0 + 15 * SEC)) < 0)
                FAIL("push after the release: %s", strerror(-r));
        r = drv_wait_done(&s.ring, 101, t0 + 15 * SEC);
        printf("released: a write into the released region ended with %d (%s) after %.3f s, ring error %d\n",
               r, r ? strerror(-r) : "done, no error", (double)(drv_now_ns() - t0) / 1e9,
               (int)s.ring.hdr->error);
        if (r == 0)
                FAIL("a write into a released region was reported done with no error");
        if (r == -ETIMEDOUT)
                FAIL("a write into a released region neither completed nor failed in 15 s");
        {
                struct pollfd efd = { .fd = proxy_event_fd(s.proxy), .events = POLLIN };
                struct proxy_event ev;
                bool seen = false;

                for (t0 = drv_now_ns(); !seen && drv_now_ns() - t0 < 5 * SEC;) {
                        poll(&efd, 1, 100);
                        while (proxy_event_next(s.proxy, &ev))
                                if (ev.type == PROXY_EVENT_PEER_FAILED) {
                                        printf("released: event: %s\n", ev.msg);
                                        seen = true;
                                }
                }
                if (!seen)
                        FAIL("no peer-failed event within 5 s of the error");
        }
        if (write(sock, &c, 1) != 1)
                FAIL("release handshake: %s", strerror(errno));
        side_teardown(&s);
        return 0;
}

/* The next event of `type` within 5 s (others are printed), or false. */
static bool event_wait(struct proxy *px, enum proxy_event_type type, struct proxy_event *ev) {
        struct pollfd efd = { .fd = proxy_event_fd(px), .events = POLLIN };

        for (uint64_t t0 = drv_now_ns(); drv_now_ns() - t0 < 5 * SEC;) {
                poll(&efd, 1, 100);
                while (proxy_event_next(px, ev)) {
                        printf("stall: event: %s\n", ev->msg);
                        if (ev->type == type)
                                return true;
                }
        }
        return false;
}

/* Forced draining on a real transport: the receiver (other == 0) only
 * waits; the writer stops it, leaves 199 writes on their way (libfabric
 * tcp completes a write once the target acknowledged it), fails the peer
 * and waits until timeout_ms gave them up and the peer was freed
 * (fi_av_remove with the writes still queued in the provider). Index 0
 * then serves a new transport peer, to the writer's own endpoint, whose
 * ring moves 100 descriptors (every byte and counter checked) while the
 * receiver, resumed, acknowledges the old writes: their completions come
 * late, name given-up slots and are ignored. The old ring's next
 * descriptor is refused, naming the old generation. */
static int stall_side(int sock, uint64_t count, pid_t other) {
        struct proxy_desc d = { .length = 64, .flags = PROXY_DESC_SIGNAL, .signal_value = 1 };
        struct proxy_route route;
        struct proxy_event ev;
        struct proxy_stats st;
        struct drv_ring old;
        struct side s = { 0 };
        uint8_t blob[TP_ADDR_MAX];
        char err[ERRMSG_MAX];
        uint32_t peer, gen;
        size_t len;
        void *map;
        int fd, r;

        (void)count;
        side_setup(&s, &fabric_cfg, sock, 100, 500);
        if (!other) {
                pause();
                return 0;
        }
        /* One write first: the provider connects on the first. */
        if (drv_push(&s.ring, &d, drv_now_ns() + 5 * SEC) < 0 ||
            drv_wait_done(&s.ring, 1, drv_now_ns() + 5 * SEC))
                FAIL("stall: the first write did not complete");
        kill(other, SIGSTOP);
        for (uint64_t i = 1; i < 200; i++) {
                d = (struct proxy_desc){ .dst_offset = (i % 100) * SLOT,
                                         .length = SLOT,
                                         .flags = PROXY_DESC_SIGNAL,
                                         .signal_value = i + 1 };
                if ((r = drv_push(&s.ring, &d, drv_now_ns() + 5 * SEC)) < 0)
                        FAIL("stall: push %" PRIu64 ": %s", i, strerror(-r));
        }
        for (uint64_t t0 = drv_now_ns(); DRV_LOAD_ACQ(&s.ring.hdr->head) < 200;)
                if (drv_now_ns() - t0 > 5 * SEC)
                        FAIL("stall: the proxy took %" PRIu64 " of 200 descriptors", s.ring.hdr->head);
        if (DRV_LOAD_ACQ(&s.ring.hdr->done) == 200)
                FAIL("stall: every write completed with the receiver stopped");
        if (proxy_peer_fail(s.proxy, s.tp_peer, s.tp_gen, -ECONNRESET) < 0)
                FAIL("stall: proxy_peer_fail");
        if (!event_wait(s.proxy, PROXY_EVENT_PEER_FREED, &ev) || !strstr(ev.msg, "never completed"))
                FAIL("stall: the peer was not freed with its writes given up on");

        /* Index 0 again, the next generation, to our own endpoint. */
        if (proxy_peer_new(s.proxy, "self", &peer, &gen, blob, &len, err) < 0 ||
            proxy_peer_connect(s.proxy, peer, gen, blob, len, err) < 0)
                FAIL("stall: %s", err);
        if (peer != s.tp_peer || gen == s.tp_gen)
                FAIL("stall: the new peer is %u generation %u, the old %u generation %u", peer, gen,
                     s.tp_peer, s.tp_gen);
        route = (struct proxy_route){ .tp_peer = peer, .tp_gen = gen };
        s.t.ops->mr_rkey(s.recv_mr, &route.data);
        s.t.ops->mr_rkey(s.ctr_mr, &route.counters);
        if (proxy_ring_create(256, &fd, err) < 0 ||
            proxy_ring_add(s.proxy, 2, fd, s.send_mr, &route, 1, err) < 0)
                FAIL("stall: %s", err);
        map = mmap(NULL, PROXY_RING_BYTES(256), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (map == MAP_FAILED)
                FAIL("stall: mmap: %s", strerror(errno));
        old = s.ring;
        drv_ring_init(&s.ring, map);
        kill(other, SIGCONT);
        if ((r = produce(&s, 100, drv_now_ns() + 30 * SEC)) < 0)
                FAIL("stall: the new peer's ring: %s", strerror(-r));
        consume(&s, 100);
        proxy_stats_get(s.proxy, &st);
        printf("stall: the new peer moved 100 descriptors, every byte and counter; %" PRIu64
               " writes given up on, %" PRIu64 " late completions ignored\n",
               st.cancelled, st.stale);
        if (st.cancelled == 0)
                FAIL("stall: no write was given up on");

        /* The old ring writes on: refused, naming the old generation. */
        d = (struct proxy_desc){ .length = 64, .flags = PROXY_DESC_SIGNAL, .signal_value = 1 };
        if (drv_push(&old, &d, drv_now_ns() + 5 * SEC) < 0)
                FAIL("stall: push on the old ring");
        if (!event_wait(s.proxy, PROXY_EVENT_ROUTE_DEAD, &ev) || ev.ring_id != 1 ||
            !strstr(ev.msg, "is gone"))
                FAIL("stall: the old ring's descriptor was not refused as a route to a gone generation");
        kill(other, SIGKILL);
        munmap(map, PROXY_RING_BYTES(256));
        close(fd);
        s.ring = old;
        side_teardown(&s);
        return 0;
}

static int test_verbs(void) {
        struct tp_config cfg = { .backend = "verbs" };
        struct transport t;
        char err[ERRMSG_MAX];
        int r = transport_open(&cfg, &t, err);

        if (r == -ENODEV) {
                printf("SKIP: %s\n", err);
                return 77;
        }
        if (r < 0)
                FAIL("%s", err);
        transport_close(&t);
        printf("verbs: opened and closed the first device\n");
        return 0;
}

int main(int argc, char **argv) {
        const char *what = argc > 1 ? argv[1] : "";

        signal(SIGPIPE, SIG_IGN);
        if (strcmp(what, "loop") == 0)
                return test_loop();
        if (strcmp(what, "fabric") == 0) {
                probe_fabric();
                return run_two(fabric_both, 3000);
        }
        if (strcmp(what, "kill") == 0) {
                probe_fabric();
                return run_two(kill_side, 0);
        }
        if (strcmp(what, "released") == 0) {
                probe_fabric();
                return run_two(released_side, 0);
        }
        if (strcmp(what, "stall") == 0) {
                probe_fabric();
                return run_two(stall_side, 0);
        }
        if (strcmp(what, "verbs") == 0)
                return test_verbs();
        fprintf(stderr, "usage: %s loop|fabric|kill|released|stall|verbs\n", argv[0]);
        return 2;
}
