/* Normal-mode dispatch/combine against a CPU reference.
 *
 * Each rank is its own process attached through a real moeepd (see
 * client/bench/harness.c). Every case draws fresh random inputs for every
 * rank from the run's seed; each rank regenerates all ranks' inputs on the
 * CPU to know exactly what it must receive, poisons its outputs, runs the
 * GPU path and compares. Exit 77 (skipped) without a GPU.
 *
 * Usage: ep_normal_test [--ranks 1,2,4] [--seed N] [--case NAME] [--moeepd PATH] */
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
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
        bool fp8;       /* dispatch FP8 with scales */
        bool idx32;     /* int32 top-k indices */
        bool no_topk;   /* route by is_token_in_rank only, no top-k travels */
        bool uneven;    /* every expert on rank 0: the others receive nothing */
        bool zero_rank; /* rank 1 sends no tokens */
        bool reuse;     /* second dispatch with the cached handle and new data */
        bool worst;     /* num_worst_tokens: no host synchronisation */
        bool graph; /* dispatch + combine captured once in a CUDA graph, replayed with new routing and data */
        bool bad_args; /* unsupported shapes and arguments must be -EINVAL */
        bool colmajor; /* fp8: scales column-major (DeepEP's callers' layout), read through the strides */
        int align;     /* expert_alignment */
        int areas;     /* receive areas; each rank dispatches into its own pick, another one when reused */
};

#define CASE(n, h, e, k, t, ...) \
        { .name = n, .hidden = h, .experts = e, .topk = k, .max_tokens = t, __VA_ARGS__ }
static const struct tcase cases[] = {
        CASE("bf16-h7168-top8-e256", 7168, 256, 8, 256),
        CASE("fp8-h7168-top8-e256", 7168, 256, 8, 256, .fp8 = true),
        CASE("bf16-h2048-top1-e64-int32", 2048, 64, 1, 384, .idx32 = true),
        CASE("bf16-h4096-top9-e288-rank1-empty", 4096, 288, 9, 200, .zero_rank = true),
        CASE("bf16-h5120-no-topk", 5120, 64, 4, 128, .no_topk = true),
        CASE("bf16-h2048-uneven", 2048, 32, 4, 256, .uneven = true),
        CASE("bf16-h7168-handle-reuse", 7168, 256, 8, 128, .reuse = true),
        CASE("bf16-h4096-worst-case", 4096, 128, 6, 256, .worst = true),
        CASE("fp8-h2048-align128", 2048, 128, 8, 300, .fp8 = true, .align = 128),
        CASE("bf16-h4096-graph-replay", 4096, 128, 8, 256, .worst = true, .graph = true),
        CASE("bf16-h4096-areas-reuse", 4096, 128, 8, 256, .areas = 3, .reuse = true),
        CASE("fp8-h4096-areas-colmajor", 4096, 128, 8, 300, .fp8 = true, .areas = 2, .colmajor = true),
        /* More tokens than the 768 warps of 24 SMs: the dispatch splits rows
         * into parts, here of 16 and 20 int4 (fewer than a warp's lanes: the
         * lanes of a warp run its row loop a different number of times).
         * Small rows: across two daemons the job's first endpoint (the first
         * case) sets the proxy staging that every later one must fit. */
        CASE("bf16-h512-row-parts", 512, 64, 8, 1024),
        CASE("fp8-h1280-row-parts", 1280, 64, 4, 1024, .fp8 = true),
        CASE("bad-arguments", 2048, 64, 4, 64, .bad_args = true),
};
#define NCASES (int)(sizeof(cases) / sizeof(cases[0]))

/* One rank's inputs, regenerated identically by every rank. */
struct input {
        int T;
        int64_t *idx;   /* [T][K] */
        float *w;       /* [T][K] */
        uint16_t *x;    /* [T][H] bf16 */
        uint8_t *xq;    /* fp8: [T][H] */
        float *sc;      /* fp8: [T][H/128] */
        uint32_t *mask; /* [T]: destination ranks */
};

static void input_free(struct input *in) {
        free(in->idx);
        free(in->w);
        free(in->x);
        free(in->xq);
        free(in->sc);
        free(in->mask);
        memset(in, 0, sizeof(*in));
}

