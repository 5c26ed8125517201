/* avx2_rows.c: the AVX2 + FMA + F16C row-wise and attention kernels (rmsnorm, swiglu, softmax,
 * attention part, cache row, read and FMA probes) of the avx2 level, whose linear algebra is in
 * avx2.c; cpumla_fill_avx2 calls cpumla_fill_avx2_rows. Compiled with the same flags as avx2.c.
 * Same semantics as scalar.c, which is the spec. Single-threaded: ops.c splits the work. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#include "core/common.h"
#include "core/kernels.h"
#include "kernels/x86/avx2_common.h"

static const int32_t tail_mask_tab[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};
/* lanes [0, n) set, 0 <= n <= 8 */
INLINE __m256i tail_mask(int64_t n) { return _mm256_loadu_si256((const __m256i *)(tail_mask_tab + 8 - n)); }

/* e^x, within ~1 ulp of expf: Cody-Waite reduction, Cephes polynomial, 2^n applied in two halves so
 * that subnormal results come out right. -inf -> 0, large -> inf, NaN -> NaN. */
INLINE __m256 exp256(__m256 x) {
    x = _mm256_max_ps(_mm256_set1_ps(-104.0f), x);  /* NaN stays in x (second operand) */
    x = _mm256_min_ps(_mm256_set1_ps(88.8f), x);
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i ni = _mm256_cvtps_epi32(n);
    __m256i n1 = _mm256_srai_epi32(ni, 1), n2 = _mm256_sub_epi32(ni, n1);
    __m256i bias = _mm256_set1_epi32(127);
    __m256 s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, bias), 23));
    __m256 s2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, bias), 23));
    return _mm256_mul_ps(_mm256_mul_ps(p, s1), s2);
}

/* ---- rmsnorm, swiglu, softmax -------------------------------------------------------------------- */
static void rmsnorm_row_avx2(const float *x, float *y, int64_t dim, const void *weight, int32_t wdtype,
                             float eps) {
    __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
    int64_t i = 0;
    for (; i + 32 <= dim; i += 32) {
        __m256 a = _mm256_loadu_ps(x + i), b = _mm256_loadu_ps(x + i + 8);
        __m256 c = _mm256_loadu_ps(x + i + 16), d = _mm256_loadu_ps(x + i + 24);
        s0 = _mm256_fmadd_ps(a, a, s0);
        s1 = _mm256_fmadd_ps(b, b, s1);
        s2 = _mm256_fmadd_ps(c, c, s2);
        s3 = _mm256_fmadd_ps(d, d, s3);
    }
    for (; i + 8 <= dim; i += 8) {
        __m256 a = _mm256_loadu_ps(x + i);
        s0 = _mm256_fmadd_ps(a, a, s0);
    }
    if (i < dim) {
        __m256 a = _mm256_maskload_ps(x + i, tail_mask(dim - i));
        s1 = _mm256_fmadd_ps(a, a, s1);
    }
    float ss = hsum8(_mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3)));
    const float inv = 1.0f / sqrtf(ss / (float)dim + eps);
    const __m256 vi = _mm256_set1_ps(inv);
    i = 0;
    for (; i + 8 <= dim; i += 8) {
        __m256 v = _mm256_mul_ps(_mm256_loadu_ps(x + i), vi);
        if (weight) {
            if (wdtype == CPUMLA_F32) v = _mm256_mul_ps(v, _mm256_loadu_ps((const float *)weight + i));
            else if (wdtype == CPUMLA_BF16) v = _mm256_mul_ps(v, ld_bf16((const uint16_t *)weight + i));
            else if (wdtype == CPUMLA_F16) v = _mm256_mul_ps(v, ld_f16((const uint16_t *)weight + i));
            else v = _mm256_set1_ps(NAN);
        }
        _mm256_storeu_ps(y + i, v);
    }
    for (; i < dim; i++) {
        float v = x[i] * inv;
        y[i] = weight ? v * vec_at(weight, wdtype, i) : v;
    }
}

