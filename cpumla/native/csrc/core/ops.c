/* ops.c: the public kernels of cpumla.h. Each splits its work into tasks for the thread pool and
 * calls the chosen level's range kernels (kernels.h; the linear algebra through kern_gemv and its
 * siblings, which route the integer formats), between cpumla_enter(NULL) and cpumla_leave
 * (context.c: the library lock and the scratch of the current context). Small ops that
 * never dominate a token (RoPE, top-k) are portable code here; the absorbed MLA attention and the
 * cache store are in mla_attention.c, routing in moe.c, the benchmark probes in probes.c. */
#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "core/common.h"
#include "core/dispatch.h"
#include "core/threadpool.h"

#define MIN_PARALLEL_WORK 32768     /* below this many multiply-adds a call stays on one thread */
#define GEMM_TASK_ROWS 512          /* most weight rows of a gemm task (but see linear_rows) */

static int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
static int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
static int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

/* ---- gemv / gemm ------------------------------------------------------------------------------ */
typedef struct {
    const cpumla_weight *w;
    int64_t r_begin, r_end;               /* weight rows this job covers */
    const float *x;
    int64_t ldx, n;                       /* tokens */
    float *y;                             /* y[t*ldy + (r - r_begin)] */
    int64_t ldy, rows_per_task, tokens_per_task, row_tasks;
    int64_t pieces;                       /* gemv: pieces of each thread's span (cpumla_span_pieces) */
    int threads;
    int64_t halves_from;                  /* row tasks from this one on take half a task's rows */
    const uint16_t *xb;                   /* BF16 weights: x in bf16 for gemm_xb, or NULL */
    int64_t ldb;
    const void *qx;                       /* weights that take quantized activations: x quantized once, or NULL */
    int64_t qx_per;                       /* bytes of one token's quantized row */
} lin_job;

static void gemv_task(void *p, int64_t t, int tid) {
    (void)tid;
    lin_job *j = p;
    int64_t r0, r1;
    cpumla_span_piece(j->r_end - j->r_begin, j->pieces, 8, j->threads, t, &r0, &r1);
    if (r1 <= r0) return;
    r0 += j->r_begin;
    r1 += j->r_begin;
    if (j->qx) kern_gemv_qx(&cpumla_k, j->w, j->qx, j->y + (r0 - j->r_begin), r0, r1);
    else kern_gemv(&cpumla_k, j->w, j->x, j->y + (r0 - j->r_begin), r0, r1);
}

static void gemm_task(void *p, int64_t t, int tid) {
    (void)tid;
    lin_job *j = p;
    int64_t rt = t % j->row_tasks, tt = t / j->row_tasks, half = rt >= j->halves_from;
    int64_t h = half ? rt - j->halves_from : 0;       /* tasks past halves_from: half a task's rows */
    int64_t r0 = j->r_begin + (rt - h) * j->rows_per_task + h * (j->rows_per_task / 2);
    int64_t r1 = min64(r0 + (half ? j->rows_per_task / 2 : j->rows_per_task), j->r_end);
    if (r1 <= r0) return;
    int64_t t0 = tt * j->tokens_per_task, t1 = min64(t0 + j->tokens_per_task, j->n);
    if (j->qx)
        kern_gemm_qx(&cpumla_k, j->w, (const uint8_t *)j->qx + t0 * j->qx_per, t1 - t0,
                     j->y + t0 * j->ldy + (r0 - j->r_begin), j->ldy, r0, r1);
    else if (j->xb)
        cpumla_k.gemm_xb(j->w, j->xb + t0 * j->ldb, j->ldb, t1 - t0, j->y + t0 * j->ldy + (r0 - j->r_begin),
                         j->ldy, r0, r1);
    else
        kern_gemm(&cpumla_k, j->w, j->x + t0 * j->ldx, j->ldx, t1 - t0, j->y + t0 * j->ldy + (r0 - j->r_begin),
                      j->ldy, r0, r1);
}

/* x [n][ldx] -> bf16 [n][ldb] (zero past cols) in the caller's scratch, for gemm_xb; NULL if out of
 * memory (the context is then marked failed and the call does nothing) */
