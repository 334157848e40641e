/* moeep-bench: normal-mode dispatch/combine figures in DeepEP's convention,
 * with the NVLink floor and an NCCL all-to-all reference measured in the
 * same run on the same GPUs, and beside each moeep figure its memory floor:
 * the bytes the call must read and write in one GPU's memory over that
 * GPU's device-to-device copy speed, plus its kernel launches, both
 * measured at the start of the run (struct device_speed).
 *
 * One process per GPU, each attached through a private moeepd (or the one
 * at --socket). Times are taken with CUDA events around each call, per
 * rank: after a daemon barrier, the call is queued behind a 500 us busy
 * kernel (so the host's launch latency is not counted) and a barrier
 * kernel across the GPUs (so every rank's call starts at the same time,
 * not skewed by when each process left the daemon barrier; --host-start
 * leaves it out): kernel time. The moeep calls are also timed back to back
 * as engines issue them (time_series: no synchronisation between calls,
 * events around each, the host's time inside each call beside), and the
 * low-latency step replayed from a CUDA graph; in low-latency mode each
 * figure also gets an NVLink floor (bench-nvl.c). The table shows
 * min/median/max over ranks of each rank's median over --iters runs.
 *
 *   dispatch GB/s = bytes of recv_x on a rank (own tokens included) / time
 *   combine  GB/s = bytes of the rows a rank sends back / time
 *   FP8 counts the FP8 bytes plus the float scales.
 *
 * bench.c holds the command line and each rank's sequence; the measurements
 * are bench-normal.c, bench-nvl.c (the NVLink floor), bench-nccl.c and
 * bench-ll.c, over the timing and inputs of bench-run.c; bench-report.c
 * prints the table. */
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>

#include "bench.h"
#include "harness.h"

static int rank_fn(struct moeep_client *c, int rank, int ranks, void *shared, void *arg) {
        const struct opts *o = arg;
        struct rank_env *env = calloc(1, sizeof(*env));
        int max_tokens = o->sweep ? (o->tokens > 8192 ? o->tokens : 8192) : o->tokens, slot = 0, err = 0;
        struct moeep_ep_config cfg = {
                .max_tokens_per_rank = max_tokens,
                .hidden = o->hidden,
                .num_experts = o->experts,
                .max_topk = o->topk,
                .num_sms = o->sms,
        };
        if (o->ll) {
                /* Low-latency buffers for the largest call; normal buffers
                 * as big as the NCCL reference's layout needs, and at
                 * least LL_PUT_TOKENS rows, which measure_nvlink's store
                 * writes to each peer. */
                cfg.ll_max_tokens = o->sweep ? 256 : o->tokens;
                cfg.max_tokens_per_rank =
                        cfg.ll_max_tokens > LL_PUT_TOKENS ? cfg.ll_max_tokens : LL_PUT_TOKENS;
        }

        env->o = o;
        env->sh = shared;
        env->c = c;
        env->rank = rank;
        env->ranks = ranks;
        if (moeep_ep_create(c, &cfg, &env->ep) < 0) {
                fprintf(stderr, "rank %d: creating the endpoint: %s\n", rank, moeep_client_error(c));
                free(env);
                return 1;
        }
        if (rank == 0)
                env->sh->buffer_bytes = moeep_ep_buffer_bytes(env->ep);
        CUDA_OK(cudaStreamCreateWithFlags(&env->st, cudaStreamNonBlocking));
        CUDA_OK(cudaEventCreate(&env->e0));
        CUDA_OK(cudaEventCreate(&env->e1));
        CUDA_OK(cudaMalloc(&env->flush, FLUSH_BYTES));
        env->sev = calloc((size_t)(SERIES_MAX_PARTS + 1) * o->iters, sizeof(*env->sev));
        if (!env->sev)
                return 1;
        for (int i = 0; i < (SERIES_MAX_PARTS + 1) * o->iters; i++)
                CUDA_OK(cudaEventCreate(&env->sev[i]));
        err |= measure_speed(env);

        if (o->ll) {
                static const int toks[] = { 1, 16, 64, 128, 256 };
                int ll_err;
                err |= measure_nvlink(env);
                ll_err = bench_ll(env, &slot, o->tokens);
                if (o->nccl)
                        err |= bench_nccl(env, &slot, o->tokens);
                /* A failed low-latency run (a failed graph capture fails on
                 * every rank) may leave the ranks' buffer sets apart: no
                 * more low-latency calls after one. */
                for (size_t i = 0; o->sweep && !ll_err && i < sizeof(toks) / sizeof(toks[0]); i++)
                        if (toks[i] != o->tokens)
                                ll_err = bench_ll(env, &slot, toks[i]);
                err |= ll_err;
                goto done;
        }
        err |= bench_moeep(env, &slot, o->tokens, o->sms, true);
        err |= bench_floor(env, &slot, o->tokens);
        if (o->nccl)
                err |= bench_nccl(env, &slot, o->tokens);
        if (o->sweep) {
                static const int toks[] = { 512, 1024, 2048, 4096, 8192 };
                static const int sms[] = { 8, 16, 24, 32 };
                for (size_t i = 0; i < sizeof(toks) / sizeof(toks[0]); i++)
                        err |= bench_moeep(env, &slot, toks[i], o->sms, false);
                for (size_t i = 0; i < sizeof(sms) / sizeof(sms[0]); i++)
                        err |= bench_moeep(env, &slot, o->tokens, sms[i], false);
        }
done:
        if (rank == 0)
                env->sh->nres = slot;
        err |= moeep_ep_check(env->ep) < 0;
        if (err)
                fprintf(stderr, "rank %d: %s\n", rank, moeep_ep_error(env->ep));
        moeep_job_barrier(c);
        moeep_ep_destroy(env->ep);
        free(env);
        return err ? 1 : 0;
}

