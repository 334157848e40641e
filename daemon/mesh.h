/* The internode mesh: TCP connections between moeepd daemons, their mutual
 * authentication with the cluster key (auth.h), liveness and round-trip
 * time (PeerPing), and the jobs whose ranks joined at several daemons.
 *
 * Wire: every frame is a 4-byte big-endian length and one PeerMessage
 * (moeep.proto, "mesh"); docs/protocol.md, "Mesh", has the whole exchange.
 *
 * Peers: one struct mesh_peer per connection. The daemons named in
 * mesh_peers are the only ones this daemon meshes with: each is dialled by
 * us ("outbound"), lives as long as the daemon and is redialled every
 * MESH_REDIAL_MS while down; a connection we accept ("inbound") is taken
 * only from a daemon that proves the cluster key *and* one of those
 * identities (auth.h), and is freed once it fails. Nothing a client sends
 * creates a peer or a connection: a forwarded join goes only to a
 * configured peer. Mesh addresses are kept canonical (mesh_address_canon()
 * in mesh-handshake.c: numeric, "IPV4:PORT" or "[IPV6]:PORT"), so that two
 * spellings of one socket address compare equal as strings. A peer is
 * usable only in state UP; until then it may send only handshake messages,
 * frames of at most MESH_FRAME_MAX_UNAUTH bytes, and must finish within
 * MESH_HANDSHAKE_MS; at most MESH_MAX_UNAUTH inbound connections may be
 * unauthenticated at once, MESH_MAX_UNAUTH_PER_SOURCE from one source
 * address (an IPv6 /64), and a new one from a source at its quota (or any
 * when all are taken) displaces the oldest of that source (or of the
 * source with the most), so that one flooding source cannot keep a real
 * peer out. Every way a peer fails goes through one function
 * (mesh_peer_fail() in mesh.c), which logs once (pre-authentication
 * refusals at most MESH_PREAUTH_LOGS_PER_S lines a second, then a count).
 *
 * Jobs: the daemon named in a job's unique id (job.h) is its home. A JobJoin
 * that names another daemon is forwarded there (mesh_join_forward()); the
 * home adds a member with `remote` set whose owner is a struct mesh_rank,
 * and the joining daemon adds its session to a mirror of the job
 * (jobs_join_mirror()). Barrier, leave and loss of a mirror's members go to
 * the home; the home's answers (barrier done, rank lost, the rank -> node
 * map) come back. When a peer goes down, the home declares every rank that
 * joined through it lost, and a mirror whose home went down is aborted with
 * PeerLost for every remote rank. Only metadata crosses the mesh: memory of
 * remote ranks is reached through the transports (transport.h), never as
 * fds. */
#ifndef MOEEPD_MESH_H
#define MOEEPD_MESH_H

#include <stdbool.h>
#include <stdint.h>
#include <sys/queue.h>

#include "auth.h"
#include "job.h"
#include "moeep.pb-c.h"

struct bufferevent;
struct daemon;
struct event;
struct evconnlistener;
struct session;

#define MESH_FRAME_MAX 65536 /* largest PeerMessage either side seals or opens */
/* Largest frame on the wire: a sealed PeerMessage of MESH_FRAME_MAX bytes,
 * its tag and the outer PeerMessage's field header. */
#define MESH_FRAME_MAX_WIRE (MESH_FRAME_MAX + AUTH_SEAL_BYTES + 16)
#define MESH_FRAME_MAX_UNAUTH 1024   /* before the handshake is done */
#define MESH_HANDSHAKE_MS 1000       /* from connect/accept to UP */
#define MESH_MAX_UNAUTH 64           /* inbound connections still authenticating */
#define MESH_MAX_UNAUTH_PER_SOURCE 4 /* of those, from one IPv4 address or IPv6 /64 */
#define MESH_PREAUTH_LOGS_PER_S 8    /* pre-authentication refusals logged per second */
#define MESH_PEERS_MAX 128           /* daemons in mesh_peers */
/* Connections the kernel queues for accept(): deep enough that a flood
 * between two turns of the loop does not drop a real peer's SYN (which
 * would cost it a 1 s retransmission). */
#define MESH_LISTEN_BACKLOG 1024
/* Connections accepted in one turn of the loop; then the listener pauses
 * until the loop has served everything else that is ready, so that a
 * flood of connections cannot hold the loop (and the clients) for long. */
