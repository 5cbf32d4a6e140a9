/* Float32 projections on CPU: y[M, N] = x[M, K] @ w[N, K]^T, for any M (a decode batch
 * or a prefill chunk), with w packed once into panels (pack_panels_f32):
 *
 *   w [N, K] (checkpoint layout)  ->  panels [ceil(N / PANEL)][K][PANEL]
 *
 * Panel p holds output columns p * PANEL .. p * PANEL + PANEL - 1, one row of PANEL
 * floats per k, zero past N. PANEL is PANEL_VECS native vectors (cpu_kernels.h: 48
 * columns with AVX-512, 16 with AVX2); the panels are packed by the library that runs
 * them. Weights that came from a GGUF's Q4_1 or Q8_0 blocks can instead be stored as
 * blocks of QBLOCK k (pack_panels_blocks finds them again in the floats, and packs only
 * when every float comes back exactly):
 *
 *   PANELS_Q4, per block: scale[PANEL], min[PANEL] (float), then QBLOCK / 2 rows of
 *     PANEL bytes; byte c of row i holds q (0..15) of k = 2i (low nibble) and 2i + 1
 *     (high nibble) of column c, and w = scale * q + min;
 *   PANELS_Q8, per block: scale[PANEL] (float), then QBLOCK rows of PANEL int8 q, and
 *     w = scale * q.
 *
 * A GGUF loads as float32 (engine/gguf_convert.py dequantizes it), where each run of
 * QBLOCK weights along k of a row is exactly d * q + m (Q4_1) or d * q (Q8_0) with d a
 * float16: m is the run's minimum, and q is 15 (or +-127) at its extreme, so d is the
 * float16 nearest that or a neighbour. scale * q is exact in float32 (11 significant
 * bits times at most 8), so fma(q, scale, min) is the very float of the float32 layout.
 *
 * The arithmetic, whatever the path, the ISA and M: y[m, n] = fma(x[m, K-1], w[n, K-1],
 * ... fma(x[m, 1], w[n, 1], x[m, 0] * w[n, 0] + 0) ...), one rounding per k, in order.
 * A row's result therefore depends on nothing else in the batch, a prefill row equals
 * the same row decoded, and the AVX2 and AVX-512 builds agree bit for bit.
 *
 * Two paths compute it:
 *   - direct (M <= DIRECT_M: decode at small batch, where a step streams each weight
 *     once and is bound by memory): the rows' accumulators stay in registers for a
 *     whole panel, and each block's q are widened to floats in registers as they
 *     arrive;
 *   - tiled (larger M): a thread expands CHUNK k of a panel into floats in L1 once,
 *     then runs tiles of TILE_M rows over them: per k, TILE_VECS vector loads and
 *     TILE_M broadcasts feed TILE_M * TILE_VECS multiply-adds. The accumulators of
 *     the rows wait in the thread's scratch between chunks, and reach y when the panel
 *     is done. Rows go ROW_BLOCK at a time through every panel, so that their x and
 *     accumulators stay in L2. While the tiles pass over a chunk they pull the same
 *     rows of the next panel into L2. An output of more than ROW_BLOCK rows is
 *     streamed to memory past the caches, which it would only flush.
 * Threads take contiguous runs of panels. gemm_silu_mul_f32 runs the tiled path over a
 * gate panel and its up panel in turn and stores silu(gate) * up alone: the MLP's
 * widest output never reaches memory.
 */
#include <math.h>
#include <omp.h>
#include <stdbool.h>

#include "cpu_kernels.h"
#include "cpu_vec.h"

#define PANEL GEMM_PANEL
#define QBLOCK 32
/* TILE_M x TILE_VECS: a tile's accumulators (rows x vectors); DIRECT_M: the most rows
 * the direct path takes */
#if VL == 16
#define TILE_M 8
#define TILE_VECS 3
#define DIRECT_M 4
#else
#define TILE_M 6
#define TILE_VECS 2
#define DIRECT_M 3
#endif
#if PANEL_VECS % TILE_VECS || DIRECT_M > 4
#error "a panel is whole column groups, and direct_rows takes at most 4 rows"
#endif
/* k rows of a panel a thread expands at a time (in L1); a multiple of QBLOCK */

