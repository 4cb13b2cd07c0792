/*
 * A decoder layer's work after its attention for a decode step's few rows, in one parallel region: what the
 * kernels of mlp_rows.c (AVX-512 BF16, weights as they are) and mlp_rows_amx.c (AMX tiles, weights in tile order)
 * share. Each includes this after defining its own
 *   projection_share(a, K, M, w, N, y, t, nt): thread t's share of y [M, N] = a [M, K] W^T, each rounded once;
 *   mlp_share(x, M, H, gate, up, I, down, act, mid, y, t, nt, arrived): thread t's share of the gated MLP, one
 *   arrival at *arrived between its phases;
 * and runs layer_tail with them.
 */
#ifndef KVRELAY_LAYER_TAIL_H
#define KVRELAY_LAYER_TAIL_H

#include <omp.h>
#include <sched.h>
#include <stdatomic.h>

#include "bf16_simd.h"
#include "rms_row.h"

#define MAX_HEAD_DIM 1024
#define SPIN_TURNS 4096 /* about 20-100 us of pause before a waiting thread yields its core */

/* Wait until nt threads have arrived at *arrived (one use per counter): every thread is running, so a spin
 * waits only for the slower share, where a futex would cost the wake-up these kernels save. */
static inline void arrive_and_wait(atomic_int* arrived, int nt) {
    atomic_fetch_add_explicit(arrived, 1, memory_order_acq_rel);
    for (int turns = 0; atomic_load_explicit(arrived, memory_order_acquire) < nt; turns++) {
        if (turns < SPIN_TURNS)
            _mm_pause();
        else
            sched_yield();
    }
}

/* h = h + N2(o), with N2 the norm of w2 (NULL: no norm), rounded as kvrelay_add_rms_norm rounds it; rows of
 * thread t's share. */
static void add_normed_rows(uint16_t* h, const uint16_t* o, int64_t M, int64_t H, const float* w, float eps,
                            int unit_offset, int t, int nt) {
    for (int64_t m = t; m < M; m += nt) {
        if (w != 0) {
            norm_row(o + m * H, w, H, eps, unit_offset, h + m * H, h + m * H);
            continue;
        }
        for (int64_t c = 0; c < H; c += 16) {
            const __m512 sum = _mm512_add_ps(load_bf16(h + m * H + c), load_bf16(o + m * H + c));
            _mm256_storeu_si256((__m256i*)(h + m * H + c), (__m256i)_mm512_cvtneps_pbh(sum));
        }
    }
}

/* The next layer's start for row m's head hd (of qk_heads q and k heads of width D, v after them), in place in
 * qkv [M, N]: the head's RMS norm (per-head weights w [qk_heads, D]) then rope with row m's cos and signed sin
 * ([M, D]), each rounding as kvrelay_rms_norm_rope rounds it. */
static void norm_rope_head(uint16_t* qkv, int64_t N, int64_t m, int64_t hd, int64_t D, const float* w, float eps,
                           int unit_offset, const uint16_t* cos, const uint16_t* sin) {
    uint16_t normed[MAX_HEAD_DIM] __attribute__((aligned(64)));
    uint16_t* row = qkv + m * N + hd * D;
    norm_row(row, w + hd * D, D, eps, unit_offset, 0, normed);
    const uint16_t *c_row = cos + m * D, *s_row = sin + m * D;
    const int64_t half = D / 2;
    for (int64_t c = 0; c < D; c += 16) {
        const int64_t swapped = c < half ? c + half : c - half;
        const __m512 a = round_bf16(_mm512_mul_ps(load_bf16(normed + c), load_bf16(c_row + c)));
        const __m512 b = round_bf16(_mm512_mul_ps(load_bf16(normed + swapped), load_bf16(s_row + c)));
        _mm256_storeu_si256((__m256i*)(row + c), (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(a, b)));
    }
}

/* The next layer's start, which a layer's tail may compute in its region: qkv [M, N] = N_in(h) Wqkv^T, then
 * its first qk_heads heads of width D normed (per-head weights qk_norm_w) and rotated (cos, sin [M, D]). */
