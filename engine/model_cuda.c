/* The GPU back end of the llama-family forward pass (llama, qwen2) and of Gemma 3: host
 * code in C11 that drives the kernels of kernels/ through their C wrappers, plus cuBLAS.
 *
 * Gemma 3 (src->gemma3 set; the math is model_gemma3.c's) is the same pipeline plus:
 * the embedding scaled by sqrt(n_embd), per-head RMSNorm of Q and K after the QKV
 * product, the attention and FFN outputs RMSNorm'ed before their residual adds, GeGLU
 * (tanh) instead of SwiGLU, its own attention scale, and per layer either a global
 * layer (the file's RoPE base, linear scaling as freq factors) or a local one (the
 * local base, attention limited to the last `window` positions by the *_window
 * attention kernels; the cache keeps every position, as on the CPU).
 *
 * Shape of a forward call (one call per scheduler step, any mix of slots):
 *   - the batch's rows are grouped by slot (stable), so each sequence's new tokens are
 *     contiguous: that is the CSR layout every paged kernel takes (q_indptr = rows of
 *     sequence s, indptr/indices/last_page_len = its KV blocks);
 *   - blocks are reserved from the engine/kv_blocks manager for every slot's new
 *     positions first; when the pool cannot hold them the call returns -2 before
 *     anything is written (the scheduler preempts and retries);
 *   - the manager's prefix cache is on (M40_PREFIX_CACHE=0 turns it off): a slot may
 *     start on cached blocks (m40_gpu_kv_match_prefix, its first position then being
 *     the matched length), and after the step every block that became full is
 *     committed under the slot's real token ids, kept per slot in kv->toks;
 *   - the small integer tables (tokens, positions, CSR) go up in one copy from pinned
 *     memory; then per layer: RMSNorm (fused with the previous layer's residual add)
 *     -> fused QKV matmul (+bias) -> RoPE -> paged KV append -> attention (the decode
 *     kernel, split-K, for the sequences with one new token, which come first in the
 *     step; the prefill kernel for the prompt chunks; a plain kernel for other head
 *     sizes) -> output matmul -> residual add + RMSNorm -> fused gate/up matmul ->
 *     SwiGLU -> down matmul; everything stays on the device;
 *   - only the rows that want logits go through the final norm and the head; their
 *     logits come back to the host in the caller's row order.
 *
 * Matmuls (y = W x over n token rows):
 *   - F32 weights (the tiny test models): cublasSgemm;
 *   - n <= 8 and a type the GEMV kernels read: a GEMV, which streams each weight once
 *     for the whole decode batch: Q8_0, Q4_0, Q4_K, Q6_K (16-byte aligned) the dp4a
 *     GEMV on x quantized once per input to two int8 levels (m40k_quantize_q8,
 *     m40k_gemv_q8: per element within max|x of its block|/254^2); F16, Q4_1, Q5_0,
 *     Q5_1 the float-activation m40k_gemv;
 *   - otherwise the "tiled path": quantized weights are dequantized into an F16
 *     scratch matrix (the embedding-gather kernel over all rows), activations rounded
 *     to F16, and cublasGemmEx multiplies with F32 accumulation. A fused
 *     dequantize-in-the-tile GEMM is future work. Models under 1B parameters take it
 *     in F32 instead (weights dequantized to F32, cublasSgemm): see gemm_f32.
 * Weight types the kernels do not read (BF16, other K-quants) are converted to F16 on
 * upload. Q/K/V and gate/up are concatenated on upload when their types match, so
 * each pair/triple is one product.
 *
 * Built without CUDA (no M40_HAVE_CUDA), the entry points fail with a clear message. */
#include "model_gpu.h"
#include "model_internal.h"

#include <stdio.h>
#include <string.h>

#ifndef M40_HAVE_CUDA

int m40_gpu_load(const m40_gpu_src *src, int device, int log_progress, m40_gpu **out, char *err, size_t errlen)
{
    (void)src;
    (void)log_progress;
    *out = NULL;
    snprintf(err, errlen, "device %d was asked for, but this build has no CUDA support (configure found no "
             "CUDA toolkit); leave out the device to run on the CPU", device);
    return -1;
}
void m40_gpu_free(m40_gpu *g) { (void)g; }
m40_gpu_kv *m40_gpu_kv_new(m40_gpu *g, int32_t n_slots, int32_t ctx)
{
    (void)g, (void)n_slots, (void)ctx;
    return NULL;
}
void m40_gpu_kv_free(m40_gpu_kv *kv) { (void)kv; }
void m40_gpu_kv_slot_clear(m40_gpu_kv *kv, int32_t slot) { (void)kv, (void)slot; }
int32_t m40_gpu_kv_blocks_total(const m40_gpu_kv *kv) { (void)kv; return 0; }
int32_t m40_gpu_kv_blocks_free(const m40_gpu_kv *kv) { (void)kv; return 0; }
int m40_gpu_kv_prefix_cache_enabled(const m40_gpu_kv *kv) { (void)kv; return 0; }
int32_t m40_gpu_kv_match_prefix(m40_gpu_kv *kv, int32_t slot, const int32_t *tokens, int32_t n)
{
    (void)kv, (void)slot, (void)tokens, (void)n;
    return 0;
}
void m40_gpu_kv_prefix_stats(const m40_gpu_kv *kv, int64_t *queries, int64_t *query_tokens, int64_t *hit_tokens)
{
    (void)kv;
    *queries = *query_tokens = *hit_tokens = 0;
}
int m40_gpu_forward(m40_gpu *g, m40_gpu_kv *kv, const m40_batch *b, float *logits, char *err, size_t errlen)
{
    (void)g, (void)kv, (void)b, (void)logits;
    snprintf(err, errlen, "this build has no CUDA support");
    return -1;
}

#else /* M40_HAVE_CUDA */

#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <time.h>

#include "ggml_types.h"
#include "kernels.h"
#include "kv_blocks.h"
#include "model_aux.h"
#include "quant.h"

/* A weight matrix on the device. */
typedef struct {
    void *data;
    int type;            /* M40K_TYPE_* (GGUF numbering) */
    int64_t rows, cols;
    size_t row_bytes;
} gmat;

/* One product target: either one fused matrix, or up to 3 parts written side by side. */
typedef struct {
    gmat part[3];
    int n_parts;
    int64_t rows;        /* sum of the parts' rows */
    float *bias;         /* [rows] or NULL */
} gproj;

typedef struct {
    float *attn_norm, *ffn_norm;
    gproj qkv, wo, gate_up, down;
    float *q_norm, *k_norm, *post_attn_norm, *post_ffw_norm; /* gemma3; NULL otherwise */
    int local;                                               /* gemma3 sliding-window layer */
} glayer;

struct m40_gpu {
    int device;
    cudaStream_t stream;
    cublasHandle_t blas;
    int sm_count;
    m40_model_params p;
    int32_t q_dim, kv_dim, qkv_dim;
    gmat tok_embd, output;
    int output_shared;   /* output is tok_embd's buffer */
    float *output_norm, *rope_ff;
    glayer *layers;
    int gemma3;          /* arch gemma3: the extras below apply */
    m40_gpu_gemma3 g3;
    float *rope_ff_global; /* gemma3 with linear RoPE scaling: global_scale per frequency */
    size_t weight_bytes;

    /* Tiled path: F16 (F32 when gemm_f32) copy of one dequantized weight. */
    void *deq;
    int gemm_f32;        /* tiled products in F32 (SGEMM) rather than F16 tensor cores */
    size_t deq_elems, deq_cap;
    int32_t *iota;       /* 0..max_rows-1, the row ids the dequantizing gather takes */

    /* Per-forward scratch, grown on demand to cap tokens / cap_out logit rows. */
    int32_t cap, cap_out;
    float *x, *xb, *qkv, *att, *hb, *hb2, *xg, *logits_d;
    uint16_t *x16;
    void *xq;            /* m40k_quantize_q8 of the current GEMV input, batch <= 8 */
    float *ws;
    size_t ws_cap;
    int32_t *ints_d, *ints_h;
    size_t ints_cap;
    float *logits_h;
    int32_t *pick_d; /* greedy picks: cap_out ids, then cap_out logprobs */
    /* Host-side grouping scratch. */
    int32_t *perm, *grp_slot, *grp_first, *grp_n, *out_rows;
    m40_kv_seq **grp_seq;
    int32_t host_cap;
};

