/* kernels.h: the kernel table each instruction-set level fills, and the numeric contract its entries
 * keep.
 *
 * Entries are single-threaded kernels over a range (rows, columns, KV entries); the runtime (ops.c,
 * mla_attention.c, mla_mha.c, moe.c) splits the work of a public call (cpumla.h) over the thread pool
 * and calls these. Levels form a tree (dispatch.c's isas[]): a level's table is its parent's with the
 * level's own entries written over it, so a table is filled by the fill of every level from the root
 * down to the chosen one: scalar -> avx2 -> avxvnni, or scalar -> avx2 -> avx512f -> avx512vnni ->
 * avx512 -> amx (x86-64); scalar -> neon (arm64). who[] names the level that owns each entry and
 * who_fmt[] the one that serves each weight format of the linear-algebra entries (a fill sets it for
 * the formats it really handles), for `cpumla info`.
 *
 * Every entry's semantics are those of its scalar twin in scalar.c, which is the spec.
 *
 * BF16 weights (gemv, gemm, gemv_t): the activation is rounded to bf16 (nearest even, bf16_round in
 * common.h) before the multiply and the products accumulate in fp32, as bf16 hardware dot products
 * compute them and as transformers and llama.cpp do for bf16 checkpoints. Every implementation keeps
 * this, so decode (gemv) and prefill (gemm) agree and every ISA gives the same logits.
 *
 * E4M3 weights (gemv, gemm, gemv_t): the block scale is folded into the activation instead: each
 * code (exact) multiplies e4m3_act (common.h), bf16(x * scale of its block), and the products sum in
 * fp32. So an FP8 product is a bf16 product too, with no scale applied per block to partial sums.
 * F32 and F16 weights multiply x as given.
 *
 * Q8 / Q4 weights (cpumla.h; quant.h has the layouts), and E2M1 (FP4) weights of 1x32 E8M0 blocks
 * over whole blocks in gemv and gemm: the activation row is quantized per block of 32 first (quant_x),
 * to int8 for Q8 / Q4 (M = 127) and to int16 for E2M1 (M = 32512 = 127 * 256; int8 codes lose too
 * much against the fp32 forward there): amax = max |x_i| over the block, xd = amax / M (fp32
 * division), id = M / amax (fp32 division), xq_i = nearest_even(x_i * id) (fp32 product), so
 * |xq_i| <= M; a block whose amax is below 2^-100 (QACT_TINY, quant.h) counts as zero: xd = id = 0
 * (M / amax would overflow fp32 below ~2^-121 for M = 127 and ~2^-113 for 32512, and xd be subnormal
 * below ~2^-119 and ~2^-111); a block holding a NaN or an infinity keeps it: xd = NaN and its codes 0
 * (amax as quant.h's q_amax, over the bits of |x|, so no level loses a NaN to the order of a max).
 * Then, in fp32,
 *   y_r = sum over blocks b, in order, of (float)(sum_i wq_{r,b,i} * xq_{b,i}) * (wd_{r,b} * xd_b)
 * with the integer sums exact (|sum| < 2^24, so (float) is exact too): wq = q for Q8, nibble - 8 for
 * Q4, w2 = 2 * the e2m1 value for E2M1 (0, +-1, +-2, +-3, +-4, +-6, +-8, +-12); wd the fp16 scale as
 * fp32, or for E2M1 the E8M0 scale halved, 2^(e - 128) (e = 0xff: NaN; e <= 1: the fp32 subnormals
 * 2^-127 and 2^-128, which never occur in a released checkpoint and are applied as they are: the
 * integer operands have no subnormals, and wd * xd is one correctly rounded product). Every
 * implementation computes the same integer sums; only the fp32 additions over blocks are associated
 * differently. gemv_t (the MLA absorb) and dequant_row keep fp32: y[c] += (x_i * wd) * wq (E2M1: its
 * fp32 entries, x times the exact value times the block scale).
 * E2M1's other layouts (a partial edge block: cols % 32 != 0; wider blocks; F32 scales) keep the fp32
 * product of scalar.c (x as given, each block scale applied once to the block's partial sum), to
 * which every implementation hands them, gemv and gemm alike.
 * Q8_0 (GGUF's blocks, cpumla.h) multiplies as Q8 does: the same activation codes (quant_x's for Q8,
 * in the spec's column order: gq_quant_x), wq its int8 codes, wd the fp16 scale of its block, and
 * the same sum over blocks, which every implementation adds in block order: every level's result is
 * the spec's, bit for bit. gemv_t and dequant keep fp32 as Q8's do.
 * The table entries gemv, gemm, gemv_t and dequant_row take the checkpoint formats only. Every caller
 * goes through kern_gemv, kern_gemm, kern_gemv_t and kern_dequant (below), which send Q8 / Q4 weights
 * (and E2M1's 1x32 E8M0 layout, in gemv and gemm) to the table's q entries, and Q8_0 to its gq ones.
 */
