/* A decoder layer's decode step in C: a batch of sequences, one new token each.
 *
 * The layer runs as two calls, split where tensor parallelism all-reduces (the caller
 * sums `out` over the ranks between them):
 *
 *   h, residual --add+RMS norm--> x --qkv--> q, k, v --rotary(q, k)--> k, v into the
 *   cache slots --paged attention--> o --o proj--> out              (decode_attention_f32)
 *   h, residual --add+RMS norm--> x --gate_up--> silu(g) * u --down--> out (decode_mlp_f32)
 *
 * with residual_out = h + residual (h itself when residual is NULL, the first layer).
 * Without tensor parallelism nothing happens between the halves, and decode_layers_f32
 * runs every layer of the stack in one call.
 * The kernels are the ones the torch path calls one by one (cpu_gemm.c, cpu_ops.c,
 * attention/cpu_decode.c): the same arithmetic, without a Python call and a tensor per
 * op. Shapes are this rank's (tensor-parallel shards); every row is contiguous.
 */
#include <stdint.h>
#include <string.h>

#include "cpu_kernels.h"

/* what stays fixed for a layer: its norm weights, its projections packed into panels
 * (cpu_gemm.c), its caches and sizes */
struct decode_layer {
    const float *input_norm;
    const void *qkv, *o;
    const float *post_norm;
    const void *gate_up, *down;
    float *k_cache, *v_cache; /* [num_blocks, block_size, num_kv_heads, head_dim] */
    int64_t hidden, num_heads, num_kv_heads, head_dim, intermediate, block_size;
    int64_t qkv_format, o_format, gate_up_format, down_format; /* PANELS_* */
    float eps, scale;
    int64_t window; /* sliding window of the attention (0: none), as cpu_decode.c */
    float softcap;  /* score soft-capping (0: none) */
};

/* what a step sets: num_seqs tokens, their positions and cache slots, the sequences'
 * block tables and lengths (after this token), the rotary tables [max_pos, head_dim / 2]
 * and a scratch buffer of decode_scratch_floats() floats: first the GEMM's (panels
 * expanded per thread), then the activations */
struct decode_batch {
    const int64_t *positions, *slots;
    const float *cos, *sin;
    const int32_t *block_tables, *seq_lens;
    int64_t num_seqs, table_stride;
    float *scratch;
    int num_threads;
};

static int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

int64_t decode_scratch_floats(const struct decode_layer *l, int64_t num_seqs,
                              int num_threads) {
    const int64_t qkv = (l->num_heads + 2 * l->num_kv_heads) * l->head_dim;
    const int64_t attention = qkv + 2 * l->num_heads * l->head_dim;
    const int64_t mlp = 3 * l->intermediate;
    return gemm_scratch_floats(num_seqs, num_threads) +
           num_seqs * (l->hidden + max64(attention, mlp));
}

static void norm(const struct decode_layer *l, const struct decode_batch *b, const float *h,
                 const float *residual, const float *w, float *x, float *residual_out) {
    add_rms_norm_f32(h, residual, w, x, residual_out, b->num_seqs, l->hidden, l->eps,
                     b->num_threads);
    if (residual == NULL) memcpy(residual_out, h, sizeof(float) * b->num_seqs * l->hidden);
}

/* Returns 0, or -1 when the attention could not allocate its score buffers. */
int decode_attention_f32(const struct decode_layer *l, const struct decode_batch *b,
                         const float *h, const float *residual, float *out,
                         float *residual_out) {
    const int64_t B = b->num_seqs, H = l->hidden, D = l->head_dim;
    const int64_t q_width = l->num_heads * D, kv_width = l->num_kv_heads * D;
    const int64_t width = q_width + 2 * kv_width;
    float *g = b->scratch, *x = g + gemm_scratch_floats(B, b->num_threads);
    float *qkv = x + B * H, *q = qkv + B * width, *o = q + B * q_width;
    norm(l, b, h, residual, l->input_norm, x, residual_out);
    gemm_panel_f32(x, H, l->qkv, l->qkv_format, qkv, width, B, width, H, g, b->num_threads);
    rotary_f32(qkv, width, B, l->num_heads, D, b->positions, b->cos, b->sin, b->num_threads);
    rotary_f32(qkv + q_width, width, B, l->num_kv_heads, D, b->positions, b->cos, b->sin,
               b->num_threads);
    for (int64_t s = 0; s < B; s++) {
        const float *row = qkv + s * width;
        memcpy(q + s * q_width, row, sizeof(float) * q_width);
        memcpy(l->k_cache + b->slots[s] * kv_width, row + q_width, sizeof(float) * kv_width);
        memcpy(l->v_cache + b->slots[s] * kv_width, row + q_width + kv_width,
               sizeof(float) * kv_width);
    }
    if (paged_decode_f32(q, l->k_cache, l->v_cache, b->block_tables, b->seq_lens, o, B,
                         l->num_heads, l->num_kv_heads, D, l->block_size, b->table_stride,
                         l->scale, l->window, l->softcap, b->num_threads) != 0)
        return -1;
    gemm_panel_f32(o, q_width, l->o, l->o_format, out, H, B, H, q_width, g, b->num_threads);
    return 0;
}

void decode_mlp_f32(const struct decode_layer *l, const struct decode_batch *b, const float *h,
                    const float *residual, float *out, float *residual_out) {
    const int64_t B = b->num_seqs, H = l->hidden, I = l->intermediate;
    float *g = b->scratch, *x = g + gemm_scratch_floats(B, b->num_threads);
    float *gate_up = x + B * H, *act = gate_up + B * 2 * I;
    norm(l, b, h, residual, l->post_norm, x, residual_out);
    gemm_panel_f32(x, H, l->gate_up, l->gate_up_format, gate_up, 2 * I, B, 2 * I, H, g,
                   b->num_threads);
    silu_mul_f32(gate_up, 2 * I, act, B, I, b->num_threads);
    gemm_panel_f32(act, I, l->down, l->down_format, out, H, B, H, I, g, b->num_threads);
}

/* All n layers of a single-rank model on h [B, hidden], in place: h becomes the last
 * layer's output and residual [B, hidden] its residual stream, as n pairs of the calls
 * above would leave them; tmp holds 2 x B x hidden floats. Returns 0, or -1 as
 * decode_attention_f32. */
int decode_layers_f32(const struct decode_layer *layers, int64_t n, const struct decode_batch *b,
                      float *h, float *residual, float *tmp) {
    const int64_t size = b->num_seqs * layers[0].hidden;
    float *attended = tmp, *stream = tmp + size;
    for (int64_t i = 0; i < n; i++) {
        if (decode_attention_f32(layers + i, b, h, i == 0 ? NULL : residual, attended, stream))
            return -1;
        decode_mlp_f32(layers + i, b, attended, stream, h, residual);
    }
    return 0;
}
