/* amx_gq.c: the amx level's gemm_gq, GGUF's block weights (gguf_q.h) on int8 tiles from a number of
 * tokens (AMX_GQ_MIN); fewer tokens go to the entry below (avx512vnni's).
 *
 * A panel of 16 weight rows is unpacked once (the K types by gqk_unpack's SIMD, the others by
 * gqi_unpack's, Q8_0 as stored) into int8 codes in column order, [16][K], and each chunk's s, m, d, dm
 * as vectors over the 16 rows. For each group of 16 tokens and each chunk of 32 columns, tdpbssd gives
 * the exact int32 sums of 16 rows x 16 tokens: one over the 32 columns where the panel's two halves
 * of every chunk share their scale and min, else one per half of 16; the next chunk's products run
 * while this one's are scaled (two sets of C tiles taking turns). Then every (row, token) adds the
 * spec's chunk product, in column order:
 *   p = (float)(s0 a0 + s1 a1) * (d * xd)  [- (float)(m0 x0 + m1 x1) * (dm * xd)]
 * each fp32 operation rounded once (this file is compiled without contraction). The integer sums
 * become fp32 exactly (gq_take says why): a product of two exact floats, or an FMA of one exact product
 * and another, rounds once, as (float) of the exact int32 does: the same bits without integer
 * multiplies. So every token's row is the scalar spec's, bit for bit, through gemv (decode) and gemm
 * (prefill) alike.
 * Operands:
 *   A (16 rows x 32 or 16 bytes) = the chunk (or half) of the unpacked panel, stride K;
 *   B (8 or 4 rows x 64 bytes)   = 16 tokens' codes of the chunk, dword n of row kk token n's columns
 *                                  4kk .. 4kk + 3 (VNNI order), gathered once per call; a half is
 *                                  rows 0-3 or 4-7 of the chunk's tile;
 *   C (16 rows x 16 tokens)      = int32 sums (two for the halves).
 * Tiles: gq_group's, in one of two configurations (gq_tilecfg). */
#include <immintrin.h>
#include <stdio.h>
#include <string.h>
#include "core/common.h"
#include "core/gguf_q.h"
#include "core/kernels.h"
#include "core/quant.h"
#include "kernels/x86/amx_common.h"
#include "kernels/x86/gqi_unpack_x86.h"
#include "kernels/x86/gqk_unpack_x86.h"

/* From how many tokens the tiles beat avx512vnni's entry: every type's panel unpacks with SIMD (gqk_unpack,
 * gqi_unpack, Q8_0's a copy), and from one group of 16 tokens the tiles are at least as fast for each
 * (benchmarks/gguf_gemv.py --tokens 16 --isa amx against --isa avx512vnni, a Xeon with AMX, 2 threads,
 * 2048 columns: Q4_0 even, IQ2_XXS 1.4x, Q8_0 2x). */
#define AMX_GQ_MIN 16

typedef void (*gq_gemm_fn)(const cpumla_weight *, const void *, int64_t, float *, int64_t, int64_t, int64_t);
static gq_gemm_fn prev_gq[GQ_N];


/* per chunk of the panel: the 16 rows' scales, mins and factors as fp32 (lane i: row i; the integer
 * scales and mins are small, so exact) */
typedef struct {
    float s0[16], s1[16], m0[16], m1[16];
    float d[16], dm[16];
} amx_gq_chunk;

/* what a panel's chunks need: halves (a chunk's halves differ in scale or min: two sums a chunk) and
 * unit (every scale is 1: the sum itself is the product's integer) */
enum { GQ_HALVES = 1, GQ_UNIT = 2 };

#define ROUNDED(v) __asm__("" : "+v"(v))

/* row i of a K-type panel (Q2_K .. Q6_K) by gqk_unpack (SIMD; the spec's values): codes q = u - off, and
 * each chunk's scales and mins from the gqk_u lanes (per-16 types: gqk_halves order) */
