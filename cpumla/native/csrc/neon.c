/* neon.c: aarch64 ASIMD kernels, baseline armv8-a (fp32 FMA, fp16 <-> fp32 conversion).
 *
 * Same semantics as scalar.c (the spec); only the order of fp32 additions differs.
 *   FP8 e4m3 is widened through fp16: the bits ((b & 0x7f) << 7) | ((b & 0x80) << 8) are an fp16
 *   equal to value * 2^-8 exactly (subnormals included), so the block scale is multiplied by 256.
 *   FP4 e2m1 goes through a byte table of 2 * value (all integers), so the block scale is halved.
 *   Both factors are powers of two: scale applied once per block, as scalar.c does. */
#include <arm_neon.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#include "common.h"
#include "kernels.h"

const char cpumla_flags_neon[] = CPUMLA_FLAGS;

/* ---- element loads ---------------------------------------------------------------------------- */
static inline float32x4_t ld_bf16(const uint16_t *p) {
    return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(p), 16));
}

/* bf16_round (common.h) of 4 floats: the activations of a BF16 product (kernels.h) */
static inline float32x4_t bf16_round_q(float32x4_t v) {
    uint32x4_t u = vreinterpretq_u32_f32(v);
    uint32x4_t odd = vandq_u32(vshrq_n_u32(u, 16), vdupq_n_u32(1));
    uint32x4_t rn = vaddq_u32(u, vaddq_u32(vdupq_n_u32(0x7fff), odd));
    uint32x4_t nan = vcgtq_u32(vandq_u32(u, vdupq_n_u32(0x7fffffff)), vdupq_n_u32(0x7f800000));
    uint32x4_t qn = vorrq_u32(u, vdupq_n_u32(0x00400000));
    return vreinterpretq_f32_u32(vandq_u32(vbslq_u32(nan, qn, rn), vdupq_n_u32(0xffff0000u)));
}

static inline float32x4_t ld_f16(const uint16_t *p) {
    return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p)));
}

/* 8 e4m3 bytes -> fp16 bit patterns of value * 2^-8 */
static inline uint16x8_t e4m3_as_f16(uint8x8_t b) {
    int16x8_t s = vmovl_s8(vreinterpret_s8_u8(b));          /* bits 7..15 = sign */
    return vandq_u16(vreinterpretq_u16_s16(vshlq_n_s16(s, 7)), vdupq_n_u16(0xbfff));
}

/* 16 e4m3 bytes -> 4 x 4 floats (value * 2^-8) */
static inline void ld_e4m3_16(const uint8_t *p, float32x4_t v[4]) {
    uint8x16_t b = vld1q_u8(p);
    float16x8_t lo = vreinterpretq_f16_u16(e4m3_as_f16(vget_low_u8(b)));
    float16x8_t hi = vreinterpretq_f16_u16(e4m3_as_f16(vget_high_u8(b)));
    v[0] = vcvt_f32_f16(vget_low_f16(lo));
    v[1] = vcvt_high_f32_f16(lo);
    v[2] = vcvt_f32_f16(vget_low_f16(hi));
    v[3] = vcvt_high_f32_f16(hi);
}

static inline float32x4_t ld_e4m3_4(const uint8_t *p) {
    uint32_t u;
    memcpy(&u, p, 4);
    uint8x8_t b = vreinterpret_u8_u32(vdup_n_u32(u));
    return vcvt_f32_f16(vget_low_f16(vreinterpretq_f16_u16(e4m3_as_f16(b))));
}

/* e4m3 -> value * 2^-8, scalar tails (matches the vector path exactly) */
static inline float e4m3_scaled(uint8_t b) { return e4m3_to_f32(b) * 0.00390625f; }

