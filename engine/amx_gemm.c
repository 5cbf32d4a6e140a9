/* Float32 projections of many rows (prefill) on the CPU's AMX tiles, from the Q4 / Q8
 * panels of cpu_gemm.c: y[M, N] = x[M, K] @ w[N, K]^T, with w = scale * q + min in
 * blocks of QBLOCK k (min = 0 for Q8).
 *
 * AMX multiplies bfloat16 pairs and adds in float32. Two facts make it exact enough
 * for float32 work:
 *   - q (0..15, or -128..127) is a bfloat16 exactly;
 *   - a float32 x is exactly hi + mid + lo, three bfloat16 (each the nearest bfloat16
 *     to what the ones before it leave, and each difference exact by Sterbenz), so
 *     x * q = hi * q + mid * q + lo * q, each product exact in float32.
 * So, per block b of QBLOCK k and 16 x 16 outputs, three tile products give
 *   c[i, n] = sum_k x[i, k] * q'[k, n]      (float32 sums, in the tile's order)
 * and the vector unit adds
 *   acc[i, n] += scale[b, n] * c[i, n] + offset[b, n] * s[i, b],   s[i, b] = sum_k x[i, k]
 * where q' = q and offset = 0 for Q8, and for Q4 q' = q - z, offset = min + scale * z
 * (expand_q: centred, so that the two terms do not cancel). This differs from the
 * float32 product of the dequantized floats in where it rounds: its weight
 * scale * q' + offset is not rounded to float32 (a float32 weight is, by up to half an
 * ulp), and it rounds c, scale * c and offset * s per block where a float32 GEMM
 * rounds each partial sum. The errors are of a float32 GEMM's size
 * (tests/test_amx_gemm.py bounds them against float64); dropping lo would make them
 * ~2^-17 of each product, and the tests catch it.
 *
 * Data (scratch, amx_scratch_bytes):
 *   xs   [ceil(M / 16)][K / QBLOCK][3][16][32] bfloat16: A tiles, hi / mid / lo
 *   sums [ceil(M / 16)][K / QBLOCK][16] float: s, rows past M zero
 *   bq   [ceil(N / 48)][K / QBLOCK][3][16][16][2] bfloat16: B tiles of q in the pair
 *        layout AMX reads (row r holds k = 2r and 2r + 1 of 16 columns)
 *   offsets [ceil(N / 48)][K / QBLOCK][48] float (Q4, see expand_q)
 * Threads first split x and expand q, then take work items: up to MBLOCK rows (their
 * xs stays in L2) against a run of panels. A strip is 16 rows by RUN panels: per
 * block it loads its three A tiles once, and per panel runs 9 tile products into three
 * C tiles, which it stores for the vector unit to scale while the tile unit runs the
 * next panel. Each row of y comes from its own row of A tiles through the same
 * sequence of products, whatever M is: results do not depend on the other rows.
 */
#include <math.h>
#include <omp.h>
#include <stdbool.h>

#include "cpu_kernels.h"
#include "cpu_vec.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define HAVE_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif

#define GROUPS 3 /* 16-column tiles in a panel */
#define PANEL (GROUPS * 16)
#if defined(HAVE_AMX) && PANEL != GEMM_PANEL
#error "amx_gemm.c reads cpu_gemm.c's panels: their widths must agree"
#endif
#define QBLOCK 32
#define TILE 1024 /* bytes of a 16 x 64-byte tile */
#define MBLOCK 128
#define RUN 4 /* panels a strip takes at once */

int64_t amx_scratch_bytes(int64_t M, int64_t N, int64_t K) {
    const int64_t mt = (M + 15) / 16, kb = K / QBLOCK, p = (N + PANEL - 1) / PANEL;
    return mt * kb * (3 * TILE + 16 * 4) + p * kb * (GROUPS * TILE + PANEL * 4);
}

#ifdef HAVE_AMX

bool amx_enable(void) {
    /* ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA: Linux hands out the tile state only
     * to processes that ask */
    return syscall(SYS_arch_prctl, 0x1023, 18) == 0;
}

struct tile_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t bytes_per_row[16];
    uint8_t rows[16];
} __attribute__((packed));

static void configure_tiles(void) {
    struct tile_config c = {.palette = 1};
    for (int t = 0; t < 8; t++) c.rows[t] = 16, c.bytes_per_row[t] = 64;
    _tile_loadconfig(&c);
}

static inline vf widen_bf16(__m256bh h) { return (vf)_mm512_cvtpbh_ps(h); }

