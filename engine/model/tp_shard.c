/* Tensor parallelism's partition of a model's weights into per-rank views (tp_shard.h). */
#include "tp_shard.h"

#include <stdlib.h>
#include <string.h>

#include "ref/ggml_types.h"
#include "util/err.h"

/* Rows [r0, r0 + n) of m. */
static m40_matrix rows_of(const m40_matrix *m, int64_t r0, int64_t n)
{
    m40_matrix v = *m;
    v.data = m->data + (size_t)r0 * m->row_bytes;
    v.rows = n;
    return v;
}

/* Columns [c0, c0 + n) of every row of m: the stride stays row_bytes (c0 on a block
 * boundary, checked by m40_tp_check). */
static m40_matrix cols_of(const m40_matrix *m, int64_t c0, int64_t n)
{
    m40_matrix v = *m;
    uint64_t off = 0;
    if (c0 > 0)
        m40_type_nbytes(m->type, (uint64_t)c0, &off);
    v.data = m->data + off;
    v.cols = n;
    return v;
}

/* Whether a run of `width` columns (every rank's) of m starts and ends on m's blocks. */
static int cols_split_ok(const m40_matrix *m, int64_t width)
{
    uint64_t b;
    return m40_type_nbytes(m->type, (uint64_t)width, &b) == 0;
}

static int64_t vocab_stride(const m40_model_params *p, int n) { return ((int64_t)p->n_vocab + n - 1) / n; }

int m40_tp_check(const m40_model_params *p, const m40_layer *layers, int n, char *err, size_t errlen)
{
    if (n < 1) {
        m40_set_err(err, errlen, "tensor parallelism needs at least 1 rank, not %d", n);
        return -1;
    }
    if (n == 1)
        return 0;
    if (p->n_experts > 0 || p->shared_ffn_dim > 0) {
        m40_set_err(err, errlen, "tensor parallelism does not split mixtures of experts yet (%d experts)",
                    (int)p->n_experts);
        return -1;
    }
    if (p->n_heads % n || p->n_kv_heads % n) {
        m40_set_err(err, errlen, "tp=%d does not divide the model's %d attention heads and %d KV heads", n,
                    (int)p->n_heads, (int)p->n_kv_heads);
        return -1;
    }
    if (p->ffn_dim % n) {
        m40_set_err(err, errlen, "tp=%d does not divide the model's FFN width %d", n, (int)p->ffn_dim);
        return -1;
    }
    if (vocab_stride(p, n) * (n - 1) >= p->n_vocab) {
        m40_set_err(err, errlen, "tp=%d leaves a rank without vocabulary rows (%d tokens)", n, (int)p->n_vocab);
        return -1;
    }
    const int64_t qd = (int64_t)p->n_heads * p->head_dim / n, fd = p->ffn_dim / n;
    for (int32_t l = 0; l < p->n_layers; l++) {
        const m40_layer *L = &layers[l];
        if (L->router.data || L->sh_gate.data) {
            m40_set_err(err, errlen, "tensor parallelism does not split mixtures of experts yet (layer %d)", (int)l);
            return -1;
        }
        if (!cols_split_ok(&L->wo, qd) || !cols_split_ok(&L->w_down, fd)) {
            const m40_type_info *a = m40_type_get(L->wo.type), *b = m40_type_get(L->w_down.type);
            m40_set_err(err, errlen,
                        "tp=%d splits layer %d's attention output (%s, blocks of %u) into %lld columns and its FFN "
                        "down projection (%s, blocks of %u) into %lld: each must be a whole number of blocks",
                        n, (int)l, m40_type_name(L->wo.type), a ? a->block_elems : 0, (long long)qd,
                        m40_type_name(L->w_down.type), b ? b->block_elems : 0, (long long)fd);
            return -1;
        }
    }
    return 0;
}

int m40_tp_shard_make(const m40_model_params *p, const m40_matrix *output, const m40_layer *layers, int rank, int n,
                      m40_tp_shard *out, char *err, size_t errlen)
{
    memset(out, 0, sizeof *out);
    out->rank = rank;
    out->n = n;
    out->n_heads = p->n_heads / n;
    out->n_kv_heads = p->n_kv_heads / n;
    out->ffn_dim = p->ffn_dim / n;
    out->q_dim = out->n_heads * p->head_dim;
    out->kv_dim = out->n_kv_heads * p->head_dim;
    out->vocab_stride = vocab_stride(p, n);
    out->vocab0 = (int64_t)rank * out->vocab_stride;
    out->vocab_rows = rank + 1 < n ? out->vocab_stride : p->n_vocab - out->vocab0;
    out->output = rows_of(output, out->vocab0, out->vocab_rows);
    out->layers = calloc((size_t)(p->n_layers > 0 ? p->n_layers : 1), sizeof *out->layers);
    if (!out->layers) {
        m40_set_err(err, errlen, "out of memory");
        return -1;
    }
    const int64_t q0 = (int64_t)rank * out->q_dim, k0 = (int64_t)rank * out->kv_dim;
    const int64_t f0 = (int64_t)rank * out->ffn_dim;
    for (int32_t l = 0; l < p->n_layers; l++) {
        const m40_layer *L = &layers[l];
        m40_layer *S = &out->layers[l];
        *S = *L; /* norms, flags and everything the split leaves whole */
        S->wq = rows_of(&L->wq, q0, out->q_dim);
        S->wk = rows_of(&L->wk, k0, out->kv_dim);
        S->wv = rows_of(&L->wv, k0, out->kv_dim);
        S->bq = L->bq ? L->bq + q0 : NULL;
        S->bk = L->bk ? L->bk + k0 : NULL;
        S->bv = L->bv ? L->bv + k0 : NULL;
        S->wo = cols_of(&L->wo, q0, out->q_dim);
        S->bo = rank == 0 ? L->bo : NULL;
        S->attn_sinks = L->attn_sinks ? L->attn_sinks + (size_t)rank * out->n_heads : NULL;
        S->w_gate = rows_of(&L->w_gate, f0, out->ffn_dim);
        S->w_up = rows_of(&L->w_up, f0, out->ffn_dim);
        S->w_down = cols_of(&L->w_down, f0, out->ffn_dim);
    }
    return 0;
}

void m40_tp_shard_free(m40_tp_shard *s)
{
    if (!s)
        return;
    free(s->layers);
    s->layers = NULL;
}

void m40_tp_shard_params(const m40_tp_shard *s, const m40_model_params *p, m40_model_params *out)
{
    *out = *p;
    out->n_heads = s->n_heads;
    out->n_kv_heads = s->n_kv_heads;
    out->ffn_dim = s->ffn_dim;
}
