/* Record framing shared by moeepd and libmoeep.
 *
 * One record is one SOCK_SEQPACKET datagram: a fixed header followed by one
 * protobuf-encoded envelope (moeep.proto). File descriptors ride along as one
 * SCM_RIGHTS control message. The socket is local, so the header is in host
 * byte order. */
#ifndef MOEEP_RECORD_H
#define MOEEP_RECORD_H

#include <stddef.h>
#include <stdint.h>

#include <protobuf-c/protobuf-c.h>

#include "moeep.pb-c.h"

#define MOEEP_RECORD_MAGIC 0x5045454du /* "MEEP" read as little-endian bytes */
#define MOEEP_PROTOCOL_MAJOR 1
#define MOEEP_PROTOCOL_MINOR 4

/* Largest record (header + payload) either side sends or accepts. Anything
 * bulky travels as a memfd instead. */
#define MOEEP_RECORD_MAX 65536
/* Most descriptors one record may carry. A Regions reply carries at most
 * this many: MOEEP_MAX_RANKS (8) ranks of 8 regions fit, but
 * max_regions_per_session may be set up to 64, and a fetch that matches more
 * fails with -E2BIG (broker_fetch). */
#define MOEEP_RECORD_MAX_FDS 64
/* Room for what the kernel may attach to one message (SCM_MAX_FD): a
 * receiver with less room gets MSG_CTRUNC and the kernel closes the rest in
 * the receiver's own thread, where a socket with SO_LINGER or a FUSE file
 * would block it. Records carrying more than MOEEP_RECORD_MAX_FDS are
 * refused after receipt. */
#define MOEEP_RECORD_RECV_FDS 253

/* Ranges of record types: the field numbers of the envelopes' body cases. */
#define MOEEP_TYPE_REQUEST_MIN 1
#define MOEEP_TYPE_REQUEST_MAX 63
#define MOEEP_TYPE_RESPONSE_MIN 64
#define MOEEP_TYPE_RESPONSE_MAX 127
#define MOEEP_TYPE_EVENT_MIN 128
#define MOEEP_TYPE_EVENT_MAX 191

struct moeep_record_header {
        uint32_t magic;      /* MOEEP_RECORD_MAGIC */
        uint16_t major;      /* sender's protocol major; must equal the receiver's */
        uint16_t type;       /* body case of the envelope that follows (see above) */
        uint16_t nfds;       /* descriptors attached as SCM_RIGHTS; must match exactly */
        uint16_t reserved;   /* zero */
        uint32_t length;     /* payload bytes after the header */
        uint64_t request_id; /* chosen by the client, echoed in the response; 0 for events */
};
_Static_assert(sizeof(struct moeep_record_header) == 24, "header layout is part of the protocol");

/* A received record. Owns `fds` until moeep_record_release() or until the
 * caller takes them (set the slot to -1). */
struct moeep_record {
        struct moeep_record_header hdr;
        uint8_t *payload;               /* points into buf */
        int fds[MOEEP_RECORD_RECV_FDS]; /* -1 in slots taken by the caller */
        size_t nfds;
        /* After moeep_record_recv() refused the record (-EBADMSG,
         * -EPROTONOSUPPORT): the ErrorCode that names what was wrong, for a
         * receiver that answers with Error (ERROR_BAD_RECORD, ERROR_BAD_FDS,
         * ERROR_UNKNOWN_TYPE, ERROR_VERSION_MISMATCH); else ERROR_UNSPECIFIED. */
        Moeep__V1__ErrorCode error_code;
        uint8_t buf[MOEEP_RECORD_MAX];
};

/* How many descriptors a record type must carry, as messages.def declares
 * it: returns 0 for "none", 1 for "exactly one", -1 (MOEEP_FDS_MANY) for
 * "any number up to MOEEP_RECORD_MAX_FDS" (Regions: one per entry, checked
 * after decoding), MOEEP_FDS_ONE_OR_NONE for "one, or none when the message
 * says so" (RegionRegister: none with `take`, 1.4; the daemon checks which
 * after decoding). */
