/* Descriptors that clients send: what each must be, how many the daemon
 * holds for each uid, and closing them where a stuck close() costs only
 * the client that sent the descriptor.
 *
 * A client chooses what its descriptors are, and some kinds block the
 * thread that touches them: fstat()/fstatfs()/close() of a FUSE file wait
 * for the client's FUSE server, close() of a TCP socket with SO_LINGER waits
 * for the linger time, and closing the last reference to a socket whose
 * receive queue holds such descriptors closes those too. So:
 *
 *   - clientfd_check() decides whether an fd is of the kind its record
 *     declares using only calls that never reach a client-controlled
 *     filesystem, driver or lock (fcntl, statx with AT_STATX_DONT_SYNC,
 *     fstatfs of an anonymous inode, and /proc/self/fdinfo only of an fd
 *     proved a dma-buf: the kernel writes another file's fdinfo under that
 *     file's locks, an epoll fd's mutex among them), in the order that
 *     proves each later call safe before it is made; and even so it runs
 *     off the loop, in the uid's queue of checks on a checker thread
 *     (clientfd_check_async()) or after a take on a closer
 *     (clientfd_take()), so that a wait nobody foresaw stalls only the uid
 *     that sent the descriptor;
 *   - what a registration does with a checked fd that takes long (a
 *     transport pinning its memory) runs in the same queue of checks
 *     (clientfd_run()): checkers are a pool of their own, so that neither
 *     closes that never return nor another uid's registrations hold it
 *     up, and each uid has a bounded number of checks and runs waiting;
 *   - clientfd_close() hands an fd to closer threads. Each uid has its
 *     own queues, each served by at most one closer at a time, and a
 *     closer is started whenever work waits and none is idle, so a close
 *     that never returns stalls only the uid that sent the descriptor,
 *     whatever the number of such uids (clientfd-internal.h has the
 *     bounds); its pending closes stay charged to that uid until they
 *     finish. A timer ends every wait a signal can end (SO_LINGER);
 *   - every fd the daemon holds for a uid (its regions, duplicates queued
 *     in unsent replies, received fds not yet handled, its jobs' control
 *     pages, and closes still pending, session sockets included) is
 *     charged to it and capped by max_fds_per_uid (its open sessions have
 *     max_sessions_per_uid); all uids together, open sessions included,
 *     stay below RLIMIT_NOFILE less a reserve, so accept() and the
 *     operator's path keep working: a record that may bring descriptors
 *     (up to 253) is read only while they fit (clientfds_read_check());
 *   - the client socket takes no descriptors before Welcome (SO_PASSRIGHTS,
 *     Linux 6.16+), so that a connection the daemon turns away closes at
 *     once, whatever its uid.
 *
 * Charges are made and returned on the event-loop thread only. */
#ifndef MOEEPD_CLIENTFD_H
#define MOEEPD_CLIENTFD_H

#include <stdbool.h>
#include <stdint.h>
#include <sys/socket.h>
#include <sys/types.h>

#include "record.h" /* MOEEP_RECORD_RECV_FDS */

struct config;
struct event_base;
struct clientfds;

/* What a region's fd is, as RegionRegister says: the protocol's
 * RegionKind, value for value (requests.c translates it). */
enum region_kind {
        REGION_KIND_UNSPECIFIED = 0, /* refused */
        REGION_KIND_CUMEM_FD = 1,    /* cuMemExportToShareableHandle(POSIX_FILE_DESCRIPTOR) */
        REGION_KIND_DMABUF = 2,      /* cuMemGetHandleForAddressRange(DMA_BUF_FD) */
        REGION_KIND_MEMFD = 3,       /* memfd_create, host memory */
};

/* Descriptors kept out of the clients' reach: the listening sockets, the
 * operator's sessions (16), mesh connections (64 authenticating, the
 * peers), metrics connections (32) and the libraries' own (192 in all),
 * and room for one record whose header understates its descriptors
 * (MOEEP_RECORD_RECV_FDS): at least this many, or an eighth of
 * RLIMIT_NOFILE. */
#define CLIENTFDS_RESERVE_MIN (192 + MOEEP_RECORD_RECV_FDS)

/* Starts the closer machinery. With `base` NULL every close happens at once
 * on the caller's thread (unit tests of code that takes fds). Reads
 * RLIMIT_NOFILE to size the reserve. Returns 0, -ENOMEM or -errno. */
int clientfds_new(struct event_base *base, const struct config *config, struct clientfds **ret_clientfds);

/* Waits up to `timeout_ms` for the pending closes, then frees everything;
 * closer threads still stuck in close() are left to the process's exit.
 * Accepts NULL. */
void clientfds_free(struct clientfds *cf, int timeout_ms);

/* Waits up to `timeout_ms` until no close is pending and the charges of
 * finished closes are returned. Returns 0, or -ETIMEDOUT. */
int clientfds_settle(struct clientfds *cf, int timeout_ms);

