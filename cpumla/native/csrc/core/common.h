/* common.h: portable helpers shared by every kernel and runtime file (static inline, no ISA flags). */
#ifndef CPUMLA_COMMON_H
#define CPUMLA_COMMON_H
#include <math.h>
#include <stdint.h>
#include <string.h>
#include "cpumla.h"
#include "mla_attention.h"

#ifndef CPUMLA_FLAGS
#define CPUMLA_FLAGS "(unrecorded)"
#endif

/* Functions one file shares with the others of the library (avx2.c's with avx2_gemm.c, quant.c's
 * kern_gemv for every caller): not part of the library's interface, so not exported from the shared
 * object and called directly rather than through the PLT. */
#define CPUMLA_INTERNAL __attribute__((visibility("hidden")))

/* The software prefetch distance of the GEMVs that read a thread's rows one at a time, as one stream
 * (avx2.c's and avx512f.c's plain weights, avx512.c's bf16 and E4M3): the hardware prefetchers stop
 * at each page. */
#ifndef GEMV_PF_BYTES
#define GEMV_PF_BYTES 8192
#endif
/* The hint of that prefetch, and of the AVX-512 integer / E4M3 loops' when they prefetch into L1:
 * prefetchnta (_MM_HINT_NTA, 0 here so that files without the x86 headers read it). A weight line is
 * used once per token, and a non-temporal fill keeps the stream from pushing the rest out of L2 / L3:
 * the steps between GEMVs (norms, RoPE, the latent cache, routing, Python between tokens) then find
 * their data in cache. */
#ifndef GEMV_PF_HINT
#define GEMV_PF_HINT 0
#endif

/* Where the AVX-512 GEMVs that do the most work per byte (int_avx512.h's integer products, avx512.c's
 * E4M3 decode) prefetch their stream: 0 into L1 (GEMV_PF_HINT), 1 into L2 (prefetcht1), 2 into L2
 * and again, GEMV_PF_NEAR bytes ahead, into L1 (prefetcht0: the two-level target); and
 * cpumla_pf_l2_plain, the same for the other GEMV streams (avx2.c, int_avx2.h, avx512f.c, avx512.c's
 * bf16). Set by cpumla_init from the CPU (cpumla_gemv_prefetch, dispatch.c), or by
 * cpumla_set_gemv_prefetch; read by those loops once per call, which pass it on as a constant
 * (GEMV_PF_CASES). Loops without a near prefetch of their own (row groups, scale lines) take 2 as 1. */
extern int cpumla_pf_l2, cpumla_pf_l2_plain;
/* The near distance of the two-level target: far enough that the L1 fill lands before the loads,
 * near enough that it is not evicted first. */
#ifndef GEMV_PF_NEAR
#define GEMV_PF_NEAR 3072
#endif
/* The two-level target's own distances in the AVX-512 GEMVs: far 4 KiB for those that spend a few
 * instructions a byte (avx512.c's bf16, the integer GEMVs of quant_driver.h), 6 KiB for avx512.c's
 * E4M3 decode, and near 1.5 KiB: each tuned on Intel with AMX, where the two-level target is the
 * default. The other loops keep GEMV_PF_BYTES and GEMV_PF_NEAR under that target. */
#ifndef GEMV_PF_FAR_2L
#define GEMV_PF_FAR_2L 4096
#endif
#ifndef GEMV_PF_FAR_2L_E4M3
#define GEMV_PF_FAR_2L_E4M3 6144
#endif
#ifndef GEMV_PF_NEAR_2L
#define GEMV_PF_NEAR_2L 1536
#endif
/* the far distance of such a stream under target l2 (a constant where the loop is specialised) */
#define GEMV_PF_DIST(l2) ((l2) == 2 ? GEMV_PF_FAR_2L : GEMV_PF_BYTES)
#define GEMV_PF_DIST_E4M3(l2) ((l2) == 2 ? GEMV_PF_FAR_2L_E4M3 : GEMV_PF_BYTES)
/* One prefetch of a GEMV stream's line at p: into L2 (prefetcht1) when l2 (1 or 2), else with
 * GEMV_PF_HINT. l2 is a constant where the loop is specialised, so only one of the two is compiled
 * into it. */
