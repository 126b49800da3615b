/* The fast CPU path's weight products (cpu_matmul_fast.h).
 *
 * One pool run covers every matrix of one input (Q, K, V; gate and up): the rows of all
 * of them are cut into chunks in proportion to their work, several chunks a thread so
 * that uneven threads balance, and a small product runs on the caller alone because
 * waking the pool costs more than it. Within a chunk, tiles of TILE_ROWS weight rows
 * meet every token of the batch before the next tile is read, so a prefill of n tokens
 * reads the weights from memory once: PART_TOKENS tokens at a time, each row in pieces
 * of PART_BLOCKS blocks, the piece's records in L1 and the tile's rows in L2. */
#include "cpu_matmul_fast.h"

#include "ref/ggml_types.h"
#include "util/threadpool.h"

#include <string.h>

#define TILE_ROWS 16
/* Blocks of 32 in one range of a piecewise product (m40_dot_part_fn): PART_TOKENS
 * tokens' records of a range (20 KB) and the tile's 16 rows of it (9 KB of Q4_K) must
 * stay in L1 while the rows meet the tokens (with whole rows, every row read its tokens'
 * records of the whole width from L2 again; 64 blocks no longer fit). A multiple of 8
 * (K-quant super-blocks). */
#define PART_BLOCKS 32
/* Tokens a piecewise call takes (its widest register tile is 8: one unpack of a weight
 * block meets 8 tokens). */
#define PART_TOKENS 8
/* Tokens from which the tiled types take AMX's tiles (cpu_dot_amx.c) rather than the
 * one-token kernel a token: the same bits either way, and one tile op costs what it
 * costs for 16 tokens. */
#define TILE_MIN_TOKENS 4

int m40_fast_supported(const m40_matrix *w, int *quantized)
{
    int isa = m40_cpu_isa();
    if (w->cols % 32 == 0 && m40_dot_q_kernel(w->type, isa)) {
        *quantized = 1;
        return 1;
    }
    /* F32 rows are read in place: they must be float-aligned */
    if (m40_dot_f_kernel(w->type, isa) &&
        (w->type != M40_TYPE_F32 || ((uintptr_t)w->data % 4 == 0 && w->row_bytes % 4 == 0))) {
        *quantized = 0;
        return 1;
    }
    return 0;
}

typedef struct {
    const float *x;
    int64_t K;
    m40_xq *xq;
    float *xsum;
} quant_job;

static void quant_task(void *ctx, int task, int thread)
{
    quant_job *j = ctx;
    const size_t nb = (size_t)(j->K / 32);
    m40_xq_quantize(j->x + (size_t)task * (size_t)j->K, j->K, j->xq + (size_t)task * nb);
    m40_xq_sums(j->xq + (size_t)task * nb, (int64_t)nb, j->xsum + (size_t)task * nb);
}

void m40_fast_quantize(struct m40_threadpool *pool, const float *x, int32_t n, int64_t K, m40_xq *xq, float *xsum)
{
    quant_job j = {.x = x, .K = K, .xq = xq, .xsum = xsum};
    if (n * K < 16384) { /* a decode step: cheaper than a pool wake-up */
        for (int32_t t = 0; t < n; t++)
            quant_task(&j, t, 0);
        return;
    }
    m40_threadpool_run(pool, n, quant_task, &j);
}

typedef struct {
    const m40_matrix *w[M40_FAST_MAX_GROUP];
    float *out[M40_FAST_MAX_GROUP];
    m40_dot_q_fn dq[M40_FAST_MAX_GROUP];
    m40_dot_part_fn dpart[M40_FAST_MAX_GROUP]; /* piecewise (with dfin), or NULL */
    m40_dot_fin_fn dfin[M40_FAST_MAX_GROUP];
    m40_dot_f_fn df[M40_FAST_MAX_GROUP];
    m40_dot_tile_fn tile[M40_FAST_MAX_GROUP]; /* AMX tiles (with xp), or NULL */
    m40_dot_s_fn ds[M40_FAST_MAX_GROUP];      /* one token on split records (with xs), or NULL */
    int64_t rows_per_chunk[M40_FAST_MAX_GROUP];
    int first_task[M40_FAST_MAX_GROUP + 1]; /* matrix i's chunks: tasks first_task[i] .. first_task[i + 1] */
    int count;
    const float *x;
    const m40_xq *xq;
    const float *xsum;
    const void *xp;    /* the records prepared for the tiles (m40_dot_tile_prep), or NULL */
    const uint8_t *xs; /* the tokens' split records (m40_dot_split_prep), or NULL */
    size_t xs_bytes;   /* a token's */
    int32_t n;
} fast_job;