/* 2 * e2m1 value, indexed by the 4-bit code */
static const int8_t e2m1_x2[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

static inline float e2m1_x2_at(const uint8_t *row, int64_t c) {
    uint8_t b = row[c >> 1];
    return (float)e2m1_x2[(c & 1) ? (b >> 4) : (b & 15)];
}

static inline void s8x16_to_f32(int8x16_t v, float32x4_t o[4]) {
    int16x8_t lo = vmovl_s8(vget_low_s8(v)), hi = vmovl_s8(vget_high_s8(v));
    o[0] = vcvtq_f32_s32(vmovl_s16(vget_low_s16(lo)));
    o[1] = vcvtq_f32_s32(vmovl_s16(vget_high_s16(lo)));
    o[2] = vcvtq_f32_s32(vmovl_s16(vget_low_s16(hi)));
    o[3] = vcvtq_f32_s32(vmovl_s16(vget_high_s16(hi)));
}

/* 16 bytes = 32 e2m1 columns -> even columns ev[0..3] and odd columns od[0..3], each 2 * value */
static inline void ld_e2m1_32(const uint8_t *p, float32x4_t ev[4], float32x4_t od[4]) {
    int8x16_t tab = vld1q_s8(e2m1_x2);
    uint8x16_t b = vld1q_u8(p);
    s8x16_to_f32(vqtbl1q_s8(tab, vandq_u8(b, vdupq_n_u8(15))), ev);
    s8x16_to_f32(vqtbl1q_s8(tab, vshrq_n_u8(b, 4)), od);
}

/* Block scale with the format's fold: 256 for e4m3 (fp16 trick), 0.5 for e2m1 (table of 2x). */
static inline float block_scale(const cpumla_weight *w, int64_t r, int64_t c) {
    float s = weight_scale(w, r, c);
    return w->dtype == CPUMLA_E4M3 ? s * 256.0f : s * 0.5f;
}

/* ---- dot products of one row segment with x --------------------------------------------------- */
static float dot_f32(const float *a, const float *x, int64_t n) {
    float32x4_t s0 = vdupq_n_f32(0), s1 = s0, s2 = s0, s3 = s0;
    int64_t c = 0;
    for (; c + 16 <= n; c += 16) {
        s0 = vfmaq_f32(s0, vld1q_f32(a + c), vld1q_f32(x + c));
        s1 = vfmaq_f32(s1, vld1q_f32(a + c + 4), vld1q_f32(x + c + 4));
        s2 = vfmaq_f32(s2, vld1q_f32(a + c + 8), vld1q_f32(x + c + 8));
        s3 = vfmaq_f32(s3, vld1q_f32(a + c + 12), vld1q_f32(x + c + 12));
    }
    for (; c + 4 <= n; c += 4) s0 = vfmaq_f32(s0, vld1q_f32(a + c), vld1q_f32(x + c));
    float s = vaddvq_f32(vaddq_f32(vaddq_f32(s0, s1), vaddq_f32(s2, s3)));
    for (; c < n; c++) s += a[c] * x[c];
    return s;
}

static float dot_bf16(const uint16_t *a, const float *x, int64_t n) {
    float32x4_t s0 = vdupq_n_f32(0), s1 = s0, s2 = s0, s3 = s0;
    int64_t c = 0;
    for (; c + 16 <= n; c += 16) {
        s0 = vfmaq_f32(s0, ld_bf16(a + c), bf16_round_q(vld1q_f32(x + c)));
        s1 = vfmaq_f32(s1, ld_bf16(a + c + 4), bf16_round_q(vld1q_f32(x + c + 4)));
        s2 = vfmaq_f32(s2, ld_bf16(a + c + 8), bf16_round_q(vld1q_f32(x + c + 8)));
        s3 = vfmaq_f32(s3, ld_bf16(a + c + 12), bf16_round_q(vld1q_f32(x + c + 12)));
    }
    for (; c + 4 <= n; c += 4) s0 = vfmaq_f32(s0, ld_bf16(a + c), bf16_round_q(vld1q_f32(x + c)));
    float s = vaddvq_f32(vaddq_f32(vaddq_f32(s0, s1), vaddq_f32(s2, s3)));
    for (; c < n; c++) s += bf16_to_f32(a[c]) * bf16_round(x[c]);
    return s;
}

static float dot_f16(const uint16_t *a, const float *x, int64_t n) {
    float32x4_t s0 = vdupq_n_f32(0), s1 = s0, s2 = s0, s3 = s0;
    int64_t c = 0;
    for (; c + 16 <= n; c += 16) {
        s0 = vfmaq_f32(s0, ld_f16(a + c), vld1q_f32(x + c));
        s1 = vfmaq_f32(s1, ld_f16(a + c + 4), vld1q_f32(x + c + 4));
        s2 = vfmaq_f32(s2, ld_f16(a + c + 8), vld1q_f32(x + c + 8));
        s3 = vfmaq_f32(s3, ld_f16(a + c + 12), vld1q_f32(x + c + 12));
    }
    for (; c + 4 <= n; c += 4) s0 = vfmaq_f32(s0, ld_f16(a + c), vld1q_f32(x + c));
    float s = vaddvq_f32(vaddq_f32(vaddq_f32(s0, s1), vaddq_f32(s2, s3)));
    for (; c < n; c++) s += f16_to_f32(a[c]) * x[c];
    return s;
}

/* sum of e4m3(a[c]) * 2^-8 * x[c] */
static float dot_e4m3(const uint8_t *a, const float *x, int64_t n) {
    float32x4_t s0 = vdupq_n_f32(0), s1 = s0, s2 = s0, s3 = s0;
    int64_t c = 0;
    for (; c + 16 <= n; c += 16) {
        float32x4_t v[4];
        ld_e4m3_16(a + c, v);
        s0 = vfmaq_f32(s0, v[0], vld1q_f32(x + c));
        s1 = vfmaq_f32(s1, v[1], vld1q_f32(x + c + 4));
        s2 = vfmaq_f32(s2, v[2], vld1q_f32(x + c + 8));
        s3 = vfmaq_f32(s3, v[3], vld1q_f32(x + c + 12));
    }
    for (; c + 4 <= n; c += 4) s0 = vfmaq_f32(s0, ld_e4m3_4(a + c), vld1q_f32(x + c));
    float s = vaddvq_f32(vaddq_f32(vaddq_f32(s0, s1), vaddq_f32(s2, s3)));
    for (; c < n; c++) s += e4m3_scaled(a[c]) * x[c];
    return s;
}

/* sum over columns [c0, c1) of row of 2 * e2m1(c) * x[c] (x indexed by column) */
static float dot_e2m1(const uint8_t *row, const float *x, int64_t c0, int64_t c1) {
    float s = 0.0f;
    int64_t c = c0;
    if (c & 1) { s += e2m1_x2_at(row, c) * x[c]; c++; }
    float32x4_t a0 = vdupq_n_f32(0), a1 = a0, a2 = a0, a3 = a0;
    for (; c + 32 <= c1; c += 32) {
        float32x4_t ev[4], od[4];
        ld_e2m1_32(row + (c >> 1), ev, od);
        for (int k = 0; k < 4; k++) {   /* columns c + 8k .. c + 8k + 7 */
            float32x4x2_t xv = vld2q_f32(x + c + 8 * k);
            a0 = vfmaq_f32(a0, ev[k], xv.val[0]);
            a1 = vfmaq_f32(a1, od[k], xv.val[1]);
        }
    }
    s += vaddvq_f32(vaddq_f32(vaddq_f32(a0, a1), vaddq_f32(a2, a3)));
    for (; c < c1; c++) s += e2m1_x2_at(row, c) * x[c];
    return s;
}

static float row_dot(const cpumla_weight *w, int64_t r, const float *x) {
    const uint8_t *row = weight_row(w, r);
    int64_t n = w->cols;
    switch (w->dtype) {
    case CPUMLA_F32: return dot_f32((const float *)row, x, n);
    case CPUMLA_BF16: return dot_bf16((const uint16_t *)row, x, n);
    case CPUMLA_F16: return dot_f16((const uint16_t *)row, x, n);
    case CPUMLA_E4M3:
    case CPUMLA_E2M1: {
        float acc = 0.0f;
        for (int64_t c0 = 0; c0 < n; c0 += w->block_cols) {
            int64_t c1 = c0 + w->block_cols < n ? c0 + w->block_cols : n;
            float part = w->dtype == CPUMLA_E4M3 ? dot_e4m3(row + c0, x + c0, c1 - c0)
                                                 : dot_e2m1(row, x, c0, c1);
            acc += part * block_scale(w, r, c0);
        }
        return acc;
    }
    default: return NAN;
    }
}

static void gemv_neon(const cpumla_weight *w, const float *x, float *y, int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; r++) y[r - r0] = row_dot(w, r, x);
}