INLINE __m256 swiglu8(__m256 g, __m256 u, float limit) {
    if (limit > 0.0f) {
        __m256 l = _mm256_set1_ps(limit);
        g = _mm256_min_ps(g, l);                                           /* g < l ? g : l */
        u = _mm256_max_ps(_mm256_set1_ps(-limit), _mm256_min_ps(l, u));    /* as the spec, NaN kept */
    }
    __m256 e = exp256(_mm256_sub_ps(_mm256_setzero_ps(), g));
    __m256 s = _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
    return _mm256_mul_ps(s, u);
}

static void swiglu_row_avx2(const float *gate, const float *up, float *out, int64_t dim, float limit) {
    int64_t i = 0;
    for (; i + 8 <= dim; i += 8)
        _mm256_storeu_ps(out + i, swiglu8(_mm256_loadu_ps(gate + i), _mm256_loadu_ps(up + i), limit));
    if (i < dim) {
        __m256i m = tail_mask(dim - i);
        __m256 r = swiglu8(_mm256_maskload_ps(gate + i, m), _mm256_maskload_ps(up + i, m), limit);
        _mm256_maskstore_ps(out + i, m, r);
    }
}

static void softmax_row_avx2(float *x, int64_t n) {
    if (n <= 0) return;
    __m256 m0 = _mm256_set1_ps(-INFINITY), m1 = m0;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        m0 = _mm256_max_ps(_mm256_loadu_ps(x + i), m0);   /* x > m ? x : m, NaN never wins */
        m1 = _mm256_max_ps(_mm256_loadu_ps(x + i + 8), m1);
    }
    m0 = _mm256_max_ps(m1, m0);
    __m128 h = _mm_max_ps(_mm256_extractf128_ps(m0, 1), _mm256_castps256_ps128(m0));
    h = _mm_max_ps(_mm_movehl_ps(h, h), h);
    h = _mm_max_ps(_mm_movehdup_ps(h), h);
    float m = _mm_cvtss_f32(h);
    for (; i < n; i++) m = x[i] > m ? x[i] : m;
    const __m256 vm = _mm256_set1_ps(m);
    __m256 s0 = _mm256_setzero_ps(), s1 = s0;
    for (i = 0; i + 16 <= n; i += 16) {
        __m256 e0 = exp256(_mm256_sub_ps(_mm256_loadu_ps(x + i), vm));
        __m256 e1 = exp256(_mm256_sub_ps(_mm256_loadu_ps(x + i + 8), vm));
        _mm256_storeu_ps(x + i, e0);
        _mm256_storeu_ps(x + i + 8, e1);
        s0 = _mm256_add_ps(s0, e0);
        s1 = _mm256_add_ps(s1, e1);
    }
    for (; i < n; i += 8) {
        __m256i mk = tail_mask(n - i < 8 ? n - i : 8);
        __m256 e = exp256(_mm256_sub_ps(_mm256_maskload_ps(x + i, mk), vm));
        e = _mm256_and_ps(e, _mm256_castsi256_ps(mk));
        _mm256_maskstore_ps(x + i, mk, e);
        s0 = _mm256_add_ps(s0, e);
    }
    const __m256 vs = _mm256_set1_ps(hsum8(_mm256_add_ps(s0, s1)));
    for (i = 0; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, _mm256_div_ps(_mm256_loadu_ps(x + i), vs));
    if (i < n) {
        __m256i mk = tail_mask(n - i);
        _mm256_maskstore_ps(x + i, mk, _mm256_div_ps(_mm256_maskload_ps(x + i, mk), vs));
    }
}

/* ---- attention part ------------------------------------------------------------------------------ */
#define AT_TJ 16                /* KV entries per tile */
#define AT_BUF (AT_TJ * 1024)   /* floats of the BF16 -> fp32 tile */
static __thread float at_tile[AT_BUF] ALIGN64;

