/* The fast CPU path's weight products (cpu_matmul_fast.c): int16 activations against the
 * quantized weight blocks, F16 and F32 weights through FMA (cpu_dot.h), rows split
 * over the thread pool. Private to engine/model/. */
#ifndef M40_CPU_MATMUL_FAST_H
#define M40_CPU_MATMUL_FAST_H

#include <stdint.h>

#include "cpu_dot.h"
#include "gpu/model_gpu.h" /* m40_matrix */

struct m40_threadpool;

/* Products of one input in one pool run: at most this many matrices (Q, K and V). */
#define M40_FAST_MAX_GROUP 4

/* 1 when the fast path multiplies w on this CPU (else the caller takes the exact path):
 * *quantized says whether it reads the int16 records (else the F32 input). */
int m40_fast_supported(const m40_matrix *w, int *quantized);

/* The records of the n inputs x [n][K] (K a multiple of 32) into xq [n][K/32] and their
 * s into xsum [n][K/32] (m40_xq_sums), the tokens split over the pool when there are
 * many. */
void m40_fast_quantize(struct m40_threadpool *pool, const float *x, int32_t n, int64_t K, m40_xq *xq, float *xsum);

/* outs[i][t][r] = ws[i] row r . x[t] for the count (<= M40_FAST_MAX_GROUP) matrices,
 * each supported (m40_fast_supported) and all as wide as x (K = cols); xq and xsum the
 * records of x and their sums (m40_fast_quantize), read by the quantized ones. One pool
 * run over row chunks of all of them; within a chunk, tiles of rows meet every token
 * while they are in cache (prefill: in pieces of the row, a few tokens at a time). Each
 * (row, token) product is computed the same way whatever n and the split, so batched
 * and unbatched results agree bit for bit. */
void m40_fast_matmul(struct m40_threadpool *pool, int n_threads, const m40_matrix *const *ws, float *const *outs,
                     int count, const float *x, const m40_xq *xq, const float *xsum, int32_t n);

#endif
