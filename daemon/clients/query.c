/* Status, job and client listings; see query.h. Each fills a struct
 * query_response and returns; requests.c sends it. */
#include <errno.h>
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "clients/nics.h"
#include "clients/query.h"
#include "clients/session.h"
#include "log.h"
#include "mesh/mesh-jobs.h"
#include "mesh/mesh.h"
#include "moeep-config.h"
#include "ops/metrics.h"
#include "record.h"
#include "state/job.h"

/* Whether `viewer` may see session `other`. */
static bool session_visible(const struct session *viewer, bool admin, const struct session *other) {
        if (other->state == SESSION_CLOSED)
                return false;
        if (admin || other == viewer)
                return true;
        return viewer->member && other->member && viewer->member->job == other->member->job;
}

static bool job_visible(const struct session *viewer, bool admin, const struct job *job) {
        return admin || (viewer->member && viewer->member->job == job);
}

/* Makes a listing fit in one record by dropping trailing entries (`*n`
 * of them); the listing is then partial, which is logged (Status still
 * counts everything visible). */
static void query_fit_listing(const struct session *s, Moeep__V1__Response *resp, size_t *n,
                              const char *what) {
        size_t before = *n;

        while (*n > 0 &&
               protobuf_c_message_get_packed_size(&resp->base) + sizeof(struct moeep_record_header) >
                       MOEEP_RECORD_MAX)
                *n = *n * 3 / 4;
        if (*n != before)
                log_warn("session %" PRIu64 ": %s listing cut from %zu to %zu entries to fit one record",
                         s->id, what, before, *n);
}

/* Starts an answer: nothing owned yet, so that query_response_done() is
 * safe whatever happens next. */
static void query_response_init(struct query_response *q) {
        memset(q, 0, sizeof(*q));
        moeep__v1__response__init(&q->resp);
}

void query_response_done(struct query_response *q) {
        for (size_t i = 0; i < sizeof(q->owned) / sizeof(q->owned[0]); i++)
                free(q->owned[i]);
        metrics_snapshot_free(q->metrics);
        if (q->nics)
                nics_free(q->nics);
        memset(q, 0, sizeof(*q));
}

int query_status(const struct jobs *jobs, const struct metrics *m, const struct session *s,
                 struct query_response *q, char *errmsg) {
        bool admin = s->admin;
        Moeep__V1__Status *st = &q->body.status;
        const struct session *o;
        const struct job *job;

        query_response_init(q);
        moeep__v1__status__init(st);
        TAILQ_FOREACH (o, &s->reg->list, entry)
                st->sessions += session_visible(s, admin, o);
        TAILQ_FOREACH (job, &jobs->list, entry)
                st->jobs += job_visible(s, admin, job);
        st->daemon_version = (char *)MOEEP_VERSION;
        st->major = MOEEP_PROTOCOL_MAJOR;
        st->minor = MOEEP_PROTOCOL_MINOR;
        st->uptime_ms = metrics_uptime_ms(m);
        st->pid = (uint32_t)getpid();
        st->draining = jobs->draining;
        st->log_level = (char *)log_level_to_string(log_get_level());
        q->resp.body_case = MOEEP__V1__RESPONSE__BODY_STATUS;
        q->resp.status = st;
        return 0;
}