/* s_h[j] = q_h . k_j for NH (1 or 2) heads and 4 rows */
INLINE void attn_scores(const int NH, const float *q0, const float *q1, const float *const *k, int64_t dk,
                        float *s0, float *s1) {
    __m256 a[2][4];
    for (int h = 0; h < 2; h++)
        for (int j = 0; j < 4; j++) a[h][j] = _mm256_setzero_ps();
    int64_t d = 0;
    for (; d + 8 <= dk; d += 8) {
        __m256 qa = _mm256_loadu_ps(q0 + d), qb = NH > 1 ? _mm256_loadu_ps(q1 + d) : qa;
        for (int j = 0; j < 4; j++) {
            __m256 kv = _mm256_loadu_ps(k[j] + d);
            a[0][j] = _mm256_fmadd_ps(qa, kv, a[0][j]);
            if (NH > 1) a[1][j] = _mm256_fmadd_ps(qb, kv, a[1][j]);
        }
    }
    if (d < dk) {
        __m256i mk = tail_mask(dk - d);
        __m256 qa = _mm256_maskload_ps(q0 + d, mk), qb = NH > 1 ? _mm256_maskload_ps(q1 + d, mk) : qa;
        for (int j = 0; j < 4; j++) {
            __m256 kv = _mm256_maskload_ps(k[j] + d, mk);
            a[0][j] = _mm256_fmadd_ps(qa, kv, a[0][j]);
            if (NH > 1) a[1][j] = _mm256_fmadd_ps(qb, kv, a[1][j]);
        }
    }
    _mm_storeu_ps(s0, hsum4x8(a[0][0], a[0][1], a[0][2], a[0][3]));
    if (NH > 1) _mm_storeu_ps(s1, hsum4x8(a[1][0], a[1][1], a[1][2], a[1][3]));
}

/* o_h = o_h * c_h + sum_{j < nv} p_h[j] v_j over dv, for NH heads */
INLINE void attn_pv(const int NH, float *o0, float *o1, float c0, float c1, const float *p0, const float *p1,
                    const float *const *v, int nv, int64_t dv) {
    const __m256 vc0 = _mm256_set1_ps(c0), vc1 = _mm256_set1_ps(c1);
    int64_t d = 0;
    for (; d + 32 <= dv; d += 32) {
        __m256 a[2][4];
        for (int k = 0; k < 4; k++) {
            a[0][k] = _mm256_mul_ps(_mm256_loadu_ps(o0 + d + 8 * k), vc0);
            if (NH > 1) a[1][k] = _mm256_mul_ps(_mm256_loadu_ps(o1 + d + 8 * k), vc1);
        }
        for (int j = 0; j < nv; j++) {
            __m256 pa = _mm256_broadcast_ss(p0 + j), pb = NH > 1 ? _mm256_broadcast_ss(p1 + j) : pa;
            for (int k = 0; k < 4; k++) {
                __m256 vv = _mm256_loadu_ps(v[j] + d + 8 * k);
                a[0][k] = _mm256_fmadd_ps(pa, vv, a[0][k]);
                if (NH > 1) a[1][k] = _mm256_fmadd_ps(pb, vv, a[1][k]);
            }
        }
        for (int k = 0; k < 4; k++) {
            _mm256_storeu_ps(o0 + d + 8 * k, a[0][k]);
            if (NH > 1) _mm256_storeu_ps(o1 + d + 8 * k, a[1][k]);
        }
    }
    for (; d < dv; d += 8) {
        __m256i mk = tail_mask(dv - d < 8 ? dv - d : 8);
        __m256 a0 = _mm256_mul_ps(_mm256_maskload_ps(o0 + d, mk), vc0);
        __m256 a1 = NH > 1 ? _mm256_mul_ps(_mm256_maskload_ps(o1 + d, mk), vc1) : a0;
        for (int j = 0; j < nv; j++) {
            __m256 vv = _mm256_maskload_ps(v[j] + d, mk);
            a0 = _mm256_fmadd_ps(_mm256_broadcast_ss(p0 + j), vv, a0);
            if (NH > 1) a1 = _mm256_fmadd_ps(_mm256_broadcast_ss(p1 + j), vv, a1);
        }
        _mm256_maskstore_ps(o0 + d, mk, a0);
        if (NH > 1) _mm256_maskstore_ps(o1 + d, mk, a1);
    }
}

