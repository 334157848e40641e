/* Jobs across daemons: home and mirror jobs and the barrier, region,
 * leave and loss messages between them; see mesh-jobs.h. The connections
 * they travel on are mesh.c's (mesh.h). */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/queue.h>

#include "errors.h"
#include "log.h"
#include "mesh/mesh-jobs.h"
#include "mesh/mesh.h"
#include "state/job.h"

struct mesh_rank;
TAILQ_HEAD(mesh_rank_list, mesh_rank);

struct mesh_jobs {
        struct mesh *mesh;           /* not owning; the peers */
        struct jobs *jobs;           /* not owning; the registry */
        struct mesh_rank_list ranks; /* owns; remote ranks of our home jobs, in order of joining */
        bool stopping;               /* the daemon is shutting down: joins are refused */
};

/* A rank of one of our home jobs that joined through a peer: the owner of
 * that (remote) member. */
struct mesh_rank {
        struct mesh_jobs *mj;      /* not owning */
        struct mesh_peer *peer;    /* not owning; the rank is lost when the peer goes down */
        struct job_member *member; /* not owning; the job owns it */
        TAILQ_ENTRY(mesh_rank) entry;
};

/* The state of one job that spans daemons (job->mesh): one allocation,
 * freed by job.c with free(). Made when the first of it is needed. */
struct mesh_job {
        /* Mirror: the rank -> daemon map as the home last said (PeerRanks). */
        struct job_node nodes[MOEEP_MAX_RANKS];
        uint32_t nremote_regions;
        bool regions_room; /* remote_regions has room for JOB_REMOTE_REGIONS_MAX */
        /* Regions of ranks at other daemons; room for JOB_REMOTE_REGIONS_MAX
         * once the first arrives (0 before). */
        struct job_remote_region remote_regions[];
};

/* job->mesh, made (without room for regions) when it is missing; NULL
 * when out of memory. */
static struct mesh_job *job_state(struct job *job) {
        if (!job->mesh)
                job->mesh = calloc(1, sizeof(struct mesh_job));
        return job->mesh;
}

/* Whether `s` is a usable mesh address: a word (names.h), short. */
static bool address_valid(const char *s) {
        size_t n = strlen(s);

        return n > 0 && n <= JOB_NODE_MAX && moeep_word_valid(s, n);
}

/* ------------------------------------------------------------ jobs, home side */

static void send_rank_lost(struct mesh_peer *p, uint64_t job_id, uint32_t rank, const char *reason) {
        Moeep__V1__PeerRankLost lost = MOEEP__V1__PEER_RANK_LOST__INIT;
        PEER_MSG(msg, rank_lost, &lost, RANK_LOST);

        lost.job_id = job_id;
        lost.rank = rank;
        lost.reason = (char *)reason;
        mesh_peer_send(p, &msg);
}

static void rank_barrier_done(void *owner, const struct job *job, uint64_t request_id, int error) {
        struct mesh_rank *mr = owner;
        Moeep__V1__PeerBarrierDone done = MOEEP__V1__PEER_BARRIER_DONE__INIT;
        PEER_MSG(msg, barrier_done, &done, BARRIER_DONE);

        if (error == -ERROR_KIND_NOT_IN_JOB) /* it left; its daemon answers the client */
                return;
        done.job_id = job->id;
        done.rank = mr->member->rank;
        done.error = error ? error_code(error) : MOEEP__V1__ERROR_CODE__ERROR_UNSPECIFIED;
        mesh_peer_send(mr->peer, &msg);
}

static void rank_peer_lost(void *owner, const struct job *job, uint32_t rank, const char *reason) {
        struct mesh_rank *mr = owner;

        send_rank_lost(mr->peer, job->id, rank, reason);
}

const struct job_callbacks mesh_rank_callbacks = {
        .barrier_done = rank_barrier_done,
        .peer_lost = rank_peer_lost,
};

/* The remote member `rank` of home job `job_id` that joined through `p`,
 * or NULL. */
