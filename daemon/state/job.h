/* Jobs: the ranks of one EP group, their membership, barrier and control
 * page. job.c knows nothing about sockets: a member's owner is an opaque
 * pointer (a session in moeepd, anything in the unit tests) and everything
 * the job must tell its members goes through struct job_callbacks. */
#ifndef MOEEPD_JOB_H
#define MOEEPD_JOB_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/queue.h>
#include <sys/types.h>

#include "log.h" /* ERRMSG_MAX */
#include "moeep_job.h"
#include "names.h" /* MOEEP_JOB_NAME_MAX, MOEEP_GPU_UUID_MAX */

struct clientfds;
struct config;
struct mesh_job;
struct region;

#define JOB_SECRET_BYTES 32
/* Room for a daemon's mesh address ("HOST:PORT", an IPv6 literal at most). */
#define JOB_NODE_MAX 71

/* Unique id layout (opaque to clients): byte 0 the format version
 * (JOB_UNIQUE_ID_VERSION), bytes 1..8 the job id (little-endian u64),
 * bytes 9..40 the secret. JobCreated carries these JOB_UNIQUE_ID_BYTES
 * bytes; JobJoin accepts them followed by up to MOEEP_UNIQUE_ID_BYTES in all
 * (clients may send their zero-padded 128-byte copy). When the creating
 * daemon's mesh is on, byte 41 is the length L (1..JOB_NODE_MAX) of its mesh
 * address and bytes 42..41+L the address ("HOST:PORT"): a daemon that gets
 * a JobJoin naming another daemon forwards it there (mesh-jobs.c). Byte 41 zero
 * (or absent) means "the daemon that receives the join". */
#define JOB_UNIQUE_ID_VERSION 1
#define JOB_UNIQUE_ID_BYTES (1 + 8 + JOB_SECRET_BYTES)
#define JOB_UNIQUE_ID_NODE_OFFSET JOB_UNIQUE_ID_BYTES

enum job_state {
        JOB_FORMING, /* fewer than world_size ranks joined */
        JOB_READY,   /* every rank joined */
        JOB_ABORTED, /* a member was lost; final */
};

const char *job_state_to_string(enum job_state s);

struct job;

/* How a job talks to its members' owners. Called synchronously from inside
 * job_*() calls, so they must only queue work (never free a member or call
 * back into job.c). */
struct job_callbacks {
        /* A barrier the member entered with `request_id` finished: error 0
         * when every rank arrived, -ERROR_KIND_PEER_LOST when a rank was lost
         * (the job is aborted; job->lost_rank names it),
         * -ERROR_KIND_NOT_IN_JOB when the member left the job while waiting
         * (error kinds: errors.h). */
        void (*barrier_done)(void *owner, const struct job *job, uint64_t request_id, int error);
        /* Rank `rank` of the member's job was lost; the job is aborted. */
        void (*peer_lost)(void *owner, const struct job *job, uint32_t rank, const char *reason);
};

/* Which daemon a rank of a job that spans daemons is at. */
struct job_node {
        char address[JOB_NODE_MAX + 1]; /* mesh address of its daemon, "" = not joined (or unknown) */
};

TAILQ_HEAD(region_list, region);

/* Where a rank's daemon registered a region with its transport: what a
 * writer at another daemon names (datapath/transport.h's struct tp_rkey,
 * field for field; it travels in PeerRegion). */
struct job_rkey {
        uint64_t base;
        uint64_t key;
        uint64_t length;
};

/* A region of a rank joined at another daemon: metadata only (mesh-jobs.c). */
struct job_remote_region {
        uint32_t rank;
        uint32_t tag;
        uint32_t kind; /* enum region_kind (clientfd.h) */
        uint64_t size;
        uint64_t region_id;   /* at the rank's daemon */
        uint32_t proxy;       /* enum region_role (datapath.h); RECV and COUNTERS come with `rkey` */
        struct job_rkey rkey; /* where the rank's daemon registered it with its transport */
};

