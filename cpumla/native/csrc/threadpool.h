/* threadpool.h: cpumla's own persistent worker pool (so it never fights torch's or numpy's OpenMP).
 * Workers spin briefly between jobs (decode issues many short jobs back to back), then sleep. */
#ifndef CPUMLA_THREADPOOL_H
#define CPUMLA_THREADPOOL_H
#include <stdint.h>

/* fn(ctx, task, tid) for task in [0, n_tasks), handed out dynamically; tid in [0, threads). The caller
 * is thread 0 and works too. Returns when every task is done. Not reentrant. */
typedef void (*cpumla_task_fn)(void *ctx, int64_t task, int tid);
void cpumla_pool_run(int64_t n_tasks, cpumla_task_fn fn, void *ctx);

int cpumla_pool_resize(int n_threads);   /* n < 1: one per core available to this process */
int cpumla_pool_threads(void);
int cpumla_online_cores(void);

#endif
