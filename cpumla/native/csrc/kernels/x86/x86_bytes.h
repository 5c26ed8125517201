/* x86_bytes.h: the byte work the x86 levels' FP4 packing shares (avx2_gemm.c, avx512f_gemm.c), SSE2 and
 * SSSE3 only, so that it compiles under either file's flags. static inline only. */
#ifndef CPUMLA_X86_BYTES_H
#define CPUMLA_X86_BYTES_H
#include <immintrin.h>
#include "core/quant.h"

/* o[k] = byte k of r[0], ..., r[15] (a 16 x 16 byte transpose in four unpack stages) */
static inline __attribute__((always_inline)) void tr16x16_bytes(const __m128i r[16], __m128i o[16]) {
    __m128i a[16], bq[4][4], c[8][2];
    for (int p = 0; p < 8; p++) {           /* a[8h + p]: words (row 2p, row 2p + 1) of bytes 8h .. 8h + 7 */
        a[p] = _mm_unpacklo_epi8(r[2 * p], r[2 * p + 1]);
        a[8 + p] = _mm_unpackhi_epi8(r[2 * p], r[2 * p + 1]);
    }
    for (int h = 0; h < 2; h++)             /* bq[kq][q]: dwords rows 4q .. 4q + 3 of bytes 4kq .. 4kq + 3 */
        for (int q = 0; q < 4; q++) {
            bq[2 * h][q] = _mm_unpacklo_epi16(a[8 * h + 2 * q], a[8 * h + 2 * q + 1]);
            bq[2 * h + 1][q] = _mm_unpackhi_epi16(a[8 * h + 2 * q], a[8 * h + 2 * q + 1]);
        }
    for (int kq = 0; kq < 4; kq++)          /* c[kp][s]: qwords rows 8s .. 8s + 7 of bytes 2kp, 2kp + 1 */
        for (int s = 0; s < 2; s++) {
            c[2 * kq][s] = _mm_unpacklo_epi32(bq[kq][2 * s], bq[kq][2 * s + 1]);
            c[2 * kq + 1][s] = _mm_unpackhi_epi32(bq[kq][2 * s], bq[kq][2 * s + 1]);
        }
    for (int kp = 0; kp < 8; kp++) {
        o[2 * kp] = _mm_unpacklo_epi64(c[kp][0], c[kp][1]);
        o[2 * kp + 1] = _mm_unpackhi_epi64(c[kp][0], c[kp][1]);
    }
}

/* block b's 16 code bytes of rows r .. r + 15 into v (rows from nr on: zero, code 0, w2 = 0) and
 * their scales as e8m0_half into wd[0 .. 16) (0 from nr on) */
static inline __attribute__((always_inline)) void fp4_block_rows(const cpumla_weight *w, int64_t r, int nr, int64_t b,
                                                                 __m128i v[16], float *wd) {
    for (int i = 0; i < 16; i++) {
        if (i < nr) {
            v[i] = _mm_loadu_si128((const __m128i *)(weight_row(w, r + i) + b * 16));
            wd[i] = e8m0_half(((const uint8_t *)q_scale_row(w, r + i))[b]);
        } else {
            v[i] = _mm_setzero_si128();
            wd[i] = 0.0f;
        }
    }
}

/* the w2 (quant.h's e2m1_w2, int8) of the low and of the high nibbles of 16 code bytes */
static inline __attribute__((always_inline)) void e2m1_w2_bytes(__m128i c, __m128i *lo, __m128i *hi) {
    const __m128i tab = _mm_loadu_si128((const __m128i *)e2m1_w2), m4 = _mm_set1_epi8(15);
    *lo = _mm_shuffle_epi8(tab, _mm_and_si128(c, m4));
    *hi = _mm_shuffle_epi8(tab, _mm_and_si128(_mm_srli_epi16(c, 4), m4));
}

#endif
