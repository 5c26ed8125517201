/* avx512f_gemm.c: the avx512f level's gemm (prefill), AVX-512 F/BW/VL/DQ only, compiled with
 * avx512f.c's flags; cpumla_fill_avx512f calls cpumla_fill_avx512f_gemm. Same semantics as scalar.c
 * (the spec), to fp32 rounding.
 *
 * A blocked GEMM: K in chunks of G_KC columns and tokens in chunks of at most G_TC. For each chunk the
 * activation operands are made once (BF16: bf16(x); E4M3: bf16(x * block scale * 2^8) of the row
 * block, kernels.h; F32 / F16: x copied) into this thread's CPUMLA_SCRATCH_AVX512F_XR buffer (no
 * buffer: nothing computed, the call fails; E2M1 goes to the entry below, as the gemv does). Then
 * each panel of G_MR = 32 weight rows is decoded and transposed into [k][32] (the packing step: fp32 with all widening and scaling done, or
 * for E4M3 the fp16 bits of value * 2^-8, which the microkernel widens with vcvtph2ps as it loads
 * them; either way no fp32 subnormal reaches a multiply), and a register-tiled microkernel runs over
 * it: G_MT tokens x 32 rows, 2 * G_MT zmm accumulators, each k one pair of weight loads and one
 * broadcast per token. The panel chunk (32 KiB, E4M3 16 KiB) is read from L1 by every token group;
 * the operands of a token chunk (at most G_TC * G_KC * 4 = 256 KiB) stay in L2. The last token group
 * of a panel prefetches the weight lines of the panel packed next (pf_plan).
 * Single-threaded: ops.c splits rows (and tokens) over the pool. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#include "core/common.h"
#include "core/kernels.h"
#include "kernels/x86/avx512_common.h"
#include "core/quant.h"
#include "kernels/x86/x86_bytes.h"

#define G_MR 32     /* weight rows per panel: two zmm */
#define G_MT 14     /* tokens per microkernel: 28 accumulators + 2 weight registers + a broadcast */
#define G_KC 256    /* columns per chunk (a multiple of 16): the panel chunk is 32 KiB */
#define G_TC 256    /* most tokens per chunk (bounds the operand buffer) */
#define G_RB 256    /* rows at a time (E4M3: a row block): the y tile of a token chunk stays in L2 */
#define G_MIN_N 4   /* fewer tokens: gemv per token (packing a panel costs more than reading rows n times) */

static __thread float g_pack[G_KC * G_MR] __attribute__((aligned(64)));   /* [k][32] fp32, or fp16 (pack_panel) */

/* the avx512f gemv (for n < G_MIN_N) */
static void (*g_gemv)(const cpumla_weight *, const float *, float *, int64_t, int64_t);


/* ---- activation operands (kernels.h) ------------------------------------------------------------ */

/* dst[t*ldd + k] = bf16(src[t*lds + k] * s(k)) for k < kc, zero up to the next multiple of 16, with
 * s(k) = 1 (BF16) or scale(r, c0 + k) * 2^8 (E4M3: the operand of row r's block times the decode's
 * 2^8, which is bf16(x * scale) * 2^8 exactly); other formats: x copied. Token by token: the rows of
 * x lie a multiple of 4 KiB apart in a model, and 16 columns of every token at a time missed L1 on
 * every load; the copy G_KC floats apart keeps the microkernel's token rows off one cache set too. */
