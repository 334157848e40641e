/* Descriptors that clients send; see clientfd.h. */
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

#include "clientfd.h"
#include "config.h"
#include "log.h"
#include "record.h"

/* Closer threads, started as work arrives. Each serves one uid at a time,
 * so this many uids with a stuck close stall closing for everyone; a
 * single uid never holds more than one. */
#define CF_WORKERS_MAX 8
/* Descriptors kept out of the clients' reach: the listening sockets, the
 * operator's sessions, mesh and metrics connections, job control pages and
 * the libraries' own. At least this many, or an eighth of the limit. */
#define CF_RESERVE_MIN 64
/* The queue of closes that cannot block (memfds, the NVIDIA device), apart
 * from every uid's own: behind a uid's stuck close they would stay open. */
#define CF_QUICK_UID ((uid_t)-2)
/* A uid whose close has been in progress this long is stuck: once its
 * pending closes also reach max_fds_per_uid, it gets nothing more read.
 * Legitimate bursts of closes (a job's ranks leaving) finish in
 * microseconds. */
#define CF_STUCK_MS 200
/* Records read from a closing session's socket before closing it; a
 * peer's send buffer holds a few hundred. */
#define CF_DRAIN_MAX 1024
/* A close that takes longer than this is logged once it returns. */
#define CF_SLOW_CLOSE_MS 1000

/* What the kernel reports for the descriptors CUDA hands out, measured
 * with CUDA driver 580 on Linux 6.18 (notes of issue 15):
 *
 *   cuMemExportToShareableHandle(POSIX_FILE_DESCRIPTOR): a character
 *     device, rdev 195:255 (major 195 is the NVIDIA driver's fixed major,
 *     minor 255 its control device /dev/nvidiactl); no seals, fdinfo has
 *     only the generic lines. The kernel cannot tell it from a plain open
 *     of /dev/nvidiactl: the driver checks the allocation when a peer
 *     imports it.
 *   cuMemGetHandleForAddressRange(DMA_BUF_FD): an anonymous inode (no
 *     S_IFMT bits, mode 0600) on the dma-buf filesystem (f_type
 *     DMA_BUF_MAGIC); fdinfo has "size:", "count:" and "exp_name:
 *     nv_dmabuf". readlink gives "/dmabuf:NAME", which a client can spell
 *     as a path of its own, so it is never trusted. */
