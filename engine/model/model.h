/* A loaded model and its CPU forward pass (llama, qwen2). F32 activations, F32 KV cache;
 * matrix-vector products read each weight row once per batch (all tokens of the batch
 * against one row), split over the thread pool. */
#ifndef M40_MODEL_H
#define M40_MODEL_H

#include <stddef.h>
#include <stdint.h>

#include "gguf/gguf.h"
#include "tokenizer/tokenizer.h"
#include "util/tuning.h"

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
    /* Mixture of experts (all 0 for a dense model): experts per layer, chosen per token,
     * the width of each expert's FFN, and of the shared expert (0: none). */
    int32_t n_experts, n_experts_used, expert_ffn_dim, shared_ffn_dim;
} m40_model_params;

typedef struct m40_model m40_model;

/* Opens the GGUF, validates every tensor the architecture needs (name, shape, type
 * supported) and builds the tokenizer. -1 with err naming the problem. n_threads <= 0:
 * all online CPUs. */
int m40_model_load(const char *path, int n_threads, m40_model **out, char *err, size_t errlen);

/* Loading options. device < 0: the CPU backend; device N >= 0: every weight is
 * uploaded once to CUDA device N (mmap -> pinned staging -> device) and forward calls
 * run there with GPU-resident activations and a paged F16 KV cache (llama, qwen2;
 * engine/gpu/model_cuda.c). log_progress: upload progress lines on stderr. */
typedef struct {
    int n_threads;
    int device;
    int log_progress;
    int32_t ctx_size; /* the context one sequence gets, 0: the model's; picks LongRoPE's factor set */
    /* CPU backend only. 0 (the default, and m40_model_load's): the exact F32 reference
     * (dequantized weights times F32 activations), the one `m40 eval` and the tests
     * compare with the shared references. 1: the fast path (cpu_matmul_fast.h):
     * activations quantized to int16 per block of 32 against the quantized weights,
     * F16 weights through F16C/FMA; types without a fast kernel keep the exact path. */
    int cpu_fast;
    /* Tensor parallelism (model/tp_shard.h): 0 or 1, none; n > 1 splits the attention
     * heads, the FFN and the head's vocabulary over n ranks. With a device, the ranks are
     * CUDA devices device .. device + n - 1, joined by NCCL (gpu/tp.c); on the CPU they are
     * n simulated ranks (model_tp.c: the twin of the GPU's split, for tests). */
    int tp;
    /* GPU: 1 computes every row of a step as it would be computed alone, whatever else the
     * step holds (a greedy request's text does not depend on the load; slower: the GPU's
     * model_cuda_fwd.c, inv_*). The CPU computes a row the same way at any batch size
     * already. Also set by M40_BATCH_INVARIANT=1. */
    int batch_invariant;
} m40_model_options;
int m40_model_load_opts(const char *path, const m40_model_options *opts, m40_model **out, char *err, size_t errlen);
/* -1: the CPU, else the CUDA device index the model lives on. */
int m40_model_device(const m40_model *m);
/* The tuning switches read from the environment when the model was loaded. */
const m40_tuning *m40_model_tuning(const m40_model *m);
/* GPU models: decode-step CUDA graphs captured and launched so far (0 and 0 on the CPU). */
void m40_model_graph_stats(const m40_model *m, int64_t *captures, int64_t *launches);
/* GPU models: time each forward call's device work with CUDA events (on / off; -1 on the
 * CPU or when the events can not be made), and the sum so far in seconds over the calls
 * timed (0 and 0 on the CPU). For profiling: host time per step = wall - device time. */
int m40_model_step_timing(m40_model *m, int on);
void m40_model_step_time(const m40_model *m, double *seconds, int64_t *steps);
/* Tensor parallelism on GPUs with timing on: the collectives' device time so far (steps
 * without a CUDA graph only: M40_CUDA_GRAPHS=0) and their count; 0 and 0 otherwise. */
void m40_model_collective_time(const m40_model *m, double *seconds, int64_t *calls);
void m40_model_free(m40_model *m);
const m40_model_params *m40_model_get_params(const m40_model *m);
const m40_tokenizer *m40_model_tokenizer(const m40_model *m);
const m40_gguf *m40_model_gguf(const m40_model *m);
/* Threads of the model's CPU pool (the caller of m40_model_forward counts as one). */
int m40_model_n_threads(const m40_model *m);
/* The CPU path in use: "exact" (the F32 reference), or the fast path's instruction set
 * ("fast: AVX-512 VNNI", "fast: AVX2", "fast: portable C"); "gpu" on a GPU model. */
