/* gq_x86.h: the x86 levels' GGUF gemms (gguf_q.h), compiled once per level by avx2_gq.c and
 * avx512vnni_gq.c over their own exact int8 block product. Include it after defining
 *   gq_dot8(w, x): 8 int32 lanes, lane i summing w_j * x_j over bytes 4i .. 4i+3 of 32 int8 codes (w in
 *   [-128, 127], |x| <= 127), gq_xsum8(x) the same with w = 1, and GQ_GEMM / GQ_GEMM_ANY, the names
 *   the Q8_0 entry and every other type's entry get.
 * Q8_0 reads its blocks directly; the other types unpack 256 columns at a time with the spec's
 * gq_unpack, then take the 16 half sums of 8 chunks at once.
 * Per 8 blocks: their block sums by a tree of integer adds (exact), then (float)isum * (d * xd) as
 * 8 fp32 products, each rounded once as the spec's, added to the row's sum in block order.
 * GQ_QUANT names the level's gq_quant_x, the activations' quantization in 8-lane vectors. */
#include <immintrin.h>
#include <string.h>
#include "core/gguf_q.h"
#include "core/quant.h"
#include "kernels/x86/avx2_common.h"

/* the 8 block sums of s[0..7] (each 8 int32 lanes), in order */
static inline __m256i gq_sums8(const __m256i s[8]) {
    const __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(s[0], s[1]), _mm256_hadd_epi32(s[2], s[3]));
    const __m256i b = _mm256_hadd_epi32(_mm256_hadd_epi32(s[4], s[5]), _mm256_hadd_epi32(s[6], s[7]));
    return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31));
}

static inline int32_t gq_hsum(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}

static float gq8_row(const cpumla_weight *w, int64_t r, const int8_t *xq, const float *xd) {
    const int64_t nb = w->cols / QK;
    const uint8_t *row = (const uint8_t *)w->data + r * w->row_bytes;
    float acc = 0.0f;
    int64_t b = 0;
    for (; b + 8 <= nb; b += 8) {
        __m256i s[8];
        float d[8], p[8];
        for (int j = 0; j < 8; j++) {
            const uint8_t *blk = row + (b + j) * GQ8_0_BYTES;
            s[j] = gq_dot8(_mm256_loadu_si256((const __m256i *)(blk + 2)),
                           _mm256_loadu_si256((const __m256i *)(xq + (b + j) * QK)));
            d[j] = gq8_scale(blk);
        }
        const __m256 wx = _mm256_mul_ps(_mm256_loadu_ps(d), _mm256_loadu_ps(xd + b));
        _mm256_storeu_ps(p, _mm256_mul_ps(_mm256_cvtepi32_ps(gq_sums8(s)), wx));
        for (int j = 0; j < 8; j++) acc += p[j];
    }
    for (; b < nb; b++) {
        const uint8_t *blk = row + b * GQ8_0_BYTES;
        const int32_t isum = gq_hsum(gq_dot8(_mm256_loadu_si256((const __m256i *)(blk + 2)),
                                             _mm256_loadu_si256((const __m256i *)(xq + b * QK))));
        acc += gq_block_product(isum, gq8_scale(blk), xd[b]);
    }
    return acc;
}

/* gq_quant_x's bytes: per block of 32, amax over the bits of |x| (avx2_common.h's amax32), xd and id as
 * quant.h computes them, codes nearest_even(x * id) (vcvtps2dq under the default rounding), 0 for a block
 * that is not finite, and their int32 sum */
static void GQ_QUANT(const float *x, int64_t K, void *qx) {
    int8_t *q = qx;
    float *d = qx_d(qx, K);
    int32_t *s = qx_s(qx, K);
    const int64_t nb = K / QK, kp = qx_kp(K);
    const __m256 absm = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int64_t b = 0; b < nb; b++) {
        __m256 v[4];
        for (int j = 0; j < 4; j++) v[j] = _mm256_loadu_ps(x + b * QK + 8 * j);
        const float amax = amax32(v, absm);
        const float id = qact_id(amax, QACT_MAX8);
        d[b] = qact_xd(amax, QACT_MAX8);
        __m256i c[4];
        for (int j = 0; j < 4; j++)
            c[j] = q_nonfinite(amax) ? _mm256_setzero_si256() : _mm256_cvtps_epi32(_mm256_mul_ps(v[j], _mm256_set1_ps(id)));
        s[b] = gq_hsum(_mm256_add_epi32(_mm256_add_epi32(c[0], c[1]), _mm256_add_epi32(c[2], c[3])));
        /* |code| <= 127: the saturating packs are exact; they interleave 128-bit lanes, which order undoes */
        const __m256i h = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
        _mm256_storeu_si256((__m256i *)(q + b * QK), _mm256_permutevar8x32_epi32(h, order));
    }
    memset(q + K, 0, (size_t)(kp - K));
    for (int64_t b = nb; b < kp / QK; b++) { d[b] = 0.0f; s[b] = 0; }
}

