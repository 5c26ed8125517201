/* avx2.c: AVX2 + FMA + F16C kernels (compiled with -mavx2 -mfma -mf16c). Same semantics as scalar.c,
 * which is the spec; results agree with it to float rounding (sums are associated differently).
 *
 * Weight decoding tricks (all exact):
 *   BF16  zero-extend to 32 bits and shift left 16.
 *   E4M3  byte b -> fp16 bits ((b << 8) >>arith 1) & 0xbf80, i.e. sign | (b & 0x7f) << 7, which is
 *         the value * 2^-8 (subnormals included); 256 is folded into the block scale. 0x7f / 0xff
 *         are forced to NaN as in the spec.
 *   E2M1  two vpshufb lookups give the low and high byte of each code's bf16 value; the 32 codes of
 *         16 bytes come out in a fixed permuted column order, so gemv permutes x once per call to
 *         match (fp4_perm) and never reorders weights.
 * Single-threaded: ops.c splits rows / columns / heads / KV ranges over the pool. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#include "common.h"
#include "kernels.h"

const char cpumla_flags_avx2[] = CPUMLA_FLAGS;

#define INLINE static inline __attribute__((always_inline))
#define ALIGN64 __attribute__((aligned(64)))

/* ---- helpers ---------------------------------------------------------------------------------- */
static const int32_t tail_mask_tab[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};
/* lanes [0, n) set, 0 <= n <= 8 */
INLINE __m256i tail_mask(int64_t n) { return _mm256_loadu_si256((const __m256i *)(tail_mask_tab + 8 - n)); }

INLINE float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* [sum a0, sum a1, sum a2, sum a3] */
INLINE __m128 hsum4x8(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
    __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

INLINE __m256 ld_bf16(const uint16_t *p) {
    __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}
INLINE __m256 ld_f16(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }

/* 16 E4M3 bytes -> two vectors of value * 2^-8 */
INLINE void ld_e4m3x16(const uint8_t *p, __m256 *lo, __m256 *hi) {
    __m256i u = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p));
    __m256i f = _mm256_and_si256(_mm256_srai_epi16(_mm256_slli_epi16(u, 8), 1), _mm256_set1_epi16((short)0xbf80));
    __m256i t = _mm256_and_si256(u, _mm256_set1_epi16(0x7f));
    f = _mm256_or_si256(f, _mm256_cmpeq_epi16(t, _mm256_set1_epi16(0x7f)));
    *lo = _mm256_cvtph_ps(_mm256_castsi256_si128(f));
    *hi = _mm256_cvtph_ps(_mm256_extracti128_si256(f, 1));
}
/* 8 E4M3 bytes -> value * 2^-8 */
INLINE __m256 ld_e4m3x8(const uint8_t *p) {
    __m128i u = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)p));
    __m128i f = _mm_and_si128(_mm_srai_epi16(_mm_slli_epi16(u, 8), 1), _mm_set1_epi16((short)0xbf80));
    __m128i t = _mm_and_si128(u, _mm_set1_epi16(0x7f));
    f = _mm_or_si128(f, _mm_cmpeq_epi16(t, _mm_set1_epi16(0x7f)));
    return _mm256_cvtph_ps(f);
}

/* bf16 low / high bytes of the E2M1 values 0, .5, 1, 1.5, 2, 3, 4, 6 and their negatives */
#define FP4_TL 0, 0, (char)0x80, (char)0xc0, 0, 0x40, (char)0x80, (char)0xc0
#define FP4_TH 0, 0x3f, 0x3f, 0x3f, 0x40, 0x40, 0x40, 0x40
#define FP4_THN (char)0x80, (char)0xbf, (char)0xbf, (char)0xbf, (char)0xc0, (char)0xc0, (char)0xc0, (char)0xc0
INLINE __m256i fp4_tl(void) { return _mm256_setr_epi8(FP4_TL, FP4_TL, FP4_TL, FP4_TL); }
INLINE __m256i fp4_th(void) { return _mm256_setr_epi8(FP4_TH, FP4_THN, FP4_TH, FP4_THN); }

/* 16 E2M1 bytes (32 codes) -> f[0..3], exact values, in the permuted order: lane L, dword d of f[k]
 * is column 16*(k>>1) + 4*d + 2*(k&1) + L of the group. */
INLINE void ld_e2m1x32(const uint8_t *p, __m256i tl, __m256i th, __m256 f[4]) {
    __m256i b = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)p));
    __m256i n = _mm256_srlv_epi32(b, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4));
    n = _mm256_and_si256(n, _mm256_set1_epi8(0x0f));
    __m256i lb = _mm256_shuffle_epi8(tl, n), hb = _mm256_shuffle_epi8(th, n);
    __m256i wl = _mm256_unpacklo_epi8(lb, hb), wh = _mm256_unpackhi_epi8(lb, hb);
    __m256i m = _mm256_set1_epi32((int)0xffff0000);
    f[0] = _mm256_castsi256_ps(_mm256_slli_epi32(wl, 16));
    f[1] = _mm256_castsi256_ps(_mm256_and_si256(wl, m));
    f[2] = _mm256_castsi256_ps(_mm256_slli_epi32(wh, 16));
    f[3] = _mm256_castsi256_ps(_mm256_and_si256(wh, m));
}
/* the same 32 values in column order */
INLINE void ld_e2m1x32_nat(const uint8_t *p, __m256i tl, __m256i th, __m256 o[4]) {
    __m256 f[4];
    ld_e2m1x32(p, tl, th, f);
    const __m256i ix = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    o[0] = _mm256_permutevar8x32_ps(_mm256_unpacklo_ps(f[0], f[1]), ix);
    o[1] = _mm256_permutevar8x32_ps(_mm256_unpackhi_ps(f[0], f[1]), ix);
    o[2] = _mm256_permutevar8x32_ps(_mm256_unpacklo_ps(f[2], f[3]), ix);
    o[3] = _mm256_permutevar8x32_ps(_mm256_unpackhi_ps(f[2], f[3]), ix);
}
/* position i of a permuted 32-group holds column fp4_perm[i] */
static const uint8_t fp4_perm[32] = {0,  4,  8,  12, 1,  5,  9,  13, 2,  6,  10, 14, 3,  7,  11, 15,
                                     16, 20, 24, 28, 17, 21, 25, 29, 18, 22, 26, 30, 19, 23, 27, 31};

INLINE float e2m1_at(const uint8_t *row, int64_t c) {
    uint8_t b = row[c >> 1];
    return cpumla_e2m1_lut[(c & 1) ? (b >> 4) : (b & 15)];
}

/* 8 E8M0 scale bytes -> floats (0 -> 2^-127, 0xff -> NaN, as e8m0_to_f32) */
INLINE __m256 ld_e8m0x8(const uint8_t *p) {
    __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    __m256i f = _mm256_slli_epi32(v, 23);
    f = _mm256_blendv_epi8(f, _mm256_set1_epi32(0x00400000), _mm256_cmpeq_epi32(v, _mm256_setzero_si256()));
    f = _mm256_or_si256(f, _mm256_cmpeq_epi32(v, _mm256_set1_epi32(255)));
    return _mm256_castsi256_ps(f);
}

