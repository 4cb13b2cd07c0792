/*
 * The gated MLP of a few bfloat16 rows, down(act(gate x) * up x), in ONE parallel region, AVX-512 BF16.
 *
 * A decode step's MLP through oneDNN is three parallel regions (gate with its activation, up with the
 * product, down); with passive OpenMP threads each wakes the sleeping partner (about 100 us on the
 * machines measured), which a few rows' projections do not amortize. Here phase 1 splits the intermediate
 * rows over the team (four gate and four up rows at a time, each value loaded once for two input rows, the
 * weight rows kept in L1 across the input rows), a spin barrier inside the region waits for the whole
 * intermediate, and phase 2 splits the output rows of down (four weight rows against four input rows).
 *
 * Numerics are the post-op path's (mlp.GatedMLP): the activation applies to the gate's float32 sum and is
 * rounded once to bfloat16; the product with the up projection's float32 sum is rounded once; down's sums
 * are rounded once. Each float32 sum is linear_row.c's (sixteen lanes of dot-product pairs per 32 columns,
 * then four-way horizontal sums), so a row's output does not depend on the other rows or on M.
 *
 * kvrelay_layer_tail runs a decoder layer's whole tail with these sums (layer_tail.h).
 *
 * Contract: 1 <= M <= MAX_ROWS, H % 32 == 0, I % 32 == 0, I % 4 == 0, H % 4 == 0, x [M, H], gate and up
 * [I, H], down [H, I], mid [M, I] (scratch), y [M, H], all contiguous bfloat16; act 0 = SiLU, 1 = GELU with
 * the tanh approximation, 2 = GELU with erf. Returns 0, or -1 when the shapes break the contract (nothing is written then).
 */
#include "layer_tail.h"
#include "mlp_activations.h"

#define MAX_ROWS 32

/* The float32 sums of input rows x and z (K columns) against weight rows w .. w + 3K and against v .. v + 3K, four
 * lanes each: sixteen lanes of dot-product pairs per 32 columns, then sum4, in sixteen independent chains (so the
 * instruction's latency is hidden and each weight value loaded serves both rows). A sum depends on its row and
 * weight row alone. */
static inline void four_sums_twice_two_rows(const uint16_t* x, const uint16_t* z, const uint16_t* w, const uint16_t* v,
                                            int64_t K, __m128 sums[4]) {
    __m512 a[4], b[4], c[4], d[4];
    for (int i = 0; i < 4; i++) a[i] = b[i] = c[i] = d[i] = _mm512_setzero_ps();
    for (int64_t col = 0; col < K; col += 32) {
        const __m512bh xc = (__m512bh)_mm512_loadu_si512(x + col), zc = (__m512bh)_mm512_loadu_si512(z + col);
        for (int i = 0; i < 4; i++) {
            const __m512bh wi = (__m512bh)_mm512_loadu_si512(w + i * K + col);
            const __m512bh vi = (__m512bh)_mm512_loadu_si512(v + i * K + col);
            a[i] = _mm512_dpbf16_ps(a[i], wi, xc);
            b[i] = _mm512_dpbf16_ps(b[i], vi, xc);
            c[i] = _mm512_dpbf16_ps(c[i], wi, zc);
            d[i] = _mm512_dpbf16_ps(d[i], vi, zc);
        }
    }
    sums[0] = sum4(a[0], a[1], a[2], a[3]);
    sums[1] = sum4(b[0], b[1], b[2], b[3]);
    sums[2] = sum4(c[0], c[1], c[2], c[3]);
    sums[3] = sum4(d[0], d[1], d[2], d[3]);
}

/* The same sums of four input rows x[0..3] against the same weight rows w .. w + 3K (each weight value loaded once
 * for the four), into s[0..3]. */
static inline void four_sums_four_rows(const uint16_t* const x[4], const uint16_t* w, int64_t K, __m128 s[4]) {
    __m512 acc[4][4];
    for (int r = 0; r < 4; r++)
        for (int i = 0; i < 4; i++) acc[r][i] = _mm512_setzero_ps();
    for (int64_t c = 0; c < K; c += 32) {
        __m512bh wc[4];
        for (int i = 0; i < 4; i++) wc[i] = (__m512bh)_mm512_loadu_si512(w + i * K + c);
        for (int r = 0; r < 4; r++) {
            const __m512bh xc = (__m512bh)_mm512_loadu_si512(x[r] + c);
            for (int i = 0; i < 4; i++) acc[r][i] = _mm512_dpbf16_ps(acc[r][i], wc[i], xc);
        }
    }
    for (int r = 0; r < 4; r++) s[r] = sum4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]);
}

