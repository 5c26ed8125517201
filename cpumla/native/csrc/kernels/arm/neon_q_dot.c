/* neon_q_dot.c: neon_q.c built with +dotprod (sdot), for CPUs with ASIMDDP (quant.c chooses). */
#define NEON_Q_DOT 1
#include "kernels/arm/neon_q.c"
