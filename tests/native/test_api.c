/* test_api.c: the public API (cpumla.h) under each level this CPU runs: cpumla_init and
 * introspection, then the multi-threaded kernels against the references of ref.h (top-k and routing
 * in test_route.c, contexts in test_context.c, cpumla_mla_mha in test_attn_block.c). */
#include "core/kernels.h"
#include "ref.h"

static int g_pass, g_fail;
static void group_begin(void) { g_pass = n_pass; g_fail = n_fail; }
static void group_end(const char *group) {
    printf("%-8s %-12s %4d passed %3d failed   (public API, %d threads)\n", cur_isa, group, n_pass - g_pass,
           n_fail - g_fail, cpumla_get_threads());
}

#define SENT 12345.0f

#if defined(__x86_64__)
static const char *chain[] = {"scalar", "avx2", "avxvnni", "avx512f", "avx512vnni", "avx512", "amx"};   /* least preferred first */
static const char *foreign = "neon";
#elif defined(__aarch64__)
static const char *chain[] = {"scalar", "neon"};
static const char *foreign = "avx2";
#else
static const char *chain[] = {"scalar"};
static const char *foreign = "avx2";
#endif
#define N_CHAIN ((int)(sizeof chain / sizeof chain[0]))

static void test_init(const char *expect_isa) {
    cur_isa = "init";
    group_begin();
    const char *best = "scalar";     /* the most preferred level that runs here */
    for (int i = 0; i < N_CHAIN; i++)
        if (cpumla_isa_available(chain[i])) best = chain[i];
    check(cpumla_isa_available("scalar") == 1, "scalar must always be available");
    check(cpumla_init("") == 0, "cpumla_init(\"\") failed: %s", cpumla_last_error());
    check(!strcmp(cpumla_isa(), best), "cpumla_init(\"\") chose %s, want %s", cpumla_isa(), best);
    printf("init     auto picks %s\n", cpumla_isa());
    check(cpumla_init(NULL) == 0 && !strcmp(cpumla_isa(), best), "cpumla_init(NULL) did not pick %s", best);
    check(cpumla_init("auto") == 0 && !strcmp(cpumla_isa(), best), "cpumla_init(\"auto\") did not pick %s", best);
    if (expect_isa) check(!strcmp(best, expect_isa), "expected the best implementation here to be %s, got %s",
                          expect_isa, best);
    for (int i = 0; i < N_CHAIN; i++) {
        int avail = cpumla_isa_available(chain[i]);
        int rc = cpumla_init(chain[i]);
        if (avail) {
            check(rc == 0 && !strcmp(cpumla_isa(), chain[i]), "cpumla_init(\"%s\") = %d (%s), isa %s", chain[i], rc,
                  cpumla_last_error(), cpumla_isa());
        } else {
            const char *e = cpumla_last_error();
            check(rc == -1 && e && e[0], "cpumla_init(\"%s\") on a CPU without it must fail with a message (rc %d)",
                  chain[i], rc);
            printf("init     cpumla_init(\"%s\") -> %d: %s\n", chain[i], rc, e ? e : "(no message)");
        }
    }
    int rc = cpumla_init(foreign);
    check(rc == -1 && cpumla_last_error()[0], "cpumla_init(\"%s\") (other architecture) must fail", foreign);
    rc = cpumla_init("bogus");
    check(rc == -1 && cpumla_last_error()[0], "cpumla_init(\"bogus\") must fail");
    check(cpumla_init("") == 0 && !strcmp(cpumla_isa(), best), "re-init after a failure");
    const char *kn = cpumla_kernel_names();
    check(kn && strstr(kn, "gemv") != NULL, "cpumla_kernel_names: %s", kn ? kn : "(null)");
    check(cpumla_kernel_impl("gemv") != NULL && cpumla_kernel_impl("nope") == NULL, "cpumla_kernel_impl");
    check(cpumla_version() && cpumla_version()[0], "cpumla_version");
    group_end("init");
}

