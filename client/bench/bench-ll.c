/* moeep-bench (bench.c): the low-latency figures (moeep-bench ll), timed
 * three ways (kernel time, back to back, CUDA-graph replay), each beside
 * its memory floor and its NVLink floor. */
#include <stdlib.h>

#include "bench.h"
#include "ep-internal.h"

/* The arguments of the low-latency calls at one token count, and what the
 * last dispatch returned (its combine's handle). */
struct ll_case {
        struct moeep_ll_dispatch_args da;
        struct moeep_ll_combine_args ca;
        struct moeep_ll_dispatch_result res;
        struct moeep_ll_hook hook;
};

/* What each whole call must move, for its row's floors. */
enum ll_kind {
        LL_DISPATCH,
        LL_COMBINE,
        LL_BOTH,       /* dispatch + combine */
        LL_BOTH_HOOKS, /* dispatch + combine with both receive hooks (4 launches) */
        LL_KINDS,
        LL_PHASE = LL_KINDS, /* a hook mode phase: no floor */
};

struct ll_floors {
        double bytes[LL_KINDS]; /* of the convention (FP8 rows + scales received, BF16 rows sent back) */
        double moved[LL_KINDS]; /* memory floor */
        double nvl[LL_KINDS];   /* NVLink floor: bytes to or from other GPUs */
        int launches[LL_KINDS], trips[LL_KINDS];
        bool has_nvl;
};

static int ll_failed(struct rank_env *env, const char *what) {
        fprintf(stderr, "rank %d: low-latency %s failed: %s\n", env->rank, what, moeep_ep_error(env->ep));
        return -1;
}

/* Part of one step as an engine calls it (time_series): 0 the dispatch,
 * 1 its combine; with hooks (da/ca.return_recv_hook) each runs its own
 * receive hook right away. */
static int ll_part(struct rank_env *env, void *arg, int part) {
        struct ll_case *l = arg;

        if (part == 0) {
                if (moeep_ll_dispatch(env->ep, &l->da, &l->res, &l->hook, env->st) < 0 ||
                    (l->da.return_recv_hook && moeep_ll_hook_run(env->ep, &l->hook, env->st) < 0))
                        return ll_failed(env, "dispatch");
                return 0;
        }
        l->ca.handle = &l->res.handle;
        if (moeep_ll_combine(env->ep, &l->ca, &l->hook, env->st) < 0 ||
            (l->ca.return_recv_hook && moeep_ll_hook_run(env->ep, &l->hook, env->st) < 0))
                return ll_failed(env, "combine");
        return 0;
}

/* One whole step (time_series): the dispatch, then its combine. */
static int ll_step(struct rank_env *env, void *arg, int part) {
        (void)part;
        return ll_part(env, arg, 0) < 0 ? -1 : ll_part(env, arg, 1);
}

/* Kernel time of the step (start_together before each), as in a decode
 * step: dispatch and combine timed apart and together, then with hooks
 * each of the four phases. t: [7][iters] in the order of ll_ops. */
static int ll_kernel_time(struct rank_env *env, struct ll_case *l, double (*t)[MAX_ITERS]) {
        const struct opts *o = env->o;
        cudaEvent_t ev[5] = { NULL };
        int err = 0;

        for (int i = 0; i < 5; i++)
                CUDA_OK(cudaEventCreate(&ev[i]));
        for (int mode = 0; mode < 2 && !err; mode++) {
                l->da.return_recv_hook = l->ca.return_recv_hook = mode == 1;
                for (int i = 0; i < o->warmup + o->iters && !err; i++) {
                        float ms[4] = { 0 };
                        start_together(env);
                        cudaEventRecord(ev[0], env->st);
                        err |= moeep_ll_dispatch(env->ep, &l->da, &l->res, &l->hook, env->st) < 0;
                        cudaEventRecord(ev[1], env->st);
                        if (mode == 1)
                                err |= moeep_ll_hook_run(env->ep, &l->hook, env->st) < 0;
                        cudaEventRecord(ev[2], env->st);
                        l->ca.handle = &l->res.handle;
                        err |= moeep_ll_combine(env->ep, &l->ca, &l->hook, env->st) < 0;
                        cudaEventRecord(ev[3], env->st);
                        if (mode == 1)
                                err |= moeep_ll_hook_run(env->ep, &l->hook, env->st) < 0;
                        cudaEventRecord(ev[4], env->st);
                        if (cudaEventSynchronize(ev[4]) != cudaSuccess)
                                err = 1;
                        for (int k = 0; k < 4; k++)
                                cudaEventElapsedTime(&ms[k], ev[k], ev[k + 1]);
                        if (i < o->warmup)
                                continue;
                        int j = i - o->warmup;
                        if (mode == 0) {
                                t[0][j] = ms[0] * 1e3;
                                t[1][j] = (ms[2] + ms[3]) * 1e3;
                                t[2][j] = (ms[0] + ms[1] + ms[2] + ms[3]) * 1e3;
                        } else
                                for (int k = 0; k < 4; k++)
                                        t[3 + k][j] = ms[k] * 1e3;
                }
        }
        l->da.return_recv_hook = l->ca.return_recv_hook = false;
        for (int i = 0; i < 5; i++)
                cudaEventDestroy(ev[i]);
        return err ? ll_failed(env, "call") : 0;
}

