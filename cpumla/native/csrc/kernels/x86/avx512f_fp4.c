/* avx512f_fp4.c: the avx512f level's E2M1 integer products: int_avx512.h's quant_x and tile without
 * VNNI (vpmaddubsw + vpmaddwd for vpdpbusd), for E2M1 weights only; Q8 / Q4 stay avx2's there. */
#define AVX512_NO_VNNI 1
#include "kernels/x86/int_avx512.h"

#define QDRIVER_GEMM gemm_q_avx512
#define QDRIVER_PF_L2 cpumla_pf_l2
#include "kernels/generic/quant_driver.h"

/* the entries below (avx2's), for Q8 / Q4 */
static void (*prev_quant_x)(int32_t, const float *, int64_t, void *);
static void (*prev_gemm_q)(const cpumla_weight *, const void *, int64_t, float *, int64_t, int64_t, int64_t);

static void quant_x_f(int32_t wdtype, const float *x, int64_t K, void *qx) {
    if (wdtype == CPUMLA_E2M1) quant_x_avx512(wdtype, x, K, qx);
    else prev_quant_x(wdtype, x, K, qx);
}

static void gemm_q_f(const cpumla_weight *w, const void *qx, int64_t n, float *y, int64_t ldy, int64_t r0, int64_t r1) {
    if (w->dtype == CPUMLA_E2M1) gemm_q_avx512(w, qx, n, y, ldy, r0, r1);
    else prev_gemm_q(w, qx, n, y, ldy, r0, r1);
}

void cpumla_fill_avx512f_fp4(cpumla_kernels *k) {
    if (k->quant_x != quant_x_f) prev_quant_x = k->quant_x;
    if (k->gemm_q != gemm_q_f) prev_gemm_q = k->gemm_q;
    k->quant_x = quant_x_f;
    k->gemm_q = gemm_q_f;
    k->who_fmt[K_GEMV][CPUMLA_E2M1] = E2M1_WHO("avx512f");
    k->who_fmt[K_GEMM][CPUMLA_E2M1] = E2M1_GEMM_WHO("avx512f", FP4_FMA_MIN_AVX512F);   /* avx512f_gemm.c's gemm_fp4 */
}
