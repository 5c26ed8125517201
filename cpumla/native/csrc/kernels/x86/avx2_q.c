/* avx2_q.c: the avx2 level's integer products (Q8 / Q4 / E2M1, quant.h): the tile of int_avx2.h
 * under quant_driver.h's gemv / gemm, the activation quantization (quant_x), the Q8 / Q4 gemv_t and
 * cpumla_quantize's quantize_row. Compiled as avx2.c is; avxvnni_q.c reuses the tile with AVX-VNNI and
 * takes everything else from here. */
#include "kernels/x86/int_avx2.h"

#define QDRIVER_GEMM gemm_q_avx2
#define QDRIVER_PF_L2 cpumla_pf_l2_plain
#define QDRIVER_FEW 3                        /* 2 or 3 tokens: rows one at a time (int_avx2.h's tile_run) */
#define QDRIVER_PANEL cpumla_gemm_qp_avx2    /* Q8 / Q4 from GQ2_MIN tokens: avx2_gqp.c's panels */
#include "kernels/generic/quant_driver.h"

/* the 32 signed codes of block b of a row (Q8 / Q4) */
INLINE __m256i ld_block(const uint8_t *row, int64_t b, int q4) {
    if (!q4) return _mm256_loadu_si256((const __m256i *)(row + 32 * b));
    __m128i v = _mm_loadu_si128((const __m128i *)(row + 16 * b));
    __m256i n = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), _mm256_set1_epi8(15));
    return _mm256_sub_epi8(n, _mm256_set1_epi8(8));
}

/* one block's 32 codes (int32, each fitting int8) stored at q in the format's order (quant.h) */
INLINE void put_codes(const __m256i i[4], int fp4, int q4, int8_t *q, int64_t b) {
    /* packs interleave 128-bit lanes: [0a 1a 0b 1b] -> fix with a dword permute */
    __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3]));
    p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    if (fp4) {            /* [even columns | odd columns], the order of the low and high nibbles */
        const __m128i eo = _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
        p = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(p, _mm256_set_m128i(eo, eo)), 0xd8);
    }
    if (q4) {             /* pairs of blocks: [cols 0-15 of b, b+1 | cols 16-31 of b, b+1] */
        int8_t *g = q + (b / 2) * 64 + (b % 2) * 16;
        _mm_storeu_si128((__m128i *)g, _mm256_castsi256_si128(p));
        _mm_storeu_si128((__m128i *)(g + 32), _mm256_extracti128_si256(p, 1));
    } else {
        _mm256_storeu_si256((__m256i *)(q + b * QK), p);
    }
}

static void quant_x_avx2(int32_t wdtype, const float *x, int64_t K, void *qx) {
    const int fp4 = wdtype == CPUMLA_E2M1, q4 = wdtype == CPUMLA_Q4 || fp4;
    int8_t *q = qx, *ql = qx_lo(qx, K);
    float *d = qx_d(qx, K);
    int32_t *s = qx_s(qx, K);
    const int64_t nb = K / QK, kp = qx_kp(K);
    const __m256 absm = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    if (q4) memset(q, 0, (size_t)kp);         /* the pair layout leaves a gap after an odd last block */
    if (fp4) memset(ql, 0, (size_t)kp);
    /* zero past the row: E2M1 from the last group of 8 on (its blocks are stored permuted, below) */
    for (int64_t b = fp4 ? nb & ~(int64_t)7 : nb; b < kp / QK; b++) { d[b] = 0.0f; s[b] = 0; }
    for (int64_t b = 0; b < nb; b++) {
        /* E2M1: xd and the int32 per 8 blocks in the order the tile's sums come out (0 2 4 6 1 3 5 7) */
        const int64_t at = fp4 ? (b & ~(int64_t)7) | ((b & 1) << 2) | ((b & 7) >> 1) : b;
        const float *xb = x + b * QK;
        __m256 v[4];
        for (int k = 0; k < 4; k++) v[k] = _mm256_loadu_ps(xb + 8 * k);
        const float amax = amax32(v, absm), qmax = qact_max(wdtype), id = qact_id(amax, qmax);
        d[at] = qact_xd(amax, qmax);
        if (q_nonfinite(amax))                                          /* codes 0 */
            for (int k = 0; k < 4; k++) v[k] = _mm256_setzero_ps();
        const __m256 vid = _mm256_set1_ps(id);
        __m256i i[4];
        for (int k = 0; k < 4; k++) i[k] = _mm256_cvtps_epi32(_mm256_mul_ps(v[k], vid));   /* nearest even */
        __m256i sum = _mm256_add_epi32(_mm256_add_epi32(i[0], i[1]), _mm256_add_epi32(i[2], i[3]));
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
        s[at] = (fp4 ? -12 : q4 ? -8 : 1) * _mm_cvtsi128_si32(s4);
        if (fp4) {            /* q = 256 * hi + lo: lo the sign-extended low byte (quant.h's q_lo, q_hi) */
            __m256i l[4];
            for (int k = 0; k < 4; k++) {
                l[k] = _mm256_srai_epi32(_mm256_slli_epi32(i[k], 24), 24);
                i[k] = _mm256_srai_epi32(_mm256_sub_epi32(i[k], l[k]), 8);
            }
            put_codes(l, 1, 1, ql, b);
        }
        put_codes(i, fp4, q4, q, b);
    }
    if (!q4) memset(q + K, 0, (size_t)(kp - K));
}

