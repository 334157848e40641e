/* moeep-bench (bench.c): timing, results and inputs shared by every
 * measurement. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench.h"
#include "ep-internal.h"
#include "bench/bench_kernels.h"

static uint64_t mix(uint64_t *s) {
        uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
        return z ^ (z >> 31);
}

/* Routing as DeepEP's tests: top-k of |randn| + 1 scores, about 1% of the
 * entries masked to -1. */
static void make_routing(int64_t *idx, int T, int K, int E, uint64_t seed) {
        float *score = malloc(sizeof(float) * (size_t)E);
        for (int t = 0; t < T; t++) {
                for (int e = 0; e < E; e++) {
                        double u1 = ((mix(&seed) >> 11) + 1.0) / 9007199254740993.0,
                               u2 = (mix(&seed) >> 11) / 9007199254740992.0;
                        score[e] = (float)(fabs(sqrt(-2 * log(u1)) * cos(2 * M_PI * u2)) + 1.0);
                }
                for (int k = 0; k < K; k++) {
                        int best = 0;
                        for (int e = 1; e < E; e++)
                                if (score[e] > score[best])
                                        best = e;
                        idx[(size_t)t * K + k] = best;
                        score[best] = -1;
                }
                for (int k = 0; k < K; k++)
                        if (mix(&seed) % 100 == 0)
                                idx[(size_t)t * K + k] = -1;
        }
        free(score);
}

static int cmp_double(const void *a, const void *b) {
        double x = *(const double *)a, y = *(const double *)b;
        return x < y ? -1 : x > y;
}