static void prep_task(void *ctx, int task, int thread)
{
    (void)thread;
    const fast_job *j = ctx;
    m40_dot_tile_prep(j->xq, j->xsum, j->w[0]->cols / 32, j->n, task, (void *)j->xp);
}

/* The prepared records go in the calling (engine) thread's scratch, slot 1 (slot 0 is
 * the tiles' staging, which the caller also uses when it runs tasks itself). */
static const void *prep_records(struct m40_threadpool *pool, fast_job *j)
{
    void *prep_buf = m40_thread_scratch(1, m40_dot_tile_prep_bytes(j->n, j->w[0]->cols));
    if (!prep_buf)
        return NULL; /* the one-token kernels instead: the same bits */
    j->xp = prep_buf;
    const int tiles = (j->n + 15) / 16;
    if (tiles == 1 || (int64_t)j->n * j->w[0]->cols < 16384)
        for (int t = 0; t < tiles; t++)
            prep_task(j, t, 0);
    else
        m40_threadpool_run(pool, tiles, prep_task, j);
    return prep_buf;
}

/* The tokens' split records, in the calling thread's scratch slot 1 (no tiles in the
 * same call); NULL without memory: the one-token kernels on the records, the same bits */
static const uint8_t *split_records(fast_job *j)
{
    const int64_t nb = j->w[0]->cols / 32;
    j->xs_bytes = m40_dot_split_bytes(nb);
    uint8_t *buf = m40_thread_scratch(1, j->xs_bytes * (size_t)j->n);
    if (!buf)
        return NULL;
    for (int32_t t = 0; t < j->n; t++)
        m40_dot_split_prep(j->xq + (size_t)t * (size_t)nb, nb, buf + j->xs_bytes * (size_t)t);
    j->xs = buf;
    return buf;
}

static void fast_task(void *ctx, int task, int thread)
{
    fast_job *j = ctx;
    int i = 0;
    while (task >= j->first_task[i + 1])
        i++;
    const m40_matrix *w = j->w[i];
    int64_t r0 = (int64_t)(task - j->first_task[i]) * j->rows_per_chunk[i];
    int64_t r1 = r0 + j->rows_per_chunk[i] < w->rows ? r0 + j->rows_per_chunk[i] : w->rows;
    const int64_t K = w->cols, nb = K / 32;
    const size_t rows = (size_t)w->rows;
    float *out = j->out[i];
    /* AMX: the chunk's rows against every token; without memory for its staging, the
     * one-token kernels below (a tiled type has no piecewise kernel): the same bits */
    if (j->tile[i] && j->xp &&
        j->tile[i](w->data + (size_t)r0 * w->row_bytes, w->row_bytes, (int)(r1 - r0), K, j->xp, j->n, out + r0,
                   (int64_t)rows) == 0)
        return;
    if (j->dpart[i] && j->n >= 4) { /* prefill: ranges of the row in L1, PART_TOKENS at a time */
        m40_dot_state st[TILE_ROWS][PART_TOKENS];
        for (int64_t t0 = r0; t0 < r1; t0 += TILE_ROWS) {
            const int64_t t1 = t0 + TILE_ROWS < r1 ? t0 + TILE_ROWS : r1;
            for (int32_t t = 0; t < j->n; t += PART_TOKENS) {
                const int nt = j->n - t < PART_TOKENS ? (int)(j->n - t) : PART_TOKENS;
                const m40_xq *xq = j->xq + (size_t)t * (size_t)nb;
                const float *xsum = j->xsum + (size_t)t * (size_t)nb;
                memset(st, 0, sizeof st);
                for (int64_t kb = 0; kb < nb; kb += PART_BLOCKS) {
                    const int64_t ke = kb + PART_BLOCKS < nb ? kb + PART_BLOCKS : nb;
                    for (int64_t r = t0; r < t1; r++)
                        j->dpart[i](w->data + (size_t)r * w->row_bytes, xq, xsum, nb, kb, ke, nt, st[r - t0]);
                }
                for (int64_t r = t0; r < t1; r++)
                    for (int k = 0; k < nt; k++)
                        out[(size_t)(t + k) * rows + (size_t)r] = j->dfin[i](&st[r - t0][k]);
            }
        }
        return;
    }
    for (int64_t t0 = r0; t0 < r1; t0 += TILE_ROWS) {
        int64_t t1 = t0 + TILE_ROWS < r1 ? t0 + TILE_ROWS : r1;
        for (int32_t t = 0; t < j->n; t++) {
            float *o = out + (size_t)t * rows;
            if (j->ds[i] && j->xs) {
                const uint8_t *xs = j->xs + j->xs_bytes * (size_t)t;
                const float *xsum = j->xsum + (size_t)t * (size_t)nb;
                for (int64_t r = t0; r < t1; r++)
                    o[r] = j->ds[i](w->data + (size_t)r * w->row_bytes, xs, xsum, K);
            } else if (j->dq[i]) {
                const m40_xq *xq = j->xq + (size_t)t * (size_t)nb;
                const float *xsum = j->xsum + (size_t)t * (size_t)nb;
                for (int64_t r = t0; r < t1; r++)
                    o[r] = j->dq[i](w->data + (size_t)r * w->row_bytes, xq, xsum, K);
            } else {
                const float *x = j->x + (size_t)t * (size_t)K;
                for (int64_t r = t0; r < t1; r++)
                    o[r] = j->df[i](w->data + (size_t)r * w->row_bytes, x, K);
            }
        }
    }
}

