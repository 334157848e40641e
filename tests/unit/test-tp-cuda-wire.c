/* Unit tests of the cuda transport's wire and peer socket, without a GPU:
 * the blob and the messages (hostile inputs), the token table, the peer
 * socket attacked through raw connections (wrong, replayed and missing
 * tokens, FETCH before HELLO, garbage, silence), peer_connect refusing blobs
 * that would make it dial elsewhere or trust another process, a freed
 * peer (its token refused, the connection that presented it dropped, its
 * own closed, the index serving a fresh peer), and the open of the real
 * backend where libcuda is missing. */
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

#include "datapath/tp-cuda-internal.h"
#include "tp-cuda-fake.h"

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
        uint32_t peer = 0;
        int32_t status;
        size_t len;
        int fd, memfd;

        assert_int_equal(tpc_open(&cfg, &fake_api, &tp, errmsg), 0);
        assert_int_equal(tpc_open(&cfg, &fake_api, &other, errmsg), 0);
        assert_int_equal(tp_cuda_ops.peer_new(tp, peer, blob, &len, errmsg), 0);
        /* An index in use is not handed out twice. */
        assert_int_equal(tp_cuda_ops.peer_new(tp, peer, blob, &len, errmsg), -EINVAL);
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
        assert_int_equal(tp_cuda_ops.peer_new(other, peer, blob, &len, errmsg), 0);
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
                uint32_t p2 = 1;
                uint8_t junk[TP_ADDR_MAX];

                assert_int_equal(tp_cuda_ops.peer_new(other, p2, junk, &len, errmsg), 0);
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

/* Waits (bounded) until `tp`'s server serves `n` connections, polling
 * `poller` meanwhile as its proxy thread would (NULL: none). */
static bool conns_settle(struct tp *tp, uint32_t n, struct tp *poller) {
        struct tp_completion c[4];
        uint32_t have = UINT32_MAX;

        for (int i = 0; i < 2000 && have != n; i++) {
                for (int k = 0; poller && k < 256; k++)
                        tp_cuda_ops.poll(poller, c, 4);
                pthread_mutex_lock(&tp->lock);
                have = tp->nconns;
                pthread_mutex_unlock(&tp->lock);
                nanosleep(&(struct timespec){ .tv_nsec = 1000000 }, NULL);
        }
        return have == n;
}

/* A transport peer freed (tp_ops.peer_free, once the proxy let it go):
 * B frees its peer of A: its token is refused from then on, and A's
 * connection that presented it is dropped, so that A's side dies too (it
 * fetches nothing more under it); A frees its peer: its socket is closed.
 * Then index 0 serves a fresh peer at both, with a fresh token, and a
 * write goes through. */
static void test_peer_freed(void **state) {
        const size_t size = TPC_MAP_ALIGN;
        struct tpc_msg hello = { .magic = TPC_MSG_MAGIC, .type = TPC_MSG_HELLO };
        uint8_t blob_a[TP_ADDR_MAX], blob_b[TP_ADDR_MAX];
        struct tp_completion c[4];
        struct tp_mr *src, *dst;
        struct tp_rkey rk;
        char errmsg[ERRMSG_MAX];
        struct pair p;
        int32_t status;
        size_t la, lb;
        int fd, old_fd, fd_src = cumem_fake(size), fd_dst = cumem_fake(size);

        pair_open(&p);
        pair_first_write(&p, fd_src, fd_dst, size, &src, &dst, &rk);
        assert_true(conns_settle(p.b, 1, NULL));
        pthread_mutex_lock(&p.b->lock);
        memcpy(hello.token, p.b->tokens[p.b_peer], sizeof(hello.token));
        pthread_mutex_unlock(&p.b->lock);

        tp_cuda_ops.peer_free(p.b, p.b_peer);
        assert_int_equal(atomic_load(&p.b->peers[p.b_peer].state), TPC_PEER_FREE);
        assert_true(conns_settle(p.b, 0, p.a));
        assert_int_equal(atomic_load(&p.a->peers[p.a_peer].state), TPC_PEER_DEAD);
        fd = attacker_connect(p.b);
        assert_int_equal(send(fd, &hello, sizeof(hello), 0), sizeof(hello));
        assert_int_equal(attacker_read(fd, &status), TPC_MSG_WELCOME);
        assert_int_equal(status, -EACCES);
        close(fd);

        old_fd = p.a->peers[p.a_peer].fd;
        assert_true(fcntl(old_fd, F_GETFD) >= 0);
        tp_cuda_ops.peer_free(p.a, p.a_peer);
        assert_int_equal(p.a->peers[p.a_peer].fd, -1);
        assert_true(fcntl(old_fd, F_GETFD) < 0 && errno == EBADF);
        assert_int_equal(tp_cuda_ops.write(p.a, p.a_peer, src, 0, &rk, 0, 64, 2, 0, 0), -ENOTCONN);

        assert_int_equal(tp_cuda_ops.peer_new(p.a, 0, blob_a, &la, errmsg), 0);
        assert_int_equal(tp_cuda_ops.peer_new(p.b, 0, blob_b, &lb, errmsg), 0);
        pthread_mutex_lock(&p.b->lock);
        assert_memory_not_equal(hello.token, p.b->tokens[0], sizeof(hello.token));
        pthread_mutex_unlock(&p.b->lock);
        assert_int_equal(tp_cuda_ops.peer_connect(p.a, 0, blob_b, lb, errmsg), 0);
        assert_int_equal(tp_cuda_ops.peer_connect(p.b, 0, blob_a, la, errmsg), 0);
        assert_int_equal(tp_cuda_ops.write(p.a, 0, src, 0, &rk, 0, 64, 3, 0, 0), 0);
        assert_int_equal(poll_n(p.a, c, 1), 1);
        assert_int_equal(c[0].status, 0);
        assert_int_equal(c[0].cookie, 3);

        tp_cuda_ops.close(p.a);
        tp_cuda_ops.close(p.b);
        close(fd_src);
        close(fd_dst);
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
                cmocka_unit_test(test_blob_roundtrip),       cmocka_unit_test(test_blob_hostile),
                cmocka_unit_test(test_msg_hostile),          cmocka_unit_test(test_token_find),
                cmocka_unit_test(test_peer_socket_hostile),  cmocka_unit_test(test_peer_freed),
                cmocka_unit_test(test_open_without_libcuda),
        };

        return cmocka_run_group_tests(tests, NULL, NULL);
}
