/* libFuzzer target: the node mesh's frame decoder and handshake
 * (daemon/mesh/mesh.c, daemon/mesh/auth.c), as a remote daemon or an attacker on the
 * mesh port would drive them.
 *
 * A real daemon object runs in-process with the mesh on 127.0.0.1 (port
 * chosen by the kernel), a cluster key, and one configured peer: the
 * harness, which listens at that peer's address. Its loop is pumped by the
 * harness. Byte 0 of an input picks what the rest is:
 *
 *   0  raw bytes written to a fresh connection to the mesh port;
 *   1  a PeerHello with fuzzed fields (major, mesh version, nonce, and the
 *      identity: the configured peer's, the daemon's own, or fuzzed), then
 *      a PeerProof that is either the right one (the harness holds the key)
 *      or fuzzed bytes, then raw bytes;
 *   2  a whole handshake as the configured peer, then fuzzed plaintexts
 *      each sealed correctly: the inner message decoder and every
 *      post-handshake handler;
 *   3  a whole handshake, then raw bytes: sealed frames that do not open,
 *      frames in clear, bad lengths;
 *   4  the daemon's own dial of its configured peer (when one is pending
 *      at the harness's listener; it redials every second): a
 *      PeerChallenge with fuzzed fields and a right or fuzzed proof, then
 *      raw bytes. Without a pending dial, as 0.
 *
 * Checked after every input: a whole handshake with the key and a
 * configured identity comes up; without the right proof no inbound peer is
 * ever up; once the harness closed its connections and the loop ran, no
 * inbound peer is left and the count of unauthenticated connections is 0. */
#include <arpa/inet.h>
#include <errno.h>
#include <event2/event.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <signal.h>
#include <sodium.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include "../tmpdir.h"
#include "daemon.h"
#include "fuzz.h"
#include "log.h"
#include "mesh/auth.h"
#include "mesh/mesh.h"
#include "moeep.pb-c.h"
#include "record.h"

static struct daemon d;
static char dir[64], conf_path[96], key_path[96], sock_path[96];
static uint8_t key[AUTH_KEY_BYTES];
static char id_self[JOB_NODE_MAX + 1], id_peer[JOB_NODE_MAX + 1];
static uint16_t mesh_port;
static int peer_listen = -1;

/* Up to `max` bytes of the input, as they are (length from one byte). */
static size_t take_bytes(struct input *in, size_t max, const uint8_t **ret) {
        return take_span(in, take8(in), max, ret);
}

static void pump(void) {
        for (int i = 0; i < 6; i++)
                event_base_loop(d.base, EVLOOP_NONBLOCK);
}

static void write_all(int fd, const uint8_t *b, size_t n) {
        while (n > 0) {
                ssize_t w = send(fd, b, n, MSG_NOSIGNAL | MSG_DONTWAIT);

                if (w <= 0) {
                        if (w < 0 && errno == EAGAIN) {
                                pump();
                                continue;
                        }
                        return;
                }
                b += w;
                n -= (size_t)w;
        }
}

static void send_msg(int fd, const Moeep__V1__PeerMessage *m) {
        static uint8_t buf[4 + 70000];
        size_t n = protobuf_c_message_get_packed_size(&m->base);

        if (n > sizeof(buf) - 4)
                return;
        buf[0] = (uint8_t)(n >> 24);
        buf[1] = (uint8_t)(n >> 16);
        buf[2] = (uint8_t)(n >> 8);
        buf[3] = (uint8_t)n;
        protobuf_c_message_pack(&m->base, buf + 4);
        write_all(fd, buf, 4 + n);
}

/* The next frame the daemon sent on `fd`, pumping the loop while it comes
 * (bounded), or NULL. */
