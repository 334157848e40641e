/* The internode mesh: connections, their framing and sealing, and the
 * jobs across daemons; see mesh.h. Identities, admission and the handshake
 * are in mesh-handshake.c. */
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

#include "auth.h"
#include "config.h"
#include "daemon.h"
#include "datapath.h"
#include "job.h"
#include "log.h"
#include "mesh-internal.h"
#include "mesh.h"
#include "record.h"
#include "session.h"

/* A rank of one of our home jobs that joined through a peer: the owner of
 * that (remote) member. */
struct mesh_rank {
        struct mesh_peer *peer;    /* not owning; the peer frees us when it goes down */
        struct job_member *member; /* not owning; the job owns it */
        TAILQ_ENTRY(mesh_rank) entry;
};

/* A client's JobJoin forwarded to its job's home. */
struct mesh_join {
        uint64_t token;
        struct session *session; /* holds a reference */
        uint64_t request_id;
        bool sent; /* PeerJoin is out; waiting for PeerJoined */
        char home[JOB_NODE_MAX + 1];
        uint8_t unique_id[MOEEP_UNIQUE_ID_BYTES]; /* never logged */
        size_t unique_id_len;
        uint32_t rank, world_size;
        char gpu_uuid[JOB_GPU_UUID_MAX + 1];
        TAILQ_ENTRY(mesh_join) entry;
};

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

/* Whether `s` is a usable mesh address: printable, no spaces, short. */
static bool address_valid(const char *s) {
        size_t n = strlen(s);

        if (n == 0 || n > JOB_NODE_MAX)
                return false;
        for (size_t i = 0; i < n; i++)
                if (s[i] < 0x21 || s[i] > 0x7e)
                        return false;
        return true;
}

/* ------------------------------------------------------------ sending */

/* Messages that travel in clear during the handshake. PeerWelcome is not
 * one: it is the acceptor's first sealed frame. */
static bool is_clear_handshake(Moeep__V1__PeerMessage__BodyCase c) {
        return c == MOEEP__V1__PEER_MESSAGE__BODY_HELLO || c == MOEEP__V1__PEER_MESSAGE__BODY_CHALLENGE ||
               c == MOEEP__V1__PEER_MESSAGE__BODY_PROOF || c == MOEEP__V1__PEER_MESSAGE__BODY_REFUSED;
}

/* Appends one frame (length and `len` bytes of `body`) to `out`. */
static int frame_add(struct evbuffer *out, const uint8_t *body, size_t len) {
        uint8_t hdr[4] = { (uint8_t)(len >> 24), (uint8_t)(len >> 16), (uint8_t)(len >> 8), (uint8_t)len };

        if (evbuffer_add(out, hdr, 4) < 0 || evbuffer_add(out, body, len) < 0)
                return -ENOMEM;
        return 0;
}

/* Queues one frame: in clear for the handshake messages, sealed (auth.h)
 * for everything else, which only a connection whose handshake is done
 * may carry. To a peer that is down, nothing (the job code sends to peers
 * that may have gone, and learns of it through mesh_peer_fail()). */
