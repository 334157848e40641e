/* Mesh peer authentication; see auth.h. */
#include <errno.h>
#include <fcntl.h>
#include <sodium.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "log.h"
#include "mesh/auth.h"

_Static_assert(AUTH_KEY_BYTES == crypto_hash_sha256_BYTES, "the key is a SHA-256");
_Static_assert(AUTH_KEY_BYTES == crypto_generichash_KEYBYTES, "the key keys BLAKE2b");
_Static_assert(AUTH_KEY_BYTES == crypto_kdf_KEYBYTES, "session key size");
_Static_assert(AUTH_KEY_BYTES == crypto_auth_KEYBYTES, "proof key size");
_Static_assert(AUTH_MAC_BYTES == crypto_auth_BYTES, "proof size");
_Static_assert(AUTH_KEY_BYTES == crypto_aead_xchacha20poly1305_ietf_KEYBYTES, "frame key size");
_Static_assert(AUTH_SEAL_BYTES == crypto_aead_xchacha20poly1305_ietf_ABYTES, "frame tag size");

/* The protocol label: first in the transcript and in the session key's
 * input, so that no other use of the cluster key can produce the same
 * values. */
#define LABEL "moeep-mesh-2"
/* crypto_kdf context (8 bytes) and the subkey ids. */
#define KDF_CONTEXT "moeepmsh"
enum {
        KDF_PROOF_DIALLER = 1,
        KDF_PROOF_ACCEPTOR = 2,
        KDF_DIALLER_TO_ACCEPTOR = 3,
        KDF_ACCEPTOR_TO_DIALLER = 4
};

const char *auth_role_to_string(enum auth_role r) {
        switch (r) {
        case AUTH_DIALLER:
                return "dialler";
        case AUTH_ACCEPTOR:
                return "acceptor";
        }
        return "unknown";
}

int auth_init(void) {
        return sodium_init() < 0 ? -EIO : 0;
}

int auth_key_load(const char *path, uint8_t ret_key[static AUTH_KEY_BYTES], char *errmsg) {
        uint8_t buf[AUTH_KEY_FILE_MAX + 1];
        struct stat st;
        ssize_t n;
        size_t len = 0;
        int fd, r = 0;

        fd = open(path, O_RDONLY | O_CLOEXEC | O_NOCTTY);
        if (fd < 0)
                return errmsg_set(errmsg, -errno, "cluster key file %s: %s", path, strerror(errno));
        if (fstat(fd, &st) < 0) {
                r = errmsg_set(errmsg, -errno, "cluster key file %s: %s", path, strerror(errno));
                goto out;
        }
        if (!S_ISREG(st.st_mode) || (st.st_mode & 077)) {
                r = errmsg_set(errmsg, -EPERM,
                               "cluster key file %s: mode %04o: need a regular file that only its owner may "
                               "read (chmod 0600 or 0400)",
                               path, (unsigned)(st.st_mode & 07777));
                goto out;
        }
        while (len < sizeof(buf)) {
                n = read(fd, buf + len, sizeof(buf) - len);
                if (n < 0 && errno == EINTR)
                        continue;
                if (n < 0) {
                        r = errmsg_set(errmsg, -errno, "cluster key file %s: %s", path, strerror(errno));
                        goto out;
                }
                if (n == 0)
                        break;
                len += (size_t)n;
        }
        while (len > 0 &&
               (buf[len - 1] == '\n' || buf[len - 1] == '\r' || buf[len - 1] == ' ' || buf[len - 1] == '\t'))
                len--;
        if (len < AUTH_KEY_FILE_MIN || len > AUTH_KEY_FILE_MAX) {
                r = errmsg_set(errmsg, -EINVAL, "cluster key file %s: %zu%s bytes of key: need %d to %d",
                               path, len, len > AUTH_KEY_FILE_MAX ? " or more" : "", AUTH_KEY_FILE_MIN,
                               AUTH_KEY_FILE_MAX);
                goto out;
        }
        crypto_hash_sha256(ret_key, buf, len);
out:
        sodium_memzero(buf, sizeof(buf));
        close(fd);
        return r;
}

void auth_nonce(uint8_t nonce[static AUTH_NONCE_BYTES]) {
        randombytes_buf(nonce, AUTH_NONCE_BYTES);
}

static void hash_u32(crypto_generichash_state *st, uint32_t v) {
        uint8_t b[4] = { (uint8_t)(v >> 24), (uint8_t)(v >> 16), (uint8_t)(v >> 8), (uint8_t)v };

        crypto_generichash_update(st, b, sizeof(b));
}

/* A string as its length and bytes, so that no two pairs of identities
 * hash alike by moving bytes from one to the other. */
static void hash_string(crypto_generichash_state *st, const char *s) {
        hash_u32(st, (uint32_t)strlen(s));
        crypto_generichash_update(st, (const uint8_t *)s, strlen(s));
}