#define CHUNK 128
/* below this many multiply-adds one thread does the whole product */
#define PARALLEL_WORK (1 << 18)

const char *kernels_isa(void) { return ISA_NAME; }

int64_t gemm_panel_width(void) { return PANEL; }

int64_t gemm_panel_bytes(int format, int64_t K) {
    switch (format) {
    case PANELS_Q4: return K / QBLOCK * (2 * PANEL * 4 + QBLOCK / 2 * PANEL);
    case PANELS_Q8: return K / QBLOCK * (PANEL * 4 + QBLOCK * PANEL);
    default: return K * PANEL * 4;
    }
}

void pack_panels_f32(const float *w, int64_t ldw, int64_t N, int64_t K, float *panels) {
    const int64_t count = (N + PANEL - 1) / PANEL;
    for (int64_t p = 0; p < count; p++)
        for (int64_t k = 0; k < K; k++) {
            float *row = panels + (p * K + k) * PANEL;
            for (int64_t c = 0; c < PANEL; c++) {
                const int64_t n = p * PANEL + c;
                row[c] = n < N ? w[n * ldw + k] : 0.0f;
            }
        }
}

/* Writes column c of a panel's block from the QBLOCK floats v of one run of the weight;
 * false when they are not a block of format (PANELS_Q4 or PANELS_Q8). */
static bool pack_run(int format, const float *v, uint8_t *block, int c) {
    float low = v[0], high = v[0], top = fabsf(v[0]);
    for (int i = 1; i < QBLOCK; i++) {
        low = fminf(low, v[i]), high = fmaxf(high, v[i]);
        top = fmaxf(top, fabsf(v[i]));
    }
    if (format == PANELS_Q8) low = 0.0f;
    const float guess = format == PANELS_Q4 ? (high - low) / 15 : top / 127;
    const int qmin = format == PANELS_Q4 ? 0 : -128, qmax = format == PANELS_Q4 ? 15 : 127;
    const _Float16 nearest = (_Float16)guess;
    uint16_t bits;
    memcpy(&bits, &nearest, sizeof bits);
    for (int step = 0; step < 3; step++) {
        const uint16_t cand = bits + (step == 0 ? 0 : step == 1 ? 1 : -1);
        _Float16 h;
        memcpy(&h, &cand, sizeof h);
        const float d = (float)h;
        if (!(d >= 0.0f) || isinf(d) || (d == 0.0f && high != low)) continue;
        float q[QBLOCK];
        int wrong = 0;
        for (int i = 0; i < QBLOCK; i++) {
            const float r = d > 0.0f ? nearbyintf((v[i] - low) / d) : 0.0f;
            q[i] = fminf(fmaxf(r, (float)qmin), (float)qmax);
            const float back = fmaf(d, q[i], low); /* as the kernels widen it */
            int32_t a, b;                          /* bit for bit, -0.0 too */
            memcpy(&a, &back, sizeof a), memcpy(&b, &v[i], sizeof b);
            wrong |= a ^ b;
        }
        if (wrong) continue;
        memcpy(block + 4 * c, &d, sizeof d);
        if (format == PANELS_Q4) {
            uint8_t *pairs = block + 8 * PANEL + c;
            memcpy(block + 4 * (PANEL + c), &low, sizeof low);
            for (int i = 0; i < QBLOCK / 2; i++)
                pairs[i * PANEL] = (uint8_t)((int)q[2 * i] | (int)q[2 * i + 1] << 4);
        } else {
            int8_t *rows = (int8_t *)block + 4 * PANEL + c;
            for (int i = 0; i < QBLOCK; i++) rows[i * PANEL] = (int8_t)q[i];
        }
        return true;
    }
    return false;
}

/* w [N, K] -> panels of format (PANELS_Q4 or PANELS_Q8; K a multiple of QBLOCK), the
 * columns past N zero; returns false, out half written, when w is not such blocks. */
