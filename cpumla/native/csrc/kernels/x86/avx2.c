/* avx2.c: AVX2 + FMA + F16C kernels (compiled with -mavx2 -mfma -mf16c). Same semantics as scalar.c,
 * which is the spec; results agree with it to float rounding (sums are associated differently).
 *
 * Weight decoding tricks (all exact):
 *   BF16  zero-extend to 32 bits and shift left 16.
 *   E4M3  byte b -> fp16 bits ((b << 8) >>arith 1) & 0xbf80, i.e. sign | (b & 0x7f) << 7, which is
 *         the value * 2^-8 (subnormals included), widened with vcvtph2ps: e4m3's subnormals are fp16
 *         subnormals, which come out as normal fp32, so no multiply ever sees a subnormal weight
 *         operand (on Intel cores such an operand costs a microcode assist per instruction). 0x7f /
 *         0xff are forced to NaN as in the spec (dequant_row, gemv_t, gemm's panels; gemv by a mask
 *         per row). The block scale goes into the activation operand, bf16(x * scale) (kernels.h),
 *         never onto a partial sum.
 *   E2M1  (gemv_t, dequant_row) two vpshufb lookups give the low and high byte of each code's bf16
 *         value; gemv / gemm hand E2M1 back (kernels.h: the integer product, quant.h).
 * Single-threaded: ops.c and mla_attention.c split rows / columns / heads / KV ranges over the pool.
 *
 * This file holds gemv, the gemm of 2 or 3 tokens on gemv's loops, gemv_t and dequant_row; the gemm
 * (panels decoded with dequant_row) is in
 * avx2_gemm.c, the row-wise and attention kernels in avx2_rows.c, the integer products in avx2_q.c,
 * the sampler's passes in avx2_sample.c: cpumla_fill_avx2 sets them all. Shared helpers:
 * avx2_common.h. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include "core/common.h"
#include "core/kernels.h"
#include "core/dispatch.h"
#include "core/sample.h"
#include "kernels/x86/avx2_common.h"

const char cpumla_flags_avx2[] = CPUMLA_FLAGS;

/* ---- helpers ---------------------------------------------------------------------------------- */
/* Layouts the fast paths do not cover go to the entry this one replaced (the scalar spec): E2M1 (every
 * layout: kern_gemv sends 1x32 E8M0 blocks to the integer product first), and degenerate block shapes.
 * The activation operands of BF16 and E4M3 weights (kernels.h) go to the thread's
 * CPUMLA_SCRATCH_AVX2_XR buffer (avx2_gemm.c's too); without it a kernel does nothing (the call then
 * fails). */
static void (*prev_gemv)(const cpumla_weight *, const float *, float *, int64_t, int64_t);

