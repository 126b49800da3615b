/* Thread pool: every task runs exactly once per job, thread indices stay in range, the
 * pool is reusable for many jobs, and run returns only when all tasks are done. */
#include <stdatomic.h>

#include "check.h"
#include "util/threadpool.h"

#define MAX_TASKS 1000

typedef struct {
    atomic_int runs[MAX_TASKS];
    atomic_int bad_thread;
    atomic_int threads_seen[8];
    int size;
} job;

static void task(void *ctx, int t, int thread)
{
    job *j = ctx;
    atomic_fetch_add(&j->runs[t], 1);
    if (thread < 0 || thread >= j->size)
        atomic_store(&j->bad_thread, 1);
    else if (thread < 8)
        atomic_store(&j->threads_seen[thread], 1);
    /* a little uneven work so tasks overlap on several threads */
    volatile double x = 0;
    for (int i = 0; i < (t % 7) * 200; i++)
        x += i;
}

static void check_pool(int n_threads)
{
    m40_threadpool *p = m40_threadpool_new(n_threads);
    CHECK(p != NULL, "pool of %d", n_threads);
    if (!p)
        return;
    CHECK(m40_threadpool_size(p) == n_threads, "size %d, want %d", m40_threadpool_size(p), n_threads);
    static job j;
    int all_once = 1, in_range = 1;
    for (int rep = 0; rep < 120; rep++) {
        int n = rep % 3 == 0 ? 1 : rep % 3 == 1 ? 7 : MAX_TASKS;
        memset(&j, 0, sizeof j);
        j.size = n_threads;
        m40_threadpool_run(p, n, task, &j);
        /* No synchronization beyond run's return: results must already be complete. */
        for (int t = 0; t < MAX_TASKS; t++)
            if (atomic_load(&j.runs[t]) != (t < n ? 1 : 0))
                all_once = 0;
        if (atomic_load(&j.bad_thread))
            in_range = 0;
    }
    CHECK(all_once, "%d threads: every task ran exactly once in every job", n_threads);
    CHECK(in_range, "%d threads: thread indices within 0..%d", n_threads, n_threads - 1);
    m40_threadpool_run(p, 0, task, &j); /* no tasks: returns at once */

    /* start / wait: the tasks run while the caller does something else, every one exactly
     * once, done by wait's return; jobs of start/wait and run alternate on one pool */
    int async_once = 1;
    for (int rep = 0; rep < 60; rep++) {
        int n = rep % 4 == 0 ? 1 : rep % 4 == 1 ? 3 : MAX_TASKS;
        memset(&j, 0, sizeof j);
        j.size = n_threads;
        m40_threadpool_start(p, n, task, &j);
        volatile double x = 0; /* the caller's own work meanwhile */
        for (int i = 0; i < (rep % 5) * 5000; i++)
            x += i;
        m40_threadpool_wait(p);
        for (int t = 0; t < MAX_TASKS; t++)
            if (atomic_load(&j.runs[t]) != (t < n ? 1 : 0))
                async_once = 0;
        if (rep % 3 == 0) {
            m40_threadpool_wait(p); /* a second wait without a job returns at once */
            memset(&j, 0, sizeof j);
            j.size = n_threads;
            m40_threadpool_run(p, 7, task, &j);
            for (int t = 0; t < 7; t++)
                if (atomic_load(&j.runs[t]) != 1)
                    async_once = 0;
        }
    }
    CHECK(async_once, "%d threads: start/wait ran every task exactly once", n_threads);
    m40_threadpool_start(p, 0, task, &j); /* no tasks: nothing to wait for */
    m40_threadpool_wait(p);
    m40_threadpool_free(p);
}

int main(void)
{
    check_pool(1);
    check_pool(2);
    check_pool(4);
    m40_threadpool *p = m40_threadpool_new(0);
    CHECK(p != NULL && m40_threadpool_size(p) >= 1, "0 threads means the online CPUs");
    m40_threadpool_free(p);
    return check_done();
}
