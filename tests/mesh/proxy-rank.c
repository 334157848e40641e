/* moeep-proxy-rank: one rank of a job that spans two daemons, writing to
 * the ranks at the other daemon through moeepd's internode proxy path, from
 * the CPU, exactly as the kernels will (daemon/datapath/proxy.h, "Memory ordering";
 * tests/proxy/driver.h). proxy.sh starts four of these, two at each daemon.
 *
 *   moeep-proxy-rank --socket PATH --id-file FILE --world N --rank R
 *                    (--create|--join) --mode MODE [--count K] [--size S]
 *                    [--ready-file FILE] [--timeout SECONDS] [--duration MS] [--uid N]
 *
 * Every mode: create or join the job (the unique id goes through FILE, as
 * in mesh-rank.c), register the three proxy regions (sealed memfds), pass a
 * barrier, open a channel (retrying after a barrier while the daemon says
 * -EAGAIN would be a bug here: every region was registered before it).
 *
 * --mode data: K descriptors to every rank at the other daemon, each with a
 *   pseudo-random length (1..S) and payload and its own counter
 *   (signal_id = my_rank * K + i, a distinct value); then every byte that
 *   arrived from each remote rank is checked, the bytes after each payload
 *   stay zero, and every counter holds its value. Prints the descriptor rate
 *   (push of the first to done of the last). Ranks 0 and world/2 then
 *   ping-pong one descriptor (64-byte payload and a signal) 1000 times and
 *   rank 0 prints the round-trip median. Barrier, leave.
 * --mode bad-local: rank 1 writes one descriptor naming rank 0 (at its own
 *   daemon): its ring must fail with -EINVAL, error_peer 0; every rank
 *   then sees the job aborted, with a PeerLost naming rank 1 and "not
 *   routed" in its reason.
 * --mode bad-range: the same from rank world-1 with a dst_offset past rank
 *   0's recv region: "range outside a region".
 * --mode stream-ok: the same for --duration MS (3000), with other jobs'
 *   faults around it: it must end without a ring error or an abort.
 * --mode release-write: rank 0 releases its recv region; rank world/2 (at
 *   the other daemon) keeps writing to it: its ring must fail with -EINVAL
 *   naming peer 0, and every rank then sees the job aborted with a PeerLost
 *   naming it, "released" in its reason.
 * --mode flood: ranks 0 and world/2 (at different daemons) write
 *   descriptors of their whole send region into each other's recv region
 *   as fast as their ring (1024 descriptors) takes them, for --duration MS,
 *   without a ring error or an abort and with some done; then, past a
 *   barrier, they exit with the rest queued (the daemon removes the ring
 *   once nothing of it is in flight; the first to go fails the other's
 *   ring, which is no test failure). The proxy must hold each back: at most FLOOD_MAX_BYTES of
 *   its payload taken and not done at any time (it prints the most seen),
 *   the ring full meanwhile. The other ranks wait at a barrier. With --uid
 *   N every rank drops to uid N first (another tenant).
 * --mode stream: descriptors to the remote ranks without end; once 2000
 *   finished it creates FILE (--ready-file). It must end with the ring's
 *   error or the job's abort word (the test kills the other daemon) and
 *   prints which, with CLOCK_REALTIME in ns, so that the script can time it.
 * --mode elastic: as stream (FILE once 2000 finished), but the test kills
 *   one rank: a remote rank that the control page marks lost is written to
 *   for LOST_WRITE_MS more (as an elastic endpoint's kernels may, until
 *   they notice), then no more, and the others LOST_AFTER_MS past that,
 *   longer than the daemon keeps a lost rank's regions. The ring must never
 *   fail (writes in flight to a lost rank land; the job's abort word is
 *   expected), and it ends 0.
 *
 * Two modes without a ring, in a job of their own of one rank (no
 * --id-file, --world or --rank), after dropping to --uid N where given:
 * --mode retire: registers and releases --count K sparse memfd recv
 *   regions of --size S bytes, each released at once (the daemon retires
 *   its mapping for 10 s); the next must be refused with -EUSERS naming
 *   max_proxy_bytes_per_uid (the retired ones still count) and it prints
 *   "refused" (and creates --ready-file if given); after --duration MS (past the linger) one more must be
 *   registered.
 * --mode victim: one recv region of --size S bytes must be registered
 *   (another uid's retired regions do not count against it), then a send
 *   region of 2 S must be refused with -EUSERS naming max_proxy_bytes (the
 *   daemon-wide cap).
 *
 * Exit status: 0 when everything checked out, 1 on a mismatch (one line on
 * stderr naming the rank, the check and the value seen), 2 on bad usage.
 * Every wait is bounded by --timeout (default 30 s); SIGALRM at twice that
 * ends it otherwise. */
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <sched.h>
#include <inttypes.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "client-internal.h"
#include "driver.h"
#include "../job-id.h"
#include "moeep.h"

#define RANK_PROGRAM "proxy-rank"
#include "rank-fail.h"

static uint64_t deadline_ns;
static uint32_t duration_ms = 3000; /* --duration, for stream-ok */

/* ------------------------------------------------------------ regions */

struct region {
        int fd;
        uint8_t *map;
        uint64_t size;
        uint64_t id; /* the daemon's region id */
};