/* scores of one head for the tile -> online-softmax update; returns the rescale factor, writes p */
static float attn_update(const float *s, int nv, float scale, float *mh, float *lh, float *p) {
    float mt = *mh;
    for (int j = 0; j < nv; j++) {
        p[j] = s[j] * scale;
        mt = p[j] > mt ? p[j] : mt;
    }
    float c = 1.0f;
    if (mt > *mh) { c = expf(*mh - mt); *mh = mt; }
    float l = *lh * c;
    for (int j = 0; j < nv; j++) {
        p[j] = expf(p[j] - *mh);
        l += p[j];
    }
    *lh = l;
    return c;
}

INLINE void attn_heads(const int NH, const cpumla_attn_args *a, int64_t qi, int64_t h, int64_t h0,
                       const float *const *rows, int nv, float *acc, float *m, float *l) {
    float s[2][AT_TJ + 4], p[2][AT_TJ];
    const float *q0 = a->q + qi * a->ldq_t + h * a->ldq_h, *q1 = NH > 1 ? q0 + a->ldq_h : q0;
    for (int j = 0; j < nv; j += 4) {
        const float *k[4];
        for (int t = 0; t < 4; t++) k[t] = rows[j + t < nv ? j + t : j];
        attn_scores(NH, q0, q1, k, a->dk, s[0] + j, s[1] + j);
    }
    const int64_t k0 = h - h0;
    float c0 = attn_update(s[0], nv, a->scale, m + k0, l + k0, p[0]);
    float c1 = NH > 1 ? attn_update(s[1], nv, a->scale, m + k0 + 1, l + k0 + 1, p[1]) : c0;
    attn_pv(NH, acc + k0 * a->dv, acc + (k0 + (NH > 1)) * a->dv, c0, c1, p[0], p[1], rows, nv, a->dv);
}

/* Rows too wide for the tile buffer go to the entry this one replaced (the scalar spec). */
static void (*prev_attn_part)(const cpumla_attn_args *, int64_t, int64_t, int64_t, int64_t, int64_t, float *,
                              float *, float *);

static void attn_part_avx2(const cpumla_attn_args *a, int64_t qi, int64_t h0, int64_t h1, int64_t j0,
                           int64_t j1, float *acc, float *m, float *l) {
    const int64_t dk = a->dk, dv = a->dv, dmax = dk > dv ? dk : dv, ldt = (dmax + 7) & ~(int64_t)7;
    const int bf = a->kv_dtype == CPUMLA_BF16;
    int tj = AT_TJ;
    if (bf && AT_BUF / ldt < tj) tj = (int)(AT_BUF / ldt);
    if (tj < 1) { prev_attn_part(a, qi, h0, h1, j0, j1, acc, m, l); return; }
    for (int64_t h = h0; h < h1; h++) { m[h - h0] = -INFINITY; l[h - h0] = 0.0f; }
    memset(acc, 0, (size_t)((h1 - h0) * dv) * sizeof(float));
    const float *rows[AT_TJ];
    int64_t j = j0;
    while (j < j1) {
        int nv = 0;
        for (; j < j1 && nv < tj; j++) {
            const void *row = attn_kv_row(a, qi, j);
            if (!row) continue;
            if (bf) {
                float *t = at_tile + nv * ldt;
                const uint16_t *rb = (const uint16_t *)row;
                int64_t d = 0;
                for (; d + 8 <= dmax; d += 8) _mm256_store_ps(t + d, ld_bf16(rb + d));
                for (; d < dmax; d++) t[d] = bf16_to_f32(rb[d]);
                rows[nv++] = t;
            } else {
                rows[nv++] = (const float *)row;
            }
        }
        if (!nv) break;
        int64_t h = h0;
        for (; h + 2 <= h1; h += 2) attn_heads(2, a, qi, h, h0, rows, nv, acc, m, l);
        if (h < h1) attn_heads(1, a, qi, h, h0, rows, nv, acc, m, l);
    }
}

