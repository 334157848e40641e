/* A rank's lifecycle at this daemon; see membership.h. In its order: a
 * job's creation, joins, barriers (and what jobs tell their members'
 * sessions), regions, channels, the end of a membership; then the joins
 * forwarded to another daemon and its answer. */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "clients/membership.h"
#include "clients/session.h"
#include "datapath/datapath.h"
#include "errors.h"
#include "log.h"
#include "mesh/mesh-jobs.h"
#include "mesh/mesh.h"
#include "moeep.pb-c.h"
#include "ops/metrics.h"
#include "state/broker.h"
#include "state/clientfd.h"
#include "state/job.h"

/* Forwarded joins (at the end of this file). */
static int forward_join(struct membership *ms, struct session *s, uint64_t rid,
                        const struct membership_join_args *jj, const char *home, char *errmsg);

/* ------------------------------------------------------------ create */

int membership_create(struct membership *ms, struct session *s, const char *name, uint32_t world_size,
                      struct job **ret_job, char *errmsg) {
        struct job *job;
        int r;

        if (s->reg->stopping)
                return errmsg_set(errmsg, -ERROR_KIND_DRAINING, "the daemon is shutting down: no new jobs");
        if (ms->jobs->draining)
                return errmsg_set(errmsg, -ERROR_KIND_DRAINING,
                                  "the daemon is draining: no new jobs (an admin ends it with "
                                  "'moeepctl drain --off')");
        r = jobs_create(ms->jobs, name, world_size, s->cred.uid, s, &job, errmsg);
        if (r < 0)
                return r;
        ms->metrics->jobs_created++;
        log_info("session %" PRIu64 " (uid %u): created job %" PRIu64 " '%s' of %" PRIu32 " ranks", s->id,
                 (unsigned)s->cred.uid, job->id, job->name, job->world_size);
        *ret_job = job;
        return 0;
}

size_t membership_unique_id(const struct membership *ms, const struct job *job,
                            uint8_t ret[static MOEEP_UNIQUE_ID_BYTES]) {
        return job_unique_id_with_node(job, mesh_address(ms->mesh), ret);
}

/* ------------------------------------------------------------ join */

/* A join of `s` named no job it may join (ERROR_NO_SUCH_JOB, here or at
 * the job's home daemon): counted against its uid's allowance (uids.h). */
static void join_failed(struct session *s) {
        if (s->uid_state)
                uid_join_failed(s->uid_state, uids_now_us());
}

/* `s` became member `m` (a local join, or one its job's home daemon
 * accepted): READY, and JobJoined (request `rid`) with the control page
 * queued. Returns 0 or -errno from session_respond(). */
static int joined(struct session *s, uint64_t rid, struct job_member *m) {
        Moeep__V1__JobJoined answer = MOEEP__V1__JOB_JOINED__INIT;
        Moeep__V1__Response resp = MOEEP__V1__RESPONSE__INIT;
        int fd;

        s->member = m;
        session_state_set(s, SESSION_READY);
        log_info("session %" PRIu64 " (pid %d uid %u): joined job %" PRIu64 " as rank %" PRIu32 "/%" PRIu32
                 " gpu '%s' (%s%s%s)",
                 s->id, (int)s->cred.pid, (unsigned)s->cred.uid, m->job->id, m->rank, m->job->world_size,
                 m->gpu_uuid, job_state_to_string(m->job->state), m->job->home[0] ? ", home " : "",
                 m->job->home);

        answer.job_id = m->job->id;
        answer.world_size = m->job->world_size;
        answer.rank = m->rank;
        resp.body_case = MOEEP__V1__RESPONSE__BODY_JOB_JOINED;
        resp.job_joined = &answer;
        fd = job_control_fd(m->job);
        return session_respond(s, rid, &resp, &fd, 1);
}

