/*
 * Prefill attention on AMX tiles: one prefilling sequence's Q new queries over its gathered keys, causal with an
 * optional sliding window, bfloat16 in and out, in one OpenMP region.
 *
 * Per KV head, the query heads sharing it are folded into rows (row t * G + j: query t, head j of the head's G),
 * and each 32 rows (two A tiles sharing every K and V tile loaded) attend together over the 32-key blocks any of
 * them sees:
 *   scores = rows K^T (TDPBF16PS, float32 sums), times scale, in float32;
 *   per row, over the keys that row sees (its causal and window limits), exp(score - max) and its sum, in float32
 *   (exp_simd.h); the probabilities rounded to bfloat16 (as torch's fused CPU kernel rounds them for its second
 *   product), zero where the row does not see the key;
 *   out = probabilities V (TDPBF16PS, float32 sums) / sum, rounded to bfloat16 once.
 * A row's result depends on its own query and keys only (its zero probabilities add exact zeros), not on the rows
 * it shares a tile with, and keys are blocked from the window's first gathered key, so a prompt's KV comes out the
 * same for any split of its rows into tiles.
 *
 * Layouts (the kernel makes them, in scratch): K of one KV head in tiles of 16 keys x 32 dims, row r holding for
 * each key n its dims 2r, 2r + 1 (TDPBF16PS's second operand for rows K^T); V in tiles of 32 keys x 16 dims, row r
 * holding for each dim j keys 2r, 2r + 1; the rows of one KV head packed [rows padded to 32, D].
 *
 * Contract: q [Q, H, D] with query t's heads at q + t * q_stride, contiguous; k, v: key i of KV head h at
 * k + h * head_stride + i * key_stride (unit stride along D), the same strides for v; H % kv_heads == 0;
 * D % 64 == 0, D <= 512; 1 <= Q; 1 <= S; query t sits at position first_query + t, key i at first_key + i;
 * query t sees key i iff first_key + i <= first_query + t and (window == 0 or first_key + i > first_query + t -
 * window); every query sees at least one key;
 * scratch holds kvrelay_prefill_attention_scratch(...) bytes, 64-byte aligned. The caller has been granted the
 * AMX tile state (amx_tiles.h). Returns 0, or -1 when the shapes break the contract (nothing written then).
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "amx_tiles.h"
#include "exp_simd.h"

#define ROWS 32 /* rows attended together: two A tiles share every K and V tile loaded */
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

/* Eight tiles of 16 rows x 64 bytes (their use: attend_tile). */
static void configure(void) {
    TileConfig config = {0};
    config.palette = 1;
    for (int t = 0; t < 8; t++) config.rows[t] = 16, config.colsb[t] = 64;
    _tile_loadconfig(&config);
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

/* ROWS folded rows from row0 of one KV head (nrows of them real): scores, softmax, probabilities times values,
 * into out. Tiles 0, 1: rows 0..15 and 16..31 (their queries, then their probabilities); 2, 3: K or V; 4..7: the
 * sums of rows 0..15 (4, 5) and 16..31 (6, 7) against two key groups, or two 16-dim slices. */
static void attend_tile(const uint16_t* rows, int64_t row0, int64_t nrows, int64_t G, int64_t D, const uint32_t* kt,
                        const uint16_t* vt, int64_t first_query, int64_t first_key, int64_t window, float scale,
                        float* s, uint16_t* p, float* o, uint16_t* out, int64_t H, int64_t head) {
    int64_t lo_first, hi_first, lo_last, hi_last;
    row_keys(row0, G, first_query, first_key, window, &lo_first, &hi_first);
    row_keys(row0 + nrows - 1, G, first_query, first_key, window, &lo_last, &hi_last);
    const int64_t b0 = lo_first / KEY_BLOCK, b1 = hi_last / KEY_BLOCK + 1, ld = (b1 - b0) * KEY_BLOCK;
    const int64_t chunks = D / 32, dim_tiles = D / 16;
    const uint16_t* upper = rows + row0 * D;
    for (int64_t b = b0; b < b1; b++) {
        _tile_zero(4);
        _tile_zero(5);
        _tile_zero(6);
        _tile_zero(7);
        for (int64_t c = 0; c < chunks; c++) {
            _tile_loadd(2, kt + ((2 * b) * chunks + c) * 256, 64);
            _tile_loadd(3, kt + ((2 * b + 1) * chunks + c) * 256, 64);
            _tile_loadd(0, upper + 32 * c, D * 2);
            _tile_dpbf16ps(4, 0, 2);
            _tile_dpbf16ps(5, 0, 3);
            _tile_loadd(1, upper + 16 * D + 32 * c, D * 2);
            _tile_dpbf16ps(6, 1, 2);
            _tile_dpbf16ps(7, 1, 3);
        }
        float* at = s + (b - b0) * KEY_BLOCK;
        _tile_stored(4, at, ld * 4);
        _tile_stored(5, at + 16, ld * 4);
        _tile_stored(6, at + 16 * ld, ld * 4);
        _tile_stored(7, at + 16 * ld + 16, ld * 4);
    }
    float inv[ROWS];
    for (int64_t r = 0; r < ROWS; r++) {
        if (r >= nrows) {
            memset(p + r * ld, 0, ld * 2);
            continue;
        }
        int64_t lo, hi;
        row_keys(row0 + r, G, first_query, first_key, window, &lo, &hi);
        inv[r] = softmax_row(s + r * ld, p + r * ld, ld, lo - b0 * KEY_BLOCK, hi - b0 * KEY_BLOCK, scale);
    }
    for (int64_t d0 = 0; d0 < dim_tiles; d0 += 2) {
        _tile_zero(4);
        _tile_zero(5);
        _tile_zero(6);
        _tile_zero(7);
        for (int64_t b = b0; b < b1; b++) {
            const uint16_t* base = vt + (b * dim_tiles + d0) * 512;
            _tile_loadd(0, p + (b - b0) * KEY_BLOCK, ld * 2);
            _tile_loadd(1, p + 16 * ld + (b - b0) * KEY_BLOCK, ld * 2);
            _tile_loadd(2, base, 64);
            _tile_dpbf16ps(4, 0, 2);
            _tile_dpbf16ps(6, 1, 2);
            _tile_loadd(3, base + 512, 64);
            _tile_dpbf16ps(5, 0, 3);
            _tile_dpbf16ps(7, 1, 3);
        }
        _tile_stored(4, o + 16 * d0, D * 4);
        _tile_stored(5, o + 16 * d0 + 16, D * 4);
        _tile_stored(6, o + 16 * D + 16 * d0, D * 4);
        _tile_stored(7, o + 16 * D + 16 * d0 + 16, D * 4);
    }
    for (int64_t r = 0; r < nrows; r++) {
        const int64_t row = row0 + r, t = row / G, j = row % G;
        uint16_t* dst = out + (t * H + head * G + j) * D;
        const __m512 scale_row = _mm512_set1_ps(inv[r]);
        for (int64_t c = 0; c < D; c += 16)
            _mm256_storeu_si256((__m256i*)(dst + c),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(o + r * D + c), scale_row)));
    }
}

