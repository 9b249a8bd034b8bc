/* Paged decode attention on CPU, float32: one query token per request, reading the request's
 * keys and values where they lie in the block pool (no gather into a contiguous copy).
 *
 * Place in the data flow: engine/native_build.py compiles this file once per machine, and
 * engine/native_attention.py loads it with ctypes and calls `pf_paged_decode_attention` from
 * `paged_attention` for every layer of a CPU decode batch. The function first stores each
 * request's new key/value vectors into their slots (the last position of its context), then,
 * for every request, computes all its query heads' scores over the whole context (query head
 * h * group + g reads kv head h), a max-subtracted softmax and the weighted sum of values: the
 * same operations as the torch path (scores * scale, softmax, @ V), in float32, without
 * materialising the context.
 *
 * Pool layout (one model's view): block b starts at pool + b * block_stride; keys of slot s,
 * head h at + (s * kv_heads + h) * head_dim, values at + v_offset + (s * kv_heads + h) * head_dim.
 * Requests are the work items of the kernels' thread pool (thread_pool.c, `num_threads`
 * threads); each thread keeps its own score buffer. head_dim must be a multiple of 8 (the vector
 * width; the caller checks).
 */
#include <stdlib.h>

#include "thread_pool.h"
#include "vec_math.h"


typedef struct {
    const float *q;             /* [B, kv_heads * group, head_dim] */
    float *pool;
    int64_t block_stride, v_offset;
    int tokens_per_block, kv_heads, group, head_dim;
    const int64_t *block_table; /* [B, max_blocks] */
    int64_t max_blocks;
    const int64_t *context_lens; /* [B] */
    float scale;
    float *out;                 /* [B, kv_heads * group, head_dim] */
    int failed;                 /* set when a thread could not get its score buffer */
} job_t;

static inline float dot(const float *a, const float *b, int n) {
    v8f even = {0}, odd = {0};
    int c = 0;
    for (; c + 16 <= n; c += 16) {
        even += load8(a + c) * load8(b + c);
        odd += load8(a + c + 8) * load8(b + c + 8);
    }
    if (c < n) even += load8(a + c) * load8(b + c);
    even += odd;
    float s = 0;
    for (int i = 0; i < 8; i++) s += even[i];
    return s;
}

/* Prefetch one slot's keys and values (all kv heads: `row` floats each). */
static inline void prefetch_slot(const float *k, int64_t v_offset, int row) {
    for (int c = 0; c < row; c += 16) {
        __builtin_prefetch(k + c);
        __builtin_prefetch(k + v_offset + c);
    }
}

/* One request: all its query heads over its whole context. The context is walked block by
   block and slot by slot, all kv heads of a slot at once, so keys and values stream through
   memory in address order inside a block; while a block is read, the same slot of the next
   block is prefetched (the blocks lie anywhere, so the hardware prefetcher stops at each). */
static void attend(const job_t *j, int64_t b, float *sc) {
    const int D = j->head_dim, H = j->kv_heads, G = j->group, HQ = H * G, tpb = j->tokens_per_block;
    const int row = H * D;
    const int64_t n = j->context_lens[b];
    const int64_t *table = j->block_table + b * j->max_blocks;
    const float *q = j->q + b * (int64_t)HQ * D;
    float *out = j->out + b * (int64_t)HQ * D;
    for (int64_t t0 = 0, blk = 0; t0 < n; t0 += tpb, blk++) {
        const float *k = j->pool + table[blk] * j->block_stride;
        const float *next = t0 + tpb < n ? j->pool + table[blk + 1] * j->block_stride : NULL;
        const int64_t end = n - t0 < tpb ? n - t0 : tpb;
        for (int64_t s = 0; s < end; s++, k += row) {
            if (next) prefetch_slot(next + s * row, j->v_offset, row);
            for (int hq = 0; hq < HQ; hq++) sc[hq * n + t0 + s] = dot(q + hq * D, k + (hq / G) * D, D) * j->scale;
        }
    }
    for (int hq = 0; hq < HQ; hq++) {
        float *s = sc + hq * n, m = s[0], sum = 0;
        for (int64_t t = 1; t < n; t++) m = s[t] > m ? s[t] : m;
        for (int64_t t = 0; t < n; t++) s[t] = exp_clamped(s[t] - m);
        for (int64_t t = 0; t < n; t++) sum += s[t];
        const float inv = 1.0f / sum;
        for (int64_t t = 0; t < n; t++) s[t] *= inv;
    }
    memset(out, 0, sizeof(float) * (size_t)HQ * D);
    for (int64_t t0 = 0, blk = 0; t0 < n; t0 += tpb, blk++) {
        const float *v = j->pool + table[blk] * j->block_stride + j->v_offset;
        const int64_t end = n - t0 < tpb ? n - t0 : tpb;
        for (int64_t s = 0; s < end; s++, v += row) {
            for (int hq = 0; hq < HQ; hq++) {
                const float p = sc[hq * n + t0 + s];
                const float *vh = v + (hq / G) * D;
                float *o = out + hq * D;
                for (int c = 0; c < D; c += 8) store8(o + c, load8(o + c) + p * load8(vh + c));
            }
        }
    }
}

/* This thread's score buffer, grown to at least `floats` (kept for the thread's next calls). */
static __thread float *thread_scores;
static __thread size_t thread_capacity;

static float *scores_buffer(size_t floats) {
    if (floats > thread_capacity) {
        free(thread_scores);
        thread_scores = malloc(sizeof(float) * floats);
        thread_capacity = thread_scores ? floats : 0;
    }
    return thread_scores;
}

static void attend_item(void *ctx, int64_t b) {
    job_t *j = (job_t *)ctx;
    float *sc = scores_buffer((size_t)j->kv_heads * (size_t)j->group * (size_t)j->context_lens[b]);
    if (!sc) {
        __atomic_store_n(&j->failed, 1, __ATOMIC_RELAXED);
        return;
    }
    attend(j, b, sc);
}

/* Returns 0, or -1 when scratch memory cannot be had. k_new/v_new: [B, kv_heads, head_dim]. */
int pf_paged_decode_attention(const float *q, const float *k_new, const float *v_new, float *pool,
                              int64_t block_stride, int64_t v_offset, int tokens_per_block,
                              int kv_heads, int group, int head_dim, const int64_t *block_table,
                              int64_t max_blocks, const int64_t *context_lens, int64_t num_seqs,
                              float scale, float *out, int num_threads) {
    if (num_seqs <= 0) return 0;
    const int64_t vec = (int64_t)kv_heads * head_dim;
    for (int64_t b = 0; b < num_seqs; b++) {
        const int64_t pos = context_lens[b] - 1, blk = block_table[b * max_blocks + pos / tokens_per_block];
        float *slot = pool + blk * block_stride + (pos % tokens_per_block) * vec;
        memcpy(slot, k_new + b * vec, sizeof(float) * vec);
        memcpy(slot + v_offset, v_new + b * vec, sizeof(float) * vec);
    }
    job_t job = {q, pool, block_stride, v_offset, tokens_per_block, kv_heads, group, head_dim,
                 block_table, max_blocks, context_lens, scale, out, 0};
    pf_pool_run(attend_item, &job, num_seqs, num_threads);
    return job.failed ? -1 : 0;
}
