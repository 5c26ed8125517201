/* avx512f_rows.c: the AVX-512 row-wise and attention kernels (softmax, rmsnorm, swiglu and the vector
 * exp they use, attention part, cache row, read and FMA probes) of the avx512f level (F/BW/VL/DQ),
 * whose linear algebra is in avx512f.c; cpumla_fill_avx512f calls cpumla_fill_avx512f_rows. Compiled
 * with the same flags as avx512f.c. Same semantics as scalar.c (the spec), to fp32 rounding. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#include "core/common.h"
#include "core/kernels.h"
#include "kernels/x86/avx512_common.h"

/* The entries we replace, for the rare shapes we leave to them (attention rows wider than the tile). */
static void (*prev_attn_part)(const cpumla_attn_args *, int64_t, int64_t, int64_t, int64_t, int64_t,
                              float *, float *, float *);

/* ---- exp, softmax, rmsnorm, swiglu -------------------------------------------------------------- */
/* expf to ~1 ulp (SLEEF's xexpf polynomial; 2^q applied with vscalefps, which rounds subnormal
 * results once). Inputs are clamped to [-104, 100] (results 0 and inf there); NaN stays NaN. */
INLINE __m512 exp512(__m512 x) {
    x = _mm512_max_ps(_mm512_set1_ps(-104.0f), x);     /* second operand wins on NaN */
    x = _mm512_min_ps(_mm512_set1_ps(100.0f), x);
    __m512 q = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.442695040888963407f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 s = _mm512_fnmadd_ps(q, _mm512_set1_ps(0.693145751953125f), x);
    s = _mm512_fnmadd_ps(q, _mm512_set1_ps(1.428606765330187045e-06f), s);
    __m512 u = _mm512_set1_ps(0.000198527617612853646278381f);
    u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.00139304355252534151077271f));
    u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.00833336077630519866943359f));
    u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.0416664853692054748535156f));
    u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.166666671633720397949219f));
    u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.5f));
    u = _mm512_add_ps(_mm512_set1_ps(1.0f), _mm512_fmadd_ps(_mm512_mul_ps(s, s), u, s));
    return _mm512_scalef_ps(u, q);
}

static void softmax_row_avx512(float *x, int64_t n) {
    __m512 mv = _mm512_set1_ps(-INFINITY);
    for (int64_t i = 0; i < n; i += 16)
        mv = _mm512_max_ps(_mm512_mask_loadu_ps(mv, tail16(n - i), x + i), mv);   /* NaN never wins */
    __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mv));
    __m512 sv = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) {
        __mmask16 k = tail16(n - i);
        __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, x + i), m));
        _mm512_mask_storeu_ps(x + i, k, e);
        sv = _mm512_add_ps(sv, _mm512_maskz_mov_ps(k, e));
    }
    __m512 s = _mm512_set1_ps(_mm512_reduce_add_ps(sv));
    for (int64_t i = 0; i < n; i += 16) {
        __mmask16 k = tail16(n - i);
        _mm512_mask_storeu_ps(x + i, k, _mm512_div_ps(_mm512_maskz_loadu_ps(k, x + i), s));
    }
}


static void rmsnorm_row_avx512(const float *x, float *y, int64_t dim, const void *weight, int32_t wdtype,
                               float eps) {
    __m512 ss = _mm512_setzero_ps();
    for (int64_t i = 0; i < dim; i += 16) {
        __m512 v = _mm512_maskz_loadu_ps(tail16(dim - i), x + i);
        ss = _mm512_fmadd_ps(v, v, ss);
    }
    __m512 inv = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(ss) / (float)dim + eps));
    for (int64_t i = 0; i < dim; i += 16) {
        __mmask16 k = tail16(dim - i);
        __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(k, x + i), inv);
        if (weight) {
            int32_t dt = wdtype == CPUMLA_F32 || wdtype == CPUMLA_BF16 || wdtype == CPUMLA_F16 ? wdtype : -1;
            v = _mm512_mul_ps(v, dq16(dt, (const uint8_t *)weight, i, dim - i));
        }
        _mm512_mask_storeu_ps(y + i, k, v);
    }
}

