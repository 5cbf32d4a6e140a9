/* Paged decode attention for float32 on CPU, read straight from the KV blocks.
 *
 * One query token per sequence, at position seq_lens[b] - 1. For sequence b and KV
 * head h, the query heads h * G .. h * G + G - 1 (G = num_heads / num_kv_heads) attend
 * to the cached tokens start .. seq_lens[b] - 1 of b, where start is 0, or with a
 * sliding window (window > 0) max(0, seq_lens[b] - window): the last window tokens,
 * the query's own included. Token l sits at slot l % block_size of block
 * block_tables[b, l / block_size]; nothing before start is read, so the table entries
 * of blocks wholly before it may name any block (freed ones included). With
 * softcap > 0 each score s = scale * q . k becomes softcap * tanh(s / softcap) before
 * the softmax. A task is one sequence and a run of its KV heads: it reads each key and
 * value row once, for all G query heads, with no gathered copy.
 *
 * Layouts (contiguous): q, out [B, num_heads, head_dim]; k_cache, v_cache
 * [num_blocks, block_size, num_kv_heads, head_dim]; block_tables rows of
 * table_stride int32; seq_lens [B] int32, each >= 1. head_dim is a multiple of 16.
 */
#include <stdlib.h>

#include "cpu_kernels.h"
#include "cpu_vec.h"

struct shape {
    int64_t num_heads, num_kv_heads, head_dim, block_size, group;
};

/* A task: one sequence's KV heads h0 .. h0 + heads - 1, i.e. its query rows
 * r = (h - h0) * group + g, each of them [head_dim] in q and out, [padded] in scores
 * (score l belongs to token start + l). Both passes walk the task's len tokens from
 * start in order through the blocks. */
struct task {
    const int32_t *table;
    int64_t start, len, padded, h0, heads;
};

/* A place in a task's walk through its tokens: block (index into the table) and slot;
 * row_at gives that token's row for KV head h0 in the cache. */
struct cursor {
    const float *cache;
    int64_t block, slot;
};

static inline const float *row_at(struct cursor c, struct shape s, struct task w) {
    return c.cache + ((w.table[c.block] * s.block_size + c.slot) * s.num_kv_heads + w.h0) *
                         s.head_dim;
}

/* Pulls the rows of heads h0 .. h0 + heads - 1 of the token one block after c (same
 * slot) toward L2: the blocks of a sequence lie anywhere in the cache, so the hardware
 * prefetcher, which follows addresses, stops at every block's end. */
static inline void prefetch_next_block(struct cursor c, struct shape s, struct task w,
                                       int64_t first, int64_t bytes) {
    if ((c.block + 1) * s.block_size >= w.start + w.len) return;
    c.block++;
    const char *row = (const char *)(row_at(c, s, w) + first);
    for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(row + off, 0, 2);
}

static inline void advance(struct cursor *c, struct shape s) {
    if (++c->slot == s.block_size) c->slot = 0, c->block++;
}

static inline struct cursor first_token(const float *cache, struct shape s, struct task w) {
    return (struct cursor){cache, w.start / s.block_size, w.start % s.block_size};
}

/* scores: scale * q . k (soft-capped when softcap > 0), VL tokens at a time (one
 * folded sum for the VL, cpu_vec.h's hsum_vl), then the softmax over the first len of
 * each row. */
static void softmax_scores(const float *q, const float *k_cache, struct shape s, struct task w,
                           float scale, float softcap, float *scores) {
    const int64_t chunks = s.head_dim / VL, rows = w.heads * s.group;
    struct cursor at = first_token(k_cache, s, w);
    for (int64_t l = 0; l < w.len; l += VL) {
        /* past the length, token l's row again: its scores are masked below */
        const float *k[VL];
        for (int64_t t = 0; t < VL; t++)
            if (l + t < w.len) {
                k[t] = row_at(at, s, w);
                prefetch_next_block(at, s, w, 0, w.heads * s.head_dim * 4);
                advance(&at, s);
            } else {
                k[t] = k[0];
            }
        for (int64_t r = 0; r < rows; r++) {
            const float *qr = q + r * s.head_dim;
            const int64_t head = r / s.group * s.head_dim;
            vn acc[VL];
            for (int t = 0; t < VL; t++) acc[t] = (vn){0};
            for (int64_t c = 0; c < chunks; c++) {
                const vn qc = vn_load(qr + c * VL);
                for (int t = 0; t < VL; t++) acc[t] += qc * vn_load(k[t] + head + c * VL);
            }
            vn x = hsum_vl(acc) * scale;
            if (softcap > 0.0f) x = softcap * vn_tanh(x * (1.0f / softcap));
            vn_store(scores + r * w.padded + l, x);
        }
    }
    for (int64_t r = 0; r < rows; r++) {
        float *row = scores + r * w.padded;
        for (int64_t l = w.len; l < w.padded; l++) row[l] = -1e30f; /* e^-87: adds nothing */
        vf top_lanes = load(row);
        for (int64_t l = LANES; l < w.padded; l += LANES)
            top_lanes = blend(load(row + l) > top_lanes, load(row + l), top_lanes);
        float top = top_lanes[0];
        for (int t = 1; t < LANES; t++) top = top_lanes[t] > top ? top_lanes[t] : top;
        vf sum = {0};
        for (int64_t l = 0; l < w.padded; l += LANES) {
            vf e = vexp(load(row + l) - top);
            store(row + l, e);
            sum += e;
        }
        vf inv = splat(1.0f / hsum(sum));
        for (int64_t l = 0; l < w.padded; l += LANES) store(row + l, load(row + l) * inv);
    }
}