static struct mesh_rank *rank_find(const struct mesh_jobs *mj, const struct mesh_peer *p, uint64_t job_id,
                                   uint32_t rank) {
        struct mesh_rank *mr;

        TAILQ_FOREACH (mr, &mj->ranks, entry)
                if (mr->peer == p && mr->member->job->id == job_id && mr->member->rank == rank)
                        return mr;
        return NULL;
}

/* mesh_jobs_nodes() with rank `gone` (-1: none) counted as not joined. */
static bool job_nodes_except(const struct mesh_jobs *mj, const struct job *job, int64_t gone,
                             struct job_node ret[MOEEP_MAX_RANKS]) {
        bool spans = job->home[0] != '\0';

        memset(ret, 0, sizeof(struct job_node) * MOEEP_MAX_RANKS);
        if (!mj)
                return false;
        if (job->home[0]) {
                if (job->mesh)
                        memcpy(ret, job->mesh->nodes, sizeof(job->mesh->nodes));
                return true;
        }
        for (uint32_t r = 0; r < job->world_size; r++) {
                const struct job_member *m = job->ranks[r];

                if (!m || (int64_t)r == gone)
                        continue;
                if (m->remote) {
                        const struct mesh_rank *mr = m->owner;

                        snprintf(ret[r].address, sizeof(ret[r].address), "%s", mr->peer->address);
                        spans = true;
                } else {
                        snprintf(ret[r].address, sizeof(ret[r].address), "%s", mesh_address(mj->mesh));
                }
        }
        return spans;
}

bool mesh_jobs_nodes(const struct mesh_jobs *mj, const struct job *job,
                     struct job_node ret[MOEEP_MAX_RANKS]) {
        return job_nodes_except(mj, job, -1, ret);
}

const struct job_remote_region *mesh_jobs_remote_regions(const struct job *job, uint32_t *ret_n) {
        *ret_n = job->mesh ? job->mesh->nremote_regions : 0;
        return *ret_n ? job->mesh->remote_regions : NULL;
}

/* Sends `msg` once to every daemon with ranks of home job `job`, but
 * `except` (NULL: none) and the daemon of rank `gone` only (-1: none). */
static void job_peers_send(const struct job *job, Moeep__V1__PeerMessage *msg, const struct mesh_peer *except,
                           int64_t gone) {
        const struct mesh_peer *told[MOEEP_MAX_RANKS];
        size_t ntold = 0;

        for (uint32_t r = 0; r < job->world_size; r++) {
                const struct job_member *m = job->ranks[r];
                struct mesh_rank *mr;
                bool seen = false;

                if (!m || !m->remote || (int64_t)r == gone)
                        continue;
                mr = m->owner;
                for (size_t i = 0; i < ntold; i++)
                        seen |= told[i] == mr->peer;
                if (seen || mr->peer == except)
                        continue;
                told[ntold++] = mr->peer;
                mesh_peer_send(mr->peer, msg);
        }
}

/* Forgets the remote regions of rank `rank` (all ranks: -1) of `job`. */
static void remote_regions_drop(struct job *job, int64_t rank) {
        struct mesh_job *mjob = job->mesh;
        uint32_t kept = 0;

        if (!mjob)
                return;
        for (uint32_t i = 0; i < mjob->nremote_regions; i++)
                if (rank >= 0 && mjob->remote_regions[i].rank != rank)
                        mjob->remote_regions[kept++] = mjob->remote_regions[i];
        mjob->nremote_regions = kept;
}

