/* moeep-proxy-bench: the proxy's descriptor rate and added latency on one
 * host. One process, one transport connected to itself (peer 0 is this
 * process), one proxy thread and one producer thread, as in
 * docs/benchmarks.md, "Internode proxy (CPU, loopback)".
 *
 *   --transport loop|fabric   loop: memcpy that completes at once (the
 *                             proxy's own cost); fabric: libfabric
 *   --provider NAME           fabric provider [tcp]
 *   --count N                 descriptors for the rate runs [2000000]
 *   --size BYTES              payload per descriptor [8]
 *   --iters N                 latency round trips [20000]
 *   --producer cpu|gpu        who writes the ring [cpu]; gpu: one GPU
 *                             thread (kernels/common/ring.cuh) on device 0, the
 *                             ring and counters in mapped host memory
 *
 * Rate: the producer pushes N descriptors as fast as the ring takes them;
 * rate = N / (time until done = N). Two runs: data only (one write per
 * descriptor) and data + signal (two writes).
 * Latency: one descriptor (size bytes + signal) at a time; the time from
 * publishing it to seeing its counter, against the same data + counter
 * writes posted straight on the transport by one thread that polls it.
 * The difference is what the proxy adds per hop. With a GPU producer the
 * baseline is instead the GPU's round trip through host memory to a CPU
 * thread and back (ping-pong), which any path through a CPU proxy pays. */
#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "datapath/proxy.h"
#include "datapath/transport.h"
#include "driver.h"
#include "moeep-config.h"

#if MOEEP_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "bench/bench_kernels.h"
#endif

#define REGION (1u << 20)

static struct {
        struct tp_config cfg;
        uint64_t count;
        uint32_t size, iters;
        bool gpu;
} opt = { .cfg = { .backend = "loop", .provider = "tcp", .node = "127.0.0.1" },
          .count = 2000000,
          .size = 8,
          .iters = 20000 };

struct bench {
        struct transport t;
        uint8_t *src, *dst;
        uint64_t *ctr;
        struct tp_mr *src_mr, *dst_mr, *ctr_mr;
        struct tp_rkey dst_rkey, ctr_rkey;
        uint32_t peer, gen; /* the transport peer to ourselves of the proxy running, or of raw_latency */
};

static void die(const char *what, const char *err) {
        fprintf(stderr, "moeep-proxy-bench: %s: %s\n", what, err);
        exit(1);
}

static struct tp_mr *reg(struct bench *b, void *addr, size_t len, const char *name) {
        struct tp_mem mem = { .kind = TP_MEM_HOST, .addr = addr, .length = len, .name = name };
        char err[ERRMSG_MAX];
        struct tp_mr *mr;

        if (b->t.ops->mr_new(b->t.tp, &mem, &mr, err) < 0)
                die("register", err);
        return mr;
}

static void *alloc(size_t len) {
        void *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);

        if (p == MAP_FAILED)
                die("mmap", strerror(errno));
        return p;
}

static void bench_open(struct bench *b) {
        char err[ERRMSG_MAX];

        if (transport_open(&opt.cfg, &b->t, err) < 0)
                die("transport", err);
        b->src = alloc(REGION);
        b->dst = alloc(REGION);
        b->ctr = alloc(4096);
        b->src_mr = reg(b, b->src, REGION, "bench source");
        b->dst_mr = reg(b, b->dst, REGION, "bench destination");
        b->ctr_mr = reg(b, b->ctr, 4096, "bench counters");
        b->t.ops->mr_rkey(b->dst_mr, &b->dst_rkey);
        b->t.ops->mr_rkey(b->ctr_mr, &b->ctr_rkey);
}

static void bench_close(struct bench *b) {
        b->t.ops->mr_free(b->t.tp, b->src_mr);
        b->t.ops->mr_free(b->t.tp, b->dst_mr);
        b->t.ops->mr_free(b->t.tp, b->ctr_mr);
        transport_close(&b->t);
}

