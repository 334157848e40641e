/* The internode data path; see datapath.h. At the end, its side of the
 * mesh: each connection's transport peer (PeerTransport), as a subscriber
 * of the mesh, and what the proxy's events tell the mesh. */
#include <errno.h>
#include <event2/event.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/queue.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "config.h"
#include "datapath/datapath.h"
#include "datapath/proxy.h"
#include "mesh/mesh-jobs.h"
#include "mesh/mesh.h"
#include "errors.h"
#include "log.h"
#include "state/broker.h"
#include "state/clientfd.h"

/* One open channel: a ring the proxy reads. */
struct dp_channel {
        uint64_t ring_id;
        bool removing; /* proxy_ring_remove asked; RING_REMOVED frees it */
        TAILQ_ENTRY(dp_channel) entry;
};

TAILQ_HEAD(dp_channel_list, dp_channel);

/* The proxy state of one rank at this daemon. */
struct dp_rank {
        struct job_member *member; /* not owning; NULL once it went (the rank lingers for its rings) */
        uint64_t job_id;           /* for messages after the member went */
        uint32_t rank;
        uid_t uid;                        /* the uid its registrations are charged to */
        uint64_t region_id[REGION_ROLES]; /* 0 = none */
        struct tp_mr *mr[REGION_ROLES];   /* owns */
        uint64_t host[REGION_ROLES];      /* bytes of mr charged as host memory (dp_usage) */
        struct dp_channel_list channels;  /* owns */
        uint32_t nchannels;
        /* Not owning: the registrations under way (region_id is theirs
         * already, mr not yet). */
        struct dp_pending *pending[REGION_ROLES];
        TAILQ_ENTRY(dp_rank) entry;
};

TAILQ_HEAD(dp_rank_list, dp_rank);

/* A receive or counter registration the rank let go, kept until no
 * writer can still be on its way (DATAPATH_MR_LINGER_MS). */
struct dp_retired {
        struct tp_mr *mr; /* owns */
        uid_t uid;        /* still charged to it (dp_usage, and one fd) */
        uint64_t host;
        uint64_t until_ms;
        TAILQ_ENTRY(dp_retired) entry;
};

TAILQ_HEAD(dp_retired_list, dp_retired);

/* What one uid holds in transport registrations, live or retired, until
 * each is really freed: the host memory (memfd regions) the transport maps
 * or pins, for max_proxy_bytes_per_uid, and one fd each, charged in
 * clientfds (the mapping or pin holds the memfd's file, and cuda keeps a
 * duplicate of it). A release does not return the charge: the
 * registration lingers (mr_retire()). */
struct dp_usage {
        uid_t uid;
        uint64_t host;
        uint32_t mrs; /* the entry goes when 0 */
        LIST_ENTRY(dp_usage) entry;
};

/* A proxy region's registration while its transport part (mr_new) runs
 * off the loop, in its uid's queue (clientfd_run()): made on the loop
 * (datapath_region_register()), run on a checker (pending_run()), ended on
 * the loop (pending_done()). Owned by clientfd until it is handed back. */
struct dp_pending {
        struct datapath *dp;       /* not owning */
        struct broker *broker;     /* not owning */
        struct job_member *member; /* not owning; NULL once the member went (datapath_member_gone()) */
        uid_t uid;                 /* charged: dp_usage (`host` bytes, one fd) */
        struct region_spec spec;
        uint64_t id;       /* the broker's region, hidden until done */
        uint64_t host;     /* bytes charged as host memory */
        struct tp_mem mem; /* mem.fd: a duplicate of the region's fd, owned until the run closes it */
        char name[96];     /* mem.name */
        /* Written by the run, read on the loop once it is handed back: */
        struct tp_mr *mr; /* owns until the rank does */
        int error;
        char errmsg[ERRMSG_MAX];
        datapath_registered_fn *done;
        void *ctx;
};

struct datapath {
        const struct config *config;    /* not owning; the caps are read at each registration */
        struct clientfds *fds;          /* not owning; charges a registration's fd, runs its mr_new */
        uint32_t npending;              /* registrations whose run may be in the transport */
        LIST_HEAD(, dp_usage) usage;    /* owns; entries exist while a uid holds registrations */
        uint64_t host;                  /* host bytes of every registration (max_proxy_bytes) */
        struct mesh *mesh;              /* not owning; the peer daemons */
        struct mesh_jobs *mesh_jobs;    /* not owning; the jobs across them */
        struct dp_retired_list retired; /* owns; oldest first */
        struct event *ev_retired;       /* owns; frees them when their time is up */
        struct transport tp;            /* owns; zeroed when not open */
        struct proxy *proxy;            /* owns; NULL when not up */
        struct event *ev_proxy;         /* owns; the proxy's event fd */
        char why[ERRMSG_MAX + 160];     /* why it is not up: the transport's message and a hint */
        struct dp_rank_list ranks;      /* owns */
        uint64_t next_ring_id;
};

/* Its side of the mesh (at the end of this file). */
static int transport_peer(const struct datapath *dp, const char *address, uint32_t *ret_tp_peer,
                          uint32_t *ret_gen);
static void transport_failed(struct datapath *dp, uint32_t tp_peer, uint32_t gen, const char *why);
static void mesh_transport_subscribe(struct datapath *dp);

static const char *role_to_string(uint32_t role) {
        switch ((enum region_role)role) {
        case REGION_ROLE_NONE:
                return "none";
        case REGION_ROLE_SEND:
                return "send";
        case REGION_ROLE_RECV:
                return "recv";
        case REGION_ROLE_COUNTERS:
                return "counters";
        }
        return "unknown";
}

bool datapath_up(const struct datapath *dp, const char **ret_why) {
        if (dp && dp->proxy)
                return true;
        if (ret_why)
                *ret_why = dp ? dp->why : "the mesh is off (mesh_listen), so there is no internode data path";
        return false;
}

const char *datapath_backend(const struct datapath *dp) {
        return dp && dp->tp.ops ? dp->tp.ops->name : "";
}

/* ------------------------------------------------------------ ranks */

static struct dp_rank *rank_find(const struct datapath *dp, const struct job_member *m) {
        struct dp_rank *dr;

