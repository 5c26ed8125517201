/* neon_q_dot.c: the neon level's integer products with the dot-product extension (int_neon.h built
 * with +dotprod: sdot), for CPUs with ASIMDDP. */
#define NEON_Q_DOT 1
#include "kernels/arm/int_neon.h"