int mesh_peer_send(struct mesh_peer *p, Moeep__V1__PeerMessage *msg) {
        Moeep__V1__PeerMessage outer = MOEEP__V1__PEER_MESSAGE__INIT;
        struct evbuffer *out;
        uint8_t *plain = NULL, *sealed = NULL, *wire = NULL;
        size_t len, wire_len;
        int r;

        if (!p->bev)
                return -ENOTCONN;
        if (is_clear_handshake(msg->body_case) ? p->sealed : !p->sealed)
                return -ENOTCONN;
        out = bufferevent_get_output(p->bev);
        len = protobuf_c_message_get_packed_size(&msg->base);
        if (len > MESH_FRAME_MAX)
                return -EMSGSIZE;
        if (evbuffer_get_length(out) + len > MESH_OUT_MAX) {
                /* It stopped reading; the ping timer notices it going
                 * silent. Nothing is queued past the cap. */
                log_warn("mesh: peer %s: %zu bytes queued and not read: dropping a message", p->address,
                         evbuffer_get_length(out));
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

/* ------------------------------------------------------------ failure */

static void peer_dial(struct mesh_peer *p);
static struct mesh_peer *peer_find(const struct mesh *mesh, const char *address, bool up_only);
static bool peer_transport_drop(struct mesh_peer *p, bool fail);
static void peer_transport_offer(struct mesh_peer *p);
static void jobs_abort_at(struct mesh *mesh, const char *address, const char *why);
static void peer_ranks_lost(struct mesh_peer *p, const char *why);
static void mirrors_abort(struct mesh *mesh, const char *home, const char *why);
static void joins_fail(struct mesh *mesh, const char *home, const char *why);

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
        char why[ERRMSG_MAX];
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
                char lost[ERRMSG_MAX + JOB_NODE_MAX + 16];

                snprintf(lost, sizeof(lost), "daemon %s lost: %s", p->address, why);
                /* Rings writing to it end first, so that no producer waits
                 * on it while the jobs are aborted below. */
                if (peer_transport_drop(p, true))
                        jobs_abort_at(mesh, p->address, lost);
                peer_ranks_lost(p, lost);
                /* Mirrors and forwarded joins name the daemon, not the
                 * connection: they go on over another one that is up. */
                if (!peer_find(mesh, p->address, true))
                        mirrors_abort(mesh, p->address, lost);
        }
        /* An inbound connection that never came up has no identity:
         * nothing waits on it. */
        if ((p->outbound || was == MESH_PEER_UP) && !peer_find(mesh, p->address, true))
                joins_fail(mesh, p->address, why);
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
        peer_transport_drop(p, false);
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
static void peer_read_cb(struct bufferevent *bev, void *arg);
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
        TAILQ_INIT(&p->ranks);
        p->ev_timer = evtimer_new(mesh->daemon->base, peer_timer_cb, p);
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

        bufferevent_setcb(p->bev, peer_read_cb, NULL, peer_event_cb, p);
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
        p->bev = bufferevent_socket_new(p->mesh->daemon->base, -1, BEV_OPT_CLOSE_ON_FREE);
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

/* Sends the forwarded joins that wait for `p` (UP). */
static void peer_up_flush(struct mesh_peer *p) {
        struct mesh_join *j;

        TAILQ_FOREACH (j, &p->mesh->joins, entry) {
                Moeep__V1__PeerJoin pj = MOEEP__V1__PEER_JOIN__INIT;
                PEER_MSG(msg, join, &pj, JOIN);

                if (j->sent || strcmp(j->home, p->address) != 0)
                        continue;
                pj.token = j->token;
                pj.unique_id.data = j->unique_id;
                pj.unique_id.len = j->unique_id_len;
                pj.rank = j->rank;
                pj.world_size = j->world_size;
                pj.gpu_uuid = j->gpu_uuid;
                if (mesh_peer_send(p, &msg) == 0)
                        j->sent = true;
        }
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
                bool keep_p = strcmp(dialler_p, dialler_q) < 0 && TAILQ_EMPTY(&q->ranks) &&
                              !mesh_peer_jobs(mesh, q);

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
        peer_up_flush(p);
        peer_transport_offer(p);
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

        if (error == -ECANCELED) /* it left; its daemon answers the client */
                return;
        done.job_id = job->id;
        done.rank = mr->member->rank;
        done.error = error ? session_error_code(error) : MOEEP__V1__ERROR_CODE__ERROR_UNSPECIFIED;
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
static struct mesh_rank *rank_find(struct mesh_peer *p, uint64_t job_id, uint32_t rank) {
        struct mesh_rank *mr;

        TAILQ_FOREACH (mr, &p->ranks, entry)
                if (mr->member->job->id == job_id && mr->member->rank == rank)
                        return mr;
        return NULL;
}

/* mesh_job_nodes() with rank `gone` (-1: none) counted as not joined. */
static bool job_nodes_except(const struct mesh *mesh, const struct job *job, int64_t gone,
                             struct job_node ret[MOEEP_MAX_RANKS]) {
        bool spans = job->home[0] != '\0';

        memset(ret, 0, sizeof(struct job_node) * MOEEP_MAX_RANKS);
        if (!mesh)
                return false;
        if (job->home[0]) {
                memcpy(ret, job->nodes, sizeof(job->nodes));
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
                        snprintf(ret[r].address, sizeof(ret[r].address), "%s", mesh->address);
                }
        }
        return spans;
}

bool mesh_job_nodes(const struct mesh *mesh, const struct job *job, struct job_node ret[MOEEP_MAX_RANKS]) {
        return job_nodes_except(mesh, job, -1, ret);
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
        uint32_t kept = 0;

        for (uint32_t i = 0; i < job->nremote_regions; i++)
                if (rank >= 0 && job->remote_regions[i].rank != rank)
                        job->remote_regions[kept++] = job->remote_regions[i];
        job->nremote_regions = kept;
}

/* Records (or forgets, when released) a region of a remote rank. */
static void remote_region_update(struct job *job, const Moeep__V1__PeerRegion *pr) {
        struct job_remote_region *rr;

        for (uint32_t i = 0; i < job->nremote_regions; i++) {
                rr = &job->remote_regions[i];
                if (rr->rank != pr->rank || rr->region_id != pr->region_id)
                        continue;
                if (pr->released)
                        job->remote_regions[i] = job->remote_regions[--job->nremote_regions];
                return;
        }
        if (pr->released)
                return;
        if (job->nremote_regions >= JOB_REMOTE_REGIONS_MAX) {
                log_warn("job %" PRIu64 ": more than %d remote regions: rank %" PRIu32 "'s region %" PRIu64
                         " is not listed",
                         job->id, JOB_REMOTE_REGIONS_MAX, pr->rank, pr->region_id);
                return;
        }
        if (!job->remote_regions) {
                job->remote_regions = calloc(JOB_REMOTE_REGIONS_MAX, sizeof(*job->remote_regions));
                if (!job->remote_regions)
                        return;
        }
        rr = &job->remote_regions[job->nremote_regions++];
        rr->rank = pr->rank;
        rr->tag = pr->tag;
        rr->kind = (uint32_t)pr->kind;
        rr->size = pr->size;
        rr->region_id = pr->region_id;
        rr->proxy = (uint32_t)pr->proxy;
        rr->rkey = (struct tp_rkey){ .base = pr->rkey_base, .key = pr->rkey_key, .length = pr->rkey_length };
}

/* Tells every daemon with ranks of home job `job` (but the rank `gone`,
 * -1: none) the rank -> node map without `gone`. */
static void job_changed_except(struct mesh *mesh, const struct job *job, int64_t gone) {
        Moeep__V1__PeerRanks ranks = MOEEP__V1__PEER_RANKS__INIT;
        PEER_MSG(msg, ranks, &ranks, RANKS);
        struct job_node nodes[MOEEP_MAX_RANKS];
        char *ptrs[MOEEP_MAX_RANKS];

        if (!mesh || job->home[0] || !job_nodes_except(mesh, job, gone, nodes))
                return;
        for (uint32_t r = 0; r < job->world_size; r++)
                ptrs[r] = nodes[r].address;
        ranks.job_id = job->id;
        ranks.nodes = ptrs;
        ranks.n_nodes = job->world_size;
        job_peers_send(job, &msg, NULL, gone);
}

void mesh_job_changed(struct mesh *mesh, const struct job *job) {
        job_changed_except(mesh, job, -1);
}

static void handle_join(struct mesh_peer *p, const Moeep__V1__PeerJoin *pj) {
        struct daemon *d = p->mesh->daemon;
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
        else if (d->stopping)
                r = errmsg_set(errmsg, -ESHUTDOWN, "the job's daemon is shutting down");
        else
                r = jobs_join(d->jobs, pj->unique_id.data, pj->unique_id.len, pj->rank, pj->world_size,
                              pj->gpu_uuid, mr, &m, errmsg);
        if (r < 0) {
                free(mr);
                joined.error = session_error_code(r);
                joined.message = errmsg;
                log_info("mesh: peer %s: join as rank %" PRIu32 " refused: %s", p->address, pj->rank, errmsg);
                mesh_peer_send(p, &msg);
                return;
        }
        mr->peer = p;
        mr->member = m;
        m->remote = true;
        m->cb = &mesh_rank_callbacks;
        TAILQ_INSERT_TAIL(&p->ranks, mr, entry);
        log_info("mesh: rank %" PRIu32 "/%" PRIu32 " of job %" PRIu64 " '%s' joined at daemon %s (%s)",
                 m->rank, m->job->world_size, m->job->id, m->job->name, p->address,
                 job_state_to_string(m->job->state));
        joined.job_id = m->job->id;
        joined.name = m->job->name;
        joined.world_size = m->job->world_size;
        mesh_peer_send(p, &msg);
        mesh_job_changed(p->mesh, m->job);
        daemon_status_changed(d);
}

/* Takes `mr` off its peer; returns its member. */
static struct job_member *rank_detach(struct mesh_rank *mr) {
        struct job_member *m = mr->member;

        TAILQ_REMOVE(&mr->peer->ranks, mr, entry);
        free(mr);
        return m;
}

static void handle_barrier(struct mesh_peer *p, const Moeep__V1__PeerBarrier *pb) {
        struct mesh_rank *mr = rank_find(p, pb->job_id, pb->rank);
        char errmsg[ERRMSG_MAX];
        int r;

        if (!mr) {
                log_debug("mesh: peer %s: barrier for job %" PRIu64 " rank %" PRIu32
                          " that it has not joined",
                          p->address, pb->job_id, pb->rank);
                return;
        }
        r = job_barrier(mr->member, 0, errmsg);
        if (r == -EPIPE)
                rank_barrier_done(mr, mr->member->job, 0, r);
}

static void handle_leave(struct mesh_peer *p, const Moeep__V1__PeerLeave *pl) {
        struct mesh_rank *mr = rank_find(p, pl->job_id, pl->rank);

        if (!mr)
                return;
        log_info("mesh: rank %" PRIu32 " of job %" PRIu64 " left at daemon %s", pl->rank, pl->job_id,
                 p->address);
        /* The job may go away with its last member: tell the others first. */
        remote_regions_drop(mr->member->job, pl->rank);
        job_changed_except(p->mesh, mr->member->job, pl->rank);
        job_member_leave(rank_detach(mr));
        daemon_status_changed(p->mesh->daemon);
}

static void handle_rank_lost_home(struct mesh_peer *p, const Moeep__V1__PeerRankLost *pl) {
        struct mesh_rank *mr = rank_find(p, pl->job_id, pl->rank);
        char reason[ERRMSG_MAX];

        if (!mr)
                return;
        snprintf(reason, sizeof(reason), "%s (at daemon %s)", pl->reason ? pl->reason : "lost", p->address);
        remote_regions_drop(mr->member->job, pl->rank);
        job_member_lost(rank_detach(mr), reason);
        daemon_status_changed(p->mesh->daemon);
}

/* `p` went down: every rank that joined through it is lost. */
static void peer_ranks_lost(struct mesh_peer *p, const char *why) {
        struct mesh_rank *mr;

        while ((mr = TAILQ_FIRST(&p->ranks))) {
                remote_regions_drop(mr->member->job, mr->member->rank);
                job_member_lost(rank_detach(mr), why);
        }
        daemon_status_changed(p->mesh->daemon);
}

/* ------------------------------------------------------------ jobs, mirror side */

static struct mesh_join *join_find(const struct mesh *mesh, uint64_t token) {
        struct mesh_join *j;

        TAILQ_FOREACH (j, &mesh->joins, entry)
                if (j->token == token)
                        return j;
        return NULL;
}

static void join_free(struct mesh *mesh, struct mesh_join *j) {
        TAILQ_REMOVE(&mesh->joins, j, entry);
        session_unref(j->session);
        explicit_bzero(j->unique_id, sizeof(j->unique_id));
        free(j);
}

/* Fails the forwarded joins waiting for `home`. */
static void joins_fail(struct mesh *mesh, const char *home, const char *why) {
        struct mesh_join *j, *next;
        char msg[ERRMSG_MAX + JOB_NODE_MAX + 48];

        for (j = TAILQ_FIRST(&mesh->joins); j; j = next) {
                next = TAILQ_NEXT(j, entry);
                if (strcmp(j->home, home) != 0)
                        continue;
                snprintf(msg, sizeof(msg), "the job's daemon %s cannot be reached: %s", home, why);
                if (j->session->state != SESSION_CLOSED)
                        session_send_error(j->session, j->request_id,
                                           MOEEP__V1__ERROR_CODE__ERROR_NO_SUCH_JOB, msg);
                join_free(mesh, j);
        }
}

int mesh_join_forward(struct mesh *mesh, struct session *s, uint64_t rid, const Moeep__V1__JobJoin *jj,
                      const char *home, char *errmsg) {
        char canon[JOB_NODE_MAX + 1], said[JOB_NODE_MAX + 1];
        struct mesh_join *j;
        struct mesh_peer *p;

        mesh_claim_printable(home, said);
        if (!mesh)
                return errmsg_set(
                        errmsg, -ENOENT,
                        "the job was created at daemon %s, and this daemon's mesh is off (mesh_listen)",
                        said);
        if (jj->unique_id.len > MOEEP_UNIQUE_ID_BYTES || strlen(jj->gpu_uuid) > JOB_GPU_UUID_MAX)
                return errmsg_set(errmsg, -EINVAL, "unique id of %zu bytes or gpu uuid of %zu: too long",
                                  jj->unique_id.len, strlen(jj->gpu_uuid));
        /* The address comes from the client: it is only ever looked up
         * among the configured peers, never dialled as it is. */
        if (mesh_address_canon(home, canon) < 0)
                return errmsg_set(errmsg, -EINVAL,
                                  "the unique id names daemon '%s', which is not a mesh address", said);
        if (strcmp(canon, mesh->address) == 0)
                return errmsg_set(errmsg, -EINVAL, "the unique id names daemon '%s', which is this one (%s)",
                                  said, mesh->address);
        p = mesh_configured_find(mesh, canon);
        if (!p)
                return errmsg_set(errmsg, -ENOENT,
                                  "the job's daemon %s (named in the unique id) is not one of this daemon's "
                                  "mesh_peers: the join is not forwarded",
                                  said);
        TAILQ_FOREACH (j, &mesh->joins, entry)
                if (j->session == s)
                        return errmsg_set(errmsg, -EALREADY,
                                          "session %" PRIu64 " already waits for a join at daemon %s", s->id,
                                          j->home);
        j = calloc(1, sizeof(*j));
        if (!j)
                return errmsg_set(errmsg, -ENOMEM, "out of memory");
        j->token = ++mesh->next_token;
        j->session = s;
        session_ref(s);
        j->request_id = rid;
        snprintf(j->home, sizeof(j->home), "%s", canon);
        memcpy(j->unique_id, jj->unique_id.data, jj->unique_id.len);
        j->unique_id_len = jj->unique_id.len;
        j->rank = jj->rank;
        j->world_size = jj->world_size;
        snprintf(j->gpu_uuid, sizeof(j->gpu_uuid), "%s", jj->gpu_uuid);
        TAILQ_INSERT_TAIL(&mesh->joins, j, entry);
        log_info("session %" PRIu64 ": join as rank %" PRIu32 " forwarded to daemon %s", s->id, j->rank,
                 canon);
        /* A configured peer that is down is being redialled; the join
         * goes when it is up, or fails with the next failed dial. */
        p = peer_find(mesh, canon, true);
        if (p)
                peer_up_flush(p);
        return 0;
}

static void handle_joined(struct mesh_peer *p, const Moeep__V1__PeerJoined *pj) {
        struct mesh *mesh = p->mesh;
        struct mesh_join *j = join_find(mesh, pj->token);
        char errmsg[ERRMSG_MAX] = "";
        struct job_member *m;
        struct session *s;
        int r;

        if (!j || strcmp(j->home, p->address) != 0) {
                log_debug("mesh: peer %s: PeerJoined for unknown token %" PRIu64, p->address, pj->token);
                return;
        }
        s = j->session;
        if (pj->error != MOEEP__V1__ERROR_CODE__ERROR_UNSPECIFIED) {
                snprintf(errmsg, sizeof(errmsg), "at daemon %s: %s", p->address,
                         pj->message ? pj->message : "");
                if (s->state != SESSION_CLOSED)
                        session_send_error(s, j->request_id, pj->error, errmsg);
                join_free(mesh, j);
                return;
        }
        r = -ECANCELED;
        if (s->state != SESSION_CLOSED && !s->member)
                r = jobs_join_mirror(mesh->daemon->jobs, p->address, pj->job_id, pj->name, pj->world_size,
                                     j->rank, j->gpu_uuid, s, &m, errmsg);
        if (r < 0) {
                Moeep__V1__PeerLeave leave = MOEEP__V1__PEER_LEAVE__INIT;
                PEER_MSG(msg, leave, &leave, LEAVE);

                leave.job_id = pj->job_id;
                leave.rank = j->rank;
                mesh_peer_send(p, &msg);
                if (r != -ECANCELED && s->state != SESSION_CLOSED)
                        session_send_error(s, j->request_id, session_error_code(r), errmsg);
                join_free(mesh, j);
                return;
        }
        session_joined(s, j->request_id, m);
        daemon_status_changed(mesh->daemon);
        join_free(mesh, j);
}

static void handle_ranks(struct mesh_peer *p, const Moeep__V1__PeerRanks *pr) {
        struct job *job = jobs_find_mirror(p->mesh->daemon->jobs, p->address, pr->job_id);

        if (!job)
                return;
        for (uint32_t r = 0; r < job->world_size; r++) {
                const char *a = r < pr->n_nodes ? pr->nodes[r] : "";

                snprintf(job->nodes[r].address, sizeof(job->nodes[r].address), "%s",
                         address_valid(a) ? a : "");
        }
}

static void handle_barrier_done(struct mesh_peer *p, const Moeep__V1__PeerBarrierDone *pb) {
        struct job *job = jobs_find_mirror(p->mesh->daemon->jobs, p->address, pb->job_id);

        if (!job || pb->rank >= job->world_size || !job_rank_local(job, pb->rank))
                return;
        job_barrier_release(job->ranks[pb->rank], pb->error ? -EPIPE : 0);
}

static void handle_rank_lost_mirror(struct mesh_peer *p, const Moeep__V1__PeerRankLost *pl) {
        struct job *job = jobs_find_mirror(p->mesh->daemon->jobs, p->address, pl->job_id);

        if (!job || pl->rank >= job->world_size)
                return;
        job_abort(job, pl->rank, pl->reason ? pl->reason : "lost");
}

/* The home `home` went down: every mirror of its jobs is aborted, with
 * PeerLost for each rank that is not here. */
static void mirrors_abort(struct mesh *mesh, const char *home, const char *why) {
        struct job *job;

        TAILQ_FOREACH (job, &mesh->daemon->jobs->list, entry) {
                if (strcmp(job->home, home) != 0)
                        continue;
                for (uint32_t r = 0; r < job->world_size; r++)
                        if (!job_rank_local(job, r))
                                job_abort(job, r, why);
        }
}

static struct mesh_peer *home_peer(struct mesh *mesh, const struct job *job) {
        return mesh && job->home[0] ? peer_find(mesh, job->home, true) : NULL;
}

void mesh_barrier(struct mesh *mesh, struct job_member *m) {
        Moeep__V1__PeerBarrier pb = MOEEP__V1__PEER_BARRIER__INIT;
        PEER_MSG(msg, barrier, &pb, BARRIER);
        struct mesh_peer *p = home_peer(mesh, m->job);

        pb.job_id = m->job->home_id;
        pb.rank = m->rank;
        if (!p || mesh_peer_send(p, &msg) < 0) {
                /* The home is gone: the job is (being) aborted. */
                for (uint32_t r = 0; r < m->job->world_size; r++)
                        if (!job_rank_local(m->job, r))
                                job_abort(m->job, r, "the job's home daemon is not reachable");
                job_barrier_release(m, -EPIPE);
        }
}

void mesh_member_gone(struct mesh *mesh, struct job_member *m, bool lost, const char *reason) {
        struct mesh_peer *p = home_peer(mesh, m->job);

        if (mesh && !m->job->home[0] && !lost) /* a home job's local rank leaves */
                job_changed_except(mesh, m->job, m->rank);
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

void mesh_region_changed(struct mesh *mesh, const struct job_member *m, uint64_t region_id, uint32_t tag,
                         uint32_t kind, uint64_t size, bool released, uint32_t proxy,
                         const struct tp_rkey *rkey) {
        Moeep__V1__PeerRegion pr = MOEEP__V1__PEER_REGION__INIT;
        PEER_MSG(msg, region, &pr, REGION);
        struct mesh_peer *p;

        if (!mesh)
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
        p = home_peer(mesh, m->job);
        if (p)
                mesh_peer_send(p, &msg);
}

static void handle_region(struct mesh_peer *p, const Moeep__V1__PeerRegion *pr) {
        struct mesh_rank *mr = rank_find(p, pr->job_id, pr->rank);
        struct job *job;

        if (mr) { /* we are the home: keep it, pass it on to the others */
                Moeep__V1__PeerMessage msg = MOEEP__V1__PEER_MESSAGE__INIT;

                remote_region_update(mr->member->job, pr);
                msg.body_case = MOEEP__V1__PEER_MESSAGE__BODY_REGION;
                msg.region = (Moeep__V1__PeerRegion *)pr;
                job_peers_send(mr->member->job, &msg, p, -1);
                return;
        }
        job = jobs_find_mirror(p->mesh->daemon->jobs, p->address, pr->job_id);
        if (job && pr->rank < job->world_size && !job_rank_local(job, pr->rank))
                remote_region_update(job, pr);
}

/* ------------------------------------------------------------ transport */

/* The connection is up: makes our half of a transport connection to that
 * daemon and sends its address. Peers older than 1.3 would refuse the
 * message, and a daemon without a data path has nothing to offer. */
static void peer_transport_offer(struct mesh_peer *p) {
        struct datapath *dp = p->mesh->daemon->datapath;
        Moeep__V1__PeerTransport pt = MOEEP__V1__PEER_TRANSPORT__INIT;
        PEER_MSG(msg, transport, &pt, TRANSPORT);
        char errmsg[ERRMSG_MAX] = "";
        uint8_t blob[TP_ADDR_MAX];
        size_t len = 0;

        if (p->minor < 3 || !datapath_up(dp, NULL))
                return;
        if (datapath_peer_new(dp, &p->tp_peer, blob, &len, errmsg) < 0) {
                log_warn("mesh: peer %s: no transport connection: %s", p->address, errmsg);
                return;
        }
        pt.backend = (char *)datapath_backend(dp);
        pt.address.data = blob;
        pt.address.len = len;
        mesh_peer_send(p, &msg);
}

static void handle_transport(struct mesh_peer *p, const Moeep__V1__PeerTransport *pt) {
        struct datapath *dp = p->mesh->daemon->datapath;
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
            datapath_peer_connect(dp, p->tp_peer, pt->address.data, pt->address.len, errmsg) < 0) {
                log_warn("mesh: peer %s: transport address of %zu bytes refused: %s", p->address,
                         pt->address.len, errmsg[0] ? errmsg : "bad length");
                return;
        }
        p->tp_connected = true;
        log_info("mesh: peer %s: transport connected (transport peer %" PRIu32 ")", p->address, p->tp_peer);
}

/* Forgets the connection's transport peer, failing it in the proxy when
 * `fail` (rings routing to it get an error). Returns whether it was
 * connected. */
static bool peer_transport_drop(struct mesh_peer *p, bool fail) {
        bool was = p->tp_connected;

        if (p->tp_peer != MESH_NO_TP_PEER && fail)
                datapath_peer_fail(p->mesh->daemon->datapath, p->tp_peer, -ECONNRESET);
        p->tp_peer = MESH_NO_TP_PEER;
        p->tp_connected = false;
        return was;
}

int mesh_transport_peer(const struct mesh *mesh, const char *address, uint32_t *ret_tp_peer) {
        struct mesh_peer *p = mesh ? peer_find(mesh, address, true) : NULL;

        if (!p)
                return -ENOTCONN;
        if (!p->tp_connected)
                return -ENODEV;
        *ret_tp_peer = p->tp_peer;
        return 0;
}

void mesh_rank_failed(struct mesh *mesh, struct job *job, uint32_t rank, const char *reason) {
        struct mesh_peer *p = home_peer(mesh, job);

        if (p)
                send_rank_lost(p, job->home_id, rank, reason);
        job_abort(job, rank, reason);
}

/* Aborts every job that has a rank at daemon `address`, naming the first
 * such rank. */
static void jobs_abort_at(struct mesh *mesh, const char *address, const char *why) {
        struct job_node nodes[MOEEP_MAX_RANKS];
        struct job *job;

        TAILQ_FOREACH (job, &mesh->daemon->jobs->list, entry) {
                if (job->state == JOB_ABORTED || !mesh_job_nodes(mesh, job, nodes))
                        continue;
                for (uint32_t r = 0; r < job->world_size; r++)
                        if (!job_rank_local(job, r) && strcmp(nodes[r].address, address) == 0) {
                                mesh_rank_failed(mesh, job, r, why);
                                break;
                        }
        }
}

void mesh_transport_failed(struct mesh *mesh, uint32_t tp_peer, const char *why) {
        struct mesh_peer *p;

        if (!mesh)
                return;
        TAILQ_FOREACH (p, &mesh->peers, entry)
                if (p->state == MESH_PEER_UP && p->tp_peer == tp_peer) {
                        mesh_peer_fail(p, false, "its transport connection failed: %s", why);
                        return;
                }
}

/* ------------------------------------------------------------ reading */

/* Handles one message; `sealed` says whether it came in a sealed frame.
 * In clear: only the handshake messages, each in its turn. Sealed: the
 * dialler's PeerWelcome, then anything but a handshake message. */
static void peer_handle(struct mesh_peer *p, const Moeep__V1__PeerMessage *msg, bool sealed) {
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
                ok = !is_clear_handshake(c) && c != MOEEP__V1__PEER_MESSAGE__BODY_WELCOME &&
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
        case MOEEP__V1__PEER_MESSAGE__BODY_JOIN:
                handle_join(p, msg->join);
                return;
        case MOEEP__V1__PEER_MESSAGE__BODY_JOINED:
                handle_joined(p, msg->joined);
                return;
        case MOEEP__V1__PEER_MESSAGE__BODY_RANKS:
                handle_ranks(p, msg->ranks);
                return;
        case MOEEP__V1__PEER_MESSAGE__BODY_BARRIER:
                handle_barrier(p, msg->barrier);
                return;
        case MOEEP__V1__PEER_MESSAGE__BODY_BARRIER_DONE:
                handle_barrier_done(p, msg->barrier_done);
                return;
        case MOEEP__V1__PEER_MESSAGE__BODY_LEAVE:
                handle_leave(p, msg->leave);
                return;
        case MOEEP__V1__PEER_MESSAGE__BODY_REGION:
                handle_region(p, msg->region);
                return;
        case MOEEP__V1__PEER_MESSAGE__BODY_TRANSPORT:
                handle_transport(p, msg->transport);
                return;
        case MOEEP__V1__PEER_MESSAGE__BODY_RANK_LOST:
                /* To the home from a rank's daemon, or from the home. */
                if (rank_find(p, msg->rank_lost->job_id, msg->rank_lost->rank))
                        handle_rank_lost_home(p, msg->rank_lost);
                else
                        handle_rank_lost_mirror(p, msg->rank_lost);
                return;
        case MOEEP__V1__PEER_MESSAGE__BODY_SEALED: /* refused above */
        case MOEEP__V1__PEER_MESSAGE__BODY__NOT_SET:
        case _MOEEP__V1__PEER_MESSAGE__BODY__CASE_IS_INT_SIZE:
                break;
        }
        mesh_peer_fail(p, false, "message of unknown type %d", (int)c);
}

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
        peer_handle(p, inner, true);
        moeep__v1__peer_message__free_unpacked(inner, NULL);
}

