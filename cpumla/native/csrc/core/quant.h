/* quant.h: the integer products: cpumla's Q8 and Q4 weight formats, FP4 (E2M1) checkpoint weights,
 * and the quantized activations their products use.
 *
 * Weights (cpumla.h): block 1x32 along a row, one fp16 scale d per block in a separate grid
 * (scale [rows, cols/32], scale_dtype CPUMLA_F16), cols a multiple of 32.
 *   Q8: 32 int8 codes q in [-127, 127] per block; W = d * q. 34 bytes per 32 weights: 8.5 bits each.
 *   Q4: 16 bytes per block; byte i (0..15) holds column i in its low nibble and column 16 + i in its
 *       high nibble (unsigned n); W = d * (n - 8). 18 bytes per 32 weights: 4.5 bits each.
 *   The low / high split means a block's 16 bytes give its first 16 columns with one AND and its last
 *   16 with one shift, in column order, on every ISA.
 *   E2M1 (the checkpoint's FP4, is_e2m1_q below: 1x32 blocks of E8M0 scales, cols a multiple of 32):
 *       byte i of a block holds column 2i in its low nibble and 2i + 1 in its high nibble; the integer
 *       code is w2 = e2m1_w2[nibble] = 2 * the e2m1 value, in {0, +-1, +-2, +-3, +-4, +-6, +-8, +-12},
 *       and the scale wd = 2^(e - 128) (e8m0_half: the E8M0 scale halved, exact; e = 0xff is NaN; for
 *       e <= 1 it is the fp32 subnormal 2^-127 or 2^-128, applied as it is). W = wd * w2.
 *
 * Quantized activations (qx, made by the table's quant_x, kernels.h: the exact rounding is there):
 * one row of K values takes QX_BYTES(K) bytes, KP = K rounded up to 512 (whole groups of 16 blocks):
 *   [0, KP)                  int8 codes, zero past K, in the implementation's order (below)
 *   [KP, KP + KP/8)          float xd per block (zero past K/32)
 *   [KP + KP/8, +KP/8)       int32 per block: the implementation's own per-block integer (below)
 *   [KP + KP/4, 2KP + KP/4)  E2M1 only: the low bytes of its int16 codes (qx_lo), the same order
 * Q8 / Q4 codes are int8 (|q| <= 127). E2M1's are int16 (|q| <= 32512 = 127 * 256), stored as two
 * int8 halves q = 256 * hi + lo (q_lo, q_hi: lo the sign-extended low byte, in [-128, 127]; hi in
 * [-127, 127]), hi in the first array, lo in qx_lo, so its block sums are 256 times a sum over hi plus
 * a sum over lo, each an int8 product. Orders: scalar, neon, avx2's Q8: codes in column order, the
 * int32 is the block's code sum. avx2's Q4:
 * per pair of blocks [cols 0-15 of b, b+1 | cols 16-31 of b, b+1], the int32 -8 times the code sum
 * (the nibbles' offset). avx512: codes per
 * group of 4 blocks as [cols 0-15 of blocks 0..3 | cols 16-31 of blocks 0..3] (the order vpand / vpsrlw
 * give 64 bytes of Q4 weights, and vpermt2q 128 bytes of Q8); the int32 is -128 (Q8) or -8 (Q4) times
 * the code sum, the correction for vpdpbusd's unsigned operand (weights + 128, or the nibbles).
 * E2M1: the same orders as Q4 with each block's columns taken as [even columns | odd columns] (what
 * the low and high nibbles give) where Q4 has [0-15 | 16-31]: avx2 and avx512 as their Q4 with the
 * int32 -12 times the (int16) code sum (their unsigned operand is w2 + 12, from a vpshufb table); neon
 * per block [even | odd] (its table gives w2 itself), the int32 the code sum; scalar in column order.
 */
#ifndef CPUMLA_QUANT_H
#define CPUMLA_QUANT_H
#include <math.h>
#include <stdint.h>
#include "core/common.h"
#include "core/kernels.h"

#define QK 32
static inline int64_t qx_kp(int64_t K) { return (K + 511) & ~(int64_t)511; }
static inline int64_t QX_BYTES(int64_t K) { return 2 * qx_kp(K) + qx_kp(K) / 4; }
static inline float *qx_d(const void *qx, int64_t K) { return (float *)((uint8_t *)qx + qx_kp(K)); }
static inline int32_t *qx_s(const void *qx, int64_t K) {
    return (int32_t *)((uint8_t *)qx + qx_kp(K) + qx_kp(K) / 8);
}
static inline int8_t *qx_lo(const void *qx, int64_t K) { return (int8_t *)qx + qx_kp(K) + qx_kp(K) / 4; }

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

