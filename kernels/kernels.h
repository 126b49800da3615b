/* m40 CUDA kernels: host launch wrappers callable from C11.
 *
 * No engine knowledge: plain device pointers, shapes, strides and a stream. Every
 * wrapper launches asynchronously on `stream` and returns the launch status as a
 * cudaError_t value (0 = cudaSuccess; cudaErrorInvalidValue = 1 for a shape the kernel
 * does not handle). Each function has a CPU twin with the same semantics in
 * kernels/ref/cpu_ref.h (m40_ref_*); tests/gpu/test_kernels.cu compares the two.
 *
 * Conventions:
 *  - F16 data is IEEE binary16 stored as uint16_t; F32 accumulation everywhere.
 *  - Strides are in elements unless named *_bytes.
 *  - Weight/table types use the GGUF numbering (M40K_TYPE_*, same values as the
 *    engine's enum m40_type) so a tensor's file type maps directly.
 *  - Paged KV cache (per layer): separate K and V arrays, each laid out
 *    [block][kv_head][M40K_PAGE][head_dim] F16. A sequence's pages are given in CSR
 *    form: pages of sequence s are indices[indptr[s] .. indptr[s+1]), the last one
 *    holding last_page_len[s] (1..16) tokens, so its length is
 *    (indptr[s+1]-indptr[s]-1)*16 + last_page_len[s].
 *  - Query head h reads KV head h / (n_heads / n_kv_heads) (grouped-query attention).
 */
#ifndef M40_KERNELS_H
#define M40_KERNELS_H

#include <stddef.h>
#include <stdint.h>

#include "sample_hd.h" /* the argmax key (9c), the rank key and the random number (9b) */

