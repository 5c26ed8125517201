/* avx2_gqp.c: the avx2 level's gemm_gq from a number of tokens (GQ2_MIN), every GGUF type: panels of 16
 * weight rows unpacked once (gq_panel_unpack_x86.h) against the tokens' codes gathered once per call in
 * groups of 8. Fewer tokens go to the per-type entries (avx2_gq.c, avx2_gqk.c, avx2_gqi.c), which stay
 * the gemv. avxvnni keeps it. cpumla's own Q8 / Q4 take the same panels from GQ2_MIN tokens
 * (cpumla_gemm_qp_avx2, called by avx2_q.c's gemm: their products are Q8_0's and Q4_0's, with
 * quant_x_avx2's activations, the blocks' terms added as the level's gemv adds them: gq2_own_sums).
 *
 * Per (row, chunk), the 8 tokens' sums in one ymm, a token a dword: each dword of 4 codes of the row is
 * broadcast against the tokens' dwords of the same 4 columns (vpmaddubsw: 16 int16 pairs), so no sum is
 * ever reduced across lanes. vpmaddubsw multiplies an unsigned operand by a signed one and saturates its
 * pairs, so the codes are stored u = q + b, b the type's lowest code negated (gq2_of: 0 for the types
 * whose codes are unsigned), and the bias's share b (s0 x0 + s1 x1), from the tokens' half sums, is taken
 * out once a chunk; Q8_0 and the IQ4 types (|q| up to 128) keep q and give the tokens' codes its signs
 * (|q| * (x sign q)). Where u is small, the pairs of several steps are added as int16 (acc: at most
 * 2 * u_max * 127 a step, below 2^15 in all) before one vpmaddwd by the half's integer scale turns them
 * into int32. Every sum is exact, the spec's isum and msum; then each (row, token) adds the chunk's
 * product in column order, each fp32 operation the spec's (this file is compiled without contraction):
 * every result is the scalar spec's, bit for bit. */
#include <immintrin.h>
#include <string.h>
#include "core/common.h"
#include "core/gguf_q.h"
#include "core/kernels.h"
#include "core/quant.h"
#include "kernels/x86/gqi_unpack_x86.h"
#include "kernels/x86/gqk_unpack_x86.h"
#include "kernels/x86/gq_panel_unpack_x86.h"

#define GQ2_MIN 8                /* tokens from which the panels serve */

/* per type: b, the bias of its stored codes (-1: the sign path), and n, the steps of 4 columns whose
 * vpmaddubsw pairs add up in int16 (n * 2 * u_max * 127 < 2^15, u_max the largest stored code; 1, 2 or 4,
 * or 8 for the 4-bit types scaled per 32). The codebook types size b by the tables loaded (gguf_q.h): the gguf
 * package's give IQ2_XXS 43, IQ3_XXS 62, MXFP4 12. */
typedef struct { int8_t b, n; } gq2_type;
static gq2_type gq2_table(int32_t amax) {     /* codes in [-amax, amax]: u_max = 2 amax */
    if (amax > 64) return (gq2_type){-1, 1};
    const int32_t pair = 2 * (2 * amax) * 127;
    const int8_t n = pair * 4 < 32768 ? 4 : pair * 2 < 32768 ? 2 : 1;
    return (gq2_type){(int8_t)amax, n};
}
/* the types of fixed codes: X(type, b, n, per-16 scales, unit scales, mins), read by gq2_of and, as
 * literals that specialise each loop, by gq2_rows */
