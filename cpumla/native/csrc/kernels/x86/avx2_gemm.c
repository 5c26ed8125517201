/* avx2_gemm.c: the AVX2 + FMA + F16C gemm (prefill; 1 to 3 tokens take the gemv's loops in avx2.c):
 * K in chunks of GM_KC columns; for each chunk, 16-row panels of the weights are packed once into
 * fp32 [k][16] (gm_pack), the widening done there: full BF16 / E4M3 panels straight from the
 * weights (gemm_pack's direct paths transpose dwords, i.e. pairs of bf16 or groups of four e4m3
 * codes, then widen), the rest decoded row by row (dequant_row, in avx2.c; E4M3: e4m3_codes) and
 * transposed (tr8x8_store). Then a 6-token x 16-row FMA microkernel runs over the panel. Its
 * activation operand is x itself, x rounded to bf16 (BF16 weights), or, for E4M3, bf16(x * scale) *
 * 2^8 of the panel's row block (kernels.h; the codes are packed as value * 2^-8, never an fp32
 * subnormal): E4M3 panels never straddle a row block, and the operands are made once per row block,
 * K chunk and chunk of at most GM_TC tokens (which bounds the buffer). Part of the avx2 level
 * (cpumla_fill_avx2 calls cpumla_fill_avx2_gemm; the same flags as avx2.c). Same semantics as
 * scalar.c (the spec), to fp32 rounding. Single-threaded: ops.c splits rows and tokens. */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include "core/common.h"
#include "core/kernels.h"
#include "kernels/x86/avx2_common.h"
#include "core/quant.h"
#include "kernels/x86/x86_bytes.h"

/* The entry this one replaced (the scalar spec): for degenerate E4M3 block shapes only. The activation
 * operands of BF16 / E4M3 weights go to the thread's CPUMLA_SCRATCH_AVX2_XR buffer; without it the
 * kernel does nothing (the context is marked failed and the call returns -1). */
static void (*prev_gemm)(const cpumla_weight *, const float *, int64_t, int64_t, float *, int64_t, int64_t,
                         int64_t);

/* ---- gemm: dequantised 16-row panels, 6 tokens x 16 rows FMA microkernel ------------------------ */
#define GM_KC 512   /* K chunk */
#define GM_NR 16    /* rows per panel */
#define GM_MT 6     /* tokens per microkernel */
#define GM_TC 192   /* most tokens per chunk of E4M3 activation operands (a multiple of GM_MT) */
static __thread float gm_pack[GM_KC * GM_NR] ALIGN64;   /* [k][16] */
static __thread float gm_tmp[GM_NR * GM_KC] ALIGN64;    /* [16][k] */

/* 8x8 transpose in registers: o[j] = element j of every r[i] (lane i) */
INLINE void tr8x8(const __m256 r[8], __m256 o[8]) {
    __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
    __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
    __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
    __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
    __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xee);
    __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xee);
    __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xee);
    __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xee);
    o[0] = _mm256_permute2f128_ps(u0, u4, 0x20); o[1] = _mm256_permute2f128_ps(u1, u5, 0x20);
    o[2] = _mm256_permute2f128_ps(u2, u6, 0x20); o[3] = _mm256_permute2f128_ps(u3, u7, 0x20);
    o[4] = _mm256_permute2f128_ps(u0, u4, 0x31); o[5] = _mm256_permute2f128_ps(u1, u5, 0x31);
    o[6] = _mm256_permute2f128_ps(u2, u6, 0x31); o[7] = _mm256_permute2f128_ps(u3, u7, 0x31);
}

INLINE void tr8x8_store(const float *src, int64_t lds, float *dst, int64_t ldd) {
    __m256 r[8], o[8];
    for (int i = 0; i < 8; i++) r[i] = _mm256_load_ps(src + i * lds);
    tr8x8(r, o);
    for (int j = 0; j < 8; j++) _mm256_store_ps(dst + j * ldd, o[j]);
}

