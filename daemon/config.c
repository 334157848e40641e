/* moeepd configuration; see config.h. */
#include <arpa/inet.h>
#include <errno.h>
#include <ini.h>
#include <inttypes.h>
#include <limits.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "admin-socket.h"
#include "config.h"
#include "log.h"
#include "moeep-config.h"

/* The defaults, in the file's own syntax, so that one parser fills in both
 * and `moeepd` runs with no file at all. */
static const char default_config[] = "socket = " MOEEP_DEFAULT_SOCKET "\n"
                                     "socket_mode = 0660\n"
                                     "socket_group =\n"
                                     "admin_socket =\n"
                                     "admin_group =\n"
                                     "log_level = info\n"
                                     "max_sessions = 1024\n"
                                     "max_sessions_per_uid = 64\n"
                                     "max_jobs_per_uid = 16\n"
                                     "max_mirrors_per_peer = 256\n"
                                     "max_regions_per_session = 8\n"
                                     "max_region_bytes_per_uid = 1T\n"
                                     "max_fds_per_uid = 512\n"
                                     "max_proxy_bytes_per_uid = 16G\n"
                                     "max_proxy_bytes = 64G\n"
                                     "metrics_listen =\n"
                                     "transport = fabric\n"
                                     "fabric_provider = efa\n"
                                     "transport_device =\n"
                                     "transport_address =\n"
                                     "verbs_gid_index = 0\n"
                                     "mesh_listen =\n"
                                     "mesh_peers =\n"
                                     "cluster_key_file =\n";

enum key_type {
        KEY_PATH,
        KEY_PATH_OPT,  /* a socket path, or empty */
        KEY_TRANSPORT, /* a transport backend name */
        KEY_NAME,      /* a provider or device name, or empty */
        KEY_MODE,
        KEY_GROUP,
        KEY_LEVEL,
        KEY_U32,
        KEY_BYTES,
        KEY_LISTEN,
        KEY_PEERS, /* comma list of listen addresses */
        KEY_FILE,  /* absolute path, or empty */
};

/* Every key, its type, where it lives, its range and whether SIGHUP applies
 * it. One table so that parsing, validation and reload agree. */
static const struct key {
        const char *name;
        enum key_type type;
        size_t offset;
        uint64_t min, max;
        bool reloadable;
} keys[] = {
        { "socket", KEY_PATH, offsetof(struct config, socket), 0, 0, false },
        { "socket_mode", KEY_MODE, offsetof(struct config, socket_mode), 0, 0777, false },
        { "socket_group", KEY_GROUP, offsetof(struct config, socket_group), 0, 0, false },
        /* Empty: next to `socket` (moeep_admin_socket_path()). */
        { "admin_socket", KEY_PATH_OPT, offsetof(struct config, admin_socket), 0, 0, false },
        /* Obsolete: operator rights come from the admin socket now. Still
         * read, so that files that set it keep loading. */
        { "admin_group", KEY_GROUP, offsetof(struct config, admin_group), 0, 0, true },
        { "log_level", KEY_LEVEL, offsetof(struct config, log_level), 0, 0, true },
        { "max_sessions", KEY_U32, offsetof(struct config, max_sessions), 1, 65536, true },
        { "max_sessions_per_uid", KEY_U32, offsetof(struct config, max_sessions_per_uid), 1, 65536, true },
        { "max_jobs_per_uid", KEY_U32, offsetof(struct config, max_jobs_per_uid), 1, 4096, true },
        { "max_mirrors_per_peer", KEY_U32, offsetof(struct config, max_mirrors_per_peer), 1, 4096, true },
        /* A Regions record carries at most MOEEP_RECORD_MAX_FDS (64) fds. */
        { "max_regions_per_session", KEY_U32, offsetof(struct config, max_regions_per_session), 1, 64, true },
        { "max_region_bytes_per_uid", KEY_BYTES, offsetof(struct config, max_region_bytes_per_uid), 1,
          UINT64_MAX, true },
        { "max_fds_per_uid", KEY_U32, offsetof(struct config, max_fds_per_uid), 1, 65536, true },
        /* Host memory the transport maps or pins for proxy regions
         * (datapath.c): far below max_region_bytes_per_uid, since it is
         * the daemon's memory and address space, not the client's. */
        { "max_proxy_bytes_per_uid", KEY_BYTES, offsetof(struct config, max_proxy_bytes_per_uid), 1,
          UINT64_MAX, true },
        { "max_proxy_bytes", KEY_BYTES, offsetof(struct config, max_proxy_bytes), 1, UINT64_MAX, true },
        { "metrics_listen", KEY_LISTEN, offsetof(struct config, metrics_listen), 0, 0, false },
        /* Transports (transport.h) are opened once at start-up. */
        { "transport", KEY_TRANSPORT, offsetof(struct config, transport), 0, 0, false },
        { "fabric_provider", KEY_NAME, offsetof(struct config, fabric_provider), 1, 0, false },
        { "transport_device", KEY_NAME, offsetof(struct config, transport_device), 0, 0, false },
        { "transport_address", KEY_NAME, offsetof(struct config, transport_address), 0, 0, false },
        { "verbs_gid_index", KEY_U32, offsetof(struct config, verbs_gid_index), 0, 255, false },
        /* The mesh (mesh.c) is set up once at start-up. */
        { "mesh_listen", KEY_LISTEN, offsetof(struct config, mesh_listen), 0, 0, false },
        { "mesh_peers", KEY_PEERS, offsetof(struct config, mesh_peers), 0, 0, false },
        { "cluster_key_file", KEY_FILE, offsetof(struct config, cluster_key_file), 0, 0, false },
};