bool pack_panels_blocks(const float *w, int64_t ldw, int64_t N, int64_t K, int format,
                        uint8_t *out, int num_threads) {
    if (K % QBLOCK) return false;
    const int64_t count = (N + PANEL - 1) / PANEL, bytes = gemm_panel_bytes(format, K);
    const int64_t block = gemm_panel_bytes(format, QBLOCK);
    bool ok = true;
#pragma omp parallel for num_threads(num_threads) schedule(static) reduction(&& : ok)
    for (int64_t p = 0; p < count; p++) {
        uint8_t *panel = out + p * bytes;
        memset(panel, 0, bytes);
        for (int64_t c = 0; c < PANEL && p * PANEL + c < N && ok; c++)
            for (int64_t b = 0; b < K / QBLOCK && ok; b++)
                ok = pack_run(format, w + (p * PANEL + c) * ldw + b * QBLOCK,
                              panel + b * block, (int)c);
    }
    return ok;
}

static inline vn to_float(vni q) { return __builtin_convertvector(q, vn); }

/* The direct path: rows 0 .. mr - 1 of x against one panel over all K, into
 * out[mr][PANEL]. mr is a constant where it is inlined, so the accumulators live in
 * registers (with AVX2 some scales spill to L1): each one chain of multiply-adds in k
 * order, mr * PANEL_VECS of them in flight. */
static inline __attribute__((always_inline)) void direct(const float *x, int64_t ldx,
                                                         const uint8_t *panel, int format,
                                                         int64_t K, float *out,
                                                         const int mr) {
    vn acc[DIRECT_M][PANEL_VECS];
    for (int r = 0; r < mr; r++)
        for (int j = 0; j < PANEL_VECS; j++) acc[r][j] = (vn){0};
    if (format == PANELS_F32) {
        const float *rows = (const float *)panel;
        for (int64_t k = 0; k < K; k++)
            for (int j = 0; j < PANEL_VECS; j++) {
                const vn w = vn_load(rows + k * PANEL + j * VL);
                for (int r = 0; r < mr; r++)
                    acc[r][j] = vn_fma(vn_splat(x[r * ldx + k]), w, acc[r][j]);
            }
    } else {
        const int64_t block = gemm_panel_bytes(format, QBLOCK);
        for (int64_t b = 0; b < K / QBLOCK; b++) {
            const uint8_t *src = panel + b * block;
            const float *xb = x + b * QBLOCK;
            vn scale[PANEL_VECS], min[PANEL_VECS];
            for (int j = 0; j < PANEL_VECS; j++) {
                scale[j] = vn_load((const float *)src + j * VL);
                min[j] = format == PANELS_Q4
                             ? vn_load((const float *)src + PANEL + j * VL)
                             : (vn){0};
            }
            if (format == PANELS_Q4) {
                const uint8_t *pairs = src + 8 * PANEL;
                for (int i = 0; i < QBLOCK / 2; i++)
                    for (int j = 0; j < PANEL_VECS; j++) {
                        const vni n = widen_vl(pairs + i * PANEL + j * VL, false);
                        const vn even = vn_fma(to_float(n & 15), scale[j], min[j]);
                        const vn odd = vn_fma(to_float(n >> 4), scale[j], min[j]);
                        for (int r = 0; r < mr; r++) {
                            const vn a = vn_fma(vn_splat(xb[r * ldx + 2 * i]), even, acc[r][j]);
                            acc[r][j] = vn_fma(vn_splat(xb[r * ldx + 2 * i + 1]), odd, a);
                        }
                    }
            } else {
                const uint8_t *rows = src + 4 * PANEL;
                for (int i = 0; i < QBLOCK; i++)
                    for (int j = 0; j < PANEL_VECS; j++) {
                        const vni n = widen_vl(rows + i * PANEL + j * VL, true);
                        const vn w = to_float(n) * scale[j]; /* exact */
                        for (int r = 0; r < mr; r++)
                            acc[r][j] = vn_fma(vn_splat(xb[r * ldx + i]), w, acc[r][j]);
                    }
            }
        }
    }
    for (int r = 0; r < mr; r++)
        for (int j = 0; j < PANEL_VECS; j++) vn_store(out + r * PANEL + j * VL, acc[r][j]);
}

