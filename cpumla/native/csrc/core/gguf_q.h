/* gguf_q.h: GGUF's block weight formats, read in place from the file's mapping (cpumla.h), and what
 * their products share across levels.
 *
 * Every type is ggml's layout: a row is cols / B blocks of the type's bytes (gq_types below), each
 * holding its own scales; all loads are unaligned. Each block unpacks (gq_unpack, the spec in
 * gguf_q.c) into chunks of 32 columns, chunk c holding
 *   q[32]          integer codes (int8),
 *   s[2c], s[2c+1] integer scales of its two halves of 16 (equal where the type scales by 32),
 *   m[2c], m[2c+1] integer mins of the halves (types with mins only),
 *   d[c], dm[c]    fp32 factors,
 * so that W = (d * s) * q for the types without mins and W = (d * s) * q - dm * m with them; the
 * values are those of the gguf package's dequantize, bit for bit:
 *   Q8_0 q, s 1          Q4_0 nib - 8, s 1        Q5_0 (nib | hb << 4) - 16, s 1
 *   Q4_1 / Q5_1  codes as Q4_0 / Q5_0 without the offset, s 1, m 1, dm = -(the fp16 min)
 *   Q2_K 2-bit q, s and m the low / high nibbles of the 16 scale bytes, dm the fp16 dmin
 *   Q3_K q = 2-bit - (4 when the hmask bit is clear), s the 6-bit scale - 32
 *   Q4_K / Q5_K q the 4 / 5 bits, s and m the 6-bit scale and min of each 32, dm the fp16 dmin
 *   Q6_K q = 6 bits - 32, s the int8 scale of each 16
 *   IQ4_NL / IQ4_XS q the iq4nl value of the nibble, s 1 / the 6-bit scale - 32
 *   IQ2_XXS q = +-grid (8, 25, 43), s = 2 ls + 1, d = the fp16 d / 8
 *   IQ3_XXS q = +-grid (4 .. 62), s = 2 ls + 1, d = d / 4
 *   IQ1_S / IQ1_M q = 8 g + (the delta's sign: +1, or -1 when its bit is set), g the grid value
 *       (-1, 0, 1), s = 2 ls + 1 (IQ1_M: per 16), d = d / 8 (IQ1_M's d gathered from its scales' top nibbles)
 *   MXFP4 q the doubled e2m1 value, s 1, d = 2^(e - 128) as the gguf package reads e (e < 2: its
 *       subnormals)
 * Products (kernels.h): the activation rows are quantized by gq_quant_x, quant_x's spec for Q8 (int8
 * codes in column order, xd per block of 32, the int32 code sum; QX_BYTES(K) bytes, quant.h) on every
 * level, and each chunk adds, in column order,
 *   p = (float)(s0 * sum_{i<16} q_i x_i + s1 * sum_{i>=16} q_i x_i) * (d * xd)
 *   p = p - (float)(m0 * sum_{i<16} x_i + m1 * sum_{i>=16} x_i) * (dm * xd)      (types with mins)
 * with exact int32 sums (|s q x| sums stay below 2^25; (float) of a sum above 2^24 rounds once, the
 * same on every level) and every fp32 operation rounded once: every level's result is the spec's, bit
 * for bit.
 */
#ifndef CPUMLA_GGUF_Q_H
#define CPUMLA_GGUF_Q_H
#include <stdint.h>
#include "core/common.h"
#include "core/kernels.h"

#define GQ8_0_BYTES 34           /* bytes of a Q8_0 block of 32 weights */
#define GQ_N (CPUMLA_MXFP4 - CPUMLA_Q8_0 + 1)

typedef struct {
    const char *name;            /* "q4_k": cpumla_kernel_impl's format name */
    int32_t block, bytes;        /* columns and bytes of a block */
    int32_t has_min;             /* the product has the dm * m term */
} gq_type;
CPUMLA_INTERNAL extern const gq_type gq_types[GQ_N];

static inline int is_gq(const cpumla_weight *w) { return w->dtype >= CPUMLA_Q8_0 && w->dtype <= CPUMLA_MXFP4; }
static inline const gq_type *gq_info(int32_t dtype) { return &gq_types[dtype - CPUMLA_Q8_0]; }

