/* int_avx2.h: the integer products' tile (Q8 / Q4 / E2M1, quant.h) in 256-bit vectors, compiled by
 * avx2_q.c (the avx2 level) and, with -mavxvnni, by avxvnni_q.c (the avxvnni level). Semantics:
 * scalar_q.c (kernels.h), to the rounding: exact block sums, (float)isum * (wd * xd) rounded as the
 * spec rounds it, only the fp32 sums over blocks associated differently.
 * Q8 (activations in column order): |w| (vpsignb w, w) times x with w's sign (vpsignb x, w) in
 * vpmaddubsw (pair sums fit int16), vpmaddwd by ones, then vphaddd reduces 8 blocks to one lane each.
 * Q4 (activations in pairs of blocks, quant.h): the nibbles are vpmaddubsw's unsigned operand as they
 * are, two vphaddw levels stay below 2^15, and the per-block correction (-8 times the activation code
 * sum) makes the sums exact. E2M1 is Q4 with even / odd columns for Q4's first / last 16 (quant.h) and
 * a vpshufb table from each nibble to w2 + 12 (0..24) against its int16 activation codes' two int8
 * halves (quant.h): per half one vphaddw level stays below 2^15, vpmaddwd by 256 (high bytes) or 1
 * (low bytes) widens, vpaddd and vphaddd do the rest, and the correction is -12 times the code sum;
 * the E8M0 scales become 2^(e - 128) with integer operations.
 * With AVX-VNNI (__AVXVNNI__) vpdpbusd (4 u8 x s8 products into each int32 lane, accumulating)
 * replaces vpmaddubsw, vphaddw and vpmaddwd in the block sums, with the same inputs and the same exact
 * sums: Q8 takes w + 128 (its sign bit flipped) as the unsigned operand and subtracts 128 times the
 * code sum, E2M1 shifts the high bytes' sums left by 8 before the low bytes' products add in.
 * The fp32 work runs once per 8 blocks. The includer defines QDRIVER_GEMM and QDRIVER_PF_L2 and
 * includes kernels/generic/quant_driver.h after this: gemv reads the rows in order, one at a time (one
 * stream, prefetched ahead); a gemm of 2 or 3 tokens the same, each row's unpacked blocks shared by its
 * tokens (quant_driver.h's gemv_rows); larger ones run tiles of up to 4 rows x 2 tokens. */
#ifndef CPUMLA_INT_AVX2_H
#define CPUMLA_INT_AVX2_H
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include "core/common.h"
#include "core/kernels.h"
#include "core/quant.h"
#include "kernels/x86/avx2_common.h"

/* the spec rounds each product: keep the compiler from fusing it into the add that follows */
#define ROUNDED(v) __asm__("" : "+x"(v))
#ifndef QPF_BYTES
#define QPF_BYTES 8192     /* gemv: software prefetch distance along the row stream */
#endif

/* the weight format a tile is specialised for: F_FP4X is E2M1 with scale bytes 0, 1 or 0xff somewhere
 * in the tile's rows (their full conversion), F_FP4 with none */
enum { F_Q8, F_Q4, F_FP4, F_FP4X };

/* acc += (float)isum * (wd * xd) for 8 blocks, each product rounded (kernels.h) */
INLINE __m256 step_acc(__m256 acc, __m256i isum, __m256 wd, const float *xd) {
    __m256 f = _mm256_mul_ps(wd, _mm256_loadu_ps(xd));
    ROUNDED(f);
    __m256 p = _mm256_mul_ps(_mm256_cvtepi32_ps(isum), f);
    ROUNDED(p);
    return _mm256_add_ps(acc, p);
}

/* 8 blocks of a row from p (vb < 8: the row's last vb blocks, the rest read as zero): Q8, w[j] =
 * block j's codes; Q4, lo[v] / hi[v] = columns 0-15 / 16-31 of blocks 2v, 2v + 1 (the nibbles); E2M1,
 * the even / odd columns of blocks 2v, 2v + 1 as w2 + 12 */
