/* The internode mesh's peers: connections, their failure, liveness, dial,
 * accept and reap, and the routing of each message; see mesh.h. Frames
 * and sealing are in mesh-frame.c, identities, admission and the handshake
 * in mesh-handshake.c, each connection's transport peer in
 * mesh-transport.c; the jobs across daemons, which this file hands their
 * messages to, in mesh-jobs.c. */
#include <arpa/inet.h>
#include <errno.h>
#include <event2/buffer.h>
#include <event2/bufferevent.h>
#include <event2/event.h>
#include <event2/listener.h>
#include <inttypes.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "auth.h"
#include "config.h"
#include "job.h"
#include "log.h"
#include "mesh-internal.h"
#include "mesh.h"
#include "record.h"

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

/* The one way a peer connection ends: logs `fmt` once, drops the
 * connection (flushing a queued PeerRefused when `flush`), fails what
 * depended on it, and then redials (outbound) or frees the peer from the
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
        if (p->bev) {
                bev_release(p->bev, flush);
                p->bev = NULL;
        }
        evtimer_del(p->ev_timer);
        peer_handshake_reset(p);
        if (was == MESH_PEER_UP) {
                snprintf(lost, sizeof(lost), "daemon %s lost: %s", p->address, why);
                /* Rings writing to it end first, so that no producer waits
                 * on it while the jobs are aborted. */
                tp_was_connected = mesh_transport_drop(p, true);
        }
        /* The jobs across daemons let go of what depended on it. */
        if (mesh->client.peer_down)
                mesh->client.peer_down(mesh->client.arg, p, was == MESH_PEER_UP, tp_was_connected, lost, why);
        if (p->outbound) {
                timer_arm(p, MESH_REDIAL_MS);
        } else {
                p->dead = true;
                event_active(mesh->ev_reap, EV_TIMEOUT, 0);
        }
}

/* Closes a connection that duplicates another one to the same daemon and
 * that nothing uses: no log line, no job touched. An outbound peer waits to
 * redial (which it skips while the other connection is up). */
static void peer_drop(struct mesh_peer *p) {
        struct mesh *mesh = p->mesh;

        /* No job spans the daemon (mesh_peer_up() checked): nothing routes to
         * its transport peer. */
        mesh_transport_drop(p, false);
        if (!p->outbound && p->state != MESH_PEER_UP)
                mesh->unauthenticated--;
        p->state = MESH_PEER_DOWN;
        if (p->bev) {
                /* Flushed: a PeerWelcome queued on it lets the dialler
                 * reach the same decision instead of seeing a refusal. */
                bev_release(p->bev, true);
                p->bev = NULL;
        }
        evtimer_del(p->ev_timer);
        peer_handshake_reset(p);
        if (p->outbound) {
                timer_arm(p, MESH_REDIAL_MS);
        } else {
                p->dead = true;
                event_active(mesh->ev_reap, EV_TIMEOUT, 0);
        }
}

