/* deepseek_v32.c: the DeepSeek-V3.2 forward: deepseek_v2.c's layer with the lightning indexer between
 * the attention's input projections and the attention (deepseek_v32.h has the math).
 *
 * IH=index_n_heads ID=index_head_dim P=qk_rope_head_dim QL=q_lora_rank D=hidden n=tokens in this call
 * T=cached tokens k=index_topk QC=queries scored together */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "models/deepseek_v2_impl.h"
#include "deepseek_v32.h"
#include "core/dispatch.h"

#define TRY(call) do { if ((call) != 0) return -1; } while (0)
#define SCORE_FLOATS (8 << 20)   /* scores of one query chunk: at most 32 MB */

struct cpumla_dsv32_state {
    cpumla_dsv2_state base;
    const cpumla_dsv32_model *m;
    float **icache;    /* [layers with a cache] index-key caches [ctx, ID] (the MTP layer's last) */
    void *block;       /* the one allocation behind the scratch below */
    float *qi;         /* [n, IH, ID] index queries */
    float *ki;         /* [n, ID] index keys */
    float *iw;         /* [n, IH] head weights (scales folded in) */
    float *scores;     /* [QC, IH, T] qI . kI */
    float *isc;        /* [T] one query's index scores */
    int32_t *order;    /* [T] selection work */
    int32_t *sel;      /* [n, k] the selected cache rows */
    int64_t *sel_len;  /* [n] how many of them */
    int64_t qc;        /* QC */
};

static void release(cpumla_dsv32_state *s) {
    if (s->icache)
        for (int64_t l = 0; l < dsv2_cached_layers(&s->m->base); l++) free(s->icache[l]);
    free(s->icache);
    free(s->block);
    s->icache = NULL;
    s->block = NULL;
    dsv2_state_release(&s->base);
}

cpumla_dsv32_state *cpumla_dsv32_new(const cpumla_dsv32_model *m, int64_t ctx, int64_t max_tokens) {
    cpumla_ensure_init();
    if (m->index_topk < 1 || m->index_n_heads < 1 || m->index_head_dim < m->base.qk_rope_head_dim ||
        m->base.q_lora_rank < 1) {
        cpumla_set_error("V3.2 needs index_topk, index_n_heads >= 1, index_head_dim >= qk_rope_head_dim and a q LoRA");
        return NULL;
    }
    cpumla_dsv32_state *s = calloc(1, sizeof *s);
    if (!s) { cpumla_set_error("out of memory for the model state"); return NULL; }
    s->m = m;
    if (dsv2_state_init(&s->base, &m->base, ctx, max_tokens) != 0) { free(s); return NULL; }
    int64_t n = s->base.max_tokens, IH = m->index_n_heads, ID = m->index_head_dim, k = m->index_topk;
    ctx = s->base.ctx;
    s->qc = SCORE_FLOATS / (IH * ctx);
    s->qc = s->qc < 1 ? 1 : s->qc > n ? n : s->qc;
    size_t floats = (size_t)(n * IH * ID + n * ID + n * IH + s->qc * IH * ctx + ctx + 64);
    size_t ints = (size_t)(ctx + n * k + 16);
    s->block = aligned_alloc(64, ((floats + ints) * 4 + (size_t)n * 8 + 256 + 63) & ~(size_t)63);
    s->icache = calloc((size_t)dsv2_cached_layers(&m->base), sizeof(float *));
    if (!s->block || !s->icache) goto oom;
    s->qi = s->block;
    s->ki = s->qi + n * IH * ID;
    s->iw = s->ki + n * ID;
    s->scores = s->iw + n * IH;
    s->isc = s->scores + s->qc * IH * ctx;
    s->order = (int32_t *)(s->isc + ctx + 16);
    s->sel = s->order + ctx;
    s->sel_len = (int64_t *)(((uintptr_t)(s->sel + n * k) + 7) & ~(uintptr_t)7);
    for (int64_t l = 0; l < dsv2_cached_layers(&m->base); l++) {
        s->icache[l] = cpumla_cache_alloc((size_t)(ctx * ID) * 4);
        if (!s->icache[l]) goto oom;
    }
    return s;
oom:
    release(s);
    free(s);
    cpumla_set_error("out of memory for the model's caches and scratch");
    return NULL;
}

void cpumla_dsv32_free(cpumla_dsv32_state *s) {
    if (!s) return;
    release(s);
    free(s);
}