struct m40_gpu_kv {
    m40_gpu *g;
    int32_t n_slots, ctx, n_blocks;
    m40_kv_blocks *mgr;
    m40_kv_seq **seqs;
    uint16_t *k, *v;     /* [layer][block][kv_head][16][head_dim] */
    size_t layer_elems;  /* elements of one layer's K (or V) */
    int32_t *csr_indptr, *csr_lpl, *csr_indices;
    int32_t csr_cap;
    /* Prefix cache: the token id at every position of each slot (what m40_kv_seq_commit
     * keys the slot's full blocks by), grown with the slot's length. */
    int prefix_cache;
    int32_t **toks;
    int32_t *toks_cap;
};


static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* ---------------------------------------------------------------- upload ---- */

#define STAGE_BYTES ((size_t)32 << 20)

typedef struct {
    m40_gpu *g;
    uint8_t *stage[2];
    cudaEvent_t ev[2];
    int cur;
    size_t total, done, next_report;
    int log;
    double t0;
    cudaError_t status;
} uploader;

static int gpu_type_native(uint32_t t)
{
    return t == M40_TYPE_F32 || t == M40_TYPE_F16 || t == M40_TYPE_Q8_0 || t == M40_TYPE_Q4_0 ||
           t == M40_TYPE_Q4_1 || t == M40_TYPE_Q5_0 || t == M40_TYPE_Q5_1 || t == M40_TYPE_Q4_K ||
           t == M40_TYPE_Q6_K;
}

/* Bytes of a matrix once on the device (converted to F16 when not native). */
static size_t dev_bytes(const m40_matrix *m)
{
    return gpu_type_native(m->type) ? m->row_bytes * (size_t)m->rows : (size_t)m->rows * (size_t)m->cols * 2;
}

static void progress(uploader *u, size_t n)
{
    u->done += n;
    /* Small models: the summary line at the end says enough. */
    if (u->log && u->total >= ((size_t)256 << 20) && (u->done >= u->next_report || u->done == u->total)) {
        double dt = now_s() - u->t0;
        fprintf(stderr, "m40: gpu %d: uploading weights %3.0f%% (%.2f of %.2f GB, %.1f GB/s)\n", u->g->device,
                100.0 * (double)u->done / (double)(u->total ? u->total : 1), u->done / 1e9, u->total / 1e9,
                dt > 0 ? u->done / 1e9 / dt : 0.0);
        u->next_report = u->done + u->total / 10;
    }
}

/* Copies n bytes from host memory (the mmap) to dst through the pinned staging
 * buffers: while one chunk crosses the bus the next one is being filled. */
static int upload_bytes(uploader *u, void *dst, const uint8_t *src, size_t n)
{
    while (n > 0 && u->status == cudaSuccess) {
        size_t c = n < STAGE_BYTES ? n : STAGE_BYTES;
        int b = u->cur;
        u->cur ^= 1;
        if ((u->status = cudaEventSynchronize(u->ev[b])) != cudaSuccess)
            break;
        memcpy(u->stage[b], src, c);
        if ((u->status = cudaMemcpyAsync(dst, u->stage[b], c, cudaMemcpyHostToDevice, u->g->stream)) != cudaSuccess ||
            (u->status = cudaEventRecord(u->ev[b], u->g->stream)) != cudaSuccess)
            break;
        progress(u, c);
        dst = (uint8_t *)dst + c;
        src += c;
        n -= c;
    }
    return u->status == cudaSuccess ? 0 : -1;
}

/* A non-native matrix: rows dequantized on the host and rounded to F16, staged. */
static int upload_converted(uploader *u, void *dst, const m40_matrix *m)
{
    float *row = malloc((size_t)m->cols * sizeof *row);
    if (!row)
        return -1;
    size_t row16 = (size_t)m->cols * 2, per = STAGE_BYTES / row16;
    if (per == 0)
        per = 1;
    for (int64_t r0 = 0; r0 < m->rows && u->status == cudaSuccess; r0 += (int64_t)per) {
        int64_t r1 = r0 + (int64_t)per < m->rows ? r0 + (int64_t)per : m->rows;
        int b = u->cur;
        u->cur ^= 1;
        if ((u->status = cudaEventSynchronize(u->ev[b])) != cudaSuccess)
            break;
        uint16_t *o = (uint16_t *)(void *)u->stage[b];
        for (int64_t r = r0; r < r1; r++) {
            m40_dequantize_row(m->type, m->data + (size_t)r * m->row_bytes, row, m->cols);
            for (int64_t c = 0; c < m->cols; c++)
                *o++ = m40_fp32_to_fp16(row[c]);
        }
        size_t nb = (size_t)(r1 - r0) * row16;
        if ((u->status = cudaMemcpyAsync((uint8_t *)dst + (size_t)r0 * row16, u->stage[b], nb, cudaMemcpyHostToDevice,
                                         u->g->stream)) != cudaSuccess ||
            (u->status = cudaEventRecord(u->ev[b], u->g->stream)) != cudaSuccess)
            break;
        progress(u, nb);
    }
    free(row);
    return u->status == cudaSuccess ? 0 : -1;
}

static int upload_matrix(uploader *u, const m40_matrix *m, void *dst)
{
    if (gpu_type_native(m->type))
        return upload_bytes(u, dst, m->data, m->row_bytes * (size_t)m->rows);
    return upload_converted(u, dst, m);
}

static void gmat_describe(const m40_matrix *m, void *data, gmat *out)
{
    out->data = data;
    out->rows = m->rows;
    out->cols = m->cols;
    if (gpu_type_native(m->type)) {
        out->type = (int)m->type;
        out->row_bytes = m->row_bytes;
    } else {
        out->type = M40K_TYPE_F16;
        out->row_bytes = (size_t)m->cols * 2;
    }
}

static int dev_alloc(m40_gpu *g, void **p, size_t n, char *err, size_t errlen, const char *what)
{
    /* 256 bytes of slack: the GEMV kernel may read up to 15 bytes past a matrix. */
    cudaError_t e = cudaMalloc(p, n + 256);
    if (e != cudaSuccess) {
        *p = NULL;
        m40_set_err(err, errlen, "gpu %d: cannot allocate %.1f MB for %s: %s", g->device, n / 1e6, what,
                cudaGetErrorString(e));
        return -1;
    }
    g->weight_bytes += n;
    return 0;
}

/* Matrices written side by side into one product; fused into one device matrix when
 * their device types match and each part starts 16-byte aligned. */
static int upload_proj(uploader *u, const m40_matrix *const *ms, int n, const float *const *biases, gproj *out,
                       char *err, size_t errlen)
{
    m40_gpu *g = u->g;
    memset(out, 0, sizeof *out);
    int fuse = 1;
    gmat first;
    gmat_describe(ms[0], NULL, &first);
    size_t off = 0;
    for (int i = 0; i < n; i++) {
        gmat d;
        gmat_describe(ms[i], NULL, &d);
        if (d.type != first.type || d.cols != first.cols || off % 16)
            fuse = 0;
        off += dev_bytes(ms[i]);
        out->rows += ms[i]->rows;
    }
    if (fuse) {
        void *buf;
        if (dev_alloc(g, &buf, off, err, errlen, "weights"))
            return -1;
        size_t o = 0;
        for (int i = 0; i < n; i++) {
            if (upload_matrix(u, ms[i], (uint8_t *)buf + o))
                goto cuda_fail;
            o += dev_bytes(ms[i]);
        }
        gmat_describe(ms[0], buf, &out->part[0]);
        out->part[0].rows = out->rows;
        out->n_parts = 1;
    } else {
        for (int i = 0; i < n; i++) {
            void *buf;
            if (dev_alloc(g, &buf, dev_bytes(ms[i]), err, errlen, "weights"))
                return -1;
            gmat_describe(ms[i], buf, &out->part[i]);
            out->n_parts = i + 1;
            if (upload_matrix(u, ms[i], buf))
                goto cuda_fail;
        }
    }
    int any_bias = 0;
    for (int i = 0; i < n; i++)
        any_bias |= biases && biases[i] != NULL;
    if (any_bias) {
        float *hb = calloc((size_t)out->rows, sizeof *hb);
        if (!hb) {
            m40_set_err(err, errlen, "out of memory");
            return -1;
        }
        int64_t r = 0;
        for (int i = 0; i < n; i++) {
            if (biases[i])
                memcpy(hb + r, biases[i], (size_t)ms[i]->rows * sizeof *hb);
            r += ms[i]->rows;
        }
        cudaError_t e = cudaMalloc((void **)&out->bias, (size_t)out->rows * sizeof *hb);
        if (e == cudaSuccess)
            e = cudaMemcpy(out->bias, hb, (size_t)out->rows * sizeof *hb, cudaMemcpyHostToDevice);
        free(hb);
        if (e != cudaSuccess) {
            m40_set_err(err, errlen, "gpu %d: bias upload: %s", g->device, cudaGetErrorString(e));
            return -1;
        }
    }
    return 0;
cuda_fail:
    m40_set_err(err, errlen, "gpu %d: weight upload failed: %s", g->device, cudaGetErrorString(u->status));
    return -1;
}

