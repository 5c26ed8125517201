/* mla_model.c: the whole DeepSeek V2/V3 forward in one call (cpumla_mla_forward), so the per-token
 * path never returns to Python and allocates nothing once warm. Portable orchestration of the public
 * kernels; all heavy work happens inside them.
 *
 * D=hidden H=heads R=kv_lora_rank P=qk_rope_head_dim dn=qk_nope_head_dim dv=v_head_dim qk=dn+P
 * E=experts K=top_k n=tokens in this call T=cached tokens */
#include <stdio.h>
#include <string.h>
#include "common.h"
#include "dispatch.h"

typedef struct {
    float *h;        /* [n, D] residual stream */
    float *x;        /* [n, D] normed input of a sub-block */
    float *t;        /* [n, D] o_proj output */
    float *qa;       /* [n, q_lora] */
    float *q;        /* [n, H*qk] */
    float *latent;   /* [n, R+P] = [c_kv | k_pe] */
    float *q_abs;    /* [n, H, R+P] absorbed queries */
    float *o_lat;    /* [n, H, R] */
    float *o;        /* [n, H*dv] */
    float *gate;     /* [n, E] router logits */
    float *w;        /* [n, K] routing weights */
    float *ones;     /* [n] */
    int32_t *idx;    /* [n, K] */
    int32_t *zeros;  /* [n] */
    int64_t *pos;    /* [n] positions */
    int64_t *kv_len; /* [n] = pos + 1 */
} fwd_scratch;

static int fwd_alloc(const cpumla_mla_model *m, int64_t n, int64_t E, int64_t K, fwd_scratch *s) {
    int64_t D = m->hidden, H = m->n_heads, R = m->kv_lora_rank, P = m->qk_rope_head_dim;
    int64_t qk = m->qk_nope_head_dim + P, QL = m->q_lora_rank > 0 ? m->q_lora_rank : 0;
    int64_t sizes[] = {n * D, n * D, n * D, n * QL, n * H * qk, n * (R + P), n * H * (R + P), n * H * R,
                       n * H * m->v_head_dim, n * (E > 0 ? E : 1), n * (K > 0 ? K : 1), n};
    size_t floats = 0;
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) floats += (size_t)((sizes[i] + 15) & ~15);
    size_t bytes = floats * 4 + (size_t)n * (K > 0 ? K : 1) * 4 + (size_t)n * 4 + (size_t)n * 16 + 256;
    float *p = cpumla_scratch(CPUMLA_SCRATCH_FWD, bytes);
    if (!p) return -1;
    float **slots[] = {&s->h, &s->x, &s->t, &s->qa, &s->q, &s->latent, &s->q_abs, &s->o_lat, &s->o, &s->gate,
                       &s->w, &s->ones};
    for (size_t i = 0; i < sizeof slots / sizeof slots[0]; i++) {
        *slots[i] = p;
        p += (sizes[i] + 15) & ~15;
    }
    s->idx = (int32_t *)p;
    s->zeros = s->idx + n * (K > 0 ? K : 1);
    s->pos = (int64_t *)(((uintptr_t)(s->zeros + n) + 7) & ~(uintptr_t)7);
    s->kv_len = s->pos + n;
    return 0;
}

/* The attention sub-block of layer L for n tokens: h += o_proj(MLA(rmsnorm(h))). */
static void attention(const cpumla_mla_model *m, const cpumla_mla_layer *L, int64_t n, int64_t pos0,
                      fwd_scratch *s) {
    int64_t D = m->hidden, H = m->n_heads, R = m->kv_lora_rank, P = m->qk_rope_head_dim;
    int64_t dn = m->qk_nope_head_dim, dv = m->v_head_dim, qk = dn + P;
    float eps = m->rms_norm_eps;
    cpumla_rmsnorm(s->h, D, s->x, D, n, D, L->input_ln.data, L->input_ln.dtype, eps);
    if (L->q) {
        cpumla_gemm(L->q, s->x, D, n, s->q, H * qk);
    } else {
        int64_t QL = m->q_lora_rank;
        cpumla_gemm(L->q_a, s->x, D, n, s->qa, QL);
        cpumla_rmsnorm(s->qa, QL, s->qa, QL, n, QL, L->q_a_ln.data, L->q_a_ln.dtype, eps);
        cpumla_gemm(L->q_b, s->qa, QL, n, s->q, H * qk);
    }
    cpumla_gemm(L->kv_a, s->x, D, n, s->latent, R + P);
    cpumla_rmsnorm(s->latent, R + P, s->latent, R + P, n, R, L->kv_a_ln.data, L->kv_a_ln.dtype, eps);
    cpumla_rope(s->latent, n, R + P, 1, 0, R, P, s->pos, m->inv_freq, m->rope_attn_scale, CPUMLA_ROPE_INTERLEAVED);
    cpumla_rope(s->q, n, H * qk, H, qk, dn, P, s->pos, m->inv_freq, m->rope_attn_scale, CPUMLA_ROPE_INTERLEAVED);
    /* absorb: q~_h[:R] = q_nope_h @ W_UK[h]; q~_h[R:] = q_pe_h */
    cpumla_head_gemv_t(L->kv_b, 0, dn + dv, dn, H, n, s->q, H * qk, qk, s->q_abs, H * (R + P), R + P);
    for (int64_t t = 0; t < n; t++)
        for (int64_t hh = 0; hh < H; hh++)
            memcpy(s->q_abs + (t * H + hh) * (R + P) + R, s->q + t * H * qk + hh * qk + dn, sizeof(float) * (size_t)P);
    cpumla_cache_store(L->cache, m->cache_dtype, R + P, s->latent, R + P, n, R + P, s->pos);
    cpumla_attn_args a;
    memset(&a, 0, sizeof a);
    a.q = s->q_abs; a.ldq_t = H * (R + P); a.ldq_h = R + P; a.n_q = n; a.n_heads = H;
    a.kv = L->cache; a.kv_dtype = m->cache_dtype; a.ld_kv = R + P; a.n_kv = pos0 + n; a.dk = R + P; a.dv = R;
    a.kv_len = s->kv_len; a.scale = m->softmax_scale;
    a.out = s->o_lat; a.ldo_t = H * R; a.ldo_h = R;
    cpumla_mla_attention(&a);
    /* un-absorb: o_h = W_UV[h] o~_h */
    cpumla_head_gemv(L->kv_b, dn, dn + dv, dv, H, n, s->o_lat, H * R, R, s->o, H * dv, dv);
    cpumla_gemm(L->o_proj, s->o, H * dv, n, s->t, D);
    for (int64_t i = 0; i < n * D; i++) s->h[i] += s->t[i];
}

