/* avx512f_q.c: cpumla_quantize's quantize_row and the Q8 / Q4 gemv_t (the MLA absorb of a quantized
 * kv_b) with AVX-512 F/BW/VL/DQ (compiled as avx512f.c is). quantize_row is bit-identical to scalar_q.c's
 * spec. 16 blocks at a time: their maxima land in one vector (a transposing max tree), so the scale
 * work is done once per 16 blocks with the same IEEE operations: fp32 division, fp32 -> fp16 by
 * vcvtps2ph with round-to-nearest-even (f32_to_f16 exactly, subnormal and overflowing results
 * included; tests/native/test_quant.c checks every fp32 input of the range), fp16 -> fp32 (exact), and
 * 1 / d. The codes are v * id in fp32 rounded to nearest even by vcvtps2dq (the spec's magic-number
 * round under the same MXCSR mode, exact for |v * id| < 2^22), then clamped as integers (the same as
 * clamping the rounded float). */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include "core/common.h"
#include "core/kernels.h"
#include "core/quant.h"

/* lane j of the result: the largest (smallest) lane of x[j], the 16 lanes of block j folded by a
 * transposing tree of max (min) */
#define TREE16(NAME, OP)                                                                                   \
    static inline __m512 NAME(const __m512 x[16]) {                                                        \
        __m512 l1[8], l2[4], l3[2];                                                                        \
        for (int i = 0; i < 8; i++) /* lanes 0-1 (128-bit): x[2i] halved, lanes 2-3: x[2i+1] halved */     \
            l1[i] = OP(_mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], 0x44),                                 \
                       _mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], 0xee));                                \
        for (int i = 0; i < 4; i++) /* lane k: one of x[4i .. 4i+3], 4 partials */                         \
            l2[i] = OP(_mm512_shuffle_f32x4(l1[2 * i], l1[2 * i + 1], 0x88),                               \
                       _mm512_shuffle_f32x4(l1[2 * i], l1[2 * i + 1], 0xdd));                              \
        for (int i = 0; i < 2; i++) /* per lane, 2 partials of one block of l2[2i], then 2 of l2[2i+1] */  \
            l3[i] = OP(_mm512_shuffle_ps(l2[2 * i], l2[2 * i + 1], 0x44),                                  \
                       _mm512_shuffle_ps(l2[2 * i], l2[2 * i + 1], 0xee));                                 \
        const __m512 m = OP(_mm512_shuffle_ps(l3[0], l3[1], 0x88), _mm512_shuffle_ps(l3[0], l3[1], 0xdd)); \
        /* lane 4k + e of m is block 4e + k for the blocks' order above */                                 \
        const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);     \
        return _mm512_permutexvar_ps(order, m);                                                            \
    }
/* the max of non-negative floats as integers (quant.h's q_amax: a NaN is not lost to the tree's order) */
static inline __m512 max_bits(__m512 a, __m512 b) {
    return _mm512_castsi512_ps(_mm512_max_epi32(_mm512_castps_si512(a), _mm512_castps_si512(b)));
}
TREE16(max_tree16, _mm512_max_ps)
TREE16(min_tree16, _mm512_min_ps)
TREE16(amax_tree16, max_bits)

/* Q4's m for 16 blocks: the first value of largest magnitude, 0 for an all-zero block. The largest
 * magnitude amax is either the largest value or minus the smallest; a block holding both +amax and
 * -amax (a tie of opposite signs) takes the spec's search for the first. */
