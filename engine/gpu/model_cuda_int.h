/* Private to the GPU back end (model_cuda.c: load and free; gpu_kv.c: the KV pool;
 * model_cuda_fwd.c: the forward pass): the device-side structures they work on. Only included
 * when building with CUDA (M40_HAVE_CUDA). */
#ifndef M40_MODEL_CUDA_INT_H
#define M40_MODEL_CUDA_INT_H

#include "model_gpu.h"
#include "model/model_internal.h"

#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ref/ggml_types.h"
#include "kernels.h"
#include "kv/kv_blocks.h"
#include "kv/paged_kv.h"
#include "model_aux.h"
#include "ref/quant.h"

/* A weight matrix on the device. */
typedef struct {
    void *data;
    int type;            /* M40K_TYPE_* (GGUF numbering) */
    int64_t rows, cols;
    size_t row_bytes;
} gmat;

/* One product target: up to 3 parts written side by side, each a run of consecutive
 * matrices of one device type fused into one device matrix (upload_proj). */
typedef struct {
    gmat part[3];
    int n_parts;
    int64_t rows;        /* sum of the parts' rows */
    float *bias;         /* [rows] or NULL */
} gproj;

/* A decode step's CUDA graph (model_cuda_fwd.c, run_step): the work of one shape of a
 * pure decode step, keyed by what the kernels' arguments depend on. */
typedef struct {
    int32_t n, n_out, splits, splits_local;
    int pick;            /* the greedy pick folded into the head (step_plan.d_key) */
    const void *kv_k, *kv_v; /* the KV pool it reads (m40_gpu_kv.k, .v) and its layer stride */
    size_t kv_layer;
    int seen;            /* ran once without a graph (lazy initializations done) */
    int failed;          /* capture failed: this shape runs without a graph */
    cudaGraphExec_t exec;
    uint64_t used;       /* LRU tick */
} gstep_graph;

#define M40_GRAPH_SLOTS 64

typedef struct {
    float *attn_norm, *ffn_norm;
    gproj qkv, wo, gate_up, down;
    float *q_norm, *k_norm;          /* per-head Q/K norms where the layer has them; NULL otherwise */
    float *post_attn_norm, *post_ffw_norm; /* norms of the attention / FFN outputs where it has them */
    int local;                       /* sliding-window layer: g->sc.window, g->sc.local_base */
    float *sinks;                    /* attention sinks [n_heads] (gpt-oss) or NULL; wo.bias: its output bias */
    /* Mixture of experts (router NULL: a dense layer, gate_up/down): the router F32
     * [n_experts][dim] and its bias [n_experts] or NULL; the experts' 3-D tensors as
     * they are in the file (never regrouped: the MoE kernels read the GGUF layouts), one
     * device type for gate and up (kernels.h 10c), and their biases [n_experts][rows]
     * or NULL. */
    float *router, *router_b;
    gmat exp_gate, exp_up, exp_down;
    float *exp_gate_b, *exp_up_b, *exp_down_b;
} glayer;

/* cuBLAS's workspace under batch invariance: 32 MiB, what NVIDIA advises for Hopper */
#define M40_BLAS_WS_BYTES ((size_t)32 << 20)

