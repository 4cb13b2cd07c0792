/*
 * The screening pass of an exact greedy LM head (greedy_head.py): for each row n of an int8
 * weight copy Q [N, K] and one input row x, an upper bound on the row's bfloat16 logit, and the
 * largest lower bound over all rows; then the rows whose upper bound reaches it.
 *
 * The input comes in two int8 parts, x = x_scale * hq + g_scale * gq + rest (|rest| <= g_max),
 * each passed plus 128 as uint8 (xu, gu), so dot(xu, Q[n]) - 128 * rowsum[n] is the exact int32
 * dot of hq and Q[n] (|K| * 255 * 127 < 2^31 for K < 66,000), and likewise for gq. The estimate
 * is scale[n] * (x_scale * that + g_scale * the other), in double; the caller's c1[n] * g_max +
 * c2[n] * x_abs_sum bounds its distance to the exact real logit (the rest of x, the quantization
 * of Q, the float32 sums of the bfloat16 GEMV). Rounding to bfloat16 moves a logit by at most
 * 2^-8 of its size: upper = hi + |hi| 2^-8, lower = lo - |lo| 2^-8, each widened a little for
 * the double arithmetic.
 *
 * Contract: K % 64 == 0, N % 4 == 0, all arrays contiguous, upper has N doubles, picked has room
 * for max_picked indices. Rows are split over the calling thread's OpenMP team (AVX-512 VNNI).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "head_quantize.h"

#define PREFETCH_ROWS 16
#define BLOCK 256
#define MARGIN (0.00390625 * 1.001) /* 2^-8, widened for the double arithmetic */

/* The bounds of rows n .. n + 3 from their two int32 dots (coarse and fine part of the input). */
static inline double bound_rows(const uint8_t* xu, const uint8_t* gu, const int8_t* q, const int32_t* rowsum,
                                const double* scale, const double* c1, const double* c2, int64_t n, int64_t K,
                                double x_scale, double g_scale, double g_max, double x_abs_sum, double* upper) {
    __m512i a[4], b[4];
    for (int i = 0; i < 4; i++) a[i] = b[i] = _mm512_setzero_si512();
    const int8_t* rows = q + n * K;
    for (int64_t c = 0; c < K; c += 64) {
        const __m512i x = _mm512_loadu_si512(xu + c), g = _mm512_loadu_si512(gu + c);
        for (int i = 0; i < 4; i++) {
            _mm_prefetch((const char*)(rows + (PREFETCH_ROWS + i) * K + c), _MM_HINT_T1);
            const __m512i w = _mm512_loadu_si512(rows + i * K + c);
            a[i] = _mm512_dpbusd_epi32(a[i], x, w);
            b[i] = _mm512_dpbusd_epi32(b[i], g, w);
        }
    }
    double best = -INFINITY;
    for (int i = 0; i < 4; i++) {
        const int64_t m = n + i;
        const double coarse = (double)(_mm512_reduce_add_epi32(a[i]) - 128 * rowsum[m]);
        const double fine = (double)(_mm512_reduce_add_epi32(b[i]) - 128 * rowsum[m]);
        const double est = scale[m] * (x_scale * coarse + g_scale * fine);
        const double bound = c1[m] * g_max + c2[m] * x_abs_sum;
        const double hi = est + bound, lo = est - bound;
        upper[m] = hi + fabs(hi) * MARGIN;
        const double low = lo - fabs(lo) * MARGIN;
        if (low > best) best = low;
    }
    return best;
}

/*
 * Writes upper[0 .. N) and the indices n (ascending) with upper[n] >= max lower into picked.
 * Returns how many rows it picked, or -1 when they do not fit in max_picked or the shapes break
 * the contract (picked is then unspecified).
 */
int64_t kvrelay_head_screen(const uint8_t* xu, const uint8_t* gu, const int8_t* q, const int32_t* rowsum,
                            const double* scale, const double* c1, const double* c2, int64_t N, int64_t K,
                            double x_scale, double g_scale, double g_max, double x_abs_sum, double* upper,
                            int64_t* picked, int64_t max_picked) {
    if (K <= 0 || K % 64 != 0 || K >= 66000 || N < 4 || N % 4 != 0) return -1;
    const int64_t blocks = (N + BLOCK - 1) / BLOCK;
    double best_lower = -INFINITY;
#pragma omp parallel for schedule(static) reduction(max : best_lower)
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t end = (b + 1) * BLOCK < N ? (b + 1) * BLOCK : N;
        for (int64_t n = b * BLOCK; n < end; n += 4) {
            const double low = bound_rows(xu, gu, q, rowsum, scale, c1, c2, n, K, x_scale, g_scale, g_max,
                                          x_abs_sum, upper);
            if (low > best_lower) best_lower = low;
        }
    }
    int64_t count = 0;
    for (int64_t n = 0; n < N; n++) {
        if (upper[n] >= best_lower) {
            if (count == max_picked) return -1;
            picked[count++] = n;
        }
    }
    return count;
}
