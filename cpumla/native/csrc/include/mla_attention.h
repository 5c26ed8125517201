/* mla_attention.h: the latent cache and MLA attention kernels of cpumla's library (cpumla.h's
 * conventions: fp32 activations, strides in elements, multi-threaded calls that return 0 or -1 with
 * cpumla_last_error()). Parsed by cffi after cpumla.h: plain C only. */
#ifndef CPUMLA_MLA_ATTENTION_H
#define CPUMLA_MLA_ATTENTION_H
#include "cpumla.h"
#ifdef __cplusplus
extern "C" {
#endif

/* cache row slots[t] = src row t (width values), for t < n; a slot of -1 is skipped.
 * cache_dtype: CPUMLA_F32, or CPUMLA_BF16 (round to nearest even); another is an error (-1). */
int cpumla_cache_store(void *cache, int32_t cache_dtype, int64_t ld_cache, const float *src,
                       int64_t ld_src, int64_t n, int64_t width, const int64_t *slots);

/* Multi-query attention of H query heads against one shared key/value row per token:
 * MLA decode (absorbed q~ [H, R+P] against the latent cache [T, R+P], value = first R columns),
 * latent prefill (n_q queries, causal through kv_len), V4 (K == V, dk = dv = 512, sinks).
 *   key of token j = kv row j [0, dk), value = kv row j [0, dv), rows ld_kv elements apart.
 *   Query i (of n_q) sees: rows 0 .. kv_len[i]-1 (kv_len NULL: n_kv rows for every query); or, when
 *   kv_idx is not NULL, rows kv_idx[i*ld_idx + j] for j < that count (entries < 0 are skipped).
 *   s_h(j) = scale * q_ih . key_j ;  out_ih = sum_j softmax_j(s_h) value_j, where a sink adds
 *   exp(sinks[h]) to the softmax denominator (NULL: none). A query that sees nothing gets zeros.
 *   lse (optional, [n_q, H]) receives log(sum_j exp(s_h(j))), sink included.
 * Split over KV blocks and head blocks so that one query still uses every thread; the parts are
 * merged with log-sum-exp. */
typedef struct cpumla_attn_args {
    const float *q; int64_t ldq_t, ldq_h;       /* [n_q, H, dk] */
    int64_t n_q, n_heads;
    const void *kv; int32_t kv_dtype; int64_t ld_kv;   /* [n_kv, ld_kv], F32 or BF16 */
    int64_t n_kv, dk, dv;
    const int64_t *kv_len;                      /* [n_q] or NULL */
    const int32_t *kv_idx; int64_t ld_idx;      /* [n_q, ld_idx] or NULL */
    const float *sinks;                         /* [H] or NULL */
    float scale;
    float *out; int64_t ldo_t, ldo_h;           /* [n_q, H, dv] */
    float *lse;                                 /* [n_q, H] or NULL */
} cpumla_attn_args;
int cpumla_mla_attention(const cpumla_attn_args *a);

/* MLA attention in the un-absorbed form, for prefill: keys and values are decompressed from the
 * latent rows with kv_b instead of absorbing W_UK into the queries and W_UV into the output.
 *   latent row j = kv row j: c_j [0, rank) then k_pe_j [rank, rank + rope_dim), F32 or BF16;
 *   head h: W_UK = kv_b rows h*(dn+dv) + [0, dn), W_UV = the next dv rows (kv_b has rank columns);
 *   or, kv_b NULL, the two apart as a GGUF file splits them: W_UK transposed in k_b rows h*rank +
 *   [0, rank) (dn columns), W_UV in v_b rows h*dv + [0, dv) (rank columns), each of any weight
 *   format, dequantized per head to fp32 (cpumla_dequant's values) into the task's scratch, so
 *   neither is copied whole;
 *   key_hj = [W_UK c_j | k_pe_j] (dn + rope_dim), value_hj = W_UV c_j (dv), both products as
 *   cpumla_gemm computes them (kernels.h: rounded activations for BF16 / E4M3 weights);
 *   q_ih = [q_nope | q_pe] (dn + rope_dim);  s_h(i, j) = scale * q_ih . key_hj;
 *   out_ih = sum_j softmax_j(s_h(i, j)) value_hj over rows j < kv_len[i] (kv_len NULL: n_kv rows);
 *   a query that sees nothing gets zeros.
 * Mathematically cpumla_mla_attention over the absorbed queries followed by the un-absorb, at
 * (n_kv * rank * (dn + dv) + pairs * (dn + rope_dim + dv)) multiply-adds per head instead of
 * (n_q * rank * (dn + dv) + pairs * (2 * rank + rope_dim)): the cheaper form for a prefill chunk of
 * more than a few hundred tokens. Keys and values are made per head in blocks of a few hundred rows
 * (scratch bounded by the block, not the context), and the products are GEMMs (cpumla_gemm's
 * kernels); one task per head (and query range when there are fewer heads than threads).
 * Returns 0, or -1 for bad arguments (cpumla_last_error) or out of memory. */
typedef struct cpumla_mla_mha_args {
    const float *q; int64_t ldq_t, ldq_h;              /* [n_q, H, dn + rope_dim] */
    int64_t n_q, n_heads;
    const void *kv; int32_t kv_dtype; int64_t ld_kv;   /* [n_kv, ld_kv], F32 or BF16 */
    int64_t n_kv, rank, rope_dim;
    const cpumla_weight *kv_b;                         /* [n_heads * (dn + dv), rank], or NULL: */
    int64_t dn, dv;
    const int64_t *kv_len;                             /* [n_q] or NULL */
    float scale;
    float *out; int64_t ldo_t, ldo_h;                  /* [n_q, H, dv] */
    const cpumla_weight *k_b, *v_b;                    /* [n_heads * rank, dn], [n_heads * dv, rank] */
} cpumla_mla_mha_args;
int cpumla_mla_mha(const cpumla_mla_mha_args *a);

#ifdef __cplusplus
}
#endif
#endif
