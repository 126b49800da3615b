/* The GPU back end's paged KV pool: sized from the card's memory once the weights are
 * loaded (what gpu_memory_fraction leaves after everything in use and the activation
 * reserve of model_cuda_fwd.c) and K and V in device memory. Which block holds what is
 * kv/'s (paged_kv.c): this file sizes the pool and makes it. */
#ifdef M40_HAVE_CUDA

#include "model_cuda_int.h"

#include <stdio.h>
#include <string.h>

/* The blocks that fit g's card as o says (info: the accounting), or -1 with err. */
static int64_t kv_blocks_fit(m40_gpu *g, int32_t n_slots, const m40_kv_options *o, m40_kv_pool_info *info, char *err,
                             size_t errlen)
{
    cudaSetDevice(g->device);
    /* Bytes of one block over all layers, K and V. */
    size_t block_elems = (size_t)M40K_PAGE * (size_t)g->kv_dim;
    size_t block_bytes = block_elems * 2 * 2 * (size_t)g->p.n_layers;
    const float fraction = o->gpu_memory_fraction > 0.0f ? o->gpu_memory_fraction : M40_GPU_MEMORY_FRACTION_DEFAULT;
    const int32_t max_rows = o->max_step_rows > 0 ? o->max_step_rows : n_slots + 512;
    const int32_t max_out = o->max_step_out > 0 ? o->max_step_out : n_slots;
    size_t free_b = 0, total_b = 0;
    cudaError_t ce = cudaMemGetInfo(&free_b, &total_b);
    if (ce != cudaSuccess) {
        m40_set_err(err, errlen, "gpu %d: cudaMemGetInfo: %s", g->device, cudaGetErrorString(ce));
        return -1;
    }
    /* What this process may fill is fraction * total; everything on the card now counts
     * against it (weights, the dequantization scratch, the CUDA context and cuBLAS
     * handles, and other processes' memory), and so does the activation reserve. */
    double budget = (double)fraction * (double)total_b;
    double in_use = (double)(total_b - free_b);
    double reserve = (double)m40_gpu_step_reserve_bytes(g, n_slots, max_rows, max_out);
    info->total = (double)total_b;
    info->in_use = in_use;
    info->reserve = reserve;
    info->fraction = fraction;
    double room = budget - in_use - reserve; /* never more than free - reserve: fraction <= 1 */
    int64_t nb = room > 0 ? (int64_t)(room / (double)block_bytes) : 0;
    if (nb <= 0) {
        m40_set_err(err, errlen,
                    "gpu %d: no room for the KV cache: gpu_memory_fraction %.2f of %.1f GiB is %.1f GiB, but %.1f "
                    "GiB are in use (%.1f GiB of weights) and %.1f GiB are kept for the activations of steps of %d "
                    "tokens; a block of 16 tokens takes %.1f MiB (raise the memory fraction or lower max_seqs)",
                    g->device, fraction, total_b / 1073741824.0, budget / 1073741824.0, in_use / 1073741824.0,
                    g->weight_bytes / 1073741824.0, reserve / 1073741824.0, (int)max_rows, block_bytes / 1048576.0);
        return -1;
    }
    return nb;
}

/* K and V of nb blocks on kv->g's card. */
static int kv_alloc(m40_gpu_kv *kv, int64_t nb, char *err, size_t errlen)
{
    m40_gpu *g = kv->g;
    cudaSetDevice(g->device);
    size_t block_elems = (size_t)M40K_PAGE * (size_t)g->kv_dim;
    kv->n_blocks = (int32_t)nb;
    kv->layer_elems = (size_t)nb * block_elems;
    kv->info.pool = (double)nb * (double)block_elems * 2 * 2 * (double)g->p.n_layers;
    cudaError_t ce;
    if ((ce = cudaMalloc((void **)&kv->k, kv->layer_elems * 2 * (size_t)g->p.n_layers)) != cudaSuccess ||
        (ce = cudaMalloc((void **)&kv->v, kv->layer_elems * 2 * (size_t)g->p.n_layers)) != cudaSuccess) {
        m40_set_err(err, errlen, "gpu %d: cannot allocate a KV pool of %d blocks (%.2f GiB): %s", g->device, (int)nb,
                    kv->info.pool / 1073741824.0, cudaGetErrorString(ce));
        return -1;
    }
    return 0;
}