/* Scales of row r for blocks [b0, b0 + nb) into out */
static void row_scales(const cpumla_weight *w, int64_t r, int64_t b0, int64_t nb, float *out) {
    int64_t base = (r / w->block_rows) * w->scale_ld + b0, i = 0;
    if (w->scale_dtype == CPUMLA_E8M0) {
        const uint8_t *s = (const uint8_t *)w->scale + base;
        for (; i + 8 <= nb; i += 8) _mm256_storeu_ps(out + i, ld_e8m0x8(s + i));
        for (; i < nb; i++) out[i] = e8m0_to_f32(s[i]);
    } else {
        memcpy(out, (const float *)w->scale + base, (size_t)nb * sizeof(float));
    }
}

/* e^x, within ~1 ulp of expf: Cody-Waite reduction, Cephes polynomial, 2^n applied in two halves so
 * that subnormal results come out right. -inf -> 0, large -> inf, NaN -> NaN. */
INLINE __m256 exp256(__m256 x) {
    x = _mm256_max_ps(_mm256_set1_ps(-104.0f), x);  /* NaN stays in x (second operand) */
    x = _mm256_min_ps(_mm256_set1_ps(88.8f), x);
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i ni = _mm256_cvtps_epi32(n);
    __m256i n1 = _mm256_srai_epi32(ni, 1), n2 = _mm256_sub_epi32(ni, n1);
    __m256i bias = _mm256_set1_epi32(127);
    __m256 s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, bias), 23));
    __m256 s2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, bias), 23));
    return _mm256_mul_ps(_mm256_mul_ps(p, s1), s2);
}

/* ---- reference row dot (the spec's row_dot), for layouts the fast paths do not cover ----------- */
static float row_dot_ref(const cpumla_weight *w, int64_t r, const float *x) {
    const uint8_t *row = weight_row(w, r);
    float acc = 0.0f;
    if ((w->dtype == CPUMLA_E4M3 || w->dtype == CPUMLA_E2M1) && w->block_cols > 0) {
        for (int64_t c0 = 0; c0 < w->cols; c0 += w->block_cols) {
            int64_t c1 = c0 + w->block_cols < w->cols ? c0 + w->block_cols : w->cols;
            float part = 0.0f;
            for (int64_t c = c0; c < c1; c++)
                part += (w->dtype == CPUMLA_E4M3 ? e4m3_to_f32(row[c]) : e2m1_at(row, c)) * x[c];
            acc += part * weight_scale(w, r, c0);
        }
        return acc;
    }
    for (int64_t c = 0; c < w->cols; c++) acc += weight_at(w, r, c) * x[c];
    return acc;
}

