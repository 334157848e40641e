/* Unit tests of the cuda transport without a GPU: its wire (blob and
 * messages, hostile inputs), the token checks of its peer socket (driven by
 * a raw attacker socket), and the backend itself between two instances in
 * this process over a stand-in for libcuda in which cuMem memory is memfds:
 * imports, fetches, writes, completions in posting order, revocation and
 * the byte counters. Where an fd travels, an independent mapping of it is
 * the reference. */
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

#include "driver.h"
#include "proxy.h"
#include "tp-cuda-internal.h"
#include "unit.h"

/* ------------------------------------------------------------ wire */

static struct tpc_blob blob_good(void) {
        struct tpc_blob b = { .magic = TPC_BLOB_MAGIC, .version = TPC_BLOB_VERSION, .pid = 42, .uid = 7 };

        tpc_name_make(&b, 42, 0x0123456789abcdefull);
        memset(b.token, 0xa5, sizeof(b.token));
        return b;
}

static int blob_try(const struct tpc_blob *b, const char **why) {
        uint8_t buf[TPC_BLOB_BYTES];
        struct tpc_blob out;

        memcpy(buf, b, sizeof(buf)); /* raw, as a hostile sender would */
        return tpc_blob_decode(buf, sizeof(buf), &out, why);
}

static void test_blob_roundtrip(void **state) {
        struct tpc_blob b = blob_good(), out;
        uint8_t buf[TPC_BLOB_BYTES + 8];
        const char *why = NULL;
        size_t n;

        memset(b.name + b.name_len, 'X', sizeof(b.name) - b.name_len); /* garbage past the name */
        n = tpc_blob_encode(&b, buf);
        assert_int_equal(n, TPC_BLOB_BYTES);
        assert_true(n <= TP_ADDR_MAX);
        /* Nothing past the name leaves the daemon. */
        for (size_t i = offsetof(struct tpc_blob, name) + b.name_len; i < n; i++)
                assert_int_equal(buf[i], 0);
        assert_int_equal(tpc_blob_decode(buf, n, &out, &why), 0);
        assert_string_equal(out.name, "moeep-tp-cuda-42-0123456789abcdef");
        assert_int_equal(out.pid, 42);
        assert_int_equal(out.uid, 7);
        assert_memory_equal(out.token, b.token, TPC_TOKEN_BYTES);
        /* Wrong lengths. */
        for (size_t len = 0; len <= sizeof(buf); len++)
                if (len != TPC_BLOB_BYTES)
                        assert_int_equal(tpc_blob_decode(buf, len, &out, &why), -EINVAL);
}

static void test_blob_hostile(void **state) {
        static const char *const names[] = {
                "moeep-tp-cuda-",            /* prefix only */
                "moeep-tp-cuda-42",          /* no dash */
                "moeep-tp-cuda-42-",         /* no hex */
                "moeep-tp-cuda--abcdef",     /* no pid */
                "moeep-tp-cuda-42-ABCDEF",   /* uppercase */
                "moeep-tp-cuda-42-ab/cd",    /* a path */
                "moeep-tp-cuda-42-ab-cd",    /* a second dash */
                "moeep-tp-cuda-4a-abcd",     /* hex in the pid */
                "systemd-private-42-abcdef", /* another service's socket */
                "moeep-tp-cudb-42-abcdef",   /* near miss */
                "/run/moeep/moeepd.sock",    /* a path */
        };
        const char *why = NULL;
        struct tpc_blob b;

        b = blob_good();
        assert_int_equal(blob_try(&b, &why), 0);
        b.magic ^= 1;
        assert_int_equal(blob_try(&b, &why), -EINVAL);
        assert_non_null(strstr(why, "magic"));
        b = blob_good();
        b.version = 2;
        assert_int_equal(blob_try(&b, &why), -EINVAL);
        b = blob_good();
        memset(b.token, 0, sizeof(b.token));
        assert_int_equal(blob_try(&b, &why), -EINVAL);
        assert_non_null(strstr(why, "token"));
        for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
                b = blob_good();
                memset(b.name, 0, sizeof(b.name));
                memcpy(b.name, names[i], strlen(names[i]));
                b.name_len = (uint16_t)strlen(names[i]);
                assert_int_equal(blob_try(&b, &why), -EINVAL);
        }
        /* A NUL inside the name, and lengths past the field. */
        b = blob_good();
        b.name[20] = '\0';
        assert_int_equal(blob_try(&b, &why), -EINVAL);
        for (unsigned len = TPC_NAME_MAX; len < 70000; len = len * 3 + 1) {
                b = blob_good();
                b.name_len = (uint16_t)len;
                assert_int_equal(blob_try(&b, &why), -EINVAL);
        }
}