/* A sealed memfd of `size` bytes, mapped; registered with `role`. */
static int region_new(struct moeep_client *c, struct region *ret, uint64_t size, enum moeep_proxy_role role,
                      const char *name) {
        uint64_t id;
        int r;

        ret->size = size;
        ret->fd = memfd_create(name, MFD_CLOEXEC | MFD_ALLOW_SEALING);
        if (ret->fd < 0 || ftruncate(ret->fd, (off_t)size) < 0 ||
            fcntl(ret->fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) < 0)
                return fail("%s region of %" PRIu64 " bytes: %s", name, size, strerror(errno));
        ret->map = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, ret->fd, 0);
        if (ret->map == MAP_FAILED)
                return fail("%s region: mmap: %s", name, strerror(errno));
        r = client_proxy_region_register(c, ret->fd, size, role, 0, &id);
        if (r < 0)
                return fail("registering the %s region: %s (%s)", name, strerror(-r), moeep_client_error(c));
        ret->id = id;
        return 0;
}

static void region_free(struct region *reg) {
        if (reg->map && reg->map != MAP_FAILED)
                munmap(reg->map, reg->size);
        if (reg->fd >= 0)
                close(reg->fd);
}

/* ------------------------------------------------------------ payloads */

static uint64_t mix(uint64_t x) {
        x ^= x >> 33;
        x *= 0xff51afd7ed558ccdull;
        x ^= x >> 33;
        x *= 0xc4ceb9fe1a85ec53ull;
        return x ^ (x >> 33);
}

static uint64_t seed(uint32_t src, uint32_t dst, uint32_t i) {
        return mix(((uint64_t)src << 48) ^ ((uint64_t)dst << 32) ^ i ^ 0x6d6f656570ull);
}

static uint32_t payload_len(uint32_t src, uint32_t dst, uint32_t i, uint32_t max) {
        return 1 + (uint32_t)(seed(src, dst, i) % max);
}

static uint8_t payload_byte(uint64_t s, uint32_t j) {
        return (uint8_t)(mix(s + j / 8) >> (8 * (j % 8)));
}

static uint64_t signal_value(uint32_t src, uint32_t dst, uint32_t i) {
        return ((uint64_t)(src + 1) << 40) | ((uint64_t)(dst + 1) << 24) | (i + 1);
}

/* ------------------------------------------------------------ the modes */

struct ctx {
        struct moeep_client *c;
        const volatile struct moeep_control_page *page;
        int world, rank;
        uint32_t local, remote; /* bit masks of moeep_job_ranks() */
        uint32_t count, size;
        struct region send, recv, counters;
        struct drv_ring ring;
        void *ring_map;
        size_t ring_bytes;
        int ring_fd;
};

/* The ring's error, else -ENOTCONN when the job's abort word is set. */
static int health(const struct ctx *x) {
        int err = DRV_LOAD_ACQ(&x->ring.hdr->error);

        if (err)
                return err;
        return __atomic_load_n(&x->page->abort, __ATOMIC_ACQUIRE) ? -ENOTCONN : 0;
}

/* drv_wait_counter() that also watches the job's abort word. */
static int wait_counter(const struct ctx *x, uint64_t *counter, uint64_t value) {
        unsigned spins = 0;
        int err;

        while (DRV_LOAD_ACQ(counter) < value) {
                if ((err = health(x)) != 0)
                        return err;
                if ((++spins & 1023) == 0) {
                        if (drv_now_ns() > deadline_ns)
                                return -ETIMEDOUT;
                        /* Four ranks and two proxies share a CI machine's
                         * few cores: a spinning kernel has an SM of its own. */
                        sched_yield();
                }
        }
        return 0;
}

/* Writes one descriptor; -ENOTCONN when the job's abort word is set,
 * unless `elastic` (an elastic job goes on after a loss). */
static int push_desc(struct ctx *x, uint32_t peer, uint64_t src_off, uint64_t dst_off, uint32_t len,
                     uint32_t signal_id, uint64_t value, bool elastic) {
        struct proxy_desc d = { .src_offset = src_off,
                                .dst_offset = dst_off,
                                .signal_value = value,
                                .length = len,
                                .peer = peer,
                                .signal_id = signal_id,
                                .flags = PROXY_DESC_SIGNAL };
        int r = drv_push(&x->ring, &d, deadline_ns);

        return r == 0 && !elastic && __atomic_load_n(&x->page->abort, __ATOMIC_ACQUIRE) ? -ENOTCONN : r;
}

static int push(struct ctx *x, uint32_t peer, uint64_t src_off, uint64_t dst_off, uint32_t len,
                uint32_t signal_id, uint64_t value) {
        return push_desc(x, peer, src_off, dst_off, len, signal_id, value, false);
}

/* Slot of (peer, i) in a region: one S-byte slot per (rank, descriptor). */
static uint64_t slot(const struct ctx *x, uint32_t rank, uint32_t i) {
        return ((uint64_t)rank * x->count + i) * x->size;
}

static int cmp_u64(const void *a, const void *b) {
        uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;

        return x < y ? -1 : x > y;
}

