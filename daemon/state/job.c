/* Jobs: membership, barrier, control page; see job.h. */
#include <assert.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <unistd.h>

#include "config.h"
#include "errors.h"
#include "log.h"
#include "state/clientfd.h"
#include "state/job.h"

const char *job_state_to_string(enum job_state s) {
        switch (s) {
        case JOB_FORMING:
                return "forming";
        case JOB_READY:
                return "ready";
        case JOB_ABORTED:
                return "aborted";
        }
        return "unknown";
}

int jobs_new(const struct config *config, const struct job_callbacks *cb, struct clientfds *clientfds,
             struct jobs **ret_jobs) {
        struct jobs *jobs = calloc(1, sizeof(*jobs));

        if (!jobs)
                return -ENOMEM;
        TAILQ_INIT(&jobs->list);
        jobs->next_id = 1;
        jobs->config = config;
        jobs->cb = cb;
        jobs->clientfds = clientfds;
        *ret_jobs = jobs;
        return 0;
}

/* The callbacks that reach member `m`'s owner. */
static const struct job_callbacks *member_cb(const struct job_member *m) {
        return m->cb ? m->cb : m->job->jobs->cb;
}

static void job_free(struct job *job) {
        if (!job)
                return;
        if (job->fds_charged)
                clientfds_uncharge(job->jobs->clientfds, job->fds_uid, job->fds_charged);
        if (job->control)
                munmap(job->control, MOEEP_CONTROL_PAGE_SIZE);
        if (job->control_fd >= 0)
                close(job->control_fd);
        if (job->control_ro_fd >= 0)
                close(job->control_ro_fd);
        explicit_bzero(job->secret, sizeof(job->secret));
        free(job->mesh);
        free(job);
}

static void job_unref(struct job *job) {
        assert(job->references > 0);
        if (--job->references > 0)
                return;
        assert(job->njoined == 0);
        TAILQ_REMOVE(&job->jobs->list, job, entry);
        job->jobs->count--;
        log_info("job %" PRIu64 " '%s' freed", job->id, job->name);
        job_free(job);
}

void jobs_free(struct jobs *jobs) {
        struct job *job;

        if (!jobs)
                return;
        while ((job = TAILQ_FIRST(&jobs->list))) {
                TAILQ_REMOVE(&jobs->list, job, entry);
                job_free(job);
        }
        free(jobs);
}

/* Creates the control page: a memfd the daemon keeps mapped writable and
 * seals so that it can neither change size nor be mapped writable again
 * (F_SEAL_FUTURE_WRITE, Linux 5.1+). Clients get a read-only reopening of
 * it where /proc allows, so even on older kernels they cannot map it
 * PROT_WRITE; only the daemon writes the abort word. */
static int control_page_create(struct job *job, char *errmsg) {
        char name[64], path[64];
        int seals = F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL;
        void *p;

        snprintf(name, sizeof(name), "moeep-job-%" PRIu64, job->id);
        job->control_fd = memfd_create(name, MFD_CLOEXEC | MFD_ALLOW_SEALING);
        if (job->control_fd < 0)
                return errmsg_set(errmsg, -errno, "job %" PRIu64 ": memfd_create of the control page: %s",
                                  job->id, strerror(errno));
        if (ftruncate(job->control_fd, MOEEP_CONTROL_PAGE_SIZE) < 0)
                return errmsg_set(errmsg, -errno, "job %" PRIu64 ": sizing the control page to %d bytes: %s",
                                  job->id, MOEEP_CONTROL_PAGE_SIZE, strerror(errno));
        p = mmap(NULL, MOEEP_CONTROL_PAGE_SIZE, PROT_READ | PROT_WRITE, MAP_SHARED, job->control_fd, 0);
        if (p == MAP_FAILED)
                return errmsg_set(errmsg, -errno, "job %" PRIu64 ": mapping the control page: %s", job->id,
                                  strerror(errno));
        job->control = p;
        job->control->magic = MOEEP_CONTROL_PAGE_MAGIC;
        job->control->version = MOEEP_CONTROL_PAGE_VERSION;
        job->control->abort = 0;
        job->control->lost_rank = -1;
        job->control->job_id = job->id;
        job->control->lost_ranks = 0;
        job->control->stopping = 0;
#ifdef F_SEAL_FUTURE_WRITE
        if (fcntl(job->control_fd, F_ADD_SEALS, seals | F_SEAL_FUTURE_WRITE) == 0)
                seals = 0;
#endif
        if (seals && fcntl(job->control_fd, F_ADD_SEALS, seals) < 0)
                return errmsg_set(errmsg, -errno, "job %" PRIu64 ": sealing the control page: %s", job->id,
                                  strerror(errno));
        snprintf(path, sizeof(path), "/proc/self/fd/%d", job->control_fd);
        job->control_ro_fd = open(path, O_RDONLY | O_CLOEXEC);
        if (job->control_ro_fd < 0)
                log_debug("job %" PRIu64 ": no read-only reopening of the control page (%s): %s", job->id,
                          path, strerror(errno));
        return 0;
}

