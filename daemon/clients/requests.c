/* The request layer: the handler table and the handlers; see requests.h. */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "clients/admin.h"
#include "clients/query.h"
#include "clients/region-take.h"
#include "clients/requests.h"
#include "clients/session.h"
#include "datapath/datapath.h"
#include "errors.h"
#include "log.h"
#include "mesh/mesh-jobs.h"
#include "mesh/mesh.h"
#include "messages.h"
#include "moeep-config.h"
#include "ops/metrics.h"
#include "record.h"
#include "state/broker.h"
#include "state/job.h"

/* Features this daemon offers in Welcome. */
#define REQUESTS_FEATURES                                                                              \
        ((uint64_t)MOEEP__V1__FEATURE__FEATURE_REGIONS |                                               \
         (uint64_t)MOEEP__V1__FEATURE__FEATURE_CONTROL_PAGE |                                          \
         (uint64_t)MOEEP__V1__FEATURE__FEATURE_OPERATOR | (uint64_t)MOEEP__V1__FEATURE__FEATURE_MESH | \
         (uint64_t)MOEEP__V1__FEATURE__FEATURE_PROXY | (uint64_t)MOEEP__V1__FEATURE__FEATURE_PIDFD)

/* ------------------------------------------------------------ handlers */

static int handle_hello(struct requests *rq, struct session *s, uint64_t rid, const Moeep__V1__Request *req,
                        struct moeep_record *rec, char *errmsg) {
        const Moeep__V1__Hello *hello = req->hello;
        Moeep__V1__Welcome welcome = MOEEP__V1__WELCOME__INIT;
        Moeep__V1__Response resp = MOEEP__V1__RESPONSE__INIT;

        if (s->state != SESSION_NEW)
                return errmsg_set(errmsg, -ERROR_KIND_INVALID_ARGUMENT,
                                  "session %" PRIu64 ": Hello already received", s->id);
        if (hello->major != MOEEP_PROTOCOL_MAJOR) {
                session_fail(s, MOEEP__V1__ERROR_CODE__ERROR_VERSION_MISMATCH, rid,
                             "Hello with protocol major %" PRIu32 ": the daemon speaks %d", hello->major,
                             MOEEP_PROTOCOL_MAJOR);
                return 0;
        }
        session_welcome(s, hello->client_name, hello->features & REQUESTS_FEATURES);
        log_info("session %" PRIu64 " (pid %d uid %u gid %u): hello from '%s', protocol %" PRIu32 ".%" PRIu32,
                 s->id, (int)s->cred.pid, (unsigned)s->cred.uid, (unsigned)s->cred.gid, s->name, hello->major,
                 hello->minor);

        welcome.major = MOEEP_PROTOCOL_MAJOR;
        welcome.minor = MOEEP_PROTOCOL_MINOR;
        welcome.features = s->features;
        welcome.daemon_version = (char *)MOEEP_VERSION;
        welcome.session_id = s->id;
        resp.body_case = MOEEP__V1__RESPONSE__BODY_WELCOME;
        resp.welcome = &welcome;
        return session_respond(s, rid, &resp, NULL, 0);
}

static int handle_job_create(struct requests *rq, struct session *s, uint64_t rid,
                             const Moeep__V1__Request *req, struct moeep_record *rec, char *errmsg) {
        const Moeep__V1__JobCreate *jc = req->job_create;
        Moeep__V1__JobCreated created = MOEEP__V1__JOB_CREATED__INIT;
        Moeep__V1__Response resp = MOEEP__V1__RESPONSE__INIT;
        uint8_t uid[MOEEP_UNIQUE_ID_BYTES];
        struct job *job;
        int r;

        if (s->reg->stopping)
                return errmsg_set(errmsg, -ERROR_KIND_DRAINING, "the daemon is shutting down: no new jobs");
        if (rq->membership.jobs->draining)
                return errmsg_set(errmsg, -ERROR_KIND_DRAINING,
                                  "the daemon is draining: no new jobs (an admin ends it with "
                                  "'moeepctl drain --off')");
        r = jobs_create(rq->membership.jobs, jc->name, jc->world_size, s->cred.uid, s, &job, errmsg);
        if (r < 0)
                return r;
        rq->metrics->jobs_created++;
        log_info("session %" PRIu64 " (uid %u): created job %" PRIu64 " '%s' of %" PRIu32 " ranks", s->id,
                 (unsigned)s->cred.uid, job->id, job->name, job->world_size);

        created.unique_id.data = uid;
        created.unique_id.len = job_unique_id_with_node(job, mesh_address(rq->membership.mesh), uid);
        created.job_id = job->id;
        resp.body_case = MOEEP__V1__RESPONSE__BODY_JOB_CREATED;
        resp.job_created = &created;
        r = session_respond(s, rid, &resp, NULL, 0);
        explicit_bzero(uid, sizeof(uid));
        return r;
}

