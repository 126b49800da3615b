/* Llama-family transformer on the CPU (llama, qwen2): the reference forward pass.
 *
 * Everything is F32 except the weights, which stay in the mmap'd GGUF in their stored
 * type, and the inputs of the few F16 products that the reference rounds to F16 (see
 * rounds_input_to_f16). A matmul reads each weight row once per forward call: the row is dequantized
 * (F32 rows are used in place) and multiplied with every token of the batch while it
 * is hot in cache, so a batched prefill costs about one pass over the weights. Rows are
 * split over the thread pool; each (row, token) dot product is computed the same way
 * whatever the batch, so batched and unbatched results are bitwise equal. */
#include "model.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ref/ggml_types.h"
#include "kv/kv_blocks.h" /* M40_KV_BLOCK_SIZE_DEFAULT: the GPU pool's block size */
#include "kv/paged_kv.h"
#include "sample_hd.h" /* m40k_argmax */
#include "gpu/model_gpu.h"
#include "model_internal.h"
#include "ref/quant.h"
#include "util/threadpool.h"

/* Gemma 3 has its own weights and forward pass in model_gemma3.c; this object keeps
 * the GGUF, tokenizer, params, thread pool and KV cache layout for it. */
typedef struct m40_gemma3 m40_gemma3;
int m40_gemma3_load(const m40_gguf *g, m40_model_params *p, m40_gemma3 **out, char *err, size_t errlen);
void m40_gemma3_free(m40_gemma3 *g);
int m40_gemma3_forward(m40_gemma3 *g, m40_threadpool *pool, float *kv_k, float *kv_v, int32_t kv_ctx,
                       const m40_batch *b, float *logits, char *err, size_t errlen);
int m40_gemma3_gpu_src(const m40_gemma3 *g, m40_gpu_src *src, m40_gpu_gemma3 *extra, m40_matrix *tok_embd,
                       m40_matrix *output, m40_layer **layers_out);

typedef m40_matrix matrix;
typedef m40_layer layer;

struct m40_model {
    m40_gguf *gguf;
    m40_tokenizer *tok;
    m40_model_params p;
    int32_t q_dim, kv_dim;
    float *rope_freq_factors;     /* rope_freqs.weight (Llama 3.1 style), or NULL */

    matrix tok_embd, output;
    float *output_norm;
    layer *layers;
    m40_gemma3 *gemma3;           /* arch gemma3: holds the weights (the llama ones above stay unset) */
    m40_gpu *gpu;                 /* device >= 0: the weights on the GPU, forward runs there */
    int device;
    m40_tuning tuning;            /* the switches read at load (util/tuning.h) */

    m40_threadpool *pool;
    int n_threads;

    /* Scratch for one forward call, grown on demand. */
    int32_t cap_tokens;
    float *x, *xb, *q, *k, *v, *att, *hb, *hb2;
    float *x16;                   /* [n][max input dim]: F16-rounded matmul input, see matmul() */
    float *rope_cos, *rope_sin;   /* [n][rope_dim/2] */
    int32_t *logit_rows;
    float *row_buf;               /* per thread: one dequantized weight row */
    int64_t row_buf_len;
    float *score_buf;             /* per thread: attention scores over the context */
    int32_t score_buf_len;
};

struct m40_kv {
    int32_t n_slots, ctx, n_layers, kv_dim;
    float *k, *v;                 /* [slot][layer][pos][kv_dim] (CPU) */
    m40_gpu_kv *gpu;              /* GPU model: the paged pool instead, its memory... */
    m40_paged_kv *pool;           /* ...and which block holds what (kv/paged_kv.h) */
};


/* ---------------------------------------------------------------- loading ---- */




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