#define MESH_ACCEPTS_PER_TURN 16
#define MESH_PING_MS 1000       /* PeerPing interval once UP */
#define MESH_DEAD_MS 5000       /* no PeerPong for this long: the peer is down */
#define MESH_REDIAL_MS 1000     /* an outbound peer that is down is redialled after this */
#define MESH_OUT_MAX (4u << 20) /* bytes queued to one peer before it counts as stuck */

/* mesh_peer.tp_peer while the connection has no transport peer. */
#define MESH_NO_TP_PEER UINT32_MAX

enum mesh_peer_state {
        MESH_PEER_CONNECTING,     /* outbound: TCP connect in progress */
        MESH_PEER_AUTHENTICATING, /* connected; handshake not done */
        MESH_PEER_UP,             /* authenticated both ways */
        MESH_PEER_DOWN,           /* failed; outbound peers wait to be redialled */
};

const char *mesh_peer_state_to_string(enum mesh_peer_state s);

struct mesh_rank;
TAILQ_HEAD(mesh_rank_list, mesh_rank);

struct mesh_peer {
        struct mesh *mesh; /* not owning */
        enum mesh_peer_state state;
        bool outbound;
        bool dead;               /* inbound and failed: freed from the loop */
        bool unreachable_logged; /* outbound: the last dial failed and was logged */
        /* Its mesh address (canonical): the configured one for an outbound
         * peer; for an inbound one the identity it proved, and until then
         * the connected socket's address (never used to find a peer). */
        char address[JOB_NODE_MAX + 1];
        char remote[JOB_NODE_MAX + 1]; /* the connected socket's address, for logs */
        char claimed[JOB_NODE_MAX +
                     1];         /* inbound: the identity its PeerHello claimed, believed once proved */
        uint8_t source[16];      /* inbound: its source address (IPv6 /64 or IPv4), for the quota */
        uint64_t accepted_ns;    /* inbound: CLOCK_MONOTONIC of accept() */
        struct bufferevent *bev; /* owns; NULL while down */
        struct event *ev_timer;  /* owns; handshake deadline, then ping, or redial */
        uint8_t nonce_dialler[AUTH_NONCE_BYTES];
        struct auth_session auth; /* this connection's keys (wiped when it ends) */
        bool have_keys;           /* `auth` is derived: the other side's proof can be checked */
        bool sealed;              /* the handshake is done: every frame both ways is sealed */
        bool got_hello;           /* acceptor: PeerHello arrived */
        bool sent_proof;          /* dialler: PeerProof sent, waiting for PeerWelcome */
        uint64_t ping_seq;        /* last PeerPing sent */
        uint64_t last_pong_ns;    /* CLOCK_MONOTONIC of the last PeerPong (or of going UP) */
        uint64_t rtt_us;          /* last measured round trip, 0 before the first */
        uint32_t minor;           /* its protocol minor (PeerHello/PeerChallenge), 0 = 1.2 or older */
        /* The transport connection to that daemon (datapath.h), made anew
         * each time this connection comes up: our half's index, and whether
         * its PeerTransport arrived and connected it. */
        uint32_t tp_peer; /* MESH_NO_TP_PEER while none */
        bool tp_connected;
        struct mesh_rank_list ranks; /* owns; ranks of our home jobs that joined through this peer */
        TAILQ_ENTRY(mesh_peer) entry;
};

TAILQ_HEAD(mesh_peer_list, mesh_peer);

struct mesh_join; /* a JobJoin forwarded to a home, waiting for PeerJoined */
TAILQ_HEAD(mesh_join_list, mesh_join);

struct mesh {
        struct daemon *daemon;           /* not owning */
        struct evconnlistener *listener; /* owns */
        char address[JOB_NODE_MAX + 1];  /* ours: mesh_listen, with the real port when it said 0 */
        bool keyed;                      /* `key` was loaded from cluster_key_file */
        uint8_t key[AUTH_KEY_BYTES];     /* never logged or shown */
        struct mesh_peer_list peers;     /* owns */
        uint32_t unauthenticated;        /* inbound peers not yet UP */
        uint64_t log_second;             /* CLOCK_MONOTONIC second of the pre-auth log budget */
        uint32_t log_lines;              /* pre-auth refusals logged in that second */
        uint32_t log_suppressed;         /* and those not logged */
        struct mesh_join_list joins;     /* owns; forwarded joins waiting for an answer */
        uint64_t next_token;
        struct event *ev_reap;          /* owns; frees dead inbound peers from the loop */
        struct event *ev_accept_resume; /* owns; re-enables the listener after a full turn */
        uint32_t accepted_this_turn;    /* since the listener was last (re-)enabled */
        uint64_t refused;               /* connections refused (bad key, no key, timeout, cap) */
};

