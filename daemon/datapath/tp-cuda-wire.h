/* tp-cuda's wire: the address blob that peer_new hands the mesh, and the
 * messages two daemons of one host exchange on the cuda backend's Unix
 * socket to pass each other the fds of registered GPU memory. Pure
 * encoding, decoding and checking, so that the unit tests (and fuzzers)
 * exercise them without CUDA; tp-cuda.c does the I/O.
 *
 * Trust: a blob arrives over the authenticated mesh (docs/protocol.md,
 * "Mesh"), so its sender is a daemon holding the cluster key; still every
 * field is checked, so that a blob cannot make this daemon dial a socket
 * that is not another cuda backend's. Messages arrive on an abstract Unix
 * socket that anyone in the network namespace may connect to: until a
 * connection proved it holds a token that this daemon put in one of its
 * blobs (tpc_token_find), it may send nothing but HELLO. */
#ifndef MOEEPD_TP_CUDA_WIRE_H
#define MOEEPD_TP_CUDA_WIRE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define TPC_TOKEN_BYTES 32
/* The abstract socket's name (without the leading NUL): this prefix, the
 * daemon's pid and 16 random hex digits. */
#define TPC_NAME_PREFIX "moeep-tp-cuda-"
#define TPC_NAME_MAX 64

/* The address blob (tp_ops.peer_new), little-endian host order (both ends
 * are on one host). */
struct tpc_blob {
        uint32_t magic;   /* TPC_BLOB_MAGIC */
        uint16_t version; /* TPC_BLOB_VERSION */
        uint16_t name_len;
        uint32_t pid; /* the daemon that listens on `name`: checked with SO_PEERCRED on connect */
        uint32_t uid; /* its uid: the same */
        uint8_t token[TPC_TOKEN_BYTES]; /* what a connection must present in HELLO; one connection each */
        char name[TPC_NAME_MAX];        /* name_len bytes, not NUL-terminated on the wire */
};
#define TPC_BLOB_MAGIC 0x75637470u /* "ptcu" */
#define TPC_BLOB_VERSION 1
#define TPC_BLOB_BYTES sizeof(struct tpc_blob)

/* Writes `b` into `out` (TPC_BLOB_BYTES); returns the length. */
size_t tpc_blob_encode(const struct tpc_blob *b, void *out);

/* Reads a peer's blob: -EINVAL with `why` (a static string) for a wrong
 * length, magic or version, a name that is not TPC_NAME_PREFIX followed by
 * digits, '-' and lowercase hex, or a token of zeros. ret->name is
 * NUL-terminated. */
int tpc_blob_decode(const void *in, size_t len, struct tpc_blob *ret, const char **ret_why);

/* Fills name/name_len: TPC_NAME_PREFIX, pid, '-', 16 hex digits of `nonce`. */
void tpc_name_make(struct tpc_blob *b, uint32_t pid, uint64_t nonce);

enum tpc_msg_type {
        TPC_MSG_HELLO = 1,   /* client -> server: token; answered WELCOME */
        TPC_MSG_WELCOME = 2, /* server -> client: status 0 or -EACCES (then the server closes) */
        TPC_MSG_FETCH = 3,   /* client -> server: key; answered REGION */
        TPC_MSG_REGION = 4,  /* server -> client: key, status, kind, length; one fd when status is 0 */
        TPC_MSG_REVOKE = 5,  /* server -> client: key was deregistered: drop what was imported of it */
};
const char *tpc_msg_type_to_string(enum tpc_msg_type t);

/* tpc_msg.kind of a REGION: what the fd is. */
enum tpc_region_kind {
        TPC_REGION_CUMEM = 1, /* a cuMem POSIX fd: import it (cuMemImportFromShareableHandle) */
        TPC_REGION_MEMFD = 2, /* a memfd: map it and register it with CUDA (host memory) */
};

/* One message: one SOCK_SEQPACKET record of exactly TPC_MSG_BYTES. */
struct tpc_msg {
        uint32_t magic; /* TPC_MSG_MAGIC */
        uint16_t type;  /* enum tpc_msg_type */
        uint16_t reserved;
        int32_t status;                 /* REGION, WELCOME: 0 or -errno; others 0 */
        uint32_t kind;                  /* REGION: enum tpc_region_kind; others 0 */
        uint64_t key;                   /* FETCH, REGION, REVOKE */
        uint64_t length;                /* REGION: bytes of the region */
        uint8_t token[TPC_TOKEN_BYTES]; /* HELLO; zeros in every other message */
};
#define TPC_MSG_MAGIC 0x6d637470u /* "ptcm" */
#define TPC_MSG_BYTES sizeof(struct tpc_msg)

/* Checks a received record of `len` bytes that came with `nfds` fds:
 * 0, or -EINVAL with `why` (static) for a wrong size or magic, an unknown
 * type, a type the receiver does not take (`from_server`: REGION, WELCOME,
 * REVOKE; else HELLO, FETCH), non-zero reserved fields or token outside
 * HELLO, a REGION of an unknown kind or empty, or a number of fds other
 * than one for a REGION with status 0 and zero for everything else. */
int tpc_msg_check(const void *buf, size_t len, size_t nfds, bool from_server, struct tpc_msg *ret,
                  const char **ret_why);

/* The tokens a server handed out: tokens[i] belongs to transport peer i;
 * used[i] once a connection presented it. Returns the index of `token`
 * when it matches an unused one (comparing every entry in constant time
 * per entry), -EACCES when none does, -EALREADY when it matches a used
 * one. An all-zero token never matches. */
int tpc_token_find(const uint8_t (*tokens)[TPC_TOKEN_BYTES], const bool *used, size_t n,
                   const uint8_t token[TPC_TOKEN_BYTES]);

#endif