static const uint16_t *x_to_bf16(const float *x, int64_t ldx, int64_t n, int64_t cols, int64_t ldb) {
    uint16_t *xb = cpumla_scratch(CPUMLA_SCRATCH_X_BF16, sizeof(uint16_t) * (size_t)(n * ldb));
    if (!xb) return NULL;
    for (int64_t t = 0; t < n; t++) {
        cpumla_k.cache_row(xb + t * ldb, CPUMLA_BF16, x + t * ldx, cols);
        memset(xb + t * ldb + cols, 0, sizeof(uint16_t) * (size_t)(ldb - cols));
    }
    return xb;
}

/* tokens [t*per_task, ...) of x quantized for w (kern_quant_rows) */
typedef struct {
    const cpumla_weight *w;
    const float *x;
    int64_t ldx, n, per, per_task;
    uint8_t *qx;
} quant_rows_job;

static void quant_rows_task(void *p, int64_t t, int tid) {
    (void)tid;
    const quant_rows_job *j = p;
    const int64_t t0 = t * j->per_task, t1 = min64(t0 + j->per_task, j->n);
    if (t1 > t0) kern_quant_rows(&cpumla_k, j->w, j->x + t0 * j->ldx, j->ldx, t1 - t0, j->qx + t0 * j->per);
}

/* Rows [r_begin, r_end) of w times n tokens (x [n, ldx] -> y [n, ldy]). */
static void linear_rows(const cpumla_weight *w, int64_t r_begin, int64_t r_end, const float *x,
                        int64_t ldx, int64_t n, float *y, int64_t ldy) {
    int64_t rows = r_end - r_begin;
    if (n <= 0 || rows <= 0) return;
    int threads = cpumla_pool_threads();
    int small = threads == 1 || rows * w->cols * n < MIN_PARALLEL_WORK;
    lin_job j = {.w = w, .r_begin = r_begin, .r_end = r_end, .x = x, .ldx = ldx, .n = n, .y = y, .ldy = ldy};
    if (n == 1) {
        if (small) { kern_gemv(&cpumla_k, w, x, y, r_begin, r_end); return; }
        int64_t per = kern_qx_bytes(&cpumla_k, w, 1);
        if (per) {
            void *qx = cpumla_scratch(CPUMLA_SCRATCH_QX_JOB, (size_t)per);
            if (!qx) return;
            kern_quant_rows(&cpumla_k, w, x, 0, 1, qx);
            j.qx = qx;
        }
        /* each thread streams its span of the rows in pieces that shrink towards its end (threadpool.h) */
        j.pieces = cpumla_span_pieces(rows, w->row_bytes, 8, threads);
        j.threads = threads;
        cpumla_pool_run_spans(j.pieces * threads, gemv_task, &j);
        return;
    }
    if (w->dtype == CPUMLA_BF16 && cpumla_k.gemm_xb) {      /* convert x once, not once per task */
        j.ldb = (w->cols + 31) & ~(int64_t)31;
        j.xb = x_to_bf16(x, ldx, n, w->cols, j.ldb);
        if (!j.xb) return;
    }
    if (!small && (j.qx_per = kern_qx_bytes(&cpumla_k, w, n))) {   /* quantize x once, the threads sharing it */
        quant_rows_job q = {.w = w, .x = x, .ldx = ldx, .n = n, .per = j.qx_per, .per_task = ceil_div(n, 2 * threads)};
        q.qx = cpumla_scratch(CPUMLA_SCRATCH_QX_JOB, (size_t)(j.qx_per * n));
        if (!q.qx) return;
        cpumla_pool_run(ceil_div(n, q.per_task), quant_rows_task, &q);
        j.qx = q.qx;
    }
    if (small) {
        if (j.xb) cpumla_k.gemm_xb(w, j.xb, j.ldb, n, y, ldy, r_begin, r_end);
        else kern_gemm(&cpumla_k, w, x, ldx, n, y, ldy, r_begin, r_end);
        return;
    }
    /* row blocks of 64 (128 for FP8 with 128-row scale blocks: the rows of a scale block share one
     * converted activation, kernels.h); with too few blocks to feed every thread, split rows finer
     * and tokens too. With many rows per thread, other formats take larger blocks (at most
     * GEMM_TASK_ROWS, multiples of 32, an even count per thread): every task converts the tokens'
     * activations again (BF16 and E4M3 weights on levels without gemm_xb; the integer formats' are
     * quantized once above), which 64-row tasks of a few threads pay once per 64 rows. */
    int64_t unit = w->dtype == CPUMLA_E4M3 && w->block_rows == 128 ? 128 : 64;
    j.rows_per_task = rows >= unit * 2 * threads ? unit : ceil_div(ceil_div(rows, 2 * threads), 8) * 8;
    if (unit == 64 && rows >= unit * 2 * threads) {
        int64_t tasks = ceil_div(max64(ceil_div(rows, GEMM_TASK_ROWS), 2 * threads), 2 * threads) * 2 * threads;
        j.rows_per_task = ceil_div(ceil_div(rows, tasks), 32) * 32;
    }
    j.row_tasks = ceil_div(rows, j.rows_per_task);
    j.halves_from = j.row_tasks;
    /* FP8 blocks that do not split evenly over the threads: the last few in halves (64 rows), so that
     * the threads finish half a block apart at most (11 blocks of an expert's 1408 rows on 2 threads:
     * 5.5 each, not 6 and 5) */
    if (unit == 128 && j.rows_per_task == unit && j.row_tasks % threads && j.row_tasks >= 2 * threads) {
        j.halves_from = j.row_tasks - j.row_tasks % threads;
        j.row_tasks += j.row_tasks % threads;
    }
    int64_t token_tasks = j.row_tasks >= 2 * threads ? 1 : min64(ceil_div(2 * threads, j.row_tasks), n);
    j.tokens_per_task = ceil_div(n, token_tasks);
    token_tasks = ceil_div(n, j.tokens_per_task);
    cpumla_pool_run(j.row_tasks * token_tasks, gemm_task, &j);
}

