/* test_gemm.c: the gemm entry on the edges of the blocked GEMMs (one group of test_kernels.c's table,
 * every implementation), against ref.h's double-precision dot products:
 *   token counts around the microkernels' tiles (2..15, 29, 45) and past the token chunks (300);
 *   row ranges that start and end inside a panel; columns past and between the K chunks (not a
 *   multiple of 16); x and y with strides (ldx, ldy) whose gaps must stay untouched;
 *   FP8 with partial 128x128 blocks in both directions, row ranges starting inside a block, E8M0 and
 *   F32 scales; NaN codes inside a packed panel (their rows, and only those, give NaN); FP8 rows
 *   long enough that the activations are converted in several chunks of tokens. */
#include "core/kernels.h"
#include "ref.h"

#define SENT 12345.0f
static const double TOL = 1e-5;   /* |err| <= TOL * sum |terms|, as test_kernels.c's TOL_DOT */

typedef struct {
    int64_t rows, cols;
    int dtype, sdtype, brows, bcols;
    int64_t pad;
} gcase;

/* rows [r0, r1) of t times n tokens; returns the number of failed checks */
static int run_case(const cpumla_kernels *k, const tweight *t, const char *nm, int64_t n, int64_t r0, int64_t r1) {
    const int64_t cols = t->w.cols, ldx = cols + 7, nr = r1 - r0, ldy = nr + 5;
    float *x = nan_floats((size_t)(n * ldx + 64));
    for (int64_t tt = 0; tt < n; tt++)
        for (int64_t c = 0; c < cols; c++) x[tt * ldx + c] = rng_sym(1.0f);
    float *y = xalloc(sizeof(float) * (size_t)(n * ldy));
    for (int64_t i = 0; i < n * ldy; i++) y[i] = SENT;
    case_begin();
    if (n == 1) kern_gemv(k, &t->w, x, y, r0, r1);          /* n = 1: decode's gemv */
    else kern_gemm(k, &t->w, x, ldx, n, y, ldy, r0, r1);
    int bad = 0, gap_ok = 1, before = n_fail;
    for (int64_t tt = 0; tt < n; tt++) {
        for (int64_t i = 0; i < nr && bad < 3; i++) {
            double mag, ref = ref_row_dot(t, r0 + i, x + tt * ldx, &mag);
            float got = y[tt * ldy + i];
            int ok = isnan(ref) ? isnan(got) : close_to(got, ref, mag, TOL);
            if (!check(ok, "gemm %s n=%lld rows [%lld,%lld): y[%lld,%lld] = %.9g, want %.9g", nm, (long long)n,
                       (long long)r0, (long long)r1, (long long)tt, (long long)i, got, ref))
                bad++;
        }
        for (int64_t i = nr; i < ldy; i++) gap_ok &= y[tt * ldy + i] == SENT;
    }
    check(gap_ok, "gemm %s n=%lld wrote into the gap of y (ldy)", nm, (long long)n);
    case_end();
    free(x);
    free(y);
    return n_fail - before;
}

static void name_of(const gcase *c, char *buf, size_t n) {
    if (c->dtype == CPUMLA_E4M3 || c->dtype == CPUMLA_E2M1)
        snprintf(buf, n, "%s/%s[%dx%d] %lldx%lld", dtype_name(c->dtype), dtype_name(c->sdtype), c->brows, c->bcols,
                 (long long)c->rows, (long long)c->cols);
    else
        snprintf(buf, n, "%s %lldx%lld", dtype_name(c->dtype), (long long)c->rows, (long long)c->cols);
}

/* FP8 rows long enough that a gemm converts its activations in several chunks of tokens
 * (avx512.c: 2 MiB of bf16 per chunk, 26 tokens of 40000 columns), one row block of 8 rows. */
static void gemm_e4m3_token_chunks(const cpumla_kernels *k) {
    if (small_mode) return;
    int64_t R = 8, C = 40000, n = 30, ldx = C + 1;
    tweight t = make_weight(R, C, CPUMLA_E4M3, CPUMLA_F32, 128, 128, 0);
    float *x = nan_floats((size_t)(n * ldx + 64));
    for (int64_t i = 0; i < n * ldx; i++) if (i % ldx < C) x[i] = rng_sym(1.0f);
    float *y = xalloc(sizeof(float) * (size_t)(n * R));
    case_begin();
    kern_gemm(k, &t.w, x, ldx, n, y, R, 0, R);
    int bad = 0;
    for (int64_t tt = 0; tt < n && bad < 3; tt++)
        for (int64_t r = 0; r < R && bad < 3; r++) {
            double mag, ref = ref_row_dot(&t, r, x + tt * ldx, &mag);
            if (!check(close_to(y[tt * R + r], ref, mag, TOL), "gemm E4M3 8x40000 n=30: y[%lld,%lld] = %.9g, want %.9g",
                       (long long)tt, (long long)r, y[tt * R + r], ref)) bad++;
        }
    case_end();
    free(x); free(y); free_weight(&t);
}

