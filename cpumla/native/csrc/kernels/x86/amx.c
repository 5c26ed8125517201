/* amx.c: AMX tile kernels (Sapphire Rapids and later): `gemm` with BF16 and E4M3 weights (tdpbf16ps)
 * and the integer `gemm_q` of Q8 / Q4 / E2M1 weights (tdpbssd), each from 16 tokens; everything else keeps
 * the entry the layers below installed (avx512, over avx512f; avx512vnni for the q entries).
 *
 * Precision: the fp32 activations are rounded to bf16 (round to nearest even, vcvtne2ps2bf16) for
 * tdpbf16ps, which multiplies bf16 pairs exactly and accumulates in fp32 (bf16 denormals are flushed).
 * That is the rounding kernels.h specifies for BF16 weights on every ISA. E4M3 takes the same path:
 * its codes decoded to bf16 (exact), the activation times its block's scale before the rounding
 * (common.h e4m3_act). Fewer than 16 tokens, E4M3 blocks that are not whole 32s, and other weight
 * types go to the avx512 gemm: who[K_GEMM] = "amx" names the entry, and who_fmt says which formats
 * really reach the tiles. cpumla_fill_amx sets gemm, then gemm_q (cpumla_fill_amx_q).
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
#include "core/common.h"
#include "core/kernels.h"
#include "core/quant.h"
#include "kernels/x86/amx_common.h"

const char cpumla_flags_amx[] = CPUMLA_FLAGS;

#define AMX_MIN_TOKENS 16


static void (*prev_gemm)(const cpumla_weight *, const float *, int64_t, int64_t, float *, int64_t,
                         int64_t, int64_t);

/* E4M3 codes [0, K) -> their bf16 bits (exact), zero to kpad: sign | (code << 4) + 120 << 7 for
 * normal codes, a table for the subnormal ones (m * 2^-9), NaN for 0x7f / 0xff (e4m3_to_f32) */
static void e4m3_bf16_row(const uint8_t *src, int64_t K, uint16_t *dst, int64_t kpad) {
    static const uint16_t subn[32] = {0, 0x3b00, 0x3b80, 0x3bc0, 0x3c00, 0x3c20, 0x3c40, 0x3c60};
    const __m512i sub = _mm512_loadu_si512(subn);
    for (int64_t c = 0; c < kpad; c += 32) {
        const __mmask32 in = K - c >= 32 ? ~(__mmask32)0 : K - c <= 0 ? 0 : (((__mmask32)1 << (K - c)) - 1);
        const __m512i v = _mm512_cvtepu8_epi16(_mm256_maskz_loadu_epi8(in, src + c));
        const __m512i mag = _mm512_and_si512(v, _mm512_set1_epi16(0x7f)), sign = _mm512_slli_epi16(_mm512_and_si512(v, _mm512_set1_epi16(0x80)), 8);
        __m512i b = _mm512_add_epi16(_mm512_slli_epi16(mag, 4), _mm512_set1_epi16(120 << 7));
        b = _mm512_mask_permutexvar_epi16(b, _mm512_cmplt_epu16_mask(mag, _mm512_set1_epi16(8)), mag, sub);
        b = _mm512_mask_mov_epi16(b, _mm512_cmpeq_epi16_mask(mag, _mm512_set1_epi16(0x7f)), _mm512_set1_epi16(0x7fc0));
        _mm512_storeu_si512(dst + c, _mm512_or_si512(b, sign));
    }
}

/* E4M3 from the tiles: block rows and columns multiples of 32 (a panel and a k-chunk lie in one
 * block) and panels starting on a block row */
static int e4m3_tiles(const cpumla_weight *w, int64_t r0) {
    return w->dtype == CPUMLA_E4M3 && w->block_rows > 0 && w->block_cols > 0 && w->block_rows % 32 == 0 &&
           w->block_cols % 32 == 0 && r0 % 32 == 0;
}

