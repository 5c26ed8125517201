/* avx512.c: the avx512 level, AVX-512 F/BW/VL/DQ + BF16 + VNNI + VBMI (Zen 4, Sapphire Rapids and
 * later), on top of the avx512vnni level (avx512vnni_q.c's integer products) and so of avx512f
 * (avx512f.c, avx512f_rows.c, avx512f_gemm.c): products on AVX512-BF16 dot products
 * (vdpbf16ps): BF16-weight gemv, gemm and gemv_t here, E4M3-weight gemv and gemm in avx512_e4m3.c
 * (codes decoded to bf16 with VBMI's vpermi2b). Every other format and kernel is handed to the
 * avx512f entries this level's fill replaces.
 *
 * vdpbf16ps acc, w, x adds w[2i] * x[2i] + w[2i+1] * x[2i+1] to fp32 lane i: 32 multiply-adds per
 * instruction, twice an fp32 FMA's 16. A 64-byte load of a bf16 weight row is 32 columns, which is
 * already that operand's layout, so the weights are read as stored: no panel is decoded or packed.
 * The activations are converted once per call (per K chunk for gemm) into a per-thread scratch
 * buffer (cpumla_scratch) with vcvtne2ps2bf16, which rounds to nearest even: the rounding kernels.h
 * specifies for every ISA. A product of two bf16 is exact in fp32; bf16 subnormal inputs are read as
 * zero (far below anything a weight or activation holds), and the sums round as fp32 FMAs do.
 *
 * gemv (bf16 and E4M3): one row at a time, so a thread's range of rows is one sequential stream,
 * with a software prefetch a fixed distance ahead of it, as the integer GEMVs do: it is bound by
 * memory bandwidth, and one stream a thread keeps the memory system busier than 4 rows at a time.
 * gemm: K in chunks of BG_KC columns, rows in panels of BG_MP (a panel's chunk, 256 KiB, stays in
 * L2 while the token blocks pass over it); each block of 6 tokens (24 KiB of bf16 activations, L1)
 * goes through a 4-row x 6-token microkernel (avx512_dpbf16.h) that keeps 24 accumulators in zmm
 * registers and reduces them once per chunk. Activations come converted (gemm_xb, from ops.c, once
 * per call) or are converted here per chunk (gemm). Long K chunks amortise the microkernel's
 * reduction; the panel height keeps a chunk within L2. A gemm of 2 or 3 tokens whose activations fit in
 * L1 goes row by row instead (gemv_row_nt): the gemv's stream and sums, every token's dot products
 * taken from one read of the row, each result bit for bit that token's gemv.
 */
#include <immintrin.h>
#include <stdint.h>
#include "core/common.h"
#include "core/kernels.h"
#include "core/dispatch.h"
#include "kernels/x86/avx512_common.h"
#include "kernels/x86/avx512_dpbf16.h"

/* gemm_xb of at most FEW_NT tokens whose bf16 activations fit in FEW_XB bytes (they stay in L1 while
 * the rows stream past): gemv_row_nt. Measured on Zen 4 (bf16, 2 threads): 2 and 3 tokens over rows of
 * 512 columns in 1.0x one token's time (the blocked gemm: 1.7-2.0x), over 2048 columns 0.9-1.0x
 * (1.05-1.2x); with 4 tokens, or activations past L1 (3 x 7168 columns), the blocked gemm is faster. */
#define FEW_NT 3
#define FEW_XB (16 << 10)

const char cpumla_flags_avx512[] = CPUMLA_FLAGS;