INLINE void load_step(const uint8_t *p, int fmt, int64_t vb, __m256i lo[4], __m256i hi[4]) {
    if (fmt == F_Q8) {
        for (int j = 0; j < 8; j++)
            (j < 4 ? lo : hi)[j & 3] = j < vb ? _mm256_loadu_si256((const __m256i *)(p + 32 * j)) : _mm256_setzero_si256();
        return;
    }
    const __m256i m4 = _mm256_set1_epi8(15);
    for (int v = 0; v < 4; v++) {
        __m256i wv;
        if (2 * v + 2 <= vb) wv = _mm256_loadu_si256((const __m256i *)(p + 32 * v));
        else if (2 * v + 1 == vb) wv = _mm256_zextsi128_si256(_mm_loadu_si128((const __m128i *)(p + 32 * v)));
        else wv = _mm256_setzero_si256();
        lo[v] = _mm256_and_si256(wv, m4);
        hi[v] = _mm256_and_si256(_mm256_srli_epi16(wv, 4), m4);
        if (fmt >= F_FP4) {
            const __m256i u = _mm256_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0,
                                               12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0);
            lo[v] = _mm256_shuffle_epi8(u, lo[v]);
            hi[v] = _mm256_shuffle_epi8(u, hi[v]);
        }
    }
}

/* int16 lanes of 4 vectors' (u * x) pair sums over 8 blocks: p[v] = lo[v] . x + hi[v] . (x + 32) */
INLINE void pair_sums(const __m256i lo[4], const __m256i hi[4], const uint8_t *xg, __m256i p[4]) {
    for (int v = 0; v < 4; v++)
        p[v] = _mm256_add_epi16(_mm256_maddubs_epi16(lo[v], _mm256_loadu_si256((const __m256i *)(xg + 64 * v))),
                                _mm256_maddubs_epi16(hi[v], _mm256_loadu_si256((const __m256i *)(xg + 64 * v + 32))));
}

/* the 8 exact block sums of a step, in block order (E2M1: 0 2 4 6 1 3 5 7); xg: the step's 256
 * activation codes (E2M1: their high bytes, the low at xl) */
INLINE __m256i step_sums(const __m256i lo[4], const __m256i hi[4], int fmt, const uint8_t *xg, const uint8_t *xl,
                         const int32_t *corr) {
    if (fmt == F_Q8) {
        __m256i p[8];
        for (int j = 0; j < 8; j++) {
            const __m256i w = (j < 4 ? lo : hi)[j & 3], x = _mm256_loadu_si256((const __m256i *)(xg + 32 * j));
#if defined(__AVXVNNI__)          /* (w + 128) . x = w . x + 128 * (the code sum, corr) */
            p[j] = _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), _mm256_xor_si256(w, _mm256_set1_epi8((char)0x80)), x);
#else                             /* |w| times x with w's sign: pair sums fit int16, vpmaddwd makes them int32 */
            p[j] = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w)),
                                     _mm256_set1_epi16(1));
#endif
        }
        /* per 128-bit half: [b0 b1 b2 b3] and [b4 .. b7] after two levels; the halves then add up */
        const __m256i g0 = _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3]));
        const __m256i g1 = _mm256_hadd_epi32(_mm256_hadd_epi32(p[4], p[5]), _mm256_hadd_epi32(p[6], p[7]));
        const __m256i h = _mm256_add_epi32(_mm256_permute2x128_si256(g0, g1, 0x20), _mm256_permute2x128_si256(g0, g1, 0x31));
#if defined(__AVXVNNI__)
        return _mm256_sub_epi32(h, _mm256_slli_epi32(_mm256_loadu_si256((const __m256i *)corr), 7));
#else
        return h;
#endif
    }
