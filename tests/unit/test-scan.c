/* The wire scan that moeepd runs on every request before decoding it
 * (moeep_record_scan(), proto/record.c; issue 27, item 3): what it refuses
 * (many unknown fields, a field twice, two members of a oneof, groups,
 * malformed varints and lengths), what it lets through (every request the
 * encoder makes, a newer minor's few unknown fields), and what it costs
 * against protobuf-c's own decoding of the same bytes: a 64 KiB record of
 * about 21,000 tiny unknown fields, which took protobuf-c about a
 * millisecond to decode (one allocation per unknown field), must be refused
 * in a small fraction of that. The times are printed. */
#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include <cmocka.h>

#include "record.h"

static size_t put_varint(uint8_t *p, uint64_t v) {
        size_t n = 0;

        do {
                p[n++] = (uint8_t)((v & 0x7f) | (v > 0x7f ? 0x80 : 0));
                v >>= 7;
        } while (v);
        return n;
}

/* Request{hello: Hello{major: 1, `extra` bytes as they are}} into `buf`;
 * returns its length. */
static size_t hello_with(uint8_t *buf, const uint8_t *extra, size_t extra_len) {
        size_t n = 0, inner = 2 + extra_len;

        buf[n++] = (MOEEP__V1__REQUEST__BODY_HELLO << 3) | 2;
        n += put_varint(buf + n, inner);
        buf[n++] = (1 << 3) | 0; /* Hello.major */
        buf[n++] = MOEEP_PROTOCOL_MAJOR;
        memcpy(buf + n, extra, extra_len);
        return n + extra_len;
}

/* `count` unknown varint fields (number 1000, value 1), 3 bytes each. */
static size_t unknown_fields(uint8_t *p, size_t count) {
        size_t n = 0;

        for (size_t i = 0; i < count; i++) {
                n += put_varint(p + n, (1000 << 3) | 0);
                p[n++] = 1;
        }
        return n;
}

static int scan(const uint8_t *buf, size_t len, const char **why) {
        *why = NULL;
        return moeep_record_scan(&moeep__v1__request__descriptor, buf, len, why);
}

static double now_us(void) {
        struct timespec ts;

        clock_gettime(CLOCK_MONOTONIC, &ts);
        return ts.tv_sec * 1e6 + ts.tv_nsec / 1e3;
}

static void test_many_unknown_fields(void **state) {
        static uint8_t extra[MOEEP_RECORD_MAX], buf[MOEEP_RECORD_MAX];
        size_t count = (MOEEP_RECORD_MAX - sizeof(struct moeep_record_header) - 16) / 3;
        size_t len = hello_with(buf, extra, unknown_fields(extra, count));
        double t0, scan_us = 1e9, decode_us = 1e9;
        const char *why;

        assert_true(len <= MOEEP_RECORD_MAX - sizeof(struct moeep_record_header));
        for (int i = 0; i < 20; i++) {
                Moeep__V1__Request *req;
                double t;

                t0 = now_us();
                assert_int_equal(scan(buf, len, &why), -EBADMSG);
                t = now_us() - t0;
                scan_us = t < scan_us ? t : scan_us;
                t0 = now_us();
                req = moeep__v1__request__unpack(NULL, len, buf);
                t = now_us() - t0;
                decode_us = t < decode_us ? t : decode_us;
                assert_non_null(req); /* protobuf-c itself takes it, at that cost */
                assert_int_equal(req->hello->base.n_unknown_fields, count);
                moeep__v1__request__free_unpacked(req, NULL);
        }
        assert_non_null(strstr(why, "does not know"));
        printf("a %zu-byte request of %zu unknown fields: the scan refuses it in %.1f us; protobuf-c "
               "decodes it in %.1f us\n",
               len, count, scan_us, decode_us);
        /* The scan stops at the 65th field: it must cost far less than a
         * decode that allocates for each of them. */
        assert_true(scan_us * 10 < decode_us);
}

static void test_unknown_limit(void **state) {
        static uint8_t extra[4096], buf[8192];
        const char *why;
        size_t len;

        /* A newer minor's fields: up to the limit, ignored as rule 3 says. */
        len = hello_with(buf, extra, unknown_fields(extra, MOEEP_RECORD_UNKNOWN_MAX));
        assert_int_equal(scan(buf, len, &why), 0);
        len = hello_with(buf, extra, unknown_fields(extra, MOEEP_RECORD_UNKNOWN_MAX + 1));
        assert_int_equal(scan(buf, len, &why), -EBADMSG);
        /* At the envelope's level too. */
        len = unknown_fields(buf, MOEEP_RECORD_UNKNOWN_MAX + 1);
        len += hello_with(buf + len, NULL, 0);
        assert_int_equal(scan(buf, len, &why), -EBADMSG);
}

