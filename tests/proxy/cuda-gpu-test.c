/* moeep-cuda-gpu-test: the cuda transport on a real GPU, without kernels,
 * ranks or daemons: two transport instances in this process (standing for
 * two daemons) and cuMem allocations exported as POSIX fds (as ranks make
 * them). It isolates the transport from everything above it, so that a
 * failure of the GPU suites across two daemons can be placed.
 *
 *   1. host -> device: A writes a pattern from a memfd into B's GPU region;
 *   2. device -> device, the GPUDirect case: B writes that GPU region into
 *      A's GPU region, then an 8-byte signal from host memory into A's GPU
 *      counters, ordered after the data;
 *   3. device -> host: A writes its GPU region into a memfd of B's, and the
 *      memfd (read by the CPU) must hold the pattern; the counter, brought
 *      back the same way, must hold the signal.
 * B's byte counters must show step 2's payload as device-to-device.
 * First, the dma-buf a NIC's transport would register: one allocation is
 * exported with cumem_export_dmabuf, must be a dma-buf fd (its link names
 * "dmabuf") and the cuda transport must refuse it with a message. A driver
 * that cannot export dma-bufs is reported, not failed.
 *
 * Exit status: 0 passed, 1 failed (one line naming the step), 77 without a
 * CUDA driver or device. */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "cumem.h"
#include "datapath/transport.h"
#include "log.h"

#define SIZE (4u << 20)
#define LEN (3u << 20)

#define FAIL(...)                                      \
        do {                                           \
                fprintf(stderr, "FAIL: " __VA_ARGS__); \
                fputc('\n', stderr);                   \
                exit(1);                               \
        } while (0)

static int memfd_of(size_t size) {
        int fd = memfd_create("cuda-gpu-test", MFD_CLOEXEC);

        if (fd < 0 || ftruncate(fd, (off_t)size) < 0)
                FAIL("memfd: %s", strerror(errno));
        return fd;
}

static struct tp_mr *reg(struct transport *t, enum tp_mem_kind kind, int fd, void *addr, uint64_t len,
                         const char *name) {
        struct tp_mem m = { .kind = kind, .fd = fd, .addr = addr, .length = len, .name = name };
        char err[ERRMSG_MAX];
        struct tp_mr *mr;

        if (t->ops->mr_new(t->tp, &m, &mr, err) < 0)
                FAIL("%s", err);
        return mr;
}

/* The dma-buf export of `m` (see the top of this file). */
static void dmabuf_check(const struct cumem_api *cu, const struct cumem_mapping *m, struct transport *t) {
        char path[64], link[256] = "", err[ERRMSG_MAX];
        struct tp_mem mem = { .kind = TP_MEM_DMABUF, .length = m->size, .name = "dma-buf" };
        struct tp_mr *mr = NULL;
        CUresult cr;
        ssize_t n;
        int fd = -1;

        cr = cumem_export_dmabuf(cu, m, &fd);
        if (cr != CUDA_SUCCESS) {
                printf("dma-buf export not available here: %s\n", cumem_strerror(cu, cr));
                return;
        }
        snprintf(path, sizeof(path), "/proc/self/fd/%d", fd);
        n = readlink(path, link, sizeof(link) - 1);
        if (n <= 0 || !strstr(link, "dmabuf"))
                FAIL("dma-buf export: fd %d is '%s', not a dma-buf", fd, link);
        mem.fd = fd;
        if (t->ops->mr_new(t->tp, &mem, &mr, err) == 0)
                FAIL("the cuda transport took a dma-buf region");
        printf("dma-buf export: fd %d is %s (%zu bytes); the cuda transport refuses it: %s\n", fd, link,
               m->size, err);
        close(fd);
}

/* One write and its completion (bounded). */
static void put(struct transport *t, uint32_t peer, struct tp_mr *src, uint64_t src_off, struct tp_mr *dst_mr,
                uint64_t dst_off, uint64_t len, uint64_t cookie, const char *what) {
        struct tp_completion c;
        struct tp_rkey rk;
        int r, n = 0;

        t->ops->mr_rkey(dst_mr, &rk);
        r = t->ops->write(t->tp, peer, src, src_off, &rk, dst_off, len, cookie, 0, TP_WRITE_ORDERED);
        if (r < 0)
                FAIL("%s: write: %s", what, strerror(-r));
        for (int i = 0; i < 10000000 && n == 0; i++)
                n = t->ops->poll(t->tp, &c, 1);
        if (n != 1 || c.cookie != cookie || c.status != 0)
                FAIL("%s: completion %d, cookie %" PRIu64 ", status %d", what, n, n ? c.cookie : 0,
                     n ? c.status : 0);
}