#define GEMV_PF(p, l2)                                                      \
    do {                                                                    \
        if (l2) __builtin_prefetch((const void *)(p), 0, 2);                \
        else __builtin_prefetch((const void *)(p), 0, GEMV_PF_HINT);        \
    } while (0)
/* The prefetches of a row stream at p, `dist` bytes ahead of the line read now: GEMV_PF there, and
 * with the two-level target (l2 == 2) a prefetcht0 GEMV_PF_NEAR bytes ahead of the line read now
 * (GEMV_PF_NEAR_2L when dist is one of the two-level target's own far distances). Written from the
 * far address: computed from the line read now, gcc scheduled the AVX-512 q8 loop worse. */
#define GEMV_PF_LINE(p, dist, l2)                                           \
    do {                                                                    \
        GEMV_PF(p, l2);                                                     \
        if ((l2) == 2)                                                      \
            __builtin_prefetch((const char *)(p) - (dist) +                 \
                               ((dist) == GEMV_PF_FAR_2L || (dist) == GEMV_PF_FAR_2L_E4M3 ? \
                                GEMV_PF_NEAR_2L : GEMV_PF_NEAR), 0, 3);                          \
    } while (0)
/* stmt with L2 declared as the constant 0, 1 or 2 that the target v holds: one specialisation of
 * the loop stmt calls for each target */
#define GEMV_PF_CASES(v, stmt)                                              \
    do {                                                                    \
        if ((v) == 2) { const int L2 = 2; stmt; }                           \
        else if (v) { const int L2 = 1; stmt; }                             \
        else { const int L2 = 0; stmt; }                                    \
    } while (0)

/* gemv_t (the MLA absorb) reads a head's rows back to back, a group of rows at a time over columns
 * [c0, c1): a stream the hardware prefetchers follow only within a page. Its software prefetch: at
 * the group of rows from i0, rows [i0 + GT_PF_ROWS, i0 + GT_PF_ROWS + g) of [0, nr) (at the first
 * group the rows before those too), the bytes of columns [c0, c1) of each, col_bytes per column
 * (gt_col_bytes), into L2 (GT_PF_LOC 2: prefetcht1: the rows are read once, a whole group at a time,
 * and L2 holds a group ahead where L1 would not). Always inlined: GCC drops calls to a function that
 * only prefetches. */
#ifndef GT_PF_LOC
#define GT_PF_LOC 2
#endif
#ifndef GT_PF_ROWS
#define GT_PF_ROWS 8
#endif
static inline int gt_col_bytes(int32_t dt) {       /* bytes a column of a plain-format row; E2M1: 0 (half) */
    return dt == CPUMLA_F32 ? 4 : dt == CPUMLA_BF16 || dt == CPUMLA_F16 ? 2 : dt == CPUMLA_E2M1 ? 0 : 1;
}
static inline __attribute__((always_inline)) void gt_prefetch(const void *data, int64_t row_bytes, int64_t r0,
                                                              int64_t i0, int64_t g, int64_t nr, int64_t c0,
                                                              int64_t c1, int col_bytes) {
    const int64_t o0 = col_bytes ? c0 * col_bytes : c0 / 2, o1 = col_bytes ? c1 * col_bytes : (c1 + 1) / 2;
    for (int64_t i = i0 ? i0 + GT_PF_ROWS : 0; i < i0 + GT_PF_ROWS + g && i < nr; i++) {
        const char *p = (const char *)data + (r0 + i) * row_bytes;
        for (int64_t o = o0 & ~(int64_t)63; o < o1; o += 64) __builtin_prefetch(p + o, 0, GT_PF_LOC);
    }
}

