/* Paged decode attention on CPU, float32 or bfloat16: one query token per request, reading the
 * request's keys and values where they lie in the block pool (no gather into a contiguous copy).
 *
 * Place in the data flow: engine/native_build.py compiles this file once per machine, and
 * engine/native_attention.py loads it with ctypes and calls `pf_paged_decode_attention` from
 * `paged_attention` for every layer of a CPU decode batch. The function first stores each
 * request's new key/value vectors into their slots (the last position of its context), then,
 * for every request, computes all its query heads' attention over the whole context (query head
 * h * group + g reads kv head h): the same operations as the torch path (scores * scale,
 * softmax, @ V), in float32, without materialising the context.
 * float32: one pass, block by block, with the online softmax of flash attention (attend_f32), so
 * the next block streams in while a block's softmax and weighted sum run; results equal the
 * torch path's to float32 rounding. bfloat16 (queries, pool and output; `bf16` set): two passes
 * (attend_bf16), the math in float32 (keys and values widened as they are read), rounded to
 * bfloat16 where the torch path's bfloat16 tensors round: each score, the scaled score, each
 * probability (after the sum over the whole context) and the output.
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

/* bfloat16 query head . key head: both bfloat16 where the CPU has avx512_bf16, else the query
   widened to float32 */
static inline __attribute__((always_inline)) float score(const void *q, const bf16_t *k, int n) {
#ifdef __AVX512BF16__
    return dot_bf16((const bf16_t *)q, k, n);
#else
    return dot((const float *)q, k, n, 1);
#endif
}

/* Prefetch `bytes` from p into L2, not L1 (prefetcht1): on the 2-core AMD EPYC VM, prefetches
   into L1 wait for its few line-fill buffers and stall the loop that issues them; into L2 the
   decode kernel ran 1.2x faster. */
static inline void prefetch_row(const char *p, int64_t bytes) {
    for (int64_t c = 0; c < bytes; c += 64) __builtin_prefetch(p + c, 0, 2);
}

/* Prefetch one slot's keys and values (all kv heads: `bytes` each). */
static inline void prefetch_slot(const char *k, int64_t v_bytes, int64_t bytes) {
    prefetch_row(k, bytes);
    prefetch_row(k + v_bytes, bytes);
}

/* Prefetch the first `slots` slots of a block (its first block: nothing before it fetched it). */
static inline void prefetch_block(const char *block, int64_t slots, int64_t v_bytes, int64_t row_bytes) {
    for (int64_t s = 0; s < slots; s++) prefetch_slot(block + s * row_bytes, v_bytes, row_bytes);
}

/* float32, one pass over the context block by block (the online softmax of flash attention): a
   block's scores, their exponentials against the running maximum (the sums so far rescaled
   when it grows), then its values weighed into the output, all while the next block streams in
   (its keys prefetched slot by slot with the scores, its values with the weighted sums), so
   memory stays busy while the softmax and the weighted sum run. `p`: scratch of HQ * tokens_per_block weights, then HQ maxima and HQ sums. */
