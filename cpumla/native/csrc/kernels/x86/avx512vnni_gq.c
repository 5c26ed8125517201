/* avx512vnni_gq.c: the avx512vnni level's Q8_0 gemm (gguf_q.h, gq_x86.h): block products with
 * vpdpbusd on the codes' magnitudes and the activations given their signs (exact int32 sums). Compiled
 * as avx512vnni_q.c is; avx512 and amx keep it. */
#include "core/gguf_q.h"
#include <immintrin.h>

static inline __m256i gq_dot8(__m256i w, __m256i x) {
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
}

static inline __m256i gq_xsum8(__m256i x) {
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_set1_epi8(1), x);
}
#define GQ_GEMM gemm_gq_avx512vnni
#define GQ_GEMM_ANY gemm_gq_any_avx512vnni
#define GQ_QUANT gq_quant_x_avx512vnni
#include "kernels/x86/gq_x86.h"

void cpumla_fill_avx512vnni_gq(cpumla_kernels *k) {
    k->gemm_gq[0] = gemm_gq_avx512vnni;
    k->quant_gq = gq_quant_x_avx512vnni;
    for (int t = 1; t < GQ_N; t++) k->gemm_gq[t] = gemm_gq_any_avx512vnni;
    for (int f = CPUMLA_Q8_0; f <= CPUMLA_MXFP4; f++) k->who_fmt[K_GEMV][f] = k->who_fmt[K_GEMM][f] = "avx512vnni";
}