static void amx_gqk_row(int T, const uint8_t *row, int64_t K, int64_t i, int8_t *o, amx_gq_chunk *ch) {
    const int off = T == GQK_Q6 ? 32 : T == GQK_Q3 ? 4 : 0, per16 = T != GQK_Q4 && T != GQK_Q5;
    const int64_t bytes = gq_types[CPUMLA_Q2_K + T - CPUMLA_Q8_0].bytes;
    const __m256i vo = _mm256_set1_epi8((char)off);
    gqk_u u;
    int32_t s0[8], s1[8], m0[8], m1[8];
    for (int64_t j = 0; j < K / 256; j++) {
        gqk_unpack(T, row + j * bytes, &u);
        for (int c = 0; c < 8; c++)
            _mm256_storeu_si256((__m256i *)(o + 256 * j + 32 * c), _mm256_sub_epi8(u.q[c], vo));
        _mm256_storeu_si256((__m256i *)s0, u.s0);
        _mm256_storeu_si256((__m256i *)m0, u.m0);
        if (per16) {
            _mm256_storeu_si256((__m256i *)s1, u.s1);
            _mm256_storeu_si256((__m256i *)m1, u.m1);
        }
        for (int c = 0; c < 8; c++) {
            amx_gq_chunk *k = &ch[8 * j + c];
            if (per16) {            /* s0: half 0 of chunks 0-3 | half 1 of 0-3; s1: the same for 4-7 */
                const int32_t *a = c < 4 ? s0 : s1, *b = c < 4 ? m0 : m1;
                k->s0[i] = (float)a[c % 4]; k->s1[i] = (float)a[4 + c % 4];
                k->m0[i] = (float)b[c % 4]; k->m1[i] = (float)b[4 + c % 4];
            } else {
                k->s0[i] = k->s1[i] = (float)s0[c];
                k->m0[i] = k->m1[i] = (float)m0[c];
            }
            k->d[i] = u.d;
            k->dm[i] = u.dm;
        }
    }
}

/* row i of a panel of the other types by gqi_unpack's SIMD (the spec's values), 256 columns at a time:
 * each chunk's codes from its operand bytes (less the offset, or given their signs) and its scales,
 * mins and factors; Q8_0's codes and scales as stored. Returns 0 where gqi's unpackers do not apply
 * (a sign table other than ggml's: gqi_ksigns_ok), for gq_unpack to serve instead. */
static int amx_gqi_row(int32_t dtype, const uint8_t *row, int64_t K, int64_t i, int8_t *o, amx_gq_chunk *ch) {
    const int64_t nch = K / 32;
    if (dtype == CPUMLA_Q8_0) {
        for (int64_t c = 0; c < nch; c++) {
            const uint8_t *b = row + c * GQ8_0_BYTES;
            _mm256_storeu_si256((__m256i *)(o + 32 * c), _mm256_loadu_si256((const __m256i *)(b + 2)));
            amx_gq_chunk *k = &ch[c];
            k->s0[i] = k->s1[i] = 1.0f;
            k->d[i] = gqi_h16(b);
        }
        return 1;
    }
    if ((dtype == CPUMLA_IQ2_XXS || dtype == CPUMLA_IQ3_XXS) && !gqi_ksigns_ok()) return 0;
    gqi_ctx cx = {_mm256_setzero_si256(), _mm256_setzero_si256()};
    if (dtype == CPUMLA_IQ4_NL || dtype == CPUMLA_IQ4_XS) gqi_ctx_tab(&cx, gq_kvalues_iq4nl);
    if (dtype == CPUMLA_MXFP4) gqi_ctx_tab(&cx, gq_kvalues_mxfp4);
    /* gqi_x86.h's table of the types: offset, signs, mins, per-16 scales (u.s stays 1 where a type has none) */
    int off = 0, sg = GQI_SG_NONE, has_min = 0, halves = 0;
    for (int64_t g = 0; g * 8 < nch; g++) {
        const int nc = nch - 8 * g < 8 ? (int)(nch - 8 * g) : 8;
        gqi_grp u;
        u.s = u.s1 = _mm256_set1_epi32(1);     /* what the types without them read */
        u.dm = _mm256_setzero_ps();
        switch (dtype) {
        case CPUMLA_Q4_0: gqi_un_q4_0(row, g, nc, &u, &cx); off = 8; break;
        case CPUMLA_Q4_1: gqi_un_q4_1(row, g, nc, &u, &cx); has_min = 1; break;
        case CPUMLA_Q5_0: gqi_un_q5_0(row, g, nc, &u, &cx); off = 16; break;
        case CPUMLA_Q5_1: gqi_un_q5_1(row, g, nc, &u, &cx); has_min = 1; break;
        case CPUMLA_IQ4_NL: gqi_un_iq4_nl(row, g, nc, &u, &cx); off = GQI_TAB_OFF; sg = GQI_TAB_SG; break;
        case CPUMLA_MXFP4: gqi_un_mxfp4(row, g, nc, &u, &cx); off = GQI_TAB_OFF; sg = GQI_TAB_SG; break;
        case CPUMLA_IQ4_XS: gqi_un_iq4_xs(row, g, nc, &u, &cx); off = GQI_TAB_OFF; sg = GQI_TAB_SG; break;
        case CPUMLA_IQ2_XXS: gqi_un_iq2_xxs(row, g, nc, &u, &cx); sg = GQI_SG_MASK; break;
        case CPUMLA_IQ3_XXS: gqi_un_iq3_xxs(row, g, nc, &u, &cx); sg = GQI_SG_MASK; break;
        case CPUMLA_IQ1_S: gqi_un_iq1_s(row, g, nc, &u, &cx); off = 9; break;
        case CPUMLA_IQ1_M: gqi_un_iq1_m(row, g, nc, &u, &cx); sg = GQI_SG_VAL; halves = 1; break;
        default: return 0;
        }
        for (int c = 0; c < nc; c++) {
            __m256i q = u.w[c];
            if (sg == GQI_SG_MASK) q = gqi_neg(q, u.m[c]);
            else if (sg == GQI_SG_VAL) q = u.v[c];
            else q = _mm256_sub_epi8(q, _mm256_set1_epi8((char)off));
            _mm256_storeu_si256((__m256i *)(o + 256 * g + 32 * c), q);
        }
        int32_t s0[8], s1[8];
        float d[8], dm[8];
        _mm256_storeu_si256((__m256i *)s0, u.s);
        _mm256_storeu_si256((__m256i *)s1, halves ? u.s1 : u.s);
        _mm256_storeu_ps(d, u.d);
        _mm256_storeu_ps(dm, u.dm);
        for (int c = 0; c < nc; c++) {
            amx_gq_chunk *k = &ch[8 * g + c];
            k->s0[i] = (float)s0[c];
            k->s1[i] = (float)s1[c];
            k->m0[i] = k->m1[i] = (float)has_min;
            k->d[i] = d[c];
            k->dm[i] = dm[c];
        }
    }
    return 1;
}