static int ping_pong(struct ctx *x) {
        enum {
                ITERS = 1000
        };
        uint32_t other = x->rank == 0 ? (uint32_t)x->world / 2 : 0;
        uint64_t ping_src = slot(x, (uint32_t)x->world, 0), ping_id = (uint64_t)x->world * x->count;
        uint64_t *counter = (uint64_t *)x->counters.map + ping_id;
        uint64_t *rtt = calloc(ITERS, sizeof(*rtt));
        int r = 0;

        if (!(x->remote & (1u << other)))
                return fail("ping-pong: rank %" PRIu32 " is not at the other daemon", other);
        if (!rtt)
                return fail("ping-pong: out of memory");
        for (uint32_t n = 1; n <= ITERS && r == 0; n++) {
                uint64_t t0 = drv_now_ns();

                if (x->rank == 0) {
                        r = push(x, other, ping_src, ping_src, 64, (uint32_t)ping_id, n);
                        if (r == 0)
                                r = wait_counter(x, counter, n);
                } else {
                        r = wait_counter(x, counter, n);
                        if (r == 0)
                                r = push(x, other, ping_src, ping_src, 64, (uint32_t)ping_id, n);
                }
                rtt[n - 1] = drv_now_ns() - t0;
        }
        if (r < 0) {
                free(rtt);
                return fail("ping-pong with rank %" PRIu32 ": %s", other, strerror(-r));
        }
        if (x->rank == 0) {
                qsort(rtt, ITERS, sizeof(*rtt), cmp_u64);
                printf("proxy-rank 0: one-descriptor round trip to rank %" PRIu32
                       " (64 B + signal, %d times): "
                       "p50 %.1f us, p99 %.1f us\n",
                       other, ITERS, rtt[ITERS / 2] / 1e3, rtt[ITERS * 99 / 100] / 1e3);
        }
        free(rtt);
        return 0;
}

static int mode_data(struct ctx *x) {
        uint64_t total = 0, bytes = 0, t0, t1;
        uint64_t *counters = (uint64_t *)x->counters.map;
        int r;

        /* Interleaved over the remote ranks, as a dispatch would be. */
        t0 = drv_now_ns();
        for (uint32_t i = 0; i < x->count; i++)
                for (uint32_t d = 0; d < (uint32_t)x->world; d++) {
                        uint64_t s = seed((uint32_t)x->rank, d, i);
                        uint32_t len = payload_len((uint32_t)x->rank, d, i, x->size);
                        uint8_t *src = x->send.map + slot(x, d, i);

                        if (!(x->remote & (1u << d)))
                                continue;
                        for (uint32_t j = 0; j < len; j++)
                                src[j] = payload_byte(s, j);
                        r = push(x, d, slot(x, d, i), slot(x, (uint32_t)x->rank, i), len,
                                 (uint32_t)x->rank * x->count + i, signal_value((uint32_t)x->rank, d, i));
                        if (r < 0)
                                return fail("descriptor %" PRIu32 " to rank %" PRIu32 ": %s", i, d,
                                            strerror(-r));
                        total++;
                        bytes += len;
                }
        r = drv_wait_done(&x->ring, x->ring.tail, deadline_ns);
        t1 = drv_now_ns();
        if (r < 0)
                return fail("waiting for %" PRIu64 " descriptors to finish (done %" PRIu64 "): %s", total,
                            DRV_LOAD_ACQ(&x->ring.hdr->done), strerror(-r));
        printf("proxy-rank %d: %" PRIu64 " descriptors (%" PRIu64 " bytes + signals) to %d remote ranks in "
               "%.1f ms: %.0f desc/s, %.1f MB/s\n",
               x->rank, total, bytes, __builtin_popcount(x->remote), (t1 - t0) / 1e6,
               total / ((t1 - t0) / 1e9), bytes / ((t1 - t0) / 1e3));

        /* What the remote ranks sent us: counter, then every byte. */
        for (uint32_t src = 0; src < (uint32_t)x->world; src++) {
                if (!(x->remote & (1u << src)))
                        continue;
                for (uint32_t i = 0; i < x->count; i++) {
                        uint64_t want = signal_value(src, (uint32_t)x->rank, i),
                                 s = seed(src, (uint32_t)x->rank, i);
                        uint32_t len = payload_len(src, (uint32_t)x->rank, i, x->size);
                        const uint8_t *got = x->recv.map + slot(x, src, i);

                        r = wait_counter(x, &counters[src * x->count + i], want);
                        if (r < 0)
                                return fail("counter %" PRIu32 " (from rank %" PRIu32 ", descriptor %" PRIu32
                                            "): %s, holds %#" PRIx64 ", want %#" PRIx64,
                                            src * x->count + i, src, i, strerror(-r),
                                            DRV_LOAD_ACQ(&counters[src * x->count + i]), want);
                        if (DRV_LOAD_ACQ(&counters[src * x->count + i]) != want)
                                return fail("counter %" PRIu32 " holds %#" PRIx64 ", want %#" PRIx64,
                                            src * x->count + i, counters[src * x->count + i], want);
                        for (uint32_t j = 0; j < x->size; j++) {
                                uint8_t w = j < len ? payload_byte(s, j) : 0;

                                if (got[j] != w)
                                        return fail("from rank %" PRIu32 ", descriptor %" PRIu32 " (%" PRIu32
                                                    " bytes): byte %" PRIu32 " is %#x, want %#x",
                                                    src, i, len, j, got[j], w);
                        }
                }
        }
        /* Counters of ranks at this daemon were never written. */
        for (uint32_t src = 0; src < (uint32_t)x->world; src++)
                for (uint32_t i = 0; i < x->count && !(x->remote & (1u << src)); i++)
                        if (counters[src * x->count + i])
                                return fail("counter %" PRIu32 " of local rank %" PRIu32 " was written", i,
                                            src);
        printf("proxy-rank %d: every byte and counter from %d remote ranks checked (%" PRIu32 " each)\n",
               x->rank, __builtin_popcount(x->remote), x->count);

        r = moeep_job_barrier(x->c);
        if (r < 0)
                return fail("barrier after the data: %s (%s)", strerror(-r), moeep_client_error(x->c));
        /* Ranks 0 and world/2 are at different daemons (proxy.sh). */
        if (x->rank == 0 || x->rank == x->world / 2) {
                r = ping_pong(x);
                if (r)
                        return r;
        }
        r = moeep_job_barrier(x->c);
        if (r < 0)
                return fail("last barrier: %s (%s)", strerror(-r), moeep_client_error(x->c));
        return 0;
}

