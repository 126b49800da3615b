/* Test helpers for driving engine requests the way the nginx module does (tests/unit/
 * test_engine.c on the CPU, tests/gpu/test_model_gpu.c on the GPU): a job collects one
 * request's events; pump waits on the engine's eventfd and learns which jobs have news
 * only from m40_engine_ready. */
#ifndef M40_TEST_ENGINE_JOBS_H
#define M40_TEST_ENGINE_JOBS_H

#include <poll.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "m40_engine.h"

static inline double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* The engine publishes its stats after a step's events went out, so a request's last
 * event can come before the gauges count it gone: wait (up to 5 s) for nothing running
 * or queued. */
static inline void settle_stats(m40_engine *e, m40_engine_stats *st)
{
    double end = now_s() + 5;
    do
        m40_engine_get_stats(e, st);
    while ((st->running != 0 || st->queue_depth != 0) && now_s() < end && usleep(2000) == 0);
}

typedef struct {
    m40_request *req;
    char text[8192];
    size_t len;
    int done, n_events, n_text_events, n_logprob_tokens;
    m40_finish finish;
    int prompt_tokens, cached_tokens, completion_tokens;
    int stop_matched; /* DONE: 1 + the index of the stop string that ended it */
    int err_status;
    char err_msg[256];
} job;

static inline void job_take(job *j)
{
    m40_event ev;
    while (!j->done && m40_request_poll(j->req, &ev)) {
        j->n_events++;
        if (ev.type == M40_EV_TEXT) {
            j->n_text_events++;
            j->n_logprob_tokens += ev.n_tokens;
            if (j->len + ev.text_len < sizeof j->text) {
                memcpy(j->text + j->len, ev.text, ev.text_len);
                j->len += ev.text_len;
                j->text[j->len] = '\0';
            }
        } else if (ev.type == M40_EV_DONE) {
            j->done = 1;
            j->finish = ev.finish;
            j->prompt_tokens = ev.prompt_tokens;
            j->cached_tokens = ev.cached_tokens;
            j->completion_tokens = ev.completion_tokens;
            j->stop_matched = ev.stop_matched;
        } else {
            j->done = 1;
            j->err_status = ev.http_status;
            snprintf(j->err_msg, sizeof j->err_msg, "%s", ev.message);
        }
        m40_event_clear(&ev);
    }
}

/* One round of the module's event loop: wait up to 50 ms on the eventfd, then hand each
 * ready request's events to its job. */
static inline void pump_once(m40_engine *e)
{
    struct pollfd pfd = {.fd = m40_engine_event_fd(e), .events = POLLIN};
    if (poll(&pfd, 1, 50) > 0) {
        uint64_t v;
        if (read(pfd.fd, &v, sizeof v) != (ssize_t)sizeof v)
            return;
    }
    void *users[8];
    int got;
    do {
        got = m40_engine_ready(e, users, 8);
        for (int i = 0; i < got; i++)
            job_take(users[i]);
    } while (got == 8);
}

/* Waits (poll on the eventfd, as the module does) until every job is done (0) or the
 * timeout passes (-1). */
static inline int pump(m40_engine *e, job **jobs, int n, double timeout)
{
    double end = now_s() + timeout;
    for (;;) {
        int open = 0;
        for (int i = 0; i < n; i++)
            open += !jobs[i]->done;
        if (!open)
            return 0;
        if (now_s() > end)
            return -1;
        pump_once(e);
    }
}

#endif
