/* The engine's public API (m40_engine.h): creating and stopping the engine thread,
 * submitting requests, the per-request event queues, the ready list the worker's
 * event loop drains, and the stats. The engine thread itself (load, admission,
 * batching, sampling, stop strings) lives in scheduler.c, the tokenizer thread that
 * every request passes first (template rendering, tokenization) in prompt.c.
 *
 * Lifetime of a request: submit creates it with two references, the engine's and the
 * submitter's. The engine drops its own when the request has its final event (or was
 * cancelled); the submitter drops its own with m40_request_release. Whoever drops the
 * last one frees it, so neither side ever touches freed memory and the submitter may
 * keep polling a finished request after the engine is gone. */
#include "engine_impl.h"

#include <errno.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <time.h>
#include <unistd.h>

double m40_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Prometheus-style cumulative buckets: every bucket whose bound is >= v counts it. */
void m40_hist_observe(const double *bounds, uint64_t *counts, double *sum, double v)
{
    for (int i = 0; i < M40_HIST_BUCKETS; i++)
        if (v <= bounds[i])
            counts[i]++;
    *sum += v;
}

static char *dup_str(const char *s)
{
    if (!s)
        return NULL;
    size_t n = strlen(s);
    char *d = malloc(n + 1);
    if (d)
        memcpy(d, s, n + 1);
    return d;
}

/* ---------- intrusive lists (all under e->mu) ---------- */

/* The tokenizer queue and the admission queue: FIFO lists through q_next / q_prev (a
 * request is in at most one of them). */
void m40_queue_push(m40_request **head, m40_request **tail, int32_t *n, m40_request *r)
{
    r->q_next = NULL;
    r->q_prev = *tail;
    if (*tail)
        (*tail)->q_next = r;
    else
        *head = r;
    *tail = r;
    (*n)++;
}

void m40_queue_unlink(m40_request **head, m40_request **tail, int32_t *n, m40_request *r)
{
    if (r->q_prev)
        r->q_prev->q_next = r->q_next;
    else
        *head = r->q_next;
    if (r->q_next)
        r->q_next->q_prev = r->q_prev;
    else
        *tail = r->q_prev;
    r->q_next = r->q_prev = NULL;
    (*n)--;
}

int32_t m40_engine_waiting_locked(const m40_engine *e)
{
    return e->tq_n + e->tk_busy + e->q_n;
}

static void ready_unlink(m40_engine *e, m40_request *r)
{
    if (!r->in_ready)
        return;
    if (r->rd_prev)
        r->rd_prev->rd_next = r->rd_next;
    else
        e->rd_head = r->rd_next;
    if (r->rd_next)
        r->rd_next->rd_prev = r->rd_prev;
    else
        e->rd_tail = r->rd_prev;
    r->rd_next = r->rd_prev = NULL;
    r->in_ready = 0;
}

static void live_unlink(m40_engine *e, m40_request *r)
{
    if (r->live_prev)
        r->live_prev->live_next = r->live_next;
    else
        e->live_head = r->live_next;
    if (r->live_next)
        r->live_next->live_prev = r->live_prev;
    r->live_next = r->live_prev = NULL;
}

/* ---------- events ---------- */

void m40_event_clear(m40_event *ev)
{
    if (!ev)
        return;
    free(ev->text);
    free(ev->tokens);
    free(ev->top);
    memset(ev, 0, sizeof *ev);
}

int m40_request_push_event(m40_request *r, m40_event *ev)
{
    int rc = 0;
    pthread_mutex_lock(&r->evmu);
    if (r->ev_n == r->ev_cap) {
        size_t ncap = r->ev_cap ? r->ev_cap * 2 : 8;
        m40_event *nev = malloc(ncap * sizeof *nev);
        if (!nev) {
            rc = -1;
        } else {
            /* Unroll the ring into the new buffer so that it starts at 0. */
            for (size_t i = 0; i < r->ev_n; i++)
                nev[i] = r->ev[(r->ev_head + i) % r->ev_cap];
            free(r->ev);
            r->ev = nev;
            r->ev_cap = ncap;
            r->ev_head = 0;
        }
    }
    if (rc == 0) {
        r->ev[(r->ev_head + r->ev_n) % r->ev_cap] = *ev;
        r->ev_n++;
        memset(ev, 0, sizeof *ev);
    }
    pthread_mutex_unlock(&r->evmu);
    return rc;
}

