/* Unit tests of fdorder.c: a socket moves to the top of the descriptor
 * table, above files opened before it (the CUDA driver's, in moeepd),
 * keeps working and leaves no descriptor behind; one already there stays;
 * files opened later take numbers below it. */
#include <fcntl.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>
#include <unistd.h>
#include <cmocka.h>

#include "fdorder.h"
#include "unit.h"

static void test_moves_to_top(void **state) {
        int sv[2], dev, before, fd, later;
        char c = 0;

        (void)state;
        dev = open("/dev/null", O_RDONLY | O_CLOEXEC); /* a "device file" opened first */
        assert_true(dev >= 0);
        assert_int_equal(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
        assert_true(sv[0] > dev);
        before = unit_count_fds();
        fd = fd_to_top(sv[0]);
        assert_true(fd >= fd_top_base());
        assert_true(fd > dev);
        assert_int_equal(unit_count_fds(), before); /* the old number is closed */
        assert_int_equal(fcntl(sv[0], F_GETFD), -1);
        assert_true(fcntl(fd, F_GETFD) & FD_CLOEXEC);
        assert_int_equal(write(sv[1], "x", 1), 1); /* the same socket */
        assert_int_equal(read(fd, &c, 1), 1);
        assert_int_equal(c, 'x');
        assert_int_equal(fd_to_top(fd), fd);             /* at the top already: unchanged */
        later = open("/dev/null", O_RDONLY | O_CLOEXEC); /* a file opened later goes below */
        assert_true(later >= 0 && later < fd);
        assert_int_equal(fd_to_top(-1), -1);
        close(later);
        close(fd);
        close(sv[1]);
        close(dev);
}

int main(void) {
        const struct CMUnitTest tests[] = {
                cmocka_unit_test(test_moves_to_top),
        };

        return cmocka_run_group_tests(tests, NULL, NULL);
}