static void swiglu_row_avx512(const float *gate, const float *up, float *out, int64_t dim, float limit) {
    const __m512 one = _mm512_set1_ps(1.0f), lim = _mm512_set1_ps(limit), nlim = _mm512_set1_ps(-limit);
    for (int64_t i = 0; i < dim; i += 16) {
        __mmask16 k = tail16(dim - i);
        __m512 g = _mm512_maskz_loadu_ps(k, gate + i), u = _mm512_maskz_loadu_ps(k, up + i);
        if (limit > 0.0f) {
            g = _mm512_min_ps(g, lim);                         /* NaN -> limit, as g < limit ? g : limit */
            u = _mm512_min_ps(lim, _mm512_max_ps(nlim, u));    /* NaN stays NaN */
        }
        __m512 s = _mm512_div_ps(g, _mm512_add_ps(one, exp512(_mm512_sub_ps(_mm512_setzero_ps(), g))));
        _mm512_mask_storeu_ps(out + i, k, _mm512_mul_ps(s, u));
    }
}

/* ---- attention part ----------------------------------------------------------------------------- */
/* Tiles of up to ATT_TJ valid KV entries; a BF16 tile is converted to fp32 once and used by every head
 * of [h0, h1). Per head and tile: scores by 4-row dot products, one vector exp for the tile, then the
 * online-softmax update of (m, l, acc). */
#define ATT_TJ 16
#define ATT_BUF (ATT_TJ * 1024)

/* Online-softmax update of one head from its scores s[0..nt) (scaled here): m, l and the head's acc
 * rows are rescaled; s becomes the probabilities. Returns the factor the old acc must be scaled by. */
INLINE float softmax_step(float *s, int nt, float scale, float *m, float *l) {
    __mmask16 tm = tail16(nt);
    __m512 sv = _mm512_mul_ps(_mm512_maskz_loadu_ps(tm, s), _mm512_set1_ps(scale));
    float mt = _mm512_mask_reduce_max_ps(tm, sv);
    float mh = *m, mn = mt > mh ? mt : mh;
    float c = mh == -INFINITY ? 0.0f : expf(mh - mn);
    __m512 pv = _mm512_maskz_mov_ps(tm, exp512(_mm512_sub_ps(sv, _mm512_set1_ps(mn))));
    _mm512_store_ps(s, pv);
    *l = *l * c + _mm512_reduce_add_ps(pv);
    *m = mn;
    return c;
}

/* Heads [h, h + 4) against the tile: each row and q load serves 4 heads x 4 rows of scores, and each
 * row load 4 heads' value sums (16 accumulators), so the loop is bound by FMAs, not loads. */
