/* A small persistent pthread pool for the CPU backend's data-parallel loops (matmul
 * rows, attention heads). Threads are created once and sleep between jobs, so a
 * forward pass with hundreds of small matmuls pays no thread-creation cost.
 *
 * One job at a time: m40_threadpool_run must not be called concurrently on the same
 * pool (the model that owns a pool is itself single-threaded from the caller's view). */
#ifndef M40_THREADPOOL_H
#define M40_THREADPOOL_H

typedef struct m40_threadpool m40_threadpool;

/* Runs task number `task` (0..n_tasks). `thread` is the index (0..size) of the thread
 * running it, so tasks can use per-thread scratch buffers without locking. */
typedef void (*m40_task_fn)(void *ctx, int task, int thread);

/* n_threads threads in all, the caller of m40_threadpool_run counting as one (so
 * n_threads - 1 are created). n_threads <= 0: the number of online CPUs. NULL when a
 * thread cannot be created or memory runs out. */
m40_threadpool *m40_threadpool_new(int n_threads);
void m40_threadpool_free(m40_threadpool *p);
int m40_threadpool_size(const m40_threadpool *p);

/* Runs fn for every task in 0..n_tasks, spread over the pool's threads (tasks are
 * claimed one by one, so uneven tasks balance themselves), and returns when all are
 * done. With one thread or one task everything runs on the caller. With no more tasks
 * than threads, a task may wait for another (tensor parallelism's ranks meet at their
 * collectives): a thread claims a task only when it is free, so a task that waits keeps
 * its thread and the tasks not yet claimed go to the threads that are free. A thread may
 * still run two tasks one after the other, where the first finished without waiting. */
void m40_threadpool_run(m40_threadpool *p, int n_tasks, m40_task_fn fn, void *ctx);

/* The same job in two halves, so that the caller can do other work meanwhile (the
 * engine thread runs a GPU step while the pool computes grammar masks):
 * m40_threadpool_start publishes the job to the workers and returns at once; the caller
 * must then call m40_threadpool_wait, which works on what is left (as thread 0) and
 * returns when every task is done. No other call on the pool in between. With one
 * thread, start runs every task itself before it returns. */
void m40_threadpool_start(m40_threadpool *p, int n_tasks, m40_task_fn fn, void *ctx);
void m40_threadpool_wait(m40_threadpool *p);

#endif
