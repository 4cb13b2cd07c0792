/*
 * Batched one-query decode attention over strided key/value rows, bfloat16, AVX-512 BF16.
 *
 * For each unit (a sequence and one of its KV heads): the G query rows sharing that KV head
 * attend to the first n rows of its keys and values, n given per sequence. The numerics
 * follow kvrelay.models.kernels.attention.decode_attention in bfloat16: scores are float32 dot products rounded to bfloat16, then scaled and softmaxed in
 * float32; the probabilities are rounded to bfloat16 and the weighted sum of values is
 * accumulated in float32 and rounded to bfloat16 (round to nearest even throughout). Only
 * the summation order differs from oneDNN's, so an output may differ in its last bit.
 *
 * Contract: G % 4 == 0, G <= MAX_G, D % 128 == 0, 1 <= n <= keys < MAX_KEYS, q and out contiguous
 * [batch, kv_heads, G, D]; k and v strided alike, with unit strides and row strides given.
 * Units run in parallel on the calling thread's OpenMP team (torch's, when torch's libgomp
 * is loaded first); a single unit runs on the calling thread alone.
 */
#include <math.h>

#include "bf16_simd.h"
#include "exp_simd.h"

#define MAX_KEYS 4096
#define MAX_G 16
#define PREFETCH_ROWS 8

/* p[g][j] = bf16(q[g] . k[j]) for four query rows starting at g0; key rows are `stride` apart. */
static void scores4(const uint16_t* q, const uint16_t* k, int n, int D, int64_t stride, int g0, float (*p)[MAX_KEYS]) {
    const uint16_t* q0 = q + (int64_t)g0 * D;
    for (int j = 0; j < n; j++) {
        const uint16_t* row = k + j * stride;
        for (int c = 0; c < D; c += 32) _mm_prefetch((const char*)(row + PREFETCH_ROWS * stride + c), _MM_HINT_T1);
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (int c = 0; c < D; c += 32) {
            __m512bh key = (__m512bh)_mm512_loadu_si512(row + c);
            a0 = _mm512_dpbf16_ps(a0, key, (__m512bh)_mm512_loadu_si512(q0 + c));
            a1 = _mm512_dpbf16_ps(a1, key, (__m512bh)_mm512_loadu_si512(q0 + D + c));
            a2 = _mm512_dpbf16_ps(a2, key, (__m512bh)_mm512_loadu_si512(q0 + 2 * D + c));
            a3 = _mm512_dpbf16_ps(a3, key, (__m512bh)_mm512_loadu_si512(q0 + 3 * D + c));
        }
        float s[4];
        _mm_storeu_ps(s, sum4(a0, a1, a2, a3));
        for (int i = 0; i < 4; i++) p[g0 + i][j] = s[i];
    }
}

/* Row p[0..n) of raw scores becomes bf16(softmax(bf16(p) * scale)), zero-padded to even length. */
static void softmax_row(float* p, int n, float scale) {
    const __m512 vscale = _mm512_set1_ps(scale);
    __m512 vmax = _mm512_set1_ps(-INFINITY);
    int j = 0;
    for (; j + 16 <= n; j += 16) {
        __m512 x = _mm512_mul_ps(round_bf16(_mm512_loadu_ps(p + j)), vscale);
        _mm512_storeu_ps(p + j, x);
        vmax = _mm512_max_ps(vmax, x);
    }
    const __mmask16 tail = (__mmask16)((1u << (n - j)) - 1);
    if (j < n) {
        __m512 x = _mm512_mul_ps(round_bf16(_mm512_maskz_loadu_ps(tail, p + j)), vscale);
        _mm512_mask_storeu_ps(p + j, tail, x);
        vmax = _mm512_mask_max_ps(vmax, tail, vmax, x);
    }
    const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(vmax));
    __m512 total = _mm512_setzero_ps();
    for (j = 0; j + 16 <= n; j += 16) {
        __m512 e = exp_ps(_mm512_sub_ps(_mm512_loadu_ps(p + j), top));
        _mm512_storeu_ps(p + j, e);
        total = _mm512_add_ps(total, e);
    }
    if (j < n) {
        __m512 e = exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, p + j), top));
        _mm512_mask_storeu_ps(p + j, tail, e);
        total = _mm512_add_ps(total, _mm512_maskz_mov_ps(tail, e));
    }
    const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(total));
    for (j = 0; j + 16 <= n; j += 16) _mm512_storeu_ps(p + j, round_bf16(_mm512_mul_ps(_mm512_loadu_ps(p + j), inv)));
    if (j < n) _mm512_mask_storeu_ps(p + j, tail, round_bf16(_mm512_mul_ps(_mm512_maskz_loadu_ps(tail, p + j), inv)));
    p[n] = 0.0f;
}

