/* A loaded model and its CPU forward pass (llama, qwen2). F32 activations, F32 KV cache;
 * matrix-vector products read each weight row once per batch (all tokens of the batch
 * against one row), split over the thread pool. */
#ifndef M40_MODEL_H
#define M40_MODEL_H

#include <stddef.h>
#include <stdint.h>

#include "gguf.h"
#include "tokenizer.h"

typedef struct {
    char arch[32];          /* "llama", "qwen2" */
    char name[128];         /* general.name or "" */
    int32_t n_vocab;
    int32_t dim;            /* embedding length */
    int32_t n_layers;
    int32_t n_heads;
    int32_t n_kv_heads;
    int32_t head_dim;
    int32_t ffn_dim;
    int32_t ctx_train;      /* <arch>.context_length */
    float norm_eps;
    float rope_base;
    int rope_neox;          /* 1: NeoX-style (rotate halves), 0: normal (adjacent pairs) */
    int tied_output;        /* output.weight absent: token_embd used as the head */
    uint32_t weight_type;   /* type of the majority of weights (for messages) */
} m40_model_params;

typedef struct m40_model m40_model;

/* Opens the GGUF, validates every tensor the architecture needs (name, shape, type
 * supported) and builds the tokenizer. -1 with err naming the problem. n_threads <= 0:
 * all online CPUs. */
int m40_model_load(const char *path, int n_threads, m40_model **out, char *err, size_t errlen);
void m40_model_free(m40_model *m);
const m40_model_params *m40_model_get_params(const m40_model *m);
const m40_tokenizer *m40_model_tokenizer(const m40_model *m);
const m40_gguf *m40_model_gguf(const m40_model *m);

/* KV cache for n_slots independent sequences of up to ctx tokens each. */
typedef struct m40_kv m40_kv;
m40_kv *m40_kv_new(const m40_model *m, int32_t n_slots, int32_t ctx);
void m40_kv_free(m40_kv *kv);
int32_t m40_kv_ctx(const m40_kv *kv);

/* One forward call over n tokens that may belong to different slots. For each slot,
 * its tokens appear in increasing position order and positions continue the slot's
 * cache (token i attends to its slot's positions 0..pos[i]). Rows with want_logits[i]
 * set get n_vocab logits written, packed in order, into logits. Returns 0, or -1 with
 * err (position beyond ctx, bad slot). */
typedef struct {
    int32_t n;
    const int32_t *tokens;
    const int32_t *pos;
    const int32_t *slot;
    const uint8_t *want_logits; /* NULL: only the last token of the batch */
} m40_batch;

int m40_model_forward(m40_model *m, m40_kv *kv, const m40_batch *b, float *logits, char *err, size_t errlen);

#endif
