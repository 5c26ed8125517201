/* test_context.c: contexts, the library lock and failure as a value (cpumla_ctx_new / enter / leave,
 * CPUMLA_SCRATCH_LIMIT, two threads calling at once), and the pool's span jobs, run by test_api.c under
 * each implementation. */
#include <pthread.h>
#include <stdatomic.h>
#include <time.h>
#include "core/kernels.h"
#include "ref.h"
#include "core/threadpool.h"

/* ---- contexts, the library lock, failure as a value -------------------------------------------- */
/* cpumla_ctx_new / enter / leave / free nesting: which buffer cpumla_scratch hands out at each level */
static void test_ctx_nesting(void) {
    cpumla_ctx *c1 = cpumla_ctx_new(), *c2 = cpumla_ctx_new();
    check(c1 && c2 && c1 != c2, "cpumla_ctx_new");
    if (!c1 || !c2) { cpumla_ctx_free(c1); cpumla_ctx_free(c2); return; }
    case_begin();
    check(cpumla_enter(c1) == 0, "cpumla_enter(c1)");
    void *p1 = cpumla_scratch(CPUMLA_SCRATCH_MOE, 100);
    check(p1 && ((uintptr_t)p1 & 63) == 0, "scratch of c1: %p (64-byte aligned)", p1);
    check(cpumla_scratch(CPUMLA_SCRATCH_MOE, 50) == p1, "a smaller request reuses the buffer");
    check(cpumla_enter(c2) == 0, "cpumla_enter(c2) inside c1");
    void *p2 = cpumla_scratch(CPUMLA_SCRATCH_MOE, 100);
    check(p2 && p2 != p1, "c2 has its own scratch (%p vs %p)", p2, p1);
    cpumla_enter(NULL);
    check(cpumla_scratch(CPUMLA_SCRATCH_MOE, 100) == p2, "enter(NULL) inside keeps the current context");
    check(cpumla_leave(7) == 7, "leave returns rc");
    check(cpumla_leave(0) == 0, "leave c2");
    check(cpumla_scratch(CPUMLA_SCRATCH_MOE, 100) == p1, "leaving c2 makes c1 current again");
    float *big = cpumla_scratch(CPUMLA_SCRATCH_MOE, 1 << 20);
    check(big != NULL, "scratch grows");
    if (big) big[(1 << 18) - 1] = 1.0f;
    check(cpumla_leave(0) == 0, "leave c1");
    check(cpumla_leave(3) == -1 && strstr(cpumla_last_error(), "without"), "leave without enter is an error");
    cpumla_enter(NULL);                                     /* a temporary context, freed at its leave */
    check(cpumla_scratch(CPUMLA_SCRATCH_MOE, 100) != NULL, "scratch of a temporary context");
    check(cpumla_leave(0) == 0, "leave the temporary context");
    check(cpumla_scratch(CPUMLA_SCRATCH_MOE, 100) == NULL, "no scratch outside cpumla_enter");
    cpumla_enter(c1);                                       /* c1 kept its buffers */
    check(cpumla_scratch(CPUMLA_SCRATCH_MOE, 1 << 20) == big, "c1 keeps its buffers across enters");
    cpumla_leave(0);
    case_end();
    cpumla_ctx_free(c1);
    cpumla_ctx_free(c2);
    cpumla_ctx_free(NULL);
}