/* ---- BF16 weights as the A operand, straight from memory ----------------------------------------
 * A BF16 weight row is already a row of an A tile (32 bf16 of one output row per 64 bytes): tiles load
 * 16 rows at the weight's own stride, nothing is repacked. The tokens are the B operand, packed once a
 * call: for token block b (16 tokens) and 32-column chunk c, the 1 KiB tile
 *   xb[((b * kc + c) * 16 + kk) * 16 + t] = dword of bf16(x[16b + t][32c + 2kk]), bf16(x[..][32c + 2kk + 1])
 * (zero past K and past n). A product tile C[i][t] is (weight row i, token t); its store transposes. A
 * chunk that runs past K, or rows past r1, load from a zero-padded copy. The sums are those of the
 * token-as-A form (the same products, the same order within each tdpbf16ps). */
static void pack_tokens_vnni(const float *x, int64_t ldx, int64_t n, int64_t K, int64_t kc, const float *scale,
                             uint32_t *xb) {
    const __m512i rows = lanes_times(64);
    uint32_t tmp[16 * 16] __attribute__((aligned(64)));
    for (int64_t b = 0; b * 16 < n; b++) {
        int64_t nt = n - 16 * b < 16 ? n - 16 * b : 16;
        for (int64_t c = 0; c < kc; c++) {
            int64_t k0 = c * 32, left = K - k0;
            __mmask16 m0 = left >= 16 ? 0xffff : (__mmask16)((1u << left) - 1u);
            __mmask16 m1 = left >= 32 ? 0xffff : left <= 16 ? 0 : (__mmask16)((1u << (left - 16)) - 1u);
            const __m512 sv = _mm512_set1_ps(scale ? scale[c] : 1.0f);
            for (int64_t t = 0; t < 16; t++) {          /* tmp[t][kk]: token t's 16 pairs */
                __m512i v = _mm512_setzero_si512();
                if (t < nt) {
                    const float *xr = x + (16 * b + t) * ldx + k0;
                    v = (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_ps(_mm512_maskz_loadu_ps(m1, xr + 16), sv),
                                                     _mm512_mul_ps(_mm512_maskz_loadu_ps(m0, xr), sv));
                }
                _mm512_store_si512(tmp + 16 * t, v);
            }
            uint32_t *tile = xb + (b * kc + c) * 256;
            for (int kk = 0; kk < 16; kk++)             /* tile[kk][t] = tmp[t][kk] */
                _mm512_store_si512(tile + 16 * kk, _mm512_i32gather_epi32(rows, tmp + kk, 1));
        }
    }
}

/* rows [p0, p0 + mp) of w, columns [k0, k0 + 32), into a zero-padded 16 x 32 bf16 tile image */
static void pad_rows(const cpumla_weight *w, int64_t p0, int64_t mp, int64_t k0, uint16_t *pad) {
    int64_t left = w->cols - k0 < 32 ? w->cols - k0 : 32;
    memset(pad, 0, 16 * 64);
    for (int64_t i = 0; i < mp && i < 16; i++)
        memcpy(pad + 32 * i, (const uint16_t *)weight_row(w, p0 + i) + k0, 2 * (size_t)left);
}

/* One panel of 32 weight rows (A tiles from a0 / a1 at stride rs, chunks from `direct` on from padded
 * copies of the weight's rows) times every token (xb), into y (the panel's first column). */
