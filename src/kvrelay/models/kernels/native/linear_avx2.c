/*
 * y = x W^T (+ bias) for bfloat16 x [M, K], W [N, K] (and bias [N]), on CPUs with AVX2 and FMA but without
 * bfloat16 arithmetic: the projections of a bfloat16 model where oneDNN has no bfloat16 kernel.
 *
 * Every output is one chain of float32 fused multiply-adds over k = 0 .. K-1 in order, starting from 0
 * (each product of two bfloat16 numbers is exact in float32), plus the bias, rounded once to bfloat16
 * (nearest even; NaN stays a quiet NaN). The chain depends on the output's row of x and row of W alone, not
 * on M, N or where the rows sit, so a row of x gives the same outputs alone or in any batch, and a subset of
 * W's rows gives the same outputs for them (kvrelay_linear_rows_at_avx2; greedy_head.py relies on it).
 *
 * Layout: kvrelay_pack_panels_avx2 lays W out once as panels of 16 rows, transposed: panel p holds
 * W[16p + j][k] at [p][k][j] (bfloat16, rows past N zero). A call runs every block of up to 6 rows of x
 * (float32) against each panel, 12 accumulators of 8 outputs; for a dozen rows or more the panel is first
 * widened to float32 in the cache. Calls of 4M multiply-adds or more split their panels over the calling
 * thread's OpenMP team, a few at a time to whichever thread is running (on a shared machine the OS may hold
 * one up); smaller ones run on the calling thread. Contract: M, N, K >= 1; x, panels, bias contiguous; y row
 * m at y + m * ldy, ldy >= N.
 */
#include <stdlib.h>

#include "avx2_simd.h"

#define NB 16                   /* rows of W per panel */
#define MR 6                    /* rows of x per micro-kernel call */
#define PARALLEL_MACS (1 << 22) /* smaller calls run on the calling thread alone */
#define CHUNK 4                 /* panels a thread takes at a time: a thread the OS holds up holds up little */

/* Transpose the 8x8 float32 block r[0..7] in place (row i becomes column i). */
static inline void transpose8(__m256* r) {
    const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
    const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
    const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
    const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
    const __m256 s0 = _mm256_shuffle_ps(t0, t2, 0x44), s1 = _mm256_shuffle_ps(t0, t2, 0xEE);
    const __m256 s2 = _mm256_shuffle_ps(t1, t3, 0x44), s3 = _mm256_shuffle_ps(t1, t3, 0xEE);
    const __m256 s4 = _mm256_shuffle_ps(t4, t6, 0x44), s5 = _mm256_shuffle_ps(t4, t6, 0xEE);
    const __m256 s6 = _mm256_shuffle_ps(t5, t7, 0x44), s7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    r[0] = _mm256_permute2f128_ps(s0, s4, 0x20);
    r[1] = _mm256_permute2f128_ps(s1, s5, 0x20);
    r[2] = _mm256_permute2f128_ps(s2, s6, 0x20);
    r[3] = _mm256_permute2f128_ps(s3, s7, 0x20);
    r[4] = _mm256_permute2f128_ps(s0, s4, 0x31);
    r[5] = _mm256_permute2f128_ps(s1, s5, 0x31);
    r[6] = _mm256_permute2f128_ps(s2, s6, 0x31);
    r[7] = _mm256_permute2f128_ps(s3, s7, 0x31);
}

/* P[k][j] = row j of the panel at k, as float32; rows[j] NULL gives zeros. K % 8 == 0 here. */
static void pack_panel(const uint16_t* const* rows, int64_t K, float* P) {
    for (int half = 0; half < 2; half++) {
        for (int64_t k = 0; k < K; k += 8) {
            __m256 r[8];
            for (int j = 0; j < 8; j++) {
                const uint16_t* row = rows[half * 8 + j];
                r[j] = row ? load8_bf16(row + k) : _mm256_setzero_ps();
            }
            transpose8(r);
            for (int j = 0; j < 8; j++) _mm256_storeu_ps(P + (k + j) * NB + half * 8, r[j]);
        }
    }
}