const char *m40_model_cpu_path(const m40_model *m);

/* KV cache for n_slots independent sequences of up to ctx tokens each (ctx <= 0: the
 * model's ctx_train). F32, allocated up front: n_slots * n_layers * ctx * 2 * kv_dim
 * floats. NULL when out of memory or n_slots <= 0. A slot holds no length: the
 * positions of the batch say what is valid, so reusing a slot for a new sequence
 * just means starting again at position 0. */
typedef struct m40_kv m40_kv;
m40_kv *m40_kv_new(const m40_model *m, int32_t n_slots, int32_t ctx);

/* How a GPU model's KV pool is sized (the CPU backend ignores all of it: a slot's cache
 * there is always ctx positions of its own).
 *
 * The pool takes what is left of gpu_memory_fraction of the card's memory once
 * everything already on it is counted (this process's weights and scratch, the CUDA
 * context, other processes: total - free) and once a reserve for the activations of the
 * largest forward call is set aside (max_step_rows token rows, max_step_out of them
 * with logits; see m40_gpu_kv_new), capped by max_tokens when that is given:
 *   pool bytes = fraction * total - (total - free) - reserve.
 * The environment variable M40_KV_BLOCKS caps the block count further (a test seam). */
typedef struct {
    float gpu_memory_fraction;  /* (0, 1]; 0: M40_GPU_MEMORY_FRACTION_DEFAULT */
    int64_t max_tokens;         /* > 0: at most this many tokens; 0: as many as the memory holds */
    int32_t max_step_rows;      /* token rows of the largest forward call; 0: n_slots + 512 */
    int32_t max_step_out;       /* rows of it that want logits; 0: n_slots */
} m40_kv_options;
#define M40_GPU_MEMORY_FRACTION_DEFAULT 0.90f
/* m40_kv_new is m40_kv_new_opts with max_tokens = n_slots * ctx and defaults otherwise.
 * NULL with err (which may be NULL) when the memory does not hold a single block, or on
 * bad arguments or out of memory. */
m40_kv *m40_kv_new_opts(const m40_model *m, int32_t n_slots, int32_t ctx, const m40_kv_options *o, char *err,
                        size_t errlen);
/* The GPU memory accounting behind a pool (bytes; all 0 on the CPU backend). */
typedef struct {
    double total;       /* the card's memory */
    double in_use;      /* in use when the pool was sized (total - free) */
    double reserve;     /* kept free for the activations of the largest forward call */
    double pool;        /* the pool itself */
    float fraction;     /* gpu_memory_fraction applied */
} m40_kv_pool_info;
void m40_kv_get_pool_info(const m40_kv *kv, m40_kv_pool_info *out);
void m40_kv_free(m40_kv *kv);
int32_t m40_kv_ctx(const m40_kv *kv);
int32_t m40_kv_n_slots(const m40_kv *kv);
/* The slot's sequence is over: on the GPU its KV blocks go back to the pool (a no-op
 * on the CPU, where a slot's memory is fixed). Positions restart at 0 afterwards.
 *
 * On a GPU model the cache is a pool of 16-token blocks (engine/kv/) shared by
 * all slots, sized as m40_kv_options says (m40_kv_new: ctx * n_slots or what the memory
 * holds, whichever is smaller). A slot takes blocks
 * as its positions grow; a batch whose first position for a slot is below the slot's
 * length restarts that slot there (position 0 always works; a restart inside a full
 * block that the prefix cache shares with other sequences is an error). */
void m40_kv_slot_clear(m40_kv *kv, int32_t slot);
/* Pool blocks in total and unused (GPU); both 0 on the CPU. */
int32_t m40_kv_pool_blocks(const m40_kv *kv);
int32_t m40_kv_pool_free_blocks(const m40_kv *kv);

/* Automatic prefix caching (GPU pool; engine/kv/kv_blocks.h has the design). Full 16-token
 * blocks whose KV has been computed stay registered under the hash of their whole
 * token prefix, also after their sequence ends (idle, evicted least recently used when
 * the pool runs short), and a new sequence can start on them instead of recomputing.
 *
 * m40_kv_slot_match_prefix: for an EMPTY slot (new, or after m40_kv_slot_clear) about
 * to prefill tokens[0..n): attaches the longest chain of cached blocks that prefixes
 * them and returns how many leading tokens that covers (a multiple of 16, never all n,
 * so the last token is always computed and yields logits). The caller then feeds
 * positions from the returned value on. 0 on the CPU backend, when caching is off, or
 * when the slot is not empty.
 *
 * Commits are automatic: every m40_model_forward on a GPU model records the token ids
 * of the positions it computed (prompt and generated tokens alike) and registers each
 * block that became full. So what the cache holds is always keyed by the real tokens.
 *
 * Caching is on for GPU models; the environment variable M40_PREFIX_CACHE=0 at
 * m40_kv_new turns it off (a test and benchmarking seam). */
