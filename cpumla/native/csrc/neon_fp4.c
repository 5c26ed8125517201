/* neon_fp4.c: the FP4 (e2m1) GEMV of the NEON level for block widths that are multiples of 32, through
 * fp16 (split from neon.c; same flags: csrc/FLAGS), and the operands its decode hands the FMAs. */
#include <arm_neon.h>
#include <stdint.h>
#include <string.h>
#include "common.h"
#include "kernels.h"

/* E2M1 gemv for block_cols a multiple of 32, 4 rows at a time (each x load serves the 4), 32 columns
 * (16 bytes) per row per step. Decode: tbl gives each code's fp16 high byte (the low byte is zero:
 * every e2m1 value is exact and normal in fp16), zip with zero makes the fp16 words, fcvtl widens
 * them: 16 instructions per 32 codes against the integer table's 24 (sxtl chains and scvtf). The
 * codes come out even columns first (e2m1_col), so x is rearranged once per E2M1_CH columns; one
 * multiply by the block scale per block's partial sum, as scalar.c. */
#define E2M1_CH 4096
static const uint8_t e2m1_h16[16] = {0, 0x38, 0x3c, 0x3e, 0x40, 0x42, 0x44, 0x46,
                                     0x80, 0xb8, 0xbc, 0xbe, 0xc0, 0xc2, 0xc4, 0xc6};
/* vector j of e2m1_dec32 holds, in lane l, column e2m1_col[j] + 2l of the group */
static const uint8_t e2m1_col[8] = {0, 8, 16, 24, 1, 9, 17, 25};

/* 16 bytes (32 codes) -> f[0..7], exact values, in e2m1_col's order */
static inline void e2m1_dec32(uint8x16_t b, uint8x16_t tab, float32x4_t f[8]) {
    const uint8x16_t z = vdupq_n_u8(0);
    uint8x16_t lo = vqtbl1q_u8(tab, vandq_u8(b, vdupq_n_u8(15))), hi = vqtbl1q_u8(tab, vshrq_n_u8(b, 4));
    float16x8_t h[4] = {vreinterpretq_f16_u8(vzip1q_u8(z, lo)), vreinterpretq_f16_u8(vzip2q_u8(z, lo)),
                        vreinterpretq_f16_u8(vzip1q_u8(z, hi)), vreinterpretq_f16_u8(vzip2q_u8(z, hi))};
    for (int j = 0; j < 4; j++) {
        f[2 * j] = vcvt_f32_f16(vget_low_f16(h[j]));
        f[2 * j + 1] = vcvt_high_f32_f16(h[j]);
    }
}

void cpumla_neon_gemv_e2m1(const cpumla_weight *w, const float *x, float *y, int64_t r0, int64_t r1) {
    float xp[E2M1_CH], sc[4][E2M1_CH / 32];
    const uint8x16_t tab = vld1q_u8(e2m1_h16);
    const int64_t K = w->cols;
    if (K <= 0) { memset(y, 0, (size_t)(r1 - r0) * sizeof(float)); return; }
    for (int64_t k0 = 0; k0 < K; k0 += E2M1_CH) {
        const int64_t k1 = k0 + E2M1_CH < K ? k0 + E2M1_CH : K, n32 = (k1 - k0) / 32, kv = k0 + 32 * n32;
        for (int64_t g = 0; g < n32; g++)
            for (int j = 0; j < 8; j++)
                for (int l = 0; l < 4; l++) xp[32 * g + 4 * j + l] = x[k0 + 32 * g + e2m1_col[j] + 2 * l];
        for (int64_t r = r0; r < r1; r += 4) {
            const int nr = r1 - r < 4 ? (int)(r1 - r) : 4;
            const uint8_t *p[4];
            for (int i = 0; i < 4; i++) {
                int64_t rr = r + (i < nr ? i : 0);
                p[i] = weight_row(w, rr) + k0 / 2;
                const int64_t base = (rr / w->block_rows) * w->scale_ld;
                for (int64_t g = 0; g < n32; g++) sc[i][g] = scale_elem(w, base + (k0 + 32 * g) / w->block_cols);
            }
            float32x4_t tot[4];
            for (int i = 0; i < 4; i++) tot[i] = vdupq_n_f32(0.0f);
            for (int64_t g = 0; g < n32; g++) {
                const float *xg = xp + 32 * g;
                for (int i = 0; i < 4; i++) {
                    float32x4_t f[8];
                    e2m1_dec32(vld1q_u8(p[i] + 16 * g), tab, f);
                    float32x4_t s0 = vmulq_f32(f[0], vld1q_f32(xg)), s1 = vmulq_f32(f[1], vld1q_f32(xg + 4));
                    for (int j = 2; j < 8; j += 2) {
                        s0 = vfmaq_f32(s0, f[j], vld1q_f32(xg + 4 * j));
                        s1 = vfmaq_f32(s1, f[j + 1], vld1q_f32(xg + 4 * j + 4));
                    }
                    tot[i] = vfmaq_n_f32(tot[i], vaddq_f32(s0, s1), sc[i][g]);
                }
            }
            for (int i = 0; i < nr; i++) {
                float t = vaddvq_f32(tot[i]);
                if (kv < k1) {                   /* the last partial group: scalar */
                    const uint8_t *row = weight_row(w, r + i);
                    float part = 0.0f;
                    for (int64_t c = kv; c < k1; c++)
                        part += cpumla_e2m1_lut[(c & 1) ? (row[c >> 1] >> 4) : (row[c >> 1] & 15)] * x[c];
                    t += part * weight_scale(w, r + i, kv);
                }
                y[r - r0 + i] = k0 ? y[r - r0 + i] + t : t;
            }
        }
    }
}

/* the values e2m1_dec32 gives codes 0..15 (cpumla_decode_operands) */
int cpumla_neon_e2m1_operands(float *out) {
    uint8_t b[16] = {0};
    for (int j = 0; j < 8; j++) b[j] = (uint8_t)(2 * j | (2 * j + 1) << 4);   /* columns 0..15: codes 0..15 */
    float32x4_t f[8];
    e2m1_dec32(vld1q_u8(b), vld1q_u8(e2m1_h16), f);
    for (int j = 0; j < 8; j++) {
        float v[4];
        vst1q_f32(v, f[j]);
        for (int l = 0; l < 4; l++)
            if (e2m1_col[j] + 2 * l < 16) out[e2m1_col[j] + 2 * l] = v[l];
    }
    return 0;
}
