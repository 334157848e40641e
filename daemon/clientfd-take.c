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
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "clientfd-internal.h"
#include "record.h"
#include "errors.h"
#include "log.h"

#ifndef SO_PEERPIDFD
#define SO_PEERPIDFD 77 /* Linux 6.5 */
#endif
#ifndef SYS_pidfd_getfd
#define SYS_pidfd_getfd 438 /* Linux 5.6, the same number on every architecture */
#endif
#ifndef SYS_pidfd_send_signal
#define SYS_pidfd_send_signal 424
#endif

/* PIDFD_GET_INFO (Linux 6.13), declared here for older headers: the
 * process's ids, read through the pidfd, so with no pid to race with. */
struct take_pidfd_info {
        uint64_t mask;
        uint64_t cgroupid;
        uint32_t pid, tgid, ppid;
        uint32_t ruid, rgid, euid, egid, suid, sgid, fsuid, fsgid;
        int32_t exit_code;
        uint32_t coredump_mask;
        uint32_t spare;
};
#define TAKE_PIDFD_INFO_CREDS (1ULL << 1)
#define TAKE_PIDFD_GET_INFO _IOWR(0xFF, 11, struct take_pidfd_info)

/* The ids a process has: real, effective, saved, filesystem. */
struct take_ids {
        uint32_t uid[4], gid[4];
};

/* Reads the ids of the process behind `pidfd` with PIDFD_GET_INFO.
 * Returns 0, -ENOTTY where the kernel lacks it, -ESRCH once it is gone. */
static int ids_from_pidfd(int pidfd, struct take_ids *ret) {
        struct take_pidfd_info info = { .mask = TAKE_PIDFD_INFO_CREDS };

        if (ioctl(pidfd, TAKE_PIDFD_GET_INFO, &info) < 0)
                return errno == EINVAL || errno == ENOTTY ? -ENOTTY : -errno;
        if (!(info.mask & TAKE_PIDFD_INFO_CREDS))
                return -ENOTTY;
        *ret = (struct take_ids){ .uid = { info.ruid, info.euid, info.suid, info.fsuid },
                                  .gid = { info.rgid, info.egid, info.sgid, info.fsgid } };
        return 0;
}

/* Reads the ids from /proc/PID/status (kernels before 6.13). The pid comes
 * from the pidfd's fdinfo; the pidfd is asked afterwards whether its
 * process still lives: if so, the pid was not reused in between and the
 * lines read are its. Returns 0, -ESRCH, or -EIO. */
static int ids_from_proc(int pidfd, struct take_ids *ret) {
        char path[64], line[256];
        int pid = -1, got = 0;
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
        while (fgets(line, sizeof(line), f))
                if (sscanf(line, "Uid: %u %u %u %u", &ret->uid[0], &ret->uid[1], &ret->uid[2],
                           &ret->uid[3]) == 4)
                        got |= 1;
                else if (sscanf(line, "Gid: %u %u %u %u", &ret->gid[0], &ret->gid[1], &ret->gid[2],
                                &ret->gid[3]) == 4)
                        got |= 2;
        fclose(f);
        if (syscall(SYS_pidfd_send_signal, pidfd, 0, NULL, 0) < 0)
                return -ESRCH;
        return got == 3 ? 0 : -EIO;
}

/* Whether the process still has the ids it connected with: a client that
 * started a set-id program with the socket inherited must not have the
 * daemon take that program's fds. */
static int take_check_ids(struct cf_take *t) {
        struct take_ids ids;
        int r = ids_from_pidfd(t->pidfd, &ids);

        if (r == -ENOTTY)
                r = ids_from_proc(t->pidfd, &ids);
        if (r == -ESRCH)
                return errmsg_set(t->errmsg, -ESRCH,
                                  "fd %d of pid %d: the process that connected this session has exited",
                                  t->number, (int)t->pid);
        if (r < 0)
                return errmsg_set(t->errmsg, r, "fd %d of pid %d: reading the process's ids: %s", t->number,
                                  (int)t->pid, strerror(-r));
        for (int i = 0; i < 4; i++)
                if (ids.uid[i] != t->uid || ids.gid[i] != t->gid)
                        return errmsg_set(t->errmsg, -ERROR_KIND_PERMISSION_DENIED,
                                          "fd %d of pid %d: the process's user/group ids (uid %u %u %u %u, "
                                          "gid %u %u %u %u) are no longer the uid %u gid %u it connected "
                                          "with: nothing is taken from it",
                                          t->number, (int)t->pid, ids.uid[0], ids.uid[1], ids.uid[2],
                                          ids.uid[3], ids.gid[0], ids.gid[1], ids.gid[2], ids.gid[3],
                                          (unsigned)t->uid, (unsigned)t->gid);
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

void clientfd_take_run(struct cf_take *t) {
        if (t->discard) {
                discard_run(t);
                return;
        }
        int fd = (int)syscall(SYS_pidfd_getfd, t->pidfd, t->number, 0);
        int e = errno;

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
                close(t->pidfd);
                t->pidfd = -1;
                return;
        }
        t->error = take_check_ids(t);
        /* On a closer thread, this close may block like any close of a
         * client's file without stalling the loop; its charge goes back in
         * clientfd_take_finish(). */
        if (t->error < 0)
                close(fd);
        else
                t->fd = fd;
        close(t->pidfd);
        t->pidfd = -1;
}

void clientfd_take_finish(struct clientfds *cf, struct cf_take *t) {
        if (t->discard) {
                clientfds_uncharge(cf, t->uid, 1); /* its duplicate of the socket is closed */
                if (!cf->takes_dropped)
                        t->discarded(t->ctx, t->len >= (long)sizeof(t->hdr) ? &t->hdr : NULL, t->len,
                                     t->errmsg);
                free(t);
                return;
        }
        /* The pidfd is closed by now; the fd stays charged when taken. */
        clientfds_uncharge(cf, t->uid, t->fd < 0 ? 2 : 1);
        /* When the daemon exits, nobody waits for the reply; the exit
         * closes the fd. */
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

/* Runs `t` (at once without a loop), or queues it; on failure undoes it:
 * its pidfd (or duplicate of a socket nothing was read from) closes at
 * once, and the `charged` fds go back. */
static int take_start(struct clientfds *cf, struct cf_take *t, uint32_t charged) {
        int r;

        if (!cf->base) {
                clientfd_take_run(t);
                clientfd_take_finish(cf, t);
                return 0;
        }
        r = clientfd_queue_take(cf, t);
        if (r < 0) {
                close(t->pidfd);
                clientfds_uncharge(cf, t->uid, charged);
                free(t);
        }
        return r;
}

int clientfd_take(struct clientfds *cf, int sock, const struct ucred *cred, int64_t number,
                  clientfd_take_fn *done, void *ctx, char *errmsg) {
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
        t->pidfd = pidfd;
        t->number = (int)number;
        t->pid = cred->pid;
        t->uid = cred->uid;
        t->gid = cred->gid;
        t->fd = -1;
        t->done = done;
        t->ctx = ctx;
        r = take_start(cf, t, 2);
        if (r < 0)
                return errmsg_set(errmsg, r, "fd %" PRId64 ": out of memory", number);
        return 0;
}

int clientfd_discard_record(struct clientfds *cf, uid_t uid, int sock, const char *errmsg,
                            clientfd_discard_fn *done, void *ctx) {
        struct cf_take *t = calloc(1, sizeof(*t));
        int r;

        if (!t)
                return -ENOMEM;
        t->discard = true;
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
        return take_start(cf, t, 1);
}