static int handle_barrier(struct requests *rq, struct session *s, uint64_t rid, const Moeep__V1__Request *req,
                          struct moeep_record *rec, char *errmsg) {
        /* 0: the reply comes from requests_barrier_done() (the job's
         * barrier_done callback); 1: from the job's home daemon, through
         * the mesh. */
        int r = job_barrier(s->member, rid, errmsg);

        if (r == 1) {
                mesh_jobs_barrier(rq->membership.mesh_jobs, s->member);
                r = 0;
        }
        return r;
}

static int handle_regions_fetch(struct requests *rq, struct session *s, uint64_t rid,
                                const Moeep__V1__Request *req, struct moeep_record *rec, char *errmsg) {
        const Moeep__V1__RegionsFetch *rf = req->regions_fetch;
        Moeep__V1__RegionInfo infos[MOEEP_RECORD_MAX_FDS];
        Moeep__V1__RegionInfo *ptrs[MOEEP_RECORD_MAX_FDS];
        Moeep__V1__Regions regions = MOEEP__V1__REGIONS__INIT;
        Moeep__V1__Response resp = MOEEP__V1__RESPONSE__INIT;
        int fds[MOEEP_RECORD_MAX_FDS];
        const struct job *job = s->member->job;
        const struct job_remote_region *remote;
        struct region **found = NULL;
        size_t n = 0, nfds;
        uint32_t nremote;
        int r;

        r = broker_fetch(s->member, rf->rank, rf->tag, MOEEP_RECORD_MAX_FDS, &found, &n, errmsg);
        if (r < 0)
                return r;
        for (size_t i = 0; i < n; i++) {
                moeep__v1__region_info__init(&infos[i]);
                infos[i].rank = found[i]->owner->rank;
                infos[i].tag = found[i]->tag;
                infos[i].kind = found[i]->kind;
                infos[i].size = found[i]->size;
                infos[i].region_id = found[i]->id;
                ptrs[i] = &infos[i];
                fds[i] = found[i]->fd;
        }
        free(found);
        nfds = n;
        /* Ranks at other daemons: metadata only, to clients that know the
         * field (their memory is reached through the transports). */
        remote = mesh_jobs_remote_regions(job, &nremote);
        for (uint32_t i = 0; i < nremote && (s->features & MOEEP__V1__FEATURE__FEATURE_MESH); i++) {
                const struct job_remote_region *rr = &remote[i];

                if ((rf->rank >= 0 ? rr->rank != (uint32_t)rf->rank : rr->rank == s->member->rank) ||
                    (rf->tag >= 0 && rr->tag != (uint64_t)rf->tag))
                        continue;
                if (n == MOEEP_RECORD_MAX_FDS)
                        return errmsg_set(errmsg, -ERROR_KIND_LIMIT_EXCEEDED,
                                          "more than %d regions match (rank %" PRId32 ", tag %" PRId64 ")",
                                          MOEEP_RECORD_MAX_FDS, rf->rank, rf->tag);
                moeep__v1__region_info__init(&infos[n]);
                infos[n].rank = rr->rank;
                infos[n].tag = rr->tag;
                infos[n].kind = (Moeep__V1__RegionKind)rr->kind;
                infos[n].size = rr->size;
                infos[n].region_id = rr->region_id;
                infos[n].remote = true;
                ptrs[n] = &infos[n];
                n++;
        }
        regions.n_regions = n;
        regions.regions = ptrs;
        resp.body_case = MOEEP__V1__RESPONSE__BODY_REGIONS;
        resp.regions = &regions;
        r = session_respond(s, rid, &resp, fds, nfds);
        /* A cap of the uid or the daemon's budget: both a limit to the client. */
        if (r == -EDQUOT || r == -EMFILE)
                return errmsg_set(errmsg, -ERROR_KIND_LIMIT_EXCEEDED, "RegionsFetch: %s", session_send_why());
        return r;
}

