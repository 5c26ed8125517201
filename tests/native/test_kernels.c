/* test_kernels.c: every kernel-table entry of every level built in and runnable here, against the
 * double-precision references of ref.h (in the style of llama.cpp's test-backend-ops): the row-wise,
 * attention and probe entries here, the linear algebra in test_linear.c, the integer products in
 * test_quant.c; then the public API (test_api.c).
 *
 *   test_kernels [--small] [--expect-isa NAME] [-v]
 *     --small       smaller shapes (for runs under qemu)
 *     --expect-isa  cpumla_init("") must pick NAME (run.sh nehalem: scalar)
 * Prints one line per implementation and case group, then "N passed, M failed"; exits 1 on failure.
 * The pass/fail bookkeeping (check, case_begin/case_end, watchdog) is in harness.c. */
#include "core/kernels.h"
#include "ref.h"

/* one line per (implementation, case group) */
static int g_pass, g_fail;
static void group_begin(void) { g_pass = n_pass; g_fail = n_fail; }
static void group_end(const char *group, const char *who) {
    int p = n_pass - g_pass, f = n_fail - g_fail;
    printf("%-8s %-12s %4d passed %3d failed   (%s)\n", cur_isa, group, p, f, who ? who : "");
}

#define SENT 12345.0f

/* ---- the implementations, least preferred first (dispatch.c's list) --------------------------- */
#if defined(__x86_64__)
static const char *impls[] = {"scalar", "avx2", "avxvnni", "avx512f", "avx512vnni", "avx512", "amx"};
#elif defined(__aarch64__)
static const char *impls[] = {"scalar", "neon"};
#else
static const char *impls[] = {"scalar"};
#endif
#define N_IMPLS ((int)(sizeof impls / sizeof impls[0]))

/* ---- row ops ---------------------------------------------------------------------------------- */
static void test_rmsnorm(const cpumla_kernels *k) {
    static const int64_t dims[] = {1, 7, 64, 100, 1000, 7168};
    static const int wdt[] = {-1, CPUMLA_F32, CPUMLA_BF16, CPUMLA_F16};
    for (int di = 0; di < 6; di++) {
        int64_t dim = dims[di];
        if (small_mode && dim > 1000) continue;
        for (int wi = 0; wi < 4; wi++)
            for (int inplace = 0; inplace < 2; inplace++) {
                float *x = make_vec(dim, 3.0f);
                void *wbuf = NULL;
                double *wv = xalloc(sizeof(double) * (size_t)dim);
                if (wdt[wi] >= 0) {
                    wbuf = xalloc((size_t)dim * 4 + 64);
                    memset(wbuf, 0xff, (size_t)dim * 4 + 64);
                    for (int64_t i = 0; i < dim; i++) {
                        float f = rng_sym(2.0f);
                        if (wdt[wi] == CPUMLA_F32) { ((float *)wbuf)[i] = f; wv[i] = f; }
                        else if (wdt[wi] == CPUMLA_BF16) {
                            uint16_t h = (uint16_t)(bitsf(f) >> 16);
                            ((uint16_t *)wbuf)[i] = h;
                            wv[i] = ref_bf16(h);
                        } else {
                            double hv = ldexp(1024 + (double)(rng_u64() % 1024), (int)(rng_u64() % 3) - 12);
                            uint16_t h = ref_f16_bits(f < 0 ? -hv : hv);
                            ((uint16_t *)wbuf)[i] = h;
                            wv[i] = ref_f16(h);
                        }
                    }
                }
                double ss = 0;
                for (int64_t i = 0; i < dim; i++) ss += (double)x[i] * x[i];
                double inv = 1.0 / sqrt(ss / dim + 1e-6);
                double *ref = xalloc(sizeof(double) * (size_t)dim);
                double mx = 0;
                for (int64_t i = 0; i < dim; i++) {
                    ref[i] = x[i] * inv * (wbuf ? wv[i] : 1.0);
                    mx = dmax(mx, fabs(ref[i]));
                }
                float *y = inplace ? x : nan_floats((size_t)dim + 4);
                if (!inplace) for (int64_t i = dim; i < dim + 4; i++) y[i] = SENT;
                case_begin();
                k->rmsnorm_row(x, y, dim, wbuf, wdt[wi] >= 0 ? wdt[wi] : CPUMLA_F32, 1e-6f);
                int bad = 0;
                for (int64_t i = 0; i < dim && bad < 2; i++)
                    if (!check(close_to(y[i], ref[i], fabs(ref[i]) + 1e-3 * mx, 1e-5),
                               "rmsnorm dim %lld weight %s%s: y[%lld] = %.9g, want %.9g", (long long)dim,
                               wdt[wi] < 0 ? "none" : dtype_name(wdt[wi]), inplace ? " in place" : "",
                               (long long)i, y[i], ref[i]))
                        bad++;
                if (!inplace) { check(y[dim] == SENT, "rmsnorm dim %lld wrote past dim", (long long)dim); free(y); }
                case_end();
                free(x); free(wbuf); free(wv); free(ref);
            }
    }
}