/* ---- gemm: decode a 4-row panel once, reuse it for 4 tokens at a time --------------------------- */
#define GEMM_CH 256   /* columns decoded per step */

/* out[c] = W[r, c0 + c] for c < n, unscaled (e4m3: value * 2^-8, e2m1: 2 * value) */
static void decode_unscaled(const cpumla_weight *w, int64_t r, int64_t c0, int64_t n, float *out) {
    const uint8_t *row = weight_row(w, r);
    int64_t c = 0;
    switch (w->dtype) {
    case CPUMLA_F32:
        memcpy(out, (const float *)row + c0, (size_t)n * sizeof(float));
        return;
    case CPUMLA_BF16: {
        const uint16_t *p = (const uint16_t *)row + c0;
        for (; c + 4 <= n; c += 4) vst1q_f32(out + c, ld_bf16(p + c));
        for (; c < n; c++) out[c] = bf16_to_f32(p[c]);
        return;
    }
    case CPUMLA_F16: {
        const uint16_t *p = (const uint16_t *)row + c0;
        for (; c + 4 <= n; c += 4) vst1q_f32(out + c, ld_f16(p + c));
        for (; c < n; c++) out[c] = f16_to_f32(p[c]);
        return;
    }
    case CPUMLA_E4M3: {
        const uint8_t *p = row + c0;
        for (; c + 16 <= n; c += 16) {
            float32x4_t v[4];
            ld_e4m3_16(p + c, v);
            for (int k = 0; k < 4; k++) vst1q_f32(out + c + 4 * k, v[k]);
        }
        for (; c < n; c++) out[c] = e4m3_scaled(p[c]);
        return;
    }
    case CPUMLA_E2M1:
        if (c0 & 1) { out[0] = e2m1_x2_at(row, c0); c = 1; }
        for (; c + 32 <= n; c += 32) {
            float32x4_t ev[4], od[4];
            ld_e2m1_32(row + ((c0 + c) >> 1), ev, od);
            for (int k = 0; k < 4; k++) {
                float32x4x2_t v = {{ev[k], od[k]}};
                vst2q_f32(out + c + 8 * k, v);
            }
        }
        for (; c < n; c++) out[c] = e2m1_x2_at(row, c0 + c);
        return;
    default:
        for (; c < n; c++) out[c] = NAN;
    }
}