static void make_operands(const cpumla_weight *w, int64_t r, const float *src, int64_t lds, int64_t n,
                          int64_t c0, int64_t kc, float *dst, int64_t ldd) {
    float sv[G_KC] __attribute__((aligned(64)));
    const int e4 = w->dtype == CPUMLA_E4M3;
    for (int64_t k = 0; k < kc; k += 16) {
        const int64_t c = c0 + k, last = c0 + min64(k + 15, kc - 1);
        if (!e4) {
            _mm512_store_ps(sv + k, _mm512_set1_ps(1.0f));
        } else if (c / w->block_cols == last / w->block_cols) {
            _mm512_store_ps(sv + k, _mm512_set1_ps(weight_scale(w, r, c) * 256.0f));
        } else {                                      /* a block edge inside these 16 columns */
            for (int64_t i = 0; i < 16; i++) sv[k + i] = c + i <= last ? weight_scale(w, r, c + i) * 256.0f : 0.0f;
        }
    }
    const int round = w->dtype == CPUMLA_BF16 || e4;
    for (int64_t t = 0; t < n; t++) {
        if (t + 2 < n)            /* a token's columns are a short run that the prefetchers pick up late */
            for (int64_t k = 0; k < kc; k += 16) _mm_prefetch((const char *)(src + (t + 2) * lds + k), _MM_HINT_T0);
        const float *s = src + t * lds;
        float *d = dst + t * ldd;
        int64_t k = 0;
        if (round) {
            for (; k + 16 <= kc; k += 16) bf16_mul16(s + k, _mm512_load_ps(sv + k), 0xffff, d + k);
            if (k < kc) bf16_mul16(s + k, _mm512_load_ps(sv + k), tail16(kc - k), d + k);
        } else {
            for (; k < kc; k += 16) _mm512_store_ps(d + k, _mm512_maskz_loadu_ps(tail16(kc - k), s + k));
        }
    }
}

/* ---- packing ------------------------------------------------------------------------------------ */
/* columns [c, c + nc) (nc <= 16) of row r as fp32, the panel's operand: BF16 / F16 / F32 exact, E4M3
 * codes as value * 2^-8 (the scale is in the activation); lanes >= nc: 0. (E2M1 never comes here.) */
INLINE __m512 panel_cols(const cpumla_weight *w, int32_t dt, int64_t r, int64_t c, int64_t nc) {
    return dq16(dt, weight_row(w, r), c, nc < 16 ? nc : 16);
}

