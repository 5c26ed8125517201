/* int_avx512.h: the integer products' tile (Q8 / Q4 / E2M1, quant.h) in 512-bit vectors and their
 * activation quantization (quant_x), compiled by avx512vnni_q.c (the avx512vnni level: vpdpbusd) and,
 * with AVX512_NO_VNNI defined, by avx512f_fp4.c (the avx512f level: E2M1 only, vpmaddubsw + vpmaddwd).
 * Semantics: scalar_q.c (kernels.h), to the rounding: each block's integer sum is exact,
 * (float)isum * (wd * xd) is rounded as the spec rounds it, and only the fp32 sums over blocks are
 * associated differently.
 *
 * vpdpbusd multiplies unsigned by signed bytes, 4 per int32 lane: Q8 weights go in as w + 128
 * (w ^ 0x80), Q4 as the nibbles themselves, E2M1 as w2 + 12 (one vpshufb per 64 nibbles); quant_x
 * stores per block -128 (Q8), -8 (Q4) or -12 (E2M1) times the activation block's code sum, the
 * correction that makes the block's sum exact. E2M1's int16 activation codes come as two int8 halves
 * (quant.h): the same weights go through vpdpbusd against the high bytes, the lanes are shifted left
 * by 8, and the low bytes' products added (4 vpdpbusd and one shift per 64 weight bytes).
 * A step is 16 blocks of a row: Q4's 4 lines give the blocks' columns 0-15 (AND) and 16-31 (shift),
 * E2M1's their even and odd columns (quant.h: its activations are laid out to match);
 * Q8's 8 lines are regrouped into the same halves with vpermt2q. Against the activations laid out to
 * match (quant.h), two vpdpbusd per 4 blocks leave each block's sum in 4 lanes of one vector; two
 * levels of in-lane unpack + add reduce the 4 vectors to one lane per block, and one vpermd puts the
 * blocks in order. The fp32 work (the correction, the conversion, wd * xd, the product, the sum) is
 * then one instruction per 16 blocks, on the scales and activation arrays as stored.
 *
 * The includer defines QDRIVER_GEMM and QDRIVER_PF_L2 and includes kernels/generic/quant_driver.h
 * after this: gemv (one token) runs one row at a time, the rows of a range one sequential stream with
 * a software prefetch a fixed distance ahead of it (the hardware prefetchers stop at page boundaries);
 * gemm runs tiles of up to 4 rows x 2 tokens sharing each unpacked weight. The last step of a row is
 * masked (weights and scales past the row read as zero; the activation buffer is zero-padded to whole
 * steps). */
#ifndef CPUMLA_INT_AVX512_H
#define CPUMLA_INT_AVX512_H
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include "core/common.h"
#include "core/kernels.h"
#include "core/quant.h"
#include "kernels/x86/avx512_common.h"

#ifdef AVX512_NO_VNNI
/* avx512f_fp4.c: the avx512f level (no VNNI) builds this for E2M1 only, with vpmaddubsw for
 * vpdpbusd: exact while no vpmaddubsw pair sum saturates, which holds for E2M1's operands (w2 + 12 <= 24
 * against bytes >= -128: 24 * 128 * 2 = 6144, two such added in int16 12288) but not Q8's (w + 128 up
 * to 255): Q8 / Q4 stay avx2's. vpmaddwd by 256 (the high bytes) and by 1 (the low) widens to int32. */
#define NO_VNNI 1
#else
#define NO_VNNI 0
#endif

/* the spec rounds each product: keep the compiler from fusing it into the add that follows */
#define ROUNDED(v) __asm__("" : "+v"(v))
#ifndef QPF_BYTES
#define QPF_BYTES 8192     /* gemv: software prefetch distance along the row stream */
#endif

