/* avx512_e4m3.c: the avx512 level's E4M3-weight gemv and gemm: the codes decoded to bf16 with VBMI's
 * vpermi2b and multiplied with vdpbf16ps like BF16 weights (avx512_dpbf16.h's microkernel), against
 * activations bf16(x * block scale) made once per row block (kernels.h). Compiled with avx512.c's
 * flags; avx512.c's entries call these (avx512_common.h) and cpumla_fill_avx512 builds the decode
 * tables. */
#include <immintrin.h>
#include <stdint.h>
#include "core/common.h"
#include "core/kernels.h"
#include "kernels/x86/avx512_common.h"
#include "kernels/x86/avx512_dpbf16.h"

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
