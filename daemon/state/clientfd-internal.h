/* What clientfd.c (accounting, the closer threads) and clientfd-check.c
 * (the kind checks: region_rules, clientfd_check) share. Not for any other
 * file of the daemon, which uses clientfd.h (tests/unit/test-clientfd.c
 * reaches clientfd_fdinfo_size() here). */
#ifndef MOEEPD_CLIENTFD_INTERNAL_H
#define MOEEPD_CLIENTFD_INTERNAL_H

#include <pthread.h>
#include <signal.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/queue.h>
#include <sys/types.h>

#include "log.h" /* ERRMSG_MAX */
#include "record.h"
#include "state/clientfd.h"

/* Threads, in two pools; each starts a thread whenever work waits and
 * none of its threads is idle, and idle ones beyond CF_WORKERS_KEEP end
 * after CF_IDLE_EXIT_MS:
 *   - closers serve every uid's fds and sockets lanes: closes and takes,
 *     which a client can make wait for as long as it likes (a FUSE server
 *     that does not answer FLUSH, an execve() it keeps in progress). A uid
 *     whose close never returns holds one closer and nobody else waits
 *     for it, whatever their number or uid. Past CF_CLOSERS_MAX (every one
 *     of them stuck in a close of a uid of its own) closes wait for one to
 *     come back: at the daemon's fd budget each stuck uid holds at least
 *     one charged fd, so below an RLIMIT_NOFILE of about 4,600 that cannot
 *     happen.
 *   - checkers serve every uid's checks lane: the kind checks of attached
 *     fds (clientfd_check()) and the runs (clientfd_run(): a transport
 *     registering a region's memory), none of which waits for anything a
 *     client controls. A pool of their own, so that closes that never
 *     return cannot hold up a registration, nor a burst of registrations
 *     the closes. Past CF_CHECKERS_MAX uids with work at once, a uid's work
 *     waits for the first checker to finish a job (a check takes
 *     microseconds, a run as long as its pinning: a few GiB, a second);
 *     lanes take turns, one job at a time. A uid has at most
 *     CF_CHECKS_QUEUED_MAX checks and runs waiting; more are refused. */
#define CF_WORKERS_KEEP 2
#define CF_IDLE_EXIT_MS 1000
#define CF_CLOSERS_MAX 4096
#define CF_CHECKERS_MAX 256
#define CF_CHECKS_QUEUED_MAX 256
/* A closer needs little stack: close(), pidfd_getfd(), a few stats. A
 * checker runs a transport's registration (libibverbs, a libfabric
 * provider, the CUDA driver), whose needs the daemon does not know: it
 * gets the default stack. */
#define CF_STACK_BYTES (256u << 10)
/* Each close, take, check or discard runs under a timer that signals its
 * thread after this long (CF_SIGNAL, a handler that does nothing): a wait
 * the kernel lets a signal end (a socket lingering with SO_LINGER, also
 * one in flight in a socket being closed) ends there, and the close
 * returns. What no signal ends (FUSE's FLUSH) keeps its thread. A run gets
 * no timer: a registration interrupted would fail. */
#define CF_INTERRUPT_MS 20
#define CF_SIGNAL (SIGRTMIN + 5)
/* A memfd with at most this many bytes of pages closes on the loop: it
 * cannot block, and freeing that much takes microseconds. */
#define CF_INLINE_BYTES (1u << 20)
/* A uid whose close has been in progress this long is stuck: once it also
 * holds more than max_fds_per_uid, it gets no new session. Legitimate
 * bursts of closes (a job's ranks leaving) finish in microseconds. */
#define CF_STUCK_MS 200
/* Records without fds read and dropped from a session socket before it
 * is closed, so that its peer reads the Error it was sent rather than a
 * reset. */
#define CF_DRAIN_MAX 64
/* A close that takes longer than this is logged at notice once it
 * returns (at info past CF_INTERRUPT_MS, at most once per
 * CF_LOG_INTERVAL_MS and uid). */
