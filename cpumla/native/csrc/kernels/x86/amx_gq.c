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
 * become fp32 exactly (gqp_take says why): a product of two exact floats, or an FMA of one exact product
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
#include "kernels/x86/gq_panel_x86.h"

/* From how many tokens the tiles beat avx512vnni's entry: every type's panel unpacks with SIMD (gqk_unpack,
 * gqi_unpack, Q8_0's a copy), and from one group of 16 tokens the tiles are at least as fast for each
 * (benchmarks/gguf_gemv.py --tokens 16 --isa amx against --isa avx512vnni, a Xeon with AMX, 2 threads,
 * 2048 columns: Q4_0 even, IQ2_XXS 1.4x, Q8_0 2x). */
#define AMX_GQ_MIN 16

typedef void (*gq_gemm_fn)(const cpumla_weight *, const void *, int64_t, float *, int64_t, int64_t, int64_t);
static gq_gemm_fn prev_gq[GQ_N];


/* one group of 16 tokens against the panel, chunks in column order into acc. The chunks' tile products
 * take turns in two sets of C tiles, so the next chunk's tdpbssd runs while this one's sums are scaled.
 * Tiles (the panel's configuration, gemm_gq_amx): whole chunks C 0-1, A 2-3 (16 x 32 bytes), B 4-5
 * (8 x 64); halves C 0-1 and 2-3 (a pair a chunk), A 4-5 (16 x 16), B 6-7 (4 x 64). */
static inline __attribute__((always_inline)) void gq_group(const int8_t *codes, int64_t K, const gqp_chunk *ch,
                                                           const int32_t *bq, const float *xd, const float *x0,
                                                           const float *x1, int flags, int has_min, __m512 acc[16]) {
    const int64_t nc = K / 32;
    int32_t cb[4][256] __attribute__((aligned(64)));
#define GQ_AT(c) (c) * 16
#define GQ_TAKE(T0, T1, c)                                                                                         \
    do {                                                                                                           \
        _tile_stored(T0, cb[T0], 64);                                                                              \
        if (flags & GQP_HALVES) _tile_stored(T1, cb[T1], 64);                                                      \
        gqp_take(cb[T0], cb[T1], &ch[c], xd + GQ_AT(c), x0 + GQ_AT(c), x1 + GQ_AT(c), flags, has_min, acc);        \
    } while (0)
    if (flags & GQP_HALVES) {
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
    uint8_t *ps = cpumla_scratch(CPUMLA_SCRATCH_AMX_PANEL, (size_t)(16 * K) + sizeof(gqp_chunk) * (size_t)nc + 64);
    if (!xs || !ps) return;
    int32_t *bq = (int32_t *)xs;
    float *x0 = (float *)(xs + ng * nc * 512), *x1 = x0 + ng * nc * 16, *xdb = x1 + ng * nc * 16;
    gqp_chunk *ch = (gqp_chunk *)ps;
    int8_t *codes = (int8_t *)(ps + sizeof(gqp_chunk) * (size_t)nc);
    gqp_pack_x(qx, n, K, bq, xdb, has_min ? x0 : NULL, x1, NULL);

    float fb[256] __attribute__((aligned(64)));
    int cfg = -1;
    for (int64_t p0 = r0; p0 < r1; p0 += 16) {
        const int64_t mp = r1 - p0 < 16 ? r1 - p0 : 16;
        const int flags = gqp_unpack(w, p0, mp, codes, ch, 0, NULL);
        if ((flags & GQP_HALVES) != cfg) gq_tilecfg(cfg = flags & GQP_HALVES);
        for (int64_t g = 0; g < ng; g++) {
            __m512 acc[16];
            for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
            const int32_t *bg = bq + g * nc * 128;
            const float *xg = xdb + g * nc * 16, *x0g = x0 + g * nc * 16, *x1g = x1 + g * nc * 16;
            /* each flag set its own loop (the flags are constants in each call) */
            if (has_min) {
                if (flags & GQP_HALVES) gq_group(codes, K, ch, bg, xg, x0g, x1g, GQP_HALVES, 1, acc);
                else gq_group(codes, K, ch, bg, xg, x0g, x1g, 0, 1, acc);
            } else if (flags & GQP_HALVES) gq_group(codes, K, ch, bg, xg, x0g, x1g, GQP_HALVES, 0, acc);
            else if (flags & GQP_UNIT) gq_group(codes, K, ch, bg, xg, x0g, x1g, GQP_UNIT, 0, acc);
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
