/* Loading: GGUF metadata to hyperparameters and weights to per-layer tensors, as the
 * architecture's row (arch.h) says; see model_priv.h. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ref/ggml_types.h"
#include "model_internal.h"
#include "model_priv.h"

static int get_u32(const m40_gguf *g, const char *arch, const char *suffix, int required, uint32_t dflt,
                   int32_t *out, char *err, size_t errlen)
{
    uint32_t v;
    if (m40_gguf_get_arch_u32(g, suffix, &v) != 0) {
        /* Distinguish "absent" from "present with a bad type" for the message. */
        char key[160];
        snprintf(key, sizeof key, "%s.%s", arch, suffix);
        if (m40_gguf_get(g, key)) {
            m40_set_err(err, errlen, "metadata '%s' is not an unsigned 32-bit integer", key);
            return -1;
        }
        if (required) {
            m40_set_err(err, errlen, "metadata '%s' is missing", key);
            return -1;
        }
        v = dflt;
    }
    if (v > INT32_MAX) {
        m40_set_err(err, errlen, "metadata '%s.%s' = %u is out of range", arch, suffix, v);
        return -1;
    }
    *out = (int32_t)v;
    return 0;
}

static int get_f32(const m40_gguf *g, const char *arch, const char *suffix, int required, float dflt, float *out,
                   char *err, size_t errlen)
{
    if (m40_gguf_get_arch_f32(g, suffix, out) == 0)
        return 0;
    char key[160];
    snprintf(key, sizeof key, "%s.%s", arch, suffix);
    if (m40_gguf_get(g, key)) {
        m40_set_err(err, errlen, "metadata '%s' is not a number", key);
        return -1;
    }
    if (required) {
        m40_set_err(err, errlen, "metadata '%s' is missing", key);
        return -1;
    }
    *out = dflt;
    return 0;
}

/* YaRN as ggml computes it (ggml_rope_yarn_corr_dims, rope_yarn): dimension pair i
 * rotates at theta_i * freq_scale below `low`, at theta_i above `high` and at a linear
 * mix in between; low and high are the pairs whose wavelength fits beta_fast and
 * beta_slow rotations into the original context. */
static float yarn_corr_dim(int32_t n_dims, int32_t n_ctx_orig, float n_rot, float base)
{
    return (float)n_dims * logf((float)n_ctx_orig / (n_rot * 2.0f * (float)M_PI)) / (2.0f * logf(base));
}

static int load_yarn(m40_model *m, char *err, size_t errlen)
{
    const m40_gguf *g = m->gguf;
    const char *arch = m->p.arch;
    float factor, beta_fast, beta_slow, attn_factor;
    int32_t orig_ctx;
    if (get_f32(g, arch, "rope.scaling.factor", 1, 0, &factor, err, errlen) ||
        get_u32(g, arch, "rope.scaling.original_context_length", 1, 0, &orig_ctx, err, errlen) ||
        get_f32(g, arch, "rope.scaling.yarn_beta_fast", 0, 32.0f, &beta_fast, err, errlen) ||
        get_f32(g, arch, "rope.scaling.yarn_beta_slow", 0, 1.0f, &beta_slow, err, errlen) ||
        get_f32(g, arch, "rope.scaling.attn_factor", 0, 1.0f, &attn_factor, err, errlen))
        return -1;
    if (!(factor >= 1.0f && factor <= 1e6f) || orig_ctx <= 0 || !(beta_fast > 0 && beta_fast < 1e6f) ||
        !(beta_slow > 0 && beta_slow < 1e6f) || !(attn_factor > 0 && attn_factor < 1e6f)) {
        m40_set_err(err, errlen, "bad YaRN parameters: factor %g, original_context_length %d, beta_fast %g, "
                    "beta_slow %g, attn_factor %g", factor, (int)orig_ctx, beta_fast, beta_slow, attn_factor);
        return -1;
    }
    int32_t n_dims = m->p.rope_dim;
    float low = floorf(yarn_corr_dim(n_dims, orig_ctx, beta_fast, m->p.rope_base));
    float high = ceilf(yarn_corr_dim(n_dims, orig_ctx, beta_slow, m->p.rope_base));
    m->yarn = 1;
    m->yarn_freq_scale = 1.0f / factor;
    m->yarn_low = low > 0 ? low : 0;
    m->yarn_high = high < (float)(n_dims - 1) ? high : (float)(n_dims - 1);
    m->yarn_mscale = attn_factor * (1.0f + 0.1f * logf(factor));
    return 0;
}