int membership_join(struct membership *ms, struct session *s, uint64_t rid,
                    const struct membership_join_args *j, char *errmsg) {
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
        /* A job created at another daemon is joined there; this daemon
         * named in any spelling is this daemon. */
        forwarded = job_unique_id_node(j->unique_id, j->unique_id_len, home) == 0 && home[0] &&
                    (!here || !mesh_address_is_self(ms->mesh, home));
        /* A forwarded join's answer comes later (forward_answer()); refused
         * here, it tested no secret (a daemon that is no peer) and counts
         * not. */
        if (forwarded)
                return forward_join(ms, s, rid, j, home, errmsg);
        r = jobs_join(ms->jobs, j->unique_id, j->unique_id_len, j->rank, j->world_size, j->gpu_uuid, s, &m,
                      errmsg);
        if (r == -ERROR_KIND_NO_SUCH_JOB)
                join_failed(s);
        if (r < 0)
                return r;
        r = joined(s, rid, m);
        mesh_jobs_changed(ms->mesh_jobs, m->job);
        return r;
}

/* ------------------------------------------------------------ barrier */

int membership_barrier(struct membership *ms, struct session *s, uint64_t rid, char *errmsg) {
        /* 0: the reply comes from barrier_done() (the job's callback); 1:
         * from the job's home daemon, through the mesh. */
        int r = job_barrier(s->member, rid, errmsg);

        if (r == 1) {
                mesh_jobs_barrier(ms->mesh_jobs, s->member);
                r = 0;
        }
        return r;
}

static void barrier_done(void *owner, const struct job *job, uint64_t request_id, int error) {
        struct session *s = owner;
        char why[ERRMSG_MAX];

        if (error == 0) {
                session_send_ok(s, request_id);
                return;
        }
        if (error == -ERROR_KIND_PEER_LOST)
                snprintf(why, sizeof(why), "barrier of job %" PRIu64 ": rank %" PRId32 " was lost", job->id,
                         job->lost_rank);
        else
                snprintf(why, sizeof(why), "barrier of job %" PRIu64 ": left the job while waiting", job->id);
        session_send_error(s, request_id, error_code(error), why);
}

static void peer_lost(void *owner, const struct job *job, uint32_t rank, const char *reason) {
        struct session *s = owner;
        Moeep__V1__PeerLost lost = MOEEP__V1__PEER_LOST__INIT;
        Moeep__V1__Event ev = MOEEP__V1__EVENT__INIT;

        if (s->reg->stopping) /* everybody gets Shutdown instead */
                return;
        lost.job_id = job->id;
        lost.rank = rank;
        lost.reason = (char *)reason;
        ev.body_case = MOEEP__V1__EVENT__BODY_PEER_LOST;
        ev.peer_lost = &lost;
        session_send(s, MOEEP__V1__EVENT__BODY_PEER_LOST, 0, &ev.base, NULL, 0);
}

const struct job_callbacks membership_job_callbacks = {
        .barrier_done = barrier_done,
        .peer_lost = peer_lost,
};

/* ------------------------------------------------------------ regions */

/* Queues RegionRegistered (request `rid`) for region `id`. Returns 0 or
 * -errno from session_respond(). */
static int registered(struct session *s, uint64_t rid, uint64_t id) {
        Moeep__V1__RegionRegistered answer = MOEEP__V1__REGION_REGISTERED__INIT;
        Moeep__V1__Response resp = MOEEP__V1__RESPONSE__INIT;

        answer.region_id = id;
        resp.body_case = MOEEP__V1__RESPONSE__BODY_REGION_REGISTERED;
        resp.region_registered = &answer;
        return session_respond(s, rid, &resp, NULL, 0);
}

/* One RegionRegister whose fd is being checked, or taken and checked, off
 * the loop in the uid's queue, then registered (for a proxy role, also
 * off the loop: datapath_region_register()): what the request asked, and
 * whom to answer. The session reads nothing more until it is answered. */
struct pending_region {
        struct membership *ms;     /* not owning */
        struct session *s;         /* holds a reference until the reply */
        struct job_member *member; /* not owning; the member that asked */
        uint64_t rid;
        int64_t number; /* the fd number to take; -1: the fd was attached */
        struct region_spec spec;
};

