/* avx2_gq.c: the avx2 level's Q8_0 gemm (gguf_q.h, gq_x86.h): block products with vpmaddubsw on the
 * codes' magnitudes and the activations given their signs, then vpmaddwd (exact: each pair of products
 * is at most 2 * 128 * 127 < 2^15). Compiled as avx2.c is. */
#include "core/gguf_q.h"
#include <immintrin.h>

static inline __m256i gq_dot8(__m256i w, __m256i x) {
    const __m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
    return _mm256_madd_epi16(p, _mm256_set1_epi16(1));
}

static inline __m256i gq_xsum8(__m256i x) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), x), _mm256_set1_epi16(1));
}
#define GQ_GEMM gemm_gq_avx2
#define GQ_GEMM_ANY gemm_gq_any_avx2
#define GQ_QUANT gq_quant_x_avx2
#include "kernels/x86/gq_x86.h"

void cpumla_fill_avx2_gq(cpumla_kernels *k) {
    k->gemm_gq[0] = gemm_gq_avx2;
    k->quant_gq = gq_quant_x_avx2;
    for (int t = 1; t < GQ_N; t++) k->gemm_gq[t] = gemm_gq_any_avx2;
    for (int f = CPUMLA_Q8_0; f <= CPUMLA_MXFP4; f++) k->who_fmt[K_GEMV][f] = k->who_fmt[K_GEMM][f] = "avx2";
}