static void usage(FILE *f) {
        fprintf(f, "usage: moeep-bench [ll] [--ranks N] [--tokens N] [--hidden N] [--topk N] [--experts N] "
                   "[--sms N]\n"
                   "                   [--iters N] [--warmup N] [--sweep] [--no-nccl] [--json] [--seed N] "
                   "[--host-start]\n"
                   "                   [--moeepd PATH | --socket PATH]\n");
}

static void help(void) {
        usage(stdout);
        printf("\nNormal-mode dispatch (BF16, FP8, cached) and combine, or with 'll' the low-latency\n"
               "dispatch (FP8) and combine (BF16), one process per rank (rank i on GPU i %% GPUs), beside\n"
               "the NVLink floor and an NCCL all-to-all reference measured in the same run.\n"
               "\n"
               "timing (column):\n"
               "  kernel  each call after a daemon barrier, a 500 us busy kernel and a GPU barrier\n"
               "          (not with --host-start): the GPU time of its kernels, CUDA events around it\n"
               "  b2b     the same calls back to back as an engine issues them (no barrier, busy kernel\n"
               "          or host sync between them), after warm-ups and one start per series (L2 flush,\n"
               "          daemon barrier, GPU barrier, waited for); CUDA events around each call, as\n"
               "          DeepEP's bench(): host launch cost and host waits count where the GPU waits\n"
               "          for them. Low-latency: the step (dispatch, then its combine) as one call, and\n"
               "          each alone (a second series, an event between them); normal mode: every\n"
               "          operation at --tokens and --sms (not at --sweep's other points)\n"
               "  graph   (ll) two steps captured once in a CUDA graph (without hooks, and with both\n"
               "          receive hooks), replayed back to back; events around each replay, per step\n"
               "columns:\n"
               "  time us, GB/s  min/median/max over ranks of each rank's median of --iters calls\n"
               "  floor us       memory floor: bytes the call must read and write in one GPU's memory\n"
               "                 over its copy speed, plus its kernel launches (measured in the run)\n"
               "  nvl us         (ll) NVLink floor: the bytes of the pairs whose expert is at another\n"
               "                 rank (FP8 row + scales, BF16 row back; the larger of sent and received)\n"
               "                 over the all-peer store speed with the low-latency kernels' SMs, plus\n"
               "                 the launches and one flag round trip per call between two GPUs (all\n"
               "                 measured in the run); '-' with one rank\n"
               "  x floor, x nvl the time over each floor\n"
               "  host us        (b2b, graph) median wall-clock time the calling thread spends inside\n"
               "                 the call(s); '*': the call waits on the host for the GPU (a fresh\n"
               "                 dispatch's count exchange), which host us includes\n"
               "  cpu us         the same span's thread CPU time (near host us: spinning; below: asleep)\n"
               "--json prints the same rows, with min/median/max of host_us and cpu_us, 0 where none.\n");
}

