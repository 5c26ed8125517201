/* test_gguf_q.c: a kernel table's products with GGUF's Q8_0 weights (cpumla.h: 34-byte blocks of an
 * fp16 scale then 32 int8 codes, read in place), reached as every caller reaches them (kern_gemv,
 * kern_gemm, kern_gemv_t, kern_dequant), against references written from cpumla.h and kernels.h: the
 * activations quantized here as kernels.h defines it, exact block sums, each block's term
 * (float)isum * (d * xd) rounded once and added in block order in fp32, so gemv and gemm must match
 * bit for bit; gemv_t against double; dequant exact. Codes span [-128, 127], rows are padded with
 * poisoned bytes, odd row counts and token counts. test_gguf_types (below) covers every block type. */
#include "core/gguf_q.h"
#include "core/kernels.h"
#include "ref.h"

typedef struct {
    cpumla_weight w;
    uint8_t *data;
} gq8;

static uint16_t rand_f16_scale(void) {       /* a normal fp16 in about [2^-12, 2^2] of either sign */
    const int e = 3 + (int)(rng_u64() % 14), m = (int)(rng_u64() % 1024);
    return (uint16_t)(((rng_u64() & 1) << 15) | (e << 10) | m);
}

static gq8 make_gq8(int64_t rows, int64_t cols, int64_t pad) {
    gq8 t;
    memset(&t, 0, sizeof t);
    const int64_t nb = cols / 32, rb = nb * 34 + pad;
    t.data = xalloc((size_t)(rows * rb) + 64);
    memset(t.data, 0xff, (size_t)(rows * rb) + 64);
    for (int64_t r = 0; r < rows; r++)
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *blk = t.data + r * rb + b * 34;
            const uint16_t d = rand_f16_scale();
            blk[0] = (uint8_t)(d & 0xff);
            blk[1] = (uint8_t)(d >> 8);
            for (int i = 0; i < 32; i++) {
                int q = (int)(rng_u64() % 256) - 128;
                if ((r + b) % 5 == 0 && i < 2) q = i ? 127 : -128;
                blk[2 + i] = (uint8_t)(int8_t)q;
            }
        }
    t.w.data = t.data;
    t.w.rows = rows;
    t.w.cols = cols;
    t.w.row_bytes = rb;
    t.w.dtype = CPUMLA_Q8_0;
    t.w.scale_dtype = CPUMLA_F16;
    t.w.block_rows = 1;
    t.w.block_cols = 32;
    return t;
}

static double gq8_value(const gq8 *t, int64_t r, int64_t c) {
    const uint8_t *blk = t->data + r * t->w.row_bytes + (c / 32) * 34;
    return ref_f16((uint16_t)(blk[0] | blk[1] << 8)) * (double)(int8_t)blk[2 + c % 32];
}

/* kernels.h's definition of one output: activation codes per block, exact sums, fp32 terms in order */
static float ref_gq8_dot(const gq8 *t, int64_t r, const float *x) {
    float acc = 0.0f;
    for (int64_t b = 0; b < t->w.cols / 32; b++) {
        float amax = 0.0f;
        for (int i = 0; i < 32; i++) amax = fabsf(x[b * 32 + i]) > amax ? fabsf(x[b * 32 + i]) : amax;
        const int tiny = amax < fbits(0x0d800000u);                   /* 2^-100 */
        const float id = tiny ? 0.0f : 127.0f / amax, xd = tiny ? 0.0f : amax / 127.0f;
        const uint8_t *blk = t->data + r * t->w.row_bytes + b * 34;
        int64_t isum = 0;
        for (int i = 0; i < 32; i++) {
            volatile float v = x[b * 32 + i] * id;
            isum += (int64_t)(int8_t)blk[2 + i] * (int64_t)nearbyintf(v);
        }
        volatile float wx = (float)ref_f16((uint16_t)(blk[0] | blk[1] << 8)) * xd;
        volatile float term = (float)isum * wx;
        acc += term;
    }
    return acc;
}