#ifdef __cplusplus
extern "C" {
#endif

/* Same type as cudaStream_t, without requiring CUDA headers in C callers. */
struct CUstream_st;
typedef struct CUstream_st *m40k_stream;

#define M40K_PAGE 16 /* tokens per KV-cache block */

enum {
    M40K_TYPE_F32 = 0,
    M40K_TYPE_F16 = 1,
    M40K_TYPE_Q4_0 = 2,
    M40K_TYPE_Q4_1 = 3,
    M40K_TYPE_Q5_0 = 6,
    M40K_TYPE_Q5_1 = 7,
    M40K_TYPE_Q8_0 = 8,
    M40K_TYPE_Q2_K = 10,
    M40K_TYPE_Q3_K = 11,
    M40K_TYPE_Q4_K = 12,
    M40K_TYPE_Q5_K = 13,
    M40K_TYPE_Q6_K = 14,
    M40K_TYPE_BF16 = 30,
    M40K_TYPE_MXFP4 = 39, /* 17 B / 32: E8M0 scale byte | 16 bytes of E2M1 nibbles (quant_dev.h) */
    /* Device-only layouts (never in a GGUF file): the same blocks regrouped by 8 so that
     * every piece the int8 GEMV reads starts 16-byte aligned (m40k_repack_g8). */
    M40K_TYPE_Q8_0_G8 = 1008,
    M40K_TYPE_Q6_K_G8 = 1014,
    /* Q6_K superblocks padded to 224 bytes (m40k_repack_q6_k_p) */
    M40K_TYPE_Q6_K_P = 2014,
    /* MXFP4 blocks in 144-byte chunks of 8 (m40k_repack_mxfp4_p) */
    M40K_TYPE_MXFP4_P = 2039
};

/* 0. Regrouped layouts. GGUF's Q8_0 (34-byte) and Q6_K (210-byte) blocks start at any
 * even offset, so a GEMV lane assembles each piece from two or three 16-byte chunks.
 * Regrouped, 8 consecutive blocks of a row become one group of the same bytes:
 *   Q8_0_G8 (272 B / 256 elements): d[8] f16 | qs[8][32] int8
 *   Q6_K_G8 (1680 B / 2048 elements): {ql[128] | qh[64] | scales[16]}[8] | d[8] f16
 * (both 16-byte multiples: every row, quant run and scale run of a group aligned).
 * Rows keep their byte length; a row's K must be a multiple of 256 (Q8_0) or 2048 (Q6_K).
 * m40k_g8_type: the regrouped type of GGUF type t for rows of K elements, or t itself
 * when it has none or K does not fit. m40k_repack_g8: rows of K elements of GGUF type t
 * (src, packed) rewritten in m40k_g8_type(t, K)'s layout into dst (no overlap); returns
 * M40K_INVALID when there is no such layout. Host functions, no device work. */
int m40k_g8_type(int t, int64_t K);
int m40k_repack_g8(int t, const void *src, void *dst, int64_t rows, int64_t K);
/* Q6_K_P (224 B / 256 elements): a Q6_K superblock (ql | qh | scales | d, 210 bytes)
 * followed by 14 zero bytes, so that every superblock of every row starts 16-byte
 * aligned whatever K (a multiple of 256). For the matrices whose rows Q6_K_G8 cannot
 * regroup (K not a multiple of 2048: the experts' down rows of Qwen3-30B-A3B, 768 wide),
 * which the 16-byte copies of the quantized GEMM's register and staged kernels could not
 * read otherwise (6.7% more bytes than the file's). Rows are K/256 * 224 bytes: NOT the
 * file's row length. The expert kernels (10c, 10d, 10g) and the quantized GEMM (8e) read
 * it. m40k_repack_q6_k_p: rows of K elements of Q6_K (src, packed) into dst in Q6_K_P
 * (dst holds rows * K/256 * 224 bytes; no overlap); M40K_INVALID where K is not a
 * positive multiple of 256. Host function, no device work. */
int m40k_repack_q6_k_p(const void *src, void *dst, int64_t rows, int64_t K);
/* MXFP4_P (144 B / 256 elements): a row's MXFP4 blocks (17 bytes: E8M0 scale | 16 bytes
 * of nibbles) in chunks of 8, each chunk qs[8][16] | e[8] | 8 zero bytes, so that every
 * block's nibbles start 16-byte aligned; a row of K elements (K a multiple of 32) takes
 * ceil(K/256) chunks, the blocks past K zero (scale byte 0, nibbles 0: weights 0). For
 * gpt-oss's experts (rows of 2,880), which the quantized GEMM otherwise reads with byte
 * loads on its direct kernel. Row bytes: ceil(K/256) * 144 (m40k_row_bytes). The expert
 * kernels (10c, 10d, 10g) and the quantized GEMM (8e) read it: the register kernel and
 * the expert GEMVs at any K of whole blocks, products of more than 64 rows on the direct
 * kernel (no staged kernel, no F16 dequantization). m40k_repack_mxfp4_p: rows of K elements of MXFP4 (src, packed) into dst (rows *
 * ceil(K/256) * 144 bytes; no overlap); M40K_INVALID where K is not a positive multiple
 * of 32. Host function, no device work. */
int m40k_repack_mxfp4_p(const void *src, void *dst, int64_t rows, int64_t K);
/* The bytes of a row of K elements in padded layout t (Q6_K_P, MXFP4_P); 0 for another
 * type or a K the layout does not take. */
int64_t m40k_padded_row_bytes(int t, int64_t K);

/* 1. Embedding gather: out[i][0..dim) = dequant(table row ids[i]). table_type is F32,
 * F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, MXFP4 or a regrouped layout (0.) (dim a
 * multiple of the block size: 32, or 256 for the K-quants and Q8_0_G8, 2048 for
 * Q6_K_G8); rows are dim elements packed (row bytes = dim/block*block_bytes). out_type
 * F32 or F16, row stride out_stride elements. Ids outside [0, n_rows) give zero rows. */
int m40k_embed(const void *table, int table_type, int64_t n_rows, int dim, const int32_t *ids, int n_ids,
               void *out, int out_type, int64_t out_stride, m40k_stream stream);

/* 2. RMSNorm: out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w, rows x dim, any dim.
 * x row stride x_stride, out row stride out_stride; out_type F32 or F16. */
int m40k_rmsnorm(const float *x, int64_t x_stride, const float *w, void *out, int out_type, int64_t out_stride,
                 int rows, int dim, float eps, m40k_stream stream);
/* 2b. Residual add + RMSNorm in one pass: x[r] += d[r], then out[r] = rmsnorm(x[r]) * w
 * (F32; out may alias d, not x). */
int m40k_add_rmsnorm(float *x, int64_t x_stride, const float *d, int64_t d_stride, const float *w, float *out,
                     int64_t out_stride, int rows, int dim, float eps, m40k_stream stream);
/* 2c. The same, and out quantized for m40k_gemv_q8 on the way (8b): xq receives the
 * workspace m40k_quantize_q8(out, out_stride, dim, rows, xq) would write, byte for byte.
 * dim a multiple of 32, rows <= 8 for the GEMV. */
int m40k_add_rmsnorm_q8(float *x, int64_t x_stride, const float *d, int64_t d_stride, const float *w, float *out,
                        int64_t out_stride, int rows, int dim, float eps, void *xq, m40k_stream stream);
/* 2d. The same with an F16 copy of out for the tensor-core products (what
 * m40k_f32_to_f16 of out would write, bit for bit): out16[r*dim + i], rows contiguous. */
int m40k_add_rmsnorm_f16(float *x, int64_t x_stride, const float *d, int64_t d_stride, const float *w, float *out,
                         int64_t out_stride, int rows, int dim, float eps, uint16_t *out16, m40k_stream stream);
/* 2e. Out of place: x_out[r] = x[r] + d[r] (row stride x_stride, as x), out[r] =
 * rmsnorm(x_out[r]) * w, and where given xq (2c: dim a multiple of 32) and out16 (2d);
 * out may be NULL where xq or out16 is given (only they are written).
 * x_out may be x (then as 2b-2d). With x_out and out both apart from x and d, rows of a
 * width that is a multiple of 512 up to 8,192, at 16-byte strides, need no exchange
 * between the blocks of a row (each sums the whole row itself): the decode steps'
 * residual stream alternates between two buffers for it. */
int m40k_add_rmsnorm_to(const float *x, int64_t x_stride, const float *d, int64_t d_stride, float *x_out,
                        const float *w, float *out, int64_t out_stride, int rows, int dim, float eps, void *xq,
                        uint16_t *out16, m40k_stream stream);
/* 2f. 2e without xq, on one kernel whatever rows is: a row's outputs are then the same bits
 * at any row count (2e takes a kernel of several blocks a row for few rows, whose sums
 * run in another order). Twin: 2e's. */
int m40k_add_rmsnorm_to_any(const float *x, int64_t x_stride, const float *d, int64_t d_stride, float *x_out,
                            const float *w, float *out, int64_t out_stride, int rows, int dim, float eps,
                            uint16_t *out16, m40k_stream stream);

/* 3. RoPE in place on q (and k unless NULL): token t's head h starts at
 * q + t*q_stride + h*head_dim. The first rot_dim (even, <= head_dim) dims rotate by
 * theta_i = pos[t] * base^(-2i/rot_dim) / freq_factors[i] (freq_factors may be NULL),
 * i < rot_dim/2. Normal: pairs (2i, 2i+1); neox != 0: pairs (i, i + rot_dim/2).
 * Angles are computed in double so long positions keep full float accuracy. */
int m40k_rope(float *q, int64_t q_stride, int n_q_heads, float *k, int64_t k_stride, int n_k_heads, int head_dim,
              int rot_dim, const int32_t *pos, int n_tokens, float base, const float *freq_factors, int neox,
              m40k_stream stream);

/* 4. Gated activations: out[r][i] = act(gate[r][i]) * up[r][i], i < n; gate/up rows at
 * stride in_stride, out rows at out_stride. act = silu (SwiGLU) or the tanh
 * approximation of GELU (GeGLU). */
enum { M40K_GLU_SILU = 0, M40K_GLU_GELU_TANH = 1 };
int m40k_glu(int act, const float *gate, const float *up, int64_t in_stride, float *out, int64_t out_stride, int rows,
             int n, m40k_stream stream);
/* 4b. The same, and out quantized for m40k_gemv_q8 on the way, as 2c (n a multiple of 32). */
int m40k_glu_q8(int act, const float *gate, const float *up, int64_t in_stride, float *out, int64_t out_stride,
                int rows, int n, void *xq, m40k_stream stream);
/* 4c. The same with an F16 copy of out, as 2d: out16[r*n + i], rows contiguous. out may
 * be NULL here and in 4b (only the copy or the records written). */
int m40k_glu_f16(int act, const float *gate, const float *up, int64_t in_stride, float *out, int64_t out_stride,
                 int rows, int n, uint16_t *out16, m40k_stream stream);

/* 4d. The GLU of a gate/up product written in F16 at a scale (the engine's prefill chunks:
 * half the bytes of the F32 product, written and read): out16[r*n + i] =
 * F16(act(s * gate[r*in_stride + i]) * (s * up[r*in_stride + i])), s = in_scale, rows
 * of out16 contiguous. Twin: m40_ref_glu on the F32 values s * gate, s * up. */
int m40k_glu_h16(int act, const uint16_t *gate, const uint16_t *up, int64_t in_stride, float in_scale,
                 uint16_t *out16, int rows, int n, m40k_stream stream);

/* Residual add: out[i] = a[i] + b[i], i < n (out may alias a or b). */
int m40k_add(float *out, const float *a, const float *b, int64_t n, m40k_stream stream);

/* 5. Paged KV append. The batch holds n_tokens new tokens; those of sequence s are rows
 * new_indptr[s] - new_indptr[0] .. new_indptr[s+1] - new_indptr[0] (new_indptr[0] is
 * usually 0; a slice of a larger batch's table works as it is) and are the LAST tokens
 * of that sequence (whose
 * pages, already allocated, and length include them, see the CSR convention above).
 * Row t of k (F32, stride k_stride) holds n_kv_heads*head_dim values, head-major; same
 * for v. Written as F16 into k_cache / v_cache. */
int m40k_kv_append(uint16_t *k_cache, uint16_t *v_cache, const float *k, int64_t k_stride, const float *v,
                   int64_t v_stride, const int32_t *new_indptr, int n_seqs, int n_tokens, const int32_t *indptr,
                   const int32_t *indices, const int32_t *last_page_len, int n_kv_heads, int head_dim,
                   m40k_stream stream);
/* 5b. The same with K rotated by RoPE on the way, and Q rotated in place: the cache
 * receives, and q holds afterwards, bit for bit what m40k_rope(q, q_stride, n_q_heads,
 * k, k_stride, n_kv_heads, head_dim, rot_dim, pos, n_tokens, base, freq_factors, neox)
 * followed by m40k_kv_append would write (pos: one position per row of k, as
 * m40k_rope's; the other RoPE arguments as there, and refused as there), while k itself
 * is left as it is. q may be NULL (K only). One launch instead of two: the forward pass
 * ropes Q and appends K and V with this. rot_dim 0 is m40k_kv_append. CPU twin:
 * m40_ref_rope on q and a copy of k, then m40_ref_kv_append. */
int m40k_kv_append_rope(float *q, int64_t q_stride, int n_q_heads, uint16_t *k_cache, uint16_t *v_cache,
                        const float *k, int64_t k_stride, const float *v, int64_t v_stride, const int32_t *new_indptr,
                        int n_seqs, int n_tokens, const int32_t *indptr, const int32_t *indices,
                        const int32_t *last_page_len, int n_kv_heads, int head_dim, const int32_t *pos, int rot_dim,
                        float base, const float *freq_factors, int neox, m40k_stream stream);
/* 5c. The angles of RoPE as a table, for the kernels of a forward pass to read instead
 * of each forming them again (every layer rotates the same positions): cs[2*(t*h + i)]
 * and cs[2*(t*h + i) + 1], h = rot_dim/2, hold the cosine and sine of theta_i at pos[t],
 * bit for bit those m40k_rope forms (the same arguments, refused as there; rot_dim 0
 * writes nothing). cs: n_tokens * rot_dim floats, 8-byte aligned.
 * m40k_kv_append_rope_tab is m40k_kv_append_rope with the table in place of pos, base
 * and freq_factors (row t of the table for row t of k and q): the same bits in the
 * cache and q, without forming the angles (in double precision) again in every block
 * of every layer. */
int m40k_rope_table(const int32_t *pos, int n_tokens, int rot_dim, float base, const float *freq_factors, float *cs,
                    m40k_stream stream);
int m40k_kv_append_rope_tab(float *q, int64_t q_stride, int n_q_heads, uint16_t *k_cache, uint16_t *v_cache,
                            const float *k, int64_t k_stride, const float *v, int64_t v_stride,
                            const int32_t *new_indptr, int n_seqs, int n_tokens, const int32_t *indptr,
                            const int32_t *indices, const int32_t *last_page_len, int n_kv_heads, int head_dim,
                            int rot_dim, const float *cs, int neox, m40k_stream stream);

/* 6. Paged decode attention: one query token per sequence (the sequence's last).
 * q: [n_seqs][q_stride] F32 (head h at h*head_dim), out likewise with out_stride.
 * head_dim 64, 128 or 256; n_heads/n_kv_heads in 1..8 (n_heads a multiple).
 * scale multiplies q.k (usually 1/sqrt(head_dim)). n_splits > 1 splits each sequence's
 * positions into that many even ranges processed by separate blocks (better GPU fill for
 * few long sequences); the last block of each (sequence, KV head) to finish merges them,
 * in the same launch. n_splits > 1 needs:
 *   - workspace: m40k_decode_workspace_floats(...) floats, 16-byte aligned (cudaMalloc
 *     memory is); its contents need no initialization and are scratch after the call;
 *   - counters: m40k_decode_counter_ints(n_seqs, n_kv_heads) ints (or more) of device
 *     memory that the caller ZEROES ONCE when it allocates them (cudaMemset[Async]). Every
 *     call that completes leaves them zero again, so one array serves every later call
 *     of any shape up to that size (every layer, every step). Two calls that may run at
 *     the same time (different streams) need different counters; a call that faults
 *     mid-kernel may leave them nonzero (zero them again before reuse).
 * Both may be NULL for n_splits == 1 (neither is touched). With programmatic dependent
 * launch the block tables (indptr, indices, last_page_len) are read before the kernel
 * waits for the kernel launched ahead of it: they must not be that kernel's output. */
size_t m40k_decode_workspace_floats(int n_seqs, int n_heads, int head_dim, int n_splits);
size_t m40k_decode_counter_ints(int n_seqs, int n_kv_heads);
/* A split count for the given shape: about 32 positions per split, at most 4 blocks per
 * SM and 64 splits. sm_count from cudaDeviceProp.multiProcessorCount. */
int m40k_decode_pick_splits(int n_seqs, int n_kv_heads, int max_seq_len, int sm_count);
int m40k_attn_decode(float *out, int64_t out_stride, const float *q, int64_t q_stride, const uint16_t *k_cache,
                     const uint16_t *v_cache, const int32_t *indptr, const int32_t *indices,
                     const int32_t *last_page_len, int n_seqs, int n_heads, int n_kv_heads, int head_dim, float scale,
                     int n_splits, float *workspace, int *counters, m40k_stream stream);

/* 6c. Decode attention that appends the step's own K/V on the way: one launch for what
 * m40k_kv_append_rope (new_indptr 0, 1, .., n_seqs: one new token per sequence, row s of
 * q / k / v and pos[s] being sequence s's) followed by m40k_attn_decode_window on the
 * rotated q would do. The caches receive the same bits as there (K rotated by RoPE, V,
 * both as F16, at position len(s) - 1) and out is what the decode kernel gives on the
 * rotated q; q and k are read and left as they are (q is rotated in registers only).
 * k / v: 16-byte aligned, strides multiples of 4 floats. RoPE arguments and refusals as
 * m40k_kv_append_rope's (rot_dim 0: no rotation). pos and freq_factors are read BEFORE
 * the kernel waits for the kernel launched ahead of it (PDL): they must not be that
 * kernel's output (the forward pass uploads pos before its first kernel); nor the block
 * tables and the cached K/V rows before position len - 1, the first tile of which is
 * prefetched then as well (that kernel must not append to the cache). The split
 * holding position len - 1 stores it; no split reads it from the cache. The rest (splits,
 * workspace, counters, window, softcap) as m40k_attn_decode_window; what else the layer
 * asks (int8 records, sinks, biases, Q/K norms, an F16 copy) in opts (6e; NULL: none).
 * The call is declared after 6e. Twin: m40_ref_rope and m40_ref_kv_append, then
 * m40_ref_attn_decode. */
/* Its option out_q8 (6e) also writes out as the int8 records of m40k_quantize_q8(out,
 * out_stride, n_heads * head_dim, n_seqs, out_q8), byte for byte (out_q8 16-byte
 * aligned), for the int8 GEMV that reads them next: no quantization launch between the
 * two. Only where m40k_attn_decode_q8_ok(n_seqs, n_heads, n_kv_heads, head_dim,
 * n_splits) is 1 (the cluster merge of sm_90 at 1..2 sequences, every block's slice of a
 * KV head's outputs whole 32-element blocks); refused elsewhere. */
int m40k_attn_decode_q8_ok(int n_seqs, int n_heads, int n_kv_heads, int head_dim, int n_splits);
/* 6d. Attention sinks (gpt-oss): the _sinks calls take sinks[n_heads] (device memory,
 * or NULL: none, then exactly the call without the suffix): head h's softmax gets one
 * more logit, sinks[h], compared with the scaled (and soft-capped) scores as it is, with
 * no value behind it, so out = sum_t exp(s_t) v_t / (exp(sinks[h]) + sum_t exp(s_t)).
 * The kernels apply it where they normalize (the last split's merge), one uniform
 * branch: nothing more in the loops. Twins: m40_ref_attn_prefill_sinks (decode rows are
 * a prefill of one row each) and m40_ref_attn_generic_sinks. Decode: the RoPE variant
 * only (6c's option sinks; rot_dim 0 rotates nothing). */
/* 6e. What else a layer asks of its decode rows, in m40k_dec_opts (NULL or zeroed: the
 * attention alone; each member NULL when absent):
 *   - out_q8: the int8 records of out (6c); sinks: the heads' sink logits (6d);
 *   - bias_q [n_heads * head_dim], bias_k and bias_v [n_kv_heads * head_dim]: the q/k/v
 *     product's biases (gpt-oss, Qwen2; all three or none), added first, as m40k_add_bias
 *     adds them (the same bits);
 *   - q_norm, k_norm (head_dim weights each, both or neither; norm_eps >= 0): the per-head
 *     RMSNorm of q and k before RoPE (Qwen3, Gemma 3), as m40k_rmsnorm_qk(q, .., n_heads,
 *     n_kv_heads, head_dim, q_norm, k_norm, n_seqs, norm_eps) would do first, but a head's
 *     sum of squares in another order: the results agree to rounding, not bit for bit;
 *   - out16: out also as F16 (m40k_f32_to_f16 of out: the same bits; rows out_stride
 *     elements apart), for an output projection that reads F16 x;
 *   - plain (non-zero): the n_splits blocks a (sequence, KV head) merged through the
 *     workspace, never as a cluster: a sequence's output then depends on its own length
 *     and n_splits only, not on how many sequences the launch has (the engine's batch
 *     invariance).
 * q, k and v are read and left as they are. Twin: the biases added, m40_ref_rmsnorm_heads
 * on the q and k heads, then 6c's. */
typedef struct m40k_dec_opts {
    void *out_q8;
    const float *sinks;
    const float *bias_q, *bias_k, *bias_v;
    const float *q_norm, *k_norm;
    float norm_eps;
    uint16_t *out16;
    int plain;
} m40k_dec_opts;
int m40k_attn_decode_rope(float *out, int64_t out_stride, const float *q, int64_t q_stride, const float *k,
                          int64_t k_stride, const float *v, int64_t v_stride, uint16_t *k_cache, uint16_t *v_cache,
                          const int32_t *indptr, const int32_t *indices, const int32_t *last_page_len, int n_seqs,
                          int n_heads, int n_kv_heads, int head_dim, float scale, int window, float softcap,
                          const int32_t *pos, int rot_dim, float base, const float *freq_factors, int neox,
                          int n_splits, float *workspace, int *counters, const m40k_dec_opts *opts,
                          m40k_stream stream);

/* 7. Prefill attention, causal, over the paged cache (the new tokens already appended
 * with m40k_kv_append). Query rows of sequence s are q_indptr[s] .. q_indptr[s+1]; they
 * are that sequence's last tokens, so query row i sits at position
 * len(s) - (q_indptr[s+1] - i) and attends to positions 0..that one. q/out: [row][stride]
 * F32 as in decode. head_dim 64/128/256, n_heads/n_kv_heads 1..8. SIMT tiled online
 * softmax (flash-attention style), each K/V tile read once per block and shared by the
 * group's query heads. */
int m40k_attn_prefill(float *out, int64_t out_stride, const float *q, int64_t q_stride, const int32_t *q_indptr,
                      int n_seqs, int n_rows, const uint16_t *k_cache, const uint16_t *v_cache,
                      const int32_t *indptr, const int32_t *indices, const int32_t *last_page_len, int n_heads,
                      int n_kv_heads, int head_dim, float scale, m40k_stream stream);

/* 6b, 7b. Sliding-window and soft-capped variants (Gemma's local layers, Gemma 2's
 * attn_logit_softcapping): the same kernels, but a query at position p attends to
 * positions max(0, p-window+1)..p only (window tokens, itself included), and with
 * softcap > 0 each score s = scale * q.k becomes softcap * tanh(s / softcap) before the
 * softmax. window 0 means no window, softcap 0 no cap (< 0 is refused):
 * m40k_attn_decode and m40k_attn_prefill are these with window 0 and softcap 0. */
int m40k_attn_decode_window(float *out, int64_t out_stride, const float *q, int64_t q_stride, const uint16_t *k_cache,
                            const uint16_t *v_cache, const int32_t *indptr, const int32_t *indices,
                            const int32_t *last_page_len, int n_seqs, int n_heads, int n_kv_heads, int head_dim,
                            float scale, int window, float softcap, int n_splits, float *workspace, int *counters,
                            m40k_stream stream);
int m40k_attn_prefill_window(float *out, int64_t out_stride, const float *q, int64_t q_stride,
                             const int32_t *q_indptr, int n_seqs, int n_rows, const uint16_t *k_cache,
                             const uint16_t *v_cache, const int32_t *indptr, const int32_t *indices,
                             const int32_t *last_page_len, int n_heads, int n_kv_heads, int head_dim, float scale,
                             int window, float softcap, m40k_stream stream);

/* 7c. Prefill attention on tensor cores (kernels/attn_prefill_tc.cu): the same arguments
 * and results as m40k_attn_prefill[_window] (softcap included; up to F16 rounding of Q and of the softmax
 * weights: ~1e-3 of the output scale), flash-attention-2 style with mma.sync, for
 * sm_80 and newer. m40k_attn_prefill_tc_supported(head_dim) says whether it runs on the
 * current device (sm_80+, head_dim 64/128/256, a kernel image built for sm_80+, enough
 * shared memory); where it does not, the _tc calls return
 * cudaErrorNoKernelImageForDevice (209). The _auto calls take the tensor-core path where
 * it is supported and the SIMT kernel otherwise: the ones to call from model code. */
int m40k_attn_prefill_tc_supported(int head_dim);
/* For measurement: 1 or 2 key halves a block (attn_prefill_tc.cu) for every launch of
 * 7c-7f; 0, the default: 2 where head_dim <= 128, else 1. */
void m40k_attn_prefill_tc_tune(int key_halves);
int m40k_attn_prefill_tc(float *out, int64_t out_stride, const float *q, int64_t q_stride, const int32_t *q_indptr,
                         int n_seqs, int n_rows, const uint16_t *k_cache, const uint16_t *v_cache,
                         const int32_t *indptr, const int32_t *indices, const int32_t *last_page_len, int n_heads,
                         int n_kv_heads, int head_dim, float scale, m40k_stream stream);
int m40k_attn_prefill_tc_window(float *out, int64_t out_stride, const float *q, int64_t q_stride,
                                const int32_t *q_indptr, int n_seqs, int n_rows, const uint16_t *k_cache,
                                const uint16_t *v_cache, const int32_t *indptr, const int32_t *indices,
                                const int32_t *last_page_len, int n_heads, int n_kv_heads, int head_dim, float scale,
                                int window, float softcap, m40k_stream stream);
int m40k_attn_prefill_auto(float *out, int64_t out_stride, const float *q, int64_t q_stride, const int32_t *q_indptr,
                           int n_seqs, int n_rows, const uint16_t *k_cache, const uint16_t *v_cache,
                           const int32_t *indptr, const int32_t *indices, const int32_t *last_page_len, int n_heads,
                           int n_kv_heads, int head_dim, float scale, m40k_stream stream);
int m40k_attn_prefill_auto_window(float *out, int64_t out_stride, const float *q, int64_t q_stride,
                                  const int32_t *q_indptr, int n_seqs, int n_rows, const uint16_t *k_cache,
                                  const uint16_t *v_cache, const int32_t *indptr, const int32_t *indices,
                                  const int32_t *last_page_len, int n_heads, int n_kv_heads, int head_dim,
                                  float scale, int window, float softcap, m40k_stream stream);

/* 7d. The tensor-core prefill with each block's keys split n_splits ways (1..
 * M40K_PREFILL_SPLIT_MAX), the splits merged by a second kernel: for few new rows after a
 * long context, where one block per (row tile, KV head) would leave SMs idle. Same
 * results as 7c (softcap as there; up to F32 summation order). ws: a device buffer of
 * m40k_attn_prefill_split_ws_floats(...) floats (NULL when n_splits is 1).
 * m40k_attn_prefill_pick_splits: the split count for a step: 1 when the (row tile, KV
 * head) blocks fill the sm_count SMs already, else enough blocks for two waves, each
 * split at least M40K_PREFILL_SPLIT_MIN keys of the longest context max_len, within
 * ws_floats of workspace. The _auto_split
 * call falls back to the SIMT kernel (no splits) where the tensor cores do not run. */
#define M40K_PREFILL_SPLIT_MAX 16
#define M40K_PREFILL_SPLIT_MIN 512
size_t m40k_attn_prefill_split_ws_floats(int n_rows, int n_seqs, int n_heads, int n_kv_heads, int head_dim,
                                         int n_splits);
int m40k_attn_prefill_pick_splits(int n_rows, int n_seqs, int n_heads, int n_kv_heads, int head_dim, int max_len,
                                  int sm_count, size_t ws_floats);
int m40k_attn_prefill_tc_split(float *out, int64_t out_stride, const float *q, int64_t q_stride,
                               const int32_t *q_indptr, int n_seqs, int n_rows, const uint16_t *k_cache,
                               const uint16_t *v_cache, const int32_t *indptr, const int32_t *indices,
                               const int32_t *last_page_len, int n_heads, int n_kv_heads, int head_dim, float scale,
                               int window, float softcap, int n_splits, float *ws, m40k_stream stream);
int m40k_attn_prefill_auto_split(float *out, int64_t out_stride, const float *q, int64_t q_stride,
                                 const int32_t *q_indptr, int n_seqs, int n_rows, const uint16_t *k_cache,
                                 const uint16_t *v_cache, const int32_t *indptr, const int32_t *indices,
                                 const int32_t *last_page_len, int n_heads, int n_kv_heads, int head_dim, float scale,
                                 int window, float softcap, int n_splits, float *ws, m40k_stream stream);
/* 7e. The prefill kernels with attention sinks (6d): SIMT (7b's), tensor cores with key
 * splits (7d's), and the pick between them (7d's _auto_split). */
int m40k_attn_prefill_sinks(float *out, int64_t out_stride, const float *q, int64_t q_stride, const int32_t *q_indptr,
                            int n_seqs, int n_rows, const uint16_t *k_cache, const uint16_t *v_cache,
                            const int32_t *indptr, const int32_t *indices, const int32_t *last_page_len, int n_heads,
                            int n_kv_heads, int head_dim, float scale, int window, float softcap, const float *sinks,
                            m40k_stream stream);
int m40k_attn_prefill_tc_split_sinks(float *out, int64_t out_stride, const float *q, int64_t q_stride,
                                     const int32_t *q_indptr, int n_seqs, int n_rows, const uint16_t *k_cache,
                                     const uint16_t *v_cache, const int32_t *indptr, const int32_t *indices,
                                     const int32_t *last_page_len, int n_heads, int n_kv_heads, int head_dim,
                                     float scale, int window, float softcap, int n_splits, float *ws,
                                     const float *sinks, m40k_stream stream);
int m40k_attn_prefill_auto_split_sinks(float *out, int64_t out_stride, const float *q, int64_t q_stride,
                                       const int32_t *q_indptr, int n_seqs, int n_rows, const uint16_t *k_cache,
                                       const uint16_t *v_cache, const int32_t *indptr, const int32_t *indices,
                                       const int32_t *last_page_len, int n_heads, int n_kv_heads, int head_dim,
                                       float scale, int window, float softcap, int n_splits, float *ws,
                                       const float *sinks, m40k_stream stream);
/* 7f. 7e's tensor-core call writing F16 (out rows at out_stride elements): the input of
 * an output projection that reads an F16 copy of x (prompt chunks), without a conversion
 * between them. Same values as 7e's, rounded to F16. */
int m40k_attn_prefill_tc_split_sinks_h16(uint16_t *out, int64_t out_stride, const float *q, int64_t q_stride,
                                         const int32_t *q_indptr, int n_seqs, int n_rows, const uint16_t *k_cache,
                                         const uint16_t *v_cache, const int32_t *indptr, const int32_t *indices,
                                         const int32_t *last_page_len, int n_heads, int n_kv_heads, int head_dim,
                                         float scale, int window, float softcap, int n_splits, float *ws,
                                         const float *sinks, m40k_stream stream);

/* 8. GEMV for decode batches: y[b*y_stride + n] = sum_k W[n][k] * x[b*x_stride + k],
 * n < N, b < batch (1..8). W rows are K elements of w_type (F16, BF16, Q8_0, Q4_0, Q4_1,
 * Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, MXFP4 (the generic kernel); GGUF block layouts) packed, row bytes =
 * K/block*block_bytes. K a multiple of 32 (256 for the K-quants, 8 for F16 and BF16). x 16-byte aligned, x_stride a multiple of 4.
 * One warp per row: 16-byte loads staged through shared memory, dequantization in
 * registers, F32 accumulation. May read up to 15 bytes past the end of W's last row
 * (never past the 16-byte-aligned chunk that holds its last byte). */
int m40k_gemv(const void *w, int w_type, int N, int K, const float *x, int64_t x_stride, float *y, int64_t y_stride,
              int batch, m40k_stream stream);

/* 8b. GEMV with int8 activations (kernels/gemv_q8.cu): the decode path for Q8_0, Q4_0,
 * Q4_K and Q6_K weights and the regrouped Q8_0_G8 and Q6_K_G8 (0.), integer dot
 * products (dp4a) at memory bandwidth. Two steps:
 *   m40k_quantize_q8: x[b*x_stride + k] (b < batch 1..8, k < K, K a multiple of 32) into
 *     the workspace ws (16-byte aligned, m40k_gemv_q8_ws_bytes(K, batch) bytes): per
 *     block of 32 (batch row b, block j) an 80-byte record at 80*(b*K/32 + j):
 *     int8 q1[32] | int8 q2[32] | float d1, d2, s, 0. Two levels (residual
 *     quantization), IEEE division, ties to even, q = 0 where its d == 0:
 *       d1 = max|x| / 127, q1 = rint(x / d1), r = fma(-d1, q1, x) (rounded once),
 *       d2 = max|r| / 127, q2 = rint(r / d2), s = fma(d1, sum(q1), d2 * sum(q2)),
 *     so x ~ d1*q1 + d2*q2, and s is that summed over the block.
 *   m40k_gemv_q8: y[b*y_stride + n] = sum over the weight's scale groups of
 *     scale * (d1 * sum(w_int * q1) + d2 * sum(w_int * q2)) minus the offset terms
 *     (Q4_0: 8*d_w*s; Q4_K: dmin*m*s), all in F32 (the exact definition:
 *     m40_ref_gemv_q8 in kernels/ref/cpu_ref.c), for the ws written by m40k_quantize_q8 with
 *     the same K, batch. K a multiple of 32 (256 for the K-quants and Q8_0_G8, 2048 for
 *     Q6_K_G8), W 16-byte aligned
 *     (rows packed as for m40k_gemv; other alignments: use m40k_gemv). Never reads past
 *     the 16-byte-aligned chunk that holds W's last byte.
 * One quantization serves every matrix applied to the same x.
 * Accuracy. With u = 2^-24 and a = max|x| of a block: |x/d1 - q1| <= 1/2 + 128u, so
 * |r| <= d1*(1/2 + 128u) and d2 <= a/(127*254) * (1 + 260u); likewise
 * |r - d2*q2| <= d2*(1/2 + 128u), and the rounding of r adds at most u*|r|. So
 *   |x - (d1*q1 + d2*q2)| <= a/254^2 * (1 + 2^-14)
 * per element (a >= 1e-33, where d2 is a normal float), against a/254 for one level.
 * Compared with m40k_gemv (exact F32 x) the result differs by at most
 *   sum_k |W[n][k]| * max|x of k's block| / 254^2 * (1 + 2^-14)
 * plus the F32 rounding of the two sums. */
size_t m40k_gemv_q8_ws_bytes(int K, int batch);
int m40k_quantize_q8(const float *x, int64_t x_stride, int K, int batch, void *ws, m40k_stream stream);
int m40k_gemv_q8(const void *w, int w_type, int N, int K, const void *ws, int batch, float *y, int64_t y_stride,
                 m40k_stream stream);
/* Two products of the same x (ws) in one launch, as two m40k_gemv_q8 calls would write
 * them: y[n] = W0[n] . x for n < N0, y[N0 + n] = W1[n] . x for n < N1 (both K wide).
 * Batch 1 and W0 in Q4_K, W1 in Q6_K or Q6_K_G8 only (Q4_K_M's [q; k] and v); M40K_INVALID for
 * anything else, and the caller launches the two apart. */
int m40k_gemv_q8_pair(const void *w0, int type0, int N0, const void *w1, int type1, int N1, int K, const void *ws,
                      int batch, float *y, int64_t y_stride, m40k_stream stream);

/* 8d. The residual add + RMSNorm between two int8 GEMVs of a decode layer, folded into
 * both (batch 1). The producer, m40k_gemv_q8_add_norm, multiplies W (N x K, N a multiple
 * of 32) by the activations in ws as m40k_gemv_q8 and, instead of y, writes per row n
 * the residual x plus the product and its bias (NULL: none),
 *     x_out[n] = x[n] + ((W . ws)[n] + bias[n]),
 * and per group j of 32 rows the int8 records of x_out[32j .. 32j+32) * norm_w[..] (as
 * m40k_quantize_q8 writes them) into xq_out, and the group's sum of squares of x_out
 * into ss_out[j] (N/32 floats). A block holds whole groups: no exchange between blocks.
 * x_out may be x (each element read and written by one thread); xq_out must not be ws.
 * The consumer, m40k_gemv_q8_normed (and the pair, m40k_gemv_q8_pair_normed), multiplies
 * those records and scales the product by rsqrt(sum(ss[0 .. K/32)) / K + eps): with
 * x_out's RMSNorm r = x_out * rsqrt(mean(x_out^2) + eps) * norm_w it is W' . r, the
 * quantization taken before the scale instead of after it (the same relative error).
 * Every block of the consumer sums ss in one fixed order: one factor for all rows.
 * Twins: m40_ref_gemv_q8_add_norm and m40_ref_norm_factor (kernels/ref/cpu_ref.h). Types and
 * K as m40k_gemv_q8. */
int m40k_gemv_q8_add_norm(const void *w, int w_type, int N, int K, const void *ws, const float *bias, const float *x,
                          float *x_out, const float *norm_w, void *xq_out, float *ss_out, m40k_stream stream);
int m40k_gemv_q8_normed(const void *w, int w_type, int N, int K, const void *ws, const float *ss, float eps,
                        float *y, int64_t y_stride, m40k_stream stream);
int m40k_gemv_q8_pair_normed(const void *w0, int type0, int N0, const void *w1, int type1, int N1, int K,
                             const void *ws, const float *ss, float eps, float *y, int64_t y_stride,
                             m40k_stream stream);

/* 8c. F16 GEMV on the tensor cores (kernels/gemm_skinny.cu), for decode steps of 1..8
 * token rows where a row-per-warp GEMV leaves bandwidth unused (long K, several rows):
 * y[t*ldy + r] = sum_k W[r][k] * f16(x[t*x_stride + k]), r < N, t < n (1..8). W F16
 * [N][K] row-major and x (F32) 16-byte aligned, x_stride a multiple of 4; K a multiple
 * of 128; ldy >= N. x is rounded to F16 (as the tiled path's cuBLAS products round it);
 * F32 accumulation in an order of its own (twin: m40_ref_gemv of W on f16(x)).
 * n_splits (1..K/128) splits K over blocks; n_splits > 1 needs:
 *   - workspace: m40k_gemm_skinny_ws_floats(N, n, n_splits) floats (scratch);
 *   - counters: m40k_gemm_skinny_counter_ints(N) ints of device memory the caller ZEROES
 *     ONCE; every completed call leaves them zero (as 6's counters; one array serves
 *     every later call up to that N on one stream).
 * The split sums are added in a fixed order: results do not depend on timing.
 * m40k_gemm_skinny_pick_splits: a split count for the shape within the caller's
 * workspace and counters (1 when they are too small). */
size_t m40k_gemm_skinny_ws_floats(int N, int n, int n_splits);
size_t m40k_gemm_skinny_counter_ints(int N);
int m40k_gemm_skinny_pick_splits(int N, int K, int n, int sm_count, size_t ws_floats, size_t counter_ints);
int m40k_gemm_skinny(const uint16_t *w, int N, int K, const float *x, int64_t x_stride, int n, float *y, int64_t ldy,
                     int n_splits, float *workspace, int *counters, m40k_stream stream);
/* The same product of x = act(gate) * up elementwise (8c's x, the GLU output m40k_glu
 * would write: act M40K_GLU_SILU or M40K_GLU_GELU_TANH), read from gate[t*in_stride + k]
 * and up[t*in_stride + k] (both 16-byte aligned) and never stored: the FFN's down
 * projection straight from the gate/up product, without m40k_glu in between. Twin:
 * m40_ref_glu, then m40_ref_gemv of W on f16 of its output. */
int m40k_gemm_skinny_glu(int act, const uint16_t *w, int N, int K, const float *gate, const float *up,
                         int64_t in_stride, int n, float *y, int64_t ldy, int n_splits, float *workspace, int *counters,
                         m40k_stream stream);

/* 8e. Quantized GEMM on the tensor cores (kernels/gemm_q.cu) for products of 9 and more
 * token rows, decode batches and prefill chunks alike: y[t*ldy + r] = sum_k W[r][k] *
 * x[t*x_stride + k], r < N, t < M. W: rows of K elements of w_type packed (F16, Q8_0, Q4_0,
 * Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, BF16, MXFP4 (direct kernel), Q8_0_G8, Q6_K_G8,
 * Q6_K_P: m40k_gemm_q_supported; BF16 values are rounded to F16), K a multiple of
 * the type's block (and of 8); any alignment. x F16, 16-byte aligned, x_stride a multiple
 * of 8. Each weight is dequantized in shared memory to F16(q * F16(scale) - F16(offset))
 * (one F16 fused multiply-add; q, scale and offset of its group as in quant_dev.h): for
 * Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 the value m40k_embed's F16 output holds, for Q4_K and
 * Q6_K within 2^-11 of the weight's size of it. Then F16 x F16 products with F32
 * accumulation (twin: m40_ref_gemm_q). No per-call scratch copy of W: each block reads
 * its weight tile's quantized bytes once.
 * Where the rows allow (K a multiple of 256, W and its rows 16-byte aligned, a type whose
 * 256-element chunks are 16-byte multiples: all but plain Q6_K and F16) the raw chunks
 * come into shared memory by cp.async a chunk ahead and are dequantized from there;
 * otherwise straight from global memory (byte loads, any alignment): the same values
 * and the same order of sums either way.
 * n_splits (1..ceil(K/256)) splits K over blocks; n_splits > 1 needs:
 *   - workspace: m40k_gemm_q_ws_floats(N, M, n_splits) floats (scratch);
 *   - counters: m40k_gemm_q_counter_ints(N, M) ints of device memory the caller ZEROES
 *     ONCE; every completed call leaves them zero (as 6's counters; one array serves every
 *     later call up to that size on one stream).
 * The split sums are added in a fixed order: results do not depend on timing.
 * Two kernels (m40k_gemm_q_kernel says which takes a product): products of 1..64 token
 * rows in Q4_K, Q8_0_G8, Q6_K_G8 and Q6_K_P with aligned rows (K a multiple of 256, 2048
 * for Q6_K_G8) take the register kernel (gemm_q_reg.cu: the weights formed straight into the
 * mma fragments); everything else the shared-memory tile kernel (staged or direct, as
 * above). Same weights, same F32 sums of F16 products; the order of the sums differs
 * between the two kernels (and is fixed within each).
 * m40k_gemm_q_tune(reg_rows): products of up to reg_rows token rows may take the register
 * kernel (default 64, its most; 0: never). Process-wide; set it before any launch.
 * The register kernel's blocks take 96, 112 or 128 weight rows, picked with the split
 * count so that the busiest SM has the least work in one wave of blocks;
 * m40k_gemm_q_rows(rows) forces one of them (0: picked; for tests), process-wide.
 * m40k_gemm_q_pick_splits: a split count for the product (its type picks the kernel)
 * within the caller's workspace and counters (1 when they are too small). */
int m40k_gemm_q_supported(int w_type);
/* Raises the kernels' shared-memory limit on the current device (once; m40k_gemm_q does
 * it too on first use): call it before capturing m40k_gemm_q into a CUDA graph. */
int m40k_gemm_q_prepare(void);
size_t m40k_gemm_q_ws_floats(int N, int M, int n_splits);
size_t m40k_gemm_q_counter_ints(int N, int M);
int m40k_gemm_q_pick_splits(int w_type, int N, int K, int M, int sm_count, size_t ws_floats, size_t counter_ints);
enum { M40K_GEMM_Q_DIRECT = 0, M40K_GEMM_Q_STAGED = 1, M40K_GEMM_Q_REGISTER = 2 };
/* m40k_gemm_q_dequant: out[r*K + k] = the F16 weight m40k_gemm_q forms of W[r][k] (r < N,
 * k < K), for products of so many rows that cuBLAS on the F16 copy is faster than either
 * kernel (prefill chunks). The staged kernel's types and layouts only (K a multiple of
 * 256, W, its rows and out 16-byte aligned); M40K_INVALID otherwise (m40k_embed's F16
 * output holds the same values for Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0). */
int m40k_gemm_q_dequant(const void *w, int w_type, int N, int K, uint16_t *out, m40k_stream stream);
int m40k_gemm_q_kernel(int w_type, int K, int M, const void *w);
void m40k_gemm_q_tune(int reg_rows);
void m40k_gemm_q_rows(int rows);
int m40k_gemm_q(const void *w, int w_type, int N, int K, const uint16_t *x, int64_t x_stride, int M, float *y,
                int64_t ldy, int n_splits, float *workspace, int *counters, m40k_stream stream);

/* 8f. int8 tensor-core GEMM (kernels/gemm_x8.cu) for products of 1..64 token rows in
 * Q4_K and Q8_0_G8 (K a multiple of 256, W 16-byte aligned): y[t*ldy + r] = sum_k
 * W[r][k] x[t][k], r < N, t < M, x given as int8 records:
 *   m40k_quantize_x8: x F16 (x[t*x_stride + k]) into xq (16-byte aligned,
 *     m40k_x8_bytes(K, M) bytes): q[M][K] int8, then per token and chunk of 256 a record
 *     of 32 bytes {F32 d = max|x|/127, 12 zero bytes, F16 s[8]}; q = rint(x/d), stored
 *     permuted within each 64 for the MMA fragments; s: the blocks' sums of q.
 *   m40k_gemm_x8: per chunk, Q4_K F32(d * F32(sum_j sc_j dot_j)) + sum_j F16(-dmin*m_j)
 *     s_j, Q8_0 sum_j d_j dot_j in F32, times the chunk's dx; F32 sums. Twins:
 *     m40_ref_quantize_x8 / m40_ref_gemm_x8.
 * n_splits, workspace and counters as 8e's (m40k_gemm_q_ws_floats / _counter_ints sizes;
 * the same zeroed counters). m40k_gemm_x8_reads says whether it takes the product;
 * m40k_gemm_x8_pick_splits gives one wave of blocks. Call m40k_gemm_x8_prepare before
 * capturing it into a CUDA graph. The engine does not call it (measured against 8e's
 * register kernel: kernels/README.md). */
size_t m40k_x8_bytes(int K, int M);
int m40k_quantize_x8(const uint16_t *x, int64_t x_stride, int K, int M, void *xq, m40k_stream stream);
int m40k_gemm_x8_reads(int w_type, int K, int M, const void *w);
int m40k_gemm_x8_pick_splits(int w_type, int N, int K, int M, int sm_count);
int m40k_gemm_x8_prepare(void);
int m40k_gemm_x8(const void *w, int w_type, int N, int K, const void *xq, int M, float *y, int64_t ldy, int n_splits,
                 float *workspace, int *counters, m40k_stream stream);

/* 9. Sampling helpers: per row r of logits [rows][stride] (n_vocab entries), writes
 * argmax token (ties: lowest id) to token[r] and its log-softmax to logprob[r]; when
 * top_k > 0 also the top_k (<= 32) largest (token, logprob) pairs, descending, to
 * top_tokens[r*top_k ..] and top_logprobs[r*top_k ..]. */
int m40k_sample_greedy(const float *logits, int64_t stride, int rows, int n_vocab, int32_t *token, float *logprob,
                       int top_k, int32_t *top_tokens, float *top_logprobs, m40k_stream stream);

/* 9c. The greedy pick folded into the head's int8 GEMV (batch 1, one row of logits):
 * m40k_gemv_q8_argmax computes y = W . x as m40k_gemv_q8 (ss == NULL) or
 * m40k_gemv_q8_normed (ss and eps as there), and also the argmax of y as
 * m40k_sample_greedy picks it (largest value, ties: lowest id; NaN skipped; -0 as +0),
 * folded into *key (8-byte aligned device memory that must hold 0 before the call) by
 * atomicMax of m40k_argmax_key(y[i], i): each block offers the key of its best row, so no
 * sampling kernel follows the head. m40k_argmax_key_id reads the id back from the key
 * (-1: no entry that is not NaN).
 * (sample_hd.h holds both, with the rank key and the random number of 9b.) */
int m40k_gemv_q8_argmax(const void *w, int w_type, int N, int K, const void *ws, const float *ss, float eps, float *y,
                        uint64_t *key, m40k_stream stream);

/* 9b. Full sampling, batched: one block per sequence s over logits row s
 * (logits + s*stride, n_vocab <= 2^23 entries, modified in place: logit bias and
 * penalties are applied to it), with the CPU sampler's order (engine/serve/sampler.c):
 *   logit bias -> penalties -> [logprobs: log-softmax at temperature 1] ->
 *   temperature -> top-k -> top-p -> min-p -> draw.
 * Rank order is (logit descending, id ascending); NaN counts as -inf and -0 as +0.
 * Temperature <= 0, top_k == 1 or a non-finite max logit give the argmax (first in rank
 * order) without a draw. Otherwise p_i = m40 exp((l_i - max) / T) (a fixed polynomial of
 * IEEE-rounded operations, identical on CPU and GPU), held as a 2^-40 fixed-point integer
 * so every sum is exact and order-free; the kept set is a prefix of the rank order:
 * the first top_k (all when top_k <= 0 or >= n_vocab), cut after the first element whose
 * inclusive mass reaches ceil(top_p * mass of the top-k) (top_p < 1), then only those
 * with p >= min_p (min_p > 0). The draw takes r = floor(rand * kept_mass / 2^64) with
 * rand = m40k_sample_random(seed, step) and picks the first element whose inclusive mass
 * exceeds r. So the GPU and the CPU twin (m40_ref_sample) pick the same token exactly.
 * The caller advances `step` once per sampled token (e.g. tokens generated so far).
 *
 * Logit bias (optional, bias_indptr NULL = none): entries bias_indptr[s] ..
 * bias_indptr[s+1] of bias_ids/bias_values are added in list order (duplicates add up;
 * ids outside [0, n_vocab) are ignored). Penalties (optional, pen_indptr NULL = none):
 * entries pen_indptr[s] .. pen_indptr[s+1] of pen_ids/pen_counts are the DISTINCT tokens
 * of the sequence's penalty window with their occurrence counts (>= 1); each gets
 *   l = repetition != 1 ? (l > 0 ? l / repetition : l * repetition) : l;
 *   l -= count * frequency + presence.
 * Outputs: token[s], logprob[s] (log-softmax of the biased, penalized logits at
 * temperature 1), and when n_top > 0 (<= 20) the n_top first (token, logprob) of the rank
 * order at top_ids[s*n_top ..], top_logprobs[s*n_top ..] (-1 / -inf past n_vocab).
 * Cost: a few passes over the row (a 4-digit radix descent on the ordered float bits per
 * threshold: top-k/top-p cut, draw, top-n), no sort. */
typedef struct {
    float temperature;        /* <= 0: greedy */
    int32_t top_k;            /* <= 0: off */
    float top_p;              /* >= 1: off */
    float min_p;              /* <= 0: off */
    float repetition_penalty; /* 1: off */
    float presence_penalty;   /* 0: off */
    float frequency_penalty;  /* 0: off */
    uint32_t pad_;
    uint64_t seed;
    uint64_t step;
} m40k_sample_params;

int m40k_sample(float *logits, int64_t stride, int n_seq, int n_vocab, const m40k_sample_params *params,
                const int32_t *bias_indptr, const int32_t *bias_ids, const float *bias_values,
                const int32_t *pen_indptr, const int32_t *pen_ids, const int32_t *pen_counts, int32_t *token,
                float *logprob, int n_top, int32_t *top_ids, float *top_logprobs, m40k_stream stream);

/* 10. Mixtures of experts (kernels/moe.cu, the grouped product in gemm_q.cu; twins in
 * kernels/ref/moe_ref.c). A token t picks k of n_expert experts (k 1..8, n_expert 1..256);
 * pair p = t*k + j is its j-th choice, ids[p] the expert and weights[p] its weight. An
 * expert tensor holds n_expert matrices one after the other (GGUF's 3-D ffn_*_exps:
 * expert e's matrix of N rows x K at byte e * N * row_bytes). Nothing here goes through
 * the host: every count, offset and choice stays in device memory, so a decode step with
 * these launches can be captured in a CUDA graph.
 *
 * 10a. Router logits: logits[t*n_expert + e] = sum_i wr[e*dim + i] * x[t*x_stride + i]
 * (+ bias[e] where bias is not NULL); wr F32 (GGUF keeps ffn_gate_inp in F32), any dim. */
int m40k_moe_router_logits(const float *wr, const float *bias, int n_expert, int dim, const float *x,
                           int64_t x_stride, int n_tokens, float *logits, m40k_stream stream);
/* 10a'. The same on the RMSNorm that the attention output projection before folded in
 * (8d's producer): x holds the residual rows x_out, norm_w the norm's weights and ss their
 * sums of squares per 32 elements (dim/32 floats a token, token t's from ss + t * dim/32);
 * logits = (sum_i wr[e][i] * x[i] * norm_w[i]) * rsqrt(sum(ss) / dim + eps) (+ bias[e]),
 * every block summing ss in one order. dim a multiple of 32, eps >= 0; norm_w and ss both
 * NULL: 10a. Twin: m40_ref_moe_router_logits of x * norm_w, times m40_ref_norm_factor. */
int m40k_moe_router_logits_normed(const float *wr, const float *bias, int n_expert, int dim, const float *x,
                                  int64_t x_stride, const float *norm_w, const float *ss, float eps, int n_tokens,
                                  float *logits, m40k_stream stream);
/* 10b. Top-k and gating, a thread block a token, from logits [n_tokens][n_expert]:
 *   M40K_MOE_SOFTMAX:      p = softmax(logits) over all experts; the k largest logits
 *                          (= the k largest p) chosen, weight p (Qwen3-MoE, Mixtral);
 *   M40K_MOE_SIGMOID:      p = sigmoid(logit); chosen by p + sel_bias[e] (sel_bias may be
 *                          NULL: 0), weight p (DeepSeek-V3 style);
 *   M40K_MOE_SOFTMAX_TOPK: the k largest logits chosen, weights the softmax of those k
 *                          logits (gpt-oss).
 * Then norm != 0 divides the k weights by their sum, and every weight is multiplied by
 * scale. Ties choose the lower expert id; NaN logits count as -inf (never chosen before a
 * number; a softmax over nothing but -inf weighs them equally).
 * ids[t*k + j], weights[t*k + j] in order of choice (largest first). */
enum { M40K_MOE_SOFTMAX = 0, M40K_MOE_SIGMOID = 1, M40K_MOE_SOFTMAX_TOPK = 2 };
int m40k_moe_topk(const float *logits, int n_tokens, int n_expert, int k, int gating, const float *sel_bias, int norm,
                  float scale, int32_t *ids, float *weights, m40k_stream stream);

/* 10c. Batch-1 (and small batch) expert GEMV, gate and up fused with the activation: for
 * every pair p = t*k + j with e = ids[p] in [0, n_expert),
 *   g = W_gate[e] . x_t + gate_b[e*n_ff + n],  u = W_up[e] . x_t + up_b[e*n_ff + n],
 *   h[p*h_stride + n] = act(g, u),  n < n_ff,
 * act M40K_GLU_SILU: silu(g) * u; M40K_GLU_SWIGLU_OAI (gpt-oss): with gc = min(g, 7),
 * uc = clamp(u, -7, 7): gc * sigmoid(1.702 * gc) * (uc + 1). Biases may be NULL (0). A
 * pair whose id is out of range gets a zero row. Only the chosen experts' rows are read.
 * W_gate and W_up: the same w_type (F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K,
 * Q4_K, Q5_K, Q6_K, Q6_K_P, MXFP4), n_expert matrices of n_ff x dim; dim a multiple of the block
 * (8 for F16 / BF16), x 16-byte aligned, x_stride a multiple of 4. n_tokens * k pairs.
 * 10d. The down projection with the weighted sum over the token's experts:
 *   out[t*out_stride + n] = (accumulate ? out[..] : 0) +
 *       sum_{j<k} weights[t*k+j] * (W_down[e_j][n] . h[(t*k+j)*h_stride ..] + down_b[e_j*dim + n])
 * summed in the order j = 0..k-1; n < dim; out-of-range ids contribute nothing. W_down:
 * n_expert matrices of dim x n_ff; n_ff a multiple of the block, h 16-byte aligned,
 * h_stride a multiple of 4. accumulate adds into out (the residual, or a shared expert's
 * output). Twins: m40_ref_moe_gate_up, m40_ref_moe_down.
 * Both are launched with programmatic dependent launch where their fast kernels take the
 * type (F16, BF16, Q8_0, Q4_0, Q4_K, Q6_K, Q6_K_P, MXFP4; 16-byte aligned matrices, and rows
 * of 16-byte multiples for F16, BF16, Q4_K, Q6_K_P): the gate/up kernel waits for the kernel before it
 * first; the down kernel reads ids BEFORE its wait (its first weight rows load while the
 * gate/up kernel ends), so ids must not be the output of the kernel launched just before
 * m40k_moe_down (in the pipeline router -> top-k -> gate/up -> down they are top-k's). */
enum { M40K_GLU_SWIGLU_OAI = 2 };
#define M40K_OAI_ALPHA 1.702f
#define M40K_OAI_LIMIT 7.0f
int m40k_moe_gate_up(const void *w_gate, const void *w_up, int w_type, int n_expert, int n_ff, int dim,
                     const float *gate_b, const float *up_b, int act, const float *x, int64_t x_stride,
                     const int32_t *ids, int n_tokens, int k, float *h, int64_t h_stride, m40k_stream stream);
int m40k_moe_down(const void *w_down, int w_type, int n_expert, int dim, int n_ff, const float *down_b,
                  const float *h, int64_t h_stride, const int32_t *ids, const float *weights, int n_tokens, int k,
                  float *out, int64_t out_stride, int accumulate, m40k_stream stream);
/* 10c'. 10c on x's int8 records (kernels/gemv_q8.cu): h as 10c with each dot product
 * W[e][n] . x_t replaced by m40k_gemv_q8's product of that row and the records of token t
 * (xq: m40k_quantize_q8 of x with K = dim, batch n_tokens; the record error bound of 8b
 * applies). Types Q8_0, Q4_0, Q4_K, Q6_K (the file's layout) and MXFP4_P, dim a multiple
 * of their block (MXFP4_P: of 32; m40k_moe_gate_up_q8_supported), W_gate, W_up and xq
 * 16-byte aligned, n_tokens <= 8. hq, where not NULL (n_ff a multiple of 32, 16-byte aligned,
 * m40k_moe_q8_records_bytes(n_tokens * k, n_ff) bytes), also receives the records of each
 * pair's h (as m40k_quantize_q8 of h with K = n_ff writes them; pair p's at record
 * p * n_ff / 32) for 10d'. Launched with PDL as 10c: waits for the kernel before it
 * first. Twin: per pair, m40_ref_gemv_q8 of the expert's gate and up rows, then act.
 * 10d'. 10d on those records of h: out as 10d with each W_down[e_j][n] . h_(t,j) replaced
 * by m40k_gemv_q8's product of that row and pair (t, j)'s records; the weighted sum over j
 * in an order of its own, then the biases in order j. Types as 10c' and Q6_K_P, n_ff a
 * multiple of their block and of 32 (m40k_moe_down_q8_supported), W_down and hq 16-byte
 * aligned. Reads ids before its PDL wait, as 10d. Twin: per pair, m40_ref_gemv_q8 of the
 * expert's down rows on m40_ref_quantize_q8 of h, weighted and summed. */
int m40k_moe_gate_up_q8_supported(int w_type, int dim);
int m40k_moe_down_q8_supported(int w_type, int n_ff);
size_t m40k_moe_q8_records_bytes(int n_pairs, int n_ff);
int m40k_moe_gate_up_q8(const void *w_gate, const void *w_up, int w_type, int n_expert, int n_ff, int dim,
                        const float *gate_b, const float *up_b, int act, const void *xq, const int32_t *ids,
                        int n_tokens, int k, float *h, int64_t h_stride, void *hq, m40k_stream stream);
/* 10c'n. 10c' on the records 8d's producer wrote (of x_out * norm_w, unscaled): each
 * pair's gate and up products are multiplied by its token's factor rsqrt(sum(ss) / dim +
 * eps) (ss: dim/32 floats a token, as 10a') before the biases and act. ss NULL: 10c'.
 * Twin: as 10c', the products times m40_ref_norm_factor. */
int m40k_moe_gate_up_q8_normed(const void *w_gate, const void *w_up, int w_type, int n_expert, int n_ff, int dim,
                               const float *gate_b, const float *up_b, int act, const void *xq, const float *ss,
                               float eps, const int32_t *ids, int n_tokens, int k, float *h, int64_t h_stride,
                               void *hq, m40k_stream stream);
int m40k_moe_down_q8(const void *w_down, int w_type, int n_expert, int dim, int n_ff, const float *down_b,
                     const void *hq, const int32_t *ids, const float *weights, int n_tokens, int k, float *out,
                     int64_t out_stride, int accumulate, m40k_stream stream);

/* 10e. Batches: the pairs grouped by expert, on the GPU (one block). counts[e] = pairs
 * choosing e; offsets[0..n_expert] their exclusive prefix sum (offsets[n_expert] = pairs
 * with an id in range); perm[i] = the pair at sorted position i (by expert, then by pair
 * index: stable, so the result does not depend on timing); inv[p] = the sorted position of
 * pair p (-1 for an out-of-range id); perm[i] = -1 for i >= offsets[n_expert]. tiles: m40k_moe_max_tiles(n_pairs, n_expert, bm)
 * entries of two int32 (expert e, first row m0 within e's group) covering every group in
 * pieces of bm rows (16, 32, 64 or 128: the grouped product's block rows), then entries
 * (-1, 0) to the end. All outputs device memory; n_pairs = n_tokens * k. */
static inline int m40k_moe_max_tiles(int n_pairs, int n_expert, int bm)
{
    /* every non-empty group rounds up once: at most min(n_expert, n_pairs) extra tiles */
    return n_pairs <= 0 || n_expert <= 0 || bm <= 0 ? 0 : n_pairs / bm + (n_expert < n_pairs ? n_expert : n_pairs);
}
int m40k_moe_group(const int32_t *ids, int n_pairs, int n_expert, int bm, int32_t *counts, int32_t *offsets,
                   int32_t *perm, int32_t *inv, int32_t *tiles, m40k_stream stream);
/* 10f. x of each sorted pair's token, as F16 for the grouped product:
 * out16[i*out_stride + c] = f16(x[(perm[i] / k)*x_stride + c]), i < n_pairs, c < dim
 * (zeros where perm[i] < 0). */
int m40k_moe_gather_f16(const float *x, int64_t x_stride, int dim, const int32_t *perm, int n_pairs, int k,
                        uint16_t *out16, int64_t out_stride, m40k_stream stream);
/* 10g. The grouped quantized product, one launch for every expert: for each expert e and
 * sorted row i in offsets[e] .. offsets[e+1],
 *   y[i*ldy + r] = sum_c W[e][r][c] * x[i*x_stride + c],  r < N,
 * with m40k_gemm_q's weights and sums (8e; its types, MXFP4 included; twin:
 * m40_ref_gemm_q per expert): tiles of 16-64 rows (bm) in the register kernel's types
 * (Q4_K, Q8_0_G8, Q6_K_G8, Q6_K_P with aligned rows and expert matrices) on its grouped kernel,
 * everything else on the shared-memory kernel, staged or direct as there. tiles /
 * max_tiles / bm as m40k_moe_group wrote them with the same bm. x 16-byte aligned,
 * x_stride a multiple of 8 and >= K. m40k_moe_gemm_q_tune(reg_rows): tiles of up to
 * reg_rows rows may take the register kernel (default 64; 0: never; process-wide, before
 * any launch). */
int m40k_moe_gemm_q(const void *w, int w_type, int n_expert, int N, int K, const uint16_t *x, int64_t x_stride,
                    const int32_t *offsets, const int32_t *tiles, int max_tiles, int bm, float *y, int64_t ldy,
                    m40k_stream stream);
void m40k_moe_gemm_q_tune(int reg_rows);
/* 10h. The activation between the grouped products, per sorted row i (pair p = perm[i],
 * expert e = ids[p]): out16[i*out_stride + n] = f16(act(gate[i*in_stride + n] +
 * gate_b[e*n_ff + n], up[i*in_stride + n] + up_b[e*n_ff + n])) (act and NULL biases as
 * 10c), n < n_ff, i < n_pairs; rows with perm[i] < 0 untouched. */
int m40k_moe_glu_sorted(int act, const float *gate, const float *up, int64_t in_stride, const float *gate_b,
                        const float *up_b, const int32_t *ids, const int32_t *perm, int n_pairs, int n_ff,
                        uint16_t *out16, int64_t out_stride, m40k_stream stream);
/* 10i. Back to the tokens: out[t*out_stride + n] = (accumulate ? out : 0) +
 * sum_{j<k, inv[t*k+j] >= 0} weights[t*k+j] * (y[inv[t*k+j]*ldy + n] + down_b[e_j*dim + n]),
 * in the order j = 0..k-1, as 10d. */
int m40k_moe_combine(const float *y, int64_t ldy, const int32_t *inv, const int32_t *ids, const float *weights,
                     const float *down_b, int n_expert, int n_tokens, int k, int dim, float *out, int64_t out_stride,
                     int accumulate, m40k_stream stream);

/* 11. Tensor parallelism's all-reduce of a small product on NCCL's device API
 * (kernels/tp_allreduce.cu): out[i] = the sum over the LSA team's ranks r = 0, 1, .., n-1,
 * in that order, of float i at byte offset in_off of rank r's window (i < count). Every
 * rank of the team calls it with the same count, each on its own GPU; each rank's input
 * is complete on its stream when the call is enqueued and stays unwritten until the
 * team's next call (kernels/tp_allreduce.cu says why). dev_comm: the bytes of the
 * rank's ncclDevComm (m40k_tp_devcomm_bytes of them: 0 where the build had no NCCL
 * device headers, and the call returns cudaErrorNotSupported) from ncclDevCommCreate
 * with the requirements m40k_tp_devcomm_reqs writes into reqs (at most cap bytes; returns
 * their size, 0 where they do not fit): M40K_TP_AR_BLOCKS LSA barriers, nothing else;
 * win: the rank's ncclWindow_t of its input; abort: NULL, or an int the GPU can read
 * (mapped host memory) that the host sets to nonzero to end the calls still waiting for
 * a peer that will not come (their outputs are then not written). The engine calls NCCL's host API itself
 * (engine/gpu/tp.c), so these keep NCCL's device types out of its C. Twin:
 * m40_ref_tp_allreduce; test: tests/gpu/test_tp_allreduce.cu. */
#define M40K_TP_AR_BLOCKS 32
size_t m40k_tp_devcomm_bytes(void);
size_t m40k_tp_devcomm_reqs(void *reqs, size_t cap);
/* NCCL_VERSION_CODE of the headers these were built with (0: none): the device API's
 * structures are those of that release, so the engine takes it only from a libnccl of
 * the same version, patch level included. */
int m40k_tp_nccl_version(void);
int m40k_tp_allreduce(const void *dev_comm, void *win, size_t in_off, float *out, int64_t count, const int *abort,
                      m40k_stream stream);

#ifdef __cplusplus
}
#endif

#endif