static int cmp_u64(const void *a, const void *b) {
        uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;

        return x < y ? -1 : x > y;
}

static void report_lat(const char *what, uint64_t *ns, uint32_t n) {
        qsort(ns, n, sizeof(*ns), cmp_u64);
        printf("%-34s p50 %7.2f us  p99 %7.2f us  min %7.2f us\n", what, (double)ns[n / 2] / 1e3,
               (double)ns[n * 99 / 100] / 1e3, (double)ns[0] / 1e3);
}

/* The transport alone: data write, then the ordered counter write, polled
 * by this thread until the counter changes. */
static double raw_latency(struct bench *b, uint64_t *ns) {
        struct tp_completion c[64];
        uint64_t *value = (uint64_t *)(b->src + REGION - 8);
        uint8_t blob[TP_ADDR_MAX];
        char err[ERRMSG_MAX];
        size_t len;

        /* No proxy runs now: index 0 is ours to take straight from the
         * transport, and to give back after. */
        b->peer = 0;
        if (b->t.ops->peer_new(b->t.tp, b->peer, blob, &len, err) < 0 ||
            b->t.ops->peer_connect(b->t.tp, b->peer, blob, len, err) < 0)
                die("connect to self", err);
        for (uint32_t i = 0; i < opt.iters; i++) {
                uint64_t t0 = drv_now_ns();
                int inflight = 0;

                *value = i + 1;
                if (b->t.ops->write(b->t.tp, b->peer, b->src_mr, 0, &b->dst_rkey, 0, opt.size, 1, 0, 0) < 0 ||
                    b->t.ops->write(b->t.tp, b->peer, b->src_mr, REGION - 8, &b->ctr_rkey, 8, 8, 2, 0,
                                    TP_WRITE_ORDERED) < 0)
                        die("raw write", "failed");
                inflight = 2;
                while (DRV_LOAD_ACQ(&b->ctr[1]) < i + 1 || inflight > 0) {
                        int n = b->t.ops->poll(b->t.tp, c, 64);

                        if (n < 0 || (n > 0 && c[0].status < 0))
                                die("raw poll", "completion error");
                        inflight -= n > 0 ? n : 0;
                        if (DRV_LOAD_ACQ(&b->ctr[1]) >= i + 1 && !ns[i])
                                ns[i] = drv_now_ns() - t0;
                }
                if (!ns[i])
                        ns[i] = drv_now_ns() - t0;
        }
        report_lat("transport write + counter:", ns, opt.iters);
        b->t.ops->peer_free(b->t.tp, b->peer);
        return (double)ns[opt.iters / 2];
}

static struct proxy *start_proxy(struct bench *b, int *ret_fd, struct drv_ring *ring, uint64_t id) {
        struct proxy_params params = { .idle_spins = UINT32_MAX, .batch = 64, .max_inflight = 1024 };
        struct proxy_route route = { .data = b->dst_rkey, .counters = b->ctr_rkey };
        uint8_t blob[TP_ADDR_MAX];
        char err[ERRMSG_MAX];
        struct proxy *p;
        size_t len;
        void *map;

        /* The transport peer to ourselves, through the proxy (which gives
         * it back in proxy_free). */
        if (proxy_new(&b->t, &params, "bench", &p, err) < 0 ||
            proxy_peer_new(p, "self", &b->peer, &b->gen, blob, &len, err) < 0 ||
            proxy_peer_connect(p, b->peer, b->gen, blob, len, err) < 0)
                die("proxy", err);
        route.tp_peer = b->peer;
        route.tp_gen = b->gen;
        if (proxy_ring_create(4096, ret_fd, err) < 0 ||
            proxy_ring_add(p, id, *ret_fd, b->src_mr, &route, 1, err) < 0)
                die("proxy", err);
        map = mmap(NULL, PROXY_RING_BYTES(4096), PROT_READ | PROT_WRITE, MAP_SHARED, *ret_fd, 0);
        if (map == MAP_FAILED)
                die("mmap ring", strerror(errno));
        drv_ring_init(ring, map);
        return p;
}

