/* avx512vnni_gqk.c: the avx512vnni level's own GGUF products for the K types (gguf_q.h, gqk_x86.h):
 * chunk lane sums with vpdpbusd on the unsigned codes, the gemv 4 rows at a time in zmm. avx512 and amx
 * keep them. */
#include "core/gguf_q.h"
#include <immintrin.h>

static inline __m256i gqk_dp(__m256i acc, __m256i u, __m256i x) { return _mm256_dpbusd_epi32(acc, u, x); }
#define GQK_NAME(t) gemm_##t##_avx512vnni
#define GQK_AVX512                       /* the gemv in zmm: gqk_avx512.h */
#include "kernels/x86/gqk_x86.h"

void cpumla_fill_avx512vnni_gqk(cpumla_kernels *k) { GQK_FILL(k, "avx512vnni"); }
