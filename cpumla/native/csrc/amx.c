/* amx.c: AMX tile kernels (Sapphire Rapids and later). Only `gemm` with BF16 weights and n >= 16
 * tokens; everything else keeps the entry the layers below installed (avx512, over avx512f).
 *
 * Precision: the fp32 activations are rounded to bf16 (round to nearest even, vcvtne2ps2bf16) for
 * tdpbf16ps, which multiplies bf16 pairs exactly and accumulates in fp32 (bf16 denormals are flushed).
 * That is the rounding kernels.h specifies for BF16 weights on every ISA. Fewer than 16 tokens, and
 * other weight types, go to the avx512 gemm: who[K_GEMM] = "amx" names the entry, and who_fmt says
 * which formats really reach the tiles.
 *
 * Status: written without AMX hardware (the development machine has none). Compiled, and run only with
 * the tile instructions emulated in C (packing, tile layout, edges checked against scalar.c); never
 * run on a real AMX unit.
 *
 * Y[t, r] = sum_k X[t, k] W[r, k] maps onto tiles as
 *   A (16 tokens x 32 k, bf16)  = activations converted per 32-column step into a 2 KiB buffer;
 *   B (16 k-pairs x 16 rows)    = a 32-row weight panel, packed once per panel in VNNI order: dword n
 *                                 of B row kk holds W[r + n][k0 + 2kk] (low) and W[r + n][k0 + 2kk + 1];
 *   C (16 tokens x 16 rows fp32)= 2 x 2 accumulators covering 32 tokens x 32 rows.
 * Tiles: 0-3 C, 4-5 A, 6-7 B. The Linux permission (ARCH_REQ_XCOMP_PERM) is requested by dispatch.c. */
#include <immintrin.h>
#include <stdlib.h>
#include <string.h>
#include <stdio.h>
#include "common.h"
#include "kernels.h"

const char cpumla_flags_amx[] = CPUMLA_FLAGS;

#define AMX_MIN_TOKENS 16

static void (*prev_gemm)(const cpumla_weight *, const float *, int64_t, int64_t, float *, int64_t,
                         int64_t, int64_t);

typedef struct {                /* the 64-byte operand of ldtilecfg, palette 1 */
    uint8_t palette_id;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];         /* bytes per row of tile i */
    uint8_t rows[16];           /* rows of tile i */
} __attribute__((packed, aligned(64))) amx_tilecfg;

/* The packed panel, 32 rows x kpad columns of bf16 (2 KiB per 32 columns), is the thread's
 * CPUMLA_SCRATCH_AMX_PANEL buffer; without it the kernel does nothing (the call then fails). */

/* Pack rows [p0, p0 + mp) (mp <= 32; missing rows are zero) of a BF16 weight, columns [0, kpad)
 * (zero past K): for chunk c, half j, k-pair kk, row n: dword ((c*2 + j)*16 + kk)*16 + n. */
static void pack_panel(const cpumla_weight *w, int64_t p0, int64_t mp, int64_t kpad, uint16_t *bp) {
    int64_t K = w->cols;
    for (int64_t c = 0; c < kpad / 32; c++) {
        int64_t k0 = c * 32;
        for (int j = 0; j < 2; j++) {
            uint32_t *tile = (uint32_t *)bp + (c * 2 + j) * 256;
            int64_t rows = mp - 16 * j;                       /* valid rows in this half */
            if (rows <= 0) { memset(tile, 0, 1024); continue; }
            if (rows > 16) rows = 16;
            if (k0 + 32 <= K) {
                /* one masked gather per B row: dword (k0/2 + kk) of 16 weight rows */
                __mmask16 m = (__mmask16)((1u << rows) - 1u);
                __m512i off = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                                 _mm512_set1_epi32((int)w->row_bytes));
                const uint8_t *base = weight_row(w, p0 + 16 * j) + k0 * 2;
                for (int kk = 0; kk < 16; kk++)
                    _mm512_store_si512(tile + kk * 16,
                                       _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), m, off, base + kk * 4, 1));
            } else {                                          /* the last, partial chunk */
                uint16_t *t16 = (uint16_t *)tile;
                memset(tile, 0, 1024);
                for (int64_t n = 0; n < rows; n++) {
                    const uint16_t *wr = (const uint16_t *)weight_row(w, p0 + 16 * j + n);
                    for (int64_t k = k0; k < K; k++) t16[((k - k0) / 2 * 16 + n) * 2 + (k & 1)] = wr[k];
                }
            }
        }
    }
}

/* A tiles for tokens [t0, t0 + nt) (nt <= 32; missing tokens zero), columns [k0, k0 + 32) (zero
 * past K): 32 rows of 32 bf16. */