static void rate(struct bench *b, bool signal) {
        struct drv_ring ring;
        struct proxy_stats st;
        struct proxy *p;
        uint64_t t0, t1, deadline;
        int fd, r;

        p = start_proxy(b, &fd, &ring, 1);
        deadline = drv_now_ns() + 300ull * 1000000000u;
        t0 = drv_now_ns();
        for (uint64_t i = 0; i < opt.count; i++) {
                struct proxy_desc d = { .src_offset = (i * opt.size) % (REGION / 2),
                                        .dst_offset = (i * opt.size) % (REGION / 2),
                                        .length = opt.size,
                                        .flags = signal ? PROXY_DESC_SIGNAL : 0,
                                        .signal_id = (uint32_t)(i & 255),
                                        .signal_value = i + 1 };

                if ((r = drv_push(&ring, &d, deadline)) < 0)
                        die("push", strerror(-r));
        }
        if ((r = drv_wait_done(&ring, opt.count, deadline)) < 0)
                die("done", strerror(-r));
        t1 = drv_now_ns();
        proxy_stats_get(p, &st);
        printf("rate %-6s %-13s %5u B: %8.3f M descriptors/s (%" PRIu64 " in %.3f s, %" PRIu64
               " writes, %" PRIu64 " EAGAIN)\n",
               b->t.ops->name, signal ? "data+signal" : "data only", opt.size,
               (double)opt.count / ((double)(t1 - t0) / 1e9) / 1e6, opt.count, (double)(t1 - t0) / 1e9,
               st.writes, st.eagain);
        proxy_free(p);
        munmap(ring.hdr, PROXY_RING_BYTES(4096));
        close(fd);
}

static double proxy_latency(struct bench *b, uint64_t *ns) {
        struct drv_ring ring;
        struct proxy *p;
        int fd, r;

        p = start_proxy(b, &fd, &ring, 2);
        memset(b->ctr, 0, 4096);
        for (uint32_t i = 0; i < opt.iters; i++) {
                struct proxy_desc d = {
                        .length = opt.size, .flags = PROXY_DESC_SIGNAL, .signal_id = 2, .signal_value = i + 1
                };
                uint64_t t0 = drv_now_ns(), deadline = t0 + 10ull * 1000000000u;

                if ((r = drv_push(&ring, &d, deadline)) < 0 ||
                    (r = drv_wait_counter(&b->ctr[2], i + 1, ring.hdr, deadline)) < 0)
                        die("latency", strerror(-r));
                ns[i] = drv_now_ns() - t0;
                if ((r = drv_wait_done(&ring, i + 1, deadline)) < 0)
                        die("latency done", strerror(-r));
        }
        report_lat("through the proxy (ring->counter):", ns, opt.iters);
        proxy_free(p);
        munmap(ring.hdr, PROXY_RING_BYTES(4096));
        close(fd);
        return (double)ns[opt.iters / 2];
}

#if MOEEP_HAVE_CUDA
/* Maps host memory for the device; the pointer the kernels use. */
static void *gpu_map(void *host, size_t len) {
        void *dev = NULL;

        if (cudaHostRegister(host, len, cudaHostRegisterMapped) != cudaSuccess ||
            cudaHostGetDevicePointer(&dev, host, 0) != cudaSuccess)
                die("cudaHostRegister", cudaGetErrorString(cudaGetLastError()));
        return dev;
}

/* Runs one mode of ring_bench_kernel; its out[] back in ret (2 entries for
 * RATE, 1 + n for the others). */
