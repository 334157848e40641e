/* The handle broker; see broker.h. */
#include <errno.h>
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "config.h"
#include "errors.h"
#include "log.h"
#include "state/broker.h"
#include "state/clientfd.h"

int broker_new(const struct config *config, struct clientfds *fds, struct broker **ret_broker) {
        struct broker *b = calloc(1, sizeof(*b));

        if (!b)
                return -ENOMEM;
        b->config = config;
        b->fds = fds;
        b->next_id = 1;
        LIST_INIT(&b->usage);
        *ret_broker = b;
        return 0;
}

void broker_free(struct broker *b) {
        struct uid_usage *u;

        if (!b)
                return;
        while ((u = LIST_FIRST(&b->usage))) {
                LIST_REMOVE(u, entry);
                free(u);
        }
        free(b);
}

static struct uid_usage *usage_find(struct broker *b, uid_t uid) {
        struct uid_usage *u;

        LIST_FOREACH (u, &b->usage, entry)
                if (u->uid == uid)
                        return u;
        return NULL;
}

int broker_register(struct broker *b, struct job_member *m, uid_t uid, enum region_kind kind, uint64_t size,
                    uint32_t tag, int fd, uint64_t *ret_id, char *errmsg) {
        const struct config *c = b->config;
        struct uid_usage *u;
        struct region *reg;

        if (m->job->state == JOB_ABORTED)
                return errmsg_set(errmsg, -ERROR_KIND_PEER_LOST,
                                  "job %" PRIu64 " is aborted: rank %" PRId32 " was lost", m->job->id,
                                  m->job->lost_rank);
        if (size == 0)
                return errmsg_set(errmsg, -ERROR_KIND_INVALID_ARGUMENT,
                                  "%s region with tag %" PRIu32 ": size 0", clientfd_kind_to_string(kind),
                                  tag);
        if (m->nregions >= c->max_regions_per_session)
                return errmsg_set(errmsg, -ERROR_KIND_LIMIT_EXCEEDED,
                                  "rank %" PRIu32 " already has %" PRIu32
                                  " regions (max_regions_per_session = %" PRIu32 ")",
                                  m->rank, m->nregions, c->max_regions_per_session);
        /* The receiver charged `fd` already: past the cap, this one is
         * the fd too many. */
        if (clientfds_held(b->fds, uid) > c->max_fds_per_uid)
                return errmsg_set(
                        errmsg, -ERROR_KIND_LIMIT_EXCEEDED,
                        "uid %u holds %" PRIu32 " descriptors in the daemon with this one "
                        "(sessions, regions, unsent replies, closes pending; max_fds_per_uid = %" PRIu32 ")",
                        (unsigned)uid, clientfds_held(b->fds, uid), c->max_fds_per_uid);
        u = usage_find(b, uid);
        if (size > c->max_region_bytes_per_uid || (u && u->bytes > c->max_region_bytes_per_uid - size))
                return errmsg_set(errmsg, -ERROR_KIND_LIMIT_EXCEEDED,
                                  "region of %" PRIu64
                                  " bytes: uid %u would hold more than max_region_bytes_per_uid = %" PRIu64,
                                  size, (unsigned)uid, c->max_region_bytes_per_uid);

        reg = calloc(1, sizeof(*reg));
        if (!reg)
                return errmsg_set(errmsg, -ENOMEM, "region: out of memory");
        if (!u) {
                u = calloc(1, sizeof(*u));
                if (!u) {
                        free(reg);
                        return errmsg_set(errmsg, -ENOMEM, "region: out of memory");
                }
                u->uid = uid;
                LIST_INSERT_HEAD(&b->usage, u, entry);
        }
        reg->id = b->next_id++;
        reg->owner = m;
        reg->uid = uid;
        reg->tag = tag;
        reg->kind = kind;
        reg->size = size;
        reg->fd = fd;
        TAILQ_INSERT_TAIL(&m->regions, reg, entry);
        m->nregions++;
        b->nregions++;
        u->bytes += size;
        u->fds++;
        log_debug("job %" PRIu64 " rank %" PRIu32 ": region %" PRIu64 " (%s, %" PRIu64 " bytes, tag %" PRIu32
                  ") registered",
                  m->job->id, m->rank, reg->id, clientfd_kind_to_string(kind), size, tag);
        *ret_id = reg->id;
        return 0;
}