/* Rank `bad` writes one bad descriptor; every rank then checks the abort. */
static int mode_bad(struct ctx *x, bool local) {
        int bad = local ? 1 : x->world - 1;
        const char *want = local ? "not routed" : "range outside a region";
        struct moeep_event ev;
        int r;

        if (x->rank == bad) {
                /* rank 0 is at our daemon (local) or at the other one. */
                r = push(x, 0, 0, local ? 0 : x->recv.size, 8, 0, 1);
                if (r < 0)
                        return fail("pushing the bad descriptor: %s", strerror(-r));
                while ((r = DRV_LOAD_ACQ(&x->ring.hdr->error)) == 0 && drv_now_ns() < deadline_ns)
                        ;
                if (r != -EINVAL || x->ring.hdr->error_peer != 0 || x->ring.hdr->error_seq != 0)
                        return fail("ring error %d (%s), peer %" PRIu32 ", descriptor %" PRIu64
                                    ": want -EINVAL, peer 0, descriptor 0",
                                    r, r ? strerror(-r) : "none", x->ring.hdr->error_peer,
                                    x->ring.hdr->error_seq);
                printf("proxy-rank %d: bad descriptor (%s): ring error %s, peer 0, descriptor 0\n", x->rank,
                       local ? "a rank at its own daemon" : "offset past the region", strerror(-r));
        }
        while (!__atomic_load_n(&x->page->abort, __ATOMIC_ACQUIRE) && drv_now_ns() < deadline_ns)
                usleep(1000);
        if (!x->page->abort || x->page->lost_rank != bad)
                return fail("job abort word %u, lost rank %d: want 1 and %d", x->page->abort,
                            x->page->lost_rank, bad);
        /* The PeerLost event with the proxy's reason; a barrier lets it in. */
        r = moeep_job_barrier(x->c);
        if (r != -ENOTCONN)
                return fail("barrier on the aborted job: %d (%s), want -ENOTCONN", r,
                            moeep_client_error(x->c));
        while ((r = moeep_event_next(x->c, &ev)) == 1 &&
               !(ev.type == MOEEP_EVENT_PEER_LOST && ev.rank == bad))
                ;
        if (r != 1)
                return fail("no PeerLost event naming rank %d (%d)", bad, r);
        if (!strstr(ev.reason, want))
                return fail("PeerLost reason '%s' does not say '%s'", ev.reason, want);
        printf("proxy-rank %d: job aborted, PeerLost rank %d: %s\n", x->rank, bad, ev.reason);
        return 0;
}

/* Streams to every remote rank until an error, or until `until_ns` (then
 * returns 0 without a ring error or abort); creates `ready_file` once 2000
 * rounds are done. */
static int stream(struct ctx *x, const char *ready_file, uint64_t until_ns, uint64_t *ret_rounds) {
        uint64_t n = 0;
        bool ready = false;
        int r = 0;

        while (drv_now_ns() < until_ns) {
                for (uint32_t d = 0; d < (uint32_t)x->world && r == 0; d++) {
                        uint32_t i = (uint32_t)(n % x->count);

                        if (!(x->remote & (1u << d)))
                                continue;
                        /* Slot (d, i) again only once its last use is done. */
                        if (n >= x->count)
                                r = drv_wait_done(&x->ring, x->ring.tail + 1 - x->count, deadline_ns);
                        if (r == 0)
                                r = push(x, d, slot(x, d, i), slot(x, (uint32_t)x->rank, i), x->size,
                                         (uint32_t)x->rank * x->count + i, n + 1);
                }
                if (r == 0)
                        r = health(x);
                if (r < 0)
                        break;
                n++;
                if (!ready && n >= 2000 && DRV_LOAD_ACQ(&x->ring.hdr->done) >= 2000) {
                        int fd = ready_file ? open(ready_file, O_WRONLY | O_CREAT | O_CLOEXEC, 0600) : -1;

                        if (fd >= 0)
                                close(fd);
                        ready = true;
                }
        }
        *ret_rounds = n;
        return r;
}

static int mode_stream(struct ctx *x, const char *ready_file) {
        struct timespec ts;
        uint64_t n;
        int r = stream(x, ready_file, deadline_ns, &n);

        clock_gettime(CLOCK_REALTIME, &ts);
        if (r == 0 || r == -ETIMEDOUT)
                return fail("streaming: no error within the timeout (%" PRIu64 " rounds)", n);
        printf("proxy-rank %d: stream ended after %" PRIu64 " rounds: %s (ring error %d, peer %" PRId32
               ", abort word %u, lost rank %d) at %lld%09ld\n",
               x->rank, n, strerror(-r), x->ring.hdr->error, (int32_t)x->ring.hdr->error_peer, x->page->abort,
               x->page->lost_rank, (long long)ts.tv_sec, ts.tv_nsec);
        return 0;
}

#define LOST_WRITE_MS 300
#define LOST_AFTER_MS 1500

