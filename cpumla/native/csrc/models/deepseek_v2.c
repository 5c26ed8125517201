/* deepseek_v2.c: the DeepSeek V2 / V3 forward in one call (cpumla_dsv2_forward), so the per-token path
 * never returns to Python. Portable orchestration of the public kernels; all heavy work happens inside
 * them. Every buffer a forward touches belongs to the model's state, allocated once at load.
 *
 * D=hidden H=heads R=kv_lora_rank P=qk_rope_head_dim dn=qk_nope_head_dim dv=v_head_dim qk=dn+P
 * QL=q_lora_rank E=routed experts K=experts per token n=tokens in this call T=cached tokens */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "models/deepseek_v2_impl.h"
#include "core/dispatch.h"
#include "core/expert_stream.h"

#define TRY(call) do { if ((call) != 0) return -1; } while (0)

const cpumla_dsv2_layer *dsv2_layer(const cpumla_dsv2_model *m, int64_t l) {
    return l < m->n_layers ? &m->layers[l] : &m->mtp->layer;
}

int64_t dsv2_cached_layers(const cpumla_dsv2_model *m) { return m->n_layers + (m->mtp ? 1 : 0); }

static int64_t max_experts(const cpumla_dsv2_model *m, int want_k) {
    int64_t v = 0;
    for (int64_t l = 0; l < dsv2_cached_layers(m); l++) {
        const cpumla_router *r = dsv2_layer(m, l)->router;
        if (r) {
            int64_t x = want_k ? r->top_k : r->n_experts;
            v = x > v ? x : v;
        }
    }
    return v > 0 ? v : 1;
}

int dsv2_state_init(cpumla_dsv2_state *s, const cpumla_dsv2_model *m, int64_t ctx, int64_t max_tokens) {
    memset(s, 0, sizeof *s);
    s->m = m;
    if (ctx < 1 || max_tokens < 1 || m->n_layers < 1) {
        cpumla_set_error("a model state needs a context and a chunk of at least one token");
        return -1;
    }
    s->ctx = ctx;
    s->max_tokens = max_tokens = max_tokens < ctx ? max_tokens : ctx;
    int64_t n = max_tokens, D = m->hidden, H = m->n_heads, R = m->kv_lora_rank, P = m->qk_rope_head_dim;
    int64_t qk = m->qk_nope_head_dim + P, QL = m->q_lora_rank > 0 ? m->q_lora_rank : 0;
    int64_t E = max_experts(m, 0), K = max_experts(m, 1);
    int64_t sizes[] = {n * D, n * D, n * D, n * QL, n * H * qk, n * (R + P), n * H * (R + P), n * H * R,
                       n * H * m->v_head_dim, n * E, n * K, n, m->mtp ? 2 * n * D : 0};
    float **slots[] = {&s->h, &s->x, &s->t, &s->qa, &s->q, &s->latent, &s->q_abs, &s->o_lat, &s->o, &s->gate,
                       &s->w, &s->ones, &s->cat};
    size_t floats = 0;
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) floats += (size_t)((sizes[i] + 15) & ~15);
    size_t bytes = floats * 4 + (size_t)(n * K + n) * 4 + (size_t)n * 16 + 256;
    s->block = aligned_alloc(64, (bytes + 63) & ~(size_t)63);
    s->n_cached = dsv2_cached_layers(m);
    s->cache = calloc((size_t)s->n_cached, sizeof(float *));
    s->scratch = cpumla_ctx_new();
    if (!s->block || !s->cache || !s->scratch) goto oom;
    float *p = s->block;
    for (size_t i = 0; i < sizeof slots / sizeof slots[0]; i++) {
        *slots[i] = p;
        p += (sizes[i] + 15) & ~15;
    }
    s->idx = (int32_t *)p;
    s->zeros = s->idx + n * K;
    s->pos = (int64_t *)(((uintptr_t)(s->zeros + n) + 7) & ~(uintptr_t)7);
    s->kv_len = s->pos + n;
    for (int64_t t = 0; t < n; t++) { s->zeros[t] = 0; s->ones[t] = 1.0f; }
    size_t row = (size_t)(R + P) * sizeof(float);
    for (int64_t l = 0; l < s->n_cached; l++) {
        /* rows are written before they are read: no need to clear (untouched pages stay unmapped) */
        s->cache[l] = cpumla_cache_alloc((size_t)ctx * row);
        if (!s->cache[l]) goto oom;
    }
    return 0;