static int load_hparams(m40_model *m, char *err, size_t errlen)
{
    const m40_gguf *g = m->gguf;
    m40_model_params *p = &m->p;
    const char *arch = m40_gguf_arch(g);
    if (!arch) {
        m40_set_err(err, errlen, "metadata 'general.architecture' is missing");
        return -1;
    }
    if (strcmp(arch, "llama") != 0 && strcmp(arch, "qwen2") != 0) {
        m40_set_err(err, errlen, "architecture '%s' is not supported (llama, qwen2, gemma3)", arch);
        return -1;
    }
    snprintf(p->arch, sizeof p->arch, "%s", arch);
    const char *name = m40_gguf_get_str(g, "general.name");
    snprintf(p->name, sizeof p->name, "%s", name ? name : "");
    p->rope_neox = strcmp(arch, "qwen2") == 0;

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
    if (get_u32(g, arch, "rope.dimension_count", 0, (uint32_t)p->head_dim, &p->rope_dim, err, errlen))
        return -1;
    if (p->rope_dim <= 0 || p->rope_dim % 2 != 0 || p->rope_dim > p->head_dim) {
        m40_set_err(err, errlen, "rope.dimension_count %d must be even and at most the head dimension %d", p->rope_dim,
                p->head_dim);
        return -1;
    }
    if (get_f32(g, arch, "attention.layer_norm_rms_epsilon", 1, 0, &p->norm_eps, err, errlen) ||
        get_f32(g, arch, "rope.freq_base", 0, 10000.0f, &p->rope_base, err, errlen))
        return -1;
    if (!(p->norm_eps >= 0) || !(p->rope_base > 0)) {
        m40_set_err(err, errlen, "bad layer_norm_rms_epsilon %g or rope.freq_base %g", p->norm_eps, p->rope_base);
        return -1;
    }
    /* Context-extension schemes change the rotation angles; computing them as plain
     * RoPE would give quietly wrong answers, so refuse instead. */
    char key[160];
    snprintf(key, sizeof key, "%s.rope.scaling.type", arch);
    const char *scaling = m40_gguf_get_str(g, key);
    if (scaling && strcmp(scaling, "none") != 0) {
        m40_set_err(err, errlen, "RoPE scaling '%s' (%s) is not supported", scaling, key);
        return -1;
    }
    m->q_dim = p->n_heads * p->head_dim;
    m->kv_dim = p->n_kv_heads * p->head_dim;
    return 0;
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

    m->layers = calloc((size_t)p->n_layers, sizeof *m->layers);
    if (!m->layers) {
        m40_set_err(err, errlen, "out of memory");
        return -1;
    }
    unsigned type_count[M40_TYPE_COUNT] = {0};
    int need_bias = !strcmp(p->arch, "qwen2");
    for (int32_t l = 0; l < p->n_layers; l++) {
        layer *L = &m->layers[l];
        char n[96];
#define NAME(s) (snprintf(n, sizeof n, "blk.%d.%s", (int)l, s), n)
        if (m40_weight_vector(m->gguf, NAME("attn_norm.weight"), p->dim, 0, &L->attn_norm, err, errlen) ||
            m40_weight_vector(m->gguf, NAME("ffn_norm.weight"), p->dim, 0, &L->ffn_norm, err, errlen) ||
            m40_weight_matrix(m->gguf, NAME("attn_q.weight"), p->dim, m->q_dim, &L->wq, err, errlen) ||
            m40_weight_matrix(m->gguf, NAME("attn_k.weight"), p->dim, m->kv_dim, &L->wk, err, errlen) ||
            m40_weight_matrix(m->gguf, NAME("attn_v.weight"), p->dim, m->kv_dim, &L->wv, err, errlen) ||
            m40_weight_matrix(m->gguf, NAME("attn_output.weight"), m->q_dim, p->dim, &L->wo, err, errlen) ||
            m40_weight_matrix(m->gguf, NAME("ffn_gate.weight"), p->dim, p->ffn_dim, &L->w_gate, err, errlen) ||
            m40_weight_matrix(m->gguf, NAME("ffn_up.weight"), p->dim, p->ffn_dim, &L->w_up, err, errlen) ||
            m40_weight_matrix(m->gguf, NAME("ffn_down.weight"), p->ffn_dim, p->dim, &L->w_down, err, errlen) ||
            m40_weight_vector(m->gguf, NAME("attn_q.bias"), m->q_dim, !need_bias, &L->bq, err, errlen) ||
            m40_weight_vector(m->gguf, NAME("attn_k.bias"), m->kv_dim, !need_bias, &L->bk, err, errlen) ||
            m40_weight_vector(m->gguf, NAME("attn_v.bias"), m->kv_dim, !need_bias, &L->bv, err, errlen))
            return -1;
#undef NAME
        const matrix *ms[] = {&L->wq, &L->wk, &L->wv, &L->wo, &L->w_gate, &L->w_up, &L->w_down};
        for (size_t i = 0; i < sizeof ms / sizeof ms[0]; i++)
            type_count[ms[i]->type]++;
    }
    p->weight_type = 0;
    for (uint32_t t = 0; t < M40_TYPE_COUNT; t++)
        if (type_count[t] > type_count[p->weight_type])
            p->weight_type = t;
    return 0;
}

int m40_model_load(const char *path, int n_threads, m40_model **out, char *err, size_t errlen)
{
    m40_model_options o = {.n_threads = n_threads, .device = -1};
    return m40_model_load_opts(path, &o, out, err, errlen);
}

