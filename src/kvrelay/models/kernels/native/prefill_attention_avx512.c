/*
 * Prefill attention with AVX-512 BF16 dot products (VDPBF16PS), for CPUs without AMX tiles: the same contract,
 * layouts and numerics as prefill_attention_amx.c, whose header says them (a row's scores are its bfloat16 products
 * summed in float32, its softmax in float32, its probabilities rounded to bfloat16 and summed against the values in
 * float32; only the order of the float sums differs from the AMX kernel's and torch's).
 *
 * Per KV head and ROWS folded rows, in register blocks of RB rows (RB x 32 float32 accumulators):
 *   scores: for each 32-key block some row of the block sees, each of the 16-key groups' dim-pair words (one
 *   vector of 16 keys) against each row's same dim pair broadcast, summed over D / 2 pairs;
 *   softmax per row over the keys it sees (prefill_attention.h);
 *   out: for each 32 dims, each key pair's words of two 16-dim slices (the V layout) against each row's two
 *   probabilities of that key pair broadcast, summed over the key pairs some row of the block sees; times 1 / sum,
 *   rounded to bfloat16 once.
 * A row block skips the key blocks none of its rows sees; a row's result depends on its own query and keys only
 * (its zero probabilities add exact zeros), so a prompt's KV comes out the same for any split into blocks.
 *
 * Contract: as kvrelay_prefill_attention_amx, without the tile state.
 */
#include "prefill_attention.h"

#define RB 8 /* rows of a register block */

/* Scores of rows row0 .. row0 + RB - 1 (c->rows) against key block b, into s (row r at s + r * ld, the block at
 * column (b - b0) * KEY_BLOCK). */
static void score_block(const PrefillCall* c, int64_t row0, int64_t b, int64_t b0, float* s, int64_t ld) {
    const int64_t pairs = c->D / 2;
    const uint32_t* upper = c->kt + (2 * b) * pairs * 16;
    const uint32_t* lower = upper + pairs * 16;
    const uint32_t* q = (const uint32_t*)(c->rows + row0 * c->D);
    __m512 acc[RB][2];
    for (int r = 0; r < RB; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t i = 0; i < pairs; i++) {
        const __m512bh k0 = (__m512bh)_mm512_loadu_si512(upper + i * 16);
        const __m512bh k1 = (__m512bh)_mm512_loadu_si512(lower + i * 16);
        for (int r = 0; r < RB; r++) {
            const __m512bh w = (__m512bh)_mm512_set1_epi32((int)q[r * pairs + i]);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], w, k0);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], w, k1);
        }
    }
    float* at = s + (b - b0) * KEY_BLOCK;
    for (int r = 0; r < RB; r++) {
        _mm512_storeu_ps(at + r * ld, acc[r][0]);
        _mm512_storeu_ps(at + r * ld + 16, acc[r][1]);
    }
}

/* Outputs of rows row0 .. row0 + n - 1 (n <= RB) of head `head`: their probabilities p (row r at p + r * ld, from
 * key block b0) times the values of key blocks gb0 .. gb1 - 1, times inv, rounded into c->out. */
static void attend_values(const PrefillCall* c, int64_t head, int64_t row0, int64_t n, const uint16_t* p, int64_t ld,
                          int64_t b0, int64_t gb0, int64_t gb1, const float* inv) {
    const int64_t D = c->D, dim_tiles = D / 16;
    for (int64_t d0 = 0; d0 < dim_tiles; d0 += 2) {
        __m512 acc[RB][2];
        for (int r = 0; r < RB; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
        for (int64_t b = gb0; b < gb1; b++) {
            const uint16_t* base = c->vt + (b * dim_tiles + d0) * 512;
            const uint16_t* pb = p + (b - b0) * KEY_BLOCK;
            for (int m = 0; m < KEY_BLOCK / 2; m++) {
                const __m512bh v0 = (__m512bh)_mm512_loadu_si512(base + m * 32);
                const __m512bh v1 = (__m512bh)_mm512_loadu_si512(base + 512 + m * 32);
                for (int r = 0; r < RB; r++) {
                    uint32_t word;
                    memcpy(&word, pb + r * ld + 2 * m, 4);
                    const __m512bh w = (__m512bh)_mm512_set1_epi32((int)word);
                    acc[r][0] = _mm512_dpbf16_ps(acc[r][0], w, v0);
                    acc[r][1] = _mm512_dpbf16_ps(acc[r][1], w, v1);
                }
            }
        }
        for (int64_t r = 0; r < n; r++) {
            const int64_t row = row0 + r, t = row / c->G, j = row % c->G;
            uint16_t* dst = c->out + (t * c->H + head * c->G + j) * D + 16 * d0;
            const __m512 scale_row = _mm512_set1_ps(inv[r]);
            _mm256_storeu_si256((__m256i*)dst, (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(acc[r][0], scale_row)));
            _mm256_storeu_si256((__m256i*)(dst + 16), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(acc[r][1], scale_row)));
        }
    }
}

/* ROWS folded rows from row0 of one KV head (nrows of them real), in blocks of RB: scores, softmax, probabilities
 * times values, into c->out. */
static void attend_tile(const PrefillCall* c, int64_t head, int64_t row0, int64_t nrows, uint8_t* own) {
    float* s = (float*)own;
    uint16_t* p = (uint16_t*)(own + ROWS * c->keys * 4);
    int64_t b0, b1;
    rows_blocks(c, row0, row0 + nrows - 1, &b0, &b1);
    const int64_t ld = (b1 - b0) * KEY_BLOCK, blocks = (nrows + RB - 1) / RB;
    int64_t gb0[ROWS / RB], gb1[ROWS / RB];
    for (int64_t g = 0; g < blocks; g++) {
        const int64_t last = g * RB + RB - 1 < nrows - 1 ? g * RB + RB - 1 : nrows - 1;
        rows_blocks(c, row0 + g * RB, row0 + last, &gb0[g], &gb1[g]);
    }
    for (int64_t b = b0; b < b1; b++)
        for (int64_t g = 0; g < blocks; g++)
            if (gb0[g] <= b && b < gb1[g]) score_block(c, row0 + g * RB, b, b0, s + g * RB * ld, ld);
    float inv[ROWS];
    for (int64_t r = 0; r < blocks * RB; r++) {
        if (r >= nrows) {
            memset(p + r * ld, 0, ld * 2);
            continue;
        }
        int64_t lo, hi;
        row_keys(row0 + r, c->G, c->first_query, c->first_key, c->window, &lo, &hi);
        inv[r] = softmax_row(s + r * ld, p + r * ld, ld, lo - b0 * KEY_BLOCK, hi - b0 * KEY_BLOCK, c->scale);
    }
    for (int64_t g = 0; g < blocks; g++) {
        const int64_t n = nrows - g * RB < RB ? nrows - g * RB : RB;
        attend_values(c, head, row0 + g * RB, n, p + g * RB * ld, ld, b0, gb0[g], gb1[g], inv + g * RB);
    }
}

int kvrelay_prefill_attention_avx512(const uint16_t* q, const uint16_t* k, const uint16_t* v, uint16_t* out,
                                     int64_t Q, int64_t q_stride, int64_t H, int64_t kv_heads, int64_t D, int64_t S,
                                     int64_t head_stride, int64_t key_stride, int64_t first_query, int64_t first_key,
                                     int64_t window, float scale, uint8_t* scratch, int64_t threads) {
    return prefill_attention(q, k, v, out, Q, q_stride, H, kv_heads, D, S, head_stride, key_stride, first_query,
                             first_key, window, scale, scratch, threads, attend_tile, NULL, NULL);
}