/* The FFN sub-block: h += MoE or dense MLP of rmsnorm(h). */
static int ffn(const cpumla_mla_model *m, const cpumla_mla_layer *L, int64_t n, fwd_scratch *s) {
    int64_t D = m->hidden;
    cpumla_rmsnorm(s->h, D, s->x, D, n, D, L->post_ln.data, L->post_ln.dtype, m->rms_norm_eps);
    if (L->gate) {
        const cpumla_router *r = L->router;
        /* fp32 activations, as transformers computes router logits: bf16-rounded ones move scores
         * across the top-k boundary */
        if (cpumla_gemm_f32act(L->gate, s->x, D, n, s->gate, r->n_experts) != 0) return -1;
        if (cpumla_route(r, s->gate, r->n_experts, n, NULL, s->idx, s->w) != 0) return -1;
        if (cpumla_moe(L->experts, r->n_experts, s->x, D, n, s->idx, s->w, r->top_k, s->h, D, 0.0f) != 0) return -1;
    }
    if (L->mlp && cpumla_moe(L->mlp, 1, s->x, D, n, s->zeros, s->ones, 1, s->h, D, 0.0f) != 0) return -1;
    return 0;
}

static int mla_forward(const cpumla_mla_model *m, const int64_t *ids, int64_t n, int64_t pos0, float *logits,
                       int32_t last_only) {
    char msg[160];
    if (n <= 0) { cpumla_set_error("forward needs at least one token"); return -1; }
    if (pos0 < 0 || pos0 + n > m->cache_rows) {
        snprintf(msg, sizeof msg, "context full: %lld cached + %lld new tokens > %lld", (long long)pos0,
                 (long long)n, (long long)m->cache_rows);
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
    int64_t E = 0, K = 0;
    for (int64_t l = 0; l < m->n_layers; l++)
        if (m->layers[l].router) {
            E = m->layers[l].router->n_experts > E ? m->layers[l].router->n_experts : E;
            K = m->layers[l].router->top_k > K ? m->layers[l].router->top_k : K;
        }
    fwd_scratch s;
    if (fwd_alloc(m, n, E, K, &s) != 0) return -1;
    int64_t D = m->hidden;
    for (int64_t t = 0; t < n; t++) {
        s.pos[t] = pos0 + t;
        s.kv_len[t] = pos0 + t + 1;
        s.zeros[t] = 0;
        s.ones[t] = 1.0f;
        cpumla_k.dequant_row(m->embed, ids[t], 0, D, s.h + t * D);
    }
    for (int64_t l = 0; l < m->n_layers; l++) {
        attention(m, &m->layers[l], n, pos0, &s);
        if (ffn(m, &m->layers[l], n, &s) != 0) return -1;
    }
    int64_t first = last_only ? n - 1 : 0, rows = n - first;
    cpumla_rmsnorm(s.h + first * D, D, s.x, D, rows, D, m->norm.data, m->norm.dtype, m->rms_norm_eps);
    cpumla_gemm(m->lm_head, s.x, D, rows, logits, m->vocab);
    return 0;
}

/* Under the library lock, with the scratch of the caller's context (a temporary one when it entered
 * none): a failed scratch request anywhere inside makes the forward return -1. */
int cpumla_mla_forward(const cpumla_mla_model *m, const int64_t *ids, int64_t n, int64_t pos0, float *logits,
                       int32_t last_only) {
    cpumla_enter(NULL);
    cpumla_ensure_init();
    return cpumla_leave(mla_forward(m, ids, n, pos0, logits, last_only));
}
