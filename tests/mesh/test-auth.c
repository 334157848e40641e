/* The mesh's peer authentication (daemon/mesh/auth.c) driven directly: both
 * sides of the handshake with the same key, a wrong key, other identities,
 * a replayed transcript, a reflected proof, sealed frames replayed,
 * reordered or moved between connections, and the key file checks. */
#include <errno.h>
#include <fcntl.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmocka.h>

#include "../tmpdir.h"
#include "log.h"
#include "mesh/auth.h"

#define ID_A "127.0.0.1:7100"
#define ID_B "127.0.0.1:7101"
#define ID_C "[::1]:7102"

static void key(uint8_t k[AUTH_KEY_BYTES], uint8_t fill) {
        memset(k, fill, AUTH_KEY_BYTES);
}

/* The two sides' sessions of one handshake between dialler `id_d` (key
 * `kd`) and acceptor `id_a` (key `ka`), each deriving from what it has, as
 * mesh.c does. */
struct pair {
        struct auth_transcript t;
        struct auth_session d, a;
};

static void pair_make(struct pair *p, const uint8_t kd[AUTH_KEY_BYTES], const uint8_t ka[AUTH_KEY_BYTES],
                      const char *id_d, const char *id_a) {
        memset(p, 0, sizeof(*p));
        auth_nonce(p->t.nonce_dialler);  /* PeerHello */
        auth_nonce(p->t.nonce_acceptor); /* PeerChallenge */
        p->t.id_dialler = id_d;
        p->t.id_acceptor = id_a;
        p->t.minor_dialler = p->t.minor_acceptor = 3;
        assert_int_equal(auth_session_derive(kd, &p->t, AUTH_DIALLER, &p->d), 0);
        assert_int_equal(auth_session_derive(ka, &p->t, AUTH_ACCEPTOR, &p->a), 0);
}

/* 0 when both accept, -1 when the dialler refuses the acceptor's proof,
 * -2 when the acceptor refuses the dialler's. */
static int handshake(struct pair *p) {
        uint8_t mac[AUTH_MAC_BYTES];

        auth_proof(&p->a, AUTH_ACCEPTOR, mac);
        if (!auth_proof_verify(&p->d, AUTH_ACCEPTOR, mac, sizeof(mac)))
                return -1;
        auth_proof(&p->d, AUTH_DIALLER, mac);
        if (!auth_proof_verify(&p->a, AUTH_DIALLER, mac, sizeof(mac)))
                return -2;
        return 0;
}

static void test_good_key(void **state) {
        uint8_t k[AUTH_KEY_BYTES], box[5 + AUTH_SEAL_BYTES], back[5];
        struct pair p;

        key(k, 0x11);
        for (int i = 0; i < 16; i++) {
                pair_make(&p, k, k, ID_A, ID_B);
                assert_int_equal(handshake(&p), 0);
                /* Frames go both ways, each direction under its own key. */
                assert_int_equal(auth_seal(&p.d, (const uint8_t *)"hello", 5, box), 0);
                assert_int_equal(auth_open(&p.a, box, sizeof(box), back), 0);
                assert_memory_equal(back, "hello", 5);
                assert_int_equal(auth_seal(&p.a, (const uint8_t *)"world", 5, box), 0);
                assert_int_equal(auth_open(&p.d, box, sizeof(box), back), 0);
                assert_memory_equal(back, "world", 5);
        }
}

static void test_bad_key(void **state) {
        uint8_t a[AUTH_KEY_BYTES], b[AUTH_KEY_BYTES];
        struct pair p;

        key(a, 0x11);
        key(b, 0x11);
        b[AUTH_KEY_BYTES - 1] ^= 1; /* one bit off */
        /* The dialler checks first, so it is the one that notices. */
        pair_make(&p, b, a, ID_A, ID_B);
        assert_int_equal(handshake(&p), -1);
        pair_make(&p, a, b, ID_A, ID_B);
        assert_int_equal(handshake(&p), -1);
}

/* The proofs bind both identities: an acceptor that believes it talks to
 * C, or a dialler that believes it dialled C, computes other keys. */