/* 16x16 transpose in registers: o[j] = element j of every r[i] (lane i) */
INLINE void tr16(const __m512 r[16], __m512 o[16]) {
    __m512 t[16], u[16];
    UNROLL for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    UNROLL for (int i = 0; i < 16; i += 4) {
        u[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44);
        u[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xee);
        u[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        u[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xee);
    }
    /* u[4g + q] holds, in each 128-bit lane L, element 4L + q of r[4g..4g+3] */
    UNROLL for (int q = 0; q < 4; q++) {
        __m512 a = _mm512_shuffle_f32x4(u[q], u[4 + q], 0x88), b = _mm512_shuffle_f32x4(u[q], u[4 + q], 0xdd);
        __m512 c = _mm512_shuffle_f32x4(u[8 + q], u[12 + q], 0x88), d = _mm512_shuffle_f32x4(u[8 + q], u[12 + q], 0xdd);
        o[q] = _mm512_shuffle_f32x4(a, c, 0x88);
        o[q + 8] = _mm512_shuffle_f32x4(a, c, 0xdd);
        o[q + 4] = _mm512_shuffle_f32x4(b, d, 0x88);
        o[q + 12] = _mm512_shuffle_f32x4(b, d, 0xdd);
    }
}

/* BF16, 16 full rows x 32 columns: the 16x16 transpose moves column pairs (one dword each), then
 * each pair splits into its two fp32 columns: half the shuffles of transposing fp32 */
INLINE void pack_bf16_16x32(const cpumla_weight *w, int64_t r, int64_t c, float *out) {
    __m512 v[16], o[16];
    UNROLL for (int i = 0; i < 16; i++) v[i] = _mm512_loadu_ps((const uint16_t *)weight_row(w, r + i) + c);
    tr16(v, o);
    const __m512i hi = _mm512_set1_epi32((int)0xffff0000u);
    UNROLL for (int j = 0; j < 16; j++) {
        __m512i d = _mm512_castps_si512(o[j]);
        _mm512_store_ps(out + (2 * j) * G_MR, _mm512_castsi512_ps(_mm512_slli_epi32(d, 16)));
        _mm512_store_ps(out + (2 * j + 1) * G_MR, _mm512_castsi512_ps(_mm512_and_si512(d, hi)));
    }
}

/* E4M3 into the fp16 panel, 16 full rows x 64 columns: the transpose moves groups of 4 codes (one
 * dword); a byte shuffle and a dword permute gather in 128-bit lane p the 16 rows' codes of column
 * 4j + p, which widen 32 at a time to the fp16 bits of value * 2^-8 (e4m3_h32; e4m3 subnormals are
 * fp16 subnormals, which vcvtph2ps makes normal fp32). Returns 0 when a NaN code was seen (the
 * caller redoes the block through dq16, which decodes it to NaN). */
INLINE int pack_e4m3_16x64(const cpumla_weight *w, int64_t r, int64_t c, uint16_t *out) {
    __m512 v[16], o[16];
    __m512i lo7 = _mm512_setzero_si512();
    UNROLL for (int i = 0; i < 16; i++) {
        __m512i b = _mm512_loadu_si512(weight_row(w, r + i) + c);
        lo7 = _mm512_max_epu8(lo7, _mm512_and_si512(b, _mm512_set1_epi8(0x7f)));
        v[i] = _mm512_castsi512_ps(b);
    }
    tr16(v, o);
    /* in each 128-bit lane, dword p <- byte p of its 4 dwords; then lane p <- dword p of every lane */
    const __m512i bytes = _mm512_set4_epi32(0x0f0b0703, 0x0e0a0602, 0x0d090501, 0x0c080400);
    const __m512i lanes = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    UNROLL for (int j = 0; j < 16; j++) {
        __m512i d = _mm512_permutexvar_epi32(lanes, _mm512_shuffle_epi8(_mm512_castps_si512(o[j]), bytes));
        __m512i h01 = e4m3_h32(_mm512_castsi512_si256(d)), h23 = e4m3_h32(_mm512_extracti64x4_epi64(d, 1));
        _mm256_store_si256((__m256i *)(out + (4 * j) * G_MR), _mm512_castsi512_si256(h01));
        _mm256_store_si256((__m256i *)(out + (4 * j + 1) * G_MR), _mm512_extracti64x4_epi64(h01, 1));
        _mm256_store_si256((__m256i *)(out + (4 * j + 2) * G_MR), _mm512_castsi512_si256(h23));
        _mm256_store_si256((__m256i *)(out + (4 * j + 3) * G_MR), _mm512_extracti64x4_epi64(h23, 1));
    }
    return _mm512_cmpeq_epi8_mask(lo7, _mm512_set1_epi8(0x7f)) == 0;
}

/* rows r..r+15 (zero rows from nr on), columns [c, c + 16) (zero columns past c1) through dq16: into
 * the fp32 panel at out, or (half) the fp16 one (E4M3: value * 2^-8 is exact in fp16, NaN stays NaN) */
INLINE void pack_16x16(const cpumla_weight *w, int64_t r, int nr, int64_t c, int64_t c1, void *out, int half) {
    __m512 v[16], o[16];
    const int32_t dt = w->dtype;
    for (int i = 0; i < 16; i++) v[i] = i < nr ? panel_cols(w, dt, r + i, c, c1 - c) : _mm512_setzero_ps();
    tr16(v, o);
    UNROLL for (int j = 0; j < 16; j++) {
        if (half)
            _mm256_store_si256((__m256i *)((uint16_t *)out + j * G_MR),
                               _mm512_cvtps_ph(o[j], _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        else
            _mm512_store_ps((float *)out + j * G_MR, o[j]);
    }
}

/* The panel of rows [r, r + nr) (zero rows past nr), columns [k0, k0 + kc) rounded up to 16 (zero
 * columns past kc), in g_pack: [k][32] fp32 operands (BF16, F32, F16), or (E4M3) [k][32] fp16
 * bits of the codes' value * 2^-8, which the microkernel widens as it loads them: half the stores
 * here, and half the panel's room in L1 */
static void pack_panel(const cpumla_weight *w, int64_t r, int nr, int64_t k0, int64_t kc) {
    uint16_t *p16 = w->dtype == CPUMLA_E4M3 ? (uint16_t *)g_pack : NULL;
    for (int h = 0; h < G_MR; h += 16) {
        const int hr = nr - h;
        int64_t k = 0;
        if (hr >= 16 && w->dtype == CPUMLA_BF16)
            for (; k + 32 <= kc; k += 32) pack_bf16_16x32(w, r + h, k0 + k, g_pack + k * G_MR + h);
        if (hr >= 16 && p16)
            for (; k + 64 <= kc; k += 64)
                if (!pack_e4m3_16x64(w, r + h, k0 + k, p16 + k * G_MR + h))
                    for (int64_t j = k; j < k + 64; j += 16)
                        pack_16x16(w, r + h, 16, k0 + j, k0 + kc, p16 + j * G_MR + h, 1);
        for (; k < kc; k += 16)
            pack_16x16(w, r + h, hr, k0 + k, k0 + kc,
                       p16 ? (void *)(p16 + k * G_MR + h) : (void *)(g_pack + k * G_MR + h), p16 != NULL);
    }
}

/* ---- microkernel -------------------------------------------------------------------------------- */
/* The weight lines of the panel packed next, prefetched while this one is multiplied: the panel's rows
 * are short runs (256 columns) a row apart, too short for the hardware prefetchers, and the packing
 * otherwise waits on each of them from memory. Line j of the plan is line j >> 5 of row j & 31. */
typedef struct {
    const char *base;       /* the first row's first byte, or NULL: nothing to prefetch */
    int64_t row_bytes;
    int64_t lines;          /* 32 * lines per row */
    int rows;               /* rows of that panel (1..32); rows past it repeat its last */
} pf_plan;

INLINE void pf_line(const pf_plan *pp, int64_t j) {
    const int64_t i = min64(j & 31, pp->rows - 1);
    _mm_prefetch(pp->base + i * pp->row_bytes + (j >> 5) * 64, _MM_HINT_T0);
}

/* y[t*ldy + i] (+)= sum_k x[t*G_KC + k] * wp[k*32 + i] for t < NT, lanes of m0 / m1 (rows 0-15 / 16-31);
 * H: wp is the fp16 panel (E4M3), widened here (vcvtph2ps runs beside the FMAs).
 * The operands' fixed stride addresses every token from one register (no spills in the loop).
 * The next tile's y rows (pf, ldy apart) are prefetched first: when accumulating they come back
 * from L3 (y of a long token chunk outgrows L2), and the accumulators cannot start before them.
 * pp (or NULL): one weight line of the next panel per k. */
INLINE void micro(const int NT, const int H, const float *wp, int64_t kc, const float *x, float *y,
                  int64_t ldy, __mmask16 m0, __mmask16 m1, int accumulate, const float *pf, const pf_plan *pp) {
    __m512 a[G_MT], b[G_MT];
    if (pf)
        UNROLL for (int t = 0; t < G_MT; t++) {
            _mm_prefetch((const char *)(pf + t * ldy), _MM_HINT_T0);
            _mm_prefetch((const char *)(pf + t * ldy + 16), _MM_HINT_T0);
        }
    UNROLL for (int t = 0; t < NT; t++) {
        a[t] = accumulate ? _mm512_maskz_loadu_ps(m0, y + t * ldy) : _mm512_setzero_ps();
        b[t] = accumulate ? _mm512_maskz_loadu_ps(m1, y + t * ldy + 16) : _mm512_setzero_ps();
    }
    const int64_t kp = pp ? min64(kc, pp->lines) : 0;
#define MICRO_STEP                                                                                       \
    {                                                                                                    \
        __m512 w0 = H ? _mm512_cvtph_ps(_mm256_load_si256((const __m256i *)((const uint16_t *)wp + k * G_MR))) \
                      : _mm512_load_ps(wp + k * G_MR);                                                   \
        __m512 w1 = H ? _mm512_cvtph_ps(_mm256_load_si256((const __m256i *)((const uint16_t *)wp + k * G_MR + 16))) \
                      : _mm512_load_ps(wp + k * G_MR + 16);                                              \
        UNROLL for (int t = 0; t < NT; t++) {                                                            \
            __m512 s = _mm512_set1_ps(x[t * G_KC + k]);                                                  \
            a[t] = _mm512_fmadd_ps(s, w0, a[t]);                                                         \
            b[t] = _mm512_fmadd_ps(s, w1, b[t]);                                                         \
        }                                                                                                \
    }
    int64_t k = 0;
    for (; k < kp; k++) {
        pf_line(pp, k);
        MICRO_STEP
    }
    for (; k < kc; k++) MICRO_STEP
#undef MICRO_STEP
    UNROLL for (int t = 0; t < NT; t++) {
        _mm512_mask_storeu_ps(y + t * ldy, m0, a[t]);
        _mm512_mask_storeu_ps(y + t * ldy + 16, m1, b[t]);
    }
}

/* one out-of-line instance per token count, so that each gets the whole register file */
typedef void (*micro_fn)(const float *, int64_t, const float *, float *, int64_t, __mmask16, __mmask16,
                         int, const float *, const pf_plan *);
#define MICRO(N)                                                                                         \
    __attribute__((noinline)) static void micro##N(const float *wp, int64_t kc, const float *x,              \
                                                   float *y, int64_t ldy, __mmask16 m0, __mmask16 m1, int acc, \
                                                   const float *pf, const pf_plan *pp) {                \
        micro(N, 0, wp, kc, x, y, ldy, m0, m1, acc, pf, pp);                                             \
    }                                                                                                    \
    __attribute__((noinline)) static void microh##N(const float *wp, int64_t kc, const float *x,             \
                                                    float *y, int64_t ldy, __mmask16 m0, __mmask16 m1, int acc, \
                                                    const float *pf, const pf_plan *pp) {               \
        micro(N, 1, wp, kc, x, y, ldy, m0, m1, acc, pf, pp);                                             \
    }
MICRO(1) MICRO(2) MICRO(3) MICRO(4) MICRO(5) MICRO(6) MICRO(7) MICRO(8) MICRO(9) MICRO(10) MICRO(11) MICRO(12)
MICRO(13) MICRO(14)
#undef MICRO
static const micro_fn micros[2][G_MT + 1] = {
    {NULL, micro1, micro2, micro3, micro4, micro5, micro6, micro7, micro8, micro9, micro10, micro11, micro12,
     micro13, micro14},
    {NULL, microh1, microh2, microh3, microh4, microh5, microh6, microh7, microh8, microh9, microh10, microh11,
     microh12, microh13, microh14}};

/* tokens [0, nt) of a chunk against the packed panel, G_MT at a time; the last group prefetches pp
 * (earlier, the operands of the later groups would push those lines out of L1 before the packing) */
static void panel_tokens(const float *x, int64_t nt, int64_t kc, float *y, int64_t ldy, int nr,
                         int accumulate, const pf_plan *pp, int half) {
    const __mmask16 m0 = tail16(nr), m1 = tail16(nr - 16);
    for (int64_t t = 0; t < nt; t += G_MT) {
        const int64_t c = min64(G_MT, nt - t);
        const float *pf = accumulate && t + G_MT < nt ? y + (t + G_MT) * ldy : NULL;
        micros[half][c](g_pack, kc, x + t * G_KC, y + t * ldy, ldy, m0, m1, accumulate, pf,
                        t + G_MT >= nt && pp->base ? pp : NULL);
    }
}

/* the gemm below this level's: E2M1 goes there (1x32 E8M0 blocks never arrive: kern_gemm takes them
 * to the integer product; other layouts the spec's fp32 product, as gemv) */
static void (*g_prev)(const cpumla_weight *, const float *, int64_t, int64_t, float *, int64_t, int64_t, int64_t);

/* the plan for the panel of rows [p, min(p + 32, r1)), columns [k0, k0 + kc) (none when p >= r1) */
static pf_plan plan_panel(const cpumla_weight *w, int64_t p, int64_t r1, int64_t k0, int64_t kc) {
    static const int bits[5] = {32, 16, 16, 8, 4};
    pf_plan pp = {NULL, w->row_bytes, 0, 1};
    if (p >= r1 || w->dtype < 0 || w->dtype > CPUMLA_E2M1) return pp;
    const int64_t b0 = k0 * bits[w->dtype] / 8, b1 = ((k0 + kc) * bits[w->dtype] + 7) / 8;
    pp.base = (const char *)weight_row(w, p) + (b0 & ~(int64_t)63);
    pp.lines = 32 * ((b1 - (b0 & ~(int64_t)63) + 63) / 64);
    pp.rows = (int)min64(G_MR, r1 - p);
    return pp;
}

static void gemm_avx512f(const cpumla_weight *w, const float *x, int64_t ldx, int64_t n, float *y, int64_t ldy,
                         int64_t r0, int64_t r1) {
    if (n <= 0 || r1 <= r0) return;
    if (w->dtype == CPUMLA_E2M1) { g_prev(w, x, ldx, n, y, ldy, r0, r1); return; }     /* as gemv does */
    if (n < G_MIN_N) {
        for (int64_t t = 0; t < n; t++) g_gemv(w, x + t * ldx, y + t * ldy, r0, r1);
        return;
    }
    const int64_t K = w->cols;
    if (K <= 0) {
        for (int64_t t = 0; t < n; t++) memset(y + t * ldy, 0, sizeof(float) * (size_t)(r1 - r0));
        return;
    }
    const int e4 = w->dtype == CPUMLA_E4M3;
    if (e4 && (w->block_rows <= 0 || w->block_cols <= 0)) {
        for (int64_t t = 0; t < n; t++) for (int64_t r = r0; r < r1; r++) y[t * ldy + (r - r0)] = NAN;
        return;
    }
    /* token chunks: the fewest of at most G_TC, as even as multiples of G_MT allow */
    const int64_t nch = (n + G_TC - 1) / G_TC;
    const int64_t tc = min64(n, ((n + nch - 1) / nch + G_MT - 1) / G_MT * G_MT);
    /* the operands of a token and K chunk, [tc][G_KC] */
    float *xr = cpumla_scratch(CPUMLA_SCRATCH_AVX512F_XR, sizeof(float) * (size_t)(tc * G_KC));
    if (!xr) return;             /* out of memory: the call fails */
    for (int64_t rs = r0; rs < r1;) {                /* E4M3: one row block at a time */
        const int64_t re = e4 ? min64((rs / w->block_rows + 1) * w->block_rows, r1) : min64(rs + G_RB, r1);
        for (int64_t t0 = 0; t0 < n; t0 += tc) {
            const int64_t nt = min64(tc, n - t0);
            for (int64_t k0 = 0; k0 < K; k0 += G_KC) {
                const int64_t kc = min64(G_KC, K - k0);
                make_operands(w, rs, x + t0 * ldx + k0, ldx, nt, k0, kc, xr, G_KC);
                for (int64_t p = rs; p < re; p += G_MR) {
                    const int nr = (int)min64(G_MR, re - p);
                    /* the panel after this one: the next of the row block, else the next K chunk's
                     * first, else the next token chunk's or row block's first */
                    int64_t np = p + G_MR, nk = k0;
                    if (np >= re) {
                        np = rs;
                        nk = k0 + G_KC;
                        if (nk >= K) {
                            nk = 0;
                            if (t0 + nt >= n) np = re;
                        }
                    }
                    const pf_plan pp = plan_panel(w, np, r1, nk, min64(G_KC, K - nk));
                    pack_panel(w, p, nr, k0, kc);
                    panel_tokens(xr, nt, kc, y + t0 * ldy + (p - r0), ldy, nr, k0 > 0, &pp, e4);
                }
            }
        }
        rs = re;
    }
}

/* ---- E2M1 of 1x32 E8M0 blocks: the integer product on fp32 FMAs (kernels.h's gemm_fp4) ------------
 * As avx2_gemm.c's: the activation codes (|q| <= 32512) and w2 (|w2| <= 12) are exact in fp32, and so
 * are every product and partial sum of a block (< 2^24), so the FMAs give each block's integer sum
 * exactly; each block then adds (float)sum * (wd * xd), both products rounded, to its row's total in
 * block order: scalar_q.c's result bit for bit. Panels: w2 as fp32 [k][32] in g_pack and the chunk's
 * scales wd [block][32] (zero rows: wd 0); operands: codes [t][G_KC] and xd [t][F_NB]. */
#define F_NB (G_KC / 32)    /* blocks per K chunk */
static __thread float f_wd[F_NB * G_MR] __attribute__((aligned(64)));

/* rows [r, r + nr) (zero rows past nr), columns [k0, k0 + kc) (kc a multiple of 32): w2 into g_pack
 * [k][32], wd into f_wd. Each block's 16 x 16 code bytes (per half panel) are transposed first, so
 * that one byte vector holds a column pair of 16 rows (low nibbles column 2k, high nibbles 2k + 1). */
static void fp4_pack(const cpumla_weight *w, int64_t r, int nr, int64_t k0, int64_t kc) {
    for (int h = 0; h < G_MR; h += 16)
        for (int64_t b = 0; b < kc / 32; b++) {
            __m128i v[16], o[16];
            fp4_block_rows(w, r + h, nr - h, k0 / 32 + b, v, f_wd + b * G_MR + h);
            tr16x16_bytes(v, o);
            float *out = g_pack + 32 * b * G_MR + h;
            UNROLL for (int k = 0; k < 16; k++) {
                __m128i lo, hi;
                e2m1_w2_bytes(o[k], &lo, &hi);
                _mm512_store_ps(out + (2 * k) * G_MR, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(lo)));
                _mm512_store_ps(out + (2 * k + 1) * G_MR, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(hi)));
            }
        }
}