/* ---- dequant_row -------------------------------------------------------------------------------- */
void cpumla_avx2_dequant_row(const cpumla_weight *w, int64_t r, int64_t c0, int64_t c1, float *out) {
    const uint8_t *row = weight_row(w, r);
    int64_t c = c0;
    switch (w->dtype) {
    case CPUMLA_F32:
        memcpy(out, (const float *)row + c0, (size_t)(c1 - c0) * sizeof(float));
        return;
    case CPUMLA_BF16:
        for (; c + 8 <= c1; c += 8) _mm256_storeu_ps(out + c - c0, ld_bf16((const uint16_t *)row + c));
        for (; c < c1; c++) out[c - c0] = bf16_to_f32(((const uint16_t *)row)[c]);
        return;
    case CPUMLA_F16:
        for (; c + 8 <= c1; c += 8) _mm256_storeu_ps(out + c - c0, ld_f16((const uint16_t *)row + c));
        for (; c < c1; c++) out[c - c0] = f16_to_f32(((const uint16_t *)row)[c]);
        return;
    case CPUMLA_E4M3:
        while (c < c1) {
            int64_t be = (c / w->block_cols + 1) * w->block_cols;
            if (be > c1) be = c1;
            float s = weight_scale(w, r, c);
            __m256 vs = _mm256_set1_ps(s * 256.0f);
            for (; c + 8 <= be; c += 8) _mm256_storeu_ps(out + c - c0, _mm256_mul_ps(ld_e4m3x8(row + c), vs));
            for (; c < be; c++) out[c - c0] = e4m3_to_f32(row[c]) * s;
        }
        return;
    case CPUMLA_E2M1: {
        __m256i tl = fp4_tl(), th = fp4_th();
        while (c < c1) {
            int64_t be = (c / w->block_cols + 1) * w->block_cols;
            if (be > c1) be = c1;
            float s = weight_scale(w, r, c);
            __m256 vs = _mm256_set1_ps(s);
            if ((c & 1) && c < be) { out[c - c0] = e2m1_at(row, c) * s; c++; }
            for (; c + 32 <= be; c += 32) {
                __m256 o[4];
                ld_e2m1x32_nat(row + (c >> 1), tl, th, o);
                for (int k = 0; k < 4; k++) _mm256_storeu_ps(out + c - c0 + 8 * k, _mm256_mul_ps(o[k], vs));
            }
            for (; c < be; c++) out[c - c0] = e2m1_at(row, c) * s;
        }
        return;
    }
    default:
        for (; c < c1; c++) out[c - c0] = weight_at(w, r, c);
    }
}

/* ---- gemv ---------------------------------------------------------------------------------------- */
/* 8 plain (F32 / BF16 / F16) weights at column c; dt is a constant after inlining */
INLINE __m256 ld_plain(const uint8_t *row, int64_t c, int dt) {
    if (dt == CPUMLA_F32) return _mm256_loadu_ps((const float *)row + c);
    if (dt == CPUMLA_BF16) return ld_bf16((const uint16_t *)row + c);
    return ld_f16((const uint16_t *)row + c);
}
INLINE float at_plain(const uint8_t *row, int64_t c, int dt) {
    if (dt == CPUMLA_F32) return ((const float *)row)[c];
    if (dt == CPUMLA_BF16) return bf16_to_f32(((const uint16_t *)row)[c]);
    return f16_to_f32(((const uint16_t *)row)[c]);
}

/* The line to prefetch for row i (row start pi, group start p0) at byte offset off of each row, pf
 * bytes ahead. lin (the 4 rows lie back to back): the group ahead is one contiguous range, fetched in
 * address order, 4 lines per 64 bytes of a row (4 * off + 64 * i), which the memory system serves
 * better than 4 interleaved page streams. */
INLINE const char *pf_at(const uint8_t *p0, const uint8_t *pi, int64_t pf, int lin, int i, int64_t off) {
    return (const char *)(lin ? p0 + pf + 4 * off + 64 * i : pi + off + pf);
}

/* Software prefetch of the E4M3 row groups (gemv_e4m3_rows): the group PF_ROWS rows ahead, at the same
 * column: each group starts four new streams, which the hardware prefetchers pick up too late on their
 * own. */
#ifndef PF_ON
#define PF_ON 1
#endif
#ifndef PF_ROWS
#define PF_ROWS 8
#endif
#define FEW_NT 3   /* the most tokens of the gemv's loops (a verify forward of drafts) */
/* Plain rows (F32 / BF16 / F16) one at a time: the rows of a range are one sequential stream, with a
 * software prefetch GEMV_PF_BYTES ahead of it (common.h). A row is read 32 columns a step into four
 * partial sums: one stream keeps the memory system busier than four rows at a time would, even with
 * their shared x loads. NT tokens (x ldx apart, x already rounded for BF16; results ldy apart) share
 * each step's weights, every token's sums in the same order: NT = 1 is the gemv, 2 and 3 the gemm of
 * a few tokens below, each token's result bit for bit its gemv's. */
