/* Paged decode over a latent / tied KV cache (MLA, GLA, GTA; absorbed form), float32
 * on CPU, read straight from the blocks.
 *
 * One query token per sequence. Cached token t of sequence b holds Hc latent heads of
 * dc floats and one RoPE key of dr floats; query head h = j * G + g (G = num_heads /
 * num_latent) reads latent head j:
 *     score[h, t] = scale * (q_c[b, h] . c[t, j, :dk] + q_r[b, h] . r[t])
 *     out[b, h]   = sum_t softmax_t(score[h]) * c[t, j, :dc]
 * for t < seq_lens[b] (dk <= dc: dk = dc / 2 for GTA). Token t sits at slot
 * t % block_size of block block_tables[b, t / block_size].
 *
 * Layouts: q_c [B, H, dk], q_r [B, H, dr], out [B, H, dc] contiguous. The caches are
 * strided views of one [layers, blocks, block_size, Hc * dc + dr] allocation: latent
 * head j of slot (blk, s) is dc floats at c_cache + blk * c_sb + s * c_st + j * c_sh,
 * its RoPE key dr floats at r_cache + blk * r_sb + s * r_st. dk, dc and dr are
 * multiples of 16; every seq_lens[b] >= 1.
 *
 * A task is one sequence, one latent head with all G of its query heads (each latent
 * row is read for the whole group) and one span of the context. With one span per
 * sequence a task writes its rows of out; with several, it writes partial sums with
 * their running max and total, and a last pass merges the spans of each query head.
 */
#include <math.h>
#include <stdlib.h>

#include "cpu_kernels.h"
#include "cpu_vec.h"

#define MIN_SPAN 256 /* tokens: shorter spans cost more to merge than they save */
#define MASKED (-1e30f)
#define WEIGH_TOKENS 16 /* tokens whose latent rows (2 KiB each at dc = 512) stay in L1 */

struct latent {
    const float *c, *r;
    const int32_t *tables;
    int64_t c_sb, c_st, c_sh, r_sb, r_st, table_stride, block_size;
    int64_t group, dk, dc, dr;
};

/* A span of one sequence's tokens for one latent head: c[l] and r[l] point at the
 * latent row (dc floats) and the RoPE key (dr floats) of its token l < len; score rows
 * are padded floats apart (len rounded up to LANES). */
struct span {
    int64_t len, padded;
    const float **c, **r;
};

/* the rows of tokens begin .. begin + w->len - 1 of sequence b, latent head j */
static void find_rows(const struct latent *L, int64_t b, int64_t j, int64_t begin,
                      struct span *w) {
    const int32_t *table = L->tables + b * L->table_stride;
    for (int64_t l = 0; l < w->len; l++) {
        const int64_t t = begin + l, block = table[t / L->block_size], slot = t % L->block_size;
        w->c[l] = L->c + block * L->c_sb + slot * L->c_st + j * L->c_sh;
        w->r[l] = L->r + block * L->r_sb + slot * L->r_st;
    }
}

/* scores[g] = scale * (q_c[g] . c[:dk] + q_r[g] . r) for the span's tokens, VL at a
 * time (one folded sum for the VL, cpu_vec.h's hsum_vl); q_c rows dk apart, q_r rows dr
 * apart. */
static void span_scores(const float *q_c, const float *q_r, const struct latent *L,
                        const struct span *w, float scale, float *scores) {
    for (int64_t l = 0; l < w->len; l += VL) {
        /* past the span, its token l again: those scores are masked later */
        const float *c[VL], *r[VL];
        for (int64_t t = 0; t < VL; t++) {
            const int64_t tok = l + (l + t < w->len ? t : 0);
            c[t] = w->c[tok], r[t] = w->r[tok];
        }
        for (int64_t g = 0; g < L->group; g++) {
            const float *qc = q_c + g * L->dk, *qr = q_r + g * L->dr;
            vn acc[VL];
            for (int t = 0; t < VL; t++) acc[t] = (vn){0};
            for (int64_t k = 0; k < L->dk; k += VL) {
                const vn q = vn_load(qc + k);
                for (int t = 0; t < VL; t++) acc[t] += q * vn_load(c[t] + k);
            }
            for (int64_t k = 0; k < L->dr; k += VL) {
                const vn q = vn_load(qr + k);
                for (int t = 0; t < VL; t++) acc[t] += q * vn_load(r[t] + k);
            }
            vn_store(scores + g * w->padded + l, hsum_vl(acc) * scale);
        }
    }
}

