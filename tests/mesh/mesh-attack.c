/* Attacks on moeepd's node mesh (daemon/mesh/mesh.c, daemon/mesh/auth.c), for
 * attack.sh and home.sh. Each command attacks a real daemon on 127.0.0.1 and exits 0
 * only when the daemon refused the attack as it must; what it saw goes to
 * stdout, one line per step, and the reason for a failure to stderr.
 *
 *   mesh-attack [--uid UID] COMMAND ARGS...
 *
 * --uid: the command runs in a forked child that first drops to UID (and
 * its gid, no supplementary groups): the attacker is an unprivileged local
 * user. Commands:
 *
 *   reflect PORT_A ID_A ID_B PORT_B
 *       Without the key: listens on PORT_B (the port of a peer ID_B that A
 *       is configured to dial and that is down), takes A's dial, opens a
 *       second connection to A and relays A's own nonces and proofs back
 *       to A in every arrangement (as A itself, as B, the challenge
 *       reflected with and without its address rewritten, A's acceptor
 *       proof sent back as a dialler proof). Every connection must be
 *       refused and none may bring a sealed frame.
 *   replay KEYFILE PORT_A ID_A ID_B
 *       With the key, plays peer ID_B (configured at A, not running) and
 *       records a handshake and a sealed PeerPing; then without the key
 *       (a child at uid 65534) replays the recorded handshake: refused.
 *       Then, as an attacker on the path would, injects into fresh
 *       sessions the recorded frame, a frame twice, two frames reordered,
 *       a frame of a concurrent connection, a frame in clear, a PeerHello
 *       sealed and a sealed frame sealed again: each connection must end
 *       without an answer to the bad frame.
 *   flood PORT_A FIRST_SOURCE NSOURCES SECONDS
 *       Opens connections to A's mesh port from 127.0.0.FIRST_SOURCE ..
 *       + NSOURCES-1, 32 per source (96 when alone: more than the
 *       daemon's 64 slots), reopening each as A closes it (up to
 *       5,000 a second), for SECONDS; they send nothing, or half a
 *       PeerHello.
 *   peer KEYFILE PORT_A ID_A ID_B TRIES MAX_MS
 *       With the key, connects to A as ID_B TRIES times: each handshake
 *       must be done (sealed PeerWelcome) within MAX_MS.
 *   forge SOCKET MODE COUNT ARG
 *       Joins at the daemon on SOCKET with COUNT forged unique ids whose
 *       home address is, by MODE: "distinct" 127.0.X.Y:ARG (all
 *       different), "spellings" other spellings of 127.0.0.1:ARG, "self"
 *       spellings of the daemon's own address 127.0.0.1:ARG (a job id that
 *       does not exist: the daemon must answer as for a local job),
 *       "selfjob" a real job created here, its id respelled with this
 *       daemon's address in another spelling: the join must succeed
 *       locally; "peer" spellings of a configured peer 127.0.0.1:ARG that
 *       is up, a job id it does not have: the join must be forwarded to
 *       it and come back refused by it. Each refused join must fail fast
 *       with an error naming the address.
 *   probe SOCKET SECONDS MAX_MS
 *       A well-behaved client: connects, creates a job of one rank, joins,
 *       leaves, every 50 ms for SECONDS; each step must be answered within
 *       MAX_MS.
 *   mirrors KEYFILE PORT_A ID_A ID_B SOCKET CAP JOBS CHECK
 *       With the key, plays home daemon ID_B (configured at A, not
 *       running): CAP + 1 sessions at A (SOCKET) join jobs of ID_B with
 *       forged unique ids, each answered as joined by the home. A must
 *       hold CAP mirrors (its max_mirrors_per_peer), refuse the next join
 *       (-EUSERS naming the cap) and send the home PeerLeave of it; this
 *       uid must meanwhile create JOBS jobs of its own at A (its
 *       max_jobs_per_uid: mirrors are nobody's); the shell command CHECK
 *       (may be empty) runs while all of it is held.
 *   unread KEYFILE PORT_A ID_A ID_B SOCKET SECONDS
 *       With the key, plays home daemon ID_B: a rank at A joins a job of
 *       it and waits in a barrier; then the home stops reading and sends
 *       PeerPings (a PeerPong every 200 ms, so that it never looks silent)
 *       for up to SECONDS. A must end the connection (its answers pile up
 *       unread), and the rank's barrier must end with -ENOTCONN, the abort
 *       word set and PeerLost of rank 0.
 *   flap KEYFILE PORT_A ID_A ID_B COUNT
 *       With the key, connects to A as ID_B and fails, COUNT times: each
 *       time it takes A's PeerTransport, answers with A's own address (one
 *       A's transport takes), waits for the PeerPong of a PeerPing sent
 *       after it (so A connected its transport peer) and closes. A
 *       connection A ends before its PeerTransport (no transport peer for
 *       ID_B while its last ones drain) is retried 10 ms later, COUNT such
 *       at most.
 *
 * Every loop is bounded in count and time. */
/* The wire side of moeep-mesh-attack (mesh-attack.c): sockets with bounded
 * reads, mesh frames packed, sealed, sent and received, and the pieces of
 * the peer handshake (Hello, proof, ping and pong). */
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

#include "clients/uids.h" /* UID_JOINS_BURST */
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

/* Receives one frame within `ms` on a key holder's connection and opens
 * it under `s`: 0 and *ret (free with moeep__v1__peer_message__free_unpacked),
 * -ETIMEDOUT, -EPIPE (closed), or -EBADMSG (not sealed, or it does not open
 * as the next frame under `s`). */
static int sealed_recv(int fd, struct auth_session *s, int ms, Moeep__V1__PeerMessage **ret) {
        static uint8_t plain[FRAME_MAX];
        Moeep__V1__PeerMessage *m;
        int r = frame_recv(fd, ms, &m, NULL);

        if (r < 0)
                return r;
        if (m->body_case != MOEEP__V1__PEER_MESSAGE__BODY_SEALED || m->sealed.len < AUTH_SEAL_BYTES ||
            m->sealed.len - AUTH_SEAL_BYTES > sizeof(plain) ||
            auth_open(s, m->sealed.data, m->sealed.len, plain) < 0) {
                moeep__v1__peer_message__free_unpacked(m, NULL);
                return -EBADMSG;
        }
        *ret = moeep__v1__peer_message__unpack(NULL, m->sealed.len - AUTH_SEAL_BYTES, plain);
        moeep__v1__peer_message__free_unpacked(m, NULL);
        return *ret ? 0 : -EBADMSG;
}