/* M rows (M <= DIRECT_M) against one panel */
static void direct_rows(const float *x, int64_t ldx, const uint8_t *panel, int format,
                        int64_t K, float *out, int64_t M) {
    switch (M) {
    case 1: direct(x, ldx, panel, format, K, out, 1); break;
    case 2: direct(x, ldx, panel, format, K, out, 2); break;
    case 3: direct(x, ldx, panel, format, K, out, 3); break;
#if DIRECT_M >= 4
    case 4: direct(x, ldx, panel, format, K, out, 4); break;
#endif
    }
}

/* what a tile reads: kn rows of a panel's column group (rows[k * PANEL ..], TILE_VECS
 * vectors) against the matching columns of x (x[i * ldx + k]); it adds into
 * acc[i * PANEL ..] (the group's columns; sets them when first) */
struct tile_args {
    const float *x, *rows;
    float *acc;
    int64_t ldx, kn;
};


/* rows 0 .. mr - 1 of t.x; mr is a constant where it is inlined, so the accumulators
 * live in registers. ahead (unless NULL): a vector of the next panel's group rows, one
 * line of which it pulls into L2 per k. */
static inline __attribute__((always_inline)) void tile(struct tile_args t, const int mr,
                                                       bool first, const float *ahead) {
    vn acc[TILE_M][TILE_VECS];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < TILE_VECS; j++)
            acc[i][j] = first ? (vn){0} : vn_load(t.acc + i * PANEL + j * VL);
    for (int64_t k = 0; k < t.kn; k++) {
        const float *row = t.rows + k * PANEL;
        if (ahead != NULL) __builtin_prefetch(ahead + k * PANEL, 0, 2); /* 2: into L2 */
        vn w[TILE_VECS];
        for (int j = 0; j < TILE_VECS; j++) w[j] = vn_load(row + j * VL);
        for (int i = 0; i < mr; i++) {
            const vn xb = vn_splat(t.x[i * t.ldx + k]);
            for (int j = 0; j < TILE_VECS; j++) acc[i][j] = vn_fma(xb, w[j], acc[i][j]);
        }
    }
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < TILE_VECS; j++) vn_store(t.acc + i * PANEL + j * VL, acc[i][j]);
}

/* all M rows against kn rows of a panel, a column group at a time; tile i pulls
 * vector i of the group's rows of the next panel (when not NULL) into L2 */
static void chunk_rows(struct tile_args t, int64_t M, bool first, const float *next) {
    for (int g = 0; g < PANEL_VECS; g += TILE_VECS) {
        struct tile_args u = {t.x, t.rows + g * VL, t.acc + g * VL, t.ldx, t.kn};
        int i = 0;
#define AHEAD (next == NULL || i >= TILE_VECS ? NULL : next + (g + i) * VL)
        for (; (i + 1) * TILE_M <= M; i++, u.x += TILE_M * u.ldx, u.acc += TILE_M * PANEL)
            tile(u, TILE_M, first, AHEAD);
        switch (M - (int64_t)i * TILE_M) {
#if TILE_M > 7
        case 7: tile(u, 7, first, AHEAD); break;
#endif
#if TILE_M > 6
        case 6: tile(u, 6, first, AHEAD); break;
#endif
        case 5: tile(u, 5, first, AHEAD); break;
        case 4: tile(u, 4, first, AHEAD); break;
        case 3: tile(u, 3, first, AHEAD); break;
        case 2: tile(u, 2, first, AHEAD); break;
        case 1: tile(u, 1, first, AHEAD); break;
        }
#undef AHEAD
    }
}

/* kn rows (a multiple of QBLOCK) of a Q4 or Q8 panel from src -> float32 rows in dst;
 * pulls the same bytes of the next panel (when not NULL) into L2 meanwhile, a few
 * lines per step */