INLINE void plain_rows_pf(const cpumla_weight *w, const float *x, int64_t ldx, int NT, float *y, int64_t ldy,
                          int64_t r0, int64_t r1, int dt, int l2) {
    const int64_t K = w->cols, K32 = K & ~(int64_t)31, esz = dt == CPUMLA_F32 ? 4 : 2;
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *p = weight_row(w, r);
        __m256 a[FEW_NT][4];
        UNROLL for (int t = 0; t < NT; t++) UNROLL for (int i = 0; i < 4; i++) a[t][i] = _mm256_setzero_ps();
        int64_t c = 0;
        for (; c < K32; c += 32) {
            for (int64_t b = 0; b < 32 * esz; b += 64) GEMV_PF_LINE((const char *)p + c * esz + b + GEMV_PF_BYTES, GEMV_PF_BYTES, l2);
            UNROLL for (int i = 0; i < 4; i++) {
                const __m256 wv = ld_plain(p, c + 8 * i, dt);
                UNROLL for (int t = 0; t < NT; t++) a[t][i] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + t * ldx + c + 8 * i), a[t][i]);
            }
        }
        for (; c + 8 <= K; c += 8) {
            const __m256 wv = ld_plain(p, c, dt);
            UNROLL for (int t = 0; t < NT; t++) a[t][0] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + t * ldx + c), a[t][0]);
        }
        const int64_t ct = c;
        UNROLL for (int t = 0; t < NT; t++) {
            float s = hsum8(_mm256_add_ps(_mm256_add_ps(a[t][0], a[t][1]), _mm256_add_ps(a[t][2], a[t][3])));
            for (c = ct; c < K; c++) s += at_plain(p, c, dt) * x[t * ldx + c];
            y[t * ldy + (r - r0)] = s;
        }
    }
}

/* FP8 e4m3 (kernels.h): each code times its activation operand bf16(x * block scale), summed in fp32.
 * For each row block [r0, r1) touches, the operands of the whole row are made once (e4m3_act_row into
 * xs, this thread's buffer), then each row is a plain dot product with xs, 32 bytes per step per row,
 * 4 rows at a time (a group never straddles a row block). The 32 codes of a step are decoded by
 * e4m3_dec32: even and odd bytes become fp16 bits of value * 2^-8 (as ld_e4m3x8) and vcvtph2ps widens
 * them, so every operand the FMAs see is a normal fp32 or zero (e4m3's subnormals, m * 2^-17 here, are
 * normal in fp32): no code takes a microcode assist, whatever the weights hold. The 2^8 goes into the
 * activation operand: xs = bf16(x * (scale * 2^8)) = bf16(x * scale) * 2^8 exactly, so every product
 * is the spec's, exact. The operands of the first K - K % 32 columns are rearranged in place
 * (e4m3_perm_x) to the decode's column order; the last K % 32 columns (scalar) use xs as is. NaN codes
 * 0x7f / 0xff decode to +-480 there, so each row also keeps the byte-wise max of its codes | 0x80 (two
 * ops a step, no branch): a row that met one (a 0xff byte) gives NaN, as the spec does. */

/* 32 E4M3 bytes -> f[0..3], each code's value * 2^-8: f[0] lane i is column 2i, f[1] column 16 + 2i,
 * f[2] column 2i + 1, f[3] column 17 + 2i */
INLINE void e4m3_dec32(__m256i d, __m256 f[4]) {
    const __m256i m = _mm256_set1_epi16((short)0xbf80);
    __m256i he = _mm256_and_si256(_mm256_srai_epi16(_mm256_slli_epi16(d, 8), 1), m);   /* even bytes */
    __m256i ho = _mm256_and_si256(_mm256_srai_epi16(d, 1), m);                          /* odd bytes */
    f[0] = _mm256_cvtph_ps(_mm256_castsi256_si128(he));
    f[1] = _mm256_cvtph_ps(_mm256_extracti128_si256(he, 1));
    f[2] = _mm256_cvtph_ps(_mm256_castsi256_si128(ho));
    f[3] = _mm256_cvtph_ps(_mm256_extracti128_si256(ho, 1));
}

