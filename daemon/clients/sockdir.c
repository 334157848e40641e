/* Listening sockets in directories opened and checked race-free; see
 * sockdir.h. */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "clients/sockdir.h"
#include "log.h"

int sockdir_open(struct sockdir *d, const char *socket_path, bool create, char *errmsg) {
        const char *slash = strrchr(socket_path, '/');
        size_t dlen;

        *d = (struct sockdir){ .fd = -1 };
        if (strlen(socket_path) >= sizeof(d->path))
                return errmsg_set(errmsg, -ENAMETOOLONG, "socket %s: longer than %zu bytes", socket_path,
                                  sizeof(d->path) - 1);
        if (!slash) {
                snprintf(d->path, sizeof(d->path), ".");
                snprintf(d->name, sizeof(d->name), "%s", socket_path);
        } else {
                dlen = slash == socket_path ? 1 : (size_t)(slash - socket_path);
                snprintf(d->path, sizeof(d->path), "%.*s", (int)dlen, socket_path);
                snprintf(d->name, sizeof(d->name), "%s", slash + 1);
        }
        if (!d->name[0] || strcmp(d->name, ".") == 0 || strcmp(d->name, "..") == 0)
                return errmsg_set(errmsg, -EINVAL, "socket %s: names no file", socket_path);
        if (create) {
                if (mkdir(d->path, 0700) == 0)
                        d->created = true;
                else if (errno != EEXIST)
                        return errmsg_set(errmsg, -errno, "directory %s: mkdir: %s", d->path,
                                          strerror(errno));
        }
        d->fd = open(d->path, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
        if (d->fd < 0)
                return errmsg_set(errmsg, -errno, "directory %s: %s", d->path,
                                  errno == ELOOP || errno == ENOTDIR ? "is a symlink, or not a directory"
                                                                     : strerror(errno));
        if (fstat(d->fd, &d->st) < 0) {
                int r = -errno;

                sockdir_close(d, false);
                return errmsg_set(errmsg, r, "directory %s: fstat: %s", d->path, strerror(-r));
        }
        return 0;
}

int sockdir_check_private(const struct sockdir *d, char *errmsg) {
        if (d->st.st_uid != geteuid())
                return errmsg_set(errmsg, -EPERM,
                                  "directory %s is owned by uid %u, not by the daemon's uid %u: whoever owns "
                                  "it can put a socket of their own where moeepctl looks for the daemon's; "
                                  "remove it, or set admin_socket to a path in a directory of uid %u",
                                  d->path, (unsigned)d->st.st_uid, (unsigned)geteuid(), (unsigned)geteuid());
        if (d->st.st_mode & 022)
                return errmsg_set(errmsg, -EPERM,
                                  "directory %s is mode 0%o: writable by others, who can put a socket of "
                                  "their own where moeepctl looks for the daemon's; make it 0700",
                                  d->path, (unsigned)(d->st.st_mode & 07777));
        return 0;
}

int sockdir_within(const struct sockdir *d, const struct stat *other) {
        struct stat st = d->st;
        int fd = -1, r = 0;

        /* Up through "..", at most 256 levels, until the root (whose ".."
         * is itself). */
        for (int depth = 0; depth < 256; depth++) {
                int up;

                if (st.st_dev == other->st_dev && st.st_ino == other->st_ino) {
                        r = 1;
                        break;
                }
                up = openat(fd >= 0 ? fd : d->fd, "..", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
                if (up < 0) {
                        r = -errno;
                        break;
                }
                if (fd >= 0)
                        close(fd);
                fd = up;
                {
                        struct stat parent;

                        if (fstat(fd, &parent) < 0) {
                                r = -errno;
                                break;
                        }
                        if (parent.st_dev == st.st_dev && parent.st_ino == st.st_ino)
                                break; /* the root */
                        st = parent;
                }
        }
        if (fd >= 0)
                close(fd);
        return r;
}

/* The address of d->name through the open directory: nobody can swap a
 * path component under it. */
static int sockdir_addr(const struct sockdir *d, struct sockaddr_un *ret) {
        int n;

        *ret = (struct sockaddr_un){ .sun_family = AF_UNIX };
        n = snprintf(ret->sun_path, sizeof(ret->sun_path), "/proc/self/fd/%d/%s", d->fd, d->name);
        return n < 0 || (size_t)n >= sizeof(ret->sun_path) ? -ENAMETOOLONG : 0;
}

/* A socket already at d->name: refuse when a daemon answers there, remove
 * it when it is a stale leftover of a daemon that died. */
static int sockdir_clear_stale(const struct sockdir *d, const struct sockaddr_un *sa) {
        struct stat st;
        int fd, r;

        if (fstatat(d->fd, d->name, &st, AT_SYMLINK_NOFOLLOW) < 0)
                return errno == ENOENT ? 0 : -errno;
        if (!S_ISSOCK(st.st_mode))
                return -EEXIST;
        fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
        if (fd < 0)
                return -errno;
        r = connect(fd, (const struct sockaddr *)sa, sizeof(*sa));
        close(fd);
        if (r == 0)
                return -EADDRINUSE;
        if (unlinkat(d->fd, d->name, 0) < 0 && errno != ENOENT)
                return -errno;
        return 0;
}

int sockdir_bind(const struct sockdir *d, mode_t mode, gid_t gid, char *errmsg) {
        struct sockaddr_un sa;
        mode_t old_umask;
        struct stat st;
        int fd, r;

        if (sockdir_addr(d, &sa) < 0)
                return errmsg_set(errmsg, -ENAMETOOLONG, "socket %s/%s: the name is too long", d->path,
                                  d->name);
        r = sockdir_clear_stale(d, &sa);
        if (r < 0)
                return errmsg_set(errmsg, r, "socket %s/%s: %s", d->path, d->name,
                                  r == -EADDRINUSE ? "another daemon is listening there"
                                  : r == -EEXIST   ? "exists and is not a socket"
                                                   : strerror(-r));
        fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
        if (fd < 0)
                return errmsg_set(errmsg, -errno, "socket %s/%s: socket(): %s", d->path, d->name,
                                  strerror(errno));
        /* Created with its mode: it is never more open than `mode`, and no
         * chmod() afterwards could follow a link put in its place. */
        old_umask = umask(~mode & 0777);
        r = bind(fd, (struct sockaddr *)&sa, sizeof(sa));
        umask(old_umask);
        if (r < 0) {
                r = errmsg_set(errmsg, -errno, "socket %s/%s: bind: %s", d->path, d->name, strerror(errno));
                goto fail;
        }
        if (gid != (gid_t)-1 && fchownat(d->fd, d->name, (uid_t)-1, gid, AT_SYMLINK_NOFOLLOW) < 0) {
                r = errmsg_set(errmsg, -errno, "socket %s/%s: chgrp %u: %s", d->path, d->name, (unsigned)gid,
                               strerror(errno));
                goto fail_unlink;
        }
        /* A default ACL on the directory would override the umask. */
        if (fstatat(d->fd, d->name, &st, AT_SYMLINK_NOFOLLOW) < 0 || !S_ISSOCK(st.st_mode) ||
            (st.st_mode & 0777 & ~mode)) {
                r = errmsg_set(errmsg, -EPERM,
                               "socket %s/%s: came out mode 0%o, not 0%o (a default ACL on %s?)", d->path,
                               d->name, (unsigned)(st.st_mode & 07777), (unsigned)mode, d->path);
                goto fail_unlink;
        }
        if (listen(fd, SOMAXCONN) < 0) {
                r = errmsg_set(errmsg, -errno, "socket %s/%s: listen: %s", d->path, d->name, strerror(errno));
                goto fail_unlink;
        }
        return fd;

fail_unlink:
        unlinkat(d->fd, d->name, 0);
fail:
        close(fd);
        return r;
}

void sockdir_close(struct sockdir *d, bool unlink_socket) {
        if (d->fd < 0)
                return;
        if (unlink_socket)
                unlinkat(d->fd, d->name, 0);
        close(d->fd);
        d->fd = -1;
        if (d->created)
                (void)rmdir(d->path); /* only when empty: ENOTEMPTY otherwise */
        d->created = false;
}
