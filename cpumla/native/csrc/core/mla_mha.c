/* mla_mha.c: MLA attention in the un-absorbed form (cpumla_mla_mha, mla_attention.h), the prefill side of
 * DeepSeek's attention. Portable orchestration: the products run on the table's gemm (kern_gemm,
 * kernels.h) and the softmax on its softmax_block entry, so every level brings its own speed.
 *
 * W_UK and W_UV are kv_b's rows of the head, or (kv_b NULL) the head's rows of k_b (W_UK transposed) and
 * v_b, dequantized once a task to fp32 in kv_b's layout [dn + dv][rank] (its scratch): the products
 * are then kv_b's F32 ones, and a GGUF file's split pair is never copied whole.
 *
 * The cached rows go in spans of MHA_SPAN: where the table multiplies bf16 directly (gemm_xb) and
 * kv_b is BF16, a span's latents are first rounded to bf16 once for every head (one pool job), as
 * gemm would round them per call. Then one task per head (and per query range when there are fewer
 * heads than twice the threads) walks the span's rows its queries see in blocks of MHA_KB:
 *   1. K = [W_UK c_j | k_pe_j] [nk, dk] and V = W_UV c_j [nk, dv] by two products over the block's
 *      latents (BF16 rows are widened first), V transposed to [dv, nk] for the second product;
 *   2. per query block of MHA_QB: S = Q K^T (gemm with K as an fp32 weight), one softmax_block step
 *      per query (its causal length masks the block's tail), then O = c O + P V (gemm with V^T).
 * O accumulates in the caller's out rows, the softmax state (m, l) per head and query in the job, and
 * the last span divides O by l. Scratch per thread: the block's keys, values and scores,
 * O(MHA_KB * (rank + dk + 2 dv + MHA_QB)) floats (with k_b / v_b the head's (dn + dv) * rank more);
 * shared: m and l, and a span's bf16 latents.
 *
 * R=rank P=rope_dim dk=dn+P H=heads nk=rows in a block */
#include <math.h>
#include <stdio.h>
#include <string.h>
#include "core/common.h"
#include "core/dispatch.h"
#include "core/threadpool.h"

#define MHA_KB 256          /* latent rows per block */
#define MHA_QB 256          /* queries per score block */
#define MHA_SPAN 4096       /* latent rows per span (bounds the bf16 copy) */
#define MHA_MIN_QUERIES 64  /* fewest queries a task takes when queries are split too */

static int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
static int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }
static int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
static int64_t pad16(int64_t n) { return (n + 15) & ~(int64_t)15; }

typedef struct {
    const cpumla_mla_mha_args *a;
    int64_t q_tasks, q_per_task;
    int64_t j_begin, j_end, n_rows;   /* this span's rows; rows of the whole call */
    const uint16_t *xb;               /* the span's latents in bf16 [j_end - j_begin][ldb], or NULL */
    int64_t ldb;
    float *m, *l;                     /* [H][n_q] softmax state */
} mha_job;

/* rows query i sees */
static int64_t visible(const cpumla_mla_mha_args *a, int64_t i) {
    int64_t c = a->kv_len ? a->kv_len[i] : a->n_kv;
    return c < 0 ? 0 : min64(c, a->n_kv);
}

static float latent_at(const cpumla_mla_mha_args *a, int64_t j, int64_t d) {
    return a->kv_dtype == CPUMLA_BF16 ? bf16_to_f32(((const uint16_t *)a->kv)[j * a->ld_kv + d])
                                      : ((const float *)a->kv)[j * a->ld_kv + d];
}

static cpumla_weight f32_rows(const float *data, int64_t rows, int64_t cols, int64_t ld) {
    cpumla_weight w;
    memset(&w, 0, sizeof w);
    w.data = data;
    w.rows = rows;
    w.cols = cols;
    w.row_bytes = ld * (int64_t)sizeof(float);
    w.dtype = CPUMLA_F32;
    return w;
}

