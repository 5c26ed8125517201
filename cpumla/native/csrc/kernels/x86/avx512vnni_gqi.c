/* avx512vnni_gqi.c: the avx512vnni level's own GGUF products for the 32-column types, the IQ types and
 * MXFP4 (gguf_q.h, gqi_x86.h): vpdpbusd, signs as mask registers. Compiled as avx512vnni_gq.c is; avx512
 * and amx keep them. */
#include "kernels/x86/gqi_x86.h"

void cpumla_fill_avx512vnni_gqi(cpumla_kernels *k) { gqi_fill(k, "avx512vnni"); }