static void attn_heads4(const cpumla_attn_args *a, int64_t qi, int64_t h, int64_t h0, const float *const *rows,
                        int nt, float *acc, float *m, float *l) {
    const int64_t dk = a->dk, dv = a->dv;
    const float *q[4];
    float s[4][ATT_TJ] __attribute__((aligned(64)));
    float c[4];
    for (int i = 0; i < 4; i++) q[i] = a->q + qi * a->ldq_t + (h + i) * a->ldq_h;
    int t = 0;
    for (; t < nt; t += 4) {
        const float *r[4];
        for (int u = 0; u < 4; u++) r[u] = rows[t + u < nt ? t + u : t];   /* repeats are not stored */
        __m512 sc[4][4];
        UNROLL for (int i = 0; i < 4; i++) UNROLL for (int u = 0; u < 4; u++) sc[i][u] = _mm512_setzero_ps();
        for (int64_t d = 0; d < dk; d += 16) {
            __mmask16 k = tail16(dk - d);
            __m512 rv[4];
            UNROLL for (int u = 0; u < 4; u++) rv[u] = _mm512_maskz_loadu_ps(k, r[u] + d);
            UNROLL for (int i = 0; i < 4; i++) {
                __m512 qv = _mm512_maskz_loadu_ps(k, q[i] + d);
                UNROLL for (int u = 0; u < 4; u++) sc[i][u] = _mm512_fmadd_ps(qv, rv[u], sc[i][u]);
            }
        }
        for (int i = 0; i < 4; i++) {
            float tmp[4];
            _mm_storeu_ps(tmp, hsum4(sc[i][0], sc[i][1], sc[i][2], sc[i][3]));
            for (int u = 0; u < 4 && t + u < nt; u++) s[i][t + u] = tmp[u];
        }
    }
    for (int i = 0; i < 4; i++) c[i] = softmax_step(s[i], nt, a->scale, &m[h + i - h0], &l[h + i - h0]);
    float *o[4];
    for (int i = 0; i < 4; i++) o[i] = acc + (h + i - h0) * dv;
    int64_t d = 0;
    for (; d + 64 <= dv; d += 64) {
        __m512 ov[4][4];
        UNROLL for (int i = 0; i < 4; i++) {
            __m512 cv = _mm512_set1_ps(c[i]);
            UNROLL for (int k = 0; k < 4; k++) ov[i][k] = _mm512_mul_ps(_mm512_loadu_ps(o[i] + d + 16 * k), cv);
        }
        for (int u = 0; u < nt; u++) {
            __m512 rv[4];
            UNROLL for (int k = 0; k < 4; k++) rv[k] = _mm512_loadu_ps(rows[u] + d + 16 * k);
            UNROLL for (int i = 0; i < 4; i++) {
                __m512 p = _mm512_set1_ps(s[i][u]);
                UNROLL for (int k = 0; k < 4; k++) ov[i][k] = _mm512_fmadd_ps(p, rv[k], ov[i][k]);
            }
        }
        UNROLL for (int i = 0; i < 4; i++) UNROLL for (int k = 0; k < 4; k++) _mm512_storeu_ps(o[i] + d + 16 * k, ov[i][k]);
    }
    for (; d < dv; d += 16) {
        __mmask16 k = tail16(dv - d);
        __m512 ov[4];
        UNROLL for (int i = 0; i < 4; i++) ov[i] = _mm512_mul_ps(_mm512_maskz_loadu_ps(k, o[i] + d), _mm512_set1_ps(c[i]));
        for (int u = 0; u < nt; u++) {
            __m512 rv = _mm512_maskz_loadu_ps(k, rows[u] + d);
            UNROLL for (int i = 0; i < 4; i++) ov[i] = _mm512_fmadd_ps(_mm512_set1_ps(s[i][u]), rv, ov[i]);
        }
        UNROLL for (int i = 0; i < 4; i++) _mm512_mask_storeu_ps(o[i] + d, k, ov[i]);
    }
}

