/* Gemma 3 on the CPU: the reference forward pass for general.architecture "gemma3".
 *
 * It differs from the llama family of model.c in enough places that it has its own
 * weights and forward pass; model.c keeps the shared object (GGUF, tokenizer, params,
 * thread pool, KV cache) and hands gemma3 files to the three entry points at the end
 * of this file. Per layer:
 *
 *   h  = x + post_attention_norm(Wo attn(rope(qnorm(Wq n)), rope(knorm(Wk n)), Wv n)),
 *        n = attn_norm(x)
 *   x' = h + post_ffw_norm(Wdown(gelu_tanh(Wgate m) * Wup m)),  m = ffn_norm(h)
 *
 * with x0 = token_embd[token] * sqrt(n_embd), logits = token_embd . output_norm(x_L)
 * (tied head unless output.weight exists), optionally soft-capped. Every norm is
 * RMSNorm with the stored weights (GGUF conversion already folded Gemma's "1 + w" into
 * them); the Q and K norms run per head over head_dim.
 *
 * Attention alternates local (sliding-window) and global layers:
 *  - window: <arch>.attention.sliding_window W; a local layer lets position p see
 *    positions p-W+1..p (W tokens, itself included), a global layer all of 0..p.
 *  - which layers are local: <arch>.attention.sliding_window_pattern when the file has
 *    it (an array of bools, true = local, one per layer; or a period N: every Nth layer
 *    is global). Gemma 3 files from the usual converters carry neither, and Gemma 3 is
 *    defined with period 6 (layers 5, 11, 17, ... global), which is the default here.
 *  - RoPE (NeoX style, halves rotated) with <arch>.rope.freq_base on global layers and
 *    <arch>.rope.freq_base_swa on local ones, default 10000 (Gemma 3's local base, not
 *    stored by the usual converters). Linear RoPE scaling (<arch>.rope.scaling.type
 *    "linear", as in the 4B..27B files) applies to the global layers only.
 *  - scale: <arch>.attention.scale when present, else 1/sqrt(query_pre_attn_scalar),
 *    which Gemma 3 sets to key_length (head_dim) for every size except 27B, where it
 *    is n_embd / n_head; the GGUF does not store it, so 27B (n_embd 5376, 62 layers) is
 *    recognised by shape.
 *
 * Matmuls read each weight row once per forward call for all tokens of the batch, split
 * over the thread pool, and compute each (row, token) dot product the same way whatever
 * the batch, so batched and unbatched results are bitwise equal (as in model.c). */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ref/ggml_types.h"
#include "gguf/gguf.h"
#include "model.h"
#include "gpu/model_gpu.h"
#include "model_internal.h"
#include "ref/quant.h"
#include "util/threadpool.h"

/* The entry points model.c calls (declared there the same way). */
typedef struct m40_gemma3 m40_gemma3;
int m40_gemma3_load(const m40_gguf *g, m40_model_params *p, m40_gemma3 **out, char *err, size_t errlen);
void m40_gemma3_free(m40_gemma3 *g);
int m40_gemma3_forward(m40_gemma3 *g, m40_threadpool *pool, float *kv_k, float *kv_v, int32_t kv_ctx,
                       const m40_batch *b, float *logits, char *err, size_t errlen);
int m40_gemma3_gpu_src(const m40_gemma3 *g, m40_gpu_src *src, m40_gpu_gemma3 *extra, m40_matrix *tok_embd,
                       m40_matrix *output, m40_layer **layers_out);

#define GEMMA3_DEFAULT_SWA_PERIOD 6
#define GEMMA3_DEFAULT_LOCAL_ROPE_BASE 10000.0f

typedef m40_matrix g3_matrix;

typedef struct {
    float *attn_norm, *q_norm, *k_norm, *post_attn_norm, *ffn_norm, *post_ffw_norm;
    g3_matrix wq, wk, wv, wo, w_gate, w_up, w_down;
    int local;          /* sliding-window layer */
} g3_layer;