static int handle_job_join(struct requests *rq, struct session *s, uint64_t rid,
                           const Moeep__V1__Request *req, struct moeep_record *rec, char *errmsg) {
        return membership_join(&rq->membership, s, rid, req->job_join, errmsg);
}

static int handle_job_leave(struct requests *rq, struct session *s, uint64_t rid,
                            const Moeep__V1__Request *req, struct moeep_record *rec, char *errmsg) {
        log_info("session %" PRIu64 ": left job %" PRIu64 " (rank %" PRIu32 ")", s->id, s->member->job->id,
                 s->member->rank);
        membership_end(&rq->membership, s, false, "left");
        return session_send_ok(s, rid);
}

static int handle_region_register(struct requests *rq, struct session *s, uint64_t rid,
                                  const Moeep__V1__Request *req, struct moeep_record *rec, char *errmsg) {
        const Moeep__V1__RegionRegister *rr = req->region_register;
        Moeep__V1__RegionRegistered registered = MOEEP__V1__REGION_REGISTERED__INIT;
        Moeep__V1__Response resp = MOEEP__V1__RESPONSE__INIT;
        int r;

        /* Rule 5 of proto/README.md for a field: only after the feature
         * was agreed. */
        if (rr->proxy != MOEEP__V1__PROXY_ROLE__PROXY_ROLE_NONE &&
            !(s->features & MOEEP__V1__FEATURE__FEATURE_PROXY))
                return errmsg_set(errmsg, -ERROR_KIND_INVALID_ARGUMENT,
                                  "RegionRegister: proxy role %d, but session %" PRIu64
                                  " did not offer FEATURE_PROXY in Hello",
                                  (int)rr->proxy, s->id);
        if (rr->take) {
                if (!(s->features & MOEEP__V1__FEATURE__FEATURE_PIDFD))
                        return errmsg_set(errmsg, -ERROR_KIND_INVALID_ARGUMENT,
                                          "RegionRegister: fd number %" PRId64
                                          " to take, but session %" PRIu64
                                          " did not offer FEATURE_PIDFD in Hello",
                                          rr->take->fd_number, s->id);
                return region_take_start(&rq->membership, rq->metrics, s, rid, rr, errmsg);
        }
        r = membership_register(&rq->membership, s, rr, &rec->fds[0], &registered.region_id, errmsg);
        if (r < 0)
                return r;
        rec->fds[0] = -1; /* the broker owns it now */
        rq->metrics->regions_registered++;
        resp.body_case = MOEEP__V1__RESPONSE__BODY_REGION_REGISTERED;
        resp.region_registered = &registered;
        return session_respond(s, rid, &resp, NULL, 0);
}

static int handle_region_release(struct requests *rq, struct session *s, uint64_t rid,
                                 const Moeep__V1__Request *req, struct moeep_record *rec, char *errmsg) {
        int r = membership_release(&rq->membership, s, req->region_release->region_id, errmsg);

        if (r < 0)
                return r;
        return session_send_ok(s, rid);
}

/* Sends what a query filled (unless it refused), then frees it. */
static int reply_query(struct session *s, uint64_t rid, int r, struct query_response *q) {
        if (r == 0)
                r = session_respond(s, rid, &q->resp, NULL, 0);
        query_response_done(q);
        return r;
}

/* The listings: each handler runs its query (query.h), which fills an
 * answer from what it is handed, and sends it. */
static int handle_status_get(struct requests *rq, struct session *s, uint64_t rid,
                             const Moeep__V1__Request *req, struct moeep_record *rec, char *errmsg) {
        struct query_response q;

        return reply_query(s, rid, query_status(rq->membership.jobs, rq->metrics, s, &q, errmsg), &q);
}

static int handle_jobs_list(struct requests *rq, struct session *s, uint64_t rid,
                            const Moeep__V1__Request *req, struct moeep_record *rec, char *errmsg) {
        struct query_response q;

        return reply_query(s, rid, query_jobs(rq->membership.jobs, rq->membership.mesh_jobs, s, &q, errmsg),
                           &q);
}

static int handle_clients_list(struct requests *rq, struct session *s, uint64_t rid,
                               const Moeep__V1__Request *req, struct moeep_record *rec, char *errmsg) {
        struct query_response q;

        return reply_query(s, rid, query_clients(s, &q, errmsg), &q);
}

static int handle_metrics_get(struct requests *rq, struct session *s, uint64_t rid,
                              const Moeep__V1__Request *req, struct moeep_record *rec, char *errmsg) {
        struct query_response q;

        return reply_query(s, rid, query_metrics(rq->metrics, s, &q, errmsg), &q);
}