int m40_model_load_opts(const char *path, const m40_model_options *opts, m40_model **out, char *err, size_t errlen)
{
    int n_threads = opts ? opts->n_threads : 0;
    int device = opts ? opts->device : -1;
    *out = NULL;
    m40_model *m = calloc(1, sizeof *m);
    if (!m) {
        m40_set_err(err, errlen, "out of memory");
        return -1;
    }
    m40_tuning_from_env(&m->tuning);
    char sub[512];
    if (m40_gguf_open(path, &m->gguf, sub, sizeof sub) != 0) {
        m40_set_err(err, errlen, "%s: %s", path, sub);
        goto fail;
    }
    const char *arch = m40_gguf_arch(m->gguf);
    if (arch && !strcmp(arch, "gemma3")) {
        if (m40_gemma3_load(m->gguf, &m->p, &m->gemma3, sub, sizeof sub)) {
            m40_set_err(err, errlen, "%s: %s", path, sub);
            goto fail;
        }
        m->q_dim = m->p.n_heads * m->p.head_dim;
        m->kv_dim = m->p.n_kv_heads * m->p.head_dim;
    } else if (load_hparams(m, sub, sizeof sub) || load_weights(m, sub, sizeof sub)) {
        m40_set_err(err, errlen, "%s: %s", path, sub);
        goto fail;
    }
    if (m40_tokenizer_from_gguf(m->gguf, &m->tok, sub, sizeof sub) != 0) {
        m40_set_err(err, errlen, "%s: tokenizer: %s", path, sub);
        goto fail;
    }
    /* Once per load, on stderr like the engine's other load messages (nginx sends a
     * worker's stderr to its error log). */
    const char *tok_warning = m40_tokenizer_load_warning(m->tok);
    if (tok_warning)
        fprintf(stderr, "m40: warning: %s: %s\n", path, tok_warning);
    if (m40_tokenizer_n_vocab(m->tok) > m->p.n_vocab) {
        m40_set_err(err, errlen, "%s: the tokenizer has %d tokens but token_embd.weight only %d rows", path,
                (int)m40_tokenizer_n_vocab(m->tok), (int)m->p.n_vocab);
        goto fail;
    }
    m->pool = m40_threadpool_new(n_threads);
    if (!m->pool) {
        m40_set_err(err, errlen, "cannot start the CPU thread pool");
        goto fail;
    }
    m->n_threads = m40_threadpool_size(m->pool);
    m->device = -1;
    if (device >= 0) {
        m40_gpu_src src = {.p = &m->p, .q_dim = m->q_dim, .kv_dim = m->kv_dim, .tok_embd = &m->tok_embd,
                           .output = &m->output, .output_norm = m->output_norm,
                           .rope_freq_factors = m->rope_freq_factors, .layers = m->layers};
        m40_gpu_gemma3 g3;
        m40_matrix g3_embd, g3_out;
        m40_layer *g3_layers = NULL;
        if (m->gemma3 && m40_gemma3_gpu_src(m->gemma3, &src, &g3, &g3_embd, &g3_out, &g3_layers)) {
            m40_set_err(err, errlen, "out of memory");
            goto fail;
        }
        int rc = m40_gpu_load(&src, &m->tuning, device, opts && opts->log_progress, &m->gpu, sub, sizeof sub);
        free(g3_layers);
        if (rc) {
            m40_set_err(err, errlen, "%s: %s", path, sub);
            goto fail;
        }
        m->device = device;
    }
    *out = m;
    return 0;
fail:
    m40_model_free(m);
    return -1;
}

void m40_model_free(m40_model *m)
{
    if (!m)
        return;
    if (m->layers) {
        for (int32_t l = 0; l < m->p.n_layers; l++) {
            layer *L = &m->layers[l];
            free(L->attn_norm);
            free(L->ffn_norm);
            free(L->bq);
            free(L->bk);
            free(L->bv);
        }
        free(m->layers);
    }
    m40_gpu_free(m->gpu);
    free(m->output_norm);
    free(m->rope_freq_factors);
    m40_gemma3_free(m->gemma3);
    m40_threadpool_free(m->pool);
    m40_tokenizer_free(m->tok);
    m40_gguf_close(m->gguf);
    float *bufs[] = {m->x, m->xb, m->q, m->k, m->v, m->att, m->hb, m->hb2, m->x16, m->rope_cos, m->rope_sin,
                     m->row_buf, m->score_buf};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        free(bufs[i]);
    free(m->logit_rows);
    free(m);
}

