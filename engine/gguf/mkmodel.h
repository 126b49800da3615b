/* Synthetic GGUF models: the real tensor layout of a known model (llama, qwen3, phi3,
 * gemma2, qwen3moe, gpt-oss; m40_mkmodel_shape.arch), with
 * random weights, a synthetic SentencePiece-style vocabulary and complete metadata.
 * They exercise loading, kernels and benchmarks at full size without downloading
 * anything; their text is of course gibberish.
 *
 * Files are streamed: the header, metadata and tensor infos are laid out first (every
 * tensor's offset is known before any weight exists), then the tensors are generated
 * and quantized in row chunks over a thread pool, each chunk written with pwrite at
 * its place, so memory stays at a few MB per thread whatever the model size.
 *
 * Weights (all deterministic in (seed, tensor name, row), so the file does not depend
 * on the thread count, and the same seed gives the same underlying weights in every
 * type -- a Q4_K_M file is a quantization of the F32 file of the same seed):
 *   - matrices: approximately normal(0, 0.02): an Irwin-Hall sum of four 16-bit
 *     uniforms from xoshiro256** (mean 0, unit variance, bounded at +-2*sqrt(3)),
 *     integer-only so that the bytes are the same on every machine;
 *   - the output projections of each residual branch (attn_output, ffn_down) are
 *     further scaled by 1/sqrt(2 * n_layers), as in GPT-2's initialization, so the
 *     residual stream does not grow with depth;
 *   - norm weights are 1.0.
 *
 * Types (--type) and the tensor types they use, following llama.cpp's quantize:
 *   F32, F16, BF16: every matrix in that type, norms F32.
 *   Q8_0:           every matrix Q8_0.
 *   Q4_0:           every matrix Q4_0 except output.weight, Q6_K.
 *   Q6_K:           every matrix Q6_K.
 *   Q4_K_M:         Q4_K, except output.weight Q6_K, and attn_v / ffn_down Q6_K in
 *                   the layers where m40_mkmodel_more_bits(layer, n_layers) holds:
 *                   the first eighth (i < n/8), the last eighth (i >= 7n/8, integer
 *                   division) and every third layer in between ((i - n/8) % 3 == 2).
 *                   For 32 layers: 0-3, 6, 9, ..., 27, 28-31 (16 of 32).
 *                   Expert tensors (ffn_*_exps) follow the same rule by their name
 *                   (ffn_down_exps as ffn_down).
 *   MXFP4:          the experts MXFP4, every other matrix Q8_0 (llama.cpp's MXFP4_MOE,
 *                   as gpt-oss is published); for MoE shapes only.
 *   Norm vectors, biases, attention sinks and the routers (ffn_gate_inp) are F32 in
 *   every type. */
#ifndef M40_MKMODEL_H
#define M40_MKMODEL_H

#include <stddef.h>
#include <stdint.h>

typedef struct {
    const char *name;        /* "llama-2-7b" */
    const char *description; /* what it mirrors */
    int32_t dim;
    int32_t n_layers;
    int32_t n_heads;
    int32_t n_kv_heads;
    int32_t ffn_dim;
    int32_t n_vocab;
    int32_t ctx;
    float rope_base;
    float norm_eps;
    /* Other architectures (engine/model/arch.h rows): NULL is "llama". What the file then
     * holds beyond the llama layout: qwen3 attn_q_norm / attn_k_norm; phi3 a fused
     * attn_qkv and gate+up ffn_up; gemma2 post_attention_norm / post_ffw_norm, a tied
     * head, its sliding window and soft-caps (50, 30) in the metadata. */
    const char *arch;
    int32_t head_dim;        /* attention.key_length; 0: dim / n_heads */
    int32_t window;          /* attention.sliding_window (gemma2, gpt-oss) */
    /* Mixtures of experts (qwen3moe, gpt-oss; 0 for dense shapes): experts per layer,
     * used per token, and each expert's FFN width. The file then holds the router
     * ffn_gate_inp and 3-D ffn_{gate,up,down}_exps instead of the dense FFN; gpt-oss
     * adds q/k/v/o, router and expert biases, attn_sinks, post_attention_norm as the
     * FFN norm, and YaRN (factor 32 over an original context of 4096) in the metadata. */
    int32_t n_experts, n_experts_used, expert_ffn_dim;
} m40_mkmodel_shape;

/* File types; values are general.file_type (llama.cpp's llama_ftype numbering). */
typedef enum {
    M40_MK_F32 = 0,
    M40_MK_F16 = 1,
    M40_MK_Q4_0 = 2,
    M40_MK_Q8_0 = 7,
    M40_MK_Q4_K_M = 15,
    M40_MK_Q6_K = 18,
    M40_MK_BF16 = 32,
    M40_MK_MXFP4 = 38, /* MXFP4_MOE */
} m40_mkmodel_ftype;

/* NULL for an unknown name. m40_mkmodel_shape_at(i) walks the table (NULL past the end). */
const m40_mkmodel_shape *m40_mkmodel_find_shape(const char *name);
const m40_mkmodel_shape *m40_mkmodel_shape_at(int i);
/* "F16" etc. (case-insensitive) -> 0, or -1 for an unknown name. */
int m40_mkmodel_parse_type(const char *name, m40_mkmodel_ftype *out);
const char *m40_mkmodel_type_name(m40_mkmodel_ftype t);
/* Comma-separated list of the type names, for messages. */
const char *m40_mkmodel_type_list(void);

/* The Q4_K_M rule above. */
int m40_mkmodel_more_bits(int32_t layer, int32_t n_layers);
/* Tensor type (enum m40_type) that file type `ft` gives the tensor named `name`
 * ("output.weight", "blk.3.attn_v.weight", ...) in a model of n_layers layers. */
uint32_t m40_mkmodel_tensor_type(m40_mkmodel_ftype ft, const char *name, int32_t n_layers);

typedef struct {
    const m40_mkmodel_shape *shape;
    m40_mkmodel_ftype ftype;
    uint64_t seed;
    int32_t n_layers; /* <= 0: the shape's */
    int n_threads;    /* <= 0: every online CPU */
    int dry_run;      /* lay the file out and report its size, write nothing */
    int quick;        /* K-quants by m40_quantize_row_quick (--quick): large shapes for speed runs */
} m40_mkmodel_opts;

typedef struct {
    uint64_t file_bytes;
    uint64_t n_tensors;
    uint64_t n_params;
    uint64_t weight_bytes; /* the data section */
    int n_threads;
    double seconds;        /* wall time of the whole write */
} m40_mkmodel_stats;

/* Writes the model to path (through path.part, renamed at the end; nothing is left
 * behind on failure). 0, or -1 with err naming the problem. stats may be NULL. */
int m40_mkmodel_write(const m40_mkmodel_opts *o, const char *path, m40_mkmodel_stats *stats, char *err,
                      size_t errlen);

#endif
