/* The engines of a worker: one per m40_model, started in init_process (one GPU loads
 * one model at a time, in the order of the configuration), loaded on demand and
 * unloaded after idle time (keep_alive, m40_max_resident), and their eventfds in the
 * event loop.
 *
 * Each engine's eventfd is registered in the worker's event loop as a pseudo
 * connection; when it becomes readable, the worker asks the engine which requests have
 * news and lets each of them pull its events (ngx_http_m40_generate.c). Engine requests
 * are known to the engines by a numeric id, unique in the worker, looked up in a
 * red-black tree, so that a notification for a request that has just gone away is
 * ignored instead of touching freed memory. */
#include "ngx_http_m40_module.h"


static ngx_int_t ngx_http_m40_start_engine(ngx_cycle_t *cycle,
    ngx_http_m40_model_t *m);
static void ngx_http_m40_start_pending(ngx_cycle_t *cycle,
    ngx_http_m40_main_conf_t *mcf);
static void ngx_http_m40_idle(ngx_event_t *ev);
static void ngx_http_m40_load_waiting(ngx_http_m40_main_conf_t *mcf);
static void ngx_http_m40_engine_event(ngx_event_t *rev);


void
ngx_http_m40_engines_init(ngx_cycle_t *cycle, ngx_http_m40_main_conf_t *mcf)
{
    ngx_uint_t                 i;
    ngx_http_m40_model_t      *models;

    ngx_rbtree_init(&mcf->choices, &mcf->choices_sentinel,
                    ngx_rbtree_insert_value);
    mcf->next_id = 1;
    mcf->start_time = ngx_time();

    models = mcf->models.elts;

    for (i = 0; i < mcf->models.nelts; i++) {
        models[i].mcf = mcf;
        models[i].engine = NULL;
        /* keep_alive: loaded by its first request, as Ollama does */
        models[i].engine_status = models[i].keep_alive
                                  ? NGX_HTTP_M40_ENGINE_UNLOADED
                                  : NGX_HTTP_M40_ENGINE_PENDING;
        models[i].active = 0;
        models[i].last_used = 0;
        ngx_memzero(&models[i].idle_ev, sizeof(ngx_event_t));
        models[i].idle_ev.handler = ngx_http_m40_idle;
        models[i].idle_ev.data = &models[i];
        models[i].idle_ev.log = cycle->log;
        models[i].idle_ev.cancelable = 1;      /* no reason to hold a shutdown */
        ngx_memzero(&models[i].base, sizeof(m40_engine_stats));
        ngx_memzero(&models[i].mc, sizeof(ngx_http_m40_mcounters_t));
        models[i].event_conn = NULL;
        models[i].load_logged = 0;
        models[i].slot = NULL;
        /* worker k's engine: GPU device + k, or with tensor parallelism
         * the tp GPUs from device + k * tp */
        models[i].worker_device = models[i].device < 0
                                  ? -1 : models[i].device
                                         + (ngx_int_t) ngx_worker * models[i].tp;
    }

    ngx_http_m40_shm_attach(cycle, mcf);

    /* large request bodies are parsed off the event loop (ngx_http_m40_json.c);
     * without its thread they are parsed inline */
    (void) ngx_http_m40_json_init(cycle);

    /* Engines start now, but one GPU loads one model at a time: the next one on it
     * starts when the one before is ready or failed (ngx_http_m40_engine_event), so
     * that each KV pool is sized after the weights and pools of those before it. */
    ngx_http_m40_start_pending(cycle, mcf);

    for (i = 0; i < mcf->models.nelts; i++) {
        ngx_http_m40_shm_publish(&models[i]);
    }
}


