/* moeep-bench (bench.c): the normal-mode figures (dispatch BF16, FP8 and
 * cached, combine). */
#include <stdint.h>
#include <stdlib.h>

#include "bench.h"
#include "ep-internal.h"
#include "bench/bench_kernels.h"

/* Arguments of one configuration of the moeep operations. */
struct moe_case {
        struct moeep_dispatch_args da;
        struct moeep_dispatch_result dr;
        struct moeep_combine_args ca;
};

static int op_dispatch(struct rank_env *env, void *arg) {
        struct moe_case *m = arg;
        struct moeep_dispatch_result r;
        int rc = moeep_dispatch(env->ep, &m->da, &r, env->st);
        if (rc < 0) {
                fprintf(stderr, "rank %d: dispatch: %s\n", env->rank, moeep_ep_error(env->ep));
                return rc;
        }
        if (m->da.handle == NULL) {
                moeep_ep_handle_free(m->dr.handle);
                m->dr = r;
        }
        return 0;
}

/* The blocks whose trace stamps moeep-bench prints, at most. */
#define TRACE_MAX_BLOCKS 64

/* With $MOEEP_KERNEL_TRACE, on rank 0, for at most TRACE_MAX_BLOCKS blocks:
 * copies `words` trace words from word `at` into out, once the GPU is idle,
 * and zeroes them there for the next call. False when there is nothing to
 * print. */
static bool trace_take(struct rank_env *env, int sms, size_t at, size_t words, uint64_t *out) {
        struct moeep_ctx ctx;

        if (env->rank != 0 || ep_internal_ctx(env->ep, &ctx) < 0 || !ctx.trace || sms > TRACE_MAX_BLOCKS)
                return false;
        cudaDeviceSynchronize();
        cudaMemcpy(out, ctx.trace + at, sizeof(uint64_t) * words, cudaMemcpyDeviceToHost);
        cudaMemset(ctx.trace + at, 0, sizeof(uint64_t) * words);
        return true;
}

/* With $MOEEP_KERNEL_TRACE, rank 0 prints when each block of its last
 * combine ended its roles (us after the first block started). */
static void print_trace(struct rank_env *env, int T, int sms) {
        uint64_t t[MOEEP_TRACE_STAMPS * TRACE_MAX_BLOCKS], t0 = UINT64_MAX;

        if (!trace_take(env, sms, 0, MOEEP_TRACE_STAMPS * (size_t)sms, t))
                return;
        for (int b = 0; b < sms; b++)
                if (t[MOEEP_TRACE_STAMPS * b] && t[MOEEP_TRACE_STAMPS * b] < t0)
                        t0 = t[MOEEP_TRACE_STAMPS * b];
        fprintf(stderr, "trace tokens %d: block start/send/produce/consume us:", T);
        for (int b = 0; b < sms; b++) {
                const uint64_t *bt = t + MOEEP_TRACE_STAMPS * b;
                fprintf(stderr, " [%d %.0f", b, (bt[0] - t0) / 1e3);
                for (int k = 1; k < MOEEP_TRACE_STAMPS; k++)
                        if (bt[k] > t0)
                                fprintf(stderr, " %.0f", (bt[k] - t0) / 1e3);
                fprintf(stderr, "]");
        }
        fprintf(stderr, "\n");
}

static double us_after(uint64_t t, uint64_t t0) {
        return (double)(int64_t)(t - t0) / 1e3;
}

static int cmp_u64(const void *a, const void *b) {
        uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
        return (x > y) - (x < y);
}

/* With $MOEEP_KERNEL_TRACE, rank 0 prints the phases of its last fresh
 * dispatch, in us after notify started: notify's (counts, histogram,
 * positions, count exchange, end), then the dispatch blocks' start and end
 * of their rows (first / median / last), the last block's wait for its
 * peers and its end. */
static void print_dispatch_trace(struct rank_env *env, int T, int sms) {
        uint64_t n[MOEEP_TRACE_NOTIFY_STAMPS], d[MOEEP_TRACE_STAMPS * TRACE_MAX_BLOCKS],
                start[TRACE_MAX_BLOCKS], rows[TRACE_MAX_BLOCKS], waited = 0, end = 0;

        if (!trace_take(env, sms, MOEEP_TRACE_NOTIFY, MOEEP_TRACE_NOTIFY_STAMPS, n) ||
            !trace_take(env, sms, MOEEP_TRACE_DISPATCH, MOEEP_TRACE_STAMPS * (size_t)sms, d))
                return;
        for (int b = 0; b < sms; b++) {
                const uint64_t *bt = d + MOEEP_TRACE_STAMPS * b;
                start[b] = bt[0];
                rows[b] = bt[1];
                waited = bt[2] > waited ? bt[2] : waited;
                end = bt[3] > end ? bt[3] : end;
        }
        qsort(start, (size_t)sms, sizeof(uint64_t), cmp_u64);
        qsort(rows, (size_t)sms, sizeof(uint64_t), cmp_u64);
        const uint64_t t0 = n[0];
        fprintf(stderr,
                "trace dispatch tokens %d, us: notify counts %.1f histogram %.1f positions %.1f exchange "
                "%.1f "
                "end %.1f; blocks start %.1f/%.1f/%.1f rows done %.1f/%.1f/%.1f; peers %.1f end %.1f\n",
                T, us_after(n[1], t0), us_after(n[2], t0), us_after(n[3], t0), us_after(n[4], t0),
                us_after(n[5], t0), us_after(start[0], t0), us_after(start[sms / 2], t0),
                us_after(start[sms - 1], t0), us_after(rows[0], t0), us_after(rows[sms / 2], t0),
                us_after(rows[sms - 1], t0), us_after(waited, t0), us_after(end, t0));
}

