/* quant.c: the integer products (quant.h) in the kernel table, and cpumla_quantize.
 *
 * The implementations' gemv / gemm / gemv_t / dequant_row entries know the checkpoint formats only.
 * cpumla_fill_quant(k, "scalar"), called by dispatch.c after every level has filled the table, wraps
 * those four entries: a Q8 / Q4 weight goes to the q entries (quant_x + gemm_q for gemv and gemm:
 * the activation rows of the call are quantized once per task into this thread's scratch), and so
 * does an E2M1 weight of 1x32 E8M0 blocks for gemv and gemm (its gemv_t and dequant_row stay on the
 * fp32 entries); any other weight goes to the entry that was there. The q entries themselves come
 * from the q fill of each level of the chain (scalar_q.c, avx2_q.c, avxvnni_q.c, avx512f_q.c,
 * avx512_q.c for avx512vnni, neon_q.c / neon_q_dot.c), best last, and are never touched by the other
 * fills, so who_fmt[..][CPUMLA_Q8 / Q4] names the level whose code really serves them. */
#include <stdio.h>
#include <string.h>
#include "core/common.h"
#include "core/dispatch.h"
#include "core/quant.h"
#include "core/threadpool.h"

static void (*base_gemv)(const cpumla_weight *, const float *, float *, int64_t, int64_t);
static void (*base_gemm)(const cpumla_weight *, const float *, int64_t, int64_t, float *, int64_t, int64_t,
                         int64_t);
static void (*base_gemv_t)(const cpumla_weight *, int64_t, int64_t, const float *, float *, int64_t, int64_t);
static void (*base_dequant)(const cpumla_weight *, int64_t, int64_t, int64_t, float *);

/* the q entries of the table last filled (its best layer's), for the wrappers */
static void (*q_quant_x)(int32_t, const float *, int64_t, void *);
static void (*q_gemm)(const cpumla_weight *, const void *, int64_t, float *, int64_t, int64_t, int64_t);
static void (*q_gemm_fp4)(const cpumla_weight *, const float *, int64_t, int64_t, float *, int64_t, int64_t,
                          int64_t);
static int64_t q_gemm_fp4_min_n;
static void (*q_gemv_t)(const cpumla_weight *, int64_t, int64_t, const float *, float *, int64_t, int64_t);
static void (*q_dequant)(const cpumla_weight *, int64_t, int64_t, int64_t, float *);

/* weights of the integer products: Q8 / Q4 (every entry), E2M1 with 1x32 E8M0 blocks (gemv and gemm
 * only: quant.h's is_e2m1_q) */
static int is_q(const cpumla_weight *w) { return w->dtype == CPUMLA_Q8 || w->dtype == CPUMLA_Q4; }
static int is_q_product(const cpumla_weight *w) { return is_q(w) || is_e2m1_q(w); }

/* n activation rows quantized into this thread's scratch, then gemm_q (E2M1 at gemm_fp4_min_n tokens
 * or more: gemm_fp4 where the level has one, kernels.h); out of memory: nothing done (the context is marked
 * failed and the call returns -1) */
static void gemm_q_route(const cpumla_weight *w, const float *x, int64_t ldx, int64_t n, float *y, int64_t ldy,
                         int64_t r0, int64_t r1) {
    if (!is_q_product(w)) { base_gemm(w, x, ldx, n, y, ldy, r0, r1); return; }
    if (n <= 0 || r1 <= r0) return;
    if (q_gemm_fp4 && n >= q_gemm_fp4_min_n && is_e2m1_q(w)) { q_gemm_fp4(w, x, ldx, n, y, ldy, r0, r1); return; }
    const int64_t K = w->cols, per = QX_BYTES(K);
    uint8_t *qx = cpumla_scratch(CPUMLA_SCRATCH_QX, (size_t)(per * n));
    if (!qx) return;
    for (int64_t t = 0; t < n; t++) q_quant_x(w->dtype, x + t * ldx, K, qx + t * per);
    q_gemm(w, qx, n, y, ldy, r0, r1);
}

static void gemv_q_route(const cpumla_weight *w, const float *x, float *y, int64_t r0, int64_t r1) {
    if (!is_q_product(w)) { base_gemv(w, x, y, r0, r1); return; }
    gemm_q_route(w, x, 0, 1, y, 0, r0, r1);
}

/* ---- a GEMV job's activations, quantized once for all of its tasks (dispatch.h) ---- */
int64_t cpumla_qx_bytes(const cpumla_weight *w) {
    if (!is_q_product(w) || (q_gemm_fp4 && q_gemm_fp4_min_n <= 1 && is_e2m1_q(w))) return 0;
    return QX_BYTES(w->cols);
}

void cpumla_quant_rows(const cpumla_weight *w, const float *x, int64_t ldx, int64_t n, void *qx) {
    const int64_t per = QX_BYTES(w->cols);
    for (int64_t t = 0; t < n; t++) q_quant_x(w->dtype, x + t * ldx, w->cols, (uint8_t *)qx + t * per);
}

void cpumla_gemv_qx(const cpumla_weight *w, const void *qx, float *y, int64_t r0, int64_t r1) {
    if (r1 > r0) q_gemm(w, qx, 1, y, 0, r0, r1);
}

static void gemv_t_q_route(const cpumla_weight *w, int64_t r0, int64_t nr, const float *x, float *y, int64_t c0,
                           int64_t c1) {
    if (is_q(w)) q_gemv_t(w, r0, nr, x, y, c0, c1);
    else base_gemv_t(w, r0, nr, x, y, c0, c1);
}