/* rows [p0, p0 + mp) (missing rows zero) unpacked: codes [16][K], chunks [K / 32]; returns the panel's
 * GQ_HALVES / GQ_UNIT flags */
static int amx_gq_unpack(const cpumla_weight *w, int64_t p0, int64_t mp, int8_t *codes, amx_gq_chunk *ch) {
    const int64_t K = w->cols, nc = K / 32;
    int same = 1, unit = 1;
    gq_unpacked u;
    memset(ch, 0, sizeof *ch * (size_t)nc);
    const int T = w->dtype >= CPUMLA_Q2_K && w->dtype <= CPUMLA_Q6_K ? w->dtype - CPUMLA_Q2_K : -1;
    for (int64_t i = 0; i < 16; i++) {
        int8_t *o = codes + i * K;
        if (i >= mp) { memset(o, 0, (size_t)K); continue; }
        const uint8_t *row = (const uint8_t *)w->data + (p0 + i) * w->row_bytes;
        if (T >= 0) {
            amx_gqk_row(T, row, K, i, o, ch);
            if (T != GQK_Q4 && T != GQK_Q5) same = 0;
            unit = 0;
            continue;
        }
        if (amx_gqi_row(w->dtype, row, K, i, o, ch)) {
            for (int64_t c = 0; c < nc; c++) {
                const amx_gq_chunk *k = &ch[c];
                same &= k->s0[i] == k->s1[i] && k->m0[i] == k->m1[i];
                unit &= k->s0[i] == 1.0f && k->s1[i] == 1.0f;
            }
            continue;
        }
        for (int64_t c0 = 0; c0 < K; c0 += 256) {
            const int n = K - c0 >= 256 ? 8 : (int)((K - c0) / 32);
            gq_unpack(w->dtype, row, c0, n, &u);
            memcpy(o + c0, u.q, (size_t)(32 * n));
            for (int c = 0; c < n; c++) {
                amx_gq_chunk *k = &ch[c0 / 32 + c];
                k->s0[i] = (float)u.s[2 * c];
                k->s1[i] = (float)u.s[2 * c + 1];
                k->m0[i] = (float)u.m[2 * c];
                k->m1[i] = (float)u.m[2 * c + 1];
                k->d[i] = u.d[c];
                k->dm[i] = u.dm[c];
                same &= u.s[2 * c] == u.s[2 * c + 1] && u.m[2 * c] == u.m[2 * c + 1];
                unit &= u.s[2 * c] == 1 && u.s[2 * c + 1] == 1;
            }
        }
    }
    return (same ? 0 : GQ_HALVES) | (unit ? GQ_UNIT : 0);
}