/* y[c - c0] += (x[i] * wd) * wq, rows in order, four at a time: each 8 columns of y are loaded and
 * stored once for four rows, whose FMAs run in row order (as one row at a time adds them), and the
 * scales of 8 blocks are widened by one vcvtph2ps (exact, as f16_to_f32). Four rows read a block at a
 * time are not a stream the hardware prefetchers follow, so the first rows and then the rows
 * QT_PF_ROWS ahead are prefetched. */
static void gemv_t_q_avx2(const cpumla_weight *w, int64_t r0, int64_t nr, const float *x, float *y, int64_t c0,
                          int64_t c1) {
    const int q4 = w->dtype == CPUMLA_Q4;
    const int64_t b1 = (c1 + QK - 1) / QK;
    for (int64_t c = c0; c < c1; c++) y[c - c0] = 0.0f;
    int8_t wq[4][QK] __attribute__((aligned(32)));
    for (int64_t i0 = 0; i0 < nr; i0 += 4) {
        const int R = nr - i0 < 4 ? (int)(nr - i0) : 4;
        qt_prefetch(w, r0, i0, nr, c0 / QK, b1);
        const uint8_t *rp[4];
        for (int i = 0; i < 4; i++) rp[i] = weight_row(w, r0 + i0 + (i < R ? i : 0));
        for (int64_t b8 = c0 / QK; b8 < b1; b8 += 8) {
            const int nbk = b1 - b8 < 8 ? (int)(b1 - b8) : 8;
            float xs[4][8];
            for (int i = 0; i < R; i++) {
                const int64_t r = r0 + i0 + i;
                if (nbk == 8) {
                    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)w->scale + r * w->scale_ld + b8));
                    _mm256_storeu_ps(xs[i], _mm256_mul_ps(_mm256_set1_ps(x[i0 + i]), _mm256_cvtph_ps(h)));
                } else {
                    for (int k = 0; k < nbk; k++) xs[i][k] = x[i0 + i] * q_scale(w, r, b8 + k);
                }
            }
            for (int k = 0; k < nbk; k++) {
                const int64_t b = b8 + k;
                for (int i = 0; i < R; i++)
                    _mm256_store_si256((__m256i *)wq[i], q4 ? ld_block(rp[i], b, 1) : ld_block(rp[i], b, 0));
                int64_t c = b * QK > c0 ? b * QK : c0;
                const int64_t hi = (b + 1) * QK < c1 ? (b + 1) * QK : c1;
                for (; c + 8 <= hi; c += 8) {
                    __m256 acc = _mm256_loadu_ps(y + c - c0);
                    for (int i = 0; i < R; i++) {
                        const __m128i q = _mm_loadl_epi64((const __m128i *)(wq[i] + c - b * QK));
                        acc = _mm256_fmadd_ps(_mm256_set1_ps(xs[i][k]), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), acc);
                    }
                    _mm256_storeu_ps(y + c - c0, acc);
                }
                for (; c < hi; c++)
                    for (int i = 0; i < R; i++) y[c - c0] += xs[i][k] * (float)wq[i][c - b * QK];
            }
        }
    }
}