/* A new job with a secret and a control page (its fds charged to `uid`),
 * in the registry, without references; `owner_uid` counts it against
 * max_jobs_per_uid (JOB_OWNER_NONE: against nobody's). */
static int job_alloc(struct jobs *jobs, const char *name, uint32_t world_size, uid_t owner_uid, uid_t uid,
                     struct job **ret_job, char *errmsg) {
        struct job *job;
        ssize_t n;
        int r;

        job = calloc(1, sizeof(*job));
        if (!job)
                return errmsg_set(errmsg, -ENOMEM, "job '%s': out of memory", name);
        job->control_fd = job->control_ro_fd = -1;
        job->id = jobs->next_id;
        job->home_id = job->id;
        snprintf(job->name, sizeof(job->name), "%s", name);
        job->world_size = world_size;
        job->owner_uid = owner_uid;
        job->state = JOB_FORMING;
        job->lost_rank = -1;
        job->jobs = jobs;
        /* getrandom() without flags blocks only before the pool is
         * initialised at boot; 32 bytes never come back short. */
        /* The control page's fds count against the uid before they exist. */
        if (jobs->clientfds) {
                r = clientfds_charge(jobs->clientfds, uid, JOB_CONTROL_FDS, errmsg);
                if (r < 0) {
                        free(job);
                        return -ERROR_KIND_LIMIT_EXCEEDED;
                }
                job->fds_uid = uid;
                job->fds_charged = JOB_CONTROL_FDS;
        }
        n = getrandom(job->secret, sizeof(job->secret), 0);
        if (n != (ssize_t)sizeof(job->secret)) {
                r = errmsg_set(errmsg, n < 0 ? -errno : -EIO, "job '%s': getrandom for the secret: %s", name,
                               n < 0 ? strerror(errno) : "short read");
                goto fail;
        }
        r = control_page_create(job, errmsg);
        if (r < 0)
                goto fail;
        if (job->control_ro_fd < 0 && job->fds_charged) { /* one fd only */
                clientfds_uncharge(jobs->clientfds, uid, 1);
                job->fds_charged--;
        }

        jobs->next_id++;
        TAILQ_INSERT_TAIL(&jobs->list, job, entry);
        jobs->count++;
        *ret_job = job;
        return 0;

fail:
        job_free(job);
        return r;
}

int jobs_create(struct jobs *jobs, const char *name, uint32_t world_size, uid_t uid, void *creator,
                struct job **ret_job, char *errmsg) {
        struct job *job;
        uint32_t have;
        int r;

        if (!moeep_job_name_valid(name))
                return errmsg_set(errmsg, -ERROR_KIND_INVALID_ARGUMENT,
                                  "job name of %zu bytes: need 1 to %d printable ASCII bytes", strlen(name),
                                  MOEEP_JOB_NAME_MAX);
        if (world_size < 1 || world_size > MOEEP_MAX_RANKS)
                return errmsg_set(errmsg, -ERROR_KIND_INVALID_ARGUMENT,
                                  "world size %" PRIu32 ": need 1 to %d", world_size, MOEEP_MAX_RANKS);
        have = jobs_count_uid(jobs, uid);
        if (have >= jobs->config->max_jobs_per_uid)
                return errmsg_set(errmsg, -ERROR_KIND_LIMIT_EXCEEDED,
                                  "uid %u already has %" PRIu32 " jobs (max_jobs_per_uid = %" PRIu32 ")",
                                  (unsigned)uid, have, jobs->config->max_jobs_per_uid);

        r = job_alloc(jobs, name, world_size, uid, uid, &job, errmsg);
        if (r < 0)
                return r;
        job->creator = creator;
        job->references = 1;
        *ret_job = job;
        return 0;
}

