/* Peer authentication for the mesh: the cluster key, the mutual
 * challenge-response that binds both nonces, both roles and both
 * identities, and the AEAD that protects every frame afterwards
 * (libsodium). Pure functions over bytes, no sockets, so the unit tests and
 * the fuzzers drive both sides directly; mesh.c carries the values in
 * PeerHello / PeerChallenge / PeerProof / PeerMessage.sealed (moeep.proto,
 * "mesh"; docs/protocol.md, "Mesh", has the protocol and its threat model).
 *
 * The transcript of one handshake is the protocol label, the dialler's
 * nonce Nd, the acceptor's nonce Na, the dialler's identity Id, the
 * acceptor's identity Ia (canonical mesh addresses, "IPV4:PORT" or
 * "[IPV6]:PORT") and both protocol minors. From the cluster key K:
 *
 *   th      = BLAKE2b-256(transcript)
 *   session = BLAKE2b-256(key = K, "moeep-mesh-2 session\0" | th)
 *   k_i     = crypto_kdf_derive_from_key(session, id i, context "moeepmsh")
 *             i = 1 dialler proof, 2 acceptor proof, 3 dialler -> acceptor
 *             frames, 4 acceptor -> dialler frames
 *   proof_r = HMAC-SHA-512-256(k_r, th)   (crypto_auth)
 *
 * Every value depends on both fresh nonces (no replay), on the role (a
 * proof reflected to its sender is checked under the other role's key) and
 * on both identities (a proof made for one pair of daemons is worthless
 * for another). Frames after the handshake are
 * crypto_aead_xchacha20poly1305_ietf under the sender's direction key with
 * an implicit 64-bit counter as the nonce, so a frame dropped, replayed,
 * reordered or moved to another connection does not open. */
#ifndef MOEEPD_AUTH_H
#define MOEEPD_AUTH_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define AUTH_KEY_BYTES 32   /* the cluster key: SHA-256 of the key file */
#define AUTH_NONCE_BYTES 32 /* fresh from randombytes_buf() for every handshake */
#define AUTH_MAC_BYTES 32   /* crypto_auth_BYTES */
#define AUTH_SEAL_BYTES 16  /* crypto_aead_xchacha20poly1305_ietf_ABYTES: what sealing adds */
/* The mesh handshake this code speaks (PeerHello/PeerChallenge
 * mesh_version); version 1 (moeep 1.3 and older) had no identities in its
 * MACs and no frame protection and is refused. */
#define AUTH_MESH_VERSION 2
/* A key file holds at least this many bytes of secret (e.g. 32 random
 * bytes, or their 64 hex digits); shorter is refused as guessable. */
#define AUTH_KEY_FILE_MIN 16
#define AUTH_KEY_FILE_MAX 4096

enum auth_role {
        AUTH_DIALLER,  /* opened the connection (mesh_peers) */
        AUTH_ACCEPTOR, /* accepted it (mesh_listen) */
};

const char *auth_role_to_string(enum auth_role r);

/* What both sides must agree on; the identities are canonical mesh
 * addresses (mesh_address_canon(), mesh.c), NUL-terminated, not
 * owned. */
struct auth_transcript {
        uint8_t nonce_dialler[AUTH_NONCE_BYTES];
        uint8_t nonce_acceptor[AUTH_NONCE_BYTES];
        const char *id_dialler;
        const char *id_acceptor;
        uint32_t minor_dialler;
        uint32_t minor_acceptor;
};

/* The keys of one connection, for one side (`self`). Wiped with
 * auth_session_wipe(). */
struct auth_session {
        enum auth_role self;
        uint8_t th[32];                       /* transcript hash */
        uint8_t proof_key[2][AUTH_KEY_BYTES]; /* by role; wiped once the handshake is done */
        uint8_t tx_key[AUTH_KEY_BYTES];       /* frames we seal */
        uint8_t rx_key[AUTH_KEY_BYTES];       /* frames we open */
        uint64_t tx_seq;                      /* counter of the next frame we seal */
        uint64_t rx_seq;                      /* counter of the next frame we open */
};

/* Initialises libsodium; call once before anything else. Returns 0 or
 * -EIO. */
int auth_init(void);

/* Reads the cluster key file at `path`: the key is SHA-256 of its contents
 * with trailing whitespace removed, so a hex or base64 text file and the
 * same bytes written without a newline give the same key. Refuses a file
 * that others may read or write (mode & 077), and one shorter than
 * AUTH_KEY_FILE_MIN or longer than AUTH_KEY_FILE_MAX. Returns 0 or -errno
 * with errmsg naming the path (never the contents). */
int auth_key_load(const char *path, uint8_t ret_key[static AUTH_KEY_BYTES], char *errmsg);

/* Fills `nonce` with fresh random bytes. */
void auth_nonce(uint8_t nonce[static AUTH_NONCE_BYTES]);

/* Derives side `self`'s keys of the handshake `t` under cluster key `key`.
 * Returns 0, or -EINVAL when an identity is missing or longer than 255
 * bytes. */
int auth_session_derive(const uint8_t key[static AUTH_KEY_BYTES], const struct auth_transcript *t,
                        enum auth_role self, struct auth_session *ret_session);

/* The proof that side `role` sends in this session. */
void auth_proof(const struct auth_session *s, enum auth_role role, uint8_t ret_mac[static AUTH_MAC_BYTES]);

/* Whether `mac` (of `len` bytes, as received) is side `role`'s proof in
 * this session; the comparison takes the same time wherever it differs. */
bool auth_proof_verify(const struct auth_session *s, enum auth_role role, const uint8_t *mac, size_t len);

/* The handshake is over: forgets the proof keys. */
void auth_session_done(struct auth_session *s);

/* Seals `len` bytes of `msg` as the next frame: `out` receives
 * len + AUTH_SEAL_BYTES bytes. Returns 0, or -EOVERFLOW once 2^64 - 1
 * frames went out (the connection must end). */
int auth_seal(struct auth_session *s, const uint8_t *msg, size_t len, uint8_t *out);

/* Opens the next frame (`len` >= AUTH_SEAL_BYTES bytes of `in`) into `out`
 * (len - AUTH_SEAL_BYTES bytes). Returns 0, -EBADMSG when it does not
 * authenticate as the next frame of this direction (forged, replayed,
 * reordered, truncated or from another connection; the counter does not
 * move), or -EOVERFLOW as auth_seal(). */
int auth_open(struct auth_session *s, const uint8_t *in, size_t len, uint8_t *out);

/* Wipes every key. Accepts NULL. */
void auth_session_wipe(struct auth_session *s);

#endif
