/* The wire side of moeep-mesh-attack (mesh-attack.c): sockets with bounded
 * reads, mesh frames packed, sealed, sent and received, and the pieces of
 * the peer handshake (Hello, proof, ping and pong). Included by
 * mesh-attack.c only; test code. */
#ifndef MOEEP_MESH_ATTACK_WIRE_H
#define MOEEP_MESH_ATTACK_WIRE_H

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <signal.h>
#include <sodium.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "log.h"
#include "mesh/auth.h"
#include "moeep.h"
#include "moeep.pb-c.h"
#include "record.h"

#define FRAME_MAX (65536 + 64)

static uint64_t now_ms(void) {
        struct timespec ts;

        clock_gettime(CLOCK_MONOTONIC, &ts);
        return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

static void sleep_ms(long ms) {
        struct timespec ts = { .tv_sec = ms / 1000, .tv_nsec = (ms % 1000) * 1000000 };

        nanosleep(&ts, NULL);
}

#define die(...)                                              \
        do {                                                  \
                fprintf(stderr, "mesh-attack: " __VA_ARGS__); \
                fputc('\n', stderr);                          \
                exit(1);                                      \
        } while (0)

/* ------------------------------------------------------------ sockets */

static int tcp_connect(uint16_t port, const char *source) {
        struct sockaddr_in sa = { .sin_family = AF_INET, .sin_port = htons(port) };
        int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0), one = 1;

        if (fd < 0)
                return -errno;
        if (source) {
                struct sockaddr_in src = { .sin_family = AF_INET };

                inet_pton(AF_INET, source, &src.sin_addr);
                if (bind(fd, (struct sockaddr *)&src, sizeof(src)) < 0) {
                        int e = -errno;

                        close(fd);
                        return e;
                }
        }
        inet_pton(AF_INET, "127.0.0.1", &sa.sin_addr);
        if (connect(fd, (struct sockaddr *)&sa, sizeof(sa)) < 0) {
                int e = -errno;

                close(fd);
                return e;
        }
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
        return fd;
}

/* Reads exactly `len` bytes within `deadline` (now_ms()). 0, -ETIMEDOUT,
 * or -EPIPE when the connection ended (EOF or reset). */
static int read_full(int fd, uint8_t *buf, size_t len, uint64_t deadline) {
        size_t got = 0;

        while (got < len) {
                struct pollfd pfd = { .fd = fd, .events = POLLIN };
                uint64_t now = now_ms();
                ssize_t n;

                if (now >= deadline)
                        return -ETIMEDOUT;
                if (poll(&pfd, 1, (int)(deadline - now)) <= 0)
                        continue;
                n = read(fd, buf + got, len - got);
                if (n <= 0)
                        return n < 0 && errno == EINTR ? 0 : -EPIPE;
                got += (size_t)n;
        }
        return 0;
}

static int write_full(int fd, const uint8_t *buf, size_t len) {
        while (len > 0) {
                ssize_t n = send(fd, buf, len, MSG_NOSIGNAL);

                if (n < 0 && errno == EINTR)
                        continue;
                if (n <= 0)
                        return -EPIPE;
                buf += n;
                len -= (size_t)n;
        }
        return 0;
}

/* One frame as it goes on the wire: the 4-byte length and the body. */
struct frame {
        uint8_t bytes[4 + FRAME_MAX];
        size_t len; /* of `bytes`, header included */
};

static void frame_pack(struct frame *f, const Moeep__V1__PeerMessage *msg) {
        size_t n = protobuf_c_message_get_packed_size(&msg->base);

        if (n > FRAME_MAX)
                die("frame of %zu bytes", n);
        f->bytes[0] = (uint8_t)(n >> 24);
        f->bytes[1] = (uint8_t)(n >> 16);
        f->bytes[2] = (uint8_t)(n >> 8);
        f->bytes[3] = (uint8_t)n;
        protobuf_c_message_pack(&msg->base, f->bytes + 4);
        f->len = 4 + n;
}

/* Seals `msg` under `s` into frame `f`. */
static void frame_seal(struct frame *f, struct auth_session *s, const Moeep__V1__PeerMessage *msg) {
        Moeep__V1__PeerMessage outer = MOEEP__V1__PEER_MESSAGE__INIT;
        static uint8_t plain[FRAME_MAX], box[FRAME_MAX + AUTH_SEAL_BYTES];
        size_t n = protobuf_c_message_get_packed_size(&msg->base);

        protobuf_c_message_pack(&msg->base, plain);
        if (auth_seal(s, plain, n, box) < 0)
                die("seal");
        outer.body_case = MOEEP__V1__PEER_MESSAGE__BODY_SEALED;
        outer.sealed.data = box;
        outer.sealed.len = n + AUTH_SEAL_BYTES;
        frame_pack(f, &outer);
}

