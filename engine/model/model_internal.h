/* Helpers shared by the model backends (model.c, model_cuda.c) and
 * eval.c: validated views of GGUF weight tensors (and, through util/err.h, error
 * messages). Not public API. */
#ifndef M40_MODEL_INTERNAL_H
#define M40_MODEL_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include "gguf/gguf.h"
#include "gpu/model_gpu.h"
#include "util/err.h" /* m40_set_err */

/* The tensor `name`, which must exist and have a type the CPU backend supports. */
const m40_gguf_tensor *m40_weight_tensor(const m40_gguf *g, const char *name, char *err, size_t errlen);

/* A 2-D weight of `rows` rows of `cols` elements (GGUF ne = [cols, rows]), checked for
 * shape, block alignment of the rows and data size. */
int m40_weight_matrix(const m40_gguf *g, const char *name, int64_t cols, int64_t rows, m40_matrix *out, char *err,
                      size_t errlen);

/* A 3-D stack of n_experts matrices of `rows` rows of `cols` elements (GGUF ne = [cols,
 * rows, n_experts], the experts' ffn_*_exps), checked like m40_weight_matrix and seen as
 * one matrix of n_experts * rows rows (expert e: rows [e * rows, (e + 1) * rows)). */
int m40_weight_experts(const m40_gguf *g, const char *name, int64_t cols, int64_t rows, int64_t n_experts,
                       m40_matrix *out, char *err, size_t errlen);

/* A 2-D tensor of n_rows rows of n_cols elements (GGUF ne = [n_cols, n_rows]; n_rows 1
 * also accepts a 1-D tensor) converted to an owned F32 array [n_rows][n_cols]: the
 * experts' biases. optional and absent: 0 with *out NULL. */
int m40_weight_table(const m40_gguf *g, const char *name, int64_t n_cols, int64_t n_rows, int optional,
                     float **out, char *err, size_t errlen);

/* A 1-D tensor of n elements converted to an owned F32 array. optional and absent:
 * 0 with *out NULL. */
int m40_weight_vector(const m40_gguf *g, const char *name, int64_t n, int optional, float **out, char *err,
                      size_t errlen);

/* Dot product of two float vectors: 8 running sums, combined pairwise (the CPU
 * backends' one summation order, so their results agree bit for bit). */
static inline float m40_dot_f32(const float *a, const float *b, int64_t n)
{
    float s[8] = {0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++)
            s[j] += a[i + j] * b[i + j];
    for (; i < n; i++)
        s[0] += a[i] * b[i];
    return ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
}

/* out[t] = W x[t] for the n token vectors of x (x [n][w->cols], out [n][w->rows]) on
 * the thread pool; row_buf holds row_buf_len floats (>= w->cols) per pool thread. */
struct m40_threadpool;
void m40_cpu_matmul(struct m40_threadpool *pool, int n_threads, float *row_buf, size_t row_buf_len,
                    const m40_matrix *w, const float *x, int32_t n, float *out);

/* A batch row's sampling parameters (model.h) as the sampling kernel and its twin take
 * them (kernels.h 9b): no penalties, repetition 1. */
#include "kernels.h"
#include "model/model.h"
void m40_row_sample_params(const m40_row_sample *r, m40k_sample_params *out);

#endif
