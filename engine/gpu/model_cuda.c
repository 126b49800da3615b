/* The GPU back end of the forward pass: host code in C11 that drives the kernels of
 * kernels/ through their C wrappers, plus cuBLAS.
 *
 * One pipeline for every row of the architecture table (the math is model/model.c's):
 * the llama block, plus what the layer's tensors and the row's scalars (src->sc,
 * neutral where a row lacks the feature) ask for: per-head RMSNorm of Q and K after
 * the QKV product where the layer has Q/K norms (gemma3, qwen3), the attention and FFN
 * outputs RMSNorm'ed before their residual adds where it has post norms (gemma2,
 * gemma3), GeGLU (tanh) instead of SwiGLU, the embedding scale, the attention scale
 * and q.k soft-cap, the logit soft-cap, and per layer either a global layer (the
 * file's RoPE base, its frequency factors and linear scaling) or a local one (the
 * local base, attention limited to the last `window` positions by the window argument
 * of the attention kernels; the cache keeps every position, as on the CPU); the
 * attention output's bias and the heads' sink logits where the layer has them; YaRN as
 * per-pair RoPE frequency factors (every layer) and its magnitude squared on the
 * attention scale (yarn_ff); and per layer either the dense FFN or a mixture of experts
 * (upload_moe: the router in F32, the 3-D expert tensors in their file type, MXFP4
 * included, or F16 where the expert kernels do not read it, and their biases).
 *
 * This file: loading (every weight uploaded through pinned staging buffers, converted
 * to F16 where the kernels do not read the type) and freeing. model_cuda_fwd.c: the
 * paged KV pool and the forward pass; model_cuda_int.h: the structures they share.
 *
 * Built without CUDA (no M40_HAVE_CUDA), the entry points fail with a clear message. */
#include "model_gpu.h"
#include "model/model_internal.h"

#include <stdio.h>
#include <string.h>

#ifndef M40_HAVE_CUDA

int m40_gpu_load(const m40_gpu_src *src, const m40_tuning *t, int device, int log_progress, m40_gpu **out, char *err,
                 size_t errlen)
{
    (void)src, (void)t;
    (void)log_progress;
    *out = NULL;
    snprintf(err, errlen, "device %d was asked for, but this build has no CUDA support (configure found no "
             "CUDA toolkit); leave out the device to run on the CPU", device);
    return -1;
}
int m40_gpu_load_tp(const m40_gpu_src *src, const m40_tuning *t, int device, int n, int log_progress, m40_gpu **out,
                    char *err, size_t errlen)
{
    (void)n;
    return m40_gpu_load(src, t, device, log_progress, out, err, errlen);
}
void m40_gpu_free(m40_gpu *g) { (void)g; }
void m40_gpu_tp_time(const m40_gpu *g, double *ms, int64_t *calls)
{
    (void)g;
    *ms = 0;
    *calls = 0;
}
void m40_gpu_graph_stats(const m40_gpu *g, int64_t *captures, int64_t *launches)
{
    (void)g;
    *captures = *launches = 0;
}
int m40_gpu_step_timing(m40_gpu *g, int on)
{
    (void)g, (void)on;
    return -1;
}
void m40_gpu_step_time(const m40_gpu *g, double *ms, int64_t *steps)
{
    (void)g;
    *ms = 0, *steps = 0;
}
m40_gpu_kv *m40_gpu_kv_new(m40_gpu *g, int32_t n_slots, int32_t ctx, const m40_kv_options *o, char *err,
                           size_t errlen)
{
    (void)g, (void)n_slots, (void)ctx, (void)o;
    snprintf(err, errlen, "this build has no CUDA support");
    return NULL;
}
void m40_gpu_kv_pool_info(const m40_gpu_kv *kv, m40_kv_pool_info *out)
{
    (void)kv;
    memset(out, 0, sizeof *out);
}
void m40_gpu_kv_free(m40_gpu_kv *kv) { (void)kv; }
m40_paged_kv *m40_gpu_kv_pool(m40_gpu_kv *kv)
{
    (void)kv;
    return NULL;
}
int m40_gpu_forward(m40_gpu *g, m40_gpu_kv *kv, const m40_batch *b, float *logits, char *err, size_t errlen)
{
    (void)g, (void)kv, (void)b, (void)logits;
    snprintf(err, errlen, "this build has no CUDA support");
    return -1;
}

#else /* M40_HAVE_CUDA */

#include "model_cuda_int.h"

#include <time.h>

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
    return t == M40_TYPE_F32 || t == M40_TYPE_F16 || t == M40_TYPE_BF16 || t == M40_TYPE_Q8_0 ||
           t == M40_TYPE_Q4_0 || t == M40_TYPE_Q4_1 || t == M40_TYPE_Q5_0 || t == M40_TYPE_Q5_1 ||
           t == M40_TYPE_Q2_K || t == M40_TYPE_Q3_K || t == M40_TYPE_Q4_K || t == M40_TYPE_Q5_K ||
           t == M40_TYPE_Q6_K || t == M40_TYPE_MXFP4;
}