/* up to 8 chunks (256 columns) unpacked */
typedef struct {
    int8_t q[256];
    int16_t s[16], m[16];
    float d[8], dm[8];
} gq_unpacked;

/* unpack the chunks of columns [c0, c0 + 32 n) of row `row` (c0 a multiple of the type's block, n <= 8,
 * whole blocks) into u's chunks 0 .. n-1 */
CPUMLA_INTERNAL void gq_unpack(int32_t dtype, const uint8_t *row, int64_t c0, int n, gq_unpacked *u);
/* W[r, c] as gq_unpack's values give it (common.h's weight_at) */
CPUMLA_INTERNAL float gq_value(const cpumla_weight *w, int64_t r, int64_t c);

/* the codebooks (cpumla_gguf_tables): IQ2_XXS / IQ1_S grids as 8 bytes a word, IQ3_XXS's as 4 */
CPUMLA_INTERNAL extern uint64_t gq_iq2xxs_grid[256];
CPUMLA_INTERNAL extern uint32_t gq_iq3xxs_grid[256];
CPUMLA_INTERNAL extern uint64_t gq_iq1s_grid[2048];
CPUMLA_INTERNAL extern uint8_t gq_ksigns[128];
CPUMLA_INTERNAL extern int8_t gq_kvalues_iq4nl[16], gq_kvalues_mxfp4[16];
/* the largest |code| each table gives: IQ2_XXS's and IQ3_XXS's grid values, MXFP4's |value| (a bound the
 * panels of avx2_gqp.c size their biases by) */
CPUMLA_INTERNAL extern int32_t gq_iq2xxs_max, gq_iq3xxs_max, gq_mxfp4_max;

/* block b of row r of a Q8_0 weight: its fp16 scale as fp32, and its 32 codes */
static inline const uint8_t *gq8_block(const cpumla_weight *w, int64_t r, int64_t b) {
    return (const uint8_t *)w->data + r * w->row_bytes + b * GQ8_0_BYTES;
}
static inline float gq8_scale(const uint8_t *blk) { return f16_to_f32((uint16_t)(blk[0] | blk[1] << 8)); }
static inline const int8_t *gq8_codes(const uint8_t *blk) { return (const int8_t *)(blk + 2); }

/* the block's product, rounded as the spec rounds it: never fused into the running sum */
static inline float gq_block_product(int32_t isum, float wd, float xd) {
    volatile float p = (float)isum * (wd * xd);
    return p;
}

/* chunk c's product with 32 activation codes of scale xd, as the spec rounds it */
static inline float gq_chunk_product(const gq_unpacked *u, int c, int has_min, int32_t a0, int32_t a1, int32_t x0,
                                     int32_t x1, float xd) {
    const int32_t isum = (int32_t)u->s[2 * c] * a0 + (int32_t)u->s[2 * c + 1] * a1;
    volatile float p = (float)isum * (u->d[c] * xd);
    if (has_min) {
        const int32_t msum = (int32_t)u->m[2 * c] * x0 + (int32_t)u->m[2 * c + 1] * x1;
        volatile float pm = (float)msum * (u->dm[c] * xd);
        p = p - pm;
    }
    return p;
}

/* chunk c's product with the 32 activation codes x of scale xd, the integer sums formed one by one */
static inline float gq_chunk_spec(const gq_unpacked *u, int c, int has_min, const int8_t *x, float xd) {
    int32_t a0 = 0, a1 = 0, x0 = 0, x1 = 0;
    for (int i = 0; i < 16; i++) { a0 += u->q[32 * c + i] * x[i]; x0 += x[i]; }
    for (int i = 16; i < 32; i++) { a1 += u->q[32 * c + i] * x[i]; x1 += x[i]; }
    return gq_chunk_product(u, c, has_min, a0, a1, x0, x1, xd);
}

/* one activation row x [K] (K a multiple of 32) -> qx in the spec's Q8 layout (scalar_gq.c) */
CPUMLA_INTERNAL void gq_quant_x(const float *x, int64_t K, void *qx);

#endif