/* ---- dequant_row -------------------------------------------------------------------------------- */
static void dequant_row_avx2(const cpumla_weight *w, int64_t r, int64_t c0, int64_t c1, float *out) {
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

/* Software prefetch of the row group PF_ROWS rows ahead, at the same column: each group starts four
 * new streams, which the hardware prefetchers pick up too late on their own. */
#ifndef PF_ON
#define PF_ON 1
#endif
#ifndef PF_ROWS
#define PF_ROWS 8
#endif
INLINE void gemv_plain(const cpumla_weight *w, const float *x, float *y, int64_t r0, int64_t r1, int dt) {
    const int64_t K = w->cols, K16 = K & ~(int64_t)15;
    int64_t r = r0;
    for (; r + 4 <= r1; r += 4) {
        const uint8_t *p0 = weight_row(w, r), *p1 = weight_row(w, r + 1);
        const uint8_t *p2 = weight_row(w, r + 2), *p3 = weight_row(w, r + 3);
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
        int64_t c = 0;
        const int64_t esz = dt == CPUMLA_F32 ? 4 : 2, pf = PF_ROWS * w->row_bytes;
        const int lin = w->row_bytes == K * esz;
        for (; c < K16; c += 16) {
            __m256 x0 = _mm256_loadu_ps(x + c), x1 = _mm256_loadu_ps(x + c + 8);
            if (PF_ON && ((c * esz) & 63) == 0) {
                _mm_prefetch(pf_at(p0, p0, pf, lin, 0, c * esz), _MM_HINT_T0);
                _mm_prefetch(pf_at(p0, p1, pf, lin, 1, c * esz), _MM_HINT_T0);
                _mm_prefetch(pf_at(p0, p2, pf, lin, 2, c * esz), _MM_HINT_T0);
                _mm_prefetch(pf_at(p0, p3, pf, lin, 3, c * esz), _MM_HINT_T0);
            }
            a0 = _mm256_fmadd_ps(ld_plain(p0, c, dt), x0, a0);
            b0 = _mm256_fmadd_ps(ld_plain(p0, c + 8, dt), x1, b0);
            a1 = _mm256_fmadd_ps(ld_plain(p1, c, dt), x0, a1);
            b1 = _mm256_fmadd_ps(ld_plain(p1, c + 8, dt), x1, b1);
            a2 = _mm256_fmadd_ps(ld_plain(p2, c, dt), x0, a2);
            b2 = _mm256_fmadd_ps(ld_plain(p2, c + 8, dt), x1, b2);
            a3 = _mm256_fmadd_ps(ld_plain(p3, c, dt), x0, a3);
            b3 = _mm256_fmadd_ps(ld_plain(p3, c + 8, dt), x1, b3);
        }
        if (c + 8 <= K) {
            __m256 x0 = _mm256_loadu_ps(x + c);
            a0 = _mm256_fmadd_ps(ld_plain(p0, c, dt), x0, a0);
            a1 = _mm256_fmadd_ps(ld_plain(p1, c, dt), x0, a1);
            a2 = _mm256_fmadd_ps(ld_plain(p2, c, dt), x0, a2);
            a3 = _mm256_fmadd_ps(ld_plain(p3, c, dt), x0, a3);
            c += 8;
        }
        float t[4];
        _mm_storeu_ps(t, hsum4x8(_mm256_add_ps(a0, b0), _mm256_add_ps(a1, b1), _mm256_add_ps(a2, b2),
                                 _mm256_add_ps(a3, b3)));
        for (; c < K; c++) {
            t[0] += at_plain(p0, c, dt) * x[c];
            t[1] += at_plain(p1, c, dt) * x[c];
            t[2] += at_plain(p2, c, dt) * x[c];
            t[3] += at_plain(p3, c, dt) * x[c];
        }
        memcpy(y + (r - r0), t, sizeof t);
    }
    for (; r < r1; r++) {
        const uint8_t *p0 = weight_row(w, r);
        __m256 a0 = _mm256_setzero_ps(), b0 = a0;
        int64_t c = 0;
        for (; c < K16; c += 16) {
            a0 = _mm256_fmadd_ps(ld_plain(p0, c, dt), _mm256_loadu_ps(x + c), a0);
            b0 = _mm256_fmadd_ps(ld_plain(p0, c + 8, dt), _mm256_loadu_ps(x + c + 8), b0);
        }
        if (c + 8 <= K) { a0 = _mm256_fmadd_ps(ld_plain(p0, c, dt), _mm256_loadu_ps(x + c), a0); c += 8; }
        float t = hsum8(_mm256_add_ps(a0, b0));
        for (; c < K; c++) t += at_plain(p0, c, dt) * x[c];
        y[r - r0] = t;
    }
}

/* FP8 e4m3, block scales: per row and block, sum then scale once */
#define E4M3_ROWS 4
static void gemv_e4m3(const cpumla_weight *w, const float *x, float *y, int64_t r0, int64_t r1) {
    const int64_t K = w->cols, bc = w->block_cols, pf = PF_ROWS * w->row_bytes;
    for (int64_t r = r0; r < r1; r += E4M3_ROWS) {
        const int nr = r1 - r < E4M3_ROWS ? (int)(r1 - r) : E4M3_ROWS;
        const uint8_t *p[E4M3_ROWS];
        for (int i = 0; i < E4M3_ROWS; i++) p[i] = weight_row(w, r + (i < nr ? i : 0));
        __m256 tot[E4M3_ROWS];
        float tail[E4M3_ROWS];
        for (int i = 0; i < E4M3_ROWS; i++) { tot[i] = _mm256_setzero_ps(); tail[i] = 0.0f; }
        for (int64_t cb = 0; cb < K; cb += bc) {
            const int64_t ce = cb + bc < K ? cb + bc : K;
            float s[E4M3_ROWS];
            for (int i = 0; i < E4M3_ROWS; i++) s[i] = weight_scale(w, r + (i < nr ? i : 0), cb);
            __m256 a[E4M3_ROWS], b[E4M3_ROWS];
            for (int i = 0; i < E4M3_ROWS; i++) a[i] = b[i] = _mm256_setzero_ps();
            int64_t c = cb;
            for (; c + 16 <= ce; c += 16) {
                __m256 x0 = _mm256_loadu_ps(x + c), x1 = _mm256_loadu_ps(x + c + 8);
                if ((c & 63) == 0)
                    for (int i = 0; i < E4M3_ROWS; i++) _mm_prefetch((const char *)(p[i] + c + pf), _MM_HINT_T0);
                for (int i = 0; i < E4M3_ROWS; i++) {
                    __m256 lo, hi;
                    ld_e4m3x16(p[i] + c, &lo, &hi);
                    a[i] = _mm256_fmadd_ps(lo, x0, a[i]);
                    b[i] = _mm256_fmadd_ps(hi, x1, b[i]);
                }
            }
            for (; c + 8 <= ce; c += 8) {
                __m256 x0 = _mm256_loadu_ps(x + c);
                for (int i = 0; i < E4M3_ROWS; i++) a[i] = _mm256_fmadd_ps(ld_e4m3x8(p[i] + c), x0, a[i]);
            }
            for (int i = 0; i < E4M3_ROWS; i++)
                tot[i] = _mm256_fmadd_ps(_mm256_add_ps(a[i], b[i]), _mm256_set1_ps(s[i] * 256.0f), tot[i]);
            if (c < ce) {
                for (int i = 0; i < E4M3_ROWS; i++) {
                    float part = 0.0f;
                    for (int64_t cc = c; cc < ce; cc++) part += e4m3_to_f32(p[i][cc]) * x[cc];
                    tail[i] += part * s[i];
                }
            }
        }
        float t[4];
        _mm_storeu_ps(t, hsum4x8(tot[0], tot[1], tot[2], tot[3]));
        for (int i = 0; i < nr; i++) y[r - r0 + i] = t[i] + tail[i];
    }
}

/* FP8 e4m3 with blocks a multiple of 32 columns wide, 32 bytes (8 dwords) per step per row. Byte j
 * of each dword becomes the fp32 bits of value * 2^-120 with word shifts and masks only (no
 * converts): sraw(d, 4) & 0x87f00000 is byte 3, (sraw(d, 4) << 16) & 0x87f00000 byte 1, and the
 * same after sllw(d, 8) bytes 2 and 0; e4m3 subnormals land on fp32 subnormals, so every byte is
 * decoded exactly. x is rearranged once per call (e4_xp, thread-local) to [x(4k + j), k < 8] for
 * j = 0..3 per 32 columns and multiplied by 2^104 so the products stay normal; the block scale
 * carries the remaining 2^16. When some |x| >= 2^23 (the scaled x would overflow) the call takes
 * gemv_e4m3 above. NaN codes 0x7f / 0xff are not detected on this path (they decode to +-480; real
 * checkpoints never contain them); gemv_e4m3, gemm, gemv_t and dequant give NaN for them. */
#define E4_XP_MAX 16384
static __thread float e4_xp[E4_XP_MAX] ALIGN64;

/* n: a multiple of 32. Returns 0 when some |x| >= 2^23 (inf included). */
static int e4m3_split_x(const float *x, int64_t n, float *xp) {
    const __m256i ix = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    const __m256 k = _mm256_set1_ps(0x1p104f), lim = _mm256_set1_ps(0x1p23f);
    const __m256 absm = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 big = _mm256_setzero_ps();
    for (int64_t g = 0; g < n; g += 32) {
        __m256 v0 = _mm256_loadu_ps(x + g), v1 = _mm256_loadu_ps(x + g + 8);
        __m256 v2 = _mm256_loadu_ps(x + g + 16), v3 = _mm256_loadu_ps(x + g + 24);
        big = _mm256_or_ps(big, _mm256_or_ps(_mm256_cmp_ps(_mm256_and_ps(v0, absm), lim, _CMP_GE_OQ),
                                             _mm256_cmp_ps(_mm256_and_ps(v1, absm), lim, _CMP_GE_OQ)));
        big = _mm256_or_ps(big, _mm256_or_ps(_mm256_cmp_ps(_mm256_and_ps(v2, absm), lim, _CMP_GE_OQ),
                                             _mm256_cmp_ps(_mm256_and_ps(v3, absm), lim, _CMP_GE_OQ)));
        /* 4x4 transposes within 128-bit lanes: o_j = x(4k + j) for k = 0, 2, 4, 6 | 1, 3, 5, 7 */
        __m256 t0 = _mm256_unpacklo_ps(v0, v1), t1 = _mm256_unpackhi_ps(v0, v1);
        __m256 t2 = _mm256_unpacklo_ps(v2, v3), t3 = _mm256_unpackhi_ps(v2, v3);
        __m256 o[4] = {_mm256_shuffle_ps(t0, t2, 0x44), _mm256_shuffle_ps(t0, t2, 0xee),
                       _mm256_shuffle_ps(t1, t3, 0x44), _mm256_shuffle_ps(t1, t3, 0xee)};
        for (int j = 0; j < 4; j++)
            _mm256_store_ps(xp + g + 8 * j, _mm256_mul_ps(_mm256_permutevar8x32_ps(o[j], ix), k));
    }
    return _mm256_movemask_ps(big) == 0;
}

__attribute__((noinline)) static void gemv_e4m3_x(const cpumla_weight *w, const float *x, float *y,
                                                  int64_t r0, int64_t r1) {
    const int64_t K = w->cols, bc = w->block_cols, pf = PF_ROWS * w->row_bytes;
    const int64_t K32 = K / 32 * 32;
    if (!e4m3_split_x(x, K32, e4_xp)) { gemv_e4m3(w, x, y, r0, r1); return; }
    const int e8m0 = w->scale_dtype == CPUMLA_E8M0;
    const __m256i m = _mm256_set1_epi32((int)0x87f00000u);
    for (int64_t r = r0; r < r1; r += 4) {
        const int nr = r1 - r < 4 ? (int)(r1 - r) : 4, lin = nr == 4 && w->row_bytes == K;
        const uint8_t *p[4];
        const uint8_t *sc8[4];
        const float *sc32[4];
        for (int i = 0; i < 4; i++) {
            int64_t rr = r + (i < nr ? i : 0), si = rr / w->block_rows * w->scale_ld;
            p[i] = weight_row(w, rr);
            sc8[i] = (const uint8_t *)w->scale + si;
            sc32[i] = (const float *)w->scale + si;
        }
        __m256 tot[4];
        float tail[4];
        for (int i = 0; i < 4; i++) { tot[i] = _mm256_setzero_ps(); tail[i] = 0.0f; }
        for (int64_t cb = 0, bi = 0; cb < K; cb += bc, bi++) {
            const int64_t ce = cb + bc < K ? cb + bc : K;
            float s[4];
            for (int i = 0; i < 4; i++) s[i] = e8m0 ? e8m0_to_f32(sc8[i][bi]) : sc32[i][bi];
            __m256 a[4], b[4];
            for (int i = 0; i < 4; i++) a[i] = b[i] = _mm256_setzero_ps();
            int64_t c = cb;
            for (; c + 32 <= ce; c += 32) {
                const float *xs = e4_xp + c;
                __m256 x0 = _mm256_load_ps(xs), x1 = _mm256_load_ps(xs + 8);
                __m256 x2 = _mm256_load_ps(xs + 16), x3 = _mm256_load_ps(xs + 24);
                if ((c & 63) == 0)
                    for (int i = 0; i < 4; i++) _mm_prefetch(pf_at(p[0], p[i], pf, lin, i, c), _MM_HINT_T0);
                for (int i = 0; i < 4; i++) {
                    __m256i d = _mm256_loadu_si256((const __m256i *)(p[i] + c));
                    __m256i vh = _mm256_srai_epi16(d, 4), vl = _mm256_srai_epi16(_mm256_slli_epi16(d, 8), 4);
                    a[i] = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(vl, 16), m)), x0, a[i]);
                    b[i] = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(vh, 16), m)), x1, b[i]);
                    a[i] = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(vl, m)), x2, a[i]);
                    b[i] = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(vh, m)), x3, b[i]);
                }
            }
            for (int i = 0; i < 4; i++)
                tot[i] = _mm256_fmadd_ps(_mm256_add_ps(a[i], b[i]), _mm256_set1_ps(s[i] * 0x1p16f), tot[i]);
            if (c < ce) {                           /* the last columns of a row (K % 32) */
                for (int i = 0; i < 4; i++) {
                    float part = 0.0f;
                    for (int64_t cc = c; cc < ce; cc++) part += e4m3_to_f32(p[i][cc]) * x[cc];
                    tail[i] += part * s[i];
                }
            }
        }
        float t[4];
        _mm_storeu_ps(t, hsum4x8(tot[0], tot[1], tot[2], tot[3]));
        for (int i = 0; i < nr; i++) y[r - r0 + i] = t[i] + tail[i];
    }
}

