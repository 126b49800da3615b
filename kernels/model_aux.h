/* Small CUDA helpers of the GPU forward pass (engine/gpu/model_cuda_fwd.c) that the kernel
 * families of kernels.h do not cover: type conversion, bias broadcast, row gather, and a
 * plain paged attention for the shapes the tuned kernels reject (head_dim other than
 * 64/128/256, or more than 8 query heads per KV head). Same conventions as kernels.h:
 * asynchronous on `stream`, the launch status returned as a cudaError_t value. */
#ifndef M40_MODEL_AUX_H
#define M40_MODEL_AUX_H

#include <stdint.h>

#include "kernels.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Launch switches for every kernel family, set by the engine once per GPU model load
 * from its tuning switches (engine/util/tuning.h; no getenv in kernels/): pdl 0 turns
 * programmatic dependent launch off, clusters 0 the decode attention's thread block
 * clusters (both apply from compute capability 9 only), head_split 0 the clustered
 * decode attention's block a query head at small batches (attn_decode.cu). All on until
 * set. */
void m40k_set_launch_tuning(int pdl, int clusters, int head_split);

/* y[i] = f16(x[i]), i < n. */
int m40k_f32_to_f16(const float *x, uint16_t *y, int64_t n, m40k_stream stream);

/* y[r*y_stride + c] += bias[c], r < rows, c < cols. */
int m40k_add_bias(float *y, int64_t y_stride, const float *bias, int rows, int cols, m40k_stream stream);

/* dst[i*dst_stride + d] = src[rows[i]*src_stride + d], i < n, d < dim. */
int m40k_gather_rows(float *dst, int64_t dst_stride, const float *src, int64_t src_stride, const int32_t *rows,
                     int n, int dim, m40k_stream stream);

/* Causal attention over the paged cache for any head_dim <= 512 and any group size:
 * query row i belongs to sequence row_seq[i] and sits at position row_pos[i]; it
 * attends to positions 0..row_pos[i] of that sequence's pages (CSR indptr/indices,
 * layout [block][kv_head][16][head_dim] F16). One block of 128 threads per (row, head),
 * online softmax over chunks of 128 positions. Slow but shape-agnostic. The CPU twins of
 * this file's kernels are in kernels/ref/cpu_ref.c (m40_ref_attn_generic_window, ...),
 * compared in tests/gpu/test_gemma_kernels.cu. */
int m40k_attn_generic(float *out, int64_t out_stride, const float *q, int64_t q_stride, const int32_t *row_seq,
                      const int32_t *row_pos, int n_rows, const uint16_t *k_cache, const uint16_t *v_cache,
                      const int32_t *indptr, const int32_t *indices, int n_heads, int n_kv_heads, int head_dim,
                      float scale, m40k_stream stream);

/* m40k_attn_generic with a sliding window: row i attends to positions
 * max(0, row_pos[i]-window+1)..row_pos[i]; window 0 = no window. softcap > 0: each score
 * s = scale * q.k becomes softcap * tanh(s / softcap) before the softmax (Gemma 2's
 * attn_logit_softcapping); 0 = none, < 0 refused. m40k_attn_generic is this with 0, 0. */
int m40k_attn_generic_window(float *out, int64_t out_stride, const float *q, int64_t q_stride,
                             const int32_t *row_seq, const int32_t *row_pos, int n_rows, const uint16_t *k_cache,
                             const uint16_t *v_cache, const int32_t *indptr, const int32_t *indices, int n_heads,
                             int n_kv_heads, int head_dim, float scale, int window, float softcap,
                             m40k_stream stream);
/* m40k_attn_generic_window with attention sinks (gpt-oss): sinks[h] (NULL: none, then
 * exactly m40k_attn_generic_window) is one more logit in head h's softmax, compared with
 * the scaled (and capped) scores as it is, with no value behind it:
 * out = sum_t exp(s_t) v_t / (exp(sinks[h]) + sum_t exp(s_t)). Twin:
 * m40_ref_attn_generic_sinks. */
int m40k_attn_generic_sinks(float *out, int64_t out_stride, const float *q, int64_t q_stride, const int32_t *row_seq,
                            const int32_t *row_pos, int n_rows, const uint16_t *k_cache, const uint16_t *v_cache,
                            const int32_t *indptr, const int32_t *indices, int n_heads, int n_kv_heads, int head_dim,
                            float scale, int window, float softcap, const float *sinks, m40k_stream stream);

/* Per-head RMSNorm in place (Gemma 3's Q/K norms): for row r < rows and head h <
 * n_heads, the head_dim values at x + r*x_stride + h*head_dim become
 * v / sqrt(mean(v^2) + eps) * w (w: head_dim weights shared by all heads). */
int m40k_rmsnorm_heads(float *x, int64_t x_stride, int n_heads, int head_dim, const float *w, int rows, float eps,
                       m40k_stream stream);
/* Q's and K's per-head RMSNorms in one launch, where K's heads follow Q's in the row (a
 * qkv row: q at x, k at x + n_q_heads * head_dim): m40k_rmsnorm_heads(x, .., n_q_heads,
 * .., wq) and m40k_rmsnorm_heads(x + n_q_heads * head_dim, .., n_k_heads, .., wk), the
 * same values; launched as the decode chain's kernels are (programmatic dependent
 * launch where on). Twin: m40_ref_rmsnorm_heads twice. */
int m40k_rmsnorm_qk(float *x, int64_t x_stride, int n_q_heads, int n_k_heads, int head_dim, const float *wq,
                    const float *wk, int rows, float eps, m40k_stream stream);

/* x[i] *= s, i < n (Gemma's embedding scale sqrt(n_embd)). */
int m40k_scale(float *x, int64_t n, float s, m40k_stream stream);

/* x[i] = cap * tanh(x[i] / cap), i < n (final logit soft-capping). */
int m40k_softcap(float *x, int64_t n, float cap, m40k_stream stream);

#ifdef __cplusplus
}
#endif

#endif
