/* avx512_q.c: Q8 / Q4 kernels with AVX-512 VNNI (compiled as avx512.c is). Semantics: scalar_q.c
 * (kernels.h). vpdpbusd multiplies unsigned by signed bytes, 4 per int32 lane: Q8 weights go in as
 * w + 128 (w ^ 0x80) and Q4 as the nibbles themselves, and the lanes start from the per-block
 * correction quant_x stored (-128 or -8 times the activation block's code sum, in the block's first
 * lane), so the lanes of a block add up to its exact integer dot product.
 * Both formats run 4 blocks a vector pair, lanes 4j..4j+3 for block j: Q4's 64 bytes give the blocks'
 * columns 0-15 (AND) and 16-31 (shift); Q8's 128 bytes are regrouped into the same two halves with
 * vpermt2q. The activations are laid out to match (quant.h). Steps of 8 blocks per row: the 8 fp16
 * scales of a step are converted at once and spread over the lanes with vpermps; the last step of a
 * row is masked (weights and scales past the row read as zero, the activation buffer is zero-padded to
 * 256 columns). Tiles of up to 4 rows x 2 tokens. */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include "common.h"
#include "kernels.h"
#include "quant.h"

#define INLINE static inline __attribute__((always_inline))
#define UNROLL _Pragma("GCC unroll 16")

static void quant_x_avx512(int32_t wdtype, const float *x, int64_t K, void *qx) {
    int8_t *q = qx;
    float *d = qx_d(qx, K);
    int32_t *s = qx_s(qx, K);
    const int64_t nb = K / QK, kp = qx_kp(K);
    const int q4 = wdtype == CPUMLA_Q4;
    memset(q, 0, (size_t)kp);
    for (int64_t b = 0; b < kp / QK; b++) { d[b] = 0.0f; s[b] = 0; }
    for (int64_t b = 0; b < nb; b++) {
        __m512 v0 = _mm512_loadu_ps(x + b * QK), v1 = _mm512_loadu_ps(x + b * QK + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
        const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
        d[b] = amax / 127.0f;
        __m512i i0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, _mm512_set1_ps(id)));    /* nearest even */
        __m512i i1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, _mm512_set1_ps(id)));
        s[b] = (q4 ? -8 : -128) * _mm512_reduce_add_epi32(_mm512_add_epi32(i0, i1));
        int8_t *lo = q + (b / 4) * 128 + (b % 4) * 16, *hi = lo + 64;
        _mm_storeu_si128((__m128i *)lo, _mm512_cvtepi32_epi8(i0));
        _mm_storeu_si128((__m128i *)hi, _mm512_cvtepi32_epi8(i1));
    }
}

INLINE __mmask64 bytes_mask(int64_t n) { return n >= 64 ? ~(__mmask64)0 : n <= 0 ? 0 : (((__mmask64)1 << n) - 1); }

/* y[t*ldy + i] = row r + i . token t, i < R, t < T. pr: the row whose group to prefetch (software
 * prefetch of the lines a later group of rows reads, at the same offsets: four new row streams at a
 * time are more than the hardware prefetchers pick up on their own) */
