/* avx512f.c: the avx512f level, AVX-512 F/BW/VL/DQ only (Skylake-SP, Cascade Lake, Ice Lake and every
 * later AVX-512 CPU; compiled with just those flags, FLAGS). Same semantics as scalar.c (the
 * spec), to fp32 rounding: every product is accumulated in fp32 and the weights are decoded exactly.
 * The avx512 level (avx512.c) sits on top of this one (through avx512vnni) and replaces the BF16 and
 * E4M3 linear algebra with vdpbf16ps; everything else it leaves to this level.
 *
 * Generic weight decoding, 16 columns at a time into fp32 (dq16; used by gemv, gemv_t, the gemm panel,
 * dequant_row; E2M1 by gemv_t and dequant_row only), with a power of two folded into the block scale:
 *   BF16: shift left 16.                    F16: vcvtph2ps.
 *   E4M3: fp16 bits ((b & 0x7f) << 7) | (b & 0x80) << 8 are exactly value * 2^-8, built as
 *         (sign_extend(b) << 7) & 0xbfff; vcvtph2ps widens them to fp32 (the fp16 subnormals, e4m3's
 *         own, come out as normal fp32: the smallest nonzero operand is 2^-17). 0x7f / 0xff decode to
 *         NaN as in the spec.
 *   E2M1: a 16-entry byte table gives the high byte of the fp16 of value * 2^-14 (low byte is 0).
 * BF16 and E4M3 products follow kernels.h: BF16 weights multiply bf16(x), E4M3 codes multiply
 * bf16(x * block scale); those operands are made once per call (per row block for E4M3, per K chunk
 * for gemm) into this thread's CPUMLA_SCRATCH_AVX512F_XR buffer (no buffer: nothing computed, the
 * call fails). E4M3's operand is made as bf16(x * (scale * 2^8)), which is bf16(x * scale) * 2^8
 * exactly, so the code operand value * 2^-8 times it is the spec's product, and no multiply sees a
 * subnormal weight operand.
 * gemv has its own streaming loops per format (4 rows at a time with software prefetch). E2M1 gemv and
 * gemm go back to the entries below (kernels.h: kern_gemv takes 1x32 E8M0 blocks to the integer
 * product, the other layouts go to the spec's fp32 one); gemv_t folds FP4 block scales, and E4M3's
 * (kernels.h), into the activation.
 * The fold factors assume |scale| < 2^113 (scale * 2^14 must not overflow).
 *
 * This file holds the linear algebra (gemv, gemv_t, dequant_row); the level's gemm is in
 * avx512f_gemm.c, its row-wise and attention kernels in avx512f_rows.c, its integer products in
 * avx512f_q.c and avx512f_fp4.c, its sampler's passes in avx512f_sample.c: cpumla_fill_avx512f sets
 * them all. Shared helpers: avx512_common.h.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#include "core/common.h"
#include "core/kernels.h"
#include "core/sample.h"
#include "kernels/x86/avx512_common.h"

const char cpumla_flags_avx512f[] = CPUMLA_FLAGS;


/* ---- weight decoding ---------------------------------------------------------------------------- */
static const float dq_fold[5] = {1.0f, 1.0f, 1.0f, 256.0f, 16384.0f};   /* by dtype */

INLINE int blocked(const cpumla_weight *w) { return w->dtype == CPUMLA_E4M3 || w->dtype == CPUMLA_E2M1; }

/* Scale of block (r, c), times the decode's fold factor. */
INLINE float blk_scale(const cpumla_weight *w, int64_t r, int64_t c) {
    return weight_scale(w, r, c) * dq_fold[w->dtype];
}

/* out[c - c0] = W[r, c] (scale included) for c0 <= c < c1; the fp32 twin of weight_at. */
static void dq_range(const cpumla_weight *w, int64_t r, int64_t c0, int64_t c1, float *out) {
    const uint8_t *row = weight_row(w, r);
    int32_t dt = w->dtype;
    if (!blocked(w)) {
        int64_t c = c0;
        /* whole vectors of the 16-bit formats without the per-vector switch and masks: this loop is
         * most of cpumla_quantize's time from a BF16 / F16 checkpoint */
        if (dt == CPUMLA_BF16)
            for (; c + 16 <= c1; c += 16) {
                __m512i h = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)row + c)));
                _mm512_storeu_ps(out + (c - c0), _mm512_castsi512_ps(_mm512_slli_epi32(h, 16)));
            }
        else if (dt == CPUMLA_F16)
            for (; c + 16 <= c1; c += 16)
                _mm512_storeu_ps(out + (c - c0),
                                 _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)row + c))));
        for (; c < c1; c += 16)
            _mm512_mask_storeu_ps(out + (c - c0), tail16(c1 - c), dq16(dt, row, c, c1 - c));
        return;
    }
    for (int64_t b0 = c0; b0 < c1;) {
        int64_t b1 = min64((b0 / w->block_cols + 1) * w->block_cols, c1);
        __m512 s = _mm512_set1_ps(blk_scale(w, r, b0));
        for (int64_t c = b0; c < b1; c += 16)
            _mm512_mask_storeu_ps(out + (c - c0), tail16(b1 - c), _mm512_mul_ps(dq16(dt, row, c, b1 - c), s));
        b0 = b1;
    }
}

