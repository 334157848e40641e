/* The internode data path of moeepd: the transport opened at start-up
 * (transport.h), the one proxy thread over it (proxy.h), the transport
 * connections to the other daemons of the mesh, the ranks' proxy regions
 * and their channels (descriptor rings).
 *
 * Who calls what:
 *  - daemon.c starts it when the mesh is on (datapath_start), after the
 *    mesh and the jobs across daemons, which it calls (mesh.h,
 *    mesh-jobs.h), and frees it after the sessions and the mesh are gone.
 *  - It subscribes to the mesh for each connection's transport peer: when
 *    a peer daemon's connection comes up it makes the local half of a
 *    transport connection, sends its address in PeerTransport and connects
 *    with the peer's; when the connection goes down (or is dropped as a
 *    duplicate) it lets the transport peer go, which fails it so that
 *    rings routing to it get an error, and the proxy frees it once its
 *    writes drained (proxy.h, "Transport peers"); when a remote rank goes
 *    (mesh_rank_gone()) the routes to it lead nowhere. A daemon that holds
 *    PROXY_PEERS_PER_NAME transport peers already (failed ones not freed
 *    yet) has its connection failed as it comes up, and redials.
 *  - membership.c registers regions with a proxy role
 *    (datapath_region_register), releases them and tells it when a member
 *    goes; requests.c opens channels (datapath_channel_open).
 *
 * Lifetime of a rank's send region: a ring reads it until the proxy says the
 * ring is removed (PROXY_EVENT_RING_REMOVED), so when its member goes the
 * rank's state lingers here, holding the send registration, until every one
 * of its rings is removed. Receive and counter registrations go at once.
 *
 * Proxy events come through the proxy's eventfd on the loop: a ring error
 * (a bad descriptor) aborts the producer's job naming its rank; a failed
 * transport peer fails the mesh connection to that daemon (mesh.c): its
 * client (mesh-jobs.c) aborts every job with ranks there, and the mesh
 * makes a fresh transport connection when the connection comes back. */
#ifndef MOEEPD_DATAPATH_H
#define MOEEPD_DATAPATH_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "datapath/transport.h"
#include "state/clientfd.h" /* enum region_kind */
#include "state/job.h"

struct broker;
struct config;
struct datapath;
struct event_base;
struct mesh;
struct mesh_jobs;

/* A region's part in the proxy path (RegionRegister.proxy: the
 * protocol's ProxyRole, value for value; requests.c translates it). */
enum region_role {
        REGION_ROLE_NONE = 0,     /* an ordinary region (NVLink peers map it) */
        REGION_ROLE_SEND = 1,     /* source of the rank's writes */
        REGION_ROLE_RECV = 2,     /* target of other ranks' data */
        REGION_ROLE_COUNTERS = 3, /* target of the 8-byte signal writes */
};
#define REGION_ROLES (REGION_ROLE_COUNTERS + 1)

/* A region a member registers: what RegionRegister asks, in the daemon's
 * terms. */
struct region_spec {
        enum region_kind kind;
        uint64_t size;
        uint32_t tag;
        enum region_role role;
};

/* Descriptors of a ring when ChannelOpen says 0. */
#define DATAPATH_RING_DEFAULT 1024
/* Channels (rings) one rank may open. */
#define DATAPATH_MAX_CHANNELS 8

/* Starts the data path when the mesh is on (mesh_listen set): opens the
 * configured transport (transport, fabric_provider, transport_device,
 * transport_address) and starts the proxy. `c` (read at each registration
 * for max_proxy_bytes_per_uid and max_proxy_bytes) and `fds` (each
 * registration's fd is charged there, and its transport part runs in its
 * uid's queue: clientfd_run()) must outlive it. When the transport does not
 * open, moeepd runs without the internode data path: that is logged once
 * (a warning naming the transport and why) and every request that needs it
 * is answered with the same text. Returns 0 (*ret NULL when the mesh is
 * off) or -ENOMEM. */
int datapath_start(struct event_base *base, const struct config *c, struct clientfds *fds, struct mesh *mesh,
                   struct mesh_jobs *mesh_jobs, struct datapath **ret);

/* Waits for the registrations under way (their members went with the
 * sessions: each undoes itself), stops the proxy, drops every registration
 * and closes the transport; one still in the transport after
 * DATAPATH_FREE_WAIT_MS leaves everything to the process's exit. Call
 * before clientfds_free(). Accepts NULL. */
void datapath_free(struct datapath *dp);

/* Whether the transport is open and the proxy runs; when not, `why` (may
 * be NULL) gets the reason. */
bool datapath_up(const struct datapath *dp, const char **ret_why);

/* Backend name of the transport ("fabric", "verbs", "cuda"). */
const char *datapath_backend(const struct datapath *dp);

/* The transport's byte counters (transport.h, struct tp_stats): true and
 * *ret filled where the backend counts (cuda), false otherwise. */