/* acc[i][t] += sum_c wp[i][c] * xp[t][c], 4 rows x 4 tokens; returns sums as floats in part */
static void micro_4x4(const float *const wp[4], const float *const xp[4], int64_t n, float part[4][4]) {
    float32x4_t a[4][4];
    for (int i = 0; i < 4; i++)
        for (int t = 0; t < 4; t++) a[i][t] = vdupq_n_f32(0);
    int64_t c = 0;
    for (; c + 4 <= n; c += 4) {
        float32x4_t xv[4], wv[4];
        for (int t = 0; t < 4; t++) xv[t] = vld1q_f32(xp[t] + c);
        for (int i = 0; i < 4; i++) wv[i] = vld1q_f32(wp[i] + c);
        for (int i = 0; i < 4; i++)
            for (int t = 0; t < 4; t++) a[i][t] = vfmaq_f32(a[i][t], wv[i], xv[t]);
    }
    for (int i = 0; i < 4; i++)
        for (int t = 0; t < 4; t++) {
            float s = vaddvq_f32(a[i][t]);
            for (int64_t k = c; k < n; k++) s += wp[i][k] * xp[t][k];
            part[i][t] = s;
        }
}

static void gemm_neon(const cpumla_weight *w, const float *x, int64_t ldx, int64_t n, float *y,
                      int64_t ldy, int64_t r0, int64_t r1) {
    int quant = w->dtype == CPUMLA_E4M3 || w->dtype == CPUMLA_E2M1;
    int64_t bc = quant ? w->block_cols : w->cols;
    float panel[4][GEMM_CH], xrnd[4][GEMM_CH];    /* xrnd: BF16 weights' activations, rounded */
    int bf16 = w->dtype == CPUMLA_BF16;
    for (int64_t r = r0; r < r1; r += 4) {
        int nr = r1 - r < 4 ? (int)(r1 - r) : 4;
        const float *wp[4];
        for (int i = 0; i < 4; i++) wp[i] = panel[i < nr ? i : 0];
        for (int64_t t0 = 0; t0 < n; t0 += 4) {
            int nt = n - t0 < 4 ? (int)(n - t0) : 4;
            const float *xt[4];
            for (int t = 0; t < 4; t++) xt[t] = x + (t0 + (t < nt ? t : 0)) * ldx;
            float acc[4][4] = {{0}};
            for (int64_t b0 = 0; b0 < w->cols; b0 += bc) {
                int64_t b1 = b0 + bc < w->cols ? b0 + bc : w->cols;
                float blk[4][4] = {{0}};
                for (int64_t c0 = b0; c0 < b1; c0 += GEMM_CH) {
                    int64_t len = b1 - c0 < GEMM_CH ? b1 - c0 : GEMM_CH;
                    for (int i = 0; i < nr; i++) decode_unscaled(w, r + i, c0, len, panel[i]);
                    const float *xp[4];
                    for (int t = 0; t < 4; t++) {
                        xp[t] = xt[t] + c0;
                        if (!bf16) continue;
                        int64_t c = 0;
                        for (; c + 4 <= len; c += 4) vst1q_f32(xrnd[t] + c, bf16_round_q(vld1q_f32(xp[t] + c)));
                        for (; c < len; c++) xrnd[t][c] = bf16_round(xp[t][c]);
                        xp[t] = xrnd[t];
                    }
                    float part[4][4];
                    micro_4x4(wp, xp, len, part);
                    for (int i = 0; i < 4; i++)
                        for (int t = 0; t < 4; t++) blk[i][t] += part[i][t];
                }
                for (int i = 0; i < nr; i++) {
                    float s = quant ? block_scale(w, r + i, b0) : 1.0f;
                    for (int t = 0; t < nt; t++) acc[i][t] += quant ? blk[i][t] * s : blk[i][t];
                }
            }
            for (int i = 0; i < nr; i++)
                for (int t = 0; t < nt; t++) y[(t0 + t) * ldy + (r + i - r0)] = acc[i][t];
        }
    }
}