static void pack_acts(const float *x, int64_t ldx, int64_t nt, int64_t k0, int64_t K, uint16_t *ab) {
    int64_t left = K - k0;
    __mmask16 m0 = left >= 16 ? 0xffff : (__mmask16)((1u << left) - 1u);
    __mmask16 m1 = left >= 32 ? 0xffff : left <= 16 ? 0 : (__mmask16)((1u << (left - 16)) - 1u);
    for (int64_t t = 0; t < 32; t++) {
        __m512i v = _mm512_setzero_si512();
        if (t < nt) {
            const float *xr = x + t * ldx + k0;
            __m512 lo = _mm512_maskz_loadu_ps(m0, xr), hi = _mm512_maskz_loadu_ps(m1, xr + 16);
            v = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
        }
        _mm512_store_si512(ab + t * 32, v);
    }
}

static void gemm_amx(const cpumla_weight *w, const float *x, int64_t ldx, int64_t n, float *y, int64_t ldy,
                     int64_t r0, int64_t r1) {
    int64_t K = w->cols, kpad = (K + 31) / 32 * 32;
    if (w->dtype != CPUMLA_BF16 || n < AMX_MIN_TOKENS || K <= 0) { prev_gemm(w, x, ldx, n, y, ldy, r0, r1); return; }
    uint16_t *bp = cpumla_scratch(CPUMLA_SCRATCH_AMX_PANEL, sizeof(uint16_t) * (size_t)(32 * kpad));
    if (!bp) return;

    amx_tilecfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int i = 0; i < 8; i++) { cfg.rows[i] = 16; cfg.colsb[i] = 64; }
    _tile_loadconfig(&cfg);

    uint16_t ab[32 * 32] __attribute__((aligned(64)));
    float cb[32 * 32] __attribute__((aligned(64)));
    for (int64_t p0 = r0; p0 < r1; p0 += 32) {
        int64_t mp = r1 - p0 < 32 ? r1 - p0 : 32;
        pack_panel(w, p0, mp, kpad, bp);
        for (int64_t t0 = 0; t0 < n; t0 += 32) {
            int64_t nt = n - t0 < 32 ? n - t0 : 32;
            _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
            for (int64_t c = 0; c < kpad / 32; c++) {
                pack_acts(x + t0 * ldx, ldx, nt, c * 32, K, ab);
                _tile_loadd(4, ab, 64);                       /* tokens 0-15 */
                _tile_loadd(5, ab + 16 * 32, 64);             /* tokens 16-31 */
                _tile_loadd(6, bp + (c * 2 + 0) * 512, 64);   /* rows 0-15 */
                _tile_loadd(7, bp + (c * 2 + 1) * 512, 64);   /* rows 16-31 */
                _tile_dpbf16ps(0, 4, 6);
                _tile_dpbf16ps(1, 4, 7);
                _tile_dpbf16ps(2, 5, 6);
                _tile_dpbf16ps(3, 5, 7);
            }
            /* cb[t][i]: token t, panel row i */
            _tile_stored(0, cb, 128);
            _tile_stored(1, cb + 16, 128);
            _tile_stored(2, cb + 16 * 32, 128);
            _tile_stored(3, cb + 16 * 32 + 16, 128);
            __mmask16 mlo = mp >= 16 ? 0xffff : (__mmask16)((1u << mp) - 1u);
            __mmask16 mhi = mp >= 32 ? 0xffff : mp <= 16 ? 0 : (__mmask16)((1u << (mp - 16)) - 1u);
            for (int64_t t = 0; t < nt; t++) {
                float *yr = y + (t0 + t) * ldy + (p0 - r0);
                _mm512_mask_storeu_ps(yr, mlo, _mm512_load_ps(cb + t * 32));
                _mm512_mask_storeu_ps(yr + 16, mhi, _mm512_load_ps(cb + t * 32 + 16));
            }
        }
    }
    _tile_release();
}

void cpumla_fill_amx(cpumla_kernels *k) {
    static char bf16_gemm[64];
    if (k->gemm != gemm_amx) prev_gemm = k->gemm;
    k->gemm = gemm_amx;
    k->gemm_xb = NULL;                     /* BF16 goes to the tiles through gemm */
    k->who[K_GEMM] = "amx";
    /* other formats keep who_fmt of the gemm below (avx512 or avx512f) */
    snprintf(bf16_gemm, sizeof bf16_gemm, "amx (%s below %d tokens)", k->who_fmt[K_GEMM][CPUMLA_BF16], AMX_MIN_TOKENS);
    k->who_fmt[K_GEMM][CPUMLA_BF16] = bf16_gemm;
}