static int upload_vec(m40_gpu *g, const float *v, int64_t n, float **out, char *err, size_t errlen)
{
    *out = NULL;
    if (!v)
        return 0;
    cudaError_t e = cudaMalloc((void **)out, (size_t)n * sizeof(float));
    if (e == cudaSuccess)
        e = cudaMemcpy(*out, v, (size_t)n * sizeof(float), cudaMemcpyHostToDevice);
    if (e != cudaSuccess) {
        m40_set_err(err, errlen, "gpu %d: cannot upload a norm vector: %s", g->device, cudaGetErrorString(e));
        return -1;
    }
    return 0;
}

static void gproj_free(gproj *p)
{
    for (int i = 0; i < p->n_parts; i++)
        cudaFree(p->part[i].data);
    cudaFree(p->bias);
}

void m40_gpu_free(m40_gpu *g)
{
    if (!g)
        return;
    cudaSetDevice(g->device);
    if (g->stream)
        cudaStreamSynchronize(g->stream);
    if (g->layers) {
        for (int32_t l = 0; l < g->p.n_layers; l++) {
            glayer *L = &g->layers[l];
            cudaFree(L->attn_norm);
            cudaFree(L->ffn_norm);
            cudaFree(L->q_norm);
            cudaFree(L->k_norm);
            cudaFree(L->post_attn_norm);
            cudaFree(L->post_ffw_norm);
            gproj_free(&L->qkv);
            gproj_free(&L->wo);
            gproj_free(&L->gate_up);
            gproj_free(&L->down);
        }
        free(g->layers);
    }
    cudaFree(g->tok_embd.data);
    if (!g->output_shared)
        cudaFree(g->output.data);
    cudaFree(g->output_norm);
    cudaFree(g->rope_ff);
    cudaFree(g->rope_ff_global);
    cudaFree(g->deq);
    cudaFree(g->iota);
    void *bufs[] = {g->x, g->xb, g->qkv, g->att, g->hb, g->hb2, g->xg,
                    g->logits_d, g->x16, g->xq, g->ws, g->ints_d, g->pick_d};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        cudaFree(bufs[i]);
    cudaFreeHost(g->ints_h);
    cudaFreeHost(g->logits_h);
    free(g->perm);
    free(g->grp_slot);
    free(g->grp_first);
    free(g->grp_n);
    free(g->out_rows);
    free(g->grp_seq);
    if (g->blas)
        cublasDestroy(g->blas);
    if (g->stream)
        cudaStreamDestroy(g->stream);
    free(g);
}