int m40_request_poll(m40_request *r, m40_event *ev)
{
    int got = 0;
    pthread_mutex_lock(&r->evmu);
    if (r->ev_n > 0) {
        *ev = r->ev[r->ev_head];
        r->ev_head = (r->ev_head + 1) % r->ev_cap;
        r->ev_n--;
        got = 1;
    }
    pthread_mutex_unlock(&r->evmu);
    return got;
}

void m40_engine_wake(m40_engine *e)
{
    uint64_t one = 1;
    /* EAGAIN only when the counter is about to overflow: the fd is readable then
     * anyway, so the wake-up is not lost. */
    ssize_t w = write(e->efd, &one, sizeof one);
    (void)w;
}

void m40_engine_notify(m40_engine *e, m40_request **rs, int32_t n)
{
    if (n <= 0)
        return;
    int any = 0;
    pthread_mutex_lock(&e->mu);
    for (int32_t i = 0; i < n; i++) {
        m40_request *r = rs[i];
        if (r->released || r->in_ready)
            continue;
        r->rd_next = NULL;
        r->rd_prev = e->rd_tail;
        if (e->rd_tail)
            e->rd_tail->rd_next = r;
        else
            e->rd_head = r;
        e->rd_tail = r;
        r->in_ready = 1;
        any = 1;
    }
    pthread_mutex_unlock(&e->mu);
    if (any)
        m40_engine_wake(e);
}

int m40_engine_ready(m40_engine *e, void **users, int cap)
{
    int n = 0;
    pthread_mutex_lock(&e->mu);
    while (n < cap && e->rd_head) {
        m40_request *r = e->rd_head;
        ready_unlink(e, r);
        users[n++] = r->user;
    }
    pthread_mutex_unlock(&e->mu);
    return n;
}

/* ---------- requests ---------- */

static void request_free(m40_request *r)
{
    if (!r)
        return;
    free(r->ids);
    for (size_t i = 0; i < r->ev_n; i++)
        m40_event_clear(&r->ev[(r->ev_head + i) % r->ev_cap]);
    free(r->ev);
    pthread_mutex_destroy(&r->evmu);
    if (r->messages)
        json_decref(r->messages);
    if (r->tools)
        json_decref(r->tools);
    if (r->template_kwargs)
        json_decref(r->template_kwargs);
    free(r->prompt);
    free((void *)r->sampling.logit_bias_ids);
    free((void *)r->sampling.logit_bias_values);
    for (int i = 0; i < r->n_stop; i++)
        free(r->stop[i]);
    free(r->grammar_src);
    free(r->json_schema);
    m40_grammar_free(r->grammar);
    free(r);
}

void m40_engine_drop_request(m40_engine *e, m40_request *r)
{
    pthread_mutex_lock(&e->mu);
    r->phase = M40_REQ_DONE;
    int last = --r->refs == 0;
    if (last) {
        ready_unlink(e, r);
        live_unlink(e, r);
    }
    pthread_mutex_unlock(&e->mu);
    if (last)
        request_free(r);
}

void m40_engine_fail_request(m40_engine *e, m40_request *r, int http_status, const char *msg)
{
    m40_event ev;
    memset(&ev, 0, sizeof ev);
    ev.type = M40_EV_ERROR;
    ev.http_status = http_status;
    snprintf(ev.message, sizeof ev.message, "%s", msg);
    /* out of memory for the event: nothing can be told, the request ends all the same */
    if (m40_request_push_event(r, &ev) == 0)
        m40_engine_notify(e, &r, 1);
    else
        m40_event_clear(&ev);
    m40_engine_drop_request(e, r);
}

void m40_engine_count_done(m40_engine *e, m40_request *r, int32_t n_prompt)
{
    m40_event ev;
    memset(&ev, 0, sizeof ev);
    ev.type = M40_EV_DONE;
    ev.finish = M40_FINISH_STOP;
    ev.prompt_tokens = n_prompt;
    ev.reasoning_open = r->reasoning_open;
    if (m40_request_push_event(r, &ev) == 0)
        m40_engine_notify(e, &r, 1);
    m40_engine_drop_request(e, r);
}

