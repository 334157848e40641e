/* A FUSE filesystem served by a thread of the test process, for attacks
 * with a file whose close() blocks: one directory holding one regular file
 * "f" (4 KiB, mode 0666, allow_other). FLUSH, which every close() of an
 * fd of it sends, is answered only when it comes from the pid set with
 * fuse_stub_answer_flush_from(); from anyone else (moeepd) it is never
 * answered, so that close() hangs until fuse_stub_stop() aborts the
 * connection (or fuse_stub_hold_flushes() says otherwise). Needs root
 * (mount) and /dev/fuse. Test code only. */
#ifndef MOEEP_SECURITY_FUSE_STUB_H
#define MOEEP_SECURITY_FUSE_STUB_H

#include <sys/types.h>

/* Mounts the filesystem on `dir` (created here) and starts serving it.
 * Returns 0 or -errno (-EPERM, -ENOENT where FUSE cannot be mounted). */
int fuse_stub_start(const char *dir);

/* FLUSH from `pid` is answered (the attacker closing its own copy). */
void fuse_stub_answer_flush_from(pid_t pid);

/* From now on FLUSH from a thread of process `holder` (moeepd) is answered
 * `ms` after it came, every other FLUSH at once: the daemon's close of a
 * file of this filesystem then takes `ms`, and no signal shortens it (FUSE
 * waits for FLUSH's answer uninterruptibly). holder 0: back to never
 * answering the daemon. */
void fuse_stub_hold_flushes(pid_t holder, int ms);

/* From now on POLL (what epoll_ctl ADD and poll() of a file of this
 * filesystem send, with the epoll fd's mutex held in epoll_ctl's case) is
 * answered `ms` after it came, no events ready; 0: at once, with ENOSYS
 * (the default, after which the kernel sends no POLL again). */
void fuse_stub_hold_polls(int ms);

/* The /dev/fuse fd: a forked child closes it, so that only the server's
 * thread holds the device and fuse_stub_stop() can abort the connection. */
int fuse_stub_device(void);

/* FLUSH requests left unanswered so far. */
int fuse_stub_stuck_flushes(void);

/* Unmounts and aborts the connection: every hung close() returns. Safe to
 * call when not started or twice. */
void fuse_stub_stop(void);

#endif
