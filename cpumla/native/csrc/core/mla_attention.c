/* mla_attention.c: MLA attention in the absorbed form (cpumla_mla_attention, mla_attention.h: decode and
 * short prefill chunks against the latent cache) and the cache store (cpumla_cache_store). Splits
 * each call over the thread pool by query, head block and KV split and calls the chosen level's
 * attn_part and cache_row (kernels.h), between cpumla_enter(NULL) and cpumla_leave (context.c). The
 * un-absorbed form is in mla_mha.c. */
#include <float.h>
#include <math.h>
#include <string.h>
#include "core/common.h"
#include "core/dispatch.h"
#include "core/threadpool.h"

static int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
static int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* ---- latent cache ------------------------------------------------------------------------------ */
int cpumla_cache_store(void *cache, int32_t cache_dtype, int64_t ld_cache, const float *src,
                       int64_t ld_src, int64_t n, int64_t width, const int64_t *slots) {
    if (cache_dtype != CPUMLA_F32 && cache_dtype != CPUMLA_BF16) {
        cpumla_set_error("cache_store: the cache must be F32 or BF16");
        return -1;
    }
    cpumla_enter(NULL);
    cpumla_ensure_init();
    size_t esz = cache_dtype == CPUMLA_BF16 ? 2 : 4;
    for (int64_t t = 0; t < n; t++) {
        if (slots[t] < 0) continue;
        cpumla_k.cache_row((uint8_t *)cache + (size_t)slots[t] * (size_t)ld_cache * esz, cache_dtype,
                           src + t * ld_src, width);
    }
    return cpumla_leave(0);
}

/* Work split: (query, head block, KV split). Each part writes (acc, m, l) for its heads; a second
 * pass merges the splits with log-sum-exp and the sink, and normalises. With one split the part is
 * merged straight away by the task that computed it. */
typedef struct {
    const cpumla_attn_args *a;
    int64_t head_block, n_hblocks, n_splits, split_len;
    float *parts;          /* [n_q, n_hblocks, n_splits, head_block, dv + 2] */
} attn_job;

static int64_t attn_count(const cpumla_attn_args *a, int64_t qi) {
    int64_t c = a->kv_len ? a->kv_len[qi] : a->n_kv;
    if (!a->kv_idx && c > a->n_kv) c = a->n_kv;
    return c < 0 ? 0 : c;
}

static float *part_at(const attn_job *j, int64_t qi, int64_t hb, int64_t s) {
    size_t per = (size_t)j->head_block * (size_t)(j->a->dv + 2);
    return j->parts + (((size_t)qi * j->n_hblocks + hb) * j->n_splits + s) * per;
}

/* Merge the splits of (qi, heads of block hb) into out / lse. */
static void attn_merge(const attn_job *j, int64_t qi, int64_t hb) {
    const cpumla_attn_args *a = j->a;
    int64_t dv = a->dv, h0 = hb * j->head_block, h1 = min64(h0 + j->head_block, a->n_heads);
    for (int64_t h = h0; h < h1; h++) {
        int64_t k = h - h0;
        float M = a->sinks ? a->sinks[h] : -INFINITY;
        int nan = isnan(M);                   /* a NaN sink */
        for (int64_t s = 0; s < j->n_splits; s++) {
            const float *p = part_at(j, qi, hb, s);
            float m = p[j->head_block * dv + k], l = p[j->head_block * dv + j->head_block + k];
            nan |= isnan(m) || isnan(l);       /* a NaN score: NaN out, never the zeros of "no entry" */
            M = m > M ? m : M;
        }
        float *o = a->out + qi * a->ldo_t + h * a->ldo_h;
        if (nan) {
            for (int64_t d = 0; d < dv; d++) o[d] = NAN;
            if (a->lse) a->lse[qi * a->n_heads + h] = NAN;
            continue;
        }
        for (int64_t d = 0; d < dv; d++) o[d] = 0.0f;
        float L = 0.0f;
        if (M != -INFINITY) {
            if (a->sinks) L = expf(a->sinks[h] - M);
            for (int64_t s = 0; s < j->n_splits; s++) {
                const float *p = part_at(j, qi, hb, s);
                float m = p[j->head_block * dv + k], l = p[j->head_block * dv + j->head_block + k];
                if (m == -INFINITY) continue;
                float c = expf(m - M);
                L += l * c;
                const float *acc = p + k * dv;
                for (int64_t d = 0; d < dv; d++) o[d] += c * acc[d];
            }
            if (L > 0.0f) {
                float inv = 1.0f / L;
                for (int64_t d = 0; d < dv; d++) o[d] *= inv;
            }
        }
        if (a->lse) a->lse[qi * a->n_heads + h] = M == -INFINITY ? -INFINITY : M + logf(L);
    }
}

