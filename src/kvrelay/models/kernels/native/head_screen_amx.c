/*
 * head_screen_batch.c on AMX: the int8 dots of up to 8 input rows (their coarse and fine parts, 16 tile
 * rows) against 16 weight rows at a time come from one TDPBUSD per 64 columns, so the screen of a
 * decode step's rows reads the int8 head from memory once and stays bound by that read at any M.
 *
 * The weight is read in tile order (kvrelay_head_pack_tiles makes that copy of Q [N, K]: for each 16 rows
 * and 64 columns, a 16 x 64-byte tile whose row r holds, for each of the 16 weight rows j, its four
 * bytes 4r .. 4r + 3 of the 64, as TDPBUSD takes its second operand). Row m's arithmetic is head_screen.c's
 * (that file states it): its coarse and fine int8 parts plus 128 are rows of parts (uint8 [2M, K]) in slices of
 * 8 input rows (the last may be shorter), each slice's coarse rows then its fine rows; its terms terms[m] = (x_scale, g_scale, g_max, x_abs_sum); picked and count as head_screen_batch.c
 * gives them, through the same per-thread candidates in scratch [threads, M, 2, max_picked] doubles.
 *
 * Contract: K % 64 == 0, K < 66,000, N % 64 == 0, 1 <= M <= 64, 1 <= threads <= 64, parts [2M, K],
 * terms [M, 4], picked [M, max_picked], count [M], tiles (N * K bytes) from kvrelay_head_pack_tiles, all
 * contiguous. The caller has been granted the AMX tile state (amx_tiles.h). Returns 0, or -1 when
 * the shapes break the contract (nothing is picked then).
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>

#include "amx_tiles.h"

#define MAX_M 64
#define MAX_THREADS 64
#define SLICE 8   /* input rows per A tile: their two parts fill its 16 rows */
#define GROUPS 4  /* 16-row weight groups per block: one C tile each */
#define MARGIN (0.00390625 * 1.001)

/* Q [N, K] (row-major int8) into tiles (N * K bytes, tile order above). Returns 0, or -1 on bad shapes. */
int kvrelay_head_pack_tiles(const int8_t* q, int64_t N, int64_t K, int8_t* tiles) {
    if (K <= 0 || K % 64 != 0 || N < 16 || N % 16 != 0) return -1;
    const int64_t chunks = K / 64;
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < N / 16; g++)
        for (int64_t c = 0; c < chunks; c++) {
            int8_t* tile = tiles + (g * chunks + c) * 1024;
            for (int r = 0; r < 16; r++)
                for (int j = 0; j < 16; j++)
                    for (int i = 0; i < 4; i++) tile[r * 64 + 4 * j + i] = q[(g * 16 + j) * K + 64 * c + 4 * r + i];
        }
    return 0;
}

/* The terms of weight rows n .. n + 7 that every input row's bounds use: 128 x their int8 sums, their scales
 * and their two error coefficients. */
typedef struct {
    __m512d r128, scale, c1, c2;
} EightRows;

static inline EightRows eight_rows(const int32_t* rowsum, const double* scale, const double* c1, const double* c2,
                                   int64_t n) {
    EightRows w;
    w.r128 = _mm512_mul_pd(_mm512_cvtepi32_pd(_mm256_loadu_si256((const __m256i*)(rowsum + n))),
                           _mm512_set1_pd(128.0));
    w.scale = _mm512_loadu_pd(scale + n);
    w.c1 = _mm512_loadu_pd(c1 + n);
    w.c2 = _mm512_loadu_pd(c2 + n);
    return w;
}

/* The bounds of weight rows n .. n + 7 (terms w) against one input row, from their coarse and fine dots;
 * appends the rows whose upper bound reaches the new floor to the candidates (as head_screen_batch.c's keep);
 * returns the floor, or NAN when the candidates overflowed. The lower bounds are computed only when some
 * upper bound reaches the floor: otherwise every lower bound is below it too (lo <= hi <= up) and the floor
 * stays, so most blocks cost the upper bounds alone. */
static inline double bound_eight(const int32_t* coarse_dots, const int32_t* fine_dots, int64_t n, const EightRows* w,
                                 const double* t, double floor, double* rows, double* bounds, int64_t* kept,
                                 int64_t room) {
    const __m512d coarse = _mm512_sub_pd(_mm512_cvtepi32_pd(_mm256_loadu_si256((const __m256i*)coarse_dots)), w->r128);
    const __m512d fine = _mm512_sub_pd(_mm512_cvtepi32_pd(_mm256_loadu_si256((const __m256i*)fine_dots)), w->r128);
    const __m512d est = _mm512_mul_pd(w->scale, _mm512_add_pd(_mm512_mul_pd(_mm512_set1_pd(t[0]), coarse),
                                                              _mm512_mul_pd(_mm512_set1_pd(t[1]), fine)));
    const __m512d bound = _mm512_add_pd(_mm512_mul_pd(w->c1, _mm512_set1_pd(t[2])),
                                        _mm512_mul_pd(w->c2, _mm512_set1_pd(t[3])));
    const __m512d hi = _mm512_add_pd(est, bound);
    const __m512d margin = _mm512_set1_pd(MARGIN);
    const __m512d up = _mm512_add_pd(hi, _mm512_mul_pd(_mm512_abs_pd(hi), margin));
    __mmask8 mask = _mm512_cmp_pd_mask(up, _mm512_set1_pd(floor), _CMP_GE_OQ);
    if (!mask) return floor;
    const __m512d lo = _mm512_sub_pd(est, bound);
    const double low = _mm512_reduce_max_pd(_mm512_sub_pd(lo, _mm512_mul_pd(_mm512_abs_pd(lo), margin)));
    if (low > floor) {
        floor = low;
        mask = _mm512_cmp_pd_mask(up, _mm512_set1_pd(floor), _CMP_GE_OQ);
        if (!mask) return floor;
    }
    double ups[8];
    _mm512_storeu_pd(ups, up);
    while (mask) {
        const int i = __builtin_ctz(mask);
        mask &= (__mmask8)(mask - 1);
        if (*kept == room) {
            int64_t j = 0;
            for (int64_t k = 0; k < *kept; k++)
                if (bounds[k] >= floor) rows[j] = rows[k], bounds[j++] = bounds[k];
            *kept = j;
            if (j == room) return NAN;
        }
        rows[*kept] = (double)(n + i);
        bounds[(*kept)++] = ups[i];
    }
    return floor;
}