/* BF16, 8 rows x 16 columns straight into the panel: the transpose moves column pairs (one dword
 * each), then each pair splits into its two fp32 columns (half the shuffles of transposing fp32) */
INLINE void pack_bf16_8x16(const cpumla_weight *w, int64_t r, int64_t c, float *out) {
    __m256 v[8], o[8];
    for (int i = 0; i < 8; i++) v[i] = _mm256_loadu_ps((const float *)((const uint16_t *)weight_row(w, r + i) + c));
    tr8x8(v, o);
    const __m256i hi = _mm256_set1_epi32((int)0xffff0000u);
    for (int j = 0; j < 8; j++) {
        __m256i d = _mm256_castps_si256(o[j]);
        _mm256_store_si256((__m256i *)(out + (2 * j) * GM_NR), _mm256_slli_epi32(d, 16));
        _mm256_store_si256((__m256i *)(out + (2 * j + 1) * GM_NR), _mm256_and_si256(d, hi));
    }
}

/* E4M3, 8 rows x 32 columns straight into the panel as value * 2^-8 (ld_e4m3x8's operand): the
 * transpose moves groups of 4 codes (one dword); byte p of each dword becomes the fp16 bits
 * (sign_extend(b) << 7) & 0xbf80 (the mask also clears the byte below), two positions are packed to
 * words and widened by vcvtph2ps. Returns 0 when a NaN code was seen (the caller redoes the block). */
INLINE int pack_e4m3_8x32(const cpumla_weight *w, int64_t r, int64_t c, float *out) {
    __m256 v[8], o[8];
    __m256i lo7 = _mm256_setzero_si256();
    for (int i = 0; i < 8; i++) {
        __m256i b = _mm256_loadu_si256((const __m256i *)(weight_row(w, r + i) + c));
        lo7 = _mm256_max_epu8(lo7, _mm256_and_si256(b, _mm256_set1_epi8(0x7f)));
        v[i] = _mm256_castsi256_ps(b);
    }
    tr8x8(v, o);
    const __m256i m = _mm256_set1_epi32(0xbf80);
    for (int j = 0; j < 8; j++) {
        __m256i d = _mm256_castps_si256(o[j]);
        __m256i h0 = _mm256_and_si256(_mm256_srai_epi32(_mm256_slli_epi32(d, 24), 17), m);
        __m256i h1 = _mm256_and_si256(_mm256_srai_epi32(_mm256_slli_epi32(d, 16), 17), m);
        __m256i h2 = _mm256_and_si256(_mm256_srai_epi32(_mm256_slli_epi32(d, 8), 17), m);
        __m256i h3 = _mm256_and_si256(_mm256_srai_epi32(d, 17), m);
        __m256i p01 = _mm256_permute4x64_epi64(_mm256_packus_epi32(h0, h1), 0xd8);   /* [h0 rows | h1 rows] */
        __m256i p23 = _mm256_permute4x64_epi64(_mm256_packus_epi32(h2, h3), 0xd8);
        _mm256_store_ps(out + (4 * j + 0) * GM_NR, _mm256_cvtph_ps(_mm256_castsi256_si128(p01)));
        _mm256_store_ps(out + (4 * j + 1) * GM_NR, _mm256_cvtph_ps(_mm256_extracti128_si256(p01, 1)));
        _mm256_store_ps(out + (4 * j + 2) * GM_NR, _mm256_cvtph_ps(_mm256_castsi256_si128(p23)));
        _mm256_store_ps(out + (4 * j + 3) * GM_NR, _mm256_cvtph_ps(_mm256_extracti128_si256(p23, 1)));
    }
    return _mm256_movemask_epi8(_mm256_cmpeq_epi8(lo7, _mm256_set1_epi8(0x7f))) == 0;
}

/* out[c - c0] = the value of E4M3 code row[c] times 2^-8, without the scale, c0 <= c < c1 (NaN codes
 * give NaN): ld_e4m3x8's operand, never an fp32 subnormal */