void job_unique_id(const struct job *job, uint8_t buf[static JOB_UNIQUE_ID_BYTES]) {
        buf[0] = JOB_UNIQUE_ID_VERSION;
        for (int i = 0; i < 8; i++)
                buf[1 + i] = (uint8_t)(job->id >> (8 * i));
        memcpy(buf + 9, job->secret, JOB_SECRET_BYTES);
}

size_t job_unique_id_with_node(const struct job *job, const char *node,
                               uint8_t buf[static MOEEP_UNIQUE_ID_BYTES]) {
        size_t n = node ? strlen(node) : 0;

        _Static_assert(JOB_UNIQUE_ID_BYTES + 1 + JOB_NODE_MAX <= MOEEP_UNIQUE_ID_BYTES, "node fits");
        assert(n <= JOB_NODE_MAX);
        job_unique_id(job, buf);
        if (n == 0)
                return JOB_UNIQUE_ID_BYTES;
        buf[JOB_UNIQUE_ID_NODE_OFFSET] = (uint8_t)n;
        memcpy(buf + JOB_UNIQUE_ID_NODE_OFFSET + 1, node, n);
        return JOB_UNIQUE_ID_BYTES + 1 + n;
}

int job_unique_id_node(const uint8_t *unique_id, size_t len, char ret_node[static JOB_NODE_MAX + 1]) {
        size_t n;

        ret_node[0] = '\0';
        if (len < JOB_UNIQUE_ID_BYTES || len > MOEEP_UNIQUE_ID_BYTES)
                return -EINVAL;
        if (len == JOB_UNIQUE_ID_BYTES || unique_id[JOB_UNIQUE_ID_NODE_OFFSET] == 0)
                return 0;
        n = unique_id[JOB_UNIQUE_ID_NODE_OFFSET];
        if (n > JOB_NODE_MAX || JOB_UNIQUE_ID_NODE_OFFSET + 1 + n > len ||
            !moeep_word_valid((const char *)unique_id + JOB_UNIQUE_ID_NODE_OFFSET + 1, n))
                return -EINVAL;
        memcpy(ret_node, unique_id + JOB_UNIQUE_ID_NODE_OFFSET + 1, n);
        ret_node[n] = '\0';
        return 0;
}

int job_control_fd(const struct job *job) {
        return job->control_ro_fd >= 0 ? job->control_ro_fd : job->control_fd;
}

/* Compares secrets in time independent of where they differ, so that a
 * guesser learns nothing from how long a refusal takes. */
static bool secret_equal(const uint8_t *a, const uint8_t *b) {
        volatile uint8_t diff = 0;

        for (size_t i = 0; i < JOB_SECRET_BYTES; i++)
                diff |= a[i] ^ b[i];
        return diff == 0;
}

static struct job *jobs_find(const struct jobs *jobs, uint64_t id) {
        struct job *job;

        TAILQ_FOREACH (job, &jobs->list, entry)
                if (job->id == id && !job->home[0]) /* a mirror is reached through its home only */
                        return job;
        return NULL;
}

struct job *jobs_find_mirror(const struct jobs *jobs, const char *home, uint64_t home_id) {
        struct job *job;

        TAILQ_FOREACH (job, &jobs->list, entry)
                if (job->home[0] && job->home_id == home_id && strcmp(job->home, home) == 0)
                        return job;
        return NULL;
}

bool job_rank_local(const struct job *job, uint32_t rank) {
        return rank < job->world_size && job->ranks[rank] && !job->ranks[rank]->remote;
}

static bool owner_in_a_job(const struct jobs *jobs, const void *owner) {
        const struct job *job;

        TAILQ_FOREACH (job, &jobs->list, entry)
                for (uint32_t r = 0; r < job->world_size; r++)
                        if (job->ranks[r] && job->ranks[r]->owner == owner)
                                return true;
        return false;
}

static int member_add(struct job *job, uint32_t rank, const char *gpu_uuid, void *owner,
                      struct job_member **ret_member, char *errmsg);

