/* Vectors for the CPU kernels, written with GCC/Clang vector extensions.
 *
 * Two widths. `vf` holds 16 floats whatever the ISA (two registers with AVX2): the
 * attention and element-wise kernels count tokens and lanes in sixteens. `vn` holds
 * one register: VL = 16 floats with AVX-512, 8 with AVX2; kernels that keep many
 * accumulators in registers (the projections, cpu_gemm.c) use it, so that AVX2's 16
 * registers are not asked to hold AVX-512's 32. engine/native.py builds the library
 * once per ISA (-march=x86-64-v3 for AVX2, x86-64-v4 for AVX-512, sapphirerapids for
 * AMX), and `ISA_NAME` says which one this object was compiled for. */
#ifndef PDSERVE_CPU_VEC_H
#define PDSERVE_CPU_VEC_H

#include <stdbool.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#if defined(__AMX_TILE__)
#define ISA_NAME "amx"
#elif defined(__AVX512F__)
#define ISA_NAME "avx512"
#elif defined(__AVX2__)
#define ISA_NAME "avx2"
#else
#define ISA_NAME "generic"
#endif

#ifdef __AVX512F__
#define VL 16
#else
#define VL 8
#endif
typedef float vn __attribute__((vector_size(VL * 4)));
typedef int32_t vni __attribute__((vector_size(VL * 4)));

static inline vn vn_load(const float *p) {
    vn v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void vn_store(float *p, vn v) { memcpy(p, &v, sizeof v); }

/* a store that bypasses the caches (p aligned to a vector): for outputs larger than
 * they are, written once and read by the next operation; _mm_sfence() before another
 * thread reads them */
static inline void vn_stream(float *p, vn v) {
#if VL == 16
    __m512 m;
    memcpy(&m, &v, sizeof m);
    _mm512_stream_ps(p, m);
#else
    __m256 m;
    memcpy(&m, &v, sizeof m);
    _mm256_stream_ps(p, m);
#endif
}

static inline vn vn_splat(float s) {
#if defined(__AVX512F__)
    return (vn)_mm512_set1_ps(s);
#elif defined(__AVX2__)
    return (vn)_mm256_set1_ps(s);
#else
    vn v;
    for (int i = 0; i < VL; i++) v[i] = s;
    return v;
#endif
}

/* a * b + c rounded once, lane-wise: spelled out, so that no compiler setting decides
 * whether a product is rounded before its sum */
static inline vn vn_fma(vn a, vn b, vn c) {
#if defined(__AVX512F__)
    return (vn)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__FMA__)
    return (vn)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
    vn out;
    for (int i = 0; i < VL; i++) out[i] = __builtin_fmaf(a[i], b[i], c[i]);
    return out;
#endif
}

/* VL bytes at p widened to VL int32 lanes, as int8 or uint8 (one vpmovsxbd / vpmovzxbd) */
static inline vni widen_vl(const void *p, const bool is_signed) {
    vni out;
#if defined(__AVX512F__)
    const __m128i bytes = _mm_loadu_si128((const __m128i *)p);
    const __m512i v = is_signed ? _mm512_cvtepi8_epi32(bytes) : _mm512_cvtepu8_epi32(bytes);
    memcpy(&out, &v, sizeof out);
#elif defined(__AVX2__)
    const __m128i bytes = _mm_loadl_epi64((const __m128i *)p);
    const __m256i v = is_signed ? _mm256_cvtepi8_epi32(bytes) : _mm256_cvtepu8_epi32(bytes);
    memcpy(&out, &v, sizeof out);
#else
    for (int i = 0; i < VL; i++)
        out[i] = is_signed ? ((const int8_t *)p)[i] : ((const uint8_t *)p)[i];
#endif
    return out;
}

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

/* Lane t of the result is the sum of the lanes of v[t], for VL native vectors: hsum16
 * with AVX-512; with AVX2 the same folding in three rounds of eight. v is overwritten. */
static inline vn hsum_vl(vn v[VL]) {
#if VL == 16
    vf w[16];
    memcpy(w, v, sizeof w);
    const vf sums = hsum16(w);
    vn out;
    memcpy(&out, &sums, sizeof out);
    return out;
#else
#ifdef __clang__
#define PERMUTE8(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define PERMUTE8(a, b, ...) __builtin_shuffle(a, b, (vni){__VA_ARGS__})
#endif
    for (int p = 0; p < 4; p++)
        v[p] = PERMUTE8(v[p], v[p + 4], 0, 1, 2, 3, 8, 9, 10, 11) +
               PERMUTE8(v[p], v[p + 4], 4, 5, 6, 7, 12, 13, 14, 15);
    for (int p = 0; p < 2; p++)
        v[p] = PERMUTE8(v[p], v[p + 2], 0, 1, 8, 9, 4, 5, 12, 13) +
               PERMUTE8(v[p], v[p + 2], 2, 3, 10, 11, 6, 7, 14, 15);
    return PERMUTE8(v[0], v[1], 0, 8, 2, 10, 4, 12, 6, 14) +
           PERMUTE8(v[0], v[1], 1, 9, 3, 11, 5, 13, 7, 15);
#undef PERMUTE8
#endif
}

/* 16 bytes at p widened to 16 int32 lanes, as int8 or uint8 (vpmovsxbd / vpmovzxbd: GCC's
 * generic conversion goes through scalar inserts) */
