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
        SIZE_FDINFO, /* the "size:" line of fdinfo */
};

/* What an fd of one region kind must look like. The checks run in the
 * field order below; each one is made only once the ones before proved it
 * cannot block (a FUSE inode fails the type or seals test before anything
 * else looks at it). */
struct region_rule {
        enum region_kind kind;
        const char *name; /* the kind, as clients spell it in errors */
        const char *is;   /* what a matching fd is */
        mode_t type;      /* S_IFMT of the inode; 0 = none (an anonymous inode) */
        int rdev_major;   /* character devices: device number, -1 = any */
        int rdev_minor;
        bool seals;             /* F_GET_SEALS must work: shmem or hugetlbfs only */
        bool memfd_dev;         /* same superblock as the daemon's own memfds */
        const char *fdinfo_key; /* a line of /proc/self/fdinfo/N must start with it; NULL = not read */
        unsigned long fs_magic; /* fstatfs() f_type, 0 = not asked */
        enum size_source size;
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
                .is = "a dma-buf (an anonymous inode with exp_name in its fdinfo)",
                .type = 0,
                .rdev_major = -1,
                .rdev_minor = -1,
                .fdinfo_key = "exp_name:",
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

/* Reads /proc/self/fdinfo/N: generated by the kernel from the open file,
 * with no call into the filesystem that backs it. Returns whether a line
 * starts with `key`; stores the value of a "size:" line in *ret_size (or
 * leaves it). */
static int fdinfo_has(int fd, const char *key, uint64_t *ret_size, bool *ret_has_size) {
        char path[64], buf[2048];
        ssize_t n;
        int pfd, found = 0;

        *ret_has_size = false;
        snprintf(path, sizeof(path), "/proc/self/fdinfo/%d", fd);
        pfd = open(path, O_RDONLY | O_CLOEXEC);
        if (pfd < 0)
                return -errno;
        n = read(pfd, buf, sizeof(buf) - 1);
        close(pfd);
        if (n < 0)
                return -EIO;
        buf[n] = '\0';
        for (char *line = buf; line && *line;) {
                char *nl = strchr(line, '\n');

                if (nl)
                        *nl = '\0';
                if (strncmp(line, key, strlen(key)) == 0)
                        found = 1;
                if (strncmp(line, "size:", 5) == 0) {
                        char *end;
                        unsigned long long v = strtoull(line + 5, &end, 10);

                        if (end != line + 5) {
                                *ret_size = v;
                                *ret_has_size = true;
                        }
                }
                line = nl ? nl + 1 : NULL;
        }
        return found;
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
        bool has_size = false;
        int flags;

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
        if (rule->fdinfo_key) {
                int r = fdinfo_has(fd, rule->fdinfo_key, &actual, &has_size);

                if (r < 0)
                        return errmsg_set(errmsg, -ERROR_KIND_BAD_FDS, "%s region: reading its fdinfo: %s",
                                          rule->name, strerror(-r));
                if (r == 0)
                        goto wrong;
        }
        /* Only the dma-buf filesystem's own inodes print exp_name, so the
         * fstatfs() below reaches dma-buf and nothing a client serves. */
        if (rule->fs_magic) {
                struct statfs sfs;

                if (fstatfs(fd, &sfs) < 0 || (unsigned long)sfs.f_type != rule->fs_magic)
                        goto wrong;
        }
        switch (rule->size) {
        case SIZE_NONE:
                return 0;
        case SIZE_STATX:
                actual = stx.stx_size;
                break;
        case SIZE_FDINFO:
                if (!has_size)
                        return errmsg_set(errmsg, -ERROR_KIND_BAD_FDS,
                                          "%s region: its fdinfo has no size line", rule->name);
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