/* 2 * the e2m1 value of each code (bit 3 is the sign): the integer operand of the E2M1 products */
static const int8_t e2m1_w2[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

/* an E8M0 scale byte halved, 2^(e - 128) as fp32: (e - 1) << 23 for e >= 2, the subnormals 2^-127
 * and 2^-128 for e = 1 and 0, NaN for 0xff */
static inline float e8m0_half(uint8_t e) {
    if (e == 0xff) return NAN;
    if (e <= 1) return f32_from_bits(0x00200000u << e);
    return f32_from_bits((uint32_t)(e - 1) << 23);
}

/* E2M1 weights the integer products take (is_q_product in quant.c): 1x32 blocks (any block_rows) of E8M0
 * scales and whole blocks. Others (partial edge blocks, wider blocks, F32 scales) stay on the
 * fp32-activation entries: the scalar spec's row_dot, for gemv and gemm alike. */
static inline int is_e2m1_q(const cpumla_weight *w) {
    return w->dtype == CPUMLA_E2M1 && w->scale_dtype == CPUMLA_E8M0 && w->block_cols == QK && w->block_rows >= 1 &&
           w->cols > 0 && w->cols % QK == 0;
}

/* the scale bytes (E2M1: E8M0) or halves (Q8 / Q4: fp16) of row r's blocks */
static inline const void *q_scale_row(const cpumla_weight *w, int64_t r) {
    if (w->dtype == CPUMLA_E2M1) return (const uint8_t *)w->scale + (r / w->block_rows) * w->scale_ld;
    return (const uint16_t *)w->scale + r * w->scale_ld;
}

/* gemv_t's software prefetch for Q8 / Q4 (avx2_q.c, avx512f_q.c): their groups of four rows read a
 * block of each row at a time, not a stream the hardware prefetchers follow. For the group at row i0
 * of [0, nr): rows [i0 + QT_PF_ROWS, i0 + QT_PF_ROWS + 4), and at the first group the rows before
 * those too; of each, blocks [b0, b1) and the line where its scales start. Always inlined: GCC takes a
 * function that only prefetches for one without effects and drops its calls. */
#define QT_PF_ROWS 8
static inline __attribute__((always_inline)) void qt_prefetch(const cpumla_weight *w, int64_t r0, int64_t i0,
                                                              int64_t nr, int64_t b0, int64_t b1) {
    const int64_t bb = w->dtype == CPUMLA_Q4 ? QK / 2 : QK;     /* weight bytes a block */
    for (int64_t i = i0 ? i0 + QT_PF_ROWS : 0; i < i0 + QT_PF_ROWS + 4 && i < nr; i++) {
        const char *p = (const char *)weight_row(w, r0 + i);
        for (int64_t o = b0 * bb; o < b1 * bb; o += 64) __builtin_prefetch(p + o, 0, 3);
        __builtin_prefetch((const uint16_t *)q_scale_row(w, r0 + i) + b0, 0, 3);
    }
}

/* the scale wd of block b of row r: the fp16 scale (Q8 / Q4), e8m0_half (E2M1) */
static inline float q_scale(const cpumla_weight *w, int64_t r, int64_t b) {
    if (w->dtype == CPUMLA_E2M1) return e8m0_half(((const uint8_t *)q_scale_row(w, r))[b]);
    return f16_to_f32(((const uint16_t *)w->scale)[r * w->scale_ld + b]);
}

/* the 32 signed codes of block b of row r, in column order (Q4: nibble - 8, E2M1: w2) */
static inline void q_block(const cpumla_weight *w, int64_t r, int64_t b, int8_t out[QK]) {
    const uint8_t *row = weight_row(w, r);
    if (w->dtype == CPUMLA_Q8) {
        memcpy(out, row + b * QK, QK);
        return;
    }
    if (w->dtype == CPUMLA_E2M1) {
        for (int i = 0; i < 16; i++) {
            out[2 * i] = e2m1_w2[row[b * 16 + i] & 15];
            out[2 * i + 1] = e2m1_w2[row[b * 16 + i] >> 4];
        }
        return;
    }
    for (int i = 0; i < 16; i++) {
        out[i] = (int8_t)((row[b * 16 + i] & 15) - 8);
        out[16 + i] = (int8_t)((row[b * 16 + i] >> 4) - 8);
    }
}

/* The codes' range: Q8 / Q4 activations int8 (127), E2M1's int16 (127 * 256: q_hi fits int8) */
#define QACT_MAX8 127.0f
#define QACT_MAX16 32512.0f
static inline float qact_max(int32_t wdtype) { return wdtype == CPUMLA_E2M1 ? QACT_MAX16 : QACT_MAX8; }

/* Activation blocks whose largest magnitude is below this quantize to zero (kernels.h): qmax / amax
 * would overflow fp32 below ~2^-121 (qmax 127) or ~2^-113 (32512), and xd = amax / qmax be subnormal
 * below ~2^-119 or ~2^-111. Written as
 * id = amax >= QACT_TINY ? qmax / amax : 0, xd = amax < QACT_TINY ? 0 : amax / qmax. */
#define QACT_TINY 0x1p-100f
static inline float qact_id(float amax, float qmax) { return amax >= QACT_TINY ? qmax / amax : 0.0f; }

/* A block holding a NaN or an infinity (amax not finite: NaN or inf) keeps it: its xd (activations) or
 * scale (weights) is NaN and its codes 0, so every product and dequantized value of the block is NaN.
 * amax is taken over the values' magnitudes as integers (the bits of |x|), which orders finite values
 * as floats do, puts inf and NaN above them, and does not depend on the order of a max tree the way
 * a float max does when one operand is NaN. */
static inline int q_nonfinite(float amax) { return !(amax <= 3.40282347e38f); }
static inline float qact_xd(float amax, float qmax) {
    return q_nonfinite(amax) ? NAN : amax < QACT_TINY ? 0.0f : amax / qmax;
}
#define Q_NAN_F16 0x7e00u          /* the fp16 scale of a weight block holding a NaN or an infinity */

/* max |x_i| of n values as the bits of |x| (an integer max: a NaN anywhere gives a NaN) */
static inline float q_amax(const float *x, int n) {
    uint32_t m = 0;
    for (int i = 0; i < n; i++) {
        const uint32_t u = bits_from_f32(x[i]) & 0x7fffffffu;
        m = u > m ? u : m;
    }
    return f32_from_bits(m);
}

/* The spec's activation quantization of one block (kernels.h), codes in [-qmax, qmax]: codes into q,
 * returns xd */
static inline float q_act_block(const float *x, float qmax, int32_t *q) {
    const float amax = q_amax(x, QK);
    const float id = qact_id(amax, qmax);
    for (int i = 0; i < QK; i++) q[i] = q_nonfinite(amax) ? 0 : (int32_t)rintf(x[i] * id);
    return qact_xd(amax, qmax);
}

/* an int16 code q as 256 * hi + lo, lo its sign-extended low byte (quant.h's E2M1 layout) */
static inline int8_t q_lo(int32_t q) { return (int8_t)(uint8_t)(q & 0xff); }
static inline int8_t q_hi(int32_t q) { return (int8_t)((q - q_lo(q)) / 256); }

/* who_fmt of gemv / gemm for E2M1: the integer kernel's file, and where the other layouts go */
#define E2M1_HANDBACK "scalar when cols % 32 != 0 or blocks not 1x32 E8M0"
#define E2M1_WHO(isa) isa " (" E2M1_HANDBACK ")"

/* the fewest tokens of an E2M1 gemm that a level's gemm_fp4 (kernels.h) takes: the token count from
 * which its FMA gemm outruns its integer tiles (whose speed does not grow with the tokens). With
 * vpdpbusd the tiles are at least as fast at every token count, so avxvnni and avx512vnni have no
 * gemm_fp4. */
#define FP4_FMA_MIN_AVX2 12
#define FP4_FMA_MIN_AVX512F 40
#define FP4_STR_(v) #v
#define FP4_STR(v) FP4_STR_(v)
/* who_fmt of gemm for E2M1 on a level with gemm_fp4 */
#define E2M1_GEMM_WHO(isa, min) isa " (fp32 FMAs from " FP4_STR(min) " tokens; " E2M1_HANDBACK ")"

#endif