static void test_identities(void **state) {
        uint8_t k[AUTH_KEY_BYTES], mac[AUTH_MAC_BYTES];
        struct pair p;
        struct auth_session other;
        struct auth_transcript t;

        key(k, 0x44);
        pair_make(&p, k, k, ID_A, ID_B);
        t = p.t;
        t.id_dialler = ID_C;
        assert_int_equal(auth_session_derive(k, &t, AUTH_ACCEPTOR, &other), 0);
        auth_proof(&p.d, AUTH_DIALLER, mac);
        assert_false(auth_proof_verify(&other, AUTH_DIALLER, mac, sizeof(mac)));
        t = p.t;
        t.id_acceptor = ID_C;
        assert_int_equal(auth_session_derive(k, &t, AUTH_DIALLER, &other), 0);
        auth_proof(&p.a, AUTH_ACCEPTOR, mac);
        assert_false(auth_proof_verify(&other, AUTH_ACCEPTOR, mac, sizeof(mac)));
        /* Bytes moved from one identity to the other are another transcript. */
        t = p.t;
        t.id_dialler = "127.0.0.1:710";
        t.id_acceptor = "0127.0.0.1:7101";
        assert_int_equal(auth_session_derive(k, &t, AUTH_ACCEPTOR, &other), 0);
        auth_proof(&p.d, AUTH_DIALLER, mac);
        assert_false(auth_proof_verify(&other, AUTH_DIALLER, mac, sizeof(mac)));
        /* A minor downgraded on the way is noticed too. */
        t = p.t;
        t.minor_acceptor = 2;
        assert_int_equal(auth_session_derive(k, &t, AUTH_DIALLER, &other), 0);
        auth_proof(&p.a, AUTH_ACCEPTOR, mac);
        assert_false(auth_proof_verify(&other, AUTH_ACCEPTOR, mac, sizeof(mac)));
        t.id_dialler = NULL;
        assert_int_equal(auth_session_derive(k, &t, AUTH_DIALLER, &other), -EINVAL);
}

/* A recorded PeerProof is worthless later: the acceptor draws a fresh
 * nonce every time, and the proof covers it. */
static void test_replay(void **state) {
        uint8_t k[AUTH_KEY_BYTES], mac_d[AUTH_MAC_BYTES];
        struct pair p, q;

        key(k, 0x22);
        pair_make(&p, k, k, ID_A, ID_B);
        assert_int_equal(handshake(&p), 0);
        auth_proof(&p.d, AUTH_DIALLER, mac_d);
        /* An attacker without the key replays the dialler's side: same
         * nonce in PeerHello, same MAC in PeerProof. */
        pair_make(&q, k, k, ID_A, ID_B);
        memcpy(q.t.nonce_dialler, p.t.nonce_dialler, AUTH_NONCE_BYTES);
        assert_int_equal(auth_session_derive(k, &q.t, AUTH_ACCEPTOR, &q.a), 0);
        assert_false(auth_proof_verify(&q.a, AUTH_DIALLER, mac_d, sizeof(mac_d)));
}

/* A proof sent back to its sender as the other role's is refused (the
 * roles' keys differ), even over the very same transcript; and so are
 * proofs of the wrong size. */
static void test_reflection_and_size(void **state) {
        uint8_t k[AUTH_KEY_BYTES], mac[AUTH_MAC_BYTES];
        struct pair p;

        key(k, 0x33);
        pair_make(&p, k, k, ID_A, ID_B);
        auth_proof(&p.a, AUTH_ACCEPTOR, mac);
        assert_true(auth_proof_verify(&p.a, AUTH_ACCEPTOR, mac, sizeof(mac)));
        assert_false(auth_proof_verify(&p.a, AUTH_DIALLER, mac, sizeof(mac)));
        assert_false(auth_proof_verify(&p.d, AUTH_DIALLER, mac, sizeof(mac)));
        assert_false(auth_proof_verify(&p.a, AUTH_ACCEPTOR, mac, sizeof(mac) - 1));
        assert_false(auth_proof_verify(&p.a, AUTH_ACCEPTOR, NULL, 0));
        /* A's transcript as dialler to B is not its transcript as acceptor
         * from B: a reflected exchange swaps the identities. */
        {
                struct auth_transcript t = p.t;
                struct auth_session swapped;

                t.id_dialler = ID_B;
                t.id_acceptor = ID_A;
                assert_int_equal(auth_session_derive(k, &t, AUTH_DIALLER, &swapped), 0);
                assert_false(auth_proof_verify(&swapped, AUTH_ACCEPTOR, mac, sizeof(mac)));
        }
}

/* Frames: a replayed, reordered, truncated, altered or reflected frame,
 * and one from another connection, do not open; the counter does not move
 * on a failure. */