static void quant_x_avx512(int32_t wdtype, const float *x, int64_t K, void *qx) {
    int8_t *q = qx, *ql = qx_lo(qx, K);
    float *d = qx_d(qx, K);
    int32_t *s = qx_s(qx, K);
    const int64_t nb = K / QK, kp = qx_kp(K);
    const int fp4 = wdtype == CPUMLA_E2M1, q4 = wdtype == CPUMLA_Q4 || fp4;
    const __m512i ev = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i od = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    memset(q + K, 0, (size_t)(kp - K));
    if (fp4) memset(ql + K, 0, (size_t)(kp - K));
    for (int64_t b = nb; b < kp / QK; b++) { d[b] = 0.0f; s[b] = 0; }
    for (int64_t b = 0; b < nb; b++) {
        __m512 v0 = _mm512_loadu_ps(x + b * QK), v1 = _mm512_loadu_ps(x + b * QK + 16);
        const float amax = amax32_avx512(v0, v1);
        const float qmax = qact_max(wdtype), id = qact_id(amax, qmax);
        d[b] = qact_xd(amax, qmax);
        if (q_nonfinite(amax)) v0 = v1 = _mm512_setzero_ps();      /* codes 0 */
        __m512i i0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, _mm512_set1_ps(id)));    /* nearest even */
        __m512i i1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, _mm512_set1_ps(id)));
        s[b] = (fp4 ? -12 : q4 ? -8 : -128) * _mm512_reduce_add_epi32(_mm512_add_epi32(i0, i1));
        const int64_t at = (b / 4) * 128 + (b % 4) * 16;
        if (fp4) {            /* [even columns | odd columns]: the low and high nibbles' order */
            const __m512i e = _mm512_permutex2var_epi32(i0, ev, i1);
            i1 = _mm512_permutex2var_epi32(i0, od, i1);
            i0 = e;
            /* q = 256 * hi + lo: lo the sign-extended low byte (quant.h's q_lo, q_hi) */
            const __m512i l0 = _mm512_srai_epi32(_mm512_slli_epi32(i0, 24), 24);
            const __m512i l1 = _mm512_srai_epi32(_mm512_slli_epi32(i1, 24), 24);
            _mm_storeu_si128((__m128i *)(ql + at), _mm512_cvtepi32_epi8(l0));
            _mm_storeu_si128((__m128i *)(ql + at + 64), _mm512_cvtepi32_epi8(l1));
            i0 = _mm512_srai_epi32(_mm512_sub_epi32(i0, l0), 8);
            i1 = _mm512_srai_epi32(_mm512_sub_epi32(i1, l1), 8);
        }
        _mm_storeu_si128((__m128i *)(q + at), _mm512_cvtepi32_epi8(i0));
        _mm_storeu_si128((__m128i *)(q + at + 64), _mm512_cvtepi32_epi8(i1));
    }
}

INLINE __mmask64 bytes_mask(int64_t n) { return n >= 64 ? ~(__mmask64)0 : n <= 0 ? 0 : (((__mmask64)1 << n) - 1); }

/* the weight format a tile is specialised for: F_FP4X is E2M1 with scale bytes 0, 1 or 0xff somewhere
 * in the tile's rows (their full conversion), F_FP4 with none */
enum { F_Q8, F_Q4, F_FP4, F_FP4X };

/* the unsigned operands of one step of a row: lo[v] / hi[v] = columns 0-15 / 16-31 (E2M1: the even /
 * odd columns, as w2 + 12) of blocks 4v..4v+3 of the step; vb < 16: a masked last step of vb blocks */