int m40_gpu_load(const m40_gpu_src *src, int device, int log_progress, m40_gpu **out, char *err, size_t errlen)
{
    *out = NULL;
    int n_dev = 0;
    cudaError_t e = cudaGetDeviceCount(&n_dev);
    if (e != cudaSuccess || device >= n_dev) {
        m40_set_err(err, errlen, "device %d was asked for, but %s", device,
                e != cudaSuccess ? cudaGetErrorString(e) : n_dev == 0 ? "there is no CUDA device" : "no such CUDA device");
        if (e == cudaSuccess && n_dev > 0)
            m40_set_err(err, errlen, "device %d was asked for, but there are only %d CUDA device(s)", device, n_dev);
        return -1;
    }
    if ((e = cudaSetDevice(device)) != cudaSuccess) {
        m40_set_err(err, errlen, "cannot use CUDA device %d: %s", device, cudaGetErrorString(e));
        return -1;
    }
    const m40_model_params *p = src->p;
    if (p->head_dim > 512 || p->rope_dim > p->head_dim) {
        m40_set_err(err, errlen, "head dimension %d is not supported on the GPU (at most 512)", p->head_dim);
        return -1;
    }
    m40_gpu *g = calloc(1, sizeof *g);
    if (!g) {
        m40_set_err(err, errlen, "out of memory");
        return -1;
    }
    g->device = device;
    g->p = *p;
    g->q_dim = src->q_dim;
    g->kv_dim = src->kv_dim;
    g->qkv_dim = src->q_dim + 2 * src->kv_dim;
    if (src->gemma3) {
        g->gemma3 = 1;
        g->g3 = *src->gemma3;
    }
    struct cudaDeviceProp prop;
    if ((e = cudaGetDeviceProperties(&prop, device)) != cudaSuccess ||
        (e = cudaStreamCreateWithFlags(&g->stream, cudaStreamNonBlocking)) != cudaSuccess) {
        m40_set_err(err, errlen, "gpu %d: %s", device, cudaGetErrorString(e));
        goto fail;
    }
    g->sm_count = prop.multiProcessorCount;
    if (cublasCreate(&g->blas) != CUBLAS_STATUS_SUCCESS || cublasSetStream(g->blas, g->stream) != CUBLAS_STATUS_SUCCESS) {
        g->blas = NULL;
        m40_set_err(err, errlen, "gpu %d: cannot initialize cuBLAS", device);
        goto fail;
    }

    /* Precision of the tiled path (prefill, batches over 8 rows). F16 operands on the
     * tensor cores round every weight and activation to 11 bits; over a long prompt
     * that moves a small model's logprobs by up to ~0.05 (Gemma 3 270M, 712 tokens:
     * 0.051 with F16, 0.028 with F32, measured on an H100). Under 1B parameters the
     * F32 products cost little (the step is launch-bound), so they are the default
     * there; M40_GEMM=f16|f32 overrides. */
    {
        double params = (double)src->tok_embd->rows * (double)src->tok_embd->cols;
        if (src->output->data != src->tok_embd->data)
            params += (double)src->output->rows * (double)src->output->cols;
        for (int32_t l = 0; l < p->n_layers; l++) {
            const m40_layer *L = &src->layers[l];
            const m40_matrix *ms[] = {&L->wq, &L->wk, &L->wv, &L->wo, &L->w_gate, &L->w_up, &L->w_down};
            for (int i = 0; i < 7; i++)
                params += (double)ms[i]->rows * (double)ms[i]->cols;
        }
        const char *gm = getenv("M40_GEMM");
        const int forced = gm && (!strcmp(gm, "f32") || !strcmp(gm, "f16"));
        g->gemm_f32 = forced ? !strcmp(gm, "f32") : params < 1e9;
        if (gm && !forced)
            fprintf(stderr, "m40: M40_GEMM=%s is neither f16 nor f32: ignored\n", gm);
        if (log_progress)
            fprintf(stderr, "m40: gpu %d: %.0fM parameters: prefill matmuls in %s%s\n", device, params / 1e6,
                    g->gemm_f32 ? "F32" : "F16 on the tensor cores", forced ? " (M40_GEMM)" : "");
    }

    uploader u = {.g = g, .log = log_progress, .t0 = now_s(), .status = cudaSuccess};
    u.total = dev_bytes(src->tok_embd);
    if (src->output->data != src->tok_embd->data)
        u.total += dev_bytes(src->output);
    for (int32_t l = 0; l < p->n_layers; l++) {
        const m40_layer *L = &src->layers[l];
        const m40_matrix *ms[] = {&L->wq, &L->wk, &L->wv, &L->wo, &L->w_gate, &L->w_up, &L->w_down};
        for (int i = 0; i < 7; i++)
            u.total += dev_bytes(ms[i]);
    }
    if (log_progress)
        fprintf(stderr, "m40: gpu %d (%s, %.1f GB): uploading %.2f GB of weights (%s, %d layers)\n", device,
                prop.name, prop.totalGlobalMem / 1e9, u.total / 1e9, m40_type_name(p->weight_type), p->n_layers);
    for (int i = 0; i < 2; i++) {
        if ((e = cudaHostAlloc((void **)&u.stage[i], STAGE_BYTES, cudaHostAllocDefault)) != cudaSuccess ||
            (e = cudaEventCreateWithFlags(&u.ev[i], cudaEventDisableTiming)) != cudaSuccess) {
            m40_set_err(err, errlen, "gpu %d: cannot allocate pinned staging memory: %s", device, cudaGetErrorString(e));
            goto fail_upload;
        }
        cudaEventRecord(u.ev[i], g->stream);
    }

    void *buf;
    if (dev_alloc(g, &buf, dev_bytes(src->tok_embd), err, errlen, "token_embd"))
        goto fail_upload;
    gmat_describe(src->tok_embd, buf, &g->tok_embd);
    if (upload_matrix(&u, src->tok_embd, buf))
        goto fail_cuda;
    if (src->output->data == src->tok_embd->data) {
        g->output = g->tok_embd;
        g->output_shared = 1;
    } else {
        if (dev_alloc(g, &buf, dev_bytes(src->output), err, errlen, "output"))
            goto fail_upload;
        gmat_describe(src->output, buf, &g->output);
        if (upload_matrix(&u, src->output, buf))
            goto fail_cuda;
    }
    if (upload_vec(g, src->output_norm, p->dim, &g->output_norm, err, errlen) ||
        upload_vec(g, src->rope_freq_factors, p->rope_dim / 2, &g->rope_ff, err, errlen))
        goto fail_upload;
    if (g->gemma3 && g->g3.global_scale != 1.0f) {
        /* theta_i = pos * base^(-2i/d) / factor_i: linear scaling is a constant factor */
        float *ff = malloc((size_t)(p->rope_dim / 2) * sizeof *ff);
        if (!ff) {
            m40_set_err(err, errlen, "out of memory");
            goto fail_upload;
        }
        for (int32_t i = 0; i < p->rope_dim / 2; i++)
            ff[i] = g->g3.global_scale;
        int rc = upload_vec(g, ff, p->rope_dim / 2, &g->rope_ff_global, err, errlen);
        free(ff);
        if (rc)
            goto fail_upload;
    }
    g->layers = calloc((size_t)p->n_layers, sizeof *g->layers);
    if (!g->layers) {
        m40_set_err(err, errlen, "out of memory");
        goto fail_upload;
    }
    int64_t max_rows = p->n_vocab;
    size_t max_elems = 0;
    int any_tiled = 0;
    for (int32_t l = 0; l < p->n_layers; l++) {
        const m40_layer *L = &src->layers[l];
        glayer *G = &g->layers[l];
        const m40_matrix *qkv[] = {&L->wq, &L->wk, &L->wv};
        const float *qkv_b[] = {L->bq, L->bk, L->bv};
        const m40_matrix *wo[] = {&L->wo};
        const m40_matrix *gu[] = {&L->w_gate, &L->w_up};
        const m40_matrix *dn[] = {&L->w_down};
        if (upload_vec(g, L->attn_norm, p->dim, &G->attn_norm, err, errlen) ||
            upload_vec(g, L->ffn_norm, p->dim, &G->ffn_norm, err, errlen) ||
            upload_proj(&u, qkv, 3, qkv_b, &G->qkv, err, errlen) || upload_proj(&u, wo, 1, NULL, &G->wo, err, errlen) ||
            upload_proj(&u, gu, 2, NULL, &G->gate_up, err, errlen) ||
            upload_proj(&u, dn, 1, NULL, &G->down, err, errlen))
            goto fail_upload;
        if (g->gemma3) {
            if (!L->q_norm || !L->k_norm || !L->post_attn_norm || !L->post_ffw_norm) {
                m40_set_err(err, errlen, "gemma3 layer %d lacks its Q/K or post norms", (int)l);
                goto fail_upload;
            }
            if (upload_vec(g, L->q_norm, p->head_dim, &G->q_norm, err, errlen) ||
                upload_vec(g, L->k_norm, p->head_dim, &G->k_norm, err, errlen) ||
                upload_vec(g, L->post_attn_norm, p->dim, &G->post_attn_norm, err, errlen) ||
                upload_vec(g, L->post_ffw_norm, p->dim, &G->post_ffw_norm, err, errlen))
                goto fail_upload;
            G->local = L->local;
        }
        gproj *ps[] = {&G->qkv, &G->wo, &G->gate_up, &G->down};
        for (int i = 0; i < 4; i++)
            for (int j = 0; j < ps[i]->n_parts; j++) {
                gmat *m = &ps[i]->part[j];
                if (m->rows > max_rows)
                    max_rows = m->rows;
                if (m->type != M40K_TYPE_F32 && (m->type != M40K_TYPE_F16 || g->gemm_f32)) {
                    any_tiled = 1;
                    if ((size_t)(m->rows * m->cols) > max_elems)
                        max_elems = (size_t)(m->rows * m->cols);
                }
            }
    }
    if (g->output.type != M40K_TYPE_F32 && (g->output.type != M40K_TYPE_F16 || g->gemm_f32)) {
        any_tiled = 1;
        if ((size_t)(g->output.rows * g->output.cols) > max_elems)
            max_elems = (size_t)(g->output.rows * g->output.cols);
    }
    if ((e = cudaStreamSynchronize(g->stream)) != cudaSuccess) {
        u.status = e;
        goto fail_cuda;
    }
    for (int i = 0; i < 2; i++) {
        cudaFreeHost(u.stage[i]);
        cudaEventDestroy(u.ev[i]);
        u.stage[i] = NULL;
        u.ev[i] = NULL;
    }
    /* The tiled path's scratch is reserved now, so that the KV pool sized later from
     * the free memory cannot take it. */
    int32_t *iota = malloc((size_t)max_rows * sizeof *iota);
    if (!iota) {
        m40_set_err(err, errlen, "out of memory");
        goto fail;
    }
    for (int64_t i = 0; i < max_rows; i++)
        iota[i] = (int32_t)i;
    e = cudaMalloc((void **)&g->iota, (size_t)max_rows * sizeof *iota);
    if (e == cudaSuccess)
        e = cudaMemcpy(g->iota, iota, (size_t)max_rows * sizeof *iota, cudaMemcpyHostToDevice);
    free(iota);
    if (e == cudaSuccess && any_tiled) {
        e = cudaMalloc((void **)&g->deq, max_elems * (g->gemm_f32 ? 4 : 2) + 256);
        g->deq_cap = max_elems;
    }
    if (e != cudaSuccess) {
        m40_set_err(err, errlen, "gpu %d: cannot allocate the dequantization scratch: %s", device, cudaGetErrorString(e));
        goto fail;
    }
    if (log_progress)
        fprintf(stderr, "m40: gpu %d: %.2f GB of weights resident in %.2f s\n", device, g->weight_bytes / 1e9,
                now_s() - u.t0);
    *out = g;
    return 0;

fail_cuda:
    m40_set_err(err, errlen, "gpu %d: weight upload failed: %s", device, cudaGetErrorString(u.status));
fail_upload:
    cudaStreamSynchronize(g->stream);
    for (int i = 0; i < 2; i++) {
        if (u.stage[i])
            cudaFreeHost(u.stage[i]);
        if (u.ev[i])
            cudaEventDestroy(u.ev[i]);
    }
fail:
    m40_gpu_free(g);
    return -1;
}

/* ------------------------------------------------------------- KV pool ---- */