/* Waits for the sealed PeerPong of `seq` on a key holder's connection,
 * skipping the daemon's own PeerPings. Returns 0, or -1. */
static int expect_pong(int fd, struct auth_session *s, uint64_t seq) {
        for (int i = 0; i < 8; i++) {
                Moeep__V1__PeerMessage *inner;
                bool ok;

                if (sealed_recv(fd, s, 2000, &inner) < 0)
                        return -1;
                ok = inner->body_case == MOEEP__V1__PEER_MESSAGE__BODY_PONG && inner->pong->seq == seq;
                moeep__v1__peer_message__free_unpacked(inner, NULL);
                if (ok)
                        return 0;
        }
        return -1;
}

/* ------------------------------------------------------------ reflect */

static int listen_on(uint16_t port) {
        struct sockaddr_in sa = { .sin_family = AF_INET, .sin_port = htons(port) };
        int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0), one = 1;

        inet_pton(AF_INET, "127.0.0.1", &sa.sin_addr);
        setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
        if (fd < 0 || bind(fd, (struct sockaddr *)&sa, sizeof(sa)) < 0 || listen(fd, 8) < 0)
                die("listen on 127.0.0.1:%u: %s", port, strerror(errno));
        return fd;
}

/* Takes A's next dial on `lfd` (within 3 s) and reads its PeerHello. */
static int take_dial(int lfd, Moeep__V1__PeerMessage **ret_hello) {
        struct pollfd pfd = { .fd = lfd, .events = POLLIN };
        int fd;

        if (poll(&pfd, 1, 3000) <= 0)
                die("A did not dial its configured peer within 3 s");
        fd = accept4(lfd, NULL, NULL, SOCK_CLOEXEC);
        if (fd < 0 || frame_recv(fd, 2000, ret_hello, NULL) < 0 ||
            (*ret_hello)->body_case != MOEEP__V1__PEER_MESSAGE__BODY_HELLO)
                die("no PeerHello from A's dial");
        return fd;
}

static int cmd_reflect(uint16_t port_a, const char *id_a, const char *id_b, uint16_t port_b) {
        int lfd = listen_on(port_b), bad = 0;

        for (int variant = 0; variant < 4; variant++) {
                Moeep__V1__PeerMessage *dial_hello, *ch = NULL;
                struct frame f;
                int c1 = take_dial(lfd, &dial_hello), c2 = tcp_connect(port_a, NULL), r;
                /* A's own nonce, under A's identity (variant 0) or B's. */
                const char *as = variant == 0 ? id_a : id_b;

                if (c2 < 0)
                        die("connect to A: %s", strerror(-c2));
                hello_pack(&f, dial_hello->hello->nonce.data, as);
                frame_send(c2, &f);
                if (variant == 0) {
                        bad |= expect_refused(c2, 2000,
                                              "A's own PeerHello reflected to A under A's identity");
                        bad |= expect_refused(c1, 2000, "A's dial, left waiting");
                        goto next;
                }
                r = frame_recv(c2, 2000, &ch, NULL);
                if (r < 0 || ch->body_case != MOEEP__V1__PEER_MESSAGE__BODY_CHALLENGE) {
                        fprintf(stderr, "A did not challenge a dialler claiming to be %s\n", id_b);
                        bad = 1;
                        goto next;
                }
                printf("A challenged the second connection (claiming %s)\n", id_b);
                if (variant == 1 || variant == 2) {
                        /* A's challenge (nonce and acceptor proof) relayed
                         * to A's own dial; variant 2 rewrites the address
                         * to the one A dialled. */
                        char *said = ch->challenge->address;

                        if (variant == 2)
                                ch->challenge->address = (char *)id_b;
                        frame_pack(&f, ch);
                        ch->challenge->address = said; /* freed with `ch` */
                        frame_send(c1, &f);
                        bad |= expect_refused(c1, 2000,
                                              variant == 1
                                                      ? "A's challenge reflected to A's dial"
                                                      : "A's challenge reflected, its address rewritten");
                        bad |= expect_refused(c2, 2000, "the second connection, never proved");
                } else {
                        /* A's acceptor proof sent back as a dialler proof. */
                        proof_pack(&f, ch->challenge->mac.data, ch->challenge->mac.len);
                        frame_send(c2, &f);
                        bad |= expect_refused(c2, 2000, "A's acceptor proof reflected as a dialler proof");
                        bad |= expect_refused(c1, 2000, "A's dial, left waiting");
                }
next:
                if (ch)
                        moeep__v1__peer_message__free_unpacked(ch, NULL);
                moeep__v1__peer_message__free_unpacked(dial_hello, NULL);
                close(c1);
                close(c2);
        }
        close(lfd);
        return bad;
}

/* ------------------------------------------------------------ replay */

static int drop_to(uid_t uid);