/* xb[t*ldb + k] = bf16(x[t*ldx + k]) for k < K, 0 for K <= k < ldb (ldb a multiple of 32) */
static void to_bf16(const float *x, int64_t ldx, int64_t n, int64_t K, uint16_t *xb, int64_t ldb) {
    for (int64_t t = 0; t < n; t++) {
        const float *s = x + t * ldx;
        uint16_t *d = xb + t * ldb;
        for (int64_t k = 0; k < ldb; k += 32) {
            __m512 lo = _mm512_maskz_loadu_ps(tail16(K - k), s + k);
            __m512 hi = _mm512_maskz_loadu_ps(tail16(K - k - 16), s + k + 16);
            _mm512_storeu_si512(d + k, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
        }
    }
}

/* ---- gemv --------------------------------------------------------------------------------------- */
/* y = row r . xb, the row read in order 128 columns (4 lines) a step, each line prefetched
 * GEMV_PF_DIST(l2) ahead (l2: the target, common.h cpumla_pf_l2_plain) after the step's products, then 64
 * columns a step; xb is zero-padded past K. Four lines a step with their prefetches after the products,
 * as the integer GEMVs issue them: the prefetches do not delay the step's own loads. */
INLINE float gemv_row(const cpumla_weight *w, const uint16_t *xb, int64_t r, int l2) {
    const uint16_t *rp = (const uint16_t *)weight_row(w, r);
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
    int64_t K = w->cols, c = 0;
    for (; c + 128 <= K; c += 128) {
        a0 = _mm512_dpbf16_ps(a0, ld_bh(rp + c), ld_bh(xb + c));
        a1 = _mm512_dpbf16_ps(a1, ld_bh(rp + c + 32), ld_bh(xb + c + 32));
        a2 = _mm512_dpbf16_ps(a2, ld_bh(rp + c + 64), ld_bh(xb + c + 64));
        a3 = _mm512_dpbf16_ps(a3, ld_bh(rp + c + 96), ld_bh(xb + c + 96));
        UNROLL for (int l = 0; l < 256; l += 64) GEMV_PF_LINE((const char *)(rp + c) + l + GEMV_PF_DIST(l2), GEMV_PF_DIST(l2), l2);
    }
    a0 = _mm512_add_ps(a0, a2);
    a1 = _mm512_add_ps(a1, a3);
    for (; c + 64 <= K; c += 64) {
        GEMV_PF_LINE((const char *)(rp + c) + GEMV_PF_DIST(l2), GEMV_PF_DIST(l2), l2);
        GEMV_PF_LINE((const char *)(rp + c) + 64 + GEMV_PF_DIST(l2), GEMV_PF_DIST(l2), l2);
        a0 = _mm512_dpbf16_ps(a0, ld_bh(rp + c), ld_bh(xb + c));
        a1 = _mm512_dpbf16_ps(a1, ld_bh(rp + c + 32), ld_bh(xb + c + 32));
    }
    for (; c < K; c += 32) a0 = _mm512_dpbf16_ps(a0, ld_bh_tail(rp + c, K - c), ld_bh(xb + c));
    return _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
}

void cpumla_avx512_gemv_bf16(const cpumla_weight *w, const float *x, float *y, int64_t r0, int64_t r1) {
    int64_t K = w->cols, Kp = (K + 31) & ~(int64_t)31;
    uint16_t *xb = cpumla_scratch(CPUMLA_SCRATCH_AVX512_XB, sizeof(uint16_t) * (size_t)Kp);
    if (!xb) return;
    to_bf16(x, 0, 1, K, xb, Kp);
    GEMV_PF_CASES(cpumla_pf_l2_plain, for (int64_t r = r0; r < r1; r++) y[r - r0] = gemv_row(w, xb, r, L2));
}

/* y[t*ldy] = row r . xb[t*ldb ..] for each of NT tokens: gemv_row's loads, prefetches and sums (so each
 * token's result is bit for bit its gemv's), the row read once for all of them. The gemm of a few
 * tokens (a verify forward of drafts) stays as bandwidth-bound as the gemv. */
INLINE void gemv_row_nt(const cpumla_weight *w, const uint16_t *xb, int64_t ldb, int64_t r, float *y, int64_t ldy,
                        int NT, int l2) {
    const uint16_t *rp = (const uint16_t *)weight_row(w, r);
    __m512 a[FEW_NT][4];
    UNROLL for (int t = 0; t < NT; t++) UNROLL for (int i = 0; i < 4; i++) a[t][i] = _mm512_setzero_ps();
    int64_t K = w->cols, c = 0;
    for (; c + 128 <= K; c += 128) {
        __m512bh wv[4];
        UNROLL for (int i = 0; i < 4; i++) wv[i] = ld_bh(rp + c + 32 * i);
        UNROLL for (int t = 0; t < NT; t++)
            UNROLL for (int i = 0; i < 4; i++) a[t][i] = _mm512_dpbf16_ps(a[t][i], wv[i], ld_bh(xb + t * ldb + c + 32 * i));
        UNROLL for (int l = 0; l < 256; l += 64) GEMV_PF_LINE((const char *)(rp + c) + l + GEMV_PF_DIST(l2), GEMV_PF_DIST(l2), l2);
    }
    UNROLL for (int t = 0; t < NT; t++) {
        a[t][0] = _mm512_add_ps(a[t][0], a[t][2]);
        a[t][1] = _mm512_add_ps(a[t][1], a[t][3]);
    }
    for (; c + 64 <= K; c += 64) {
        GEMV_PF_LINE((const char *)(rp + c) + GEMV_PF_DIST(l2), GEMV_PF_DIST(l2), l2);
        GEMV_PF_LINE((const char *)(rp + c) + 64 + GEMV_PF_DIST(l2), GEMV_PF_DIST(l2), l2);
        __m512bh w0 = ld_bh(rp + c), w1 = ld_bh(rp + c + 32);
        UNROLL for (int t = 0; t < NT; t++) {
            a[t][0] = _mm512_dpbf16_ps(a[t][0], w0, ld_bh(xb + t * ldb + c));
            a[t][1] = _mm512_dpbf16_ps(a[t][1], w1, ld_bh(xb + t * ldb + c + 32));
        }
    }
    for (; c < K; c += 32) {
        __m512bh w0 = ld_bh_tail(rp + c, K - c);
        UNROLL for (int t = 0; t < NT; t++) a[t][0] = _mm512_dpbf16_ps(a[t][0], w0, ld_bh(xb + t * ldb + c));
    }
    UNROLL for (int t = 0; t < NT; t++) y[t * ldy] = _mm512_reduce_add_ps(_mm512_add_ps(a[t][0], a[t][1]));
}

/* ---- gemm --------------------------------------------------------------------------------------- */
/* Columns [k0, k0 + kc) of rows [r0, r1) against xb (those columns of n tokens, row stride ldb) */
static void gemm_chunk(const cpumla_weight *w, const uint16_t *xb, int64_t ldb, int64_t n, int64_t k0,
                       int64_t kc, float *y, int64_t ldy, int64_t r0, int64_t r1) {
    int acc = k0 > 0;
    for (int64_t p0 = r0; p0 < r1; p0 += BG_MP) {
        int64_t p1 = min64(p0 + BG_MP, r1);
        for (int64_t t0 = 0; t0 < n; t0 += BG_NT) {
            int nt = (int)min64(BG_NT, n - t0);
            const uint16_t *xt = xb + t0 * ldb;
            for (int64_t i0 = p0; i0 < p1; i0 += 4) {
                int mr = (int)min64(4, p1 - i0);
                const uint16_t *rp[4];
                UNROLL for (int i = 0; i < 4; i++) rp[i] = (const uint16_t *)weight_row(w, i0 + (i < mr ? i : 0)) + k0;
                float *yt = y + t0 * ldy + (i0 - r0);
#define MICRO(NT) gemm_micro(rp, xt, ldb, kc, yt, ldy, mr, NT, acc)
                SWITCH_NT(nt, MICRO)
#undef MICRO
            }
        }
    }
}

/* the table's gemm_xb: x already in bf16 (ops.c converts it once per call) */
void cpumla_avx512_gemm_xb(const cpumla_weight *w, const uint16_t *xb, int64_t ldb, int64_t n, float *y,
                           int64_t ldy, int64_t r0, int64_t r1) {
    if (n <= 0 || r1 <= r0) return;
    if (w->cols <= 0) {
        for (int64_t t = 0; t < n; t++)
            for (int64_t r = r0; r < r1; r++) y[t * ldy + (r - r0)] = 0.0f;
        return;
    }
    if (n <= FEW_NT && n * ldb * (int64_t)sizeof(uint16_t) <= FEW_XB) {  /* a few tokens: each row streamed once */
#define FEW(NT) GEMV_PF_CASES(cpumla_pf_l2_plain, for (int64_t r = r0; r < r1; r++)                          \
                                  gemv_row_nt(w, xb, ldb, r, y + (r - r0), ldy, NT, L2))
        switch (n) {
        case 3: FEW(3); break;
        case 2: FEW(2); break;
        default: FEW(1); break;
        }
#undef FEW
        return;
    }
    for (int64_t k0 = 0; k0 < w->cols; k0 += BG_KC)
        gemm_chunk(w, xb + k0, ldb, n, k0, min64(BG_KC, w->cols - k0), y, ldy, r0, r1);
}