#ifndef CPUMLA_KERNELS_H
#define CPUMLA_KERNELS_H
#include <stddef.h>
#include "core/common.h"

enum cpumla_kernel_id {
    K_GEMV, K_GEMM, K_GEMV_T, K_DEQUANT, K_RMSNORM, K_SWIGLU, K_SOFTMAX, K_ATTN, K_CACHE_ROW,
    K_READ, K_FMA, K_DOT, K_SOFTMAX_BLOCK, K_COUNT
};

typedef struct cpumla_kernels {
    /* y[i] = W[r0 + i, :] . x   for r0 + i < r1 */
    void (*gemv)(const cpumla_weight *w, const float *x, float *y, int64_t r0, int64_t r1);

    /* y[t*ldy + i] = W[r0 + i, :] . x[t*ldx, :]   for t < n, r0 + i < r1 */
    void (*gemm)(const cpumla_weight *w, const float *x, int64_t ldx, int64_t n, float *y,
                 int64_t ldy, int64_t r0, int64_t r1);

    /* gemm for BF16 weights with the activations already in bf16: xb [n][ldb] bf16 bits, the x of
     * gemm rounded (so the result is gemm's), zero from w->cols up to ldb, a multiple of 32. Only
     * where the ISA multiplies bf16 directly (NULL otherwise): ops.c then converts x once per call
     * (cache_row) instead of once per task. */
    void (*gemm_xb)(const cpumla_weight *w, const uint16_t *xb, int64_t ldb, int64_t n, float *y,
                    int64_t ldy, int64_t r0, int64_t r1);

    /* y[c - c0] = sum_{i < nr} x[i] * W[r0 + i, c]   for c0 <= c < c1 (overwrites y) */
    void (*gemv_t)(const cpumla_weight *w, int64_t r0, int64_t nr, const float *x, float *y,
                   int64_t c0, int64_t c1);

    /* out[c - c0] = W[r, c] as fp32, c0 <= c < c1 */
    void (*dequant_row)(const cpumla_weight *w, int64_t r, int64_t c0, int64_t c1, float *out);

    /* one row of cpumla_rmsnorm (y may equal x) */
    void (*rmsnorm_row)(const float *x, float *y, int64_t dim, const void *weight, int32_t wdtype,
                        float eps);

    /* one row of cpumla_swiglu (out may equal gate or up) */
    void (*swiglu_row)(const float *gate, const float *up, float *out, int64_t dim, float limit);

    /* one row of cpumla_softmax, in place */
    void (*softmax_row)(float *x, int64_t n);

    /* One part of cpumla_mla_attention: query qi, heads [h0, h1), entries [j0, j1) of that query's
     * list (row j itself, or kv_idx[qi*ld_idx + j]; entries < 0 skipped). Writes, for each head
     * k = h - h0:  m[k] = max_j s_h(j) (-INFINITY when no entry), l[k] = sum_j exp(s_h(j) - m[k]),
     * acc[k*dv + d] = sum_j exp(s_h(j) - m[k]) * value_j[d]  (zeros when no entry). A NaN score makes
     * l[k] NaN (its exp is NaN, and later rescales keep it so) while m[k] may stay -INFINITY: the merge
     * reads a NaN l as a NaN output, never as the zeros of "no entry". No sinks
     * here: mla_attention.c adds them when it merges the parts. */
    void (*attn_part)(const cpumla_attn_args *a, int64_t qi, int64_t h0, int64_t h1, int64_t j0,
                      int64_t j1, float *acc, float *m, float *l);

    /* One query's step of an online softmax over a block of n keys (cpumla_mla_mha), in place: the
     * first `valid` scores s[j] are visible, the rest masked. With x_j = s[j] * scale (j < valid) and
     * mn = max(*m, max_j x_j) (a NaN x_j never wins):  s[j] = exp(x_j - mn) for j < valid, 0 for
     * valid <= j < n;  *l = *l * c + sum_j s[j];  *m = mn;  returns c = exp(m_old - mn), which the
     * query's running output must be scaled by (0 when m_old is -INFINITY; 1 when mn is -INFINITY,
     * nothing visible yet). Every exp below FLT_MIN (s[j] and c) is 0 (flush_tiny, common.h): the
     * probabilities are the next product's operands, and no subnormal may reach it. */
    float (*softmax_block)(float *s, int64_t n, int64_t valid, float scale, float *m, float *l);

    /* dst[0..width) = src in dtype (CPUMLA_F32, or CPUMLA_BF16 rounded to nearest even) */
    void (*cache_row)(void *dst, int32_t dtype, const float *src, int64_t width);

    /* the sum of [buf, buf + bytes) read as doubles (bytes a multiple of 64, buf 64-byte aligned):
     * a streaming-read probe whose result can be checked */
    double (*read_sum)(const void *buf, int64_t bytes);

    /* iters rounds of independent fp32 FMAs in registers (an FMA-throughput probe); returns the
     * floating-point operations done (2 per multiply-add), folding the results into *sink */
    double (*fma_loop)(int64_t iters, float *sink);

    /* the same for the multiply-adds a BF16-weight gemm does: vdpbf16ps where the ISA has it (32 per
     * instruction), fp32 FMAs where it decodes the weights first */
    double (*dot_loop)(int64_t iters, float *sink);

    /* iters rounds of AMX tile multiply-adds on resident tiles (kind 0: tdpbf16ps, 16 x 16 x 32
     * multiply-adds an instruction; kind 1: tdpbusd, 16 x 16 x 64): the tiles' peak; returns the
     * operations done (2 per multiply-add). NULL below the amx level. */
    double (*tile_loop)(int kind, int64_t iters, float *sink);

    /* ---- Q8 / Q4 weights (quant.h: the activation buffer qx and its layout per implementation) ---- */
    /* one activation row x [K] (K a multiple of 32) -> qx, in this implementation's layout for
     * weights of dtype wdtype (CPUMLA_Q8 / CPUMLA_Q4 / CPUMLA_E2M1) */
    void (*quant_x)(int32_t wdtype, const float *x, int64_t K, void *qx);
    /* y[t*ldy + i] = W[r0 + i, :] . x_t for t < n, from the quantized rows qx + t * QX_BYTES(K) */
    void (*gemm_q)(const cpumla_weight *w, const void *qx, int64_t n, float *y, int64_t ldy, int64_t r0,
                   int64_t r1);
    /* gemm_q of E2M1 weights (quant.h's is_e2m1_q) for n >= gemm_fp4_min_n tokens, from x itself: the
     * same activation codes, exact block sums and rounding, with the block sums formed by fp32 FMAs
     * (every product and partial sum of a block is an integer below 2^24, so exact in any order) and
     * added in block order: bit for bit scalar_q.c's gemm_q. Packing fp32 panels costs more than the
     * integer tiles save below gemm_fp4_min_n tokens (quant.h). NULL: gemm_q serves every n. */
    void (*gemm_fp4)(const cpumla_weight *w, const float *x, int64_t ldx, int64_t n, float *y, int64_t ldy,
                     int64_t r0, int64_t r1);
    int64_t gemm_fp4_min_n;
    /* gemv_t and dequant_row for Q8 / Q4 (fp32 activations; E2M1 stays on gemv_t / dequant_row) */
    void (*gemv_t_q)(const cpumla_weight *w, int64_t r0, int64_t nr, const float *x, float *y, int64_t c0,
                     int64_t c1);
    void (*dequant_q)(const cpumla_weight *w, int64_t r, int64_t c0, int64_t c1, float *out);
    /* cpumla_quantize's step: nb blocks of 32 fp32 values -> codes q (Q8: 32 bytes a block, Q4: 16,
     * quant.h) and fp16 scales[nb]. scalar_q.c is the spec; every implementation is bit-identical to it
     * for NaN- and inf-free input. */
    void (*quantize_row)(int32_t dtype, const float *row, int64_t nb, uint8_t *q, uint16_t *scales);

    /* the sampler's passes over a logits row (core/sample.h), compiled for this level's vectors: every
     * level's compute the same bits, so a level without passes of its own keeps its parent's */
    const struct sample_passes *sample_passes;

    const char *who[K_COUNT];

    /* who_fmt[K_GEMV .. K_DEQUANT][weight dtype]: the implementation that really serves that format
     * through the entry (one that hands a format back to the entry it replaced names the one below);
     * a hand-back that depends on the layout is named in parentheses. cpumla_kernel_impl("gemv:e2m1").
     * Entries 5..7 (not weight formats) stay NULL. */
    const char *who_fmt[K_DEQUANT + 1][CPUMLA_DTYPE_COUNT];

    /* ---- GGUF block weights (gguf_q.h: Q8_0 .. MXFP4), read in place ----
     * gemm_gq[dtype - CPUMLA_Q8_0]: gemm_q for that type, from rows quantized by gq_quant_x (the spec's
     * layout, every level: quant_gq); gemv_t_gq and dequant_gq: gemv_t_q and dequant_q for them all. */
    void (*gemm_gq[CPUMLA_MXFP4 - CPUMLA_Q8_0 + 1])(const cpumla_weight *w, const void *qx, int64_t n, float *y,
                                                    int64_t ldy, int64_t r0, int64_t r1);
    /* gq_quant_x (the spec, scalar_gq.c) compiled for this level's vectors: the same bytes */
    void (*quant_gq)(const float *x, int64_t K, void *qx);
    void (*gemv_t_gq)(const cpumla_weight *w, int64_t r0, int64_t nr, const float *x, float *y, int64_t c0,
                      int64_t c1);
    void (*dequant_gq)(const cpumla_weight *w, int64_t r, int64_t c0, int64_t c1, float *out);
} cpumla_kernels;

