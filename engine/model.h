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
    int32_t rope_dim;       /* <arch>.rope.dimension_count: leading dims of each head that are rotated */
} m40_model_params;

typedef struct m40_model m40_model;

/* Opens the GGUF, validates every tensor the architecture needs (name, shape, type
 * supported) and builds the tokenizer. -1 with err naming the problem. n_threads <= 0:
 * all online CPUs. */
int m40_model_load(const char *path, int n_threads, m40_model **out, char *err, size_t errlen);

/* Loading options. device < 0: the CPU backend; device N >= 0: every weight is
 * uploaded once to CUDA device N (mmap -> pinned staging -> device) and forward calls
 * run there with GPU-resident activations and a paged F16 KV cache (llama, qwen2;
 * engine/model_cuda.c). log_progress: upload progress lines on stderr. */
typedef struct {
    int n_threads;
    int device;
    int log_progress;
} m40_model_options;
int m40_model_load_opts(const char *path, const m40_model_options *opts, m40_model **out, char *err, size_t errlen);
/* -1: the CPU, else the CUDA device index the model lives on. */
int m40_model_device(const m40_model *m);
void m40_model_free(m40_model *m);
const m40_model_params *m40_model_get_params(const m40_model *m);
const m40_tokenizer *m40_model_tokenizer(const m40_model *m);
const m40_gguf *m40_model_gguf(const m40_model *m);
/* Threads of the model's CPU pool (the caller of m40_model_forward counts as one). */
int m40_model_n_threads(const m40_model *m);

/* KV cache for n_slots independent sequences of up to ctx tokens each (ctx <= 0: the
 * model's ctx_train). F32, allocated up front: n_slots * n_layers * ctx * 2 * kv_dim
 * floats. NULL when out of memory or n_slots <= 0. A slot holds no length: the
 * positions of the batch say what is valid, so reusing a slot for a new sequence
 * just means starting again at position 0. */
typedef struct m40_kv m40_kv;
m40_kv *m40_kv_new(const m40_model *m, int32_t n_slots, int32_t ctx);
void m40_kv_free(m40_kv *kv);
int32_t m40_kv_ctx(const m40_kv *kv);
int32_t m40_kv_n_slots(const m40_kv *kv);
/* The slot's sequence is over: on the GPU its KV blocks go back to the pool (a no-op
 * on the CPU, where a slot's memory is fixed). Positions restart at 0 afterwards.
 *
 * On a GPU model the cache is a pool of 16-token blocks (engine/kv_blocks) shared by
 * all slots, sized by ctx * n_slots or the free GPU memory, whichever is smaller
 * (the environment variable M40_KV_BLOCKS caps it: a test seam). A slot takes blocks
 * as its positions grow; a batch whose first position for a slot is below the slot's
 * length restarts that slot there. */
void m40_kv_slot_clear(m40_kv *kv, int32_t slot);
/* Pool blocks in total and unused (GPU); both 0 on the CPU. */
int32_t m40_kv_pool_blocks(const m40_kv *kv);
int32_t m40_kv_pool_free_blocks(const m40_kv *kv);

/* One forward call over n tokens that may belong to different slots. For each slot,
 * its tokens appear in increasing position order and positions continue the slot's
 * cache (token i attends to its slot's positions 0..pos[i]). Rows with want_logits[i]
 * set get n_vocab logits written, packed in order, into logits. Returns 0, or -1 with
 * err (position beyond ctx, bad slot, token out of range, out of memory). Not
 * thread-safe: one forward call at a time per model (it uses the model's scratch and
 * thread pool). */
typedef struct {
    int32_t n;
    const int32_t *tokens;
    const int32_t *pos;
    const int32_t *slot;
    const uint8_t *want_logits; /* NULL: only the last token of the batch */
} m40_batch;

/* M40_FORWARD_NO_BLOCKS (-2, GPU only): the KV pool lacks the blocks this batch needs;
 * nothing changed, so the caller can free a sequence's slot and retry. */
#define M40_FORWARD_NO_BLOCKS (-2)
int m40_model_forward(m40_model *m, m40_kv *kv, const m40_batch *b, float *logits, char *err, size_t errlen);

#endif