static struct tpc_msg msg_of(uint16_t type) {
        struct tpc_msg m = { .magic = TPC_MSG_MAGIC, .type = type };

        if (type == TPC_MSG_HELLO)
                memset(m.token, 1, sizeof(m.token));
        if (type == TPC_MSG_REGION) {
                m.kind = TPC_REGION_CUMEM;
                m.length = 4096;
        }
        return m;
}

static int msg_try(const struct tpc_msg *m, size_t nfds, bool from_server) {
        struct tpc_msg out;
        const char *why = NULL;
        int r = tpc_msg_check(m, sizeof(*m), nfds, from_server, &out, &why);

        assert_true(r == 0 || (why && why[0]));
        return r;
}

static void test_msg_hostile(void **state) {
        const uint16_t client_types[] = { TPC_MSG_HELLO, TPC_MSG_FETCH };
        const uint16_t server_types[] = { TPC_MSG_WELCOME, TPC_MSG_REGION, TPC_MSG_REVOKE };
        uint8_t buf[TPC_MSG_BYTES + 1] = { 0 };
        struct tpc_msg m, out;
        const char *why;

        for (size_t i = 0; i < 2; i++) {
                m = msg_of(client_types[i]);
                assert_int_equal(msg_try(&m, 0, false), 0);
                assert_int_equal(msg_try(&m, 0, true), -EINVAL);  /* wrong direction */
                assert_int_equal(msg_try(&m, 1, false), -EINVAL); /* fds where none belong */
        }
        for (size_t i = 0; i < 3; i++) {
                m = msg_of(server_types[i]);
                assert_int_equal(msg_try(&m, server_types[i] == TPC_MSG_REGION, true), 0);
                assert_int_equal(msg_try(&m, server_types[i] == TPC_MSG_REGION, false), -EINVAL);
        }
        /* Sizes and magic. */
        m = msg_of(TPC_MSG_FETCH);
        memcpy(buf, &m, sizeof(m));
        assert_int_equal(tpc_msg_check(buf, sizeof(m) - 1, 0, false, &out, &why), -EINVAL);
        assert_int_equal(tpc_msg_check(buf, sizeof(m) + 1, 0, false, &out, &why), -EINVAL);
        assert_int_equal(tpc_msg_check(buf, 0, 0, false, &out, &why), -EINVAL);
        m.magic = 0;
        assert_int_equal(msg_try(&m, 0, false), -EINVAL);
        /* Unknown types. */
        for (unsigned t = 0; t < 70000; t = t * 2 + 6) {
                m = msg_of(TPC_MSG_FETCH);
                m.type = (uint16_t)t;
                assert_int_equal(msg_try(&m, 0, false), -EINVAL);
                assert_int_equal(msg_try(&m, 0, true), -EINVAL);
        }
        /* Fields that must be zero. */
        m = msg_of(TPC_MSG_FETCH);
        m.reserved = 1;
        assert_int_equal(msg_try(&m, 0, false), -EINVAL);
        m = msg_of(TPC_MSG_FETCH);
        m.token[31] = 1;
        assert_int_equal(msg_try(&m, 0, false), -EINVAL);
        m = msg_of(TPC_MSG_FETCH);
        m.status = -1;
        assert_int_equal(msg_try(&m, 0, false), -EINVAL);
        m = msg_of(TPC_MSG_REVOKE);
        m.length = 1;
        assert_int_equal(msg_try(&m, 0, true), -EINVAL);
        m = msg_of(TPC_MSG_WELCOME);
        m.status = 5;
        assert_int_equal(msg_try(&m, 0, true), -EINVAL);
        /* Regions: kind, length, the fd. */
        m = msg_of(TPC_MSG_REGION);
        assert_int_equal(msg_try(&m, 0, true), -EINVAL);
        assert_int_equal(msg_try(&m, 2, true), -EINVAL);
        m.kind = 3;
        assert_int_equal(msg_try(&m, 1, true), -EINVAL);
        m = msg_of(TPC_MSG_REGION);
        m.length = 0;
        assert_int_equal(msg_try(&m, 1, true), -EINVAL);
        m = (struct tpc_msg){ .magic = TPC_MSG_MAGIC, .type = TPC_MSG_REGION, .status = -ENOENT };
        assert_int_equal(msg_try(&m, 0, true), 0);
        assert_int_equal(msg_try(&m, 1, true), -EINVAL); /* a refusal with an fd */
        m.kind = TPC_REGION_CUMEM;
        assert_int_equal(msg_try(&m, 0, true), -EINVAL);
}

