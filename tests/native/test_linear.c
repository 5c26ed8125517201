/* test_linear.c: the kernel table's linear algebra (gemv, gemm, gemv_t, dequant_row through kern_gemv
 * and its siblings) over every weight format and layout, against the double-precision references of
 * ref.h. Run per level by test_kernels.c. */
#include "core/kernels.h"
#include "ref.h"

#define SENT 12345.0f

/* ---- weight cases ----------------------------------------------------------------------------- */
typedef struct {
    int64_t rows, cols;
    int dtype, sdtype, brows, bcols;
    int64_t pad;
    int big;          /* skipped with --small */
} wcase;

static const wcase wcases[] = {
    {1, 1, CPUMLA_F32, 0, 0, 0, 0, 0},
    {3, 17, CPUMLA_F32, 0, 0, 0, 0, 0},
    {33, 67, CPUMLA_F32, 0, 0, 0, 12, 0},
    {64, 256, CPUMLA_F32, 0, 0, 0, 0, 0},
    {130, 1031, CPUMLA_F32, 0, 0, 0, 0, 1},
    {1, 3, CPUMLA_BF16, 0, 0, 0, 0, 0},
    {7, 100, CPUMLA_BF16, 0, 0, 0, 6, 0},
    {64, 512, CPUMLA_BF16, 0, 0, 0, 0, 0},
    {129, 1031, CPUMLA_BF16, 0, 0, 0, 0, 1},
    {37, 4133, CPUMLA_BF16, 0, 0, 0, 4, 0},       /* past avx512.c's 2048-column gemm chunks */
    {2, 5, CPUMLA_F16, 0, 0, 0, 0, 0},
    {17, 130, CPUMLA_F16, 0, 0, 0, 2, 0},
    {129, 1031, CPUMLA_F16, 0, 0, 0, 0, 1},
    /* FP8, 128x128 blocks: partial edge blocks, a 2x3 grid, one element, a column tail */
    {200, 300, CPUMLA_E4M3, CPUMLA_F32, 128, 128, 0, 0},
    {1, 1, CPUMLA_E4M3, CPUMLA_F32, 128, 128, 0, 0},
    {128, 128, CPUMLA_E4M3, CPUMLA_F32, 128, 128, 0, 0},
    {257, 129, CPUMLA_E4M3, CPUMLA_F32, 128, 128, 3, 0},
    {31, 1000, CPUMLA_E4M3, CPUMLA_F32, 128, 128, 0, 0},
    {64, 7168, CPUMLA_E4M3, CPUMLA_F32, 128, 128, 0, 1},
    {200, 300, CPUMLA_E4M3, CPUMLA_E8M0, 128, 128, 0, 0},
    {129, 385, CPUMLA_E4M3, CPUMLA_E8M0, 128, 128, 5, 0},
    {100, 150, CPUMLA_E4M3, CPUMLA_F32, 32, 48, 0, 0},
    /* FP4, 1x32 blocks of E8M0: odd columns, partial last block (the fp32 product), whole blocks (the
     * integer one) */
    {1, 1, CPUMLA_E2M1, CPUMLA_E8M0, 1, 32, 0, 0},
    {3, 33, CPUMLA_E2M1, CPUMLA_E8M0, 1, 32, 0, 0},
    {7, 64, CPUMLA_E2M1, CPUMLA_E8M0, 1, 32, 0, 0},
    {33, 100, CPUMLA_E2M1, CPUMLA_E8M0, 1, 32, 5, 0},
    {5, 31, CPUMLA_E2M1, CPUMLA_E8M0, 1, 32, 0, 0},
    {16, 2048, CPUMLA_E2M1, CPUMLA_E8M0, 1, 32, 0, 0},
    {64, 7168, CPUMLA_E2M1, CPUMLA_E8M0, 1, 32, 0, 1},
    /* the gemv loops' edges: an odd count of 32-column groups (avx2 steps 64 columns), past the
     * column chunks x is rearranged in (avx2 16384, neon 4096) with a partial last block, wider and
     * taller blocks with F32 scales, and a block width the fast paths hand back */
    {6, 96, CPUMLA_E2M1, CPUMLA_E8M0, 1, 32, 0, 0},
    {5, 16485, CPUMLA_E2M1, CPUMLA_E8M0, 1, 32, 3, 0},
    {9, 200, CPUMLA_E2M1, CPUMLA_F32, 2, 64, 0, 0},
    {7, 160, CPUMLA_E2M1, CPUMLA_E8M0, 3, 96, 1, 0},
    {5, 70, CPUMLA_E2M1, CPUMLA_E8M0, 1, 16, 0, 0},
    /* 1x32 E8M0 blocks over whole blocks take the integer product (kernels.h, ref.h's ref_row_dot):
     * a scale row shared by 3 weight rows */
    {10, 256, CPUMLA_E2M1, CPUMLA_E8M0, 3, 32, 2, 0},
};
#define N_WCASES ((int)(sizeof wcases / sizeof wcases[0]))

