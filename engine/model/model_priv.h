/* The model object and the CPU KV cache as the files of engine/model/ share them
 * (model.c: life cycle, KV cache, forward pass; model_load.c: hyperparameters and
 * weights as the architecture's row says). Private to engine/model/. */
#ifndef M40_MODEL_PRIV_H
#define M40_MODEL_PRIV_H

#include <stdint.h>

#include "arch.h"
#include "gguf/gguf.h"
#include "gpu/model_gpu.h"
#include "model.h"
#include "tokenizer/tokenizer.h"
#include "util/threadpool.h"
#include "util/tuning.h"

typedef m40_matrix matrix;
typedef m40_layer layer;

struct m40_model {
    m40_gguf *gguf;
    m40_tokenizer *tok;
    m40_model_params p;
    const m40_arch *arch;         /* the table row of p.arch (arch.h) */
    int32_t q_dim, kv_dim;
    float *rope_freq_factors;     /* rope_freqs.weight (Llama 3.1 style), LongRoPE's chosen set, or NULL */
    int32_t ctx_request;          /* the context a sequence gets (options.ctx_size; 0: ctx_train) */
    int longrope;                 /* 0: no LongRoPE factors; 1: the short set; 2: the long one */
    int32_t longrope_orig;        /* LongRoPE's original context length */

    /* What the row and the metadata add to the llama block (1 or 0: absent). */
    int32_t window;               /* local layers (L->local) see the last `window` positions */
    int has_local;                /* some layer is local */
    float local_base;             /* RoPE base of the local layers */
    float global_scale;           /* linear RoPE factor of the other layers (1: none) */
    float attn_scale;             /* multiplies q.k */
    float attn_softcap;           /* q.k soft-cap (0: none) */
    float final_softcap;          /* logits soft-cap (0: none) */
    float embd_scale;             /* multiplies the embeddings (1: none) */
    m40_activation act;
    /* Mixture of experts (p.n_experts > 0): the gating, whether the chosen weights are
     * divided by their sum, and the factor on them (arch.h). */
    m40_gating gating;
    int norm_topk;
    float expert_scale;
    /* YaRN (yarn set): rotation frequencies interpolated by freq_scale = 1/factor, fully
     * below dimension pair yarn_low, not at all above yarn_high, and cos/sin multiplied by
     * yarn_mscale = 1 + 0.1 ln(factor) (so q.k by its square), as ggml's rope_yarn. */
    int yarn;
    float yarn_freq_scale, yarn_low, yarn_high, yarn_mscale;

    matrix tok_embd, output;
    float *output_norm;
    layer *layers;
    m40_gpu *gpu;                 /* device >= 0: the weights on the GPU, forward runs there */
    int device;
    m40_tuning tuning;            /* the switches read at load (util/tuning.h) */

    m40_threadpool *pool;
    int n_threads;
    int fast;                     /* the fast CPU path (options.cpu_fast): cpu_matmul_fast.h */
    /* the fast path's attention: q.k through the F32 FMA dot and p * V through axpy
     * (cpu_dot.h); NULL on the exact path, whose attention is the reference's */
    float (*attn_dot)(const uint8_t *k, const float *q, int64_t n);
    void (*attn_axpy)(float *y, float a, const float *x, int64_t n);

    /* Scratch for one forward call, grown on demand. */
    int32_t cap_tokens;
    float *x, *xb, *q, *k, *v, *att, *hb, *hb2;
    float *x16;                   /* [n][max input dim]: F16-rounded matmul input, see matmul() */
    /* MoE scratch (moe.c): router logits [n][n_experts], the chosen experts and their
     * weights [n][k], the inputs gathered for one expert [n][dim], each (token, choice)
     * output [n][k][dim], and which (token, choice) rows an expert serves [n]. */
    float *moe_logits, *moe_w, *moe_in, *moe_out;
    int32_t *moe_ids, *moe_rows;
    float *rope_cos, *rope_sin;   /* [n][rope_dim/2] */
    float *rope_cos_l, *rope_sin_l; /* the same with the local layers' base (has_local) */
    int32_t *logit_rows;
    struct m40_xq *xq;            /* fast path: [n][max input dim / 32] int16 records of a matmul input */
    float *xsum;                  /* fast path: their s in a row (m40_xq_sums) */
    float *row_buf;               /* per thread: one dequantized weight row */
    int64_t row_buf_len;
    float *score_buf;             /* per thread: attention scores over the context */
    int32_t score_buf_len;

