/* deepseek_v4.c: the DeepSeek-V4 forward in one call (deepseek_v4.h has the math): its state, the mHC
 * residual streams around each sub-block, the MoE (sqrt-softplus or hash routing, clamped SwiGLU) and the
 * HyperHead before the final norm. Attention lives in deepseek_v4_attn.c. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "models/deepseek_v4_impl.h"
#include "core/dispatch.h"
#include "core/expert_stream.h"

#define SCORE_FLOATS (8 << 20)   /* index scores of one query block: at most 32 MB */

const cpumla_dsv4_layer *dsv4_layer(const cpumla_dsv4_model *m, int64_t l) {
    return l < m->n_layers ? &m->layers[l] : &m->mtp->layer;
}

int64_t dsv4_cached_layers(const cpumla_dsv4_model *m) { return m->n_layers + (m->mtp ? 1 : 0); }

static int64_t max_router(const cpumla_dsv4_model *m, int want_k) {
    int64_t v = 1;
    for (int64_t l = 0; l < dsv4_cached_layers(m); l++) {
        const cpumla_router *r = dsv4_layer(m, l)->router;
        int64_t x = want_k ? r->top_k : r->n_experts;
        v = x > v ? x : v;
    }
    return v;
}

static void release(cpumla_dsv4_state *s) {
    float **lists[] = {s->kv, s->cring, s->ikeys, s->iring};
    for (size_t i = 0; i < 4; i++) {
        if (lists[i])
            for (int64_t l = 0; l < dsv4_cached_layers(s->m); l++) free(lists[i][l]);
        free(lists[i]);
    }
    free(s->block);
    cpumla_ctx_free(s->scratch);
}

static float *layer_alloc(int64_t rows, int64_t width) {
    return cpumla_cache_alloc((size_t)(rows * width) * sizeof(float));
}

static int check_model(const cpumla_dsv4_model *m) {
    if (m->n_layers < 1 || m->hidden < 1 || m->hc_mult < 1 || m->n_heads < 1 || m->head_dim < 1 ||
        m->rope_dim < 2 || m->rope_dim % 2 || m->rope_dim > m->head_dim || m->q_lora_rank < 1 ||
        m->o_groups < 1 || m->n_heads * m->head_dim % m->o_groups || m->o_lora_rank < 1 || m->sliding_window < 1 ||
        m->hc_sinkhorn_iters < 1)
        return -1;
    if (m->mtp && (m->mtp->layer.ratio != 0 || !m->mtp->e_proj || !m->mtp->h_proj || !m->mtp->hc_head.fn))
        return -1;
    for (int64_t l = 0; l < dsv4_cached_layers(m); l++) {
        const cpumla_dsv4_layer *L = dsv4_layer(m, l);
        if (L->ratio < 0 || !L->router || !L->experts || !L->gate) return -1;
        if (L->csa && (L->ratio < 1 || m->index_topk < 1 || m->index_n_heads < 1 ||
                       m->index_head_dim < m->rope_dim || !L->index_wq_b || !L->index_proj))
            return -1;
    }
    return 0;
}