static double ref_silu_mul(float g, float u, float limit) {
    double gg = g, uu = u;
    if (limit > 0) {
        gg = fmin(gg, limit);
        uu = fmax(fmin(uu, limit), -limit);
    }
    return gg / (1.0 + exp(-gg)) * uu;
}

static void test_swiglu(const cpumla_kernels *k) {
    static const int64_t dims[] = {1, 3, 8, 37, 1024};
    static const float limits[] = {0.0f, 7.0f};
    for (int di = 0; di < 5; di++)
        for (int li = 0; li < 2; li++)
            for (int inplace = 0; inplace < 2; inplace++) {
                int64_t dim = dims[di];
                float *g = make_vec(dim, 20.0f), *u = make_vec(dim, 20.0f);
                if (dim > 3) { g[0] = -100.0f; g[1] = 90.0f; g[2] = 0.0f; }
                double *ref = xalloc(sizeof(double) * (size_t)dim);
                for (int64_t i = 0; i < dim; i++) ref[i] = ref_silu_mul(g[i], u[i], limits[li]);
                float *out = inplace ? g : nan_floats((size_t)dim + 4);
                if (!inplace) for (int64_t i = dim; i < dim + 4; i++) out[i] = SENT;
                case_begin();
                k->swiglu_row(g, u, out, dim, limits[li]);
                int bad = 0;
                for (int64_t i = 0; i < dim && bad < 2; i++)
                    if (!check(close_to(out[i], ref[i], fabs(ref[i]) + 1e-30, 1e-5),
                               "swiglu dim %lld limit %g%s: out[%lld] = %.9g, want %.9g", (long long)dim,
                               limits[li], inplace ? " in place" : "", (long long)i, out[i], ref[i]))
                        bad++;
                if (!inplace) { check(out[dim] == SENT, "swiglu wrote past dim"); free(out); }
                case_end();
                free(g); free(u); free(ref);
            }
}

static void test_softmax(const cpumla_kernels *k) {
    static const int64_t ns[] = {1, 3, 4, 17, 100, 1000};
    for (int ni = 0; ni < 6; ni++) {
        int64_t n = ns[ni];
        float *x = make_vec(n, 30.0f);
        if (n > 2) x[n / 2] = -INFINITY;
        for (int64_t i = n; i < n + 4; i++) x[i] = SENT;
        double m = -INFINITY, s = 0;
        for (int64_t i = 0; i < n; i++) m = dmax(m, x[i]);
        double *ref = xalloc(sizeof(double) * (size_t)n);
        for (int64_t i = 0; i < n; i++) { ref[i] = exp((double)x[i] - m); s += ref[i]; }
        for (int64_t i = 0; i < n; i++) ref[i] /= s;
        case_begin();
        k->softmax_row(x, n);
        int bad = 0;
        for (int64_t i = 0; i < n && bad < 2; i++)
            if (!check(fabs(x[i] - ref[i]) <= 1e-5 * ref[i] + 1e-12, "softmax n %lld: x[%lld] = %.9g, want %.9g",
                       (long long)n, (long long)i, x[i], ref[i]))
                bad++;
        check(x[n] == SENT, "softmax wrote past n");
        case_end();
        free(x); free(ref);
    }
}