static inline __m512 q4_first_max(const float *v, int n, __m512 amax, __m512 pmax, __m512 nmin) {
    const __mmask16 valid = (__mmask16)((1u << n) - 1);
    const __m512 namax = _mm512_sub_ps(_mm512_setzero_ps(), amax);
    const __mmask16 nz = _mm512_mask_cmp_ps_mask(valid, amax, _mm512_setzero_ps(), _CMP_GT_OQ);
    const __mmask16 pos = _mm512_mask_cmp_ps_mask(nz, pmax, amax, _CMP_EQ_OQ);
    const __mmask16 neg = _mm512_mask_cmp_ps_mask(nz, nmin, namax, _CMP_EQ_OQ);
    __m512 m = _mm512_mask_mov_ps(_mm512_setzero_ps(), (__mmask16)(pos & ~neg), amax);
    m = _mm512_mask_mov_ps(m, (__mmask16)(neg & ~pos), namax);
    unsigned search = nz & ~(pos ^ neg);
    if (search) {
        float am[16], mm[16];
        _mm512_storeu_ps(am, amax);
        _mm512_storeu_ps(mm, m);
        for (; search; search &= search - 1) {
            const int j = __builtin_ctz(search);
            const __m512 a = _mm512_set1_ps(am[j]);
            const uint32_t eq =
                (uint32_t)_mm512_cmp_ps_mask(_mm512_abs_ps(_mm512_loadu_ps(v + j * QK)), a, _CMP_EQ_OQ) |
                (uint32_t)_mm512_cmp_ps_mask(_mm512_abs_ps(_mm512_loadu_ps(v + j * QK + 16)), a, _CMP_EQ_OQ) << 16;
            mm[j] = eq ? v[j * QK + __builtin_ctz(eq)] : 0.0f;
        }
        m = _mm512_loadu_ps(mm);
    }
    return m;
}

static void quantize_row_avx512f(int32_t dtype, const float *row, int64_t nb, uint8_t *q, uint16_t *scales) {
    const int q8 = dtype == CPUMLA_Q8;
    const int64_t bb = q8 ? QK : QK / 2;     /* bytes per block */
    for (int64_t b0 = 0; b0 < nb; b0 += 16) {
        const int n = nb - b0 < 16 ? (int)(nb - b0) : 16;
        const float *v = row + b0 * QK;
        /* one pass over the blocks per tree (the loads hit L1), so no tree's inputs spill */
        __m512 x[16];
#define BLOCKS_(OP, A, B)                                                                            \
    for (int j = 0; j < 16; j++)                                                                     \
        x[j] = j < n ? OP(A(_mm512_loadu_ps(v + j * QK)), A(_mm512_loadu_ps(v + j * QK + 16))) : _mm512_setzero_ps();
#define ID_(y) (y)
        BLOCKS_(max_bits, _mm512_abs_ps, _mm512_abs_ps)
        const __m512 amax = amax_tree16(x);
        /* blocks holding a NaN or an infinity: scale NaN, codes 0 (written after the others) */
        const __mmask16 bad = _mm512_mask_cmp_ps_mask((__mmask16)((1u << n) - 1), amax, _mm512_set1_ps(3.40282347e38f), _CMP_NLE_UQ);
        __m512 s;
        if (q8) {
            s = _mm512_div_ps(amax, _mm512_set1_ps(127.0f));
        } else {
            BLOCKS_(_mm512_max_ps, ID_, ID_)
            const __m512 pmax = max_tree16(x);
            BLOCKS_(_mm512_min_ps, ID_, ID_)
            s = _mm512_div_ps(q4_first_max(v, n, amax, pmax, min_tree16(x)), _mm512_set1_ps(-8.0f));
        }
#undef BLOCKS_
#undef ID_
        const __m256i d16 = _mm256_mask_mov_epi16(_mm512_cvtps_ph(s, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), bad,
                                                  _mm256_set1_epi16((short)Q_NAN_F16));
        const __m512 d = _mm512_cvtph_ps(d16);
        /* Q8: id = d > 0 ? 1 / d : 0; Q4: d != 0 ? 1 / d : 0 */
        /* the predicate must be an immediate even in unoptimised (sanitizer) builds: two compares */
        const __mmask16 ok = q8 ? _mm512_cmp_ps_mask(d, _mm512_setzero_ps(), _CMP_GT_OQ)
                                : _mm512_cmp_ps_mask(d, _mm512_setzero_ps(), _CMP_NEQ_OQ);
        const __m512 idv = _mm512_maskz_div_ps(ok, _mm512_set1_ps(1.0f), d);
        _mm256_mask_storeu_epi16(scales + b0, (__mmask16)((1u << n) - 1), d16);
        float id[16];
        _mm512_storeu_ps(id, idv);
        uint8_t *qb = q + b0 * bb;
        if (q8) {
            /* clamped below at -127 as integers; vpmovsdb saturates above at 127 */
            const __m512i lo = _mm512_set1_epi32(-127);
            for (int j = 0; j < n; j++) {
                const __m512 vid = _mm512_set1_ps(id[j]);
                const __m512i i0 = _mm512_max_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(v + j * QK), vid)), lo);
                const __m512i i1 =
                    _mm512_max_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(v + j * QK + 16), vid)), lo);
                _mm_storeu_si128((__m128i *)(qb + j * QK), _mm512_cvtsepi32_epi8(i0));
                _mm_storeu_si128((__m128i *)(qb + j * QK + 16), _mm512_cvtsepi32_epi8(i1));
            }
        } else {
            /* codes c0 (column i) and c1 (column 16 + i) in [-8, 7]: byte i = (c0 + 8) + 16 * (c1 + 8) */
            const __m512i lo = _mm512_set1_epi32(-8), hi = _mm512_set1_epi32(7), off = _mm512_set1_epi32(136);
            for (int j = 0; j < n; j++) {
                const __m512 vid = _mm512_set1_ps(id[j]);
                __m512i i0 = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(v + j * QK), vid));
                __m512i i1 = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(v + j * QK + 16), vid));
                i0 = _mm512_max_epi32(_mm512_min_epi32(i0, hi), lo);
                i1 = _mm512_max_epi32(_mm512_min_epi32(i1, hi), lo);
                const __m512i t = _mm512_add_epi32(_mm512_add_epi32(i0, _mm512_slli_epi32(i1, 4)), off);
                _mm_storeu_si128((__m128i *)(qb + j * (QK / 2)), _mm512_cvtepi32_epi8(t));
            }
        }
        for (unsigned m = bad; m; m &= m - 1) memset(qb + __builtin_ctz(m) * bb, q8 ? 0 : 0x88, (size_t)bb);
    }
}

