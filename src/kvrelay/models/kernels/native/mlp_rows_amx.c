/*
 * mlp_rows.c on AMX: the gated MLP of up to 32 bfloat16 rows in one parallel region, the dot products in
 * bfloat16 tiles (TDPBF16PS), so the rows cost what reading the weights costs, not 40 us each.
 *
 * Weights are read in tile order (kvrelay_bf16_pack_tiles makes that copy of W [N, K]: for each 16 rows and
 * 32 columns, a 16 x 64-byte tile whose row r holds, for each of the 16 weight rows j, its two values
 * 2r, 2r + 1 of the 32, as TDPBF16PS takes its second operand; the tiles of one 16-row block follow each other
 * along K). Phase 1 splits gate's and up's 16-row blocks over the team; the input rows are one or two A tiles
 * of up to 16 rows each, read from x in place. A spin barrier, then phase 2 splits down's blocks, its A tiles
 * read from the intermediate.
 *
 * Numerics as mlp_rows.c states them, except the sums: each is the tile unit's float32 sum (denormal inputs
 * as zero), which does not depend on the other rows either.
 *
 * Contract: 1 <= M <= 32, H % 32 == 0, I % 32 == 0, x [M, H], gate_tiles and up_tiles from [I, H] weights,
 * down_tiles from [H, I], mid [M, I] (scratch), y [M, H], all contiguous bfloat16; act as in mlp_rows.c. The
 * caller has been granted the AMX tile state (amx_tiles.h). Returns 0, or -1 when the shapes break the
 * contract (nothing is written then).
 */
#include "amx_tiles.h"
#include "layer_tail.h"
#include "mlp_activations.h"

#define MAX_ROWS 32

/* W [N, K] (row-major bfloat16) into tiles (N * K values, the order above). Returns 0, or -1 on bad shapes. */
int kvrelay_bf16_pack_tiles(const uint16_t* w, int64_t N, int64_t K, uint16_t* tiles) {
    if (N < 16 || N % 16 || K < 32 || K % 32) return -1;
    const int64_t chunks = K / 32;
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < N / 16; b++)
        for (int64_t c = 0; c < chunks; c++) {
            uint16_t* tile = tiles + (b * chunks + c) * 512;
            for (int r = 0; r < 16; r++)
                for (int j = 0; j < 16; j++)
                    for (int i = 0; i < 2; i++) tile[r * 32 + 2 * j + i] = w[(b * 16 + j) * K + 32 * c + 2 * r + i];
        }
    return 0;
}

/* Tiles 0, 1: the A tiles (input rows 0..15, 16..31); 2, 3: B tiles; 4..7: C tiles (4, 5 rows 0..15 and
 * 6, 7 rows 16..31; phase 1 pairs gate with 4, 6 and up with 5, 7). */
static void configure(int64_t M) {
    TileConfig config = {0};
    const uint8_t first = (uint8_t)(M < 16 ? M : 16), second = (uint8_t)(M > 16 ? M - 16 : 0);
    config.palette = 1;
    config.rows[0] = first, config.colsb[0] = 64;
    config.rows[2] = 16, config.colsb[2] = 64;
    config.rows[3] = 16, config.colsb[3] = 64;
    config.rows[4] = first, config.colsb[4] = 64;
    config.rows[5] = first, config.colsb[5] = 64;
    if (second) {
        config.rows[1] = second, config.colsb[1] = 64;
        config.rows[6] = second, config.colsb[6] = 64;
        config.rows[7] = second, config.colsb[7] = 64;
    }
    load_tile_config(&config);
}

/* The sums of input rows a (stride lda values) against the 16 weight rows of block b of tiles (chunks of 32
 * along K): into c (M x 16 float32). */
static inline void block_sums(const uint16_t* a, int64_t lda, int64_t M, const uint16_t* tiles, int64_t b,
                              int64_t chunks, float c[MAX_ROWS][16]) {
    const uint16_t* base = tiles + b * chunks * 512;
    _tile_zero(4);
    if (M > 16) _tile_zero(6);
    for (int64_t k = 0; k < chunks; k++) {
        _tile_loadd(0, a + 32 * k, lda * 2);
        _tile_loadd(2, base + k * 512, 64);
        _tile_dpbf16ps(4, 0, 2);
        if (M > 16) {
            _tile_loadd(1, a + 16 * lda + 32 * k, lda * 2);
            _tile_dpbf16ps(6, 1, 2);
        }
    }
    _tile_stored(4, c[0], 64);
    if (M > 16) _tile_stored(6, c[16], 64);
}

