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

#define GQK_INLINE static inline __attribute__((always_inline))
#define GQK_R 4                  /* rows a tile */

enum { GQK_Q2, GQK_Q3, GQK_Q4, GQK_Q5, GQK_Q6 };

/* a super-block unpacked: codes u (chunk c in q[c]); per-32 types (Q4_K, Q5_K) s, m: int32 of chunk
 * 0..7; per-16 types: s0 / s1 (and m0 / m1): [half 0 of chunks 0..3 | half 1 of chunks 0..3] and the
 * same for chunks 4..7 (the order gqk_halves gives) */
typedef struct {
    __m256i q[8];
    __m256i s0, s1, m0, m1;
    float d, dm;
} gqk_u;

/* one token's activations for a super-block */
typedef struct {
    __m256i x[8];
    __m256i h0, h1;              /* half sums, gqk_halves order (per-16 types) */
    __m256i xs;                  /* code sums of chunks 0..7 (Q4_K, Q5_K) */
    __m256 xd;
} gqk_x;

/* fp16 -> fp32 with F16C: exact, and f16_to_f32's value for every finite and infinite input (a NaN
 * only ever makes the products NaN) */
static inline float gqk_h16(const uint8_t *p) { return _cvtsh_ss((unsigned short)(p[0] | p[1] << 8)); }
static inline uint32_t gqk_le32(const uint8_t *p) { uint32_t v; __builtin_memcpy(&v, p, 4); return v; }
static inline uint64_t gqk_le64(const uint8_t *p) { uint64_t v; __builtin_memcpy(&v, p, 8); return v; }

static inline __m256i gqk_ld(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }

/* bit `from` of each byte of v (masked) moved to bit `to` (16-bit shifts: the masked bit stays in its byte) */
GQK_INLINE __m256i gqk_bit(__m256i v, int from, int to) {
    const __m256i b = _mm256_and_si256(v, _mm256_set1_epi8((char)(1 << from)));
    if (to > from) return _mm256_slli_epi16(b, to - from);
    if (to < from) return _mm256_srli_epi16(b, from - to);
    return b;
}

/* 4 chunks' lane vectors -> [half 0 sums of chunks 0..3 | half 1 sums of chunks 0..3] (lanes 0-3 of a
 * chunk are its first 16 bytes, lanes 4-7 its last 16) */
GQK_INLINE __m256i gqk_halves(__m256i a, __m256i b, __m256i c, __m256i d) {
    const __m256i ab = _mm256_add_epi32(_mm256_unpacklo_epi32(a, b), _mm256_unpackhi_epi32(a, b));
    const __m256i cd = _mm256_add_epi32(_mm256_unpacklo_epi32(c, d), _mm256_unpackhi_epi32(c, d));
    return _mm256_add_epi32(_mm256_unpacklo_epi64(ab, cd), _mm256_unpackhi_epi64(ab, cd));
}
/* two gqk_halves vectors -> the 8 chunk sums in chunk order */
GQK_INLINE __m256i gqk_join(__m256i lo, __m256i hi) {
    return _mm256_add_epi32(_mm256_permute2x128_si256(lo, hi, 0x20), _mm256_permute2x128_si256(lo, hi, 0x31));
}

/* 16 per-16 bytes v (t = 2c + half) -> int32 lanes in gqk_halves order, signed or unsigned */
GQK_INLINE void gqk_sc16(__m128i v, int sgn, __m256i *s0, __m256i *s1) {
    const __m128i p = _mm_shuffle_epi8(v, _mm_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15));
    const __m128i h = _mm_unpackhi_epi64(p, p);
    *s0 = sgn ? _mm256_cvtepi8_epi32(p) : _mm256_cvtepu8_epi32(p);
    *s1 = sgn ? _mm256_cvtepi8_epi32(h) : _mm256_cvtepu8_epi32(h);
}

