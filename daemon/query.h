/* Status, job and client listings (StatusGet, JobsList, ClientsList), and
 * the operator queries MetricsGet and NicsList.
 * Admins (uid 0, the daemon's own uid, members of admin_group) see
 * everything; anyone else sees their own job and its members, or only their
 * own session when not in a job. The job secret is never part of any
 * answer. */
#ifndef MOEEPD_QUERY_H
#define MOEEPD_QUERY_H

#include <stdbool.h>
#include <stdint.h>

struct session;

/* Whether the session's peer is an admin. */
bool query_is_admin(const struct session *s);

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