/* Answers the RegionRegister of `p` and frees it: RegionRegistered for
 * region `id`, or the Error of `r` (< 0) with `errmsg`, which names the fd
 * number of a take when the registration (`registering`) refused it; the
 * session reads on. Nobody is answered once the session failed or left
 * its job meanwhile. */
static void region_answer(struct pending_region *p, int r, uint64_t id, const char *errmsg,
                          bool registering) {
        struct session *s = p->s;
        char msg[ERRMSG_MAX + 64];

        session_resume(s);
        if (s->state == SESSION_CLOSED || s->member != p->member)
                goto out;
        if (r < 0 && registering && p->number >= 0) {
                snprintf(msg, sizeof(msg), "fd %" PRId64 " of pid %d: %s", p->number, (int)s->cred.pid,
                         errmsg);
                errmsg = msg;
        }
        /* A process gone is a descriptor that cannot be had, to the client. */
        if (r == -ESRCH)
                r = -ERROR_KIND_BAD_FDS;
        if (r < 0) {
                char what[48] = "";

                if (p->number >= 0)
                        snprintf(what, sizeof(what), ", fd number %" PRId64, p->number);
                log_debug("session %" PRIu64 ": RegionRegister (request %" PRIu64 "%s) refused: %s", s->id,
                          p->rid, what, errmsg);
                session_send_error(s, p->rid, error_code(r), errmsg);
                goto out;
        }
        p->ms->metrics->regions_registered++;
        if (p->number >= 0)
                log_debug("session %" PRIu64 ": took fd %" PRId64 " of pid %d as region %" PRIu64, s->id,
                          p->number, (int)s->cred.pid, id);
        /* Registered: a reply that cannot be queued (the session is broken
         * and fails from the loop) is no refusal. */
        registered(s, p->rid, id);
out:
        session_unref(s);
        free(p);
}

/* A proxy region's registration ended (datapath_registered_fn, on the
 * loop). */
static void region_registered(void *ctx, int error, uint64_t id, const char *errmsg) {
        region_answer(ctx, error, id, errmsg, true);
}

/* The check (or take) finished (clientfd_take_fn, on the loop): a good fd
 * is registered: at once with the broker and the mesh, or through the data
 * path for a proxy role, which answers later (region_registered()). */
static void region_checked(void *ctx, int fd, int error, const char *errmsg) {
        struct pending_region *p = ctx;
        struct membership *ms = p->ms;
        struct session *s = p->s;
        char why[ERRMSG_MAX] = "";
        uint64_t id = 0;
        int r;

        /* Gone meanwhile (the session failed; it read nothing else, so it
         * cannot have left or joined another job): the fd goes back. */
        if (s->state == SESSION_CLOSED || s->member != p->member) {
                clientfd_close(s->reg->clientfds, s->cred.uid, fd);
                region_answer(p, -ECANCELED, 0, "", false);
                return;
        }
        if (fd < 0) {
                region_answer(p, error, 0, errmsg, false);
                return;
        }
        if (p->spec.role != REGION_ROLE_NONE) {
                r = datapath_region_register(ms->datapath, ms->broker, s->member, s->cred.uid, &p->spec, &fd,
                                             region_registered, p, why);
                /* Taken by the broker, fd is -1 now; refused, it is still
                 * ours, charged to the uid, and closed. */
                clientfd_close(s->reg->clientfds, s->cred.uid, fd);
                if (r == 0)
                        return;
        } else {
                r = broker_register(ms->broker, s->member, s->cred.uid, p->spec.kind, p->spec.size,
                                    p->spec.tag, fd, &id, why);
                if (r == 0)
                        mesh_jobs_region_changed(ms->mesh_jobs, s->member, id, p->spec.tag,
                                                 (uint32_t)p->spec.kind, p->spec.size, false, 0, NULL);
                else
                        clientfd_close(s->reg->clientfds, s->cred.uid, fd);
        }
        region_answer(p, r, id, why, true);
}

/* Starts the check of `*fd` (set to -1: the check's now), or the take of
 * `number` when `fd` is NULL; the session reads nothing more until
 * region_checked() answers. Returns 0, or -errno with errmsg when it could
 * not start (the session reads on). */
