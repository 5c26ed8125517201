/* scalar_q.c: the spec of the integer kernels (Q8 / Q4 / E2M1 weights; kernels.h, quant.h), portable
 * C. The activation row is quantized per block of 32 (q_act_block, quant.h: int8 codes for Q8 / Q4,
 * int16 for E2M1); each block's integer dot product (weight codes q_block: Q8 q, Q4 nibble - 8, E2M1
 * w2 = 2 * value) is exact, scaled by wd * xd (q_scale: the fp16 scale, or the E8M0 scale halved) and
 * added in block order. gemv_t and dequant_row keep fp32 (Q8 / Q4 here; E2M1 stays on the fp32
 * entries, scalar.c and its twins). */
#include <math.h>
#include <stdint.h>
#include <string.h>
#include "core/common.h"
#include "core/kernels.h"
#include "core/quant.h"

/* codes in column order (E2M1: the int16 codes split, hi here and lo in qx_lo), xd per block, the
 * int32 is the block's code sum; zero padding past K (the same for every weight format) */
static void quant_x_scalar(int32_t wdtype, const float *x, int64_t K, void *qx) {
    int8_t *q = qx, *ql = qx_lo(qx, K);
    float *d = qx_d(qx, K);
    int32_t *s = qx_s(qx, K);
    const int64_t nb = K / QK, kp = qx_kp(K);
    for (int64_t b = 0; b < nb; b++) {
        int32_t c[QK], sum = 0;
        d[b] = q_act_block(x + b * QK, qact_max(wdtype), c);
        for (int i = 0; i < QK; i++) {
            q[b * QK + i] = wdtype == CPUMLA_E2M1 ? q_hi(c[i]) : (int8_t)c[i];
            ql[b * QK + i] = wdtype == CPUMLA_E2M1 ? q_lo(c[i]) : 0;
            sum += c[i];
        }
        s[b] = sum;
    }
    memset(q + K, 0, (size_t)(kp - K));
    memset(ql + K, 0, (size_t)(kp - K));
    for (int64_t b = nb; b < kp / QK; b++) { d[b] = 0.0f; s[b] = 0; }
}

/* the exact block sums against the activation codes (E2M1: q = 256 * hi + lo) */
static float row_dot_q(const cpumla_weight *w, int64_t r, const int8_t *xq, const int8_t *xl, const float *xd) {
    const int fp4 = w->dtype == CPUMLA_E2M1;
    float acc = 0.0f;
    int8_t wq[QK];
    for (int64_t b = 0; b < w->cols / QK; b++) {
        q_block(w, r, b, wq);
        int32_t isum = 0;
        for (int64_t i = b * QK; i < (b + 1) * QK; i++)
            isum += (int32_t)wq[i - b * QK] * (fp4 ? 256 * (int32_t)xq[i] + xl[i] : (int32_t)xq[i]);
        volatile float p = (float)isum * (q_scale(w, r, b) * xd[b]);    /* rounded: never fused into the sum */
        acc += p;
    }
    return acc;
}

static void gemm_q_scalar(const cpumla_weight *w, const void *qx, int64_t n, float *y, int64_t ldy, int64_t r0,
                          int64_t r1) {
    const int64_t K = w->cols, per = QX_BYTES(K);
    for (int64_t t = 0; t < n; t++) {
        const uint8_t *xt = (const uint8_t *)qx + t * per;
        for (int64_t r = r0; r < r1; r++) y[t * ldy + (r - r0)] = row_dot_q(w, r, (const int8_t *)xt, qx_lo(xt, K), qx_d(xt, K));
    }
}

/* y[c - c0] = sum_i (x[i] * wd) * wq, rows in order */
static void gemv_t_q_scalar(const cpumla_weight *w, int64_t r0, int64_t nr, const float *x, float *y, int64_t c0,
                            int64_t c1) {
    for (int64_t c = c0; c < c1; c++) y[c - c0] = 0.0f;
    int8_t wq[QK];
    for (int64_t i = 0; i < nr; i++) {
        for (int64_t b = c0 / QK; b * QK < c1; b++) {
            q_block(w, r0 + i, b, wq);
            const float xs = x[i] * q_scale(w, r0 + i, b);
            const int64_t lo = b * QK > c0 ? b * QK : c0, hi = (b + 1) * QK < c1 ? (b + 1) * QK : c1;
            for (int64_t c = lo; c < hi; c++) y[c - c0] += xs * (float)wq[c - b * QK];
        }
    }
}

