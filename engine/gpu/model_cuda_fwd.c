/* The GPU back end, part 2 (part 1, model_cuda.c, loads the weights; gpu_kv.c holds the
 * device KV pool): the forward pass.
 *
 * Shape of a forward call (one call per scheduler step, any mix of slots):
 *   - the batch's rows are grouped by slot (stable), so each sequence's new tokens are
 *     contiguous: that is the CSR layout every paged kernel takes (q_indptr = rows of
 *     sequence s, indptr/indices/last_page_len = its KV blocks);
 *   - kv/ (paged_kv.c) groups them and reserves the blocks of every slot's new
 *     positions first, asked by the scheduler before the call (m40_kv_reserve) or by
 *     the call itself; when the pool cannot hold them the answer is -2 before anything
 *     is written (the scheduler preempts and retries);
 *   - the prefix cache is on (M40_PREFIX_CACHE=0 turns it off): a slot may start on
 *     cached blocks (m40_kv_slot_match_prefix, its first position then being the
 *     matched length), and after the step kv/ commits every block that became full
 *     under the slot's real token ids;
 *   - step_plan.c writes the small integer tables (tokens, positions, CSR), which go up
 *     in one copy from pinned memory; then per layer: RMSNorm (fused with the previous layer's residual add)
 *     -> fused QKV matmul (+bias) -> RoPE -> paged KV append -> attention -> output
 *     matmul -> residual add + RMSNorm -> fused gate/up matmul -> SwiGLU -> down matmul;
 *     everything stays on the device. Attention: the sequences with one new token come
 *     first in the step and take the decode kernel (split-K), which also does their
 *     q/k/v biases and per-head Q/K norms where the layer has them, their RoPE and KV
 *     append (m40k_attn_decode_rope: one launch, not four) and, in its
 *     cluster merge, the int8 records of its output for an int8 output projection
 *     (its option out_q8: no quantization launch between them); the prompt
 *     chunks take RoPE + append (m40k_kv_append_rope_tab, the angles made once a step
 *     for every layer by m40k_rope_table) and the prefill kernel; other
 *     head sizes all three separately, with a plain attention kernel. An F16 down
 *     projection on the tensor-core GEMV (1..8 rows) forms SwiGLU of its input itself
 *     (m40k_gemm_skinny_glu): one launch less there too;
 *   - a layer with a router runs its mixture of experts instead of the dense FFN
 *     (moe_ffn): router logits and top-k on the device, then for steps of up to 8 rows
 *     the expert GEMVs (each pair reads its expert's rows, gate/up fused with the
 *     activation, down with the weighted sum), above that the grouped products (pairs
 *     sorted by expert, one quantized tensor-core GEMM launch for all experts, then
 *     back to the tokens); no host round trip, so decode steps keep their CUDA graphs;
 *   - only the rows that want logits go through the final norm and the head; their
 *     logits come back to the host in the caller's row order;
 *   - a decode step of one sequence whose products all take the int8 GEMV (no post norms)
 *     runs without add+RMSNorm kernels after layer 0: the attention output and down
 *     projections add their product into the residual themselves and write the next
 *     product's int8 input (the records of x * norm weight, unscaled) and x's sums of
 *     squares; the next GEMV scales its product by the norm factor (kernels.h 8d,
 *     fold_norm_ok; M40_FUSE_NORM=0 turns it off). The last down projection does the
 *     final norm for the head the same way. A MoE layer folds its post-attention norm
 *     the same way too (moe_fold_ok): the router and the experts' gate/up read it.
 *
 * Matmuls (y = W x over n token rows):
 *   - F32 weights (the tiny test models): cublasSgemm;
 *   - n <= 8 and a type the GEMV kernels read: a GEMV, which streams each weight once
 *     for the whole decode batch (except where the register kernel of m40k_gemm_q,
 *     below, reads the type and n is past M40_GEMV_ROWS, default 2: the dp4a GEMV's
 *     time grows with n, the register kernel's barely, BENCHMARKS.md; gemv_batch):
 *     Q8_0, Q4_0, Q4_K, Q6_K (16-byte aligned; Q8_0 and Q6_K in their regrouped
 *     device layouts where the row width allows, kernels.h 0., M40_G8) the dp4a GEMV
 *     on x quantized once per input to two int8 levels (m40k_quantize_q8,
 *     m40k_gemv_q8: per element within max|x of its block|/254^2); F16, Q4_1, Q5_0,
 *     Q5_1 the float-activation m40k_gemv;
 *   - 9..128 rows (M40_GEMM_Q_ROWS; from 3 rows as above), quantized weights (every
 *     type the GPU reads): the quantized tensor-core GEMM (m40k_gemm_q, kernels.h 8e)
 *     on the F16 copy of x: the weights read once per block of token rows in their
 *     quantized bytes, formed in F16 in registers (decode batches up to 64 rows of the
 *     common types) or in shared memory, no F16 copy of the matrix (gemm_q_reads;
 *     M40_GEMM_Q=0 turns it off);
 *   - F16 weights over more rows: cublasGemmEx on x rounded to F16, F32 accumulation;
 *   - otherwise (more than M40_GEMM_Q_ROWS rows: prefill chunks; M40_GEMM_Q=0; a shape
 *     m40k_gemm_q refuses) the "tiled path": the weights dequantized into an F16 scratch
 *     matrix (m40k_gemm_q_dequant, the same F16 weights; the embedding-gather kernel for
 *     the types it does not read), then cublasGemmEx. Models under 1B parameters take it in F32 instead (weights
 *     dequantized to F32, cublasSgemm): see gemm_f32.
 * Every GGUF weight type the loader reads is kept on the device as the file has it (Q8_0
 * and Q6_K regrouped, kernels.h 0.): BF16, Q2_K, Q3_K and Q5_K go through the GEMV and
 * the direct kernel of m40k_gemm_q (their F16 weights, BF16 rounded to F16 there) and
 * above M40_GEMM_Q_ROWS through the gather into the F16 scratch. Q/K/V and gate/up are concatenated on upload when their types match, so
 * each pair/triple is one product. */
#ifdef M40_HAVE_CUDA

#include "model_cuda_int.h"

#include <stdio.h>
#include <string.h>

/* ------------------------------------------------- activation reserve ---- */

/* Device bytes that forward calls of up to max_rows token rows, max_out of them with
 * logits, allocate on top of what is resident at load: what ensure_scratch, ensure_ints
 * and the attention workspace below grow to (keep this in step with them), plus room
 * for what is not ours to count exactly. The KV pool is sized after the weights but
 * before any forward call, so this is reserved out of the pool's share up front; a
 * forward call that found no memory for its scratch would fail the step.
 *   - per token row: the residual stream and its copies (x, xb, x2, xd), q/k/v, the
 *     attention output, gate|up and the FFN hidden (hb, hb2) in F32, and the F16 copy
 *     of the widest product input (x16);
 *   - per logits row: the final-norm output, the logits and the greedy pick;
 *   - the int8 GEMV inputs, the tensor-core GEMV's split-K workspace (4 MB) and
 *     counters, the decode attention's split workspace (its split picker keeps
 *     sequences x KV heads x splits within 4 blocks per SM) and counters;
 *   - then a quarter more and 256 MiB: cuBLAS / cuBLASLt workspaces (allocated at their
 *     first GEMM), the executable CUDA graphs of decode steps (up to M40_GRAPH_SLOTS),
 *     the batch tables (a few ints per row and one per KV block in the step), the
 *     allocator's rounding, and the scratch that a GEMM kernel of ours may add without
 *     this estimate knowing it. */
/* The most rows any product of the model has (the output head, the fused [q; k; v] and
 * [gate; up]): the split-K counters of the GEMV and GEMM kernels cover it. */
static int gpu_rows_max(const m40_gpu *g)
{
    const m40_model_params *p = &g->p;
    int64_t rows = p->n_vocab;
    const int64_t cand[] = {g->qkv_dim, 2 * (int64_t)p->ffn_dim, p->dim, g->q_dim};
    for (int i = 0; i < 4; i++)
        if (cand[i] > rows)
            rows = cand[i];
    return (int)rows;
}

/* The widest input of any product (the x16 and int8 records are sized by it). */
static size_t gpu_in_max(const m40_gpu *g)
{
    const m40_model_params *p = &g->p;
    size_t in_max = (size_t)p->ffn_dim;
    if ((size_t)p->dim > in_max)
        in_max = (size_t)p->dim;
    if ((size_t)g->q_dim > in_max)
        in_max = (size_t)g->q_dim;
    return in_max;
}

/* Split-K partial sums of the tensor-core GEMV (4 MB: every split the picker makes for
 * 7B-class shapes at 8 rows; larger ones take fewer splits) and of the quantized GEMM
 * (16 MB; likewise). */
#define SK_WS_FLOATS ((size_t)1 << 20)
#define MQ_WS_FLOATS ((size_t)1 << 22)

/* Token rows one pass of the expert kernels takes: they index at most 65535 (token,
 * choice) pairs a launch (kernels/moe.cu); longer steps run the layer's experts in
 * slices of rows. */
static int32_t moe_rows_max(const m40_gpu *g) { return 65535 / (g->p.n_experts_used > 0 ? g->p.n_experts_used : 1); }

/* Device bytes of the expert FFN's scratch per token row (moe_scratch: model_cuda_int.h). */
static size_t moe_row_bytes(const m40_gpu *g)
{
    const m40_model_params *p = &g->p;
    const size_t k = (size_t)p->n_experts_used, E = (size_t)p->n_experts;
    return 4 * E + k * (4 + 4 + 4 + 4 + 2 * (size_t)g->moe_ldx + 4 * 2 * (size_t)p->expert_ffn_dim +
                        (4 + 2) * (size_t)g->moe_ldh + 4 * (size_t)p->dim + 80 * (size_t)(p->expert_ffn_dim / 32)) +
           8 * (size_t)(E < k ? E : k) + 64;
}

/* The expert FFN's scratch for c token rows (model_cuda_int.h), contents lost. */
static int moe_scratch(m40_gpu *g, int32_t c)
{
    const m40_model_params *p = &g->p;
    if (c > moe_rows_max(g))
        c = moe_rows_max(g);
    const size_t N = (size_t)c, k = (size_t)p->n_experts_used, E = (size_t)p->n_experts, P = N * k;
    const size_t tiles = (size_t)m40k_moe_max_tiles((int)P, (int)E, 16); /* bm 16: the most tiles */
    return grow_dev((void **)&g->moe_logits, N * E * 4) || grow_dev((void **)&g->moe_w, P * 4) ||
           grow_dev((void **)&g->moe_ids, P * 4) || grow_dev((void **)&g->moe_counts, E * 4) ||
           grow_dev((void **)&g->moe_offsets, (E + 1) * 4) || grow_dev((void **)&g->moe_perm, P * 4) ||
           grow_dev((void **)&g->moe_inv, P * 4) || grow_dev((void **)&g->moe_tiles, 2 * tiles * 4) ||
           grow_dev((void **)&g->moe_x16, P * (size_t)g->moe_ldx * 2) ||
           grow_dev((void **)&g->moe_yg, P * (size_t)p->expert_ffn_dim * 4) ||
           grow_dev((void **)&g->moe_yu, P * (size_t)p->expert_ffn_dim * 4) ||
           grow_dev((void **)&g->moe_h, P * (size_t)g->moe_ldh * 4) ||
           grow_dev((void **)&g->moe_h16, P * (size_t)g->moe_ldh * 2) ||
           grow_dev((void **)&g->moe_yd, P * (size_t)p->dim * 4) ||
           grow_dev(&g->moe_hq, m40k_moe_q8_records_bytes((int)P, p->expert_ffn_dim));
}