static void tile_panel(const cpumla_weight *w, const uint8_t *a0, const uint8_t *a1, int64_t rs, int64_t direct,
                       int64_t p0, int64_t mp, const uint32_t *xb, int64_t kc, int64_t nb, int64_t n, float *y,
                       int64_t ldy, uint16_t (*pad)[16 * 32], float *fb) {
    for (int64_t b = 0; b < nb; b += 2) {
        const int two = b + 1 < nb;                     /* a second block of 16 tokens */
        const uint32_t *x0 = xb + b * kc * 256, *x1 = xb + (b + 1) * kc * 256;
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
        for (int64_t c = 0; c < kc; c++) {
            if (c < direct) {
                _tile_loadd(4, a0 + c * 64, rs);
                _tile_loadd(5, a1 + c * 64, rs);
            } else {
                pad_rows(w, p0, mp, c * 32, pad[0]);
                pad_rows(w, p0 + 16, mp - 16, c * 32, pad[1]);
                _tile_loadd(4, pad[0], 64);
                _tile_loadd(5, pad[1], 64);
            }
            _tile_loadd(6, x0 + c * 256, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(2, 5, 6);
            if (two) {
                _tile_loadd(7, x1 + c * 256, 64);
                _tile_dpbf16ps(1, 4, 7);
                _tile_dpbf16ps(3, 5, 7);
            }
        }
        /* C[i][t] -> y[t][i]: fb[16 i + t] is what amx_store_block takes */
        int64_t nt0 = n - 16 * b < 16 ? n - 16 * b : 16, nt1 = two ? (n - 16 * (b + 1) < 16 ? n - 16 * (b + 1) : 16) : 0;
        int64_t m0 = mp < 16 ? mp : 16, m1 = mp - 16;
        float *yb = y + 16 * b * ldy;
        _tile_stored(0, fb, 64);
        amx_store_block(fb, yb, ldy, nt0, m0);
        if (m1 > 0) { _tile_stored(2, fb, 64); amx_store_block(fb, yb + 16, ldy, nt0, m1); }
        if (two) {
            _tile_stored(1, fb, 64);
            amx_store_block(fb, yb + 16 * ldy, ldy, nt1, m0);
            if (m1 > 0) { _tile_stored(3, fb, 64); amx_store_block(fb, yb + 16 * ldy + 16, ldy, nt1, m1); }
        }
    }
}

static void gemm_bf16_tiles(const cpumla_weight *w, const float *x, int64_t ldx, int64_t n, float *y, int64_t ldy,
                            int64_t r0, int64_t r1) {
    int64_t K = w->cols, kc = (K + 31) / 32, nb = (n + 15) / 16;
    const int e4 = w->dtype == CPUMLA_E4M3;
    /* E4M3: the activations scaled per block of 32k rows (a new packing each block row), a panel's rows
     * decoded to bf16 (db, zero past K) */
    int64_t group = e4 ? w->block_rows : r1 - r0;
    size_t xbytes = (size_t)(nb * kc) * 1024, dbytes = e4 ? (size_t)(32 * kc) * 64 : 0;
    uint8_t *buf = cpumla_scratch(CPUMLA_SCRATCH_AMX_PANEL, xbytes + dbytes + (e4 ? (size_t)kc * 4 : 0));
    if (!buf) return;
    uint32_t *xb = (uint32_t *)buf;
    uint16_t *db = (uint16_t *)(buf + xbytes);
    float *scale = e4 ? (float *)(buf + xbytes + dbytes) : NULL;
    amx_tilecfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int i = 0; i < 8; i++) { cfg.rows[i] = 16; cfg.colsb[i] = 64; }
    _tile_loadconfig(&cfg);
    uint16_t pad[2][16 * 32] __attribute__((aligned(64)));
    float fb[16 * 16] __attribute__((aligned(64)));
    for (int64_t g0 = r0; g0 < r1; g0 += group) {
        int64_t g1 = e4 ? (g0 / group + 1) * group : r1;   /* one block row of scales */
        g1 = g1 < r1 ? g1 : r1;
        if (e4)
            for (int64_t c = 0; c < kc; c++) scale[c] = weight_scale(w, g0, c * 32);
        pack_tokens_vnni(x, ldx, n, K, kc, scale, xb);
        for (int64_t p0 = g0; p0 < g1; p0 += 32) {
            int64_t mp = g1 - p0 < 32 ? g1 - p0 : 32;
            const uint8_t *a0, *a1;
            int64_t rs, direct;                         /* chunks loaded straight from a0 / a1 */
            if (e4) {
                for (int64_t i = 0; i < 32; i++) {
                    if (i < mp) e4m3_bf16_row(weight_row(w, p0 + i), K, db + i * 32 * kc, 32 * kc);
                    else memset(db + i * 32 * kc, 0, 64 * (size_t)kc);
                }
                a0 = (const uint8_t *)db, a1 = (const uint8_t *)(db + 16 * 32 * kc), rs = 64 * kc, direct = kc;
            } else {
                a0 = weight_row(w, p0), a1 = mp > 16 ? weight_row(w, p0 + 16) : a0, rs = w->row_bytes;
                direct = mp == 32 ? K / 32 : 0;
            }
            tile_panel(w, a0, a1, rs, direct, p0, mp, xb, kc, nb, n, y + (p0 - r0), ldy, pad, fb);
        }
    }
    _tile_release();
}

