/* The CPU kernels' worker threads: one pool per process, shared by every compiled kernel.
 *
 * Place in the data flow: engine/native_build.py loads this library first, with its symbols
 * global, so the kernel libraries (linear_f32.c, paged_decode_attention.c,
 * decoder_layer_ops.c) resolve `pf_pool_run` against the one pool. A kernel cuts its work into
 * items and calls pf_pool_run(fn, ctx, items, threads) from the engine thread.
 *
 * Why not OpenMP: an OpenMP region ends in a barrier that waits for EVERY thread of the team,
 * including one the OS has not scheduled yet. On a machine whose cores are shared (the
 * gateway's thread, other processes), SmolLM2's 120 projections of a batch-1 step on two
 * threads took 15 ms at best but 62-477 ms at the median (one thread: 27 ms). Here the calling
 * thread never waits for a worker that has not started: items are claimed from a shared counter
 * (with the job's generation in the same word, so a worker that wakes late cannot claim items of
 * a later job), the caller takes every item nobody else has, and it waits only for items a
 * worker has claimed and not finished. Workers spin briefly between jobs (the next projection
 * follows within microseconds), then sleep on a condition variable.
 */
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <time.h>

#include "thread_pool.h"

#define MAX_WORKERS 63
#define JOB_SLOTS 4           /* a worker can read a job's slot until 4 jobs later */
#define SPIN_NS 100000        /* a worker spins this long for the next job, then sleeps; the
                                 caller waiting for claimed items yields its core after it */

typedef struct {
    pf_task_fn fn;
    void *ctx;
    int64_t items;
    int threads;              /* workers with an index below threads - 1 take part */
    int64_t done;             /* items finished (atomic) */
} job_t;

static job_t jobs[JOB_SLOTS];
static uint64_t word;         /* generation << 32 | next item to claim (atomic) */
static int sleepers;          /* workers waiting on `wake` (atomic) */
static int started;           /* workers started */
static int busy;              /* a caller holds the pool (atomic) */
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t wake = PTHREAD_COND_INITIALIZER;

static inline void relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* Claim and run items of generation `gen` until none is left or a later job is published. The
   job's fields are read before each claim: a claim that succeeds proves the word still held this
   generation after the reads, and a slot is rewritten only for the job 4 generations later, which
   cannot be published before this one is finished: so the fields read were this job's. */
static void work(uint32_t gen, int index) {
    job_t *job = &jobs[gen % JOB_SLOTS];
    for (;;) {
        uint64_t w = __atomic_load_n(&word, __ATOMIC_ACQUIRE);
        if ((uint32_t)(w >> 32) != gen) return;
        if (index >= __atomic_load_n(&job->threads, __ATOMIC_RELAXED) - 1) return;  /* not asked for */
        const pf_task_fn fn = __atomic_load_n(&job->fn, __ATOMIC_RELAXED);
        void *ctx = __atomic_load_n(&job->ctx, __ATOMIC_RELAXED);
        const int64_t items = __atomic_load_n(&job->items, __ATOMIC_RELAXED);
        const int64_t item = (int64_t)(uint32_t)w;
        if (item >= items) return;
        if (!__atomic_compare_exchange_n(&word, &w, w + 1, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) continue;
        fn(ctx, item);
        __atomic_add_fetch(&job->done, 1, __ATOMIC_RELEASE);
    }
}

static void *worker(void *arg) {
    const int index = (int)(intptr_t)arg;  /* 0 for the first worker started */
    uint32_t seen = (uint32_t)(__atomic_load_n(&word, __ATOMIC_ACQUIRE) >> 32);
    for (;;) {
        uint32_t gen = seen;
        const int64_t until = now_ns() + SPIN_NS;
        for (int i = 1; gen == seen; i++) {
            relax();
            gen = (uint32_t)(__atomic_load_n(&word, __ATOMIC_ACQUIRE) >> 32);
            if ((i & 63) == 0 && now_ns() > until) break;
        }
        if (gen == seen) {  /* sleep until a new job (sleepers first: see pf_pool_run) */
            __atomic_add_fetch(&sleepers, 1, __ATOMIC_SEQ_CST);
            pthread_mutex_lock(&lock);
            while ((gen = (uint32_t)(__atomic_load_n(&word, __ATOMIC_SEQ_CST) >> 32)) == seen)
                pthread_cond_wait(&wake, &lock);
            pthread_mutex_unlock(&lock);
            __atomic_sub_fetch(&sleepers, 1, __ATOMIC_SEQ_CST);
        }
        seen = gen;
        work(gen, index);
    }
    return NULL;
}

/* Start workers until `count` run (never fewer than already started). Caller holds no lock. */
static void ensure_workers(int count) {
    if (count > MAX_WORKERS) count = MAX_WORKERS;
    if (__atomic_load_n(&started, __ATOMIC_ACQUIRE) >= count) return;
    pthread_mutex_lock(&lock);
    while (started < count) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        const int rc = pthread_create(&t, &attr, worker, (void *)(intptr_t)started);
        pthread_attr_destroy(&attr);
        if (rc != 0) break;  /* fewer threads: the caller does the rest */
        __atomic_add_fetch(&started, 1, __ATOMIC_RELEASE);
    }
    pthread_mutex_unlock(&lock);
}

