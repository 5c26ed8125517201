/* sample_passes.h: the bodies of the sampler's passes (core/sample.h) over a whole logits row, written
 * once as plain loops that gcc vectorises, compiled once per level that has its own vectors:
 * scalar_sample.c (the baseline: SSE2 on x86-64, NEON on aarch64), avx2_sample.c, avx512f_sample.c
 * (their FLAGS). Each of those files defines its level's table with DEFINE_SAMPLE_PASSES and the
 * level's fill sets kernels.h's sample_passes to it. Every level computes the same bits: only single
 * IEEE operations, each rounded as written (FLAGS: -ffp-contract=off, so no fused multiply-adds;
 * -fno-trapping-math lets gcc vectorise the selects and changes no value). */
#ifndef CPUMLA_SAMPLE_PASSES_H
#define CPUMLA_SAMPLE_PASSES_H
#include <stdint.h>
#include <string.h>
#include "core/sample.h"

#define SAMPLE_Y_MIN (-87.0f)       /* p = 0 below: exp(-87) is near float32's smallest normal */

/* The definition's exp of y <= 0 (Cody-Waite reduction, Cephes' expf polynomial), float32 steps in
 * this order; sampling.py's _exp is the same steps in numpy. The constants are the float32 values of
 * Cephes' decimals, written exactly. */
static inline float sample_exp(float y) {
    float yc = y < SAMPLE_Y_MIN ? SAMPLE_Y_MIN : y;      /* -inf too; the result is masked below */
    float t = yc * 0x1.715476p+0f;                       /* log2(e) */
    float k = (t + 0x1.8p+23f) - 0x1.8p+23f;             /* round to nearest even (|t| < 2^22) */
    float r = (yc - k * 0x1.63p-1f) - k * -0x1.bd0106p-13f;     /* y - k ln 2, ln 2 in two parts */
    float q = 0x1.a0d2cep-13f;
    q = q * r + 0x1.6e879cp-10f;
    q = q * r + 0x1.11121p-7f;
    q = q * r + 0x1.555382p-5f;
    q = q * r + 0x1.555554p-3f;
    q = q * r + 0x1p-1f;
    float e = q * (r * r) + r + 1.0f;
    float p = e * sample_u2f((uint32_t)((int32_t)k + 127) << 23);     /* * 2^k, k in [-126, 0] */
    p = p < 1.0f ? p : 1.0f;
    return y < SAMPLE_Y_MIN ? 0.0f : p;
}

/* On float bits mapped to integers that order like the floats: gcc vectorises an integer max, not a
 * float one (whose NaN and signed-zero rules it must keep). */
static int sample_row_max(const float *x, int64_t n, float *max) {
    int32_t key_max = INT32_MIN;
    uint32_t nan = 0;
    for (int64_t i = 0; i < n; i++) {
        uint32_t b = sample_f2u(x[i]);
        int32_t key = (int32_t)(b ^ ((uint32_t)((int32_t)b >> 31) >> 1));
        key_max = key > key_max ? key : key_max;
        nan |= (b & 0x7fffffffu) > 0x7f800000u;
    }
    uint32_t kb = (uint32_t)key_max;
    float m = sample_u2f(kb ^ ((uint32_t)((int32_t)kb >> 31) >> 1));
    *max = m;
    if (nan) return SAMPLE_ROW_NAN;
    if (m == __builtin_inff()) return SAMPLE_ROW_INF;
    if (m == -__builtin_inff()) return SAMPLE_ROW_ALL_NEG_INF;
    return SAMPLE_ROW_OK;
}

static void sample_probs(const float *restrict x, int64_t n, float m, float s, float *restrict p) {
    for (int64_t i = 0; i < n; i++) p[i] = sample_exp((x[i] - m) * s);
}

/* A pass of its own: gcc vectorises neither a float min nor a min of bits taken from a float computed
 * in the same loop. */
static uint32_t sample_least(const uint32_t *bits, int64_t n) {
    uint32_t low = ~0u;
    for (int64_t i = 0; i < n; i++) low = bits[i] < low ? bits[i] : low;
    return low;
}

/* The bins of a block of ids first (vectorised; no branch, which a row with and without mass would
 * mispredict), then the adds. Tokens without mass spread over 16 slots, so that their adds do not
 * form one chain through memory. */
static void sample_histogram(const uint32_t *bits, int64_t n, uint32_t lo, int shift, uint32_t dump,
                             float scale, uint32_t *count, uint64_t *mass) {
    uint32_t bin[256];
    for (int64_t i = 0; i < n; i += 256) {
        const int64_t m = n - i < 256 ? n - i : 256;
        for (int64_t j = 0; j < m; j++) {
            const uint32_t b = bits[i + j];
            bin[j] = b >= lo ? (b - lo) >> shift : dump + ((uint32_t)j & 15);
        }
        if (count)
            for (int64_t j = 0; j < m; j++) count[bin[j]]++;
        for (int64_t j = 0; j < m; j++) mass[bin[j]] += (uint64_t)(int64_t)(sample_u2f(bits[i + j]) * scale);
    }
}

/* Blocks of 16 ids are tested at once (vectorised) and only blocks with a member are compacted: the
 * bins asked for are usually a small part of the row. */
static int64_t sample_gather(const uint32_t *bits, int64_t n, uint32_t base, uint32_t width, uint32_t *out,
                             int *same) {
    uint32_t all = ~0u, any = 0;
    int64_t m = 0;
    for (int64_t i = 0; i < n; i += 16) {
        const int64_t end = i + 16 <= n ? i + 16 : n;
        uint32_t hit = end - i < 16;
        if (!hit)
            for (int j = 0; j < 16; j++) hit |= bits[i + j] - base < width;
        if (!hit) continue;
        for (int64_t j = i; j < end; j++) {
            const uint32_t b = bits[j], in = b - base < width, mask = 0u - in;
            out[m] = (uint32_t)j;
            m += in;
            all &= b | ~mask;
            any |= b & mask;
        }
    }
    *same = m > 0 && all == any;
    return m;
}

#define DEFINE_SAMPLE_PASSES(name) \
    const sample_passes name = {sample_row_max, sample_probs, sample_least, sample_histogram, sample_gather}

#endif
