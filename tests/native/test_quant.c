/* test_quant.c: the integer products of a kernel table (gemv, gemm, gemv_t, dequant_row with cpumla's
 * own Q8 / Q4 formats; gemv and gemm with FP4 E2M1 weights of 1x32 E8M0 blocks) against
 * double-precision references written from cpumla.h and kernels.h, independently of scalar_q.c /
 * quant.h: weights are generated with their codes and scales, the activations quantized here as
 * kernels.h defines it, the integer block sums taken exactly, each block's term rounded to fp32 as
 * the definition rounds it. FP4 runs over three code distributions (all zero, random, every code in
 * turn) and five scale kinds (normal, 2^-128 / 2^-127 / 2^-126 with normal and with huge
 * activations, 2^124..2^126 with tiny activations, a NaN scale in some rows). quantize_row (cpumla_quantize)
 * is checked bit for bit against its spec, scalar_q.c's, on random and edge-case blocks. */
#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include "core/kernels.h"
#include "core/quant.h"
#include "ref.h"

#define QSENT 12345.0f

typedef struct {
    cpumla_weight w;
    void *data;
    void *scale;
    int *codes;        /* [rows, cols]: signed code (Q4: nibble - 8, E2M1: 2 * value) */
    double *d;         /* [rows, cols/32]: scale values (E2M1: the E8M0 scale halved) */
} qweight;

/* t's weight over data (t->scale already set): 1x32 blocks of brows rows */
static void set_w(qweight *t, uint8_t *data, int64_t rows, int64_t cols, int64_t rb, int64_t sld, int dtype,
                  int sdtype, int brows) {
    t->data = data;
    t->w.data = data;
    t->w.scale = t->scale;
    t->w.rows = rows;
    t->w.cols = cols;
    t->w.row_bytes = rb;
    t->w.scale_ld = sld;
    t->w.dtype = dtype;
    t->w.scale_dtype = sdtype;
    t->w.block_rows = brows;
    t->w.block_cols = 32;
}

/* FP4 weights: code distributions and scale kinds */
enum { FC_ZERO, FC_RANDOM, FC_EVERY, FC_N };
enum { FS_NORMAL, FS_LOW, FS_LOW_BIGX, FS_HIGH_TINYX, FS_NAN, FS_N };
static const char *fc_name[FC_N] = {"zero codes", "random codes", "every code"};
static const char *fs_name[FS_N] = {"normal scales", "scales 2^-128..2^-126", "scales 2^-128..2^-126, x * 2^100",
                                    "scales 2^124..2^126, x * 2^-100", "a NaN scale in some rows"};

/* an FP4 weight [rows, cols] (1x32 E8M0 blocks, brows rows a scale row), rows padded by pad bytes
 * (poisoned), one poisoned (NaN) scale column */
static qweight make_fp4(int64_t rows, int64_t cols, int brows, int64_t pad, int codes, int scales) {
    static const double mag[8] = {0, 1, 2, 3, 4, 6, 8, 12};
    qweight t;
    memset(&t, 0, sizeof t);
    const int64_t nb = cols / 32, rb = cols / 2 + pad, sld = nb + 1, gr = (rows + brows - 1) / brows;
    uint8_t *data = xalloc((size_t)(rows * rb) + 64), *sc = xalloc((size_t)(gr * sld) + 64);
    memset(data, 0xff, (size_t)(rows * rb) + 64);
    t.codes = xalloc(sizeof(int) * (size_t)(rows * cols));
    t.d = xalloc(sizeof(double) * (size_t)(rows * nb));
    for (int64_t g = 0; g < gr; g++) {
        sc[g * sld + nb] = 0xff;
        for (int64_t b = 0; b < nb; b++) {
            int e = 118 + (int)(rng_u64() % 16);
            if (scales == FS_LOW || scales == FS_LOW_BIGX) e = (int)(rng_u64() % 3);
            if (scales == FS_HIGH_TINYX) e = 252 + (int)(rng_u64() % 3);
            if (scales == FS_NAN && g % 3 == 1 && b == g % nb) e = 0xff;
            sc[g * sld + b] = (uint8_t)e;
        }
    }
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t e = sc[(r / brows) * sld + b];
            t.d[r * nb + b] = e == 0xff ? NAN : ldexp(1.0, e - 128);
        }
        uint8_t *row = data + r * rb;
        for (int64_t c = 0; c < cols; c++) {
            int nib = codes == FC_ZERO ? (int)(rng_u64() & 1) * 8 : codes == FC_EVERY ? (int)((r + c) & 15)
                                                                                      : (int)(rng_u64() & 15);
            row[c / 2] = (uint8_t)((c & 1) ? (row[c / 2] & 0x0f) | (nib << 4) : (row[c / 2] & 0xf0) | nib);
            t.codes[r * cols + c] = (int)((nib & 8) ? -mag[nib & 7] : mag[nib & 7]);
        }
    }
    t.scale = sc;
    set_w(&t, data, rows, cols, rb, sld, CPUMLA_E2M1, CPUMLA_E8M0, brows);
    return t;
}