/* rows [r0, r1) of kv (kv_b, or a head's rows in its layout) times latent rows [j0, j0 + nk) -> y [nk][ldy] */
static void kv_b_rows(const mha_job *job, const cpumla_weight *kv, int64_t j0, int64_t nk, float *lat, int64_t r0,
                      int64_t r1, float *y, int64_t ldy) {
    const cpumla_mla_mha_args *a = job->a;
    if (job->xb) {
        cpumla_k.gemm_xb(kv, job->xb + (j0 - job->j_begin) * job->ldb, job->ldb, nk, y, ldy, r0, r1);
    } else if (a->kv_dtype == CPUMLA_BF16) {
        kern_gemm(&cpumla_k, kv, lat, pad16(a->rank), nk, y, ldy, r0, r1);
    } else {
        kern_gemm(&cpumla_k, kv, (const float *)a->kv + j0 * a->ld_kv, a->ld_kv, nk, y, ldy, r0, r1);
    }
}

/* Head h's W_UK and W_UV from k_b and v_b in fp32, laid out as kv_b's rows of the head: uk [dn + dv][rank]
 * (row d < dn: W_UK row d, column r of k_b's row h * rank + r; then v_b's rows). tmp: SPLIT_RB * dn floats
 * (k_b's rows SPLIT_RB at a time, so that the transposed stores fill whole lines). */
#define SPLIT_RB 16
static void split_head(const cpumla_mla_mha_args *a, int64_t h, float *uk, float *tmp) {
    const int64_t R = a->rank, dn = a->dn, dv = a->dv;
    for (int64_t r0 = 0; r0 < R; r0 += SPLIT_RB) {
        const int64_t nr = min64(SPLIT_RB, R - r0);
        for (int64_t i = 0; i < nr; i++) kern_dequant(&cpumla_k, a->k_b, h * R + r0 + i, 0, dn, tmp + i * dn);
        for (int64_t d = 0; d < dn; d++)
            for (int64_t i = 0; i < nr; i++) uk[d * R + r0 + i] = tmp[i * dn + d];
    }
    for (int64_t d = 0; d < dv; d++) kern_dequant(&cpumla_k, a->v_b, h * dv + d, 0, R, uk + (dn + d) * R);
}

/* Keys [nk, dk] and transposed values [dv, MHA_KB] of head h for latent rows [j0, j0 + nk): the head's
 * rows of kv from r0. */
static void decompress(const mha_job *job, const cpumla_weight *kv, int64_t r0, int64_t j0, int64_t nk, float *lat,
                       float *k, float *v, float *vt) {
    const cpumla_mla_mha_args *a = job->a;
    const int64_t R = a->rank, P = a->rope_dim, dn = a->dn, dv = a->dv, dk = dn + P;
    if (!job->xb && a->kv_dtype == CPUMLA_BF16)
        for (int64_t j = 0; j < nk; j++)
            for (int64_t d = 0; d < R; d++) lat[j * pad16(R) + d] = latent_at(a, j0 + j, d);
    kv_b_rows(job, kv, j0, nk, lat, r0, r0 + dn, k, dk);
    for (int64_t j = 0; j < nk; j++)
        for (int64_t p = 0; p < P; p++) k[j * dk + dn + p] = latent_at(a, j0 + j, R + p);
    kv_b_rows(job, kv, j0, nk, lat, r0 + dn, r0 + dn + dv, v, dv);
    for (int64_t jb = 0; jb < nk; jb += 16)          /* 16 rows at a time: reads stay in L1 */
        for (int64_t d = 0; d < dv; d++)
            for (int64_t j = jb; j < min64(jb + 16, nk); j++) vt[d * MHA_KB + j] = v[j * dv + d];
}

