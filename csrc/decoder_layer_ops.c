/* The per-row work around the projections on CPU, float32 and bfloat16: RMSNorm (with the
 * residual add fused in), the rotary embedding of queries and keys (in place), SiLU(gate) * up,
 * and the greedy pick (argmax, float32) over a last stage's logits.
 *
 * Place in the data flow: engine/native_ops.py compiles this file once per machine (through
 * engine/native_build.py, with -ffp-contract=off so that no multiply-add is fused: the rotation
 * gives the torch path's bits) and `engine/model/layer_ops.py` calls it from every layer of a
 * CPU float32 stage, one call where the torch path runs 3-8 small ops (the sampler calls the
 * argmax: torch's goes parallel and stalls when the other core is busy). Rows are contiguous.
 * The torch path's arithmetic is kept: RMSNorm is w * (x * (1 / sqrt(mean(x^2) + eps))) (only the
 * order of the sum of squares differs), SiLU is g / (1 + e^-g) with the exponential of
 * vec_math.h. The bfloat16 variants (`_bf16`) widen to float32, compute the same formulas and
 * round to bfloat16 (bf16.h) at the points where the torch formulas of layer_ops.py do: the
 * residual sum, x * inv before the weight, each product and the sum of the rotation, SiLU
 * before the multiply by up, and every output.
 */
#include <math.h>

#include "bf16.h"
#include "thread_pool.h"
#include "vec_math.h"

/* o = w * (x * (1 / sqrt(mean(x^2) + eps))) for one row of n floats. */
static void norm_row(const float *x, const float *w, float *o, int64_t n, float eps) {
    v8f acc = {0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const v8f v = load8(x + i);
        acc += v * v;
    }
    float s = 0;
    for (int k = 0; k < 8; k++) s += acc[k];
    for (; i < n; i++) s += x[i] * x[i];
    const float inv = 1.0f / sqrtf(s / (float)n + eps);
    for (i = 0; i < n; i++) o[i] = w[i] * (x[i] * inv);
}

/* The row loops: fn(ctx, r0, r1) over [0, rows), split into chunks for the kernels' thread pool
   when there are at least this many floats (prompts); a decode batch's rows stay on the calling
   thread. */
#define PARALLEL_MIN_FLOATS 65536
typedef void (*rows_fn)(const void *ctx, int64_t r0, int64_t r1);
typedef struct {
    rows_fn fn;
    const void *ctx;
    int64_t rows, chunk;
} split_t;

static void split_item(void *c, int64_t i) {
    const split_t *s = (const split_t *)c;
    const int64_t r0 = i * s->chunk, r1 = r0 + s->chunk < s->rows ? r0 + s->chunk : s->rows;
    s->fn(s->ctx, r0, r1);
}

static void over_rows(rows_fn fn, const void *ctx, int64_t rows, int64_t floats_per_row, int threads) {
    if (threads <= 1 || rows * floats_per_row < PARALLEL_MIN_FLOATS) {
        fn(ctx, 0, rows);
        return;
    }
    const int64_t pieces = 4 * (int64_t)threads;  /* a few chunks per thread: late workers still help */
    split_t s = {fn, ctx, rows, (rows + pieces - 1) / pieces};
    pf_pool_run(split_item, &s, (rows + s.chunk - 1) / s.chunk, threads);
}

typedef struct {
    float *stream;
    const float *x, *w;
    float *out;
    int64_t n;
    float eps;
} norm_t;

static void norm_rows(const void *c, int64_t r0, int64_t r1) {
    const norm_t *a = (const norm_t *)c;
    for (int64_t r = r0; r < r1; r++) norm_row(a->x + r * a->n, a->w, a->out + r * a->n, a->n, a->eps);
}

/* stream[r] += x[r], then out[r] = RMSNorm(stream[r]) */
static void add_norm_rows(const void *c, int64_t r0, int64_t r1) {
    const norm_t *a = (const norm_t *)c;
    for (int64_t r = r0; r < r1; r++) {
        float *sr = a->stream + r * a->n, *o = a->out + r * a->n;
        const float *xr = a->x + r * a->n;
        for (int64_t i = 0; i < a->n; i++) sr[i] += xr[i];
        norm_row(sr, a->w, o, a->n, a->eps);
    }
}

