/* Status, job and client listings (StatusGet, JobsList, ClientsList), and
 * the operator queries MetricsGet, NicsList and MeshList.
 *
 * Sessions of the admin socket see everything. On the client socket (what
 * containers are given) a session sees only its own job and that job's
 * members, or only itself when not in a job, whatever its uid: StatusGet
 * counts only those, and says the version, uptime, pid, draining and log
 * level. MetricsGet (node-wide totals, the same as the HTTP listener) and
 * NicsList (the node's NICs) are answered on both sockets; MeshList (the
 * peer daemons' addresses) only on the admin socket (its row in
 * proto/messages.def says so, and requests.c refuses it elsewhere). The job secret is
 * never part of any answer. Every listing is linear in what it lists.
 *
 * Each query fills a struct query_response from the objects it is handed
 * (the viewer's registry of sessions is its own, s->reg) and returns; it
 * sends nothing. requests.c sends `resp` and then calls
 * query_response_done(). */
#ifndef MOEEPD_QUERY_H
#define MOEEPD_QUERY_H

#include <stdbool.h>
#include <stdint.h>

#include "moeep.pb-c.h"

struct jobs;
struct mesh;
struct mesh_jobs;
struct metrics;
struct session;

/* One answer: `resp` and everything it points to. */
struct query_response {
        Moeep__V1__Response resp; /* what to send; its body points into the fields below */
        union {
                Moeep__V1__Status status;
                Moeep__V1__Jobs jobs;
                Moeep__V1__Clients clients;
                Moeep__V1__Mesh mesh;
        } body;
        void *owned[6];              /* owns; the listing's arrays */
        Moeep__V1__Metrics *metrics; /* owns; MetricsGet's snapshot */
        Moeep__V1__Nics *nics;       /* owns; NicsList's scan */
};

/* Each fills *ret for viewer `s`: 0, or -errno with errmsg (*ret is then
 * still to be freed). */
/* StatusGet: the sessions and jobs `s` sees, the uptime (metrics.h), the
 * drain. */
int query_status(const struct jobs *jobs, const struct metrics *m, const struct session *s,
                 struct query_response *ret, char *errmsg);
/* JobsList: with where the ranks of a job that spans daemons are. */
int query_jobs(const struct jobs *jobs, const struct mesh_jobs *mj, const struct session *s,
               struct query_response *ret, char *errmsg);
int query_clients(const struct session *s, struct query_response *ret, char *errmsg);
/* MetricsGet: a snapshot of the metrics (metrics.h); the same for everyone. */
int query_metrics(const struct metrics *m, const struct session *s, struct query_response *ret, char *errmsg);
/* NicsList: the RDMA devices and the GPU -> NIC mapping (nics.h). */
int query_nics(const struct session *s, struct query_response *ret, char *errmsg);
/* MeshList: the peer daemons of the mesh (mesh.h; NULL when it is off);
 * admin sessions only. */
int query_mesh(const struct mesh *mesh, const struct session *s, struct query_response *ret, char *errmsg);

/* Frees what a query filled. */
void query_response_done(struct query_response *q);

#endif
