/* Paged decode attention on CPU, float32: one query token per request, reading the request's
 * keys and values where they lie in the block pool (no gather into a contiguous copy).
 *
 * Place in the data flow: engine/native_attention.py (paraflex.engine) compiles this file once per
 * machine (cc -O3 -shared), loads it with ctypes and calls `pf_paged_decode_attention` from
 * `paged_attention` for every layer of a CPU decode batch. The function first stores each
 * request's new key/value vectors into their slots (the last position of its context), then,
 * for every (request, kv head), computes the grouped queries' scores over the whole context,
 * a max-subtracted softmax and the weighted sum of values: the same operations as the torch
 * path (scores * scale, softmax, @ V), in float32, without materialising the context.
 *
 * Pool layout (one model's view): block b starts at pool + b * block_stride; keys of slot s,
 * head h at + (s * kv_heads + h) * head_dim, values at + v_offset + (s * kv_heads + h) * head_dim.
 * Work is split over `num_threads` POSIX threads by (request, kv head) pairs. head_dim must be a
 * multiple of 8 (the vector width; the caller checks).
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

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
    int64_t first, last;        /* (request, kv head) pairs [first, last) of this thread */
    float *scores;              /* scratch: group * max context */
} job_t;

typedef float v8f __attribute__((vector_size(32)));

static inline v8f load8(const float *p) { v8f v; memcpy(&v, p, sizeof v); return v; }
static inline void store8(float *p, v8f v) { memcpy(p, &v, sizeof v); }
static inline float hsum(v8f v) {
    float s = 0;
    for (int i = 0; i < 8; i++) s += v[i];
    return s;
}

#define GB 4 /* query heads of one group handled together (a literal 1-4 at every call, so the
                accumulators below stay in vector registers) */

/* scores[g * n + t] = scale * q_g . k_t for the group's query heads g0 .. g0+gb-1 */
static inline __attribute__((always_inline)) void scores_of(const job_t *j, const int64_t *table, int64_t n, int h, const float *q, int g0, int gb,
                      float *sc, int prefetch, const float *after) {
    const int D = j->head_dim, H = j->kv_heads, tpb = j->tokens_per_block;
    for (int64_t t0 = 0, blk = 0; t0 < n; t0 += tpb, blk++) {
        const float *k = j->pool + table[blk] * j->block_stride + (int64_t)h * D;
        const int64_t end = n - t0 < tpb ? n - t0 : tpb;
        /* prefetch the next block's keys and values one slot per slot of this block (the
           blocks lie anywhere in the pool, so the hardware's stream prefetcher stops at each);
           after the last block, the first block of the thread's next (request, head) pair */
        const float *next = t0 + tpb < n ? j->pool + table[blk + 1] * j->block_stride + (int64_t)h * D : after;
        for (int64_t s = 0; s < end; s++, k += (int64_t)H * D) {
            if (next && prefetch) {
                const float *pk = next + s * (int64_t)H * D;
                for (int c = 0; c < D; c += 16) {
                    __builtin_prefetch(pk + c);
                    __builtin_prefetch(pk + j->v_offset + c);
                }
            }
            v8f even[GB] = {{0}}, odd[GB] = {{0}};
            int c = 0;
            for (; c + 16 <= D; c += 16) {
                const v8f k0 = load8(k + c), k1 = load8(k + c + 8);
                for (int g = 0; g < gb; g++) {
                    even[g] += load8(q + (g0 + g) * D + c) * k0;
                    odd[g] += load8(q + (g0 + g) * D + c + 8) * k1;
                }
            }
            for (; c < D; c += 8) {
                const v8f k0 = load8(k + c);
                for (int g = 0; g < gb; g++) even[g] += load8(q + (g0 + g) * D + c) * k0;
            }
            for (int g = 0; g < gb; g++) sc[(g0 + g) * n + t0 + s] = hsum(even[g] + odd[g]) * j->scale;
        }
    }
}

/* out_g = sum_t p[g * n + t] * v_t for the group's query heads g0 .. g0+gb-1, 16 of the head's
   dimensions per pass over the values (two vectors per head: 8 accumulators for 4 heads) */
static inline __attribute__((always_inline)) void weighted_values(const job_t *j, const int64_t *table, int64_t n,
                                                                  int h, const float *p, int g0, int gb, float *out) {
    const int D = j->head_dim, H = j->kv_heads, tpb = j->tokens_per_block;
    for (int c = 0; c < D; c += 16) {
        const int wide = c + 16 <= D; /* else the last 8 dimensions alone */
        v8f lo[GB] = {{0}}, hi[GB] = {{0}};
        for (int64_t t0 = 0, blk = 0; t0 < n; t0 += tpb, blk++) {
            const float *v = j->pool + table[blk] * j->block_stride + j->v_offset + (int64_t)h * D + c;
            const int64_t end = n - t0 < tpb ? n - t0 : tpb;
            const float *pt = p + t0;
            for (int64_t s = 0; s < end; s++, v += (int64_t)H * D) {
                const v8f v0 = load8(v), v1 = wide ? load8(v + 8) : v0;
                for (int g = 0; g < gb; g++) {
                    const float w = pt[(g0 + g) * n + s];
                    lo[g] += w * v0;
                    hi[g] += w * v1;
                }
            }
        }
        for (int g = 0; g < gb; g++) {
            store8(out + (g0 + g) * D + c, lo[g]);
            if (wide) store8(out + (g0 + g) * D + c + 8, hi[g]);
        }
    }
}

