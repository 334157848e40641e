/* What the peer layer's files share: mesh.c (connections, framing and
 * sealing, identities, admission, handshake). Not for any other file: the rest of
 * the daemon, the jobs across daemons included, uses mesh.h. */
#ifndef MOEEPD_MESH_INTERNAL_H
#define MOEEPD_MESH_INTERNAL_H

#include <stdbool.h>
#include <stdint.h>
#include <sys/socket.h>
#include <time.h>

#include "mesh/mesh.h"
#include "moeep.pb-c.h"

static inline uint64_t mesh_now_ns(void) {
        struct timespec ts;

        clock_gettime(CLOCK_MONOTONIC, &ts);
        return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* ------------------------------------------------ mesh.c: connections */

/* Handles one message of `p`; `sealed` says whether it came in a sealed
 * frame. In clear: only the handshake messages, each in its turn. Sealed:
 * the dialler's PeerWelcome, then anything but a handshake message (job
 * messages go to the mesh's client). */
void mesh_peer_handle(struct mesh_peer *p, const Moeep__V1__PeerMessage *msg, bool sealed);

/* Refuses `p` during the handshake: PeerRefused{why}, then mesh_peer_fail(). */
void mesh_peer_refuse(struct mesh_peer *p, const char *why);

/* Both sides proved the key: `p` is usable (or dropped as a duplicate of
 * a connection to the same daemon). */
void mesh_peer_up(struct mesh_peer *p);

/* ------------------------------------------------ mesh.c: addresses */

/* "IPV4:PORT" or "[IPV6]:PORT" of `sa`, "?" for another family. */
void mesh_sockaddr_string(const struct sockaddr *sa, char *buf, size_t size);

/* Parses a mesh address (config_listen_split()'s forms) into a sockaddr.
 * Returns 0 or -EINVAL. */
int mesh_address_resolve(const char *address, struct sockaddr_storage *ret_ss, socklen_t *ret_len);

/* Our advertised address and identity (mesh->address), from the
 * listener's socket. */
void mesh_address_set(struct mesh *mesh);

/* ------------------------------------------------ mesh.c: frames */

/* Whether messages of case `c` travel in clear (the handshake's, but
 * PeerWelcome, the acceptor's first sealed frame). */
bool mesh_is_clear_handshake(Moeep__V1__PeerMessage__BodyCase c);

/* The bufferevent read callback of every connection (arg: its peer): cuts
 * frames, opens sealed ones, hands each message to mesh_peer_handle(). */
void mesh_peer_read_cb(struct bufferevent *bev, void *arg);

/* ------------------------------------------------ mesh.c: handshake */

/* Dialler: the connection is made; sends PeerHello. */
void mesh_hello_send(struct mesh_peer *p);

/* The handshake messages, each in its turn (mesh.c checked the order). */
void mesh_hello_handle(struct mesh_peer *p, const Moeep__V1__PeerHello *h);
void mesh_challenge_handle(struct mesh_peer *p, const Moeep__V1__PeerChallenge *c);
void mesh_proof_handle(struct mesh_peer *p, const Moeep__V1__PeerProof *pr);
void mesh_welcome_handle(struct mesh_peer *p);

/* ------------------------------------------------ mesh.c: admission */

/* Whether one more pre-authentication refusal may be logged now. */
bool mesh_preauth_log_ok(struct mesh *mesh);

/* The pre-authentication quota's key of source address `sa`. */
void mesh_source_key(const struct sockaddr *sa, uint8_t ret[static 16]);

/* Makes room for one more inbound connection authenticating from `source`
 * (displacing the oldest of its source, or of the biggest source). */
void mesh_preauth_make_room(struct mesh *mesh, const uint8_t source[static 16]);

#endif
