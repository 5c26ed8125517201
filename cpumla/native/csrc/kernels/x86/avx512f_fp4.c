/* avx512f_qi.c: avx512_q.c built for the avx512f level (AVX-512 F/BW/VL/DQ, no VNNI): its E2M1 kernels
 * with vpmaddubsw + vpmaddwd for vpdpbusd (Q8 / Q4 stay avx2's there). */
#define AVX512_NO_VNNI 1
#include "kernels/x86/avx512vnni_q.c"