/* Bytes of one of m's rows once packed: row_bytes, except for a tensor-parallel rank's
 * column run (model/tp_shard.h), whose rows are strided views into the file's. */
static size_t packed_row(const m40_matrix *m)
{
    uint64_t b = 0;
    return m40_type_nbytes(m->type, (uint64_t)m->cols, &b) == 0 ? (size_t)b : m->row_bytes;
}

/* Bytes of a matrix once on the device (converted to F16 when not native). */
static size_t dev_bytes(const m40_matrix *m)
{
    return gpu_type_native(m->type) ? packed_row(m) * (size_t)m->rows : (size_t)m->rows * (size_t)m->cols * 2;
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

/* A matrix whose rows change on the way (upload_converted, upload_regrouped): chunks of
 * whole rows, out_row bytes each on the device, formed by fill(m, r0, r1, stage, scratch)
 * in a pinned staging buffer (nonzero: refused) while the other buffer crosses the bus. */
typedef int (*row_fill)(const m40_matrix *m, int64_t r0, int64_t r1, uint8_t *stage, void *scratch);

static int upload_rows(uploader *u, void *dst, const m40_matrix *m, size_t out_row, row_fill fill, void *scratch)
{
    size_t per = STAGE_BYTES / out_row;
    if (per == 0)
        per = 1;
    for (int64_t r0 = 0; r0 < m->rows && u->status == cudaSuccess; r0 += (int64_t)per) {
        int64_t r1 = r0 + (int64_t)per < m->rows ? r0 + (int64_t)per : m->rows;
        int b = u->cur;
        u->cur ^= 1;
        if ((u->status = cudaEventSynchronize(u->ev[b])) != cudaSuccess)
            break;
        if (fill(m, r0, r1, u->stage[b], scratch)) {
            u->status = cudaErrorInvalidValue;
            break;
        }
        size_t nb = (size_t)(r1 - r0) * out_row;
        if ((u->status = cudaMemcpyAsync((uint8_t *)dst + (size_t)r0 * out_row, u->stage[b], nb,
                                         cudaMemcpyHostToDevice, u->g->stream)) != cudaSuccess ||
            (u->status = cudaEventRecord(u->ev[b], u->g->stream)) != cudaSuccess)
            break;
        progress(u, nb);
    }
    return u->status == cudaSuccess ? 0 : -1;
}

/* rows r0..r1 dequantized (scratch: one row of floats) and rounded to F16 */
static int fill_f16(const m40_matrix *m, int64_t r0, int64_t r1, uint8_t *stage, void *scratch)
{
    float *row = scratch;
    uint16_t *o = (uint16_t *)(void *)stage;
    for (int64_t r = r0; r < r1; r++) {
        m40_dequantize_row(m->type, m->data + (size_t)r * m->row_bytes, row, m->cols);
        for (int64_t c = 0; c < m->cols; c++)
            *o++ = m40_fp32_to_fp16(row[c]);
    }
    return 0;
}

/* A non-native matrix: rows dequantized on the host and rounded to F16, staged. */
static int upload_converted(uploader *u, void *dst, const m40_matrix *m)
{
    float *row = malloc((size_t)m->cols * sizeof *row);
    if (!row)
        return -1;
    int rc = upload_rows(u, dst, m, (size_t)m->cols * 2, fill_f16, row);
    free(row);
    return rc;
}

/* rows r0..r1 in the regrouped layout (kernels.h 0.), row by row where they are strided */
static int fill_g8(const m40_matrix *m, int64_t r0, int64_t r1, uint8_t *stage, void *scratch)
{
    (void)scratch;
    const size_t pr = packed_row(m);
    if (pr == m->row_bytes)
        return m40k_repack_g8((int)m->type, m->data + (size_t)r0 * m->row_bytes, stage, r1 - r0, m->cols);
    for (int64_t r = r0; r < r1; r++)
        if (m40k_repack_g8((int)m->type, m->data + (size_t)r * m->row_bytes, stage + (size_t)(r - r0) * pr, 1,
                           m->cols))
            return -1;
    return 0;
}

/* rows r0..r1 of a strided view, packed */
static int fill_packed(const m40_matrix *m, int64_t r0, int64_t r1, uint8_t *stage, void *scratch)
{
    (void)scratch;
    const size_t pr = packed_row(m);
    for (int64_t r = r0; r < r1; r++)
        memcpy(stage + (size_t)(r - r0) * pr, m->data + (size_t)r * m->row_bytes, pr);
    return 0;
}

/* A matrix the device keeps in a regrouped layout (kernels.h 0.: Q8_0 and Q6_K rows whose
 * width takes whole groups, unless M40_G8=0): its rows are rewritten on the way, in the
 * staging buffers. Same bytes per row, so sizes and offsets do not change. */
static int upload_regrouped(uploader *u, void *dst, const m40_matrix *m)
{
    return upload_rows(u, dst, m, packed_row(m), fill_g8, NULL);
}

/* The device type of a native matrix: its GGUF type, or the regrouped layout of it (rows
 * that fit a staging buffer, where upload_regrouped rewrites them). */
static int dev_type(const m40_gpu *g, const m40_matrix *m)
{
    return g->g8 && packed_row(m) <= STAGE_BYTES ? m40k_g8_type((int)m->type, m->cols) : (int)m->type;
}

static int upload_matrix(uploader *u, const m40_matrix *m, void *dst)
{
    if (!gpu_type_native(m->type))
        return upload_converted(u, dst, m);
    if (dev_type(u->g, m) != (int)m->type)
        return upload_regrouped(u, dst, m);
    if (packed_row(m) != m->row_bytes)
        return upload_rows(u, dst, m, packed_row(m), fill_packed, NULL);
    return upload_bytes(u, dst, m->data, m->row_bytes * (size_t)m->rows);
}

static void gmat_describe(const m40_gpu *g, const m40_matrix *m, void *data, gmat *out)
{
    out->data = data;
    out->rows = m->rows;
    out->cols = m->cols;
    if (gpu_type_native(m->type)) {
        out->type = dev_type(g, m);
        out->row_bytes = packed_row(m);
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

/* Matrices written side by side into one product. Each run of consecutive matrices
 * whose device types and widths match (and whose parts start 16-byte aligned) becomes
 * one device matrix, one part of the product: Q4_K_M's [q, k, v] with v in Q6_K is two
 * GEMVs ([q; k] and v), not three. */
static int upload_proj(uploader *u, const m40_matrix *const *ms, int n, const float *const *biases, gproj *out,
                       char *err, size_t errlen)
{
    m40_gpu *g = u->g;
    memset(out, 0, sizeof *out);
    for (int i = 0; i < n;) {
        gmat first;
        gmat_describe(g, ms[i], NULL, &first);
        size_t off = dev_bytes(ms[i]);
        int64_t rows = ms[i]->rows;
        int j = i + 1;
        for (; j < n; j++) {
            gmat d;
            gmat_describe(g, ms[j], NULL, &d);
            if (d.type != first.type || d.cols != first.cols || off % 16)
                break;
            off += dev_bytes(ms[j]);
            rows += ms[j]->rows;
        }
        void *buf;
        if (dev_alloc(g, &buf, off, err, errlen, "weights"))
            return -1;
        gmat_describe(g, ms[i], buf, &out->part[out->n_parts]);
        out->part[out->n_parts].rows = rows;
        out->n_parts++;
        out->rows += rows;
        size_t o = 0;
        for (int k = i; k < j; k++) {
            if (upload_matrix(u, ms[k], (uint8_t *)buf + o))
                goto cuda_fail;
            o += dev_bytes(ms[k]);
        }
        i = j;
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

/* The types the expert kernels read (kernels.h 10c, 10d, 10g) and the granularity of
 * their rows' length (the block; 8 for F16 and BF16). 0: not one of them. */
static int64_t moe_block(int t)
{
    switch (t) {
    case M40K_TYPE_F16:
    case M40K_TYPE_BF16: return 8;
    case M40K_TYPE_Q8_0:
    case M40K_TYPE_Q4_0:
    case M40K_TYPE_Q4_1:
    case M40K_TYPE_Q5_0:
    case M40K_TYPE_Q5_1:
    case M40K_TYPE_MXFP4: return 32;
    case M40K_TYPE_Q2_K:
    case M40K_TYPE_Q3_K:
    case M40K_TYPE_Q4_K:
    case M40K_TYPE_Q5_K:
    case M40K_TYPE_Q6_K:
    case M40K_TYPE_Q6_K_P: return 256;
    case M40K_TYPE_MXFP4_P: return 32; /* whole MXFP4 blocks: its rows are padded to 256 */
    default: return 0;
    }
}

/* The device type of an expert tensor: F16 where it is converted (as_f16: a type the
 * expert kernels do not read, or gate and up of different types, which kernels.h 10c
 * multiplies with one type); Q6_K and MXFP4 padded to Q6_K_P and MXFP4_P (kernels.h 0.:
 * Q6_K's 210-byte superblocks at rows of 768, Qwen3-30B-A3B's down experts, and MXFP4's
 * 17-byte blocks start at any offset, and the register and staged kernels of the grouped
 * product copy 16 bytes at a time; M40_MOE_PAD=0 keeps the file's layout); the file's
 * type otherwise (never regrouped: the expert GEMVs do not read the G8 layouts). */
static int experts_type(const m40_gpu *g, const m40_matrix *m, int as_f16)
{
    if (as_f16)
        return M40K_TYPE_F16;
    if (m->type == M40_TYPE_Q6_K && g->moe_pad)
        return M40K_TYPE_Q6_K_P;
    if (m->type == M40_TYPE_MXFP4 && g->moe_pad)
        return M40K_TYPE_MXFP4_P;
    return (int)m->type;
}

/* Bytes of a row of an expert tensor on the device (a padded row of a K the layout does
 * not take: 0, and its upload refuses it). */
static size_t experts_row_bytes(const m40_gpu *g, const m40_matrix *m, int as_f16)
{
    const int t = experts_type(g, m, as_f16);
    if (t == M40K_TYPE_F16)
        return (size_t)m->cols * 2;
    if (t == M40K_TYPE_Q6_K_P || t == M40K_TYPE_MXFP4_P)
        return (size_t)m40k_padded_row_bytes(t, m->cols);
    return m->row_bytes;
}

/* Device bytes of an expert tensor (upload_experts). */
static size_t experts_bytes(const m40_gpu *g, const m40_matrix *m, int as_f16)
{
    return experts_row_bytes(g, m, as_f16) * (size_t)m->rows;
}

/* rows r0..r1 of Q6_K or MXFP4 in their padded layouts (scratch: the device row's bytes) */
static int fill_padded(const m40_matrix *m, int64_t r0, int64_t r1, uint8_t *stage, void *scratch)
{
    const size_t out = *(const size_t *)scratch;
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *src = m->data + (size_t)r * m->row_bytes;
        uint8_t *dst = stage + (size_t)(r - r0) * out;
        if (m->type == M40_TYPE_Q6_K ? m40k_repack_q6_k_p(src, dst, 1, m->cols)
                                     : m40k_repack_mxfp4_p(src, dst, 1, m->cols))
            return -1;
    }
    return 0;
}

/* An expert tensor (n_experts matrices seen as one, model_gpu.h) on the device in
 * experts_type's layout. */
static int upload_experts(uploader *u, const m40_matrix *m, int as_f16, gmat *out, char *err, size_t errlen)
{
    m40_gpu *g = u->g;
    const int type = experts_type(g, m, as_f16);
    const size_t rb = experts_row_bytes(g, m, as_f16), bytes = rb * (size_t)m->rows;
    if (rb == 0) { /* the GGUF loader refuses rows of no whole block: not reached from a file */
        m40_set_err(err, errlen, "gpu %d: expert rows of %lld elements fit no device layout", g->device,
                    (long long)m->cols);
        return -1;
    }
    void *buf;
    if (dev_alloc(g, &buf, bytes, err, errlen, "expert weights"))
        return -1;
    *out = (gmat){.data = buf, .type = type, .rows = m->rows, .cols = m->cols, .row_bytes = rb};
    int rc;
    if (type == M40K_TYPE_F16)
        rc = upload_converted(u, buf, m);
    else if (type == M40K_TYPE_Q6_K_P || type == M40K_TYPE_MXFP4_P)
        rc = upload_rows(u, buf, m, rb, fill_padded, (void *)&rb);
    else
        rc = upload_bytes(u, buf, m->data, bytes);
    if (rc) {
        m40_set_err(err, errlen, "gpu %d: expert weight upload failed: %s", g->device, cudaGetErrorString(u->status));
        return -1;
    }
    return 0;
}

/* Whether an expert tensor stays in its file type on the device (else F16). */
static int experts_native(const m40_matrix *m) { return gpu_type_native(m->type) && moe_block((int)m->type) > 0; }

/* The router as F32 on the device (kernels.h 10a reads F32; GGUF keeps it in F32, any
 * other type is dequantized here). */
static int upload_router(m40_gpu *g, const m40_matrix *m, float **out, char *err, size_t errlen)
{
    float *h = malloc((size_t)m->rows * (size_t)m->cols * sizeof *h);
    if (!h) {
        m40_set_err(err, errlen, "out of memory");
        return -1;
    }
    for (int64_t r = 0; r < m->rows; r++)
        m40_dequantize_row(m->type, m->data + (size_t)r * m->row_bytes, h + (size_t)r * (size_t)m->cols, m->cols);
    int rc = upload_vec(g, h, m->rows * m->cols, out, err, errlen);
    free(h);
    return rc;
}

/* A layer's mixture of experts: router, experts and their biases (glayer). Refuses what
 * the expert kernels do not take, with the reason. */
static int upload_moe(uploader *u, const m40_layer *L, int32_t l, glayer *G, char *err, size_t errlen)
{
    m40_gpu *g = u->g;
    const m40_model_params *p = &g->p;
    const int64_t E = p->n_experts, F = p->expert_ffn_dim, D = p->dim;
    if (E > 256 || p->n_experts_used > 8) {
        m40_set_err(err, errlen, "layer %d: %d experts, %d chosen: the GPU takes at most 256 experts and 8 chosen",
                    (int)l, (int)E, (int)p->n_experts_used);
        return -1;
    }
    if (g->sc.act != M40_ACT_SILU && g->sc.act != M40_ACT_SWIGLU_OAI) {
        m40_set_err(err, errlen, "layer %d: the GPU's expert kernels take SwiGLU and SwiGLU-OAI only", (int)l);
        return -1;
    }
    if (L->sh_gate.data) {
        m40_set_err(err, errlen, "layer %d: shared experts (ffn_*_shexp) run on the CPU only in this build", (int)l);
        return -1;
    }
    const int gu_f16 = !experts_native(&L->exp_gate) || !experts_native(&L->exp_up) ||
                       L->exp_gate.type != L->exp_up.type;
    const int dn_f16 = !experts_native(&L->exp_down);
    if (upload_router(g, &L->router, &G->router, err, errlen) ||
        upload_vec(g, L->router_b, E, &G->router_b, err, errlen) ||
        upload_experts(u, &L->exp_gate, gu_f16, &G->exp_gate, err, errlen) ||
        upload_experts(u, &L->exp_up, gu_f16, &G->exp_up, err, errlen) ||
        upload_experts(u, &L->exp_down, dn_f16, &G->exp_down, err, errlen) ||
        upload_vec(g, L->exp_gate_b, E * F, &G->exp_gate_b, err, errlen) ||
        upload_vec(g, L->exp_up_b, E * F, &G->exp_up_b, err, errlen) ||
        upload_vec(g, L->exp_down_b, E * D, &G->exp_down_b, err, errlen))
        return -1;
    /* the GEMVs' conditions (kernels.h 10c/d): rows of whole blocks, x rows 16-byte aligned */
    if (D % moe_block(G->exp_gate.type) || F % moe_block(G->exp_down.type) || D % 4) {
        m40_set_err(err, errlen, "layer %d: experts of %lld x %lld (types %d, %d) do not fit the GPU's expert kernels",
                    (int)l, (long long)F, (long long)D, G->exp_gate.type, G->exp_down.type);
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
    m40_gpu_tp_free(g); /* the other ranks, their threads and the communicators */
    cudaSetDevice(g->device);
    m40_gpu_graphs_free(g);
    for (int i = 0; i < 2; i++)
        if (g->step_ev[i])
            cudaEventDestroy(g->step_ev[i]);
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
            void *moe[] = {L->sinks, L->router, L->router_b, L->exp_gate.data, L->exp_up.data, L->exp_down.data,
                           L->exp_gate_b, L->exp_up_b, L->exp_down_b};
            for (size_t i = 0; i < sizeof moe / sizeof moe[0]; i++)
                cudaFree(moe[i]);
        }
        free(g->layers);
    }
    cudaFree(g->tok_embd.data);
    if (!g->output_shared)
        cudaFree(g->output.data);
    cudaFree(g->output_norm);
    cudaFree(g->rope_ff);
    cudaFree(g->rope_ff_global);
    cudaFree(g->rope_ff_local);
    cudaFree(g->deq);
    cudaFree(g->iota);
    cudaFree(g->inv_x);
    cudaFree(g->inv_y);
    void *bufs[] = {g->x, g->x2, g->xd, g->xb, g->qkv, g->att, g->hb, g->hb2, g->xg,
                    g->logits_d, g->x16, g->xq, g->xq2, g->nss, g->ws, g->att_cnt, g->ints_d, g->pick_d,
                    g->sk_ws, g->sk_cnt, g->mq_ws, g->mq_cnt, g->moe_logits, g->moe_w, g->moe_yg, g->moe_yu,
                    g->moe_h, g->moe_yd, g->moe_ids, g->moe_counts, g->moe_offsets, g->moe_perm, g->moe_inv,
                    g->moe_tiles, g->moe_x16, g->moe_h16, g->moe_hq, g->samp_d, g->tp_logits, g->tp_gather,
                    g->rope_cs[0], g->rope_cs[1]};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        cudaFree(bufs[i]);
    cudaFreeHost(g->ints_h);
    cudaFreeHost(g->logits_h);
    cudaFreeHost(g->samp_h);
    free(g->perm);
    free(g->out_rows);
    for (int i = 0; i < g->tp_ev_cap; i++)
        cudaEventDestroy(g->tp_ev[i]);
    free(g->tp_ev);
    if (g->blas)
        cublasDestroy(g->blas);
    cudaFree(g->blas_ws);
    if (g->stream)
        cudaStreamDestroy(g->stream);
    free(g);
}

/* A tied head that is the whole embedding: one device copy serves both (a tensor-parallel
 * rank's head is its rows of it only, a matrix of its own). */
static int output_is_embd(const m40_gpu_src *src)
{
    return src->output->data == src->tok_embd->data && src->output->rows == src->tok_embd->rows;
}

/* YaRN's angle of pair d is theta * (freq_scale * (1 - mix) + mix) (model.c, yarn_theta,
 * mix 1 above the ramp, 0 below it): the RoPE kernels' theta / factor with this factor. */
static float yarn_ff(const m40_gpu_scalars *sc, int32_t d)
{
    float span = sc->yarn_high - sc->yarn_low;
    float y = ((float)d - sc->yarn_low) / (span > 0.001f ? span : 0.001f);
    double mix = 1.0 - (y < 0 ? 0 : y > 1 ? 1 : y);
    return (float)(1.0 / ((double)sc->yarn_freq_scale * (1.0 - mix) + mix));
}

int m40_gpu_load(const m40_gpu_src *src, const m40_tuning *t, int device, int log_progress, m40_gpu **out, char *err,
                 size_t errlen)
{
    *out = NULL;
    if (src->sc.yarn && src->p->rope_dim != src->p->head_dim) {
        /* the magnitude YaRN puts on the rotated dimensions becomes the attention scale's
         * here, which holds only when every dimension rotates */
        m40_set_err(err, errlen, "YaRN with a partial rotation (%d of %d dimensions) runs on the CPU only",
                    (int)src->p->rope_dim, (int)src->p->head_dim);
        return -1;
    }
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
    g->tuning = *t;
    g->p = *p;
    g->q_dim = src->q_dim;
    g->kv_dim = src->kv_dim;
    g->qkv_dim = src->q_dim + 2 * src->kv_dim;
    g->sc = src->sc;
    struct cudaDeviceProp prop;
    if ((e = cudaGetDeviceProperties(&prop, device)) != cudaSuccess ||
        (e = cudaStreamCreateWithFlags(&g->stream, cudaStreamNonBlocking)) != cudaSuccess) {
        m40_set_err(err, errlen, "gpu %d: %s", device, cudaGetErrorString(e));
        goto fail;
    }
    g->sm_count = prop.multiProcessorCount;
    /* MoE steps of up to this many rows take the expert GEMVs (kernels.h 10c/d: each pair
     * reads its expert's rows), larger ones the grouped products (10e-10i: each expert
     * read once for its tokens); M40_MOE_GEMV_ROWS, unset (-1): by the experts' type
     * (moe_grouped) */
    g->moe_gemv_rows = t->moe_gemv_rows;
    {
        /* CUDA graphs for decode steps of up to this many sequences (0: off) */
        g->graph_max = t->cuda_graphs;
    }
    {
        /* batch-1 decode: the add + RMSNorm of each layer folded into the int8 GEMVs around
         * it (kernels.h 8d); M40_FUSE_NORM=0: the add+RMSNorm kernels */
        g->fuse_norm = t->fuse_norm;
        /* one greedy row: the pick folded into the head's int8 GEMV (kernels.h 9c);
         * M40_FUSE_PICK=0: the sampling kernel */
        g->fuse_pick = t->fuse_pick;
        /* prompt chunks: the cuBLAS gate/up product written in F16 at 1/16 for the GLU,
         * the attention's output in F16 for the output projection (half the bytes
         * written and read back, no conversion); M40_PREFILL_F16=0: F32 */
        g->prefill_f16 = t->prefill_f16;
        /* the tiled (cuBLAS) products of the residual stream add into it themselves (beta
         * 1), the RMSNorm after them reads one stream; M40_FUSE_RESIDUAL=0: xd and the
         * add + RMSNorm */
        g->fuse_residual = t->fuse_residual;
    }
    {
        /* Q8_0 and Q6_K weights regrouped for aligned loads (kernels.h 0.); M40_G8=0: as in the file */
        g->g8 = t->g8;
        /* Q6_K and MXFP4 experts padded to Q6_K_P and MXFP4_P (experts_type); M40_MOE_PAD=0: as in the file */
        g->moe_pad = t->moe_pad;
        /* a decode row's expert GEMVs on int8 records of x and h (moe_q8); M40_MOE_Q8=0: on F32 */
        g->moe_q8 = t->moe_q8;
    }
    {
        g->skinny = prop.major >= 8 && t->skinny;
        /* the quantized GEMM's mma.sync F16 needs cc >= 8.0, as the skinny GEMV's */
        g->gemm_q = prop.major >= 8 && t->gemm_q;
        if (g->gemm_q && m40k_gemm_q_prepare() != 0) /* before any graph capture */
            g->gemm_q = 0;
        /* products of more than M40_GEMM_Q_ROWS token rows (default 128: prefill chunks)
         * dequantize the matrix to F16 and take cuBLAS, faster there than either kernel of
         * m40k_gemm_q (BENCHMARKS.md); 0: m40k_gemm_q at every size */
        g->gemm_q_rows = t->gemm_q_rows;
        /* products of up to M40_GEMM_Q_REG token rows (default 64) take the register kernel */
        m40k_gemm_q_tune(t->gemm_q_reg);
        /* the experts' grouped products: tiles of up to M40_MOE_GEMM_REG rows (default 64)
         * on the register kernel */
        m40k_moe_gemm_q_tune(t->moe_gemm_reg);
        g->gemv_rows = t->gemv_rows;
    }
    if (t->batch_invariant) {
        /* Batch invariance: none of the paths that a step's size picks (the fused norms
         * and pick of batch 1, the F16 outputs of prompt-only steps, the GEMVs and the
         * skinny kernel of small batches, the expert GEMVs) */
        g->invariant = 1;
        g->fuse_norm = g->fuse_pick = g->prefill_f16 = g->fuse_residual = g->skinny = g->moe_q8 = 0;
        g->moe_gemv_rows = 0; /* every mixture-of-experts step on the grouped products */
        /* the quantized products in tiles that the register kernel takes whole (M40_GEMM_Q_REG) */
        g->inv_rows = t->gemm_q_reg >= 1 && t->gemm_q_reg < 64 ? t->gemm_q_reg : 64;
        /* the decode attention's ranges a sequence, whatever its length (the default's
         * unit of 32 positions a range at 512) */
        g->inv_splits = 16;
    }
    m40k_set_launch_tuning(t->pdl, t->clusters, t->dec_hsplit); /* M40_PDL, M40_CLUSTER, M40_DEC_HSPLIT */
    if (log_progress) {
        char line[512];
        m40_tuning_line(t, line, sizeof line);
        fprintf(stderr, "m40: gpu %d: switches: %s\n", device, line);
    }
    if (cublasCreate(&g->blas) != CUBLAS_STATUS_SUCCESS || cublasSetStream(g->blas, g->stream) != CUBLAS_STATUS_SUCCESS) {
        g->blas = NULL;
        m40_set_err(err, errlen, "gpu %d: cannot initialize cuBLAS", device);
        goto fail;
    }
    /* Batch invariance: cuBLAS gets a workspace of its own, the same for a CUDA graph's
     * capture as for a plain call, so that what it may pick for a shape does not depend
     * on whether a decode step is graphed (NVIDIA's advice for capture; the configuration
     * BENCHMARKS.md measured invariant) */
    if (g->invariant && ((e = cudaMalloc(&g->blas_ws, M40_BLAS_WS_BYTES)) != cudaSuccess ||
                         cublasSetWorkspace(g->blas, g->blas_ws, M40_BLAS_WS_BYTES) != CUBLAS_STATUS_SUCCESS)) {
        m40_set_err(err, errlen, "gpu %d: cannot set cuBLAS's workspace", device);
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
        if (!output_is_embd(src))
            params += (double)src->output->rows * (double)src->output->cols;
        for (int32_t l = 0; l < p->n_layers; l++) {
            const m40_layer *L = &src->layers[l];
            const m40_matrix *ms[] = {&L->wq, &L->wk, &L->wv, &L->wo, &L->w_gate, &L->w_up, &L->w_down};
            for (int i = 0; i < 7; i++)
                params += (double)ms[i]->rows * (double)ms[i]->cols;
            if (L->router.data) /* every expert counts: the size of the model, not of a token's work */
                params += 3.0 * (double)L->exp_gate.rows * (double)L->exp_gate.cols;
        }
        const int forced = t->gemm != M40_GEMM_AUTO;
        g->gemm_f32 = forced ? t->gemm == M40_GEMM_F32 : params < 1e9;
        if (t->gemm_ignored[0])
            fprintf(stderr, "m40: M40_GEMM=%s is neither f16 nor f32: ignored\n", t->gemm_ignored);
        if (log_progress)
            fprintf(stderr, "m40: gpu %d: %.0fM parameters: prefill matmuls in %s%s\n", device, params / 1e6,
                    g->gemm_f32 ? "F32" : "F16 on the tensor cores", forced ? " (M40_GEMM)" : "");
    }

    uploader u = {.g = g, .log = log_progress, .t0 = now_s(), .status = cudaSuccess};
    u.total = dev_bytes(src->tok_embd);
    if (!output_is_embd(src))
        u.total += dev_bytes(src->output);
    for (int32_t l = 0; l < p->n_layers; l++) {
        const m40_layer *L = &src->layers[l];
        const m40_matrix *ms[] = {&L->wq, &L->wk, &L->wv, &L->wo, &L->w_gate, &L->w_up, &L->w_down};
        for (int i = 0; i < 7; i++)
            u.total += dev_bytes(ms[i]);
        if (L->router.data) {
            const int gu_f16 = !experts_native(&L->exp_gate) || !experts_native(&L->exp_up) ||
                               L->exp_gate.type != L->exp_up.type;
            u.total += experts_bytes(g, &L->exp_gate, gu_f16) + experts_bytes(g, &L->exp_up, gu_f16) +
                       experts_bytes(g, &L->exp_down, !experts_native(&L->exp_down));
        }
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
    gmat_describe(g, src->tok_embd, buf, &g->tok_embd);
    if (upload_matrix(&u, src->tok_embd, buf))
        goto fail_cuda;
    if (output_is_embd(src)) {
        g->output = g->tok_embd;
        g->output_shared = 1;
    } else {
        if (dev_alloc(g, &buf, dev_bytes(src->output), err, errlen, "output"))
            goto fail_upload;
        gmat_describe(g, src->output, buf, &g->output);
        if (upload_matrix(&u, src->output, buf))
            goto fail_cuda;
    }
    if (upload_vec(g, src->output_norm, p->dim, &g->output_norm, err, errlen) ||
        upload_vec(g, src->rope_freq_factors, p->rope_dim / 2, &g->rope_ff, err, errlen))
        goto fail_upload;
    if (g->sc.global_scale != 1.0f || g->sc.yarn) {
        /* theta_i = pos * base^(-2i/d) / factor_i: linear scaling is a constant factor,
         * on top of the file's factors where it has them; YaRN's ramp one more factor per
         * pair, for local layers too (yarn_ff) */
        const int32_t half = p->rope_dim / 2;
        float *ff = malloc((size_t)half * 2 * sizeof *ff), *yf = ff ? ff + half : NULL;
        if (!ff) {
            m40_set_err(err, errlen, "out of memory");
            goto fail_upload;
        }
        for (int32_t i = 0; i < half; i++) {
            yf[i] = g->sc.yarn ? yarn_ff(&g->sc, i) : 1.0f;
            ff[i] = (src->rope_freq_factors ? src->rope_freq_factors[i] : 1.0f) * g->sc.global_scale * yf[i];
        }
        int rc = upload_vec(g, ff, half, &g->rope_ff_global, err, errlen) ||
                 (g->sc.yarn && upload_vec(g, yf, half, &g->rope_ff_local, err, errlen));
        free(ff);
        if (rc)
            goto fail_upload;
    }
    if (g->sc.yarn) /* the magnitude on cos and sin of q and of k: q.k times its square */
        g->sc.attn_scale *= g->sc.yarn_mscale * g->sc.yarn_mscale;
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
        const float *wo_b[] = {L->bo};
        const m40_matrix *gu[] = {&L->w_gate, &L->w_up};
        const m40_matrix *dn[] = {&L->w_down};
        if (upload_vec(g, L->attn_norm, p->dim, &G->attn_norm, err, errlen) ||
            upload_vec(g, L->ffn_norm, p->dim, &G->ffn_norm, err, errlen) ||
            upload_proj(&u, qkv, 3, qkv_b, &G->qkv, err, errlen) || upload_proj(&u, wo, 1, wo_b, &G->wo, err, errlen) ||
            upload_vec(g, L->attn_sinks, p->n_heads, &G->sinks, err, errlen))
            goto fail_upload;
        /* the FFN: a mixture of experts where the layer has a router, else the dense one */
        if (L->router.data) {
            if (upload_moe(&u, L, l, G, err, errlen))
                goto fail_upload;
            g->moe = 1;
        } else if (upload_proj(&u, gu, 2, NULL, &G->gate_up, err, errlen) ||
                   upload_proj(&u, dn, 1, NULL, &G->down, err, errlen)) {
            goto fail_upload;
        }
        if (!L->q_norm != !L->k_norm) {
            m40_set_err(err, errlen, "layer %d has one of its Q/K norms but not the other", (int)l);
            goto fail_upload;
        }
        /* Per-head Q/K norms and post norms wherever the layer has them, independently. */
        if (L->q_norm && (upload_vec(g, L->q_norm, p->head_dim, &G->q_norm, err, errlen) ||
                          upload_vec(g, L->k_norm, p->head_dim, &G->k_norm, err, errlen)))
            goto fail_upload;
        if ((L->post_attn_norm && upload_vec(g, L->post_attn_norm, p->dim, &G->post_attn_norm, err, errlen)) ||
            (L->post_ffw_norm && upload_vec(g, L->post_ffw_norm, p->dim, &G->post_ffw_norm, err, errlen)))
            goto fail_upload;
        G->local = L->local;
        gproj *ps[] = {&G->qkv, &G->wo, &G->gate_up, &G->down};
        for (int i = 0; i < 4; i++)
            for (int j = 0; j < ps[i]->n_parts; j++) {
                gmat *m = &ps[i]->part[j];
                if (m->rows > max_rows)
                    max_rows = m->rows;
                if (m->type != M40K_TYPE_F32 && (m->type != M40K_TYPE_F16 || g->gemm_f32) &&
                    (!gemm_q_reads(g, m) || g->gemm_q_rows > 0)) {
                    any_tiled = 1;
                    if ((size_t)(m->rows * m->cols) > max_elems)
                        max_elems = (size_t)(m->rows * m->cols);
                }
            }
    }
    if (g->output.type != M40K_TYPE_F32 && (g->output.type != M40K_TYPE_F16 || g->gemm_f32) &&
        (!gemm_q_reads(g, &g->output) || g->gemm_q_rows > 0)) {
        any_tiled = 1;
        if ((size_t)(g->output.rows * g->output.cols) > max_elems)
            max_elems = (size_t)(g->output.rows * g->output.cols);
    }
    /* the expert FFN's row strides: 16-byte rows for F32 and F16 alike (kernels.h 10c-10h) */
    g->moe_ldx = ((int64_t)p->dim + 7) / 8 * 8;
    g->moe_ldh = ((int64_t)p->expert_ffn_dim + 7) / 8 * 8;
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
    if (g->invariant) { /* the last tile of a product on cuBLAS (inv_matmul): F32 or F16 rows */
        int64_t in_max = p->dim > p->ffn_dim ? p->dim : p->ffn_dim;
        if (g->q_dim > in_max)
            in_max = g->q_dim;
        /* output rows: as wide as any product's row stride (the head's vocabulary, the
         * fused [q; k; v] and [gate; up]) */
        int64_t out_max = max_rows > g->qkv_dim ? max_rows : g->qkv_dim;
        if (2 * (int64_t)p->ffn_dim > out_max)
            out_max = 2 * (int64_t)p->ffn_dim;
        e = cudaMalloc(&g->inv_x, (size_t)g->inv_rows * (size_t)in_max * 4);
        if (e == cudaSuccess)
            e = cudaMalloc((void **)&g->inv_y, (size_t)g->inv_rows * (size_t)out_max * 4);
        if (e != cudaSuccess) {
            m40_set_err(err, errlen, "gpu %d: cannot allocate the batch-invariant scratch: %s", device,
                        cudaGetErrorString(e));
            goto fail;
        }
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

#endif /* M40_HAVE_CUDA */
