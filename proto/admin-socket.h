/* Where the operator (admin) socket lives when nobody names it. moeepd
 * binds it there and moeepctl looks for it there, so both use this one
 * rule: in a directory of its own beside the client socket's, named like
 * that directory with "-admin" appended, under the client socket's own
 * file name:
 *
 *   /run/moeep/moeepd.sock -> /run/moeep-admin/moeepd.sock
 *                             (MOEEP_DEFAULT_ADMIN_SOCKET)
 *   /run/moeep/gpu0.sock   -> /run/moeep-admin/gpu0.sock
 *   /tmp/t/moeepd.sock     -> /tmp/t-admin/moeepd.sock
 *
 * never in the client socket's directory, which containers are given
 * (docs/operations.md), so that mounting it never hands a container the
 * operator's socket; daemons on private sockets (tests, several daemons on
 * one host) each have their own. A client socket whose directory is "/",
 * ".", ".." or none has no admin socket by this rule: name one. */
#ifndef MOEEP_ADMIN_SOCKET_H
#define MOEEP_ADMIN_SOCKET_H

#include <errno.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>

/* Writes the admin socket path that belongs to client socket `socket` into
 * `buf` (`len` bytes). Returns 0, -EINVAL when the client socket has no
 * directory of its own to put one beside, or -ENAMETOOLONG when it does
 * not fit. */
static inline int moeep_admin_socket_path(const char *socket, char *buf, size_t len) {
        const char *slash = strrchr(socket, '/'), *dir_end, *dir_name;
        int w;

        if (!slash || !slash[1])
                return -EINVAL;
        /* The directory's last component, repeated slashes left out. */
        for (dir_end = slash; dir_end > socket && dir_end[-1] == '/'; dir_end--)
                ;
        for (dir_name = dir_end; dir_name > socket && dir_name[-1] != '/'; dir_name--)
                ;
        if (dir_end == dir_name || (dir_end - dir_name == 1 && dir_name[0] == '.') ||
            (dir_end - dir_name == 2 && dir_name[0] == '.' && dir_name[1] == '.'))
                return -EINVAL;
        w = snprintf(buf, len, "%.*s-admin%s", (int)(dir_end - socket), socket, slash);
        return w < 0 || (size_t)w >= len ? -ENAMETOOLONG : 0;
}

#endif
