/* A per-thread scratch buffer for the CPU kernels' work items, grown on demand and kept for the
 * thread's next calls (the pool's workers live as long as the process).
 *
 * Place in the data flow: included by paged_decode_attention.c (its score buffer) and
 * paged_prompt_attention.c (its tiles and running sums), which engine/kernels/native_build.py
 * compiles; each library holds its own buffer per thread.
 */
#ifndef PARAFLEX_THREAD_SCRATCH_H
#define PARAFLEX_THREAD_SCRATCH_H

#include <stdlib.h>

static __thread float *thread_scratch_buffer;
static __thread size_t thread_scratch_capacity;

/* This thread's buffer of at least `floats` floats, or NULL when memory cannot be had. */
static inline float *thread_scratch(size_t floats) {
    if (floats > thread_scratch_capacity) {
        free(thread_scratch_buffer);
        thread_scratch_buffer = malloc(sizeof(float) * floats);
        thread_scratch_capacity = thread_scratch_buffer ? floats : 0;
    }
    return thread_scratch_buffer;
}

#endif