/* ---- attention part --------------------------------------------------------------------------- */
typedef struct { int64_t n_kv, H, dk, dv; int big; } acase;
static const acase acases[] = {
    {1, 1, 8, 8, 0}, {19, 2, 13, 7, 0}, {37, 5, 40, 32, 0}, {50, 4, 72, 64, 0},
    {100, 16, 576, 512, 1}, {64, 3, 512, 512, 1},
};

/* One attn_part call: query qi of a 2-query problem, heads [h0, h1), entries [j0, j1). Every kv row
 * the call must not read is NaN; so are the columns past dk and the q values past dk. */
static void attn_part_case(const cpumla_kernels *k, const acase *c, int bf16, int use_idx, int64_t h0,
                           int64_t h1, int64_t j0, int64_t j1, const char *what) {
    int64_t n_kv = c->n_kv, H = c->H, dk = c->dk, dv = c->dv, ld_kv = dk + 5, rows_alloc = n_kv + 3;
    int64_t ldq_h = dk + 3, ldq_t = H * ldq_h + 1, n_q = 2, qi = 1;
    int64_t L = use_idx ? n_kv + 5 : n_kv, ld_idx = L + 2;
    float *q = nan_floats((size_t)(n_q * ldq_t));
    for (int64_t t = 0; t < n_q; t++)
        for (int64_t h = 0; h < H; h++)
            for (int64_t d = 0; d < dk; d++) q[t * ldq_t + h * ldq_h + d] = rng_sym(2.0f);
    int32_t *idx = NULL;
    if (use_idx) {
        idx = xalloc(sizeof(int32_t) * (size_t)(n_q * ld_idx));
        for (int64_t i = 0; i < n_q * ld_idx; i++) idx[i] = (int32_t)(rng_u64() % (uint64_t)n_kv);
        int32_t bad_entries[] = {-1, (int32_t)n_kv, (int32_t)n_kv + 2, -7};
        for (int b = 0; b < 4 && b < L; b++) idx[qi * ld_idx + (b * 3) % L] = bad_entries[b];
    }
    /* rows this call reads */
    int64_t *rows = xalloc(sizeof(int64_t) * (size_t)(L + 1));
    int64_t nrows = 0;
    char *used = calloc((size_t)rows_alloc, 1);
    for (int64_t j = j0; j < j1; j++) {
        int64_t r = use_idx ? idx[qi * ld_idx + j] : j;
        if (r < 0 || r >= n_kv) continue;
        rows[nrows++] = r;
        used[r] = 1;
    }
    size_t esz = bf16 ? 2 : 4;
    void *kv = xalloc((size_t)(rows_alloc * ld_kv) * esz);
    for (int64_t r = 0; r < rows_alloc; r++)
        for (int64_t d = 0; d < ld_kv; d++) {
            float v = (used[r] && d < dk) ? rng_sym(1.0f) : NAN;
            if (bf16) ((uint16_t *)kv)[r * ld_kv + d] = isnan(v) ? 0x7fc0 : ref_to_bf16(v);
            else ((float *)kv)[r * ld_kv + d] = v;
        }
    cpumla_attn_args a;
    memset(&a, 0, sizeof a);
    a.q = q; a.ldq_t = ldq_t; a.ldq_h = ldq_h; a.n_q = n_q; a.n_heads = H;
    a.kv = kv; a.kv_dtype = bf16 ? CPUMLA_BF16 : CPUMLA_F32; a.ld_kv = ld_kv;
    a.n_kv = n_kv; a.dk = dk; a.dv = dv; a.kv_idx = idx; a.ld_idx = ld_idx;
    a.scale = (float)(1.0 / sqrt((double)dk));
    int64_t nh = h1 - h0;
    float *acc = xalloc(sizeof(float) * (size_t)(nh * dv + 4)), *m = xalloc(sizeof(float) * (size_t)(nh + 2)),
          *l = xalloc(sizeof(float) * (size_t)(nh + 2));
    for (int64_t i = 0; i < nh * dv + 4; i++) acc[i] = SENT;
    for (int64_t i = 0; i < nh + 2; i++) m[i] = l[i] = SENT;
    case_begin();
    k->attn_part(&a, qi, h0, h1, j0, j1, acc, m, l);
    ref_kv rk = {kv, bf16, ld_kv, dk, dv};
    double *out = xalloc(sizeof(double) * (size_t)dv);
    char nm[160];
    snprintf(nm, sizeof nm, "attn_part %s n_kv %lld H %lld dk %lld dv %lld %s%s heads [%lld,%lld) entries [%lld,%lld)",
             what, (long long)n_kv, (long long)H, (long long)dk, (long long)dv, bf16 ? "BF16" : "F32",
             use_idx ? " kv_idx" : "", (long long)h0, (long long)h1, (long long)j0, (long long)j1);
    for (int64_t h = h0; h < h1; h++) {
        int64_t kk = h - h0;
        double lse, smag;
        double rm = ref_attn(&rk, q + qi * ldq_t + h * ldq_h, a.scale, rows, nrows, 0, 0, out, &lse, &smag);
        if (nrows == 0) {
            int zero = 1;
            for (int64_t d = 0; d < dv; d++) zero &= acc[kk * dv + d] == 0.0f;
            check(m[kk] == -INFINITY && l[kk] == 0.0f && zero, "%s: no entry must give m=-inf l=0 acc=0 (got m=%g l=%g)",
                  nm, m[kk], l[kk]);
            continue;
        }
        double tol_s = 2e-6 * smag + 1e-6;
        if (!check(fabs(m[kk] - rm) <= tol_s, "%s head %lld: m = %.9g, want %.9g", nm, (long long)h, m[kk], rm)) continue;
        double got_lse = m[kk] + log((double)l[kk]);
        check(fabs(got_lse - lse) <= 2 * tol_s + 1e-6, "%s head %lld: m + log l = %.9g, want %.9g", nm, (long long)h,
              got_lse, lse);
        int bad = 0;
        for (int64_t d = 0; d < dv && !bad; d++) {
            double o = acc[kk * dv + d] / l[kk];
            if (!check(fabs(o - out[d]) <= 1e-5 + 4 * tol_s, "%s head %lld: acc/l [%lld] = %.9g, want %.9g", nm,
                       (long long)h, (long long)d, o, out[d]))
                bad = 1;
        }
    }
    check(acc[nh * dv] == SENT && m[nh] == SENT && l[nh] == SENT, "%s: wrote past its heads", nm);
    case_end();
    free(q); free(idx); free(rows); free(used); free(kv); free(acc); free(m); free(l); free(out);
}