/* RoPE: bases, the optional scaling, and how far each head is rotated. */
static int load_rope(m40_model *m, char *err, size_t errlen)
{
    const m40_gguf *g = m->gguf;
    m40_model_params *p = &m->p;
    const char *arch = p->arch;
    if (get_u32(g, arch, "rope.dimension_count", 0, (uint32_t)p->head_dim, &p->rope_dim, err, errlen))
        return -1;
    if (p->rope_dim <= 0 || p->rope_dim % 2 != 0 || p->rope_dim > p->head_dim) {
        m40_set_err(err, errlen, "rope.dimension_count %d must be even and at most the head dimension %d", p->rope_dim,
                p->head_dim);
        return -1;
    }
    if (get_f32(g, arch, "rope.freq_base", 0, 10000.0f, &p->rope_base, err, errlen))
        return -1;
    m->local_base = m->arch->swa_rope_base > 0 ? m->arch->swa_rope_base : p->rope_base;
    if (m->arch->swa_period > 0 &&
        get_f32(g, arch, "rope.freq_base_swa", 0, m->local_base, &m->local_base, err, errlen))
        return -1;
    if (!(p->rope_base > 0) || !(m->local_base > 0)) {
        m40_set_err(err, errlen, "bad RoPE bases %g (global), %g (local)", p->rope_base, m->local_base);
        return -1;
    }
    /* Context-extension schemes change the rotation angles; computing them as plain
     * RoPE would give quietly wrong answers, so refuse what the row does not implement. */
    m->global_scale = 1.0f;
    char key[160];
    snprintf(key, sizeof key, "%s.rope.scaling.type", arch);
    const char *scaling = m40_gguf_get_str(g, key);
    if (scaling && !strcmp(scaling, "linear") && m->arch->rope_linear_global) {
        if (get_f32(g, arch, "rope.scaling.factor", 0, 1.0f, &m->global_scale, err, errlen))
            return -1;
        if (!(m->global_scale > 0) || m->global_scale > 1e6f) {
            m40_set_err(err, errlen, "bad %s.rope.scaling.factor %g", arch, m->global_scale);
            return -1;
        }
    } else if (scaling && !strcmp(scaling, "yarn") && m->arch->rope_yarn) {
        if (load_yarn(m, err, errlen))
            return -1;
    } else if (scaling && !strcmp(scaling, "longrope") && m40_gguf_find_tensor(g, "rope_factors_long.weight")) {
        /* the factors and the attention factor: load_longrope */
    } else if (scaling && strcmp(scaling, "none") != 0) {
        m40_set_err(err, errlen, "RoPE scaling '%s' (%s) is not supported", scaling, key);
        return -1;
    }
    return 0;
}