/* FP4 e2m1 with 1 x block_cols E8M0 scales (block_cols a multiple of 32): x is permuted per 32-group
 * into xp (thread-local), in column chunks of XP_MAX */
#define XP_MAX 16384
static __thread float fp4_xp[XP_MAX] ALIGN64;
static __thread float fp4_sc[4][XP_MAX / 32] ALIGN64;

static void gemv_e2m1(const cpumla_weight *w, const float *x, float *y, int64_t r0, int64_t r1) {
    const int64_t K = w->cols, bc = w->block_cols, chunk = (XP_MAX / bc) * bc;
    const int64_t gpb = bc / 32, pf = PF_ROWS * w->row_bytes;   /* groups per block, prefetch distance */
    const __m256i tl = fp4_tl(), th = fp4_th();
    for (int64_t k0 = 0; k0 < K; k0 += chunk) {
        const int64_t k1 = k0 + chunk < K ? k0 + chunk : K;
        const int64_t ng = (k1 - k0) / 32, nb = (k1 - k0 + bc - 1) / bc;
        for (int64_t g = 0; g < ng; g++)
            for (int i = 0; i < 32; i++) fp4_xp[32 * g + i] = x[k0 + 32 * g + fp4_perm[i]];
        for (int64_t r = r0; r < r1; r += 4) {
            const int nr = r1 - r < 4 ? (int)(r1 - r) : 4, lin = nr == 4 && w->row_bytes == K / 2 && K % 2 == 0;
            const uint8_t *p[4];
            for (int i = 0; i < 4; i++) {
                int64_t rr = r + (i < nr ? i : 0);
                p[i] = weight_row(w, rr) + k0 / 2;
                row_scales(w, rr, k0 / bc, nb, fp4_sc[i]);
            }
            __m256 tot[4];
            for (int i = 0; i < 4; i++) tot[i] = _mm256_setzero_ps();
            for (int64_t g = 0; g < ng; g++) {
                const float *xg = fp4_xp + 32 * g;
                __m256 x0 = _mm256_load_ps(xg), x1 = _mm256_load_ps(xg + 8);
                __m256 x2 = _mm256_load_ps(xg + 16), x3 = _mm256_load_ps(xg + 24);
                const int64_t b = g / gpb;
                if ((g & 3) == 0)
                    for (int i = 0; i < 4; i++) _mm_prefetch(pf_at(p[0] - k0 / 2, p[i] - k0 / 2, pf, lin, i, k0 / 2 + 16 * g), _MM_HINT_T0);
                for (int i = 0; i < 4; i++) {
                    __m256 f[4];
                    ld_e2m1x32(p[i] + 16 * g, tl, th, f);
                    __m256 s = _mm256_mul_ps(f[0], x0);
                    s = _mm256_fmadd_ps(f[1], x1, s);
                    s = _mm256_fmadd_ps(f[2], x2, s);
                    s = _mm256_fmadd_ps(f[3], x3, s);
                    tot[i] = _mm256_fmadd_ps(s, _mm256_broadcast_ss(&fp4_sc[i][b]), tot[i]);
                }
            }
            float t[4];
            _mm_storeu_ps(t, hsum4x8(tot[0], tot[1], tot[2], tot[3]));
            if (k0 + 32 * ng < k1) {   /* the last partial group: scalar */
                const int64_t ct = k0 + 32 * ng;
                for (int i = 0; i < nr; i++) {
                    const uint8_t *row = weight_row(w, r + i);
                    float part = 0.0f;
                    for (int64_t c = ct; c < k1; c++) part += e2m1_at(row, c) * x[c];
                    t[i] += part * fp4_sc[i][(ct - k0) / bc];
                }
            }
            for (int i = 0; i < nr; i++) {
                if (k0 == 0) y[r - r0 + i] = t[i];
                else y[r - r0 + i] += t[i];
            }
        }
    }
}

static void gemv_avx2(const cpumla_weight *w, const float *x, float *y, int64_t r0, int64_t r1) {
    switch (w->dtype) {
    case CPUMLA_F32: gemv_plain(w, x, y, r0, r1, CPUMLA_F32); return;
    case CPUMLA_BF16: gemv_plain(w, x, y, r0, r1, CPUMLA_BF16); return;
    case CPUMLA_F16: gemv_plain(w, x, y, r0, r1, CPUMLA_F16); return;
    case CPUMLA_E4M3:
        if (w->block_cols > 0 && w->block_cols % 32 == 0 && w->block_rows > 0 && w->cols <= E4_XP_MAX) {
            gemv_e4m3_x(w, x, y, r0, r1);
            return;
        }
        if (w->block_cols > 0 && w->block_rows > 0) { gemv_e4m3(w, x, y, r0, r1); return; }
        break;
    case CPUMLA_E2M1:
        if (w->block_cols > 0 && w->block_cols % 32 == 0 && w->block_cols <= XP_MAX && w->block_rows > 0) {
            gemv_e2m1(w, x, y, r0, r1);
            return;
        }
        break;
    default: break;
    }
    for (int64_t r = r0; r < r1; r++) y[r - r0] = row_dot_ref(w, r, x);
}

