/* What the machine can do at best, for one ISA of engine/native.py, measured with the
 * kernels' own vectors (cpu_vec.h) and threads; bench/limits.py builds it once per ISA,
 * as the kernels are built.
 *   fma_peak_flops: ACC independent chains of vector multiply-adds per thread, nothing
 *     loaded or stored, so that only the FMA units and the clock bound it;
 *   read_bandwidth: a buffer streamed once by each pass, split over the threads, each
 *     vector added into one of four sums (a decode step only reads its weights). */
#include <omp.h>

#include "cpu_vec.h"

#define ACC 12

/* FLOP/s (2 per multiply-add per lane) of `iterations` rounds on `threads` threads, the
 * best of `repeats` */
double fma_peak_flops(int threads, int64_t iterations, int repeats) {
    double best = 0.0;
    for (int r = 0; r < repeats; r++) {
        float sink = 0.0f;
        const double start = omp_get_wtime();
#pragma omp parallel num_threads(threads) reduction(+ : sink)
        {
            vn acc[ACC];
            for (int i = 0; i < ACC; i++) acc[i] = vn_splat(1.0f + i);
            const vn a = vn_splat(0.999999f), b = vn_splat(1e-7f);
            for (int64_t n = 0; n < iterations; n++)
                for (int i = 0; i < ACC; i++) acc[i] = vn_fma(acc[i], a, b);
            for (int i = 1; i < ACC; i++) acc[0] += acc[i];
            sink += acc[0][0];
        }
        const double seconds = omp_get_wtime() - start;
        const double flops = 2.0 * ACC * VL * (double)iterations * threads / seconds;
        if (flops > best && sink == sink) best = flops;
    }
    return best;
}

/* bytes/s of reading `floats` floats at p (a multiple of 4 * VL), the best of `repeats` */
double read_bandwidth(const float *p, int64_t floats, int threads, int repeats) {
    double best = 0.0;
    for (int r = 0; r < repeats; r++) {
        float sink = 0.0f;
        const double start = omp_get_wtime();
#pragma omp parallel num_threads(threads) reduction(+ : sink)
        {
            vn s[4] = {{0}, {0}, {0}, {0}};
#pragma omp for schedule(static)
            for (int64_t i = 0; i < floats; i += 4 * VL)
                for (int j = 0; j < 4; j++) s[j] += vn_load(p + i + j * VL);
            sink += (s[0] + s[1] + s[2] + s[3])[0];
        }
        const double seconds = omp_get_wtime() - start;
        if (4.0 * floats / seconds > best && sink == sink) best = 4.0 * floats / seconds;
    }
    return best;
}