/* Records (or forgets, when released) a region of a remote rank. */
static void remote_region_update(struct job *job, const Moeep__V1__PeerRegion *pr) {
        struct mesh_job *mjob = job->mesh;
        struct job_remote_region *rr;

        for (uint32_t i = 0; mjob && i < mjob->nremote_regions; i++) {
                rr = &mjob->remote_regions[i];
                if (rr->rank != pr->rank || rr->region_id != pr->region_id)
                        continue;
                if (pr->released)
                        mjob->remote_regions[i] = mjob->remote_regions[--mjob->nremote_regions];
                return;
        }
        if (pr->released)
                return;
        if (mjob && mjob->nremote_regions >= JOB_REMOTE_REGIONS_MAX) {
                log_warn("job %" PRIu64 ": more than %d remote regions: rank %" PRIu32 "'s region %" PRIu64
                         " is not listed",
                         job->id, JOB_REMOTE_REGIONS_MAX, pr->rank, pr->region_id);
                return;
        }
        if (!mjob || !mjob->regions_room) {
                mjob = job_state(job);
                if (!mjob)
                        return;
                mjob = realloc(mjob,
                               sizeof(*mjob) + JOB_REMOTE_REGIONS_MAX * sizeof(mjob->remote_regions[0]));
                if (!mjob)
                        return;
                job->mesh = mjob;
                mjob->regions_room = true;
        }
        rr = &mjob->remote_regions[mjob->nremote_regions++];
        rr->rank = pr->rank;
        rr->tag = pr->tag;
        rr->kind = (uint32_t)pr->kind;
        rr->size = pr->size;
        rr->region_id = pr->region_id;
        rr->proxy = (uint32_t)pr->proxy;
        rr->rkey = (struct job_rkey){ .base = pr->rkey_base, .key = pr->rkey_key, .length = pr->rkey_length };
}

/* Tells every daemon with ranks of home job `job` (but the rank `gone`,
 * -1: none) the rank -> node map without `gone`. */
static void job_changed_except(struct mesh_jobs *mj, const struct job *job, int64_t gone) {
        Moeep__V1__PeerRanks ranks = MOEEP__V1__PEER_RANKS__INIT;
        PEER_MSG(msg, ranks, &ranks, RANKS);
        struct job_node nodes[MOEEP_MAX_RANKS];
        char *ptrs[MOEEP_MAX_RANKS];

        if (!mj || job->home[0] || !job_nodes_except(mj, job, gone, nodes))
                return;
        for (uint32_t r = 0; r < job->world_size; r++)
                ptrs[r] = nodes[r].address;
        ranks.job_id = job->id;
        ranks.nodes = ptrs;
        ranks.n_nodes = job->world_size;
        job_peers_send(job, &msg, NULL, gone);
}

void mesh_jobs_changed(struct mesh_jobs *mj, const struct job *job) {
        job_changed_except(mj, job, -1);
}

static void handle_join(struct mesh_jobs *mj, struct mesh_peer *p, const Moeep__V1__PeerJoin *pj) {
        Moeep__V1__PeerJoined joined = MOEEP__V1__PEER_JOINED__INIT;
        PEER_MSG(msg, joined, &joined, JOINED);
        char errmsg[ERRMSG_MAX] = "";
        struct job_member *m = NULL;
        struct mesh_rank *mr;
        int r;

        joined.token = pj->token;
        mr = calloc(1, sizeof(*mr));
        if (!mr)
                r = errmsg_set(errmsg, -ENOMEM, "out of memory");
        else if (mj->stopping)
                r = errmsg_set(errmsg, -ERROR_KIND_DRAINING, "the job's daemon is shutting down");
        else
                r = jobs_join(mj->jobs, pj->unique_id.data, pj->unique_id.len, pj->rank, pj->world_size,
                              pj->gpu_uuid, mr, &m, errmsg);
        if (r < 0) {
                free(mr);
                joined.error = error_code(r);
                joined.message = errmsg;
                log_info("mesh: peer %s: join as rank %" PRIu32 " refused: %s", p->address, pj->rank, errmsg);
                mesh_peer_send(p, &msg);
                return;
        }
        mr->mj = mj;
        mr->peer = p;
        mr->member = m;
        m->remote = true;
        m->cb = &mesh_rank_callbacks;
        TAILQ_INSERT_TAIL(&mj->ranks, mr, entry);
        log_info("mesh: rank %" PRIu32 "/%" PRIu32 " of job %" PRIu64 " '%s' joined at daemon %s (%s)",
                 m->rank, m->job->world_size, m->job->id, m->job->name, p->address,
                 job_state_to_string(m->job->state));
        joined.job_id = m->job->id;
        joined.name = m->job->name;
        joined.world_size = m->job->world_size;
        mesh_peer_send(p, &msg);
        mesh_jobs_changed(mj, m->job);
}

