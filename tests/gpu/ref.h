/* CPU reference helpers of the GPU tests: a seeded PRNG, bf16 and fp8 e4m3
 * conversions (round to nearest even, written from the formats'
 * definitions, independent of CUDA's intrinsics) and MoE routing draws. */
#ifndef MOEEP_TEST_REF_H
#define MOEEP_TEST_REF_H

#include <math.h>
#include <stdint.h>
#include <string.h>

struct rng {
        uint64_t s;
};

static inline uint64_t rng_next(struct rng *r) {
        uint64_t z = (r->s += 0x9e3779b97f4a7c15ull);
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
        return z ^ (z >> 31);
}

static inline struct rng rng_make(uint64_t seed, uint64_t a, uint64_t b) {
        struct rng r = { seed ^ (a * 0xd1342543de82ef95ull) ^ (b * 0x2545f4914f6cdd1dull) };
        rng_next(&r);
        return r;
}

/* Uniform in [0, 1). */
static inline double rng_unit(struct rng *r) {
        return (double)(rng_next(r) >> 11) * (1.0 / 9007199254740992.0);
}

static inline float bf16_to_float(uint16_t h) {
        uint32_t u = (uint32_t)h << 16;
        float f;
        memcpy(&f, &u, 4);
        return f;
}

static inline uint16_t float_to_bf16(float f) {
        uint32_t u;
        memcpy(&u, &f, 4);
        if ((u & 0x7fffffffu) > 0x7f800000u)
                return 0x7fc0; /* NaN */
        u += 0x7fffu + ((u >> 16) & 1u);
        return (uint16_t)(u >> 16);
}

/* e4m3: 1 sign, 4 exponent (bias 7), 3 mantissa bits; max 448, no inf. */
static inline float e4m3_to_float(uint8_t v) {
        int e = (v >> 3) & 0xf, m = v & 7;
        float mag = e ? ldexpf(1.0f + m / 8.0f, e - 7) : ldexpf(m / 8.0f, -6);
        if ((v & 0x7f) == 0x7f)
                return NAN;
        return (v & 0x80) ? -mag : mag;
}

/* Nearest e4m3 code, ties to even, saturating at 448. */
static inline uint8_t float_to_e4m3(float f) {
        uint8_t sign = signbit(f) ? 0x80 : 0, best = 0;
        float a = fabsf(f), best_err = INFINITY;

        if (a >= 448.0f)
                return sign | 0x7e;
        for (int c = 0; c < 0x7f; c++) {
                float err = fabsf(e4m3_to_float((uint8_t)c) - a);
                if (err < best_err || (err == best_err && (c & 1) == 0)) {
                        best_err = err;
                        best = (uint8_t)c;
                }
        }
        return sign | best;
}

/* K distinct experts out of [lo, lo + n), each masked (-1) with
 * probability mask_p; as DeepEP's tests: top-k of random scores. */
static inline void draw_topk(struct rng *r, int64_t *out, int k, int lo, int n, double mask_p) {
        for (int i = 0; i < k; i++) {
                int64_t e;
                int dup;
                do {
                        e = lo + (int64_t)(rng_next(r) % (uint64_t)n);
                        dup = 0;
                        for (int j = 0; j < i; j++)
                                dup |= out[j] == e;
                } while (dup);
                out[i] = e;
        }
        for (int i = 0; i < k; i++)
                if (rng_unit(r) < mask_p)
                        out[i] = -1;
}

#endif
