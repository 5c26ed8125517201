/* scalar.c: portable C for every kernel. This is the spec the other implementations are tested
 * against: readable first, fast second. Compiled with baseline flags only. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "core/common.h"
#include "core/kernels.h"
#include "core/sample.h"

const char cpumla_flags_scalar[] = CPUMLA_FLAGS;

/* Dot product of row r with x. E4M3: each code times its activation operand e4m3_act (x times the
 * block scale, rounded to bf16). E2M1 (the layouts kern_gemv does not take to the integer product:
 * partial edge blocks, wider blocks, F32 scales; every ISA hands them here, gemv and gemm alike):
 * block by block, each scale applied once per block to the block's partial sum. */
static float row_dot(const cpumla_weight *w, int64_t r, const float *x) {
    const uint8_t *row = weight_row(w, r);
    float acc = 0.0f;
    switch (w->dtype) {
    case CPUMLA_F32:
        for (int64_t c = 0; c < w->cols; c++) acc += ((const float *)row)[c] * x[c];
        return acc;
    case CPUMLA_BF16:
        for (int64_t c = 0; c < w->cols; c++) acc += bf16_to_f32(((const uint16_t *)row)[c]) * bf16_round(x[c]);
        return acc;
    case CPUMLA_F16:
        for (int64_t c = 0; c < w->cols; c++) acc += f16_to_f32(((const uint16_t *)row)[c]) * x[c];
        return acc;
    case CPUMLA_E4M3:
        for (int64_t c = 0; c < w->cols; c++) acc += e4m3_to_f32(row[c]) * e4m3_act(w, r, c, x[c]);
        return acc;
    case CPUMLA_E2M1:
        for (int64_t c0 = 0; c0 < w->cols; c0 += w->block_cols) {
            int64_t c1 = c0 + w->block_cols < w->cols ? c0 + w->block_cols : w->cols;
            float part = 0.0f;
            for (int64_t c = c0; c < c1; c++) {
                part += cpumla_e2m1_lut[(c & 1) ? (row[c >> 1] >> 4) : (row[c >> 1] & 15)] * x[c];
            }
            acc += part * weight_scale(w, r, c0);
        }
        return acc;
    default:
        return NAN;
    }
}

static void gemv_scalar(const cpumla_weight *w, const float *x, float *y, int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; r++) y[r - r0] = row_dot(w, r, x);
}

static void gemm_scalar(const cpumla_weight *w, const float *x, int64_t ldx, int64_t n, float *y,
                        int64_t ldy, int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; r++)
        for (int64_t t = 0; t < n; t++) y[t * ldy + (r - r0)] = row_dot(w, r, x + t * ldx);
}

static void dequant_row_scalar(const cpumla_weight *w, int64_t r, int64_t c0, int64_t c1, float *out) {
    for (int64_t c = c0; c < c1; c++) out[c - c0] = weight_at(w, r, c);
}

static void gemv_t_scalar(const cpumla_weight *w, int64_t r0, int64_t nr, const float *x, float *y,
                          int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; c++) y[c - c0] = 0.0f;
    for (int64_t i = 0; i < nr; i++) {
        const uint8_t *row = weight_row(w, r0 + i);
        if (w->dtype == CPUMLA_E4M3) {
            for (int64_t c = c0; c < c1; c++) y[c - c0] += e4m3_to_f32(row[c]) * e4m3_act(w, r0 + i, c, x[i]);
            continue;
        }
        float xi = w->dtype == CPUMLA_BF16 ? bf16_round(x[i]) : x[i];
        for (int64_t c = c0; c < c1; c++) y[c - c0] += xi * weight_at(w, r0 + i, c);
    }
}

static void rmsnorm_row_scalar(const float *x, float *y, int64_t dim, const void *weight,
                               int32_t wdtype, float eps) {
    float ss = 0.0f;
    for (int64_t i = 0; i < dim; i++) ss += x[i] * x[i];
    float inv = 1.0f / sqrtf(ss / (float)dim + eps);
    for (int64_t i = 0; i < dim; i++) {
        float v = x[i] * inv;
        y[i] = weight ? v * vec_at(weight, wdtype, i) : v;
    }
}

static void swiglu_row_scalar(const float *gate, const float *up, float *out, int64_t dim, float limit) {
    for (int64_t i = 0; i < dim; i++) out[i] = swiglu1(gate[i], up[i], limit);
}

static void softmax_row_scalar(float *x, int64_t n) {
    float m = -INFINITY;
    for (int64_t i = 0; i < n; i++) m = x[i] > m ? x[i] : m;
    float s = 0.0f;
    for (int64_t i = 0; i < n; i++) { x[i] = expf(x[i] - m); s += x[i]; }
    for (int64_t i = 0; i < n; i++) x[i] /= s;
}

static inline float kv_at(const cpumla_attn_args *a, const void *row, int64_t d) {
    return a->kv_dtype == CPUMLA_BF16 ? bf16_to_f32(((const uint16_t *)row)[d]) : ((const float *)row)[d];
}

