/* neon_gq_dot.c: the neon level's GGUF gemms with the dot-product extension (gq_neon.h built with
 * +dotprod: sdot), for CPUs with ASIMDDP. */
#define NEON_GQ_DOT 1
#include "kernels/arm/gq_neon.h"

void cpumla_fill_neon_gq_dot(cpumla_kernels *k) { fill_gq_neon_dot(k); }
