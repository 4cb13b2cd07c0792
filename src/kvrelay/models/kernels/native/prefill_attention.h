/*
 * What the prefill attention kernels (prefill_attention_amx.c, prefill_attention_avx512.c) share: the scratch they
 * need, the packed layouts of one KV head's keys and values, each folded row's key range, and its softmax.
 *
 * Layouts: K of one KV head in tiles of 16 keys x 32 dims, row r holding for each key n its dims 2r, 2r + 1 as one
 * 32-bit word (so the words of one key group's dim pair p sit at group * D / 2 * 16 + p * 16); V in tiles of 32
 * keys x 16 dims, row r holding for each dim j keys 2r, 2r + 1; the rows of one KV head packed [rows padded to
 * ROWS, D], row t * G + j holding query t's head j of the KV head's G.
 */
#ifndef KVRELAY_PREFILL_ATTENTION_H
#define KVRELAY_PREFILL_ATTENTION_H

#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "exp_simd.h"

#define ROWS 32 /* folded rows attended together, sharing every K and V block loaded */
#define KEY_BLOCK 32
#define MAX_D 512

static inline int64_t round_up(int64_t x, int64_t to) { return (x + to - 1) / to * to; }

/* Bytes of the scratch: packed K and V of one KV head, the packed rows, and per thread the float32 scores, the
 * bfloat16 probabilities and the float32 outputs of ROWS rows. */
int64_t kvrelay_prefill_attention_scratch(int64_t Q, int64_t H, int64_t kv_heads, int64_t D, int64_t S,
                                          int64_t threads) {
    const int64_t keys = round_up(S, KEY_BLOCK), rows = round_up(Q * (H / kv_heads), ROWS);
    const int64_t shared = 2 * keys * D * 2 + rows * D * 2;
    const int64_t per_thread = ROWS * keys * 4 + ROWS * keys * 2 + ROWS * D * 4;
    return round_up(shared, 64) + threads * round_up(per_thread, 64);
}

/* Key i's dims 2r, 2r + 1 of chunk c as one 32-bit word (0 past the last key). */
static inline uint32_t key_pair(const uint16_t* k, int64_t key_stride, int64_t S, int64_t i, int64_t c, int r) {
    if (i >= S) return 0;
    uint32_t word;
    memcpy(&word, k + i * key_stride + 32 * c + 2 * r, 4);
    return word;
}

/* Pack one KV head's keys and values (tile layouts above), a share of the tiles per thread. */
static void pack_head(const uint16_t* k, const uint16_t* v, int64_t key_stride, int64_t S, int64_t D, uint32_t* kt,
                      uint16_t* vt, int t, int nt) {
    const int64_t blocks = round_up(S, KEY_BLOCK) / KEY_BLOCK, chunks = D / 32, dim_tiles = D / 16;
    for (int64_t b = t; b < blocks; b += nt) {
        for (int half = 0; half < 2; half++) {
            const int64_t group = 2 * b + half;
            for (int64_t c = 0; c < chunks; c++) {
                uint32_t* tile = kt + (group * chunks + c) * 256;
                for (int r = 0; r < 16; r++)
                    for (int n = 0; n < 16; n++) tile[r * 16 + n] = key_pair(k, key_stride, S, 16 * group + n, c, r);
            }
        }
        for (int64_t d = 0; d < dim_tiles; d++) {
            uint16_t* tile = vt + (b * dim_tiles + d) * 512;
            for (int r = 0; r < 16; r++)
                for (int i = 0; i < 2; i++) {
                    const int64_t key = KEY_BLOCK * b + 2 * r + i;
                    for (int j = 0; j < 16; j++) tile[r * 32 + 2 * j + i] = key < S ? v[key * key_stride + 16 * d + j] : 0;
                }
        }
    }
}

