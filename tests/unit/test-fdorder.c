/* Unit tests of fdorder.c: a socket moves to the top of the descriptor
 * table, above the highest device file, keeps working and leaves no
 * descriptor behind; one already there stays; files opened later take
 * numbers below it. */
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

/* A "device" (here /dev/null) open at fd `at`. */
static int device_at(int at) {
        int fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
        int moved;

        assert_true(fd >= 0);
        moved = fcntl(fd, F_DUPFD_CLOEXEC, at);
        assert_true(moved >= at);
        close(fd);
        return moved;
}

static void test_moves_above(void **state) {
        int sv[2], dev_lo, dev_hi, before, fd;
        char c = 0;

        (void)state;
        dev_lo = device_at(40);
        dev_hi = device_at(60);
        assert_int_equal(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
        assert_true(sv[0] < dev_lo);
        before = unit_count_fds();
        fd = fd_above_files(sv[0], "/dev/null");
        assert_true(fd > dev_hi);
        assert_true(fd >= fd_top_base());           /* at the top: later files go below */
        assert_int_equal(unit_count_fds(), before); /* the old number is closed */
        assert_int_equal(fcntl(sv[0], F_GETFD), -1);
        assert_true(fcntl(fd, F_GETFD) & FD_CLOEXEC);
        assert_int_equal(write(sv[1], "x", 1), 1); /* the same socket */
        assert_int_equal(read(fd, &c, 1), 1);
        assert_int_equal(c, 'x');
        /* Above them already: unchanged. */
        assert_int_equal(fd_above_files(fd, "/dev/null"), fd);
        close(fd);
        close(sv[1]);
        close(dev_lo);
        close(dev_hi);
}

static void test_no_devices(void **state) {
        int sv[2], fd, later;

        (void)state;
        assert_int_equal(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
        fd = fd_above_devices(sv[0]); /* no GPU files in this test: to the top all the same */
        assert_true(fd >= fd_top_base());
        assert_int_equal(fd_above_files(fd, "/dev/no-such-device"), fd);
        later = open("/dev/null", O_RDONLY | O_CLOEXEC); /* a file opened later goes below */
        assert_true(later >= 0 && later < fd);
        assert_int_equal(fd_above_files(-1, "/dev/null"), -1);
        close(later);
        close(fd);
        close(sv[1]);
}

int main(void) {
        const struct CMUnitTest tests[] = {
                cmocka_unit_test(test_moves_above),
                cmocka_unit_test(test_no_devices),
        };

        return cmocka_run_group_tests(tests, NULL, NULL);
}