static void e4m3_codes(const uint8_t *row, int64_t c0, int64_t c1, float *out) {
    int64_t c = c0;
    for (; c + 8 <= c1; c += 8) _mm256_storeu_ps(out + c - c0, ld_e4m3x8(row + c));
    for (; c < c1; c++) out[c - c0] = e4m3_to_f32(row[c]) * 0x1p-8f;
}

/* gm_pack[k][i] = W[r + i, k0 + k] for i < nr (zero rows above), k < kpad (zero columns past kc); E4M3:
 * the codes' values times 2^-8, without the scale (both are in the activation operand). Full panels
 * of BF16 / E4M3 go straight from the weights into the panel; the rest through gm_tmp. */
static void gemm_pack(const cpumla_weight *w, int64_t r, int nr, int64_t k0, int64_t kc) {
    const int64_t kpad = (kc + 7) & ~(int64_t)7;
    int64_t kf = 0;                      /* columns [0, kf) done by the direct paths */
    if (nr == GM_NR && w->dtype == CPUMLA_BF16)
        for (; kf + 16 <= kc; kf += 16) {
            pack_bf16_8x16(w, r, k0 + kf, gm_pack + kf * GM_NR);
            pack_bf16_8x16(w, r + 8, k0 + kf, gm_pack + kf * GM_NR + 8);
        }
    if (nr == GM_NR && w->dtype == CPUMLA_E4M3)
        for (; kf + 32 <= kc; kf += 32)
            if (!pack_e4m3_8x32(w, r, k0 + kf, gm_pack + kf * GM_NR) ||
                !pack_e4m3_8x32(w, r + 8, k0 + kf, gm_pack + kf * GM_NR + 8)) break;
    if (kf >= kc) return;
    for (int i = 0; i < GM_NR; i++) {
        float *t = gm_tmp + i * GM_KC;
        if (i < nr) {
            if (w->dtype == CPUMLA_E4M3) e4m3_codes(weight_row(w, r + i), k0 + kf, k0 + kc, t + kf);
            else cpumla_avx2_dequant_row(w, r + i, k0 + kf, k0 + kc, t + kf);
            for (int64_t k = kc; k < kpad; k++) t[k] = 0.0f;
        } else {
            memset(t + kf, 0, (size_t)(kpad - kf) * sizeof(float));
        }
    }
    for (int64_t k = kf; k < kpad; k += 8) {
        tr8x8_store(gm_tmp + k, GM_KC, gm_pack + k * GM_NR, GM_NR);
        tr8x8_store(gm_tmp + 8 * GM_KC + k, GM_KC, gm_pack + k * GM_NR + 8, GM_NR);
    }
}

/* one k of the 6-token x 16-row FMA tile: wp[k][16] times x0[k] .. x5[k] into the caller's twelve
 * named accumulators c00 .. c51 (named, not an array, so that nothing spills) */
#define GM_STEP(k)                                                                                          \
    {                                                                                                       \
        const __m256 w0 = _mm256_load_ps(wp + (k) * GM_NR), w1 = _mm256_load_ps(wp + (k) * GM_NR + 8);   \
        __m256 b_;                                                                                          \
        b_ = _mm256_broadcast_ss(x0 + (k)); c00 = _mm256_fmadd_ps(b_, w0, c00); c01 = _mm256_fmadd_ps(b_, w1, c01); \
        b_ = _mm256_broadcast_ss(x1 + (k)); c10 = _mm256_fmadd_ps(b_, w0, c10); c11 = _mm256_fmadd_ps(b_, w1, c11); \
        b_ = _mm256_broadcast_ss(x2 + (k)); c20 = _mm256_fmadd_ps(b_, w0, c20); c21 = _mm256_fmadd_ps(b_, w1, c21); \
        b_ = _mm256_broadcast_ss(x3 + (k)); c30 = _mm256_fmadd_ps(b_, w0, c30); c31 = _mm256_fmadd_ps(b_, w1, c31); \
        b_ = _mm256_broadcast_ss(x4 + (k)); c40 = _mm256_fmadd_ps(b_, w0, c40); c41 = _mm256_fmadd_ps(b_, w1, c41); \
        b_ = _mm256_broadcast_ss(x5 + (k)); c50 = _mm256_fmadd_ps(b_, w0, c50); c51 = _mm256_fmadd_ps(b_, w1, c51); \
    }

