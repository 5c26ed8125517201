/* avx512vnni_gq.c: the avx512vnni level's Q8_0 gemm (gguf_q.h, gq_x86.h): block products with
 * vpdpbusd on the codes' magnitudes and the activations given their signs (exact int32 sums). Compiled
 * as avx512vnni_q.c is; avx512 and amx keep it. */
#include "core/gguf_q.h"
#include <immintrin.h>

static inline __m256i gq_dot8(__m256i w, __m256i x) {
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
}

#define GQ_GEMM gemm_gq_avx512vnni
#include "kernels/x86/gq_x86.h"

void cpumla_fill_avx512vnni_gq(cpumla_kernels *k) {
    k->gemm_gq = gemm_gq_avx512vnni;
    k->who_fmt[K_GEMV][CPUMLA_Q8_0] = k->who_fmt[K_GEMM][CPUMLA_Q8_0] = "avx512vnni";
}