/* ---- linear ----------------------------------------------------------------------------------- */
static void test_linear(void) {
    static const struct { int64_t rows, cols; int dt, sdt, br, bc; } cs[] = {
        {200, 300, CPUMLA_E4M3, CPUMLA_F32, 128, 128}, {129, 385, CPUMLA_E4M3, CPUMLA_E8M0, 128, 128},
        {129, 1031, CPUMLA_BF16, 0, 0, 0}, {65, 77, CPUMLA_F16, 0, 0, 0}, {33, 100, CPUMLA_E2M1, CPUMLA_E8M0, 1, 32},
        {300, 64, CPUMLA_F32, 0, 0, 0},
        {1300, 40, CPUMLA_E4M3, CPUMLA_F32, 128, 128},   /* 11 row blocks over 4 threads: the last ones halved */
    };
    for (size_t ci = 0; ci < sizeof cs / sizeof cs[0]; ci++) {
        tweight t = make_weight(cs[ci].rows, cs[ci].cols, cs[ci].dt, cs[ci].sdt, cs[ci].br, cs[ci].bc, 4);
        int64_t R = cs[ci].rows, C = cs[ci].cols;
        /* gemv */
        float *x = make_vec(C, 1.0f), *y = nan_floats((size_t)R + 4);
        y[R] = SENT;
        case_begin();
        check(cpumla_gemv(&t.w, x, y) == 0, "cpumla_gemv failed: %s", cpumla_last_error());
        int bad = 0;
        for (int64_t r = 0; r < R && bad < 3; r++) {
            double mag, ref = ref_row_dot(&t, r, x, &mag);
            if (!check(close_to(y[r], ref, mag, 1e-5), "cpumla_gemv %s %lldx%lld: y[%lld] = %.9g, want %.9g",
                       dtype_name(cs[ci].dt), (long long)R, (long long)C, (long long)r, y[r], ref)) bad++;
        }
        check(y[R] == SENT, "cpumla_gemv wrote past rows");
        case_end();
        free(x); free(y);
        /* gemm, strided */
        int64_t n = 5, ldx = C + 2, ldy = R + 3;
        x = nan_floats((size_t)(n * ldx));
        for (int64_t tt = 0; tt < n; tt++) for (int64_t c = 0; c < C; c++) x[tt * ldx + c] = rng_sym(1.0f);
        y = xalloc(sizeof(float) * (size_t)(n * ldy));
        for (int64_t i = 0; i < n * ldy; i++) y[i] = SENT;
        case_begin();
        check(cpumla_gemm(&t.w, x, ldx, n, y, ldy) == 0, "cpumla_gemm failed: %s", cpumla_last_error());
        bad = 0;
        for (int64_t tt = 0; tt < n; tt++) {
            for (int64_t r = 0; r < R && bad < 3; r++) {
                double mag, ref = ref_row_dot(&t, r, x + tt * ldx, &mag);
                if (!check(close_to(y[tt * ldy + r], ref, mag, 1e-5), "cpumla_gemm %s: y[%lld,%lld] = %.9g, want %.9g",
                           dtype_name(cs[ci].dt), (long long)tt, (long long)r, y[tt * ldy + r], ref)) bad++;
            }
            check(y[tt * ldy + R] == SENT, "cpumla_gemm wrote into the gap of y");
        }
        case_end();
        free(x); free(y);
        /* dequant rows [r0, r1) into a strided buffer */
        int64_t r0 = R / 3, r1 = R - 1, ldo = C + 1;
        float *out = xalloc(sizeof(float) * (size_t)((r1 - r0) * ldo));
        for (int64_t i = 0; i < (r1 - r0) * ldo; i++) out[i] = SENT;
        cpumla_dequant(&t.w, r0, r1, out, ldo);
        int ok = 1;
        for (int64_t r = r0; r < r1 && ok; r++) {
            for (int64_t c = 0; c < C; c++) ok &= out[(r - r0) * ldo + c] == (float)t.wd[r * C + c];
            ok &= out[(r - r0) * ldo + C] == SENT;
        }
        check(ok, "cpumla_dequant %s rows [%lld,%lld)", dtype_name(cs[ci].dt), (long long)r0, (long long)r1);
        free(out);
        free_weight(&t);
    }

    /* per-head products over kv_b_proj [H*(dn+dv), R] */
    static const struct { int dt, sdt, br, bc; } hs[] = {
        {CPUMLA_BF16, 0, 0, 0}, {CPUMLA_E4M3, CPUMLA_F32, 16, 16}, {CPUMLA_E4M3, CPUMLA_E8M0, 128, 128}};
    for (size_t hi = 0; hi < 3; hi++) {
        int64_t H = 3, dn = 24, dv = 20, Rk = 72, n = 2;
        tweight t = make_weight(H * (dn + dv), Rk, hs[hi].dt, hs[hi].sdt, hs[hi].br, hs[hi].bc, 0);
        /* absorb: y_h[Rk] = W_UK[h]^T x_h[dn]; W_UK[h] = rows h*(dn+dv) .. + dn */
        int64_t ldx_h = dn + 1, ldx_t = H * ldx_h + 2, ldy_h = Rk + 3, ldy_t = H * ldy_h + 1;
        float *x = nan_floats((size_t)(n * ldx_t));
        for (int64_t tt = 0; tt < n; tt++) for (int64_t h = 0; h < H; h++) for (int64_t i = 0; i < dn; i++)
            x[tt * ldx_t + h * ldx_h + i] = rng_sym(1.0f);
        float *y = xalloc(sizeof(float) * (size_t)(n * ldy_t));
        for (int64_t i = 0; i < n * ldy_t; i++) y[i] = SENT;
        case_begin();
        check(cpumla_head_gemv_t(&t.w, 0, dn + dv, dn, H, n, x, ldx_t, ldx_h, y, ldy_t, ldy_h) == 0,
              "cpumla_head_gemv_t failed: %s", cpumla_last_error());
        int bad = 0;
        for (int64_t tt = 0; tt < n; tt++) for (int64_t h = 0; h < H; h++) {
            for (int64_t c = 0; c < Rk && bad < 3; c++) {
                double s = 0, mag = 0;
                for (int64_t i = 0; i < dn; i++) {
                    double p = ref_term(&t, h * (dn + dv) + i, c, x[tt * ldx_t + h * ldx_h + i]);
                    s += p; mag += fabs(p);
                }
                float got = y[tt * ldy_t + h * ldy_h + c];
                if (!check(close_to(got, s, mag, 1e-5), "cpumla_head_gemv_t %s t %lld h %lld c %lld: %.9g, want %.9g",
                           dtype_name(hs[hi].dt), (long long)tt, (long long)h, (long long)c, got, s)) bad++;
            }
            check(y[tt * ldy_t + h * ldy_h + Rk] == SENT, "cpumla_head_gemv_t wrote into a gap");
        }
        case_end();
        free(x); free(y);
        /* un-absorb: y_h[dv] = W_UV[h] x_h[Rk]; W_UV[h] = rows h*(dn+dv) + dn .. + dv */
        ldx_h = Rk + 1; ldx_t = H * ldx_h + 2; ldy_h = dv + 3; ldy_t = H * ldy_h + 1;
        x = nan_floats((size_t)(n * ldx_t));
        for (int64_t tt = 0; tt < n; tt++) for (int64_t h = 0; h < H; h++) for (int64_t i = 0; i < Rk; i++)
            x[tt * ldx_t + h * ldx_h + i] = rng_sym(1.0f);
        y = xalloc(sizeof(float) * (size_t)(n * ldy_t));
        for (int64_t i = 0; i < n * ldy_t; i++) y[i] = SENT;
        case_begin();
        check(cpumla_head_gemv(&t.w, dn, dn + dv, dv, H, n, x, ldx_t, ldx_h, y, ldy_t, ldy_h) == 0,
              "cpumla_head_gemv failed: %s", cpumla_last_error());
        bad = 0;
        for (int64_t tt = 0; tt < n; tt++) for (int64_t h = 0; h < H; h++) {
            for (int64_t r = 0; r < dv && bad < 3; r++) {
                double mag, s = ref_row_dot(&t, h * (dn + dv) + dn + r, x + tt * ldx_t + h * ldx_h, &mag);
                float got = y[tt * ldy_t + h * ldy_h + r];
                if (!check(close_to(got, s, mag, 1e-5), "cpumla_head_gemv %s t %lld h %lld r %lld: %.9g, want %.9g",
                           dtype_name(hs[hi].dt), (long long)tt, (long long)h, (long long)r, got, s)) bad++;
            }
            check(y[tt * ldy_t + h * ldy_h + dv] == SENT, "cpumla_head_gemv wrote into a gap");
        }
        case_end();
        free(x); free(y);
        free_weight(&t);
    }
}