/* ---- gemm: dequantised 16-row panels, 6 tokens x 16 rows FMA microkernel ------------------------ */
#define GM_KC 512   /* K chunk */
#define GM_NR 16    /* rows per panel */
#define GM_MT 6     /* tokens per microkernel */
static __thread float gm_pack[GM_KC * GM_NR] ALIGN64;   /* [k][16] */
static __thread float gm_tmp[GM_NR * GM_KC] ALIGN64;    /* [16][k] */

INLINE void tr8x8_store(const float *src, int64_t lds, float *dst, int64_t ldd) {
    __m256 r0 = _mm256_load_ps(src), r1 = _mm256_load_ps(src + lds), r2 = _mm256_load_ps(src + 2 * lds);
    __m256 r3 = _mm256_load_ps(src + 3 * lds), r4 = _mm256_load_ps(src + 4 * lds);
    __m256 r5 = _mm256_load_ps(src + 5 * lds), r6 = _mm256_load_ps(src + 6 * lds);
    __m256 r7 = _mm256_load_ps(src + 7 * lds);
    __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1);
    __m256 t2 = _mm256_unpacklo_ps(r2, r3), t3 = _mm256_unpackhi_ps(r2, r3);
    __m256 t4 = _mm256_unpacklo_ps(r4, r5), t5 = _mm256_unpackhi_ps(r4, r5);
    __m256 t6 = _mm256_unpacklo_ps(r6, r7), t7 = _mm256_unpackhi_ps(r6, r7);
    __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xee);
    __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xee);
    __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xee);
    __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xee);
    _mm256_store_ps(dst + 0 * ldd, _mm256_permute2f128_ps(u0, u4, 0x20));
    _mm256_store_ps(dst + 1 * ldd, _mm256_permute2f128_ps(u1, u5, 0x20));
    _mm256_store_ps(dst + 2 * ldd, _mm256_permute2f128_ps(u2, u6, 0x20));
    _mm256_store_ps(dst + 3 * ldd, _mm256_permute2f128_ps(u3, u7, 0x20));
    _mm256_store_ps(dst + 4 * ldd, _mm256_permute2f128_ps(u0, u4, 0x31));
    _mm256_store_ps(dst + 5 * ldd, _mm256_permute2f128_ps(u1, u5, 0x31));
    _mm256_store_ps(dst + 6 * ldd, _mm256_permute2f128_ps(u2, u6, 0x31));
    _mm256_store_ps(dst + 7 * ldd, _mm256_permute2f128_ps(u3, u7, 0x31));
}

/* gm_pack[k][i] = W[r + i, k0 + k] for i < nr (zero rows above), k < kpad (zero columns past kc) */
static void gemm_pack(const cpumla_weight *w, int64_t r, int nr, int64_t k0, int64_t kc) {
    const int64_t kpad = (kc + 7) & ~(int64_t)7;
    for (int i = 0; i < GM_NR; i++) {
        float *t = gm_tmp + i * GM_KC;
        if (i < nr) {
            dequant_row_avx2(w, r + i, k0, k0 + kc, t);
            for (int64_t k = kc; k < kpad; k++) t[k] = 0.0f;
        } else {
            memset(t, 0, (size_t)kpad * sizeof(float));
        }
    }
    for (int64_t k = 0; k < kpad; k += 8) {
        tr8x8_store(gm_tmp + k, GM_KC, gm_pack + k * GM_NR, GM_NR);
        tr8x8_store(gm_tmp + 8 * GM_KC + k, GM_KC, gm_pack + k * GM_NR + 8, GM_NR);
    }
}

/* Y[t, 0..nr) (+)= sum_k X[t, k] pack[k][0..nr) for t < nt (nt <= 6; missing tokens repeat the last
 * one and are not stored). Twelve named accumulators so that nothing spills. */
static void gemm_micro(int nt, const float *wp, int64_t kc, const float *x, int64_t ldx, float *y,
                       int64_t ldy, int nr, int accumulate) {
    const float *x0 = x, *x1 = x + (nt > 1 ? 1 : 0) * ldx, *x2 = x + (nt > 2 ? 2 : nt - 1) * ldx;
    const float *x3 = x + (nt > 3 ? 3 : nt - 1) * ldx, *x4 = x + (nt > 4 ? 4 : nt - 1) * ldx;
    const float *x5 = x + (nt > 5 ? 5 : nt - 1) * ldx;
    __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00;
    __m256 c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
    for (int64_t k = 0; k < kc; k++) {
        __m256 w0 = _mm256_load_ps(wp + k * GM_NR), w1 = _mm256_load_ps(wp + k * GM_NR + 8), b;
        b = _mm256_broadcast_ss(x0 + k); c00 = _mm256_fmadd_ps(b, w0, c00); c01 = _mm256_fmadd_ps(b, w1, c01);
        b = _mm256_broadcast_ss(x1 + k); c10 = _mm256_fmadd_ps(b, w0, c10); c11 = _mm256_fmadd_ps(b, w1, c11);
        b = _mm256_broadcast_ss(x2 + k); c20 = _mm256_fmadd_ps(b, w0, c20); c21 = _mm256_fmadd_ps(b, w1, c21);
        b = _mm256_broadcast_ss(x3 + k); c30 = _mm256_fmadd_ps(b, w0, c30); c31 = _mm256_fmadd_ps(b, w1, c31);
        b = _mm256_broadcast_ss(x4 + k); c40 = _mm256_fmadd_ps(b, w0, c40); c41 = _mm256_fmadd_ps(b, w1, c41);
        b = _mm256_broadcast_ss(x5 + k); c50 = _mm256_fmadd_ps(b, w0, c50); c51 = _mm256_fmadd_ps(b, w1, c51);
    }
    __m256 c[GM_MT][2] = {{c00, c01}, {c10, c11}, {c20, c21}, {c30, c31}, {c40, c41}, {c50, c51}};
    for (int t = 0; t < nt; t++) {
        float *yt = y + t * ldy;
        if (nr == GM_NR) {
            if (accumulate) {
                c[t][0] = _mm256_add_ps(c[t][0], _mm256_loadu_ps(yt));
                c[t][1] = _mm256_add_ps(c[t][1], _mm256_loadu_ps(yt + 8));
            }
            _mm256_storeu_ps(yt, c[t][0]);
            _mm256_storeu_ps(yt + 8, c[t][1]);
        } else {
            float tmp[GM_NR];
            _mm256_storeu_ps(tmp, c[t][0]);
            _mm256_storeu_ps(tmp + 8, c[t][1]);
            for (int i = 0; i < nr; i++) yt[i] = accumulate ? yt[i] + tmp[i] : tmp[i];
        }
    }
}

