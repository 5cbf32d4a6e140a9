/* Paged decode attention for float32 on CPU, read straight from the KV blocks.
 *
 * One query token per sequence. For sequence b and KV head h, the query heads
 * h * G .. h * G + G - 1 (G = num_heads / num_kv_heads) attend to the first
 * seq_lens[b] cached tokens of b; token l sits at slot l % block_size of block
 * block_tables[b, l / block_size]. A task is one sequence and a run of its KV heads:
 * it reads each key and value row once, for all G query heads, with no gathered copy.
 *
 * Layouts (contiguous): q, out [B, num_heads, head_dim]; k_cache, v_cache
 * [num_blocks, block_size, num_kv_heads, head_dim]; block_tables rows of
 * table_stride int32; seq_lens [B] int32, each >= 1. head_dim is a multiple of 16.
 */
#include <stdlib.h>

#include "cpu_kernels.h"
#include "cpu_vec.h"

/* e^x for x <= 0, lane-wise (Cephes' expf: x = n ln2 + r, a degree-6 polynomial in
 * r, times 2^n); within 2 ulp of expf. */
static inline vf exp_nonpositive(vf x) {
    vi low = x < splat(-87.0f);
    x = (vf)(((vi)x & ~low) | ((vi)splat(-87.0f) & low));
    vi n = __builtin_convertvector(x * 1.44269504088896341f - 0.5f, vi); /* round, x <= 0 */
    vf nf = __builtin_convertvector(n, vf);
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

struct shape {
    int64_t num_heads, num_kv_heads, head_dim, block_size, group;
};

/* A task: one sequence's KV heads h0 .. h0 + heads - 1, i.e. its query rows
 * r = (h - h0) * group + g, each of them [head_dim] in q and out, [padded] in scores.
 * Both passes walk the blocks in order and, in a block, each token's rows for all the
 * task's heads: contiguous memory the prefetcher follows. */
struct task {
    const int32_t *table;
    int64_t len, padded, h0, heads;
};

static inline const float *block_rows(const float *cache, struct shape s, struct task w,
                                      int64_t j) {
    return cache + (w.table[j] * s.block_size * s.num_kv_heads + w.h0) * s.head_dim;
}

/* scores: scale * q . k, then the softmax over the first len of each row. */
static void softmax_scores(const float *q, const float *k_cache, struct shape s, struct task w,
                           float scale, float *scores) {
    const int64_t token_stride = s.num_kv_heads * s.head_dim, chunks = s.head_dim / LANES;
    const int64_t rows = w.heads * s.group;
    for (int64_t l = 0, j = 0; l < w.len; j++) {
        const float *k = block_rows(k_cache, s, w, j);
        for (int64_t t = 0; t < s.block_size && l < w.len; t++, l++, k += token_stride) {
            for (int64_t r = 0; r < rows; r++) {
                const float *qr = q + r * s.head_dim, *kr = k + r / s.group * s.head_dim;
                vf acc = {0}, acc2 = {0}; /* two chains of FMAs */
                int64_t c = 0;
                for (; c + 2 <= chunks; c += 2) {
                    acc += load(qr + c * LANES) * load(kr + c * LANES);
                    acc2 += load(qr + (c + 1) * LANES) * load(kr + (c + 1) * LANES);
                }
                if (c < chunks) acc += load(qr + c * LANES) * load(kr + c * LANES);
                scores[r * w.padded + l] = hsum(acc + acc2) * scale;
            }
        }
    }
    for (int64_t r = 0; r < rows; r++) {
        float *row = scores + r * w.padded, top = row[0];
        for (int64_t l = 1; l < w.len; l++) top = row[l] > top ? row[l] : top;
        for (int64_t l = w.len; l < w.padded; l++) row[l] = -1e30f; /* e^-87: adds nothing */
        vf sum = {0};
        for (int64_t l = 0; l < w.padded; l += LANES) {
            vf e = exp_nonpositive(load(row + l) - top);
            store(row + l, e);
            sum += e;
        }
        vf inv = splat(1.0f / hsum(sum));
        for (int64_t l = 0; l < w.padded; l += LANES) store(row + l, load(row + l) * inv);
    }
}

/* out: each row's probabilities times the value rows of its KV head. */
static void weigh_values(const float *scores, const float *v_cache, struct shape s,
                         struct task w, float *out) {
    const int64_t token_stride = s.num_kv_heads * s.head_dim, chunks = s.head_dim / LANES;
    const int64_t rows = w.heads * s.group, ts = token_stride;
    memset(out, 0, sizeof(float) * rows * s.head_dim);
    for (int64_t l = 0, j = 0; l < w.len; j++) {
        const float *v = block_rows(v_cache, s, w, j);
        int64_t n = s.block_size < w.len - l ? s.block_size : w.len - l, t = 0;
        /* four tokens at a time: one load and store of the output per four rows */
        for (; t + 4 <= n; t += 4, v += 4 * ts) {
            for (int64_t r = 0; r < rows; r++) {
                const float *p = scores + r * w.padded + l + t, *vr = v + r / s.group * s.head_dim;
                float *o = out + r * s.head_dim;
                for (int64_t c = 0; c < chunks; c++) {
                    const float *vc = vr + c * LANES;
                    vf a = load(vc) * p[0] + load(vc + ts) * p[1];
                    vf b = load(vc + 2 * ts) * p[2] + load(vc + 3 * ts) * p[3];
                    store(o + c * LANES, load(o + c * LANES) + (a + b));
                }
            }
        }
        for (; t < n; t++, v += ts) {
            for (int64_t r = 0; r < rows; r++) {
                const float *vr = v + r / s.group * s.head_dim;
                float p = scores[r * w.padded + l + t], *o = out + r * s.head_dim;
                for (int64_t c = 0; c < chunks; c++)
                    store(o + c * LANES, load(o + c * LANES) + load(vr + c * LANES) * p);
            }
        }
        l += n;
    }
}

/* Returns 0, or -1 when a score buffer could not be allocated. */
int paged_decode_f32(const float *q, const float *k_cache, const float *v_cache,
                     const int32_t *block_tables, const int32_t *seq_lens, float *out,
                     int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                     int64_t head_dim, int64_t block_size, int64_t table_stride, float scale,
                     int num_threads) {
    struct shape s = {num_heads, num_kv_heads, head_dim, block_size, num_heads / num_kv_heads};
    /* whole sequences per task when they keep every thread busy, else one KV head each */
    const int64_t per_task = num_seqs >= 2 * num_threads ? num_kv_heads : 1;
    const int64_t tasks = num_seqs * (num_kv_heads / per_task);
    int failed = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t i = 0; i < tasks; i++) {
        int64_t b = i * per_task / num_kv_heads, len = seq_lens[b];
        struct task w = {block_tables + b * table_stride, len, (len + LANES - 1) / LANES * LANES,
                         i * per_task % num_kv_heads, per_task};
        float *scores = malloc(sizeof(float) * per_task * s.group * w.padded);
        if (scores == NULL) {
#pragma omp atomic write
            failed = 1;
            continue;
        }
        int64_t first = (b * num_heads + w.h0 * s.group) * head_dim;
        softmax_scores(q + first, k_cache, s, w, scale, scores);
        weigh_values(scores, v_cache, s, w, out + first);
        free(scores);
    }
    return failed ? -1 : 0;
}
