/* int_neon.h: the integer products (Q8 / Q4 / E2M1, quant.h) for aarch64 (semantics: scalar_q.c,
 * kernels.h), compiled twice: by neon_q.c at baseline armv8-a (widening multiplies vmull_s8 +
 * pairwise adds, exact in int32), and by neon_q_dot.c with NEON_Q_DOT defined and +dotprod (sdot: 4
 * int8 products into each int32 lane), which the neon level's fill takes when the CPU has ASIMDDP.
 * Activations in column order (quant.h; E2M1 per block [even | odd columns]). Q4 blocks are unpacked
 * to nibble - 8: low nibbles are the block's first 16 columns, high nibbles its last 16; E2M1's
 * nibbles go through a tbl to w2, low nibbles the even columns, high the odd (signed codes: no
 * correction), against its int16 activation codes' two int8 halves (quant.h: 256 times the sum over
 * the high bytes plus the sum over the low), and its E8M0 scales through e8m0_half.
 * Each block's sum is exact; pairwise adds put 4 blocks' sums in one vector, and the fp32 work (wd * xd,
 * the product, each rounded as kernels.h rounds it, and the sum) runs once per 4 blocks. gemv reads the
 * rows in order, one at a time (one stream, prefetched ahead); gemm keeps 4 rows in cache while the
 * tokens pass. gemv_t and dequant keep the scalar spec's. */
#ifndef CPUMLA_INT_NEON_H
#define CPUMLA_INT_NEON_H
#include <arm_neon.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#include "core/common.h"
#include "core/kernels.h"
#include "core/quant.h"

#ifdef NEON_Q_DOT
#define FN(name) name##_dot
#define WHO "neon (sdot)"
#else
#define FN(name) name
#define WHO "neon"
#endif
#define INLINE static inline __attribute__((always_inline))
/* the spec rounds each product: keep the compiler from fusing it into the add that follows */
#define ROUNDED(v) __asm__("" : "+w"(v))
#ifndef QPF_BYTES
#define QPF_BYTES 8192     /* gemv: software prefetch distance along the row stream */
#endif

/* int32 lanes summing to the dot product of 32 codes */
INLINE int32x4_t dot32(int8x16_t w0, int8x16_t w1, int8x16_t x0, int8x16_t x1) {
#ifdef NEON_Q_DOT
    return vdotq_s32(vdotq_s32(vdupq_n_s32(0), w0, x0), w1, x1);
#else
    int32x4_t a = vpaddlq_s16(vmull_s8(vget_low_s8(w0), vget_low_s8(x0)));
    a = vpadalq_s16(a, vmull_high_s8(w0, x0));
    a = vpadalq_s16(a, vmull_s8(vget_low_s8(w1), vget_low_s8(x1)));
    return vpadalq_s16(a, vmull_high_s8(w1, x1));
#endif
}

/* one block's 32 codes (int32, each fitting int8) at q, in column order (fp4: [even | odd]) */
INLINE void put_codes(const int32x4_t iv[8], int fp4, int8_t *q) {
    for (int k = 0; k < 8; k += 2) {
        int16x8_t h = vcombine_s16(vmovn_s32(iv[k]), vmovn_s32(iv[k + 1]));
        vst1_s8(q + 4 * k, vmovn_s16(h));
    }
    if (fp4) {
        const int8x16x2_t c = vld2q_s8(q);          /* de-interleave: even, odd columns */
        vst1q_s8(q, c.val[0]);
        vst1q_s8(q + 16, c.val[1]);
    }
}

/* codes in column order (E2M1: per block [even columns | odd columns], the order of its low and high
 * nibbles; its int16 codes split, high bytes here, low in qx_lo), xd per block, the int32 the block's
 * code sum */