cpumla_dsv4_state *cpumla_dsv4_new(const cpumla_dsv4_model *m, int64_t ctx, int64_t max_tokens) {
    cpumla_ensure_init();
    if (check_model(m) != 0) {
        cpumla_set_error("bad V4 model description (sizes, rope dims, groups, routers, indexer or MTP layer)");
        return NULL;
    }
    if (ctx < 1 || max_tokens < 1) {
        cpumla_set_error("a model state needs a context and a chunk of at least one token");
        return NULL;
    }
    cpumla_dsv4_state *s = calloc(1, sizeof *s);
    if (!s) { cpumla_set_error("out of memory for the model state"); return NULL; }
    s->m = m;
    s->ctx = ctx;
    s->max_tokens = max_tokens = max_tokens < ctx ? max_tokens : ctx;
    int64_t n = max_tokens, D = m->hidden, N = m->hc_mult, H = m->n_heads, hd = m->head_dim;
    int64_t IH = m->index_n_heads > 0 ? m->index_n_heads : 1, ID = m->index_head_dim > 0 ? m->index_head_dim : 1;
    int64_t KI = m->index_topk > 0 ? m->index_topk : 1, E = max_router(m, 0), K = max_router(m, 1);
    int64_t L = dsv4_cached_layers(m), W = m->sliding_window, cwmax = hd > ID ? hd : ID;
    s->wr = W + n;
    int64_t most = 0;
    for (int64_t l = 0; l < L; l++) {
        const cpumla_dsv4_layer *Ly = dsv4_layer(m, l);
        if (Ly->ratio <= 0) continue;
        int64_t ne = ctx / Ly->ratio;
        s->max_entries = ne > s->max_entries ? ne : s->max_entries;
        int64_t reads = Ly->csa ? (ne < KI ? ne : KI) : ne;
        most = reads > most ? reads : most;
    }
    s->ld_idx = W + most;
    int64_t me = s->max_entries > 0 ? s->max_entries : 1;
    s->qc = SCORE_FLOATS / (IH * me);
    s->qc = s->qc < 1 ? 1 : s->qc > n ? n : s->qc;
    /* scratch: floats, then 32-bit ints, then 64-bit ints, each slot rounded up to 16 elements */
    int64_t fsz[] = {n * N * D, n * N * D, n * (2 + N) * N, n * N, n * N, n * N * N, n * D, n * D, n * D, N * D,
                     n * m->q_lora_rank, n * H * hd, n * hd, n * H * hd, n * m->o_groups * m->o_lora_rank,
                     n * 4 * cwmax, 4 * cwmax, n * IH * ID, n * IH, s->qc * IH * me, me, KI, n * E, n * K, n};
    float **fslot[] = {&s->X, &s->Xn, &s->mix, &s->pre, &s->post, &s->comb, &s->y, &s->x, &s->o, &s->tmp,
                       &s->qr, &s->q, &s->kvn, &s->att, &s->z, &s->caz, &s->ent, &s->qi, &s->iw, &s->scores,
                       &s->isc, &s->tkval, &s->gl, &s->rw, &s->ones};
    int64_t isz[] = {n * KI, n * s->ld_idx, n * K, n};
    int32_t **islot[] = {&s->sel, &s->kv_idx, &s->ri, &s->zeros};
    int64_t lsz[] = {n, n, n, n};
    int64_t **lslot[] = {&s->sel_len, &s->kv_cnt, &s->pos, &s->slots};
    size_t bytes = 64;
    for (size_t i = 0; i < sizeof fsz / sizeof fsz[0]; i++) bytes += (size_t)((fsz[i] + 15) & ~15) * 4;
    for (size_t i = 0; i < sizeof isz / sizeof isz[0]; i++) bytes += (size_t)((isz[i] + 15) & ~15) * 4;
    for (size_t i = 0; i < sizeof lsz / sizeof lsz[0]; i++) bytes += (size_t)((lsz[i] + 15) & ~15) * 8;
    s->block = aligned_alloc(64, (bytes + 63) & ~(size_t)63);
    s->scratch = cpumla_ctx_new();
    s->kv = calloc((size_t)L, sizeof(float *));
    s->cring = calloc((size_t)L, sizeof(float *));
    s->ikeys = calloc((size_t)L, sizeof(float *));
    s->iring = calloc((size_t)L, sizeof(float *));
    if (!s->block || !s->scratch || !s->kv || !s->cring || !s->ikeys || !s->iring) goto oom;
    char *p = s->block;
    for (size_t i = 0; i < sizeof fsz / sizeof fsz[0]; i++) { *fslot[i] = (float *)p; p += ((fsz[i] + 15) & ~15) * 4; }
    for (size_t i = 0; i < sizeof isz / sizeof isz[0]; i++) { *islot[i] = (int32_t *)p; p += ((isz[i] + 15) & ~15) * 4; }
    for (size_t i = 0; i < sizeof lsz / sizeof lsz[0]; i++) { *lslot[i] = (int64_t *)p; p += ((lsz[i] + 15) & ~15) * 8; }
    for (int64_t t = 0; t < n; t++) { s->ones[t] = 1.0f; s->zeros[t] = 0; }
    for (int64_t l = 0; l < L; l++) {
        const cpumla_dsv4_layer *Ly = dsv4_layer(m, l);
        int64_t r = Ly->ratio, ne = r > 0 ? ctx / r : 0, coff = Ly->csa ? 2 : 1;
        if (!(s->kv[l] = layer_alloc(s->wr + ne, hd))) goto oom;
        if (r > 0 && !(s->cring[l] = layer_alloc(dsv4_ring_rows(s, Ly), 2 * coff * hd))) goto oom;
        if (Ly->csa && !(s->ikeys[l] = layer_alloc(ne > 0 ? ne : 1, ID))) goto oom;
        if (Ly->csa && !(s->iring[l] = layer_alloc(dsv4_ring_rows(s, Ly), 4 * ID))) goto oom;
    }
    return s;
oom:
    release(s);
    free(s);
    cpumla_set_error("out of memory for the model's caches and scratch");
    return NULL;
}

