/*
 * The MLP activations of mlp_rows.c and mlp_rows_amx.c on float32 lanes (AVX-512), with the erf they are built
 * of (exp: exp_simd.h).
 */
#ifndef KVRELAY_MLP_ACTIVATIONS_H
#define KVRELAY_MLP_ACTIVATIONS_H

#include <immintrin.h>

#include "exp_simd.h"

/* erf(x) for float32 lanes: Abramowitz and Stegun 7.1.26 (absolute error below 1.5e-7), odd in x. */
static inline __m512 erf_ps(__m512 x) {
    const __m512 a = _mm512_abs_ps(x);
    const __m512 t = _mm512_div_ps(_mm512_set1_ps(1.0f), _mm512_fmadd_ps(_mm512_set1_ps(0.3275911f), a, _mm512_set1_ps(1.0f)));
    __m512 p = _mm512_set1_ps(1.061405429f);
    p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(-1.453152027f));
    p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(1.421413741f));
    p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(-0.284496736f));
    p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(0.254829592f));
    p = _mm512_mul_ps(p, t);
    const __m512 e = _mm512_fnmadd_ps(p, exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(a, a))), _mm512_set1_ps(1.0f));
    return _mm512_mask_sub_ps(e, _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ), _mm512_setzero_ps(), e);
}

/* act(g) for float32 lanes: 0 SiLU g / (1 + e^-g); 1 GELU 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))), with
 * tanh(u) = 1 - 2 / (e^(2u) + 1); 2 GELU 0.5 g (1 + erf(g / sqrt 2)). */
static inline __m512 activate(__m512 g, int act) {
    const __m512 one = _mm512_set1_ps(1.0f), half_g = _mm512_mul_ps(_mm512_set1_ps(0.5f), g);
    if (act == 0) return _mm512_div_ps(g, _mm512_add_ps(one, exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), g))));
    if (act == 2) return _mm512_mul_ps(half_g, _mm512_add_ps(one, erf_ps(_mm512_mul_ps(g, _mm512_set1_ps(0.7071067811865476f)))));
    const __m512 g3 = _mm512_mul_ps(_mm512_mul_ps(g, g), g);
    const __m512 u = _mm512_mul_ps(_mm512_set1_ps(0.7978845608028654f), _mm512_fmadd_ps(_mm512_set1_ps(0.044715f), g3, g));
    const __m512 t = _mm512_sub_ps(one, _mm512_div_ps(_mm512_set1_ps(2.0f), _mm512_add_ps(exp_ps(_mm512_add_ps(u, u)), one)));
    return _mm512_mul_ps(half_g, _mm512_add_ps(one, t));
}

#endif