static int cmd_replay(const char *keyfile, uint16_t port_a, const char *id_a, const char *id_b) {
        uint8_t key[AUTH_KEY_BYTES];
        char errmsg[ERRMSG_MAX];
        struct auth_session s1, s2, s3;
        Moeep__V1__PeerMessage ping;
        Moeep__V1__PeerPing pp;
        static struct frame hello, proof, rec_ping, f0, f1;
        int fd, fd2, bad = 0;
        pid_t pid;

        if (auth_init() < 0 || auth_key_load(keyfile, key, errmsg) < 0)
                die("%s", errmsg);
        /* Session 1, recorded: handshake, a PeerPing answered. */
        fd = handshake(port_a, key, id_b, id_a, &s1, &hello, &proof);
        ping_msg(&ping, &pp, 11);
        frame_seal(&rec_ping, &s1, &ping);
        frame_send(fd, &rec_ping);
        if (expect_pong(fd, &s1, 11) < 0)
                die("session 1: no sealed PeerPong: the tool or the daemon is wrong");
        printf("session 1 up as %s: PeerPing 11 answered\n", id_b);
        close(fd);

        /* The recorded handshake replayed by someone without the key. */
        fflush(stdout);
        pid = fork();
        if (pid == 0) {
                Moeep__V1__PeerMessage *m;

                sodium_memzero(key, sizeof(key));
                if (drop_to(65534) < 0)
                        _exit(2);
                fd = tcp_connect(port_a, NULL);
                if (fd < 0 || frame_send(fd, &hello) < 0 || frame_recv(fd, 2000, &m, NULL) < 0)
                        _exit(3);
                moeep__v1__peer_message__free_unpacked(m, NULL);
                frame_send(fd, &proof);
                _exit(expect_refused(fd, 2000, "recorded handshake replayed (uid 65534)") ? 1 : 0);
        }
        bad |= pid < 0 || waitpid(pid, &fd, 0) != pid || !WIFEXITED(fd) || WEXITSTATUS(fd) != 0;
        fflush(stdout);

        /* Session 2: the frame recorded in session 1 injected. */
        fd = handshake(port_a, key, id_b, id_a, &s2, NULL, NULL);
        frame_send(fd, &rec_ping);
        bad |= expect_refused(fd, 2000, "a sealed frame of an earlier session injected");
        close(fd);

        /* Session 3: a frame answered, then the same bytes again. */
        fd = handshake(port_a, key, id_b, id_a, &s3, NULL, NULL);
        ping_msg(&ping, &pp, 12);
        frame_seal(&f0, &s3, &ping);
        frame_send(fd, &f0);
        if (expect_pong(fd, &s3, 12) < 0) {
                fprintf(stderr, "session 3: PeerPing 12 not answered\n");
                bad = 1;
        }
        frame_send(fd, &f0);
        bad |= expect_refused(fd, 2000, "a sealed frame replayed on its own connection");
        close(fd);

        /* Session 4: two frames in the wrong order. */
        fd = handshake(port_a, key, id_b, id_a, &s3, NULL, NULL);
        ping_msg(&ping, &pp, 13);
        frame_seal(&f0, &s3, &ping);
        ping_msg(&ping, &pp, 14);
        frame_seal(&f1, &s3, &ping);
        frame_send(fd, &f1);
        bad |= expect_refused(fd, 2000, "sealed frames reordered");
        close(fd);

        /* Sessions 5 and 6 at once, both as B: A keeps the first and
         * drops the second as a duplicate, but its keys were made; a frame
         * sealed for the second is spliced into the first. */
        fd = handshake(port_a, key, id_b, id_a, &s2, NULL, NULL);
        fd2 = handshake(port_a, key, id_b, id_a, &s3, NULL, NULL);
        ping_msg(&ping, &pp, 15);
        frame_seal(&f0, &s3, &ping);
        frame_send(fd, &f0);
        bad |= expect_refused(fd, 2000, "a sealed frame of a concurrent connection spliced in");
        close(fd2);
        close(fd);

        /* Session 7: a message in clear after the handshake. */
        fd = handshake(port_a, key, id_b, id_a, &s3, NULL, NULL);
        ping_msg(&ping, &pp, 16);
        frame_pack(&f0, &ping);
        frame_send(fd, &f0);
        bad |= expect_refused(fd, 2000, "a PeerPing in clear after the handshake");
        close(fd);

        /* Session 8: a handshake message inside a sealed frame. */
        fd = handshake(port_a, key, id_b, id_a, &s3, NULL, NULL);
        {
                Moeep__V1__PeerMessage h = MOEEP__V1__PEER_MESSAGE__INIT;
                Moeep__V1__PeerHello again = MOEEP__V1__PEER_HELLO__INIT;

                again.major = MOEEP_PROTOCOL_MAJOR;
                again.address = (char *)id_b;
                h.body_case = MOEEP__V1__PEER_MESSAGE__BODY_HELLO;
                h.hello = &again;
                frame_seal(&f0, &s3, &h);
        }
        frame_send(fd, &f0);
        bad |= expect_refused(fd, 2000, "a PeerHello inside a sealed frame");
        close(fd);

        /* Session 9: a sealed frame inside a sealed frame. */
        fd = handshake(port_a, key, id_b, id_a, &s3, NULL, NULL);
        {
                Moeep__V1__PeerMessage nested = MOEEP__V1__PEER_MESSAGE__INIT;
                uint8_t junk[32] = { 0 };

                /* Whatever it holds, it must be refused unopened. */
                nested.body_case = MOEEP__V1__PEER_MESSAGE__BODY_SEALED;
                nested.sealed.data = junk;
                nested.sealed.len = sizeof(junk);
                frame_seal(&f0, &s3, &nested);
        }
        frame_send(fd, &f0);
        bad |= expect_refused(fd, 2000, "a sealed frame inside a sealed frame");
        close(fd);
        auth_session_wipe(&s1);
        auth_session_wipe(&s2);
        auth_session_wipe(&s3);
        sodium_memzero(key, sizeof(key));
        return bad;
}

/* ------------------------------------------------------------ flood */

/* A non-blocking connection to 127.0.0.1:port from `source`, or -1. */
static int flood_connect(uint16_t port, const char *source) {
        struct sockaddr_in sa = { .sin_family = AF_INET, .sin_port = htons(port) };
        struct sockaddr_in src = { .sin_family = AF_INET };
        int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);

        if (fd < 0)
                return -1;
        inet_pton(AF_INET, "127.0.0.1", &sa.sin_addr);
        inet_pton(AF_INET, source, &src.sin_addr);
        if (bind(fd, (struct sockaddr *)&src, sizeof(src)) < 0 ||
            (connect(fd, (struct sockaddr *)&sa, sizeof(sa)) < 0 && errno != EINPROGRESS)) {
                close(fd);
                return -1;
        }
        return fd;
}

