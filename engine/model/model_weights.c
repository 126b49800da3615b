/* Shared helpers of the model backends: see model_internal.h. */
#include <stdint.h>
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

/* A matrix of n_mats * rows rows of cols elements from a tensor of n_dims dimensions
 * [cols, rows(, n_mats)]. The reader bounded every dimension (their product fits in
 * int64 and the data in the file); the byte count is still computed overflow-checked,
 * as hostile shapes must fail here, not wrap. */
static int weight_rows(const m40_gguf *g, const char *name, uint32_t n_dims, int64_t cols, int64_t rows,
                       int64_t n_mats, m40_matrix *out, char *err, size_t errlen)
{
    const m40_gguf_tensor *t = m40_weight_tensor(g, name, err, errlen);
    if (!t)
        return -1;
    if (t->n_dims != n_dims || t->ne[0] != (uint64_t)cols || t->ne[1] != (uint64_t)rows ||
        t->ne[2] != (uint64_t)n_mats || t->ne[3] != 1) {
        if (n_dims == 2)
            m40_set_err(err, errlen, "tensor '%s' has shape [%llu, %llu, %llu, %llu], expected [%lld, %lld]", name,
                        (unsigned long long)t->ne[0], (unsigned long long)t->ne[1], (unsigned long long)t->ne[2],
                        (unsigned long long)t->ne[3], (long long)cols, (long long)rows);
        else
            m40_set_err(err, errlen, "tensor '%s' has shape [%llu, %llu, %llu, %llu], expected [%lld, %lld, %lld]",
                        name, (unsigned long long)t->ne[0], (unsigned long long)t->ne[1],
                        (unsigned long long)t->ne[2], (unsigned long long)t->ne[3], (long long)cols, (long long)rows,
                        (long long)n_mats);
        return -1;
    }
    uint64_t row_bytes;
    if (m40_type_nbytes(t->type, (uint64_t)cols, &row_bytes) != 0) {
        m40_set_err(err, errlen, "tensor '%s': row length %lld is not a multiple of the %s block size", name,
                (long long)cols, m40_type_name(t->type));
        return -1;
    }
    uint64_t all_rows = (uint64_t)rows * (uint64_t)n_mats; /* both <= 2^31 (callers' bounds) */
    if (rows <= 0 || n_mats <= 0 || all_rows > (uint64_t)INT64_MAX || row_bytes > UINT64_MAX / all_rows ||
        row_bytes * all_rows > t->nbytes || row_bytes > SIZE_MAX) {
        m40_set_err(err, errlen, "tensor '%s': %llu bytes of data, %llu rows of %llu bytes needed", name,
                    (unsigned long long)t->nbytes, (unsigned long long)all_rows, (unsigned long long)row_bytes);
        return -1;
    }
    rows = (int64_t)all_rows;
    out->data = t->data;
    out->type = t->type;
    out->rows = rows;
    out->cols = cols;
    out->row_bytes = (size_t)row_bytes;
    return 0;
}

int m40_weight_matrix(const m40_gguf *g, const char *name, int64_t cols, int64_t rows, m40_matrix *out, char *err,
                      size_t errlen)
{
    return weight_rows(g, name, 2, cols, rows, 1, out, err, errlen);
}

int m40_weight_experts(const m40_gguf *g, const char *name, int64_t cols, int64_t rows, int64_t n_experts,
                       m40_matrix *out, char *err, size_t errlen)
{
    return weight_rows(g, name, 3, cols, rows, n_experts, out, err, errlen);
}

int m40_weight_table(const m40_gguf *g, const char *name, int64_t n_cols, int64_t n_rows, int optional,
                     float **out, char *err, size_t errlen)
{
    *out = NULL;
    if (optional && !m40_gguf_find_tensor(g, name))
        return 0;
    const m40_gguf_tensor *t = m40_weight_tensor(g, name, err, errlen);
    if (!t)
        return -1;
    if (n_cols <= 0 || n_rows <= 0 || t->ne[0] != (uint64_t)n_cols || t->ne[1] != (uint64_t)n_rows ||
        t->ne[2] != 1 || t->ne[3] != 1) {
        m40_set_err(err, errlen, "tensor '%s' has shape [%llu, %llu, %llu], expected [%lld, %lld]", name,
                    (unsigned long long)t->ne[0], (unsigned long long)t->ne[1], (unsigned long long)t->ne[2],
                    (long long)n_cols, (long long)n_rows);
        return -1;
    }
    uint64_t row_bytes, n = (uint64_t)n_cols * (uint64_t)n_rows;
    if (m40_type_nbytes(t->type, (uint64_t)n_cols, &row_bytes) != 0 || row_bytes > t->nbytes / (uint64_t)n_rows ||
        n > SIZE_MAX / sizeof(float)) {
        m40_set_err(err, errlen, "tensor '%s': %lld x %lld elements do not fit type %s", name, (long long)n_rows,
                    (long long)n_cols, m40_type_name(t->type));
        return -1;
    }
    float *v = malloc((size_t)n * sizeof *v);
    if (!v) {
        m40_set_err(err, errlen, "out of memory loading tensor '%s'", name);
        return -1;
    }
    for (int64_t r = 0; r < n_rows; r++)
        m40_dequantize_row(t->type, (const uint8_t *)t->data + (size_t)r * row_bytes, v + (size_t)r * (size_t)n_cols,
                           n_cols);
    *out = v;
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
