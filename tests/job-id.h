/* The job's unique id between the rank processes of the tests (e2e/rank.c,
 * mesh/mesh-rank.c, mesh/proxy-rank.c): the creating rank writes it to a
 * file (through a temporary name and rename, so readers never see half of
 * it); the others wait for the file. The wait ends only with the file: the
 * callers' alarm() bounds it. */
#ifndef MOEEP_TESTS_JOB_ID_H
#define MOEEP_TESTS_JOB_ID_H

#include <errno.h>
#include <fcntl.h>
#include <stdbool.h>
#include <stdio.h>
#include <time.h>
#include <unistd.h>

#include "moeep.h"

static inline int id_write(const char *path, const struct moeep_unique_id *id) {
        char tmp[4096];
        int fd;

        if (snprintf(tmp, sizeof(tmp), "%s.tmp.%d", path, (int)getpid()) >= (int)sizeof(tmp))
                return -ENAMETOOLONG;
        fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
        if (fd < 0)
                return -errno;
        if (write(fd, id->bytes, sizeof(id->bytes)) != (ssize_t)sizeof(id->bytes) || fsync(fd) < 0) {
                int r = errno ? -errno : -EIO;

                close(fd);
                unlink(tmp);
                return r;
        }
        close(fd);
        if (rename(tmp, path) < 0) {
                int r = -errno;

                unlink(tmp);
                return r;
        }
        return 0;
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
                if (n != (ssize_t)sizeof(ret_id->bytes))
                        return n < 0 ? -errno : -EBADMSG;
                return 0;
        }
}

/* The whole exchange: the creating rank creates job `name` of `world`
 * ranks and publishes its id at `path`; the others wait for it there.
 * Returns 0, or -errno with *ret_what naming the step that failed. */
static inline int id_share(struct moeep_client *c, bool create, const char *name, int world, const char *path,
                           struct moeep_unique_id *ret_id, const char **ret_what) {
        int r;

        if (!create) {
                *ret_what = "reading the unique id file";
                return id_read(path, ret_id);
        }
        *ret_what = "moeep_job_create";
        if ((r = moeep_job_create(c, name, world, ret_id)) < 0)
                return r;
        *ret_what = "writing the unique id file";
        return id_write(path, ret_id);
}

#endif