static void dequant_row_avx512(const cpumla_weight *w, int64_t r, int64_t c0, int64_t c1, float *out) {
    dq_range(w, r, c0, c1, out);
}

/* ---- gemv --------------------------------------------------------------------------------------- */
/* R rows (1..4) at once so each x load serves all of them; one block at a time (the whole row when
 * unblocked), two partial sums per row per block for latency. F16 / BF16 run it one row at a time
 * (R = 1, pf GEMV_PF_BYTES, common.h's GEMV_PF_LINE with the target l2): the rows of a range are then
 * one sequential stream with a software prefetch ahead of it, which the memory system serves better
 * than groups of 4 rows. */
INLINE void gemv_rows(const cpumla_weight *w, const float *x, float *y, int64_t r, int R, int32_t dt,
                      int64_t pf, int l2) {
    const uint8_t *rp[4];
    __m512 acc[4];
    UNROLL for (int i = 0; i < R; i++) { rp[i] = weight_row(w, r + i); acc[i] = _mm512_setzero_ps(); }
    int64_t cols = w->cols, bc = dt == CPUMLA_E4M3 || dt == CPUMLA_E2M1 ? w->block_cols : cols;
    for (int64_t b0 = 0; b0 < cols; b0 += bc) {
        int64_t b1 = min64(b0 + bc, cols), c = b0;
        __m512 p0[4], p1[4];
        UNROLL for (int i = 0; i < R; i++) { p0[i] = _mm512_setzero_ps(); p1[i] = _mm512_setzero_ps(); }
        for (; c + 32 <= b1; c += 32) {
            __m512 x0 = _mm512_loadu_ps(x + c), x1 = _mm512_loadu_ps(x + c + 16);
            UNROLL for (int i = 0; i < R; i++) {
                if ((dt == CPUMLA_F16 || dt == CPUMLA_BF16) && pf) GEMV_PF_LINE(rp[i] + 2 * c + pf, pf, l2);
                p0[i] = _mm512_fmadd_ps(dq16(dt, rp[i], c, 16), x0, p0[i]);
                p1[i] = _mm512_fmadd_ps(dq16(dt, rp[i], c + 16, 16), x1, p1[i]);
            }
        }
        for (; c < b1; c += 16) {
            __m512 x0 = _mm512_maskz_loadu_ps(tail16(b1 - c), x + c);
            UNROLL for (int i = 0; i < R; i++) p0[i] = _mm512_fmadd_ps(dq16(dt, rp[i], c, b1 - c), x0, p0[i]);
        }
        UNROLL for (int i = 0; i < R; i++) {
            __m512 p = _mm512_add_ps(p0[i], p1[i]);
            if (bc == cols && b0 == 0) acc[i] = p;
            else acc[i] = _mm512_fmadd_ps(p, _mm512_set1_ps(blk_scale(w, r + i, b0)), acc[i]);
        }
    }
    if (bc == cols && (dt == CPUMLA_E4M3 || dt == CPUMLA_E2M1)) {   /* one block spans the row */
        UNROLL for (int i = 0; i < R; i++) acc[i] = _mm512_mul_ps(acc[i], _mm512_set1_ps(blk_scale(w, r + i, 0)));
    }
    UNROLL for (int i = 0; i < R; i++) y[i] = _mm512_reduce_add_ps(acc[i]);
}


