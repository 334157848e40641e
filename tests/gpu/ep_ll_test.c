/* Low-latency dispatch/combine against a CPU reference, one process per rank
 * through a real moeepd. Slots fill in arrival order, so the check is per
 * local expert as a set: every expected (rank, token, k) pair exactly once,
 * with its row (bitwise for BF16; for FP8 the dequantised error bound
 * |x - q * scale| <= 2^-4 |x| + 2^-9 scale and the scale rule). Combine uses
 * an expert-dependent function of each token. Outputs are poisoned before
 * every call. Exit 77 (skipped) without a GPU.
 *
 * Usage: ep_ll_test [--ranks 2,4] [--seed N] [--case NAME] [--moeepd PATH] */
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>

#include <cuda_runtime_api.h>

#include "harness.h"
#include "suite.h"
#include "case.h"
#include "moeep_ep.h"
#include "ref.h"

struct tcase {
        const char *name;
        int hidden, experts, topk, max_tokens;
        bool fp8, round_scale, hook, idx32;
        int fixed_tokens; /* > 0: every rank sends exactly this many */
        bool empty_rank;  /* rank 1 sends nothing */
        bool graph;       /* captured once (hook + zero-copy combine), replayed with new data */
        /* On a stream of its own: every other case runs on the process's
         * one stream, where after the first cooperative launch of both
         * phases the launches go plain (kernels/ll/coop.cuh); a second
         * stream makes them cooperative from then on, so this case comes
         * last. */
        bool own_stream;
};

#define CASE(n, h, e, k, t, ...) \
        { .name = n, .hidden = h, .experts = e, .topk = k, .max_tokens = t, __VA_ARGS__ }
static const struct tcase cases[] = {
        CASE("bf16-h7168-top8-e288", 7168, 288, 8, 128),
        CASE("fp8-h7168-top8-e288-hook", 7168, 288, 8, 128, .fp8 = true, .hook = true),
        CASE("fp8-round-scale-h4096-top6-e64", 4096, 64, 6, 96, .fp8 = true, .round_scale = true,
             .idx32 = true),
        CASE("bf16-h2048-one-token", 2048, 32, 4, 64, .fixed_tokens = 1, .hook = true),
        CASE("fp8-h7168-rank1-empty", 7168, 128, 8, 128, .fp8 = true, .empty_rank = true),
        CASE("bf16-h7168-graph-zero-copy", 7168, 288, 8, 128, .hook = true, .graph = true),
        /* Rank 0's 640 tokens are more pairs than the dispatch counts in
         * shared memory (LL_SCAN_PAIRS): its send claims slots instead. */
        CASE("fp8-h1024-top8-e64-claimed-slots", 1024, 64, 8, 640, .fp8 = true),
        CASE("fp8-h7168-top8-e288-second-stream", 7168, 288, 8, 128, .fp8 = true, .own_stream = true),
};
#define NCASES (int)(sizeof(cases) / sizeof(cases[0]))

struct input {
        int T;
        int64_t *idx; /* [T][K] */
        float *w;     /* [T][K] */
        uint16_t *x;  /* [T][H] */
};

static void input_free(struct input *in) {
        free(in->idx);
        free(in->w);
        free(in->x);
        memset(in, 0, sizeof(*in));
}