static void gpu_launch(void *ring_dev, uint64_t *ctr_dev, uint64_t *ping_dev, int mode, uint32_t n,
                       bool signal, int64_t *ret) {
        const size_t entries = mode == MOEEP_RING_BENCH_RATE ? 2 : 1 + (size_t)n;
        int64_t *out;

        if (cudaMalloc((void **)&out, entries * sizeof(*out)) != cudaSuccess ||
            moeep_launch_ring_bench(ring_dev, ctr_dev, ping_dev, mode, n, opt.size, REGION, signal, out, 0) !=
                    0 ||
            cudaDeviceSynchronize() != cudaSuccess ||
            cudaMemcpy(ret, out, entries * sizeof(*out), cudaMemcpyDeviceToHost) != cudaSuccess)
                die("ring kernel", cudaGetErrorString(cudaGetLastError()));
        cudaFree(out);
        if (ret[0] != 0)
                die("ring kernel", strerror((int)-ret[0]));
}

static void report_gpu_lat(const char *what, int64_t *v, uint32_t n) {
        uint64_t *ns = (uint64_t *)v, sum = 0;

        for (uint32_t i = 0; i < n; i++)
                sum += ns[i];
        report_lat(what, ns, n);
        printf("%-34s mean %6.2f us\n", "", (double)sum / n / 1e3);
}

static volatile int echo_stop;

/* The CPU side of the ping-pong: copies ping[0] to ping[8]. */
static void *echo_main(void *arg) {
        uint64_t *ping = arg, last = 0;

        while (!echo_stop) {
                uint64_t v = DRV_LOAD_ACQ(&ping[0]);
                if (v != last) {
                        DRV_STORE_REL(&ping[8], v);
                        last = v;
                }
        }
        return NULL;
}

/* The GPU as producer: rate (data only, data + signal), one-descriptor
 * latency ring -> counter, and the host-memory ping-pong it is compared
 * with. Returns 77 (skipped) without a CUDA device. */
static int gpu_bench(struct bench *b) {
        uint64_t *ctr_dev, *ping, *ping_dev;
        struct drv_ring ring;
        struct proxy *p;
        pthread_t echo;
        int64_t *out;
        int n = 0, fd;

        if (cudaGetDeviceCount(&n) != cudaSuccess || n < 1) {
                printf("moeep-proxy-bench: no CUDA device: GPU producer skipped\n");
                return 77;
        }
        ping = alloc(4096);
        out = calloc(2 + (size_t)opt.iters, sizeof(*out));
        if (!out)
                die("calloc", strerror(errno));
        if (cudaSetDevice(0) != cudaSuccess)
                die("cudaSetDevice", cudaGetErrorString(cudaGetLastError()));
        ctr_dev = gpu_map(b->ctr, 4096);
        ping_dev = gpu_map(ping, 4096);
        for (int signal = 0; signal < 2; signal++) {
                p = start_proxy(b, &fd, &ring, 10 + (uint64_t)signal);
                gpu_launch(gpu_map(ring.hdr, PROXY_RING_BYTES(4096)), ctr_dev, ping_dev,
                           MOEEP_RING_BENCH_RATE, (uint32_t)opt.count, signal, out);
                printf("rate gpu    %-13s %5u B: %8.3f M descriptors/s (%" PRIu64
                       " in %.3f ms, tail published every %d)\n",
                       signal ? "data+signal" : "data only", opt.size,
                       (double)opt.count / ((double)out[1] / 1e3), opt.count, (double)out[1] / 1e6,
                       MOEEP_RING_BENCH_BATCH);
                cudaHostUnregister(ring.hdr);
                proxy_free(p);
                munmap(ring.hdr, PROXY_RING_BYTES(4096));
                close(fd);
        }
        memset(b->ctr, 0, 4096);
        p = start_proxy(b, &fd, &ring, 12);
        void *ring_dev = gpu_map(ring.hdr, PROXY_RING_BYTES(4096));
        gpu_launch(ring_dev, ctr_dev, ping_dev, MOEEP_RING_BENCH_LATENCY, opt.iters, true, out);
        report_gpu_lat("gpu: ring -> proxy -> counter:", out + 1, opt.iters);
        uint64_t prox = ((uint64_t *)out)[1 + opt.iters / 2];
        if (pthread_create(&echo, NULL, echo_main, ping) != 0)
                die("pthread_create", strerror(errno));
        gpu_launch(ring_dev, ctr_dev, ping_dev, MOEEP_RING_BENCH_PINGPONG, opt.iters, false, out);
        echo_stop = 1;
        pthread_join(echo, NULL);
        report_gpu_lat("gpu: host-memory ping-pong:", out + 1, opt.iters);
        printf("proxy path adds %.2f us per hop over the GPU's host round trip (p50 - p50)\n",
               ((double)prox - (double)((uint64_t *)out)[1 + opt.iters / 2]) / 1e3);
        cudaHostUnregister(ring.hdr);
        proxy_free(p);
        munmap(ring.hdr, PROXY_RING_BYTES(4096));
        close(fd);
        cudaHostUnregister(b->ctr);
        cudaHostUnregister(ping);
        munmap(ping, 4096);
        free(out);
        return 0;
}
#endif