static int region_check_start(struct membership *ms, struct session *s, uint64_t rid,
                              const struct region_spec *spec, int64_t number, int *fd, char *errmsg) {
        struct pending_region *p = calloc(1, sizeof(*p));
        int r;

        if (!p)
                return errmsg_set(errmsg, -ENOMEM, "RegionRegister: out of memory");
        p->ms = ms;
        p->s = s;
        p->member = s->member;
        p->rid = rid;
        p->number = fd ? -1 : number;
        p->spec = *spec;
        session_ref(s);
        session_pause(s);
        if (fd) {
                r = clientfd_check_async(s->reg->clientfds, s->cred.uid, *fd, spec->kind, spec->size,
                                         region_checked, p, errmsg);
                if (r == 0)
                        *fd = -1;
        } else {
                r = clientfd_take(s->reg->clientfds, s->fd, &s->cred, number, spec->kind, spec->size,
                                  region_checked, p, errmsg);
        }
        if (r < 0) {
                session_resume(s);
                session_unref(s);
                free(p);
        }
        return r;
}

int membership_register(struct membership *ms, struct session *s, uint64_t rid,
                        const struct region_spec *spec, int *fd, char *errmsg) {
        return region_check_start(ms, s, rid, spec, -1, fd, errmsg);
}

int membership_register_take(struct membership *ms, struct session *s, uint64_t rid,
                             const struct region_spec *spec, int64_t number, char *errmsg) {
        return region_check_start(ms, s, rid, spec, number, NULL, errmsg);
}

int membership_release(struct membership *ms, struct session *s, uint64_t id, char *errmsg) {
        int r = datapath_region_release(ms->datapath, s->member, id, errmsg);

        if (r == 0)
                r = broker_release(ms->broker, s->member, id, errmsg);
        if (r < 0)
                return r;
        mesh_jobs_region_changed(ms->mesh_jobs, s->member, id, 0, 0, 0, true, 0, NULL);
        return 0;
}

int membership_fetch(const struct membership *ms, const struct session *s, int32_t rank, int64_t tag,
                     bool remote, struct membership_region ret[MOEEP_RECORD_MAX_FDS], size_t *ret_n,
                     char *errmsg) {
        const struct job_remote_region *rr;
        struct region **found = NULL;
        uint32_t nremote = 0;
        size_t n = 0;
        int r;

        r = broker_fetch(s->member, rank, tag, MOEEP_RECORD_MAX_FDS, &found, &n, errmsg);
        if (r < 0)
                return r;
        for (size_t i = 0; i < n; i++)
                ret[i] = (struct membership_region){
                        .rank = found[i]->owner->rank,
                        .tag = found[i]->tag,
                        .kind = found[i]->kind,
                        .size = found[i]->size,
                        .region_id = found[i]->id,
                        .fd = found[i]->fd,
                };
        free(found);
        /* Ranks at other daemons: metadata only (their memory is reached
         * through the transports). */
        rr = remote ? mesh_jobs_remote_regions(s->member->job, &nremote) : NULL;
        for (uint32_t i = 0; i < nremote; i++) {
                if ((rank >= 0 ? rr[i].rank != (uint32_t)rank : rr[i].rank == s->member->rank) ||
                    (tag >= 0 && rr[i].tag != (uint64_t)tag))
                        continue;
                if (n == MOEEP_RECORD_MAX_FDS)
                        return errmsg_set(errmsg, -ERROR_KIND_LIMIT_EXCEEDED,
                                          "more than %d regions match (rank %" PRId32 ", tag %" PRId64 ")",
                                          MOEEP_RECORD_MAX_FDS, rank, tag);
                ret[n++] = (struct membership_region){
                        .rank = rr[i].rank,
                        .tag = rr[i].tag,
                        .kind = (enum region_kind)rr[i].kind,
                        .size = rr[i].size,
                        .region_id = rr[i].region_id,
                        .remote = true,
                        .fd = -1,
                };
        }
        *ret_n = n;
        return 0;
}

