/* avx512.c: the avx512 level, AVX-512 F/BW/VL/DQ + BF16 + VNNI + VBMI (Zen 4, Sapphire Rapids and
 * later), on top of the avx512vnni level (avx512vnni_q.c's integer products) and so of avx512f
 * (avx512f.c, avx512f_rows.c, avx512f_gemm.c): products on AVX512-BF16 dot products
 * (vdpbf16ps): BF16-weight gemv, gemm and gemv_t, and E4M3-weight gemv and gemm (codes decoded to bf16
 * with VBMI's vpermi2b; see the E4M3 section below). Every other format and kernel is handed to the
 * avx512f entries this level's fill replaces.
 *
 * vdpbf16ps acc, w, x adds w[2i] * x[2i] + w[2i+1] * x[2i+1] to fp32 lane i: 32 multiply-adds per
 * instruction, twice an fp32 FMA's 16. A 64-byte load of a bf16 weight row is 32 columns, which is
 * already that operand's layout, so the weights are read as stored: no panel is decoded or packed.
 * The activations are converted once per call (per K chunk for gemm) into a per-thread scratch
 * buffer (cpumla_scratch) with
 * vcvtne2ps2bf16, which rounds to nearest even: the rounding kernels.h specifies for every ISA. A
 * product of two bf16 is exact in fp32; bf16 subnormal inputs are read as zero (far below anything a
 * weight or activation holds), and the sums round as fp32 FMAs do.
 *
 * gemv (bf16 and E4M3): one row at a time, so a thread's range of rows is one sequential stream,
 * with a software prefetch a fixed distance ahead of it, as the integer GEMVs do: it is bound by
 * memory bandwidth, and one stream a thread keeps the memory system busier than 4 rows at a time.
 * gemm: K in chunks of BG_KC columns, rows in panels of BG_MP (a panel's chunk, 256 KiB, stays in
 * L2 while the token blocks pass over it); each block of 6 tokens (24 KiB of bf16 activations, L1)
 * goes through a 4-row x 6-token microkernel that keeps 24 accumulators in zmm registers and reduces
 * them once per chunk. Activations come converted
 * (gemm_xb, from ops.c, once per call) or are converted here per chunk (gemm). Long K chunks amortise
 * the microkernel's reduction; the panel height keeps a chunk within L2.
 */
#include <immintrin.h>
#include <stdint.h>
#include "core/common.h"
#include "core/kernels.h"
#include "core/dispatch.h"
#include "kernels/x86/avx512_common.h"

const char cpumla_flags_avx512[] = CPUMLA_FLAGS;

#define BG_KC 2048    /* gemm: columns per chunk (a multiple of 32) */
#define BG_MP 64      /* gemm: rows per panel (a multiple of 4) */
#define BG_NT 6       /* gemm: tokens per microkernel */

/* lanes [0, n) of 32 (bf16 elements), as tail16 */
INLINE __mmask32 mask32(int64_t n) { return n >= 32 ? 0xffffffffu : n <= 0 ? 0 : (__mmask32)((1u << n) - 1u); }

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

INLINE __m512bh ld_bh(const uint16_t *p) { return (__m512bh)_mm512_loadu_si512(p); }
INLINE __m512bh ld_bh_tail(const uint16_t *p, int64_t n) { return (__m512bh)_mm512_maskz_loadu_epi16(mask32(n), p); }

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

/* ---- gemm --------------------------------------------------------------------------------------- */
/* y[t*ldy + i] (+)= sum_{k < kc} rp[i][k] * xb[t*ldb + k] for i < mr, t < NT; xb is zero past kc
 * (up to the next multiple of 32), the rows are read with a mask there. rp[i] for i >= mr may repeat
 * a valid row: those sums are not stored. */
