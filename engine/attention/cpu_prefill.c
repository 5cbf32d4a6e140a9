/* Causal paged attention for a prefill chunk, float32 on CPU, read straight from the
 * KV blocks (flash-attention style: an online softmax over tiles of keys, no score
 * matrix the size of the context).
 *
 * One sequence: its num_tokens query tokens sit at positions context - num_tokens ..
 * context - 1, and their K/V are already in the cache with the earlier ones; token l
 * of the sequence sits at slot l % block_size of block block_table[l / block_size].
 * Query head h * G + g (G = num_heads / num_kv_heads) attends to KV head h. The token
 * at position p attends to positions 0 .. p, or with a sliding window (window > 0)
 * max(0, p - window + 1) .. p; a task starts its keys at the window of its first row,
 * so no position before context - num_tokens - window + 1 is read (the table entries
 * of blocks wholly before it may name any block). With softcap > 0 each score
 * s = scale * q . k becomes softcap * tanh(s / softcap) before the mask.
 *
 * Everything runs transposed, with the queries along the vector lanes: a task is one
 * KV head and a tile of LANES_PER_TASK query rows (several query heads of its group by
 * a run of tokens: VECS native vectors, cpu_vec.h's vn), held as
 *     qt [head_dim][lanes]   scale * q, the rows side by side
 *     st [KEYS][lanes]       scores, then probabilities, of a tile of keys
 *     ot [head_dim][lanes]   the running sum of probabilities times values
 * so scores are key rows broadcast against qt, the softmax runs down the columns
 * (lane-wise max, exp and sums: no horizontal reductions) and the values are value
 * rows broadcast against st. Keys are taken in tiles of KEYS; a tile that reaches past
 * a row's position, or before its window, is masked there (keys past the context are
 * masked the same way). The products run in register tiles of KEY_ROWS keys (or
 * DIM_ROWS value columns) by GROUP_VECS of the lane vectors.
 *
 * Layouts: q and out rows of num_heads * head_dim floats, q_stride and out_stride
 * floats apart; k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_dim],
 * contiguous.
 */
#include <stdlib.h>

#include "cpu_kernels.h"
#include "cpu_vec.h"

/* A task's query rows (LANES_PER_TASK: VECS native vectors) and its tiles of keys
 * (KEYS); the register tiles: KEY_ROWS keys (scores) or DIM_ROWS value columns (sums)
 * broadcast against GROUP_VECS lane vectors, 24 accumulators with AVX-512's 32
 * registers, 8 with AVX2's 16. Eight keys a tile load each query vector once for eight
 * multiply-adds, where four left the loop waiting on loads. AVX2's task is half
 * AVX-512's, so that its transposed queries, scores and sums stay in L1. */
#if VL == 16
#define LANES_PER_TASK 96
#define GROUP_VECS 3
#define KEYS 128
#else
#define LANES_PER_TASK 48
#define GROUP_VECS 1
#define KEYS 64
#endif
#define VECS (LANES_PER_TASK / VL)
#define KEY_ROWS 8
#define DIM_ROWS 8
_Static_assert(KEYS % KEY_ROWS == 0, "a tile of keys is whole score tiles");
_Static_assert(VECS % GROUP_VECS == 0, "a task is whole register tiles");
#define MASKED (-1e30f)

struct prefill {
    const float *q, *k_cache, *v_cache;
    const int32_t *table;
    float *out;
    int64_t q_stride, out_stride, num_tokens, context, num_heads, num_kv_heads, head_dim,
        block_size, window;
    float scale, softcap;
    /* a task's rows: heads g0 .. g0 + heads - 1 of the group by tokens t0 .. t0 + tokens - 1,
     * lane i = (g - g0) * tokens + (t - t0) */
    int64_t heads, tokens;
};

struct task {
    int64_t kv_head, g0, t0;
};

/* Lanes that do not see key l: past their position pos, or before their window's
 * first position lo. */
static inline vni hidden(vni pos, vni lo, int64_t l) {
    return (pos < (int32_t)l) | (lo > (int32_t)l);
}

/* st[j] = qt . key j (soft-capped) for keys j < nk of the tile (nk a multiple of
 * KEY_ROWS), KEY_ROWS keys by GROUP_VECS lane vectors at a time; with pos and lo (the
 * lanes' positions and first visible positions, k0 the tile's first key) the keys a
 * lane does not see are masked. top[v]: each lane's largest score. */