int kvrelay_prefill_attention_amx(const uint16_t* q, const uint16_t* k, const uint16_t* v, uint16_t* out, int64_t Q,
                                  int64_t q_stride, int64_t H, int64_t kv_heads, int64_t D, int64_t S, int64_t head_stride,
                                  int64_t key_stride, int64_t first_query, int64_t first_key, int64_t window,
                                  float scale, uint8_t* scratch, int64_t threads) {
    if (Q < 1 || S < 1 || kv_heads < 1 || H % kv_heads || D % 64 || D > MAX_D || window < 0 || threads < 1) return -1;
    const int64_t G = H / kv_heads, keys = round_up(S, KEY_BLOCK), nrows = Q * G, prows = round_up(nrows, ROWS);
    if (first_key > first_query || first_key + S - 1 < first_query + Q - 1) return -1;
    uint32_t* kt = (uint32_t*)scratch;
    uint16_t* vt = (uint16_t*)(scratch + keys * D * 2);
    uint16_t* rows = (uint16_t*)(scratch + 2 * keys * D * 2);
    uint8_t* own = scratch + round_up(2 * keys * D * 2 + prows * D * 2, 64);
    const int64_t per_thread = round_up(ROWS * keys * 4 + ROWS * keys * 2 + ROWS * D * 4, 64);
    const int64_t tiles = prows / ROWS;
#pragma omp parallel num_threads(threads)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        float* s = (float*)(own + t * per_thread);
        uint16_t* p = (uint16_t*)(own + t * per_thread + ROWS * keys * 4);
        float* o = (float*)(own + t * per_thread + ROWS * keys * 6);
        configure();
        for (int64_t head = 0; head < kv_heads; head++) {
            pack_head(k + head * head_stride, v + head * head_stride, key_stride, S, D, kt, vt, t, nt);
            for (int64_t row = t; row < prows; row += nt) {
                uint16_t* dst = rows + row * D;
                if (row >= nrows) {
                    memset(dst, 0, D * 2);
                    continue;
                }
                memcpy(dst, q + (row / G) * q_stride + (head * G + row % G) * D, D * 2);
            }
#pragma omp barrier
#pragma omp for schedule(dynamic, 1)
            for (int64_t tile = 0; tile < tiles; tile++) {
                const int64_t row0 = tile * ROWS, n = nrows - row0 < ROWS ? nrows - row0 : ROWS;
                attend_tile(rows, row0, n, G, D, kt, vt, first_query, first_key, window, scale, s, p, o, out, H, head);
            }
        }
        _tile_release();
    }
    return 0;
}
