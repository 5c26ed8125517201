/* neon.c: the neon level, aarch64 ASIMD at baseline armv8-a (fp32 FMA, fp16 <-> fp32 conversion).
 * Same semantics as scalar.c (the spec); only the order of fp32 additions differs.
 *   FP8 e4m3 is widened through fp16: the bits ((b & 0x7f) << 7) | ((b & 0x80) << 8) are an fp16
 *   equal to value * 2^-8 exactly (subnormals included; the NaN code is made an fp16 NaN). The block
 *   scale goes into the activation (e4m3_act, common.h): bf16_round(x * scale), computed once per row
 *   block and column; the codes are used unscaled and no block scale touches partial sums. The
 *   decode's 2^-8 is undone by one multiply by 256 of each finished sum (folded into the activation,
 *   256 would overflow once |bf16(x * scale)| >= 2^120): sums of products scaled by a power of two
 *   round alike (FMA: one rounding each), so this is exact unless a partial sum is below 2^-118.
 *   FP4 e2m1: gemv and gemm go back to the entries below (kernels.h: kern_gemv sends 1x32 E8M0 blocks
 *   to the integer product, int_neon.h); gemv_t and dequant_row go through a byte table of 2 * value
 *   (all integers), so their block scale is halved.
 *
 * This file holds the linear algebra (gemv, gemm, gemv_t, dequant_row); the row-wise and attention
 * kernels are in neon_rows.c, the integer products in neon_q.c / neon_q_dot.c (int_neon.h):
 * cpumla_fill_neon sets them all. Shared helpers: neon_common.h. */
#include <arm_neon.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#include "core/common.h"
#include "core/kernels.h"
#include "kernels/arm/neon_common.h"
#include "core/quant.h"          /* e2m1_w2: 2 * the e2m1 value of each code */

const char cpumla_flags_neon[] = CPUMLA_FLAGS;

