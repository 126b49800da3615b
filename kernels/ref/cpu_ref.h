/* CPU twins of the CUDA kernels in kernels/kernels.h: same arguments (host pointers,
 * no stream), same semantics, plain C. They define what each kernel must compute;
 * tests/gpu/test_kernels.cu compares the GPU results with them on random inputs and
 * tests/unit/test_cpu_ref.c checks them against direct formulas. Written for clarity,
 * not speed: the engine's CPU backend has its own fast paths. */
#ifndef M40_CPU_REF_H
#define M40_CPU_REF_H

#include <stddef.h>
#include <stdint.h>

#include "../kernels.h"

#ifdef __cplusplus
extern "C" {
#endif

void m40_ref_embed(const void *table, int table_type, int64_t n_rows, int dim, const int32_t *ids, int n_ids,
                   void *out, int out_type, int64_t out_stride);
void m40_ref_rmsnorm(const float *x, int64_t x_stride, const float *w, void *out, int out_type, int64_t out_stride,
                     int rows, int dim, float eps);
void m40_ref_add_rmsnorm(float *x, int64_t x_stride, const float *d, int64_t d_stride, const float *w, float *out,
                         int64_t out_stride, int rows, int dim, float eps);
void m40_ref_rope(float *q, int64_t q_stride, int n_q_heads, float *k, int64_t k_stride, int n_k_heads,
                  int head_dim, int rot_dim, const int32_t *pos, int n_tokens, float base, const float *freq_factors,
                  int neox);
float m40_ref_glu_act(int act, float g);
void m40_ref_glu(int act, const float *gate, const float *up, int64_t in_stride, float *out, int64_t out_stride,
                 int rows, int n);
void m40_ref_add(float *out, const float *a, const float *b, int64_t n);
void m40_ref_kv_append(uint16_t *k_cache, uint16_t *v_cache, const float *k, int64_t k_stride, const float *v,
                       int64_t v_stride, const int32_t *new_indptr, int n_seqs, int n_tokens, const int32_t *indptr,
                       const int32_t *indices, const int32_t *last_page_len, int n_kv_heads, int head_dim);
/* Decode attention (no split: the split count only changes the GPU's order of summation). */
void m40_ref_attn_decode(float *out, int64_t out_stride, const float *q, int64_t q_stride, const uint16_t *k_cache,
                         const uint16_t *v_cache, const int32_t *indptr, const int32_t *indices,
                         const int32_t *last_page_len, int n_seqs, int n_heads, int n_kv_heads, int head_dim,
                         float scale);
void m40_ref_attn_prefill(float *out, int64_t out_stride, const float *q, int64_t q_stride, const int32_t *q_indptr,
                          int n_seqs, int n_rows, const uint16_t *k_cache, const uint16_t *v_cache,
                          const int32_t *indptr, const int32_t *indices, const int32_t *last_page_len, int n_heads,
                          int n_kv_heads, int head_dim, float scale);
/* Sliding-window, soft-capped twins (window 0 = none; softcap > 0: each scaled score s
 * becomes softcap * tanh(s / softcap) before the softmax, 0 = none) and the Gemma
 * helpers of kernels/model_aux.h. */
void m40_ref_attn_decode_window(float *out, int64_t out_stride, const float *q, int64_t q_stride,
                                const uint16_t *k_cache, const uint16_t *v_cache, const int32_t *indptr,
                                const int32_t *indices, const int32_t *last_page_len, int n_seqs, int n_heads,
                                int n_kv_heads, int head_dim, float scale, int window, float softcap);
void m40_ref_attn_prefill_window(float *out, int64_t out_stride, const float *q, int64_t q_stride,
                                 const int32_t *q_indptr, int n_seqs, int n_rows, const uint16_t *k_cache,
                                 const uint16_t *v_cache, const int32_t *indptr, const int32_t *indices,
                                 const int32_t *last_page_len, int n_heads, int n_kv_heads, int head_dim, float scale,
                                 int window, float softcap);
void m40_ref_attn_generic_window(float *out, int64_t out_stride, const float *q, int64_t q_stride,
                                 const int32_t *row_seq, const int32_t *row_pos, int n_rows, const uint16_t *k_cache,
                                 const uint16_t *v_cache, const int32_t *indptr, const int32_t *indices, int n_heads,
                                 int n_kv_heads, int head_dim, float scale, int window, float softcap);
/* The same with attention sinks (kernels.h 6d; sinks[n_heads] or NULL: none): each head's
 * softmax has one more logit, sinks[h], with no value behind it. */
void m40_ref_attn_prefill_sinks(float *out, int64_t out_stride, const float *q, int64_t q_stride,
                                const int32_t *q_indptr, int n_seqs, int n_rows, const uint16_t *k_cache,
                                const uint16_t *v_cache, const int32_t *indptr, const int32_t *indices,
                                const int32_t *last_page_len, int n_heads, int n_kv_heads, int head_dim, float scale,
                                int window, float softcap, const float *sinks);
void m40_ref_attn_generic_sinks(float *out, int64_t out_stride, const float *q, int64_t q_stride,
                                const int32_t *row_seq, const int32_t *row_pos, int n_rows, const uint16_t *k_cache,
                                const uint16_t *v_cache, const int32_t *indptr, const int32_t *indices, int n_heads,
                                int n_kv_heads, int head_dim, float scale, int window, float softcap,
                                const float *sinks);
void m40_ref_rmsnorm_heads(float *x, int64_t x_stride, int n_heads, int head_dim, const float *w, int rows, float eps);
void m40_ref_scale(float *x, int64_t n, float s);
void m40_ref_softcap(float *x, int64_t n, float cap);
void m40_ref_gemv(const void *w, int w_type, int N, int K, const float *x, int64_t x_stride, float *y,
                  int64_t y_stride, int batch);
/* Twin of m40k_gemm_q (kernels.h 8e): every weight formed as the GPU forms it,
 * F16(q * F16(scale) - F16(offset)) of its group of 8 (the q, scale and offset of
 * m40k_group8), times x (F16), summed in double; y[t*ldy + r] for r < N, t < M. GGUF types
 * only (a regrouped device layout holds the same values as its GGUF type). */
void m40_ref_gemm_q(const void *w, int w_type, int N, int K, const uint16_t *x, int64_t x_stride, int M, float *y,
                    int64_t ldy);
/* Twin of m40k_gemm_q_dequant: the F16 weights m40_ref_gemm_q multiplies, row r at out + r*K. */
void m40_ref_gemm_q_dequant(const void *w, int w_type, int N, int K, uint16_t *out);
/* Twins of m40k_quantize_q8 / m40k_gemv_q8 (kernels.h 8b): the same workspace bytes
 * (both levels of the rounding of x), the same integer dots and F32 group terms; only
 * the order of the sum differs (here in double). m40_ref_gemv_q8 also reads MXFP4 (the
 * twin of the experts' 10c' / 10d' on MXFP4_P). */
void m40_ref_quantize_q8(const float *x, int64_t x_stride, int K, int batch, void *ws);
void m40_ref_gemv_q8(const void *w, int w_type, int N, int K, const void *ws, int batch, float *y, int64_t y_stride);
/* Twins of m40k_quantize_x8 / m40k_gemm_x8 (kernels.h 8f): the same record bytes (x F16;
 * per chunk of 256 d = max|x|/127, q = rint(x/d), per block of 32 s = F16(sum q)); the
 * product as the GPU forms it: per chunk Q4_K's F32(d * F32(sum_j sc_j dot_j)) plus
 * sum_j F16(-dmin*m_j) * s_j, Q8_0's sum_j d_j dot_j, times dx; summed in double.
 * w_type Q4_K or Q8_0 (the plain layout of Q8_0_G8). */
void m40_ref_quantize_x8(const uint16_t *x, int64_t x_stride, int K, int M, void *xq);
void m40_ref_gemm_x8(const void *w, int w_type, int N, int K, const void *xq, int M, float *y, int64_t ldy);
/* Twins of kernels.h 8d (batch 1): m40k_gemv_q8_add_norm's x_out = x + W.ws (x_out may
 * be x), the records of x_out * norm_w and the sums of squares of x_out per 32 rows; and
 * the consumer's factor rsqrt(sum(ss[0 .. K/32)) / K + eps) (sums in double here). */
void m40_ref_gemv_q8_add_norm(const void *w, int w_type, int N, int K, const void *ws, const float *bias,
                              const float *x, float *x_out, const float *norm_w, void *xq_out, float *ss_out);
float m40_ref_norm_factor(const float *ss, int K, float eps);
void m40_ref_sample_greedy(const float *logits, int64_t stride, int rows, int n_vocab, int32_t *token,
                           float *logprob, int top_k, int32_t *top_tokens, float *top_logprobs);
/* Sampling twins of m40k_sample (kernels.h 9b): the fixed exp used for probabilities
 * (x <= 0; 0 below -32), and the sampler itself, written as a sort of the row in rank
 * order and linear walks over it. The random number of a draw and the rank key are the
 * GPU's own (sample_hd.h: m40k_sample_random, m40k_rank_key), not twins. */
float m40_ref_sample_exp(float x);
void m40_ref_sample(float *logits, int64_t stride, int n_seq, int n_vocab, const m40k_sample_params *params,
                    const int32_t *bias_indptr, const int32_t *bias_ids, const float *bias_values,
                    const int32_t *pen_indptr, const int32_t *pen_ids, const int32_t *pen_counts, int32_t *token,
                    float *logprob, int n_top, int32_t *top_ids, float *top_logprobs);

/* Mixtures of experts (kernels.h 10; kernels/ref/moe_ref.c): the same arguments as the
 * m40k_moe_* kernels, host pointers. Dot products in float through m40_dot_row (the GPU's
 * order of summation differs), the grouped product through m40_ref_gemm_q per expert. */
float m40_ref_moe_act(int act, float g, float u);
void m40_ref_moe_router_logits(const float *wr, const float *bias, int n_expert, int dim, const float *x,
                               int64_t x_stride, int n_tokens, float *logits);
void m40_ref_moe_topk(const float *logits, int n_tokens, int n_expert, int k, int gating, const float *sel_bias,
                      int norm, float scale, int32_t *ids, float *weights);
void m40_ref_moe_gate_up(const void *w_gate, const void *w_up, int w_type, int n_expert, int n_ff, int dim,
                         const float *gate_b, const float *up_b, int act, const float *x, int64_t x_stride,
                         const int32_t *ids, int n_tokens, int k, float *h, int64_t h_stride);
void m40_ref_moe_down(const void *w_down, int w_type, int n_expert, int dim, int n_ff, const float *down_b,
                      const float *h, int64_t h_stride, const int32_t *ids, const float *weights, int n_tokens, int k,
                      float *out, int64_t out_stride, int accumulate);
void m40_ref_moe_group(const int32_t *ids, int n_pairs, int n_expert, int bm, int32_t *counts, int32_t *offsets,
                       int32_t *perm, int32_t *inv, int32_t *tiles);
void m40_ref_moe_gather_f16(const float *x, int64_t x_stride, int dim, const int32_t *perm, int n_pairs, int k,
                            uint16_t *out16, int64_t out_stride);
void m40_ref_moe_gemm_q(const void *w, int w_type, int n_expert, int N, int K, const uint16_t *x, int64_t x_stride,
                        const int32_t *offsets, float *y, int64_t ldy);
void m40_ref_moe_glu_sorted(int act, const float *gate, const float *up, int64_t in_stride, const float *gate_b,
                            const float *up_b, const int32_t *ids, const int32_t *perm, int n_pairs, int n_ff,
                            uint16_t *out16, int64_t out_stride);
void m40_ref_moe_combine(const float *y, int64_t ldy, const int32_t *inv, const int32_t *ids, const float *weights,
                         const float *down_b, int n_expert, int n_tokens, int k, int dim, float *out,
                         int64_t out_stride, int accumulate);

/* 11: out[i] = in[0][i] + in[1][i] + .. + in[n_ranks-1][i], added in that order (the
 * order every rank of m40k_tp_allreduce adds in). */
void m40_ref_tp_allreduce(const float *const *in, int n_ranks, float *out, int64_t count);

/* Length of sequence s in the CSR page table. */
static inline int64_t m40_ref_seq_len(const int32_t *indptr, const int32_t *last_page_len, int s)
{
    int64_t pages = indptr[s + 1] - indptr[s];
    return pages > 0 ? (pages - 1) * M40K_PAGE + last_page_len[s] : 0;
}

#ifdef __cplusplus
}
#endif

#endif
