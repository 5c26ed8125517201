/* gq_neon.h: the neon level's GGUF gemms (gguf_q.h), compiled twice: by neon_gq.c at baseline armv8-a
 * (vmull_s8 + pairwise adds) and by neon_gq_dot.c with NEON_GQ_DOT defined and +dotprod (sdot), which
 * the level's fill takes when the CPU has ASIMDDP. Both files are built with -ffp-contract=off: every
 * fp32 multiply and subtract below is rounded once, as the spec's.
 * Q8_0 reads its blocks in place; the other types unpack 256 columns at a time with the spec's
 * gq_unpack, each unpacked unit serving up to GQ_NT tokens. The half sums of a chunk (16 int8 products
 * into int32 lanes) are exact; per 4 chunks the int32 sums s0 a0 + s1 a1 (and m0 x0 + m1 x1), their
 * fp32 products with d * xd (dm * xd) in one vector, then added to the row's sum in column order. */
#ifndef CPUMLA_GQ_NEON_H
#define CPUMLA_GQ_NEON_H
#include <arm_neon.h>
#include <stdint.h>
#include "core/gguf_q.h"
#include "core/kernels.h"
#include "core/quant.h"

#ifdef NEON_GQ_DOT
#define GQFN(name) name##_dot
#else
#define GQFN(name) name
#endif
#define GQ_INLINE static inline __attribute__((always_inline))
#define GQ_NT 8            /* tokens served by one unpacked unit */

CPUMLA_INTERNAL void cpumla_fill_neon_gq_dot(cpumla_kernels *k);    /* neon_gq_dot.c */

/* int32 lanes summing to the dot product of 16 codes (|w| <= 128, |x| <= 127: exact) */
GQ_INLINE int32x4_t gq_dot16(int8x16_t w, int8x16_t x) {
#ifdef NEON_GQ_DOT
    return vdotq_s32(vdupq_n_s32(0), w, x);
#else
    return vpadalq_s16(vpaddlq_s16(vmull_s8(vget_low_s8(w), vget_low_s8(x))), vmull_high_s8(w, x));
#endif
}

/* int32 lanes summing to 16 codes */
GQ_INLINE int32x4_t gq_sum16(int8x16_t x) { return vpaddlq_s16(vpaddlq_s8(x)); }

/* the sums of 4 lane vectors, in order */
GQ_INLINE int32x4_t gq_sums4(const int32x4_t v[4]) {
    return vpaddq_s32(vpaddq_s32(v[0], v[1]), vpaddq_s32(v[2], v[3]));
}

/* adds the 4 products of p to acc, in order */
GQ_INLINE float gq_add4(float acc, float32x4_t p) {
    acc += vgetq_lane_f32(p, 0);
    acc += vgetq_lane_f32(p, 1);
    acc += vgetq_lane_f32(p, 2);
    acc += vgetq_lane_f32(p, 3);
    return acc;
}

/* ---- Q8_0: blocks in place ---- */
static float gq8_row_neon(const uint8_t *row, int64_t nb, const int8_t *xq, const float *xd) {
    float acc = 0.0f;
    int64_t b = 0;
    for (; b + 4 <= nb; b += 4) {
        int32x4_t s[4];
        uint16_t h[4];
        for (int j = 0; j < 4; j++) {
            const uint8_t *blk = row + (b + j) * GQ8_0_BYTES;
            const int8_t *x = xq + (b + j) * QK;
            s[j] = vaddq_s32(gq_dot16(vld1q_s8((const int8_t *)blk + 2), vld1q_s8(x)),
                             gq_dot16(vld1q_s8((const int8_t *)blk + 18), vld1q_s8(x + 16)));
            h[j] = (uint16_t)(blk[0] | blk[1] << 8);
        }
        const float32x4_t d = vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(h)));
        acc = gq_add4(acc, vmulq_f32(vcvtq_f32_s32(gq_sums4(s)), vmulq_f32(d, vld1q_f32(xd + b))));
    }
    for (; b < nb; b++) {
        const uint8_t *blk = row + b * GQ8_0_BYTES;
        const int8_t *x = xq + b * QK;
        const int32x4_t s = vaddq_s32(gq_dot16(vld1q_s8((const int8_t *)blk + 2), vld1q_s8(x)),
                                      gq_dot16(vld1q_s8((const int8_t *)blk + 18), vld1q_s8(x + 16)));
        acc += gq_block_product(vaddvq_s32(s), gq8_scale(blk), xd[b]);
    }
    return acc;
}

static void GQFN(gemm_gq8_neon)(const cpumla_weight *w, const void *qx, int64_t n, float *y, int64_t ldy,
                                int64_t r0, int64_t r1) {
    const int64_t K = w->cols, nb = K / QK, per = QX_BYTES(K);
    const uint8_t *base = w->data;
    if (n == 1) {          /* one token: the rows in order, the next ones prefetched */
        const int8_t *xq = qx;
        const float *xd = qx_d(qx, K);
        for (int64_t r = r0; r < r1; r++) {
            if (r + 2 < r1)
                for (int64_t l = 0; l < w->row_bytes; l += 64) __builtin_prefetch(base + (r + 2) * w->row_bytes + l);
            y[r - r0] = gq8_row_neon(base + r * w->row_bytes, nb, xq, xd);
        }
        return;
    }
    for (int64_t r = r0; r < r1; r += 4) {     /* 4 rows stay in cache while the tokens pass */
        const int64_t R = r1 - r < 4 ? r1 - r : 4;
        for (int64_t t = 0; t < n; t++) {
            const uint8_t *xt = (const uint8_t *)qx + t * per;
            for (int64_t i = 0; i < R; i++)
                y[t * ldy + (r + i - r0)] = gq8_row_neon(base + (r + i) * w->row_bytes, nb, (const int8_t *)xt, qx_d(xt, K));
        }
    }
}

