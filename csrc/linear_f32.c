/* Dense projections on CPU, float32: y[M, N] = x[M, K] @ W^T + bias, with W packed once at load
 * time into column panels of 16: panel p holds columns 16p..16p+15 as [K][16] (zero-padded past
 * N), so a panel streams through memory in one run.
 *
 * Place in the data flow: engine/model/linear.py packs every projection weight of a CPU float32
 * stage with `pf_pack_weight` (Q|K|V, O, gate|up, down, LM head) and calls `pf_linear` for each
 * projection of a batch (through engine/native_build.py; ctypes releases the GIL).
 *
 * Kernel: a tile of up to 6 rows x 16 columns kept in 12 vector accumulators (AVX-512: 8 rows x
 * 32 columns, two panels, in 16); per k, two vector loads of the panel(s) and one broadcast load
 * of x per row feed 12 (16) fused multiply-adds (x is
 * broadcast straight from memory: load ports only, the vector units stay on the FMAs; a scalar
 * load plus a register broadcast ran at ~60% of this speed). Work items are (block of up to 96
 * rows, panel or panel pair), run by the kernels' thread pool (thread_pool.c), consecutive items sharing a row
 * block while it is warm in cache. One row (a decode step at batch 1) streams the weights
 * once: the kernel is memory-bound there, and a panel layout keeps the stream sequential.
 */
#include <stdint.h>
#include <string.h>

#include "thread_pool.h"
#include "vec_math.h"


#define NR 16        /* columns per panel */
#define ROW_BLOCK 96 /* rows per work item: 16 tiles of 6, or 12 of 8 */
/* Each panel's weights are prefetched this many k steps (64-byte lines) ahead of the FMAs: a tile's
   first pass over a panel reads it from memory, and the hardware prefetcher alone left the FMAs
   waiting. On the AVX-512 VM (2 threads, SmolLM2's 30 layers + head, cold weights, same-run A/B):
   8 rows 1.25x, 32 rows 1.15-1.2x, 128 rows 1.1-1.15x faster, 1 row level; 16 to 64 lines ahead
   measured alike, 8 worse. */
#define PREFETCH_K 32
/* When the whole batch is one tile (m <= MR rows: a decode step of a few requests) each weight
   line is read once, so it is prefetched into L2 only (prefetcht1), further ahead: prefetches into
   L1 wait for its few line-fill buffers and stall the FMAs that follow. Same-run A/B on the AMD
   EPYC VM (avx512f, 2 threads, SmolLM2's 30 layers + head, cold weights, 2026-11-27, six runs as
   the host's memory speed moved): 1 row 1.08-1.23x faster (17.5 -> 14.3 ms, 18.8 -> 16.8 ms),
   8 rows 1.10-1.16x; the AVX2 build 1.15-1.21x at 1 row.
   Where later tiles reread the lines (more rows), L2-only prefetches were level or up to 11% slower
   in the AVX2 build, so those keep prefetching into L1. */
#define PREFETCH_K_STREAM 48

/* w [n, k] row-major (the checkpoint layout) -> out [ceil(n / 16)][k][16]. */
void pf_pack_weight(const float *w, int64_t n, int64_t k, float *out) {
    const int64_t panels = (n + NR - 1) / NR;
    for (int64_t p = 0; p < panels; p++)
        for (int64_t kk = 0; kk < k; kk++)
            for (int j = 0; j < NR; j++) {
                const int64_t col = p * NR + j;
                out[(p * k + kk) * NR + j] = col < n ? w[col * k + kk] : 0.0f;
            }
}

/* The vector a tile row is kept in. AVX-512: one 16-float register holds a panel's row, and a tile
   spans two adjacent panels (8 rows x 32 columns in 16 of the 32 registers: per k, two panel loads
   and eight broadcasts feed 16 FMAs of 16 lanes). Elsewhere: 8-float vectors, two per panel row,
   and a tile is one panel (6 x 16 in 12 of the 16 registers). On the AVX-512 VM (Xeon with
   avx512f/bf16/amx, 2 threads, SmolLM2's projections) the 8-float tiles ran 128 rows 1.4x slower
   than 16-float 6 x 32 tiles, and those 1.3x slower than 8 x 32 (same-run A/B, loaded machine). */