/* ---- gemv_t: y[c - c0] = sum_i x[i] W[r0 + i, c] ----------------------------------------------- */
/* y[0..n) += s * unscaled W[r, c0 .. c0 + n) */
static void axpy_row(const cpumla_weight *w, int64_t r, int64_t c0, int64_t n, float s, float *y) {
    const uint8_t *row = weight_row(w, r);
    float32x4_t sv = vdupq_n_f32(s);
    int64_t c = 0;
    switch (w->dtype) {
    case CPUMLA_F32: {
        const float *p = (const float *)row + c0;
        for (; c + 4 <= n; c += 4) vst1q_f32(y + c, vfmaq_f32(vld1q_f32(y + c), sv, vld1q_f32(p + c)));
        for (; c < n; c++) y[c] += s * p[c];
        return;
    }
    case CPUMLA_BF16: {
        const uint16_t *p = (const uint16_t *)row + c0;
        for (; c + 4 <= n; c += 4) vst1q_f32(y + c, vfmaq_f32(vld1q_f32(y + c), sv, ld_bf16(p + c)));
        for (; c < n; c++) y[c] += s * bf16_to_f32(p[c]);
        return;
    }
    case CPUMLA_F16: {
        const uint16_t *p = (const uint16_t *)row + c0;
        for (; c + 4 <= n; c += 4) vst1q_f32(y + c, vfmaq_f32(vld1q_f32(y + c), sv, ld_f16(p + c)));
        for (; c < n; c++) y[c] += s * f16_to_f32(p[c]);
        return;
    }
    case CPUMLA_E4M3: {
        const uint8_t *p = row + c0;
        for (; c + 16 <= n; c += 16) {
            float32x4_t v[4];
            ld_e4m3_16(p + c, v);
            for (int k = 0; k < 4; k++)
                vst1q_f32(y + c + 4 * k, vfmaq_f32(vld1q_f32(y + c + 4 * k), sv, v[k]));
        }
        for (; c < n; c++) y[c] += s * e4m3_scaled(p[c]);
        return;
    }
    case CPUMLA_E2M1:
        if (c0 & 1) { y[0] += s * e2m1_x2_at(row, c0); c = 1; }
        for (; c + 32 <= n; c += 32) {
            float32x4_t ev[4], od[4];
            ld_e2m1_32(row + ((c0 + c) >> 1), ev, od);
            for (int k = 0; k < 4; k++) {
                float32x4x2_t yv = vld2q_f32(y + c + 8 * k);
                yv.val[0] = vfmaq_f32(yv.val[0], sv, ev[k]);
                yv.val[1] = vfmaq_f32(yv.val[1], sv, od[k]);
                vst2q_f32(y + c + 8 * k, yv);
            }
        }
        for (; c < n; c++) y[c] += s * e2m1_x2_at(row, c0 + c);
        return;
    default:
        for (; c < n; c++) y[c] = NAN;
    }
}

static void gemv_t_neon(const cpumla_weight *w, int64_t r0, int64_t nr, const float *x, float *y,
                        int64_t c0, int64_t c1) {
    if (c1 <= c0) return;
    memset(y, 0, (size_t)(c1 - c0) * sizeof(float));
    int quant = w->dtype == CPUMLA_E4M3 || w->dtype == CPUMLA_E2M1;
    for (int64_t i = 0; i < nr; i++) {
        int64_t r = r0 + i;
        if (!quant) { axpy_row(w, r, c0, c1 - c0, w->dtype == CPUMLA_BF16 ? bf16_round(x[i]) : x[i], y); continue; }
        /* one segment per column block, each with its own scale */
        for (int64_t c = c0; c < c1;) {
            int64_t bend = (c / w->block_cols + 1) * w->block_cols;
            int64_t e = bend < c1 ? bend : c1;
            axpy_row(w, r, c, e - c, x[i] * block_scale(w, r, c), y + (c - c0));
            c = e;
        }
    }
}

static void dequant_row_neon(const cpumla_weight *w, int64_t r, int64_t c0, int64_t c1, float *out) {
    if (c1 <= c0) return;
    if (w->dtype != CPUMLA_E4M3 && w->dtype != CPUMLA_E2M1) {
        decode_unscaled(w, r, c0, c1 - c0, out);
        return;
    }
    for (int64_t c = c0; c < c1;) {
        int64_t bend = (c / w->block_cols + 1) * w->block_cols;
        int64_t e = bend < c1 ? bend : c1;
        float *o = out + (c - c0);
        decode_unscaled(w, r, c, e - c, o);
        float32x4_t sv = vdupq_n_f32(block_scale(w, r, c));
        int64_t k = 0, n = e - c;
        for (; k + 4 <= n; k += 4) vst1q_f32(o + k, vmulq_f32(vld1q_f32(o + k), sv));
        for (; k < n; k++) o[k] *= vgetq_lane_f32(sv, 0);
        c = e;
    }
}