/* The one refusal of a GPU UUID that names.h's validator did not take. */
static int gpu_uuid_refuse(const char *gpu_uuid, char *errmsg) {
        return errmsg_set(errmsg, -ERROR_KIND_INVALID_ARGUMENT,
                          "gpu uuid of %zu bytes: need up to %d printable bytes", strlen(gpu_uuid),
                          MOEEP_GPU_UUID_MAX);
}

int jobs_join(struct jobs *jobs, const uint8_t *unique_id, size_t len, uint32_t rank, uint32_t world_size,
              const char *gpu_uuid, void *owner, struct job_member **ret_member, char *errmsg) {
        struct job *job;
        uint64_t id = 0;

        if (len < JOB_UNIQUE_ID_BYTES || len > MOEEP_UNIQUE_ID_BYTES || unique_id[0] != JOB_UNIQUE_ID_VERSION)
                return errmsg_set(errmsg, -ERROR_KIND_INVALID_ARGUMENT,
                                  "unique id of %zu bytes, version %u: need %d to %d bytes of version %d",
                                  len, len ? unique_id[0] : 0, JOB_UNIQUE_ID_BYTES, MOEEP_UNIQUE_ID_BYTES,
                                  JOB_UNIQUE_ID_VERSION);
        if (!gpu_uuid)
                gpu_uuid = "";
        if (!moeep_gpu_uuid_valid(gpu_uuid))
                return gpu_uuid_refuse(gpu_uuid, errmsg);
        for (int i = 0; i < 8; i++)
                id |= (uint64_t)unique_id[1 + i] << (8 * i);
        /* An unknown id and a wrong secret get the same answer: a guesser
         * must not learn which job ids exist. */
        job = jobs_find(jobs, id);
        if (!job || !secret_equal(job->secret, unique_id + 9))
                return errmsg_set(errmsg, -ERROR_KIND_NO_SUCH_JOB,
                                  "job %" PRIu64 ": no live job has this id and secret", id);
        if (owner_in_a_job(jobs, owner))
                return errmsg_set(errmsg, -ERROR_KIND_ALREADY_IN_JOB,
                                  "job %" PRIu64 ": the session already belongs to a job", id);
        if (job->state == JOB_ABORTED)
                return errmsg_set(errmsg, -ERROR_KIND_PEER_LOST,
                                  "job %" PRIu64 " is aborted: rank %" PRId32 " was lost", id,
                                  job->lost_rank);
        if (world_size != job->world_size)
                return errmsg_set(errmsg, -ERROR_KIND_WORLD_SIZE_MISMATCH,
                                  "job %" PRIu64 ": world size %" PRIu32 " differs from the job's %" PRIu32,
                                  id, world_size, job->world_size);
        if (rank >= job->world_size)
                return errmsg_set(errmsg, -ERROR_KIND_RANK_OUT_OF_RANGE,
                                  "job %" PRIu64 ": rank %" PRIu32 " is out of range 0..%" PRIu32, id, rank,
                                  job->world_size - 1);
        if (job->ranks[rank])
                return errmsg_set(errmsg, -ERROR_KIND_RANK_TAKEN,
                                  "job %" PRIu64 ": rank %" PRIu32 " is already taken", id, rank);
        return member_add(job, rank, gpu_uuid, owner, ret_member, errmsg);
}