void cpumla_dsv4_free(cpumla_dsv4_state *s) {
    if (!s) return;
    release(s);
    free(s);
}

int cpumla_dsv4_resumable(const cpumla_dsv4_state *s, int64_t pos0) {
    const cpumla_dsv4_model *m = s->m;
    if (pos0 == 0) return 1;
    if (pos0 < 0 || pos0 > s->len) return 0;
    int64_t first = pos0 - m->sliding_window + 1;        /* the window of the query at pos0 */
    if ((first > 0 ? first : 0) < s->top - s->wr) return 0;
    for (int64_t l = 0; l < m->n_layers; l++) {
        const cpumla_dsv4_layer *L = dsv4_layer(m, l);
        if (L->ratio <= 0) continue;
        /* the open window's inputs, and with overlap the previous window's */
        first = (pos0 / L->ratio - (L->csa ? 1 : 0)) * L->ratio;
        if ((first > 0 ? first : 0) < s->top - dsv4_ring_rows(s, L)) return 0;
    }
    return 1;
}

/* y = sum_i pre_i X_i over the N streams of D values at X: stream by stream over d (vectorised), each
 * y[d] summed in stream order as the spec's loop */
static void hc_mix(const float *pre, const float *X, int64_t N, int64_t D, float *y) {
    for (int64_t d = 0; d < D; d++) y[d] = 0.0f;
    for (int64_t i = 0; i < N; i++)
        for (int64_t d = 0; d < D; d++) y[d] += pre[i] * X[i * D + d];
}

/* The mHC weights of one sub-block from s->X: s->pre, s->post, s->comb, and s->y = sum_i pre_i X_i. */
static int hc_pre(cpumla_dsv4_state *s, const cpumla_dsv4_hc *hc, int64_t n) {
    const cpumla_dsv4_model *m = s->m;
    int64_t N = m->hc_mult, D = m->hidden, ND = N * D, NM = (2 + N) * N;
    float eps = m->hc_eps;
    cpumla_rmsnorm(s->X, ND, s->Xn, ND, n, ND, NULL, CPUMLA_F32, m->rms_norm_eps);
    DSV4_TRY(cpumla_gemm_f32act(hc->fn, s->Xn, ND, n, s->mix, NM));
    float sc[3];
    for (int i = 0; i < 3; i++) sc[i] = vec_at(hc->scale.data, hc->scale.dtype, i);
    for (int64_t t = 0; t < n; t++) {
        const float *mx = s->mix + t * NM;
        float *pre = s->pre + t * N, *post = s->post + t * N, *c = s->comb + t * N * N;
        for (int64_t i = 0; i < N; i++) {
            pre[i] = 1.0f / (1.0f + expf(-(mx[i] * sc[0] + vec_at(hc->base.data, hc->base.dtype, i)))) + eps;
            post[i] = 2.0f / (1.0f + expf(-(mx[N + i] * sc[1] + vec_at(hc->base.data, hc->base.dtype, N + i))));
        }
        for (int64_t j = 0; j < N; j++) {            /* row softmax of C, plus eps */
            float *row = c + j * N, mxv = -INFINITY, sum = 0.0f;
            for (int64_t k = 0; k < N; k++) {
                row[k] = mx[2 * N + j * N + k] * sc[2] + vec_at(hc->base.data, hc->base.dtype, 2 * N + j * N + k);
                mxv = row[k] > mxv ? row[k] : mxv;
            }
            for (int64_t k = 0; k < N; k++) { row[k] = expf(row[k] - mxv); sum += row[k]; }
            for (int64_t k = 0; k < N; k++) row[k] = row[k] / sum + eps;
        }
        /* Sinkhorn: columns first, then (iters - 1) rounds of rows and columns */
        for (int64_t it = 0; it < m->hc_sinkhorn_iters; it++) {
            if (it > 0)
                for (int64_t j = 0; j < N; j++) {
                    float sum = 0.0f;
                    for (int64_t k = 0; k < N; k++) sum += c[j * N + k];
                    for (int64_t k = 0; k < N; k++) c[j * N + k] /= sum + eps;
                }
            for (int64_t k = 0; k < N; k++) {
                float sum = 0.0f;
                for (int64_t j = 0; j < N; j++) sum += c[j * N + k];
                for (int64_t j = 0; j < N; j++) c[j * N + k] /= sum + eps;
            }
        }
        hc_mix(pre, s->X + t * ND, N, D, s->y + t * D);
    }
    return 0;
}