/* The first and last key index row `row` (of the head's folded rows) sees. */
static inline void row_keys(int64_t row, int64_t G, int64_t first_query, int64_t first_key, int64_t window,
                            int64_t* lo, int64_t* hi) {
    const int64_t pos = first_query + row / G;
    const int64_t start = window > 0 && pos - window + 1 > first_key ? pos - window + 1 : first_key;
    *lo = start - first_key;
    *hi = pos - first_key;
}

/* Lanes j .. j + 15 that fall in lo .. hi. */
static inline __mmask16 seen_lanes(int64_t j, int64_t lo, int64_t hi) {
    int64_t a = lo - j, b = hi - j;
    if (b < 0 || a > 15) return 0;
    a = a < 0 ? 0 : a;
    b = b > 15 ? 15 : b;
    return (__mmask16)(((1u << (b + 1)) - 1) & ~((1u << a) - 1));
}

/* Softmax of scale x the row's scores s over keys lo .. hi (of width), rounded into p (zero elsewhere); returns
 * 1 / the sum of the exps. */
static float softmax_row(const float* s, uint16_t* p, int64_t width, int64_t lo, int64_t hi, float scale) {
    __m512 top = _mm512_set1_ps(-INFINITY);
    for (int64_t j = lo / 16 * 16; j <= hi; j += 16)
        top = _mm512_mask_max_ps(top, seen_lanes(j, lo, hi), top, _mm512_loadu_ps(s + j));
    const __m512 sc = _mm512_set1_ps(scale), shift = _mm512_set1_ps(_mm512_reduce_max_ps(top) * scale);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = 0; j < width; j += 16) {
        const __mmask16 seen = seen_lanes(j, lo, hi);
        const __m512 e = seen ? _mm512_maskz_mov_ps(seen, exp_ps(_mm512_fmsub_ps(_mm512_loadu_ps(s + j), sc, shift)))
                              : _mm512_setzero_ps();
        sum = _mm512_add_ps(sum, e);
        _mm256_storeu_si256((__m256i*)(p + j), (__m256i)_mm512_cvtneps_pbh(e));
    }
    return 1.0f / _mm512_reduce_add_ps(sum);
}

/* One call's shapes and the places in its scratch (the kernels' contract: prefill_attention_amx.c). */
typedef struct {
    const uint16_t *q, *k, *v;
    uint16_t* out;
    int64_t Q, q_stride, H, kv_heads, D, S, head_stride, key_stride, first_query, first_key, window;
    float scale;
    int64_t G, nrows, prows, keys, per_thread;
    uint32_t* kt;   /* one KV head's packed keys */
    uint16_t* vt;   /* its packed values */
    uint16_t* rows; /* its folded query rows */
    uint8_t* own;   /* each thread's share: float32 scores, bfloat16 probabilities, float32 outputs of ROWS rows */
} PrefillCall;

/* Fills *c from the arguments; -1 when they break the contract (then nothing may be written). */
static int prefill_call(PrefillCall* c, const uint16_t* q, const uint16_t* k, const uint16_t* v, uint16_t* out,
                        int64_t Q, int64_t q_stride, int64_t H, int64_t kv_heads, int64_t D, int64_t S,
                        int64_t head_stride, int64_t key_stride, int64_t first_query, int64_t first_key,
                        int64_t window, float scale, uint8_t* scratch, int64_t threads) {
    if (Q < 1 || S < 1 || kv_heads < 1 || H % kv_heads || D % 64 || D > MAX_D || window < 0 || threads < 1) return -1;
    if (first_key > first_query || first_key + S - 1 < first_query + Q - 1) return -1;
    *c = (PrefillCall){.q = q, .k = k, .v = v, .out = out, .Q = Q, .q_stride = q_stride, .H = H,
                       .kv_heads = kv_heads, .D = D, .S = S, .head_stride = head_stride, .key_stride = key_stride,
                       .first_query = first_query, .first_key = first_key, .window = window, .scale = scale};
    c->G = H / kv_heads;
    c->keys = round_up(S, KEY_BLOCK);
    c->nrows = Q * c->G;
    c->prows = round_up(c->nrows, ROWS);
    c->per_thread = round_up(ROWS * c->keys * 4 + ROWS * c->keys * 2 + ROWS * D * 4, 64);
    c->kt = (uint32_t*)scratch;
    c->vt = (uint16_t*)(scratch + c->keys * D * 2);
    c->rows = (uint16_t*)(scratch + 2 * c->keys * D * 2);
    c->own = scratch + round_up(2 * c->keys * D * 2 + c->prows * D * 2, 64);
    return 0;
}

