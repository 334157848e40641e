/* The job's unique id between the ranks of the mesh tests (mesh-rank.c,
 * proxy-rank.c): the creating rank writes it to a file (through a temporary
 * name and rename, so readers never see half of it); the others wait for
 * the file. The wait ends only with the file: the callers' alarm() bounds
 * it. */
#ifndef MOEEP_TESTS_MESH_JOB_ID_H
#define MOEEP_TESTS_MESH_JOB_ID_H

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <time.h>
#include <unistd.h>

#include "moeep.h"

static inline int id_write(const char *path, const struct moeep_unique_id *id) {
        char tmp[4096];
        int fd;

        snprintf(tmp, sizeof(tmp), "%s.tmp", path);
        fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
        if (fd < 0)
                return -errno;
        if (write(fd, id->bytes, sizeof(id->bytes)) != (ssize_t)sizeof(id->bytes)) {
                close(fd);
                return -EIO;
        }
        close(fd);
        return rename(tmp, path) < 0 ? -errno : 0;
}

static inline int id_read(const char *path, struct moeep_unique_id *ret_id) {
        struct timespec pause = { .tv_nsec = 10 * 1000 * 1000 };

        for (;;) {
                int fd = open(path, O_RDONLY | O_CLOEXEC);
                ssize_t n;

                if (fd < 0) {
                        if (errno != ENOENT)
                                return -errno;
                        nanosleep(&pause, NULL);
                        continue;
                }
                n = read(fd, ret_id->bytes, sizeof(ret_id->bytes));
                close(fd);
                return n == (ssize_t)sizeof(ret_id->bytes) ? 0 : -EBADMSG;
        }
}

#endif