void m40_engine_set_tokenize_hook(m40_engine *e, void (*fn)(void *ctx, void *user), void *ctx)
{
    pthread_mutex_lock(&e->mu);
    e->tokenize_hook = fn;
    e->tokenize_hook_ctx = ctx;
    pthread_mutex_unlock(&e->mu);
}

void m40_request_release(m40_request *r)
{
    if (!r)
        return;
    m40_engine *e = r->e;
    int last;
    if (!e) {
        /* The engine is gone (destroyed): the submitter holds the only reference. */
        last = --r->refs == 0;
    } else {
        int wake = 0;
        pthread_mutex_lock(&e->mu);
        r->released = 1;
        ready_unlink(e, r);
        if (r->phase == M40_REQ_TOKENIZE || r->phase == M40_REQ_QUEUED) {
            /* Waiting in a queue: unlink it here (the engine's reference goes with it),
             * neither thread will see it. */
            if (r->phase == M40_REQ_TOKENIZE)
                m40_queue_unlink(&e->tq_head, &e->tq_tail, &e->tq_n, r);
            else
                m40_queue_unlink(&e->q_head, &e->q_tail, &e->q_n, r);
            e->stats.queue_depth = m40_engine_waiting_locked(e);
            e->stats.requests_cancelled++;
            r->phase = M40_REQ_DONE;
            r->refs--;
        } else if (r->phase == M40_REQ_ENGINE) {
            wake = 1; /* its slot is freed at the engine's next step */
        }
        /* M40_REQ_TOKENIZING: the tokenizer thread sees `released` when it is done and
         * drops the engine's reference then (prompt.c). */
        last = --r->refs == 0;
        if (last)
            live_unlink(e, r);
        if (wake)
            pthread_cond_signal(&e->cv);
        pthread_mutex_unlock(&e->mu);
    }
    if (last)
        request_free(r);
}

static m40_submit_status invalid(char *err, size_t errlen, const char *msg)
{
    snprintf(err, errlen, "%s", msg);
    return M40_SUBMIT_INVALID;
}