static int frame_send(int fd, const struct frame *f) {
        return write_full(fd, f->bytes, f->len);
}

/* Receives one frame within `ms`: 0 and *ret (free with
 * moeep__v1__peer_message__free_unpacked), -ETIMEDOUT, -EPIPE (closed), or
 * -EBADMSG. The raw frame goes to `raw` when not NULL. */
static int frame_recv(int fd, int ms, Moeep__V1__PeerMessage **ret, struct frame *raw) {
        static struct frame f;
        uint64_t deadline = now_ms() + (uint64_t)ms;
        uint32_t n;
        int r;

        r = read_full(fd, f.bytes, 4, deadline);
        if (r < 0)
                return r;
        n = (uint32_t)f.bytes[0] << 24 | (uint32_t)f.bytes[1] << 16 | (uint32_t)f.bytes[2] << 8 | f.bytes[3];
        if (n > FRAME_MAX)
                return -EBADMSG;
        r = read_full(fd, f.bytes + 4, n, deadline);
        if (r < 0)
                return r;
        f.len = 4 + n;
        if (raw)
                *raw = f;
        *ret = moeep__v1__peer_message__unpack(NULL, n, f.bytes + 4);
        return *ret ? 0 : -EBADMSG;
}

/* The daemon must end the connection within `ms`: it may say PeerRefused
 * first, but nothing sealed and no other message. Returns 0, or -1 with
 * the reason on stderr. */
static int expect_refused(int fd, int ms, const char *what) {
        uint64_t deadline = now_ms() + (uint64_t)ms;

        for (int i = 0; i < 8; i++) {
                Moeep__V1__PeerMessage *m;
                uint64_t now = now_ms();
                int r = frame_recv(fd, now < deadline ? (int)(deadline - now) : 0, &m, NULL);

                if (r == -EPIPE) {
                        printf("refused: %s\n", what);
                        return 0;
                }
                if (r < 0) {
                        fprintf(stderr, "%s: the connection stayed open (%s)\n", what, strerror(-r));
                        return -1;
                }
                if (m->body_case != MOEEP__V1__PEER_MESSAGE__BODY_REFUSED) {
                        fprintf(stderr, "%s: the daemon answered with message %d instead of refusing\n", what,
                                (int)m->body_case);
                        moeep__v1__peer_message__free_unpacked(m, NULL);
                        return -1;
                }
                printf("PeerRefused (%s): %s\n", what, m->refused->reason);
                moeep__v1__peer_message__free_unpacked(m, NULL);
        }
        fprintf(stderr, "%s: too many frames\n", what);
        return -1;
}

/* ------------------------------------------------------------ handshake pieces */

static void hello_pack(struct frame *f, const uint8_t nonce[AUTH_NONCE_BYTES], const char *id) {
        Moeep__V1__PeerHello h = MOEEP__V1__PEER_HELLO__INIT;
        Moeep__V1__PeerMessage m = MOEEP__V1__PEER_MESSAGE__INIT;

        h.major = MOEEP_PROTOCOL_MAJOR;
        h.minor = MOEEP_PROTOCOL_MINOR;
        h.mesh_version = AUTH_MESH_VERSION;
        h.nonce.data = (uint8_t *)nonce;
        h.nonce.len = AUTH_NONCE_BYTES;
        h.address = (char *)id;
        m.body_case = MOEEP__V1__PEER_MESSAGE__BODY_HELLO;
        m.hello = &h;
        frame_pack(f, &m);
}

static void proof_pack(struct frame *f, const uint8_t *mac, size_t len) {
        Moeep__V1__PeerProof p = MOEEP__V1__PEER_PROOF__INIT;
        Moeep__V1__PeerMessage m = MOEEP__V1__PEER_MESSAGE__INIT;

        p.mac.data = (uint8_t *)mac;
        p.mac.len = len;
        m.body_case = MOEEP__V1__PEER_MESSAGE__BODY_PROOF;
        m.proof = &p;
        frame_pack(f, &m);
}

static void ping_msg(Moeep__V1__PeerMessage *m, Moeep__V1__PeerPing *ping, uint64_t seq) {
        moeep__v1__peer_ping__init(ping);
        moeep__v1__peer_message__init(m);
        ping->seq = seq;
        ping->sent_ns = seq;
        m->body_case = MOEEP__V1__PEER_MESSAGE__BODY_PING;
        m->ping = ping;
}

