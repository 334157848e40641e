/* RegionRegister with `take` (FEATURE_PIDFD, protocol 1.4): the member names
 * a descriptor number in its own process instead of attaching the fd; the
 * daemon takes it (clientfd_take(): SO_PEERPIDFD, pidfd_getfd, off the
 * loop) and registers it exactly like an attached one (membership_register:
 * the kind checks, the caps, the peers' fetches). The session reads nothing
 * more until the reply is queued. */
#ifndef MOEEPD_REGION_TAKE_H
#define MOEEPD_REGION_TAKE_H

#include <stdint.h>

#include "moeep.pb-c.h"

struct membership;
struct metrics;
struct session;

/* Starts the take for request `rid` of `s` (a job member), to be
 * registered through `ms` and counted in `counters`; the reply
 * (RegionRegistered or Error naming the fd number) is queued once the take
 * finished. Returns 0 (nothing more for the caller to send), or -errno
 * with errmsg when it could not start (no fd taken, the session reads on). */
int region_take_start(const struct membership *ms, struct metrics *counters, struct session *s, uint64_t rid,
                      const Moeep__V1__RegionRegister *rr, char *errmsg);

#endif
