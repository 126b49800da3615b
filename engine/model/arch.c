/* The architecture table (see arch.h). The rows name the reference each was checked
 * against: ../shared/models (llama, qwen2), tests/unit/test_gemma3.c and Gemma 3 270M
 * (gemma3), ../shared/models/next (qwen3, phi3, gemma2, llama with key_length, qwen3moe, gpt-oss). */
#include "arch.h"

#include <stdio.h>
#include <string.h>

static const m40_arch arches[] = {
    {.name = "llama", .rope = M40_ROPE_NORM, .act = M40_ACT_SILU, .f16_round_ragged = 1, .gpu_validated = 1},
    {.name = "qwen2", .rope = M40_ROPE_NEOX, .qkv_bias = 1, .act = M40_ACT_SILU, .f16_round_ragged = 1,
     .gpu_validated = 1},
    /* Gemma 3: every layer global once in 6; local layers keep RoPE base 10000, which
     * the usual converters do not store. */
    {.name = "gemma3", .rope = M40_ROPE_NEOX, .qk_norm = 1, .sandwich_norms = 1, .act = M40_ACT_GELU_TANH,
     .embd_scale_sqrt_dim = 1, .final_softcap = 1, .swa_period = 6, .swa_rope_base = 10000.0f,
     .rope_linear_global = 1, .gemma_attn_scale = 1, .gpu_validated = 1},
    /* Qwen3 dense: llama with per-head Q/K norms, NeoX RoPE, no biases. */
    {.name = "qwen3", .rope = M40_ROPE_NEOX, .qk_norm = 1, .act = M40_ACT_SILU, .gpu_validated = 1},
    /* Phi-3 / Phi-4: fused attn_qkv and gate+up; its stored sliding_window is ignored. */
    {.name = "phi3", .rope = M40_ROPE_NEOX, .act = M40_ACT_SILU, .fused_qkv = 1, .fused_gate_up = 1, .gpu_validated = 1},
    /* Gemma 2: sandwich norms, GeGLU, both soft-caps (50 and 30 when the file does not
     * say, as Gemma 2 is defined), even layers local, one RoPE base. */
    {.name = "gemma2", .rope = M40_ROPE_NEOX, .sandwich_norms = 1, .act = M40_ACT_GELU_TANH,
     .embd_scale_sqrt_dim = 1, .attn_softcap = 1, .attn_softcap_default = 50.0f, .final_softcap = 1,
     .final_softcap_default = 30.0f, .swa_period = 2, .gemma_attn_scale = 1, .gpu_validated = 1},
    /* Qwen3-MoE (30B-A3B, 235B-A22B): qwen3's attention, a softmax router whose top-k
     * weights are renormalized, no shared experts. */
    {.name = "qwen3moe", .rope = M40_ROPE_NEOX, .qk_norm = 1, .act = M40_ACT_SILU, .moe = 1,
     .moe_gating = M40_GATING_SOFTMAX, .moe_norm_topk = 1, .gpu_validated = 1},
    /* gpt-oss (20b, 120b): q/k/v/o biases, attention sinks, even layers local (sliding
     * window), YaRN, its FFN norm stored as post_attention_norm, router and expert
     * biases, softmax over the chosen logits, SwiGLU-OAI. */
    {.name = "gpt-oss", .rope = M40_ROPE_NEOX, .qkv_bias = 1, .act = M40_ACT_SWIGLU_OAI, .swa_period = 2,
     .moe = 1, .moe_gating = M40_GATING_SOFTMAX_SELECTED, .moe_biases = 1, .attn_out_bias = 1, .attn_sinks = 1,
     .ffn_norm_post_attention = 1, .rope_yarn = 1, .gpu_validated = 1},
};

const m40_arch *m40_arch_find(const char *name)
{
    if (!name)
        return NULL;
    for (size_t i = 0; i < sizeof arches / sizeof arches[0]; i++)
        if (!strcmp(arches[i].name, name))
            return &arches[i];
    return NULL;
}

const char *m40_arch_names(void) { return "llama, qwen2, gemma3, qwen3, phi3, gemma2, qwen3moe, gpt-oss"; }

int m40_arch_device_ok(const m40_arch *a, int device, char *err, size_t errlen)
{
    /* A row whose GPU path has not been checked against its reference runs on the CPU
     * only: refusing is better than serving quietly wrong tokens. */
    if (device < 0 || a->gpu_validated)
        return 0;
    snprintf(err, errlen, "architecture '%s' runs on the CPU only in this build: its GPU path is not validated yet",
             a->name);
    return -1;
}