static void attn_part_avx512(const cpumla_attn_args *a, int64_t qi, int64_t h0, int64_t h1, int64_t j0,
                             int64_t j1, float *acc, float *m, float *l) {
    int64_t dk = a->dk, dv = a->dv, width = max64(dk, dv), w16 = (width + 15) & ~(int64_t)15;
    if (w16 > ATT_BUF) { prev_attn_part(a, qi, h0, h1, j0, j1, acc, m, l); return; }
    int tj = (int)min64(ATT_TJ, ATT_BUF / w16);
    float tile[ATT_BUF] __attribute__((aligned(64)));
    const float *rows[ATT_TJ];
    for (int64_t h = h0; h < h1; h++) {
        m[h - h0] = -INFINITY;
        l[h - h0] = 0.0f;
        for (int64_t d = 0; d < dv; d += 16)
            _mm512_mask_storeu_ps(acc + (h - h0) * dv + d, tail16(dv - d), _mm512_setzero_ps());
    }
    int64_t j = j0;
    while (j < j1) {
        int nt = 0;
        while (nt < tj && j < j1) {
            const void *p = attn_kv_row(a, qi, j++);
            if (!p) continue;
            if (a->kv_dtype == CPUMLA_BF16) {
                float *o = tile + nt * w16;
                for (int64_t d = 0; d < width; d += 16)
                    _mm512_store_ps(o + d, dq16(CPUMLA_BF16, (const uint8_t *)p, d, width - d));
                rows[nt] = o;
            } else {
                rows[nt] = (const float *)p;
            }
            nt++;
        }
        if (nt == 0) break;
        int64_t h = h0;
        for (; h + 4 <= h1; h += 4) attn_heads4(a, qi, h, h0, rows, nt, acc, m, l);
        for (; h < h1; h++) {
            const float *q = a->q + qi * a->ldq_t + h * a->ldq_h;
            float s[ATT_TJ] __attribute__((aligned(64)));
            int t = 0;
            for (; t + 4 <= nt; t += 4) {
                __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
                for (int64_t d = 0; d < dk; d += 16) {
                    __mmask16 k = tail16(dk - d);
                    __m512 qv = _mm512_maskz_loadu_ps(k, q + d);
                    s0 = _mm512_fmadd_ps(qv, _mm512_maskz_loadu_ps(k, rows[t] + d), s0);
                    s1 = _mm512_fmadd_ps(qv, _mm512_maskz_loadu_ps(k, rows[t + 1] + d), s1);
                    s2 = _mm512_fmadd_ps(qv, _mm512_maskz_loadu_ps(k, rows[t + 2] + d), s2);
                    s3 = _mm512_fmadd_ps(qv, _mm512_maskz_loadu_ps(k, rows[t + 3] + d), s3);
                }
                _mm_storeu_ps(s + t, hsum4(s0, s1, s2, s3));
            }
            for (; t < nt; t++) {
                __m512 s0 = _mm512_setzero_ps();
                for (int64_t d = 0; d < dk; d += 16) {
                    __mmask16 k = tail16(dk - d);
                    s0 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(k, q + d), _mm512_maskz_loadu_ps(k, rows[t] + d), s0);
                }
                s[t] = _mm512_reduce_add_ps(s0);
            }
            float c = softmax_step(s, nt, a->scale, &m[h - h0], &l[h - h0]);
            float *o = acc + (h - h0) * dv;
            __m512 cv = _mm512_set1_ps(c);
            int64_t d = 0;
            for (; d + 64 <= dv; d += 64) {
                __m512 o0 = _mm512_mul_ps(_mm512_loadu_ps(o + d), cv), o1 = _mm512_mul_ps(_mm512_loadu_ps(o + d + 16), cv);
                __m512 o2 = _mm512_mul_ps(_mm512_loadu_ps(o + d + 32), cv), o3 = _mm512_mul_ps(_mm512_loadu_ps(o + d + 48), cv);
                for (int u = 0; u < nt; u++) {
                    __m512 p = _mm512_set1_ps(s[u]);
                    o0 = _mm512_fmadd_ps(p, _mm512_loadu_ps(rows[u] + d), o0);
                    o1 = _mm512_fmadd_ps(p, _mm512_loadu_ps(rows[u] + d + 16), o1);
                    o2 = _mm512_fmadd_ps(p, _mm512_loadu_ps(rows[u] + d + 32), o2);
                    o3 = _mm512_fmadd_ps(p, _mm512_loadu_ps(rows[u] + d + 48), o3);
                }
                _mm512_storeu_ps(o + d, o0); _mm512_storeu_ps(o + d + 16, o1);
                _mm512_storeu_ps(o + d + 32, o2); _mm512_storeu_ps(o + d + 48, o3);
            }
            for (; d < dv; d += 16) {
                __mmask16 k = tail16(dv - d);
                __m512 o0 = _mm512_mul_ps(_mm512_maskz_loadu_ps(k, o + d), cv);
                for (int u = 0; u < nt; u++)
                    o0 = _mm512_fmadd_ps(_mm512_set1_ps(s[u]), _mm512_maskz_loadu_ps(k, rows[u] + d), o0);
                _mm512_mask_storeu_ps(o + d, k, o0);
            }
        }
    }
}

