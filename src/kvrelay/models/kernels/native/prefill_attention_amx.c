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
 * Layouts (the kernel makes them, in scratch): prefill_attention.h; K is TDPBF16PS's second operand for rows K^T.
 *
 * Contract: q [Q, H, D] with query t's heads at q + t * q_stride, contiguous; k, v: key i of KV head h at
 * k + h * head_stride + i * key_stride (unit stride along D), the same strides for v; H % kv_heads == 0;
 * D % 64 == 0, D <= 512; 1 <= Q; 1 <= S; query t sits at position first_query + t, key i at first_key + i;
 * query t sees key i iff first_key + i <= first_query + t and (window == 0 or first_key + i > first_query + t -
 * window); every query sees at least one key;
 * scratch holds kvrelay_prefill_attention_scratch(...) bytes, 64-byte aligned. The caller has been granted the
 * AMX tile state (amx_tiles.h). Returns 0, or -1 when the shapes break the contract (nothing written then).
 */
#include "amx_tiles.h"
#include "prefill_attention.h"

/* Eight tiles of 16 rows x 64 bytes (their use: attend_tile). */
static void configure(void) {
    TileConfig config = {0};
    config.palette = 1;
    for (int t = 0; t < 8; t++) config.rows[t] = 16, config.colsb[t] = 64;
    load_tile_config(&config);
}

static void release(void) { _tile_release(); }

/* ROWS folded rows from row0 of one KV head (nrows of them real): scores, softmax, probabilities times values,
 * into out. Tiles 0, 1: rows 0..15 and 16..31 (their queries, then their probabilities); 2, 3: K or V; 4..7: the
 * sums of rows 0..15 (4, 5) and 16..31 (6, 7) against two key groups, or two 16-dim slices. */
static void attend_tile(const PrefillCall* c, int64_t head, int64_t row0, int64_t nrows, uint8_t* own) {
    float* s = (float*)own;
    uint16_t* p = (uint16_t*)(own + ROWS * c->keys * 4);
    float* o = (float*)(own + ROWS * c->keys * 6);
    const int64_t G = c->G, D = c->D, first_query = c->first_query, first_key = c->first_key, window = c->window;
    const uint32_t* kt = c->kt;
    const uint16_t* vt = c->vt;
    int64_t b0, b1;
    rows_blocks(c, row0, row0 + nrows - 1, &b0, &b1);
    const int64_t ld = (b1 - b0) * KEY_BLOCK;
    const int64_t chunks = D / 32, dim_tiles = D / 16;
    const uint16_t* upper = c->rows + row0 * D;
    for (int64_t b = b0; b < b1; b++) {
        _tile_zero(4);
        _tile_zero(5);
        _tile_zero(6);
        _tile_zero(7);
        for (int64_t ch = 0; ch < chunks; ch++) {
            _tile_loadd(2, kt + ((2 * b) * chunks + ch) * 256, 64);
            _tile_loadd(3, kt + ((2 * b + 1) * chunks + ch) * 256, 64);
            _tile_loadd(0, upper + 32 * ch, D * 2);
            _tile_dpbf16ps(4, 0, 2);
            _tile_dpbf16ps(5, 0, 3);
            _tile_loadd(1, upper + 16 * D + 32 * ch, D * 2);
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
        inv[r] = softmax_row(s + r * ld, p + r * ld, ld, lo - b0 * KEY_BLOCK, hi - b0 * KEY_BLOCK, c->scale);
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
        uint16_t* dst = c->out + (t * c->H + head * G + j) * D;
        const __m512 scale_row = _mm512_set1_ps(inv[r]);
        for (int64_t d = 0; d < D; d += 16)
            _mm256_storeu_si256((__m256i*)(dst + d),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(o + r * D + d), scale_row)));
    }
}

int kvrelay_prefill_attention_amx(const uint16_t* q, const uint16_t* k, const uint16_t* v, uint16_t* out, int64_t Q,
                                  int64_t q_stride, int64_t H, int64_t kv_heads, int64_t D, int64_t S, int64_t head_stride,
                                  int64_t key_stride, int64_t first_query, int64_t first_key, int64_t window,
                                  float scale, uint8_t* scratch, int64_t threads) {
    return prefill_attention(q, k, v, out, Q, q_stride, H, kv_heads, D, S, head_stride, key_stride, first_query,
                             first_key, window, scale, scratch, threads, attend_tile, configure, release);
}