INLINE void load_step(const uint8_t *p, int fmt, int64_t vb, __m512i lo[4], __m512i hi[4]) {
    const int full = vb >= 16;
    if (fmt != F_Q8) {
        const __m512i m4 = _mm512_set1_epi8(15);
        UNROLL for (int v = 0; v < 4; v++) {
            const __m512i wv = full ? _mm512_loadu_si512(p + 64 * v)
                                    : _mm512_maskz_loadu_epi8(bytes_mask(vb * 16 - 64 * v), p + 64 * v);
            lo[v] = _mm512_and_si512(wv, m4);
            hi[v] = _mm512_and_si512(_mm512_srli_epi16(wv, 4), m4);
            if (fmt >= F_FP4) {
                const __m512i u = _mm512_broadcast_i32x4(_mm_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0));
                lo[v] = _mm512_shuffle_epi8(u, lo[v]);
                hi[v] = _mm512_shuffle_epi8(u, hi[v]);
            }
        }
        return;
    }
    const __m512i lo_half = _mm512_setr_epi64(0, 1, 4, 5, 8, 9, 12, 13);
    const __m512i hi_half = _mm512_setr_epi64(2, 3, 6, 7, 10, 11, 14, 15), x80 = _mm512_set1_epi8((char)0x80);
    UNROLL for (int v = 0; v < 4; v++) {
        __m512i A, B;
        if (full) {
            A = _mm512_loadu_si512(p + 128 * v);
            B = _mm512_loadu_si512(p + 128 * v + 64);
        } else {
            A = _mm512_maskz_loadu_epi8(bytes_mask(vb * 32 - 128 * v), p + 128 * v);
            B = _mm512_maskz_loadu_epi8(bytes_mask(vb * 32 - 128 * v - 64), p + 128 * v + 64);
        }
        lo[v] = _mm512_xor_si512(_mm512_permutex2var_epi64(A, lo_half, B), x80);
        hi[v] = _mm512_xor_si512(_mm512_permutex2var_epi64(A, hi_half, B), x80);
    }
}

/* one vector of 4 blocks' sums (lanes 4k..4k+3: block k), u0 / u1 against the codes at x / x + 64 */
INLINE __m512i dot4(const __m512i u0, const __m512i u1, const uint8_t *x) {
#if NO_VNNI
    return _mm512_madd_epi16(_mm512_add_epi16(_mm512_maddubs_epi16(u0, _mm512_loadu_si512(x)),
                                              _mm512_maddubs_epi16(u1, _mm512_loadu_si512(x + 64))),
                             _mm512_set1_epi16(1));
#else
    const __m512i a = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u0, _mm512_loadu_si512(x));
    return _mm512_dpbusd_epi32(a, u1, _mm512_loadu_si512(x + 64));
#endif
}

/* the same for E2M1's int16 codes: 256 times the sums against the high bytes xh plus those against the
 * low bytes xl */
INLINE __m512i dot4_16(const __m512i u0, const __m512i u1, const uint8_t *xh, const uint8_t *xl) {
#if NO_VNNI
    const __m512i h = _mm512_add_epi16(_mm512_maddubs_epi16(u0, _mm512_loadu_si512(xh)),
                                       _mm512_maddubs_epi16(u1, _mm512_loadu_si512(xh + 64)));
    const __m512i l = _mm512_add_epi16(_mm512_maddubs_epi16(u0, _mm512_loadu_si512(xl)),
                                       _mm512_maddubs_epi16(u1, _mm512_loadu_si512(xl + 64)));
    return _mm512_add_epi32(_mm512_madd_epi16(h, _mm512_set1_epi16(256)), _mm512_madd_epi16(l, _mm512_set1_epi16(1)));
#else
    __m512i a = _mm512_slli_epi32(dot4(u0, u1, xh), 8);
    a = _mm512_dpbusd_epi32(a, u0, _mm512_loadu_si512(xl));
    return _mm512_dpbusd_epi32(a, u1, _mm512_loadu_si512(xl + 64));
#endif
}

/* the 16 exact block sums of a step, in block order: xg = the step's 512 activation codes (E2M1: their
 * high bytes, the low at xl) */