void test_gguf_q(const cpumla_kernels *k) {
    static const int64_t shapes[][2] = {{1, 32}, {5, 64}, {17, 288}, {33, 1024}, {4, 7168}};
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
        const int64_t rows = shapes[s][0], cols = shapes[s][1], n = 3;
        gq8 t = make_gq8(rows, cols, s % 2 ? 6 : 0);
        float *x = nan_floats((size_t)(n * cols) + 16), *y = nan_floats((size_t)(n * rows) + 16);
        for (int64_t i = 0; i < n * cols; i++) x[i] = rng_sym(2.0f);
        for (int64_t i = 0; i < 32 && i < cols; i++) x[cols + i] = 0.0f;       /* a zero block */
        case_begin();
        kern_gemv(k, &t.w, x, y, 0, rows);
        int bad = 0;
        for (int64_t r = 0; r < rows; r++) bad += bitsf(y[r]) != bitsf(ref_gq8_dot(&t, r, x));
        check(!bad, "q8_0 gemv %lldx%lld: %d rows differ from the definition", (long long)rows, (long long)cols, bad);
        for (int64_t i = 0; i < n * rows; i++) y[i] = NAN;
        kern_gemm(k, &t.w, x, cols, n, y, rows, 0, rows);
        bad = 0;
        for (int64_t tt = 0; tt < n; tt++)
            for (int64_t r = 0; r < rows; r++) bad += bitsf(y[tt * rows + r]) != bitsf(ref_gq8_dot(&t, r, x + tt * cols));
        check(!bad, "q8_0 gemm %lldx%lld x %lld: %d outputs differ from the definition", (long long)rows,
              (long long)cols, (long long)n, bad);
        /* gemv_t over every row, columns [c0, cols) */
        const int64_t c0 = cols > 32 ? 32 : 0;
        float *yt = nan_floats((size_t)cols + 16);
        kern_gemv_t(k, &t.w, 0, rows, x, yt, c0, cols);
        double worst = 0.0, scale = 1e-30;
        for (int64_t c = c0; c < cols; c++) {
            double ref = 0.0, mag = 0.0;
            for (int64_t r = 0; r < rows; r++) {
                ref += (double)x[r] * gq8_value(&t, r, c);
                mag += fabs((double)x[r] * gq8_value(&t, r, c));
            }
            worst = fmax(worst, fabs(yt[c - c0] - ref));
            scale = fmax(scale, mag);
        }
        check(worst <= 1e-5 * scale, "q8_0 gemv_t %lldx%lld: error %g of %g", (long long)rows, (long long)cols, worst, scale);
        float *row = nan_floats((size_t)cols + 16);
        kern_dequant(k, &t.w, rows - 1, 0, cols, row);
        bad = 0;
        for (int64_t c = 0; c < cols; c++) bad += (double)row[c] != gq8_value(&t, rows - 1, c);
        check(!bad, "q8_0 dequant %lld columns: %d differ", (long long)cols, bad);
        case_end();
        free(t.data);
        free(x);
        free(y);
        free(yt);
        free(row);
    }
}

/* ---- every GGUF block type (gguf_q.h) ------------------------------------------------------------
 * Random bytes with finite fp16 scales at each type's scale fields (IQ1_M: d in its scale words' top
 * nibbles; MXFP4: E8M0 bytes near 2^0 and the subnormal e = 0, 1), rows padded with poisoned bytes, the
 * IQ codebooks pseudo-random in range. gemv / gemm against the spec written here over gq_unpack's
 * values (activations quantized here, exact int64 half sums, each chunk's fp32 product rounded once and
 * added in column order): bit for bit; gemv_t against double; dequant bit for bit gq_value. */

typedef struct {
    int32_t dtype;
    const char *name;
    int block, bytes, has_min;
    int f16[2];            /* byte offsets of the block's fp16 fields (-1: none) */
} gq_case_type;