/* gemm from fp32 x (callers of the table entry itself, e.g. per-head products): converted per chunk */
void cpumla_avx512_gemm_bf16(const cpumla_weight *w, const float *x, int64_t ldx, int64_t n, float *y,
                             int64_t ldy, int64_t r0, int64_t r1) {
    int64_t K = w->cols;
    uint16_t *xb = cpumla_scratch(CPUMLA_SCRATCH_AVX512_XB, sizeof(uint16_t) * (size_t)(n * BG_KC));
    if (!xb) return;
    for (int64_t k0 = 0; k0 < K; k0 += BG_KC) {
        int64_t kc = min64(BG_KC, K - k0);
        to_bf16(x + k0, ldx, n, kc, xb, BG_KC);
        gemm_chunk(w, xb, BG_KC, n, k0, kc, y, ldy, r0, r1);
    }
}

/* ---- gemv_t for BF16 weights (the MLA absorb) ----------------------------------------------------
 * y[c - c0] = sum_i bf16(x[i]) * W[r0 + i, c]. Rows go in pairs: unpacking 32 columns of rows i and
 * i + 1 by 16-bit words gives (W[i, c], W[i+1, c]) pairs in each dword, and one vdpbf16ps against
 * the broadcast pair (x_i, x_{i+1}) adds both rows' products to 16 columns. The unpack permutes the
 * columns within each 32: the low vector holds columns 8L + 0..3 of 128-bit lane L (L < 4), the high
 * one 8L + 4..7. The sums are kept in that order in a per-thread buffer and put back in order at the
 * end. Two pairs (4 rows) per pass over the buffer. */