static ngx_int_t
ngx_http_m40_start_engine(ngx_cycle_t *cycle, ngx_http_m40_model_t *m)
{
    char                       err[512];
    ngx_connection_t          *c;
    m40_engine_config          ec;

    ngx_memzero(&ec, sizeof(m40_engine_config));
    ec.model_path = (const char *) m->model_path.data;
    ec.model_name = (const char *) m->model_name.data;
    ec.device = (int) m->worker_device;
    ec.tp = (int) m->tp;
    ec.ctx_size = (int32_t) m->ctx_size;
    ec.max_seqs = (int32_t) m->max_seqs;
    ec.max_queue = (int32_t) m->max_queue;
    ec.n_threads = (int32_t) m->threads;
    ec.cpu_fast = !m->mcf->cpu_exact;
    ec.gpu_memory_fraction = (float) m->gpu_memory_fraction;
    ec.kv_share = (float) m->kv_share;
    ec.kv_keep_bytes = m->kv_keep_bytes;
    ec.prefill_chunk = (int32_t) m->prefill_chunk;
    ec.prefill_budget = (int32_t) m->prefill_budget;
    ec.itl_guard = (float) m->itl_guard;
    ec.batch_invariant = m->batch_invariant ? 1 : 0;
    ec.chat_template = m->chat_template.len
                       ? (const char *) m->chat_template.data : NULL;

    err[0] = '\0';
    if (m40_engine_create(&ec, &m->engine, err, sizeof(err)) != 0) {
        /* The worker keeps serving: /health reports "failed", generation 503. */
        ngx_log_error(NGX_LOG_EMERG, cycle->log, 0,
                      "m40: cannot start the engine for \"%V\": %s",
                      &m->model_path, err);
        m->engine = NULL;
        m->engine_status = NGX_HTTP_M40_ENGINE_NONE;
        return NGX_ERROR;
    }

    c = ngx_http_m40_eventfd_add(m40_engine_event_fd(m->engine),
                                 ngx_http_m40_engine_event, m, "engine's",
                                 cycle->log);
    if (c == NULL) {
        m40_engine_destroy(m->engine);
        m->engine = NULL;
        m->engine_status = NGX_HTTP_M40_ENGINE_NONE;
        return NGX_ERROR;
    }

    m->event_conn = c;
    m->engine_status = NGX_HTTP_M40_ENGINE_STARTED;
    m->mc.loads++;

    if (ec.device < 0) {
        ngx_log_error(NGX_LOG_NOTICE, cycle->log, 0,
                      "m40: worker %ui loading \"%V\" as \"%V\" on the cpu%s",
                      ngx_worker, &m->model_path, &m->model_name,
                      ec.batch_invariant
                      ? " (batch invariant: the cpu computes a row the same "
                        "way at any batch size already)"
                      : "");
    } else {
        ngx_log_error(NGX_LOG_NOTICE, cycle->log, 0,
                      "m40: worker %ui loading \"%V\" as \"%V\" on gpu %d "
                      "(KV share %.2f, %.2f GiB kept for the models after it%s)",
                      ngx_worker, &m->model_path, &m->model_name, ec.device,
                      m->kv_share, (double) m->kv_keep_bytes / 1073741824.0,
                      ec.batch_invariant ? "; batch invariant" : "");
    }

    return NGX_OK;
}


/* The pending engines whose GPU has no engine loading any more: the first such of
 * each GPU starts (one that cannot start lets the next one go). The CPU's all start. */
static void
ngx_http_m40_start_pending(ngx_cycle_t *cycle, ngx_http_m40_main_conf_t *mcf)
{
    ngx_uint_t             i, j;
    ngx_flag_t             busy;
    ngx_http_m40_model_t  *models;

    models = mcf->models.elts;

    for (i = 0; i < mcf->models.nelts; i++) {
        if (models[i].engine_status != NGX_HTTP_M40_ENGINE_PENDING) {
            continue;
        }

        /* busy: another model loads on this GPU (a later one too: keep_alive
         * loads come in any order), or an earlier one waits to */
        busy = 0;
        for (j = 0; models[i].worker_device >= 0 && j < mcf->models.nelts; j++) {
            if (j == i || models[j].worker_device != models[i].worker_device) {
                continue;
            }

            if ((models[j].engine_status == NGX_HTTP_M40_ENGINE_PENDING && j < i)
                || (models[j].engine_status == NGX_HTTP_M40_ENGINE_STARTED
                    && m40_engine_get_state(models[j].engine, NULL, 0)
                       == M40_ENGINE_LOADING))
            {
                busy = 1;
                break;
            }
        }

        if (!busy) {
            (void) ngx_http_m40_start_engine(cycle, &models[i]);
            ngx_http_m40_shm_publish(&models[i]);
            /* one that could not even start: the next on its GPU may go */
            if (models[i].engine_status == NGX_HTTP_M40_ENGINE_NONE) {
                i = (ngx_uint_t) -1;    /* look again from the start */
            }
        }
    }
}


