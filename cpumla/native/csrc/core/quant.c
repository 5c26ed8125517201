/* quant.c: the integer products (quant.h) as every caller reaches the table's linear algebra, and
 * cpumla_quantize.
 *
 * A level's gemv / gemm / gemv_t / dequant_row entries know the checkpoint formats only. kern_gemv,
 * kern_gemm, kern_gemv_t and kern_dequant (kernels.h) take the table they are given: a Q8 / Q4 weight
 * goes to its q entries (quant_x + gemm_q for gemv and gemm: the activation rows of the call are
 * quantized once per task into this thread's scratch), and so does an E2M1 weight of 1x32 E8M0
 * blocks for gemv and gemm (its gemv_t and dequant_row stay on the fp32 entries); any other weight
 * goes to the entry itself. The q entries come from each level's own fill, set after the level's
 * other entries, so who_fmt[..][CPUMLA_Q8 / Q4] names the level whose code really serves them. */
#include <stdio.h>
#include <string.h>
#include "core/common.h"
#include "core/dispatch.h"
#include "core/gguf_q.h"
#include "core/quant.h"
#include "core/threadpool.h"

/* weights of the integer products: Q8 / Q4 (every entry), E2M1 with 1x32 E8M0 blocks (gemv and gemm
 * only: quant.h's is_e2m1_q) */
static int is_q(const cpumla_weight *w) { return w->dtype == CPUMLA_Q8 || w->dtype == CPUMLA_Q4; }
static int is_q_product(const cpumla_weight *w) { return is_q(w) || is_e2m1_q(w) || is_gq(w); }

/* a row of activations quantized for w, and w's product from such rows: the GGUF block types (gguf_q.h) to
 * the gq entries, the other integer formats to the q ones */
static void quant_row(const cpumla_kernels *k, const cpumla_weight *w, const float *x, void *qx) {
    if (is_gq(w)) k->quant_gq(x, w->cols, qx);
    else k->quant_x(w->dtype, x, w->cols, qx);
}
static void gemm_from_qx(const cpumla_kernels *k, const cpumla_weight *w, const void *qx, int64_t n, float *y,
                         int64_t ldy, int64_t r0, int64_t r1) {
    if (is_gq(w)) k->gemm_gq[w->dtype - CPUMLA_Q8_0](w, qx, n, y, ldy, r0, r1);
    else k->gemm_q(w, qx, n, y, ldy, r0, r1);
}

/* n activation rows quantized into this thread's scratch, then gemm_q (E2M1 at gemm_fp4_min_n tokens
 * or more: gemm_fp4 where the level has one, kernels.h); out of memory: nothing done (the context is marked
 * failed and the call returns -1) */
static void gemm_q_route(const cpumla_kernels *k, const cpumla_weight *w, const float *x, int64_t ldx, int64_t n,
                         float *y, int64_t ldy, int64_t r0, int64_t r1) {
    if (n <= 0 || r1 <= r0) return;
    if (k->gemm_fp4 && n >= k->gemm_fp4_min_n && is_e2m1_q(w)) { k->gemm_fp4(w, x, ldx, n, y, ldy, r0, r1); return; }
    const int64_t K = w->cols, per = QX_BYTES(K);
    uint8_t *qx = cpumla_scratch(CPUMLA_SCRATCH_QX, (size_t)(per * n));
    if (!qx) return;
    for (int64_t t = 0; t < n; t++) quant_row(k, w, x + t * ldx, qx + t * per);
    gemm_from_qx(k, w, qx, n, y, ldy, r0, r1);
}

void kern_gemm(const cpumla_kernels *k, const cpumla_weight *w, const float *x, int64_t ldx, int64_t n, float *y,
               int64_t ldy, int64_t r0, int64_t r1) {
    if (!is_q_product(w)) { k->gemm(w, x, ldx, n, y, ldy, r0, r1); return; }
    gemm_q_route(k, w, x, ldx, n, y, ldy, r0, r1);
}

void kern_gemv(const cpumla_kernels *k, const cpumla_weight *w, const float *x, float *y, int64_t r0, int64_t r1) {
    if (!is_q_product(w)) { k->gemv(w, x, y, r0, r1); return; }
    gemm_q_route(k, w, x, 0, 1, y, 0, r0, r1);
}

void kern_gemv_t(const cpumla_kernels *k, const cpumla_weight *w, int64_t r0, int64_t nr, const float *x, float *y,
                 int64_t c0, int64_t c1) {
    if (is_q(w)) k->gemv_t_q(w, r0, nr, x, y, c0, c1);
    else if (is_gq(w)) k->gemv_t_gq(w, r0, nr, x, y, c0, c1);
    else k->gemv_t(w, r0, nr, x, y, c0, c1);
}

void kern_dequant(const cpumla_kernels *k, const cpumla_weight *w, int64_t r, int64_t c0, int64_t c1, float *out) {
    if (is_q(w)) k->dequant_q(w, r, c0, c1, out);
    else if (is_gq(w)) k->dequant_gq(w, r, c0, c1, out);
    else k->dequant_row(w, r, c0, c1, out);
}

/* ---- a job's activations, quantized once for all of its tasks (kernels.h) ---- */
int64_t kern_qx_bytes(const cpumla_kernels *k, const cpumla_weight *w, int64_t n) {
    if (!is_q_product(w) || (k->gemm_fp4 && n >= k->gemm_fp4_min_n && is_e2m1_q(w))) return 0;
    return QX_BYTES(w->cols);
}

void kern_quant_rows(const cpumla_kernels *k, const cpumla_weight *w, const float *x, int64_t ldx, int64_t n,
                     void *qx) {
    const int64_t per = QX_BYTES(w->cols);
    for (int64_t t = 0; t < n; t++) quant_row(k, w, x + t * ldx, (uint8_t *)qx + t * per);
}

void kern_gemv_qx(const cpumla_kernels *k, const cpumla_weight *w, const void *qx, float *y, int64_t r0,
                  int64_t r1) {
    if (r1 > r0) gemm_from_qx(k, w, qx, 1, y, 0, r0, r1);
}

void kern_gemm_qx(const cpumla_kernels *k, const cpumla_weight *w, const void *qx, int64_t n, float *y, int64_t ldy,
                  int64_t r0, int64_t r1) {
    if (n > 0 && r1 > r0) gemm_from_qx(k, w, qx, n, y, ldy, r0, r1);
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
        kern_dequant(&cpumla_k, j->src, r, 0, K, row);
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
    else if (src->dtype == CPUMLA_Q8 || src->dtype == CPUMLA_Q4 || is_gq(src))
        snprintf(msg, sizeof msg, "quantize: the source is already quantized (Q8 / Q4 / a GGUF block type)");
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