/* xp[0, n) (n a multiple of 32) rearranged per 32-group to e4m3_dec32's order, in place */
static void e4m3_perm_x(float *xp, int64_t n) {
    for (int64_t g = 0; g < n; g += 32) {
        __m256 v0 = _mm256_load_ps(xp + g), v1 = _mm256_load_ps(xp + g + 8);
        __m256 v2 = _mm256_load_ps(xp + g + 16), v3 = _mm256_load_ps(xp + g + 24);
        /* shuffle_ps picks within 128-bit lanes; permute4x64 (0xd8) puts the 64-bit pairs in order */
        __m256 o[4] = {_mm256_shuffle_ps(v0, v1, 0x88), _mm256_shuffle_ps(v2, v3, 0x88),
                       _mm256_shuffle_ps(v0, v1, 0xdd), _mm256_shuffle_ps(v2, v3, 0xdd)};
        for (int j = 0; j < 4; j++)
            _mm256_store_ps(xp + g + 8 * j, _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(o[j]), 0xd8)));
    }
}

/* rows [rs, re) of one row block, xs prepared by gemv_e4m3 */
INLINE void gemv_e4m3_rows(const cpumla_weight *w, const float *xs, float *y, int64_t rs, int64_t re, int l2) {
    const int64_t K = w->cols, K32 = K / 32 * 32, pf = PF_ROWS * w->row_bytes;
    for (int64_t r = rs; r < re; r += 4) {
        const int nr = re - r < 4 ? (int)(re - r) : 4, lin = nr == 4 && w->row_bytes == K;
        const uint8_t *p[4];
        for (int i = 0; i < 4; i++) p[i] = weight_row(w, r + (i < nr ? i : 0));
        __m256 a[4], b[4];
        __m256i nan[4];
        for (int i = 0; i < 4; i++) {
            a[i] = b[i] = _mm256_setzero_ps();
            nan[i] = _mm256_setzero_si256();
        }
        const __m256i hi = _mm256_set1_epi8((char)0x80);
        for (int64_t c = 0; c < K32; c += 32) {
            __m256 x0 = _mm256_load_ps(xs + c), x1 = _mm256_load_ps(xs + c + 8);
            __m256 x2 = _mm256_load_ps(xs + c + 16), x3 = _mm256_load_ps(xs + c + 24);
            if (PF_ON && (c & 63) == 0)
                for (int i = 0; i < 4; i++) GEMV_PF(pf_at(p[0], p[i], pf, lin, i, c), l2);
            for (int i = 0; i < 4; i++) {
                __m256 f[4];
                const __m256i d = _mm256_loadu_si256((const __m256i *)(p[i] + c));
                nan[i] = _mm256_max_epu8(nan[i], _mm256_or_si256(d, hi));
                e4m3_dec32(d, f);
                a[i] = _mm256_fmadd_ps(f[0], x0, a[i]);
                b[i] = _mm256_fmadd_ps(f[1], x1, b[i]);
                a[i] = _mm256_fmadd_ps(f[2], x2, a[i]);
                b[i] = _mm256_fmadd_ps(f[3], x3, b[i]);
            }
        }
        float t[4];
        _mm_storeu_ps(t, hsum4x8(_mm256_add_ps(a[0], b[0]), _mm256_add_ps(a[1], b[1]),
                                 _mm256_add_ps(a[2], b[2]), _mm256_add_ps(a[3], b[3])));
        for (int i = 0; i < nr; i++) {
            for (int64_t c = K32; c < K; c++) t[i] += (e4m3_to_f32(p[i][c]) * 0x1p-8f) * xs[c];
            const __m256i met = _mm256_cmpeq_epi8(nan[i], _mm256_set1_epi8(-1));
            y[r - rs + i] = _mm256_testz_si256(met, met) ? t[i] : NAN;
        }
    }
}

