/* test_attn_block.c: the softmax_block entry (one online-softmax step of cpumla_mla_mha; one group of
 * test_kernels.c's table, every implementation) against a double-precision reference of kernels.h's
 * definition: block widths around the vector widths (1, 5, 16, 17, 40, 256), every count of visible
 * scores from none to all, a running maximum below, between and above the block's, the first block
 * (m = -inf), an -inf score, a score whose exp is subnormal (must give 0, as must every masked entry
 * and every tiny rescale factor), a NaN score (NaN probability and sum, the maximum unchanged), and
 * the sentinel after the block untouched. */
#include <float.h>
#include "core/kernels.h"
#include "ref.h"

#define SENT 12345.0f

/* the spec in double: the scaled scores are fp32 products, as every implementation computes them.
 * Tolerances: x - m rounded to fp32 moves exp by up to 2e-6 relative (|x - m| < 64), the sum over
 * 256 entries a few ulps more. */
static double ref_block(const float *s, int64_t valid, float scale, float mo, double *p, float *mn_out, double *c) {
    float mn = mo;
    for (int64_t j = 0; j < valid; j++) {
        float x = s[j] * scale;
        mn = x > mn ? x : mn;
    }
    double sum = 0;
    for (int64_t j = 0; j < valid; j++) {
        double e = exp((double)(s[j] * scale) - (double)mn);
        p[j] = e < FLT_MIN ? 0.0 : e;
        sum += p[j];
    }
    double cc = mn == -INFINITY ? 1.0 : exp((double)mo - (double)mn);
    *c = cc < FLT_MIN ? 0.0 : cc;
    *mn_out = mn;
    return sum;
}

static void block_case(const cpumla_kernels *k, int64_t n, int64_t valid, float mo, int special) {
    const float scale = 0.37f;
    float *s = xalloc(sizeof(float) * (size_t)(n + 4));
    for (int64_t j = 0; j < n; j++) s[j] = rng_sym(60.0f);
    for (int64_t j = valid; j < n; j++) s[j] = j % 2 ? NAN : 1e30f;         /* masked: never read as scores */
    if (special == 1 && valid > 2) {
        s[valid / 2] = -INFINITY;
        s[0] = 60.0f;                                                        /* the maximum, 22.2 after scale */
        s[valid - 1] = (22.2f - 95.0f) / scale;                              /* exp(-95): subnormal, so 0 */
    }
    if (special == 2 && valid > 0) s[valid - 1] = NAN;
    for (int64_t j = n; j < n + 4; j++) s[j] = SENT;
    double *p = xalloc(sizeof(double) * (size_t)(valid + 1));
    float mn;
    double c, lo = 1.5;
    double sum = ref_block(s, valid, scale, mo, p, &mn, &c);
    float m = mo, l = (float)lo;
    case_begin();
    float got_c = k->softmax_block(s, n, valid, scale, &m, &l);
    char nm[96];
    snprintf(nm, sizeof nm, "softmax_block n %lld valid %lld m %g case %d", (long long)n, (long long)valid, mo, special);
    int bad = 0;
    for (int64_t j = 0; j < valid && bad < 2; j++) {
        int ok = special == 2 && j == valid - 1 ? isnan(s[j])
                                                 : p[j] == 0.0 ? s[j] == 0.0f : fabs(s[j] - p[j]) <= 1e-5 * p[j];
        if (!check(ok, "%s: s[%lld] = %.9g, want %.9g", nm, (long long)j, s[j], p[j])) bad++;
    }
    for (int64_t j = valid; j < n && bad < 2; j++)
        if (!check(s[j] == 0.0f && !signbit(s[j]), "%s: masked s[%lld] = %.9g, want 0", nm, (long long)j, s[j])) bad++;
    check(s[n] == SENT, "%s: wrote past n", nm);
    check(m == mn || (isnan(m) && isnan(mn)), "%s: m = %.9g, want %.9g", nm, m, mn);
    check(c == 0.0 ? got_c == 0.0f : fabs(got_c - c) <= 1e-5 * c, "%s: c = %.9g, want %.9g", nm, got_c, c);
    double want_l = lo * c + sum;
    if (special == 2 && valid > 0)
        check(isnan(l), "%s: a NaN score must make l NaN, got %.9g", nm, l);
    else
        check(fabs(l - want_l) <= 3e-5 * want_l, "%s: l = %.9g, want %.9g", nm, l, want_l);
    case_end();
    free(s);
    free(p);
}