static int cmd_flood(uint16_t port_a, int first, int nsources, int seconds) {
        enum {
                PER_SOURCE = 32,
                MAX = 24 * PER_SOURCE,
                OPENS_MAX = 2000000,
                RATE_MAX = 5000
        };
        static struct pollfd pfd[MAX];
        static bool said[MAX];
        /* One source alone opens more than every slot. */
        int per_source = nsources == 1 ? 3 * PER_SOURCE : PER_SOURCE, n = nsources * per_source;
        uint64_t start = now_ms(), end = start + (uint64_t)seconds * 1000u, opened = 0, closed = 0;
        struct frame half;
        uint8_t nonce[AUTH_NONCE_BYTES] = { 0 };

        if (nsources < 1 || n > MAX || first < 2 || first + nsources > 255 || seconds < 1 || seconds > 60)
                die("flood: 1..24 sources from 127.0.0.2, 1..60 s");
        hello_pack(&half, nonce, "127.0.0.1:1");
        for (int i = 0; i < n; i++)
                pfd[i].fd = -1;
        while (now_ms() < end && opened < OPENS_MAX) {
                for (int i = 0; i < n; i++) {
                        char src[32];

                        if (pfd[i].fd >= 0)
                                continue;
                        snprintf(src, sizeof(src), "127.0.0.%d", first + i / per_source);
                        pfd[i].fd = flood_connect(port_a, src);
                        pfd[i].events = POLLIN | POLLOUT;
                        said[i] = false;
                        opened += pfd[i].fd >= 0;
                }
                /* At most RATE_MAX connections a second: plenty to keep
                 * every slot taken (64 slots, 1 s each), without turning
                 * the test into a measure of the machine's CPU. */
                while (opened > (now_ms() - start) * RATE_MAX / 1000u + n && now_ms() < end)
                        sleep_ms(1);
                if (poll(pfd, (nfds_t)n, 5) <= 0)
                        continue;
                for (int i = 0; i < n; i++) {
                        uint8_t b[256];

                        if (pfd[i].fd < 0 || !pfd[i].revents)
                                continue;
                        if ((pfd[i].revents & POLLOUT) && !said[i]) {
                                /* Connected: every other one sends half a
                                 * PeerHello, then nothing. */
                                said[i] = true;
                                pfd[i].events = POLLIN;
                                if (i % 2 && send(pfd[i].fd, half.bytes, half.len / 2, MSG_NOSIGNAL) < 0)
                                        pfd[i].revents |= POLLHUP;
                        }
                        if ((pfd[i].revents & (POLLHUP | POLLERR)) ||
                            ((pfd[i].revents & POLLIN) && read(pfd[i].fd, b, sizeof(b)) <= 0)) {
                                close(pfd[i].fd);
                                pfd[i].fd = -1;
                                closed++;
                        }
                }
        }
        for (int i = 0; i < n; i++)
                if (pfd[i].fd >= 0)
                        close(pfd[i].fd);
        printf("flood: %llu connections opened from %d sources, %llu closed by the daemon\n",
               (unsigned long long)opened, nsources, (unsigned long long)closed);
        return 0;
}

/* ------------------------------------------------------------ peer */

/* A key holder connects as `id_b` `tries` times, 200 ms apart: each
 * handshake (connect to sealed PeerWelcome) must take at most `max_ms`. */
static int cmd_peer(const char *keyfile, uint16_t port_a, const char *id_a, const char *id_b, int tries,
                    int max_ms) {
        uint8_t key[AUTH_KEY_BYTES];
        char errmsg[ERRMSG_MAX];
        uint64_t worst = 0;

        if (auth_key_load(keyfile, key, errmsg) < 0)
                die("%s", errmsg);
        for (int i = 0; i < tries && i < 100; i++) {
                struct auth_session s;
                uint64_t t0 = now_ms(), t;
                int fd = handshake(port_a, key, id_b, id_a, &s, NULL, NULL);

                t = now_ms() - t0;
                worst = t > worst ? t : worst;
                close(fd);
                auth_session_wipe(&s);
                sleep_ms(200);
        }
        sodium_memzero(key, sizeof(key));
        printf("peer: %d handshakes as %s, slowest %llu ms\n", tries, id_b, (unsigned long long)worst);
        if (worst > (uint64_t)max_ms) {
                fprintf(stderr, "a key holder's handshake took %llu ms (at most %d)\n",
                        (unsigned long long)worst, max_ms);
                return 1;
        }
        return 0;
}

/* ------------------------------------------------------------ flap */

/* One round of `flap` on a connection that is up: 0, or -1 when A ended
 * it (or said nothing of its transport) first. */
static int flap_once(int fd, struct auth_session *s, uint64_t seq) {
        Moeep__V1__PeerMessage *m = NULL, out = MOEEP__V1__PEER_MESSAGE__INIT;
        Moeep__V1__PeerTransport pt = MOEEP__V1__PEER_TRANSPORT__INIT;
        Moeep__V1__PeerPing ping;
        static struct frame f;
        int r;

        for (int i = 0; i < 16; i++) {
                if (sealed_recv(fd, s, 2000, &m) < 0)
                        return -1;
                if (m->body_case == MOEEP__V1__PEER_MESSAGE__BODY_TRANSPORT)
                        break;
                moeep__v1__peer_message__free_unpacked(m, NULL);
                m = NULL;
        }
        if (!m)
                return -1;
        pt.backend = m->transport->backend;
        pt.address = m->transport->address;
        out.body_case = MOEEP__V1__PEER_MESSAGE__BODY_TRANSPORT;
        out.transport = &pt;
        frame_seal(&f, s, &out);
        r = frame_send(fd, &f);
        moeep__v1__peer_message__free_unpacked(m, NULL);
        ping_msg(&out, &ping, seq);
        frame_seal(&f, s, &out);
        if (r < 0 || frame_send(fd, &f) < 0)
                return -1;
        return expect_pong(fd, s, seq);
}

static int cmd_flap(const char *keyfile, uint16_t port_a, const char *id_a, const char *id_b, int count) {
        uint8_t key[AUTH_KEY_BYTES];
        char errmsg[ERRMSG_MAX];
        uint64_t t0 = now_ms();
        int done = 0, ended = 0;

        if (auth_key_load(keyfile, key, errmsg) < 0)
                die("%s", errmsg);
        while (done < count) {
                struct auth_session s;
                int fd = handshake(port_a, key, id_b, id_a, &s, NULL, NULL), r;

                r = flap_once(fd, &s, (uint64_t)done + 1);
                close(fd);
                auth_session_wipe(&s);
                if (r == 0) {
                        done++;
                } else if (++ended > count) {
                        die("flap: %d connections ended before A's PeerTransport", ended);
                } else {
                        sleep_ms(10);
                }
        }
        sodium_memzero(key, sizeof(key));
        printf("flap: %d connections as %s took a transport peer and failed (%d more ended before one and "
               "were "
               "retried) in %.1f s\n",
               count, id_b, ended, (double)(now_ms() - t0) / 1000.0);
        return 0;
}

/* ------------------------------------------------------------ forge */

/* A unique id of job `job_id` with a random secret, naming `home`. */
static void forge_id(struct moeep_unique_id *id, uint64_t job_id, const char *home) {
        size_t n = strlen(home);

        memset(id, 0, sizeof(*id));
        id->bytes[0] = 1; /* JOB_UNIQUE_ID_VERSION */
        for (int i = 0; i < 8; i++)
                id->bytes[1 + i] = (uint8_t)(job_id >> (8 * i));
        randombytes_buf(id->bytes + 9, 32);
        id->bytes[41] = (uint8_t)n;
        memcpy(id->bytes + 42, home, n);
}