static void test_token_find(void **state) {
        uint8_t tokens[3][TPC_TOKEN_BYTES];
        bool used[3] = { false, true, false };
        uint8_t t[TPC_TOKEN_BYTES];

        memset(tokens, 0, sizeof(tokens));
        memset(tokens[0], 1, TPC_TOKEN_BYTES);
        memset(tokens[1], 2, TPC_TOKEN_BYTES);
        memset(tokens[2], 3, TPC_TOKEN_BYTES);
        memset(t, 3, sizeof(t));
        assert_int_equal(tpc_token_find((const uint8_t(*)[TPC_TOKEN_BYTES])tokens, used, 3, t), 2);
        assert_int_equal(tpc_token_find((const uint8_t(*)[TPC_TOKEN_BYTES])tokens, used, 2, t), -EACCES);
        memset(t, 2, sizeof(t));
        assert_int_equal(tpc_token_find((const uint8_t(*)[TPC_TOKEN_BYTES])tokens, used, 3, t), -EALREADY);
        memset(t, 1, sizeof(t));
        t[TPC_TOKEN_BYTES - 1] = 0; /* all but the last byte right */
        assert_int_equal(tpc_token_find((const uint8_t(*)[TPC_TOKEN_BYTES])tokens, used, 3, t), -EACCES);
        /* A zero token never matches, not even an entry never issued. */
        memset(tokens[2], 0, TPC_TOKEN_BYTES);
        memset(t, 0, sizeof(t));
        assert_int_equal(tpc_token_find((const uint8_t(*)[TPC_TOKEN_BYTES])tokens, used, 3, t), -EACCES);
}

/* ------------------------------------------------ a libcuda stand-in */

/* cuMem in miniature: an "allocation handle" is a dup of a memfd, an
 * address reservation is PROT_NONE anonymous memory and cuMemMap maps the
 * memfd over it, so that device pointers are host pointers the test can
 * read. Copies run at once (a stream in order); an event reports NOT_READY
 * for `fake_lag` queries after it was recorded. */
static int fake_lag;
static int fake_events[8192];
static int fake_nevents;
static int fake_imports;

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
        fake_imports++;
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
        fake_imports--;
        return close((int)h) ? 1 : 0;
}
static tpc_result f_access(tpc_devptr p, size_t n, const struct tpc_access_desc *d, size_t c) {
        return d->location_type == TPC_LOCATION_DEVICE && d->flags == TPC_ACCESS_READWRITE ? 0 : 1;
}

static const struct tpc_api fake_api = {
        f_err,      f_init,   f_count,     f_dev,       f_retain,        f_release_ctx,
        f_set,      f_stream, f_stream_op, f_stream_op, f_event,         f_event_destroy,
        f_record,   f_query,  f_copy,      f_copy,      f_host_register, f_host_unregister,
        f_host_ptr, f_import, f_reserve,   f_addr_free, f_map,           f_unmap,
        f_release,  f_access,
};

/* A memfd standing for a cuMem allocation of `size` bytes. */
static int cumem_fake(size_t size) {
        int fd = memfd_create("fake-cumem", MFD_CLOEXEC);

        assert_true(fd >= 0);
        assert_int_equal(ftruncate(fd, (off_t)size), 0);
        return fd;
}

