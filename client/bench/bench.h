/* moeep-bench's pieces (bench.c): what the per-rank measurements
 * (bench-run.c, bench-normal.c, bench-nvl.c, bench-nccl.c, bench-ll.c) and the report
 * (bench-report.c) share. Every rank process fills its column of struct
 * shared; rank 0 also the result's row description; the parent reports. */
#ifndef MOEEP_BENCH_H
#define MOEEP_BENCH_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

#include <cuda_runtime_api.h>
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wstrict-prototypes"
#include <nccl.h> /* types only: libnccl is dlopen()ed (bench-nccl.c) */
#pragma GCC diagnostic pop

#include "moeep_ep.h"

#define MAX_RESULTS 96
#define MAX_ITERS 1000
/* Each timed call is queued behind a kernel that keeps the GPU busy this
 * long, so that events measure GPU time, not host launch latency. */
#define QUEUE_DELAY_NS 500000
/* Bytes written before each back-to-back series to flush the L2, as
 * DeepEP's bench() does before its timed calls. */
#define FLUSH_BYTES ((size_t)256 << 20)
/* Low-latency mode: the normal-mode buffers hold at least this many rows
 * per rank, as the NVLink floor's store (measure_nvlink) writes that many
 * rows into its slot of each peer's combine area. */
#define LL_PUT_TOKENS 128
/* Calls of one back-to-back step timed apart (the low-latency step:
 * dispatch, then combine). */
#define SERIES_MAX_PARTS 2

enum op {
        OP_DISPATCH_BF16,
        OP_DISPATCH_FP8,
        OP_DISPATCH_CACHED,
        OP_COMBINE,
        OP_NVL_FLOOR,
        OP_NVL_FLOOR_ALL,
        OP_NCCL_DISPATCH,
        OP_NCCL_DATA,
        OP_NCCL_COMBINE,
        OP_LL_DISPATCH,
        OP_LL_COMBINE,
        OP_LL_BOTH,
        OP_LL_DISPATCH_SEND,
        OP_LL_DISPATCH_RECV,
        OP_LL_COMBINE_SEND,
        OP_LL_COMBINE_RECV,
        OP_LL_BOTH_HOOKS,
};

const char *op_to_string(enum op o);

/* How a result was timed. */
enum timing {
        /* Each call after start_together: the GPU time of its kernels. */
        TIMING_KERNEL,
        /* Calls back to back as an engine issues them (time_series): no
         * barrier, busy kernel or host synchronisation between them, CUDA
         * events around each; host launch cost and host waits count. */
        TIMING_B2B,
        /* CUDA-graph replays back to back (time_series), per step. */
        TIMING_GRAPH,
};

const char *timing_to_string(enum timing t);

struct result {
        enum op op;
        enum timing timing;
        int tokens, sms;
        double us[MOEEP_MAX_RANKS];    /* per-rank median */
        double bytes[MOEEP_MAX_RANKS]; /* per-rank bytes of the convention */
        /* The operation's memory floor on each rank: the bytes it must read
         * and write in that GPU's memory (each input read once, each output
         * written once), and the kernel launches it cannot do without.
         * moved 0: no floor is defined (phases, references). */
        double moved[MOEEP_MAX_RANKS];
        int launches;
        /* Back to back and graph: each rank's median of the wall-clock time
         * its calling thread spent inside the call(s) (CLOCK_MONOTONIC),
         * and of that thread's CPU time over the same span
         * (CLOCK_THREAD_CPUTIME_ID); 0: not measured (kernel time). */
        double host_us[MOEEP_MAX_RANKS], cpu_us[MOEEP_MAX_RANKS];
        bool host_waits; /* the call waits on the host for the GPU (a fresh dispatch's counts) */
        /* The low-latency NVLink floor on each rank: the bytes the call must
         * move to or from other GPUs (the larger), over device_speed.nvl_gbps,
         * plus `launches` launches and `round_trips` cross-GPU flag round
         * trips (shared.flag_rtt_us). round_trips 0: no NVLink floor. */
        double nvl_bytes[MOEEP_MAX_RANKS];
        int round_trips;
};

/* What one GPU can do, measured by each rank in the same run: a large
 * device-to-device copy (bytes read + bytes written over its time), the
 * event-timed cost of one empty kernel and, in low-latency mode with
 * every rank on NVLink, the bytes per second it stores into every peer at
 * once with shared.nvl_sms blocks (0: not measured). */
struct device_speed {
        double copy_gbps, launch_us, nvl_gbps;
};

struct shared {
        ncclUniqueId nccl_id;
        int nccl_ready;
        int nres;
        size_t buffer_bytes; /* NVLink buffer of one rank */
        struct device_speed speed[MOEEP_MAX_RANKS];
        int nvl_sms;        /* blocks of the nvl_gbps store (the low-latency kernels' SMs) */
        double flag_rtt_us; /* median NVLink flag round trip, rank 0 to 1 and back; 0: not measured */
        /* bench_ll: (token, expert) pairs of each rank's routing whose
         * expert is at each rank, [src][dst], for the NVLink floor. */
        int64_t ll_pairs[MOEEP_MAX_RANKS][MOEEP_MAX_RANKS];
        /* bench_ll: tokens of each rank's routing with an expert at each
         * rank, [src][dst]: the rows of the summed combine. */
        int64_t ll_sums[MOEEP_MAX_RANKS][MOEEP_MAX_RANKS];
        /* bench_ll, each rank's: bit 0 its CUDA-graph captures worked, bit 1
         * the parity of its low-latency dispatches after them. */
        int graph_ok[MOEEP_MAX_RANKS];
        struct result res[MAX_RESULTS];
};