#define GQ2_FIXED(X)                                                            \
    X(CPUMLA_Q4_0, 8, 8, 0, 1, 0)       /* q in [-8, 7] */                      \
    X(CPUMLA_Q4_1, 0, 8, 0, 1, 1)       /* [0, 15] */                           \
    X(CPUMLA_Q5_0, 16, 4, 0, 1, 0)      /* [-16, 15] */                         \
    X(CPUMLA_Q5_1, 0, 4, 0, 1, 1)       /* [0, 31] */                           \
    X(CPUMLA_Q2_K, 0, 4, 1, 0, 1)       /* [0, 3] */                            \
    X(CPUMLA_Q3_K, 4, 4, 1, 0, 0)       /* [-4, 3] */                           \
    X(CPUMLA_Q4_K, 0, 8, 0, 0, 1)       /* [0, 15] */                           \
    X(CPUMLA_Q5_K, 0, 4, 0, 0, 1)       /* [0, 31] */                           \
    X(CPUMLA_Q6_K, 32, 2, 1, 0, 0)      /* [-32, 31] */                         \
    X(CPUMLA_IQ1_S, 9, 4, 0, 0, 0)      /* [-9, 9]: the grid is -1, 0, 1 */     \
    X(CPUMLA_IQ1_M, 9, 4, 1, 0, 0)                                              \
    X(CPUMLA_Q4, 8, 8, 0, 1, 0)         /* cpumla's Q4: nibble - 8 */
static gq2_type gq2_of(int32_t dtype) {
    switch (dtype) {
#define GQ2_OF(t, b, n, h, u, m) case t: return (gq2_type){b, n};
    GQ2_FIXED(GQ2_OF)
#undef GQ2_OF
    case CPUMLA_IQ2_XXS: return gq2_table(gq_iq2xxs_max);
    case CPUMLA_IQ3_XXS: return gq2_table(gq_iq3xxs_max);
    case CPUMLA_MXFP4: return gq2_table(gq_mxfp4_max);
    default: return (gq2_type){-1, 1};                 /* Q8_0, IQ4_NL, IQ4_XS: |q| up to 128 */
    }
}

typedef void (*gq_gemm_fn)(const cpumla_weight *, const void *, int64_t, float *, int64_t, int64_t, int64_t);
static gq_gemm_fn prev_gq2[GQ_N];

/* the tokens' operands of every group of 8 (zero past n): bx[((g nc + c) 8 + kk) 8 + t], dword kk of
 * token t's chunk c; xp[(g nc + c) 8 + t] its halves' code sums as a pair (x0 | x1 << 16: |x_h| <= 2032);
 * xd likewise. qx: gq_quant_x's rows, or quant_x_avx2's (the same codes; q4: in its Q4 order) */
