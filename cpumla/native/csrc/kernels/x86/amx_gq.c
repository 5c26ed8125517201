/* amx_gq.c: the amx level's gemm_gq, GGUF's block weights (gguf_q.h) on int8 tiles from a number of
 * tokens per type (amx_gq_min); fewer tokens go to the entry below (avx512vnni's).
 *
 * A panel of 16 weight rows is unpacked once (the K types by gqk_unpack's SIMD, the others by the
 * spec's own gq_unpack) into int8 codes in column order, [16][K], and each chunk's s, m, d, dm as
 * vectors over the 16 rows. For each group of 16 tokens and each chunk of 32 columns, tdpbssd gives
 * the exact int32 sums of 16 rows x 16 tokens: one over the 32 columns where the panel's two halves
 * of every chunk share their scale and min, else one per half of 16. Then every (row, token) adds the spec's chunk product, in column order:
 *   p = (float)(s0 a0 + s1 a1) * (d * xd)  [- (float)(m0 x0 + m1 x1) * (dm * xd)]
 * each fp32 operation rounded once (this file is compiled without contraction). Where s0 = s1 the
 * integer s * (a0 + a1) is exact in int32, and (float)s * (float)(a0 + a1), one correctly rounded
 * product of two exact floats, is its (float): the same bits without the integer multiply. So every
 * token's row is the scalar spec's, bit for bit, through gemv (decode) and gemm (prefill) alike.
 * Operands:
 *   A (16 rows x 32 or 16 bytes) = the chunk (or half) of the unpacked panel, stride K;
 *   B (8 or 4 rows x 64 bytes)   = 16 tokens' codes of the chunk, dword n of row kk token n's columns
 *                                  4kk .. 4kk + 3 (VNNI order), gathered once per call; a half is
 *                                  rows 0-3 or 4-7 of the chunk's tile;
 *   C (16 rows x 16 tokens)      = int32 sums (two for the halves).
 * Tiles: 0-1 C, 2-3 A, 4-5 B. */
#include <immintrin.h>
#include <stdio.h>
#include <string.h>
#include "core/common.h"
#include "core/gguf_q.h"
#include "core/kernels.h"
#include "core/quant.h"
#include "kernels/x86/amx_common.h"
#include "kernels/x86/gqk_unpack_x86.h"

/* From how many tokens the tiles beat avx512vnni's entry, per type (Q8_0 .. MXFP4). The K types' panels
 * unpack with SIMD (gqk_unpack) and Q8_0's is a copy: they win from 16. The others unpack with the
 * spec's gq_unpack (one call per row and 256 columns), which costs as much as the products of tens of
 * tokens. Measured with benchmarks/gguf_gemv.py on a Xeon with AMX (2 threads, 2048 columns): each
 * type's crossing, rounded up. */
static const int16_t amx_gq_min[] = {
    16,                         /* Q8_0 */
    64, 64, 64, 64,             /* Q4_0, Q4_1, Q5_0, Q5_1 */
    16, 16, 16, 16, 16,         /* Q2_K, Q3_K, Q4_K, Q5_K, Q6_K */
    64, 96, 48, 64,             /* IQ4_NL, IQ4_XS, IQ2_XXS, IQ3_XXS */
    48, 48, 64,                 /* IQ1_S, IQ1_M, MXFP4 */
};

typedef void (*gq_gemm_fn)(const cpumla_weight *, const void *, int64_t, float *, int64_t, int64_t, int64_t);
static gq_gemm_fn prev_gq[GQ_N];
_Static_assert(sizeof amx_gq_min / sizeof amx_gq_min[0] == GQ_N, "a threshold per GGUF type");


/* per chunk of the panel: the 16 rows' scales, mins and factors (lane i: row i) */
typedef struct {
    int32_t s0[16], s1[16], m0[16], m1[16];
    float d[16], dm[16], sf[16];         /* sf: (float)s0, for chunks whose halves agree */
} amx_gq_chunk;

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
                k->s0[i] = a[c % 4]; k->s1[i] = a[4 + c % 4];
                k->m0[i] = b[c % 4]; k->m1[i] = b[4 + c % 4];
            } else {
                k->s0[i] = k->s1[i] = s0[c];
                k->m0[i] = k->m1[i] = m0[c];
            }
            k->d[i] = u.d;
            k->dm[i] = u.dm;
            k->sf[i] = (float)k->s0[i];
        }
    }
}

/* rows [p0, p0 + mp) (missing rows zero) unpacked: codes [16][K], chunks [K / 32]; returns whether
 * every chunk's halves share their scale and min */