/* the codes and xd of columns [k0, k0 + kc) of n tokens (quant.h's q_act_block: amax over the block,
 * id = 32512 / amax, codes nearest_even(x * id), xd = amax / 32512; zero below QACT_TINY) */
static void fp4_operands(const float *x, int64_t ldx, int64_t n, int64_t k0, int64_t kc, float *codes, float *xd) {
    for (int64_t t = 0; t < n; t++)
        for (int64_t b = 0; b < kc / 32; b++) {
            const float *xb = x + t * ldx + k0 + 32 * b;
            __m512 v0 = _mm512_loadu_ps(xb), v1 = _mm512_loadu_ps(xb + 16);
            const float amax = amax32_avx512(v0, v1);
            const float id = qact_id(amax, QACT_MAX16);
            xd[t * F_NB + b] = qact_xd(amax, QACT_MAX16);
            if (q_nonfinite(amax)) v0 = v1 = _mm512_setzero_ps();      /* codes 0 */
            const __m512 vid = _mm512_set1_ps(id);
            float *c = codes + t * G_KC + 32 * b;
            _mm512_store_ps(c, _mm512_cvtepi32_ps(_mm512_cvtps_epi32(_mm512_mul_ps(v0, vid))));
            _mm512_store_ps(c + 16, _mm512_cvtepi32_ps(_mm512_cvtps_epi32(_mm512_mul_ps(v1, vid))));
        }
}