static void gen_input(struct input *in, const struct tcase *tc, int R, uint64_t seed, int ci, int s,
                      int variant) {
        /* T depends on the rank only; routing changes with the variant
         * except where a cached handle must see the same routing. */
        struct rng r = rng_make(seed, (uint64_t)ci * 64 + (uint64_t)s, 0);
        struct rng rr =
                rng_make(seed, (uint64_t)ci * 64 + (uint64_t)s, 100 + (tc->reuse ? 0 : (uint64_t)variant));
        struct rng rx = rng_make(seed, (uint64_t)ci * 64 + (uint64_t)s, 1 + (uint64_t)variant);
        int H = tc->hidden, K = tc->topk, epr = tc->experts / R;

        memset(in, 0, sizeof(*in));
        in->T = s == 0 ? tc->max_tokens : 1 + (int)(rng_next(&r) % (uint64_t)tc->max_tokens);
        if (tc->zero_rank && s == 1)
                in->T = 0;
        in->idx = calloc((size_t)in->T * K + 1, sizeof(int64_t));
        in->w = calloc((size_t)in->T * K + 1, sizeof(float));
        in->mask = calloc((size_t)in->T + 1, sizeof(uint32_t));
        in->x = calloc((size_t)in->T * H + 1, sizeof(uint16_t));
        for (int t = 0; t < in->T; t++) {
                int64_t *row = in->idx + (size_t)t * K;
                draw_topk(&rr, row, K, 0, tc->uneven ? epr : tc->experts, 0.1);
                for (int k = 0; k < K; k++) {
                        in->w[(size_t)t * K + k] = (float)rng_unit(&rr);
                        if (row[k] >= 0)
                                in->mask[t] |= 1u << (row[k] / epr);
                }
        }
        for (size_t i = 0; i < (size_t)in->T * H; i++)
                in->x[i] = float_to_bf16((float)(rng_unit(&rx) * 8.0 - 4.0));
        if (tc->fp8) {
                int nb = H / 128;
                in->xq = calloc((size_t)in->T * H + 1, 1);
                in->sc = calloc((size_t)in->T * nb + 1, sizeof(float));
                for (int t = 0; t < in->T; t++)
                        for (int b = 0; b < nb; b++) {
                                const uint16_t *v = in->x + (size_t)t * H + b * 128;
                                float amax = 0, scale;
                                for (int j = 0; j < 128; j++)
                                        amax = fmaxf(amax, fabsf(bf16_to_float(v[j])));
                                scale = amax > 0 ? amax / 448.0f : 1.0f;
                                in->sc[(size_t)t * nb + b] = scale;
                                for (int j = 0; j < 128; j++)
                                        in->xq[(size_t)t * H + b * 128 + j] =
                                                float_to_e4m3(bf16_to_float(v[j]) / scale);
                        }
        }
}

/* Expert output of rank r for a row: a rank-dependent function of the
 * token's bf16 values, so that combine must sum the right slots. */
static uint16_t expert_out(uint16_t x, int r) {
        return float_to_bf16(bf16_to_float(x) * (float)(1 + r) + 0.25f * (float)r);
}

static void *dev_upload(const void *src, size_t bytes) {
        void *d = NULL;
        if (cudaMalloc(&d, bytes ? bytes : 16) != cudaSuccess)
                return NULL;
        if (src && bytes && cudaMemcpy(d, src, bytes, cudaMemcpyHostToDevice) != cudaSuccess) {
                cudaFree(d);
                return NULL;
        }
        return d;
}

/* Checks the receive side of one dispatch against the inputs of all ranks.
 * check_meta: also the top-k ids/weights, counts and source info. */