static int amx_gq_unpack(const cpumla_weight *w, int64_t p0, int64_t mp, int8_t *codes, amx_gq_chunk *ch) {
    const int64_t K = w->cols, nc = K / 32;
    int same = 1;
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
            continue;
        }
        for (int64_t c0 = 0; c0 < K; c0 += 256) {
            const int n = K - c0 >= 256 ? 8 : (int)((K - c0) / 32);
            gq_unpack(w->dtype, row, c0, n, &u);
            memcpy(o + c0, u.q, (size_t)(32 * n));
            for (int c = 0; c < n; c++) {
                amx_gq_chunk *k = &ch[c0 / 32 + c];
                k->s0[i] = u.s[2 * c];
                k->s1[i] = u.s[2 * c + 1];
                k->m0[i] = u.m[2 * c];
                k->m1[i] = u.m[2 * c + 1];
                k->d[i] = u.d[c];
                k->dm[i] = u.dm[c];
                k->sf[i] = (float)u.s[2 * c];
                same &= k->s0[i] == k->s1[i] && k->m0[i] == k->m1[i];
            }
        }
    }
    return same;
}

/* B tiles, xd and the halves' code sums of every group of 16 tokens (zero past n):
 * bq[(g nc + c) 128 + kk 16 + t], xd[(g nc + c) 16 + t], xs0 / xs1 likewise (xs0 NULL: no sums, for
 * the types without mins) */
static void amx_gq_pack_x(const uint8_t *qx, int64_t n, int64_t K, int32_t *bq, float *xd, int32_t *xs0, int32_t *xs1) {
    const int64_t nc = K / 32, ng = (n + 15) / 16, per = QX_BYTES(K);
    const __m512i idx = lanes_times((int32_t)per);
    for (int64_t g = 0; g < ng; g++) {
        const int64_t nt = n - 16 * g < 16 ? n - 16 * g : 16;
        const __mmask16 m = (__mmask16)((1u << nt) - 1u);
        const uint8_t *base = qx + 16 * g * per;
        for (int64_t c = 0; c < nc; c++) {
            int32_t *t = bq + (g * nc + c) * 128;
            for (int kk = 0; kk < 8; kk++)
                _mm512_store_si512(t + 16 * kk, _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), m, idx,
                                                                            base + 32 * c + 4 * kk, 1));
            _mm512_store_ps(xd + (g * nc + c) * 16, _mm512_mask_i32gather_ps(_mm512_setzero_ps(), m, idx,
                                                                             base + qx_kp(K) + 4 * c, 1));
            for (int64_t j = 0; xs0 && j < 16; j++) {
                int32_t a = 0, b = 0;
                if (j < nt) {
                    const int8_t *x = (const int8_t *)(base + j * per) + 32 * c;
                    for (int i = 0; i < 16; i++) { a += x[i]; b += x[16 + i]; }
                }
                xs0[(g * nc + c) * 16 + j] = a;
                xs1[(g * nc + c) * 16 + j] = b;
            }
        }
    }
}