/* Y[t, 0..nr) (+)= sum_k X[t, k] pack[k][0..nr) for t < nt (nt <= 6; missing tokens repeat the last
 * one and are not stored) */
static void gemm_micro(int nt, const float *wp, int64_t kc, const float *x, int64_t ldx, float *y,
                       int64_t ldy, int nr, int accumulate) {
    const float *x0 = x, *x1 = x + (nt > 1 ? 1 : 0) * ldx, *x2 = x + (nt > 2 ? 2 : nt - 1) * ldx;
    const float *x3 = x + (nt > 3 ? 3 : nt - 1) * ldx, *x4 = x + (nt > 4 ? 4 : nt - 1) * ldx;
    const float *x5 = x + (nt > 5 ? 5 : nt - 1) * ldx;
    __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00;
    __m256 c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
    for (int64_t k = 0; k < kc; k++) GM_STEP(k);
    __m256 c[GM_MT][2] = {{c00, c01}, {c10, c11}, {c20, c21}, {c30, c31}, {c40, c41}, {c50, c51}};
    for (int t = 0; t < nt; t++) {
        float *yt = y + t * ldy;
        if (nr == GM_NR) {
            if (accumulate) {
                c[t][0] = _mm256_add_ps(c[t][0], _mm256_loadu_ps(yt));
                c[t][1] = _mm256_add_ps(c[t][1], _mm256_loadu_ps(yt + 8));
            }
            _mm256_storeu_ps(yt, c[t][0]);
            _mm256_storeu_ps(yt + 8, c[t][1]);
        } else {
            float tmp[GM_NR];
            _mm256_storeu_ps(tmp, c[t][0]);
            _mm256_storeu_ps(tmp + 8, c[t][1]);
            for (int i = 0; i < nr; i++) yt[i] = accumulate ? yt[i] + tmp[i] : tmp[i];
        }
    }
}

static void gemm_avx2(const cpumla_weight *w, const float *x, int64_t ldx, int64_t n, float *y,
                      int64_t ldy, int64_t r0, int64_t r1) {
    if (n <= 0 || r1 <= r0) return;
    if (w->dtype == CPUMLA_E2M1) { prev_gemm(w, x, ldx, n, y, ldy, r0, r1); return; }   /* as gemv does */
    if (n == 1) { cpumla_avx2_gemv(w, x, y, r0, r1); return; }
    if (cpumla_avx2_gemm_few(w, x, ldx, n, y, ldy, r0, r1)) return;      /* 2 or 3 tokens: rows read once */
    const int64_t K = w->cols;
    if (K <= 0) {
        for (int64_t t = 0; t < n; t++)
            for (int64_t r = r0; r < r1; r++) y[t * ldy + r - r0] = 0.0f;
        return;
    }
    const int e4 = w->dtype == CPUMLA_E4M3, bf = w->dtype == CPUMLA_BF16;
    if (e4 && (w->block_rows <= 0 || w->block_cols <= 0)) { prev_gemm(w, x, ldx, n, y, ldy, r0, r1); return; }
    /* tokens per chunk (E4M3; the others take all n at once): the fewest chunks of at most GM_TC, as
     * even as multiples of GM_MT allow. Each chunk packs the panels again. */
    const int64_t nch = (n + GM_TC - 1) / GM_TC;
    const int64_t tc = e4 ? ((n + nch - 1) / nch + GM_MT - 1) / GM_MT * GM_MT : n;
    float *xr = NULL;         /* BF16 / E4M3: the activation operands of a K and token chunk, [tc][GM_KC] */
    if (e4 || bf) {
        xr = cpumla_scratch(CPUMLA_SCRATCH_AVX2_XR, sizeof(float) * (size_t)((n < tc ? n : tc) * GM_KC));
        if (!xr) return;
    }
    for (int64_t k0 = 0; k0 < K; k0 += GM_KC) {
        const int64_t kc = K - k0 < GM_KC ? K - k0 : GM_KC;
        const int acc = k0 > 0;
        for (int64_t t0 = 0; t0 < n; t0 += tc) {
            const int64_t nt = n - t0 < tc ? n - t0 : tc;
            const float *xt = x + t0 * ldx, *xk = xt + k0;
            int64_t ldxk = ldx;
            if (bf) {
                bf16_round_rows(xt + k0, ldx, nt, kc, xr, GM_KC);
                xk = xr;
                ldxk = GM_KC;
            }
            for (int64_t rs = r0; rs < r1;) {      /* E4M3: one row block at a time */
                int64_t re = r1;
                if (e4) {
                    const int64_t be = (rs / w->block_rows + 1) * w->block_rows;
                    if (be < r1) re = be;
                    for (int64_t t = 0; t < nt; t++) e4m3_act_row(w, rs, xt + t * ldx, k0, k0 + kc, xr + t * GM_KC, 256.0f);
                    xk = xr;
                    ldxk = GM_KC;
                }
                for (int64_t r = rs; r < re; r += GM_NR) {
                    const int nr = re - r < GM_NR ? (int)(re - r) : GM_NR;
                    gemm_pack(w, r, nr, k0, kc);
                    float *yr = y + t0 * ldy + (r - r0);
                    for (int64_t t = 0; t < nt; t += GM_MT)
                        gemm_micro(nt - t < GM_MT ? (int)(nt - t) : GM_MT, gm_pack, kc, xk + t * ldxk, ldxk,
                                   yr + t * ldy, ldy, nr, acc);
                }
                rs = re;
            }
        }
    }
}