/* total += (float)sum * (wd * xd), each product rounded (never fused into the add) */
INLINE __m512 fp4_add(__m512 total, __m512 sum, __m512 wd, __m512 xd) {
    __m512 f = _mm512_mul_ps(wd, xd);
    __asm__("" : "+v"(f));
    __m512 p = _mm512_mul_ps(sum, f);
    __asm__("" : "+v"(p));
    return _mm512_add_ps(total, p);
}

/* y[t*ldy + i] = (first ? 0 : y[t*ldy + i]) + the chunk's blocks in order, t < NT, lanes of m0 / m1:
 * 2 * NT accumulators per block, the totals in memory between blocks */
INLINE void micro_fp4(const int NT, const float *wp, const float *wd, int64_t nb, const float *x, const float *xd,
                      float *y, int64_t ldy, __mmask16 m0, __mmask16 m1, int first) {
    float tot[G_MT][G_MR] __attribute__((aligned(64)));
    UNROLL for (int t = 0; t < NT; t++) {
        _mm512_store_ps(tot[t], first ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(m0, y + t * ldy));
        _mm512_store_ps(tot[t] + 16, first ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(m1, y + t * ldy + 16));
    }
    for (int64_t b = 0; b < nb; b++) {
        __m512 a[G_MT], c[G_MT];
        UNROLL for (int t = 0; t < NT; t++) a[t] = c[t] = _mm512_setzero_ps();
        for (int64_t k = 32 * b; k < 32 * b + 32; k++) {
            const __m512 w0 = _mm512_load_ps(wp + k * G_MR), w1 = _mm512_load_ps(wp + k * G_MR + 16);
            UNROLL for (int t = 0; t < NT; t++) {
                const __m512 s = _mm512_set1_ps(x[t * G_KC + k]);
                a[t] = _mm512_fmadd_ps(s, w0, a[t]);
                c[t] = _mm512_fmadd_ps(s, w1, c[t]);
            }
        }
        const __m512 d0 = _mm512_load_ps(wd + b * G_MR), d1 = _mm512_load_ps(wd + b * G_MR + 16);
        UNROLL for (int t = 0; t < NT; t++) {
            const __m512 v = _mm512_set1_ps(xd[t * F_NB + b]);
            _mm512_store_ps(tot[t], fp4_add(_mm512_load_ps(tot[t]), a[t], d0, v));
            _mm512_store_ps(tot[t] + 16, fp4_add(_mm512_load_ps(tot[t] + 16), c[t], d1, v));
        }
        __asm__("" : : "r"(tot) : "memory");     /* keep the totals in memory, the accumulators in registers */
    }
    UNROLL for (int t = 0; t < NT; t++) {
        _mm512_mask_storeu_ps(y + t * ldy, m0, _mm512_load_ps(tot[t]));
        _mm512_mask_storeu_ps(y + t * ldy + 16, m1, _mm512_load_ps(tot[t] + 16));
    }
}