/* JobJoin, waited for while the forgeries before have spent this uid's
 * allowance of wrong joins: its joins are refused unchecked (-EUSERS)
 * until the allowance grows back, at 8 a second (at most 2 s here). */
static int join_patiently(struct moeep_client *c, const struct moeep_unique_id *id, uint32_t rank,
                          uint32_t world) {
        int r = -EUSERS;

        for (int i = 0; i < 40 && r == -EUSERS; i++) {
                r = moeep_job_join(c, id, rank, world, NULL);
                if (r == -EUSERS)
                        usleep(50 * 1000);
        }
        return r;
}

static int cmd_forge(const char *sock, const char *mode, int count, const char *arg) {
        struct moeep_client *c;
        uint64_t worst = 0;
        int bad = 0, unchecked = 0, r;

        if (count < 1 || count > 5000)
                die("forge: 1..5000 ids");
        r = moeep_connect(sock, &c);
        if (r < 0)
                die("connect to %s: %s", sock, strerror(-r));
        if (strcmp(mode, "selfjob") == 0) {
                struct moeep_unique_id id;
                struct moeep_client *c1;
                uint32_t local = 0, remote = 0;
                char home[80];

                /* rank 0 here, then rank 1 through the id respelled */
                if (moeep_job_create(c, "respelled", 2, &id) < 0 || join_patiently(c, &id, 0, 2) < 0)
                        die("selfjob: create/join rank 0: %s", moeep_client_error(c));
                snprintf(home, sizeof(home), "%s", arg);
                id.bytes[41] = (uint8_t)strlen(home);
                memset(id.bytes + 42, 0, sizeof(id.bytes) - 42);
                memcpy(id.bytes + 42, home, strlen(home));
                if (moeep_connect(sock, &c1) < 0)
                        die("selfjob: second client");
                r = join_patiently(c1, &id, 1, 2);
                if (r < 0) {
                        fprintf(stderr, "selfjob: join through '%s' failed: %s\n", home,
                                moeep_client_error(c1));
                        bad = 1;
                } else if (moeep_job_ranks(c1, &local, &remote) < 0 || local != 0x3 || remote != 0) {
                        fprintf(stderr, "selfjob: ranks local 0x%x remote 0x%x, want 0x3 and 0\n", local,
                                remote);
                        bad = 1;
                } else {
                        printf("selfjob: rank 1 joined through '%s' locally (local 0x%x, remote 0x%x)\n",
                               home, local, remote);
                }
                moeep_client_free(c1);
                moeep_client_free(c);
                return bad;
        }
        for (int i = 0; i < count && !bad; i++) {
                struct moeep_unique_id id;
                char home[80], want[80];
                uint64_t t0;
                bool self = strcmp(mode, "self") == 0, peer = strcmp(mode, "peer") == 0;
                int spelling = i % 6, zeros = i / 6 % 40 + 1;

                if (strcmp(mode, "distinct") == 0) {
                        snprintf(home, sizeof(home), "127.0.%d.%d:%s", 1 + i / 250, 1 + i % 250, arg);
                } else {
                        /* The same socket address, spelled many ways. */
                        switch (spelling) {
                        case 0:
                                snprintf(home, sizeof(home), "127.0.0.1:%0*d", zeros + (int)strlen(arg),
                                         atoi(arg));
                                break;
                        case 1:
                                snprintf(home, sizeof(home), "localhost:%0*d", zeros + (int)strlen(arg),
                                         atoi(arg));
                                break;
                        case 2:
                                snprintf(home, sizeof(home), "[::ffff:127.0.0.1]:%0*d",
                                         zeros % 20 + 1 + (int)strlen(arg), atoi(arg));
                                break;
                        case 3:
                                snprintf(home, sizeof(home), "[::FFFF:7f00:%d]:%s", 1, arg);
                                break;
                        case 4:
                                snprintf(home, sizeof(home), "%0*d", zeros + (int)strlen(arg), atoi(arg));
                                break;
                        default:
                                snprintf(home, sizeof(home), "[0:0:0:0:0:ffff:127.0.0.1]:%s", arg);
                                break;
                        }
                }
                forge_id(&id, self || peer ? 999999 : (uint64_t)i + 1, home);
                t0 = now_ms();
                r = moeep_job_join(c, &id, 0, 2, NULL);
                if (now_ms() - t0 > worst)
                        worst = now_ms() - t0;
                if (peer) /* forwarded to the peer, which answers */
                        snprintf(want, sizeof(want), "at daemon 127.0.0.1:%s: job 999999: no live job", arg);
                else
                        snprintf(want, sizeof(want), "%s", self ? "no live job" : home);
                if (r == -EUSERS && strstr(moeep_client_error(c), "was not checked") &&
                    i >= UID_JOINS_BURST) {
                        /* The uid's allowance of wrong joins is spent: refused
                         * unchecked, which dials nothing either. */
                        unchecked++;
                        continue;
                }
                if (r >= 0) {
                        fprintf(stderr, "forged id naming '%s' joined\n", home);
                        bad = 1;
                } else if (!strstr(moeep_client_error(c), want) ||
                           (self && strstr(moeep_client_error(c), "mesh"))) {
                        fprintf(stderr, "forged id naming '%s': error %d '%s' does not name '%s'\n", home, r,
                                moeep_client_error(c), want);
                        bad = 1;
                } else if (i < 3 || i == count - 1) {
                        printf("forged id naming '%s': %s\n", home, moeep_client_error(c));
                }
        }
        printf("forge %s: %d ids refused (%d unchecked: the uid's allowance of wrong joins was spent), "
               "slowest answer %llu ms\n",
               mode, count, unchecked, (unsigned long long)worst);
        if (worst > 100) {
                fprintf(stderr, "a refused join took %llu ms\n", (unsigned long long)worst);
                bad = 1;
        }
        moeep_client_free(c);
        return bad;
}

/* ------------------------------------------------------------ probe */