#if defined(__AVXVNNI__)
    /* Q4: nibble . x per 4 columns; E2M1: (w2 + 12) . high bytes, shifted left by 8, then + (w2 + 12) .
     * low bytes. Lanes 0-3 / 4-7 of p[v] belong to blocks 2v / 2v + 1: two vphaddd levels leave blocks
     * 0 2 4 6 | 1 3 5 7 */
    __m256i p[4];
    for (int v = 0; v < 4; v++) {
        const __m256i *xv = (const __m256i *)(xg + 64 * v);
        p[v] = _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), lo[v], _mm256_loadu_si256(xv)),
                                       hi[v], _mm256_loadu_si256(xv + 1));
        if (fmt != F_Q4) {
            const __m256i *lv = (const __m256i *)(xl + 64 * v);
            p[v] = _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(_mm256_slli_epi32(p[v], 8), lo[v], _mm256_loadu_si256(lv)),
                                           hi[v], _mm256_loadu_si256(lv + 1));
        }
    }
    __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3]));
    if (fmt == F_Q4) h = _mm256_permutevar8x32_epi32(h, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
#else
    /* Q4: int16 lanes of (nibble * x) pairs, |.| <= 7620; two vphaddw levels stay below 2^15. E2M1:
     * (w2 + 12) * x pairs per half, |.| <= 12288 (x >= -128); one vphaddw level (24576), then vpmaddwd
     * by 256 (high bytes) and 1 (low bytes), vpaddd, vphaddd */
    __m256i p[4];
    pair_sums(lo, hi, xg, p);
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i h;
    if (fmt == F_Q4) {
        h = _mm256_madd_epi16(_mm256_hadd_epi16(_mm256_hadd_epi16(p[0], p[1]), _mm256_hadd_epi16(p[2], p[3])), ones);
        h = _mm256_permutevar8x32_epi32(h, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    } else {
        __m256i pl[4];
        pair_sums(lo, hi, xl, pl);
        const __m256i s256 = _mm256_set1_epi16(256);
        const __m256i g01 = _mm256_add_epi32(_mm256_madd_epi16(_mm256_hadd_epi16(p[0], p[1]), s256),
                                             _mm256_madd_epi16(_mm256_hadd_epi16(pl[0], pl[1]), ones));
        const __m256i g23 = _mm256_add_epi32(_mm256_madd_epi16(_mm256_hadd_epi16(p[2], p[3]), s256),
                                             _mm256_madd_epi16(_mm256_hadd_epi16(pl[2], pl[3]), ones));
        h = _mm256_hadd_epi32(g01, g23);    /* blocks 0 2 4 6 | 1 3 5 7: its xd, int32 and scales follow */
    }
#endif
    return _mm256_add_epi32(h, _mm256_loadu_si256((const __m256i *)corr));
}

/* the scales wd of 8 blocks from p: fp16 (Q8 / Q4), or E8M0 bytes as 2^(e - 128) (e8m0_half: the
 * normal (e - 1) << 23; F_FP4X also the subnormals 2^-127 and 2^-128 for e = 1 and 0, NaN for 0xff) */
INLINE __m256 ld_wd(const uint8_t *p, int fmt) {
    if (fmt < F_FP4) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
    /* the 8 bytes zero-extended in the sums' block order, 0 2 4 6 1 3 5 7 */
    const __m256i e = _mm256_shuffle_epi8(_mm256_broadcastq_epi64(_mm_loadl_epi64((const __m128i *)p)),
                                          _mm256_setr_epi8(0, -1, -1, -1, 2, -1, -1, -1, 4, -1, -1, -1, 6, -1, -1, -1,
                                                           1, -1, -1, -1, 3, -1, -1, -1, 5, -1, -1, -1, 7, -1, -1, -1));
    const __m256i norm = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
    if (fmt == F_FP4) return _mm256_castsi256_ps(norm);       /* every e in [2, 254] */
    const __m256i sub = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);
    const __m256i v = _mm256_blendv_epi8(norm, sub, _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e));
    return _mm256_castsi256_ps(_mm256_or_si256(v, _mm256_cmpeq_epi32(e, _mm256_set1_epi32(255))));
}

/* 1 when every E8M0 byte of s[0..n) is in [2, 254] (F_FP4 then serves those rows) */
INLINE int e8m0_plain(const uint8_t *s, int64_t n) {
    __m256i bad = _mm256_setzero_si256();
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {         /* e - 2 (mod 256) > 252: e is 0, 1 or 255 */
        const __m256i t = _mm256_sub_epi8(_mm256_loadu_si256((const __m256i *)(s + i)), _mm256_set1_epi8(2));
        bad = _mm256_or_si256(bad, _mm256_cmpeq_epi8(_mm256_max_epu8(t, _mm256_set1_epi8((char)253)), t));
    }
    int ok = _mm256_testz_si256(bad, bad);
    for (; i < n; i++) ok &= (uint8_t)(s[i] - 2) <= 252;
    return ok;
}