/* ---- scratch ------------------------------------------------------------------------------------
 * Buffers a kernel needs beyond its fixed-size locals come from the current context (cpumla_enter,
 * context.c): one buffer per slot per pool thread, grown as needed, 64-byte aligned, kept by the
 * context. Two uses of one slot must never be live at once on one thread. cpumla_scratch returns NULL
 * when the buffer cannot be had (out of memory, or above CPUMLA_SCRATCH_LIMIT): the context is then
 * marked failed with a message, the public call returns -1, and the kernel must skip its work (never
 * compute on garbage, never hand the work to another implementation). */
enum cpumla_scratch_slot {
    CPUMLA_SCRATCH_X_BF16,           /* ops.c: a gemm's activations in bf16, for gemm_xb */
    CPUMLA_SCRATCH_F32ACT,           /* ops.c: cpumla_gemm_f32act's parts and products */
    CPUMLA_SCRATCH_ATTN,             /* mla_attention.c: attention parts */
    CPUMLA_SCRATCH_MHA,              /* mla_mha.c: decompressed keys and values, scores of a block */
    CPUMLA_SCRATCH_MHA_STATE,        /* mla_mha.c: softmax state per head and query */
    CPUMLA_SCRATCH_MHA_XB,           /* mla_mha.c: a span of latents in bf16 */
    CPUMLA_SCRATCH_ROUTE,            /* moe.c: routing scores */
    CPUMLA_SCRATCH_MOE1,             /* moe.c: one token's expert activations */
    CPUMLA_SCRATCH_MOE,              /* moe.c: prefill activations per expert */
    CPUMLA_SCRATCH_MOE_LIST,         /* moe.c: tokens grouped by expert */
    CPUMLA_SCRATCH_AVX2_XR,          /* avx2.c, avx2_gemm.c: rounded activation operands */
    CPUMLA_SCRATCH_AVX512F_XR,       /* avx512f.c, avx512f_gemm.c: rounded activation operands (bf16, e4m3) */
    CPUMLA_SCRATCH_AVX512_XB,        /* avx512.c: bf16 activations */
    CPUMLA_SCRATCH_AVX512_E4_XS,     /* avx512.c: e4m3 activation operands */
    CPUMLA_SCRATCH_AVX512_E4_PANEL,  /* avx512.c: decoded e4m3 panel */
    CPUMLA_SCRATCH_AVX512_GT,        /* avx512.c: gemv_t sums */
    CPUMLA_SCRATCH_AMX_PANEL,        /* amx.c: packed weight panel */
    CPUMLA_SCRATCH_AMX_QX,           /* amx.c: the tokens' int8 tiles of a Q8 / Q4 product */
    CPUMLA_SCRATCH_QX,               /* quant.c (kern_gemv, kern_gemm): quantized activations */
    CPUMLA_SCRATCH_QX_JOB,           /* ops.c, moe.c: a job's quantized activations, for all its tasks */
    CPUMLA_SCRATCH_GQP_PANEL,        /* avx512vnni_gqp.c, avx2_gqp.c: a GGUF weight panel */
    CPUMLA_SCRATCH_GQP_QX,           /* avx512vnni_gqp.c, avx2_gqp.c: the tokens' operands of a GGUF product */
    CPUMLA_SCRATCH_COUNT
};
CPUMLA_INTERNAL void *cpumla_scratch(int slot, size_t bytes);
/* Memory for a cache that fills a position at a time (a layer's latent cache, V3.2's index keys, V4's
 * caches), freed with free(): from 2 MiB up in 2 MiB-aligned transparent huge pages, elsewhere 64-byte
 * aligned. Untouched pages stay unmapped either way; a huge page is mapped for ~900 positions of a
 * 576-float row where 4 KiB pages fault every second position. */
