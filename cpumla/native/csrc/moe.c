/* moe.c: cpumla_moe, SwiGLU experts applied to routed tokens (also dense MLPs and shared experts, as a
 * table of one). Portable orchestration over the table's gemv / gemm / swiglu kernels.
 *
 * D=hidden I=expert intermediate K=experts per token (k here) n=tokens */
#include <stdio.h>
#include <string.h>
#include "common.h"
#include "dispatch.h"
#include "threadpool.h"

static int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
static int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* ---- decode: one token, k experts -------------------------------------------------------------- */
typedef struct {
    const cpumla_expert *experts;
    const int32_t *idx;          /* [k] */
    int64_t k, I, D, blocks_in, blocks_out, rows_in, rows_out;
    const float *x;
    float *h;                    /* [k, 2I]: gate rows then up rows of each expert */
    float *o;                    /* [k, D] */
} moe1_job;

static void moe1_in_task(void *p, int64_t t, int tid) {
    (void)tid;
    moe1_job *j = p;
    int64_t b = t % j->blocks_in, rest = t / j->blocks_in, which = rest % 2, e = rest / 2;
    if (j->idx[e] < 0) return;
    const cpumla_expert *ex = &j->experts[j->idx[e]];
    const cpumla_weight *w = which ? &ex->up : &ex->gate;
    int64_t r0 = b * j->rows_in, r1 = min64(r0 + j->rows_in, j->I);
    if (r0 < r1) cpumla_k.gemv(w, j->x, j->h + e * 2 * j->I + which * j->I + r0, r0, r1);
}

static void moe1_out_task(void *p, int64_t t, int tid) {
    (void)tid;
    moe1_job *j = p;
    int64_t b = t % j->blocks_out, e = t / j->blocks_out;
    if (j->idx[e] < 0) return;
    int64_t r0 = b * j->rows_out, r1 = min64(r0 + j->rows_out, j->D);
    if (r0 < r1) cpumla_k.gemv(&j->experts[j->idx[e]].down, j->h + e * 2 * j->I, j->o + e * j->D + r0, r0, r1);
}

static void *moe1_buf;
static size_t moe1_cap;

static int moe_one_token(const cpumla_expert *experts, const float *x, const int32_t *idx, const float *w,
                         int64_t k, float *y, float limit) {
    int64_t I = experts[0].gate.rows, D = experts[0].gate.cols;
    float *h = cpumla_grow(&moe1_buf, &moe1_cap, sizeof(float) * (size_t)(k * 2 * I + k * D));
    if (!h) { cpumla_set_error("out of memory for MoE scratch"); return -1; }
    int threads = cpumla_pool_threads();
    moe1_job j = {experts, idx, k, I, D, 1, 1, I, D, x, h, h + k * 2 * I};
    /* ~4 tasks per thread over all k*2 input matrices, a multiple of 8 rows each */
    j.rows_in = ceil_div(ceil_div(I, ceil_div(4 * (int64_t)threads, 2 * k)), 8) * 8;
    j.blocks_in = ceil_div(I, j.rows_in);
    j.rows_out = ceil_div(ceil_div(D, ceil_div(4 * (int64_t)threads, k)), 8) * 8;
    j.blocks_out = ceil_div(D, j.rows_out);
    cpumla_pool_run(k * 2 * j.blocks_in, moe1_in_task, &j);
    for (int64_t e = 0; e < k; e++)
        if (idx[e] >= 0) cpumla_k.swiglu_row(h + e * 2 * I, h + e * 2 * I + I, h + e * 2 * I, I, limit);
    cpumla_pool_run(k * j.blocks_out, moe1_out_task, &j);
    for (int64_t e = 0; e < k; e++) {
        if (idx[e] < 0) continue;
        const float *o = j.o + e * D;
        float we = w[e];
        for (int64_t d = 0; d < D; d++) y[d] += we * o[d];
    }
    return 0;
}

/* ---- prefill: group tokens by expert, one GEMM per expert hit ----------------------------------- */
static void *moe_buf, *moe_list_buf;
static size_t moe_cap, moe_list_cap;

int cpumla_moe(const cpumla_expert *experts, int64_t n_experts, const float *x, int64_t ldx, int64_t n,
               const int32_t *idx, const float *w, int64_t k, float *y, int64_t ldy, float limit) {
    cpumla_ensure_init();
    if (n <= 0 || k <= 0) return 0;
    for (int64_t i = 0; i < n * k; i++) {
        if (idx[i] >= n_experts) {
            char msg[120];
            snprintf(msg, sizeof msg, "MoE: expert index %d is out of range (%lld experts)", idx[i],
                     (long long)n_experts);
            cpumla_set_error(msg);
            return -1;
        }
    }
    if (n == 1) return moe_one_token(experts, x, idx, w, k, y, limit);

    int64_t I = experts[0].gate.rows, D = experts[0].gate.cols;
    /* counting sort of the (token, slot) pairs by expert */
    int64_t *list = cpumla_grow(&moe_list_buf, &moe_list_cap, sizeof(int64_t) * (size_t)(n * k + n_experts + 1));
    if (!list) { cpumla_set_error("out of memory for MoE scratch"); return -1; }
    int64_t *start = list + n * k;
    memset(start, 0, sizeof(int64_t) * (size_t)(n_experts + 1));
    for (int64_t i = 0; i < n * k; i++)
        if (idx[i] >= 0) start[idx[i] + 1]++;
    int64_t most = 0;
    for (int64_t e = 0; e < n_experts; e++) {
        most = start[e + 1] > most ? start[e + 1] : most;
        start[e + 1] += start[e];
    }
    int64_t total = start[n_experts];
    /* fill: list[pos] = token*k + slot, in token order within each expert */
    for (int64_t e = n_experts; e > 0; e--) start[e] = start[e - 1];
    start[0] = 0;
    for (int64_t i = 0; i < n * k; i++)
        if (idx[i] >= 0) list[start[idx[i] + 1]++] = i;
    /* now start[e+1] is the end of expert e's run and start[e] its beginning (start[0] = 0) */
    (void)total;
    float *xs = cpumla_grow(&moe_buf, &moe_cap, sizeof(float) * (size_t)(most * (D + 2 * I + D)));
    if (!xs) { cpumla_set_error("out of memory for MoE scratch"); return -1; }
    float *g = xs + most * D, *u = g + most * I, *o = u + most * I;
    for (int64_t e = 0; e < n_experts; e++) {
        int64_t b = start[e], cnt = start[e + 1] - b;
        if (cnt == 0) continue;
        for (int64_t r = 0; r < cnt; r++) memcpy(xs + r * D, x + (list[b + r] / k) * ldx, sizeof(float) * (size_t)D);
        cpumla_gemm(&experts[e].gate, xs, D, cnt, g, I);
        cpumla_gemm(&experts[e].up, xs, D, cnt, u, I);
        cpumla_swiglu(g, u, I, g, I, cnt, I, limit);
        cpumla_gemm(&experts[e].down, g, I, cnt, o, D);
        for (int64_t r = 0; r < cnt; r++) {
            int64_t pair = list[b + r];
            float we = w[pair];
            float *yt = y + (pair / k) * ldy;
            const float *orow = o + r * D;
            for (int64_t d = 0; d < D; d++) yt[d] += we * orow[d];
        }
    }
    return 0;
}