static int mode_elastic(struct ctx *x, const char *ready_file) {
        uint64_t n = 0, lost_ns = 0;
        uint32_t skip = 0, lost = 0;
        bool ready = false;
        int r = 0;

        while (drv_now_ns() < deadline_ns) {
                const uint64_t now = drv_now_ns();

                lost = __atomic_load_n(&x->page->lost_ranks, __ATOMIC_ACQUIRE);
                if (lost && !lost_ns)
                        lost_ns = now;
                if (lost_ns && now > lost_ns + LOST_WRITE_MS * 1000000ull)
                        skip = lost;
                if (lost_ns && now > lost_ns + (LOST_WRITE_MS + LOST_AFTER_MS) * 1000000ull)
                        break;
                for (uint32_t d = 0; d < (uint32_t)x->world && r == 0; d++) {
                        uint32_t i = (uint32_t)(n % x->count);

                        if (!(x->remote & (1u << d)) || (skip & (1u << d)))
                                continue;
                        if (n >= x->count)
                                r = drv_wait_done(&x->ring, x->ring.tail + 1 - x->count, deadline_ns);
                        if (r == 0)
                                r = push_desc(x, d, slot(x, d, i), slot(x, (uint32_t)x->rank, i), x->size,
                                              (uint32_t)x->rank * x->count + i, n + 1, true);
                }
                if (r == 0)
                        r = DRV_LOAD_ACQ(&x->ring.hdr->error);
                if (r < 0)
                        return fail("elastic: the ring failed after %" PRIu64 " rounds: %s (peer %" PRId32
                                    "), lost ranks 0x%x",
                                    n, strerror(-r), (int32_t)x->ring.hdr->error_peer, lost);
                n++;
                if (!ready && n >= 2000 && DRV_LOAD_ACQ(&x->ring.hdr->done) >= 2000) {
                        int fd = open(ready_file, O_WRONLY | O_CREAT | O_CLOEXEC, 0600);

                        if (fd >= 0)
                                close(fd);
                        ready = true;
                }
        }
        if (!lost_ns)
                return fail("elastic: no rank was marked lost within the timeout (%" PRIu64 " rounds)", n);
        if ((r = drv_wait_done(&x->ring, x->ring.tail, deadline_ns)) < 0)
                return fail("elastic: the last writes did not finish: %s", strerror(-r));
        printf("proxy-rank %d: elastic: %" PRIu64
               " rounds; wrote to lost ranks 0x%x for %d ms after the loss, "
               "then %d ms to the others: no ring error\n",
               x->rank, n, lost & x->remote, LOST_WRITE_MS, LOST_AFTER_MS);
        return 0;
}

/* `r`, else the wait for every descriptor pushed to be done, else health(). */
static int drain(struct ctx *x, int r) {
        if (r == 0)
                r = drv_wait_done(&x->ring, x->ring.tail, deadline_ns);
        return r == 0 ? health(x) : r;
}

/* Streams for `ms` milliseconds, another job's faults around it: must end
 * without a ring error or an abort, its last writes done. */
static int mode_stream_ok(struct ctx *x, const char *ready_file, uint32_t ms) {
        uint64_t n;
        int r = drain(x, stream(x, ready_file, drv_now_ns() + (uint64_t)ms * 1000000u, &n));

        if (r < 0)
                return fail("streaming for %" PRIu32 " ms: %s after %" PRIu64
                            " rounds (ring error %d, peer %" PRId32 ", abort word %u, lost rank %d)",
                            ms, strerror(-r), n, x->ring.hdr->error, (int32_t)x->ring.hdr->error_peer,
                            x->page->abort, x->page->lost_rank);
        printf("proxy-rank %d: streamed %" PRIu64 " rounds for %" PRIu32 " ms, no error\n", x->rank, n, ms);
        /* Nobody leaves while others still stream: one leaving is no fault. */
        r = moeep_job_barrier(x->c);
        if (r == 0)
                r = health(x);
        if (r == 0)
                r = moeep_job_leave(x->c);
        if (r < 0)
                return fail("after streaming: %s (%s)", strerror(-r), moeep_client_error(x->c));
        return 0;
}

/* Rank 0 releases its recv region; rank world/2, at the other daemon,
 * keeps writing to it: its own ring must fail ("released") and the job be
 * aborted naming it, the transport connection and other jobs untouched. */