/* The scalars of the row: window, attention scale, soft-caps, embedding scale. */
static int load_row_scalars(m40_model *m, char *err, size_t errlen)
{
    const m40_gguf *g = m->gguf;
    const m40_arch *a = m->arch;
    m40_model_params *p = &m->p;
    if (a->swa_period > 0) {
        if (get_u32(g, p->arch, "attention.sliding_window", 1, 0, &m->window, err, errlen))
            return -1;
        if (m->window <= 0) {
            m40_set_err(err, errlen, "bad %s.attention.sliding_window %d (must be > 0)", p->arch, (int)m->window);
            return -1;
        }
    }
    float query_pre_attn_scalar = (float)p->head_dim;
    /* Gemma 3 27B (n_embd 5376, 62 layers) and Gemma 2 27B (4608, 46) scale by
     * n_embd / n_head; the GGUF does not store it. */
    if (a->gemma_attn_scale &&
        ((p->dim == 5376 && p->n_layers == 62) || (p->dim == 4608 && p->n_layers == 46)))
        query_pre_attn_scalar = (float)p->dim / (float)p->n_heads;
    m->attn_scale = 1.0f / sqrtf(query_pre_attn_scalar);
    if (a->gemma_attn_scale && get_f32(g, p->arch, "attention.scale", 0, m->attn_scale, &m->attn_scale, err, errlen))
        return -1;
    if ((a->attn_softcap && get_f32(g, p->arch, "attn_logit_softcapping", 0, a->attn_softcap_default,
                                    &m->attn_softcap, err, errlen)) ||
        (a->final_softcap && get_f32(g, p->arch, "final_logit_softcapping", 0, a->final_softcap_default,
                                     &m->final_softcap, err, errlen)))
        return -1;
    if (!(m->attn_scale > 0) || !(m->attn_softcap >= 0) || !(m->final_softcap >= 0)) {
        m40_set_err(err, errlen, "bad attention.scale %g, attn_logit_softcapping %g or final_logit_softcapping %g",
                    m->attn_scale, m->attn_softcap, m->final_softcap);
        return -1;
    }
    m->embd_scale = a->embd_scale_sqrt_dim ? sqrtf((float)p->dim) : 1.0f;
    m->act = a->act;
    return 0;
}

/* The mixture of experts' sizes and routing (arch.h, moe): llama.cpp's key names. */
static int load_moe(m40_model *m, char *err, size_t errlen)
{
    const m40_gguf *g = m->gguf;
    const m40_arch *a = m->arch;
    m40_model_params *p = &m->p;
    if (!a->moe)
        return 0;
    int32_t gating;
    if (get_u32(g, p->arch, "expert_count", 1, 0, &p->n_experts, err, errlen) ||
        get_u32(g, p->arch, "expert_used_count", 1, 0, &p->n_experts_used, err, errlen) ||
        get_u32(g, p->arch, "expert_feed_forward_length", 0, (uint32_t)p->ffn_dim, &p->expert_ffn_dim, err,
                errlen) ||
        get_u32(g, p->arch, "expert_gating_func", 0, (uint32_t)a->moe_gating, &gating, err, errlen) ||
        get_f32(g, p->arch, "expert_weights_scale", 0, 1.0f, &m->expert_scale, err, errlen))
        return -1;
    /* 512 experts and 64 chosen bound every real model (Qwen3: 128 and 8, gpt-oss-120b:
     * 128 and 4, DeepSeek V3: 256 and 8) and the scratch sizes with them. */
    if (p->n_experts < 1 || p->n_experts > 512 || p->n_experts_used < 1 || p->n_experts_used > 64 ||
        p->n_experts_used > p->n_experts || p->expert_ffn_dim <= 0 || p->expert_ffn_dim > (1 << 22)) {
        m40_set_err(err, errlen, "bad mixture of experts: expert_count %d, expert_used_count %d, "
                    "expert_feed_forward_length %d", (int)p->n_experts, (int)p->n_experts_used,
                    (int)p->expert_ffn_dim);
        return -1;
    }
    if (gating < M40_GATING_SOFTMAX || gating > M40_GATING_SOFTMAX_SELECTED) {
        m40_set_err(err, errlen, "%s.expert_gating_func %d is not supported (1 softmax, 2 sigmoid, 3 softmax over "
                    "the chosen)", p->arch, (int)gating);
        return -1;
    }
    m->gating = (m40_gating)gating;
    /* ggml's default of 0 means "no scaling" as 1 does. */
    if (m->expert_scale == 0.0f)
        m->expert_scale = 1.0f;
    if (!(m->expert_scale > 0 && m->expert_scale < 1e6f)) {
        m40_set_err(err, errlen, "bad %s.expert_weights_scale %g", p->arch, m->expert_scale);
        return -1;
    }
    char key[160];
    snprintf(key, sizeof key, "%s.expert_weights_norm", p->arch);
    m->norm_topk = a->moe_norm_topk;
    if (m40_gguf_get(g, key) && m40_gguf_get_bool(g, key, &m->norm_topk) != 0) {
        m40_set_err(err, errlen, "metadata '%s' is not a bool", key);
        return -1;
    }
    return 0;
}