/* Each row's scores become e^(score - top) (zero past the span); top[g], total[g] their
 * max and sum. */
static void exp_rows(float *scores, const struct span *w, int64_t rows, float *top,
                     float *total) {
    for (int64_t g = 0; g < rows; g++) {
        float *row = scores + g * w->padded;
        for (int64_t l = w->len; l < w->padded; l++) row[l] = MASKED;
        vf most = load(row);
        for (int64_t l = LANES; l < w->padded; l += LANES)
            most = blend(load(row + l) > most, load(row + l), most);
        float m = most[0];
        for (int t = 1; t < LANES; t++) m = most[t] > m ? most[t] : m;
        vf sum = {0};
        for (int64_t l = 0; l < w->padded; l += LANES) {
            const vf e = vexp(load(row + l) - m);
            store(row + l, e);
            sum += e;
        }
        top[g] = m, total[g] = hsum(sum);
    }
}

/* Rows g0 .. g0 + R - 1 (weights p, padded apart) times the latent rows of tokens
 * l0 .. l1 - 1, over vectors k0 .. k0 + C - 1 of dc: R * C accumulators in registers,
 * added to out (set instead for the first tokens, l0 = 0). */
static inline __attribute__((always_inline)) void weigh_tile(
    const float *p, const struct latent *L, const struct span *w, int64_t l0, int64_t l1,
    int64_t k0, float *out, const int R, const int C) {
    vn acc[4][WEIGH_C];
    for (int i = 0; i < R; i++)
        for (int k = 0; k < C; k++)
            acc[i][k] = l0 ? vn_load(out + i * L->dc + (k0 + k) * VL) : (vn){0};
    for (int64_t l = l0; l < l1; l++) {
        const float *c = w->c[l] + k0 * VL;
        vn cv[WEIGH_C];
        for (int k = 0; k < C; k++) cv[k] = vn_load(c + k * VL);
        for (int i = 0; i < R; i++) {
            const vn pi = vn_splat(p[i * w->padded + l]);
            for (int k = 0; k < C; k++) acc[i][k] += pi * cv[k];
        }
    }
    for (int i = 0; i < R; i++)
        for (int k = 0; k < C; k++) vn_store(out + i * L->dc + (k0 + k) * VL, acc[i][k]);
}

#define WEIGH(R, C) \
    case WEIGH_C * ((R) - 1) + (C) - 1: weigh_tile(p, L, w, l0, l1, k0, o, R, C); break;

/* out[g] (rows dc apart) = sum over the span of weights[g, l] * c[l, :dc], WEIGH_TOKENS
 * tokens at a time (their latent rows stay in cache for all the tiles), in tiles of up
 * to 4 rows by WEIGH_C vectors */
static void weigh_latent(const float *weights, const struct latent *L, const struct span *w,
                         float *out) {
    const int64_t chunks = L->dc / VL;
    for (int64_t l0 = 0; l0 < w->len; l0 += WEIGH_TOKENS) {
        const int64_t l1 = l0 + WEIGH_TOKENS < w->len ? l0 + WEIGH_TOKENS : w->len;
        for (int64_t g = 0; g < L->group; g += 4)
            for (int64_t k0 = 0; k0 < chunks; k0 += WEIGH_C) {
                const float *p = weights + g * w->padded;
                float *o = out + g * L->dc;
                const int R = L->group - g < 4 ? (int)(L->group - g) : 4;
                const int C = chunks - k0 < WEIGH_C ? (int)(chunks - k0) : WEIGH_C;
                WEIGH_SWITCH(R, C)
            }
    }
}

/* out [dc] = one query head's partial sums over its spans merged by their maxima and
 * totals: span s's sum is dc floats at o + s * stride * dc, its max and total at
 * top[s * stride] and total[s * stride] (total 0: a span past the sequence, skipped) */
static void merge_spans(const float *o, const float *top, const float *total, int64_t spans,
                        int64_t stride, int64_t dc, float *out) {
    float m = -INFINITY;
    for (int64_t s = 0; s < spans; s++)
        if (total[s * stride] > 0 && top[s * stride] > m) m = top[s * stride];
    float sum = 0;
    for (int64_t k = 0; k < dc; k += LANES) store(out + k, (vf){0});
    for (int64_t s = 0; s < spans; s++) {
        if (total[s * stride] == 0) continue;
        const float f = expf(top[s * stride] - m);
        sum += f * total[s * stride];
        for (int64_t k = 0; k < dc; k += LANES)
            store(out + k, load(out + k) + splat(f) * load(o + s * stride * dc + k));
    }
    const vf inv = splat(1.0f / sum);
    for (int64_t k = 0; k < dc; k += LANES) store(out + k, load(out + k) * inv);
}

