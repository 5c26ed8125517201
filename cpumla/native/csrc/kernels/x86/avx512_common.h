/* avx512_common.h: helpers shared by the AVX-512 files of the avx512f level (avx512f.c, avx512f_rows.c,
 * avx512f_gemm.c) and the avx512 level (avx512.c), whose flags include avx512f's: e4m3_h32 (the
 * avx512f linear algebra's) kept next to its 16-lane twin, and the functions avx512.c's entries are
 * made of.
 * static inline and declarations only: nothing here may define data (tables stay in the one file
 * that uses them). */
#ifndef CPUMLA_AVX512_COMMON_H
#define CPUMLA_AVX512_COMMON_H
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include "core/common.h"

#define INLINE static inline __attribute__((always_inline))
#define UNROLL _Pragma("GCC unroll 16")   /* small fixed loops: keep accumulators in registers */

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
static inline int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

/* max |x| of the 32 values v0, v1 (a block), as quant.h's q_amax: an integer max over the bits of |x| */
INLINE float amax32_avx512(__m512 v0, __m512 v1) {
    const __m512i a = _mm512_max_epi32(_mm512_castps_si512(_mm512_abs_ps(v0)), _mm512_castps_si512(_mm512_abs_ps(v1)));
    return f32_from_bits((uint32_t)_mm512_reduce_max_epi32(a));
}

/* lanes [0, n) of 16: all for n >= 16, none for n <= 0 */
INLINE __mmask16 tail16(int64_t n) { return n >= 16 ? (__mmask16)0xffff : n <= 0 ? 0 : (__mmask16)((1u << n) - 1u); }

/* ---- gemv software prefetch (avx512f.c's E4M3 groups: pf_at, and pf_rows, the group ahead; BF16 /
 * F16 read one row at a time, GEMV_PF_BYTES ahead: common.h GEMV_PF_LINE) ---- */
#ifndef PF_BYTES
#define PF_BYTES 4096
#endif
/* The line to prefetch for row i of the group at pf, byte offset off of each row, while a group of
 * R rows is read 64 bytes per row per step. When the 4 rows lie back to back (row_bytes equals the
 * row's data bytes), the next group is one contiguous range and is fetched in address order, 4 lines
 * per step (4 * off + 64 * i), which the memory system serves better than 4 interleaved page
 * streams; otherwise line off of each of the R rows. */
INLINE const char *pf_at(const uint8_t *pf, const cpumla_weight *w, int R, int i, int64_t off, int64_t data_bytes) {
    if (R == 4 && w->row_bytes == data_bytes) return (const char *)(pf + 4 * off + 64 * i);
    return (const char *)(pf + i * w->row_bytes + off);
}
/* The rows to prefetch while rows [r, r + 4) are computed: a later group about 16 KiB ahead (4 row
 * streams, each starting a new page, leave the hardware prefetcher behind); at the end of the range,
 * the last group (already read: cheap). */
INLINE const uint8_t *pf_rows(const cpumla_weight *w, int64_t r, int64_t r1) {
    int64_t ahead = 4 * max64(1, PF_BYTES / max64(w->row_bytes, 1));
    int64_t p = min64(r + ahead, r1 - 4);
    return weight_row(w, p > r ? p : r);
}

/* high byte of fp16(value * 2^-14) of each E2M1 code: ((code & 7) << 1) | ((code & 8) << 4) */
#define E2M1_HB 0, 2, 4, 6, 8, 10, 12, 14, -128, -126, -124, -122, -120, -118, -116, -114

/* E4M3 bytes -> fp16 bits of value * 2^-8 (16 or 32 of them). */
INLINE __m256i e4m3_h16(__m128i b) {
    return _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(b), 7), _mm256_set1_epi16((short)0xbfff));
}
INLINE __m512i e4m3_h32(__m256i b) {
    return _mm512_and_si512(_mm512_slli_epi16(_mm512_cvtepi8_epi16(b), 7), _mm512_set1_epi16((short)0xbfff));
}
/* lanes whose byte is 0x7f or 0xff (e4m3fn NaN) */
INLINE __mmask16 e4m3_nan16(__m128i b) {
    return _mm_cmpeq_epi8_mask(_mm_or_si128(b, _mm_set1_epi8((char)0x80)), _mm_set1_epi8(-1));
}

/* Columns [c, c + n) of one row (n <= 16) as fp32, unscaled (see dq_fold); lanes >= n are 0.
 * Reads no byte outside those columns. */