m40_gpu_kv *m40_gpu_kv_new(m40_gpu *g, int32_t n_slots, int32_t ctx, const m40_kv_options *o, char *err,
                           size_t errlen)
{
    if (n_slots <= 0 || ctx <= 0) {
        m40_set_err(err, errlen, "a KV pool needs at least one slot and a positive context");
        return NULL;
    }
    m40_gpu_kv *kv = calloc(1, sizeof *kv);
    if (!kv) {
        m40_set_err(err, errlen, "out of memory");
        return NULL;
    }
    kv->g = g;
    kv->n_slots = n_slots;
    kv->ctx = ctx;
    kv->pool_owned = 1;
    int64_t nb = kv_blocks_fit(g, n_slots, o, &kv->info, err, errlen);
    /* tensor parallelism: every rank holds the same blocks (of its heads), so the pool
     * has what the fullest card fits */
    for (int r = 1; nb > 0 && r < g->tp_n; r++) {
        m40_kv_pool_info ri;
        int64_t nr = kv_blocks_fit(m40_gpu_tp_rank(g, r), n_slots, o, &ri, err, errlen);
        if (nr < nb)
            nb = nr;
    }
    if (nb <= 0)
        goto fail;
    if (o->max_tokens > 0) {
        int64_t want = (o->max_tokens + M40K_PAGE - 1) / M40K_PAGE;
        if (want < nb)
            nb = want;
    }
    if (g->tuning.kv_blocks > 0 && g->tuning.kv_blocks < nb) /* M40_KV_BLOCKS: a test seam */
        nb = g->tuning.kv_blocks;
    if (nb > INT32_MAX / M40K_PAGE)
        nb = INT32_MAX / M40K_PAGE;
    if (kv_alloc(kv, nb, err, errlen))
        goto fail;
    /* M40_PREFIX_CACHE=0: off (test and benchmark seam). On under batch invariance too:
     * a cached prefix there leaves at least two prompt tokens to compute as a chunk
     * (scheduler.c first_chunk; BENCHMARKS.md, thirty-fifth session). */
    kv->pool = m40_paged_kv_new(n_slots, kv->n_blocks, M40K_PAGE, g->tuning.prefix_cache);
    if (!kv->pool) {
        m40_set_err(err, errlen, "out of memory for the KV block tables (%d blocks)", (int)nb);
        goto fail;
    }
    if (g->tp_n > 1) {
        kv->tp_kv = calloc((size_t)g->tp_n, sizeof *kv->tp_kv);
        if (!kv->tp_kv) {
            m40_set_err(err, errlen, "out of memory");
            goto fail;
        }
        for (int r = 1; r < g->tp_n; r++) {
            m40_gpu_kv *k = kv->tp_kv[r] = calloc(1, sizeof *k);
            if (!k) {
                m40_set_err(err, errlen, "out of memory");
                goto fail;
            }
            k->g = m40_gpu_tp_rank(g, r);
            k->n_slots = n_slots;
            k->ctx = ctx;
            k->pool = kv->pool; /* rank 0's tables: pool_owned 0 */
            k->info = kv->info;
            if (kv_alloc(k, nb, err, errlen))
                goto fail;
        }
        cudaSetDevice(g->device);
    }
    return kv;
fail:
    m40_gpu_kv_free(kv);
    return NULL;
}

void m40_gpu_kv_pool_info(const m40_gpu_kv *kv, m40_kv_pool_info *out) { *out = kv->info; }

void m40_gpu_kv_free(m40_gpu_kv *kv)
{
    if (!kv)
        return;
    for (int r = 1; kv->tp_kv && r < kv->g->tp_n; r++)
        m40_gpu_kv_free(kv->tp_kv[r]);
    free(kv->tp_kv);
    cudaSetDevice(kv->g->device);
    cudaStreamSynchronize(kv->g->stream);
    m40_gpu_graphs_free(kv->g); /* they read this pool */
    if (kv->pool_owned)
        m40_paged_kv_free(kv->pool);
    cudaFree(kv->k);
    cudaFree(kv->v);
    free(kv->csr_indptr);
    free(kv->csr_lpl);
    free(kv->csr_indices);
    free(kv);
}

m40_paged_kv *m40_gpu_kv_pool(m40_gpu_kv *kv) { return kv->pool; }

#endif /* M40_HAVE_CUDA */
