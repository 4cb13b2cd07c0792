/*
 * The gated MLP of a few bfloat16 rows, down(act(gate x) * up x), in ONE parallel region, AVX-512 BF16.
 *
 * A decode step's MLP through oneDNN is three parallel regions (gate with its activation, up with the
 * product, down); with passive OpenMP threads each wakes the sleeping partner (about 100 us on the
 * machines measured), which a few rows' projections do not amortize. Here phase 1 splits the intermediate
 * rows over the team (gate and up rows read once each, every input row's dots from L1), a spin barrier
 * inside the region waits for the whole intermediate, and phase 2 splits the output rows of down.
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

#define MAX_ROWS 16

/* The float32 sums of input row x (K columns) against weight rows w .. w + 3K and against v .. v + 3K, four
 * lanes each: sixteen lanes of dot-product pairs per 32 columns, then sum4, in eight independent chains (so the
 * instruction's latency is hidden). A sum depends on its row and weight row alone. */
static inline void four_sums_twice(const uint16_t* x, const uint16_t* w, const uint16_t* v, int64_t K, __m128* sw,
                                   __m128* sv) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
    for (int64_t c = 0; c < K; c += 32) {
        const __m512bh xc = (__m512bh)_mm512_loadu_si512(x + c);
        a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(w + c), xc);
        a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_loadu_si512(w + K + c), xc);
        a2 = _mm512_dpbf16_ps(a2, (__m512bh)_mm512_loadu_si512(w + 2 * K + c), xc);
        a3 = _mm512_dpbf16_ps(a3, (__m512bh)_mm512_loadu_si512(w + 3 * K + c), xc);
        b0 = _mm512_dpbf16_ps(b0, (__m512bh)_mm512_loadu_si512(v + c), xc);
        b1 = _mm512_dpbf16_ps(b1, (__m512bh)_mm512_loadu_si512(v + K + c), xc);
        b2 = _mm512_dpbf16_ps(b2, (__m512bh)_mm512_loadu_si512(v + 2 * K + c), xc);
        b3 = _mm512_dpbf16_ps(b3, (__m512bh)_mm512_loadu_si512(v + 3 * K + c), xc);
    }
    *sw = sum4(a0, a1, a2, a3);
    *sv = sum4(b0, b1, b2, b3);
}

/* The same sums of two input rows x and z against the same weight rows w .. w + 3K. */
static inline void four_sums_two_rows(const uint16_t* x, const uint16_t* z, const uint16_t* w, int64_t K, __m128* sx,
                                      __m128* sz) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
    for (int64_t c = 0; c < K; c += 32) {
        const __m512bh xc = (__m512bh)_mm512_loadu_si512(x + c), zc = (__m512bh)_mm512_loadu_si512(z + c);
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w + c), w1 = (__m512bh)_mm512_loadu_si512(w + K + c);
        const __m512bh w2 = (__m512bh)_mm512_loadu_si512(w + 2 * K + c), w3 = (__m512bh)_mm512_loadu_si512(w + 3 * K + c);
        a0 = _mm512_dpbf16_ps(a0, w0, xc);
        a1 = _mm512_dpbf16_ps(a1, w1, xc);
        a2 = _mm512_dpbf16_ps(a2, w2, xc);
        a3 = _mm512_dpbf16_ps(a3, w3, xc);
        b0 = _mm512_dpbf16_ps(b0, w0, zc);
        b1 = _mm512_dpbf16_ps(b1, w1, zc);
        b2 = _mm512_dpbf16_ps(b2, w2, zc);
        b3 = _mm512_dpbf16_ps(b3, w3, zc);
    }
    *sx = sum4(a0, a1, a2, a3);
    *sz = sum4(b0, b1, b2, b3);
}

/* Rows [lo, hi) of the team's share of n rows in steps of four: thread t of nt. */
static inline void share(int64_t n, int t, int nt, int64_t* lo, int64_t* hi) {
    const int64_t quads = n / 4;
    *lo = quads * t / nt * 4;
    *hi = quads * (t + 1) / nt * 4;
}

/* Thread t's share of y = a W^T (a [M, K] with row stride K, W [N, K] row-major), in quads of output columns, the
 * input rows in pairs (the last of an odd count as its own pair); each sum rounded once to bfloat16. */
static void projection_share(const uint16_t* a, int64_t K, int64_t M, const uint16_t* w, int64_t N, uint16_t* y,
                             int t, int nt) {
    int64_t lo, hi;
    share(N, t, nt, &lo, &hi);
    for (int64_t n = lo; n < hi; n += 4)
        for (int64_t m = 0; m < M; m += 2) {
            const int64_t z = m + 1 < M ? m + 1 : m;
            __m128 s0, s1;
            four_sums_two_rows(a + m * K, a + z * K, w + n * K, K, &s0, &s1);
            _mm_storel_epi64((__m128i*)(y + m * N + n), (__m128i)_mm_cvtneps_pbh(s0));
            if (z != m) _mm_storel_epi64((__m128i*)(y + z * N + n), (__m128i)_mm_cvtneps_pbh(s1));
        }
}

/* Thread t's share of the MLP of x into y (the intermediate in mid); one arrival at *arrived between phases:
 * every thread has run by then, so a spin is short, where a futex would cost the wake-up this saves. */
static void mlp_share(const uint16_t* x, int64_t M, int64_t H, const uint16_t* gate, const uint16_t* up, int64_t I,
                      const uint16_t* down, int act, uint16_t* mid, uint16_t* y, int t, int nt, atomic_int* arrived) {
    int64_t lo, hi;
    share(I, t, nt, &lo, &hi);
    for (int64_t j = lo; j < hi; j += 4)
        for (int64_t m = 0; m < M; m++) {
            __m128 g, u;
            four_sums_twice(x + m * H, gate + j * H, up + j * H, H, &g, &u);
            const __m512 a = round_bf16(activate(_mm512_castps128_ps512(g), act));
            const __m512 p = _mm512_mul_ps(a, _mm512_castps128_ps512(u));
            _mm_storel_epi64((__m128i*)(mid + m * I + j), (__m128i)_mm_cvtneps_pbh(_mm512_castps512_ps128(p)));
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