/* out[r] = RMSNorm(x[r]) (norm_row) for rows r of n floats. */
void pf_rms_norm(const float *x, const float *w, float *out, int64_t rows, int64_t n, float eps, int num_threads) {
    const norm_t a = {NULL, x, w, out, n, eps};
    over_rows(norm_rows, &a, rows, n, num_threads);
}

/* stream[r] += x[r] (the residual stream after the add), then out[r] = RMSNorm(stream[r]). */
void pf_add_rms_norm(float *stream, const float *x, const float *w, float *out, int64_t rows, int64_t n,
                     float eps, int num_threads) {
    const norm_t a = {stream, x, w, out, n, eps};
    over_rows(add_norm_rows, &a, rows, n, num_threads);
}

typedef struct {
    float *x;
    int64_t row_stride;
    int heads, head_dim;
    const float *cos, *ssin;
} rotary_t;

static void rotary_rows(const void *c, int64_t t0, int64_t t1) {
    const rotary_t *a = (const rotary_t *)c;
    const int half = a->head_dim / 2;
    for (int64_t t = t0; t < t1; t++) {
        const float *cs = a->cos + t * a->head_dim, *sn = a->ssin + t * a->head_dim;
        for (int h = 0; h < a->heads; h++) {
            float *p = a->x + t * a->row_stride + (int64_t)h * a->head_dim;
            for (int i = 0; i < half; i++) {
                const float lo_in = p[i], hi_in = p[i + half];
                const float lo = lo_in * cs[i] + hi_in * sn[i];
                const float hi = hi_in * cs[i + half] + lo_in * sn[i + half];
                p[i] = lo;
                p[i + half] = hi;
            }
        }
    }
}

/* Rotate the first `heads` heads of each row in place: with half = head_dim / 2,
   y[i] = x[i] cos[i] + x[i + half] ssin[i] and y[i + half] = x[i + half] cos[i + half] +
   x[i] ssin[i + half], where ssin is the sine with its first half negated (Rotary.cos_sin).
   x row t starts at x + t * row_stride; cos/ssin are [tokens, head_dim]. */
void pf_rotary(float *x, int64_t tokens, int64_t row_stride, int heads, int head_dim, const float *cos,
               const float *ssin, int num_threads) {
    const rotary_t a = {x, row_stride, heads, head_dim, cos, ssin};
    over_rows(rotary_rows, &a, tokens, (int64_t)heads * head_dim, num_threads);
}

typedef struct {
    const float *gate_up;
    float *out;
    int64_t inter;
} silu_t;

static void silu_rows(const void *c, int64_t r0, int64_t r1) {
    const silu_t *a = (const silu_t *)c;
    for (int64_t r = r0; r < r1; r++) {
        const float *gate = a->gate_up + r * 2 * a->inter, *up = gate + a->inter;
        float *o = a->out + r * a->inter;
        for (int64_t i = 0; i < a->inter; i++) {
            const float g = gate[i];
            o[i] = g / (1.0f + exp_clamped(-g)) * up[i];
        }
    }
}

/* out[r, i] = silu(gate_up[r, i]) * gate_up[r, inter + i], silu(g) = g / (1 + e^-g). */
void pf_silu_mul(const float *gate_up, float *out, int64_t rows, int64_t inter, int num_threads) {
    const silu_t a = {gate_up, out, inter};
    over_rows(silu_rows, &a, rows, inter, num_threads);
}

/* ---- bfloat16 rows: float32 math inside, rounded where the torch formulas round ---- */

/* o = bf16(w * bf16(x * (1 / sqrt(mean(x^2) + eps)))) for one row of n bfloat16s. */
static void norm_row_bf16(const bf16_t *x, const bf16_t *w, bf16_t *o, int64_t n, float eps) {
    v8f acc = {0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const v8f v = load8_bf16(x + i);
        acc += v * v;
    }
    float s = 0;
    for (int k = 0; k < 8; k++) s += acc[k];
    for (int64_t j = i; j < n; j++) s += bf16_to_float(x[j]) * bf16_to_float(x[j]);
    const float inv = 1.0f / sqrtf(s / (float)n + eps);
    for (i = 0; i + 8 <= n; i += 8) store8_bf16(o + i, load8_bf16(w + i) * round8_bf16(load8_bf16(x + i) * inv));
    for (; i < n; i++) o[i] = float_to_bf16(bf16_to_float(w[i]) * round_bf16(bf16_to_float(x[i]) * inv));
}

