/* context.c: scratch contexts (cpumla_ctx) and the library lock (cpumla_enter / cpumla_leave).
 *
 * A context owns one buffer per scratch slot (kernels.h) per pool thread, each grown as needed and
 * kept until cpumla_ctx_free. cpumla_enter takes the library lock (recursive for the calling thread)
 * and makes a context current; every public kernel brackets its work with cpumla_enter(NULL) ..
 * cpumla_leave, so a standalone call gets a temporary context and a call nested in one that entered
 * a context (a model's forward) uses that one. Only one thread is ever inside, so the current context
 * is a plain global that the pool's workers read (the pool publishes each job with release / acquire
 * ordering). */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include "core/common.h"
#include "core/dispatch.h"
#include "core/threadpool.h"

typedef struct { void *p; size_t cap; } scratch_buf;

struct cpumla_ctx {
    scratch_buf *bufs[CPUMLA_MAX_THREADS];    /* [tid] -> [CPUMLA_SCRATCH_COUNT], made by that thread */
    atomic_uint fails;                        /* scratch requests that failed, ever */
    int no_alloc;                             /* the stand-in used when a temporary one can't be made */
    pthread_mutex_t mu;                       /* guards msg */
    char msg[256];                            /* why the last request failed */
};

static const char *slot_names[CPUMLA_SCRATCH_COUNT] = {
    [CPUMLA_SCRATCH_X_BF16] = "gemm activations", [CPUMLA_SCRATCH_F32ACT] = "fp32-activation product",
    [CPUMLA_SCRATCH_ATTN] = "attention parts",    [CPUMLA_SCRATCH_ROUTE] = "routing",
    [CPUMLA_SCRATCH_MHA] = "un-absorbed MLA attention", [CPUMLA_SCRATCH_MHA_STATE] = "MLA softmax state",
    [CPUMLA_SCRATCH_MHA_XB] = "MLA latents in bf16",
    [CPUMLA_SCRATCH_MOE1] = "MoE decode",         [CPUMLA_SCRATCH_MOE] = "MoE prefill",
    [CPUMLA_SCRATCH_MOE_LIST] = "MoE token lists",
    [CPUMLA_SCRATCH_AVX2_XR] = "avx2 activations", [CPUMLA_SCRATCH_AVX512_XB] = "avx512 bf16 activations",
    [CPUMLA_SCRATCH_AVX512_E4_XS] = "avx512 e4m3 activations",
    [CPUMLA_SCRATCH_AVX512_E4_PANEL] = "avx512 e4m3 panel", [CPUMLA_SCRATCH_AVX512_GT] = "avx512 gemv_t sums",
    [CPUMLA_SCRATCH_AMX_PANEL] = "amx panel", [CPUMLA_SCRATCH_AMX_QX] = "amx activation tiles", [CPUMLA_SCRATCH_QX] = "quantized activations",
    [CPUMLA_SCRATCH_QX_JOB] = "a job's quantized activations", [CPUMLA_SCRATCH_GQP_PANEL] = "gguf panel",
    [CPUMLA_SCRATCH_GQP_QX] = "gguf panel activations",
};

cpumla_ctx *cpumla_ctx_new(void) {
    cpumla_ctx *c = calloc(1, sizeof *c);
    if (!c) return NULL;
    pthread_mutex_init(&c->mu, NULL);
    return c;
}

void cpumla_ctx_free(cpumla_ctx *ctx) {
    if (!ctx) return;
    for (int t = 0; t < CPUMLA_MAX_THREADS; t++) {
        if (!ctx->bufs[t]) continue;
        for (int s = 0; s < CPUMLA_SCRATCH_COUNT; s++) free(ctx->bufs[t][s].p);
        free(ctx->bufs[t]);
    }
    pthread_mutex_destroy(&ctx->mu);
    free(ctx);
}

/* ---- the lock and the current context ---------------------------------------------------------- */
#define MAX_DEPTH 64
typedef struct {
    cpumla_ctx *prev, *ctx;
    unsigned fails;          /* ctx->fails at the enter */
    int temp;                /* ctx is this level's own, freed at its leave */
} level;

static pthread_mutex_t lib_lock = PTHREAD_MUTEX_INITIALIZER;
static cpumla_ctx *current;                  /* read by pool workers; written only under lib_lock */
static size_t scratch_limit;                 /* CPUMLA_SCRATCH_LIMIT (test hook); 0: none */
static cpumla_ctx stand_in = {.no_alloc = 1, .mu = PTHREAD_MUTEX_INITIALIZER};
static __thread level levels[MAX_DEPTH];
static __thread int depth;

