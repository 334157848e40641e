/* What session.c and session-hold.c share. Not for any other file: the
 * rest of the daemon uses session.h. */
#ifndef MOEEPD_SESSION_INTERNAL_H
#define MOEEPD_SESSION_INTERNAL_H

#include <event2/util.h>
#include <stdint.h>

struct session;

/* CPU time of the loop thread, in microseconds: what handling a record
 * cost, whatever else ran on the machine meanwhile. */
uint64_t session_thread_cpu_us(void);

/* Stops reading `s` until `until_us` (CLOCK_MONOTONIC us; 0: now) has come
 * and its uid's share of the loop has grown back. */
void session_hold(struct session *s, uint64_t until_us);

/* Takes `s` off the held list (it closes, or is read again). */
void session_unhold(struct session *s);

/* The registry's ev_throttle: reads held sessions again when they may. */
void sessions_hold_cb(evutil_socket_t fd, short what, void *arg);

/* Before reading a record of `s`: 1 to read it, or 0 when it is not read
 * now: `s` is held (fds that would make room are being closed), or the
 * record is being refused unread (its fds released by a closer, never
 * taken; the session is paused until then), or `s` failed. */
int session_read_admitted(struct session *s);

#endif
