/* Dense projections on CPU, float32: y[M, N] = x[M, K] @ W^T + bias, with W packed once at load
 * time into column panels of 16: panel p holds columns 16p..16p+15 as [K][16] (zero-padded past
 * N), so a panel streams through memory in one run.
 *
 * Place in the data flow: engine/model/linear.py packs every projection weight of a CPU float32
 * stage with `pf_pack_weight` (Q|K|V, O, gate|up, down, LM head) and calls `pf_linear` for each
 * projection of a batch (through engine/native_build.py; ctypes releases the GIL).
 *
 * Kernel: a tile of up to 6 rows x 16 columns kept in 12 vector accumulators; per k, two vector
 * loads of the panel and one broadcast load of x per row feed 12 fused multiply-adds (x is
 * broadcast straight from memory: load ports only, the vector units stay on the FMAs; a scalar
 * load plus a register broadcast ran at ~60% of this speed). Work items are (block of up to 96
 * rows, panel), run by the kernels' thread pool (thread_pool.c), consecutive items sharing a row
 * block while it is warm in cache. One row (a decode step at batch 1) streams the weights
 * once: the kernel is memory-bound there, and a panel layout keeps the stream sequential.
 */
#include <stdint.h>
#include <string.h>

#include "thread_pool.h"
#include "vec_math.h"


#define NR 16        /* columns per panel */
#define ROW_BLOCK 96 /* rows per work item: 16 tiles of 6 */

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

/* R rows of x (stride lda) times one panel -> c (stride ldc), 16 columns, plus bias (16 values). */
#define DEFINE_TILE(R)                                                                               \
    static inline void tile##R(const float *a, int64_t lda, const float *w, int64_t k, const float *bias, \
                               float *c, int64_t ldc) {                                             \
        v8f acc[R][2];                                                                               \
        for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = (v8f){0};                               \
        for (int64_t kk = 0; kk < k; kk++) {                                                         \
            const v8f w0 = load8(w + kk * NR), w1 = load8(w + kk * NR + 8);                          \
            for (int r = 0; r < R; r++) {                                                            \
                const float s = a[r * lda + kk];                                                     \
                const v8f x = {s, s, s, s, s, s, s, s};                                              \
                acc[r][0] += x * w0;                                                                 \
                acc[r][1] += x * w1;                                                                 \
            }                                                                                        \
        }                                                                                            \
        const v8f b0 = bias ? load8(bias) : (v8f){0}, b1 = bias ? load8(bias + 8) : (v8f){0};        \
        for (int r = 0; r < R; r++) {                                                                \
            store8(c + r * ldc, acc[r][0] + b0);                                                     \
            store8(c + r * ldc + 8, acc[r][1] + b1);                                                 \
        }                                                                                            \
    }
DEFINE_TILE(6)
DEFINE_TILE(5)
DEFINE_TILE(4)
DEFINE_TILE(3)
DEFINE_TILE(2)
DEFINE_TILE(1)

static void tile_rows(int rows, const float *a, int64_t lda, const float *w, int64_t k, const float *bias,
                      float *c, int64_t ldc) {
    switch (rows) {
    case 6: tile6(a, lda, w, k, bias, c, ldc); break;
    case 5: tile5(a, lda, w, k, bias, c, ldc); break;
    case 4: tile4(a, lda, w, k, bias, c, ldc); break;
    case 3: tile3(a, lda, w, k, bias, c, ldc); break;
    case 2: tile2(a, lda, w, k, bias, c, ldc); break;
    default: tile1(a, lda, w, k, bias, c, ldc); break;
    }
}

typedef struct {
    const float *x, *packed, *bias;
    float *y;
    int64_t m, k, n, panels, blocks;
} linear_t;

/* Rows [m0, m1) times panel p. A panel past column n (the last, partial one) is computed into a
   scratch tile and only its valid columns copied out. */
static void item(const linear_t *L, int64_t m0, int64_t m1, int64_t p) {
    const float *w = L->packed + p * L->k * NR;
    const float *bias = L->bias ? L->bias + p * NR : NULL;
    const int64_t cols = L->n - p * NR < NR ? L->n - p * NR : NR;
    for (int64_t m = m0; m < m1; m += 6) {
        const int rows = m1 - m < 6 ? (int)(m1 - m) : 6;
        if (cols == NR) {
            tile_rows(rows, L->x + m * L->k, L->k, w, L->k, bias, L->y + m * L->n + p * NR, L->n);
        } else {
            float tmp[6 * NR];
            tile_rows(rows, L->x + m * L->k, L->k, w, L->k, bias, tmp, NR);
            for (int r = 0; r < rows; r++) memcpy(L->y + (m + r) * L->n + p * NR, tmp + r * NR, sizeof(float) * cols);
        }
    }
}

static void run_item(void *ctx, int64_t i) {
    const linear_t *L = (const linear_t *)ctx;
    const int64_t b = i / L->panels, p = i % L->panels;
    const int64_t m0 = b * ROW_BLOCK, m1 = m0 + ROW_BLOCK < L->m ? m0 + ROW_BLOCK : L->m;
    item(L, m0, m1, p);
}

/* y [m, n] = x [m, k] (contiguous) @ W^T + bias; packed from pf_pack_weight, bias NULL or padded to
   whole panels. */
void pf_linear(const float *x, int64_t m, int64_t k, const float *packed, const float *bias, int64_t n, float *y,
               int num_threads) {
    if (m <= 0 || n <= 0) return;
    linear_t L = {x, packed, bias, y, m, k, n, (n + NR - 1) / NR, (m + ROW_BLOCK - 1) / ROW_BLOCK};
    pf_pool_run(run_item, &L, L.blocks * L.panels, num_threads);
}
