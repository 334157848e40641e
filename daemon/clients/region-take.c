/* RegionRegister with `take`; see region-take.h. */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>

#include "clients/membership.h"
#include "clients/region-take.h"
#include "clients/session.h"
#include "errors.h"
#include "log.h"
#include "ops/metrics.h"
#include "state/clientfd.h"

/* One take in flight: what the request asked, and whom to answer. */
struct region_take {
        const struct membership *ms; /* not owning */
        struct metrics *counters;    /* not owning; regions_registered */
        struct session *s;           /* holds a reference until the reply */
        struct job_member *member;   /* not owning; the member that asked */
        uint64_t rid;
        int64_t number;
        Moeep__V1__RegionRegister rr; /* kind, size, tag, proxy; `take` cleared */
};

static void region_take_done(void *ctx, int fd, int error, const char *errmsg) {
        struct region_take *rt = ctx;
        struct session *s = rt->s;
        Moeep__V1__RegionRegistered registered = MOEEP__V1__REGION_REGISTERED__INIT;
        Moeep__V1__Response resp = MOEEP__V1__RESPONSE__INIT;
        char why[ERRMSG_MAX], msg[ERRMSG_MAX + 64];
        int r = error;

        session_resume(s);
        /* Gone meanwhile (the session failed; it read nothing else, so it
         * cannot have left or joined another job): the fd goes back. */
        if (s->state == SESSION_CLOSED || s->member != rt->member) {
                clientfd_close(s->reg->clientfds, s->cred.uid, fd);
                goto out;
        }
        if (fd >= 0) {
                r = membership_register(rt->ms, s, &rt->rr, &fd, &registered.region_id, why);
                /* Taken by the broker, fd is -1 now; refused, it is still
                 * ours, charged like an attached one, and closed. */
                clientfd_close(s->reg->clientfds, s->cred.uid, fd);
                if (r < 0) {
                        snprintf(msg, sizeof(msg), "fd %" PRId64 " of pid %d: %s", rt->number,
                                 (int)s->cred.pid, why);
                        errmsg = msg;
                }
        }
        /* A process gone is a descriptor that cannot be had, to the client. */
        if (r == -ESRCH)
                r = -ERROR_KIND_BAD_FDS;
        if (r < 0) {
                log_debug("session %" PRIu64 ": RegionRegister (request %" PRIu64 ", fd number %" PRId64
                          ") refused: %s",
                          s->id, rt->rid, rt->number, errmsg);
                session_send_error(s, rt->rid, error_code(r), errmsg);
                goto out;
        }
        rt->counters->regions_registered++;
        log_debug("session %" PRIu64 ": took fd %" PRId64 " of pid %d as region %" PRIu64, s->id, rt->number,
                  (int)s->cred.pid, registered.region_id);
        resp.body_case = MOEEP__V1__RESPONSE__BODY_REGION_REGISTERED;
        resp.region_registered = &registered;
        session_respond(s, rt->rid, &resp, NULL, 0);
out:
        session_unref(s);
        free(rt);
}

int region_take_start(const struct membership *ms, struct metrics *counters, struct session *s, uint64_t rid,
                      const Moeep__V1__RegionRegister *rr, char *errmsg) {
        struct region_take *rt = calloc(1, sizeof(*rt));
        int r;

        if (!rt)
                return errmsg_set(errmsg, -ENOMEM, "RegionRegister: out of memory");
        rt->ms = ms;
        rt->counters = counters;
        rt->s = s;
        rt->member = s->member;
        rt->rid = rid;
        rt->number = rr->take->fd_number;
        moeep__v1__region_register__init(&rt->rr);
        rt->rr.kind = rr->kind;
        rt->rr.size = rr->size;
        rt->rr.tag = rr->tag;
        rt->rr.proxy = rr->proxy;
        session_ref(s);
        session_pause(s);
        r = clientfd_take(s->reg->clientfds, s->fd, &s->cred, rt->number, region_take_done, rt, errmsg);
        if (r < 0) {
                session_resume(s);
                session_unref(s);
                free(rt);
        }
        return r;
}