/* Unlinks and frees one region, returning its charge to its uid. */
static void region_free(struct broker *b, struct job_member *m, struct region *reg) {
        struct uid_usage *u = usage_find(b, reg->uid);

        TAILQ_REMOVE(&m->regions, reg, entry);
        m->nregions--;
        b->nregions--;
        if (u) {
                u->bytes -= reg->size;
                if (--u->fds == 0) {
                        LIST_REMOVE(u, entry);
                        free(u);
                }
        }
        /* The charge goes with the fd; the closer returns it. */
        clientfd_close(b->fds, reg->uid, reg->fd);
        free(reg);
}

int broker_release(struct broker *b, struct job_member *m, uint64_t id, char *errmsg) {
        struct region *reg;

        TAILQ_FOREACH (reg, &m->regions, entry)
                if (reg->id == id) {
                        log_debug("job %" PRIu64 " rank %" PRIu32 ": region %" PRIu64 " released", m->job->id,
                                  m->rank, id);
                        region_free(b, m, reg);
                        return 0;
                }
        return errmsg_set(errmsg, -ERROR_KIND_INVALID_ARGUMENT,
                          "job %" PRIu64 " rank %" PRIu32 ": no region %" PRIu64 " of this session",
                          m->job->id, m->rank, id);
}

void broker_hide(struct job_member *m, uint64_t id, bool hidden) {
        struct region *reg;

        TAILQ_FOREACH (reg, &m->regions, entry)
                if (reg->id == id)
                        reg->hidden = hidden;
}

void broker_drop_member(struct broker *b, struct job_member *m) {
        struct region *reg;

        while ((reg = TAILQ_FIRST(&m->regions)))
                region_free(b, m, reg);
}

int broker_fetch(const struct job_member *m, int32_t rank, int64_t tag, size_t max,
                 struct region ***ret_regions, size_t *ret_count, char *errmsg) {
        const struct job *job = m->job;
        struct region **out = NULL;
        struct region *reg;
        size_t n = 0;

        if (rank < -1 || rank >= (int32_t)job->world_size)
                return errmsg_set(errmsg, -ERROR_KIND_RANK_OUT_OF_RANGE,
                                  "job %" PRIu64 ": rank %" PRId32 " is out of range -1..%" PRIu32, job->id,
                                  rank, job->world_size - 1);
        if (tag < -1 || tag > UINT32_MAX)
                return errmsg_set(errmsg, -ERROR_KIND_INVALID_ARGUMENT,
                                  "tag %" PRId64 ": need -1 or 0..%" PRIu32, tag, UINT32_MAX);

        /* Two passes: count, then collect, so the array is exact. */
        for (int pass = 0; pass < 2; pass++) {
                n = 0;
                for (uint32_t r = 0; r < job->world_size; r++) {
                        const struct job_member *peer = job->ranks[r];

                        if (!peer || (rank == -1 && peer == m) || (rank >= 0 && (uint32_t)rank != r))
                                continue;
                        TAILQ_FOREACH (reg, &peer->regions, entry) {
                                if (reg->hidden || (tag >= 0 && reg->tag != (uint32_t)tag))
                                        continue;
                                if (out)
                                        out[n] = reg;
                                n++;
                        }
                }
                if (pass > 0 || n == 0)
                        break;
                if (n > max)
                        return errmsg_set(errmsg, -ERROR_KIND_LIMIT_EXCEEDED,
                                          "job %" PRIu64 ": %zu regions match rank %" PRId32 " tag %" PRId64
                                          ", one reply carries at most %zu",
                                          job->id, n, rank, tag, max);
                out = calloc(n, sizeof(*out));
                if (!out)
                        return errmsg_set(errmsg, -ENOMEM, "regions: out of memory");
        }
        *ret_regions = out;
        *ret_count = n;
        return 0;
}
