/* Shared helpers of the model backends: see model_internal.h. */
#include <stdio.h>
#include <stdlib.h>

#include "ref/ggml_types.h"
#include "model_internal.h"
#include "ref/quant.h"

const m40_gguf_tensor *m40_weight_tensor(const m40_gguf *g, const char *name, char *err, size_t errlen)
{
    const m40_gguf_tensor *t = m40_gguf_find_tensor(g, name);
    if (!t) {
        m40_set_err(err, errlen, "tensor '%s' is missing", name);
        return NULL;
    }
    if (!m40_type_supported(t->type)) {
        m40_set_err(err, errlen, "tensor '%s' has type %s which is not supported", name, m40_type_name(t->type));
        return NULL;
    }
    return t;
}

int m40_weight_matrix(const m40_gguf *g, const char *name, int64_t cols, int64_t rows, m40_matrix *out, char *err,
                      size_t errlen)
{
    const m40_gguf_tensor *t = m40_weight_tensor(g, name, err, errlen);
    if (!t)
        return -1;
    if (t->n_dims != 2 || t->ne[0] != (uint64_t)cols || t->ne[1] != (uint64_t)rows) {
        m40_set_err(err, errlen, "tensor '%s' has shape [%llu, %llu, %llu, %llu], expected [%lld, %lld]", name,
                (unsigned long long)t->ne[0], (unsigned long long)t->ne[1], (unsigned long long)t->ne[2],
                (unsigned long long)t->ne[3], (long long)cols, (long long)rows);
        return -1;
    }
    uint64_t row_bytes;
    if (m40_type_nbytes(t->type, (uint64_t)cols, &row_bytes) != 0) {
        m40_set_err(err, errlen, "tensor '%s': row length %lld is not a multiple of the %s block size", name,
                (long long)cols, m40_type_name(t->type));
        return -1;
    }
    if (row_bytes * (uint64_t)rows > t->nbytes) {
        m40_set_err(err, errlen, "tensor '%s': %llu bytes of data, %llu needed", name, (unsigned long long)t->nbytes,
                (unsigned long long)(row_bytes * (uint64_t)rows));
        return -1;
    }
    out->data = t->data;
    out->type = t->type;
    out->rows = rows;
    out->cols = cols;
    out->row_bytes = (size_t)row_bytes;
    return 0;
}

int m40_weight_vector(const m40_gguf *g, const char *name, int64_t n, int optional, float **out, char *err,
                      size_t errlen)
{
    *out = NULL;
    if (optional && !m40_gguf_find_tensor(g, name))
        return 0;
    const m40_gguf_tensor *t = m40_weight_tensor(g, name, err, errlen);
    if (!t)
        return -1;
    if (t->n_elems != (uint64_t)n || t->ne[0] != (uint64_t)n) {
        m40_set_err(err, errlen, "tensor '%s' has shape [%llu, %llu], expected [%lld]", name,
                (unsigned long long)t->ne[0], (unsigned long long)t->ne[1], (long long)n);
        return -1;
    }
    uint64_t nbytes;
    if (m40_type_nbytes(t->type, (uint64_t)n, &nbytes) != 0 || nbytes > t->nbytes) {
        m40_set_err(err, errlen, "tensor '%s': %lld elements do not fit type %s", name, (long long)n,
                m40_type_name(t->type));
        return -1;
    }
    float *v = malloc((size_t)n * sizeof *v);
    if (!v) {
        m40_set_err(err, errlen, "out of memory loading tensor '%s'", name);
        return -1;
    }
    m40_dequantize_row(t->type, t->data, v, n);
    *out = v;
    return 0;
}