/* Rows r0 .. r0 + R - 1 of one KV head (their probabilities p, padded apart) times its
 * value rows, over vectors c0 .. c0 + C - 1 of head_dim: R * C accumulators in
 * registers across all the tokens. */
static inline __attribute__((always_inline)) void weigh_tile(
    const float *p, const float *v_cache, struct shape s, struct task w, int64_t head,
    int64_t c0, float *out, const int R, const int C) {
    vn acc[4][WEIGH_C];
    for (int i = 0; i < R; i++)
        for (int c = 0; c < C; c++) acc[i][c] = (vn){0};
    struct cursor at = first_token(v_cache, s, w);
    for (int64_t l = 0; l < w.len; l++, advance(&at, s)) {
        const float *v = row_at(at, s, w) + head * s.head_dim + c0 * VL;
        prefetch_next_block(at, s, w, head * s.head_dim + c0 * VL, C * VL * 4);
        vn vv[WEIGH_C];
        for (int c = 0; c < C; c++) vv[c] = vn_load(v + c * VL);
        for (int i = 0; i < R; i++) {
            const vn pi = vn_splat(p[i * w.padded + l]);
            for (int c = 0; c < C; c++) acc[i][c] += pi * vv[c];
        }
    }
    for (int i = 0; i < R; i++)
        for (int c = 0; c < C; c++) vn_store(out + i * s.head_dim + (c0 + c) * VL, acc[i][c]);
}

#define WEIGH(R, C) \
    case WEIGH_C * ((R) - 1) + (C) - 1: weigh_tile(p, v_cache, s, w, head, c0, o, R, C); break;

/* out: each row's probabilities times the value rows of its KV head, in tiles of up to
 * 4 rows by WEIGH_C vectors */
static void weigh_values(const float *scores, const float *v_cache, struct shape s,
                         struct task w, float *out) {
    const int64_t chunks = s.head_dim / VL;
    for (int64_t head = 0; head < w.heads; head++)
        for (int64_t g = 0; g < s.group; g += 4)
            for (int64_t c0 = 0; c0 < chunks; c0 += WEIGH_C) {
                const int64_t r = head * s.group + g;
                const float *p = scores + r * w.padded;
                float *o = out + r * s.head_dim;
                const int R = s.group - g < 4 ? (int)(s.group - g) : 4;
                const int C = chunks - c0 < WEIGH_C ? (int)(chunks - c0) : WEIGH_C;
                WEIGH_SWITCH(R, C)
            }
}

/* window 0: full causal attention; softcap 0: no capping. Returns 0, or -1 when a
 * score buffer could not be allocated. */
int paged_decode_f32(const float *q, const float *k_cache, const float *v_cache,
                     const int32_t *block_tables, const int32_t *seq_lens, float *out,
                     int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                     int64_t head_dim, int64_t block_size, int64_t table_stride, float scale,
                     int64_t window, float softcap, int num_threads) {
    struct shape s = {num_heads, num_kv_heads, head_dim, block_size, num_heads / num_kv_heads};
    /* whole sequences per task when they keep every thread busy, else one KV head each */
    const int64_t per_task = num_seqs >= 2 * num_threads ? num_kv_heads : 1;
    const int64_t tasks = num_seqs * (num_kv_heads / per_task);
    int failed = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t i = 0; i < tasks; i++) {
        const int64_t b = i * per_task / num_kv_heads, seq_len = seq_lens[b];
        const int64_t start = window > 0 && seq_len > window ? seq_len - window : 0;
        const int64_t len = seq_len - start;
        struct task w = {block_tables + b * table_stride, start, len,
                         (len + LANES - 1) / LANES * LANES, i * per_task % num_kv_heads,
                         per_task};
        float *scores = malloc(sizeof(float) * per_task * s.group * w.padded);
        if (scores == NULL) {
#pragma omp atomic write
            failed = 1;
            continue;
        }
        int64_t first = (b * num_heads + w.h0 * s.group) * head_dim;
        softmax_scores(q + first, k_cache, s, w, scale, softcap, scores);
        weigh_values(scores, v_cache, s, w, out + first);
        free(scores);
    }
    return failed ? -1 : 0;
}
