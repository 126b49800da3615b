/* Tensor parallelism's partition (engine/model/tp_shard.c) and its CPU twin
 * (engine/model/model_tp.c): the views of each rank are the right rows and columns of
 * the weights, every type's strided column views dequantize to the slice of the full
 * rows, what cannot split is refused with a message that says why, and a model run over
 * 2 or 4 simulated ranks gives the logits of one rank (mixed prefill and decode batches,
 * the argmax path too) for F32, Q8_0 and Q4_K_M synthetic files and, where ../shared
 * has them, the shared references' models. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "check.h"
#include "gguf/mkmodel.h"
#include "model/model_priv.h"
#include "model/tp_shard.h"
#include "ref/ggml_types.h"
#include "ref/quant.h"
#include "tp_compare.h"

static int make(const char *shape, m40_mkmodel_ftype t, const char *path)
{
    m40_mkmodel_opts o = {.shape = m40_mkmodel_find_shape(shape), .ftype = t, .seed = 7, .n_threads = 2};
    char err[256];
    int rc = m40_mkmodel_write(&o, path, NULL, err, sizeof err);
    CHECK(rc == 0, "mkmodel %s: %s", shape, err);
    return rc;
}

/* row r of w, dequantized (cols of the view) */
static void row_f32(const m40_matrix *w, int64_t r, float *out)
{
    m40_dequantize_row(w->type, w->data + (size_t)r * w->row_bytes, out, w->cols);
}

/* Every rank's views against the whole matrices, element by element. */
static void check_views(const char *path, const char *label, int n)
{
    m40_model *m = NULL;
    char err[512];
    m40_model_options o = {.n_threads = 1, .device = -1};
    if (m40_model_load_opts(path, &o, &m, err, sizeof err)) {
        CHECK(0, "%s: %s", label, err);
        return;
    }
    const m40_model_params *p = &m->p;
    CHECK(m40_tp_check(p, m->layers, n, err, sizeof err) == 0, "%s tp=%d: %s", label, n, err);
    float *full = malloc(sizeof(float) * 65536), *part = malloc(sizeof(float) * 65536);
    int64_t vocab_seen = 0;
    for (int r = 0; r < n; r++) {
        m40_tp_shard s;
        if (m40_tp_shard_make(p, &m->output, m->layers, r, n, &s, err, sizeof err)) {
            CHECK(0, "%s rank %d: %s", label, r, err);
            continue;
        }
        CHECK(s.n_heads * n == p->n_heads && s.n_kv_heads * n == p->n_kv_heads && s.ffn_dim * n == p->ffn_dim,
              "%s rank %d: shares of heads and FFN", label, r);
        CHECK(s.vocab0 == vocab_seen && s.vocab_rows > 0 && s.vocab_rows <= s.vocab_stride, "%s rank %d: vocab rows",
              label, r);
        vocab_seen += s.vocab_rows;
        for (int32_t l = 0; l < p->n_layers; l++) {
            const m40_layer *L = &m->layers[l], *S = &s.layers[l];
            /* column-parallel: rows from the rank's offset */
            struct { const m40_matrix *a, *b; int64_t r0; } rowv[] = {
                {&L->wq, &S->wq, (int64_t)r * s.q_dim}, {&L->wk, &S->wk, (int64_t)r * s.kv_dim},
                {&L->wv, &S->wv, (int64_t)r * s.kv_dim}, {&L->w_gate, &S->w_gate, (int64_t)r * s.ffn_dim},
                {&L->w_up, &S->w_up, (int64_t)r * s.ffn_dim}};
            for (size_t i = 0; i < sizeof rowv / sizeof rowv[0]; i++) {
                int same = rowv[i].b->cols == rowv[i].a->cols;
                for (int64_t j = 0; j < rowv[i].b->rows && same; j += 37) {
                    row_f32(rowv[i].a, rowv[i].r0 + j, full);
                    row_f32(rowv[i].b, j, part);
                    same = !memcmp(full, part, sizeof(float) * (size_t)rowv[i].a->cols);
                }
                CHECK(same, "%s rank %d layer %d: row view %zu", label, r, (int)l, i);
            }
            /* row-parallel: each row's columns from the rank's offset, strided */
            struct { const m40_matrix *a, *b; int64_t c0; } colv[] = {{&L->wo, &S->wo, (int64_t)r * s.q_dim},
                                                                     {&L->w_down, &S->w_down, (int64_t)r * s.ffn_dim}};
            for (size_t i = 0; i < 2; i++) {
                int same = colv[i].b->rows == colv[i].a->rows && colv[i].b->row_bytes == colv[i].a->row_bytes;
                for (int64_t j = 0; j < colv[i].b->rows && same; j += 41) {
                    row_f32(colv[i].a, j, full);
                    row_f32(colv[i].b, j, part);
                    same = !memcmp(full + colv[i].c0, part, sizeof(float) * (size_t)colv[i].b->cols);
                }
                CHECK(same, "%s rank %d layer %d: column view %zu", label, r, (int)l, i);
            }
            CHECK(S->attn_norm == L->attn_norm && S->ffn_norm == L->ffn_norm, "%s: norms stay whole", label);
        }
        row_f32(&m->output, s.vocab0, full);
        row_f32(&s.output, 0, part);
        CHECK(!memcmp(full, part, sizeof(float) * (size_t)p->dim), "%s rank %d: head rows", label, r);
        m40_tp_shard_free(&s);
    }
    CHECK(vocab_seen == p->n_vocab, "%s: the ranks' vocabulary rows cover %lld of %d", label, (long long)vocab_seen,
          (int)p->n_vocab);
    free(full);
    free(part);
    m40_model_free(m);
}