/* Most remote regions one job lists: every rank's max_regions_per_session
 * at its largest. */
#define JOB_REMOTE_REGIONS_MAX (MOEEP_MAX_RANKS * 64)

struct job_member {
        struct job *job; /* holds a reference */
        uint32_t rank;
        char gpu_uuid[MOEEP_GPU_UUID_MAX + 1];
        void *owner; /* not owning; handed to the callbacks */
        /* Not owning; the callbacks for this member, NULL = the registry's
         * (sessions). The mesh sets its own for the members that stand for
         * ranks at another daemon (`remote`). */
        const struct job_callbacks *cb;
        bool remote;     /* stands for a rank joined at another daemon (home job only) */
        bool in_barrier; /* waiting; barrier_request_id is held back */
        uint64_t barrier_request_id;
        struct region_list regions; /* owns; filled by broker.c, empty when the member goes */
        uint32_t nregions;
};

/* Descriptors of a job's control page (the memfd and its read-only
 * reopening), charged to the uid whose session made the job (clientfd.h). */
#define JOB_CONTROL_FDS 2

/* The owner_uid of a mirror (below): nobody created it here, so it counts
 * against no uid's max_jobs_per_uid (had it a uid, say root's, anyone who
 * joins jobs of other daemons from here would spend that uid's allowance).
 * Mirrors have their own cap, per home daemon: max_mirrors_per_peer.
 * (uid_t)-1 is no process's uid (chown(2) reads it as "leave it alone");
 * listings show it as none. */
#define JOB_OWNER_NONE ((uid_t)-1)

struct job {
        uint64_t id; /* public, daemon-wide unique, never reused */
        char name[MOEEP_JOB_NAME_MAX + 1];
        uint32_t world_size;
        uid_t owner_uid;      /* the creator's, for max_jobs_per_uid; JOB_OWNER_NONE: a mirror */
        uid_t fds_uid;        /* charged for the control page's fds (a mirror: its first rank's uid) */
        uint32_t fds_charged; /* how many of them (clientfds_charge()) */
        enum job_state state;
        int32_t lost_rank;                         /* first rank lost, -1 while none */
        uint8_t secret[JOB_SECRET_BYTES];          /* never logged or shown */
        struct job_member *ranks[MOEEP_MAX_RANKS]; /* owns the members; NULL = not joined */
        uint32_t njoined;
        uint64_t barrier_generation;        /* completed barriers */
        uint32_t barrier_arrived;           /* members waiting in the current generation */
        int control_fd;                     /* owns; the sealed memfd */
        int control_ro_fd;                  /* owns; read-only reopening sent to clients, or -1 */
        struct moeep_control_page *control; /* owns a MAP_SHARED writable mapping */
        void *creator;                      /* not owning; holds a reference until jobs_creator_gone() */
        unsigned references;                /* creator + one per member */
        struct jobs *jobs;                  /* not owning; the registry */
        /* Jobs that span daemons (mesh-jobs.h). On the daemon of rank 0
         * (the "home") every rank is a member, the remote ones with
         * member->remote set. Another daemon holds a "mirror" of the job
         * with only its own ranks as members, `home` naming the home daemon
         * and `home_id` the job's id there; barrier, leave and loss go
         * through the home. */
        char home[JOB_NODE_MAX + 1]; /* "" for a job created here */
        uint64_t home_id;            /* the id at `home`; == id when home is "" */
        uint32_t lost_notified;      /* bit r set once rank r was marked lost and PeerLost(r) went out */
        /* Owns; what mesh-jobs.c keeps of a job that spans daemons (the
         * mirror's rank -> daemon map, the remote ranks' regions), opaque
         * here and NULL until it is needed. One allocation: job.c frees it
         * with the job. */
        struct mesh_job *mesh;
        TAILQ_ENTRY(job) entry;
};