INLINE void gemm_micro(const uint16_t *const rp[4], const uint16_t *xb, int64_t ldb, int64_t kc, float *y,
                       int64_t ldy, int mr, int NT, int accumulate) {
    __m512 acc[BG_NT][4];
    UNROLL for (int t = 0; t < NT; t++)
        UNROLL for (int i = 0; i < 4; i++) acc[t][i] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= kc; k += 32) {
        __m512bh wv[4];
        UNROLL for (int i = 0; i < 4; i++) wv[i] = ld_bh(rp[i] + k);
        UNROLL for (int t = 0; t < NT; t++) {
            __m512bh xv = ld_bh(xb + t * ldb + k);
            UNROLL for (int i = 0; i < 4; i++) acc[t][i] = _mm512_dpbf16_ps(acc[t][i], wv[i], xv);
        }
    }
    if (k < kc) {
        __m512bh wv[4];
        UNROLL for (int i = 0; i < 4; i++) wv[i] = ld_bh_tail(rp[i] + k, kc - k);
        UNROLL for (int t = 0; t < NT; t++) {
            __m512bh xv = ld_bh(xb + t * ldb + k);
            UNROLL for (int i = 0; i < 4; i++) acc[t][i] = _mm512_dpbf16_ps(acc[t][i], wv[i], xv);
        }
    }
    __mmask8 m = (__mmask8)((1u << mr) - 1u);
    UNROLL for (int t = 0; t < NT; t++) {
        __m128 s = hsum4(acc[t][0], acc[t][1], acc[t][2], acc[t][3]);
        if (accumulate) s = _mm_add_ps(s, _mm_maskz_loadu_ps(m, y + t * ldy));
        _mm_mask_storeu_ps(y + t * ldy, m, s);
    }
}

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

/* ---- E4M3 weights --------------------------------------------------------------------------------
 * kernels.h: an E4M3 product is code * bf16(x * block scale), summed in fp32. Every e4m3 code is
 * exact in bf16, subnormals and NaN included, so the weights are decoded to bf16 and multiplied with
 * vdpbf16ps like BF16 weights. Decoding 64 codes: two vpermi2b over 128-entry tables give the high
 * and low byte of the bf16 of each code's magnitude (any bit trick maps e4m3 subnormals to bf16
 * subnormals, which vdpbf16ps reads as zero); the sign is or'ed into the high byte and unpacking the
 * bytes gives 2 x 32 bf16 in the order of PERM below. The activations are converted once per row
 * block (block_rows rows share a scale per column block) into bf16 in that same order, scale
 * folded in, so a row's dot is 2 vdpbf16ps per 64 codes with nothing applied per block.
 *
 * PERM, within each 64 columns: unpacklo/hi of bytes work per 128-bit lane, so word 8L + j of the
 * first vector is column 16L + j and word 8L + j of the second is column 16L + 8 + j (L < 4, j < 8).
 * Columns past K are zero codes in the weight (masked loads) and zero in x. */
static uint8_t e4_hi[128], e4_lo[128];      /* bytes of bf16(e4m3 value of c), c < 128 */

void cpumla_avx512_e4m3_tables(void) {
    for (int c = 0; c < 128; c++) {
        uint16_t h = f32_to_bf16(e4m3_to_f32((uint8_t)c));   /* exact; 0x7f -> NaN */
        e4_hi[c] = (uint8_t)(h >> 8);
        e4_lo[c] = (uint8_t)h;
    }
}

typedef struct { __m512i h0, h1, l0, l1; } e4_tab;

INLINE e4_tab e4_load(void) {
    e4_tab t = {_mm512_loadu_si512(e4_hi), _mm512_loadu_si512(e4_hi + 64), _mm512_loadu_si512(e4_lo),
                _mm512_loadu_si512(e4_lo + 64)};
    return t;
}

INLINE __mmask64 mask64(int64_t n) { return n >= 64 ? ~(__mmask64)0 : n <= 0 ? 0 : ((__mmask64)1 << n) - 1; }

/* 64 codes -> two vectors of 32 bf16, in PERM order */
INLINE void e4_decode(const e4_tab *t, __m512i d, __m512bh *w0, __m512bh *w1) {
    __m512i hi = _mm512_permutex2var_epi8(t->h0, d, t->h1);       /* index: the code's low 7 bits */
    __m512i lo = _mm512_permutex2var_epi8(t->l0, d, t->l1);
    hi = _mm512_ternarylogic_epi32(hi, d, _mm512_set1_epi8((char)0x80), 0xf8);   /* hi | (d & 0x80) */
    *w0 = (__m512bh)_mm512_unpacklo_epi8(lo, hi);
    *w1 = (__m512bh)_mm512_unpackhi_epi8(lo, hi);
}

