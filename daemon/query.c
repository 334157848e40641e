/* Status, job and client listings; see query.h. */
#include <errno.h>
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "admin.h"
#include "daemon.h"
#include "job.h"
#include "log.h"
#include "mesh-jobs.h"
#include "mesh.h"
#include "metrics.h"
#include "nics.h"
#include "moeep-config.h"
#include "query.h"
#include "record.h"
#include "session.h"

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

/* Sends a listing, first dropping trailing entries (`*n` of them) until it
 * fits in one record; the listing is then partial, which is logged (Status
 * still counts everything visible). */
static int query_send_listing(struct session *s, uint64_t request_id, Moeep__V1__Response *resp, size_t *n,
                              const char *what) {
        size_t before = *n;

        while (*n > 0 &&
               protobuf_c_message_get_packed_size(&resp->base) + sizeof(struct moeep_record_header) >
                       MOEEP_RECORD_MAX)
                *n = *n * 3 / 4;
        if (*n != before)
                log_warn("session %" PRIu64 ": %s listing cut from %zu to %zu entries to fit one record",
                         s->id, what, before, *n);
        return session_respond(s, request_id, resp, NULL, 0);
}

int query_status(struct session *s, uint64_t request_id, char *errmsg) {
        const struct daemon *d = s->daemon;
        bool admin = s->admin;
        Moeep__V1__Status st = MOEEP__V1__STATUS__INIT;
        Moeep__V1__Response resp = MOEEP__V1__RESPONSE__INIT;
        const struct session *o;
        const struct job *job;

        TAILQ_FOREACH (o, &d->sessions, entry)
                st.sessions += session_visible(s, admin, o);
        TAILQ_FOREACH (job, &d->jobs->list, entry)
                st.jobs += job_visible(s, admin, job);
        st.daemon_version = (char *)MOEEP_VERSION;
        st.major = MOEEP_PROTOCOL_MAJOR;
        st.minor = MOEEP_PROTOCOL_MINOR;
        st.uptime_ms = daemon_uptime_ms(d);
        st.pid = (uint32_t)getpid();
        st.draining = d->draining;
        st.log_level = (char *)log_level_to_string(log_get_level());
        resp.body_case = MOEEP__V1__RESPONSE__BODY_STATUS;
        resp.status = &st;
        return session_respond(s, request_id, &resp, NULL, 0);
}

int query_jobs(struct session *s, uint64_t request_id, char *errmsg) {
        const struct daemon *d = s->daemon;
        bool admin = s->admin;
        Moeep__V1__Jobs jobs = MOEEP__V1__JOBS__INIT;
        Moeep__V1__Response resp = MOEEP__V1__RESPONSE__INIT;
        Moeep__V1__JobInfo *infos = NULL, **ptrs = NULL;
        uint32_t *ranks = NULL, *remote = NULL;
        struct job_node *nodes = NULL;
        char **node_ptrs = NULL;
        struct job *job;
        size_t n = 0;
        int r;

        infos = calloc(d->jobs->count + 1, sizeof(*infos));
        ptrs = calloc(d->jobs->count + 1, sizeof(*ptrs));
        ranks = calloc((d->jobs->count + 1) * MOEEP_MAX_RANKS, sizeof(*ranks));
        remote = calloc((d->jobs->count + 1) * MOEEP_MAX_RANKS, sizeof(*remote));
        nodes = calloc((d->jobs->count + 1) * MOEEP_MAX_RANKS, sizeof(*nodes));
        node_ptrs = calloc((d->jobs->count + 1) * MOEEP_MAX_RANKS, sizeof(*node_ptrs));
        if (!infos || !ptrs || !ranks || !remote || !nodes || !node_ptrs) {
                r = errmsg_set(errmsg, -ENOMEM, "JobsList of %" PRIu32 " jobs: out of memory",
                               d->jobs->count);
                goto out;
        }
        TAILQ_FOREACH (job, &d->jobs->list, entry) {
                Moeep__V1__JobInfo *ji = &infos[n];

                if (!job_visible(s, admin, job))
                        continue;
                moeep__v1__job_info__init(ji);
                ji->job_id = job->id;
                ji->name = job->name;
                ji->world_size = job->world_size;
                ji->joined_ranks = &ranks[n * MOEEP_MAX_RANKS];
                ji->remote_ranks = &remote[n * MOEEP_MAX_RANKS];
                ji->home = job->home;
                /* A job that spans daemons: its ranks joined elsewhere
                 * count as joined too, and say where they are. */
                if (mesh_jobs_nodes(d->mesh_jobs, job, &nodes[n * MOEEP_MAX_RANKS])) {
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
                }
                ji->state = (char *)job_state_to_string(job->state);
                ji->owner_uid = (uint32_t)job->owner_uid;
                ptrs[n++] = ji;
        }
        jobs.jobs = ptrs;
        resp.body_case = MOEEP__V1__RESPONSE__BODY_JOBS;
        resp.jobs = &jobs;
        jobs.n_jobs = n;
        r = query_send_listing(s, request_id, &resp, &jobs.n_jobs, "job");
out:
        free(infos);
        free(ptrs);
        free(ranks);
        free(remote);
        free(nodes);
        free(node_ptrs);
        return r;
}

