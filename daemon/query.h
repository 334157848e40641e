/* Status, job and client listings (StatusGet, JobsList, ClientsList), and
 * the operator queries MetricsGet, NicsList and MeshList.
 *
 * Sessions of the admin socket see everything. On the client socket (what
 * containers are given) a session sees only its own job and that job's
 * members, or only itself when not in a job, whatever its uid: StatusGet
 * counts only those, and says the version, uptime, pid, draining and log
 * level. MetricsGet (node-wide totals, the same as the HTTP listener) and
 * NicsList (the node's NICs) are answered on both sockets; MeshList (the
 * peer daemons' addresses) only on the admin socket. The job secret is
 * never part of any answer. Every listing is linear in what it lists. */
#ifndef MOEEPD_QUERY_H
#define MOEEPD_QUERY_H

#include <stdbool.h>
#include <stdint.h>

struct session;

/* Each queues its response on `s`; 0 or -errno with errmsg. */
int query_status(struct session *s, uint64_t request_id, char *errmsg);
int query_jobs(struct session *s, uint64_t request_id, char *errmsg);
int query_clients(struct session *s, uint64_t request_id, char *errmsg);
/* MetricsGet: a snapshot of the metrics (metrics.h); the same for everyone. */
int query_metrics(struct session *s, uint64_t request_id, char *errmsg);
/* NicsList: the RDMA devices and the GPU -> NIC mapping (nics.h). */
int query_nics(struct session *s, uint64_t request_id, char *errmsg);
/* MeshList: the peer daemons of the mesh (mesh.h). */
int query_mesh(struct session *s, uint64_t request_id, char *errmsg);

#endif