/* What does not split is refused at load, naming why. */
static void check_refused(const char *path, int n, const char *want)
{
    m40_model *m = NULL;
    char err[512] = "";
    m40_model_options o = {.n_threads = 1, .device = -1, .tp = n};
    int rc = m40_model_load_opts(path, &o, &m, err, sizeof err);
    CHECK(rc != 0 && strstr(err, want), "tp=%d of %s: refused with '%s' (got %d: '%s')", n, path, want, rc, err);
    m40_model_free(m);
}

int main(void)
{
    char dir[] = "/tmp/m40-test-tp-XXXXXX";
    if (!mkdtemp(dir)) {
        SKIP("no temporary directory");
        return check_done();
    }
    char f32[300], q8[300], q4[300], tiny_q4[300], moe[300];
    snprintf(f32, sizeof f32, "%s/tp-f32.gguf", dir);
    snprintf(q8, sizeof q8, "%s/tp-q8_0.gguf", dir);
    snprintf(q4, sizeof q4, "%s/tp-q4km.gguf", dir);
    snprintf(tiny_q4, sizeof tiny_q4, "%s/tiny-q4km.gguf", dir);
    snprintf(moe, sizeof moe, "%s/moe.gguf", dir);
    int ok = !make("tiny-tp", M40_MK_F32, f32) && !make("tiny-tp", M40_MK_Q8_0, q8) &&
             !make("tiny-tp", M40_MK_Q4_K_M, q4) && !make("tiny", M40_MK_Q4_K_M, tiny_q4) &&
             !make("tiny-qwen3moe", M40_MK_F16, moe);
    if (ok) {
        check_views(f32, "tiny-tp F32", 2);
        check_views(q8, "tiny-tp Q8_0", 4);
        check_views(q4, "tiny-tp Q4_K_M", 4);
        /* one rank's sums against n ranks': only the order of the additions differs */
        tpc_compare(f32, "tiny-tp F32", -1, 2, 1e-5);
        tpc_compare(f32, "tiny-tp F32", -1, 4, 1e-5);
        tpc_compare(q8, "tiny-tp Q8_0", -1, 2, 1e-5);
        tpc_compare(q4, "tiny-tp Q4_K_M", -1, 4, 1e-5);
        check_refused(f32, 3, "does not divide the model's 8 attention heads");
        check_refused(tiny_q4, 2, "whole number of blocks");
        check_refused(moe, 2, "mixtures of experts");
    }
    /* tp 0 and 1 are one rank: they load */
    {
        m40_model *m = NULL;
        char err[256];
        m40_model_options o = {.n_threads = 1, .device = -1, .tp = 1};
        CHECK(!ok || m40_model_load_opts(f32, &o, &m, err, sizeof err) == 0, "tp=1 loads: %s", err);
        m40_model_free(m);
    }
    /* the shared references' models that split (heads, KV heads and blocks) */
    const struct { const char *file; int tp; } shared[] = {
        {"models/stories260K.gguf", 4}, {"models/tiny-llama-spm-gqa-f16.gguf", 2},
        {"models/tiny-qwen2-gpt2-f16.gguf", 2}, {"models/tiny-llama-q8_0.gguf", 2},
        {"models/next/tiny-qwen3-gpt2-f16.gguf", 2}, {"models/next/tiny-gemma2-f16.gguf", 2},
        {"models/next/tiny-phi3-f16.gguf", 2}};
    for (size_t i = 0; i < sizeof shared / sizeof shared[0]; i++) {
        char path[4096];
        if (!check_shared_file(shared[i].file, path, sizeof path)) {
            SKIP("%s absent (../shared)", shared[i].file);
            continue;
        }
        tpc_compare(path, shared[i].file, -1, shared[i].tp, 1e-5);
    }
    const char *files[] = {f32, q8, q4, tiny_q4, moe};
    for (size_t i = 0; i < 5; i++)
        unlink(files[i]);
    rmdir(dir);
    return check_done();
}