static void gq2_pack_x(const uint8_t *qx, int64_t n, int64_t K, int q4, int32_t *bx, int32_t *xp, float *xd) {
    const int64_t nc = K / 32, ng = (n + 7) / 8, per = QX_BYTES(K);
    const __m256i one8 = _mm256_set1_epi8(1), one16 = _mm256_set1_epi16(1);
    for (int64_t g = 0; g < ng; g++) {
        const int64_t nt = n - 8 * g < 8 ? n - 8 * g : 8;
        const uint8_t *base = qx + 8 * g * per;
        for (int64_t c = 0; c < nc; c++) {
            __m256i v[8];
            for (int t = 0; t < 8; t++) {
                /* cpumla's Q4 (avx2_q.c's order): block c's first 16 codes at 64 (c / 2) + 16 (c % 2), its
                 * last 16 32 bytes on */
                const uint8_t *p = base + t * per + (q4 ? 64 * (c / 2) + 16 * (c % 2) : 32 * c);
                v[t] = t >= nt ? _mm256_setzero_si256()
                       : q4    ? _mm256_loadu2_m128i((const __m128i *)(p + 32), (const __m128i *)p)
                               : _mm256_loadu_si256((const __m256i *)p);
            }
            /* 8 x 8 dwords transposed: w[kk] lane t = v[t] dword kk */
            const __m256i a0 = _mm256_unpacklo_epi32(v[0], v[1]), a1 = _mm256_unpackhi_epi32(v[0], v[1]);
            const __m256i a2 = _mm256_unpacklo_epi32(v[2], v[3]), a3 = _mm256_unpackhi_epi32(v[2], v[3]);
            const __m256i a4 = _mm256_unpacklo_epi32(v[4], v[5]), a5 = _mm256_unpackhi_epi32(v[4], v[5]);
            const __m256i a6 = _mm256_unpacklo_epi32(v[6], v[7]), a7 = _mm256_unpackhi_epi32(v[6], v[7]);
            const __m256i b0 = _mm256_unpacklo_epi64(a0, a2), b1 = _mm256_unpackhi_epi64(a0, a2);
            const __m256i b2 = _mm256_unpacklo_epi64(a1, a3), b3 = _mm256_unpackhi_epi64(a1, a3);
            const __m256i b4 = _mm256_unpacklo_epi64(a4, a6), b5 = _mm256_unpackhi_epi64(a4, a6);
            const __m256i b6 = _mm256_unpacklo_epi64(a5, a7), b7 = _mm256_unpackhi_epi64(a5, a7);
            const __m256i w[8] = {_mm256_permute2x128_si256(b0, b4, 0x20), _mm256_permute2x128_si256(b1, b5, 0x20),
                                  _mm256_permute2x128_si256(b2, b6, 0x20), _mm256_permute2x128_si256(b3, b7, 0x20),
                                  _mm256_permute2x128_si256(b0, b4, 0x31), _mm256_permute2x128_si256(b1, b5, 0x31),
                                  _mm256_permute2x128_si256(b2, b6, 0x31), _mm256_permute2x128_si256(b3, b7, 0x31)};
            int32_t *o = bx + (g * nc + c) * 64;
            __m256i h[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
            for (int kk = 0; kk < 8; kk++) {
                _mm256_storeu_si256((__m256i *)(o + 8 * kk), w[kk]);
                h[kk / 4] = _mm256_add_epi32(h[kk / 4], _mm256_madd_epi16(_mm256_maddubs_epi16(one8, w[kk]), one16));
            }
            _mm256_storeu_si256((__m256i *)(xp + (g * nc + c) * 8), gqp_pair(h[0], h[1]));
            for (int t = 0; t < 8; t++) xd[(g * nc + c) * 8 + t] = t < nt ? qx_d(base + t * per, K)[c] : 0.0f;
        }
    }
}

/* rows i0 .. i0 + R - 1 of the panel against G groups of 8 tokens, chunks in column order into sum[i][g]
 * (a lane per token); bx / xp / xd: the first group's (gq2_pack_x), the next 8 nc ints / floats further on
 * (bx: 64 nc); na: gq2_type's n */
static inline __attribute__((always_inline)) void gq2_tile(const uint8_t *codes, int64_t K, const gqp_rows *rw,
                                                           int i0, const int32_t *bx, const int32_t *xp,
                                                           const float *xd, int R, int G, int wide, int biased,
                                                           int na, int halves, int unit, int has_min,
                                                           __m256 sum[4][2], __m256 (*part)[2][8]) {
    const int64_t nc = K / 32, gs = 8 * nc;
    const __m256i one16 = _mm256_set1_epi16(1);
    for (int64_t c = 0; c < nc; c++) {
        const int64_t o = i0 * rw->ld + c;            /* row i0's chunk c; row i0 + i: + i ld */
        const uint8_t *cc = codes + i0 * K + 32 * c;
        __m256i acc[4][2], a16[4][2], sv[4];
        for (int i = 0; i < R; i++) acc[i][0] = acc[i][1] = a16[i][0] = a16[i][1] = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int kk = 0; kk < 8; kk++) {
            if (kk % 4 == 0)
                for (int i = 0; i < R; i++)
                    sv[i] = unit ? one16 : _mm256_set1_epi32((kk && halves ? rw->s1 : rw->s0)[o + i * rw->ld]);
            __m256i xv[2];
            for (int g = 0; g < G; g++) xv[g] = _mm256_loadu_si256((const __m256i *)(bx + 8 * g * gs + (c * 8 + kk) * 8));
            for (int i = 0; i < R; i++) {
                int32_t u;
                memcpy(&u, cc + i * K + 4 * kk, 4);
                const __m256i wb = _mm256_set1_epi32(u), ab = wide ? _mm256_abs_epi8(wb) : wb;
                for (int g = 0; g < G; g++) {
                    const __m256i p = _mm256_maddubs_epi16(ab, wide ? _mm256_sign_epi8(xv[g], wb) : xv[g]);
                    a16[i][g] = kk % na ? _mm256_add_epi16(a16[i][g], p) : p;
                    /* one chain of adds per sum, int16 and int32: a tree of them (the compiler's
                     * reassociation, which held Q8_0's products for a tree at the chunk's end) spills */
                    __asm__("" : "+x"(a16[i][g]));
                    if (kk % na == na - 1) {
                        acc[i][g] = _mm256_add_epi32(acc[i][g], _mm256_madd_epi16(a16[i][g], sv[i]));
                        __asm__("" : "+x"(acc[i][g]));
                    }
                }
            }
        }
        for (int g = 0; g < G; g++) {
            const __m256i xpv = _mm256_loadu_si256((const __m256i *)(xp + g * gs + 8 * c));
            const __m256 xdv = _mm256_loadu_ps(xd + g * gs + 8 * c);
            for (int i = 0; i < R; i++) {
                __m256i isum = acc[i][g];
                if (biased) isum = _mm256_sub_epi32(isum, _mm256_madd_epi16(_mm256_set1_epi32(rw->sb[o + i * rw->ld]), xpv));
                __m256 p = _mm256_mul_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(_mm256_set1_ps(rw->d[o + i * rw->ld]), xdv));
                if (has_min) {
                    const __m256i msum = _mm256_madd_epi16(_mm256_set1_epi32(rw->m[o + i * rw->ld]), xpv);
                    p = _mm256_sub_ps(p, _mm256_mul_ps(_mm256_cvtepi32_ps(msum),
                                                       _mm256_mul_ps(_mm256_set1_ps(rw->dm[o + i * rw->ld]), xdv)));
                }
                if (part) part[i][g][c & 7] = _mm256_add_ps(part[i][g][c & 7], p);
                else sum[i][g] = _mm256_add_ps(sum[i][g], p);
            }
        }
    }
}