#ifdef __AVX512F__
typedef float vec_t __attribute__((vector_size(64)));
#define TILE_PANELS 2
#define MR 8 /* rows per tile */
#else
typedef v8f vec_t;
#define TILE_PANELS 1
#define MR 6
#endif
#define VW ((int)(sizeof(vec_t) / sizeof(float))) /* lanes */
#define VPP (NR / VW)                            /* vectors per panel row */

static inline vec_t load_vec(const float *p) { vec_t v; memcpy(&v, p, sizeof v); return v; }
static inline void store_vec(float *p, vec_t v) { memcpy(p, &v, sizeof v); }

/* R rows of x (stride lda) times NP consecutive panels (panel stride k * 16 floats) -> c (stride
   ldc), NP * 16 columns, plus bias (NP * 16 values, or NULL). */
#define DEFINE_TILE(R, NP, NAME)                                                                     \
    static inline void NAME(const float *a, int64_t lda, const float *w, int64_t k, const float *bias, \
                            float *c, int64_t ldc, int stream) {                                     \
        vec_t acc[R][NP * VPP];                                                                      \
        for (int r = 0; r < R; r++)                                                                  \
            for (int j = 0; j < NP * VPP; j++) acc[r][j] = (vec_t){0};                               \
        for (int64_t kk = 0; kk < k; kk++) {                                                         \
            vec_t wv[NP * VPP];                                                                      \
            for (int p = 0; p < NP; p++) {                                                           \
                if (stream) __builtin_prefetch(w + (p * k + kk + PREFETCH_K_STREAM) * NR, 0, 2);      \
                else __builtin_prefetch(w + (p * k + kk + PREFETCH_K) * NR, 0, 3);                    \
            }                                                                                        \
            for (int p = 0; p < NP; p++)                                                             \
                for (int v = 0; v < VPP; v++) wv[p * VPP + v] = load_vec(w + (p * k + kk) * NR + v * VW); \
            for (int r = 0; r < R; r++) {                                                            \
                const float s = a[r * lda + kk];                                                     \
                const vec_t x = s - (vec_t){0};                                                      \
                for (int j = 0; j < NP * VPP; j++) acc[r][j] += x * wv[j];                           \
            }                                                                                        \
        }                                                                                            \
        for (int r = 0; r < R; r++)                                                                  \
            for (int j = 0; j < NP * VPP; j++)                                                       \
                store_vec(c + r * ldc + j * VW, bias ? acc[r][j] + load_vec(bias + j * VW) : acc[r][j]); \
    }