/* A key holder's whole handshake with the acceptor on PORT, as dialler
 * `id_d` to `id_a`: fills `s` and returns the fd, or dies. The frames it
 * sent are copied to `ret_hello` / `ret_proof` when not NULL. */
static int handshake(uint16_t port, const uint8_t key[AUTH_KEY_BYTES], const char *id_d, const char *id_a,
                     struct auth_session *s, struct frame *ret_hello, struct frame *ret_proof) {
        struct auth_transcript t = { 0 };
        Moeep__V1__PeerMessage *m;
        struct frame f;
        uint8_t mac[AUTH_MAC_BYTES], plain[64];
        int fd = tcp_connect(port, NULL), r;

        if (fd < 0)
                die("connect to %u: %s", port, strerror(-fd));
        auth_nonce(t.nonce_dialler);
        hello_pack(&f, t.nonce_dialler, id_d);
        if (ret_hello)
                *ret_hello = f;
        frame_send(fd, &f);
        r = frame_recv(fd, 2000, &m, NULL);
        if (r < 0 || m->body_case != MOEEP__V1__PEER_MESSAGE__BODY_CHALLENGE)
                die("handshake as %s: no PeerChallenge (%s, message %d%s%s)", id_d, strerror(-r),
                    r < 0 ? -1 : (int)m->body_case,
                    r == 0 && m->body_case == MOEEP__V1__PEER_MESSAGE__BODY_REFUSED ? ": " : "",
                    r == 0 && m->body_case == MOEEP__V1__PEER_MESSAGE__BODY_REFUSED ? m->refused->reason
                                                                                    : "");
        memcpy(t.nonce_acceptor, m->challenge->nonce.data, AUTH_NONCE_BYTES);
        t.id_dialler = id_d;
        t.id_acceptor = id_a;
        t.minor_dialler = MOEEP_PROTOCOL_MINOR;
        t.minor_acceptor = m->challenge->minor;
        if (auth_session_derive(key, &t, AUTH_DIALLER, s) < 0 ||
            !auth_proof_verify(s, AUTH_ACCEPTOR, m->challenge->mac.data, m->challenge->mac.len))
                die("handshake: the acceptor's proof does not verify with the key");
        moeep__v1__peer_message__free_unpacked(m, NULL);
        auth_proof(s, AUTH_DIALLER, mac);
        proof_pack(&f, mac, sizeof(mac));
        if (ret_proof)
                *ret_proof = f;
        frame_send(fd, &f);
        r = frame_recv(fd, 2000, &m, NULL);
        if (r < 0 || m->body_case != MOEEP__V1__PEER_MESSAGE__BODY_SEALED || m->sealed.len > sizeof(plain) ||
            auth_open(s, m->sealed.data, m->sealed.len, plain) < 0)
                die("handshake as %s: no sealed PeerWelcome", id_d);
        moeep__v1__peer_message__free_unpacked(m, NULL);
        auth_session_done(s);
        return fd;
}

/* Waits for the sealed PeerPong of `seq` on a key holder's connection,
 * skipping the daemon's own PeerPings. Returns 0, or -1. */
static int expect_pong(int fd, struct auth_session *s, uint64_t seq) {
        static uint8_t plain[FRAME_MAX];

        for (int i = 0; i < 8; i++) {
                Moeep__V1__PeerMessage *m, *inner;
                int r = frame_recv(fd, 2000, &m, NULL);
                bool ok;

                if (r < 0 || m->body_case != MOEEP__V1__PEER_MESSAGE__BODY_SEALED ||
                    m->sealed.len < AUTH_SEAL_BYTES ||
                    auth_open(s, m->sealed.data, m->sealed.len, plain) < 0) {
                        if (r == 0)
                                moeep__v1__peer_message__free_unpacked(m, NULL);
                        return -1;
                }
                inner = moeep__v1__peer_message__unpack(NULL, m->sealed.len - AUTH_SEAL_BYTES, plain);
                moeep__v1__peer_message__free_unpacked(m, NULL);
                if (!inner)
                        return -1;
                ok = inner->body_case == MOEEP__V1__PEER_MESSAGE__BODY_PONG && inner->pong->seq == seq;
                moeep__v1__peer_message__free_unpacked(inner, NULL);
                if (ok)
                        return 0;
        }
        return -1;
}

#endif
