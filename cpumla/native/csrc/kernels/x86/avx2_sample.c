/* avx2_sample.c: the sampler's row passes (sample_passes.h) compiled for AVX2 (FLAGS). */
#include "kernels/generic/sample_passes.h"

DEFINE_SAMPLE_PASSES(cpumla_sample_passes_avx2);