static void gemm_avx2(const cpumla_weight *w, const float *x, int64_t ldx, int64_t n, float *y,
                      int64_t ldy, int64_t r0, int64_t r1) {
    if (n <= 0 || r1 <= r0) return;
    if (n == 1) { gemv_avx2(w, x, y, r0, r1); return; }
    const int64_t K = w->cols;
    if (K <= 0) {
        for (int64_t t = 0; t < n; t++)
            for (int64_t r = r0; r < r1; r++) y[t * ldy + r - r0] = 0.0f;
        return;
    }
    for (int64_t k0 = 0; k0 < K; k0 += GM_KC) {
        const int64_t kc = K - k0 < GM_KC ? K - k0 : GM_KC;
        const int acc = k0 > 0;
        for (int64_t r = r0; r < r1; r += GM_NR) {
            const int nr = r1 - r < GM_NR ? (int)(r1 - r) : GM_NR;
            gemm_pack(w, r, nr, k0, kc);
            float *yr = y + (r - r0);
            const float *xk = x + k0;
            for (int64_t t = 0; t < n; t += GM_MT)
                gemm_micro(n - t < GM_MT ? (int)(n - t) : GM_MT, gm_pack, kc, xk + t * ldx, ldx, yr + t * ldy, ldy, nr, acc);
        }
    }
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
            const uint8_t *row = weight_row(w, r0 + i);
            const float xi = x[i];
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
                if (dt == CPUMLA_E4M3) {
                    __m256 vx = _mm256_set1_ps(xi * s * 256.0f);
                    for (; c + 8 <= be; c += 8)
                        _mm256_storeu_ps(a + c, _mm256_fmadd_ps(vx, ld_e4m3x8(row + c), _mm256_loadu_ps(a + c)));
                    for (; c < be; c++) a[c] += xi * (e4m3_to_f32(row[c]) * s);
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

/* ---- rmsnorm, swiglu, softmax -------------------------------------------------------------------- */
static void rmsnorm_row_avx2(const float *x, float *y, int64_t dim, const void *weight, int32_t wdtype,
                             float eps) {
    __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
    int64_t i = 0;
    for (; i + 32 <= dim; i += 32) {
        __m256 a = _mm256_loadu_ps(x + i), b = _mm256_loadu_ps(x + i + 8);
        __m256 c = _mm256_loadu_ps(x + i + 16), d = _mm256_loadu_ps(x + i + 24);
        s0 = _mm256_fmadd_ps(a, a, s0);
        s1 = _mm256_fmadd_ps(b, b, s1);
        s2 = _mm256_fmadd_ps(c, c, s2);
        s3 = _mm256_fmadd_ps(d, d, s3);
    }
    for (; i + 8 <= dim; i += 8) {
        __m256 a = _mm256_loadu_ps(x + i);
        s0 = _mm256_fmadd_ps(a, a, s0);
    }
    if (i < dim) {
        __m256 a = _mm256_maskload_ps(x + i, tail_mask(dim - i));
        s1 = _mm256_fmadd_ps(a, a, s1);
    }
    float ss = hsum8(_mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3)));
    const float inv = 1.0f / sqrtf(ss / (float)dim + eps);
    const __m256 vi = _mm256_set1_ps(inv);
    i = 0;
    for (; i + 8 <= dim; i += 8) {
        __m256 v = _mm256_mul_ps(_mm256_loadu_ps(x + i), vi);
        if (weight) {
            if (wdtype == CPUMLA_F32) v = _mm256_mul_ps(v, _mm256_loadu_ps((const float *)weight + i));
            else if (wdtype == CPUMLA_BF16) v = _mm256_mul_ps(v, ld_bf16((const uint16_t *)weight + i));
            else if (wdtype == CPUMLA_F16) v = _mm256_mul_ps(v, ld_f16((const uint16_t *)weight + i));
            else v = _mm256_set1_ps(NAN);
        }
        _mm256_storeu_ps(y + i, v);
    }
    for (; i < dim; i++) {
        float v = x[i] * inv;
        y[i] = weight ? v * vec_at(weight, wdtype, i) : v;
    }
}

INLINE __m256 swiglu8(__m256 g, __m256 u, float limit) {
    if (limit > 0.0f) {
        __m256 l = _mm256_set1_ps(limit);
        g = _mm256_min_ps(g, l);                                           /* g < l ? g : l */
        u = _mm256_max_ps(_mm256_set1_ps(-limit), _mm256_min_ps(l, u));    /* as the spec, NaN kept */
    }
    __m256 e = exp256(_mm256_sub_ps(_mm256_setzero_ps(), g));
    __m256 s = _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
    return _mm256_mul_ps(s, u);
}

static void swiglu_row_avx2(const float *gate, const float *up, float *out, int64_t dim, float limit) {
    int64_t i = 0;
    for (; i + 8 <= dim; i += 8)
        _mm256_storeu_ps(out + i, swiglu8(_mm256_loadu_ps(gate + i), _mm256_loadu_ps(up + i), limit));
    if (i < dim) {
        __m256i m = tail_mask(dim - i);
        __m256 r = swiglu8(_mm256_maskload_ps(gate + i, m), _mm256_maskload_ps(up + i, m), limit);
        _mm256_maskstore_ps(out + i, m, r);
    }
}

static void softmax_row_avx2(float *x, int64_t n) {
    if (n <= 0) return;
    __m256 m0 = _mm256_set1_ps(-INFINITY), m1 = m0;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        m0 = _mm256_max_ps(_mm256_loadu_ps(x + i), m0);   /* x > m ? x : m, NaN never wins */
        m1 = _mm256_max_ps(_mm256_loadu_ps(x + i + 8), m1);
    }
    m0 = _mm256_max_ps(m1, m0);
    __m128 h = _mm_max_ps(_mm256_extractf128_ps(m0, 1), _mm256_castps256_ps128(m0));
    h = _mm_max_ps(_mm_movehl_ps(h, h), h);
    h = _mm_max_ps(_mm_movehdup_ps(h), h);
    float m = _mm_cvtss_f32(h);
    for (; i < n; i++) m = x[i] > m ? x[i] : m;
    const __m256 vm = _mm256_set1_ps(m);
    __m256 s0 = _mm256_setzero_ps(), s1 = s0;
    for (i = 0; i + 16 <= n; i += 16) {
        __m256 e0 = exp256(_mm256_sub_ps(_mm256_loadu_ps(x + i), vm));
        __m256 e1 = exp256(_mm256_sub_ps(_mm256_loadu_ps(x + i + 8), vm));
        _mm256_storeu_ps(x + i, e0);
        _mm256_storeu_ps(x + i + 8, e1);
        s0 = _mm256_add_ps(s0, e0);
        s1 = _mm256_add_ps(s1, e1);
    }
    for (; i < n; i += 8) {
        __m256i mk = tail_mask(n - i < 8 ? n - i : 8);
        __m256 e = exp256(_mm256_sub_ps(_mm256_maskload_ps(x + i, mk), vm));
        e = _mm256_and_ps(e, _mm256_castsi256_ps(mk));
        _mm256_maskstore_ps(x + i, mk, e);
        s0 = _mm256_add_ps(s0, e);
    }
    const __m256 vs = _mm256_set1_ps(hsum8(_mm256_add_ps(s0, s1)));
    for (i = 0; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, _mm256_div_ps(_mm256_loadu_ps(x + i), vs));
    if (i < n) {
        __m256i mk = tail_mask(n - i);
        _mm256_maskstore_ps(x + i, mk, _mm256_div_ps(_mm256_maskload_ps(x + i, mk), vs));
    }
}

/* ---- attention part ------------------------------------------------------------------------------ */
#define AT_TJ 16                /* KV entries per tile */
#define AT_BUF (AT_TJ * 1024)   /* floats of the BF16 -> fp32 tile */
static __thread float at_tile[AT_BUF] ALIGN64;

