/* gqk_x86.h: the x86 levels' own gemms for the K types Q2_K .. Q6_K (gguf_q.h), compiled once per
 * level by avx2_gqk.c and avx512vnni_gqk.c. Include it after defining
 *   gqk_dp(acc, u, x): acc + 8 int32 lanes, lane i summing u_j * x_j over bytes 4i .. 4i+3 (u unsigned
 *   codes <= 63, x int8 with |x| <= 127: exact), and GQK_NAME(t), the name of type t's gemm.
 * A super-block (256 columns) is unpacked with SIMD shifts and masks into 8 ymm of unsigned codes u
 * (one chunk of 32 each) with q = u - off (off 0, 4 or 32 by type), its scales and mins as int32 lanes;
 * the chunk sums come from gqk_dp and an exact integer tree, the offset taken out with the activations'
 * half sums (s (a - off x) per half of 16: the spec's integers), then (float)isum * (d * xd)
 * [- (float)msum * (dm * xd)] as 8 fp32 products, added to the row's sum one by one in chunk order.
 * Rows go 4 at a time (their sums are independent chains, added 4 lanes at once); each super-block of
 * them is unpacked once and used for every token; the next 4 rows are prefetched a super-block's share
 * at a time. GQK_AVX512 (avx512vnni_gqk.c) takes the gemv's 4-row tiles to gqk_avx512.h. */
#include <immintrin.h>
#include "core/gguf_q.h"
#include "core/quant.h"
#include "kernels/x86/gqk_unpack_x86.h"

#define GQK_R 4                  /* rows a tile */
#define GQK_HH_MAX 512           /* super-blocks of a row whose half sums the gemv keeps on the stack (32 KiB) */

/* one token's activations for a super-block */
typedef struct {
    __m256i x[8];
    __m256i h0, h1;              /* half sums, gqk_halves order (per-16 types) */
    __m256i xs;                  /* code sums of chunks 0..7 (Q4_K, Q5_K) */
    __m256 xd;
} gqk_x;

/* the activations of super-block j of one token; hh (per-16 types, or NULL) the half sums of every
 * super-block of the token, formed once (gqk_hsums) */
GQK_INLINE void gqk_xload(int T, const int8_t *xq, const float *xd, const int32_t *xs, int64_t j, const __m256i *hh,
                          gqk_x *x) {
    for (int c = 0; c < 8; c++) x->x[c] = gqk_ld(xq + 256 * j + 32 * c);
    x->xd = _mm256_loadu_ps(xd + 8 * j);
    if (T == GQK_Q4 || T == GQK_Q5) x->xs = gqk_ld(xs + 8 * j);
    else if (hh) {
        x->h0 = hh[2 * j];
        x->h1 = hh[2 * j + 1];
    } else {
        const __m256i one = _mm256_set1_epi8(1), z = _mm256_setzero_si256();
        __m256i e[8];
        for (int c = 0; c < 8; c++) e[c] = gqk_dp(z, one, x->x[c]);
        x->h0 = gqk_halves(e[0], e[1], e[2], e[3]);
        x->h1 = gqk_halves(e[4], e[5], e[6], e[7]);
    }
}

/* the half sums (gqk_xload's h0, h1) of every super-block of one token's codes xq */
GQK_INLINE void gqk_hsums(const int8_t *xq, int64_t nsb, __m256i *hh) {
    const __m256i one = _mm256_set1_epi8(1), z = _mm256_setzero_si256();
    for (int64_t j = 0; j < nsb; j++) {
        __m256i e[8];
        for (int c = 0; c < 8; c++) e[c] = gqk_dp(z, one, gqk_ld(xq + 256 * j + 32 * c));
        hh[2 * j] = gqk_halves(e[0], e[1], e[2], e[3]);
        hh[2 * j + 1] = gqk_halves(e[4], e[5], e[6], e[7]);
    }
}

/* the 8 chunk products of a super-block, as the spec rounds each */
GQK_INLINE __m256 gqk_prod(int T, const gqk_u *u, const gqk_x *x) {
    const __m256i z = _mm256_setzero_si256();
    __m256i e[8];
    for (int c = 0; c < 8; c++) e[c] = gqk_dp(z, u->q[c], x->x[c]);
    const __m256i a0 = gqk_halves(e[0], e[1], e[2], e[3]), a1 = gqk_halves(e[4], e[5], e[6], e[7]);
    __m256i isum, msum = z;
    if (T == GQK_Q4 || T == GQK_Q5) {
        isum = _mm256_mullo_epi32(gqk_join(a0, a1), u->s0);
        msum = _mm256_mullo_epi32(x->xs, u->m0);
    } else if (T == GQK_Q2) {
        isum = gqk_join(_mm256_mullo_epi32(a0, u->s0), _mm256_mullo_epi32(a1, u->s1));
        msum = gqk_join(_mm256_mullo_epi32(x->h0, u->m0), _mm256_mullo_epi32(x->h1, u->m1));
    } else {
        const int sh = T == GQK_Q6 ? 5 : 2;
        isum = gqk_join(_mm256_mullo_epi32(_mm256_sub_epi32(a0, _mm256_slli_epi32(x->h0, sh)), u->s0),
                        _mm256_mullo_epi32(_mm256_sub_epi32(a1, _mm256_slli_epi32(x->h1, sh)), u->s1));
    }
    __m256 p = _mm256_mul_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(_mm256_set1_ps(u->d), x->xd));
    if (T == GQK_Q2 || T == GQK_Q4 || T == GQK_Q5)
        p = _mm256_sub_ps(p, _mm256_mul_ps(_mm256_cvtepi32_ps(msum), _mm256_mul_ps(_mm256_set1_ps(u->dm), x->xd)));
    return p;
}

