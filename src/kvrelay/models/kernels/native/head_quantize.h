/*
 * The int8 copy of the LM head that both screening kernels read (head_screen.c, head_screen_avx2.c): one
 * definition, included by each (every kernel is a library of its own).
 */
#ifndef KVRELAY_HEAD_QUANTIZE_H
#define KVRELAY_HEAD_QUANTIZE_H

#include <math.h>
#include <stdint.h>

/*
 * The int8 copy of a bfloat16 weight W [N, K] and its per-row terms, for K % 64 == 0: per row,
 * scale = max |W[n]| / 127 (1 for a zero row), q = W[n] / scale rounded to nearest (ties away
 * from zero), rowsum = sum q, c1 = scale * sum |q| * slack, and c2 = (max |W[n] - scale * q| +
 * accumulation * max |W[n]|) * slack + 1e-30, all in double. Returns 0, or -1 on bad shapes.
 */
int kvrelay_head_quantize(const uint16_t* w, int64_t N, int64_t K, double accumulation, double slack, int8_t* q,
                          int32_t* rowsum, double* scale, double* c1, double* c2) {
    if (K <= 0 || K % 64 != 0 || N < 1) return -1;
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const uint16_t* row = w + n * K;
        int8_t* out = q + n * K;
        double largest = 0.0;
        for (int64_t k = 0; k < K; k++) {
            const uint32_t bits = (uint32_t)row[k] << 16;
            float f;
            __builtin_memcpy(&f, &bits, 4);
            if (fabs((double)f) > largest) largest = fabs((double)f);
        }
        const double s = largest > 0.0 ? largest / 127.0 : 1.0;
        int32_t sum = 0, magnitude = 0;
        double residual = 0.0;
        for (int64_t k = 0; k < K; k++) {
            const uint32_t bits = (uint32_t)row[k] << 16;
            float f;
            __builtin_memcpy(&f, &bits, 4);
            double r = round((double)f / s);
            r = r > 127.0 ? 127.0 : (r < -127.0 ? -127.0 : r);
            out[k] = (int8_t)r;
            sum += (int32_t)r;
            magnitude += (int32_t)fabs(r);
            const double e = fabs((double)f - r * s);
            if (e > residual) residual = e;
        }
        rowsum[n] = sum;
        scale[n] = s;
        c1[n] = s * (double)magnitude * slack;
        c2[n] = (residual + accumulation * largest) * slack + 1e-30;
    }
    return 0;
}

#endif