INLINE __m512i step_sums(const __m512i lo[4], const __m512i hi[4], int fmt, const uint8_t *xg, const uint8_t *xl,
                         const int32_t *corr) {
    __m512i a[4];
    UNROLL for (int v = 0; v < 4; v++)
        a[v] = fmt >= F_FP4 ? dot4_16(lo[v], hi[v], xg + 128 * v, xl + 128 * v) : dot4(lo[v], hi[v], xg + 128 * v);
    /* a[v]: block 4v + k in lanes 4k..4k+3. Level 1: lanes of (a0, a1) and (a2, a3) pairwise; level
     * 2: 128-bit lane k = blocks k, 4 + k, 8 + k, 12 + k */
    const __m512i s01 = _mm512_add_epi32(_mm512_unpacklo_epi32(a[0], a[1]), _mm512_unpackhi_epi32(a[0], a[1]));
    const __m512i s23 = _mm512_add_epi32(_mm512_unpacklo_epi32(a[2], a[3]), _mm512_unpackhi_epi32(a[2], a[3]));
    const __m512i s = _mm512_add_epi32(_mm512_unpacklo_epi64(s01, s23), _mm512_unpackhi_epi64(s01, s23));
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    return _mm512_add_epi32(_mm512_permutexvar_epi32(order, s), _mm512_loadu_si512(corr));
}

/* acc += (float)isum * (wd * xd), each product rounded (kernels.h) */
INLINE __m512 step_acc(__m512 acc, __m512i isum, __m512 wd, const float *xd) {
    __m512 f = _mm512_mul_ps(wd, _mm512_loadu_ps(xd));
    ROUNDED(f);
    __m512 p = _mm512_mul_ps(_mm512_cvtepi32_ps(isum), f);
    ROUNDED(p);
    return _mm512_add_ps(acc, p);
}

/* the scales wd of the m-masked blocks of 16 from p (the rest 0): fp16 (Q8 / Q4), or E8M0 bytes as
 * 2^(e - 128) (e8m0_half: the normal (e - 1) << 23; F_FP4X also the subnormals 2^-127 and 2^-128
 * for e = 1 and 0, NaN for 0xff) */
INLINE __m512 ld_wd(const uint8_t *p, int fmt, __mmask16 m) {
    if (fmt < F_FP4) return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p));
    /* blocks past the row (m's zeros): e = 2, a normal scale (their sums and xd are 0) */
    const __m512i e = _mm512_cvtepu8_epi32(_mm_mask_loadu_epi8(_mm_set1_epi8(2), m, p));
    __m512i v = _mm512_slli_epi32(_mm512_sub_epi32(e, _mm512_set1_epi32(1)), 23);
    if (fmt == F_FP4) return _mm512_castsi512_ps(v);          /* every e in [2, 254] */
    v = _mm512_mask_sllv_epi32(v, _mm512_cmplt_epu32_mask(e, _mm512_set1_epi32(2)), _mm512_set1_epi32(0x00200000), e);
    v = _mm512_mask_mov_epi32(v, _mm512_cmpeq_epi32_mask(e, _mm512_set1_epi32(255)), _mm512_set1_epi32(0x7fc00000));
    return _mm512_castsi512_ps(v);
}

/* 1 when every E8M0 byte of s[0..n) is in [2, 254] (F_FP4 then serves those rows) */
INLINE int e8m0_plain(const uint8_t *s, int64_t n) {
    __mmask64 bad = 0;
    for (int64_t i = 0; i < n; i += 64) {   /* e - 2 (mod 256) > 252: e is 0, 1 or 255 */
        const __m512i e = _mm512_maskz_loadu_epi8(bytes_mask(n - i), s + i);
        bad |= _mm512_mask_cmpgt_epu8_mask(bytes_mask(n - i), _mm512_sub_epi8(e, _mm512_set1_epi8(2)),
                                           _mm512_set1_epi8((char)252));
    }
    return !bad;
}

/* The scale line's prefetch: with the L1 target as the stream's, else into L1 (prefetcht0: a scale
 * line serves 32 or 64 blocks and is read soon) */
INLINE void pf_scale(const char *sl, int l2) {
    if (!l2) _mm_prefetch(sl, GEMV_PF_HINT);
    else _mm_prefetch(sl, _MM_HINT_T0);
}