m40_engine_state
ngx_http_m40_model_state(ngx_http_m40_model_t *model, char *err, size_t errlen)
{
    if (err && errlen) {
        err[0] = '\0';
    }

    switch (model->engine_status) {

    case NGX_HTTP_M40_ENGINE_PENDING:
    case NGX_HTTP_M40_ENGINE_UNLOADED:     /* for a request: loading for it */
        return M40_ENGINE_LOADING;

    case NGX_HTTP_M40_ENGINE_STARTED:
        return m40_engine_get_state(model->engine, err, errlen);

    default:
        if (err && errlen) {
            ngx_cpystrn((u_char *) err,
                        (u_char *) "the engine could not be started (see the "
                        "error log)", errlen);
        }
        return M40_ENGINE_FAILED;
    }
}


void
ngx_http_m40_model_stats(ngx_http_m40_model_t *m, m40_engine_stats *s)
{
    if (m->engine) {
        m40_engine_get_stats(m->engine, s);
    } else {
        ngx_memzero(s, sizeof(m40_engine_stats));
    }

    ngx_http_m40_stats_add(s, &m->base, 0);
}


/* keep_alive: the engine goes, its counters stay (in base). Nothing uses it: the
 * requests that did have released their engine requests (their pools' cleanups ran
 * before the one that let go of the model). */
static void
ngx_http_m40_model_unload(ngx_http_m40_model_t *m, const char *why)
{
    m40_engine_stats  s;

    m40_engine_get_stats(m->engine, &s);
    ngx_http_m40_stats_add(&m->base, &s, 0);

    if (m->event_conn) {
        ngx_http_m40_eventfd_del(m->event_conn);
        m->event_conn = NULL;
    }

    /* joins the engine's threads: an idle engine's are waiting, so this is short */
    m40_engine_destroy(m->engine);
    m->engine = NULL;
    m->engine_status = NGX_HTTP_M40_ENGINE_UNLOADED;
    m->load_logged = 0;
    m->mc.unloads++;

    if (m->idle_ev.timer_set) {
        ngx_del_timer(&m->idle_ev);
    }

    ngx_http_m40_shm_publish(m);

    ngx_log_error(NGX_LOG_NOTICE, ngx_cycle->log, 0,
                  "m40: worker %ui unloaded \"%V\" (%s)", ngx_worker,
                  &m->model_name, why);
}


static void
ngx_http_m40_idle(ngx_event_t *ev)
{
    ngx_http_m40_model_t *m = ev->data;

    if (m->active || m->engine_status != NGX_HTTP_M40_ENGINE_STARTED) {
        return;         /* in use again; its last request re-arms the timer */
    }

    if (m40_engine_get_state(m->engine, NULL, 0) == M40_ENGINE_LOADING) {
        ngx_add_timer(ev, m->keep_alive);
        return;
    }

    ngx_http_m40_model_unload(m, "idle for its keep_alive");
}


/* Loads an unloaded model, first unloading the least recently used idle one when
 * m40_max_resident engines are loaded already; without one it stays unloaded (its
 * requests try again while they wait). */