/* X'_k = post_k o + sum_j C_jk X_j */
static void hc_post(cpumla_dsv4_state *s, int64_t n) {
    const cpumla_dsv4_model *m = s->m;
    int64_t N = m->hc_mult, D = m->hidden;
    for (int64_t t = 0; t < n; t++) {
        float *X = s->X + t * N * D, *tmp = s->tmp;
        const float *o = s->o + t * D, *post = s->post + t * N, *c = s->comb + t * N * N;
        /* inner loops over d (vectorised); each element summed in the order post_k o, then j = 0..N-1 */
        for (int64_t k = 0; k < N; k++) {
            float *out = tmp + k * D;
            for (int64_t d = 0; d < D; d++) out[d] = post[k] * o[d];
            for (int64_t j = 0; j < N; j++)
                for (int64_t d = 0; d < D; d++) out[d] += c[j * N + k] * X[j * D + d];
        }
        memcpy(X, tmp, sizeof(float) * (size_t)(N * D));
    }
}

/* s->o = MoE of s->x: routed experts (hash or biased sqrt-softplus top-k) plus the shared expert. */
static int ffn(cpumla_dsv4_state *s, int64_t l, int64_t n, const int64_t *ids) {
    const cpumla_dsv4_model *m = s->m;
    const cpumla_dsv4_layer *L = dsv4_layer(m, l);
    const cpumla_router *r = L->router;
    int64_t D = m->hidden;
    memset(s->o, 0, sizeof(float) * (size_t)(n * D));
    DSV4_TRY(cpumla_gemm_f32act(L->gate, s->x, D, n, s->gl, r->n_experts));
    DSV4_TRY(cpumla_route(r, s->gl, r->n_experts, n, ids, s->ri, s->rw));
    if (n == 1 && l + 1 < m->n_layers) {        /* experts read from disk: the next layer's, ahead */
        const cpumla_dsv4_layer *next = &m->layers[l + 1];
        DSV4_TRY(stream_predict(next->experts, next->gate, next->router, s->x, D, ids));
    }
    DSV4_TRY(cpumla_moe(L->experts, r->n_experts, s->x, D, n, s->ri, s->rw, r->top_k, s->o, D, m->swiglu_limit));
    if (L->shared) DSV4_TRY(cpumla_moe(L->shared, 1, s->x, D, n, s->zeros, s->ones, 1, s->o, D, m->swiglu_limit));
    return 0;
}

/* The token checks of a forward of n ids at pos0 (the main model's and the MTP layer's). */
static int check_call(const cpumla_dsv4_state *s, const int64_t *ids, int64_t n, int64_t pos0) {
    const cpumla_dsv4_model *m = s->m;
    char msg[200];
    if (n <= 0 || n > s->max_tokens) {
        snprintf(msg, sizeof msg, "a forward takes 1 to %lld tokens, got %lld", (long long)s->max_tokens, (long long)n);
        cpumla_set_error(msg);
        return -1;
    }
    if (pos0 < 0 || pos0 + n > s->ctx) {
        snprintf(msg, sizeof msg, "context full: %lld cached + %lld new tokens > %lld", (long long)pos0, (long long)n,
                 (long long)s->ctx);
        cpumla_set_error(msg);
        return -1;
    }
    for (int64_t t = 0; t < n; t++)
        if (ids[t] < 0 || ids[t] >= m->vocab) {
            snprintf(msg, sizeof msg, "token id %lld is outside the vocabulary of %lld", (long long)ids[t],
                     (long long)m->vocab);
            cpumla_set_error(msg);
            return -1;
        }
    return 0;
}

/* An mHC sub-block around F (attention or MoE): sub_in makes its normed input s->x from the streams s->X
 * of the n tokens, F writes s->o, sub_out joins s->o (all-reduced across ranks) to the streams. */
