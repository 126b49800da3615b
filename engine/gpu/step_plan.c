/* The GPU back end, part 3: the plan of one forward step (m40_gpu_forward calls it
 * before any device work), once kv/ has reserved the step's KV blocks and grouped its
 * rows by slot (decoding slots, one new token each, first: the decode attention kernel
 * takes the first n_dec rows). The small integer tables every kernel of the step reads
 * (permuted tokens and positions, q_indptr, the CSR block tables, the logit rows) are
 * written to pinned memory and sent up in one copy; the attention split counts are
 * chosen from the longest decoding sequence, bucketed, so that a decode step's CUDA
 * graph serves many lengths. */
#ifdef M40_HAVE_CUDA

#include "model_cuda_int.h"

#include <stdio.h>
#include <string.h>

/* The most workspace the prefill key splits may take (64 MB): the split count is
 * lowered to fit. */
#define M40_PREFILL_SPLIT_WS_FLOATS ((size_t)16 << 20)

static int ensure_ints(m40_gpu *g, size_t n)
{
    if (n <= g->ints_cap)
        return 0;
    m40_gpu_graphs_free(g);
    n = n < 4096 ? 4096 : n * 2;
    cudaFreeHost(g->ints_h);
    g->ints_h = NULL;
    if (grow_dev((void **)&g->ints_d, n * 4) || cudaHostAlloc((void **)&g->ints_h, n * 4, cudaHostAllocDefault))
        return -1;
    g->ints_cap = n;
    return 0;
}

/* The attention workspace (decode splits, prefill key splits) holds need floats. */
static int ensure_ws(m40_gpu *g, size_t need, char *err, size_t errlen)
{
    if (need <= g->ws_cap)
        return 0;
    m40_gpu_graphs_free(g);
    if (grow_dev((void **)&g->ws, need * 4)) {
        g->ws_cap = 0;
        m40_set_err(err, errlen, "gpu %d: out of memory for the attention workspace", g->device);
        return -1;
    }
    g->ws_cap = need;
    return 0;
}