/* the scales of columns [c, c + 16) for row r (0 past K, where x is 0 too) */
INLINE __m512 scale16(const cpumla_weight *w, int64_t r, int64_t c, int64_t K) {
    int64_t last = min64(c + 15, K - 1);
    if (c > last) return _mm512_setzero_ps();
    if (c / w->block_cols == last / w->block_cols) return _mm512_set1_ps(weight_scale(w, r, c));
    float s[16];
    for (int64_t i = 0; i < 16; i++) s[i] = c + i <= last ? weight_scale(w, r, c + i) : 0.0f;
    return _mm512_loadu_ps(s);
}

/* xs[t*ldb + PERM(k)] = bf16(x[t*ldx + k] * scale(r, k)) for k < K, 0 up to ldb (a multiple of 64).
 * This runs before a row block's weights stream (decode: once per 128 rows), so the scales are
 * walked with a counter rather than found by two divisions per 16 columns. */
static void e4_act(const cpumla_weight *w, int64_t r, const float *x, int64_t ldx, int64_t n, uint16_t *xs,
                   int64_t ldb) {
    const int64_t K = w->cols, bc = w->block_cols;
    const int simple = bc % 16 == 0;
    const int64_t si = (r / w->block_rows) * w->scale_ld;   /* the row block's first scale */
    int64_t b = 0, rem = 0;               /* (simple blocks) the block of column c and c's offset in it */
    for (int64_t c = 0; c < ldb; c += 64) {
        __m512 s[4];
        UNROLL for (int i = 0; i < 4; i++) {
            int64_t cc = c + 16 * i;
            if (!simple || cc >= K) {
                s[i] = scale16(w, r, cc, K);
            } else {                      /* 16 columns inside one block */
                s[i] = _mm512_set1_ps(scale_elem(w, si + b));
                rem += 16;
                if (rem == bc) { rem = 0; b++; }
            }
        }
        for (int64_t t = 0; t < n; t++) {
            __m512 v[4];
            UNROLL for (int i = 0; i < 4; i++)
                v[i] = _mm512_mul_ps(_mm512_maskz_loadu_ps(tail16(K - c - 16 * i), x + t * ldx + c + 16 * i), s[i]);
            __m512 a = _mm512_shuffle_f32x4(v[0], v[1], 0x44), b = _mm512_shuffle_f32x4(v[2], v[3], 0x44);
            __m512 e = _mm512_shuffle_f32x4(v[0], v[1], 0xee), f = _mm512_shuffle_f32x4(v[2], v[3], 0xee);
            _mm512_storeu_si512(xs + t * ldb + c, (__m512i)_mm512_cvtne2ps_pbh(b, a));
            _mm512_storeu_si512(xs + t * ldb + c + 32, (__m512i)_mm512_cvtne2ps_pbh(f, e));
        }
    }
}

/* y = row r . xs, the row read in order 128 codes a step, prefetched GEMV_PF_DIST_E4M3(l2) ahead (l2:
 * the target, common.h cpumla_pf_l2) */
INLINE float e4_gemv_row(const cpumla_weight *w, const e4_tab *tab, const uint16_t *xs, int64_t r, int l2) {
    const uint8_t *rp = weight_row(w, r);
    __m512 a[4];
    UNROLL for (int j = 0; j < 4; j++) a[j] = _mm512_setzero_ps();
    int64_t K = w->cols, c = 0;
    for (; c + 128 <= K; c += 128) {
        GEMV_PF_LINE((const char *)rp + c + GEMV_PF_DIST_E4M3(l2), GEMV_PF_DIST_E4M3(l2), l2);
        GEMV_PF_LINE((const char *)rp + c + 64 + GEMV_PF_DIST_E4M3(l2), GEMV_PF_DIST_E4M3(l2), l2);
        __m512i d0 = _mm512_loadu_si512(rp + c), d1 = _mm512_loadu_si512(rp + c + 64);
        __asm__("" : "+v"(d0), "+v"(d1));   /* one load of each line, not one per use: vpermi2b
                                             * clobbers its index, and gcc reloaded the line for each lookup */
        __m512bh w[4];
        e4_decode(tab, d0, &w[0], &w[1]);
        e4_decode(tab, d1, &w[2], &w[3]);
        UNROLL for (int j = 0; j < 4; j++) a[j] = _mm512_dpbf16_ps(a[j], w[j], ld_bh(xs + c + 32 * j));
    }
    for (; c < K; c += 64) {                   /* the last, partial columns: masked loads */
        __m512bh w0, w1;
        e4_decode(tab, _mm512_maskz_loadu_epi8(mask64(K - c), rp + c), &w0, &w1);
        a[0] = _mm512_dpbf16_ps(a[0], w0, ld_bh(xs + c));
        a[1] = _mm512_dpbf16_ps(a[1], w1, ld_bh(xs + c + 32));
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a[0], a[1]), _mm512_add_ps(a[2], a[3])));
}