static int mode_release_write(struct ctx *x) {
        int writer = x->world / 2, r;
        struct moeep_event ev;
        uint64_t n = 0;

        if (x->rank == 0) {
                usleep(300 * 1000); /* while rank world/2 writes to it */
                r = moeep_region_release(x->c, x->recv.id);
                if (r < 0)
                        return fail("releasing the recv region: %s (%s)", strerror(-r),
                                    moeep_client_error(x->c));
        }
        if (x->rank == writer) {
                r = 0;
                while (r == 0 && drv_now_ns() < deadline_ns) {
                        uint32_t i = (uint32_t)(n % x->count);

                        if (n >= x->count)
                                r = drv_wait_done(&x->ring, x->ring.tail + 1 - x->count, deadline_ns);
                        if (r == 0)
                                r = push(x, 0, slot(x, 0, i), slot(x, (uint32_t)x->rank, i), x->size,
                                         (uint32_t)x->rank * x->count + i, n + 1);
                        if (r == 0)
                                r = health(x);
                        n++;
                }
                /* Writes were on their way when the region went (they
                 * landed), then the next one failed the ring. */
                if (DRV_LOAD_ACQ(&x->ring.hdr->error) != -EINVAL || x->ring.hdr->error_peer != 0 ||
                    x->ring.hdr->error_seq == 0)
                        return fail("writing to the released region: ring error %d, peer %" PRId32
                                    ", descriptor %" PRIu64 " of %" PRIu64
                                    ", want -EINVAL naming peer 0 after some got through",
                                    x->ring.hdr->error, (int32_t)x->ring.hdr->error_peer,
                                    x->ring.hdr->error_seq, n);
                printf("proxy-rank %d: %" PRIu64 " descriptors to rank 0's recv region, released meanwhile: "
                       "descriptor %" PRIu64 " failed its ring: %s\n",
                       x->rank, n, x->ring.hdr->error_seq, strerror(EINVAL));
        }
        while (!__atomic_load_n(&x->page->abort, __ATOMIC_ACQUIRE) && drv_now_ns() < deadline_ns)
                usleep(1000);
        if (!x->page->abort || x->page->lost_rank != writer)
                return fail("job abort word %u, lost rank %d: want 1 and %d", x->page->abort,
                            x->page->lost_rank, writer);
        r = moeep_job_barrier(x->c);
        if (r != -ENOTCONN)
                return fail("barrier on the aborted job: %d (%s), want -ENOTCONN", r,
                            moeep_client_error(x->c));
        while ((r = moeep_event_next(x->c, &ev)) == 1 &&
               !(ev.type == MOEEP_EVENT_PEER_LOST && ev.rank == writer))
                ;
        if (r != 1 || !strstr(ev.reason, "released"))
                return fail("no PeerLost event naming rank %d with 'released' in its reason (%d)", writer, r);
        printf("proxy-rank %d: job aborted, PeerLost rank %d: %s\n", x->rank, writer, ev.reason);
        return 0;
}

/* What the proxy may have in flight of one ring's payload (256 MiB,
 * daemon/datapath/proxy.h) plus one descriptor that alone exceeds it. */
#define FLOOD_MAX_BYTES (256ull << 20)

static int mode_flood(struct ctx *x, uint32_t ms) {
        const uint64_t until_ns = drv_now_ns() + (uint64_t)ms * 1000000u;
        const uint32_t len = (uint32_t)x->recv.size, half = (uint32_t)x->world / 2;
        const uint32_t to = x->rank == 0 ? half : 0;
        uint64_t n = 0, most = 0, waited = 0, ndone;
        int r = 0;

        if (x->rank == 0 || x->rank == (int)half) {
                while (r == 0 && drv_now_ns() < until_ns) {
                        uint64_t head = DRV_LOAD_ACQ(&x->ring.hdr->head);
                        uint64_t fin = DRV_LOAD_ACQ(&x->ring.hdr->done);

                        most = head - fin > most ? head - fin : most;
                        if (x->ring.tail - head >= x->ring.cap) {
                                waited++; /* full: the proxy holds us back */
                                usleep(200);
                        } else {
                                r = push(x, to, 0, 0, len, 0, ++n);
                        }
                        if (r == 0)
                                r = health(x);
                }
                ndone = DRV_LOAD_ACQ(&x->ring.hdr->done);
                if (r < 0)
                        return fail("flood: %s after %" PRIu64 " descriptors of %" PRIu32 " bytes, %" PRIu64
                                    " done (ring error %d, abort word %u, lost rank %d)",
                                    strerror(-r), n, len, ndone, x->ring.hdr->error, x->page->abort,
                                    x->page->lost_rank);
                if (most * len > FLOOD_MAX_BYTES + len || !waited || !ndone)
                        return fail("flood: up to %" PRIu64 " descriptors of %" PRIu32
                                    " bytes in flight, the ring full %" PRIu64 " times, %" PRIu64
                                    " done: want at most %llu MiB in flight, the ring held back, some done",
                                    most, len, waited, ndone, FLOOD_MAX_BYTES >> 20);
                printf("proxy-rank %d: flood: %" PRIu64 " descriptors of %" PRIu32 " bytes in %" PRIu32
                       " ms, %" PRIu64 " done; at most %" PRIu64
                       " in flight (%.0f MiB), the ring full %" PRIu64 " times: held back, no error\n",
                       x->rank, n, len, ms, ndone, most, most * (double)len / (1 << 20), waited);
        }
        /* Then out, without a leave's checks: once one flooder is gone,
         * the other's queued descriptors to it fail its ring ("released")
         * and end the job, as they should. */
        r = moeep_job_barrier(x->c);
        if (r < 0)
                return fail("barrier after the flood: %s (%s)", strerror(-r), moeep_client_error(x->c));
        return 0;
}

/* ------------------------------------------------------------ caps */

/* Registers a sparse sealed memfd of `size` bytes with `role`: 0 and its id,
 * or the daemon's refusal (the client's error text in `c`). */
static int region_try(struct moeep_client *c, uint64_t size, enum moeep_proxy_role role, uint64_t *ret_id) {
        int fd = memfd_create("cap", MFD_CLOEXEC | MFD_ALLOW_SEALING), r;

        if (fd < 0 || ftruncate(fd, (off_t)size) < 0 || fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK) < 0) {
                r = -errno;
                if (fd >= 0)
                        close(fd);
                fail("memfd of %" PRIu64 " bytes: %s", size, strerror(-r));
                return r;
        }
        r = client_proxy_region_register(c, fd, size, role, 0, ret_id);
        close(fd);
        return r;
}

/* `r` must be -EUSERS with `want` in the client's error text. */
static int expect_cap(struct moeep_client *c, int r, const char *what, const char *want) {
        if (r != -EUSERS || !strstr(moeep_client_error(c), want))
                return fail("%s: %d (%s), want -EUSERS naming %s", what, r, moeep_client_error(c), want);
        printf("proxy-rank: %s refused: %s\n", what, moeep_client_error(c));
        return 0;
}

