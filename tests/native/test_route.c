/* test_route.c: the public top-k and MoE routing (cpumla_topk, cpumla_route) against references
 * written from cpumla.h, under the level test_api.c has chosen. */
#include "core/kernels.h"
#include "ref.h"

/* ---- top-k and routing ------------------------------------------------------------------------ */
/* a before b: larger value; NaN last; equal values: lower index */
static int ref_before(const float *v, int a, int b) {
    if (isnan(v[a]) || isnan(v[b])) return isnan(v[a]) ? (isnan(v[b]) && a < b) : 1;
    return v[a] > v[b] || (v[a] == v[b] && a < b);
}

static void ref_topk(const float *v, int n, int k, int *idx) {
    int *o = malloc(sizeof(int) * (size_t)n);
    for (int i = 0; i < n; i++) o[i] = i;
    for (int i = 1; i < n; i++) {
        int t = o[i], j = i;
        while (j > 0 && ref_before(v, t, o[j - 1])) { o[j] = o[j - 1]; j--; }
        o[j] = t;
    }
    memcpy(idx, o, sizeof(int) * (size_t)k);
    free(o);
}

void test_api_topk(void) {
    float x[12] = {1, 3, NAN, 3, -INFINITY, 7, 2, 7, NAN, 0, -1, 3};
    int n = 12;
    for (int k = 1; k <= 10; k += 3) {
        int32_t idx[12];
        float val[12];
        int want[12];
        cpumla_topk(x, n, k, idx, val);
        ref_topk(x, n, k, want);
        int ok = 1;
        for (int i = 0; i < k; i++) ok &= idx[i] == want[i] && (val[i] == x[want[i]]);
        check(ok, "cpumla_topk k=%d: first %d %d %d, want %d %d %d", k, idx[0], k > 1 ? idx[1] : -1, k > 2 ? idx[2] : -1,
              want[0], k > 1 ? want[1] : -1, k > 2 ? want[2] : -1);
    }
    float big[300];
    for (int i = 0; i < 300; i++) big[i] = (float)(rng_u64() % 50);
    int32_t idx[8];
    float val[8];
    int want[8];
    cpumla_topk(big, 300, 8, idx, val);
    ref_topk(big, 300, 8, want);
    int ok = 1;
    for (int i = 0; i < 8; i++) ok &= idx[i] == want[i];
    check(ok, "cpumla_topk n=300 k=8 with many ties");
}

/* scores s, choice values ch (s + bias) for one token; returns selected indices in idx */
static void ref_route_token(const cpumla_router *r, const float *logit, int64_t tok, int *idx, double *w) {
    int E = r->n_experts, K = r->top_k;
    double s[512];
    float ch[512];
    for (int e = 0; e < E; e++) {
        double z = logit[e];
        if (r->method == CPUMLA_ROUTE_SOFTMAX || r->method == CPUMLA_ROUTE_GROUP_LIMITED) s[e] = z;
        else if (r->method == CPUMLA_ROUTE_NOAUX_TC) s[e] = 1 / (1 + exp(-z));
        else s[e] = sqrt(z > 20 ? z : log1p(exp(z)));
    }
    if (r->method <= CPUMLA_ROUTE_GROUP_LIMITED) {
        double m = -INFINITY, t = 0;
        for (int e = 0; e < E; e++) m = dmax(m, s[e]);
        for (int e = 0; e < E; e++) { s[e] = exp(s[e] - m); t += s[e]; }
        for (int e = 0; e < E; e++) s[e] /= t;
    }
    for (int e = 0; e < E; e++) ch[e] = (float)(s[e] + (r->bias && r->method != CPUMLA_ROUTE_SOFTMAX &&
                                                        r->method != CPUMLA_ROUTE_GROUP_LIMITED ? r->bias[e] : 0));
    if (r->method == CPUMLA_ROUTE_HASH) {
        for (int k = 0; k < K; k++)
            idx[k] = r->tid2eid_dtype == CPUMLA_I64 ? (int)((const int64_t *)r->tid2eid)[tok * K + k]
                                                    : ((const int32_t *)r->tid2eid)[tok * K + k];
    } else {
        int G = r->n_group > 1 ? r->n_group : 1;
        if (G > 1 && (r->method == CPUMLA_ROUTE_GROUP_LIMITED || r->method == CPUMLA_ROUTE_NOAUX_TC)) {
            int per = E / G;
            float gs[64];
            int gi[64];
            for (int g = 0; g < G; g++) {
                int o[64];
                ref_topk(ch + g * per, per, 2, o);
                gs[g] = r->method == CPUMLA_ROUTE_GROUP_LIMITED ? ch[g * per + o[0]]
                                                                : ch[g * per + o[0]] + ch[g * per + o[1]];
            }
            ref_topk(gs, G, r->topk_group, gi);
            for (int g = 0; g < G; g++) {
                int keep = 0;
                for (int q = 0; q < r->topk_group; q++) keep |= gi[q] == g;
                if (!keep) for (int e = g * per; e < (g + 1) * per; e++) ch[e] = -INFINITY;
            }
        }
        ref_topk(ch, E, K, idx);
    }
    double sum = 0;
    for (int k = 0; k < K; k++) { w[k] = s[idx[k]]; sum += w[k]; }
    for (int k = 0; k < K; k++) {
        if (r->norm_topk_prob) w[k] /= sum + 1e-20;
        w[k] *= r->routed_scaling_factor;
    }
}

