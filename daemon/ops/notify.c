/* systemd notification; see notify.h. */
#include <errno.h>
#include <event2/event.h>
#include <inttypes.h>
#include <systemd/sd-daemon.h>

#include "log.h"
#include "ops/notify.h"

static void notify_watchdog_cb(evutil_socket_t fd, short what, void *arg) {
        sd_notify(0, "WATCHDOG=1");
}

int notify_watchdog_start(struct notify *n, struct event_base *base) {
        uint64_t usec = 0;

        /* Ping at half the interval systemd expects, as sd_watchdog_enabled(3)
         * recommends. */
        if (sd_watchdog_enabled(0, &usec) > 0 && usec > 0) {
                struct timeval tv = { .tv_sec = (time_t)(usec / 2 / 1000000),
                                      .tv_usec = (suseconds_t)(usec / 2 % 1000000) };

                n->ev_watchdog = event_new(base, -1, EV_PERSIST, notify_watchdog_cb, n);
                if (!n->ev_watchdog || event_add(n->ev_watchdog, &tv) < 0)
                        return -ENOMEM;
                log_info("watchdog: pinging every %" PRIu64 " ms", usec / 2000);
        }
        return 0;
}

void notify_ready(void) {
        sd_notify(0, "READY=1");
}

void notify_stopping(void) {
        sd_notify(0, "STOPPING=1\nSTATUS=shutting down");
}

void notify_status(struct notify *n, uint32_t sessions, uint32_t jobs) {
        if (n->sent && n->sessions == sessions && n->jobs == jobs)
                return;
        n->sent = true;
        n->sessions = sessions;
        n->jobs = jobs;
        sd_notifyf(0, "STATUS=%" PRIu32 " sessions, %" PRIu32 " jobs", sessions, jobs);
}

void notify_done(struct notify *n) {
        if (n->ev_watchdog)
                event_free(n->ev_watchdog);
        n->ev_watchdog = NULL;
}
