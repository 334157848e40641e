/* A rank's lifecycle at this daemon, written once, in one order: a session
 * creates a job or joins one (here, or at the job's home daemon through the
 * mesh), passes barriers, registers, fetches and releases regions, opens
 * proxy channels while a member, and leaves or is lost. Every step tells
 * the objects below in the same order: the data path (proxy regions and
 * channels), the broker (regions), the mesh (the job's other daemons), then
 * the job itself. A join that names another daemon is forwarded there, and
 * that daemon's answer (PeerJoined, for which this module subscribes to
 * the mesh) makes the session a member of a mirror of the job here.
 *
 * The calls take the daemon's own types: requests.c translates each
 * request's message into them, and builds the answers of the steps that
 * return one (create, fetch, channel). The steps whose answer may come
 * later send it themselves: a join (JobJoined, with the control page), a
 * registration (RegionRegistered: one completion whether the fd was
 * attached or taken from the client's process), a barrier (through the
 * jobs' callbacks, membership_job_callbacks, which also send PeerLost).
 *
 * Who calls what: daemon.c makes it (membership_init()) after the mesh,
 * the jobs across daemons and the data path, which it calls, and hands the
 * job registry membership_job_callbacks. requests.c calls the steps.
 * membership.c writes struct session's `member` and its READY state,
 * nothing else of it. */
#ifndef MOEEPD_MEMBERSHIP_H
#define MOEEPD_MEMBERSHIP_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/queue.h>

#include "datapath/datapath.h" /* struct region_spec */
#include "record.h"            /* MOEEP_RECORD_MAX_FDS */
#include "state/clientfd.h"    /* enum region_kind */
#include "state/job.h"         /* MOEEP_UNIQUE_ID_BYTES */

struct broker;
struct datapath;
struct job;
struct job_member;
struct jobs;
struct mesh;
struct mesh_jobs;
struct metrics;
struct session;

struct forward; /* a join forwarded to another daemon (membership.c) */
TAILQ_HEAD(forward_list, forward);

/* The objects a lifecycle step tells (none owned here), and the joins
 * waiting for another daemon's answer. */
struct membership {
        struct metrics *metrics; /* counts jobs created and regions registered */
        struct jobs *jobs;
        struct broker *broker;
        struct datapath *datapath;    /* NULL unless the mesh is on */
        struct mesh *mesh;            /* NULL unless the mesh is on */
        struct mesh_jobs *mesh_jobs;  /* NULL unless the mesh is on */
        struct forward_list forwards; /* owns; each holds a reference on its session */
        uint64_t next_token;
};

/* What a JobJoin asks. */
struct membership_join_args {
        const uint8_t *unique_id; /* as the client sent it: the job, its secret, maybe its home daemon */
        size_t unique_id_len;
        uint32_t rank;
        uint32_t world_size;
        const char *gpu_uuid;
};

/* One region a RegionsFetch answers with. */
struct membership_region {
        uint32_t rank;
        uint32_t tag;
        enum region_kind kind;
        uint64_t size;
        uint64_t region_id; /* at the rank's daemon */
        bool remote;        /* the rank is at another daemon: metadata only */
        int fd;             /* not owning (the broker's); -1 when remote */
};

/* Fills `ms` with the objects it calls and subscribes to `mesh` (when on)
 * for the answers to forwarded joins. Returns 0. */
int membership_init(struct membership *ms, struct metrics *metrics, struct jobs *jobs, struct broker *broker,
                    struct mesh *mesh, struct mesh_jobs *mesh_jobs, struct datapath *datapath);

/* Drops the forwarded joins (no answer is sent: the daemon stops) and
 * unsubscribes. Call after the sessions left their jobs, before the mesh
 * is freed. */
void membership_done(struct membership *ms);

/* JobCreate of `s`: a job of `world_size` ranks named `name`, created by
 * `s` (and charged to its uid). Refused with ERROR_KIND_DRAINING while the
 * daemon stops or drains. Returns 0 with *ret_job, or -errno with
 * errmsg. */
int membership_create(struct membership *ms, struct session *s, const char *name, uint32_t world_size,
                      struct job **ret_job, char *errmsg);

