/* deepseek_v4.h: DeepSeek-V4 Flash / Pro (model_type deepseek_v4).
 *
 *   D=hidden V=vocab N=hc_mult (residual streams) H=heads hd=head_dim P=rope dims (the last P of a head)
 *   QL=q_lora_rank G=o_groups OL=o_lora_rank W=sliding_window r=compress ratio IH=index_n_heads
 *   ID=index_head_dim E=routed experts K=experts per token n=tokens in one call
 *
 * Per layer, on N residual streams X [N, D] per token (mHC): a sub-block F (attention, then MoE) reads
 * y = sum_i pre_i X_i and writes X'_k = post_k F(y) + sum_j C_jk X_j, with pre / post / C (Sinkhorn-
 * normalised, hc_sinkhorn_iters) computed from the RMS-normalised streams by hc_fn [(2+N)*N, N*D].
 *
 * Attention: one shared K == V head of hd values per token, RMSNorm'd and RoPE'd on its last P dims;
 * q = wq_b(q_norm(wq_a x)) with an unweighted per-head RMSNorm and the same RoPE; per-head sinks in the
 * softmax denominator; the output's rope slice rotated back at the query position; grouped low-rank
 * output wo_b(concat_g wo_a[g] o_g). Each query sees the last W tokens (a ring buffer) plus, in a
 * compressed layer (r > 0), compressed entries: entry w pools the compressor inputs of tokens
 * [w*r, (w+1)*r) (CSA, with overlap: also the first half of tokens [(w-1)*r, w*r)) with a per-channel
 * softmax over the tokens, then RMSNorm and RoPE at position w*r; it exists once token (w+1)*r-1 has
 * been seen and is visible to queries t with w < (t+1)/r. HCA attends to every visible entry; CSA to
 * the top index_topk of its lightning indexer: score(t, w) = sum_h w_h relu(qI_h(t) . kI(w)), qI from
 * the q LoRA latent, kI from the indexer's own compressor (width ID). MoE on every layer: sqrt(softplus)
 * scores, biased top-k or a token-id hash table, SwiGLU experts and a shared expert with a clamp.
 * Parsed by cffi: plain C only. */