static Moeep__V1__PeerMessage *recv_msg(int fd) {
        static uint8_t buf[4 + 70000];
        size_t have = 0, want = 4;

        for (int i = 0; i < 200 && have < want; i++) {
                ssize_t n = recv(fd, buf + have, want - have, MSG_DONTWAIT);

                if (n == 0)
                        return NULL;
                if (n < 0) {
                        if (errno != EAGAIN)
                                return NULL;
                        pump();
                        continue;
                }
                have += (size_t)n;
                if (have == 4 && want == 4) {
                        want = 4 +
                               ((size_t)buf[0] << 24 | (size_t)buf[1] << 16 | (size_t)buf[2] << 8 | buf[3]);
                        if (want > sizeof(buf))
                                return NULL;
                }
        }
        if (have < want)
                return NULL;
        return moeep__v1__peer_message__unpack(NULL, want - 4, buf + 4);
}

static int mesh_connect(void) {
        struct sockaddr_in sa = { .sin_family = AF_INET, .sin_port = htons(mesh_port) };
        int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0), one = 1, err = 0;
        socklen_t len = sizeof(err);

        inet_pton(AF_INET, "127.0.0.1", &sa.sin_addr);
        if (fd < 0)
                abort();
        /* Non-blocking, and waited for here with the loop pumped: a SYN that
         * meets a daemon-side TIME-WAIT of the same ports is retried by the
         * kernel a second later, and a blocking connect() then ends in
         * EINTR when libFuzzer's timer signal arrives. 10 s at most. */
        if (connect(fd, (struct sockaddr *)&sa, sizeof(sa)) < 0 && errno != EINPROGRESS) {
                fprintf(stderr, "fuzz-mesh: connect: %s\n", strerror(errno));
                abort();
        }
        for (int i = 0; i < 1000; i++) {
                struct pollfd p = { .fd = fd, .events = POLLOUT };

                pump();
                if (poll(&p, 1, 10) == 1)
                        break;
        }
        if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) < 0 || err != 0) {
                fprintf(stderr, "fuzz-mesh: connect: %s\n", strerror(err ? err : errno));
                abort();
        }
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
        /* Our close resets the connection: a run opens a hundred thousand of
         * them, and closes that leave TIME-WAIT behind (on either side, the
         * reset ends the daemon's too) ran the loopback out of ports. */
        setsockopt(fd, SOL_SOCKET, SO_LINGER, &(struct linger){ .l_onoff = 1, .l_linger = 0 },
                   sizeof(struct linger));
        pump();
        return fd;
}

static uint32_t inbound_up(void) {
        const struct mesh_peer *p;
        uint32_t n = 0;

        TAILQ_FOREACH (p, &d.mesh->peers, entry)
                n += !p->dead && !p->outbound && p->state == MESH_PEER_UP;
        return n;
}

static uint32_t inbound_live(void) {
        const struct mesh_peer *p;
        uint32_t n = 0;

        TAILQ_FOREACH (p, &d.mesh->peers, entry)
                n += !p->outbound;
        return n;
}

/* The key, configuration and socket live in a private directory that
 * goes with the process, and so does the admin socket's, beside it
 * (proto/admin-socket.h). */