/* The unique id of `job` to hand its creator, naming this daemon when the
 * mesh is on; returns its length. */
size_t membership_unique_id(const struct membership *ms, const struct job *job,
                            uint8_t ret[static MOEEP_UNIQUE_ID_BYTES]);

/* JobJoin from `s` (request `rid`): forwarded to the job's home daemon
 * when the unique id names another one (the reply comes later), else
 * joined here, JobJoined queued and the job's other daemons told. Returns
 * 0 or -errno with errmsg. */
int membership_join(struct membership *ms, struct session *s, uint64_t rid,
                    const struct membership_join_args *j, char *errmsg);

/* Barrier of `s` (request `rid`): the reply comes when every rank entered
 * it (the job's barrier_done callback), here or at the job's home daemon.
 * Returns 0, or -errno with errmsg. */
int membership_barrier(struct membership *ms, struct session *s, uint64_t rid, char *errmsg);

/* RegionRegister of `s` (request `rid`) with fd `*fd` attached (set to -1
 * once the check has it): its kind is checked off the loop, in the uid's
 * closer queue (clientfd_check_async()), then it goes to the data path for
 * a proxy role, else to the broker, then the mesh; the session reads
 * nothing more until the reply (RegionRegistered, or Error) is queued.
 * Returns 0 (nothing more for the caller to send), or -errno with errmsg
 * when it could not start (the fd is still the caller's, the session reads
 * on). */
int membership_register(struct membership *ms, struct session *s, uint64_t rid,
                        const struct region_spec *spec, int *fd, char *errmsg);

/* RegionRegister of `s` (request `rid`) naming descriptor `number` of its
 * own process instead (FEATURE_PIDFD, protocol 1.4): the daemon takes it
 * and checks its kind (clientfd_take(): SO_PEERPIDFD, pidfd_getfd, off the
 * loop) and registers it exactly like an attached one; the session reads
 * nothing more until the reply (RegionRegistered, or Error naming the fd
 * number) is queued. Returns 0 (nothing more for the caller to send), or
 * -errno with errmsg when it could not start (no fd taken, the session
 * reads on). */
int membership_register_take(struct membership *ms, struct session *s, uint64_t rid,
                             const struct region_spec *spec, int64_t number, char *errmsg);

/* RegionRelease of region `id` of `s`: data path, broker, mesh. */
int membership_release(struct membership *ms, struct session *s, uint64_t id, char *errmsg);

/* RegionsFetch of `s`: the regions it may receive of rank `rank` (-1:
 * every other rank) with tag `tag` (-1: any), those of ranks here first
 * (with their fds) and then, with `remote`, those of ranks at other
 * daemons (metadata only). Returns 0 with ret[0 .. *ret_n), or -errno
 * with errmsg (ERROR_KIND_LIMIT_EXCEEDED past MOEEP_RECORD_MAX_FDS). */
int membership_fetch(const struct membership *ms, const struct session *s, int32_t rank, int64_t tag,
                     bool remote, struct membership_region ret[MOEEP_RECORD_MAX_FDS], size_t *ret_n,
                     char *errmsg);

/* ChannelOpen of `s`: a descriptor ring of `capacity` (0: the default)
 * whose descriptor peer r goes to rank r of its job. Returns 0 with the
 * ring's fd (the caller's), id, capacity and number of routes, or -errno
 * with errmsg (datapath_channel_open()). */
int membership_channel_open(struct membership *ms, struct session *s, uint32_t capacity, int *ret_fd,
                            uint64_t *ret_ring_id, uint32_t *ret_capacity, uint32_t *ret_routes,
                            char *errmsg);

/* JobLeave of `s`: data path, broker, mesh, job, in that order; `s` is in
 * no job afterwards (HELLO). */
void membership_leave(struct membership *ms, struct session *s);

/* `s` ends (its session failed, `why`): it is lost to its job (data path,
 * broker, mesh, job: the job is aborted) and gives up the jobs it created. */
void membership_gone(struct membership *ms, struct session *s, const char *why);

/* The callbacks jobs use to reach their members' sessions (the owner of
 * every local member is its struct session): barrier replies, PeerLost. */
extern const struct job_callbacks membership_job_callbacks;

#endif