static const gq_case_type gq_case_types[] = {
    {CPUMLA_Q8_0, "q8_0", 32, 34, 0, {0, -1}},        {CPUMLA_Q4_0, "q4_0", 32, 18, 0, {0, -1}},
    {CPUMLA_Q4_1, "q4_1", 32, 20, 1, {0, 2}},         {CPUMLA_Q5_0, "q5_0", 32, 22, 0, {0, -1}},
    {CPUMLA_Q5_1, "q5_1", 32, 24, 1, {0, 2}},         {CPUMLA_Q2_K, "q2_k", 256, 84, 1, {80, 82}},
    {CPUMLA_Q3_K, "q3_k", 256, 110, 0, {108, -1}},    {CPUMLA_Q4_K, "q4_k", 256, 144, 1, {0, 2}},
    {CPUMLA_Q5_K, "q5_k", 256, 176, 1, {0, 2}},       {CPUMLA_Q6_K, "q6_k", 256, 210, 0, {208, -1}},
    {CPUMLA_IQ4_NL, "iq4_nl", 32, 18, 0, {0, -1}},    {CPUMLA_IQ4_XS, "iq4_xs", 256, 136, 0, {0, -1}},
    {CPUMLA_IQ2_XXS, "iq2_xxs", 256, 66, 0, {0, -1}}, {CPUMLA_IQ3_XXS, "iq3_xxs", 256, 98, 0, {0, -1}},
    {CPUMLA_IQ1_S, "iq1_s", 256, 50, 0, {0, -1}},     {CPUMLA_IQ1_M, "iq1_m", 256, 56, 0, {-1, -1}},
    {CPUMLA_MXFP4, "mxfp4", 32, 17, 0, {-1, -1}},
};
#define GQ_CASE_TYPES ((int)(sizeof gq_case_types / sizeof gq_case_types[0]))

/* the codebooks, pseudo-random within each table's range (an rng of their own); mx_own: MXFP4's own
 * table instead (the doubled e2m1 values, |v| <= 12: the unsigned path of avx2's gemm) */