/* 64 E4M3 bytes -> 4 x 16 fp32 (value * 2^-8), NaN bytes decoded to NaN (rare path) */
INLINE void e4m3_64(const uint8_t *p, __m512 f[4]) {
    __m512i b = _mm512_loadu_si512(p);
    __m512i h0 = e4m3_h32(_mm512_castsi512_si256(b)), h1 = e4m3_h32(_mm512_extracti64x4_epi64(b, 1));
    f[0] = _mm512_cvtph_ps(_mm512_castsi512_si256(h0));
    f[1] = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h0, 1));
    f[2] = _mm512_cvtph_ps(_mm512_castsi512_si256(h1));
    f[3] = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h1, 1));
    __mmask64 nan = _mm512_cmpeq_epi8_mask(_mm512_or_si512(b, _mm512_set1_epi8((char)0x80)), _mm512_set1_epi8(-1));
    if (__builtin_expect(nan != 0, 0))
        for (int g = 0; g < 4; g++) f[g] = _mm512_mask_mov_ps(f[g], (__mmask16)(nan >> (16 * g)), _mm512_set1_ps(NAN));
}

/* ---- activation operands (kernels.h) ------------------------------------------------------------ */

/* dst[t*ldd + k] = bf16(src[t*lds + k]) for k < K, zero up to the next multiple of 16 */
static void bf16_rows(const float *src, int64_t lds, int64_t n, int64_t K, float *dst, int64_t ldd) {
    for (int64_t t = 0; t < n; t++)
        for (int64_t k = 0; k < K; k += 16) bf16_mul16(src + t * lds + k, _mm512_set1_ps(1.0f), tail16(K - k), dst + t * ldd + k);
}

/* dst[t*ldd + k] = bf16(src[t*lds + k] * scale(r, c0 + k) * 2^8) for k < kc (zero up to the next
 * multiple of 16): the E4M3 operands of row r's block times the decode's 2^8 */
static void e4m3_acts(const cpumla_weight *w, int64_t r, const float *src, int64_t lds, int64_t n, int64_t c0,
                      int64_t kc, float *dst, int64_t ldd) {
    for (int64_t k = 0; k < kc; k += 16) {
        int64_t c = c0 + k, last = c0 + min64(k + 15, kc - 1);
        __m512 s;
        if (c / w->block_cols == last / w->block_cols) {
            s = _mm512_set1_ps(weight_scale(w, r, c) * 256.0f);
        } else {
            float sv[16];
            for (int64_t i = 0; i < 16; i++) sv[i] = c + i <= last ? weight_scale(w, r, c + i) * 256.0f : 0.0f;
            s = _mm512_loadu_ps(sv);
        }
        for (int64_t t = 0; t < n; t++) bf16_mul16(src + t * lds + k, s, tail16(kc - k), dst + t * ldd + k);
    }
}

/* ---- gemv: BF16 and E4M3 ------------------------------------------------------------------------ */
/* E4M3 rows [r, r + R) (R 1..4) against xs (operands of their row block), 64 columns per step */
INLINE void gemv_e4m3_rows(const cpumla_weight *w, const float *xs, float *y, int64_t r, int R, const uint8_t *pf,
                           int l2) {
    const uint8_t *rp[4];
    __m512 a0[4], a1[4];
    UNROLL for (int i = 0; i < R; i++) { rp[i] = weight_row(w, r + i); a0[i] = a1[i] = _mm512_setzero_ps(); }
    int64_t K = w->cols, c = 0;
    for (; c + 64 <= K; c += 64) {
        __m512 x0 = _mm512_loadu_ps(xs + c), x1 = _mm512_loadu_ps(xs + c + 16);
        __m512 x2 = _mm512_loadu_ps(xs + c + 32), x3 = _mm512_loadu_ps(xs + c + 48);
        UNROLL for (int i = 0; i < R; i++) {
            __m512 f[4];
            GEMV_PF(pf_at(pf, w, R, i, c, K), l2);
            e4m3_64(rp[i] + c, f);
            a0[i] = _mm512_fmadd_ps(f[0], x0, a0[i]);
            a1[i] = _mm512_fmadd_ps(f[1], x1, a1[i]);
            a0[i] = _mm512_fmadd_ps(f[2], x2, a0[i]);
            a1[i] = _mm512_fmadd_ps(f[3], x3, a1[i]);
        }
    }
    for (; c < K; c += 16) {
        __m512 x0 = _mm512_maskz_loadu_ps(tail16(K - c), xs + c);
        UNROLL for (int i = 0; i < R; i++) a0[i] = _mm512_fmadd_ps(dq16(CPUMLA_E4M3, rp[i], c, K - c), x0, a0[i]);
    }
    UNROLL for (int i = 0; i < R; i++) y[i] = _mm512_reduce_add_ps(_mm512_add_ps(a0[i], a1[i]));
}

