/* systemd notification (sd_notify(3)): READY=1 once listening, STATUS=
 * with the session and job counts when they change, WATCHDOG=1 from a
 * timer at half of WatchdogSec, STOPPING=1 at shutdown. Each is a no-op
 * outside systemd (no NOTIFY_SOCKET). Owned by daemon.c, which is the only
 * caller. */
#ifndef MOEEPD_NOTIFY_H
#define MOEEPD_NOTIFY_H

#include <stdbool.h>
#include <stdint.h>

struct event;
struct event_base;

struct notify {
        struct event *ev_watchdog; /* owns; NULL without WatchdogSec */
        uint32_t sessions;         /* what the last STATUS= said, to send only changes */
        uint32_t jobs;
        bool sent;
};

/* Starts the watchdog timer when systemd asks for one. 0 or -ENOMEM. */
int notify_watchdog_start(struct notify *n, struct event_base *base);

void notify_ready(void);

/* STOPPING=1 with a last STATUS= line. */
void notify_stopping(void);

/* STATUS= with these counts, unless the last one said the same. */
void notify_status(struct notify *n, uint32_t sessions, uint32_t jobs);

/* Stops the watchdog timer. Accepts a zeroed struct. */
void notify_done(struct notify *n);

#endif
