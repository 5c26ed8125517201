/* deepseek_v2.h: the DeepSeek-V2 / V2-Lite / V3 / R1 / V3.1 / Moonlight family (model_type deepseek_v2 and
 * deepseek_v3): MLA attention over a latent cache, then a dense MLP or a MoE, per layer.
 *
 *   D=hidden H=heads R=kv_lora_rank P=qk_rope_head_dim dn=qk_nope_head_dim dv=v_head_dim qk=dn+P
 *   QL=q_lora_rank E=routed experts K=experts per token T=cached tokens n=tokens in one call
 *
 * The model description points at checkpoint tensors in place; the state (created once per model,
 * freed with it) owns the latent caches and every scratch buffer a forward needs, so two models in one
 * process never share memory. Parsed by cffi: keep it plain C (lines starting with '#' are dropped). */
#ifndef CPUMLA_DEEPSEEK_V2_H
#define CPUMLA_DEEPSEEK_V2_H
#include "cpumla.h"
#include "mla_attention.h"
#ifdef __cplusplus
extern "C" {
#endif

/* One decoder layer. */
typedef struct cpumla_dsv2_layer {
    cpumla_vec input_ln, post_ln, q_a_ln, kv_a_ln;  /* [D], [D], [QL] (unused without q LoRA), [R] */
    const cpumla_weight *q;        /* [H*qk, D], or NULL with q LoRA */
    const cpumla_weight *q_a;      /* [QL, D] */
    const cpumla_weight *q_b;      /* [H*qk, QL] */
    const cpumla_weight *kv_a;     /* [R+P, D] */
    const cpumla_weight *kv_b;     /* [H*(dn+dv), R]: per head dn rows of W_UK, then dv rows of W_UV; */
    /* or kv_b NULL and W_UK, W_UV as a GGUF file splits them (attn_k_b [H*R, dn]: per head W_UK
     * transposed, attn_v_b [H*dv, R]), read in place by both forms of the attention */
    const cpumla_weight *k_b, *v_b;
    const cpumla_weight *o_proj;   /* [D, H*dv] */
    const cpumla_weight *gate;     /* [E, D] router, or NULL for a dense layer */
    const cpumla_router *router;
    const cpumla_expert *experts;  /* [E] routed experts */
    const cpumla_expert *mlp;      /* dense MLP (gate NULL) or the shared experts (or NULL): a table of one */
} cpumla_dsv2_layer;

/* Prefill chunks of at least this many tokens attend in the un-absorbed form (cpumla_mla_mha), shorter
 * ones and decode in the absorbed (latent) form. The crossover of their costs: per head, the absorbed
 * form spends n * R * (dn + dv) + pairs * (2R + P) multiply-adds, the un-absorbed one T * R * (dn + dv)
 * + pairs * (dn + P + dv); at V2-Lite's widths and equal efficiency they meet near n = 170 tokens at
 * any depth well above n, and lower in practice, the latent attention being the less efficient. */
enum { CPUMLA_DSV2_MHA_MIN_TOKENS = 128 };

/* The multi-token-prediction (MTP) layer of V3 / R1 / V3.1 (`model.layers.{n_layers}.*`): from the main
 * model's final normed hidden state h_i at position i and the embedding e of token i+1,
 *   u = eh_proj([enorm(e) ; hnorm(h_i)]),  h' = a decoder layer (its own latent cache) over u,
 *   logits of token i+2 = lm_head(norm(h')). */
typedef struct cpumla_dsv2_mtp {
    cpumla_vec enorm, hnorm, norm;  /* [D] each (norm: shared_head.norm) */
    const cpumla_weight *eh_proj;   /* [D, 2D] */
    cpumla_dsv2_layer layer;
} cpumla_dsv2_mtp;

typedef struct cpumla_dsv2_model {
    int64_t n_layers, hidden, n_heads, q_lora_rank, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim,
        v_head_dim, vocab;
    int64_t mha_min_tokens;        /* chunks of n > 1 tokens with n >= this attend un-absorbed; 0: the
                                    * default CPUMLA_DSV2_MHA_MIN_TOKENS */
    float rms_norm_eps, softmax_scale, rope_attn_scale;
    const float *inv_freq;         /* [P/2] */
    const cpumla_weight *embed;    /* [V, D] (F32/BF16/F16) */
    const cpumla_weight *lm_head;  /* [V, D] */
    cpumla_vec norm;               /* [D] */
    const cpumla_dsv2_layer *layers;
    const cpumla_dsv2_mtp *mtp;    /* the MTP layer, or NULL */
    /* Tensor parallel (NULL: one process). With comm, this rank's layers hold n_heads of the heads
     * (q / q_b and kv_b rows, o_proj columns) and a slice of every expert's and dense MLP's
     * intermediate dimension (gate / up rows, down columns); o_proj's and the MLPs' partial sums are
     * all-reduced before they join the residual stream, so every rank carries the same hidden state
     * (and routes alike). lm_head holds vocabulary rows head_row0 .. head_row0 + lm_head->rows - 1;
     * the logits are gathered on rank 0. */
    const cpumla_comm *comm;
    int64_t head_row0;
} cpumla_dsv2_model;

typedef struct cpumla_dsv2_state cpumla_dsv2_state;

/* The state of one model: latent caches [ctx, R+P] (fp32) per layer and the scratch of a forward of up
 * to max_tokens tokens. m (and what it points at) must outlive the state. NULL when out of memory or
 * for a bad size (cpumla_last_error says which). */
cpumla_dsv2_state *cpumla_dsv2_new(const cpumla_dsv2_model *m, int64_t ctx, int64_t max_tokens);
void cpumla_dsv2_free(cpumla_dsv2_state *s);

/* Appends n <= max_tokens tokens at positions pos0 .. pos0+n-1 to every layer's latent cache and writes
 * logits [n, vocab] (last_only: [1, vocab] of the last token): embedding, MLA (absorbed, latent-space
 * attention with causal lengths; un-absorbed for a chunk of mha_min_tokens or more), MoE, final norm,
 * lm_head. Returns 0, or -1 (cpumla_last_error: bad
 * token id, context full, routing error, out of memory). */
int cpumla_dsv2_forward(cpumla_dsv2_state *s, const int64_t *ids, int64_t n, int64_t pos0, float *logits,
                        int32_t last_only);
/* cpumla_dsv2_forward that also writes the final normed hidden state of each of the n tokens into
 * hidden [n, D] (what the MTP layer takes), when hidden is not NULL. */
int cpumla_dsv2_forward_hidden(cpumla_dsv2_state *s, const int64_t *ids, int64_t n, int64_t pos0, float *logits,
                               int32_t last_only, float *hidden);
/* The MTP layer over n positions pos0 .. pos0+n-1 of its own latent cache: row t pairs hidden[t] (a
 * normed hidden state of the main model at that position, or an MTP output h' when drafts are chained)
 * with the token ids[t] that follows it; logits [n, vocab] of the token after ids[t] and h' rows into
 * hidden_out [n, D], each when not NULL. last_only: of the last position alone ([1, vocab], [1, D]):
 * the others write their cache entries, and attention and MoE run for the last one alone; with
 * neither logits nor hidden_out, only the cache entries are written. -1 when the model has no MTP
 * layer. */
int cpumla_dsv2_mtp_forward(cpumla_dsv2_state *s, const int64_t *ids, int64_t n, int64_t pos0, const float *hidden,
                            float *logits, int32_t last_only, float *hidden_out);
/* Whether the forward attends a chunk of n tokens un-absorbed (without sparse index lists): n > 1 and
 * n >= m->mha_min_tokens, or the default when that is 0 or below. 1 or 0. */
int cpumla_dsv2_unabsorbed(const cpumla_dsv2_model *m, int64_t n);

#ifdef __cplusplus
}
#endif
#endif