static void gen_input(struct input *in, const struct tcase *tc, uint64_t seed, int ci, int s, int variant) {
        /* Token counts stay the same in every round (a captured graph has
         * fixed shapes); routing and data change. */
        struct rng rt = rng_make(seed, (uint64_t)ci * 64 + (uint64_t)s, 3);
        struct rng r = rng_make(seed, (uint64_t)ci * 64 + (uint64_t)s, 7 + 13 * (uint64_t)variant);
        int H = tc->hidden, K = tc->topk;

        in->T = tc->fixed_tokens ? tc->fixed_tokens : 1 + (int)(rng_next(&rt) % (uint64_t)tc->max_tokens);
        if (s == 0 && !tc->fixed_tokens)
                in->T = tc->max_tokens;
        if (tc->empty_rank && s == 1)
                in->T = 0;
        in->idx = calloc((size_t)in->T * K + 1, sizeof(int64_t));
        in->w = calloc((size_t)in->T * K + 1, sizeof(float));
        in->x = calloc((size_t)in->T * H + 1, sizeof(uint16_t));
        for (int t = 0; t < in->T; t++) {
                draw_topk(&r, in->idx + (size_t)t * K, K, 0, tc->experts, 0.1);
                for (int k = 0; k < K; k++)
                        in->w[(size_t)t * K + k] = (float)rng_unit(&r);
        }
        for (size_t i = 0; i < (size_t)in->T * H; i++)
                in->x[i] = float_to_bf16((float)(rng_unit(&r) * 8.0 - 4.0));
}

/* Output of global expert e for an input channel value. */
static uint16_t expert_fn(uint16_t x, int e) {
        return float_to_bf16(bf16_to_float(x) * (0.5f + (float)(e % 7) * 0.25f) + 0.125f * (float)(e % 5));
}

struct devbufs {
        void *x, *idx;
        float *w;
        void *y, *out;
        int *stats;
};

static int upload(const struct tcase *tc, const struct input *in, struct devbufs *d) {
        int K = tc->topk;
        size_t n = (size_t)in->T * K;
        int r = 0;

        if (tc->idx32) {
                int32_t *i32 = malloc(sizeof(int32_t) * n + 4);
                for (size_t i = 0; i < n; i++)
                        i32[i] = (int32_t)in->idx[i];
                r |= cudaMemcpy(d->idx, i32, sizeof(int32_t) * n, cudaMemcpyHostToDevice) != cudaSuccess;
                free(i32);
        } else
                r |= cudaMemcpy(d->idx, in->idx, sizeof(int64_t) * n, cudaMemcpyHostToDevice) != cudaSuccess;
        r |= cudaMemcpy(d->w, in->w, sizeof(float) * n, cudaMemcpyHostToDevice) != cudaSuccess;
        r |= cudaMemcpy(d->x, in->x, (size_t)in->T * tc->hidden * 2, cudaMemcpyHostToDevice) != cudaSuccess;
        return r ? -1 : 0;
}

/* Checks the receive side against DeepEP's layout: each expert's slots
 * hold each source rank's tokens together, sources in rank order, as
 * layout_range says (begin << 32 | count); src_info is the source token;
 * FP8 scales are column-major per expert. Fills `ys` with the expert
 * outputs in slot order (host, [local experts][slots][hidden]) for
 * combine. Returns received pairs per local expert through `counts`. */