/* ---- the other types: gq_unpack's units ---- */
/* acc plus the products of the n chunks of u with the codes x (xd per chunk), in column order */
GQ_INLINE float gq_unit_dot(const gq_unpacked *u, int n, int has_min, const int8_t *x, const float *xd, float acc) {
    int c = 0;
    for (; c + 4 <= n; c += 4) {
        int32x4_t h0[4], h1[4], g0[4], g1[4];
        for (int j = 0; j < 4; j++) {
            const int8_t *q = u->q + 32 * (c + j), *xc = x + 32 * (c + j);
            const int8x16_t x0 = vld1q_s8(xc), x1 = vld1q_s8(xc + 16);
            h0[j] = gq_dot16(vld1q_s8(q), x0);
            h1[j] = gq_dot16(vld1q_s8(q + 16), x1);
            if (has_min) { g0[j] = gq_sum16(x0); g1[j] = gq_sum16(x1); }
        }
        const int16x4x2_t s = vld2_s16(u->s + 2 * c);            /* s[2c], s[2c + 2] ..; s[2c + 1] .. */
        const int32x4_t isum = vmlaq_s32(vmulq_s32(vmovl_s16(s.val[0]), gq_sums4(h0)), vmovl_s16(s.val[1]), gq_sums4(h1));
        const float32x4_t xdv = vld1q_f32(xd + c);
        float32x4_t p = vmulq_f32(vcvtq_f32_s32(isum), vmulq_f32(vld1q_f32(u->d + c), xdv));
        if (has_min) {
            const int16x4x2_t m = vld2_s16(u->m + 2 * c);
            const int32x4_t msum = vmlaq_s32(vmulq_s32(vmovl_s16(m.val[0]), gq_sums4(g0)), vmovl_s16(m.val[1]), gq_sums4(g1));
            p = vsubq_f32(p, vmulq_f32(vcvtq_f32_s32(msum), vmulq_f32(vld1q_f32(u->dm + c), xdv)));
        }
        acc = gq_add4(acc, p);
    }
    for (; c < n; c++) {
        const int8_t *q = u->q + 32 * c, *xc = x + 32 * c;
        const int8x16_t x0 = vld1q_s8(xc), x1 = vld1q_s8(xc + 16);
        const int32_t a0 = vaddvq_s32(gq_dot16(vld1q_s8(q), x0)), a1 = vaddvq_s32(gq_dot16(vld1q_s8(q + 16), x1));
        const int32_t s0 = has_min ? vaddvq_s32(gq_sum16(x0)) : 0, s1 = has_min ? vaddvq_s32(gq_sum16(x1)) : 0;
        acc += gq_chunk_product(u, c, has_min, a0, a1, s0, s1, xd[c]);
    }
    return acc;
}

GQ_INLINE void gq_rows_unpack(const cpumla_weight *w, const void *qx, int64_t n, float *y, int64_t ldy, int64_t r0,
                              int64_t r1, int has_min) {
    const int64_t K = w->cols, per = QX_BYTES(K);
    const uint8_t *base = w->data;
    gq_unpacked u;
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *row = base + r * w->row_bytes;
        if (r + 1 < r1)
            for (int64_t l = 0; l < w->row_bytes; l += 64) __builtin_prefetch(row + w->row_bytes + l);
        for (int64_t t0 = 0; t0 < n; t0 += GQ_NT) {
            const int nt = n - t0 < GQ_NT ? (int)(n - t0) : GQ_NT;
            float acc[GQ_NT] = {0};
            for (int64_t c0 = 0; c0 < K; c0 += 256) {
                const int nc = K - c0 >= 256 ? 8 : (int)((K - c0) / 32);
                gq_unpack(w->dtype, row, c0, nc, &u);
                for (int i = 0; i < nt; i++) {
                    const uint8_t *xt = (const uint8_t *)qx + (t0 + i) * per;
                    acc[i] = gq_unit_dot(&u, nc, has_min, (const int8_t *)xt + c0, qx_d(xt, K) + c0 / 32, acc[i]);
                }
            }
            for (int i = 0; i < nt; i++) y[(t0 + i) * ldy + (r - r0)] = acc[i];
        }
    }
}

static void GQFN(gemm_gq_any_neon)(const cpumla_weight *w, const void *qx, int64_t n, float *y, int64_t ldy,
                                   int64_t r0, int64_t r1) {
    if (gq_info(w->dtype)->has_min) gq_rows_unpack(w, qx, n, y, ldy, r0, r1, 1);
    else gq_rows_unpack(w, qx, n, y, ldy, r0, r1, 0);
}

static void GQFN(fill_gq_neon)(cpumla_kernels *k) {
    k->gemm_gq[0] = GQFN(gemm_gq8_neon);
    for (int t = 1; t < GQ_N; t++) k->gemm_gq[t] = GQFN(gemm_gq_any_neon);
    for (int f = CPUMLA_Q8_0; f <= CPUMLA_MXFP4; f++) k->who_fmt[K_GEMV][f] = k->who_fmt[K_GEMM][f] = "neon";
}

#endif