static void peer_read_cb(struct bufferevent *bev, void *arg) {
        struct mesh_peer *p = arg;

        while (p->bev == bev && p->state != MESH_PEER_DOWN) {
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
                        peer_handle(p, msg, false);
                moeep__v1__peer_message__free_unpacked(msg, NULL);
        }
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
                p->bev = bufferevent_socket_new(mesh->daemon->base, fd, BEV_OPT_CLOSE_ON_FREE);
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

int mesh_start(struct daemon *d, struct mesh **ret_mesh, char *errmsg) {
        const struct config *c = &d->config;
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
        mesh->daemon = d;
        TAILQ_INIT(&mesh->peers);
        TAILQ_INIT(&mesh->joins);
        if (c->cluster_key_file[0]) {
                r = auth_key_load(c->cluster_key_file, mesh->key, errmsg);
                if (r < 0)
                        goto fail;
                mesh->keyed = true;
        } else {
                log_warn("mesh: no cluster_key_file: every peer daemon will be refused");
        }
        mesh->ev_reap = event_new(d->base, -1, 0, mesh_reap_cb, mesh);
        mesh->ev_accept_resume = event_new(d->base, -1, 0, mesh_accept_resume_cb, mesh);
        if (!mesh->ev_reap || !mesh->ev_accept_resume) {
                r = errmsg_set(errmsg, -ENOMEM, "mesh: out of memory");
                goto fail;
        }
        mesh->listener =
                evconnlistener_new_bind(d->base, mesh_accept_cb, mesh,
                                        LEV_OPT_CLOSE_ON_FREE | LEV_OPT_CLOSE_ON_EXEC | LEV_OPT_REUSEABLE,
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

void mesh_free(struct mesh *mesh) {
        struct mesh_peer *p;
        struct mesh_join *j;

        if (!mesh)
                return;
        while ((j = TAILQ_FIRST(&mesh->joins)))
                join_free(mesh, j);
        /* Take every connection down first, so that the members let go
         * below send nothing. */
        TAILQ_FOREACH (p, &mesh->peers, entry) {
                p->state = MESH_PEER_DOWN;
                if (p->bev) {
                        bufferevent_free(p->bev);
                        p->bev = NULL;
                }
        }
        while ((p = TAILQ_FIRST(&mesh->peers))) {
                struct mesh_rank *mr;

                while ((mr = TAILQ_FIRST(&p->ranks)))
                        job_member_leave(rank_detach(mr));
                peer_free(p);
        }
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

uint32_t mesh_peer_jobs(const struct mesh *mesh, const struct mesh_peer *p) {
        const struct job *job;
        uint32_t n = 0;

        TAILQ_FOREACH (job, &mesh->daemon->jobs->list, entry) {
                bool spans = strcmp(job->home, p->address) == 0;

                for (uint32_t r = 0; r < job->world_size && !spans; r++) {
                        const struct job_member *m = job->ranks[r];

                        spans = m && m->remote && ((const struct mesh_rank *)m->owner)->peer == p;
                }
                n += spans;
        }
        return n;
}
