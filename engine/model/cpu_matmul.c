/* The CPU backends' weight product (model.c): rows of W split into
 * tasks over the thread pool, each row dequantized once into the thread's row buffer
 * and dotted with every token's input. */
#include <stdint.h>

#include "model_internal.h"
#include "ref/quant.h"
#include "util/threadpool.h"
#include "ref/ggml_types.h"

typedef struct {
    const m40_matrix *w;
    const float *x; /* [n][w->cols] */
    float *out;     /* [n][w->rows] */
    int32_t n;
    int64_t rows_per_task;
    float *row_buf;
    size_t row_buf_len;
} cpu_matmul_job;

static void cpu_matmul_task(void *ctx, int task, int thread)
{
    cpu_matmul_job *j = ctx;
    const m40_matrix *w = j->w;
    int64_t r0 = (int64_t)task * j->rows_per_task;
    int64_t r1 = r0 + j->rows_per_task < w->rows ? r0 + j->rows_per_task : w->rows;
    float *buf = j->row_buf + (size_t)thread * j->row_buf_len;
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *src = w->data + (size_t)r * w->row_bytes;
        const float *row = buf;
        if (w->type == M40_TYPE_F32 && ((uintptr_t)src % sizeof(float)) == 0)
            row = (const float *)(const void *)src;
        else
            m40_dequantize_row(w->type, src, buf, w->cols);
        for (int32_t t = 0; t < j->n; t++)
            j->out[(size_t)t * (size_t)w->rows + (size_t)r] =
                m40_dot_f32(row, j->x + (size_t)t * (size_t)w->cols, w->cols);
    }
}

void m40_cpu_matmul(m40_threadpool *pool, int n_threads, float *row_buf, size_t row_buf_len, const m40_matrix *w,
                    const float *x, int32_t n, float *out)
{
    cpu_matmul_job j = {.w = w, .x = x, .out = out, .n = n, .row_buf = row_buf, .row_buf_len = row_buf_len};
    /* Several tasks per thread balance uneven thread speed; tiny products (the test
     * models) run on the caller because waking the pool costs more than the work. */
    int64_t work = w->rows * w->cols * n;
    int n_tasks = work < 32768 ? 1 : n_threads * 4;
    if (n_tasks > w->rows)
        n_tasks = (int)w->rows;
    j.rows_per_task = (w->rows + n_tasks - 1) / n_tasks;
    n_tasks = (int)((w->rows + j.rows_per_task - 1) / j.rows_per_task);
    m40_threadpool_run(pool, n_tasks, cpu_matmul_task, &j);
}
