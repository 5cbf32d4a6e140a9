/* Small-batch float32 projections on CPU: y[M, N] = x[M, K] @ w[N, K]^T, with w in
 * its checkpoint layout ([out, in], each row contiguous) and M a decode batch.
 *
 * Decode reads every weight once per step and does little arithmetic with it, so the
 * kernel streams the weight rows once (each thread a contiguous run of them) and keeps
 * the few activation rows in cache. While a thread works on one tile of weight rows it
 * pulls the next tile's rows into L2, so that memory and arithmetic overlap. A tile is
 * nr weight rows x mr activation rows: mr * nr vector accumulators of 16 lanes along
 * k, folded into scalars at the end. Every y[m, n] is the same sequence of operations
 * whatever M and the tile it falls in, so a request's result does not depend on what
 * else is in the batch.
 *
 * Layouts: rows of x, w and y are ldx, ldw and ldy floats apart; any K (a tail of
 * fewer than 16 is done in scalar).
 */
#include "cpu_kernels.h"
#include "cpu_vec.h"

/* up to this batch a tile spans 8 weight rows (more streams in flight), else 6 rows
 * by up to 4 activation rows (24 accumulators; the activations come from L2, the
 * weight rows from L1 after the first tile) */
#define WIDE_M 2
#define MID_NR 6
#define MAX_MR 4
/* below this many multiply-adds one thread does the whole product */
#define PARALLEL_WORK (1 << 18)

struct operands {
    const float *x, *w;
    float *y;
    int64_t ldx, ldw, ldy, K;
};

/* The weight rows a tile pulls into L2 for the next one: rows first, first + step, ...
 * below nr of next (none when next is NULL), one cache line of each per k step. */
struct prefetch {
    const float *next;
    int first, step;
};

/* One tile: rows m0 .. m0 + mr - 1 of x against rows n0 .. n0 + nr - 1 of w. The sizes
 * are constants where it is inlined, so the accumulators live in registers. */
static inline __attribute__((always_inline)) void tile(struct operands o, int64_t m0,
                                                       int64_t n0, const int mr, const int nr,
                                                       struct prefetch p) {
    vf acc[MAX_MR][8];
    const float *x = o.x + m0 * o.ldx, *w = o.w + n0 * o.ldw;
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) acc[i][j] = (vf){0};
    const int64_t vec_end = o.K / LANES * LANES;
    for (int64_t k = 0; k < vec_end; k += LANES) {
        vf wv[8];
        if (p.next != NULL)
            for (int j = p.first; j < nr; j += p.step)
                __builtin_prefetch(p.next + j * o.ldw + k, 0, 2); /* 2: into L2 */
        for (int j = 0; j < nr; j++) wv[j] = load(w + j * o.ldw + k);
        for (int i = 0; i < mr; i++) {
            vf xv = load(x + i * o.ldx + k);
            for (int j = 0; j < nr; j++) acc[i][j] += xv * wv[j];
        }
    }
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) {
            float sum = hsum(acc[i][j]);
            for (int64_t k = vec_end; k < o.K; k++) sum += x[i * o.ldx + k] * w[j * o.ldw + k];
            o.y[(m0 + i) * o.ldy + n0 + j] = sum;
        }
}

/* all M rows of x against weight rows n0 .. n0 + nr - 1; activation tile t of T
 * prefetches rows t, t + T, ... of next */
#define ROWS(name, nr)                                                                \
    static void name(struct operands o, int64_t M, int64_t n0, const float *next) {   \
        const int T = (M + MAX_MR - 1) / MAX_MR;                                      \
        int64_t m = 0;                                                                \
        int t = 0;                                                                    \
        for (; m + MAX_MR <= M; m += MAX_MR, t++)                                     \
            tile(o, m, n0, MAX_MR, nr, (struct prefetch){next, t, T});                \
        struct prefetch p = {next, t, T};                                             \
        switch (M - m) {                                                              \
        case 3: tile(o, m, n0, 3, nr, p); break;                                      \
        case 2: tile(o, m, n0, 2, nr, p); break;                                      \
        case 1: tile(o, m, n0, 1, nr, p); break;                                      \
        }                                                                             \
    }
ROWS(rows_1, 1)
ROWS(rows_mid, MID_NR)

static void rows_8(struct operands o, int64_t M, int64_t n0, const float *next) {
    struct prefetch p = {next, 0, 1};
    if (M == 2)
        tile(o, 0, n0, 2, 8, p);
    else
        tile(o, 0, n0, 1, 8, p);
}

void gemm_nt_f32(const float *x, int64_t ldx, const float *w, int64_t ldw, float *y,
                 int64_t ldy, int64_t M, int64_t N, int64_t K, int num_threads) {
    struct operands o = {x, w, y, ldx, ldw, ldy, K};
    const int64_t nr = M <= WIDE_M ? 8 : MID_NR, groups = N / nr;
#pragma omp parallel num_threads(num_threads) if (M * N * K >= PARALLEL_WORK)
    {
#pragma omp for schedule(static) nowait
        for (int64_t g = 0; g < groups; g++) {
            const float *next = g + 1 < groups ? w + (g + 1) * nr * ldw : NULL;
            if (nr == 8)
                rows_8(o, M, g * nr, next);
            else
                rows_mid(o, M, g * nr, next);
        }
#pragma omp for schedule(static)
        for (int64_t n = groups * nr; n < N; n++) rows_1(o, M, n, NULL);
    }
}
