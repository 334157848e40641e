/* A FUSE filesystem served by a thread of the test, for
 * tests/security/fdattack.c; see fuse-stub.h. Speaks the kernel's protocol
 * (linux/fuse.h) directly: no libfuse. */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/fuse.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "fuse-stub.h"

static char fuse_dir[PATH_MAX];
static int fuse_fd = -1;
static pthread_t fuse_thread;
static volatile pid_t fuse_flush_pid; /* FLUSH from it is answered, from others never */
static volatile int fuse_stop;        /* the thread closes the device: the connection aborts */
static int fuse_stuck_flushes;
static volatile pid_t fuse_hold_pid; /* FLUSH from its threads is answered fuse_hold_ms late */
static volatile int fuse_hold_ms;
static volatile int fuse_poll_ms; /* POLL is answered this late (0: at once) */
/* Requests held back (FLUSH, POLL), answered at their deadline
 * (CLOCK_MONOTONIC ms). */
static struct {
        uint64_t unique;
        long deadline;
        int poll; /* a POLL: answered with no events ready */
} fuse_held[64];
static int fuse_nheld;

static long fuse_now_ms(void) {
        struct timespec ts;

        clock_gettime(CLOCK_MONOTONIC, &ts);
        return ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* Whether thread `tid` belongs to process `pid`. */
static int fuse_thread_of(pid_t tid, pid_t pid) {
        char path[64];

        snprintf(path, sizeof(path), "/proc/%d/task/%d", (int)pid, (int)tid);
        return access(path, F_OK) == 0;
}

static void fuse_reply(uint64_t unique, int error, const void *out, size_t len) {
        char buf[sizeof(struct fuse_out_header) + 256];
        struct fuse_out_header *oh = (struct fuse_out_header *)buf;

        oh->unique = unique;
        oh->error = error;
        oh->len = (uint32_t)(sizeof(*oh) + len);
        if (len)
                memcpy(buf + sizeof(*oh), out, len);
        (void)!write(fuse_fd, buf, oh->len);
}

static void fuse_attr(uint64_t ino, struct fuse_attr *a) {
        memset(a, 0, sizeof(*a));
        a->ino = ino;
        a->mode = ino == 1 ? S_IFDIR | 0755 : S_IFREG | 0666;
        a->nlink = 1;
        a->size = ino == 1 ? 0 : 4096;
        a->blksize = 4096;
}

static void *fuse_main(void *arg) {
        static char buf[(1 << 17) + 4096];

        for (;;) {
                struct pollfd pfd = { .fd = fuse_fd, .events = POLLIN };
                struct fuse_in_header *h = (struct fuse_in_header *)buf;
                ssize_t n;

                /* Closed here, where no read() holds it, the device's last
                 * reference goes and the kernel fails the pending
                 * requests: the stuck closes return. */
                if (fuse_stop) {
                        close(fuse_fd);
                        fuse_fd = -1;
                        break;
                }
                for (int i = 0; i < fuse_nheld; i++)
                        if (fuse_now_ms() >= fuse_held[i].deadline) {
                                struct fuse_poll_out none = { 0 };

                                fuse_reply(fuse_held[i].unique, 0, &none,
                                           fuse_held[i].poll ? sizeof(none) : 0);
                                fuse_held[i--] = fuse_held[--fuse_nheld];
                        }
                if (poll(&pfd, 1, fuse_nheld ? 10 : 100) <= 0)
                        continue;
                n = read(fuse_fd, buf, sizeof(buf));

                if (n < 0 && (errno == EINTR || errno == EAGAIN || errno == ENOENT))
                        continue;
                if (n < (ssize_t)sizeof(*h))
                        break; /* ENODEV: unmounted or aborted */
                switch (h->opcode) {
                case FUSE_INIT: {
                        struct fuse_init_out o = { .major = FUSE_KERNEL_VERSION,
                                                   .minor = 31,
                                                   .max_readahead = 4096,
                                                   .max_write = 4096,
                                                   .max_background = 16,
                                                   .congestion_threshold = 12,
                                                   .time_gran = 1 };
                        fuse_reply(h->unique, 0, &o, sizeof(o));
                        break;
                }
                case FUSE_LOOKUP: {
                        struct fuse_entry_out e = { .nodeid = 2, .generation = 1 };

                        if (strcmp(buf + sizeof(*h), "f") != 0) {
                                fuse_reply(h->unique, -ENOENT, NULL, 0);
                                break;
                        }
                        fuse_attr(2, &e.attr);
                        fuse_reply(h->unique, 0, &e, sizeof(e));
                        break;
                }
                case FUSE_GETATTR: {
                        struct fuse_attr_out a = { 0 };

                        fuse_attr(h->nodeid, &a.attr);
                        fuse_reply(h->unique, 0, &a, sizeof(a));
                        break;
                }
                case FUSE_OPEN: {
                        struct fuse_open_out o = { .fh = 1 };

                        fuse_reply(h->unique, 0, &o, sizeof(o));
                        break;
                }
                case FUSE_FLUSH:
                        if ((pid_t)h->pid == fuse_flush_pid) {
                                fuse_reply(h->unique, 0, NULL, 0);
                        } else if (fuse_hold_pid && fuse_thread_of((pid_t)h->pid, fuse_hold_pid) &&
                                   fuse_nheld < (int)(sizeof(fuse_held) / sizeof(fuse_held[0]))) {
                                fuse_held[fuse_nheld].unique = h->unique;
                                fuse_held[fuse_nheld].poll = 0;
                                fuse_held[fuse_nheld++].deadline = fuse_now_ms() + fuse_hold_ms;
                                __atomic_add_fetch(&fuse_stuck_flushes, 1, __ATOMIC_SEQ_CST);
                        } else if (fuse_hold_pid) {
                                fuse_reply(h->unique, 0, NULL, 0);
                        } else {
                                __atomic_add_fetch(&fuse_stuck_flushes, 1, __ATOMIC_SEQ_CST);
                        }
                        break;
                case FUSE_POLL:
                        /* Held: answered later with no events (ENOSYS would
                         * make the kernel never ask again). */
                        if (fuse_poll_ms && fuse_nheld < (int)(sizeof(fuse_held) / sizeof(fuse_held[0]))) {
                                fuse_held[fuse_nheld].unique = h->unique;
                                fuse_held[fuse_nheld].poll = 1;
                                fuse_held[fuse_nheld++].deadline = fuse_now_ms() + fuse_poll_ms;
                        } else {
                                fuse_reply(h->unique, -ENOSYS, NULL, 0);
                        }
                        break;
                case FUSE_FORGET:
                case FUSE_BATCH_FORGET:
                case FUSE_INTERRUPT:
                        break;
                case FUSE_RELEASE:
                case FUSE_DESTROY:
                        fuse_reply(h->unique, 0, NULL, 0);
                        break;
                default:
                        fuse_reply(h->unique, -ENOSYS, NULL, 0);
                        break;
                }
        }
        return NULL;
}

int fuse_stub_start(const char *dir) {
        char opts[128];

        if (fuse_fd >= 0)
                return -EBUSY;
        snprintf(fuse_dir, sizeof(fuse_dir), "%s", dir);
        if (mkdir(fuse_dir, 0755) < 0)
                return -errno;
        /* Children fork from the test: fuse_stub_device() lets them close
         * it, so that the server's close is the last. */
        fuse_fd = open("/dev/fuse", O_RDWR | O_CLOEXEC);
        if (fuse_fd < 0) {
                int r = -errno;

                rmdir(fuse_dir);
                return r;
        }
        snprintf(opts, sizeof(opts), "fd=%d,rootmode=40000,user_id=0,group_id=0,allow_other", fuse_fd);
        if (mount("moeep-fuse-stub", fuse_dir, "fuse", MS_NOSUID | MS_NODEV, opts) < 0) {
                int r = -errno;

                close(fuse_fd);
                fuse_fd = -1;
                rmdir(fuse_dir);
                return r;
        }
        fuse_stop = 0;
        fuse_nheld = 0;
        if (pthread_create(&fuse_thread, NULL, fuse_main, NULL) != 0) {
                umount2(fuse_dir, MNT_DETACH);
                close(fuse_fd);
                fuse_fd = -1;
                return -EAGAIN;
        }
        return 0;
}

void fuse_stub_answer_flush_from(pid_t pid) {
        fuse_flush_pid = pid;
}

void fuse_stub_hold_flushes(pid_t holder, int ms) {
        fuse_hold_ms = ms;
        fuse_hold_pid = holder;
}

void fuse_stub_hold_polls(int ms) {
        fuse_poll_ms = ms;
}

int fuse_stub_device(void) {
        return fuse_fd;
}

int fuse_stub_stuck_flushes(void) {
        return __atomic_load_n(&fuse_stuck_flushes, __ATOMIC_SEQ_CST);
}

void fuse_stub_stop(void) {
        if (fuse_fd < 0)
                return;
        umount2(fuse_dir, MNT_DETACH);
        fuse_stop = 1;
        pthread_join(fuse_thread, NULL);
        /* The thread ends without closing it when the unmount came first
         * (ENODEV): closed here, so that the stub can start again. */
        if (fuse_fd >= 0) {
                close(fuse_fd);
                fuse_fd = -1;
        }
        fuse_hold_pid = 0;
        fuse_poll_ms = 0;
        rmdir(fuse_dir);
}