/* ---- elementwise ------------------------------------------------------------------------------ */
static void test_rows(void) {
    int64_t n = 3, dim = 77, ld = dim + 5;
    /* rmsnorm, BF16 weight, strided, then in place */
    float *x = nan_floats((size_t)(n * ld)), *y = xalloc(sizeof(float) * (size_t)(n * ld));
    uint16_t *wb = xalloc(sizeof(uint16_t) * (size_t)dim);
    for (int64_t i = 0; i < n * ld; i++) y[i] = SENT;
    for (int64_t t = 0; t < n; t++) for (int64_t i = 0; i < dim; i++) x[t * ld + i] = rng_sym(2.0f);
    for (int64_t i = 0; i < dim; i++) wb[i] = (uint16_t)(bitsf(rng_sym(2.0f)) >> 16);
    for (int inplace = 0; inplace < 2; inplace++) {
        double ref[3][77];
        for (int64_t t = 0; t < n; t++) {
            double ss = 0;
            for (int64_t i = 0; i < dim; i++) ss += (double)x[t * ld + i] * x[t * ld + i];
            double inv = 1 / sqrt(ss / dim + 1e-5);
            for (int64_t i = 0; i < dim; i++) ref[t][i] = x[t * ld + i] * inv * ref_bf16(wb[i]);
        }
        float *dst = inplace ? x : y;
        cpumla_rmsnorm(x, ld, dst, ld, n, dim, wb, CPUMLA_BF16, 1e-5f);
        int ok = 1;
        for (int64_t t = 0; t < n; t++) {
            for (int64_t i = 0; i < dim; i++) ok &= close_to(dst[t * ld + i], ref[t][i], fabs(ref[t][i]) + 1e-3, 1e-5);
            if (!inplace) ok &= dst[t * ld + dim] == SENT;
        }
        check(ok, "cpumla_rmsnorm BF16 weight%s", inplace ? " in place" : "");
    }
    free(x); free(y); free(wb);

    /* swiglu: gate | up halves of one row */
    int64_t ld_in = 2 * dim + 1, ld_out = dim + 2;
    float *in = nan_floats((size_t)(n * ld_in)), *out = xalloc(sizeof(float) * (size_t)(n * ld_out));
    for (int64_t t = 0; t < n; t++) for (int64_t i = 0; i < 2 * dim; i++) in[t * ld_in + i] = rng_sym(12.0f);
    for (int li = 0; li < 2; li++) {
        float limit = li ? 7.0f : 0.0f;
        for (int64_t i = 0; i < n * ld_out; i++) out[i] = SENT;
        cpumla_swiglu(in, in + dim, ld_in, out, ld_out, n, dim, limit);
        int ok = 1;
        for (int64_t t = 0; t < n; t++) {
            for (int64_t i = 0; i < dim; i++) {
                float g = in[t * ld_in + i], u = in[t * ld_in + dim + i];
                double gg = limit > 0 ? fmin(g, limit) : g, uu = limit > 0 ? fmax(fmin(u, limit), -limit) : u;
                double r = gg / (1 + exp(-gg)) * uu;
                ok &= close_to(out[t * ld_out + i], r, fabs(r) + 1e-30, 1e-5);
            }
            ok &= out[t * ld_out + dim] == SENT;
        }
        check(ok, "cpumla_swiglu limit %g", limit);
    }
    free(in); free(out);

    /* softmax rows */
    int64_t sn = 33, sld = 40;
    float *s = nan_floats((size_t)(n * sld));
    for (int64_t t = 0; t < n; t++) { for (int64_t i = 0; i < sn; i++) s[t * sld + i] = rng_sym(10.0f); s[t * sld + sn] = SENT; }
    double ref[3][33];
    for (int64_t t = 0; t < n; t++) {
        double m = -INFINITY, z = 0;
        for (int64_t i = 0; i < sn; i++) m = dmax(m, s[t * sld + i]);
        for (int64_t i = 0; i < sn; i++) { ref[t][i] = exp(s[t * sld + i] - m); z += ref[t][i]; }
        for (int64_t i = 0; i < sn; i++) ref[t][i] /= z;
    }
    cpumla_softmax(s, n, sld, sn);
    int ok = 1;
    for (int64_t t = 0; t < n; t++) {
        for (int64_t i = 0; i < sn; i++) ok &= fabs(s[t * sld + i] - ref[t][i]) <= 1e-5 * ref[t][i] + 1e-12;
        ok &= s[t * sld + sn] == SENT;
    }
    check(ok, "cpumla_softmax");
    free(s);
}

