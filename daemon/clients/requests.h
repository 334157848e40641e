/* The request layer: what a client's records mean. The protocol's one
 * table (proto/messages.def) says, for each request type, its name,
 * whether it needs a job, the feature bit its Hello must have offered and
 * whether only the admin socket may send it; requests.c adds the handler of
 * each. requests_dispatch() checks those and calls the handler, which
 * translates the message into the daemon's own terms, calls the module
 * that does the work, and queues the reply, or returns -errno (an error
 * kind for a refusal, errors.h) with a message that the dispatcher turns
 * into Error. A rank's lifecycle (create, join, barrier, regions,
 * channels, leave, loss) is membership.c's; the listings are query.c's and
 * the operator commands admin.c's: both fill an answer and return it, and
 * the handler here sends it. Protocol messages go no further down than
 * these handlers.
 *
 * Who calls what: daemon.c makes the one struct requests and hands
 * requests_dispatch() to the session registry as its dispatch callback,
 * through which session.c brings every record and the end of every
 * session. It calls nothing above it. */
#ifndef MOEEPD_REQUESTS_H
#define MOEEPD_REQUESTS_H

#include <stdbool.h>

#include "clients/membership.h"

struct metrics;
struct moeep_record;
struct session;

struct requests {
        struct membership membership; /* a rank's lifecycle (membership_init()) */
        struct metrics *metrics; /* not owning; counts requests by type, jobs created, regions registered */
};

/* The session registry's dispatch callback (session.h,
 * session_dispatch_fn), `ctx` the struct requests: handles one received
 * record, or (`rec` NULL) the end of session `s`. Returns 1 to go on
 * reading, 0 when the session failed. */
int requests_dispatch(void *ctx, struct session *s, struct moeep_record *rec, const char *why);

#endif