INLINE void tile(const cpumla_weight *w, int64_t r, int R, const uint8_t *qx, int64_t per, int T, float *y,
                 int64_t ldy, int q4, int64_t pr) {
    const int64_t K = w->cols, nb = K / QK;
    const uint8_t *rp[4], *pp[4];
    const uint16_t *sp[4], *ps[4];
    UNROLL for (int i = 0; i < 4; i++) {
        rp[i] = weight_row(w, r + (i < R ? i : 0));
        sp[i] = (const uint16_t *)w->scale + (r + (i < R ? i : 0)) * w->scale_ld;
        pp[i] = weight_row(w, pr + (i < R ? i : 0));
        ps[i] = (const uint16_t *)w->scale + (pr + (i < R ? i : 0)) * w->scale_ld;
    }
    const uint8_t *xq[2] = {qx, qx + (T > 1 ? per : 0)};
    const float *xd[2] = {qx_d(xq[0], K), qx_d(xq[1], K)};
    const int32_t *xs[2] = {qx_s(xq[0], K), qx_s(xq[1], K)};
    /* lane spreads of the 8 scales of a step: Q8 vector j has blocks 2j, 2j+1; Q4 vector j blocks 4j..4j+3 */
    __m512i spread[4];
    UNROLL for (int j = 0; j < 4; j++) {
        spread[j] = _mm512_setr_epi32(4 * j, 4 * j, 4 * j, 4 * j, 4 * j + 1, 4 * j + 1, 4 * j + 1, 4 * j + 1,
                                      4 * j + 2, 4 * j + 2, 4 * j + 2, 4 * j + 2, 4 * j + 3, 4 * j + 3, 4 * j + 3, 4 * j + 3);
    }
    const int NV = 2;                               /* groups of 4 blocks a step */
    const int64_t BB = q4 ? 16 : 32;                /* weight bytes a block */
    /* Q8: the 16-byte halves of 4 blocks (two 64-byte loads) regrouped as Q4's low / high nibbles are */
    const __m512i lo_half = _mm512_setr_epi64(0, 1, 4, 5, 8, 9, 12, 13), hi_half = _mm512_setr_epi64(2, 3, 6, 7, 10, 11, 14, 15);
    const __m512i x80 = _mm512_set1_epi8((char)0x80), m4 = _mm512_set1_epi8(15);
    __m512 acc[4][2];
    UNROLL for (int i = 0; i < 4; i++) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b += 8) {
        const int64_t vb = nb - b < 8 ? nb - b : 8;     /* blocks of this step */
        __m512 sx[2][4];
        __m512i corr[2][4];         /* each block's correction in its first lane (the spread's lanes) */
        UNROLL for (int t = 0; t < T; t++) {
            __m512 d8 = _mm512_castps256_ps512(_mm256_loadu_ps(xd[t] + b));
            __m512i s8 = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(xs[t] + b)));
            UNROLL for (int j = 0; j < NV; j++) {
                sx[t][j] = _mm512_permutexvar_ps(spread[j], d8);
                corr[t][j] = _mm512_maskz_permutexvar_epi32(0x1111, spread[j], s8);
            }
        }
        UNROLL for (int i = 0; i < R; i++) {
            for (int j = 0; j < NV * (q4 ? 1 : 2); j++) _mm_prefetch((const char *)(pp[i] + b * BB + 64 * j), _MM_HINT_T0);
            if ((b & 31) == 0) _mm_prefetch((const char *)(ps[i] + b), _MM_HINT_T0);
            __m512 w8 = _mm512_castps256_ps512(_mm256_cvtph_ps(_mm_maskz_loadu_epi16((__mmask8)((1u << vb) - 1u), sp[i] + b)));
            UNROLL for (int j = 0; j < NV; j++) {
                __m512i wlo, whi;            /* unsigned operands: cols 0-15 / 16-31 of blocks b+4j .. b+4j+3 */
                if (q4) {
                    const __m512i wv = _mm512_maskz_loadu_epi8(bytes_mask((vb - 4 * j) * 16), rp[i] + b * 16 + 64 * j);
                    wlo = _mm512_and_si512(wv, m4);
                    whi = _mm512_and_si512(_mm512_srli_epi16(wv, 4), m4);
                } else {
                    const uint8_t *p = rp[i] + (b + 4 * j) * 32;
                    const __m512i A = _mm512_maskz_loadu_epi8(bytes_mask((vb - 4 * j) * 32), p);
                    const __m512i B = _mm512_maskz_loadu_epi8(bytes_mask((vb - 4 * j - 2) * 32), p + 64);
                    wlo = _mm512_xor_si512(_mm512_permutex2var_epi64(A, lo_half, B), x80);
                    whi = _mm512_xor_si512(_mm512_permutex2var_epi64(A, hi_half, B), x80);
                }
                const __m512 sw = _mm512_permutexvar_ps(spread[j], w8);
                UNROLL for (int t = 0; t < T; t++) {
                    const uint8_t *xg = xq[t] + (b / 4 + j) * 128;
                    __m512i a = _mm512_dpbusd_epi32(corr[t][j], wlo, _mm512_loadu_si512(xg));
                    a = _mm512_dpbusd_epi32(a, whi, _mm512_loadu_si512(xg + 64));
                    acc[i][t] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(a), sx[t][j]), sw, acc[i][t]);
                }
            }
        }
    }
    UNROLL for (int t = 0; t < T; t++)
        UNROLL for (int i = 0; i < R; i++) y[t * ldy + i] = _mm512_reduce_add_ps(acc[i][t]);
}

#define TILE(R, T)                                                                   \
    static void tile_##R##_##T(const cpumla_weight *w, int64_t r, const uint8_t *qx, int64_t per, float *y, \
                               int64_t ldy, int64_t pr) {                            \
        if (w->dtype == CPUMLA_Q4) tile(w, r, R, qx, per, T, y, ldy, 1, pr);         \
        else tile(w, r, R, qx, per, T, y, ldy, 0, pr);                               \
    }
TILE(1, 1) TILE(2, 1) TILE(3, 1) TILE(4, 1) TILE(1, 2) TILE(2, 2) TILE(3, 2) TILE(4, 2)
typedef void (*tile_fn)(const cpumla_weight *, int64_t, const uint8_t *, int64_t, float *, int64_t, int64_t);
static const tile_fn tiles[2][4] = {{tile_1_1, tile_2_1, tile_3_1, tile_4_1}, {tile_1_2, tile_2_2, tile_3_2, tile_4_2}};

static void gemm_q_avx512(const cpumla_weight *w, const void *qx, int64_t n, float *y, int64_t ldy, int64_t r0,
                          int64_t r1) {
    const int64_t per = QX_BYTES(w->cols), data = w->dtype == CPUMLA_Q4 ? w->cols / 2 : w->cols;
    const int64_t ahead = ((16384 + 4 * data - 1) / (4 * data)) * 4;     /* rows about 16 KiB ahead */
    for (int64_t r = r0; r < r1; r += 4) {
        const int R = r1 - r < 4 ? (int)(r1 - r) : 4;
        int64_t pr = r + ahead + 4 <= r1 ? r + ahead : r;                /* the range's end: nothing new */
        for (int64_t t = 0; t < n; t += 2) {
            const int T = n - t < 2 ? 1 : 2;
            tiles[T - 1][R - 1](w, r, (const uint8_t *)qx + t * per, per, y + t * ldy + (r - r0), ldy, t ? r : pr);
        }
    }
}

void cpumla_fill_avx512_q(cpumla_kernels *k) {
    k->quant_x = quant_x_avx512;
    k->gemm_q = gemm_q_avx512;
    for (int f = CPUMLA_Q8; f <= CPUMLA_Q4; f++) k->who_fmt[K_GEMV][f] = k->who_fmt[K_GEMM][f] = "avx512";
}