static void gemv_e4m3(const cpumla_weight *w, const float *x, float *y, int64_t r0, int64_t r1) {
    float *xs = cpumla_scratch(CPUMLA_SCRATCH_AVX512F_XR, sizeof(float) * (size_t)(w->cols + 16));
    if (!xs) return;
    for (int64_t b0 = r0; b0 < r1;) {                /* one row block (one activation) at a time */
        int64_t b1 = min64((b0 / w->block_rows + 1) * w->block_rows, r1), r = b0;
        e4m3_acts(w, b0, x, 0, 1, 0, w->cols, xs, 0);
        if (cpumla_pf_l2_plain) {
            for (; r + 4 <= b1; r += 4) gemv_e4m3_rows(w, xs, y + (r - r0), r, 4, pf_rows(w, r, r1), 1);
            for (; r < b1; r++) gemv_e4m3_rows(w, xs, y + (r - r0), r, 1, pf_rows(w, r, r1), 1);
        } else {
            for (; r + 4 <= b1; r += 4) gemv_e4m3_rows(w, xs, y + (r - r0), r, 4, pf_rows(w, r, r1), 0);
            for (; r < b1; r++) gemv_e4m3_rows(w, xs, y + (r - r0), r, 1, pf_rows(w, r, r1), 0);
        }
        b0 = b1;
    }
}

static void (*prev_gemv)(const cpumla_weight *, const float *, float *, int64_t, int64_t);

static void gemv_avx512(const cpumla_weight *w, const float *x, float *y, int64_t r0, int64_t r1) {
    switch (w->dtype) {
    case CPUMLA_F32: {                                /* groups of 4 rows, no software prefetch */
        int64_t r = r0;
        for (; r + 4 <= r1; r += 4) gemv_rows(w, x, y + (r - r0), r, 4, CPUMLA_F32, 0, 0);
        for (; r < r1; r++) gemv_rows(w, x, y + (r - r0), r, 1, CPUMLA_F32, 0, 0);
        return;
    }
    case CPUMLA_BF16: {
        float *xr = cpumla_scratch(CPUMLA_SCRATCH_AVX512F_XR, sizeof(float) * (size_t)(w->cols + 16));
        if (!xr) return;                             /* out of memory: the call fails */
        bf16_rows(x, 0, 1, w->cols, xr, 0);
        GEMV_PF_CASES(cpumla_pf_l2_plain,
                      for (int64_t r = r0; r < r1; r++) gemv_rows(w, xr, y + (r - r0), r, 1, CPUMLA_BF16, GEMV_PF_BYTES, L2));
        return;
    }
    case CPUMLA_F16:
        GEMV_PF_CASES(cpumla_pf_l2_plain,
                      for (int64_t r = r0; r < r1; r++) gemv_rows(w, x, y + (r - r0), r, 1, CPUMLA_F16, GEMV_PF_BYTES, L2));
        return;
    case CPUMLA_E4M3:
        if (w->block_rows > 0 && w->block_cols > 0) { gemv_e4m3(w, x, y, r0, r1); return; }
        break;
    case CPUMLA_E2M1:       /* the integer product (kern_gemv) or, other layouts, the spec's fp32 one */
        prev_gemv(w, x, y, r0, r1);
        return;
    default:
        break;
    }
    for (int64_t r = r0; r < r1; r++) y[r - r0] = NAN;
}