int main(int argc, char **argv) {
        struct opts o = { .tokens = 4096,
                          .hidden = 7168,
                          .topk = 8,
                          .experts = 256,
                          .sms = MOEEP_DEFAULT_NUM_SMS,
                          .iters = 30,
                          .warmup = 5,
                          .nccl = true };
        const char *moeepd = NULL, *socket = NULL;
        struct harness h;
        int opt, ngpu, failed;
        bool tokens_set = false, experts_set = false;
        static const struct option lo[] = {
                { "ranks", required_argument, NULL, 'r' },
                { "tokens", required_argument, NULL, 't' },
                { "hidden", required_argument, NULL, 'H' },
                { "topk", required_argument, NULL, 'k' },
                { "experts", required_argument, NULL, 'e' },
                { "sms", required_argument, NULL, 'm' },
                { "iters", required_argument, NULL, 'i' },
                { "warmup", required_argument, NULL, 'w' },
                { "sweep", no_argument, NULL, 'S' },
                { "no-nccl", no_argument, NULL, 'N' },
                { "json", no_argument, NULL, 'j' },
                { "seed", required_argument, NULL, 's' },
                { "moeepd", required_argument, NULL, 'd' },
                { "socket", required_argument, NULL, 'x' },
                { "host-start", no_argument, NULL, 'B' },
                { "help", no_argument, NULL, 'h' },
                { NULL, 0, NULL, 0 },
        };

        while ((opt = getopt_long(argc, argv, "", lo, NULL)) != -1) {
                switch (opt) {
                case 'r':
                        o.ranks = atoi(optarg);
                        break;
                case 't':
                        o.tokens = atoi(optarg);
                        tokens_set = true;
                        break;
                case 'H':
                        o.hidden = atoi(optarg);
                        break;
                case 'k':
                        o.topk = atoi(optarg);
                        break;
                case 'e':
                        o.experts = atoi(optarg);
                        experts_set = true;
                        break;
                case 'm':
                        o.sms = atoi(optarg);
                        break;
                case 'i':
                        o.iters = atoi(optarg);
                        break;
                case 'w':
                        o.warmup = atoi(optarg);
                        break;
                case 'S':
                        o.sweep = true;
                        break;
                case 'N':
                        o.nccl = false;
                        break;
                case 'B':
                        o.host_start = true;
                        break;
                case 'j':
                        o.json = true;
                        break;
                case 's':
                        o.seed = strtoull(optarg, NULL, 0);
                        break;
                case 'd':
                        moeepd = optarg;
                        break;
                case 'x':
                        socket = optarg;
                        break;
                case 'h':
                        help();
                        return 0;
                default:
                        usage(stderr);
                        return 2;
                }
        }
        if (optind < argc && strcmp(argv[optind], "ll") == 0) {
                /* Low-latency mode: the standard shape (docs/benchmarks.md,
                 * "Conventions") unless given. */
                o.ll = true;
                if (!tokens_set)
                        o.tokens = 128;
                if (!experts_set)
                        o.experts = 288;
                optind++;
        }
        if (optind < argc) {
                usage(stderr);
                return 2;
        }
        if (o.iters < 1 || o.iters > MAX_ITERS || o.warmup < 0 || o.tokens < 1) {
                fprintf(stderr, "moeep-bench: --iters must be in 1..%d, --warmup >= 0, --tokens >= 1\n",
                        MAX_ITERS);
                return 2;
        }
        ngpu = harness_gpu_count();
        if (ngpu < 1) {
                fprintf(stderr, "moeep-bench: no CUDA device\n");
                return 1;
        }
        if (o.ranks == 0)
                o.ranks = ngpu > MOEEP_MAX_RANKS ? MOEEP_MAX_RANKS : ngpu;
        /* More ranks than GPUs share them; the harness warns that the
         * times are then no performance figures. */
        if (o.ranks > MOEEP_MAX_RANKS) {
                fprintf(stderr, "moeep-bench: --ranks %d, at most %d\n", o.ranks, MOEEP_MAX_RANKS);
                return 2;
        }
        if (!o.seed && getrandom(&o.seed, sizeof(o.seed), 0) != sizeof(o.seed))
                o.seed = 1;
        if (harness_init(&h, moeepd, socket, sizeof(struct shared)) < 0)
                return 1;
        /* Across daemons the GPU start barrier cannot reach every rank. */
        o.nodes = h.nodes;
        if (o.nodes == 2)
                o.host_start = true;
        failed = harness_run(&h, o.ranks, "moeep-bench", rank_fn, &o, 1800);
        if (!failed)
                report(&o, h.shared, o.ranks);
        harness_fini(&h);
        if (failed)
                fprintf(stderr, "moeep-bench: %d ranks failed\n", failed);
        return failed ? 1 : 0;
}