static void dequant_q_route(const cpumla_weight *w, int64_t r, int64_t c0, int64_t c1, float *out) {
    if (is_q(w)) q_dequant(w, r, c0, c1, out);
    else base_dequant(w, r, c0, c1, out);
}

void cpumla_fill_quant(cpumla_kernels *k, const char *isa) {
    if (!strcmp(isa, "scalar")) {
        if (k->gemv != gemv_q_route) base_gemv = k->gemv;
        if (k->gemm != gemm_q_route) base_gemm = k->gemm;
        if (k->gemv_t != gemv_t_q_route) base_gemv_t = k->gemv_t;
        if (k->dequant_row != dequant_q_route) base_dequant = k->dequant_row;
        k->gemv = gemv_q_route;
        k->gemm = gemm_q_route;
        k->gemv_t = gemv_t_q_route;
        k->dequant_row = dequant_q_route;
        cpumla_fill_scalar_q(k);
    }
#if defined(__x86_64__)
    else if (!strcmp(isa, "avx2")) cpumla_fill_avx2_q(k);
    else if (!strcmp(isa, "avxvnni")) cpumla_fill_avxvnni_q(k);
    else if (!strcmp(isa, "avx512f")) cpumla_fill_avx512f_q(k);
    else if (!strcmp(isa, "avx512vnni")) cpumla_fill_avx512vnni_q(k);
    else if (!strcmp(isa, "amx")) cpumla_fill_amx_q(k);
#elif defined(__aarch64__)
    else if (!strcmp(isa, "neon")) {
        if (cpumla_cpu_features() & CPUMLA_FEAT_NEON_DOTPROD) cpumla_fill_neon_q_dot(k);
        else cpumla_fill_neon_q(k);
    }
#endif
    q_quant_x = k->quant_x;
    q_gemm = k->gemm_q;
    q_gemm_fp4 = k->gemm_fp4;
    q_gemm_fp4_min_n = k->gemm_fp4_min_n;
    q_gemv_t = k->gemv_t_q;
    q_dequant = k->dequant_q;
}

/* ---- cpumla_quantize ------------------------------------------------------------------------------ */
typedef struct {
    const cpumla_weight *src, *dst;
    int64_t r0, r1, rows_per_task;
} quant_job;

static void quantize_task(void *p, int64_t t, int tid) {
    (void)tid;
    quant_job *j = p;
    const int64_t K = j->src->cols, nb = K / QK;
    float *row = cpumla_scratch(CPUMLA_SCRATCH_QX, sizeof(float) * (size_t)K);
    if (!row) return;
    const int64_t a = j->r0 + t * j->rows_per_task, b = a + j->rows_per_task < j->r1 ? a + j->rows_per_task : j->r1;
    for (int64_t r = a; r < b; r++) {
        cpumla_k.dequant_row(j->src, r, 0, K, row);
        uint8_t *q = (uint8_t *)j->dst->data + r * j->dst->row_bytes;
        uint16_t *s = (uint16_t *)j->dst->scale + r * j->dst->scale_ld;
        cpumla_k.quantize_row(j->dst->dtype, row, nb, q, s);
    }
}

int cpumla_quantize(const cpumla_weight *src, const cpumla_weight *dst, int64_t r0, int64_t r1) {
    char msg[200];
    msg[0] = 0;
    if (dst->dtype != CPUMLA_Q8 && dst->dtype != CPUMLA_Q4)
        snprintf(msg, sizeof msg, "quantize: the target must be Q8 or Q4 (dtype %d)", (int)dst->dtype);
    else if (src->dtype == CPUMLA_Q8 || src->dtype == CPUMLA_Q4)
        snprintf(msg, sizeof msg, "quantize: the source is already quantized (Q8 / Q4)");
    else if (src->rows != dst->rows || src->cols != dst->cols)
        snprintf(msg, sizeof msg, "quantize: source %lldx%lld and target %lldx%lld differ", (long long)src->rows,
                 (long long)src->cols, (long long)dst->rows, (long long)dst->cols);
    else if (src->cols % QK || src->cols <= 0)
        snprintf(msg, sizeof msg, "quantize: %lld columns is not a positive multiple of 32", (long long)src->cols);
    else if (!dst->scale || dst->scale_dtype != CPUMLA_F16 || dst->block_rows != 1 || dst->block_cols != QK)
        snprintf(msg, sizeof msg, "quantize: the target needs an F16 scale grid of 1x32 blocks");
    else if (r0 < 0 || r1 > src->rows || r0 > r1)
        snprintf(msg, sizeof msg, "quantize: rows [%lld, %lld) are outside the weight", (long long)r0, (long long)r1);
    if (msg[0]) {
        cpumla_set_error(msg);
        return -1;
    }
    cpumla_enter(NULL);
    cpumla_ensure_init();
    /* tasks of ~256 KiB of source rows (at least 16 rows, and at least 4 tasks per thread): two threads
     * faulting in the same 2 MiB of a mapping wait on each other's page-table lock */
    const int64_t rows = r1 - r0, threads = cpumla_pool_threads();
    int64_t per = ((int64_t)256 << 10) / (src->row_bytes > 0 ? src->row_bytes : 1);
    const int64_t most = (rows + 4 * threads - 1) / (4 * threads);
    per = per < most ? per : most;
    per = per > 16 ? per : 16;
    quant_job j = {src, dst, r0, r1, per};
    cpumla_pool_run((rows + per - 1) / per, quantize_task, &j);
    return cpumla_leave(0);
}