int query_clients(struct session *s, uint64_t request_id, char *errmsg) {
        const struct daemon *d = s->daemon;
        bool admin = s->admin;
        Moeep__V1__Clients clients = MOEEP__V1__CLIENTS__INIT;
        Moeep__V1__Response resp = MOEEP__V1__RESPONSE__INIT;
        Moeep__V1__ClientInfo *infos = NULL, **ptrs = NULL;
        struct session *o;
        size_t n = 0;
        int r;

        infos = calloc(d->nsessions + 1, sizeof(*infos));
        ptrs = calloc(d->nsessions + 1, sizeof(*ptrs));
        if (!infos || !ptrs) {
                r = errmsg_set(errmsg, -ENOMEM, "ClientsList of %" PRIu32 " sessions: out of memory",
                               d->nsessions);
                goto out;
        }
        TAILQ_FOREACH (o, &d->sessions, entry) {
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
        clients.clients = ptrs;
        resp.body_case = MOEEP__V1__RESPONSE__BODY_CLIENTS;
        resp.clients = &clients;
        clients.n_clients = n;
        r = query_send_listing(s, request_id, &resp, &clients.n_clients, "client");
out:
        free(infos);
        free(ptrs);
        return r;
}

int query_metrics(struct session *s, uint64_t request_id, char *errmsg) {
        Moeep__V1__Response resp = MOEEP__V1__RESPONSE__INIT;
        Moeep__V1__Metrics *m;
        int r;

        r = metrics_snapshot(s->daemon, &m);
        if (r < 0)
                return errmsg_set(errmsg, r, "MetricsGet: out of memory");
        resp.body_case = MOEEP__V1__RESPONSE__BODY_METRICS;
        resp.metrics = m;
        r = session_respond(s, request_id, &resp, NULL, 0);
        metrics_snapshot_free(m);
        return r;
}

int query_nics(struct session *s, uint64_t request_id, char *errmsg) {
        Moeep__V1__Response resp = MOEEP__V1__RESPONSE__INIT;
        Moeep__V1__Nics *nics;
        int r;

        r = nics_scan(NICS_SYSFS_ROOT, &nics, errmsg);
        if (r < 0)
                return r;
        resp.body_case = MOEEP__V1__RESPONSE__BODY_NICS;
        resp.nics = nics;
        r = session_respond(s, request_id, &resp, NULL, 0);
        nics_free(nics);
        return r;
}

static int peer_address_cmp(const void *a, const void *b) {
        const struct mesh_peer *p = *(const struct mesh_peer *const *)a,
                               *q = *(const struct mesh_peer *const *)b;

        return strcmp(p->address, q->address);
}

int query_mesh(struct session *s, uint64_t request_id, char *errmsg) {
        const struct mesh *mesh = s->daemon->mesh;
        Moeep__V1__Mesh m = MOEEP__V1__MESH__INIT;
        Moeep__V1__Response resp = MOEEP__V1__RESPONSE__INIT;
        Moeep__V1__MeshPeer *infos = NULL, **ptrs = NULL;
        const struct mesh_peer *p, **sorted = NULL;
        size_t count = 0, n = 0;
        int r;

        /* The peers' addresses describe the cluster, not the caller's job. */
        r = admin_check(s, "MeshList", errmsg);
        if (r < 0)
                return r;
        m.address = (char *)"";
        if (mesh) {
                m.enabled = true;
                m.address = (char *)mesh->address;
                m.keyed = mesh->keyed;
                TAILQ_FOREACH (p, &mesh->peers, entry)
                        count++;
        }
        infos = calloc(count + 1, sizeof(*infos));
        ptrs = calloc(count + 1, sizeof(*ptrs));
        sorted = calloc(count + 1, sizeof(*sorted));
        if (!infos || !ptrs || !sorted) {
                r = errmsg_set(errmsg, -ENOMEM, "MeshList of %zu peers: out of memory", count);
                goto out;
        }
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
        m.peers = ptrs;
        m.n_peers = n;
        resp.body_case = MOEEP__V1__RESPONSE__BODY_MESH;
        resp.mesh = &m;
        r = query_send_listing(s, request_id, &resp, &m.n_peers, "mesh peer");
out:
        free(infos);
        free(ptrs);
        free(sorted);
        return r;
}