const m40_model_params *m40_model_get_params(const m40_model *m) { return &m->p; }
const m40_tokenizer *m40_model_tokenizer(const m40_model *m) { return m->tok; }
const m40_gguf *m40_model_gguf(const m40_model *m) { return m->gguf; }
int m40_model_n_threads(const m40_model *m) { return m->n_threads; }
int m40_model_device(const m40_model *m) { return m->gpu ? m->device : -1; }
const m40_tuning *m40_model_tuning(const m40_model *m) { return &m->tuning; }
void m40_model_graph_stats(const m40_model *m, int64_t *captures, int64_t *launches)
{
    *captures = *launches = 0;
    if (m->gpu)
        m40_gpu_graph_stats(m->gpu, captures, launches);
}

int m40_model_step_timing(m40_model *m, int on) { return m->gpu ? m40_gpu_step_timing(m->gpu, on) : -1; }
void m40_model_step_time(const m40_model *m, double *seconds, int64_t *steps)
{
    double ms = 0;
    *steps = 0;
    if (m->gpu)
        m40_gpu_step_time(m->gpu, &ms, steps);
    *seconds = ms / 1e3;
}

/* --------------------------------------------------------------- KV cache ---- */

m40_kv *m40_kv_new(const m40_model *m, int32_t n_slots, int32_t ctx)
{
    if (ctx <= 0)
        ctx = m->p.ctx_train;
    /* every slot may fill its whole context: ctx rounded up to whole blocks each */
    const int64_t bs = M40_KV_BLOCK_SIZE_DEFAULT;
    m40_kv_options o = {.max_tokens = ctx > 0 && n_slots > 0 ? (int64_t)n_slots * ((ctx + bs - 1) / bs * bs) : 0};
    return m40_kv_new_opts(m, n_slots, ctx, &o, NULL, 0);
}

m40_kv *m40_kv_new_opts(const m40_model *m, int32_t n_slots, int32_t ctx, const m40_kv_options *o, char *err,
                        size_t errlen)
{
    char dummy[8];
    if (!err || !errlen) {
        err = dummy;
        errlen = sizeof dummy;
    }
    err[0] = '\0';
    if (ctx <= 0)
        ctx = m->p.ctx_train;
    if (n_slots <= 0 || ctx <= 0) {
        snprintf(err, errlen, "a KV cache needs at least one slot and a positive context (%d slots of %d)",
                 (int)n_slots, (int)ctx);
        return NULL;
    }
    if (o && (!(o->gpu_memory_fraction >= 0.0f && o->gpu_memory_fraction <= 1.0f) || o->max_tokens < 0 ||
              o->max_step_rows < 0 || o->max_step_out < 0)) {
        snprintf(err, errlen, "bad KV pool options (gpu_memory_fraction must be in (0, 1])");
        return NULL;
    }
    size_t per_slot = (size_t)m->p.n_layers * (size_t)ctx * (size_t)m->kv_dim;
    if (per_slot / (size_t)ctx / (size_t)m->kv_dim != (size_t)m->p.n_layers ||
        per_slot > SIZE_MAX / sizeof(float) / (size_t)n_slots) {
        snprintf(err, errlen, "a KV cache of %d slots of %d positions is too large", (int)n_slots, (int)ctx);
        return NULL;
    }
    m40_kv *kv = calloc(1, sizeof *kv);
    if (!kv) {
        snprintf(err, errlen, "out of memory");
        return NULL;
    }
    kv->n_slots = n_slots;
    kv->ctx = ctx;
    kv->n_layers = m->p.n_layers;
    kv->kv_dim = m->kv_dim;
    if (m->gpu) {
        m40_kv_options d = {0};
        kv->gpu = m40_gpu_kv_new(m->gpu, n_slots, ctx, o ? o : &d, err, errlen);
        if (!kv->gpu) {
            free(kv);
            return NULL;
        }
        kv->pool = m40_gpu_kv_pool(kv->gpu);
        return kv;
    }
    kv->k = calloc(per_slot * (size_t)n_slots, sizeof(float));
    kv->v = calloc(per_slot * (size_t)n_slots, sizeof(float));
    if (!kv->k || !kv->v) {
        snprintf(err, errlen, "out of memory for a KV cache of %d slots of %d positions (%.2f GB)", (int)n_slots,
                 (int)ctx, 2.0 * (double)per_slot * (double)n_slots * sizeof(float) / 1e9);
        m40_kv_free(kv);
        return NULL;
    }
    return kv;
}

