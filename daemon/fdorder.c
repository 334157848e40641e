/* Sockets at the top of the descriptor table; see fdorder.h. */
#include <fcntl.h>
#include <sys/resource.h>
#include <unistd.h>

#include "fdorder.h"

int fd_top_base(void) {
        struct rlimit rl;
        rlim_t hi = 65536;

        if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < hi)
                hi = rl.rlim_cur;
        return (int)(hi - hi / 8);
}

int fd_to_top(int fd) {
        const int base = fd_top_base();
        int moved;

        if (fd < 0 || fd >= base)
                return fd;
        moved = fcntl(fd, F_DUPFD_CLOEXEC, base);
        if (moved < 0)
                return fd;
        close(fd);
        return moved;
}