TAILQ_HEAD(job_list, job);

/* The daemon's set of jobs. */
struct jobs {
        struct job_list list;
        uint32_t count;
        uint64_t next_id;
        const struct config *config;    /* not owning; caps are read at each call */
        const struct job_callbacks *cb; /* not owning */
        /* Not owning; where the control pages' fds are charged to uids
         * (clientfds_charge()); NULL (unit tests): charged to nobody. */
        struct clientfds *clientfds;
        /* Drain, an operator's (admin.c): JobCreate is refused with
         * ERROR_DRAINING, and the jobs that exist go on. */
        bool draining;
        /* Totals since start-up, for the metrics (moeepd_barriers_total,
         * moeepd_ranks_lost_total). */
        uint64_t barriers_completed; /* barrier generations every rank passed */
        uint64_t ranks_lost;         /* members lost (job_member_lost()) */
};

/* Makes the registry: `cb` reaches the members' owners unless a member has
 * callbacks of its own, `clientfds` (may be NULL) is charged for the
 * control pages' fds. Returns 0 or -ENOMEM. */
int jobs_new(const struct config *config, const struct job_callbacks *cb, struct clientfds *clientfds,
             struct jobs **ret_jobs);
/* Frees every job; members must be gone. Accepts NULL. */
void jobs_free(struct jobs *jobs);

/* Creates a job in state forming, with one reference held by `creator`.
 * Its control page's fds are charged to `uid`. Returns 0,
 * -ERROR_KIND_INVALID_ARGUMENT (name or world size),
 * -ERROR_KIND_LIMIT_EXCEEDED (max_jobs_per_uid, or no room for the control
 * page's fds in the uid's cap or the daemon's budget), or -errno from
 * memfd/getrandom. */
int jobs_create(struct jobs *jobs, const char *name, uint32_t world_size, uid_t uid, void *creator,
                struct job **ret_job, char *errmsg);

/* Writes the job's unique id (JOB_UNIQUE_ID_BYTES) into `buf`. */
void job_unique_id(const struct job *job, uint8_t buf[static JOB_UNIQUE_ID_BYTES]);

/* The same followed by `node` (this daemon's mesh address, see above) when
 * it is not NULL or empty; returns the length written:
 * JOB_UNIQUE_ID_BYTES, plus 1 + strlen(node) with a node. */
size_t job_unique_id_with_node(const struct job *job, const char *node,
                               uint8_t buf[static MOEEP_UNIQUE_ID_BYTES]);

/* The daemon named in a unique id (see above) into `ret_node`
 * (JOB_NODE_MAX + 1 bytes): "" when it names none. Returns 0, or -EINVAL
 * for a malformed id. */
int job_unique_id_node(const uint8_t *unique_id, size_t len, char ret_node[static JOB_NODE_MAX + 1]);

/* Mirror jobs (see struct job): finds the mirror of job `home_id` at
 * daemon `home`, or NULL. */
struct job *jobs_find_mirror(const struct jobs *jobs, const char *home, uint64_t home_id);

/* Joins `owner` (of uid `uid`) as `rank` of the mirror of job `home_id` at
 * `home` (creating the mirror, owned by JOB_OWNER_NONE, with its own
 * control page charged to `uid`, when it is the first local rank). The
 * home daemon already checked secret, rank and world size.
 * Returns 0, -ERROR_KIND_INVALID_ARGUMENT (bad mirror or gpu_uuid),
 * -ERROR_KIND_ALREADY_IN_JOB, -ERROR_KIND_PEER_LOST (mirror aborted),
 * -ERROR_KIND_RANK_TAKEN (rank taken here), -ERROR_KIND_LIMIT_EXCEEDED
 * (max_mirrors_per_peer mirrors of `home`'s jobs, or no room for the
 * control page's fds) or -errno from memfd/ENOMEM. */