static void expand(int format, const uint8_t *src, int64_t kn, float *dst,
                   const uint8_t *next) {
    const int64_t block = gemm_panel_bytes(format, QBLOCK), lines = block / 64;
    const int64_t steps = format == PANELS_Q4 ? QBLOCK / 2 : QBLOCK;
    for (int64_t b = 0; b < kn / QBLOCK; b++, src += block, dst += QBLOCK * PANEL) {
        vn scale[PANEL_VECS], min[PANEL_VECS];
        for (int j = 0; j < PANEL_VECS; j++) {
            scale[j] = vn_load((const float *)src + j * VL);
            min[j] = format == PANELS_Q4 ? vn_load((const float *)src + PANEL + j * VL)
                                         : (vn){0};
        }
        for (int i = 0; i < steps; i++) {
            if (next != NULL) /* lines i, i + steps, ...: every line of the block */
                for (int64_t l = i; l < lines; l += steps)
                    __builtin_prefetch(next + b * block + l * 64, 0, 2);
            for (int j = 0; j < PANEL_VECS; j++) {
                if (format == PANELS_Q4) {
                    const vni n = widen_vl(src + 8 * PANEL + i * PANEL + j * VL, false);
                    float *row = dst + 2 * i * PANEL + j * VL;
                    vn_store(row, vn_fma(to_float(n & 15), scale[j], min[j]));
                    vn_store(row + PANEL, vn_fma(to_float(n >> 4), scale[j], min[j]));
                } else {
                    const vni n = widen_vl(src + 4 * PANEL + i * PANEL + j * VL, true);
                    vn_store(dst + i * PANEL + j * VL, to_float(n) * scale[j]);
                }
            }
        }
    }
}

/* rows of a block: the tiled path takes the rows ROW_BLOCK at a time, every panel for
 * each block, so that a block's x and accumulators stay in L2 while the panels pass */
#define ROW_BLOCK 256

/* A thread's scratch: its chunk, SKEW floats, its accumulators, SKEW floats, a second
 * set of accumulators (the fused up projection's), SKEW floats; the next thread's
 * follows. Without the skew the buffers of every thread, and a thread's chunk and
 * accumulators, sit at one offset modulo 4 KiB, and a thread's stores alias the loads of
 * a thread on the same core (two vCPUs of a VM may share one: SMT siblings), which
 * slowed each thread of the tiled path by a fifth (docs/performance.md). */
#define SKEW 272 /* floats: 17 cache lines */

int64_t gemm_scratch_floats(int64_t M, int num_threads) {
    const int64_t rows = M < ROW_BLOCK ? M : ROW_BLOCK;
    return num_threads * ((CHUNK + 2 * rows) * PANEL + 3 * SKEW);
}

/* Outputs of more rows than a row block outgrow the caches before anything reads them:
 * they are streamed past the caches (vn_stream) when y's rows are vector-aligned. */
static bool streamed(const float *y, int64_t ldy, int64_t M) {
    const uintptr_t align = VL * sizeof(float);
    return M > ROW_BLOCK && (uintptr_t)y % align == 0 && ldy * sizeof(float) % align == 0;
}

/* v into y at p, streamed past the caches or stored */
static inline void put(float *p, vn v, bool stream) {
    if (stream)
        vn_stream(p, v);
    else
        vn_store(p, v);
}

/* acc[M][PANEL] -> columns p * PANEL .. of y (those below N) */
static void store_panel(const float *acc, float *y, int64_t ldy, int64_t p, int64_t M,
                        int64_t N, bool stream) {
    const int64_t n = p * PANEL, cols = N - n < PANEL ? N - n : PANEL;
    for (int64_t i = 0; i < M; i++)
        if (cols < PANEL)
            memcpy(y + i * ldy + n, acc + i * PANEL, sizeof(float) * cols);
        else
            for (int j = 0; j < PANEL_VECS; j++)
                put(y + i * ldy + n + j * VL, vn_load(acc + i * PANEL + j * VL), stream);
}

/* The tiled path for rows x[0 .. M - 1] (M <= ROW_BLOCK) against the panel at src (of
 * K rows, in format): chunk by chunk of k, the panel expanded (Q4 / Q8) or read in place
 * (F32), into acc[M][PANEL]; next (or NULL): the panel to pull into L2 meanwhile. */