static void gemm_gq_amx(const cpumla_weight *w, const void *qx, int64_t n, float *y, int64_t ldy, int64_t r0,
                        int64_t r1) {
    const int t = w->dtype - CPUMLA_Q8_0;
    if (n < amx_gq_min[t]) { prev_gq[t](w, qx, n, y, ldy, r0, r1); return; }
    const int has_min = gq_types[t].has_min;
    const int64_t K = w->cols, nc = K / 32, ng = (n + 15) / 16;
    uint8_t *xs = cpumla_scratch(CPUMLA_SCRATCH_AMX_QX, (size_t)(ng * nc * (512 + 3 * 64)));
    uint8_t *ps = cpumla_scratch(CPUMLA_SCRATCH_AMX_PANEL, (size_t)(16 * K) + sizeof(amx_gq_chunk) * (size_t)nc + 64);
    if (!xs || !ps) return;
    int32_t *bq = (int32_t *)xs, *xs0 = (int32_t *)(xs + ng * nc * 512), *xs1 = xs0 + ng * nc * 16;
    float *xdb = (float *)(xs1 + ng * nc * 16);
    amx_gq_chunk *ch = (amx_gq_chunk *)ps;
    int8_t *codes = (int8_t *)(ps + sizeof(amx_gq_chunk) * (size_t)nc);
    amx_gq_pack_x(qx, n, K, bq, xdb, has_min ? xs0 : NULL, xs1);

    amx_tilecfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    cfg.rows[0] = cfg.rows[1] = 16; cfg.colsb[0] = cfg.colsb[1] = 64;      /* C */
    cfg.rows[2] = 16; cfg.colsb[2] = 32;                                  /* A: a whole chunk */
    cfg.rows[3] = 16; cfg.colsb[3] = 16;                                  /* A: a half */
    cfg.rows[4] = 8; cfg.colsb[4] = 64;                                   /* B: a whole chunk */
    cfg.rows[5] = 4; cfg.colsb[5] = 64;                                   /* B: a half */
    _tile_loadconfig(&cfg);

    int32_t c0b[256] __attribute__((aligned(64))), c1b[256] __attribute__((aligned(64)));
    float fb[256] __attribute__((aligned(64)));
    for (int64_t p0 = r0; p0 < r1; p0 += 16) {
        const int64_t mp = r1 - p0 < 16 ? r1 - p0 : 16;
        const int same = amx_gq_unpack(w, p0, mp, codes, ch);
        for (int64_t g = 0; g < ng; g++) {
            __m512 acc[16];
            for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
            for (int64_t c = 0; c < nc; c++) {
                const int32_t *bt = bq + (g * nc + c) * 128;
                const amx_gq_chunk *k = &ch[c];
                const __m512 xv = _mm512_load_ps(xdb + (g * nc + c) * 16);
                if (same) {
                    _tile_loadd(2, codes + 32 * c, K);
                    _tile_loadd(4, bt, 64);
                    _tile_zero(0);
                    _tile_dpbssd(0, 2, 4);
                    _tile_stored(0, c0b, 64);
                    const __m512i xsum = has_min ? _mm512_add_epi32(_mm512_load_si512(xs0 + (g * nc + c) * 16),
                                                                    _mm512_load_si512(xs1 + (g * nc + c) * 16))
                                                 : _mm512_setzero_si512();
                    for (int i = 0; i < 16; i++) {
                        __m512 f = _mm512_mul_ps(_mm512_set1_ps(k->d[i]), xv);
                        ROUNDED(f);
                        __m512 is = _mm512_mul_ps(_mm512_set1_ps(k->sf[i]), _mm512_cvtepi32_ps(_mm512_load_si512(c0b + 16 * i)));
                        ROUNDED(is);
                        __m512 p = _mm512_mul_ps(is, f);
                        ROUNDED(p);
                        if (has_min) {
                            __m512 fm = _mm512_mul_ps(_mm512_set1_ps(k->dm[i]), xv);
                            ROUNDED(fm);
                            __m512 pm = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_mullo_epi32(_mm512_set1_epi32(k->m0[i]), xsum)), fm);
                            ROUNDED(pm);
                            p = _mm512_sub_ps(p, pm);
                            ROUNDED(p);
                        }
                        acc[i] = _mm512_add_ps(acc[i], p);
                    }
                } else {
                    _tile_loadd(3, codes + 32 * c, K);
                    _tile_loadd(5, bt, 64);
                    _tile_zero(0);
                    _tile_dpbssd(0, 3, 5);
                    _tile_loadd(3, codes + 32 * c + 16, K);
                    _tile_loadd(5, bt + 64, 64);
                    _tile_zero(1);
                    _tile_dpbssd(1, 3, 5);
                    _tile_stored(0, c0b, 64);
                    _tile_stored(1, c1b, 64);
                    const __m512i x0 = has_min ? _mm512_load_si512(xs0 + (g * nc + c) * 16) : _mm512_setzero_si512();
                    const __m512i x1 = has_min ? _mm512_load_si512(xs1 + (g * nc + c) * 16) : _mm512_setzero_si512();
                    for (int i = 0; i < 16; i++) {
                        __m512 f = _mm512_mul_ps(_mm512_set1_ps(k->d[i]), xv);
                        ROUNDED(f);
                        const __m512i is = _mm512_add_epi32(
                            _mm512_mullo_epi32(_mm512_set1_epi32(k->s0[i]), _mm512_load_si512(c0b + 16 * i)),
                            _mm512_mullo_epi32(_mm512_set1_epi32(k->s1[i]), _mm512_load_si512(c1b + 16 * i)));
                        __m512 p = _mm512_mul_ps(_mm512_cvtepi32_ps(is), f);
                        ROUNDED(p);
                        if (has_min) {
                            __m512 fm = _mm512_mul_ps(_mm512_set1_ps(k->dm[i]), xv);
                            ROUNDED(fm);
                            const __m512i ms = _mm512_add_epi32(_mm512_mullo_epi32(_mm512_set1_epi32(k->m0[i]), x0),
                                                                _mm512_mullo_epi32(_mm512_set1_epi32(k->m1[i]), x1));
                            __m512 pm = _mm512_mul_ps(_mm512_cvtepi32_ps(ms), fm);
                            ROUNDED(pm);
                            p = _mm512_sub_ps(p, pm);
                            ROUNDED(p);
                        }
                        acc[i] = _mm512_add_ps(acc[i], p);
                    }
                }
            }
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
        snprintf(who[t], sizeof who[t], "amx (%s below %d tokens)", k->who_fmt[K_GEMM][f], amx_gq_min[t]);
        k->who_fmt[K_GEMM][f] = who[t];
    }
}
