/* The handle broker: memory regions (fds) that job members register, and
 * handing them to the other members of the same job, never anyone else. */
#ifndef MOEEPD_BROKER_H
#define MOEEPD_BROKER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/queue.h>
#include <sys/types.h>

#include "state/clientfd.h" /* enum region_kind */
#include "state/job.h"

struct clientfds;
struct config;

struct region {
        uint64_t id;              /* daemon-wide unique, never reused */
        struct job_member *owner; /* not owning; the region lives in owner->regions */
        uid_t uid;                /* charged against the uid's caps */
        uint32_t tag;
        enum region_kind kind;
        uint64_t size;
        int fd;      /* owns */
        bool hidden; /* handed to no peer (broker_fetch()): its registration is under way */
        TAILQ_ENTRY(region) entry;
};

/* What one uid holds in regions, for max_region_bytes_per_uid (its fds are
 * charged in clientfd.c, with everything else the daemon holds for it). */
struct uid_usage {
        uid_t uid;
        uint64_t bytes;
        uint32_t fds; /* its regions; the entry goes when 0 */
        LIST_ENTRY(uid_usage) entry;
};

struct broker {
        const struct config *config; /* not owning; caps are read at each call */
        struct clientfds *fds;       /* not owning; checks, charges and closes region fds */
        uint64_t next_id;
        uint32_t nregions;            /* all live regions */
        LIST_HEAD(, uid_usage) usage; /* owns; entries exist while a uid holds regions */
};

int broker_new(const struct config *config, struct clientfds *fds, struct broker **ret_broker);
/* Every region must be gone (members drop theirs). Accepts NULL. */
void broker_free(struct broker *b);

/* Registers `fd` as a region of member `m` (uid `uid`, to whom the
 * receiver charged `fd` already: clientfds_charge_held()). `fd` passed
 * clientfd_check() for `kind` and `size` already, off the loop
 * (clientfd_check_async(), clientfd_take()): the broker never looks at a
 * client's fd itself. Takes `fd` only on success; the region's release
 * closes it through clientfd_close(). Errors, as error kinds (errors.h):
 * INVALID_ARGUMENT size 0; LIMIT_EXCEEDED a cap; PEER_LOST the job is
 * aborted; and -ENOMEM. */
int broker_register(struct broker *b, struct job_member *m, uid_t uid, enum region_kind kind, uint64_t size,
                    uint32_t tag, int fd, uint64_t *ret_id, char *errmsg);

/* Closes region `id` of member `m` (RegionRelease); peers that imported it
 * keep their mappings. -ERROR_KIND_INVALID_ARGUMENT when `m` owns no such
 * region: ids of other members' regions are refused alike, so release
 * reveals nothing about them. */
int broker_release(struct broker *b, struct job_member *m, uint64_t id, char *errmsg);

/* Hides region `id` of member `m` from its peers (broker_fetch()) or shows
 * it again: a proxy region is registered here first, charged and capped
 * like every other, and shown once its transport registration, which runs
 * off the loop, is done (datapath.c). Does nothing when `m` owns no such
 * region. */
void broker_hide(struct job_member *m, uint64_t id, bool hidden);

/* Closes every region of `m`. */
void broker_drop_member(struct broker *b, struct job_member *m);

/* Collects the regions member `m` may receive: of rank `rank` (any rank of
 * the job, its own included) or, for -1, of every other rank; with tag `tag`
 * or, for -1, any tag; none that is hidden (broker_hide()). Order: rank ascending, then registration order.
 * Returns 0 with a malloc'ed array of at most `max` borrowed pointers
 * (NULL when none), -ERROR_KIND_RANK_OUT_OF_RANGE for a rank outside the
 * job, -ERROR_KIND_INVALID_ARGUMENT for a bad tag,
 * -ERROR_KIND_LIMIT_EXCEEDED when more than `max` match, -ENOMEM. */
int broker_fetch(const struct job_member *m, int32_t rank, int64_t tag, size_t max,
                 struct region ***ret_regions, size_t *ret_count, char *errmsg);

#endif