/* ---- vector expf: Cephes polynomial, ~1 ulp on [-87, 88]; NaN stays NaN, -inf gives 0 ----------- */
static inline float32x4_t exp_f32x4(float32x4_t x) {
    x = vminq_f32(vmaxq_f32(x, vdupq_n_f32(-104.0f)), vdupq_n_f32(89.0f));
    float32x4_t fn = vrndnq_f32(vmulq_f32(x, vdupq_n_f32(1.44269504088896341f)));
    float32x4_t r = vfmsq_f32(x, fn, vdupq_n_f32(0.693359375f));
    r = vfmsq_f32(r, fn, vdupq_n_f32(-2.12194440e-4f));
    float32x4_t p = vdupq_n_f32(1.9875691500e-4f);
    p = vfmaq_f32(vdupq_n_f32(1.3981999507e-3f), p, r);
    p = vfmaq_f32(vdupq_n_f32(8.3334519073e-3f), p, r);
    p = vfmaq_f32(vdupq_n_f32(4.1665795894e-2f), p, r);
    p = vfmaq_f32(vdupq_n_f32(1.6666665459e-1f), p, r);
    p = vfmaq_f32(vdupq_n_f32(5.0000001201e-1f), p, r);
    p = vfmaq_f32(vaddq_f32(r, vdupq_n_f32(1.0f)), p, vmulq_f32(r, r));
    /* 2^n as two factors so that n in [-150, 129] never leaves the normal range */
    int32x4_t n = vcvtq_s32_f32(fn);
    int32x4_t n1 = vshrq_n_s32(n, 1), n2 = vsubq_s32(n, n1);
    float32x4_t e1 = vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(n1, vdupq_n_s32(127)), 23));
    float32x4_t e2 = vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(n2, vdupq_n_s32(127)), 23));
    return vmulq_f32(vmulq_f32(p, e1), e2);
}

/* ---- rows ------------------------------------------------------------------------------------- */
static void rmsnorm_row_neon(const float *x, float *y, int64_t dim, const void *weight, int32_t wdtype,
                             float eps) {
    float32x4_t s0 = vdupq_n_f32(0), s1 = s0;
    int64_t i = 0;
    for (; i + 8 <= dim; i += 8) {
        float32x4_t a = vld1q_f32(x + i), b = vld1q_f32(x + i + 4);
        s0 = vfmaq_f32(s0, a, a);
        s1 = vfmaq_f32(s1, b, b);
    }
    for (; i + 4 <= dim; i += 4) { float32x4_t a = vld1q_f32(x + i); s0 = vfmaq_f32(s0, a, a); }
    float ss = vaddvq_f32(vaddq_f32(s0, s1));
    for (; i < dim; i++) ss += x[i] * x[i];
    float inv = 1.0f / sqrtf(ss / (float)dim + eps);
    float32x4_t iv = vdupq_n_f32(inv);
    i = 0;
    for (; i + 4 <= dim; i += 4) {
        float32x4_t v = vmulq_f32(vld1q_f32(x + i), iv);
        if (weight) {
            float32x4_t wv;
            if (wdtype == CPUMLA_F32) wv = vld1q_f32((const float *)weight + i);
            else if (wdtype == CPUMLA_BF16) wv = ld_bf16((const uint16_t *)weight + i);
            else if (wdtype == CPUMLA_F16) wv = ld_f16((const uint16_t *)weight + i);
            else wv = vdupq_n_f32(NAN);
            v = vmulq_f32(v, wv);
        }
        vst1q_f32(y + i, v);
    }
    for (; i < dim; i++) {
        float v = x[i] * inv;
        y[i] = weight ? v * vec_at(weight, wdtype, i) : v;
    }
}

static void swiglu_row_neon(const float *gate, const float *up, float *out, int64_t dim, float limit) {
    int64_t i = 0;
    float32x4_t one = vdupq_n_f32(1.0f);
    for (; i + 4 <= dim; i += 4) {
        float32x4_t g = vld1q_f32(gate + i), u = vld1q_f32(up + i);
        if (limit > 0.0f) {
            g = vminq_f32(g, vdupq_n_f32(limit));
            u = vmaxq_f32(vminq_f32(u, vdupq_n_f32(limit)), vdupq_n_f32(-limit));
        }
        float32x4_t sg = vdivq_f32(g, vaddq_f32(one, exp_f32x4(vnegq_f32(g))));
        vst1q_f32(out + i, vmulq_f32(sg, u));
    }
    for (; i < dim; i++) {
        float g = gate[i], u = up[i];
        if (limit > 0.0f) {
            g = g < limit ? g : limit;
            u = u < -limit ? -limit : (u > limit ? limit : u);
        }
        out[i] = silu(g) * u;
    }
}

static void softmax_row_neon(float *x, int64_t n) {
    if (n <= 0) return;
    float32x4_t mv = vdupq_n_f32(-INFINITY);
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) mv = vmaxq_f32(mv, vld1q_f32(x + i));
    float m = vmaxvq_f32(mv);
    for (; i < n; i++) m = x[i] > m ? x[i] : m;
    float32x4_t sv = vdupq_n_f32(0);
    mv = vdupq_n_f32(m);
    i = 0;
    for (; i + 4 <= n; i += 4) {
        float32x4_t e = exp_f32x4(vsubq_f32(vld1q_f32(x + i), mv));
        vst1q_f32(x + i, e);
        sv = vaddq_f32(sv, e);
    }
    float s = vaddvq_f32(sv);
    for (; i < n; i++) { x[i] = expf(x[i] - m); s += x[i]; }
    float32x4_t inv = vdupq_n_f32(1.0f / s);
    i = 0;
    for (; i + 4 <= n; i += 4) vst1q_f32(x + i, vmulq_f32(vld1q_f32(x + i), inv));
    for (; i < n; i++) x[i] /= s;
}