static void FN(quant_x_neon)(int32_t wdtype, const float *x, int64_t K, void *qx) {
    const int fp4 = wdtype == CPUMLA_E2M1;
    int8_t *q = qx, *ql = qx_lo(qx, K);
    float *d = qx_d(qx, K);
    int32_t *s = qx_s(qx, K);
    const int64_t nb = K / QK, kp = qx_kp(K);
    for (int64_t b = 0; b < nb; b++) {
        float32x4_t v[8];
        for (int k = 0; k < 8; k++) v[k] = vld1q_f32(x + b * QK + 4 * k);
        /* quant.h's q_amax: an integer max over the bits of |x| */
        uint32x4_t m = vreinterpretq_u32_f32(vabsq_f32(v[0]));
        for (int k = 1; k < 8; k++) m = vmaxq_u32(m, vreinterpretq_u32_f32(vabsq_f32(v[k])));
        const float amax = f32_from_bits(vmaxvq_u32(m)), qmax = qact_max(wdtype), id = qact_id(amax, qmax);
        d[b] = qact_xd(amax, qmax);
        if (q_nonfinite(amax))                                          /* codes 0 */
            for (int k = 0; k < 8; k++) v[k] = vdupq_n_f32(0.0f);
        int32x4_t iv[8], sum = vdupq_n_s32(0);
        for (int k = 0; k < 8; k++) {
            iv[k] = vcvtnq_s32_f32(vmulq_n_f32(v[k], id));          /* nearest even */
            sum = vaddq_s32(sum, iv[k]);
        }
        s[b] = vaddvq_s32(sum);
        if (fp4) {          /* q = 256 * hi + lo: lo the sign-extended low byte (quant.h's q_lo, q_hi) */
            int32x4_t lv[8];
            for (int k = 0; k < 8; k++) {
                lv[k] = vshrq_n_s32(vshlq_n_s32(iv[k], 24), 24);
                iv[k] = vshrq_n_s32(vsubq_s32(iv[k], lv[k]), 8);
            }
            put_codes(lv, 1, ql + b * QK);
        }
        put_codes(iv, fp4, q + b * QK);
    }
    memset(q + K, 0, (size_t)(kp - K));
    if (fp4) memset(ql + K, 0, (size_t)(kp - K));
    for (int64_t b = nb; b < kp / QK; b++) { d[b] = 0.0f; s[b] = 0; }
}

/* the weight codes of block b of a row as two halves: Q8 columns 0-15 / 16-31, Q4 the nibbles - 8
 * (the same halves), E2M1 (q4 == 2) w2 of the even / odd columns (the low / high nibbles) */
INLINE void ld_block(const uint8_t *row, int64_t b, int q4, int8x16_t *w0, int8x16_t *w1) {
    if (q4 == 2) {
        const uint8x16_t v = vld1q_u8(row + 16 * b);
        const int8x16_t tab = vld1q_s8(e2m1_w2);
        *w0 = vqtbl1q_s8(tab, vandq_u8(v, vdupq_n_u8(15)));
        *w1 = vqtbl1q_s8(tab, vshrq_n_u8(v, 4));
        return;
    }
    if (!q4) {
        *w0 = vld1q_s8((const int8_t *)row + 32 * b);
        *w1 = vld1q_s8((const int8_t *)row + 32 * b + 16);
        return;
    }
    uint8x16_t v = vld1q_u8(row + 16 * b);
    *w0 = vsubq_s8(vreinterpretq_s8_u8(vandq_u8(v, vdupq_n_u8(15))), vdupq_n_s8(8));
    *w1 = vsubq_s8(vreinterpretq_s8_u8(vshrq_n_u8(v, 4)), vdupq_n_s8(8));
}

/* int32 lanes summing to block b's exact dot product with the codes xq (E2M1: the high bytes, 256
 * times, plus the low bytes xl) */
INLINE int32x4_t block_dot(const uint8_t *row, int64_t b, int q4, const int8_t *xq, const int8_t *xl) {
    int8x16_t w0, w1;
    ld_block(row, b, q4, &w0, &w1);
    const int32x4_t h = dot32(w0, w1, vld1q_s8(xq + b * QK), vld1q_s8(xq + b * QK + 16));
    if (q4 != 2) return h;
    return vaddq_s32(vshlq_n_s32(h, 8), dot32(w0, w1, vld1q_s8(xl + b * QK), vld1q_s8(xl + b * QK + 16)));
}

/* the exact sums of blocks b..b+3 of a row, in block order (pairwise adds of each block's lanes) */
INLINE int32x4_t sums4(const uint8_t *row, int64_t b, int q4, const int8_t *xq, const int8_t *xl) {
    int32x4_t d[4];
    for (int j = 0; j < 4; j++) d[j] = block_dot(row, b + j, q4, xq, xl);
    return vpaddq_s32(vpaddq_s32(d[0], d[1]), vpaddq_s32(d[2], d[3]));
}

