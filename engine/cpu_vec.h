/* 16-float vectors for the CPU kernels, written with GCC/Clang vector extensions: the
 * compiler maps them to AVX-512, AVX2 or SSE as -march allows. */
#ifndef PDSERVE_CPU_VEC_H
#define PDSERVE_CPU_VEC_H

#include <stdint.h>
#include <string.h>

#define LANES 16
typedef float vf __attribute__((vector_size(64)));
typedef int32_t vi __attribute__((vector_size(64)));

static inline vf load(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store(float *p, vf v) { memcpy(p, &v, sizeof v); }

static inline vf splat(float s) {
    return (vf){s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s};
}

#ifdef __clang__
#define PERMUTE(v, ...) __builtin_shufflevector(v, v, __VA_ARGS__)
#else
#define PERMUTE(v, ...) __builtin_shuffle(v, (vi){__VA_ARGS__})
#endif

/* the sum of the lanes, in registers (halves folded onto each other) */
static inline float hsum(vf v) {
    v += PERMUTE(v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    v += PERMUTE(v, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3);
    v += PERMUTE(v, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1);
    return v[0] + v[1];
}

#endif
