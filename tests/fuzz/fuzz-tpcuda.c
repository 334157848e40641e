/* libFuzzer target: what the cuda transport reads from other processes
 * (daemon/datapath/tp-cuda-wire.c): a peer daemon's address blob, and the messages
 * on its peer socket, which any local process may send.
 *
 * Byte 0 picks the entry point, byte 1 its options, the rest is the input:
 *
 *   0   tpc_blob_decode()
 *   1   tpc_msg_check() with byte 1 & 3 fds, from the server when bit 2
 *   2   tpc_token_find() of the first 32 bytes against a table made from
 *       the next 96, entries used per the bits of byte 1
 *
 * Checked: an accepted blob has a NUL-terminated name of the transport's
 * prefix and a non-zero token, and encodes back to an accepted blob with
 * the same fields; an accepted message takes fds only as a REGION with
 * status 0 (exactly one) and decodes to itself; a refusal always says why;
 * a token is found only where it matches an unused entry byte for byte. */
#include <errno.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "datapath/tp-cuda-wire.h"
#include "fuzz.h"

int LLVMFuzzerInitialize(int *argc, char ***argv) {
        return 0;
}

static void blob(const uint8_t *in, size_t n) {
        struct tpc_blob b, again;
        uint8_t buf[TPC_BLOB_BYTES];
        const char *why = NULL;

        if (tpc_blob_decode(in, n, &b, &why) < 0) {
                if (!why || !why[0])
                        abort();
                return;
        }
        if (b.name_len >= TPC_NAME_MAX || strlen(b.name) != b.name_len ||
            strncmp(b.name, TPC_NAME_PREFIX, strlen(TPC_NAME_PREFIX)) != 0 || strchr(b.name, '/'))
                abort();
        tpc_blob_encode(&b, buf);
        if (tpc_blob_decode(buf, sizeof(buf), &again, &why) < 0 || memcmp(&again, &b, sizeof(b)) != 0)
                abort();
}

static void msg(uint8_t opt, const uint8_t *in, size_t n) {
        size_t nfds = opt & 3;
        bool from_server = opt & 4;
        struct tpc_msg m, again;
        const char *why = NULL;

        if (tpc_msg_check(in, n, nfds, from_server, &m, &why) < 0) {
                if (!why || !why[0])
                        abort();
                return;
        }
        if (nfds != (m.type == TPC_MSG_REGION && m.status == 0 ? 1u : 0u) || m.magic != TPC_MSG_MAGIC ||
            m.status > 0)
                abort();
        if (tpc_msg_check(&m, sizeof(m), nfds, from_server, &again, &why) < 0 ||
            memcmp(&m, &again, sizeof(m)))
                abort();
}

static void token(uint8_t opt, const uint8_t *in, size_t n) {
        uint8_t table[3][TPC_TOKEN_BYTES] = { { 0 } };
        uint8_t t[TPC_TOKEN_BYTES] = { 0 };
        bool used[3] = { opt & 1, opt & 2, opt & 4 };
        int r;

        memcpy(t, in, n < sizeof(t) ? n : sizeof(t));
        if (n > sizeof(t))
                memcpy(table, in + sizeof(t), n - sizeof(t) < sizeof(table) ? n - sizeof(t) : sizeof(table));
        r = tpc_token_find((const uint8_t(*)[TPC_TOKEN_BYTES])table, used, 3, t);
        if (r >= 0 && (r > 2 || used[r] || memcmp(table[r], t, sizeof(t)) != 0))
                abort();
        if (r == -EACCES)
                for (int i = 0; i < 3; i++)
                        if (memcmp(table[i], t, sizeof(t)) == 0 && !used[i] &&
                            memcmp(t, (uint8_t[TPC_TOKEN_BYTES]){ 0 }, sizeof(t)) != 0)
                                abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
        if (size < 2)
                return 0;
        switch (data[0] % 3) {
        case 0:
                blob(data + 2, size - 2);
                break;
        case 1:
                msg(data[1], data + 2, size - 2);
                break;
        case 2:
                token(data[1], data + 2, size - 2);
                break;
        }
        return 0;
}