m40_submit_status m40_engine_submit(m40_engine *e, const m40_request_params *p, void *user, m40_request **out,
                                    char *err, size_t errlen)
{
    *out = NULL;
    if (err && errlen)
        err[0] = '\0';
    char dummy[8];
    if (!err || !errlen) {
        err = dummy;
        errlen = sizeof dummy;
    }

    pthread_mutex_lock(&e->mu);
    m40_engine_state st = e->state;
    int stopping = e->stop;
    int32_t n_vocab = e->n_vocab;
    pthread_mutex_unlock(&e->mu);
    if (st != M40_ENGINE_READY || stopping) {
        snprintf(err, errlen, "%s", st == M40_ENGINE_LOADING ? "the model is still loading"
                                    : st == M40_ENGINE_FAILED ? "the model failed to load"
                                                              : "the engine is stopping");
        return M40_SUBMIT_NOT_READY;
    }

    /* Validate before allocating anything. */
    if ((p->messages != NULL) == (p->prompt != NULL))
        return invalid(err, errlen, "exactly one of messages or prompt must be given");
    if (p->messages && !json_is_array(p->messages))
        return invalid(err, errlen, "messages must be an array");
    if (p->max_tokens <= 0)
        return invalid(err, errlen, "max_tokens must be positive");
    if (p->n_stop < 0 || p->n_stop > M40_MAX_STOP || (p->n_stop > 0 && !p->stop))
        return invalid(err, errlen, "at most 4 stop strings are allowed");
    for (int i = 0; i < p->n_stop; i++) {
        if (!p->stop[i] || !p->stop[i][0])
            return invalid(err, errlen, "stop strings must not be empty");
        if (strlen(p->stop[i]) > M40_MAX_STOP_LEN)
            return invalid(err, errlen, "a stop string is longer than 1024 bytes");
    }
    if ((p->grammar != NULL) + (p->json_schema != NULL) + (p->json_object != 0) > 1)
        return invalid(err, errlen, "at most one of grammar, json_schema and json_object");
    if (p->tool_call_format != 0 &&
        (p->grammar || p->json_schema || p->json_object || !p->messages || !json_is_array(p->tools) ||
         json_array_size(p->tools) == 0 || p->tool_call_format < 0 || p->tool_call_format > M40_TOOLS_HARMONY))
        return invalid(err, errlen, "forced tool calls need tools, a known tool format and no other grammar");
    const m40_sampler_params *sp = &p->sampling;
    if (!(sp->temperature >= 0.0f) || !isfinite(sp->temperature))
        return invalid(err, errlen, "temperature must be a finite number >= 0");
    if (!(sp->top_p > 0.0f && sp->top_p <= 1.0f))
        return invalid(err, errlen, "top_p must be in (0, 1]");
    if (!(sp->min_p >= 0.0f && sp->min_p <= 1.0f))
        return invalid(err, errlen, "min_p must be in [0, 1]");
    if (sp->n_top_logprobs < 0 || sp->n_top_logprobs > 20)
        return invalid(err, errlen, "top_logprobs must be between 0 and 20");
    if (sp->n_logit_bias < 0 || (sp->n_logit_bias > 0 && (!sp->logit_bias_ids || !sp->logit_bias_values)))
        return invalid(err, errlen, "logit_bias is malformed");
    for (int32_t i = 0; i < sp->n_logit_bias; i++) {
        if (sp->logit_bias_ids[i] < 0 || sp->logit_bias_ids[i] >= n_vocab) {
            snprintf(err, errlen, "logit_bias token id %d is outside the vocabulary (0..%d)",
                     (int)sp->logit_bias_ids[i], (int)n_vocab - 1);
            return M40_SUBMIT_INVALID;
        }
        if (!isfinite(sp->logit_bias_values[i]))
            return invalid(err, errlen, "logit_bias values must be finite");
    }

    m40_request *r = calloc(1, sizeof *r);
    if (!r)
        goto nomem;
    if (pthread_mutex_init(&r->evmu, NULL) != 0) {
        free(r);
        r = NULL;
        goto nomem;
    }
    r->e = e;
    r->user = user;
    r->refs = 2;
    r->phase = M40_REQ_TOKENIZE;
    r->add_generation_prompt = p->add_generation_prompt;
    r->max_tokens = p->max_tokens;
    r->logprobs = p->logprobs != 0;
    r->ignore_eos = p->ignore_eos != 0;
    r->sampling = *sp;
    r->sampling.logit_bias_ids = NULL;
    r->sampling.logit_bias_values = NULL;
    r->sampling.n_logit_bias = 0;
    if (p->messages) {
        /* A private deep copy: the engine thread reads (and finally frees) it while the
         * submitter may keep using its own, and jansson's sharing is not a promise we
         * want to lean on across threads. */
        r->messages = json_deep_copy(p->messages);
        if (!r->messages)
            goto nomem;
        if (p->tools && !(r->tools = json_deep_copy(p->tools)))
            goto nomem;
        if (p->template_kwargs && !(r->template_kwargs = json_deep_copy(p->template_kwargs)))
            goto nomem;
    } else {
        r->prompt = malloc(p->prompt_len + 1);
        if (!r->prompt)
            goto nomem;
        memcpy(r->prompt, p->prompt, p->prompt_len);
        r->prompt[p->prompt_len] = '\0';
        r->prompt_len = p->prompt_len;
    }
    if (sp->n_logit_bias > 0) {
        int32_t *ids = malloc((size_t)sp->n_logit_bias * sizeof *ids);
        float *vals = malloc((size_t)sp->n_logit_bias * sizeof *vals);
        r->sampling.logit_bias_ids = ids;
        r->sampling.logit_bias_values = vals;
        if (!ids || !vals)
            goto nomem;
        memcpy(ids, sp->logit_bias_ids, (size_t)sp->n_logit_bias * sizeof *ids);
        memcpy(vals, sp->logit_bias_values, (size_t)sp->n_logit_bias * sizeof *vals);
        r->sampling.n_logit_bias = sp->n_logit_bias;
    }
    for (int i = 0; i < p->n_stop; i++) {
        r->stop[i] = dup_str(p->stop[i]);
        if (!r->stop[i])
            goto nomem;
        r->stop_len[i] = strlen(r->stop[i]);
        r->n_stop = i + 1;
    }
    r->json_object = p->json_object != 0;
    r->tool_call_format = p->tool_call_format;
    r->tool_call_parallel = p->tool_call_parallel != 0;
    r->count_only = p->count_only != 0;
    if ((p->grammar && !(r->grammar_src = dup_str(p->grammar))) ||
        (p->json_schema && !(r->json_schema = dup_str(p->json_schema))))
        goto nomem;
    r->t_submit = m40_now();

    pthread_mutex_lock(&e->mu);
    if (e->stop || e->state != M40_ENGINE_READY) {
        pthread_mutex_unlock(&e->mu);
        request_free(r);
        snprintf(err, errlen, "the engine is stopping");
        return M40_SUBMIT_NOT_READY;
    }
    /* Waiting counts from submit on: for the tokenizer (queued or at work) and for a slot. */
    if (m40_engine_waiting_locked(e) >= e->max_queue) {
        e->stats.requests_rejected++;
        pthread_mutex_unlock(&e->mu);
        request_free(r);
        snprintf(err, errlen, "the queue is full (%d requests waiting)", (int)e->max_queue);
        return M40_SUBMIT_QUEUE_FULL;
    }
    r->phase = M40_REQ_TOKENIZE;
    m40_queue_push(&e->tq_head, &e->tq_tail, &e->tq_n, r);
    r->live_next = e->live_head;
    if (e->live_head)
        e->live_head->live_prev = r;
    e->live_head = r;
    e->stats.requests_total++;
    e->stats.queue_depth = m40_engine_waiting_locked(e);
    pthread_cond_signal(&e->tk_cv);
    pthread_mutex_unlock(&e->mu);
    *out = r;
    return M40_SUBMIT_OK;

nomem:
    request_free(r);
    snprintf(err, errlen, "out of memory");
    return M40_SUBMIT_NOMEM;
}