/* Polls `tp` until it returned `want` completions into out (bounded). */
static int poll_n(struct tp *tp, struct tp_completion *out, int want) {
        int got = 0;

        for (int i = 0; i < 100000 && got < want; i++) {
                int n = tp_cuda_ops.poll(tp, out + got, want - got);

                assert_true(n >= 0);
                got += n;
        }
        return got;
}

struct pair {
        struct tp *a, *b;
        uint32_t a_peer, b_peer; /* a's name for b, b's name for a */
};

static void pair_open(struct pair *p) {
        struct tp_config cfg = { .backend = "cuda", .queue_depth = 8 };
        uint8_t blob_a[TP_ADDR_MAX], blob_b[TP_ADDR_MAX];
        size_t la, lb;
        char errmsg[ERRMSG_MAX];

        assert_int_equal(tpc_open(&cfg, &fake_api, &p->a, errmsg), 0);
        assert_int_equal(tpc_open(&cfg, &fake_api, &p->b, errmsg), 0);
        assert_int_equal(tp_cuda_ops.peer_new(p->a, &p->a_peer, blob_a, &la, errmsg), 0);
        assert_int_equal(tp_cuda_ops.peer_new(p->b, &p->b_peer, blob_b, &lb, errmsg), 0);
        assert_int_equal(tp_cuda_ops.peer_connect(p->a, p->a_peer, blob_b, lb, errmsg), 0);
        assert_int_equal(tp_cuda_ops.peer_connect(p->b, p->b_peer, blob_a, la, errmsg), 0);
}

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

        pair_open(&p);
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
        routes[1] = (struct proxy_route){ .tp_peer = p.a_peer };
        tp_cuda_ops.mr_rkey(recv, &routes[1].data);
        tp_cuda_ops.mr_rkey(counters, &routes[1].counters);

        t = (struct transport){ .ops = &tp_cuda_ops, .tp = p.a };
        assert_int_equal(proxy_new(&t, &params, "test", &px, errmsg), 0);
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
        uint32_t a2, b2, conns = 0;
        size_t la, lb;
        struct pair p;
        int fd_src = cumem_fake(size), fd_dst = cumem_fake(size), r = 0;

        pair_open(&p);
        struct tp_mem m = { .kind = TP_MEM_CUMEM, .fd = fd_src, .length = size, .name = "src" };
        assert_int_equal(tp_cuda_ops.mr_new(p.a, &m, &src, errmsg), 0);
        m = (struct tp_mem){ .kind = TP_MEM_CUMEM, .fd = fd_dst, .length = size, .name = "dst" };
        assert_int_equal(tp_cuda_ops.mr_new(p.b, &m, &dst, errmsg), 0);
        tp_cuda_ops.mr_rkey(dst, &rk);
        assert_int_equal(tp_cuda_ops.write(p.a, p.a_peer, src, 0, &rk, 0, 64, 1, 0, 0), 0);
        assert_int_equal(poll_n(p.a, c, 1), 1);
        assert_int_equal(c[0].status, 0);
        assert_int_equal(fake_imports, 3);

        assert_int_equal(tp_cuda_ops.peer_new(p.a, &a2, blob_a, &la, errmsg), 0);
        assert_int_equal(tp_cuda_ops.peer_new(p.b, &b2, blob_b, &lb, errmsg), 0);
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

/* ------------------------------------------------ the peer socket */

/* A raw connection to `tp`'s socket, as any local process can make. */
static int attacker_connect(const struct tp *tp) {
        struct sockaddr_un a = { .sun_family = AF_UNIX };
        int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);

        memcpy(a.sun_path + 1, tp->self.name, tp->self.name_len);
        assert_int_equal(connect(fd, (struct sockaddr *)&a,
                                 (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + tp->self.name_len)),
                         0);
        return fd;
}

/* Waits (bounded) for the server to answer or close: the answer's type and
 * status, or -1 for a closed connection. */