void m40_fast_matmul(struct m40_threadpool *pool, int n_threads, const m40_matrix *const *ws, float *const *outs,
                     int count, const float *x, const m40_xq *xq, const float *xsum, int32_t n)
{
    fast_job j = {.count = count, .x = x, .xq = xq, .xsum = xsum, .n = n};
    int isa = m40_cpu_isa();
    int64_t work = 0;
    for (int i = 0; i < count; i++) {
        j.w[i] = ws[i];
        j.out[i] = outs[i];
        int quantized = 0;
        m40_fast_supported(ws[i], &quantized);
        j.dq[i] = quantized ? m40_dot_q_kernel(ws[i]->type, isa) : NULL;
        j.dpart[i] = quantized ? m40_dot_part_kernel(ws[i]->type, isa) : NULL;
        j.dfin[i] = quantized ? m40_dot_fin_kernel(ws[i]->type, isa) : NULL;
        if (!j.dfin[i])
            j.dpart[i] = NULL;
        j.df[i] = quantized ? NULL : m40_dot_f_kernel(ws[i]->type, isa);
        j.tile[i] = quantized && n >= TILE_MIN_TOKENS ? m40_dot_tile_kernel(ws[i]->type, isa) : NULL;
        j.ds[i] = quantized && !j.tile[i] ? m40_dot_s_kernel(ws[i]->type, isa) : NULL;
        work += ws[i]->rows * ws[i]->cols * n;
    }
    for (int i = 0; i < count; i++)
        if (j.tile[i]) {
            if (!prep_records(pool, &j))
                for (int k = 0; k < count; k++)
                    j.tile[k] = NULL;
            break;
        }
    for (int i = 0; i < count && !j.xp; i++)
        if (j.ds[i]) {
            split_records(&j);
            break;
        }
    /* about 4 chunks a thread over the whole group, each matrix its share by its work;
     * tiny groups (the test models) as one chunk each, on the caller */
    int64_t target = work < 65536 || n_threads <= 1 ? 0 : work / (4 * (int64_t)n_threads);
    int tasks = 0;
    for (int i = 0; i < count; i++) {
        const m40_matrix *w = ws[i];
        int64_t chunks = target > 0 ? (w->rows * w->cols * n + target - 1) / target : 1;
        if (chunks > w->rows)
            chunks = w->rows;
        if (chunks < 1)
            chunks = 1;
        j.rows_per_chunk[i] = (w->rows + chunks - 1) / chunks;
        if (j.tile[i]) /* whole tiles of 16 rows */
            j.rows_per_chunk[i] = (j.rows_per_chunk[i] + 15) / 16 * 16;
        j.first_task[i] = tasks;
        tasks += (int)((w->rows + j.rows_per_chunk[i] - 1) / j.rows_per_chunk[i]);
    }
    j.first_task[count] = tasks;
    if (target == 0) {
        for (int t = 0; t < tasks; t++)
            fast_task(&j, t, 0);
        return;
    }
    m40_threadpool_run(pool, tasks, fast_task, &j);
}