static void test_rope(void) {
    int64_t n = 2, H = 3, ld_head = 21, ld_row = H * ld_head + 2, off = 5, P = 8;
    int64_t pos[2] = {0, 4093};
    float inv_freq[4];
    for (int i = 0; i < 4; i++) inv_freq[i] = (float)pow(10000.0, -2.0 * i / (double)P);
    for (int mode = 0; mode < 4; mode++) {
        float *x = xalloc(sizeof(float) * (size_t)(n * ld_row)), *x0 = xalloc(sizeof(float) * (size_t)(n * ld_row));
        for (int64_t i = 0; i < n * ld_row; i++) x0[i] = x[i] = rng_sym(1.0f);
        float attn_scale = mode == 3 ? 1.25f : 1.0f;
        cpumla_rope(x, n, ld_row, H, ld_head, off, P, pos, inv_freq, attn_scale, mode);
        int ok = 1;
        for (int64_t t = 0; t < n; t++)
            for (int64_t h = 0; h < H; h++) {
                const float *a = x0 + t * ld_row + h * ld_head;
                const float *b = x + t * ld_row + h * ld_head;
                for (int64_t i = 0; i < P / 2; i++) {
                    double ang = (double)((float)pos[t] * inv_freq[i]);
                    if (mode & CPUMLA_ROPE_INVERSE) ang = -ang;
                    double c = cos(ang) * attn_scale, s = sin(ang) * attn_scale;
                    int64_t i0 = (mode & CPUMLA_ROPE_HALF) ? off + i : off + 2 * i;
                    int64_t i1 = (mode & CPUMLA_ROPE_HALF) ? off + i + P / 2 : off + 2 * i + 1;
                    double r0 = a[i0] * c - a[i1] * s, r1 = a[i1] * c + a[i0] * s;
                    ok &= fabs(b[i0] - r0) <= 2e-6 && fabs(b[i1] - r1) <= 2e-6;
                }
                for (int64_t d = 0; d < ld_head; d++)
                    if (d < off || d >= off + P) ok &= b[d] == a[d];
            }
        for (int64_t t = 0; t < n; t++) ok &= x[t * ld_row + H * ld_head] == x0[t * ld_row + H * ld_head];
        check(ok, "cpumla_rope mode %d (%s%s)", mode, (mode & 1) ? "half" : "interleaved", (mode & 2) ? ", inverse" : "");
        free(x); free(x0);
    }
}

