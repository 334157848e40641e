/* Listening sockets that moeepd binds itself, in directories it opens and
 * checks race-free: the directory is opened once (O_DIRECTORY |
 * O_NOFOLLOW) and everything after goes through that descriptor (the
 * stale socket's check and removal, the bind itself through
 * /proc/self/fd/N/NAME, the group), so that nobody can swap a path
 * component or a symlink in between; a socket gets its mode when it is
 * created (under a umask), never by a chmod() that could follow a link.
 *
 * The admin socket's directory must be private to the daemon: owned by its
 * uid, writable by nobody else, and neither the client socket's directory
 * nor below it (containers are given that one). daemon.c decides which
 * socket goes where (proto/admin-socket.h says where an unnamed admin
 * socket goes); this file only opens, checks and binds. */
#ifndef MOEEPD_SOCKDIR_H
#define MOEEPD_SOCKDIR_H

#include <stdbool.h>
#include <sys/stat.h>
#include <sys/types.h>

/* The directory of a socket path, opened. */
struct sockdir {
        int fd;         /* owns; -1 when not open */
        char path[108]; /* the directory as named ("." for a bare name) */
        char name[108]; /* the socket's file name in it */
        bool created;   /* sockdir_open() made it (sockdir_close() removes it when empty) */
        struct stat st; /* fstat of `fd` */
};

/* Splits `socket_path` and opens its directory, creating it (mode 0700)
 * first when `create` is set and it is missing. Returns 0, or -errno with
 * errmsg naming the directory (-ELOOP: it is a symlink). */
int sockdir_open(struct sockdir *d, const char *socket_path, bool create, char *errmsg);

/* Whether `d` is private to this process's uid: owned by it, writable by
 * nobody else. Returns 0, or -EPERM with errmsg saying what is wrong. */
int sockdir_check_private(const struct sockdir *d, char *errmsg);

/* Whether `d` is the directory `other` (dev and inode as fstat gave them)
 * or lies below it: 1, 0, or -errno. */
int sockdir_within(const struct sockdir *d, const struct stat *other);

/* Binds and listens on a SOCK_SEQPACKET socket at d->name: a socket left
 * there by a daemon that died is removed (one that answers: -EADDRINUSE;
 * anything but a socket: -EEXIST); the socket is created with exactly
 * `mode` and, when `gid` is not (gid_t)-1, given that group. Returns the
 * listening fd (non-blocking, close-on-exec), or -errno with errmsg. */
int sockdir_bind(const struct sockdir *d, mode_t mode, gid_t gid, char *errmsg);

/* Removes the socket bound in `d` (when `unlink_socket`), then the
 * directory when sockdir_open() created it and it is empty, and closes
 * it. Accepts a closed one. */
void sockdir_close(struct sockdir *d, bool unlink_socket);

#endif