typedef struct {
    const float* in_norm_w;
    const uint16_t* qkv_w; /* the next layer's q, k, v projection [N, H], as the kernel reads weights */
    int64_t N;
    int64_t qk_heads;
    int64_t D;
    const float* qk_norm_w;
    const uint16_t* cos;
    const uint16_t* sin;
    uint16_t* qkv;
} NextHead;

typedef void (*ProjectionShare)(const uint16_t* a, int64_t K, int64_t M, const uint16_t* w, int64_t N, uint16_t* y,
                                int t, int nt);
typedef void (*MlpShare)(const uint16_t* x, int64_t M, int64_t H, const uint16_t* gate, const uint16_t* up, int64_t I,
                         const uint16_t* down, int act, uint16_t* mid, uint16_t* y, int t, int nt, atomic_int* arrived);

/*
 * A decoder layer after its attention, for M <= max_rows rows, in one parallel region:
 *   h += N_post_attn(attn Wo^T);  x = N_pre_ff(h);  h += N_post_ff(down(act(gate x) * up x))
 * where an N whose weight is NULL is the identity (Llama: post_attn_w and post_ff_w NULL), then, given next,
 * the next layer's normed and rotated q and k and its v (NextHead). Each step rounds as the separate kernels
 * do (the projection's sums once, kvrelay_add_rms_norm, kvrelay_rms_norm, kvrelay_rms_norm_rope, the MLP).
 * attn [M, A], h [M, H] (in place), o from Wo [H, A] (as the kernel reads weights); scratch holds 3 M H + M I
 * values. Every thread calls enter(M) first and leave() last (either may be NULL). Returns 0, or -1 when the
 * shapes break the contract (nothing is written then).
 */
static int layer_tail(const uint16_t* attn, int64_t A, const uint16_t* o_w, uint16_t* h, int64_t M, int64_t H,
                      const float* post_attn_w, const float* pre_ff_w, const float* post_ff_w, float eps,
                      int unit_offset, const uint16_t* gate, const uint16_t* up, int64_t I, const uint16_t* down,
                      int act, uint16_t* scratch, const NextHead* next, int64_t max_rows, ProjectionShare projection,
                      MlpShare mlp, void (*enter)(int64_t), void (*leave)(void)) {
    if (M < 1 || M > max_rows || H < 32 || I < 32 || A < 32 || H % 32 || I % 32 || A % 32 || act < 0 || act > 2 ||
        pre_ff_w == 0)
        return -1;
    if (next != 0 && (next->N % 32 || next->D % 32 || next->D > MAX_HEAD_DIM || next->qk_heads * next->D > next->N))
        return -1;
    uint16_t *o = scratch, *x = o + M * H, *out = x + M * H, *mid = out + M * H;
    atomic_int arrived[6] = {0, 0, 0, 0, 0, 0};
#pragma omp parallel
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        if (enter) enter(M);
        projection(attn, A, M, o_w, H, o, t, nt);
        arrive_and_wait(&arrived[0], nt);
        add_normed_rows(h, o, M, H, post_attn_w, eps, unit_offset, t, nt);
        for (int64_t m = t; m < M; m += nt) norm_row(h + m * H, pre_ff_w, H, eps, unit_offset, 0, x + m * H);
        arrive_and_wait(&arrived[1], nt);
        mlp(x, M, H, gate, up, I, down, act, mid, out, t, nt, &arrived[2]);
        arrive_and_wait(&arrived[3], nt);
        add_normed_rows(h, out, M, H, post_ff_w, eps, unit_offset, t, nt);
        if (next != 0) {
            for (int64_t m = t; m < M; m += nt) norm_row(h + m * H, next->in_norm_w, H, eps, unit_offset, 0, x + m * H);
            arrive_and_wait(&arrived[4], nt);
            projection(x, H, M, next->qkv_w, next->N, next->qkv, t, nt);
            arrive_and_wait(&arrived[5], nt);
            for (int64_t i = t; i < M * next->qk_heads; i += nt)
                norm_rope_head(next->qkv, next->N, i / next->qk_heads, i % next->qk_heads, next->D, next->qk_norm_w,
                               eps, unit_offset, next->cos, next->sin);
        }
        if (leave) leave();
    }
    return 0;
}

#endif