/* ---- weight decoding -------------------------------------------------------------------------- */
/* 8 e4m3 bytes -> fp16 bit patterns of value * 2^-8 */
static inline uint16x8_t e4m3_as_f16(uint8x8_t b) {
    int16x8_t s = vmovl_s8(vreinterpret_s8_u8(b));          /* bits 7..15 = sign */
    uint16x8_t h = vandq_u16(vreinterpretq_u16_s16(vshlq_n_s16(s, 7)), vdupq_n_u16(0xbfff));
    /* the NaN code S.1111.111 shifts to 0x3f80 (a finite fp16): make it an fp16 NaN, as the spec's */
    uint16x8_t nan = vceqq_u16(vandq_u16(h, vdupq_n_u16(0x7fff)), vdupq_n_u16(0x3f80));
    return vorrq_u16(h, vandq_u16(nan, vdupq_n_u16(0x7e00)));
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

static inline float e2m1_w2_at(const uint8_t *row, int64_t c) {
    uint8_t b = row[c >> 1];
    return (float)e2m1_w2[(c & 1) ? (b >> 4) : (b & 15)];
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
    int8x16_t tab = vld1q_s8(e2m1_w2);
    uint8x16_t b = vld1q_u8(p);
    s8x16_to_f32(vqtbl1q_s8(tab, vandq_u8(b, vdupq_n_u8(15))), ev);
    s8x16_to_f32(vqtbl1q_s8(tab, vshrq_n_u8(b, 4)), od);
}

/* E2M1 block scale with the table's fold (2x values): halved. */
static inline float e2m1_block_scale(const cpumla_weight *w, int64_t r, int64_t c) {
    return weight_scale(w, r, c) * 0.5f;
}

/* ---- E4M3 activations: e4m3_act (common.h), vectorised -------------------------------------------- */
#define E4M3_UNFOLD 256.0f   /* sums of decoded codes (value * 2^-8) times activations, times this */

/* xs[k] = bf16_round(x[k] * s) for k < n */
static inline void e4m3_act_seg(const float *x, float s, int64_t n, float *xs) {
    float32x4_t sv = vdupq_n_f32(s);
    int64_t k = 0;
    for (; k + 4 <= n; k += 4) vst1q_f32(xs + k, bf16_round_q(vmulq_f32(vld1q_f32(x + k), sv)));
    for (; k < n; k++) xs[k] = bf16_round(x[k] * s);
}

/* xs[c - c0] = e4m3_act(w, r, c, x[c]) for c0 <= c < c0 + n (x indexed by column): one
 * segment per column block, each with the scale of block (r / block_rows, c / block_cols) */
static void e4m3_act_cols(const cpumla_weight *w, int64_t r, const float *x, int64_t c0, int64_t n,
                          float *xs) {
    for (int64_t c = c0; c < c0 + n;) {
        int64_t bend = (c / w->block_cols + 1) * w->block_cols;
        int64_t e = bend < c0 + n ? bend : c0 + n;
        e4m3_act_seg(x + c, weight_scale(w, r, c), e - c, xs + (c - c0));
        c = e;
    }
}

/* end of the row block holding row r, capped at r1 */
static inline int64_t row_block_end(const cpumla_weight *w, int64_t r, int64_t r1) {
    int64_t e = (r / w->block_rows + 1) * w->block_rows;
    return e < r1 ? e : r1;
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

/* sum of e4m3(a[c]) * 2^-8 * x[c] (x: activations from e4m3_act_cols) */
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

static float row_dot(const cpumla_weight *w, int64_t r, const float *x) {
    const uint8_t *row = weight_row(w, r);
    int64_t n = w->cols;
    switch (w->dtype) {
    case CPUMLA_F32: return dot_f32((const float *)row, x, n);
    case CPUMLA_BF16: return dot_bf16((const uint16_t *)row, x, n);
    case CPUMLA_F16: return dot_f16((const uint16_t *)row, x, n);
    default: return NAN;
    }
}

/* E4M3 gemv: per row block, the activations of E4M3_CH columns at a time (once per row block), then
 * a plain dot of each row's codes with them, accumulated in y over the column chunks */
#define E4M3_CH 4096
static void gemv_e4m3(const cpumla_weight *w, const float *x, float *y, int64_t r0, int64_t r1) {
    float xs[E4M3_CH];
    if (w->cols <= 0) { memset(y, 0, (size_t)(r1 - r0) * sizeof(float)); return; }
    for (int64_t ra = r0, rb; ra < r1; ra = rb) {
        rb = row_block_end(w, ra, r1);
        for (int64_t c0 = 0; c0 < w->cols; c0 += E4M3_CH) {
            int64_t len = w->cols - c0 < E4M3_CH ? w->cols - c0 : E4M3_CH;
            e4m3_act_cols(w, ra, x, c0, len, xs);
            for (int64_t r = ra; r < rb; r++) {
                float part = dot_e4m3(weight_row(w, r) + c0, xs, len) * E4M3_UNFOLD;
                y[r - r0] = c0 ? y[r - r0] + part : part;
            }
        }
    }
}

/* E2M1 gemv / gemm go to the entries below (the spec's fp32 product; kern_gemv takes 1x32 E8M0
 * blocks to the integer one first) */
static void (*prev_gemv)(const cpumla_weight *, const float *, float *, int64_t, int64_t);
static void (*prev_gemm)(const cpumla_weight *, const float *, int64_t, int64_t, float *, int64_t, int64_t, int64_t);

static void gemv_neon(const cpumla_weight *w, const float *x, float *y, int64_t r0, int64_t r1) {
    if (w->dtype == CPUMLA_E4M3) { gemv_e4m3(w, x, y, r0, r1); return; }
    if (w->dtype == CPUMLA_E2M1) { prev_gemv(w, x, y, r0, r1); return; }
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
        if (c0 & 1) { out[0] = e2m1_w2_at(row, c0); c = 1; }
        for (; c + 32 <= n; c += 32) {
            float32x4_t ev[4], od[4];
            ld_e2m1_32(row + ((c0 + c) >> 1), ev, od);
            for (int k = 0; k < 4; k++) {
                float32x4x2_t v = {{ev[k], od[k]}};
                vst2q_f32(out + c + 8 * k, v);
            }
        }
        for (; c < n; c++) out[c] = e2m1_w2_at(row, c0 + c);
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

/* E4M3 gemm, per row block: for each column chunk and each chunk of E4M3_TC tokens, the tokens'
 * activations for that row block once (e4m3_act_cols), then 4-row panels of unscaled codes times
 * 4 tokens at a time; partial sums of the column chunks accumulate in y. */
#define E4M3_TC 16
static void gemm_e4m3(const cpumla_weight *w, const float *x, int64_t ldx, int64_t n, float *y,
                      int64_t ldy, int64_t r0, int64_t r1) {
    float panel[4][GEMM_CH], xs[E4M3_TC][GEMM_CH];
    for (int64_t t = 0; t < n; t++) memset(y + t * ldy, 0, (size_t)(r1 - r0) * sizeof(float));
    for (int64_t ra = r0, rb; ra < r1; ra = rb) {
        rb = row_block_end(w, ra, r1);
        for (int64_t c0 = 0; c0 < w->cols; c0 += GEMM_CH) {
            int64_t len = w->cols - c0 < GEMM_CH ? w->cols - c0 : GEMM_CH;
            for (int64_t t0 = 0; t0 < n; t0 += E4M3_TC) {
                int ntc = n - t0 < E4M3_TC ? (int)(n - t0) : E4M3_TC;
                for (int t = 0; t < ntc; t++) e4m3_act_cols(w, ra, x + (t0 + t) * ldx, c0, len, xs[t]);
                for (int64_t r = ra; r < rb; r += 4) {
                    int nr = rb - r < 4 ? (int)(rb - r) : 4;
                    const float *wp[4];
                    for (int i = 0; i < 4; i++) wp[i] = panel[i < nr ? i : 0];
                    for (int i = 0; i < nr; i++) decode_unscaled(w, r + i, c0, len, panel[i]);
                    for (int tg = 0; tg < ntc; tg += 4) {
                        int nt = ntc - tg < 4 ? ntc - tg : 4;
                        const float *xp[4];
                        for (int t = 0; t < 4; t++) xp[t] = xs[tg + (t < nt ? t : 0)];
                        float part[4][4];
                        micro_4x4(wp, xp, len, part);
                        float *yt = y + (t0 + tg) * ldy + (r - r0);
                        for (int i = 0; i < nr; i++)
                            for (int t = 0; t < nt; t++) yt[t * ldy + i] += part[i][t] * E4M3_UNFOLD;
                    }
                }
            }
        }
    }
}

static void gemm_neon(const cpumla_weight *w, const float *x, int64_t ldx, int64_t n, float *y,
                      int64_t ldy, int64_t r0, int64_t r1) {
    if (w->dtype == CPUMLA_E4M3) { gemm_e4m3(w, x, ldx, n, y, ldy, r0, r1); return; }
    if (w->dtype == CPUMLA_E2M1) { prev_gemm(w, x, ldx, n, y, ldy, r0, r1); return; }
    const int64_t bc = w->cols;
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
                for (int i = 0; i < nr; i++)
                    for (int t = 0; t < nt; t++) acc[i][t] += blk[i][t];
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
        if (c0 & 1) { y[0] += s * e2m1_w2_at(row, c0); c = 1; }
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
        for (; c < n; c++) y[c] += s * e2m1_w2_at(row, c0 + c);
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
        /* one segment per column block, each with its own scale: e4m3 folds it into the activation
         * (e4m3_act; y is multiplied by E4M3_UNFOLD at the end), e2m1 multiplies x by it (halved) */
        for (int64_t c = c0; c < c1;) {
            int64_t bend = (c / w->block_cols + 1) * w->block_cols;
            int64_t e = bend < c1 ? bend : c1;
            float s = w->dtype == CPUMLA_E4M3 ? e4m3_act(w, r, c, x[i]) : x[i] * e2m1_block_scale(w, r, c);
            axpy_row(w, r, c, e - c, s, y + (c - c0));
            c = e;
        }
    }
    if (w->dtype == CPUMLA_E4M3) {
        float32x4_t f = vdupq_n_f32(E4M3_UNFOLD);
        int64_t k = 0, n = c1 - c0;
        for (; k + 4 <= n; k += 4) vst1q_f32(y + k, vmulq_f32(vld1q_f32(y + k), f));
        for (; k < n; k++) y[k] *= E4M3_UNFOLD;
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
        /* the decode's fold: 256 for e4m3 (value * 2^-8), 0.5 for e2m1 (2 * value) */
        float s = weight_scale(w, r, c) * (w->dtype == CPUMLA_E4M3 ? 256.0f : 0.5f);
        float32x4_t sv = vdupq_n_f32(s);
        int64_t k = 0, n = e - c;
        for (; k + 4 <= n; k += 4) vst1q_f32(o + k, vmulq_f32(vld1q_f32(o + k), sv));
        for (; k < n; k++) o[k] *= s;
        c = e;
    }
}

/* The weight operands the gemv loops multiply (cpumla_decode_operands): E4M3 ld_e4m3_16's value *
 * 2^-8, widened from fp16, so e4m3's subnormals come out as normal fp32. */
int cpumla_decode_operands_neon(int dtype, float *out) {
    if (dtype != CPUMLA_E4M3) return -1;
    uint8_t codes[16];
    for (int g = 0; g < 16; g++) {
        float32x4_t v[4];
        for (int i = 0; i < 16; i++) codes[i] = (uint8_t)(16 * g + i);
        ld_e4m3_16(codes, v);
        for (int j = 0; j < 4; j++) vst1q_f32(out + 16 * g + 4 * j, v[j]);
    }
    return 8;
}

void cpumla_fill_neon(cpumla_kernels *k) {
    cpumla_fill_neon_rows(k);
    if (k->gemv != gemv_neon) prev_gemv = k->gemv;
    if (k->gemm != gemm_neon) prev_gemm = k->gemm;
    k->gemv = gemv_neon;               k->who[K_GEMV] = "neon";
    k->gemm = gemm_neon;               k->who[K_GEMM] = "neon";
    k->gemv_t = gemv_t_neon;           k->who[K_GEMV_T] = "neon";
    k->dequant_row = dequant_row_neon; k->who[K_DEQUANT] = "neon";
    for (int i = K_GEMV; i <= K_DEQUANT; i++)          /* every format, every layout */
        for (int f = 0; f <= CPUMLA_E2M1; f++) k->who_fmt[i][f] = "neon";
    k->who_fmt[K_GEMV][CPUMLA_E2M1] = k->who_fmt[K_GEMM][CPUMLA_E2M1] = "scalar";     /* handed back */
    if (cpumla_cpu_features() & CPUMLA_FEAT_NEON_DOTPROD) cpumla_fill_neon_q_dot(k);  /* neon_q_dot.c */
    else cpumla_fill_neon_q(k);                                                       /* neon_q.c */
}