static int load_hparams(m40_model *m, char *err, size_t errlen)
{
    const m40_gguf *g = m->gguf;
    m40_model_params *p = &m->p;
    const char *arch = m40_gguf_arch(g);
    if (!arch) {
        m40_set_err(err, errlen, "metadata 'general.architecture' is missing");
        return -1;
    }
    m->arch = m40_arch_find(arch);
    if (!m->arch) {
        m40_set_err(err, errlen, "architecture '%s' is not supported (%s)", arch, m40_arch_names());
        return -1;
    }
    snprintf(p->arch, sizeof p->arch, "%s", arch);
    const char *name = m40_gguf_get_str(g, "general.name");
    snprintf(p->name, sizeof p->name, "%s", name ? name : "");
    p->rope_neox = m->arch->rope == M40_ROPE_NEOX;

    if (get_u32(g, arch, "embedding_length", 1, 0, &p->dim, err, errlen) ||
        get_u32(g, arch, "block_count", 1, 0, &p->n_layers, err, errlen) ||
        get_u32(g, arch, "attention.head_count", 1, 0, &p->n_heads, err, errlen) ||
        get_u32(g, arch, "feed_forward_length", 1, 0, &p->ffn_dim, err, errlen) ||
        get_u32(g, arch, "context_length", 1, 0, &p->ctx_train, err, errlen))
        return -1;
    if (p->dim <= 0 || p->n_heads <= 0 || p->n_layers <= 0 || p->ffn_dim <= 0 || p->ctx_train <= 0) {
        m40_set_err(err, errlen, "bad hyperparameters: embedding_length %d, block_count %d, head_count %d, "
                "feed_forward_length %d, context_length %d (all must be > 0)",
                p->dim, p->n_layers, p->n_heads, p->ffn_dim, p->ctx_train);
        return -1;
    }
    /* Bounds that keep every size computation below far from overflow. */
    if (p->dim > (1 << 20) || p->ffn_dim > (1 << 22) || p->n_layers > 4096 || p->n_heads > 4096) {
        m40_set_err(err, errlen, "hyperparameters out of range: embedding_length %d, feed_forward_length %d, "
                "block_count %d, head_count %d", p->dim, p->ffn_dim, p->n_layers, p->n_heads);
        return -1;
    }
    /* key_length: head sizes other than dim/heads (Qwen3, Gemma, Mistral-Nemo). */
    if (get_u32(g, arch, "attention.head_count_kv", 0, (uint32_t)p->n_heads, &p->n_kv_heads, err, errlen) ||
        get_u32(g, arch, "attention.key_length", 0, (uint32_t)(p->dim / p->n_heads), &p->head_dim, err, errlen))
        return -1;
    int32_t value_length;
    if (get_u32(g, arch, "attention.value_length", 0, (uint32_t)p->head_dim, &value_length, err, errlen))
        return -1;
    if (p->n_kv_heads <= 0 || p->n_heads % p->n_kv_heads != 0) {
        m40_set_err(err, errlen, "attention.head_count %d is not a multiple of attention.head_count_kv %d", p->n_heads,
                p->n_kv_heads);
        return -1;
    }
    if (p->head_dim <= 0 || p->head_dim % 2 != 0 || p->head_dim > 65536 || value_length != p->head_dim) {
        m40_set_err(err, errlen, "head dimension %d (value length %d) is not supported: it must be even and the "
                "same for keys and values", p->head_dim, value_length);
        return -1;
    }
    if (get_f32(g, arch, "attention.layer_norm_rms_epsilon", 1, 0, &p->norm_eps, err, errlen))
        return -1;
    if (!(p->norm_eps >= 0)) {
        m40_set_err(err, errlen, "bad layer_norm_rms_epsilon %g", p->norm_eps);
        return -1;
    }
    if (load_rope(m, err, errlen) || load_row_scalars(m, err, errlen) || load_moe(m, err, errlen))
        return -1;
    m->q_dim = p->n_heads * p->head_dim;
    m->kv_dim = p->n_kv_heads * p->head_dim;
    return 0;
}