typedef struct {
    bf16_t *stream;
    const bf16_t *x, *w;
    bf16_t *out;
    int64_t n;
    float eps;
} norm_bf16_t;

static void norm_rows_bf16(const void *c, int64_t r0, int64_t r1) {
    const norm_bf16_t *a = (const norm_bf16_t *)c;
    for (int64_t r = r0; r < r1; r++) norm_row_bf16(a->x + r * a->n, a->w, a->out + r * a->n, a->n, a->eps);
}

static void add_norm_rows_bf16(const void *c, int64_t r0, int64_t r1) {
    const norm_bf16_t *a = (const norm_bf16_t *)c;
    for (int64_t r = r0; r < r1; r++) {
        bf16_t *sr = a->stream + r * a->n, *o = a->out + r * a->n;
        const bf16_t *xr = a->x + r * a->n;
        int64_t i = 0;
        for (; i + 8 <= a->n; i += 8) store8_bf16(sr + i, load8_bf16(sr + i) + load8_bf16(xr + i));
        for (; i < a->n; i++) sr[i] = float_to_bf16(bf16_to_float(sr[i]) + bf16_to_float(xr[i]));
        norm_row_bf16(sr, a->w, o, a->n, a->eps);
    }
}

/* pf_rms_norm for bfloat16 rows and weight. */
void pf_rms_norm_bf16(const bf16_t *x, const bf16_t *w, bf16_t *out, int64_t rows, int64_t n, float eps,
                      int num_threads) {
    const norm_bf16_t a = {NULL, x, w, out, n, eps};
    over_rows(norm_rows_bf16, &a, rows, n, num_threads);
}

/* pf_add_rms_norm for bfloat16 rows and weight (the sum rounded to bfloat16 in the stream). */
void pf_add_rms_norm_bf16(bf16_t *stream, const bf16_t *x, const bf16_t *w, bf16_t *out, int64_t rows, int64_t n,
                          float eps, int num_threads) {
    const norm_bf16_t a = {stream, x, w, out, n, eps};
    over_rows(add_norm_rows_bf16, &a, rows, n, num_threads);
}

typedef struct {
    bf16_t *x;
    int64_t row_stride;
    int heads, head_dim;
    const bf16_t *cos, *ssin;
} rotary_bf16_t;

/* lo * c + hi * s with each product and the sum rounded to bfloat16 (torch's x * cos + roll(x) * sin) */
static inline v8f rotate8(v8f lo, v8f hi, v8f c, v8f s) { return round8_bf16(lo * c) + round8_bf16(hi * s); }

static void rotary_rows_bf16(const void *c, int64_t t0, int64_t t1) {
    const rotary_bf16_t *a = (const rotary_bf16_t *)c;
    const int half = a->head_dim / 2;
    for (int64_t t = t0; t < t1; t++) {
        const bf16_t *cs = a->cos + t * a->head_dim, *sn = a->ssin + t * a->head_dim;
        for (int h = 0; h < a->heads; h++) {
            bf16_t *p = a->x + t * a->row_stride + (int64_t)h * a->head_dim;
            int i = 0;
            for (; i + 8 <= half; i += 8) {
                const v8f lo = load8_bf16(p + i), hi = load8_bf16(p + i + half);
                store8_bf16(p + i, rotate8(lo, hi, load8_bf16(cs + i), load8_bf16(sn + i)));
                store8_bf16(p + i + half, rotate8(hi, lo, load8_bf16(cs + i + half), load8_bf16(sn + i + half)));
            }
            for (; i < half; i++) {
                const float lo = bf16_to_float(p[i]), hi = bf16_to_float(p[i + half]);
                p[i] = float_to_bf16(round_bf16(lo * bf16_to_float(cs[i])) + round_bf16(hi * bf16_to_float(sn[i])));
                p[i + half] = float_to_bf16(round_bf16(hi * bf16_to_float(cs[i + half]))
                                            + round_bf16(lo * bf16_to_float(sn[i + half])));
            }
        }
    }
}