int main(int argc, char **argv) {
        struct bench b = { 0 };
        uint64_t *ns;
        double raw, prox;

        for (int i = 1; i + 1 < argc; i += 2) {
                if (strcmp(argv[i], "--transport") == 0)
                        opt.cfg.backend = argv[i + 1];
                else if (strcmp(argv[i], "--provider") == 0)
                        opt.cfg.provider = argv[i + 1];
                else if (strcmp(argv[i], "--count") == 0)
                        opt.count = strtoull(argv[i + 1], NULL, 0);
                else if (strcmp(argv[i], "--size") == 0)
                        opt.size = (uint32_t)strtoul(argv[i + 1], NULL, 0);
                else if (strcmp(argv[i], "--iters") == 0)
                        opt.iters = (uint32_t)strtoul(argv[i + 1], NULL, 0);
                else if (strcmp(argv[i], "--producer") == 0 && strcmp(argv[i + 1], "cpu") == 0)
                        opt.gpu = false;
                else if (strcmp(argv[i], "--producer") == 0 && strcmp(argv[i + 1], "gpu") == 0)
                        opt.gpu = true;
                else {
                        fprintf(stderr,
                                "usage: %s [--transport loop|fabric] [--provider P] [--count N] "
                                "[--size B] [--iters N] [--producer cpu|gpu]\n",
                                argv[0]);
                        return 2;
                }
        }
        if (opt.size == 0 || opt.size > REGION / 4 || opt.iters == 0 || opt.count == 0) {
                fprintf(stderr, "moeep-proxy-bench: --size 1..%u, --iters and --count > 0\n", REGION / 4);
                return 2;
        }
        bench_open(&b);
        printf("moeep-proxy-bench: transport %s%s%s, %ld CPUs\n", b.t.ops->name,
               strcmp(b.t.ops->name, "fabric") == 0 ? " provider " : "",
               strcmp(b.t.ops->name, "fabric") == 0 ? opt.cfg.provider : "", sysconf(_SC_NPROCESSORS_ONLN));
        if (opt.gpu) {
#if MOEEP_HAVE_CUDA
                int r = gpu_bench(&b);
#else
                int r = 77;
                printf("moeep-proxy-bench: built without CUDA: GPU producer skipped\n");
#endif
                bench_close(&b);
                return r;
        }
        rate(&b, false);
        rate(&b, true);
        ns = calloc(opt.iters, sizeof(*ns));
        raw = raw_latency(&b, ns);
        memset(ns, 0, opt.iters * sizeof(*ns));
        prox = proxy_latency(&b, ns);
        printf("proxy adds %.2f us per hop (p50 through the proxy - p50 of the transport alone)\n",
               (prox - raw) / 1e3);
        free(ns);
        bench_close(&b);
        return 0;
}
