/* Helpers shared by the unit tests; see unit.h. */
#include <dirent.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "unit.h"

int unit_count_fds(void) {
        DIR *d = opendir("/proc/self/fd");
        struct dirent *e;
        int n = 0;

        if (!d)
                abort();
        while ((e = readdir(d)))
                if (e->d_name[0] != '.')
                        n++;
        closedir(d);
        return n - 1;
}

int unit_memfd(size_t size, const char *text) {
        int fd = memfd_create("unit", MFD_CLOEXEC);

        if (fd < 0 || ftruncate(fd, (off_t)size) < 0)
                abort();
        if (text && pwrite(fd, text, strlen(text) + 1, 0) < 0)
                abort();
        return fd;
}