/* ---- attention part: a tile of KV rows is read once and reused by every head ------------------ */
#define ATTN_TILE 16

static inline float32x4_t ld_kv(const void *row, int bf16, int64_t d) {
    return bf16 ? ld_bf16((const uint16_t *)row + d) : vld1q_f32((const float *)row + d);
}

static inline float kv_scalar(const void *row, int bf16, int64_t d) {
    return bf16 ? bf16_to_f32(((const uint16_t *)row)[d]) : ((const float *)row)[d];
}

/* s[k] = q . key(rows[k]) over [0, dk), 4 rows at a time */
static void scores_4(const float *q, const void *const rows[4], int bf16, int64_t dk, float s[4]) {
    float32x4_t a0 = vdupq_n_f32(0), a1 = a0, a2 = a0, a3 = a0;
    int64_t d = 0;
    for (; d + 4 <= dk; d += 4) {
        float32x4_t qv = vld1q_f32(q + d);
        a0 = vfmaq_f32(a0, qv, ld_kv(rows[0], bf16, d));
        a1 = vfmaq_f32(a1, qv, ld_kv(rows[1], bf16, d));
        a2 = vfmaq_f32(a2, qv, ld_kv(rows[2], bf16, d));
        a3 = vfmaq_f32(a3, qv, ld_kv(rows[3], bf16, d));
    }
    s[0] = vaddvq_f32(a0); s[1] = vaddvq_f32(a1); s[2] = vaddvq_f32(a2); s[3] = vaddvq_f32(a3);
    for (; d < dk; d++)
        for (int k = 0; k < 4; k++) s[k] += q[d] * kv_scalar(rows[k], bf16, d);
}

static float score_1(const float *q, const void *row, int bf16, int64_t dk) {
    float32x4_t a0 = vdupq_n_f32(0), a1 = a0;
    int64_t d = 0;
    for (; d + 8 <= dk; d += 8) {
        a0 = vfmaq_f32(a0, vld1q_f32(q + d), ld_kv(row, bf16, d));
        a1 = vfmaq_f32(a1, vld1q_f32(q + d + 4), ld_kv(row, bf16, d + 4));
    }
    for (; d + 4 <= dk; d += 4) a0 = vfmaq_f32(a0, vld1q_f32(q + d), ld_kv(row, bf16, d));
    float s = vaddvq_f32(vaddq_f32(a0, a1));
    for (; d < dk; d++) s += q[d] * kv_scalar(row, bf16, d);
    return s;
}

/* o[0..dv) += sum_k p[k] * value(rows[k]) */
static void accumulate(float *o, const void *const *rows, const float *p, int nt, int bf16, int64_t dv) {
    int k = 0;
    for (; k + 4 <= nt; k += 4) {
        float32x4_t p0 = vdupq_n_f32(p[k]), p1 = vdupq_n_f32(p[k + 1]);
        float32x4_t p2 = vdupq_n_f32(p[k + 2]), p3 = vdupq_n_f32(p[k + 3]);
        int64_t d = 0;
        for (; d + 4 <= dv; d += 4) {
            float32x4_t ov = vld1q_f32(o + d);
            ov = vfmaq_f32(ov, p0, ld_kv(rows[k], bf16, d));
            ov = vfmaq_f32(ov, p1, ld_kv(rows[k + 1], bf16, d));
            ov = vfmaq_f32(ov, p2, ld_kv(rows[k + 2], bf16, d));
            ov = vfmaq_f32(ov, p3, ld_kv(rows[k + 3], bf16, d));
            vst1q_f32(o + d, ov);
        }
        for (; d < dv; d++)
            for (int i = 0; i < 4; i++) o[d] += p[k + i] * kv_scalar(rows[k + i], bf16, d);
    }
    for (; k < nt; k++) {
        float32x4_t pv = vdupq_n_f32(p[k]);
        int64_t d = 0;
        for (; d + 4 <= dv; d += 4) vst1q_f32(o + d, vfmaq_f32(vld1q_f32(o + d), pv, ld_kv(rows[k], bf16, d)));
        for (; d < dv; d++) o[d] += p[k] * kv_scalar(rows[k], bf16, d);
    }
}