/* Rows padded by pad bytes (poisoned 0xff), one extra poisoned scale column (fp16 NaN). */
static qweight make_qweight(int64_t rows, int64_t cols, int dtype, int64_t pad) {
    qweight t;
    memset(&t, 0, sizeof t);
    int64_t nb = cols / 32, rb = (dtype == CPUMLA_Q8 ? cols : cols / 2) + pad, sld = nb + 1;
    uint8_t *data = xalloc((size_t)(rows * rb) + 64);
    memset(data, 0xff, (size_t)(rows * rb) + 64);
    uint16_t *scale = xalloc(sizeof(uint16_t) * (size_t)(rows * sld) + 64);
    t.scale = scale;
    t.codes = xalloc(sizeof(int) * (size_t)(rows * cols));
    t.d = xalloc(sizeof(double) * (size_t)(rows * nb));
    for (int64_t r = 0; r < rows; r++) {
        scale[r * sld + nb] = 0x7e00;
        for (int64_t b = 0; b < nb; b++) {
            double v = ldexp(1024 + (double)(rng_u64() % 1024), (int)(rng_u64() % 5) - 19);
            if (rng_u64() & 1) v = -v;
            scale[r * sld + b] = ref_f16_bits(v);
            t.d[r * nb + b] = ref_f16(scale[r * sld + b]);
        }
        uint8_t *row = data + r * rb;
        for (int64_t c = 0; c < cols; c++) {
            if (dtype == CPUMLA_Q8) {
                int q = (int)(rng_u64() % 255) - 127;
                row[c] = (uint8_t)(int8_t)q;
                t.codes[r * cols + c] = q;
            } else {
                /* block b: byte 16b + i holds column 32b + i (low nibble) and 32b + 16 + i (high) */
                int nib = (int)(rng_u64() % 16);
                int64_t b = c / 32, i = c % 32, at = 16 * b + (i % 16);
                row[at] = (uint8_t)(i < 16 ? (row[at] & 0xf0) | nib : (row[at] & 0x0f) | (nib << 4));
                t.codes[r * cols + c] = nib - 8;
            }
        }
    }
    set_w(&t, data, rows, cols, rb, sld, dtype, CPUMLA_F16, 1);
    return t;
}

static void free_qweight(qweight *t) { free(t->data); free(t->scale); free(t->codes); free(t->d); }

static double qvalue(const qweight *t, int64_t r, int64_t c) {
    return t->codes[r * t->w.cols + c] * t->d[r * (t->w.cols / 32) + c / 32];
}

/* the product of row r with x as kernels.h defines it, the block terms (ref.h's ref_qterm) summed in
 * double; *mag = sum of |block terms| */
static double ref_qdot(const qweight *t, int64_t r, const float *x, double *mag) {
    int64_t nb = t->w.cols / 32;
    double s = 0, a = 0;
    for (int64_t b = 0; b < nb; b++) {
        int q[32];
        double xd = ref_qact(x + 32 * b, q, ref_qmax(t->w.dtype));
        long long isum = 0;
        for (int i = 0; i < 32; i++) isum += (long long)t->codes[r * t->w.cols + 32 * b + i] * q[i];
        const double p = ref_qterm(isum, t->d[r * nb + b], xd);
        s += p;
        a += fabs(p);
    }
    *mag = a;
    return s;
}