static void wname(const wcase *c, char *buf, size_t n) {
    if (c->dtype == CPUMLA_E4M3 || c->dtype == CPUMLA_E2M1)
        snprintf(buf, n, "%s/%s[%dx%d] %lldx%lld", dtype_name(c->dtype), dtype_name(c->sdtype), c->brows,
                 c->bcols, (long long)c->rows, (long long)c->cols);
    else
        snprintf(buf, n, "%s %lldx%lld", dtype_name(c->dtype), (long long)c->rows, (long long)c->cols);
}

static const double TOL_DOT = 1e-5;   /* |err| <= TOL_DOT * sum |terms| */

void test_gemv(const cpumla_kernels *k) {
    for (int ci = 0; ci < N_WCASES; ci++) {
        const wcase *c = &wcases[ci];
        if (small_mode && c->big) continue;
        char nm[96];
        wname(c, nm, sizeof nm);
        tweight t = make_weight(c->rows, c->cols, c->dtype, c->sdtype, c->brows, c->bcols, c->pad);
        float *x = make_vec(c->cols, 1.0f);
        int64_t ranges[2][2] = {{0, c->rows}, {c->rows / 3, c->rows - c->rows / 5}};
        for (int ri = 0; ri < 2; ri++) {
            int64_t r0 = ranges[ri][0], r1 = ranges[ri][1], nr = r1 - r0;
            float *y = xalloc(sizeof(float) * (size_t)(nr + 4));
            for (int64_t i = 0; i < nr + 4; i++) y[i] = SENT;
            case_begin();
            kern_gemv(k, &t.w, x, y, r0, r1);
            int bad = 0;
            for (int64_t i = 0; i < nr && bad < 3; i++) {
                double mag, ref = ref_row_dot(&t, r0 + i, x, &mag);
                if (!check(close_to(y[i], ref, mag, TOL_DOT), "gemv %s rows [%lld,%lld): y[%lld] = %.9g, want %.9g",
                           nm, (long long)r0, (long long)r1, (long long)i, y[i], ref)) bad++;
            }
            check(y[nr] == SENT && y[nr + 3] == SENT, "gemv %s wrote past row r1", nm);
            case_end();
            free(y);
        }
        free(x);
        free_weight(&t);
    }
}

void test_gemm(const cpumla_kernels *k) {
    static const int64_t ns[] = {1, 3, 6};
    for (int ci = 0; ci < N_WCASES; ci++) {
        const wcase *c = &wcases[ci];
        if (small_mode && c->big) continue;
        char nm[96];
        wname(c, nm, sizeof nm);
        tweight t = make_weight(c->rows, c->cols, c->dtype, c->sdtype, c->brows, c->bcols, c->pad);
        for (int ni = 0; ni < 3; ni++) {
            int64_t n = ns[ni], ldx = c->cols + 3, r0 = c->rows / 4, r1 = c->rows, nr = r1 - r0, ldy = nr + 2;
            float *x = nan_floats((size_t)(n * ldx + 64));
            for (int64_t tt = 0; tt < n; tt++)
                for (int64_t i = 0; i < c->cols; i++) x[tt * ldx + i] = rng_sym(1.0f);
            float *y = xalloc(sizeof(float) * (size_t)(n * ldy));
            for (int64_t i = 0; i < n * ldy; i++) y[i] = SENT;
            case_begin();
            kern_gemm(k, &t.w, x, ldx, n, y, ldy, r0, r1);
            int bad = 0, gap_ok = 1;
            for (int64_t tt = 0; tt < n; tt++) {
                for (int64_t i = 0; i < nr && bad < 3; i++) {
                    double mag, ref = ref_row_dot(&t, r0 + i, x + tt * ldx, &mag);
                    float got = y[tt * ldy + i];
                    if (!check(close_to(got, ref, mag, TOL_DOT), "gemm %s n=%lld rows [%lld,%lld): y[%lld,%lld] = %.9g, want %.9g",
                               nm, (long long)n, (long long)r0, (long long)r1, (long long)tt, (long long)i, got, ref))
                        bad++;
                }
                gap_ok &= y[tt * ldy + nr] == SENT && y[tt * ldy + nr + 1] == SENT;
            }
            check(gap_ok, "gemm %s n=%lld wrote into the gap of y (ldy)", nm, (long long)n);
            case_end();
            free(x);
            free(y);
        }
        free_weight(&t);
    }
}