void
ngx_http_m40_model_load(ngx_http_m40_model_t *m)
{
    ngx_uint_t                 i, resident;
    ngx_http_m40_model_t      *models, *lru;
    ngx_http_m40_main_conf_t  *mcf;

    if (m->engine_status != NGX_HTTP_M40_ENGINE_UNLOADED) {
        return;
    }

    mcf = m->mcf;
    models = mcf->models.elts;

    for ( ;; ) {
        resident = 0;
        lru = NULL;

        for (i = 0; i < mcf->models.nelts; i++) {
            if (models[i].engine_status == NGX_HTTP_M40_ENGINE_PENDING
                || models[i].engine_status == NGX_HTTP_M40_ENGINE_STARTED)
            {
                resident++;

                /* only one that can load again later: a keep_alive model */
                if (models[i].keep_alive && models[i].active == 0
                    && models[i].engine_status == NGX_HTTP_M40_ENGINE_STARTED
                    && m40_engine_get_state(models[i].engine, NULL, 0)
                       != M40_ENGINE_LOADING
                    && (lru == NULL || models[i].last_used < lru->last_used))
                {
                    lru = &models[i];
                }
            }
        }

        if (mcf->max_resident == 0 || resident < mcf->max_resident) {
            break;
        }

        if (lru == NULL) {
            return;         /* all in use: wait */
        }

        ngx_http_m40_model_unload(lru, "the least recently used, for another "
                                  "model (m40_max_resident)");
    }

    m->engine_status = NGX_HTTP_M40_ENGINE_PENDING;
    ngx_http_m40_start_pending((ngx_cycle_t *) ngx_cycle, mcf);
    ngx_http_m40_shm_publish(m);
}


static void
ngx_http_m40_model_release(void *data)
{
    ngx_http_m40_model_t *m = data;

    m->active--;
    m->last_used = ngx_current_msec;

    if (m->active == 0 && m->keep_alive
        && m->engine_status == NGX_HTTP_M40_ENGINE_STARTED)
    {
        ngx_add_timer(&m->idle_ev, m->keep_alive);
    }

    /* a model that waits for room may have it now */
    if (m->active == 0 && m->mcf->max_resident) {
        ngx_http_m40_load_waiting(m->mcf);
    }
}


static void
ngx_http_m40_load_waiting(ngx_http_m40_main_conf_t *mcf)
{
    ngx_uint_t             i;
    ngx_http_m40_model_t  *models;

    models = mcf->models.elts;

    for (i = 0; i < mcf->models.nelts; i++) {
        if (models[i].engine_status == NGX_HTTP_M40_ENGINE_UNLOADED
            && models[i].active)
        {
            ngx_http_m40_model_load(&models[i]);
        }
    }
}


ngx_int_t
ngx_http_m40_model_use(ngx_http_request_t *r, ngx_http_m40_model_t *m)
{
    ngx_pool_cleanup_t  *cln;

    cln = ngx_pool_cleanup_add(r->pool, 0);
    if (cln == NULL) {
        return NGX_ERROR;
    }

    cln->handler = ngx_http_m40_model_release;
    cln->data = m;

    m->active++;
    m->last_used = ngx_current_msec;

    if (m->idle_ev.timer_set) {
        ngx_del_timer(&m->idle_ev);
    }

    ngx_http_m40_model_load(m);

    return NGX_OK;
}


ngx_int_t
ngx_http_m40_choice_register(ngx_http_m40_main_conf_t *mcf,
    ngx_http_m40_choice_t *ch)
{
    ch->node.key = mcf->next_id++;
    ngx_rbtree_insert(&mcf->choices, &ch->node);
    ch->in_tree = 1;

    return NGX_OK;
}


void
ngx_http_m40_choice_unregister(ngx_http_m40_main_conf_t *mcf,
    ngx_http_m40_choice_t *ch)
{
    if (ch->in_tree) {
        ngx_rbtree_delete(&mcf->choices, &ch->node);
        ch->in_tree = 0;
    }
}


static ngx_http_m40_choice_t *
ngx_http_m40_choice_lookup(ngx_http_m40_main_conf_t *mcf, ngx_rbtree_key_t key)
{
    ngx_rbtree_node_t  *node, *sentinel;

    node = mcf->choices.root;
    sentinel = mcf->choices.sentinel;

    while (node != sentinel) {
        if (key < node->key) {
            node = node->left;
            continue;
        }

        if (key > node->key) {
            node = node->right;
            continue;
        }

        return (ngx_http_m40_choice_t *) node;
    }

    return NULL;
}


/* Once the engine has loaded (the eventfd is written when it becomes READY or
 * FAILED): what it sized, or why it failed. */
