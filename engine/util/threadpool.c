/* Persistent pthread pool. A job is published under the mutex with a new generation
 * number; every worker wakes, claims task indices from an atomic counter until none
 * are left, and checks out. The caller works too and then waits until every worker
 * has checked out, so the job's fields are never changed while a worker still reads
 * them. */
#include "threadpool.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <unistd.h>

struct m40_threadpool {
    int n_threads;              /* including the caller */
    pthread_t *threads;         /* n_threads - 1 workers */
    int n_started;

    pthread_mutex_t mu;
    pthread_cond_t start;       /* workers wait here for a new generation */
    pthread_cond_t done;        /* the caller waits here for the last check-out */
    unsigned long generation;
    int n_checked_out;
    int quit;
    int pending;                /* a published job not yet waited for (caller's side only) */

    /* the current job */
    m40_task_fn fn;
    void *ctx;
    int n_tasks;
    atomic_int next_task;
};

static void work_on_job(m40_threadpool *p, int thread)
{
    for (;;) {
        int t = atomic_fetch_add_explicit(&p->next_task, 1, memory_order_relaxed);
        if (t >= p->n_tasks)
            break;
        p->fn(p->ctx, t, thread);
    }
}

typedef struct {
    m40_threadpool *pool;
    int index;
} worker_arg;

static void *worker_main(void *arg)
{
    worker_arg *wa = arg;
    m40_threadpool *p = wa->pool;
    int index = wa->index;
    free(wa);

    unsigned long seen = 0;
    pthread_mutex_lock(&p->mu);
    for (;;) {
        while (!p->quit && p->generation == seen)
            pthread_cond_wait(&p->start, &p->mu);
        if (p->quit)
            break;
        seen = p->generation;
        pthread_mutex_unlock(&p->mu);

        work_on_job(p, index);

        pthread_mutex_lock(&p->mu);
        if (++p->n_checked_out == p->n_threads - 1)
            pthread_cond_signal(&p->done);
    }
    pthread_mutex_unlock(&p->mu);
    return NULL;
}

m40_threadpool *m40_threadpool_new(int n_threads)
{
    if (n_threads <= 0) {
        long n = sysconf(_SC_NPROCESSORS_ONLN);
        n_threads = n > 0 ? (int)n : 1;
    }
    m40_threadpool *p = calloc(1, sizeof *p);
    if (!p)
        return NULL;
    p->n_threads = n_threads;
    atomic_init(&p->next_task, 0);
    if (pthread_mutex_init(&p->mu, NULL) != 0) {
        free(p);
        return NULL;
    }
    pthread_cond_init(&p->start, NULL);
    pthread_cond_init(&p->done, NULL);
    if (n_threads > 1) {
        p->threads = calloc((size_t)n_threads - 1, sizeof *p->threads);
        if (!p->threads) {
            m40_threadpool_free(p);
            return NULL;
        }
    }
    for (int i = 1; i < n_threads; i++) {
        worker_arg *wa = malloc(sizeof *wa);
        if (!wa) {
            m40_threadpool_free(p);
            return NULL;
        }
        wa->pool = p;
        wa->index = i;
        if (pthread_create(&p->threads[i - 1], NULL, worker_main, wa) != 0) {
            free(wa);
            m40_threadpool_free(p);
            return NULL;
        }
        p->n_started++;
    }
    return p;
}

void m40_threadpool_free(m40_threadpool *p)
{
    if (!p)
        return;
    pthread_mutex_lock(&p->mu);
    p->quit = 1;
    pthread_cond_broadcast(&p->start);
    pthread_mutex_unlock(&p->mu);
    for (int i = 0; i < p->n_started; i++)
        pthread_join(p->threads[i], NULL);
    free(p->threads);
    pthread_cond_destroy(&p->start);
    pthread_cond_destroy(&p->done);
    pthread_mutex_destroy(&p->mu);
    free(p);
}

int m40_threadpool_size(const m40_threadpool *p)
{
    return p->n_threads;
}

static void publish(m40_threadpool *p, int n_tasks, m40_task_fn fn, void *ctx)
{
    pthread_mutex_lock(&p->mu);
    p->fn = fn;
    p->ctx = ctx;
    p->n_tasks = n_tasks;
    atomic_store(&p->next_task, 0);
    p->n_checked_out = 0;
    p->generation++;
    p->pending = 1;
    pthread_cond_broadcast(&p->start);
    pthread_mutex_unlock(&p->mu);
}

void m40_threadpool_wait(m40_threadpool *p)
{
    if (!p->pending)
        return;
    work_on_job(p, 0);
    pthread_mutex_lock(&p->mu);
    while (p->n_checked_out < p->n_threads - 1)
        pthread_cond_wait(&p->done, &p->mu);
    p->pending = 0;
    pthread_mutex_unlock(&p->mu);
}

void m40_threadpool_start(m40_threadpool *p, int n_tasks, m40_task_fn fn, void *ctx)
{
    if (n_tasks <= 0)
        return;
    if (p->n_threads == 1) {
        for (int t = 0; t < n_tasks; t++)
            fn(ctx, t, 0);
        return;
    }
    publish(p, n_tasks, fn, ctx);
}

void m40_threadpool_run(m40_threadpool *p, int n_tasks, m40_task_fn fn, void *ctx)
{
    if (n_tasks <= 0)
        return;
    /* Waking workers costs more than it saves for a single task. */
    if (p->n_threads == 1 || n_tasks == 1) {
        for (int t = 0; t < n_tasks; t++)
            fn(ctx, t, 0);
        return;
    }
    publish(p, n_tasks, fn, ctx);
    m40_threadpool_wait(p);
}