struct m40_gemma3 {
    const m40_gguf *gguf;
    m40_model_params *p;     /* model.c's, filled in by the loader */
    int32_t q_dim, kv_dim, window;
    float local_base, global_base, global_scale; /* global_scale: linear RoPE factor */
    float attn_scale, logit_softcap;             /* softcap 0: none */
    float embd_scale;
    g3_matrix tok_embd, output;
    float *output_norm;
    g3_layer *layers;

    /* Scratch for one forward call, grown on demand. */
    int32_t cap_tokens;
    float *x, *xb, *q, *k, *v, *att, *hb, *hb2;
    float *cos_l, *sin_l, *cos_g, *sin_g;   /* [n][head_dim/2], local and global bases */
    int32_t *logit_rows;
    int n_threads;
    float *row_buf;                          /* per thread: one dequantized weight row */
    int64_t row_buf_len;
    float *score_buf;                        /* per thread: scores over the context */
    int32_t score_buf_len;
};


/* ---------------------------------------------------------------- loading ---- */




/* Reads "gemma3.<suffix>": 0 found, 1 absent, -1 present with a bad type. */
static int g3_u32(const m40_gguf *g, const char *suffix, int32_t *out, char *err, size_t errlen)
{
    char key[160];
    snprintf(key, sizeof key, "gemma3.%s", suffix);
    uint32_t v;
    if (m40_gguf_get_u32(g, key, &v) == 0) {
        if (v > INT32_MAX) {
            m40_set_err(err, errlen, "metadata '%s' = %u is out of range", key, v);
            return -1;
        }
        *out = (int32_t)v;
        return 0;
    }
    if (m40_gguf_get(g, key)) {
        m40_set_err(err, errlen, "metadata '%s' is not an unsigned 32-bit integer", key);
        return -1;
    }
    return 1;
}

static int g3_f32(const m40_gguf *g, const char *suffix, float *out, char *err, size_t errlen)
{
    char key[160];
    snprintf(key, sizeof key, "gemma3.%s", suffix);
    if (m40_gguf_get_f32(g, key, out) == 0)
        return 0;
    if (m40_gguf_get(g, key)) {
        m40_set_err(err, errlen, "metadata '%s' is not a number", key);
        return -1;
    }
    return 1;
}

static int g3_required_u32(const m40_gguf *g, const char *suffix, int32_t *out, char *err, size_t errlen)
{
    int rc = g3_u32(g, suffix, out, err, errlen);
    if (rc == 1)
        m40_set_err(err, errlen, "metadata 'gemma3.%s' is missing", suffix);
    return rc == 0 ? 0 : -1;
}