int auth_session_derive(const uint8_t key[static AUTH_KEY_BYTES], const struct auth_transcript *t,
                        enum auth_role self, struct auth_session *ret_session) {
        static const char session_label[] = LABEL " session";
        crypto_generichash_state st;
        uint8_t session[crypto_kdf_KEYBYTES], d2a[AUTH_KEY_BYTES], a2d[AUTH_KEY_BYTES];
        struct auth_session *s = ret_session;

        if (!t->id_dialler || !t->id_acceptor || strlen(t->id_dialler) > 255 || strlen(t->id_acceptor) > 255)
                return -EINVAL;
        memset(s, 0, sizeof(*s));
        s->self = self;
        crypto_generichash_init(&st, NULL, 0, sizeof(s->th));
        crypto_generichash_update(&st, (const uint8_t *)LABEL, sizeof(LABEL)); /* with its NUL */
        crypto_generichash_update(&st, t->nonce_dialler, AUTH_NONCE_BYTES);
        crypto_generichash_update(&st, t->nonce_acceptor, AUTH_NONCE_BYTES);
        hash_string(&st, t->id_dialler);
        hash_string(&st, t->id_acceptor);
        hash_u32(&st, t->minor_dialler);
        hash_u32(&st, t->minor_acceptor);
        crypto_generichash_final(&st, s->th, sizeof(s->th));

        crypto_generichash_init(&st, key, AUTH_KEY_BYTES, sizeof(session));
        crypto_generichash_update(&st, (const uint8_t *)session_label, sizeof(session_label));
        crypto_generichash_update(&st, s->th, sizeof(s->th));
        crypto_generichash_final(&st, session, sizeof(session));

        crypto_kdf_derive_from_key(s->proof_key[AUTH_DIALLER], AUTH_KEY_BYTES, KDF_PROOF_DIALLER, KDF_CONTEXT,
                                   session);
        crypto_kdf_derive_from_key(s->proof_key[AUTH_ACCEPTOR], AUTH_KEY_BYTES, KDF_PROOF_ACCEPTOR,
                                   KDF_CONTEXT, session);
        crypto_kdf_derive_from_key(d2a, sizeof(d2a), KDF_DIALLER_TO_ACCEPTOR, KDF_CONTEXT, session);
        crypto_kdf_derive_from_key(a2d, sizeof(a2d), KDF_ACCEPTOR_TO_DIALLER, KDF_CONTEXT, session);
        memcpy(s->tx_key, self == AUTH_DIALLER ? d2a : a2d, AUTH_KEY_BYTES);
        memcpy(s->rx_key, self == AUTH_DIALLER ? a2d : d2a, AUTH_KEY_BYTES);
        sodium_memzero(session, sizeof(session));
        sodium_memzero(d2a, sizeof(d2a));
        sodium_memzero(a2d, sizeof(a2d));
        sodium_memzero(&st, sizeof(st));
        return 0;
}

void auth_proof(const struct auth_session *s, enum auth_role role, uint8_t ret_mac[static AUTH_MAC_BYTES]) {
        crypto_auth(ret_mac, s->th, sizeof(s->th), s->proof_key[role]);
}

bool auth_proof_verify(const struct auth_session *s, enum auth_role role, const uint8_t *mac, size_t len) {
        if (!mac || len != AUTH_MAC_BYTES)
                return false;
        return crypto_auth_verify(mac, s->th, sizeof(s->th), s->proof_key[role]) == 0;
}

void auth_session_done(struct auth_session *s) {
        sodium_memzero(s->proof_key, sizeof(s->proof_key));
}

/* The AEAD nonce of frame `seq`: the counter, little-endian, then zeros.
 * Each direction of each connection has its own key, so a (key, nonce)
 * pair never repeats. */
static void frame_nonce(uint64_t seq, uint8_t ret[static crypto_aead_xchacha20poly1305_ietf_NPUBBYTES]) {
        memset(ret, 0, crypto_aead_xchacha20poly1305_ietf_NPUBBYTES);
        for (int i = 0; i < 8; i++)
                ret[i] = (uint8_t)(seq >> (8 * i));
}

int auth_seal(struct auth_session *s, const uint8_t *msg, size_t len, uint8_t *out) {
        uint8_t nonce[crypto_aead_xchacha20poly1305_ietf_NPUBBYTES];

        if (s->tx_seq == UINT64_MAX)
                return -EOVERFLOW;
        frame_nonce(s->tx_seq++, nonce);
        crypto_aead_xchacha20poly1305_ietf_encrypt(out, NULL, msg, len, NULL, 0, NULL, nonce, s->tx_key);
        return 0;
}

int auth_open(struct auth_session *s, const uint8_t *in, size_t len, uint8_t *out) {
        uint8_t nonce[crypto_aead_xchacha20poly1305_ietf_NPUBBYTES];

        if (s->rx_seq == UINT64_MAX)
                return -EOVERFLOW;
        if (len < AUTH_SEAL_BYTES)
                return -EBADMSG;
        frame_nonce(s->rx_seq, nonce);
        if (crypto_aead_xchacha20poly1305_ietf_decrypt(out, NULL, NULL, in, len, NULL, 0, nonce, s->rx_key) !=
            0)
                return -EBADMSG;
        s->rx_seq++;
        return 0;
}

void auth_session_wipe(struct auth_session *s) {
        if (s)
                sodium_memzero(s, sizeof(*s));
}