/* ---- cache store and attention ---------------------------------------------------------------- */
static void test_cache_store(void) {
    int64_t width = 37, ld = 40, n_slots = 6, n = 4;
    int64_t slots[4] = {2, -1, 0, 5};
    for (int bf16 = 0; bf16 < 2; bf16++) {
        size_t esz = bf16 ? 2 : 4;
        uint8_t *cache = xalloc((size_t)(n_slots * ld) * esz);
        memset(cache, 0x5a, (size_t)(n_slots * ld) * esz);
        int64_t lds = width + 3;
        float *src = make_vec(n * lds, 3.0f);
        src[0] = fbits(0x3f808000u); src[1] = fbits(0x3f818000u); src[2] = fbits(0x00012345u);
        check(cpumla_cache_store(cache, bf16 ? CPUMLA_BF16 : CPUMLA_F32, ld, src, lds, n, width, slots) == 0,
              "cpumla_cache_store failed: %s", cpumla_last_error());
        int ok = 1;
        for (int64_t s = 0; s < n_slots; s++) {
            int64_t t = -1;
            for (int64_t i = 0; i < n; i++) if (slots[i] == s) t = i;
            for (int64_t d = 0; d < ld; d++) {
                const uint8_t *p = cache + (size_t)(s * ld + d) * esz;
                if (t < 0 || d >= width) {
                    for (size_t b = 0; b < esz; b++) ok &= p[b] == 0x5a;
                } else if (bf16) {
                    uint16_t h;
                    memcpy(&h, p, 2);
                    ok &= h == ref_to_bf16(src[t * lds + d]);
                } else {
                    ok &= memcmp(p, src + t * lds + d, 4) == 0;
                }
            }
        }
        check(ok, "cpumla_cache_store %s with slot -1", bf16 ? "BF16" : "F32");
        free(cache); free(src);
    }
}