/* ---- E2M1 of 1x32 E8M0 blocks: the integer product on fp32 FMAs (kernels.h's gemm_fp4) ------------
 * The activation codes (int16 values: |q| <= 32512) and w2 (|w2| <= 12) are exact in fp32, and so is
 * every product (< 2^19) and every partial sum of a block (< 32 * 2^19 = 2^24): the FMAs give each
 * block's integer sum exactly, in any order. Each block then adds (float)sum * (wd * xd), both
 * products rounded, to its row's total in block order, as scalar_q.c does: the result is the spec's
 * bit for bit. Panels: w2 as fp32 [k][16] and the chunk's scales wd [block][16] (zero rows: wd 0);
 * operands: the codes [t][GM_KC] and xd [t][FP_NB] of a token and K chunk. */
#define FP_NB (GM_KC / 32)    /* blocks per K chunk */
static __thread float fp_wd[FP_NB * GM_NR] ALIGN64;   /* [b][16] */

/* w2 of 16 rows (int8, one per byte) as fp32 into the panel's row k: lanes 0-7 and 8-15 */
INLINE void w2_store16(__m128i v, float *out) {
    _mm256_store_ps(out, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)));
    _mm256_store_ps(out + 8, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v, 8))));
}

/* rows [r, r + nr) (zero rows past nr), columns [k0, k0 + kc) (kc a multiple of 32): w2 into gm_pack
 * [k][16], wd into fp_wd. Each block's 16 x 16 code bytes are transposed first, so that one byte
 * vector holds a column pair of all 16 rows (low nibbles column 2k, high nibbles 2k + 1). */
static void fp4_pack(const cpumla_weight *w, int64_t r, int nr, int64_t k0, int64_t kc) {
    for (int64_t b = 0; b < kc / 32; b++) {
        __m128i v[16], o[16];
        fp4_block_rows(w, r, nr, k0 / 32 + b, v, fp_wd + b * GM_NR);
        tr16x16_bytes(v, o);
        float *out = gm_pack + 32 * b * GM_NR;
        for (int k = 0; k < 16; k++) {
            __m128i lo, hi;
            e2m1_w2_bytes(o[k], &lo, &hi);
            w2_store16(lo, out + (2 * k) * GM_NR);
            w2_store16(hi, out + (2 * k + 1) * GM_NR);
        }
    }
}