static void gemm_amx(const cpumla_weight *w, const float *x, int64_t ldx, int64_t n, float *y, int64_t ldy,
                     int64_t r0, int64_t r1) {
    if ((w->dtype != CPUMLA_BF16 && !e4m3_tiles(w, r0)) || n < AMX_MIN_TOKENS || w->cols <= 0) {
        prev_gemm(w, x, ldx, n, y, ldy, r0, r1);
        return;
    }
    gemm_bf16_tiles(w, x, ldx, n, y, ldy, r0, r1);
}

/* ---- Q8 / Q4 / E2M1: gemm_q on int8 tiles -----------------------------------------------------
 * The product of kernels.h for n >= AMX_MIN_TOKENS tokens: per block of 32 columns, the exact int32
 * sums of 16 weight rows x 16 tokens come from one tdpbssd (signed codes times signed codes: Q8's
 * codes as stored, Q4's nibbles less 8; E2M1's w2 codes, two tdpbssd against the high and the low
 * bytes of its int16 activation codes, 256 * high + low), and each is added to its fp32 sum as
 * (float)sum * (wd * xd), blocks in order, as avx512vnni adds them. E2M1 runs one block at a time
 * (its five tiles leave no room for a second set). Operands:
 *   A (16 rows x 32 bytes) = block b of 16 weight rows in column order: Q8's rows as stored (stride
 *                            row_bytes); Q4's, and a Q8 panel of fewer than 16 rows, unpacked once per
 *                            panel into a [16][K] int8 buffer;
 *   B (8 x 64 bytes)       = block b of 16 tokens, dword n of row kk their codes 4kk..4kk+3 (VNNI
 *                            order), gathered once per call from the avx512 level's quantized rows
 *                            (quant.h: block b's columns 0-15 at (b/4)*128 + (b%4)*16, 16-31 64 bytes on);
 *   C (16 x 16 int32)      = rows x tokens, two tiles taking turns so one block's tdpbssd runs while
 *                            the other's sums are scaled.
 * Tiles: 0-1 C, 2-3 A, 4-5 B. The sums of 16 rows x 16 tokens stay in 16 registers (one per row, a lane
 * per token) and are transposed into y at the end. */
static void (*prev_gemm_q)(const cpumla_weight *, const void *, int64_t, float *, int64_t, int64_t, int64_t);

/* B tiles and xd of every group of 16 tokens: bq[(g*nb + b)*128 + kk*16 + n], xdb[(g*nb + b)*16 + n]
 * (zero for tokens past n), from the codes at byte off of each quantized row (0, or E2M1's low bytes at
 * qx_lo); xdb NULL: no xd */