/* rows t * 16 .. t * 16 + 15 of x, k block b -> the three A tiles and the 16 sums */
static void split_x(const float *x, int64_t ldx, int64_t M, int64_t t, int64_t b,
                    uint8_t *tiles, float *sums) {
    for (int r = 0; r < 16; r++) {
        const int64_t row = t * 16 + r;
        __m256bh *out = (__m256bh *)(tiles + r * 64);
        if (row >= M) {
            for (int part = 0; part < 3; part++)
                memset(tiles + part * TILE + r * 64, 0, 64);
            sums[r] = 0;
            continue;
        }
        vf v[2] = {load(x + row * ldx + b * QBLOCK), load(x + row * ldx + b * QBLOCK + 16)};
        sums[r] = _mm512_reduce_add_ps((__m512)(v[0] + v[1]));
        for (int part = 0; part < 3; part++)
            for (int h = 0; h < 2; h++) {
                const __m256bh bf = _mm512_cvtneps_pbh((__m512)v[h]);
                memcpy((uint8_t *)out + part * TILE + h * 32, &bf, 32);
                v[h] -= widen_bf16(bf); /* exact: the next part's value */
            }
    }
}

/* A Q4 block as scale * (q - z) + offset, offset = min + scale * z, with z the integer
 * nearest -min / scale (within +-ZMAX): scale * (q - z) is then near w itself, and the
 * offset at most half a scale, so that the two terms of the sum no longer cancel where
 * w is near zero and min is not. q - z stays an integer below 2^8: a bfloat16. */
#define ZMAX 128

/* block (Q4 or Q8) of a panel -> its three B tiles of q (Q4: q - z) and, for Q4, the
 * offsets of its PANEL columns */
static void expand_q(int format, const uint8_t *block, uint8_t *tiles, float *offset) {
    const vi low16 = (vi){0} + 0xffff;
    for (int g = 0; g < GROUPS; g++) {
        vi z = {0};
        if (format == PANELS_Q4) {
            const vf scale = load((const float *)block + g * 16);
            const vf min = load((const float *)block + PANEL + g * 16);
            for (int c = 0; c < 16; c++) {
                const float v = scale[c] == 0 ? 0 : nearbyintf(-min[c] / scale[c]);
                z[c] = v > ZMAX ? ZMAX : v < -ZMAX ? -ZMAX : (int32_t)v;
            }
            store(offset + g * 16, min + scale * __builtin_convertvector(z, vf));
        }
        for (int r = 0; r < 16; r++) {
            vi even, odd; /* q of k = 2r and 2r + 1, columns g * 16 .. */
            if (format == PANELS_Q4) {
                const vi n = widen_bytes(block + 2 * PANEL * 4 + r * PANEL + g * 16, false);
                even = (n & 15) - z, odd = (n >> 4) - z;
            } else {
                const uint8_t *q = block + PANEL * 4 + 2 * r * PANEL + g * 16;
                even = widen_bytes(q, true), odd = widen_bytes(q + PANEL, true);
            }
            /* a small integer's float32 has zero low halves: its bits >> 16 are its
             * bfloat16 */
            const vi e = (vi)__builtin_convertvector(even, vf);
            const vi o = (vi)__builtin_convertvector(odd, vf);
            const vi pair = ((e >> 16) & low16) | (o & ~low16);
            memcpy(tiles + g * TILE + r * 64, &pair, 64);
        }
    }
}

/* acc[16][ld] (+)= scale * c + offset * s for one block of one panel */
static inline void scale_block(float *acc, int64_t ld, const float c[GROUPS][16][16],
                               const float *scale, const float *offset, const float *s,
                               bool first) {
    for (int g = 0; g < GROUPS; g++) {
        const vf d = load(scale + g * 16);
        const vf m = offset == NULL ? (vf){0} : load(offset + g * 16);
        for (int r = 0; r < 16; r++) {
            float *out = acc + r * ld + g * 16;
            const vf prior = first ? (vf){0} : load(out);
            /* fused, explicitly: left to the compiler, some rows came out contracted
             * and others not, and a row's result depended on its place in the tile */
            const __m512 t = _mm512_fmadd_ps((__m512)m, (__m512)splat(s[r]), (__m512)prior);
            store(out, (vf)_mm512_fmadd_ps((__m512)d, (__m512)load(c[g][r]), t));
        }
    }
}

#define PRODUCTS(C, B)                                                                     \
    _tile_dpbf16ps(C, 3, B);                                                               \
    _tile_dpbf16ps(C, 4, B);                                                               \
    _tile_dpbf16ps(C, 5, B)

/* One strip of y: 16 rows by n <= RUN panels. xs / sums: the rows' A tiles and sums
 * (K / QBLOCK blocks); src: the first panel (panels bytes apart); bq / offsets: its q
 * tiles and Q4 offsets (the next panels' follow). Each block's A tiles load once for
 * all n panels; the vector unit scales one (block, panel) step while the tile unit
 * runs the next. */