static void gq_test_tables(int mx_own) {
    static uint8_t iq2[256 * 8], iq3[256 * 4], ks[128];
    static int8_t iq1[2048 * 8], nl[16], mx[16];
    uint64_t s = 0x2545f4914f6cdd1dull;
#define NEXT() (s ^= s << 13, s ^= s >> 7, s ^= s << 17, s)
    for (int i = 0; i < 256 * 8; i++) iq2[i] = (uint8_t)(NEXT() % 128);
    for (int i = 0; i < 256 * 4; i++) iq3[i] = (uint8_t)(NEXT() % 128);
    for (int i = 0; i < 2048 * 8; i++) iq1[i] = (int8_t)((int)(NEXT() % 3) - 1);
    for (int i = 0; i < 128; i++) ks[i] = (uint8_t)NEXT();
    for (int i = 0; i < 16; i++) { nl[i] = (int8_t)(uint8_t)NEXT(); mx[i] = (int8_t)(uint8_t)NEXT(); }
    nl[0] = -128;
    mx[15] = 127;
    static const int8_t e2m1x2[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
    if (mx_own) memcpy(mx, e2m1x2, sizeof mx);
#undef NEXT
    check(cpumla_gguf_tables(iq2, iq3, iq1, ks, nl, mx) == 0, "cpumla_gguf_tables refused in-range tables: %s",
          cpumla_last_error());
}

typedef struct {
    cpumla_weight w;
    uint8_t *data;
    const gq_case_type *ty;
} gqw;

static void put16(uint8_t *p, uint16_t v) { p[0] = (uint8_t)(v & 0xff); p[1] = (uint8_t)(v >> 8); }

/* rows x cols of random blocks, each row followed by pad poisoned bytes; allocated to the last byte */
static gqw make_gqw(const gq_case_type *ty, int64_t rows, int64_t cols, int64_t pad) {
    gqw t;
    memset(&t, 0, sizeof t);
    const int64_t nb = cols / ty->block, rb = nb * ty->bytes + pad;
    t.data = malloc((size_t)(rows * rb));
    if (!t.data) { fprintf(stderr, "out of memory\n"); exit(2); }
    memset(t.data, 0xff, (size_t)(rows * rb));
    for (int64_t r = 0; r < rows; r++)
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *blk = t.data + r * rb + b * ty->bytes;
            for (int i = 0; i < ty->bytes; i++) blk[i] = (uint8_t)rng_u64();
            for (int j = 0; j < 2; j++)
                if (ty->f16[j] >= 0) put16(blk + ty->f16[j], rand_f16_scale());
            if (ty->dtype == CPUMLA_IQ1_M) {     /* d's 16 bits: the top nibbles of the 4 scale words */
                const uint16_t d = rand_f16_scale();
                for (int i = 0; i < 4; i++) {
                    const uint16_t sc = (uint16_t)(blk[48 + 2 * i] | blk[49 + 2 * i] << 8);
                    put16(blk + 48 + 2 * i, (uint16_t)((sc & 0x0fff) | ((d >> (4 * i)) & 15) << 12));
                }
            }
            if (ty->dtype == CPUMLA_MXFP4)       /* E8M0 around 2^0, some e = 0, 1 (subnormal d) */
                blk[0] = (r * nb + b) % 7 == 3 ? (uint8_t)((r + b) % 2) : (uint8_t)(118 + rng_u64() % 18);
        }
    t.w.data = t.data;
    t.w.rows = rows;
    t.w.cols = cols;
    t.w.row_bytes = rb;
    t.w.dtype = ty->dtype;
    t.w.scale_dtype = CPUMLA_F16;
    t.w.block_rows = 1;
    t.w.block_cols = ty->block;
    t.ty = ty;
    return t;
}

/* kernels.h's activation quantization: codes and xd per block of 32 */
static void ref_quant_act(const float *x, int64_t cols, int32_t *q, float *xd) {
    for (int64_t b = 0; b < cols / 32; b++) {
        float amax = 0.0f;
        for (int i = 0; i < 32; i++) amax = fabsf(x[b * 32 + i]) > amax ? fabsf(x[b * 32 + i]) : amax;
        const int tiny = amax < fbits(0x0d800000u);                   /* 2^-100 */
        const float id = tiny ? 0.0f : 127.0f / amax;
        xd[b] = tiny ? 0.0f : amax / 127.0f;
        for (int i = 0; i < 32; i++) {
            volatile float v = x[b * 32 + i] * id;
            q[b * 32 + i] = (int32_t)nearbyintf(v);
        }
    }
}

/* one output as the spec defines it, from gq_unpack's values */
static float ref_gq_dot(const gqw *t, int64_t r, const int32_t *xq, const float *xd) {
    const uint8_t *row = t->data + r * t->w.row_bytes;
    const int64_t cols = t->w.cols;
    float acc = 0.0f;
    gq_unpacked u;
    for (int64_t c0 = 0; c0 < cols; c0 += 256) {
        const int n = cols - c0 >= 256 ? 8 : (int)((cols - c0) / 32);
        gq_unpack(t->w.dtype, row, c0, n, &u);
        for (int c = 0; c < n; c++) {
            int64_t a[2] = {0, 0}, xs[2] = {0, 0};
            for (int i = 0; i < 32; i++) {
                a[i / 16] += (int64_t)u.q[32 * c + i] * xq[c0 + 32 * c + i];
                xs[i / 16] += xq[c0 + 32 * c + i];
            }
            const float xdc = xd[(c0 + 32 * c) / 32];
            volatile float f = u.d[c] * xdc;
            volatile float p = (float)(u.s[2 * c] * a[0] + u.s[2 * c + 1] * a[1]) * f;
            if (t->ty->has_min) {
                volatile float fm = u.dm[c] * xdc;
                volatile float pm = (float)(u.m[2 * c] * xs[0] + u.m[2 * c + 1] * xs[1]) * fm;
                p = p - pm;
            }
            acc += p;
        }
    }
    return acc;
}