INLINE __m512bh pair_bh(float a, float b) {
    uint32_t u = (uint32_t)f32_to_bf16(a) | (uint32_t)f32_to_bf16(b) << 16;
    return (__m512bh)_mm512_set1_epi32((int)u);
}

void cpumla_avx512_gemv_t_bf16(const cpumla_weight *w, int64_t r0, int64_t nr, const float *x, float *y,
                               int64_t c0, int64_t c1) {
    int64_t n = c1 - c0, n32 = (n + 31) & ~(int64_t)31;
    float *acc = cpumla_scratch(CPUMLA_SCRATCH_AVX512_GT, sizeof(float) * (size_t)(n32 > 0 ? n32 : 32));
    if (!acc) return;
    for (int64_t c = 0; c < n32; c += 16) _mm512_storeu_ps(acc + c, _mm512_setzero_ps());
    for (int64_t i = 0; i < nr; i += 4) {
        int R = (int)min64(4, nr - i);
        gt_prefetch(w->data, w->row_bytes, r0, i, 4, nr, c0, c1, 2);
        const uint16_t *rp[4];
        UNROLL for (int k = 0; k < 4; k++) rp[k] = (const uint16_t *)weight_row(w, r0 + i + (k < R ? k : 0)) + c0;
        /* rows past nr: no weights loaded (zeros) and x = 0 */
        __m512bh xp0 = pair_bh(x[i], R > 1 ? x[i + 1] : 0.0f);
        __m512bh xp1 = pair_bh(R > 2 ? x[i + 2] : 0.0f, R > 3 ? x[i + 3] : 0.0f);
        for (int64_t c = 0; c < n; c += 32) {
            __mmask32 m = mask32(n - c);
            __m512i a = _mm512_maskz_loadu_epi16(m, rp[0] + c), b = _mm512_maskz_loadu_epi16(R > 1 ? m : 0, rp[1] + c);
            __m512i e = _mm512_maskz_loadu_epi16(R > 2 ? m : 0, rp[2] + c), f = _mm512_maskz_loadu_epi16(R > 3 ? m : 0, rp[3] + c);
            __m512 lo = _mm512_loadu_ps(acc + c), hi = _mm512_loadu_ps(acc + c + 16);
            lo = _mm512_dpbf16_ps(lo, (__m512bh)_mm512_unpacklo_epi16(a, b), xp0);
            hi = _mm512_dpbf16_ps(hi, (__m512bh)_mm512_unpackhi_epi16(a, b), xp0);
            lo = _mm512_dpbf16_ps(lo, (__m512bh)_mm512_unpacklo_epi16(e, f), xp1);
            hi = _mm512_dpbf16_ps(hi, (__m512bh)_mm512_unpackhi_epi16(e, f), xp1);
            _mm512_storeu_ps(acc + c, lo);
            _mm512_storeu_ps(acc + c + 16, hi);
        }
    }
    for (int64_t c = 0; c < n; c += 32) {           /* back in column order */
        __m512 lo = _mm512_loadu_ps(acc + c), hi = _mm512_loadu_ps(acc + c + 16);
        __m512 t0 = _mm512_shuffle_f32x4(lo, hi, 0x44), t1 = _mm512_shuffle_f32x4(lo, hi, 0xee);
        _mm512_mask_storeu_ps(y + c, tail16(n - c), _mm512_shuffle_f32x4(t0, t0, 0xd8));
        _mm512_mask_storeu_ps(y + c + 16, tail16(n - c - 16), _mm512_shuffle_f32x4(t1, t1, 0xd8));
    }
}