/* kernels.h: one online-softmax step over a block of scores (cpumla_mla_mha) */
static float softmax_block_avx512(float *s, int64_t n, int64_t valid, float scale, float *m, float *l) {
    const __m512 sc = _mm512_set1_ps(scale), tiny = _mm512_set1_ps(1.17549435e-38f);
    const float mo = *m;
    __m512 mv = _mm512_set1_ps(mo);
    for (int64_t j = 0; j < valid; j += 16) {
        __mmask16 k = tail16(valid - j);
        mv = _mm512_mask_max_ps(mv, k, _mm512_mul_ps(_mm512_maskz_loadu_ps(k, s + j), sc), mv);   /* NaN never wins */
    }
    const float mn = _mm512_reduce_max_ps(mv);
    const __m512 mnv = _mm512_set1_ps(mn);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; j += 16) {
        __mmask16 kv = tail16(valid - j);
        __m512 e = exp512(_mm512_sub_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(kv, s + j), sc), mnv));
        e = _mm512_maskz_mov_ps(kv & ~_mm512_cmp_ps_mask(e, tiny, _CMP_LT_OQ), e);    /* below FLT_MIN: 0 */
        _mm512_mask_storeu_ps(s + j, tail16(n - j), e);
        sum = _mm512_add_ps(sum, e);
    }
    const float c = mn == -INFINITY ? 1.0f : flush_tiny(expf(mo - mn));
    *l = *l * c + _mm512_reduce_add_ps(sum);
    *m = mn;
    return c;
}

/* ---- cache row, read probe ---------------------------------------------------------------------- */
static void cache_row_avx512(void *dst, int32_t dtype, const float *src, int64_t width) {
    if (dtype != CPUMLA_BF16) { memcpy(dst, src, (size_t)width * sizeof(float)); return; }
    uint16_t *o = (uint16_t *)dst;
    const __m512i one = _mm512_set1_epi32(1), bias = _mm512_set1_epi32(0x7fff);
    for (int64_t i = 0; i < width; i += 16) {
        __mmask16 k = tail16(width - i);
        __m512i u = _mm512_castps_si512(_mm512_maskz_loadu_ps(k, src + i));
        __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(bias, _mm512_and_si512(_mm512_srli_epi32(u, 16), one))), 16);
        __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
        r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40)));
        _mm256_mask_storeu_epi16(o + i, k, _mm512_cvtepi32_epi16(r));
    }
}

/* The data summed as doubles (a bandwidth probe: four zmm accumulators, software prefetch 2 KiB ahead
 * so the stream does not stall at every 4 KiB page). */
static double read_sum_avx512(const void *buf, int64_t bytes) {
    const double *p = (const double *)buf;
    int64_t n = bytes / 64, i = 0;
    __m512d a0 = _mm512_setzero_pd(), a1 = a0, a2 = a0, a3 = a0;
    for (; i + 4 <= n; i += 4) {
        const char *ahead = (const char *)(p + 8 * i) + 2048;   /* the hardware stops at each page */
        _mm_prefetch(ahead, _MM_HINT_T0); _mm_prefetch(ahead + 64, _MM_HINT_T0);
        _mm_prefetch(ahead + 128, _MM_HINT_T0); _mm_prefetch(ahead + 192, _MM_HINT_T0);
        a0 = _mm512_add_pd(a0, _mm512_loadu_pd(p + 8 * i));
        a1 = _mm512_add_pd(a1, _mm512_loadu_pd(p + 8 * i + 8));
        a2 = _mm512_add_pd(a2, _mm512_loadu_pd(p + 8 * i + 16));
        a3 = _mm512_add_pd(a3, _mm512_loadu_pd(p + 8 * i + 24));
    }
    for (; i < n; i++) a0 = _mm512_add_pd(a0, _mm512_loadu_pd(p + 8 * i));
    return _mm512_reduce_add_pd(_mm512_add_pd(_mm512_add_pd(a0, a1), _mm512_add_pd(a2, a3)));
}