int jobs_join_mirror(struct jobs *jobs, const char *home, uint64_t home_id, const char *name,
                     uint32_t world_size, uint32_t rank, const char *gpu_uuid, void *owner, uid_t uid,
                     struct job_member **ret_member, char *errmsg) {
        struct job *job = jobs_find_mirror(jobs, home, home_id);
        int r;

        if (strlen(home) == 0 || strlen(home) > JOB_NODE_MAX || world_size < 1 ||
            world_size > MOEEP_MAX_RANKS || rank >= world_size)
                return errmsg_set(errmsg, -ERROR_KIND_INVALID_ARGUMENT,
                                  "job %" PRIu64 " at %s: bad mirror (world size %" PRIu32 ", rank %" PRIu32
                                  ")",
                                  home_id, home, world_size, rank);
        if (!gpu_uuid)
                gpu_uuid = "";
        if (!moeep_gpu_uuid_valid(gpu_uuid))
                return gpu_uuid_refuse(gpu_uuid, errmsg);
        if (owner_in_a_job(jobs, owner))
                return errmsg_set(errmsg, -ERROR_KIND_ALREADY_IN_JOB,
                                  "job %" PRIu64 " at %s: the session already belongs to a job", home_id,
                                  home);
        if (job && job->state == JOB_ABORTED)
                return errmsg_set(errmsg, -ERROR_KIND_PEER_LOST,
                                  "job %" PRIu64 " at %s is aborted: rank %" PRId32 " was lost", home_id,
                                  home, job->lost_rank);
        if (job && (job->world_size != world_size || job->ranks[rank]))
                return errmsg_set(errmsg, -ERROR_KIND_RANK_TAKEN,
                                  "job %" PRIu64 " at %s: rank %" PRIu32 " is already taken here", home_id,
                                  home, rank);
        if (!job) {
                uint32_t have = jobs_count_mirrors(jobs, home);

                if (have >= jobs->config->max_mirrors_per_peer)
                        return errmsg_set(errmsg, -ERROR_KIND_LIMIT_EXCEEDED,
                                          "job %" PRIu64 " at %s: %" PRIu32
                                          " jobs of that daemon already have ranks here "
                                          "(max_mirrors_per_peer = %" PRIu32 ")",
                                          home_id, home, have, jobs->config->max_mirrors_per_peer);
                r = job_alloc(jobs, name && moeep_job_name_valid(name) ? name : "remote", world_size,
                              JOB_OWNER_NONE, uid, &job, errmsg);
                if (r < 0)
                        return r;
                snprintf(job->home, sizeof(job->home), "%s", home);
                job->home_id = home_id;
                /* The mirror's own secret is never handed out: it is reached
                 * through its home only (jobs_find() skips it). */
        }
        return member_add(job, rank, gpu_uuid, owner, ret_member, errmsg);
}

/* Adds `owner` as member `rank` of `job`; the caller checked everything. */
static int member_add(struct job *job, uint32_t rank, const char *gpu_uuid, void *owner,
                      struct job_member **ret_member, char *errmsg) {
        struct job_member *m;

        m = calloc(1, sizeof(*m));
        if (!m)
                return errmsg_set(errmsg, -ENOMEM, "job %" PRIu64 ": out of memory", job->id);
        m->job = job;
        m->rank = rank;
        snprintf(m->gpu_uuid, sizeof(m->gpu_uuid), "%s", gpu_uuid);
        m->owner = owner;
        TAILQ_INIT(&m->regions);
        job->references++;
        job->ranks[rank] = m;
        job->njoined++;
        if (job->njoined == job->world_size)
                job->state = JOB_READY;
        *ret_member = m;
        return 0;
}

/* Takes `m` out of its job and frees it; returns the job, still referenced
 * by `m`'s reference, which the caller drops once done notifying. */
static struct job *member_remove(struct job_member *m) {
        struct job *job = m->job;

        assert(TAILQ_EMPTY(&m->regions));
        assert(job->ranks[m->rank] == m);
        if (m->in_barrier && !job->home[0]) /* a mirror counts no arrivals */
                job->barrier_arrived--;
        job->ranks[m->rank] = NULL;
        job->njoined--;
        free(m);
        return job;
}

void job_member_leave(struct job_member *m) {
        const struct job_callbacks *cb = member_cb(m);
        bool waited = m->in_barrier;
        uint64_t request_id = m->barrier_request_id;
        void *owner = m->owner;
        struct job *job = member_remove(m);

        if (job->state == JOB_READY)
                job->state = JOB_FORMING;
        if (waited)
                cb->barrier_done(owner, job, request_id, -ERROR_KIND_NOT_IN_JOB);
        job_unref(job);
}

void job_member_lost(struct job_member *m, const char *reason) {
        uint32_t rank = m->rank;
        struct job *job = member_remove(m);

        job->jobs->ranks_lost++;
        job_abort(job, rank, reason);
        job_unref(job);
}