static void cleanup(void) {
        char admin[sizeof(dir) + 32];

        unlink(key_path);
        unlink(conf_path);
        unlink(sock_path);
        rmdir(dir);
        snprintf(admin, sizeof(admin), "%s-admin/moeepd.sock", dir);
        unlink(admin);
        snprintf(admin, sizeof(admin), "%s-admin", dir);
        rmdir(admin);
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
        struct daemon_options o = { .log_level = "err" };
        struct sockaddr_in sa = { .sin_family = AF_INET };
        socklen_t len = sizeof(sa);
        char errmsg[ERRMSG_MAX];
        FILE *f;
        int fd;

        signal(SIGPIPE, SIG_IGN);
        test_tmp_path(dir, sizeof(dir), "moeep-fuzz-mesh.XXXXXX");
        if (!mkdtemp(dir))
                abort();
        atexit(cleanup);
        snprintf(key_path, sizeof(key_path), "%s/key", dir);
        snprintf(conf_path, sizeof(conf_path), "%s/moeepd.conf", dir);
        snprintf(sock_path, sizeof(sock_path), "%s/moeepd.sock", dir);
        fd = open(key_path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
        if (fd < 0 || write(fd, "moeep-fuzz-mesh-key-0123456789\n", 31) != 31)
                abort();
        close(fd);
        if (auth_init() < 0 || auth_key_load(key_path, key, errmsg) < 0)
                abort();
        /* The configured peer: the harness's listener. */
        peer_listen = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
        inet_pton(AF_INET, "127.0.0.1", &sa.sin_addr);
        if (peer_listen < 0 || bind(peer_listen, (struct sockaddr *)&sa, sizeof(sa)) < 0 ||
            listen(peer_listen, 8) < 0 || getsockname(peer_listen, (struct sockaddr *)&sa, &len) < 0)
                abort();
        snprintf(id_peer, sizeof(id_peer), "127.0.0.1:%u", (unsigned)ntohs(sa.sin_port));
        f = fopen(conf_path, "w");
        if (!f)
                abort();
        fprintf(f,
                "[moeepd]\nsocket = %s\nmesh_listen = 127.0.0.1:0\nmesh_peers = %s\ncluster_key_file = %s\n",
                sock_path, id_peer, key_path);
        fclose(f);
        o.config_path = conf_path;
        if (daemon_init(&d, &o) < 0 || !d.mesh)
                abort();
        snprintf(id_self, sizeof(id_self), "%s", mesh_address(d.mesh));
        mesh_port = (uint16_t)atoi(strrchr(id_self, ':') + 1);
        return 0;
}

/* A whole handshake as the configured peer; returns the fd (sealed frames
 * follow under `s`) or -1 when the daemon did not take it. */
static int handshake_ok(struct auth_session *s) {
        Moeep__V1__PeerMessage m = MOEEP__V1__PEER_MESSAGE__INIT, *r;
        Moeep__V1__PeerHello h = MOEEP__V1__PEER_HELLO__INIT;
        Moeep__V1__PeerProof pr = MOEEP__V1__PEER_PROOF__INIT;
        struct auth_transcript t = { 0 };
        uint8_t mac[AUTH_MAC_BYTES];
        int fd = mesh_connect();

        auth_nonce(t.nonce_dialler);
        h.major = MOEEP_PROTOCOL_MAJOR;
        h.minor = MOEEP_PROTOCOL_MINOR;
        h.mesh_version = AUTH_MESH_VERSION;
        h.nonce.data = t.nonce_dialler;
        h.nonce.len = AUTH_NONCE_BYTES;
        h.address = id_peer;
        m.body_case = MOEEP__V1__PEER_MESSAGE__BODY_HELLO;
        m.hello = &h;
        send_msg(fd, &m);
        r = recv_msg(fd);
        if (!r || r->body_case != MOEEP__V1__PEER_MESSAGE__BODY_CHALLENGE ||
            r->challenge->nonce.len != AUTH_NONCE_BYTES) {
                if (r)
                        moeep__v1__peer_message__free_unpacked(r, NULL);
                return fd;
        }
        memcpy(t.nonce_acceptor, r->challenge->nonce.data, AUTH_NONCE_BYTES);
        t.id_dialler = id_peer;
        t.id_acceptor = id_self;
        t.minor_dialler = MOEEP_PROTOCOL_MINOR;
        t.minor_acceptor = r->challenge->minor;
        moeep__v1__peer_message__free_unpacked(r, NULL);
        auth_session_derive(key, &t, AUTH_DIALLER, s);
        auth_proof(s, AUTH_DIALLER, mac);
        pr.mac.data = mac;
        pr.mac.len = sizeof(mac);
        m.body_case = MOEEP__V1__PEER_MESSAGE__BODY_PROOF;
        m.proof = &pr;
        send_msg(fd, &m);
        pump();
        r = recv_msg(fd); /* the sealed PeerWelcome */
        if (r) {
                static uint8_t plain[64];

                if (r->body_case == MOEEP__V1__PEER_MESSAGE__BODY_SEALED && r->sealed.len <= sizeof(plain))
                        auth_open(s, r->sealed.data, r->sealed.len, plain);
                moeep__v1__peer_message__free_unpacked(r, NULL);
        }
        return fd;
}

/* Mode 1: the acceptor's side of the handshake with fuzzed fields.
 * Returns the fd and whether the right proof was sent. */
static int fuzz_hello(struct input *in, bool *ret_proved) {
        Moeep__V1__PeerMessage m = MOEEP__V1__PEER_MESSAGE__INIT, *r;
        Moeep__V1__PeerHello h = MOEEP__V1__PEER_HELLO__INIT;
        Moeep__V1__PeerProof pr = MOEEP__V1__PEER_PROOF__INIT;
        struct auth_transcript t = { 0 };
        struct auth_session s;
        uint8_t flags = take8(in), mac[AUTH_MAC_BYTES], nonce[40] = { 0 };
        const uint8_t *b;
        char claim[JOB_NODE_MAX + 8];
        size_t n;
        int fd = mesh_connect();

        *ret_proved = false;
        h.major = flags & 1 ? take32(in) : MOEEP_PROTOCOL_MAJOR;
        h.minor = take8(in);
        h.mesh_version = flags & 2 ? take32(in) : AUTH_MESH_VERSION;
        n = flags & 4 ? take_bytes(in, sizeof(nonce), &b) : AUTH_NONCE_BYTES;
        if (flags & 4)
                memcpy(nonce, b, n);
        else
                randombytes_buf(nonce, n);
        h.nonce.data = nonce;
        h.nonce.len = n;
        switch ((flags >> 3) & 3) {
        case 0:
                snprintf(claim, sizeof(claim), "%s", id_peer);
                break;
        case 1:
                snprintf(claim, sizeof(claim), "%s", id_self);
                break;
        default:
                n = take_bytes(in, JOB_NODE_MAX + 4, &b);
                memcpy(claim, b, n);
                claim[n] = '\0';
                break;
        }
        h.address = claim;
        m.body_case = MOEEP__V1__PEER_MESSAGE__BODY_HELLO;
        m.hello = &h;
        send_msg(fd, &m);
        r = recv_msg(fd);
        if (r && r->body_case == MOEEP__V1__PEER_MESSAGE__BODY_CHALLENGE && h.nonce.len == AUTH_NONCE_BYTES &&
            r->challenge->nonce.len == AUTH_NONCE_BYTES && (flags & 0x20)) {
                /* The right proof, for the transcript as the daemon sees it. */
                memcpy(t.nonce_dialler, nonce, AUTH_NONCE_BYTES);
                memcpy(t.nonce_acceptor, r->challenge->nonce.data, AUTH_NONCE_BYTES);
                t.id_dialler = id_peer;
                t.id_acceptor = id_self;
                t.minor_dialler = h.minor;
                t.minor_acceptor = r->challenge->minor;
                auth_session_derive(key, &t, AUTH_DIALLER, &s);
                auth_proof(&s, AUTH_DIALLER, mac);
                auth_session_wipe(&s);
                pr.mac.data = mac;
                pr.mac.len = sizeof(mac);
                *ret_proved = true;
        } else {
                pr.mac.len = take_bytes(in, 40, (const uint8_t **)&pr.mac.data);
        }
        if (r)
                moeep__v1__peer_message__free_unpacked(r, NULL);
        m.body_case = MOEEP__V1__PEER_MESSAGE__BODY_PROOF;
        m.proof = &pr;
        send_msg(fd, &m);
        return fd;
}

/* Mode 4: the dialler's side, on the daemon's own dial if one waits. */
static int fuzz_challenge(struct input *in, bool *ret_proved) {
        Moeep__V1__PeerMessage m = MOEEP__V1__PEER_MESSAGE__INIT, *r;
        Moeep__V1__PeerChallenge ch = MOEEP__V1__PEER_CHALLENGE__INIT;
        struct auth_transcript t = { 0 };
        struct auth_session s;
        uint8_t flags = take8(in), mac[AUTH_MAC_BYTES], nonce[AUTH_NONCE_BYTES];
        const uint8_t *b;
        char said[JOB_NODE_MAX + 8];
        size_t n;
        int fd;

        *ret_proved = false;
        pump();
        fd = accept4(peer_listen, NULL, NULL, SOCK_CLOEXEC);
        if (fd < 0)
                return -1;
        r = recv_msg(fd);
        if (!r || r->body_case != MOEEP__V1__PEER_MESSAGE__BODY_HELLO ||
            r->hello->nonce.len != AUTH_NONCE_BYTES) {
                if (r)
                        moeep__v1__peer_message__free_unpacked(r, NULL);
                return fd;
        }
        randombytes_buf(nonce, sizeof(nonce));
        memcpy(t.nonce_dialler, r->hello->nonce.data, AUTH_NONCE_BYTES);
        memcpy(t.nonce_acceptor, nonce, AUTH_NONCE_BYTES);
        t.id_dialler = id_self;
        t.id_acceptor = id_peer;
        t.minor_dialler = r->hello->minor;
        t.minor_acceptor = take8(in);
        moeep__v1__peer_message__free_unpacked(r, NULL);
        ch.minor = t.minor_acceptor;
        ch.mesh_version = flags & 1 ? take32(in) : AUTH_MESH_VERSION;
        ch.nonce.data = nonce;
        ch.nonce.len = flags & 2 ? take_bytes(in, sizeof(nonce), &b) : AUTH_NONCE_BYTES;
        if (flags & 2)
                memcpy(nonce, b, ch.nonce.len);
        if (flags & 4) {
                n = take_bytes(in, JOB_NODE_MAX + 4, &b);
                memcpy(said, b, n);
                said[n] = '\0';
        } else {
                snprintf(said, sizeof(said), "%s", id_peer);
        }
        ch.address = said;
        if (flags & 8) {
                auth_session_derive(key, &t, AUTH_ACCEPTOR, &s);
                auth_proof(&s, AUTH_ACCEPTOR, mac);
                auth_session_wipe(&s);
                ch.mac.data = mac;
                ch.mac.len = sizeof(mac);
                *ret_proved = true;
        } else {
                ch.mac.len = take_bytes(in, 40, (const uint8_t **)&ch.mac.data);
        }
        m.body_case = MOEEP__V1__PEER_MESSAGE__BODY_CHALLENGE;
        m.challenge = &ch;
        send_msg(fd, &m);
        return fd;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
        struct input in = { data, size };
        struct auth_session s;
        bool proved = false;
        uint8_t mode = take8(&in) % 5;
        int fd = -1;

        memset(&s, 0, sizeof(s));
        switch (mode) {
        case 1:
                fd = fuzz_hello(&in, &proved);
                break;
        case 2:
        case 3:
                fd = handshake_ok(&s);
                proved = true;
                /* A key holder with a configured identity always gets in. */
                if (inbound_up() != 1) {
                        fprintf(stderr, "fuzz-mesh: the configured peer's handshake did not come up\n");
                        abort();
                }
                break;
        case 4:
                fd = fuzz_challenge(&in, &proved);
                break;
        }
        if (fd < 0)
                fd = mesh_connect();
        if (mode == 2) {
                /* Plaintexts sealed right: [length byte][bytes]... */
                static uint8_t box[256 + AUTH_SEAL_BYTES];

                for (int i = 0; i < 64 && in.left > 0; i++) {
                        Moeep__V1__PeerMessage outer = MOEEP__V1__PEER_MESSAGE__INIT;
                        const uint8_t *b;
                        size_t n = take_bytes(&in, 255, &b);

                        auth_seal(&s, b, n, box);
                        outer.body_case = MOEEP__V1__PEER_MESSAGE__BODY_SEALED;
                        outer.sealed.data = box;
                        outer.sealed.len = n + AUTH_SEAL_BYTES;
                        send_msg(fd, &outer);
                        pump();
                }
        }
        write_all(fd, in.p, in.left);
        pump();
        if (!proved && inbound_up() != 0) {
                fprintf(stderr, "fuzz-mesh: an inbound peer is up without the right proof\n");
                abort();
        }
        close(fd);
        auth_session_wipe(&s);
        for (int i = 0; i < 100 && inbound_live() > 0; i++)
                pump();
        if (inbound_live() != 0 || d.mesh->unauthenticated != 0) {
                fprintf(stderr, "fuzz-mesh: %u inbound peers, %u unauthenticated left after the input\n",
                        inbound_live(), d.mesh->unauthenticated);
                abort();
        }
        return 0;
}