static int verify_dispatch(char *msg, const struct tcase *tc, int me, int R, const struct input *in,
                           const struct moeep_ll_dispatch_result *res, uint16_t *ys, int *counts) {
        const int H = tc->hidden, K = tc->topk, L = res->num_local_experts, S = res->slots_per_expert,
                  nb = H / 128;
        const size_t xrow = (size_t)H * (tc->fp8 ? 1 : 2);
        uint8_t *rx = malloc(xrow * S + 16);
        float *rsc = malloc(sizeof(float) * (size_t)S * nb + 16);
        int *src = malloc(sizeof(int) * (size_t)S + 16);
        int64_t *range = malloc(sizeof(int64_t) * (size_t)L * R + 16);
        uint8_t *seen = NULL;
        int bad = 0;

        if (cudaMemcpy(range, res->layout_range, sizeof(int64_t) * (size_t)L * R, cudaMemcpyDeviceToHost) !=
            cudaSuccess) {
                snprintf(msg, 200, "reading layout_range failed");
                bad = 1;
        }

        if (cudaMemcpy(counts, res->recv_count, sizeof(int) * L, cudaMemcpyDeviceToHost) != cudaSuccess) {
                snprintf(msg, 200, "reading recv_count failed");
                bad = 1;
        }
        for (int le = 0; le < L && !bad; le++) {
                const int e = me * L + le;
                int want = 0;
                for (int s = 0; s < R; s++)
                        for (int t = 0; t < in[s].T; t++)
                                for (int k = 0; k < K; k++)
                                        want += in[s].idx[(size_t)t * K + k] == e;
                if (counts[le] != want) {
                        snprintf(msg, 200, "expert %d (local %d): %d slots, expected %d", e, le, counts[le],
                                 want);
                        bad = 1;
                        break;
                }
                const int n = counts[le];
                cudaMemcpy(rx, (const char *)res->recv_x + (size_t)le * S * xrow, xrow * n,
                           cudaMemcpyDeviceToHost);
                cudaMemcpy(src, res->recv_src_info + (size_t)le * S, sizeof(int) * n, cudaMemcpyDeviceToHost);
                if (tc->fp8)
                        cudaMemcpy(rsc, res->recv_x_scales + (size_t)le * S * nb, sizeof(float) * S * nb,
                                   cudaMemcpyDeviceToHost);
                free(seen);
                seen = calloc((size_t)R * tc->max_tokens + 1, 1);
                /* Sources in rank order; with two daemons, this daemon's
                 * sources first, then the others' (each still one run). */
                int order[MOEEP_MAX_RANKS], no = 0;
                const char *nodes = getenv("MOEEP_HARNESS_NODES");
                const bool two = nodes && atoi(nodes) == 2;
                for (int pass = 0; pass < 2; pass++)
                        for (int s = 0; s < R; s++)
                                if ((two && harness_node_of(s, R) != harness_node_of(me, R)) == (pass == 1))
                                        order[no++] = s;
                int begin = 0;
                for (int oi = 0; oi < R && !bad; oi++) {
                        const int s = order[oi];
                        int c = 0;
                        for (int t = 0; t < in[s].T; t++)
                                for (int k = 0; k < K; k++)
                                        c += in[s].idx[(size_t)t * K + k] == e;
                        const int64_t v = range[(size_t)le * R + s];
                        if ((v >> 32) != begin || (v & 0xffffffff) != c) {
                                snprintf(msg, 200,
                                         "expert %d: layout_range of rank %d is (%lld, %lld), want (%d, %d)",
                                         e, s, (long long)(v >> 32), (long long)(v & 0xffffffff), begin, c);
                                bad = 1;
                        }
                        begin += c;
                }
                for (int p = 0; p < n && !bad; p++) {
                        int s = -1, t = src[p], k = -1;
                        for (int q = 0; q < R; q++) { /* the source whose run holds slot p */
                                const int64_t v = range[(size_t)le * R + q];
                                if (p >= (v >> 32) && p < (v >> 32) + (v & 0xffffffff))
                                        s = q;
                        }
                        if (s < 0) {
                                snprintf(msg, 200, "expert %d slot %d: in no source's layout_range", e, p);
                                bad = 1;
                                break;
                        }
                        for (int j = 0; t >= 0 && t < in[s].T && j < K; j++)
                                if (in[s].idx[(size_t)t * K + j] == e)
                                        k = j;
                        if (k < 0) {
                                snprintf(msg, 200,
                                         "expert %d slot %d: rank %d token %d has no pair with this expert",
                                         e, p, s, src[p]);
                                bad = 1;
                                break;
                        }
                        size_t key = (size_t)s * tc->max_tokens + t;
                        if (seen[key]++) {
                                snprintf(msg, 200, "expert %d: pair (rank %d, token %d) twice", e, s, t);
                                bad = 1;
                                break;
                        }
                        const uint16_t *x = in[s].x + (size_t)t * H;
                        if (!tc->fp8) {
                                if (memcmp(rx + (size_t)p * xrow, x, xrow)) {
                                        snprintf(msg, 200,
                                                 "expert %d slot %d (rank %d token %d): row differs", e, p, s,
                                                 t);
                                        bad = 1;
                                }
                        } else {
                                for (int g = 0; g < nb && !bad; g++) {
                                        float amax = 0, sc = rsc[(size_t)g * S + p], want_sc;
                                        for (int c = g * 128; c < (g + 1) * 128; c++)
                                                amax = fmaxf(amax, fabsf(bf16_to_float(x[c])));
                                        want_sc = amax > 0 ? amax / 448.0f : 1.0f;
                                        if (tc->round_scale)
                                                want_sc = exp2f(ceilf(log2f(want_sc)));
                                        if (!(fabsf(sc - want_sc) <= 1e-6f * want_sc)) {
                                                snprintf(msg, 200,
                                                         "expert %d slot %d group %d: scale %g, want %g", e,
                                                         p, g, sc, want_sc);
                                                bad = 1;
                                        }
                                        for (int c = g * 128; c < (g + 1) * 128 && !bad; c++) {
                                                float xv = bf16_to_float(x[c]);
                                                float d = e4m3_to_float(rx[(size_t)p * xrow + c]) * sc;
                                                if (!(fabsf(d - xv) <= 0.0625f * fabsf(xv) + sc / 512.0f)) {
                                                        snprintf(msg, 200,
                                                                 "expert %d slot %d ch %d: dequantised %g vs "
                                                                 "%g",
                                                                 e, p, c, d, xv);
                                                        bad = 1;
                                                }
                                        }
                                }
                        }
                        if (ys)
                                for (int c = 0; c < H; c++)
                                        ys[((size_t)le * S + p) * H + c] = expert_fn(x[c], e);
                }
        }
        free(rx);
        free(rsc);
        free(src);
        free(range);
        free(seen);
        return bad ? -1 : 0;
}