/* Takes `mr` off the list; returns its member. */
static struct job_member *rank_detach(struct mesh_rank *mr) {
        struct job_member *m = mr->member;

        TAILQ_REMOVE(&mr->mj->ranks, mr, entry);
        free(mr);
        return m;
}

static void handle_barrier(struct mesh_jobs *mj, struct mesh_peer *p, const Moeep__V1__PeerBarrier *pb) {
        struct mesh_rank *mr = rank_find(mj, p, pb->job_id, pb->rank);
        char errmsg[ERRMSG_MAX];
        int r;

        if (!mr) {
                log_debug("mesh: peer %s: barrier for job %" PRIu64 " rank %" PRIu32
                          " that it has not joined",
                          p->address, pb->job_id, pb->rank);
                return;
        }
        r = job_barrier(mr->member, 0, errmsg);
        if (r == -ERROR_KIND_PEER_LOST)
                rank_barrier_done(mr, mr->member->job, 0, r);
}

static void handle_leave(struct mesh_jobs *mj, struct mesh_peer *p, const Moeep__V1__PeerLeave *pl) {
        struct mesh_rank *mr = rank_find(mj, p, pl->job_id, pl->rank);

        if (!mr)
                return;
        log_info("mesh: rank %" PRIu32 " of job %" PRIu64 " left at daemon %s", pl->rank, pl->job_id,
                 p->address);
        /* The job may go away with its last member: tell the others first. */
        remote_regions_drop(mr->member->job, pl->rank);
        mesh_rank_gone(mj->mesh, mr->member->job, pl->rank);
        job_changed_except(mj, mr->member->job, pl->rank);
        job_member_leave(rank_detach(mr));
}

static void handle_rank_lost_home(struct mesh_jobs *mj, struct mesh_rank *mr, struct mesh_peer *p,
                                  const Moeep__V1__PeerRankLost *pl) {
        char reason[ERRMSG_MAX];

        snprintf(reason, sizeof(reason), "%s (at daemon %s)", pl->reason ? pl->reason : "lost", p->address);
        remote_regions_drop(mr->member->job, pl->rank);
        job_member_lost(rank_detach(mr), reason);
}

/* `p` went down: every rank that joined through it is lost. */
static void peer_ranks_lost(struct mesh_jobs *mj, const struct mesh_peer *p, const char *why) {
        struct mesh_rank *mr, *next;

        for (mr = TAILQ_FIRST(&mj->ranks); mr; mr = next) {
                next = TAILQ_NEXT(mr, entry);
                if (mr->peer != p)
                        continue;
                remote_regions_drop(mr->member->job, mr->member->rank);
                job_member_lost(rank_detach(mr), why);
        }
}

/* ------------------------------------------------------------ jobs, mirror side */

static void handle_ranks(struct mesh_jobs *mj, struct mesh_peer *p, const Moeep__V1__PeerRanks *pr) {
        struct job *job = jobs_find_mirror(mj->jobs, p->address, pr->job_id);
        struct mesh_job *mjob;

        if (!job)
                return;
        mjob = job_state(job);
        if (!mjob)
                return;
        for (uint32_t r = 0; r < job->world_size; r++) {
                const char *a = r < pr->n_nodes ? pr->nodes[r] : "";

                snprintf(mjob->nodes[r].address, sizeof(mjob->nodes[r].address), "%s",
                         address_valid(a) ? a : "");
        }
}

static void handle_barrier_done(struct mesh_jobs *mj, struct mesh_peer *p,
                                const Moeep__V1__PeerBarrierDone *pb) {
        struct job *job = jobs_find_mirror(mj->jobs, p->address, pb->job_id);

        if (!job || pb->rank >= job->world_size || !job_rank_local(job, pb->rank))
                return;
        job_barrier_release(job->ranks[pb->rank], pb->error ? -ERROR_KIND_PEER_LOST : 0);
}