/* the panel's rows i0 .. for G groups, each class of type its own loop (constants in each call), returning
 * how many rows it took: 4 rows x 2 groups where a sum is one register (n 8: the pairs add up as int16
 * over a whole chunk; n 1: each step's pairs go straight to int32), else 2 x 2 (two a sum, the int16 one
 * and the int32 one: 4 x 2 spilled); 4 x 1 where one group is left. flags are
 * gqp_unpack's (the generic unpacker's, for IQ2_XXS / IQ3_XXS under another sign table) */
#define GQ2_T(w, b, n, h, u, m, own)                                                                 \
    do {                                                                                              \
        __m256 (*pt)[2][8] = own ? part : NULL;                                                       \
        if (G == 1) gq2_tile(codes, K, rw, i0, bx, xp, xd, 4, 1, w, b, n, h, u, m, sum, pt);         \
        else if (n == 8 || n == 1) gq2_tile(codes, K, rw, i0, bx, xp, xd, 4, 2, w, b, n, h, u, m, sum, pt); \
        else gq2_tile(codes, K, rw, i0, bx, xp, xd, 2, 2, w, b, n, h, u, m, sum, pt);                \
        return G == 1 || n == 8 || n == 1 ? 4 : 2;                                                    \
    } while (0)
static int gq2_rows(int32_t dtype, gq2_type ty, const uint8_t *codes, int64_t K, const gqp_rows *rw, int i0,
                     const int32_t *bx, const int32_t *xp, const float *xd, int G, int flags, __m256 sum[4][2],
                     __m256 part[4][2][8]) {
    const int halves = flags & GQP_HALVES, unit = flags & GQP_UNIT;
    switch (dtype) {
#define GQ2_ROWS(t, b, n, h, u, m) case t: GQ2_T(0, b > 0, n, h, u, m, t == CPUMLA_Q4);
    GQ2_FIXED(GQ2_ROWS)
#undef GQ2_ROWS
    case CPUMLA_Q8: GQ2_T(1, 0, 1, 0, 1, 0, 1);
    default: break;
    }
    /* Q8_0, the IQ4 types, and the codebook types by their tables: no mins */
    if (ty.b < 0) {
        if (halves) GQ2_T(1, 0, 1, 1, 0, 0, 0);
        else if (unit) GQ2_T(1, 0, 1, 0, 1, 0, 0);
        else GQ2_T(1, 0, 1, 0, 0, 0, 0);
    } else if (halves) {
        GQ2_T(0, 1, 1, 1, 0, 0, 0);
    } else if (unit) {                     /* MXFP4 */
        if (ty.n == 4) GQ2_T(0, 1, 4, 0, 1, 0, 0);
        else if (ty.n == 2) GQ2_T(0, 1, 2, 0, 1, 0, 0);
        else GQ2_T(0, 1, 1, 0, 1, 0, 0);
    } else {                               /* IQ2_XXS, IQ3_XXS */
        if (ty.n == 4) GQ2_T(0, 1, 4, 0, 0, 0, 0);
        else if (ty.n == 2) GQ2_T(0, 1, 2, 0, 0, 0, 0);
        else GQ2_T(0, 1, 1, 0, 0, 0, 0);
    }
}
#undef GQ2_T