/* ---- gemv_t ------------------------------------------------------------------------------------- */
/* Rows outer (the weight streams in order), 4 at a time: y[c] += sum_i (x_i * scale_i) * q_i(c). */
static void gemv_t_avx512(const cpumla_weight *w, int64_t r0, int64_t nr, const float *x, float *y,
                          int64_t c0, int64_t c1) {
    int32_t dt = w->dtype;
    int64_t bc = blocked(w) ? w->block_cols : c1 - c0;
    if (bc <= 0) bc = 1;
    for (int64_t c = c0; c < c1; c += 16) _mm512_mask_storeu_ps(y + (c - c0), tail16(c1 - c), _mm512_setzero_ps());
    for (int64_t i0 = 0; i0 < nr; i0 += 4) {
        int R = (int)min64(4, nr - i0);
        gt_prefetch(w->data, w->row_bytes, r0, i0, 4, nr, c0, c1, gt_col_bytes(dt));
        const uint8_t *rp[4];
        UNROLL for (int i = 0; i < 4; i++) rp[i] = weight_row(w, r0 + i0 + (i < R ? i : 0));
        for (int64_t b0 = c0; b0 < c1;) {
            int64_t b1 = blocked(w) ? min64((b0 / bc + 1) * bc, c1) : c1;
            __m512 xs[4];
            UNROLL for (int i = 0; i < 4; i++)      /* the activation operand (kernels.h), decode fold in */
                xs[i] = _mm512_set1_ps(i >= R ? 0.0f : dt == CPUMLA_BF16 ? bf16_round(x[i0 + i])
                                       : dt == CPUMLA_E4M3 ? e4m3_act(w, r0 + i0 + i, b0, x[i0 + i]) * dq_fold[dt]
                                       : x[i0 + i] * (blocked(w) ? blk_scale(w, r0 + i0 + i, b0) : 1.0f));
            int64_t c = b0;
            if (dt == CPUMLA_E4M3) {
                for (; c + 64 <= b1; c += 64) {      /* 64 columns per row per step */
                    float *yc = y + (c - c0);
                    __m512 y0 = _mm512_loadu_ps(yc), y1 = _mm512_loadu_ps(yc + 16);
                    __m512 y2 = _mm512_loadu_ps(yc + 32), y3 = _mm512_loadu_ps(yc + 48);
                    UNROLL for (int i = 0; i < 4; i++) {
                        if (i >= R) break;
                        __m512 f[4];
                        e4m3_64(rp[i] + c, f);
                        y0 = _mm512_fmadd_ps(f[0], xs[i], y0); y1 = _mm512_fmadd_ps(f[1], xs[i], y1);
                        y2 = _mm512_fmadd_ps(f[2], xs[i], y2); y3 = _mm512_fmadd_ps(f[3], xs[i], y3);
                    }
                    _mm512_storeu_ps(yc, y0); _mm512_storeu_ps(yc + 16, y1);
                    _mm512_storeu_ps(yc + 32, y2); _mm512_storeu_ps(yc + 48, y3);
                }
            }
            for (; c < b1; c += 16) {
                int64_t n = b1 - c;
                __mmask16 m = tail16(n);
                __m512 yv = _mm512_maskz_loadu_ps(m, y + (c - c0));
                yv = _mm512_fmadd_ps(dq16(dt, rp[0], c, n), xs[0], yv);
                if (R > 1) yv = _mm512_fmadd_ps(dq16(dt, rp[1], c, n), xs[1], yv);
                if (R > 2) yv = _mm512_fmadd_ps(dq16(dt, rp[2], c, n), xs[2], yv);
                if (R > 3) yv = _mm512_fmadd_ps(dq16(dt, rp[3], c, n), xs[3], yv);
                _mm512_mask_storeu_ps(y + (c - c0), m, yv);
            }
            b0 = b1;
        }
    }
}

/* The weight operands gemv's loops multiply (cpumla_decode_operands): E4M3 through e4m3_64 (value *
 * 2^-8). */
int cpumla_decode_operands_avx512f(int dtype, float *out) {
    if (dtype == CPUMLA_E4M3) {
        uint8_t codes[256];
        for (int i = 0; i < 256; i++) codes[i] = (uint8_t)i;
        for (int g = 0; g < 4; g++) {
            __m512 f[4];
            e4m3_64(codes + 64 * g, f);
            for (int j = 0; j < 4; j++) _mm512_storeu_ps(out + 64 * g + 16 * j, f[j]);
        }
        return 8;
    }

    return -1;
}

void cpumla_fill_avx512f(cpumla_kernels *k) {
    cpumla_fill_avx512f_rows(k);
    if (k->gemv != gemv_avx512) prev_gemv = k->gemv;
    k->gemv = gemv_avx512;
    cpumla_fill_avx512f_gemm(k);        /* avx512f_gemm.c; its small-n path calls the gemv above */
    k->gemv_t = gemv_t_avx512;
    k->dequant_row = dequant_row_avx512;
    static const int ids[] = {K_GEMV, K_GEMM, K_GEMV_T, K_DEQUANT};
    for (size_t i = 0; i < sizeof ids / sizeof ids[0]; i++) {
        k->who[ids[i]] = "avx512f";
        for (int f = 0; f <= CPUMLA_E2M1; f++) k->who_fmt[ids[i]][f] = "avx512f";    /* every format, every layout */
    }
    k->who_fmt[K_GEMV][CPUMLA_E2M1] = k->who_fmt[K_GEMM][CPUMLA_E2M1] = "scalar";     /* handed back */
    k->sample_passes = &cpumla_sample_passes_avx512f;
    cpumla_fill_avx512f_q(k);           /* avx512f_q.c, avx512f_fp4.c: the integer products */
}