static void test_frames(void **state) {
        uint8_t k[AUTH_KEY_BYTES], f0[4 + AUTH_SEAL_BYTES], f1[4 + AUTH_SEAL_BYTES], out[4];
        struct pair p, q;

        key(k, 0x55);
        pair_make(&p, k, k, ID_A, ID_B);
        pair_make(&q, k, k, ID_A, ID_B);
        assert_int_equal(auth_seal(&p.d, (const uint8_t *)"zero", 4, f0), 0);
        assert_int_equal(auth_seal(&p.d, (const uint8_t *)"one!", 4, f1), 0);
        assert_int_equal(auth_open(&p.a, f1, sizeof(f1), out), -EBADMSG); /* reordered */
        assert_int_equal(auth_open(&q.a, f0, sizeof(f0), out), -EBADMSG); /* another connection */
        assert_int_equal(auth_open(&p.d, f0, sizeof(f0), out), -EBADMSG); /* reflected */
        assert_int_equal(auth_open(&p.a, f0, sizeof(f0) - 1, out), -EBADMSG);
        assert_int_equal(auth_open(&p.a, f0, 3, out), -EBADMSG);
        f0[0] ^= 1;
        assert_int_equal(auth_open(&p.a, f0, sizeof(f0), out), -EBADMSG);
        f0[0] ^= 1;
        assert_int_equal(auth_open(&p.a, f0, sizeof(f0), out), 0);
        assert_memory_equal(out, "zero", 4);
        assert_int_equal(auth_open(&p.a, f0, sizeof(f0), out), -EBADMSG); /* replayed */
        assert_int_equal(auth_open(&p.a, f1, sizeof(f1), out), 0);
        assert_memory_equal(out, "one!", 4);
        p.d.tx_seq = UINT64_MAX;
        assert_int_equal(auth_seal(&p.d, out, 4, f0), -EOVERFLOW);
        auth_session_wipe(&p.d);
        auth_session_wipe(NULL);
}

static char *write_key(const char *text, mode_t mode) {
        char *path = strdup(test_tmp_path((char[256]){ 0 }, 256, "moeep-test-key.XXXXXX"));
        int fd = mkstemp(path);

        assert_true(fd >= 0);
        assert_int_equal(write(fd, text, strlen(text)), (ssize_t)strlen(text));
        assert_int_equal(fchmod(fd, mode), 0);
        close(fd);
        return path;
}

static void test_key_file(void **state) {
        uint8_t k1[AUTH_KEY_BYTES], k2[AUTH_KEY_BYTES];
        char errmsg[ERRMSG_MAX] = "";
        char *a = write_key("0123456789abcdef0123456789abcdef\n", 0600);
        char *b = write_key("0123456789abcdef0123456789abcdef", 0400);
        char *open_to_all = write_key("0123456789abcdef0123456789abcdef", 0644);
        char *shortkey = write_key("short\n", 0600);

        assert_int_equal(auth_key_load(a, k1, errmsg), 0);
        assert_int_equal(auth_key_load(b, k2, errmsg), 0);
        assert_memory_equal(k1, k2, AUTH_KEY_BYTES); /* the newline does not count */

        assert_int_equal(auth_key_load(open_to_all, k1, errmsg), -EPERM);
        assert_non_null(strstr(errmsg, open_to_all));
        assert_non_null(strstr(errmsg, "0644"));
        assert_null(strstr(errmsg, "0123456789")); /* never the key */

        assert_int_equal(auth_key_load(shortkey, k1, errmsg), -EINVAL);
        assert_null(strstr(errmsg, "short")); /* never the key */
        assert_int_equal(auth_key_load("/nonexistent/moeep.key", k1, errmsg), -ENOENT);

        for (char **p = (char *[]){ a, b, open_to_all, shortkey, NULL }; *p; p++) {
                unlink(*p);
                free(*p);
        }
}

int main(void) {
        const struct CMUnitTest tests[] = {
                cmocka_unit_test(test_good_key),
                cmocka_unit_test(test_bad_key),
                cmocka_unit_test(test_identities),
                cmocka_unit_test(test_replay),
                cmocka_unit_test(test_reflection_and_size),
                cmocka_unit_test(test_frames),
                cmocka_unit_test(test_key_file),
        };

        if (auth_init() < 0)
                return 1;
        return cmocka_run_group_tests(tests, NULL, NULL);
}
