/* ref.h: test data and double-precision references for the kernel tests.
 *
 * Written from cpumla.h's definitions, independently of scalar.c / common.h, so that a bug shared by
 * the spec and its twins still shows. Weights are generated together with their exact values in
 * double (wd), so decoding is checked too. Buffers are poisoned with NaN where a kernel must not read. */
#ifndef CPUMLA_TEST_REF_H
#define CPUMLA_TEST_REF_H
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "cpumla.h"

/* ---- bookkeeping ------------------------------------------------------------------------------ */
/* the runner's bookkeeping (harness.c) */
extern int n_pass, n_fail, verbose, small_mode, watch_seconds;
extern const char *cur_isa;
int check(int ok, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void case_begin(void);
void case_end(void);
void watchdog(const char *what);   /* NULL: off */

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static inline uint64_t rng_u64(void) {
    uint64_t x = rng_state;
    x ^= x << 13; x ^= x >> 7; x ^= x << 17;
    return rng_state = x;
}
static inline double rng_unit(void) { return (double)(rng_u64() >> 11) * (1.0 / 9007199254740992.0); }
static inline float rng_sym(float a) { return (float)((2.0 * rng_unit() - 1.0) * a); }   /* [-a, a) */

static inline float fbits(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t bitsf(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

static void *xalloc(size_t bytes) {
    void *p = aligned_alloc(64, (bytes + 63) / 64 * 64 + 64);
    if (!p) { fprintf(stderr, "out of memory\n"); exit(2); }
    return p;
}

/* float buffer of n values, all quiet NaN (fill what must be read) */
static float *nan_floats(size_t n) {
    float *p = xalloc(n * sizeof(float));
    for (size_t i = 0; i < n; i++) p[i] = NAN;
    return p;
}

/* ---- independent decoders (double) ------------------------------------------------------------ */
static double ref_bf16(uint16_t h) { return (double)fbits((uint32_t)h << 16); }

static double ref_f16(uint16_t h) {
    int s = h >> 15, e = (h >> 10) & 31, m = h & 1023;
    double v = e == 0 ? ldexp(m, -24) : e == 31 ? (m ? NAN : INFINITY) : ldexp(1024 + m, e - 25);
    return s ? -v : v;
}

static double ref_e4m3(uint8_t b) {
    int s = b >> 7, e = (b >> 3) & 15, m = b & 7;
    if (e == 15 && m == 7) return NAN;
    double v = e == 0 ? ldexp(m, -9) : ldexp(8 + m, e - 10);
    return s ? -v : v;
}

static double ref_e2m1(int code) {
    static const double mag[8] = {0, 0.5, 1, 1.5, 2, 3, 4, 6};
    return (code & 8) ? -mag[code & 7] : mag[code & 7];
}

static double ref_e8m0(uint8_t b) { return b == 255 ? NAN : ldexp(1.0, b - 127); }

/* bf16 round to nearest even, by integer reasoning on the discarded half */
static uint16_t ref_to_bf16(float f) {
    uint32_t u = bitsf(f);
    uint32_t hi = u >> 16, lo = u & 0xffff;
    if (lo > 0x8000 || (lo == 0x8000 && (hi & 1))) hi++;
    return (uint16_t)hi;
}

static uint16_t ref_f16_bits(double v) {   /* v must be exactly representable, normal or zero */
    if (v == 0) return 0;
    uint16_t s = v < 0 ? 0x8000 : 0;
    int e;
    double m = frexp(fabs(v), &e);           /* v = m 2^e, m in [0.5, 1) */
    return (uint16_t)(s | ((e + 14) << 10) | ((int)(m * 2048) - 1024));
}

/* ---- weights ---------------------------------------------------------------------------------- */
static const char *dtype_name(int d) {
    static const char *n[] = {"F32", "BF16", "F16", "E4M3", "E2M1", "E8M0"};
    return d >= 0 && d <= 5 ? n[d] : "?";
}

typedef struct {
    cpumla_weight w;
    double *wd;        /* [rows, cols]: exact value of each element, scale included */
    double *qd;        /* [rows, cols]: the code's value without the scale (quantised formats) */
    float *se;         /* [rows, cols]: the scale of each element's block (quantised formats) */
    void *data, *scale;
} tweight;

/* A random weight as stored in a checkpoint. Padding after each row and the unused scale-grid column
 * are poisoned (NaN, or the FP4 code -6 in the spare nibble of an odd row, which meets x's NaN). */
static tweight make_weight(int64_t rows, int64_t cols, int dtype, int sdtype, int brows, int bcols,
                           int64_t pad_bytes) {
    tweight t;
    memset(&t, 0, sizeof t);
    int64_t rb;
    switch (dtype) {
    case CPUMLA_F32: rb = cols * 4; break;
    case CPUMLA_BF16: case CPUMLA_F16: rb = cols * 2; break;
    case CPUMLA_E4M3: rb = cols; break;
    default: rb = (cols + 1) / 2; break;
    }
    rb += pad_bytes;
    if (dtype == CPUMLA_F32) rb = (rb + 3) / 4 * 4;
    if (dtype == CPUMLA_BF16 || dtype == CPUMLA_F16) rb = (rb + 1) / 2 * 2;
    uint8_t *d = xalloc((size_t)(rows * rb) + 64);
    memset(d, 0xff, (size_t)(rows * rb) + 64);
    t.wd = xalloc(sizeof(double) * (size_t)(rows * cols + 1));
    t.qd = xalloc(sizeof(double) * (size_t)(rows * cols + 1));
    t.se = xalloc(sizeof(float) * (size_t)(rows * cols + 1));
    int quant = dtype == CPUMLA_E4M3 || dtype == CPUMLA_E2M1;
    int64_t gr = quant ? (rows + brows - 1) / brows : 0, gc = quant ? (cols + bcols - 1) / bcols : 0;
    int64_t sld = gc + 1;
    double *sv = NULL;
    if (quant) {
        sv = xalloc(sizeof(double) * (size_t)(gr * sld + 1));
        size_t esz = sdtype == CPUMLA_F32 ? 4 : 1;
        t.scale = xalloc((size_t)(gr * sld) * esz + 64);
        memset(t.scale, 0xff, (size_t)(gr * sld) * esz + 64);
        for (int64_t i = 0; i < gr; i++)
            for (int64_t j = 0; j < gc; j++) {
                if (sdtype == CPUMLA_F32) {
                    float s = (float)((0.5 + rng_unit()) * ldexp(1.0, (int)(rng_u64() % 7) - 3));
                    ((float *)t.scale)[i * sld + j] = s;
                    sv[i * sld + j] = s;
                } else {
                    uint8_t b = (uint8_t)(122 + rng_u64() % 10);
                    ((uint8_t *)t.scale)[i * sld + j] = b;
                    sv[i * sld + j] = ref_e8m0(b);
                }
            }
    }
    for (int64_t r = 0; r < rows; r++) {
        uint8_t *row = d + r * rb;
        if (dtype == CPUMLA_E2M1) memset(row, 0, (size_t)((cols + 1) / 2));
        if (dtype == CPUMLA_E2M1 && (cols & 1)) row[cols / 2] = 0xf0;   /* spare nibble: -6 */
        for (int64_t c = 0; c < cols; c++) {
            double v;
            switch (dtype) {
            case CPUMLA_F32: {
                float f = rng_sym(1.0f);
                memcpy(row + 4 * c, &f, 4);
                v = f;
                break;
            }
            case CPUMLA_BF16: {
                uint16_t h = (uint16_t)(bitsf(rng_sym(1.0f)) >> 16);
                memcpy(row + 2 * c, &h, 2);
                v = ref_bf16(h);
                break;
            }
            case CPUMLA_F16: {
                /* random normal fp16 in about [-2, 2], some tiny, some zeros */
                uint64_t u = rng_u64();
                double m = 1024 + (double)(u % 1024);
                int e = (int)((u >> 10) % 12) - 10;
                double val = (u >> 20) % 23 == 0 ? 0.0 : ldexp(m, e - 10);
                if ((u >> 30) & 1) val = -val;
                uint16_t h = ref_f16_bits(val);
                memcpy(row + 2 * c, &h, 2);
                v = ref_f16(h);
                break;
            }
            case CPUMLA_E4M3: {
                uint8_t b;
                do b = (uint8_t)rng_u64(); while ((b & 0x7f) == 0x7f);
                row[c] = b;
                v = ref_e4m3(b);
                break;
            }
            default: {
                int code = (int)(rng_u64() & 15);
                row[c / 2] = (uint8_t)((c & 1) ? (row[c / 2] & 0x0f) | (code << 4) : (row[c / 2] & 0xf0) | code);
                v = ref_e2m1(code);
                break;
            }
            }
            t.qd[r * cols + c] = v;
            t.se[r * cols + c] = quant ? (float)sv[(r / brows) * sld + c / bcols] : 1.0f;
            if (quant) v *= sv[(r / brows) * sld + c / bcols];
            t.wd[r * cols + c] = v;
        }
    }
    free(sv);
    t.data = d;
    t.w.data = d;
    t.w.scale = t.scale;
    t.w.rows = rows;
    t.w.cols = cols;
    t.w.row_bytes = rb;
    t.w.scale_ld = sld;
    t.w.dtype = dtype;
    t.w.scale_dtype = quant ? sdtype : CPUMLA_F32;
    t.w.block_rows = quant ? brows : 0;
    t.w.block_cols = quant ? bcols : 0;
    return t;
}

static void free_weight(tweight *t) { free(t->data); free(t->scale); free(t->wd); free(t->qd); free(t->se); }

/* x with n valid values, NaN after (out-of-bounds reads of x poison the result) */
static float *make_vec(int64_t n, float amp) {
    float *x = nan_floats((size_t)n + 64);
    for (int64_t i = 0; i < n; i++) x[i] = rng_sym(amp);
    return x;
}

/* max for reductions (gcc 12 for aarch64 ICEs vectorising an fmax() reduction at -O3) */
static inline double dmax(double a, double b) { return a > b ? a : b; }

/* ---- comparisons ------------------------------------------------------------------------------ */
/* |got - ref| <= tol * mag (+ a tiny floor); NaN never passes */
static inline int close_to(double got, double ref, double mag, double tol) {
    double err = fabs(got - ref);
    return err <= tol * mag + 1e-30;
}

/* ---- references ------------------------------------------------------------------------------- */
/* kernels.h's activation quantization of one block of 32 (every step in fp32): codes in [-qmax, qmax]
 * (127 for Q8 / Q4, 32512 for E2M1: ref_qmax) into q, returns xd; a block holding a NaN or an
 * infinity: codes 0, xd NaN */
static double ref_qact(const float *x, int *q, float qmax) {
    float amax = 0.0f;
    for (int i = 0; i < 32; i++)
        if (!isfinite(x[i])) {
            for (int j = 0; j < 32; j++) q[j] = 0;
            return NAN;
        }
    for (int i = 0; i < 32; i++) amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
    /* blocks below 2^-100 count as zero (kernels.h) */
    volatile float xd = amax < 0x1p-100f ? 0.0f : amax / qmax, id = amax >= 0x1p-100f ? qmax / amax : 0.0f;
    for (int i = 0; i < 32; i++) {
        volatile float p = x[i] * id;
        q[i] = (int)nearbyint(p);
    }
    return xd;
}

/* the activation codes' range of a weight format's integer product (kernels.h) */
static float ref_qmax(int32_t dtype) { return dtype == CPUMLA_E2M1 ? 32512.0f : 127.0f; }

/* One block's term of an integer product (kernels.h): (float)isum * (float)(wd * xd), each product
 * rounded to fp32 as the definition rounds it (isum is exact, |isum| < 2^24). */
static double ref_qterm(long long isum, double wd, double xd) {
    volatile float f = (float)wd * (float)xd;
    volatile float p = (float)isum * f;
    return p;
}

/* FP4 weights the integer products take (quant.h's is_e2m1_q): 1x32 blocks (any block_rows) of E8M0
 * scales over whole blocks. The others multiply fp32 activations (ref_term). */
static int ref_fp4_int(const cpumla_weight *w) {
    return w->dtype == CPUMLA_E2M1 && w->scale_dtype == CPUMLA_E8M0 && w->block_cols == 32 && w->cols % 32 == 0;
}
/* The product of weight element (r, c) with activation x, as kernels.h defines it: BF16 weights
 * multiply x rounded to bf16; E4M3 codes multiply bf16(x * the block's scale), the product taken in
 * fp32; the other formats multiply their value (scale included) by x. */
static double ref_term(const tweight *t, int64_t r, int64_t c, float x) {
    int64_t i = r * t->w.cols + c;
    if (t->w.dtype == CPUMLA_BF16) return t->wd[i] * ref_bf16(ref_to_bf16(x));
    if (t->w.dtype == CPUMLA_E4M3) {
        volatile float xs = x * t->se[i];           /* the fp32 product, then rounded to bf16 */
        return t->qd[i] * ref_bf16(ref_to_bf16(xs));
    }
    return t->wd[i] * (double)x;
}

/* dot of weight row r with x over all columns; *mag = sum of |terms|. FP4 with 1x32 E8M0 blocks: the
 * integer product of kernels.h (x quantized to int16 per block, codes 2 * value, scale halved). */
static double ref_row_dot(const tweight *t, int64_t r, const float *x, double *mag) {
    double s = 0, a = 0;
    if (ref_fp4_int(&t->w)) {
        for (int64_t b = 0; b < t->w.cols / 32; b++) {
            int q[32];
            double xd = ref_qact(x + 32 * b, q, ref_qmax(CPUMLA_E2M1));
            long long isum = 0;
            for (int i = 0; i < 32; i++) isum += (long long)(2.0 * t->qd[r * t->w.cols + 32 * b + i]) * q[i];
            double p = ref_qterm(isum, 0.5 * t->se[r * t->w.cols + 32 * b], xd);
            s += p;
            a += fabs(p);
        }
        *mag = a;
        return s;
    }
    for (int64_t c = 0; c < t->w.cols; c++) {
        double p = ref_term(t, r, c, x[c]);
        s += p;
        a += fabs(p);
    }
    *mag = a;
    return s;
}

/* Softmax-attention of one query / head over the given kv rows (a list), in double. */
typedef struct {
    const void *kv; int bf16; int64_t ld_kv, dk, dv;
} ref_kv;

static double ref_kv_at(const ref_kv *k, int64_t row, int64_t d) {
    if (k->bf16) return ref_bf16(((const uint16_t *)k->kv)[row * k->ld_kv + d]);
    return ((const float *)k->kv)[row * k->ld_kv + d];
}

/* rows[n]; out[dv] = softmax-weighted values (sink in the denominator when has_sink);
 * returns the max score (-inf when n = 0), *lse = log(sum exp(s) [+ exp(sink)]), *smag = max over
 * rows of scale * sum |q k| (score magnitude, for tolerances) */
static double ref_attn(const ref_kv *k, const float *q, double scale, const int64_t *rows, int64_t n,
                       int has_sink, double sink, double *out, double *lse, double *smag) {
    double *s = malloc(sizeof(double) * (size_t)(n + 1));
    double m = -INFINITY, mag = 0;
    for (int64_t j = 0; j < n; j++) {
        double acc = 0, a = 0;
        for (int64_t d = 0; d < k->dk; d++) {
            double p = q[d] * ref_kv_at(k, rows[j], d);
            acc += p;
            a += fabs(p);
        }
        s[j] = scale * acc;
        mag = dmax(mag, fabs(scale) * a);
        m = dmax(m, s[j]);
    }
    double mm = has_sink ? fmax(m, sink) : m;
    double l = has_sink ? exp(sink - mm) : 0;
    for (int64_t d = 0; d < k->dv; d++) out[d] = 0;
    for (int64_t j = 0; j < n; j++) {
        double p = exp(s[j] - mm);
        l += p;
        for (int64_t d = 0; d < k->dv; d++) out[d] += p * ref_kv_at(k, rows[j], d);
    }
    if (n > 0)
        for (int64_t d = 0; d < k->dv; d++) out[d] /= l;
    *lse = (n > 0 || has_sink) ? mm + log(l) : -INFINITY;
    *smag = mag;
    free(s);
    return m;
}

#endif