static void test_duplicates(void **state) {
        static const uint8_t major_again[] = { (1 << 3) | 0, MOEEP_PROTOCOL_MAJOR };
        uint8_t buf[256];
        const char *why;
        size_t len, one;

        /* Hello.major twice. */
        len = hello_with(buf, major_again, sizeof(major_again));
        assert_int_equal(scan(buf, len, &why), -EBADMSG);
        assert_non_null(strstr(why, "twice"));
        /* The body twice: protobuf-c would decode and merge both. */
        one = hello_with(buf, NULL, 0);
        memcpy(buf + one, buf, one);
        assert_int_equal(scan(buf, 2 * one, &why), -EBADMSG);
        /* Two members of the oneof. */
        len = one;
        buf[len++] = (MOEEP__V1__REQUEST__BODY_STATUS_GET << 3) | 2;
        buf[len++] = 0;
        assert_int_equal(scan(buf, len, &why), -EBADMSG);
        assert_non_null(strstr(why, "oneof"));
}

static void test_malformed(void **state) {
        static const uint8_t group[] = { (1000 << 3 & 0x7f) | 0x80 | 3, 1000 >> 4, 0 };
        static const uint8_t long_varint[] = { 0x08, 0xff, 0xff, 0xff, 0xff, 0xff,
                                               0xff, 0xff, 0xff, 0xff, 0xff, 0x01 };
        static const uint8_t past_end[] = { 0x0a, 0x40, 0x08, 0x01 };
        static const uint8_t tag_zero[] = { 0x00, 0x01 };
        const char *why;

        assert_int_equal(scan(group, sizeof(group), &why), -EBADMSG);
        assert_int_equal(scan(long_varint, sizeof(long_varint), &why), -EBADMSG);
        assert_int_equal(scan(past_end, sizeof(past_end), &why), -EBADMSG);
        assert_int_equal(scan(tag_zero, sizeof(tag_zero), &why), -EBADMSG);
}

static void test_encoder_requests_pass(void **state) {
        Moeep__V1__TakeFd take = MOEEP__V1__TAKE_FD__INIT;
        Moeep__V1__RegionRegister rr = MOEEP__V1__REGION_REGISTER__INIT;
        Moeep__V1__JobJoin jj = MOEEP__V1__JOB_JOIN__INIT;
        Moeep__V1__Request req = MOEEP__V1__REQUEST__INIT;
        uint8_t id[128] = { 1, 2, 3 }, buf[1024];
        const char *why;
        size_t len;

        take.fd_number = 7;
        rr.kind = MOEEP__V1__REGION_KIND__REGION_KIND_MEMFD;
        rr.size = 1 << 20;
        rr.tag = 3;
        rr.proxy = MOEEP__V1__PROXY_ROLE__PROXY_ROLE_RECV;
        rr.take = &take;
        req.body_case = MOEEP__V1__REQUEST__BODY_REGION_REGISTER;
        req.region_register = &rr;
        len = moeep__v1__request__pack(&req, buf);
        assert_int_equal(scan(buf, len, &why), 0);
        jj.unique_id.data = id;
        jj.unique_id.len = sizeof(id);
        jj.rank = 5;
        jj.world_size = 8;
        jj.gpu_uuid = "GPU-0123";
        req.body_case = MOEEP__V1__REQUEST__BODY_JOB_JOIN;
        req.job_join = &jj;
        len = moeep__v1__request__pack(&req, buf);
        assert_int_equal(scan(buf, len, &why), 0);
        assert_int_equal(scan(buf, 0, &why), 0); /* an empty Request: refused later, by its body case */
}

int main(void) {
        const struct CMUnitTest tests[] = {
                cmocka_unit_test(test_many_unknown_fields),
                cmocka_unit_test(test_unknown_limit),
                cmocka_unit_test(test_duplicates),
                cmocka_unit_test(test_malformed),
                cmocka_unit_test(test_encoder_requests_pass),
        };

        return cmocka_run_group_tests(tests, NULL, NULL);
}