/* Out of memory: nothing written (the context is marked failed). */
static void gemv_e4m3(const cpumla_weight *w, const float *x, float *y, int64_t r0, int64_t r1) {
    const int64_t K = w->cols, K32 = K / 32 * 32, br = w->block_rows;
    float *xs = cpumla_scratch(CPUMLA_SCRATCH_AVX2_XR, sizeof(float) * (size_t)(K + 32));
    if (!xs) return;
    for (int64_t rs = r0; rs < r1;) {
        const int64_t re = (rs / br + 1) * br < r1 ? (rs / br + 1) * br : r1;
        e4m3_act_row(w, rs, x, 0, K, xs, 256.0f);
        e4m3_perm_x(xs, K32);
        if (cpumla_pf_l2_plain) gemv_e4m3_rows(w, xs, y + (rs - r0), rs, re, 1);
        else gemv_e4m3_rows(w, xs, y + (rs - r0), rs, re, 0);
        rs = re;
    }
}

/* plain_rows_pf of one token with its prefetch target (common.h cpumla_pf_l2_plain) as a constant */
static void gemv_plain(const cpumla_weight *w, const float *x, float *y, int64_t r0, int64_t r1, int dt) {
    GEMV_PF_CASES(cpumla_pf_l2_plain, plain_rows_pf(w, x, 0, 1, y, 0, r0, r1, dt, L2));
}

void cpumla_avx2_gemv(const cpumla_weight *w, const float *x, float *y, int64_t r0, int64_t r1) {
    switch (w->dtype) {
    case CPUMLA_F32: gemv_plain(w, x, y, r0, r1, CPUMLA_F32); return;
    case CPUMLA_BF16: {
        float *xr = cpumla_scratch(CPUMLA_SCRATCH_AVX2_XR, sizeof(float) * (size_t)w->cols);
        if (!xr) return;                               /* out of memory: the call fails */
        bf16_round_rows(x, 0, 1, w->cols, xr, 0);
        gemv_plain(w, xr, y, r0, r1, CPUMLA_BF16);
        return;
    }
    case CPUMLA_F16: gemv_plain(w, x, y, r0, r1, CPUMLA_F16); return;
    case CPUMLA_E4M3:
        if (w->block_cols > 0 && w->block_rows > 0) { gemv_e4m3(w, x, y, r0, r1); return; }
        break;
    default: break;         /* E2M1: the integer product (kern_gemv) or the spec's fp32 one */
    }
    prev_gemv(w, x, y, r0, r1);
}

/* ---- a few tokens ----------------------------------------------------------------------------------
 * Products of 2 or 3 tokens (the verify forward of speculative decoding) with the GEMV's loops, each row
 * read once for all of them: the row's weights are decoded once a step and every token's sums take the
 * same operands, FMAs, order and final reduction as that token's gemv, so each result is bit for bit
 * its gemv's (prefill and decode agree). The blocked gemm (avx2_gemm.c) decodes every weight into a
 * panel, which costs several GEMVs' time at these counts. One row at a time: 2 x 3 (E4M3) or 4 x 3
 * (plain) accumulators stay in registers; the tokens' operands are read from L1 / L2. */

/* E4M3 rows [rs, re) of one row block, NT tokens' operands (as gemv_e4m3 makes them) lds apart: each
 * token's sums as gemv_e4m3_rows's, reduced by the same hsum4x8 */