int cpumla_gemv(const cpumla_weight *w, const float *x, float *y) {
    cpumla_enter(NULL);
    cpumla_ensure_init();
    linear_rows(w, 0, w->rows, x, 0, 1, y, 0);
    return cpumla_leave(0);
}

int cpumla_gemm(const cpumla_weight *w, const float *x, int64_t ldx, int64_t n, float *y, int64_t ldy) {
    cpumla_enter(NULL);
    cpumla_ensure_init();
    linear_rows(w, 0, w->rows, x, ldx, n, y, ldy);
    return cpumla_leave(0);
}

static void gemm_f32act(const cpumla_weight *w, const float *x, int64_t ldx, int64_t n, float *y, int64_t ldy) {
    if (w->dtype != CPUMLA_BF16) { linear_rows(w, 0, w->rows, x, ldx, n, y, ldy); return; }
    enum { CHUNK = 64 };                    /* tokens at a time: the scratch stays a few MB */
    int64_t K = w->cols, R = w->rows;       /* the parts [3 * CHUNK][K] and their products [3 * CHUNK][R] */
    float *parts = cpumla_scratch(CPUMLA_SCRATCH_F32ACT, sizeof(float) * (size_t)(3 * min64(n, CHUNK) * (K + R)));
    if (!parts) return;
    float *out = parts + 3 * min64(n, CHUNK) * K;
    for (int64_t t0 = 0; t0 < n; t0 += CHUNK) {
        int64_t nt = min64(CHUNK, n - t0);
        for (int64_t t = 0; t < nt; t++)
            for (int64_t c = 0; c < K; c++) {
                float v = x[(t0 + t) * ldx + c], p1 = bf16_round(v), p2 = bf16_round(v - p1);
                parts[(3 * t) * K + c] = p1;
                parts[(3 * t + 1) * K + c] = p2;
                parts[(3 * t + 2) * K + c] = (v - p1) - p2;    /* exact, at most 8 significant bits */
            }
        linear_rows(w, 0, R, parts, K, 3 * nt, out, R);
        for (int64_t t = 0; t < nt; t++)
            for (int64_t r = 0; r < R; r++)
                y[(t0 + t) * ldy + r] = (out[(3 * t) * R + r] + out[(3 * t + 1) * R + r]) + out[(3 * t + 2) * R + r];
    }
}