/* Thread t's share of packing KV head `head`'s keys, values and folded rows (zero rows past the last); the threads
 * must meet at a barrier before any reads them. */
static void prefill_pack(const PrefillCall* c, int64_t head, int t, int nt) {
    pack_head(c->k + head * c->head_stride, c->v + head * c->head_stride, c->key_stride, c->S, c->D, c->kt, c->vt, t,
              nt);
    for (int64_t row = t; row < c->prows; row += nt) {
        uint16_t* dst = c->rows + row * c->D;
        if (row >= c->nrows) {
            memset(dst, 0, c->D * 2);
            continue;
        }
        memcpy(dst, c->q + (row / c->G) * c->q_stride + (head * c->G + row % c->G) * c->D, c->D * 2);
    }
}

/* The first and last key block (of KEY_BLOCK keys) that folded rows row0 .. last see. */
static inline void rows_blocks(const PrefillCall* c, int64_t row0, int64_t last, int64_t* b0, int64_t* b1) {
    int64_t lo, hi, lo_last, hi_last;
    row_keys(row0, c->G, c->first_query, c->first_key, c->window, &lo, &hi);
    row_keys(last, c->G, c->first_query, c->first_key, c->window, &lo_last, &hi_last);
    *b0 = lo / KEY_BLOCK;
    *b1 = hi_last / KEY_BLOCK + 1;
}

/* What a kernel does to ROWS folded rows from row0 of KV head `head` (n of them real), with the calling thread's
 * scratch `own` (c->per_thread bytes). */
typedef void (*AttendTile)(const PrefillCall* c, int64_t head, int64_t row0, int64_t n, uint8_t* own);

/* Runs `attend` over every KV head's tiles on `threads` OpenMP threads, each head packed first; every thread calls
 * `enter` before its first tile and `leave` after its last (either may be NULL). */
static void prefill_run(const PrefillCall* c, AttendTile attend, void (*enter)(void), void (*leave)(void),
                        int64_t threads) {
    const int64_t tiles = c->prows / ROWS;
#pragma omp parallel num_threads(threads)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        uint8_t* own = c->own + t * c->per_thread;
        if (enter) enter();
        for (int64_t head = 0; head < c->kv_heads; head++) {
            prefill_pack(c, head, t, nt);
#pragma omp barrier
#pragma omp for schedule(dynamic, 1)
            for (int64_t tile = 0; tile < tiles; tile++) {
                const int64_t row0 = tile * ROWS, n = c->nrows - row0 < ROWS ? c->nrows - row0 : ROWS;
                attend(c, head, row0, n, own);
            }
        }
        if (leave) leave();
    }
}

/* A kernel's entry: checks the arguments (prefill_call; -1 when they break the contract, nothing written) and
 * runs `attend` over every tile (prefill_run); 0 when done. */
static int prefill_attention(const uint16_t* q, const uint16_t* k, const uint16_t* v, uint16_t* out, int64_t Q,
                             int64_t q_stride, int64_t H, int64_t kv_heads, int64_t D, int64_t S, int64_t head_stride,
                             int64_t key_stride, int64_t first_query, int64_t first_key, int64_t window, float scale,
                             uint8_t* scratch, int64_t threads, AttendTile attend, void (*enter)(void),
                             void (*leave)(void)) {
    PrefillCall c;
    if (prefill_call(&c, q, k, v, out, Q, q_stride, H, kv_heads, D, S, head_stride, key_stride, first_query, first_key,
                     window, scale, scratch, threads))
        return -1;
    prefill_run(&c, attend, enter, leave, threads);
    return 0;
}

#endif