int cpumla_enter(cpumla_ctx *ctx) {
    if (depth == 0) {
        pthread_mutex_lock(&lib_lock);
        const char *lim = getenv("CPUMLA_SCRATCH_LIMIT");
        scratch_limit = lim && lim[0] ? (size_t)strtoull(lim, NULL, 10) : 0;
    }
    int d = depth++;
    if (d >= MAX_DEPTH) return 0;            /* deeper levels keep the current context */
    level *lv = &levels[d];
    lv->prev = current;
    lv->temp = 0;
    if (!ctx && d > 0 && current) {
        ctx = current;
    } else if (!ctx) {
        ctx = cpumla_ctx_new();
        lv->temp = ctx != NULL;
        if (!ctx) ctx = &stand_in;
    }
    lv->ctx = ctx;
    lv->fails = atomic_load(&ctx->fails);
    current = ctx;
    return 0;
}

int cpumla_leave(int rc) {
    if (depth == 0) {
        cpumla_set_error("cpumla_leave without a matching cpumla_enter");
        return -1;
    }
    int d = --depth;
    if (d < MAX_DEPTH) {
        level *lv = &levels[d];
        cpumla_ctx *c = lv->ctx;
        if (atomic_load(&c->fails) != lv->fails) {
            pthread_mutex_lock(&c->mu);
            cpumla_set_error(c->msg);
            pthread_mutex_unlock(&c->mu);
            rc = -1;
        }
        current = lv->prev;
        if (lv->temp) cpumla_ctx_free(c);
    }
    if (d == 0) pthread_mutex_unlock(&lib_lock);
    return rc;
}

/* ---- scratch ------------------------------------------------------------------------------------ */
static void *fail(cpumla_ctx *c, int slot, size_t bytes, const char *why) {
    pthread_mutex_lock(&c->mu);
    snprintf(c->msg, sizeof c->msg, "%s: %zu bytes of scratch for %s", why, bytes,
             slot >= 0 && slot < CPUMLA_SCRATCH_COUNT && slot_names[slot] ? slot_names[slot] : "?");
    pthread_mutex_unlock(&c->mu);
    atomic_fetch_add(&c->fails, 1);
    return NULL;
}

void *cpumla_scratch(int slot, size_t bytes) {
    cpumla_ctx *c = current;
    if (!c) {
        cpumla_set_error("scratch requested outside cpumla_enter");
        return NULL;
    }
    int tid = cpumla_pool_tid;
    if (slot < 0 || slot >= CPUMLA_SCRATCH_COUNT || tid < 0 || tid >= CPUMLA_MAX_THREADS)
        return fail(c, slot, bytes, "bad scratch request");
    if (scratch_limit && bytes > scratch_limit) return fail(c, slot, bytes, "over CPUMLA_SCRATCH_LIMIT");
    if (c->no_alloc) return fail(c, slot, bytes, "out of memory (no scratch context)");
    scratch_buf *row = c->bufs[tid];
    if (!row) {
        row = calloc(CPUMLA_SCRATCH_COUNT, sizeof *row);
        if (!row) return fail(c, slot, bytes, "out of memory");
        c->bufs[tid] = row;
    }
    scratch_buf *b = &row[slot];
    if (bytes <= b->cap && b->p) return b->p;
    free(b->p);
    size_t want = bytes + bytes / 4 + 4096;
    b->p = aligned_alloc(64, (want + 63) & ~(size_t)63);
    b->cap = b->p ? want : 0;
    if (!b->p) return fail(c, slot, bytes, "out of memory");
    return b->p;
}

void *cpumla_cache_alloc(size_t bytes) {
    const size_t huge = (size_t)2 << 20;
#ifdef MADV_HUGEPAGE
    if (bytes >= huge) {
        void *p = NULL;
        size_t rounded = (bytes + huge - 1) & ~(huge - 1);
        if (posix_memalign(&p, huge, rounded) != 0) return NULL;
        (void)madvise(p, rounded, MADV_HUGEPAGE);    /* a hint: 4 KiB pages if the kernel declines */
        return p;
    }
#endif
    return aligned_alloc(64, (bytes + 63) & ~(size_t)63);
}