static int count_bad_dots(const gqw *t, const float *y, int64_t ldy, int64_t n, int64_t r0, int64_t r1,
                          const int32_t *xq, const float *xd) {
    const int64_t cols = t->w.cols;
    int bad = 0;
    for (int64_t tt = 0; tt < n; tt++)
        for (int64_t r = r0; r < r1; r++)
            bad += bitsf(y[tt * ldy + r - r0]) != bitsf(ref_gq_dot(t, r, xq + tt * cols, xd + tt * (cols / 32)));
    return bad;
}

/* gemm of 1, 3 and (n = 9) 9 tokens: more than a level serves from one unpacked unit (gq_neon.h) */
static void gq_type_case(const cpumla_kernels *k, const gq_case_type *ty, int64_t rows, int64_t cols, int64_t pad,
                         int64_t n) {
    const int64_t ldy = rows + 2;
    gqw t = make_gqw(ty, rows, cols, pad);
    float *x = nan_floats((size_t)(n * cols)), *y = nan_floats((size_t)(n * ldy));
    int32_t *xq = xalloc(sizeof(int32_t) * (size_t)(n * cols));
    float *xd = xalloc(sizeof(float) * (size_t)(n * cols / 32));
    for (int64_t i = 0; i < n * cols; i++) x[i] = rng_sym(2.0f);
    for (int64_t i = 0; i < 32; i++) x[cols + i] = 0.0f;                 /* a zero block */
    for (int64_t i = 64; i < cols; i++) x[2 * cols + i] *= 1e-3f;
    for (int64_t tt = 0; tt < n; tt++) ref_quant_act(x + tt * cols, cols, xq + tt * cols, xd + tt * (cols / 32));
    const char *nm = ty->name;
    const long long R = rows, C = cols;

    case_begin();
    check(k->who_fmt[K_GEMV][ty->dtype] && k->who_fmt[K_GEMM][ty->dtype] && k->who_fmt[K_GEMV_T][ty->dtype] &&
              k->who_fmt[K_DEQUANT][ty->dtype],
          "%s: who_fmt unset", nm);
    kern_gemv(k, &t.w, x, y, 0, rows);
    int bad = count_bad_dots(&t, y, ldy, 1, 0, rows, xq, xd);
    check(!bad, "%s gemv %lldx%lld: %d rows differ from the spec", nm, R, C, bad);
    const int64_t h = rows / 2;                                          /* rows [h, rows) */
    for (int64_t i = 0; i < n * ldy; i++) y[i] = NAN;
    kern_gemv(k, &t.w, x + 2 * cols, y, h, rows);
    bad = count_bad_dots(&t, y, ldy, 1, h, rows, xq + 2 * cols, xd + 2 * (cols / 32));
    check(!bad && isnan(y[rows - h]), "%s gemv rows %lld..%lld of %lldx%lld: %d differ", nm, (long long)h, R, R, C, bad);
    static const int64_t tokens[] = {1, 3, 9};
    for (int j = 0; j < 3 && tokens[j] <= n; j++) {
        const int64_t nn = tokens[j];
        for (int64_t i = 0; i < n * ldy; i++) y[i] = NAN;
        kern_gemm(k, &t.w, x, cols, nn, y, ldy, 0, rows);
        bad = count_bad_dots(&t, y, ldy, nn, 0, rows, xq, xd);
        for (int64_t tt = 0; tt < nn; tt++) bad += !isnan(y[tt * ldy + rows]) + !isnan(y[tt * ldy + rows + 1]);
        check(!bad, "%s gemm %lldx%lld x %lld: %d outputs differ from the spec (or gaps written)", nm, R, C,
              (long long)nn, bad);
    }
    case_end();

    case_begin();
    /* gemv_t over rows [r0, rows), columns [c0, c1) */
    const int64_t r0 = rows > 1 ? 1 : 0, c0 = cols >= 64 ? 32 : 0, c1 = cols >= 96 ? cols - 32 : cols;
    float *yt = nan_floats((size_t)(c1 - c0));
    kern_gemv_t(k, &t.w, r0, rows - r0, x, yt, c0, c1);
    double worst = 0.0;
    for (int64_t c = c0; c < c1; c++) {
        double ref = 0.0, mag = 1e-30;
        for (int64_t r = r0; r < rows; r++) {
            const double v = (double)x[r - r0] * (double)gq_value(&t.w, r, c);
            ref += v;
            mag += fabs(v);
        }
        worst = fmax(worst, fabs(yt[c - c0] - ref) / mag);
    }
    check(worst <= 1e-5, "%s gemv_t %lldx%lld columns %lld..%lld: relative error %g", nm, R, C, (long long)c0,
          (long long)c1, worst);
    /* dequant: the last row whole, row 0's columns [c0, c1) */
    float *row = nan_floats((size_t)cols);
    kern_dequant(k, &t.w, rows - 1, 0, cols, row);
    bad = 0;
    for (int64_t c = 0; c < cols; c++) bad += (double)row[c] != (double)gq_value(&t.w, rows - 1, c);
    check(!bad, "%s dequant %lld columns: %d differ from gq_value", nm, C, bad);
    for (int64_t c = 0; c < cols; c++) row[c] = NAN;
    kern_dequant(k, &t.w, 0, c0, c1, row);
    bad = 0;
    for (int64_t c = c0; c < c1; c++) bad += (double)row[c - c0] != (double)gq_value(&t.w, 0, c);
    for (int64_t c = c1 - c0; c < cols; c++) bad += !isnan(row[c]);
    check(!bad, "%s dequant columns %lld..%lld of %lld: %d differ from gq_value (or past c1 written)", nm,
          (long long)c0, (long long)c1, C, bad);
    case_end();

    free(t.data);
    free(x);
    free(y);
    free(xq);
    free(xd);
    free(yt);
    free(row);
}