int cpumla_gemm_f32act(const cpumla_weight *w, const float *x, int64_t ldx, int64_t n, float *y, int64_t ldy) {
    cpumla_enter(NULL);
    cpumla_ensure_init();
    gemm_f32act(w, x, ldx, n, y, ldy);
    return cpumla_leave(0);
}

/* ---- per-head products (MLA absorb / un-absorb) ----------------------------------------------- */
typedef struct {
    const cpumla_weight *w;
    int64_t row0, head_stride, head_rows, n_heads, n;
    const float *x;
    int64_t ldx_t, ldx_h;
    float *y;
    int64_t ldy_t, ldy_h, col_tasks, cols_per_task;
} head_job;

static void head_gemv_task(void *p, int64_t t, int tid) {
    (void)tid;
    head_job *j = p;
    int64_t h = t % j->n_heads, tok = t / j->n_heads;
    int64_t r0 = j->row0 + h * j->head_stride;
    const float *x = j->x + h * j->ldx_h + tok * j->ldx_t;
    float *y = j->y + h * j->ldy_h + tok * j->ldy_t;
    if (j->n == 1) kern_gemv(&cpumla_k, j->w, x, y, r0, r0 + j->head_rows);
    else kern_gemm(&cpumla_k, j->w, x, j->ldx_t, j->n, y, j->ldy_t, r0, r0 + j->head_rows);
}

int cpumla_head_gemv(const cpumla_weight *w, int64_t row0, int64_t head_stride, int64_t head_rows,
                     int64_t n_heads, int64_t n, const float *x, int64_t ldx_t, int64_t ldx_h,
                     float *y, int64_t ldy_t, int64_t ldy_h) {
    cpumla_enter(NULL);
    cpumla_ensure_init();
    head_job j = {w, row0, head_stride, head_rows, n_heads, n, x, ldx_t, ldx_h, y, ldy_t, ldy_h, 1, 0};
    /* one task per head; all n tokens of a head go through gemm so its rows are read once */
    if (n <= 0 || n_heads <= 0) {
    } else if (cpumla_pool_threads() == 1 || head_rows * w->cols * n * n_heads < MIN_PARALLEL_WORK) {
        for (int64_t h = 0; h < n_heads; h++) head_gemv_task(&j, h, 0);
    } else {
        cpumla_pool_run_spans(n_heads, head_gemv_task, &j);     /* a thread's heads in order */
    }
    return cpumla_leave(0);
}

static void head_gemv_t_task(void *p, int64_t t, int tid) {
    (void)tid;
    head_job *j = p;
    int64_t ct = t % j->col_tasks, rest = t / j->col_tasks;
    int64_t tok = rest % j->n, h = rest / j->n;      /* a head's tokens in a row: its rows stay in L2 */
    int64_t c0 = ct * j->cols_per_task, c1 = min64(c0 + j->cols_per_task, j->w->cols);
    kern_gemv_t(&cpumla_k, j->w, j->row0 + h * j->head_stride, j->head_rows, j->x + tok * j->ldx_t + h * j->ldx_h,
                    j->y + tok * j->ldy_t + h * j->ldy_h + c0, c0, c1);
}

