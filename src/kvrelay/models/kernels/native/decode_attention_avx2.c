/*
 * decode_attention.c for CPUs with AVX2 but without AVX-512: the same function, arguments and results (that
 * file states the numerics and the contract), eight lanes at a time with float32 fused multiply-adds. The
 * scores are float32 dot products (rounded to bfloat16, then scaled and softmaxed in float32), the
 * probabilities are rounded to bfloat16 and the values' weighted sum is accumulated in float32 and rounded
 * to bfloat16; only the summation order differs from the PyTorch path. Units go one at a time to whichever
 * thread of the calling thread's OpenMP team is running; a single unit runs on the calling thread.
 */
#include <math.h>

#include "avx2_simd.h"

#define MAX_KEYS 4096
#define MAX_G 16
#define PREFETCH_ROWS 8

/* exp(x) for x <= 0: Cephes' single-precision range reduction and polynomial. */
static inline __m256 exp_nonpositive(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
    const __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

/* p[g][j] = q[g] . k[j] (float32) for four query rows g0 .. g0 + 3 (float32, D apart); key rows `stride` apart. */
static void scores4(const float* qf, const uint16_t* k, int n, int D, int64_t stride, int g0, float (*p)[MAX_KEYS]) {
    const float* q0 = qf + (int64_t)g0 * D;
    for (int j = 0; j < n; j++) {
        const uint16_t* row = k + j * stride;
        for (int c = 0; c < D; c += 32) _mm_prefetch((const char*)(row + PREFETCH_ROWS * stride + c), _MM_HINT_T1);
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (int c = 0; c < D; c += 8) {
            const __m256 key = load8_bf16(row + c);
            a0 = _mm256_fmadd_ps(key, _mm256_loadu_ps(q0 + c), a0);
            a1 = _mm256_fmadd_ps(key, _mm256_loadu_ps(q0 + D + c), a1);
            a2 = _mm256_fmadd_ps(key, _mm256_loadu_ps(q0 + 2 * D + c), a2);
            a3 = _mm256_fmadd_ps(key, _mm256_loadu_ps(q0 + 3 * D + c), a3);
        }
        p[g0][j] = hsum8(a0);
        p[g0 + 1][j] = hsum8(a1);
        p[g0 + 2][j] = hsum8(a2);
        p[g0 + 3][j] = hsum8(a3);
    }
}

/* Row p[0..n) of raw scores becomes bf16(softmax(bf16(p) * scale)) (as float32). */
static void softmax_row(float* p, int n, float scale) {
    const __m256 vscale = _mm256_set1_ps(scale);
    __m256 vmax = _mm256_set1_ps(-INFINITY);
    int j = 0;
    for (; j + 8 <= n; j += 8) {
        const __m256 x = _mm256_mul_ps(round_bf16_8(_mm256_loadu_ps(p + j)), vscale);
        _mm256_storeu_ps(p + j, x);
        vmax = _mm256_max_ps(vmax, x);
    }
    float top = hmax8(vmax);
    for (int t = j; t < n; t++) {
        float x[8] = {p[t]};
        _mm256_storeu_ps(x, _mm256_mul_ps(round_bf16_8(_mm256_loadu_ps(x)), vscale));
        p[t] = x[0];
        if (x[0] > top) top = x[0];
    }
    const __m256 vtop = _mm256_set1_ps(top);
    __m256 total = _mm256_setzero_ps();
    for (j = 0; j + 8 <= n; j += 8) {
        const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(p + j), vtop));
        _mm256_storeu_ps(p + j, e);
        total = _mm256_add_ps(total, e);
    }
    float sum = hsum8(total);
    for (int t = j; t < n; t++) {
        float x[8] = {p[t] - top};
        _mm256_storeu_ps(x, exp_nonpositive(_mm256_loadu_ps(x)));
        p[t] = x[0];
        sum += x[0];
    }
    const __m256 inv = _mm256_set1_ps(1.0f / sum);
    for (j = 0; j + 8 <= n; j += 8) _mm256_storeu_ps(p + j, round_bf16_8(_mm256_mul_ps(_mm256_loadu_ps(p + j), inv)));
    for (int t = j; t < n; t++) {
        float x[8] = {p[t]};
        _mm256_storeu_ps(x, round_bf16_8(_mm256_mul_ps(_mm256_loadu_ps(x), inv)));
        p[t] = x[0];
    }
}