/* See thread_pool.h. A second caller while the pool is busy (two engines' threads in one
   process), or a job of more than 2^32 items, runs its items on its own thread. */
void pf_pool_run(pf_task_fn fn, void *ctx, int64_t items, int threads) {
    if (items <= 0) return;
    int idle = 0;
    if (threads <= 1 || items == 1 || items > (int64_t)UINT32_MAX ||
        !__atomic_compare_exchange_n(&busy, &idle, 1, 0, __ATOMIC_ACQUIRE, __ATOMIC_RELAXED)) {
        for (int64_t i = 0; i < items; i++) fn(ctx, i);
        return;
    }
    ensure_workers(threads - 1);
    const uint32_t gen = (uint32_t)(__atomic_load_n(&word, __ATOMIC_ACQUIRE) >> 32) + 1;
    job_t *job = &jobs[gen % JOB_SLOTS];
    __atomic_store_n(&job->fn, fn, __ATOMIC_RELAXED);
    __atomic_store_n(&job->ctx, ctx, __ATOMIC_RELAXED);
    __atomic_store_n(&job->items, items, __ATOMIC_RELAXED);
    __atomic_store_n(&job->threads, threads, __ATOMIC_RELAXED);
    __atomic_store_n(&job->done, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&word, (uint64_t)gen << 32, __ATOMIC_SEQ_CST);  /* publish */
    if (__atomic_load_n(&sleepers, __ATOMIC_SEQ_CST) > 0) {
        pthread_mutex_lock(&lock);
        pthread_cond_broadcast(&wake);
        pthread_mutex_unlock(&lock);
    }
    work(gen, -1);
    const int64_t until = now_ns() + SPIN_NS;  /* items a worker claimed and is still running */
    for (int i = 1; __atomic_load_n(&job->done, __ATOMIC_ACQUIRE) < items; i++) {
        relax();
        if ((i & 63) == 0 && now_ns() > until) sched_yield();  /* it may be waiting for our core */
    }
    __atomic_store_n(&busy, 0, __ATOMIC_RELEASE);
}

/* A forked child has none of the parent's workers: start afresh (a held lock is not inherited
   in a usable state either). */
static void after_fork_in_child(void) {
    started = 0;
    sleepers = 0;
    busy = 0;
    pthread_mutex_init(&lock, NULL);
    pthread_cond_init(&wake, NULL);
}

__attribute__((constructor)) static void install_fork_handler(void) {
    pthread_atfork(NULL, NULL, after_fork_in_child);
}