static const struct key *key_find(const char *name) {
        for (size_t i = 0; i < sizeof(keys) / sizeof(keys[0]); i++)
                if (strcmp(keys[i].name, name) == 0)
                        return &keys[i];
        return NULL;
}

bool config_key_reloadable(const char *name) {
        const struct key *k = key_find(name);

        return k && k->reloadable;
}

/* Parses a whole unsigned number in `base`, with an optional K/M/G/T
 * (powers of 1024) suffix when `suffixes` is set. */
static int parse_u64(const char *s, int base, bool suffixes, uint64_t *ret) {
        unsigned long long v;
        unsigned shift = 0;
        char *end;

        if (!s || s[0] < '0' || s[0] > '9')
                return -EINVAL;
        errno = 0;
        v = strtoull(s, &end, base);
        if (errno != 0)
                return -EINVAL;
        if (suffixes && *end) {
                switch (*end) {
                case 'K':
                        shift = 10;
                        break;
                case 'M':
                        shift = 20;
                        break;
                case 'G':
                        shift = 30;
                        break;
                case 'T':
                        shift = 40;
                        break;
                default:
                        return -EINVAL; /* a character, not one of our enums */
                }
                end++;
        }
        if (*end)
                return -EINVAL;
        if (shift && v > (UINT64_MAX >> shift))
                return -EINVAL;
        *ret = (uint64_t)v << shift;
        return 0;
}

int config_listen_split(const char *value, char *ret_host, uint16_t *ret_port) {
        const char *colon = strrchr(value, ':'), *host = value, *port = value;
        char buf[CONFIG_HOST_MAX] = "127.0.0.1";
        unsigned char addr[sizeof(struct in6_addr)];
        size_t hostlen;
        uint64_t v;

        if (colon) {
                bool v6;

                hostlen = (size_t)(colon - value);
                port = colon + 1;
                v6 = hostlen >= 2 && host[0] == '[' && host[hostlen - 1] == ']';
                if (v6) {
                        host++;
                        hostlen -= 2;
                }
                if (hostlen == 0 || hostlen >= sizeof(buf))
                        return -EINVAL;
                memcpy(buf, host, hostlen);
                buf[hostlen] = '\0';
                if (v6 ? inet_pton(AF_INET6, buf, addr) != 1
                       : strcmp(buf, "localhost") != 0 && inet_pton(AF_INET, buf, addr) != 1)
                        return -EINVAL;
        }
        if (parse_u64(port, 10, false, &v) < 0 || v > 65535)
                return -EINVAL;
        memcpy(ret_host, buf, strlen(buf) + 1);
        *ret_port = (uint16_t)v;
        return 0;
}

static int set_string(char **field, const char *value) {
        char *copy = strdup(value);

        if (!copy)
                return -ENOMEM;
        free(*field);
        *field = copy;
        return 0;
}

