/* A stand-in for libcuda under the cuda transport's unit tests
 * (test-tp-cuda.c, test-tp-cuda-wire.c): cuMem in miniature, where an
 * allocation handle is a dup of a memfd, an address reservation is
 * PROT_NONE anonymous memory and cuMemMap maps the memfd over it, so that
 * device pointers are host pointers a test can read. Copies run at once
 * (a stream in order); an event reports NOT_READY for `fake_lag` queries
 * after it was recorded. */
#ifndef MOEEP_TESTS_TP_CUDA_FAKE_H
#define MOEEP_TESTS_TP_CUDA_FAKE_H

#include <stddef.h>

#include "datapath/proxy.h"
#include "datapath/tp-cuda-internal.h"

extern const struct tpc_api fake_api;
extern int fake_lag;          /* NOT_READY answers of each event recorded from now on */
extern int fake_events[8192]; /* per event: NOT_READY answers left */
extern int fake_nevents;      /* events created */
extern int fake_imports;      /* allocation handles imported and not released */

/* A memfd standing for a cuMem allocation of `size` bytes. */
int cumem_fake(size_t size);

/* Polls `tp` until it returned `want` completions into out (bounded). */
int poll_n(struct tp *tp, struct tp_completion *out, int want);

/* Two transports over fake_api (standing for two daemons), each with a
 * transport peer connected to the other. */
struct pair {
        struct tp *a, *b;
        uint32_t a_peer, b_peer; /* a's name for b, b's name for a */
        uint32_t a_gen, b_gen;   /* their generations (proxy.h), 0 when made without a proxy */
};

/* The two transports, no peer yet. */
void pair_transports(struct pair *p);

/* Each side's transport peer, connected to the other: through proxy pxa
 * (pxb) over p->a (p->b) when not NULL, as datapath.c makes them, else
 * straight through the backend under index 0. */
void pair_connect(struct pair *p, struct proxy *pxa, struct proxy *pxb);

/* Both: the transports and their peers made without a proxy. */
void pair_open(struct pair *p);

/* Registers `fd_src` (a cumem_fake of `size` bytes) at a and `fd_dst` at
 * b, and writes 64 bytes from one to the other through a's peer (cookie
 * 1), which completes: a holds its import of the destination then. */
void pair_first_write(struct pair *p, int fd_src, int fd_dst, size_t size, struct tp_mr **ret_src,
                      struct tp_mr **ret_dst, struct tp_rkey *ret_rk);

#endif
