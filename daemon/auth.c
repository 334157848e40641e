/* Mesh peer authentication; see auth.h. */
#include <errno.h>
#include <fcntl.h>
#include <sodium.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "auth.h"
#include "log.h"

_Static_assert(AUTH_KEY_BYTES == crypto_auth_hmacsha256_KEYBYTES, "key size");
_Static_assert(AUTH_MAC_BYTES == crypto_auth_hmacsha256_BYTES, "mac size");
_Static_assert(AUTH_KEY_BYTES == crypto_hash_sha256_BYTES, "the key is a SHA-256");

const char *auth_role_to_string(enum auth_role r) {
        switch (r) {
        case AUTH_DIALLER:
                return "dialler";
        case AUTH_LISTENER:
                return "listener";
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

void auth_mac(const uint8_t key[static AUTH_KEY_BYTES], enum auth_role role,
              const uint8_t dialler_nonce[static AUTH_NONCE_BYTES],
              const uint8_t listener_nonce[static AUTH_NONCE_BYTES], uint8_t ret_mac[static AUTH_MAC_BYTES]) {
        crypto_auth_hmacsha256_state st;
        const char *label = role == AUTH_DIALLER ? "moeep-mesh-1 dialler" : "moeep-mesh-1 listener";

        crypto_auth_hmacsha256_init(&st, key, AUTH_KEY_BYTES);
        /* The label's terminating NUL is hashed too, so no label is a prefix
         * of another one's input. */
        crypto_auth_hmacsha256_update(&st, (const uint8_t *)label, strlen(label) + 1);
        crypto_auth_hmacsha256_update(&st, dialler_nonce, AUTH_NONCE_BYTES);
        crypto_auth_hmacsha256_update(&st, listener_nonce, AUTH_NONCE_BYTES);
        crypto_auth_hmacsha256_final(&st, ret_mac);
        sodium_memzero(&st, sizeof(st));
}

bool auth_verify(const uint8_t key[static AUTH_KEY_BYTES], enum auth_role role,
                 const uint8_t dialler_nonce[static AUTH_NONCE_BYTES],
                 const uint8_t listener_nonce[static AUTH_NONCE_BYTES], const uint8_t *mac, size_t len) {
        uint8_t want[AUTH_MAC_BYTES];
        bool ok;

        if (!mac || len != AUTH_MAC_BYTES)
                return false;
        auth_mac(key, role, dialler_nonce, listener_nonce, want);
        ok = sodium_memcmp(want, mac, AUTH_MAC_BYTES) == 0;
        sodium_memzero(want, sizeof(want));
        return ok;
}
