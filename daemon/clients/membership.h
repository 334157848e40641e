/* A rank's lifecycle at this daemon, written once, in one order: a session
 * joins a job (here, or at the job's home daemon through the mesh),
 * registers and releases regions while a member, and leaves or is lost.
 * Every step tells the objects below in the same order: the data path
 * (proxy regions and channels), the broker (regions), the mesh (the job's
 * other daemons), then the job itself.
 *
 * A join that names another daemon is forwarded there, and that daemon's
 * answer (PeerJoined, for which this module subscribes to the mesh) makes
 * the session a member of a mirror of the job here.
 *
 * Who calls what: daemon.c makes it (membership_init()) after the mesh,
 * the jobs across daemons and the data path, which it calls. requests.c
 * calls these for JobJoin, RegionRegister, RegionRelease and JobLeave, and
 * when a session ends. membership.c writes struct session's `member` and
 * its READY state, nothing else of it. */
#ifndef MOEEPD_MEMBERSHIP_H
#define MOEEPD_MEMBERSHIP_H

#include <stdbool.h>
#include <stdint.h>
#include <sys/queue.h>

#include "moeep.pb-c.h"

struct broker;
struct datapath;
struct job_member;
struct jobs;
struct mesh;
struct mesh_jobs;
struct session;

struct forward; /* a join forwarded to another daemon (membership.c) */
TAILQ_HEAD(forward_list, forward);

/* The objects a lifecycle step tells (none owned here), and the joins
 * waiting for another daemon's answer. */
struct membership {
        struct jobs *jobs;
        struct broker *broker;
        struct datapath *datapath;    /* NULL unless the mesh is on */
        struct mesh *mesh;            /* NULL unless the mesh is on */
        struct mesh_jobs *mesh_jobs;  /* NULL unless the mesh is on */
        struct forward_list forwards; /* owns; each holds a reference on its session */
        uint64_t next_token;
};

/* Fills `ms` with the objects it calls and subscribes to `mesh` (when on)
 * for the answers to forwarded joins. Returns 0. */
int membership_init(struct membership *ms, struct jobs *jobs, struct broker *broker, struct mesh *mesh,
                    struct mesh_jobs *mesh_jobs, struct datapath *datapath);

/* Drops the forwarded joins (no answer is sent: the daemon stops) and
 * unsubscribes. Call after the sessions left their jobs, before the mesh
 * is freed. */
void membership_done(struct membership *ms);

/* JobJoin from `s` (request `rid`): forwarded to the job's home daemon
 * when the unique id names another one (the reply comes later), else
 * joined here, JobJoined queued and the job's other daemons told. Returns
 * 0 or -errno with errmsg. */
int membership_join(struct membership *ms, struct session *s, uint64_t rid, const Moeep__V1__JobJoin *jj,
                    char *errmsg);

/* A join of `s` named no job it may join (ERROR_NO_SUCH_JOB, here or at
 * the job's home daemon): counted against its uid's allowance (uids.h). */
void membership_join_failed(struct session *s);

/* `s` became member `m`: READY, and JobJoined (request `rid`) with the
 * control page queued. Returns 0 or -errno from session_respond(). */
int membership_joined(struct session *s, uint64_t rid, struct job_member *m);

/* RegionRegister of `s` with fd `*fd` (set to -1 once the broker took it):
 * to the data path for a proxy role, else to the broker, then the mesh.
 * Returns 0 with *ret_id or -errno with errmsg. */
int membership_register(const struct membership *ms, struct session *s, const Moeep__V1__RegionRegister *rr,
                        int *fd, uint64_t *ret_id, char *errmsg);

/* RegionRelease of region `id` of `s`: data path, broker, mesh. */
int membership_release(const struct membership *ms, struct session *s, uint64_t id, char *errmsg);

/* `s` leaves its job (`lost` false: JobLeave) or is lost (its session
 * failed): data path, broker, mesh, job, in that order; `s` is no longer a
 * member afterwards (HELLO after a leave). Does nothing when `s` is not a
 * member. */
void membership_end(const struct membership *ms, struct session *s, bool lost, const char *reason);

#endif