static void amxq_pack_x(const uint8_t *qx, int64_t per, int64_t n, int64_t K, int64_t off, int32_t *bq, float *xdb) {
    const int64_t nb = K / QK, ng = (n + 15) / 16, kp = qx_kp(K);
    const __m512i idx = lanes_times((int32_t)per);
    for (int64_t g = 0; g < ng; g++) {
        const int64_t nt = n - 16 * g < 16 ? n - 16 * g : 16;
        const __mmask16 m = (__mmask16)((1u << nt) - 1u);
        const uint8_t *base = qx + 16 * g * per;
        for (int64_t b = 0; b < nb; b++) {
            const int64_t at = (b / 4) * 128 + (b % 4) * 16;
            int32_t *t = bq + (g * nb + b) * 128;
            for (int kk = 0; kk < 8; kk++)
                _mm512_store_si512(t + 16 * kk, _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), m, idx,
                                                                            base + off + at + 4 * kk + (kk >= 4 ? 48 : 0), 1));
            if (xdb)
                _mm512_store_ps(xdb + (g * nb + b) * 16,
                                _mm512_mask_i32gather_ps(_mm512_setzero_ps(), m, idx, base + kp + 4 * b, 1));
        }
    }
}

/* rows [p0, p0 + mp) (mp <= 16, missing rows zero) as int8 codes, [16][K]: Q8 in column order; Q4
 * (nibble - 8) and E2M1 (e2m1_w2) per block as [low nibbles | high nibbles], the order of their
 * activation codes (Q4: columns 0-15 | 16-31; E2M1: even | odd columns) */
static void amxq_unpack(const cpumla_weight *w, int64_t p0, int64_t mp, int8_t *ap) {
    const int64_t K = w->cols;
    for (int64_t i = 0; i < 16; i++) {
        int8_t *o = ap + i * K;
        if (i >= mp) { memset(o, 0, (size_t)K); continue; }
        const uint8_t *row = weight_row(w, p0 + i);
        if (w->dtype == CPUMLA_Q8) { memcpy(o, row, (size_t)K); continue; }
        /* Q4: 4 blocks (64 bytes) a step; block j's low nibbles are its columns 0-15, high 16-31 */
        const __m512i lo_idx = _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11), hi_idx = _mm512_setr_epi64(4, 5, 12, 13, 6, 7, 14, 15);
        const __m512i m4 = _mm512_set1_epi8(15), e8 = _mm512_set1_epi8(8);
        const __m512i w2 = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)e2m1_w2));
        const int fp4 = w->dtype == CPUMLA_E2M1;
        for (int64_t c = 0; c < K; c += 128) {
            const int64_t left = K - c;                       /* columns left: a multiple of 32 */
            const __mmask64 in = left >= 128 ? ~(__mmask64)0 : (((__mmask64)1 << (left / 2)) - 1);
            const __m512i v = _mm512_maskz_loadu_epi8(in, row + c / 2);
            const __m512i ln = _mm512_and_si512(v, m4), hn = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
            const __m512i lo = fp4 ? _mm512_shuffle_epi8(w2, ln) : _mm512_sub_epi8(ln, e8);
            const __m512i hi = fp4 ? _mm512_shuffle_epi8(w2, hn) : _mm512_sub_epi8(hn, e8);
            const __m512i o0 = _mm512_permutex2var_epi64(lo, lo_idx, hi), o1 = _mm512_permutex2var_epi64(lo, hi_idx, hi);
            if (left >= 128) {
                _mm512_storeu_si512(o + c, o0);
                _mm512_storeu_si512(o + c + 64, o1);
            } else {
                const int64_t n0 = left < 64 ? left : 64;
                _mm512_mask_storeu_epi8(o + c, n0 >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << n0) - 1), o0);
                if (left > 64) _mm512_mask_storeu_epi8(o + c + 64, (((__mmask64)1 << (left - 64)) - 1), o1);
            }
        }
    }
}

/* acc[i] += (float)c[i][n] * (wd[i] * xd[n]) for the 16 rows i of one block, each product rounded
 * before the add (no contraction into an FMA): the avx512vnni level's arithmetic, so that a token's
 * row is the same bits through gemv (decode) and gemm (prefill) */