/* ---------- engine ---------- */

int m40_engine_create(const m40_engine_config *cfg, m40_engine **out, char *err, size_t errlen)
{
    static const double bounds[M40_HIST_BUCKETS] = {0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                                                     0.5,   1.0,  2.5,   5.0,  10.0, INFINITY};
    *out = NULL;
    if (!cfg || !cfg->model_path) {
        snprintf(err, errlen, "no model path");
        return -1;
    }
    if (cfg->ctx_size < 0 || cfg->max_seqs < 0 || cfg->max_queue < 0 || cfg->prefill_chunk < 0 ||
        cfg->prefill_budget < 0) {
        snprintf(err, errlen, "ctx_size, max_seqs, max_queue, prefill_chunk and prefill_budget must not be negative");
        return -1;
    }
    if (cfg->prefill_chunk > M40_MAX_PREFILL_TOKENS || cfg->prefill_budget > M40_MAX_PREFILL_TOKENS) {
        snprintf(err, errlen, "prefill_chunk and prefill_budget must be at most %d", M40_MAX_PREFILL_TOKENS);
        return -1;
    }
    if (!(cfg->itl_guard <= 0.0f || (cfg->itl_guard >= 1.0f && cfg->itl_guard <= 100.0f))) {
        snprintf(err, errlen, "itl_guard must be from 1 to 100 (0 for the default, negative for no guard)");
        return -1;
    }
    if (!(cfg->gpu_memory_fraction >= 0.0f && cfg->gpu_memory_fraction <= 1.0f)) {
        snprintf(err, errlen, "gpu_memory_fraction must be in (0, 1] (0 for the default)");
        return -1;
    }
    if (!(cfg->kv_share >= 0.0f && cfg->kv_share <= 1.0f) || cfg->kv_keep_bytes < 0) {
        snprintf(err, errlen, "kv_share must be in (0, 1] (0 for the whole room) and kv_keep_bytes >= 0");
        return -1;
    }
    m40_engine *e = calloc(1, sizeof *e);
    if (!e) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    e->efd = -1;
    e->model_path = dup_str(cfg->model_path);
    e->model_name = dup_str(cfg->model_name ? cfg->model_name : cfg->model_path);
    e->template_override = cfg->chat_template ? dup_str(cfg->chat_template) : NULL;
    if (!e->model_path || !e->model_name || (cfg->chat_template && !e->template_override)) {
        snprintf(err, errlen, "out of memory");
        goto fail;
    }
    e->device = cfg->device;
    e->tp = cfg->tp;
    e->ctx_cfg = cfg->ctx_size;
    e->max_seqs_cfg = cfg->max_seqs;
    e->max_queue = cfg->max_queue > 0 ? cfg->max_queue : M40_DEFAULT_MAX_QUEUE;
    e->gpu_memory_fraction = cfg->gpu_memory_fraction; /* 0: the KV pool's default */
    e->kv_share = cfg->kv_share;
    e->kv_keep_bytes = cfg->kv_keep_bytes;
    e->n_threads = cfg->n_threads;
    e->cpu_fast = cfg->cpu_fast;
    e->batch_invariant = cfg->batch_invariant != 0;
    /* The chunk caps one sequence and the budget all of them: a chunk beyond the budget
     * could never be taken, so it is cut to it. */
    int32_t chunk = cfg->prefill_chunk > 0 ? cfg->prefill_chunk : M40_DEFAULT_PREFILL_CHUNK;
    int32_t budget = cfg->prefill_budget > 0 ? cfg->prefill_budget
                     : cfg->device >= 0      ? M40_DEFAULT_PREFILL_BUDGET
                                             : chunk;
    e->prefill_budget_auto = cfg->prefill_budget == 0;
    e->prefill = (m40_prefill_policy){.budget = budget,
                                      .chunk = chunk < budget ? chunk : budget,
                                      .floor = M40_PREFILL_FLOOR,
                                      .guard = cfg->itl_guard < 0.0f    ? 0.0
                                               : cfg->itl_guard == 0.0f ? (double)M40_DEFAULT_ITL_GUARD
                                                                        : (double)cfg->itl_guard};
    e->state = M40_ENGINE_LOADING;
    memcpy(e->stats.hist_bounds, bounds, sizeof bounds);

    e->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (e->efd < 0) {
        snprintf(err, errlen, "eventfd: %s", strerror(errno));
        goto fail;
    }
    if (pthread_mutex_init(&e->mu, NULL) != 0) {
        snprintf(err, errlen, "cannot create a mutex");
        goto fail;
    }
    if (pthread_cond_init(&e->cv, NULL) != 0) {
        pthread_mutex_destroy(&e->mu);
        snprintf(err, errlen, "cannot create a condition variable");
        goto fail;
    }
    if (pthread_cond_init(&e->tk_cv, NULL) != 0) {
        pthread_cond_destroy(&e->cv);
        pthread_mutex_destroy(&e->mu);
        snprintf(err, errlen, "cannot create a condition variable");
        goto fail;
    }
    /* The engine thread (and the model's thread pool it starts) must never take the
     * worker's signals: nginx handles them on its own thread. Threads inherit the
     * mask, so block everything around pthread_create. */
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    int rc = pthread_create(&e->thread, NULL, m40_engine_thread_main, e);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (rc != 0) {
        snprintf(err, errlen, "cannot start the engine thread: %s", strerror(rc));
        pthread_cond_destroy(&e->tk_cv);
        pthread_cond_destroy(&e->cv);
        pthread_mutex_destroy(&e->mu);
        goto fail;
    }
    *out = e;
    return 0;

fail:
    if (e->efd >= 0)
        close(e->efd);
    free(e->model_path);
    free(e->model_name);
    free(e->template_override);
    free(e);
    return -1;
}