/* y[i] = row r + i . xq for i < R: per 4 blocks, acc += (float)isum * (wd * xd) with each product
 * rounded as kernels.h rounds it; the last nb % 4 blocks one by one. pf: prefetch distance (0: none) */
INLINE void rows(const cpumla_weight *w, int64_t r, int64_t R, const uint8_t *xq, float *y, int q4, int64_t pf) {
    const int64_t K = w->cols, nb = K / QK, bb = q4 ? 16 : 32;
    const float *xd = qx_d(xq, K);
    const int8_t *xl = qx_lo(xq, K);
    for (int64_t i = 0; i < R; i++) {
        const uint8_t *rp = weight_row(w, r + i);
        const uint16_t *sp = (const uint16_t *)w->scale + (r + i) * w->scale_ld;
        const uint8_t *ep = q4 == 2 ? q_scale_row(w, r + i) : NULL;      /* E2M1: E8M0 bytes */
        float32x4_t acc = vdupq_n_f32(0.0f);
        int64_t b = 0;
        for (; b + 4 <= nb; b += 4) {
            if (pf) {
                for (int64_t l = 0; l < 4 * bb; l += 64) __builtin_prefetch(rp + b * bb + pf + l);
                if ((b & 31) == 0 && q4 != 2) __builtin_prefetch((const uint8_t *)(sp + b) + pf / (q4 ? 8 : 16));
            }
            const int32x4_t is = sums4(rp, b, q4, (const int8_t *)xq, xl);
            float32x4_t wd;
            if (q4 == 2) {
                const float e4[4] = {e8m0_half(ep[b]), e8m0_half(ep[b + 1]), e8m0_half(ep[b + 2]), e8m0_half(ep[b + 3])};
                wd = vld1q_f32(e4);
            } else {
                wd = vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(sp + b)));
            }
            float32x4_t f = vmulq_f32(wd, vld1q_f32(xd + b));
            ROUNDED(f);
            float32x4_t p = vmulq_f32(vcvtq_f32_s32(is), f);
            ROUNDED(p);
            acc = vaddq_f32(acc, p);
        }
        float tail = 0.0f;
        for (; b < nb; b++) {
            float f = (q4 == 2 ? e8m0_half(ep[b]) : f16_to_f32(sp[b])) * xd[b];
            ROUNDED(f);
            float p = (float)vaddvq_s32(block_dot(rp, b, q4, (const int8_t *)xq, xl)) * f;
            ROUNDED(p);
            tail += p;
        }
        y[i] = vaddvq_f32(acc) + tail;
    }
}

static void FN(gemm_q_neon)(const cpumla_weight *w, const void *qx, int64_t n, float *y, int64_t ldy, int64_t r0,
                            int64_t r1) {
    const int64_t per = QX_BYTES(w->cols);
    const int q4 = w->dtype == CPUMLA_Q4 ? 1 : w->dtype == CPUMLA_E2M1 ? 2 : 0;
    if (n == 1) {          /* one token: the rows in order, one stream prefetched ahead */
        if (q4 == 2) rows(w, r0, r1 - r0, qx, y, 2, QPF_BYTES);
        else if (q4) rows(w, r0, r1 - r0, qx, y, 1, QPF_BYTES);
        else rows(w, r0, r1 - r0, qx, y, 0, QPF_BYTES);
        return;
    }
    for (int64_t r = r0; r < r1; r += 4) {     /* 4 rows stay in cache while the tokens pass */
        const int R = r1 - r < 4 ? (int)(r1 - r) : 4;
        for (int64_t t = 0; t < n; t++) {
            const uint8_t *xq = (const uint8_t *)qx + t * per;
            float *yt = y + t * ldy + (r - r0);
            if (q4 == 2) rows(w, r, R, xq, yt, 2, 0);
            else if (q4) rows(w, r, R, xq, yt, 1, 0);
            else rows(w, r, R, xq, yt, 0, 0);
        }
    }
}

void FN(cpumla_fill_neon_q)(cpumla_kernels *k) {
    k->quant_x = FN(quant_x_neon);
    k->gemm_q = FN(gemm_q_neon);
    for (int f = CPUMLA_Q8; f <= CPUMLA_Q4; f++) k->who_fmt[K_GEMV][f] = k->who_fmt[K_GEMM][f] = WHO;
    k->who_fmt[K_GEMV][CPUMLA_E2M1] = k->who_fmt[K_GEMM][CPUMLA_E2M1] = E2M1_WHO(WHO);
}

#endif