/* Rows [first, first + rows) of a fused weight as a matrix of their own. */
static matrix rows_of(const matrix *w, int64_t first, int64_t rows)
{
    matrix r = *w;
    r.data = w->data + (size_t)first * w->row_bytes;
    r.rows = rows;
    return r;
}

/* Marks the sliding-window layers: <arch>.attention.sliding_window_pattern when the
 * file has it (an array of bools, true = local, one per layer; or a period N), else
 * the row's period (arch.h). */
static int load_layer_kinds(m40_model *m, char *err, size_t errlen)
{
    int32_t n_layers = m->p.n_layers, period = m->arch->swa_period;
    if (period <= 0)
        return 0;
    char key[160];
    snprintf(key, sizeof key, "%s.attention.sliding_window_pattern", m->p.arch);
    const m40_gguf_value *v = m40_gguf_get(m->gguf, key);
    if (v && v->type == M40_GGUF_ARRAY) {
        if (v->v.arr.type != M40_GGUF_BOOL || v->v.arr.n != (uint64_t)n_layers) {
            m40_set_err(err, errlen, "metadata '%s' must be an array of %d bools", key, (int)n_layers);
            return -1;
        }
        for (int32_t l = 0; l < n_layers; l++)
            m->has_local |= m->layers[l].local = v->v.arr.items[l].v.b != 0;
        return 0;
    }
    if (v) {
        if (get_u32(m->gguf, m->p.arch, "attention.sliding_window_pattern", 1, 0, &period, err, errlen))
            return -1;
        if (period <= 0) {
            m40_set_err(err, errlen, "metadata '%s' = %d must be > 0", key, (int)period);
            return -1;
        }
    }
    for (int32_t l = 0; l < n_layers; l++)
        m->has_local |= m->layers[l].local = l % period < period - 1;
    return 0;
}

/* One block's mixture of experts (arch.h): the router, the 3-D expert tensors, the
 * biases the row requires (or the file has), and a shared expert when present. */
static int load_experts(m40_model *m, int32_t l, layer *L, char *err, size_t errlen)
{
    const m40_arch *a = m->arch;
    m40_model_params *p = &m->p;
    const m40_gguf *g = m->gguf;
    int64_t E = p->n_experts, F = p->expert_ffn_dim, D = p->dim;
    int opt = !a->moe_biases;
    char n[96];
#define NAME(s) (snprintf(n, sizeof n, "blk.%d.%s", (int)l, s), n)
    if (m40_weight_matrix(g, NAME("ffn_gate_inp.weight"), D, E, &L->router, err, errlen) ||
        m40_weight_vector(g, NAME("ffn_gate_inp.bias"), E, opt, &L->router_b, err, errlen) ||
        m40_weight_experts(g, NAME("ffn_gate_exps.weight"), D, F, E, &L->exp_gate, err, errlen) ||
        m40_weight_experts(g, NAME("ffn_up_exps.weight"), D, F, E, &L->exp_up, err, errlen) ||
        m40_weight_experts(g, NAME("ffn_down_exps.weight"), F, D, E, &L->exp_down, err, errlen) ||
        m40_weight_table(g, NAME("ffn_gate_exps.bias"), F, E, opt, &L->exp_gate_b, err, errlen) ||
        m40_weight_table(g, NAME("ffn_up_exps.bias"), F, E, opt, &L->exp_up_b, err, errlen) ||
        m40_weight_table(g, NAME("ffn_down_exps.bias"), D, E, opt, &L->exp_down_b, err, errlen))
        return -1;
    const m40_gguf_tensor *sh = m40_gguf_find_tensor(g, NAME("ffn_up_shexp.weight"));
    if (sh) {
        /* Its width is the tensor's (expert_shared_feed_forward_length is not always stored). */
        if (sh->ne[1] == 0 || sh->ne[1] > (1 << 22) ||
            (p->shared_ffn_dim && sh->ne[1] != (uint64_t)p->shared_ffn_dim)) {
            m40_set_err(err, errlen, "tensor '%s' has a bad width %llu", n, (unsigned long long)sh->ne[1]);
            return -1;
        }
        p->shared_ffn_dim = (int32_t)sh->ne[1];
        int64_t S = p->shared_ffn_dim;
        if (m40_weight_matrix(g, NAME("ffn_gate_shexp.weight"), D, S, &L->sh_gate, err, errlen) ||
            m40_weight_matrix(g, NAME("ffn_up_shexp.weight"), D, S, &L->sh_up, err, errlen) ||
            m40_weight_matrix(g, NAME("ffn_down_shexp.weight"), S, D, &L->sh_down, err, errlen) ||
            m40_weight_vector(g, NAME("ffn_gate_inp_shexp.weight"), D, 1, &L->sh_gate_inp, err, errlen))
            return -1;
    } else if (p->shared_ffn_dim) {
        m40_set_err(err, errlen, "tensor '%s' is missing (earlier layers have a shared expert)", n);
        return -1;
    }
#undef NAME
    return 0;
}