/* Returns 0, or -1 when a buffer could not be allocated. */
int paged_latent_decode_f32(const float *q_c, const float *q_r, const float *c_cache,
                            int64_t c_sb, int64_t c_st, int64_t c_sh, const float *r_cache,
                            int64_t r_sb, int64_t r_st, const int32_t *block_tables,
                            int64_t table_stride, const int32_t *seq_lens, float *out,
                            int64_t num_seqs, int64_t num_heads, int64_t num_latent,
                            int64_t dk, int64_t dc, int64_t dr, int64_t block_size, float scale,
                            int num_threads) {
    const struct latent L = {c_cache, r_cache, block_tables, c_sb, c_st, c_sh, r_sb, r_st,
                             table_stride, block_size, num_heads / num_latent, dk, dc, dr};
    int64_t max_len = 0;
    for (int64_t b = 0; b < num_seqs; b++) max_len = seq_lens[b] > max_len ? seq_lens[b] : max_len;
    /* spans per sequence: about two tasks per thread, none shorter than MIN_SPAN */
    const int64_t pairs = num_seqs * num_latent;
    int64_t spans = (2 * num_threads + pairs - 1) / pairs;
    const int64_t most = (max_len + MIN_SPAN - 1) / MIN_SPAN;
    spans = spans < most ? spans : most;
    spans = spans < 1 ? 1 : spans;
    int64_t span_len = (max_len + spans - 1) / spans;
    span_len = (span_len + LANES - 1) / LANES * LANES;
    spans = (max_len + span_len - 1) / span_len;

    /* partial sums [pairs, spans, G, dc] (several spans only), maxima and totals
     * [pairs, spans, G]: a task's rows are together, a query head's spans G rows apart.
     * With one span, the row of query head h of sequence b is b * H + h, as in out. */
    const int64_t rows = pairs * spans * L.group;
    float *part = spans > 1 ? malloc(sizeof(float) * rows * dc) : NULL;
    float *stats = malloc(sizeof(float) * 2 * rows);
    if ((spans > 1 && part == NULL) || stats == NULL) {
        free(part), free(stats);
        return -1;
    }
    int failed = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t i = 0; i < pairs * spans; i++) {
        const int64_t pair = i / spans, s = i % spans;
        const int64_t begin = s * span_len, left = seq_lens[pair / num_latent] - begin;
        const int64_t len = left < span_len ? left : span_len;
        float *top = stats + i * L.group, *total = stats + rows + i * L.group;
        if (len <= 0) {
            for (int64_t g = 0; g < L.group; g++) total[g] = 0;
            continue;
        }
        struct span w = {len, (len + LANES - 1) / LANES * LANES, NULL, NULL};
        w.c = malloc(sizeof(float *) * 2 * len);
        float *scores = malloc(sizeof(float) * L.group * w.padded);
        if (w.c == NULL || scores == NULL) {
            free(w.c), free(scores);
#pragma omp atomic write
            failed = 1;
            continue;
        }
        w.r = w.c + len;
        find_rows(&L, pair / num_latent, pair % num_latent, begin, &w);
        const int64_t head = pair * L.group; /* b * H + j * G */
        float *o = spans > 1 ? part + i * L.group * dc : out + head * dc;
        span_scores(q_c + head * dk, q_r + head * dr, &L, &w, scale, scores);
        exp_rows(scores, &w, L.group, top, total);
        weigh_latent(scores, &L, &w, o);
        free(w.c), free(scores);
        for (int64_t g = 0; spans == 1 && g < L.group; g++) {
            const vf inv = splat(1.0f / total[g]);
            for (int64_t k = 0; k < dc; k += LANES)
                store(o + g * dc + k, load(o + g * dc + k) * inv);
        }
    }
    if (spans > 1 && !failed) {
#pragma omp parallel for schedule(static) num_threads(num_threads)
        for (int64_t h = 0; h < num_seqs * num_heads; h++) {
            const int64_t first = h / L.group * spans * L.group + h % L.group;
            merge_spans(part + first * dc, stats + first, stats + rows + first, spans, L.group,
                        dc, out + h * dc);
        }
    }
    free(part), free(stats);
    return failed ? -1 : 0;
}
