/* The JSON of large request bodies, parsed on a thread of the worker.
 *
 * jansson takes about 10 ms of CPU for a 1 MB body. On the event loop that is 10 ms
 * during which no running stream gets a token (tests/stress, phase stall). Bodies of
 * NGX_HTTP_M40_JSON_THREAD_MIN or more are parsed here instead; the request waits
 * (NGX_DONE) and is resumed by ngx_http_m40_json_event when its job comes back.
 *
 * One thread per worker (nginx's thread pools are not in every build), a queue of
 * pending jobs and a queue of parsed ones under one mutex, and an eventfd in the event
 * loop that the thread writes after each job. A body nginx kept in a temp file is
 * read by the thread too (a dup of the file's fd): copying 1 MB into fresh memory
 * costs the event loop a third of a millisecond. The thread touches only a job's
 * data, len, fd, file_pos, read_err, root, err and state; everything else, and freeing
 * jobs, is the event loop's.
 * A request that goes away cancels its job: still pending, it is freed at once;
 * being parsed or parsed, its result is freed when the event loop picks it up.
 *
 * jansson is thread-safe for separate values; the one thing the threads share is the
 * hash seed of its objects, set once (json_object_seed) before the thread starts. */
#include "ngx_http_m40_module.h"
#include "util/thread_prio.h"

#include <pthread.h>
#include <signal.h>
#include <sys/eventfd.h>


typedef enum {
    NGX_HTTP_M40_JOB_PENDING = 0,
    NGX_HTTP_M40_JOB_RUNNING,
    NGX_HTTP_M40_JOB_DONE
} ngx_http_m40_job_state_e;


typedef struct {
    pthread_mutex_t           mu;
    pthread_cond_t            cv;
    pthread_t                 thread;
    ngx_http_m40_json_job_t  *pending;       /* FIFO: head and tail */
    ngx_http_m40_json_job_t  *pending_tail;
    ngx_http_m40_json_job_t  *done;
    ngx_http_m40_json_job_t  *done_tail;
    int                       efd;
    ngx_connection_t         *conn;          /* efd in the event loop */
    unsigned                  stop:1;
    unsigned                  running:1;     /* the thread was started */
} ngx_http_m40_json_pool_t;


/* Per worker process (set in init_process, after fork). */
static ngx_http_m40_json_pool_t  ngx_http_m40_json_pool = { .efd = -1 };

static void *ngx_http_m40_json_thread(void *arg);
static void ngx_http_m40_json_event(ngx_event_t *rev);


static void
ngx_http_m40_json_append(ngx_http_m40_json_job_t **head,
    ngx_http_m40_json_job_t **tail, ngx_http_m40_json_job_t *job)
{
    job->next = NULL;

    if (*tail) {
        (*tail)->next = job;
    } else {
        *head = job;
    }

    *tail = job;
}


ngx_int_t
ngx_http_m40_json_init(ngx_cycle_t *cycle)
{
    int                        rc;
    sigset_t                   all, old;
    ngx_http_m40_json_pool_t  *jp;

    jp = &ngx_http_m40_json_pool;

    if (jp->running) {
        return NGX_OK;
    }

    /* Before any thread can create an object: jansson seeds its hash tables lazily
     * otherwise, and two threads could race for it. */
    json_object_seed(0);

    jp->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (jp->efd == -1) {
        ngx_log_error(NGX_LOG_ALERT, cycle->log, ngx_errno,
                      "m40: eventfd() for the JSON thread failed: large "
                      "request bodies are parsed on the event loop");
        return NGX_ERROR;
    }

    if (pthread_mutex_init(&jp->mu, NULL) != 0) {
        goto failed_mutex;
    }

    if (pthread_cond_init(&jp->cv, NULL) != 0) {
        pthread_mutex_destroy(&jp->mu);
        goto failed_mutex;
    }

    jp->conn = ngx_http_m40_eventfd_add(jp->efd, ngx_http_m40_json_event, jp,
                                        "JSON thread's", cycle->log);
    if (jp->conn == NULL) {
        goto failed_sync;
    }

    /* nginx's signals must stay on nginx's thread: the new thread inherits the mask */
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    rc = pthread_create(&jp->thread, NULL, ngx_http_m40_json_thread, jp);
    pthread_sigmask(SIG_SETMASK, &old, NULL);

    if (rc != 0) {
        ngx_log_error(NGX_LOG_ALERT, cycle->log, rc,
                      "m40: cannot start the JSON thread: large request bodies "
                      "are parsed on the event loop");
        ngx_http_m40_eventfd_del(jp->conn);
        jp->conn = NULL;
        goto failed_sync;
    }

    jp->stop = 0;
    jp->running = 1;

    return NGX_OK;

failed_mutex:

    ngx_log_error(NGX_LOG_ALERT, cycle->log, 0,
                  "m40: cannot create the JSON thread's mutex: large request "
                  "bodies are parsed on the event loop");
    goto failed;

failed_sync:

    pthread_cond_destroy(&jp->cv);
    pthread_mutex_destroy(&jp->mu);

failed:

    (void) close(jp->efd);
    jp->efd = -1;

    return NGX_ERROR;
}