int jobs_join_mirror(struct jobs *jobs, const char *home, uint64_t home_id, const char *name,
                     uint32_t world_size, uint32_t rank, const char *gpu_uuid, void *owner, uid_t uid,
                     struct job_member **ret_member, char *errmsg);

/* Aborts the job because rank `rank` (not a member here: remote, or its
 * daemon is gone) was lost: marks the rank in the control page's
 * lost_ranks (every lost rank, not only the first: elastic endpoints go on
 * without them), sets the abort word (once), tells every member peer_lost
 * (once per rank) and ends every waiting barrier with
 * -ERROR_KIND_PEER_LOST.
 * JOB_NO_RANK: no rank was lost (the daemon stops); the control page's
 * stopping word is set, lost_rank stays -1 and nobody is told peer_lost. */
#define JOB_NO_RANK UINT32_MAX
void job_abort(struct job *job, uint32_t rank, const char *reason);

/* job_abort(JOB_NO_RANK) of every job: the daemon is stopping, and kernels
 * of its jobs must not wait for ranks that will soon look lost. */
void jobs_abort_all(struct jobs *jobs, const char *reason);

/* Ends `m`'s barrier wait with `error` (0 or -ERROR_KIND_PEER_LOST) when it waits: the
 * home daemon's answer to a mirror member's barrier. */
void job_barrier_release(struct job_member *m, int error);

/* Whether `rank` of `job` is joined at this daemon (a member that is not
 * remote). */
bool job_rank_local(const struct job *job, uint32_t rank);

/* The fd to send with JobJoined: read-only when the daemon could reopen it. */
int job_control_fd(const struct job *job);

/* Joins the job named by `unique_id` as `rank`. Errors, in order of
 * checking, each an error kind (errors.h) but the last:
 * INVALID_ARGUMENT malformed id or gpu_uuid, NO_SUCH_JOB (no such job, or
 * a secret that does not match: the same answer, so that nobody learns
 * which ids exist),
 * ALREADY_IN_JOB (`owner` already belongs to a job), PEER_LOST (the job is
 * aborted), WORLD_SIZE_MISMATCH, RANK_OUT_OF_RANGE, RANK_TAKEN; -ENOMEM. */
int jobs_join(struct jobs *jobs, const uint8_t *unique_id, size_t len, uint32_t rank, uint32_t world_size,
              const char *gpu_uuid, void *owner, struct job_member **ret_member, char *errmsg);

/* Orderly leave: the rank becomes free again (a forming job stays forming,
 * a ready job goes back to forming); frees `m`. Its regions must be gone. */
void job_member_leave(struct job_member *m);

/* The member's owner died or misbehaved: the job is aborted (control page
 * abort word set, lost_rank recorded), every other member gets peer_lost and
 * every waiting one barrier_done(-ERROR_KIND_PEER_LOST); frees `m`. */
void job_member_lost(struct job_member *m, const char *reason);

/* Enters the barrier of the current generation. Returns 0 when the reply is
 * held back (barrier_done comes later, or already came synchronously when
 * this member was the last to arrive), 1 for a mirror's member (it now
 * waits; the caller asks the home daemon, whose answer comes through
 * job_barrier_release()), -ERROR_KIND_PEER_LOST when the job is aborted,
 * -ERROR_KIND_INVALID_ARGUMENT when the member already waits. */
int job_barrier(struct job_member *m, uint64_t request_id, char *errmsg);

/* `creator` goes away: drops the creator reference of every job it created
 * (freeing the ones without members). */
void jobs_creator_gone(struct jobs *jobs, void *creator);

/* Number of live jobs created by `uid` (mirrors are nobody's: 0 for
 * JOB_OWNER_NONE). */
uint32_t jobs_count_uid(const struct jobs *jobs, uid_t uid);

/* Number of mirrors of jobs whose home is daemon `home`. */
uint32_t jobs_count_mirrors(const struct jobs *jobs, const char *home);

#endif