void test_softmax_block(const cpumla_kernels *k) {
    static const int64_t ns[] = {1, 5, 16, 17, 40, 256};
    for (int ni = 0; ni < 6; ni++) {
        int64_t n = ns[ni];
        const int64_t valids[] = {0, 1, n / 2, n - 1, n};
        for (int vi = 0; vi < 5; vi++) {
            int64_t valid = valids[vi] < 0 ? 0 : valids[vi];
            static const float mos[] = {-INFINITY, -5.0f, 3.0f, 40.0f, 140.0f};   /* 140: every exp tiny */
            for (int mi = 0; mi < 5; mi++)
                for (int special = 0; special < 3; special++) block_case(k, n, valid, mos[mi], special);
        }
    }
}

/* ---- cpumla_mla_mha (public API, run by test_api.c's attention group on every level) ------------ */
typedef struct {
    int64_t n_q, H, R, P, dn, dv, pos0;
    int wdtype, kv_len_kind;     /* 0: causal from pos0, 1: none (every row), 2: ragged (some 0, some past n_kv) */
    int big;
} mha_case;

extern int small_mode;

static void mha_case_run(const mha_case *c, int bf16) {
    const int64_t H = c->H, R = c->R, P = c->P, dn = c->dn, dv = c->dv, dk = dn + P, n_q = c->n_q;
    const int64_t n_kv = c->pos0 + n_q, ld_kv = R + P + 3, ldq_h = dk + 2, ldq_t = H * ldq_h + 5;
    const int64_t ldo_h = dv + 1, ldo_t = H * ldo_h + 3;
    tweight t = make_weight(H * (dn + dv), R, c->wdtype, CPUMLA_F32, 128, 128, 8);
    /* latent rows, NaN past rank + rope and past n_kv (read only what is visible) */
    size_t esz = bf16 ? 2 : 4;
    void *kv = xalloc((size_t)((n_kv + 8) * ld_kv) * esz);
    float *lat = xalloc(sizeof(float) * (size_t)(n_kv * (R + P)));      /* the values, as floats */
    for (int64_t r = 0; r < n_kv + 8; r++)
        for (int64_t d = 0; d < ld_kv; d++) {
            float v = (r < n_kv && d < R + P) ? rng_sym(1.0f) : NAN;
            if (bf16) {
                uint16_t b = isnan(v) ? 0x7fc0 : ref_to_bf16(v);
                ((uint16_t *)kv)[r * ld_kv + d] = b;
                v = (float)ref_bf16(b);
            } else {
                ((float *)kv)[r * ld_kv + d] = v;
            }
            if (r < n_kv && d < R + P) lat[r * (R + P) + d] = v;
        }
    int64_t *kv_len = NULL;
    if (c->kv_len_kind != 1) {
        kv_len = xalloc(sizeof(int64_t) * (size_t)n_q);
        for (int64_t i = 0; i < n_q; i++)
            kv_len[i] = c->kv_len_kind == 0 ? c->pos0 + i + 1 : (i % 3 == 0 ? 0 : (int64_t)(rng_u64() % (uint64_t)(n_kv + 9)));
    }
    float *q = nan_floats((size_t)(n_q * ldq_t));
    for (int64_t i = 0; i < n_q; i++) for (int64_t h = 0; h < H; h++) for (int64_t d = 0; d < dk; d++)
        q[i * ldq_t + h * ldq_h + d] = rng_sym(1.0f);
    float *out = xalloc(sizeof(float) * (size_t)(n_q * ldo_t));
    for (int64_t i = 0; i < n_q * ldo_t; i++) out[i] = SENT;
    const float scale = (float)(0.6 / sqrt((double)dk));
    cpumla_mla_mha_args a = {.q = q, .ldq_t = ldq_t, .ldq_h = ldq_h, .n_q = n_q, .n_heads = H, .kv = kv,
                             .kv_dtype = bf16 ? CPUMLA_BF16 : CPUMLA_F32, .ld_kv = ld_kv, .n_kv = n_kv, .rank = R,
                             .rope_dim = P, .kv_b = &t.w, .dn = dn, .dv = dv, .kv_len = kv_len, .scale = scale,
                             .out = out, .ldo_t = ldo_t, .ldo_h = ldo_h};
    check(cpumla_mla_mha(&a) == 0, "cpumla_mla_mha failed: %s", cpumla_last_error());
    /* reference: keys and values per head from kernels.h's products, attention in double */
    double *key = xalloc(sizeof(double) * (size_t)(n_kv * dk)), *val = xalloc(sizeof(double) * (size_t)(n_kv * dv));
    double *sc = xalloc(sizeof(double) * (size_t)(n_kv + 1)), *ro = xalloc(sizeof(double) * (size_t)dv);
    int ok = 1;
    char where[200] = "";
    for (int64_t h = 0; h < H && ok; h++) {
        double vmag = 0, mag;
        for (int64_t j = 0; j < n_kv; j++) {
            for (int64_t d = 0; d < dn; d++) key[j * dk + d] = ref_row_dot(&t, h * (dn + dv) + d, lat + j * (R + P), &mag);
            for (int64_t p = 0; p < P; p++) key[j * dk + dn + p] = lat[j * (R + P) + R + p];
            for (int64_t d = 0; d < dv; d++) {
                val[j * dv + d] = ref_row_dot(&t, h * (dn + dv) + dn + d, lat + j * (R + P), &mag);
                vmag = dmax(vmag, fabs(val[j * dv + d]));
            }
        }
        for (int64_t i = 0; i < n_q && ok; i++) {
            int64_t cnt = kv_len ? (kv_len[i] < n_kv ? kv_len[i] : n_kv) : n_kv;
            double m = -INFINITY, l = 0;
            for (int64_t j = 0; j < cnt; j++) {
                double s = 0;
                for (int64_t d = 0; d < dk; d++) s += (double)q[i * ldq_t + h * ldq_h + d] * key[j * dk + d];
                sc[j] = scale * s;
                m = dmax(m, sc[j]);
            }
            for (int64_t d = 0; d < dv; d++) ro[d] = 0;
            for (int64_t j = 0; j < cnt; j++) {
                double p = exp(sc[j] - m);
                l += p;
                for (int64_t d = 0; d < dv; d++) ro[d] += p * val[j * dv + d];
            }
            const float *o = out + i * ldo_t + h * ldo_h;
            for (int64_t d = 0; d < dv; d++) ok &= fabs(o[d] - (cnt ? ro[d] / l : 0.0)) <= 2e-5 * (1 + vmag);
            ok &= o[dv] == SENT;
            if (!ok) snprintf(where, sizeof where, "query %lld head %lld (%lld rows): out[0] %.9g want %.9g", (long long)i,
                              (long long)h, (long long)cnt, o[0], cnt ? ro[0] / l : 0.0);
        }
    }
    check(ok, "cpumla_mla_mha n_q %lld H %lld R %lld P %lld dn %lld dv %lld n_kv %lld %s cache, %s kv_b, kv_len %d: %s",
          (long long)n_q, (long long)H, (long long)R, (long long)P, (long long)dn, (long long)dv, (long long)n_kv,
          bf16 ? "BF16" : "F32", dtype_name(c->wdtype), c->kv_len_kind, where);
    if (c->wdtype == CPUMLA_F32) {
        /* kv_b NULL, the same W_UK / W_UV apart as a GGUF file splits them (k_b [H*R, dn]: W_UK transposed
         * per head; v_b [H*dv, R]): the same numbers, bit for bit */
        float *kb = xalloc(sizeof(float) * (size_t)(H * R * dn)), *vb = xalloc(sizeof(float) * (size_t)(H * dv * R));
        for (int64_t h = 0; h < H; h++) {
            for (int64_t d = 0; d < dn; d++) {
                const float *row = (const float *)((const char *)t.w.data + (h * (dn + dv) + d) * t.w.row_bytes);
                for (int64_t r = 0; r < R; r++) kb[(h * R + r) * dn + d] = row[r];
            }
            for (int64_t d = 0; d < dv; d++)
                memcpy(vb + (h * dv + d) * R, (const char *)t.w.data + (h * (dn + dv) + dn + d) * t.w.row_bytes,
                       sizeof(float) * (size_t)R);
        }
        cpumla_weight kw, vw;
        memset(&kw, 0, sizeof kw);
        kw.dtype = CPUMLA_F32;
        vw = kw;
        kw.data = kb; kw.rows = H * R; kw.cols = dn; kw.row_bytes = dn * (int64_t)sizeof(float);
        vw.data = vb; vw.rows = H * dv; vw.cols = R; vw.row_bytes = R * (int64_t)sizeof(float);
        float *out2 = xalloc(sizeof(float) * (size_t)(n_q * ldo_t));
        for (int64_t i = 0; i < n_q * ldo_t; i++) out2[i] = SENT;
        a.kv_b = NULL; a.k_b = &kw; a.v_b = &vw; a.out = out2;
        check(cpumla_mla_mha(&a) == 0, "cpumla_mla_mha (k_b, v_b) failed: %s", cpumla_last_error());
        check(memcmp(out, out2, sizeof(float) * (size_t)(n_q * ldo_t)) == 0,
              "cpumla_mla_mha with k_b / v_b differs from kv_b (n_q %lld H %lld R %lld dn %lld dv %lld, %s cache)",
              (long long)n_q, (long long)H, (long long)R, (long long)dn, (long long)dv, bf16 ? "BF16" : "F32");
        free(kb); free(vb); free(out2);
    }
    free_weight(&t);
    free(kv); free(lat); free(kv_len); free(q); free(out); free(key); free(val); free(sc); free(ro);
}