static int g3_hparams(m40_gemma3 *g, char *err, size_t errlen)
{
    const m40_gguf *f = g->gguf;
    m40_model_params *p = g->p;
    snprintf(p->arch, sizeof p->arch, "gemma3");
    const char *name = m40_gguf_get_str(f, "general.name");
    snprintf(p->name, sizeof p->name, "%s", name ? name : "");
    p->rope_neox = 1;

    if (g3_required_u32(f, "embedding_length", &p->dim, err, errlen) ||
        g3_required_u32(f, "block_count", &p->n_layers, err, errlen) ||
        g3_required_u32(f, "attention.head_count", &p->n_heads, err, errlen) ||
        g3_required_u32(f, "feed_forward_length", &p->ffn_dim, err, errlen) ||
        g3_required_u32(f, "context_length", &p->ctx_train, err, errlen) ||
        g3_required_u32(f, "attention.sliding_window", &g->window, err, errlen))
        return -1;
    if (p->dim <= 0 || p->n_heads <= 0 || p->n_layers <= 0 || p->ffn_dim <= 0 || p->ctx_train <= 0 ||
        g->window <= 0) {
        m40_set_err(err, errlen, "bad hyperparameters: embedding_length %d, block_count %d, head_count %d, "
                "feed_forward_length %d, context_length %d, sliding_window %d (all must be > 0)",
                p->dim, p->n_layers, p->n_heads, p->ffn_dim, p->ctx_train, g->window);
        return -1;
    }
    if (p->dim > (1 << 20) || p->ffn_dim > (1 << 22) || p->n_layers > 4096 || p->n_heads > 4096) {
        m40_set_err(err, errlen, "hyperparameters out of range: embedding_length %d, feed_forward_length %d, "
                "block_count %d, head_count %d", p->dim, p->ffn_dim, p->n_layers, p->n_heads);
        return -1;
    }
    p->n_kv_heads = p->n_heads;
    p->head_dim = p->dim / p->n_heads;
    int32_t value_length;
    int rc;
    if ((rc = g3_u32(f, "attention.head_count_kv", &p->n_kv_heads, err, errlen)) < 0 ||
        (rc = g3_u32(f, "attention.key_length", &p->head_dim, err, errlen)) < 0)
        return -1;
    value_length = p->head_dim;
    if (g3_u32(f, "attention.value_length", &value_length, err, errlen) < 0)
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
    p->rope_dim = p->head_dim;
    if (g3_u32(f, "rope.dimension_count", &p->rope_dim, err, errlen) < 0)
        return -1;
    if (p->rope_dim != p->head_dim) {
        m40_set_err(err, errlen, "rope.dimension_count %d: gemma3 rotates whole heads of %d", p->rope_dim, p->head_dim);
        return -1;
    }

    if ((rc = g3_f32(f, "attention.layer_norm_rms_epsilon", &p->norm_eps, err, errlen)) != 0) {
        if (rc == 1)
            m40_set_err(err, errlen, "metadata 'gemma3.attention.layer_norm_rms_epsilon' is missing");
        return -1;
    }
    g->global_base = 10000.0f;
    g->local_base = GEMMA3_DEFAULT_LOCAL_ROPE_BASE;
    if (g3_f32(f, "rope.freq_base", &g->global_base, err, errlen) < 0 ||
        g3_f32(f, "rope.freq_base_swa", &g->local_base, err, errlen) < 0)
        return -1;
    p->rope_base = g->global_base;
    if (!(p->norm_eps >= 0) || !(g->global_base > 0) || !(g->local_base > 0)) {
        m40_set_err(err, errlen, "bad layer_norm_rms_epsilon %g or RoPE bases %g (global), %g (local)", p->norm_eps,
                g->global_base, g->local_base);
        return -1;
    }
    g->global_scale = 1.0f;
    const char *scaling = m40_gguf_get_str(f, "gemma3.rope.scaling.type");
    if (scaling && !strcmp(scaling, "linear")) {
        if (g3_f32(f, "rope.scaling.factor", &g->global_scale, err, errlen) < 0)
            return -1;
        if (!(g->global_scale > 0) || g->global_scale > 1e6f) {
            m40_set_err(err, errlen, "bad gemma3.rope.scaling.factor %g", g->global_scale);
            return -1;
        }
    } else if (scaling && strcmp(scaling, "none") != 0) {
        m40_set_err(err, errlen, "RoPE scaling '%s' (gemma3.rope.scaling.type) is not supported", scaling);
        return -1;
    }

    float query_pre_attn_scalar = (float)p->head_dim;
    if (p->dim == 5376 && p->n_layers == 62)
        query_pre_attn_scalar = (float)p->dim / (float)p->n_heads; /* Gemma 3 27B */
    g->attn_scale = 1.0f / sqrtf(query_pre_attn_scalar);
    if (g3_f32(f, "attention.scale", &g->attn_scale, err, errlen) < 0)
        return -1;
    g->logit_softcap = 0;
    if (g3_f32(f, "final_logit_softcapping", &g->logit_softcap, err, errlen) < 0)
        return -1;
    if (!(g->attn_scale > 0) || !(g->logit_softcap >= 0)) {
        m40_set_err(err, errlen, "bad attention.scale %g or final_logit_softcapping %g", g->attn_scale, g->logit_softcap);
        return -1;
    }
    g->embd_scale = sqrtf((float)p->dim);
    g->q_dim = p->n_heads * p->head_dim;
    g->kv_dim = p->n_kv_heads * p->head_dim;
    return 0;
}