static void handle_rank_lost_mirror(struct mesh_jobs *mj, struct mesh_peer *p,
                                    const Moeep__V1__PeerRankLost *pl) {
        struct job *job = jobs_find_mirror(mj->jobs, p->address, pl->job_id);

        if (!job || pl->rank >= job->world_size)
                return;
        job_abort(job, pl->rank, pl->reason ? pl->reason : "lost");
}

/* The home `home` went down: every mirror of its jobs is aborted, with
 * PeerLost for each rank that is not here. */
static void mirrors_abort(struct mesh_jobs *mj, const char *home, const char *why) {
        struct job *job;

        TAILQ_FOREACH (job, &mj->jobs->list, entry) {
                if (strcmp(job->home, home) != 0)
                        continue;
                for (uint32_t r = 0; r < job->world_size; r++)
                        if (!job_rank_local(job, r))
                                job_abort(job, r, why);
        }
}

static struct mesh_peer *home_peer(struct mesh_jobs *mj, const struct job *job) {
        return mj && job->home[0] ? mesh_peer_find(mj->mesh, job->home) : NULL;
}

void mesh_jobs_barrier(struct mesh_jobs *mj, struct job_member *m) {
        Moeep__V1__PeerBarrier pb = MOEEP__V1__PEER_BARRIER__INIT;
        PEER_MSG(msg, barrier, &pb, BARRIER);
        struct mesh_peer *p = home_peer(mj, m->job);

        pb.job_id = m->job->home_id;
        pb.rank = m->rank;
        if (!p || mesh_peer_send(p, &msg) < 0) {
                /* The home is gone: the job is (being) aborted. */
                for (uint32_t r = 0; r < m->job->world_size; r++)
                        if (!job_rank_local(m->job, r))
                                job_abort(m->job, r, "the job's home daemon is not reachable");
                job_barrier_release(m, -ERROR_KIND_PEER_LOST);
        }
}

void mesh_jobs_member_gone(struct mesh_jobs *mj, struct job_member *m, bool lost, const char *reason) {
        struct mesh_peer *p = home_peer(mj, m->job);

        if (mj && !m->job->home[0] && !lost) /* a home job's local rank leaves */
                job_changed_except(mj, m->job, m->rank);
        if (!p)
                return;
        if (lost) {
                send_rank_lost(p, m->job->home_id, m->rank, reason);
        } else {
                Moeep__V1__PeerLeave leave = MOEEP__V1__PEER_LEAVE__INIT;
                PEER_MSG(msg, leave, &leave, LEAVE);

                leave.job_id = m->job->home_id;
                leave.rank = m->rank;
                mesh_peer_send(p, &msg);
        }
}

void mesh_jobs_region_changed(struct mesh_jobs *mj, const struct job_member *m, uint64_t region_id,
                              uint32_t tag, uint32_t kind, uint64_t size, bool released, uint32_t proxy,
                              const struct job_rkey *rkey) {
        Moeep__V1__PeerRegion pr = MOEEP__V1__PEER_REGION__INIT;
        PEER_MSG(msg, region, &pr, REGION);
        struct mesh_peer *p;

        if (!mj)
                return;
        pr.job_id = m->job->home_id;
        pr.rank = m->rank;
        pr.tag = tag;
        pr.kind = (Moeep__V1__RegionKind)kind;
        pr.size = size;
        pr.region_id = region_id;
        pr.released = released;
        pr.proxy = (Moeep__V1__ProxyRole)proxy;
        if (rkey) {
                pr.rkey_base = rkey->base;
                pr.rkey_key = rkey->key;
                pr.rkey_length = rkey->length;
        }
        if (!m->job->home[0]) {
                job_peers_send(m->job, &msg, NULL, -1);
                return;
        }
        p = home_peer(mj, m->job);
        if (p)
                mesh_peer_send(p, &msg);
}