/* CPUMLA_SCRATCH_LIMIT: a scratch request above it fails, and the failure is the call's result */
static void test_scratch_failure(void) {
    tweight t = make_weight(64, 256, CPUMLA_BF16, 0, 0, 0, 0);
    int64_t n = 8;
    float *x = make_vec(n * 256, 1.0f), *y = xalloc(sizeof(float) * (size_t)(n * 64));
    float *q = make_vec(4 * 64, 1.0f), *kv = make_vec(32 * 64, 1.0f), *o = xalloc(sizeof(float) * 4 * 64);
    cpumla_attn_args a;
    memset(&a, 0, sizeof a);
    a.q = q; a.ldq_t = 4 * 64; a.ldq_h = 64; a.n_q = 1; a.n_heads = 4;
    a.kv = kv; a.kv_dtype = CPUMLA_F32; a.ld_kv = 64; a.n_kv = 32; a.dk = 64; a.dv = 64; a.scale = 0.125f;
    a.out = o; a.ldo_t = 4 * 64; a.ldo_h = 64;
    /* avx2, avx512 and amx round bf16 activations into scratch; scalar and neon kernels need none */
    int needs = strcmp(cpumla_isa(), "scalar") != 0 && strcmp(cpumla_isa(), "neon") != 0;
    case_begin();
    check(cpumla_gemm(&t.w, x, 256, n, y, 64) == 0 && cpumla_gemv(&t.w, x, y) == 0, "gemm/gemv before the limit: %s",
          cpumla_last_error());
    setenv("CPUMLA_SCRATCH_LIMIT", "16", 1);
    int rc = cpumla_gemm(&t.w, x, 256, n, y, 64);
    check(rc == (needs ? -1 : 0), "cpumla_gemm (bf16) under CPUMLA_SCRATCH_LIMIT=16 returned %d", rc);
    if (needs) check(strstr(cpumla_last_error(), "CPUMLA_SCRATCH_LIMIT") != NULL, "error: %s", cpumla_last_error());
    rc = cpumla_gemv(&t.w, x, y);
    check(rc == (needs ? -1 : 0), "cpumla_gemv (bf16) under the limit returned %d", rc);
    check(cpumla_mla_attention(&a) == -1 && strstr(cpumla_last_error(), "attention"),
          "cpumla_mla_attention must fail without its scratch: %s", cpumla_last_error());
    /* nested: the failure of an inner call is the outer level's too */
    cpumla_ctx *c = cpumla_ctx_new();
    cpumla_enter(c);
    check(cpumla_mla_attention(&a) == -1, "inner call fails");
    check(cpumla_leave(0) == -1, "the enclosing leave reports the failure");
    unsetenv("CPUMLA_SCRATCH_LIMIT");
    cpumla_enter(c);
    check(cpumla_mla_attention(&a) == 0, "the same context works once memory is there: %s", cpumla_last_error());
    check(cpumla_leave(0) == 0, "an earlier failure is not reported by a later enter's leave");
    cpumla_ctx_free(c);
    check(cpumla_gemm(&t.w, x, 256, n, y, 64) == 0, "gemm after the limit is lifted: %s", cpumla_last_error());
    case_end();
    free(x); free(y); free(q); free(kv); free(o);
    free_weight(&t);
}

/* Two threads calling at once: the lock runs their calls one after the other, each on its own
 * temporary scratch, and every result equals the one computed alone. */
typedef struct { const cpumla_weight *w; const float *x; int64_t n, rows; const float *want; int bad, calls; } hammer_arg;

static void *hammer(void *p) {
    hammer_arg *h = p;
    float *y = xalloc(sizeof(float) * (size_t)(h->n * h->rows));
    for (int it = 0; it < 40; it++) {
        if (cpumla_gemm(h->w, h->x, h->w->cols, h->n, y, h->rows) != 0) { h->bad++; continue; }
        h->calls++;
        if (memcmp(y, h->want, sizeof(float) * (size_t)(h->n * h->rows))) h->bad++;
    }
    free(y);
    return NULL;
}

static void test_threads(void) {
    tweight t1 = make_weight(96, 320, CPUMLA_BF16, 0, 0, 0, 0), t2 = make_weight(200, 130, CPUMLA_E4M3, CPUMLA_F32, 128, 128, 0);
    float *x1 = make_vec(7 * 320, 1.0f), *x2 = make_vec(3 * 130, 1.0f);
    float *w1 = xalloc(sizeof(float) * 7 * 96), *w2 = xalloc(sizeof(float) * 3 * 200);
    cpumla_gemm(&t1.w, x1, 320, 7, w1, 96);
    cpumla_gemm(&t2.w, x2, 130, 3, w2, 200);
    hammer_arg a1 = {&t1.w, x1, 7, 96, w1, 0, 0}, a2 = {&t2.w, x2, 3, 200, w2, 0, 0};
    pthread_t th;
    int started = pthread_create(&th, NULL, hammer, &a1) == 0;
    hammer(&a2);
    if (started) pthread_join(th, NULL);
    check(started && a1.bad == 0 && a2.bad == 0 && a1.calls == 40 && a2.calls == 40,
          "two threads calling cpumla_gemm at once: %d and %d bad results", a1.bad, a2.bad);
    free(x1); free(x2); free(w1); free(w2);
    free_weight(&t1); free_weight(&t2);
}

/* cpumla_pool_run_spans: every task runs once; a thread takes the tasks of its own span in order from
 * its front; a thread held up in its first task has the rest of its span taken from the back by the
 * others. */
enum { SPAN_MAX = 1000 };
typedef struct {
    atomic_int runs[SPAN_MAX];
    int tid_of[SPAN_MAX];
    atomic_int seq;
    int order[SPAN_MAX];          /* order[task]: when it started, over the whole job */
    int64_t slow_task;            /* this task sleeps 10 ms (-1: none) */
} span_log;

static void span_task(void *p, int64_t t, int tid) {
    span_log *l = p;
    l->order[t] = atomic_fetch_add(&l->seq, 1);
    l->tid_of[t] = tid;
    if (t == l->slow_task) nanosleep(&(struct timespec){0, 10000000}, NULL);
    atomic_fetch_add(&l->runs[t], 1);
}