/* ------------------------------------------------------------ channels */

int membership_channel_open(struct membership *ms, struct session *s, uint32_t capacity, int *ret_fd,
                            uint64_t *ret_ring_id, uint32_t *ret_capacity, uint32_t *ret_routes,
                            char *errmsg) {
        int r = datapath_channel_open(ms->datapath, s->member, capacity, ret_fd, ret_ring_id, ret_capacity,
                                      errmsg);

        if (r == 0)
                *ret_routes = s->member->job->world_size;
        return r;
}

/* ------------------------------------------------------------ the end */

/* `s` leaves its job (`lost` false: JobLeave) or is lost (its session
 * failed): data path, broker, mesh, job, in that order; `s` is no longer a
 * member afterwards (HELLO after a leave). Does nothing when `s` is not a
 * member. */
static void member_end(struct membership *ms, struct session *s, bool lost, const char *reason) {
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
                session_state_set(s, SESSION_HELLO);
}

void membership_leave(struct membership *ms, struct session *s) {
        log_info("session %" PRIu64 ": left job %" PRIu64 " (rank %" PRIu32 ")", s->id, s->member->job->id,
                 s->member->rank);
        member_end(ms, s, false, "left");
}

void membership_gone(struct membership *ms, struct session *s, const char *why) {
        member_end(ms, s, true, why);
        jobs_creator_gone(ms->jobs, s);
}

/* ------------------------------------------------------------ forwarded joins */

/* A client's JobJoin forwarded to its job's home. */
struct forward {
        uint64_t token;
        struct session *session; /* holds a reference */
        uint64_t request_id;
        bool sent; /* PeerJoin is out; waiting for PeerJoined */
        char home[JOB_NODE_MAX + 1];
        uint8_t unique_id[MOEEP_UNIQUE_ID_BYTES]; /* never logged */
        size_t unique_id_len;
        uint32_t rank, world_size;
        char gpu_uuid[MOEEP_GPU_UUID_MAX + 1];
        TAILQ_ENTRY(forward) entry;
};

/* Sends the forwarded joins that wait for `p` (UP): the mesh's peer_up. */
static void forwards_flush(void *arg, struct mesh_peer *p) {
        struct membership *ms = arg;
        struct forward *j;

        TAILQ_FOREACH (j, &ms->forwards, entry) {
                Moeep__V1__PeerJoin pj = MOEEP__V1__PEER_JOIN__INIT;
                PEER_MSG(msg, join, &pj, JOIN);

                if (j->sent || strcmp(j->home, p->address) != 0)
                        continue;
                pj.token = j->token;
                pj.unique_id.data = j->unique_id;
                pj.unique_id.len = j->unique_id_len;
                pj.rank = j->rank;
                pj.world_size = j->world_size;
                pj.gpu_uuid = j->gpu_uuid;
                if (mesh_peer_send(p, &msg) == 0)
                        j->sent = true;
        }
}

static struct forward *forward_find(const struct membership *ms, uint64_t token) {
        struct forward *j;

        TAILQ_FOREACH (j, &ms->forwards, entry)
                if (j->token == token)
                        return j;
        return NULL;
}

static void forward_free(struct membership *ms, struct forward *j) {
        TAILQ_REMOVE(&ms->forwards, j, entry);
        session_unref(j->session);
        explicit_bzero(j->unique_id, sizeof(j->unique_id));
        free(j);
}

/* A forwarded join of request `request_id` failed: Error `code` with
 * `message`, unless the session is closed; a join that named no job it may
 * join counts against its uid (join_failed()). */
static void forward_failed(struct session *s, uint64_t request_id, int code, const char *message) {
        if (s->state == SESSION_CLOSED)
                return;
        if (code == MOEEP__V1__ERROR_CODE__ERROR_NO_SUCH_JOB)
                join_failed(s);
        session_send_error(s, request_id, code, message);
}

/* Fails the forwarded joins waiting for daemon `home` (it cannot be
 * reached: `why`). */
