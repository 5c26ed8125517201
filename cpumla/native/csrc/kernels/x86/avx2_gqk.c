/* avx2_gqk.c: the avx2 level's own GGUF products for the K types (gguf_q.h, gqk_x86.h): chunk lane
 * sums with vpmaddubsw on the unsigned codes (each pair at most 2 * 63 * 127 < 2^15: exact), then
 * vpmaddwd. */
#include "core/gguf_q.h"
#include <immintrin.h>

static inline __m256i gqk_dp(__m256i acc, __m256i u, __m256i x) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1)));
}
#define GQK_NAME(t) gemm_##t##_avx2
#include "kernels/x86/gqk_x86.h"

void cpumla_fill_avx2_gqk(cpumla_kernels *k) { GQK_FILL(k, "avx2"); }