GQK_INLINE void gqk_add8(float *acc, __m256 p) {
    float v[8], a = *acc;
    _mm256_storeu_ps(v, p);
    for (int c = 0; c < 8; c++) a += v[c];
    *acc = a;
}

/* 4 rows' sums (lanes) plus their chunk products p0 .. p3, chunk by chunk in order */
GQK_INLINE __m128 gqk_add4x8(__m128 acc, __m256 p0, __m256 p1, __m256 p2, __m256 p3) {
    const __m256 t0 = _mm256_unpacklo_ps(p0, p1), t1 = _mm256_unpackhi_ps(p0, p1);
    const __m256 t2 = _mm256_unpacklo_ps(p2, p3), t3 = _mm256_unpackhi_ps(p2, p3);
    const __m256 c04 = _mm256_shuffle_ps(t0, t2, 0x44), c15 = _mm256_shuffle_ps(t0, t2, 0xee);
    const __m256 c26 = _mm256_shuffle_ps(t1, t3, 0x44), c37 = _mm256_shuffle_ps(t1, t3, 0xee);
    acc = _mm_add_ps(acc, _mm256_castps256_ps128(c04));
    acc = _mm_add_ps(acc, _mm256_castps256_ps128(c15));
    acc = _mm_add_ps(acc, _mm256_castps256_ps128(c26));
    acc = _mm_add_ps(acc, _mm256_castps256_ps128(c37));
    acc = _mm_add_ps(acc, _mm256_extractf128_ps(c04, 1));
    acc = _mm_add_ps(acc, _mm256_extractf128_ps(c15, 1));
    acc = _mm_add_ps(acc, _mm256_extractf128_ps(c26, 1));
    return _mm_add_ps(acc, _mm256_extractf128_ps(c37, 1));
}

/* software prefetch of the next tile's R rows (their bytes from row r + R on, which is where they are
 * when rows are packed), one super-block's share of them per step, never past the weight's last byte */
typedef struct {
    const uint8_t *p, *end;
    int64_t step;
} gqk_pf;
static inline gqk_pf gqk_pf_init(const cpumla_weight *w, int64_t r, int R, int64_t bytes) {
    const int64_t nsb = w->cols / 256;
    gqk_pf f = {(const uint8_t *)w->data + (r + R) * w->row_bytes,
                (const uint8_t *)w->data + (w->rows - 1) * w->row_bytes + nsb * bytes, R * bytes};
    return f;
}
static inline void gqk_pf_step(gqk_pf *f) {
    for (int64_t o = 0; o < f->step; o += 64)
        if (f->p + o < f->end) __builtin_prefetch(f->p + o, 0, 3);
    f->p += f->step;
}

