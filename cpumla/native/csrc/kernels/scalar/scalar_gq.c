/* scalar_gq.c: the spec of GGUF's block formats' products (gguf_q.h; kernels.h), portable C, and the
 * activation quantization every level's gemm_gq reads (gq_quant_x). */
#include <math.h>
#include <stdint.h>
#include <string.h>
#include "core/common.h"
#include "core/gguf_q.h"
#include "core/quant.h"

/* quant_x's spec for Q8: codes in column order, xd per block, the int32 code sum; zero past K */
void gq_quant_x(const float *x, int64_t K, void *qx) {
    int8_t *q = qx;
    float *d = qx_d(qx, K);
    int32_t *s = qx_s(qx, K);
    const int64_t nb = K / QK, kp = qx_kp(K);
    for (int64_t b = 0; b < nb; b++) {
        int32_t c[QK], sum = 0;
        d[b] = q_act_block(x + b * QK, QACT_MAX8, c);
        for (int i = 0; i < QK; i++) {
            q[b * QK + i] = (int8_t)c[i];
            sum += c[i];
        }
        s[b] = sum;
    }
    memset(q + K, 0, (size_t)(kp - K));
    for (int64_t b = nb; b < kp / QK; b++) { d[b] = 0.0f; s[b] = 0; }
}

static float row_dot_gq8(const cpumla_weight *w, int64_t r, const int8_t *xq, const float *xd) {
    float acc = 0.0f;
    for (int64_t b = 0; b < w->cols / QK; b++) {
        const uint8_t *blk = gq8_block(w, r, b);
        const int8_t *q = gq8_codes(blk);
        int32_t isum = 0;
        for (int i = 0; i < QK; i++) isum += (int32_t)q[i] * (int32_t)xq[b * QK + i];
        acc += gq_block_product(isum, gq8_scale(blk), xd[b]);
    }
    return acc;
}

static void gemm_gq_scalar(const cpumla_weight *w, const void *qx, int64_t n, float *y, int64_t ldy, int64_t r0,
                           int64_t r1) {
    const int64_t K = w->cols, per = QX_BYTES(K);
    for (int64_t t = 0; t < n; t++) {
        const uint8_t *xt = (const uint8_t *)qx + t * per;
        for (int64_t r = r0; r < r1; r++) y[t * ldy + (r - r0)] = row_dot_gq8(w, r, (const int8_t *)xt, qx_d(xt, K));
    }
}

/* y[c - c0] = sum_i (x[i] * d) * q, rows in order (fp32, as Q8's gemv_t_q) */
static void gemv_t_gq_scalar(const cpumla_weight *w, int64_t r0, int64_t nr, const float *x, float *y, int64_t c0,
                             int64_t c1) {
    for (int64_t c = c0; c < c1; c++) y[c - c0] = 0.0f;
    for (int64_t i = 0; i < nr; i++) {
        for (int64_t b = c0 / QK; b * QK < c1; b++) {
            const uint8_t *blk = gq8_block(w, r0 + i, b);
            const int8_t *q = gq8_codes(blk);
            const float xs = x[i] * gq8_scale(blk);
            const int64_t lo = b * QK > c0 ? b * QK : c0, hi = (b + 1) * QK < c1 ? (b + 1) * QK : c1;
            for (int64_t c = lo; c < hi; c++) y[c - c0] += xs * (float)q[c - b * QK];
        }
    }
}

static void dequant_gq_scalar(const cpumla_weight *w, int64_t r, int64_t c0, int64_t c1, float *out) {
    for (int64_t c = c0; c < c1; c++) out[c - c0] = weight_at(w, r, c);
}

void cpumla_fill_scalar_gq(cpumla_kernels *k) {
    k->gemm_gq = gemm_gq_scalar;
    k->gemv_t_gq = gemv_t_gq_scalar;
    k->dequant_gq = dequant_gq_scalar;
    for (int i = K_GEMV; i <= K_DEQUANT; i++) k->who_fmt[i][CPUMLA_Q8_0] = "scalar";
}