typedef void (*micro_fp4_fn)(const float *, const float *, int64_t, const float *, const float *, float *, int64_t,
                             __mmask16, __mmask16, int);
#define MICRO_FP4(N)                                                                                     \
    __attribute__((noinline)) static void micro_fp4_##N(const float *wp, const float *wd, int64_t nb,     \
                                                        const float *x, const float *xd, float *y,      \
                                                        int64_t ldy, __mmask16 m0, __mmask16 m1, int first) { \
        micro_fp4(N, wp, wd, nb, x, xd, y, ldy, m0, m1, first);                                           \
    }
MICRO_FP4(1) MICRO_FP4(2) MICRO_FP4(3) MICRO_FP4(4) MICRO_FP4(5) MICRO_FP4(6) MICRO_FP4(7) MICRO_FP4(8)
MICRO_FP4(9) MICRO_FP4(10) MICRO_FP4(11) MICRO_FP4(12) MICRO_FP4(13) MICRO_FP4(14)
#undef MICRO_FP4
static const micro_fp4_fn micros_fp4[G_MT + 1] = {
    NULL, micro_fp4_1, micro_fp4_2, micro_fp4_3, micro_fp4_4, micro_fp4_5, micro_fp4_6, micro_fp4_7, micro_fp4_8,
    micro_fp4_9, micro_fp4_10, micro_fp4_11, micro_fp4_12, micro_fp4_13, micro_fp4_14};

