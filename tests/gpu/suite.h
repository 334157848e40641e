/* The driver shared by the GPU test programs: options, the skip without a
 * GPU, one job per rank count with one process per rank (harness.h), and
 * the per-case result table ending in "N passed, N failed". */
#ifndef MOEEP_TEST_SUITE_H
#define MOEEP_TEST_SUITE_H

#include <stdint.h>

#include "moeep.h"

#define SUITE_MAX_CASES 32

struct suite {
        const char *name;          /* program name, for messages and the job name */
        const char *default_ranks; /* --ranks default, e.g. "1,2,4" */
        int ncases;                /* at most SUITE_MAX_CASES */
        const char *(*case_name)(int ci);
        /* Runs case ci on rank `me` of R (every rank runs the same cases in
         * the same order); 0 on success, else -1 with `msg` (200 bytes) set. */
        int (*run_case)(struct moeep_client *c, int me, int R, int ci, uint64_t seed, char *msg);
};

/* Inside run_case, whose `msg` they fill and whose cleanup label is `out`:
 * FAIL(fmt, ...) records the failure and goes to out; CK(call) fails with
 * the CUDA error of a cuda* call, MK(call) with moeep_ep_error(ep) when a
 * moeep call returns -errno. */
#define FAIL(...)                                \
        do {                                     \
                snprintf(msg, 200, __VA_ARGS__); \
                goto out;                        \
        } while (0)
#define CK(call)                                                       \
        do {                                                           \
                cudaError_t e_ = (call);                               \
                if (e_ != cudaSuccess)                                 \
                        FAIL("%s: %s", #call, cudaGetErrorString(e_)); \
        } while (0)
#define MK(call)                                                   \
        do {                                                       \
                int r_ = (call);                                   \
                if (r_ < 0)                                        \
                        FAIL("%s: %s", #call, moeep_ep_error(ep)); \
        } while (0)

/* Usage: PROGRAM [--ranks LIST] [--seed N] [--case NAME] [--moeepd PATH].
 * Exits 77 (meson: skipped) without a GPU; 0 when every case passed. */
int suite_main(const struct suite *s, int argc, char **argv);

#endif