/* gate's and up's sums of block b together (one pass over the A tiles). */
static inline void pair_sums(const uint16_t* x, int64_t H, int64_t M, const uint16_t* gate, const uint16_t* up,
                             int64_t b, int64_t chunks, float g[MAX_ROWS][16], float u[MAX_ROWS][16]) {
    const uint16_t* gb = gate + b * chunks * 512;
    const uint16_t* ub = up + b * chunks * 512;
    _tile_zero(4);
    _tile_zero(5);
    if (M > 16) {
        _tile_zero(6);
        _tile_zero(7);
    }
    for (int64_t k = 0; k < chunks; k++) {
        _tile_loadd(0, x + 32 * k, H * 2);
        _tile_loadd(2, gb + k * 512, 64);
        _tile_loadd(3, ub + k * 512, 64);
        _tile_dpbf16ps(4, 0, 2);
        _tile_dpbf16ps(5, 0, 3);
        if (M > 16) {
            _tile_loadd(1, x + 16 * H + 32 * k, H * 2);
            _tile_dpbf16ps(6, 1, 2);
            _tile_dpbf16ps(7, 1, 3);
        }
    }
    _tile_stored(4, g[0], 64);
    _tile_stored(5, u[0], 64);
    if (M > 16) {
        _tile_stored(6, g[16], 64);
        _tile_stored(7, u[16], 64);
    }
}

/* Thread t's share of y = a W^T (a [M, K] with row stride K, W's tiles [N, K]): its 16-column blocks of y
 * [M, N], each rounded once to bfloat16. */
static void projection_share(const uint16_t* a, int64_t K, int64_t M, const uint16_t* tiles, int64_t N, uint16_t* y,
                             int t, int nt) {
    float c[MAX_ROWS][16];
    const int64_t blocks = N / 16;
    for (int64_t b = blocks * t / nt; b < blocks * (t + 1) / nt; b++) {
        block_sums(a, K, M, tiles, b, K / 32, c);
        for (int64_t m = 0; m < M; m++)
            _mm256_storeu_si256((__m256i*)(y + m * N + 16 * b), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(c[m])));
    }
}

/* Thread t's share of the MLP of x into y (the intermediate in mid); one arrival at *arrived between phases. */
static void mlp_share(const uint16_t* x, int64_t M, int64_t H, const uint16_t* gate_tiles, const uint16_t* up_tiles,
                      int64_t I, const uint16_t* down_tiles, int act, uint16_t* mid, uint16_t* y, int t, int nt,
                      atomic_int* arrived) {
    float g[MAX_ROWS][16], u[MAX_ROWS][16];
    const int64_t blocks1 = I / 16;
    for (int64_t b = blocks1 * t / nt; b < blocks1 * (t + 1) / nt; b++) {
        pair_sums(x, H, M, gate_tiles, up_tiles, b, H / 32, g, u);
        for (int64_t m = 0; m < M; m++) {
            const __m512 a = round_bf16(activate(_mm512_loadu_ps(g[m]), act));
            const __m512 p = _mm512_mul_ps(a, _mm512_loadu_ps(u[m]));
            _mm256_storeu_si256((__m256i*)(mid + m * I + 16 * b), (__m256i)_mm512_cvtneps_pbh(p));
        }
    }
    arrive_and_wait(arrived, nt);
    projection_share(mid, I, M, down_tiles, H, y, t, nt);
}

int kvrelay_mlp_rows_amx(const uint16_t* x, int64_t M, int64_t H, const uint16_t* gate_tiles,
                         const uint16_t* up_tiles, int64_t I, const uint16_t* down_tiles, int act, uint16_t* mid,
                         uint16_t* y) {
    if (M < 1 || M > MAX_ROWS || H < 32 || I < 32 || H % 32 || I % 32 || act < 0 || act > 2) return -1;
    atomic_int arrived = 0;
#pragma omp parallel
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        configure(M);
        mlp_share(x, M, H, gate_tiles, up_tiles, I, down_tiles, act, mid, y, t, nt, &arrived);
        _tile_release();
    }
    return 0;
}

static void release(void) { _tile_release(); }

/* kvrelay_layer_tail_amx: layer_tail.h's layer_tail on AMX tiles for M <= 32 rows; o_tiles, gate_tiles,
 * up_tiles, down_tiles and next's qkv weight from kvrelay_bf16_pack_tiles. The caller has been granted the AMX
 * tile state. */
int kvrelay_layer_tail_amx(const uint16_t* attn, int64_t A, const uint16_t* o_tiles, uint16_t* h, int64_t M,
                           int64_t H, const float* post_attn_w, const float* pre_ff_w, const float* post_ff_w,
                           float eps, int unit_offset, const uint16_t* gate_tiles, const uint16_t* up_tiles,
                           int64_t I, const uint16_t* down_tiles, int act, uint16_t* scratch, const NextHead* next) {
    return layer_tail(attn, A, o_tiles, h, M, H, post_attn_w, pre_ff_w, post_ff_w, eps, unit_offset, gate_tiles,
                      up_tiles, I, down_tiles, act, scratch, next, MAX_ROWS, projection_share, mlp_share, configure,
                      release);
}
