/* The internode mesh's peers: TCP connections between moeepd daemons,
 * their mutual authentication with the cluster key (auth.h), liveness and
 * round-trip time (PeerPing), and the transport connection made over each
 * (datapath/datapath.c). What travels over them for jobs is the business of
 * the layer above, the jobs across daemons (mesh-jobs.h).
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
 * in mesh.c: numeric, "IPV4:PORT" or "[IPV6]:PORT"), so that two
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
 * Who calls what: daemon.c starts the mesh (mesh_start()) first of the
 * floors above the state, and frees it after the jobs across daemons
 * (mesh_jobs_free()). The layers above it subscribe, one per owner of the
 * mesh's messages (struct mesh_subscriber): the jobs across daemons
 * (mesh-jobs.c), the forwarded joins (clients/membership.c) and each
 * connection's transport peer (datapath/datapath.c). The mesh hands each
 * the messages it owns of a connection that is up and tells them all when
 * a peer comes up or goes down; they send with mesh_peer_send() to peers
 * they find with mesh_peer_find(). The mesh includes nothing of theirs.
 * The mesh owns its peers, their connections, timers and keys. */
#ifndef MOEEPD_MESH_H
#define MOEEPD_MESH_H

#include <stdbool.h>
#include <stdint.h>
#include <sys/queue.h>

#include "mesh/auth.h"
#include "moeep.pb-c.h"
#include "state/job.h" /* JOB_NODE_MAX */

struct bufferevent;
struct config;
struct datapath;
struct event;
struct event_base;
struct evconnlistener;

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
#define MESH_PING_MS 1000   /* PeerPing interval once UP */
#define MESH_DEAD_MS 5000   /* no PeerPong for this long: the peer is down */
#define MESH_REDIAL_MS 1000 /* an outbound peer that is down is redialled after this */
/* Bytes queued to one peer: a message that would queue more fails the
 * connection (mesh_peer_send()). */
#define MESH_OUT_MAX (4u << 20)

/* mesh_peer.tp_peer while the connection has no transport peer. */
#define MESH_NO_TP_PEER UINT32_MAX

enum mesh_peer_state {
        MESH_PEER_CONNECTING,     /* outbound: TCP connect in progress */
        MESH_PEER_AUTHENTICATING, /* connected; handshake not done */
        MESH_PEER_UP,             /* authenticated both ways */
        MESH_PEER_DOWN,           /* failed; outbound peers wait to be redialled */
};

const char *mesh_peer_state_to_string(enum mesh_peer_state s);

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
        uint32_t tp_gen;  /* its generation (the proxy's), meaningful with tp_peer */
        bool tp_connected;
        /* Its output would have passed MESH_OUT_MAX with this many bytes
         * queued (it stopped reading): the connection is failed from the
         * loop, and until then nothing more is queued or read. 0 while it
         * reads. */
        size_t stuck_bytes;
        TAILQ_ENTRY(mesh_peer) entry;
};

TAILQ_HEAD(mesh_peer_list, mesh_peer);

/* Who handles a mesh message (proto/mesh.def's OWNER column): the peers
 * themselves (the handshake and liveness), or one of the layers above,
 * each subscribed once. */
enum mesh_owner {
        MESH_OWNER_PEERS,     /* mesh.c */
        MESH_OWNER_JOBS,      /* the jobs across daemons, mesh-jobs.c */
        MESH_OWNER_JOINS,     /* the forwarded joins, clients/membership.c */
        MESH_OWNER_TRANSPORT, /* each connection's transport peer, datapath/datapath.c */
        MESH_OWNERS,
};

/* A layer above the peers, subscribed with mesh_subscribe() for the
 * messages of one owner. Each member may be NULL. Called from the loop,
 * from inside the mesh's own callbacks: they may send, and must not free a
 * peer (the mesh does, from the loop). */
struct mesh_subscriber {
        void *arg; /* handed to each */
        /* A message of the subscriber's owner from `p`, which is UP; the
         * mesh frees `msg` after. */
        void (*message)(void *arg, struct mesh_peer *p, const Moeep__V1__PeerMessage *msg);
        /* `p` came up. Told in the order of enum mesh_owner; one may fail
         * it (mesh_peer_fail()), and the owners after it are not told. */
        void (*peer_up)(void *arg, struct mesh_peer *p);
        /* `p` failed (mesh_peer_fail(), already DOWN). `was_up`: it was UP,
         * `lost` says so ("daemon X lost: why"), and `transport_was_connected`
         * whether its transport peer was connected. `why` is the failure as
         * logged. Told the transport first (rings writing to that daemon
         * end before its jobs are aborted, so that no producer waits on it
         * meanwhile), then in the order of enum mesh_owner. For a
         * duplicate connection dropped without a word, only the transport
         * is told (`lost` empty), so that it lets its transport peer go. */
        void (*peer_down)(void *arg, struct mesh_peer *p, bool was_up, bool transport_was_connected,
                          const char *lost, const char *why);
        /* Jobs with ranks at both this daemon and `p`. */
        uint32_t (*peer_jobs)(void *arg, const struct mesh_peer *p);
        /* Rank `rank` of `job`, at another daemon, released its receive or
         * counter region or left the job: what routed to it leads nowhere
         * from now on (mesh_rank_gone()). */
        void (*rank_gone)(void *arg, const struct job *job, uint32_t rank);
};