double median(double *v, int n) {
        qsort(v, (size_t)n, sizeof(double), cmp_double);
        return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/* Lines every rank's next call up: a daemon barrier, the busy kernel, and
 * unless --host-start a barrier kernel across the GPUs, so that the GPUs
 * leave it within an NVLink flag's latency of each other. */
void start_together(struct rank_env *env) {
        struct moeep_ctx ctx;

        moeep_job_barrier(env->c);
        moeep_launch_delay(QUEUE_DELAY_NS, env->st);
        if (!env->o->host_start && ep_internal_ctx(env->ep, &ctx) == 0)
                moeep_launch_barrier(&ctx, env->st);
}

/* Times fn: warm-ups, then iters runs, each started on every rank together
 * (start_together); returns the median in microseconds. */
double time_op(struct rank_env *env, op_fn fn, void *arg, int *ret_err) {
        int n = env->o->iters;
        for (int i = 0; i < env->o->warmup + n; i++) {
                float ms = 0;
                start_together(env);
                cudaEventRecord(env->e0, env->st);
                if (fn(env, arg) < 0) {
                        *ret_err = -1;
                        return 0;
                }
                cudaEventRecord(env->e1, env->st);
                if (cudaEventSynchronize(env->e1) != cudaSuccess) {
                        *ret_err = -1;
                        return 0;
                }
                cudaEventElapsedTime(&ms, env->e0, env->e1);
                if (i >= env->o->warmup)
                        env->samples[i - env->o->warmup] = ms * 1000.0;
        }
        return median(env->samples, n);
}

/* Lines a back-to-back series up (see bench.h). DeepEP's bench() also
 * starts its timed calls on an idle GPU, after a synchronize and the L2
 * flush: no busy kernel here, which would let the host queue the first
 * calls ahead and hide what they cost it. */
int start_series(struct rank_env *env) {
        struct moeep_ctx ctx;

        CUDA_OK(cudaMemsetAsync(env->flush, 0, FLUSH_BYTES, env->st));
        CUDA_OK(cudaStreamSynchronize(env->st));
        if (moeep_job_barrier(env->c) < 0) {
                fprintf(stderr, "rank %d: barrier: %s\n", env->rank, moeep_client_error(env->c));
                return -1;
        }
        if (!env->o->host_start && ep_internal_ctx(env->ep, &ctx) == 0 &&
            moeep_launch_barrier(&ctx, env->st) != 0) {
                fprintf(stderr, "rank %d: the GPU barrier failed to launch\n", env->rank);
                return -1;
        }
        CUDA_OK(cudaStreamSynchronize(env->st));
        return 0;
}

static double clock_us(clockid_t clock) {
        struct timespec ts;
        clock_gettime(clock, &ts);
        return (double)ts.tv_sec * 1e6 + (double)ts.tv_nsec / 1e3;
}

/* MOEEP_BENCH_DUMP=DIR: every series' per-call GPU times, one JSON line
 * per series (numbered in the order this rank timed them) in
 * DIR/moeep-bench-rank<r>.jsonl, to see tails that medians hide. */
static void dump_series(struct rank_env *env, int parts, int n) {
        static int index;
        const char *dir = getenv("MOEEP_BENCH_DUMP");
        char path[4096];
        FILE *f;

        if (!dir ||
            snprintf(path, sizeof(path), "%s/moeep-bench-rank%d.jsonl", dir, env->rank) >=
                    (int)sizeof(path) ||
            !(f = fopen(path, "a")))
                return;
        fprintf(f, "{\"series\": %d, \"parts\": %d, \"gpu_us\": [", index++, parts);
        for (int p = 0; p <= parts; p++) {
                fprintf(f, "%s[", p ? ", " : "");
                for (int i = 0; i < n; i++)
                        fprintf(f, "%s%.2f", i ? ", " : "", env->s_gpu[p][i]);
                fprintf(f, "]");
        }
        fprintf(f, "]}\n");
        fclose(f);
}

/* Times fn back to back (see bench.h), as DeepEP's bench() does: events
 * recorded around each call, the calls issued one after the other, one
 * synchronisation at the end; the time of a call is between its own two
 * events, so the bench's loop between calls is not counted, and what the
 * host spends in a call counts whenever the GPU waits for it. */
int time_series(struct rank_env *env, part_fn fn, void *arg, int parts, struct series *ret) {
        const int n = env->o->iters, stride = SERIES_MAX_PARTS + 1;
        cudaEvent_t *ev = env->sev;

        for (int i = 0; i < env->o->warmup; i++)
                for (int p = 0; p < parts; p++)
                        if (fn(env, arg, p) < 0)
                                return -1;
        if (start_series(env) < 0)
                return -1;
        for (int i = 0; i < n; i++) {
                env->s_host[parts][i] = env->s_cpu[parts][i] = 0;
                for (int p = 0; p < parts; p++) {
                        CUDA_OK(cudaEventRecord(ev[i * stride + p], env->st));
                        /* The thread's CPU clock is a system call: read
                         * outside the wall-clock span it would lengthen. */
                        const double c0 = clock_us(CLOCK_THREAD_CPUTIME_ID), w0 = clock_us(CLOCK_MONOTONIC);
                        const int rc = fn(env, arg, p);
                        const double w1 = clock_us(CLOCK_MONOTONIC), c1 = clock_us(CLOCK_THREAD_CPUTIME_ID);
                        if (rc < 0)
                                return -1;
                        env->s_host[p][i] = w1 - w0;
                        env->s_cpu[p][i] = c1 - c0;
                        env->s_host[parts][i] += w1 - w0;
                        env->s_cpu[parts][i] += c1 - c0;
                }
                CUDA_OK(cudaEventRecord(ev[i * stride + parts], env->st));
        }
        CUDA_OK(cudaStreamSynchronize(env->st));
        for (int i = 0; i < n; i++) {
                float ms = 0;
                for (int p = 0; p < parts; p++) {
                        CUDA_OK(cudaEventElapsedTime(&ms, ev[i * stride + p], ev[i * stride + p + 1]));
                        env->s_gpu[p][i] = ms * 1e3;
                }
                CUDA_OK(cudaEventElapsedTime(&ms, ev[i * stride], ev[i * stride + parts]));
                env->s_gpu[parts][i] = ms * 1e3;
        }
        dump_series(env, parts, n);
        for (int p = 0; p <= parts; p++) {
                ret->gpu_us[p] = median(env->s_gpu[p], n);
                ret->host_us[p] = median(env->s_host[p], n);
                ret->cpu_us[p] = median(env->s_cpu[p], n);
        }
        return 0;
}

struct one_part {
        op_fn fn;
        void *arg;
};

static int part_of_op(struct rank_env *env, void *arg, int part) {
        struct one_part *o = arg;
        (void)part;
        return o->fn(env, o->arg);
}

int time_series_op(struct rank_env *env, op_fn fn, void *arg, struct series *ret) {
        struct one_part o = { fn, arg };
        return time_series(env, part_of_op, &o, 1, ret);
}

void record(struct rank_env *env, int slot, enum op op, int tokens, int sms, double us, double bytes) {
        struct result *r = &env->sh->res[slot];
        if (env->rank == 0) {
                r->op = op;
                r->timing = TIMING_KERNEL;
                r->tokens = tokens;
                r->sms = sms;
                r->launches = 0;
                r->host_waits = false;
                r->round_trips = 0;
        }
        r->us[env->rank] = us;
        r->bytes[env->rank] = bytes;
        r->moved[env->rank] = 0;
        r->host_us[env->rank] = r->cpu_us[env->rank] = 0;
        r->nvl_bytes[env->rank] = 0;
}

void record_host(struct rank_env *env, int slot, enum timing timing, double host_us, double cpu_us,
                 bool waits) {
        struct result *r = &env->sh->res[slot];
        if (env->rank == 0) {
                r->timing = timing;
                r->host_waits = waits;
        }
        r->host_us[env->rank] = host_us;
        r->cpu_us[env->rank] = cpu_us;
}

/* Gives the result in slot its memory floor: moved bytes and launches. */
void record_floor(struct rank_env *env, int slot, double moved, int launches) {
        env->sh->res[slot].moved[env->rank] = moved;
        if (env->rank == 0)
                env->sh->res[slot].launches = launches;
}

void record_nvl(struct rank_env *env, int slot, double nvl_bytes, int round_trips) {
        env->sh->res[slot].nvl_bytes[env->rank] = nvl_bytes;
        if (env->rank == 0)
                env->sh->res[slot].round_trips = round_trips;
}

struct copy_arg {
        void *dst, *src;
        size_t bytes;
};

static int op_copy(struct rank_env *env, void *arg) {
        struct copy_arg *c = arg;
        return cudaMemcpyAsync(c->dst, c->src, c->bytes, cudaMemcpyDeviceToDevice, env->st) == cudaSuccess
                       ? 0
                       : -1;
}

static int op_launch(struct rank_env *env, void *arg) {
        (void)arg;
        return moeep_launch_delay(0, env->st) ? -1 : 0;
}

int inputs_make(struct rank_env *env, struct inputs *in, int T) {
        const struct opts *o = env->o;
        size_t nx = (size_t)T * o->hidden;
        uint16_t *hx = malloc(nx * 2 + 2);
        int64_t *hidx = malloc(sizeof(int64_t) * (size_t)T * o->topk + 8);
        float *hw = malloc(sizeof(float) * (size_t)T * o->topk + 4);
        uint64_t s = o->seed ^ ((uint64_t)env->rank << 32) ^ (uint64_t)T;

        for (size_t i = 0; i < nx; i++)
                hx[i] = (uint16_t)(0x3c00 + (mix(&s) & 0x3ff) -
                                   (mix(&s) & 0x8000)); /* random bf16 in about ±[0.0078, 0.016) */
        for (size_t i = 0; i < (size_t)T * o->topk; i++)
                hw[i] = (float)((mix(&s) >> 40) / 16777216.0);
        make_routing(hidx, T, o->topk, o->experts, s);
        CUDA_OK(cudaMalloc(&in->x, nx * 2 + 16));
        CUDA_OK(cudaMalloc(&in->xq, nx + 16));
        CUDA_OK(cudaMalloc((void **)&in->sc, sizeof(float) * (size_t)T * (o->hidden / 128) + 16));
        CUDA_OK(cudaMalloc((void **)&in->idx, sizeof(int64_t) * (size_t)T * o->topk + 16));
        CUDA_OK(cudaMalloc((void **)&in->w, sizeof(float) * (size_t)T * o->topk + 16));
        CUDA_OK(cudaMalloc((void **)&in->in_rank, (size_t)T * env->ranks + 16));
        CUDA_OK(cudaMalloc((void **)&in->per_rank, sizeof(int) * MOEEP_MAX_RANKS));
        CUDA_OK(cudaMalloc((void **)&in->per_expert, sizeof(int) * (size_t)o->experts));
        CUDA_OK(cudaMalloc(&in->y, (size_t)env->ranks * T * o->hidden * 2 + 16));
        CUDA_OK(cudaMalloc(&in->out, nx * 2 + 16));
        CUDA_OK(cudaMemcpy(in->x, hx, nx * 2, cudaMemcpyHostToDevice));
        CUDA_OK(cudaMemcpy(in->xq, hx, nx, cudaMemcpyHostToDevice)); /* any bytes: fp8 payload */
        CUDA_OK(cudaMemset(in->sc, 0, sizeof(float) * (size_t)T * (o->hidden / 128)));
        CUDA_OK(cudaMemcpy(in->idx, hidx, sizeof(int64_t) * (size_t)T * o->topk, cudaMemcpyHostToDevice));
        CUDA_OK(cudaMemcpy(in->w, hw, sizeof(float) * (size_t)T * o->topk, cudaMemcpyHostToDevice));
        CUDA_OK(cudaMemset(in->y, 0x3c, (size_t)env->ranks * T * o->hidden * 2));
        free(hx);
        free(hidx);
        free(hw);
        if (moeep_get_dispatch_layout(env->ep, in->idx, MOEEP_INDEX_INT64, T, o->topk, in->per_rank,
                                      in->per_expert, in->in_rank, env->st) < 0)
                return -1;
        CUDA_OK(cudaStreamSynchronize(env->st));
        return 0;
}

void inputs_free(struct inputs *in) {
        void *p[] = { in->x,       in->xq,       in->sc,         in->idx, in->w,
                      in->in_rank, in->per_rank, in->per_expert, in->y,   in->out };
        for (size_t i = 0; i < sizeof(p) / sizeof(p[0]); i++)
                cudaFree(p[i]);
        memset(in, 0, sizeof(*in));
}

/* Measures this rank's device_speed, timed like the operations. The copy
 * moves 256 MiB each way, far past the L2, so it runs at memory speed. */
int measure_speed(struct rank_env *env) {
        struct copy_arg c = { .bytes = (size_t)256 << 20 };
        struct device_speed *d = &env->sh->speed[env->rank];
        int err = 0;
        double us;

        CUDA_OK(cudaMalloc(&c.dst, c.bytes));
        CUDA_OK(cudaMalloc(&c.src, c.bytes));
        CUDA_OK(cudaMemset(c.src, 0x5a, c.bytes));
        us = time_op(env, op_copy, &c, &err);
        d->copy_gbps = us > 0 ? 2.0 * (double)c.bytes / (us * 1e3) : 0;
        d->launch_us = time_op(env, op_launch, NULL, &err);
        cudaFree(c.dst);
        cudaFree(c.src);
        return err ? -1 : 0;
}
