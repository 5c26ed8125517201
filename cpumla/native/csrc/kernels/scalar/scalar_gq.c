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

/* a row's product with one activation row: chunks unpacked 8 at a time, each added in column order */
static float row_dot_gq(const cpumla_weight *w, int64_t r, const int8_t *xq, const float *xd) {
    const gq_type *t = gq_info(w->dtype);
    const uint8_t *row = (const uint8_t *)w->data + r * w->row_bytes;
    float acc = 0.0f;
    gq_unpacked u;
    for (int64_t c0 = 0; c0 < w->cols; c0 += 256) {
        const int n = w->cols - c0 >= 256 ? 8 : (int)((w->cols - c0) / 32);
        gq_unpack(w->dtype, row, c0, n, &u);
        for (int c = 0; c < n; c++) acc += gq_chunk_spec(&u, c, t->has_min, xq + c0 + 32 * c, xd[c0 / 32 + c]);
    }
    return acc;
}

static void gemm_gq_scalar(const cpumla_weight *w, const void *qx, int64_t n, float *y, int64_t ldy, int64_t r0,
                           int64_t r1) {
    const int64_t K = w->cols, per = QX_BYTES(K);
    for (int64_t t = 0; t < n; t++) {
        const uint8_t *xt = (const uint8_t *)qx + t * per;
        for (int64_t r = r0; r < r1; r++) y[t * ldy + (r - r0)] = row_dot_gq(w, r, (const int8_t *)xt, qx_d(xt, K));
    }
}

/* the values of columns [c0, c1) of row r, as gq_value gives them, a unit (256 columns) at a time */
static void dequant_gq_scalar(const cpumla_weight *w, int64_t r, int64_t c0, int64_t c1, float *out) {
    const gq_type *t = gq_info(w->dtype);
    const uint8_t *row = (const uint8_t *)w->data + r * w->row_bytes;
    gq_unpacked u;
    for (int64_t u0 = c0 / 256 * 256; u0 < c1; u0 += 256) {
        const int n = w->cols - u0 >= 256 ? 8 : (int)((w->cols - u0) / 32);
        gq_unpack(w->dtype, row, u0, n, &u);
        const int64_t lo = u0 > c0 ? u0 : c0, hi = u0 + 32 * n < c1 ? u0 + 32 * n : c1;
        for (int64_t c = lo; c < hi; c++) {
            const int j = (int)(c - u0), ch = j / 32;
            const float v = (u.d[ch] * (float)u.s[j / 16]) * (float)u.q[j];
            out[c - c0] = t->has_min ? v - u.dm[ch] * (float)u.m[j / 16] : v;
        }
    }
}

/* y[c - c0] = sum_i x[i] * W[r0 + i, c], rows in order, each term rounded once (fp32) */
static void gemv_t_gq_scalar(const cpumla_weight *w, int64_t r0, int64_t nr, const float *x, float *y, int64_t c0,
                             int64_t c1) {
    float row[256];
    for (int64_t c = c0; c < c1; c++) y[c - c0] = 0.0f;
    for (int64_t i = 0; i < nr; i++)
        for (int64_t a = c0; a < c1; a += 256) {
            const int64_t b = a + 256 < c1 ? a + 256 : c1;
            dequant_gq_scalar(w, r0 + i, a, b, row);
            for (int64_t c = a; c < b; c++) y[c - c0] += x[i] * row[c - a];
        }
}

void cpumla_fill_scalar_gq(cpumla_kernels *k) {
    for (int t = 0; t < GQ_N; t++) k->gemm_gq[t] = gemm_gq_scalar;
    k->quant_gq = gq_quant_x;
    k->gemv_t_gq = gemv_t_gq_scalar;
    k->dequant_gq = dequant_gq_scalar;
    for (int i = K_GEMV; i <= K_DEQUANT; i++)
        for (int f = CPUMLA_Q8_0; f <= CPUMLA_MXFP4; f++) k->who_fmt[i][f] = "scalar";
}