/* B tiles, xd and the halves' code sums of every group of 16 tokens (zero past n):
 * bq[(g nc + c) 128 + kk 16 + t], xd[(g nc + c) 16 + t], x0 / x1 likewise as fp32 (exact: |sum| <= 2032),
 * each from its B tile's dwords (x0 NULL: no sums, for the types without mins) */
static void amx_gq_pack_x(const uint8_t *qx, int64_t n, int64_t K, int32_t *bq, float *xd, float *x0, float *x1) {
    const int64_t nc = K / 32, ng = (n + 15) / 16, per = QX_BYTES(K);
    const __m512i idx = lanes_times((int32_t)per), ones = _mm512_set1_epi8(1);
    for (int64_t g = 0; g < ng; g++) {
        const int64_t nt = n - 16 * g < 16 ? n - 16 * g : 16;
        const __mmask16 m = (__mmask16)((1u << nt) - 1u);
        const uint8_t *base = qx + 16 * g * per;
        for (int64_t c = 0; c < nc; c++) {
            int32_t *t = bq + (g * nc + c) * 128;
            __m512i h[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
            for (int kk = 0; kk < 8; kk++) {
                const __m512i v = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), m, idx, base + 32 * c + 4 * kk, 1);
                _mm512_store_si512(t + 16 * kk, v);
                h[kk / 4] = _mm512_dpbusd_epi32(h[kk / 4], ones, v);
            }
            _mm512_store_ps(xd + (g * nc + c) * 16, _mm512_mask_i32gather_ps(_mm512_setzero_ps(), m, idx,
                                                                             base + qx_kp(K) + 4 * c, 1));
            if (x0) {
                _mm512_store_ps(x0 + (g * nc + c) * 16, _mm512_cvtepi32_ps(h[0]));
                _mm512_store_ps(x1 + (g * nc + c) * 16, _mm512_cvtepi32_ps(h[1]));
            }
        }
    }
}

/* acc[i] (row i, a lane per token) += chunk k's product from its tile sums c0 (the chunk, or its first
 * half) and c1 (the second half), xv the tokens' xd, x0 / x1 their halves' code sums (fp32):
 *   a = (float)(s0 a0 + s1 a1): halves: s1 * a1 + (s0 * a0) by one FMA, s0 * a0 exact in fp32 (|s q x|
 *       over a half of 16 stays below 2^24 for every type: at most 128 * 32 * 127 * 16, Q6_K's), so the
 *       FMA rounds the exact sum once, as (float) of the int32 sum does; else s0 * (float)a0, one
 *       correctly rounded product of exact operands (and for unit scales, (float)a0 itself)
 *   p = a * (d * xd) - (float)(m0 x0 + m1 x1) * (dm * xd), the mins' sum formed the same way
 * each fp32 operation rounded once, as the spec rounds it */
static inline __attribute__((always_inline)) void gq_take(const int32_t *c0, const int32_t *c1, const amx_gq_chunk *k,
                                                          const float *xd, const float *x0, const float *x1, int flags,
                                                          int has_min, __m512 acc[16]) {
    const int halves = flags & GQ_HALVES, unit = flags & GQ_UNIT;
    const __m512 xv = _mm512_load_ps(xd);
    __m512 x0v = _mm512_setzero_ps(), x1v = x0v;
    if (has_min) {
        x0v = _mm512_load_ps(x0);
        x1v = _mm512_load_ps(x1);
        if (!halves) x0v = _mm512_add_ps(x0v, x1v);     /* exact */
    }
#pragma GCC unroll 16      /* acc stays in registers */
    for (int i = 0; i < 16; i++) {
        __m512 f = _mm512_mul_ps(_mm512_set1_ps(k->d[i]), xv);
        ROUNDED(f);
        __m512 a = _mm512_cvtepi32_ps(_mm512_load_si512(c0 + 16 * i));
        if (halves) {
            __m512 e = _mm512_mul_ps(_mm512_set1_ps(k->s0[i]), a);
            ROUNDED(e);
            a = _mm512_fmadd_ps(_mm512_set1_ps(k->s1[i]), _mm512_cvtepi32_ps(_mm512_load_si512(c1 + 16 * i)), e);
        } else if (!unit) {
            a = _mm512_mul_ps(_mm512_set1_ps(k->s0[i]), a);
        }
        ROUNDED(a);
        __m512 p = _mm512_mul_ps(a, f);
        ROUNDED(p);
        if (has_min) {
            __m512 fm = _mm512_mul_ps(_mm512_set1_ps(k->dm[i]), xv);
            ROUNDED(fm);
            __m512 ms = _mm512_mul_ps(_mm512_set1_ps(k->m0[i]), x0v);
            ROUNDED(ms);
            if (halves) ms = _mm512_fmadd_ps(_mm512_set1_ps(k->m1[i]), x1v, ms);
            ROUNDED(ms);
            __m512 pm = _mm512_mul_ps(ms, fm);
            ROUNDED(pm);
            p = _mm512_sub_ps(p, pm);
            ROUNDED(p);
        }
        acc[i] = _mm512_add_ps(acc[i], p);
    }
}

