/* The request layer: what a client's records mean. The protocol's one
 * table (proto/messages.def) says, for each request type, its name,
 * whether it needs a job, the feature bit its Hello must have offered and
 * whether only the admin socket may send it; requests.c adds the handler of
 * each. requests_dispatch() checks those and calls the handler, which
 * queues its reply or returns -errno (an error kind for a refusal,
 * errors.h) with a message that the dispatcher turns into Error. A rank's lifecycle
 * (join, regions, leave, loss) is membership.c's; the listings are
 * query.c's and the operator commands admin.c's: both fill an answer and
 * return it, and the handler here sends it.
 *
 * Who calls what: daemon.c makes the one struct requests and hands
 * requests_session_hooks() to the session registry, through which
 * session.c reaches requests_dispatch() and the end of a session;
 * requests_job_callbacks are what jobs call (barrier replies, PeerLost).
 * Upward it calls only its own hooks (the STATUS= line). */
#ifndef MOEEPD_REQUESTS_H
#define MOEEPD_REQUESTS_H

#include <stdbool.h>

#include "clients/membership.h"

struct metrics;
struct session_hooks;
struct view;

/* How the request layer reaches the daemon above it. */
struct requests_hooks {
        void *ctx; /* not owning; struct daemon */
        /* Sessions or jobs came or went: the STATUS= line may change. */
        void (*changed)(void *ctx);
};

struct requests {
        struct membership membership; /* the objects a rank's lifecycle tells; set by daemon.c */
        const struct view *view;      /* not owning; what the listings read */
        struct metrics *counters;     /* not owning; requests by type, jobs created, regions registered */
        struct requests_hooks hooks;
        bool draining; /* Drain: JobCreate is refused with ERROR_DRAINING; written by admin_drain() */
};

/* The hooks a session registry needs to hand records and ends of sessions
 * to `rq`. */
void requests_session_hooks(struct requests *rq, struct session_hooks *ret_hooks);

/* The callbacks jobs use to reach their members' sessions (the owner of
 * every local member is its struct session). */
extern const struct job_callbacks requests_job_callbacks;

#endif