static void strip(const uint8_t *xs, const float *sums, const uint8_t *src, int64_t bytes,
                  const uint8_t *bq, const float *offsets, int format, int64_t kb, int n,
                  float *y, int64_t ldy, int rows, int cols) {
    float acc[16][RUN * PANEL] __attribute__((aligned(64)));
    float c[GROUPS][16][16] __attribute__((aligned(64)));
    const int64_t block = gemm_panel_bytes(format, QBLOCK);
    for (int64_t step = 0; step <= kb * n; step++) {
        const int64_t b = step / n, p = step % n;
        if (step < kb * n) {
            if (p == 0) {
                const uint8_t *a = xs + b * 3 * TILE;
                _tile_loadd(3, a, 64);
                _tile_loadd(4, a + TILE, 64);
                _tile_loadd(5, a + 2 * TILE, 64);
            }
            const uint8_t *q = bq + (p * kb + b) * GROUPS * TILE;
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_loadd(6, q, 64);
            PRODUCTS(0, 6);
            _tile_loadd(7, q + TILE, 64);
            PRODUCTS(1, 7);
            _tile_loadd(6, q + 2 * TILE, 64);
            PRODUCTS(2, 6);
        }
        if (step > 0) { /* the step before */
            const int64_t pb = (step - 1) / n, pp = (step - 1) % n;
            const float *scale = (const float *)(src + pp * bytes + pb * block);
            const float *offset =
                format == PANELS_Q4 ? offsets + (pp * kb + pb) * PANEL : NULL;
            scale_block(acc[0] + pp * PANEL, RUN * PANEL, c, scale, offset, sums + pb * 16,
                        pb == 0);
        }
        if (step < kb * n) {
            _tile_stored(0, c[0], 64);
            _tile_stored(1, c[1], 64);
            _tile_stored(2, c[2], 64);
        }
    }
    for (int r = 0; r < rows; r++) memcpy(y + r * ldy, acc[r], sizeof(float) * cols);
}

bool amx_gemm_blocks(const float *x, int64_t ldx, const void *panels, int format, float *y,
                     int64_t ldy, int64_t M, int64_t N, int64_t K, void *scratch,
                     int num_threads) {
    if ((format != PANELS_Q4 && format != PANELS_Q8) || K % QBLOCK != 0 || M < 1)
        return false;
    const int64_t mt = (M + 15) / 16, kb = K / QBLOCK, np = (N + PANEL - 1) / PANEL;
    const int64_t bytes = gemm_panel_bytes(format, K);
    const int64_t block = gemm_panel_bytes(format, QBLOCK);
    uint8_t *xs = scratch, *bq = xs + mt * kb * 3 * TILE;
    float *sums = (float *)(bq + np * kb * GROUPS * TILE), *offsets = sums + mt * kb * 16;
    /* work items: MBLOCK rows by a run of panels, enough of them for every thread */
    const int64_t row_items = (mt + MBLOCK / 16 - 1) / (MBLOCK / 16);
    int64_t runs = (2 * num_threads + row_items - 1) / row_items;
    runs = runs > np ? np : runs;
    const int64_t run = (np + runs - 1) / runs;
#pragma omp parallel num_threads(num_threads)
    {
        configure_tiles();
#pragma omp for schedule(static)
        for (int64_t i = 0; i < mt * kb; i++)
            split_x(x, ldx, M, i / kb, i % kb, xs + i * 3 * TILE, sums + i * 16);
#pragma omp for schedule(static)
        for (int64_t i = 0; i < np * kb; i++)
            expand_q(format, (const uint8_t *)panels + i / kb * bytes + i % kb * block,
                     bq + i * GROUPS * TILE, offsets + i * PANEL);
#pragma omp for schedule(static)
        for (int64_t item = 0; item < row_items * runs; item++) {
            const int64_t t0 = item / runs * (MBLOCK / 16), p0 = item % runs * run;
            const int64_t p1 = p0 + run < np ? p0 + run : np;
            for (int64_t p = p0; p < p1; p += RUN) {
                const int n = p1 - p < RUN ? (int)(p1 - p) : RUN;
                const int64_t cols = N - p * PANEL < n * PANEL ? N - p * PANEL : n * PANEL;
                const uint8_t *src = (const uint8_t *)panels + p * bytes;
                for (int64_t t = t0; t < t0 + MBLOCK / 16 && t < mt; t++) {
                    const int rows = M - t * 16 < 16 ? (int)(M - t * 16) : 16;
                    strip(xs + t * kb * 3 * TILE, sums + t * kb * 16, src, bytes,
                          bq + p * kb * GROUPS * TILE, offsets + p * kb * PANEL, format, kb, n,
                          y + t * 16 * ldy + p * PANEL, ldy, rows, (int)cols);
                }
            }
        }
        _tile_release();
    }
    return true;
}

#else

bool amx_enable(void) { return false; }

bool amx_gemm_blocks(const float *x, int64_t ldx, const void *panels, int format, float *y,
                     int64_t ldy, int64_t M, int64_t N, int64_t K, void *scratch,
                     int num_threads) {
    return false;
}

#endif