void cpumla_avx512_gemv_e4m3(const cpumla_weight *w, const float *x, float *y, int64_t r0, int64_t r1) {
    int64_t Kp = (w->cols + 63) & ~(int64_t)63;
    uint16_t *xs = cpumla_scratch(CPUMLA_SCRATCH_AVX512_E4_XS, sizeof(uint16_t) * (size_t)Kp);
    if (!xs) return;
    e4_tab tab = e4_load();
    for (int64_t b0 = r0; b0 < r1;) {                /* one row block (one activation) at a time */
        int64_t b1 = min64((b0 / w->block_rows + 1) * w->block_rows, r1);
        e4_act(w, b0, x, 0, 1, xs, Kp);
        GEMV_PF_CASES(cpumla_pf_l2, for (int64_t r = b0; r < b1; r++) y[r - r0] = e4_gemv_row(w, &tab, xs, r, L2));
        b0 = b1;
    }
}

/* gemm: per row block, the tokens' activations (in chunks of up to E4_ACT_BYTES) are converted once;
 * then for each panel of BG_MP rows and BG_KC columns the codes are decoded to bf16 (PERM order) into
 * a per-thread panel, and the BF16 microkernel runs over it. While it does, the next panel's codes
 * are prefetched into L2, a few lines per microkernel call: decoding a panel straight from memory
 * would stall on every line. */
#define E4_ACT_BYTES (2 << 20)

typedef struct { const cpumla_weight *w; int64_t r, r1, c0, c1, c, per; } e4_pf;   /* lines to come */

/* rows [q0, q1), columns [k0, k0 + kc) (within K), spread over `calls` microkernel calls */
static e4_pf e4_pf_panel(const cpumla_weight *w, int64_t q0, int64_t q1, int64_t k0, int64_t kc, int64_t calls) {
    int64_t c1 = min64(k0 + kc, w->cols), lines = (q1 - q0) * ((c1 - k0 + 63) / 64);
    e4_pf p = {w, q0, c1 > k0 ? q1 : q0, k0, c1, k0, (lines + calls - 1) / max64(calls, 1)};
    return p;
}

INLINE void e4_pf_some(e4_pf *p) {
    for (int64_t i = 0; i < p->per && p->r < p->r1; i++) {
        _mm_prefetch((const char *)weight_row(p->w, p->r) + p->c, _MM_HINT_T1);
        p->c += 64;
        if (p->c >= p->c1) { p->c = p->c0; p->r++; }
    }
}

