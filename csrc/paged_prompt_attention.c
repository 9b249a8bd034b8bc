/* Paged prompt attention on CPU, float32: any number of new tokens per request (whole prompts,
 * chunks after cached context, single decode tokens alike), causal, reading the context where
 * it lies in the block pool.
 *
 * Place in the data flow: engine/kernels/native_attention.py loads this file (through
 * engine/kernels/native_build.py) and calls `pf_paged_prompt_attention` from `paged_attention`
 * (engine/worker/attention.py) for every layer of a CPU float32 batch holding a prompt. It first
 * stores every new token's key and value into its slot, then attends each new token over its
 * request's context up to its own position. The torch path it replaces spent a 128-token
 * SmolLM2 prefill's attention in scaled_dot_product_attention (0.44 ms per layer for 9.4 MFLOP)
 * and index_copy_ (0.12 ms) on the 2-core AVX-512 VM.
 *
 * Work items: (request, kv head, tile of up to 16 new tokens), claimed by the kernels' thread pool
 * (thread_pool.c). An item walks the keys in chunks of 64: it copies the chunk's keys of its kv
 * head into a transposed [head_dim][64] tile and its values into [64][head_dim] (both stay in
 * L1), then takes its query vectors (tokens x the kv head's `group` query heads) two tokens at a
 * time: the scores of the chunk are head_dim broadcast multiply-adds into vectors across keys (no
 * horizontal sums; each key vector loaded once for both tokens), the keys past a token's
 * position dropped, and a running (online) softmax rescales its sums by exp(old max - new max)
 * before adding the chunk's probability-weighted values. Same operations as softmax(q k^T *
 * scale) v, in float32; the sums are taken in another order, so results match the torch path to
 * float32 rounding, not bitwise. It reaches ~45% of the FMA peak, so past ~500 tokens of context
 * torch's blocked matrix products are faster: the caller keeps those batches on the torch path
 * (native_attention.PROMPT_KERNEL_MAX_CONTEXT).
 *
 * Pool layout (one model's view, in floats): block b starts at pool + b * block_stride; the key
 * of slot s, head h at + (s * kv_heads + h) * head_dim, its value at + v_offset + the same.
 * head_dim must be a multiple of 8 (the caller checks).
 */
#include <stdlib.h>

#include "thread_pool.h"
#include "thread_scratch.h"
#include "vec_math.h"

#ifdef __AVX512F__
typedef float kvec __attribute__((vector_size(64))); /* scores of 16 keys */
#else
typedef v8f kvec;
#endif
#define KW ((int)(sizeof(kvec) / sizeof(float)))
#define KC 64          /* keys per chunk */
#define NKV (KC / KW)  /* score vectors per chunk */
#define QT 16          /* new tokens per work item */
#define NEG_BIG (-3.0e38f)

static inline kvec load_k(const float *p) { kvec v; memcpy(&v, p, sizeof v); return v; }
static inline void store_k(float *p, kvec v) { memcpy(p, &v, sizeof v); }

typedef struct {
    const float *q;              /* [T, kv_heads * group, head_dim], packed new tokens */
    float *pool;
    int64_t block_stride, v_offset;
    int tpb, kv_heads, group, head_dim;
    const int64_t *block_table;  /* [B, max_blocks] */
    int64_t max_blocks;
    const int64_t *context_lens; /* [B]: tokens in the pool after this step */
    const int64_t *query_start;  /* [B + 1]: request b owns packed tokens [b]:[b + 1] */
    int64_t num_seqs;
    float scale;
    float *out;                  /* [T, kv_heads * group * head_dim] */
    const int64_t *item_start;   /* [B + 1]: request b owns work items [b]:[b + 1] */
    int failed;
} job_t;

/* a0/a1 [0, count) += q0/q1 . the chunk's key vectors, from the transposed tile kt [D][KC]: per
   d, one load of each key vector feeds both queries' broadcasts. Inlined, so a constant `count`
   keeps the sums in registers as independent chains. */
static inline __attribute__((always_inline)) void score_pair(const float *q0, const float *q1, const float *kt,
                                                             int D, int count, kvec *a0, kvec *a1) {
    for (int d = 0; d < D; d++) {
        const kvec x0 = q0[d] - (kvec){0}, x1 = q1[d] - (kvec){0};
        for (int v = 0; v < count; v++) {
            const kvec key = load_k(kt + d * KC + v * KW);
            a0[v] += x0 * key;
            a1[v] += x1 * key;
        }
    }
}

/* s0/s1 [0, nv * KW) = (q0/q1 . key k) * scale for the chunk's keys (q1 NULL: q0 alone); the
   whole-chunk pair runs with the constant count NKV. */