oom:
    dsv2_state_release(s);
    cpumla_set_error("out of memory for the model's latent cache and scratch");
    return -1;
}

void dsv2_state_release(cpumla_dsv2_state *s) {
    if (s->cache)
        for (int64_t l = 0; l < s->n_cached; l++) free(s->cache[l]);
    free(s->cache);
    free(s->block);
    cpumla_ctx_free(s->scratch);
    s->cache = NULL;
    s->block = NULL;
    s->scratch = NULL;
}

int dsv2_begin(cpumla_dsv2_state *s, const int64_t *ids, int64_t n, int64_t pos0) {
    const cpumla_dsv2_model *m = s->m;
    char msg[160];
    if (n <= 0 || n > s->max_tokens) {
        snprintf(msg, sizeof msg, "a forward takes 1 to %lld tokens, got %lld", (long long)s->max_tokens,
                 (long long)n);
        cpumla_set_error(msg);
        return -1;
    }
    if (pos0 < 0 || pos0 + n > s->ctx) {
        snprintf(msg, sizeof msg, "context full: %lld cached + %lld new tokens > %lld", (long long)pos0,
                 (long long)n, (long long)s->ctx);
        cpumla_set_error(msg);
        return -1;
    }
    for (int64_t t = 0; t < n; t++) {
        if (ids[t] < 0 || ids[t] >= m->vocab) {
            snprintf(msg, sizeof msg, "token id %lld is outside the vocabulary of %lld", (long long)ids[t],
                     (long long)m->vocab);
            cpumla_set_error(msg);
            return -1;
        }
    }
    int64_t D = m->hidden;
    for (int64_t t = 0; t < n; t++) {
        s->pos[t] = pos0 + t;
        s->kv_len[t] = pos0 + t + 1;
        kern_dequant(&cpumla_k, m->embed, ids[t], 0, D, s->h + t * D);
    }
    return 0;
}

int dsv2_attn_in(cpumla_dsv2_state *s, int64_t l, int64_t n) {
    const cpumla_dsv2_model *m = s->m;
    const cpumla_dsv2_layer *L = dsv2_layer(m, l);
    int64_t D = m->hidden, H = m->n_heads, R = m->kv_lora_rank, P = m->qk_rope_head_dim;
    int64_t dn = m->qk_nope_head_dim, qk = dn + P;
    float eps = m->rms_norm_eps;
    cpumla_rmsnorm(s->h, D, s->x, D, n, D, L->input_ln.data, L->input_ln.dtype, eps);
    if (L->q) {
        TRY(cpumla_gemm(L->q, s->x, D, n, s->q, H * qk));
    } else {
        int64_t QL = m->q_lora_rank;
        TRY(cpumla_gemm(L->q_a, s->x, D, n, s->qa, QL));
        cpumla_rmsnorm(s->qa, QL, s->qa, QL, n, QL, L->q_a_ln.data, L->q_a_ln.dtype, eps);
        TRY(cpumla_gemm(L->q_b, s->qa, QL, n, s->q, H * qk));
    }
    TRY(cpumla_gemm(L->kv_a, s->x, D, n, s->latent, R + P));
    cpumla_rmsnorm(s->latent, R + P, s->latent, R + P, n, R, L->kv_a_ln.data, L->kv_a_ln.dtype, eps);
    cpumla_rope(s->latent, n, R + P, 1, 0, R, P, s->pos, m->inv_freq, m->rope_attn_scale, CPUMLA_ROPE_INTERLEAVED);
    cpumla_rope(s->q, n, H * qk, H, qk, dn, P, s->pos, m->inv_freq, m->rope_attn_scale, CPUMLA_ROPE_INTERLEAVED);
    TRY(cpumla_cache_store(s->cache[l], CPUMLA_F32, R + P, s->latent, R + P, n, R + P, s->pos));
    return 0;
}

int cpumla_dsv2_unabsorbed(const cpumla_dsv2_model *m, int64_t n) {
    return n > 1 && n >= (m->mha_min_tokens > 0 ? m->mha_min_tokens : CPUMLA_DSV2_MHA_MIN_TOKENS);
}