    /* Tensor parallelism on the CPU (options.tp > 1; model_tp.c): the simulated ranks
     * this model's forward calls go to (tp); in a rank, its group, its place, its share
     * of the head's rows and its piece of the logits (tp_logits [n_out][vocab_stride]). */
    struct m40_tp_sim *tp;
    struct m40_tp_group *tp_group;
    int tp_rank;
    int64_t tp_vocab_rows, tp_vocab_stride;
    float *tp_logits;
};

struct m40_kv {
    int32_t n_slots, ctx, n_layers, kv_dim;
    float *k, *v;                 /* [slot][layer][pos][kv_dim] (CPU) */
    m40_gpu_kv *gpu;              /* GPU model: the paged pool instead, its memory... */
    m40_paged_kv *pool;           /* ...and which block holds what (kv/paged_kv.h) */
    struct m40_kv **rank_kv;      /* CPU tensor parallelism: each rank's cache (model_tp.c) */
    int n_rank_kv;
};

/* Reads the hyperparameters (the row's scalars included) and every weight of m->gguf
 * into m. -1 with err naming the problem. */
int m40_model_read(m40_model *m, char *err, size_t errlen);

/* out[t] = W x[t] (+ bias) for the n token vectors of x on the model's pool, with the
 * F16 input rounding the row asks for (model.c). */
void m40_model_matmul(m40_model *m, const m40_matrix *w, const float *x, int32_t n, float *out, const float *bias);
/* The products of `count` (<= 4) matrices of one input x (all as wide), in one pool run
 * on the fast path with x quantized once; on the exact path as count m40_model_matmul
 * calls. biases may be NULL or hold NULL entries. */
void m40_model_matmul_group(m40_model *m, const m40_matrix *const *ws, float *const *outs, const float *const *biases,
                            int count, const float *x, int32_t n);

/* The forward call's scratch (model.c): grown for n tokens and a context of ctx (0, or
 * -1 when out of memory); freed; forgotten (a copy of the model starts without any). */
int m40_model_ensure_scratch(m40_model *m, int32_t n, int32_t ctx);
void m40_model_free_scratch(m40_model *m);
void m40_model_scratch_reset(m40_model *m);

/* CPU tensor parallelism (model_tp.c). sim_new: n ranks beside m (m->tp), or -1 with err
 * when the model does not split so (tp_shard.h). sim_kv: each rank's cache of kv's slots
 * and context. sim_forward: one forward call over the ranks. all_reduce and
 * gather_logits: the collectives, called by every rank of a group at the same point of
 * its forward pass (gather: rank 0's logits [n_out][n_vocab] get every rank's piece). */
typedef struct m40_tp_sim m40_tp_sim;
int m40_tp_sim_new(m40_model *m, int n, char *err, size_t errlen);
void m40_tp_sim_free(m40_tp_sim *s);
int m40_tp_sim_kv(m40_tp_sim *s, m40_kv *kv, char *err, size_t errlen);
int m40_tp_sim_forward(m40_tp_sim *s, m40_kv *kv, const m40_batch *b, float *logits, char *err, size_t errlen);
void m40_tp_all_reduce(m40_model *m, float *buf, size_t count);
void m40_tp_gather_logits(m40_model *m, float *local, int32_t n_out, float *logits);

/* The GPU back end's view of m's weights and of its row's scalars (neutral where the row lacks one). */
void m40_model_gpu_src(const m40_model *m, m40_gpu_src *src);

#endif