static int sub_in(cpumla_dsv4_state *s, const cpumla_dsv4_hc *hc, const cpumla_vec *norm, int64_t n) {
    const cpumla_dsv4_model *m = s->m;
    DSV4_TRY(hc_pre(s, hc, n));
    cpumla_rmsnorm(s->y, m->hidden, s->x, m->hidden, n, m->hidden, norm->data, norm->dtype, m->rms_norm_eps);
    return 0;
}

static int sub_out(cpumla_dsv4_state *s, int64_t n) {
    DSV4_TRY(tp_all_reduce(s->m->comm, s->o, n * s->m->hidden));
    hc_post(s, n);
    return 0;
}

/* The attention half of layer l (the MTP layer's: n_layers) over the n tokens at s->pos, then its MoE
 * half. */
static int layer_attn(cpumla_dsv4_state *s, int64_t l, int64_t n, int64_t pos0) {
    const cpumla_dsv4_layer *L = dsv4_layer(s->m, l);
    DSV4_TRY(sub_in(s, &L->hc_attn, &L->attn_norm, n));
    DSV4_TRY(dsv4_attention(s, l, n, pos0));
    return sub_out(s, n);
}

static int layer_ffn(cpumla_dsv4_state *s, int64_t l, int64_t n, const int64_t *ids) {
    const cpumla_dsv4_layer *L = dsv4_layer(s->m, l);
    DSV4_TRY(sub_in(s, &L->hc_ffn, &L->ffn_norm, n));
    DSV4_TRY(ffn(s, l, n, ids));
    return sub_out(s, n);
}

/* The logits of the streams s->X (last_only: of the last token): a HyperHead, y = sum_i pre_i X_i with
 * pre = sigmoid(scale * hc_fn(norm(X)) + base) + eps, then the final norm and the head. */
static int hyper_head(cpumla_dsv4_state *s, const cpumla_dsv4_hc *hc, const cpumla_vec *norm, int64_t n,
                      float *logits, int32_t last_only) {
    const cpumla_dsv4_model *m = s->m;
    int64_t D = m->hidden, N = m->hc_mult;
    int64_t first = last_only ? n - 1 : 0, rows = n - first, ND = N * D;
    const float *Xf = s->X + first * ND;
    cpumla_rmsnorm(Xf, ND, s->Xn, ND, rows, ND, NULL, CPUMLA_F32, m->rms_norm_eps);
    DSV4_TRY(cpumla_gemm_f32act(hc->fn, s->Xn, ND, rows, s->mix, N));
    float scale = vec_at(hc->scale.data, hc->scale.dtype, 0);
    for (int64_t t = 0; t < rows; t++) {
        float pre[N];
        for (int64_t i = 0; i < N; i++)
            pre[i] = 1.0f / (1.0f + expf(-(s->mix[t * N + i] * scale + vec_at(hc->base.data, hc->base.dtype, i))))
                     + m->hc_eps;
        hc_mix(pre, Xf + t * ND, N, D, s->y + t * D);
    }
    cpumla_rmsnorm(s->y, D, s->x, D, rows, D, norm->data, norm->dtype, m->rms_norm_eps);
    return tp_head(m->comm, m->lm_head, m->head_row0, s->x, D, rows, logits, m->vocab);
}

static int forward(cpumla_dsv4_state *s, const int64_t *ids, int64_t n, int64_t pos0, float *logits,
                   int32_t last_only, float *hidden) {
    const cpumla_dsv4_model *m = s->m;
    DSV4_TRY(check_call(s, ids, n, pos0));
    if (!cpumla_dsv4_resumable(s, pos0)) {
        char msg[200];
        snprintf(msg, sizeof msg, "the V4 state holds %lld tokens and cannot continue at position %lld",
                 (long long)s->len, (long long)pos0);
        cpumla_set_error(msg);
        return -1;
    }
    if (pos0 == 0) s->top = 0;
    s->len = pos0;                                  /* on failure the state holds what came before */
    s->top = s->top > pos0 + n ? s->top : pos0 + n;
    int64_t D = m->hidden, N = m->hc_mult;
    for (int64_t t = 0; t < n; t++) {
        s->pos[t] = pos0 + t;
        kern_dequant(&cpumla_k, m->embed, ids[t], 0, D, s->X + t * N * D);
        for (int64_t i = 1; i < N; i++) memcpy(s->X + (t * N + i) * D, s->X + t * N * D, sizeof(float) * (size_t)D);
    }
    for (int64_t l = 0; l < m->n_layers; l++) {
        DSV4_TRY(layer_attn(s, l, n, pos0));
        DSV4_TRY(layer_ffn(s, l, n, ids));
    }
    if (hidden) memcpy(hidden, s->X, sizeof(float) * (size_t)(n * N * D));
    DSV4_TRY(hyper_head(s, &m->hc_head, &m->norm, n, logits, last_only));
    s->len = pos0 + n;
    return 0;
}