/* FMA-throughput probe: 12 independent accumulators hide the FMA latency. */
static double fma_loop_avx512(int64_t iters, float *sink) {
    __m512 a0 = _mm512_set1_ps(1.0f), a1 = _mm512_set1_ps(1.1f), a2 = _mm512_set1_ps(1.2f), a3 = _mm512_set1_ps(1.3f), a4 = _mm512_set1_ps(1.4f),
           a5 = _mm512_set1_ps(1.5f), a6 = _mm512_set1_ps(1.6f), a7 = _mm512_set1_ps(1.7f), a8 = _mm512_set1_ps(1.8f), a9 = _mm512_set1_ps(1.9f),
           a10 = _mm512_set1_ps(2.0f), a11 = _mm512_set1_ps(2.1f);
    const __m512 m = _mm512_set1_ps(0.999999f), c = _mm512_set1_ps(1e-7f);
    for (int64_t i = 0; i < iters; i++) {
        a0 = _mm512_fmadd_ps(a0, m, c); a1 = _mm512_fmadd_ps(a1, m, c); a2 = _mm512_fmadd_ps(a2, m, c); a3 = _mm512_fmadd_ps(a3, m, c);
        a4 = _mm512_fmadd_ps(a4, m, c); a5 = _mm512_fmadd_ps(a5, m, c); a6 = _mm512_fmadd_ps(a6, m, c); a7 = _mm512_fmadd_ps(a7, m, c);
        a8 = _mm512_fmadd_ps(a8, m, c); a9 = _mm512_fmadd_ps(a9, m, c); a10 = _mm512_fmadd_ps(a10, m, c); a11 = _mm512_fmadd_ps(a11, m, c);
    }
    __m512 s = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)), _mm512_add_ps(_mm512_add_ps(a4, a5), _mm512_add_ps(a6, a7)));
    s = _mm512_add_ps(s, _mm512_add_ps(_mm512_add_ps(a8, a9), _mm512_add_ps(a10, a11)));
    float buf[16];
    _mm512_storeu_ps(buf, s);
    for (int j = 0; j < 16; j++) *sink += buf[j];
    return 2.0 * 12.0 * 16.0 * (double)iters;
}

void cpumla_fill_avx512f_rows(cpumla_kernels *k) {
    k->fma_loop = fma_loop_avx512;
    k->dot_loop = fma_loop_avx512;         /* BF16 products on this level are fp32 FMAs */
    k->who[K_FMA] = k->who[K_DOT] = "avx512f";
    if (k->attn_part != attn_part_avx512) prev_attn_part = k->attn_part;
    k->rmsnorm_row = rmsnorm_row_avx512;
    k->swiglu_row = swiglu_row_avx512;
    k->softmax_row = softmax_row_avx512;
    k->attn_part = attn_part_avx512;
    k->softmax_block = softmax_block_avx512;
    k->cache_row = cache_row_avx512;
    k->read_sum = read_sum_avx512;
    static const int ids[] = {K_RMSNORM, K_SWIGLU, K_SOFTMAX, K_ATTN, K_CACHE_ROW, K_READ, K_SOFTMAX_BLOCK};
    for (size_t i = 0; i < sizeof ids / sizeof ids[0]; i++) k->who[ids[i]] = "avx512f";
    k->who[K_ATTN] = "avx512f (avx2 for rows wider than 16384, scalar if BF16)";   /* ATT_BUF */
}