static int mode_retire(struct moeep_client *c, uint32_t rounds, uint64_t size, const char *ready_file) {
        uint64_t id;
        int r, fd;

        for (uint32_t i = 0; i < rounds; i++) {
                r = region_try(c, size, MOEEP_PROXY_RECV, &id);
                if (r == 0)
                        r = moeep_region_release(c, id);
                if (r < 0)
                        return fail("round %" PRIu32 " of %" PRIu64 " bytes: %s (%s)", i, size, strerror(-r),
                                    moeep_client_error(c));
        }
        r = expect_cap(c, region_try(c, size, MOEEP_PROXY_RECV, &id), "a region past the released ones",
                       "max_proxy_bytes_per_uid = ");
        if (r)
                return r;
        fd = ready_file ? open(ready_file, O_WRONLY | O_CREAT | O_CLOEXEC, 0644) : -1;
        if (fd >= 0)
                close(fd);
        usleep(duration_ms * 1000u);
        r = region_try(c, size, MOEEP_PROXY_RECV, &id);
        if (r < 0)
                return fail("after %" PRIu32 " ms the retired regions were still charged: %s (%s)",
                            duration_ms, strerror(-r), moeep_client_error(c));
        printf("proxy-rank: %" PRIu32 " regions of %" PRIu64 " bytes released; the next refused; one "
               "registered %" PRIu32 " ms later\n",
               rounds, size, duration_ms);
        return 0;
}

static int mode_victim(struct moeep_client *c, uint64_t size) {
        uint64_t id;
        int r = region_try(c, size, MOEEP_PROXY_RECV, &id);

        if (r < 0)
                return fail("a recv region of %" PRIu64 " bytes while another uid is capped: %s (%s)", size,
                            strerror(-r), moeep_client_error(c));
        return expect_cap(c, region_try(c, 2 * size, MOEEP_PROXY_SEND, &id),
                          "a send region past the daemon's cap", "max_proxy_bytes = ");
}

/* Drops to uid and gid `uid` (-1: stays). */
static int drop_to(long uid) {
        if (uid >= 0 && (setgid((gid_t)uid) < 0 || setuid((uid_t)uid) < 0))
                return fail("dropping to uid %ld: %s", uid, strerror(errno));
        return 0;
}

/* The caps modes: a job of one rank, as uid `uid` (-1: as we are). */
static int run_caps(const char *sock, const char *mode, long uid, uint32_t count, uint64_t size,
                    const char *ready_file) {
        struct moeep_client *c;
        struct moeep_unique_id id;
        int r;

        if (drop_to(uid) < 0)
                return 1;
        r = moeep_connect(sock, &c);
        if (r < 0)
                return fail("connect %s: %s", sock, strerror(-r));
        r = moeep_job_create(c, mode, 1, &id);
        if (r == 0)
                r = moeep_job_join(c, &id, 0, 1, NULL);
        if (r < 0)
                r = fail("job: %s (%s)", strerror(-r), moeep_client_error(c));
        else if (strcmp(mode, "retire") == 0)
                r = mode_retire(c, count, size, ready_file);
        else
                r = mode_victim(c, size);
        moeep_client_free(c);
        return r;
}

/* ------------------------------------------------------------ main */

static int run(struct ctx *x, const char *id_file, bool create, const char *mode, const char *ready_file) {
        struct moeep_unique_id id;
        const char *what;
        uint64_t ring_id;
        uint32_t cap;
        int r;

        if ((r = id_share(x->c, create, "proxy", x->world, id_file, &id, &what)) < 0)
                return fail("%s (%s): %s (%s)", what, id_file, strerror(-r), moeep_client_error(x->c));
        r = moeep_job_join(x->c, &id, x->rank, x->world, NULL);
        if (r == 0)
                r = moeep_job_barrier(x->c);
        if (r == 0)
                r = moeep_job_ranks(x->c, &x->local, &x->remote);
        if (r < 0)
                return fail("join, barrier, ranks: %s (%s)", strerror(-r), moeep_client_error(x->c));
        x->page = moeep_job_control_page(x->c);
        /* One slot per (rank, descriptor) and one more for the ping. */
        if (region_new(x->c, &x->send, slot(x, (uint32_t)x->world, 1), MOEEP_PROXY_SEND, "send") ||
            region_new(x->c, &x->recv, slot(x, (uint32_t)x->world, 1), MOEEP_PROXY_RECV, "recv") ||
            region_new(x->c, &x->counters, ((uint64_t)x->world * x->count + 1) * 8, MOEEP_PROXY_COUNTERS,
                       "counters"))
                return 1;
        r = moeep_job_barrier(x->c);
        if (r < 0)
                return fail("barrier after registering: %s (%s)", strerror(-r), moeep_client_error(x->c));
        r = client_proxy_channel_open(x->c, strcmp(mode, "flood") == 0 ? 1024 : 256, &x->ring_fd, &ring_id,
                                      &cap);
        if (r < 0)
                return fail("channel open: %s (%s)", strerror(-r), moeep_client_error(x->c));
        x->ring_bytes = PROXY_RING_BYTES(cap);
        x->ring_map = mmap(NULL, x->ring_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, x->ring_fd, 0);
        if (x->ring_map == MAP_FAILED)
                return fail("mapping ring %" PRIu64 ": %s", ring_id, strerror(errno));
        drv_ring_init(&x->ring, x->ring_map);
        if (x->ring.cap != cap)
                return fail("ring %" PRIu64 " capacity %" PRIu32 ", the daemon said %" PRIu32, ring_id,
                            x->ring.cap, cap);
        /* Every channel is open before anyone writes (a bad descriptor
         * aborts the job, and ChannelOpen on an aborted job fails). */
        r = moeep_job_barrier(x->c);
        if (r < 0)
                return fail("barrier after the channel: %s (%s)", strerror(-r), moeep_client_error(x->c));
        if (strcmp(mode, "data") == 0)
                r = mode_data(x);
        else if (strcmp(mode, "bad-local") == 0 || strcmp(mode, "bad-range") == 0)
                r = mode_bad(x, strcmp(mode, "bad-local") == 0);
        else if (strcmp(mode, "elastic") == 0)
                r = mode_elastic(x, ready_file);
        else if (strcmp(mode, "stream-ok") == 0)
                r = mode_stream_ok(x, ready_file, duration_ms);
        else if (strcmp(mode, "release-write") == 0)
                r = mode_release_write(x);
        else if (strcmp(mode, "flood") == 0)
                r = mode_flood(x, duration_ms);
        else
                r = mode_stream(x, ready_file);
        if (r == 0 && strcmp(mode, "data") == 0 && (r = moeep_job_leave(x->c)) < 0)
                return fail("leave: %s (%s)", strerror(-r), moeep_client_error(x->c));
        return r;
}