/* Refuses a peer during the handshake: tells it why, logs, closes. */
void mesh_peer_refuse(struct mesh_peer *p, const char *why) {
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

        p->remote[0] = '\0';
        if (mesh_address_resolve(p->address, &ss, &len) < 0) {
                p->state = MESH_PEER_CONNECTING; /* so that mesh_peer_fail() logs and re-arms */
                mesh_peer_fail(p, false, "'%s' is not an address", p->address);
                return;
        }
        p->bev = bufferevent_socket_new(p->mesh->base, -1, BEV_OPT_CLOSE_ON_FREE);
        p->state = MESH_PEER_CONNECTING;
        if (!p->bev) {
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
void mesh_peer_up(struct mesh_peer *p) {
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
        if (mesh->client.peer_up) /* forwarded joins that wait for it */
                mesh->client.peer_up(mesh->client.arg, p);
        mesh_transport_offer(p);
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

/* Handles one message; `sealed` says whether it came in a sealed frame.
 * In clear: only the handshake messages, each in its turn. Sealed: the
 * dialler's PeerWelcome, then anything but a handshake message. */
void mesh_peer_handle(struct mesh_peer *p, const Moeep__V1__PeerMessage *msg, bool sealed) {
        struct mesh *mesh = p->mesh;
        Moeep__V1__PeerMessage__BodyCase c = msg->body_case;
        bool ok;

        if (!sealed)
                ok = (c == MOEEP__V1__PEER_MESSAGE__BODY_HELLO && !p->outbound && !p->got_hello) ||
                     (c == MOEEP__V1__PEER_MESSAGE__BODY_CHALLENGE && p->outbound && !p->sent_proof) ||
                     (c == MOEEP__V1__PEER_MESSAGE__BODY_PROOF && !p->outbound && p->got_hello) ||
                     c == MOEEP__V1__PEER_MESSAGE__BODY_REFUSED;
        else if (!p->sealed)
                ok = c == MOEEP__V1__PEER_MESSAGE__BODY_WELCOME;
        else
                ok = !mesh_is_clear_handshake(c) && c != MOEEP__V1__PEER_MESSAGE__BODY_WELCOME &&
                     c != MOEEP__V1__PEER_MESSAGE__BODY_SEALED;
        if (!ok) {
                mesh_peer_fail(p, false, "message %d %s", (int)c,
                               p->sealed ? "not allowed after the handshake"
                                         : "out of order during the handshake");
                return;
        }
        switch (c) {
        case MOEEP__V1__PEER_MESSAGE__BODY_HELLO:
                mesh_hello_handle(p, msg->hello);
                return;
        case MOEEP__V1__PEER_MESSAGE__BODY_CHALLENGE:
                mesh_challenge_handle(p, msg->challenge);
                return;
        case MOEEP__V1__PEER_MESSAGE__BODY_PROOF:
                mesh_proof_handle(p, msg->proof);
                return;
        case MOEEP__V1__PEER_MESSAGE__BODY_WELCOME:
                mesh_welcome_handle(p);
                return;
        case MOEEP__V1__PEER_MESSAGE__BODY_REFUSED: {
                char reason[128];
                size_t n;

                snprintf(reason, sizeof(reason), "%s", msg->refused->reason ? msg->refused->reason : "");
                for (n = 0; reason[n]; n++)
                        if (reason[n] < 0x20 || reason[n] > 0x7e)
                                reason[n] = '?';
                mesh_peer_fail(p, false, "it refused us: %s", reason);
                return;
        }
        case MOEEP__V1__PEER_MESSAGE__BODY_PING: {
                Moeep__V1__PeerPong pong = MOEEP__V1__PEER_PONG__INIT;
                PEER_MSG(out, pong, &pong, PONG);

                pong.seq = msg->ping->seq;
                pong.sent_ns = msg->ping->sent_ns;
                mesh_peer_send(p, &out);
                return;
        }
        case MOEEP__V1__PEER_MESSAGE__BODY_PONG: {
                uint64_t now = mesh_now_ns();

                if (msg->pong->seq == p->ping_seq && msg->pong->sent_ns <= now)
                        p->rtt_us = (now - msg->pong->sent_ns) / 1000u;
                p->last_pong_ns = now;
                return;
        }
        case MOEEP__V1__PEER_MESSAGE__BODY_TRANSPORT:
                mesh_transport_handle(p, msg->transport);
                return;
        case MOEEP__V1__PEER_MESSAGE__BODY_JOIN: /* the jobs across daemons' (mesh-jobs.c) */
        case MOEEP__V1__PEER_MESSAGE__BODY_JOINED:
        case MOEEP__V1__PEER_MESSAGE__BODY_RANKS:
        case MOEEP__V1__PEER_MESSAGE__BODY_BARRIER:
        case MOEEP__V1__PEER_MESSAGE__BODY_BARRIER_DONE:
        case MOEEP__V1__PEER_MESSAGE__BODY_LEAVE:
        case MOEEP__V1__PEER_MESSAGE__BODY_REGION:
        case MOEEP__V1__PEER_MESSAGE__BODY_RANK_LOST:
                if (mesh->client.message)
                        mesh->client.message(mesh->client.arg, p, msg);
                return;
        case MOEEP__V1__PEER_MESSAGE__BODY_SEALED: /* refused above */
        case MOEEP__V1__PEER_MESSAGE__BODY__NOT_SET:
        case _MOEEP__V1__PEER_MESSAGE__BODY__CASE_IS_INT_SIZE:
                break;
        }
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

int mesh_start(struct event_base *base, const struct config *c, const struct mesh_transport_hooks *transport,
               struct mesh **ret_mesh, char *errmsg) {
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
        mesh->transport = *transport;
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
                if (p->bev) {
                        bufferevent_free(p->bev);
                        p->bev = NULL;
                }
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

void mesh_client_set(struct mesh *mesh, const struct mesh_client *client) {
        if (client)
                mesh->client = *client;
        else
                memset(&mesh->client, 0, sizeof(mesh->client));
}

struct mesh_peer *mesh_peer_find(const struct mesh *mesh, const char *address) {
        return peer_find(mesh, address, true);
}

uint32_t mesh_peer_jobs(const struct mesh *mesh, const struct mesh_peer *p) {
        return mesh->client.peer_jobs ? mesh->client.peer_jobs(mesh->client.arg, p) : 0;
}
