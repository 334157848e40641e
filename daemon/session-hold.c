/* Sessions held back: not read while their uid's share of the loop is
 * spent (uids.h), or while the descriptors their next record may bring do
 * not fit yet (clientfd.h); and the records refused unread because of
 * that. See session.h. */
#include <errno.h>
#include <event2/event.h>
#include <inttypes.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "clientfd.h"
#include "log.h"
#include "messages.h"
#include "record.h"
#include "session-internal.h"
#include "session.h"

/* A record whose fds do not fit yet, while closes that would make room are
 * under way, is tried again every SESSION_FDS_RETRY_US for at most
 * SESSION_FDS_WAIT_MS; then the session ends. */
#define SESSION_FDS_RETRY_US 2000
#define SESSION_FDS_WAIT_MS 1000
/* Held sessions (throttled, or waiting for fds) are looked at again at
 * least this often. */
#define SESSION_HOLD_TICK_US 5000

/* CPU time of the loop thread, in microseconds: what handling a record
 * cost, whatever else ran on the machine meanwhile. */
uint64_t session_thread_cpu_us(void) {
        struct timespec ts;

        clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
        return (uint64_t)ts.tv_sec * 1000000u + (uint64_t)ts.tv_nsec / 1000u;
}

/* Arms the registry's timer that reads held sessions again, at most
 * SESSION_HOLD_TICK_US away. */
static void sessions_hold_arm(struct sessions *reg, uint64_t wait_us) {
        struct timeval tv;

        if (wait_us > SESSION_HOLD_TICK_US)
                wait_us = SESSION_HOLD_TICK_US;
        tv = (struct timeval){ .tv_sec = 0, .tv_usec = (suseconds_t)wait_us };
        if (!evtimer_pending(reg->ev_throttle, NULL))
                evtimer_add(reg->ev_throttle, &tv);
}

/* Stops reading `s` until `until_us` has come and its uid's share of the
 * loop has grown back (sessions_hold_cb). */
void session_hold(struct session *s, uint64_t until_us) {
        struct sessions *reg = s->reg;
        uint64_t now = uids_now_us(), wait = uid_loop_wait_us(s->uid_state, now);

        if (until_us > now && until_us - now > wait)
                wait = until_us - now;
        if (!s->uid_state->throttled && !uid_loop_ok(s->uid_state, now))
                log_debug("uid %u: its share of the loop is spent: its sessions wait %" PRIu64 " us",
                          (unsigned)s->cred.uid, wait);
        s->uid_state->throttled = true;
        s->throttled = true;
        s->hold_until_us = until_us;
        reg->throttles++;
        event_del(s->ev_read);
        TAILQ_INSERT_TAIL(&reg->throttled, s, throttle_entry);
        sessions_hold_arm(reg, wait);
}

void session_unhold(struct session *s) {
        if (!s->throttled)
                return;
        TAILQ_REMOVE(&s->reg->throttled, s, throttle_entry);
        s->throttled = false;
        if (s->uid_state)
                s->uid_state->throttled = false;
}

void sessions_hold_cb(evutil_socket_t fd, short what, void *arg) {
        struct sessions *reg = arg;
        uint64_t now = uids_now_us(), wait = UINT64_MAX;
        struct session *s, *next;

        for (s = TAILQ_FIRST(&reg->throttled); s; s = next) {
                next = TAILQ_NEXT(s, throttle_entry);
                if (now < s->hold_until_us || !uid_loop_ok(s->uid_state, now)) {
                        uint64_t w = uid_loop_wait_us(s->uid_state, now);

                        if (now < s->hold_until_us && s->hold_until_us - now > w)
                                w = s->hold_until_us - now;
                        wait = w < wait ? w : wait;
                        continue;
                }
                session_unhold(s);
                session_resume(s);
        }
        if (wait != UINT64_MAX)
                sessions_hold_arm(reg, wait);
}

/* A record whose fds did not fit was dropped unread (clientfd.h): refused
 * as its framing would have been (a record of zero bytes reads as the end,
 * descriptors its type may not carry are ERROR_BAD_FDS and end the
 * session), else with ERROR_LIMIT_EXCEEDED, and the session reads on. */
static void session_discarded(void *ctx, const struct moeep_record_header *hdr, long len,
                              const char *errmsg) {
        struct session *s = ctx;
        uint64_t rid = hdr && hdr->magic == MOEEP_RECORD_MAGIC ? hdr->request_id : 0;
        int expected = hdr ? moeep_record_fds_expected(hdr->type) : 0;

        if (s->state == SESSION_CLOSED) {
                session_unref(s);
                return;
        }
        if (len <= 0)
                session_fail(s, 0, 0, len == 0 ? "peer closed the connection" : "receiving: %s",
                             strerror((int)-len));
        else if (!hdr || hdr->magic != MOEEP_RECORD_MAGIC)
                session_fail(s, MOEEP__V1__ERROR_CODE__ERROR_BAD_RECORD, 0, "bad record: %s",
                             hdr ? "bad magic" : "record shorter than its header");
        else if (hdr->nfds > MOEEP_RECORD_MAX_FDS || (expected >= 0 && hdr->nfds != expected) ||
                 (expected == MOEEP_FDS_ONE_OR_NONE && hdr->nfds > 1))
                session_fail(s, MOEEP__V1__ERROR_CODE__ERROR_BAD_FDS, rid,
                             "bad record: %" PRIu16 " descriptors on a record of type %" PRIu16
                             ", dropped unread: %s",
                             hdr->nfds, hdr->type, errmsg);
        else {
                log_info("session %" PRIu64 " (pid %d uid %u): request %" PRIu64 " refused unread: %s", s->id,
                         (int)s->cred.pid, (unsigned)s->cred.uid, rid, errmsg);
                session_send_error(s, rid, MOEEP__V1__ERROR_CODE__ERROR_LIMIT_EXCEEDED, errmsg);
                session_resume(s);
        }
        session_unref(s);
}

int session_read_admitted(struct session *s) {
        char errmsg[ERRMSG_MAX];
        int r;

        /* A record may bring up to 253 fds: read only while they fit its
         * uid's cap and the daemon's budget, or when it brings none. While
         * closes that would make room are under way, it waits a moment; a
         * uid whose fds do not close (its own FUSE server) gets nothing
         * more. */
        r = clientfds_read_check(s->reg->clientfds, s->cred.uid, s->fd, errmsg);
        if (r == -EAGAIN && s->uid_state) {
                uint64_t now = uids_now_us();

                if (!s->fds_wait_since_us)
                        s->fds_wait_since_us = now;
                if (now - s->fds_wait_since_us < SESSION_FDS_WAIT_MS * 1000u) {
                        session_hold(s, now + SESSION_FDS_RETRY_US);
                        return 0;
                }
        }
        s->fds_wait_since_us = 0;
        /* Refused unread: a closer drops it, its fds never taken, and the
         * session goes on once that is done (session_discarded()). */
        if (r < 0) {
                session_ref(s);
                session_pause(s);
                if (clientfd_discard_record(s->reg->clientfds, s->cred.uid, s->fd, errmsg, session_discarded,
                                            s) < 0) {
                        session_resume(s);
                        session_unref(s);
                        session_fail(s, MOEEP__V1__ERROR_CODE__ERROR_LIMIT_EXCEEDED, 0, "%s", errmsg);
                }
                return 0;
        }
        return 1;
}