static void test_pool_spans(void) {
    static span_log l;
    const int T = cpumla_pool_threads();
    const int64_t sizes[] = {1, 2, 3, 4, 5, 7, 64, SPAN_MAX};
    for (int slow = 0; slow < 2; slow++)
        for (size_t si = 0; si < sizeof sizes / sizeof sizes[0]; si++) {
            const int64_t n = sizes[si];
            if (slow && n / T < 8) continue;
            memset(&l, 0, sizeof l);
            l.slow_task = slow ? 0 : -1;
            case_begin();
            cpumla_pool_run_spans(n, span_task, &l);
            int once = 1, in_order = 1, stolen = 0;
            for (int64_t t = 0; t < n; t++) once &= atomic_load(&l.runs[t]) == 1;
            for (int s = 0; s < T; s++) {
                const int64_t f = n * s / T, b = n * (s + 1) / T;
                /* the owner's tasks of its span: a prefix of it, started in order */
                int64_t prev = -1, owned = 0;
                for (int64_t t = f; t < b; t++) {
                    if (l.tid_of[t] != s) continue;
                    in_order &= t == f + owned && (prev < 0 || l.order[t] > l.order[prev]);
                    prev = t;
                    owned++;
                }
                if (s == 0) stolen = (int)(b - f - owned);
            }
            check(once, "pool spans, %lld tasks on %d threads: every task once", (long long)n, T);
            check(T == 1 || n == 1 || in_order, "pool spans, %lld tasks on %d threads: each thread takes its own span "
                  "front to back", (long long)n, T);
            /* thread 0 sleeps in task 0: the others finish their spans and take the rest of span 0 */
            if (slow && T > 1)
                check(stolen >= n / T - 2, "pool spans, %lld tasks on %d threads, thread 0 held up: %d of its "
                      "%lld tasks taken by the others", (long long)n, T, stolen, (long long)(n / T));
            case_end();
        }
}

/* cpumla_span_pieces / cpumla_span_piece: the pieces of all threads' spans cover the units once, in
 * order, cut at multiples of align; within a span each piece is at most about half of what is left,
 * and the last one about the tail (or the fewest units a cut allows). */
static void test_span_pieces(void) {
    const int64_t units[] = {1, 7, 8, 9, 64, 1000, 1408 * 12, 102400};
    const int64_t unit_bytes[] = {1, 1152, 2176, 1 << 20};
    const int threads[] = {1, 2, 3, 8};
    const int64_t aligns[] = {1, 8};
    for (size_t ui = 0; ui < sizeof units / sizeof units[0]; ui++)
        for (size_t bi = 0; bi < sizeof unit_bytes / sizeof unit_bytes[0]; bi++)
            for (size_t ti = 0; ti < sizeof threads / sizeof threads[0]; ti++)
                for (size_t ai = 0; ai < sizeof aligns / sizeof aligns[0]; ai++) {
                    const int64_t n = units[ui], ub = unit_bytes[bi], al = aligns[ai];
                    const int T = threads[ti];
                    const int64_t k = cpumla_span_pieces(n, ub, al, T);
                    case_begin();
                    int64_t at = 0;
                    int ok = k >= 1 && k <= 24, halves = 1, tail = 1;
                    for (int64_t t = 0; ok && t < k * T; t++) {
                        int64_t u0, u1;
                        cpumla_span_piece(n, k, al, T, t, &u0, &u1);
                        ok &= u0 == at && u1 >= u0 && (u1 == n || u1 % al == 0);
                        at = u1;
                        if (t % k == 0) continue;
                        /* the span's end: where the last piece of this span ends */
                        int64_t e0, e1;
                        cpumla_span_piece(n, k, al, T, t - t % k + k - 1, &e0, &e1);
                        halves &= u1 - u0 <= (e1 - u0 + 1) / 2 + al || t % k == k - 1;
                        if (t % k == k - 1)
                            tail &= (u1 - u0) * ub <= CPUMLA_SPAN_TAIL + al * ub || u1 - u0 <= 3 * al || k == 24;
                    }
                    ok &= at == n;
                    check(ok, "span pieces: %lld units, %d threads, align %lld: %lld pieces a span cover them "
                          "once, in order", (long long)n, T, (long long)al, (long long)k);
                    check(halves, "span pieces: %lld units of %lld bytes, %d threads: each piece at most half "
                          "of the span left", (long long)n, (long long)ub, T);
                    check(tail, "span pieces: %lld units of %lld bytes, %d threads: the last piece near the tail",
                          (long long)n, (long long)ub, T);
                    case_end();
                }
}

void test_api_context(void) {
    test_span_pieces();
    test_pool_spans();
    test_ctx_nesting();
    test_scratch_failure();
    test_threads();
}