static int cmd_probe(const char *sock, int seconds, int max_ms) {
        uint64_t end = now_ms() + (uint64_t)seconds * 1000u, worst = 0;
        int rounds = 0;

        while (now_ms() < end && rounds < 10000) {
                struct moeep_client *c;
                struct moeep_unique_id id;
                uint64_t t0 = now_ms(), t;
                int r;

                r = moeep_connect(sock, &c);
                if (r < 0)
                        die("probe: connect: %s", strerror(-r));
                t = now_ms() - t0;
                worst = t > worst ? t : worst;
                t0 = now_ms();
                if (moeep_job_create(c, "probe", 1, &id) < 0)
                        die("probe: create: %s", moeep_client_error(c));
                t = now_ms() - t0;
                worst = t > worst ? t : worst;
                t0 = now_ms();
                if (moeep_job_join(c, &id, 0, 1, NULL) < 0)
                        die("probe: join: %s", moeep_client_error(c));
                t = now_ms() - t0;
                worst = t > worst ? t : worst;
                moeep_job_leave(c);
                moeep_client_free(c);
                rounds++;
                if (worst > (uint64_t)max_ms)
                        die("probe: a request took %llu ms (at most %d)", (unsigned long long)worst, max_ms);
                sleep_ms(50);
        }
        printf("probe: %d rounds, slowest answer %llu ms\n", rounds, (unsigned long long)worst);
        return 0;
}

/* ------------------------------------------------------------ home */

/* A key holder playing home daemon ID_B for A's ranks: its connection to
 * A, its keys, and what A sent it. */
struct home {
        int fd;
        struct auth_session s;
        uint32_t joins;    /* PeerJoin answered */
        uint32_t leaves;   /* PeerLeave seen */
        uint64_t left_job; /* the job of the last one */
        uint32_t barriers; /* PeerBarrier seen */
        int child_status;  /* of the client process, once it exited */
};

static int home_send(struct home *h, const Moeep__V1__PeerMessage *msg) {
        static struct frame f;

        frame_seal(&f, &h->s, msg);
        return frame_send(h->fd, &f);
}

/* Answers one message of A as a home would: PeerPing with PeerPong,
 * PeerJoin with PeerJoined (the job id the unique id names, which the
 * client forged); counts PeerLeave and PeerBarrier; the rest (PeerRegion,
 * PeerRankLost) needs no answer here. */
static void home_answer(struct home *h, const Moeep__V1__PeerMessage *m) {
        Moeep__V1__PeerMessage out = MOEEP__V1__PEER_MESSAGE__INIT;

        if (m->body_case == MOEEP__V1__PEER_MESSAGE__BODY_PING) {
                Moeep__V1__PeerPong pong = MOEEP__V1__PEER_PONG__INIT;

                pong.seq = m->ping->seq;
                pong.sent_ns = m->ping->sent_ns;
                out.body_case = MOEEP__V1__PEER_MESSAGE__BODY_PONG;
                out.pong = &pong;
                home_send(h, &out);
        } else if (m->body_case == MOEEP__V1__PEER_MESSAGE__BODY_JOIN) {
                Moeep__V1__PeerJoined joined = MOEEP__V1__PEER_JOINED__INIT;

                joined.token = m->join->token;
                for (int i = 0; i < 8 && m->join->unique_id.len > 9; i++)
                        joined.job_id |= (uint64_t)m->join->unique_id.data[1 + i] << (8 * i);
                joined.name = (char *)"home-test";
                joined.world_size = m->join->world_size;
                out.body_case = MOEEP__V1__PEER_MESSAGE__BODY_JOINED;
                out.joined = &joined;
                home_send(h, &out);
                h->joins++;
        } else if (m->body_case == MOEEP__V1__PEER_MESSAGE__BODY_LEAVE) {
                h->leaves++;
                h->left_job = m->leave->job_id;
        } else if (m->body_case == MOEEP__V1__PEER_MESSAGE__BODY_BARRIER) {
                h->barriers++;
        }
}

/* Serves A until the client process `child` exited (then for another
 * 200 ms, for what A sent on its way out) or, when `barriers` is not 0,
 * until that many PeerBarrier came. 0, -ETIMEDOUT at `deadline`, -EPIPE
 * when A closed, -EBADMSG. */
static int home_serve(struct home *h, uint64_t deadline, pid_t child, uint32_t barriers) {
        uint64_t drain_until = 0;

        while (now_ms() < deadline && (!drain_until || now_ms() < drain_until)) {
                struct pollfd pfd = { .fd = h->fd, .events = POLLIN };
                Moeep__V1__PeerMessage *m;
                int r;

                if (!drain_until && waitpid(child, &h->child_status, WNOHANG) == child)
                        drain_until = now_ms() + 200;
                if (barriers && h->barriers >= barriers)
                        return 0;
                if (poll(&pfd, 1, 20) <= 0)
                        continue;
                r = sealed_recv(h->fd, &h->s, 2000, &m); /* a frame that began comes whole */
                if (r < 0)
                        return r;
                home_answer(h, m);
                moeep__v1__peer_message__free_unpacked(m, NULL);
        }
        return drain_until ? 0 : -ETIMEDOUT;
}

/* Connects to A as home `id_b` with the key in `keyfile` and forks the
 * client process: returns its pid in the parent (which serves A on
 * h->fd) and 0 in the child (which has no part in the connection). */
static pid_t home_start(struct home *h, const char *keyfile, uint16_t port_a, const char *id_a,
                        const char *id_b) {
        uint8_t key[AUTH_KEY_BYTES];
        char errmsg[ERRMSG_MAX];
        pid_t pid;

        if (auth_key_load(keyfile, key, errmsg) < 0)
                die("%s", errmsg);
        h->fd = handshake(port_a, key, id_b, id_a, &h->s, NULL, NULL);
        sodium_memzero(key, sizeof(key));
        fflush(stdout);
        pid = fork();
        if (pid < 0)
                die("fork: %s", strerror(errno));
        if (pid == 0) {
                close(h->fd);
                auth_session_wipe(&h->s);
        }
        return pid;
}

/* Waits up to `ms` for `child`; kills it past that. Returns its exit
 * status, or -1 when it had to be killed or did not exit normally. */