INLINE __m512 dq16(int32_t dt, const uint8_t *row, int64_t c, int64_t n) {
    __mmask16 m = tail16(n);
    switch (dt) {
    case CPUMLA_F32:
        return _mm512_maskz_loadu_ps(m, (const float *)row + c);
    case CPUMLA_BF16: {
        __m256i h = _mm256_maskz_loadu_epi16(m, (const uint16_t *)row + c);
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    case CPUMLA_F16:
        return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, (const uint16_t *)row + c));
    case CPUMLA_E4M3: {
        __m128i b = _mm_maskz_loadu_epi8(m, row + c);
        __m512 f = _mm512_cvtph_ps(e4m3_h16(b));
        return _mm512_mask_mov_ps(f, e4m3_nan16(b), _mm512_set1_ps(NAN));
    }
    case CPUMLA_E2M1: {
        if (c & 1) {                   /* odd start (odd block_cols): rare, do it element by element */
            float t[16] = {0};
            for (int64_t i = 0; i < n && i < 16; i++) {      /* n counts what is left of the row */
                uint8_t b = row[(c + i) >> 1];
                t[i] = cpumla_e2m1_lut[((c + i) & 1) ? (b >> 4) : (b & 15)] * (1.0f / 16384.0f);
            }
            return _mm512_loadu_ps(t);
        }
        int nb = n >= 16 ? 8 : (int)((n + 1) >> 1);         /* bytes of these columns (n may exceed 16) */
        __m128i b = _mm_maskz_loadu_epi8((__mmask16)((1u << nb) - 1u), row + (c >> 1));
        __m128i lo = _mm_and_si128(b, _mm_set1_epi8(15));
        __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(15));
        __m128i codes = _mm_unpacklo_epi8(lo, hi);                       /* column order */
        __m128i hb = _mm_shuffle_epi8(_mm_setr_epi8(E2M1_HB), codes);
        __m512 f = _mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(hb), 8));
        return _mm512_maskz_mov_ps(m, f);
    }
    default:
        return _mm512_set1_ps(NAN);
    }
}

/* avx512.c: BF16-weight products with vdpbf16ps. Their buffers come from cpumla_scratch; when
 * one cannot be had they write nothing (the context is marked failed and the call returns -1). */
CPUMLA_INTERNAL void cpumla_avx512_gemv_bf16(const cpumla_weight *w, const float *x, float *y, int64_t r0, int64_t r1);
CPUMLA_INTERNAL void cpumla_avx512_gemm_bf16(const cpumla_weight *w, const float *x, int64_t ldx, int64_t n, float *y,
                            int64_t ldy, int64_t r0, int64_t r1);
CPUMLA_INTERNAL void cpumla_avx512_gemm_xb(const cpumla_weight *w, const uint16_t *xb, int64_t ldb, int64_t n, float *y,
                           int64_t ldy, int64_t r0, int64_t r1);

/* gemv_t of BF16 weights, rows paired per vdpbf16ps */
CPUMLA_INTERNAL void cpumla_avx512_gemv_t_bf16(const cpumla_weight *w, int64_t r0, int64_t nr, const float *x, float *y,
                              int64_t c0, int64_t c1);

/* avx512_e4m3.c: E4M3 weights the same way (codes decoded to bf16, activations bf16(x * scale) per
 * row block); cpumla_avx512_e4m3_tables fills their decode tables (once, from cpumla_fill_avx512). */
CPUMLA_INTERNAL void cpumla_avx512_e4m3_tables(void);
CPUMLA_INTERNAL void cpumla_avx512_gemv_e4m3(const cpumla_weight *w, const float *x, float *y, int64_t r0, int64_t r1);
CPUMLA_INTERNAL void cpumla_avx512_gemm_e4m3(const cpumla_weight *w, const float *x, int64_t ldx, int64_t n, float *y,
                            int64_t ldy, int64_t r0, int64_t r1);

/* CALL(NT) with NT a constant 1..6: a gemm microkernel instantiated per token count */
#define SWITCH_NT(nt, CALL)                                                                      \
    switch (nt) {                                                                                \
    case 6: CALL(6); break;                                                                      \
    case 5: CALL(5); break;                                                                      \
    case 4: CALL(4); break;                                                                      \
    case 3: CALL(3); break;                                                                      \
    case 2: CALL(2); break;                                                                      \
    default: CALL(1); break;                                                                     \
    }

/* [sum a, sum b, sum c, sum d] */
INLINE __m128 hsum4(__m512 a, __m512 b, __m512 c, __m512 d) {
    __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
    __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
    __m512 s = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(ab), _mm512_castps_pd(cd))),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(ab), _mm512_castps_pd(cd))));
    __m256 h = _mm256_add_ps(_mm512_castps512_ps256(s), _mm512_extractf32x8_ps(s, 1));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

/* activation operands (kernels.h): dst[k] = bf16(src[k] * s[k]) as fp32 for the lanes of m, 0 elsewhere: f32_to_bf16 (common.h) */
INLINE void bf16_mul16(const float *src, __m512 s, __mmask16 m, float *dst) {
    __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, src), s);
    __m512i u = _mm512_castps_si512(v);
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff),
                                                     _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))));
    r = _mm512_mask_or_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), u, _mm512_set1_epi32(0x00400000));
    _mm512_storeu_si512(dst, _mm512_and_si512(r, _mm512_set1_epi32((int)0xffff0000u)));
}

#endif
