/* Descriptors that clients send; see clientfd.h. This file charges them to
 * their uids and closes them on the closer threads; clientfd-check.c checks
 * that an fd is of the kind a client says. */
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

#include "clientfd-internal.h"
#include "config.h"
#include "log.h"
#include "record.h"

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
                if (job->take)
                        clientfd_take_run(job->take); /* may wait on the client's execve() */
                else
                        close(job->fd); /* may block for as long as the sender arranged */
                took = now_ms() - t0;
                job_cost = job->cost;

                pthread_mutex_lock(&cf->lock);
                if (job->take)
                        TAILQ_INSERT_TAIL(&cf->takes_done, job->take, entry);
                free(job);
                u->busy = false;
                u->done += job_cost != CF_QUICK && job_cost != CF_TAKE;
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
        /* Outside the lock: the callbacks charge, close and reply. */
        while ((t = TAILQ_FIRST(&takes))) {
                TAILQ_REMOVE(&takes, t, entry);
                clientfd_take_finish(cf, t);
        }
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

/* Appends `job` to `u`'s queue and wakes a closer (starting one when none
 * is idle). */
static void job_push(struct clientfds *cf, struct cf_uid *u, struct cf_job *job) {
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
        job->take = NULL;
        u->closing += cost != CF_QUICK;
        job_push(cf, u, job);
}

int clientfd_queue_take(struct clientfds *cf, struct cf_take *t) {
        struct cf_uid *u = uid_get(cf, t->uid);
        struct cf_job *job = malloc(sizeof(*job));

        if (!u || !job) {
                free(job);
                return -ENOMEM;
        }
        job->fd = -1;
        job->cost = CF_TAKE;
        job->take = t;
        job_push(cf, u, job);
        return 0;
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
        TAILQ_INIT(&cf->takes_done);
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
        struct cf_take *t;
        struct cf_uid *u;
        bool stuck = false;

        if (!cf)
                return;
        /* The sessions that asked for takes are gone by now. */
        cf->takes_dropped = true;
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
                        if (job->take) /* never run: its caller is gone with the loop */
                                close(job->take->pidfd);
                        free(job->take);
                        free(job);
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
        pthread_cond_destroy(&cf->settled);
        pthread_cond_destroy(&cf->wake);
        pthread_mutex_destroy(&cf->lock);
        free(cf);
}
