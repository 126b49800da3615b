/* The GPU back end's paged KV pool: sized from the card's memory once the weights are
 * loaded (what gpu_memory_fraction leaves after everything in use and the activation
 * reserve of model_cuda_fwd.c) and K and V in device memory. Which block holds what is
 * kv/'s (paged_kv.c): this file sizes the pool and makes it. */
#ifdef M40_HAVE_CUDA

#include "model_cuda_int.h"

#include <stdio.h>
#include <string.h>

m40_gpu_kv *m40_gpu_kv_new(m40_gpu *g, int32_t n_slots, int32_t ctx, const m40_kv_options *o, char *err,
                           size_t errlen)
{
    if (n_slots <= 0 || ctx <= 0) {
        m40_set_err(err, errlen, "a KV pool needs at least one slot and a positive context");
        return NULL;
    }
    cudaSetDevice(g->device);
    m40_gpu_kv *kv = calloc(1, sizeof *kv);
    if (!kv) {
        m40_set_err(err, errlen, "out of memory");
        return NULL;
    }
    kv->g = g;
    kv->n_slots = n_slots;
    kv->ctx = ctx;
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
        goto fail;
    }
    /* What this process may fill is fraction * total; everything on the card now counts
     * against it (weights, the dequantization scratch, the CUDA context and cuBLAS
     * handles, and other processes' memory), and so does the activation reserve. */
    double budget = (double)fraction * (double)total_b;
    double in_use = (double)(total_b - free_b);
    double reserve = (double)m40_gpu_step_reserve_bytes(g, n_slots, max_rows, max_out);
    kv->info.total = (double)total_b;
    kv->info.in_use = in_use;
    kv->info.reserve = reserve;
    kv->info.fraction = fraction;
    double room = budget - in_use - reserve; /* never more than free - reserve: fraction <= 1 */
    int64_t nb = room > 0 ? (int64_t)(room / (double)block_bytes) : 0;
    if (nb <= 0) {
        m40_set_err(err, errlen,
                    "gpu %d: no room for the KV cache: gpu_memory_fraction %.2f of %.1f GiB is %.1f GiB, but %.1f "
                    "GiB are in use (%.1f GiB of weights) and %.1f GiB are kept for the activations of steps of %d "
                    "tokens; a block of 16 tokens takes %.1f MiB (raise the memory fraction or lower max_seqs)",
                    g->device, fraction, total_b / 1073741824.0, budget / 1073741824.0, in_use / 1073741824.0,
                    g->weight_bytes / 1073741824.0, reserve / 1073741824.0, (int)max_rows, block_bytes / 1048576.0);
        goto fail;
    }
    if (o->max_tokens > 0) {
        int64_t want = (o->max_tokens + M40K_PAGE - 1) / M40K_PAGE;
        if (want < nb)
            nb = want;
    }
    if (g->tuning.kv_blocks > 0 && g->tuning.kv_blocks < nb) /* M40_KV_BLOCKS: a test seam */
        nb = g->tuning.kv_blocks;
    if (nb > INT32_MAX / M40K_PAGE)
        nb = INT32_MAX / M40K_PAGE;
    kv->n_blocks = (int32_t)nb;
    kv->layer_elems = (size_t)nb * block_elems;
    kv->info.pool = (double)nb * (double)block_bytes;
    if ((ce = cudaMalloc((void **)&kv->k, kv->layer_elems * 2 * (size_t)g->p.n_layers)) != cudaSuccess ||
        (ce = cudaMalloc((void **)&kv->v, kv->layer_elems * 2 * (size_t)g->p.n_layers)) != cudaSuccess) {
        m40_set_err(err, errlen, "gpu %d: cannot allocate a KV pool of %d blocks (%.2f GiB): %s", g->device,
                    (int)nb, kv->info.pool / 1073741824.0, cudaGetErrorString(ce));
        goto fail;
    }
    /* M40_PREFIX_CACHE=0: off (test and benchmark seam) */
    kv->pool = m40_paged_kv_new(n_slots, kv->n_blocks, M40K_PAGE, g->tuning.prefix_cache);
    if (!kv->pool) {
        m40_set_err(err, errlen, "out of memory for the KV block tables (%d blocks)", (int)nb);
        goto fail;
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
    cudaSetDevice(kv->g->device);
    cudaStreamSynchronize(kv->g->stream);
    m40_gpu_graphs_free(kv->g); /* they read this pool */
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