static void gemm_fp4_avx512f(const cpumla_weight *w, const float *x, int64_t ldx, int64_t n, float *y,
                             int64_t ldy, int64_t r0, int64_t r1) {
    if (n <= 0 || r1 <= r0) return;
    const int64_t K = w->cols;
    const int64_t nch = (n + G_TC - 1) / G_TC;
    const int64_t tc = min64(n, ((n + nch - 1) / nch + G_MT - 1) / G_MT * G_MT);
    float *codes = cpumla_scratch(CPUMLA_SCRATCH_AVX512F_XR, sizeof(float) * (size_t)(tc * (G_KC + F_NB)));
    if (!codes) return;             /* out of memory: the call fails */
    float *xd = codes + tc * G_KC;
    for (int64_t rs = r0; rs < r1; rs = min64(rs + G_RB, r1)) {
        const int64_t re = min64(rs + G_RB, r1);
        for (int64_t t0 = 0; t0 < n; t0 += tc) {
            const int64_t nt = min64(tc, n - t0);
            for (int64_t k0 = 0; k0 < K; k0 += G_KC) {
                const int64_t kc = min64(G_KC, K - k0);
                fp4_operands(x + t0 * ldx, ldx, nt, k0, kc, codes, xd);
                for (int64_t p = rs; p < re; p += G_MR) {
                    const int nr = (int)min64(G_MR, re - p);
                    fp4_pack(w, p, nr, k0, kc);
                    /* the fewest tiles of at most G_MT tokens, as even as they come (16 tokens: 8 + 8) */
                    const int64_t tiles = (nt + G_MT - 1) / G_MT;
                    for (int64_t i = 0, t = 0; i < tiles; i++) {
                        const int64_t m = (nt - t) / (tiles - i);
                        micros_fp4[m](g_pack, f_wd, kc / 32, codes + t * G_KC, xd + t * F_NB,
                                      y + (t0 + t) * ldy + (p - r0), ldy, tail16(nr), tail16(nr - 16), k0 == 0);
                        t += m;
                    }
                }
            }
        }
    }
}

void cpumla_fill_avx512f_gemm(cpumla_kernels *k) {
    g_gemv = k->gemv;
    if (k->gemm != gemm_avx512f) g_prev = k->gemm;
    k->gemm = gemm_avx512f;
    k->gemm_fp4 = gemm_fp4_avx512f;
    k->gemm_fp4_min_n = FP4_FMA_MIN_AVX512F;
}