int query_jobs(const struct jobs *all, const struct mesh_jobs *mj, const struct session *s,
               struct query_response *q, char *errmsg) {
        bool admin = s->admin;
        Moeep__V1__Jobs *jobs = &q->body.jobs;
        Moeep__V1__JobInfo *infos = NULL, **ptrs = NULL;
        uint32_t *ranks = NULL, *remote = NULL;
        struct job_node *nodes = NULL;
        char **node_ptrs = NULL;
        struct job *job;
        size_t n = 0;

        query_response_init(q);
        moeep__v1__jobs__init(jobs);
        infos = calloc(all->count + 1, sizeof(*infos));
        ptrs = calloc(all->count + 1, sizeof(*ptrs));
        ranks = calloc((all->count + 1) * MOEEP_MAX_RANKS, sizeof(*ranks));
        /* remote ranks, then lost ranks: two halves */
        remote = calloc(2 * (all->count + 1) * MOEEP_MAX_RANKS, sizeof(*remote));
        nodes = calloc((all->count + 1) * MOEEP_MAX_RANKS, sizeof(*nodes));
        node_ptrs = calloc((all->count + 1) * MOEEP_MAX_RANKS, sizeof(*node_ptrs));
        /* Freed by query_response_done(), after the answer went. */
        q->owned[0] = infos;
        q->owned[1] = ptrs;
        q->owned[2] = ranks;
        q->owned[3] = remote;
        q->owned[4] = nodes;
        q->owned[5] = node_ptrs;
        if (!infos || !ptrs || !ranks || !remote || !nodes || !node_ptrs)
                return errmsg_set(errmsg, -ENOMEM, "JobsList of %" PRIu32 " jobs: out of memory", all->count);
        TAILQ_FOREACH (job, &all->list, entry) {
                Moeep__V1__JobInfo *ji = &infos[n];

                if (!job_visible(s, admin, job))
                        continue;
                moeep__v1__job_info__init(ji);
                ji->job_id = job->id;
                ji->name = job->name;
                ji->world_size = job->world_size;
                ji->joined_ranks = &ranks[n * MOEEP_MAX_RANKS];
                ji->remote_ranks = &remote[n * MOEEP_MAX_RANKS];
                ji->lost_ranks = &remote[(all->count + 1 + n) * MOEEP_MAX_RANKS];
                ji->home = job->home;
                /* A job that spans daemons: its ranks joined elsewhere
                 * count as joined too, and say where they are. */
                if (mesh_jobs_nodes(mj, job, &nodes[n * MOEEP_MAX_RANKS])) {
                        ji->rank_nodes = &node_ptrs[n * MOEEP_MAX_RANKS];
                        ji->n_rank_nodes = job->world_size;
                        for (uint32_t rank = 0; rank < job->world_size; rank++)
                                ji->rank_nodes[rank] = nodes[n * MOEEP_MAX_RANKS + rank].address;
                }
                for (uint32_t rank = 0; rank < job->world_size; rank++) {
                        bool here = job_rank_local(job, rank);
                        bool elsewhere = !here && ji->n_rank_nodes && ji->rank_nodes[rank][0];

                        if (here || elsewhere)
                                ji->joined_ranks[ji->n_joined_ranks++] = rank;
                        if (elsewhere)
                                ji->remote_ranks[ji->n_remote_ranks++] = rank;
                        if (job->control->lost_ranks & (1u << rank))
                                ji->lost_ranks[ji->n_lost_ranks++] = rank;
                }
                ji->state = (char *)job_state_to_string(job->state);
                ji->owner_uid = (uint32_t)job->owner_uid; /* a mirror's JOB_OWNER_NONE: 4294967295 */
                ptrs[n++] = ji;
        }
        jobs->jobs = ptrs;
        q->resp.body_case = MOEEP__V1__RESPONSE__BODY_JOBS;
        q->resp.jobs = jobs;
        jobs->n_jobs = n;
        query_fit_listing(s, &q->resp, &jobs->n_jobs, "job");
        return 0;
}

int query_clients(const struct session *s, struct query_response *q, char *errmsg) {
        const struct sessions *all = s->reg;
        bool admin = s->admin;
        Moeep__V1__Clients *clients = &q->body.clients;
        Moeep__V1__ClientInfo *infos = NULL, **ptrs = NULL;
        struct session *o;
        size_t n = 0;

        query_response_init(q);
        moeep__v1__clients__init(clients);
        infos = calloc(all->count + 1, sizeof(*infos));
        ptrs = calloc(all->count + 1, sizeof(*ptrs));
        q->owned[0] = infos;
        q->owned[1] = ptrs;
        if (!infos || !ptrs)
                return errmsg_set(errmsg, -ENOMEM, "ClientsList of %" PRIu32 " sessions: out of memory",
                                  all->count);
        TAILQ_FOREACH (o, &all->list, entry) {
                Moeep__V1__ClientInfo *ci = &infos[n];

                if (!session_visible(s, admin, o))
                        continue;
                moeep__v1__client_info__init(ci);
                ci->session_id = o->id;
                ci->pid = (uint32_t)o->cred.pid;
                ci->uid = (uint32_t)o->cred.uid;
                ci->gid = (uint32_t)o->cred.gid;
                ci->job_id = o->member ? o->member->job->id : 0;
                ci->rank = o->member ? (int32_t)o->member->rank : -1;
                ci->gpu_uuid = o->member ? o->member->gpu_uuid : (char *)"";
                ci->state = (char *)session_state_to_string(o->state);
                ci->name = o->name;
                ci->regions = o->member ? o->member->nregions : 0;
                ptrs[n++] = ci;
        }
        clients->clients = ptrs;
        q->resp.body_case = MOEEP__V1__RESPONSE__BODY_CLIENTS;
        q->resp.clients = clients;
        clients->n_clients = n;
        query_fit_listing(s, &q->resp, &clients->n_clients, "client");
        return 0;
}