void cpumla_avx512_gemm_e4m3(const cpumla_weight *w, const float *x, int64_t ldx, int64_t n, float *y,
                             int64_t ldy, int64_t r0, int64_t r1) {
    int64_t K = w->cols, Kp = (K + 63) & ~(int64_t)63;
    int64_t ntc = min64(n, max64(BG_NT, E4_ACT_BYTES / (2 * Kp)));
    uint16_t *xs = cpumla_scratch(CPUMLA_SCRATCH_AVX512_E4_XS, sizeof(uint16_t) * (size_t)(ntc * Kp));
    uint16_t *panel = cpumla_scratch(CPUMLA_SCRATCH_AVX512_E4_PANEL, sizeof(uint16_t) * (size_t)(BG_MP * BG_KC));
    if (!xs || !panel) return;
    e4_tab tab = e4_load();
    for (int64_t b0 = r0; b0 < r1;) {
        int64_t b1 = min64((b0 / w->block_rows + 1) * w->block_rows, r1);
        for (int64_t t0 = 0; t0 < n; t0 += ntc) {
            int64_t nt = min64(ntc, n - t0);
            e4_act(w, b0, x + t0 * ldx, ldx, nt, xs, Kp);
            for (int64_t p0 = b0; p0 < b1; p0 += BG_MP) {
                int64_t p1 = min64(p0 + BG_MP, b1);
                for (int64_t k0 = 0; k0 < Kp; k0 += BG_KC) {
                    int64_t kc = min64(BG_KC, Kp - k0);
                    for (int64_t r = p0; r < p1; r++) {
                        const uint8_t *src = weight_row(w, r) + k0;
                        uint16_t *dst = panel + (r - p0) * BG_KC;
                        int64_t c = 0, full = min64(kc, K - k0) & ~(int64_t)63;
                        for (; c < kc; c += 64) {           /* masked loads only past K */
                            __m512i d = c < full ? _mm512_loadu_si512(src + c)
                                                 : _mm512_maskz_loadu_epi8(mask64(K - k0 - c), src + c);
                            __m512bh w0, w1;
                            e4_decode(&tab, d, &w0, &w1);
                            _mm512_storeu_si512(dst + c, (__m512i)w0);
                            _mm512_storeu_si512(dst + c + 32, (__m512i)w1);
                        }
                    }
                    /* the panel after this one: the next columns, rows, token chunk or row block */
                    int64_t calls = (nt + BG_NT - 1) / BG_NT * ((p1 - p0 + 3) / 4), nb1 = min64(b1 + w->block_rows, r1);
                    e4_pf pf = k0 + BG_KC < Kp ? e4_pf_panel(w, p0, p1, k0 + BG_KC, BG_KC, calls)
                               : p1 < b1 ? e4_pf_panel(w, p1, min64(p1 + BG_MP, b1), 0, BG_KC, calls)
                               : t0 + ntc < n ? e4_pf_panel(w, b0, min64(b0 + BG_MP, b1), 0, BG_KC, calls)
                               : e4_pf_panel(w, b1, min64(b1 + BG_MP, nb1), 0, BG_KC, calls);
                    for (int64_t tt = 0; tt < nt; tt += BG_NT) {
                        int ntt = (int)min64(BG_NT, nt - tt);
                        const uint16_t *xt = xs + tt * Kp + k0;
                        for (int64_t i0 = p0; i0 < p1; i0 += 4) {
                            int mr = (int)min64(4, p1 - i0);
                            e4_pf_some(&pf);
                            const uint16_t *rp[4];
                            UNROLL for (int i = 0; i < 4; i++) rp[i] = panel + (i0 - p0 + (i < mr ? i : 0)) * BG_KC;
                            float *yt = y + (t0 + tt) * ldy + (i0 - r0);
#define MICRO(NT) gemm_micro(rp, xt, Kp, kc, yt, ldy, mr, NT, k0 > 0)
                            SWITCH_NT(ntt, MICRO)
#undef MICRO
                        }
                    }
                }
            }
        }
        b0 = b1;
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

/* E4M3: the bf16 codes e4_decode gives (exact values, all normal in bf16: vdpbf16ps would read a
 * subnormal as zero); E2M1 is the avx512f level's. */
int cpumla_decode_operands_avx512(int dtype, float *out) {
    if (dtype != CPUMLA_E4M3) return cpumla_decode_operands_avx512f(dtype, out);
    cpumla_avx512_e4m3_tables();
    e4_tab tab = e4_load();
    uint8_t codes[256];
    for (int i = 0; i < 256; i++) codes[i] = (uint8_t)i;
    for (int g = 0; g < 4; g++) {
        __m512bh w0, w1;
        e4_decode(&tab, _mm512_loadu_si512(codes + 64 * g), &w0, &w1);
        uint16_t h[64];
        _mm512_storeu_si512(h, (__m512i)w0);
        _mm512_storeu_si512(h + 32, (__m512i)w1);
        for (int v = 0; v < 2; v++)           /* PERM: word 8L + j of vector v is column 16L + 8v + j */
            for (int L = 0; L < 4; L++)
                for (int j = 0; j < 8; j++) out[64 * g + 16 * L + 8 * v + j] = bf16_to_f32(h[32 * v + 8 * L + j]);
    }
    return 0;
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