size_t m40_gpu_step_reserve_bytes(const m40_gpu *g, int32_t n_slots, int32_t max_rows, int32_t max_out)
{
    const m40_model_params *p = &g->p;
    size_t R = (size_t)(max_rows < 64 ? 64 : max_rows), O = (size_t)(max_out < 8 ? 8 : max_out);
    const size_t in_max = gpu_in_max(g);
    size_t per_row = 4 * (4 * (size_t)p->dim + (size_t)g->qkv_dim + (size_t)g->q_dim + 3 * (size_t)p->ffn_dim) +
                     2 * in_max + 8 * (size_t)p->rope_dim; /* ... + the two RoPE angle tables */
    size_t per_out = 4 * (size_t)p->dim + 4 * (size_t)p->n_vocab + 8;
    if (g->tp_n > 1) /* a rank's piece of the logits and the gathered pieces */
        per_out += 4 * (size_t)(g->tp_n + 1) * (size_t)g->tp_vocab_stride;
    const int rows = gpu_rows_max(g);
    size_t fixed = m40k_gemv_q8_ws_bytes((int)in_max, 8) + m40k_gemv_q8_ws_bytes((int)p->dim, 1) +
                   ((size_t)p->dim / 32 + 1) * 4 + SK_WS_FLOATS * 4 +
                   m40k_gemm_skinny_counter_ints(rows) * sizeof(int) +
                   (g->gemm_q ? MQ_WS_FLOATS * 4 + m40k_gemm_q_counter_ints(rows, (int)R) * sizeof(int)
                              : 0); /* the quantized GEMM's split-K scratch (ensure_scratch) */
    const int G = p->n_kv_heads > 0 ? p->n_heads / p->n_kv_heads : 1;
    size_t att = (size_t)4 * (size_t)(g->sm_count > 0 ? g->sm_count : 132) * (size_t)(G > 0 ? G : 1) *
                     ((size_t)p->head_dim + 2) * 4 +
                 m40k_decode_counter_ints(n_slots, p->n_kv_heads) * sizeof(int);
    if (g->moe) /* the expert FFN's scratch (moe_scratch) */
        per_row += moe_row_bytes(g);
    size_t est = R * per_row + O * per_out + fixed + att;
    return est + est / 4 + ((size_t)256 << 20);
}

/* ------------------------------------------------------------- forward ---- */

void m40_gpu_graph_stats(const m40_gpu *g, int64_t *captures, int64_t *launches)
{
    *captures = g->graph_captures;
    *launches = g->graph_launches;
}

int m40_gpu_step_timing(m40_gpu *g, int on)
{
    cudaSetDevice(g->device);
    if (on && !g->step_ev[0]) {
        if (cudaEventCreate(&g->step_ev[0]) != cudaSuccess) {
            g->step_ev[0] = NULL;
            return -1;
        }
        if (cudaEventCreate(&g->step_ev[1]) != cudaSuccess) {
            cudaEventDestroy(g->step_ev[0]);
            g->step_ev[0] = g->step_ev[1] = NULL;
            return -1;
        }
    }
    g->time_steps = on != 0;
    return 0;
}

void m40_gpu_step_time(const m40_gpu *g, double *ms, int64_t *steps)
{
    *ms = g->step_gpu_ms;
    *steps = g->steps_timed;
}

static int ensure_scratch(m40_gpu *g, int32_t n, int32_t n_out)
{
    const m40_model_params *p = &g->p;
    if (n > g->cap || (n_out > g->cap_out) || (g->skinny && !g->gemm_f32 && !g->sk_cnt))
        m40_gpu_graphs_free(g);
    if (n > g->cap) {
        int32_t c = n < 64 ? 64 : n;
        const size_t N = (size_t)c, in_max = gpu_in_max(g);
        if (grow_dev((void **)&g->x, N * p->dim * 4) || grow_dev((void **)&g->xb, N * p->dim * 4) ||
            grow_dev((void **)&g->x2, N * p->dim * 4) || grow_dev((void **)&g->xd, N * p->dim * 4) ||
            grow_dev((void **)&g->qkv, N * g->qkv_dim * 4) || grow_dev((void **)&g->att, N * g->q_dim * 4) ||
            grow_dev((void **)&g->hb, N * 2 * p->ffn_dim * 4) || grow_dev((void **)&g->hb2, N * p->ffn_dim * 4) ||
            grow_dev((void **)&g->x16, N * in_max * 2) ||
            grow_dev(&g->xq, m40k_gemv_q8_ws_bytes((int)in_max, 8)) ||
            grow_dev(&g->xq2, m40k_gemv_q8_ws_bytes((int)p->dim, 1)) ||
            grow_dev((void **)&g->nss, ((size_t)p->dim / 32 + 1) * 4) ||
            (p->rope_dim > 0 && (grow_dev((void **)&g->rope_cs[0], N * (size_t)p->rope_dim * 4) ||
                                 grow_dev((void **)&g->rope_cs[1], N * (size_t)p->rope_dim * 4))) ||
            (g->moe && moe_scratch(g, c)))
            return -1;
        free(g->perm);
        free(g->out_rows);
        g->perm = malloc(N * sizeof *g->perm);
        g->out_rows = malloc(N * sizeof *g->out_rows);
        if (!g->perm || !g->out_rows)
            return -1;
        g->cap = c;
    }
    const size_t mq_ints = m40k_gemm_q_counter_ints(gpu_rows_max(g), g->cap);
    if (g->gemm_q && !g->gemm_f32 && mq_ints > g->mq_cnt_ints) {
        /* split-K scratch of the quantized GEMM: counters for every output tile of the
         * largest product at cap rows, and the partial sums (MQ_WS_FLOATS) */
        g->mq_ws_floats = MQ_WS_FLOATS;
        if ((!g->mq_ws && grow_dev((void **)&g->mq_ws, g->mq_ws_floats * 4)) ||
            grow_dev((void **)&g->mq_cnt, mq_ints * sizeof *g->mq_cnt) ||
            cudaMemsetAsync(g->mq_cnt, 0, mq_ints * sizeof *g->mq_cnt, g->stream) != cudaSuccess) {
            cudaFree(g->mq_cnt);
            g->mq_cnt = NULL;
            g->mq_cnt_ints = 0;
            return -1;
        }
        g->mq_cnt_ints = mq_ints;
    }
    if (g->skinny && !g->gemm_f32 && !g->sk_cnt) {
        /* split-K scratch of the tensor-core GEMV (SK_WS_FLOATS) */
        g->sk_cnt_ints = m40k_gemm_skinny_counter_ints(gpu_rows_max(g));
        g->sk_ws_floats = SK_WS_FLOATS;
        if (grow_dev((void **)&g->sk_ws, g->sk_ws_floats * 4) ||
            grow_dev((void **)&g->sk_cnt, g->sk_cnt_ints * sizeof *g->sk_cnt) ||
            cudaMemsetAsync(g->sk_cnt, 0, g->sk_cnt_ints * sizeof *g->sk_cnt, g->stream) != cudaSuccess) {
            cudaFree(g->sk_cnt);
            g->sk_cnt = NULL;
            return -1;
        }
    }
    if (n_out > g->cap_out) {
        int32_t c = n_out < 8 ? 8 : n_out;
        cudaFreeHost(g->logits_h);
        cudaFreeHost(g->samp_h);
        g->logits_h = NULL;
        g->samp_h = NULL;
        if (grow_dev((void **)&g->xg, (size_t)c * p->dim * 4) ||
            grow_dev((void **)&g->logits_d, (size_t)c * p->n_vocab * 4) || grow_dev((void **)&g->pick_d, (size_t)c * 8) ||
            grow_dev((void **)&g->samp_d, (size_t)c * sizeof *g->samp_d) ||
            cudaHostAlloc((void **)&g->logits_h, (size_t)c * p->n_vocab * 4, cudaHostAllocDefault) != cudaSuccess ||
            cudaHostAlloc((void **)&g->samp_h, (size_t)c * sizeof *g->samp_h, cudaHostAllocDefault) != cudaSuccess)
            return -1;
        if (g->tp_n > 1 &&
            (grow_dev((void **)&g->tp_logits, (size_t)c * (size_t)g->tp_vocab_stride * 4) ||
             grow_dev((void **)&g->tp_gather, (size_t)g->tp_n * (size_t)c * (size_t)g->tp_vocab_stride * 4)))
            return -1;
        g->cap_out = c;
    }
    return 0;
}

static int gemv_reads(int type, int64_t K)
{
    switch (type) {
    case M40K_TYPE_F16:
    case M40K_TYPE_BF16: return K % 8 == 0;
    case M40K_TYPE_Q8_0:
    case M40K_TYPE_Q4_0:
    case M40K_TYPE_Q4_1:
    case M40K_TYPE_Q5_0:
    case M40K_TYPE_Q5_1:
    case M40K_TYPE_MXFP4: return K % 32 == 0;
    case M40K_TYPE_Q2_K:
    case M40K_TYPE_Q3_K:
    case M40K_TYPE_Q4_K:
    case M40K_TYPE_Q5_K:
    case M40K_TYPE_Q6_K: return K % 256 == 0;
    default: return 0;
    }
}

/* The int8-activation GEMV (m40k_gemv_q8, two-level activations: within
 * max|x of a block|/254^2 per element) takes quantized weights 16-byte aligned. */
static int gemv_q8_reads(const gmat *w)
{
    const int t = w->type;
    if (t == M40K_TYPE_Q8_0_G8 || t == M40K_TYPE_Q6_K_G8) /* regrouped: rows of whole groups */
        return ((uintptr_t)w->data & 15) == 0;
    return (t == M40K_TYPE_Q8_0 || t == M40K_TYPE_Q4_0 || t == M40K_TYPE_Q4_K || t == M40K_TYPE_Q6_K) &&
           gemv_reads(t, w->cols) && ((uintptr_t)w->data & 15) == 0;
}

