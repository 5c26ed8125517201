/* avx512_dpbf16.h: the avx512 level's vdpbf16ps building blocks, shared by avx512.c (BF16 weights)
 * and avx512_e4m3.c (E4M3 weights decoded to bf16), both compiled with that level's flags: the gemm
 * blocking, the bf16 loads and the 4-row x NT-token microkernel. static inline only. */
#ifndef CPUMLA_AVX512_DPBF16_H
#define CPUMLA_AVX512_DPBF16_H
#include <immintrin.h>
#include <stdint.h>
#include "kernels/x86/avx512_common.h"

#define BG_KC 2048    /* gemm: columns per chunk (a multiple of 32) */
#define BG_MP 64      /* gemm: rows per panel (a multiple of 4) */
#define BG_NT 6       /* gemm: tokens per microkernel */

/* lanes [0, n) of 32 (bf16 elements), as tail16 */
INLINE __mmask32 mask32(int64_t n) { return n >= 32 ? 0xffffffffu : n <= 0 ? 0 : (__mmask32)((1u << n) - 1u); }

INLINE __m512bh ld_bh(const uint16_t *p) { return (__m512bh)_mm512_loadu_si512(p); }
INLINE __m512bh ld_bh_tail(const uint16_t *p, int64_t n) { return (__m512bh)_mm512_maskz_loadu_epi16(mask32(n), p); }

/* y[t*ldy + i] (+)= sum_{k < kc} rp[i][k] * xb[t*ldb + k] for i < mr, t < NT; xb is zero past kc
 * (up to the next multiple of 32), the rows are read with a mask there. rp[i] for i >= mr may repeat
 * a valid row: those sums are not stored. */
INLINE void gemm_micro(const uint16_t *const rp[4], const uint16_t *xb, int64_t ldb, int64_t kc, float *y,
                       int64_t ldy, int mr, int NT, int accumulate) {
    __m512 acc[BG_NT][4];
    UNROLL for (int t = 0; t < NT; t++)
        UNROLL for (int i = 0; i < 4; i++) acc[t][i] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= kc; k += 32) {
        __m512bh wv[4];
        UNROLL for (int i = 0; i < 4; i++) wv[i] = ld_bh(rp[i] + k);
        UNROLL for (int t = 0; t < NT; t++) {
            __m512bh xv = ld_bh(xb + t * ldb + k);
            UNROLL for (int i = 0; i < 4; i++) acc[t][i] = _mm512_dpbf16_ps(acc[t][i], wv[i], xv);
        }
    }
    if (k < kc) {
        __m512bh wv[4];
        UNROLL for (int i = 0; i < 4; i++) wv[i] = ld_bh_tail(rp[i] + k, kc - k);
        UNROLL for (int t = 0; t < NT; t++) {
            __m512bh xv = ld_bh(xb + t * ldb + k);
            UNROLL for (int i = 0; i < 4; i++) acc[t][i] = _mm512_dpbf16_ps(acc[t][i], wv[i], xv);
        }
    }
    __mmask8 m = (__mmask8)((1u << mr) - 1u);
    UNROLL for (int t = 0; t < NT; t++) {
        __m128 s = hsum4(acc[t][0], acc[t][1], acc[t][2], acc[t][3]);
        if (accumulate) s = _mm_add_ps(s, _mm_maskz_loadu_ps(m, y + t * ldy));
        _mm_mask_storeu_ps(y + t * ldy, m, s);
    }
}

#endif