/* Online softmax over the entries, one head at a time. */
static void attn_part_scalar(const cpumla_attn_args *a, int64_t qi, int64_t h0, int64_t h1, int64_t j0,
                             int64_t j1, float *acc, float *m, float *l) {
    for (int64_t h = h0; h < h1; h++) {
        const float *q = a->q + qi * a->ldq_t + h * a->ldq_h;
        float *o = acc + (h - h0) * a->dv;
        float mh = -INFINITY, lh = 0.0f;
        for (int64_t d = 0; d < a->dv; d++) o[d] = 0.0f;
        for (int64_t j = j0; j < j1; j++) {
            const void *row = attn_kv_row(a, qi, j);
            if (!row) continue;
            float s = 0.0f;
            for (int64_t d = 0; d < a->dk; d++) s += q[d] * kv_at(a, row, d);
            s *= a->scale;
            if (s > mh) {                       /* rescale what we have so far */
                float c = expf(mh - s);         /* mh = -inf the first time: c = 0 */
                lh *= c;
                for (int64_t d = 0; d < a->dv; d++) o[d] *= c;
                mh = s;
            }
            float p = expf(s - mh);
            lh += p;
            for (int64_t d = 0; d < a->dv; d++) o[d] += p * kv_at(a, row, d);
        }
        m[h - h0] = mh;
        l[h - h0] = lh;
    }
}

/* kernels.h: one online-softmax step over a block of scores (cpumla_mla_mha) */
static float softmax_block_scalar(float *s, int64_t n, int64_t valid, float scale, float *m, float *l) {
    float mo = *m, mn = mo;
    for (int64_t j = 0; j < valid; j++) {
        float x = s[j] * scale;
        mn = x > mn ? x : mn;                   /* a NaN never wins */
    }
    float sum = 0.0f;
    for (int64_t j = 0; j < valid; j++) {
        s[j] = flush_tiny(expf(s[j] * scale - mn));
        sum += s[j];
    }
    for (int64_t j = valid; j < n; j++) s[j] = 0.0f;
    float c = mn == -INFINITY ? 1.0f : flush_tiny(expf(mo - mn));
    *l = *l * c + sum;
    *m = mn;
    return c;
}

static void cache_row_scalar(void *dst, int32_t dtype, const float *src, int64_t width) {
    if (dtype == CPUMLA_BF16) {
        for (int64_t i = 0; i < width; i++) ((uint16_t *)dst)[i] = f32_to_bf16(src[i]);
    } else {
        memcpy(dst, src, (size_t)width * sizeof(float));
    }
}

static double read_sum_scalar(const void *buf, int64_t bytes) {
    const double *p = (const double *)buf;
    double s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    for (int64_t i = 0; i + 4 <= bytes / 8; i += 4) {
        s0 += p[i]; s1 += p[i + 1]; s2 += p[i + 2]; s3 += p[i + 3];
    }
    return (s0 + s1) + (s2 + s3);
}

static double fma_loop_scalar(int64_t iters, float *sink) {
    float a[8] = {1, 2, 3, 4, 5, 6, 7, 8};
    const float m = 0.999999f, c = 1e-7f;
    for (int64_t i = 0; i < iters; i++)
        for (int j = 0; j < 8; j++) a[j] = a[j] * m + c;
    float s = 0;
    for (int j = 0; j < 8; j++) s += a[j];
    *sink += s;
    return 2.0 * 8.0 * (double)iters;
}

void cpumla_fill_scalar(cpumla_kernels *k) {
    k->gemv = gemv_scalar;
    k->gemm = gemm_scalar;
    k->gemm_xb = NULL;                     /* no bf16 arithmetic here: gemm rounds x itself */
    k->gemv_t = gemv_t_scalar;
    k->dequant_row = dequant_row_scalar;
    k->rmsnorm_row = rmsnorm_row_scalar;
    k->swiglu_row = swiglu_row_scalar;
    k->softmax_row = softmax_row_scalar;
    k->attn_part = attn_part_scalar;
    k->softmax_block = softmax_block_scalar;
    k->cache_row = cache_row_scalar;
    k->read_sum = read_sum_scalar;
    k->fma_loop = fma_loop_scalar;
    k->dot_loop = fma_loop_scalar;         /* BF16 products here are fp32 FMAs */
    for (int i = 0; i < K_COUNT; i++) k->who[i] = "scalar";
    for (int i = K_GEMV; i <= K_DEQUANT; i++)
        for (int f = 0; f <= CPUMLA_E2M1; f++) k->who_fmt[i][f] = "scalar";
    k->sample_passes = &cpumla_sample_passes_scalar;
    cpumla_fill_scalar_q(k);               /* scalar_q.c: the integer products' spec */
}

/* The weight operands row_dot multiplies (cpumla_decode_operands): the codes' exact values. */
int cpumla_decode_operands_scalar(int dtype, float *out) {
    if (dtype == CPUMLA_E4M3) {
        for (int i = 0; i < 256; i++) out[i] = e4m3_to_f32((uint8_t)i);
        return 0;
    }
    return -1;
}