/* y = (x - mean) / sqrt(var + eps) * w + b over rows of dim values, in place */
static void layernorm(float *x, int64_t n, int64_t dim, cpumla_vec w, cpumla_vec b, float eps) {
    for (int64_t t = 0; t < n; t++) {
        float *v = x + t * dim;
        double mean = 0.0, var = 0.0;
        for (int64_t i = 0; i < dim; i++) mean += v[i];
        mean /= (double)dim;
        for (int64_t i = 0; i < dim; i++) var += ((double)v[i] - mean) * ((double)v[i] - mean);
        float inv = (float)(1.0 / sqrt(var / (double)dim + (double)eps)), mu = (float)mean;
        for (int64_t i = 0; i < dim; i++)
            v[i] = (v[i] - mu) * inv * vec_at(w.data, w.dtype, i) + vec_at(b.data, b.dtype, i);
    }
}

/* a ranks above b: larger score, NaN lowest, equal scores by lower position */
static int above(const float *v, int32_t a, int32_t b) {
    float va = v[a], vb = v[b];
    if (isnan(va)) return isnan(vb) && a < b;
    if (isnan(vb)) return 1;
    return va > vb || (va == vb && a < b);
}

/* The k best of v[0..n) (k < n) into out, in no particular order: quickselect on positions, O(n). */
static void select_topk(const float *v, int64_t n, int64_t k, int32_t *work, int32_t *out) {
    for (int64_t i = 0; i < n; i++) work[i] = (int32_t)i;
    int64_t lo = 0, hi = n - 1;
    while (lo < hi) {
        int32_t a = work[lo], b = work[(lo + hi) / 2], c = work[hi], pivot;   /* median of three */
        if (above(v, a, b)) { int32_t t = a; a = b; b = t; }
        if (above(v, b, c)) { int32_t t = b; b = c; c = t; }
        if (above(v, a, b)) { int32_t t = a; a = b; b = t; }
        pivot = b;
        int64_t i = lo, j = hi;
        while (i <= j) {
            while (above(v, work[i], pivot)) i++;
            while (above(v, pivot, work[j])) j--;
            if (i <= j) { int32_t t = work[i]; work[i] = work[j]; work[j] = t; i++; j--; }
        }
        if (k - 1 <= j) hi = j;
        else if (k - 1 >= i) lo = i;
        else break;
    }
    memcpy(out, work, sizeof(int32_t) * (size_t)k);
}

/* The indexer of layer l for the n tokens of this call: their index keys into the cache, then for each
 * query from q_first on its selection (sel, sel_len). Reads base.x (the attention's normed input) and
 * base.qa. */
static int indexer(cpumla_dsv32_state *s, int64_t l, int64_t n, int64_t pos0, int64_t q_first) {
    const cpumla_dsv32_model *m = s->m;
    const cpumla_dsv32_indexer *X = &m->indexers[l];
    cpumla_dsv2_state *b = &s->base;
    int64_t D = m->base.hidden, QL = m->base.q_lora_rank, P = m->base.qk_rope_head_dim;
    int64_t IH = m->index_n_heads, ID = m->index_head_dim, K = m->index_topk;
    TRY(cpumla_gemm(X->wq_b, b->qa, QL, n, s->qi, IH * ID));
    TRY(cpumla_gemm(X->wk, b->x, D, n, s->ki, ID));
    TRY(cpumla_gemm(X->weights_proj, b->x, D, n, s->iw, IH));
    layernorm(s->ki, n, ID, X->k_norm, X->k_norm_bias, m->index_norm_eps);
    cpumla_rope(s->qi, n, IH * ID, IH, ID, 0, P, b->pos, m->base.inv_freq, m->base.rope_attn_scale, CPUMLA_ROPE_HALF);
    cpumla_rope(s->ki, n, ID, 1, 0, 0, P, b->pos, m->base.inv_freq, m->base.rope_attn_scale, CPUMLA_ROPE_HALF);
    TRY(cpumla_cache_store(s->icache[l], CPUMLA_F32, ID, s->ki, ID, n, ID, b->pos));
    float wscale = (float)(1.0 / sqrt((double)IH) / sqrt((double)ID));
    for (int64_t i = 0; i < n * IH; i++) s->iw[i] *= wscale;

    for (int64_t q0 = q_first; q0 < n; q0 += s->qc) {
        int64_t q1 = q0 + s->qc < n ? q0 + s->qc : n;
        int64_t T = pos0 + q1;                    /* rows the last query of the chunk sees */
        int64_t dense = 1;                        /* does every query of the chunk see all of its rows? */
        for (int64_t t = q0; t < q1; t++) dense &= pos0 + t + 1 <= K;
        if (!dense) {
            /* scores[(t - q0)*IH + h][s] = qI_h(t) . kI(s): one gemm over the cache rows */
            cpumla_weight keys = {.data = s->icache[l], .rows = T, .cols = ID, .row_bytes = ID * 4,
                                  .dtype = CPUMLA_F32, .block_rows = 1, .block_cols = 1};
            TRY(cpumla_gemm(&keys, s->qi + q0 * IH * ID, ID, (q1 - q0) * IH, s->scores, T));
        }
        for (int64_t t = q0; t < q1; t++) {
            int64_t count = pos0 + t + 1;         /* causal */
            int32_t *sel = s->sel + t * K;
            if (count <= K) {
                for (int64_t j = 0; j < count; j++) sel[j] = (int32_t)j;
                s->sel_len[t] = count;
                continue;
            }
            float *isc = s->isc;
            const float *w = s->iw + t * IH;
            memset(isc, 0, sizeof(float) * (size_t)count);
            for (int64_t h = 0; h < IH; h++) {
                const float *sc = s->scores + ((t - q0) * IH + h) * T;
                float wh = w[h];
                for (int64_t j = 0; j < count; j++) isc[j] += wh * (sc[j] > 0.0f ? sc[j] : 0.0f);
            }
            select_topk(isc, count, K, s->order, sel);
            /* in ascending position: the attention then reads the cache in address order */
            memset(s->order, 0, sizeof(int32_t) * (size_t)count);
            for (int64_t j = 0; j < K; j++) s->order[sel[j]] = 1;
            for (int64_t i = 0, j = 0; i < count; i++)
                if (s->order[i]) sel[j++] = (int32_t)i;
            s->sel_len[t] = K;
        }
    }
    return 0;
}

