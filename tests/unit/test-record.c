/* Record framing (proto/record.c, linked through moeepd_lib): round trips
 * and every rejection path of moeep_record_recv() over a real
 * SOCK_SEQPACKET socketpair, with a check that no received descriptor
 * leaks. */
#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cmocka.h>

#include "record.h"
#include "unit.h"

struct pair {
        int a, b; /* a sends, b receives */
        struct moeep_record rec;
        int fds_before;
};

static int setup(void **state) {
        struct pair *p = calloc(1, sizeof(*p));
        int sv[2];

        if (!p || socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0, sv) < 0)
                return -1;
        p->a = sv[0];
        p->b = sv[1];
        p->fds_before = unit_count_fds();
        *state = p;
        return 0;
}

static int teardown(void **state) {
        struct pair *p = *state;

        moeep_record_release(&p->rec);
        /* Whatever happened, every received descriptor is closed. */
        assert_int_equal(unit_count_fds(), p->fds_before);
        close(p->a);
        close(p->b);
        free(p);
        return 0;
}

/* Sends a header with the given fields, `len` payload bytes and `nfds`
 * fresh memfds (closed again on our side), bypassing the encoder. */
static void send_crafted(struct pair *p, uint32_t magic, uint16_t major, uint16_t type, uint16_t hdr_nfds,
                         int32_t length_delta, const void *payload, size_t len, size_t nfds) {
        union {
                char buf[CMSG_SPACE(sizeof(int) * 128)];
                struct cmsghdr align;
        } control;
        uint8_t buf[MOEEP_RECORD_MAX + 8192];
        struct moeep_record_header hdr = {
                .magic = magic,
                .major = major,
                .type = type,
                .nfds = hdr_nfds,
                .length = (uint32_t)((int32_t)len + length_delta),
                .request_id = 42,
        };
        struct iovec iov = { .iov_base = buf, .iov_len = sizeof(hdr) + len };
        struct msghdr mh = { .msg_iov = &iov, .msg_iovlen = 1 };
        int fds[128];

        assert_true(nfds <= 128 && len + sizeof(hdr) <= sizeof(buf));
        memcpy(buf, &hdr, sizeof(hdr));
        if (len)
                memcpy(buf + sizeof(hdr), payload, len);
        for (size_t i = 0; i < nfds; i++)
                fds[i] = unit_memfd(4096, NULL);
        if (nfds) {
                struct cmsghdr *c;

                memset(&control, 0, sizeof(control));
                mh.msg_control = control.buf;
                mh.msg_controllen = CMSG_SPACE(sizeof(int) * nfds);
                c = CMSG_FIRSTHDR(&mh);
                c->cmsg_level = SOL_SOCKET;
                c->cmsg_type = SCM_RIGHTS;
                c->cmsg_len = CMSG_LEN(sizeof(int) * nfds);
                memcpy(CMSG_DATA(c), fds, sizeof(int) * nfds);
        }
        assert_int_equal(sendmsg(p->a, &mh, 0), (ssize_t)(sizeof(hdr) + len));
        for (size_t i = 0; i < nfds; i++)
                close(fds[i]);
}

/* A valid Hello payload. */
static size_t hello_payload(uint8_t *buf) {
        Moeep__V1__Hello hello = MOEEP__V1__HELLO__INIT;
        Moeep__V1__Request req = MOEEP__V1__REQUEST__INIT;

        hello.major = MOEEP_PROTOCOL_MAJOR;
        hello.client_name = "unit";
        req.body_case = MOEEP__V1__REQUEST__BODY_HELLO;
        req.hello = &hello;
        return moeep__v1__request__pack(&req, buf);
}

static void expect_reject(struct pair *p, int expected, const char *why_part) {
        const char *why = NULL;

        assert_int_equal(moeep_record_recv(p->b, &p->rec, &why), expected);
        assert_non_null(why);
        assert_non_null(strstr(why, why_part));
        assert_int_equal(p->rec.nfds, 0);
        /* The code a receiver answers with: the rule moeepd once applied to
         * the text, now carried by the record. */
        if (expected == -EPROTONOSUPPORT)
                assert_int_equal(p->rec.error_code, MOEEP__V1__ERROR_CODE__ERROR_VERSION_MISMATCH);
        else if (strcmp(why, "unknown record type") == 0)
                assert_int_equal(p->rec.error_code, MOEEP__V1__ERROR_CODE__ERROR_UNKNOWN_TYPE);
        else if (strstr(why, "descriptor"))
                assert_int_equal(p->rec.error_code, MOEEP__V1__ERROR_CODE__ERROR_BAD_FDS);
        else
                assert_int_equal(p->rec.error_code, MOEEP__V1__ERROR_CODE__ERROR_BAD_RECORD);
}

