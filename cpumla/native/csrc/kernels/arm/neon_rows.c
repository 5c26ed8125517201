/* neon_rows.c: the aarch64 ASIMD row-wise and attention kernels (rmsnorm, swiglu, softmax and the
 * vector exp they use, attention part, cache row, read probe) of the neon level, whose linear
 * algebra is in neon.c; cpumla_fill_neon calls cpumla_fill_neon_rows. Compiled with the same flags
 * as neon.c. Same semantics as scalar.c (the spec); only the order of fp32 additions differs. */
#include <arm_neon.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#include "core/common.h"
#include "core/kernels.h"
#include "kernels/arm/neon_common.h"

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
    for (; i < dim; i++) out[i] = swiglu1(gate[i], up[i], limit);
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

/* The data summed as doubles (cpumla.h's contract, as the other levels): four two-lane accumulators. */
static double read_sum_neon(const void *buf, int64_t bytes) {
    const double *p = (const double *)buf;
    float64x2_t a0 = vdupq_n_f64(0), a1 = a0, b0 = a0, b1 = a0;
    int64_t n = bytes / 8, i = 0;
    for (; i + 8 <= n; i += 8) {
        a0 = vaddq_f64(a0, vld1q_f64(p + i));
        a1 = vaddq_f64(a1, vld1q_f64(p + i + 2));
        b0 = vaddq_f64(b0, vld1q_f64(p + i + 4));
        b1 = vaddq_f64(b1, vld1q_f64(p + i + 6));
    }
    a0 = vaddq_f64(a0, b0);
    a1 = vaddq_f64(a1, b1);
    for (; i + 2 <= n; i += 2) a0 = vaddq_f64(a0, vld1q_f64(p + i));
    a0 = vaddq_f64(a0, a1);
    double s = vgetq_lane_f64(a0, 0) + vgetq_lane_f64(a0, 1);
    for (; i < n; i++) s += p[i];
    return s;
}

/* kernels.h: one online-softmax step over a block of scores (cpumla_mla_mha) */
static float softmax_block_neon(float *s, int64_t n, int64_t valid, float scale, float *m, float *l) {
    const float32x4_t sc = vdupq_n_f32(scale), tiny = vdupq_n_f32(1.17549435e-38f);
    const float mo = *m;
    float32x4_t mv = vdupq_n_f32(mo);
    int64_t j = 0;
    for (; j + 4 <= valid; j += 4) mv = vmaxnmq_f32(mv, vmulq_f32(vld1q_f32(s + j), sc));   /* NaN never wins */
    float mn = vmaxnmvq_f32(mv);
    for (; j < valid; j++) {
        float x = s[j] * scale;
        mn = x > mn ? x : mn;
    }
    const float32x4_t mnv = vdupq_n_f32(mn);
    float32x4_t sv = vdupq_n_f32(0);
    for (j = 0; j + 4 <= valid; j += 4) {
        float32x4_t e = exp_f32x4(vsubq_f32(vmulq_f32(vld1q_f32(s + j), sc), mnv));
        e = vreinterpretq_f32_u32(vbicq_u32(vreinterpretq_u32_f32(e), vcltq_f32(e, tiny)));   /* below FLT_MIN: 0 */
        vst1q_f32(s + j, e);
        sv = vaddq_f32(sv, e);
    }
    float sum = vaddvq_f32(sv);
    for (; j < valid; j++) { s[j] = flush_tiny(expf(s[j] * scale - mn)); sum += s[j]; }
    for (; j < n; j++) s[j] = 0.0f;
    const float c = mn == -INFINITY ? 1.0f : flush_tiny(expf(mo - mn));
    *l = *l * c + sum;
    *m = mn;
    return c;
}

void cpumla_fill_neon_rows(cpumla_kernels *k) {
    k->rmsnorm_row = rmsnorm_row_neon; k->who[K_RMSNORM] = "neon";
    k->swiglu_row = swiglu_row_neon;   k->who[K_SWIGLU] = "neon";
    k->softmax_row = softmax_row_neon; k->who[K_SOFTMAX] = "neon";
    k->attn_part = attn_part_neon;     k->who[K_ATTN] = "neon";
    k->softmax_block = softmax_block_neon; k->who[K_SOFTMAX_BLOCK] = "neon";
    k->cache_row = cache_row_neon;     k->who[K_CACHE_ROW] = "neon";
    k->read_sum = read_sum_neon;       k->who[K_READ] = "neon";
}