void test_api_mla_mha(void) {
    static const mha_case cs[] = {
        {1, 1, 8, 2, 4, 4, 0, CPUMLA_F32, 0, 0},          {7, 3, 40, 6, 10, 7, 20, CPUMLA_BF16, 0, 0},
        {5, 2, 33, 4, 8, 9, 30, CPUMLA_E4M3, 1, 0},       {9, 2, 24, 4, 8, 6, 40, CPUMLA_F32, 2, 0},
        {270, 3, 40, 4, 12, 9, 30, CPUMLA_F32, 0, 1},     /* and the split pair (k_b, v_b) past a block */
        {270, 2, 24, 4, 8, 6, 200, CPUMLA_BF16, 0, 1},    /* two blocks of keys and of queries */
        {3, 1, 32, 4, 8, 8, 4200, CPUMLA_BF16, 0, 1},     /* past one span of rows */
    };
    for (size_t ci = 0; ci < sizeof cs / sizeof cs[0]; ci++) {
        if (small_mode && cs[ci].big) continue;
        for (int bf16 = 0; bf16 < 2; bf16++) mha_case_run(&cs[ci], bf16);
    }
    /* bad arguments: one clear error, nothing written */
    tweight t = make_weight(8, 16, CPUMLA_F32, CPUMLA_F32, 128, 128, 0);
    float q[8] = {0}, kv[20] = {0}, out[4] = {SENT, SENT, SENT, SENT};
    cpumla_mla_mha_args a = {.q = q, .ldq_t = 6, .ldq_h = 6, .n_q = 1, .n_heads = 1, .kv = kv, .kv_dtype = CPUMLA_F32,
                             .ld_kv = 20, .n_kv = 1, .rank = 12, .rope_dim = 2, .kv_b = &t.w, .dn = 4, .dv = 4,
                             .scale = 1.0f, .out = out, .ldo_t = 4, .ldo_h = 4};
    check(cpumla_mla_mha(&a) == -1 && strstr(cpumla_last_error(), "rank columns") && out[0] == SENT,
          "cpumla_mla_mha with kv_b of 16 columns and rank 12: %s", cpumla_last_error());
    a.rank = 16;
    a.kv_dtype = CPUMLA_F16;
    check(cpumla_mla_mha(&a) == -1 && strstr(cpumla_last_error(), "F32 or BF16"), "cpumla_mla_mha with an F16 cache: %s",
          cpumla_last_error());
    a.kv_dtype = CPUMLA_F32;
    a.kv_b = NULL;
    a.k_b = &t.w;                                   /* k_b without v_b */
    check(cpumla_mla_mha(&a) == -1 && strstr(cpumla_last_error(), "neither kv_b nor"), "cpumla_mla_mha without v_b: %s",
          cpumla_last_error());
    a.v_b = &t.w;                                   /* 16 columns, dn 4 */
    check(cpumla_mla_mha(&a) == -1 && strstr(cpumla_last_error(), "k_b must have dn columns") && out[0] == SENT,
          "cpumla_mla_mha with k_b of 16 columns and dn 4: %s", cpumla_last_error());
    free_weight(&t);
}