static int attacker_read(int fd, int32_t *ret_status) {
        struct pollfd pfd = { .fd = fd, .events = POLLIN };
        struct tpc_msg m;
        ssize_t n;

        assert_int_equal(poll(&pfd, 1, 3000), 1);
        n = recv(fd, &m, sizeof(m), 0);
        if (n <= 0)
                return -1;
        assert_int_equal(n, sizeof(m));
        *ret_status = m.status;
        return m.type;
}

static void test_peer_socket_hostile(void **state) {
        struct tp_config cfg = { .backend = "cuda", .queue_depth = 8 };
        struct tpc_msg hello = { .magic = TPC_MSG_MAGIC, .type = TPC_MSG_HELLO };
        struct tpc_msg fetch = { .magic = TPC_MSG_MAGIC, .type = TPC_MSG_FETCH, .key = 1 };
        uint8_t blob[TP_ADDR_MAX];
        struct tpc_blob b;
        const char *why;
        char errmsg[ERRMSG_MAX];
        struct tp *tp, *other;
        uint32_t peer;
        int32_t status;
        size_t len;
        int fd, memfd;

        assert_int_equal(tpc_open(&cfg, &fake_api, &tp, errmsg), 0);
        assert_int_equal(tpc_open(&cfg, &fake_api, &other, errmsg), 0);
        assert_int_equal(tp_cuda_ops.peer_new(tp, &peer, blob, &len, errmsg), 0);
        assert_int_equal(tpc_blob_decode(blob, len, &b, &why), 0);

        /* A wrong token: refused, then closed. */
        fd = attacker_connect(tp);
        memset(hello.token, 0x5a, sizeof(hello.token));
        assert_int_equal(send(fd, &hello, sizeof(hello), 0), sizeof(hello));
        assert_int_equal(attacker_read(fd, &status), TPC_MSG_WELCOME);
        assert_int_equal(status, -EACCES);
        assert_int_equal(attacker_read(fd, &status), -1);
        close(fd);
        /* A fetch before HELLO: closed without an answer. */
        fd = attacker_connect(tp);
        assert_int_equal(send(fd, &fetch, sizeof(fetch), 0), sizeof(fetch));
        assert_int_equal(attacker_read(fd, &status), -1);
        close(fd);
        /* Garbage: closed. */
        fd = attacker_connect(tp);
        assert_int_equal(send(fd, "junk", 4, 0), 4);
        assert_int_equal(attacker_read(fd, &status), -1);
        close(fd);
        /* Silence: closed after the HELLO timeout. */
        fd = attacker_connect(tp);
        assert_int_equal(attacker_read(fd, &status), -1);
        close(fd);

        /* The right token works once: the daemon it was meant for uses
         * it, and an attacker who learns it afterwards is refused. */
        assert_int_equal(tp_cuda_ops.peer_new(other, &peer, blob, &len, errmsg), 0);
        {
                uint8_t blob_tp[TP_ADDR_MAX];

                len = tpc_blob_encode(&b, blob_tp);
                assert_int_equal(tp_cuda_ops.peer_connect(other, peer, blob_tp, len, errmsg), 0);
                /* Connecting the same peer twice is refused. */
                assert_int_equal(tp_cuda_ops.peer_connect(other, peer, blob_tp, len, errmsg), -EALREADY);
        }
        for (int i = 0; i < 300; i++) { /* until the server took other's HELLO */
                bool used;

                pthread_mutex_lock(&tp->lock);
                used = tp->token_used[0];
                pthread_mutex_unlock(&tp->lock);
                if (used)
                        break;
                nanosleep(&(struct timespec){ .tv_nsec = 10000000 }, NULL);
        }
        fd = attacker_connect(tp);
        memcpy(hello.token, b.token, sizeof(hello.token));
        assert_int_equal(send(fd, &hello, sizeof(hello), 0), sizeof(hello));
        assert_int_equal(attacker_read(fd, &status), TPC_MSG_WELCOME);
        assert_int_equal(status, -EACCES);
        close(fd);

        /* peer_connect refuses blobs that would make it dial elsewhere or
         * trust another process. */
        {
                struct tpc_blob bad = b;
                uint8_t buf[TP_ADDR_MAX];
                uint32_t p2;
                uint8_t junk[TP_ADDR_MAX];

                assert_int_equal(tp_cuda_ops.peer_new(other, &p2, junk, &len, errmsg), 0);
                bad.pid = b.pid + 1; /* the listener is not that pid */
                len = tpc_blob_encode(&bad, buf);
                assert_int_equal(tp_cuda_ops.peer_connect(other, p2, buf, len, errmsg), -EPERM);
                assert_non_null(strstr(errmsg, "is not served by pid"));
                bad = b;
                bad.uid = b.uid + 1;
                len = tpc_blob_encode(&bad, buf);
                assert_int_equal(tp_cuda_ops.peer_connect(other, p2, buf, len, errmsg), -EPERM);
                bad = b;
                tpc_name_make(&bad, 1, 0xdead); /* nobody listens there */
                len = tpc_blob_encode(&bad, buf);
                assert_int_equal(tp_cuda_ops.peer_connect(other, p2, buf, len, errmsg), -ECONNREFUSED);
                assert_non_null(strstr(errmsg, "connect to @moeep-tp-cuda-1-"));
                memset(buf, 0, sizeof(buf));
                assert_int_equal(tp_cuda_ops.peer_connect(other, p2, buf, TPC_BLOB_BYTES, errmsg), -EINVAL);
                assert_int_equal(tp_cuda_ops.peer_connect(other, 999, buf, TPC_BLOB_BYTES, errmsg), -EINVAL);
        }

        /* Writes to a peer whose connection is gone fail at once. */
        memfd = cumem_fake(TPC_MAP_ALIGN);
        tp_cuda_ops.close(tp);
        {
                struct tp_mem m = { .kind = TP_MEM_CUMEM, .fd = memfd, .length = 64, .name = "src" };
                struct tp_rkey rk = { .key = 5, .length = 64 };
                struct tp_completion c[4];
                struct tp_mr *src;
                int r = 0;

                assert_int_equal(tp_cuda_ops.mr_new(other, &m, &src, errmsg), 0);
                for (int i = 0; i < 300 && r == 0; i++) {
                        r = tp_cuda_ops.write(other, peer, src, 0, &rk, 0, 8, 1, 0, 0);
                        if (r == 0)
                                assert_int_equal(poll_n(other, c, 1), 1);
                }
                assert_true(r == -ECONNRESET || r == -ETIMEDOUT);
                tp_cuda_ops.mr_free(other, src);
        }
        tp_cuda_ops.close(other);
        close(memfd);
}

