/* Paged decode attention on CPU, float32 or bfloat16: one query token per request, reading the
 * request's keys and values where they lie in the block pool (no gather into a contiguous copy).
 *
 * Place in the data flow: engine/native_build.py compiles this file once per machine, and
 * engine/native_attention.py loads it with ctypes and calls `pf_paged_decode_attention` from
 * `paged_attention` for every layer of a CPU decode batch. The function first stores each
 * request's new key/value vectors into their slots (the last position of its context), then,
 * for every request, computes all its query heads' scores over the whole context (query head
 * h * group + g reads kv head h), a max-subtracted softmax and the weighted sum of values: the
 * same operations as the torch path (scores * scale, softmax, @ V), in float32, without
 * materialising the context. bfloat16 (queries, pool and output; `bf16` set): the math stays
 * float32 (keys and values widened as they are read), rounded to bfloat16 where the torch path's
 * bfloat16 tensors round: each score, the scaled score, each probability and the output.
 *
 * Pool layout (one model's view, in elements): block b starts at pool + b * block_stride; keys
 * of slot s, head h at + (s * kv_heads + h) * head_dim, values at + v_offset + (s * kv_heads + h)
 * * head_dim.
 * Requests are the work items of the kernels' thread pool (thread_pool.c, `num_threads`
 * threads); each thread keeps its own scratch buffer (thread_scratch.h). head_dim must be a
 * multiple of 8 (the vector width; the caller checks).
 */
#include "bf16.h"
#include "thread_pool.h"
#include "thread_scratch.h"
#include "vec_math.h"


typedef struct {
    const void *q;              /* [B, kv_heads * group, head_dim] */
    void *pool;
    int64_t block_stride, v_offset;
    int tokens_per_block, kv_heads, group, head_dim;
    const int64_t *block_table; /* [B, max_blocks] */
    int64_t max_blocks;
    const int64_t *context_lens; /* [B] */
    float scale;
    void *out;                  /* [B, kv_heads * group, head_dim] */
    int bf16;                   /* elements are bfloat16 (else float32) */
    int failed;                 /* set when a thread could not get its scratch buffer */
} job_t;

/* 8 elements from p + i, as floats; `bf16` is a constant where the kernel is specialised */
static inline __attribute__((always_inline)) v8f load8_at(const void *p, int64_t i, const int bf16) {
    return bf16 ? load8_bf16((const bf16_t *)p + i) : load8((const float *)p + i);
}

static inline __attribute__((always_inline)) const void *elem_at(const void *p, int64_t i, const int bf16) {
    return (const char *)p + i * (bf16 ? (int64_t)sizeof(bf16_t) : (int64_t)sizeof(float));
}

static inline __attribute__((always_inline)) float rounded(float x, const int bf16) {
    return bf16 ? round_bf16(x) : x;
}

static inline __attribute__((always_inline)) float dot(const float *a, const void *b, int n, const int bf16) {
    v8f even = {0}, odd = {0};
    int c = 0;
    for (; c + 16 <= n; c += 16) {
        even += load8(a + c) * load8_at(b, c, bf16);
        odd += load8(a + c + 8) * load8_at(b, c + 8, bf16);
    }
    if (c < n) even += load8(a + c) * load8_at(b, c, bf16);
    even += odd;
    float s = 0;
    for (int i = 0; i < 8; i++) s += even[i];
    return s;
}

#ifdef __AVX512BF16__
#include <immintrin.h>

/* a . b over n bfloat16s (n a multiple of 8): pairs multiplied exactly and summed in float32 by
   VDPBF16PS (16 products per instruction, no widening) */