#define CF_SLOW_CLOSE_MS 1000
#define CF_LOG_INTERVAL_MS 10000

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

/* The size of a dma-buf from the `len` bytes of its fdinfo at `text`: the
 * first line that starts with "size:", which must read "size:\t" and a
 * decimal u64 and come before any line dma_buf_show_fdinfo() prints after
 * it ("count:", "exp_name:", "name:"). A later "size:" is not the
 * kernel's: the buffer's name (DMA_BUF_SET_NAME, the client's text,
 * newlines allowed) is printed last. Returns 0 with *ret_size, or -EINVAL
 * with *ret_why saying what is wrong (no size line, a malformed one, one
 * cut short). */
int clientfd_fdinfo_size(const char *text, size_t len, uint64_t *ret_size, const char **ret_why);

/* Work on a client's descriptor that may block or take long, done by a
 * thread in its uid's queue and handed back to the loop through
 * clientfds.takes_done: a take (clientfd_take(): pidfd_getfd() can wait on
 * a lock the client holds), the kind check of an attached fd
 * (clientfd_check_async()), a discard (clientfd_discard_record()), or a
 * run (clientfd_run()). Made on the loop. */
struct cf_take {
        enum cf_op {
                CF_OP_TAKE,  /* pidfd_getfd of `number` from `pidfd`'s process, the
                              * process checks, then the kind check of what came */
                CF_OP_CHECK, /* the kind check of `fd` (owned), which the client attached */
                /* `pidfd` is a duplicate of the session socket, whose next
                 * record the closer reads and drops (its fds released, never
                 * taken), giving its header and length; `discarded` is
                 * called instead of `done`. */
                CF_OP_DISCARD,
                CF_OP_RUN, /* `run` on a checker, then `ran` on the loop instead of `done` */
        } op;
        enum region_kind kind;          /* take, check: what the fd must be (clientfd_check()) */
        uint64_t size;                  /* and at least how many bytes */
        struct moeep_record_header hdr; /* a discard's record's header, when `len` covers it */
        long len;                       /* its length; -errno when none was read */
        clientfd_discard_fn *discarded;
        clientfd_run_fn *run, *ran;
        int pidfd;  /* owns until the closer closes it; -1 for a check or run */
        int number; /* the descriptor number in the client's process */
        pid_t pid;  /* SO_PEERCRED's, for messages */
        uid_t uid;  /* SO_PEERCRED's: the process must still have these ids */
        gid_t gid;
        int fd;    /* the result (a check's fd, to begin with): owns, charged to `uid`; -1 on error
                    * and for a run */
        int error; /* 0 or -errno (-ERROR_KIND_* for a permission refusal) */
        char errmsg[ERRMSG_MAX];
        clientfd_take_fn *done; /* called on the loop, exactly once */
        void *ctx;              /* not owning */
        TAILQ_ENTRY(cf_take) entry;
};
TAILQ_HEAD(cf_take_list, cf_take);

/* One fd waiting for a closer, or a take. Every one is charged to its
 * uid until it is done. */
struct cf_job {
        int fd;
        enum cf_cost {
                CF_CHARGED, /* an fd the uid sent (or a duplicate): charged until close() returns */
                CF_SOCKET,  /* a session socket: charged until close() returns */
                CF_TAKE,    /* a take, check, discard or run (`take`), not a close; `fd` unused */
        } cost;
        struct cf_take *take; /* owns until the closer puts it on takes_done; CF_TAKE only */
        TAILQ_ENTRY(cf_job) entry;
};
TAILQ_HEAD(cf_job_list, cf_job);

