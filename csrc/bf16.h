/* bfloat16 storage for the CPU kernels: the top 16 bits of a float32. Widening is exact (a
 * shift); narrowing rounds to nearest, ties to even, NaN to the quiet NaN 0x7FC0: the rule of
 * torch's own conversion (c10::round_to_nearest_even), so a kernel that narrows where the torch
 * formula does gives the torch path's bits. Integer arithmetic only (no avx512_bf16
 * instructions: VCVTNEPS2BF16 flushes subnormals, torch does not), so it vectorises on AVX2
 * and AVX-512 alike.
 *
 * Place in the data flow: included by decoder_layer_ops.c (the bf16 layer ops) and
 * paged_decode_attention.c (the bf16 KV pool), which engine/kernels/native_build.py compiles.
 */
#ifndef PARAFLEX_BF16_H
#define PARAFLEX_BF16_H

#include <stdint.h>
#include <string.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

#include "vec_math.h"

typedef uint16_t bf16_t;
typedef uint32_t v8u __attribute__((vector_size(32)));
typedef uint16_t v8h __attribute__((vector_size(16)));

static inline float bf16_to_float(bf16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline bf16_t float_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
    return f != f ? (bf16_t)0x7FC0 : (bf16_t)rounded;
}

/* f rounded to the nearest bfloat16, as a float (the rounding point of a torch bf16 op) */
static inline float round_bf16(float f) { return bf16_to_float(float_to_bf16(f)); }

/* (GCC 12 splits the vector-extension widening and narrowing into halves; where AVX2 /
   AVX-512VL have one instruction for them, it is named) */
static inline v8f load8_bf16(const bf16_t *p) {
#ifdef __AVX2__
    return (v8f)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16);
#else
    v8h h;
    memcpy(&h, p, sizeof h);
    return (v8f)(__builtin_convertvector(h, v8u) << 16);
#endif
}

static inline v8h narrow8(v8f f) {
    const v8u bits = (v8u)f;
    const v8u rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
    const v8u nan = (v8u)(f != f);
    const v8u out = (rounded & ~nan) | (0x7FC0u & nan);
#ifdef __AVX512VL__
    return (v8h)_mm256_cvtepi32_epi16((__m256i)out);
#else
    return __builtin_convertvector(out, v8h);
#endif
}

static inline void store8_bf16(bf16_t *p, v8f f) {
    const v8h h = narrow8(f);
    memcpy(p, &h, sizeof h);
}

/* dst[i] = src[i] rounded to bfloat16, i < n */
static inline void narrow_row(const float *src, bf16_t *dst, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) store8_bf16(dst + i, load8(src + i));
    for (; i < n; i++) dst[i] = float_to_bf16(src[i]);
}

/* the 8 floats rounded to bfloat16 and widened back (in 32-bit lanes: no narrowing) */
static inline v8f round8_bf16(v8f f) {
    const v8u bits = (v8u)f;
    const v8u rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) & 0xFFFF0000u;
    const v8u nan = (v8u)(f != f);
    return (v8f)((rounded & ~nan) | (0x7FC00000u & nan));
}

#endif