void test_gemm_tiles(const cpumla_kernels *k) {
    static const gcase cs[] = {
        {77, 600, CPUMLA_BF16, 0, 0, 0, 2},        /* K chunks of 256 / 512 and a tail of 8 */
        {70, 2100, CPUMLA_BF16, 0, 0, 0, 0},       /* past 2048-column chunks */
        {45, 290, CPUMLA_F32, 0, 0, 0, 4},
        {40, 530, CPUMLA_F16, 0, 0, 0, 0},
        {300, 650, CPUMLA_E4M3, CPUMLA_F32, 128, 128, 0},     /* partial blocks both ways */
        {150, 1100, CPUMLA_E4M3, CPUMLA_E8M0, 128, 128, 3},
        {90, 200, CPUMLA_E4M3, CPUMLA_F32, 64, 80, 0},        /* block edges inside 16 / 32 / 64 columns */
        {50, 544, CPUMLA_E2M1, CPUMLA_E8M0, 1, 32, 0},
    };
    static const int64_t ns[] = {2, 3, 4, 5, 13, 14, 15, 29, 45};
    for (size_t ci = 0; ci < sizeof cs / sizeof cs[0]; ci++) {
        const gcase *c = &cs[ci];
        char nm[96];
        name_of(c, nm, sizeof nm);
        tweight t = make_weight(c->rows, c->cols, c->dtype, c->sdtype, c->brows, c->bcols, c->pad);
        for (size_t ni = 0; ni < sizeof ns / sizeof ns[0]; ni++) {
            if (small_mode && ns[ni] > 15) continue;
            /* all rows, then a range starting and ending inside panels (and E4M3 blocks) */
            if (run_case(k, &t, nm, ns[ni], 0, c->rows)) break;
            if (run_case(k, &t, nm, ns[ni], c->rows / 5 + 1, c->rows - 3)) break;
        }
        free_weight(&t);
    }

    /* more tokens than one token chunk holds (avx2_gemm.c: 192 for E4M3; avx512f_gemm.c: 256) */
    static const gcase many[] = {{40, 100, CPUMLA_BF16, 0, 0, 0, 0}, {40, 300, CPUMLA_E4M3, CPUMLA_F32, 128, 128, 0}};
    for (size_t ci = 0; ci < sizeof many / sizeof many[0] && !small_mode; ci++) {
        char nm[96];
        name_of(&many[ci], nm, sizeof nm);
        tweight t = make_weight(many[ci].rows, many[ci].cols, many[ci].dtype, many[ci].sdtype, many[ci].brows,
                                many[ci].bcols, 0);
        run_case(k, &t, nm, 300, 3, many[ci].rows);
        free_weight(&t);
    }

    /* NaN codes inside full panels: E4M3 0x7f / 0xff decode to NaN (their rows' outputs are NaN, the
     * reference's too), wherever a packing step takes its fast path */
    tweight t = make_weight(64, 320, CPUMLA_E4M3, CPUMLA_F32, 128, 128, 0);
    uint8_t *d = t.data;
    d[20 * t.w.row_bytes + 70] = 0x7f;
    t.qd[20 * 320 + 70] = t.wd[20 * 320 + 70] = NAN;
    d[45 * t.w.row_bytes + 200] = 0xff;
    t.qd[45 * 320 + 200] = t.wd[45 * 320 + 200] = NAN;
    run_case(k, &t, "E4M3 64x320 with NaN codes", 1, 0, 64);      /* gemv's row loops */
    run_case(k, &t, "E4M3 64x320 with NaN codes", 3, 0, 64);      /* avx2: a few tokens' row loops */
    run_case(k, &t, "E4M3 64x320 with NaN codes", 7, 0, 64);
    run_case(k, &t, "E4M3 64x320 with NaN codes", 20, 0, 64);     /* amx: the tiles' decode */
    free_weight(&t);
    /* and in the columns past the last whole step of 32 / 64 */
    t = make_weight(9, 263, CPUMLA_E4M3, CPUMLA_F32, 128, 128, 0);
    d = t.data;
    d[4 * t.w.row_bytes + 260] = 0xff;
    t.qd[4 * 263 + 260] = t.wd[4 * 263 + 260] = NAN;
    run_case(k, &t, "E4M3 9x263 with a NaN code in the tail", 1, 0, 9);
    run_case(k, &t, "E4M3 9x263 with a NaN code in the tail", 2, 0, 9);
    run_case(k, &t, "E4M3 9x263 with a NaN code in the tail", 5, 0, 9);
    free_weight(&t);
    gemm_e4m3_token_chunks(k);
}