m40_gpu_kv *m40_gpu_kv_new(m40_gpu *g, int32_t n_slots, int32_t ctx)
{
    if (n_slots <= 0 || ctx <= 0)
        return NULL;
    cudaSetDevice(g->device);
    m40_gpu_kv *kv = calloc(1, sizeof *kv);
    if (!kv)
        return NULL;
    kv->g = g;
    kv->n_slots = n_slots;
    kv->ctx = ctx;
    /* Bytes of one block over all layers, K and V. */
    size_t block_elems = (size_t)M40K_PAGE * (size_t)g->kv_dim;
    size_t block_bytes = block_elems * 2 * 2 * (size_t)g->p.n_layers;
    int64_t want = (int64_t)n_slots * (((int64_t)ctx + M40K_PAGE - 1) / M40K_PAGE);
    size_t free_b = 0, total_b = 0;
    cudaMemGetInfo(&free_b, &total_b);
    /* Leave room for the activations of big steps, cuBLAS workspaces and other
     * allocations: 1 GiB or 5% of the card, whichever is larger. */
    size_t margin = (size_t)1 << 30;
    if (total_b / 20 > margin)
        margin = total_b / 20;
    int64_t fit = free_b > margin ? (int64_t)((free_b - margin) / block_bytes) : 0;
    int64_t nb = want < fit ? want : fit;
    const char *cap = getenv("M40_KV_BLOCKS");
    if (cap && atoll(cap) > 0 && atoll(cap) < nb)
        nb = atoll(cap);
    if (nb > INT32_MAX / M40K_PAGE)
        nb = INT32_MAX / M40K_PAGE;
    if (nb <= 0)
        goto fail;
    kv->n_blocks = (int32_t)nb;
    kv->layer_elems = (size_t)nb * block_elems;
    if (cudaMalloc((void **)&kv->k, kv->layer_elems * 2 * (size_t)g->p.n_layers) != cudaSuccess ||
        cudaMalloc((void **)&kv->v, kv->layer_elems * 2 * (size_t)g->p.n_layers) != cudaSuccess)
        goto fail;
    m40_kv_blocks_params bp;
    m40_kv_blocks_params_default(&bp, kv->n_blocks);
    bp.block_size = M40K_PAGE;
    const char *pc = getenv("M40_PREFIX_CACHE"); /* "0": off (test and benchmark seam) */
    bp.prefix_cache = kv->prefix_cache = !(pc && strcmp(pc, "0") == 0);
    kv->mgr = m40_kv_blocks_new(&bp);
    kv->seqs = calloc((size_t)n_slots, sizeof *kv->seqs);
    kv->toks = calloc((size_t)n_slots, sizeof *kv->toks);
    kv->toks_cap = calloc((size_t)n_slots, sizeof *kv->toks_cap);
    if (!kv->mgr || !kv->seqs || !kv->toks || !kv->toks_cap)
        goto fail;
    for (int32_t i = 0; i < n_slots; i++)
        if (!(kv->seqs[i] = m40_kv_seq_new(kv->mgr)))
            goto fail;
    return kv;
fail:
    m40_gpu_kv_free(kv);
    return NULL;
}

void m40_gpu_kv_free(m40_gpu_kv *kv)
{
    if (!kv)
        return;
    cudaSetDevice(kv->g->device);
    cudaStreamSynchronize(kv->g->stream);
    if (kv->seqs)
        for (int32_t i = 0; i < kv->n_slots; i++)
            m40_kv_seq_free(kv->seqs[i]);
    free(kv->seqs);
    m40_kv_blocks_free(kv->mgr);
    cudaFree(kv->k);
    cudaFree(kv->v);
    free(kv->csr_indptr);
    free(kv->csr_lpl);
    free(kv->csr_indices);
    if (kv->toks)
        for (int32_t i = 0; i < kv->n_slots; i++)
            free(kv->toks[i]);
    free(kv->toks);
    free(kv->toks_cap);
    free(kv);
}

void m40_gpu_kv_slot_clear(m40_gpu_kv *kv, int32_t slot)
{
    if (slot >= 0 && slot < kv->n_slots)
        m40_kv_seq_reset(kv->seqs[slot]);
}

int32_t m40_gpu_kv_blocks_total(const m40_gpu_kv *kv) { return kv->n_blocks; }
int32_t m40_gpu_kv_blocks_free(const m40_gpu_kv *kv) { return m40_kv_blocks_n_available(kv->mgr); }

/* Room for n token ids in slot's token record. -1 when out of memory. */
static int slot_toks_reserve(m40_gpu_kv *kv, int32_t slot, int32_t n)
{
    if (n <= kv->toks_cap[slot])
        return 0;
    int32_t cap = kv->toks_cap[slot] > 0 ? kv->toks_cap[slot] : 64;
    while (cap < n)
        cap = cap > INT32_MAX / 2 ? n : cap * 2;
    int32_t *t = realloc(kv->toks[slot], (size_t)cap * sizeof *t);
    if (!t)
        return -1;
    kv->toks[slot] = t;
    kv->toks_cap[slot] = cap;
    return 0;
}

int m40_gpu_kv_prefix_cache_enabled(const m40_gpu_kv *kv) { return kv->prefix_cache; }

int32_t m40_gpu_kv_match_prefix(m40_gpu_kv *kv, int32_t slot, const int32_t *tokens, int32_t n)
{
    if (slot < 0 || slot >= kv->n_slots || n <= 0 || m40_kv_seq_len(kv->seqs[slot]) != 0)
        return 0;
    /* The record must hold the matched tokens before later commits read it; sized for
     * the whole prompt, which the coming prefill needs anyway. */
    if (kv->prefix_cache && slot_toks_reserve(kv, slot, n) != 0)
        return 0;
    int32_t got = m40_kv_seq_match_prefix(kv->seqs[slot], tokens, n);
    if (got <= 0)
        return 0;
    memcpy(kv->toks[slot], tokens, (size_t)got * sizeof *tokens);
    return got;
}

void m40_gpu_kv_prefix_stats(const m40_gpu_kv *kv, int64_t *queries, int64_t *query_tokens, int64_t *hit_tokens)
{
    m40_kv_cache_stats st;
    m40_kv_blocks_stats(kv->mgr, &st);
    *queries = st.queries;
    *query_tokens = st.query_tokens;
    *hit_tokens = st.hit_tokens;
}

/* ------------------------------------------------------------- forward ---- */

static int grow_dev(void **p, size_t bytes)
{
    cudaFree(*p);
    *p = NULL;
    return cudaMalloc(p, bytes + 256) == cudaSuccess ? 0 : -1;
}

static int ensure_scratch(m40_gpu *g, int32_t n, int32_t n_out)
{
    const m40_model_params *p = &g->p;
    if (n > g->cap) {
        int32_t c = n < 64 ? 64 : n;
        size_t N = (size_t)c, in_max = (size_t)p->ffn_dim;
        if ((size_t)p->dim > in_max)
            in_max = (size_t)p->dim;
        if ((size_t)g->q_dim > in_max)
            in_max = (size_t)g->q_dim;
        if (grow_dev((void **)&g->x, N * p->dim * 4) || grow_dev((void **)&g->xb, N * p->dim * 4) ||
            grow_dev((void **)&g->qkv, N * g->qkv_dim * 4) || grow_dev((void **)&g->att, N * g->q_dim * 4) ||
            grow_dev((void **)&g->hb, N * 2 * p->ffn_dim * 4) || grow_dev((void **)&g->hb2, N * p->ffn_dim * 4) ||
            grow_dev((void **)&g->x16, N * in_max * 2) ||
            grow_dev(&g->xq, m40k_gemv_q8_ws_bytes((int)in_max, 8)))
            return -1;
        free(g->perm);
        free(g->grp_slot);
        free(g->grp_first);
        free(g->grp_n);
        free(g->out_rows);
        free(g->grp_seq);
        g->perm = malloc(N * sizeof *g->perm);
        g->grp_slot = malloc(N * sizeof *g->grp_slot);
        g->grp_first = malloc(N * sizeof *g->grp_first);
        g->grp_n = malloc(N * sizeof *g->grp_n);
        g->out_rows = malloc(N * sizeof *g->out_rows);
        g->grp_seq = malloc(N * sizeof *g->grp_seq);
        if (!g->perm || !g->grp_slot || !g->grp_first || !g->grp_n || !g->out_rows || !g->grp_seq)
            return -1;
        g->cap = c;
    }
    if (n_out > g->cap_out) {
        int32_t c = n_out < 8 ? 8 : n_out;
        cudaFreeHost(g->logits_h);
        g->logits_h = NULL;
        if (grow_dev((void **)&g->xg, (size_t)c * p->dim * 4) ||
            grow_dev((void **)&g->logits_d, (size_t)c * p->n_vocab * 4) || grow_dev((void **)&g->pick_d, (size_t)c * 8) ||
            cudaHostAlloc((void **)&g->logits_h, (size_t)c * p->n_vocab * 4, cudaHostAllocDefault) != cudaSuccess)
            return -1;
        g->cap_out = c;
    }
    return 0;
}