void
ngx_http_m40_json_job_free(ngx_http_m40_json_job_t *job)
{
    if (job->root) {
        json_decref(job->root);
    }

    if (job->fd != NGX_INVALID_FILE) {
        (void) close(job->fd);
    }

    ngx_free(job->data);
    ngx_free(job);
}


/* Worker exit (a reload's old worker, a stop): the thread ends after the job it is
 * parsing; the jobs it leaves belong to requests that end with the process. */
void
ngx_http_m40_json_exit(ngx_cycle_t *cycle)
{
    ngx_http_m40_json_job_t   *job, *next;
    ngx_http_m40_json_pool_t  *jp;

    jp = &ngx_http_m40_json_pool;

    if (!jp->running) {
        return;
    }

    pthread_mutex_lock(&jp->mu);
    jp->stop = 1;
    pthread_cond_signal(&jp->cv);
    pthread_mutex_unlock(&jp->mu);

    pthread_join(jp->thread, NULL);
    jp->running = 0;

    for (job = jp->pending; job; job = next) {
        next = job->next;
        ngx_http_m40_json_job_free(job);
    }

    for (job = jp->done; job; job = next) {
        next = job->next;
        ngx_http_m40_json_job_free(job);
    }

    jp->pending = jp->pending_tail = NULL;
    jp->done = jp->done_tail = NULL;

    ngx_http_m40_eventfd_del(jp->conn);
    jp->conn = NULL;

    if (close(jp->efd) == -1) {
        ngx_log_error(NGX_LOG_ALERT, cycle->log, ngx_errno,
                      "m40: close() of the JSON thread's eventfd failed");
    }
    jp->efd = -1;

    pthread_cond_destroy(&jp->cv);
    pthread_mutex_destroy(&jp->mu);
}


ngx_http_m40_json_job_t *
ngx_http_m40_json_job_create(size_t len, ngx_log_t *log)
{
    ngx_http_m40_json_job_t  *job;

    if (!ngx_http_m40_json_pool.running) {
        return NULL;
    }

    job = ngx_calloc(sizeof(ngx_http_m40_json_job_t), log);
    if (job == NULL) {
        return NULL;
    }

    /* malloc'd, not from the request's pool: the request may end while the thread
     * reads it */
    job->data = ngx_alloc(len ? len : 1, log);
    if (job->data == NULL) {
        ngx_free(job);
        return NULL;
    }

    job->len = len;
    job->fd = NGX_INVALID_FILE;

    return job;
}


void
ngx_http_m40_json_submit(ngx_http_m40_json_job_t *job)
{
    ngx_http_m40_json_pool_t  *jp;

    jp = &ngx_http_m40_json_pool;

    pthread_mutex_lock(&jp->mu);
    job->state = NGX_HTTP_M40_JOB_PENDING;
    ngx_http_m40_json_append(&jp->pending, &jp->pending_tail, job);
    pthread_cond_signal(&jp->cv);
    pthread_mutex_unlock(&jp->mu);
}


