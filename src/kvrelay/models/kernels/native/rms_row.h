/*
 * One row's RMS norm in float32 (rms_norm.c states the numerics), for the kernels that norm rows inside
 * their own parallel regions.
 */
#ifndef KVRELAY_RMS_ROW_H
#define KVRELAY_RMS_ROW_H

#include <math.h>

#include "bf16_simd.h"

static inline float inverse_rms(const uint16_t* x, int64_t dim, float eps) {
    __m512 squares = _mm512_setzero_ps();
    for (int64_t c = 0; c < dim; c += 16) {
        __m512 v = load_bf16(x + c);
        squares = _mm512_fmadd_ps(v, v, squares);
    }
    return 1.0f / sqrtf(_mm512_reduce_add_ps(squares) / (float)dim + eps);
}

/* out = normed x, as above; optionally added to `base` (out = bf16(base + normed)). */
static inline void norm_row(const uint16_t* x, const float* w, int64_t dim, float eps, int unit_offset,
                            const uint16_t* base, uint16_t* out) {
    const __m512 r = _mm512_set1_ps(inverse_rms(x, dim, eps));
    for (int64_t c = 0; c < dim; c += 16) {
        __m512 x_hat = _mm512_mul_ps(load_bf16(x + c), r);
        __m512 y = unit_offset ? _mm512_mul_ps(x_hat, _mm512_loadu_ps(w + c))
                               : _mm512_mul_ps(_mm512_loadu_ps(w + c), round_bf16(x_hat));
        if (base != 0) y = _mm512_add_ps(load_bf16(base + c), round_bf16(y));
        _mm256_storeu_si256((__m256i*)(out + c), (__m256i)_mm512_cvtneps_pbh(y));
    }
}

#endif