/* Charges `n` fds to `uid` when both its cap (max_fds_per_uid) and the
 * daemon-wide budget allow; -EDQUOT (uid cap) or -EMFILE (budget) with
 * errmsg naming the numbers otherwise. */
int clientfds_charge(struct clientfds *cf, uid_t uid, uint32_t n, char *errmsg);

/* Charges fds the daemon already holds (received with a record), beyond
 * any cap: they are owed until closed. */
void clientfds_charge_held(struct clientfds *cf, uid_t uid, uint32_t n);

/* Returns a charge for fds the daemon closed itself (or never kept). */
void clientfds_uncharge(struct clientfds *cf, uid_t uid, uint32_t n);

/* What `uid` is charged now, pending closes included. */
uint32_t clientfds_held(const struct clientfds *cf, uid_t uid);

/* Closes `fd`, charged to `uid`, off the event-loop thread; the charge is
 * returned once close() came back. Accepts -1 (does nothing). */
void clientfd_close(struct clientfds *cf, uid_t uid, int fd);

/* Whether a new session of `uid` is taken: -EDQUOT (errmsg says why) once
 * it holds more than max_fds_per_uid while one of its closes has been
 * stuck for a while, which only closes that block (its own FUSE server)
 * make happen. */
int clientfds_closing_check(struct clientfds *cf, uid_t uid, char *errmsg);

/* Whether the next record on the session socket `sock` of `uid` may be
 * read: 0 while the up to 253 descriptors it may bring fit the uid's cap
 * and the daemon's budget, or when it brings none or as many as its header
 * says and those fit (a peek tells, without taking them); else -EDQUOT
 * (the uid's cap, its closes pending) or -EMFILE (the budget), with
 * errmsg: the session is then ended without the record being read; or
 * -EAGAIN (errmsg filled as well) while closes that would make room are
 * under way and not stuck (the caller tries again a moment later). A
 * record whose header understates its descriptors is refused once read;
 * one such fits in the reserve. */
int clientfds_read_check(struct clientfds *cf, uid_t uid, int sock, char *errmsg);

/* A client session socket was accepted: it counts against the daemon-wide
 * budget (not the uid's cap) until clientfd_close_session() with
 * CLIENTFD_SESSION_COUNTED. */
void clientfds_session_opened(struct clientfds *cf);

/* Flags of clientfd_close_session(). */
enum {
        CLIENTFD_SESSION_COUNTED = 1u << 0, /* clientfds_session_opened() counted it */
        CLIENTFD_SESSION_NO_FDS = 1u << 1,  /* its peer could send it no fds (SO_PASSRIGHTS off) */
};

/* Closes the socket `fd` of a session of `uid` without blocking the loop:
 * shuts it down, then closes it at once when it cannot hold fds, else in
 * `uid`'s own queue of sockets, charged to it until closed: whatever the
 * peer left queued on it unread is released with it. */
void clientfd_close_session(struct clientfds *cf, uid_t uid, int fd, unsigned flags);

/* Whether `n` more descriptors fit the daemon-wide budget: 0, or -EMFILE
 * with errmsg naming the numbers. */
int clientfds_budget_check(const struct clientfds *cf, uint32_t n, char *errmsg);

/* Checks that `fd` is what a region of `kind` declared to be `size` bytes
 * must be (on a closer: through clientfd_check_async() or clientfd_take();
 * the event loop never calls it on a client's fd):
 *   memfd    F_GET_SEALS works (shmem only) and the inode lives where the
 *            daemon's own memfds live; at least `size` bytes
 *   cumem-fd a character device with the NVIDIA control device's number
 *            (what cuMemExportToShareableHandle gives)
 *   dma-buf  an anonymous inode whose filesystem is dma-buf's (fstatfs);
 *            then, and only then, its fdinfo is read: at least `size`
 *            bytes by its first "size:" line
 * and never an O_PATH fd. Returns 0, -ERROR_KIND_BAD_FDS for an fd of
 * another kind (errmsg names what it is), -ERROR_KIND_INVALID_ARGUMENT for
 * a size beyond the buffer or an unknown kind (error kinds: errors.h). */
int clientfd_check(const struct clientfds *cf, int fd, enum region_kind kind, uint64_t size, char *errmsg);

/* What a finished take or check hands back, on the loop: `fd` >= 0 (owned
 * by the callee now, charged to the uid, of the kind asked and at least
 * the size: clientfd_check()), or -1 with `error` (-errno, or
 * -ERROR_KIND_*) and `errmsg` saying why (a take's: naming the fd number);
 * a refused fd was handed to clientfd_close(). */
typedef void clientfd_take_fn(void *ctx, int fd, int error, const char *errmsg);

