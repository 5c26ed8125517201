/* neon_gq.c: the neon level's own GGUF products for GGUF's block types (gguf_q.h); types without one here keep the
 * level's generic entry (gq_x86.h / the scalar spec). */
#include "core/gguf_q.h"

void cpumla_fill_neon_gq(cpumla_kernels *k) { (void)k; }