static void test_attn_part(const cpumla_kernels *k) {
    for (size_t ci = 0; ci < sizeof acases / sizeof acases[0]; ci++) {
        const acase *c = &acases[ci];
        if (small_mode && c->big) continue;
        for (int bf16 = 0; bf16 < 2; bf16++)
            for (int use_idx = 0; use_idx < 2; use_idx++) {
                int64_t L = use_idx ? c->n_kv + 5 : c->n_kv, H = c->H;
                attn_part_case(k, c, bf16, use_idx, 0, H, 0, L, "all");
                if (H > 1 || L > 2)
                    attn_part_case(k, c, bf16, use_idx, H > 1 ? 1 : 0, H, L / 3, L - L / 4, "range");
                attn_part_case(k, c, bf16, use_idx, 0, H, L / 2, L / 2, "empty");
            }
    }
}

/* ---- cache row, read probe -------------------------------------------------------------------- */
static void test_cache_row(const cpumla_kernels *k) {
    static const uint32_t special[] = {0x3f808000u, 0x3f818000u, 0x3f808001u, 0x3f80ffffu, 0x7f7fffffu,
                                       0x7f800000u, 0xff800000u, 0x80000000u, 0x00012345u, 0x80008000u,
                                       0x00018000u, 0x7fc00000u, 0x7f800001u, 0xc0490fdbu};
    int ns = (int)(sizeof special / sizeof special[0]);
    static const int64_t widths[] = {1, 5, 16, 37, 576};
    for (int wi = 0; wi < 5; wi++)
        for (int bf16 = 0; bf16 < 2; bf16++) {
            int64_t w = widths[wi];
            float *src = make_vec(w, 10.0f);
            for (int64_t i = 0; i < w && i < ns; i++) src[(i * 7) % w] = fbits(special[i]);
            uint8_t *dst = xalloc((size_t)(w + 8) * 4);
            memset(dst, 0xa5, (size_t)(w + 8) * 4);
            case_begin();
            k->cache_row(dst, bf16 ? CPUMLA_BF16 : CPUMLA_F32, src, w);
            int ok = 1;
            int64_t at = -1;
            for (int64_t i = 0; i < w && ok; i++) {
                if (bf16) {
                    uint16_t got = ((uint16_t *)dst)[i], want = ref_to_bf16(src[i]);
                    ok = isnan(src[i]) ? ((got & 0x7f80) == 0x7f80 && (got & 0x7f)) : got == want;
                } else {
                    ok = memcmp(dst + 4 * i, src + i, 4) == 0;
                }
                if (!ok) at = i;
            }
            check(ok, "cache_row %s width %lld: element %lld (src bits %08x) -> %04x, want %04x",
                  bf16 ? "BF16" : "F32", (long long)w, (long long)at, at >= 0 ? bitsf(src[at]) : 0,
                  at >= 0 && bf16 ? ((uint16_t *)dst)[at] : 0, at >= 0 ? ref_to_bf16(src[at]) : 0);
            check(dst[(size_t)w * (bf16 ? 2 : 4)] == 0xa5, "cache_row wrote past width");
            case_end();
            free(src); free(dst);
        }
}