static int verify_dispatch(char *msg, const struct tcase *tc, int me, int R, const struct input *in,
                           const struct moeep_dispatch_result *res, int num_recv, bool check_meta) {
        int H = tc->hidden, K = tc->topk, epr = tc->experts / R, nb = H / 128;
        size_t row_bytes = (size_t)H * (tc->fp8 ? 1 : 2);
        int expect = 0, bad = 0;
        uint8_t *rx = NULL;
        float *rsc = NULL, *rw = NULL;
        int64_t *ridx = NULL;
        int *rsrc = NULL, *pe = NULL, *want_pe = calloc((size_t)epr, sizeof(int));

        for (int s = 0; s < R; s++)
                for (int t = 0; t < in[s].T; t++)
                        expect += (in[s].mask[t] >> me) & 1;
        if (num_recv != expect) {
                snprintf(msg, 200, "received %d tokens, expected %d", num_recv, expect);
                free(want_pe);
                return -1;
        }
        if (check_meta) { /* DeepEP's rank_prefix_matrix: [s][d] = rows ranks 0..s send to d */
                int got[MOEEP_MAX_RANKS * MOEEP_MAX_RANKS];
                cudaMemcpy(got, res->rank_prefix_matrix, sizeof(int) * (size_t)R * R, cudaMemcpyDeviceToHost);
                for (int d = 0; d < R && !bad; d++) {
                        int sum = 0;
                        for (int s = 0; s < R && !bad; s++) {
                                for (int t = 0; t < in[s].T; t++)
                                        sum += (in[s].mask[t] >> d) & 1;
                                if (got[s * R + d] != sum) {
                                        snprintf(msg, 200, "rank_prefix_matrix[%d][%d] is %d, expected %d", s,
                                                 d, got[s * R + d], sum);
                                        bad = 1;
                                }
                        }
                }
                /* Its column `me` on the host, as counts per source (NULL only
                 * when the host does not know them: num_worst_tokens). */
                for (int s = 0; s < R && !bad && res->num_recv_tokens_per_rank; s++) {
                        int n = 0;
                        for (int t = 0; t < in[s].T; t++)
                                n += (in[s].mask[t] >> me) & 1;
                        if (res->num_recv_tokens_per_rank[s] != n) {
                                snprintf(msg, 200, "num_recv_tokens_per_rank[%d] is %d, expected %d", s,
                                         res->num_recv_tokens_per_rank[s], n);
                                bad = 1;
                        }
                }
                if (!bad && !res->num_recv_tokens_per_rank && res->num_recv_tokens >= 0) {
                        snprintf(msg, 200, "num_recv_tokens_per_rank is NULL with num_recv_tokens %d",
                                 res->num_recv_tokens);
                        bad = 1;
                }
                if (bad) {
                        free(want_pe);
                        return -1;
                }
        }
        rx = malloc(row_bytes * (size_t)num_recv + 1);
        rsrc = malloc(sizeof(int) * (size_t)num_recv + 4);
        cudaMemcpy(rx, res->recv_x, row_bytes * (size_t)num_recv, cudaMemcpyDeviceToHost);
        cudaMemcpy(rsrc, res->recv_src_info, sizeof(int) * (size_t)num_recv, cudaMemcpyDeviceToHost);
        if (tc->fp8) {
                rsc = malloc(sizeof(float) * (size_t)num_recv * nb + 4);
                cudaMemcpy(rsc, res->recv_x_scales, sizeof(float) * (size_t)num_recv * nb,
                           cudaMemcpyDeviceToHost);
        }
        if (!tc->no_topk && check_meta) {
                size_t isz = tc->idx32 ? 4 : 8;
                void *raw = malloc(isz * (size_t)num_recv * K + 8);
                ridx = malloc(sizeof(int64_t) * (size_t)num_recv * K + 8);
                rw = malloc(sizeof(float) * (size_t)num_recv * K + 4);
                pe = malloc(sizeof(int) * (size_t)epr);
                cudaMemcpy(raw, res->recv_topk_idx, isz * (size_t)num_recv * K, cudaMemcpyDeviceToHost);
                cudaMemcpy(rw, res->recv_topk_weights, sizeof(float) * (size_t)num_recv * K,
                           cudaMemcpyDeviceToHost);
                cudaMemcpy(pe, res->num_recv_tokens_per_expert_dev, sizeof(int) * (size_t)epr,
                           cudaMemcpyDeviceToHost);
                for (size_t i = 0; i < (size_t)num_recv * K; i++)
                        ridx[i] = tc->idx32 ? ((int32_t *)raw)[i] : ((int64_t *)raw)[i];
                free(raw);
        }
        if (cudaGetLastError() != cudaSuccess) {
                snprintf(msg, 200, "copying results back failed");
                bad = 1;
                goto done;
        }

        int p = 0;
        for (int s = 0; s < R && !bad; s++)
                for (int t = 0; t < in[s].T && !bad; t++) {
                        if (!((in[s].mask[t] >> me) & 1))
                                continue;
                        const void *want = tc->fp8 ? (const void *)(in[s].xq + (size_t)t * H)
                                                   : (const void *)(in[s].x + (size_t)t * H);
                        if (memcmp(rx + (size_t)p * row_bytes, want, row_bytes)) {
                                snprintf(msg, 200, "recv_x row %d (rank %d token %d) differs", p, s, t);
                                bad = 1;
                        }
                        if (rsrc[p] != ((s << 24) | t)) {
                                snprintf(msg, 200, "row %d source info 0x%x, expected rank %d token %d", p,
                                         rsrc[p], s, t);
                                bad = 1;
                        }
                        if (tc->fp8) {
                                for (int b = 0; b < nb && !bad; b++)
                                        if (rsc[(size_t)p * nb + b] != in[s].sc[(size_t)t * nb + b]) {
                                                snprintf(msg, 200, "row %d scale %d differs", p, b);
                                                bad = 1;
                                        }
                                /* Dequantised error bound of e4m3 with a per-128 amax scale:
                                 * |x - q*scale| <= 2^-4 |x| + 2^-10 scale. */
                                for (int c = 0; c < H && !bad; c++) {
                                        float x = bf16_to_float(in[s].x[(size_t)t * H + c]);
                                        float sc = rsc[(size_t)p * nb + c / 128];
                                        float d = e4m3_to_float(rx[(size_t)p * row_bytes + c]) * sc;
                                        if (!(fabsf(d - x) <= 0.0625f * fabsf(x) + sc / 1024.0f)) {
                                                snprintf(msg, 200, "row %d ch %d dequantised %g vs %g", p, c,
                                                         d, x);
                                                bad = 1;
                                        }
                                }
                        }
                        if (ridx) {
                                for (int k = 0; k < K && !bad; k++) {
                                        int64_t e = in[s].idx[(size_t)t * K + k];
                                        int64_t local = e >= (int64_t)me * epr && e < (int64_t)(me + 1) * epr
                                                                ? e - me * epr
                                                                : -1;
                                        float w = local >= 0 ? in[s].w[(size_t)t * K + k] : 0.0f;
                                        if (ridx[(size_t)p * K + k] != local || rw[(size_t)p * K + k] != w) {
                                                snprintf(msg, 200,
                                                         "row %d topk %d: got (%" PRId64
                                                         ", %g) want (%" PRId64 ", %g)",
                                                         p, k, ridx[(size_t)p * K + k], rw[(size_t)p * K + k],
                                                         local, w);
                                                bad = 1;
                                        }
                                        if (local >= 0)
                                                want_pe[local]++;
                                }
                        }
                        p++;
                }
        if (!bad && pe)
                for (int l = 0; l < epr; l++) {
                        int w = tc->align > 1 ? (want_pe[l] + tc->align - 1) / tc->align * tc->align
                                              : want_pe[l];
                        if (pe[l] != w ||
                            (res->num_recv_tokens_per_expert && res->num_recv_tokens_per_expert[l] != w)) {
                                snprintf(msg, 200, "local expert %d count %d (host %d), expected %d", l,
                                         pe[l],
                                         res->num_recv_tokens_per_expert ? res->num_recv_tokens_per_expert[l]
                                                                         : -1,
                                         w);
                                bad = 1;
                                break;
                        }
                }
done:
        free(rx);
        free(rsrc);
        free(rsc);
        free(rw);
        free(ridx);
        free(pe);
        free(want_pe);
        return bad ? -1 : 0;
}