static int child_wait(pid_t child, int ms) {
        uint64_t deadline = now_ms() + (uint64_t)ms;
        int status;

        while (waitpid(child, &status, WNOHANG) != child) {
                if (now_ms() >= deadline) {
                        kill(child, SIGKILL);
                        waitpid(child, &status, 0);
                        return -1;
                }
                sleep_ms(10);
        }
        return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

/* The first job id of the `mirrors` command's forged unique ids. */
#define MIRRORS_JOB0 1000

/* The client side of `mirrors`, in its own process: `cap` + 1 sessions
 * join rank 1 of 2 of jobs MIRRORS_JOB0.. at home `id_b`. */
static int mirrors_client(const char *sock, const char *id_b, int cap, int jobs, const char *check) {
        struct moeep_client *c[65], *own;
        struct moeep_unique_id id;
        char refusal[256] = "";
        int r;

        for (int i = 0; i <= cap; i++) {
                r = moeep_connect(sock, &c[i]);
                if (r < 0)
                        die("mirrors: connect %d: %s", i, strerror(-r));
                forge_id(&id, MIRRORS_JOB0 + (uint64_t)i, id_b);
                r = moeep_job_join(c[i], &id, 1, 2, NULL);
                if (i < cap && r < 0)
                        die("mirrors: join %d of %d (under max_mirrors_per_peer) refused: %s", i + 1, cap,
                            moeep_client_error(c[i]));
                if (i == cap && (r != -EUSERS || !strstr(moeep_client_error(c[i]), "max_mirrors_per_peer")))
                        die("mirrors: join %d (past max_mirrors_per_peer = %d): %d '%s', want -EUSERS naming "
                            "the cap",
                            i + 1, cap, r, r < 0 ? moeep_client_error(c[i]) : "joined");
                if (i == cap)
                        snprintf(refusal, sizeof(refusal), "%s", moeep_client_error(c[i]));
        }
        printf("mirrors: A holds %d mirrors of jobs of %s; join %d refused: %s\n", cap, id_b, cap + 1,
               refusal);
        /* Mirrors count against no uid: this uid's own jobs, up to its cap. */
        r = moeep_connect(sock, &own);
        if (r < 0)
                die("mirrors: connect: %s", strerror(-r));
        for (int i = 0; i < jobs; i++) {
                char name[32];

                snprintf(name, sizeof(name), "own-%d", i);
                if (moeep_job_create(own, name, 1, &id) < 0)
                        die("mirrors: uid %u's job %d of %d (max_jobs_per_uid) with %d mirrors at A: %s",
                            (unsigned)getuid(), i + 1, jobs, cap, moeep_client_error(own));
        }
        printf("mirrors: uid %u created %d jobs of its own (its max_jobs_per_uid) meanwhile\n",
               (unsigned)getuid(), jobs);
        fflush(stdout);
        if (check && system(check) != 0)
                die("mirrors: '%s' failed", check);
        for (int i = 0; i <= cap; i++)
                moeep_client_free(c[i]);
        moeep_client_free(own);
        return 0;
}

/* As home `id_b`, lets ranks at A (SOCKET) join `cap` + 1 jobs: A must hold
 * `cap` mirrors (its max_mirrors_per_peer), refuse the next join naming
 * the cap and tell the home (PeerLeave); the test's uid must meanwhile
 * create `jobs` jobs (its max_jobs_per_uid) at A; `check` (a shell
 * command, may be empty) runs while all of that is held. */
static int cmd_mirrors(const char *keyfile, uint16_t port_a, const char *id_a, const char *id_b,
                       const char *sock, int cap, int jobs, const char *check) {
        struct home h = { 0 };
        pid_t pid;
        int r;

        if (cap < 1 || cap > 64 || jobs < 1 || jobs > 64)
                die("mirrors: 1..64 mirrors and jobs");
        pid = home_start(&h, keyfile, port_a, id_a, id_b);
        if (pid == 0)
                _exit(mirrors_client(sock, id_b, cap, jobs, check[0] ? check : NULL));
        r = home_serve(&h, now_ms() + 30000, pid, 0);
        if (r < 0) {
                child_wait(pid, 0);
                die("mirrors: serving A: %s", strerror(-r));
        }
        close(h.fd);
        auth_session_wipe(&h.s);
        if (!WIFEXITED(h.child_status) || WEXITSTATUS(h.child_status) != 0)
                return 1;
        if (h.joins != (uint32_t)cap + 1 || h.leaves != 1 || h.left_job != MIRRORS_JOB0 + (uint64_t)cap) {
                fprintf(stderr,
                        "mirrors: A forwarded %u joins (want %d) and sent %u PeerLeave (want 1, of job %llu; "
                        "the last named job %llu)\n",
                        h.joins, cap + 1, h.leaves, (unsigned long long)(MIRRORS_JOB0 + cap),
                        (unsigned long long)h.left_job);
                return 1;
        }
        printf("mirrors: the home answered %u joins and got PeerLeave of the refused job %llu\n", h.joins,
               (unsigned long long)h.left_job);
        return 0;
}

/* The client side of `unread`: rank 1 of 2 of a job of home `id_b`, in a
 * barrier that only the loss of the home can end. */
static int unread_client(const char *sock, const char *id_b, int seconds) {
        const volatile struct moeep_control_page *page;
        struct moeep_unique_id id;
        struct moeep_client *c;
        struct moeep_event ev;
        int r;

        alarm((unsigned)seconds + 20);
        r = moeep_connect(sock, &c);
        if (r < 0)
                die("unread: connect: %s", strerror(-r));
        forge_id(&id, 77, id_b);
        if (moeep_job_join(c, &id, 1, 2, NULL) < 0)
                die("unread: join: %s", moeep_client_error(c));
        r = moeep_job_barrier(c);
        if (r != -ENOTCONN)
                die("unread: barrier: %d '%s', want -ENOTCONN (the home lost)", r, moeep_client_error(c));
        page = moeep_job_control_page(c);
        if (!page || page->abort != 1 || !(page->lost_ranks & 1u))
                die("unread: control page: abort %u lost_ranks 0x%x, want 1 and rank 0",
                    page ? page->abort : 0, page ? page->lost_ranks : 0);
        r = moeep_event_next(c, &ev);
        if (r != 1 || ev.type != MOEEP_EVENT_PEER_LOST || ev.rank != 0)
                die("unread: want a PeerLost event of rank 0: r=%d rank %d", r, r == 1 ? ev.rank : -1);
        printf("unread: the barrier ended with -ENOTCONN (%s), abort word set, PeerLost rank 0 (%s)\n",
               moeep_client_error(c), ev.reason);
        moeep_client_free(c);
        return 0;
}

/* Sends A PeerPings (and a PeerPong every 200 ms, so that A never finds
 * it silent) for up to `seconds`, reading nothing. Returns the bytes sent;
 * *ret_closed says whether A ended the connection. */
static uint64_t home_flood(struct home *h, int seconds, bool *ret_closed) {
        static uint8_t buf[1 << 16];
        static struct frame f;
        uint64_t end = now_ms() + (uint64_t)seconds * 1000u, last_pong = 0, sent = 0, seq = 0;
        size_t len = 0, off = 0;

        *ret_closed = false;
        while (now_ms() < end) {
                struct pollfd pfd = { .fd = h->fd, .events = POLLOUT };
                ssize_t n;

                if (off == len) /* sent: seal the next buffer full */
                        len = off = 0;
                while (len + 256 < sizeof(buf) && off == 0) {
                        Moeep__V1__PeerMessage m;
                        Moeep__V1__PeerPing ping;
                        Moeep__V1__PeerPong pong = MOEEP__V1__PEER_PONG__INIT;

                        ping_msg(&m, &ping, ++seq);
                        if (now_ms() - last_pong >= 200) {
                                last_pong = now_ms();
                                m.body_case = MOEEP__V1__PEER_MESSAGE__BODY_PONG;
                                m.pong = &pong;
                        }
                        frame_seal(&f, &h->s, &m);
                        memcpy(buf + len, f.bytes, f.len);
                        len += f.len;
                }
                n = send(h->fd, buf + off, len - off, MSG_NOSIGNAL | MSG_DONTWAIT);
                if (n > 0) {
                        sent += (uint64_t)n;
                        off += (size_t)n;
                        continue;
                }
                if (n < 0 && (errno == EAGAIN || errno == EINTR)) {
                        poll(&pfd, 1, 100);
                        continue;
                }
                *ret_closed = true; /* reset or closed by A */
                break;
        }
        return sent;
}

/* As home `id_b`: a rank at A (SOCKET) joins a job of it and waits in a
 * barrier; then the home stops reading and floods A for up to `seconds`.
 * A must fail the connection (its answers pile up), and the rank's barrier
 * must end with the home lost. */
static int cmd_unread(const char *keyfile, uint16_t port_a, const char *id_a, const char *id_b,
                      const char *sock, int seconds) {
        struct home h = { 0 };
        uint64_t t0, sent;
        bool closed;
        pid_t pid;
        int r;

        if (seconds < 1 || seconds > 60)
                die("unread: 1..60 s");
        pid = home_start(&h, keyfile, port_a, id_a, id_b);
        if (pid == 0)
                _exit(unread_client(sock, id_b, seconds));
        r = home_serve(&h, now_ms() + 10000, pid, 1);
        if (r < 0 || h.barriers != 1) {
                child_wait(pid, 0);
                die("unread: no PeerBarrier from A (%s)", r < 0 ? strerror(-r) : "the client exited");
        }
        printf("unread: the rank joined and waits in a barrier; the home stops reading\n");
        t0 = now_ms();
        sent = home_flood(&h, seconds, &closed);
        printf("unread: %llu bytes sent in %llu ms; A %s the connection\n", (unsigned long long)sent,
               (unsigned long long)(now_ms() - t0), closed ? "ended" : "did not end");
        r = child_wait(pid, 10000);
        close(h.fd);
        auth_session_wipe(&h.s);
        if (!closed || r != 0) {
                fprintf(stderr, "unread: A %s the connection; the waiting rank %s\n",
                        closed ? "ended" : "kept", r == 0 ? "saw its home lost" : "failed or hung");
                return 1;
        }
        return 0;
}

/* ------------------------------------------------------------ main */

static int drop_to(uid_t uid) {
        if (setgroups(0, NULL) < 0 || setgid((gid_t)uid) < 0 || setuid(uid) < 0) {
                fprintf(stderr, "mesh-attack: cannot become uid %u: %s\n", (unsigned)uid, strerror(errno));
                return -1;
        }
        return 0;
}

static int run(int argc, char **argv) {
        const char *cmd = argv[0];

        if (strcmp(cmd, "reflect") == 0 && argc == 5)
                return cmd_reflect((uint16_t)atoi(argv[1]), argv[2], argv[3], (uint16_t)atoi(argv[4]));
        if (strcmp(cmd, "replay") == 0 && argc == 5)
                return cmd_replay(argv[1], (uint16_t)atoi(argv[2]), argv[3], argv[4]);
        if (strcmp(cmd, "peer") == 0 && argc == 7)
                return cmd_peer(argv[1], (uint16_t)atoi(argv[2]), argv[3], argv[4], atoi(argv[5]),
                                atoi(argv[6]));
        if (strcmp(cmd, "flood") == 0 && argc == 5)
                return cmd_flood((uint16_t)atoi(argv[1]), atoi(argv[2]), atoi(argv[3]), atoi(argv[4]));
        if (strcmp(cmd, "forge") == 0 && argc == 5)
                return cmd_forge(argv[1], argv[2], atoi(argv[3]), argv[4]);
        if (strcmp(cmd, "probe") == 0 && argc == 4)
                return cmd_probe(argv[1], atoi(argv[2]), atoi(argv[3]));
        if (strcmp(cmd, "mirrors") == 0 && argc == 9)
                return cmd_mirrors(argv[1], (uint16_t)atoi(argv[2]), argv[3], argv[4], argv[5], atoi(argv[6]),
                                   atoi(argv[7]), argv[8]);
        if (strcmp(cmd, "flap") == 0 && argc == 6)
                return cmd_flap(argv[1], (uint16_t)atoi(argv[2]), argv[3], argv[4], atoi(argv[5]));
        if (strcmp(cmd, "unread") == 0 && argc == 7)
                return cmd_unread(argv[1], (uint16_t)atoi(argv[2]), argv[3], argv[4], argv[5], atoi(argv[6]));
        fprintf(stderr, "mesh-attack: bad command or arguments (see the top of mesh-attack.c)\n");
        return 2;
}

int main(int argc, char **argv) {
        int status;
        pid_t pid;

        setvbuf(stdout, NULL, _IOLBF, 0);
        signal(SIGPIPE, SIG_IGN);
        if (auth_init() < 0)
                return 1;
        if (argc >= 3 && strcmp(argv[1], "--uid") == 0) {
                uid_t uid = (uid_t)atoi(argv[2]);

                pid = fork();
                if (pid < 0)
                        return 1;
                if (pid == 0)
                        _exit(drop_to(uid) < 0 ? 1 : run(argc - 3, argv + 3));
                if (waitpid(pid, &status, 0) != pid || !WIFEXITED(status))
                        return 1;
                return WEXITSTATUS(status);
        }
        if (argc < 2)
                return run(1, (char *[]){ "help", NULL });
        return run(argc - 1, argv + 1);
}