/* Marks each layer local or global (see the top of the file). */
static int g3_layer_kinds(m40_gemma3 *g, char *err, size_t errlen)
{
    const char *key = "gemma3.attention.sliding_window_pattern";
    int32_t n_layers = g->p->n_layers;
    const m40_gguf_value *v = m40_gguf_get(g->gguf, key);
    if (v && v->type == M40_GGUF_ARRAY) {
        if (v->v.arr.type != M40_GGUF_BOOL || v->v.arr.n != (uint64_t)n_layers) {
            m40_set_err(err, errlen, "metadata '%s' must be an array of %d bools", key, (int)n_layers);
            return -1;
        }
        for (int32_t l = 0; l < n_layers; l++)
            g->layers[l].local = v->v.arr.items[l].v.b != 0;
        return 0;
    }
    int32_t period = GEMMA3_DEFAULT_SWA_PERIOD;
    if (v) {
        if (g3_u32(g->gguf, "attention.sliding_window_pattern", &period, err, errlen) < 0)
            return -1;
        if (period <= 0) {
            m40_set_err(err, errlen, "metadata '%s' = %d must be > 0", key, (int)period);
            return -1;
        }
    }
    for (int32_t l = 0; l < n_layers; l++)
        g->layers[l].local = (l + 1) % period != 0;
    return 0;
}

static int g3_weights(m40_gemma3 *g, char *err, size_t errlen)
{
    m40_model_params *p = g->p;
    const m40_gguf *f = g->gguf;
    const m40_gguf_tensor *te = m40_gguf_find_tensor(f, "token_embd.weight");
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
    if (m40_weight_matrix(f, "token_embd.weight", p->dim, p->n_vocab, &g->tok_embd, err, errlen) ||
        m40_weight_vector(f, "output_norm.weight", p->dim, 0, &g->output_norm, err, errlen))
        return -1;
    if (m40_gguf_find_tensor(f, "output.weight")) {
        if (m40_weight_matrix(f, "output.weight", p->dim, p->n_vocab, &g->output, err, errlen))
            return -1;
    } else {
        g->output = g->tok_embd;
        p->tied_output = 1;
    }
    g->layers = calloc((size_t)p->n_layers, sizeof *g->layers);
    if (!g->layers) {
        m40_set_err(err, errlen, "out of memory");
        return -1;
    }
    unsigned type_count[M40_TYPE_COUNT] = {0};
    for (int32_t l = 0; l < p->n_layers; l++) {
        g3_layer *L = &g->layers[l];
        char n[96];
#define NAME(s) (snprintf(n, sizeof n, "blk.%d.%s", (int)l, s), n)
        if (m40_weight_vector(f, NAME("attn_norm.weight"), p->dim, 0, &L->attn_norm, err, errlen) ||
            m40_weight_vector(f, NAME("attn_q_norm.weight"), p->head_dim, 0, &L->q_norm, err, errlen) ||
            m40_weight_vector(f, NAME("attn_k_norm.weight"), p->head_dim, 0, &L->k_norm, err, errlen) ||
            m40_weight_vector(f, NAME("post_attention_norm.weight"), p->dim, 0, &L->post_attn_norm, err, errlen) ||
            m40_weight_vector(f, NAME("ffn_norm.weight"), p->dim, 0, &L->ffn_norm, err, errlen) ||
            m40_weight_vector(f, NAME("post_ffw_norm.weight"), p->dim, 0, &L->post_ffw_norm, err, errlen) ||
            m40_weight_matrix(f, NAME("attn_q.weight"), p->dim, g->q_dim, &L->wq, err, errlen) ||
            m40_weight_matrix(f, NAME("attn_k.weight"), p->dim, g->kv_dim, &L->wk, err, errlen) ||
            m40_weight_matrix(f, NAME("attn_v.weight"), p->dim, g->kv_dim, &L->wv, err, errlen) ||
            m40_weight_matrix(f, NAME("attn_output.weight"), g->q_dim, p->dim, &L->wo, err, errlen) ||
            m40_weight_matrix(f, NAME("ffn_gate.weight"), p->dim, p->ffn_dim, &L->w_gate, err, errlen) ||
            m40_weight_matrix(f, NAME("ffn_up.weight"), p->dim, p->ffn_dim, &L->w_up, err, errlen) ||
            m40_weight_matrix(f, NAME("ffn_down.weight"), p->ffn_dim, p->dim, &L->w_down, err, errlen))
            return -1;
#undef NAME
        const g3_matrix *ms[] = {&L->wq, &L->wk, &L->wv, &L->wo, &L->w_gate, &L->w_up, &L->w_down};
        for (size_t i = 0; i < sizeof ms / sizeof ms[0]; i++)
            type_count[ms[i]->type]++;
    }
    p->weight_type = 0;
    for (uint32_t t = 0; t < M40_TYPE_COUNT; t++)
        if (type_count[t] > type_count[p->weight_type])
            p->weight_type = t;
    return g3_layer_kinds(g, err, errlen);
}

