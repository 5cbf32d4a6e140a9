/* Small-batch float32 projections on CPU: y[M, N] = x[M, K] @ w[N, K]^T, with M a
 * decode batch and w packed once into panels (pack_panels_f32):
 *
 *   w [N, K] (checkpoint layout)  ->  panels [ceil(N / PANEL)][K][PANEL]
 *
 * Panel p holds output columns p * PANEL .. p * PANEL + PANEL - 1, one row of PANEL
 * floats per k, zero past N. Weights that came from a GGUF's Q4_1 or Q8_0 blocks can
 * instead be stored as blocks of QBLOCK k (pack_panels_blocks finds them again in the
 * floats, and packs only when every float comes back exactly):
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
 * bits times at most 8), so a thread expands such a panel, CHUNK rows at a time, into
 * the very floats of the float32 layout and runs the same tiles over them: the same
 * products, from a sixth (Q4) or a quarter (Q8) of the bytes.
 *
 * A tile is up to TILE_M rows of x against CHUNK rows of one panel: for each k, the
 * panel row is three vectors and each x[m, k] a broadcast, so y[m, n..n+15] sits in
 * one vector accumulator and no horizontal sum is needed (24 accumulators, 11 loads per
 * 24 multiply-adds). The accumulators of all M rows wait in the thread's scratch
 * between chunks, and reach y when the panel is done.
 *
 * Decode reads every weight once per step, so each thread streams a contiguous run of
 * panels. A chunk stays in L1 while the tiles of all M rows pass over it, and while
 * they do they pull the same rows of the next panel into L2, so that memory and
 * arithmetic overlap. Every y[m, n] is the sum over k in order, one multiply-add at a
 * time, whatever M and the tile it falls in: a request's result does not depend on
 * what else is in the batch.
 */
#include <math.h>
#include <omp.h>
#include <stdbool.h>

#include "cpu_kernels.h"
#include "cpu_vec.h"

#define PANEL_VECS 3
#define PANEL (PANEL_VECS * LANES)
#define TILE_M 8
#define QBLOCK 32
/* k rows of a panel a thread takes at a time (24 KB of floats, in L1), expanded first
 * when the panel is Q4 / Q8; a multiple of QBLOCK */
#define CHUNK 128
/* below this many multiply-adds one thread does the whole product */
#define PARALLEL_WORK (1 << 18)

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
            const float back = d * q[i] + low;
            int32_t a, b; /* bit for bit, -0.0 too */
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

/* what a tile reads: kn rows of a panel (rows[k * PANEL ..]) against the matching
 * columns of x (x[i * ldx + k]); it adds into acc[i * PANEL ..] (sets it when first) */
struct tile_args {
    const float *x, *rows;
    float *acc;
    int64_t ldx, kn;
};

/* The panel vectors a tile pulls into L2 for the next panel (none when next is NULL):
 * vectors first, first + step, ... below PANEL_VECS of each of its rows, one per k. */
struct prefetch {
    const float *next;
    int first, step;
};

/* rows 0 .. mr - 1 of t.x; mr is a constant where it is inlined, so the accumulators
 * live in registers */
static inline __attribute__((always_inline)) void tile(struct tile_args t, const int mr,
                                                       bool first, struct prefetch p) {
    vf acc[TILE_M][PANEL_VECS];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < PANEL_VECS; j++)
            acc[i][j] = first ? (vf){0} : load(t.acc + i * PANEL + j * LANES);
    for (int64_t k = 0; k < t.kn; k++) {
        const float *row = t.rows + k * PANEL;
        if (p.next != NULL)
            for (int j = p.first; j < PANEL_VECS; j += p.step)
                __builtin_prefetch(p.next + k * PANEL + j * LANES, 0, 2); /* 2: into L2 */
        vf w[PANEL_VECS];
        for (int j = 0; j < PANEL_VECS; j++) w[j] = load(row + j * LANES);
        for (int i = 0; i < mr; i++) {
            const vf xb = splat(t.x[i * t.ldx + k]);
            for (int j = 0; j < PANEL_VECS; j++) acc[i][j] += xb * w[j];
        }
    }
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < PANEL_VECS; j++) store(t.acc + i * PANEL + j * LANES, acc[i][j]);
}

/* all M rows against kn rows of a panel; tile i of T prefetches vectors i, i + T, ...
 * of the same rows of the next panel */