/* As pack_panel for any K (the last k % 8 columns one by one). */
static void pack_panel_any(const uint16_t* const* rows, int64_t K, float* P) {
    const int64_t body = K - K % 8;
    if (body) pack_panel(rows, body, P);
    for (int64_t k = body; k < K; k++) {
        for (int j = 0; j < NB; j++) {
            uint32_t bits = rows[j] ? (uint32_t)rows[j][k] << 16 : 0;
            memcpy(P + k * NB + j, &bits, 4);
        }
    }
}

/* acc[i] (16 outputs each) = rows i < ROWS of x (float32, stride K) against a panel, each a chain over k from
 * 0; LOAD(k, w0, w1) gives the panel's 16 values at k as float32. The accumulators are locals (an array would
 * be stored back on every step: it may alias the inputs). */
#define MICRO(NAME, ROWS, LOAD)                                                                                 \
    static inline void NAME(const float* xf, int64_t K, const void* panel, __m256 acc[MR][2]) {                 \
        __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00;               \
        __m256 c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;                                \
        for (int64_t k = 0; k < K; k++) {                                                                        \
            __m256 w0, w1;                                                                                       \
            LOAD(panel, k, w0, w1);                                                                              \
            __m256 b = _mm256_broadcast_ss(xf + k);                                                              \
            c00 = _mm256_fmadd_ps(b, w0, c00);                                                                   \
            c01 = _mm256_fmadd_ps(b, w1, c01);                                                                   \
            if (ROWS > 1) {                                                                                      \
                b = _mm256_broadcast_ss(xf + K + k);                                                             \
                c10 = _mm256_fmadd_ps(b, w0, c10);                                                               \
                c11 = _mm256_fmadd_ps(b, w1, c11);                                                               \
            }                                                                                                    \
            if (ROWS > 2) {                                                                                      \
                b = _mm256_broadcast_ss(xf + 2 * K + k);                                                         \
                c20 = _mm256_fmadd_ps(b, w0, c20);                                                               \
                c21 = _mm256_fmadd_ps(b, w1, c21);                                                               \
            }                                                                                                    \
            if (ROWS > 3) {                                                                                      \
                b = _mm256_broadcast_ss(xf + 3 * K + k);                                                         \
                c30 = _mm256_fmadd_ps(b, w0, c30);                                                               \
                c31 = _mm256_fmadd_ps(b, w1, c31);                                                               \
            }                                                                                                    \
            if (ROWS > 4) {                                                                                      \
                b = _mm256_broadcast_ss(xf + 4 * K + k);                                                         \
                c40 = _mm256_fmadd_ps(b, w0, c40);                                                               \
                c41 = _mm256_fmadd_ps(b, w1, c41);                                                               \
            }                                                                                                    \
            if (ROWS > 5) {                                                                                      \
                b = _mm256_broadcast_ss(xf + 5 * K + k);                                                         \
                c50 = _mm256_fmadd_ps(b, w0, c50);                                                               \
                c51 = _mm256_fmadd_ps(b, w1, c51);                                                               \
            }                                                                                                    \
        }                                                                                                        \
        acc[0][0] = c00, acc[0][1] = c01, acc[1][0] = c10, acc[1][1] = c11, acc[2][0] = c20, acc[2][1] = c21;   \
        acc[3][0] = c30, acc[3][1] = c31, acc[4][0] = c40, acc[4][1] = c41, acc[5][0] = c50, acc[5][1] = c51;   \
    }

#define LOAD_F32(panel, k, w0, w1)                         \
    do {                                                   \
        const float* q = (const float*)(panel) + (k) * NB; \
        w0 = _mm256_loadu_ps(q);                           \
        w1 = _mm256_loadu_ps(q + 8);                       \
    } while (0)
#define LOAD_BF16(panel, k, w0, w1)                              \
    do {                                                         \
        const uint16_t* q = (const uint16_t*)(panel) + (k) * NB; \
        w0 = load8_bf16(q);                                      \
        w1 = load8_bf16(q + 8);                                  \
    } while (0)

