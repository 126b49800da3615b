/* Persistent pthread pool. A job is published by a new generation number; every worker
 * sees it, claims task indices from an atomic counter until none are left, and checks
 * out. The caller works too and then waits until every worker has checked out, so the
 * job's fields are never changed while a worker still reads them.
 *
 * Why the spinning: a forward pass of a small model on the CPU is hundreds of jobs of
 * 10-100 us each. With workers that sleep on a condition variable between jobs, every job
 * paid a futex wake-up and a sleep on each side (perf on SmolLM2-135M decode: a fifth of
 * the samples in the kernel's scheduler, the second core idle a quarter of the time,
 * BENCHMARKS.md). Now a worker polls the generation for a while (SPIN_NS) after its last
 * job and the caller polls the check-outs, and both fall back to the condition variables
 * only after that: jobs back to back never sleep, an idle pool does. The sleep and the
 * wake-up are race-free because each side writes its own flag (sleepers, caller_waits)
 * before it reads the other side's counter, with sequentially consistent atomics. */
#include "threadpool.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

/* how long a worker (or the caller) polls before it sleeps: a few jobs' worth */
#define SPIN_NS 200000

struct m40_threadpool {
    int n_threads;              /* including the caller */
    pthread_t *threads;         /* n_threads - 1 workers */
    int n_started;

    pthread_mutex_t mu;
    pthread_cond_t start;       /* sleeping workers wait here for a new generation */
    pthread_cond_t done;        /* the sleeping caller waits here for the last check-out */
    atomic_ulong generation;
    atomic_int n_checked_out;
    atomic_int sleepers;        /* workers asleep on start, or about to be */
    atomic_int caller_waits;    /* the caller asleep on done, or about to be */
    atomic_int quit;
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

static long long now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static inline void cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* Polls until done(p) holds or SPIN_NS pass: 1 when it holds. The clock is read every
 * 64 polls; a yield every 1,024 lets another thread have the core on a busy machine. */
static int spin_until(m40_threadpool *p, int (*done)(m40_threadpool *, unsigned long), unsigned long arg)
{
    long long t0 = 0;
    for (unsigned i = 1;; i++) {
        if (done(p, arg))
            return 1;
        cpu_relax();
        if (i % 64 == 0) {
            long long t = now_ns();
            if (!t0)
                t0 = t;
            else if (t - t0 > SPIN_NS)
                return 0;
            if (i % 1024 == 0)
                sched_yield();
        }
    }
}

static int new_job_or_quit(m40_threadpool *p, unsigned long seen)
{
    return atomic_load(&p->generation) != seen || atomic_load(&p->quit);
}

static int all_checked_out(m40_threadpool *p, unsigned long unused)
{
    (void)unused;
    return atomic_load(&p->n_checked_out) >= p->n_threads - 1;
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
    for (;;) {
        if (!spin_until(p, new_job_or_quit, seen)) {
            pthread_mutex_lock(&p->mu);
            atomic_fetch_add(&p->sleepers, 1);
            while (!new_job_or_quit(p, seen))
                pthread_cond_wait(&p->start, &p->mu);
            atomic_fetch_sub(&p->sleepers, 1);
            pthread_mutex_unlock(&p->mu);
        }
        if (atomic_load(&p->quit))
            break;
        seen = atomic_load(&p->generation);

        work_on_job(p, index);

        if (atomic_fetch_add(&p->n_checked_out, 1) + 1 == p->n_threads - 1 && atomic_load(&p->caller_waits)) {
            pthread_mutex_lock(&p->mu);
            pthread_cond_signal(&p->done);
            pthread_mutex_unlock(&p->mu);
        }
    }
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
    atomic_init(&p->generation, 0);
    atomic_init(&p->n_checked_out, 0);
    atomic_init(&p->sleepers, 0);
    atomic_init(&p->caller_waits, 0);
    atomic_init(&p->quit, 0);
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
    atomic_store(&p->quit, 1);
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
    p->fn = fn;
    p->ctx = ctx;
    p->n_tasks = n_tasks;
    atomic_store(&p->next_task, 0);
    atomic_store(&p->n_checked_out, 0);
    p->pending = 1;
    atomic_fetch_add(&p->generation, 1); /* the job's fields before it (sequentially consistent) */
    if (atomic_load(&p->sleepers)) {
        pthread_mutex_lock(&p->mu);
        pthread_cond_broadcast(&p->start);
        pthread_mutex_unlock(&p->mu);
    }
}

void m40_threadpool_wait(m40_threadpool *p)
{
    if (!p->pending)
        return;
    work_on_job(p, 0);
    if (!spin_until(p, all_checked_out, 0)) {
        pthread_mutex_lock(&p->mu);
        atomic_store(&p->caller_waits, 1);
        while (!all_checked_out(p, 0))
            pthread_cond_wait(&p->done, &p->mu);
        atomic_store(&p->caller_waits, 0);
        pthread_mutex_unlock(&p->mu);
    }
    p->pending = 0;
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