void m40_kv_get_pool_info(const m40_kv *kv, m40_kv_pool_info *out)
{
    memset(out, 0, sizeof *out);
    if (kv && kv->gpu)
        m40_gpu_kv_pool_info(kv->gpu, out);
}

void m40_kv_free(m40_kv *kv)
{
    if (!kv)
        return;
    m40_gpu_kv_free(kv->gpu);
    free(kv->k);
    free(kv->v);
    free(kv);
}

void m40_kv_slot_clear(m40_kv *kv, int32_t slot)
{
    if (kv && kv->pool && slot >= 0 && slot < kv->n_slots)
        m40_paged_kv_slot_clear(kv->pool, slot);
}

int32_t m40_kv_pool_blocks(const m40_kv *kv) { return kv->pool ? m40_paged_kv_blocks_total(kv->pool) : 0; }
int32_t m40_kv_pool_free_blocks(const m40_kv *kv) { return kv->pool ? m40_paged_kv_blocks_free(kv->pool) : 0; }

/* The CPU backend keeps no prefix cache (a slot's memory is its own): no hits. */
int m40_kv_prefix_cache_enabled(const m40_kv *kv) { return kv && kv->pool && m40_paged_kv_prefix_cache(kv->pool); }

int32_t m40_kv_slot_match_prefix(m40_kv *kv, int32_t slot, const int32_t *tokens, int32_t n)
{
    if (!kv || !kv->pool || slot < 0 || slot >= kv->n_slots || !tokens || n <= 0)
        return 0;
    int32_t got = m40_paged_kv_match_prefix(kv->pool, slot, tokens, n);
    return got > 0 ? got : 0;
}

void m40_kv_get_prefix_stats(const m40_kv *kv, m40_kv_prefix_stats *out)
{
    memset(out, 0, sizeof *out);
    if (kv && kv->pool)
        m40_paged_kv_prefix_stats(kv->pool, &out->queries, &out->query_tokens, &out->hit_tokens);
}

void m40_kv_prefix_forget(m40_kv *kv)
{
    if (kv && kv->pool)
        m40_paged_kv_prefix_forget(kv->pool);
}

_Static_assert(M40_FORWARD_NO_BLOCKS == M40_KV_NO_BLOCKS, "one value for a pool that lacks blocks");

int m40_kv_reserve(m40_kv *kv, const m40_batch *b, char *err, size_t errlen)
{
    if (!kv->pool) /* the CPU cache: every slot holds its whole context */
        return 0;
    for (int32_t i = 0; i < b->n; i++)
        if (b->pos[i] < 0 || b->pos[i] >= kv->ctx) {
            m40_set_err(err, errlen, "batch entry %d: position %d beyond the context of %d", (int)i, (int)b->pos[i],
                        (int)kv->ctx);
            return -1;
        }
    return m40_paged_kv_reserve(kv->pool, b->n, b->tokens, b->pos, b->slot, err, errlen);
}

int32_t m40_kv_ctx(const m40_kv *kv) { return kv->ctx; }
int32_t m40_kv_n_slots(const m40_kv *kv) { return kv->n_slots; }

static float *kv_row(const m40_kv *kv, float *base, int32_t slot, int32_t l, int32_t pos)
{
    return base + (((size_t)slot * (size_t)kv->n_layers + (size_t)l) * (size_t)kv->ctx + (size_t)pos) *
                      (size_t)kv->kv_dim;
}

/* ------------------------------------------------------------- the math ---- */

/* Eight independent partial sums: lets the compiler vectorize without -ffast-math and
 * fixes the summation order, so a result never depends on how work was split. */
static void rmsnorm(float *out, const float *x, const float *w, int32_t dim, float eps)
{
    double ss = 0;
    for (int32_t i = 0; i < dim; i++)
        ss += (double)x[i] * x[i];
    float scale = 1.0f / sqrtf((float)(ss / dim) + eps);
    for (int32_t i = 0; i < dim; i++)
        out[i] = x[i] * scale * w[i];
}

static float silu(float x) { return x / (1.0f + expf(-x)); }