int m40_gemma3_load(const m40_gguf *f, m40_model_params *p, m40_gemma3 **out, char *err, size_t errlen)
{
    *out = NULL;
    m40_gemma3 *g = calloc(1, sizeof *g);
    if (!g) {
        m40_set_err(err, errlen, "out of memory");
        return -1;
    }
    g->gguf = f;
    g->p = p;
    if (g3_hparams(g, err, errlen) || g3_weights(g, err, errlen)) {
        m40_gemma3_free(g);
        return -1;
    }
    *out = g;
    return 0;
}

void m40_gemma3_free(m40_gemma3 *g)
{
    if (!g)
        return;
    if (g->layers) {
        for (int32_t l = 0; l < g->p->n_layers; l++) {
            g3_layer *L = &g->layers[l];
            float *vs[] = {L->attn_norm, L->q_norm, L->k_norm, L->post_attn_norm, L->ffn_norm, L->post_ffw_norm};
            for (size_t i = 0; i < sizeof vs / sizeof vs[0]; i++)
                free(vs[i]);
        }
        free(g->layers);
    }
    float *bufs[] = {g->output_norm, g->x, g->xb, g->q, g->k, g->v, g->att, g->hb, g->hb2,
                     g->cos_l, g->sin_l, g->cos_g, g->sin_g, g->row_buf, g->score_buf};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        free(bufs[i]);
    free(g->logit_rows);
    free(g);
}

/* ------------------------------------------------------------- the math ---- */

/* Eight partial sums in a fixed order (vectorizes without -ffast-math; the result does
 * not depend on how work was split). */
/* In place allowed (out == x). */
static void g3_rmsnorm(float *out, const float *x, const float *w, int32_t n, float eps)
{
    double ss = 0;
    for (int32_t i = 0; i < n; i++)
        ss += (double)x[i] * x[i];
    float scale = (float)(1.0 / sqrt(ss / n + eps));
    for (int32_t i = 0; i < n; i++)
        out[i] = x[i] * scale * w[i];
}

/* GELU, tanh approximation (Gemma's hidden_activation gelu_pytorch_tanh). */
static float g3_gelu(float x)
{
    const float c = 0.7978845608028654f; /* sqrt(2 / pi) */
    return 0.5f * x * (1.0f + tanhf(c * (x + 0.044715f * x * x * x)));
}

/* out[t] = W x[t] for the n token vectors of x. */
static void g3_matmul(m40_gemma3 *g, m40_threadpool *pool, const g3_matrix *w, const float *x, int32_t n, float *out)
{
    m40_cpu_matmul(pool, g->n_threads, g->row_buf, g->row_buf_len, w, x, n, out);
}

/* NeoX-style rotation of each head: pairs (i, i + head_dim/2). */
static void g3_rope(float *vec, int32_t n_heads, int32_t hd, const float *cos_t, const float *sin_t)
{
    int32_t half = hd / 2;
    for (int32_t h = 0; h < n_heads; h++) {
        float *v = vec + (size_t)h * hd;
        for (int32_t i = 0; i < half; i++) {
            float x0 = v[i], x1 = v[i + half];
            v[i] = x0 * cos_t[i] - x1 * sin_t[i];
            v[i + half] = x0 * sin_t[i] + x1 * cos_t[i];
        }
    }
}

typedef struct {
    m40_gemma3 *g;
    float *kv_k, *kv_v;
    int32_t kv_ctx;
    const m40_batch *b;
    int32_t l;
} g3_attn_job;