static void forwards_fail(struct membership *ms, const char *home, const char *why) {
        struct forward *j, *next;
        char msg[ERRMSG_MAX + JOB_NODE_MAX + 48];

        for (j = TAILQ_FIRST(&ms->forwards); j; j = next) {
                next = TAILQ_NEXT(j, entry);
                if (strcmp(j->home, home) != 0)
                        continue;
                snprintf(msg, sizeof(msg), "the job's daemon %s cannot be reached: %s", home, why);
                forward_failed(j->session, j->request_id, MOEEP__V1__ERROR_CODE__ERROR_NO_SUCH_JOB, msg);
                forward_free(ms, j);
        }
}

/* Forwards session `s`'s JobJoin (request `rid`) to the job's home daemon
 * `home` (from the unique id, as the client sent it), which must be one of
 * mesh_peers in some spelling: nothing else is ever dialled. Returns 0 when
 * the reply is held back (the home's answer, or the failure to reach it,
 * sends it), or an error kind (errors.h) with errmsg naming the address:
 * NO_SUCH_JOB when the mesh is off or `home` is not a configured peer,
 * INVALID_ARGUMENT when it is no address or this daemon, or when `s`
 * already waits for one; or -ENOMEM. */
static int forward_join(struct membership *ms, struct session *s, uint64_t rid,
                        const struct membership_join_args *jj, const char *home, char *errmsg) {
        char canon[JOB_NODE_MAX + 1], said[JOB_NODE_MAX + 1];
        struct forward *j;
        struct mesh_peer *p;

        mesh_claim_printable(home, said);
        if (!ms->mesh)
                return errmsg_set(
                        errmsg, -ERROR_KIND_NO_SUCH_JOB,
                        "the job was created at daemon %s, and this daemon's mesh is off (mesh_listen)",
                        said);
        if (jj->unique_id_len > MOEEP_UNIQUE_ID_BYTES || strlen(jj->gpu_uuid) > MOEEP_GPU_UUID_MAX)
                return errmsg_set(errmsg, -ERROR_KIND_INVALID_ARGUMENT,
                                  "unique id of %zu bytes or gpu uuid of %zu: too long", jj->unique_id_len,
                                  strlen(jj->gpu_uuid));
        /* The address comes from the client: it is only ever looked up
         * among the configured peers, never dialled as it is. */
        if (mesh_address_canon(home, canon) < 0)
                return errmsg_set(errmsg, -ERROR_KIND_INVALID_ARGUMENT,
                                  "the unique id names daemon '%s', which is not a mesh address", said);
        if (strcmp(canon, mesh_address(ms->mesh)) == 0)
                return errmsg_set(errmsg, -ERROR_KIND_INVALID_ARGUMENT,
                                  "the unique id names daemon '%s', which is this one (%s)", said,
                                  mesh_address(ms->mesh));
        p = mesh_configured_find(ms->mesh, canon);
        if (!p)
                return errmsg_set(errmsg, -ERROR_KIND_NO_SUCH_JOB,
                                  "the job's daemon %s (named in the unique id) is not one of this daemon's "
                                  "mesh_peers: the join is not forwarded",
                                  said);
        TAILQ_FOREACH (j, &ms->forwards, entry)
                if (j->session == s)
                        return errmsg_set(errmsg, -ERROR_KIND_INVALID_ARGUMENT,
                                          "session %" PRIu64 " already waits for a join at daemon %s", s->id,
                                          j->home);
        j = calloc(1, sizeof(*j));
        if (!j)
                return errmsg_set(errmsg, -ENOMEM, "out of memory");
        j->token = ++ms->next_token;
        j->session = s;
        session_ref(s);
        j->request_id = rid;
        snprintf(j->home, sizeof(j->home), "%s", canon);
        memcpy(j->unique_id, jj->unique_id, jj->unique_id_len);
        j->unique_id_len = jj->unique_id_len;
        j->rank = jj->rank;
        j->world_size = jj->world_size;
        snprintf(j->gpu_uuid, sizeof(j->gpu_uuid), "%s", jj->gpu_uuid);
        TAILQ_INSERT_TAIL(&ms->forwards, j, entry);
        log_info("session %" PRIu64 ": join as rank %" PRIu32 " forwarded to daemon %s", s->id, j->rank,
                 canon);
        /* A configured peer that is down is being redialled; the join
         * goes when it is up, or fails with the next failed dial. */
        p = mesh_peer_find(ms->mesh, canon);
        if (p)
                forwards_flush(ms, p);
        return 0;
}

