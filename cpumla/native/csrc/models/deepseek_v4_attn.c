/* deepseek_v4_attn.c: DeepSeek-V4 attention (deepseek_v4.h has the math): the window ring, the CSA / HCA
 * compressors and their state across calls, the CSA lightning indexer, sink attention over an index
 * list per query, the inverse RoPE and the grouped output projection.
 *
 * Names as in deepseek_v4.h; T = compressed entries a query may see. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "models/deepseek_v4_impl.h"
#include "core/dispatch.h"

int64_t dsv4_ring_rows(const cpumla_dsv4_state *s, const cpumla_dsv4_layer *L) {
    return (L->csa ? 2 : 1) * L->ratio + s->max_tokens;
}

/* The compressor of one layer for the chunk: a = wkv(x), z = wgate(x) + ape[p % r] of each new position
 * into the ring, then every entry whose window closes in the chunk, pooled, normed, RoPE'd at w*r, into
 * out (row w, ld_out apart). d = the entry width; overlap: coff = 2 (CSA). */
static int compress(cpumla_dsv4_state *s, const cpumla_dsv4_layer *L, const cpumla_dsv4_compressor *c,
                    float *ring, int64_t d, float *out, int64_t ld_out, int64_t n, int64_t pos0) {
    const cpumla_dsv4_model *m = s->m;
    int64_t D = m->hidden, r = L->ratio, coff = L->csa ? 2 : 1, cw = coff * d, ldr = 2 * cw;
    int64_t rows = dsv4_ring_rows(s, L), P = m->rope_dim;
    DSV4_TRY(cpumla_gemm(c->wkv, s->x, D, n, s->caz, ldr));
    DSV4_TRY(cpumla_gemm(c->wgate, s->x, D, n, s->caz + cw, ldr));
    for (int64_t t = 0; t < n; t++) {
        float *zt = s->caz + t * ldr + cw;
        int64_t a0 = ((pos0 + t) % r) * cw;
        for (int64_t i = 0; i < cw; i++) zt[i] += vec_at(c->ape.data, c->ape.dtype, a0 + i);
        s->slots[t] = (pos0 + t) % rows;
    }
    DSV4_TRY(cpumla_cache_store(ring, CPUMLA_F32, ldr, s->caz, ldr, n, ldr, s->slots));
    float *mx = s->ent + d, *se = mx + d, *acc = se + d;
    for (int64_t p = pos0; p < pos0 + n; p++) {
        if ((p + 1) % r) continue;
        int64_t w = p / r;
        /* slots: (row, offset of a, offset of z) -- CSA: window w-1's first halves, window w's second */
        for (int64_t i = 0; i < d; i++) { mx[i] = -INFINITY; se[i] = 0.0f; acc[i] = 0.0f; }
        for (int pass = 0; pass < 2; pass++) {
            for (int64_t q = (L->csa && w > 0 ? w - 1 : w) * r; q < (w + 1) * r; q++) {
                const float *row = ring + (q % rows) * ldr;
                int64_t half = (L->csa && q >= w * r) ? d : 0;
                const float *a = row + half, *z = row + cw + half;
                if (pass == 0) {
                    for (int64_t i = 0; i < d; i++) mx[i] = z[i] > mx[i] ? z[i] : mx[i];
                } else {
                    for (int64_t i = 0; i < d; i++) {
                        float e = expf(z[i] - mx[i]);
                        se[i] += e;
                        acc[i] += e * a[i];
                    }
                }
            }
        }
        float *e = s->ent;
        for (int64_t i = 0; i < d; i++) e[i] = acc[i] / se[i];
        cpumla_rmsnorm(e, d, e, d, 1, d, c->norm.data, c->norm.dtype, m->rms_norm_eps);
        int64_t at = w * r;
        cpumla_rope(e, 1, d, 1, d, d - P, P, &at, L->inv_freq, L->rope_scale, CPUMLA_ROPE_INTERLEAVED);
        memcpy(out + w * ld_out, e, sizeof(float) * (size_t)d);
    }
    return 0;
}

/* The lightning indexer of a CSA layer: for each query of the chunk, the entries it attends to
 * (s->sel, s->sel_len): every visible entry while there are at most index_topk of them, else the
 * index_topk best by sum_h w_h relu(qI_h . kI). Index keys of the chunk are emitted first. */
