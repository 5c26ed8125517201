/* deepseek_v4_impl.h: the state of a DeepSeek-V4 model and the pieces of its forward shared by
 * deepseek_v4.c (state, mHC, MoE, the layer loop) and deepseek_v4_attn.c (attention, compressors, the
 * lightning indexer). Library-internal. Dimension names as in deepseek_v4.h. */
#ifndef CPUMLA_DEEPSEEK_V4_IMPL_H
#define CPUMLA_DEEPSEEK_V4_IMPL_H
#include "core/common.h"
#include "deepseek_v4.h"

#define DSV4_TRY(call) do { if ((call) != 0) return -1; } while (0)

struct cpumla_dsv4_state {
    const cpumla_dsv4_model *m;
    int64_t ctx, max_tokens;
    int64_t len;        /* positions the state holds */
    int64_t top;        /* one past the highest position written since the last start from 0 */
    int64_t mtp_from;   /* the MTP layer's ring: the first position its window may read ... */
    int64_t mtp_top;    /* ... and one past the highest it has written since */
    int64_t wr;         /* window ring rows: W + max_tokens (position p lives in row p % wr) */
    int64_t ld_idx;     /* attention index list stride: W + the most compressed rows one query reads */
    int64_t max_entries, qc;
    cpumla_ctx *scratch;
    float **kv;         /* [L (+ the MTP layer)] [wr + ctx/r, hd]: the window ring, then the compressed entries */
    float **cring;      /* [L] [ring_rows(l), 2*coff*hd]: compressor inputs [a | z + ape] of position p */
    float **ikeys;      /* [L] CSA: [ctx/r, ID] index keys */
    float **iring;      /* [L] CSA: [ring_rows(l), 4*ID] the indexer compressor's inputs */
    void *block;        /* the one allocation behind the scratch below */
    float *X;           /* [n, N, D] residual streams */
    float *Xn;          /* [n, N*D] RMS-normalised streams */
    float *mix;         /* [n, (2+N)*N] */
    float *pre, *post, *comb;   /* [n, N], [n, N], [n, N*N] (comb[j*N + k] = C_jk) */
    float *y;           /* [n, D] collapsed streams */
    float *x;           /* [n, D] normed sub-block input */
    float *o;           /* [n, D] sub-block output */
    float *tmp;         /* [N*D] */
    float *qr;          /* [n, QL] */
    float *q;           /* [n, H*hd] */
    float *kvn;         /* [n, hd] */
    float *att;         /* [n, H*hd] */
    float *z;           /* [n, G*OL] */
    float *caz;         /* [n, 2*2*max(hd, ID)] a chunk's compressor inputs */
    float *ent;         /* [4 * max(hd, ID)] one entry and its softmax sums */
    float *qi;          /* [n, IH*ID] */
    float *iw;          /* [n, IH] */
    float *scores;      /* [qc, IH, max_entries] */
    float *isc;         /* [max_entries] */
    float *tkval;       /* [index_topk] */
    int32_t *sel;       /* [n, index_topk] */
    int64_t *sel_len;   /* [n] */
    int32_t *kv_idx;    /* [n, ld_idx] */
    int64_t *kv_cnt;    /* [n] */
    float *gl;          /* [n, E] router logits */
    float *rw;          /* [n, K] */
    int32_t *ri;        /* [n, K] */
    float *ones;        /* [n] */
    int32_t *zeros;     /* [n] */
    int64_t *pos;       /* [n] */
    int64_t *slots;     /* [n] */
};

/* Layer l of m: the MTP layer's for l = n_layers. */
CPUMLA_INTERNAL const cpumla_dsv4_layer *dsv4_layer(const cpumla_dsv4_model *m, int64_t l);
/* n_layers, plus one with an MTP layer: the layers with caches. */
CPUMLA_INTERNAL int64_t dsv4_cached_layers(const cpumla_dsv4_model *m);

/* Rows of layer l's compressor input rings: coff*r + max_tokens (coff = 2 with overlap). */
CPUMLA_INTERNAL int64_t dsv4_ring_rows(const cpumla_dsv4_state *s, const cpumla_dsv4_layer *L);

/* s->o = attention of layer l over s->x for the n tokens at s->pos (the caches updated). */
CPUMLA_INTERNAL int dsv4_attention(cpumla_dsv4_state *s, int64_t l, int64_t n, int64_t pos0);

#endif