/* A remote rank's region changed in `job`: kept (or forgotten), and when a
 * receive or counter region goes, the routes to its rank are dropped. */
static void remote_region_changed(struct mesh_jobs *mj, struct job *job, const Moeep__V1__PeerRegion *pr) {
        uint32_t proxy = MOEEP__V1__PROXY_ROLE__PROXY_ROLE_NONE, n;
        const struct job_remote_region *known = mesh_jobs_remote_regions(job, &n);

        /* A release names the region, not its role: the role is ours. */
        for (uint32_t i = 0; pr->released && i < n; i++)
                if (known[i].rank == pr->rank && known[i].region_id == pr->region_id)
                        proxy = known[i].proxy;
        remote_region_update(job, pr);
        if (proxy == MOEEP__V1__PROXY_ROLE__PROXY_ROLE_RECV ||
            proxy == MOEEP__V1__PROXY_ROLE__PROXY_ROLE_COUNTERS)
                mesh_rank_gone(mj->mesh, job, pr->rank);
}

static void handle_region(struct mesh_jobs *mj, struct mesh_peer *p, const Moeep__V1__PeerRegion *pr) {
        struct mesh_rank *mr = rank_find(mj, p, pr->job_id, pr->rank);
        struct job *job;

        if (mr) { /* we are the home: keep it, pass it on to the others */
                Moeep__V1__PeerMessage msg = MOEEP__V1__PEER_MESSAGE__INIT;

                remote_region_changed(mj, mr->member->job, pr);
                msg.body_case = MOEEP__V1__PEER_MESSAGE__BODY_REGION;
                msg.region = (Moeep__V1__PeerRegion *)pr;
                job_peers_send(mr->member->job, &msg, p, -1);
                return;
        }
        job = jobs_find_mirror(mj->jobs, p->address, pr->job_id);
        if (job && pr->rank < job->world_size && !job_rank_local(job, pr->rank))
                remote_region_changed(mj, job, pr);
}

/* ------------------------------------------------------------ failures */

void mesh_jobs_rank_failed(struct mesh_jobs *mj, struct job *job, uint32_t rank, const char *reason) {
        struct mesh_peer *p = home_peer(mj, job);

        if (p)
                send_rank_lost(p, job->home_id, rank, reason);
        job_abort(job, rank, reason);
}

/* Every rank at daemon `address` is lost to every job that has one: the
 * job is aborted and each such rank marked lost in its control page (an
 * elastic job goes on without them, so this holds for jobs already aborted
 * by an earlier loss too; job_abort() tells each rank once). */
static void jobs_abort_at(struct mesh_jobs *mj, const char *address, const char *why) {
        struct job_node nodes[MOEEP_MAX_RANKS];
        struct job *job;

        TAILQ_FOREACH (job, &mj->jobs->list, entry) {
                if (!mesh_jobs_nodes(mj, job, nodes))
                        continue;
                for (uint32_t r = 0; r < job->world_size; r++)
                        if (!job_rank_local(job, r) && strcmp(nodes[r].address, address) == 0 &&
                            !(r < 32 && (job->lost_notified & (1u << r))))
                                mesh_jobs_rank_failed(mj, job, r, why);
        }
}

/* ------------------------------------------------------------ the mesh's subscriber */

/* PeerRankLost: to the home from a rank's daemon, or from the home. */
static void handle_rank_lost(struct mesh_jobs *mj, struct mesh_peer *p, const Moeep__V1__PeerRankLost *pl) {
        struct mesh_rank *mr = rank_find(mj, p, pl->job_id, pl->rank);

        if (mr)
                handle_rank_lost_home(mj, mr, p, pl);
        else
                handle_rank_lost_mirror(mj, p, pl);
}

/* A job message from `p` (UP): the rows of proto/mesh.def whose OWNER is
 * JOBS, each to handle_<field>(). The mesh hands this subscriber no
 * other. */
