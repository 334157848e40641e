/* What mesh.c (connections, framing, jobs across daemons) and
 * mesh-handshake.c (identities, admission, handshake) share. Not for any
 * other file: the rest of the daemon uses mesh.h. */
#ifndef MOEEPD_MESH_INTERNAL_H
#define MOEEPD_MESH_INTERNAL_H

#include <stdbool.h>
#include <stdint.h>
#include <sys/socket.h>
#include <time.h>

#include "mesh.h"
#include "moeep.pb-c.h"

/* Declares PeerMessage `var` whose body is `value` (of case `Case`). */
#define PEER_MSG(var, field, value, Case)                           \
        Moeep__V1__PeerMessage var = MOEEP__V1__PEER_MESSAGE__INIT; \
        var.body_case = MOEEP__V1__PEER_MESSAGE__BODY_##Case;       \
        var.field = (value)

static inline uint64_t mesh_now_ns(void) {
        struct timespec ts;

        clock_gettime(CLOCK_MONOTONIC, &ts);
        return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* ------------------------------------------------ mesh.c: connections */

/* Queues one message to `p`: in clear for PeerHello, PeerChallenge,
 * PeerProof and PeerRefused (only before the handshake is done), sealed
 * for everything else (only after). Returns 0 or -errno (-ENOTCONN when
 * the connection cannot carry it). */
int mesh_peer_send(struct mesh_peer *p, Moeep__V1__PeerMessage *msg);

/* The one way a connection ends: logs `fmt` once, closes (flushing a
 * queued PeerRefused when `flush`), fails what depended on it, then
 * redials (outbound) or frees the peer from the loop (inbound). */
void mesh_peer_fail(struct mesh_peer *p, bool flush, const char *fmt, ...)
        __attribute__((format(printf, 3, 4)));

/* Refuses `p` during the handshake: PeerRefused{why}, then mesh_peer_fail(). */
void mesh_peer_refuse(struct mesh_peer *p, const char *why);

/* Both sides proved the key: `p` is usable (or dropped as a duplicate of
 * a connection to the same daemon). */
void mesh_peer_up(struct mesh_peer *p);

/* ------------------------------------------------ mesh-handshake.c: addresses */

/* "IPV4:PORT" or "[IPV6]:PORT" of `sa`, "?" for another family. */
void mesh_sockaddr_string(const struct sockaddr *sa, char *buf, size_t size);

/* Parses a mesh address (config_listen_split()'s forms) into a sockaddr.
 * Returns 0 or -EINVAL. */
int mesh_address_resolve(const char *address, struct sockaddr_storage *ret_ss, socklen_t *ret_len);

/* The canonical spelling of `address` (see the definition). Returns 0 or
 * -EINVAL. */
int mesh_address_canon(const char *address, char ret[static JOB_NODE_MAX + 1]);

/* The configured peer (mesh_peers) at canonical address `canon`, or NULL. */
struct mesh_peer *mesh_configured_find(const struct mesh *mesh, const char *canon);

/* An identity as someone said it, made printable for a log line or an
 * error (never believed, only shown). */
void mesh_claim_printable(const char *claim, char ret[static JOB_NODE_MAX + 1]);

/* ------------------------------------------------ mesh-handshake.c: handshake */

/* Dialler: the connection is made; sends PeerHello. */
void mesh_hello_send(struct mesh_peer *p);

/* The handshake messages, each in its turn (mesh.c checked the order). */
void mesh_hello_handle(struct mesh_peer *p, const Moeep__V1__PeerHello *h);
void mesh_challenge_handle(struct mesh_peer *p, const Moeep__V1__PeerChallenge *c);
void mesh_proof_handle(struct mesh_peer *p, const Moeep__V1__PeerProof *pr);
void mesh_welcome_handle(struct mesh_peer *p);

/* ------------------------------------------------ mesh-handshake.c: admission */

/* Whether one more pre-authentication refusal may be logged now. */
bool mesh_preauth_log_ok(struct mesh *mesh);

/* The pre-authentication quota's key of source address `sa`. */
void mesh_source_key(const struct sockaddr *sa, uint8_t ret[static 16]);

/* Makes room for one more inbound connection authenticating from `source`
 * (displacing the oldest of its source, or of the biggest source). */
void mesh_preauth_make_room(struct mesh *mesh, const uint8_t source[static 16]);

#endif