/* rows: 1, and counts off every row tile; cols: 1, 2, 7, 9, 17 blocks, whole 16-block steps (32, 80,
 * 224) and 44 (V2-Lite's expert width: steps of 16 with 12 left) */
static const struct { int64_t rows, cols, pad; } qcases[] = {
    {1, 32, 0}, {3, 64, 5}, {9, 224, 0}, {33, 288, 3}, {70, 1408, 0}, {5, 7168, 0},
    {1, 544, 0}, {6, 1024, 7}, {11, 2560, 0},
};

/* kernels.h's product in fp32 itself (blocks in order): with at most 2 blocks every association of the
 * sums gives it, so an implementation must match it bit for bit (exact integer sums, wd * xd and the
 * product each rounded to fp32, nothing fused) */
static float spec_qdot32(const qweight *t, int64_t r, const float *x) {
    int64_t nb = t->w.cols / 32;
    volatile float acc = 0.0f;
    for (int64_t b = 0; b < nb; b++) {
        int q[32];
        volatile float xd = (float)ref_qact(x + 32 * b, q, ref_qmax(t->w.dtype));
        long long isum = 0;
        for (int i = 0; i < 32; i++) isum += (long long)t->codes[r * t->w.cols + 32 * b + i] * q[i];
        volatile float f = (float)t->d[r * nb + b] * xd;
        volatile float p = (float)isum * f;
        acc = acc + p;
    }
    return acc;
}
#define N_QCASES ((int)(sizeof qcases / sizeof qcases[0]))

/* ---- quantize_row against the spec --------------------------------------------------------------- */
static float qz_pow2(int e) { return (float)ldexp(1.0, e); }

/* one block of kind `kind` (see the cases) into v[32] */
static void qz_block(int kind, float *v) {
    const int e = (int)(rng_u64() % 200) - 110;         /* 2^-110 .. 2^89: fp16 scales from 0 to inf */
    const float s = qz_pow2(e);
    switch (kind) {
    case 0:                                              /* random, any magnitude */
        for (int i = 0; i < QK; i++) v[i] = rng_sym(1.0f) * s;
        break;
    case 1: for (int i = 0; i < QK; i++) v[i] = 0.0f; break;
    case 2: for (int i = 0; i < QK; i++) v[i] = -0.0f; break;
    case 3: for (int i = 0; i < QK; i++) v[i] = (rng_u64() & 1) ? -0.0f : 0.0f; break;
    case 4: {                                            /* exact .5 ties after scaling by a power of two */
        const int q8 = rng_u64() & 1;
        const float d = qz_pow2((int)(rng_u64() % 40) - 30);
        for (int i = 0; i < QK; i++) v[i] = ((float)((int)(rng_u64() % 15) - 7) + 0.5f) * d;
        v[rng_u64() % QK] = q8 ? 127.0f * d : -8.0f * d;
        break;
    }
    case 5:                                              /* one huge outlier */
        for (int i = 0; i < QK; i++) v[i] = rng_sym(1e-3f);
        v[rng_u64() % QK] = (rng_u64() & 1) ? 1e30f : -1e30f;
        break;
    case 6: {                                            /* ties for the largest |v|, either sign */
        for (int i = 0; i < QK; i++) v[i] = rng_sym(0.5f) * s;
        for (int t = 0; t < 3; t++) v[rng_u64() % QK] = (rng_u64() & 1) ? s : -s;
        break;
    }
    case 7:                                              /* scales near and below the fp16 subnormals */
        for (int i = 0; i < QK; i++) v[i] = rng_sym(1.0f) * (float)(127.0 * ldexp(1.0, -24) * (0.2 + 3.0 * rng_unit()));
        break;
    case 8:                                              /* scales near fp16 overflow (65504) */
        for (int i = 0; i < QK; i++) v[i] = rng_sym(1.0f) * (float)(8.0e6 * (0.9 + 0.2 * rng_unit()));
        break;
    case 9: {                                            /* a NaN or an infinity, anywhere */
        static const float bad[3] = {NAN, INFINITY, -INFINITY};
        for (int i = 0; i < QK; i++) v[i] = rng_sym(1.0f) * s;
        v[rng_u64() % QK] = bad[rng_u64() % 3];
        break;
    }
    default:                                             /* values that clamp: tiny amax, rest mid-size */
        for (int i = 0; i < QK; i++) v[i] = rng_sym(1.0f) * s;
        v[QK - 1] = -s * 1.000001f;
        break;
    }
}