int query_metrics(const struct metrics *m, const struct session *s, struct query_response *q, char *errmsg) {
        int r;

        query_response_init(q);
        r = metrics_snapshot(m, &q->metrics);
        if (r < 0)
                return errmsg_set(errmsg, r, "MetricsGet: out of memory");
        q->resp.body_case = MOEEP__V1__RESPONSE__BODY_METRICS;
        q->resp.metrics = q->metrics;
        return 0;
}

int query_nics(const struct session *s, struct query_response *q, char *errmsg) {
        int r;

        query_response_init(q);
        r = nics_scan(NICS_SYSFS_ROOT, &q->nics, errmsg);
        if (r < 0) {
                q->nics = NULL;
                return r;
        }
        q->resp.body_case = MOEEP__V1__RESPONSE__BODY_NICS;
        q->resp.nics = q->nics;
        return 0;
}

static int peer_address_cmp(const void *a, const void *b) {
        const struct mesh_peer *p = *(const struct mesh_peer *const *)a,
                               *q = *(const struct mesh_peer *const *)b;

        return strcmp(p->address, q->address);
}

int query_mesh(const struct mesh *mesh, const struct session *s, struct query_response *q, char *errmsg) {
        Moeep__V1__Mesh *m = &q->body.mesh;
        Moeep__V1__MeshPeer *infos = NULL, **ptrs = NULL;
        const struct mesh_peer *p, **sorted = NULL;
        size_t count = 0, n = 0;

        /* Only the admin socket asks (messages.def's ADMIN column): the
         * peers' addresses describe the cluster, not the caller's job. */
        query_response_init(q);
        moeep__v1__mesh__init(m);
        m->address = (char *)"";
        if (mesh) {
                m->enabled = true;
                m->address = (char *)mesh->address;
                m->keyed = mesh->keyed;
                TAILQ_FOREACH (p, &mesh->peers, entry)
                        count++;
        }
        infos = calloc(count + 1, sizeof(*infos));
        ptrs = calloc(count + 1, sizeof(*ptrs));
        sorted = calloc(count + 1, sizeof(*sorted));
        q->owned[0] = infos;
        q->owned[1] = ptrs;
        q->owned[2] = sorted;
        if (!infos || !ptrs || !sorted)
                return errmsg_set(errmsg, -ENOMEM, "MeshList of %zu peers: out of memory", count);
        if (mesh) {
                size_t i = 0;

                TAILQ_FOREACH (p, &mesh->peers, entry)
                        sorted[i++] = p;
        }
        /* Sorted by address, the connections to one daemon are neighbours:
         * an outbound peer waiting while that daemon's own connection to us
         * is up is no second peer. Sorting keeps this O(n log n) where
         * comparing every pair was quadratic. */
        qsort(sorted, count, sizeof(*sorted), peer_address_cmp);
        for (size_t first = 0, last; first < count; first = last) {
                bool up = false;

                for (last = first; last < count && strcmp(sorted[last]->address, sorted[first]->address) == 0;
                     last++)
                        up |= !sorted[last]->dead && sorted[last]->state == MESH_PEER_UP;
                for (size_t i = first; i < last; i++) {
                        Moeep__V1__MeshPeer *mp = &infos[n];

                        p = sorted[i];
                        if (p->dead || (up && p->state != MESH_PEER_UP))
                                continue;
                        moeep__v1__mesh_peer__init(mp);
                        mp->address = (char *)p->address;
                        mp->state = (char *)mesh_peer_state_to_string(p->state);
                        mp->outbound = p->outbound;
                        mp->rtt_us = p->rtt_us;
                        mp->jobs = mesh_peer_jobs(mesh, p);
                        ptrs[n++] = mp;
                }
        }
        m->peers = ptrs;
        m->n_peers = n;
        q->resp.body_case = MOEEP__V1__RESPONSE__BODY_MESH;
        q->resp.mesh = m;
        query_fit_listing(s, &q->resp, &m->n_peers, "mesh peer");
        return 0;
}