/* pf_rotary for bfloat16 rows and bfloat16 cos/ssin. */
void pf_rotary_bf16(bf16_t *x, int64_t tokens, int64_t row_stride, int heads, int head_dim, const bf16_t *cos,
                    const bf16_t *ssin, int num_threads) {
    const rotary_bf16_t a = {x, row_stride, heads, head_dim, cos, ssin};
    over_rows(rotary_rows_bf16, &a, tokens, (int64_t)heads * head_dim, num_threads);
}

#define SILU_CHUNK 64

typedef struct {
    const bf16_t *gate_up;
    bf16_t *out;
    int64_t inter;
} silu_bf16_t;

static void silu_rows_bf16(const void *c, int64_t r0, int64_t r1) {
    const silu_bf16_t *a = (const silu_bf16_t *)c;
    for (int64_t r = r0; r < r1; r++) {
        const bf16_t *gate = a->gate_up + r * 2 * a->inter, *up = gate + a->inter;
        bf16_t *o = a->out + r * a->inter;
        for (int64_t i0 = 0; i0 < a->inter; i0 += SILU_CHUNK) {  /* widened chunks: float loops that vectorise */
            const int m = a->inter - i0 < SILU_CHUNK ? (int)(a->inter - i0) : SILU_CHUNK;
            float g[SILU_CHUNK];
            for (int k = 0; k < m; k++) g[k] = bf16_to_float(gate[i0 + k]);
            for (int k = 0; k < m; k++) g[k] = round_bf16(g[k] / (1.0f + exp_clamped(-g[k]))) * bf16_to_float(up[i0 + k]);
            narrow_row(g, o + i0, m);
        }
    }
}

/* pf_silu_mul for bfloat16 rows: bf16(bf16(silu(g)) * up). */
void pf_silu_mul_bf16(const bf16_t *gate_up, bf16_t *out, int64_t rows, int64_t inter, int num_threads) {
    const silu_bf16_t a = {gate_up, out, inter};
    over_rows(silu_rows_bf16, &a, rows, inter, num_threads);
}

/* out[r] = index of the first largest value of row r (of n floats), or of its first NaN (as
   torch.argmax). Eight lanes each keep their best value and its index; ties go to the lower
   index. */
void pf_argmax_rows(const float *x, int64_t rows, int64_t n, int64_t *out) {
    typedef int32_t v8i __attribute__((vector_size(32)));
    for (int64_t r = 0; r < rows; r++, x += n) {
        int64_t best = 0;
        int64_t i = 0;
        if (n >= 8) {
            v8f bv = load8(x);
            v8i bi = {0, 1, 2, 3, 4, 5, 6, 7}, ci = bi;
            const v8i step = {8, 8, 8, 8, 8, 8, 8, 8};
            v8i nan = {0};
            for (i = 8; i + 8 <= n; i += 8) {
                const v8f v = load8(x + i);
                ci += step;
                const v8i gt = (v8i)(v > bv);
                bv = (v8f)(((v8i)v & gt) | ((v8i)bv & ~gt));
                bi = (ci & gt) | (bi & ~gt);
                nan |= (v8i)(v != v);
            }
            nan |= (v8i)(load8(x) != load8(x));
            int any_nan = 0;
            for (int l = 0; l < 8; l++) any_nan |= nan[l];
            if (any_nan) {
                for (int64_t j = 0; j < n; j++)
                    if (x[j] != x[j]) { best = j; break; }
                out[r] = best;
                continue;
            }
            best = bi[0];
            for (int l = 1; l < 8; l++)
                if (bv[l] > x[best] || (bv[l] == x[best] && bi[l] < best)) best = bi[l];
        }
        for (; i < n; i++) {
            if (x[i] != x[i]) { best = i; break; }
            if (x[i] > x[best]) best = i;
        }
        out[r] = best;
    }
}