/* gemv_t for Q8 / Q4 over any columns: y[c - c0] += (x[i] * wd) * wq, rows in order, four at a time, as
 * avx2_q.c's: y is loaded and stored once per 16 columns for four rows, whose FMAs run in row order;
 * Q4's nibbles become fp32 through a 16-entry vpermps table (code - 8), Q8's codes through vpmovsxbd
 * and vcvtdq2ps; the scales of 16 blocks are widened by one vcvtph2ps (exact); the first rows and then
 * the rows QT_PF_ROWS ahead are prefetched. Columns of a block cut by c0 or c1 take a scalar loop. */
static void gemv_t_q_rows4(const cpumla_weight *w, int64_t r0, int64_t nr, const float *x, float *y, int64_t c0,
                           int64_t c1) {
    const int q4 = w->dtype == CPUMLA_Q4;
    const int64_t b1 = (c1 + QK - 1) / QK;
    const __m512 tab = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
    for (int64_t c = c0; c < c1; c++) y[c - c0] = 0.0f;
    for (int64_t i0 = 0; i0 < nr; i0 += 4) {
        const int R = nr - i0 < 4 ? (int)(nr - i0) : 4;
        qt_prefetch(w, r0, i0, nr, c0 / QK, b1);
        const uint8_t *rp[4];
        for (int i = 0; i < 4; i++) rp[i] = weight_row(w, r0 + i0 + (i < R ? i : 0));
        for (int64_t b16 = c0 / QK; b16 < b1; b16 += 16) {
            const int nbk = b1 - b16 < 16 ? (int)(b1 - b16) : 16;
            float xs[4][16];
            for (int i = 0; i < R; i++) {
                const int64_t r = r0 + i0 + i;
                if (nbk == 16) {
                    const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)w->scale + r * w->scale_ld + b16));
                    _mm512_storeu_ps(xs[i], _mm512_mul_ps(_mm512_set1_ps(x[i0 + i]), _mm512_cvtph_ps(h)));
                } else {
                    for (int k = 0; k < nbk; k++) xs[i][k] = x[i0 + i] * q_scale(w, r, b16 + k);
                }
            }
            for (int k = 0; k < nbk; k++) {
                const int64_t b = b16 + k;
                __m512 f[4][2];
                for (int i = 0; i < R; i++) {
                    const uint8_t *row = rp[i];
                    if (q4) {               /* code j: the low nibble of byte j, code 16 + j its high nibble */
                        const __m512i d = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(row + 16 * b)));
                        f[i][0] = _mm512_permutexvar_ps(_mm512_and_si512(d, _mm512_set1_epi32(15)), tab);
                        f[i][1] = _mm512_permutexvar_ps(_mm512_srli_epi32(d, 4), tab);
                    } else {
                        f[i][0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(row + 32 * b))));
                        f[i][1] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(row + 32 * b + 16))));
                    }
                }
                if (R == 4 && b * QK >= c0 && (b + 1) * QK <= c1) {       /* the common case, unrolled */
                    float *yb = y + (b * QK - c0);
                    __m512 a0 = _mm512_loadu_ps(yb), a1 = _mm512_loadu_ps(yb + 16);
                    for (int i = 0; i < 4; i++) {
                        a0 = _mm512_fmadd_ps(_mm512_set1_ps(xs[i][k]), f[i][0], a0);
                        a1 = _mm512_fmadd_ps(_mm512_set1_ps(xs[i][k]), f[i][1], a1);
                    }
                    _mm512_storeu_ps(yb, a0);
                    _mm512_storeu_ps(yb + 16, a1);
                    continue;
                }
                for (int h = 0; h < 2; h++) {
                    const int64_t cs = b * QK + 16 * h;                    /* the vector's first column */
                    if (cs >= c0 && cs + 16 <= c1) {
                        __m512 acc = _mm512_loadu_ps(y + (cs - c0));
                        for (int i = 0; i < R; i++) acc = _mm512_fmadd_ps(_mm512_set1_ps(xs[i][k]), f[i][h], acc);
                        _mm512_storeu_ps(y + (cs - c0), acc);
                    } else if (cs + 16 > c0 && cs < c1) {                  /* a block cut by c0 or c1 */
                        float v[4][16];
                        for (int i = 0; i < R; i++) _mm512_storeu_ps(v[i], f[i][h]);
                        for (int64_t c = cs > c0 ? cs : c0; c < cs + 16 && c < c1; c++)
                            for (int i = 0; i < R; i++) y[c - c0] += xs[i][k] * v[i][c - cs];
                    }
                }
            }
        }
    }
}

