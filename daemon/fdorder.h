/* The order a dying moeepd's sockets close in. When a process is killed,
 * the kernel releases its files in the reverse order of their numbers
 * (each release is queued as task work, which runs last in, first out),
 * and releasing the CUDA driver's files (the cuda transport's context and
 * memory) takes 20-30 ms on an H100 host. A socket numbered below those
 * files closes that much later than one numbered above them, and a peer
 * daemon learns of the death that much later (measured: 22-28 ms against
 * 0.3 ms; docs/reliability.md). The mesh and the cuda transport therefore
 * keep their connections at the top of the descriptor table: every other
 * file (the driver's among them) takes the lowest free number, below. */
#ifndef MOEEPD_FDORDER_H
#define MOEEPD_FDORDER_H

/* The first number of the top of the table: the last eighth of
 * min(RLIMIT_NOFILE, 65536). */
int fd_top_base(void);

/* fd itself when it is at the top already, else a duplicate numbered there
 * (close-on-exec), fd then closed. One fcntl(): cheap enough for every
 * accepted connection. When no number there is free, fd stays as it is:
 * only the timing of a peer's notice depends on it. */
int fd_to_top(int fd);

#endif