/* h += o_proj(o) */
static int attn_proj(cpumla_dsv2_state *s, const cpumla_dsv2_layer *L, int64_t n) {
    int64_t D = s->m->hidden;
    TRY(cpumla_gemm(L->o_proj, s->o, s->m->n_heads * s->m->v_head_dim, n, s->t, D));
    TRY(tp_all_reduce(s->m->comm, s->t, n * D));
    for (int64_t i = 0; i < n * D; i++) s->h[i] += s->t[i];
    return 0;
}

int dsv2_attn_out(cpumla_dsv2_state *s, int64_t l, int64_t n, int64_t pos0, const int32_t *kv_idx, int64_t ld_idx,
                  const int64_t *kv_count) {
    const cpumla_dsv2_model *m = s->m;
    const cpumla_dsv2_layer *L = dsv2_layer(m, l);
    int64_t H = m->n_heads, R = m->kv_lora_rank, P = m->qk_rope_head_dim;
    int64_t dn = m->qk_nope_head_dim, dv = m->v_head_dim, qk = dn + P;
    if (!kv_idx && cpumla_dsv2_unabsorbed(m, n)) {
        /* un-absorbed: keys and values decompressed from the cache, o written straight */
        cpumla_mla_mha_args b = {.q = s->q, .ldq_t = H * qk, .ldq_h = qk, .n_q = n, .n_heads = H,
                                 .kv = s->cache[l], .kv_dtype = CPUMLA_F32, .ld_kv = R + P, .n_kv = pos0 + n,
                                 .rank = R, .rope_dim = P, .kv_b = L->kv_b, .dn = dn, .dv = dv,
                                 .kv_len = s->kv_len, .scale = m->softmax_scale, .out = s->o,
                                 .ldo_t = H * dv, .ldo_h = dv, .k_b = L->k_b, .v_b = L->v_b};
        TRY(cpumla_mla_mha(&b));
        return attn_proj(s, L, n);
    }
    /* absorb: q~_h[:R] = q_nope_h @ W_UK[h]; q~_h[R:] = q_pe_h */
    if (L->k_b) TRY(cpumla_head_gemv(L->k_b, 0, R, R, H, n, s->q, H * qk, qk, s->q_abs, H * (R + P), R + P));
    else TRY(cpumla_head_gemv_t(L->kv_b, 0, dn + dv, dn, H, n, s->q, H * qk, qk, s->q_abs, H * (R + P), R + P));
    for (int64_t t = 0; t < n; t++)
        for (int64_t hh = 0; hh < H; hh++)
            memcpy(s->q_abs + (t * H + hh) * (R + P) + R, s->q + t * H * qk + hh * qk + dn, sizeof(float) * (size_t)P);
    cpumla_attn_args a;
    memset(&a, 0, sizeof a);
    a.q = s->q_abs; a.ldq_t = H * (R + P); a.ldq_h = R + P; a.n_q = n; a.n_heads = H;
    a.kv = s->cache[l]; a.kv_dtype = CPUMLA_F32; a.ld_kv = R + P; a.n_kv = pos0 + n; a.dk = R + P; a.dv = R;
    a.kv_len = kv_idx ? kv_count : s->kv_len; a.kv_idx = kv_idx; a.ld_idx = ld_idx;
    a.scale = m->softmax_scale;
    a.out = s->o_lat; a.ldo_t = H * R; a.ldo_h = R;
    TRY(cpumla_mla_attention(&a));
    /* un-absorb: o_h = W_UV[h] o~_h */
    if (L->v_b) TRY(cpumla_head_gemv(L->v_b, 0, dv, dv, H, n, s->o_lat, H * R, R, s->o, H * dv, dv));
    else TRY(cpumla_head_gemv(L->kv_b, dn, dn + dv, dv, H, n, s->o_lat, H * R, R, s->o, H * dv, dv));
    return attn_proj(s, L, n);
}