int config_set(struct config *c, const char *name, const char *value, char *errmsg) {
        const struct key *k = key_find(name);
        void *field;
        uint64_t v;
        int level;

        if (!k)
                return errmsg_set(errmsg, -ENOENT, "unknown configuration key '%s'", name);
        field = (char *)c + k->offset;
        switch (k->type) {
        case KEY_PATH_OPT:
        case KEY_PATH:
                if (k->type == KEY_PATH_OPT && !value[0])
                        return set_string(field, value) < 0
                                       ? errmsg_set(errmsg, -ENOMEM, "%s: out of memory", name)
                                       : 0;
                if (value[0] != '/' || strlen(value) >= sizeof(((struct sockaddr_un *)0)->sun_path))
                        return errmsg_set(errmsg, -EINVAL,
                                          "%s '%s': need an absolute path shorter than %zu bytes", name,
                                          value, sizeof(((struct sockaddr_un *)0)->sun_path));
                return set_string(field, value) < 0 ? errmsg_set(errmsg, -ENOMEM, "%s: out of memory", name)
                                                    : 0;
        case KEY_LISTEN: {
                char host[CONFIG_HOST_MAX];
                uint16_t port;

                if (value[0] && config_listen_split(value, host, &port) < 0)
                        return errmsg_set(errmsg, -EINVAL,
                                          "%s '%s': need PORT, IPV4:PORT, [IPV6]:PORT or localhost:PORT "
                                          "(port 0..65535), or nothing for off",
                                          name, value);
                return set_string(field, value) < 0 ? errmsg_set(errmsg, -ENOMEM, "%s: out of memory", name)
                                                    : 0;
        }
        case KEY_PEERS: {
                char host[CONFIG_HOST_MAX], one[CONFIG_HOST_MAX + 16];
                const char *p = value;
                uint16_t port;

                while (*p) {
                        size_t n = strcspn(p, ",");

                        if (n == 0 || n >= sizeof(one))
                                return errmsg_set(errmsg, -EINVAL,
                                                  "%s '%s': need a comma list of HOST:PORT, or nothing", name,
                                                  value);
                        memcpy(one, p, n);
                        one[n] = '\0';
                        if (config_listen_split(one, host, &port) < 0 || port == 0)
                                return errmsg_set(errmsg, -EINVAL,
                                                  "%s '%s': peer '%s' is not IPV4:PORT, [IPV6]:PORT or "
                                                  "localhost:PORT (port 1..65535)",
                                                  name, value, one);
                        p += n;
                        if (*p == ',' && *++p == '\0')
                                return errmsg_set(errmsg, -EINVAL, "%s '%s': trailing comma", name, value);
                }
                return set_string(field, value) < 0 ? errmsg_set(errmsg, -ENOMEM, "%s: out of memory", name)
                                                    : 0;
        }
        case KEY_FILE:
                if (value[0] && (value[0] != '/' || strlen(value) >= PATH_MAX))
                        return errmsg_set(errmsg, -EINVAL, "%s '%s': need an absolute path, or nothing", name,
                                          value);
                return set_string(field, value) < 0 ? errmsg_set(errmsg, -ENOMEM, "%s: out of memory", name)
                                                    : 0;
        case KEY_TRANSPORT:
                if (strcmp(value, "fabric") != 0 && strcmp(value, "verbs") != 0 && strcmp(value, "cuda") != 0)
                        return errmsg_set(errmsg, -EINVAL, "%s '%s': need fabric, verbs or cuda", name,
                                          value);
                return set_string(field, value) < 0 ? errmsg_set(errmsg, -ENOMEM, "%s: out of memory", name)
                                                    : 0;
        case KEY_NAME:
                /* min = 1: the name may not be empty. */
                if ((k->min && !value[0]) || strlen(value) > 63 ||
                    strspn(value, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.;:") !=
                            strlen(value))
                        return errmsg_set(errmsg, -EINVAL,
                                          "%s '%s': need %s letters, digits and _ - . ; :", name, value,
                                          k->min ? "1 to 63" : "up to 63");
                return set_string(field, value) < 0 ? errmsg_set(errmsg, -ENOMEM, "%s: out of memory", name)
                                                    : 0;
        case KEY_GROUP:
                if (strlen(value) > 64 || strpbrk(value, ": \t"))
                        return errmsg_set(errmsg, -EINVAL, "%s '%s': not a group name", name, value);
                return set_string(field, value) < 0 ? errmsg_set(errmsg, -ENOMEM, "%s: out of memory", name)
                                                    : 0;
        case KEY_LEVEL:
                if (log_level_from_string(value, &level) < 0)
                        return errmsg_set(errmsg, -EINVAL,
                                          "%s '%s': need err, warning, notice, info or debug", name, value);
                *(int *)field = level;
                return 0;
        case KEY_MODE:
                if (parse_u64(value, 8, false, &v) < 0 || v > k->max)
                        return errmsg_set(errmsg, -EINVAL, "%s '%s': need an octal mode up to 0777", name,
                                          value);
                *(mode_t *)field = (mode_t)v;
                return 0;
        case KEY_U32:
                if (parse_u64(value, 10, false, &v) < 0 || v < k->min || v > k->max)
                        return errmsg_set(errmsg, -EINVAL,
                                          "%s '%s': need a number from %" PRIu64 " to %" PRIu64, name, value,
                                          k->min, k->max);
                *(uint32_t *)field = (uint32_t)v;
                return 0;
        case KEY_BYTES:
                if (parse_u64(value, 10, true, &v) < 0 || v < k->min)
                        return errmsg_set(errmsg, -EINVAL,
                                          "%s '%s': need a byte count >= 1 (suffixes K, M, G, T)", name,
                                          value);
                *(uint64_t *)field = v;
                return 0;
        }
        return errmsg_set(errmsg, -EINVAL, "%s: key of unknown type %d", name, (int)k->type);
}

struct load_state {
        struct config *config;
        const char *path;
        int line;
        int r; /* first error */
        char *errmsg;
        bool peers_seen; /* mesh_peers was set in this file: more lines add to it */
};

/* inih calls this once per key; returning 0 makes ini_parse() report the
 * line. Only the first error is kept. */
static int load_handler(void *user, const char *section, const char *name, const char *value) {
        struct load_state *st = user;
        char why[ERRMSG_MAX];
        int r;

        if (st->r < 0)
                return 0;
        if (section[0] && strcmp(section, "moeepd") != 0) {
                st->r = errmsg_set(st->errmsg, -EINVAL, "unknown section [%s] (key %s = '%s')", section, name,
                                   value);
                return 0;
        }
        /* A line holds 200 bytes (inih): mesh_peers may go on over
         * indented or repeated lines, which add to the list. */
        if (strcmp(name, "mesh_peers") == 0 && st->peers_seen && st->config->mesh_peers[0] && value[0]) {
                char *both = NULL;

                if (asprintf(&both, "%s,%s", st->config->mesh_peers, value) < 0)
                        both = NULL;
                r = both ? config_set(st->config, name, both, why)
                         : errmsg_set(why, -ENOMEM, "mesh_peers: out of memory");
                free(both);
        } else {
                r = config_set(st->config, name, value, why);
        }
        st->peers_seen |= strcmp(name, "mesh_peers") == 0;
        if (r < 0) {
                st->r = r == -ENOMEM ? r : -EINVAL;
                errmsg_set(st->errmsg, st->r, "%s", why);
                return 0;
        }
        return 1;
}

static int load_finish(struct load_state *st, int lineno) {
        char why[ERRMSG_MAX];

        if (lineno == -1) {
                int e = errno ? errno : EIO;

                return errmsg_set(st->errmsg, -e, "%s: cannot read: %s", st->path, strerror(e));
        }
        if (lineno == -2)
                return errmsg_set(st->errmsg, -ENOMEM, "%s: out of memory", st->path);
        if (st->r < 0) {
                /* Prefix file and line, which inih tells only now. */
                snprintf(why, sizeof(why), "%s", st->errmsg ? st->errmsg : "");
                return errmsg_set(st->errmsg, st->r, "%s:%d: %s", st->path, lineno, why);
        }
        if (lineno > 0)
                return errmsg_set(st->errmsg, -EINVAL, "%s:%d: syntax error (need 'key = value')", st->path,
                                  lineno);
        return 0;
}

/* A byte count with the largest suffix that divides it. */
static void write_bytes(FILE *f, uint64_t v) {
        static const char suffixes[] = "TGMK";

        for (int i = 0; i < 4; i++) {
                unsigned shift = (unsigned)(40 - 10 * i);

                if (v != 0 && v % ((uint64_t)1 << shift) == 0) {
                        fprintf(f, "%" PRIu64 "%c", v >> shift, suffixes[i]);
                        return;
                }
        }
        fprintf(f, "%" PRIu64, v);
}

int config_write(const struct config *c, FILE *f) {
        fputs("[moeepd]\n", f);
        for (size_t i = 0; i < sizeof(keys) / sizeof(keys[0]); i++) {
                const struct key *k = &keys[i];
                const void *field = (const char *)c + k->offset;

                fprintf(f, "%s =", k->name);
                switch (k->type) {
                case KEY_PATH:
                case KEY_PATH_OPT:
                case KEY_TRANSPORT:
                case KEY_NAME:
                case KEY_GROUP:
                case KEY_LISTEN:
                case KEY_FILE:
                        if (**(char *const *)field)
                                fprintf(f, " %s", *(char *const *)field);
                        break;
                case KEY_PEERS: {
                        /* Continued over indented lines: inih reads 200
                         * bytes a line (config_load() adds them up). */
                        const char *p = *(char *const *)field;
                        size_t width = 0;

                        while (*p) {
                                size_t n = strcspn(p, ",");

                                fprintf(f, "%s%.*s",
                                        width == 0        ? " "
                                        : width + n > 120 ? "\n   "
                                                          : ",",
                                        (int)n, p);
                                width = width + n > 120 ? n : width + n + 1;
                                p += n + (p[n] == ',');
                        }
                        break;
                }
                case KEY_MODE:
                        fprintf(f, " %04o", (unsigned)*(const mode_t *)field);
                        break;
                case KEY_LEVEL:
                        fprintf(f, " %s", log_level_to_string(*(const int *)field));
                        break;
                case KEY_U32:
                        fprintf(f, " %" PRIu32, *(const uint32_t *)field);
                        break;
                case KEY_BYTES:
                        fputc(' ', f);
                        write_bytes(f, *(const uint64_t *)field);
                        break;
                }
                fputc('\n', f);
        }
        return ferror(f) ? -EIO : 0;
}

/* What a file that is not a regular file is, for the refusal. */
static const char *file_type_to_string(mode_t mode) {
        switch (mode & S_IFMT) {
        case S_IFDIR:
                return "a directory";
        case S_IFCHR:
                return "a character device";
        case S_IFBLK:
                return "a block device";
        case S_IFIFO:
                return "a FIFO";
        case S_IFSOCK:
                return "a socket";
        case S_IFLNK:
                return "a symbolic link";
        default:
                return "not a regular file";
        }
}

int config_read_file(const char *path, char **ret_text, char *errmsg) {
        const char *via = "";
        struct stat st, lst;
        size_t len = 0;
        char *text;
        int fd, r;

        /* O_NONBLOCK: opening a FIFO for reading must not wait for a
         * writer; O_NOCTTY: a terminal must not become ours. A symlink is
         * followed (configuration management makes them), but what it
         * points to is judged by fstat() on what was opened. */
        if (lstat(path, &lst) == 0 && S_ISLNK(lst.st_mode))
                via = " (through a symbolic link)";
        fd = open(path, O_RDONLY | O_NONBLOCK | O_NOCTTY | O_CLOEXEC);
        if (fd < 0)
                return errmsg_set(errmsg, -errno, "%s: cannot open: %s", path, strerror(errno));
        if (fstat(fd, &st) < 0) {
                r = errmsg_set(errmsg, -errno, "%s: fstat: %s", path, strerror(errno));
                goto out;
        }
        if (!S_ISREG(st.st_mode)) {
                r = errmsg_set(errmsg, -EINVAL, "%s: is %s%s, not a regular file", path,
                               file_type_to_string(st.st_mode), via);
                goto out;
        }
        if (st.st_size > CONFIG_FILE_MAX) {
                r = errmsg_set(errmsg, -EFBIG,
                               "%s: %lld bytes%s: larger than the %d bytes a configuration may have", path,
                               (long long)st.st_size, via, CONFIG_FILE_MAX);
                goto out;
        }
        text = malloc(CONFIG_FILE_MAX + 2);
        if (!text) {
                r = errmsg_set(errmsg, -ENOMEM, "%s: out of memory", path);
                goto out;
        }
        /* One byte past the cap tells a file that grew after fstat(). */
        while (len <= CONFIG_FILE_MAX) {
                ssize_t n = read(fd, text + len, CONFIG_FILE_MAX + 1 - len);

                if (n < 0 && errno == EINTR)
                        continue;
                if (n < 0) {
                        r = errmsg_set(errmsg, -errno, "%s: cannot read: %s", path, strerror(errno));
                        free(text);
                        goto out;
                }
                if (n == 0)
                        break;
                len += (size_t)n;
        }
        if (len > CONFIG_FILE_MAX) {
                r = errmsg_set(errmsg, -EFBIG, "%s: larger than the %d bytes a configuration may have", path,
                               CONFIG_FILE_MAX);
                free(text);
                goto out;
        }
        if (memchr(text, '\0', len)) {
                r = errmsg_set(errmsg, -EINVAL, "%s: a NUL byte at offset %zu: not a text file", path,
                               (size_t)((char *)memchr(text, '\0', len) - text));
                free(text);
                goto out;
        }
        text[len] = '\0';
        *ret_text = text;
        r = 0;
out:
        close(fd);
        return r;
}

int config_load(struct config *c, const char *path, char *errmsg) {
        struct load_state st = { .config = c, .path = path, .errmsg = errmsg };
        char *text;
        int r;

        r = config_read_file(path, &text, errmsg);
        if (r < 0)
                return r;
        r = load_finish(&st, ini_parse_string(text, load_handler, &st));
        free(text);
        return r;
}

int config_admin_socket(const struct config *c, char *buf, size_t len) {
        if (c->admin_socket && c->admin_socket[0]) {
                if (strlen(c->admin_socket) >= len)
                        return -ENAMETOOLONG;
                memcpy(buf, c->admin_socket, strlen(c->admin_socket) + 1);
                return 0;
        }
        return moeep_admin_socket_path(c->socket, buf, len);
}

int config_init(struct config *c) {
        struct load_state st = { .config = c, .path = "(embedded defaults)" };

        memset(c, 0, sizeof(*c));
        if (load_finish(&st, ini_parse_string(default_config, load_handler, &st)) < 0) {
                config_done(c);
                return -ENOMEM; /* the defaults are valid, so only memory can fail */
        }
        return 0;
}

void config_done(struct config *c) {
        if (!c)
                return;
        free(c->socket);
        free(c->socket_group);
        free(c->admin_socket);
        free(c->admin_group);
        free(c->metrics_listen);
        free(c->transport);
        free(c->fabric_provider);
        free(c->transport_device);
        free(c->transport_address);
        free(c->mesh_listen);
        free(c->mesh_peers);
        free(c->cluster_key_file);
        c->socket = c->socket_group = c->admin_socket = c->admin_group = c->metrics_listen = NULL;
        c->transport = c->fabric_provider = c->transport_device = c->transport_address = NULL;
        c->mesh_listen = c->mesh_peers = c->cluster_key_file = NULL;
}

int config_apply_reloadable(struct config *to, const struct config *from) {
        char *admin = strdup(from->admin_group);

        if (!admin)
                return -ENOMEM;
        free(to->admin_group);
        to->admin_group = admin;
        to->log_level = from->log_level;
        to->max_sessions = from->max_sessions;
        to->max_sessions_per_uid = from->max_sessions_per_uid;
        to->max_jobs_per_uid = from->max_jobs_per_uid;
        to->max_mirrors_per_peer = from->max_mirrors_per_peer;
        to->max_regions_per_session = from->max_regions_per_session;
        to->max_region_bytes_per_uid = from->max_region_bytes_per_uid;
        to->max_fds_per_uid = from->max_fds_per_uid;
        to->max_proxy_bytes_per_uid = from->max_proxy_bytes_per_uid;
        to->max_proxy_bytes = from->max_proxy_bytes;
        return 0;
}