/* The sum's form is each file's own (lane sums of u64 or of doubles): check only that every byte
 * counts, first and last words included, with values meaningful either way (1.0 and 2.0 as doubles). */
static void test_read_sum(const cpumla_kernels *k) {
    static const int64_t sizes[] = {64, 192, 4096, 65536 + 320};
    const double one = 1.0, two = 2.0;
    for (int si = 0; si < 4; si++) {
        int64_t b = sizes[si];
        uint64_t *buf = xalloc((size_t)b);
        memset(buf, 0, (size_t)b);
        case_begin();
        double s0 = k->read_sum(buf, b);
        memcpy(&buf[0], &one, 8);
        double s1 = k->read_sum(buf, b);
        memcpy(&buf[b / 8 - 1], &two, 8);
        double s2 = k->read_sum(buf, b);
        check(s0 == 0.0, "read_sum of %lld zero bytes = %g, not 0", (long long)b, s0);
        check(s1 != s0 && s2 != s1, "read_sum of %lld bytes ignores the first or the last word (%g %g %g)",
              (long long)b, s0, s1, s2);
        case_end();
        free(buf);
    }
}

/* ---- driver ----------------------------------------------------------------------------------- */
void test_api(const char *expect_isa);   /* test_api.c */
void test_gemv(const cpumla_kernels *k);      /* test_linear.c */
void test_gemm(const cpumla_kernels *k);
void test_gemv_t(const cpumla_kernels *k);
void test_dequant(const cpumla_kernels *k);
void test_quant(const cpumla_kernels *k);   /* test_quant.c: Q8 / Q4 */
void test_gguf_q(const cpumla_kernels *k);  /* test_gguf_q.c: GGUF's Q8_0 */
void test_gguf_types(const cpumla_kernels *k);  /* test_gguf_q.c: every GGUF block type */
void test_values(void);                  /* test_values.c */
void test_gemm_tiles(const cpumla_kernels *k);   /* test_gemm.c: the blocked GEMMs' edges */
void test_softmax_block(const cpumla_kernels *k);   /* test_attn_block.c */
#if defined(__x86_64__)
void test_daz_ftz(const cpumla_kernels *k);   /* test_values.c */
#endif