void
ngx_http_m40_json_cancel(ngx_http_m40_json_job_t *job)
{
    ngx_http_m40_json_job_t   **pp, *prev;
    ngx_http_m40_json_pool_t   *jp;

    jp = &ngx_http_m40_json_pool;

    pthread_mutex_lock(&jp->mu);

    if (job->state == NGX_HTTP_M40_JOB_PENDING) {
        /* not started: out of the queue, and nothing to wait for */
        prev = NULL;
        for (pp = &jp->pending; *pp; pp = &(*pp)->next) {
            if (*pp == job) {
                *pp = job->next;
                if (jp->pending_tail == job) {
                    jp->pending_tail = prev;
                }
                break;
            }
            prev = *pp;
        }

        pthread_mutex_unlock(&jp->mu);

        ngx_http_m40_json_job_free(job);
        return;
    }

    pthread_mutex_unlock(&jp->mu);

    /* being parsed, or parsed and not yet picked up: ngx_http_m40_json_event frees
     * it (only the event loop reads cancelled) */
    job->cancelled = 1;
}


/* On the thread: the body from its temp file (nginx has written it: this reads the
 * page cache), then the fd is closed. */
static void
ngx_http_m40_json_read(ngx_http_m40_json_job_t *job)
{
    size_t   done;
    ssize_t  n;

    for (done = 0; done < job->len; done += (size_t) n) {
        n = pread(job->fd, job->data + done, job->len - done,
                  job->file_pos + (off_t) done);

        if (n == -1 && errno == EINTR) {
            n = 0;
            continue;
        }

        if (n <= 0) {
            job->read_err = n == 0 ? EIO : errno;   /* 0: the file is shorter */
            break;
        }
    }

    (void) close(job->fd);
    job->fd = NGX_INVALID_FILE;
}


static void *
ngx_http_m40_json_thread(void *arg)
{
    ngx_http_m40_json_pool_t *jp = arg;

    ssize_t                   n;
    uint64_t                  one;
    ngx_http_m40_json_job_t  *job;

    one = 1;

    /* the engine thread and this worker's event loop first (thread_prio.h) */
    m40_thread_background(M40_BACKGROUND_NICE);

    for ( ;; ) {
        pthread_mutex_lock(&jp->mu);

        while (!jp->stop && jp->pending == NULL) {
            pthread_cond_wait(&jp->cv, &jp->mu);
        }

        if (jp->stop) {
            pthread_mutex_unlock(&jp->mu);
            return NULL;
        }

        job = jp->pending;
        jp->pending = job->next;
        if (jp->pending == NULL) {
            jp->pending_tail = NULL;
        }
        job->state = NGX_HTTP_M40_JOB_RUNNING;

        pthread_mutex_unlock(&jp->mu);

        if (job->fd != NGX_INVALID_FILE) {
            ngx_http_m40_json_read(job);
        }

        if (job->read_err == 0) {
            job->root = json_loadb((const char *) job->data, job->len, 0,
                                   &job->err);
        }

        /* the body is no longer needed: its memory goes back now */
        free(job->data);
        job->data = NULL;

        pthread_mutex_lock(&jp->mu);
        job->state = NGX_HTTP_M40_JOB_DONE;
        ngx_http_m40_json_append(&jp->done, &jp->done_tail, job);
        pthread_mutex_unlock(&jp->mu);

        /* EAGAIN only when the counter is at its maximum: the loop is awake anyway */
        do {
            n = write(jp->efd, &one, sizeof(one));
        } while (n == -1 && errno == EINTR);
    }
}


static void
ngx_http_m40_json_event(ngx_event_t *rev)
{
    ngx_connection_t          *c;
    ngx_http_m40_json_job_t   *job, *next;
    ngx_http_m40_json_pool_t  *jp;

    c = rev->data;
    jp = c->data;

    ngx_http_m40_eventfd_drain(rev);

    pthread_mutex_lock(&jp->mu);
    job = jp->done;
    jp->done = jp->done_tail = NULL;
    pthread_mutex_unlock(&jp->mu);

    for ( /* void */ ; job; job = next) {
        next = job->next;

        /* a handler may end other requests, whose jobs in this list are then
         * cancelled, not freed: cancelled is read only now */
        if (!job->cancelled) {
            job->handler(job);
        }

        ngx_http_m40_json_job_free(job);
    }

    ngx_http_m40_eventfd_rearm(rev);
}