static inline void scores(const float *q0, const float *q1, const float *kt, int D, int nv, float scale,
                          float *s0, float *s1) {
    kvec a0[NKV], a1[NKV];
    for (int v = 0; v < NKV; v++) a0[v] = a1[v] = (kvec){0};
    if (q1 && nv == NKV) {
        score_pair(q0, q1, kt, D, NKV, a0, a1);
    } else if (q1) {
        score_pair(q0, q1, kt, D, nv, a0, a1);
    } else {
        for (int d = 0; d < D; d++) {
            const kvec x0 = q0[d] - (kvec){0};
            for (int v = 0; v < nv; v++) a0[v] += x0 * load_k(kt + d * KC + v * KW);
        }
    }
    for (int v = 0; v < nv; v++) {
        store_k(s0 + v * KW, a0[v] * scale);
        if (q1) store_k(s1 + v * KW, a1[v] * scale);
    }
}

/* The online softmax's step for one query over a chunk: scores s[0, valid) become exp(s - m)
   for the new running maximum m, s[valid, n) zero (keys past the token); the running maximum and
   sum move on; returns exp(old maximum - m), the factor its value sums are rescaled by. */
static inline float softmax_step(float *s, int valid, int n, float *mx, float *sum) {
    float m = *mx;
    for (int k = 0; k < valid; k++) m = s[k] > m ? s[k] : m;
    const float correction = exp_clamped(*mx - m);
    float total = 0.0f;
    for (int k = 0; k < valid; k++) {
        s[k] = exp_clamped(s[k] - m);
        total += s[k];
    }
    for (int k = valid; k < n; k++) s[k] = 0.0f;
    *mx = m;
    *sum = *sum * correction + total;
    return correction;
}

/* a0/a1 [0, D) = a * correction + sum over k < n of p[k] * vc[k][0, D) (a1 NULL: a0 alone):
   slices of 2 vectors per query (the value vectors loaded once for both; 4 independent sums in
   registers, keys innermost), then of 8 floats. */
static inline void weigh_values(float *a0, float c0, const float *p0, float *a1, float c1, const float *p1, int n,
                                const float *vc, int D) {
    int c = 0;
    for (; c + 2 * KW <= D; c += 2 * KW) {
        kvec o0[2], o1[2];
        for (int u = 0; u < 2; u++) {
            o0[u] = load_k(a0 + c + KW * u) * c0;
            o1[u] = a1 ? load_k(a1 + c + KW * u) * c1 : (kvec){0};
        }
        if (a1) {
            for (int k = 0; k < n; k++) {
                const kvec w0 = p0[k] - (kvec){0}, w1 = p1[k] - (kvec){0};
                const float *v = vc + (size_t)k * D + c;
                for (int u = 0; u < 2; u++) {
                    const kvec value = load_k(v + KW * u);
                    o0[u] += w0 * value;
                    o1[u] += w1 * value;
                }
            }
        } else {
            for (int k = 0; k < n; k++) {
                const kvec w0 = p0[k] - (kvec){0};
                for (int u = 0; u < 2; u++) o0[u] += w0 * load_k(vc + (size_t)k * D + c + KW * u);
            }
        }
        for (int u = 0; u < 2; u++) {
            store_k(a0 + c + KW * u, o0[u]);
            if (a1) store_k(a1 + c + KW * u, o1[u]);
        }
    }
    for (; c < D; c += 8) {
        v8f o0 = load8(a0 + c) * c0, o1 = a1 ? load8(a1 + c) * c1 : (v8f){0};
        for (int k = 0; k < n; k++) {
            const v8f value = load8(vc + (size_t)k * D + c);
            o0 += p0[k] * value;
            if (a1) o1 += p1[k] * value;
        }
        store8(a0 + c, o0);
        if (a1) store8(a1 + c, o1);
    }
}

static inline const float *slot_of(const job_t *j, int64_t b, int64_t pos) {
    const int64_t blk = j->block_table[b * j->max_blocks + pos / j->tpb];
    return j->pool + blk * j->block_stride + (pos % j->tpb) * (int64_t)j->kv_heads * j->head_dim;
}

