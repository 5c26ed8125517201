/* avx2_q.c: the integer kernels (Q8 / Q4 / E2M1) with AVX2 (compiled as avx2.c is). Semantics:
 * scalar_q.c (kernels.h), to the rounding: exact block sums, (float)isum * (wd * xd) rounded as the spec
 * rounds it, only the fp32 sums over blocks associated differently. Q8 (activations in column order):
 * |w| (vpsignb w, w) times x with w's sign (vpsignb x, w) in vpmaddubsw (pair sums fit int16), vpmaddwd
 * by ones, then vphaddd reduces 8 blocks to one lane each. Q4 (activations in pairs of blocks, quant.h):
 * the nibbles are vpmaddubsw's unsigned operand as they are, two vphaddw levels stay below 2^15, and
 * the per-block correction (-8 times the activation code sum) makes the sums exact. E2M1 is Q4 with
 * even / odd columns for Q4's first / last 16 (quant.h) and a vpshufb table from each nibble to
 * w2 + 12 (0..24) against its int16 activation codes' two int8 halves (quant.h): per half one vphaddw
 * level stays below 2^15, vpmaddwd by 256 (high bytes) or 1 (low bytes) widens, vpaddd and vphaddd do
 * the rest, and the correction is -12 times the code sum; the E8M0 scales become 2^(e - 128) with
 * integer operations.
 * The fp32 work runs once per 8 blocks. gemv reads the rows in order, one at a time (one stream,
 * prefetched ahead); gemm runs tiles of up to 4 rows x 2 tokens sharing each unpacked block.
 * avxvnni_q.c compiles this file again with AVX-VNNI (__AVXVNNI__): there vpdpbusd (4 u8 x s8 products
 * into each int32 lane, accumulating) replaces vpmaddubsw, vphaddw and vpmaddwd in the block sums, with
 * the same inputs and the same exact sums: Q8 takes w + 128 (its sign bit flipped) as the unsigned
 * operand and subtracts 128 times the code sum, E2M1 shifts the high bytes' sums left by 8 before the
 * low bytes' products add in. Only that file's gemm_q is used: quant_x, gemv_t and quantize_row are
 * compiled here alone. */
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

#if !defined(__AVXVNNI__)     /* avx2's alone (the header) */
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

#endif

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

/* y[t*ldy + i] = row r + i . token t, i < R, t < T; pf: software prefetch distance (0: none); l2 the
 * target (common.h cpumla_pf_l2_plain: L1 on AMD, as measured on Zen 4 and Zen 5; the two-level one
 * on Intel) */
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
    const uint8_t *xq[2] = {qx, qx + (T > 1 ? per : 0)};
    const float *xd[2] = {qx_d(xq[0], K), qx_d(xq[1], K)};
    const int32_t *xs[2] = {qx_s(xq[0], K), qx_s(xq[1], K)};
    const uint8_t *xl[2] = {(const uint8_t *)qx_lo(xq[0], K), (const uint8_t *)qx_lo(xq[1], K)};
    __m256 acc[4][2];
    for (int i = 0; i < 4; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
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
            if (pf) {        /* the partial step's lines too (avx512_q.c) */
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

#if defined(__AVXVNNI__)
#define QDRIVER_GEMM gemm_q_avxvnni
#else
#define QDRIVER_GEMM gemm_q_avx2
#endif
#define QDRIVER_PF_L2 cpumla_pf_l2_plain
#include "kernels/generic/quant_driver.h"

#if defined(__AVXVNNI__)
void cpumla_fill_avxvnni_q(cpumla_kernels *k) {
    k->gemm_q = gemm_q_avxvnni;
    k->gemm_fp4 = NULL;           /* these tiles are as fast as avx2_gemm.c's FMA form at any token count (quant.h) */
    k->gemm_fp4_min_n = 0;
    for (int f = CPUMLA_Q8; f <= CPUMLA_Q4; f++) k->who_fmt[K_GEMV][f] = k->who_fmt[K_GEMM][f] = "avxvnni";
    k->who_fmt[K_GEMV][CPUMLA_E2M1] = k->who_fmt[K_GEMM][CPUMLA_E2M1] = E2M1_WHO("avxvnni");
}
#else

/* y[c - c0] += (x[i] * wd) * wq, rows in order, four at a time: each 8 columns of y are loaded and
 * stored once for four rows, whose FMAs run in row order (as one row at a time adds them), and the
 * scales of 8 blocks are widened by one vcvtph2ps (exact, as f16_to_f32). Four rows read a block at a
 * time are not a stream the hardware prefetchers follow, so the first rows and then the rows
 * QT_PF_ROWS ahead are prefetched (without it q8 ran 1.5x slower than one row at a time). From memory
 * this takes 0.7x the time of one row at a time with y loaded and stored for every row
 * (docs/benchmarks.md). */
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
        __m256 mx = _mm256_max_ps(_mm256_max_ps(a[0], a[1]), _mm256_max_ps(a[2], a[3]));
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        const float amax = _mm_cvtss_f32(m4);
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
#endif