/* Whether the reference rounds the activations of this product to F16 first.
 *
 * The reference outputs come from ggml's CPU backend, whose F16 weight products take
 * one of two paths. Its tiled GEMM (llamafile sgemm / tinyBLAS), in the build that made
 * the references (evidently one whose F16 kernel takes F32 activations, as ggml's plain
 * ARM NEON build does), multiplies F16 weights with the F32 activations as they are, but
 * only takes shapes whose row count (and input length) is a multiple of 4
 * (tinyBLAS::matmul returns false otherwise). Every other shape falls back to ggml's
 * generic mul_mat, which first converts the activations to the weight's vec_dot type,
 * F16 for F16 weights, and accumulates in F32. The references show exactly this split: the F16
 * products of tiny-llama-spm-gqa-f16 (all row counts multiples of 4) agree with plain
 * F32 math to 3e-6 and move to 2e-3 when their inputs are rounded, while the tied F16
 * output head of tiny-qwen2-gpt2-f16 (50257 rows) is off by 7e-3 unless its input is
 * rounded, and by 7e-5 with the rounding. So we round where the reference does, decided
 * by the weight's type and shape alone (never by the batch, so batched and unbatched
 * results stay equal). The cost is the F16 rounding (relative 2^-11) of the input of
 * such products, which ggml's x86 build applies to every F16 product anyway.
 * BF16 is not covered: no reference with BF16 weights checks it yet. */
static int rounds_input_to_f16(const matrix *w)
{
    return w->type == M40_TYPE_F16 && (w->rows % 4 != 0 || w->cols % 4 != 0);
}

/* out[t] = W x[t] (+ bias) for the n token vectors of x. */
static void matmul(m40_model *m, const matrix *w, const float *x, int32_t n, float *out, const float *bias)
{
    if (rounds_input_to_f16(w)) {
        size_t len = (size_t)n * (size_t)w->cols;
        for (size_t i = 0; i < len; i++)
            m->x16[i] = m40_fp16_to_fp32(m40_fp32_to_fp16(x[i]));
        x = m->x16;
    }
    m40_cpu_matmul(m->pool, m->n_threads, m->row_buf, m->row_buf_len, w, x, n, out);
    if (bias)
        for (int32_t t = 0; t < n; t++)
            for (int64_t r = 0; r < w->rows; r++)
                out[(size_t)t * (size_t)w->rows + (size_t)r] += bias[r];
}

/* Rotates the first rope_dim dims of each head. Normal (llama): pairs (2i, 2i+1), as
 * the GGUF conversion permuted Q/K weights for it; NeoX (qwen2): pairs (i, i+rope_dim/2). */
static void rope(const m40_model *m, float *vec, int32_t n_heads, const float *cos_t, const float *sin_t)
{
    int32_t hd = m->p.head_dim, half = m->p.rope_dim / 2;
    for (int32_t h = 0; h < n_heads; h++) {
        float *v = vec + (size_t)h * hd;
        for (int32_t i = 0; i < half; i++) {
            int32_t a = m->p.rope_neox ? i : 2 * i;
            int32_t b = m->p.rope_neox ? i + half : 2 * i + 1;
            float x0 = v[a], x1 = v[b];
            v[a] = x0 * cos_t[i] - x1 * sin_t[i];
            v[b] = x0 * sin_t[i] + x1 * cos_t[i];
        }
    }
}

typedef struct {
    m40_model *m;
    m40_kv *kv;
    const m40_batch *b;
    int32_t l;
} attn_job;

/* One (token, head): softmax(q.k / sqrt(hd)) over the slot's positions 0..pos, times V. */
static void attention_task(void *ctx, int task, int thread)
{
    attn_job *j = ctx;
    m40_model *m = j->m;
    int32_t hd = m->p.head_dim;
    int32_t i = task / m->p.n_heads, h = task % m->p.n_heads;
    int32_t kvh = h / (m->p.n_heads / m->p.n_kv_heads);
    int32_t slot = j->b->slot[i], pos = j->b->pos[i];
    const float *q = m->q + (size_t)i * m->q_dim + (size_t)h * hd;
    float *out = m->att + (size_t)i * m->q_dim + (size_t)h * hd;
    float *score = m->score_buf + (size_t)thread * m->score_buf_len;
    float scale = 1.0f / sqrtf((float)hd);

    float max = -INFINITY;
    for (int32_t t = 0; t <= pos; t++) {
        score[t] = m40_dot_f32(q, kv_row(j->kv, j->kv->k, slot, j->l, t) + (size_t)kvh * hd, hd) * scale;
        if (score[t] > max)
            max = score[t];
    }
    double sum = 0;
    for (int32_t t = 0; t <= pos; t++) {
        score[t] = expf(score[t] - max);
        sum += score[t];
    }
    float inv = (float)(1.0 / sum);
    memset(out, 0, (size_t)hd * sizeof *out);
    for (int32_t t = 0; t <= pos; t++) {
        const float *v = kv_row(j->kv, j->kv->v, slot, j->l, t) + (size_t)kvh * hd;
        float w = score[t] * inv;
        for (int32_t d = 0; d < hd; d++)
            out[d] += w * v[d];
    }
}