bool datapath_transport_stats(const struct datapath *dp, struct tp_stats *ret);

/* The transport peers held now (proxy.h, "Transport peers"): connected,
 * and failed ones whose writes still drain or whose mesh connection has
 * not let go yet. Both 0 without a data path. */
void datapath_transport_peers(const struct datapath *dp, uint32_t *ret_connected, uint32_t *ret_draining);

/* What a proxy region's registration hands back (datapath_region_register()),
 * on the loop, exactly once: 0 and the region's id, or an error (-errno or
 * an error kind) with errmsg saying why: what the transport refused the
 * memory with (its -EINVAL as -ERROR_KIND_INVALID_ARGUMENT), or -ECANCELED
 * when the rank left its job (or was lost, or the daemon stops) before the
 * registration was done (nothing of it is kept then). */
typedef void datapath_registered_fn(void *ctx, int error, uint64_t id, const char *errmsg);

/* RegionRegister with a proxy role, of an fd that passed clientfd_check()
 * (broker_register()). On the loop, at once: checks the role (one region
 * of each per rank), the kind (a memfd sealed with F_SEAL_SHRINK, and
 * still of the size now that it cannot shrink; a dma-buf where the
 * transport takes one) and the size (counters: a multiple of 8), registers
 * the region with the broker, hidden from the peers (broker_hide()), and
 * charges it. Then the transport's registration (mr_new: it maps the
 * memory, or pins it, faulting in every page: a few GiB take about a
 * second) runs off the loop, in `uid`'s own queue of checks
 * (clientfd_run()), where it delays nobody else; back on the loop the
 * region is the rank's, shown to its peers, the mesh is told (with the
 * rkey for recv and counter regions), and `done` is called.
 * `*fd` is taken (set to -1) once the broker took it, on success and on a
 * later failure alike (the broker then closes it, off the loop), so the
 * caller closes it only while it is still >= 0. Returns 0 once the
 * registration is under way (`done` comes later), or an error (`done` is
 * never called then): as broker_register (a bad role, kind, seal or size:
 * -ERROR_KIND_INVALID_ARGUMENT), plus -ENODEV without a data path, and
 * -ERROR_KIND_LIMIT_EXCEEDED past max_proxy_bytes_per_uid or
 * max_proxy_bytes (a memfd region's bytes) or max_fds_per_uid (one fd per
 * registration), or when `uid`'s queue of checks is full: a registration
 * stays charged to its uid until it is freed, DATAPATH_MR_LINGER_MS after
 * a release for recv and counters. */
int datapath_region_register(struct datapath *dp, struct broker *b, struct job_member *m, uid_t uid,
                             const struct region_spec *spec, int *fd, datapath_registered_fn *done, void *ctx,
                             char *errmsg);

/* Before broker_release(): drops the transport registration when `id` is one
 * of `m`'s proxy regions. -ERROR_KIND_INVALID_ARGUMENT for a send region
 * that an open channel reads. */
int datapath_region_release(struct datapath *dp, struct job_member *m, uint64_t id, char *errmsg);

/* ChannelOpen: creates a ring of `capacity` descriptors (0: the default)
 * whose descriptor peer r goes to rank r of `m`'s job, hands it to the
 * proxy and returns its fd (the caller's) and id. Errors: -ENODEV without a
 * data path, and error kinds (errors.h): PEER_LOST for an aborted job,
 * INVALID_ARGUMENT no send region or a bad capacity, LIMIT_EXCEEDED past
 * DATAPATH_MAX_CHANNELS, NOT_READY when a rank at another daemon has not joined, has no transport connection
 * yet, or has not registered its recv and counters regions. */
int datapath_channel_open(struct datapath *dp, struct job_member *m, uint32_t capacity, int *ret_fd,
                          uint64_t *ret_ring_id, uint32_t *ret_capacity, char *errmsg);

/* How long datapath_free() waits for registrations under way. */
#define DATAPATH_FREE_WAIT_MS 10000

/* How long a receive or counter registration outlives its release (or
 * its rank): writes to it that were on their way land, rather than meet a
 * key the transport no longer knows (datapath.c, mr_retire()). Twice the
 * proxy's write timeout. */
#define DATAPATH_MR_LINGER_MS 10000

/* `m` leaves its job or is lost: its channels are removed and its
 * registrations dropped (the send region once the rings are gone; the
 * receive and counters registrations retire for DATAPATH_MR_LINGER_MS, so
 * that writes other daemons had in flight to a lost rank still land). A
 * job that loses a rank keeps its other ranks' channels: an elastic job
 * goes on without the rank; an endpoint that is not elastic stops at the
 * abort word, and its channels go when it leaves. Call before
 * broker_drop_member(). Accepts dp NULL. */
void datapath_member_gone(struct datapath *dp, struct job_member *m);

#endif
