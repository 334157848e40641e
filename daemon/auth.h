/* Peer authentication for the mesh: the cluster key and the mutual
 * HMAC-SHA256 challenge-response (libsodium). Pure functions over bytes, no
 * sockets, so the unit tests drive both sides directly; mesh.c carries the
 * values in PeerHello / PeerChallenge / PeerProof (moeep.proto, "mesh").
 *
 * The transcript: the dialler sends a fresh nonce Nd, the listener a fresh
 * nonce Nl and mac_l = HMAC(K, "moeep-mesh-1 listener" | Nd | Nl); the
 * dialler checks it and answers mac_d = HMAC(K, "moeep-mesh-1 dialler" |
 * Nd | Nl). Each side's MAC covers the nonce the other side just drew, so
 * a recorded MAC is worthless later (no replay), and the role label keeps
 * a listener's MAC from passing as a dialler's (no reflection). */
#ifndef MOEEPD_AUTH_H
#define MOEEPD_AUTH_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define AUTH_KEY_BYTES 32   /* crypto_auth_hmacsha256_KEYBYTES */
#define AUTH_NONCE_BYTES 32 /* fresh from randombytes_buf() for every handshake */
#define AUTH_MAC_BYTES 32   /* crypto_auth_hmacsha256_BYTES */
/* A key file holds at least this many bytes of secret (e.g. 32 random
 * bytes, or their 64 hex digits); shorter is refused as guessable. */
#define AUTH_KEY_FILE_MIN 16
#define AUTH_KEY_FILE_MAX 4096

enum auth_role {
        AUTH_DIALLER,  /* opened the connection (mesh_peers) */
        AUTH_LISTENER, /* accepted it (mesh_listen) */
};

const char *auth_role_to_string(enum auth_role r);

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

/* The MAC that side `role` sends over the two nonces of one handshake. */
void auth_mac(const uint8_t key[static AUTH_KEY_BYTES], enum auth_role role,
              const uint8_t dialler_nonce[static AUTH_NONCE_BYTES],
              const uint8_t listener_nonce[static AUTH_NONCE_BYTES], uint8_t ret_mac[static AUTH_MAC_BYTES]);

/* Whether `mac` (of `len` bytes, as received) is what side `role` must
 * have sent; the comparison takes the same time wherever it differs. */
bool auth_verify(const uint8_t key[static AUTH_KEY_BYTES], enum auth_role role,
                 const uint8_t dialler_nonce[static AUTH_NONCE_BYTES],
                 const uint8_t listener_nonce[static AUTH_NONCE_BYTES], const uint8_t *mac, size_t len);

#endif
