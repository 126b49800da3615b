/* The architecture table (see arch.h). The rows name the reference each was checked
 * against: ../shared/models (llama, qwen2), tests/unit/test_gemma3.c and Gemma 3 270M
 * (gemma3), ../shared/models/next (qwen3, phi3, gemma2, llama with key_length). */
#include "arch.h"

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
     .final_softcap_default = 30.0f, .swa_period = 2, .gemma_attn_scale = 1},
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

const char *m40_arch_names(void) { return "llama, qwen2, gemma3, qwen3, phi3, gemma2"; }