CPUMLA_INTERNAL void *cpumla_cache_alloc(size_t bytes);

/* ---- the linear algebra as callers reach it (quant.c) ---------------------------------------------
 * k's gemv / gemm / gemv_t / dequant_row for the checkpoint formats; Q8 / Q4 weights to k's q entries
 * (quant_x + gemm_q, gemv_t_q, dequant_q), and E2M1 weights of 1x32 E8M0 blocks in gemv and gemm to
 * quant_x + gemm_q, or gemm_fp4 from gemm_fp4_min_n tokens. A Q8 / Q4 / E2M1 product quantizes its
 * activation rows into this thread's CPUMLA_SCRATCH_QX (out of memory: nothing done, the call fails). */
CPUMLA_INTERNAL void kern_gemv(const cpumla_kernels *k, const cpumla_weight *w, const float *x, float *y, int64_t r0,
                               int64_t r1);
CPUMLA_INTERNAL void kern_gemm(const cpumla_kernels *k, const cpumla_weight *w, const float *x, int64_t ldx,
                               int64_t n, float *y, int64_t ldy, int64_t r0, int64_t r1);
CPUMLA_INTERNAL void kern_gemv_t(const cpumla_kernels *k, const cpumla_weight *w, int64_t r0, int64_t nr,
                                 const float *x, float *y, int64_t c0, int64_t c1);