/* One queue of a uid, served by at most one thread at a time. Each uid has
 * three: the fds it sent and its takes, whose close (or take) may never
 * return; its session sockets, whose close the CF_INTERRUPT_MS timer
 * always ends (what is in flight in them is released, never flushed), so
 * that a socket never waits behind a stuck fd (closers serve both); and
 * the kind checks of the fds it attaches and its runs, which never wait
 * for anything the client controls (clientfd_check(), clientfd_run()), so
 * that a registration never waits behind one of its uid's closes that
 * never returns, nor behind anybody's (checkers serve it). */
struct cf_lane {
        struct cf_uid *uid;   /* not owning; the uid the lane belongs to */
        struct cf_pool *pool; /* not owning; the threads that serve it */
        /* Under clientfds.lock: */
        struct cf_job_list queue; /* owns; waiting for a thread */
        uint32_t queued;          /* jobs in `queue` */
        uint32_t done;            /* closes finished that the loop has not counted */
        uint32_t slow_ms;         /* the longest of them, when over CF_INTERRUPT_MS */
        bool busy;                /* a thread runs a job of it */
        long busy_since;          /* since when (CLOCK_MONOTONIC ms) */
        bool ready;               /* in its pool's line (cf_pool.ready) */
        TAILQ_ENTRY(cf_lane) ready_entry;
};

enum {
        CF_LANE_FDS,
        CF_LANE_SOCKETS,
        CF_LANE_CHECKS,
        CF_LANES
};

/* What one uid is charged, and its lanes. */
struct cf_uid {
        uid_t uid;
        uint32_t held;    /* loop thread only: every fd charged, pending closes included */
        uint32_t closing; /* loop thread only: closes (fds and sockets) not yet returned */
        long logged_ms;   /* loop thread only: when a slow close of it was last logged */
        struct cf_lane lanes[CF_LANES];
        LIST_ENTRY(cf_uid) entry;
};

/* Threads that serve lanes: one line of lanes with work and no thread,
 * taken in turn (a lane goes to the back after each job), and the threads
 * themselves, started on demand up to `max`. */
struct cf_pool {
        struct clientfds *cf; /* not owning */
        unsigned max;         /* threads at most: CF_CLOSERS_MAX, CF_CHECKERS_MAX (tests lower them) */
        uint32_t queued_max;  /* jobs a lane may have waiting; 0: no cap (closes are never refused) */
        size_t stack;         /* bytes of a thread's stack; 0: the default */
        /* Under clientfds.lock: */
        TAILQ_HEAD(, cf_lane) ready; /* lanes with queued jobs and no thread */
        pthread_cond_t wake;         /* its threads wait here for work */
        unsigned nworkers, nidle;    /* its threads (detached), of them waiting for work */
};

struct clientfds {
        const struct config *config; /* not owning */
        struct event_base *base;     /* not owning; NULL = close at once */
        int efd;                     /* owns; closers tell the loop that closes finished */
        struct event *ev_done;       /* owns */
        uint32_t total;              /* loop only: all uids' charges */
        uint32_t sessions;           /* loop only: client session sockets open (not charged to a uid) */
        uint32_t limit;              /* RLIMIT_NOFILE at start */
        uint32_t budget;             /* what all uids together may be charged, sessions included */
        dev_t memfd_dev;             /* st_dev of a memfd of ours; 0 = unknown */
        bool memfd_dev_known;
        pthread_mutex_t lock;
        pthread_cond_t settled;         /* the loop waits here in clientfds_settle() */
        pthread_cond_t exited;          /* clientfds_free() waits here for the threads to end */
        LIST_HEAD(, cf_uid) uids;       /* owns; entries added and removed by the loop, under lock */
        struct cf_pool closers;         /* the fds and sockets lanes' threads */
        struct cf_pool checkers;        /* the checks lanes' threads */
        struct cf_take_list takes_done; /* owns; takes the loop has yet to hand back */
        uint32_t pending;               /* jobs queued or running */
        bool stopping;
        bool takes_dropped; /* loop only: clientfds_free() began; finished takes are dropped */
};

#endif