static void mha_task(void *p, int64_t t, int tid) {
    (void)tid;
    const mha_job *job = p;
    const cpumla_mla_mha_args *a = job->a;
    const int64_t h = t / job->q_tasks, qa = (t % job->q_tasks) * job->q_per_task;
    const int64_t qb = min64(qa + job->q_per_task, a->n_q);
    if (qb <= qa) return;
    const int64_t R = a->rank, dn = a->dn, dv = a->dv, dk = dn + a->rope_dim;
    const int64_t lat_floats = !job->xb && a->kv_dtype == CPUMLA_BF16 ? pad16(MHA_KB * pad16(R)) : 0;
    const int64_t uk_floats = a->kv_b ? 0 : pad16((dn + dv) * R) + pad16(SPLIT_RB * dn);
    size_t floats = (size_t)(lat_floats + pad16(MHA_KB * dk) + 2 * pad16(MHA_KB * dv) + pad16(MHA_QB * MHA_KB) +
                             pad16(MHA_QB * dv) + pad16(MHA_QB) + uk_floats);
    float *lat = cpumla_scratch(CPUMLA_SCRATCH_MHA, floats * sizeof(float));
    if (!lat) return;
    float *k = lat + lat_floats, *v = k + pad16(MHA_KB * dk), *vt = v + pad16(MHA_KB * dv);
    float *s = vt + pad16(MHA_KB * dv), *pv = s + pad16(MHA_QB * MHA_KB), *c = pv + pad16(MHA_QB * dv);
    float *uk = c + pad16(MHA_QB);                  /* the split pair: this head's rows in kv_b's layout */
    cpumla_weight head = f32_rows(uk, dn + dv, R, R);
    const cpumla_weight *kv = a->kv_b ? a->kv_b : &head;
    const int64_t r0 = a->kv_b ? h * (dn + dv) : 0;
    float *m = job->m + h * a->n_q, *l = job->l + h * a->n_q;
    int64_t kmax = 0;
    for (int64_t i = qa; i < qb; i++) {
        kmax = max64(kmax, visible(a, i));
        if (job->j_begin > 0) continue;
        m[i] = -INFINITY;
        l[i] = 0.0f;
        memset(a->out + i * a->ldo_t + h * a->ldo_h, 0, sizeof(float) * (size_t)dv);
    }
    if (!a->kv_b && job->j_begin < min64(kmax, job->j_end))
        split_head(a, h, uk, uk + pad16((dn + dv) * R));
    for (int64_t j0 = job->j_begin; j0 < min64(kmax, job->j_end); j0 += MHA_KB) {
        const int64_t nk = min64(MHA_KB, min64(kmax, job->j_end) - j0);
        decompress(job, kv, r0, j0, nk, lat, k, v, vt);
        for (int64_t q0 = qa; q0 < qb; q0 += MHA_QB) {
            int64_t s0 = q0, q1 = min64(q0 + MHA_QB, qb), ne = 0;
            while (s0 < q1 && visible(a, s0) <= j0) s0++;            /* causal: nothing to see yet */
            for (int64_t i = s0; i < q1; i++) ne = max64(ne, min64(visible(a, i) - j0, nk));
            if (ne <= 0) continue;
            cpumla_weight kw = f32_rows(k, ne, dk, dk), vw = f32_rows(vt, dv, ne, MHA_KB);
            kern_gemm(&cpumla_k, &kw, a->q + s0 * a->ldq_t + h * a->ldq_h, a->ldq_t, q1 - s0, s, MHA_KB, 0, ne);
            for (int64_t i = s0; i < q1; i++) {
                int64_t valid = max64(0, min64(visible(a, i) - j0, ne));
                c[i - s0] = cpumla_k.softmax_block(s + (i - s0) * MHA_KB, ne, valid, a->scale, &m[i], &l[i]);
            }
            kern_gemm(&cpumla_k, &vw, s, MHA_KB, q1 - s0, pv, dv, 0, dv);
            for (int64_t i = s0; i < q1; i++) {
                float *o = a->out + i * a->ldo_t + h * a->ldo_h, ci = c[i - s0];
                const float *add = pv + (i - s0) * dv;
                for (int64_t d = 0; d < dv; d++) o[d] = o[d] * ci + add[d];
            }
        }
    }
    if (job->j_end < job->n_rows) return;
    for (int64_t i = qa; i < qb; i++) {
        float li = l[i], *o = a->out + i * a->ldo_t + h * a->ldo_h;
        if (li == 0.0f) continue;                   /* nothing seen: zeros */
        float inv = 1.0f / li;
        for (int64_t d = 0; d < dv; d++) o[d] *= inv;
    }
}

/* rows of the span [j_begin, j_end) to bf16, MHA_KB at a time */
static void to_bf16_task(void *p, int64_t t, int tid) {
    (void)tid;
    const mha_job *job = p;
    const cpumla_mla_mha_args *a = job->a;
    uint16_t *xb = (uint16_t *)job->xb;
    const int64_t R = a->rank, j0 = job->j_begin + t * MHA_KB, j1 = min64(j0 + MHA_KB, job->j_end);
    for (int64_t j = j0; j < j1; j++) {
        uint16_t *o = xb + (j - job->j_begin) * job->ldb;
        if (a->kv_dtype == CPUMLA_BF16)
            memcpy(o, (const uint16_t *)a->kv + j * a->ld_kv, sizeof(uint16_t) * (size_t)R);
        else
            cpumla_k.cache_row(o, CPUMLA_BF16, (const float *)a->kv + j * a->ld_kv, R);
        memset(o + R, 0, sizeof(uint16_t) * (size_t)(job->ldb - R));
    }
}