/* ------------------------------------------------------------- forward ---- */

static int grow(float **buf, size_t n)
{
    float *p = realloc(*buf, n * sizeof **buf);
    if (!p)
        return -1;
    *buf = p;
    return 0;
}

static int ensure_scratch(m40_model *m, int32_t n, int32_t ctx)
{
    const m40_model_params *p = &m->p;
    size_t nt = (size_t)m->n_threads;
    if (n > m->cap_tokens) {
        size_t N = (size_t)n;
        size_t in_max = (size_t)(p->dim > p->ffn_dim ? p->dim : p->ffn_dim);
        if ((size_t)m->q_dim > in_max)
            in_max = (size_t)m->q_dim;
        int32_t *rows = realloc(m->logit_rows, N * sizeof *rows);
        if (!rows)
            return -1;
        m->logit_rows = rows;
        if (grow(&m->x, N * p->dim) || grow(&m->xb, N * p->dim) || grow(&m->q, N * m->q_dim) ||
            grow(&m->k, N * m->kv_dim) || grow(&m->v, N * m->kv_dim) || grow(&m->att, N * m->q_dim) ||
            grow(&m->hb, N * p->ffn_dim) || grow(&m->hb2, N * p->ffn_dim) || grow(&m->x16, N * in_max) ||
            grow(&m->rope_cos, N * (p->rope_dim / 2)) || grow(&m->rope_sin, N * (p->rope_dim / 2)))
            return -1;
        m->cap_tokens = n;
    }
    if (!m->row_buf) {
        int64_t len = p->dim > p->ffn_dim ? p->dim : p->ffn_dim;
        if (m->q_dim > len)
            len = m->q_dim;
        if (grow(&m->row_buf, nt * (size_t)len))
            return -1;
        m->row_buf_len = len;
    }
    if (ctx > m->score_buf_len) {
        if (grow(&m->score_buf, nt * (size_t)ctx))
            return -1;
        m->score_buf_len = ctx;
    }
    return 0;
}

static int check_batch(const m40_model *m, const m40_kv *kv, const m40_batch *b, char *err, size_t errlen)
{
    if (b->n <= 0) {
        m40_set_err(err, errlen, "empty batch");
        return -1;
    }
    if (kv->n_layers != m->p.n_layers || kv->kv_dim != m->kv_dim) {
        m40_set_err(err, errlen, "the KV cache was made for another model");
        return -1;
    }
    for (int32_t i = 0; i < b->n; i++) {
        if (b->tokens[i] < 0 || b->tokens[i] >= m->p.n_vocab) {
            m40_set_err(err, errlen, "batch entry %d: token %d out of range (vocabulary of %d)", (int)i,
                    (int)b->tokens[i], (int)m->p.n_vocab);
            return -1;
        }
        if (b->slot[i] < 0 || b->slot[i] >= kv->n_slots) {
            m40_set_err(err, errlen, "batch entry %d: slot %d out of range (%d slots)", (int)i, (int)b->slot[i],
                    (int)kv->n_slots);
            return -1;
        }
        if (b->pos[i] < 0 || b->pos[i] >= kv->ctx) {
            m40_set_err(err, errlen, "batch entry %d: position %d beyond the context of %d", (int)i, (int)b->pos[i],
                    (int)kv->ctx);
            return -1;
        }
    }
    return 0;
}