/* The home's answer to a forwarded join (PeerJoined): the mesh's message
 * of MESH_OWNER_JOINS. */
static void forward_answer(void *arg, struct mesh_peer *p, const Moeep__V1__PeerMessage *answer) {
        struct membership *ms = arg;
        const Moeep__V1__PeerJoined *pj = answer->joined;
        struct forward *j = forward_find(ms, pj->token);
        char errmsg[ERRMSG_MAX] = "";
        struct job_member *m;
        struct session *s;
        int r;

        if (!j || strcmp(j->home, p->address) != 0) {
                log_debug("mesh: peer %s: PeerJoined for unknown token %" PRIu64, p->address, pj->token);
                return;
        }
        s = j->session;
        if (pj->error != MOEEP__V1__ERROR_CODE__ERROR_UNSPECIFIED) {
                snprintf(errmsg, sizeof(errmsg), "at daemon %s: %s", p->address,
                         pj->message ? pj->message : "");
                forward_failed(s, j->request_id, pj->error, errmsg);
                forward_free(ms, j);
                return;
        }
        r = -ECANCELED;
        /* Still open and in no job: the answer makes it a mirror's member. */
        if (s->state != SESSION_CLOSED && !s->member)
                r = jobs_join_mirror(ms->jobs, p->address, pj->job_id, pj->name, pj->world_size, j->rank,
                                     j->gpu_uuid, s, s->cred.uid, &m, errmsg);
        if (r < 0) {
                Moeep__V1__PeerLeave leave = MOEEP__V1__PEER_LEAVE__INIT;
                PEER_MSG(msg, leave, &leave, LEAVE);

                leave.job_id = pj->job_id;
                leave.rank = j->rank;
                mesh_peer_send(p, &msg);
                if (r != -ECANCELED)
                        forward_failed(s, j->request_id, error_code(r), errmsg);
                forward_free(ms, j);
                return;
        }
        joined(s, j->request_id, m);
        forward_free(ms, j);
}

/* A connection went down: the forwarded joins that wait for its daemon
 * fail, unless another connection to it is up. An inbound connection that
 * never came up has no identity: nothing waits on it. */
static void forwards_peer_down(void *arg, struct mesh_peer *p, bool was_up, bool transport_was_connected,
                               const char *lost, const char *why) {
        struct membership *ms = arg;

        if ((p->outbound || was_up) && !mesh_peer_find(ms->mesh, p->address))
                forwards_fail(ms, p->address, why);
}

int membership_init(struct membership *ms, struct metrics *metrics, struct jobs *jobs, struct broker *broker,
                    struct mesh *mesh, struct mesh_jobs *mesh_jobs, struct datapath *datapath) {
        const struct mesh_subscriber sub = {
                .arg = ms,
                .message = forward_answer,
                .peer_up = forwards_flush,
                .peer_down = forwards_peer_down,
        };

        *ms = (struct membership){
                .metrics = metrics,
                .jobs = jobs,
                .broker = broker,
                .mesh = mesh,
                .mesh_jobs = mesh_jobs,
                .datapath = datapath,
        };
        TAILQ_INIT(&ms->forwards);
        if (mesh)
                mesh_subscribe(mesh, MESH_OWNER_JOINS, &sub);
        return 0;
}

void membership_done(struct membership *ms) {
        struct forward *j;

        while ((j = TAILQ_FIRST(&ms->forwards)))
                forward_free(ms, j);
        if (ms->mesh)
                mesh_subscribe(ms->mesh, MESH_OWNER_JOINS, NULL);
}
