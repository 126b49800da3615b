/* The GPU back end's paged KV pool: sized from the card's memory once the weights are
 * loaded (what gpu_memory_fraction leaves after everything in use and the activation
 * reserve of model_cuda_fwd.c), K and V in device memory, the blocks handed out by the
 * kv/ block manager, and the prefix cache's token records. */
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
    const char *cap = getenv("M40_KV_BLOCKS");
    if (cap && atoll(cap) > 0 && atoll(cap) < nb)
        nb = atoll(cap);
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
    m40_kv_blocks_params bp;
    m40_kv_blocks_params_default(&bp, kv->n_blocks);
    bp.block_size = M40K_PAGE;
    const char *pc = getenv("M40_PREFIX_CACHE"); /* "0": off (test and benchmark seam) */
    bp.prefix_cache = kv->prefix_cache = !(pc && strcmp(pc, "0") == 0);
    kv->mgr = m40_kv_blocks_new(&bp);
    kv->seqs = calloc((size_t)n_slots, sizeof *kv->seqs);
    kv->toks = calloc((size_t)n_slots, sizeof *kv->toks);
    kv->toks_cap = calloc((size_t)n_slots, sizeof *kv->toks_cap);
    if (!kv->mgr || !kv->seqs || !kv->toks || !kv->toks_cap) {
        m40_set_err(err, errlen, "out of memory for the KV block tables (%d blocks)", (int)nb);
        goto fail;
    }
    for (int32_t i = 0; i < n_slots; i++)
        if (!(kv->seqs[i] = m40_kv_seq_new(kv->mgr))) {
            m40_set_err(err, errlen, "out of memory for the KV block tables (%d slots)", (int)n_slots);
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
int m40_gpu_kv_toks_reserve(m40_gpu_kv *kv, int32_t slot, int32_t n)
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
    if (kv->prefix_cache && m40_gpu_kv_toks_reserve(kv, slot, n) != 0)
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

void m40_gpu_kv_prefix_forget(m40_gpu_kv *kv) { m40_kv_blocks_drop_idle(kv->mgr); }

#endif /* M40_HAVE_CUDA */