/* One block's tensors, as the row says they are stored. */
static int load_layer(m40_model *m, int32_t l, layer *L, char *err, size_t errlen)
{
    const m40_arch *a = m->arch;
    const m40_model_params *p = &m->p;
    const m40_gguf *g = m->gguf;
    char n[96];
#define NAME(s) (snprintf(n, sizeof n, "blk.%d.%s", (int)l, s), n)
    if (m40_weight_vector(g, NAME("attn_norm.weight"), p->dim, 0, &L->attn_norm, err, errlen))
        return -1;
    if (a->qk_norm && (m40_weight_vector(g, NAME("attn_q_norm.weight"), p->head_dim, 0, &L->q_norm, err, errlen) ||
                       m40_weight_vector(g, NAME("attn_k_norm.weight"), p->head_dim, 0, &L->k_norm, err, errlen)))
        return -1;
    if (a->sandwich_norms &&
        (m40_weight_vector(g, NAME("post_attention_norm.weight"), p->dim, 0, &L->post_attn_norm, err, errlen) ||
         m40_weight_vector(g, NAME("post_ffw_norm.weight"), p->dim, 0, &L->post_ffw_norm, err, errlen)))
        return -1;
    if (m40_weight_vector(g, NAME(a->ffn_norm_post_attention ? "post_attention_norm.weight" : "ffn_norm.weight"),
                          p->dim, 0, &L->ffn_norm, err, errlen))
        return -1;
    if (a->attn_sinks && m40_weight_vector(g, NAME("attn_sinks.weight"), p->n_heads, 0, &L->attn_sinks, err, errlen))
        return -1;
    if (a->fused_qkv) {
        matrix qkv;
        if (m40_weight_matrix(g, NAME("attn_qkv.weight"), p->dim, m->q_dim + 2 * m->kv_dim, &qkv, err, errlen))
            return -1;
        L->wq = rows_of(&qkv, 0, m->q_dim);
        L->wk = rows_of(&qkv, m->q_dim, m->kv_dim);
        L->wv = rows_of(&qkv, m->q_dim + m->kv_dim, m->kv_dim);
    } else if (m40_weight_matrix(g, NAME("attn_q.weight"), p->dim, m->q_dim, &L->wq, err, errlen) ||
               m40_weight_matrix(g, NAME("attn_k.weight"), p->dim, m->kv_dim, &L->wk, err, errlen) ||
               m40_weight_matrix(g, NAME("attn_v.weight"), p->dim, m->kv_dim, &L->wv, err, errlen))
        return -1;
    if (m40_weight_matrix(g, NAME("attn_output.weight"), m->q_dim, p->dim, &L->wo, err, errlen) ||
        m40_weight_vector(g, NAME("attn_output.bias"), p->dim, !a->attn_out_bias, &L->bo, err, errlen))
        return -1;
    if (a->moe) {
        if (load_experts(m, l, L, err, errlen))
            return -1;
    } else if (a->fused_gate_up) {
        matrix gate_up;
        if (m40_weight_matrix(g, NAME("ffn_up.weight"), p->dim, 2 * (int64_t)p->ffn_dim, &gate_up, err, errlen))
            return -1;
        L->w_gate = rows_of(&gate_up, 0, p->ffn_dim);
        L->w_up = rows_of(&gate_up, p->ffn_dim, p->ffn_dim);
    } else if (m40_weight_matrix(g, NAME("ffn_gate.weight"), p->dim, p->ffn_dim, &L->w_gate, err, errlen) ||
               m40_weight_matrix(g, NAME("ffn_up.weight"), p->dim, p->ffn_dim, &L->w_up, err, errlen))
        return -1;
    if (!a->moe && m40_weight_matrix(g, NAME("ffn_down.weight"), p->ffn_dim, p->dim, &L->w_down, err, errlen))
        return -1;
    /* Biases: required where the row says so, else taken when the file has them. */
    if (!a->fused_qkv &&
        (m40_weight_vector(g, NAME("attn_q.bias"), m->q_dim, !a->qkv_bias, &L->bq, err, errlen) ||
         m40_weight_vector(g, NAME("attn_k.bias"), m->kv_dim, !a->qkv_bias, &L->bk, err, errlen) ||
         m40_weight_vector(g, NAME("attn_v.bias"), m->kv_dim, !a->qkv_bias, &L->bv, err, errlen)))
        return -1;
#undef NAME
    return 0;
}

