/* The transformer on the CPU, every row of the architecture table (arch.h): the
 * reference forward pass. One loader fills each layer's tensors as the row says (fused
 * tensors become views, optional norms stay NULL when the row has none); the forward
 * pass is the llama block plus what a layer or the model carries:
 *
 *   h  = x + post_attn_norm(Wo attn(rope(q_norm(Wq n)), rope(k_norm(Wk n)), Wv n)),
 *        n = attn_norm(x)
 *   x' = h + post_ffw_norm(Wdown(act(Wgate m) * Wup m)),  m = ffn_norm(h)
 *
 * each optional norm applied only where the layer has it (Q/K norms run per head over
 * head_dim), each bias added where the layer has it (q/k/v and, for gpt-oss, the
 * output), a layer's learned sink logits joining its softmax where it has them, and the
 * FFN replaced by the layer's mixture of experts where it has a router (ffn.c),
 * x0 = token_embd[token] * embd_scale, logits = output(output_norm(x_L)),
 * soft-capped where the model caps; local (sliding-window) layers see the last `window`
 * positions and rotate with their own RoPE base; YaRN (gpt-oss) changes the angles and
 * the magnitude of every layer's rotation (yarn_theta). Gemma's details (the window pattern,
 * the local base, the attention scale) are documented where model_load.c reads them
 * (load_row_scalars, load_layer_kinds) and in arch.c.
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
#include "ref/cpu_ref.h"  /* m40_ref_sample: the GPU's draw on the CPU */
#include "gpu/model_gpu.h"
#include "model_internal.h"
#include "model_priv.h"
#include "ffn.h"
#include "cpu_matmul_fast.h"
#include "ref/quant.h"
#include "util/threadpool.h"

static void mark_ragged_all(m40_model *m);

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
    if (opts && opts->batch_invariant)
        m->tuning.batch_invariant = 1;
    m->ctx_request = opts && opts->ctx_size > 0 ? opts->ctx_size : 0;
    char sub[512];
    if (m40_gguf_open(path, &m->gguf, sub, sizeof sub) != 0) {
        m40_set_err(err, errlen, "%s: %s", path, sub);
        goto fail;
    }
    if (m40_model_read(m, sub, sizeof sub)) {
        m40_set_err(err, errlen, "%s: %s", path, sub);
        goto fail;
    }
    mark_ragged_all(m);
    if (m40_arch_device_ok(m->arch, device, sub, sizeof sub)) { /* before any CUDA call */
        if (!m->tuning.gpu_unvalidated) {
            m40_set_err(err, errlen, "%s: %s", path, sub);
            goto fail;
        }
        /* the test seam that lets a developer validate a row's GPU path without a rebuild */
        fprintf(stderr, "m40: WARNING: %s: M40_GPU_UNVALIDATED=1: architecture '%s' loads on GPU %d although its GPU "
                "path is not validated; its outputs may be wrong (a test seam, not for serving)\n", path,
                m->arch->name, device);
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
    if (m->longrope && opts && opts->log_progress)
        fprintf(stderr, "m40: %s: LongRoPE: the %s factors (a sequence's context %d, the original %d)\n", path,
                m->longrope == 2 ? "long" : "short", (int)(m->ctx_request > 0 ? m->ctx_request : m->p.ctx_train),
                (int)m->longrope_orig);
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
    m->fast = opts && opts->cpu_fast && device < 0;
    if (m->fast) {
        m->attn_dot = m40_dot_f_kernel(M40_TYPE_F32, m40_cpu_isa()); /* NULL without AVX2 */
        m->attn_axpy = m->attn_dot ? m40_axpy_kernel(m40_cpu_isa()) : NULL;
    }
    m->device = -1;
    const int tp = opts && opts->tp > 1 ? opts->tp : 1;
    if (tp > 1 && device < 0 && m40_tp_sim_new(m, tp, sub, sizeof sub)) {
        m40_set_err(err, errlen, "%s: %s", path, sub);
        goto fail;
    }
    if (device >= 0) {
        m40_gpu_src src;
        m40_model_gpu_src(m, &src);
        int rc = m40_gpu_load_tp(&src, &m->tuning, device, tp, opts && opts->log_progress, &m->gpu, sub, sizeof sub);
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
            free(L->q_norm);
            free(L->k_norm);
            free(L->post_attn_norm);
            free(L->post_ffw_norm);
            float *moe[] = {L->bo, L->attn_sinks, L->router_b, L->exp_gate_b, L->exp_up_b, L->exp_down_b,
                            L->sh_gate_inp};
            for (size_t i = 0; i < sizeof moe / sizeof moe[0]; i++)
                free(moe[i]);
        }
        free(m->layers);
    }
    m40_tp_sim_free(m->tp);
    m40_gpu_free(m->gpu);
    free(m->output_norm);
    free(m->rope_freq_factors);
    m40_threadpool_free(m->pool);
    m40_tokenizer_free(m->tok);
    m40_gguf_close(m->gguf);
    m40_model_free_scratch(m);
    free(m);
}

