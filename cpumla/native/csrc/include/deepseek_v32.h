/* deepseek_v32.h: DeepSeek-V3.2-Exp / V3.2 (model_type deepseek_v32): the V3 layer (deepseek_v2.h) plus
 * DSA's lightning indexer, which picks for each query the index_topk cached tokens that MLA attends to.
 *
 *   IH=index_n_heads ID=index_head_dim P=qk_rope_head_dim QL=q_lora_rank D=hidden T=cached tokens
 *
 * Per layer and token t:  qI = wq_b(q LoRA latent) [IH, ID];  kI = LayerNorm(wk(x)) [ID] (weight and
 * bias); both half-split ("rotate_half") RoPE on their first P dims at the MLA's frequencies; kI goes to
 * the layer's index-key cache. score(t, s) = sum_h w_h relu(qI_h(t) . kI(s)) over cached s <= t with
 * w = weights_proj(x) * IH^-0.5 * ID^-0.5; MLA then attends to the top index_topk of them (all of them
 * while t + 1 <= index_topk). Parsed by cffi: plain C only. */
#ifndef CPUMLA_DEEPSEEK_V32_H
#define CPUMLA_DEEPSEEK_V32_H
#include "deepseek_v2.h"
#ifdef __cplusplus
extern "C" {
#endif

typedef struct cpumla_dsv32_indexer {
    const cpumla_weight *wq_b;          /* [IH*ID, QL] */
    const cpumla_weight *wk;            /* [ID, D] */
    cpumla_vec k_norm, k_norm_bias;     /* [ID] LayerNorm weight and bias */
    const cpumla_weight *weights_proj;  /* [IH, D] */
} cpumla_dsv32_indexer;

typedef struct cpumla_dsv32_model {
    cpumla_dsv2_model base;                /* MLA + MoE as V3; q LoRA required */
    const cpumla_dsv32_indexer *indexers;  /* [n_layers], then the MTP layer's when base.mtp is set */
    int64_t index_n_heads, index_head_dim, index_topk;
    float index_norm_eps;                  /* the LayerNorm's eps (1e-6) */
} cpumla_dsv32_model;

typedef struct cpumla_dsv32_state cpumla_dsv32_state;

/* Latent and index-key caches [ctx, R+P] and [ctx, ID] per layer, and the scratch of a forward of up to
 * max_tokens tokens. NULL when out of memory or for a bad model (cpumla_last_error). */
cpumla_dsv32_state *cpumla_dsv32_new(const cpumla_dsv32_model *m, int64_t ctx, int64_t max_tokens);
void cpumla_dsv32_free(cpumla_dsv32_state *s);

/* As cpumla_dsv2_forward, with each query's attention restricted to the indexer's selection. */
int cpumla_dsv32_forward(cpumla_dsv32_state *s, const int64_t *ids, int64_t n, int64_t pos0, float *logits,
                         int32_t last_only);
/* As cpumla_dsv2_forward_hidden and cpumla_dsv2_mtp_forward: V3.2's MTP layer is a V3.2 decoder layer,
 * its indexer and index-key cache its own. */
int cpumla_dsv32_forward_hidden(cpumla_dsv32_state *s, const int64_t *ids, int64_t n, int64_t pos0, float *logits,
                                int32_t last_only, float *hidden);
int cpumla_dsv32_mtp_forward(cpumla_dsv32_state *s, const int64_t *ids, int64_t n, int64_t pos0, const float *hidden,
                             float *logits, int32_t last_only, float *hidden_out);

#ifdef __cplusplus
}
#endif
#endif
