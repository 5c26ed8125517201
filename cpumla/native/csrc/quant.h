/* quant.h: cpumla's Q8 and Q4 weight formats and the quantized activations their products use.
 *
 * Weights (cpumla.h): block 1x32 along a row, one fp16 scale d per block in a separate grid
 * (scale [rows, cols/32], scale_dtype CPUMLA_F16), cols a multiple of 32.
 *   Q8: 32 int8 codes q in [-127, 127] per block; W = d * q. 34 bytes per 32 weights: 8.5 bits each.
 *   Q4: 16 bytes per block; byte i (0..15) holds column i in its low nibble and column 16 + i in its
 *       high nibble (unsigned n); W = d * (n - 8). 18 bytes per 32 weights: 4.5 bits each.
 *   The low / high split means a block's 16 bytes give its first 16 columns with one AND and its last
 *   16 with one shift, in column order, on every ISA.
 *
 * Quantized activations (qx, made by the table's quant_x, kernels.h: the exact rounding is there):
 * one row of K values takes QX_BYTES(K) bytes, KP = K rounded up to 512 (whole groups of 16 blocks):
 *   [0, KP)             int8 codes, zero past K, in the implementation's order (below)
 *   [KP, KP + KP/8)     float xd per block (zero past K/32)
 *   [KP + KP/8, +KP/8)  int32 per block: the implementation's own per-block integer (below)
 * Orders: scalar, neon, avx2's Q8: codes in column order, the int32 is the block's code sum. avx2's Q4:
 * per pair of blocks [cols 0-15 of b, b+1 | cols 16-31 of b, b+1], the int32 -8 times the code sum
 * (the nibbles' offset). avx512: codes per
 * group of 4 blocks as [cols 0-15 of blocks 0..3 | cols 16-31 of blocks 0..3] (the order vpand / vpsrlw
 * give 64 bytes of Q4 weights, and vpermt2q 128 bytes of Q8); the int32 is -128 (Q8) or -8 (Q4) times
 * the code sum, the correction for vpdpbusd's unsigned operand (weights + 128, or the nibbles).
 */
#ifndef CPUMLA_QUANT_H
#define CPUMLA_QUANT_H
#include <math.h>
#include <stdint.h>
#include "common.h"
#include "kernels.h"

#define QK 32
static inline int64_t qx_kp(int64_t K) { return (K + 511) & ~(int64_t)511; }
static inline int64_t QX_BYTES(int64_t K) { return qx_kp(K) + qx_kp(K) / 4; }
static inline float *qx_d(const void *qx, int64_t K) { return (float *)((uint8_t *)qx + qx_kp(K)); }
static inline int32_t *qx_s(const void *qx, int64_t K) {
    return (int32_t *)((uint8_t *)qx + qx_kp(K) + qx_kp(K) / 8);
}

/* fp32 -> fp16 bits, round to nearest even (overflow to inf; NaN stays NaN) */
static inline uint16_t f32_to_f16(float f) {
    uint32_t u = bits_from_f32(f), sign = (u >> 16) & 0x8000u;
    u &= 0x7fffffffu;
    if (u > 0x7f800000u) return (uint16_t)(sign | 0x7e00u);
    if (u >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);       /* rounds to >= 65536: inf */
    if (u < 0x38800000u) {                                           /* below 2^-14: subnormal or 0 */
        float a = f32_from_bits(u) * 16777216.0f;                    /* units of 2^-24, exact */
        return (uint16_t)(sign | (uint32_t)rintf(a));
    }
    uint32_t r = u + 0xfffu + ((u >> 13) & 1u);
    return (uint16_t)(sign | ((r - 0x38000000u) >> 13));
}

/* the fp16 scale of block b of row r */
static inline float q_scale(const cpumla_weight *w, int64_t r, int64_t b) {
    return f16_to_f32(((const uint16_t *)w->scale)[r * w->scale_ld + b]);
}

/* the 32 signed codes of block b of row r (Q4: nibble - 8) */
static inline void q_block(const cpumla_weight *w, int64_t r, int64_t b, int8_t out[QK]) {
    const uint8_t *row = weight_row(w, r);
    if (w->dtype == CPUMLA_Q8) {
        memcpy(out, row + b * QK, QK);
        return;
    }
    for (int i = 0; i < 16; i++) {
        out[i] = (int8_t)((row[b * 16 + i] & 15) - 8);
        out[16 + i] = (int8_t)((row[b * 16 + i] >> 4) - 8);
    }
}

/* The spec's activation quantization of one block (kernels.h): codes into q, returns xd. */
static inline float q_act_block(const float *x, int8_t *q) {
    float amax = 0.0f;
    for (int i = 0; i < QK; i++) amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
    float id = amax > 0.0f ? 127.0f / amax : 0.0f;
    for (int i = 0; i < QK; i++) q[i] = (int8_t)rintf(x[i] * id);
    return amax / 127.0f;
}

/* Implementations' q fills (quant.c calls them by name) */
void cpumla_fill_scalar_q(cpumla_kernels *k);
void cpumla_fill_avx2_q(cpumla_kernels *k);
void cpumla_fill_avx512f_q(cpumla_kernels *k);     /* avx512f_q.c: quantize_row only */
void cpumla_fill_avx512_q(cpumla_kernels *k);
void cpumla_fill_neon_q(cpumla_kernels *k);
void cpumla_fill_neon_q_dot(cpumla_kernels *k);    /* neon_q.c with +dotprod, as neon_q_dot.c */

#endif
