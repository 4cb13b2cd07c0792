/*
 * RMS norm of bfloat16 rows, computed in float32, AVX-512 BF16.
 *
 * x_hat = x * (1 / sqrt(mean(x^2) + eps)), all in float32, then
 *   unit_offset != 0 (Gemma): out = bf16(x_hat * w), w the float32 (1 + weight);
 *   unit_offset == 0 (Llama): out = bf16(w * bf16(x_hat)), w the weight's bfloat16 values.
 * This is kvrelay.models.layers.RMSNorm's order of operations; the sum of squares is taken
 * in another order than torch's, so an output can differ from it in its last bit.
 *
 * kvrelay_rms_norm_rope then rotates each normed row as kvrelay.models.layers.apply_rope does
 * in bfloat16: out = bf16(bf16(n * cos) + bf16(swap_halves(n) * sin)), sin with its first half
 * negated; every step is one rounding, so it matches apply_rope bit for bit given the same n.
 *
 * Contract: dim % 16 == 0 (dim % 32 == 0 and dim <= MAX_ROPE_DIM for the rope). Row (t, h)
 * of x is at t * token_stride + h * dim; weight has weight_heads rows of dim (1: shared by all heads, else one per head). Rows run on the
 * calling thread's OpenMP team when there are many.
 */
#include <math.h>

#include "bf16_simd.h"
#include "rms_row.h"

#define PARALLEL_ELEMENTS (1 << 16)
#define MAX_ROPE_DIM 1024

/* out (contiguous [tokens, heads, dim]) = norm of x's rows. Returns 0, or -1 if dim % 16 != 0. */
int kvrelay_rms_norm(const uint16_t* x, int64_t tokens, int64_t heads, int64_t dim, int64_t token_stride,
                     const float* weight, int64_t weight_heads, float eps, int unit_offset, uint16_t* out) {
    if (dim <= 0 || dim % 16 != 0) return -1;
    const int64_t rows = tokens * heads;
#pragma omp parallel for schedule(static) if (rows * dim >= PARALLEL_ELEMENTS)
    for (int64_t i = 0; i < rows; i++) {
        const int64_t t = i / heads, h = i % heads;
        const float* w = weight + (weight_heads == 1 ? 0 : h * dim);
        norm_row(x + t * token_stride + h * dim, w, dim, eps, unit_offset, 0, out + i * dim);
    }
    return 0;
}

/* base (contiguous [tokens, dim]) = bf16(base + norm(x)), in place; x contiguous. Returns 0, or -1. */
int kvrelay_add_rms_norm(uint16_t* base, const uint16_t* x, int64_t tokens, int64_t dim, const float* weight,
                         float eps, int unit_offset) {
    if (dim <= 0 || dim % 16 != 0) return -1;
#pragma omp parallel for schedule(static) if (tokens * dim >= PARALLEL_ELEMENTS)
    for (int64_t t = 0; t < tokens; t++) norm_row(x + t * dim, weight, dim, eps, unit_offset, base + t * dim, base + t * dim);
    return 0;
}

/* kvrelay_rms_norm, then rope with cos / sin ([tokens, dim], contiguous) of each row's token. */
int kvrelay_rms_norm_rope(const uint16_t* x, int64_t tokens, int64_t heads, int64_t dim, int64_t token_stride,
                          const float* weight, int64_t weight_heads, float eps, int unit_offset, const uint16_t* cos,
                          const uint16_t* sin, uint16_t* out) {
    if (dim <= 0 || dim % 32 != 0 || dim > MAX_ROPE_DIM) return -1;
    const int64_t rows = tokens * heads, half = dim / 2;
#pragma omp parallel for schedule(static) if (rows * dim >= PARALLEL_ELEMENTS)
    for (int64_t i = 0; i < rows; i++) {
        const int64_t t = i / heads, h = i % heads;
        uint16_t normed[MAX_ROPE_DIM] __attribute__((aligned(64)));
        const float* w = weight + (weight_heads == 1 ? 0 : h * dim);
        norm_row(x + t * token_stride + h * dim, w, dim, eps, unit_offset, 0, normed);
        const uint16_t* c_row = cos + t * dim;
        const uint16_t* s_row = sin + t * dim;
        uint16_t* o = out + i * dim;
        for (int64_t c = 0; c < dim; c += 16) {
            const int64_t swapped = c < half ? c + half : c - half;
            __m512 a = round_bf16(_mm512_mul_ps(load_bf16(normed + c), load_bf16(c_row + c)));
            __m512 b = round_bf16(_mm512_mul_ps(load_bf16(normed + swapped), load_bf16(s_row + c)));
            _mm256_storeu_si256((__m256i*)(o + c), (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(a, b)));
        }
    }
    return 0;
}