static int ensure_ints(m40_gpu *g, size_t n)
{
    if (n <= g->ints_cap)
        return 0;
    n = n < 4096 ? 4096 : n * 2;
    cudaFreeHost(g->ints_h);
    g->ints_h = NULL;
    if (grow_dev((void **)&g->ints_d, n * 4) || cudaHostAlloc((void **)&g->ints_h, n * 4, cudaHostAllocDefault))
        return -1;
    g->ints_cap = n;
    return 0;
}

static int gemv_reads(int type, int64_t K)
{
    switch (type) {
    case M40K_TYPE_F16: return K % 8 == 0;
    case M40K_TYPE_Q8_0:
    case M40K_TYPE_Q4_0:
    case M40K_TYPE_Q4_1:
    case M40K_TYPE_Q5_0:
    case M40K_TYPE_Q5_1: return K % 32 == 0;
    case M40K_TYPE_Q4_K:
    case M40K_TYPE_Q6_K: return K % 256 == 0;
    default: return 0;
    }
}

#define CK(call)                                                                                                       \
    do {                                                                                                               \
        int rc_ = (call);                                                                                              \
        if (rc_ != 0) {                                                                                                \
            m40_set_err(err, errlen, "gpu %d: %s failed: %s", g->device, #call, cudaGetErrorString((cudaError_t)rc_));    \
            return -1;                                                                                                 \
        }                                                                                                              \
    } while (0)

/* The int8-activation GEMV (m40k_gemv_q8, two-level activations: within
 * max|x of a block|/254^2 per element) takes quantized weights 16-byte aligned. */
static int gemv_q8_reads(const gmat *w)
{
    const int t = w->type;
    return (t == M40K_TYPE_Q8_0 || t == M40K_TYPE_Q4_0 || t == M40K_TYPE_Q4_K || t == M40K_TYPE_Q6_K) &&
           gemv_reads(t, w->cols) && ((uintptr_t)w->data & 15) == 0;
}

/* y[t*ldy + r] = sum_k W[r][k] x[t*cols + k] for r < W.rows, t < n (x contiguous).
 * *xq_ready: whether g->xq already holds x quantized (m40k_quantize_q8); set once it
 * does, so the products of one x share one quantization. */
static int matmul_one(m40_gpu *g, const gmat *w, const float *x, int32_t n, float *y, int64_t ldy, int *xq_ready,
                      char *err, size_t errlen)
{
    const float one = 1.0f, zero = 0.0f;
    int rows = (int)w->rows, cols = (int)w->cols;
    if (w->type == M40K_TYPE_F32) {
        cublasStatus_t s = cublasSgemm(g->blas, CUBLAS_OP_T, CUBLAS_OP_N, rows, n, cols, &one, (const float *)w->data,
                                       cols, x, cols, &zero, y, (int)ldy);
        if (s != CUBLAS_STATUS_SUCCESS) {
            m40_set_err(err, errlen, "gpu %d: cublasSgemm failed (%d)", g->device, (int)s);
            return -1;
        }
        return 0;
    }
    if (n <= 8 && gemv_q8_reads(w)) {
        if (!*xq_ready) {
            CK(m40k_quantize_q8(x, cols, cols, n, g->xq, g->stream));
            *xq_ready = 1;
        }
        CK(m40k_gemv_q8(w->data, w->type, rows, cols, g->xq, n, y, ldy, g->stream));
        return 0;
    }
    if (n <= 8 && gemv_reads(w->type, cols))
        return m40k_gemv(w->data, w->type, rows, cols, x, cols, y, ldy, n, g->stream) == 0
                   ? 0
                   : (m40_set_err(err, errlen, "gpu %d: GEMV (type %d, %dx%d, batch %d) failed", g->device, w->type, rows,
                              cols, (int)n),
                      -1);
    if (g->gemm_f32) { /* the tiled path in F32: exact weights and activations */
        if ((size_t)rows * (size_t)cols > g->deq_cap) {
            m40_set_err(err, errlen, "gpu %d: dequantization scratch too small", g->device);
            return -1;
        }
        CK(m40k_embed(w->data, w->type, rows, cols, g->iota, rows, g->deq, M40K_TYPE_F32, cols, g->stream));
        cublasStatus_t s = cublasSgemm(g->blas, CUBLAS_OP_T, CUBLAS_OP_N, rows, n, cols, &one, (const float *)g->deq,
                                       cols, x, cols, &zero, y, (int)ldy);
        if (s != CUBLAS_STATUS_SUCCESS) {
            m40_set_err(err, errlen, "gpu %d: cublasSgemm failed (%d)", g->device, (int)s);
            return -1;
        }
        return 0;
    }
    /* The tiled path: F16 x F16 -> F32 on the tensor cores. */
    const void *wf16 = w->data;
    if (w->type != M40K_TYPE_F16) {
        if ((size_t)rows * (size_t)cols > g->deq_cap) {
            m40_set_err(err, errlen, "gpu %d: dequantization scratch too small", g->device);
            return -1;
        }
        CK(m40k_embed(w->data, w->type, rows, cols, g->iota, rows, g->deq, M40K_TYPE_F16, cols, g->stream));
        wf16 = g->deq;
    }
    CK(m40k_f32_to_f16(x, g->x16, (int64_t)n * cols, g->stream));
    cublasStatus_t s = cublasGemmEx(g->blas, CUBLAS_OP_T, CUBLAS_OP_N, rows, n, cols, &one, wf16, CUDA_R_16F, cols,
                                    g->x16, CUDA_R_16F, cols, &zero, y, CUDA_R_32F, (int)ldy, CUBLAS_COMPUTE_32F,
                                    CUBLAS_GEMM_DEFAULT);
    if (s != CUBLAS_STATUS_SUCCESS) {
        m40_set_err(err, errlen, "gpu %d: cublasGemmEx failed (%d)", g->device, (int)s);
        return -1;
    }
    return 0;
}

/* Whether the product pr over n rows starts with the int8-activation GEMV: then the
 * kernel that writes its input can quantize it on the way (m40k_add_rmsnorm_q8,
 * m40k_glu_q8) and matmul is told so (xq_ready). */
static int wants_xq(const gproj *pr, int32_t n)
{
    return n <= 8 && pr->n_parts > 0 && gemv_q8_reads(&pr->part[0]); /* cols: a multiple of 32 */
}

/* xq_ready: g->xq already holds x quantized (m40k_quantize_q8 layout). */
static int matmul(m40_gpu *g, const gproj *pr, const float *x, int32_t n, float *y, int xq_ready, char *err,
                  size_t errlen)
{
    int64_t off = 0;
    for (int i = 0; i < pr->n_parts; i++) {
        if (matmul_one(g, &pr->part[i], x, n, y + off, pr->rows, &xq_ready, err, errlen))
            return -1;
        off += pr->part[i].rows;
    }
    if (pr->bias)
        CK(m40k_add_bias(y, pr->rows, pr->bias, n, (int)pr->rows, g->stream));
    return 0;
}

int m40_gpu_forward(m40_gpu *g, m40_gpu_kv *kv, const m40_batch *b, float *logits, char *err, size_t errlen)
{
    const m40_model_params *p = &g->p;
    const int32_t n = b->n;
    cudaSetDevice(g->device);

    int32_t n_out = 0;
    for (int32_t i = 0; i < n; i++)
        n_out += b->want_logits ? b->want_logits[i] != 0 : i == n - 1;
    if (ensure_scratch(g, n, n_out)) {
        m40_set_err(err, errlen, "gpu %d: out of memory for a batch of %d tokens", g->device, (int)n);
        return -1;
    }

    /* Group rows by slot, in order of first appearance; check each slot's positions. */
    int32_t n_grp = 0;
    for (int32_t i = 0; i < n; i++) {
        int32_t j = 0;
        while (j < n_grp && g->grp_slot[j] != b->slot[i])
            j++;
        if (j == n_grp) {
            g->grp_slot[n_grp] = b->slot[i];
            g->grp_first[n_grp] = b->pos[i];
            g->grp_n[n_grp] = 0;
            n_grp++;
        }
        if (b->pos[i] != g->grp_first[j] + g->grp_n[j]) {
            m40_set_err(err, errlen, "batch entry %d: slot %d's positions must be consecutive (got %d after %d)", (int)i,
                    (int)b->slot[i], (int)b->pos[i], (int)(g->grp_first[j] + g->grp_n[j] - 1));
            return -1;
        }
        g->grp_n[j]++;
    }
    /* Decoding groups (one token) first, in order, then the prompt chunks: the first n_dec
     * rows of the step are then one decode query each, for the decode attention kernel,
     * and the prefill kernel takes the rest (a mixed step no longer runs its decode rows
     * through prefill tiles of one query without split-K). */
    int32_t n_dec = 0;
    for (int32_t j = 0; j < n_grp; j++)
        if (g->grp_n[j] == 1) {
            int32_t sl = g->grp_slot[j], fi = g->grp_first[j];
            memmove(g->grp_slot + n_dec + 1, g->grp_slot + n_dec, (size_t)(j - n_dec) * sizeof *g->grp_slot);
            memmove(g->grp_first + n_dec + 1, g->grp_first + n_dec, (size_t)(j - n_dec) * sizeof *g->grp_first);
            memmove(g->grp_n + n_dec + 1, g->grp_n + n_dec, (size_t)(j - n_dec) * sizeof *g->grp_n);
            g->grp_slot[n_dec] = sl, g->grp_first[n_dec] = fi, g->grp_n[n_dec] = 1;
            n_dec++;
        }
    /* A slot's tokens continue its cache; a first position below its length restarts
     * the slot there (a new sequence in a reused slot). */
    int64_t need = 0;
    for (int32_t j = 0; j < n_grp; j++) {
        m40_kv_seq *s = kv->seqs[g->grp_slot[j]];
        int32_t len = m40_kv_seq_len(s);
        if (g->grp_first[j] > len) {
            m40_set_err(err, errlen, "slot %d: position %d skips ahead of its cache (%d tokens)", (int)g->grp_slot[j],
                    (int)g->grp_first[j], (int)len);
            return -1;
        }
        if (g->grp_first[j] < len && m40_kv_seq_truncate(s, g->grp_first[j]) != g->grp_first[j]) {
            m40_set_err(err, errlen, "slot %d: cannot restart at position %d", (int)g->grp_slot[j], (int)g->grp_first[j]);
            return -1;
        }
        if (kv->prefix_cache && slot_toks_reserve(kv, g->grp_slot[j], g->grp_first[j] + g->grp_n[j]) != 0) {
            m40_set_err(err, errlen, "out of memory for slot %d's token record", (int)g->grp_slot[j]);
            return -1;
        }
        need += m40_kv_seq_blocks_needed(s, g->grp_n[j]);
        g->grp_seq[j] = s;
    }
    if (need > m40_kv_blocks_n_available(kv->mgr)) {
        m40_set_err(err, errlen, "the KV cache pool is full: this step needs %lld blocks, %d are free of %d",
                (long long)need, (int)m40_kv_blocks_n_available(kv->mgr), (int)kv->n_blocks);
        return M40_FORWARD_NO_BLOCKS;
    }
    for (int32_t j = 0; j < n_grp; j++)
        if (m40_kv_seq_append(g->grp_seq[j], g->grp_n[j]) != 0) {
            m40_set_err(err, errlen, "KV block allocation failed");
            return -1;
        }
    if (kv->prefix_cache) /* the ids the commit below keys full blocks by */
        for (int32_t i = 0; i < n; i++)
            kv->toks[b->slot[i]][b->pos[i]] = b->tokens[i];

    /* Host tables: permuted tokens and positions, q_indptr, CSR, logit rows. */
    int32_t total_blocks = 0, max_len = 0; /* max_len: of the decoding groups */
    for (int32_t j = 0; j < n_grp; j++) {
        total_blocks += m40_kv_seq_n_blocks(g->grp_seq[j]);
        if (j < n_dec && m40_kv_seq_len(g->grp_seq[j]) > max_len)
            max_len = m40_kv_seq_len(g->grp_seq[j]);
    }
    /* layout: tokens[n] pos[n] row_seq[n] q_indptr[n_grp+1] indptr[n_grp+1] lpl[n_grp] out_rows[n_out] indices[] */
    size_t o_tok = 0, o_pos = (size_t)n, o_rs = 2 * (size_t)n, o_qi = 3 * (size_t)n, o_ip = o_qi + (size_t)n_grp + 1,
           o_lpl = o_ip + (size_t)n_grp + 1, o_out = o_lpl + (size_t)n_grp, o_idx = o_out + (size_t)n_out;
    size_t n_ints = o_idx + (size_t)total_blocks;
    if (ensure_ints(g, n_ints)) {
        m40_set_err(err, errlen, "gpu %d: out of memory for the batch tables", g->device);
        return -1;
    }
    int32_t *H = g->ints_h;
    /* The previous call's logits copy has completed (it synchronized), so H is free. */
    int32_t r = 0;
    H[o_qi] = 0;
    for (int32_t j = 0; j < n_grp; j++) {
        for (int32_t i = 0; i < n; i++)
            if (b->slot[i] == g->grp_slot[j]) {
                g->perm[i] = r;
                H[o_tok + r] = b->tokens[i];
                H[o_pos + r] = b->pos[i];
                H[o_rs + r] = j;
                r++;
            }
        H[o_qi + j + 1] = r;
    }
    int32_t k_out = 0;
    for (int32_t i = 0; i < n; i++)
        if (b->want_logits ? b->want_logits[i] != 0 : i == n - 1)
            H[o_out + k_out++] = g->perm[i];
    if (m40_kv_blocks_csr((const m40_kv_seq *const *)g->grp_seq, n_grp, H + o_ip, H + o_idx, total_blocks,
                          H + o_lpl) < 0) {
        m40_set_err(err, errlen, "block table export failed");
        return -1;
    }
    int32_t *D = g->ints_d;
    const int32_t *d_tok = D + o_tok, *d_pos = D + o_pos, *d_rs = D + o_rs, *d_qi = D + o_qi, *d_ip = D + o_ip,
                  *d_lpl = D + o_lpl, *d_out = D + o_out, *d_idx = D + o_idx;
    CK(cudaMemcpyAsync(D, H, n_ints * 4, cudaMemcpyHostToDevice, g->stream));

    /* Attention kernel choice: decode kernel for the first n_dec groups, prefill for the rest. */
    int G = p->n_heads / p->n_kv_heads;
    int hd = p->head_dim;
    int tuned = (hd == 64 || hd == 128 || hd == 256) && G >= 1 && G <= 8;
    int splits = 1, splits_local = 1;
    const int window = g->gemma3 ? g->g3.window : 0;
    if (tuned && n_dec > 0) {
        splits = m40k_decode_pick_splits(n_dec, p->n_kv_heads, max_len, g->sm_count);
        if (splits < 1)
            splits = 1;
        /* sliding-window layers read at most `window` positions: fewer splits */
        splits_local = window > 0 && window < max_len
                           ? m40k_decode_pick_splits(n_dec, p->n_kv_heads, window, g->sm_count)
                           : splits;
        if (splits_local < 1)
            splits_local = 1;
        size_t need_ws = m40k_decode_workspace_floats(n_dec, p->n_heads, hd, splits > splits_local ? splits : splits_local);
        if (need_ws > g->ws_cap) {
            if (grow_dev((void **)&g->ws, need_ws * 4)) {
                g->ws_cap = 0;
                m40_set_err(err, errlen, "gpu %d: out of memory for the attention workspace", g->device);
                return -1;
            }
            g->ws_cap = need_ws;
        }
    }
    const float scale = g->gemma3 ? g->g3.attn_scale : 1.0f / sqrtf((float)hd);
    const int64_t dim = p->dim, qkvd = g->qkv_dim, ffn = p->ffn_dim;

    CK(m40k_embed(g->tok_embd.data, g->tok_embd.type, g->tok_embd.rows, (int)dim, d_tok, n, g->x, M40K_TYPE_F32, dim,
                  g->stream));
    if (g->gemma3)
        CK(m40k_scale(g->x, (int64_t)n * dim, g->g3.embd_scale, g->stream));
    for (int32_t l = 0; l < p->n_layers; l++) {
        const glayer *L = &g->layers[l];
        uint16_t *kc = kv->k + (size_t)l * kv->layer_elems, *vc = kv->v + (size_t)l * kv->layer_elems;
        /* gemma3: local layers have their own RoPE base and a window; global ones the
         * file's base, optionally linearly scaled */
        const int win = g->gemma3 && L->local ? window : 0;
        const float base = !g->gemma3 ? p->rope_base : L->local ? g->g3.local_base : g->g3.global_base;
        const float *ff = !g->gemma3 ? g->rope_ff : L->local ? NULL : g->rope_ff_global;
        /* the previous layer's FFN residual is still in xb: added here, fused with this norm
         * (and with the int8 quantization of its output when the GEMV takes that) */
        const int xq_qkv = wants_xq(&L->qkv, n);
        if (l == 0)
            CK(m40k_rmsnorm(g->x, dim, L->attn_norm, g->xb, M40K_TYPE_F32, dim, n, (int)dim, p->norm_eps, g->stream));
        else if (xq_qkv)
            CK(m40k_add_rmsnorm_q8(g->x, dim, g->xb, dim, L->attn_norm, g->xb, dim, n, (int)dim, p->norm_eps, g->xq,
                                   g->stream));
        else
            CK(m40k_add_rmsnorm(g->x, dim, g->xb, dim, L->attn_norm, g->xb, dim, n, (int)dim, p->norm_eps, g->stream));
        if (matmul(g, &L->qkv, g->xb, n, g->qkv, l > 0 && xq_qkv, err, errlen))
            return -1;
        float *q = g->qkv, *k = g->qkv + g->q_dim, *v = g->qkv + g->q_dim + g->kv_dim;
        if (g->gemma3) {
            CK(m40k_rmsnorm_heads(q, qkvd, p->n_heads, hd, L->q_norm, n, p->norm_eps, g->stream));
            CK(m40k_rmsnorm_heads(k, qkvd, p->n_kv_heads, hd, L->k_norm, n, p->norm_eps, g->stream));
        }
        CK(m40k_rope(q, qkvd, p->n_heads, k, qkvd, p->n_kv_heads, hd, p->rope_dim, d_pos, n, base, ff, p->rope_neox,
                     g->stream));
        CK(m40k_kv_append(kc, vc, k, qkvd, v, qkvd, d_qi, n_grp, n, d_ip, d_idx, d_lpl, p->n_kv_heads, hd, g->stream));
        if (tuned && n_dec > 0)
            CK(m40k_attn_decode_window(g->att, g->q_dim, q, qkvd, kc, vc, d_ip, d_idx, d_lpl, n_dec, p->n_heads,
                                       p->n_kv_heads, hd, scale, win, win ? splits_local : splits, g->ws, g->stream));
        if (tuned && n_dec < n_grp) /* q_indptr and indptr hold absolute offsets: the tail slices work */
            CK(m40k_attn_prefill_auto_window(g->att, g->q_dim, q, qkvd, d_qi + n_dec, n_grp - n_dec, n - n_dec, kc,
                                             vc, d_ip + n_dec, d_idx, d_lpl + n_dec, p->n_heads, p->n_kv_heads, hd,
                                             scale, win, g->stream));
        if (!tuned)
            CK(m40k_attn_generic_window(g->att, g->q_dim, q, qkvd, d_rs, d_pos, n, kc, vc, d_ip, d_idx, p->n_heads,
                                        p->n_kv_heads, hd, scale, win, g->stream));
        if (matmul(g, &L->wo, g->att, n, g->xb, 0, err, errlen))
            return -1;
        if (g->gemma3)
            CK(m40k_rmsnorm(g->xb, dim, L->post_attn_norm, g->xb, M40K_TYPE_F32, dim, n, (int)dim, p->norm_eps,
                            g->stream));
        const int xq_gu = wants_xq(&L->gate_up, n), xq_dn = wants_xq(&L->down, n);
        if (xq_gu)
            CK(m40k_add_rmsnorm_q8(g->x, dim, g->xb, dim, L->ffn_norm, g->xb, dim, n, (int)dim, p->norm_eps, g->xq,
                                   g->stream));
        else
            CK(m40k_add_rmsnorm(g->x, dim, g->xb, dim, L->ffn_norm, g->xb, dim, n, (int)dim, p->norm_eps, g->stream));
        if (matmul(g, &L->gate_up, g->xb, n, g->hb, xq_gu, err, errlen))
            return -1;
        const int act = g->gemma3 ? M40K_GLU_GELU_TANH : M40K_GLU_SILU;
        if (xq_dn)
            CK(m40k_glu_q8(act, g->hb, g->hb + ffn, 2 * ffn, g->hb2, ffn, n, (int)ffn, g->xq, g->stream));
        else
            CK(m40k_glu(act, g->hb, g->hb + ffn, 2 * ffn, g->hb2, ffn, n, (int)ffn, g->stream));
        if (matmul(g, &L->down, g->hb2, n, g->xb, xq_dn, err, errlen))
            return -1;
        if (g->gemma3)
            CK(m40k_rmsnorm(g->xb, dim, L->post_ffw_norm, g->xb, M40K_TYPE_F32, dim, n, (int)dim, p->norm_eps,
                            g->stream));
    }
    if (p->n_layers > 0) /* the last layer's FFN residual */
        CK(m40k_add(g->x, g->x, g->xb, (int64_t)n * dim, g->stream));
    if (n_out > 0) {
        CK(m40k_gather_rows(g->xg, dim, g->x, dim, d_out, n_out, (int)dim, g->stream));
        CK(m40k_rmsnorm(g->xg, dim, g->output_norm, g->xg, M40K_TYPE_F32, dim, n_out, (int)dim, p->norm_eps,
                        g->stream));
        int xq_ready = 0;
        if (matmul_one(g, &g->output, g->xg, n_out, g->logits_d, p->n_vocab, &xq_ready, err, errlen))
            return -1;
        if (g->gemma3 && g->g3.logit_softcap > 0)
            CK(m40k_softcap(g->logits_d, (int64_t)n_out * p->n_vocab, g->g3.logit_softcap, g->stream));
        if (b->argmax) { /* greedy on the device: n_out ids come back instead of the rows */
            CK(m40k_sample_greedy(g->logits_d, p->n_vocab, n_out, p->n_vocab, g->pick_d,
                                  (float *)(g->pick_d + g->cap_out), 0, NULL, NULL, g->stream));
            CK(cudaMemcpyAsync(g->logits_h, g->pick_d, (size_t)n_out * 4, cudaMemcpyDeviceToHost, g->stream));
        } else {
            CK(cudaMemcpyAsync(g->logits_h, g->logits_d, (size_t)n_out * p->n_vocab * 4, cudaMemcpyDeviceToHost,
                               g->stream));
        }
    }
    CK(cudaStreamSynchronize(g->stream));
    if (n_out > 0)
        memcpy(b->argmax ? (void *)b->argmax : (void *)logits, g->logits_h,
               b->argmax ? (size_t)n_out * 4 : (size_t)n_out * p->n_vocab * 4);
    /* Every position of the batch is computed: with the prefix cache, each block that is
     * now full is registered under its token prefix (or merged into an identical cached
     * block; block ids may change, the next call re-exports the tables). */
    for (int32_t j = 0; j < n_grp; j++)
        m40_kv_seq_commit(g->grp_seq[j], kv->prefix_cache ? kv->toks[g->grp_slot[j]] : NULL,
                          m40_kv_seq_len(g->grp_seq[j]));
    return 0;
}

#endif /* M40_HAVE_CUDA */
