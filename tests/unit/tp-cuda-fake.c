/* The libcuda stand-in of the cuda transport's unit tests; see
 * tp-cuda-fake.h. */
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

#include "tp-cuda-fake.h"

/* cuMem in miniature: an "allocation handle" is a dup of a memfd, an
 * address reservation is PROT_NONE anonymous memory and cuMemMap maps the
 * memfd over it, so that device pointers are host pointers the test can
 * read. Copies run at once (a stream in order); an event reports NOT_READY
 * for `fake_lag` queries after it was recorded. */
int fake_lag;
int fake_events[8192];
int fake_nevents;
int fake_imports;

static tpc_result f_err(tpc_result r, const char **s) {
        *s = "fake driver error";
        return 0;
}
static tpc_result f_init(unsigned f) {
        return 0;
}
static tpc_result f_count(int *n) {
        *n = 1;
        return 0;
}
static tpc_result f_dev(tpc_device *d, int o) {
        *d = o;
        return 0;
}
static tpc_result f_retain(tpc_context *c, tpc_device d) {
        *c = (tpc_context)(uintptr_t)1;
        return 0;
}
static tpc_result f_release_ctx(tpc_device d) {
        return 0;
}
static tpc_result f_set(tpc_context c) {
        return c ? 0 : 1;
}
static tpc_result f_stream(tpc_stream *s, unsigned f) {
        *s = (tpc_stream)(uintptr_t)1;
        return 0;
}
static tpc_result f_stream_op(tpc_stream s) {
        return 0;
}
static tpc_result f_event(tpc_event *e, unsigned f) {
        if (fake_nevents >= 8192)
                return 2;
        *e = (tpc_event)(uintptr_t)(++fake_nevents);
        return 0;
}
static tpc_result f_event_destroy(tpc_event e) {
        return 0;
}
static tpc_result f_record(tpc_event e, tpc_stream s) {
        fake_events[(uintptr_t)e - 1] = fake_lag;
        return 0;
}
static tpc_result f_query(tpc_event e) {
        int *left = &fake_events[(uintptr_t)e - 1];

        if (*left > 0) {
                (*left)--;
                return TPC_ERROR_NOT_READY;
        }
        return 0;
}
static tpc_result f_copy(tpc_devptr dst, tpc_devptr src, size_t n, tpc_stream s) {
        memcpy((void *)(uintptr_t)dst, (void *)(uintptr_t)src, n);
        return 0;
}
static tpc_result f_host_register(void *p, size_t n, unsigned f) {
        return 0;
}
static tpc_result f_host_unregister(void *p) {
        return 0;
}
static tpc_result f_host_ptr(tpc_devptr *d, void *p, unsigned f) {
        *d = (tpc_devptr)(uintptr_t)p;
        return 0;
}
static tpc_result f_import(tpc_mem_handle *h, void *fd, int type) {
        int d = type == TPC_HANDLE_POSIX_FD ? fcntl((int)(uintptr_t)fd, F_DUPFD_CLOEXEC, 3) : -1;

        if (d < 0)
                return 1;
        __atomic_add_fetch(&fake_imports, 1, __ATOMIC_ACQ_REL);
        *h = (tpc_mem_handle)d;
        return 0;
}
static tpc_result f_reserve(tpc_devptr *p, size_t n, size_t a, tpc_devptr addr, unsigned long long f) {
        void *m = mmap(NULL, n, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);

        if (m == MAP_FAILED)
                return 2;
        *p = (tpc_devptr)(uintptr_t)m;
        return 0;
}
static tpc_result f_addr_free(tpc_devptr p, size_t n) {
        return munmap((void *)(uintptr_t)p, n) ? 1 : 0;
}
static tpc_result f_map(tpc_devptr p, size_t n, size_t off, tpc_mem_handle h, unsigned long long f) {
        struct stat st;

        /* The real cuMemMap refuses more than the allocation has. */
        if (fstat((int)h, &st) < 0 || (size_t)st.st_size < n)
                return 1;
        return mmap((void *)(uintptr_t)p, n, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, (int)h, 0) ==
                               MAP_FAILED
                       ? 1
                       : 0;
}
static tpc_result f_unmap(tpc_devptr p, size_t n) {
        return mmap((void *)(uintptr_t)p, n, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0) ==
                               MAP_FAILED
                       ? 1
                       : 0;
}
static tpc_result f_release(tpc_mem_handle h) {
        __atomic_sub_fetch(&fake_imports, 1, __ATOMIC_ACQ_REL);
        return close((int)h) ? 1 : 0;
}
static tpc_result f_access(tpc_devptr p, size_t n, const struct tpc_access_desc *d, size_t c) {
        return d->location_type == TPC_LOCATION_DEVICE && d->flags == TPC_ACCESS_READWRITE ? 0 : 1;
}