INLINE void few_e4m3_rows(const cpumla_weight *w, const float *xs, int64_t lds, int NT, float *y, int64_t ldy,
                          int64_t rs, int64_t re, int l2) {
    const int64_t K = w->cols, K32 = K / 32 * 32, pf = PF_ROWS * w->row_bytes;
    const __m256i hi = _mm256_set1_epi8((char)0x80);
    for (int64_t r = rs; r < re; r++) {
        const uint8_t *p = weight_row(w, r);
        __m256 a[4], b[4];
        __m256i nan = _mm256_setzero_si256();
        UNROLL for (int t = 0; t < 4; t++) a[t] = b[t] = _mm256_setzero_ps();
        for (int64_t c = 0; c < K32; c += 32) {
            if (PF_ON && (c & 63) == 0) GEMV_PF(p + pf + c, l2);
            __m256 f[4];
            const __m256i d = _mm256_loadu_si256((const __m256i *)(p + c));
            nan = _mm256_max_epu8(nan, _mm256_or_si256(d, hi));
            e4m3_dec32(d, f);
            UNROLL for (int t = 0; t < NT; t++) {
                const float *xt = xs + t * lds + c;
                a[t] = _mm256_fmadd_ps(f[0], _mm256_load_ps(xt), a[t]);
                b[t] = _mm256_fmadd_ps(f[1], _mm256_load_ps(xt + 8), b[t]);
                a[t] = _mm256_fmadd_ps(f[2], _mm256_load_ps(xt + 16), a[t]);
                b[t] = _mm256_fmadd_ps(f[3], _mm256_load_ps(xt + 24), b[t]);
            }
        }
        float s[4];
        _mm_storeu_ps(s, hsum4x8(_mm256_add_ps(a[0], b[0]), _mm256_add_ps(a[1], b[1]), _mm256_add_ps(a[2], b[2]),
                                 _mm256_add_ps(a[3], b[3])));
        const __m256i met = _mm256_cmpeq_epi8(nan, _mm256_set1_epi8(-1));
        const int is_nan = !_mm256_testz_si256(met, met);
        for (int t = 0; t < NT; t++) {
            for (int64_t c = K32; c < K; c++) s[t] += (e4m3_to_f32(p[c]) * 0x1p-8f) * xs[t * lds + c];
            y[t * ldy + (r - rs)] = is_nan ? NAN : s[t];
        }
    }
}

/* y[t*ldy + r - r0] for n <= FEW_NT tokens x[t*ldx] of a BF16, F32, F16 or E4M3 (block-scaled)
 * weight, as n gemvs would give them; returns 0 (nothing done) for other formats or more tokens. Out
 * of memory: 1, nothing written (the context is marked failed). */
int cpumla_avx2_gemm_few(const cpumla_weight *w, const float *x, int64_t ldx, int64_t n, float *y, int64_t ldy,
                         int64_t r0, int64_t r1) {
    const int dt = w->dtype;
    const int64_t K = w->cols;
    if (n < 2 || n > FEW_NT || K <= 0) return 0;
    if (dt == CPUMLA_E4M3) {
        if (w->block_cols <= 0 || w->block_rows <= 0) return 0;
        const int64_t K32 = K / 32 * 32, br = w->block_rows, lds = (K + 32 + 15) & ~(int64_t)15;
        float *xs = cpumla_scratch(CPUMLA_SCRATCH_AVX2_XR, sizeof(float) * (size_t)(n * lds));
        if (!xs) return 1;
        for (int64_t rs = r0; rs < r1;) {
            const int64_t re = (rs / br + 1) * br < r1 ? (rs / br + 1) * br : r1;
            for (int64_t t = 0; t < n; t++) {
                e4m3_act_row(w, rs, x + t * ldx, 0, K, xs + t * lds, 256.0f);
                e4m3_perm_x(xs + t * lds, K32);
            }
            /* the prefetch's target as gemv_e4m3's: L2 for either L2 target, else L1 */
            const int l2 = cpumla_pf_l2_plain != 0;
            if (n == 3 && l2) few_e4m3_rows(w, xs, lds, 3, y + (rs - r0), ldy, rs, re, 1);
            else if (n == 3) few_e4m3_rows(w, xs, lds, 3, y + (rs - r0), ldy, rs, re, 0);
            else if (l2) few_e4m3_rows(w, xs, lds, 2, y + (rs - r0), ldy, rs, re, 1);
            else few_e4m3_rows(w, xs, lds, 2, y + (rs - r0), ldy, rs, re, 0);
            rs = re;
        }
        return 1;
    }
    if (dt != CPUMLA_F32 && dt != CPUMLA_BF16 && dt != CPUMLA_F16) return 0;
    const float *xr = x;
    int64_t ldr = ldx;
    if (dt == CPUMLA_BF16) {
        float *b = cpumla_scratch(CPUMLA_SCRATCH_AVX2_XR, sizeof(float) * (size_t)(n * K));
        if (!b) return 1;
        bf16_round_rows(x, ldx, n, K, b, K);
        xr = b;
        ldr = K;
    }
#define FEW(NT, DT) GEMV_PF_CASES(cpumla_pf_l2_plain, plain_rows_pf(w, xr, ldr, NT, y, ldy, r0, r1, DT, L2))
#define FEW_DT(DT) do { if (n == 3) FEW(3, DT); else FEW(2, DT); } while (0)
    if (dt == CPUMLA_BF16) FEW_DT(CPUMLA_BF16);
    else if (dt == CPUMLA_F32) FEW_DT(CPUMLA_F32);
    else FEW_DT(CPUMLA_F16);
#undef FEW_DT
#undef FEW
    return 1;
}

