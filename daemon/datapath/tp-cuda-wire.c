/* tp-cuda's blob and messages; see tp-cuda-wire.h. */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "datapath/tp-cuda-wire.h"

_Static_assert(sizeof(struct tpc_blob) == 112, "the blob's layout is fixed");
_Static_assert(sizeof(struct tpc_msg) == 64, "a message is 64 bytes");

static bool all_zero(const uint8_t *p, size_t n) {
        uint8_t acc = 0;

        for (size_t i = 0; i < n; i++)
                acc |= p[i];
        return acc == 0;
}

size_t tpc_blob_encode(const struct tpc_blob *b, void *out) {
        struct tpc_blob w = *b;

        /* Bytes past name_len are zero, so that no stack garbage leaves. */
        memset(w.name + w.name_len, 0, sizeof(w.name) - w.name_len);
        memcpy(out, &w, sizeof(w));
        return sizeof(w);
}

void tpc_name_make(struct tpc_blob *b, uint32_t pid, uint64_t nonce) {
        int n = snprintf(b->name, sizeof(b->name), TPC_NAME_PREFIX "%" PRIu32 "-%016" PRIx64, pid, nonce);

        b->name_len = (uint16_t)n;
}

int tpc_blob_decode(const void *in, size_t len, struct tpc_blob *ret, const char **ret_why) {
        const size_t prefix = sizeof(TPC_NAME_PREFIX) - 1;
        struct tpc_blob b;
        size_t dash = 0;

        if (len != sizeof(b)) {
                *ret_why = "wrong length";
                return -EINVAL;
        }
        memcpy(&b, in, sizeof(b));
        if (b.magic != TPC_BLOB_MAGIC) {
                *ret_why = "bad magic (not a cuda transport's blob)";
                return -EINVAL;
        }
        if (b.version != TPC_BLOB_VERSION) {
                *ret_why = "unknown version";
                return -EINVAL;
        }
        if (b.name_len <= prefix || b.name_len >= TPC_NAME_MAX ||
            memcmp(b.name, TPC_NAME_PREFIX, prefix) != 0) {
                *ret_why = "socket name is not a cuda transport's";
                return -EINVAL;
        }
        /* PID '-' HEX: digits, one dash, then lowercase hex, nothing else
         * (no NUL, no '/'), so the name says what it is in messages. */
        for (size_t i = prefix; i < b.name_len; i++) {
                char ch = b.name[i];

                if (ch == '-' && !dash && i > prefix)
                        dash = i;
                else if (!(ch >= '0' && ch <= '9') && !(dash && ch >= 'a' && ch <= 'f')) {
                        *ret_why = "socket name has characters outside PID-HEX";
                        return -EINVAL;
                }
        }
        if (!dash || dash == b.name_len - 1u) {
                *ret_why = "socket name has characters outside PID-HEX";
                return -EINVAL;
        }
        if (all_zero(b.token, sizeof(b.token))) {
                *ret_why = "empty token";
                return -EINVAL;
        }
        memset(b.name + b.name_len, 0, sizeof(b.name) - b.name_len);
        *ret = b;
        return 0;
}

const char *tpc_msg_type_to_string(enum tpc_msg_type t) {
        switch (t) {
        case TPC_MSG_HELLO:
                return "hello";
        case TPC_MSG_WELCOME:
                return "welcome";
        case TPC_MSG_FETCH:
                return "fetch";
        case TPC_MSG_REGION:
                return "region";
        case TPC_MSG_REVOKE:
                return "revoke";
        }
        return "unknown";
}

int tpc_msg_check(const void *buf, size_t len, size_t nfds, bool from_server, struct tpc_msg *ret,
                  const char **ret_why) {
        struct tpc_msg m;
        bool server_type;
        size_t want_fds = 0;

        if (len != sizeof(m)) {
                *ret_why = "wrong size";
                return -EINVAL;
        }
        memcpy(&m, buf, sizeof(m));
        if (m.magic != TPC_MSG_MAGIC) {
                *ret_why = "bad magic";
                return -EINVAL;
        }
        switch ((enum tpc_msg_type)m.type) {
        case TPC_MSG_HELLO:
        case TPC_MSG_FETCH:
                server_type = false;
                break;
        case TPC_MSG_WELCOME:
        case TPC_MSG_REGION:
        case TPC_MSG_REVOKE:
                server_type = true;
                break;
        default:
                *ret_why = "unknown type";
                return -EINVAL;
        }
        if (server_type != from_server) {
                *ret_why = from_server ? "a client's message from the server"
                                       : "a server's message from a client";
                return -EINVAL;
        }
        if (m.reserved || (m.type != TPC_MSG_HELLO && !all_zero(m.token, sizeof(m.token)))) {
                *ret_why = "reserved fields set";
                return -EINVAL;
        }
        if (m.type != TPC_MSG_REGION && m.type != TPC_MSG_WELCOME && m.status) {
                *ret_why = "status set";
                return -EINVAL;
        }
        if (m.type == TPC_MSG_REGION && m.status == 0) {
                if (m.kind != TPC_REGION_CUMEM && m.kind != TPC_REGION_MEMFD) {
                        *ret_why = "unknown region kind";
                        return -EINVAL;
                }
                if (m.length == 0) {
                        *ret_why = "empty region";
                        return -EINVAL;
                }
                want_fds = 1;
        } else if (m.kind || m.length) {
                *ret_why = "kind or length outside a region";
                return -EINVAL;
        }
        if (m.status > 0) {
                *ret_why = "positive status";
                return -EINVAL;
        }
        if (nfds != want_fds) {
                *ret_why = want_fds ? "a region without its fd" : "fds where none belong";
                return -EINVAL;
        }
        *ret = m;
        return 0;
}

int tpc_token_find(const uint8_t (*tokens)[TPC_TOKEN_BYTES], const bool *used, size_t n,
                   const uint8_t token[TPC_TOKEN_BYTES]) {
        int found = -EACCES;

        if (all_zero(token, TPC_TOKEN_BYTES))
                return -EACCES;
        for (size_t i = 0; i < n; i++) {
                uint8_t diff = 0;

                /* Every byte of every entry, so that the time taken says
                 * nothing of how much of a guess was right. */
                for (size_t k = 0; k < TPC_TOKEN_BYTES; k++)
                        diff |= tokens[i][k] ^ token[k];
                if (diff == 0 && found == -EACCES)
                        found = used[i] ? -EALREADY : (int)i;
        }
        return found;
}