/* the codes and xd of columns [k0, k0 + kc) of n tokens (quant.h's q_act_block: amax over the block,
 * id = 32512 / amax, codes nearest_even(x * id), xd = amax / 32512; zero below QACT_TINY) */
static void fp4_operands(const float *x, int64_t ldx, int64_t n, int64_t k0, int64_t kc, float *codes, float *xd) {
    const __m256 absm = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (int64_t t = 0; t < n; t++)
        for (int64_t b = 0; b < kc / 32; b++) {
            const float *xb = x + t * ldx + k0 + 32 * b;
            __m256 v[4];
            for (int j = 0; j < 4; j++) v[j] = _mm256_loadu_ps(xb + 8 * j);
            const float amax = amax32(v, absm), id = qact_id(amax, QACT_MAX16);
            xd[t * FP_NB + b] = qact_xd(amax, QACT_MAX16);
            if (q_nonfinite(amax))                                      /* codes 0 */
                for (int j = 0; j < 4; j++) v[j] = _mm256_setzero_ps();
            const __m256 vid = _mm256_set1_ps(id);
            for (int j = 0; j < 4; j++)
                _mm256_store_ps(codes + t * GM_KC + 32 * b + 8 * j,
                                _mm256_cvtepi32_ps(_mm256_cvtps_epi32(_mm256_mul_ps(v[j], vid))));
        }
}

/* total += (float)sum * (wd * xd), each product rounded (never fused into the add) */
INLINE __m256 fp4_add(__m256 total, __m256 sum, __m256 wd, __m256 xd) {
    __m256 f = _mm256_mul_ps(wd, xd);
    __asm__("" : "+x"(f));
    __m256 p = _mm256_mul_ps(sum, f);
    __asm__("" : "+x"(p));
    return _mm256_add_ps(total, p);
}

/* one k of fp4_micro's tile: token j's two accumulators, for j < NT (a constant in each instance) */
#define FP4_FMA(j, k)                                                                                       \
    if (NT > j) {                                                                                           \
        const __m256 b_ = _mm256_broadcast_ss(x + j * GM_KC + (k));                                        \
        c##j##0 = _mm256_fmadd_ps(b_, w0, c##j##0);                                                         \
        c##j##1 = _mm256_fmadd_ps(b_, w1, c##j##1);                                                         \
    }

/* Y[t, 0..nr) = (first ? 0 : Y[t, 0..nr)) + the chunk's blocks in order, t < NT <= 6. The totals live
 * in memory (tot) between blocks: the 2 * NT accumulators take the registers. */
INLINE void fp4_micro(const int NT, const float *wp, const float *wd, int64_t nb, const float *x, const float *xd,
                      float *y, int64_t ldy, int nr, int first) {
    float tot[GM_MT][GM_NR] ALIGN64;
    for (int t = 0; t < NT; t++)
        for (int i = 0; i < GM_NR; i++) tot[t][i] = first || i >= nr ? 0.0f : y[t * ldy + i];
    for (int64_t b = 0; b < nb; b++) {
        __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00;
        __m256 c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
        for (int64_t k = 32 * b; k < 32 * b + 32; k++) {
            const __m256 w0 = _mm256_load_ps(wp + k * GM_NR), w1 = _mm256_load_ps(wp + k * GM_NR + 8);
            FP4_FMA(0, k) FP4_FMA(1, k) FP4_FMA(2, k) FP4_FMA(3, k) FP4_FMA(4, k) FP4_FMA(5, k)
        }
        const __m256 s[GM_MT][2] = {{c00, c01}, {c10, c11}, {c20, c21}, {c30, c31}, {c40, c41}, {c50, c51}};
        const __m256 d0 = _mm256_load_ps(wd + b * GM_NR), d1 = _mm256_load_ps(wd + b * GM_NR + 8);
        for (int t = 0; t < NT; t++) {
            const __m256 v = _mm256_broadcast_ss(xd + t * FP_NB + b);
            _mm256_store_ps(tot[t], fp4_add(_mm256_load_ps(tot[t]), s[t][0], d0, v));
            _mm256_store_ps(tot[t] + 8, fp4_add(_mm256_load_ps(tot[t] + 8), s[t][1], d1, v));
        }
        __asm__("" : : "r"(tot) : "memory");     /* keep the totals in memory, the accumulators in registers */
    }
    for (int t = 0; t < NT; t++)
        for (int i = 0; i < nr; i++) y[t * ldy + i] = tot[t][i];
}
#undef FP4_FMA

