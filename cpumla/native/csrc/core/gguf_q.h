/* gguf_q.h: GGUF's block weight formats, read in place from the file's mapping (cpumla.h), and what
 * their products share across levels.
 *
 * Q8_0: a row is cols / 32 blocks of 34 bytes, each an fp16 scale d (little-endian) then 32 int8 codes
 * q; W[r, 32b + i] = d * q[i]. The blocks are 2-byte aligned at best, so every load is unaligned.
 *
 * Products (kernels.h): the activation rows are quantized by gq_quant_x, which is quant_x's spec for
 * Q8 (int8 codes in column order, xd per block, the int32 code sum; QX_BYTES(K) bytes, quant.h) on
 * every level, so a level's gemm_gq only has to form each block's exact integer sum and add
 * (float)isum * (d * xd) in block order, as the spec does: its result is the spec's, bit for bit.
 */
#ifndef CPUMLA_GGUF_Q_H
#define CPUMLA_GGUF_Q_H
#include <stdint.h>
#include "core/common.h"
#include "core/kernels.h"

#define GQ8_0_BYTES 34           /* bytes of a Q8_0 block of 32 weights */

static inline int is_gq(const cpumla_weight *w) { return w->dtype == CPUMLA_Q8_0; }

/* block b of row r: its fp16 scale as fp32, and its 32 codes */
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

/* one activation row x [K] (K a multiple of 32) -> qx in the spec's Q8 layout (scalar_gq.c) */
CPUMLA_INTERNAL void gq_quant_x(const float *x, int64_t K, void *qx);

#endif