#if defined(__x86_64__)
/* vcvtps2ph with round-to-nearest-even, as avx512f_q.c uses it, against f32_to_f16 for every positive
 * fp32 from below half the smallest fp16 subnormal to past fp16 overflow, and every 7th negative one */
__attribute__((target("avx512f,f16c"))) static long qz_f16_exhaustive(void) {
    long bad = 0;
    for (uint32_t u = 0x32000000u; u < 0x47900000u && bad < 5; u += 16) {
        uint32_t lanes[16];
        for (int i = 0; i < 16; i++) lanes[i] = u + (uint32_t)i;
        uint16_t got[16];
        __m512 x = _mm512_loadu_ps((const float *)lanes);
        _mm256_storeu_si256((__m256i *)got, _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        for (int i = 0; i < 16; i++) {
            float f;
            memcpy(&f, &lanes[i], 4);
            if (got[i] != f32_to_f16(f)) bad++;
            if (i % 7 == 0 && f32_to_f16(-f) != (uint16_t)(got[i] | 0x8000u)) bad++;
        }
    }
    return bad;
}
#endif

static void test_quantize_row(const cpumla_kernels *k) {
#if defined(__x86_64__)
    static int f16_done;
    if (!f16_done && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("f16c")) {
        f16_done = 1;
        check(qz_f16_exhaustive() == 0, "vcvtps2ph (nearest even) differs from f32_to_f16");
    }
#endif
    cpumla_kernels spec;
    memset(&spec, 0, sizeof spec);
    cpumla_fill_scalar_q(&spec);
    check(k->quantize_row != NULL, "quantize_row missing");
    if (!k->quantize_row) return;
    static const int64_t nbs[] = {1, 2, 15, 16, 17, 31, 33, 64, 100};
    for (int dt = CPUMLA_Q8; dt <= CPUMLA_Q4; dt++)
        for (size_t t = 0; t < sizeof nbs / sizeof nbs[0]; t++)
            for (int rep = 0; rep < (small_mode ? 4 : 40); rep++) {
                const int64_t nb = nbs[t], bb = dt == CPUMLA_Q8 ? QK : QK / 2;
                float *row = xalloc(sizeof(float) * (size_t)(nb * QK));
                /* one kind per row, or every kind mixed */
                const int fixed = small_mode ? (rep == 1 ? 9 : rep == 2 ? 0 : -1) : rep < 11 ? rep : -1;
                for (int64_t b = 0; b < nb; b++) qz_block(fixed >= 0 ? fixed : (int)(rng_u64() % 11), row + b * QK);
                uint8_t *qa = xalloc((size_t)(nb * bb) + 1), *qb = xalloc((size_t)(nb * bb) + 1);
                uint16_t *sa = xalloc(sizeof(uint16_t) * (size_t)(nb + 1)), *sb = xalloc(sizeof(uint16_t) * (size_t)(nb + 1));
                memset(qa, 0xa5, (size_t)(nb * bb) + 1);
                memset(sa, 0xa5, sizeof(uint16_t) * (size_t)(nb + 1));
                spec.quantize_row(dt, row, nb, qb, sb);
                case_begin();
                k->quantize_row(dt, row, nb, qa, sa);
                int64_t bad = -1;
                for (int64_t b = 0; b < nb && bad < 0; b++)
                    if (sa[b] != sb[b] || memcmp(qa + b * bb, qb + b * bb, (size_t)bb)) bad = b;
                check(bad < 0, "quantize_row %s nb %lld kind %d: block %lld differs from the spec (scale %04x, want %04x)",
                      dt == CPUMLA_Q8 ? "Q8" : "Q4", (long long)nb, fixed, (long long)bad,
                      bad < 0 ? 0 : sa[bad], bad < 0 ? 0 : sb[bad]);
                check(qa[nb * bb] == 0xa5 && sa[nb] == 0xa5a5, "quantize_row %s nb %lld wrote past the row",
                      dt == CPUMLA_Q8 ? "Q8" : "Q4", (long long)nb);
                case_end();
                free(row); free(qa); free(qb); free(sa); free(sb);
            }
}

/* n activation rows ldx apart (uniform in +-amp, the second at amp / 1000, a zero block in the third,
 * in the first a block 2^-118 times the rest (below QACT_TINY for the usual amp: it counts as zero)
 * and one 2^-98 times (just above), a NaN or an infinity somewhere in the fourth, NaN past the row) through gemv (n = 1) or gemm over rows [r0, r1): returns y (n rows ldy apart,
 * QSENT where nothing was written), *xo the activations */
static float *run_q(const cpumla_kernels *k, const cpumla_weight *w, int64_t n, int64_t ldx, float amp, int64_t r0,
                    int64_t r1, int64_t ldy, float **xo) {
    float *x = nan_floats((size_t)(n * ldx + 64));
    for (int64_t tt = 0; tt < n; tt++)
        for (int64_t i = 0; i < w->cols; i++) x[tt * ldx + i] = rng_sym(tt == 1 ? amp * 1e-3f : amp);
    for (int64_t i = 0; i < 32 && n > 2; i++) x[2 * ldx + i] = 0.0f;      /* a zero block */
    for (int64_t i = 32; i < 64 && i < w->cols; i++) x[i] *= 0x1p-118f;     /* tiny blocks */
    for (int64_t i = 64; i < 96 && i < w->cols; i++) x[i] *= 0x1p-98f;
    if (n > 3) {                                                           /* a NaN or an infinity */
        static const float bad[3] = {NAN, INFINITY, -INFINITY};
        x[3 * ldx + (int64_t)(rng_u64() % (uint64_t)w->cols)] = bad[rng_u64() % 3];
    }
    float *y = xalloc(sizeof(float) * (size_t)(n * ldy));
    for (int64_t i = 0; i < n * ldy; i++) y[i] = QSENT;
    case_begin();
    if (n == 1) kern_gemv(k, w, x, y, r0, r1);
    else kern_gemm(k, w, x, ldx, n, y, ldy, r0, r1);
    *xo = x;
    return y;
}

/* the same bits, or both NaN */
static int same_f(float a, float b) { return bitsf(a) == bitsf(b) || (isnan(a) && isnan(b)); }

/* got against want: NaN and infinities exactly, the rest within 1e-5 of the terms' magnitude */
static int q_close(float got, double want, double mag) {
    if (isnan(want)) return isnan(got);
    if (isinf(want)) return got == want;
    return close_to(got, want, mag, 1e-5);
}

/* FP4 (E2M1, 1x32 E8M0 blocks) through gemv and gemm: every code distribution and scale kind, row
 * ranges and token counts over the tiles' edges; bit for bit the fp32 spec on 1-2 blocks (exact
 * integer sums), and on every width where the gemm takes the level's fp32-FMA product (gemm_fp4, from
 * gemm_fp4_min_n tokens: blocks added in the spec's order); below that, gemm's tokens bit for bit
 * gemv's (decode and prefill agree) */
static void test_fp4(const cpumla_kernels *k) {
    static const struct { int64_t rows, cols; int brows; int64_t pad; } cs[] = {
        {1, 32, 1, 0}, {5, 64, 1, 3}, {9, 224, 1, 0}, {33, 288, 1, 1}, {6, 544, 2, 0}, {11, 2048, 1, 0},
        {5, 7168, 1, 0}, {70, 1408, 3, 0},
    };
    for (size_t ci = 0; ci < sizeof cs / sizeof cs[0]; ci++)
        for (int fc = 0; fc < FC_N; fc++)
            for (int fs = 0; fs < FS_N; fs++) {
                const int64_t R = cs[ci].rows, C = cs[ci].cols;
                if (small_mode && (C > 2000 || (fc != FC_RANDOM && fs != FS_NORMAL))) continue;
                qweight t = make_fp4(R, C, cs[ci].brows, cs[ci].pad, fc, fs);
                const float amp = fs == FS_LOW_BIGX ? 0x1p100f : fs == FS_HIGH_TINYX ? 0x1p-100f : 2.0f;
                static const int64_t ns[] = {1, 2, 3, 5, 13, 50};
                for (int ni = 0; ni < 6; ni++) {
                    const int64_t n = ns[ni], ldx = C + 3, r0 = R / 4, r1 = R - R / 5, nr = r1 - r0, ldy = nr + 2;
                    const int fma = n > 1 && k->gemm_fp4 && n >= k->gemm_fp4_min_n;
                    float *x, *y = run_q(k, &t.w, n, ldx, amp, r0, r1, ldy, &x);
                    int bad = 0, gap_ok = 1, same = 1, agree = 1;
                    for (int64_t tt = 0; tt < n; tt++) {
                        for (int64_t i = 0; i < nr && bad < 3; i++) {
                            double mag, want = ref_qdot(&t, r0 + i, x + tt * ldx, &mag);
                            float got = y[tt * ldy + i];
                            if (!check(q_close(got, want, mag), "%s E2M1 %lldx%lld [%dx32] %s, %s, n=%lld: y[%lld,%lld] = %.9g, want %.9g",
                                       n == 1 ? "gemv" : "gemm", (long long)R, (long long)C, cs[ci].brows, fc_name[fc],
                                       fs_name[fs], (long long)n, (long long)tt, (long long)i, got, want))
                                bad++;
                            if (C <= 64 || fma) {
                                const float sp = spec_qdot32(&t, r0 + i, x + tt * ldx);
                                same &= same_f(got, sp);
                            }
                        }
                        gap_ok &= y[tt * ldy + nr] == QSENT && y[tt * ldy + nr + 1] == QSENT;
                    }
                    if (n > 1 && !fma) {          /* each token's row as gemv gives it */
                        float *y1 = xalloc(sizeof(float) * (size_t)nr);
                        for (int64_t tt = 0; tt < n; tt++) {
                            kern_gemv(k, &t.w, x + tt * ldx, y1, r0, r1);
                            for (int64_t i = 0; i < nr; i++)
                                agree &= same_f(y1[i], y[tt * ldy + i]);
                        }
                        free(y1);
                    }
                    check(gap_ok, "E2M1 %lldx%lld n=%lld wrote past its rows", (long long)R, (long long)C, (long long)n);
                    check(same, "E2M1 %lldx%lld %s, %s, n=%lld differs from the fp32 spec", (long long)R, (long long)C,
                          fc_name[fc], fs_name[fs], (long long)n);
                    check(agree, "E2M1 %lldx%lld %s, %s: gemm (n=%lld) differs from gemv", (long long)R, (long long)C,
                          fc_name[fc], fs_name[fs], (long long)n);
                    case_end();
                    free(x);
                    free(y);
                }
                free_qweight(&t);
            }
}

void test_quant(const cpumla_kernels *k) {
    test_quantize_row(k);
    test_fp4(k);
    for (int dt = CPUMLA_Q8; dt <= CPUMLA_Q4; dt++)
        for (int ci = 0; ci < N_QCASES; ci++) {
            int64_t R = qcases[ci].rows, C = qcases[ci].cols;
            if (small_mode && C > 2000) continue;
            const char *nm = dt == CPUMLA_Q8 ? "Q8" : "Q4";
            qweight t = make_qweight(R, C, dt, qcases[ci].pad);
            /* gemv (rows [r0, r1)) and gemm (n tokens, strided x poisoned with NaN past C) */
            static const int64_t ns[] = {1, 2, 3, 5, 17, 40};    /* 2, 3: rows one at a time; from 16: amx's int8 tiles */
            for (int ni = 0; ni < 6; ni++) {
                int64_t n = ns[ni], ldx = C + 3, r0 = R / 4, r1 = R - R / 5, nr = r1 - r0, ldy = nr + 2;
                float *x, *y = run_q(k, &t.w, n, ldx, 2.0f, r0, r1, ldy, &x);
                int bad = 0, gap_ok = 1;
                for (int64_t tt = 0; tt < n; tt++) {
                    for (int64_t i = 0; i < nr && bad < 3; i++) {
                        double mag, want = ref_qdot(&t, r0 + i, x + tt * ldx, &mag);
                        float got = y[tt * ldy + i];
                        if (!check(q_close(got, want, mag), "%s %s %lldx%lld n=%lld: y[%lld,%lld] = %.9g, want %.9g",
                                   n == 1 ? "gemv" : "gemm", nm, (long long)R, (long long)C, (long long)n,
                                   (long long)tt, (long long)i, got, want))
                            bad++;
                    }
                    gap_ok &= y[tt * ldy + nr] == QSENT && y[tt * ldy + nr + 1] == QSENT;
                }
                check(gap_ok, "%s %s %lldx%lld wrote past its rows", n == 1 ? "gemv" : "gemm", nm, (long long)R,
                      (long long)C);
                if (C <= 64) {
                    int same = 1;
                    for (int64_t tt = 0; tt < n; tt++)
                        for (int64_t i = 0; i < nr; i++) same &= same_f(y[tt * ldy + i], spec_qdot32(&t, r0 + i, x + tt * ldx));
                    check(same, "%s %s %lldx%lld differs from the fp32 spec", n == 1 ? "gemv" : "gemm", nm,
                          (long long)R, (long long)C);
                }
                if (n > 1) {                 /* each token's row as gemv gives it: prefill and decode agree */
                    float *y1 = xalloc(sizeof(float) * (size_t)nr);
                    int same = 1;
                    for (int64_t tt = 0; tt < n; tt++) {
                        kern_gemv(k, &t.w, x + tt * ldx, y1, r0, r1);
                        for (int64_t i = 0; i < nr; i++) same &= same_f(y1[i], y[tt * ldy + i]);
                    }
                    check(same, "gemm %s %lldx%lld n=%lld: a token's row differs from gemv's", nm, (long long)R,
                          (long long)C, (long long)n);
                    free(y1);
                }
                if (n == 1 && nr > 2) {      /* a row's result does not depend on how the rows are split */
                    float *y2 = xalloc(sizeof(float) * (size_t)nr);
                    int64_t m = r0 + 1 + (nr - 1) / 2;
                    kern_gemv(k, &t.w, x, y2, r0, r0 + 1);
                    kern_gemv(k, &t.w, x, y2 + 1, r0 + 1, m);
                    kern_gemv(k, &t.w, x, y2 + (m - r0), m, r1);
                    check(!memcmp(y, y2, sizeof(float) * (size_t)nr), "gemv %s %lldx%lld: split rows differ", nm,
                          (long long)R, (long long)C);
                    free(y2);
                }
                case_end();
                free(x);
                free(y);
            }
            /* gemv_t over rows [r0, r0 + nr) and columns [c0, c1), c0 inside a block, neither a multiple of 8 */
            {
                int64_t r0 = R / 3, nr = R - R / 3, c0 = C > 32 ? 13 : 0, c1 = C - (C > 64 ? 5 : 0), nc = c1 - c0;
                float *x = make_vec(nr, 1.0f);
                float *y = xalloc(sizeof(float) * (size_t)(nc + 4));
                for (int64_t i = 0; i < nc + 4; i++) y[i] = QSENT;
                case_begin();
                kern_gemv_t(k, &t.w, r0, nr, x, y, c0, c1);
                int bad = 0;
                for (int64_t c = c0; c < c1 && bad < 3; c++) {
                    double s = 0, mag = 0;
                    for (int64_t i = 0; i < nr; i++) {
                        double p = (double)x[i] * qvalue(&t, r0 + i, c);
                        s += p;
                        mag += fabs(p);
                    }
                    if (!check(close_to(y[c - c0], s, mag, 1e-5), "gemv_t %s %lldx%lld: y[%lld] = %.9g, want %.9g", nm,
                               (long long)R, (long long)C, (long long)(c - c0), y[c - c0], s))
                        bad++;
                }
                check(y[nc] == QSENT, "gemv_t %s wrote past c1", nm);
                case_end();
                free(x);
                free(y);
            }
            /* dequant_row, exact */
            {
                int64_t c0 = C / 3, nc = C - c0;
                float *out = xalloc(sizeof(float) * (size_t)(nc + 4));
                out[nc] = QSENT;
                case_begin();
                kern_dequant(k, &t.w, R - 1, c0, C, out);
                int ok = 1;
                for (int64_t c = c0; c < C && ok; c++) ok = out[c - c0] == (float)qvalue(&t, R - 1, c);
                check(ok && out[nc] == QSENT, "dequant_row %s %lldx%lld", nm, (long long)R, (long long)C);
                case_end();
                free(out);
            }
            free_qweight(&t);
        }
}