/* out rows g0, g0 + 1, dims d0 .. d0 + 31 = sum_j p[g][j] v[j] in float32, rounded to bfloat16. */
static void weighted_values2(const uint16_t* v, int n, int D, int64_t stride, int g0, int d0, float (*p)[MAX_KEYS],
                             uint16_t* out) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
    for (int j = 0; j < n; j++) {
        const uint16_t* row = v + j * stride + d0;
        const __m256 v0 = load8_bf16(row), v1 = load8_bf16(row + 8), v2 = load8_bf16(row + 16);
        const __m256 v3 = load8_bf16(row + 24);
        const __m256 w = _mm256_broadcast_ss(&p[g0][j]), u = _mm256_broadcast_ss(&p[g0 + 1][j]);
        a0 = _mm256_fmadd_ps(w, v0, a0);
        a1 = _mm256_fmadd_ps(w, v1, a1);
        a2 = _mm256_fmadd_ps(w, v2, a2);
        a3 = _mm256_fmadd_ps(w, v3, a3);
        b0 = _mm256_fmadd_ps(u, v0, b0);
        b1 = _mm256_fmadd_ps(u, v1, b1);
        b2 = _mm256_fmadd_ps(u, v2, b2);
        b3 = _mm256_fmadd_ps(u, v3, b3);
    }
    uint16_t* o = out + (int64_t)g0 * D + d0;
    store8_bf16(o, a0);
    store8_bf16(o + 8, a1);
    store8_bf16(o + 16, a2);
    store8_bf16(o + 24, a3);
    o += D;
    store8_bf16(o, b0);
    store8_bf16(o + 8, b1);
    store8_bf16(o + 16, b2);
    store8_bf16(o + 24, b3);
}

static void attend_unit(const uint16_t* q, const uint16_t* k, const uint16_t* v, int n, int G, int D, int64_t stride,
                        float scale, uint16_t* out) {
    float p[G][MAX_KEYS] __attribute__((aligned(32))); /* G <= MAX_G rows: at most 256 KiB of stack */
    float qf[G * D] __attribute__((aligned(32)));
    for (int i = 0; i < G * D; i += 8) _mm256_storeu_ps(qf + i, load8_bf16(q + i));
    for (int g0 = 0; g0 < G; g0 += 4) scores4(qf, k, n, D, stride, g0, p);
    for (int g = 0; g < G; g++) softmax_row(p[g], n, scale);
    for (int g0 = 0; g0 < G; g0 += 2)
        for (int d0 = 0; d0 < D; d0 += 32) weighted_values2(v, n, D, stride, g0, d0, p, out);
}

/* As decode_attention.c (the same contract); returns 0, or -1 when the arguments break it. */
int kvrelay_decode_attention(const uint16_t* q, const uint16_t* k, const uint16_t* v, const int64_t* n, uint16_t* out,
                             int64_t batch, int64_t kv_heads, int G, int D, int64_t keys, int64_t batch_stride,
                             int64_t head_stride, int64_t row_stride, float scale) {
    if (G % 4 != 0 || G > MAX_G || D % 128 != 0 || D <= 0 || keys > MAX_KEYS - 1) return -1;
    for (int64_t b = 0; b < batch; b++)
        if (n[b] < 1 || n[b] > keys) return -1;
    const int64_t units = batch * kv_heads;
#pragma omp parallel for schedule(dynamic, 1) if (units > 1)
    for (int64_t u = 0; u < units; u++) {
        const int64_t b = u / kv_heads, h = u % kv_heads, at = b * batch_stride + h * head_stride;
        attend_unit(q + u * G * D, k + at, v + at, (int)n[b], G, D, row_stride, scale, out + u * G * D);
    }
    return 0;
}
