/* Descriptors that clients send: whether an fd is of the region kind a
 * client says (region_rules, clientfd_check); see clientfd.h. Accounting and
 * closing are in clientfd.c. */
#include <errno.h>
#include <event2/event.h>
#include <fcntl.h>
#include <inttypes.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/queue.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/vfs.h>
#include <time.h>
#include <unistd.h>

#include "config.h"
#include "errors.h"
#include "log.h"
#include "record.h"
#include "state/clientfd-internal.h"

enum size_source {
        SIZE_NONE,   /* opaque: the driver checks it at import */
        SIZE_STATX,  /* the inode's size (shmem: exact, never revalidated) */
        SIZE_FDINFO, /* the dma-buf's "size:" line of fdinfo (clientfd_fdinfo_size()) */
};

/* What an fd of one region kind must look like. The checks run in the
 * field order below; each one is made only once the ones before proved it
 * cannot block: a FUSE inode fails the type or seals test before anything
 * else looks at it, and fdinfo, whose text the kernel builds with the
 * file's own locks held (an epoll fd's mutex, which a client can hold for
 * as long as it likes), is read only of an fd fs_magic proved a dma-buf. */
struct region_rule {
        enum region_kind kind;
        const char *name; /* the kind, as clients spell it in errors */
        const char *is;   /* what a matching fd is */
        mode_t type;      /* S_IFMT of the inode; 0 = none (an anonymous inode) */
        int rdev_major;   /* character devices: device number, -1 = any */
        int rdev_minor;
        bool seals;     /* F_GET_SEALS must work: shmem or hugetlbfs only */
        bool memfd_dev; /* same superblock as the daemon's own memfds */
        /* fstatfs() f_type, 0 = not asked. Asked only of an anonymous
         * inode (type 0): only the kernel's pseudo-filesystems make those
         * (FUSE refuses a mode without a file type), and their statfs
         * answers from memory. */
        unsigned long fs_magic;
        enum size_source size; /* SIZE_FDINFO needs fs_magic DMA_BUF_MAGIC */
};

static const struct region_rule region_rules[] = {
        {
                .kind = REGION_KIND_MEMFD,
                .name = "memfd",
                .is = "a memfd (memfd_create)",
                .type = S_IFREG,
                .rdev_major = -1,
                .rdev_minor = -1,
                .seals = true,
                .memfd_dev = true,
                .size = SIZE_STATX,
        },
        {
                .kind = REGION_KIND_CUMEM_FD,
                .name = "cumem-fd",
                .is = "a cuMem POSIX fd (character device 195:255, /dev/nvidiactl)",
                .type = S_IFCHR,
                .rdev_major = NVIDIA_MAJOR,
                .rdev_minor = NVIDIA_CTL_MINOR,
                .size = SIZE_NONE,
        },
        {
                .kind = REGION_KIND_DMABUF,
                .name = "dma-buf",
                .is = "a dma-buf (an anonymous inode of the dma-buf filesystem)",
                .type = 0,
                .rdev_major = -1,
                .rdev_minor = -1,
                .fs_magic = DMA_BUF_MAGIC,
                .size = SIZE_FDINFO,
        },
};

const char *clientfd_kind_to_string(enum region_kind kind) {
        switch (kind) {
        case REGION_KIND_UNSPECIFIED:
                return "unspecified";
        case REGION_KIND_CUMEM_FD:
                return "cumem-fd";
        case REGION_KIND_DMABUF:
                return "dma-buf";
        case REGION_KIND_MEMFD:
                return "memfd";
        }
        return "unknown";
}

/* ------------------------------------------------------------ checking */

/* Copies `src` for a message: printable ASCII only, at most size-1 bytes. */
static void printable(char *dst, size_t size, const char *src) {
        size_t i;

        for (i = 0; i + 1 < size && src[i]; i++)
                dst[i] = (src[i] >= 0x20 && src[i] <= 0x7e && src[i] != '\'') ? src[i] : '?';
        dst[i] = '\0';
}

/* What /proc/self/fd/N points to, for messages only: the kernel builds it
 * from the dentry without asking the filesystem, but a client chooses
 * the names it contains. */
static void fd_link(int fd, char *buf, size_t size) {
        char path[64], raw[128];
        ssize_t n;

        snprintf(path, sizeof(path), "/proc/self/fd/%d", fd);
        n = readlink(path, raw, sizeof(raw) - 1);
        if (n < 0)
                n = 0;
        raw[n] = '\0';
        printable(buf, size, raw);
}