/* Q4_K / Q5_K: the 6-bit scales (sv) and mins (mv) of chunks 0..7 as bytes, from 12 bytes */
GQK_INLINE void gqk_sm6(const uint8_t *sc, __m256i *s, __m256i *m) {
    const uint32_t w0 = gqk_le32(sc), w1 = gqk_le32(sc + 4), w2 = gqk_le32(sc + 8);
    const uint64_t sv = (uint64_t)(w0 & 0x3f3f3f3fu) | (uint64_t)((w2 & 0x0f0f0f0fu) | ((w0 >> 2) & 0x30303030u)) << 32;
    const uint64_t mv = (uint64_t)(w1 & 0x3f3f3f3fu) | (uint64_t)(((w2 >> 4) & 0x0f0f0f0fu) | ((w1 >> 2) & 0x30303030u)) << 32;
    *s = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)sv));
    *m = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)mv));
}

GQK_INLINE void gqk_unpack(int T, const uint8_t *b, gqk_u *u) {
    const __m256i m4 = _mm256_set1_epi8(15), m2 = _mm256_set1_epi8(3);
    if (T == GQK_Q4 || T == GQK_Q5) {
        const uint8_t *qs = b + (T == GQK_Q4 ? 16 : 48);
        for (int g = 0; g < 4; g++) {
            const __m256i v = gqk_ld(qs + 32 * g);
            u->q[2 * g] = _mm256_and_si256(v, m4);
            u->q[2 * g + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
        }
        if (T == GQK_Q5) {
            const __m256i h = gqk_ld(b + 16);
            for (int c = 0; c < 8; c++) u->q[c] = _mm256_or_si256(u->q[c], gqk_bit(h, c, 4));
        }
        gqk_sm6(b + 4, &u->s0, &u->m0);
        u->d = gqk_h16(b);
        u->dm = gqk_h16(b + 2);
    } else if (T == GQK_Q6) {
        for (int h = 0; h < 2; h++) {
            const __m256i l0 = gqk_ld(b + 64 * h), l1 = gqk_ld(b + 64 * h + 32), hb = gqk_ld(b + 128 + 32 * h);
            u->q[4 * h] = _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_slli_epi16(_mm256_and_si256(hb, m2), 4));
            u->q[4 * h + 1] = _mm256_or_si256(_mm256_and_si256(l1, m4),
                                              _mm256_slli_epi16(_mm256_and_si256(hb, _mm256_set1_epi8(0x0c)), 2));
            u->q[4 * h + 2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4),
                                              _mm256_and_si256(hb, _mm256_set1_epi8(0x30)));
            u->q[4 * h + 3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                                              _mm256_srli_epi16(_mm256_and_si256(hb, _mm256_set1_epi8((char)0xc0)), 2));
        }
        gqk_sc16(_mm_loadu_si128((const __m128i *)(b + 192)), 1, &u->s0, &u->s1);
        u->d = gqk_h16(b + 208);
    } else if (T == GQK_Q2) {
        for (int h = 0; h < 2; h++) {
            const __m256i v = gqk_ld(b + 16 + 32 * h);
            u->q[4 * h] = _mm256_and_si256(v, m2);
            u->q[4 * h + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 2), m2);
            u->q[4 * h + 2] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m2);
            u->q[4 * h + 3] = _mm256_and_si256(_mm256_srli_epi16(v, 6), m2);
        }
        const __m128i sc = _mm_loadu_si128((const __m128i *)b);
        gqk_sc16(_mm_and_si128(sc, _mm_set1_epi8(15)), 0, &u->s0, &u->s1);
        gqk_sc16(_mm_and_si128(_mm_srli_epi16(sc, 4), _mm_set1_epi8(15)), 0, &u->m0, &u->m1);
        u->d = gqk_h16(b + 80);
        u->dm = gqk_h16(b + 82);
    } else {                                  /* Q3_K: u = 2 bits + 4 * the hmask bit, q = u - 4 */
        const __m256i hm = gqk_ld(b);
        for (int h = 0; h < 2; h++) {
            const __m256i v = gqk_ld(b + 32 + 32 * h);
            for (int k = 0; k < 4; k++) {
                const __m256i lo = _mm256_and_si256(k ? _mm256_srli_epi16(v, 2 * k) : v, m2);
                u->q[4 * h + k] = _mm256_or_si256(lo, gqk_bit(hm, 4 * h + k, 2));
            }
        }
        const uint64_t a = gqk_le64(b + 96);
        const uint32_t hw = gqk_le32(b + 104);
        const uint64_t hl = (uint64_t)(hw & 0x03030303u) | (uint64_t)((hw >> 2) & 0x03030303u) << 32;
        const uint64_t hh = (uint64_t)((hw >> 4) & 0x03030303u) | (uint64_t)((hw >> 6) & 0x03030303u) << 32;
        const uint64_t lo = (a & 0x0f0f0f0f0f0f0f0full) | hl << 4, hi = ((a >> 4) & 0x0f0f0f0f0f0f0f0full) | hh << 4;
        const __m128i sv = _mm_sub_epi8(_mm_set_epi64x((long long)hi, (long long)lo), _mm_set1_epi8(32));
        gqk_sc16(sv, 1, &u->s0, &u->s1);
        u->d = gqk_h16(b + 108);
    }
}

