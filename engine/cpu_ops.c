/* The decoder's element-wise float32 ops on CPU, one pass each (engine/ops.py).
 * Rows are split over the threads when there are enough of them to pay for it. */
#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "cpu_kernels.h"
#include "cpu_vec.h"

#define PARALLEL_ELEMENTS 32768

/* out[t] = r / sqrt(mean(r^2) + eps) * w with r = x[t] + residual[t], written to
 * sum[t], or r = x[t] when residual is NULL. Rows are contiguous, hidden floats each. */
void add_rms_norm_f32(const float *x, const float *residual, const float *w, float *out,
                      float *sum, int64_t rows, int64_t hidden, float eps, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) \
    if (rows * hidden >= PARALLEL_ELEMENTS)
    for (int64_t t = 0; t < rows; t++) {
        const float *r = x + t * hidden;
        if (residual != NULL) {
            const float *a = x + t * hidden, *b = residual + t * hidden;
            float *s = sum + t * hidden;
#pragma omp simd
            for (int64_t d = 0; d < hidden; d++) s[d] = a[d] + b[d];
            r = s;
        }
        float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
        for (int64_t d = 0; d < hidden; d++) squares += r[d] * r[d];
        float inv = 1.0f / sqrtf(squares / (float)hidden + eps);
        float *o = out + t * hidden;
#pragma omp simd
        for (int64_t d = 0; d < hidden; d++) o[d] = r[d] * inv * w[d];
    }
}

/* Rotate-half rotary in place: for each row t and head h of x (heads of head_dim floats,
 * contiguous within a row; rows row_stride floats apart), with c, s the tables' rows at
 * positions[t] ([head_dim / 2] each): x1, x2 -> x1 c - x2 s, x2 c + x1 s. */
void rotary_f32(float *x, int64_t row_stride, int64_t rows, int64_t heads, int64_t head_dim,
                const int64_t *positions, const float *cos, const float *sin, int num_threads) {
    const int64_t half = head_dim / 2;
#pragma omp parallel for schedule(static) num_threads(num_threads) \
    if (rows * heads * head_dim >= PARALLEL_ELEMENTS)
    for (int64_t t = 0; t < rows; t++) {
        const float *c = cos + positions[t] * half, *s = sin + positions[t] * half;
        for (int64_t h = 0; h < heads; h++) {
            float *a = x + t * row_stride + h * head_dim, *b = a + half;
#pragma omp simd
            for (int64_t i = 0; i < half; i++) {
                float x1 = a[i], x2 = b[i];
                a[i] = x1 * c[i] - x2 * s[i];
                b[i] = x2 * c[i] + x1 * s[i];
            }
        }
    }
}

/* out[t, i] = silu(g) * u with g = x[t, i], u = x[t, I + i] and silu(g) = g / (1 + e^-g);
 * rows of x are ldx floats apart, rows of out I. */
void silu_mul_f32(const float *x, int64_t ldx, float *out, int64_t rows, int64_t I,
                  int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) \
    if (rows * I >= PARALLEL_ELEMENTS)
    for (int64_t t = 0; t < rows; t++) {
        const float *g = x + t * ldx, *u = g + I;
        float *o = out + t * I;
        int64_t i = 0;
        for (; i + VL <= I; i += VL) vn_store(o + i, vn_silu_mul(vn_load(g + i), vn_load(u + i)));
        for (; i < I; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}

/* out[t] = the index of the largest of the cols floats of row t (rows ld floats apart):
 * the first one when several are equal, the first NaN when there is one (torch.argmax's
 * answers). One pass: each lane keeps its largest and where it was, by strict greater,
 * so the earliest of equals stays. */
void argmax_rows_f32(const float *x, int64_t ld, int64_t rows, int64_t cols, int64_t *out,
                     int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) \
    if (rows * cols >= 8 * PARALLEL_ELEMENTS)
    for (int64_t t = 0; t < rows; t++) {
        const float *row = x + t * ld;
        int64_t c = 0, best = 0;
        if (cols >= LANES) {
            vf top = load(row);
            vi at = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}, here = at, nan = {0};
            for (c = LANES; c + LANES <= cols; c += LANES) {
                const vf v = load(row + c);
                here += LANES;
                const vi greater = v > top;
                nan |= v != v;
                top = blend(greater, v, top);
                at = (vi)blend(greater, (vf)here, (vf)at);
            }
            nan |= top != top;
            int any_nan = 0;
            for (int l = 0; l < LANES; l++) any_nan |= nan[l];
            if (any_nan) {
                for (int64_t i = 0; i < cols; i++)
                    if (row[i] != row[i]) {
                        out[t] = i;
                        break;
                    }
                continue;
            }
            best = at[0];
            for (int l = 1; l < LANES; l++)
                if (top[l] > row[best] || (top[l] == row[best] && at[l] < best)) best = at[l];
        }
        for (; c < cols; c++) {
            if (row[c] != row[c]) {
                best = c;
                break;
            }
            if (row[c] > row[best]) best = c;
        }
        out[t] = best;
    }
}

/* out[t] = the index of the largest of the cols floats of row rows[t] of x (rows ld floats
 * apart) among the tokens its grammar allows: token c is allowed when bit c % 32 of word
 * c / 32 of bits[t] (words int32 per row) is set. The first of equals; NaN is never the
 * largest; a row whose allowed tokens are all -inf (or NaN) answers its first allowed
 * token, and a row that allows none answers -1. One pass over the allowed logits: a
 * 16-token block whose 16 bits are all clear is not read. */
void masked_argmax_f32(const float *x, int64_t ld, const int64_t *rows, int64_t n,
                       const int32_t *bits, int64_t words, int64_t cols, int64_t *out,
                       int num_threads) {
    const vi lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
#pragma omp parallel for schedule(static) num_threads(num_threads) \
    if (n * cols >= 8 * PARALLEL_ELEMENTS)
    for (int64_t t = 0; t < n; t++) {
        const float *row = x + rows[t] * ld;
        const uint32_t *b = (const uint32_t *)bits + t * words;
        const vf none = splat(-INFINITY);
        vf top = none;
        vi at = lane, here = lane - LANES;
        int64_t c = 0;
        for (; c + LANES <= cols; c += LANES) {
            here += LANES;
            const int32_t w = (int32_t)((b[c >> 5] >> (c & 31)) & 0xFFFF);
            if (w == 0) continue;
            const vi allowed = (((vi){0} + w) >> lane) & 1;
            const vf v = blend(allowed != 0, load(row + c), none);
            const vi greater = v > top;
            top = blend(greater, v, top);
            at = (vi)blend(greater, (vf)here, (vf)at);
        }
        int64_t best = -1;
        float best_value = -INFINITY;
        for (int l = 0; l < LANES; l++)
            if (top[l] > best_value || (top[l] == best_value && best >= 0 && at[l] < best)) {
                if (top[l] > -INFINITY) best = at[l], best_value = top[l];
            }
        for (; c < cols; c++)
            if ((b[c >> 5] >> (c & 31)) & 1 && row[c] > best_value) best = c, best_value = row[c];
        if (best < 0)
            for (c = 0; c < cols; c++)
                if ((b[c >> 5] >> (c & 31)) & 1) {
                    best = c;
                    break;
                }
        out[t] = best;
    }
}