#define ROUNDED(v) __asm__("" : "+v"(v))
static inline __attribute__((always_inline)) void amxq_scale(const int32_t *c, const float *xd, const float *wd,
                                                             __m512 acc[16]) {
    const __m512 xv = _mm512_load_ps(xd);
    for (int i = 0; i < 16; i++) {
        __m512 f = _mm512_mul_ps(_mm512_set1_ps(wd[i]), xv);
        ROUNDED(f);
        __m512 p = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_load_si512(c + 16 * i)), f);
        ROUNDED(p);
        acc[i] = _mm512_add_ps(acc[i], p);
    }
}

/* the block after b in lane order: b + 16 in b's lane, else the first block of the next lane; -1 at
 * the end */
static inline int64_t amxq_next(int64_t b, int64_t nb) {
    if (b + 16 < nb) return b + 16;
    const int64_t l = b % 16 + 1;
    return l < 16 && l < nb ? l : -1;
}

static void gemm_q_amx(const cpumla_weight *w, const void *qx, int64_t n, float *y, int64_t ldy, int64_t r0,
                       int64_t r1) {
    const int fp4 = is_e2m1_q(w);
    if ((w->dtype != CPUMLA_Q8 && w->dtype != CPUMLA_Q4 && !fp4) || n < AMX_MIN_TOKENS) {
        prev_gemm_q(w, qx, n, y, ldy, r0, r1);
        return;
    }
    const int64_t K = w->cols, nb = K / QK, ng = (n + 15) / 16, per = QX_BYTES(K);
    /* scratch: B tiles (E2M1: of the high, then the low code bytes) and xd of the tokens; the unpacked
     * panel and its scales */
    uint8_t *xs = cpumla_scratch(CPUMLA_SCRATCH_AMX_QX, (size_t)(ng * nb * (512 * (fp4 ? 2 : 1) + 64)));
    uint8_t *ps = cpumla_scratch(CPUMLA_SCRATCH_AMX_PANEL, (size_t)(16 * K + 64 * nb));
    if (!xs || !ps) return;
    int32_t *bq = (int32_t *)xs, *bql = bq + ng * nb * 128;
    float *xdb = (float *)(xs + ng * nb * 512 * (fp4 ? 2 : 1));
    float *wdp = (float *)ps;                          /* [nb][16] */
    int8_t *ap = (int8_t *)(ps + 64 * nb);
    amxq_pack_x(qx, per, n, K, 0, bq, xdb);
    if (fp4) amxq_pack_x(qx, per, n, K, (const uint8_t *)qx_lo(qx, K) - (const uint8_t *)qx, bql, NULL);

    amx_tilecfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int i = 0; i < 2; i++) { cfg.rows[i] = 16; cfg.colsb[i] = 64; }       /* C */
    for (int i = 2; i < 4; i++) { cfg.rows[i] = 16; cfg.colsb[i] = 32; }       /* A */
    for (int i = 4; i < 6; i++) { cfg.rows[i] = 8; cfg.colsb[i] = 64; }        /* B */
    _tile_loadconfig(&cfg);

    int32_t cb[2][256] __attribute__((aligned(64)));
    float fb[256] __attribute__((aligned(64)));
    static __thread float part[16][16][16] __attribute__((aligned(64)));   /* [lane][row][token] */
    for (int64_t p0 = r0; p0 < r1; p0 += 16) {
        const int64_t mp = r1 - p0 < 16 ? r1 - p0 : 16;
        const int8_t *abase;
        int64_t astride;
        if (w->dtype == CPUMLA_Q8 && mp == 16) {           /* Q4, E2M1: always unpacked */
            abase = (const int8_t *)weight_row(w, p0);
            astride = w->row_bytes;
        } else {
            amxq_unpack(w, p0, mp, ap);
            abase = ap;
            astride = K;
        }
        for (int64_t i = 0; i < 16; i++)
            for (int64_t b = 0; b < nb; b++) wdp[b * 16 + i] = i < mp ? q_scale(w, p0 + i, b) : 0.0f;
        for (int64_t g = 0; g < ng; g++) {
            const int32_t *bg = bq + g * nb * 128;
            const float *xg = xdb + g * nb * 16;
            /* lane j of avx512vnni's sums: blocks j, j + 16, j + 32, ... in order (acc, then part[j]);
             * the lanes visited one after another, each block's tdpbssd issued before the previous
             * block's sums are scaled */
            __m512 acc[16];
            for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
            for (int64_t l = nb < 16 ? nb : 16; l < 16; l++)
                for (int i = 0; i < 16; i++) _mm512_store_ps(part[l][i], _mm512_setzero_ps());
#define AMXQ_ISSUE(C, A, B, b)                         /* tile numbers: literals (asm names) */ \
    do {                                                               \
        _tile_loadd(A, abase + (b) * QK, astride);                     \
        _tile_loadd(B, bg + (b) * 128, 64);                            \
        _tile_zero(C);                                                 \
        _tile_dpbssd(C, A, B);                                         \
    } while (0)
#define AMXQ_TAKE(T, b)                                                                  \
    do {                                                                                 \
        _tile_stored(T, cb[T], 64);                                                      \
        AMXQ_TAKE_SUMS(T, b);                                                            \
    } while (0)
#define AMXQ_TAKE_SUMS(T, b)                                 /* cb[T] holds block b's sums */ \
    do {                                                                                 \
        amxq_scale(cb[T], xg + (b) * 16, wdp + (b) * 16, acc);                           \
        if ((b) + 16 >= nb)                                  /* the lane's last block */ \
            for (int i = 0; i < 16; i++) {                                               \
                _mm512_store_ps(part[(b) % 16][i], acc[i]);                              \
                acc[i] = _mm512_setzero_ps();                                            \
            }                                                                            \
    } while (0)
            if (fp4) {          /* 256 times the sums over the high bytes plus those over the low */
                for (int64_t b = 0; b >= 0; b = amxq_next(b, nb)) {
                    _tile_loadd(2, abase + b * QK, astride);
                    _tile_loadd(4, bg + b * 128, 64);
                    _tile_loadd(5, bql + g * nb * 128 + b * 128, 64);
                    _tile_zero(0);
                    _tile_zero(1);
                    _tile_dpbssd(0, 2, 4);
                    _tile_dpbssd(1, 2, 5);
                    _tile_stored(0, cb[0], 64);
                    _tile_stored(1, cb[1], 64);
                    for (int i = 0; i < 256; i += 16)
                        _mm512_store_si512(cb[0] + i, _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(cb[0] + i), 8),
                                                                       _mm512_load_si512(cb[1] + i)));
                    AMXQ_TAKE_SUMS(0, b);
                }
            } else {
            int64_t cur = 0, nxt;
            AMXQ_ISSUE(0, 2, 4, cur);
            for (;;) {
                nxt = amxq_next(cur, nb);
                if (nxt >= 0) AMXQ_ISSUE(1, 3, 5, nxt);
                AMXQ_TAKE(0, cur);
                if (nxt < 0) break;
                cur = nxt;
                nxt = amxq_next(cur, nb);
                if (nxt >= 0) AMXQ_ISSUE(0, 2, 4, nxt);
                AMXQ_TAKE(1, cur);
                if (nxt < 0) break;
                cur = nxt;
            }
            }