/* Starts the mesh when mesh_listen is set: loads the key, listens, dials
 * mesh_peers. Returns 0 (with *ret_mesh NULL when the mesh is off) or -errno
 * with errmsg naming the key or value. */
int mesh_start(struct daemon *d, struct mesh **ret_mesh, char *errmsg);

/* Closes every connection; fails forwarded joins. Accepts NULL. */
void mesh_free(struct mesh *mesh);

/* Our mesh address, or NULL when the mesh is off (mesh NULL). */
const char *mesh_address(const struct mesh *mesh);

/* Whether mesh address `address` (any spelling config_listen_split()
 * takes: "localhost:P", "127.0.0.1:0P", "[::ffff:127.0.0.1]:P", ...) is
 * this daemon's own. False when the mesh is off or it is no address. */
bool mesh_address_is_self(const struct mesh *mesh, const char *address);

/* Forwards session `s`'s JobJoin (request `rid`) to the job's home daemon
 * `home` (from the unique id, as the client sent it), which must be one of
 * mesh_peers in some spelling: nothing else is ever dialled. Returns 0 when
 * the reply is held back (session_joined() or an Error follows), or -errno
 * with errmsg naming the address: -ENOENT when the mesh is off or `home` is
 * not a configured peer, -EINVAL when it is no address or this daemon,
 * -EALREADY when `s` already waits for one. */
int mesh_join_forward(struct mesh *mesh, struct session *s, uint64_t rid, const Moeep__V1__JobJoin *jj,
                      const char *home, char *errmsg);

/* Member `m` of a mirror entered its barrier (job_barrier() returned 1):
 * asks the home. */
void mesh_barrier(struct mesh *mesh, struct job_member *m);

/* Member `m` of a mirror is about to leave (`lost` false) or be lost: tells
 * the home. Call before job_member_leave() / job_member_lost(). */
void mesh_member_gone(struct mesh *mesh, struct job_member *m, bool lost, const char *reason);

/* Member `m` (a rank at this daemon) registered (`released` false) or
 * released a region: tells the home, or for a home job the daemons with
 * ranks of it, so that their RegionsFetch lists it as remote. `proxy` is
 * its Moeep__V1__ProxyRole and `rkey` (NULL: none) where the other
 * daemons' transports write into it (datapath.h). */
void mesh_region_changed(struct mesh *mesh, const struct job_member *m, uint64_t region_id, uint32_t tag,
                         uint32_t kind, uint64_t size, bool released, uint32_t proxy,
                         const struct tp_rkey *rkey);

/* The transport peer (datapath.h) that reaches daemon `address`: 0 and
 * *ret_tp_peer, -ENOTCONN when no connection to it is up, -ENODEV when it
 * is up but no transport connection was made over it. */
int mesh_transport_peer(const struct mesh *mesh, const char *address, uint32_t *ret_tp_peer);

/* The proxy failed transport peer `tp_peer` (`why` says how): every job
 * with ranks at that daemon is aborted naming one, and the mesh connection
 * is failed, so that a fresh transport connection is made when it comes
 * back. */
void mesh_transport_failed(struct mesh *mesh, uint32_t tp_peer, const char *why);

/* Rank `rank` of `job` (at this daemon) cannot go on (its channel failed):
 * aborts the job here naming it and tells the home, which tells the other
 * daemons, as a lost rank. The member stays until its session leaves. */
void mesh_rank_failed(struct mesh *mesh, struct job *job, uint32_t rank, const char *reason);

/* A local rank of home job `job` joined: tells the daemons with ranks of it
 * the new rank -> node map. */
void mesh_job_changed(struct mesh *mesh, const struct job *job);

/* The rank -> node map of `job` as this daemon knows it: for a home job
 * from its members, for a mirror as the home last said. Returns false for
 * a job that does not span daemons (every entry ""). */
bool mesh_job_nodes(const struct mesh *mesh, const struct job *job, struct job_node ret[MOEEP_MAX_RANKS]);

/* Peers in each state, for the metrics. */
void mesh_count(const struct mesh *mesh, uint32_t ret_counts[MESH_PEER_DOWN + 1]);

/* Jobs with ranks at both this daemon and `p`. */
uint32_t mesh_peer_jobs(const struct mesh *mesh, const struct mesh_peer *p);

/* The callbacks of the members that stand for remote ranks. */
extern const struct job_callbacks mesh_rank_callbacks;

#endif