static void test_round_trip_hello(void **state) {
        struct pair *p = *state;
        Moeep__V1__Hello hello = MOEEP__V1__HELLO__INIT;
        Moeep__V1__Request req = MOEEP__V1__REQUEST__INIT, *got;

        hello.major = MOEEP_PROTOCOL_MAJOR;
        hello.minor = 7;
        hello.pid = 1234;
        hello.client_name = "libmoeep/test";
        req.body_case = MOEEP__V1__REQUEST__BODY_HELLO;
        req.hello = &hello;
        assert_int_equal(moeep_record_send(p->a, MOEEP__V1__REQUEST__BODY_HELLO, 99, &req.base, NULL, 0), 0);
        assert_int_equal(moeep_record_recv(p->b, &p->rec, NULL), 0);
        assert_int_equal(p->rec.hdr.request_id, 99);
        assert_int_equal(p->rec.hdr.type, MOEEP__V1__REQUEST__BODY_HELLO);
        got = moeep_record_decode_request(&p->rec);
        assert_non_null(got);
        assert_int_equal(got->body_case, MOEEP__V1__REQUEST__BODY_HELLO);
        assert_int_equal(got->hello->minor, 7);
        assert_int_equal(got->hello->pid, 1234);
        assert_string_equal(got->hello->client_name, "libmoeep/test");
        moeep__v1__request__free_unpacked(got, NULL);
        /* A request does not decode as a response or an event. */
        assert_null(moeep_record_decode_response(&p->rec));
        assert_null(moeep_record_decode_event(&p->rec));
}

static void test_round_trip_fd(void **state) {
        struct pair *p = *state;
        Moeep__V1__RegionRegister rr = MOEEP__V1__REGION_REGISTER__INIT;
        Moeep__V1__Request req = MOEEP__V1__REQUEST__INIT;
        int fd = unit_memfd(8192, "payload");
        char buf[16] = "";

        rr.kind = MOEEP__V1__REGION_KIND__REGION_KIND_MEMFD;
        rr.size = 8192;
        req.body_case = MOEEP__V1__REQUEST__BODY_REGION_REGISTER;
        req.region_register = &rr;
        assert_int_equal(moeep_record_send(p->a, req.body_case, 5, &req.base, &fd, 1), 0);
        close(fd);
        assert_int_equal(moeep_record_recv(p->b, &p->rec, NULL), 0);
        assert_int_equal(p->rec.nfds, 1);
        assert_int_equal(pread(p->rec.fds[0], buf, sizeof(buf), 0), sizeof(buf));
        assert_string_equal(buf, "payload");
}

static void test_nothing_queued(void **state) {
        struct pair *p = *state;

        assert_int_equal(moeep_record_recv(p->b, &p->rec, NULL), -EAGAIN);
}

static void test_eof(void **state) {
        struct pair *p = *state;

        shutdown(p->a, SHUT_WR);
        assert_int_equal(moeep_record_recv(p->b, &p->rec, NULL), -ECONNRESET);
}

static void test_bad_magic(void **state) {
        uint8_t payload[256];
        size_t len = hello_payload(payload);

        send_crafted(*state, 0xdeadbeef, MOEEP_PROTOCOL_MAJOR, 1, 0, 0, payload, len, 0);
        expect_reject(*state, -EBADMSG, "magic");
}

static void test_short(void **state) {
        struct pair *p = *state;

        assert_int_equal(send(p->a, "MEEPshort", 9, 0), 9);
        expect_reject(p, -EBADMSG, "shorter");
}

static void test_length_mismatch(void **state) {
        uint8_t payload[256];
        size_t len = hello_payload(payload);

        send_crafted(*state, MOEEP_RECORD_MAGIC, MOEEP_PROTOCOL_MAJOR, 1, 0, +1, payload, len, 0);
        expect_reject(*state, -EBADMSG, "length");
}

static void test_oversize(void **state) {
        static uint8_t big[MOEEP_RECORD_MAX];

        send_crafted(*state, MOEEP_RECORD_MAGIC, MOEEP_PROTOCOL_MAJOR, 1, 0, 0, big, sizeof(big), 0);
        expect_reject(*state, -EBADMSG, "64 KiB");
}

static void test_fds_on_hello(void **state) {
        uint8_t payload[256];
        size_t len = hello_payload(payload);

        send_crafted(*state, MOEEP_RECORD_MAGIC, MOEEP_PROTOCOL_MAJOR, 1, 2, 0, payload, len, 2);
        expect_reject(*state, -EBADMSG, "may not carry");
}