struct mesh {
        struct event_base *base; /* not owning */
        /* The layers above, by owner (all NULL until one subscribes;
         * [MESH_OWNER_PEERS] unused). */
        struct mesh_subscriber subscribers[MESH_OWNERS];
        struct evconnlistener *listener; /* owns */
        char address[JOB_NODE_MAX + 1];  /* ours: mesh_listen, with the real port when it said 0 */
        bool keyed;                      /* `key` was loaded from cluster_key_file */
        uint8_t key[AUTH_KEY_BYTES];     /* never logged or shown */
        struct mesh_peer_list peers;     /* owns */
        uint32_t unauthenticated;        /* inbound peers not yet UP */
        uint64_t log_second;             /* CLOCK_MONOTONIC second of the pre-auth log budget */
        uint32_t log_lines;              /* pre-auth refusals logged in that second */
        uint32_t log_suppressed;         /* and those not logged */
        struct event *ev_reap;           /* owns; frees dead inbound peers from the loop */
        struct event *ev_accept_resume;  /* owns; re-enables the listener after a full turn */
        uint32_t accepted_this_turn;     /* since the listener was last (re-)enabled */
        uint64_t refused;                /* connections refused (bad key, no key, timeout, cap) */
};

/* Starts the mesh when config's mesh_listen is set: loads the key,
 * listens, dials mesh_peers, on loop `base`. Returns 0 (with *ret_mesh NULL
 * when the mesh is off) or -errno with errmsg naming the key or value. */
int mesh_start(struct event_base *base, const struct config *config, struct mesh **ret_mesh, char *errmsg);

/* Takes every connection down without a word (no subscriber is told,
 * nothing is logged): the daemon is stopping. */
void mesh_close_all(struct mesh *mesh);

/* Closes every connection and frees every peer. Accepts NULL. */
void mesh_free(struct mesh *mesh);

/* Subscribes `s` (a copy is kept) for the messages of `owner` and the
 * mesh's news, or unsubscribes it (NULL). */
void mesh_subscribe(struct mesh *mesh, enum mesh_owner owner, const struct mesh_subscriber *s);

/* Our mesh address, or NULL when the mesh is off (mesh NULL). */
const char *mesh_address(const struct mesh *mesh);

/* Whether mesh address `address` (any spelling config_listen_split()
 * takes: "localhost:P", "127.0.0.1:0P", "[::ffff:127.0.0.1]:P", ...) is
 * this daemon's own. False when the mesh is off or it is no address. */
bool mesh_address_is_self(const struct mesh *mesh, const char *address);

/* The canonical spelling of `address` (see mesh.c). Returns 0 or
 * -EINVAL. */
int mesh_address_canon(const char *address, char ret[static JOB_NODE_MAX + 1]);

/* An identity as someone said it, made printable for a log line or an
 * error (never believed, only shown). */
void mesh_claim_printable(const char *claim, char ret[static JOB_NODE_MAX + 1]);

/* The configured peer (mesh_peers) at canonical address `canon`, or NULL. */
struct mesh_peer *mesh_configured_find(const struct mesh *mesh, const char *canon);

/* The connection that is UP to the daemon at canonical address `address`,
 * or NULL. */
struct mesh_peer *mesh_peer_find(const struct mesh *mesh, const char *address);

/* Declares PeerMessage `var` whose body is `value` (of case `Case`). */
#define PEER_MSG(var, field, value, Case)                           \
        Moeep__V1__PeerMessage var = MOEEP__V1__PEER_MESSAGE__INIT; \
        var.body_case = MOEEP__V1__PEER_MESSAGE__BODY_##Case;       \
        var.field = (value)

/* Queues one message to `p`: in clear for PeerHello, PeerChallenge,
 * PeerProof and PeerRefused (only before the handshake is done), sealed
 * for everything else (only after). Returns 0 or -errno (-ENOTCONN when
 * the connection cannot carry it, as to a peer that is down). A message
 * that would queue more than MESH_OUT_MAX bytes to `p` is never dropped
 * alone, which would leave both sides believing different things (a
 * barrier waiting forever): -ENOBUFS, and the connection is failed from
 * the loop (mesh_peer_fail(), logged with the bytes queued), so that the
 * layers above handle it as any peer lost; every later message to it gets
 * -ENOBUFS too. The caller is not called back from inside. */
int mesh_peer_send(struct mesh_peer *p, Moeep__V1__PeerMessage *msg);

/* The one way a connection ends: logs `fmt` once, closes (flushing a
 * queued PeerRefused when `flush`), tells the subscribers, then redials
 * (outbound) or frees the peer from the loop (inbound). */
void mesh_peer_fail(struct mesh_peer *p, bool flush, const char *fmt, ...)
        __attribute__((format(printf, 3, 4)));

/* Tells every subscriber that rank `rank` of `job`, at another daemon,
 * is gone from where it was reached (its receive or counter region
 * released, or the rank left): mesh-jobs.c, as it learns it. */
void mesh_rank_gone(struct mesh *mesh, const struct job *job, uint32_t rank);

/* Peers in each state, for the metrics. */
void mesh_count(const struct mesh *mesh, uint32_t ret_counts[MESH_PEER_DOWN + 1]);

/* Jobs with ranks at both this daemon and `p` (the subscribers' count). */
uint32_t mesh_peer_jobs(const struct mesh *mesh, const struct mesh_peer *p);

#endif