/* F16 decode products that the tensor-core GEMV (m40k_gemm_skinny) reads faster than
 * m40k_gemv (H100, test_kernels --bench skinny, BENCHMARKS.md): 3..8 rows (8 rows, N 4096
 * x K 14336: 87.1% of bandwidth against 47.2%), and one or two rows of long K (1 row, K
 * 14336: 91.1% against 79.7%; at K = N and below the GEMV is as fast or faster: alone,
 * N 4096 x K 4096 at 1 row takes 14.6 us here against 15.4, but Mistral's o-projection on
 * it made batch-1 decode slower, 170.0 -> 169.1 tok/s, fifth session). It rounds x to
 * F16, so not for models under 1B parameters (gemm_f32: their products stay F32). */
static int skinny_reads(const m40_gpu *g, const gmat *w, int32_t n)
{
    return g->skinny && g->sk_cnt && !g->gemm_f32 && w->type == M40K_TYPE_F16 && n <= 8 && w->cols % 128 == 0 &&
           ((uintptr_t)w->data & 15) == 0 && (n >= 3 || w->cols >= 2 * w->rows);
}

/* y[t*ldy + r] = sum_k W[r][k] x[t*cols + k] in F32 (cuBLAS SGEMM) for F32 weights w. */
static int sgemm_rows(const m40_gpu *g, const float *w, int rows, int cols, const float *x, int32_t n, float *y,
                      int64_t ldy, char *err, size_t errlen)
{
    const float one = 1.0f, zero = 0.0f;
    cublasStatus_t s =
        cublasSgemm(g->blas, CUBLAS_OP_T, CUBLAS_OP_N, rows, n, cols, &one, w, cols, x, cols, &zero, y, (int)ldy);
    if (s != CUBLAS_STATUS_SUCCESS) {
        m40_set_err(err, errlen, "gpu %d: cublasSgemm failed (%d)", g->device, (int)s);
        return -1;
    }
    return 0;
}

/* y[t*ldy + r] = sum_k W[r][k] x[t*cols + k] for r < W.rows, t < n (x contiguous).
 * *xq_ready: whether g->xq already holds x quantized (m40k_quantize_q8); set once it
 * does, so the products of one x share one quantization. *x16_ready likewise for the
 * F16 copy of x in g->x16 (tensor-core paths). */
/* x (n rows of cols) quantized into g->xq for m40k_gemv_q8, unless *xq_ready says it is
 * there already; then it is. */
static int quantize_once(m40_gpu *g, const float *x, int cols, int32_t n, int *xq_ready)
{
    if (*xq_ready)
        return 0;
    *xq_ready = 1;
    return m40k_quantize_q8(x, cols, cols, n, g->xq, g->stream);
}

/* The input of a product whose RMSNorm the GEMV before it folded in (kernels.h 8d): the
 * records of x * norm_w (unscaled) and the sums of squares of x per 32 elements. */
typedef struct {
    const void *xq;
    const float *ss;
    float eps;
} gnorm_in;

/* The gate/up product of a prompt chunk written in F16 (m40_gpu.prefill_f16) is scaled by
 * this, and the GLU (m40k_glu_h16) scales it back: a power of two, exact, which lifts
 * F16's range from 65,504 to 1,048,064 (pre-activations past it would be infinities). */
#define GLU_H16_SCALE 16.0f

/* x (n rows of cols) rounded to F16 into g->x16 for the tensor-core products, unless
 * *x16_ready says it is there already; then it is (quantize_once's twin). */
static int f16_once(m40_gpu *g, const float *x, int cols, int32_t n, int *x16_ready)
{
    if (*x16_ready)
        return 0;
    *x16_ready = 1;
    return m40k_f32_to_f16(x, g->x16, (int64_t)n * cols, g->stream);
}

/* *out: W's weights as type (M40K_TYPE_F16 or M40K_TYPE_F32) for cuBLAS: w's own data
 * where it has that type, else dequantized into g->deq (to F16 the weights gemm_q forms,
 * where its dequantizer reads the type; else, and to F32, the gather's). */
static int weights_as(m40_gpu *g, const gmat *w, int type, const void **out, char *err, size_t errlen)
{
    const int rows = (int)w->rows, cols = (int)w->cols;
    *out = w->data;
    if (w->type == type)
        return 0;
    if ((size_t)rows * (size_t)cols > g->deq_cap) {
        m40_set_err(err, errlen, "gpu %d: dequantization scratch too small", g->device);
        return -1;
    }
    if (type != M40K_TYPE_F16 || m40k_gemm_q_dequant(w->data, w->type, rows, cols, (uint16_t *)g->deq, g->stream) != 0)
        CK(m40k_embed(w->data, w->type, rows, cols, g->iota, rows, g->deq, type, cols, g->stream));
    *out = g->deq;
    return 0;
}

/* The tiled path: W dequantized to F16 where it is not (g->deq), then cuBLAS, F16 x F16
 * with F32 sums, into y (F32; added to what y holds where accumulate is set) or, where
 * y16 is not NULL, into y16 (F16, times 1/GLU_H16_SCALE). */