static int indexer(cpumla_dsv4_state *s, int64_t l, int64_t n, int64_t pos0) {
    const cpumla_dsv4_model *m = s->m;
    const cpumla_dsv4_layer *L = dsv4_layer(m, l);
    int64_t D = m->hidden, QL = m->q_lora_rank, P = m->rope_dim, IH = m->index_n_heads, ID = m->index_head_dim;
    int64_t K = m->index_topk, r = L->ratio;
    DSV4_TRY(compress(s, L, &L->icomp, s->iring[l], ID, s->ikeys[l], ID, n, pos0));
    DSV4_TRY(cpumla_gemm(L->index_wq_b, s->qr, QL, n, s->qi, IH * ID));
    cpumla_rope(s->qi, n, IH * ID, IH, ID, ID - P, P, s->pos, L->inv_freq, L->rope_scale, CPUMLA_ROPE_INTERLEAVED);
    DSV4_TRY(cpumla_gemm(L->index_proj, s->x, D, n, s->iw, IH));
    /* relu(x) * c == relu(x * c) for c > 0: both scales fold into the head weights */
    float wscale = (float)(1.0 / sqrt((double)IH) / sqrt((double)ID));
    for (int64_t i = 0; i < n * IH; i++) s->iw[i] *= wscale;
    for (int64_t q0 = 0; q0 < n; q0 += s->qc) {
        int64_t q1 = q0 + s->qc < n ? q0 + s->qc : n;
        int64_t T = (pos0 + q1) / r;                  /* entries the last query of the block sees */
        if (T > K) {
            cpumla_weight keys = {.data = s->ikeys[l], .rows = T, .cols = ID, .row_bytes = ID * 4,
                                  .dtype = CPUMLA_F32, .block_rows = 1, .block_cols = 1};
            DSV4_TRY(cpumla_gemm(&keys, s->qi + q0 * IH * ID, ID, (q1 - q0) * IH, s->scores, T));
        }
        for (int64_t t = q0; t < q1; t++) {
            int64_t vis = (pos0 + t + 1) / r;
            int32_t *sel = s->sel + t * K;
            if (vis <= K) {
                for (int64_t j = 0; j < vis; j++) sel[j] = (int32_t)j;
                s->sel_len[t] = vis;
                continue;
            }
            float *isc = s->isc;
            const float *w = s->iw + t * IH;
            memset(isc, 0, sizeof(float) * (size_t)vis);
            for (int64_t h = 0; h < IH; h++) {
                const float *sc = s->scores + ((t - q0) * IH + h) * T;
                float wh = w[h];
                for (int64_t j = 0; j < vis; j++) isc[j] += wh * (sc[j] > 0.0f ? sc[j] : 0.0f);
            }
            cpumla_topk(isc, vis, K, sel, s->tkval);
            s->sel_len[t] = K;
        }
    }
    return 0;
}