static inline float dot_bf16(const bf16_t *a, const bf16_t *b, int n) {
    __m256 even = _mm256_setzero_ps(), odd = _mm256_setzero_ps();
    int c = 0;
    for (; c + 32 <= n; c += 32) {
        even = _mm256_dpbf16_ps(even, (__m256bh)_mm256_loadu_si256((const __m256i *)(a + c)),
                                (__m256bh)_mm256_loadu_si256((const __m256i *)(b + c)));
        odd = _mm256_dpbf16_ps(odd, (__m256bh)_mm256_loadu_si256((const __m256i *)(a + c + 16)),
                               (__m256bh)_mm256_loadu_si256((const __m256i *)(b + c + 16)));
    }
    if (c + 16 <= n) {
        even = _mm256_dpbf16_ps(even, (__m256bh)_mm256_loadu_si256((const __m256i *)(a + c)),
                                (__m256bh)_mm256_loadu_si256((const __m256i *)(b + c)));
        c += 16;
    }
    __m128 sum = _mm_add_ps(_mm256_castps256_ps128(even), _mm256_extractf128_ps(even, 1));
    sum = _mm_add_ps(sum, _mm_add_ps(_mm256_castps256_ps128(odd), _mm256_extractf128_ps(odd, 1)));
    if (c < n)
        sum = _mm_dpbf16_ps(sum, (__m128bh)_mm_loadu_si128((const __m128i *)(a + c)),
                            (__m128bh)_mm_loadu_si128((const __m128i *)(b + c)));
    float lanes[4];
    _mm_storeu_ps(lanes, sum);
    return (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
}
#define WIDEN_QUERIES 0
#else
#define WIDEN_QUERIES 1
#endif

/* query head . key head: both bfloat16 where the CPU has avx512_bf16, else the query widened */
static inline __attribute__((always_inline)) float score(const void *q, const void *k, int n, const int bf16) {
#ifdef __AVX512BF16__
    if (bf16) return dot_bf16((const bf16_t *)q, (const bf16_t *)k, n);
#endif
    return dot((const float *)q, k, n, bf16);
}

/* Prefetch one slot's keys and values (all kv heads: `bytes` each). */
static inline void prefetch_slot(const char *k, int64_t v_bytes, int64_t bytes) {
    for (int64_t c = 0; c < bytes; c += 64) {
        __builtin_prefetch(k + c);
        __builtin_prefetch(k + v_bytes + c);
    }
}

/* One request: all its query heads over its whole context. The context is walked block by
   block and slot by slot, all kv heads of a slot at once, so keys and values stream through
   memory in address order inside a block; while a block is read, the same slot of the next
   block is prefetched (the blocks lie anywhere, so the hardware prefetcher stops at each).
   `sc`: scratch of HQ * n scores, then (bfloat16) HQ * D floats each for the widened queries and
   the output sums. */
static inline __attribute__((always_inline)) void attend(const job_t *j, int64_t b, float *sc, const int bf16) {
    const int D = j->head_dim, H = j->kv_heads, G = j->group, HQ = H * G, tpb = j->tokens_per_block;
    const int row = H * D;
    const int64_t n = j->context_lens[b];
    const int64_t *table = j->block_table + b * j->max_blocks;
    const int64_t elem = bf16 ? (int64_t)sizeof(bf16_t) : (int64_t)sizeof(float);
    const void *q = elem_at(j->q, b * (int64_t)HQ * D, bf16);
    float *out = (float *)elem_at(j->out, b * (int64_t)HQ * D, bf16);
    if (bf16) {  /* sum the output in float32; widen the queries once (without avx512_bf16) */
        float *wide = sc + HQ * n;
        if (WIDEN_QUERIES) {
            for (int c = 0; c < HQ * D; c += 8) store8(wide + c, load8_at(q, c, 1));
            q = wide;
        }
        out = wide + HQ * D;
    }
    for (int64_t t0 = 0, blk = 0; t0 < n; t0 += tpb, blk++) {
        const void *k = elem_at(j->pool, table[blk] * j->block_stride, bf16);
        const void *next = t0 + tpb < n ? elem_at(j->pool, table[blk + 1] * j->block_stride, bf16) : NULL;
        const int64_t end = n - t0 < tpb ? n - t0 : tpb;
        for (int64_t s = 0; s < end; s++, k = elem_at(k, row, bf16)) {
            if (next) prefetch_slot((const char *)next + s * row * elem, j->v_offset * elem, row * elem);
            for (int hq = 0; hq < HQ; hq++)
                sc[hq * n + t0 + s] = rounded(rounded(score(elem_at(q, hq * D, bf16 && !WIDEN_QUERIES),
                                                            elem_at(k, (hq / G) * D, bf16), D, bf16), bf16)
                                              * j->scale, bf16);
        }
    }
    for (int hq = 0; hq < HQ; hq++) {
        float *s = sc + hq * n, m = s[0], sum = 0;
        for (int64_t t = 1; t < n; t++) m = s[t] > m ? s[t] : m;
        for (int64_t t = 0; t < n; t++) s[t] = exp_clamped(s[t] - m);
        for (int64_t t = 0; t < n; t++) sum += s[t];
        const float inv = 1.0f / sum;
        for (int64_t t = 0; t < n; t++) s[t] = rounded(s[t] * inv, bf16);
    }
    /* out[hq] = sum over t of p[hq, t] v[t, hq / G], in slices of 32 (then 8) floats whose sums
       stay in registers over the whole context (the values of one kv head stay in cache) */
    for (int hq = 0; hq < HQ; hq++) {
        const float *p = sc + hq * n;
        const int64_t head = (int64_t)(hq / G) * D + j->v_offset;
        int c0 = 0;
        for (; c0 + 32 <= D; c0 += 32) {
            v8f a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
            for (int64_t t0 = 0, blk = 0; t0 < n; t0 += tpb, blk++) {
                const void *v = elem_at(j->pool, table[blk] * j->block_stride + head + c0, bf16);
                const int64_t end = n - t0 < tpb ? n - t0 : tpb;
                for (int64_t s = 0; s < end; s++, v = elem_at(v, row, bf16)) {
                    const float w = p[t0 + s];
                    a0 += w * load8_at(v, 0, bf16);
                    a1 += w * load8_at(v, 8, bf16);
                    a2 += w * load8_at(v, 16, bf16);
                    a3 += w * load8_at(v, 24, bf16);
                }
            }
            float *o = out + hq * D + c0;
            store8(o, a0), store8(o + 8, a1), store8(o + 16, a2), store8(o + 24, a3);
        }
        for (; c0 < D; c0 += 8) {
            v8f a = {0};
            for (int64_t t0 = 0, blk = 0; t0 < n; t0 += tpb, blk++) {
                const void *v = elem_at(j->pool, table[blk] * j->block_stride + head + c0, bf16);
                const int64_t end = n - t0 < tpb ? n - t0 : tpb;
                for (int64_t s = 0; s < end; s++, v = elem_at(v, row, bf16)) a += p[t0 + s] * load8_at(v, 0, bf16);
            }
            store8(out + hq * D + c0, a);
        }
    }
    if (bf16) {
        bf16_t *dst = (bf16_t *)elem_at(j->out, b * (int64_t)HQ * D, 1);
        for (int c = 0; c < HQ * D; c += 8) store8_bf16(dst + c, load8(out + c));
    }
}

static void attend_item(void *ctx, int64_t b) {
    job_t *j = (job_t *)ctx;
    const size_t heads = (size_t)j->kv_heads * (size_t)j->group;
    float *sc = thread_scratch(heads * (size_t)j->context_lens[b] + (j->bf16 ? 2 * heads * (size_t)j->head_dim : 0));
    if (!sc) {
        __atomic_store_n(&j->failed, 1, __ATOMIC_RELAXED);
        return;
    }
    if (j->bf16)
        attend(j, b, sc, 1);
    else
        attend(j, b, sc, 0);
}

/* Returns 0, or -1 when scratch memory cannot be had. k_new/v_new: [B, kv_heads, head_dim];
   q, k_new, v_new, pool and out all float32, or all bfloat16 when `bf16` is set. */
int pf_paged_decode_attention(const void *q, const void *k_new, const void *v_new, void *pool,
                              int64_t block_stride, int64_t v_offset, int tokens_per_block,
                              int kv_heads, int group, int head_dim, const int64_t *block_table,
                              int64_t max_blocks, const int64_t *context_lens, int64_t num_seqs,
                              float scale, void *out, int bf16, int num_threads) {
    if (num_seqs <= 0) return 0;
    const int64_t vec = (int64_t)kv_heads * head_dim, elem = bf16 ? (int64_t)sizeof(bf16_t) : (int64_t)sizeof(float);
    for (int64_t b = 0; b < num_seqs; b++) {
        const int64_t pos = context_lens[b] - 1, blk = block_table[b * max_blocks + pos / tokens_per_block];
        char *slot = (char *)pool + (blk * block_stride + (pos % tokens_per_block) * vec) * elem;
        memcpy(slot, (const char *)k_new + b * vec * elem, (size_t)(vec * elem));
        memcpy(slot + v_offset * elem, (const char *)v_new + b * vec * elem, (size_t)(vec * elem));
    }
    job_t job = {q, pool, block_stride, v_offset, tokens_per_block, kv_heads, group, head_dim,
                 block_table, max_blocks, context_lens, scale, out, bf16, 0};
    pf_pool_run(attend_item, &job, num_seqs, num_threads);
    return job.failed ? -1 : 0;
}
