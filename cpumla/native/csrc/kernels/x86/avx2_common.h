/* avx2_common.h: inline helpers of avx2.c (linear algebra), avx2_gemm.c (its gemm) and avx2_rows.c
 * (row-wise and attention kernels): first those they share, then avx2.c's weight decoders (see avx2.c
 * for the tricks), last the functions avx2.c lends avx2_gemm.c. Included by those three files and by
 * int_avx2.h and gq_x86.h (their shared helpers), all compiled with AVX2 at least (FLAGS). static inline and declarations only:
 * nothing here may define data (tables and buffers stay in the one file that uses them). */
#ifndef CPUMLA_AVX2_COMMON_H
#define CPUMLA_AVX2_COMMON_H
#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>
#include "core/common.h"

#define INLINE static inline __attribute__((always_inline))
#define UNROLL _Pragma("GCC unroll 16")   /* small fixed loops: keep accumulators in registers */
#define ALIGN64 __attribute__((aligned(64)))

INLINE float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* max |v| over 4 vectors (a block of 32; absm: the sign-clearing mask), as quant.h's q_amax: an
 * integer max over the bits of |v| */
INLINE float amax32(const __m256 v[4], __m256 absm) {
#define ABITS_(k) _mm256_castps_si256(_mm256_and_ps(v[k], absm))
    __m256i m = _mm256_max_epi32(_mm256_max_epi32(ABITS_(0), ABITS_(1)), _mm256_max_epi32(ABITS_(2), ABITS_(3)));
#undef ABITS_
    __m128i m4 = _mm_max_epi32(_mm256_castsi256_si128(m), _mm256_extracti128_si256(m, 1));
    m4 = _mm_max_epi32(m4, _mm_shuffle_epi32(m4, 0x4e));
    m4 = _mm_max_epi32(m4, _mm_shuffle_epi32(m4, 0xb1));
    return f32_from_bits((uint32_t)_mm_cvtsi128_si32(m4));
}

/* [sum a0, sum a1, sum a2, sum a3] */
INLINE __m128 hsum4x8(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
    __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

/* bf16 bits (in the low half of each dword) of 8 floats, rounded as f32_to_bf16 (common.h) does */
INLINE __m256i bf16_round8(__m256i u) {
    __m256i isnan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)), _mm256_set1_epi32(0x7f800000));
    __m256i hi = _mm256_srli_epi32(u, 16);
    __m256i rnd = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), _mm256_and_si256(hi, _mm256_set1_epi32(1))));
    return _mm256_blendv_epi8(_mm256_srli_epi32(rnd, 16), _mm256_or_si256(hi, _mm256_set1_epi32(0x40)), isnan);
}

/* dst[t*ldd + k] = bf16_round(src[t*lds + k]) for t < n, k < K: the activations of a BF16 product */
INLINE void bf16_round_rows(const float *src, int64_t lds, int64_t n, int64_t K, float *dst, int64_t ldd) {
    for (int64_t t = 0; t < n; t++) {
        const float *s = src + t * lds;
        float *d = dst + t * ldd;
        int64_t k = 0;
        for (; k + 8 <= K; k += 8) {
            __m256i b = bf16_round8(_mm256_loadu_si256((const __m256i *)(s + k)));
            _mm256_storeu_si256((__m256i *)(d + k), _mm256_slli_epi32(b, 16));
        }
        for (; k < K; k++) d[k] = bf16_round(s[k]);
    }
}

/* dst[k] = bf16_round(src[k] * s) for k < n: the fp32 product rounded to bf16 (nearest even), as fp32.
 * Returns the largest |dst[k]| as fp32 bits (above 0x7f800000 when some dst[k] is NaN). The loop
 * rounds without minding NaN ((u + 0x7fff + lsb) & 0xffff0000 is f32_to_bf16 for all but NaN) and
 * redoes the whole with bf16_round8 when it saw one. */
