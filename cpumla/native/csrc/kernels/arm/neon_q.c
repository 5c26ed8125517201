/* neon_q.c: the neon level's integer products at baseline armv8-a (int_neon.h), for CPUs without
 * the dot-product extension. */
#include "kernels/arm/int_neon.h"
