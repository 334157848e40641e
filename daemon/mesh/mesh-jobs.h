/* Jobs across daemons: the layer above the mesh's peers (mesh.h) that makes
 * one job of ranks joined at several moeepd daemons (mesh-jobs.c; the
 * forwarded joins in mesh-joins.c, mesh-jobs-internal.h is what the two
 * share).
 *
 * The daemon named in a job's unique id (job.h) is its home. A JobJoin
 * that names another daemon is forwarded there (mesh_jobs_join_forward());
 * the home adds a member with `remote` set whose owner is a struct
 * mesh_rank, and the joining daemon adds its session to a mirror of the job
 * (jobs_join_mirror()). Barrier, leave and loss of a mirror's members go to
 * the home; the home's answers (barrier done, rank lost, the rank -> node
 * map) come back, and regions registered at one daemon are listed at the
 * others. When a peer goes down, the home declares every rank that joined
 * through it lost, and a mirror whose home went down is aborted with
 * PeerLost for every remote rank. Only metadata crosses the mesh: memory of
 * remote ranks is reached through the transports (transport.h), never as
 * fds.
 *
 * Who calls what:
 *  - daemon.c creates it after the mesh (mesh_jobs_new()), giving it the
 *    mesh, the job registry and struct mesh_jobs_hooks, and frees it
 *    before the mesh, once the sessions left their jobs.
 *  - It registers itself with the mesh (mesh_client_set()): the peer layer
 *    hands it every job message of a connection that is up, and tells it
 *    when a peer comes up or goes down.
 *  - membership.c, requests.c, query.c (through the view) and datapath.c
 *    (through daemon.c's datapath_hooks) call the functions below;
 *    everything it must tell a session or the daemon goes through the
 *    hooks, never through struct daemon.
 *
 * Who owns what: struct mesh_jobs owns the forwarded joins (each holds a
 * session reference) and the struct mesh_rank of every remote member of
 * a home job (the job owns the member itself). The per-job state of a job
 * that spans daemons (the mirror's rank -> node map, the remote ranks'
 * regions) is a struct mesh_job made here, reached from job->mesh and
 * freed by job.c with the job. */
#ifndef MOEEPD_MESH_JOBS_H
#define MOEEPD_MESH_JOBS_H

#include <stdbool.h>
#include <stdint.h>

#include "moeep.pb-c.h"
#include "state/job.h"

struct mesh;
struct mesh_jobs;
struct session;

/* What the jobs across daemons need from the daemon and its sessions.
 * Every member is set. */
struct mesh_jobs_hooks {
        void *arg; /* handed to status_changed and stopping */
        /* Ranks joined, left or were lost: the daemon's status changed. */
        void (*status_changed)(void *arg);
        /* Whether the daemon is shutting down (a forwarded join is refused). */
        bool (*stopping)(void *arg);
        /* The protocol ErrorCode of a -errno (or -ERROR_KIND_*) value. */
        Moeep__V1__ErrorCode (*error_code)(int error);
        /* A forwarded join holds its session while it waits. */
        void (*session_ref)(struct session *s);
        void (*session_unref)(struct session *s);
        /* The session's id, for log lines. */
        uint64_t (*session_id)(const struct session *s);
        /* The session's uid: a mirror's control page is charged to it. */
        uid_t (*session_uid)(const struct session *s);
        /* Whether the session is still open and in no job (the home's
         * answer may make it a mirror's member). */
        bool (*session_can_join)(const struct session *s);
        /* The forwarded join of request `request_id` failed: sends Error
         * `code` with `message`, unless the session is closed. */
        void (*join_failed)(struct session *s, uint64_t request_id, int code, const char *message);
        /* It succeeded: `m` is the session's member of the mirror. */
        int (*joined)(struct session *s, uint64_t request_id, struct job_member *m);
        /* Rank `rank` of `job`, at another daemon, released its receive or
         * counter region or left: routes to it lead nowhere from now on
         * (datapath_remote_rank_gone()). */
        void (*remote_rank_gone)(void *arg, const struct job *job, uint32_t rank);
};

/* The per-job state of a job that spans daemons (opaque outside
 * mesh-jobs.c; job.h's job->mesh). */
struct mesh_job;

/* Starts the jobs across daemons over `mesh` and registers with it.
 * Returns 0 (with *ret NULL when the mesh is off, `mesh` NULL) or -ENOMEM. */
int mesh_jobs_new(struct mesh *mesh, struct jobs *jobs, const struct mesh_jobs_hooks *hooks,
                  struct mesh_jobs **ret);

/* Fails the forwarded joins, takes every connection of the mesh down and
 * lets go of the remote members; unregisters from the mesh, which is freed
 * after. Accepts NULL. */
void mesh_jobs_free(struct mesh_jobs *mj);

/* Forwards session `s`'s JobJoin (request `rid`) to the job's home daemon
 * `home` (from the unique id, as the client sent it), which must be one of
 * mesh_peers in some spelling: nothing else is ever dialled. Returns 0 when
 * the reply is held back (hooks->joined or ->join_failed follows), or
 * an error kind (errors.h) with errmsg naming the address: NO_SUCH_JOB when
 * the mesh is off (`mj` NULL) or `home` is not a configured peer,
 * INVALID_ARGUMENT when it is no address or this daemon, or when `s`
 * already waits for one; or -ENOMEM. */
int mesh_jobs_join_forward(struct mesh_jobs *mj, struct session *s, uint64_t rid,
                           const Moeep__V1__JobJoin *jj, const char *home, char *errmsg);

/* Member `m` of a mirror entered its barrier (job_barrier() returned 1):
 * asks the home. */
void mesh_jobs_barrier(struct mesh_jobs *mj, struct job_member *m);

/* Member `m` of a mirror is about to leave (`lost` false) or be lost: tells
 * the home. Call before job_member_leave() / job_member_lost(). */
void mesh_jobs_member_gone(struct mesh_jobs *mj, struct job_member *m, bool lost, const char *reason);

/* Member `m` (a rank at this daemon) registered (`released` false) or
 * released a region: tells the home, or for a home job the daemons with
 * ranks of it, so that their RegionsFetch lists it as remote. `proxy` is
 * its Moeep__V1__ProxyRole and `rkey` (NULL: none) where the other
 * daemons' transports write into it (datapath.h). */
void mesh_jobs_region_changed(struct mesh_jobs *mj, const struct job_member *m, uint64_t region_id,
                              uint32_t tag, uint32_t kind, uint64_t size, bool released, uint32_t proxy,
                              const struct tp_rkey *rkey);

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
