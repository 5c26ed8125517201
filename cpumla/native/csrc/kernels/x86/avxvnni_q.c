/* avxvnni_q.c: the avxvnni level (AVX2 + AVX-VNNI, dispatch.c), whose only kernels of its own are the
 * integer products' gemm_q: int_avx2.h's tile compiled with -mavxvnni (FLAGS), where vpdpbusd forms each
 * block's sum. Everything else of the level is avx2's. */
#include "kernels/x86/int_avx2.h"

#define QDRIVER_GEMM gemm_q_avxvnni
#define QDRIVER_PF_L2 cpumla_pf_l2_plain
#define QDRIVER_FEW 3                        /* 2 or 3 tokens: rows one at a time (int_avx2.h's tile_run) */
#include "kernels/generic/quant_driver.h"

const char cpumla_flags_avxvnni[] = CPUMLA_FLAGS;

void cpumla_fill_avxvnni(cpumla_kernels *k) {
    k->gemm_q = gemm_q_avxvnni;
    k->gemm_fp4 = NULL;           /* these tiles keep up with avx2_gemm.c's FMA form at any token count (quant.h) */
    k->gemm_fp4_min_n = 0;
    for (int f = CPUMLA_Q8; f <= CPUMLA_Q4; f++) k->who_fmt[K_GEMV][f] = k->who_fmt[K_GEMM][f] = "avxvnni";
    k->who_fmt[K_GEMV][CPUMLA_E2M1] = k->who_fmt[K_GEMM][CPUMLA_E2M1] = E2M1_WHO("avxvnni");
}