/* moeep_dispatch_copy_topk against the area it copies (which
 * verify_dispatch checked against the CPU): into poisoned arrays of `rows`
 * rows, the first num_recv equal to the area's, the rest -1 and 0 (rows >
 * num_recv only with num_worst_tokens). Also its refusals: a row count
 * other than the received one (host-known count), an area out of range, no
 * handle. */
static int check_copy_topk(char *msg, struct moeep_ep *ep, const struct moeep_dispatch_args *a,
                           const struct moeep_dispatch_result *res, int num_recv, int rows, cudaStream_t st) {
        const int K = a->num_topk;
        const size_t isz = a->topk_idx_type == MOEEP_INDEX_INT32 ? 4 : 8, n = (size_t)rows * K,
                     m = (size_t)num_recv * K;
        uint8_t *d_i = NULL, *want_i = malloc(isz * n + 8), *got_i = malloc(isz * n + 8);
        float *d_w = NULL, *want_w = malloc(sizeof(float) * n + 4), *got_w = malloc(sizeof(float) * n + 4);
        int rc = -1;

        CK(cudaMalloc((void **)&d_i, isz * n + 8));
        CK(cudaMalloc((void **)&d_w, sizeof(float) * n + 4));
        CK(cudaMemset(d_i, 0x5a, isz * n + 8));
        CK(cudaMemset(d_w, 0x5a, sizeof(float) * n + 4));
        CK(cudaMemcpy(want_i, res->recv_topk_idx, isz * m, cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(want_w, res->recv_topk_weights, sizeof(float) * m, cudaMemcpyDeviceToHost));
        memset(want_i + isz * m, 0xff, isz * (n - m)); /* -1 in either width */
        for (size_t i = m; i < n; i++)
                want_w[i] = 0.0f;
        MK(moeep_dispatch_copy_topk(ep, res->handle, a->recv_area, a->topk_idx_type, rows, d_i, d_w, st));
        CK(cudaStreamSynchronize(st));
        CK(cudaMemcpy(got_i, d_i, isz * n, cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(got_w, d_w, sizeof(float) * n, cudaMemcpyDeviceToHost));
        for (size_t i = 0; i < n; i++)
                if (memcmp(got_i + i * isz, want_i + i * isz, isz) ||
                    memcmp(&got_w[i], &want_w[i], sizeof(float)))
                        FAIL("copy_topk: row %zu entry %zu differs from the area (or the padding)", i / K,
                             i % K);
        if (res->num_recv_tokens >= 0 &&
            moeep_dispatch_copy_topk(ep, res->handle, a->recv_area, a->topk_idx_type, rows + 1, d_i, d_w,
                                     st) != -EINVAL)
                FAIL("copy_topk accepted %d rows of a dispatch that received %d", rows + 1, num_recv);
        if (moeep_dispatch_copy_topk(ep, res->handle, -1, a->topk_idx_type, rows, d_i, d_w, st) != -EINVAL ||
            moeep_dispatch_copy_topk(ep, NULL, a->recv_area, a->topk_idx_type, rows, d_i, d_w, st) != -EINVAL)
                FAIL("copy_topk accepted an area out of range or no handle");
        rc = 0;
out:
        cudaFree(d_i);
        cudaFree(d_w);
        free(want_i);
        free(got_i);
        free(want_w);
        free(got_w);
        return rc;
}

/* Device buffers of a combine: expert outputs and weights in receive
 * order (sized for the worst case), and the outputs. */
struct comb_io {
        void *y, *w, *out, *ow;
};

static void comb_io_free(struct comb_io *io) {
        cudaFree(io->y);
        cudaFree(io->w);
        cudaFree(io->out);
        cudaFree(io->ow);
        memset(io, 0, sizeof(*io));
}

static int comb_io_alloc(struct comb_io *io, const struct tcase *tc, int R, int T) {
        size_t rows = (size_t)R * tc->max_tokens;
        memset(io, 0, sizeof(*io));
        io->y = dev_upload(NULL, rows * tc->hidden * 2);
        io->w = dev_upload(NULL, rows * tc->topk * sizeof(float));
        io->out = dev_upload(NULL, (size_t)T * tc->hidden * 2);
        io->ow = dev_upload(NULL, (size_t)T * tc->topk * sizeof(float));
        return io->y && io->w && io->out && io->ow ? 0 : -1;
}

/* Expert outputs (a rank-dependent function of each received token) and
 * weights in receive order, uploaded; outputs poisoned. */
static int combine_prepare(const struct tcase *tc, int me, int R, const struct input *in, int num_recv,
                           struct comb_io *io) {
        int H = tc->hidden, K = tc->topk, epr = tc->experts / R, T = in[me].T, p = 0, r = 0;
        uint16_t *y = malloc(sizeof(uint16_t) * (size_t)num_recv * H + 2);
        float *w = malloc(sizeof(float) * (size_t)num_recv * K + 4);

        for (int s = 0; s < R; s++)
                for (int t = 0; t < in[s].T; t++) {
                        if (!((in[s].mask[t] >> me) & 1))
                                continue;
                        for (int c = 0; c < H; c++)
                                y[(size_t)p * H + c] = expert_out(in[s].x[(size_t)t * H + c], me);
                        for (int k = 0; k < K; k++) {
                                int64_t e = in[s].idx[(size_t)t * K + k];
                                w[(size_t)p * K + k] = e >= (int64_t)me * epr && e < (int64_t)(me + 1) * epr
                                                               ? in[s].w[(size_t)t * K + k]
                                                               : 0.0f;
                        }
                        p++;
                }
        if (cudaMemcpy(io->y, y, sizeof(uint16_t) * (size_t)num_recv * H, cudaMemcpyHostToDevice) !=
                    cudaSuccess ||
            cudaMemcpy(io->w, w, sizeof(float) * (size_t)num_recv * K, cudaMemcpyHostToDevice) !=
                    cudaSuccess ||
            cudaMemset(io->out, 0xff, sizeof(uint16_t) * (size_t)T * H) != cudaSuccess || /* NaN poison */
            cudaMemset(io->ow, 0xff, sizeof(float) * (size_t)T * K) != cudaSuccess)
                r = -1;
        free(y);
        free(w);
        return r;
}

/* Checks my combined tokens (and summed weights) against the CPU. */
static int combine_verify(char *msg, const struct tcase *tc, int me, int R, const struct input *in,
                          const struct comb_io *io, bool weights) {
        int H = tc->hidden, K = tc->topk, T = in[me].T, bad = 0;
        uint16_t *out = malloc(sizeof(uint16_t) * (size_t)T * H + 2);
        float *ow = malloc(sizeof(float) * (size_t)T * K + 4);

        cudaMemcpy(out, io->out, sizeof(uint16_t) * (size_t)T * H, cudaMemcpyDeviceToHost);
        cudaMemcpy(ow, io->ow, sizeof(float) * (size_t)T * K, cudaMemcpyDeviceToHost);
        for (int t = 0; t < T && !bad; t++) {
                for (int c = 0; c < H && !bad; c++) {
                        float ref = 0, got = bf16_to_float(out[(size_t)t * H + c]);
                        for (int r = 0; r < R; r++)
                                if ((in[me].mask[t] >> r) & 1)
                                        ref += bf16_to_float(expert_out(in[me].x[(size_t)t * H + c], r));
                        if (!(fabsf(got - ref) <= fmaxf(fabsf(ref), 1.0f) / 128.0f)) {
                                snprintf(msg, 200, "combine token %d ch %d: got %g want %g", t, c, got, ref);
                                bad = 1;
                        }
                }
                for (int k = 0; k < K && weights && !bad; k++) {
                        float want = in[me].idx[(size_t)t * K + k] >= 0 ? in[me].w[(size_t)t * K + k] : 0.0f;
                        if (ow[(size_t)t * K + k] != want) {
                                snprintf(msg, 200, "combined weight t %d k %d: got %g want %g", t, k,
                                         ow[(size_t)t * K + k], want);
                                bad = 1;
                        }
                }
        }
        free(out);
        free(ow);
        return bad ? -1 : 0;
}

/* Runs combine with a rank-dependent expert function and checks my tokens. */
static int run_combine(char *msg, struct moeep_ep *ep, const struct tcase *tc, int me, int R,
                       const struct input *in, struct moeep_ep_handle *handle, int num_recv,
                       cudaStream_t st) {
        struct comb_io io;
        bool weights = !tc->no_topk;
        int r = -1;

        if (comb_io_alloc(&io, tc, R, in[me].T) < 0 || combine_prepare(tc, me, R, in, num_recv, &io) < 0) {
                snprintf(msg, 200, "combine buffers: %s", cudaGetErrorString(cudaGetLastError()));
                goto out;
        }
        struct moeep_combine_args ca = {
                .x = io.y,
                .topk_weights = weights ? io.w : NULL,
                .num_topk = tc->topk,
                .handle = handle,
                .out = io.out,
                .out_topk_weights = weights ? io.ow : NULL,
        };
        if (moeep_combine(ep, &ca, st) < 0) {
                snprintf(msg, 200, "combine: %s", moeep_ep_error(ep));
                goto out;
        }
        if (cudaStreamSynchronize(st) != cudaSuccess || moeep_ep_check(ep) < 0) {
                snprintf(msg, 200, "combine failed on the device: %s", moeep_ep_error(ep));
                goto out;
        }
        r = combine_verify(msg, tc, me, R, in, &io, weights);
out:
        comb_io_free(&io);
        return r;
}

/* Poisons every receive area, then waits (control plane) until every
 * rank did, so no peer writes before our poison landed. */
static int poison_and_sync(struct moeep_ep *ep, struct moeep_client *c) {
        struct moeep_dispatch_result area;
        size_t bytes;

        for (int a = 0; moeep_ep_recv_area(ep, a, &area, &bytes) == 0; a++)
                cudaMemset(area.recv_x, 0xa5, bytes);
        if (cudaDeviceSynchronize() != cudaSuccess)
                return -EIO;
        return moeep_job_barrier(c);
}

/* The receive area rank `me` picks for dispatch `n` of a case with areas:
 * each rank another one, and another one at each dispatch. */
static int pick_area(const struct tcase *tc, int me, int n) {
        return tc->areas ? (me + n) % tc->areas : 0;
}

/* Unsupported shapes and bad arguments: -EINVAL, before anything collective. */
static int check_bad_args(char *msg, struct moeep_client *c, struct moeep_ep *ep, const struct tcase *tc,
                          void *d_x, void *d_idx, cudaStream_t st) {
        const struct moeep_dispatch_args good = {
                .x = d_x,
                .x_type = MOEEP_DTYPE_BF16,
                .num_tokens = 1,
                .topk_idx = d_idx,
                .topk_idx_type = MOEEP_INDEX_INT64,
                .num_topk = tc->topk,
        };
        struct {
                const char *what;
                struct moeep_dispatch_args a;
        } bad[] = {
                { "num_tokens > max", good },    { "num_topk > max_topk", good },  { "unknown x_type", good },
                { "unknown index type", good },  { "fp8 without scales", good },   { "no routing", good },
                { "negative num_tokens", good }, { "weights without topk", good },
        };
        bad[0].a.num_tokens = tc->max_tokens + 1;
        bad[1].a.num_topk = tc->topk + 1;
        bad[2].a.x_type = (enum moeep_dtype)7;
        bad[3].a.topk_idx_type = (enum moeep_index_type)9;
        bad[4].a.x_type = MOEEP_DTYPE_FP8_E4M3;
        bad[5].a.topk_idx = NULL;
        bad[6].a.num_tokens = -1;
        bad[7].a.topk_idx = NULL;
        bad[7].a.topk_weights = (const float *)d_idx;
        struct moeep_dispatch_result res;
        struct moeep_combine_args ca = { 0 };
        struct moeep_ep *ep2 = NULL;
        int r;

        for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++)
                if ((r = moeep_dispatch(ep, &bad[i].a, &res, st)) != -EINVAL) {
                        snprintf(msg, 200, "dispatch with %s returned %d, want -EINVAL", bad[i].what, r);
                        return -1;
                }
        if ((r = moeep_combine(ep, &ca, st)) != -EINVAL) {
                snprintf(msg, 200, "combine without a handle returned %d, want -EINVAL", r);
                return -1;
        }
        int *d_pr = NULL;
        if ((r = moeep_get_dispatch_layout(ep, d_idx, MOEEP_INDEX_INT64, 1, 0, d_pr, d_pr, NULL, st)) !=
            -EINVAL) {
                snprintf(msg, 200, "layout with num_topk 0 returned %d, want -EINVAL", r);
                return -1;
        }
        const struct moeep_ep_config cfgs[] = {
                { .max_tokens_per_rank = 64, .hidden = 1000, .num_experts = 64, .max_topk = 4 },
                { .max_tokens_per_rank = 64, .hidden = 2048, .num_experts = 513, .max_topk = 4 },
                { .max_tokens_per_rank = 64, .hidden = 2048, .num_experts = 64, .max_topk = 10 },
                { .max_tokens_per_rank = 0, .hidden = 2048, .num_experts = 64, .max_topk = 4 },
                { .max_tokens_per_rank = 70000, .hidden = 2048, .num_experts = 64, .max_topk = 4 },
                { .max_tokens_per_rank = 64,
                  .hidden = 2048,
                  .num_experts = 64,
                  .max_topk = 4,
                  .num_sms = -1 },
        };
        for (size_t i = 0; i < sizeof(cfgs) / sizeof(cfgs[0]); i++)
                if ((r = moeep_ep_create(c, &cfgs[i], &ep2)) != -EINVAL) {
                        snprintf(msg, 200, "moeep_ep_create with bad config %zu returned %d, want -EINVAL", i,
                                 r);
                        moeep_ep_destroy(ep2);
                        return -1;
                }
        return 0;
}

/* Dispatch + combine (worst-case mode) captured once in a CUDA graph, then
 * replayed twice with new routing and new data in the same input buffers. */
static int run_graph(char *msg, struct moeep_client *c, struct moeep_ep *ep, const struct tcase *tc, int me,
                     int R, int ci, uint64_t seed, struct input *in, void *d_x, void *d_idx, void *d_w,
                     cudaStream_t st) {
        const int T = in[me].T, H = tc->hidden, K = tc->topk;
        struct moeep_dispatch_args a = {
                .x = d_x,
                .x_type = MOEEP_DTYPE_BF16,
                .num_tokens = T,
                .topk_idx = d_idx,
                .topk_idx_type = MOEEP_INDEX_INT64,
                .topk_weights = d_w,
                .num_topk = K,
                .num_worst_tokens = R * tc->max_tokens,
        };
        struct moeep_dispatch_result res = { 0 }, warm;
        cudaGraph_t graph = NULL;
        cudaGraphExec_t exec = NULL;
        struct comb_io io;
        int rc = -1, num_recv;

        if (comb_io_alloc(&io, tc, R, T) < 0)
                FAIL("cudaMalloc of combine buffers failed");
        /* Outside the capture first: module loading, the handle pool. */
        if (moeep_dispatch(ep, &a, &warm, st) < 0)
                FAIL("warm-up dispatch: %s", moeep_ep_error(ep));
        CK(cudaStreamSynchronize(st));
        moeep_ep_handle_free(warm.handle);

        CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
        int r1 = moeep_dispatch(ep, &a, &res, st);
        struct moeep_combine_args ca = {
                .x = io.y,
                .topk_weights = io.w,
                .num_topk = K,
                .handle = res.handle,
                .out = io.out,
                .out_topk_weights = io.ow,
        };
        int r2 = r1 < 0 ? r1 : moeep_combine(ep, &ca, st);
        cudaError_t ce = cudaStreamEndCapture(st, &graph);
        if (r1 < 0 || r2 < 0 || ce != cudaSuccess)
                FAIL("capture: %s (%s)", r1 < 0 || r2 < 0 ? moeep_ep_error(ep) : "ok",
                     cudaGetErrorString(ce));
        CK(cudaGraphInstantiate(&exec, graph, 0));

        for (int v = 1; v <= 2; v++) {
                int want = 0;
                for (int s = 0; s < R; s++) {
                        input_free(&in[s]);
                        gen_input(&in[s], tc, R, seed, ci, s, v);
                        for (int t = 0; t < in[s].T; t++)
                                want += (in[s].mask[t] >> me) & 1;
                }
                CK(cudaMemcpy(d_x, in[me].x, (size_t)T * H * 2, cudaMemcpyHostToDevice));
                CK(cudaMemcpy(d_idx, in[me].idx, sizeof(int64_t) * (size_t)T * K, cudaMemcpyHostToDevice));
                CK(cudaMemcpy(d_w, in[me].w, sizeof(float) * (size_t)T * K, cudaMemcpyHostToDevice));
                if (combine_prepare(tc, me, R, in, want, &io) < 0)
                        FAIL("preparing combine inputs failed");
                if (poison_and_sync(ep, c) < 0)
                        FAIL("poison/barrier failed");
                CK(cudaGraphLaunch(exec, st));
                CK(cudaStreamSynchronize(st));
                if (moeep_ep_check(ep) < 0)
                        FAIL("graph replay %d failed on the device: %s", v, moeep_ep_error(ep));
                CK(cudaMemcpy(&num_recv, res.num_recv_tokens_dev, sizeof(int), cudaMemcpyDeviceToHost));
                if (verify_dispatch(msg, tc, me, R, in, &res, num_recv, true) < 0 ||
                    combine_verify(msg, tc, me, R, in, &io, true) < 0)
                        goto out;
        }
        rc = 0;
out:
        if (exec)
                cudaGraphExecDestroy(exec);
        if (graph)
                cudaGraphDestroy(graph);
        moeep_ep_handle_free(res.handle);
        comb_io_free(&io);
        return rc;
}

static int run_case(struct moeep_client *c, int me, int R, int ci, uint64_t seed, char *msg) {
        const struct tcase *tc = &cases[ci];
        struct moeep_ep_config cfg = {
                .max_tokens_per_rank = tc->max_tokens,
                .hidden = tc->hidden,
                .num_experts = tc->experts,
                .max_topk = tc->topk,
                .timeout_ms = 20000,
                .recv_areas = tc->areas,
        };
        struct input in[MOEEP_MAX_RANKS] = { 0 };
        struct moeep_ep *ep = NULL;
        struct moeep_dispatch_result res;
        struct moeep_ep_handle *handle = NULL;
        cudaStream_t st = NULL;
        void *d_x = NULL, *d_sc = NULL, *d_idx = NULL, *d_w = NULL, *d_in_rank = NULL;
        int *d_pr = NULL, *d_pe = NULL;
        uint8_t *d_lin = NULL;
        int H = tc->hidden, K = tc->topk, E = tc->experts, T, rc = -1, num_recv, r;

        msg[0] = '\0';
        if ((r = moeep_ep_create(c, &cfg, &ep)) < 0) {
                snprintf(msg, 200, "moeep_ep_create: %s", strerror(-r));
                return -1;
        }
        for (int s = 0; s < R; s++)
                gen_input(&in[s], tc, R, seed, ci, s, 0);
        T = in[me].T;
        CK(cudaStreamCreate(&st));

        /* My inputs on the device. */
        d_x = tc->fp8 ? dev_upload(in[me].xq, (size_t)T * H) : dev_upload(in[me].x, (size_t)T * H * 2);
        if (tc->fp8 && tc->colmajor) {
                /* [H / 128][T] in memory: scale b of token t at b * T + t. */
                float *col = malloc(sizeof(float) * (size_t)T * (H / 128) + 4);
                for (int t = 0; t < T; t++)
                        for (int b = 0; b < H / 128; b++)
                                col[(size_t)b * T + t] = in[me].sc[(size_t)t * (H / 128) + b];
                d_sc = dev_upload(col, sizeof(float) * (size_t)T * (H / 128));
                free(col);
        } else
                d_sc = tc->fp8 ? dev_upload(in[me].sc, sizeof(float) * (size_t)T * (H / 128)) : NULL;
        if (tc->idx32) {
                int32_t *i32 = malloc(sizeof(int32_t) * (size_t)T * K + 4);
                for (size_t i = 0; i < (size_t)T * K; i++)
                        i32[i] = (int32_t)in[me].idx[i];
                d_idx = dev_upload(i32, sizeof(int32_t) * (size_t)T * K);
                free(i32);
        } else
                d_idx = dev_upload(in[me].idx, sizeof(int64_t) * (size_t)T * K);
        d_w = dev_upload(in[me].w, sizeof(float) * (size_t)T * K);
        if (!d_x || !d_idx || !d_w || (tc->fp8 && !d_sc))
                FAIL("cudaMalloc of inputs failed");

        if (tc->bad_args) {
                rc = check_bad_args(msg, c, ep, tc, d_x, d_idx, st);
                goto out;
        }
        if (tc->graph) {
                rc = run_graph(msg, c, ep, tc, me, R, ci, seed, in, d_x, d_idx, d_w, st);
                goto out;
        }

        if (T == 0) {
                /* As an empty torch tensor: no array at all, num_topk still set. */
                cudaFree(d_idx);
                cudaFree(d_w);
                d_idx = d_w = NULL;
        }

        /* Layout against the CPU. */
        CK(cudaMalloc((void **)&d_pr, sizeof(int) * R));
        CK(cudaMalloc((void **)&d_pe, sizeof(int) * E));
        CK(cudaMalloc((void **)&d_lin, (size_t)T * R + 1));
        CK(cudaMemset(d_lin, 0xa5, (size_t)T * R + 1));
        MK(moeep_get_dispatch_layout(ep, d_idx, tc->idx32 ? MOEEP_INDEX_INT32 : MOEEP_INDEX_INT64, T, K, d_pr,
                                     d_pe, d_lin, st));
        CK(cudaStreamSynchronize(st));
        {
                int *pr = malloc(sizeof(int) * R), *pe = malloc(sizeof(int) * E),
                    *wpr = calloc(R, sizeof(int)), *wpe = calloc(E, sizeof(int));
                uint8_t *lin = malloc((size_t)T * R + 1);
                int bad = 0;
                cudaMemcpy(pr, d_pr, sizeof(int) * R, cudaMemcpyDeviceToHost);
                cudaMemcpy(pe, d_pe, sizeof(int) * E, cudaMemcpyDeviceToHost);
                cudaMemcpy(lin, d_lin, (size_t)T * R, cudaMemcpyDeviceToHost);
                for (int t = 0; t < T; t++) {
                        for (int d = 0; d < R; d++) {
                                wpr[d] += (in[me].mask[t] >> d) & 1;
                                bad |= lin[(size_t)t * R + d] != ((in[me].mask[t] >> d) & 1);
                        }
                        for (int k = 0; k < K; k++)
                                if (in[me].idx[(size_t)t * K + k] >= 0)
                                        wpe[in[me].idx[(size_t)t * K + k]]++;
                }
                bad |= memcmp(pr, wpr, sizeof(int) * R) != 0;
                bad |= memcmp(pe, wpe, sizeof(int) * E) != 0;
                free(pr);
                free(pe);
                free(wpr);
                free(wpe);
                free(lin);
                if (bad)
                        FAIL("get_dispatch_layout differs from the CPU reference");
        }
        if (tc->no_topk)
                d_in_rank = d_lin;

        /* Dispatch. */
        if (poison_and_sync(ep, c) < 0)
                FAIL("poison/barrier failed");
        struct moeep_dispatch_args a = {
                .x = d_x,
                .x_type = tc->fp8 ? MOEEP_DTYPE_FP8_E4M3 : MOEEP_DTYPE_BF16,
                .x_scales = d_sc,
                .num_tokens = T,
                .is_token_in_rank = d_in_rank,
                .topk_idx = tc->no_topk ? NULL : d_idx,
                .topk_idx_type = tc->idx32 ? MOEEP_INDEX_INT32 : MOEEP_INDEX_INT64,
                .topk_weights = tc->no_topk ? NULL : d_w,
                .num_topk = K,
                .expert_alignment = tc->align,
                .num_worst_tokens = tc->worst ? R * tc->max_tokens : 0,
                .recv_area = pick_area(tc, me, 0),
                .x_scales_token_stride = tc->colmajor ? 1 : 0,
                .x_scales_block_stride = tc->colmajor ? (T > 0 ? T : 1) : 0,
        };
        MK(moeep_dispatch(ep, &a, &res, st));
        handle = res.handle;
        CK(cudaStreamSynchronize(st));
        if (moeep_ep_check(ep) < 0)
                FAIL("dispatch failed on the device: %s", moeep_ep_error(ep));
        num_recv = res.num_recv_tokens;
        if (tc->worst) {
                if (num_recv != -1)
                        FAIL("worst-case dispatch reported a host count %d", num_recv);
                CK(cudaMemcpy(&num_recv, res.num_recv_tokens_dev, sizeof(int), cudaMemcpyDeviceToHost));
        }
        if (verify_dispatch(msg, tc, me, R, in, &res, num_recv, true) < 0)
                goto out;
        if (!tc->no_topk &&
            check_copy_topk(msg, ep, &a, &res, num_recv, tc->worst ? a.num_worst_tokens : num_recv, st) < 0)
                goto out;
        if (run_combine(msg, ep, tc, me, R, in, handle, num_recv, st) < 0)
                goto out;

        if (tc->reuse) {
                /* Same routing, new payload: the cached handle skips the count
                 * exchange and must place every row exactly as before. */
                for (int s = 0; s < R; s++) {
                        input_free(&in[s]);
                        gen_input(&in[s], tc, R, seed, ci, s, 1);
                }
                CK(cudaMemcpy(d_x, in[me].x, (size_t)T * H * 2, cudaMemcpyHostToDevice));
                if (poison_and_sync(ep, c) < 0)
                        FAIL("poison/barrier failed");
                a.handle = handle;
                a.recv_area = pick_area(tc, me, 1);
                MK(moeep_dispatch(ep, &a, &res, st));
                CK(cudaStreamSynchronize(st));
                if (res.handle != handle)
                        FAIL("cached dispatch returned another handle");
                if (verify_dispatch(msg, tc, me, R, in, &res, num_recv, true) < 0)
                        goto out;
                if (run_combine(msg, ep, tc, me, R, in, handle, num_recv, st) < 0)
                        goto out;
        }
        rc = 0;
out:
        if (rc && !msg[0])
                snprintf(msg, 200, "failed");
        moeep_ep_handle_free(handle);
        cudaFree(d_x);
        cudaFree(d_sc);
        cudaFree(d_idx);
        cudaFree(d_w);
        cudaFree(d_pr);
        cudaFree(d_pe);
        cudaFree(d_lin);
        if (st)
                cudaStreamDestroy(st);
        /* Keep the ranks in step even when this one failed. */
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
                .name = "ep_normal_test",
                .default_ranks = "1,2,4",
                .ncases = NCASES,
                .case_name = case_name,
                .run_case = run_case,
        };

        return suite_main(&suite, argc, argv);
}
