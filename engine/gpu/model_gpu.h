/* Internal interface between the model front end (model.c: GGUF parsing, validation,
 * CPU forward) and the GPU back end (model_cuda.c, model_cuda_fwd.c). Not part of the
 * public API. */
#ifndef M40_MODEL_GPU_H
#define M40_MODEL_GPU_H

#include <stddef.h>
#include <stdint.h>

#include "kv/paged_kv.h"
#include "model/arch.h"
#include "model/model.h"
#include "util/tuning.h"

/* A weight matrix in GGUF layout: `rows` rows (ne[1], the output dim) of `cols`
 * elements (ne[0], the input dim), row r at data + r * row_bytes. */
typedef struct {
    const uint8_t *data;
    uint32_t type;
    int64_t rows;
    int64_t cols;
    size_t row_bytes;
    /* rows or cols of the whole matrix not a multiple of 4 (the CPU reference's F16
     * input rounding, model.c: rounds_input_to_f16): set once loaded, so that a tensor-
     * parallel rank's view of part of it keeps the whole matrix's rule */
    uint8_t ragged4;
} m40_matrix;

typedef struct {
    float *attn_norm, *ffn_norm;  /* owned F32 copies */
    float *bq, *bk, *bv;          /* attention biases (qwen2); NULL when absent */
    m40_matrix wq, wk, wv, wo;
    m40_matrix w_gate, w_up, w_down;
    /* Where the row has them (NULL otherwise): per-head Q/K norms [head_dim] (gemma3,
     * qwen3), the norms of the attention and FFN outputs before their residual adds
     * [dim] (gemma2, gemma3); and whether the layer is sliding-window (local). */
    float *q_norm, *k_norm, *post_attn_norm, *post_ffw_norm;
    int local;
    /* gpt-oss (NULL otherwise): the attention output's bias [dim] and the learned
     * logit of each head that joins its softmax [n_heads]. */
    float *bo, *attn_sinks;
    /* Mixture of experts (router.data NULL for a dense layer, whose FFN is w_gate/w_up/
     * w_down). router: ffn_gate_inp, n_experts rows of dim, and its bias [n_experts] or
     * NULL. The 3-D ffn_{gate,up,down}_exps [cols, rows, n_experts] are stored expert
     * after expert, so each is one matrix of n_experts * rows rows: expert e is rows
     * [e * rows, (e + 1) * rows) (rows = expert_ffn_dim for gate/up, dim for down).
     * Their biases, when present, are [n_experts][rows]. The shared expert (sh_gate.data
     * NULL: none) runs on every token, scaled by sigmoid(sh_gate_inp . x) when that
     * vector [dim] is present. */
    m40_matrix router;
    float *router_b;
    m40_matrix exp_gate, exp_up, exp_down;
    float *exp_gate_b, *exp_up_b, *exp_down_b;
    m40_matrix sh_gate, sh_up, sh_down;
    float *sh_gate_inp;
} m40_layer;

/* The model's scalars of the forward pass beyond the plain llama block, filled from the
 * architecture table for every row; a row without the feature gets the neutral value
 * (see model/model_load.c), so the GPU path tests values, never the architecture. */
typedef struct {
    m40_activation act;                  /* of the gated FFN: SwiGLU or GeGLU (tanh) */
    int32_t window;                      /* local layers see the last `window` positions (0: none is local) */
    float local_base;                    /* RoPE base of the local layers */
    float global_scale;                  /* linear RoPE factor of the other layers (1: none) */
    float attn_scale;                    /* multiplies q.k (1/sqrt(head_dim) unless the row says otherwise) */
    float attn_softcap;                  /* c * tanh(s / c) of the scaled q.k before the softmax (0: none) */
    float embd_scale;                    /* multiplies the embeddings (1: none) */
    float logit_softcap;                 /* of the logits (0: none) */
    /* Mixture of experts (layers with a router): the gating (arch.h), whether the k
     * chosen weights are divided by their sum, and the factor on them. */
    m40_gating gating;
    int norm_topk;
    float expert_scale;
    /* YaRN (yarn 1; 0: none): each dimension pair's angle interpolated between theta and
     * theta * yarn_freq_scale by a ramp from pair yarn_low to yarn_high, cos and sin
     * multiplied by yarn_mscale (model.c, yarn_theta). The GPU takes the ramp as RoPE
     * frequency factors and the magnitude as yarn_mscale^2 on the attention scale. */
    int yarn;
    float yarn_freq_scale, yarn_low, yarn_high, yarn_mscale;
} m40_gpu_scalars;

