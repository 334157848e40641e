/* Where the operator (admin) socket lives when nobody names it. moeepd
 * binds it there and moeepctl looks for it there, so both use this one
 * rule:
 *
 * - next to the default client socket (MOEEP_DEFAULT_SOCKET,
 *   /run/moeep/moeepd.sock): MOEEP_DEFAULT_ADMIN_SOCKET,
 *   /run/moeep-admin/moeepd.sock, outside /run/moeep, the directory that
 *   containers are given (docs/operations.md), so that mounting it never
 *   hands a container the operator's socket;
 * - next to any other client socket: the same path with "-admin" before
 *   ".sock" (/tmp/t/moeepd.sock -> /tmp/t/moeepd-admin.sock), so that
 *   daemons on private sockets (tests, several daemons on one host) each
 *   have their own. */
#ifndef MOEEP_ADMIN_SOCKET_H
#define MOEEP_ADMIN_SOCKET_H

#include <errno.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>

#include "moeep-config.h"

/* Writes the admin socket path that belongs to client socket `socket` into
 * `buf` (`len` bytes). Returns 0, or -ENAMETOOLONG when it does not fit. */
static inline int moeep_admin_socket_path(const char *socket, char *buf, size_t len) {
        size_t n = strlen(socket);
        int w;

        if (strcmp(socket, MOEEP_DEFAULT_SOCKET) == 0)
                w = snprintf(buf, len, "%s", MOEEP_DEFAULT_ADMIN_SOCKET);
        else {
                if (n >= 5 && strcmp(socket + n - 5, ".sock") == 0)
                        n -= 5;
                w = snprintf(buf, len, "%.*s-admin.sock", (int)n, socket);
        }
        return w < 0 || (size_t)w >= len ? -ENAMETOOLONG : 0;
}

#endif