#define NVIDIA_MAJOR 195
#define NVIDIA_CTL_MINOR 255
#define DMA_BUF_MAGIC 0x444d4142

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
        Moeep__V1__RegionKind kind;
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
                .kind = MOEEP__V1__REGION_KIND__REGION_KIND_MEMFD,
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
                .kind = MOEEP__V1__REGION_KIND__REGION_KIND_CUMEM_FD,
                .name = "cumem-fd",
                .is = "a cuMem POSIX fd (character device 195:255, /dev/nvidiactl)",
                .type = S_IFCHR,
                .rdev_major = NVIDIA_MAJOR,
                .rdev_minor = NVIDIA_CTL_MINOR,
                .size = SIZE_NONE,
        },
        {
                .kind = MOEEP__V1__REGION_KIND__REGION_KIND_DMABUF,
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

/* One fd waiting for a closer. */
struct cf_job {
        int fd;
        enum cf_cost {
                CF_QUICK,   /* cannot block: in the quick queue, charged to nobody */
                CF_CHARGED, /* its uid's fd charge stays until close() returns */
                CF_SOCKET,  /* a session socket: counts as closing for its uid */
        } cost;
        TAILQ_ENTRY(cf_job) entry;
};
TAILQ_HEAD(cf_job_list, cf_job);

/* What one uid is charged, and its closing queue. */
struct cf_uid {
        uid_t uid;
        uint32_t held;    /* loop thread only: every fd charged, pending closes included */
        uint32_t closing; /* loop thread only: closes of its queue not yet returned */
        /* Under clientfds.lock: */
        struct cf_job_list queue; /* owns; fds waiting to be closed */
        uint32_t done;            /* closes finished that the loop has not counted */
        uint32_t done_charged;    /* how many of them were CF_CHARGED */
        uint32_t slow_ms;         /* the longest of them, when over CF_SLOW_CLOSE_MS */
        bool busy;                /* a closer is in close() for this uid */
        long busy_since;          /* since when (CLOCK_MONOTONIC ms) */
        bool ready;               /* in clientfds.ready */
        TAILQ_ENTRY(cf_uid) ready_entry;
        LIST_ENTRY(cf_uid) entry;
};

struct clientfds {
        const struct config *config; /* not owning */
        struct event_base *base;     /* not owning; NULL = close at once */
        int efd;                     /* owns; closers tell the loop that closes finished */
        struct event *ev_done;       /* owns */
        uint32_t total;              /* loop only: all uids' charges */
        uint32_t limit;              /* RLIMIT_NOFILE at start */
        uint32_t budget;             /* what all uids together may be charged */
        dev_t memfd_dev;             /* st_dev of a memfd of ours; 0 = unknown */
        bool memfd_dev_known;
        pthread_mutex_t lock;
        pthread_cond_t wake;        /* closers wait here for work */
        pthread_cond_t settled;     /* the loop waits here in clientfds_settle() */
        LIST_HEAD(, cf_uid) uids;   /* owns; entries added and removed by the loop, under lock */
        TAILQ_HEAD(, cf_uid) ready; /* uids with queued fds and no closer */
        uint32_t pending;           /* fds queued or in close() */
        unsigned nworkers, nidle;
        bool stopping;
        pthread_t workers[CF_WORKERS_MAX];
};

const char *clientfd_kind_to_string(Moeep__V1__RegionKind kind) {
        switch (kind) {
        case MOEEP__V1__REGION_KIND__REGION_KIND_UNSPECIFIED:
                return "unspecified";
        case MOEEP__V1__REGION_KIND__REGION_KIND_CUMEM_FD:
                return "cumem-fd";
        case MOEEP__V1__REGION_KIND__REGION_KIND_DMABUF:
                return "dma-buf";
        case MOEEP__V1__REGION_KIND__REGION_KIND_MEMFD:
                return "memfd";
        case _MOEEP__V1__REGION_KIND_IS_INT_SIZE:
                break;
        }
        return "unknown";
}

/* ------------------------------------------------------------ accounting */

static long now_ms(void) {
        struct timespec ts;

        clock_gettime(CLOCK_MONOTONIC, &ts);
        return ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static struct cf_uid *uid_find(const struct clientfds *cf, uid_t uid) {
        struct cf_uid *u;

        LIST_FOREACH (u, &cf->uids, entry)
                if (u->uid == uid)
                        return u;
        return NULL;
}

static struct cf_uid *uid_get(struct clientfds *cf, uid_t uid) {
        struct cf_uid *u = uid_find(cf, uid);

        if (u)
                return u;
        u = calloc(1, sizeof(*u));
        if (!u)
                return NULL;
        u->uid = uid;
        TAILQ_INIT(&u->queue);
        pthread_mutex_lock(&cf->lock);
        LIST_INSERT_HEAD(&cf->uids, u, entry);
        pthread_mutex_unlock(&cf->lock);
        return u;
}

/* Frees `u` once it owes nothing and no closer can reach it. Call with the
 * lock held. */
static void uid_maybe_free_locked(struct cf_uid *u) {
        if (u->held || u->closing || u->done || u->done_charged || u->busy || u->ready ||
            !TAILQ_EMPTY(&u->queue))
                return;
        LIST_REMOVE(u, entry);
        free(u);
}

int clientfds_charge(struct clientfds *cf, uid_t uid, uint32_t n, char *errmsg) {
        const struct cf_uid *u = uid_find(cf, uid);
        uint32_t held = u ? u->held : 0;
        uint32_t cap = cf->config->max_fds_per_uid;
        int r;

        if (held + (uint64_t)n > cap)
                return errmsg_set(errmsg, -EDQUOT,
                                  "uid %u holds %" PRIu32 " descriptors in the daemon (sessions, regions, "
                                  "unsent replies, closes pending); %" PRIu32
                                  " more would pass max_fds_per_uid = %" PRIu32,
                                  (unsigned)uid, held, n, cap);
        r = clientfds_budget_check(cf, n, errmsg);
        if (r < 0)
                return r;
        clientfds_charge_held(cf, uid, n);
        return 0;
}

void clientfds_charge_held(struct clientfds *cf, uid_t uid, uint32_t n) {
        struct cf_uid *u;

        if (n == 0)
                return;
        cf->total += n;
        u = uid_get(cf, uid);
        if (u)
                u->held += n;
        else /* counted in the total only; clientfds_uncharge() copes */
                log_warn("uid %u: out of memory charging %" PRIu32 " descriptors", (unsigned)uid, n);
}

void clientfds_uncharge(struct clientfds *cf, uid_t uid, uint32_t n) {
        struct cf_uid *u = uid_find(cf, uid);

        if (n == 0)
                return;
        cf->total -= n < cf->total ? n : cf->total;
        if (!u)
                return;
        if (u->held < n) {
                log_err("uid %u: returning %" PRIu32 " descriptors but %" PRIu32 " are charged",
                        (unsigned)uid, n, u->held);
                n = u->held;
        }
        u->held -= n;
        pthread_mutex_lock(&cf->lock);
        uid_maybe_free_locked(u);
        pthread_mutex_unlock(&cf->lock);
}

uint32_t clientfds_held(const struct clientfds *cf, uid_t uid) {
        const struct cf_uid *u = uid_find(cf, uid);

        return u ? u->held : 0;
}

int clientfds_closing_check(struct clientfds *cf, uid_t uid, char *errmsg) {
        const struct cf_uid *u = uid_find(cf, uid);
        bool stuck;

        if (!u || u->closing < cf->config->max_fds_per_uid)
                return 0;
        pthread_mutex_lock(&cf->lock);
        stuck = u->busy && now_ms() - u->busy_since > CF_STUCK_MS;
        pthread_mutex_unlock(&cf->lock);
        if (stuck)
                return errmsg_set(errmsg, -EDQUOT,
                                  "uid %u has %" PRIu32 " descriptors it sent still being closed "
                                  "(max_fds_per_uid = %" PRIu32 "): nothing more is taken from it",
                                  (unsigned)uid, u->closing, cf->config->max_fds_per_uid);
        return 0;
}

/* ------------------------------------------------------------ closing */

/* A closer: takes one fd of the uid first in line, closes it, and puts the
 * uid back in line when it has more. Never logs (logging is the loop's). */
static void *closer_main(void *arg) {
        struct clientfds *cf = arg;
        uint64_t one = 1;

        pthread_mutex_lock(&cf->lock);
        while (!cf->stopping) {
                struct cf_uid *u = TAILQ_FIRST(&cf->ready);
                struct cf_job *job;
                enum cf_cost job_cost;
                long t0, took;

                if (!u) {
                        cf->nidle++;
                        pthread_cond_wait(&cf->wake, &cf->lock);
                        cf->nidle--;
                        continue;
                }
                TAILQ_REMOVE(&cf->ready, u, ready_entry);
                u->ready = false;
                job = TAILQ_FIRST(&u->queue);
                TAILQ_REMOVE(&u->queue, job, entry);
                u->busy = true;
                u->busy_since = now_ms();
                pthread_mutex_unlock(&cf->lock);

                t0 = now_ms();
                close(job->fd); /* may block for as long as the sender arranged */
                took = now_ms() - t0;
                job_cost = job->cost;
                free(job);

                pthread_mutex_lock(&cf->lock);
                u->busy = false;
                u->done += job_cost != CF_QUICK;
                u->done_charged += job_cost == CF_CHARGED;
                if (took > CF_SLOW_CLOSE_MS && (uint32_t)took > u->slow_ms)
                        u->slow_ms = (uint32_t)took;
                cf->pending--;
                if (!TAILQ_EMPTY(&u->queue)) {
                        TAILQ_INSERT_TAIL(&cf->ready, u, ready_entry);
                        u->ready = true;
                }
                pthread_cond_broadcast(&cf->settled);
                (void)!write(cf->efd, &one, sizeof(one));
        }
        pthread_mutex_unlock(&cf->lock);
        return NULL;
}

/* Starts one more closer. Call with the lock held. */
static void closer_spawn_locked(struct clientfds *cf) {
        sigset_t all, old;

        if (cf->nworkers >= CF_WORKERS_MAX)
                return;
        /* Signals are the loop's business (libevent's handlers). */
        sigfillset(&all);
        pthread_sigmask(SIG_BLOCK, &all, &old);
        if (pthread_create(&cf->workers[cf->nworkers], NULL, closer_main, cf) == 0)
                cf->nworkers++;
        pthread_sigmask(SIG_SETMASK, &old, NULL);
}

/* Returns the charges of finished closes (the loop, on the eventfd). */
static void clientfds_collect(struct clientfds *cf) {
        struct cf_uid *u, *next;
        uint64_t n;

        (void)!read(cf->efd, &n, sizeof(n));
        pthread_mutex_lock(&cf->lock);
        for (u = LIST_FIRST(&cf->uids); u; u = next) {
                next = LIST_NEXT(u, entry);
                if (!u->done) {
                        uid_maybe_free_locked(u);
                        continue;
                }
                if (u->slow_ms)
                        log_notice("uid %u: closing a descriptor it sent took %" PRIu32 " ms",
                                   (unsigned)u->uid, u->slow_ms);
                cf->total -= u->done_charged < cf->total ? u->done_charged : cf->total;
                u->held -= u->done_charged < u->held ? u->done_charged : u->held;
                u->closing -= u->done < u->closing ? u->done : u->closing;
                u->done = 0;
                u->done_charged = 0;
                u->slow_ms = 0;
                uid_maybe_free_locked(u);
        }
        pthread_mutex_unlock(&cf->lock);
}

static void clientfds_done_cb(evutil_socket_t fd, short what, void *arg) {
        clientfds_collect(arg);
}

/* Whether closing `fd` cannot block, by facts that never block to learn:
 * shmem files (F_GET_SEALS works on nothing else) have no flush and free
 * pages only; the NVIDIA driver's release does not wait for a client. */
static bool close_is_quick(int fd) {
        struct statx stx;

        if (fcntl(fd, F_GET_SEALS) >= 0)
                return true;
        return statx(fd, "", AT_EMPTY_PATH | AT_STATX_DONT_SYNC, STATX_TYPE, &stx) == 0 &&
               S_ISCHR(stx.stx_mode) && stx.stx_rdev_major == NVIDIA_MAJOR;
}

static void close_queue(struct clientfds *cf, uid_t uid, int fd, enum cf_cost cost) {
        struct cf_job *job;
        struct cf_uid *u;

        u = uid_get(cf, cost == CF_QUICK ? CF_QUICK_UID : uid);
        job = malloc(sizeof(*job));
        if (!u || !job) {
                /* Closing here could block the loop: keep the fd (and its
                 * charge) rather. */
                log_err("uid %u: out of memory queueing fd %d for closing: it stays open", (unsigned)uid, fd);
                free(job);
                return;
        }
        job->fd = fd;
        job->cost = cost;
        u->closing += cost != CF_QUICK;
        pthread_mutex_lock(&cf->lock);
        TAILQ_INSERT_TAIL(&u->queue, job, entry);
        cf->pending++;
        if (!u->busy && !u->ready) {
                TAILQ_INSERT_TAIL(&cf->ready, u, ready_entry);
                u->ready = true;
        }
        if (cf->nidle == 0)
                closer_spawn_locked(cf);
        pthread_cond_signal(&cf->wake);
        pthread_mutex_unlock(&cf->lock);
}

void clientfd_close(struct clientfds *cf, uid_t uid, int fd) {
        bool quick;

        if (fd < 0)
                return;
        if (!cf->base) {
                close(fd);
                clientfds_uncharge(cf, uid, 1);
                return;
        }
        /* A close that cannot block is off the loop all the same, but its
         * charge is returned now: a client that releases a region and
         * registers another at once is not refused for a close in flight. */
        quick = close_is_quick(fd);
        if (quick)
                clientfds_uncharge(cf, uid, 1);
        close_queue(cf, uid, fd, quick ? CF_QUICK : CF_CHARGED);
}

void clientfd_close_socket(struct clientfds *cf, uid_t uid, int fd) {
        if (fd < 0)
                return;
        if (!cf->base) {
                close(fd);
                return;
        }
        close_queue(cf, uid, fd, CF_SOCKET);
}

int clientfds_budget_check(const struct clientfds *cf, uint32_t n, char *errmsg) {
        if (cf->total + (uint64_t)n > cf->budget)
                return errmsg_set(errmsg, -EMFILE,
                                  "the daemon holds %" PRIu32 " descriptors for clients and keeps %" PRIu32
                                  " of its RLIMIT_NOFILE %" PRIu32 " in reserve",
                                  cf->total + n, cf->limit - cf->budget, cf->limit);
        return 0;
}

/* Closing a session's socket closes whatever the peer queued on it unread,
 * the fds it attached included, in the closing thread: a socket with SO_LINGER or a FUSE file
 * among them blocks there. So the socket is shut first (the peer's sends
 * fail from now on), records still queued are read here, a bounded number,
 * each fd found going to the closers charged to `uid`, and the socket
 * itself closes in `uid`'s own closing queue: what is left in it (records
 * past the bound, or behind a zero-length one, which reads like the end)
 * can stall only that uid. */
void clientfd_close_session(struct clientfds *cf, uid_t uid, int fd) {
        union {
                char buf[CMSG_SPACE(sizeof(int) * MOEEP_RECORD_RECV_FDS)];
                struct cmsghdr align;
        } control;
        char byte;

        if (fd < 0)
                return;
        (void)shutdown(fd, SHUT_RDWR);
        for (int i = 0; i < CF_DRAIN_MAX && clientfds_closing_check(cf, uid, NULL) == 0; i++) {
                struct iovec iov = { .iov_base = &byte, .iov_len = 1 };
                struct msghdr mh = { .msg_iov = &iov,
                                     .msg_iovlen = 1,
                                     .msg_control = control.buf,
                                     .msg_controllen = sizeof(control.buf) };
                ssize_t n = recvmsg(fd, &mh, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);

                if (n < 0)
                        break;
                for (struct cmsghdr *c = CMSG_FIRSTHDR(&mh); c; c = CMSG_NXTHDR(&mh, c)) {
                        size_t nfds = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);

                        if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS)
                                continue;
                        for (size_t k = 0; k < nfds; k++) {
                                int got;

                                memcpy(&got, CMSG_DATA(c) + k * sizeof(int), sizeof(got));
                                clientfds_charge_held(cf, uid, 1);
                                clientfd_close(cf, uid, got);
                        }
                }
                /* The end, or a record of zero bytes without fds: they
                 * read alike, so stop. */
                if (n == 0 && mh.msg_controllen == 0)
                        break;
        }
        clientfd_close_socket(cf, uid, fd);
}