/* one out-of-line instance per token count, so that each gets the register file to itself */
typedef void (*fp4_micro_fn)(const float *, const float *, int64_t, const float *, const float *, float *, int64_t,
                             int, int);
#define FP4_MICRO(N)                                                                                        \
    __attribute__((noinline)) static void fp4_micro##N(const float *wp, const float *wd, int64_t nb,        \
                                                       const float *x, const float *xd, float *y, int64_t ldy, \
                                                       int nr, int first) {                                \
        fp4_micro(N, wp, wd, nb, x, xd, y, ldy, nr, first);                                                \
    }
FP4_MICRO(1) FP4_MICRO(2) FP4_MICRO(3) FP4_MICRO(4) FP4_MICRO(5) FP4_MICRO(6)
#undef FP4_MICRO
static const fp4_micro_fn fp4_micros[GM_MT + 1] = {NULL, fp4_micro1, fp4_micro2, fp4_micro3, fp4_micro4,
                                                   fp4_micro5, fp4_micro6};

static void gemm_fp4_avx2(const cpumla_weight *w, const float *x, int64_t ldx, int64_t n, float *y, int64_t ldy,
                          int64_t r0, int64_t r1) {
    if (n <= 0 || r1 <= r0) return;
    const int64_t K = w->cols;
    const int64_t nch = (n + GM_TC - 1) / GM_TC, tc = ((n + nch - 1) / nch + GM_MT - 1) / GM_MT * GM_MT;
    const int64_t tb = n < tc ? n : tc;
    float *codes = cpumla_scratch(CPUMLA_SCRATCH_AVX2_XR, sizeof(float) * (size_t)(tb * (GM_KC + FP_NB)));
    if (!codes) return;
    float *xd = codes + tb * GM_KC;
    for (int64_t k0 = 0; k0 < K; k0 += GM_KC) {
        const int64_t kc = K - k0 < GM_KC ? K - k0 : GM_KC;
        for (int64_t t0 = 0; t0 < n; t0 += tc) {
            const int64_t nt = n - t0 < tc ? n - t0 : tc;
            fp4_operands(x + t0 * ldx, ldx, nt, k0, kc, codes, xd);
            for (int64_t r = r0; r < r1; r += GM_NR) {
                const int nr = r1 - r < GM_NR ? (int)(r1 - r) : GM_NR;
                fp4_pack(w, r, nr, k0, kc);
                float *yr = y + t0 * ldy + (r - r0);
                /* the fewest tiles of at most GM_MT tokens, as even as they come (8 tokens: 4 + 4) */
                const int64_t tiles = (nt + GM_MT - 1) / GM_MT;
                for (int64_t i = 0, t = 0; i < tiles; i++) {
                    const int64_t m = (nt - t) / (tiles - i);
                    fp4_micros[m](gm_pack, fp_wd, kc / 32, codes + t * GM_KC, xd + t * FP_NB, yr + t * ldy, ldy, nr,
                                  k0 == 0);
                    t += m;
                }
            }
        }
    }
}

void cpumla_fill_avx2_gemm(cpumla_kernels *k) {
    if (k->gemm != gemm_avx2) prev_gemm = k->gemm;
    k->gemm = gemm_avx2;
    k->gemm_fp4 = gemm_fp4_avx2;
    k->gemm_fp4_min_n = FP4_FMA_MIN_AVX2;
}
