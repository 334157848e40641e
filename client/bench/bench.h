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

#define MAX_RESULTS 64
#define MAX_ITERS 1000
/* Each timed call is queued behind a kernel that keeps the GPU busy this
 * long, so that events measure GPU time, not host launch latency. */
#define QUEUE_DELAY_NS 500000

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
};

const char *op_to_string(enum op o);

struct result {
        enum op op;
        int tokens, sms;
        double us[MOEEP_MAX_RANKS];    /* per-rank median */
        double bytes[MOEEP_MAX_RANKS]; /* per-rank bytes of the convention */
        /* The operation's memory floor on each rank: the bytes it must read
         * and write in that GPU's memory (each input read once, each output
         * written once), and the kernel launches it cannot do without.
         * moved 0: no floor is defined (phases, references). */
        double moved[MOEEP_MAX_RANKS];
        int launches;
};

/* What one GPU can do, measured by each rank in the same run: a large
 * device-to-device copy (bytes read + bytes written over its time) and
 * the event-timed cost of one empty kernel. */
struct device_speed {
        double copy_gbps, launch_us;
};

struct shared {
        ncclUniqueId nccl_id;
        int nccl_ready;
        int nres;
        size_t buffer_bytes; /* NVLink buffer of one rank */
        struct device_speed speed[MOEEP_MAX_RANKS];
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
};

typedef int (*op_fn)(struct rank_env *env, void *arg);

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
/* Times fn: warm-ups, then iters runs, each started on every rank together
 * (start_together); returns the median in microseconds. */
double time_op(struct rank_env *env, op_fn fn, void *arg, int *ret_err);
/* Fills this rank's column of result `slot` (rank 0 also its row); no floor. */
void record(struct rank_env *env, int slot, enum op op, int tokens, int sms, double us, double bytes);
/* Gives the result in slot its memory floor: moved bytes and launches. */
void record_floor(struct rank_env *env, int slot, double moved, int launches);
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

/* bench-report.c: the table (or JSON) of every result, in the parent. */
void report(const struct opts *o, const struct shared *sh, int ranks);

#endif