int clientfds_settle(struct clientfds *cf, int timeout_ms) {
        struct timespec until;
        int r = 0;

        if (!cf || !cf->base)
                return 0;
        clock_gettime(CLOCK_REALTIME, &until);
        until.tv_sec += timeout_ms / 1000;
        until.tv_nsec += (long)(timeout_ms % 1000) * 1000000;
        if (until.tv_nsec >= 1000000000) {
                until.tv_sec++;
                until.tv_nsec -= 1000000000;
        }
        pthread_mutex_lock(&cf->lock);
        while (cf->pending > 0 && r == 0)
                r = pthread_cond_timedwait(&cf->settled, &cf->lock, &until);
        r = cf->pending > 0 ? -ETIMEDOUT : 0;
        pthread_mutex_unlock(&cf->lock);
        clientfds_collect(cf);
        return r;
}

/* ------------------------------------------------------------ lifetime */

int clientfds_new(struct event_base *base, const struct config *config, struct clientfds **ret_clientfds) {
        struct clientfds *cf = calloc(1, sizeof(*cf));
        struct rlimit rl;
        struct stat st;
        uint32_t reserve;
        int probe;

        if (!cf)
                return -ENOMEM;
        cf->config = config;
        cf->base = base;
        cf->efd = -1;
        LIST_INIT(&cf->uids);
        TAILQ_INIT(&cf->ready);
        pthread_mutex_init(&cf->lock, NULL);
        pthread_cond_init(&cf->wake, NULL);
        pthread_cond_init(&cf->settled, NULL);

        if (getrlimit(RLIMIT_NOFILE, &rl) < 0 || rl.rlim_cur == RLIM_INFINITY || rl.rlim_cur > (1u << 30))
                rl.rlim_cur = 1u << 30;
        cf->limit = (uint32_t)rl.rlim_cur;
        reserve = cf->limit / 8 > CF_RESERVE_MIN ? cf->limit / 8 : CF_RESERVE_MIN;
        cf->budget = cf->limit > 2 * reserve ? cf->limit - reserve : cf->limit / 2;

        /* Where memfds live: one internal shmem mount for all of them. A
         * tmpfs file (/dev/shm, a client's own tmpfs) has seals too but
         * another st_dev. */
        probe = memfd_create("moeepd-probe", MFD_CLOEXEC);
        if (probe >= 0 && fstat(probe, &st) == 0) {
                cf->memfd_dev = st.st_dev;
                cf->memfd_dev_known = true;
        }
        if (probe >= 0)
                close(probe);

        if (base) {
                cf->efd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
                if (cf->efd < 0)
                        goto fail;
                cf->ev_done = event_new(base, cf->efd, EV_READ | EV_PERSIST, clientfds_done_cb, cf);
                if (!cf->ev_done || event_add(cf->ev_done, NULL) < 0)
                        goto fail;
        }
        log_info("client descriptors: RLIMIT_NOFILE %" PRIu32 ", %" PRIu32 " for clients, %" PRIu32
                 " in reserve",
                 cf->limit, cf->budget, cf->limit - cf->budget);
        *ret_clientfds = cf;
        return 0;

fail:
        clientfds_free(cf, 0);
        return -ENOMEM;
}