/* rows [r, r + R) of the tile, every token; hh: the one token's gqk_hsums where n is 1 (or NULL) */
GQK_INLINE void gqk_tile(int T, int R, const cpumla_weight *w, const void *qx, int64_t n, float *y, int64_t ldy,
                         int64_t r, const __m256i *hh) {
    const int64_t K = w->cols, per = QX_BYTES(K), nsb = K / 256, bytes = gq_info(w->dtype)->bytes;
    const uint8_t *row = (const uint8_t *)w->data + r * w->row_bytes;
    gqk_pf pf = gqk_pf_init(w, r, R, bytes);
    if (n == 1 && R == GQK_R) {               /* one token: each row unpacked straight into its product */
        __m128 acc = _mm_setzero_ps();
        for (int64_t j = 0; j < nsb; j++) {
            gqk_pf_step(&pf);
            gqk_x x;
            gqk_xload(T, (const int8_t *)qx, qx_d(qx, K), qx_s(qx, K), j, hh, &x);
            __m256 p[GQK_R];
            for (int i = 0; i < GQK_R; i++) {
                gqk_u u;
                gqk_unpack(T, row + i * w->row_bytes + j * bytes, &u);
                p[i] = gqk_prod(T, &u, &x);
            }
            acc = gqk_add4x8(acc, p[0], p[1], p[2], p[3]);
        }
        _mm_storeu_ps(y, acc);
        return;
    }
    for (int64_t t = 0; t < n; t++)
        for (int i = 0; i < R; i++) y[t * ldy + i] = 0.0f;
    for (int64_t j = 0; j < nsb; j++) {
        gqk_pf_step(&pf);
        gqk_u u[GQK_R];
        for (int i = 0; i < R; i++) gqk_unpack(T, row + i * w->row_bytes + j * bytes, &u[i]);
        for (int64_t t = 0; t < n; t++) {
            const uint8_t *xt = (const uint8_t *)qx + t * per;
            gqk_x x;
            gqk_xload(T, (const int8_t *)xt, qx_d(xt, K), qx_s(xt, K), j, NULL, &x);
            if (R == GQK_R) {
                float *yt = y + t * ldy;
                _mm_storeu_ps(yt, gqk_add4x8(_mm_loadu_ps(yt), gqk_prod(T, &u[0], &x), gqk_prod(T, &u[1], &x),
                                             gqk_prod(T, &u[2], &x), gqk_prod(T, &u[3], &x)));
            } else
                for (int i = 0; i < R; i++) gqk_add8(y + t * ldy + i, gqk_prod(T, &u[i], &x));
        }
    }
}

#ifdef GQK_AVX512
#include "kernels/x86/gqk_avx512.h"
#endif

GQK_INLINE void gqk_gemm(int T, const cpumla_weight *w, const void *qx, int64_t n, float *y, int64_t ldy, int64_t r0,
                         int64_t r1) {
    int64_t r = r0;
    if (n == 1) {                             /* the gemv: one token, a constant */
#ifdef GQK_AVX512
        for (; r + GQK_R <= r1; r += GQK_R) gqk4_gemv(T, w, qx, y + (r - r0), r);
#else
        /* the per-16 types' half sums of the token once a call, not once a tile (one thread's gemv of
         * 4096 x 2048 in cache, AMD EPYC Zen 3: Q6_K 1.08x, Q2_K / Q3_K 1.03x); rows wider than
         * GQK_HH_MAX super-blocks form them per tile, as the gemm does */
        const int64_t nsb = w->cols / 256;
        const int per16 = T != GQK_Q4 && T != GQK_Q5 && nsb <= GQK_HH_MAX;
        __m256i hh[per16 ? 2 * nsb : 1];
        if (per16) gqk_hsums((const int8_t *)qx, nsb, hh);
        for (; r + GQK_R <= r1; r += GQK_R) gqk_tile(T, GQK_R, w, qx, 1, y + (r - r0), ldy, r, per16 ? hh : NULL);
#endif
    }
    for (; r + GQK_R <= r1; r += GQK_R) gqk_tile(T, GQK_R, w, qx, n, y + (r - r0), ldy, r, NULL);
    for (; r < r1; r++) gqk_tile(T, 1, w, qx, n, y + (r - r0), ldy, r, NULL);
}

#define GQK_DEF(t, T)                                                                                            \
    static void GQK_NAME(t)(const cpumla_weight *w, const void *qx, int64_t n, float *y, int64_t ldy, int64_t r0, \
                            int64_t r1) {                                                                          \
        gqk_gemm(T, w, qx, n, y, ldy, r0, r1);                                                                     \
    }
GQK_DEF(q2_k, GQK_Q2)
GQK_DEF(q3_k, GQK_Q3)
GQK_DEF(q4_k, GQK_Q4)
GQK_DEF(q5_k, GQK_Q5)
GQK_DEF(q6_k, GQK_Q6)

/* type t's gemm in k's table, served by `who` */
#define GQK_FILL(k, who)                                                                                         \
    do {                                                                                                         \
        (k)->gemm_gq[CPUMLA_Q2_K - CPUMLA_Q8_0] = GQK_NAME(q2_k);                                               \
        (k)->gemm_gq[CPUMLA_Q3_K - CPUMLA_Q8_0] = GQK_NAME(q3_k);                                               \
        (k)->gemm_gq[CPUMLA_Q4_K - CPUMLA_Q8_0] = GQK_NAME(q4_k);                                               \
        (k)->gemm_gq[CPUMLA_Q5_K - CPUMLA_Q8_0] = GQK_NAME(q5_k);                                               \
        (k)->gemm_gq[CPUMLA_Q6_K - CPUMLA_Q8_0] = GQK_NAME(q6_k);                                               \
        for (int f_ = CPUMLA_Q2_K; f_ <= CPUMLA_Q6_K; f_++) (k)->who_fmt[K_GEMV][f_] = (k)->who_fmt[K_GEMM][f_] = (who); \
    } while (0)