CPUMLA_INTERNAL void kern_dequant(const cpumla_kernels *k, const cpumla_weight *w, int64_t r, int64_t c0,
                                  int64_t c1, float *out);
/* A GEMV or GEMM job over weights that take quantized activations: the caller quantizes x once and every
 * task multiplies from that, rather than each task quantizing it again. The results are bit for bit
 * kern_gemv's and kern_gemm's.
 *   kern_qx_bytes: bytes of one quantized row for w's product with n tokens; 0 when it takes x as it is.
 *   kern_quant_rows: n rows of x (ldx apart) -> qx, kern_qx_bytes bytes apart.
 *   kern_gemv_qx: y[i] = W[r0 + i, :] . x for rows [r0, r1), from qx.
 *   kern_gemm_qx: kern_gemm's y for rows [r0, r1) and n tokens, from their quantized rows qx. */
CPUMLA_INTERNAL int64_t kern_qx_bytes(const cpumla_kernels *k, const cpumla_weight *w, int64_t n);
CPUMLA_INTERNAL void kern_quant_rows(const cpumla_kernels *k, const cpumla_weight *w, const float *x, int64_t ldx,
                                     int64_t n, void *qx);
CPUMLA_INTERNAL void kern_gemv_qx(const cpumla_kernels *k, const cpumla_weight *w, const void *qx, float *y,
                                  int64_t r0, int64_t r1);
