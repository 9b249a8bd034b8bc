/* The kernels' thread pool (thread_pool.c): run fn(ctx, i) for i in [0, items) on the calling
 * thread and up to threads - 1 workers; returns when all have run. Included by every kernel
 * that splits its work, so a change here changes their build's cache key too. */
#ifndef PARAFLEX_THREAD_POOL_H
#define PARAFLEX_THREAD_POOL_H

#include <stdint.h>

typedef void (*pf_task_fn)(void *ctx, int64_t item);

void pf_pool_run(pf_task_fn fn, void *ctx, int64_t items, int threads);

#endif
