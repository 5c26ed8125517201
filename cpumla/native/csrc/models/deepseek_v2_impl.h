/* deepseek_v2_impl.h: the pieces of the DeepSeek-V2/V3 forward (deepseek_v2.c) that a family built on it
 * reuses: V3.2 (deepseek_v32.c) runs the same layer with its indexer between the attention's input
 * projections and the attention itself. Library-internal.
 *
 * D=hidden H=heads R=kv_lora_rank P=qk_rope_head_dim dn=qk_nope_head_dim dv=v_head_dim qk=dn+P
 * QL=q_lora_rank E=routed experts K=experts per token n=tokens in this call */
#ifndef CPUMLA_DEEPSEEK_V2_IMPL_H
#define CPUMLA_DEEPSEEK_V2_IMPL_H
#include "core/common.h"
#include "deepseek_v2.h"

struct cpumla_dsv2_state {
    const cpumla_dsv2_model *m;
    int64_t ctx, max_tokens;
    cpumla_ctx *scratch;  /* the kernels' scratch (attention parts, MoE lists, operand conversions) */
    int64_t n_cached;  /* latent caches: n_layers, plus one for the MTP layer */
    float **cache;   /* [n_cached] latent caches [ctx, R+P] = rows of [c_kv | RoPE(k_pe)] */
    void *block;     /* the one allocation behind every scratch pointer below */
    float *h;        /* [n, D] residual stream */
    float *x;        /* [n, D] normed input of a sub-block */
    float *t;        /* [n, D] o_proj output */
    float *qa;       /* [n, QL] q LoRA latent after its norm */
    float *q;        /* [n, H*qk] */
    float *latent;   /* [n, R+P] = [c_kv | k_pe] */
    float *q_abs;    /* [n, H, R+P] absorbed queries (the absorbed form only) */
    float *o_lat;    /* [n, H, R] */
    float *o;        /* [n, H*dv] */
    float *gate;     /* [n, E] router logits */
    float *w;        /* [n, K] routing weights */
    float *ones;     /* [n] */
    float *cat;      /* [n, 2D] the MTP layer's [enorm(e) ; hnorm(h)] (with an MTP layer only) */
    int32_t *idx;    /* [n, K] */
    int32_t *zeros;  /* [n] */
    int64_t *pos;    /* [n] positions */
    int64_t *kv_len; /* [n] = pos + 1 */
};

/* Layer l of m: the MTP layer for l = n_layers. */
CPUMLA_INTERNAL const cpumla_dsv2_layer *dsv2_layer(const cpumla_dsv2_model *m, int64_t l);
/* n_layers, plus one with an MTP layer. */
CPUMLA_INTERNAL int64_t dsv2_cached_layers(const cpumla_dsv2_model *m);

/* Caches and scratch for m; 0, or -1 (error set; whatever was allocated is released). */
CPUMLA_INTERNAL int dsv2_state_init(cpumla_dsv2_state *s, const cpumla_dsv2_model *m, int64_t ctx,
                                    int64_t max_tokens);
CPUMLA_INTERNAL void dsv2_state_release(cpumla_dsv2_state *s);

/* Checks the call, fills positions and embeds ids into s->h. 0 or -1. */
CPUMLA_INTERNAL int dsv2_begin(cpumla_dsv2_state *s, const int64_t *ids, int64_t n, int64_t pos0);
/* Attention inputs of layer l: s->x = input norm of h; s->qa (q LoRA); queries (RoPE applied) in s->q;
 * the new latent rows stored in the cache at their positions. */
CPUMLA_INTERNAL int dsv2_attn_in(cpumla_dsv2_state *s, int64_t l, int64_t n);
/* Attention of the n queries over the cache, then h += o_proj(o). kv_idx NULL: causal over every cached
 * row, un-absorbed (cpumla_mla_mha) when cpumla_dsv2_unabsorbed, else absorbed (queries through W_UK into
 * s->q_abs, latent attention, o = W_UV o~); with kv_idx (always absorbed) query i sees rows
 * kv_idx[i*ld_idx + j], j < kv_count[i] (cpumla_attn_args). */
CPUMLA_INTERNAL int dsv2_attn_out(cpumla_dsv2_state *s, int64_t l, int64_t n, int64_t pos0,
                                  const int32_t *kv_idx, int64_t ld_idx, const int64_t *kv_count);
/* h += MoE or dense MLP of the post-attention norm of h. */
CPUMLA_INTERNAL int dsv2_ffn(cpumla_dsv2_state *s, int64_t l, int64_t n);
/* Final norm and lm_head. */
CPUMLA_INTERNAL int dsv2_end(cpumla_dsv2_state *s, int64_t n, float *logits, int32_t last_only);
/* The final normed hidden states of the n tokens into hidden [n, D] (NULL: nothing), before dsv2_end. */
CPUMLA_INTERNAL int dsv2_final_hidden(cpumla_dsv2_state *s, int64_t n, float *hidden);
/* The MTP layer around its decoder layer (index n_layers): dsv2_mtp_in checks there is one, embeds ids
 * and writes u = eh_proj([enorm(e) ; hnorm(hidden)]) into s->h; dsv2_mtp_out copies h' into hidden_out
 * and writes the logits (shared_head.norm, lm_head) unless logits is NULL. */
CPUMLA_INTERNAL int dsv2_mtp_in(cpumla_dsv2_state *s, const int64_t *ids, int64_t n, int64_t pos0, const float *hidden);
/* After dsv2_attn_in of n tokens: the last one's residual row, queries, position and causal length moved
 * to row 0, so the rest of the layer runs on it alone (an MTP pass that wants the last position's
 * output only: the others' cache entries are written, their MoE is not run). */
CPUMLA_INTERNAL void dsv2_keep_last(cpumla_dsv2_state *s, int64_t n);
CPUMLA_INTERNAL int dsv2_mtp_out(cpumla_dsv2_state *s, int64_t n, float *logits, int32_t last_only, float *hidden_out);

#endif