static float *g3_kv_row(const m40_gemma3 *g, float *base, int32_t kv_ctx, int32_t slot, int32_t l, int32_t pos)
{
    return base + (((size_t)slot * (size_t)g->p->n_layers + (size_t)l) * (size_t)kv_ctx + (size_t)pos) *
                      (size_t)g->kv_dim;
}

/* One (token, head): softmax(scale q.k) over the positions the layer lets it see, times V. */
static void g3_attention_task(void *ctx, int task, int thread)
{
    g3_attn_job *j = ctx;
    m40_gemma3 *g = j->g;
    const m40_model_params *p = g->p;
    int32_t hd = p->head_dim;
    int32_t i = task / p->n_heads, h = task % p->n_heads;
    int32_t kvh = h / (p->n_heads / p->n_kv_heads);
    int32_t slot = j->b->slot[i], pos = j->b->pos[i];
    int32_t first = 0;
    if (g->layers[j->l].local && pos - g->window + 1 > 0)
        first = pos - g->window + 1;
    const float *q = g->q + (size_t)i * g->q_dim + (size_t)h * hd;
    float *out = g->att + (size_t)i * g->q_dim + (size_t)h * hd;
    float *score = g->score_buf + (size_t)thread * g->score_buf_len;

    float max = -INFINITY;
    for (int32_t t = first; t <= pos; t++) {
        float s = m40_dot_f32(q, g3_kv_row(g, j->kv_k, j->kv_ctx, slot, j->l, t) + (size_t)kvh * hd, hd) * g->attn_scale;
        score[t - first] = s;
        if (s > max)
            max = s;
    }
    double sum = 0;
    for (int32_t t = first; t <= pos; t++) {
        score[t - first] = expf(score[t - first] - max);
        sum += score[t - first];
    }
    float inv = (float)(1.0 / sum);
    memset(out, 0, (size_t)hd * sizeof *out);
    for (int32_t t = first; t <= pos; t++) {
        const float *v = g3_kv_row(g, j->kv_v, j->kv_ctx, slot, j->l, t) + (size_t)kvh * hd;
        float w = score[t - first] * inv;
        for (int32_t d = 0; d < hd; d++)
            out[d] += w * v[d];
    }
}

/* ------------------------------------------------------------- forward ---- */

static int g3_grow(float **buf, size_t n)
{
    float *q = realloc(*buf, n * sizeof **buf);
    if (!q)
        return -1;
    *buf = q;
    return 0;
}

static int g3_scratch(m40_gemma3 *g, int n_threads, int32_t n, int32_t ctx)
{
    const m40_model_params *p = g->p;
    if (n > g->cap_tokens) {
        size_t N = (size_t)n, half = (size_t)p->head_dim / 2;
        int32_t *rows = realloc(g->logit_rows, N * sizeof *rows);
        if (!rows)
            return -1;
        g->logit_rows = rows;
        if (g3_grow(&g->x, N * p->dim) || g3_grow(&g->xb, N * p->dim) || g3_grow(&g->q, N * g->q_dim) ||
            g3_grow(&g->k, N * g->kv_dim) || g3_grow(&g->v, N * g->kv_dim) || g3_grow(&g->att, N * g->q_dim) ||
            g3_grow(&g->hb, N * p->ffn_dim) || g3_grow(&g->hb2, N * p->ffn_dim) ||
            g3_grow(&g->cos_l, N * half) || g3_grow(&g->sin_l, N * half) || g3_grow(&g->cos_g, N * half) ||
            g3_grow(&g->sin_g, N * half))
            return -1;
        g->cap_tokens = n;
    }
    if (n_threads != g->n_threads) {
        int64_t len = p->dim > p->ffn_dim ? p->dim : p->ffn_dim;
        if (g->q_dim > len)
            len = g->q_dim;
        if (g3_grow(&g->row_buf, (size_t)n_threads * (size_t)len))
            return -1;
        g->row_buf_len = len;
        g->score_buf_len = 0; /* per-thread stride changes: regrow below */
    }
    if (ctx > g->score_buf_len || n_threads != g->n_threads) {
        if (g3_grow(&g->score_buf, (size_t)n_threads * (size_t)ctx))
            return -1;
        g->score_buf_len = ctx;
    }
    g->n_threads = n_threads;
    return 0;
}

