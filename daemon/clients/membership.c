/* A rank's lifecycle at this daemon; see membership.h. */
#include <errno.h>
#include <inttypes.h>

#include "clients/membership.h"
#include "clients/session.h"
#include "datapath/datapath.h"
#include "errors.h"
#include "log.h"
#include "mesh/mesh-jobs.h"
#include "mesh/mesh.h"
#include "state/broker.h"
#include "state/job.h"

void membership_join_failed(struct session *s) {
        if (s->uid_state)
                uid_join_failed(s->uid_state, uids_now_us());
}

int membership_join(const struct membership *ms, struct session *s, uint64_t rid,
                    const Moeep__V1__JobJoin *jj, char *errmsg) {
        const char *here = mesh_address(ms->mesh);
        char home[JOB_NODE_MAX + 1];
        struct job_member *m;
        bool forwarded;
        int r;

        if (s->member)
                return errmsg_set(errmsg, -ERROR_KIND_ALREADY_IN_JOB,
                                  "session %" PRIu64 " is already rank %" PRIu32 " of job %" PRIu64, s->id,
                                  s->member->rank, s->member->job->id);
        /* Secrets are 256 bits, so guessing is hopeless; still, a uid that
         * keeps naming jobs it may not join is slowed down and logged. */
        if (s->uid_state && uid_join_allowed(s->uid_state, uids_now_us()) < 0)
                return errmsg_set(errmsg, -ERROR_KIND_LIMIT_EXCEEDED,
                                  "uid %u named too many jobs it may not join (an unknown id or a wrong "
                                  "secret; %d a second at most): this join was not checked, try later",
                                  (unsigned)s->cred.uid, UID_JOINS_PER_S);
        /* A job created at another daemon is joined there (mesh-jobs.c); this
         * daemon named in any spelling is this daemon. */
        forwarded = job_unique_id_node(jj->unique_id.data, jj->unique_id.len, home) == 0 && home[0] &&
                    (!here || !mesh_address_is_self(ms->mesh, home));
        /* A forwarded join's answer comes later (mesh-joins.c); refused here,
         * it tested no secret (a daemon that is no peer) and counts not. */
        if (forwarded)
                return mesh_jobs_join_forward(ms->mesh_jobs, s, rid, jj, home, errmsg);
        r = jobs_join(ms->jobs, jj->unique_id.data, jj->unique_id.len, jj->rank, jj->world_size, jj->gpu_uuid,
                      s, &m, errmsg);
        if (r == -ERROR_KIND_NO_SUCH_JOB)
                membership_join_failed(s);
        if (r < 0)
                return r;
        r = membership_joined(s, rid, m);
        mesh_jobs_changed(ms->mesh_jobs, m->job);
        return r;
}

int membership_joined(struct session *s, uint64_t rid, struct job_member *m) {
        Moeep__V1__JobJoined joined = MOEEP__V1__JOB_JOINED__INIT;
        Moeep__V1__Response resp = MOEEP__V1__RESPONSE__INIT;
        int fd;

        s->member = m;
        s->state = SESSION_READY;
        log_info("session %" PRIu64 " (pid %d uid %u): joined job %" PRIu64 " as rank %" PRIu32 "/%" PRIu32
                 " gpu '%s' (%s%s%s)",
                 s->id, (int)s->cred.pid, (unsigned)s->cred.uid, m->job->id, m->rank, m->job->world_size,
                 m->gpu_uuid, job_state_to_string(m->job->state), m->job->home[0] ? ", home " : "",
                 m->job->home);

        joined.job_id = m->job->id;
        joined.world_size = m->job->world_size;
        joined.rank = m->rank;
        resp.body_case = MOEEP__V1__RESPONSE__BODY_JOB_JOINED;
        resp.job_joined = &joined;
        fd = job_control_fd(m->job);
        return session_respond(s, rid, &resp, &fd, 1);
}

int membership_register(const struct membership *ms, struct session *s, const Moeep__V1__RegionRegister *rr,
                        int *fd, uint64_t *ret_id, char *errmsg) {
        int r;

        /* The data path tells the mesh itself (with the rkey). */
        if (rr->proxy != MOEEP__V1__PROXY_ROLE__PROXY_ROLE_NONE)
                return datapath_region_register(ms->datapath, ms->broker, s->member, s->cred.uid, rr, fd,
                                                ret_id, errmsg);
        r = broker_register(ms->broker, s->member, s->cred.uid, rr->kind, rr->size, rr->tag, *fd, ret_id,
                            errmsg);
        if (r < 0)
                return r;
        *fd = -1; /* the broker owns it now */
        mesh_jobs_region_changed(ms->mesh_jobs, s->member, *ret_id, rr->tag, (uint32_t)rr->kind, rr->size,
                                 false, 0, NULL);
        return 0;
}

int membership_release(const struct membership *ms, struct session *s, uint64_t id, char *errmsg) {
        int r = datapath_region_release(ms->datapath, s->member, id, errmsg);

        if (r == 0)
                r = broker_release(ms->broker, s->member, id, errmsg);
        if (r < 0)
                return r;
        mesh_jobs_region_changed(ms->mesh_jobs, s->member, id, 0, 0, 0, true, 0, NULL);
        return 0;
}

void membership_end(const struct membership *ms, struct session *s, bool lost, const char *reason) {
        if (!s->member)
                return;
        datapath_member_gone(ms->datapath, s->member);
        broker_drop_member(ms->broker, s->member);
        mesh_jobs_member_gone(ms->mesh_jobs, s->member, lost, reason);
        if (lost)
                job_member_lost(s->member, reason);
        else
                job_member_leave(s->member);
        s->member = NULL;
        if (!lost)
                s->state = SESSION_HELLO;
}
