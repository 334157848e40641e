/* Sockets numbered above the CUDA driver's files; see fdorder.h. */
#include <dirent.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>

#include "fdorder.h"

/* The highest fd of this process open on a file whose path starts with
 * `prefix`, or -1. */
static int highest_fd_on(const char *prefix) {
        const size_t plen = strlen(prefix);
        DIR *dir = opendir("/proc/self/fd");
        struct dirent *de;
        int best = -1;

        if (!dir)
                return -1;
        while ((de = readdir(dir)) != NULL) {
                char path[64], target[256];
                char *end;
                long n = strtol(de->d_name, &end, 10);
                ssize_t len;

                if (*end || end == de->d_name || n <= best || n == dirfd(dir))
                        continue;
                snprintf(path, sizeof(path), "/proc/self/fd/%ld", n);
                len = readlink(path, target, sizeof(target) - 1);
                if (len < (ssize_t)plen)
                        continue;
                target[len] = '\0';
                if (strncmp(target, prefix, plen) == 0)
                        best = (int)n;
        }
        closedir(dir);
        return best;
}

int fd_top_base(void) {
        struct rlimit rl;
        rlim_t hi = 65536;

        if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < hi)
                hi = rl.rlim_cur;
        return (int)(hi - hi / 8);
}

int fd_above_files(int fd, const char *prefix) {
        int floor, moved;

        if (fd < 0)
                return fd;
        floor = highest_fd_on(prefix) + 1;
        if (floor < fd_top_base())
                floor = fd_top_base();
        if (fd >= floor)
                return fd;
        moved = fcntl(fd, F_DUPFD_CLOEXEC, floor);
        if (moved < 0)
                return fd;
        close(fd);
        return moved;
}

int fd_above_devices(int fd) {
        return fd_above_files(fd, "/dev/nvidia");
}