/* ---- cache row, read probe ----------------------------------------------------------------------- */
static void cache_row_avx2(void *dst, int32_t dtype, const float *src, int64_t width) {
    if (dtype != CPUMLA_BF16) { memcpy(dst, src, (size_t)width * sizeof(float)); return; }
    uint16_t *d = (uint16_t *)dst;
    int64_t i = 0;
    for (; i + 16 <= width; i += 16) {
        __m256i a = bf16_round8(_mm256_loadu_si256((const __m256i *)(src + i)));
        __m256i b = bf16_round8(_mm256_loadu_si256((const __m256i *)(src + i + 8)));
        _mm256_storeu_si256((__m256i *)(d + i), _mm256_permute4x64_epi64(_mm256_packus_epi32(a, b), 0xd8));
    }
    for (; i < width; i++) d[i] = f32_to_bf16(src[i]);
}

/* the sum of the buffer as doubles; 8 independent 256-bit accumulators keep enough loads in flight */
static double read_sum_avx2(const void *buf, int64_t bytes) {
    const double *p = (const double *)buf;
    const int64_t n = bytes / 8;
    __m256d s0 = _mm256_setzero_pd(), s1 = s0, s2 = s0, s3 = s0, s4 = s0, s5 = s0, s6 = s0, s7 = s0;
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        s0 = _mm256_add_pd(s0, _mm256_loadu_pd(p + i));
        s1 = _mm256_add_pd(s1, _mm256_loadu_pd(p + i + 4));
        s2 = _mm256_add_pd(s2, _mm256_loadu_pd(p + i + 8));
        s3 = _mm256_add_pd(s3, _mm256_loadu_pd(p + i + 12));
        s4 = _mm256_add_pd(s4, _mm256_loadu_pd(p + i + 16));
        s5 = _mm256_add_pd(s5, _mm256_loadu_pd(p + i + 20));
        s6 = _mm256_add_pd(s6, _mm256_loadu_pd(p + i + 24));
        s7 = _mm256_add_pd(s7, _mm256_loadu_pd(p + i + 28));
    }
    for (; i + 4 <= n; i += 4) s0 = _mm256_add_pd(s0, _mm256_loadu_pd(p + i));
    s0 = _mm256_add_pd(_mm256_add_pd(_mm256_add_pd(s0, s1), _mm256_add_pd(s2, s3)),
                       _mm256_add_pd(_mm256_add_pd(s4, s5), _mm256_add_pd(s6, s7)));
    double s[4];
    _mm256_storeu_pd(s, s0);
    return (s[0] + s[1]) + (s[2] + s[3]);
}


/* FMA-throughput probe: 12 independent accumulators hide the FMA latency. */
static double fma_loop_avx2(int64_t iters, float *sink) {
    __m256 a0 = _mm256_set1_ps(1.0f), a1 = _mm256_set1_ps(1.1f), a2 = _mm256_set1_ps(1.2f), a3 = _mm256_set1_ps(1.3f), a4 = _mm256_set1_ps(1.4f),
           a5 = _mm256_set1_ps(1.5f), a6 = _mm256_set1_ps(1.6f), a7 = _mm256_set1_ps(1.7f), a8 = _mm256_set1_ps(1.8f), a9 = _mm256_set1_ps(1.9f),
           a10 = _mm256_set1_ps(2.0f), a11 = _mm256_set1_ps(2.1f);
    const __m256 m = _mm256_set1_ps(0.999999f), c = _mm256_set1_ps(1e-7f);
    for (int64_t i = 0; i < iters; i++) {
        a0 = _mm256_fmadd_ps(a0, m, c); a1 = _mm256_fmadd_ps(a1, m, c); a2 = _mm256_fmadd_ps(a2, m, c); a3 = _mm256_fmadd_ps(a3, m, c);
        a4 = _mm256_fmadd_ps(a4, m, c); a5 = _mm256_fmadd_ps(a5, m, c); a6 = _mm256_fmadd_ps(a6, m, c); a7 = _mm256_fmadd_ps(a7, m, c);
        a8 = _mm256_fmadd_ps(a8, m, c); a9 = _mm256_fmadd_ps(a9, m, c); a10 = _mm256_fmadd_ps(a10, m, c); a11 = _mm256_fmadd_ps(a11, m, c);
    }
    __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)), _mm256_add_ps(_mm256_add_ps(a4, a5), _mm256_add_ps(a6, a7)));
    s = _mm256_add_ps(s, _mm256_add_ps(_mm256_add_ps(a8, a9), _mm256_add_ps(a10, a11)));
    float buf[8];
    _mm256_storeu_ps(buf, s);
    for (int j = 0; j < 8; j++) *sink += buf[j];
    return 2.0 * 12.0 * 8.0 * (double)iters;
}