struct m40_gpu {
    int device;
    m40_tuning tuning;   /* the model's switches (util/tuning.h), read at its load */
    cudaStream_t stream;
    cublasHandle_t blas;
    int sm_count;
    int g8;              /* regrouped device layouts for Q8_0 / Q6_K (M40_G8, kernels.h 0.) */
    int moe_pad;         /* Q6_K and MXFP4 experts padded to Q6_K_P, MXFP4_P (M40_MOE_PAD, kernels.h 0.) */
    int moe_q8;          /* a decode row's expert GEMVs on int8 records (M40_MOE_Q8, kernels.h 10c', 10d') */
    m40_model_params p;
    int32_t q_dim, kv_dim, qkv_dim;
    gmat tok_embd, output;
    int output_shared;   /* output is tok_embd's buffer */
    float *output_norm, *rope_ff;
    glayer *layers;
    m40_gpu_scalars sc;  /* the row's scalars (model_gpu.h): neutral where the row lacks the feature */
    /* Linear RoPE scaling (sc.global_scale != 1) or YaRN: the global layers' frequency
     * factors, rope_ff (1 where absent) times global_scale times YaRN's; NULL otherwise
     * (they take rope_ff). rope_ff_local: the local layers' (YaRN's alone), or NULL. */
    float *rope_ff_global, *rope_ff_local;
    /* Mixture of experts: some layer has a router (moe), and the scratch of its FFN,
     * grown with cap (ensure_scratch): router logits [cap][E], the chosen experts and
     * their weights [cap][k], the grouping (kernels.h 10e: counts [E], offsets [E+1],
     * perm and inv [cap*k], tiles [2*max tiles at bm 16]), the sorted F16 inputs
     * [cap*k][moe_ldx], the gate and up products [cap*k][F] each, the activation
     * (F32 [cap*k][moe_ldh] for the GEMV path; F16 [cap*k][moe_ldh] for the grouped
     * one) and the down products [cap*k][dim]. moe_gemv_rows: steps of up to so many
     * rows take the expert GEMVs (kernels.h 10c/d), larger ones the grouped products
     * (-1: by the experts' type, moe_grouped). */
    int moe;
    int32_t moe_gemv_rows;
    int64_t moe_ldx, moe_ldh;
    float *moe_logits, *moe_w, *moe_yg, *moe_yu, *moe_h, *moe_yd;
    int32_t *moe_ids, *moe_counts, *moe_offsets, *moe_perm, *moe_inv, *moe_tiles;
    uint16_t *moe_x16, *moe_h16;
    void *moe_hq; /* the int8 records of a decode row's h (kernels.h 10c', 10d') */
    size_t weight_bytes;

    /* Tiled path: F16 (F32 when gemm_f32) copy of one dequantized weight. */
    void *deq;
    int gemm_f32;        /* tiled products in F32 (SGEMM) rather than F16 tensor cores */
    size_t deq_elems, deq_cap;
    int32_t *iota;       /* 0..max_rows-1, the row ids the dequantizing gather takes */
    /* Tensor-core GEMV (m40k_gemm_skinny) for F16 decode products (skinny_reads): on
     * where the GPU has mma.sync F16 (cc >= 8.0) unless M40_SKINNY=0; its split-K
     * workspace and counters (zeroed once, zero between calls). */
    int skinny;
    float *sk_ws;
    size_t sk_ws_floats;
    int *sk_cnt;
    size_t sk_cnt_ints;
    /* Quantized tensor-core GEMM (m40k_gemm_q, gemm_q_reads) for products of more than 8
     * rows: on unless M40_GEMM_Q=0 (then the tiled path); its split-K workspace and
     * counters (zeroed once, zero between calls). */
    int gemm_q;
    int32_t gemm_q_rows; /* products of more rows take the tiled path (M40_GEMM_Q_ROWS, default 128; 0: none do) */
    int32_t gemv_rows;   /* quantized products of more rows (up to 8) take the register kernel where it
                          * reads the type (M40_GEMV_ROWS) */
    float *mq_ws;
    size_t mq_ws_floats;
    int *mq_cnt;
    size_t mq_cnt_ints;
    /* Batch invariance (M40_BATCH_INVARIANT, m40_model_options.batch_invariant): every row
     * of a step computed as it would be alone (model_cuda_fwd.c, inv_matmul; step_plan.c):
     * the products in tiles of inv_rows token rows on one kernel with one split count
     * whatever the step's rows (cuBLAS calls always of inv_rows rows, the last tile
     * through inv_x / inv_y), the decode attention in inv_splits ranges a sequence merged
     * without clusters, the prompt rows' attention unsplit, and none of the fusions or
     * GEMVs picked by the batch's size. */
    int invariant;
    int32_t inv_rows;
    int inv_splits;
    void *inv_x;  /* inv_rows rows of the widest product input (F32, or F16) */
    float *inv_y; /* inv_rows rows of the widest product output */
    void *blas_ws; /* cuBLAS's workspace (cublasSetWorkspace), M40_BLAS_WS_BYTES */