/* layer l over s->base.h */
static int layer(cpumla_dsv32_state *s, int64_t l, int64_t n, int64_t pos0) {
    cpumla_dsv2_state *b = &s->base;
    TRY(dsv2_attn_in(b, l, n));
    TRY(indexer(s, l, n, pos0, 0));
    TRY(dsv2_attn_out(b, l, n, pos0, s->sel, s->m->index_topk, s->sel_len));
    return dsv2_ffn(b, l, n);
}

static int forward(cpumla_dsv32_state *s, const int64_t *ids, int64_t n, int64_t pos0, float *logits,
                   int32_t last_only, float *hidden) {
    cpumla_dsv2_state *b = &s->base;
    TRY(dsv2_begin(b, ids, n, pos0));
    for (int64_t l = 0; l < s->m->base.n_layers; l++) TRY(layer(s, l, n, pos0));
    TRY(dsv2_final_hidden(b, n, hidden));
    return dsv2_end(b, n, logits, last_only);
}

static int mtp_forward(cpumla_dsv32_state *s, const int64_t *ids, int64_t n, int64_t pos0, const float *hidden,
                       float *logits, int32_t last_only, float *hidden_out) {
    cpumla_dsv2_state *b = &s->base;
    int64_t L = s->m->base.n_layers, K = s->m->index_topk;
    int outputs = logits || hidden_out;
    TRY(dsv2_mtp_in(b, ids, n, pos0, hidden));
    TRY(dsv2_attn_in(b, L, n));
    /* the cache entries of every position; the rest of the layer for those whose output is wanted (as
     * deepseek_v2.c's MTP pass) */
    TRY(indexer(s, L, n, pos0, !outputs ? n : last_only ? n - 1 : 0));
    if (!outputs) return 0;
    if (last_only && n > 1) {
        dsv2_keep_last(b, n);
        memmove(s->sel, s->sel + (n - 1) * K, sizeof(int32_t) * (size_t)K);
        s->sel_len[0] = s->sel_len[n - 1];
        pos0 += n - 1;
        n = 1;
    }
    TRY(dsv2_attn_out(b, L, n, pos0, s->sel, K, s->sel_len));
    TRY(dsv2_ffn(b, L, n));
    return dsv2_mtp_out(b, n, logits, last_only, hidden_out);
}

int cpumla_dsv32_forward(cpumla_dsv32_state *s, const int64_t *ids, int64_t n, int64_t pos0, float *logits,
                         int32_t last_only) {
    cpumla_enter(s->base.scratch);
    cpumla_ensure_init();
    return cpumla_leave(forward(s, ids, n, pos0, logits, last_only, NULL));
}

int cpumla_dsv32_forward_hidden(cpumla_dsv32_state *s, const int64_t *ids, int64_t n, int64_t pos0, float *logits,
                                int32_t last_only, float *hidden) {
    cpumla_enter(s->base.scratch);
    cpumla_ensure_init();
    return cpumla_leave(forward(s, ids, n, pos0, logits, last_only, hidden));
}

int cpumla_dsv32_mtp_forward(cpumla_dsv32_state *s, const int64_t *ids, int64_t n, int64_t pos0, const float *hidden,
                             float *logits, int32_t last_only, float *hidden_out) {
    cpumla_enter(s->base.scratch);
    cpumla_ensure_init();
    return cpumla_leave(mtp_forward(s, ids, n, pos0, hidden, logits, last_only, hidden_out));
}