/* s_h[j] = q_h . k_j for NH (1 or 2) heads and 4 rows */
INLINE void attn_scores(const int NH, const float *q0, const float *q1, const float *const *k, int64_t dk,
                        float *s0, float *s1) {
    __m256 a[2][4];
    for (int h = 0; h < 2; h++)
        for (int j = 0; j < 4; j++) a[h][j] = _mm256_setzero_ps();
    int64_t d = 0;
    for (; d + 8 <= dk; d += 8) {
        __m256 qa = _mm256_loadu_ps(q0 + d), qb = NH > 1 ? _mm256_loadu_ps(q1 + d) : qa;
        for (int j = 0; j < 4; j++) {
            __m256 kv = _mm256_loadu_ps(k[j] + d);
            a[0][j] = _mm256_fmadd_ps(qa, kv, a[0][j]);
            if (NH > 1) a[1][j] = _mm256_fmadd_ps(qb, kv, a[1][j]);
        }
    }
    if (d < dk) {
        __m256i mk = tail_mask(dk - d);
        __m256 qa = _mm256_maskload_ps(q0 + d, mk), qb = NH > 1 ? _mm256_maskload_ps(q1 + d, mk) : qa;
        for (int j = 0; j < 4; j++) {
            __m256 kv = _mm256_maskload_ps(k[j] + d, mk);
            a[0][j] = _mm256_fmadd_ps(qa, kv, a[0][j]);
            if (NH > 1) a[1][j] = _mm256_fmadd_ps(qb, kv, a[1][j]);
        }
    }
    _mm_storeu_ps(s0, hsum4x8(a[0][0], a[0][1], a[0][2], a[0][3]));
    if (NH > 1) _mm_storeu_ps(s1, hsum4x8(a[1][0], a[1][1], a[1][2], a[1][3]));
}

/* o_h = o_h * c_h + sum_{j < nv} p_h[j] v_j over dv, for NH heads */
INLINE void attn_pv(const int NH, float *o0, float *o1, float c0, float c1, const float *p0, const float *p1,
                    const float *const *v, int nv, int64_t dv) {
    const __m256 vc0 = _mm256_set1_ps(c0), vc1 = _mm256_set1_ps(c1);
    int64_t d = 0;
    for (; d + 32 <= dv; d += 32) {
        __m256 a[2][4];
        for (int k = 0; k < 4; k++) {
            a[0][k] = _mm256_mul_ps(_mm256_loadu_ps(o0 + d + 8 * k), vc0);
            if (NH > 1) a[1][k] = _mm256_mul_ps(_mm256_loadu_ps(o1 + d + 8 * k), vc1);
        }
        for (int j = 0; j < nv; j++) {
            __m256 pa = _mm256_broadcast_ss(p0 + j), pb = NH > 1 ? _mm256_broadcast_ss(p1 + j) : pa;
            for (int k = 0; k < 4; k++) {
                __m256 vv = _mm256_loadu_ps(v[j] + d + 8 * k);
                a[0][k] = _mm256_fmadd_ps(pa, vv, a[0][k]);
                if (NH > 1) a[1][k] = _mm256_fmadd_ps(pb, vv, a[1][k]);
            }
        }
        for (int k = 0; k < 4; k++) {
            _mm256_storeu_ps(o0 + d + 8 * k, a[0][k]);
            if (NH > 1) _mm256_storeu_ps(o1 + d + 8 * k, a[1][k]);
        }
    }
    for (; d < dv; d += 8) {
        __m256i mk = tail_mask(dv - d < 8 ? dv - d : 8);
        __m256 a0 = _mm256_mul_ps(_mm256_maskload_ps(o0 + d, mk), vc0);
        __m256 a1 = NH > 1 ? _mm256_mul_ps(_mm256_maskload_ps(o1 + d, mk), vc1) : a0;
        for (int j = 0; j < nv; j++) {
            __m256 vv = _mm256_maskload_ps(v[j] + d, mk);
            a0 = _mm256_fmadd_ps(_mm256_broadcast_ss(p0 + j), vv, a0);
            if (NH > 1) a1 = _mm256_fmadd_ps(_mm256_broadcast_ss(p1 + j), vv, a1);
        }
        _mm256_maskstore_ps(o0 + d, mk, a0);
        if (NH > 1) _mm256_maskstore_ps(o1 + d, mk, a1);
    }
}

/* scores of one head for the tile -> online-softmax update; returns the rescale factor, writes p */
static float attn_update(const float *s, int nv, float scale, float *mh, float *lh, float *p) {
    float mt = *mh;
    for (int j = 0; j < nv; j++) {
        p[j] = s[j] * scale;
        mt = p[j] > mt ? p[j] : mt;
    }
    float c = 1.0f;
    if (mt > *mh) { c = expf(*mh - mt); *mh = mt; }
    float l = *lh * c;
    for (int j = 0; j < nv; j++) {
        p[j] = expf(p[j] - *mh);
        l += p[j];
    }
    *lh = l;
    return c;
}

INLINE void attn_heads(const int NH, const cpumla_attn_args *a, int64_t qi, int64_t h, int64_t h0,
                       const float *const *rows, int nv, float *acc, float *m, float *l) {
    float s[2][AT_TJ + 4], p[2][AT_TJ];
    const float *q0 = a->q + qi * a->ldq_t + h * a->ldq_h, *q1 = NH > 1 ? q0 + a->ldq_h : q0;
    for (int j = 0; j < nv; j += 4) {
        const float *k[4];
        for (int t = 0; t < 4; t++) k[t] = rows[j + t < nv ? j + t : j];
        attn_scores(NH, q0, q1, k, a->dk, s[0] + j, s[1] + j);
    }
    const int64_t k0 = h - h0;
    float c0 = attn_update(s[0], nv, a->scale, m + k0, l + k0, p[0]);
    float c1 = NH > 1 ? attn_update(s[1], nv, a->scale, m + k0 + 1, l + k0 + 1, p[1]) : c0;
    attn_pv(NH, acc + k0 * a->dv, acc + (k0 + (NH > 1)) * a->dv, c0, c1, p[0], p[1], rows, nv, a->dv);
}

static void attn_part_ref(const cpumla_attn_args *a, int64_t qi, int64_t h0, int64_t h1, int64_t j0,
                          int64_t j1, float *acc, float *m, float *l) {
    for (int64_t h = h0; h < h1; h++) {
        const float *q = a->q + qi * a->ldq_t + h * a->ldq_h;
        float *o = acc + (h - h0) * a->dv;
        float mh = -INFINITY, lh = 0.0f;
        for (int64_t d = 0; d < a->dv; d++) o[d] = 0.0f;
        for (int64_t j = j0; j < j1; j++) {
            const void *row = attn_kv_row(a, qi, j);
            if (!row) continue;
            const uint16_t *rb = (const uint16_t *)row;
            const float *rf = (const float *)row;
            float s = 0.0f;
            for (int64_t d = 0; d < a->dk; d++) s += q[d] * (a->kv_dtype == CPUMLA_BF16 ? bf16_to_f32(rb[d]) : rf[d]);
            s *= a->scale;
            if (s > mh) {
                float c = expf(mh - s);
                lh *= c;
                for (int64_t d = 0; d < a->dv; d++) o[d] *= c;
                mh = s;
            }
            float p = expf(s - mh);
            lh += p;
            for (int64_t d = 0; d < a->dv; d++) o[d] += p * (a->kv_dtype == CPUMLA_BF16 ? bf16_to_f32(rb[d]) : rf[d]);
        }
        m[h - h0] = mh;
        l[h - h0] = lh;
    }
}