static void scores(const struct prefill *p, const float *const *keys, int64_t nk,
                   const float *qt, const vni *pos, const vni *lo, int64_t k0, float *st,
                   vn *top) {
    const float softcap = p->softcap; /* a local: the stores to st could alias p's floats */
    for (int v = 0; v < VECS; v++) top[v] = vn_splat(MASKED);
    for (int64_t j = 0; j < nk; j += KEY_ROWS)
        for (int v0 = 0; v0 < VECS; v0 += GROUP_VECS) {
            vn acc[KEY_ROWS][GROUP_VECS];
            for (int a = 0; a < KEY_ROWS; a++)
                for (int v = 0; v < GROUP_VECS; v++) acc[a][v] = (vn){0};
            for (int64_t d = 0; d < p->head_dim; d++) {
                const float *col = qt + d * LANES_PER_TASK + v0 * VL;
                vn qv[GROUP_VECS];
                for (int v = 0; v < GROUP_VECS; v++) qv[v] = vn_load(col + v * VL);
                for (int a = 0; a < KEY_ROWS; a++) {
                    const vn kv = vn_splat(keys[j + a][d]);
                    for (int v = 0; v < GROUP_VECS; v++) acc[a][v] += kv * qv[v];
                }
            }
            for (int a = 0; a < KEY_ROWS; a++)
                for (int v = v0; v < v0 + GROUP_VECS; v++) {
                    vn x = acc[a][v - v0];
                    if (softcap > 0.0f) x = softcap * vn_tanh(x * (1.0f / softcap));
                    if (pos != NULL)
                        x = vn_blend(hidden(pos[v], lo[v], k0 + j + a), vn_splat(MASKED), x);
                    top[v] = vn_max(x, top[v]);
                    vn_store(st + (j + a) * LANES_PER_TASK + v * VL, x);
                }
        }
}

/* ot[d0 .. d0 + R - 1] += the value rows' columns d0 .. times st, over keys j < nk, for
 * lane vectors v0 .. v0 + GROUP_VECS - 1 */
static inline __attribute__((always_inline)) void weigh_tile(
    const struct prefill *p, const float *const *values, int64_t nk, const float *st,
    float *ot, int64_t d0, int v0, const int R) {
    float *rows = ot + d0 * LANES_PER_TASK + v0 * VL;
    vn acc[DIM_ROWS][GROUP_VECS];
    for (int r = 0; r < R; r++)
        for (int v = 0; v < GROUP_VECS; v++)
            acc[r][v] = vn_load(rows + r * LANES_PER_TASK + v * VL);
    for (int64_t j = 0; j < nk; j++) {
        const float *row = st + j * LANES_PER_TASK + v0 * VL;
        vn pv[GROUP_VECS];
        for (int v = 0; v < GROUP_VECS; v++) pv[v] = vn_load(row + v * VL);
        for (int r = 0; r < R; r++) {
            const vn value = vn_splat(values[j][d0 + r]);
            for (int v = 0; v < GROUP_VECS; v++) acc[r][v] += value * pv[v];
        }
    }
    for (int r = 0; r < R; r++)
        for (int v = 0; v < GROUP_VECS; v++)
            vn_store(rows + r * LANES_PER_TASK + v * VL, acc[r][v]);
}

static void weigh(const struct prefill *p, const float *const *values, int64_t nk,
                  const float *st, float *ot) {
    for (int v0 = 0; v0 < VECS; v0 += GROUP_VECS) {
        int64_t d = 0;
        for (; d + DIM_ROWS <= p->head_dim; d += DIM_ROWS)
            weigh_tile(p, values, nk, st, ot, d, v0, DIM_ROWS);
        for (; d < p->head_dim; d++) weigh_tile(p, values, nk, st, ot, d, v0, 1);
    }
}

/* One task: gathers its rows into qt, runs the key tiles up to its last position,
 * writes its rows of out. scratch: qt, ot, st and KEYS key and value pointers. */
