/* avx512vnni_q.c: the avx512vnni level (avx512f + AVX512_VNNI, dispatch.c), whose only kernels of its
 * own are the integer products: int_avx512.h's quant_x and tile with vpdpbusd, under quant_driver.h's
 * gemv / gemm. Everything else of the level is avx512f's. */
#include "kernels/x86/int_avx512.h"

#define QDRIVER_GEMM gemm_q_avx512
#define QDRIVER_PF_L2 cpumla_pf_l2
#include "kernels/generic/quant_driver.h"

const char cpumla_flags_avx512vnni[] = CPUMLA_FLAGS;

void cpumla_fill_avx512vnni(cpumla_kernels *k) {
    k->quant_x = quant_x_avx512;
    k->gemm_q = gemm_q_avx512;
    k->gemm_fp4 = NULL;          /* E2M1: these tiles keep up with avx512f's FMA gemm at any token count (quant.h) */
    k->gemm_fp4_min_n = 0;
    for (int f = CPUMLA_Q8; f <= CPUMLA_Q4; f++) k->who_fmt[K_GEMV][f] = k->who_fmt[K_GEMM][f] = "avx512vnni";
    k->who_fmt[K_GEMV][CPUMLA_E2M1] = k->who_fmt[K_GEMM][CPUMLA_E2M1] = E2M1_WHO("avx512vnni");
}