/* one group of 16 tokens against the panel, chunks in column order into acc. The chunks' tile products
 * take turns in two sets of C tiles, so the next chunk's tdpbssd runs while this one's sums are scaled.
 * Tiles (the panel's configuration, gemm_gq_amx): whole chunks C 0-1, A 2-3 (16 x 32 bytes), B 4-5
 * (8 x 64); halves C 0-1 and 2-3 (a pair a chunk), A 4-5 (16 x 16), B 6-7 (4 x 64). */
static inline __attribute__((always_inline)) void gq_group(const int8_t *codes, int64_t K, const amx_gq_chunk *ch,
                                                           const int32_t *bq, const float *xd, const float *x0,
                                                           const float *x1, int flags, int has_min, __m512 acc[16]) {
    const int64_t nc = K / 32;
    int32_t cb[4][256] __attribute__((aligned(64)));
#define GQ_AT(c) (c) * 16
#define GQ_TAKE(T0, T1, c)                                                                                         \
    do {                                                                                                           \
        _tile_stored(T0, cb[T0], 64);                                                                              \
        if (flags & GQ_HALVES) _tile_stored(T1, cb[T1], 64);                                                      \
        gq_take(cb[T0], cb[T1], &ch[c], xd + GQ_AT(c), x0 + GQ_AT(c), x1 + GQ_AT(c), flags, has_min, acc);        \
    } while (0)
    if (flags & GQ_HALVES) {
#define GQ_ISSUE_H(C0, C1, c)                                                                                      \
    do {                                                                                                           \
        _tile_loadd(4, codes + 32 * (c), K);                                                                       \
        _tile_loadd(6, bq + (c) * 128, 64);                                                                        \
        _tile_zero(C0);                                                                                            \
        _tile_dpbssd(C0, 4, 6);                                                                                    \
        _tile_loadd(5, codes + 32 * (c) + 16, K);                                                                  \
        _tile_loadd(7, bq + (c) * 128 + 64, 64);                                                                   \
        _tile_zero(C1);                                                                                            \
        _tile_dpbssd(C1, 5, 7);                                                                                    \
    } while (0)
        GQ_ISSUE_H(0, 1, 0);
        for (int64_t c = 0; c < nc; c += 2) {
            if (c + 1 < nc) GQ_ISSUE_H(2, 3, c + 1);
            GQ_TAKE(0, 1, c);
            if (c + 1 >= nc) break;
            if (c + 2 < nc) GQ_ISSUE_H(0, 1, c + 2);
            GQ_TAKE(2, 3, c + 1);
        }
#undef GQ_ISSUE_H
    } else {
#define GQ_ISSUE(C, A, B, c)                                                                                       \
    do {                                                                                                           \
        _tile_loadd(A, codes + 32 * (c), K);                                                                       \
        _tile_loadd(B, bq + (c) * 128, 64);                                                                        \
        _tile_zero(C);                                                                                             \
        _tile_dpbssd(C, A, B);                                                                                     \
    } while (0)
        GQ_ISSUE(0, 2, 4, 0);
        for (int64_t c = 0; c < nc; c += 2) {
            if (c + 1 < nc) GQ_ISSUE(1, 3, 5, c + 1);
            GQ_TAKE(0, 0, c);
            if (c + 1 >= nc) break;
            if (c + 2 < nc) GQ_ISSUE(0, 2, 4, c + 2);
            GQ_TAKE(1, 1, c + 1);
        }
#undef GQ_ISSUE
    }
#undef GQ_TAKE
#undef GQ_AT
}