int moeep_record_fds_expected(uint16_t type);

/* Whether `type` names a message this protocol version knows (a row of
 * messages.def). */
int moeep_record_type_known(uint16_t type);

/* Encodes `msg` (a Request, Response or Event envelope) with type `type`
 * and sends it with `fds` attached. The descriptors stay owned by the
 * caller. Returns 0, -EAGAIN when a non-blocking socket is full, -EMSGSIZE
 * when the record would exceed MOEEP_RECORD_MAX, or another -errno. */
int moeep_record_send(int sock, uint16_t type, uint64_t request_id, const ProtobufCMessage *msg,
                      const int *fds, size_t nfds);

/* Encodes a record into `buf` (at least MOEEP_RECORD_MAX bytes) for sending
 * later; returns its length or -EMSGSIZE. */
int moeep_record_encode(uint8_t *buf, uint16_t type, uint64_t request_id, const ProtobufCMessage *msg,
                        size_t nfds);

/* Sends an already encoded record. Same returns as moeep_record_send(). */
int moeep_record_send_raw(int sock, const uint8_t *buf, size_t len, const int *fds, size_t nfds);

/* Receives one record. Descriptors are received with MSG_CMSG_CLOEXEC.
 * Returns 0 with `rec` filled, -EAGAIN when nothing is queued, -ECONNRESET on
 * end of file, -EBADMSG for a record that is malformed (short, truncated,
 * bad magic, length mismatch, descriptor count differing from the header or
 * from what the type allows), -EPROTONOSUPPORT for a major mismatch, or
 * another -errno. On any error every received descriptor is already closed.
 * `ret_why`, when not NULL, gets a static string naming what was wrong. */
int moeep_record_recv(int sock, struct moeep_record *rec, const char **ret_why);

/* Like moeep_record_recv(), but on every error the received descriptors
 * stay in rec->fds (rec->nfds of them, possibly more than the header says)
 * for the caller to close: moeepd closes what clients send off its event
 * loop. */
int moeep_record_recv_keep(int sock, struct moeep_record *rec, const char **ret_why);

/* Closes every descriptor the record still owns. Accepts NULL. */
void moeep_record_release(struct moeep_record *rec);

/* Most fields one message of a request may carry that the daemon does not
 * know (fields a newer minor added, rule 3 of proto/README.md). protobuf-c
 * keeps each unknown field in an allocation of its own, so that a 64 KiB
 * record of 16,000 tiny ones would cost the daemon a millisecond to decode;
 * more than this many are refused before anything is decoded. */
#define MOEEP_RECORD_UNKNOWN_MAX 64
/* How deep messages may nest in a request (Request, its body, TakeFd). */
#define MOEEP_RECORD_DEPTH_MAX 8

/* Checks the protobuf wire form of `len` bytes at `data`, a message of type
 * `desc`, without decoding or allocating anything: every tag, varint and
 * length well formed; no groups; in every message at most
 * MOEEP_RECORD_UNKNOWN_MAX fields its schema does not know, a field that is
 * not `repeated` at most once, and at most one member of each oneof;
 * messages nested at most MOEEP_RECORD_DEPTH_MAX deep. Its cost grows with
 * `len` alone. Returns 0, or -EBADMSG with *ret_why (static text; may be
 * NULL) naming what was wrong. */
int moeep_record_scan(const ProtobufCMessageDescriptor *desc, const uint8_t *data, size_t len,
                      const char **ret_why);

/* Decoders: check that the type is in the envelope's range and that the
 * decoded body case equals the header type. Return NULL on any mismatch;
 * free the result with the matching __free_unpacked(msg, NULL).
 * moeep_record_decode_request() decodes only what moeep_record_scan()
 * accepts: a request comes from a client the daemon does not trust. */
Moeep__V1__Request *moeep_record_decode_request(const struct moeep_record *rec);
Moeep__V1__Response *moeep_record_decode_response(const struct moeep_record *rec);
Moeep__V1__Event *moeep_record_decode_event(const struct moeep_record *rec);

#endif
