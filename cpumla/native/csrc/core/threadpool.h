/* threadpool.h: cpumla's own persistent worker pool (so it never fights torch's or numpy's OpenMP).
 * Workers spin briefly between jobs (decode issues many short jobs back to back), then sleep. */
#ifndef CPUMLA_THREADPOOL_H
#define CPUMLA_THREADPOOL_H
#include <stdint.h>

/* fn(ctx, task, tid) for task in [0, n_tasks), handed out dynamically; tid in [0, threads). The caller
 * is thread 0 and works too. Returns when every task is done. Not reentrant: callers hold the library
 * lock (cpumla_enter), so one job runs at a time. */
typedef void (*cpumla_task_fn)(void *ctx, int64_t task, int tid);
void cpumla_pool_run(int64_t n_tasks, cpumla_task_fn fn, void *ctx);
/* The same, but thread i starts on a contiguous span of the tasks (the i-th of n_tasks split evenly)
 * and takes them in order, then helps with the other spans from their ends (threadpool.c). For jobs
 * whose consecutive tasks read consecutive memory (rows of one weight): each thread streams. */
void cpumla_pool_run_spans(int64_t n_tasks, cpumla_task_fn fn, void *ctx);

/* Pieces for a span job over `units` units (rows) of about `unit_bytes` bytes each, on `threads`
 * threads: cpumla_span_pieces gives k, the pieces of each thread's span (the job has threads * k
 * tasks); cpumla_span_piece the units [u0, u1) of task t, cut at multiples of `align`. A span's
 * pieces halve in size from front to back, the last two of about CPUMLA_SPAN_TAIL bytes: its owner
 * streams a few large pieces, and a thread that runs out of work takes the small ones from the other
 * spans' backs, so that the threads finish within about one small piece of each other. (Four equal
 * pieces a thread could leave them up to a piece apart: with a q8 output head of 102400 x 2048 on two
 * threads a piece is 28 MB.) */
#ifndef CPUMLA_SPAN_TAIL
#define CPUMLA_SPAN_TAIL (128 << 10)
#endif
int64_t cpumla_span_pieces(int64_t units, int64_t unit_bytes, int64_t align, int threads);
void cpumla_span_piece(int64_t units, int64_t k, int64_t align, int threads, int64_t t, int64_t *u0, int64_t *u1);

#define CPUMLA_MAX_THREADS 256

/* The calling thread's id in the pool: worker i has i (1 .. threads-1), every other thread 0, as the
 * caller of cpumla_pool_run is task thread 0. Scratch (cpumla_scratch) is kept per id. */
extern __thread int cpumla_pool_tid;

int cpumla_pool_resize(int n_threads);   /* n < 1: one per core available to this process */
int cpumla_pool_threads(void);
int cpumla_online_cores(void);

#endif