static int handle_nics_list(struct requests *rq, struct session *s, uint64_t rid,
                            const Moeep__V1__Request *req, struct moeep_record *rec, char *errmsg) {
        struct query_response q;

        return reply_query(s, rid, query_nics(s, &q, errmsg), &q);
}

static int handle_mesh_list(struct requests *rq, struct session *s, uint64_t rid,
                            const Moeep__V1__Request *req, struct moeep_record *rec, char *errmsg) {
        struct query_response q;

        return reply_query(s, rid, query_mesh(rq->membership.mesh, s, &q, errmsg), &q);
}

static int handle_log_level_set(struct requests *rq, struct session *s, uint64_t rid,
                                const Moeep__V1__Request *req, struct moeep_record *rec, char *errmsg) {
        int r = admin_log_level_set(s, req->log_level_set->level, errmsg);

        return r < 0 ? r : session_send_ok(s, rid);
}

static int handle_drain(struct requests *rq, struct session *s, uint64_t rid, const Moeep__V1__Request *req,
                        struct moeep_record *rec, char *errmsg) {
        int r = admin_drain(s, &rq->membership.jobs->draining, req->drain->on, errmsg);

        return r < 0 ? r : session_send_ok(s, rid);
}

static int handle_channel_open(struct requests *rq, struct session *s, uint64_t rid,
                               const Moeep__V1__Request *req, struct moeep_record *rec, char *errmsg) {
        Moeep__V1__ChannelOpened opened = MOEEP__V1__CHANNEL_OPENED__INIT;
        Moeep__V1__Response resp = MOEEP__V1__RESPONSE__INIT;
        int fd, r;

        r = datapath_channel_open(rq->membership.datapath, s->member, req->channel_open->capacity, &fd,
                                  &opened.ring_id, &opened.capacity, errmsg);
        if (r < 0)
                return r;
        opened.routes = s->member->job->world_size;
        resp.body_case = MOEEP__V1__RESPONSE__BODY_CHANNEL_OPENED;
        resp.channel_opened = &opened;
        /* The session sends a duplicate; the proxy mapped the ring already.
         * A ring the client never receives goes when its member goes. */
        r = session_respond(s, rid, &resp, &fd, 1);
        close(fd);
        if (r == -EDQUOT || r == -EMFILE)
                return errmsg_set(errmsg, -ERROR_KIND_LIMIT_EXCEEDED, "ChannelOpen: %s", session_send_why());
        return r;
}

/* The handlers, indexed by request type (= Request body case), one per
 * request row of proto/messages.def, which also says each one's name,
 * feature bit, whether it needs a job and whether only the admin socket
 * may send it. A handler returns 0 once it
 * queued its reply (or when the reply is held back, Barrier), or -errno
 * with `errmsg` filled, which the dispatcher turns into Error. */
typedef int handler_fn(struct requests *rq, struct session *s, uint64_t rid, const Moeep__V1__Request *req,
                       struct moeep_record *rec, char *errmsg);