/* LongRoPE (Phi-3 128k, Phi-3.5, Phi-4-mini): two sets of per-frequency divisors, the
 * long one for contexts past the original length (<arch>.rope.scaling.
 * original_context_length), as llama.cpp picks them: by the context a sequence gets
 * (m->ctx_request, the model's own when 0). Both sets are divisors like Llama 3.1's
 * rope_freqs.weight, which wins when a file has both. <arch>.rope.scaling.attn_factor
 * multiplies the rotated q and k (the cos/sin tables), so q.k by its square: folded
 * into attn_scale, which the KV cache never sees. */
static int load_longrope(m40_model *m, char *err, size_t errlen)
{
    const m40_gguf *g = m->gguf;
    m40_model_params *p = &m->p;
    float attn_factor;
    if (get_f32(g, p->arch, "rope.scaling.attn_factor", 0, 1.0f, &attn_factor, err, errlen))
        return -1;
    if (!(attn_factor > 0) || attn_factor > 16.0f) {
        m40_set_err(err, errlen, "bad %s.rope.scaling.attn_factor %g", p->arch, attn_factor);
        return -1;
    }
    m->attn_scale *= attn_factor * attn_factor;
    float *lng = NULL, *sht = NULL;
    if (m40_weight_vector(g, "rope_factors_long.weight", p->rope_dim / 2, 1, &lng, err, errlen) ||
        m40_weight_vector(g, "rope_factors_short.weight", p->rope_dim / 2, 1, &sht, err, errlen))
        goto fail;
    if (!lng != !sht) {
        m40_set_err(err, errlen, "LongRoPE needs both rope_factors_long.weight and rope_factors_short.weight");
        goto fail;
    }
    if (!lng || m->rope_freq_factors) {
        free(lng);
        free(sht);
        return 0;
    }
    int32_t orig;
    if (get_u32(g, p->arch, "rope.scaling.original_context_length", 0, (uint32_t)p->ctx_train, &orig, err, errlen))
        goto fail;
    for (int32_t i = 0; i < p->rope_dim / 2; i++)
        if (!(lng[i] > 0) || !(sht[i] > 0) || lng[i] > 1e6f || sht[i] > 1e6f) {
            m40_set_err(err, errlen, "LongRoPE factor %d is %g (long) / %g (short): must be in (0, 1e6]", (int)i,
                        lng[i], sht[i]);
            goto fail;
        }
    const int32_t ctx = m->ctx_request > 0 ? m->ctx_request : p->ctx_train;
    m->longrope = ctx > orig ? 2 : 1;
    m->longrope_orig = orig;
    m->rope_freq_factors = m->longrope == 2 ? lng : sht;
    free(m->longrope == 2 ? sht : lng);
    return 0;
fail:
    free(lng);
    free(sht);
    return -1;
}