static void
ngx_http_m40_log_load(ngx_http_m40_model_t *m, ngx_log_t *log)
{
    char                   line[768];
    m40_engine_state       state;
    m40_engine_capacity    cap;

    state = m40_engine_get_state(m->engine, line, sizeof(line));

    if (state == M40_ENGINE_FAILED) {
        ngx_log_error(NGX_LOG_ERR, log, 0, "m40: \"%V\" failed to load: %s",
                      &m->model_path, line);
        m->load_logged = 1;
        return;
    }

    if (state != M40_ENGINE_READY
        || m40_engine_get_capacity(m->engine, &cap) != 0)
    {
        return;
    }

    m->load_logged = 1;

    m40_engine_capacity_line(&cap, line, sizeof(line));
    ngx_log_error(NGX_LOG_NOTICE, log, 0, "m40: \"%V\" ready; %s",
                  &m->model_name, line);

    if (cap.full_ctx_seqs < 1) {
        ngx_log_error(NGX_LOG_WARN, log, 0,
                      "m40: the KV cache of \"%V\" holds %L tokens, less "
                      "than one sequence of the full context (%d tokens): "
                      "longer sequences end early; lower m40_ctx_size or "
                      "raise m40_gpu_memory_fraction (or its kv_share)",
                      &m->model_name, (int64_t) cap.kv_tokens, (int) cap.ctx);
    }
}


#define NGX_HTTP_M40_READY_BATCH  64

static void
ngx_http_m40_engine_event(ngx_event_t *rev)
{
    int                        i, n;
    void                      *users[NGX_HTTP_M40_READY_BATCH];
    ngx_connection_t          *c;
    ngx_http_m40_choice_t     *ch;
    ngx_http_m40_model_t      *m;
    ngx_http_m40_main_conf_t  *mcf;

    c = rev->data;
    m = c->data;
    mcf = m->mcf;

    if (!m->load_logged) {
        ngx_http_m40_log_load(m, rev->log);

        if (m->load_logged) {
            /* loaded or failed: the next model on its GPU may load */
            ngx_http_m40_start_pending((ngx_cycle_t *) ngx_cycle, mcf);
        }
    }

    ngx_http_m40_eventfd_drain(rev);

    do {
        n = m40_engine_ready(m->engine, users, NGX_HTTP_M40_READY_BATCH);

        /* The counters before the wake-ups: waking a request may send its last bytes at
         * once, and its client may ask another worker's /metrics next. The engine
         * publishes its statistics before it hands out events, so this copy holds
         * every token of the events just taken. */
        if (n > 0) {
            ngx_http_m40_shm_publish(m);
        }

        for (i = 0; i < n; i++) {
            /* Looked up again for each id: waking one request may finish (and
             * free) the request that a later id belongs to. */
            ch = ngx_http_m40_choice_lookup(mcf, (ngx_rbtree_key_t) users[i]);
            if (ch == NULL) {
                continue;
            }

            ngx_http_m40_ctx_wake(ch->ctx);
        }

    } while (n == NGX_HTTP_M40_READY_BATCH);

    /* and after them: what the wake-ups themselves changed (requests finished here) */
    ngx_http_m40_shm_publish(m);

    ngx_http_m40_eventfd_rearm(rev);
}


void
ngx_http_m40_engines_exit(ngx_cycle_t *cycle, ngx_http_m40_main_conf_t *mcf)
{
    ngx_uint_t                 i;
    ngx_http_m40_model_t      *models;

    ngx_http_m40_json_exit(cycle);

    /* the counters' last copies go to the retired sums while the engines still
     * hold them */
    ngx_http_m40_shm_detach(mcf);

    models = mcf->models.elts;

    for (i = 0; i < mcf->models.nelts; i++) {
        if (models[i].event_conn) {
            /* The engine owns and closes the fd. */
            ngx_http_m40_eventfd_del(models[i].event_conn);
            models[i].event_conn = NULL;
        }

        if (models[i].engine) {
            m40_engine_destroy(models[i].engine);
            models[i].engine = NULL;
        }
    }
}
