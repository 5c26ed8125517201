/* avx2_gemm.c: the AVX2 + FMA + F16C gemm (prefill): K in chunks of GM_KC columns; for each chunk,
 * 16-row panels of the weights are decoded to fp32 (dequant_row, in avx2.c; E4M3: the codes without
 * their scale, e4m3_codes) and transposed into [k][16] (tr8x8_store), then a 6-token x 16-row FMA
 * microkernel runs over them. Its activation operand is x itself, x rounded to bf16 (BF16 weights),
 * or, for E4M3, bf16(x * scale) of the panel's row block (kernels.h): E4M3 panels never straddle a
 * row block, and the operands are made once per row block, K chunk and chunk of at most GM_TC tokens
 * (which bounds the buffer). Split from avx2.c, whose cpumla_fill_avx2 calls cpumla_fill_avx2_gemm;
 * compiled with the same flags. Same semantics as scalar.c (the spec), to fp32 rounding.
 * Single-threaded: ops.c splits rows and tokens. */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include "common.h"
#include "kernels.h"
#include "avx2_common.h"

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

INLINE void tr8x8_store(const float *src, int64_t lds, float *dst, int64_t ldd) {
    __m256 r0 = _mm256_load_ps(src), r1 = _mm256_load_ps(src + lds), r2 = _mm256_load_ps(src + 2 * lds);
    __m256 r3 = _mm256_load_ps(src + 3 * lds), r4 = _mm256_load_ps(src + 4 * lds);
    __m256 r5 = _mm256_load_ps(src + 5 * lds), r6 = _mm256_load_ps(src + 6 * lds);
    __m256 r7 = _mm256_load_ps(src + 7 * lds);
    __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1);
    __m256 t2 = _mm256_unpacklo_ps(r2, r3), t3 = _mm256_unpackhi_ps(r2, r3);
    __m256 t4 = _mm256_unpacklo_ps(r4, r5), t5 = _mm256_unpackhi_ps(r4, r5);
    __m256 t6 = _mm256_unpacklo_ps(r6, r7), t7 = _mm256_unpackhi_ps(r6, r7);
    __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xee);
    __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xee);
    __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xee);
    __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xee);
    _mm256_store_ps(dst + 0 * ldd, _mm256_permute2f128_ps(u0, u4, 0x20));
    _mm256_store_ps(dst + 1 * ldd, _mm256_permute2f128_ps(u1, u5, 0x20));
    _mm256_store_ps(dst + 2 * ldd, _mm256_permute2f128_ps(u2, u6, 0x20));
    _mm256_store_ps(dst + 3 * ldd, _mm256_permute2f128_ps(u3, u7, 0x20));
    _mm256_store_ps(dst + 4 * ldd, _mm256_permute2f128_ps(u0, u4, 0x31));
    _mm256_store_ps(dst + 5 * ldd, _mm256_permute2f128_ps(u1, u5, 0x31));
    _mm256_store_ps(dst + 6 * ldd, _mm256_permute2f128_ps(u2, u6, 0x31));
    _mm256_store_ps(dst + 7 * ldd, _mm256_permute2f128_ps(u3, u7, 0x31));
}

/* out[c - c0] = the value of E4M3 code row[c], without the scale, c0 <= c < c1 (NaN codes give NaN) */
static void e4m3_codes(const uint8_t *row, int64_t c0, int64_t c1, float *out) {
    const __m256 k = _mm256_set1_ps(256.0f);          /* ld_e4m3x8 gives value * 2^-8 */
    int64_t c = c0;
    for (; c + 8 <= c1; c += 8) _mm256_storeu_ps(out + c - c0, _mm256_mul_ps(ld_e4m3x8(row + c), k));
    for (; c < c1; c++) out[c - c0] = e4m3_to_f32(row[c]);
}

/* gm_pack[k][i] = W[r + i, k0 + k] for i < nr (zero rows above), k < kpad (zero columns past kc); E4M3:
 * the codes' values, without the scale */
static void gemm_pack(const cpumla_weight *w, int64_t r, int nr, int64_t k0, int64_t kc) {
    const int64_t kpad = (kc + 7) & ~(int64_t)7;
    for (int i = 0; i < GM_NR; i++) {
        float *t = gm_tmp + i * GM_KC;
        if (i < nr) {
            if (w->dtype == CPUMLA_E4M3) e4m3_codes(weight_row(w, r + i), k0, k0 + kc, t);
            else cpumla_avx2_dequant_row(w, r + i, k0, k0 + kc, t);
            for (int64_t k = kc; k < kpad; k++) t[k] = 0.0f;
        } else {
            memset(t, 0, (size_t)kpad * sizeof(float));
        }
    }
    for (int64_t k = 0; k < kpad; k += 8) {
        tr8x8_store(gm_tmp + k, GM_KC, gm_pack + k * GM_NR, GM_NR);
        tr8x8_store(gm_tmp + 8 * GM_KC + k, GM_KC, gm_pack + k * GM_NR + 8, GM_NR);
    }
}

/* Y[t, 0..nr) (+)= sum_k X[t, k] pack[k][0..nr) for t < nt (nt <= 6; missing tokens repeat the last
 * one and are not stored). Twelve named accumulators so that nothing spills. */
static void gemm_micro(int nt, const float *wp, int64_t kc, const float *x, int64_t ldx, float *y,
                       int64_t ldy, int nr, int accumulate) {
    const float *x0 = x, *x1 = x + (nt > 1 ? 1 : 0) * ldx, *x2 = x + (nt > 2 ? 2 : nt - 1) * ldx;
    const float *x3 = x + (nt > 3 ? 3 : nt - 1) * ldx, *x4 = x + (nt > 4 ? 4 : nt - 1) * ldx;
    const float *x5 = x + (nt > 5 ? 5 : nt - 1) * ldx;
    __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00;
    __m256 c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
    for (int64_t k = 0; k < kc; k++) {
        __m256 w0 = _mm256_load_ps(wp + k * GM_NR), w1 = _mm256_load_ps(wp + k * GM_NR + 8), b;
        b = _mm256_broadcast_ss(x0 + k); c00 = _mm256_fmadd_ps(b, w0, c00); c01 = _mm256_fmadd_ps(b, w1, c01);
        b = _mm256_broadcast_ss(x1 + k); c10 = _mm256_fmadd_ps(b, w0, c10); c11 = _mm256_fmadd_ps(b, w1, c11);
        b = _mm256_broadcast_ss(x2 + k); c20 = _mm256_fmadd_ps(b, w0, c20); c21 = _mm256_fmadd_ps(b, w1, c21);
        b = _mm256_broadcast_ss(x3 + k); c30 = _mm256_fmadd_ps(b, w0, c30); c31 = _mm256_fmadd_ps(b, w1, c31);
        b = _mm256_broadcast_ss(x4 + k); c40 = _mm256_fmadd_ps(b, w0, c40); c41 = _mm256_fmadd_ps(b, w1, c41);
        b = _mm256_broadcast_ss(x5 + k); c50 = _mm256_fmadd_ps(b, w0, c50); c51 = _mm256_fmadd_ps(b, w1, c51);
    }
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
    if (n == 1) { cpumla_avx2_gemv(w, x, y, r0, r1); return; }
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
                    for (int64_t t = 0; t < nt; t++) e4m3_act_row(w, rs, xt + t * ldx, k0, k0 + kc, xr + t * GM_KC, 1.0f);
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

void cpumla_fill_avx2_gemm(cpumla_kernels *k) {
    if (k->gemm != gemm_avx2) prev_gemm = k->gemm;
    k->gemm = gemm_avx2;
}
