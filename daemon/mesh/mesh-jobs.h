/* Jobs across daemons: the layer above the mesh's peers (mesh.h) that makes
 * one job of ranks joined at several moeepd daemons.
 *
 * The daemon named in a job's unique id (job.h) is its home. A JobJoin
 * that names another daemon is forwarded there (clients/membership.c);
 * the home adds a member with `remote` set whose owner is a struct
 * mesh_rank, and the joining daemon adds its session to a mirror of the job
 * (jobs_join_mirror()). Barrier, leave and loss of a mirror's members go to
 * the home; the home's answers (barrier done, rank lost, the rank -> node
 * map) come back, and regions registered at one daemon are listed at the
 * others. When a peer goes down, the home declares every rank that joined
 * through it lost, and a mirror whose home went down is aborted with
 * PeerLost for every remote rank. Only metadata crosses the mesh: memory of
 * remote ranks is reached through the transports (datapath/), never as
 * fds.
 *
 * Who calls what: daemon.c makes it after the mesh (mesh_jobs_new()) and
 * frees it before the mesh, once the sessions left their jobs. It
 * subscribes to the mesh for the job messages (MESH_OWNER_JOBS) and the
 * peers' news; what the data path must learn (a remote rank gone) it tells
 * the mesh's subscribers (mesh_rank_gone()). The data path and the clients'
 * floor call the functions below.
 *
 * Who owns what: struct mesh_jobs owns the struct mesh_rank of every
 * remote member of a home job (the job owns the member itself). The
 * per-job state of a job that spans daemons (the mirror's rank -> node map,
 * the remote ranks' regions) is a struct mesh_job made here, reached from
 * job->mesh and freed by job.c with the job. */
#ifndef MOEEPD_MESH_JOBS_H
#define MOEEPD_MESH_JOBS_H

#include <stdbool.h>
#include <stdint.h>

#include "state/job.h"

struct mesh;
struct mesh_jobs;

/* The per-job state of a job that spans daemons (opaque outside
 * mesh-jobs.c; job.h's job->mesh). */
struct mesh_job;

/* Starts the jobs across daemons over `mesh` and subscribes to it.
 * Returns 0 (with *ret NULL when the mesh is off, `mesh` NULL) or -ENOMEM. */
int mesh_jobs_new(struct mesh *mesh, struct jobs *jobs, struct mesh_jobs **ret);

/* Takes every connection of the mesh down and lets go of the remote
 * members; unsubscribes from the mesh, which is freed after. Accepts NULL. */
void mesh_jobs_free(struct mesh_jobs *mj);

/* The daemon is shutting down: joins from other daemons are refused
 * (ERROR_DRAINING) from now on. Accepts NULL. */
void mesh_jobs_stop(struct mesh_jobs *mj);

/* Member `m` of a mirror entered its barrier (job_barrier() returned 1):
 * asks the home. */
void mesh_jobs_barrier(struct mesh_jobs *mj, struct job_member *m);

/* Member `m` of a mirror is about to leave (`lost` false) or be lost: tells
 * the home. Call before job_member_leave() / job_member_lost(). */
void mesh_jobs_member_gone(struct mesh_jobs *mj, struct job_member *m, bool lost, const char *reason);

/* Member `m` (a rank at this daemon) registered (`released` false) or
 * released a region: tells the home, or for a home job the daemons with
 * ranks of it, so that their RegionsFetch lists it as remote. `proxy` is
 * its enum region_role (datapath.h) and `rkey` (NULL: none) where the other
 * daemons' transports write into it (datapath/datapath.h). */
void mesh_jobs_region_changed(struct mesh_jobs *mj, const struct job_member *m, uint64_t region_id,
                              uint32_t tag, uint32_t kind, uint64_t size, bool released, uint32_t proxy,
                              const struct job_rkey *rkey);

/* Rank `rank` of `job` (at this daemon) cannot go on (its channel failed):
 * aborts the job here naming it and tells the home, which tells the other
 * daemons, as a lost rank. The member stays until its session leaves. */
void mesh_jobs_rank_failed(struct mesh_jobs *mj, struct job *job, uint32_t rank, const char *reason);

/* A local rank of home job `job` joined: tells the daemons with ranks of it
 * the new rank -> node map. */
void mesh_jobs_changed(struct mesh_jobs *mj, const struct job *job);

/* The rank -> node map of `job` as this daemon knows it: for a home job
 * from its members, for a mirror as the home last said. Returns false for
 * a job that does not span daemons (every entry ""). */
bool mesh_jobs_nodes(const struct mesh_jobs *mj, const struct job *job, struct job_node ret[MOEEP_MAX_RANKS]);

/* The regions of `job`'s ranks at other daemons: *ret_n of them (0 and
 * NULL for a job that has none). */
const struct job_remote_region *mesh_jobs_remote_regions(const struct job *job, uint32_t *ret_n);

/* The callbacks of the members that stand for remote ranks. */
extern const struct job_callbacks mesh_rank_callbacks;

#endif
