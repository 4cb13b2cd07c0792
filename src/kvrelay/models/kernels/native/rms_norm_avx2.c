/*
 * rms_norm.c for CPUs with AVX2 but without AVX-512: the same functions, arguments and results (that file
 * states the numerics and the contract), eight lanes at a time. Only the order of the sum of squares differs
 * from torch's, as there.
 */
#include <math.h>

#include "avx2_simd.h"

#define PARALLEL_ELEMENTS (1 << 16)
#define MAX_ROPE_DIM 1024

static inline float inverse_rms(const uint16_t* x, int64_t dim, float eps) {
    __m256 a = _mm256_setzero_ps(), b = a;
    for (int64_t c = 0; c < dim; c += 16) {
        const __m256 u = load8_bf16(x + c), v = load8_bf16(x + c + 8);
        a = _mm256_fmadd_ps(u, u, a);
        b = _mm256_fmadd_ps(v, v, b);
    }
    return 1.0f / sqrtf(hsum8(_mm256_add_ps(a, b)) / (float)dim + eps);
}

/* out = normed x; optionally added to `base` (out = bf16(base + bf16(normed))). */
static inline void norm_row(const uint16_t* x, const float* w, int64_t dim, float eps, int unit_offset,
                            const uint16_t* base, uint16_t* out) {
    const __m256 r = _mm256_set1_ps(inverse_rms(x, dim, eps));
    for (int64_t c = 0; c < dim; c += 8) {
        const __m256 x_hat = _mm256_mul_ps(load8_bf16(x + c), r);
        __m256 y = unit_offset ? _mm256_mul_ps(x_hat, _mm256_loadu_ps(w + c))
                               : _mm256_mul_ps(_mm256_loadu_ps(w + c), round_bf16_8(x_hat));
        if (base != 0) y = _mm256_add_ps(load8_bf16(base + c), round_bf16_8(y));
        store8_bf16(out + c, y);
    }
}

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

int kvrelay_add_rms_norm(uint16_t* base, const uint16_t* x, int64_t tokens, int64_t dim, const float* weight,
                         float eps, int unit_offset) {
    if (dim <= 0 || dim % 16 != 0) return -1;
#pragma omp parallel for schedule(static) if (tokens * dim >= PARALLEL_ELEMENTS)
    for (int64_t t = 0; t < tokens; t++)
        norm_row(x + t * dim, weight, dim, eps, unit_offset, base + t * dim, base + t * dim);
    return 0;
}

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
        for (int64_t c = 0; c < dim; c += 8) {
            const int64_t swapped = c < half ? c + half : c - half;
            const __m256 a = round_bf16_8(_mm256_mul_ps(load8_bf16(normed + c), load8_bf16(c_row + c)));
            const __m256 b = round_bf16_8(_mm256_mul_ps(load8_bf16(normed + swapped), load8_bf16(s_row + c)));
            store8_bf16(o + c, _mm256_add_ps(a, b));
        }
    }
    return 0;
}
