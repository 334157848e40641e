/* The mesh's frames: a 4-byte big-endian length and a PeerMessage, in
 * clear for the handshake and sealed (auth.h) after it, written by
 * mesh_peer_send() and read by mesh_peer_read_cb(), which hands each
 * message to mesh_peer_handle() (mesh.c). See mesh.h. */
#include <errno.h>
#include <event2/buffer.h>
#include <event2/bufferevent.h>
#include <inttypes.h>
#include <sodium.h>
#include <stdlib.h>

#include "auth.h"
#include "log.h"
#include "mesh-internal.h"
#include "mesh.h"

/* ------------------------------------------------------------ sending */

/* Messages that travel in clear during the handshake. PeerWelcome is not
 * one: it is the acceptor's first sealed frame. */
bool mesh_is_clear_handshake(Moeep__V1__PeerMessage__BodyCase c) {
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
        if (mesh_is_clear_handshake(msg->body_case) ? p->sealed : !p->sealed)
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

void mesh_peer_read_cb(struct bufferevent *bev, void *arg) {
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
                        mesh_peer_handle(p, msg, false);
                moeep__v1__peer_message__free_unpacked(msg, NULL);
        }
}