int dsv2_ffn(cpumla_dsv2_state *s, int64_t l, int64_t n) {
    const cpumla_dsv2_model *m = s->m;
    const cpumla_dsv2_layer *L = dsv2_layer(m, l);
    int64_t D = m->hidden;
    const cpumla_comm *c = m->comm;
    float *acc = s->h;      /* tensor parallel: this rank's partial sums into t, all-reduced, then added */
    if (c) {
        acc = s->t;
        memset(acc, 0, sizeof(float) * (size_t)(n * D));
    }
    cpumla_rmsnorm(s->h, D, s->x, D, n, D, L->post_ln.data, L->post_ln.dtype, m->rms_norm_eps);
    if (L->gate) {
        const cpumla_router *r = L->router;
        /* fp32 activations, as transformers computes router logits: bf16-rounded ones move scores
         * across the top-k boundary */
        TRY(cpumla_gemm_f32act(L->gate, s->x, D, n, s->gate, r->n_experts));
        TRY(cpumla_route(r, s->gate, r->n_experts, n, NULL, s->idx, s->w));
        const cpumla_dsv2_layer *next = l + 1 < m->n_layers ? &m->layers[l + 1] : NULL;
        if (n == 1 && next && next->gate)       /* experts read from disk: the next layer's, ahead */
            TRY(stream_predict(next->experts, next->gate, next->router, s->x, D, NULL));
        TRY(cpumla_moe(L->experts, r->n_experts, s->x, D, n, s->idx, s->w, r->top_k, acc, D, 0.0f));
    }
    if (L->mlp) TRY(cpumla_moe(L->mlp, 1, s->x, D, n, s->zeros, s->ones, 1, acc, D, 0.0f));
    if (c) {
        TRY(tp_all_reduce(c, acc, n * D));
        for (int64_t i = 0; i < n * D; i++) s->h[i] += acc[i];
    }
    return 0;
}

/* logits [rows, vocab] = lm_head(x) (this rank's vocabulary rows, gathered on rank 0 under tensor
 * parallel) */
static int head(const cpumla_dsv2_model *m, const float *x, int64_t rows, float *logits) {
    return tp_head(m->comm, m->lm_head, m->head_row0, x, m->hidden, rows, logits, m->vocab);
}

int dsv2_end(cpumla_dsv2_state *s, int64_t n, float *logits, int32_t last_only) {
    const cpumla_dsv2_model *m = s->m;
    int64_t D = m->hidden, first = last_only ? n - 1 : 0, rows = n - first;
    cpumla_rmsnorm(s->h + first * D, D, s->x, D, rows, D, m->norm.data, m->norm.dtype, m->rms_norm_eps);
    return head(m, s->x, rows, logits);
}

/* ---- public ----------------------------------------------------------------------------------- */
cpumla_dsv2_state *cpumla_dsv2_new(const cpumla_dsv2_model *m, int64_t ctx, int64_t max_tokens) {
    cpumla_ensure_init();
    cpumla_dsv2_state *s = malloc(sizeof *s);
    if (!s) { cpumla_set_error("out of memory for the model state"); return NULL; }
    if (dsv2_state_init(s, m, ctx, max_tokens) != 0) { free(s); return NULL; }
    return s;
}

void cpumla_dsv2_free(cpumla_dsv2_state *s) {
    if (!s) return;
    dsv2_state_release(s);
    free(s);
}

static int forward(cpumla_dsv2_state *s, const int64_t *ids, int64_t n, int64_t pos0, float *logits,
                   int32_t last_only, float *hidden) {
    const cpumla_dsv2_model *m = s->m;
    TRY(dsv2_begin(s, ids, n, pos0));
    for (int64_t l = 0; l < m->n_layers; l++) {
        TRY(dsv2_attn_in(s, l, n));
        TRY(dsv2_attn_out(s, l, n, pos0, NULL, 0, NULL));
        TRY(dsv2_ffn(s, l, n));
    }
    TRY(dsv2_final_hidden(s, n, hidden));
    return dsv2_end(s, n, logits, last_only);
}

