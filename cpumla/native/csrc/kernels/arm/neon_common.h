/* neon_common.h: inline helpers of neon.c (linear algebra) and neon_rows.c (row-wise and attention
 * kernels): the element loads and the bf16 rounding both use. Only included by those two files, which
 * are compiled with the same flags (FLAGS). static inline only: nothing here may define data
 * (tables stay in the one file that uses them). */
#ifndef CPUMLA_NEON_COMMON_H
#define CPUMLA_NEON_COMMON_H
#include <arm_neon.h>
#include <stdint.h>
#include "core/common.h"

static inline float32x4_t ld_bf16(const uint16_t *p) {
    return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(p), 16));
}

/* bf16_round (common.h) of 4 floats: the activations of a BF16 product (kernels.h) */
static inline float32x4_t bf16_round_q(float32x4_t v) {
    uint32x4_t u = vreinterpretq_u32_f32(v);
    uint32x4_t odd = vandq_u32(vshrq_n_u32(u, 16), vdupq_n_u32(1));
    uint32x4_t rn = vaddq_u32(u, vaddq_u32(vdupq_n_u32(0x7fff), odd));
    uint32x4_t nan = vcgtq_u32(vandq_u32(u, vdupq_n_u32(0x7fffffff)), vdupq_n_u32(0x7f800000));
    uint32x4_t qn = vorrq_u32(u, vdupq_n_u32(0x00400000));
    return vreinterpretq_f32_u32(vandq_u32(vbslq_u32(nan, qn, rn), vdupq_n_u32(0xffff0000u)));
}

static inline float32x4_t ld_f16(const uint16_t *p) {
    return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p)));
}

#endif