MICRO(f32_1, 1, LOAD_F32)
MICRO(f32_2, 2, LOAD_F32)
MICRO(f32_3, 3, LOAD_F32)
MICRO(f32_4, 4, LOAD_F32)
MICRO(f32_5, 5, LOAD_F32)
MICRO(f32_6, 6, LOAD_F32)
MICRO(bf16_1, 1, LOAD_BF16)
MICRO(bf16_2, 2, LOAD_BF16)
MICRO(bf16_3, 3, LOAD_BF16)
MICRO(bf16_4, 4, LOAD_BF16)
MICRO(bf16_5, 5, LOAD_BF16)
MICRO(bf16_6, 6, LOAD_BF16)

/* The micro-kernel for ``rows`` rows against a float32 (wide) or bfloat16 panel. */
static inline void micro(const float* xf, int64_t K, const void* panel, int wide, int rows, __m256 acc[MR][2]) {
    if (wide) {
        switch (rows) {
            case 1: f32_1(xf, K, panel, acc); return;
            case 2: f32_2(xf, K, panel, acc); return;
            case 3: f32_3(xf, K, panel, acc); return;
            case 4: f32_4(xf, K, panel, acc); return;
            case 5: f32_5(xf, K, panel, acc); return;
            default: f32_6(xf, K, panel, acc); return;
        }
    }
    switch (rows) {
        case 1: bf16_1(xf, K, panel, acc); return;
        case 2: bf16_2(xf, K, panel, acc); return;
        case 3: bf16_3(xf, K, panel, acc); return;
        case 4: bf16_4(xf, K, panel, acc); return;
        case 5: bf16_5(xf, K, panel, acc); return;
        default: bf16_6(xf, K, panel, acc); return;
    }
}

/* Outputs of one panel for every row of x: y[m][n0 + j] for j < width. */
static void panel_outputs(const float* xf, int64_t M, int64_t K, const void* panel, int wide, const float* bias16,
                          uint16_t* y, int64_t ldy, int64_t n0, int width) {
    __m256 acc[MR][2];
    const __m256 b0 = _mm256_loadu_ps(bias16), b1 = _mm256_loadu_ps(bias16 + 8);
    for (int64_t m = 0; m < M; m += MR) {
        const int rows = M - m < MR ? (int)(M - m) : MR;
        micro(xf + m * K, K, panel, wide, rows, acc);
        for (int i = 0; i < rows; i++) {
            uint16_t* out = y + (m + i) * ldy + n0;
            const __m128i lo = to_bf16x8(_mm256_add_ps(acc[i][0], b0));
            const __m128i hi = to_bf16x8(_mm256_add_ps(acc[i][1], b1));
            if (width == NB) {
                _mm_storeu_si128((__m128i*)out, lo);
                _mm_storeu_si128((__m128i*)(out + 8), hi);
            } else {
                uint16_t tmp[NB];
                _mm_storeu_si128((__m128i*)tmp, lo);
                _mm_storeu_si128((__m128i*)(tmp + 8), hi);
                memcpy(out, tmp, (size_t)width * 2);
            }
        }
    }
}

static float* to_float(const uint16_t* x, int64_t count) {
    float* xf = aligned_alloc(64, (size_t)((count * 4 + 63) / 64 * 64));
    if (!xf) return NULL;
    for (int64_t i = 0; i < count; i++) {
        uint32_t bits = (uint32_t)x[i] << 16;
        memcpy(xf + i, &bits, 4);
    }
    return xf;
}

/* The bias of panel rows n0 .. n0 + 15 as float32 (zeros past N or without a bias); adding 0 changes nothing. */
static void panel_bias(const uint16_t* bias, int64_t n0, int64_t N, float* out) {
    for (int j = 0; j < NB; j++) {
        uint32_t bits = (bias && n0 + j < N) ? (uint32_t)bias[n0 + j] << 16 : 0;
        memcpy(out + j, &bits, 4);
    }
}