int dsv2_mtp_in(cpumla_dsv2_state *s, const int64_t *ids, int64_t n, int64_t pos0, const float *hidden) {
    const cpumla_dsv2_model *m = s->m;
    const cpumla_dsv2_mtp *mtp = m->mtp;
    if (!mtp) {
        cpumla_set_error("this model has no MTP layer");
        return -1;
    }
    int64_t D = m->hidden;
    float eps = m->rms_norm_eps;
    TRY(dsv2_begin(s, ids, n, pos0));      /* the embeddings e into s->h */
    cpumla_rmsnorm(s->h, D, s->cat, 2 * D, n, D, mtp->enorm.data, mtp->enorm.dtype, eps);
    cpumla_rmsnorm(hidden, D, s->cat + D, 2 * D, n, D, mtp->hnorm.data, mtp->hnorm.dtype, eps);
    return cpumla_gemm(mtp->eh_proj, s->cat, 2 * D, n, s->h, D);
}

int dsv2_mtp_out(cpumla_dsv2_state *s, int64_t n, float *logits, int32_t last_only, float *hidden_out) {
    const cpumla_dsv2_model *m = s->m;
    int64_t D = m->hidden;
    if (hidden_out) memcpy(hidden_out, s->h, sizeof(float) * (size_t)(n * D));
    if (!logits) return 0;
    int64_t first = last_only ? n - 1 : 0, rows = n - first;
    cpumla_rmsnorm(s->h + first * D, D, s->x, D, rows, D, m->mtp->norm.data, m->mtp->norm.dtype, m->rms_norm_eps);
    return head(m, s->x, rows, logits);
}

int dsv2_final_hidden(cpumla_dsv2_state *s, int64_t n, float *hidden) {
    const cpumla_dsv2_model *m = s->m;
    if (hidden)
        cpumla_rmsnorm(s->h, m->hidden, hidden, m->hidden, n, m->hidden, m->norm.data, m->norm.dtype, m->rms_norm_eps);
    return 0;
}

void dsv2_keep_last(cpumla_dsv2_state *s, int64_t n) {
    const cpumla_dsv2_model *m = s->m;
    int64_t D = m->hidden, qw = m->n_heads * (m->qk_nope_head_dim + m->qk_rope_head_dim);
    memmove(s->h, s->h + (n - 1) * D, sizeof(float) * (size_t)D);
    memmove(s->q, s->q + (n - 1) * qw, sizeof(float) * (size_t)qw);
    s->pos[0] = s->pos[n - 1];
    s->kv_len[0] = s->kv_len[n - 1];
}

static int mtp_forward(cpumla_dsv2_state *s, const int64_t *ids, int64_t n, int64_t pos0, const float *hidden,
                       float *logits, int32_t last_only, float *hidden_out) {
    int64_t L = s->m->n_layers;
    TRY(dsv2_mtp_in(s, ids, n, pos0, hidden));
    TRY(dsv2_attn_in(s, L, n));
    if (!logits && !hidden_out) return 0;          /* the cache entries alone */
    if (last_only && n > 1) {                      /* the last position alone goes on */
        dsv2_keep_last(s, n);
        pos0 += n - 1;
        n = 1;
    }
    TRY(dsv2_attn_out(s, L, n, pos0, NULL, 0, NULL));
    TRY(dsv2_ffn(s, L, n));
    return dsv2_mtp_out(s, n, logits, last_only, hidden_out);
}

/* Under the library lock, with the model's own scratch: a failed scratch request anywhere inside makes
 * the forward return -1 rather than go on with garbage. */
int cpumla_dsv2_forward(cpumla_dsv2_state *s, const int64_t *ids, int64_t n, int64_t pos0, float *logits,
                        int32_t last_only) {
    cpumla_enter(s->scratch);
    cpumla_ensure_init();
    return cpumla_leave(forward(s, ids, n, pos0, logits, last_only, NULL));
}

int cpumla_dsv2_forward_hidden(cpumla_dsv2_state *s, const int64_t *ids, int64_t n, int64_t pos0, float *logits,
                               int32_t last_only, float *hidden) {
    cpumla_enter(s->scratch);
    cpumla_ensure_init();
    return cpumla_leave(forward(s, ids, n, pos0, logits, last_only, hidden));
}

int cpumla_dsv2_mtp_forward(cpumla_dsv2_state *s, const int64_t *ids, int64_t n, int64_t pos0, const float *hidden,
                            float *logits, int32_t last_only, float *hidden_out) {
    cpumla_enter(s->scratch);
    cpumla_ensure_init();
    return cpumla_leave(mtp_forward(s, ids, n, pos0, hidden, logits, last_only, hidden_out));
}
