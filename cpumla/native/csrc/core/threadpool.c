/* threadpool.c: a fixed set of workers fed one job at a time.
 *
 * A job is (fn, ctx, n_tasks); tasks are claimed with an atomic counter, or, for a job run by
 * cpumla_pool_run_spans, from per-thread spans (below). Publishing a job bumps
 * `generation`; each worker, once it sees a new generation, claims tasks until none are left and then
 * checks in (`checked_in`). The caller waits for every worker to check in before returning, so a job's
 * fields are never read after its call returned. Idle workers spin for a while (decode issues a few
 * hundred short jobs per token) and then sleep on a condition variable.
 *
 * Spans: thread i owns tasks [n i / T, n (i + 1) / T) and takes them front to back; a thread whose span
 * is empty takes the other spans' tasks from their backs. A span is one 64-bit word, front | back << 32,
 * claimed by compare-and-swap at either end. For row tasks of one weight this keeps each thread on one
 * sequential stream of memory, where tasks handed out in turn from one counter make every thread jump
 * to a new place at each task, and each jump restarts the hardware prefetchers. Helping from the back
 * keeps the balance of small tasks when a thread starts late or runs slow. */
#define _GNU_SOURCE
#include "core/threadpool.h"
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <unistd.h>

#define SPIN_ROUNDS 20000   /* ~100 us of polling before a worker sleeps */

static struct {
    pthread_t threads[CPUMLA_MAX_THREADS];
    int n_threads;                 /* including the caller */
    cpumla_task_fn fn;
    void *ctx;
    int64_t n_tasks;
    atomic_llong next_task;
    atomic_int checked_in;
    atomic_uint generation;
    atomic_int sleeping;
    atomic_int quit;
    unsigned start_generation;     /* generation new workers count as seen (set before they start) */
    int spans;                     /* this job hands tasks out by span */
    struct { _Alignas(64) atomic_ullong v; } span[CPUMLA_MAX_THREADS];   /* front | back << 32 per thread */
    pthread_mutex_t mu;
    pthread_cond_t wake;
} pool = {.n_threads = 0, .mu = PTHREAD_MUTEX_INITIALIZER, .wake = PTHREAD_COND_INITIALIZER};

__thread int cpumla_pool_tid;

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* one task of span s from its front (its owner) or its back (a helper); 0 when the span is empty */
static int claim(int s, int back, int64_t *task) {
    unsigned long long v = atomic_load_explicit(&pool.span[s].v, memory_order_relaxed);
    for (;;) {
        uint32_t f = (uint32_t)v, b = (uint32_t)(v >> 32);
        if (f >= b) return 0;
        unsigned long long nv = back ? ((unsigned long long)(b - 1) << 32) | f
                                     : ((unsigned long long)b << 32) | (f + 1);
        if (atomic_compare_exchange_weak_explicit(&pool.span[s].v, &v, nv, memory_order_relaxed,
                                                  memory_order_relaxed)) {
            *task = back ? (int64_t)b - 1 : (int64_t)f;
            return 1;
        }
    }
}

static void run_tasks(int tid) {
    if (pool.spans) {
        int64_t t;
        while (claim(tid, 0, &t)) pool.fn(pool.ctx, t, tid);
        for (int k = 1; k < pool.n_threads; k++)
            while (claim((tid + k) % pool.n_threads, 1, &t)) pool.fn(pool.ctx, t, tid);
        return;
    }
    for (;;) {
        int64_t t = atomic_fetch_add_explicit(&pool.next_task, 1, memory_order_relaxed);
        if (t >= pool.n_tasks) break;
        pool.fn(pool.ctx, t, tid);
    }
}

static void *worker_main(void *arg) {
    int tid = (int)(intptr_t)arg;
    cpumla_pool_tid = tid;
    /* Not the current generation: a job published before this thread got to run must still be seen
     * as new, or the caller would wait for this worker forever. */
    unsigned seen = pool.start_generation;
    for (;;) {
        unsigned g;
        int spins = 0;
        while ((g = atomic_load_explicit(&pool.generation, memory_order_acquire)) == seen &&
               !atomic_load_explicit(&pool.quit, memory_order_relaxed)) {
            if (++spins < SPIN_ROUNDS) { cpu_relax(); continue; }
            pthread_mutex_lock(&pool.mu);
            atomic_fetch_add(&pool.sleeping, 1);
            while (atomic_load(&pool.generation) == seen && !atomic_load(&pool.quit))
                pthread_cond_wait(&pool.wake, &pool.mu);
            atomic_fetch_sub(&pool.sleeping, 1);
            pthread_mutex_unlock(&pool.mu);
            spins = 0;
        }
        if (atomic_load(&pool.quit)) return NULL;
        seen = g;
        run_tasks(tid);
        atomic_fetch_add_explicit(&pool.checked_in, 1, memory_order_release);
    }
}