static int op_combine(struct rank_env *env, void *arg) {
        struct moe_case *m = arg;
        int rc = moeep_combine(env->ep, &m->ca, env->st);
        if (rc < 0)
                fprintf(stderr, "rank %d: combine: %s\n", env->rank, moeep_ep_error(env->ep));
        return rc;
}

/* The call just timed by kernel time (the row in *slot - 1) timed back to
 * back (time_series), in the next row, with the same bytes and floors.
 * `waits`: the call waits on the host for the GPU (a fresh dispatch's
 * count exchange). */
static int add_b2b(struct rank_env *env, int *slot, op_fn fn, struct moe_case *m, bool waits) {
        const struct result *k = &env->sh->res[*slot - 1];
        struct series s = { 0 };
        int rc = time_series_op(env, fn, m, &s);

        /* The row's description is rank 0's, which wrote it (record). */
        record(env, *slot, k->op, k->tokens, k->sms, s.gpu_us[0], k->bytes[env->rank]);
        record_host(env, *slot, TIMING_B2B, s.host_us[0], s.cpu_us[0], waits);
        record_floor(env, (*slot)++, k->moved[env->rank], k->launches);
        return rc;
}

/* The moeep figures of one (tokens, SMs) point: with `full` every
 * operation, each timed by kernel time and back to back; else dispatch
 * BF16 and combine by kernel time. */
int bench_moeep(struct rank_env *env, int *slot, int T, int sms, bool full) {
        const struct opts *o = env->o;
        struct inputs in = { 0 };
        struct moe_case m = { 0 };
        int err = 0, nrecv;
        double us, fp8_row = o->hidden + (o->hidden / 128) * 4.0;

        if (moeep_ep_set_num_sms(env->ep, sms) < 0 || inputs_make(env, &in, T) < 0)
                return -1;
        m.da = (struct moeep_dispatch_args){
                .x = in.x,
                .x_type = MOEEP_DTYPE_BF16,
                .num_tokens = T,
                .is_token_in_rank = in.in_rank,
                .topk_idx = in.idx,
                .topk_idx_type = MOEEP_INDEX_INT64,
                .topk_weights = in.w,
                .num_topk = o->topk,
        };
        us = time_op(env, op_dispatch, &m, &err);
        print_dispatch_trace(env, T, sms);
        nrecv = m.dr.num_recv_tokens;
        record(env, *slot, OP_DISPATCH_BF16, T, sms, us, (double)nrecv * o->hidden * 2);
        record_floor(env, (*slot)++, (double)(T + nrecv) * o->hidden * 2, 1);
        if (full)
                err |= add_b2b(env, slot, op_dispatch, &m, true);

        m.ca = (struct moeep_combine_args){ .x = in.y, .handle = m.dr.handle, .out = in.out };
        us = time_op(env, op_combine, &m, &err);
        record(env, *slot, OP_COMBINE, T, sms, us, (double)nrecv * o->hidden * 2);
        record_floor(env, (*slot)++, (double)(T + nrecv) * o->hidden * 2, 1);
        print_trace(env, T, sms);
        if (full) {
                struct moeep_ep_handle *h = m.dr.handle;
                err |= add_b2b(env, slot, op_combine, &m, false);
                m.da.handle = h;
                us = time_op(env, op_dispatch, &m, &err);
                record(env, *slot, OP_DISPATCH_CACHED, T, sms, us, (double)nrecv * o->hidden * 2);
                record_floor(env, (*slot)++, (double)(T + nrecv) * o->hidden * 2, 1);
                err |= add_b2b(env, slot, op_dispatch, &m, false);
                m.da.handle = NULL;
                m.da.x = in.xq;
                m.da.x_type = MOEEP_DTYPE_FP8_E4M3;
                m.da.x_scales = in.sc;
                us = time_op(env, op_dispatch, &m, &err);
                record(env, *slot, OP_DISPATCH_FP8, T, sms, us, (double)m.dr.num_recv_tokens * fp8_row);
                record_floor(env, (*slot)++, (double)(T + m.dr.num_recv_tokens) * fp8_row, 1);
                err |= add_b2b(env, slot, op_dispatch, &m, true);
        }
        moeep_ep_handle_free(m.dr.handle);
        inputs_free(&in);
        return err;
}