/* kernels.h: one online-softmax step over a block of scores (cpumla_mla_mha) */
static float softmax_block_avx2(float *s, int64_t n, int64_t valid, float scale, float *m, float *l) {
    const __m256 sc = _mm256_set1_ps(scale), tiny = _mm256_set1_ps(1.17549435e-38f);
    const float mo = *m;
    __m256 mv = _mm256_set1_ps(mo);
    for (int64_t j = 0; j < valid; j += 8) {
        __m256i k = tail_mask(valid - j < 8 ? valid - j : 8);
        __m256 x = _mm256_mul_ps(_mm256_maskload_ps(s + j, k), sc);
        mv = _mm256_blendv_ps(mv, _mm256_max_ps(x, mv), _mm256_castsi256_ps(k));   /* NaN never wins */
    }
    __m128 h = _mm_max_ps(_mm256_extractf128_ps(mv, 1), _mm256_castps256_ps128(mv));
    h = _mm_max_ps(_mm_movehl_ps(h, h), h);
    h = _mm_max_ps(_mm_movehdup_ps(h), h);
    const float mn = _mm_cvtss_f32(h);
    const __m256 mnv = _mm256_set1_ps(mn);
    __m256 sum = _mm256_setzero_ps();
    for (int64_t j = 0; j < n; j += 8) {
        __m256i kv = tail_mask(valid - j < 0 ? 0 : valid - j < 8 ? valid - j : 8);
        __m256 e = exp256(_mm256_sub_ps(_mm256_mul_ps(_mm256_maskload_ps(s + j, kv), sc), mnv));
        e = _mm256_and_ps(_mm256_andnot_ps(_mm256_cmp_ps(e, tiny, _CMP_LT_OQ), e), _mm256_castsi256_ps(kv));
        if (n - j >= 8) _mm256_storeu_ps(s + j, e);
        else _mm256_maskstore_ps(s + j, tail_mask(n - j), e);
        sum = _mm256_add_ps(sum, e);
    }
    const float c = mn == -INFINITY ? 1.0f : flush_tiny(expf(mo - mn));
    *l = *l * c + hsum8(sum);
    *m = mn;
    return c;
}

void cpumla_fill_avx2_rows(cpumla_kernels *k) {
    k->fma_loop = fma_loop_avx2;
    k->dot_loop = fma_loop_avx2;           /* avx2.c decodes BF16 weights to fp32 for its FMAs */
    k->who[K_FMA] = k->who[K_DOT] = "avx2";
    k->rmsnorm_row = rmsnorm_row_avx2;
    k->swiglu_row = swiglu_row_avx2;
    k->softmax_row = softmax_row_avx2;
    if (k->attn_part != attn_part_avx2) prev_attn_part = k->attn_part;
    k->attn_part = attn_part_avx2;
    k->softmax_block = softmax_block_avx2;
    k->cache_row = cache_row_avx2;
    k->read_sum = read_sum_avx2;
    for (int i = K_RMSNORM; i <= K_READ; i++) k->who[i] = "avx2";
    k->who[K_SOFTMAX_BLOCK] = "avx2";
    k->who[K_ATTN] = "avx2 (scalar for BF16 rows wider than 16384)";     /* AT_BUF */
}