/* Captures two steps (with both receive hooks when `hooks`) into a graph.
 * Two: every dispatch alternates the buffer set, so a graph of an even
 * number of them leaves every later call, replays included, on the set
 * the other ranks use. The capture always ends, also after a failure. */
static int ll_capture(struct rank_env *env, struct ll_case *l, bool hooks, cudaGraphExec_t *ret_exec) {
        cudaGraph_t g = NULL;
        cudaError_t e;
        int rc = 0;

        CUDA_OK(cudaStreamSynchronize(env->st));
        CUDA_OK(cudaStreamBeginCapture(env->st, cudaStreamCaptureModeThreadLocal));
        l->da.return_recv_hook = l->ca.return_recv_hook = hooks;
        for (int i = 0; i < 4 && rc == 0; i++)
                rc = ll_part(env, l, i % 2);
        l->da.return_recv_hook = l->ca.return_recv_hook = false;
        e = cudaStreamEndCapture(env->st, &g);
        if (rc == 0 && e == cudaSuccess)
                e = cudaGraphInstantiate(ret_exec, g, 0);
        if (g)
                cudaGraphDestroy(g);
        if (rc == 0 && e != cudaSuccess) {
                fprintf(stderr, "rank %d: capturing the low-latency step%s: %s\n", env->rank,
                        hooks ? " with hooks" : "", cudaGetErrorString(e));
                rc = -1;
        }
        (void)cudaGetLastError();
        return rc;
}

static int ll_replay(struct rank_env *env, void *arg, int part) {
        cudaError_t e = cudaGraphLaunch(*(cudaGraphExec_t *)arg, env->st);

        (void)part;
        if (e != cudaSuccess) {
                fprintf(stderr, "rank %d: replaying the low-latency graph: %s\n", env->rank,
                        cudaGetErrorString(e));
                return -1;
        }
        return 0;
}

/* The step's graphs (without hooks, with them) replayed back to back;
 * ret[h].gpu_us[1] etc. are per replay (two steps). Collective: the
 * graphs are timed only where every rank captured both; *ret_ok says so.
 * -1 when the ranks' buffer sets may have gone apart (a capture failed
 * at different calls on different ranks). */
static int ll_graphs(struct rank_env *env, struct ll_case *l, struct series ret[2], bool *ret_ok) {
        cudaGraphExec_t exec[2] = { NULL, NULL };
        int ok = 1, err = 0;

        for (int h = 0; h < 2 && ok; h++)
                ok = ll_capture(env, l, h == 1, &exec[h]) == 0;
        env->sh->graph_ok[env->rank] = ok | (int)(env->ep->ll_calls & 1) << 1;
        moeep_job_barrier(env->c);
        for (int k = 0; k < env->ranks; k++) {
                ok &= env->sh->graph_ok[k] & 1;
                if ((env->sh->graph_ok[k] ^ env->sh->graph_ok[env->rank]) & 2)
                        err = -1;
        }
        /* Nobody writes graph_ok again before every rank read it: the next
         * bench_ll's write comes after this barrier. */
        moeep_job_barrier(env->c);
        if (!ok && env->rank == 0)
                fprintf(stderr, "moeep-bench: a CUDA-graph capture failed; no graph figures\n");
        if (err)
                fprintf(stderr, "rank %d: the ranks' low-latency buffer sets went apart\n", env->rank);
        for (int h = 0; h < 2 && ok && !err; h++)
                err = time_series(env, ll_replay, &exec[h], 1, &ret[h]);
        for (int h = 0; h < 2; h++)
                if (exec[h])
                        cudaGraphExecDestroy(exec[h]);
        *ret_ok = ok;
        return err;
}

/* The (token, expert) pairs that cross NVLink on this rank, the larger of
 * those it sends (its routing's pairs whose expert is at another rank) and
 * those it receives (the other ranks' pairs for its experts), counted from
 * every rank's routing (shared.ll_pairs); in *sums the same for the rows
 * of the summed combine, one per token and expert rank (shared.ll_sums).
 * Collective. */
