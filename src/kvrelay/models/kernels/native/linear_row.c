/*
 * y = W x for one bfloat16 row x against a bfloat16 weight W [N, K]: the GEMV that a
 * single-row projection is, reading each weight row once, AVX-512 BF16.
 *
 * Each output is the float32 sum of its products, rounded once to bfloat16 (nearest even), as
 * F.linear computes it in bfloat16; the summation order differs, so an output can differ from
 * it in its last bit. The order depends on the row alone, not on N or on where the row sits, so
 * a subset of W's rows gives the same outputs for them (greedy_head.py relies on it). Contract: K % 32 == 0, N >= 1, x [K], W [N, K] and y [N] contiguous.
 * Weight rows are split over the calling thread's OpenMP team.
 */
#include "bf16_simd.h"

#define PREFETCH_ROWS 16
#define BLOCK 64
#define PARALLEL_ROWS 256

/* y[n .. n + 3] from weight rows n .. n + 3. */
static inline void four_outputs(const uint16_t* x, const uint16_t* w, int64_t K, uint16_t* y, int64_t n) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    const uint16_t* rows = w + n * K;
    for (int64_t c = 0; c < K; c += 32) {
        for (int i = 0; i < 4; i++) _mm_prefetch((const char*)(rows + (PREFETCH_ROWS + i) * K + c), _MM_HINT_T1);
        __m512bh xc = (__m512bh)_mm512_loadu_si512(x + c);
        a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(rows + c), xc);
        a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_loadu_si512(rows + K + c), xc);
        a2 = _mm512_dpbf16_ps(a2, (__m512bh)_mm512_loadu_si512(rows + 2 * K + c), xc);
        a3 = _mm512_dpbf16_ps(a3, (__m512bh)_mm512_loadu_si512(rows + 3 * K + c), xc);
    }
    _mm_storel_epi64((__m128i*)(y + n), (__m128i)_mm_cvtneps_pbh(sum4(a0, a1, a2, a3)));
}

/* y[n] from weight row n, summed in four_outputs' order: every row's value is the same wherever it sits. */
static inline void one_output(const uint16_t* x, const uint16_t* w, int64_t K, uint16_t* y, int64_t n) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t c = 0; c < K; c += 32)
        acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(w + n * K + c), (__m512bh)_mm512_loadu_si512(x + c));
    y[n] = (uint16_t)_mm_extract_epi16((__m128i)_mm_cvtneps_pbh(sum4(acc, acc, acc, acc)), 0);
}

/* y[n] for the weight rows n of block b (BLOCK rows, the last block shorter). */
static inline void block_outputs(const uint16_t* x, const uint16_t* w, int64_t N, int64_t K, uint16_t* y, int64_t b) {
    const int64_t end = (b + 1) * BLOCK < N ? (b + 1) * BLOCK : N;
    int64_t n = b * BLOCK;
    for (; n + 4 <= end; n += 4) four_outputs(x, w, K, y, n);
    for (; n < end; n++) one_output(x, w, K, y, n);
}

/* Returns 0, or -1 when the shapes break the contract (nothing is written then). */
int kvrelay_linear_row(const uint16_t* x, const uint16_t* w, int64_t N, int64_t K, uint16_t* y) {
    if (K <= 0 || K % 32 != 0 || N < 1) return -1;
    const int64_t blocks = (N + BLOCK - 1) / BLOCK;
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < blocks; b++) block_outputs(x, w, N, K, y, b);
    return 0;
}

/* y[j] = the output kvrelay_linear_row gives input row x[at[j]] (x [*, K]; at NULL: row 0) for weight row
 * idx[j], j < count: chosen outputs of one or several inputs, each exactly as the full GEMV gives it; one
 * thread below PARALLEL_ROWS outputs (a parallel region costs more than their dots). */
int kvrelay_linear_pairs(const uint16_t* x, const uint16_t* w, int64_t K, const int64_t* idx, const int64_t* at,
                         int64_t count, uint16_t* y) {
    if (K <= 0 || K % 32 != 0 || count < 0) return -1;
#pragma omp parallel for schedule(static) if (count >= PARALLEL_ROWS)
    for (int64_t j = 0; j < count; j++) {
        __m512 acc = _mm512_setzero_ps();
        const uint16_t* row = w + idx[j] * K;
        const uint16_t* in = at == NULL ? x : x + at[j] * K;
        for (int64_t c = 0; c < K; c += 32)
            acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(row + c), (__m512bh)_mm512_loadu_si512(in + c));
        y[j] = (uint16_t)_mm_extract_epi16((__m128i)_mm_cvtneps_pbh(sum4(acc, acc, acc, acc)), 0);
    }
    return 0;
}

/* y[j] = the output kvrelay_linear_row gives for weight row idx[j], j < count (idx in [0, N)). */
int kvrelay_linear_rows_at(const uint16_t* x, const uint16_t* w, int64_t K, const int64_t* idx, int64_t count,
                           uint16_t* y) {
    return kvrelay_linear_pairs(x, w, K, idx, NULL, count, y);
}
