/* Descriptors that clients send; see clientfd.h. This file charges them to
 * their uids, closes them on the closer threads and takes them from a
 * client's process (pidfd_getfd); clientfd-check.c checks that an fd is of
 * the kind a client says. */
#include <errno.h>
#include <event2/event.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
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
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <sys/vfs.h>
#include <time.h>
#include <unistd.h>

#include "config.h"
#include "errors.h"
#include "log.h"
#include "record.h"
#include "state/clientfd-internal.h"

/* Takes, checks and discards (at the end of this file): on a closer
 * thread, does `t` (pidfd_getfd and the checks of the process, the kind
 * check, ...), filling t->fd or t->error and t->errmsg, and closes
 * t->pidfd, never logging; on the loop, calls t->done and frees `t`. */
static void clientfd_take_run(const struct clientfds *cf, struct cf_take *t);
static void clientfd_take_finish(struct clientfds *cf, struct cf_take *t);

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
        for (int l = 0; l < CF_LANES; l++) {
                u->lanes[l].uid = u;
                u->lanes[l].pool = l == CF_LANE_CHECKS ? &cf->checkers : &cf->closers;
                TAILQ_INIT(&u->lanes[l].queue);
        }
        pthread_mutex_lock(&cf->lock);
        LIST_INSERT_HEAD(&cf->uids, u, entry);
        pthread_mutex_unlock(&cf->lock);
        return u;
}

/* Frees `u` once it owes nothing and no closer can reach it. Call with the
 * lock held. */