/* gemv_t over 8 whole blocks (256 columns) from block b0, rows [i0, i0 + n) of the nr from r0: the 16
 * sums stay in registers over those rows (loaded from y and stored back, y = 0 before row 0), not
 * loaded and stored for every four rows. Per row, the products (x[i] * wd) of the 8 blocks are made
 * ahead of the row loop and read by the FMAs as broadcasts. The same operations in the same order as
 * gemv_t_q_rows4: y = 0, then fma(x_i * wd, wq, y) row by row. Of the row GT_PF_AHEAD ahead (up to
 * nr), the bytes [pf0, pf1) and the line of its scales from b0 are prefetched into L2 (pf1 = 0: none). */
#define GT_CHUNK 16
#define GT_PF_AHEAD 16
static void gemv_t_q_8blocks(const cpumla_weight *w, int64_t r0, int64_t i0, int64_t n, int64_t nr, const float *x,
                             float *y, int64_t b0, int64_t pf0, int64_t pf1) {
    const int q4 = w->dtype == CPUMLA_Q4;
    const int64_t bb = q4 ? QK / 2 : QK;                            /* bytes a block */
    const __m512 tab = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
    __m512 acc[16];
    for (int k = 0; k < 16; k++) acc[k] = i0 ? _mm512_loadu_ps(y + 16 * k) : _mm512_setzero_ps();
    float coef[GT_CHUNK][8];
    for (int64_t i = 0; i < n; i++) {
        const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)q_scale_row(w, r0 + i0 + i) + b0));
        _mm256_storeu_ps(coef[i], _mm256_mul_ps(_mm256_set1_ps(x[i0 + i]), _mm256_cvtph_ps(h)));
    }
    for (int64_t i = 0; i < n; i++) {
        if (pf1 && i0 + i + GT_PF_AHEAD < nr) {
            const char *p = (const char *)weight_row(w, r0 + i0 + i + GT_PF_AHEAD);
            for (int64_t o = pf0 & ~(int64_t)63; o < pf1; o += 64) _mm_prefetch(p + o, _MM_HINT_T1);
            _mm_prefetch((const char *)((const uint16_t *)q_scale_row(w, r0 + i0 + i + GT_PF_AHEAD) + b0), _MM_HINT_T1);
        }
        const uint8_t *row = weight_row(w, r0 + i0 + i) + b0 * bb;
        for (int k = 0; k < 8; k++) {
            __m512 lo, hi;
            if (q4) {               /* code j: the low nibble of byte j, code 16 + j its high nibble */
                const __m512i d = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(row + 16 * k)));
                lo = _mm512_permutexvar_ps(d, tab);             /* vpermps reads the index's low 4 bits */
                hi = _mm512_permutexvar_ps(_mm512_srli_epi32(d, 4), tab);
            } else {
                lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(row + 32 * k))));
                hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(row + 32 * k + 16))));
            }
            const __m512 c = _mm512_set1_ps(coef[i][k]);
            acc[2 * k] = _mm512_fmadd_ps(c, lo, acc[2 * k]);
            acc[2 * k + 1] = _mm512_fmadd_ps(c, hi, acc[2 * k + 1]);
        }
    }
    for (int k = 0; k < 16; k++) _mm512_storeu_ps(y + 16 * k, acc[k]);
}