void test_gemv_t(const cpumla_kernels *k) {
    for (int ci = 0; ci < N_WCASES; ci++) {
        const wcase *c = &wcases[ci];
        if (small_mode && c->big) continue;
        char nm[96];
        wname(c, nm, sizeof nm);
        tweight t = make_weight(c->rows, c->cols, c->dtype, c->sdtype, c->brows, c->bcols, c->pad);
        int64_t R = c->rows, C = c->cols;
        int64_t rr[3][4] = {{0, R, 0, C}, {R / 4, R - R / 4 - R / 8, C / 5, C - C / 7}, {R / 2, 0, 1 < C ? 1 : 0, C}};
        for (int ri = 0; ri < 3; ri++) {
            int64_t r0 = rr[ri][0], nr = rr[ri][1], c0 = rr[ri][2], c1 = rr[ri][3], nc = c1 - c0;
            float *x = make_vec(nr, 1.0f);
            float *y = xalloc(sizeof(float) * (size_t)(nc + 4));
            for (int64_t i = 0; i < nc + 4; i++) y[i] = SENT;
            case_begin();
            kern_gemv_t(k, &t.w, r0, nr, x, y, c0, c1);
            int bad = 0;
            for (int64_t cc = c0; cc < c1 && bad < 3; cc++) {
                double s = 0, mag = 0;
                for (int64_t i = 0; i < nr; i++) {
                    double p = ref_term(&t, r0 + i, cc, x[i]);
                    s += p;
                    mag += fabs(p);
                }
                if (!check(close_to(y[cc - c0], s, mag, TOL_DOT),
                           "gemv_t %s rows %lld+%lld cols [%lld,%lld): y[%lld] = %.9g, want %.9g", nm,
                           (long long)r0, (long long)nr, (long long)c0, (long long)c1, (long long)(cc - c0),
                           y[cc - c0], s))
                    bad++;
            }
            check(y[nc] == SENT && y[nc + 3] == SENT, "gemv_t %s wrote past c1", nm);
            case_end();
            free(x);
            free(y);
        }
        free_weight(&t);
    }
}

void test_dequant(const cpumla_kernels *k) {
    for (int ci = 0; ci < N_WCASES; ci++) {
        const wcase *c = &wcases[ci];
        if (small_mode && c->big) continue;
        char nm[96];
        wname(c, nm, sizeof nm);
        tweight t = make_weight(c->rows, c->cols, c->dtype, c->sdtype, c->brows, c->bcols, c->pad);
        int64_t rs[3] = {0, c->rows / 2, c->rows - 1};
        int64_t c0 = c->cols / 3, c1 = c->cols, nc = c1 - c0;
        float *out = xalloc(sizeof(float) * (size_t)(nc + 4));
        for (int ri = 0; ri < 3; ri++) {
            for (int64_t i = 0; i < nc + 4; i++) out[i] = SENT;
            case_begin();
            kern_dequant(k, &t.w, rs[ri], c0, c1, out);
            int ok = 1;
            int64_t at = -1;
            for (int64_t cc = c0; cc < c1; cc++)
                if (out[cc - c0] != (float)t.wd[rs[ri] * c->cols + cc]) { ok = 0; at = cc; break; }
            check(ok, "dequant_row %s row %lld: column %lld = %.9g, want %.9g", nm, (long long)rs[ri],
                  (long long)at, at >= 0 ? out[at - c0] : 0.0, at >= 0 ? t.wd[rs[ri] * c->cols + at] : 0.0);
            check(out[nc] == SENT, "dequant_row %s wrote past c1", nm);
            case_end();
        }
        free(out);
        free_weight(&t);
    }
}
