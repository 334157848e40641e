/* A transport for the proxy's unit tests (test-proxy-share.c,
 * test-proxy-peers.c) whose writes complete only when the test lets them
 * (release()), and which counts what it was asked: writes by peer and
 * destination key, peers made and freed, writes to an index not in use. */
#ifndef MOEEP_TESTS_HELD_TP_H
#define MOEEP_TESTS_HELD_TP_H

#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>

#include "datapath/transport.h"

#define HELD_MAX 4096u /* writes held at once */
#define HELD_RINGS 8   /* test rings whose writes are counted */
#define HELD_KEYS 64   /* (peer, destination key) pairs whose writes are counted */

struct tp_mr {
        int ring; /* which test ring writes from it; -1 the proxy's staging */
};

/* Writes wait in `held` until released, per ring (all of `ring` or `n`).
 * Everything under `lock`: the proxy thread writes, polls and frees peers
 * while the test thread looks. */
struct tp {
        pthread_mutex_t lock;
        struct {
                uint64_t cookie;
                int ring;
                uint32_t peer;
                int status;
                bool go;
        } held[HELD_MAX];
        uint32_t nheld;
        uint64_t writes[HELD_RINGS]; /* posted, per ring */
        struct {
                uint32_t peer;
                uint64_t key;
                uint64_t n;
        } keys[HELD_KEYS]; /* writes posted, per (peer, destination key) */
        uint32_t nkeys;
        bool used[TP_MAX_PEERS];      /* peer_new .. peer_free */
        uint32_t freed[TP_MAX_PEERS]; /* peer_free calls per index */
        uint32_t stray;               /* writes to an index not in use, or peer calls out of turn */
        int peer_new_error;           /* peer_new fails with it when not 0 */
};

extern const struct tp_ops held_ops;

/* Lets up to `n` held writes of `ring` complete, oldest first. */
void release(struct tp *tp, int ring, uint32_t n);

/* The same, each completing with `status` (0 or -errno). */
void release_with(struct tp *tp, int ring, uint32_t n, int status);

/* Writes posted to `peer` whose destination key is `key`. */
uint64_t held_key_writes(struct tp *tp, uint32_t peer, uint64_t key);

/* Writes held now (posted, not yet polled back). */
uint32_t held_count(struct tp *tp);

#endif
