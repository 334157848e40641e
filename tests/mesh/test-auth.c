/* The mesh's peer authentication (daemon/auth.c) driven directly: both
 * sides of the HMAC challenge-response with the same key, a wrong key, a
 * replayed transcript, a reflected MAC, and the key file checks. */
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

#include "auth.h"
#include "log.h"

/* One handshake between a dialler holding `kd` and a listener holding
 * `kl`, as mesh.c runs it; returns 0 when both accepted, -1 when the
 * dialler refused the listener, -2 when the listener refused the dialler.
 * The transcript goes to `ret_*` (when not NULL) for the replay test. */
static int handshake(const uint8_t kd[AUTH_KEY_BYTES], const uint8_t kl[AUTH_KEY_BYTES],
                     uint8_t ret_nd[AUTH_NONCE_BYTES], uint8_t ret_mac_d[AUTH_MAC_BYTES]) {
        uint8_t nd[AUTH_NONCE_BYTES], nl[AUTH_NONCE_BYTES], mac_l[AUTH_MAC_BYTES], mac_d[AUTH_MAC_BYTES];

        auth_nonce(nd); /* PeerHello */
        auth_nonce(nl); /* PeerChallenge */
        auth_mac(kl, AUTH_LISTENER, nd, nl, mac_l);
        if (!auth_verify(kd, AUTH_LISTENER, nd, nl, mac_l, sizeof(mac_l)))
                return -1;
        auth_mac(kd, AUTH_DIALLER, nd, nl, mac_d); /* PeerProof */
        if (ret_nd)
                memcpy(ret_nd, nd, sizeof(nd));
        if (ret_mac_d)
                memcpy(ret_mac_d, mac_d, sizeof(mac_d));
        if (!auth_verify(kl, AUTH_DIALLER, nd, nl, mac_d, sizeof(mac_d)))
                return -2;
        return 0;
}

static void key(uint8_t k[AUTH_KEY_BYTES], uint8_t fill) {
        memset(k, fill, AUTH_KEY_BYTES);
}

static void test_good_key(void **state) {
        uint8_t k[AUTH_KEY_BYTES];

        key(k, 0x11);
        for (int i = 0; i < 16; i++)
                assert_int_equal(handshake(k, k, NULL, NULL), 0);
}

static void test_bad_key(void **state) {
        uint8_t a[AUTH_KEY_BYTES], b[AUTH_KEY_BYTES];

        key(a, 0x11);
        key(b, 0x11);
        b[AUTH_KEY_BYTES - 1] ^= 1; /* one bit off */
        /* The dialler checks first, so it is the one that notices. */
        assert_int_equal(handshake(b, a, NULL, NULL), -1);
        assert_int_equal(handshake(a, b, NULL, NULL), -1);
}

/* A recorded PeerProof is worthless later: the listener draws a fresh
 * nonce every time, and the MAC covers it. */
static void test_replay(void **state) {
        uint8_t k[AUTH_KEY_BYTES], nd[AUTH_NONCE_BYTES], mac_d[AUTH_MAC_BYTES], nl2[AUTH_NONCE_BYTES];

        key(k, 0x22);
        assert_int_equal(handshake(k, k, nd, mac_d), 0);
        /* An attacker without the key replays the dialler's side: same
         * nonce in PeerHello, same MAC in PeerProof. */
        auth_nonce(nl2);
        assert_false(auth_verify(k, AUTH_DIALLER, nd, nl2, mac_d, sizeof(mac_d)));
}

/* A listener's MAC sent back as a dialler's proof is refused (the role
 * label differs), and so are MACs of the wrong size. */
static void test_reflection_and_size(void **state) {
        uint8_t k[AUTH_KEY_BYTES], nd[AUTH_NONCE_BYTES], nl[AUTH_NONCE_BYTES], mac[AUTH_MAC_BYTES];

        key(k, 0x33);
        auth_nonce(nd);
        auth_nonce(nl);
        auth_mac(k, AUTH_LISTENER, nd, nl, mac);
        assert_true(auth_verify(k, AUTH_LISTENER, nd, nl, mac, sizeof(mac)));
        assert_false(auth_verify(k, AUTH_DIALLER, nd, nl, mac, sizeof(mac)));
        assert_false(auth_verify(k, AUTH_LISTENER, nd, nl, mac, sizeof(mac) - 1));
        assert_false(auth_verify(k, AUTH_LISTENER, nd, nl, NULL, 0));
        /* Swapped nonces are another transcript. */
        assert_false(auth_verify(k, AUTH_LISTENER, nl, nd, mac, sizeof(mac)));
}

static char *write_key(const char *text, mode_t mode) {
        char *path = strdup("/tmp/moeep-test-key.XXXXXX");
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
                cmocka_unit_test(test_good_key), cmocka_unit_test(test_bad_key),
                cmocka_unit_test(test_replay),   cmocka_unit_test(test_reflection_and_size),
                cmocka_unit_test(test_key_file),
        };

        if (auth_init() < 0)
                return 1;
        return cmocka_run_group_tests(tests, NULL, NULL);
}