/* Describes the fd as its statx says (and its link names), e.g. "a socket
 * (socket:[1234])" or "character device 1:5 (/dev/zero)". */
static void fd_describe(int fd, const struct statx *stx, char *buf, size_t size) {
        char link[64];
        const char *what;

        fd_link(fd, link, sizeof(link));
        switch (stx->stx_mode & S_IFMT) {
        case S_IFREG:
                what = "a regular file";
                break;
        case S_IFDIR:
                what = "a directory";
                break;
        case S_IFIFO:
                what = "a pipe or FIFO";
                break;
        case S_IFSOCK:
                what = "a socket";
                break;
        case S_IFLNK:
                what = "a symbolic link";
                break;
        case S_IFCHR:
        case S_IFBLK:
                snprintf(buf, size, "%s device %u:%u ('%s')", S_ISCHR(stx->stx_mode) ? "character" : "block",
                         stx->stx_rdev_major, stx->stx_rdev_minor, link);
                return;
        case 0:
                what = "an anonymous inode";
                break;
        default:
                what = "a file of an unknown type";
                break;
        }
        snprintf(buf, size, "%s ('%s')", what, link);
}

/* Whether the `n` bytes at `line` start with `key`. */
static bool line_has_key(const char *line, size_t n, const char *key) {
        size_t k = strlen(key);

        return n >= k && memcmp(line, key, k) == 0;
}

int clientfd_fdinfo_size(const char *text, size_t len, uint64_t *ret_size, const char **ret_why) {
        /* Lines dma_buf_show_fdinfo() prints after its "size:" line; the
         * last, "name:", holds what the client set (DMA_BUF_SET_NAME), a
         * newline and a "size:" of its own included. */
        static const char *const after_size[] = { "count:", "exp_name:", "name:" };
        const char *line = text, *end = text + len;

        while (line < end) {
                const char *nl = memchr(line, '\n', (size_t)(end - line));
                uint64_t v = 0;
                size_t n, i;

                if (!nl) /* the read stopped inside a line */
                        break;
                n = (size_t)(nl - line);
                for (size_t k = 0; k < sizeof(after_size) / sizeof(after_size[0]); k++)
                        if (line_has_key(line, n, after_size[k])) {
                                *ret_why = "its fdinfo has dma-buf lines before the size line";
                                return -EINVAL;
                        }
                if (!line_has_key(line, n, "size:")) {
                        line = nl + 1;
                        continue;
                }
                /* The first "size:" line is the kernel's: "size:\t%zu". */
                if (n < 7 || line[5] != '\t' || n - 6 > 20) {
                        *ret_why = "its fdinfo's size line is malformed";
                        return -EINVAL;
                }
                for (i = 6; i < n; i++) {
                        unsigned d = (unsigned char)line[i] - '0';

                        if (d > 9 || v > (UINT64_MAX - d) / 10) {
                                *ret_why = "its fdinfo's size line is malformed";
                                return -EINVAL;
                        }
                        v = v * 10 + d;
                }
                *ret_size = v;
                return 0;
        }
        *ret_why = "its fdinfo has no size line";
        return -EINVAL;
}

/* The size of the dma-buf `fd` from /proc/self/fdinfo/N, which
 * dma_buf_show_fdinfo() writes under a spinlock. Only for an fd proved a
 * dma-buf: the kernel builds another file's fdinfo with that file's locks
 * held. Returns 0, or -ERROR_KIND_BAD_FDS with errmsg. */
static int dmabuf_size(int fd, const struct region_rule *rule, uint64_t *ret_size, char *errmsg) {
        char path[64], buf[4096];
        const char *why;
        ssize_t n;
        int pfd;

        snprintf(path, sizeof(path), "/proc/self/fdinfo/%d", fd);
        pfd = open(path, O_RDONLY | O_CLOEXEC);
        if (pfd < 0)
                return errmsg_set(errmsg, -ERROR_KIND_BAD_FDS, "%s region: reading its fdinfo: %s",
                                  rule->name, strerror(errno));
        n = read(pfd, buf, sizeof(buf));
        close(pfd);
        if (n < 0)
                return errmsg_set(errmsg, -ERROR_KIND_BAD_FDS, "%s region: reading its fdinfo: %s",
                                  rule->name, strerror(errno));
        if (clientfd_fdinfo_size(buf, (size_t)n, ret_size, &why) < 0)
                return errmsg_set(errmsg, -ERROR_KIND_BAD_FDS, "%s region: %s", rule->name, why);
        return 0;
}

