/* The node mesh's identities, admission and handshake; see mesh.h and
 * auth.h. mesh.c keeps the connections and their framing; mesh-internal.h
 * is what the peer layer's files share. */
#include <arpa/inet.h>
#include <errno.h>
#include <event2/listener.h>
#include <inttypes.h>
#include <netinet/in.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>

#include "auth.h"
#include "config.h"
#include "log.h"
#include "mesh-internal.h"
#include "mesh.h"
#include "record.h"

/* ------------------------------------------------------------ addresses */

void mesh_sockaddr_string(const struct sockaddr *sa, char *buf, size_t size) {
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
int mesh_address_resolve(const char *address, struct sockaddr_storage *ret_ss, socklen_t *ret_len) {
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
void mesh_address_set(struct mesh *mesh) {
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

void mesh_hello_send(struct mesh_peer *p) {
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
void mesh_hello_handle(struct mesh_peer *p, const Moeep__V1__PeerHello *h) {
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
void mesh_challenge_handle(struct mesh_peer *p, const Moeep__V1__PeerChallenge *c) {
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
void mesh_proof_handle(struct mesh_peer *p, const Moeep__V1__PeerProof *pr) {
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
void mesh_welcome_handle(struct mesh_peer *p) {
        auth_session_done(&p->auth);
        p->sealed = true;
        mesh_peer_up(p);
}

/* ------------------------------------------------------------ admission */

/* Whether one more pre-authentication refusal may be logged this second:
 * a flood of connections must not become a flood of log lines. The count
 * of those not logged is said with the first line of a later second. */
bool mesh_preauth_log_ok(struct mesh *mesh) {
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
void mesh_source_key(const struct sockaddr *sa, uint8_t ret[static 16]) {
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
void mesh_preauth_make_room(struct mesh *mesh, const uint8_t source[static 16]) {
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