static void head_gemv_t(const cpumla_weight *w, int64_t row0, int64_t head_stride, int64_t head_rows,
                        int64_t n_heads, int64_t n, const float *x, int64_t ldx_t, int64_t ldx_h,
                        float *y, int64_t ldy_t, int64_t ldy_h) {
    if (n <= 0 || n_heads <= 0) return;
    int threads = cpumla_pool_threads();
    head_job j = {w, row0, head_stride, head_rows, n_heads, n, x, ldx_t, ldx_h, y, ldy_t, ldy_h, 1, w->cols};
    int64_t tasks = n_heads * n;
    if (threads > 1 && tasks < 2 * threads) {           /* few heads: split columns too */
        j.col_tasks = min64(ceil_div(2 * threads, tasks), ceil_div(w->cols, 64));
        j.cols_per_task = ceil_div(ceil_div(w->cols, j.col_tasks), 16) * 16;
        j.col_tasks = ceil_div(w->cols, j.cols_per_task);
    }
    tasks *= j.col_tasks;
    if (threads == 1 || head_rows * w->cols * n * n_heads < MIN_PARALLEL_WORK) {
        for (int64_t t = 0; t < tasks; t++) head_gemv_t_task(&j, t, 0);
        return;
    }
    cpumla_pool_run_spans(tasks, head_gemv_t_task, &j);     /* a thread's heads in order */
}

int cpumla_head_gemv_t(const cpumla_weight *w, int64_t row0, int64_t head_stride, int64_t head_rows,
                       int64_t n_heads, int64_t n, const float *x, int64_t ldx_t, int64_t ldx_h,
                       float *y, int64_t ldy_t, int64_t ldy_h) {
    cpumla_enter(NULL);
    cpumla_ensure_init();
    head_gemv_t(w, row0, head_stride, head_rows, n_heads, n, x, ldx_t, ldx_h, y, ldy_t, ldy_h);
    return cpumla_leave(0);
}

void cpumla_dequant(const cpumla_weight *w, int64_t r0, int64_t r1, float *out, int64_t ldo) {
    cpumla_enter(NULL);
    cpumla_ensure_init();
    for (int64_t r = r0; r < r1; r++) kern_dequant(&cpumla_k, w, r, 0, w->cols, out + (r - r0) * ldo);
    cpumla_leave(0);
}

/* ---- row-wise ops ----------------------------------------------------------------------------- */
typedef struct {
    const float *x;
    float *y;
    const float *x2;
    int64_t ldx, ldy, n_rows, dim, rows_per_task;
    const void *weight;
    int32_t wdtype;
    float eps;
} row_job;

static void rows_run(row_job *j, cpumla_task_fn fn) {
    int threads = cpumla_pool_threads();
    if (threads == 1 || j->n_rows * j->dim < MIN_PARALLEL_WORK) {
        j->rows_per_task = j->n_rows;
        fn(j, 0, 0);
        return;
    }
    j->rows_per_task = ceil_div(j->n_rows, 2 * threads);
    cpumla_pool_run(ceil_div(j->n_rows, j->rows_per_task), fn, j);
}

static void rmsnorm_task(void *p, int64_t t, int tid) {
    (void)tid;
    row_job *j = p;
    for (int64_t r = t * j->rows_per_task; r < min64((t + 1) * j->rows_per_task, j->n_rows); r++)
        cpumla_k.rmsnorm_row(j->x + r * j->ldx, j->y + r * j->ldy, j->dim, j->weight, j->wdtype, j->eps);
}

void cpumla_rmsnorm(const float *x, int64_t ldx, float *y, int64_t ldy, int64_t n_rows, int64_t dim,
                    const void *weight, int32_t weight_dtype, float eps) {
    cpumla_enter(NULL);
    cpumla_ensure_init();
    row_job j = {.x = x, .y = y, .ldx = ldx, .ldy = ldy, .n_rows = n_rows, .dim = dim, .weight = weight,
                 .wdtype = weight_dtype, .eps = eps};
    rows_run(&j, rmsnorm_task);
    cpumla_leave(0);
}

static void swiglu_task(void *p, int64_t t, int tid) {
    (void)tid;
    row_job *j = p;
    for (int64_t r = t * j->rows_per_task; r < min64((t + 1) * j->rows_per_task, j->n_rows); r++)
        cpumla_k.swiglu_row(j->x + r * j->ldx, j->x2 + r * j->ldx, j->y + r * j->ldy, j->dim, j->eps);
}