/* Rows [lo, hi) of the team's share of n rows in steps of four: thread t of nt. */
static inline void share(int64_t n, int t, int nt, int64_t* lo, int64_t* hi) {
    const int64_t quads = n / 4;
    *lo = quads * t / nt * 4;
    *hi = quads * (t + 1) / nt * 4;
}

/* Thread t's share of y = a W^T (a [M, K] with row stride K, W [N, K] row-major), in quads of output columns, the
 * input rows four at a time (the last one repeated where fewer are left); each sum rounded once to bfloat16. */
static void projection_share(const uint16_t* a, int64_t K, int64_t M, const uint16_t* w, int64_t N, uint16_t* y,
                             int t, int nt) {
    int64_t lo, hi;
    share(N, t, nt, &lo, &hi);
    for (int64_t n = lo; n < hi; n += 4)
        for (int64_t m = 0; m < M; m += 4) {
            const uint16_t* rows[4];
            for (int r = 0; r < 4; r++) rows[r] = a + (m + r < M ? m + r : M - 1) * K;
            __m128 s[4];
            four_sums_four_rows(rows, w + n * K, K, s);
            for (int r = 0; r < 4 && m + r < M; r++)
                _mm_storel_epi64((__m128i*)(y + (m + r) * N + n), (__m128i)_mm_cvtneps_pbh(s[r]));
        }
}

/* Thread t's share of the MLP of x into y (the intermediate in mid); one arrival at *arrived between phases:
 * every thread has run by then, so a spin is short, where a futex would cost the wake-up this saves. */
static void mlp_share(const uint16_t* x, int64_t M, int64_t H, const uint16_t* gate, const uint16_t* up, int64_t I,
                      const uint16_t* down, int act, uint16_t* mid, uint16_t* y, int t, int nt, atomic_int* arrived) {
    int64_t lo, hi;
    share(I, t, nt, &lo, &hi);
    for (int64_t j = lo; j < hi; j += 4)
        for (int64_t m = 0; m < M; m += 2) {
            const int64_t z = m + 1 < M ? m + 1 : m;
            __m128 sums[4]; /* gate and up of row m, then of row z */
            four_sums_twice_two_rows(x + m * H, x + z * H, gate + j * H, up + j * H, H, sums);
            for (int r = 0; r < (z != m ? 2 : 1); r++) {
                const __m512 act_g = round_bf16(activate(_mm512_castps128_ps512(sums[2 * r]), act));
                const __m512 p = _mm512_mul_ps(act_g, _mm512_castps128_ps512(sums[2 * r + 1]));
                _mm_storel_epi64((__m128i*)(mid + (m + r) * I + j), (__m128i)_mm_cvtneps_pbh(_mm512_castps512_ps128(p)));
            }
        }
    arrive_and_wait(arrived, nt);
    projection_share(mid, I, M, down, H, y, t, nt);
}

int kvrelay_mlp_rows(const uint16_t* x, int64_t M, int64_t H, const uint16_t* gate, const uint16_t* up, int64_t I,
                     const uint16_t* down, int act, uint16_t* mid, uint16_t* y) {
    if (M < 1 || M > MAX_ROWS || H <= 0 || I <= 0 || H % 32 || I % 32 || act < 0 || act > 2) return -1;
    atomic_int arrived = 0;
#pragma omp parallel
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        mlp_share(x, M, H, gate, up, I, down, act, mid, y, t, nt, &arrived);
    }
    return 0;
}

/* kvrelay_layer_tail: layer_tail.h's layer_tail with these kernels, for M <= MAX_ROWS rows, every weight (Wo,
 * gate, up, down, next's qkv) row-major bfloat16 as it is. */
int kvrelay_layer_tail(const uint16_t* attn, int64_t A, const uint16_t* o_w, uint16_t* h, int64_t M, int64_t H,
                       const float* post_attn_w, const float* pre_ff_w, const float* post_ff_w, float eps,
                       int unit_offset, const uint16_t* gate, const uint16_t* up, int64_t I, const uint16_t* down,
                       int act, uint16_t* scratch, const NextHead* next) {
    return layer_tail(attn, A, o_w, h, M, H, post_attn_w, pre_ff_w, post_ff_w, eps, unit_offset, gate, up, I, down, act,
                      scratch, next, MAX_ROWS, projection_share, mlp_share, 0, 0);
}
