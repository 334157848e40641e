/* The checked low-latency rounds of ep_shrink_test.c; see shrink-round.h.
 * Test code. */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "harness.h"
#include "ref.h"
#include "shrink-round.h"
#include "suite.h" /* now_ns */

void gen_input(struct input *in, uint64_t seed, int ci, int s, int R, int round) {
        struct rng r = rng_make(seed, (uint64_t)ci * 64 + (uint64_t)s, 11 + 17 * (uint64_t)round);

        in->T = 1 + (int)(rng_next(&r) % MAX_T);
        for (int t = 0; t < in->T; t++) {
                draw_topk(&r, in->idx + (size_t)t * K, K, 0, EPR * R, 0.1);
                for (int k = 0; k < K; k++)
                        in->w[(size_t)t * K + k] = (float)rng_unit(&r);
        }
        for (size_t i = 0; i < (size_t)in->T * H; i++)
                in->x[i] = float_to_bf16((float)((int)(rng_next(&r) % 33) - 16) / 16.0f);
}

int rk_alloc(struct rk *k) {
        k->in = calloc((size_t)k->R, sizeof(*k->in));
        k->got = malloc((size_t)MAX_T * H * 2);
        k->rx = malloc((size_t)k->S * H * 2);
        k->src = malloc((size_t)k->S * sizeof(int));
        k->range = malloc((size_t)k->L * k->R * sizeof(int64_t));
        if (!k->in || !k->got || !k->rx || !k->src || !k->range || cudaStreamCreate(&k->st) != cudaSuccess ||
            cudaMalloc(&k->x, (size_t)MAX_T * H * 2) != cudaSuccess ||
            cudaMalloc(&k->idx, (size_t)MAX_T * K * 8) != cudaSuccess ||
            cudaMalloc((void **)&k->w, (size_t)MAX_T * K * 4) != cudaSuccess ||
            cudaMalloc(&k->out, (size_t)MAX_T * H * 2) != cudaSuccess ||
            cudaMalloc(&k->y, (size_t)k->R * MAX_T * H * 2) != cudaSuccess ||
            cudaMalloc((void **)&k->mask_dev, MOEEP_MAX_RANKS * sizeof(int32_t)) != cudaSuccess)
                return -1;
        return 0;
}

void rk_free(struct rk *k) {
        cudaFree(k->x);
        cudaFree(k->idx);
        cudaFree(k->w);
        cudaFree(k->out);
        cudaFree(k->y);
        cudaFree(k->mask_dev);
        if (k->st)
                cudaStreamDestroy(k->st);
        free(k->in);
        free(k->got);
        free(k->rx);
        free(k->src);
        free(k->range);
}

/* The endpoint's mask as bits; 0 on failure (with msg). */
int mask_bits(struct rk *k, uint32_t *ret) {
        int32_t m[MOEEP_MAX_RANKS];

        if (moeep_ll_mask_query(k->ep, k->mask_dev, k->st) < 0 ||
            cudaStreamSynchronize(k->st) != cudaSuccess ||
            cudaMemcpy(m, k->mask_dev, sizeof(int32_t) * k->R, cudaMemcpyDeviceToHost) != cudaSuccess)
                FAIL("mask query: %s", moeep_ep_error(k->ep));
        *ret = 0;
        for (int r = 0; r < k->R; r++)
                if (m[r])
                        *ret |= 1u << r;
        return 0;
}

int upload(struct rk *k, const struct input *in) {
        if (cudaMemcpy(k->x, in->x, (size_t)in->T * H * 2, cudaMemcpyHostToDevice) != cudaSuccess ||
            cudaMemcpy(k->idx, in->idx, (size_t)in->T * K * 8, cudaMemcpyHostToDevice) != cudaSuccess ||
            cudaMemcpy(k->w, in->w, (size_t)in->T * K * 4, cudaMemcpyHostToDevice) != cudaSuccess ||
            cudaMemset(k->out, 0xff, (size_t)MAX_T * H * 2) != cudaSuccess)
                FAIL("uploading the inputs failed");
        return 0;
}

/* Pairs of source s for global expert e. */
static int pairs_of(const struct input *in, int e) {
        int n = 0;

        for (int i = 0; i < in->T * K; i++)
                n += in->idx[i] == e;
        return n;
}

/* Checks the receive side (see the top): sources in `must_absent` must be
 * absent, in `may_absent` may be, the others present. Returns the sources
 * found absent (that had pairs for us) in *ret_absent. */