void m40_model_free_scratch(m40_model *m)
{
    float *bufs[] = {m->x, m->xb, m->q, m->k, m->v, m->att, m->hb, m->hb2, m->x16, m->rope_cos, m->rope_sin,
                     m->rope_cos_l, m->rope_sin_l, m->row_buf, m->score_buf, m->moe_logits, m->moe_w,
                     m->moe_in, m->moe_out};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        free(bufs[i]);
    free(m->logit_rows);
    free(m->xq);
    free(m->xsum);
    free(m->moe_ids);
    free(m->moe_rows);
    m40_model_scratch_reset(m);
}

void m40_model_scratch_reset(m40_model *m)
{
    m->cap_tokens = 0;
    m->x = m->xb = m->q = m->k = m->v = m->att = m->hb = m->hb2 = m->x16 = NULL;
    m->rope_cos = m->rope_sin = m->rope_cos_l = m->rope_sin_l = m->row_buf = m->score_buf = NULL;
    m->moe_logits = m->moe_w = m->moe_in = m->moe_out = NULL;
    m->logit_rows = m->moe_ids = m->moe_rows = NULL;
    m->xq = NULL;
    m->xsum = NULL;
    m->row_buf_len = 0;
    m->score_buf_len = 0;
}

const m40_model_params *m40_model_get_params(const m40_model *m) { return &m->p; }
const m40_tokenizer *m40_model_tokenizer(const m40_model *m) { return m->tok; }
const m40_gguf *m40_model_gguf(const m40_model *m) { return m->gguf; }
int m40_model_n_threads(const m40_model *m) { return m->n_threads; }
const char *m40_model_cpu_path(const m40_model *m)
{
    static const char *const fast[M40_ISA_COUNT] = {"fast: portable C", "fast: AVX2", "fast: AVX-512 VNNI",
                                                    "fast: AMX", "fast: NEON"};
    return m->gpu ? "gpu" : m->fast ? fast[m40_cpu_isa()] : "exact";
}
int m40_model_device(const m40_model *m) { return m->gpu ? m->device : -1; }
const m40_tuning *m40_model_tuning(const m40_model *m) { return &m->tuning; }
void m40_model_graph_stats(const m40_model *m, int64_t *captures, int64_t *launches)
{
    *captures = *launches = 0;
    if (m->gpu)
        m40_gpu_graph_stats(m->gpu, captures, launches);
}