static inline float f32_from_bits(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t bits_from_f32(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

static inline float bf16_to_f32(uint16_t h) { return f32_from_bits((uint32_t)h << 16); }

/* round to nearest even; NaN stays a (quiet) NaN */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u = bits_from_f32(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* The activation operand of a BF16-weight product: x rounded to bf16 (nearest even), as fp32. Every
 * implementation multiplies bf16 weights by bf16(x) and accumulates in fp32, because that is what
 * the hardware bf16 dot products (vdpbf16ps, AMX, BFDOT) compute; the others round x to match. */
static inline float bf16_round(float f) { return bf16_to_f32(f32_to_bf16(f)); }

static inline float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    if (exp == 0x1f) return f32_from_bits(sign | 0x7f800000u | (man << 13));
    if (exp == 0) {                       /* zero or subnormal: man * 2^-24 */
        float v = (float)man * 5.9604644775390625e-8f;
        return sign ? -v : v;
    }
    return f32_from_bits(sign | ((exp + 112u) << 23) | (man << 13));
}

/* FP8 e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa; no infinities, 0x7f/0xff are NaN. */
static inline float e4m3_to_f32(uint8_t b) {
    uint32_t sign = (uint32_t)(b & 0x80u) << 24;
    uint32_t exp = (b >> 3) & 0xfu, man = b & 7u;
    if (exp == 0xf && man == 7) return NAN;
    if (exp == 0) {                       /* subnormal: man * 2^-9 */
        float v = (float)man * 0.001953125f;
        return sign ? -v : v;
    }
    return f32_from_bits(sign | ((exp + 120u) << 23) | (man << 20));
}

/* E8M0 scale byte: 2^(b-127); 0xff is NaN. */
static inline float e8m0_to_f32(uint8_t b) {
    if (b == 0xff) return NAN;
    if (b == 0) return f32_from_bits(0x00400000u);     /* 2^-127, a subnormal */
    return f32_from_bits((uint32_t)b << 23);
}

/* FP4 e2m1 code -> value; bit 3 is the sign. */
static const float cpumla_e2m1_lut[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                                          -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

/* Element i of the block-scale grid (F32 or E8M0), as fp32. */
static inline float scale_elem(const cpumla_weight *w, int64_t i) {
    if (w->scale_dtype == CPUMLA_E8M0) return e8m0_to_f32(((const uint8_t *)w->scale)[i]);
    return ((const float *)w->scale)[i];
}

/* Scale of block (r / block_rows, c / block_cols). */
static inline float weight_scale(const cpumla_weight *w, int64_t r, int64_t c) {
    return scale_elem(w, (r / w->block_rows) * w->scale_ld + c / w->block_cols);
}

/* The activation operand of an E4M3 product: x times the scale of element (r, c)'s block, in fp32,
 * rounded to bf16 (nearest even). An e4m3 code is exact in bf16 and a product of two bf16 is exact
 * in fp32, so every implementation can multiply codes by this operand with bf16 dot products
 * (vdpbf16ps, BFDOT) or fp32 FMAs alike, and sum in fp32: W[r, :] . x = sum_c e4m3(q[r, c]) *
 * e4m3_act(w, r, c, x[c]). The scale is folded into the activation (one rounding per activation and
 * row block, none on the weight), the same precision as bf16 checkpoints (kernels.h). */
static inline float e4m3_act(const cpumla_weight *w, int64_t r, int64_t c, float x) {
    return bf16_round(x * weight_scale(w, r, c));
}

static inline const uint8_t *weight_row(const cpumla_weight *w, int64_t r) {
    return (const uint8_t *)w->data + r * w->row_bytes;
}

/* Element (r, c) as fp32, scale included: the definition every kernel agrees with. */
__attribute__((visibility("hidden"))) float gq_value(const cpumla_weight *w, int64_t r, int64_t c);
static inline float weight_at(const cpumla_weight *w, int64_t r, int64_t c) {
    const uint8_t *row = weight_row(w, r);
    switch (w->dtype) {
    case CPUMLA_F32: return ((const float *)row)[c];
    case CPUMLA_BF16: return bf16_to_f32(((const uint16_t *)row)[c]);
    case CPUMLA_F16: return f16_to_f32(((const uint16_t *)row)[c]);
    case CPUMLA_E4M3: return e4m3_to_f32(row[c]) * weight_scale(w, r, c);
    case CPUMLA_E2M1: {
        uint8_t b = row[c >> 1];
        return cpumla_e2m1_lut[(c & 1) ? (b >> 4) : (b & 15)] * weight_scale(w, r, c);
    }
    case CPUMLA_Q8: case CPUMLA_Q4: {                 /* quant.h: the layouts */
        float d = f16_to_f32(((const uint16_t *)w->scale)[r * w->scale_ld + (c >> 5)]);
        if (w->dtype == CPUMLA_Q8) return d * (float)((const int8_t *)row)[c];
        uint8_t b = row[(c >> 5) * 16 + (c & 15)];
        return d * (float)(((c & 16) ? (b >> 4) : (b & 15)) - 8);
    }
    case CPUMLA_Q8_0: {                               /* cpumla.h: 34-byte blocks, fp16 d then 32 int8 */
        const uint8_t *blk = row + (c >> 5) * 34;
        return f16_to_f32((uint16_t)(blk[0] | blk[1] << 8)) * (float)((const int8_t *)blk)[2 + (c & 31)];
    }
    default:
        if (w->dtype > CPUMLA_Q8_0 && w->dtype <= CPUMLA_MXFP4) return gq_value(w, r, c);   /* gguf_q.h */
        return NAN;
    }
}

/* A norm weight element (F32 / BF16 / F16 vector). */
static inline float vec_at(const void *v, int32_t dtype, int64_t i) {
    switch (dtype) {
    case CPUMLA_F32: return ((const float *)v)[i];
    case CPUMLA_BF16: return bf16_to_f32(((const uint16_t *)v)[i]);
    case CPUMLA_F16: return f16_to_f32(((const uint16_t *)v)[i]);
    default: return NAN;
    }
}

/* Row of kv entry j of query qi (NULL when the entry is skipped). */
static inline const void *attn_kv_row(const cpumla_attn_args *a, int64_t qi, int64_t j) {
    int64_t row = j;
    if (a->kv_idx) {
        row = a->kv_idx[qi * a->ld_idx + j];
        if (row < 0 || row >= a->n_kv) return 0;
    }
    size_t esz = a->kv_dtype == CPUMLA_BF16 ? 2 : 4;
    return (const uint8_t *)a->kv + (size_t)row * (size_t)a->ld_kv * esz;
}

/* 0 for |x| below FLT_MIN (a subnormal), else x; NaN stays NaN */
static inline float flush_tiny(float x) { return x > -1.17549435e-38f && x < 1.17549435e-38f ? 0.0f : x; }

static inline float silu(float g) { return g / (1.0f + expf(-g)); }

/* One element of cpumla_swiglu: silu(min(g, limit)) * clamp(u, -limit, limit), unclamped when
 * limit <= 0. */
static inline float swiglu1(float g, float u, float limit) {
    if (limit > 0.0f) {
        g = g < limit ? g : limit;
        u = u < -limit ? -limit : (u > limit ? limit : u);
    }
    return silu(g) * u;
}

/* Tensor parallel (cpumla_comm, NULL alone): a sub-block's partial sums [n] summed over the ranks; and
 * logits [rows, vocab] = head(x) where this rank's head holds vocabulary rows row0 .. row0 + head->rows
 * - 1, gathered on rank 0. 0 or -1. */
static inline int tp_all_reduce(const cpumla_comm *c, float *buf, int64_t n) {
    return c ? c->all_reduce(c->ctx, buf, n) : 0;
}
static inline int tp_head(const cpumla_comm *c, const cpumla_weight *head, int64_t row0, const float *x, int64_t ldx,
                          int64_t rows, float *logits, int64_t vocab) {
    int64_t v0 = c ? row0 : 0;
    if (cpumla_gemm(head, x, ldx, rows, logits + v0, vocab) != 0) return -1;
    return c ? c->gather(c->ctx, logits, rows, vocab, v0, head->rows) : 0;
}

#endif