/* ---- gemv_t: y[c - c0] = sum_i x[i] W[r0 + i, c]; rows stream in order, y chunk kept in L1 ------ */
#define GT_CH 1024
static void gemv_t_avx2(const cpumla_weight *w, int64_t r0, int64_t nr, const float *x, float *y,
                        int64_t c0, int64_t c1) {
    float acc[GT_CH] ALIGN64;
    const int dt = w->dtype;
    if (dt != CPUMLA_F32 && dt != CPUMLA_BF16 && dt != CPUMLA_F16 && dt != CPUMLA_E4M3 && dt != CPUMLA_E2M1) {
        for (int64_t c = c0; c < c1; c++) y[c - c0] = 0.0f;
        for (int64_t i = 0; i < nr; i++)
            for (int64_t c = c0; c < c1; c++) y[c - c0] += x[i] * weight_at(w, r0 + i, c);
        return;
    }
    const __m256i tl = fp4_tl(), th = fp4_th();
    for (int64_t cs = c0; cs < c1; cs += GT_CH) {
        const int64_t ce = cs + GT_CH < c1 ? cs + GT_CH : c1;
        float *a = acc - cs;   /* a[c] for cs <= c < ce */
        memset(acc, 0, (size_t)(ce - cs) * sizeof(float));
        for (int64_t i = 0; i < nr; i++) {
            gt_prefetch(w->data, w->row_bytes, r0, i, 1, nr, cs, ce, gt_col_bytes(dt));
            const uint8_t *row = weight_row(w, r0 + i);
            const float xi = dt == CPUMLA_BF16 ? bf16_round(x[i]) : x[i];
            int64_t c = cs;
            if (dt == CPUMLA_F32 || dt == CPUMLA_BF16 || dt == CPUMLA_F16) {
                __m256 vx = _mm256_set1_ps(xi);
                if (dt == CPUMLA_F32)
                    for (; c + 8 <= ce; c += 8)
                        _mm256_storeu_ps(a + c, _mm256_fmadd_ps(_mm256_set1_ps(xi), ld_plain(row, c, CPUMLA_F32),
                                                                _mm256_loadu_ps(a + c)));
                else if (dt == CPUMLA_BF16)
                    for (; c + 8 <= ce; c += 8)
                        _mm256_storeu_ps(a + c, _mm256_fmadd_ps(vx, ld_plain(row, c, CPUMLA_BF16), _mm256_loadu_ps(a + c)));
                else
                    for (; c + 8 <= ce; c += 8)
                        _mm256_storeu_ps(a + c, _mm256_fmadd_ps(vx, ld_plain(row, c, CPUMLA_F16), _mm256_loadu_ps(a + c)));
                for (; c < ce; c++) a[c] += xi * weight_at(w, r0 + i, c);
                continue;
            }
            while (c < ce) {
                int64_t be = (c / w->block_cols + 1) * w->block_cols;
                if (be > ce) be = ce;
                const float s = weight_scale(w, r0 + i, c);
                if (dt == CPUMLA_E4M3) {        /* the decode's 2^-8 undone in the operand, exactly */
                    const float xs = bf16_round(xi * (s * 256.0f));
                    __m256 vx = _mm256_set1_ps(xs);
                    for (; c + 8 <= be; c += 8)
                        _mm256_storeu_ps(a + c, _mm256_fmadd_ps(vx, ld_e4m3x8(row + c), _mm256_loadu_ps(a + c)));
                    for (; c < be; c++) a[c] += (e4m3_to_f32(row[c]) * 0x1p-8f) * xs;
                } else {
                    __m256 vx = _mm256_set1_ps(xi * s);
                    if ((c & 1) && c < be) { a[c] += xi * (e2m1_at(row, c) * s); c++; }
                    for (; c + 32 <= be; c += 32) {
                        __m256 o[4];
                        ld_e2m1x32_nat(row + (c >> 1), tl, th, o);
                        for (int k = 0; k < 4; k++)
                            _mm256_storeu_ps(a + c + 8 * k, _mm256_fmadd_ps(vx, o[k], _mm256_loadu_ps(a + c + 8 * k)));
                    }
                    for (; c < be; c++) a[c] += xi * (e2m1_at(row, c) * s);
                }
            }
        }
        memcpy(y + (cs - c0), acc, (size_t)(ce - cs) * sizeof(float));
    }
}

