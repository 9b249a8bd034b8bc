/* Vector helpers shared by the CPU kernels: 8-float vectors (GCC/Clang vector extensions, one
 * AVX register where the machine has AVX; the compiler splits them elsewhere), unaligned loads
 * and stores, and an exponential without libm that vectorises.
 *
 * Place in the data flow: included by linear_f32.c, paged_decode_attention.c,
 * decoder_layer_ops.c and bf16.h, which engine/native_build.py compiles (headers copied beside the source; their text is part of the
 * build's cache key).
 */
#ifndef PARAFLEX_VEC_MATH_H
#define PARAFLEX_VEC_MATH_H

#include <stdint.h>
#include <string.h>

typedef float v8f __attribute__((vector_size(32)));

static inline v8f load8(const float *p) { v8f v; memcpy(&v, p, sizeof v); return v; }
static inline void store8(float *p, v8f v) { memcpy(p, &v, sizeof v); }

/* a * b + c, fused where the CPU has FMA (whatever -ffp-contract says: files built with
   contraction off keep their fast exponential) */
#ifdef __FMA__
#define MUL_ADD(a, b, c) __builtin_fmaf((a), (b), (c))
#else
#define MUL_ADD(a, b, c) ((a) * (b) + (c))
#endif

/* e^x, x clamped to [-87, 88] (the float range), without libm: 2^(x log2 e) split into an
   integer power of two (exponent bits) and 2^f, |f| <= 1/2, by its degree-7 Taylor polynomial
   (relative error < 1e-8). Branch-free, so loops calling it vectorise without -ffast-math (whose
   start-up code would switch the whole process to flush-to-zero). */
static inline float exp_clamped(float x) {
    x = x < -87.0f ? -87.0f : x;
    x = x > 88.0f ? 88.0f : x;
    const float y = x * 1.44269504088896341f;
    const float n = __builtin_floorf(y + 0.5f);
    const float f = (y - n) * 0.693147180559945309f;
    float p = 1.98412698412698413e-4f;
    p = MUL_ADD(p, f, 1.38888888888888889e-3f);
    p = MUL_ADD(p, f, 8.33333333333333333e-3f);
    p = MUL_ADD(p, f, 4.16666666666666667e-2f);
    p = MUL_ADD(p, f, 1.66666666666666667e-1f);
    p = MUL_ADD(p, f, 0.5f);
    p = MUL_ADD(p, f, 1.0f);
    p = MUL_ADD(p, f, 1.0f);
    const int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

#endif