/* y[t*ldy + i] = row r + i . token t, i < R, t < T (T <= 3); pf: software prefetch distance (0: none); l2 the
 * target (common.h cpumla_pf_l2_plain: L1 on AMD, the two-level one on Intel) */
INLINE void tile_run(const cpumla_weight *w, int64_t r, int R, const uint8_t *qx, int64_t per, int T, float *y,
                    int64_t ldy, int fmt, int64_t pf, int l2) {
    const int64_t K = w->cols, nb = K / QK, SB = fmt != F_Q8 ? 128 : 256;     /* weight bytes a step */
    const int64_t ss = fmt >= F_FP4 ? 1 : 2;                                   /* scale bytes a block */
    const uint8_t *rp[4];
    const uint8_t *sp[4];
    for (int i = 0; i < 4; i++) {
        rp[i] = weight_row(w, r + (i < R ? i : 0));
        sp[i] = q_scale_row(w, r + (i < R ? i : 0));
    }
    const uint8_t *xq[3];
    const float *xd[3];
    const int32_t *xs[3];
    const uint8_t *xl[3];
    __m256 acc[4][3];
    UNROLL for (int t = 0; t < 3; t++) {
        xq[t] = qx + (t < T ? t : 0) * per;
        xd[t] = qx_d(xq[t], K);
        xs[t] = qx_s(xq[t], K);
        xl[t] = (const uint8_t *)qx_lo(xq[t], K);
        UNROLL for (int i = 0; i < 4; i++) acc[i][t] = _mm256_setzero_ps();
    }
    int64_t b = 0;
    for (; b + 8 <= nb; b += 8) {
        for (int i = 0; i < R; i++) {
            if (pf) {
                for (int l = 0; l < SB; l += 64) GEMV_PF_LINE((const char *)rp[i] + (b / 8) * SB + pf + l, pf, l2);
                if ((b & 15) == 0) GEMV_PF((const char *)(sp[i] + ss * b) + pf * ss / (SB / 8), l2);
            }
            __m256i lo[4], hi[4];
            load_step(rp[i] + (b / 8) * SB, fmt, 8, lo, hi);
            const __m256 wd = ld_wd(sp[i] + ss * b, fmt);
            for (int t = 0; t < T; t++)
                acc[i][t] = step_acc(acc[i][t], step_sums(lo, hi, fmt, xq[t] + b * QK, xl[t] + b * QK, xs[t] + b), wd, xd[t] + b);
        }
    }
    if (b < nb) {
        const int64_t vb = nb - b;
        for (int i = 0; i < R; i++) {
            if (pf) {        /* the partial step's lines too, as int_avx512.h's */
                for (int64_t l = 0; l < vb * SB / 8; l += 64) GEMV_PF_LINE((const char *)rp[i] + (b / 8) * SB + pf + l, pf, l2);
                GEMV_PF((const char *)(sp[i] + ss * b) + pf * ss / (SB / 8), l2);
            }
            __m256i lo[4], hi[4];
            load_step(rp[i] + (b / 8) * SB, fmt, vb, lo, hi);
            uint8_t s8[16];      /* blocks past the row: a normal scale (their sums and xd are 0) */
            memset(s8, fmt >= F_FP4 ? 2 : 0, sizeof s8);
            memcpy(s8, sp[i] + ss * b, (size_t)(ss * vb));
            const __m256 wd = ld_wd(s8, fmt);
            for (int t = 0; t < T; t++)
                acc[i][t] = step_acc(acc[i][t], step_sums(lo, hi, fmt, xq[t] + b * QK, xl[t] + b * QK, xs[t] + b), wd, xd[t] + b);
        }
    }
    for (int t = 0; t < T; t++)
        for (int i = 0; i < R; i++) y[t * ldy + i] = hsum8(acc[i][t]);
}

#endif