static void dequant_q_scalar(const cpumla_weight *w, int64_t r, int64_t c0, int64_t c1, float *out) {
    for (int64_t c = c0; c < c1; c++) out[c - c0] = weight_at(w, r, c);
}

/* ---- quantize_row: the spec of cpumla_quantize (cpumla.h) ---------------------------------------- */
/* Round to nearest, ties to even, for |x| < 2^22 (every product rounded here is at most ~190): adding
 * and taking away 1.5 * 2^23 leaves the integer, as rintf does, in two adds the compiler vectorises. */
static inline float round_even(float x) {
    const float magic = 12582912.0f;
    return (x + magic) - magic;
}

/* One block of 32 fp32 values -> codes (Q8: int8; Q4: the 16 packed bytes) and the fp16 scale. A block
 * holding a NaN or an infinity: scale NaN, codes 0 (quant.h's q_nonfinite). */
static uint16_t quantize_block(int32_t dtype, const float *v, uint8_t *out) {
    const float amax = q_amax(v, QK);
    if (q_nonfinite(amax)) {
        memset(out, dtype == CPUMLA_Q8 ? 0 : 0x88, dtype == CPUMLA_Q8 ? QK : QK / 2);
        return Q_NAN_F16;
    }
    if (dtype == CPUMLA_Q8) {
        uint16_t d16 = f32_to_f16(amax / 127.0f);
        float d = f16_to_f32(d16), id = d > 0.0f ? 1.0f / d : 0.0f;
        for (int i = 0; i < QK; i++) {
            float q = round_even(v[i] * id);
            q = q > 127.0f ? 127.0f : q < -127.0f ? -127.0f : q;
            out[i] = (uint8_t)(int8_t)(int)q;
        }
        return d16;
    }
    /* m: the first value of largest magnitude */
    float m = 0.0f;
    for (int i = 0; amax > 0.0f && i < QK; i++)
        if (fabsf(v[i]) == amax) { m = v[i]; break; }
    uint16_t d16 = f32_to_f16(m / -8.0f);
    float d = f16_to_f32(d16), id = d != 0.0f ? 1.0f / d : 0.0f;
    uint8_t n[QK];
    for (int i = 0; i < QK; i++) {
        float q = round_even(v[i] * id);
        q = q > 7.0f ? 7.0f : q < -8.0f ? -8.0f : q;
        n[i] = (uint8_t)((int)q + 8);
    }
    for (int i = 0; i < 16; i++) out[i] = (uint8_t)(n[i] | (n[16 + i] << 4));
    return d16;
}

static void quantize_row_scalar(int32_t dtype, const float *row, int64_t nb, uint8_t *q, uint16_t *scales) {
    const int64_t bb = dtype == CPUMLA_Q8 ? QK : QK / 2;     /* bytes per block */
    for (int64_t b = 0; b < nb; b++) scales[b] = quantize_block(dtype, row + b * QK, q + b * bb);
}

void cpumla_fill_scalar_q(cpumla_kernels *k) {
    k->quantize_row = quantize_row_scalar;
    k->quant_x = quant_x_scalar;
    k->gemm_q = gemm_q_scalar;
    k->gemv_t_q = gemv_t_q_scalar;
    k->dequant_q = dequant_q_scalar;
    for (int i = K_GEMV; i <= K_DEQUANT; i++) k->who_fmt[i][CPUMLA_Q8] = k->who_fmt[i][CPUMLA_Q4] = "scalar";
    k->who_fmt[K_GEMV][CPUMLA_E2M1] = k->who_fmt[K_GEMM][CPUMLA_E2M1] = "scalar";
}