void test_gguf_types(const cpumla_kernels *k) {
    /* 32-column types: 288 and 800 columns (not multiples of 256) */
    static const int64_t shapes32[][3] = {{1, 32, 0}, {7, 288, 6}, {13, 800, 13}};
    static const int64_t shapes256[][3] = {{1, 256, 0}, {7, 512, 6}, {13, 768, 13}};
    gq_test_tables(0);
    for (int i = 0; i < GQ_CASE_TYPES; i++) {
        const gq_case_type *ty = &gq_case_types[i];
        const gq_type *g = gq_info(ty->dtype);
        check(g->block == ty->block && g->bytes == ty->bytes && g->has_min == ty->has_min && !strcmp(g->name, ty->name),
              "gq_types[%s] is not ggml's layout", ty->name);
        const int64_t(*shapes)[3] = ty->block == 32 ? shapes32 : shapes256;
        for (int s = 0; s < (small_mode ? 2 : 3); s++)
            gq_type_case(k, ty, shapes[s][0], shapes[s][1], shapes[s][2], s == 1 ? 9 : 3);
    }
    gq_test_tables(1);                  /* MXFP4 again, with its own table */
    for (int i = 0; i < GQ_CASE_TYPES; i++)
        if (gq_case_types[i].dtype == CPUMLA_MXFP4)
            for (int s = 0; s < (small_mode ? 2 : 3); s++)
                gq_type_case(k, &gq_case_types[i], shapes32[s][0], shapes32[s][1], shapes32[s][2], s == 1 ? 9 : 3);
    gq_test_tables(0);
}