INLINE uint32_t bf16_scale_round(const float *src, int64_t n, float s, float *dst) {
    const __m256 vs = _mm256_set1_ps(s);
    const __m256i b7 = _mm256_set1_epi32(0x7fff), one = _mm256_set1_epi32(1);
    const __m256i hm = _mm256_set1_epi32((int)0xffff0000u), absm = _mm256_set1_epi32(0x7fffffff);
    __m256 nan = _mm256_setzero_ps();
    __m256i mx = _mm256_setzero_si256();
    int64_t k = 0;
    for (; k + 8 <= n; k += 8) {
        __m256 v = _mm256_mul_ps(_mm256_loadu_ps(src + k), vs);
        __m256i u = _mm256_castps_si256(v);
        __m256i r = _mm256_add_epi32(_mm256_add_epi32(u, b7), _mm256_and_si256(_mm256_srli_epi32(u, 16), one));
        r = _mm256_and_si256(r, hm);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        mx = _mm256_max_epu32(mx, _mm256_and_si256(r, absm));
        _mm256_storeu_si256((__m256i *)(dst + k), r);
    }
    __m128i m4 = _mm_max_epu32(_mm256_castsi256_si128(mx), _mm256_extracti128_si256(mx, 1));
    m4 = _mm_max_epu32(m4, _mm_shuffle_epi32(m4, 0x4e));
    m4 = _mm_max_epu32(m4, _mm_shuffle_epi32(m4, 0xb1));
    uint32_t m = (uint32_t)_mm_cvtsi128_si32(m4);
    if (_mm256_movemask_ps(nan)) {
        m = 0x7fffffffu;
        for (int64_t j = 0; j + 8 <= n; j += 8) {
            __m256i u = _mm256_castps_si256(_mm256_mul_ps(_mm256_loadu_ps(src + j), vs));
            _mm256_storeu_si256((__m256i *)(dst + j), _mm256_slli_epi32(bf16_round8(u), 16));
        }
    }
    for (; k < n; k++) {
        dst[k] = bf16_round(src[k] * s);
        uint32_t a = bits_from_f32(dst[k]) & 0x7fffffffu;
        m = a > m ? a : m;
    }
    return m;
}

/* E4M3 activation operands (e4m3_act, common.h) of row block containing row r, times fold (a power of
 * two): dst[c - c0] = bf16_round(x[c] * (scale(r, c) * fold)), which is bf16_round(x[c] * scale(r, c))
 * * fold exactly (x * scale normal, no overflow), for c0 <= c < c1. Returns the largest |dst| as fp32
 * bits. */
INLINE uint32_t e4m3_act_row(const cpumla_weight *w, int64_t r, const float *x, int64_t c0, int64_t c1,
                             float *dst, float fold) {
    if (c1 <= c0) return 0;
    const int64_t bc = w->block_cols, si = (r / w->block_rows) * w->scale_ld;
    uint32_t m = 0;
    for (int64_t b = c0 / bc, c = c0; c < c1; b++) {
        const int64_t be = (b + 1) * bc < c1 ? (b + 1) * bc : c1;
        const float s = scale_elem(w, si + b) * fold;
        const uint32_t mb = bf16_scale_round(x + c, be - c, s, dst + (c - c0));
        m = mb > m ? mb : m;
        c = be;
    }
    return m;
}

INLINE __m256 ld_bf16(const uint16_t *p) {
    __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}
INLINE __m256 ld_f16(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }

/* ---- weight decoding (avx2.c) ------------------------------------------------------------------ */
/* 8 E4M3 bytes -> value * 2^-8: fp16 bits sign | (b & 0x7f) << 7, widened by vcvtph2ps, so e4m3's
 * subnormals (fp16 subnormals here) come out as normal fp32 (the smallest nonzero is 2^-17) */
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

INLINE float e2m1_at(const uint8_t *row, int64_t c) {
    uint8_t b = row[c >> 1];
    return cpumla_e2m1_lut[(c & 1) ? (b >> 4) : (b & 15)];
}

/* ---- avx2.c, for avx2_gemm.c ------------------------------------------------------------------- */
/* the table's gemv (gemm of one token) and dequant_row (gemm's panel decoding) */
CPUMLA_INTERNAL void cpumla_avx2_gemv(const cpumla_weight *w, const float *x, float *y, int64_t r0, int64_t r1);
/* a product of 2 or 3 tokens, each row read once, each token's result its gemv's; 0: not served */
CPUMLA_INTERNAL int cpumla_avx2_gemm_few(const cpumla_weight *w, const float *x, int64_t ldx, int64_t n, float *y,
                                         int64_t ldy, int64_t r0, int64_t r1);
CPUMLA_INTERNAL void cpumla_avx2_dequant_row(const cpumla_weight *w, int64_t r, int64_t c0, int64_t c1, float *out);

#endif