#define DEFINE_TILES(NP, SUFFIX)                                                                     \
    DEFINE_TILE(8, NP, tile8##SUFFIX)                                                                \
    DEFINE_TILE(7, NP, tile7##SUFFIX)                                                                \
    DEFINE_TILE(6, NP, tile6##SUFFIX)                                                                \
    DEFINE_TILE(5, NP, tile5##SUFFIX)                                                                \
    DEFINE_TILE(4, NP, tile4##SUFFIX)                                                                \
    DEFINE_TILE(3, NP, tile3##SUFFIX)                                                                \
    DEFINE_TILE(2, NP, tile2##SUFFIX)                                                                \
    DEFINE_TILE(1, NP, tile1##SUFFIX)                                                                \
    static void tile_rows##SUFFIX(int rows, const float *a, int64_t lda, const float *w, int64_t k,   \
                                  const float *bias, float *c, int64_t ldc, int stream) {            \
        switch (rows) {                                                                              \
        case 8: tile8##SUFFIX(a, lda, w, k, bias, c, ldc, stream); break;                            \
        case 7: tile7##SUFFIX(a, lda, w, k, bias, c, ldc, stream); break;                            \
        case 6: tile6##SUFFIX(a, lda, w, k, bias, c, ldc, stream); break;                            \
        case 5: tile5##SUFFIX(a, lda, w, k, bias, c, ldc, stream); break;                            \
        case 4: tile4##SUFFIX(a, lda, w, k, bias, c, ldc, stream); break;                            \
        case 3: tile3##SUFFIX(a, lda, w, k, bias, c, ldc, stream); break;                            \
        case 2: tile2##SUFFIX(a, lda, w, k, bias, c, ldc, stream); break;                            \
        default: tile1##SUFFIX(a, lda, w, k, bias, c, ldc, stream); break;                           \
        }                                                                                            \
    }
DEFINE_TILES(1, _one)           /* one panel: the last, odd or partial panel of a group */
#if TILE_PANELS > 1
DEFINE_TILES(TILE_PANELS, _group) /* a whole group of full panels */
#else
#define tile_rows_group tile_rows_one
#endif

typedef struct {
    const float *x, *packed, *bias;
    float *y;
    int64_t m, k, n, panels, blocks;
    int stream; /* the batch is one tile (m <= MR): each weight line is read once (PREFETCH_K_STREAM) */
} linear_t;

/* Rows [m0, m1) times one panel p. A panel past column n (the last, partial one) is computed into a
   scratch tile and only its valid columns copied out. */
static void panel_item(const linear_t *L, int64_t m0, int64_t m1, int64_t p) {
    const float *w = L->packed + p * L->k * NR;
    const float *bias = L->bias ? L->bias + p * NR : NULL;
    const int64_t cols = L->n - p * NR < NR ? L->n - p * NR : NR;
    for (int64_t m = m0; m < m1; m += MR) {
        const int rows = m1 - m < MR ? (int)(m1 - m) : MR;
        if (cols == NR) {
            tile_rows_one(rows, L->x + m * L->k, L->k, w, L->k, bias, L->y + m * L->n + p * NR, L->n, L->stream);
        } else {
            float tmp[MR * NR];
            tile_rows_one(rows, L->x + m * L->k, L->k, w, L->k, bias, tmp, NR, L->stream);
            for (int r = 0; r < rows; r++) memcpy(L->y + (m + r) * L->n + p * NR, tmp + r * NR, sizeof(float) * cols);
        }
    }
}

/* Rows [m0, m1) times the panels of group g (TILE_PANELS panels): whole tiles where the group's
   panels are all full, else one panel at a time. */
static void item(const linear_t *L, int64_t m0, int64_t m1, int64_t g) {
    const int64_t p0 = g * TILE_PANELS;
    if (TILE_PANELS == 1 || (p0 + TILE_PANELS) * NR > L->n) {
        for (int64_t p = p0; p < p0 + TILE_PANELS && p < L->panels; p++) panel_item(L, m0, m1, p);
        return;
    }
    const float *w = L->packed + p0 * L->k * NR;
    const float *bias = L->bias ? L->bias + p0 * NR : NULL;
    for (int64_t m = m0; m < m1; m += MR) {
        const int rows = m1 - m < MR ? (int)(m1 - m) : MR;
        tile_rows_group(rows, L->x + m * L->k, L->k, w, L->k, bias, L->y + m * L->n + p0 * NR, L->n, L->stream);
    }
}

static void run_item(void *ctx, int64_t i) {
    const linear_t *L = (const linear_t *)ctx;
    const int64_t groups = (L->panels + TILE_PANELS - 1) / TILE_PANELS;
    const int64_t b = i / groups, g = i % groups;
    const int64_t m0 = b * ROW_BLOCK, m1 = m0 + ROW_BLOCK < L->m ? m0 + ROW_BLOCK : L->m;
    item(L, m0, m1, g);
}

/* y [m, n] = x [m, k] (contiguous) @ W^T + bias; packed from pf_pack_weight, bias NULL or padded to
   whole panels. */
void pf_linear(const float *x, int64_t m, int64_t k, const float *packed, const float *bias, int64_t n, float *y,
               int num_threads) {
    if (m <= 0 || n <= 0) return;
    linear_t L = {x, packed, bias, y, m, k, n, (n + NR - 1) / NR, (m + ROW_BLOCK - 1) / ROW_BLOCK, m <= MR};
    pf_pool_run(run_item, &L, L.blocks * ((L.panels + TILE_PANELS - 1) / TILE_PANELS), num_threads);
}