/* x[t] += norm(y[t]) for each of the n rows. */
static void g3_add_normed(float *x, float *y, const float *w, int32_t n, int32_t dim, float eps)
{
    for (int32_t i = 0; i < n; i++) {
        float *yi = y + (size_t)i * dim, *xi = x + (size_t)i * dim;
        g3_rmsnorm(yi, yi, w, dim, eps);
        for (int32_t d = 0; d < dim; d++)
            xi[d] += yi[d];
    }
}

/* The batch was validated by model.c (tokens, slots and positions in range). */
int m40_gemma3_forward(m40_gemma3 *g, m40_threadpool *pool, float *kv_k, float *kv_v, int32_t kv_ctx,
                       const m40_batch *b, float *logits, char *err, size_t errlen)
{
    const m40_model_params *p = g->p;
    int32_t n = b->n;
    if (g3_scratch(g, m40_threadpool_size(pool), n, kv_ctx)) {
        m40_set_err(err, errlen, "out of memory for a batch of %d tokens", (int)n);
        return -1;
    }
    size_t dim = (size_t)p->dim, ffn = (size_t)p->ffn_dim, qd = (size_t)g->q_dim, kvd = (size_t)g->kv_dim;
    int32_t hd = p->head_dim, half = hd / 2;

    for (int32_t i = 0; i < n; i++) {
        const g3_matrix *e = &g->tok_embd;
        float *xi = g->x + i * dim;
        m40_dequantize_row(e->type, e->data + (size_t)b->tokens[i] * e->row_bytes, xi, p->dim);
        for (size_t d = 0; d < dim; d++)
            xi[d] *= g->embd_scale;
        for (int32_t d = 0; d < half; d++) {
            double inv_freq_l = pow(g->local_base, -2.0 * d / hd);
            double inv_freq_g = pow(g->global_base, -2.0 * d / hd) / g->global_scale;
            size_t o = (size_t)i * half + d;
            g->cos_l[o] = (float)cos(b->pos[i] * inv_freq_l);
            g->sin_l[o] = (float)sin(b->pos[i] * inv_freq_l);
            g->cos_g[o] = (float)cos(b->pos[i] * inv_freq_g);
            g->sin_g[o] = (float)sin(b->pos[i] * inv_freq_g);
        }
    }

    for (int32_t l = 0; l < p->n_layers; l++) {
        const g3_layer *L = &g->layers[l];
        const float *cos_t = L->local ? g->cos_l : g->cos_g, *sin_t = L->local ? g->sin_l : g->sin_g;

        for (int32_t i = 0; i < n; i++)
            g3_rmsnorm(g->xb + i * dim, g->x + i * dim, L->attn_norm, p->dim, p->norm_eps);
        g3_matmul(g, pool, &L->wq, g->xb, n, g->q);
        g3_matmul(g, pool, &L->wk, g->xb, n, g->k);
        g3_matmul(g, pool, &L->wv, g->xb, n, g->v);
        for (int32_t i = 0; i < n; i++) {
            float *q = g->q + i * qd, *k = g->k + i * kvd;
            for (int32_t h = 0; h < p->n_heads; h++)
                g3_rmsnorm(q + (size_t)h * hd, q + (size_t)h * hd, L->q_norm, hd, p->norm_eps);
            for (int32_t h = 0; h < p->n_kv_heads; h++)
                g3_rmsnorm(k + (size_t)h * hd, k + (size_t)h * hd, L->k_norm, hd, p->norm_eps);
            g3_rope(q, p->n_heads, hd, cos_t + (size_t)i * half, sin_t + (size_t)i * half);
            g3_rope(k, p->n_kv_heads, hd, cos_t + (size_t)i * half, sin_t + (size_t)i * half);
            /* All K/V of the batch go in before attention, so a token sees the earlier
             * tokens of its slot from this same batch. */
            memcpy(g3_kv_row(g, kv_k, kv_ctx, b->slot[i], l, b->pos[i]), k, kvd * sizeof(float));
            memcpy(g3_kv_row(g, kv_v, kv_ctx, b->slot[i], l, b->pos[i]), g->v + i * kvd, kvd * sizeof(float));
        }
        g3_attn_job aj = {.g = g, .kv_k = kv_k, .kv_v = kv_v, .kv_ctx = kv_ctx, .b = b, .l = l};
        m40_threadpool_run(pool, n * p->n_heads, g3_attention_task, &aj);
        g3_matmul(g, pool, &L->wo, g->att, n, g->xb);
        g3_add_normed(g->x, g->xb, L->post_attn_norm, n, p->dim, p->norm_eps);

        for (int32_t i = 0; i < n; i++)
            g3_rmsnorm(g->xb + i * dim, g->x + i * dim, L->ffn_norm, p->dim, p->norm_eps);
        g3_matmul(g, pool, &L->w_gate, g->xb, n, g->hb);
        g3_matmul(g, pool, &L->w_up, g->xb, n, g->hb2);
        for (size_t i = 0; i < (size_t)n * ffn; i++)
            g->hb[i] = g3_gelu(g->hb[i]) * g->hb2[i];
        g3_matmul(g, pool, &L->w_down, g->hb, n, g->xb);
        g3_add_normed(g->x, g->xb, L->post_ffw_norm, n, p->dim, p->norm_eps);
    }

    int32_t n_out = 0;
    for (int32_t i = 0; i < n; i++)
        if (b->want_logits ? b->want_logits[i] != 0 : i == n - 1)
            g->logit_rows[n_out++] = i;
    for (int32_t j = 0; j < n_out; j++)
        g3_rmsnorm(g->xb + j * dim, g->x + (size_t)g->logit_rows[j] * dim, g->output_norm, p->dim, p->norm_eps);
    if (n_out > 0) {
        g3_matmul(g, pool, &g->output, g->xb, n_out, logits);
        if (g->logit_softcap > 0) {
            float c = g->logit_softcap;
            for (size_t i = 0; i < (size_t)n_out * (size_t)p->n_vocab; i++)
                logits[i] = c * tanhf(logits[i] / c);
        }
    }
    return 0;
}