static const struct region_rule *rule_find(enum region_kind kind) {
        for (size_t i = 0; i < sizeof(region_rules) / sizeof(region_rules[0]); i++)
                if (region_rules[i].kind == kind)
                        return &region_rules[i];
        return NULL;
}

int clientfd_check(const struct clientfds *cf, int fd, enum region_kind kind, uint64_t size, char *errmsg) {
        const struct region_rule *rule = rule_find(kind);
        char what[160];
        struct statx stx;
        uint64_t actual = 0;
        int flags, r;

        if (!rule)
                return errmsg_set(errmsg, -ERROR_KIND_INVALID_ARGUMENT, "region kind %d is not known",
                                  (int)kind);
        /* fcntl(F_GETFL) reads the open file's flags, never its
         * filesystem. An O_PATH fd names a file without opening it, which
         * is how a FUSE inode would get past the type checks below. */
        flags = fcntl(fd, F_GETFL);
        if (flags < 0)
                return errmsg_set(errmsg, -ERROR_KIND_BAD_FDS, "%s region: fd: %s", rule->name,
                                  strerror(errno));
        if (flags & O_PATH)
                return errmsg_set(errmsg, -ERROR_KIND_BAD_FDS,
                                  "%s region: the fd is an O_PATH descriptor, not %s", rule->name, rule->is);
        /* AT_STATX_DONT_SYNC: the attributes the kernel has, never a
         * round trip to a FUSE server or a network filesystem. */
        if (statx(fd, "", AT_EMPTY_PATH | AT_STATX_DONT_SYNC, STATX_TYPE | STATX_MODE | STATX_SIZE, &stx) < 0)
                return errmsg_set(errmsg, -ERROR_KIND_BAD_FDS, "%s region: statx of the fd: %s", rule->name,
                                  strerror(errno));
        if ((stx.stx_mode & S_IFMT) != rule->type)
                goto wrong;
        if (rule->rdev_major >= 0 && (stx.stx_rdev_major != (unsigned)rule->rdev_major ||
                                      stx.stx_rdev_minor != (unsigned)rule->rdev_minor))
                goto wrong;
        /* F_GET_SEALS works on shmem and hugetlbfs files only and never
         * blocks: it proves the inode is not FUSE's before anything else
         * looks at it. */
        if (rule->seals && fcntl(fd, F_GET_SEALS) < 0)
                goto wrong;
        if (rule->memfd_dev && cf->memfd_dev_known &&
            makedev(stx.stx_dev_major, stx.stx_dev_minor) != cf->memfd_dev) {
                fd_describe(fd, &stx, what, sizeof(what));
                return errmsg_set(errmsg, -ERROR_KIND_BAD_FDS,
                                  "%s region: the fd is %s on a tmpfs or hugetlbfs mount, not %s", rule->name,
                                  what, rule->is);
        }
        /* An anonymous inode (the type test above): an epoll fd, an
         * eventfd, a timerfd, ... or a dma-buf, which only the dma-buf
         * filesystem's magic tells apart. */
        if (rule->fs_magic) {
                struct statfs sfs;

                if (fstatfs(fd, &sfs) < 0)
                        goto wrong;
                if ((unsigned long)sfs.f_type != rule->fs_magic) {
                        fd_describe(fd, &stx, what, sizeof(what));
                        return errmsg_set(errmsg, -ERROR_KIND_BAD_FDS,
                                          "%s region: the fd is %s of filesystem magic 0x%lx, not %s",
                                          rule->name, what, (unsigned long)sfs.f_type, rule->is);
                }
        }
        switch (rule->size) {
        case SIZE_NONE:
                return 0;
        case SIZE_STATX:
                actual = stx.stx_size;
                break;
        case SIZE_FDINFO:
                /* Proved a dma-buf by fs_magic just above. */
                r = dmabuf_size(fd, rule, &actual, errmsg);
                if (r < 0)
                        return r;
                break;
        }
        if (actual < size)
                return errmsg_set(errmsg, -ERROR_KIND_INVALID_ARGUMENT,
                                  "%s region of %" PRIu64 " bytes: the fd has only %" PRIu64 " bytes",
                                  rule->name, size, actual);
        return 0;

wrong:
        fd_describe(fd, &stx, what, sizeof(what));
        return errmsg_set(errmsg, -ERROR_KIND_BAD_FDS, "%s region: the fd is %s, not %s", rule->name, what,
                          rule->is);
}