/* rows [p0, p0 + mp) of cpumla's Q8 / Q4 (quant.h: codes in rows, fp16 scales in their own grid) as a
 * panel, as gqp_unpack does the GGUF types': Q8's codes as stored, Q4's nibbles (q + 8, its bias) */
static int gq2_unpack_own(const cpumla_weight *w, int64_t p0, int64_t mp, uint8_t *codes, const gqp_rows *rw) {
    const int64_t K = w->cols, nc = K / 32;
    for (int64_t i = 0; i < 16; i++) {
        uint8_t *o = codes + i * K;
        if (i >= mp) {
            gqp_blank_row((int8_t *)o, K, rw->bias, rw, i);
            continue;
        }
        const uint8_t *row = (const uint8_t *)w->data + (p0 + i) * w->row_bytes;
        const uint16_t *sc = (const uint16_t *)w->scale + (p0 + i) * w->scale_ld;
        for (int64_t c = 0; c < nc; c++) {
            if (w->dtype == CPUMLA_Q4) _mm256_storeu_si256((__m256i *)(o + 32 * c), gqi_nib(row + 16 * c));
            else memcpy(o + 32 * c, row + 32 * c, 32);
            gqp_rows_put1(rw, i, c, 1, 1, 0, 0, _cvtsh_ss(sc[c]), 0.0f);
        }
    }
    return GQP_UNIT;
}

/* cpumla's Q8 / Q4 on the avx2 level add their blocks as its gemv does (int_avx2.h's tile_run: block b
 * into lane b % 8 of a vector, the last step of fewer than 8 blocks adding +0 to the other lanes, then
 * hsum8), so that a token's row of the gemm is the gemv's, bit for bit: part[i][g][j] is lane j's sum of
 * (row i, group g), each token a lane; into sum the same tree as hsum8 */
static void gq2_own_sums(__m256 part[4][2][8], int64_t nb, __m256 sum[4][2]) {
    for (int i = 0; i < 4; i++)
        for (int g = 0; g < 2; g++) {
            __m256 *v = part[i][g];
            if (nb % 8)
                for (int64_t j = nb % 8; j < 8; j++) v[j] = _mm256_add_ps(v[j], _mm256_setzero_ps());
            const __m256 s0 = _mm256_add_ps(_mm256_add_ps(v[0], v[4]), _mm256_add_ps(v[2], v[6]));
            const __m256 s1 = _mm256_add_ps(_mm256_add_ps(v[1], v[5]), _mm256_add_ps(v[3], v[7]));
            sum[i][g] = _mm256_add_ps(s0, s1);
        }
}

/* rows [r0, r1) by n >= GQ2_MIN tokens: a GGUF type with gq_quant_x's activations, or cpumla's Q8 / Q4
 * (own) with quant_x_avx2's */