void m40_engine_destroy(m40_engine *e)
{
    if (!e)
        return;
    pthread_mutex_lock(&e->mu);
    e->stop = 1;
    pthread_cond_signal(&e->cv);
    pthread_cond_signal(&e->tk_cv);
    pthread_mutex_unlock(&e->mu);
    /* A load in progress finishes first (it cannot be interrupted); the thread then
     * stops and joins the tokenizer thread (which answers what waits for it, after
     * finishing the prompt at hand), ends every running and queued request and drops
     * its references. */
    pthread_join(e->thread, NULL);

    /* What is left is held by submitters only: detach those requests so that their
     * later poll/release calls never reach the freed engine. */
    pthread_mutex_lock(&e->mu);
    for (m40_request *r = e->live_head, *next; r; r = next) {
        next = r->live_next;
        r->in_ready = 0;
        r->rd_next = r->rd_prev = NULL;
        r->live_next = r->live_prev = NULL;
        r->e = NULL;
    }
    e->live_head = NULL;
    e->rd_head = e->rd_tail = NULL;
    pthread_mutex_unlock(&e->mu);

    pthread_cond_destroy(&e->tk_cv);
    pthread_cond_destroy(&e->cv);
    pthread_mutex_destroy(&e->mu);
    close(e->efd);
    free(e->model_path);
    free(e->model_name);
    free(e->template_override);
    free(e);
}

