/* See suite.h. */
#include <getopt.h>
#include <inttypes.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>

#include "harness.h"
#include "suite.h"

/* Written by the rank processes (MAP_SHARED), read by the driver. */
struct suite_shared {
        int result[SUITE_MAX_CASES][MOEEP_MAX_RANKS]; /* 0 pass, 1 fail, -1 not run */
        char msg[SUITE_MAX_CASES][MOEEP_MAX_RANKS][200];
};

struct suite_run {
        const struct suite *s;
        uint64_t seed;
        const char *only; /* run only the case of this name, or NULL */
};

static bool selected(const struct suite_run *run, int ci) {
        return !run->only || strcmp(run->only, run->s->case_name(ci)) == 0;
}

static int rank_fn(struct moeep_client *c, int rank, int ranks, void *shared, void *arg) {
        struct suite_shared *sh = shared;
        const struct suite_run *run = arg;
        int failed = 0;

        for (int ci = 0; ci < run->s->ncases; ci++) {
                if (!selected(run, ci))
                        continue;
                int r = run->s->run_case(c, rank, ranks, ci, run->seed, sh->msg[ci][rank]);
                sh->result[ci][rank] = r ? 1 : 0;
                failed |= r != 0;
        }
        return failed;
}

int suite_start(const char *name, const char *default_ranks, bool with_case, int argc, char **argv,
                size_t shared_bytes, struct harness *h, struct suite_args *ret) {
        struct suite_args a = { .ranks = default_ranks };
        bool have_seed = false;
        int ngpu, opt;
        struct option lo[] = {
                { "ranks", required_argument, NULL, 'r' },
                { "seed", required_argument, NULL, 's' },
                { "moeepd", required_argument, NULL, 'd' },
                { "case", required_argument, NULL, 'c' },
                { NULL, 0, NULL, 0 },
        };

        if (!with_case)
                lo[3] = (struct option){ NULL, 0, NULL, 0 };
        while ((opt = getopt_long(argc, argv, "", lo, NULL)) != -1) {
                switch (opt) {
                case 'r':
                        a.ranks = optarg;
                        break;
                case 's':
                        a.seed = strtoull(optarg, NULL, 0);
                        have_seed = true;
                        break;
                case 'c':
                        a.only = optarg;
                        break;
                case 'd':
                        a.moeepd = optarg;
                        break;
                default:
                        fprintf(stderr, "usage: %s [--ranks %s] [--seed N]%s [--moeepd PATH]\n", argv[0],
                                default_ranks, with_case ? " [--case NAME]" : "");
                        return 2;
                }
        }
        ngpu = harness_gpu_count();
        if (ngpu < 1) {
                printf("SKIP: no CUDA device\n");
                return 77;
        }
        if (!have_seed && getrandom(&a.seed, sizeof(a.seed), 0) != sizeof(a.seed))
                a.seed = 0x5eed;
        printf("%s: seed 0x%" PRIx64 ", %d GPUs\n", name, a.seed, ngpu);
        if (harness_init(h, a.moeepd, NULL, shared_bytes) < 0)
                return 1;
        *ret = a;
        return 0;
}

bool suite_next_ranks(const char **list, int *ret_ranks) {
        const char *q = *list;

        if (!*q)
                return false;
        *ret_ranks = (int)strtol(q, (char **)&q, 10);
        while (*q == ',')
                q++;
        *list = q;
        return true;
}

int suite_main(const struct suite *s, int argc, char **argv) {
        struct suite_args a;
        struct suite_run run = { .s = s };
        struct harness h;
        int passed = 0, failed = 0, R, rc;

        if (s->ncases > SUITE_MAX_CASES) {
                fprintf(stderr, "%s: %d cases, the driver holds %d\n", s->name, s->ncases, SUITE_MAX_CASES);
                return 2;
        }
        rc = suite_start(s->name, s->default_ranks, true, argc, argv, sizeof(struct suite_shared), &h, &a);
        if (rc != 0)
                return rc;
        run.seed = a.seed;
        run.only = a.only;
        for (const char *q = a.ranks; suite_next_ranks(&q, &R);) {
                struct suite_shared *sh = h.shared;

                /* More ranks than GPUs share them, rank i on GPU i % ngpu
                 * (harness_run, which also sets the MPS share). */
                if (R < 1 || R > MOEEP_MAX_RANKS) {
                        printf("SKIP ranks=%d: 1..%d ranks\n", R, MOEEP_MAX_RANKS);
                        continue;
                }
                memset(sh->result, 0xff, sizeof(sh->result));
                memset(sh->msg, 0, sizeof(sh->msg));
                int lost = harness_run(&h, R, s->name, rank_fn, &run, 600);
                for (int ci = 0; ci < s->ncases; ci++) {
                        int bad = 0;
                        if (!selected(&run, ci))
                                continue;
                        for (int r = 0; r < R; r++)
                                if (sh->result[ci][r] != 0) {
                                        bad = 1;
                                        printf("  rank %d: %s\n", r,
                                               sh->result[ci][r] < 0 ? "did not run" : sh->msg[ci][r]);
                                }
                        printf("%s ranks=%d %s\n", bad ? "FAIL" : "ok  ", R, s->case_name(ci));
                        bad ? failed++ : passed++;
                }
                if (lost)
                        printf("  (%d rank processes failed)\n", lost);
                fflush(stdout);
        }
        harness_fini(&h);
        printf("%d passed, %d failed\n", passed, failed);
        return failed ? 1 : 0;
}