static void stop_workers(void) {
    if (pool.n_threads <= 1) { pool.n_threads = pool.n_threads < 1 ? 1 : pool.n_threads; return; }
    pthread_mutex_lock(&pool.mu);
    atomic_store(&pool.quit, 1);
    pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.mu);
    for (int i = 1; i < pool.n_threads; i++) pthread_join(pool.threads[i], NULL);
    atomic_store(&pool.quit, 0);
    pool.n_threads = 1;
}

int cpumla_online_cores(void) {
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof(set), &set) == 0) {
        int n = CPU_COUNT(&set);
        if (n > 0) return n;
    }
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 ? (int)n : 1;
}

int cpumla_pool_resize(int n) {
    if (n < 1) n = cpumla_online_cores();
    if (n > CPUMLA_MAX_THREADS) n = CPUMLA_MAX_THREADS;
    if (n == pool.n_threads) return n;
    stop_workers();
    pool.start_generation = atomic_load(&pool.generation);
    int started = 1;
    for (int i = 1; i < n; i++) {
        if (pthread_create(&pool.threads[i], NULL, worker_main, (void *)(intptr_t)i) != 0) break;
        started++;
    }
    pool.n_threads = started;
    return started;
}

int cpumla_pool_threads(void) {
    if (pool.n_threads < 1) cpumla_pool_resize(0);
    return pool.n_threads;
}

int64_t cpumla_span_pieces(int64_t units, int64_t unit_bytes, int64_t align, int threads) {
    if (threads < 1) threads = 1;
    if (align < 1) align = 1;
    int64_t span = units / threads, bytes = span * (unit_bytes > 0 ? unit_bytes : 1), k = 1;
    /* halve until the last piece is at most the tail, and at least `align` units */
    while (k < 24 && (bytes >> (k - 1)) > CPUMLA_SPAN_TAIL && (span >> k) >= align) k++;
    return k;
}

static int64_t span_start(int64_t units, int64_t align, int threads, int64_t i) {
    return i >= threads ? units : units * i / threads / align * align;
}

void cpumla_span_piece(int64_t units, int64_t k, int64_t align, int threads, int64_t t, int64_t *u0,
                       int64_t *u1) {
    if (align < 1) align = 1;
    int64_t i = t / k, j = t % k, s0 = span_start(units, align, threads, i);
    int64_t len = span_start(units, align, threads, i + 1) - s0;
    /* piece j starts where the span has 2^-j of it left, rounded down to `align` */
    int64_t a = (len - (len >> j)) / align * align, b = j + 1 >= k ? len : (len - (len >> (j + 1))) / align * align;
    *u0 = s0 + a;
    *u1 = s0 + b;
}

static void pool_run(int64_t n_tasks, cpumla_task_fn fn, void *ctx, int spans);
void cpumla_pool_run(int64_t n_tasks, cpumla_task_fn fn, void *ctx) { pool_run(n_tasks, fn, ctx, 0); }
void cpumla_pool_run_spans(int64_t n_tasks, cpumla_task_fn fn, void *ctx) {
    pool_run(n_tasks, fn, ctx, n_tasks < INT32_MAX);    /* a span's ends are 32-bit */
}

static void pool_run(int64_t n_tasks, cpumla_task_fn fn, void *ctx, int spans) {
    if (n_tasks <= 0) return;
    if (pool.n_threads < 1) cpumla_pool_resize(0);
    if (pool.n_threads == 1 || n_tasks == 1) {
        for (int64_t t = 0; t < n_tasks; t++) fn(ctx, t, 0);
        return;
    }
    pool.fn = fn;
    pool.ctx = ctx;
    pool.n_tasks = n_tasks;
    pool.spans = spans;
    if (spans)
        for (int i = 0; i < pool.n_threads; i++) {
            unsigned long long f = (unsigned long long)(n_tasks * i / pool.n_threads);
            unsigned long long b = (unsigned long long)(n_tasks * (i + 1) / pool.n_threads);
            atomic_store_explicit(&pool.span[i].v, f | b << 32, memory_order_relaxed);
        }
    atomic_store_explicit(&pool.next_task, 0, memory_order_relaxed);
    atomic_store_explicit(&pool.checked_in, 0, memory_order_relaxed);
    atomic_fetch_add_explicit(&pool.generation, 1, memory_order_seq_cst);
    if (atomic_load(&pool.sleeping) > 0) {
        pthread_mutex_lock(&pool.mu);
        pthread_cond_broadcast(&pool.wake);
        pthread_mutex_unlock(&pool.mu);
    }
    run_tasks(0);
    /* a worker that the OS descheduled (more runnable threads than cores) must get its core back */
    for (int spins = 0; atomic_load_explicit(&pool.checked_in, memory_order_acquire) < pool.n_threads - 1;)
        if (++spins < 2000) cpu_relax();
        else sched_yield();
}