static int tiled_gemm(m40_gpu *g, const gmat *w, const float *x, int32_t n, float *y, uint16_t *y16, int64_t ldy,
                      int accumulate, int *x16_ready, char *err, size_t errlen)
{
    const float one = 1.0f, zero = 0.0f, inv = 1.0f / GLU_H16_SCALE;
    const int rows = (int)w->rows, cols = (int)w->cols;
    const void *wf16;
    if (weights_as(g, w, M40K_TYPE_F16, &wf16, err, errlen))
        return -1;
    CK(f16_once(g, x, cols, n, x16_ready));
    cublasStatus_t s = cublasGemmEx(g->blas, CUBLAS_OP_T, CUBLAS_OP_N, rows, n, cols, y16 ? &inv : &one, wf16,
                                    CUDA_R_16F, cols, g->x16, CUDA_R_16F, cols, accumulate ? &one : &zero,
                                    y16 ? (void *)y16 : (void *)y,
                                    y16 ? CUDA_R_16F : CUDA_R_32F, (int)ldy, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    if (s != CUBLAS_STATUS_SUCCESS) {
        m40_set_err(err, errlen, "gpu %d: cublasGemmEx failed (%d)", g->device, (int)s);
        return -1;
    }
    return 0;
}

/* ------------------------------------------------- batch invariance ---- */

/* y = W x for one tile of r <= g->inv_rows token rows on cuBLAS, always called as a
 * product of inv_rows rows: cuBLAS picks its algorithm (tiles, split of K) by the
 * shape, so one shape is one algorithm, and a row's sums do not depend on how many rows
 * the step has. A full tile reads x and writes y where they are; a short one goes
 * through inv_x and inv_y (the rows past r there are whatever they hold: each output
 * row reads its own x row only). xt / xsz: x's type and element size. */
static int inv_blas_tile(m40_gpu *g, const void *w, cudaDataType wt, int rows, int cols, const void *x,
                         cudaDataType xt, size_t xsz, int32_t r, float *y, int64_t ldy, char *err, size_t errlen)
{
    const float one = 1.0f, zero = 0.0f;
    const int T = g->inv_rows;
    const void *xa = x;
    float *ya = y;
    if (r < T) {
        CK(cudaMemcpyAsync(g->inv_x, x, (size_t)r * (size_t)cols * xsz, cudaMemcpyDeviceToDevice, g->stream));
        xa = g->inv_x;
        ya = g->inv_y;
    }
    /* the same leading dimensions for every tile (inv_y holds inv_rows rows of the widest ldy) */
    cublasStatus_t s = cublasGemmEx(g->blas, CUBLAS_OP_T, CUBLAS_OP_N, rows, T, cols, &one, w, wt, cols, xa, xt, cols,
                                    &zero, ya, CUDA_R_32F, (int)ldy, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    if (s != CUBLAS_STATUS_SUCCESS) {
        m40_set_err(err, errlen, "gpu %d: cublasGemmEx failed (%d)", g->device, (int)s);
        return -1;
    }
    if (r < T)
        CK(cudaMemcpy2DAsync(y, (size_t)ldy * 4, g->inv_y, (size_t)ldy * 4, (size_t)rows * 4, (size_t)r,
                             cudaMemcpyDeviceToDevice, g->stream));
    return 0;
}

/* The products of batch invariance (g->invariant): y[t] = W x[t] for t < n, in tiles of
 * g->inv_rows rows, each row summed the same way whatever n is. Quantized types the
 * GEMM reads: m40k_gemm_q on the F16 copy of x with one split count for the matrix (its
 * pick at inv_rows rows), each tile whole in one block of its kernel (a token's column of
 * the tensor-core sums does not depend on the others). F16 weights, and the types it does
 * not read dequantized to F16 first: cuBLAS (inv_blas_tile). F32 weights, and every
 * product of models under 1B parameters (gemm_f32): cuBLAS in F32. */
static int inv_matmul(m40_gpu *g, const gmat *w, const float *x, int32_t n, float *y, int64_t ldy, int *x16_ready,
                      char *err, size_t errlen)
{
    const int rows = (int)w->rows, cols = (int)w->cols, T = g->inv_rows;
    const int f32 = w->type == M40K_TYPE_F32 || g->gemm_f32;
    if (!f32)
        CK(f16_once(g, x, cols, n, x16_ready));
    if (!f32 && gemm_q_reads(g, w)) {
        const int S = m40k_gemm_q_pick_splits(w->type, rows, cols, T, g->sm_count, g->mq_ws_floats, g->mq_cnt_ints);
        for (int32_t t0 = 0; t0 < n; t0 += T)
            CK(m40k_gemm_q(w->data, w->type, rows, cols, g->x16 + (size_t)t0 * cols, cols, n - t0 < T ? n - t0 : T,
                           y + (size_t)t0 * ldy, ldy, S, g->mq_ws, g->mq_cnt, g->stream));
        return 0;
    }
    const void *wf;
    if (weights_as(g, w, f32 ? M40K_TYPE_F32 : M40K_TYPE_F16, &wf, err, errlen))
        return -1;
    for (int32_t t0 = 0; t0 < n; t0 += T)
        if (inv_blas_tile(g, wf, f32 ? CUDA_R_32F : CUDA_R_16F, rows, cols,
                          f32 ? (const void *)(x + (size_t)t0 * cols) : (const void *)(g->x16 + (size_t)t0 * cols),
                          f32 ? CUDA_R_32F : CUDA_R_16F, f32 ? 4 : 2, n - t0 < T ? n - t0 : T, y + (size_t)t0 * ldy,
                          ldy, err, errlen))
            return -1;
    return 0;
}

/* pick (or NULL): the greedy pick's key (kernels.h 9c) for a product of one row on the
 * int8 GEMV (w int8-readable, n 1, ldy rows: m40_gpu_forward asks for it only then) */
static int matmul_one(m40_gpu *g, const gmat *w, const float *x, int32_t n, float *y, int64_t ldy, int *xq_ready,
                      int *x16_ready, const gnorm_in *nrm, uint64_t *pick, char *err, size_t errlen)
{
    int rows = (int)w->rows, cols = (int)w->cols;
    if (g->invariant) /* no fold, no pick there: fuse_norm and fuse_pick are off */
        return inv_matmul(g, w, x, n, y, ldy, x16_ready, err, errlen);
    if (nrm) { /* fold_norm_ok: batch 1, every part int8-readable */
        CK(pick ? m40k_gemv_q8_argmax(w->data, w->type, rows, cols, nrm->xq, nrm->ss, nrm->eps, y, pick, g->stream)
                : m40k_gemv_q8_normed(w->data, w->type, rows, cols, nrm->xq, nrm->ss, nrm->eps, y, ldy, g->stream));
        return 0;
    }
    if (w->type == M40K_TYPE_F32)
        return sgemm_rows(g, (const float *)w->data, rows, cols, x, n, y, ldy, err, errlen);
    if (skinny_reads(g, w, n)) {
        const int S = m40k_gemm_skinny_pick_splits(rows, cols, n, g->sm_count, g->sk_ws_floats, g->sk_cnt_ints);
        CK(m40k_gemm_skinny((const uint16_t *)w->data, rows, cols, x, cols, n, y, ldy, S, g->sk_ws, g->sk_cnt,
                            g->stream));
        return 0;
    }
    if (gemv_batch(g, w, n) && gemv_q8_reads(w)) {
        CK(quantize_once(g, x, cols, n, xq_ready));
        CK(pick ? m40k_gemv_q8_argmax(w->data, w->type, rows, cols, g->xq, NULL, 0.0f, y, pick, g->stream)
                : m40k_gemv_q8(w->data, w->type, rows, cols, g->xq, n, y, ldy, g->stream));
        return 0;
    }
    if (gemv_batch(g, w, n) && gemv_reads(w->type, cols))
        return m40k_gemv(w->data, w->type, rows, cols, x, cols, y, ldy, n, g->stream) == 0
                   ? 0
                   : (m40_set_err(err, errlen, "gpu %d: GEMV (type %d, %dx%d, batch %d) failed", g->device, w->type, rows,
                              cols, (int)n),
                      -1);
    if (gemm_q_takes(g, w, n)) { /* past gemv_batch: the quantized tensor-core GEMM on the F16 copy of x */
        CK(f16_once(g, x, cols, n, x16_ready));
        const int S = m40k_gemm_q_pick_splits(w->type, rows, cols, n, g->sm_count, g->mq_ws_floats, g->mq_cnt_ints);
        CK(m40k_gemm_q(w->data, w->type, rows, cols, g->x16, cols, n, y, ldy, S, g->mq_ws, g->mq_cnt, g->stream));
        return 0;
    }
    if (g->gemm_f32) { /* the tiled path in F32: exact weights and activations */
        const void *wf32;
        if (weights_as(g, w, M40K_TYPE_F32, &wf32, err, errlen))
            return -1;
        return sgemm_rows(g, (const float *)wf32, rows, cols, x, n, y, ldy, err, errlen);
    }
    return tiled_gemm(g, w, x, n, y, NULL, ldy, 0, x16_ready, err, errlen);
}

/* Whether a product of n rows told x16_ready (wants_x16) reads only the F16 copy of x:
 * past 8 rows no GEMV or skinny kernel takes it, so out's F32 copy need not be written
 * (prefill chunks: 16 MB a layer less at 512 rows of 4096). */
static int x16_only(int x16, int32_t n) { return x16 && n > 8; }

/* Whether matmul_one takes the tiled path for a product of n rows with w (its tests in
 * its order: not F32, not the skinny kernel, not a GEMV, not the quantized GEMM, not the
 * F32 products). */
static int tiled_takes(const m40_gpu *g, const gmat *w, int32_t n)
{
    return w->type != M40K_TYPE_F32 && !skinny_reads(g, w, n) &&
           !(gemv_batch(g, w, n) && (gemv_q8_reads(w) || gemv_reads(w->type, (int)w->cols))) &&
           !gemm_q_takes(g, w, n) && !g->gemm_f32;
}

/* Whether every part of pr takes the tiled path at n rows (and pr has parts). */
static int all_tiled(const m40_gpu *g, const gproj *pr, int32_t n)
{
    if (pr->n_parts == 0)
        return 0;
    for (int i = 0; i < pr->n_parts; i++)
        if (!tiled_takes(g, &pr->part[i], n))
            return 0;
    return 1;
}

/* Whether the gate/up product pr of n rows is written in F16 for the GLU (m40k_glu_h16):
 * every part on the tiled path (prompt chunks), no bias, the down projection reading the
 * GLU's F16 copy only (x16_dn past 8 rows), and not turned off (M40_PREFILL_F16=0). Its F32
 * output is 2 x 14336 floats a row for Mistral: 58 MB a layer written by cuBLAS and
 * read by the GLU at 512 rows. */
static int glu_h16_ok(const m40_gpu *g, const gproj *pr, int32_t n, int x16_dn)
{
    return g->prefill_f16 && !pr->bias && x16_only(x16_dn, n) && all_tiled(g, pr, n);
}

/* Whether the product pr over n rows starts with the int8-activation GEMV: then the
 * kernel that writes its input can quantize it on the way (m40k_add_rmsnorm_to's xq,
 * m40k_glu_q8) and matmul is told so (xq_ready). */
static int wants_xq(const m40_gpu *g, const gproj *pr, int32_t n)
{
    /* cols: a multiple of 32 */
    return pr->n_parts > 0 && gemv_batch(g, &pr->part[0], n) && gemv_q8_reads(&pr->part[0]);
}

/* Whether the product pr over n rows multiplies an F16 copy of x on the tensor cores
 * (g->x16): then the kernel that writes its input writes that copy on the way
 * (m40k_add_rmsnorm_to's out16, m40k_glu_f16) and matmul is told so (x16_ready). */
static int wants_x16(const m40_gpu *g, const gproj *pr, int32_t n)
{
    if (g->gemm_f32 || pr->n_parts == 0)
        return 0;
    if (gemv_batch(g, &pr->part[0], n))
        return 0; /* a GEMV (for F16 weights the skinny one: gemm_q never reads them) */
    for (int i = 0; i < pr->n_parts; i++)
        if (pr->part[i].type == M40K_TYPE_F32)
            return 0;
    return 1;
}

/* The residual stream's two buffers trade places: the one just written becomes current. */
static void swap_residual(float **xc, float **xo)
{
    float *t = *xc;
    *xc = *xo;
    *xo = t;
}

/* Whether producer pr (its output added into the residual) can fold the add + RMSNorm
 * after it into its GEMV (kernels.h 8d): batch 1, pr one int8-readable part of dim rows
 * (its bias, if any, added there too), no post norm of pr's output (post_norm NULL: a
 * normed output is not what the residual adds), and not turned off (M40_FUSE_NORM=0). */
static int fold_producer_ok(const m40_gpu *g, const gproj *pr, const float *post_norm, int32_t n)
{
    return g->fuse_norm && !post_norm && n == 1 && pr->n_parts == 1 && pr->rows == g->p.dim && g->p.dim % 32 == 0 &&
           gemv_q8_reads(&pr->part[0]);
}

/* Whether that fold also suits consumer cn: every part of cn int8-readable (the pair of
 * m40k_gemv_q8_pair_normed or single GEMVs) over dim columns. */
static int fold_norm_ok(const m40_gpu *g, const gproj *pr, const float *post_norm, const gmat *cn, int cn_parts,
                        int32_t n)
{
    if (!fold_producer_ok(g, pr, post_norm, n) || cn_parts == 0)
        return 0;
    for (int i = 0; i < cn_parts; i++)
        if (!gemv_q8_reads(&cn[i]) || cn[i].cols != g->p.dim)
            return 0;
    return 1;
}

/* The producer of kernels.h 8d: *xo = *xc + W . (g->xq), the records of *xo * norm_w into
 * g->xq2 and its sums of squares into g->nss; then the residual buffers swap (as add_norm). */
static int gemv_add_norm(m40_gpu *g, const gproj *pr, float **xc, float **xo, const float *norm_w)
{
    const gmat *w = &pr->part[0];
    const int e = m40k_gemv_q8_add_norm(w->data, w->type, (int)w->rows, (int)w->cols, g->xq, pr->bias, *xc, *xo, norm_w,
                                        g->xq2, g->nss, g->stream);
    swap_residual(xc, xo);
    return e;
}

/* xq_ready: g->xq already holds x quantized (m40k_quantize_q8 layout); x16_ready: g->x16
 * already holds x in F16. */
static int matmul(m40_gpu *g, const gproj *pr, const float *x, int32_t n, float *y, int xq_ready, int x16_ready,
                  const gnorm_in *nrm, char *err, size_t errlen)
{
    int64_t off = 0;
    /* Two int8-activation parts at batch 1 (Q4_K_M's [q; k] in Q4_K and v in Q6_K): one
     * launch where the kernel has an instance for the pair (m40k_gemv_q8_pair) */
    const gmat *p0 = &pr->part[0], *p1 = &pr->part[1];
    if (!g->invariant && pr->n_parts == 2 && n == 1 && gemv_q8_reads(p0) && gemv_q8_reads(p1) &&
        p0->cols == p1->cols) {
        const int cols = (int)p0->cols;
        int e;
        if (nrm) {
            e = m40k_gemv_q8_pair_normed(p0->data, p0->type, (int)p0->rows, p1->data, p1->type, (int)p1->rows, cols,
                                         nrm->xq, nrm->ss, nrm->eps, y, pr->rows, g->stream);
        } else {
            CK(quantize_once(g, x, cols, n, &xq_ready));
            e = m40k_gemv_q8_pair(p0->data, p0->type, (int)p0->rows, p1->data, p1->type, (int)p1->rows, cols, g->xq,
                                  n, y, pr->rows, g->stream);
        }
        /* cudaErrorInvalidValue: not a pair the kernel has; the loop below launches them apart */
        if (e != (int)cudaErrorInvalidValue) {
            CK(e);
            off = pr->rows; /* both written */
        }
    }
    for (int i = 0; i < pr->n_parts && off < pr->rows; i++) {
        if (matmul_one(g, &pr->part[i], x, n, y + off, pr->rows, &xq_ready, &x16_ready, nrm, NULL, err, errlen))
            return -1;
        off += pr->part[i].rows;
    }
    if (pr->bias)
        CK(m40k_add_bias(y, pr->rows, pr->bias, n, (int)pr->rows, g->stream));
    return 0;
}

/* The product pr of n rows on the tiled path (all_tiled), its parts side by side in rows
 * of pr->rows: into y16 (F16, times 1/GLU_H16_SCALE; glu_h16_ok: no bias) or, with y16
 * NULL, added into y (the residual: res_fuse_ok; its bias included). */
static int matmul_tiled(m40_gpu *g, const gproj *pr, const float *x, int32_t n, float *y, uint16_t *y16,
                        int x16_ready, char *err, size_t errlen)
{
    int64_t off = 0;
    for (int i = 0; i < pr->n_parts; i++) {
        if (tiled_gemm(g, &pr->part[i], x, n, y16 ? NULL : y + off, y16 ? y16 + off : NULL, pr->rows, !y16,
                       &x16_ready, err, errlen))
            return -1;
        off += pr->part[i].rows;
    }
    if (pr->bias && !y16)
        CK(m40k_add_bias(y, pr->rows, pr->bias, n, (int)pr->rows, g->stream));
    return 0;
}

/* Whether product pr of n rows adds its output into the residual itself (cuBLAS with
 * beta 1 into xc) instead of writing xd for the add + RMSNorm after it: every part on
 * the tiled path, one GPU (ranks sum their parts first), no norm of the output before
 * the add (post_norm: Gemma's), the norm after it not quantizing for a GEMV (xq_next),
 * and not turned off (M40_FUSE_RESIDUAL=0). At 512 rows of Mistral that is 8 MB a
 * product less written and read (xd), and the norm after it reads one stream. */
static int res_fuse_ok(const m40_gpu *g, const gproj *pr, int32_t n, const float *post_norm, int xq_next)
{
    return g->fuse_residual && g->tp_n <= 1 && !post_norm && !xq_next && all_tiled(g, pr, n);
}

/* The RMSNorm of the residual xc (its add done by the product before: matmul_tiled) into
 * the F16 copy g->x16 where the product after reads it (x16), and into out (F32) unless
 * that product reads the copy only. */
static int norm_res(m40_gpu *g, const float *xc, const float *w, float *out, int32_t n, int x16)
{
    const int64_t dim = g->p.dim;
    int e = 0;
    if (x16)
        e = m40k_rmsnorm(xc, dim, w, g->x16, M40K_TYPE_F16, dim, n, (int)dim, g->p.norm_eps, g->stream);
    if (!e && !x16_only(x16, n))
        e = m40k_rmsnorm(xc, dim, w, out, M40K_TYPE_F32, dim, n, (int)dim, g->p.norm_eps, g->stream);
    return e;
}

/* The residual add fused with an RMSNorm: *xo = *xc + xd, out = rmsnorm(*xo) * w (and
 * its int8 quantization into g->xq, or its F16 copy into g->x16, for the product that
 * reads it; out itself not written where that product reads the copy only), then the
 * two residual buffers swap. */
static int add_norm(m40_gpu *g, float **xc, float **xo, const float *w, float *out, int32_t n, int xq, int x16)
{
    const int64_t dim = g->p.dim;
    float *o = x16_only(x16, n) ? NULL : out;
    uint16_t *o16 = x16 ? g->x16 : NULL;
    /* batch invariance: one kernel at any n (xq is never asked for there: no GEMV) */
    const int e = g->invariant ? m40k_add_rmsnorm_to_any(*xc, dim, g->xd, dim, *xo, w, o, dim, n, (int)dim,
                                                         g->p.norm_eps, o16, g->stream)
                               : m40k_add_rmsnorm_to(*xc, dim, g->xd, dim, *xo, w, o, dim, n, (int)dim, g->p.norm_eps,
                                                     xq ? g->xq : NULL, o16, g->stream);
    swap_residual(xc, xo);
    return e;
}

/* Whether layer L's expert GEMVs can take their gate/up product on x's int8 records
 * (kernels.h 10c': types it reads; M40_MOE_Q8; one GPU). */
static int moe_reads_q8(const m40_gpu *g, const glayer *L)
{
    return g->moe_q8 && g->tp_n <= 1 && m40k_moe_gate_up_q8_supported(L->exp_gate.type, (int)g->p.dim);
}

/* Whether n rows of layer L's experts take the grouped products (kernels.h 10e-10i: the
 * pairs sorted by expert, each expert's weights read once for its rows on the quantized
 * tensor-core GEMM) rather than the expert GEMVs (10c/d: each pair reads its expert's
 * rows): more than moe_gemv_rows rows (unset: by the experts' type, below), where the
 * GEMM runs (cc >= 8.0, M40_GEMM_Q) and reads both types, rows a multiple of 8 wide. */
static int moe_grouped(const m40_gpu *g, const glayer *L, int32_t n)
{
    /* unset (-1): the GEMVs for one row, the grouped products from two (qwen3-30b-a3b
     * Q4_K_M with its padded Q6_K experts: a tie at 2 rows, grouped 15% faster at 4); for
     * MXFP4 experts the grouped products from one row (gpt-oss-20b: 1-2% faster at 1, 9% at
     * 2, 35% at 4; BENCHMARKS.md, twenty-sixth session); where the GEMVs read int8
     * records of them (moe_q8; twenty-seventh session), the GEMVs up to 4 rows
     * (qwen3-30b-a3b Q4_K_M and gpt-oss-20b's MXFP4 on an H100: twenty-eighth session) */
    int32_t rows = moe_reads_q8(g, L) ? 4 : L->exp_gate.type == M40K_TYPE_MXFP4_P ? 0 : 1;
    if (g->moe_gemv_rows >= 0)
        rows = g->moe_gemv_rows;
    return n > rows && g->gemm_q && m40k_gemm_q_supported(L->exp_gate.type) &&
           m40k_gemm_q_supported(L->exp_down.type) && g->p.dim % 8 == 0 && g->p.expert_ffn_dim % 8 == 0;
}

/* Whether the expert GEMV of n rows of layer L takes its gate/up product on x's int8
 * records (kernels.h 10c'), which the add + RMSNorm before it then writes into g->xq:
 * a decode row on the GEMVs (not the grouped products), types it reads (the down product
 * then reads h's records where its type allows, moe_ffn). qwen3-30b-a3b Q4_K_M batch 1:
 * BENCHMARKS.md, twenty-seventh session. */
static int moe_q8(const m40_gpu *g, const glayer *L, int32_t n)
{
    return L->router && n <= 8 && moe_reads_q8(g, L) && !moe_grouped(g, L, n);
}

/* The post-attention RMSNorm of a decode row folded into the attention output
 * projection (kernels.h 8d), read by the router (10a') and the experts' gate/up on int8
 * records (10c'n): one add + RMSNorm launch less in the layer. */
static int moe_fold_ok(const m40_gpu *g, const glayer *L, int32_t n)
{
    return L->router && fold_producer_ok(g, &L->wo, L->post_attn_norm, n) && moe_q8(g, L, 1);
}

/* Layer L's mixture of experts on the n normalized rows in g->xb, its output (the
 * weighted sum of each row's chosen experts) into g->xd; or, where nin is not NULL
 * (moe_fold_ok), on the residual row x_res with the norm folded in (nin: its records and
 * sums of squares). All on the device: the router's logits, the top-k and its weights,
 * the grouping, never the host (a decode step stays one CUDA graph). Rows beyond what one
 * launch indexes run in slices (moe_rows_max). */
static int moe_ffn(m40_gpu *g, const glayer *L, int32_t n, const gnorm_in *nin, const float *x_res, char *err,
                   size_t errlen)
{
    const m40_model_params *p = &g->p;
    const int E = p->n_experts, k = p->n_experts_used, F = p->expert_ffn_dim, D = p->dim;
    const int act = g->sc.act == M40_ACT_SWIGLU_OAI ? M40K_GLU_SWIGLU_OAI : M40K_GLU_SILU;
    const int gating = g->sc.gating == M40_GATING_SIGMOID           ? M40K_MOE_SIGMOID
                       : g->sc.gating == M40_GATING_SOFTMAX_SELECTED ? M40K_MOE_SOFTMAX_TOPK
                                                                     : M40K_MOE_SOFTMAX;
    const int32_t slice = moe_rows_max(g);
    for (int32_t r0 = 0; r0 < n; r0 += slice) {
        const int32_t m = n - r0 < slice ? n - r0 : slice;
        const int P = m * k;
        const float *x = g->xb + (size_t)r0 * D;
        float *out = g->xd + (size_t)r0 * D;
        if (nin)
            CK(m40k_moe_router_logits_normed(L->router, L->router_b, E, D, x_res, D, L->ffn_norm, nin->ss, nin->eps, m,
                                             g->moe_logits, g->stream));
        else
            CK(m40k_moe_router_logits(L->router, L->router_b, E, D, x, D, m, g->moe_logits, g->stream));
        CK(m40k_moe_topk(g->moe_logits, m, E, k, gating, NULL, g->sc.norm_topk, g->sc.expert_scale, g->moe_ids,
                         g->moe_w, g->stream));
        if (!moe_grouped(g, L, m)) {
            /* on int8 records (10c', 10d'): x's, written by the add + RMSNorm before
             * (enqueue_step), and h's, by the gate/up kernel where the down GEMV reads them */
            const int q8 = moe_q8(g, L, m), q8_down = q8 && m40k_moe_down_q8_supported(L->exp_down.type, F);
            if (q8)
                CK(m40k_moe_gate_up_q8_normed(L->exp_gate.data, L->exp_up.data, L->exp_gate.type, E, F, D,
                                              L->exp_gate_b, L->exp_up_b, act, nin ? nin->xq : g->xq,
                                              nin ? nin->ss : NULL, nin ? nin->eps : 0.0f, g->moe_ids, m, k, g->moe_h,
                                              g->moe_ldh, q8_down ? g->moe_hq : NULL, g->stream));
            else
                CK(m40k_moe_gate_up(L->exp_gate.data, L->exp_up.data, L->exp_gate.type, E, F, D, L->exp_gate_b,
                                    L->exp_up_b, act, x, D, g->moe_ids, m, k, g->moe_h, g->moe_ldh, g->stream));
            if (q8_down)
                CK(m40k_moe_down_q8(L->exp_down.data, L->exp_down.type, E, D, F, L->exp_down_b, g->moe_hq, g->moe_ids,
                                    g->moe_w, m, k, out, D, 0, g->stream));
            else
                CK(m40k_moe_down(L->exp_down.data, L->exp_down.type, E, D, F, L->exp_down_b, g->moe_h, g->moe_ldh,
                                 g->moe_ids, g->moe_w, m, k, out, D, 0, g->stream));
            continue;
        }
        /* block rows of the grouped product by the pairs an expert gets on average (as
         * tests/gpu/test_moe.cu measures it): fewer wasted rows in each expert's last tile */
        const int bm = P / E <= 16 ? 16 : P / E <= 32 ? 32 : 64, mt = m40k_moe_max_tiles(P, E, bm);
        CK(m40k_moe_group(g->moe_ids, P, E, bm, g->moe_counts, g->moe_offsets, g->moe_perm, g->moe_inv, g->moe_tiles,
                          g->stream));
        CK(m40k_moe_gather_f16(x, D, D, g->moe_perm, P, k, g->moe_x16, g->moe_ldx, g->stream));
        CK(m40k_moe_gemm_q(L->exp_gate.data, L->exp_gate.type, E, F, D, g->moe_x16, g->moe_ldx, g->moe_offsets,
                           g->moe_tiles, mt, bm, g->moe_yg, F, g->stream));
        CK(m40k_moe_gemm_q(L->exp_up.data, L->exp_up.type, E, F, D, g->moe_x16, g->moe_ldx, g->moe_offsets,
                           g->moe_tiles, mt, bm, g->moe_yu, F, g->stream));
        CK(m40k_moe_glu_sorted(act, g->moe_yg, g->moe_yu, F, L->exp_gate_b, L->exp_up_b, g->moe_ids, g->moe_perm, P,
                               F, g->moe_h16, g->moe_ldh, g->stream));
        CK(m40k_moe_gemm_q(L->exp_down.data, L->exp_down.type, E, D, F, g->moe_h16, g->moe_ldh, g->moe_offsets,
                           g->moe_tiles, mt, bm, g->moe_yd, D, g->stream));
        CK(m40k_moe_combine(g->moe_yd, D, g->moe_inv, g->moe_ids, g->moe_w, L->exp_down_b, E, m, k, D, out, D, 0,
                            g->stream));
    }
    return 0;
}

/* A tensor-parallel rank's head: its vocabulary rows into its piece of the logits, every
 * rank's piece gathered, and on rank 0 the pieces laid side by side into the logits. */
static int tp_head(m40_gpu *g, int32_t n_out, int xq_ready, int x16_ready, char *err, size_t errlen)
{
    const int64_t S = g->tp_vocab_stride, V = g->p.n_vocab;
    if (matmul_one(g, &g->output, g->xg, n_out, g->tp_logits, S, &xq_ready, &x16_ready, NULL, NULL, err, errlen))
        return -1;
    if (g->sc.logit_softcap > 0)
        CK(m40k_softcap(g->tp_logits, (int64_t)n_out * S, g->sc.logit_softcap, g->stream));
    CK(m40_gpu_tp_all_gather(g, g->tp_logits, g->tp_gather, (size_t)n_out * (size_t)S));
    for (int r = 0; g->tp_rank == 0 && r < g->tp_n; r++) {
        const int64_t c0 = (int64_t)r * S, w = r + 1 < g->tp_n ? S : V - c0;
        CK(cudaMemcpy2DAsync(g->logits_d + c0, (size_t)V * 4, g->tp_gather + (size_t)r * (size_t)n_out * (size_t)S,
                             (size_t)S * 4, (size_t)w * 4, (size_t)n_out, cudaMemcpyDeviceToDevice, g->stream));
    }
    return 0;
}

/* Enqueues a step's device work, embedding to logits (in g->logits_d), on g->stream:
 * kernel launches and cuBLAS calls only, nothing that waits on the host, so that a
 * decode step can be captured into a CUDA graph as it is. */
static int enqueue_pass(m40_gpu *g, m40_gpu_kv *kv, const step_plan *sp, char *err, size_t errlen)
{
    const m40_model_params *p = &g->p;
    const int32_t n = sp->n, n_dec = sp->n_dec, n_grp = sp->n_grp, n_out = sp->n_out;
    const int tuned = sp->tuned, splits = sp->splits, splits_local = sp->splits_local;
    const int32_t *d_tok = sp->d_tok, *d_pos = sp->d_pos, *d_rs = sp->d_rs, *d_qi = sp->d_qi, *d_ip = sp->d_ip,
                  *d_lpl = sp->d_lpl, *d_out = sp->d_out, *d_idx = sp->d_idx;
    const int hd = p->head_dim;
    const int window = g->sc.window;
    const float scale = g->sc.attn_scale, cap = g->sc.attn_softcap;
    const int64_t dim = p->dim, qkvd = g->qkv_dim, ffn = p->ffn_dim;

    CK(m40k_embed(g->tok_embd.data, g->tok_embd.type, g->tok_embd.rows, (int)dim, d_tok, n, g->x, M40K_TYPE_F32, dim,
                  g->stream));
    if (g->sc.embd_scale != 1.0f)
        CK(m40k_scale(g->x, (int64_t)n * dim, g->sc.embd_scale, g->stream));
    /* The residual stream: xc, the other buffer xo (add_norm writes xc + xd there and
     * swaps them); the layers' outputs go to xd, the normalized inputs to xb. */
    float *xc = g->x, *xo = g->x2;
    /* folded: the last GEMV added its output into the residual and wrote the next
     * product's normalized input (g->xq2, g->nss: nin) itself (kernels.h 8d) */
    int folded = 0;
    int res_added = 0; /* the last down projection added into xc itself (matmul_tiled) */
    const gnorm_in nin = {g->xq2, g->nss, p->norm_eps};
    /* Every row wants logits, one row a sequence (decode steps): see the end (not under
     * batch invariance: every step's last norm then takes one kernel, the gathered rows') */
    const int out_all = !g->invariant && p->n_layers > 0 && n_out == n && n_grp == n;
    int cs_made[2] = {0, 0}; /* the RoPE angle tables of this step's prompt rows (global, local layers) */
    for (int32_t l = 0; l < p->n_layers; l++) {
        const glayer *L = &g->layers[l];
        uint16_t *kc = kv->k + (size_t)l * kv->layer_elems, *vc = kv->v + (size_t)l * kv->layer_elems;
        /* local layers have their own RoPE base (no frequency factors) and a window;
         * global ones the file's base and factors, optionally linearly scaled */
        const int win = L->local ? window : 0;
        const float base = L->local ? g->sc.local_base : p->rope_base;
        const float *ff = L->local ? g->rope_ff_local : g->rope_ff_global ? g->rope_ff_global : g->rope_ff;
        /* the previous layer's FFN residual is still in xd: added here, fused with this norm
         * (and with the int8 quantization of its output when the GEMV takes that) */
        const int xq_qkv = wants_xq(g, &L->qkv, n), x16_qkv = wants_x16(g, &L->qkv, n);
        /* l == 0 or the previous down projection added into xc itself (res_added): the
         * norm alone, into the F16 copy where qkv reads it */
        if (l == 0 || res_added)
            CK(norm_res(g, xc, L->attn_norm, g->xb, n, x16_qkv));
        else if (!folded) /* else the previous layer's down projection did it (kernels.h 8d) */
            CK(add_norm(g, &xc, &xo, L->attn_norm, g->xb, n, xq_qkv, x16_qkv));
        /* the decode attention adds the decode rows' q/k/v biases itself (kernels.h 6e): the
         * product without them, then the other rows' added apart */
        const float *qkv_b = L->qkv.bias;
        const int32_t b0 = qkv_b && tuned && n_dec > 0 ? n_dec : 0;
        gproj qkv_nb = L->qkv;
        if (b0 > 0)
            qkv_nb.bias = NULL;
        if (matmul(g, &qkv_nb, g->xb, n, g->qkv, l > 0 && !res_added && xq_qkv, x16_qkv, folded ? &nin : NULL, err,
                   errlen))
            return -1;
        if (b0 > 0 && n > b0)
            CK(m40k_add_bias(g->qkv + (size_t)b0 * qkvd, qkvd, qkv_b, n - b0, (int)qkvd, g->stream));
        res_added = 0;
        float *q = g->qkv, *k = g->qkv + g->q_dim, *v = g->qkv + g->q_dim + g->kv_dim;
        /* Decode rows (the first n_dec, one per sequence): the decode attention kernel
         * normalizes their Q and K heads where the layer has Q/K norms, rotates them (RoPE)
         * and appends their K and V to the cache itself. The other rows: the per-head norms
         * in one launch (k follows q), then RoPE on Q in place and on K on its way into the
         * cache, one launch (k in qkv stays unrotated: the attention kernels read K from
         * the cache only). */
        const int32_t r0 = tuned ? n_dec : 0;
        if (L->q_norm && n > r0)
            CK(m40k_rmsnorm_qk(q + (size_t)r0 * qkvd, qkvd, p->n_heads, p->n_kv_heads, hd, L->q_norm, L->k_norm,
                               n - r0, p->norm_eps, g->stream));
        /* A step of decode rows only whose attention output projection takes int8 x: the
         * attention's cluster merge writes those records too, where it can (xq_wo; no
         * quantization launch between the two) */
        const int xq_wo = tuned && n_dec == n && wants_xq(g, &L->wo, n) &&
                          m40k_attn_decode_q8_ok(n_dec, p->n_heads, p->n_kv_heads, hd, win ? splits_local : splits);
        /* A step of decode rows only whose output projection reads an F16 copy of x (the
         * register kernel, cuBLAS): the decode attention writes that copy too (kernels.h
         * 6e; no conversion launch) */
        const int att16d = tuned && n_dec == n && n_dec > 0 && !xq_wo && wants_x16(g, &L->wo, n);
        if (tuned && n_dec > 0) {
            const m40k_dec_opts dop = {.out_q8 = xq_wo ? g->xq : NULL,
                                       .sinks = L->sinks,
                                       .bias_q = b0 ? qkv_b : NULL,
                                       .bias_k = b0 ? qkv_b + g->q_dim : NULL,
                                       .bias_v = b0 ? qkv_b + g->q_dim + g->kv_dim : NULL,
                                       .q_norm = L->q_norm,
                                       .k_norm = L->k_norm,
                                       .norm_eps = p->norm_eps,
                                       .out16 = att16d ? g->x16 : NULL,
                                       .plain = g->invariant};
            CK(m40k_attn_decode_rope(g->att, g->q_dim, q, qkvd, k, qkvd, v, qkvd, kc, vc, d_ip, d_idx, d_lpl, n_dec,
                                     p->n_heads, p->n_kv_heads, hd, scale, win, cap, d_pos, p->rope_dim, base, ff,
                                     p->rope_neox, win ? splits_local : splits, g->ws, g->att_cnt, &dop, g->stream));
        }
        if (n > r0) { /* the slices' tables keep their absolute offsets: the kernel takes them so */
            /* the angles of these rows, once a step for each kind of layer (kernels.h 5c) */
            const int lc = L->local != 0;
            if (p->rope_dim > 0 && !cs_made[lc]) {
                CK(m40k_rope_table(d_pos + r0, n - r0, p->rope_dim, base, ff, g->rope_cs[lc], g->stream));
                cs_made[lc] = 1;
            }
            CK(m40k_kv_append_rope_tab(q + (size_t)r0 * qkvd, qkvd, p->n_heads, kc, vc, k + (size_t)r0 * qkvd, qkvd,
                                       v + (size_t)r0 * qkvd, qkvd, d_qi + r0, n_grp - r0, n - r0, d_ip + r0, d_idx,
                                       d_lpl + r0, p->n_kv_heads, hd, p->rope_dim, g->rope_cs[lc], p->rope_neox,
                                       g->stream));
        }
        /* A step of prompt rows only whose output projection reads an F16 copy of x: the
         * tensor-core attention writes that copy itself (kernels.h 7f; no F32 output and
         * no conversion; M40_PREFILL_F16=0: not) */
        const int att16 = tuned && n_dec == 0 && g->prefill_f16 && x16_only(wants_x16(g, &L->wo, n), n) &&
                          m40k_attn_prefill_tc_supported(hd);
        if (att16)
            CK(m40k_attn_prefill_tc_split_sinks_h16(g->x16, g->q_dim, q, qkvd, d_qi, n_grp, n, kc, vc, d_ip, d_idx,
                                                    d_lpl, p->n_heads, p->n_kv_heads, hd, scale, win, cap,
                                                    win ? sp->psplits_local : sp->psplits, g->ws, L->sinks,
                                                    g->stream));
        else if (tuned && n_dec < n_grp) /* q_indptr and indptr hold absolute offsets: the tail slices work */
            CK(m40k_attn_prefill_auto_split_sinks(g->att, g->q_dim, q, qkvd, d_qi + n_dec, n_grp - n_dec, n - n_dec, kc,
                                                  vc, d_ip + n_dec, d_idx, d_lpl + n_dec, p->n_heads, p->n_kv_heads, hd,
                                                  scale, win, cap, win ? sp->psplits_local : sp->psplits, g->ws,
                                                  L->sinks, g->stream));
        if (!tuned)
            CK(m40k_attn_generic_sinks(g->att, g->q_dim, q, qkvd, d_rs, d_pos, n, kc, vc, d_ip, d_idx, p->n_heads,
                                       p->n_kv_heads, hd, scale, win, cap, L->sinks, g->stream));
        const int xq_gu = wants_xq(g, &L->gate_up, n) || moe_q8(g, L, n), xq_dn = wants_xq(g, &L->down, n);
        const int x16_gu = wants_x16(g, &L->gate_up, n), x16_dn = wants_x16(g, &L->down, n);
        folded = L->router ? moe_fold_ok(g, L, n)
                           : fold_norm_ok(g, &L->wo, L->post_attn_norm, L->gate_up.part, L->gate_up.n_parts, n);
        const int ffn_folded = folded; /* (folded then turns to the FFN's own fold) */
        if (folded) { /* the attention output projection adds into the residual and normalizes */
            if (!xq_wo)
                CK(m40k_quantize_q8(g->att, g->q_dim, (int)g->q_dim, n, g->xq, g->stream));
            CK(gemv_add_norm(g, &L->wo, &xc, &xo, L->ffn_norm));
        } else if (res_fuse_ok(g, &L->wo, n, L->post_attn_norm, xq_gu)) {
            if (matmul_tiled(g, &L->wo, g->att, n, xc, NULL, att16 || att16d, err, errlen))
                return -1;
            CK(norm_res(g, xc, L->ffn_norm, g->xb, n, x16_gu));
        } else {
            if (matmul(g, &L->wo, g->att, n, g->xd, xq_wo, att16 || att16d, NULL, err, errlen))
                return -1;
            if (g->tp_n > 1) /* each rank holds its heads' part of the sum */
                CK(m40_gpu_tp_reduce_xd(g, (size_t)n * (size_t)dim));
            if (L->post_attn_norm)
                CK(m40k_rmsnorm(g->xd, dim, L->post_attn_norm, g->xd, M40K_TYPE_F32, dim, n, (int)dim, p->norm_eps,
                                g->stream));
            CK(add_norm(g, &xc, &xo, L->ffn_norm, g->xb, n, xq_gu, x16_gu));
        }
        /* a prompt chunk's gate/up product in F16 for the GLU (glu_h16_ok) */
        const int h16 = !L->router && glu_h16_ok(g, &L->gate_up, n, x16_dn);
        if (h16) {
            if (matmul_tiled(g, &L->gate_up, g->xb, n, NULL, (uint16_t *)g->hb, x16_gu, err, errlen))
                return -1;
        } else if (!L->router &&
                   matmul(g, &L->gate_up, g->xb, n, g->hb, xq_gu, x16_gu, folded ? &nin : NULL, err, errlen)) {
            return -1;
        }
        const int act = g->sc.act == M40_ACT_GELU_TANH ? M40K_GLU_GELU_TANH : M40K_GLU_SILU;
        /* F16 down projection on the tensor-core GEMV: it forms act(gate) * up itself */
        const gmat *dw = &L->down.part[0];
        folded = 0;
        if (L->router) { /* the layer's mixture of experts instead (its gate_up and down are empty) */
            if (moe_ffn(g, L, n, ffn_folded ? &nin : NULL, xc, err, errlen))
                return -1;
        } else if (L->down.n_parts == 1 && !L->down.bias && skinny_reads(g, dw, n)) {
            const int S = m40k_gemm_skinny_pick_splits((int)dw->rows, (int)dw->cols, n, g->sm_count, g->sk_ws_floats,
                                                       g->sk_cnt_ints);
            CK(m40k_gemm_skinny_glu(act, (const uint16_t *)dw->data, (int)dw->rows, (int)dw->cols, g->hb, g->hb + ffn,
                                    2 * ffn, n, g->xd, dim, S, g->sk_ws, g->sk_cnt, g->stream));
        } else {
            if (h16)
                CK(m40k_glu_h16(act, (const uint16_t *)g->hb, (const uint16_t *)g->hb + ffn, 2 * ffn, GLU_H16_SCALE,
                                g->x16, n, (int)ffn, g->stream));
            else if (xq_dn)
                CK(m40k_glu_q8(act, g->hb, g->hb + ffn, 2 * ffn, g->hb2, ffn, n, (int)ffn, g->xq, g->stream));
            else if (x16_dn)
                CK(m40k_glu_f16(act, g->hb, g->hb + ffn, 2 * ffn, x16_only(x16_dn, n) ? NULL : g->hb2, ffn, n,
                                (int)ffn, g->x16, g->stream));
            else
                CK(m40k_glu(act, g->hb, g->hb + ffn, 2 * ffn, g->hb2, ffn, n, (int)ffn, g->stream));
            /* the next layer's attention norm (the last layer: the final norm, when the
             * step's one row wants logits) folded into this projection (kernels.h 8d) */
            const int last = l + 1 == p->n_layers;
            folded = xq_dn && (last ? out_all && fold_norm_ok(g, &L->down, L->post_ffw_norm, &g->output, 1, n)
                                    : fold_norm_ok(g, &L->down, L->post_ffw_norm, g->layers[l + 1].qkv.part,
                                                   g->layers[l + 1].qkv.n_parts, n));
            /* not the last layer's: the end of the pass adds and norms as it does */
            res_added = !folded && !last &&
                        res_fuse_ok(g, &L->down, n, L->post_ffw_norm, wants_xq(g, &g->layers[l + 1].qkv, n));
            if (folded)
                CK(gemv_add_norm(g, &L->down, &xc, &xo, last ? g->output_norm : g->layers[l + 1].attn_norm));
            else if (res_added) {
                if (matmul_tiled(g, &L->down, g->hb2, n, xc, NULL, x16_dn, err, errlen))
                    return -1;
            } else if (matmul(g, &L->down, g->hb2, n, g->xd, xq_dn, x16_dn, NULL, err, errlen))
                return -1;
        }
        if (g->tp_n > 1) /* each rank holds its FFN units' part of the sum */
            CK(m40_gpu_tp_reduce_xd(g, (size_t)n * (size_t)dim));
        if (L->post_ffw_norm)
            CK(m40k_rmsnorm(g->xd, dim, L->post_ffw_norm, g->xd, M40K_TYPE_F32, dim, n, (int)dim, p->norm_eps,
                            g->stream));
    }
    /* Every row wants logits, one row a sequence (decode steps): the rows are in order
     * (d_out is 0..n-1), so the last residual add, the gather and the final norm are one
     * add+RMSNorm into xg (quantized on the way for an int8-activation head). */
    int xq_ready = 0, x16_ready = 0;
    if (p->n_layers > 0 && !out_all) /* the last layer's FFN residual */
        CK(m40k_add(xc, xc, g->xd, (int64_t)n * dim, g->stream));
    /* out_all && folded: the last down projection did the final add + norm (kernels.h 8d) */
    if (out_all && !folded) {
        xq_ready = gemv_batch(g, &g->output, n) && gemv_q8_reads(&g->output);
        CK(add_norm(g, &xc, &xo, g->output_norm, g->xg, n, xq_ready, 0));
    }
    if (n_out > 0) {
        if (!out_all) {
            CK(m40k_gather_rows(g->xg, dim, xc, dim, d_out, n_out, (int)dim, g->stream));
            CK(m40k_rmsnorm(g->xg, dim, g->output_norm, g->xg, M40K_TYPE_F32, dim, n_out, (int)dim, p->norm_eps,
                            g->stream));
        }
        if (g->tp_n > 1)
            return tp_head(g, n_out, xq_ready, x16_ready, err, errlen);
        /* sp->d_key: the head's int8 GEMV also picks the greedy token (kernels.h 9c) */
        if (matmul_one(g, &g->output, g->xg, n_out, g->logits_d, p->n_vocab, &xq_ready, &x16_ready,
                       out_all && folded ? &nin : NULL, sp->d_key, err, errlen))
            return -1;
        if (g->sc.logit_softcap > 0)
            CK(m40k_softcap(g->logits_d, (int64_t)n_out * p->n_vocab, g->sc.logit_softcap, g->stream));
    }
    return 0;
}

/* enqueue_pass; under tensor parallelism a step that fits the symmetric buffers (tp_sym)
 * has its layers' outputs written there instead of into xd, each all-reduce moving them
 * from one buffer to the other (m40_gpu_tp_reduce_xd). Two all-reduces a layer: every
 * step starts from the same buffer, so a CUDA graph captured once replays right. */
static int enqueue_step(m40_gpu *g, m40_gpu_kv *kv, const step_plan *sp, char *err, size_t errlen)
{
    float *const own = g->xd;
    if (g->tp_sym[0] && (int64_t)sp->n * g->p.dim <= g->tp_sym_floats)
        g->xd = g->tp_sym[0];
    const int rc = enqueue_pass(g, kv, sp, err, errlen);
    g->xd = own;
    return rc;
}

/* Runs a step's device work (enqueue_step). A pure decode step of at most g->graph_max
 * sequences goes through a CUDA graph of its shape: the first step of a shape runs as
 * plain launches (kernels load and lazy setup happens outside any capture), the second
 * is captured and instantiated, and from then on each step of that shape is one graph
 * launch (the GPU takes the whole step's ~300 kernels, their PDL edges included, as one
 * unit of work). Per-step data reaches the kernels through the device tables only, and
 * the split counts are taken from a bucketed length (step_plan.c), so the same
 * graph serves every step of the shape. A failed capture is logged once and that shape
 * keeps plain launches. */
static int run_step(m40_gpu *g, m40_gpu_kv *kv, const step_plan *sp, char *err, size_t errlen)
{
    if (g->graph_max <= 0 || sp->n > g->graph_max || !sp->tuned || sp->n_dec != sp->n || sp->n_grp != sp->n)
        return enqueue_step(g, kv, sp, err, errlen);
    gstep_graph *e = NULL, *lru = &g->graphs[0];
    for (int i = 0; i < M40_GRAPH_SLOTS && !e; i++) {
        gstep_graph *c = &g->graphs[i];
        if (c->seen && c->n == sp->n && c->n_out == sp->n_out && c->splits == sp->splits &&
            c->splits_local == sp->splits_local && c->pick == (sp->d_key != NULL) && c->kv_k == (const void *)kv->k && c->kv_v == (const void *)kv->v && c->kv_layer == kv->layer_elems)
            e = c;
        else if (c->used < lru->used)
            lru = c;
    }
    g->graph_tick++;
    if (!e) { /* first sight: plain launches, remembered */
        if (lru->exec)
            cudaGraphExecDestroy(lru->exec);
        *lru = (gstep_graph){.n = sp->n, .n_out = sp->n_out, .splits = sp->splits, .splits_local = sp->splits_local, .pick = sp->d_key != NULL,
                             .kv_k = kv->k, .kv_v = kv->v, .kv_layer = kv->layer_elems, .seen = 1, .used = g->graph_tick};
        return enqueue_step(g, kv, sp, err, errlen);
    }
    e->used = g->graph_tick;
    if (!e->exec && !e->failed) {
        char cerr[256] = "";
        cudaGraph_t graph = NULL;
        cudaError_t ce = cudaStreamBeginCapture(g->stream, cudaStreamCaptureModeThreadLocal);
        int rc = ce == cudaSuccess ? enqueue_step(g, kv, sp, cerr, sizeof cerr) : -1;
        if (ce == cudaSuccess) {
            cudaError_t ee = cudaStreamEndCapture(g->stream, &graph);
            if (ee != cudaSuccess)
                ce = ee;
        }
        if (rc == 0 && ce == cudaSuccess && graph)
            ce = cudaGraphInstantiateWithFlags(&e->exec, graph, 0);
        if (graph)
            cudaGraphDestroy(graph);
        if (rc != 0 || ce != cudaSuccess || !e->exec) {
            (void)cudaGetLastError(); /* the capture's error: nothing ran, the plain launches follow */
            e->exec = NULL;
            e->failed = 1;
            fprintf(stderr, "m40: gpu %d: no CUDA graph for decode steps of %d sequences (%s); they run without one\n",
                    g->device, (int)sp->n, rc != 0 ? cerr : cudaGetErrorString(ce));
        } else {
            g->graph_captures++;
        }
    }
    if (!e->exec)
        return enqueue_step(g, kv, sp, err, errlen);
    CK(cudaGraphLaunch(e->exec, g->stream));
    g->graph_launches++;
    return 0;
}

/* A tensor-parallel step: every rank plans it on its own card from the shared pool's
 * tables (the same blocks) and runs its forward pass on its shard, the ranks meeting in
 * NCCL's collectives (tp.c). Everything a rank can fail on (scratch, the tables' upload)
 * is done by all ranks before any runs, so that no rank enqueues a collective that
 * another will never join. Rank 0's plan comes back in sp; its stream is left running
 * (the caller samples and copies after it), the others' are synchronized, so their
 * host staging is free for the next step. */
typedef struct {
    m40_gpu_kv *kv0;
    const m40_batch *b;
    int32_t n_out;
    step_plan sp[64];
} tp_step_job;

static m40_gpu_kv *tp_rank_kv(m40_gpu_kv *kv0, const m40_gpu *g)
{
    return g->tp_rank == 0 ? kv0 : kv0->tp_kv[g->tp_rank];
}

static int tp_prepare(m40_gpu *g, void *ctx, char *err, size_t errlen)
{
    tp_step_job *j = ctx;
    if (ensure_scratch(g, j->b->n, j->n_out)) {
        m40_set_err(err, errlen, "gpu %d: out of memory for a batch of %d tokens", g->device, (int)j->b->n);
        return -1;
    }
    step_plan *sp = &j->sp[g->tp_rank];
    if (m40_gpu_plan_step(g, m40_paged_kv_step(j->kv0->pool), j->b, j->n_out, sp, err, errlen))
        return -1;
    sp->d_key = NULL;
    return 0;
}

static int tp_run(m40_gpu *g, void *ctx, char *err, size_t errlen)
{
    tp_step_job *j = ctx;
    if (run_step(g, tp_rank_kv(j->kv0, g), &j->sp[g->tp_rank], err, errlen))
        return -1;
    if (g->tp_rank > 0)
        CK(cudaStreamSynchronize(g->stream));
    return 0;
}

static int tp_step(m40_gpu *g, m40_gpu_kv *kv, const m40_batch *b, int32_t n_out, step_plan *sp, char *err,
                   size_t errlen)
{
    if (g->tp_n > 64 || !kv->tp_kv) {
        m40_set_err(err, errlen, "gpu %d: the KV pool was made for another model", g->device);
        return -1;
    }
    tp_step_job j = {.kv0 = kv, .b = b, .n_out = n_out}; /* a few KB, on the engine thread's stack */
    int rc = m40_gpu_tp_run(g, tp_prepare, &j, 0, err, errlen);
    if (rc == 0)
        rc = m40_gpu_tp_run(g, tp_run, &j, 1, err, errlen);
    if (rc == 0)
        *sp = j.sp[0];
    return rc;
}

int m40_gpu_forward(m40_gpu *g, m40_gpu_kv *kv, const m40_batch *b, float *logits, char *err, size_t errlen)
{
    const m40_model_params *p = &g->p;
    const int32_t n = b->n;
    cudaSetDevice(g->device);
    /* The blocks of the batch's new positions: reserved by the caller for this very
     * batch (m40_kv_reserve, the scheduler's question before the step) or here. */
    const int reserved = m40_paged_kv_claim(kv->pool, n, b->tokens, b->pos, b->slot);

    int32_t n_out = 0;
    for (int32_t i = 0; i < n; i++)
        n_out += b->want_logits ? b->want_logits[i] != 0 : i == n - 1;
    if (ensure_scratch(g, n, n_out)) {
        m40_set_err(err, errlen, "gpu %d: out of memory for a batch of %d tokens", g->device, (int)n);
        return -1;
    }
    if (!reserved) {
        int rc = m40_paged_kv_reserve(kv->pool, n, b->tokens, b->pos, b->slot, err, errlen);
        if (rc != 0)
            return rc; /* M40_KV_NO_BLOCKS is M40_FORWARD_NO_BLOCKS */
        m40_paged_kv_claim(kv->pool, n, b->tokens, b->pos, b->slot);
    }
    step_plan sp;
    /* one greedy row whose head runs on the int8 GEMV: the pick is folded into it */
    const int pick = !g->tp && b->argmax && !b->sample && n_out == 1 && g->fuse_pick &&
                     gemv_q8_reads(&g->output) && !(g->sc.logit_softcap > 0);
    if (g->tp) {
        if (tp_step(g, kv, b, n_out, &sp, err, errlen))
            return -1;
    } else {
        if (m40_gpu_plan_step(g, m40_paged_kv_step(kv->pool), b, n_out, &sp, err, errlen))
            return -1;
        sp.d_key = pick ? (uint64_t *)g->ints_d : NULL;
        if (run_step(g, kv, &sp, err, errlen))
            return -1;
    }
    if (n_out > 0) {
        if (pick) {
            CK(cudaMemcpyAsync(g->logits_h, sp.d_key, 8, cudaMemcpyDeviceToHost, g->stream));
        } else if (b->argmax && b->sample) { /* each row drawn on the device: n_out ids come back */
            for (int32_t k = 0; k < n_out; k++)
                m40_row_sample_params(&b->sample[k], &g->samp_h[k]);
            CK(cudaMemcpyAsync(g->samp_d, g->samp_h, (size_t)n_out * sizeof *g->samp_d, cudaMemcpyHostToDevice,
                               g->stream));
            CK(m40k_sample(g->logits_d, p->n_vocab, n_out, p->n_vocab, g->samp_d, NULL, NULL, NULL, NULL, NULL, NULL,
                           g->pick_d, (float *)(g->pick_d + g->cap_out), 0, NULL, NULL, g->stream));
            CK(cudaMemcpyAsync(g->logits_h, g->pick_d, (size_t)n_out * 4, cudaMemcpyDeviceToHost, g->stream));
        } else if (b->argmax) { /* greedy on the device: n_out ids come back instead of the rows */
            CK(m40k_sample_greedy(g->logits_d, p->n_vocab, n_out, p->n_vocab, g->pick_d,
                                  (float *)(g->pick_d + g->cap_out), 0, NULL, NULL, g->stream));
            CK(cudaMemcpyAsync(g->logits_h, g->pick_d, (size_t)n_out * 4, cudaMemcpyDeviceToHost, g->stream));
        } else {
            CK(cudaMemcpyAsync(g->logits_h, g->logits_d, (size_t)n_out * p->n_vocab * 4, cudaMemcpyDeviceToHost,
                               g->stream));
        }
    }
    if (g->time_steps)
        CK(cudaEventRecord(g->step_ev[1], g->stream));
    CK(cudaStreamSynchronize(g->stream));
    if (g->tp_ev_used)
        m40_gpu_tp_time_step(g);
    if (g->time_steps) {
        float ms = 0.0f;
        if (cudaEventElapsedTime(&ms, g->step_ev[0], g->step_ev[1]) == cudaSuccess) {
            g->step_gpu_ms += ms;
            g->steps_timed++;
        }
    }
    if (pick) {
        uint64_t key;
        memcpy(&key, g->logits_h, sizeof key);
        b->argmax[0] = m40k_argmax_key_id(key);
    } else if (n_out > 0 && !b->argmax && b->logits_at) {
        *b->logits_at = g->logits_h; /* the caller reads the pinned rows where they landed */
    } else if (n_out > 0)
        memcpy(b->argmax ? (void *)b->argmax : (void *)logits, g->logits_h,
               b->argmax ? (size_t)n_out * 4 : (size_t)n_out * p->n_vocab * 4);
    /* Every position of the batch is computed: with the prefix cache, each block that is
     * now full is registered under its token prefix (or merged into an identical cached
     * block; block ids may change, the next call re-exports the tables). */
    m40_paged_kv_commit(kv->pool);
    return 0;
}

#endif /* M40_HAVE_CUDA */