static void attn_part_avx2(const cpumla_attn_args *a, int64_t qi, int64_t h0, int64_t h1, int64_t j0,
                           int64_t j1, float *acc, float *m, float *l) {
    const int64_t dk = a->dk, dv = a->dv, dmax = dk > dv ? dk : dv, ldt = (dmax + 7) & ~(int64_t)7;
    const int bf = a->kv_dtype == CPUMLA_BF16;
    int tj = AT_TJ;
    if (bf && AT_BUF / ldt < tj) tj = (int)(AT_BUF / ldt);
    if (tj < 1) { attn_part_ref(a, qi, h0, h1, j0, j1, acc, m, l); return; }
    for (int64_t h = h0; h < h1; h++) { m[h - h0] = -INFINITY; l[h - h0] = 0.0f; }
    memset(acc, 0, (size_t)((h1 - h0) * dv) * sizeof(float));
    const float *rows[AT_TJ];
    int64_t j = j0;
    while (j < j1) {
        int nv = 0;
        for (; j < j1 && nv < tj; j++) {
            const void *row = attn_kv_row(a, qi, j);
            if (!row) continue;
            if (bf) {
                float *t = at_tile + nv * ldt;
                const uint16_t *rb = (const uint16_t *)row;
                int64_t d = 0;
                for (; d + 8 <= dmax; d += 8) _mm256_store_ps(t + d, ld_bf16(rb + d));
                for (; d < dmax; d++) t[d] = bf16_to_f32(rb[d]);
                rows[nv++] = t;
            } else {
                rows[nv++] = (const float *)row;
            }
        }
        if (!nv) break;
        int64_t h = h0;
        for (; h + 2 <= h1; h += 2) attn_heads(2, a, qi, h, h0, rows, nv, acc, m, l);
        if (h < h1) attn_heads(1, a, qi, h, h0, rows, nv, acc, m, l);
    }
}

/* ---- cache row, read probe ----------------------------------------------------------------------- */
INLINE __m256i bf16_round8(__m256i u) {
    __m256i isnan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)), _mm256_set1_epi32(0x7f800000));
    __m256i hi = _mm256_srli_epi32(u, 16);
    __m256i rnd = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), _mm256_and_si256(hi, _mm256_set1_epi32(1))));
    return _mm256_blendv_epi8(_mm256_srli_epi32(rnd, 16), _mm256_or_si256(hi, _mm256_set1_epi32(0x40)), isnan);
}

static void cache_row_avx2(void *dst, int32_t dtype, const float *src, int64_t width) {
    if (dtype != CPUMLA_BF16) { memcpy(dst, src, (size_t)width * sizeof(float)); return; }
    uint16_t *d = (uint16_t *)dst;
    int64_t i = 0;
    for (; i + 16 <= width; i += 16) {
        __m256i a = bf16_round8(_mm256_loadu_si256((const __m256i *)(src + i)));
        __m256i b = bf16_round8(_mm256_loadu_si256((const __m256i *)(src + i + 8)));
        _mm256_storeu_si256((__m256i *)(d + i), _mm256_permute4x64_epi64(_mm256_packus_epi32(a, b), 0xd8));
    }
    for (; i < width; i++) d[i] = f32_to_bf16(src[i]);
}

/* the sum of the buffer as doubles; 8 independent 256-bit accumulators keep enough loads in flight */
static double read_sum_avx2(const void *buf, int64_t bytes) {
    const double *p = (const double *)buf;
    const int64_t n = bytes / 8;
    __m256d s0 = _mm256_setzero_pd(), s1 = s0, s2 = s0, s3 = s0, s4 = s0, s5 = s0, s6 = s0, s7 = s0;
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        s0 = _mm256_add_pd(s0, _mm256_load_pd(p + i));
        s1 = _mm256_add_pd(s1, _mm256_load_pd(p + i + 4));
        s2 = _mm256_add_pd(s2, _mm256_load_pd(p + i + 8));
        s3 = _mm256_add_pd(s3, _mm256_load_pd(p + i + 12));
        s4 = _mm256_add_pd(s4, _mm256_load_pd(p + i + 16));
        s5 = _mm256_add_pd(s5, _mm256_load_pd(p + i + 20));
        s6 = _mm256_add_pd(s6, _mm256_load_pd(p + i + 24));
        s7 = _mm256_add_pd(s7, _mm256_load_pd(p + i + 28));
    }
    for (; i + 4 <= n; i += 4) s0 = _mm256_add_pd(s0, _mm256_load_pd(p + i));
    s0 = _mm256_add_pd(_mm256_add_pd(_mm256_add_pd(s0, s1), _mm256_add_pd(s2, s3)),
                       _mm256_add_pd(_mm256_add_pd(s4, s5), _mm256_add_pd(s6, s7)));
    double s[4];
    _mm256_storeu_pd(s, s0);
    return (s[0] + s[1]) + (s[2] + s[3]);
}


/* FMA-throughput probe: 12 independent accumulators hide the FMA latency. */
static double fma_loop_avx2(int64_t iters, float *sink) {
    __m256 a0 = _mm256_set1_ps(1.0f), a1 = _mm256_set1_ps(1.1f), a2 = _mm256_set1_ps(1.2f), a3 = _mm256_set1_ps(1.3f), a4 = _mm256_set1_ps(1.4f),
           a5 = _mm256_set1_ps(1.5f), a6 = _mm256_set1_ps(1.6f), a7 = _mm256_set1_ps(1.7f), a8 = _mm256_set1_ps(1.8f), a9 = _mm256_set1_ps(1.9f),
           a10 = _mm256_set1_ps(2.0f), a11 = _mm256_set1_ps(2.1f);
    const __m256 m = _mm256_set1_ps(0.999999f), c = _mm256_set1_ps(1e-7f);
    for (int64_t i = 0; i < iters; i++) {
        a0 = _mm256_fmadd_ps(a0, m, c); a1 = _mm256_fmadd_ps(a1, m, c); a2 = _mm256_fmadd_ps(a2, m, c); a3 = _mm256_fmadd_ps(a3, m, c);
        a4 = _mm256_fmadd_ps(a4, m, c); a5 = _mm256_fmadd_ps(a5, m, c); a6 = _mm256_fmadd_ps(a6, m, c); a7 = _mm256_fmadd_ps(a7, m, c);
        a8 = _mm256_fmadd_ps(a8, m, c); a9 = _mm256_fmadd_ps(a9, m, c); a10 = _mm256_fmadd_ps(a10, m, c); a11 = _mm256_fmadd_ps(a11, m, c);
    }
    __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)), _mm256_add_ps(_mm256_add_ps(a4, a5), _mm256_add_ps(a6, a7)));
    s = _mm256_add_ps(s, _mm256_add_ps(_mm256_add_ps(a8, a9), _mm256_add_ps(a10, a11)));
    float buf[8];
    _mm256_storeu_ps(buf, s);
    for (int j = 0; j < 8; j++) *sink += buf[j];
    return 2.0 * 12.0 * 8.0 * (double)iters;
}

void cpumla_fill_avx2(cpumla_kernels *k) {
    k->fma_loop = fma_loop_avx2;
    k->who[K_FMA] = "avx2";
    k->gemv = gemv_avx2;
    k->gemm = gemm_avx2;
    k->gemv_t = gemv_t_avx2;
    k->dequant_row = dequant_row_avx2;
    k->rmsnorm_row = rmsnorm_row_avx2;
    k->swiglu_row = swiglu_row_avx2;
    k->softmax_row = softmax_row_avx2;
    k->attn_part = attn_part_avx2;
    k->cache_row = cache_row_avx2;
    k->read_sum = read_sum_avx2;
    for (int i = K_GEMV; i <= K_READ; i++) k->who[i] = "avx2";
}