static void uid_maybe_free_locked(struct cf_uid *u) {
        if (u->held || u->closing)
                return;
        for (int l = 0; l < CF_LANES; l++)
                if (u->lanes[l].done || u->lanes[l].busy || u->lanes[l].ready ||
                    !TAILQ_EMPTY(&u->lanes[l].queue))
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
                                  "uid %u holds %" PRIu32 " descriptors in the daemon (regions, "
                                  "unsent replies, job control pages, closes pending); %" PRIu32
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

/* Whether the fds lane of `u` has been in one close (or take) for longer
 * than CF_STUCK_MS. */
static bool uid_stuck(struct clientfds *cf, const struct cf_uid *u) {
        bool stuck;

        pthread_mutex_lock(&cf->lock);
        stuck = u->lanes[CF_LANE_FDS].busy && now_ms() - u->lanes[CF_LANE_FDS].busy_since > CF_STUCK_MS;
        pthread_mutex_unlock(&cf->lock);
        return stuck;
}

int clientfds_closing_check(struct clientfds *cf, uid_t uid, char *errmsg) {
        const struct cf_uid *u = uid_find(cf, uid);

        if (!u || u->held <= cf->config->max_fds_per_uid || !uid_stuck(cf, u))
                return 0;
        return errmsg_set(errmsg, -EDQUOT,
                          "uid %u holds %" PRIu32 " descriptors in the daemon (max_fds_per_uid = %" PRIu32
                          "), %" PRIu32 " of them still being closed, one for more than %d ms: nothing "
                          "more is taken from it",
                          (unsigned)uid, u->held, cf->config->max_fds_per_uid, u->closing, CF_STUCK_MS);
}

int clientfds_read_check(struct clientfds *cf, uid_t uid, int sock, char *errmsg) {
        const struct cf_uid *u = uid_find(cf, uid);
        uint32_t held = u ? u->held : 0, cap = cf->config->max_fds_per_uid;
        uint64_t all = (uint64_t)cf->total + cf->sessions;
        uint32_t room = held < cap ? cap - held : 0,
                 room_all = all < cf->budget ? cf->budget - (uint32_t)all : 0;
        struct moeep_record_header hdr;
        struct iovec iov = { .iov_base = &hdr, .iov_len = sizeof(hdr) };
        struct msghdr mh = { .msg_iov = &iov, .msg_iovlen = 1 };
        ssize_t n;
        uint32_t claim;
        int r;

        if (room >= MOEEP_RECORD_RECV_FDS && room_all >= MOEEP_RECORD_RECV_FDS)
                return 0;
        /* Whether the next record carries descriptors, without taking them:
         * a peek with no room for them only sets MSG_CTRUNC (the kernel
         * drops its extra references, never the last one). How many its
         * header says: a record that lies is refused once read, and only
         * one such fits past a cap (the reserve has room for it). */
        n = recvmsg(sock, &mh, MSG_PEEK | MSG_DONTWAIT);
        if (n < 0 || !(mh.msg_flags & MSG_CTRUNC))
                return 0;
        claim = (size_t)n >= sizeof(hdr) && hdr.magic == MOEEP_RECORD_MAGIC && hdr.nfds
                        ? hdr.nfds
                        : MOEEP_RECORD_RECV_FDS;
        if (claim <= room && claim <= room_all)
                return 0;
        if (claim > room)
                r = errmsg_set(errmsg, -EDQUOT,
                               "uid %u holds %" PRIu32
                               " descriptors in the daemon (max_fds_per_uid = %" PRIu32 "), %" PRIu32
                               " of them still being closed: a record with %" PRIu32 " more is not read",
                               (unsigned)uid, held, cap, u ? u->closing : 0, claim);
        else
                r = errmsg_set(errmsg, -EMFILE,
                               "the daemon holds %" PRIu64 " descriptors for clients and keeps %" PRIu32
                               " of its RLIMIT_NOFILE %" PRIu32 " in reserve: a record with %" PRIu32
                               " more is not read",
                               all, cf->limit - cf->budget, cf->limit, claim);
        /* Room may come soon: closes under way (and not stuck). */
        if (claim > room ? u && u->closing && !uid_stuck(cf, u) : cf->pending > 0)
                return -EAGAIN;
        return r;
}

/* ------------------------------------------------------------ closing */

static void closer_signal_cb(int sig) {
        /* Nothing: being delivered is what ends the wait it interrupted. */
}

/* The timer that interrupts this thread's waits (CF_INTERRUPT_MS); false
 * when there is none (then a lingering close waits its time out). */
static bool closer_timer_new(timer_t *ret) {
        struct sigevent sev = { .sigev_notify = SIGEV_THREAD_ID, .sigev_signo = CF_SIGNAL };
        sigset_t set;

        sev._sigev_un._tid = (pid_t)syscall(SYS_gettid);
        if (timer_create(CLOCK_MONOTONIC, &sev, ret) < 0)
                return false;
        sigemptyset(&set);
        sigaddset(&set, CF_SIGNAL);
        pthread_sigmask(SIG_UNBLOCK, &set, NULL);
        return true;
}

static void closer_timer_arm(timer_t timer, bool on) {
        struct itimerspec it = { .it_value = { .tv_nsec = on ? CF_INTERRUPT_MS * 1000000L : 0 } };

        timer_settime(timer, 0, &it, NULL);
}

/* Runs one job, under the interrupting timer unless it is a run. Returns
 * how long it took. */
static long closer_run(const struct clientfds *cf, struct cf_job *job, timer_t timer, bool have_timer) {
        long t0 = now_ms();

        have_timer = have_timer && !(job->take && job->take->op == CF_OP_RUN);
        if (have_timer)
                closer_timer_arm(timer, true);
        if (job->take)
                clientfd_take_run(cf, job->take); /* may wait on the client's execve() */
        else
                close(job->fd); /* may block for as long as the sender arranged */
        if (have_timer)
                closer_timer_arm(timer, false);
        return now_ms() - t0;
}

static void closer_spawn_locked(struct cf_pool *pool);

/* A thread of `arg` (a pool): takes one job of the lane first in its
 * line, runs it, and puts the lane back in line when it has more. Ends
 * when idle for CF_IDLE_EXIT_MS with CF_WORKERS_KEEP others of its pool
 * left, or when stopping. Never logs (logging is the loop's). */
static void *closer_main(void *arg) {
        struct cf_pool *pool = arg;
        struct clientfds *cf = pool->cf;
        bool have_timer;
        timer_t timer;
        uint64_t one = 1;

        have_timer = closer_timer_new(&timer);
        pthread_mutex_lock(&cf->lock);
        for (;;) {
                struct cf_lane *lane = TAILQ_FIRST(&pool->ready);
                struct cf_job *job;
                long took;

                if (!lane) {
                        struct timespec until;
                        int r;

                        if (cf->stopping)
                                break;
                        clock_gettime(CLOCK_REALTIME, &until);
                        until.tv_sec += CF_IDLE_EXIT_MS / 1000;
                        pool->nidle++;
                        r = pthread_cond_timedwait(&pool->wake, &cf->lock, &until);
                        pool->nidle--;
                        if (r == ETIMEDOUT && TAILQ_EMPTY(&pool->ready) && pool->nworkers > CF_WORKERS_KEEP)
                                break;
                        continue;
                }
                TAILQ_REMOVE(&pool->ready, lane, ready_entry);
                lane->ready = false;
                job = TAILQ_FIRST(&lane->queue);
                TAILQ_REMOVE(&lane->queue, job, entry);
                lane->queued--;
                lane->busy = true;
                lane->busy_since = now_ms();
                /* This job may never return: work still waiting gets a
                 * closer of its own. (job_push() counted this thread idle
                 * when it queued that work, and started none.) */
                if (!TAILQ_EMPTY(&pool->ready) && pool->nidle == 0)
                        closer_spawn_locked(pool);
                pthread_mutex_unlock(&cf->lock);

                took = closer_run(cf, job, timer, have_timer);

                pthread_mutex_lock(&cf->lock);
                /* A run takes the time its work takes: no slow close. */
                if (job->take && job->take->op == CF_OP_RUN)
                        took = 0;
                if (job->take)
                        TAILQ_INSERT_TAIL(&cf->takes_done, job->take, entry);
                else
                        lane->done++;
                free(job);
                lane->busy = false;
                if (took >= CF_INTERRUPT_MS && (uint32_t)took > lane->slow_ms)
                        lane->slow_ms = (uint32_t)took;
                cf->pending--;
                if (!TAILQ_EMPTY(&lane->queue)) {
                        TAILQ_INSERT_TAIL(&pool->ready, lane, ready_entry);
                        lane->ready = true;
                }
                pthread_cond_broadcast(&cf->settled);
                (void)!write(cf->efd, &one, sizeof(one));
        }
        pool->nworkers--;
        pthread_cond_broadcast(&cf->exited);
        pthread_mutex_unlock(&cf->lock);
        if (have_timer)
                timer_delete(timer);
        return NULL;
}

/* Starts one more thread of `pool`. Call with the lock held. */
static void closer_spawn_locked(struct cf_pool *pool) {
        sigset_t all, old;
        pthread_attr_t attr;
        pthread_t thread;

        if (pool->nworkers >= pool->max || pthread_attr_init(&attr) != 0)
                return;
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        if (pool->stack)
                pthread_attr_setstacksize(&attr, pool->stack);
        /* Signals are the loop's business (libevent's handlers); each
         * closer unblocks CF_SIGNAL alone. */
        sigfillset(&all);
        pthread_sigmask(SIG_BLOCK, &all, &old);
        if (pthread_create(&thread, &attr, closer_main, pool) == 0)
                pool->nworkers++;
        pthread_sigmask(SIG_SETMASK, &old, NULL);
        pthread_attr_destroy(&attr);
}

/* Logs how long the closes of `u` took, at most once per
 * CF_LOG_INTERVAL_MS (a stuck close once it returns: always). */
static void uid_log_slow(struct cf_uid *u, uint32_t slow_ms) {
        long now = now_ms();

        if (slow_ms > CF_SLOW_CLOSE_MS)
                log_notice("uid %u: closing a descriptor it sent took %" PRIu32 " ms", (unsigned)u->uid,
                           slow_ms);
        else if (!u->logged_ms || now - u->logged_ms >= CF_LOG_INTERVAL_MS)
                log_info("uid %u: closing a descriptor it sent took %" PRIu32 " ms (a wait a signal "
                         "ends, as SO_LINGER's, is cut short after %d ms)",
                         (unsigned)u->uid, slow_ms, CF_INTERRUPT_MS);
        else
                return;
        u->logged_ms = now;
}

/* Returns the charges of finished closes and hands back finished takes
 * (the loop, on the eventfd). */
static void clientfds_collect(struct clientfds *cf) {
        struct cf_take_list takes = TAILQ_HEAD_INITIALIZER(takes);
        struct cf_uid *u, *next;
        struct cf_take *t;
        uint64_t n;

        (void)!read(cf->efd, &n, sizeof(n));
        pthread_mutex_lock(&cf->lock);
        TAILQ_CONCAT(&takes, &cf->takes_done, entry);
        for (u = LIST_FIRST(&cf->uids); u; u = next) {
                uint32_t done = 0, slow = 0;

                next = LIST_NEXT(u, entry);
                for (int l = 0; l < CF_LANES; l++) {
                        done += u->lanes[l].done;
                        slow = u->lanes[l].slow_ms > slow ? u->lanes[l].slow_ms : slow;
                        u->lanes[l].done = 0;
                        u->lanes[l].slow_ms = 0;
                }
                if (slow)
                        uid_log_slow(u, slow);
                cf->total -= done < cf->total ? done : cf->total;
                u->held -= done < u->held ? done : u->held;
                u->closing -= done < u->closing ? done : u->closing;
                uid_maybe_free_locked(u);
        }
        pthread_mutex_unlock(&cf->lock);
        /* Outside the lock: the callbacks charge, close and reply. */
        while ((t = TAILQ_FIRST(&takes))) {
                TAILQ_REMOVE(&takes, t, entry);
                clientfd_take_finish(cf, t);
        }
}

static void clientfds_done_cb(evutil_socket_t fd, short what, void *arg) {
        clientfds_collect(arg);
}

/* Appends `job` to `lane` and wakes a thread of its pool, starting one
 * when none is idle: a lane whose close never returns holds its closer,
 * and the others get one of their own. Returns 0, or -EUSERS when the lane
 * has its pool's queued_max jobs waiting (nothing is queued then). */
static int job_push(struct clientfds *cf, struct cf_lane *lane, struct cf_job *job) {
        struct cf_pool *pool = lane->pool;

        pthread_mutex_lock(&cf->lock);
        if (pool->queued_max && lane->queued >= pool->queued_max) {
                pthread_mutex_unlock(&cf->lock);
                return -EUSERS;
        }
        TAILQ_INSERT_TAIL(&lane->queue, job, entry);
        lane->queued++;
        cf->pending++;
        if (!lane->busy && !lane->ready) {
                TAILQ_INSERT_TAIL(&pool->ready, lane, ready_entry);
                lane->ready = true;
        }
        if (pool->nidle == 0 && lane->ready)
                closer_spawn_locked(pool);
        pthread_cond_signal(&pool->wake);
        pthread_mutex_unlock(&cf->lock);
        return 0;
}

/* Queues the close of `fd`, charged to `uid` (the caller charged it). */
static void close_queue(struct clientfds *cf, uid_t uid, int fd, enum cf_cost cost) {
        struct cf_job *job;
        struct cf_uid *u;

        u = uid_get(cf, uid);
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
        job->take = NULL;
        u->closing++;
        /* Closers take every close: their lanes have no cap. */
        (void)job_push(cf, &u->lanes[cost == CF_SOCKET ? CF_LANE_SOCKETS : CF_LANE_FDS], job);
}

/* The lane of each kind of work on a descriptor (clientfd-internal.h). */
static const int op_lane[] = {
        [CF_OP_TAKE] = CF_LANE_FDS,
        [CF_OP_CHECK] = CF_LANE_CHECKS,
        [CF_OP_DISCARD] = CF_LANE_SOCKETS,
        [CF_OP_RUN] = CF_LANE_CHECKS,
};

/* Queues `t` in its uid's queue of its kind. Returns 0, or with errmsg
 * -ENOMEM or -ERROR_KIND_LIMIT_EXCEEDED (the queue is full). */
static int clientfd_queue_take(struct clientfds *cf, struct cf_take *t, char *errmsg) {
        struct cf_uid *u = uid_get(cf, t->uid);
        struct cf_job *job = malloc(sizeof(*job));
        struct cf_lane *lane;

        if (!u || !job) {
                free(job);
                return errmsg_set(errmsg, -ENOMEM, "uid %u: out of memory queueing work on a descriptor",
                                  (unsigned)t->uid);
        }
        job->fd = -1;
        job->cost = CF_TAKE;
        job->take = t;
        lane = &u->lanes[op_lane[t->op]];
        if (job_push(cf, lane, job) < 0) {
                free(job);
                return errmsg_set(errmsg, -ERROR_KIND_LIMIT_EXCEEDED,
                                  "uid %u has %" PRIu32 " region checks and registrations waiting in its "
                                  "queue (at most %" PRIu32 "): try again once some are answered",
                                  (unsigned)t->uid, lane->pool->queued_max, lane->pool->queued_max);
        }
        return 0;
}

/* Whether closing `fd` costs the loop only a moment, by facts that never
 * block to learn: a shmem file (F_GET_SEALS works on nothing else) has no
 * flush, and freeing at most CF_INLINE_BYTES of its pages is quick. */
static bool close_is_cheap(int fd) {
        struct statx stx;

        return fcntl(fd, F_GET_SEALS) >= 0 &&
               statx(fd, "", AT_EMPTY_PATH | AT_STATX_DONT_SYNC, STATX_BLOCKS, &stx) == 0 &&
               (stx.stx_mask & STATX_BLOCKS) && stx.stx_blocks * 512 <= CF_INLINE_BYTES;
}

void clientfd_close(struct clientfds *cf, uid_t uid, int fd) {
        if (fd < 0)
                return;
        /* A small memfd closes here: a client that releases a region and
         * registers another at once finds its charge returned. Anything
         * else closes off the loop, charged until it returned. */
        if (!cf->base || close_is_cheap(fd)) {
                close(fd);
                clientfds_uncharge(cf, uid, 1);
                return;
        }
        close_queue(cf, uid, fd, CF_CHARGED);
}

int clientfds_budget_check(const struct clientfds *cf, uint32_t n, char *errmsg) {
        if ((uint64_t)cf->total + cf->sessions + n > cf->budget)
                return errmsg_set(errmsg, -EMFILE,
                                  "the daemon holds %" PRIu32 " descriptors for clients and keeps %" PRIu32
                                  " of its RLIMIT_NOFILE %" PRIu32 " in reserve",
                                  cf->total + cf->sessions + n, cf->limit - cf->budget, cf->limit);
        return 0;
}

void clientfds_session_opened(struct clientfds *cf) {
        cf->sessions++;
}

/* Closing a session's socket releases whatever the peer queued on it
 * unread, the fds it attached included. Those are released, never closed
 * as an fd is (no FLUSH to a FUSE server), so only a socket lingering with
 * SO_LINGER among them can make that close wait, and the closer's timer
 * ends such a wait (CF_INTERRUPT_MS): the close goes to the uid's sockets
 * lane, charged to it until it returns, never behind a close of an fd that
 * may never return. A socket that could not be sent fds (SO_PASSRIGHTS
 * off) closes at once, here. */
/* Reads and drops the records queued on `fd` that carry no fds (a peek
 * tells, taking none), at most CF_DRAIN_MAX, stopping at one that does: a
 * socket closed with unread input resets its peer, which then never reads
 * the Error it was sent. */
static void session_drain(int fd, bool no_fds) {
        static uint8_t sink[MOEEP_RECORD_MAX];

        for (int i = 0; i < CF_DRAIN_MAX; i++) {
                struct iovec iov = { .iov_base = sink, .iov_len = sizeof(sink) };
                struct msghdr mh = { .msg_iov = &iov, .msg_iovlen = 1 };

                if (!no_fds &&
                    (recvmsg(fd, &mh, MSG_PEEK | MSG_DONTWAIT) <= 0 || (mh.msg_flags & MSG_CTRUNC)))
                        return;
                if (recv(fd, sink, sizeof(sink), MSG_DONTWAIT) <= 0)
                        return;
        }
}

void clientfd_close_session(struct clientfds *cf, uid_t uid, int fd, unsigned flags) {
        if (fd < 0)
                return;
        if (flags & CLIENTFD_SESSION_COUNTED)
                cf->sessions -= cf->sessions > 0;
        (void)shutdown(fd, SHUT_RDWR); /* the peer's sends fail from now on */
        session_drain(fd, flags & CLIENTFD_SESSION_NO_FDS);
        if (!cf->base || (flags & CLIENTFD_SESSION_NO_FDS)) {
                close(fd);
                return;
        }
        clientfds_charge_held(cf, uid, 1);
        close_queue(cf, uid, fd, CF_SOCKET);
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
        cf->closers = (struct cf_pool){ .cf = cf, .max = CF_CLOSERS_MAX, .stack = CF_STACK_BYTES };
        cf->checkers =
                (struct cf_pool){ .cf = cf, .max = CF_CHECKERS_MAX, .queued_max = CF_CHECKS_QUEUED_MAX };
        TAILQ_INIT(&cf->closers.ready);
        TAILQ_INIT(&cf->checkers.ready);
        TAILQ_INIT(&cf->takes_done);
        pthread_mutex_init(&cf->lock, NULL);
        pthread_cond_init(&cf->closers.wake, NULL);
        pthread_cond_init(&cf->checkers.wake, NULL);
        pthread_cond_init(&cf->settled, NULL);
        pthread_cond_init(&cf->exited, NULL);
        /* The closers' timers interrupt waits with CF_SIGNAL: a handler
         * that does nothing, without SA_RESTART. Only closers unblock it. */
        sigaction(CF_SIGNAL, &(struct sigaction){ .sa_handler = closer_signal_cb }, NULL);

        if (getrlimit(RLIMIT_NOFILE, &rl) < 0 || rl.rlim_cur == RLIM_INFINITY || rl.rlim_cur > (1u << 30))
                rl.rlim_cur = 1u << 30;
        cf->limit = (uint32_t)rl.rlim_cur;
        reserve = cf->limit / 8 > CLIENTFDS_RESERVE_MIN ? cf->limit / 8 : CLIENTFDS_RESERVE_MIN;
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
        if ((uint64_t)config->max_fds_per_uid + MOEEP_RECORD_RECV_FDS > cf->budget / 2)
                log_warn("client descriptors: max_fds_per_uid %" PRIu32
                         " (and one record of up to %d past it) "
                         "lets two uids fill the %" PRIu32
                         " descriptors all clients share (RLIMIT_NOFILE %" PRIu32
                         "): raise RLIMIT_NOFILE or lower max_fds_per_uid",
                         config->max_fds_per_uid, MOEEP_RECORD_RECV_FDS, cf->budget, cf->limit);
        *ret_clientfds = cf;
        return 0;

fail:
        clientfds_free(cf, 0);
        return -ENOMEM;
}

void clientfds_free(struct clientfds *cf, int timeout_ms) {
        struct timespec until;
        struct cf_take *t;
        struct cf_uid *u;

        if (!cf)
                return;
        /* The sessions that asked for takes are gone by now. */
        cf->takes_dropped = true;
        if (clientfds_settle(cf, timeout_ms) < 0)
                log_warn("%" PRIu32 " client descriptors are still being closed: leaving them to the exit",
                         cf->pending);
        /* The idle closers end at once; the others as their job returns. */
        clock_gettime(CLOCK_REALTIME, &until);
        until.tv_sec += 1;
        pthread_mutex_lock(&cf->lock);
        cf->stopping = true;
        pthread_cond_broadcast(&cf->closers.wake);
        pthread_cond_broadcast(&cf->checkers.wake);
        while (cf->closers.nworkers + cf->checkers.nworkers > 0 &&
               pthread_cond_timedwait(&cf->exited, &cf->lock, &until) == 0)
                ;
        if (cf->closers.nworkers + cf->checkers.nworkers > 0) {
                /* A closer is still in close() (or a checker in its job):
                 * it would touch `cf` when it returns, so nothing is
                 * freed. */
                pthread_mutex_unlock(&cf->lock);
                return;
        }
        pthread_mutex_unlock(&cf->lock);
        /* Queued fds no closer took: the process's exit closes them. */
        while ((u = LIST_FIRST(&cf->uids))) {
                for (int l = 0; l < CF_LANES; l++) {
                        struct cf_job *job;

                        while ((job = TAILQ_FIRST(&u->lanes[l].queue))) {
                                TAILQ_REMOVE(&u->lanes[l].queue, job, entry);
                                if (job->take) { /* never run: its caller is gone with the loop */
                                        /* a pidfd, or a discard's socket; a check's fd */
                                        if (job->take->pidfd >= 0)
                                                close(job->take->pidfd);
                                        if (job->take->fd >= 0)
                                                close(job->take->fd);
                                }
                                free(job->take);
                                free(job);
                        }
                }
                LIST_REMOVE(u, entry);
                free(u);
        }
        /* Takes done that nobody collected: their callers are gone too. */
        while ((t = TAILQ_FIRST(&cf->takes_done))) {
                TAILQ_REMOVE(&cf->takes_done, t, entry);
                if (t->fd >= 0)
                        close(t->fd);
                free(t);
        }
        if (cf->ev_done)
                event_free(cf->ev_done);
        if (cf->efd >= 0)
                close(cf->efd);
        pthread_cond_destroy(&cf->exited);
        pthread_cond_destroy(&cf->settled);
        pthread_cond_destroy(&cf->checkers.wake);
        pthread_cond_destroy(&cf->closers.wake);
        pthread_mutex_destroy(&cf->lock);
        free(cf);
}

/* ------------------------------------------------------------ takes */

/* Descriptors the daemon takes from a client's process with pidfd_getfd()
 * (RegionRegister.take); see clientfd_take() in clientfd.h. The loop part
 * (clientfd_take, clientfd_take_finish) names the process and charges the
 * fd; the closer part (clientfd_take_run) takes it and checks the process.
 *
 * Why SO_PEERPIDFD and nothing else: the pid of SO_PEERCRED is a number,
 * which the client's process can give back (exit) and another process can
 * get, so pidfd_open() of it could name a stranger's process, whose fds
 * the daemon (CAP_SYS_PTRACE) would then take. A pidfd from SO_PEERPIDFD
 * is made by the kernel from the reference the socket holds on the
 * connecting process: it names that process or nothing. Where the kernel
 * lacks it (before Linux 6.5), the take is refused rather than emulated. */
#ifndef SO_PEERPIDFD
#define SO_PEERPIDFD 77 /* Linux 6.5 */
#endif
#ifndef SYS_pidfd_getfd
#define SYS_pidfd_getfd 438 /* Linux 5.6, the same number on every architecture */
#endif
#ifndef SYS_pidfd_send_signal
#define SYS_pidfd_send_signal 424
#endif

/* What the daemon knows of the process it takes from: its ids (real,
 * effective, saved, filesystem), its capability sets, and who owns
 * /proc/PID/status (the process's euid while it is dumpable; root, or its
 * user namespace's root, once it is not: task_dump_owner(), which leaves
 * the /proc/PID directory itself alone). */
struct take_proc {
        uint32_t uid[4], gid[4];
        uint64_t cap_prm, cap_eff;
        uid_t owner;
};

/* Reads /proc/PID (the pid from the pidfd's fdinfo) into *ret; the pidfd
 * is asked afterwards whether its process still lives: if so, the pid was
 * not reused in between and what was read is its. Returns 0, -ESRCH, or
 * -EIO. */
static int take_proc_read(int pidfd, struct take_proc *ret) {
        char path[64], line[256];
        int pid = -1, got = 0;
        struct stat st;
        FILE *f;

        snprintf(path, sizeof(path), "/proc/self/fdinfo/%d", pidfd);
        f = fopen(path, "re");
        if (!f)
                return -EIO;
        while (fgets(line, sizeof(line), f))
                if (sscanf(line, "Pid: %d", &pid) == 1)
                        break;
        fclose(f);
        if (pid <= 0)
                return -ESRCH;
        snprintf(path, sizeof(path), "/proc/%d/status", pid);
        f = fopen(path, "re");
        if (!f)
                return -ESRCH;
        if (fstat(fileno(f), &st) < 0) {
                fclose(f);
                return -EIO;
        }
        ret->owner = st.st_uid;
        while (fgets(line, sizeof(line), f))
                if (sscanf(line, "Uid: %u %u %u %u", &ret->uid[0], &ret->uid[1], &ret->uid[2],
                           &ret->uid[3]) == 4)
                        got |= 1;
                else if (sscanf(line, "Gid: %u %u %u %u", &ret->gid[0], &ret->gid[1], &ret->gid[2],
                                &ret->gid[3]) == 4)
                        got |= 2;
                else if (sscanf(line, "CapPrm: %" SCNx64, &ret->cap_prm) == 1)
                        got |= 4;
                else if (sscanf(line, "CapEff: %" SCNx64, &ret->cap_eff) == 1)
                        got |= 8;
        fclose(f);
        /* Gone only when the kernel says so: signal 0 needs CAP_KILL or the
         * client's uid, and moeepd.service leaves the daemon neither
         * (EPERM there means alive). */
        if (syscall(SYS_pidfd_send_signal, pidfd, 0, NULL, 0) < 0 && errno == ESRCH)
                return -ESRCH;
        return got == 15 ? 0 : -EIO;
}

/* Whether the daemon, which holds CAP_SYS_PTRACE, may take from the
 * process: only what the connecting uid could take itself, without
 * privilege, with pidfd_getfd() (ptrace access PTRACE_MODE_ATTACH_REALCREDS
 * of an unprivileged tracer of that uid). The kernel asks three things of
 * such a tracer, and so does this:
 *   - the process's user and group ids, all four of each, are the
 *     tracer's: those it connected with (SO_PEERCRED), so nothing is taken
 *     from a set-id program the client started with the socket inherited;
 *   - the process is dumpable: /proc/PID/status is that uid's. A set-id or
 *     file-capability program is not (nor stops being, when it drops back
 *     to the caller's ids), nor is one that said so (PR_SET_DUMPABLE 0);
 *   - its permitted capabilities are a subset of the tracer's, which has
 *     none: CapPrm and CapEff are empty (a file-capability program's are
 *     not, whatever fs.suid_dumpable says).
 * A root client (uid 0) is exempt from the last two: /proc/PID/status of
 * a root process is root's either way, and any program root starts gets at most
 * the capability bounding set, which root's exec restores anyway. A
 * process holding capabilities in a user namespace of its own (a
 * container's root, mapped to an unprivileged uid) is refused too: it
 * attaches its fds instead. Checked before the take and again after it, so
 * that an exec under way (pidfd_getfd waits for it) is seen at one end. */
static int take_check_process(struct cf_take *t) {
        struct take_proc p;
        int r = take_proc_read(t->pidfd, &p);

        if (r == -ESRCH)
                return errmsg_set(t->errmsg, -ESRCH,
                                  "fd %d of pid %d: the process that connected this session has exited",
                                  t->number, (int)t->pid);
        if (r < 0)
                return errmsg_set(t->errmsg, r, "fd %d of pid %d: reading /proc of the process: %s",
                                  t->number, (int)t->pid, strerror(-r));
        for (int i = 0; i < 4; i++)
                if (p.uid[i] != t->uid || p.gid[i] != t->gid)
                        return errmsg_set(t->errmsg, -ERROR_KIND_PERMISSION_DENIED,
                                          "fd %d of pid %d: the process's user/group ids (uid %u %u %u %u, "
                                          "gid %u %u %u %u) are no longer the uid %u gid %u it connected "
                                          "with: nothing is taken from it",
                                          t->number, (int)t->pid, p.uid[0], p.uid[1], p.uid[2], p.uid[3],
                                          p.gid[0], p.gid[1], p.gid[2], p.gid[3], (unsigned)t->uid,
                                          (unsigned)t->gid);
        if (t->uid == 0)
                return 0;
        if (p.owner != t->uid)
                return errmsg_set(t->errmsg, -ERROR_KIND_PERMISSION_DENIED,
                                  "fd %d of pid %d: the process is not dumpable (/proc/%d/status belongs "
                                  "to uid %u, not %u: a set-id or file-capability program, or "
                                  "PR_SET_DUMPABLE 0): nothing is taken from it",
                                  t->number, (int)t->pid, (int)t->pid, (unsigned)p.owner, (unsigned)t->uid);
        if (p.cap_prm || p.cap_eff)
                return errmsg_set(t->errmsg, -ERROR_KIND_PERMISSION_DENIED,
                                  "fd %d of pid %d: the process holds capabilities (CapPrm %016" PRIx64
                                  ", CapEff %016" PRIx64 ") that uid %u has not without privilege: nothing "
                                  "is taken from it (attach the fd instead)",
                                  t->number, (int)t->pid, p.cap_prm, p.cap_eff, (unsigned)t->uid);
        return 0;
}

/* A discard, on a closer: reads the next record's header without room
 * for its fds (the kernel releases them here; the closer's timer ends a
 * lingering socket's wait), the rest of the record dropped with it. */
static void discard_run(struct cf_take *t) {
        struct iovec iov = { .iov_base = &t->hdr, .iov_len = sizeof(t->hdr) };
        struct msghdr mh = { .msg_iov = &iov, .msg_iovlen = 1 };
        /* MSG_TRUNC: the record's whole length, however much is copied. */
        ssize_t n = recvmsg(t->pidfd, &mh, MSG_DONTWAIT | MSG_TRUNC);

        t->len = n < 0 ? -errno : (long)n;
        close(t->pidfd);
        t->pidfd = -1;
}

/* A take, on a closer: the process, pidfd_getfd(), the process again, then
 * the kind. */
static void take_run(const struct clientfds *cf, struct cf_take *t) {
        char why[ERRMSG_MAX];
        int fd, e;

        t->error = take_check_process(t);
        if (t->error < 0)
                return;
        fd = (int)syscall(SYS_pidfd_getfd, t->pidfd, t->number, 0);
        e = errno;
        if (fd < 0) {
                switch (e) {
                case EPERM:
                        t->error = errmsg_set(t->errmsg, -ERROR_KIND_PERMISSION_DENIED,
                                              "fd %d of pid %d: pidfd_getfd refused (EPERM): moeepd lacks "
                                              "CAP_SYS_PTRACE over the client (give it CAP_SYS_PTRACE, see "
                                              "moeepd.service; Yama ptrace_scope 3 forbids it altogether)",
                                              t->number, (int)t->pid);
                        break;
                case EBADF:
                        t->error = errmsg_set(t->errmsg, -ERROR_KIND_BAD_FDS,
                                              "fd %d of pid %d: no such open descriptor", t->number,
                                              (int)t->pid);
                        break;
                case ESRCH:
                        t->error = errmsg_set(t->errmsg, -ESRCH,
                                              "fd %d of pid %d: the process that connected this session "
                                              "has exited",
                                              t->number, (int)t->pid);
                        break;
                case ENOSYS:
                        t->error = errmsg_set(t->errmsg, -EOPNOTSUPP,
                                              "fd %d of pid %d: the kernel has no pidfd_getfd (Linux 5.6+)",
                                              t->number, (int)t->pid);
                        break;
                default:
                        t->error = errmsg_set(t->errmsg, -e, "fd %d of pid %d: pidfd_getfd: %s", t->number,
                                              (int)t->pid, strerror(e));
                        break;
                }
                return;
        }
        t->fd = fd; /* refused, clientfd_take_finish() closes it */
        t->error = take_check_process(t);
        if (t->error == 0) {
                t->error = clientfd_check(cf, fd, t->kind, t->size, why);
                if (t->error < 0)
                        errmsg_set(t->errmsg, t->error, "fd %d of pid %d: %s", t->number, (int)t->pid, why);
        }
}

static void clientfd_take_run(const struct clientfds *cf, struct cf_take *t) {
        switch (t->op) {
        case CF_OP_TAKE:
                take_run(cf, t);
                close(t->pidfd);
                t->pidfd = -1;
                break;
        case CF_OP_CHECK:
                t->error = clientfd_check(cf, t->fd, t->kind, t->size, t->errmsg);
                break;
        case CF_OP_DISCARD:
                discard_run(t);
                break;
        case CF_OP_RUN:
                t->run(t->ctx);
                break;
        }
}

static void clientfd_take_finish(struct clientfds *cf, struct cf_take *t) {
        switch (t->op) {
        case CF_OP_DISCARD:
                clientfds_uncharge(cf, t->uid, 1); /* its duplicate of the socket is closed */
                if (!cf->takes_dropped)
                        t->discarded(t->ctx, t->len >= (long)sizeof(t->hdr) ? &t->hdr : NULL, t->len,
                                     t->errmsg);
                free(t);
                return;
        case CF_OP_RUN:
                if (!cf->takes_dropped)
                        t->ran(t->ctx);
                free(t);
                return;
        case CF_OP_TAKE:
                clientfds_uncharge(cf, t->uid, 1); /* the pidfd is closed by now */
                break;
        case CF_OP_CHECK:
                break;
        }
        /* A refused fd closes in the uid's queue, where a close that
         * blocks stalls nobody else, and its charge goes when it did; a
         * take that got none gives back the charge made for it. A kept fd
         * stays charged. (When the daemon exits, nobody waits for the
         * reply; the exit closes the fd.) */
        if (t->error < 0) {
                if (t->fd >= 0)
                        clientfd_close(cf, t->uid, t->fd);
                else
                        clientfds_uncharge(cf, t->uid, 1);
                t->fd = -1;
        }
        if (!cf->takes_dropped)
                t->done(t->ctx, t->fd, t->error, t->errmsg);
        free(t);
}

/* Opens a pidfd of exactly the process that connected `sock`. */
static int peer_pidfd(int sock, const struct ucred *cred, int64_t number, char *errmsg) {
        socklen_t len = sizeof(int);
        int pidfd = -1;

        if (getsockopt(sock, SOL_SOCKET, SO_PEERPIDFD, &pidfd, &len) < 0) {
                if (errno == ENOPROTOOPT)
                        return errmsg_set(errmsg, -EOPNOTSUPP,
                                          "fd %" PRId64 " of pid %d: registering by fd number needs "
                                          "SO_PEERPIDFD (Linux 6.5+), which this kernel lacks: attach "
                                          "the fd instead",
                                          number, (int)cred->pid);
                if (errno == ESRCH || errno == EINVAL)
                        return errmsg_set(errmsg, -ESRCH,
                                          "fd %" PRId64 " of pid %d: the process that connected this "
                                          "session has exited",
                                          number, (int)cred->pid);
                return errmsg_set(errmsg, -errno, "fd %" PRId64 " of pid %d: SO_PEERPIDFD: %s", number,
                                  (int)cred->pid, strerror(errno));
        }
        if (pidfd < 0 || len != sizeof(int))
                return errmsg_set(errmsg, -EIO, "fd %" PRId64 " of pid %d: SO_PEERPIDFD gave no pidfd",
                                  number, (int)cred->pid);
        (void)fcntl(pidfd, F_SETFD, FD_CLOEXEC);
        return pidfd;
}

/* Runs `t` (at once without a loop), or queues it; on failure (errmsg
 * says why) undoes it: its pidfd (or duplicate of a socket nothing was
 * read from) closes at once, and the `charged` fds go back (a check's fd
 * stays the caller's). */
static int take_start(struct clientfds *cf, struct cf_take *t, uint32_t charged, char *errmsg) {
        int r;

        if (!cf->base) {
                clientfd_take_run(cf, t);
                clientfd_take_finish(cf, t);
                return 0;
        }
        r = clientfd_queue_take(cf, t, errmsg);
        if (r < 0) {
                if (t->pidfd >= 0)
                        close(t->pidfd);
                clientfds_uncharge(cf, t->uid, charged);
                free(t);
        }
        return r;
}

int clientfd_take(struct clientfds *cf, int sock, const struct ucred *cred, int64_t number,
                  enum region_kind kind, uint64_t size, clientfd_take_fn *done, void *ctx, char *errmsg) {
        struct cf_take *t;
        int pidfd, r;

        if (number < 0 || number > INT_MAX)
                return errmsg_set(errmsg, -ERROR_KIND_INVALID_ARGUMENT,
                                  "fd number %" PRId64 " is outside 0..%d", number, INT_MAX);
        /* The fd to come and the pidfd count now: its uid's cap bounds the
         * takes too. */
        r = clientfds_charge(cf, cred->uid, 2, errmsg);
        if (r < 0)
                return r;
        t = calloc(1, sizeof(*t));
        if (!t) {
                clientfds_uncharge(cf, cred->uid, 2);
                return errmsg_set(errmsg, -ENOMEM, "fd %" PRId64 ": out of memory", number);
        }
        pidfd = peer_pidfd(sock, cred, number, errmsg);
        if (pidfd < 0) {
                free(t);
                clientfds_uncharge(cf, cred->uid, 2);
                return pidfd;
        }
        t->op = CF_OP_TAKE;
        t->kind = kind;
        t->size = size;
        t->pidfd = pidfd;
        t->number = (int)number;
        t->pid = cred->pid;
        t->uid = cred->uid;
        t->gid = cred->gid;
        t->fd = -1;
        t->done = done;
        t->ctx = ctx;
        return take_start(cf, t, 2, errmsg);
}

int clientfd_check_async(struct clientfds *cf, uid_t uid, int fd, enum region_kind kind, uint64_t size,
                         clientfd_take_fn *done, void *ctx, char *errmsg) {
        struct cf_take *t = calloc(1, sizeof(*t));
        char why[ERRMSG_MAX];
        int r;

        if (!t)
                return errmsg_set(errmsg, -ENOMEM, "%s region: out of memory", clientfd_kind_to_string(kind));
        t->op = CF_OP_CHECK;
        t->kind = kind;
        t->size = size;
        t->pidfd = -1;
        t->uid = uid;
        t->fd = fd;
        t->done = done;
        t->ctx = ctx;
        r = take_start(cf, t, 0, why);
        if (r < 0)
                return errmsg_set(errmsg, r, "%s region: %s", clientfd_kind_to_string(kind), why);
        return 0;
}

int clientfd_run(struct clientfds *cf, uid_t uid, clientfd_run_fn *run, clientfd_run_fn *done, void *ctx,
                 char *errmsg) {
        struct cf_take *t = calloc(1, sizeof(*t));

        if (!t)
                return errmsg_set(errmsg, -ENOMEM, "uid %u: out of memory", (unsigned)uid);
        t->op = CF_OP_RUN;
        t->pidfd = -1;
        t->uid = uid;
        t->fd = -1;
        t->run = run;
        t->ran = done;
        t->ctx = ctx;
        return take_start(cf, t, 0, errmsg);
}

int clientfd_discard_record(struct clientfds *cf, uid_t uid, int sock, const char *errmsg,
                            clientfd_discard_fn *done, void *ctx) {
        struct cf_take *t = calloc(1, sizeof(*t));
        int r;

        if (!t)
                return -ENOMEM;
        t->op = CF_OP_DISCARD;
        t->uid = uid;
        t->fd = -1;
        t->discarded = done;
        t->ctx = ctx;
        snprintf(t->errmsg, sizeof(t->errmsg), "%s", errmsg);
        t->pidfd = fcntl(sock, F_DUPFD_CLOEXEC, 3);
        if (t->pidfd < 0) {
                r = -errno;
                free(t);
                return r;
        }
        clientfds_charge_held(cf, uid, 1);
        return take_start(cf, t, 1, NULL);
}