/* ---- the avx512 level's table entries ------------------------------------------------------------ */
typedef void (*gemv_fn)(const cpumla_weight *, const float *, float *, int64_t, int64_t);
typedef void (*gemm_fn)(const cpumla_weight *, const float *, int64_t, int64_t, float *, int64_t, int64_t, int64_t);
typedef void (*gemv_t_fn)(const cpumla_weight *, int64_t, int64_t, const float *, float *, int64_t, int64_t);
static gemv_fn prev_gemv;         /* the avx512f entries: every format but BF16 and E4M3 */
static gemm_fn prev_gemm;
static gemv_t_fn prev_gemv_t;

static void gemv_up(const cpumla_weight *w, const float *x, float *y, int64_t r0, int64_t r1) {
    if (w->dtype == CPUMLA_BF16) cpumla_avx512_gemv_bf16(w, x, y, r0, r1);
    else if (w->dtype == CPUMLA_E4M3) cpumla_avx512_gemv_e4m3(w, x, y, r0, r1);
    else prev_gemv(w, x, y, r0, r1);
}

static void gemm_up(const cpumla_weight *w, const float *x, int64_t ldx, int64_t n, float *y, int64_t ldy,
                    int64_t r0, int64_t r1) {
    if ((w->dtype != CPUMLA_BF16 && w->dtype != CPUMLA_E4M3) || w->cols <= 0) {
        prev_gemm(w, x, ldx, n, y, ldy, r0, r1);
    } else if (n < 4) {           /* decoding a panel costs more than reading the rows n times */
        for (int64_t t = 0; t < n; t++) gemv_up(w, x + t * ldx, y + t * ldy, r0, r1);
    } else if (w->dtype == CPUMLA_BF16) {
        cpumla_avx512_gemm_bf16(w, x, ldx, n, y, ldy, r0, r1);
    } else {
        cpumla_avx512_gemm_e4m3(w, x, ldx, n, y, ldy, r0, r1);
    }
}

static void gemv_t_up(const cpumla_weight *w, int64_t r0, int64_t nr, const float *x, float *y, int64_t c0,
                      int64_t c1) {
    if (w->dtype == CPUMLA_BF16) cpumla_avx512_gemv_t_bf16(w, r0, nr, x, y, c0, c1);
    else prev_gemv_t(w, r0, nr, x, y, c0, c1);
}

/* The dot_loop probe for vdpbf16ps: 2 x 16 multiply-adds per instruction. */
static double dot_loop_bf16(int64_t iters, float *sink) {
    __m512 a[12];
    for (int i = 0; i < 12; i++) a[i] = _mm512_set1_ps(0.1f * (float)i);
    const __m512bh w = (__m512bh)_mm512_set1_epi16(0x3f80), x = (__m512bh)_mm512_set1_epi16(0x3380);  /* 1, 2^-24 */
    for (int64_t it = 0; it < iters; it++) {
        UNROLL for (int i = 0; i < 12; i++) a[i] = _mm512_dpbf16_ps(a[i], w, x);
    }
    __m512 s = a[0];
    for (int i = 1; i < 12; i++) s = _mm512_add_ps(s, a[i]);
    *sink += _mm512_reduce_add_ps(s);
    return 2.0 * 12.0 * 32.0 * (double)iters;
}

void cpumla_fill_avx512(cpumla_kernels *k) {
    cpumla_avx512_e4m3_tables();
    if (k->gemv != gemv_up) prev_gemv = k->gemv;
    if (k->gemm != gemm_up) prev_gemm = k->gemm;
    if (k->gemv_t != gemv_t_up) prev_gemv_t = k->gemv_t;
    k->gemv = gemv_up;
    k->gemm = gemm_up;
    k->gemm_xb = cpumla_avx512_gemm_xb;
    k->gemv_t = gemv_t_up;
    k->dot_loop = dot_loop_bf16;
    k->who[K_GEMV] = k->who[K_GEMM] = k->who[K_GEMV_T] = k->who[K_DOT] = "avx512";
    k->who_fmt[K_GEMV][CPUMLA_BF16] = k->who_fmt[K_GEMV][CPUMLA_E4M3] = "avx512";
    k->who_fmt[K_GEMM][CPUMLA_BF16] = k->who_fmt[K_GEMM][CPUMLA_E4M3] = "avx512";
    k->who_fmt[K_GEMV_T][CPUMLA_BF16] = "avx512";
}