static void test_fds_undeclared(void **state) {
        uint8_t payload[256];
        size_t len = hello_payload(payload);

        /* The header says none, two arrive. */
        send_crafted(*state, MOEEP_RECORD_MAGIC, MOEEP_PROTOCOL_MAJOR, 1, 0, 0, payload, len, 2);
        expect_reject(*state, -EBADMSG, "descriptor count");
}

static void test_fd_missing(void **state) {
        struct pair *p = *state;

        /* JobJoined must carry exactly one. */
        send_crafted(p, MOEEP_RECORD_MAGIC, MOEEP_PROTOCOL_MAJOR, MOEEP__V1__RESPONSE__BODY_JOB_JOINED, 0, 0,
                     NULL, 0, 0);
        expect_reject(p, -EBADMSG, "carries none");
        /* RegionRegister one, or none when it names an fd to take (1.4):
         * never two. Which of the first two is right only the decoded
         * message says, so the daemon's request layer checks it
         * (tests/security/pidfd.c, case "frame"). */
        send_crafted(p, MOEEP_RECORD_MAGIC, MOEEP_PROTOCOL_MAJOR, MOEEP__V1__REQUEST__BODY_REGION_REGISTER, 2,
                     0, NULL, 0, 2);
        expect_reject(p, -EBADMSG, "carries several");
        send_crafted(p, MOEEP_RECORD_MAGIC, MOEEP_PROTOCOL_MAJOR, MOEEP__V1__REQUEST__BODY_REGION_REGISTER, 0,
                     0, NULL, 0, 0);
        assert_int_equal(moeep_record_recv(p->b, &p->rec, NULL), 0);
        assert_int_equal(p->rec.nfds, 0);
}

static void test_too_many_fds(void **state) {
        send_crafted(*state, MOEEP_RECORD_MAGIC, MOEEP_PROTOCOL_MAJOR, MOEEP__V1__RESPONSE__BODY_REGIONS,
                     MOEEP_RECORD_MAX_FDS, 0, NULL, 0, MOEEP_RECORD_MAX_FDS + 1);
        expect_reject(*state, -EBADMSG, "too many");
}

static void test_unknown_type(void **state) {
        send_crafted(*state, MOEEP_RECORD_MAGIC, MOEEP_PROTOCOL_MAJOR, 50, 0, 0, NULL, 0, 0);
        expect_reject(*state, -EBADMSG, "unknown record type");
}

static void test_major_mismatch(void **state) {
        struct pair *p = *state;
        uint8_t payload[256];
        size_t len = hello_payload(payload);

        send_crafted(p, MOEEP_RECORD_MAGIC, MOEEP_PROTOCOL_MAJOR + 1, 1, 1, 0, payload, len, 1);
        expect_reject(p, -EPROTONOSUPPORT, "major");
        assert_int_equal(p->rec.hdr.major, MOEEP_PROTOCOL_MAJOR + 1);
}

static void test_garbage_protobuf(void **state) {
        struct pair *p = *state;
        static const uint8_t garbage[] = { 0xff, 0xff, 0xff, 0xff, 0x0f, 0x0a, 0x99 };

        send_crafted(p, MOEEP_RECORD_MAGIC, MOEEP_PROTOCOL_MAJOR, 1, 0, 0, garbage, sizeof(garbage), 0);
        assert_int_equal(moeep_record_recv(p->b, &p->rec, NULL), 0);
        assert_null(moeep_record_decode_request(&p->rec));
}

static void test_body_case_mismatch(void **state) {
        struct pair *p = *state;
        uint8_t payload[256];
        size_t len = hello_payload(payload);

        /* A Hello body under a JobCreate header. */
        send_crafted(p, MOEEP_RECORD_MAGIC, MOEEP_PROTOCOL_MAJOR, MOEEP__V1__REQUEST__BODY_JOB_CREATE, 0, 0,
                     payload, len, 0);
        assert_int_equal(moeep_record_recv(p->b, &p->rec, NULL), 0);
        assert_null(moeep_record_decode_request(&p->rec));
}

int main(void) {
#define T(f) cmocka_unit_test_setup_teardown(f, setup, teardown)
        const struct CMUnitTest tests[] = {
                T(test_round_trip_hello), T(test_round_trip_fd),
                T(test_nothing_queued),   T(test_eof),
                T(test_bad_magic),        T(test_short),
                T(test_length_mismatch),  T(test_oversize),
                T(test_fds_on_hello),     T(test_fds_undeclared),
                T(test_fd_missing),       T(test_too_many_fds),
                T(test_unknown_type),     T(test_major_mismatch),
                T(test_garbage_protobuf), T(test_body_case_mismatch),
        };

        return cmocka_run_group_tests(tests, NULL, NULL);
}