const struct tpc_api fake_api = {
        f_err,      f_init,   f_count,     f_dev,       f_retain,        f_release_ctx,
        f_set,      f_stream, f_stream_op, f_stream_op, f_event,         f_event_destroy,
        f_record,   f_query,  f_copy,      f_copy,      f_host_register, f_host_unregister,
        f_host_ptr, f_import, f_reserve,   f_addr_free, f_map,           f_unmap,
        f_release,  f_access,
};

/* A memfd standing for a cuMem allocation of `size` bytes. */
int cumem_fake(size_t size) {
        int fd = memfd_create("fake-cumem", MFD_CLOEXEC);

        assert_true(fd >= 0);
        assert_int_equal(ftruncate(fd, (off_t)size), 0);
        return fd;
}

/* Polls `tp` until it returned `want` completions into out (bounded). */
int poll_n(struct tp *tp, struct tp_completion *out, int want) {
        int got = 0;

        for (int i = 0; i < 100000 && got < want; i++) {
                int n = tp_cuda_ops.poll(tp, out + got, want - got);

                assert_true(n >= 0);
                got += n;
        }
        return got;
}

void pair_transports(struct pair *p) {
        struct tp_config cfg = { .backend = "cuda", .queue_depth = 8 };
        char errmsg[ERRMSG_MAX];

        *p = (struct pair){ 0 };
        assert_int_equal(tpc_open(&cfg, &fake_api, &p->a, errmsg), 0);
        assert_int_equal(tpc_open(&cfg, &fake_api, &p->b, errmsg), 0);
}

/* One side's half: through its proxy when there is one, as datapath.c
 * makes it, else straight through the backend under index 0. */
static void half_new(struct tp *tp, struct proxy *px, uint32_t *ret_peer, uint32_t *ret_gen, uint8_t *blob,
                     size_t *ret_len) {
        char errmsg[ERRMSG_MAX];

        if (px) {
                assert_int_equal(proxy_peer_new(px, "the other", ret_peer, ret_gen, blob, ret_len, errmsg),
                                 0);
                return;
        }
        *ret_peer = 0;
        *ret_gen = 0;
        assert_int_equal(tp_cuda_ops.peer_new(tp, 0, blob, ret_len, errmsg), 0);
}

static void half_connect(struct tp *tp, struct proxy *px, uint32_t peer, uint32_t gen, const uint8_t *blob,
                         size_t len) {
        char errmsg[ERRMSG_MAX];

        if (px)
                assert_int_equal(proxy_peer_connect(px, peer, gen, blob, len, errmsg), 0);
        else
                assert_int_equal(tp_cuda_ops.peer_connect(tp, peer, blob, len, errmsg), 0);
}

void pair_connect(struct pair *p, struct proxy *pxa, struct proxy *pxb) {
        uint8_t blob_a[TP_ADDR_MAX], blob_b[TP_ADDR_MAX];
        size_t la, lb;

        half_new(p->a, pxa, &p->a_peer, &p->a_gen, blob_a, &la);
        half_new(p->b, pxb, &p->b_peer, &p->b_gen, blob_b, &lb);
        half_connect(p->a, pxa, p->a_peer, p->a_gen, blob_b, lb);
        half_connect(p->b, pxb, p->b_peer, p->b_gen, blob_a, la);
}

void pair_open(struct pair *p) {
        pair_transports(p);
        pair_connect(p, NULL, NULL);
}

void pair_first_write(struct pair *p, int fd_src, int fd_dst, size_t size, struct tp_mr **ret_src,
                      struct tp_mr **ret_dst, struct tp_rkey *ret_rk) {
        struct tp_mem m = { .kind = TP_MEM_CUMEM, .fd = fd_src, .length = size, .name = "src" };
        struct tp_completion c;
        char errmsg[ERRMSG_MAX];

        assert_int_equal(tp_cuda_ops.mr_new(p->a, &m, ret_src, errmsg), 0);
        m = (struct tp_mem){ .kind = TP_MEM_CUMEM, .fd = fd_dst, .length = size, .name = "dst" };
        assert_int_equal(tp_cuda_ops.mr_new(p->b, &m, ret_dst, errmsg), 0);
        tp_cuda_ops.mr_rkey(*ret_dst, ret_rk);
        assert_int_equal(tp_cuda_ops.write(p->a, p->a_peer, *ret_src, 0, ret_rk, 0, 64, 1, 0, 0), 0);
        assert_int_equal(poll_n(p->a, &c, 1), 1);
        assert_int_equal(c.status, 0);
}
