/* The architecture table (see arch.h). The rows name the reference each was checked
 * against: ../shared/models (llama, qwen2), tests/unit/test_gemma3.c and Gemma 3 270M
 * (gemma3), ../shared/models/next (llama with key_length). */
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

const char *m40_arch_names(void) { return "llama, qwen2, gemma3"; }