#ifndef CPUMLA_DEEPSEEK_V4_H
#define CPUMLA_DEEPSEEK_V4_H
#include "cpumla.h"
#ifdef __cplusplus
extern "C" {
#endif

/* A compressor: inputs a = wkv(x) and gates z = wgate(x) + ape[pos % r], coff*d wide each (coff = 2
 * with overlap), pooled per channel over a window, then RMSNorm'd to d values. */
typedef struct cpumla_dsv4_compressor {
    const cpumla_weight *wkv, *wgate;  /* [coff*d, D] */
    cpumla_vec ape;                    /* [r, coff*d] */
    cpumla_vec norm;                   /* [d] */
} cpumla_dsv4_compressor;

/* The mHC weights of one sub-block. */
typedef struct cpumla_dsv4_hc {
    const cpumla_weight *fn;           /* [(2+N)*N, N*D] */
    cpumla_vec base, scale;            /* [(2+N)*N], [3] */
} cpumla_dsv4_hc;

typedef struct cpumla_dsv4_layer {
    int64_t ratio;                     /* 0: sliding window only; else the compress ratio r */
    int32_t csa;                       /* 1: overlapping windows and the lightning indexer (CSA) */
    cpumla_dsv4_hc hc_attn, hc_ffn;
    cpumla_vec attn_norm, ffn_norm;    /* [D] */
    const cpumla_weight *wq_a;         /* [QL, D] */
    cpumla_vec q_norm;                 /* [QL] */
    const cpumla_weight *wq_b;         /* [H*hd, QL] */
    const cpumla_weight *wkv;          /* [hd, D] */
    cpumla_vec kv_norm;                /* [hd] */
    const cpumla_weight *wo_a;         /* [G*OL, H*hd/G] */
    const cpumla_weight *wo_b;         /* [D, G*OL] */
    cpumla_vec sinks;                  /* [H] */
    const float *inv_freq;             /* [P/2] this layer's RoPE frequencies */
    float rope_scale;                  /* cos/sin multiplier (1 for V4) */
    cpumla_dsv4_compressor comp;       /* ratio > 0: width hd */
    cpumla_dsv4_compressor icomp;      /* csa: the indexer's, width ID */
    const cpumla_weight *index_wq_b;   /* csa: [IH*ID, QL] */
    const cpumla_weight *index_proj;   /* csa: [IH, D] */
    const cpumla_weight *gate;         /* [E, D] router */
    const cpumla_router *router;       /* SQRTSOFTPLUS (bias) or HASH (tid2eid) */
    const cpumla_expert *experts;      /* [E] */
    const cpumla_expert *shared;       /* a table of one */
} cpumla_dsv4_layer;

/* The multi-token-prediction (MTP) layer (`mtp.0.*`): from the main model's residual streams H_i [N, D]
 * at position i (before its HyperHead) and the embedding e of token i+1,
 *   X = h_proj(hnorm(H_i)) + e_proj(enorm(e))   (hnorm on each stream; the e term added to every one),
 *   X' = a V4 layer over X (its own window ring: sliding window only, ratio 0; biased routing),
 *   logits of token i+2 = lm_head(norm(HyperHead_mtp(X'))); X' is what a chained draft takes as H. */
typedef struct cpumla_dsv4_mtp {
    cpumla_vec enorm, hnorm, norm;     /* [D] each */
    const cpumla_weight *e_proj;       /* [D, D] */
    const cpumla_weight *h_proj;       /* [D, D] */
    cpumla_dsv4_hc hc_head;            /* fn [N, N*D], base [N], scale [1] */
    cpumla_dsv4_layer layer;
} cpumla_dsv4_mtp;

typedef struct cpumla_dsv4_model {
    int64_t n_layers, hidden, vocab, hc_mult, hc_sinkhorn_iters, n_heads, head_dim, rope_dim, q_lora_rank,
        o_groups, o_lora_rank, sliding_window, index_n_heads, index_head_dim, index_topk;
    float rms_norm_eps, hc_eps, swiglu_limit;
    const cpumla_weight *embed;        /* [V, D] (F32/BF16/F16) */
    const cpumla_weight *lm_head;      /* [V, D] */
    cpumla_vec norm;                   /* [D] */
    cpumla_dsv4_hc hc_head;            /* fn [N, N*D], base [N], scale [1] */
    const cpumla_dsv4_layer *layers;
    /* Tensor parallel (NULL: one process). With comm, this rank's layers hold n_heads of the heads in
     * o_groups whole output groups (wq_b and wo_a rows, wo_b columns, sinks) and a slice of every
     * expert's intermediate dimension; the shared KV head, compressors, indexer, mHC and routers are
     * whole on every rank. The attention's and the MoE's partial outputs are all-reduced before mHC
     * takes them, so every rank carries the same streams. lm_head holds vocabulary rows head_row0 ..
     * head_row0 + lm_head->rows - 1; the logits are gathered on rank 0. */
    const cpumla_comm *comm;
    int64_t head_row0;
    const cpumla_dsv4_mtp *mtp;        /* the MTP layer, or NULL */
} cpumla_dsv4_model;

typedef struct cpumla_dsv4_state cpumla_dsv4_state;

/* The state of one model for contexts of up to ctx tokens and calls of up to max_tokens: per layer a
 * window ring of W + max_tokens rows, the compressed entries (ctx / r rows of hd; CSA also ID-wide
 * index keys), rings of the last coff*r + max_tokens compressor inputs, and the scratch of a forward.
 * NULL when out of memory or for a bad model (cpumla_last_error). */
cpumla_dsv4_state *cpumla_dsv4_new(const cpumla_dsv4_model *m, int64_t ctx, int64_t max_tokens);
void cpumla_dsv4_free(cpumla_dsv4_state *s);

/* 1 when the state can continue at pos0 (pos0 <= the tokens it holds): pos0 == 0, or every ring still
 * holds what positions >= pos0 need (rolling back at most about max_tokens positions); 0 when the
 * tokens before pos0 must be run again from position 0. */
int cpumla_dsv4_resumable(const cpumla_dsv4_state *s, int64_t pos0);

/* Appends n <= max_tokens tokens at positions pos0 .. pos0+n-1 (pos0 must be resumable) and writes
 * logits [n, vocab] (last_only: [1, vocab] of the last token). The token ids reach the hash-routed
 * layers. Returns 0, or -1 (cpumla_last_error). */
int cpumla_dsv4_forward(cpumla_dsv4_state *s, const int64_t *ids, int64_t n, int64_t pos0, float *logits,
                        int32_t last_only);
/* cpumla_dsv4_forward that also writes each token's residual streams after the last layer (before the
 * HyperHead) into hidden [n, N*D] (what the MTP layer takes), when hidden is not NULL. */
int cpumla_dsv4_forward_hidden(cpumla_dsv4_state *s, const int64_t *ids, int64_t n, int64_t pos0, float *logits,
                               int32_t last_only, float *hidden);
/* The MTP layer over positions pos0 .. pos0+n-1 of its own window ring: row t pairs hidden[t] [N*D] (the
 * main model's streams at that position, or an MTP output X' when drafts are chained) with the token
 * ids[t] that follows it; logits [n, vocab] of the token after ids[t] and X' rows into hidden_out
 * [n, N*D], each when not NULL. last_only: of the last position alone ([1, vocab], [1, N*D]), the MoE
 * run for it alone; with neither, only the ring entries are written (no MoE).
 * Its entries run on from any position its ring still holds the window of (a rollback of up to about
 * max_tokens); at any other pos0 the window starts again at pos0 (the entries before it are gone).
 * -1 when the model has no MTP layer. */
int cpumla_dsv4_mtp_forward(cpumla_dsv4_state *s, const int64_t *ids, int64_t n, int64_t pos0, const float *hidden,
                            float *logits, int32_t last_only, float *hidden_out);

#ifdef __cplusplus
}
#endif
#endif