static void chunk_rows(struct tile_args t, int64_t M, bool first, const float *next) {
    const int T = (int)((M + TILE_M - 1) / TILE_M);
    int i = 0;
    for (; (i + 1) * TILE_M <= M; i++, t.x += TILE_M * t.ldx, t.acc += TILE_M * PANEL)
        tile(t, TILE_M, first, (struct prefetch){next, i, T});
    const struct prefetch p = {next, i, T};
    switch (M - (int64_t)i * TILE_M) {
    case 7: tile(t, 7, first, p); break;
    case 6: tile(t, 6, first, p); break;
    case 5: tile(t, 5, first, p); break;
    case 4: tile(t, 4, first, p); break;
    case 3: tile(t, 3, first, p); break;
    case 2: tile(t, 2, first, p); break;
    case 1: tile(t, 1, first, p); break;
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
        vf scale[PANEL_VECS], min[PANEL_VECS];
        for (int j = 0; j < PANEL_VECS; j++) {
            scale[j] = load((const float *)src + j * LANES);
            min[j] = format == PANELS_Q4 ? load((const float *)src + PANEL + j * LANES)
                                         : (vf){0};
        }
        for (int i = 0; i < steps; i++) {
            if (next != NULL) /* lines i and i + steps: every line of the block */
                for (int64_t l = i; l < lines; l += steps)
                    __builtin_prefetch(next + b * block + l * 64, 0, 2);
            for (int j = 0; j < PANEL_VECS; j++) {
                if (format == PANELS_Q4) {
                    const uint8_t *q = src + 2 * PANEL * 4 + i * PANEL + j * LANES;
                    const vi n = widen_bytes(q, false);
                    float *row = dst + 2 * i * PANEL + j * LANES;
                    store(row, __builtin_convertvector(n & 15, vf) * scale[j] + min[j]);
                    const vf high = __builtin_convertvector(n >> 4, vf);
                    store(row + PANEL, high * scale[j] + min[j]);
                } else {
                    const int8_t *q = (const int8_t *)src + PANEL * 4 + i * PANEL + j * LANES;
                    const vf value = __builtin_convertvector(widen_bytes(q, true), vf);
                    store(dst + i * PANEL + j * LANES, value * scale[j]);
                }
            }
        }
    }
}

int64_t gemm_scratch_floats(int64_t M, int num_threads) {
    return num_threads * (CHUNK + M) * PANEL;
}

void gemm_panel_f32(const float *x, int64_t ldx, const void *panels, int format, float *y,
                    int64_t ldy, int64_t M, int64_t N, int64_t K, float *scratch,
                    int num_threads) {
    const int64_t count = (N + PANEL - 1) / PANEL, bytes = gemm_panel_bytes(format, K);
    const int64_t block = gemm_panel_bytes(format, QBLOCK);
#pragma omp parallel num_threads(num_threads) if (M * N * K >= PARALLEL_WORK)
    {
        float *chunk = scratch + gemm_scratch_floats(M, 1) * omp_get_thread_num();
        float *acc = chunk + CHUNK * PANEL; /* [M][PANEL] */
#pragma omp for schedule(static)
        for (int64_t p = 0; p < count; p++) {
            const uint8_t *src = (const uint8_t *)panels + p * bytes;
            const uint8_t *next = p + 1 < count ? src + bytes : NULL;
            for (int64_t k0 = 0; k0 < K; k0 += CHUNK) {
                struct tile_args t = {x + k0, NULL, acc, ldx, K - k0 < CHUNK ? K - k0 : CHUNK};
                const float *ahead = NULL;
                if (format == PANELS_F32) {
                    t.rows = (const float *)src + k0 * PANEL;
                    ahead = next == NULL ? NULL : (const float *)next + k0 * PANEL;
                } else {
                    const int64_t at = k0 / QBLOCK * block;
                    expand(format, src + at, t.kn, chunk, next == NULL ? NULL : next + at);
                    t.rows = chunk;
                }
                chunk_rows(t, M, k0 == 0, ahead);
            }
            const int64_t n = p * PANEL, cols = N - n < PANEL ? N - n : PANEL;
            for (int64_t i = 0; i < M; i++)
                if (cols == PANEL)
                    for (int j = 0; j < PANEL_VECS; j++)
                        store(y + i * ldy + n + j * LANES, load(acc + i * PANEL + j * LANES));
                else
                    memcpy(y + i * ldy + n, acc + i * PANEL, sizeof(float) * cols);
        }
    }
}