/* the tile configurations of gq_group: whole chunks (0) and halves (1) */
static void gq_tilecfg(int halves) {
    amx_tilecfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int i = 0; i < (halves ? 4 : 2); i++) { cfg.rows[i] = 16; cfg.colsb[i] = 64; }     /* C */
    const int a = halves ? 4 : 2, b = halves ? 6 : 4;
    for (int i = 0; i < 2; i++) {
        cfg.rows[a + i] = 16; cfg.colsb[a + i] = halves ? 16 : 32;                       /* A */
        cfg.rows[b + i] = halves ? 4 : 8; cfg.colsb[b + i] = 64;                          /* B */
    }
    _tile_loadconfig(&cfg);
}

static void gemm_gq_amx(const cpumla_weight *w, const void *qx, int64_t n, float *y, int64_t ldy, int64_t r0,
                        int64_t r1) {
    const int t = w->dtype - CPUMLA_Q8_0;
    if (n < AMX_GQ_MIN) { prev_gq[t](w, qx, n, y, ldy, r0, r1); return; }
    const int has_min = gq_types[t].has_min;
    const int64_t K = w->cols, nc = K / 32, ng = (n + 15) / 16;
    uint8_t *xs = cpumla_scratch(CPUMLA_SCRATCH_AMX_QX, (size_t)(ng * nc * (512 + 3 * 64)));
    uint8_t *ps = cpumla_scratch(CPUMLA_SCRATCH_AMX_PANEL, (size_t)(16 * K) + sizeof(amx_gq_chunk) * (size_t)nc + 64);
    if (!xs || !ps) return;
    int32_t *bq = (int32_t *)xs;
    float *x0 = (float *)(xs + ng * nc * 512), *x1 = x0 + ng * nc * 16, *xdb = x1 + ng * nc * 16;
    amx_gq_chunk *ch = (amx_gq_chunk *)ps;
    int8_t *codes = (int8_t *)(ps + sizeof(amx_gq_chunk) * (size_t)nc);
    amx_gq_pack_x(qx, n, K, bq, xdb, has_min ? x0 : NULL, x1);

    float fb[256] __attribute__((aligned(64)));
    int cfg = -1;
    for (int64_t p0 = r0; p0 < r1; p0 += 16) {
        const int64_t mp = r1 - p0 < 16 ? r1 - p0 : 16;
        const int flags = amx_gq_unpack(w, p0, mp, codes, ch);
        if ((flags & GQ_HALVES) != cfg) gq_tilecfg(cfg = flags & GQ_HALVES);
        for (int64_t g = 0; g < ng; g++) {
            __m512 acc[16];
            for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
            const int32_t *bg = bq + g * nc * 128;
            const float *xg = xdb + g * nc * 16, *x0g = x0 + g * nc * 16, *x1g = x1 + g * nc * 16;
            /* each flag set its own loop (the flags are constants in each call) */
            if (has_min) {
                if (flags & GQ_HALVES) gq_group(codes, K, ch, bg, xg, x0g, x1g, GQ_HALVES, 1, acc);
                else gq_group(codes, K, ch, bg, xg, x0g, x1g, 0, 1, acc);
            } else if (flags & GQ_HALVES) gq_group(codes, K, ch, bg, xg, x0g, x1g, GQ_HALVES, 0, acc);
            else if (flags & GQ_UNIT) gq_group(codes, K, ch, bg, xg, x0g, x1g, GQ_UNIT, 0, acc);
            else gq_group(codes, K, ch, bg, xg, x0g, x1g, 0, 0, acc);
            /* acc[i]: row p0 + i, a lane per token -> y */
            for (int i = 0; i < 16; i++) _mm512_store_ps(fb + 16 * i, acc[i]);
            amx_store_block(fb, y + 16 * g * ldy + (p0 - r0), ldy, n - 16 * g < 16 ? n - 16 * g : 16, mp);
        }
    }
    _tile_release();
}

void cpumla_fill_amx_gq(cpumla_kernels *k) {
    static char who[GQ_N][96];
    for (int t = 0; t < GQ_N; t++) {
        if (k->gemm_gq[t] != gemm_gq_amx) prev_gq[t] = k->gemm_gq[t];
        k->gemm_gq[t] = gemm_gq_amx;
        const int f = CPUMLA_Q8_0 + t;
        snprintf(who[t], sizeof who[t], "amx (%s below %d tokens)", k->who_fmt[K_GEMM][f], AMX_GQ_MIN);
        k->who_fmt[K_GEMM][f] = who[t];
    }
}