void test_api_route(void) {
    static const char *names[] = {"softmax", "group_limited", "noaux_tc", "sqrtsoftplus", "hash"};
    int64_t n = 5, vocab = 11;
    for (int method = 0; method <= CPUMLA_ROUTE_HASH; method++) {
        cpumla_router r;
        memset(&r, 0, sizeof r);
        r.method = method;
        r.n_experts = method == CPUMLA_ROUTE_NOAUX_TC ? 32 : 24;
        r.top_k = method == CPUMLA_ROUTE_HASH ? 3 : 6;
        r.n_group = method == CPUMLA_ROUTE_GROUP_LIMITED ? 4 : method == CPUMLA_ROUTE_NOAUX_TC ? 8 : 1;
        r.topk_group = method == CPUMLA_ROUTE_GROUP_LIMITED ? 2 : method == CPUMLA_ROUTE_NOAUX_TC ? 3 : 0;
        r.norm_topk_prob = method >= CPUMLA_ROUTE_NOAUX_TC;
        r.routed_scaling_factor = method == CPUMLA_ROUTE_SOFTMAX ? 1.0f : 2.5f;
        float bias[64];
        for (int e = 0; e < 64; e++) bias[e] = rng_sym(0.3f);
        r.bias = method >= CPUMLA_ROUTE_NOAUX_TC ? bias : NULL;
        int64_t t64[11 * 3];
        int32_t t32[11 * 3];
        for (int i = 0; i < 33; i++) t32[i] = (int32_t)(t64[i] = (int64_t)((i * 7 + i / 3) % r.n_experts));
        for (int dt = 0; dt < (method == CPUMLA_ROUTE_HASH ? 2 : 1); dt++) {
            r.tid2eid = dt ? (const void *)t32 : (const void *)t64;
            r.tid2eid_dtype = dt ? CPUMLA_I32 : CPUMLA_I64;
            r.vocab = vocab;
            int64_t ld = r.n_experts + 3, tok[5] = {0, 3, 10, 7, 7};
            float *lg = nan_floats((size_t)(n * ld));
            for (int64_t t = 0; t < n; t++) for (int e = 0; e < r.n_experts; e++) lg[t * ld + e] = rng_sym(4.0f);
            int32_t idx[5 * 8];
            float w[5 * 8];
            int rc = cpumla_route(&r, lg, ld, n, tok, idx, w);
            int ok = rc == 0;
            for (int64_t t = 0; t < n && ok; t++) {
                int want[8];
                double ww[8];
                ref_route_token(&r, lg + t * ld, tok[t], want, ww);
                for (int k = 0; k < r.top_k; k++)
                    ok &= idx[t * r.top_k + k] == want[k] && fabs(w[t * r.top_k + k] - ww[k]) <= 1e-5 * fabs(ww[k]) + 1e-7;
                if (!ok)
                    printf("  route %s token %lld: got %d %d %d (w %.6g), want %d %d %d (w %.6g)\n", names[method],
                           (long long)t, idx[t * r.top_k], idx[t * r.top_k + 1], idx[t * r.top_k + 2], w[t * r.top_k],
                           want[0], want[1], want[2], ww[0]);
            }
            check(ok, "cpumla_route %s%s (rc %d %s)", names[method], dt ? " I32 table" : "", rc, rc ? cpumla_last_error() : "");
            if (method == CPUMLA_ROUTE_HASH) {
                int64_t badtok[5] = {0, 1, 11, 2, 3};
                check(cpumla_route(&r, lg, ld, n, badtok, idx, w) == -1 && cpumla_last_error()[0],
                      "cpumla_route hash with a token id >= vocab must return -1");
            }
            free(lg);
        }
    }
    cpumla_router bad;
    memset(&bad, 0, sizeof bad);
    bad.method = CPUMLA_ROUTE_SOFTMAX; bad.n_experts = 4; bad.top_k = 5; bad.routed_scaling_factor = 1;
    float lg[4] = {0};
    int32_t idx[5];
    float w[5];
    check(cpumla_route(&bad, lg, 4, 1, NULL, idx, w) == -1, "cpumla_route with top_k > n_experts must return -1");
}