static void run(int threads, int64_t tasks, cpumla_task_fn fn, mha_job *job) {
    if (tasks <= 0) return;
    if (threads == 1 || tasks == 1) {
        for (int64_t t = 0; t < tasks; t++) fn(job, t, 0);
    } else {
        cpumla_pool_run(tasks, fn, job);
    }
}

static void mla_mha(const cpumla_mla_mha_args *a) {
    int threads = cpumla_pool_threads();
    mha_job job = {.a = a, .q_tasks = 1, .q_per_task = a->n_q};
    if (threads > 1 && a->n_heads < 2 * threads) {      /* few heads: split queries too */
        job.q_tasks = min64(ceil_div(2 * threads, a->n_heads), max64(1, a->n_q / MHA_MIN_QUERIES));
        job.q_per_task = ceil_div(a->n_q, job.q_tasks);
    }
    for (int64_t i = 0; i < a->n_q; i++) job.n_rows = max64(job.n_rows, visible(a, i));
    job.m = cpumla_scratch(CPUMLA_SCRATCH_MHA_STATE, sizeof(float) * (size_t)(2 * a->n_heads * a->n_q));
    if (!job.m) return;
    job.l = job.m + a->n_heads * a->n_q;
    int64_t span = job.n_rows;
    if (cpumla_k.gemm_xb && a->kv_b && a->kv_b->dtype == CPUMLA_BF16) {
        span = min64(span, MHA_SPAN);
        job.ldb = (a->rank + 31) & ~(int64_t)31;
        job.xb = cpumla_scratch(CPUMLA_SCRATCH_MHA_XB, sizeof(uint16_t) * (size_t)(max64(span, 1) * job.ldb));
        if (!job.xb) return;
    }
    /* one pass over no rows at all still zeroes the outputs */
    for (job.j_begin = 0; job.j_begin == 0 || job.j_begin < job.n_rows; job.j_begin += span) {
        job.j_end = min64(job.j_begin + span, job.n_rows);
        if (job.xb) run(threads, ceil_div(job.j_end - job.j_begin, MHA_KB), to_bf16_task, &job);
        run(threads, a->n_heads * job.q_tasks, mha_task, &job);
        if (span <= 0) break;
    }
}

static int bad(const char *msg) {
    char buf[200];
    snprintf(buf, sizeof buf, "mla_mha: %s", msg);
    cpumla_set_error(buf);
    return -1;
}

int cpumla_mla_mha(const cpumla_mla_mha_args *a) {
    if (!a || (!a->kv_b && (!a->k_b || !a->v_b))) return bad("no arguments, or neither kv_b nor k_b and v_b");
    if (a->kv_dtype != CPUMLA_F32 && a->kv_dtype != CPUMLA_BF16) return bad("the latent rows must be F32 or BF16");
    if (a->n_q < 0 || a->n_heads < 0 || a->n_kv < 0 || a->rank < 1 || a->rope_dim < 0 || a->dn < 0 || a->dv < 1)
        return bad("negative counts, or no rank or value width");
    if (a->ld_kv < a->rank + a->rope_dim) return bad("latent rows are narrower than rank + rope_dim");
    if (a->kv_b && (a->kv_b->cols != a->rank || a->kv_b->rows < a->n_heads * (a->dn + a->dv)))
        return bad("kv_b must have rank columns and n_heads * (dn + dv) rows");
    if (!a->kv_b && (a->k_b->cols != a->dn || a->k_b->rows < a->n_heads * a->rank))
        return bad("k_b must have dn columns and n_heads * rank rows");
    if (!a->kv_b && (a->v_b->cols != a->rank || a->v_b->rows < a->n_heads * a->dv))
        return bad("v_b must have rank columns and n_heads * dv rows");
    cpumla_enter(NULL);
    cpumla_ensure_init();
    if (a->n_q > 0 && a->n_heads > 0) mla_mha(a);
    return cpumla_leave(0);
}