/* The weight operands gemv's loops multiply (cpumla_decode_operands): E4M3 through e4m3_dec32 (value *
 * 2^-8). */
int cpumla_decode_operands_avx2(int dtype, float *out) {
    if (dtype == CPUMLA_E4M3) {
        uint8_t codes[32];
        for (int g = 0; g < 8; g++) {
            float f[4][8];
            __m256 v[4];
            for (int i = 0; i < 32; i++) codes[i] = (uint8_t)(32 * g + i);
            e4m3_dec32(_mm256_loadu_si256((const __m256i *)codes), v);
            for (int j = 0; j < 4; j++) _mm256_storeu_ps(f[j], v[j]);
            for (int i = 0; i < 8; i++) {
                out[32 * g + 2 * i] = f[0][i];
                out[32 * g + 16 + 2 * i] = f[1][i];
                out[32 * g + 2 * i + 1] = f[2][i];
                out[32 * g + 17 + 2 * i] = f[3][i];
            }
        }
        return 8;
    }
    return -1;
}

void cpumla_fill_avx2(cpumla_kernels *k) {
    cpumla_fill_avx2_rows(k);
    if (k->gemv != cpumla_avx2_gemv) prev_gemv = k->gemv;
    cpumla_fill_avx2_gemm(k);
    k->gemv = cpumla_avx2_gemv;
    k->gemv_t = gemv_t_avx2;
    k->dequant_row = cpumla_avx2_dequant_row;
    for (int i = K_GEMV; i <= K_DEQUANT; i++) {
        k->who[i] = "avx2";
        for (int f = 0; f <= CPUMLA_E2M1; f++) k->who_fmt[i][f] = "avx2";
    }
    /* E2M1 gemv / gemm go back to the entry below (the spec's fp32 product); kern_gemv / kern_gemm
     * take its 1x32 E8M0 layout to the integer product first */
    k->who_fmt[K_GEMV][CPUMLA_E2M1] = k->who_fmt[K_GEMM][CPUMLA_E2M1] = "scalar";
    k->sample_passes = &cpumla_sample_passes_avx2;
    cpumla_fill_avx2_q(k);                 /* avx2_q.c: the integer products */
}
