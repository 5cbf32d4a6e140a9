/* 16-float vectors for the CPU kernels, written with GCC/Clang vector extensions: the
 * compiler maps them to AVX-512, AVX2 or SSE as -march allows. */
#ifndef PDSERVE_CPU_VEC_H
#define PDSERVE_CPU_VEC_H

#include <stdbool.h>
#include <stdint.h>
#include <string.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

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

/* lanes of v, or of a and b (b's lanes numbered 16 .. 31), picked by constant indices */
#ifdef __clang__
#define PERMUTE(v, ...) __builtin_shufflevector(v, v, __VA_ARGS__)
#define PERMUTE2(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define PERMUTE(v, ...) __builtin_shuffle(v, (vi){__VA_ARGS__})
#define PERMUTE2(a, b, ...) __builtin_shuffle(a, b, (vi){__VA_ARGS__})
#endif

/* the sum of the lanes, in registers (halves folded onto each other) */
static inline float hsum(vf v) {
    v += PERMUTE(v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    v += PERMUTE(v, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3);
    v += PERMUTE(v, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1);
    return v[0] + v[1];
}

/* Lane t of the result is the sum of the lanes of v[t]: sixteen sums at the cost of
 * 15 adds and 30 two-vector shuffles. Each round adds the halves of vector p and of
 * vector p + n (n the vectors left, halved) into one vector: after four rounds the
 * lanes hold v[0] .. v[15] in order. v is overwritten. */
static inline vf hsum16(vf v[16]) {
    for (int p = 0; p < 8; p++)
        v[p] = PERMUTE2(v[p], v[p + 8], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
               PERMUTE2(v[p], v[p + 8], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    for (int p = 0; p < 4; p++)
        v[p] = PERMUTE2(v[p], v[p + 4], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27) +
               PERMUTE2(v[p], v[p + 4], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int p = 0; p < 2; p++)
        v[p] = PERMUTE2(v[p], v[p + 2], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
               PERMUTE2(v[p], v[p + 2], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
    return PERMUTE2(v[0], v[1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30) +
           PERMUTE2(v[0], v[1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
}

/* 16 bytes at p widened to 16 int32 lanes, as int8 or uint8 (one vpmovsxbd / vpmovzxbd
 * with AVX-512: GCC's generic conversion goes through scalar inserts) */
static inline vi widen_bytes(const void *p, const bool is_signed) {
    vi out;
#ifdef __AVX512F__
    const __m128i bytes = _mm_loadu_si128((const __m128i *)p);
    const __m512i v = is_signed ? _mm512_cvtepi8_epi32(bytes) : _mm512_cvtepu8_epi32(bytes);
    memcpy(&out, &v, sizeof out);
#else
    for (int i = 0; i < LANES; i++)
        out[i] = is_signed ? ((const int8_t *)p)[i] : ((const uint8_t *)p)[i];
#endif
    return out;
}

/* lane-wise: a where mask (all ones), else b */
static inline vf blend(vi mask, vf a, vf b) { return (vf)(((vi)a & mask) | ((vi)b & ~mask)); }

/* e^x lane-wise, x clamped to [-87, 88] (Cephes' expf: x = n ln2 + r with n the
 * nearest integer, a degree-6 polynomial in r, times 2^n); within 2 ulp of expf. */
static inline vf vexp(vf x) {
    x = blend(x < splat(-87.0f), splat(-87.0f), x);
    x = blend(x > splat(88.0f), splat(88.0f), x);
    /* 1.5 * 2^23 added rounds x log2(e) to the nearest integer n, in the low bits */
    const vf big = x * 1.44269504088896341f + 12582912.0f;
    const vf nf = big - 12582912.0f;
    const vi n = (vi)big - 0x4B400000;
    vf r = x - nf * 0.693359375f + nf * 2.12194440e-4f;
    vf p = splat(1.9875691500e-4f);
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    return p * (vf)((n + 127) << 23);
}

/* tanh x lane-wise, as 1 - 2 / (e^2x + 1): saturates to +-1 where vexp clamps, within
 * about 1e-7 of tanhf absolutely. */
static inline vf vtanh(vf x) { return 1.0f - 2.0f / (vexp(x + x) + 1.0f); }

#endif