/* the activations of super-block j of one token */
GQK_INLINE void gqk_xload(int T, const int8_t *xq, const float *xd, const int32_t *xs, int64_t j, gqk_x *x) {
    for (int c = 0; c < 8; c++) x->x[c] = gqk_ld(xq + 256 * j + 32 * c);
    x->xd = _mm256_loadu_ps(xd + 8 * j);
    if (T == GQK_Q4 || T == GQK_Q5) x->xs = gqk_ld(xs + 8 * j);
    else {
        const __m256i one = _mm256_set1_epi8(1), z = _mm256_setzero_si256();
        __m256i e[8];
        for (int c = 0; c < 8; c++) e[c] = gqk_dp(z, one, x->x[c]);
        x->h0 = gqk_halves(e[0], e[1], e[2], e[3]);
        x->h1 = gqk_halves(e[4], e[5], e[6], e[7]);
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

/* rows [r, r + R) of the tile, every token */
GQK_INLINE void gqk_tile(int T, int R, const cpumla_weight *w, const void *qx, int64_t n, float *y, int64_t ldy,
                         int64_t r) {
    const int64_t K = w->cols, per = QX_BYTES(K), nsb = K / 256, bytes = gq_info(w->dtype)->bytes;
    const uint8_t *row = (const uint8_t *)w->data + r * w->row_bytes;
    gqk_pf pf = gqk_pf_init(w, r, R, bytes);
    if (n == 1 && R == GQK_R) {               /* one token: each row unpacked straight into its product */
        __m128 acc = _mm_setzero_ps();
        for (int64_t j = 0; j < nsb; j++) {
            gqk_pf_step(&pf);
            gqk_x x;
            gqk_xload(T, (const int8_t *)qx, qx_d(qx, K), qx_s(qx, K), j, &x);
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
            gqk_xload(T, (const int8_t *)xt, qx_d(xt, K), qx_s(xt, K), j, &x);
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
    if (n == 1)                               /* the gemv: one token, a constant */
        for (; r + GQK_R <= r1; r += GQK_R) {
#ifdef GQK_AVX512
            gqk4_gemv(T, w, qx, y + (r - r0), r);
#else
            gqk_tile(T, GQK_R, w, qx, 1, y + (r - r0), ldy, r);
#endif
        }
    for (; r + GQK_R <= r1; r += GQK_R) gqk_tile(T, GQK_R, w, qx, n, y + (r - r0), ldy, r);
    for (; r < r1; r++) gqk_tile(T, 1, w, qx, n, y + (r - r0), ldy, r);
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