/* out[t] = sum over valid k of w[t][k] * f_e(x[t]) (or x[t] itself with
 * identity, the zero-copy case), computed in double. */
static int verify_combine(char *msg, const struct tcase *tc, const struct input *mine, const void *d_out,
                          bool identity) {
        const int H = tc->hidden, K = tc->topk, T = mine->T;
        uint16_t *out = malloc(sizeof(uint16_t) * (size_t)T * H + 2);
        int bad = 0;

        cudaMemcpy(out, d_out, sizeof(uint16_t) * (size_t)T * H, cudaMemcpyDeviceToHost);
        for (int t = 0; t < T && !bad; t++)
                for (int c = 0; c < H && !bad; c++) {
                        double ref = 0;
                        for (int k = 0; k < K; k++) {
                                int64_t e = mine->idx[(size_t)t * K + k];
                                if (e < 0)
                                        continue;
                                uint16_t v = mine->x[(size_t)t * H + c];
                                ref += (double)mine->w[(size_t)t * K + k] *
                                       bf16_to_float(identity ? v : expert_fn(v, (int)e));
                        }
                        float got = bf16_to_float(out[(size_t)t * H + c]);
                        if (!(fabs(got - ref) <= fmax(fabs(ref), 1.0) / 64.0)) {
                                snprintf(msg, 200, "combine token %d ch %d: got %g want %g", t, c, got, ref);
                                bad = 1;
                        }
                }
        free(out);
        return bad ? -1 : 0;
}

static void poison_ll(const struct moeep_ll_dispatch_result *area, const struct tcase *tc) {
        size_t rows = (size_t)area->num_local_experts * area->slots_per_expert;
        cudaMemset(area->recv_x, 0xa5, rows * tc->hidden * (tc->fp8 ? 1 : 2));
        if (area->recv_x_scales)
                cudaMemset(area->recv_x_scales, 0xa5, rows * (tc->hidden / 128) * sizeof(float));
}