/* the 4 rows of gq8_rows4 are 4 streams the hardware prefetcher alone keeps too short of memory: each
 * step prefetches the same 8 blocks of the next 4 rows (what the next call reads) into L2, never past
 * the weight's last row. Into L1 (T0), or 1 KB ahead in the row, it streamed at 0.5-0.7x the own q4
 * format's GB/s (benchmarks/gguf_gemv.py q8_0 --big-mb 256, AMD EPYC Zen 4, 2 threads); this way at
 * about 1x. */

static inline uint16_t gq_le16(const uint8_t *p) { return (uint16_t)(p[0] | p[1] << 8); }

/* rows r .. r + 3 at once (out[i]: row r + i), as gq8_row: each row's 8-block products transposed so
 * that block j of the 4 rows is one 4-lane vector, added to the 4 sums in block order; the scales by
 * F16C (exact, f16_to_f32's value for every input but a NaN's payload) */
static void gq8_rows4(const cpumla_weight *w, int64_t r, const int8_t *xq, const float *xd, float out[4]) {
    const int64_t nb = w->cols / QK, rb = w->row_bytes;
    const uint8_t *row0 = (const uint8_t *)w->data + r * rb;
    const int npf = r + 8 <= w->rows ? 4 : (int)(w->rows - r - 4 > 0 ? w->rows - r - 4 : 0);   /* next rows there are */
    __m128 acc = _mm_setzero_ps();
    int64_t b = 0;
    for (; b + 8 <= nb; b += 8) {
        const __m256 xdv = _mm256_loadu_ps(xd + b);
        __m256 p[4];
        for (int i = 0; i < 4; i++) {
            const uint8_t *blk = row0 + i * rb + b * GQ8_0_BYTES;
            if (i < npf)
                for (int l = 0; l < 5; l++) _mm_prefetch((const char *)blk + 4 * rb + 64 * l, _MM_HINT_T1);
            __m256i s[8];
            for (int j = 0; j < 8; j++)
                s[j] = gq_dot8(_mm256_loadu_si256((const __m256i *)(blk + j * GQ8_0_BYTES + 2)),
                               _mm256_loadu_si256((const __m256i *)(xq + (b + j) * QK)));
            const __m128i h = _mm_setr_epi16((short)gq_le16(blk), (short)gq_le16(blk + 34), (short)gq_le16(blk + 68),
                                             (short)gq_le16(blk + 102), (short)gq_le16(blk + 136),
                                             (short)gq_le16(blk + 170), (short)gq_le16(blk + 204),
                                             (short)gq_le16(blk + 238));
            p[i] = _mm256_mul_ps(_mm256_cvtepi32_ps(gq_sums8(s)), _mm256_mul_ps(_mm256_cvtph_ps(h), xdv));
        }
        const __m256 t0 = _mm256_unpacklo_ps(p[0], p[1]), t1 = _mm256_unpackhi_ps(p[0], p[1]);
        const __m256 t2 = _mm256_unpacklo_ps(p[2], p[3]), t3 = _mm256_unpackhi_ps(p[2], p[3]);
        const __m256 u[4] = {_mm256_shuffle_ps(t0, t2, 0x44), _mm256_shuffle_ps(t0, t2, 0xee),
                             _mm256_shuffle_ps(t1, t3, 0x44), _mm256_shuffle_ps(t1, t3, 0xee)};
        for (int j = 0; j < 4; j++) acc = _mm_add_ps(acc, _mm256_castps256_ps128(u[j]));   /* blocks b .. b + 3 */
        for (int j = 0; j < 4; j++) acc = _mm_add_ps(acc, _mm256_extractf128_ps(u[j], 1));  /* b + 4 .. b + 7 */
    }
    _mm_storeu_ps(out, acc);
    for (; b < nb; b++)
        for (int i = 0; i < 4; i++) {
            const uint8_t *blk = row0 + i * rb + b * GQ8_0_BYTES;
            const int32_t isum = gq_hsum(gq_dot8(_mm256_loadu_si256((const __m256i *)(blk + 2)),
                                                 _mm256_loadu_si256((const __m256i *)(xq + b * QK))));
            out[i] += gq_block_product(isum, gq8_scale(blk), xd[b]);
        }
}

