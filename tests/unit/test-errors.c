/* Unit tests of errors.c: every error kind maps to its ErrorCode and back;
 * errno values that system calls produce are never read as refusals. */
#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <cmocka.h>

#include "errors.h"
#include "moeep.pb-c.h"

static void test_kinds_both_ways(void **state) {
        for (int k = ERROR_KIND_FIRST; k <= ERROR_KIND_LAST; k++) {
                int code = error_code(-k);

                assert_int_not_equal(code, MOEEP__V1__ERROR_CODE__ERROR_INTERNAL);
                assert_int_equal(error_from_code(code), -k);
                assert_non_null(error_to_string(-k));
                assert_null(strstr(error_to_string(-k), "Unknown error"));
        }
        assert_int_equal(error_code(-ERROR_KIND_BAD_SECRET), MOEEP__V1__ERROR_CODE__ERROR_BAD_SECRET);
        assert_int_equal(error_code(-ERROR_KIND_PERMISSION_DENIED),
                         MOEEP__V1__ERROR_CODE__ERROR_PERMISSION_DENIED);
        assert_int_equal(error_code(-ERROR_KIND_BAD_FDS), MOEEP__V1__ERROR_CODE__ERROR_BAD_FDS);
        /* Codes that are no kind. */
        assert_int_equal(error_from_code(MOEEP__V1__ERROR_CODE__ERROR_INTERNAL), -EIO);
        assert_int_equal(error_from_code(MOEEP__V1__ERROR_CODE__ERROR_BAD_RECORD), -EIO);
}

static void test_system_errnos(void **state) {
        /* What mmap(), open() and bind() say is not a refusal. */
        assert_int_equal(error_code(-EACCES), MOEEP__V1__ERROR_CODE__ERROR_INTERNAL);
        assert_int_equal(error_code(-EPERM), MOEEP__V1__ERROR_CODE__ERROR_INTERNAL);
        assert_int_equal(error_code(-ENOMEM), MOEEP__V1__ERROR_CODE__ERROR_INTERNAL);
        assert_int_equal(error_code(-EIO), MOEEP__V1__ERROR_CODE__ERROR_INTERNAL);
        /* Refusals that exist only as kinds: these errnos mean nothing. */
        assert_int_equal(error_code(-ESHUTDOWN), MOEEP__V1__ERROR_CODE__ERROR_INTERNAL);
        assert_int_equal(error_code(-EDOM), MOEEP__V1__ERROR_CODE__ERROR_INTERNAL);
        assert_int_equal(error_code(-ERROR_KIND_DRAINING), MOEEP__V1__ERROR_CODE__ERROR_DRAINING);
        assert_int_equal(error_code(-ERROR_KIND_WORLD_SIZE_MISMATCH),
                         MOEEP__V1__ERROR_CODE__ERROR_WORLD_SIZE_MISMATCH);
        /* The one errno read as a kind: the fd caps. */
        assert_int_equal(error_code(-EDQUOT), MOEEP__V1__ERROR_CODE__ERROR_LIMIT_EXCEEDED);
        /* The errnos modules used to return for a refusal, now kinds: a
         * system call's ENOENT, EAGAIN or EPIPE is no refusal. */
        static const int former[] = { EINVAL,    ENOENT,  ERANGE, EEXIST, E2BIG,  ENOTCONN,
                                      ECANCELED, EISCONN, EBADF,  EPIPE,  EAGAIN, EALREADY };

        for (size_t i = 0; i < sizeof(former) / sizeof(former[0]); i++)
                assert_int_equal(error_code(-former[i]), MOEEP__V1__ERROR_CODE__ERROR_INTERNAL);
        assert_string_equal(error_to_string(-EACCES), strerror(EACCES));
}

int main(void) {
        const struct CMUnitTest tests[] = {
                cmocka_unit_test(test_kinds_both_ways),
                cmocka_unit_test(test_system_errnos),
        };

        return cmocka_run_group_tests(tests, NULL, NULL);
}