/* y[t*ldy + i] = row r + i . token t, i < R, t < T; pf: prefetch distance in bytes (0: none), a
 * whole step's lines prefetched after its products (the partial last step's before its loads); l2:
 * the target (common.h cpumla_pf_l2) */
INLINE void tile_run(const cpumla_weight *w, int64_t r, int R, const uint8_t *qx, int64_t per, int T, float *y,
                 int64_t ldy, int fmt, int64_t pf, int l2) {
    const int64_t K = w->cols, nb = K / QK, SB = fmt != F_Q8 ? 256 : 512;     /* weight bytes a step */
    const int64_t ss = fmt >= F_FP4 ? 1 : 2;                                   /* scale bytes a block */
    const uint8_t *rp[4];
    const uint8_t *sp[4];
    UNROLL for (int i = 0; i < 4; i++) {
        rp[i] = weight_row(w, r + (i < R ? i : 0));
        sp[i] = q_scale_row(w, r + (i < R ? i : 0));
    }
    const uint8_t *xq[2] = {qx, qx + (T > 1 ? per : 0)};
    const float *xd[2] = {qx_d(xq[0], K), qx_d(xq[1], K)};
    const int32_t *xs[2] = {qx_s(xq[0], K), qx_s(xq[1], K)};
    const uint8_t *xl[2] = {(const uint8_t *)qx_lo(xq[0], K), (const uint8_t *)qx_lo(xq[1], K)};
    __m512 acc[4][2];
    UNROLL for (int i = 0; i < 4; i++) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
    int64_t b = 0;
    for (; b + 16 <= nb; b += 16) {
        UNROLL for (int i = 0; i < R; i++) {
            const char *ahead = (const char *)rp[i] + (b / 16) * SB + pf;
            /* the scale line first; the step's lines after its products (below) */
            if (pf) pf_scale((const char *)(sp[i] + ss * b) + pf * ss / (SB / 16), l2);
            __m512i lo[4], hi[4];
            load_step(rp[i] + (b / 16) * SB, fmt, 16, lo, hi);
            const __m512 wd = ld_wd(sp[i] + ss * b, fmt, 0xffff);
            UNROLL for (int t = 0; t < T; t++)
                acc[i][t] = step_acc(acc[i][t], step_sums(lo, hi, fmt, xq[t] + b * QK, xl[t] + b * QK, xs[t] + b), wd, xd[t] + b);
            /* the step's lines issued after its products rather than before its loads: Q8's 8 prefetches
             * a step then do not delay the step's own loads */
            if (pf) UNROLL for (int l = 0; l < SB; l += 64) GEMV_PF_LINE(ahead + l, pf, l2);
        }
    }
    if (b < nb) {
        const int64_t vb = nb - b;
        UNROLL for (int i = 0; i < R; i++) {
            if (pf) {        /* the partial step's lines too: rows whose width is not whole steps would
                              * otherwise stream a part of each row unprefetched */
                const char *ahead = (const char *)rp[i] + (b / 16) * SB + pf;
                for (int64_t l = 0; l < vb * SB / 16; l += 64) GEMV_PF_LINE(ahead + l, pf, l2);
                pf_scale((const char *)(sp[i] + ss * b) + pf * ss / (SB / 16), l2);
            }
            __m512i lo[4], hi[4];
            load_step(rp[i] + (b / 16) * SB, fmt, vb, lo, hi);
            const __m512 wd = ld_wd(sp[i] + ss * b, fmt, (__mmask16)((1u << vb) - 1u));
            UNROLL for (int t = 0; t < T; t++)
                acc[i][t] = step_acc(acc[i][t], step_sums(lo, hi, fmt, xq[t] + b * QK, xl[t] + b * QK, xs[t] + b), wd, xd[t] + b);
        }
    }
    UNROLL for (int t = 0; t < T; t++)
        UNROLL for (int i = 0; i < R; i++) y[t * ldy + i] = _mm512_reduce_add_ps(acc[i][t]);
}

#endif