/* The panels of W [N, K] into out [ceil(N / 16)][K][16] (see the layout above); returns 0, or -1 on bad shapes. */
int kvrelay_pack_panels_avx2(const uint16_t* w, int64_t N, int64_t K, uint16_t* out) {
    if (N < 1 || K < 1) return -1;
    const int64_t panels = (N + NB - 1) / NB;
#pragma omp parallel for schedule(dynamic, CHUNK)
    for (int64_t p = 0; p < panels; p++) {
        uint16_t* panel = out + p * K * NB;
        for (int j = 0; j < NB; j++) {
            const int64_t n = p * NB + j;
            for (int64_t k = 0; k < K; k++) panel[k * NB + j] = n < N ? w[n * K + k] : 0;
        }
    }
    return 0;
}

#define WIDEN_ROWS 12 /* from this many rows of x on, a panel is widened to float32 once per call */

/* Returns 0, or -1 on a shape outside the contract or no memory (nothing is written then). */
int kvrelay_linear_avx2(const uint16_t* x, int64_t M, const uint16_t* panels, const uint16_t* bias, int64_t N,
                        int64_t K, uint16_t* y, int64_t ldy) {
    if (M < 1 || N < 1 || K < 1 || ldy < N) return -1;
    float* xf = to_float(x, M * K);
    if (!xf) return -1;
    const int64_t count = (N + NB - 1) / NB;
    const int wide = M >= WIDEN_ROWS;
    int failed = 0;
#pragma omp parallel reduction(| : failed) if (M * N * K >= PARALLEL_MACS)
    {
        float* P = wide ? aligned_alloc(64, (size_t)((K * NB * 4 + 63) / 64 * 64)) : NULL;
        if (wide && !P) failed = 1;
#pragma omp for schedule(dynamic, CHUNK)
        for (int64_t p = 0; p < count; p++) {
            if (failed) continue;
            const int64_t n0 = p * NB;
            const int width = N - n0 < NB ? (int)(N - n0) : NB;
            const uint16_t* panel = panels + p * K * NB;
            float b[NB];
            panel_bias(bias, n0, N, b);
            if (wide) {
                for (int64_t i = 0; i < K * NB; i += 8) _mm256_storeu_ps(P + i, load8_bf16(panel + i));
                panel_outputs(xf, M, K, P, 1, b, y, ldy, n0, width);
            } else {
                panel_outputs(xf, M, K, panel, 0, b, y, ldy, n0, width);
            }
        }
        free(P);
    }
    free(xf);
    return failed ? -1 : 0;
}

/* y[j] = the output kvrelay_linear_avx2 gives for the one row x and weight row idx[j] (no bias), j < count. */
int kvrelay_linear_rows_at_avx2(const uint16_t* x, const uint16_t* w, int64_t K, const int64_t* idx, int64_t count,
                                uint16_t* y) {
    if (K < 1 || count < 0) return -1;
    if (count == 0) return 0;
    float* xf = to_float(x, K);
    if (!xf) return -1;
    const int64_t panels = (count + NB - 1) / NB;
    int failed = 0;
#pragma omp parallel reduction(| : failed) if (count * K >= PARALLEL_MACS)
    {
        float* P = aligned_alloc(64, (size_t)((K * NB * 4 + 63) / 64 * 64));
        if (!P) failed = 1;
#pragma omp for schedule(dynamic, CHUNK)
        for (int64_t p = 0; p < panels; p++) {
            if (!P) continue;
            const int64_t j0 = p * NB;
            const int width = count - j0 < NB ? (int)(count - j0) : NB;
            const uint16_t* rows[NB];
            for (int j = 0; j < NB; j++) rows[j] = j < width ? w + idx[j0 + j] * K : NULL;
            const float zero[NB] = {0};
            pack_panel_any(rows, K, P);
            panel_outputs(xf, 1, K, P, 1, zero, y, count, j0, width);
        }
        free(P);
    }
    free(xf);
    return failed ? -1 : 0;
}
