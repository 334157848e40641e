/* The driver shared by the GPU test programs: options, the skip without a
 * GPU, one job per rank count with one process per rank (harness.h), and
 * the per-case result table ending in "N passed, N failed". ep_fail_test.c,
 * which drives its jobs itself, shares the start (suite_start) and the
 * --ranks list (suite_next_ranks). */
#ifndef MOEEP_TEST_SUITE_H
#define MOEEP_TEST_SUITE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <time.h>

#include "moeep.h"

#define SUITE_MAX_CASES 32

struct harness;

struct suite {
        const char *name;          /* program name, for messages and the job name */
        const char *default_ranks; /* --ranks default, e.g. "1,2,4" */
        int ncases;                /* at most SUITE_MAX_CASES */
        const char *(*case_name)(int ci);
        /* Runs case ci on rank `me` of R (every rank runs the same cases in
         * the same order); 0 on success, else -1 with `msg` (200 bytes) set. */
        int (*run_case)(struct moeep_client *c, int me, int R, int ci, uint64_t seed, char *msg);
};

/* Usage: PROGRAM [--ranks LIST] [--seed N] [--case NAME] [--moeepd PATH].
 * Exits 77 (meson: skipped) without a GPU; 0 when every case passed. */
int suite_main(const struct suite *s, int argc, char **argv);

/* The command line of a GPU test program, after suite_start(). */
struct suite_args {
        const char *ranks;  /* --ranks: comma-separated rank counts */
        uint64_t seed;      /* --seed, else random */
        const char *only;   /* --case: run only the case of this name; NULL: all */
        const char *moeepd; /* --moeepd, NULL: the build's */
};

/* Reads --ranks (default `default_ranks`), --seed, --moeepd and, with
 * `with_case`, --case; without a GPU prints "SKIP: no CUDA device"; then
 * prints "NAME: seed 0x..., N GPUs" and starts the harness `h` with
 * `shared_bytes` of shared memory. Returns 0 to go on, else the program's
 * exit status: 2 (usage), 77 (skipped) or 1 (no harness). */
int suite_start(const char *name, const char *default_ranks, bool with_case, int argc, char **argv,
                size_t shared_bytes, struct harness *h, struct suite_args *ret);

/* The next count of a --ranks list at *list, which moves past it and its
 * commas; false at the list's end. */
bool suite_next_ranks(const char **list, int *ret_ranks);

/* For the programs that drive their jobs themselves (ep_fail_test.c,
 * ep_shrink_test.c): CLOCK_MONOTONIC in ns (the same clock in every
 * process), a sleep, and a wait on a counter in memory shared with the
 * other ranks: true once *v >= want, false after timeout_ms. */
static inline int64_t now_ns(void) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static inline void sleep_ms(int ms) {
        struct timespec ts = { .tv_sec = ms / 1000, .tv_nsec = (long)(ms % 1000) * 1000000L };
        nanosleep(&ts, NULL);
}

static inline bool wait_shared(volatile int *v, int want, int timeout_ms) {
        for (int i = 0; i < timeout_ms; i++) {
                if (__atomic_load_n(v, __ATOMIC_ACQUIRE) >= want)
                        return true;
                sleep_ms(1);
        }
        return false;
}

#endif