static void *run(void *arg) {
    const job_t *j = (const job_t *)arg;
    const int D = j->head_dim, H = j->kv_heads, G = j->group;
    for (int64_t pair = j->first; pair < j->last; pair++) {
        const int64_t b = pair / H;
        const int h = (int)(pair % H);
        const int64_t n = j->context_lens[b];
        const int64_t *table = j->block_table + b * j->max_blocks;
        const float *q = j->q + (b * H * G + (int64_t)h * G) * D;
        float *out = j->out + (b * H * G + (int64_t)h * G) * D;
        float *sc = j->scores;
        const float *after = NULL;
        if (pair + 1 < j->last) {
            const int64_t nb = (pair + 1) / H;
            after = j->pool + j->block_table[nb * j->max_blocks] * j->block_stride + ((pair + 1) % H) * D;
        }
        for (int g0 = 0; g0 < G; g0 += GB) {
            switch (G - g0 < GB ? G - g0 : GB) {
                case 4: scores_of(j, table, n, h, q, g0, 4, sc, g0 == 0, after); break;
                case 3: scores_of(j, table, n, h, q, g0, 3, sc, g0 == 0, after); break;
                case 2: scores_of(j, table, n, h, q, g0, 2, sc, g0 == 0, after); break;
                default: scores_of(j, table, n, h, q, g0, 1, sc, g0 == 0, after);
            }
        }
        for (int g = 0; g < G; g++) {
            float *s = sc + g * n, m = s[0], sum = 0;
            for (int64_t t = 1; t < n; t++) m = s[t] > m ? s[t] : m;
            for (int64_t t = 0; t < n; t++) s[t] = expf(s[t] - m);
            for (int64_t t = 0; t < n; t++) sum += s[t];
            const float inv = 1.0f / sum;
            for (int64_t t = 0; t < n; t++) s[t] *= inv;
        }
        for (int g0 = 0; g0 < G; g0 += GB) {
            switch (G - g0 < GB ? G - g0 : GB) {
                case 4: weighted_values(j, table, n, h, sc, g0, 4, out); break;
                case 3: weighted_values(j, table, n, h, sc, g0, 3, out); break;
                case 2: weighted_values(j, table, n, h, sc, g0, 2, out); break;
                default: weighted_values(j, table, n, h, sc, g0, 1, out);
            }
        }
    }
    return NULL;
}

/* Returns 0, or -1 when scratch memory cannot be had. k_new/v_new: [B, kv_heads, head_dim]. */
int pf_paged_decode_attention(const float *q, const float *k_new, const float *v_new, float *pool,
                              int64_t block_stride, int64_t v_offset, int tokens_per_block,
                              int kv_heads, int group, int head_dim, const int64_t *block_table,
                              int64_t max_blocks, const int64_t *context_lens, int64_t num_seqs,
                              float scale, float *out, int num_threads) {
    const int64_t vec = (int64_t)kv_heads * head_dim;
    int64_t max_ctx = 1;
    for (int64_t b = 0; b < num_seqs; b++) {
        const int64_t pos = context_lens[b] - 1, blk = block_table[b * max_blocks + pos / tokens_per_block];
        float *slot = pool + blk * block_stride + (pos % tokens_per_block) * vec;
        memcpy(slot, k_new + b * vec, sizeof(float) * vec);
        memcpy(slot + v_offset, v_new + b * vec, sizeof(float) * vec);
        if (context_lens[b] > max_ctx) max_ctx = context_lens[b];
    }
    const int64_t pairs = num_seqs * kv_heads;
    if (num_threads < 1) num_threads = 1;
    if (num_threads > pairs) num_threads = (int)pairs;
    job_t jobs[64];
    pthread_t threads[64];
    if (num_threads > 64) num_threads = 64;
    float *scratch = malloc(sizeof(float) * (size_t)group * (size_t)max_ctx * (size_t)num_threads);
    if (!scratch) return -1;
    for (int i = 0; i < num_threads; i++) {
        job_t *j = &jobs[i];
        j->q = q; j->pool = pool; j->block_stride = block_stride; j->v_offset = v_offset;
        j->tokens_per_block = tokens_per_block; j->kv_heads = kv_heads; j->group = group;
        j->head_dim = head_dim; j->block_table = block_table; j->max_blocks = max_blocks;
        j->context_lens = context_lens; j->scale = scale; j->out = out;
        j->first = pairs * i / num_threads; j->last = pairs * (i + 1) / num_threads;
        j->scores = scratch + (size_t)group * (size_t)max_ctx * (size_t)i;
    }
    int started = 1;  /* thread 0's share runs on the calling thread */
    for (int i = 1; i < num_threads; i++) {
        if (pthread_create(&threads[i], NULL, run, &jobs[i]) != 0) break;
        started++;
    }
    for (int i = started; i < num_threads; i++) run(&jobs[i]);  /* could not start: run here */
    run(&jobs[0]);
    for (int i = 1; i < started; i++) pthread_join(threads[i], NULL);
    free(scratch);
    return 0;
}
