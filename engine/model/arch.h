/* The architecture table: one row per GGUF general.architecture the engine loads, saying
 * what its graph has beyond the plain llama block
 *
 *   x += Wo attn(rope(Wq n), rope(Wk n), Wv n),  n = attn_norm(x)
 *   x += Wdown(silu(Wgate m) * Wup m),           m = ffn_norm(x)
 *
 * The loader (model_load.c) reads a row once and fills each layer's tensors accordingly;
 * the forward passes then test the layer (L->q_norm != NULL, L->local, ...) and the
 * model's scalars, never the architecture's name. Adding a dense architecture is a row
 * here, plus code only for an op that is really new. Not public API. */
#ifndef M40_ARCH_H
#define M40_ARCH_H

#include <stddef.h>
#include <stdint.h>

typedef enum {
    M40_ROPE_NORM, /* adjacent pairs (2i, 2i+1): the GGUF conversion permuted Wq/Wk for it */
    M40_ROPE_NEOX  /* halves (i, i + rope_dim/2) */
} m40_rope_style;

typedef enum {
    M40_ACT_SILU,      /* SwiGLU: silu(gate) * up */
    M40_ACT_GELU_TANH, /* GeGLU with the tanh approximation (gelu_pytorch_tanh) */
    /* gpt-oss's SwiGLU: g = min(gate, 7), u = clamp(up, -7, 7), g * sigmoid(1.702 g) * (u + 1) */
    M40_ACT_SWIGLU_OAI
} m40_activation;

/* How a mixture of experts turns one token's router logits into the weights of its k
 * chosen experts. The values are llama.cpp's <arch>.expert_gating_func numbering. */
typedef enum {
    M40_GATING_SOFTMAX = 1,         /* softmax over all experts, the k largest probabilities */
    M40_GATING_SIGMOID = 2,         /* sigmoid of each logit, the k largest */
    M40_GATING_SOFTMAX_SELECTED = 3 /* the k largest logits, softmax over those k only (gpt-oss) */
} m40_gating;

typedef struct {
    const char *name;          /* general.architecture */
    m40_rope_style rope;
    uint8_t qkv_bias;          /* attn_{q,k,v}.bias required (else optional, usually absent) */
    uint8_t qk_norm;           /* attn_{q,k}_norm: RMSNorm of each head over head_dim, before RoPE */
    uint8_t sandwich_norms;    /* post_attention_norm and post_ffw_norm on each block's output */
    m40_activation act;
    uint8_t embd_scale_sqrt_dim; /* the embeddings are multiplied by sqrt(n_embd) */
    /* Soft-capping c * tanh(x / c): of q.k (<arch>.attn_logit_softcapping) and of the
     * logits (<arch>.final_logit_softcapping), with these values when the key is absent
     * (0: none); a row without the flag never caps. */
    uint8_t attn_softcap, final_softcap;
    float attn_softcap_default, final_softcap_default;
    /* Sliding-window attention: 0 none (any <arch>.attention.sliding_window is ignored,
     * as Phi-3-mini's is by the reference implementation); N > 0: <arch>.attention.
     * sliding_window is required and, unless <arch>.attention.sliding_window_pattern
     * says otherwise, layer l is local when l % N < N - 1 (every Nth layer global). */
    int32_t swa_period;
    /* RoPE base of the local layers when <arch>.rope.freq_base_swa is absent; 0: the
     * global base. */
    float swa_rope_base;
    uint8_t rope_linear_global; /* rope.scaling.type "linear" accepted, global layers only */
    /* Gemma's query_pre_attn_scalar: q.k scaled by <arch>.attention.scale when present,
     * else 1/sqrt(n_embd/n_head) for the 27B shapes (not stored in the GGUF, so known by
     * shape in model_load.c), else 1/sqrt(head_dim) as for every other row. */
    uint8_t gemma_attn_scale;
    uint8_t fused_qkv;         /* attn_qkv holds the rows of q, k and v (split into views at load) */
    uint8_t fused_gate_up;     /* ffn_up holds the rows of gate then up, no ffn_gate */
    /* No column for the tied head: every row takes token_embd as the head when the file
     * has no output.weight (Qwen3 0.6B-4B and 8B+ differ within one architecture). */
    /* Mixture of experts (0 for every dense row): each layer's FFN is ffn_gate_inp (the
     * router, optional bias) choosing <arch>.expert_used_count of <arch>.expert_count
     * experts stored as 3-D ffn_{gate,up,down}_exps, each <arch>.expert_feed_forward_length
     * wide. moe_gating and moe_norm_topk are the defaults of <arch>.expert_gating_func
     * and <arch>.expert_weights_norm (the chosen weights divided by their sum);
     * <arch>.expert_weights_scale (default 1) multiplies them. moe_biases: the router and
     * the experts carry biases (required). Shared experts (ffn_*_shexp, with an optional
     * sigmoid gate ffn_gate_inp_shexp) are taken whenever the file has them. */
    uint8_t moe;
    m40_gating moe_gating;
    uint8_t moe_norm_topk;
    uint8_t moe_biases;
    uint8_t attn_out_bias;     /* attn_output.bias required */
    uint8_t attn_sinks;        /* attn_sinks.weight: one learned logit per head joins each softmax */
    /* The FFN's input norm is stored as post_attention_norm (gpt-oss), not ffn_norm. */
    uint8_t ffn_norm_post_attention;
    /* rope.scaling.type "yarn" accepted (every layer, local ones included): factor,
     * original_context_length, yarn_beta_fast/slow, and its magnitude scale on cos/sin. */
    uint8_t rope_yarn;
    /* F16 products whose row count or input length is not a multiple of 4 round their
     * input to F16 first, as the reference these rows were checked against does (see
     * rounds_input_to_f16 in model.c). */
    uint8_t f16_round_ragged;
    /* The GPU back end implements and has validated this row against its reference;
     * 0: m40_model_load refuses device >= 0 with a clear message (CPU only). */
    uint8_t gpu_validated;
} m40_arch;

/* The row for general.architecture `name`, or NULL. */
const m40_arch *m40_arch_find(const char *name);
/* "llama, qwen2, ..." (static) for error messages. */
const char *m40_arch_names(void);
/* Whether row a may run on `device` (< 0: the CPU, always): 0, or -1 with err saying
 * that the architecture runs on the CPU only (its row's gpu_validated is 0). Apart from
 * the load so that the refusal stays testable while every row is validated. */
int m40_arch_device_ok(const m40_arch *a, int device, char *err, size_t errlen);

#endif