    /* Per-forward scratch, grown on demand to cap tokens / cap_out logit rows. */
    int32_t cap, cap_out;
    float *x, *xb, *qkv, *att, *hb, *hb2, *xg, *logits_d;
    /* x2: the residual stream's other buffer (each add+RMSNorm writes x + d to the one it
     * did not read: m40k_add_rmsnorm_to out of place); xd: the layers' attention and FFN
     * outputs (the d of the next add+RMSNorm, whose normalized output goes to xb) */
    float *x2, *xd;
    uint16_t *x16;
    /* The RoPE angles of a step's prompt rows (m40k_rope_table, kernels.h 5c), formed
     * once a step for all layers: [0] the global layers' base and factors, [1] the local
     * ones' (cap * rope_dim floats each) */
    float *rope_cs[2];
    void *xq;            /* m40k_quantize_q8 of the current GEMV input, batch <= 8 */
    /* The RMSNorm folded into the GEMVs around it (kernels.h 8d, batch 1; M40_FUSE_NORM):
     * the producer's records of the normalized input (apart from xq, which it reads) and
     * its sums of squares per 32 elements */
    int fuse_norm;
    int fuse_pick;       /* greedy picks of one row folded into the head's int8 GEMV (kernels.h 9c; M40_FUSE_PICK) */
    int fuse_residual;   /* tiled products add into the residual themselves (M40_FUSE_RESIDUAL) */
    int prefill_f16;     /* prompt chunks: the cuBLAS gate/up product and the attention write
                          * F16 where the next kernel reads F16 (kernels.h 4d, 7f; M40_PREFILL_F16) */
    void *xq2;
    float *nss;
    float *ws;
    size_t ws_cap;
    int *att_cnt;        /* decode attention's split counters: zeroed when allocated, zero between calls */
    size_t att_cnt_cap;
    int32_t *ints_d, *ints_h;
    size_t ints_cap;
    float *logits_h;
    int32_t *pick_d; /* greedy picks: cap_out ids, then cap_out logprobs */
    /* the rows' sampling parameters (m40_batch.sample), cap_out of them: staged, uploaded */
    m40k_sample_params *samp_h, *samp_d;
    /* CUDA graphs of decode steps of up to graph_max sequences (M40_CUDA_GRAPHS; 0: off).
     * Every graph bakes in the scratch pointers above: any regrow drops them all. */
    int graph_max;
    gstep_graph graphs[M40_GRAPH_SLOTS];
    uint64_t graph_tick;
    int64_t graph_captures, graph_launches;
    /* m40_gpu_step_timing: events around each forward call's device work */
    int time_steps;
    cudaEvent_t step_ev[2];
    double step_gpu_ms;
    int64_t steps_timed;
    /* Host-side scratch of the step planner: each batch row's row in the step. */
    int32_t *perm, *out_rows;
    int32_t host_cap;

