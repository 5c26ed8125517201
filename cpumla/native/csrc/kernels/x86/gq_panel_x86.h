/* gq_panel_x86.h: what amx_gq.c (int8 tiles) and avx512vnni_gqp.c (vpdpbusd) add to the panels of
 * gq_panel_unpack_x86.h (16 weight rows unpacked once, codes stored + 128: the unsigned operand these
 * products multiply): the tokens' codes gathered once per call in groups of 16, VNNI order
 * (gqp_pack_x), and gqp_take, which adds a chunk's product to every (row, token) sum from the chunk's
 * exact int32 sums, in column order, each fp32 operation the spec's. Compiled by each with its own flags.
 * Include after gqk_unpack_x86.h and gqi_unpack_x86.h. */
#ifndef CPUMLA_GQ_PANEL_X86_H
#define CPUMLA_GQ_PANEL_X86_H
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include "core/gguf_q.h"
#include "core/quant.h"
#include "kernels/x86/amx_common.h"
#include "kernels/x86/gq_panel_unpack_x86.h"

#define GQP_ROUNDED(v) __asm__("" : "+v"(v))

/* the tokens' operands, xd and the halves' code sums of every group of 16 tokens (zero past n):
 * bq[(g nc + c) 128 + kk 16 + t] (dword kk of token t's chunk c: VNNI order), xd[(g nc + c) 16 + t], x0 / x1
 * likewise as fp32 (exact: |sum| <= 2032), each from its dwords (x0 NULL: no sums, for the types without
 * mins); xc (NULL: none) -128 times the halves' sums, xc[(g nc + c) 32 + 16 h + t], what a product over
 * codes flipped to unsigned (q + 128) starts from */
static void gqp_pack_x(const uint8_t *qx, int64_t n, int64_t K, int32_t *bq, float *xd, float *x0, float *x1,
                       int32_t *xc) {
    const int64_t nc = K / 32, ng = (n + 15) / 16, per = QX_BYTES(K);
    const __m512i idx = lanes_times((int32_t)per), ones = _mm512_set1_epi8(1);
    for (int64_t g = 0; g < ng; g++) {
        const int64_t nt = n - 16 * g < 16 ? n - 16 * g : 16;
        const __mmask16 m = (__mmask16)((1u << nt) - 1u);
        const uint8_t *base = qx + 16 * g * per;
        for (int64_t c = 0; c < nc; c++) {
            int32_t *t = bq + (g * nc + c) * 128;
            __m512i h[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
            for (int kk = 0; kk < 8; kk++) {
                const __m512i v = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), m, idx, base + 32 * c + 4 * kk, 1);
                _mm512_store_si512(t + 16 * kk, v);
                h[kk / 4] = _mm512_dpbusd_epi32(h[kk / 4], ones, v);
            }
            _mm512_store_ps(xd + (g * nc + c) * 16, _mm512_mask_i32gather_ps(_mm512_setzero_ps(), m, idx,
                                                                             base + qx_kp(K) + 4 * c, 1));
            if (x0) {
                _mm512_store_ps(x0 + (g * nc + c) * 16, _mm512_cvtepi32_ps(h[0]));
                _mm512_store_ps(x1 + (g * nc + c) * 16, _mm512_cvtepi32_ps(h[1]));
            }
            if (xc) {
                _mm512_store_si512(xc + (g * nc + c) * 32, _mm512_mullo_epi32(h[0], _mm512_set1_epi32(-128)));
                _mm512_store_si512(xc + (g * nc + c) * 32 + 16, _mm512_mullo_epi32(h[1], _mm512_set1_epi32(-128)));
            }
        }
    }
}

/* acc[i] (row i, a lane per token) += chunk k's product from its tile sums c0 (the chunk, or its first
 * half) and c1 (the second half), xv the tokens' xd, x0 / x1 their halves' code sums (fp32):
 *   a = (float)(s0 a0 + s1 a1): halves: s1 * a1 + (s0 * a0) by one FMA, s0 * a0 exact in fp32 (|s q x|
 *       over a half of 16 stays below 2^24 for every type: at most 128 * 32 * 127 * 16, Q6_K's), so the
 *       FMA rounds the exact sum once, as (float) of the int32 sum does; else s0 * (float)a0, one
 *       correctly rounded product of exact operands (and for unit scales, (float)a0 itself)
 *   p = a * (d * xd) - (float)(m0 x0 + m1 x1) * (dm * xd), the mins' sum formed the same way
 * each fp32 operation rounded once, as the spec rounds it */
static inline __attribute__((always_inline)) void gqp_take(const int32_t *c0, const int32_t *c1, const gqp_chunk *k,
                                                          const float *xd, const float *x0, const float *x1, int flags,
                                                          int has_min, __m512 acc[16]) {
    const int halves = flags & GQP_HALVES, unit = flags & GQP_UNIT;
    const __m512 xv = _mm512_load_ps(xd);
    __m512 x0v = _mm512_setzero_ps(), x1v = x0v;
    if (has_min) {
        x0v = _mm512_load_ps(x0);
        x1v = _mm512_load_ps(x1);
        if (!halves) x0v = _mm512_add_ps(x0v, x1v);     /* exact */
    }
#pragma GCC unroll 16      /* acc stays in registers */
    for (int i = 0; i < 16; i++) {
        __m512 f = _mm512_mul_ps(_mm512_set1_ps(k->d[i]), xv);
        GQP_ROUNDED(f);
        __m512 a = _mm512_cvtepi32_ps(_mm512_load_si512(c0 + 16 * i));
        if (halves) {
            __m512 e = _mm512_mul_ps(_mm512_set1_ps(k->s0[i]), a);
            GQP_ROUNDED(e);
            a = _mm512_fmadd_ps(_mm512_set1_ps(k->s1[i]), _mm512_cvtepi32_ps(_mm512_load_si512(c1 + 16 * i)), e);
        } else if (!unit) {
            a = _mm512_mul_ps(_mm512_set1_ps(k->s0[i]), a);
        }
        GQP_ROUNDED(a);
        __m512 p = _mm512_mul_ps(a, f);
        GQP_ROUNDED(p);
        if (has_min) {
            __m512 fm = _mm512_mul_ps(_mm512_set1_ps(k->dm[i]), xv);
            GQP_ROUNDED(fm);
            __m512 ms = _mm512_mul_ps(_mm512_set1_ps(k->m0[i]), x0v);
            GQP_ROUNDED(ms);
            if (halves) ms = _mm512_fmadd_ps(_mm512_set1_ps(k->m1[i]), x1v, ms);
            GQP_ROUNDED(ms);
            __m512 pm = _mm512_mul_ps(ms, fm);
            GQP_ROUNDED(pm);
            p = _mm512_sub_ps(p, pm);
            GQP_ROUNDED(p);
        }
        acc[i] = _mm512_add_ps(acc[i], p);
    }
}
#endif
