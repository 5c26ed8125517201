/* neon_gq.c: the neon level's GGUF gemms (gguf_q.h) at baseline armv8-a (gq_neon.h); with the
 * dot-product extension, neon_gq_dot.c's. gemv_t and dequant keep the scalar spec's. */
#include "kernels/arm/gq_neon.h"

void cpumla_fill_neon_gq(cpumla_kernels *k) {
    if (cpumla_cpu_features() & CPUMLA_FEAT_NEON_DOTPROD) cpumla_fill_neon_gq_dot(k);
    else fill_gq_neon(k);
}
