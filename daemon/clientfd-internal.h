/* What clientfd.c (accounting, the closer threads) and clientfd-check.c
 * (the kind checks: region_rules, clientfd_check) share. Not for any other
 * file: the rest of the daemon uses clientfd.h. */
#ifndef MOEEPD_CLIENTFD_INTERNAL_H
#define MOEEPD_CLIENTFD_INTERNAL_H

#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <sys/queue.h>
#include <sys/types.h>

#include "clientfd.h"
#include "log.h" /* ERRMSG_MAX */

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

/* A descriptor taken from a client's process with pidfd_getfd()
 * (clientfd-take.c). Made on the loop, run by a closer in its uid's queue
 * (the take can wait on a lock the client holds, see clientfd_take()),
 * handed back to the loop through clientfds.takes_done. */
struct cf_take {
        int pidfd;  /* owns until the closer closes it */
        int number; /* the descriptor number in the client's process */
        pid_t pid;  /* SO_PEERCRED's, for messages */
        uid_t uid;  /* SO_PEERCRED's: the process must still have these ids */
        gid_t gid;
        int fd;    /* the result: owns, charged to `uid`; -1 on error */
        int error; /* 0 or -errno (-ERROR_KIND_* for a permission refusal) */
        char errmsg[ERRMSG_MAX];
        clientfd_take_fn *done; /* called on the loop, exactly once */
        void *ctx;              /* not owning */
        TAILQ_ENTRY(cf_take) entry;
};
TAILQ_HEAD(cf_take_list, cf_take);

/* One fd waiting for a closer, or a take. */
struct cf_job {
        int fd;
        enum cf_cost {
                CF_QUICK,   /* cannot block: in the quick queue, charged to nobody */
                CF_CHARGED, /* its uid's fd charge stays until close() returns */
                CF_SOCKET,  /* a session socket: counts as closing for its uid */
                CF_TAKE,    /* a take (`take`), not a close; `fd` unused */
        } cost;
        struct cf_take *take; /* owns until the closer puts it on takes_done; CF_TAKE only */
        TAILQ_ENTRY(cf_job) entry;
};
TAILQ_HEAD(cf_job_list, cf_job);

/* clientfd-take.c, on a closer thread: does `t` (pidfd_getfd and the
 * checks of the process), filling t->fd or t->error and t->errmsg, and
 * closes t->pidfd. Never logs. */
void clientfd_take_run(struct cf_take *t);

/* clientfd.c, on the loop: queues `t` in its uid's closer queue. Returns
 * 0 or -ENOMEM. */
int clientfd_queue_take(struct clientfds *cf, struct cf_take *t);

/* clientfd-take.c, on the loop: calls t->done and frees `t`. */
void clientfd_take_finish(struct clientfds *cf, struct cf_take *t);

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
        pthread_cond_t wake;            /* closers wait here for work */
        pthread_cond_t settled;         /* the loop waits here in clientfds_settle() */
        LIST_HEAD(, cf_uid) uids;       /* owns; entries added and removed by the loop, under lock */
        TAILQ_HEAD(, cf_uid) ready;     /* uids with queued fds and no closer */
        struct cf_take_list takes_done; /* owns; takes the loop has yet to hand back */
        uint32_t pending;               /* fds queued or in close(), takes queued or running */
        unsigned nworkers, nidle;
        bool stopping;
        bool takes_dropped; /* loop only: clientfds_free() began; finished takes are dropped */
        pthread_t workers[CF_WORKERS_MAX];
};

#endif
