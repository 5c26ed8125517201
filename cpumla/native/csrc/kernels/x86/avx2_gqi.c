/* avx2_gqi.c: the avx2 level's own GGUF products for the 32-column types, the IQ types and MXFP4
 * (gguf_q.h, gqi_x86.h): vpmaddubsw + vpmaddwd, signs by vpsignb. Compiled as avx2_gq.c is. */
#include "kernels/x86/gqi_x86.h"

void cpumla_fill_avx2_gqi(cpumla_kernels *k) { gqi_fill(k, "avx2"); }
