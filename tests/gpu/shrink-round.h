/* The checked low-latency rounds of ep_shrink_test.c: one rank's state,
 * every rank's inputs (made from the case's seed, so that any rank can make
 * any other's, also after it died), and a dispatch and combine checked
 * against CPU references that leave out the ranks the endpoint masked.
 * Test code. */
#ifndef MOEEP_TEST_SHRINK_ROUND_H
#define MOEEP_TEST_SHRINK_ROUND_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

#include <cuda_runtime_api.h>

#include "moeep_ep.h"

enum {
        H = 2048,
        K = 6,
        EPR = 6, /* experts per rank */
        MAX_T = 48,
        PIECE = 512, /* channels of one piece of the combine receive (LL_RECV_PIECE int4) */
};

struct input {
        int T;
        int64_t idx[MAX_T * K];
        float w[MAX_T * K];
        uint16_t x[MAX_T * H];
};

struct rk {
        struct shared *sh; /* not owning: the test's shared memory (ep_shrink_test.c) */
        uint64_t seed;     /* of the case: every rank makes every rank's inputs from it */
        int ci;
        struct moeep_client *c;
        struct moeep_ep *ep;
        int me, R, L, S;
        bool two; /* two daemons */
        cudaStream_t st;
        void *x, *idx, *out;
        void *y; /* normal mode: the received rows, as combine input */
        float *w;
        int32_t *mask_dev;
        uint16_t *got; /* host: combine output */
        uint8_t *rx;   /* host: received rows of one expert */
        int *src;
        int64_t *range;
        struct input *in; /* [R] */
        char *msg;
};

/* Inside a function of struct rk *k that returns int: records the failure
 * in k->msg and returns -1. */
#define FAIL(...)                                   \
        do {                                        \
                snprintf(k->msg, 240, __VA_ARGS__); \
                return -1;                          \
        } while (0)

/* A round in two halves, so that a rank can die between them: the
 * dispatch (every rank's inputs of round `round`), then the combine of
 * its slots in place. `lost_ok`: ranks that may be lost during the call.
 * With `quiet` (a rank that is about to die), calls only, no checks. */
struct round {
        struct moeep_ll_dispatch_result res;
        uint32_t mask; /* the mask before the half under way */
        bool quiet, hook;
        int n;
        int64_t t_done; /* when the last half's call ended (before its checks) */
};

/* Rank s's inputs of round `round` of case ci. */
void gen_input(struct input *in, uint64_t seed, int ci, int s, int R, int round);

/* The rank's buffers (k->R, k->L, k->S set), freed by rk_free. 0 or -1. */
int rk_alloc(struct rk *k);
void rk_free(struct rk *k);

/* The endpoint's mask as bits (moeep_ll_mask_query). 0, or -1 with msg. */
int mask_bits(struct rk *k, uint32_t *ret);

/* Our inputs to the device, the output poisoned. 0, or -1 with msg. */
int upload(struct rk *k, const struct input *in);

/* The halves of a round and the whole (see shrink-round.c). 0, or -1 with
 * msg. */
int half_dispatch(struct rk *k, struct round *rd, int round, uint32_t lost_ok, bool quiet, bool hook);
int half_combine(struct rk *k, struct round *rd, uint32_t lost_ok);
int ll_round(struct rk *k, int round, uint32_t lost_ok, bool quiet, bool hook);

#endif