void clientfds_free(struct clientfds *cf, int timeout_ms) {
        struct cf_uid *u;
        bool stuck = false;

        if (!cf)
                return;
        if (clientfds_settle(cf, timeout_ms) < 0)
                log_warn("%" PRIu32 " client descriptors are still being closed: leaving them to the exit",
                         cf->pending);
        pthread_mutex_lock(&cf->lock);
        cf->stopping = true;
        pthread_cond_broadcast(&cf->wake);
        LIST_FOREACH (u, &cf->uids, entry)
                stuck = stuck || u->busy;
        pthread_mutex_unlock(&cf->lock);
        if (stuck) {
                /* A closer is still in close(): it would touch `cf` when it
                 * returns, so nothing is freed. */
                for (unsigned i = 0; i < cf->nworkers; i++)
                        pthread_detach(cf->workers[i]);
                return;
        }
        for (unsigned i = 0; i < cf->nworkers; i++)
                pthread_join(cf->workers[i], NULL);
        /* Queued fds no closer took: the process's exit closes them. */
        while ((u = LIST_FIRST(&cf->uids))) {
                struct cf_job *job;

                while ((job = TAILQ_FIRST(&u->queue))) {
                        TAILQ_REMOVE(&u->queue, job, entry);
                        free(job);
                }
                LIST_REMOVE(u, entry);
                free(u);
        }
        if (cf->ev_done)
                event_free(cf->ev_done);
        if (cf->efd >= 0)
                close(cf->efd);
        pthread_cond_destroy(&cf->settled);
        pthread_cond_destroy(&cf->wake);
        pthread_mutex_destroy(&cf->lock);
        free(cf);
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

static const struct region_rule *rule_find(Moeep__V1__RegionKind kind) {
        for (size_t i = 0; i < sizeof(region_rules) / sizeof(region_rules[0]); i++)
                if (region_rules[i].kind == kind)
                        return &region_rules[i];
        return NULL;
}

int clientfd_check(const struct clientfds *cf, int fd, Moeep__V1__RegionKind kind, uint64_t size,
                   char *errmsg) {
        const struct region_rule *rule = rule_find(kind);
        char what[160];
        struct statx stx;
        uint64_t actual = 0;
        bool has_size = false;
        int flags;

        if (!rule)
                return errmsg_set(errmsg, -EINVAL, "region kind %d is not known", (int)kind);
        /* fcntl(F_GETFL) reads the open file's flags, never its
         * filesystem. An O_PATH fd names a file without opening it, which
         * is how a FUSE inode would get past the type checks below. */
        flags = fcntl(fd, F_GETFL);
        if (flags < 0)
                return errmsg_set(errmsg, -EBADF, "%s region: fd: %s", rule->name, strerror(errno));
        if (flags & O_PATH)
                return errmsg_set(errmsg, -EBADF, "%s region: the fd is an O_PATH descriptor, not %s",
                                  rule->name, rule->is);
        /* AT_STATX_DONT_SYNC: the attributes the kernel has, never a
         * round trip to a FUSE server or a network filesystem. */
        if (statx(fd, "", AT_EMPTY_PATH | AT_STATX_DONT_SYNC, STATX_TYPE | STATX_MODE | STATX_SIZE, &stx) < 0)
                return errmsg_set(errmsg, -EBADF, "%s region: statx of the fd: %s", rule->name,
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
                return errmsg_set(errmsg, -EBADF,
                                  "%s region: the fd is %s on a tmpfs or hugetlbfs mount, not %s", rule->name,
                                  what, rule->is);
        }
        if (rule->fdinfo_key) {
                int r = fdinfo_has(fd, rule->fdinfo_key, &actual, &has_size);

                if (r < 0)
                        return errmsg_set(errmsg, -EBADF, "%s region: reading its fdinfo: %s", rule->name,
                                          strerror(-r));
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
                        return errmsg_set(errmsg, -EBADF, "%s region: its fdinfo has no size line",
                                          rule->name);
                break;
        }
        if (actual < size)
                return errmsg_set(errmsg, -EINVAL,
                                  "%s region of %" PRIu64 " bytes: the fd has only %" PRIu64 " bytes",
                                  rule->name, size, actual);
        return 0;

wrong:
        fd_describe(fd, &stx, what, sizeof(what));
        return errmsg_set(errmsg, -EBADF, "%s region: the fd is %s, not %s", rule->name, what, rule->is);
}