static int64_t ll_remote_pairs(struct rank_env *env, const struct inputs *in, int T, int64_t *sums) {
        const int K = env->o->topk, epr = env->o->experts / env->ranks;
        int64_t *idx = malloc(sizeof(int64_t) * (size_t)T * K + 8), *row = env->sh->ll_pairs[env->rank];
        int64_t *srow = env->sh->ll_sums[env->rank];
        int64_t out = 0, back = 0, sout = 0, sback = 0;
        bool ok = idx && cudaMemcpy(idx, in->idx, sizeof(int64_t) * (size_t)T * K, cudaMemcpyDeviceToHost) ==
                                 cudaSuccess;

        for (int d = 0; d < env->ranks; d++)
                row[d] = srow[d] = 0;
        for (int t = 0; ok && t < T; t++) {
                uint32_t at = 0; /* the ranks of the token's experts */
                for (int k = 0; k < K; k++) {
                        const int64_t e = idx[(size_t)t * K + k];
                        if (e >= 0 && e < env->o->experts) {
                                row[e / epr]++;
                                at |= 1u << (e / epr);
                        }
                }
                for (int d = 0; d < env->ranks; d++)
                        srow[d] += at >> d & 1;
        }
        free(idx);
        moeep_job_barrier(env->c);
        for (int r = 0; r < env->ranks; r++)
                if (r != env->rank) {
                        out += row[r];
                        back += env->sh->ll_pairs[r][env->rank];
                        sout += srow[r];
                        sback += env->sh->ll_sums[r][env->rank];
                }
        moeep_job_barrier(env->c); /* every rank read before anyone writes again */
        if (!ok) {
                fprintf(stderr, "rank %d: reading the routing back failed\n", env->rank);
                return -1;
        }
        *sums = sout > sback ? sout : sback;
        return out > back ? out : back;
}

/* Records one row with the floors of its kind. */
static void ll_record(struct rank_env *env, int *slot, const struct ll_floors *f, enum op op,
                      enum ll_kind kind, double bytes, int T, int sms, double us) {
        record(env, *slot, op, T, sms, us, kind < LL_KINDS ? f->bytes[kind] : bytes);
        if (kind < LL_KINDS) {
                record_floor(env, *slot, f->moved[kind], f->launches[kind]);
                if (f->has_nvl)
                        record_nvl(env, *slot, f->nvl[kind], f->trips[kind]);
        }
        (*slot)++;
}

/* Low-latency figures at T tokens: kernel time (dispatch and combine apart
 * and together, and the four phases of the hook mode), the step back to
 * back (dispatch, combine, both) and its CUDA-graph replay (without hooks
 * and with), per step. */