static handler_fn *const handlers[MOEEP_TYPE_REQUEST_MAX + 1] = {
#define MOEEP_REQUEST(CASE, field, Name, FDS, FEATURE, JOB, ADMIN) \
        [MOEEP__V1__REQUEST__BODY_##CASE] = handle_##field,
#include "messages.def"
#undef MOEEP_REQUEST
};

/* Handles one received record. Returns 1 to go on reading, 0 when the
 * session failed. */
static int requests_handle(struct requests *rq, struct session *s, struct moeep_record *rec) {
        uint16_t type = rec->hdr.type;
        uint64_t rid = rec->hdr.request_id;
        char errmsg[ERRMSG_MAX] = "";
        const struct moeep_message *h;
        Moeep__V1__Request *req;
        const char *why = NULL;
        int r;

        /* moeep_record_recv() let only known types through: a response or
         * event type from a client is a known message in the wrong place. */
        if (type < MOEEP_TYPE_REQUEST_MIN || type > MOEEP_TYPE_REQUEST_MAX) {
                session_fail(s, MOEEP__V1__ERROR_CODE__ERROR_BAD_RECORD, rid,
                             "record type %u is a response or event, not a request", type);
                return 0;
        }
        h = moeep_message_lookup(type);
        if (!h || !handlers[type]) {
                session_fail(s, MOEEP__V1__ERROR_CODE__ERROR_UNKNOWN_TYPE, rid,
                             "request type %u is not known", type);
                return 0;
        }
        rq->metrics->requests[type]++;
        if (s->state == SESSION_NEW && type != MOEEP__V1__REQUEST__BODY_HELLO) {
                session_fail(s, MOEEP__V1__ERROR_CODE__ERROR_NOT_WELCOMED, rid,
                             "%s (request %" PRIu64 ") before Hello", h->name, rid);
                return 0;
        }
        /* Checked before protobuf-c allocates anything for it: a record of
         * thousands of unknown fields would cost the loop a millisecond. */
        if (moeep_record_scan(&moeep__v1__request__descriptor, rec->payload, rec->hdr.length, &why) < 0) {
                session_fail(s, MOEEP__V1__ERROR_CODE__ERROR_BAD_RECORD, rid,
                             "%s request (type %u) of %" PRIu32 " payload bytes refused before decoding: %s",
                             h->name, type, rec->hdr.length, why);
                return 0;
        }
        req = moeep_record_decode_request(rec);
        if (!req) {
                session_fail(s, MOEEP__V1__ERROR_CODE__ERROR_BAD_RECORD, rid,
                             "%s request (type %u) of %" PRIu32 " payload bytes does not decode", h->name,
                             type, rec->hdr.length);
                return 0;
        }
        /* RegionRegister carries its fd, or names one to take (1.4) and
         * carries none: the framing let both through (record.h). */
        if (type == MOEEP__V1__REQUEST__BODY_REGION_REGISTER &&
            rec->nfds != (req->region_register->take ? 0 : 1)) {
                session_fail(s, MOEEP__V1__ERROR_CODE__ERROR_BAD_FDS, rid, "bad record: %s",
                             rec->nfds ? "RegionRegister names an fd number to take but carries a descriptor"
                                       : "record type needs exactly one descriptor but carries none");
                moeep__v1__request__free_unpacked(req, NULL);
                return 0;
        }
        if (h->needs_job && !s->member)
                r = errmsg_set(errmsg, -ERROR_KIND_NOT_IN_JOB, "%s: session %" PRIu64 " is not in a job",
                               h->name, s->id);
        else if ((s->features & h->feature) != h->feature)
                /* Rule 5 of proto/README.md: the Hello did not offer it. */
                r = errmsg_set(errmsg, -ERROR_KIND_INVALID_ARGUMENT,
                               "%s: session %" PRIu64 " did not offer feature bit %" PRIu64 " in Hello",
                               h->name, s->id, h->feature);
        else if (h->admin_only && !s->admin)
                /* Who is an admin was decided at accept (session_new). */
                r = errmsg_set(errmsg, -ERROR_KIND_PERMISSION_DENIED,
                               "%s is an operator command: only the admin socket accepts it (session %" PRIu64
                               ", uid %u, came through the client socket)",
                               h->name, s->id, (unsigned)s->cred.uid);
        else
                r = handlers[type](rq, s, rid, req, rec, errmsg);
        if (r < 0 && s->state != SESSION_CLOSED) {
                if (!errmsg[0])
                        snprintf(errmsg, sizeof(errmsg), "%s: %s", h->name, error_to_string(r));
                log_debug("session %" PRIu64 ": %s (request %" PRIu64 ") refused: %s", s->id, h->name, rid,
                          errmsg);
                if (r == -ENOBUFS || session_send_error(s, rid, error_code(r), errmsg) < 0)
                        log_debug("session %" PRIu64 ": could not queue the error for request %" PRIu64,
                                  s->id, rid);
        }
        moeep__v1__request__free_unpacked(req, NULL);
        return s->state != SESSION_CLOSED;
}

int requests_dispatch(void *ctx, struct session *s, struct moeep_record *rec, const char *why) {
        struct requests *rq = ctx;

        if (rec)
                return requests_handle(rq, s, rec);
        /* The session ends: it leaves its job as a lost rank and gives up
         * the jobs it created. */
        membership_end(&rq->membership, s, true, why);
        jobs_creator_gone(rq->membership.jobs, s);
        return 0;
}

/* ------------------------------------------------------------ job callbacks */

static void requests_barrier_done(void *owner, const struct job *job, uint64_t request_id, int error) {
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

static void requests_peer_lost(void *owner, const struct job *job, uint32_t rank, const char *reason) {
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

const struct job_callbacks requests_job_callbacks = {
        .barrier_done = requests_barrier_done,
        .peer_lost = requests_peer_lost,
};