CPUMLA_INTERNAL void kern_gemm_qx(const cpumla_kernels *k, const cpumla_weight *w, const void *qx, int64_t n, float *y,
                                  int64_t ldy, int64_t r0, int64_t r1);

/* ---- the levels' fills, called by dispatch.c root first ------------------------------------------
 * Each level exports one fill that overwrites the entries it provides: its q entries last (its q fill,
 * quant.h) and the sampler's passes where it compiles its own. A level whose kernels are split over
 * several files calls their fills from its own. */
void cpumla_fill_scalar(cpumla_kernels *k);        /* scalar.c; + scalar_q.c, scalar_sample.c */
void cpumla_fill_avx2(cpumla_kernels *k);          /* avx2.c; + avx2_q.c, avx2_sample.c and: */
void cpumla_fill_avx2_rows(cpumla_kernels *k);     /* avx2_rows.c */
void cpumla_fill_avx2_gemm(cpumla_kernels *k);     /* avx2_gemm.c */
void cpumla_fill_avxvnni(cpumla_kernels *k);       /* avxvnni_q.c: the integer products only */
void cpumla_fill_avx512f(cpumla_kernels *k);       /* avx512f.c; + avx512f_q.c, avx512f_sample.c and: */
void cpumla_fill_avx512f_rows(cpumla_kernels *k);  /* avx512f_rows.c */
void cpumla_fill_avx512f_gemm(cpumla_kernels *k);  /* avx512f_gemm.c */
void cpumla_fill_avx512vnni(cpumla_kernels *k);    /* avx512vnni_q.c: the integer products only */
void cpumla_fill_avx512(cpumla_kernels *k);        /* avx512.c: BF16 and E4M3 products */
void cpumla_fill_amx(cpumla_kernels *k);           /* amx.c: the tiled gemm */
void cpumla_fill_neon(cpumla_kernels *k);          /* neon.c; + neon_q.c or neon_q_dot.c and: */
void cpumla_fill_neon_rows(cpumla_kernels *k);     /* neon_rows.c */
/* the q entries (quant.h: the formats), each called last by its level's fill; avxvnni's and
 * avx512vnni's fills set nothing else */