    /* Tensor parallelism (tp.c; tp_n 0 or 1: none). This rank's place, its NCCL communicator
     * (ncclComm_t), its share of the head's rows (model/tp_shard.h), its piece of the
     * logits [cap_out][tp_vocab_stride] and the gathered pieces [tp_n][cap_out][stride];
     * on rank 0 (the model's m40_gpu) the group, which owns the other ranks. */
    int tp_rank, tp_n;
    void *tp_comm;
    int64_t tp_vocab_rows, tp_vocab_stride;
    float *tp_logits, *tp_gather;
    struct m40_gpu_tp *tp;
    /* Two buffers of tp_sym_floats each from ncclMemAlloc, registered in NCCL symmetric
     * windows, and the rank's NCCL device communicator (ncclDevComm's bytes; NULL where
     * NCCL lacks the device API or M40_TP_SYMMETRIC=0): a step of at most tp_sym_floats /
     * dim rows writes its layers' outputs there instead of xd, and each all-reduce goes
     * from one to the other (m40_gpu_tp_reduce_xd, m40k_tp_allreduce). */
    float *tp_sym[2];
    void *tp_win[2];
    void *tp_devcomm;
    int tp_devcomm_made;
    const int *tp_abort; /* the group's abort flag (mapped host memory; tp.c, group_abort) */
    int64_t tp_sym_floats;
    /* The collectives timed (rank 0, time_steps on, steps run without a CUDA graph): an
     * event before and after each, summed after the step (tp_coll_ms, tp_coll_calls). */
    cudaEvent_t *tp_ev;
    int tp_ev_cap, tp_ev_used;
    double tp_coll_ms;
    int64_t tp_coll_calls;
};

/* tp.c: the group of a tensor-parallel model (NCCL loaded at run time, a thread a rank,
 * the caller's one of them). init: communicators over ranks[0..n) and the threads;
 * ranks[0]->tp owns them all afterwards. run: fn on every rank at once, each on its own
 * thread with its GPU current (the caller's device is g0's again after), 0 when every
 * rank returned 0, else -1 with the first failed rank's err.
 * abort_on_fail: fn enqueues collectives, so a rank that fails aborts the group's
 * communicators (the others would wait for it for ever) and the group refuses every
 * later job with an error.
 * sym_rows: steps of up to that many rows all-reduce between NCCL symmetric windows
 * (0: never; see tp_sym).
 * all_reduce (sum) and all_gather: enqueued on g->stream (capturable). */
int m40_gpu_tp_init(m40_gpu **ranks, int n, int64_t sym_rows, char *err, size_t errlen);
void m40_gpu_tp_free(m40_gpu *g0);
int m40_gpu_tp_run(m40_gpu *g0, int (*fn)(m40_gpu *g, void *ctx, char *err, size_t errlen), void *ctx,
                   int abort_on_fail, char *err, size_t errlen);
int m40_gpu_tp_all_reduce(m40_gpu *g, float *buf, size_t count);
/* The sum of every rank's g->xd[0..count): in place, or where g->xd is one of the
 * symmetric buffers (tp_sym), into the other one, which g->xd then points at. */
int m40_gpu_tp_reduce_xd(m40_gpu *g, size_t count);
int m40_gpu_tp_all_gather(m40_gpu *g, const float *send, float *recv, size_t count);
/* After a step's synchronization: the timed collectives' device time added up. */
void m40_gpu_tp_time_step(m40_gpu *g);
/* The group's ranks (g0->tp): rank r's m40_gpu (r < g0->tp_n). */
m40_gpu *m40_gpu_tp_rank(const m40_gpu *g0, int r);

/* Whether products of more than 8 rows (of more than M40_GEMV_ROWS where the register
 * kernel reads w: gemv_batch) with w take the quantized tensor-core GEMM
 * (m40k_gemm_q) rather than the tiled path: a quantized type it reads, F16 activations
 * (not gemm_f32), K a multiple of 8. F16 weights stay on cuBLAS, F32 on SGEMM. */
static inline int gemm_q_reads(const m40_gpu *g, const gmat *w)
{
    return g->gemm_q && !g->gemm_f32 && w->type != M40K_TYPE_F16 && m40k_gemm_q_supported(w->type) &&
           w->cols % 8 == 0;
}
/* The same for a product of n rows. */
static inline int gemm_q_takes(const m40_gpu *g, const gmat *w, int32_t n)
{
    return gemm_q_reads(g, w) && (g->gemm_q_rows <= 0 || n <= g->gemm_q_rows);
}
/* Whether a product of n rows with w takes a GEMV (n <= 8): unless n is past
 * M40_GEMV_ROWS and the quantized GEMM's register kernel reads w (a row alone always
 * does: the fused norm and greedy pick are the GEMV's); never under batch invariance
 * (inv_matmul). */
