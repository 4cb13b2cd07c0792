/*
 * head_screen.c for CPUs with AVX2 but without AVX-512: the same functions, arguments and results (that file
 * states the arithmetic), with the int8 dots taken as AVX2 can take them exactly.
 *
 * The input parts come as uint8 xu = hq + 128 (likewise gu); here they are turned back into the signed parts
 * hq and gq (|hq|, |gq| <= 127) and each dot is summed as pairs |hq_i| * (q_i * sign hq_i) (vpmaddubsw: a pair
 * is at most 2 * 127 * 127 < 2^15, so nothing saturates), then in int32: the exact dot of hq and Q[n]
 * without the rowsum term. rowsum is not read.
 *
 * Contract: K % 64 == 0, N % 4 == 0, all arrays contiguous, upper has N doubles, picked has room for
 * max_picked indices. Rows are split over the calling thread's OpenMP team, eight blocks at a time to whichever
 * thread is running.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "head_quantize.h"

#define PREFETCH_ROWS 16
#define BLOCK 256
#define MARGIN (0.00390625 * 1.001) /* 2^-8, widened for the double arithmetic */

static inline int32_t hsum_epi32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    return _mm_cvtsi128_si32(s);
}

/* The dot of one signed part (s, with |s| = a) and 32 weights w, as eight int32 partial sums added to acc. */
static inline __m256i dot32(__m256i acc, __m256i a, __m256i s, __m256i w, __m256i ones) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(a, _mm256_sign_epi8(w, s)), ones));
}

/* The bounds of rows n .. n + 3 from their two int32 dots (coarse and fine part of the input). */
static inline double bound_rows(const uint8_t* xu, const uint8_t* gu, const int8_t* q, const double* scale,
                                const double* c1, const double* c2, int64_t n, int64_t K, double x_scale,
                                double g_scale, double g_max, double x_abs_sum, double* upper) {
    const __m256i flip = _mm256_set1_epi8((char)0x80), ones = _mm256_set1_epi16(1);
    __m256i a[4], b[4];
    for (int i = 0; i < 4; i++) a[i] = b[i] = _mm256_setzero_si256();
    const int8_t* rows = q + n * K;
    for (int64_t c = 0; c < K; c += 32) {
        const __m256i xs = _mm256_xor_si256(_mm256_loadu_si256((const __m256i*)(xu + c)), flip);
        const __m256i gs = _mm256_xor_si256(_mm256_loadu_si256((const __m256i*)(gu + c)), flip);
        const __m256i xa = _mm256_abs_epi8(xs), ga = _mm256_abs_epi8(gs);
        for (int i = 0; i < 4; i++) {
            _mm_prefetch((const char*)(rows + (PREFETCH_ROWS + i) * K + c), _MM_HINT_T1);
            const __m256i w = _mm256_loadu_si256((const __m256i*)(rows + i * K + c));
            a[i] = dot32(a[i], xa, xs, w, ones);
            b[i] = dot32(b[i], ga, gs, w, ones);
        }
    }
    double best = -INFINITY;
    for (int i = 0; i < 4; i++) {
        const int64_t m = n + i;
        const double coarse = (double)hsum_epi32(a[i]);
        const double fine = (double)hsum_epi32(b[i]);
        const double est = scale[m] * (x_scale * coarse + g_scale * fine);
        const double bound = c1[m] * g_max + c2[m] * x_abs_sum;
        const double hi = est + bound, lo = est - bound;
        upper[m] = hi + fabs(hi) * MARGIN;
        const double low = lo - fabs(lo) * MARGIN;
        if (low > best) best = low;
    }
    return best;
}

/* As head_screen.c: upper[0 .. N), the picked rows ascending; their count, or -1 (too many, or bad shapes). */
int64_t kvrelay_head_screen(const uint8_t* xu, const uint8_t* gu, const int8_t* q, const int32_t* rowsum,
                            const double* scale, const double* c1, const double* c2, int64_t N, int64_t K,
                            double x_scale, double g_scale, double g_max, double x_abs_sum, double* upper,
                            int64_t* picked, int64_t max_picked) {
    (void)rowsum;
    if (K <= 0 || K % 64 != 0 || K >= 66000 || N < 4 || N % 4 != 0) return -1;
    const int64_t blocks = (N + BLOCK - 1) / BLOCK;
    double best_lower = -INFINITY;
#pragma omp parallel for schedule(dynamic, 8) reduction(max : best_lower)
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t end = (b + 1) * BLOCK < N ? (b + 1) * BLOCK : N;
        for (int64_t n = b * BLOCK; n < end; n += 4) {
            const double low =
                bound_rows(xu, gu, q, scale, c1, c2, n, K, x_scale, g_scale, g_max, x_abs_sum, upper);
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