static void attend_f32(const job_t *j, int64_t b, float *p) {
    const int D = j->head_dim, H = j->kv_heads, G = j->group, HQ = H * G, tpb = j->tokens_per_block;
    const int row = H * D;
    const int64_t n = j->context_lens[b];
    const int64_t *table = j->block_table + b * j->max_blocks;
    const float *q = (const float *)j->q + b * (int64_t)HQ * D;
    float *out = (float *)j->out + b * (int64_t)HQ * D;
    float *m = p + HQ * tpb, *l = m + HQ;
    const float *pool = (const float *)j->pool;
    for (int hq = 0; hq < HQ; hq++) m[hq] = -3.0e38f, l[hq] = 0;
    memset(out, 0, sizeof(float) * (size_t)(HQ * D));
    prefetch_block((const char *)(pool + table[0] * j->block_stride), n < tpb ? n : tpb, j->v_offset * 4, row * 4);
    for (int64_t t0 = 0, blk = 0; t0 < n; t0 += tpb, blk++) {
        const float *k = pool + table[blk] * j->block_stride, *v = k + j->v_offset;
        const char *next = t0 + tpb < n ? (const char *)(pool + table[blk + 1] * j->block_stride) : NULL;
        const int64_t end = n - t0 < tpb ? n - t0 : tpb;
        const int64_t next_end = next ? (n - t0 - tpb < tpb ? n - t0 - tpb : tpb) : 0;
        for (int64_t s = 0; s < end; s++) {
            if (s < next_end) prefetch_row(next + s * row * 4, row * 4);
            for (int hq = 0; hq < HQ; hq++)
                p[hq * tpb + s] = dot(q + hq * D, k + s * row + (hq / G) * D, D, 0) * j->scale;
        }
        for (int64_t s = end; s < next_end; s++) prefetch_row(next + s * row * 4, row * 4);
        for (int hq = 0; hq < HQ; hq++) {
            float *w = p + hq * tpb, top = m[hq], sum = 0;
            for (int64_t s = 0; s < end; s++) top = w[s] > top ? w[s] : top;
            for (int64_t s = 0; s < end; s++) w[s] = exp_clamped(w[s] - top);
            for (int64_t s = 0; s < end; s++) sum += w[s];
            if (top > m[hq]) {  /* the sums so far were against a smaller maximum */
                const float shrink = exp_clamped(m[hq] - top);
                l[hq] *= shrink;
                for (int c = 0; c < D; c++) out[hq * D + c] *= shrink;
                m[hq] = top;
            }
            l[hq] += sum;
        }
        for (int hq = 0; hq < HQ; hq++) {
            const float *w = p + hq * tpb, *vh = v + (hq / G) * D;
            float *o = out + hq * D;
            for (int64_t s = hq * next_end / HQ; s < (hq + 1) * next_end / HQ; s++)
                prefetch_row(next + (j->v_offset + s * row) * 4, row * 4);
            int c0 = 0;
            for (; c0 + 32 <= D; c0 += 32) {
                v8f a0 = load8(o + c0), a1 = load8(o + c0 + 8), a2 = load8(o + c0 + 16), a3 = load8(o + c0 + 24);
                for (int64_t s = 0; s < end; s++) {
                    const float *x = vh + s * row + c0;
                    a0 += w[s] * load8(x), a1 += w[s] * load8(x + 8), a2 += w[s] * load8(x + 16), a3 += w[s] * load8(x + 24);
                }
                store8(o + c0, a0), store8(o + c0 + 8, a1), store8(o + c0 + 16, a2), store8(o + c0 + 24, a3);
            }
            for (; c0 < D; c0 += 8) {
                v8f a = load8(o + c0);
                for (int64_t s = 0; s < end; s++) a += w[s] * load8(vh + s * row + c0);
                store8(o + c0, a);
            }
        }
    }
    for (int hq = 0; hq < HQ; hq++) {
        const float inv = 1.0f / l[hq];
        for (int c = 0; c < D; c++) out[hq * D + c] *= inv;
    }
}

/* bfloat16, two passes: the scores of the whole context (each rounded where the torch path's
   bfloat16 tensors round), the softmax (each probability rounded, so the sum over the whole
   context comes first), then the weighted values. Slots are read in address order inside a
   block, all kv heads at once, and the same slot of the next block is prefetched (the blocks lie
   anywhere, so the hardware prefetcher stops at each). `sc`: scratch of HQ * n scores, then
   HQ * D floats each for the widened queries and the output sums. */