static void gq2_gemm(const cpumla_weight *w, const void *qx, int64_t n, float *y, int64_t ldy, int64_t r0, int64_t r1) {
    const int own = w->dtype == CPUMLA_Q8 || w->dtype == CPUMLA_Q4;
    const gq2_type ty = gq2_of(w->dtype);
    const int64_t K = w->cols, nc = K / 32, ng = (n + 7) / 8;
    uint8_t *xs = cpumla_scratch(CPUMLA_SCRATCH_GQP_QX, (size_t)(ng * nc * (256 + 2 * 32)));
    const int64_t ld = nc + 8;
    uint8_t *ps = cpumla_scratch(CPUMLA_SCRATCH_GQP_PANEL, (size_t)(16 * K) + 6 * 16 * sizeof(int32_t) * (size_t)ld);
    if (!xs || !ps) return;
    int32_t *bx = (int32_t *)xs, *xp = bx + ng * nc * 64;
    float *xd = (float *)(xp + ng * nc * 8);
    int32_t *f = (int32_t *)ps;
    const gqp_rows rw = {ld, f, f + 16 * ld, f + 32 * ld, f + 48 * ld, (float *)(f + 64 * ld), (float *)(f + 80 * ld),
                         ty.b > 0 ? ty.b : 0};
    uint8_t *codes = (uint8_t *)(f + 96 * ld);
    gq2_pack_x(qx, n, K, w->dtype == CPUMLA_Q4, bx, xp, xd);

    float fb[8];
    for (int64_t p0 = r0; p0 < r1; p0 += 16) {
        const int64_t mp = r1 - p0 < 16 ? r1 - p0 : 16;
        const int flags = own ? gq2_unpack_own(w, p0, mp, codes, &rw)
                              : gqp_unpack(w, p0, mp, (int8_t *)codes, NULL, rw.bias, &rw);
        for (int64_t g = 0; g < ng;) {
            const int G = g + 1 < ng ? 2 : 1;
            for (int i0 = 0, R; i0 < mp; i0 += R) {
                __m256 sum[4][2], part[4][2][8];
                for (int i = 0; i < 4; i++) sum[i][0] = sum[i][1] = _mm256_setzero_ps();
                if (own)
                    for (int i = 0; i < 4; i++)
                        for (int j = 0; j < 8; j++) part[i][0][j] = part[i][1][j] = _mm256_setzero_ps();
                R = gq2_rows(w->dtype, ty, codes, K, &rw, i0, bx + g * nc * 64, xp + g * nc * 8, xd + g * nc * 8, G, flags,
                             sum, part);
                if (own) gq2_own_sums(part, nc, sum);
                const int nr = mp - i0 < R ? (int)(mp - i0) : R;
                for (int gg = 0; gg < G; gg++) {
                    const int64_t t0 = 8 * (g + gg), nt = n - t0 < 8 ? n - t0 : 8;
                    for (int i = 0; i < nr; i++) {
                        _mm256_storeu_ps(fb, sum[i][gg]);
                        for (int64_t tt = 0; tt < nt; tt++) y[(t0 + tt) * ldy + (p0 - r0) + i0 + i] = fb[tt];
                    }
                }
            }
            g += G;
        }
    }
}

static void gemm_gqp_avx2(const cpumla_weight *w, const void *qx, int64_t n, float *y, int64_t ldy, int64_t r0,
                          int64_t r1) {
    if (n < GQ2_MIN) prev_gq2[w->dtype - CPUMLA_Q8_0](w, qx, n, y, ldy, r0, r1);
    else gq2_gemm(w, qx, n, y, ldy, r0, r1);
}

int cpumla_gemm_qp_avx2(const cpumla_weight *w, const void *qx, int64_t n, float *y, int64_t ldy, int64_t r0,
                        int64_t r1) {
    if (n < GQ2_MIN || (w->dtype != CPUMLA_Q8 && w->dtype != CPUMLA_Q4)) return 0;
    gq2_gemm(w, qx, n, y, ldy, r0, r1);
    return 1;
}

/* the level's gemm_gq of every type (its owner stays "avx2", the level's name) */
void cpumla_fill_avx2_gqp(cpumla_kernels *k) {
    for (int t = 0; t < GQ_N; t++) {
        if (k->gemm_gq[t] != gemm_gqp_avx2) prev_gq2[t] = k->gemm_gq[t];
        k->gemm_gq[t] = gemm_gqp_avx2;
    }
}