#undef AMXQ_ISSUE
#undef AMXQ_TAKE_SUMS
#undef AMXQ_TAKE
            /* each row's 16 lanes added as _mm512_reduce_add_ps adds them (halves, quarters, then
             * lanes 0 + 2 and 1 + 3, then those two), a vector of its tokens at a time */
            for (int i = 0; i < 16; i++) {
                __m512 s8[8], s4[4];
                for (int l = 0; l < 8; l++) s8[l] = _mm512_add_ps(_mm512_load_ps(part[8 + l][i]), _mm512_load_ps(part[l][i]));
                for (int l = 0; l < 4; l++) s4[l] = _mm512_add_ps(s8[4 + l], s8[l]);
                _mm512_store_ps(fb + 16 * i, _mm512_add_ps(_mm512_add_ps(s4[0], s4[2]), _mm512_add_ps(s4[1], s4[3])));
            }
            /* fb[16 i + t]: row p0 + i, token 16g + t */
            amx_store_block(fb, y + 16 * g * ldy + (p0 - r0), ldy, n - 16 * g < 16 ? n - 16 * g : 16, mp);
        }
    }
    _tile_release();
}

void cpumla_fill_amx_q(cpumla_kernels *k) {
    static char who[2][64];
    if (k->gemm_q != gemm_q_amx) prev_gemm_q = k->gemm_q;
    k->gemm_q = gemm_q_amx;
    for (int f = CPUMLA_Q8; f <= CPUMLA_Q4; f++) {
        snprintf(who[f - CPUMLA_Q8], sizeof who[0], "amx (%s below %d tokens)", k->who_fmt[K_GEMM][f], AMX_MIN_TOKENS);
        k->who_fmt[K_GEMM][f] = who[f - CPUMLA_Q8];
    }
    k->who_fmt[K_GEMM][CPUMLA_E2M1] = "amx (avx512vnni below " FP4_STR(AMX_MIN_TOKENS) " tokens; " E2M1_HANDBACK ")";
}