void cpumla_fill_scalar_q(cpumla_kernels *k);      /* scalar_q.c: the spec */
void cpumla_fill_avx2_q(cpumla_kernels *k);        /* avx2_q.c */
void cpumla_fill_avx512f_q(cpumla_kernels *k);     /* avx512f_q.c: quantize_row, gemv_t_q, and: */
void cpumla_fill_avx512f_fp4(cpumla_kernels *k);   /* avx512f_fp4.c: E2M1 (int_avx512.h without VNNI) */
void cpumla_fill_amx_q(cpumla_kernels *k);         /* amx.c: gemm_q on int8 tiles, over avx512vnni's */
void cpumla_fill_neon_q(cpumla_kernels *k);        /* neon_q.c: int_neon.h at baseline */
void cpumla_fill_neon_q_dot(cpumla_kernels *k);    /* neon_q_dot.c: int_neon.h with +dotprod */
/* the GGUF block formats' entries (gguf_q.h), set after each level's own fill by dispatch.c: the level
 * named, if it has any (gguf_q.c), from scalar_gq.c (the spec), avx2_gq.c, avx512vnni_gq.c */
void cpumla_fill_gq(cpumla_kernels *k, const char *level);
void cpumla_fill_scalar_gq(cpumla_kernels *k);
void cpumla_fill_avx2_gq(cpumla_kernels *k);
void cpumla_fill_avx512vnni_gq(cpumla_kernels *k);
/* the K types' (gqk: Q2_K .. Q6_K) and the others' (gqi: Q4_0 .. Q5_1, IQ*, MXFP4) own entries, set after
 * the level's Q8_0 and generic ones; neon_gq.c the neon level's */
void cpumla_fill_avx2_gqk(cpumla_kernels *k);
void cpumla_fill_avx2_gqi(cpumla_kernels *k);
void cpumla_fill_avx2_gqp(cpumla_kernels *k);          /* avx2_gqp.c: panels from GQ2_MIN tokens */
/* avx2_gqp.c's panels for cpumla's Q8 / Q4 (quant_x_avx2's activations): 1 where it served the call (n >=
 * GQ2_MIN), else 0 */
int cpumla_gemm_qp_avx2(const cpumla_weight *w, const void *qx, int64_t n, float *y, int64_t ldy, int64_t r0,
                        int64_t r1);
void cpumla_fill_avx512vnni_gqk(cpumla_kernels *k);
void cpumla_fill_avx512vnni_gqp(cpumla_kernels *k);
void cpumla_fill_avx512vnni_gqi(cpumla_kernels *k);
void cpumla_fill_amx_gq(cpumla_kernels *k);         /* amx_gq.c: gemm_gq on int8 tiles */
void cpumla_fill_neon_gq(cpumla_kernels *k);

/* The flags each file was compiled with, recorded by the build (CPUMLA_FLAGS_<ISA> macros). */
extern const char cpumla_flags_scalar[], cpumla_flags_avx2[], cpumla_flags_avxvnni[], cpumla_flags_avx512f[],
    cpumla_flags_avx512vnni[], cpumla_flags_avx512[], cpumla_flags_amx[], cpumla_flags_neon[];

/* A table filled as cpumla_init(isa) fills it (every fill of the level's chain, root first), for the
 * tests that check each level's table on its own: -1 when isa is unknown or not built for this
 * architecture. */
int cpumla_fill_level(cpumla_kernels *k, const char *isa);

/* cpumla_decode_operands (cpumla.h) per level: dtype CPUMLA_E4M3 or CPUMLA_E2M1; fills
 * out[code] with the GEMV hot loop's weight operand, returns the power of two k with operand * 2^k =
 * the code's value, -1 for a format it has no loop for. */
int cpumla_decode_operands_scalar(int dtype, float *out);
int cpumla_decode_operands_avx2(int dtype, float *out);
int cpumla_decode_operands_avx512f(int dtype, float *out);
int cpumla_decode_operands_avx512(int dtype, float *out);
int cpumla_decode_operands_neon(int dtype, float *out);

#endif