/* ------------------------------------------------ without libcuda */

static void test_open_without_libcuda(void **state) {
        struct tp_config cfg = { .backend = "cuda", .device = "" };
        char errmsg[ERRMSG_MAX] = "";
        struct tp *tp = NULL;
        int r;

        cfg.device = "gpu0";
        assert_int_equal(tp_cuda_ops.open(&cfg, &tp, errmsg), -EINVAL);
        assert_non_null(strstr(errmsg, "transport_device 'gpu0'"));
        /* Where a driver is installed, the test says nothing about it. */
        cfg.device = "";
        r = tp_cuda_ops.open(&cfg, &tp, errmsg);
        if (r == 0) {
                tp_cuda_ops.close(tp);
                skip();
        }
        print_message("open without a driver: %s\n", errmsg);
        assert_int_equal(r, -ENODEV);
        assert_true(strncmp(errmsg, "transport cuda", 14) == 0);
        assert_true(strstr(errmsg, "cannot load libcuda.so.1: ") || strstr(errmsg, "cuInit") ||
                    strstr(errmsg, "no CUDA device"));
}

int main(void) {
        const struct CMUnitTest tests[] = {
                cmocka_unit_test(test_blob_roundtrip),  cmocka_unit_test(test_blob_hostile),
                cmocka_unit_test(test_msg_hostile),     cmocka_unit_test(test_token_find),
                cmocka_unit_test(test_backend_writes),  cmocka_unit_test(test_backend_memfd),
                cmocka_unit_test(test_proxy_over_cuda), cmocka_unit_test(test_peer_socket_hostile),
                cmocka_unit_test(test_peer_superseded), cmocka_unit_test(test_open_without_libcuda),
        };

        return cmocka_run_group_tests(tests, NULL, NULL);
}