static void test_table(const char *name, const cpumla_kernels *k) {
    cur_isa = name;
    struct { const char *group; void (*fn)(const cpumla_kernels *); int id; } groups[] = {
        {"gemv", test_gemv, K_GEMV}, {"gemm", test_gemm, K_GEMM}, {"gemm_tiles", test_gemm_tiles, K_GEMM},
        {"gemv_t", test_gemv_t, K_GEMV_T},
        {"dequant_row", test_dequant, K_DEQUANT}, {"rmsnorm_row", test_rmsnorm, K_RMSNORM},
        {"swiglu_row", test_swiglu, K_SWIGLU}, {"softmax_row", test_softmax, K_SOFTMAX},
        {"attn_part", test_attn_part, K_ATTN}, {"softmax_block", test_softmax_block, K_SOFTMAX_BLOCK},
        {"cache_row", test_cache_row, K_CACHE_ROW},
        {"read_sum", test_read_sum, K_READ}, {"q8/q4", test_quant, K_GEMV},
        {"q8_0", test_gguf_q, K_GEMV}, {"gguf types", test_gguf_types, K_GEMV},
#if defined(__x86_64__)
        {"daz_ftz", test_daz_ftz, K_GEMV},
#endif
    };
    for (size_t g = 0; g < sizeof groups / sizeof groups[0]; g++) {
        char who[128];
        const char *owner = groups[g].fn == test_quant    ? k->who_fmt[K_GEMV][CPUMLA_Q4]
                            : groups[g].fn == test_gguf_q ? k->who_fmt[K_GEMV][CPUMLA_Q8_0]
                            : groups[g].fn == test_gguf_types ? k->who_fmt[K_GEMV][CPUMLA_Q4_K]
                                                          : k->who[groups[g].id];
        snprintf(who, sizeof who, "served by %s", owner ? owner : "nobody");
        group_begin();
        watchdog(groups[g].group);
        /* the entries take their scratch from the current context, as under a public call */
        cpumla_enter(NULL);
        groups[g].fn(k);
        check(cpumla_leave(0) == 0, "%s: a scratch request failed: %s", groups[g].group, cpumla_last_error());
        watchdog(NULL);
        group_end(groups[g].group, who);
    }
}

int main(int argc, char **argv) {
    const char *expect_isa = NULL;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--small")) small_mode = 1;
        else if (!strcmp(argv[i], "-v")) verbose = 1;
        else if (!strcmp(argv[i], "--expect-isa") && i + 1 < argc) expect_isa = argv[++i];
        else { fprintf(stderr, "usage: %s [--small] [--expect-isa NAME] [-v]\n", argv[0]); return 2; }
    }
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (getenv("CPUMLA_TEST_TIMEOUT")) watch_seconds = atoi(getenv("CPUMLA_TEST_TIMEOUT"));
    printf("cpu: %s\nbuilt: %s\n%s\n", cpumla_cpu_name(), cpumla_isa_list(), cpumla_build_info());
    for (int i = 0; i < N_IMPLS; i++) {
        if (!cpumla_isa_available(impls[i])) {    /* it, or a level it builds on, does not run here */
            printf("%s: skipped (CPU or OS lacks %s)\n", impls[i], cpumla_isa_missing(impls[i]));
            continue;
        }
        cpumla_kernels k;
        check(cpumla_fill_level(&k, impls[i]) == 0, "cpumla_fill_level(\"%s\") failed", impls[i]);
        test_table(impls[i], &k);
    }
    test_api(expect_isa);
    test_values();
    printf("%d passed, %d failed\n", n_pass, n_fail);
    return n_fail ? 1 : 0;
}
