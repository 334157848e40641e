/* What the daemon keeps per client uid besides its descriptors
 * (clientfd.h): how many client sessions it has, its share of the event
 * loop's time, and the joins it got wrong. One uid can neither take more
 * than its share of the loop, however many sessions it opens (the
 * session layer stops reading its sessions while its share is spent), nor
 * try job secrets faster than a few a second (membership.c refuses its
 * joins while its allowance is spent, and says so in the log).
 *
 * An entry lives while its uid has sessions, and after that until its
 * allowances have grown back in full, so that reconnecting does not renew
 * them. Admin sessions have none: the operator is never throttled. Loop
 * thread only. */
#ifndef MOEEPD_UIDS_H
#define MOEEPD_UIDS_H

#include <stdbool.h>
#include <stdint.h>
#include <sys/queue.h>
#include <sys/types.h>

/* Loop time one uid may use, in microseconds of the loop thread's CPU: a
 * quarter of it on average, in bursts of at most 5 ms. With eight uids
 * at it at once a request of a ninth waits at most about 40 ms. */
#define UID_LOOP_SHARE_PERCENT 25
#define UID_LOOP_BURST_US 5000
/* Joins that name no job the uid may join (an unknown job id or a wrong
 * secret): 8 a second, in bursts of 32. Past that its joins are refused
 * unchecked until the allowance grows back. */
#define UID_JOINS_PER_S 8
#define UID_JOINS_BURST 32
/* Failed joins are logged at most once per this many seconds per uid. */
#define UID_JOINS_LOG_S 10

/* An allowance that grows back at a constant rate up to a burst. */
struct uid_allowance {
        int64_t credit;     /* what may still be used; below 0 after overuse */
        uint64_t at_us;     /* CLOCK_MONOTONIC us of the last refill */
        uint64_t remainder; /* refill below one unit, carried over (units * 1e6) */
};

struct client_uid {
        uid_t uid;
        uint32_t sessions;          /* client sessions connected now */
        struct uid_allowance loop;  /* us of loop CPU */
        struct uid_allowance joins; /* failed joins */
        bool throttled;             /* its sessions wait for `loop` to grow back */
        uint64_t joins_failed;      /* since the last log line about them */
        uint64_t joins_refused;     /* refused unchecked since then */
        uint64_t joins_logged_us;   /* when that line was written; 0 = never */
        LIST_ENTRY(client_uid) entry;
};

LIST_HEAD(client_uid_list, client_uid);

struct uids {
        struct client_uid_list list; /* owns */
        uint32_t count;
};

void uids_init(struct uids *u);
/* Frees every entry. */
void uids_done(struct uids *u);

/* CLOCK_MONOTONIC in microseconds. */
uint64_t uids_now_us(void);

/* The entry of `uid` with one more session counted (made with full
 * allowances when there is none), or NULL when out of memory. Frees
 * entries that have no session and nothing left to grow back. */
struct client_uid *uids_session_add(struct uids *u, uid_t uid);

/* One session of `cu` ended. Accepts NULL. */
void uids_session_remove(struct uids *u, struct client_uid *cu);

/* Whether `cu` may use the loop now (its loop allowance is positive). */
bool uid_loop_ok(struct client_uid *cu, uint64_t now_us);

/* Charges `used_us` of loop time to `cu`. */
void uid_loop_charge(struct client_uid *cu, uint64_t used_us);

/* Microseconds until `cu` may use the loop again (0: now). */
uint64_t uid_loop_wait_us(const struct client_uid *cu, uint64_t now_us);

/* Before checking a join of `cu`: 0 when it may try, or -1 when its
 * allowance of failed joins is spent (the join is then refused unchecked;
 * counted for the log). */
int uid_join_allowed(struct client_uid *cu, uint64_t now_us);

/* A join of `cu` named no job it may join: uses one of its allowance and
 * logs (at most once per UID_JOINS_LOG_S) how many it got wrong. */
void uid_join_failed(struct client_uid *cu, uint64_t now_us);

#endif