struct opts {
        int ranks, tokens, hidden, topk, experts, sms, iters, warmup;
        bool sweep, json, nccl, ll, host_start;
        uint64_t seed;
        int nodes; /* daemons the ranks are spread over ($MOEEP_HARNESS_NODES) */
};

/* One rank process's state while it measures. */
struct rank_env {
        const struct opts *o;
        struct shared *sh;
        struct moeep_client *c;
        struct moeep_ep *ep;
        int rank, ranks;
        cudaStream_t st;
        cudaEvent_t e0, e1;
        double samples[MAX_ITERS];
        void *flush; /* FLUSH_BYTES of device memory */
        /* time_series: its events, [call][part] (SERIES_MAX_PARTS + 1 per
         * call, iters calls), and samples: [part] and [parts] = the call. */
        cudaEvent_t *sev;
        double s_gpu[SERIES_MAX_PARTS + 1][MAX_ITERS], s_host[SERIES_MAX_PARTS + 1][MAX_ITERS],
                s_cpu[SERIES_MAX_PARTS + 1][MAX_ITERS];
};

typedef int (*op_fn)(struct rank_env *env, void *arg);
/* Part `part` of one call of a back-to-back series (time_series). */
typedef int (*part_fn)(struct rank_env *env, void *arg, int part);

/* Medians of a back-to-back series, per rank: [p] part p of the call,
 * [parts] the whole call (GPU: from the event before its first part to
 * the one after its last; host and CPU: the sum of its parts). */
struct series {
        double gpu_us[SERIES_MAX_PARTS + 1], host_us[SERIES_MAX_PARTS + 1], cpu_us[SERIES_MAX_PARTS + 1];
};

#define CUDA_OK(call)                                                                                   \
        do {                                                                                            \
                cudaError_t e_ = (call);                                                                \
                if (e_ != cudaSuccess) {                                                                \
                        fprintf(stderr, "rank %d: %s: %s\n", env->rank, #call, cudaGetErrorString(e_)); \
                        return -1;                                                                      \
                }                                                                                       \
        } while (0)

/* Inputs of one token count, on the device. */
struct inputs {
        void *x, *xq;
        float *sc;
        int64_t *idx;
        float *w;
        uint8_t *in_rank;
        int *per_rank, *per_expert;
        void *y, *out;
};

/* bench-run.c: timing, results and inputs, shared by every measurement. */
double median(double *v, int n);
/* Lines every rank's next call up: a daemon barrier, a busy kernel, and
 * unless --host-start a barrier kernel across the GPUs. */
void start_together(struct rank_env *env);
/* Lines a back-to-back series up: the L2 flush, a daemon barrier and
 * unless --host-start the barrier kernel, waited for: the series starts on
 * an idle GPU, every rank's within a flag's latency of the others. 0 or -1. */
int start_series(struct rank_env *env);
/* Times fn: warm-ups, then iters runs, each started on every rank together
 * (start_together); returns the median in microseconds. */
double time_op(struct rank_env *env, op_fn fn, void *arg, int *ret_err);
/* Times fn back to back as an engine calls it: warm-ups, then (after one
 * start_series) iters calls, each of `parts` parts (fn(env, arg, part)),
 * with no synchronisation between them; CUDA events around each part, the
 * host's wall-clock and thread CPU time around each fn. 0 or -1. */
int time_series(struct rank_env *env, part_fn fn, void *arg, int parts, struct series *ret);
/* time_series of an op_fn (one part). */
int time_series_op(struct rank_env *env, op_fn fn, void *arg, struct series *ret);
/* Fills this rank's column of result `slot` (rank 0 also its row), timed
 * by kernel time; no floor. */
void record(struct rank_env *env, int slot, enum op op, int tokens, int sms, double us, double bytes);
/* Makes the result in slot a back-to-back or graph one: its host and CPU
 * times, and whether the call waits for the GPU on the host. */
void record_host(struct rank_env *env, int slot, enum timing timing, double host_us, double cpu_us,
                 bool waits);
/* Gives the result in slot its memory floor: moved bytes and launches. */
void record_floor(struct rank_env *env, int slot, double moved, int launches);
/* Gives the result in slot its NVLink floor (see struct result). */
void record_nvl(struct rank_env *env, int slot, double nvl_bytes, int round_trips);
int inputs_make(struct rank_env *env, struct inputs *in, int T);
void inputs_free(struct inputs *in);
/* This rank's device_speed, timed like the operations. */
int measure_speed(struct rank_env *env);

/* The measurements: each adds its results from *slot on and advances it;
 * 0, or nonzero when a call failed. */
int bench_moeep(struct rank_env *env, int *slot, int T, int sms, bool full); /* bench-normal.c */
int bench_floor(struct rank_env *env, int *slot, int T);                     /* bench-nvl.c */
int bench_nccl(struct rank_env *env, int *slot, int T);                      /* bench-nccl.c */
int bench_ll(struct rank_env *env, int *slot, int T);                        /* bench-ll.c */
/* bench-nvl.c: the low-latency NVLink speed (device_speed.nvl_gbps,
 * shared.nvl_sms, shared.flag_rtt_us), once per run, collective; left 0
 * with one rank or with ranks at other daemons. */
int measure_nvlink(struct rank_env *env);

/* bench-report.c: the table (or JSON) of every result, in the parent. */
void report(const struct opts *o, const struct shared *sh, int ranks);

#endif