static int verify_dispatch(struct rk *k, const struct moeep_ll_dispatch_result *res, uint32_t must_absent,
                           uint32_t may_absent, uint32_t *ret_absent) {
        const int R = k->R, L = k->L, S = k->S, me = k->me;
        uint32_t present = 0, absent = 0;
        int counts[EPR * MOEEP_MAX_RANKS];

        if (cudaMemcpy(k->range, res->layout_range, sizeof(int64_t) * L * R, cudaMemcpyDeviceToHost) !=
                    cudaSuccess ||
            cudaMemcpy(counts, res->recv_count, sizeof(int) * L, cudaMemcpyDeviceToHost) != cudaSuccess)
                FAIL("reading layout_range / recv_count failed");
        /* Sources in rank order, this daemon's first. */
        int order[MOEEP_MAX_RANKS], no = 0;
        for (int pass = 0; pass < 2; pass++)
                for (int s = 0; s < R; s++)
                        if ((k->two && harness_node_of(s, R) != harness_node_of(me, R)) == (pass == 1))
                                order[no++] = s;
        for (int le = 0; le < L; le++) {
                const int e = me * L + le;
                int begin = 0;
                for (int oi = 0; oi < R; oi++) {
                        const int s = order[oi], want = pairs_of(&k->in[s], e);
                        const int64_t v = k->range[(size_t)le * R + s];
                        const int got = (int)(v & 0xffffffff);
                        if (want == 0 && got == 0)
                                continue;
                        if (got == want) {
                                present |= 1u << s;
                        } else if (got == 0) {
                                absent |= 1u << s;
                                continue;
                        } else {
                                FAIL("expert %d: layout_range of rank %d counts %d pairs, want %d or 0", e, s,
                                     got, want);
                        }
                        if ((v >> 32) != begin)
                                FAIL("expert %d: rank %d's run starts at %lld, want %d (runs from slot 0 on, "
                                     "in "
                                     "rank order)",
                                     e, s, (long long)(v >> 32), begin);
                        begin += got;
                }
                if (counts[le] != begin)
                        FAIL("expert %d: recv_count %d, the runs add up to %d", e, counts[le], begin);
                if (cudaMemcpy(k->rx, (const char *)res->recv_x + (size_t)le * S * H * 2,
                               (size_t)begin * H * 2, cudaMemcpyDeviceToHost) != cudaSuccess ||
                    cudaMemcpy(k->src, res->recv_src_info + (size_t)le * S, sizeof(int) * begin,
                               cudaMemcpyDeviceToHost) != cudaSuccess)
                        FAIL("reading expert %d's slots failed", e);
                for (int oi = 0; oi < R; oi++) {
                        const int s = order[oi];
                        const int64_t v = k->range[(size_t)le * R + s];
                        const int first = (int)(v >> 32), n = (int)(v & 0xffffffff);
                        uint8_t seen[MAX_T] = { 0 };
                        for (int p = first; p < first + n; p++) {
                                const int t = k->src[p];
                                if (t < 0 || t >= k->in[s].T || seen[t]++)
                                        FAIL("expert %d slot %d: token %d of rank %d is not expected there "
                                             "(or "
                                             "twice)",
                                             e, p, t, s);
                                bool has = false;
                                for (int j = 0; j < K; j++)
                                        has |= k->in[s].idx[(size_t)t * K + j] == e;
                                if (!has || memcmp(k->rx + (size_t)p * H * 2, k->in[s].x + (size_t)t * H,
                                                   (size_t)H * 2))
                                        FAIL("expert %d slot %d (rank %d token %d): %s", e, p, s, t,
                                             has ? "row differs" : "no such pair");
                        }
                }
        }
        if (present & absent)
                FAIL("ranks 0x%x are there at some experts and absent at others", present & absent);
        if (absent & ~(must_absent | may_absent))
                FAIL("ranks 0x%x are absent, only 0x%x may be", absent, must_absent | may_absent);
        if (present & must_absent)
                FAIL("ranks 0x%x masked before the call are there", present & must_absent);
        *ret_absent = absent;
        return 0;
}

/* Checks the combine output: per 512-channel piece of each token, the
 * weighted sum of its experts' outputs (every expert is the identity: the
 * combine reads the dispatch's slots in place, zero copy) without the
 * experts of ranks in `out` and of any subset of `maybe`. */
