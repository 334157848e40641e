/* The internode mesh's peers; see mesh.h. In order: connections, their
 * failure, liveness, dial, accept and reap, and the routing of each
 * message to its owner; the frames and their sealing; identities,
 * admission and the handshake. */
#include <arpa/inet.h>
#include <errno.h>
#include <event2/buffer.h>
#include <event2/bufferevent.h>
#include <event2/event.h>
#include <event2/listener.h>
#include <inttypes.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sodium.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "config.h"
#include "fdorder.h"
#include "log.h"
#include "mesh/auth.h"
#include "mesh/mesh.h"
#include "record.h"
#include "state/job.h"

/* What the parts of this file call of each other, declared ahead. */

static uint64_t mesh_now_ns(void) {
        struct timespec ts;

        clock_gettime(CLOCK_MONOTONIC, &ts);
        return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* ------------------------------------------------ connections */

/* Handles one message of `p`; `sealed` says whether it came in a sealed
 * frame. In clear: only the handshake messages, each in its turn. Sealed:
 * the dialler's PeerWelcome, then anything but a handshake message (job
 * messages go to their owner's subscriber). */
static void mesh_peer_handle(struct mesh_peer *p, const Moeep__V1__PeerMessage *msg, bool sealed);

/* Refuses `p` during the handshake: PeerRefused{why}, then mesh_peer_fail(). */
static void mesh_peer_refuse(struct mesh_peer *p, const char *why);

/* Both sides proved the key: `p` is usable (or dropped as a duplicate of
 * a connection to the same daemon). */
static void mesh_peer_up(struct mesh_peer *p);

/* ------------------------------------------------ addresses */

/* "IPV4:PORT" or "[IPV6]:PORT" of `sa`, "?" for another family. */
static void mesh_sockaddr_string(const struct sockaddr *sa, char *buf, size_t size);

/* Parses a mesh address (config_listen_split()'s forms) into a sockaddr.
 * Returns 0 or -EINVAL. */
static int mesh_address_resolve(const char *address, struct sockaddr_storage *ret_ss, socklen_t *ret_len);

/* Our advertised address and identity (mesh->address), from the
 * listener's socket. */
static void mesh_address_set(struct mesh *mesh);

/* ------------------------------------------------ frames */

/* When a message travels and who may send it: proto/mesh.def's PHASE and
 * FROM columns. */
enum mesh_phase {
        MESH_PHASE_CLEAR,   /* in clear, while the handshake runs */
        MESH_PHASE_WELCOME, /* sealed, the frame that ends the handshake */
        MESH_PHASE_SEALED,  /* sealed, once the handshake is done */
};
enum mesh_from {
        MESH_FROM_DIALLER,
        MESH_FROM_ACCEPTOR,
        MESH_FROM_EITHER,
};

/* One row of proto/mesh.def. */
struct mesh_message {
        enum mesh_phase phase;
        enum mesh_from from;
        enum mesh_owner owner;
};

/* The row of body case `c`; NULL for `sealed` (a frame, not a message) and
 * for a message this daemon does not know. */
static const struct mesh_message *mesh_message(Moeep__V1__PeerMessage__BodyCase c);

/* The bufferevent read callback of every connection (arg: its peer): cuts
 * frames, opens sealed ones, hands each message to mesh_peer_handle(). */
static void mesh_peer_read_cb(struct bufferevent *bev, void *arg);

/* ------------------------------------------------ handshake */

/* Dialler: the connection is made; sends PeerHello. */
static void mesh_hello_send(struct mesh_peer *p);

/* The handshake messages, each in its turn (mesh_peer_handle() checked
 * the phase, the sender and the order). */
static void mesh_hello_handle(struct mesh_peer *p, const Moeep__V1__PeerHello *h);
static void mesh_challenge_handle(struct mesh_peer *p, const Moeep__V1__PeerChallenge *c);
static void mesh_proof_handle(struct mesh_peer *p, const Moeep__V1__PeerProof *pr);
static void mesh_welcome_handle(struct mesh_peer *p, const Moeep__V1__PeerWelcome *w);

/* ------------------------------------------------ admission */

/* Whether one more pre-authentication refusal may be logged now. */
static bool mesh_preauth_log_ok(struct mesh *mesh);

/* The pre-authentication quota's key of source address `sa`. */
static void mesh_source_key(const struct sockaddr *sa, uint8_t ret[static 16]);

/* Makes room for one more inbound connection authenticating from `source`
 * (displacing the oldest of its source, or of the biggest source). */
static void mesh_preauth_make_room(struct mesh *mesh, const uint8_t source[static 16]);

const char *mesh_peer_state_to_string(enum mesh_peer_state s) {
        switch (s) {
        case MESH_PEER_CONNECTING:
                return "connecting";
        case MESH_PEER_AUTHENTICATING:
                return "authenticating";
        case MESH_PEER_UP:
                return "up";
        case MESH_PEER_DOWN:
                return "down";
        }
        return "unknown";
}

static void timer_arm(struct mesh_peer *p, unsigned ms) {
        struct timeval tv = { .tv_sec = ms / 1000, .tv_usec = (suseconds_t)(ms % 1000) * 1000 };

        evtimer_add(p->ev_timer, &tv);
}

/* ------------------------------------------------------------ failure */

static void peer_dial(struct mesh_peer *p);
static struct mesh_peer *peer_find(const struct mesh *mesh, const char *address, bool up_only);

/* A connection we are done with but whose last frame (PeerRefused) should
 * still go out: freed once written, or after a second. */
static void linger_write_cb(struct bufferevent *bev, void *arg) {
        bufferevent_free(bev);
}

static void linger_event_cb(struct bufferevent *bev, short what, void *arg) {
        bufferevent_free(bev);
}

static void bev_release(struct bufferevent *bev, bool flush) {
        struct timeval tv = { .tv_sec = 1 };

        if (!flush || evbuffer_get_length(bufferevent_get_output(bev)) == 0) {
                bufferevent_free(bev);
                return;
        }
        bufferevent_disable(bev, EV_READ);
        bufferevent_setcb(bev, NULL, linger_write_cb, linger_event_cb, NULL);
        bufferevent_set_timeouts(bev, NULL, &tv);
}

/* Forgets everything the last handshake established: keys, the claimed
 * identity, where it stood. */
static void peer_handshake_reset(struct mesh_peer *p) {
        auth_session_wipe(&p->auth);
        p->have_keys = p->sealed = false;
        p->got_hello = p->sent_proof = false;
        p->claimed[0] = '\0';
}

/* Lets go of `p`'s connection (flushing what is queued, a PeerRefused or
 * a PeerWelcome, when `flush`): its socket, its timer, its handshake and
 * its stuck output. */
static void peer_close(struct mesh_peer *p, bool flush) {
        if (p->bev) {
                bev_release(p->bev, flush);
                p->bev = NULL;
        }
        p->stuck_bytes = 0;
        evtimer_del(p->ev_timer);
        peer_handshake_reset(p);
}

/* After peer_close(): an outbound peer waits to redial, an inbound one is
 * freed from the loop. */
static void peer_closed(struct mesh_peer *p) {
        if (p->outbound) {
                timer_arm(p, MESH_REDIAL_MS);
        } else {
                p->dead = true;
                event_active(p->mesh->ev_reap, EV_TIMEOUT, 0);
        }
}

/* The subscribers of the mesh are told that `p` went down: the transport
 * first (see struct mesh_subscriber), then the others in owner order. */
static void subscribers_peer_down(struct mesh *mesh, struct mesh_peer *p, bool was_up, bool tp_was_connected,
                                  const char *lost, const char *why) {
        const struct mesh_subscriber *tp = &mesh->subscribers[MESH_OWNER_TRANSPORT];

        if (tp->peer_down)
                tp->peer_down(tp->arg, p, was_up, tp_was_connected, lost, why);
        for (int o = MESH_OWNER_PEERS + 1; o < MESH_OWNERS; o++) {
                const struct mesh_subscriber *s = &mesh->subscribers[o];

                if (o != MESH_OWNER_TRANSPORT && s->peer_down)
                        s->peer_down(s->arg, p, was_up, tp_was_connected, lost, why);
        }
}

/* The one way a peer connection ends: logs `fmt` once, drops the
 * connection (flushing a queued PeerRefused when `flush`), tells the
 * subscribers, and then redials (outbound) or frees the peer from the
 * loop (inbound). */
void mesh_peer_fail(struct mesh_peer *p, bool flush, const char *fmt, ...) {
        struct mesh *mesh = p->mesh;
        enum mesh_peer_state was = p->state;
        char why[ERRMSG_MAX], lost[ERRMSG_MAX + JOB_NODE_MAX + 16] = "";
        bool tp_was_connected = false;
        va_list ap;

        if (p->state == MESH_PEER_DOWN)
                return;
        va_start(ap, fmt);
        vsnprintf(why, sizeof(why), fmt, ap);
        va_end(ap);
        if (was == MESH_PEER_UP)
                log_warn("mesh: peer %s (%s) down: %s", p->address, p->remote, why);
        else if (was == MESH_PEER_CONNECTING && p->unreachable_logged)
                /* Redialled every second: said once at warning level. */
                log_debug("mesh: peer %s still not reached: %s", p->address, why);
        else if (!p->outbound && mesh_preauth_log_ok(mesh))
                log_warn("mesh: connection from %s%s%s%s refused: %s", p->remote,
                         p->claimed[0] ? " (says it is " : "", p->claimed,
                         p->claimed[0] ? ", not proved)" : "", why);
        else if (p->outbound)
                log_warn("mesh: peer %s (%s) %s: %s", p->address, p->remote[0] ? p->remote : "not connected",
                         was == MESH_PEER_AUTHENTICATING ? "refused" : "not reached", why);
        p->unreachable_logged = was == MESH_PEER_CONNECTING;
        if (was == MESH_PEER_AUTHENTICATING)
                mesh->refused++;
        p->state = MESH_PEER_DOWN;
        if (!p->outbound && was != MESH_PEER_UP)
                mesh->unauthenticated--;
        peer_close(p, flush);
        if (was == MESH_PEER_UP) {
                snprintf(lost, sizeof(lost), "daemon %s lost: %s", p->address, why);
                tp_was_connected = p->tp_connected;
        }
        /* The layers above let go of what depended on it. */
        subscribers_peer_down(mesh, p, was == MESH_PEER_UP, tp_was_connected, lost, why);
        peer_closed(p);
}

/* Closes a connection that duplicates another one to the same daemon and
 * that nothing uses: no log line, no job touched. An outbound peer waits to
 * redial (which it skips while the other connection is up). */
static void peer_drop(struct mesh_peer *p) {
        struct mesh *mesh = p->mesh;
        const struct mesh_subscriber *tp = &mesh->subscribers[MESH_OWNER_TRANSPORT];
        bool was_up = p->state == MESH_PEER_UP;

        if (!p->outbound && !was_up)
                mesh->unauthenticated--;
        p->state = MESH_PEER_DOWN;
        /* Flushed: a PeerWelcome queued on it lets the dialler reach the
         * same decision instead of seeing a refusal. */
        peer_close(p, true);
        /* No job spans the daemon (mesh_peer_up() checked): nothing routes
         * to its transport peer, which the transport alone is told of, so
         * that it lets it go (a daemon that keeps connecting twice must not
         * leave a transport peer behind each time). */
        if (tp->peer_down && p->tp_peer != MESH_NO_TP_PEER)
                tp->peer_down(tp->arg, p, was_up, p->tp_connected, "",
                              "a second connection to the same daemon was kept");
        p->tp_peer = MESH_NO_TP_PEER;
        p->tp_connected = false;
        peer_closed(p);
}

/* Refuses a peer during the handshake: tells it why, logs, closes. */
static void mesh_peer_refuse(struct mesh_peer *p, const char *why) {
        Moeep__V1__PeerRefused refused = MOEEP__V1__PEER_REFUSED__INIT;
        PEER_MSG(msg, refused, &refused, REFUSED);

        refused.reason = (char *)why;
        mesh_peer_send(p, &msg);
        mesh_peer_fail(p, true, "%s", why);
}

/* ------------------------------------------------------------ peers */

static void peer_timer_cb(evutil_socket_t fd, short what, void *arg);
static void peer_event_cb(struct bufferevent *bev, short what, void *arg);

static struct mesh_peer *peer_new(struct mesh *mesh, bool outbound, const char *address) {
        struct mesh_peer *p = calloc(1, sizeof(*p));

        if (!p)
                return NULL;
        p->mesh = mesh;
        p->outbound = outbound;
        p->state = MESH_PEER_DOWN;
        p->tp_peer = MESH_NO_TP_PEER;
        snprintf(p->address, sizeof(p->address), "%s", address);
        p->ev_timer = evtimer_new(mesh->base, peer_timer_cb, p);
        if (!p->ev_timer) {
                free(p);
                return NULL;
        }
        TAILQ_INSERT_TAIL(&mesh->peers, p, entry);
        return p;
}

static void peer_free(struct mesh_peer *p) {
        auth_session_wipe(&p->auth);
        TAILQ_REMOVE(&p->mesh->peers, p, entry);
        if (p->bev)
                bufferevent_free(p->bev);
        event_free(p->ev_timer);
        free(p);
}

static void peer_bev_setup(struct mesh_peer *p) {
        int one = 1;

        bufferevent_setcb(p->bev, mesh_peer_read_cb, NULL, peer_event_cb, p);
        bufferevent_enable(p->bev, EV_READ | EV_WRITE);
        if (bufferevent_getfd(p->bev) >= 0)
                setsockopt(bufferevent_getfd(p->bev), IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

static void peer_dial(struct mesh_peer *p) {
        struct sockaddr_storage ss;
        socklen_t len;
        int fd;

        p->remote[0] = '\0';
        if (mesh_address_resolve(p->address, &ss, &len) < 0) {
                p->state = MESH_PEER_CONNECTING; /* so that mesh_peer_fail() logs and re-arms */
                mesh_peer_fail(p, false, "'%s' is not an address", p->address);
                return;
        }
        /* Our own socket, moved to the top of the descriptor table
         * (fdorder.h) before libevent connects it. */
        fd = socket(ss.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
        p->state = MESH_PEER_CONNECTING;
        if (fd < 0) {
                mesh_peer_fail(p, false, "socket: %s", strerror(errno));
                return;
        }
        fd = fd_to_top(fd);
        p->bev = bufferevent_socket_new(p->mesh->base, fd, BEV_OPT_CLOSE_ON_FREE);
        if (!p->bev) {
                close(fd);
                mesh_peer_fail(p, false, "out of memory");
                return;
        }
        peer_bev_setup(p);
        timer_arm(p, MESH_HANDSHAKE_MS);
        if (bufferevent_socket_connect(p->bev, (struct sockaddr *)&ss, (int)len) < 0)
                mesh_peer_fail(p, false, "connect: %s", strerror(errno ? errno : ECONNREFUSED));
}

static struct mesh_peer *peer_find(const struct mesh *mesh, const char *address, bool up_only) {
        struct mesh_peer *p, *found = NULL;

        TAILQ_FOREACH (p, &mesh->peers, entry) {
                /* An inbound connection that is not up has proved nothing:
                 * its name is only the socket's address. */
                if (p->dead || (!p->outbound && p->state != MESH_PEER_UP) || strcmp(p->address, address) != 0)
                        continue;
                if (p->state == MESH_PEER_UP)
                        return p;
                if (!up_only && (!found || p->outbound))
                        found = p;
        }
        return found;
}

/* Both sides proved the key: the peer is usable. */
static void mesh_peer_up(struct mesh_peer *p) {
        struct mesh *mesh = p->mesh;
        struct mesh_peer *q = peer_find(mesh, p->address, true);

        /* Two daemons that dialled each other at once: both keep the
         * connection that the daemon with the smaller address dialled, so
         * that they agree without a word. One that already carries jobs is
         * kept whatever its direction (a rare race; the other side then
         * drops both and redials). */
        if (q) {
                const char *dialler_q = q->outbound ? mesh->address : q->address;
                const char *dialler_p = p->outbound ? mesh->address : p->address;
                bool keep_p = strcmp(dialler_p, dialler_q) < 0 && !mesh_peer_jobs(mesh, q);

                if (keep_p) {
                        log_info("mesh: peer %s: a second connection (%s); keeping the one %s dialled",
                                 p->address, p->remote, dialler_p);
                        peer_drop(q);
                } else {
                        log_info("mesh: peer %s: a second connection (%s); keeping the one %s dialled",
                                 p->address, q->remote, dialler_q);
                        peer_drop(p);
                        return;
                }
        }
        if (!p->outbound)
                mesh->unauthenticated--;
        p->state = MESH_PEER_UP;
        p->last_pong_ns = mesh_now_ns();
        p->rtt_us = 0;
        log_notice("mesh: peer %s up (%s, %s)", p->address, p->remote, p->outbound ? "dialled" : "accepted");
        timer_arm(p, MESH_PING_MS);
        /* Forwarded joins that wait for it, then its transport peer; one
         * may fail it (the transport, when it has no transport peer left
         * for it), and those after it are not told it came up. */
        for (int o = MESH_OWNER_PEERS + 1; o < MESH_OWNERS && p->state == MESH_PEER_UP; o++)
                if (mesh->subscribers[o].peer_up)
                        mesh->subscribers[o].peer_up(mesh->subscribers[o].arg, p);
}

static void peer_event_cb(struct bufferevent *bev, short what, void *arg) {
        struct mesh_peer *p = arg;

        if (what & BEV_EVENT_CONNECTED) {
                struct sockaddr_storage ss;
                socklen_t len = sizeof(ss);
                int one = 1;

                setsockopt(bufferevent_getfd(bev), IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
                if (getpeername(bufferevent_getfd(bev), (struct sockaddr *)&ss, &len) == 0)
                        mesh_sockaddr_string((struct sockaddr *)&ss, p->remote, sizeof(p->remote));
                p->state = MESH_PEER_AUTHENTICATING;
                mesh_hello_send(p);
                return;
        }
        if (what & BEV_EVENT_EOF)
                mesh_peer_fail(p, false, "it closed the connection");
        else if (what & BEV_EVENT_ERROR)
                mesh_peer_fail(p, false, "%s", evutil_socket_error_to_string(EVUTIL_SOCKET_ERROR()));
}

static void peer_timer_cb(evutil_socket_t fd, short what, void *arg) {
        struct mesh_peer *p = arg;
        uint64_t now = mesh_now_ns();

        if (p->stuck_bytes && p->state != MESH_PEER_DOWN) { /* peer_stuck() armed it */
                mesh_peer_fail(p, false,
                               "it stopped reading: %zu bytes queued, no room for more (at most %u)",
                               p->stuck_bytes, MESH_OUT_MAX);
                return;
        }
        switch (p->state) {
        case MESH_PEER_CONNECTING:
        case MESH_PEER_AUTHENTICATING:
                mesh_peer_fail(p, false, "handshake not done within %d ms", MESH_HANDSHAKE_MS);
                return;
        case MESH_PEER_UP: {
                Moeep__V1__PeerPing ping = MOEEP__V1__PEER_PING__INIT;
                PEER_MSG(msg, ping, &ping, PING);

                if (now - p->last_pong_ns > (uint64_t)MESH_DEAD_MS * 1000000u) {
                        mesh_peer_fail(p, false, "no PeerPong for %d ms", MESH_DEAD_MS);
                        return;
                }
                ping.seq = ++p->ping_seq;
                ping.sent_ns = now;
                mesh_peer_send(p, &msg);
                if (!p->stuck_bytes) /* else peer_stuck() armed it to fail the peer now */
                        timer_arm(p, MESH_PING_MS);
                return;
        }
        case MESH_PEER_DOWN:
                /* A daemon that dialled us while we were waiting to redial
                 * it needs no second connection. */
                if (p->outbound && peer_find(p->mesh, p->address, true))
                        timer_arm(p, MESH_REDIAL_MS);
                else if (p->outbound)
                        peer_dial(p);
                return;
        }
}

/* ------------------------------------------------------------ messages */

/* Hands `msg` of `p` to the subscriber of `owner`, when there is one. */
static void subscriber_message(struct mesh *mesh, enum mesh_owner owner, struct mesh_peer *p,
                               const Moeep__V1__PeerMessage *msg) {
        const struct mesh_subscriber *s = &mesh->subscribers[owner];

        if (s->message)
                s->message(s->arg, p, msg);
}

/* The refusal of `p`'s daemon: its reason, in printable ASCII, is logged. */
static void mesh_refused_handle(struct mesh_peer *p, const Moeep__V1__PeerRefused *r) {
        char reason[128];
        size_t n;

        snprintf(reason, sizeof(reason), "%s", r->reason ? r->reason : "");
        for (n = 0; reason[n]; n++)
                if (reason[n] < 0x20 || reason[n] > 0x7e)
                        reason[n] = '?';
        mesh_peer_fail(p, false, "it refused us: %s", reason);
}

/* Liveness: a ping is answered; a pong of our last ping times the round
 * trip. */
static void mesh_ping_handle(struct mesh_peer *p, const Moeep__V1__PeerPing *ping) {
        Moeep__V1__PeerPong pong = MOEEP__V1__PEER_PONG__INIT;
        PEER_MSG(out, pong, &pong, PONG);

        pong.seq = ping->seq;
        pong.sent_ns = ping->sent_ns;
        mesh_peer_send(p, &out);
}

static void mesh_pong_handle(struct mesh_peer *p, const Moeep__V1__PeerPong *pong) {
        uint64_t now = mesh_now_ns();

        if (pong->seq == p->ping_seq && pong->sent_ns <= now)
                p->rtt_us = (now - pong->sent_ns) / 1000u;
        p->last_pong_ns = now;
}

/* Whether a message `m` may come from `p`'s side: the FROM column, seen
 * from the receiver (a dialler receives from the acceptor). */
static bool mesh_from_ok(const struct mesh_peer *p, const struct mesh_message *m) {
        switch (m->from) {
        case MESH_FROM_DIALLER:
                return !p->outbound;
        case MESH_FROM_ACCEPTOR:
                return p->outbound;
        case MESH_FROM_EITHER:
                return true;
        }
        return false;
}

/* The handshake's order, which the table does not say: one PeerHello,
 * PeerChallenge before the dialler's proof, PeerProof after PeerHello. */
static bool mesh_in_turn(const struct mesh_peer *p, Moeep__V1__PeerMessage__BodyCase c) {
        if (c == MOEEP__V1__PEER_MESSAGE__BODY_HELLO)
                return !p->got_hello;
        if (c == MOEEP__V1__PEER_MESSAGE__BODY_CHALLENGE)
                return !p->sent_proof;
        if (c == MOEEP__V1__PEER_MESSAGE__BODY_PROOF)
                return p->got_hello;
        return true;
}

/* Handles one message; `sealed` says whether it came in a sealed frame.
 * Its row of proto/mesh.def says when it is accepted: in clear only the
 * handshake messages from the right side, each in its turn; sealed before
 * the handshake is done only the dialler's PeerWelcome (peer_handle_sealed()
 * opens no other); after it, the SEALED rows. Then the OWNER column
 * dispatches it: mesh_<field>_handle() for the peers' own, the owner's
 * subscriber for the others. */
static void mesh_peer_handle(struct mesh_peer *p, const Moeep__V1__PeerMessage *msg, bool sealed) {
        struct mesh *mesh = p->mesh;
        Moeep__V1__PeerMessage__BodyCase c = msg->body_case;
        const struct mesh_message *m = mesh_message(c);
        bool ok;

        if (!sealed)
                ok = m && m->phase == MESH_PHASE_CLEAR && mesh_from_ok(p, m) && mesh_in_turn(p, c);
        else if (!p->sealed)
                ok = m && m->phase == MESH_PHASE_WELCOME && mesh_from_ok(p, m);
        else /* an unknown message gets its own words below */
                ok = c != MOEEP__V1__PEER_MESSAGE__BODY_SEALED && (!m || m->phase == MESH_PHASE_SEALED);
        if (!ok) {
                mesh_peer_fail(p, false, "message %d %s", (int)c,
                               p->sealed ? "not allowed after the handshake"
                                         : "out of order during the handshake");
                return;
        }
/* Each row's case: the peers' own handler, or the owner's subscriber. */
#define MESH_OWNED_BY_PEERS(field) mesh_##field##_handle(p, msg->field)
#define MESH_OWNED_BY_JOBS(field) subscriber_message(mesh, MESH_OWNER_JOBS, p, msg)
#define MESH_OWNED_BY_JOINS(field) subscriber_message(mesh, MESH_OWNER_JOINS, p, msg)
#define MESH_OWNED_BY_TRANSPORT(field) subscriber_message(mesh, MESH_OWNER_TRANSPORT, p, msg)
#define MOEEP_PEER(CASE, field, Name, PHASE, FROM, OWNER) \
        case MOEEP__V1__PEER_MESSAGE__BODY_##CASE:        \
                MESH_OWNED_BY_##OWNER(field);             \
                return;
        switch (c) {
#include "mesh.def"
        case MOEEP__V1__PEER_MESSAGE__BODY_SEALED: /* refused above */
        case MOEEP__V1__PEER_MESSAGE__BODY__NOT_SET:
        case _MOEEP__V1__PEER_MESSAGE__BODY__CASE_IS_INT_SIZE:
                break;
        }
#undef MOEEP_PEER
#undef MESH_OWNED_BY_TRANSPORT
#undef MESH_OWNED_BY_JOINS
#undef MESH_OWNED_BY_JOBS
#undef MESH_OWNED_BY_PEERS
        mesh_peer_fail(p, false, "message of unknown type %d", (int)c);
}

/* ------------------------------------------------------------ listener */

static void mesh_accept_cb(struct evconnlistener *l, evutil_socket_t fd, struct sockaddr *sa, int socklen,
                           void *arg) {
        struct mesh *mesh = arg;
        struct mesh_peer *p;
        char remote[JOB_NODE_MAX + 1];
        uint8_t source[16];

        if (++mesh->accepted_this_turn >= MESH_ACCEPTS_PER_TURN) {
                /* libevent's accept loop stops once its listener is
                 * disabled; the rest waits for the next turn. */
                evconnlistener_disable(l);
                event_active(mesh->ev_accept_resume, EV_TIMEOUT, 0);
        }
        mesh_sockaddr_string(sa, remote, sizeof(remote));
        mesh_source_key(sa, source);
        mesh_preauth_make_room(mesh, source);
        if (mesh->unauthenticated >= MESH_MAX_UNAUTH) { /* not reached: room was made */
                mesh->refused++;
                close(fd);
                return;
        }
        p = peer_new(mesh, false, remote);
        fd = fd_to_top(fd); /* fdorder.h */
        if (p)
                p->bev = bufferevent_socket_new(mesh->base, fd, BEV_OPT_CLOSE_ON_FREE);
        if (!p || !p->bev) {
                log_warn("mesh: connection from %s: out of memory", remote);
                if (p)
                        peer_free(p);
                close(fd);
                return;
        }
        snprintf(p->remote, sizeof(p->remote), "%s", remote);
        memcpy(p->source, source, sizeof(source));
        p->accepted_ns = mesh_now_ns();
        p->state = MESH_PEER_AUTHENTICATING;
        mesh->unauthenticated++;
        peer_bev_setup(p);
        timer_arm(p, MESH_HANDSHAKE_MS);
        log_debug("mesh: connection from %s", remote);
}

static void mesh_accept_resume_cb(evutil_socket_t fd, short what, void *arg) {
        struct mesh *mesh = arg;

        mesh->accepted_this_turn = 0;
        evconnlistener_enable(mesh->listener);
}

static void mesh_reap_cb(evutil_socket_t fd, short what, void *arg) {
        struct mesh *mesh = arg;
        struct mesh_peer *p, *next;

        for (p = TAILQ_FIRST(&mesh->peers); p; p = next) {
                next = TAILQ_NEXT(p, entry);
                if (p->dead)
                        peer_free(p);
        }
}

int mesh_start(struct event_base *base, const struct config *c, struct mesh **ret_mesh, char *errmsg) {
        struct sockaddr_storage ss;
        struct mesh *mesh;
        socklen_t len;
        uint32_t npeers = 0;
        const char *q;
        int r;

        *ret_mesh = NULL;
        if (!c->mesh_listen[0]) {
                if (c->mesh_peers[0])
                        log_warn("mesh: mesh_peers is set but mesh_listen is not: the mesh is off");
                return 0;
        }
        if (auth_init() < 0)
                return errmsg_set(errmsg, -EIO, "mesh: libsodium does not initialise");
        if (mesh_address_resolve(c->mesh_listen, &ss, &len) < 0)
                return errmsg_set(errmsg, -EINVAL, "mesh_listen '%s': not an address", c->mesh_listen);
        mesh = calloc(1, sizeof(*mesh));
        if (!mesh)
                return errmsg_set(errmsg, -ENOMEM, "mesh: out of memory");
        mesh->base = base;
        TAILQ_INIT(&mesh->peers);
        if (c->cluster_key_file[0]) {
                r = auth_key_load(c->cluster_key_file, mesh->key, errmsg);
                if (r < 0)
                        goto fail;
                mesh->keyed = true;
        } else {
                log_warn("mesh: no cluster_key_file: every peer daemon will be refused");
        }
        mesh->ev_reap = event_new(base, -1, 0, mesh_reap_cb, mesh);
        mesh->ev_accept_resume = event_new(base, -1, 0, mesh_accept_resume_cb, mesh);
        if (!mesh->ev_reap || !mesh->ev_accept_resume) {
                r = errmsg_set(errmsg, -ENOMEM, "mesh: out of memory");
                goto fail;
        }
        mesh->listener = evconnlistener_new_bind(
                base, mesh_accept_cb, mesh, LEV_OPT_CLOSE_ON_FREE | LEV_OPT_CLOSE_ON_EXEC | LEV_OPT_REUSEABLE,
                MESH_LISTEN_BACKLOG, (struct sockaddr *)&ss, (int)len);
        if (!mesh->listener) {
                int e = errno ? errno : EADDRNOTAVAIL;

                r = errmsg_set(errmsg, -e, "mesh_listen '%s': cannot listen: %s", c->mesh_listen,
                               strerror(e));
                goto fail;
        }
        mesh_address_set(mesh);
        log_info("mesh: listening on %s%s", mesh->address, mesh->keyed ? "" : " (no cluster key)");
        for (q = c->mesh_peers; *q;) {
                char one[CONFIG_HOST_MAX + 16], canon[JOB_NODE_MAX + 1];
                size_t n = strcspn(q, ",");
                struct mesh_peer *p;

                snprintf(one, sizeof(one), "%.*s", (int)n, q);
                q += n + (q[n] == ',');
                if (mesh_address_canon(one, canon) < 0) {
                        r = errmsg_set(errmsg, -EINVAL, "mesh_peers: '%s' is not a mesh address", one);
                        goto fail;
                }
                /* Ourselves in any spelling, or a peer named twice. */
                if (strcmp(canon, mesh->address) == 0 || mesh_configured_find(mesh, canon))
                        continue;
                if (++npeers > MESH_PEERS_MAX) {
                        r = errmsg_set(errmsg, -E2BIG, "mesh_peers: more than %d daemons", MESH_PEERS_MAX);
                        goto fail;
                }
                p = peer_new(mesh, true, canon);
                if (!p) {
                        r = errmsg_set(errmsg, -ENOMEM, "mesh: out of memory");
                        goto fail;
                }
                peer_dial(p);
        }
        *ret_mesh = mesh;
        return 0;

fail:
        mesh_free(mesh);
        return r;
}

void mesh_close_all(struct mesh *mesh) {
        struct mesh_peer *p;

        TAILQ_FOREACH (p, &mesh->peers, entry) {
                p->state = MESH_PEER_DOWN;
                peer_close(p, false);
        }
}

void mesh_free(struct mesh *mesh) {
        struct mesh_peer *p;

        if (!mesh)
                return;
        mesh_close_all(mesh);
        while ((p = TAILQ_FIRST(&mesh->peers)))
                peer_free(p);
        if (mesh->listener)
                evconnlistener_free(mesh->listener);
        if (mesh->ev_reap)
                event_free(mesh->ev_reap);
        if (mesh->ev_accept_resume)
                event_free(mesh->ev_accept_resume);
        explicit_bzero(mesh->key, sizeof(mesh->key));
        free(mesh);
}

const char *mesh_address(const struct mesh *mesh) {
        return mesh ? mesh->address : NULL;
}

void mesh_count(const struct mesh *mesh, uint32_t ret_counts[MESH_PEER_DOWN + 1]) {
        const struct mesh_peer *p;

        memset(ret_counts, 0, sizeof(uint32_t) * (MESH_PEER_DOWN + 1));
        if (!mesh)
                return;
        TAILQ_FOREACH (p, &mesh->peers, entry)
                if (!p->dead)
                        ret_counts[p->state]++;
}

void mesh_subscribe(struct mesh *mesh, enum mesh_owner owner, const struct mesh_subscriber *s) {
        if (s)
                mesh->subscribers[owner] = *s;
        else
                memset(&mesh->subscribers[owner], 0, sizeof(mesh->subscribers[owner]));
}

void mesh_rank_gone(struct mesh *mesh, const struct job *job, uint32_t rank) {
        for (int o = MESH_OWNER_PEERS + 1; o < MESH_OWNERS; o++)
                if (mesh->subscribers[o].rank_gone)
                        mesh->subscribers[o].rank_gone(mesh->subscribers[o].arg, job, rank);
}

struct mesh_peer *mesh_peer_find(const struct mesh *mesh, const char *address) {
        return peer_find(mesh, address, true);
}

uint32_t mesh_peer_jobs(const struct mesh *mesh, const struct mesh_peer *p) {
        uint32_t n = 0;

        for (int o = MESH_OWNER_PEERS + 1; o < MESH_OWNERS; o++)
                if (mesh->subscribers[o].peer_jobs)
                        n += mesh->subscribers[o].peer_jobs(mesh->subscribers[o].arg, p);
        return n;
}

/* ============================================================ frames */

/* The mesh's frames: a 4-byte big-endian length and a PeerMessage, in
 * clear for the handshake and sealed (auth.h) after it, written by
 * mesh_peer_send() and read by mesh_peer_read_cb(), which hands each
 * message to mesh_peer_handle(). */

/* ------------------------------------------------------------ sending */

static const struct mesh_message *mesh_message(Moeep__V1__PeerMessage__BodyCase c) {
#define MOEEP_PEER(CASE, field, Name, PHASE, FROM, OWNER)                                      \
        case MOEEP__V1__PEER_MESSAGE__BODY_##CASE: {                                           \
                static const struct mesh_message row = { MESH_PHASE_##PHASE, MESH_FROM_##FROM, \
                                                         MESH_OWNER_##OWNER };                 \
                return &row;                                                                   \
        }
        switch (c) {
#include "mesh.def"
        case MOEEP__V1__PEER_MESSAGE__BODY_SEALED:
        case MOEEP__V1__PEER_MESSAGE__BODY__NOT_SET:
        case _MOEEP__V1__PEER_MESSAGE__BODY__CASE_IS_INT_SIZE:
                break;
        }
#undef MOEEP_PEER
        return NULL;
}

/* Appends one frame (length and `len` bytes of `body`) to `out`. */
static int frame_add(struct evbuffer *out, const uint8_t *body, size_t len) {
        uint8_t hdr[4] = { (uint8_t)(len >> 24), (uint8_t)(len >> 16), (uint8_t)(len >> 8), (uint8_t)len };

        if (evbuffer_add(out, hdr, 4) < 0 || evbuffer_add(out, body, len) < 0)
                return -ENOMEM;
        return 0;
}

/* `p` stopped reading: `queued` bytes wait and one more message does not
 * fit. Dropping it would leave the two daemons disagreeing for good (a
 * barrier done that never arrives), so the connection goes, as for any
 * other failure; but from the loop, not here: the callers send from
 * inside loops over jobs and members that mesh_peer_fail()'s subscribers
 * change. Until then nothing more is queued to it or read from it. */
static void peer_stuck(struct mesh_peer *p, size_t queued) {
        p->stuck_bytes = queued;
        bufferevent_disable(p->bev, EV_READ);
        evtimer_del(p->ev_timer);
        timer_arm(p, 0);
}

/* Queues one frame: in clear for the handshake messages (PHASE CLEAR in
 * proto/mesh.def), sealed (auth.h) for everything else, which only a connection whose handshake is done
 * may carry. To a peer that is down, nothing (the job code sends to peers
 * that may have gone, and learns of it through mesh_peer_fail()). */
int mesh_peer_send(struct mesh_peer *p, Moeep__V1__PeerMessage *msg) {
        Moeep__V1__PeerMessage outer = MOEEP__V1__PEER_MESSAGE__INIT;
        const struct mesh_message *m;
        struct evbuffer *out;
        uint8_t *plain = NULL, *sealed = NULL, *wire = NULL;
        size_t len, wire_len;
        int r;

        if (!p->bev)
                return -ENOTCONN;
        if (p->stuck_bytes)
                return -ENOBUFS; /* failed from the loop (peer_stuck()) */
        m = mesh_message(msg->body_case);
        if (m && m->phase == MESH_PHASE_CLEAR ? p->sealed : !p->sealed)
                return -ENOTCONN;
        out = bufferevent_get_output(p->bev);
        len = protobuf_c_message_get_packed_size(&msg->base);
        if (len > MESH_FRAME_MAX)
                return -EMSGSIZE;
        /* The frame takes at most its length, the message, and sealed its
         * tag and the outer PeerMessage's field header on the wire. */
        if (evbuffer_get_length(out) + 4 + len + (p->sealed ? AUTH_SEAL_BYTES + 16 : 0) > MESH_OUT_MAX) {
                peer_stuck(p, evbuffer_get_length(out));
                return -ENOBUFS;
        }
        plain = malloc(len ? len : 1);
        if (!plain)
                return -ENOMEM;
        protobuf_c_message_pack(&msg->base, plain);
        if (!p->sealed) {
                r = frame_add(out, plain, len);
                goto out;
        }
        sealed = malloc(len + AUTH_SEAL_BYTES);
        if (!sealed) {
                r = -ENOMEM;
                goto out;
        }
        r = auth_seal(&p->auth, plain, len, sealed);
        if (r < 0)
                goto out;
        outer.body_case = MOEEP__V1__PEER_MESSAGE__BODY_SEALED;
        outer.sealed.data = sealed;
        outer.sealed.len = len + AUTH_SEAL_BYTES;
        wire_len = protobuf_c_message_get_packed_size(&outer.base);
        wire = malloc(wire_len);
        if (!wire) {
                r = -ENOMEM;
                goto out;
        }
        protobuf_c_message_pack(&outer.base, wire);
        r = frame_add(out, wire, wire_len);
out:
        if (plain)
                sodium_memzero(plain, len);
        free(plain);
        free(sealed);
        free(wire);
        return r;
}

/* ------------------------------------------------------------ reading */

/* Opens a sealed frame of `p` and handles the message inside. A frame that
 * does not open as the next one of this connection (replayed, reordered,
 * spliced from another connection, forged) ends the connection. */
static void peer_handle_sealed(struct mesh_peer *p, const ProtobufCBinaryData *box) {
        Moeep__V1__PeerMessage *inner;
        uint8_t *plain;
        size_t len;

        /* Only a dialler waiting for PeerWelcome, or an established
         * connection, has the keys to open one. */
        if (!p->have_keys || (!p->sealed && !(p->outbound && p->sent_proof))) {
                mesh_peer_fail(p, false, "a sealed frame before the handshake is done");
                return;
        }
        if (box->len < AUTH_SEAL_BYTES || box->len - AUTH_SEAL_BYTES > MESH_FRAME_MAX) {
                mesh_peer_fail(p, false, "a sealed frame of %zu bytes", box->len);
                return;
        }
        len = box->len - AUTH_SEAL_BYTES;
        plain = malloc(len ? len : 1);
        if (!plain) {
                mesh_peer_fail(p, false, "out of memory");
                return;
        }
        if (auth_open(&p->auth, box->data, box->len, plain) < 0) {
                free(plain);
                mesh_peer_fail(p, false,
                               "sealed frame %" PRIu64
                               " (%zu bytes) does not authenticate: forged, replayed, "
                               "reordered or from another connection",
                               p->auth.rx_seq, box->len);
                return;
        }
        inner = moeep__v1__peer_message__unpack(NULL, len, plain);
        sodium_memzero(plain, len);
        free(plain);
        if (!inner) {
                mesh_peer_fail(p, false, "a sealed frame of %zu bytes does not decode", len);
                return;
        }
        mesh_peer_handle(p, inner, true);
        moeep__v1__peer_message__free_unpacked(inner, NULL);
}

static void mesh_peer_read_cb(struct bufferevent *bev, void *arg) {
        struct mesh_peer *p = arg;

        while (p->bev == bev && p->state != MESH_PEER_DOWN && !p->stuck_bytes) {
                struct evbuffer *in = bufferevent_get_input(bev);
                size_t max = p->state == MESH_PEER_UP ? MESH_FRAME_MAX_WIRE : MESH_FRAME_MAX_UNAUTH;
                Moeep__V1__PeerMessage *msg;
                uint8_t hdr[4];
                uint32_t len;

                if (evbuffer_copyout(in, hdr, 4) < 4)
                        return;
                len = (uint32_t)hdr[0] << 24 | (uint32_t)hdr[1] << 16 | (uint32_t)hdr[2] << 8 | hdr[3];
                if (len > max) {
                        mesh_peer_fail(p, false, "frame of %" PRIu32 " bytes (at most %zu now)", len, max);
                        return;
                }
                if (evbuffer_get_length(in) < 4 + (size_t)len)
                        return;
                evbuffer_drain(in, 4);
                msg = moeep__v1__peer_message__unpack(NULL, len, evbuffer_pullup(in, len));
                evbuffer_drain(in, len);
                if (!msg) {
                        mesh_peer_fail(p, false, "a frame of %" PRIu32 " bytes does not decode", len);
                        return;
                }
                if (msg->body_case == MOEEP__V1__PEER_MESSAGE__BODY_SEALED)
                        peer_handle_sealed(p, &msg->sealed);
                else if (p->sealed)
                        mesh_peer_fail(p, false, "a frame in clear (message %d) after the handshake",
                                       (int)msg->body_case);
                else
                        mesh_peer_handle(p, msg, false);
                moeep__v1__peer_message__free_unpacked(msg, NULL);
        }
}

/* ============================================================ identities, admission, handshake */

/* The node mesh's identities, admission and handshake; see mesh.h and
 * auth.h. */

/* ------------------------------------------------------------ addresses */

static void mesh_sockaddr_string(const struct sockaddr *sa, char *buf, size_t size) {
        char host[INET6_ADDRSTRLEN] = "?";

        if (sa->sa_family == AF_INET) {
                const struct sockaddr_in *s4 = (const struct sockaddr_in *)sa;

                inet_ntop(AF_INET, &s4->sin_addr, host, sizeof(host));
                snprintf(buf, size, "%s:%u", host, (unsigned)ntohs(s4->sin_port));
        } else if (sa->sa_family == AF_INET6) {
                const struct sockaddr_in6 *s6 = (const struct sockaddr_in6 *)sa;

                inet_ntop(AF_INET6, &s6->sin6_addr, host, sizeof(host));
                snprintf(buf, size, "[%s]:%u", host, (unsigned)ntohs(s6->sin6_port));
        } else {
                snprintf(buf, size, "?");
        }
}

/* Parses a mesh address (config_listen_split()'s forms) into a sockaddr. */
static int mesh_address_resolve(const char *address, struct sockaddr_storage *ret_ss, socklen_t *ret_len) {
        char host[CONFIG_HOST_MAX];
        uint16_t port;

        if (config_listen_split(address, host, &port) < 0)
                return -EINVAL;
        memset(ret_ss, 0, sizeof(*ret_ss));
        if (strcmp(host, "localhost") == 0)
                snprintf(host, sizeof(host), "127.0.0.1");
        if (strchr(host, ':')) {
                struct sockaddr_in6 *s6 = (struct sockaddr_in6 *)ret_ss;

                s6->sin6_family = AF_INET6;
                s6->sin6_port = htons(port);
                if (inet_pton(AF_INET6, host, &s6->sin6_addr) != 1)
                        return -EINVAL;
                *ret_len = sizeof(*s6);
        } else {
                struct sockaddr_in *s4 = (struct sockaddr_in *)ret_ss;

                s4->sin_family = AF_INET;
                s4->sin_port = htons(port);
                if (inet_pton(AF_INET, host, &s4->sin_addr) != 1)
                        return -EINVAL;
                *ret_len = sizeof(*s4);
        }
        return 0;
}

/* The canonical spelling of mesh address `address`: parsed as
 * mesh_address_resolve() does (so "localhost", leading zeros in the port and
 * every IPv6 spelling are understood), an IPv4-mapped IPv6 address taken as
 * the IPv4 one, and printed back by inet_ntop(): "IPV4:PORT" or
 * "[IPV6]:PORT". Two spellings of one socket address give the same string,
 * so canonical addresses are compared with strcmp(). Port 0 is no peer's.
 * Returns 0 or -EINVAL. */
int mesh_address_canon(const char *address, char ret[static JOB_NODE_MAX + 1]) {
        struct sockaddr_storage ss;
        socklen_t len;

        if (strlen(address) > JOB_NODE_MAX || mesh_address_resolve(address, &ss, &len) < 0)
                return -EINVAL;
        if (ss.ss_family == AF_INET6 && IN6_IS_ADDR_V4MAPPED(&((struct sockaddr_in6 *)&ss)->sin6_addr)) {
                struct sockaddr_in6 s6 = *(struct sockaddr_in6 *)&ss;
                struct sockaddr_in *s4 = (struct sockaddr_in *)&ss;

                memset(&ss, 0, sizeof(ss));
                s4->sin_family = AF_INET;
                s4->sin_port = s6.sin6_port;
                memcpy(&s4->sin_addr, &s6.sin6_addr.s6_addr[12], 4);
        }
        if ((ss.ss_family == AF_INET ? ((struct sockaddr_in *)&ss)->sin_port
                                     : ((struct sockaddr_in6 *)&ss)->sin6_port) == 0)
                return -EINVAL;
        mesh_sockaddr_string((struct sockaddr *)&ss, ret, JOB_NODE_MAX + 1);
        return 0;
}

/* The configured peer (mesh_peers) at canonical address `canon`, or NULL. */
struct mesh_peer *mesh_configured_find(const struct mesh *mesh, const char *canon) {
        struct mesh_peer *p;

        TAILQ_FOREACH (p, &mesh->peers, entry)
                if (p->outbound && strcmp(p->address, canon) == 0)
                        return p;
        return NULL;
}

bool mesh_address_is_self(const struct mesh *mesh, const char *address) {
        char canon[JOB_NODE_MAX + 1];

        return mesh && mesh_address_canon(address, canon) == 0 && strcmp(canon, mesh->address) == 0;
}

/* An identity as a peer said it, made printable for a log line or a
 * PeerRefused (it is not believed, only shown). */
void mesh_claim_printable(const char *claim, char ret[static JOB_NODE_MAX + 1]) {
        size_t n;

        snprintf(ret, JOB_NODE_MAX + 1, "%s", claim ? claim : "");
        for (n = 0; ret[n]; n++)
                if (ret[n] < 0x21 || ret[n] > 0x7e)
                        ret[n] = '?';
}

/* Our advertised address and identity: mesh_listen, canonical (as
 * mesh_address_canon()), with the port the kernel chose when it said 0. */
static void mesh_address_set(struct mesh *mesh) {
        struct sockaddr_storage ss;
        socklen_t len = sizeof(ss);
        char spelled[JOB_NODE_MAX + 1];

        if (getsockname(evconnlistener_get_fd(mesh->listener), (struct sockaddr *)&ss, &len) < 0)
                ss.ss_family = AF_UNSPEC;
        mesh_sockaddr_string((struct sockaddr *)&ss, spelled, sizeof(spelled));
        if (mesh_address_canon(spelled, mesh->address) < 0)
                snprintf(mesh->address, sizeof(mesh->address), "%s", spelled);
        if (strncmp(mesh->address, "0.0.0.0:", 8) == 0 || strncmp(mesh->address, "[::]:", 5) == 0)
                log_warn("mesh: mesh_listen %s is a wildcard: peers must dial this daemon at the address it "
                         "names itself by, so name one that they reach",
                         mesh->address);
}

/* ------------------------------------------------------------ handshake */

static void mesh_hello_send(struct mesh_peer *p) {
        Moeep__V1__PeerHello hello = MOEEP__V1__PEER_HELLO__INIT;
        PEER_MSG(msg, hello, &hello, HELLO);

        auth_nonce(p->nonce_dialler);
        hello.major = MOEEP_PROTOCOL_MAJOR;
        hello.nonce.data = p->nonce_dialler;
        hello.nonce.len = AUTH_NONCE_BYTES;
        hello.address = p->mesh->address;
        hello.minor = MOEEP_PROTOCOL_MINOR;
        hello.mesh_version = AUTH_MESH_VERSION;
        mesh_peer_send(p, &msg);
}

/* Acceptor: a dialler says who it is and sends its nonce. Only an identity
 * of mesh_peers is answered; it is believed once PeerProof proves it. */
static void mesh_hello_handle(struct mesh_peer *p, const Moeep__V1__PeerHello *h) {
        struct mesh *mesh = p->mesh;
        Moeep__V1__PeerChallenge ch = MOEEP__V1__PEER_CHALLENGE__INIT;
        PEER_MSG(msg, challenge, &ch, CHALLENGE);
        struct auth_transcript t = { 0 };
        uint8_t nonce_acceptor[AUTH_NONCE_BYTES], mac[AUTH_MAC_BYTES];
        char why[ERRMSG_MAX], claim[JOB_NODE_MAX + 1];

        p->got_hello = true;
        if (h->major != MOEEP_PROTOCOL_MAJOR || h->mesh_version != AUTH_MESH_VERSION) {
                snprintf(why, sizeof(why),
                         "protocol major %" PRIu32 " mesh version %" PRIu32
                         ", this daemon speaks %d and %d (upgrade every daemon of the mesh)",
                         h->major, h->mesh_version, MOEEP_PROTOCOL_MAJOR, AUTH_MESH_VERSION);
                mesh_peer_refuse(p, why);
                return;
        }
        if (h->nonce.len != AUTH_NONCE_BYTES) {
                snprintf(why, sizeof(why), "nonce of %zu bytes, need %d", h->nonce.len, AUTH_NONCE_BYTES);
                mesh_peer_refuse(p, why);
                return;
        }
        if (!mesh->keyed) {
                mesh_peer_refuse(p, "the accepting daemon has no cluster key (cluster_key_file)");
                return;
        }
        mesh_claim_printable(h->address, claim);
        if (!h->address || mesh_address_canon(h->address, p->claimed) < 0) {
                snprintf(why, sizeof(why), "it says it is '%s', which is not a mesh address", claim);
                mesh_peer_refuse(p, why);
                return;
        }
        if (strcmp(p->claimed, mesh->address) == 0) {
                snprintf(why, sizeof(why),
                         "it says it is this daemon (%s): a daemon never meshes with itself", mesh->address);
                mesh_peer_refuse(p, why);
                return;
        }
        if (!mesh_configured_find(mesh, p->claimed)) {
                snprintf(why, sizeof(why), "it says it is %s, which is not in this daemon's mesh_peers",
                         p->claimed);
                mesh_peer_refuse(p, why);
                return;
        }
        p->minor = h->minor;
        auth_nonce(nonce_acceptor);
        memcpy(t.nonce_dialler, h->nonce.data, AUTH_NONCE_BYTES);
        memcpy(t.nonce_acceptor, nonce_acceptor, AUTH_NONCE_BYTES);
        t.id_dialler = p->claimed;
        t.id_acceptor = mesh->address;
        t.minor_dialler = h->minor;
        t.minor_acceptor = MOEEP_PROTOCOL_MINOR;
        if (auth_session_derive(mesh->key, &t, AUTH_ACCEPTOR, &p->auth) < 0) {
                mesh_peer_refuse(p, "identities too long");
                return;
        }
        p->have_keys = true;
        auth_proof(&p->auth, AUTH_ACCEPTOR, mac);
        ch.nonce.data = nonce_acceptor;
        ch.nonce.len = AUTH_NONCE_BYTES;
        ch.mac.data = mac;
        ch.mac.len = AUTH_MAC_BYTES;
        ch.address = mesh->address;
        ch.minor = MOEEP_PROTOCOL_MINOR;
        ch.mesh_version = AUTH_MESH_VERSION;
        mesh_peer_send(p, &msg);
}

/* Dialler: the acceptor must be the daemon we dialled and prove the key
 * over the transcript with both identities; only then do we prove
 * ourselves. */
static void mesh_challenge_handle(struct mesh_peer *p, const Moeep__V1__PeerChallenge *c) {
        struct mesh *mesh = p->mesh;
        Moeep__V1__PeerProof proof = MOEEP__V1__PEER_PROOF__INIT;
        PEER_MSG(msg, proof, &proof, PROOF);
        struct auth_transcript t = { 0 };
        uint8_t mac[AUTH_MAC_BYTES];
        char why[ERRMSG_MAX], said[JOB_NODE_MAX + 1], canon[JOB_NODE_MAX + 1];

        if (!mesh->keyed) {
                mesh_peer_refuse(p, "the dialling daemon has no cluster key (cluster_key_file)");
                return;
        }
        if (c->mesh_version != AUTH_MESH_VERSION) {
                snprintf(why, sizeof(why),
                         "mesh version %" PRIu32 ", this daemon speaks %d (upgrade every daemon of the mesh)",
                         c->mesh_version, AUTH_MESH_VERSION);
                mesh_peer_refuse(p, why);
                return;
        }
        if (c->nonce.len != AUTH_NONCE_BYTES) {
                mesh_peer_refuse(p, "challenge nonce of the wrong size");
                return;
        }
        mesh_claim_printable(c->address, said);
        if (!c->address || mesh_address_canon(c->address, canon) < 0 || strcmp(canon, p->address) != 0) {
                snprintf(why, sizeof(why),
                         "it says it is '%s', but %s was dialled (its mesh_listen and our mesh_peers must "
                         "name the same address)",
                         said, p->address);
                mesh_peer_refuse(p, why);
                return;
        }
        p->minor = c->minor;
        memcpy(t.nonce_dialler, p->nonce_dialler, AUTH_NONCE_BYTES);
        memcpy(t.nonce_acceptor, c->nonce.data, AUTH_NONCE_BYTES);
        t.id_dialler = mesh->address;
        t.id_acceptor = p->address;
        t.minor_dialler = MOEEP_PROTOCOL_MINOR;
        t.minor_acceptor = c->minor;
        if (auth_session_derive(mesh->key, &t, AUTH_DIALLER, &p->auth) < 0) {
                mesh_peer_refuse(p, "identities too long");
                return;
        }
        p->have_keys = true;
        if (!auth_proof_verify(&p->auth, AUTH_ACCEPTOR, c->mac.data, c->mac.len)) {
                mesh_peer_refuse(p, "the acceptor's proof does not match the cluster key (a different key?)");
                return;
        }
        auth_proof(&p->auth, AUTH_DIALLER, mac);
        proof.mac.data = mac;
        proof.mac.len = AUTH_MAC_BYTES;
        p->sent_proof = true;
        mesh_peer_send(p, &msg);
}

/* Acceptor: the dialler proved the key and the identity it claimed. From
 * here on every frame is sealed, PeerWelcome first. */
static void mesh_proof_handle(struct mesh_peer *p, const Moeep__V1__PeerProof *pr) {
        Moeep__V1__PeerWelcome welcome = MOEEP__V1__PEER_WELCOME__INIT;
        PEER_MSG(msg, welcome, &welcome, WELCOME);

        if (!p->have_keys || !auth_proof_verify(&p->auth, AUTH_DIALLER, pr->mac.data, pr->mac.len)) {
                mesh_peer_refuse(p, "the dialler's proof does not match the cluster key (a different key?)");
                return;
        }
        auth_session_done(&p->auth);
        p->sealed = true;
        snprintf(p->address, sizeof(p->address), "%s", p->claimed);
        mesh_peer_send(p, &msg);
        mesh_peer_up(p);
}

/* Dialler: the sealed PeerWelcome opened, so the acceptor holds this
 * connection's keys. */
static void mesh_welcome_handle(struct mesh_peer *p, const Moeep__V1__PeerWelcome *w) {
        auth_session_done(&p->auth);
        p->sealed = true;
        mesh_peer_up(p);
}

/* ------------------------------------------------------------ admission */

/* Whether one more pre-authentication refusal may be logged this second:
 * a flood of connections must not become a flood of log lines. The count
 * of those not logged is said with the first line of a later second. */
static bool mesh_preauth_log_ok(struct mesh *mesh) {
        uint64_t second = mesh_now_ns() / 1000000000u;

        if (second != mesh->log_second) {
                if (mesh->log_suppressed)
                        log_warn("mesh: %" PRIu32
                                 " more connections refused before authenticating (not logged "
                                 "one by one)",
                                 mesh->log_suppressed);
                mesh->log_second = second;
                mesh->log_lines = mesh->log_suppressed = 0;
        }
        if (mesh->log_lines >= MESH_PREAUTH_LOGS_PER_S) {
                mesh->log_suppressed++;
                return false;
        }
        mesh->log_lines++;
        return true;
}

/* The source that a connection counts against for the pre-authentication
 * quota: its IPv4 address (as IPv4-mapped IPv6), or the /64 of its IPv6
 * address (one host commonly holds a whole /64). */
static void mesh_source_key(const struct sockaddr *sa, uint8_t ret[static 16]) {
        memset(ret, 0, 16);
        if (sa->sa_family == AF_INET) {
                ret[10] = ret[11] = 0xff;
                memcpy(ret + 12, &((const struct sockaddr_in *)sa)->sin_addr, 4);
        } else if (sa->sa_family == AF_INET6) {
                const struct in6_addr *a = &((const struct sockaddr_in6 *)sa)->sin6_addr;

                memcpy(ret, a->s6_addr, IN6_IS_ADDR_V4MAPPED(a) ? 16 : 8);
        }
}

/* The oldest inbound connection still authenticating from `source`, and
 * how many there are (NULL, 0 for none). */
static struct mesh_peer *preauth_oldest(const struct mesh *mesh, const uint8_t source[static 16],
                                        uint32_t *ret_count) {
        struct mesh_peer *p, *oldest = NULL;
        uint32_t n = 0;

        TAILQ_FOREACH (p, &mesh->peers, entry) {
                if (p->dead || p->outbound || p->state != MESH_PEER_AUTHENTICATING ||
                    memcmp(p->source, source, 16) != 0)
                        continue;
                n++;
                if (!oldest || p->accepted_ns < oldest->accepted_ns)
                        oldest = p;
        }
        *ret_count = n;
        return oldest;
}

/* Makes room for one more connection authenticating from `source`: when
 * that source is at its quota, its oldest connection goes; when every slot
 * is taken, the oldest of the source that holds the most goes. A real peer
 * finishes its handshake in a round trip or two, so only connections that
 * sit idle are ever displaced, and one source (however fast it reconnects)
 * holds at most its quota while any other source still gets in. */
static void mesh_preauth_make_room(struct mesh *mesh, const uint8_t source[static 16]) {
        struct mesh_peer *p, *victim;
        uint32_t n;
        const char *why = "its source is at its quota of connections authenticating: the oldest goes";

        victim = preauth_oldest(mesh, source, &n);
        if (n < MESH_MAX_UNAUTH_PER_SOURCE)
                victim = NULL;
        if (!victim && mesh->unauthenticated >= MESH_MAX_UNAUTH) {
                uint32_t most = 0;

                why = "every slot is taken and its source holds the most: the oldest goes";
                TAILQ_FOREACH (p, &mesh->peers, entry) {
                        struct mesh_peer *o;

                        if (p->dead || p->outbound || p->state != MESH_PEER_AUTHENTICATING)
                                continue;
                        o = preauth_oldest(mesh, p->source, &n);
                        if (n > most) {
                                most = n;
                                victim = o;
                        }
                }
        }
        if (victim)
                mesh_peer_fail(victim, false, "%s", why);
}