int m40_engine_event_fd(const m40_engine *e)
{
    return e->efd;
}

m40_engine_state m40_engine_get_state(m40_engine *e, char *err, size_t errlen)
{
    pthread_mutex_lock(&e->mu);
    m40_engine_state st = e->state;
    if (err && errlen)
        snprintf(err, errlen, "%s", st == M40_ENGINE_FAILED ? e->load_err : "");
    pthread_mutex_unlock(&e->mu);
    return st;
}

int32_t m40_engine_ctx_size(m40_engine *e)
{
    pthread_mutex_lock(&e->mu);
    int32_t v = e->ctx;
    pthread_mutex_unlock(&e->mu);
    return v;
}

int32_t m40_engine_n_vocab(m40_engine *e)
{
    pthread_mutex_lock(&e->mu);
    int32_t v = e->n_vocab;
    pthread_mutex_unlock(&e->mu);
    return v;
}

const char *m40_engine_model_name(const m40_engine *e)
{
    return e->model_name;
}

int m40_engine_get_capacity(m40_engine *e, m40_engine_capacity *out)
{
    pthread_mutex_lock(&e->mu);
    int ready = e->state == M40_ENGINE_READY;
    if (ready)
        *out = e->capacity;
    pthread_mutex_unlock(&e->mu);
    return ready ? 0 : -1;
}

const char *m40_engine_chat_template(m40_engine *e)
{
    pthread_mutex_lock(&e->mu);
    const char *src = e->state == M40_ENGINE_READY && e->tmpl ? e->tmpl_src : NULL;
    pthread_mutex_unlock(&e->mu);
    return src;
}

int m40_engine_capacity_line(const m40_engine_capacity *c, char *buf, size_t len)
{
    const double GiB = 1073741824.0;
    char where[256];
    if (c->kv_blocks > 0)
        snprintf(where, sizeof where,
                 "%d blocks of %d, %.1f GiB: %.2f of gpu %d's %.1f GiB less %.1f GiB in use and %.1f GiB kept for "
                 "activations",
                 (int)c->kv_blocks, (int)c->kv_block_size, c->kv_bytes / GiB, (double)c->gpu_memory_fraction,
                 c->device, c->gpu_total / GiB, c->gpu_in_use / GiB, c->gpu_reserve / GiB);
    else
        snprintf(where, sizeof where, "%d slots of %d tokens in CPU memory", (int)c->max_seqs, (int)c->ctx);
    char rule[128] = "";
    if (c->max_seqs_auto && c->kv_blocks > 0)
        snprintf(rule, sizeof rule, " (automatic: the %d-token sequences the KV cache holds, 1 to %d)",
                 (int)(c->ctx < M40_AUTO_SEQ_TOKENS ? c->ctx : M40_AUTO_SEQ_TOKENS), M40_AUTO_MAX_SEQS);
    else if (c->max_seqs_auto)
        snprintf(rule, sizeof rule, " (automatic: the CPU's)");
    char guard[32] = "off";
    if (c->itl_guard > 0.0f)
        snprintf(guard, sizeof guard, "%gx", (double)c->itl_guard);
    return snprintf(buf, len, "KV cache: %lld tokens (%s); %lld sequences of %d tokens fit; max_seqs %d%s; "
                              "max_queue %d; prefill %d tokens a step%s, %d a sequence; ITL guard %s",
                    (long long)c->kv_tokens, where, (long long)c->full_ctx_seqs, (int)c->ctx, (int)c->max_seqs, rule,
                    (int)c->max_queue, (int)c->prefill_budget,
                    c->prefill_budget_auto ? (c->device >= 0 ? " (automatic: the GPU's)" : " (automatic: the CPU's)")
                                           : "",
                    (int)c->prefill_chunk, guard);
}

void m40_engine_get_stats(m40_engine *e, m40_engine_stats *out)
{
    pthread_mutex_lock(&e->mu);
    *out = e->stats;
    out->queue_depth = m40_engine_waiting_locked(e);
    pthread_mutex_unlock(&e->mu);
}