/* cpumla_quantize's quantize_row, bit-identical to scalar_q.c's spec: the block max, the scale (the
 * same scalar fp32 divisions and f32_to_f16 / f16_to_f32), and the codes, v * id in fp32 rounded to
 * nearest even by vcvtps2dq (the spec's magic-number round under the same MXCSR mode, exact for
 * |v * id| < 2^22) then clamped as integers (the same as clamping the rounded float). */
static void quantize_row_avx2(int32_t dtype, const float *row, int64_t nb, uint8_t *q, uint16_t *scales) {
    const __m256 absm = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256i lo8 = _mm256_set1_epi32(dtype == CPUMLA_Q8 ? -127 : -8);
    const __m256i hi8 = _mm256_set1_epi32(dtype == CPUMLA_Q8 ? 127 : 7);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);   /* undoes the packs' lane interleave */
    for (int64_t b = 0; b < nb; b++) {
        const float *v = row + b * QK;
        __m256 x[4], a[4];
        for (int j = 0; j < 4; j++) {
            x[j] = _mm256_loadu_ps(v + 8 * j);
            a[j] = _mm256_and_ps(x[j], absm);
        }
        const float amax = amax32(x, absm);
        if (q_nonfinite(amax)) {
            memset(q + b * (dtype == CPUMLA_Q8 ? QK : QK / 2), dtype == CPUMLA_Q8 ? 0 : 0x88, dtype == CPUMLA_Q8 ? QK : QK / 2);
            scales[b] = Q_NAN_F16;
            continue;
        }
        float id;
        if (dtype == CPUMLA_Q8) {
            const uint16_t d16 = f32_to_f16(amax / 127.0f);
            const float d = f16_to_f32(d16);
            id = d > 0.0f ? 1.0f / d : 0.0f;
            scales[b] = d16;
        } else {
            float m = 0.0f;
            if (amax > 0.0f) {    /* the first value of largest magnitude */
                const __m256 am = _mm256_set1_ps(amax);
                uint32_t eq = 0;
                for (int j = 0; j < 4; j++)
                    eq |= (uint32_t)_mm256_movemask_ps(_mm256_cmp_ps(a[j], am, _CMP_EQ_OQ)) << (8 * j);
                m = v[__builtin_ctz(eq)];
            }
            const uint16_t d16 = f32_to_f16(m / -8.0f);
            const float d = f16_to_f32(d16);
            id = d != 0.0f ? 1.0f / d : 0.0f;
            scales[b] = d16;
        }
        const __m256 vid = _mm256_set1_ps(id);
        __m256i c[4];
        for (int j = 0; j < 4; j++) {
            c[j] = _mm256_cvtps_epi32(_mm256_mul_ps(x[j], vid));
            c[j] = _mm256_max_epi32(_mm256_min_epi32(c[j], hi8), lo8);
            if (dtype != CPUMLA_Q8) c[j] = _mm256_sub_epi32(c[j], lo8);    /* nibble = code + 8 */
        }
        /* values fit int8, so the saturating packs are exact */
        __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
        p = _mm256_permutevar8x32_epi32(p, order);
        if (dtype == CPUMLA_Q8) {
            _mm256_storeu_si256((__m256i *)(q + b * QK), p);
        } else {
            /* column i in the low half of byte i, column 16 + i in the high half */
            const __m128i n = _mm_or_si128(_mm256_castsi256_si128(p), _mm_slli_epi16(_mm256_extracti128_si256(p, 1), 4));
            _mm_storeu_si128((__m128i *)(q + b * (QK / 2)), n);
        }
    }
}

void cpumla_fill_avx2_q(cpumla_kernels *k) {
    k->quantize_row = quantize_row_avx2;
    k->quant_x = quant_x_avx2;
    k->gemm_q = gemm_q_avx2;
    k->gemv_t_q = gemv_t_q_avx2;
    for (int f = CPUMLA_Q8; f <= CPUMLA_Q4; f++)
        k->who_fmt[K_GEMV][f] = k->who_fmt[K_GEMM][f] = k->who_fmt[K_GEMV_T][f] = "avx2";
    k->who_fmt[K_GEMV][CPUMLA_E2M1] = E2M1_WHO("avx2");
    k->who_fmt[K_GEMM][CPUMLA_E2M1] = E2M1_GEMM_WHO("avx2", FP4_FMA_MIN_AVX2);      /* avx2_gemm.c's gemm_fp4 */
}
