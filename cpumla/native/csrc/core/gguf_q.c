/* gguf_q.c: which level has entries of its own for GGUF's block formats (gguf_q.h): dispatch.c calls
 * cpumla_fill_gq after each fill of a level's chain, so a level without any keeps its parent's. */
#include <string.h>
#include "core/kernels.h"

void cpumla_fill_gq(cpumla_kernels *k, const char *level) {
    if (!strcmp(level, "scalar")) cpumla_fill_scalar_gq(k);
#if defined(__x86_64__) || defined(_M_X64)
    else if (!strcmp(level, "avx2")) cpumla_fill_avx2_gq(k);
    else if (!strcmp(level, "avx512vnni")) cpumla_fill_avx512vnni_gq(k);
#endif
}
