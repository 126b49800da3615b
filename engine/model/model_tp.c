/* Tensor parallelism on the CPU: the twin of the GPU's split (gpu/tp.c), so that the
 * partition (tp_shard.c) and the places of its collectives in the forward pass are
 * tested without GPUs.
 *
 * A model loaded with options.tp = n > 1 on the CPU keeps n rank models beside it, and a
 * pool of n threads (started at load, so that a load fails cleanly where a forward call
 * could not). Each rank is a copy of the model object whose weights are its
 * shard's views, whose heads and FFN width are its share, with its own KV cache, scratch
 * and thread pool. A forward call runs the n ranks' forward passes at once, and the
 * ranks meet where the GPU ranks meet over NCCL: an all-reduce (sum) of the attention
 * output after Wo and of the FFN output after Wdown, and a gather of the head's
 * vocabulary pieces into the caller's logits. The collectives here are barriers over
 * shared memory; they sum in rank order, so every rank holds the same bits, as NCCL's
 * all-reduce gives every rank the same result. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model_priv.h"
#include "tp_shard.h"
#include "util/err.h"

struct m40_tp_group {
    int n;
    pthread_barrier_t bar;
    float **bufs;      /* each rank's buffer of the collective in progress */
    float *sum;        /* the all-reduce's result */
    size_t sum_cap;
    int failed;        /* the sum buffer could not grow: every rank's forward reports it */
};

/* One forward call's work for one rank (a task of the pool). */
typedef struct {
    m40_model *m;
    m40_kv *kv;
    m40_batch b;
    float *logits;
    int rc;
    char err[256];
} rank_job;

struct m40_tp_sim {
    int n;
    struct m40_tp_group group;
    m40_model **ranks;
    m40_tp_shard *shards;
    /* n threads, the caller one of them (started at load): a forward call is n tasks, task
     * r rank r's forward pass, all at once (util/threadpool.h) */
    m40_threadpool *crew;
    rank_job *jobs;
};

static void rank_task(void *ctx, int rank, int thread)
{
    (void)thread;
    rank_job *j = &((m40_tp_sim *)ctx)->jobs[rank];
    j->rc = m40_model_forward(j->m, j->kv, &j->b, j->logits, j->err, sizeof j->err);
}

void m40_tp_all_reduce(m40_model *m, float *buf, size_t count)
{
    struct m40_tp_group *g = m->tp_group;
    const int r = m->tp_rank, n = g->n;
    g->bufs[r] = buf;
    if (r == 0 && count > g->sum_cap) {
        float *s = realloc(g->sum, count * sizeof *s);
        if (s) {
            g->sum = s;
            g->sum_cap = count;
        } else {
            g->failed = 1;
        }
    }
    pthread_barrier_wait(&g->bar);
    if (!g->failed) { /* each rank sums its slice of the elements, ranks in order */
        size_t a = count * (size_t)r / (size_t)n, b = count * (size_t)(r + 1) / (size_t)n;
        for (size_t i = a; i < b; i++) {
            float s = 0.0f;
            for (int k = 0; k < n; k++)
                s += g->bufs[k][i];
            g->sum[i] = s;
        }
    }
    pthread_barrier_wait(&g->bar);
    if (!g->failed)
        memcpy(buf, g->sum, count * sizeof *buf);
    pthread_barrier_wait(&g->bar); /* nobody reuses sum before every rank has its copy */
}

void m40_tp_gather_logits(m40_model *m, float *local, int32_t n_out, float *logits)
{
    struct m40_tp_group *g = m->tp_group;
    g->bufs[m->tp_rank] = local;
    pthread_barrier_wait(&g->bar);
    if (m->tp_rank == 0 && logits) { /* rank r's rows are columns [r * stride, ...) of each logits row */
        const int64_t V = m->p.n_vocab, S = m->tp_vocab_stride;
        for (int k = 0; k < g->n; k++) {
            const int64_t c0 = (int64_t)k * S, w = k + 1 < g->n ? S : V - c0;
            for (int32_t t = 0; t < n_out; t++)
                memcpy(logits + (size_t)t * (size_t)V + (size_t)c0, g->bufs[k] + (size_t)t * (size_t)w,
                       (size_t)w * sizeof *logits);
        }
    }
    pthread_barrier_wait(&g->bar);
}

static void rank_free(m40_model *r)
{
    if (!r)
        return;
    m40_model_free_scratch(r);
    free(r->tp_logits);
    m40_threadpool_free(r->pool);
    free(r);
}

void m40_tp_sim_free(m40_tp_sim *s)
{
    if (!s)
        return;
    m40_threadpool_free(s->crew);
    free(s->jobs);
    for (int i = 0; i < s->n; i++) {
        if (s->ranks)
            rank_free(s->ranks[i]);
        if (s->shards)
            m40_tp_shard_free(&s->shards[i]);
    }
    free(s->ranks);
    free(s->shards);
    free(s->group.bufs);
    free(s->group.sum);
    pthread_barrier_destroy(&s->group.bar);
    free(s);
}