static void run_task(const struct prefill *p, struct task w, float *scratch) {
    const int64_t D = p->head_dim, L = LANES_PER_TASK, G = p->num_heads / p->num_kv_heads;
    float *qt = scratch, *ot = qt + D * L, *st = ot + D * L;
    const float **keys = (const float **)(st + KEYS * L), **values = keys + KEYS;
    const int64_t first = p->context - p->num_tokens; /* position of query token 0 */
    const int64_t tokens = p->num_tokens - w.t0 < p->tokens ? p->num_tokens - w.t0 : p->tokens;
    const int64_t heads = G - w.g0 < p->heads ? G - w.g0 : p->heads;
    /* each lane's position and first visible position; lanes without a row sit at 0 */
    vni pos[VECS], lo[VECS];
    for (int64_t i = 0; i < L; i++) {
        const int64_t g = i / p->tokens, t = i % p->tokens, used = g < heads && t < tokens;
        const float *row = p->q + (w.t0 + t) * p->q_stride + (w.kv_head * G + w.g0 + g) * D;
        for (int64_t d = 0; d < D; d++) qt[d * L + i] = used ? row[d] * p->scale : 0.0f;
        const int64_t at = used ? first + w.t0 + t : 0;
        pos[i / VL][i % VL] = (int32_t)at;
        lo[i / VL][i % VL] = p->window > 0 ? (int32_t)(at - p->window + 1) : 0;
    }
    memset(ot, 0, sizeof(float) * D * L);
    vn top[VECS], sum[VECS];
    for (int v = 0; v < VECS; v++) top[v] = vn_splat(MASKED), sum[v] = (vn){0};
    const int64_t last = first + w.t0 + tokens - 1; /* the furthest a row sees */
    /* the first key of the first row's window, and the last key every row's window holds */
    const int64_t begin = p->window > 0 && first + w.t0 >= p->window
                              ? first + w.t0 - p->window + 1 : 0;
    const int64_t shared_from = p->window > 0 ? last - p->window + 1 : 0;
    for (int64_t k0 = begin; k0 <= last; k0 += KEYS) {
        const int64_t reach = last + 1 - k0 < KEYS ? last + 1 - k0 : KEYS;
        const int64_t nk = (reach + KEY_ROWS - 1) / KEY_ROWS * KEY_ROWS;
        /* the tile's rows, walking the block table (no division per key); keys past
         * the last repeat it, masked below */
        int64_t block = k0 / p->block_size, slot = k0 % p->block_size;
        for (int64_t j = 0; j < nk; j++) {
            if (k0 + j <= last) {
                const int64_t at = (p->table[block] * p->block_size + slot) * p->num_kv_heads;
                keys[j] = p->k_cache + (at + w.kv_head) * p->head_dim;
                values[j] = p->v_cache + (at + w.kv_head) * p->head_dim;
                if (++slot == p->block_size) block++, slot = 0;
            } else {
                keys[j] = keys[j - 1], values[j] = values[j - 1];
            }
        }
        const int masked = k0 + nk - 1 > first + w.t0 || k0 < shared_from;
        vn tile_top[VECS], old_top[VECS], total[VECS];
        scores(p, keys, nk, qt, masked ? pos : NULL, lo, k0, st, tile_top);
        for (int v = 0; v < VECS; v++) {
            old_top[v] = top[v], top[v] = vn_max(tile_top[v], top[v]);
            total[v] = (vn){0};
        }
        /* probabilities row by row of st (in the order it lies in memory) */
        for (int64_t j = 0; j < nk; j++)
            for (int v = 0; v < VECS; v++) {
                float *s = st + j * L + v * VL;
                vn e = vn_exp(vn_load(s) - top[v]);
                if (masked) e = vn_blend(hidden(pos[v], lo[v], k0 + j), (vn){0}, e);
                vn_store(s, e);
                total[v] += e;
            }
        for (int v = 0; v < VECS; v++) {
            const vni rises = top[v] > old_top[v];
            int any = 0; /* the rows' sums so far scale by e^(old top - new top) */
            for (int t = 0; t < VL; t++) any |= rises[t];
            if (!any) {
                sum[v] += total[v];
                continue;
            }
            const vn alpha = vn_exp(old_top[v] - top[v]);
            sum[v] = sum[v] * alpha + total[v];
            for (int64_t d = 0; d < D; d++) {
                float *o = ot + d * L + v * VL;
                vn_store(o, vn_load(o) * alpha);
            }
        }
        weigh(p, values, nk, st, ot);
    }
    for (int64_t i = 0; i < heads * p->tokens; i++) {
        const int64_t g = i / p->tokens, t = i % p->tokens;
        if (t >= tokens) continue;
        float *row = p->out + (w.t0 + t) * p->out_stride + (w.kv_head * G + w.g0 + g) * D;
        const float inv = 1.0f / sum[i / VL][i % VL];
        for (int64_t d = 0; d < D; d++) row[d] = ot[d * L + i] * inv;
    }
}

/* window 0: full causal attention; softcap 0: no capping. Returns 0, or -1 when a
 * thread's scratch could not be allocated. */
int paged_prefill_f32(const float *q, int64_t q_stride, const float *k_cache,
                      const float *v_cache, const int32_t *block_table, int64_t num_tokens,
                      int64_t context, float *out, int64_t out_stride, int64_t num_heads,
                      int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale,
                      int64_t window, float softcap, int num_threads) {
    const int64_t G = num_heads / num_kv_heads, heads = G < LANES_PER_TASK ? G : LANES_PER_TASK;
    struct prefill p = {q, k_cache, v_cache, block_table, out, q_stride, out_stride,
                        num_tokens, context, num_heads, num_kv_heads, head_dim, block_size,
                        window, scale, softcap, heads, LANES_PER_TASK / heads};
    const int64_t tiles = (num_tokens + p.tokens - 1) / p.tokens;
    const int64_t parts = (G + heads - 1) / heads; /* tasks a group of query heads needs */
    const int64_t tasks = tiles * parts * num_kv_heads;
    const size_t floats = 2 * head_dim * LANES_PER_TASK + KEYS * LANES_PER_TASK;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (tasks > 1)
    {
        float *scratch = malloc(sizeof(float) * floats + 2 * KEYS * sizeof(float *));
        if (scratch == NULL) {
#pragma omp atomic write
            failed = 1;
        }
        /* the last token tiles see the most keys: they go first */
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < tasks; i++) {
            if (scratch == NULL) continue;
            const int64_t per_tile = parts * num_kv_heads;
            const int64_t tile = tiles - 1 - i / per_tile, rest = i % per_tile;
            struct task w = {rest / parts, rest % parts * heads, tile * p.tokens};
            run_task(&p, w, scratch);
        }
        free(scratch);
    }
    return failed ? -1 : 0;
}
