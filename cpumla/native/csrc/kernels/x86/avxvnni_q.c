/* avxvnni_q.c: the avxvnni level (AVX2 + AVX-VNNI, dispatch.c), whose only kernels of its own are the
 * integer products: avx2_q.c compiled with -mavxvnni (FLAGS), where its __AVXVNNI__ branches sum each
 * block with vpdpbusd. Everything else of the level is avx2's. */
#include "kernels/x86/avx2_q.c"

const char cpumla_flags_avxvnni[] = CPUMLA_FLAGS;
