/* test_gguf_q.c: a kernel table's products with GGUF's Q8_0 weights (cpumla.h: 34-byte blocks of an
 * fp16 scale then 32 int8 codes, read in place), reached as every caller reaches them (kern_gemv,
 * kern_gemm, kern_gemv_t, kern_dequant), against references written from cpumla.h and kernels.h: the
 * activations quantized here as kernels.h defines it, exact block sums, each block's term
 * (float)isum * (d * xd) rounded once and added in block order in fp32, so gemv and gemm must match
 * bit for bit; gemv_t against double; dequant exact. Codes span [-128, 127], rows are padded with
 * poisoned bytes, odd row counts and token counts. */
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