/* The MTP layer: X = h_proj(hnorm(H)) + e_proj(enorm(e)), its layer, its HyperHead. */
static int mtp_forward(cpumla_dsv4_state *s, const int64_t *ids, int64_t n, int64_t pos0, const float *hidden,
                       float *logits, int32_t last_only, float *hidden_out) {
    const cpumla_dsv4_model *m = s->m;
    const cpumla_dsv4_mtp *mtp = m->mtp;
    if (!mtp) {
        cpumla_set_error("this model has no MTP layer");
        return -1;
    }
    DSV4_TRY(check_call(s, ids, n, pos0));
    int64_t D = m->hidden, N = m->hc_mult, W = m->sliding_window;
    float eps = m->rms_norm_eps;
    /* runs on where the ring holds the window's entries since the window last started, else starts it
     * again at pos0 */
    int64_t first = pos0 - W + 1 > s->mtp_from ? pos0 - W + 1 : s->mtp_from;
    if (pos0 < s->mtp_from || pos0 > s->mtp_top || first < s->mtp_top - s->wr) s->mtp_from = s->mtp_top = pos0;
    for (int64_t t = 0; t < n; t++) {
        s->pos[t] = pos0 + t;
        kern_dequant(&cpumla_k, m->embed, ids[t], 0, D, s->y + t * D);
    }
    cpumla_rmsnorm(s->y, D, s->x, D, n, D, mtp->enorm.data, mtp->enorm.dtype, eps);
    DSV4_TRY(cpumla_gemm(mtp->e_proj, s->x, D, n, s->o, D));
    cpumla_rmsnorm(hidden, D, s->Xn, D, n * N, D, mtp->hnorm.data, mtp->hnorm.dtype, eps);
    DSV4_TRY(cpumla_gemm(mtp->h_proj, s->Xn, D, n * N, s->X, D));
    for (int64_t t = 0; t < n; t++)
        for (int64_t i = 0; i < N; i++) {
            float *x = s->X + (t * N + i) * D;
            const float *e = s->o + t * D;
            for (int64_t d = 0; d < D; d++) x[d] += e[d];
        }
    DSV4_TRY(layer_attn(s, m->n_layers, n, pos0));       /* the window entries of every position */
    s->mtp_top = s->mtp_top > pos0 + n ? s->mtp_top : pos0 + n;
    if (!logits && !hidden_out) return 0;
    if (last_only && n > 1) {              /* the MoE for the position whose output is wanted alone */
        memmove(s->X, s->X + (n - 1) * N * D, sizeof(float) * (size_t)(N * D));
        ids += n - 1;
        n = 1;
    }
    DSV4_TRY(layer_ffn(s, m->n_layers, n, ids));
    if (hidden_out) memcpy(hidden_out, s->X, sizeof(float) * (size_t)(n * N * D));
    return logits ? hyper_head(s, &mtp->hc_head, &mtp->norm, n, logits, last_only) : 0;
}

/* Under the library lock, with the model's own scratch. */
int cpumla_dsv4_forward(cpumla_dsv4_state *s, const int64_t *ids, int64_t n, int64_t pos0, float *logits,
                        int32_t last_only) {
    cpumla_enter(s->scratch);
    cpumla_ensure_init();
    return cpumla_leave(forward(s, ids, n, pos0, logits, last_only, NULL));
}

int cpumla_dsv4_forward_hidden(cpumla_dsv4_state *s, const int64_t *ids, int64_t n, int64_t pos0, float *logits,
                               int32_t last_only, float *hidden) {
    cpumla_enter(s->scratch);
    cpumla_ensure_init();
    return cpumla_leave(forward(s, ids, n, pos0, logits, last_only, hidden));
}

int cpumla_dsv4_mtp_forward(cpumla_dsv4_state *s, const int64_t *ids, int64_t n, int64_t pos0, const float *hidden,
                            float *logits, int32_t last_only, float *hidden_out) {
    cpumla_enter(s->scratch);
    cpumla_ensure_init();
    return cpumla_leave(mtp_forward(s, ids, n, pos0, hidden, logits, last_only, hidden_out));
}