void job_abort(struct job *job, uint32_t rank, const char *reason) {
        if (rank < 32 && (job->lost_notified & (1u << rank)))
                return; /* told already (a mirror hears of a loss from its home too) */
        if (rank < 32)
                job->lost_notified |= 1u << rank;
        /* Elastic endpoints read the lost ranks (every later loss too, not
         * only the first) and the stopping word; both come before `abort`,
         * which every endpoint polls first. */
        if (rank < job->world_size)
                __atomic_or_fetch(&job->control->lost_ranks, 1u << rank, __ATOMIC_RELEASE);
        else if (rank == JOB_NO_RANK)
                __atomic_store_n(&job->control->stopping, 1, __ATOMIC_RELEASE);
        if (job->state != JOB_ABORTED) {
                job->state = JOB_ABORTED;
                job->lost_rank = (int32_t)rank;
                /* Kernels poll `abort` and then read lost_rank: publish the
                 * rank first. */
                job->control->lost_rank = (int32_t)rank;
                __atomic_store_n(&job->control->abort, 1, __ATOMIC_RELEASE);
                if (rank == JOB_NO_RANK)
                        log_notice("job %" PRIu64 " '%s' aborted: %s", job->id, job->name, reason);
                else
                        log_notice("job %" PRIu64 " '%s' aborted: rank %" PRIu32 " lost (%s)", job->id,
                                   job->name, rank, reason);
        }
        for (uint32_t r = 0; r < job->world_size; r++) {
                struct job_member *peer = job->ranks[r];

                if (!peer)
                        continue;
                if (rank != JOB_NO_RANK)
                        member_cb(peer)->peer_lost(peer->owner, job, rank, reason);
                job_barrier_release(peer, -ERROR_KIND_PEER_LOST);
        }
}

void jobs_abort_all(struct jobs *jobs, const char *reason) {
        struct job *job;

        TAILQ_FOREACH (job, &jobs->list, entry)
                job_abort(job, JOB_NO_RANK, reason);
}

void job_barrier_release(struct job_member *m, int error) {
        struct job *job = m->job;

        if (!m->in_barrier)
                return;
        m->in_barrier = false;
        if (!job->home[0])
                job->barrier_arrived--;
        member_cb(m)->barrier_done(m->owner, job, m->barrier_request_id, error);
}

int job_barrier(struct job_member *m, uint64_t request_id, char *errmsg) {
        struct job *job = m->job;

        if (job->state == JOB_ABORTED)
                return errmsg_set(errmsg, -ERROR_KIND_PEER_LOST,
                                  "job %" PRIu64 " is aborted: rank %" PRId32 " was lost", job->id,
                                  job->lost_rank);
        if (m->in_barrier)
                return errmsg_set(errmsg, -ERROR_KIND_INVALID_ARGUMENT,
                                  "job %" PRIu64 " rank %" PRIu32 ": already waiting in barrier %" PRIu64,
                                  job->id, m->rank, job->barrier_generation);
        m->in_barrier = true;
        m->barrier_request_id = request_id;
        if (job->home[0])
                return 1; /* a mirror: the caller asks the home daemon */
        job->barrier_arrived++;
        if (job->barrier_arrived < job->world_size)
                return 0;

        /* Every rank is here (which implies every rank joined): release
         * them all, the caller included. */
        job->barrier_generation++;
        job->jobs->barriers_completed++;
        job->barrier_arrived = 0;
        for (uint32_t r = 0; r < job->world_size; r++) {
                struct job_member *peer = job->ranks[r];

                assert(peer && peer->in_barrier);
                peer->in_barrier = false;
                member_cb(peer)->barrier_done(peer->owner, job, peer->barrier_request_id, 0);
        }
        return 0;
}

void jobs_creator_gone(struct jobs *jobs, void *creator) {
        struct job *job, *next;

        for (job = TAILQ_FIRST(&jobs->list); job; job = next) {
                next = TAILQ_NEXT(job, entry);
                if (job->creator != creator)
                        continue;
                job->creator = NULL;
                job_unref(job);
        }
}

uint32_t jobs_count_uid(const struct jobs *jobs, uid_t uid) {
        const struct job *job;
        uint32_t n = 0;

        if (uid == JOB_OWNER_NONE)
                return 0;
        TAILQ_FOREACH (job, &jobs->list, entry)
                n += job->owner_uid == uid;
        return n;
}

uint32_t jobs_count_mirrors(const struct jobs *jobs, const char *home) {
        const struct job *job;
        uint32_t n = 0;

        TAILQ_FOREACH (job, &jobs->list, entry)
                n += job->home[0] && strcmp(job->home, home) == 0;
        return n;
}