static void tiled_panel(const float *x, int64_t ldx, const uint8_t *src, const uint8_t *next,
                        int format, int64_t M, int64_t K, float *chunk, float *acc) {
    const int64_t block = gemm_panel_bytes(format, QBLOCK);
    for (int64_t k0 = 0; k0 < K; k0 += CHUNK) {
        const int64_t kn = K - k0 < CHUNK ? K - k0 : CHUNK;
        struct tile_args t = {x + k0, NULL, acc, ldx, kn};
        const float *ahead = NULL;
        if (format == PANELS_F32) {
            t.rows = (const float *)src + k0 * PANEL;
            ahead = next == NULL ? NULL : (const float *)next + k0 * PANEL;
        } else {
            const int64_t at = k0 / QBLOCK * block;
            expand(format, src + at, kn, chunk, next == NULL ? NULL : next + at);
            t.rows = chunk;
        }
        chunk_rows(t, M, k0 == 0, ahead);
    }
}

void gemm_panel_f32(const float *x, int64_t ldx, const void *panels, int format, float *y,
                    int64_t ldy, int64_t M, int64_t N, int64_t K, float *scratch,
                    int num_threads) {
    const int64_t count = (N + PANEL - 1) / PANEL, bytes = gemm_panel_bytes(format, K);
    const uint8_t *base = (const uint8_t *)panels;
    const bool stream = streamed(y, ldy, M);
#pragma omp parallel num_threads(num_threads) if (M * N * K >= PARALLEL_WORK)
    {
        float *chunk = scratch + gemm_scratch_floats(M, 1) * omp_get_thread_num();
        float *acc = chunk + CHUNK * PANEL + SKEW; /* [min(M, ROW_BLOCK)][PANEL] */
        if (M <= DIRECT_M) {
#pragma omp for schedule(static)
            for (int64_t p = 0; p < count; p++) {
                direct_rows(x, ldx, base + p * bytes, format, K, acc, M);
                store_panel(acc, y, ldy, p, M, N, false);
            }
        } else {
            for (int64_t r0 = 0; r0 < M; r0 += ROW_BLOCK) {
                const int64_t rows = M - r0 < ROW_BLOCK ? M - r0 : ROW_BLOCK;
#pragma omp for schedule(static)
                for (int64_t p = 0; p < count; p++) {
                    const uint8_t *src = base + p * bytes;
                    tiled_panel(x + r0 * ldx, ldx, src, p + 1 < count ? src + bytes : NULL,
                                format, rows, K, chunk, acc);
                    store_panel(acc, y + r0 * ldy, ldy, p, rows, N, stream);
                }
            }
        }
        if (stream) _mm_sfence();
    }
}

void gemm_silu_mul_f32(const float *x, int64_t ldx, const void *panels, int format, float *y,
                       int64_t ldy, int64_t M, int64_t I, int64_t K, float *scratch,
                       int num_threads) {
    const int64_t pairs = I / PANEL, bytes = gemm_panel_bytes(format, K);
    const uint8_t *gates = (const uint8_t *)panels, *ups = gates + pairs * bytes;
    const bool stream = streamed(y, ldy, M);
#pragma omp parallel num_threads(num_threads) if (M * 2 * I * K >= PARALLEL_WORK)
    {
        const int64_t block_rows = M < ROW_BLOCK ? M : ROW_BLOCK;
        float *chunk = scratch + gemm_scratch_floats(M, 1) * omp_get_thread_num();
        float *gate = chunk + CHUNK * PANEL + SKEW, *up = gate + block_rows * PANEL + SKEW;
        for (int64_t r0 = 0; r0 < M; r0 += ROW_BLOCK) {
            const int64_t rows = M - r0 < ROW_BLOCK ? M - r0 : ROW_BLOCK;
#pragma omp for schedule(static)
            for (int64_t q = 0; q < pairs; q++) {
                const uint8_t *g = gates + q * bytes, *u = ups + q * bytes;
                tiled_panel(x + r0 * ldx, ldx, g, u, format, rows, K, chunk, gate);
                tiled_panel(x + r0 * ldx, ldx, u, q + 1 < pairs ? g + bytes : NULL, format,
                            rows, K, chunk, up);
                for (int64_t i = 0; i < rows; i++) {
                    float *out = y + (r0 + i) * ldy + q * PANEL;
                    for (int j = 0; j < PANEL_VECS; j++) {
                        const int64_t at = i * PANEL + j * VL;
                        put(out + j * VL, vn_silu_mul(vn_load(gate + at), vn_load(up + at)),
                            stream);
                    }
                }
            }
        }
        if (stream) _mm_sfence();
    }
}