void cpumla_swiglu(const float *gate, const float *up, int64_t ld_in, float *out, int64_t ld_out,
                   int64_t n_rows, int64_t dim, float limit) {
    cpumla_enter(NULL);
    cpumla_ensure_init();
    row_job j = {.x = gate, .x2 = up, .y = out, .ldx = ld_in, .ldy = ld_out, .n_rows = n_rows, .dim = dim,
                 .eps = limit};
    rows_run(&j, swiglu_task);
    cpumla_leave(0);
}

static void softmax_task(void *p, int64_t t, int tid) {
    (void)tid;
    row_job *j = p;
    for (int64_t r = t * j->rows_per_task; r < min64((t + 1) * j->rows_per_task, j->n_rows); r++)
        cpumla_k.softmax_row(j->y + r * j->ldy, j->dim);
}

void cpumla_softmax(float *x, int64_t n_rows, int64_t ld, int64_t n) {
    cpumla_enter(NULL);
    cpumla_ensure_init();
    row_job j = {.y = x, .ldy = ld, .n_rows = n_rows, .dim = n};
    rows_run(&j, softmax_task);
    cpumla_leave(0);
}

/* Portable: cos/sin of one token's angles once, applied to each head. rope_dim/2 angles. */
void cpumla_rope(float *x, int64_t n_rows, int64_t ld_row, int64_t n_heads, int64_t ld_head,
                 int64_t offset, int64_t rope_dim, const int64_t *pos, const float *inv_freq,
                 float attn_scale, int32_t mode) {
    int64_t half = rope_dim / 2;
    int half_split = (mode & CPUMLA_ROPE_HALF) != 0;
    float sign = (mode & CPUMLA_ROPE_INVERSE) ? -1.0f : 1.0f;
    float cs[512], sn[512];
    for (int64_t t = 0; t < n_rows; t++) {
        for (int64_t i0 = 0; i0 < half; i0 += 512) {
            int64_t i1 = min64(i0 + 512, half);
            for (int64_t i = i0; i < i1; i++) {
                float ang = (float)pos[t] * inv_freq[i];
                cs[i - i0] = cosf(ang) * attn_scale;
                sn[i - i0] = sign * sinf(ang) * attn_scale;
            }
            for (int64_t h = 0; h < n_heads; h++) {
                float *v = x + t * ld_row + h * ld_head + offset;
                for (int64_t i = i0; i < i1; i++) {
                    int64_t a = half_split ? i : 2 * i, b = half_split ? i + half : 2 * i + 1;
                    float x0 = v[a], x1 = v[b], c = cs[i - i0], s = sn[i - i0];
                    v[a] = x0 * c - x1 * s;
                    v[b] = x1 * c + x0 * s;
                }
            }
        }
    }
}

/* ---- top-k (portable) ------------------------------------------------------------------------- */
/* a ranks above b: larger value, NaN lowest, equal values by lower index */
static int ranks_above(float va, int32_t ia, float vb, int32_t ib) {
    if (isnan(va)) return isnan(vb) && ia < ib;
    if (isnan(vb)) return 1;
    return va > vb || (va == vb && ia < ib);
}

/* Keeps the best k seen so far in idx/val, sorted; insertion is O(k) but only happens for values
 * that beat the current k-th, so typical routing (n <= 384, k <= 8) costs ~n comparisons. */
void cpumla_topk(const float *x, int64_t n, int64_t k, int32_t *idx, float *val) {
    if (k > n) {
        for (int64_t i = n; i < k; i++) { idx[i] = -1; val[i] = -INFINITY; }
        k = n;
    }
    int64_t have = 0;
    for (int64_t i = 0; i < n; i++) {
        float v = x[i];
        if (have == k && !ranks_above(v, (int32_t)i, val[k - 1], idx[k - 1])) continue;
        int64_t p = have < k ? have++ : k - 1;
        while (p > 0 && ranks_above(v, (int32_t)i, val[p - 1], idx[p - 1])) {
            val[p] = val[p - 1];
            idx[p] = idx[p - 1];
            p--;
        }
        val[p] = v;
        idx[p] = (int32_t)i;
    }
}