void m40_model_collective_time(const m40_model *m, double *seconds, int64_t *calls)
{
    double ms = 0;
    *calls = 0;
    if (m->gpu)
        m40_gpu_tp_time(m->gpu, &ms, calls);
    *seconds = ms / 1e3;
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
    if (m->tp) { /* each simulated rank keeps the cache of its heads */
        if (m40_tp_sim_kv(m->tp, kv, err, errlen)) {
            m40_kv_free(kv);
            return NULL;
        }
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
    for (int i = 0; i < kv->n_rank_kv; i++)
        m40_kv_free(kv->rank_kv[i]);
    free(kv->rank_kv);
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

/* c * tanh(x / c): Gemma's soft-capping of attention scores and logits. */
static float softcap(float x, float c) { return c * tanhf(x / c); }

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
 * BF16 is not covered: no reference with BF16 weights checks it yet.
 *
 * The rule belongs to that reference build, so it is a column of the architecture table
 * (f16_round_ragged): on for llama and qwen2, whose references it matches. The second
 * batch of references (../shared/models/next, a 2026 build) multiplies every F16 weight
 * with F32 activations: its qwen3 file's tied 50257-row head agrees to 1.9e-5 unrounded
 * and is off by 4.6e-3 rounded, so the rows checked against it leave it off, and so does
 * gemma3, whose forward pass never rounded. */
static int rounds_input_to_f16(const m40_model *m, const matrix *w)
{
    return m->arch->f16_round_ragged && w->type == M40_TYPE_F16 && w->ragged4;
}

static void mark_ragged(matrix *w) { w->ragged4 = w->rows % 4 != 0 || w->cols % 4 != 0; }

/* Every matrix's ragged4 from its shape as loaded (views of fused tensors included). */
static void mark_ragged_all(m40_model *m)
{
    mark_ragged(&m->tok_embd);
    mark_ragged(&m->output);
    for (int32_t l = 0; l < m->p.n_layers; l++) {
        layer *L = &m->layers[l];
        matrix *ws[] = {&L->wq, &L->wk, &L->wv, &L->wo, &L->w_gate, &L->w_up, &L->w_down, &L->router,
                        &L->exp_gate, &L->exp_up, &L->exp_down, &L->sh_gate, &L->sh_up, &L->sh_down};
        for (size_t i = 0; i < sizeof ws / sizeof ws[0]; i++)
            mark_ragged(ws[i]);
    }
}

/* The exact reference product (the only one when m->fast is off). */
static void matmul_exact(m40_model *m, const matrix *w, const float *x, int32_t n, float *out)
{
    if (rounds_input_to_f16(m, w)) {
        size_t len = (size_t)n * (size_t)w->cols;
        for (size_t i = 0; i < len; i++)
            m->x16[i] = m40_fp16_to_fp32(m40_fp32_to_fp16(x[i]));
        x = m->x16;
    }
    m40_cpu_matmul(m->pool, m->n_threads, m->row_buf, m->row_buf_len, w, x, n, out);
}

static void add_bias(const matrix *w, int32_t n, float *out, const float *bias)
{
    if (bias)
        for (int32_t t = 0; t < n; t++)
            for (int64_t r = 0; r < w->rows; r++)
                out[(size_t)t * (size_t)w->rows + (size_t)r] += bias[r];
}

/* The fast path quantizes x once for every matrix of the group that reads int16
 * records and runs the supported ones in one pool run; a type without a fast kernel
 * (Q2_K, Q3_K, BF16, MXFP4) takes the exact product. The F16 input rounding of
 * rounds_input_to_f16 is the reference's and stays on the exact path: the fast path
 * multiplies F16 weights with the F32 activations as they are. */
void m40_model_matmul_group(m40_model *m, const matrix *const *ws, float *const *outs, const float *const *biases,
                            int count, const float *x, int32_t n)
{
    const matrix *fw[M40_FAST_MAX_GROUP];
    float *fo[M40_FAST_MAX_GROUP];
    int nf = 0, need_q = 0;
    for (int i = 0; i < count; i++) {
        int quantized = 0;
        if (m->fast && nf < M40_FAST_MAX_GROUP && m40_fast_supported(ws[i], &quantized)) {
            fw[nf] = ws[i];
            fo[nf++] = outs[i];
            need_q |= quantized;
        } else {
            matmul_exact(m, ws[i], x, n, outs[i]);
        }
    }
    if (nf > 0) {
        if (need_q)
            m40_fast_quantize(m->pool, x, n, fw[0]->cols, m->xq, m->xsum);
        m40_fast_matmul(m->pool, m->n_threads, fw, fo, nf, x, m->xq, m->xsum, n);
    }
    for (int i = 0; i < count; i++)
        add_bias(ws[i], n, outs[i], biases ? biases[i] : NULL);
}

void m40_model_matmul(m40_model *m, const matrix *w, const float *x, int32_t n, float *out, const float *bias)
{
    m40_model_matmul_group(m, &w, &out, &bias, 1, x, n);
}

/* YaRN's angle of dimension pair d from its unscaled angle, and the magnitude its
 * cos and sin take (model_load.c, load_yarn): interpolated (theta * freq_scale) for the
 * pairs below yarn_low, unchanged above yarn_high, a linear ramp between. */
static double yarn_theta(const m40_model *m, double theta, int32_t d, float *mag)
{
    float span = m->yarn_high - m->yarn_low;
    float y = ((float)d - m->yarn_low) / (span > 0.001f ? span : 0.001f);
    double mix = 1.0 - (y < 0 ? 0 : y > 1 ? 1 : y); /* 1: extrapolate (keep theta) */
    *mag = m->yarn_mscale;
    return theta * m->yarn_freq_scale * (1.0 - mix) + theta * mix;
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

/* The most query heads of one KV head that one attention task takes (its per-head state
 * lives on the stack); more than that, and each head is a task of its own */
#define ATTN_MAX_GROUP 64

typedef struct {
    m40_model *m;
    m40_kv *kv;
    const m40_batch *b;
    int32_t l;
    int32_t heads; /* query heads a task: 1, or every head of one KV head */
} attn_job;

/* One token's attention for `heads` query heads from h0 (of one KV head): for each,
 * softmax(scale q.k, soft-capped where the model caps) over the positions the layer lets
 * it see (0..pos; a local layer only the last `window`), times V. Each key and value row
 * is read once for all of the heads, and each head's scores, softmax and sum take the
 * same steps in the same order as that head alone (the same bits). */
static void attention_task(void *ctx, int task, int thread)
{
    attn_job *j = ctx;
    m40_model *m = j->m;
    const int32_t hd = m->p.head_dim, gh = j->heads, per_task = m->p.n_heads / gh;
    const int32_t i = task / per_task, h0 = (task % per_task) * gh;
    const int32_t kvh = h0 / (m->p.n_heads / m->p.n_kv_heads);
    const int32_t slot = j->b->slot[i], pos = j->b->pos[i];
    int32_t first = 0;
    if (m->layers[j->l].local && pos - m->window + 1 > 0)
        first = pos - m->window + 1;
    const int32_t len = pos - first + 1;
    const float *q = m->q + (size_t)i * m->q_dim + (size_t)h0 * hd;
    float *out = m->att + (size_t)i * m->q_dim + (size_t)h0 * hd;
    float *score = m->score_buf + (size_t)thread * m->score_buf_len; /* [head][len] */
    const float scale = m->attn_scale, cap = m->attn_softcap;
    float max[ATTN_MAX_GROUP], inv[ATTN_MAX_GROUP];
    double sum[ATTN_MAX_GROUP];

    /* A sink (gpt-oss) is one more logit in the softmax with no value behind it: it
     * takes its share of the probability mass away from the positions. */
    const float *sinks = m->layers[j->l].attn_sinks;
    for (int32_t g = 0; g < gh; g++)
        max[g] = sinks ? sinks[h0 + g] : -INFINITY;
    for (int32_t t = first; t <= pos; t++) {
        const float *krow = kv_row(j->kv, j->kv->k, slot, j->l, t) + (size_t)kvh * hd;
        for (int32_t g = 0; g < gh; g++) {
            const float *qg = q + (size_t)g * hd;
            float s = (m->attn_dot ? m->attn_dot((const uint8_t *)krow, qg, hd) : m40_dot_f32(qg, krow, hd)) * scale;
            if (cap > 0)
                s = softcap(s, cap);
            score[(size_t)g * len + (t - first)] = s;
            if (s > max[g])
                max[g] = s;
        }
    }
    for (int32_t g = 0; g < gh; g++) {
        float *sg = score + (size_t)g * len;
        sum[g] = sinks ? expf(sinks[h0 + g] - max[g]) : 0;
        for (int32_t t = 0; t < len; t++) {
            sg[t] = expf(sg[t] - max[g]);
            sum[g] += sg[t];
        }
        inv[g] = (float)(1.0 / sum[g]);
    }
    memset(out, 0, (size_t)gh * hd * sizeof *out);
    for (int32_t t = first; t <= pos; t++) {
        const float *v = kv_row(j->kv, j->kv->v, slot, j->l, t) + (size_t)kvh * hd;
        for (int32_t g = 0; g < gh; g++) {
            float *og = out + (size_t)g * hd;
            float w = score[(size_t)g * len + (t - first)] * inv[g];
            if (m->attn_axpy) {
                m->attn_axpy(og, w, v, hd);
                continue;
            }
            for (int32_t d = 0; d < hd; d++)
                og[d] += w * v[d];
        }
    }
}

/* ------------------------------------------------------------- forward ---- */

/* x[t] += y[t] for the n rows, with y[t] RMS-normed first (in place) where the block
 * has a post-norm (Gemma's sandwich norms). */
static void add_residual(float *x, float *y, const float *post_norm, int32_t n, int32_t dim, float eps)
{
    for (int32_t i = 0; i < n; i++) {
        float *yi = y + (size_t)i * dim, *xi = x + (size_t)i * dim;
        if (post_norm)
            rmsnorm(yi, yi, post_norm, dim, eps);
        for (int32_t d = 0; d < dim; d++)
            xi[d] += yi[d];
    }
}

static int grow(float **buf, size_t n)
{
    float *p = realloc(*buf, n * sizeof **buf);
    if (!p)
        return -1;
    *buf = p;
    return 0;
}

int m40_model_ensure_scratch(m40_model *m, int32_t n, int32_t ctx)
{
    const m40_model_params *p = &m->p;
    size_t nt = (size_t)m->n_threads;
    /* the widest FFN: the dense one, an expert's or the shared expert's */
    int64_t ffn_max = p->ffn_dim;
    if (p->expert_ffn_dim > ffn_max)
        ffn_max = p->expert_ffn_dim;
    if (p->shared_ffn_dim > ffn_max)
        ffn_max = p->shared_ffn_dim;
    if (n > m->cap_tokens) {
        size_t N = (size_t)n;
        size_t in_max = (size_t)(p->dim > ffn_max ? p->dim : ffn_max);
        if ((size_t)m->q_dim > in_max)
            in_max = (size_t)m->q_dim;
        int32_t *rows = realloc(m->logit_rows, N * sizeof *rows);
        if (!rows)
            return -1;
        m->logit_rows = rows;
        if (m->fast) { /* the int16 records of the widest matmul input */
            struct m40_xq *xq = realloc(m->xq, N * ((in_max + 31) / 32) * sizeof *xq);
            if (!xq)
                return -1;
            m->xq = xq;
            if (grow(&m->xsum, N * ((in_max + 31) / 32)))
                return -1;
        }
        if (grow(&m->x, N * p->dim) || grow(&m->xb, N * p->dim) || grow(&m->q, N * m->q_dim) ||
            grow(&m->k, N * m->kv_dim) || grow(&m->v, N * m->kv_dim) || grow(&m->att, N * m->q_dim) ||
            grow(&m->hb, N * (size_t)ffn_max) || grow(&m->hb2, N * (size_t)ffn_max) || grow(&m->x16, N * in_max) ||
            grow(&m->rope_cos, N * (p->rope_dim / 2)) || grow(&m->rope_sin, N * (p->rope_dim / 2)))
            return -1;
        if (m->has_local &&
            (grow(&m->rope_cos_l, N * (p->rope_dim / 2)) || grow(&m->rope_sin_l, N * (p->rope_dim / 2))))
            return -1;
        if (p->n_experts > 0) {
            size_t E = (size_t)p->n_experts, K = (size_t)p->n_experts_used;
            int32_t *ids = realloc(m->moe_ids, N * K * sizeof *ids);
            if (ids)
                m->moe_ids = ids;
            int32_t *rows = ids ? realloc(m->moe_rows, N * K * sizeof *rows) : NULL;
            if (rows)
                m->moe_rows = rows;
            if (!ids || !rows || grow(&m->moe_logits, N * E) || grow(&m->moe_w, N * K) ||
                grow(&m->moe_in, N * (size_t)p->dim) || grow(&m->moe_out, N * K * (size_t)p->dim))
                return -1;
        }
        m->cap_tokens = n;
    }
    if (!m->row_buf) {
        int64_t len = p->dim > ffn_max ? p->dim : ffn_max;
        if (m->q_dim > len)
            len = m->q_dim;
        if (grow(&m->row_buf, nt * (size_t)len))
            return -1;
        m->row_buf_len = len;
    }
    /* a thread's scores: the context for each query head of one KV head (attention_task) */
    const int32_t group = p->n_kv_heads > 0 ? p->n_heads / p->n_kv_heads : 1;
    if ((int64_t)ctx * group > m->score_buf_len) {
        if (grow(&m->score_buf, nt * (size_t)ctx * (size_t)group))
            return -1;
        m->score_buf_len = ctx * group;
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
    if (b->logits_at)
        *b->logits_at = logits; /* a GPU may point it at its own buffer instead */
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
            float *row = logits + (size_t)k * (size_t)p->n_vocab;
            if (b->sample) { /* the GPU's draw, by its twin */
                m40k_sample_params sp;
                m40_row_sample_params(&b->sample[k], &sp);
                float lp;
                m40_ref_sample(row, p->n_vocab, 1, p->n_vocab, &sp, NULL, NULL, NULL, NULL, NULL, NULL, &b->argmax[k],
                               &lp, 0, NULL, NULL);
            } else {
                b->argmax[k] = m40k_argmax(row, p->n_vocab); /* as the GPU picks */
            }
        }
        return 0;
    }
    if (m->tp)
        return m40_tp_sim_forward(m->tp, kv, b, logits, err, errlen);
    int32_t n = b->n;
    if (m40_model_ensure_scratch(m, n, kv->ctx)) {
        m40_set_err(err, errlen, "out of memory for a batch of %d tokens", (int)n);
        return -1;
    }
    size_t dim = (size_t)p->dim, ffn = (size_t)p->ffn_dim, qd = (size_t)m->q_dim, kvd = (size_t)m->kv_dim;
    int32_t half = p->rope_dim / 2;

    /* Embeddings, and the rotation angles of each token (shared by all layers):
     * theta_i = pos * base^(-2i/rope_dim), divided by the optional frequency factors
     * and linear scale; local layers use their own base, unscaled. */
    for (int32_t i = 0; i < n; i++) {
        const matrix *e = &m->tok_embd;
        float *xi = m->x + i * dim;
        m40_dequantize_row(e->type, e->data + (size_t)b->tokens[i] * e->row_bytes, xi, p->dim);
        if (m->embd_scale != 1.0f)
            for (size_t d = 0; d < dim; d++)
                xi[d] *= m->embd_scale;
        for (int32_t d = 0; d < half; d++) {
            double theta = b->pos[i] * pow(p->rope_base, -2.0 * d / p->rope_dim);
            if (m->rope_freq_factors)
                theta /= m->rope_freq_factors[d];
            if (m->global_scale != 1.0f)
                theta /= m->global_scale;
            float mag = 1.0f;
            if (m->yarn)
                theta = yarn_theta(m, theta, d, &mag);
            m->rope_cos[(size_t)i * half + d] = (float)cos(theta) * mag;
            m->rope_sin[(size_t)i * half + d] = (float)sin(theta) * mag;
            if (m->has_local) {
                double theta_l = b->pos[i] * pow(m->local_base, -2.0 * d / p->rope_dim);
                float mag_l = 1.0f;
                if (m->yarn)
                    theta_l = yarn_theta(m, theta_l, d, &mag_l);
                m->rope_cos_l[(size_t)i * half + d] = (float)cos(theta_l) * mag_l;
                m->rope_sin_l[(size_t)i * half + d] = (float)sin(theta_l) * mag_l;
            }
        }
    }

    for (int32_t l = 0; l < p->n_layers; l++) {
        const layer *L = &m->layers[l];
        const float *cos_t = L->local ? m->rope_cos_l : m->rope_cos, *sin_t = L->local ? m->rope_sin_l : m->rope_sin;
        int32_t hd = p->head_dim;

        /* attention */
        for (int32_t i = 0; i < n; i++)
            rmsnorm(m->xb + i * dim, m->x + i * dim, L->attn_norm, p->dim, p->norm_eps);
        {
            const matrix *w3[3] = {&L->wq, &L->wk, &L->wv};
            float *o3[3] = {m->q, m->k, m->v};
            const float *b3[3] = {L->bq, L->bk, L->bv};
            m40_model_matmul_group(m, w3, o3, b3, 3, m->xb, n);
        }
        for (int32_t i = 0; i < n; i++) {
            float *q = m->q + i * qd, *k = m->k + i * kvd;
            if (L->q_norm) /* per-head RMSNorm before RoPE (Qwen3, Gemma 3) */
                for (int32_t h = 0; h < p->n_heads; h++)
                    rmsnorm(q + (size_t)h * hd, q + (size_t)h * hd, L->q_norm, hd, p->norm_eps);
            if (L->k_norm)
                for (int32_t h = 0; h < p->n_kv_heads; h++)
                    rmsnorm(k + (size_t)h * hd, k + (size_t)h * hd, L->k_norm, hd, p->norm_eps);
            const float *c = cos_t + (size_t)i * half, *s = sin_t + (size_t)i * half;
            rope(m, q, p->n_heads, c, s);
            rope(m, k, p->n_kv_heads, c, s);
            /* Every token's K/V goes in before any attention runs, so a token sees the
             * earlier tokens of its own slot from this same batch. */
            memcpy(kv_row(kv, kv->k, b->slot[i], l, b->pos[i]), k, kvd * sizeof(float));
            memcpy(kv_row(kv, kv->v, b->slot[i], l, b->pos[i]), m->v + i * kvd, kvd * sizeof(float));
        }
        /* a KV head's query heads in one task where there are tasks enough for the threads
         * (a prompt chunk): its key and value rows are then read once for all of them */
        const int32_t group = p->n_heads / p->n_kv_heads;
        const int grouped = group <= ATTN_MAX_GROUP && (int64_t)n * p->n_kv_heads >= 4 * m->n_threads;
        attn_job aj = {.m = m, .kv = kv, .b = b, .l = l, .heads = grouped ? group : 1};
        m40_threadpool_run(m->pool, n * (p->n_heads / aj.heads), attention_task, &aj);
        m40_model_matmul(m, &L->wo, m->att, n, m->xb, L->bo);
        if (m->tp_group) /* each rank holds its heads' part of the sum */
            m40_tp_all_reduce(m, m->xb, (size_t)n * dim);
        add_residual(m->x, m->xb, L->post_attn_norm, n, p->dim, p->norm_eps);

        /* feed-forward: down(act(gate x) * up x), or the layer's mixture of experts */
        for (int32_t i = 0; i < n; i++)
            rmsnorm(m->xb + i * dim, m->x + i * dim, L->ffn_norm, p->dim, p->norm_eps);
        if (L->router.data) {
            m40_moe_ffn(m, l, n);
        } else {
            const matrix *w2[2] = {&L->w_gate, &L->w_up};
            float *o2[2] = {m->hb, m->hb2};
            m40_model_matmul_group(m, w2, o2, NULL, 2, m->xb, n);
            m40_model_glu(m, m->hb, m->hb2, (size_t)n * ffn);
            m40_model_matmul(m, &L->w_down, m->hb, n, m->xb, NULL);
        }
        if (m->tp_group) /* each rank holds its FFN units' part of the sum */
            m40_tp_all_reduce(m, m->xb, (size_t)n * dim);
        add_residual(m->x, m->xb, L->post_ffw_norm, n, p->dim, p->norm_eps);
    }

    /* Only the rows that want logits go through the final norm and the output head. */
    int32_t n_out = 0;
    for (int32_t i = 0; i < n; i++)
        if (b->want_logits ? b->want_logits[i] != 0 : i == n - 1)
            m->logit_rows[n_out++] = i;
    for (int32_t j = 0; j < n_out; j++)
        rmsnorm(m->xb + j * dim, m->x + (size_t)m->logit_rows[j] * dim, m->output_norm, p->dim, p->norm_eps);
    /* a rank's head is its vocabulary rows: its piece, then every rank's gathered */
    float *out = m->tp_group ? m->tp_logits : logits;
    const size_t n_cols = m->tp_group ? (size_t)m->tp_vocab_rows : (size_t)p->n_vocab;
    if (n_out > 0) {
        m40_model_matmul(m, &m->output, m->xb, n_out, out, NULL);
        if (m->final_softcap > 0)
            for (size_t i = 0; i < (size_t)n_out * n_cols; i++)
                out[i] = softcap(out[i], m->final_softcap);
    }
    if (m->tp_group)
        m40_tp_gather_logits(m, out, n_out, logits);
    return 0;
}

void m40_row_sample_params(const m40_row_sample *r, m40k_sample_params *out)
{
    memset(out, 0, sizeof *out);
    out->temperature = r->temperature;
    out->top_k = r->top_k;
    out->top_p = r->top_p;
    out->min_p = r->min_p;
    out->repetition_penalty = 1.0f;
    out->seed = r->seed;
    out->step = r->step;
}