static void GQ_GEMM(const cpumla_weight *w, const void *qx, int64_t n, float *y, int64_t ldy, int64_t r0,
                    int64_t r1) {
    const int64_t K = w->cols, per = QX_BYTES(K);
    int64_t r = r0;
    for (; r + 4 <= r1; r += 4)
        for (int64_t t = 0; t < n; t++) {
            const uint8_t *xt = (const uint8_t *)qx + t * per;
            float o[4];
            gq8_rows4(w, r, (const int8_t *)xt, qx_d(xt, K), o);
            for (int i = 0; i < 4; i++) y[t * ldy + (r - r0) + i] = o[i];
        }
    for (; r < r1; r++) {
        if (r + 4 < r1) __builtin_prefetch((const uint8_t *)w->data + (r + 4) * w->row_bytes, 0, 3);
        for (int64_t t = 0; t < n; t++) {
            const uint8_t *xt = (const uint8_t *)qx + t * per;
            y[t * ldy + (r - r0)] = gq8_row(w, r, (const int8_t *)xt, qx_d(xt, K));
        }
    }
}

/* the low-half (bytes 0..15) and high-half sums of 8 chunks' lane vectors, chunk order */
static inline void gq_halves8(const __m256i s[8], __m256i *lo, __m256i *hi) {
    const __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(s[0], s[1]), _mm256_hadd_epi32(s[2], s[3]));
    const __m256i b = _mm256_hadd_epi32(_mm256_hadd_epi32(s[4], s[5]), _mm256_hadd_epi32(s[6], s[7]));
    *lo = _mm256_permute2x128_si256(a, b, 0x20);
    *hi = _mm256_permute2x128_si256(a, b, 0x31);
}

static float gq_row_any(const cpumla_weight *w, int64_t r, const int8_t *xq, const float *xd) {
    const int has_min = gq_info(w->dtype)->has_min;
    const uint8_t *row = (const uint8_t *)w->data + r * w->row_bytes;
    float acc = 0.0f;
    gq_unpacked u;
    int64_t c0 = 0;
    for (; c0 + 256 <= w->cols; c0 += 256) {
        gq_unpack(w->dtype, row, c0, 8, &u);
        __m256i sq[8], sx[8], a0, a1;
        for (int c = 0; c < 8; c++) {
            const __m256i x = _mm256_loadu_si256((const __m256i *)(xq + c0 + 32 * c));
            sq[c] = gq_dot8(_mm256_loadu_si256((const __m256i *)(u.q + 32 * c)), x);
            if (has_min) sx[c] = gq_xsum8(x);
        }
        gq_halves8(sq, &a0, &a1);
        const __m256i sv = _mm256_loadu_si256((const __m256i *)u.s);
        const __m256i isum = _mm256_add_epi32(_mm256_mullo_epi32(_mm256_srai_epi32(_mm256_slli_epi32(sv, 16), 16), a0),
                                              _mm256_mullo_epi32(_mm256_srai_epi32(sv, 16), a1));
        const __m256 xdv = _mm256_loadu_ps(xd + c0 / 32);
        __m256 p = _mm256_mul_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(_mm256_loadu_ps(u.d), xdv));
        if (has_min) {
            __m256i x0, x1;
            gq_halves8(sx, &x0, &x1);
            const __m256i mv = _mm256_loadu_si256((const __m256i *)u.m);
            const __m256i msum = _mm256_add_epi32(_mm256_mullo_epi32(_mm256_srai_epi32(_mm256_slli_epi32(mv, 16), 16), x0),
                                                  _mm256_mullo_epi32(_mm256_srai_epi32(mv, 16), x1));
            p = _mm256_sub_ps(p, _mm256_mul_ps(_mm256_cvtepi32_ps(msum), _mm256_mul_ps(_mm256_loadu_ps(u.dm), xdv)));
        }
        float pv[8];
        _mm256_storeu_ps(pv, p);
        for (int c = 0; c < 8; c++) acc += pv[c];
    }
    if (c0 < w->cols) {                      /* 32-column types: the last chunks of a row */
        const int n = (int)((w->cols - c0) / 32);
        gq_unpack(w->dtype, row, c0, n, &u);
        for (int c = 0; c < n; c++) acc += gq_chunk_spec(&u, c, has_min, xq + c0 + 32 * c, xd[c0 / 32 + c]);
    }
    return acc;
}

static void GQ_GEMM_ANY(const cpumla_weight *w, const void *qx, int64_t n, float *y, int64_t ldy, int64_t r0,
                        int64_t r1) {
    const int64_t K = w->cols, per = QX_BYTES(K);
    for (int64_t r = r0; r < r1; r++) {
        if (r + 4 < r1) __builtin_prefetch((const uint8_t *)w->data + (r + 4) * w->row_bytes, 0, 3);
        for (int64_t t = 0; t < n; t++) {
            const uint8_t *xt = (const uint8_t *)qx + t * per;
            y[t * ldy + (r - r0)] = gq_row_any(w, r, (const int8_t *)xt, qx_d(xt, K));
        }
    }
}
