/* moeep-bench (bench.c): the low-latency figures (moeep-bench ll). */
#include <stdlib.h>

#include "bench.h"
#include "ep-internal.h"

/* Low-latency figures at T tokens: dispatch (FP8) and combine (BF16) timed
 * apart and together, and the four phases of the hook mode. Each
 * iteration is dispatch + combine, as in a decode step. */
int bench_ll(struct rank_env *env, int *slot, int T) {
        const struct opts *o = env->o;
        const int L = o->experts / env->ranks, S = env->ranks * (o->sweep ? 256 : o->tokens), H = o->hidden;
        double t_phase[7][MAX_ITERS];
        struct inputs in = { 0 };
        cudaEvent_t ev[5];
        int pairs_in = 0, *counts = calloc((size_t)L, sizeof(int)), err = 0;
        void *y = NULL;

        if (inputs_make(env, &in, T) < 0)
                return -1;
        CUDA_OK(cudaMalloc(&y, (size_t)L * S * H * 2));
        CUDA_OK(cudaMemset(y, 0x3c, (size_t)L * S * H * 2));
        for (int i = 0; i < 5; i++)
                CUDA_OK(cudaEventCreate(&ev[i]));
        struct moeep_ll_dispatch_args da = {
                .x = in.x,
                .num_tokens = T,
                .topk_idx = in.idx,
                .topk_idx_type = MOEEP_INDEX_INT64,
                .num_topk = o->topk,
                .use_fp8 = true,
        };
        struct moeep_ll_combine_args ca = {
                .x = y,
                .topk_idx = in.idx,
                .topk_idx_type = MOEEP_INDEX_INT64,
                .topk_weights = in.w,
                .num_topk = o->topk,
                .out = in.out,
        };
        struct moeep_ll_dispatch_result res;
        struct moeep_ll_hook hook;

        for (int mode = 0; mode < 2 && !err; mode++) {
                da.return_recv_hook = ca.return_recv_hook = mode == 1;
                for (int i = 0; i < o->warmup + o->iters && !err; i++) {
                        float ms[4] = { 0 };
                        start_together(env);
                        cudaEventRecord(ev[0], env->st);
                        err |= moeep_ll_dispatch(env->ep, &da, &res, &hook, env->st) < 0;
                        cudaEventRecord(ev[1], env->st);
                        if (mode == 1)
                                err |= moeep_ll_hook_run(env->ep, &hook, env->st) < 0;
                        cudaEventRecord(ev[2], env->st);
                        ca.handle = &res.handle;
                        err |= moeep_ll_combine(env->ep, &ca, &hook, env->st) < 0;
                        cudaEventRecord(ev[3], env->st);
                        if (mode == 1)
                                err |= moeep_ll_hook_run(env->ep, &hook, env->st) < 0;
                        cudaEventRecord(ev[4], env->st);
                        if (cudaEventSynchronize(ev[4]) != cudaSuccess)
                                err = 1;
                        for (int k = 0; k < 4; k++)
                                cudaEventElapsedTime(&ms[k], ev[k], ev[k + 1]);
                        if (i < o->warmup)
                                continue;
                        int j = i - o->warmup;
                        if (mode == 0) {
                                t_phase[0][j] = ms[0] * 1e3;
                                t_phase[1][j] = (ms[2] + ms[3]) * 1e3;
                                t_phase[2][j] = (ms[0] + ms[1] + ms[2] + ms[3]) * 1e3;
                        } else
                                for (int k = 0; k < 4; k++)
                                        t_phase[3 + k][j] = ms[k] * 1e3;
                }
        }
        if (err) {
                fprintf(stderr, "rank %d: low-latency call failed: %s\n", env->rank, moeep_ep_error(env->ep));
                return -1;
        }
        cudaMemcpy(counts, res.recv_count, sizeof(int) * L, cudaMemcpyDeviceToHost);
        for (int le = 0; le < L; le++)
                pairs_in += counts[le];
        /* Bytes: FP8 rows + scales received; BF16 rows sent back. */
        const double disp_bytes = (double)pairs_in * (H + H / 128 * 4), comb_bytes = (double)pairs_in * H * 2;
        const enum op ops[7] = { OP_LL_DISPATCH,      OP_LL_COMBINE,       OP_LL_BOTH,
                                 OP_LL_DISPATCH_SEND, OP_LL_DISPATCH_RECV, OP_LL_COMBINE_SEND,
                                 OP_LL_COMBINE_RECV };
        const double bytes[7] = { disp_bytes, comb_bytes, disp_bytes + comb_bytes, disp_bytes, disp_bytes,
                                  comb_bytes, comb_bytes };
        struct moeep_ctx ctx = { 0 };
        ep_internal_ctx(env->ep, &ctx); /* the low-latency kernels' SM count */
        /* Floors of the whole calls: dispatch reads the BF16 tokens once and
         * writes the FP8 pairs and scales; combine reads the expert outputs
         * once and writes the BF16 tokens. The hook phases get none. */
        const double x_bytes = (double)T * H * 2, moved[3] = { x_bytes + disp_bytes, comb_bytes + x_bytes,
                                                               2 * x_bytes + disp_bytes + comb_bytes };
        for (int k = 0; k < 7; k++) {
                record(env, *slot, ops[k], T, ctx.ll_num_sms, median(t_phase[k], o->iters), bytes[k]);
                if (k < 3)
                        record_floor(env, *slot, moved[k], k == 2 ? 2 : 1);
                (*slot)++;
        }
        for (int i = 0; i < 5; i++)
                cudaEventDestroy(ev[i]);
        cudaFree(y);
        free(counts);
        inputs_free(&in);
        return 0;
}