int m40_gpu_plan_step(m40_gpu *g, const m40_kv_step *st, const m40_batch *b, int32_t n_out, step_plan *sp, char *err,
                      size_t errlen)
{
    const m40_model_params *p = &g->p;
    const int32_t n = b->n;
    const int32_t n_grp = st->n_grp, n_dec = st->n_dec;
    const int32_t *grp_slot = st->slot;
    m40_kv_seq *const *grp_seq = st->seq;
    /* Host tables: permuted tokens and positions, q_indptr, CSR, logit rows. */
    int32_t total_blocks = 0, max_len = 0; /* max_len: of the decoding groups */
    int32_t pmax_len = 0;                    /* of the prefilling ones */
    for (int32_t j = 0; j < n_grp; j++) {
        total_blocks += m40_kv_seq_n_blocks(grp_seq[j]);
        const int32_t len = m40_kv_seq_len(grp_seq[j]);
        if (j < n_dec && len > max_len)
            max_len = len;
        if (j >= n_dec && len > pmax_len)
            pmax_len = len;
    }
    /* layout: key[2] tokens[n] pos[n] row_seq[n] q_indptr[n_grp+1] indptr[n_grp+1] lpl[n_grp] out_rows[n_out]
     * indices[]; key: the greedy pick's 64-bit key (kernels.h 9c), zeroed by this copy every step */
    size_t o_tok = 2, o_pos = o_tok + (size_t)n, o_rs = o_pos + (size_t)n, o_qi = o_rs + (size_t)n, o_ip = o_qi + (size_t)n_grp + 1,
           o_lpl = o_ip + (size_t)n_grp + 1, o_out = o_lpl + (size_t)n_grp, o_idx = o_out + (size_t)n_out;
    size_t n_ints = o_idx + (size_t)total_blocks;
    if (ensure_ints(g, n_ints)) {
        m40_set_err(err, errlen, "gpu %d: out of memory for the batch tables", g->device);
        return -1;
    }
    int32_t *H = g->ints_h;
    /* The previous call's logits copy has completed (it synchronized), so H is free. */
    H[0] = H[1] = 0;
    int32_t r = 0;
    H[o_qi] = 0;
    for (int32_t j = 0; j < n_grp; j++) {
        for (int32_t i = 0; i < n; i++)
            if (b->slot[i] == grp_slot[j]) {
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
    if (m40_kv_blocks_csr((const m40_kv_seq *const *)grp_seq, n_grp, H + o_ip, H + o_idx, total_blocks,
                          H + o_lpl) < 0) {
        m40_set_err(err, errlen, "block table export failed");
        return -1;
    }
    int32_t *D = g->ints_d;
    const int32_t *d_tok = D + o_tok, *d_pos = D + o_pos, *d_rs = D + o_rs, *d_qi = D + o_qi, *d_ip = D + o_ip,
                  *d_lpl = D + o_lpl, *d_out = D + o_out, *d_idx = D + o_idx;
    if (g->time_steps)
        CK(cudaEventRecord(g->step_ev[0], g->stream));
    CK(cudaMemcpyAsync(D, H, n_ints * 4, cudaMemcpyHostToDevice, g->stream));

    /* Attention kernel choice: decode kernel for the first n_dec groups, prefill for the rest.
     * Split counts follow the longest decoding sequence rounded up to a power of two (at
     * least 32): a decode step's graph (run_step) is then reused across many lengths. */
    int G = p->n_heads / p->n_kv_heads;
    int hd = p->head_dim;
    int tuned = (hd == 64 || hd == 128 || hd == 256) && G >= 1 && G <= 8;
    int splits = 1, splits_local = 1;
    const int window = g->sc.window; /* 0 where no layer is local */
    if (tuned && n_dec > 0) {
        int64_t bucket = 32;
        while (bucket < max_len)
            bucket *= 2;
        max_len = bucket < INT32_MAX ? (int32_t)bucket : INT32_MAX;
        splits = m40k_decode_pick_splits(n_dec, p->n_kv_heads, max_len, g->sm_count);
        if (splits < 1)
            splits = 1;
        /* sliding-window layers read at most `window` positions: fewer splits */
        splits_local = window > 0 && window < max_len
                           ? m40k_decode_pick_splits(n_dec, p->n_kv_heads, window, g->sm_count)
                           : splits;
        if (g->invariant) /* one split count whatever else the step holds (model_cuda_int.h) */
            splits = splits_local = g->inv_splits;
        if (splits_local < 1)
            splits_local = 1;
        size_t need_ws = m40k_decode_workspace_floats(n_dec, p->n_heads, hd, splits > splits_local ? splits : splits_local);
        if (ensure_ws(g, need_ws, err, errlen))
            return -1;
        /* the split counters start zeroed and every decode call leaves them so: zeroed
         * here only when (re)allocated, on the stream, before the first call uses them */
        size_t need_cnt = splits > 1 || splits_local > 1 ? m40k_decode_counter_ints(n_dec, p->n_kv_heads) : 0;
        if (need_cnt > g->att_cnt_cap) {
            m40_gpu_graphs_free(g);
            if (grow_dev((void **)&g->att_cnt, need_cnt * sizeof *g->att_cnt) ||
                cudaMemsetAsync(g->att_cnt, 0, need_cnt * sizeof *g->att_cnt, g->stream) != cudaSuccess) {
                g->att_cnt_cap = 0;
                m40_set_err(err, errlen, "gpu %d: out of memory for the attention split counters", g->device);
                return -1;
            }
            g->att_cnt_cap = need_cnt;
        }
    }
    /* Prefill rows after a long context: the tensor-core kernel's keys split (kernels.h
     * 7d); the windowed layers see at most window + the chunk. The decode kernel of the
     * same step has finished with the shared workspace when the prefill one starts. */
    int psplits = 1, psplits_local = 1;
    if (tuned && n_grp > n_dec && m40k_attn_prefill_tc_supported(hd)) {
        const int32_t pn = n - n_dec, pseqs = n_grp - n_dec;
        psplits = m40k_attn_prefill_pick_splits(pn, pseqs, p->n_heads, p->n_kv_heads, hd, pmax_len, g->sm_count,
                                                M40_PREFILL_SPLIT_WS_FLOATS);
        psplits_local = window > 0 && window + pn < pmax_len
                            ? m40k_attn_prefill_pick_splits(pn, pseqs, p->n_heads, p->n_kv_heads, hd, window + pn,
                                                            g->sm_count, M40_PREFILL_SPLIT_WS_FLOATS)
                            : psplits;
        if (g->invariant) /* a prompt row's sums over its keys in one walk, however it is chunked */
            psplits = psplits_local = 1;
        const int most = psplits > psplits_local ? psplits : psplits_local;
        if (most > 1 &&
            ensure_ws(g, m40k_attn_prefill_split_ws_floats(pn, pseqs, p->n_heads, p->n_kv_heads, hd, most), err, errlen))
            return -1;
    }
    *sp = (step_plan){n, n_dec, n_grp, n_out, tuned, splits, splits_local,
                      d_tok, d_pos, d_rs, d_qi, d_ip, d_lpl, d_out, d_idx, NULL, psplits, psplits_local};
    return 0;
}

#endif /* M40_HAVE_CUDA */
