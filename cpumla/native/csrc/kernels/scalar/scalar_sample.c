/* scalar_sample.c: the sampler's row passes (sample_passes.h) at the baseline flags, the table every
 * level starts from (FLAGS: the sampler's -ffp-contract=off -fno-trapping-math). */
#include "kernels/generic/sample_passes.h"

DEFINE_SAMPLE_PASSES(cpumla_sample_passes_scalar);
