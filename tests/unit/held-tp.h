/* A transport for the proxy's unit tests (test-proxy-share.c) whose
 * writes complete only when the test lets them (release()). */
#ifndef MOEEP_TESTS_HELD_TP_H
#define MOEEP_TESTS_HELD_TP_H

#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>

#include "datapath/transport.h"

#define HELD_MAX 4096u /* writes held at once */
#define HELD_RINGS 8   /* test rings whose writes are counted */

struct tp_mr {
        int ring; /* which test ring writes from it; -1 the proxy's staging */
};

/* Writes wait in `held` until released, per ring (all of `ring` or `n`). */
struct tp {
        pthread_mutex_t lock;
        struct {
                uint64_t cookie;
                int ring;
                int status;
                bool go;
        } held[HELD_MAX];
        uint32_t nheld;
        uint64_t writes[HELD_RINGS]; /* posted, per ring */
};

extern const struct tp_ops held_ops;

/* Lets up to `n` held writes of `ring` complete, oldest first. */
void release(struct tp *tp, int ring, uint32_t n);

#endif