int m40_kv_prefix_cache_enabled(const m40_kv *kv);
int32_t m40_kv_slot_match_prefix(m40_kv *kv, int32_t slot, const int32_t *tokens, int32_t n);
typedef struct {
    int64_t queries;      /* m40_kv_slot_match_prefix calls */
    int64_t query_tokens; /* tokens presented to them */
    int64_t hit_tokens;   /* tokens found cached (not computed) */
} m40_kv_prefix_stats;
/* All zero on the CPU backend. */
void m40_kv_get_prefix_stats(const m40_kv *kv, m40_kv_prefix_stats *out);
/* The prefix cache forgets the blocks that no sequence holds (their memory goes back to
 * the pool); what running sequences hold stays. No-op on the CPU backend. */
void m40_kv_prefix_forget(m40_kv *kv);

/* One forward call over n tokens that may belong to different slots. For each slot,
 * its tokens appear in increasing position order and positions continue the slot's
 * cache (token i attends to its slot's positions 0..pos[i]). Rows with want_logits[i]
 * set get n_vocab logits written, packed in order, into logits. Returns 0, or -1 with
 * err (position beyond ctx, bad slot, token out of range, out of memory). Not
 * thread-safe: one forward call at a time per model (it uses the model's scratch and
 * thread pool). With argmax set, each logits row's greedy token (its largest logit,
 * lowest id on ties) goes to argmax[k] for the k-th row instead: on the GPU only those
 * ids leave the device and logits is not written; on the CPU logits is still used as
 * scratch (and holds the rows).
 * With sample set as well as argmax, row k's token is drawn with sample[k]'s parameters
 * instead of taken as its argmax (kernels.h 9b: temperature, top-k, top-p, min-p, a
 * counter-based draw from (seed, step); temperature <= 0 is the argmax): on the GPU by
 * m40k_sample without the logits leaving the device, on the CPU by its twin
 * m40_ref_sample, so both pick the same token from the same logits.
 * With logits_at set (and argmax not), *logits_at tells where the rows are: logits, or
 * on a GPU the model's own pinned buffer that the device copied them into (no second
 * copy of n_out x n_vocab floats into logits, which is then not written). That buffer is
 * the caller's to read and write until the model's next forward call. */
typedef struct {
    float temperature; /* <= 0: the argmax */
    int32_t top_k;     /* <= 0: off */
    float top_p;       /* >= 1: off */
    float min_p;       /* <= 0: off */
    uint64_t seed;
    uint64_t step;     /* the sequence's tokens drawn so far: the draw's counter */
} m40_row_sample;

typedef struct {
    int32_t n;
    const int32_t *tokens;
    const int32_t *pos;
    const int32_t *slot;
    const uint8_t *want_logits; /* NULL: only the last token of the batch */
    int32_t *argmax;            /* NULL: logits wanted */
    float **logits_at;          /* NULL: the rows are copied into logits */
    const m40_row_sample *sample; /* with argmax: each row's draw (NULL: the argmax) */
} m40_batch;

/* M40_FORWARD_NO_BLOCKS (-2, GPU only): the KV pool lacks the blocks this batch needs;
 * none were taken, so the caller can free a sequence's slot and retry. */
#define M40_FORWARD_NO_BLOCKS (-2)
int m40_model_forward(m40_model *m, m40_kv *kv, const m40_batch *b, float *logits, char *err, size_t errlen);

/* Whether the KV cache holds the batch, asked before m40_model_forward (the scheduler
 * does, so that preemption is decided before the forward pass runs). On a GPU model the
 * pool (kv/paged_kv.h) takes the blocks of the batch's new positions, and the forward
 * call that follows with this same batch uses them; a forward call nobody reserved for
 * reserves by itself. 0, M40_FORWARD_NO_BLOCKS with err (no block taken), or -1 with
 * err on a bad batch. Always 0 on the CPU, where a slot holds its whole context. */
int m40_kv_reserve(m40_kv *kv, const m40_batch *b, char *err, size_t errlen);

#endif