int dsv4_attention(cpumla_dsv4_state *s, int64_t l, int64_t n, int64_t pos0) {
    const cpumla_dsv4_model *m = s->m;
    const cpumla_dsv4_layer *L = dsv4_layer(m, l);
    int64_t D = m->hidden, H = m->n_heads, hd = m->head_dim, P = m->rope_dim, QL = m->q_lora_rank;
    int64_t G = m->o_groups, OL = m->o_lora_rank, W = m->sliding_window, wr = s->wr, r = L->ratio;
    float eps = m->rms_norm_eps;
    float *kv = s->kv[l];
    /* queries: q LoRA (its latent also feeds the indexer), per-head unweighted RMSNorm, RoPE */
    DSV4_TRY(cpumla_gemm(L->wq_a, s->x, D, n, s->qr, QL));
    cpumla_rmsnorm(s->qr, QL, s->qr, QL, n, QL, L->q_norm.data, L->q_norm.dtype, eps);
    DSV4_TRY(cpumla_gemm(L->wq_b, s->qr, QL, n, s->q, H * hd));
    cpumla_rmsnorm(s->q, hd, s->q, hd, n * H, hd, NULL, CPUMLA_F32, eps);
    cpumla_rope(s->q, n, H * hd, H, hd, hd - P, P, s->pos, L->inv_freq, L->rope_scale, CPUMLA_ROPE_INTERLEAVED);
    /* the shared K == V row of each new token into the window ring */
    DSV4_TRY(cpumla_gemm(L->wkv, s->x, D, n, s->kvn, hd));
    cpumla_rmsnorm(s->kvn, hd, s->kvn, hd, n, hd, L->kv_norm.data, L->kv_norm.dtype, eps);
    cpumla_rope(s->kvn, n, hd, 1, hd, hd - P, P, s->pos, L->inv_freq, L->rope_scale, CPUMLA_ROPE_INTERLEAVED);
    for (int64_t t = 0; t < n; t++) s->slots[t] = (pos0 + t) % wr;
    DSV4_TRY(cpumla_cache_store(kv, CPUMLA_F32, hd, s->kvn, hd, n, hd, s->slots));
    if (r > 0) {
        DSV4_TRY(compress(s, L, &L->comp, s->cring[l], hd, kv + wr * hd, hd, n, pos0));
        if (L->csa) DSV4_TRY(indexer(s, l, n, pos0));
    }
    /* each query's rows: its window in the ring (the MTP layer's from where its entries start), then
     * the compressed entries it attends to */
    int64_t from = l == m->n_layers ? s->mtp_from : 0;
    for (int64_t t = 0; t < n; t++) {
        int64_t p = pos0 + t, cnt = 0;
        int32_t *idx = s->kv_idx + t * s->ld_idx;
        for (int64_t q = p - W + 1 > from ? p - W + 1 : from; q <= p; q++) idx[cnt++] = (int32_t)(q % wr);
        if (r > 0 && L->csa) {
            const int32_t *sel = s->sel + t * m->index_topk;
            for (int64_t j = 0; j < s->sel_len[t]; j++) idx[cnt++] = (int32_t)(wr + sel[j]);
        } else if (r > 0) {
            for (int64_t j = 0; j < (p + 1) / r; j++) idx[cnt++] = (int32_t)(wr + j);
        }
        s->kv_cnt[t] = cnt;
    }
    cpumla_attn_args a;
    memset(&a, 0, sizeof a);
    a.q = s->q; a.ldq_t = H * hd; a.ldq_h = hd; a.n_q = n; a.n_heads = H;
    a.kv = kv; a.kv_dtype = CPUMLA_F32; a.ld_kv = hd; a.n_kv = wr + (r > 0 ? s->ctx / r : 0);
    a.dk = hd; a.dv = hd;
    a.kv_len = s->kv_cnt; a.kv_idx = s->kv_idx; a.ld_idx = s->ld_idx;
    a.sinks = NULL;
    a.scale = (float)(1.0 / sqrt((double)hd));
    a.out = s->att; a.ldo_t = H * hd; a.ldo_h = hd;
    float sinks[H > 0 ? H : 1];
    for (int64_t h = 0; h < H; h++) sinks[h] = vec_at(L->sinks.data, L->sinks.dtype, h);
    a.sinks = sinks;
    DSV4_TRY(cpumla_mla_attention(&a));
    /* K == V carried RoPE into the output: rotate its rope slice back at the query position */
    cpumla_rope(s->att, n, H * hd, H, hd, hd - P, P, s->pos, L->inv_freq, L->rope_scale,
                CPUMLA_ROPE_INTERLEAVED | CPUMLA_ROPE_INVERSE);
    /* grouped output: z_g = wo_a[g] o_g (the g-th OL rows of wo_a against the g-th H*hd/G values) */
    int64_t gin = H * hd / G;
    const cpumla_weight *wa = L->wo_a;
    int views = wa->dtype != CPUMLA_E4M3 && wa->dtype != CPUMLA_E2M1 ? 1 : OL % wa->block_rows == 0;
    if (views) {
        for (int64_t g = 0; g < G; g++) {
            cpumla_weight v = *wa;
            v.rows = OL;
            v.data = (const char *)wa->data + g * OL * wa->row_bytes;
            if (wa->scale) {
                size_t es = wa->scale_dtype == CPUMLA_F32 ? 4 : 1;
                v.scale = (const char *)wa->scale + (size_t)(g * OL / wa->block_rows * wa->scale_ld) * es;
            }
            DSV4_TRY(cpumla_gemm(&v, s->att + g * gin, H * hd, n, s->z + g * OL, G * OL));
        }
    } else {
        DSV4_TRY(cpumla_head_gemv(wa, 0, OL, OL, G, n, s->att, H * hd, gin, s->z, G * OL, OL));
    }
    DSV4_TRY(cpumla_gemm(L->wo_b, s->z, G * OL, n, s->o, D));
    return 0;
}