/* ------------------------------------------------------- the GPU's view ---- */

/* Fills src (and the arrays behind it) with views of g's weights for m40_gpu_load. The
 * caller owns *layers_out (free() it after the upload; the norms it points to stay g's). */
int m40_gemma3_gpu_src(const m40_gemma3 *g, m40_gpu_src *src, m40_gpu_gemma3 *extra, m40_matrix *tok_embd,
                       m40_matrix *output, m40_layer **layers_out)
{
    const m40_model_params *p = g->p;
    m40_layer *ls = calloc((size_t)p->n_layers, sizeof *ls);
    if (!ls)
        return -1;
    for (int32_t l = 0; l < p->n_layers; l++) {
        const g3_layer *L = &g->layers[l];
        ls[l] = (m40_layer){.attn_norm = L->attn_norm, .ffn_norm = L->ffn_norm, .wq = L->wq,
                            .wk = L->wk, .wv = L->wv, .wo = L->wo,
                            .w_gate = L->w_gate, .w_up = L->w_up, .w_down = L->w_down,
                            .q_norm = L->q_norm, .k_norm = L->k_norm, .post_attn_norm = L->post_attn_norm,
                            .post_ffw_norm = L->post_ffw_norm, .local = L->local};
    }
    *tok_embd = g->tok_embd;
    *output = g->output.data == g->tok_embd.data ? *tok_embd : g->output;
    *extra = (m40_gpu_gemma3){.window = g->window, .local_base = g->local_base, .global_base = g->global_base,
                              .global_scale = g->global_scale, .attn_scale = g->attn_scale,
                              .embd_scale = g->embd_scale, .logit_softcap = g->logit_softcap};
    *src = (m40_gpu_src){.p = p, .q_dim = g->q_dim, .kv_dim = g->kv_dim, .tok_embd = tok_embd, .output = output,
                         .output_norm = g->output_norm, .rope_freq_factors = NULL, .layers = ls, .gemma3 = extra};
    *layers_out = ls;
    return 0;
}