int main(int argc, char **argv) {
        static const struct option opts[] = {
                { "socket", required_argument, NULL, 's' },  { "id-file", required_argument, NULL, 'i' },
                { "world", required_argument, NULL, 'w' },   { "rank", required_argument, NULL, 'r' },
                { "create", no_argument, NULL, 'c' },        { "join", no_argument, NULL, 'j' },
                { "mode", required_argument, NULL, 'm' },    { "count", required_argument, NULL, 'n' },
                { "size", required_argument, NULL, 'z' },    { "ready-file", required_argument, NULL, 'f' },
                { "timeout", required_argument, NULL, 't' }, { "duration", required_argument, NULL, 'd' },
                { "uid", required_argument, NULL, 'u' },     { NULL, 0, NULL, 0 },
        };
        const char *sock = NULL, *id_file = NULL, *mode = "data", *ready_file = NULL;
        struct ctx x = { .world = 0, .count = 500, .size = 1024, .ring_fd = -1 };
        int create = -1, timeout = 30, o, r;
        long uid = -1;

        x.send.fd = x.recv.fd = x.counters.fd = -1;
        while ((o = getopt_long(argc, argv, "", opts, NULL)) != -1) {
                switch (o) {
                case 's':
                        sock = optarg;
                        break;
                case 'i':
                        id_file = optarg;
                        break;
                case 'w':
                        x.world = atoi(optarg);
                        break;
                case 'r':
                        my_rank = x.rank = atoi(optarg);
                        break;
                case 'c':
                        create = 1;
                        break;
                case 'j':
                        create = 0;
                        break;
                case 'm':
                        mode = optarg;
                        break;
                case 'n':
                        x.count = (uint32_t)atoi(optarg);
                        break;
                case 'z':
                        x.size = (uint32_t)strtoul(optarg, NULL, 0);
                        break;
                case 'f':
                        ready_file = optarg;
                        break;
                case 't':
                        timeout = atoi(optarg);
                        break;
                case 'd':
                        duration_ms = (uint32_t)atoi(optarg);
                        break;
                case 'u':
                        uid = atol(optarg);
                        break;
                default:
                        return 2;
                }
        }
        if (sock && (strcmp(mode, "retire") == 0 || strcmp(mode, "victim") == 0)) {
                if (x.count == 0 || x.size == 0) {
                        fprintf(stderr, "usage: see the comment at the top of proxy-rank.c\n");
                        return 2;
                }
                alarm((unsigned)timeout * 2);
                setvbuf(stdout, NULL, _IOLBF, 0);
                return run_caps(sock, mode, uid, x.count, x.size, ready_file);
        }
        if (!sock || !id_file || x.world < 2 || x.world > 32 || x.rank < 0 || x.rank >= x.world ||
            create < 0 || x.count == 0 || x.size < 64 || timeout <= 0 ||
            (strcmp(mode, "data") && strcmp(mode, "bad-local") && strcmp(mode, "bad-range") &&
             strcmp(mode, "stream") && strcmp(mode, "elastic") && strcmp(mode, "stream-ok") &&
             strcmp(mode, "release-write") && strcmp(mode, "flood")) ||
            ((strcmp(mode, "stream") == 0 || strcmp(mode, "elastic") == 0) && !ready_file)) {
                fprintf(stderr, "usage: see the comment at the top of proxy-rank.c\n");
                return 2;
        }
        deadline_ns = drv_now_ns() + (uint64_t)timeout * 1000000000u;
        alarm((unsigned)timeout * 2);
        setvbuf(stdout, NULL, _IOLBF, 0);
        if (drop_to(uid) < 0)
                return 1;
        r = moeep_connect(sock, &x.c);
        if (r < 0)
                return fail("connect %s: %s", sock, strerror(-r));
        r = run(&x, id_file, create == 1, mode, ready_file);
        if (x.ring_map && x.ring_map != MAP_FAILED)
                munmap(x.ring_map, x.ring_bytes);
        if (x.ring_fd >= 0)
                close(x.ring_fd);
        region_free(&x.send);
        region_free(&x.recv);
        region_free(&x.counters);
        moeep_client_free(x.c);
        return r;
}