int m40_tp_sim_new(m40_model *m, int n, char *err, size_t errlen)
{
    if (m40_tp_check(&m->p, m->layers, n, err, errlen))
        return -1;
    m40_tp_sim *s = calloc(1, sizeof *s);
    if (!s || pthread_barrier_init(&s->group.bar, NULL, (unsigned)n) != 0) {
        free(s);
        m40_set_err(err, errlen, "out of memory");
        return -1;
    }
    s->n = n;
    s->group.n = n;
    s->group.bufs = calloc((size_t)n, sizeof *s->group.bufs);
    s->ranks = calloc((size_t)n, sizeof *s->ranks);
    s->shards = calloc((size_t)n, sizeof *s->shards);
    if (!s->group.bufs || !s->ranks || !s->shards) {
        m40_set_err(err, errlen, "out of memory");
        goto fail;
    }
    /* the model's threads shared out; the thread that runs a rank counts as one of its own */
    int per = m->n_threads / n > 0 ? m->n_threads / n : 1;
    for (int i = 0; i < n; i++) {
        if (m40_tp_shard_make(&m->p, &m->output, m->layers, i, n, &s->shards[i], err, errlen))
            goto fail;
        m40_model *r = malloc(sizeof *r);
        if (!r) {
            m40_set_err(err, errlen, "out of memory");
            goto fail;
        }
        *r = *m; /* the model's scalars, tokenizer and whole tensors (embeddings, norms) */
        m40_model_scratch_reset(r);
        r->tp = NULL;
        r->gpu = NULL;
        r->tp_group = &s->group;
        r->tp_rank = i;
        r->tp_logits = NULL;
        m40_tp_shard_params(&s->shards[i], &m->p, &r->p);
        r->q_dim = s->shards[i].q_dim;
        r->kv_dim = s->shards[i].kv_dim;
        r->layers = s->shards[i].layers;
        r->output = s->shards[i].output;
        r->tp_vocab_rows = s->shards[i].vocab_rows;
        r->tp_vocab_stride = s->shards[i].vocab_stride;
        r->pool = m40_threadpool_new(per);
        s->ranks[i] = r;
        if (!r->pool) {
            m40_set_err(err, errlen, "cannot start rank %d's thread pool", i);
            goto fail;
        }
        r->n_threads = m40_threadpool_size(r->pool);
    }
    s->jobs = calloc((size_t)n, sizeof *s->jobs);
    if (!s->jobs) {
        m40_set_err(err, errlen, "out of memory");
        goto fail;
    }
    if (!(s->crew = m40_threadpool_new(n))) {
        m40_set_err(err, errlen, "cannot start the %d threads of the simulated ranks", n);
        goto fail;
    }
    m->tp = s;
    return 0;
fail:
    m40_tp_sim_free(s);
    return -1;
}

int m40_tp_sim_kv(m40_tp_sim *s, m40_kv *kv, char *err, size_t errlen)
{
    kv->rank_kv = calloc((size_t)s->n, sizeof *kv->rank_kv);
    if (!kv->rank_kv) {
        m40_set_err(err, errlen, "out of memory");
        return -1;
    }
    kv->n_rank_kv = s->n;
    for (int i = 0; i < s->n; i++)
        if (!(kv->rank_kv[i] = m40_kv_new_opts(s->ranks[i], kv->n_slots, kv->ctx, NULL, err, errlen)))
            return -1;
    return 0;
}

int m40_tp_sim_forward(m40_tp_sim *s, m40_kv *kv, const m40_batch *b, float *logits, char *err, size_t errlen)
{
    if (!kv->rank_kv || kv->n_rank_kv != s->n) {
        m40_set_err(err, errlen, "the KV cache was made for another model");
        return -1;
    }
    int32_t n_out = 0;
    for (int32_t i = 0; i < b->n; i++)
        n_out += b->want_logits ? b->want_logits[i] != 0 : i == b->n - 1;
    /* Everything a rank could fail on comes first, serially: once the ranks run, one
     * that stopped early would leave the others waiting at a collective. */
    for (int i = 0; i < s->n; i++) {
        m40_model *r = s->ranks[i];
        const size_t rows = (size_t)(n_out > 0 ? n_out : 1);
        float *lg = realloc(r->tp_logits, rows * (size_t)r->tp_vocab_stride * sizeof *lg);
        if (!lg || m40_model_ensure_scratch(r, b->n, kv->ctx)) {
            if (lg)
                r->tp_logits = lg;
            m40_set_err(err, errlen, "out of memory for a batch of %d tokens", (int)b->n);
            return -1;
        }
        r->tp_logits = lg;
    }
    for (int i = 0; i < s->n; i++) {
        s->jobs[i] = (rank_job){.m = s->ranks[i], .kv = kv->rank_kv[i], .b = *b, .logits = i == 0 ? logits : NULL};
        s->jobs[i].b.argmax = NULL;
        s->jobs[i].b.logits_at = NULL;
        s->jobs[i].b.sample = NULL;
    }
    m40_threadpool_run(s->crew, s->n, rank_task, s);
    int rc = 0;
    for (int i = 0; i < s->n && rc == 0; i++)
        if (s->jobs[i].rc != 0 || s->group.failed) {
            rc = -1;
            m40_set_err(err, errlen, "rank %d: %s", i, s->group.failed ? "out of memory" : s->jobs[i].err);
        }
    s->group.failed = 0;
    return rc;
}