typedef struct { int64_t n_q, H, dk, dv, n_kv; int causal, idx, sinks, big; } mcase;

static void mla_case(const mcase *c, int bf16) {
    int64_t n_q = c->n_q, H = c->H, dk = c->dk, dv = c->dv, n_kv = c->n_kv, ld_kv = dk + 4;
    int64_t ldq_h = dk + 1, ldq_t = H * ldq_h + 3, ldo_h = dv + 2, ldo_t = H * ldo_h + 1;
    /* causal: query i sees n_kv - n_q - 2 + i + 1 rows; the last rows are past every query's length */
    int64_t *kv_len = NULL;
    int64_t valid = n_kv;
    if (c->causal) {
        kv_len = xalloc(sizeof(int64_t) * (size_t)n_q);
        for (int64_t i = 0; i < n_q; i++) kv_len[i] = n_kv - n_q - 2 + i + 1;
        valid = kv_len[n_q - 1];
    }
    int64_t ld_idx = n_kv + 1;
    int32_t *idx = NULL;
    if (c->idx) {
        idx = xalloc(sizeof(int32_t) * (size_t)(n_q * ld_idx));
        for (int64_t i = 0; i < n_q * ld_idx; i++) idx[i] = (rng_u64() % 5 == 0) ? -1 : (int32_t)(rng_u64() % (uint64_t)valid);
        if (n_q > 1) for (int64_t j = 0; j < ld_idx; j++) idx[j] = -1;    /* query 0 sees nothing */
    }
    size_t esz = bf16 ? 2 : 4;
    void *kv = xalloc((size_t)(n_kv * ld_kv) * esz);
    for (int64_t r = 0; r < n_kv; r++)
        for (int64_t d = 0; d < ld_kv; d++) {
            float v = (r < valid && d < dk) ? rng_sym(1.0f) : NAN;
            if (bf16) ((uint16_t *)kv)[r * ld_kv + d] = isnan(v) ? 0x7fc0 : ref_to_bf16(v);
            else ((float *)kv)[r * ld_kv + d] = v;
        }
    float *q = nan_floats((size_t)(n_q * ldq_t));
    for (int64_t i = 0; i < n_q; i++) for (int64_t h = 0; h < H; h++) for (int64_t d = 0; d < dk; d++)
        q[i * ldq_t + h * ldq_h + d] = rng_sym(2.0f);
    float *sinks = NULL;
    if (c->sinks) { sinks = xalloc(sizeof(float) * (size_t)H); for (int64_t h = 0; h < H; h++) sinks[h] = rng_sym(3.0f); }
    float *out = xalloc(sizeof(float) * (size_t)(n_q * ldo_t)), *lse = xalloc(sizeof(float) * (size_t)(n_q * H));
    for (int64_t i = 0; i < n_q * ldo_t; i++) out[i] = SENT;
    cpumla_attn_args a = {.q = q, .ldq_t = ldq_t, .ldq_h = ldq_h, .n_q = n_q, .n_heads = H, .kv = kv,
                          .kv_dtype = bf16 ? CPUMLA_BF16 : CPUMLA_F32, .ld_kv = ld_kv, .n_kv = n_kv, .dk = dk,
                          .dv = dv, .kv_len = kv_len, .kv_idx = idx, .ld_idx = ld_idx, .sinks = sinks,
                          .scale = (float)(0.7 / sqrt((double)dk)), .out = out, .ldo_t = ldo_t, .ldo_h = ldo_h,
                          .lse = lse};
    check(cpumla_mla_attention(&a) == 0, "cpumla_mla_attention failed: %s", cpumla_last_error());
    ref_kv rk = {kv, bf16, ld_kv, dk, dv};
    int64_t *rows = xalloc(sizeof(int64_t) * (size_t)(n_kv + 1));
    double *ro = xalloc(sizeof(double) * (size_t)dv);
    int ok = 1;
    char where[256] = "";
    for (int64_t i = 0; i < n_q && ok; i++) {
        int64_t cnt = kv_len ? kv_len[i] : n_kv, nr = 0;
        for (int64_t j = 0; j < cnt; j++) {
            int64_t r = idx ? idx[i * ld_idx + j] : j;
            if (r >= 0 && r < n_kv) rows[nr++] = r;
        }
        for (int64_t h = 0; h < H && ok; h++) {
            double rl, smag;
            ref_attn(&rk, q + i * ldq_t + h * ldq_h, a.scale, rows, nr, sinks != NULL, sinks ? sinks[h] : 0, ro, &rl, &smag);
            const float *o = out + i * ldo_t + h * ldo_h;
            double tol = 1e-5 + 1e-5 * smag;
            for (int64_t d = 0; d < dv; d++) ok &= fabs(o[d] - ro[d]) <= tol;
            ok &= o[dv] == SENT;
            if (nr > 0) ok &= fabs(lse[i * H + h] - rl) <= tol;
            if (!ok) snprintf(where, sizeof where, "query %lld head %lld (%lld rows): out[0] %.9g want %.9g, lse %.9g want %.9g",
                              (long long)i, (long long)h, (long long)nr, o[0], ro[0], lse[i * H + h], rl);
        }
    }
    check(ok, "cpumla_mla_attention n_q %lld H %lld dk %lld dv %lld n_kv %lld %s%s%s%s: %s", (long long)n_q, (long long)H,
          (long long)dk, (long long)dv, (long long)n_kv, bf16 ? "BF16" : "F32", c->causal ? " causal" : "",
          c->idx ? " kv_idx(-1)" : "", c->sinks ? " sinks" : "", where);
    free(kv_len); free(idx); free(kv); free(q); free(sinks); free(out); free(lse); free(rows); free(ro);
}