int kvrelay_head_screen_amx(const uint8_t* parts, const int8_t* tiles, const int32_t* rowsum, const double* scale,
                            const double* c1, const double* c2, int64_t N, int64_t K, int64_t M,
                            const double* terms, double* scratch, int64_t threads, int64_t* picked, int64_t* count,
                            int64_t max_picked) {
    if (K <= 0 || K % 64 != 0 || K >= 66000 || N < 64 || N % 64 != 0 || M < 1 || M > MAX_M || threads < 1)
        return -1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    double best_lower[MAX_M];
    int64_t kept[MAX_THREADS][MAX_M];
    int full[MAX_M];
    for (int64_t m = 0; m < M; m++) best_lower[m] = -INFINITY, full[m] = 0;
    const int64_t chunks = K / 64, blocks = N / (16 * GROUPS);
#pragma omp parallel num_threads(threads)
    {
        const int t = omp_get_thread_num();
        double* mine = scratch + (int64_t)t * M * 2 * max_picked;
        double floor[MAX_M];
        int lost[MAX_M];
        for (int64_t m = 0; m < M; m++) floor[m] = -INFINITY, lost[m] = 0, kept[t][m] = 0;
        int32_t dots[GROUPS][2 * SLICE][16];
        int64_t configured = 0;
#pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; b++) {
            const int64_t n0 = b * 16 * GROUPS;
            for (int64_t m0 = 0; m0 < M; m0 += SLICE) {
                const int64_t ms = M - m0 < SLICE ? M - m0 : SLICE;
                if (ms != configured) {
                    TileConfig config = {0};
                    config.palette = 1;
                    config.rows[0] = (uint8_t)(2 * ms), config.colsb[0] = 64;
                    config.rows[1] = 16, config.colsb[1] = 64;
                    config.rows[2] = 16, config.colsb[2] = 64;
                    for (int g = 0; g < GROUPS; g++) config.rows[4 + g] = (uint8_t)(2 * ms), config.colsb[4 + g] = 64;
                    load_tile_config(&config);
                    configured = ms;
                }
                const uint8_t* slice = parts + 2 * m0 * K; /* the slice's coarse rows, then its fine rows */
                _tile_zero(4);
                _tile_zero(5);
                _tile_zero(6);
                _tile_zero(7);
                for (int64_t c = 0; c < chunks; c++) {
                    _tile_loadd(0, slice + 64 * c, K);
                    const int8_t* base = tiles + ((n0 / 16) * chunks + c) * 1024;
                    _tile_loadd(1, base, 64);
                    _tile_dpbusd(4, 0, 1);
                    _tile_loadd(2, base + chunks * 1024, 64);
                    _tile_dpbusd(5, 0, 2);
                    _tile_loadd(1, base + 2 * chunks * 1024, 64);
                    _tile_dpbusd(6, 0, 1);
                    _tile_loadd(2, base + 3 * chunks * 1024, 64);
                    _tile_dpbusd(7, 0, 2);
                }
                _tile_stored(4, dots[0], 64);
                _tile_stored(5, dots[1], 64);
                _tile_stored(6, dots[2], 64);
                _tile_stored(7, dots[3], 64);
                /* Each input row meets the weight rows in ascending order, as in head_screen_batch.c. */
                for (int g = 0; g < GROUPS; g++)
                    for (int h = 0; h < 16; h += 8) {
                        const int64_t n = n0 + 16 * g + h;
                        const EightRows w = eight_rows(rowsum, scale, c1, c2, n);
                        for (int64_t i = 0; i < ms; i++) {
                            const int64_t m = m0 + i;
                            if (lost[m]) continue;
                            double* rows = mine + 2 * m * max_picked;
                            const double f = bound_eight(&dots[g][i][h], &dots[g][ms + i][h], n, &w, terms + 4 * m,
                                                         floor[m], rows, rows + max_picked, &kept[t][m], max_picked);
                            if (isnan(f))
                                lost[m] = 1;
                            else
                                floor[m] = f;
                        }
                    }
            }
        }
        if (configured) _tile_release();
#pragma omp critical
        for (int64_t m = 0; m < M; m++) {
            if (floor[m] > best_lower[m]) best_lower[m] = floor[m];
            full[m] |= lost[m];
        }
    }
    for (int64_t m = 0; m < M; m++) {
        int64_t c = 0;
        for (int64_t t = 0; t < threads && !full[m]; t++) {
            const double* rows = scratch + (t * M + m) * 2 * max_picked;
            const double* bounds = rows + max_picked;
            for (int64_t k = 0; k < kept[t][m]; k++)
                if (bounds[k] >= best_lower[m]) {
                    if (c == max_picked) {
                        full[m] = 1;
                        break;
                    }
                    picked[m * max_picked + c++] = (int64_t)rows[k];
                }
        }
        count[m] = full[m] ? -1 : c;
    }
    return 0;
}