/* What the GPU back end uploads (host views into the mmap'd GGUF). */
typedef struct {
    const m40_model_params *p;
    int32_t q_dim, kv_dim;
    const m40_matrix *tok_embd, *output;
    const float *output_norm;
    const float *rope_freq_factors;  /* rope_dim/2 entries or NULL */
    const m40_layer *layers;
    m40_gpu_scalars sc;
} m40_gpu_src;

typedef struct m40_gpu m40_gpu;
typedef struct m40_gpu_kv m40_gpu_kv;

/* Uploads every weight to device `device` (mmap -> pinned staging -> device); t: the
 * model's tuning switches (kept, logged once with log_progress, and handed to the
 * kernels). -1 with err when there is no such device, CUDA is not built in, or memory
 * runs out. */
int m40_gpu_load(const m40_gpu_src *src, const m40_tuning *t, int device, int log_progress, m40_gpu **out, char *err,
                 size_t errlen);
/* The same split over n GPUs device .. device + n - 1 by tensor parallelism (n <= 1:
 * m40_gpu_load): each rank's shard (model/tp_shard.h) uploaded to its GPU at once, NCCL
 * between them (gpu/tp.c). The m40_gpu returned is rank 0's and drives the others; the
 * rest of this interface takes it as it takes a single GPU's. */
int m40_gpu_load_tp(const m40_gpu_src *src, const m40_tuning *t, int device, int n, int log_progress, m40_gpu **out,
                    char *err, size_t errlen);
void m40_gpu_free(m40_gpu *g);
/* Paged KV pool for n_slots sequences of up to ctx tokens, sized as o says (model.h,
 * m40_kv_options). NULL with err when not even one block fits or memory runs out. */
m40_gpu_kv *m40_gpu_kv_new(m40_gpu *g, int32_t n_slots, int32_t ctx, const m40_kv_options *o, char *err,
                           size_t errlen);
/* The memory accounting the pool was sized by. */
void m40_gpu_kv_pool_info(const m40_gpu_kv *kv, m40_kv_pool_info *out);
void m40_gpu_kv_free(m40_gpu_kv *kv);
/* Which block holds what (kv/paged_kv.h): the slots, the prefix cache (on unless
 * M40_PREFIX_CACHE=0 was set at m40_gpu_kv_new) and the steps' reservations. */
m40_paged_kv *m40_gpu_kv_pool(m40_gpu_kv *kv);
/* Decode-step CUDA graphs so far: captured (instantiated) and launched. */
void m40_gpu_graph_stats(const m40_gpu *g, int64_t *captures, int64_t *launches);
/* Device time of forward calls: with timing on, each call's device work (table upload
 * to the last copy back) is timed with two CUDA events; step_time returns the sum in
 * milliseconds and the number of calls timed. 0, or -1 when the events can not be made. */
int m40_gpu_step_timing(m40_gpu *g, int on);
void m40_gpu_step_time(const m40_gpu *g, double *ms, int64_t *steps);
/* Tensor parallelism with timing on: the device time of rank 0's collectives (all-reduces
 * and the logits' gather) in steps run without a CUDA graph, and how many were timed. */
void m40_gpu_tp_time(const m40_gpu *g, double *ms, int64_t *calls);
/* The batch was validated by the caller (tokens, slots, positions in range). Its KV
 * blocks were reserved for it (m40_kv_reserve) or are reserved here first. 0, -1 with
 * err, or -2 (M40_FORWARD_NO_BLOCKS) when the pool lacks blocks: none were taken. */
int m40_gpu_forward(m40_gpu *g, m40_gpu_kv *kv, const m40_batch *b, float *logits, char *err, size_t errlen);

#endif