int bench_ll(struct rank_env *env, int *slot, int T) {
        const struct opts *o = env->o;
        const int L = o->experts / env->ranks, S = env->ranks * (o->sweep ? 256 : o->tokens), H = o->hidden;
        double(*t)[MAX_ITERS] = calloc(7, sizeof(*t));
        struct inputs in = { 0 };
        struct ll_case l = { 0 };
        struct series split, whole, graph[2];
        struct ll_floors f = { 0 };
        struct moeep_ctx ctx = { 0 };
        int pairs_in = 0, *counts = calloc((size_t)L, sizeof(int)), err = 0;
        int64_t remote, remote_sums;
        bool graph_ok = false;
        void *y = NULL;

        if (!t || !counts || inputs_make(env, &in, T) < 0)
                return -1;
        CUDA_OK(cudaMalloc(&y, (size_t)L * S * H * 2));
        CUDA_OK(cudaMemset(y, 0x3c, (size_t)L * S * H * 2));
        l.da = (struct moeep_ll_dispatch_args){
                .x = in.x,
                .num_tokens = T,
                .topk_idx = in.idx,
                .topk_idx_type = MOEEP_INDEX_INT64,
                .num_topk = o->topk,
                .use_fp8 = true,
        };
        l.ca = (struct moeep_ll_combine_args){
                .x = y,
                .topk_idx = in.idx,
                .topk_idx_type = MOEEP_INDEX_INT64,
                .topk_weights = in.w,
                .num_topk = o->topk,
                .out = in.out,
        };
        /* Back to back: the step with events around the dispatch and the
         * combine apart, and with events around the whole step only (as
         * DeepEP's bench() of the step, no event between the calls). */
        if ((remote = ll_remote_pairs(env, &in, T, &remote_sums)) < 0 || ll_kernel_time(env, &l, t) < 0 ||
            time_series(env, ll_part, &l, 2, &split) < 0 || time_series(env, ll_step, &l, 1, &whole) < 0 ||
            ll_graphs(env, &l, graph, &graph_ok) < 0) {
                err = -1;
                goto out;
        }
        CUDA_OK(cudaMemcpy(counts, l.res.recv_count, sizeof(int) * L, cudaMemcpyDeviceToHost));
        for (int le = 0; le < L; le++)
                pairs_in += counts[le];

        ep_internal_ctx(env->ep, &ctx); /* the low-latency kernels' SM count, the debug bits */

        /* Bytes: FP8 rows + scales received; BF16 rows sent back. Floors of
         * the whole calls: dispatch reads the BF16 tokens once and writes
         * the FP8 pairs and scales; combine reads the expert outputs once
         * and writes the BF16 tokens; over NVLink, the rows of the pairs
         * whose expert is at another rank (the dispatch: one row per token
         * and other rank, and each pair's 8-byte entry, when it sends
         * tokens once per rank; the combine: one row per token and expert
         * rank, and the top-k weights, when it sums at the expert ranks),
         * one flag round trip per call. */
        const double fp8_row = H + H / 128 * 4, x_bytes = (double)T * H * 2;
        const bool summed = moeep_ll_sums_step(&ctx, (long)T * env->ranks);
        f.bytes[LL_DISPATCH] = pairs_in * fp8_row;
        f.bytes[LL_COMBINE] = (double)pairs_in * H * 2;
        f.moved[LL_DISPATCH] = x_bytes + f.bytes[LL_DISPATCH];
        f.moved[LL_COMBINE] = f.bytes[LL_COMBINE] + x_bytes;
        f.nvl[LL_DISPATCH] = moeep_ll_dedup_call(&ctx, T, o->topk)
                                     ? (double)remote_sums * fp8_row + remote * 8.0
                                     : remote * fp8_row;
        f.nvl[LL_COMBINE] = summed ? (double)remote_sums * H * 2 + (double)T * o->topk * 4 * (env->ranks - 1)
                                   : (double)remote * H * 2;
        f.launches[LL_DISPATCH] = f.launches[LL_COMBINE] = f.trips[LL_DISPATCH] = f.trips[LL_COMBINE] = 1;
        for (int k = LL_BOTH; k <= LL_BOTH_HOOKS; k++) {
                f.bytes[k] = f.bytes[LL_DISPATCH] + f.bytes[LL_COMBINE];
                f.moved[k] = f.moved[LL_DISPATCH] + f.moved[LL_COMBINE];
                f.nvl[k] = f.nvl[LL_DISPATCH] + f.nvl[LL_COMBINE];
                f.launches[k] = k == LL_BOTH ? 2 : 4;
                f.trips[k] = 2;
        }
        f.has_nvl = env->ranks > 1;

        static const enum op ops[7] = { OP_LL_DISPATCH,      OP_LL_COMBINE,       OP_LL_BOTH,
                                        OP_LL_DISPATCH_SEND, OP_LL_DISPATCH_RECV, OP_LL_COMBINE_SEND,
                                        OP_LL_COMBINE_RECV };
        static const enum ll_kind kinds[7] = { LL_DISPATCH, LL_COMBINE, LL_BOTH, LL_PHASE,
                                               LL_PHASE,    LL_PHASE,   LL_PHASE };
        const double phase_bytes[7] = {
                0, 0, 0, f.bytes[LL_DISPATCH], f.bytes[LL_DISPATCH], f.bytes[LL_COMBINE], f.bytes[LL_COMBINE]
        };
        for (int k = 0; k < 7; k++)
                ll_record(env, slot, &f, ops[k], kinds[k], phase_bytes[k], T, ctx.ll_num_sms,
                          median(t[k], o->iters));
        for (int p = 0; p < 3; p++) {
                const struct series *b = p < 2 ? &split : &whole;
                const int i = p < 2 ? p : 0;
                ll_record(env, slot, &f, ops[p], kinds[p], 0, T, ctx.ll_num_sms, b->gpu_us[i]);
                record_host(env, *slot - 1, TIMING_B2B, b->host_us[i], b->cpu_us[i], false);
        }
        for (int h = 0; h < 2 && graph_ok; h++) { /* a replay is two steps */
                ll_record(env, slot, &f, h ? OP_LL_BOTH_HOOKS : OP_LL_BOTH, h ? LL_BOTH_HOOKS : LL_BOTH, 0, T,
                          ctx.ll_num_sms, graph[h].gpu_us[1] / 2);
                record_host(env, *slot - 1, TIMING_GRAPH, graph[h].host_us[1] / 2, graph[h].cpu_us[1] / 2,
                            false);
        }
out:
        cudaFree(y);
        free(counts);
        free(t);
        inputs_free(&in);
        return err;
}