static int load_weights(m40_model *m, char *err, size_t errlen)
{
    m40_model_params *p = &m->p;
    const m40_gguf_tensor *te = m40_gguf_find_tensor(m->gguf, "token_embd.weight");
    if (!te) {
        m40_set_err(err, errlen, "tensor 'token_embd.weight' is missing");
        return -1;
    }
    if (te->ne[1] == 0 || te->ne[1] > INT32_MAX) {
        m40_set_err(err, errlen, "tensor 'token_embd.weight' has a bad vocabulary dimension %llu",
                (unsigned long long)te->ne[1]);
        return -1;
    }
    p->n_vocab = (int32_t)te->ne[1];
    if (m40_weight_matrix(m->gguf, "token_embd.weight", p->dim, p->n_vocab, &m->tok_embd, err, errlen) ||
        m40_weight_vector(m->gguf, "output_norm.weight", p->dim, 0, &m->output_norm, err, errlen))
        return -1;
    if (m40_gguf_find_tensor(m->gguf, "output.weight")) {
        if (m40_weight_matrix(m->gguf, "output.weight", p->dim, p->n_vocab, &m->output, err, errlen))
            return -1;
    } else {
        m->output = m->tok_embd;
        p->tied_output = 1;
    }
    if (m40_weight_vector(m->gguf, "rope_freqs.weight", p->rope_dim / 2, 1, &m->rope_freq_factors, err, errlen))
        return -1;
    if (load_longrope(m, err, errlen))
        return -1;

    m->layers = calloc((size_t)p->n_layers, sizeof *m->layers);
    if (!m->layers) {
        m40_set_err(err, errlen, "out of memory");
        return -1;
    }
    unsigned type_count[M40_TYPE_COUNT] = {0};
    for (int32_t l = 0; l < p->n_layers; l++) {
        layer *L = &m->layers[l];
        if (load_layer(m, l, L, err, errlen))
            return -1;
        const matrix *ms[] = {&L->wq, &L->wk, &L->wv, &L->wo, &L->w_gate, &L->w_up, &L->w_down};
        const matrix *es[] = {&L->wq, &L->wk, &L->wv, &L->wo, &L->exp_gate, &L->exp_up, &L->exp_down};
        for (size_t i = 0; i < sizeof ms / sizeof ms[0]; i++)
            type_count[(L->router.data ? es : ms)[i]->type]++;
    }
    p->weight_type = 0;
    for (uint32_t t = 0; t < M40_TYPE_COUNT; t++)
        if (type_count[t] > type_count[p->weight_type])
            p->weight_type = t;
    return load_layer_kinds(m, err, errlen);
}

/* The GPU back end's view of the weights (gpu/model_gpu.h) and of the row's scalars,
 * the same for every row: a row without a feature has its neutral value here (window 0
 * where no layer is local, soft-caps 0, embedding scale 1, attention scale 1/sqrt(head_dim)),
 * and the GPU forward pass tests the values and the layers' tensors. */
void m40_model_gpu_src(const m40_model *m, m40_gpu_src *src)
{
    *src = (m40_gpu_src){.p = &m->p, .q_dim = m->q_dim, .kv_dim = m->kv_dim, .tok_embd = &m->tok_embd,
                         .output = &m->output, .output_norm = m->output_norm,
                         .rope_freq_factors = m->rope_freq_factors, .layers = m->layers,
                         .sc = {.act = m->act, .window = m->has_local ? m->window : 0, .local_base = m->local_base,
                                .global_scale = m->global_scale, .attn_scale = m->attn_scale,
                                .attn_softcap = m->attn_softcap, .embd_scale = m->embd_scale,
                                .logit_softcap = m->final_softcap, .gating = m->gating,
                                .norm_topk = m->norm_topk, .expert_scale = m->expert_scale, .yarn = m->yarn,
                                .yarn_freq_scale = m->yarn_freq_scale, .yarn_low = m->yarn_low,
                                .yarn_high = m->yarn_high, .yarn_mscale = m->yarn_mscale}};
}

int m40_model_read(m40_model *m, char *err, size_t errlen)
{
    return load_hparams(m, err, errlen) || load_weights(m, err, errlen) ? -1 : 0;
}