static void attn_part_task(void *p, int64_t t, int tid) {
    (void)tid;
    attn_job *j = p;
    const cpumla_attn_args *a = j->a;
    int64_t s = t % j->n_splits, rest = t / j->n_splits;
    int64_t hb = rest % j->n_hblocks, qi = rest / j->n_hblocks;
    int64_t count = attn_count(a, qi);
    int64_t j0 = min64(s * j->split_len, count), j1 = min64(j0 + j->split_len, count);
    int64_t h0 = hb * j->head_block, h1 = min64(h0 + j->head_block, a->n_heads);
    float *part = part_at(j, qi, hb, s);
    cpumla_k.attn_part(a, qi, h0, h1, j0, j1, part, part + j->head_block * a->dv,
                       part + j->head_block * a->dv + j->head_block);
    if (j->n_splits == 1) attn_merge(j, qi, hb);
}

static void attn_merge_task(void *p, int64_t t, int tid) {
    (void)tid;
    attn_job *j = p;
    attn_merge(j, t / j->n_hblocks, t % j->n_hblocks);
}

static void mla_attention(const cpumla_attn_args *a) {
    if (a->n_q <= 0 || a->n_heads <= 0) return;
    int threads = cpumla_pool_threads();
    attn_job j = {.a = a};
    j.head_block = a->n_heads <= 16 ? a->n_heads : 16;
    j.n_hblocks = ceil_div(a->n_heads, j.head_block);
    int64_t longest = 0;
    for (int64_t qi = 0; qi < a->n_q; qi++) longest = attn_count(a, qi) > longest ? attn_count(a, qi) : longest;
    /* enough KV splits that one query feeds every thread (~4 tasks each), splits of >= 64 entries */
    int64_t base = a->n_q * j.n_hblocks;
    j.n_splits = base >= 4 * threads ? 1 : ceil_div(4 * threads, base);
    j.n_splits = min64(j.n_splits, ceil_div(longest > 0 ? longest : 1, 64));
    if (j.n_splits < 1) j.n_splits = 1;
    j.split_len = ceil_div(longest > 0 ? longest : 1, j.n_splits);
    size_t bytes = sizeof(float) * (size_t)a->n_q * (size_t)j.n_hblocks * (size_t)j.n_splits *
                   (size_t)j.head_block * (size_t)(a->dv + 2);
    j.parts = cpumla_scratch(CPUMLA_SCRATCH_ATTN, bytes);
    if (!j.parts) return;
    int64_t tasks = base * j.n_splits;
    int work_small = threads == 1 || tasks == 1;
    if (work_small) {
        for (int64_t t = 0; t < tasks; t++) attn_part_task(&j, t, 0);
    } else {
        cpumla_pool_run(tasks, attn_part_task, &j);
    }
    if (j.n_splits > 1) {
        if (work_small) for (int64_t t = 0; t < base; t++) attn_merge_task(&j, t, 0);
        else cpumla_pool_run(base, attn_merge_task, &j);
    }
}

int cpumla_mla_attention(const cpumla_attn_args *a) {
    cpumla_enter(NULL);
    cpumla_ensure_init();
    mla_attention(a);
    return cpumla_leave(0);
}