static void test_attention(void) {
    static const mcase cs[] = {
        {1, 1, 8, 8, 1, 0, 0, 0, 0},        {1, 5, 40, 32, 37, 0, 0, 0, 0},   {4, 3, 40, 32, 37, 1, 0, 0, 0},
        {3, 20, 72, 64, 300, 1, 1, 0, 0},   {2, 4, 64, 64, 150, 0, 1, 1, 0},  {1, 16, 72, 64, 1000, 0, 0, 1, 0},
        {1, 16, 576, 512, 700, 0, 0, 0, 1}, {5, 16, 576, 512, 200, 1, 0, 0, 1}, {1, 64, 512, 512, 300, 0, 1, 1, 1},
    };
    for (size_t ci = 0; ci < sizeof cs / sizeof cs[0]; ci++) {
        if (small_mode && cs[ci].big) continue;
        for (int bf16 = 0; bf16 < 2; bf16++) mla_case(&cs[ci], bf16);
    }
}

void test_api_context(void);   /* test_context.c */
void test_api_topk(void);      /* test_route.c */
void test_api_route(void);
void test_api_mla_mha(void);    /* test_attn_block.c */

void test_api(const char *expect_isa) {
    watchdog("cpumla_init");
    test_init(expect_isa);
    watchdog(NULL);
    for (int i = 0; i < N_CHAIN; i++) {
        if (!cpumla_isa_available(chain[i])) {
            printf("%s: public API skipped (CPU or OS lacks it)\n", chain[i]);
            continue;
        }
        if (cpumla_init(chain[i]) != 0) { check(0, "cpumla_init(\"%s\"): %s", chain[i], cpumla_last_error()); continue; }
        cur_isa = chain[i];
        for (int th = 0; th < 2; th++) {
            cpumla_set_threads(th ? 4 : 1);
            static char what[64];
            snprintf(what, sizeof what, "public API with %d threads", th ? 4 : 1);
            watchdog(what);
            group_begin(); test_linear(); group_end("api linear");
            group_begin(); test_rows(); test_rope(); group_end("api rows");
            group_begin(); test_api_topk(); test_api_route(); group_end("api route");
            group_begin(); test_cache_store(); test_attention(); test_api_mla_mha(); group_end("api attention");
            group_begin(); test_api_context(); group_end("api context");
            watchdog(NULL);
        }
        /* the read probe takes any pointer: start 8 bytes past a 64-byte boundary */
        static double buf[1 << 13] __attribute__((aligned(64)));
        for (int j = 0; j < (1 << 13); j++) buf[j] = 1.0;
        int64_t bytes = (int64_t)sizeof buf - 8;
        double got = cpumla_read_probe(buf + 1, bytes), want = (double)((bytes & ~(int64_t)63) / 8);
        check(got == want, "%s: cpumla_read_probe of a buffer 8 bytes off alignment: %g, want %g", chain[i], got, want);
    }
    cpumla_init("");
}
