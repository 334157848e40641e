/* The request layer: the handler table and the handlers; see requests.h. */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "clients/admin.h"
#include "clients/membership.h"
#include "clients/query.h"
#include "clients/requests.h"
#include "clients/session.h"
#include "errors.h"
#include "log.h"
#include "messages.h"
#include "moeep-config.h"
#include "ops/metrics.h"
#include "record.h"

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

        r = membership_create(&rq->membership, s, jc->name, jc->world_size, &job, errmsg);
        if (r < 0)
                return r;
        created.unique_id.data = uid;
        created.unique_id.len = membership_unique_id(&rq->membership, job, uid);
        created.job_id = job->id;
        resp.body_case = MOEEP__V1__RESPONSE__BODY_JOB_CREATED;
        resp.job_created = &created;
        r = session_respond(s, rid, &resp, NULL, 0);
        explicit_bzero(uid, sizeof(uid));
        return r;
}

static int handle_barrier(struct requests *rq, struct session *s, uint64_t rid, const Moeep__V1__Request *req,
                          struct moeep_record *rec, char *errmsg) {
        return membership_barrier(&rq->membership, s, rid, errmsg);
}

static int handle_regions_fetch(struct requests *rq, struct session *s, uint64_t rid,
                                const Moeep__V1__Request *req, struct moeep_record *rec, char *errmsg) {
        const Moeep__V1__RegionsFetch *rf = req->regions_fetch;
        struct membership_region found[MOEEP_RECORD_MAX_FDS];
        Moeep__V1__RegionInfo infos[MOEEP_RECORD_MAX_FDS];
        Moeep__V1__RegionInfo *ptrs[MOEEP_RECORD_MAX_FDS];
        Moeep__V1__Regions regions = MOEEP__V1__REGIONS__INIT;
        Moeep__V1__Response resp = MOEEP__V1__RESPONSE__INIT;
        int fds[MOEEP_RECORD_MAX_FDS];
        size_t n, nfds = 0;
        int r;

        /* Regions of ranks at other daemons go only to clients that know
         * the field. */
        r = membership_fetch(&rq->membership, s, rf->rank, rf->tag,
                             s->features & MOEEP__V1__FEATURE__FEATURE_MESH, found, &n, errmsg);
        if (r < 0)
                return r;
        for (size_t i = 0; i < n; i++) {
                moeep__v1__region_info__init(&infos[i]);
                infos[i].rank = found[i].rank;
                infos[i].tag = found[i].tag;
                infos[i].kind = (Moeep__V1__RegionKind)found[i].kind;
                infos[i].size = found[i].size;
                infos[i].region_id = found[i].region_id;
                infos[i].remote = found[i].remote;
                ptrs[i] = &infos[i];
                /* The local ones, with fds, come first. */
                if (!found[i].remote)
                        fds[nfds++] = found[i].fd;
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
        const Moeep__V1__JobJoin *jj = req->job_join;
        const struct membership_join_args j = {
                .unique_id = jj->unique_id.data,
                .unique_id_len = jj->unique_id.len,
                .rank = jj->rank,
                .world_size = jj->world_size,
                .gpu_uuid = jj->gpu_uuid,
        };

        return membership_join(&rq->membership, s, rid, &j, errmsg);
}

static int handle_job_leave(struct requests *rq, struct session *s, uint64_t rid,
                            const Moeep__V1__Request *req, struct moeep_record *rec, char *errmsg) {
        membership_leave(&rq->membership, s);
        return session_send_ok(s, rid);
}

/* The message's kinds and roles are the daemon's, value for value. */
_Static_assert((int)REGION_KIND_UNSPECIFIED == MOEEP__V1__REGION_KIND__REGION_KIND_UNSPECIFIED &&
                       (int)REGION_KIND_CUMEM_FD == MOEEP__V1__REGION_KIND__REGION_KIND_CUMEM_FD &&
                       (int)REGION_KIND_DMABUF == MOEEP__V1__REGION_KIND__REGION_KIND_DMABUF &&
                       (int)REGION_KIND_MEMFD == MOEEP__V1__REGION_KIND__REGION_KIND_MEMFD,
               "enum region_kind is RegionKind");
_Static_assert((int)REGION_ROLE_NONE == MOEEP__V1__PROXY_ROLE__PROXY_ROLE_NONE &&
                       (int)REGION_ROLE_SEND == MOEEP__V1__PROXY_ROLE__PROXY_ROLE_SEND &&
                       (int)REGION_ROLE_RECV == MOEEP__V1__PROXY_ROLE__PROXY_ROLE_RECV &&
                       (int)REGION_ROLE_COUNTERS == MOEEP__V1__PROXY_ROLE__PROXY_ROLE_COUNTERS,
               "enum region_role is ProxyRole");

static int handle_region_register(struct requests *rq, struct session *s, uint64_t rid,
                                  const Moeep__V1__Request *req, struct moeep_record *rec, char *errmsg) {
        const Moeep__V1__RegionRegister *rr = req->region_register;
        const struct region_spec spec = {
                .kind = (enum region_kind)rr->kind,
                .size = rr->size,
                .tag = rr->tag,
                .role = (enum region_role)rr->proxy,
        };

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
                return membership_register_take(&rq->membership, s, rid, &spec, rr->take->fd_number, errmsg);
        }
        /* The check owns the fd once it started (rec->fds[0] is -1 then). */
        return membership_register(&rq->membership, s, rid, &spec, &rec->fds[0], errmsg);
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

        r = membership_channel_open(&rq->membership, s, req->channel_open->capacity, &fd, &opened.ring_id,
                                    &opened.capacity, &opened.routes, errmsg);
        if (r < 0)
                return r;
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
        /* The session ends: it is lost to its job and gives up the jobs it
         * created. */
        membership_gone(&rq->membership, s, why);
        return 0;
}
