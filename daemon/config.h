/* moeepd configuration: an INI file (inih) over embedded defaults, then
 * command-line overrides. Every value is validated; errors name the key and
 * the value. */
#ifndef MOEEPD_CONFIG_H
#define MOEEPD_CONFIG_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <sys/types.h>

struct config {
        char *socket;                  /* owns; listening socket path when self-bound */
        mode_t socket_mode;            /* chmod of a self-bound socket (octal in the file) */
        char *socket_group;            /* owns; chgrp of a self-bound socket, "" = leave it */
        char *admin_socket;            /* owns; operator socket path when self-bound, "" = next to socket */
        char *admin_group;             /* owns; obsolete (the admin socket decides), read and ignored */
        int log_level;                 /* LOG_ERR..LOG_DEBUG */
        uint32_t max_sessions;         /* connected sessions, all uids */
        uint32_t max_sessions_per_uid; /* connected sessions of one uid */
        uint32_t max_jobs_per_uid;     /* live jobs created by one uid */
        uint32_t max_mirrors_per_peer; /* jobs of one other daemon with ranks here (mirrors, job.h) */
        uint32_t max_regions_per_session;  /* regions one job member may register */
        uint64_t max_region_bytes_per_uid; /* sum of registered region sizes of one uid */
        uint32_t max_fds_per_uid;          /* region descriptors the daemon holds for one uid */
        uint64_t max_proxy_bytes_per_uid;  /* host memory of one uid's proxy regions the daemon maps */
        uint64_t max_proxy_bytes;          /* the same, all uids together */
        char *metrics_listen;              /* owns; "HOST:PORT" of the HTTP metrics listener, "" = off */
        char *transport;          /* owns; internode backend: "fabric", "verbs" or "cuda" (transport.h) */
        char *fabric_provider;    /* owns; libfabric provider: "efa", "verbs", "tcp" (tests) */
        char *transport_device;   /* owns; fabric domain, verbs device or cuda ordinal, "" = the first */
        char *transport_address;  /* owns; fabric: local address to bind (e.g. 127.0.0.1), "" = provider's */
        uint32_t verbs_gid_index; /* GID table index for verbs RC (RoCE) */
        char *mesh_listen;        /* owns; "HOST:PORT" peer daemons connect to, "" = mesh off */
        char *mesh_peers;         /* owns; comma list of "HOST:PORT" to connect to, "" = none */
        char *cluster_key_file;   /* owns; absolute path of the cluster key, "" = none */
};

/* Room for the host part of a listen address (an IPv6 literal at most). */
#define CONFIG_HOST_MAX 64

/* Fills `c` with the embedded defaults. Returns 0 or -ENOMEM. Free with
 * config_done(). */
int config_init(struct config *c);

/* Frees what `c` owns. Accepts a zeroed struct. */
void config_done(struct config *c);

/* Sets one key from its text form. Returns 0, -ENOENT for an unknown key,
 * -EINVAL for a bad value or -ENOMEM, with errmsg naming key and value. */
int config_set(struct config *c, const char *key, const char *value, char *errmsg);

/* Reads an INI file into `c` (keys outside any section or in [moeepd]).
 * On error `c` may be partly updated: load into a scratch copy. Returns 0,
 * -errno when the file cannot be read, or -EINVAL naming file, line, key
 * and value. */
int config_load(struct config *c, const char *path, char *errmsg);

/* The most a configuration file may hold: a larger one is refused, so that
 * a file that never ends (a symlink to /dev/zero) cannot hold the loop. */
#define CONFIG_FILE_MAX (1 << 20)

/* Reads the configuration file `path` whole, as config_load() does: it must
 * be a regular file (after following symlinks) of at most CONFIG_FILE_MAX
 * bytes without NUL bytes; FIFOs, devices and directories are refused
 * without waiting on them. Returns 0 with *ret_text (NUL-terminated; free
 * it), or -errno with errmsg naming the path and what was wrong. */
int config_read_file(const char *path, char **ret_text, char *errmsg);

/* The admin socket path in effect: admin_socket, else the one next to
 * socket (moeep_admin_socket_path()). Returns 0 or -ENAMETOOLONG. */
int config_admin_socket(const struct config *c, char *buf, size_t len);

/* Splits a listen address as metrics_listen takes it: "PORT" (meaning
 * 127.0.0.1:PORT), "HOST:PORT" or "[IPV6]:PORT", where HOST is a numeric
 * address or "localhost" and PORT 0..65535 (0: any free port). Writes the
 * host (CONFIG_HOST_MAX bytes) and the port. Returns 0 or -EINVAL. */
int config_listen_split(const char *value, char *ret_host, uint16_t *ret_port);

/* Writes every key of `c` in the file's own syntax, in the order of the
 * documentation ("moeepd --dump-config"). Returns 0 or -EIO. */
int config_write(const struct config *c, FILE *f);

/* Whether key `key` takes effect on SIGHUP (the socket keys need a
 * restart). */
bool config_key_reloadable(const char *key);

/* Copies every reloadable key from `from` into `to`; returns -ENOMEM
 * leaving `to` unchanged. */
int config_apply_reloadable(struct config *to, const struct config *from);

#endif