static inline int gemv_batch(const m40_gpu *g, const gmat *w, int32_t n)
{
    return !g->invariant && n <= 8 && (n <= 1 || n <= g->gemv_rows || !gemm_q_takes(g, w, n) ||
                      m40k_gemm_q_kernel(w->type, (int)w->cols, (int)n, w->data) != M40K_GEMM_Q_REGISTER);
}

/* A CUDA call or kernel launch inside a function with g, err and errlen in scope: on
 * failure err names the call and the function returns -1. */
#define CK(call)                                                                                                       \
    do {                                                                                                               \
        int rc_ = (call);                                                                                              \
        if (rc_ != 0) {                                                                                                \
            m40_set_err(err, errlen, "gpu %d: %s failed: %s", g->device, #call, cudaGetErrorString((cudaError_t)rc_));    \
            return -1;                                                                                                 \
        }                                                                                                              \
    } while (0)

/* (Re)allocates device memory, contents lost: grown scratch never needs its old data. */
static inline int grow_dev(void **p, size_t bytes)
{
    cudaFree(*p);
    *p = NULL;
    return cudaMalloc(p, bytes + 256) == cudaSuccess ? 0 : -1;
}

/* What a step's device work depends on, besides the model: sizes, the attention
 * choice and the device tables (m40_gpu_plan_step builds it). */
typedef struct {
    int32_t n, n_dec, n_grp, n_out;
    int tuned, splits, splits_local;
    const int32_t *d_tok, *d_pos, *d_rs, *d_qi, *d_ip, *d_lpl, *d_out, *d_idx;
    uint64_t *d_key; /* the greedy pick folded into the head (kernels.h 9c), or NULL */
    int psplits, psplits_local; /* key splits of the prefill attention (kernels.h 7d): global, windowed layers */
} step_plan;

/* step_plan.c: the device tables and attention splits of a step whose KV blocks kv/
 * reserved (st: its groups; d_key left NULL for the caller). 0, or -1 with err. */
int m40_gpu_plan_step(m40_gpu *g, const m40_kv_step *st, const m40_batch *b, int32_t n_out, step_plan *sp, char *err,
                      size_t errlen);

/* Drops every decode-step graph (they bake in the scratch pointers and the KV pool's:
 * called before any of those is reallocated or freed). Here, not in the forward pass's
 * file, because the step planner's and the pool's growth need it too. */
static inline void m40_gpu_graphs_free(m40_gpu *g)
{
    for (int i = 0; i < M40_GRAPH_SLOTS; i++) {
        if (g->graphs[i].exec)
            cudaGraphExecDestroy(g->graphs[i].exec);
        memset(&g->graphs[i], 0, sizeof g->graphs[i]);
    }
}
/* Device bytes that forward calls of up to max_rows token rows, max_out of them with
 * logits, allocate on top of what is resident at load (model_cuda_fwd.c, beside the
 * scratch it estimates): the KV pool (gpu_kv.c) keeps them out of its share. */
size_t m40_gpu_step_reserve_bytes(const m40_gpu *g, int32_t n_slots, int32_t max_rows, int32_t max_out);

struct m40_gpu_kv {
    m40_gpu *g;
    int32_t n_slots, ctx, n_blocks;
    m40_paged_kv *pool;  /* which block holds what (kv/paged_kv.h): the steps' reservations */
    uint16_t *k, *v;     /* [layer][block][kv_head][16][head_dim] */
    size_t layer_elems;  /* elements of one layer's K (or V) */
    int32_t *csr_indptr, *csr_lpl, *csr_indices;
    int32_t csr_cap;
    m40_kv_pool_info info; /* the memory accounting it was sized by (m40_gpu_kv_new) */
    /* Tensor parallelism: on rank 0's pool, the other ranks' (K and V of their heads,
     * the same blocks: they share this pool's tables, pool_owned 0 there) */
    m40_gpu_kv **tp_kv;
    int pool_owned;
};

#endif