static int verify_combine(struct rk *k, uint32_t out, uint32_t maybe) {
        const struct input *in = &k->in[k->me];
        int mr[MOEEP_MAX_RANKS], nm = 0;

        for (int r = 0; r < k->R; r++)
                if ((maybe >> r & 1) && !(out >> r & 1))
                        mr[nm++] = r;
        if (cudaMemcpy(k->got, k->out, (size_t)in->T * H * 2, cudaMemcpyDeviceToHost) != cudaSuccess)
                FAIL("reading the combine output failed");
        for (int t = 0; t < in->T; t++)
                for (int c0 = 0; c0 < H; c0 += PIECE) {
                        bool ok = false;
                        for (int sub = 0; sub < 1 << nm && !ok; sub++) {
                                uint32_t left_out = out;
                                for (int j = 0; j < nm; j++)
                                        if (sub >> j & 1)
                                                left_out |= 1u << mr[j];
                                ok = true;
                                for (int c = c0; c < c0 + PIECE && ok; c++) {
                                        double ref = 0;
                                        for (int j = 0; j < K; j++) {
                                                const int64_t e = in->idx[(size_t)t * K + j];
                                                if (e < 0 || (left_out >> (e / EPR) & 1))
                                                        continue;
                                                ref += (double)in->w[(size_t)t * K + j] *
                                                       bf16_to_float(in->x[(size_t)t * H + c]);
                                        }
                                        const float g = bf16_to_float(k->got[(size_t)t * H + c]);
                                        ok = fabs(g - ref) <= fmax(fabs(ref), 1.0) / 64.0;
                                }
                        }
                        if (!ok)
                                FAIL("combine token %d channels %d..%d: no reference leaving out ranks 0x%x "
                                     "(and any "
                                     "of 0x%x) matches",
                                     t, c0, c0 + PIECE - 1, out, maybe);
                }
        return 0;
}

int half_dispatch(struct rk *k, struct round *rd, int round, uint32_t lost_ok, bool quiet, bool hook) {
        struct moeep_ll_hook hk = { 0 };
        uint32_t after = 0, absent = 0;

        *rd = (struct round){ .quiet = quiet, .hook = hook, .n = round };
        for (int s = 0; s < k->R; s++)
                if (!quiet || s == k->me)
                        gen_input(&k->in[s], k->seed, k->ci, s, k->R, round);
        if (upload(k, &k->in[k->me]) < 0 || (!quiet && mask_bits(k, &rd->mask) < 0))
                return -1;
        struct moeep_ll_dispatch_args da = { .x = k->x,
                                             .num_tokens = k->in[k->me].T,
                                             .topk_idx = k->idx,
                                             .topk_idx_type = MOEEP_INDEX_INT64,
                                             .num_topk = K,
                                             .return_recv_hook = hook };
        if (moeep_ll_dispatch(k->ep, &da, &rd->res, &hk, k->st) < 0 ||
            (hook && moeep_ll_hook_run(k->ep, &hk, k->st) < 0))
                FAIL("round %d: dispatch: %s", round, moeep_ep_error(k->ep));
        if (cudaStreamSynchronize(k->st) != cudaSuccess || moeep_ep_check(k->ep) < 0)
                FAIL("round %d: dispatch failed on the device: %s", round, moeep_ep_error(k->ep));
        rd->t_done = now_ns();
        if (quiet)
                return 0;
        if (mask_bits(k, &after) < 0)
                return -1;
        if (after & ~(rd->mask | lost_ok))
                FAIL("round %d: dispatch masked ranks 0x%x, only 0x%x may go", round, after & ~rd->mask,
                     lost_ok);
        if (verify_dispatch(k, &rd->res, rd->mask, after & ~rd->mask, &absent) < 0)
                return -1;
        rd->mask = after;
        return 0;
}

int half_combine(struct rk *k, struct round *rd, uint32_t lost_ok) {
        struct moeep_ll_hook hk = { 0 };
        uint32_t after = 0;

        if (!rd->quiet && mask_bits(k, &rd->mask) < 0)
                return -1;
        struct moeep_ll_combine_args ca = { .x = rd->res.combine_buffer,
                                            .topk_idx = k->idx,
                                            .topk_idx_type = MOEEP_INDEX_INT64,
                                            .topk_weights = k->w,
                                            .num_topk = K,
                                            .handle = &rd->res.handle,
                                            .out = k->out,
                                            .return_recv_hook = rd->hook };
        if (moeep_ll_combine(k->ep, &ca, &hk, k->st) < 0 ||
            (rd->hook && moeep_ll_hook_run(k->ep, &hk, k->st) < 0))
                FAIL("round %d: combine: %s", rd->n, moeep_ep_error(k->ep));
        if (cudaStreamSynchronize(k->st) != cudaSuccess || moeep_ep_check(k->ep) < 0)
                FAIL("round %d: combine failed on the device: %s", rd->n, moeep_ep_error(k->ep));
        rd->t_done = now_ns();
        if (rd->quiet)
                return 0;
        if (mask_bits(k, &after) < 0)
                return -1;
        if (after & ~(rd->mask | lost_ok))
                FAIL("round %d: combine masked ranks 0x%x, only 0x%x may go", rd->n, after & ~rd->mask,
                     lost_ok);
        return verify_combine(k, rd->mask, after & ~rd->mask);
}

int ll_round(struct rk *k, int round, uint32_t lost_ok, bool quiet, bool hook) {
        struct round rd;

        if (half_dispatch(k, &rd, round, lost_ok, quiet, hook) < 0)
                return -1;
        return half_combine(k, &rd, lost_ok);
}