int main(void) {
        struct tp_config cfg = { .backend = "cuda", .device = "0" };
        const struct cumem_api *cu;
        struct cumem_mapping gpu[3];
        struct transport a, b;
        struct tp_stats st;
        uint8_t blob_a[TP_ADDR_MAX], blob_b[TP_ADDR_MAX];
        char err[ERRMSG_MAX];
        uint32_t pa = 0, pb = 0; /* each transport's first peer index (no proxy here) */
        size_t la, lb;
        const char *why;
        int fd[3], host_src = memfd_of(SIZE), host_dst = memfd_of(SIZE), r;
        uint8_t *src_map, *dst_map;
        uint64_t *stage;

        if (cumem_api_get(&cu, &why) < 0) {
                printf("SKIP: %s\n", why);
                return 77;
        }
        r = transport_open(&cfg, &a, err);
        if (r == -ENODEV) {
                printf("SKIP: %s\n", err);
                return 77;
        }
        if (r < 0 || transport_open(&cfg, &b, err) < 0)
                FAIL("%s", err);
        for (int i = 0; i < 3; i++) {
                CUresult cr = cumem_alloc_exportable(cu, 0, SIZE, &gpu[i], &fd[i]);

                if (cr != CUDA_SUCCESS)
                        FAIL("cuMem allocation %d: %s", i, cumem_strerror(cu, cr));
        }
        dmabuf_check(cu, &gpu[0], &a);
        if (a.ops->peer_new(a.tp, pa, blob_a, &la, err) < 0 ||
            b.ops->peer_new(b.tp, pb, blob_b, &lb, err) < 0 ||
            a.ops->peer_connect(a.tp, pa, blob_b, lb, err) < 0 ||
            b.ops->peer_connect(b.tp, pb, blob_a, la, err) < 0)
                FAIL("peers: %s", err);

        src_map = mmap(NULL, SIZE, PROT_READ | PROT_WRITE, MAP_SHARED, host_src, 0);
        dst_map = mmap(NULL, SIZE, PROT_READ | PROT_WRITE, MAP_SHARED, host_dst, 0);
        if (src_map == MAP_FAILED || dst_map == MAP_FAILED || posix_memalign((void **)&stage, 4096, 4096))
                FAIL("maps: %s", strerror(errno));
        for (size_t i = 0; i < LEN; i++)
                src_map[i] = (uint8_t)(i * 131 + 7);

        /* A: host source, its GPU region, its GPU counters; B: its GPU region,
         * the host target, its signal staging. */
        struct tp_mr *a_src = reg(&a, TP_MEM_MEMFD, host_src, NULL, SIZE, "A host source");
        struct tp_mr *a_gpu = reg(&a, TP_MEM_CUMEM, fd[0], NULL, SIZE, "A GPU region");
        struct tp_mr *a_ctr = reg(&a, TP_MEM_CUMEM, fd[1], NULL, SIZE, "A GPU counters");
        struct tp_mr *b_gpu = reg(&b, TP_MEM_CUMEM, fd[2], NULL, SIZE, "B GPU region");
        struct tp_mr *b_dst = reg(&b, TP_MEM_MEMFD, host_dst, NULL, SIZE, "B host target");
        struct tp_mr *b_stage = reg(&b, TP_MEM_HOST, -1, stage, 4096, "B signal staging");

        put(&a, pa, a_src, 0, b_gpu, 4096, LEN, 1, "1. host -> B's GPU region");
        stage[3] = 0x5157a1u;
        put(&b, pb, b_gpu, 4096, a_gpu, 0, LEN, 2, "2. B's GPU region -> A's GPU region");
        put(&b, pb, b_stage, 24, a_ctr, 64, 8, 3, "2. signal -> A's GPU counters");
        b.ops->stats(b.tp, &st);
        if (st.device != LEN || st.host != 0 || st.daemon != 8)
                FAIL("2. B's counters: device %" PRIu64 ", host %" PRIu64 ", daemon %" PRIu64
                     " (want %u, 0, 8)",
                     st.device, st.host, st.daemon, LEN);
        put(&a, pa, a_gpu, 0, b_dst, 0, LEN, 4, "3. A's GPU region -> B's host target");
        put(&a, pa, a_ctr, 64, b_dst, LEN, 8, 5, "3. A's counter -> B's host target");
        for (size_t i = 0; i < LEN; i++)
                if (dst_map[i] != (uint8_t)(i * 131 + 7))
                        FAIL("3. byte %zu is %u, want %u", i, dst_map[i], (uint8_t)(i * 131 + 7));
        if (*(uint64_t *)(dst_map + LEN) != 0x5157a1u)
                FAIL("3. the counter holds %#" PRIx64, *(uint64_t *)(dst_map + LEN));
        printf("ok: %u bytes host -> GPU -> GPU (other instance) -> host and a signal into GPU counters\n",
               LEN);

        a.ops->mr_free(a.tp, a_src);
        a.ops->mr_free(a.tp, a_gpu);
        a.ops->mr_free(a.tp, a_ctr);
        b.ops->mr_free(b.tp, b_gpu);
        b.ops->mr_free(b.tp, b_dst);
        b.ops->mr_free(b.tp, b_stage);
        transport_close(&a);
        transport_close(&b);
        for (int i = 0; i < 3; i++) {
                cumem_mapping_release(cu, &gpu[i]);
                close(fd[i]);
        }
        return 0;
}
