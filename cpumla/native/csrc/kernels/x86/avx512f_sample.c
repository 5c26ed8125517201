/* avx512f_sample.c: the sampler's row passes (sample_passes.h) compiled for AVX-512 F/BW/VL/DQ, in
 * 512-bit vectors (FLAGS). */
#include "kernels/generic/sample_passes.h"

DEFINE_SAMPLE_PASSES(cpumla_sample_passes_avx512f);
