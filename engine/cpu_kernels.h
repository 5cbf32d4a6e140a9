/* The float32 CPU kernels that call one another across files (engine/native.py builds
 * them into one library); each is documented where it is defined. */
#ifndef PDSERVE_CPU_KERNELS_H
#define PDSERVE_CPU_KERNELS_H

#include <stdint.h>

#include "cpu_vec.h"

/* the layouts of cpu_gemm.c's panels */
enum { PANELS_F32, PANELS_Q4, PANELS_Q8 };

/* a panel's width in native vectors (cpu_vec.h's VL floats each): 3 x 16 columns with
 * AVX-512 (amx_gemm.c reads the same panels as three 16-column tiles), 4 x 8 with AVX2
 * (one row streaming a panel keeps four chains of multiply-adds in flight) */
#if VL == 16
#define PANEL_VECS 3
#else
#define PANEL_VECS 4
#endif
#define GEMM_PANEL (PANEL_VECS * VL)

/* Value tiles of the decode attention kernels (attention/cpu_decode.c, cpu_latent.c): up
 * to 4 rows by WEIGH_C native vectors, 16 accumulators with AVX-512, 8 with AVX2 (whose
 * 16 registers also hold the value vectors and a broadcast). WEIGH_SWITCH(R, C) runs
 * the including file's WEIGH(r, c) for the tile of R rows and C vectors, r and c
 * constants in each case. */
#if VL == 16
#define WEIGH_C 4
#else
#define WEIGH_C 2
#endif
#if WEIGH_C == 4
#define WEIGH_WIDE WEIGH(1, 3) WEIGH(1, 4) WEIGH(2, 3) WEIGH(2, 4) WEIGH(3, 3) WEIGH(3, 4) \
                   WEIGH(4, 3) WEIGH(4, 4)
#else
#define WEIGH_WIDE
#endif
#define WEIGH_SWITCH(R, C)                                                                 \
    switch (WEIGH_C * ((R) - 1) + (C) - 1) {                                              \
        WEIGH(1, 1) WEIGH(1, 2) WEIGH(2, 1) WEIGH(2, 2) WEIGH(3, 1) WEIGH(3, 2) WEIGH(4, 1) \
        WEIGH(4, 2) WEIGH_WIDE                                                            \
    }

/* the ISA this library was compiled for: "avx2", "avx512" or "amx" (cpu_vec.h) */
const char *kernels_isa(void);

/* scratch: gemm_scratch_floats(M, num_threads) floats */
void gemm_panel_f32(const float *x, int64_t ldx, const void *panels, int format, float *y,
                    int64_t ldy, int64_t M, int64_t N, int64_t K, float *scratch,
                    int num_threads);

/* y[M, I] = silu(x @ Wg^T) * (x @ Wu^T), lane-wise as silu_mul_f32, where the panels
 * hold [Wg; Wu] (2 I rows, I a multiple of gemm_panel_width()): the gate and up panels
 * of each column run are computed in turn (the tiled path, for any M) and only their
 * product is stored; equal bit for bit to gemm_panel_f32 then silu_mul_f32. scratch:
 * gemm_scratch_floats(M, num_threads) floats */
void gemm_silu_mul_f32(const float *x, int64_t ldx, const void *panels, int format, float *y,
                       int64_t ldy, int64_t M, int64_t I, int64_t K, float *scratch,
                       int num_threads);

int64_t gemm_scratch_floats(int64_t M, int num_threads);

int64_t gemm_panel_bytes(int format, int64_t K);

void add_rms_norm_f32(const float *x, const float *residual, const float *w, float *out,
                      float *sum, int64_t rows, int64_t hidden, float eps, int num_threads);

void silu_mul_f32(const float *x, int64_t ldx, float *out, int64_t rows, int64_t I,
                  int num_threads);

void argmax_rows_f32(const float *x, int64_t ld, int64_t rows, int64_t cols, int64_t *out,
                     int num_threads);

void masked_argmax_f32(const float *x, int64_t ld, const int64_t *rows, int64_t n,
                       const int32_t *bits, int64_t words, int64_t cols, int64_t *out,
                       int num_threads);

void rotary_f32(float *x, int64_t row_stride, int64_t rows, int64_t heads, int64_t head_dim,
                const int64_t *positions, const float *cos, const float *sin, int num_threads);

int paged_decode_f32(const float *q, const float *k_cache, const float *v_cache,
                     const int32_t *block_tables, const int32_t *seq_lens, float *out,
                     int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                     int64_t head_dim, int64_t block_size, int64_t table_stride, float scale,
                     int64_t window, float softcap, int num_threads);

int paged_prefill_f32(const float *q, int64_t q_stride, const float *k_cache,
                      const float *v_cache, const int32_t *block_table, int64_t num_tokens,
                      int64_t context, float *out, int64_t out_stride, int64_t num_heads,
                      int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale,
                      int64_t window, float softcap, int num_threads);

#endif