static inline vi widen_bytes(const void *p, const bool is_signed) {
    vi out;
#if defined(__AVX512F__)
    const __m128i bytes = _mm_loadu_si128((const __m128i *)p);
    const __m512i v = is_signed ? _mm512_cvtepi8_epi32(bytes) : _mm512_cvtepu8_epi32(bytes);
    memcpy(&out, &v, sizeof out);
#elif defined(__AVX2__)
    const __m128i bytes = _mm_loadu_si128((const __m128i *)p);
    const __m128i high = _mm_unpackhi_epi64(bytes, bytes);
    const __m256i lo = is_signed ? _mm256_cvtepi8_epi32(bytes) : _mm256_cvtepu8_epi32(bytes);
    const __m256i hi = is_signed ? _mm256_cvtepi8_epi32(high) : _mm256_cvtepu8_epi32(high);
    memcpy(&out, &lo, sizeof lo);
    memcpy((char *)&out + sizeof lo, &hi, sizeof hi);
#else
    for (int i = 0; i < LANES; i++)
        out[i] = is_signed ? ((const int8_t *)p)[i] : ((const uint8_t *)p)[i];
#endif
    return out;
}

/* x clamped to [lo, hi] lane-wise: a max and a min per native vector (a compare and a
 * blend each cost three) */
static inline vn vn_clamp(vn x, float lo, float hi) {
#if VL == 16
    __m512 m;
    memcpy(&m, &x, sizeof m);
    m = _mm512_min_ps(_mm512_max_ps(m, _mm512_set1_ps(lo)), _mm512_set1_ps(hi));
#else
    __m256 m;
    memcpy(&m, &x, sizeof m);
    m = _mm256_min_ps(_mm256_max_ps(m, _mm256_set1_ps(lo)), _mm256_set1_ps(hi));
#endif
    memcpy(&x, &m, sizeof x);
    return x;
}
static inline vf clamp(vf x, float lo, float hi) {
    vn part[16 / VL];
    memcpy(part, &x, sizeof part);
    for (int i = 0; i < 16 / VL; i++) part[i] = vn_clamp(part[i], lo, hi);
    memcpy(&x, part, sizeof x);
    return x;
}

/* the lane-wise larger of a and b (b where either is NaN) */
static inline vn vn_max(vn a, vn b) {
#if VL == 16
    __m512 x, y;
    memcpy(&x, &a, sizeof x), memcpy(&y, &b, sizeof y);
    x = _mm512_max_ps(x, y);
#else
    __m256 x, y;
    memcpy(&x, &a, sizeof x), memcpy(&y, &b, sizeof y);
    x = _mm256_max_ps(x, y);
#endif
    memcpy(&a, &x, sizeof a);
    return a;
}

/* Three lane-wise functions, defined for a vector type V with integer lanes VI (vf and
 * vi, vn and vni), CLAMP its clamp:
 *   BLEND(mask, a, b): a where mask (all ones), else b;
 *   EXP(x): e^x, x clamped to [-87, 88] (Cephes' expf: x = n ln2 + r with n the nearest
 *     integer, a degree-6 polynomial in r, times 2^n); within 2 ulp of expf;
 *   TANH(x): 1 - 2 / (e^2x + 1): saturates to +-1 where EXP clamps, within about 1e-7
 *     of tanhf absolutely. */
#define VEC_MATH(V, VI, BLEND, CLAMP, EXP, TANH)                                           \
    static inline V BLEND(VI mask, V a, V b) { return (V)(((VI)a & mask) | ((VI)b & ~mask)); } \
    static inline V EXP(V x) {                                                             \
        const V zero = {0};                                                                \
        x = CLAMP(x, -87.0f, 88.0f);                                                       \
        /* 1.5 * 2^23 added rounds x log2(e) to the nearest integer n, in the low bits */  \
        const V big = x * 1.44269504088896341f + 12582912.0f;                              \
        const V nf = big - 12582912.0f;                                                    \
        const VI n = (VI)big - 0x4B400000;                                                 \
        V r = x - nf * 0.693359375f + nf * 2.12194440e-4f;                                 \
        V p = zero + 1.9875691500e-4f;                                                     \
        p = p * r + 1.3981999507e-3f;                                                      \
        p = p * r + 8.3334519073e-3f;                                                      \
        p = p * r + 4.1665795894e-2f;                                                      \
        p = p * r + 1.6666665459e-1f;                                                      \
        p = p * r + 5.0000001201e-1f;                                                      \
        p = p * r * r + r + 1.0f;                                                          \
        return p * (V)((n + 127) << 23);                                                   \
    }                                                                                      \
    static inline V TANH(V x) { return 1.0f - 2.0f / (EXP(x + x) + 1.0f); }

VEC_MATH(vf, vi, blend, clamp, vexp, vtanh)
VEC_MATH(vn, vni, vn_blend, vn_clamp, vn_exp, vn_tanh)

/* silu(g) * u = g / (1 + e^-g) * u, lane-wise: the one formula of every path (the
 * separate pass of cpu_ops.c and the fused epilogue of cpu_gemm.c agree bit for bit) */
static inline vn vn_silu_mul(vn g, vn u) { return g / (1.0f + vn_exp(-g)) * u; }

#endif