/* gemv_t for Q8 / Q4 (kernels.h): whole 8-block spans of the columns by gemv_t_q_8blocks, the rest
 * (fewer than 8 blocks, or columns that do not start a block) by gemv_t_q_rows4. The rows go in
 * chunks of GT_CHUNK, each through every span before the next: a chunk (8 KiB of Q8 rows of 512
 * columns) comes from memory once, prefetched whole into L2 by the first span's pass, and the other
 * spans find it in cache, so the stream from memory runs at one rate rather than in a burst for the
 * first span and none for the rest. */
static void gemv_t_q_avx512f(const cpumla_weight *w, int64_t r0, int64_t nr, const float *x, float *y, int64_t c0,
                             int64_t c1) {
    const int64_t bb = w->dtype == CPUMLA_Q4 ? QK / 2 : QK;      /* bytes a block */
    const int64_t c8 = c0 % QK == 0 ? c0 + (c1 - c0) / (8 * QK) * (8 * QK) : c0;   /* the spans' end */
    for (int64_t i0 = 0; i0 < nr && c8 > c0; i0 += GT_CHUNK) {
        const int64_t n = nr - i0 < GT_CHUNK ? nr - i0 : GT_CHUNK;
        for (int64_t c = c0; c < c8; c += 8 * QK)
            gemv_t_q_8blocks(w, r0, i0, n, nr, x, y + (c - c0), c / QK, c == c0 ? c0 / QK * bb : 0,
                             c == c0 ? (c1 + QK - 1) / QK * bb : 0);
    }
    if (c8 < c1) gemv_t_q_rows4(w, r0, nr, x, y + (c8 - c0), c8, c1);
}

void cpumla_fill_avx512f_q(cpumla_kernels *k) {
    k->quantize_row = quantize_row_avx512f;
    k->gemv_t_q = gemv_t_q_avx512f;
    for (int f = CPUMLA_Q8; f <= CPUMLA_Q4; f++) k->who_fmt[K_GEMV_T][f] = "avx512f";
    cpumla_fill_avx512f_fp4(k);        /* avx512f_fp4.c: E2M1's integer products */
}