/* out rows g0, g0 + 1, dims d0 .. d0 + 127 = sum_j p[g][j] v[j], keys taken in pairs by dpbf16. */
static void weighted_values2(const uint16_t* v, int n, int D, int64_t stride, int g0, int d0, float (*p)[MAX_KEYS],
                             uint16_t* out) {
    static const uint16_t zeros[128] __attribute__((aligned(64)));
    /* dpbf16 of unpacklo/unpackhi(x, y) leaves dims {0-3, 8-11, 16-19, 24-27} and {4-7, ...}: reorder. */
    const __m512i first = _mm512_set_epi32(23, 22, 21, 20, 7, 6, 5, 4, 19, 18, 17, 16, 3, 2, 1, 0);
    const __m512i second = _mm512_set_epi32(31, 30, 29, 28, 15, 14, 13, 12, 27, 26, 25, 24, 11, 10, 9, 8);
    __m512 acc[2][4][2];
    for (int g = 0; g < 2; g++)
        for (int c = 0; c < 4; c++) acc[g][c][0] = acc[g][c][1] = _mm512_setzero_ps();
    for (int j = 0; j < n; j += 2) {
        const uint16_t* x_row = v + j * stride + d0;
        const uint16_t* y_row = j + 1 < n ? x_row + stride : zeros;
        if (g0 == 0 && d0 == 0)
            for (int c = 0; c < D; c += 32) {
                _mm_prefetch((const char*)(x_row + PREFETCH_ROWS * stride + c), _MM_HINT_T1);
                _mm_prefetch((const char*)(x_row + (PREFETCH_ROWS + 1) * stride + c), _MM_HINT_T1);
            }
        uint16_t w[2][2] = {{to_bf16(p[g0][j]), to_bf16(p[g0][j + 1])}, {to_bf16(p[g0 + 1][j]), to_bf16(p[g0 + 1][j + 1])}};
        uint32_t w0, w1;
        memcpy(&w0, w[0], 4);
        memcpy(&w1, w[1], 4);
        const __m512bh b0 = (__m512bh)_mm512_set1_epi32((int)w0), b1 = (__m512bh)_mm512_set1_epi32((int)w1);
        for (int c = 0; c < 4; c++) {
            __m512i x = _mm512_loadu_si512(x_row + c * 32), y = _mm512_loadu_si512(y_row + c * 32);
            __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(x, y), hi = (__m512bh)_mm512_unpackhi_epi16(x, y);
            acc[0][c][0] = _mm512_dpbf16_ps(acc[0][c][0], lo, b0);
            acc[0][c][1] = _mm512_dpbf16_ps(acc[0][c][1], hi, b0);
            acc[1][c][0] = _mm512_dpbf16_ps(acc[1][c][0], lo, b1);
            acc[1][c][1] = _mm512_dpbf16_ps(acc[1][c][1], hi, b1);
        }
    }
    for (int g = 0; g < 2; g++)
        for (int c = 0; c < 4; c++) {
            uint16_t* o = out + (int64_t)(g0 + g) * D + d0 + c * 32;
            __m512 lo = _mm512_permutex2var_ps(acc[g][c][0], first, acc[g][c][1]);
            __m512 hi = _mm512_permutex2var_ps(acc[g][c][0], second, acc[g][c][1]);
            _mm256_storeu_si256((__m256i*)o, (__m256i)_mm512_cvtneps_pbh(lo));
            _mm256_storeu_si256((__m256i*)(o + 16), (__m256i)_mm512_cvtneps_pbh(hi));
        }
}

static void attend_unit(const uint16_t* q, const uint16_t* k, const uint16_t* v, int n, int G, int D, int64_t stride,
                        float scale, uint16_t* out) {
    float p[G][MAX_KEYS] __attribute__((aligned(64))); /* G <= MAX_G rows: at most 256 KiB of stack */
    for (int g0 = 0; g0 < G; g0 += 4) scores4(q, k, n, D, stride, g0, p);
    for (int g = 0; g < G; g++) softmax_row(p[g], n, scale);
    for (int g0 = 0; g0 < G; g0 += 2)
        for (int d0 = 0; d0 < D; d0 += 128) weighted_values2(v, n, D, stride, g0, d0, p, out);
}

/*
 * Unit (b, h) of `batch` x `kv_heads` reads keys and values at b * batch_stride + h * head_stride,
 * rows row_stride apart (k and v strided alike), and its first n[b] rows (1 <= n[b] <= keys).
 * Returns 0, or -1 when the arguments break the contract (nothing is written then).
 */
int kvrelay_decode_attention(const uint16_t* q, const uint16_t* k, const uint16_t* v, const int64_t* n, uint16_t* out,
                             int64_t batch, int64_t kv_heads, int G, int D, int64_t keys, int64_t batch_stride,
                             int64_t head_stride, int64_t row_stride, float scale) {
    if (G % 4 != 0 || G > MAX_G || D % 128 != 0 || D <= 0 || keys > MAX_KEYS - 1) return -1;
    for (int64_t b = 0; b < batch; b++)
        if (n[b] < 1 || n[b] > keys) return -1;
    const int64_t units = batch * kv_heads;
    /* One unit runs on this thread: a team would wake a partner with nothing to do. */
#pragma omp parallel for schedule(static) if (units > 1)
    for (int64_t u = 0; u < units; u++) {
        const int64_t b = u / kv_heads, h = u % kv_heads, at = b * batch_stride + h * head_stride;
        attend_unit(q + u * G * D, k + at, v + at, (int)n[b], G, D, row_stride, scale, out + u * G * D);
    }
    return 0;
}