/* The tile_loop probe: 4 accumulators over 2 x 2 resident A / B tiles, 4 tile products a round with no
 * dependence between consecutive ones (each accumulator is written every 4th product). */
static double tile_loop_amx(int kind, int64_t iters, float *sink) {
    amx_tilecfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
    static const uint8_t src[16 * 64] __attribute__((aligned(64))) = {0};     /* zeros: no subnormal, no overflow */
    float out[16 * 16] __attribute__((aligned(64)));
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    _tile_loadd(4, src, 64);
    _tile_loadd(5, src, 64);
    _tile_loadd(6, src, 64);
    _tile_loadd(7, src, 64);
    if (kind == 0) {
        for (int64_t it = 0; it < iters; it++) {
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
    } else {
        for (int64_t it = 0; it < iters; it++) {
            _tile_dpbusd(0, 4, 6);
            _tile_dpbusd(1, 4, 7);
            _tile_dpbusd(2, 5, 6);
            _tile_dpbusd(3, 5, 7);
        }
    }
    _tile_stored(0, out, 64);
    _tile_release();
    *sink += out[0] + out[255];
    return 4.0 * 2.0 * 16.0 * 16.0 * (kind == 0 ? 32.0 : 64.0) * (double)iters;
}

void cpumla_fill_amx(cpumla_kernels *k) {
    k->tile_loop = tile_loop_amx;
    static char bf16_gemm[64];
    if (k->gemm != gemm_amx) prev_gemm = k->gemm;
    k->gemm = gemm_amx;
    k->gemm_xb = NULL;                     /* BF16 goes to the tiles through gemm */
    k->who[K_GEMM] = "amx";
    /* other formats keep who_fmt of the gemm below (avx512 or avx512f) */
    static char e4m3_gemm[96];
    snprintf(bf16_gemm, sizeof bf16_gemm, "amx (%s below %d tokens)", k->who_fmt[K_GEMM][CPUMLA_BF16], AMX_MIN_TOKENS);
    k->who_fmt[K_GEMM][CPUMLA_BF16] = bf16_gemm;
    snprintf(e4m3_gemm, sizeof e4m3_gemm, "amx (%s below %d tokens or for blocks not of 32k rows and columns)",
             k->who_fmt[K_GEMM][CPUMLA_E4M3], AMX_MIN_TOKENS);
    k->who_fmt[K_GEMM][CPUMLA_E4M3] = e4m3_gemm;
    cpumla_fill_amx_q(k);
}