/* Checks `fd`, which `uid` attached (charged to it: its receiver did), as
 * a region of `kind` and `size` with clientfd_check() on a checker, in
 * `uid`'s own queue of checks: behind nobody else's work, and behind none
 * of its uid's closes and takes, which may never return.
 * From this call on `fd` is the check's: `done` gets it back, or -1 once
 * it was refused. `done` is called later on the loop, exactly once (with
 * `base` NULL: before this returns). Returns 0, or with errmsg
 * -ERROR_KIND_LIMIT_EXCEEDED (`uid` has CF_CHECKS_QUEUED_MAX checks and
 * runs waiting: clientfd-internal.h) or -ENOMEM (then `fd` is still the
 * caller's and `done` is never called). */
int clientfd_check_async(struct clientfds *cf, uid_t uid, int fd, enum region_kind kind, uint64_t size,
                         clientfd_take_fn *done, void *ctx, char *errmsg);

/* Work on the loop's behalf, with its context (clientfd_run()). */
typedef void clientfd_run_fn(void *ctx);

/* Does what a request of `uid` asked that takes long but waits for
 * nothing the client controls (datapath.c: a transport pinning or mapping
 * a region's memory): `run(ctx)` on a checker, in `uid`'s queue of checks
 * (clientfd_check_async()), so that it delays only that uid's checks and
 * runs; then `done(ctx)` on the loop, exactly once (with `base` NULL: both
 * before this returns), unless clientfds_free() began first (the daemon
 * exits: `done` is not called then, nor `run` if it had not begun). `run`
 * may not log, nor touch what the loop owns. Returns 0, or with errmsg
 * -ERROR_KIND_LIMIT_EXCEEDED (`uid` has CF_CHECKS_QUEUED_MAX checks and
 * runs waiting) or -ENOMEM; then neither is called. */
int clientfd_run(struct clientfds *cf, uid_t uid, clientfd_run_fn *run, clientfd_run_fn *done, void *ctx,
                 char *errmsg);

/* Takes descriptor `number` of the process that connected the session
 * socket `sock` (credentials `cred`, SO_PEERCRED) with pidfd_getfd(), for
 * RegionRegister.take. The process is named by SO_PEERPIDFD (Linux 6.5+),
 * so a recycled pid cannot stand in for it; after the take, its user and
 * group ids (real, effective, saved, filesystem) must still be cred's, so
 * that nothing is taken from a set-id program the client started on the
 * connection; what was taken must be a region of `kind` and `size`
 * (clientfd_check(), there too). The descriptor and the pidfd are charged
 * to cred->uid before it is taken (the pidfd's charge goes when it is
 * closed).
 * pidfd_getfd() waits for an execve() in progress in the client (its
 * exec_update_lock), which a client can make last as long as it likes (a
 * close-on-exec FUSE file), so the take runs in the uid's own closer
 * queue: it stalls only that uid. `done` is called later on the loop,
 * exactly once (with `base` NULL: before this returns). Returns 0, or
 * -errno with errmsg (then `done` is never called):
 * -ERROR_KIND_INVALID_ARGUMENT for a number outside 0..INT_MAX, -EOPNOTSUPP where the kernel lacks SO_PEERPIDFD,
 * -ESRCH when the connecting process is gone, -EDQUOT/-EMFILE for the
 * caps. What `done` may get: -ERROR_KIND_BAD_FDS (nothing open at
 * `number`, or an fd not of `kind`), -ERROR_KIND_INVALID_ARGUMENT (smaller
 * than `size`), -ESRCH
 * (the process exited), -ERROR_KIND_PERMISSION_DENIED (the daemon may not
 * ptrace the client: CAP_SYS_PTRACE missing, or the process's ids
 * changed). */
int clientfd_take(struct clientfds *cf, int sock, const struct ucred *cred, int64_t number,
                  enum region_kind kind, uint64_t size, clientfd_take_fn *done, void *ctx, char *errmsg);

/* What a discard hands back, on the loop: the record read and dropped, its
 * length `len` (0: a record of zero bytes, or the end; -errno: nothing
 * was read) and its header (`hdr` NULL when the record is shorter than
 * one), and the errmsg given to clientfd_discard_record(). */
typedef void clientfd_discard_fn(void *ctx, const struct moeep_record_header *hdr, long len,
                                 const char *errmsg);

/* Reads the next record queued on session socket `sock` of `uid` and drops
 * it, its descriptors released without ever being taken: for a record
 * that may not be read (clientfds_read_check()), so that it can be
 * refused with an Error while the session goes on. Releasing what a client
 * sent can wait (a socket lingering with SO_LINGER), so it happens in the
 * uid's queue of sockets, under its closer's timer; `sock` is duplicated
 * for it (charged to `uid` until closed). The caller reads nothing more
 * from `sock` until `done` (called later on the loop, exactly once, with
 * `errmsg` copied; with `base` NULL: before this returns). Returns 0 or
 * -errno. */
int clientfd_discard_record(struct clientfds *cf, uid_t uid, int sock, const char *errmsg,
                            clientfd_discard_fn *done, void *ctx);

/* A short name of a region kind ("memfd", "cumem-fd", "dma-buf"). */
const char *clientfd_kind_to_string(enum region_kind kind);

#endif