static void client_message(void *arg, struct mesh_peer *p, const Moeep__V1__PeerMessage *msg) {
        struct mesh_jobs *mj = arg;

#define MESH_OWNED_BY_JOBS(field) handle_##field(mj, p, msg->field)
#define MESH_OWNED_BY_PEERS(field) /* others': never handed here */
#define MESH_OWNED_BY_JOINS(field)
#define MESH_OWNED_BY_TRANSPORT(field)
#define MOEEP_PEER(CASE, field, Name, PHASE, FROM, OWNER) \
        case MOEEP__V1__PEER_MESSAGE__BODY_##CASE:        \
                MESH_OWNED_BY_##OWNER(field);             \
                return;
        switch (msg->body_case) {
#include "mesh.def"
        case MOEEP__V1__PEER_MESSAGE__BODY_SEALED:
        case MOEEP__V1__PEER_MESSAGE__BODY__NOT_SET:
        case _MOEEP__V1__PEER_MESSAGE__BODY__CASE_IS_INT_SIZE:
                return;
        }
#undef MOEEP_PEER
#undef MESH_OWNED_BY_TRANSPORT
#undef MESH_OWNED_BY_JOINS
#undef MESH_OWNED_BY_PEERS
#undef MESH_OWNED_BY_JOBS
}

static void client_peer_down(void *arg, struct mesh_peer *p, bool was_up, bool transport_was_connected,
                             const char *lost, const char *why) {
        struct mesh_jobs *mj = arg;

        if (was_up) {
                /* The rings writing to it ended first (the transport is told
                 * first, mesh.h), so that no producer waits on it while the
                 * jobs are aborted. */
                if (transport_was_connected)
                        jobs_abort_at(mj, p->address, lost);
                peer_ranks_lost(mj, p, lost);
                /* Mirrors name the daemon, not the connection: they go on
                 * over another one that is up. */
                if (!mesh_peer_find(mj->mesh, p->address))
                        mirrors_abort(mj, p->address, lost);
        }
}

/* Jobs with ranks at both this daemon and `p`. */
static uint32_t client_peer_jobs(void *arg, const struct mesh_peer *p) {
        struct mesh_jobs *mj = arg;
        const struct job *job;
        uint32_t n = 0;

        TAILQ_FOREACH (job, &mj->jobs->list, entry) {
                bool spans = strcmp(job->home, p->address) == 0;

                for (uint32_t r = 0; r < job->world_size && !spans; r++) {
                        const struct job_member *m = job->ranks[r];

                        spans = m && m->remote && ((const struct mesh_rank *)m->owner)->peer == p;
                }
                n += spans;
        }
        return n;
}

/* ------------------------------------------------------------ life */

int mesh_jobs_new(struct mesh *mesh, struct jobs *jobs, struct mesh_jobs **ret) {
        struct mesh_jobs *mj;
        struct mesh_subscriber sub = {
                .message = client_message,
                .peer_down = client_peer_down,
                .peer_jobs = client_peer_jobs,
        };

        *ret = NULL;
        if (!mesh)
                return 0;
        mj = calloc(1, sizeof(*mj));
        if (!mj)
                return -ENOMEM;
        mj->mesh = mesh;
        mj->jobs = jobs;
        TAILQ_INIT(&mj->ranks);
        sub.arg = mj;
        mesh_subscribe(mesh, MESH_OWNER_JOBS, &sub);
        *ret = mj;
        return 0;
}

void mesh_jobs_free(struct mesh_jobs *mj) {
        struct mesh_rank *mr;

        if (!mj)
                return;
        /* Every connection down first, so that the members let go below
         * send nothing. */
        mesh_close_all(mj->mesh);
        while ((mr = TAILQ_FIRST(&mj->ranks)))
                job_member_leave(rank_detach(mr));
        mesh_subscribe(mj->mesh, MESH_OWNER_JOBS, NULL);
        free(mj);
}

void mesh_jobs_stop(struct mesh_jobs *mj) {
        if (mj)
                mj->stopping = true;
}