static int run_case(struct moeep_client *c, int me, int R, int ci, uint64_t seed, char *msg) {
        const struct tcase *tc = &cases[ci];
        const struct moeep_ep_config cfg = {
                .max_tokens_per_rank = 16,
                .hidden = tc->hidden,
                .num_experts = tc->experts,
                .max_topk = tc->topk,
                .timeout_ms = 20000,
                .ll_max_tokens = tc->max_tokens,
        };
        const int H = tc->hidden, K = tc->topk, L = tc->experts / R, S = R * tc->max_tokens;
        struct input in[MOEEP_MAX_RANKS] = { 0 };
        struct moeep_ep *ep = NULL;
        struct devbufs d = { 0 };
        cudaStream_t st = NULL;
        cudaGraph_t graph = NULL;
        cudaGraphExec_t exec = NULL;
        uint16_t *ys = NULL;
        int *counts = calloc((size_t)L, sizeof(int)), *stats_want = calloc((size_t)L, sizeof(int));
        int rc = -1, r;

        msg[0] = '\0';
        if ((r = moeep_ep_create(c, &cfg, &ep)) < 0) {
                snprintf(msg, 200, "moeep_ep_create: %s", moeep_client_error(c));
                free(counts);
                free(stats_want);
                return -1;
        }
        static cudaStream_t one; /* the cases' one stream (own_stream: not) */
        if (!one && !tc->own_stream)
                CK(cudaStreamCreate(&one));
        if (tc->own_stream)
                CK(cudaStreamCreate(&st));
        else
                st = one;
        CK(cudaMalloc(&d.x, (size_t)tc->max_tokens * H * 2 + 16));
        CK(cudaMalloc(&d.idx, (size_t)tc->max_tokens * K * 8 + 16));
        CK(cudaMalloc((void **)&d.w, (size_t)tc->max_tokens * K * 4 + 16));
        CK(cudaMalloc(&d.y, (size_t)L * S * H * 2 + 16));
        CK(cudaMalloc(&d.out, (size_t)tc->max_tokens * H * 2 + 16));
        CK(cudaMalloc((void **)&d.stats, sizeof(int) * L));
        CK(cudaMemset(d.stats, 0, sizeof(int) * L));
        ys = malloc(sizeof(uint16_t) * (size_t)L * S * H + 2);

        struct moeep_ll_dispatch_args da = {
                .topk_idx_type = tc->idx32 ? MOEEP_INDEX_INT32 : MOEEP_INDEX_INT64,
                .num_topk = K,
                .use_fp8 = tc->fp8,
                .round_scale = tc->round_scale,
                .return_recv_hook = tc->hook,
                .cumulative_local_expert_recv_stats = d.stats,
                .x = d.x,
                .topk_idx = d.idx,
        };
        struct moeep_ll_combine_args ca = {
                .x = d.y,
                .topk_idx = d.idx,
                .topk_idx_type = da.topk_idx_type,
                .topk_weights = d.w,
                .num_topk = K,
                .out = d.out,
                .return_recv_hook = tc->hook,
        };
        struct moeep_ll_dispatch_result res = { 0 };
        struct moeep_ll_hook hook = { 0 };
        int rounds = tc->graph ? 4 : 3; /* graph: one warm-up round, then three replays */

        for (int v = 0; v < rounds; v++) {
                for (int s = 0; s < R; s++) {
                        input_free(&in[s]);
                        gen_input(&in[s], tc, seed, ci, s, v);
                }
                da.num_tokens = in[me].T;
                if (upload(tc, &in[me], &d) < 0)
                        FAIL("upload failed");
                CK(cudaMemset(d.out, 0xff, (size_t)tc->max_tokens * H * 2));
                if (tc->graph && v == 1) {
                        /* Capture once, with the hook and the zero-copy combine
                         * (expert outputs = the received rows themselves). */
                        CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
                        int r1 = moeep_ll_dispatch(ep, &da, &res, &hook, st);
                        int r2 = r1 < 0 ? r1 : moeep_ll_hook_run(ep, &hook, st);
                        ca.x = res.recv_x;
                        ca.handle = &res.handle;
                        int r3 = r2 < 0 ? r2 : moeep_ll_combine(ep, &ca, &hook, st);
                        int r4 = r3 < 0 ? r3 : moeep_ll_hook_run(ep, &hook, st);
                        cudaError_t ce = cudaStreamEndCapture(st, &graph);
                        if (r4 < 0 || ce != cudaSuccess)
                                FAIL("capture: %s (%s)", moeep_ep_error(ep), cudaGetErrorString(ce));
                        CK(cudaGraphInstantiate(&exec, graph, 0));
                }
                if (exec) {
                        poison_ll(&res, tc);
                        CK(cudaDeviceSynchronize());
                        moeep_job_barrier(c);
                        CK(cudaGraphLaunch(exec, st));
                } else {
                        /* Poison both sets' areas through a first result. */
                        if (v > 0)
                                poison_ll(&res, tc);
                        CK(cudaDeviceSynchronize());
                        moeep_job_barrier(c);
                        if (moeep_ll_dispatch(ep, &da, &res, &hook, st) < 0)
                                FAIL("dispatch: %s", moeep_ep_error(ep));
                        if (tc->hook && moeep_ll_hook_run(ep, &hook, st) < 0)
                                FAIL("dispatch hook: %s", moeep_ep_error(ep));
                }
                CK(cudaStreamSynchronize(st));
                if (moeep_ep_check(ep) < 0)
                        FAIL("round %d failed on the device: %s", v, moeep_ep_error(ep));
                if (verify_dispatch(msg, tc, me, R, in, &res, tc->graph ? NULL : ys, counts) < 0)
                        goto out;
                for (int le = 0; le < L; le++)
                        stats_want[le] += counts[le];
                if (!exec) {
                        if (tc->graph) {
                                ca.x = res.recv_x;
                        } else {
                                CK(cudaMemcpy(d.y, ys, sizeof(uint16_t) * (size_t)L * S * H,
                                              cudaMemcpyHostToDevice));
                                ca.x = d.y;
                        }
                        ca.handle = &res.handle;
                        moeep_job_barrier(c); /* every rank read its receive area */
                        if (moeep_ll_combine(ep, &ca, &hook, st) < 0)
                                FAIL("combine: %s", moeep_ep_error(ep));
                        if (tc->hook && moeep_ll_hook_run(ep, &hook, st) < 0)
                                FAIL("combine hook: %s", moeep_ep_error(ep));
                        CK(cudaStreamSynchronize(st));
                        if (moeep_ep_check(ep) < 0)
                                FAIL("combine failed on the device: %s", moeep_ep_error(ep));
                }
                if (verify_combine(msg, tc, &in[me], d.out, tc->graph) < 0)
                        goto out;
        }
        {
                int *stats = malloc(sizeof(int) * L);
                CK(cudaMemcpy(stats, d.stats, sizeof(int) * L, cudaMemcpyDeviceToHost));
                r = memcmp(stats, stats_want, sizeof(int) * L);
                free(stats);
                if (r)
                        FAIL("cumulative per-expert receive statistics differ from the counts");
        }
        rc = 0;
out:
        if (rc && !msg[0])
                snprintf(msg, 200, "failed");
        if (exec)
                cudaGraphExecDestroy(exec);
        if (graph)
                cudaGraphDestroy(graph);
        cudaFree(d.x);
        cudaFree(d.idx);
        cudaFree(d.w);
        cudaFree(d.y);
        cudaFree(d.out);
        cudaFree(d.stats);
        if (st && st != one)
                cudaStreamDestroy(st);
        free(ys);
        free(counts);
        free(stats_want);
        moeep_job_barrier(c);
        moeep_ep_destroy(ep);
        for (int s = 0; s < R; s++)
                input_free(&in[s]);
        return rc;
}

static const char *case_name(int ci) {
        return cases[ci].name;
}

int main(int argc, char **argv) {
        static const struct suite suite = {
                .name = "ep_ll_test",
                .default_ranks = "2,4",
                .ncases = NCASES,
                .case_name = case_name,
                .run_case = run_case,
        };

        return suite_main(&suite, argc, argv);
}