static void attn_part_neon(const cpumla_attn_args *a, int64_t qi, int64_t h0, int64_t h1, int64_t j0,
                           int64_t j1, float *acc, float *m, float *l) {
    int bf16 = a->kv_dtype == CPUMLA_BF16;
    int64_t nh = h1 - h0, dv = a->dv;
    for (int64_t k = 0; k < nh; k++) { m[k] = -INFINITY; l[k] = 0.0f; }
    if (nh > 0) memset(acc, 0, (size_t)(nh * dv) * sizeof(float));
    for (int64_t j = j0; j < j1;) {
        const void *rows[ATTN_TILE];
        int nt = 0;
        for (; j < j1 && nt < ATTN_TILE; j++) {
            const void *row = attn_kv_row(a, qi, j);
            if (row) rows[nt++] = row;
        }
        if (nt == 0) continue;
        for (int64_t h = h0; h < h1; h++) {
            const float *q = a->q + qi * a->ldq_t + h * a->ldq_h;
            float s[ATTN_TILE];
            int k = 0;
            for (; k + 4 <= nt; k += 4) scores_4(q, rows + k, bf16, a->dk, s + k);
            for (; k < nt; k++) s[k] = score_1(q, rows[k], bf16, a->dk);
            float mt = -INFINITY;
            for (k = 0; k < nt; k++) { s[k] *= a->scale; mt = s[k] > mt ? s[k] : mt; }
            float *o = acc + (h - h0) * dv;
            float mh = m[h - h0], lh = l[h - h0];
            if (mt > mh) {                       /* rescale what we have so far */
                float c = expf(mh - mt);         /* mh = -inf the first time: c = 0 */
                lh *= c;
                float32x4_t cv = vdupq_n_f32(c);
                int64_t d = 0;
                for (; d + 4 <= dv; d += 4) vst1q_f32(o + d, vmulq_f32(vld1q_f32(o + d), cv));
                for (; d < dv; d++) o[d] *= c;
                mh = mt;
            }
            for (k = 0; k < nt; k++) { s[k] = expf(s[k] - mh); lh += s[k]; }
            accumulate(o, rows, s, nt, bf16, dv);
            m[h - h0] = mh;
            l[h - h0] = lh;
        }
    }
}

/* ---- cache row, read probe -------------------------------------------------------------------- */
static void cache_row_neon(void *dst, int32_t dtype, const float *src, int64_t width) {
    if (dtype != CPUMLA_BF16) {
        memcpy(dst, src, (size_t)width * sizeof(float));
        return;
    }
    uint16_t *d = (uint16_t *)dst;
    int64_t i = 0;
    for (; i + 4 <= width; i += 4)
        vst1_u16(d + i, vshrn_n_u32(vreinterpretq_u32_f32(bf16_round_q(vld1q_f32(src + i))), 16));
    for (; i < width; i++) d[i] = f32_to_bf16(src[i]);
}

/* Same association as scalar.c: four 64-bit lane sums, xor-ed. */
static double read_sum_neon(const void *buf, int64_t bytes) {
    const uint64_t *p = (const uint64_t *)buf;
    uint64x2_t a0 = vdupq_n_u64(0), a1 = a0, b0 = a0, b1 = a0;
    int64_t n = bytes / 8, i = 0;
    for (; i + 8 <= n; i += 8) {
        a0 = vaddq_u64(a0, vld1q_u64(p + i));
        a1 = vaddq_u64(a1, vld1q_u64(p + i + 2));
        b0 = vaddq_u64(b0, vld1q_u64(p + i + 4));
        b1 = vaddq_u64(b1, vld1q_u64(p + i + 6));
    }
    a0 = vaddq_u64(a0, b0);
    a1 = vaddq_u64(a1, b1);
    for (; i + 4 <= n; i += 4) {
        a0 = vaddq_u64(a0, vld1q_u64(p + i));
        a1 = vaddq_u64(a1, vld1q_u64(p + i + 2));
    }
    uint64_t s = vgetq_lane_u64(a0, 0) ^ vgetq_lane_u64(a0, 1) ^ vgetq_lane_u64(a1, 0) ^
                 vgetq_lane_u64(a1, 1);
    return (double)s;
}

void cpumla_fill_neon(cpumla_kernels *k) {
    k->gemv = gemv_neon;               k->who[K_GEMV] = "neon";
    k->gemm = gemm_neon;               k->who[K_GEMM] = "neon";
    k->gemv_t = gemv_t_neon;           k->who[K_GEMV_T] = "neon";
    k->dequant_row = dequant_row_neon; k->who[K_DEQUANT] = "neon";
    k->rmsnorm_row = rmsnorm_row_neon; k->who[K_RMSNORM] = "neon";
    k->swiglu_row = swiglu_row_neon;   k->who[K_SWIGLU] = "neon";
    k->softmax_row = softmax_row_neon; k->who[K_SOFTMAX] = "neon";
    k->attn_part = attn_part_neon;     k->who[K_ATTN] = "neon";
    k->cache_row = cache_row_neon;     k->who[K_CACHE_ROW] = "neon";
    k->read_sum = read_sum_neon;       k->who[K_READ] = "neon";
}