        if (!m) /* ranks that went have member NULL: never "found" */
                return NULL;
        TAILQ_FOREACH (dr, &dp->ranks, entry)
                if (dr->member == m)
                        return dr;
        return NULL;
}

static bool rank_has_regions(const struct dp_rank *dr) {
        for (uint32_t role = 0; role < REGION_ROLES; role++)
                if (dr->region_id[role])
                        return true;
        return false;
}

static uint64_t dp_now_ms(void) {
        struct timespec ts;

        clock_gettime(CLOCK_MONOTONIC, &ts);
        return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

static struct dp_usage *usage_find(const struct datapath *dp, uid_t uid) {
        struct dp_usage *u;

        LIST_FOREACH (u, &dp->usage, entry)
                if (u->uid == uid)
                        return u;
        return NULL;
}

/* Charges one registration of `host` bytes of host memory (0 for GPU
 * memory) to `uid`: the caps max_proxy_bytes_per_uid and max_proxy_bytes
 * on the bytes, and one fd against max_fds_per_uid and the daemon's
 * budget. `name` names the region in the refusal. */
static int usage_charge(struct datapath *dp, uid_t uid, uint64_t host, const char *name, char *errmsg) {
        const struct config *c = dp->config;
        struct dp_usage *u = usage_find(dp, uid);
        uint64_t held = u ? u->host : 0;
        char why[ERRMSG_MAX];
        int r;

        if (held > c->max_proxy_bytes_per_uid || host > c->max_proxy_bytes_per_uid - held)
                return errmsg_set(errmsg, -ERROR_KIND_LIMIT_EXCEEDED,
                                  "%s: %" PRIu64
                                  " bytes of host memory the daemon would map: uid %u holds %" PRIu64
                                  " in proxy regions (released ones count for %d s after), "
                                  "max_proxy_bytes_per_uid = %" PRIu64,
                                  name, host, (unsigned)uid, held, DATAPATH_MR_LINGER_MS / 1000,
                                  c->max_proxy_bytes_per_uid);
        if (dp->host > c->max_proxy_bytes || host > c->max_proxy_bytes - dp->host)
                return errmsg_set(
                        errmsg, -ERROR_KIND_LIMIT_EXCEEDED,
                        "%s: %" PRIu64 " bytes of host memory the daemon would map: all uids hold %" PRIu64
                        " in proxy regions (released ones count for %d s after), max_proxy_bytes = %" PRIu64,
                        name, host, dp->host, DATAPATH_MR_LINGER_MS / 1000, c->max_proxy_bytes);
        if (!u) {
                u = calloc(1, sizeof(*u));
                if (!u)
                        return errmsg_set(errmsg, -ENOMEM, "%s: out of memory", name);
                u->uid = uid;
                LIST_INSERT_HEAD(&dp->usage, u, entry);
        }
        if ((r = clientfds_charge(dp->fds, uid, 1, why)) < 0) {
                if (!u->mrs) {
                        LIST_REMOVE(u, entry);
                        free(u);
                }
                return errmsg_set(errmsg, -ERROR_KIND_LIMIT_EXCEEDED,
                                  "%s: its transport registration (released ones count for %d s after): %s",
                                  name, DATAPATH_MR_LINGER_MS / 1000, why);
        }
        u->host += host;
        u->mrs++;
        dp->host += host;
        return 0;
}

static void usage_return(struct datapath *dp, uid_t uid, uint64_t host) {
        struct dp_usage *u = usage_find(dp, uid);

        clientfds_uncharge(dp->fds, uid, 1);
        dp->host -= host;
        if (!u)
                return;
        u->host -= host;
        if (--u->mrs == 0) {
                LIST_REMOVE(u, entry);
                free(u);
        }
}

/* Frees a registration and returns its charge. */
static void mr_free(struct datapath *dp, struct tp_mr *mr, uid_t uid, uint64_t host) {
        dp->tp.ops->mr_free(dp->tp.tp, mr);
        usage_return(dp, uid, host);
}

/* Frees the retired registrations whose time is up; arms the timer for
 * the next one. */
static void retired_free(struct datapath *dp, bool all) {
        struct dp_retired *rt;
        uint64_t now = dp_now_ms();

        while ((rt = TAILQ_FIRST(&dp->retired)) && (all || rt->until_ms <= now)) {
                TAILQ_REMOVE(&dp->retired, rt, entry);
                mr_free(dp, rt->mr, rt->uid, rt->host);
                free(rt);
        }
        if (rt && dp->ev_retired) {
                struct timeval tv = { .tv_sec = (time_t)((rt->until_ms - now) / 1000),
                                      .tv_usec = (suseconds_t)((rt->until_ms - now) % 1000 * 1000) };

                evtimer_add(dp->ev_retired, &tv);
        }
}

static void retired_cb(evutil_socket_t fd, short what, void *arg) {
        retired_free(arg, false);
}

/* A receive or counter registration its rank let go: writers at other
 * daemons may still be on their way to it (their daemons learn of the
 * release over the mesh, and drop their routes to it then), and a write to
 * a key its target no longer knows makes some transports (libfabric tcp)
 * close the connection every job between the two daemons shares. So the
 * registration stays, holding the memory (the client's fd is closed), for
 * DATAPATH_MR_LINGER_MS; what arrives meanwhile lands where nobody reads.
 * It stays charged to its uid until then (dp_usage), so that releasing and
 * registering again cannot map more than the caps allow. */
static void mr_retire(struct datapath *dp, struct tp_mr *mr, uid_t uid, uint64_t host) {
        struct dp_retired *rt;

        if (!mr)
                return;
        rt = dp->ev_retired ? calloc(1, sizeof(*rt)) : NULL;
        if (!rt) {
                mr_free(dp, mr, uid, host);
                return;
        }
        rt->mr = mr;
        rt->uid = uid;
        rt->host = host;
        rt->until_ms = dp_now_ms() + DATAPATH_MR_LINGER_MS;
        TAILQ_INSERT_TAIL(&dp->retired, rt, entry);
        if (!evtimer_pending(dp->ev_retired, NULL))
                retired_free(dp, false);
}

static void rank_mr_drop(struct datapath *dp, struct dp_rank *dr, uint32_t role) {
        if (!dr->mr[role])
                return;
        if (role == REGION_ROLE_SEND)
                mr_free(dp, dr->mr[role], dr->uid, dr->host[role]); /* no ring reads it any more */
        else
                mr_retire(dp, dr->mr[role], dr->uid, dr->host[role]);
        dr->mr[role] = NULL;
        dr->host[role] = 0;
        dr->region_id[role] = 0;
}

/* Frees a rank that has no member and no ring left. */
static void rank_maybe_free(struct datapath *dp, struct dp_rank *dr) {
        if (dr->member || dr->nchannels)
                return;
        for (uint32_t role = 0; role < REGION_ROLES; role++)
                rank_mr_drop(dp, dr, role);
        TAILQ_REMOVE(&dp->ranks, dr, entry);
        free(dr);
}

static void channels_remove(struct datapath *dp, struct dp_rank *dr) {
        struct dp_channel *ch;

        TAILQ_FOREACH (ch, &dr->channels, entry) {
                if (ch->removing)
                        continue;
                ch->removing = true;
                if (proxy_ring_remove(dp->proxy, ch->ring_id) < 0)
                        /* Out of memory for the command: the ring stays
                         * until proxy_free, and so does its rank. */
                        log_warn("datapath: job %" PRIu64 " rank %" PRIu32 ": ring %" PRIu64
                                 " cannot be removed now; it goes at shutdown",
                                 dr->job_id, dr->rank, ch->ring_id);
        }
}

/* Rank `rank` of `job`, at another daemon, released its receive or
 * counter region, or left the job (mesh_rank_gone()): the routes to it in
 * the rings of the job's ranks here lead nowhere from now on
 * (proxy_route_drop()), so that a descriptor naming it fails its own ring
 * instead of reaching a region that daemon no longer knows. */
static void remote_rank_gone(void *arg, const struct job *job, uint32_t rank) {
        struct datapath *dp = arg;
        struct dp_rank *dr;
        struct dp_channel *ch;

        if (!datapath_up(dp, NULL))
                return;
        TAILQ_FOREACH (dr, &dp->ranks, entry) {
                if (!dr->member || dr->member->job != job)
                        continue;
                TAILQ_FOREACH (ch, &dr->channels, entry)
                        if (!ch->removing && proxy_route_drop(dp->proxy, ch->ring_id, rank) == -ENOMEM)
                                log_warn("datapath: job %" PRIu64 " rank %" PRIu32 ": ring %" PRIu64
                                         ": out of memory dropping its route to rank %" PRIu32,
                                         dr->job_id, dr->rank, ch->ring_id, rank);
        }
}

void datapath_member_gone(struct datapath *dp, struct job_member *m) {
        struct dp_rank *dr = dp ? rank_find(dp, m) : NULL;

        if (!dr)
                return;
        /* A registration under way is undone when its run returns
         * (pending_done()): the broker drops its hidden region now. */
        for (uint32_t role = 0; role < REGION_ROLES; role++)
                if (dr->pending[role]) {
                        dr->pending[role]->member = NULL;
                        dr->pending[role] = NULL;
                        dr->region_id[role] = 0;
                }
        channels_remove(dp, dr);
        rank_mr_drop(dp, dr, REGION_ROLE_RECV);
        rank_mr_drop(dp, dr, REGION_ROLE_COUNTERS);
        dr->member = NULL;
        rank_maybe_free(dp, dr);
}

/* ------------------------------------------------------------ regions */

/* What the transport needs of a region, and the checks that keep the
 * daemon safe while it reads or writes the memory. */
static int region_mem(const struct datapath *dp, const struct job_member *m, const struct region_spec *spec,
                      int fd, struct tp_mem *ret_mem, char *name, size_t name_size, char *errmsg) {
        const char *role = role_to_string(spec->role);
        struct stat st = { 0 };
        int seals;

        snprintf(name, name_size, "job %" PRIu64 " rank %" PRIu32 " %s region", m->job->id, m->rank, role);
        *ret_mem = (struct tp_mem){ .fd = fd, .length = spec->size, .name = name };
        switch (spec->kind) {
        case REGION_KIND_MEMFD:
                /* The transport maps it: a client that shrinks it would make
                 * the daemon fault on the next write. */
                seals = fcntl(fd, F_GET_SEALS);
                if (seals < 0 || !(seals & F_SEAL_SHRINK))
                        return errmsg_set(
                                errmsg, -ERROR_KIND_INVALID_ARGUMENT,
                                "%s: the memfd must be sealed with F_SEAL_SHRINK (memfd_create with "
                                "MFD_ALLOW_SEALING, then fcntl F_ADD_SEALS)%s",
                                name, seals < 0 ? ": it is not a memfd that allows seals" : "");
                /* Its size was checked off the loop before it was sealed
                 * (clientfd_check_async()): once more now that it cannot
                 * shrink. A memfd, so fstat is shmem's and never waits. */
                if (fstat(fd, &st) < 0 || (uint64_t)st.st_size < spec->size)
                        return errmsg_set(errmsg, -ERROR_KIND_INVALID_ARGUMENT,
                                          "%s of %" PRIu64 " bytes: the memfd has only %jd bytes", name,
                                          spec->size, (intmax_t)st.st_size);
                ret_mem->kind = TP_MEM_MEMFD;
                break;
        case REGION_KIND_DMABUF:
                ret_mem->kind = TP_MEM_DMABUF;
                break;
        case REGION_KIND_CUMEM_FD:
                /* GPU memory for a transport that imports it (cuda); the
                 * others refuse it in mr_new, naming what they take. */
                ret_mem->kind = TP_MEM_CUMEM;
                break;
        case REGION_KIND_UNSPECIFIED:
                return errmsg_set(errmsg, -ERROR_KIND_INVALID_ARGUMENT,
                                  "%s: kind %d: need a memfd (or a dma-buf or cuMem fd) for the %s transport",
                                  name, (int)spec->kind, datapath_backend(dp));
        }
        if (spec->role == REGION_ROLE_COUNTERS && spec->size % 8)
                return errmsg_set(errmsg, -ERROR_KIND_INVALID_ARGUMENT,
                                  "%s: size %" PRIu64 " is not a multiple of 8 (uint64 counters)", name,
                                  spec->size);
        return 0;
}

/* The transports and the proxy speak errno (transport.h, proxy.h): their
 * -EINVAL refuses what the client asked for (a memory kind or region the
 * transport cannot register, a ring capacity), which the client is told
 * as ERROR_INVALID_ARGUMENT. */
static int client_refusal(int r) {
        return r == -EINVAL ? -ERROR_KIND_INVALID_ARGUMENT : r;
}

/* A rank made for a registration alone goes again when it failed. */
static void rank_drop_unused(struct datapath *dp, struct dp_rank *dr) {
        if (dr->member && !dr->nchannels && !rank_has_regions(dr)) {
                TAILQ_REMOVE(&dp->ranks, dr, entry);
                free(dr);
        }
}

/* On a checker (clientfd_run()): the transport's registration, which
 * maps or pins the memory (transport.h: mr_new may run on any thread);
 * then the duplicate of the fd closes (the mapping or pin, or cuda's own
 * duplicate, holds the file now). Never logs. */
static void pending_run(void *arg) {
        struct dp_pending *p = arg;
        const struct datapath *dp = p->dp;

        p->error = dp->tp.ops->mr_new(dp->tp.tp, &p->mem, &p->mr, p->errmsg);
        close(p->mem.fd);
        p->mem.fd = -1;
}

/* Back on the loop: the registration becomes the rank's, is shown to its
 * peers and told to the mesh; or, refused by the transport or no longer
 * wanted (its member went), it is undone: the registration freed, the
 * charge returned, the broker's region released (a member that went took
 * it already). Then `done`. */
static void pending_done(void *arg) {
        struct dp_pending *p = arg;
        struct datapath *dp = p->dp;
        struct job_member *m = p->member;
        enum region_role role = p->spec.role;
        struct dp_rank *dr = m ? rank_find(dp, m) : NULL;
        struct job_rkey jrkey;
        struct tp_rkey rkey;
        char why[ERRMSG_MAX];
        int r = client_refusal(p->error);

        dp->npending--;
        if (!dr || r < 0) {
                if (p->mr) /* never told to anyone: no writer can be on its way */
                        mr_free(dp, p->mr, p->uid, p->host);
                else
                        usage_return(dp, p->uid, p->host);
        }
        if (!dr) {
                snprintf(why, sizeof(why), "%s: its rank left the job while it was being registered",
                         p->name);
                p->done(p->ctx, -ECANCELED, 0, why);
                free(p);
                return;
        }
        dr->pending[role] = NULL;
        if (r < 0) {
                dr->region_id[role] = 0;
                broker_release(p->broker, m, p->id, NULL);
                rank_drop_unused(dp, dr);
                p->done(p->ctx, r, 0, p->errmsg);
                free(p);
                return;
        }
        dr->mr[role] = p->mr;
        dr->host[role] = p->host;
        broker_hide(m, p->id, false);
        dp->tp.ops->mr_rkey(p->mr, &rkey);
        log_info("datapath: %s registered (region %" PRIu64 ", %" PRIu64 " bytes)", p->name, p->id,
                 p->spec.size);
        jrkey = (struct job_rkey){ .base = rkey.base, .key = rkey.key, .length = rkey.length };
        mesh_jobs_region_changed(dp->mesh_jobs, m, p->id, p->spec.tag, (uint32_t)p->spec.kind, p->spec.size,
                                 false, (uint32_t)role, role == REGION_ROLE_SEND ? NULL : &jrkey);
        p->done(p->ctx, 0, p->id, NULL);
        free(p);
}

int datapath_region_register(struct datapath *dp, struct broker *b, struct job_member *m, uid_t uid,
                             const struct region_spec *spec, int *fd, datapath_registered_fn *done, void *ctx,
                             char *errmsg) {
        struct dp_pending *p;
        const char *why;
        struct dp_rank *dr;
        int r;

        if (spec->role <= REGION_ROLE_NONE || spec->role >= REGION_ROLES)
                return errmsg_set(errmsg, -ERROR_KIND_INVALID_ARGUMENT,
                                  "region register: proxy role %d is unknown", (int)spec->role);
        if (!datapath_up(dp, &why))
                return errmsg_set(errmsg, -ENODEV, "%s region of rank %" PRIu32 ": %s",
                                  role_to_string(spec->role), m->rank, why);
        dr = rank_find(dp, m);
        if (dr && dr->region_id[spec->role])
                return errmsg_set(errmsg, -ERROR_KIND_INVALID_ARGUMENT,
                                  "rank %" PRIu32 " of job %" PRIu64
                                  " already registered a %s region (region %" PRIu64 "): release it first",
                                  m->rank, m->job->id, role_to_string(spec->role), dr->region_id[spec->role]);
        if (m->job->state == JOB_ABORTED)
                return errmsg_set(errmsg, -ERROR_KIND_PEER_LOST,
                                  "job %" PRIu64 " is aborted: rank %" PRId32 " was lost", m->job->id,
                                  m->job->lost_rank);
        p = calloc(1, sizeof(*p));
        if (!p)
                return errmsg_set(errmsg, -ENOMEM, "%s region of rank %" PRIu32 ": out of memory",
                                  role_to_string(spec->role), m->rank);
        *p = (struct dp_pending){
                .dp = dp, .broker = b, .member = m, .uid = uid, .spec = *spec, .done = done, .ctx = ctx
        };
        r = region_mem(dp, m, spec, *fd, &p->mem, p->name, sizeof(p->name), errmsg);
        if (r < 0) {
                free(p);
                return r;
        }
        if (!dr) {
                dr = calloc(1, sizeof(*dr));
                if (!dr) {
                        r = errmsg_set(errmsg, -ENOMEM, "%s: out of memory", p->name);
                        free(p);
                        return r;
                }
                dr->member = m;
                dr->uid = uid;
                dr->job_id = m->job->id;
                dr->rank = m->rank;
                TAILQ_INIT(&dr->channels);
                TAILQ_INSERT_TAIL(&dp->ranks, dr, entry);
        }
        r = broker_register(b, m, uid, spec->kind, spec->size, spec->tag, *fd, &p->id, errmsg);
        if (r < 0)
                goto fail;
        /* The broker owns the fd now: releasing the region below closes it
         * (on a closer thread), and a second close by the caller could hit
         * a number the loop has given to another client's fd meanwhile. */
        *fd = -1;
        broker_hide(m, p->id, true);
        /* Host memory the transport maps (tp-mem) or pins (verbs, fabric's
         * NIC providers, cuda): the daemon's own memory and address space,
         * capped far below max_region_bytes_per_uid. GPU memory is the
         * client's and is not counted; every registration holds an fd (the
         * run's duplicate of it, until the registration holds the file). */
        p->host = spec->kind == REGION_KIND_MEMFD ? spec->size : 0;
        r = usage_charge(dp, dr->uid, p->host, p->name, errmsg);
        if (r < 0)
                goto fail_broker;
        /* The run's own reference: the broker's fd closes when the member
         * goes, whenever that is. dup() never waits. */
        p->mem.fd = fcntl(p->mem.fd, F_DUPFD_CLOEXEC, 3);
        if (p->mem.fd < 0) {
                r = errmsg_set(errmsg, -errno, "%s: duplicating its fd: %s", p->name, strerror(errno));
                goto fail_charge;
        }
        /* mr_new runs off the loop, in the uid's own queue: pinning faults
         * in every page (a few GiB take about a second), which would hold
         * the loop, and every tenant with it; there it delays only the
         * uid's own checks and registrations. */
        dr->region_id[spec->role] = p->id;
        dr->pending[spec->role] = p;
        dp->npending++;
        r = clientfd_run(dp->fds, uid, pending_run, pending_done, p, errmsg);
        if (r == 0)
                return 0;
        dp->npending--;
        dr->pending[spec->role] = NULL;
        dr->region_id[spec->role] = 0;
        close(p->mem.fd); /* not the file's last reference: the broker holds it */
fail_charge:
        usage_return(dp, dr->uid, p->host);
fail_broker:
        broker_release(b, m, p->id, NULL);
fail:
        rank_drop_unused(dp, dr);
        free(p);
        return r;
}

int datapath_region_release(struct datapath *dp, struct job_member *m, uint64_t id, char *errmsg) {
        struct dp_rank *dr = dp ? rank_find(dp, m) : NULL;

        if (!dr || !id)
                return 0;
        for (uint32_t role = 1; role < REGION_ROLES; role++) {
                if (dr->region_id[role] != id)
                        continue;
                if (dr->pending[role]) /* its session waits for the registration: not sent */
                        return errmsg_set(errmsg, -ERROR_KIND_INVALID_ARGUMENT,
                                          "region %" PRIu64 " is still being registered", id);
                if (role == REGION_ROLE_SEND && dr->nchannels)
                        return errmsg_set(errmsg, -ERROR_KIND_INVALID_ARGUMENT,
                                          "region %" PRIu64 " is rank %" PRIu32
                                          "'s proxy send region and %" PRIu32
                                          " channel(s) read it: leave the job to close them",
                                          id, m->rank, dr->nchannels);
                rank_mr_drop(dp, dr, role);
        }
        return 0;
}

/* ------------------------------------------------------------ channels */

/* The remote region of `rank` with proxy role `role` in `job`, or NULL. */
static const struct job_remote_region *remote_find(const struct datapath *dp, const struct job *job,
                                                   uint32_t rank, uint32_t role) {
        uint32_t n;
        const struct job_remote_region *remote = mesh_jobs_remote_regions(job, &n);

        for (uint32_t i = 0; i < n; i++)
                if (remote[i].rank == rank && remote[i].proxy == role)
                        return &remote[i];
        return NULL;
}

/* Route r of `m`'s job: rank r's daemon and its recv and counter regions,
 * or PROXY_ROUTE_NONE for a rank at this daemon. */
static int route_fill(struct datapath *dp, const struct job_member *m, const struct job_node *nodes,
                      uint32_t r, struct proxy_route *ret, char *errmsg) {
        const struct job *job = m->job;
        const struct job_remote_region *recv, *counters;
        int e;

        *ret = (struct proxy_route){ .tp_peer = PROXY_ROUTE_NONE };
        if (r == m->rank || job_rank_local(job, r))
                return 0;
        if (!nodes[r].address[0])
                return errmsg_set(errmsg, -ERROR_KIND_NOT_READY,
                                  "rank %" PRIu32 " of job %" PRIu64 " has not joined yet", r, job->id);
        e = transport_peer(dp, nodes[r].address, &ret->tp_peer, &ret->tp_gen);
        if (e < 0)
                return errmsg_set(
                        errmsg, -ERROR_KIND_NOT_READY,
                        "rank %" PRIu32 " of job %" PRIu64 ": no transport connection to its daemon %s "
                        "yet (%s)",
                        r, job->id, nodes[r].address,
                        e == -ENOTCONN ? "the mesh connection is not up"
                                       : "that daemon sent no transport address: is its transport off?");
        recv = remote_find(dp, job, r, REGION_ROLE_RECV);
        counters = remote_find(dp, job, r, REGION_ROLE_COUNTERS);
        if (!recv || !counters)
                return errmsg_set(errmsg, -ERROR_KIND_NOT_READY,
                                  "rank %" PRIu32 " of job %" PRIu64
                                  " (at daemon %s) has not registered its proxy "
                                  "%s region%s yet: register, pass a job barrier, then open the channel",
                                  r, job->id, nodes[r].address,
                                  !recv && !counters ? "recv and counters"
                                  : !recv            ? "recv"
                                                     : "counters",
                                  !recv && !counters ? "s" : "");
        ret->data = (struct tp_rkey){ .base = recv->rkey.base,
                                      .key = recv->rkey.key,
                                      .length = recv->rkey.length };
        ret->counters = (struct tp_rkey){ .base = counters->rkey.base,
                                          .key = counters->rkey.key,
                                          .length = counters->rkey.length };
        return 0;
}

int datapath_channel_open(struct datapath *dp, struct job_member *m, uint32_t capacity, int *ret_fd,
                          uint64_t *ret_ring_id, uint32_t *ret_capacity, char *errmsg) {
        struct proxy_route routes[MOEEP_MAX_RANKS];
        struct job_node nodes[MOEEP_MAX_RANKS];
        struct dp_channel *ch;
        struct dp_rank *dr;
        const char *why;
        uint64_t id;
        int fd, r;

        if (!datapath_up(dp, &why))
                return errmsg_set(errmsg, -ENODEV, "channel open: %s", why);
        if (m->job->state == JOB_ABORTED)
                return errmsg_set(errmsg, -ERROR_KIND_PEER_LOST,
                                  "job %" PRIu64 " is aborted: rank %" PRId32 " was lost", m->job->id,
                                  m->job->lost_rank);
        dr = rank_find(dp, m);
        if (!dr || !dr->mr[REGION_ROLE_SEND])
                return errmsg_set(errmsg, -ERROR_KIND_INVALID_ARGUMENT,
                                  "channel open: rank %" PRIu32 " of job %" PRIu64
                                  " has no proxy send region "
                                  "(RegionRegister with proxy = PROXY_ROLE_SEND first)",
                                  m->rank, m->job->id);
        if (dr->nchannels >= DATAPATH_MAX_CHANNELS)
                return errmsg_set(errmsg, -ERROR_KIND_LIMIT_EXCEEDED,
                                  "channel open: rank %" PRIu32 " already has %d channels", m->rank,
                                  DATAPATH_MAX_CHANNELS);
        mesh_jobs_nodes(dp->mesh_jobs, m->job, nodes);
        for (uint32_t i = 0; i < m->job->world_size; i++) {
                r = route_fill(dp, m, nodes, i, &routes[i], errmsg);
                if (r < 0)
                        return r;
        }
        if (!capacity)
                capacity = DATAPATH_RING_DEFAULT;
        r = proxy_ring_create(capacity, &fd, errmsg);
        if (r < 0)
                return client_refusal(r);
        ch = calloc(1, sizeof(*ch));
        if (!ch) {
                close(fd);
                return errmsg_set(errmsg, -ENOMEM, "channel open: out of memory");
        }
        id = ++dp->next_ring_id;
        r = proxy_ring_add(dp->proxy, id, fd, dr->mr[REGION_ROLE_SEND], routes, m->job->world_size, errmsg);
        if (r < 0) {
                free(ch);
                close(fd);
                return r;
        }
        ch->ring_id = id;
        TAILQ_INSERT_TAIL(&dr->channels, ch, entry);
        dr->nchannels++;
        log_info("datapath: job %" PRIu64 " rank %" PRIu32 ": channel open, ring %" PRIu64 " of %" PRIu32
                 " descriptors, %" PRIu32 " routes",
                 m->job->id, m->rank, id, capacity, m->job->world_size);
        *ret_fd = fd;
        *ret_ring_id = id;
        *ret_capacity = capacity;
        return 0;
}

/* ------------------------------------------------------------ peers */

/* The local half of a connection to one more daemon (`address`) and its
 * address blob (TP_ADDR_MAX bytes at most); the peer's blob; letting go of
 * it (-errno: why), which fails it unless the proxy did already. The proxy
 * hands the index out and takes it back (proxy.h, "Transport peers").
 * Set-up calls return -errno with errmsg. */
static int datapath_peer_new(struct datapath *dp, const char *address, uint32_t *ret_tp_peer,
                             uint32_t *ret_gen, uint8_t ret_blob[TP_ADDR_MAX], size_t *ret_len,
                             char *errmsg) {
        const char *why;

        if (!datapath_up(dp, &why))
                return errmsg_set(errmsg, -ENODEV, "%s", why);
        return proxy_peer_new(dp->proxy, address, ret_tp_peer, ret_gen, ret_blob, ret_len, errmsg);
}

static int datapath_peer_connect(struct datapath *dp, uint32_t tp_peer, uint32_t gen, const void *blob,
                                 size_t len, char *errmsg) {
        const char *why;

        if (!datapath_up(dp, &why))
                return errmsg_set(errmsg, -ENODEV, "%s", why);
        return proxy_peer_connect(dp->proxy, tp_peer, gen, blob, len, errmsg);
}

static void datapath_peer_fail(struct datapath *dp, uint32_t tp_peer, uint32_t gen, int error) {
        if (datapath_up(dp, NULL) && proxy_peer_fail(dp->proxy, tp_peer, gen, error) < 0)
                /* Our own invariant (one let-go per hand-out), not a peer's doing. */
                log_err("datapath: transport peer %" PRIu32 " generation %" PRIu32 " let go twice", tp_peer,
                        gen);
}

/* ------------------------------------------------------------ events */

static struct dp_channel *channel_find(const struct datapath *dp, uint64_t ring_id,
                                       struct dp_rank **ret_rank) {
        struct dp_rank *dr;
        struct dp_channel *ch;

        TAILQ_FOREACH (dr, &dp->ranks, entry)
                TAILQ_FOREACH (ch, &dr->channels, entry)
                        if (ch->ring_id == ring_id) {
                                *ret_rank = dr;
                                return ch;
                        }
        return NULL;
}

static void proxy_event(struct datapath *dp, const struct proxy_event *ev) {
        struct dp_channel *ch;
        struct dp_rank *dr = NULL;
        char why[ERRMSG_MAX + 32];

        switch (ev->type) {
        case PROXY_EVENT_RING_REMOVED:
                ch = channel_find(dp, ev->ring_id, &dr);
                if (!ch)
                        return;
                TAILQ_REMOVE(&dr->channels, ch, entry);
                dr->nchannels--;
                free(ch);
                log_debug("datapath: job %" PRIu64 " rank %" PRIu32 ": ring %" PRIu64 " removed", dr->job_id,
                          dr->rank, ev->ring_id);
                rank_maybe_free(dp, dr);
                return;
        case PROXY_EVENT_RING_ERROR:
                ch = channel_find(dp, ev->ring_id, &dr);
                log_notice("datapath: %s", ev->msg);
                if (!ch || !dr->member)
                        return;
                /* The ring is dead and the ranks it writes to would wait for
                 * its counters: the job cannot go on. */
                /* What happened to the ring, without the proxy's name. */
                snprintf(why, sizeof(why), "channel: %s", ev->msg + ev->what);
                mesh_jobs_rank_failed(dp->mesh_jobs, dr->member->job, dr->member->rank, why);
                return;
        case PROXY_EVENT_PEER_FAILED:
                log_warn("datapath: %s", ev->msg);
                transport_failed(dp, ev->tp_peer, ev->tp_gen, ev->msg);
                return;
        case PROXY_EVENT_ROUTE_DEAD:
                /* The job learns of the lost daemon from the mesh (its
                 * abort, or an elastic job's mask): the writer is not to
                 * blame, so no abort naming it here. */
                log_notice("datapath: %s", ev->msg);
                return;
        case PROXY_EVENT_PEER_FREED:
                log_info("datapath: %s", ev->msg);
                return;
        }
}

static void proxy_event_cb(evutil_socket_t fd, short what, void *arg) {
        struct datapath *dp = arg;
        struct proxy_event ev;

        while (dp->proxy && proxy_event_next(dp->proxy, &ev))
                proxy_event(dp, &ev);
}

/* ------------------------------------------------------------ start, stop */

int datapath_start(struct event_base *base, const struct config *c, struct clientfds *fds, struct mesh *mesh,
                   struct mesh_jobs *mesh_jobs, struct datapath **ret) {
        struct tp_config cfg = {
                .backend = c->transport,
                .provider = c->fabric_provider,
                .device = c->transport_device,
                .node = c->transport_address[0] ? c->transport_address : NULL,
                .gid_index = c->verbs_gid_index,
        };
        char errmsg[ERRMSG_MAX] = "";
        struct datapath *dp;
        int r;

        *ret = NULL;
        if (!c->mesh_listen[0])
                return 0;
        dp = calloc(1, sizeof(*dp));
        if (!dp)
                return -ENOMEM;
        dp->config = c;
        dp->fds = fds;
        LIST_INIT(&dp->usage);
        dp->mesh = mesh;
        dp->mesh_jobs = mesh_jobs;
        TAILQ_INIT(&dp->ranks);
        TAILQ_INIT(&dp->retired);
        dp->ev_retired = evtimer_new(base, retired_cb, dp);
        if (!dp->ev_retired) {
                free(dp);
                return -ENOMEM;
        }
        r = transport_open(&cfg, &dp->tp, errmsg);
        if (r == 0)
                r = proxy_new(&dp->tp, NULL, "moeepd", &dp->proxy, errmsg);
        if (r == 0) {
                dp->ev_proxy =
                        event_new(base, proxy_event_fd(dp->proxy), EV_READ | EV_PERSIST, proxy_event_cb, dp);
                if (!dp->ev_proxy || event_add(dp->ev_proxy, NULL) < 0) {
                        datapath_free(dp);
                        return -ENOMEM;
                }
                log_info("datapath: transport %s%s%s open, proxy running", c->transport,
                         strcmp(c->transport, "fabric") == 0 ? " provider "
                         : strcmp(c->transport, "cuda") == 0 ? " device "
                                                             : "",
                         strcmp(c->transport, "fabric") == 0 ? c->fabric_provider
                         : strcmp(c->transport, "cuda") == 0
                                 ? (c->transport_device[0] ? c->transport_device : "0")
                                 : "");
        } else {
                snprintf(dp->why, sizeof(dp->why),
                         "this daemon has no internode data path: %s (see transport, fabric_provider, "
                         "transport_device and transport_address in moeepd.conf)",
                         errmsg);
                log_warn("datapath: %s", dp->why);
                proxy_free(dp->proxy);
                dp->proxy = NULL;
                transport_close(&dp->tp);
        }
        mesh_transport_subscribe(dp);
        *ret = dp;
        return 0;
}

bool datapath_transport_stats(const struct datapath *dp, struct tp_stats *ret) {
        if (!dp || !dp->tp.ops || !dp->tp.ops->stats)
                return false;
        dp->tp.ops->stats(dp->tp.tp, ret);
        return true;
}

void datapath_transport_peers(const struct datapath *dp, uint32_t *ret_connected, uint32_t *ret_draining) {
        proxy_peers_count(dp ? dp->proxy : NULL, ret_connected, ret_draining);
}

/* At shutdown, where the bytes went: how an operator (and the GPU tests)
 * see that the GPUDirect path kept payload out of host memory. */
static void datapath_stats_log(const struct datapath *dp) {
        struct tp_stats st;

        if (datapath_transport_stats(dp, &st))
                log_notice("datapath: transport %s totals: %" PRIu64 " writes, %" PRIu64
                           " bytes device-to-device, %" PRIu64 " bytes through client host memory, %" PRIu64
                           " bytes of daemon signal words",
                           datapath_backend(dp), st.writes, st.device, st.host, st.daemon);
}

void datapath_free(struct datapath *dp) {
        struct dp_rank *dr;
        struct dp_channel *ch;

        if (!dp)
                return;
        if (dp->mesh)
                mesh_subscribe(dp->mesh, MESH_OWNER_TRANSPORT, NULL);
        /* Registrations under way are in the transport, or about to be:
         * they end first (their members went with the sessions, so each
         * undoes itself, pending_done()). */
        for (uint64_t until = dp_now_ms() + DATAPATH_FREE_WAIT_MS; dp->npending && dp_now_ms() < until;)
                clientfds_settle(dp->fds, 100);
        if (dp->npending) {
                log_warn("datapath: %" PRIu32 " registrations still in the transport after %d s: it is left "
                         "open to the exit",
                         dp->npending, DATAPATH_FREE_WAIT_MS / 1000);
                return;
        }
        if (dp->ev_proxy)
                event_free(dp->ev_proxy);
        /* The thread first: it drops the rings that still read send
         * regions; then the registrations; then the transport. */
        proxy_free(dp->proxy);
        datapath_stats_log(dp);
        while ((dr = TAILQ_FIRST(&dp->ranks))) {
                while ((ch = TAILQ_FIRST(&dr->channels))) {
                        TAILQ_REMOVE(&dr->channels, ch, entry);
                        free(ch);
                }
                for (uint32_t role = 0; role < REGION_ROLES; role++)
                        rank_mr_drop(dp, dr, role);
                TAILQ_REMOVE(&dp->ranks, dr, entry);
                free(dr);
        }
        if (dp->ev_retired)
                event_free(dp->ev_retired);
        dp->ev_retired = NULL;
        retired_free(dp, true);
        transport_close(&dp->tp);
        free(dp);
}

/* ------------------------------------------------------------ the mesh */

/* A connection to a daemon came up: makes our half of a transport
 * connection to it and sends its address. Peers older than 1.3 would
 * refuse the message, and a daemon without a data path has nothing to
 * offer. When that daemon holds every transport peer it may (failed ones
 * not freed yet, after it connected and failed in a row: their writes
 * still drain) or all are held, the connection is failed: it is
 * redialled, and gets its transport peer once they are freed, instead of
 * staying up without one. */
static void transport_offer(void *arg, struct mesh_peer *p) {
        struct datapath *dp = arg;
        Moeep__V1__PeerTransport pt = MOEEP__V1__PEER_TRANSPORT__INIT;
        PEER_MSG(msg, transport, &pt, TRANSPORT);
        char errmsg[ERRMSG_MAX] = "";
        uint8_t blob[TP_ADDR_MAX];
        size_t len = 0;
        int r;

        if (p->minor < 3 || !datapath_up(dp, NULL))
                return;
        r = datapath_peer_new(dp, p->address, &p->tp_peer, &p->tp_gen, blob, &len, errmsg);
        if (r == -EUSERS || r == -ENOSPC) {
                /* Flushed: the PeerWelcome queued on it tells the dialler
                 * the handshake was fine, and the close what happened. */
                mesh_peer_fail(p, true, "no transport connection for it: %s", errmsg);
                return;
        }
        if (r < 0) {
                log_warn("mesh: peer %s: no transport connection: %s", p->address, errmsg);
                return;
        }
        pt.backend = (char *)datapath_backend(dp);
        pt.address.data = blob;
        pt.address.len = len;
        mesh_peer_send(p, &msg);
}

/* The peer's PeerTransport: connects our half with its address. */
static void transport_message(void *arg, struct mesh_peer *p, const Moeep__V1__PeerMessage *msg) {
        struct datapath *dp = arg;
        const Moeep__V1__PeerTransport *pt = msg->transport;
        char errmsg[ERRMSG_MAX] = "";

        if (p->tp_peer == MESH_NO_TP_PEER || p->tp_connected) {
                log_debug("mesh: peer %s: PeerTransport ignored (%s)", p->address,
                          p->tp_connected ? "already connected" : "this daemon has no data path");
                return;
        }
        if (!pt->backend || strcmp(pt->backend, datapath_backend(dp)) != 0) {
                log_warn("mesh: peer %s: its transport is '%.32s', ours '%s': no internode data path with it",
                         p->address, pt->backend ? pt->backend : "", datapath_backend(dp));
                return;
        }
        if (pt->address.len == 0 || pt->address.len > TP_ADDR_MAX ||
            datapath_peer_connect(dp, p->tp_peer, p->tp_gen, pt->address.data, pt->address.len, errmsg) < 0) {
                log_warn("mesh: peer %s: transport address of %zu bytes refused: %s", p->address,
                         pt->address.len, errmsg[0] ? errmsg : "bad length");
                return;
        }
        p->tp_connected = true;
        log_info("mesh: peer %s: transport connected (transport peer %" PRIu32 ", generation %" PRIu32 ")",
                 p->address, p->tp_peer, p->tp_gen);
}

/* The connection went down (or was dropped as a duplicate): its transport
 * peer is let go, which fails it in the proxy (rings routing to it get an
 * error) unless the proxy failed it already, and is forgotten here; the
 * proxy frees its index once its writes drained. */
static void transport_peer_down(void *arg, struct mesh_peer *p, bool was_up, bool transport_was_connected,
                                const char *lost, const char *why) {
        if (p->tp_peer != MESH_NO_TP_PEER)
                datapath_peer_fail(arg, p->tp_peer, p->tp_gen, -ECONNRESET);
        p->tp_peer = MESH_NO_TP_PEER;
        p->tp_connected = false;
}

/* The transport peer that reaches daemon `address`: 0 and *ret_tp_peer with
 * its generation, -ENOTCONN when no connection to it is up, -ENODEV when
 * it is up but no transport connection was made over it. */
static int transport_peer(const struct datapath *dp, const char *address, uint32_t *ret_tp_peer,
                          uint32_t *ret_gen) {
        struct mesh_peer *p = dp->mesh ? mesh_peer_find(dp->mesh, address) : NULL;

        if (!p)
                return -ENOTCONN;
        if (!p->tp_connected)
                return -ENODEV;
        *ret_tp_peer = p->tp_peer;
        *ret_gen = p->tp_gen;
        return 0;
}

/* The proxy failed transport peer (`tp_peer`, `gen`) (`why` says how): the
 * mesh connection that holds it is failed (its subscribers abort every job
 * with ranks at that daemon, naming one, and it lets the transport peer
 * go), so that a fresh transport connection is made when it comes back. */
static void transport_failed(struct datapath *dp, uint32_t tp_peer, uint32_t gen, const char *why) {
        struct mesh_peer *p;

        if (!dp->mesh)
                return;
        TAILQ_FOREACH (p, &dp->mesh->peers, entry)
                if (p->state == MESH_PEER_UP && p->tp_peer == tp_peer && p->tp_gen == gen) {
                        mesh_peer_fail(p, false, "its transport connection failed: %s", why);
                        return;
                }
}

static void mesh_transport_subscribe(struct datapath *dp) {
        const struct mesh_subscriber sub = {
                .arg = dp,
                .message = transport_message,
                .peer_up = transport_offer,
                .peer_down = transport_peer_down,
                .rank_gone = remote_rank_gone,
        };

        if (dp->mesh)
                mesh_subscribe(dp->mesh, MESH_OWNER_TRANSPORT, &sub);
}
