/* probes.c: the benchmark probes of cpumla.h (read bandwidth, fp32 FMA, bf16 dot-product and AMX tile peaks):
 * each runs the table's single-threaded probe kernel (kernels.h: read_sum, fma_loop, dot_loop) on
 * every thread of the pool and adds up what they return, holding the library lock (cpumla_enter),
 * which also guards the static job records. */
#include <string.h>
#include "core/common.h"
#include "core/dispatch.h"
#include "core/threadpool.h"

#define MAX_POOL_THREADS CPUMLA_MAX_THREADS     /* a result slot per thread, 64 bytes apart */

static int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
static int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

double cpumla_read_probe(const void *buf, int64_t bytes);
typedef struct { const uint8_t *buf; int64_t bytes, chunk; double sums[MAX_POOL_THREADS * 8]; } read_job;

static void read_task(void *p, int64_t t, int tid) {
    read_job *j = p;
    int64_t b0 = t * j->chunk, b1 = min64(b0 + j->chunk, j->bytes);
    if (b1 > b0) j->sums[tid * 8] += cpumla_k.read_sum(j->buf + b0, b1 - b0);
}

double cpumla_read_probe(const void *buf, int64_t bytes) {
    cpumla_enter(NULL);
    cpumla_ensure_init();
    static read_job j;
    int threads = cpumla_pool_threads();
    memset(j.sums, 0, sizeof j.sums);
    j.buf = buf;
    j.bytes = bytes & ~(int64_t)63;
    /* one contiguous stream per thread, as a GEMV split over rows reads */
    j.chunk = ceil_div(ceil_div(j.bytes, threads), 4096) * 4096;
    cpumla_pool_run(threads, read_task, &j);
    double s = 0;
    for (int i = 0; i < threads; i++) s += j.sums[i * 8];
    cpumla_leave(0);
    return s;
}

typedef struct {
    double (*loop)(int64_t, float *);
    int64_t iters;
    double flops[MAX_POOL_THREADS * 8];
    float sink[MAX_POOL_THREADS * 16];
} fma_job;

static void fma_task(void *p, int64_t t, int tid) {
    (void)t;
    fma_job *j = p;
    j->flops[tid * 8] += j->loop(j->iters, &j->sink[tid * 16]);
}

static double flops_probe(double (*loop)(int64_t, float *), int64_t iters) {
    static fma_job j;
    int threads = cpumla_pool_threads();
    memset(j.flops, 0, sizeof j.flops);
    j.loop = loop;
    j.iters = iters;
    cpumla_pool_run(threads, fma_task, &j);
    double s = 0;
    for (int i = 0; i < threads; i++) s += j.flops[i * 8];
    return s;
}

double cpumla_fma_probe(int64_t iters) {
    cpumla_enter(NULL);
    cpumla_ensure_init();
    double f = flops_probe(cpumla_k.fma_loop, iters);
    cpumla_leave(0);
    return f;
}

double cpumla_bf16_probe(int64_t iters) {
    cpumla_enter(NULL);
    cpumla_ensure_init();
    double f = flops_probe(cpumla_k.dot_loop, iters);
    cpumla_leave(0);
    return f;
}

static double tile_bf16_loop(int64_t iters, float *sink) { return cpumla_k.tile_loop(0, iters, sink); }
static double tile_int8_loop(int64_t iters, float *sink) { return cpumla_k.tile_loop(1, iters, sink); }

double cpumla_tile_probe(int32_t kind, int64_t iters) {
    cpumla_enter(NULL);
    cpumla_ensure_init();
    double f = 0;
    if (cpumla_k.tile_loop && (kind == 0 || kind == 1) && iters > 0)
        f = flops_probe(kind == 0 ? tile_bf16_loop : tile_int8_loop, iters);
    cpumla_leave(0);
    return f;
}