static void attend_item(void *ctx, int64_t item) {
    job_t *j = (job_t *)ctx;
    int64_t lo = 0, hi = j->num_seqs; /* the request owning this item: item_start[lo] <= item */
    while (hi - lo > 1) {
        const int64_t mid = (lo + hi) / 2;
        if (j->item_start[mid] <= item) lo = mid; else hi = mid;
    }
    const int64_t b = lo, first = j->query_start[b], qlen = j->query_start[b + 1] - first;
    const int64_t tiles = (qlen + QT - 1) / QT, local = item - j->item_start[b];
    const int h = (int)(local / tiles), G = j->group, D = j->head_dim, HQ = j->kv_heads * G;
    const int64_t r0 = (local % tiles) * QT, r1 = r0 + QT < qlen ? r0 + QT : qlen;
    const int64_t base = j->context_lens[b] - qlen; /* position of the request's first new token */
    const int nq = (int)(r1 - r0) * G;
    float *acc = thread_scratch((size_t)nq * D + 2 * (size_t)nq + 2 * (size_t)KC * D + 2 * KC);
    if (!acc) {
        __atomic_store_n(&j->failed, 1, __ATOMIC_RELAXED);
        return;
    }
    float *mx = acc + (size_t)nq * D, *sum = mx + nq, *kt = sum + nq, *vc = kt + (size_t)KC * D, *s = vc + (size_t)KC * D;
    for (int i = 0; i < nq; i++) mx[i] = NEG_BIG, sum[i] = 0.0f;
    memset(acc, 0, sizeof(float) * (size_t)nq * D);
    const int64_t last = base + r1 - 1; /* the last key any token of this item sees */
    for (int64_t c0 = 0; c0 <= last; c0 += KC) {
        const int nk = last + 1 - c0 < KC ? (int)(last + 1 - c0) : KC;
        for (int k = 0; k < nk; k++) {
            const float *key = slot_of(j, b, c0 + k) + (int64_t)h * D;
            for (int d = 0; d < D; d++) kt[d * KC + k] = key[d];
            memcpy(vc + (size_t)k * D, key + j->v_offset, sizeof(float) * D);
        }
        for (int d = 0; d < D; d++)
            for (int k = nk; k < KC; k++) kt[d * KC + k] = 0.0f;
        for (int g = 0; g < G; g++)  /* the item's tokens in pairs: each key loaded once for two queries */
            for (int64_t r = r0; r < r1; ) {
                if (base + r < c0) {  /* this chunk lies past the token */
                    r++;
                    continue;
                }
                const int pair = r + 1 < r1;
                const int v0 = base + r - c0 + 1 < nk ? (int)(base + r - c0 + 1) : nk;
                const int v1 = pair ? (v0 < nk ? v0 + 1 : nk) : 0, n = pair ? v1 : v0;
                const int q0 = (int)(r - r0) * G + g, q1 = q0 + G;
                const float *x0 = j->q + ((first + r) * HQ + h * G + g) * (int64_t)D;
                scores(x0, pair ? x0 + (int64_t)HQ * D : NULL, kt, D, (n + KW - 1) / KW, j->scale, s, s + KC);
                const float f0 = softmax_step(s, v0, n, mx + q0, sum + q0);
                const float f1 = pair ? softmax_step(s + KC, v1, n, mx + q1, sum + q1) : 0.0f;
                weigh_values(acc + (size_t)q0 * D, f0, s, pair ? acc + (size_t)q1 * D : NULL, f1, s + KC, n, vc, D);
                r += pair ? 2 : 1;
            }
    }
    for (int64_t r = r0; r < r1; r++)
        for (int g = 0; g < G; g++) {
            const int qi = (int)(r - r0) * G + g;
            const float inv = 1.0f / sum[qi];
            float *o = j->out + ((first + r) * HQ + h * G + g) * (int64_t)D;
            for (int c = 0; c < D; c += 8) store8(o + c, load8(acc + (size_t)qi * D + c) * inv);
        }
}

/* Returns 0, or -1 when scratch memory cannot be had. q [T, kv_heads * group, head_dim], k_new /
   v_new [T, kv_heads, head_dim] (T = query_start[num_seqs]), all float32; out [T, kv_heads *
   group * head_dim]. */
int pf_paged_prompt_attention(const float *q, const float *k_new, const float *v_new, float *pool,
                              int64_t block_stride, int64_t v_offset, int tokens_per_block, int kv_heads,
                              int group, int head_dim, const int64_t *block_table, int64_t max_blocks,
                              const int64_t *context_lens, const int64_t *query_start, int64_t num_seqs,
                              float scale, float *out, int num_threads) {
    if (num_seqs <= 0) return 0;
    int64_t *item_start = malloc(sizeof(int64_t) * (size_t)(num_seqs + 1));
    if (!item_start) return -1;
    job_t job = {q, pool, block_stride, v_offset, tokens_per_block, kv_heads, group, head_dim, block_table,
                 max_blocks, context_lens, query_start, num_seqs, scale, out, item_start, 0};
    const int64_t vec = (int64_t)kv_heads * head_dim;
    item_start[0] = 0;
    for (int64_t b = 0; b < num_seqs; b++) {
        const int64_t first = query_start[b], qlen = query_start[b + 1] - first, base = context_lens[b] - qlen;
        for (int64_t t = 0; t < qlen; t++) {
            float *slot = (float *)slot_of(&job, b, base + t);
            memcpy(slot, k_new + (first + t) * vec, sizeof(float) * (size_t)vec);
            memcpy(slot + v_offset, v_new + (first + t) * vec, sizeof(float) * (size_t)vec);
        }
        item_start[b + 1] = item_start[b] + kv_heads * ((qlen + QT - 1) / QT);
    }
    pf_pool_run(attend_item, &job, item_start[num_seqs], num_threads);
    free(item_start);
    return job.failed ? -1 : 0;
}
