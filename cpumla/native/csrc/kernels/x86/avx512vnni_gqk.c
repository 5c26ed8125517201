/* avx512vnni_gqk.c: the avx512vnni level's own GGUF products for the K types (gguf_q.h); types without one here keep the
 * level's generic entry (gq_x86.h / the scalar spec). */
#include "core/gguf_q.h"

void cpumla_fill_avx512vnni_gqk(cpumla_kernels *k) { (void)k; }