int m40_model_forward(m40_model *m, m40_kv *kv, const m40_batch *b, float *logits, char *err, size_t errlen)
{
    const m40_model_params *p = &m->p;
    if (check_batch(m, kv, b, err, errlen))
        return -1;
    if (m->gpu || kv->gpu) {
        if (!m->gpu || !kv->gpu) {
            m40_set_err(err, errlen, "the KV cache and the model live on different devices");
            return -1;
        }
        return m40_gpu_forward(m->gpu, kv->gpu, b, logits, err, errlen);
    }
    if (b->argmax) { /* the CPU computes the logits anyway: pick on them */
        if (!logits) {
            m40_set_err(err, errlen, "argmax on the CPU needs the logits buffer");
            return -1;
        }
        m40_batch full = *b;
        full.argmax = NULL;
        int rc = m40_model_forward(m, kv, &full, logits, err, errlen);
        if (rc != 0)
            return rc;
        int32_t n_out = 0;
        for (int32_t i = 0; i < b->n; i++)
            n_out += b->want_logits ? b->want_logits[i] != 0 : i == b->n - 1;
        for (int32_t k = 0; k < n_out; k++) {
            const float *row = logits + (size_t)k * (size_t)p->n_vocab;
            b->argmax[k] = m40k_argmax(row, p->n_vocab); /* as the GPU picks */
        }
        return 0;
    }
    if (m->gemma3)
        return m40_gemma3_forward(m->gemma3, m->pool, kv->k, kv->v, kv->ctx, b, logits, err, errlen);
    int32_t n = b->n;
    if (ensure_scratch(m, n, kv->ctx)) {
        m40_set_err(err, errlen, "out of memory for a batch of %d tokens", (int)n);
        return -1;
    }
    size_t dim = (size_t)p->dim, ffn = (size_t)p->ffn_dim, qd = (size_t)m->q_dim, kvd = (size_t)m->kv_dim;
    int32_t half = p->rope_dim / 2;

    /* Embeddings, and the rotation angles of each token (shared by all layers):
     * theta_i = pos * base^(-2i/rope_dim), divided by the optional frequency factors. */
    for (int32_t i = 0; i < n; i++) {
        const matrix *e = &m->tok_embd;
        m40_dequantize_row(e->type, e->data + (size_t)b->tokens[i] * e->row_bytes, m->x + i * dim, p->dim);
        for (int32_t d = 0; d < half; d++) {
            double theta = b->pos[i] * pow(p->rope_base, -2.0 * d / p->rope_dim);
            if (m->rope_freq_factors)
                theta /= m->rope_freq_factors[d];
            m->rope_cos[(size_t)i * half + d] = (float)cos(theta);
            m->rope_sin[(size_t)i * half + d] = (float)sin(theta);
        }
    }

    for (int32_t l = 0; l < p->n_layers; l++) {
        const layer *L = &m->layers[l];

        /* attention */
        for (int32_t i = 0; i < n; i++)
            rmsnorm(m->xb + i * dim, m->x + i * dim, L->attn_norm, p->dim, p->norm_eps);
        matmul(m, &L->wq, m->xb, n, m->q, L->bq);
        matmul(m, &L->wk, m->xb, n, m->k, L->bk);
        matmul(m, &L->wv, m->xb, n, m->v, L->bv);
        for (int32_t i = 0; i < n; i++) {
            const float *c = m->rope_cos + (size_t)i * half, *s = m->rope_sin + (size_t)i * half;
            rope(m, m->q + i * qd, p->n_heads, c, s);
            rope(m, m->k + i * kvd, p->n_kv_heads, c, s);
            /* Every token's K/V goes in before any attention runs, so a token sees the
             * earlier tokens of its own slot from this same batch. */
            memcpy(kv_row(kv, kv->k, b->slot[i], l, b->pos[i]), m->k + i * kvd, kvd * sizeof(float));
            memcpy(kv_row(kv, kv->v, b->slot[i], l, b->pos[i]), m->v + i * kvd, kvd * sizeof(float));
        }
        attn_job aj = {.m = m, .kv = kv, .b = b, .l = l};
        m40_threadpool_run(m->pool, n * p->n_heads, attention_task, &aj);
        matmul(m, &L->wo, m->att, n, m->xb, NULL);
        for (size_t i = 0; i < (size_t)n * dim; i++)
            m->x[i] += m->xb[i];

        /* feed-forward: down(silu(gate x) * up x) */
        for (int32_t i = 0; i < n; i++)
            rmsnorm(m->xb + i * dim, m->x + i * dim, L->ffn_norm, p->dim, p->norm_eps);
        matmul(m, &L->w_gate, m->xb, n, m->hb, NULL);
        matmul(m, &L->w_up, m->xb, n, m->hb2, NULL);
        for (size_t i = 0; i < (size_t)n * ffn; i++)
            m->hb[i] = silu(m->hb[i]) * m->hb2[i];
        matmul(m, &L->w_down, m->hb, n, m->xb, NULL);
        for (size_t i = 0; i < (size_t)n * dim; i++)
            m->x[i] += m->xb[i];
    }

    /* Only the rows that want logits go through the final norm and the output head. */
    int32_t n_out = 0;
    for (int32_t i = 0; i < n; i++)
        if (b->want_logits ? b->want_logits[i] != 0 : i == n - 1)
            m->logit_rows[n_out++] = i;
    for (int32_t j = 0; j < n_out; j++)
        rmsnorm(m->xb + j * dim, m->x + (size_t)m->logit_rows[j] * dim, m->output_norm, p->dim, p->norm_eps);
    if (n_out > 0)
        matmul(m, &m->output, m->xb, n_out, logits, NULL);
    return 0;
}