static void attend_bf16(const job_t *j, int64_t b, float *sc) {
    const int D = j->head_dim, H = j->kv_heads, G = j->group, HQ = H * G, tpb = j->tokens_per_block;
    const int row = H * D;
    const int64_t n = j->context_lens[b];
    const int64_t *table = j->block_table + b * j->max_blocks;
    const bf16_t *pool = (const bf16_t *)j->pool;
    const void *q = (const bf16_t *)j->q + b * (int64_t)HQ * D;
    float *wide = sc + HQ * n, *out = wide + HQ * D;  /* the output summed in float32 */
    if (WIDEN_QUERIES) {  /* without avx512_bf16: the queries widened once */
        for (int c = 0; c < HQ * D; c += 8) store8(wide + c, load8_bf16((const bf16_t *)q + c));
        q = wide;
    }
    prefetch_block((const char *)(pool + table[0] * j->block_stride), n < tpb ? n : tpb, j->v_offset * 2, row * 2);
    for (int64_t t0 = 0, blk = 0; t0 < n; t0 += tpb, blk++) {
        const bf16_t *k = pool + table[blk] * j->block_stride;
        const char *next = t0 + tpb < n ? (const char *)(pool + table[blk + 1] * j->block_stride) : NULL;
        const int64_t end = n - t0 < tpb ? n - t0 : tpb;
        for (int64_t s = 0; s < end; s++, k += row) {
            if (next) prefetch_slot(next + s * row * 2, j->v_offset * 2, row * 2);
            for (int hq = 0; hq < HQ; hq++)
                sc[hq * n + t0 + s] = round_bf16(round_bf16(score(elem_at(q, hq * D, !WIDEN_QUERIES), k + (hq / G) * D, D))
                                                 * j->scale);
        }
    }
    for (int hq = 0; hq < HQ; hq++) {
        float *s = sc + hq * n, m = s[0], sum = 0;
        for (int64_t t = 1; t < n; t++) m = s[t] > m ? s[t] : m;
        for (int64_t t = 0; t < n; t++) s[t] = exp_clamped(s[t] - m);
        for (int64_t t = 0; t < n; t++) sum += s[t];
        const float inv = 1.0f / sum;
        for (int64_t t = 0; t < n; t++) s[t] = round_bf16(s[t] * inv);
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
                const bf16_t *v = pool + table[blk] * j->block_stride + head + c0;
                const int64_t end = n - t0 < tpb ? n - t0 : tpb;
                for (int64_t s = 0; s < end; s++, v += row) {
                    const float w = p[t0 + s];
                    a0 += w * load8_bf16(v), a1 += w * load8_bf16(v + 8);
                    a2 += w * load8_bf16(v + 16), a3 += w * load8_bf16(v + 24);
                }
            }
            float *o = out + hq * D + c0;
            store8(o, a0), store8(o + 8, a1), store8(o + 16, a2), store8(o + 24, a3);
        }
        for (; c0 < D; c0 += 8) {
            v8f a = {0};
            for (int64_t t0 = 0, blk = 0; t0 < n; t0 += tpb, blk++) {
                const bf16_t *v = pool + table[blk] * j->block_stride + head + c0;
                const int64_t end = n - t0 < tpb ? n - t0 : tpb;
                for (int64_t s = 0; s < end; s++, v += row) a += p[t0 + s] * load8_bf16(v);
            }
            store8(out + hq * D + c0, a);
        }
    }
    bf16_t *dst = (bf16_t *)j->out + b * (int64_t)HQ * D;
    for (int c = 0; c < HQ * D; c += 8) store8_bf16(dst + c, load8(out + c));
}

static void attend_item(void *ctx, int64_t b) {
    job_t *j = (job_t *)ctx;
    const size_t heads = (size_t)j->kv_heads * (size_t)j->group;
    float *sc = j->bf16 ? thread_scratch(heads * ((size_t)j->context_lens[b] + 2 * (size_t)j->head_dim))
                        : thread_scratch(heads * ((size_t)j->tokens_per_block + 2));
    if (!sc) {
        __atomic_store_n(&j->failed, 1, __ATOMIC_RELAXED);
        return;
    }
    if (j->bf16)
        attend_bf16(j, b, sc);
    else
        attend_f32(j, b, sc);
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
