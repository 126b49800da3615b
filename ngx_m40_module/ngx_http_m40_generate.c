/* POST /v1/chat/completions and /v1/completions: the request's life, and the
 * non-streaming answer (streaming: ngx_http_m40_stream.c).
 *
 * Life of a request: the body is read (memory or temp file), parsed (a large one on
 * the JSON thread, ngx_http_m40_json.c: the request waits for it and start is entered
 * again with the result), validated, and n engine requests are submitted (one per
 * choice, seeds seed+i). The HTTP request then waits
 * (NGX_DONE) until the engine's eventfd says a choice has events:
 *   - non-streaming: every event is pulled at once and accumulated; the response is
 *     sent when the last choice is done;
 *   - streaming: events are pulled only while the client connection can take them
 *     (ngx_http_m40_stream.c).
 * The pool cleanup releases every engine request still held, whatever ended the
 * HTTP request (done, client gone, timeout, error), which cancels running sequences
 * and frees their KV blocks. */
#include "ngx_http_m40_module.h"


#define NGX_HTTP_M40_LINGER_MS    60000

static void ngx_http_m40_body_handler(ngx_http_request_t *r);
static ngx_http_m40_model_t *ngx_http_m40_route(ngx_http_m40_main_conf_t *mcf,
    json_t *root, ngx_http_m40_error_t *err);
static ngx_int_t ngx_http_m40_start(ngx_http_request_t *r,
    ngx_http_m40_ctx_t *ctx);
static ngx_int_t ngx_http_m40_collect(ngx_http_m40_ctx_t *ctx);
static void ngx_http_m40_cleanup(void *data);
static void ngx_http_m40_linger(ngx_event_t *ev);
static ngx_int_t ngx_http_m40_load_wait(ngx_http_request_t *r,
    ngx_http_m40_ctx_t *ctx);

#define NGX_HTTP_M40_LOAD_POLL_MS  50


ngx_int_t
ngx_http_m40_generate_handler(ngx_http_request_t *r, ngx_http_m40_kind_e kind,
    const ngx_http_m40_dialect_t *dialect)
{
    ngx_int_t            rc;
    ngx_http_m40_ctx_t  *ctx;

    ctx = ngx_pcalloc(r->pool, sizeof(ngx_http_m40_ctx_t));
    if (ctx == NULL) {
        return NGX_HTTP_INTERNAL_SERVER_ERROR;
    }

    ctx->request = r;
    ctx->kind = kind;
    ctx->dialect = dialect;
    ctx->mcf = ngx_http_get_module_main_conf(r, ngx_http_m40_module);

    ngx_http_set_ctx(r, ctx, ngx_http_m40_module);

    rc = ngx_http_read_client_request_body(r, ngx_http_m40_body_handler);
    if (rc >= NGX_HTTP_SPECIAL_RESPONSE) {
        return rc;
    }

    return NGX_DONE;
}


static void
ngx_http_m40_body_handler(ngx_http_request_t *r)
{
    ngx_int_t            rc;
    ngx_http_m40_ctx_t  *ctx;

    ctx = ngx_http_get_module_ctx(r, ngx_http_m40_module);

    rc = ngx_http_m40_start(r, ctx);
    if (rc == NGX_DONE) {
        return;         /* waiting for the engine */
    }

    ngx_http_finalize_request(r, rc);
}


/* The body's size: in memory, in a temp file, or both. */
static off_t
ngx_http_m40_body_size(ngx_http_request_t *r)
{
    off_t         total;
    ngx_chain_t  *cl;

    if (r->request_body == NULL || r->request_body->bufs == NULL) {
        return 0;
    }

    total = 0;
    for (cl = r->request_body->bufs; cl; cl = cl->next) {
        total += ngx_buf_size(cl->buf);
    }

    return total;
}


/* The body copied to p, which has room for all of it. */
static ngx_int_t
ngx_http_m40_body_copy(ngx_http_request_t *r, u_char *p)
{
    off_t         size;
    ssize_t       n;
    ngx_buf_t    *b;
    ngx_chain_t  *cl;

    for (cl = r->request_body->bufs; cl; cl = cl->next) {
        b = cl->buf;

        if (ngx_buf_special(b) || ngx_buf_size(b) == 0) {
            continue;       /* the last_buf marker of a chunked body */
        }

        if (ngx_buf_in_memory(b)) {
            p = ngx_cpymem(p, b->pos, b->last - b->pos);
            continue;
        }

        if (!b->in_file || b->file == NULL) {
            ngx_log_error(NGX_LOG_ALERT, r->connection->log, 0,
                          "m40: request body buffer neither in memory nor "
                          "in a file");
            return NGX_ERROR;
        }

        /* A body larger than client_body_buffer_size: nginx just wrote it,
         * so this reads the page cache. */
        size = b->file_last - b->file_pos;
        n = ngx_read_file(b->file, p, (size_t) size, b->file_pos);
        if (n != size) {
            ngx_log_error(NGX_LOG_ERR, r->connection->log, 0,
                          "m40: reading the request body from \"%V\" "
                          "returned %z of %O bytes", &b->file->name, n, size);
            return NGX_ERROR;
        }
        p += size;
    }

    return NGX_OK;
}


/* The whole body as one contiguous block. */
static ngx_int_t
ngx_http_m40_body(ngx_http_request_t *r, u_char **data, size_t *len)
{
    off_t        total;
    ngx_buf_t   *b;

    *data = NULL;
    *len = 0;

    total = ngx_http_m40_body_size(r);
    if (total == 0) {
        return NGX_OK;
    }

    b = r->request_body->bufs->buf;
    if (ngx_buf_in_memory(b) && ngx_buf_size(b) == total) {
        *data = b->pos;
        *len = (size_t) total;
        return NGX_OK;
    }

    *data = ngx_pnalloc(r->pool, (size_t) total);
    if (*data == NULL) {
        return NGX_ERROR;
    }

    *len = (size_t) total;

    return ngx_http_m40_body_copy(r, *data);
}


/* ---- large bodies: their JSON is parsed on the JSON thread (ngx_http_m40_json.c) */

static void
ngx_http_m40_json_wait_cleanup(void *data)
{
    ngx_http_m40_ctx_t *ctx = data;

    if (ctx->json_job) {
        ngx_log_error(NGX_LOG_INFO, ctx->request->connection->log, 0,
                      "m40: the request ended while its body of %uz bytes "
                      "was being parsed", ctx->json_job->len);
        ngx_http_m40_json_cancel(ctx->json_job);
        ctx->json_job = NULL;
    }

    if (ctx->json_root) {
        json_decref(ctx->json_root);
        ctx->json_root = NULL;
    }

    if (ctx->linger.timer_set) {
        ngx_del_timer(&ctx->linger);
    }
}


/* On the event loop: the body is parsed; start goes on from there, the way a request
 * that waited for a loading model resumes. */
static void
ngx_http_m40_json_parsed(ngx_http_m40_json_job_t *job)
{
    ngx_connection_t    *c;
    ngx_http_m40_ctx_t  *ctx;
    ngx_http_request_t  *r;

    ctx = job->ctx;
    r = ctx->request;
    c = r->connection;

    ctx->json_job = NULL;
    ctx->json_root = job->root;
    job->root = NULL;
    if (ctx->json_root == NULL) {
        ctx->json_err = job->err;
    }
    ctx->json_parsed = 1;

    if (job->read_err) {
        ngx_log_error(NGX_LOG_ERR, c->log, job->read_err,
                      "m40: reading the request body (%uz bytes) from its temp "
                      "file failed", job->len);
        ctx->json_failed = 1;
    }

    if (ctx->linger.timer_set) {
        ngx_del_timer(&ctx->linger);
    }

    ngx_http_m40_body_handler(r);
    ngx_http_run_posted_requests(c);
}


/* NGX_DONE: the body went to the JSON thread and the request waits for it;
 * NGX_DECLINED: the thread does not run (or no memory for the copy), parse inline. */
static ngx_int_t
ngx_http_m40_json_wait(ngx_http_request_t *r, ngx_http_m40_ctx_t *ctx,
    size_t len)
{
    ngx_buf_t                *b;
    ngx_chain_t              *cl;
    ngx_pool_cleanup_t       *cln;
    ngx_http_m40_json_job_t  *job;

    job = ngx_http_m40_json_job_create(len, r->connection->log);
    if (job == NULL) {
        return NGX_DECLINED;
    }

    /* A body past client_body_buffer_size is one buffer of its temp file: the thread
     * reads it. Anything else is copied here. */
    cl = r->request_body->bufs;
    b = cl->buf;

    if (cl->next == NULL && !ngx_buf_in_memory(b) && b->in_file && b->file
        && (size_t) (b->file_last - b->file_pos) == len)
    {
        job->fd = fcntl(b->file->fd, F_DUPFD_CLOEXEC, 0);
        job->file_pos = b->file_pos;
    }

    if (job->fd == NGX_INVALID_FILE
        && ngx_http_m40_body_copy(r, job->data) != NGX_OK)
    {
        ngx_http_m40_json_job_free(job);
        return NGX_HTTP_INTERNAL_SERVER_ERROR;
    }

    cln = ngx_pool_cleanup_add(r->pool, 0);
    if (cln == NULL) {
        ngx_http_m40_json_job_free(job);
        return NGX_HTTP_INTERNAL_SERVER_ERROR;
    }

    cln->handler = ngx_http_m40_json_wait_cleanup;
    cln->data = ctx;

    job->handler = ngx_http_m40_json_parsed;
    job->ctx = ctx;
    ctx->json_job = job;

    /* a client that leaves ends the request, whose cleanup cancels the job; a
     * graceful shutdown waits for the parse (as for a generation) */
    r->read_event_handler = ngx_http_test_reading;

    ctx->linger.handler = ngx_http_m40_linger;
    ctx->linger.data = ctx;
    ctx->linger.log = r->connection->log;
    ctx->linger.cancelable = 0;
    ngx_add_timer(&ctx->linger, NGX_HTTP_M40_LINGER_MS);

    ngx_http_m40_json_submit(job);

    return NGX_DONE;
}


static void
ngx_http_m40_body_cleanup(void *data)
{
    ngx_http_m40_ctx_t *ctx = data;

    if (ctx->body) {
        json_decref(ctx->body);
        ctx->body = NULL;
    }
}


/* A dialect's body becomes a chat request; the body stays for the answer (echoed
 * fields) until the request's pool goes. */
static json_t *
ngx_http_m40_dialect_request(ngx_http_m40_ctx_t *ctx, json_t *body,
    ngx_http_m40_error_t *err)
{
    ngx_pool_cleanup_t  *cln;

    cln = ngx_pool_cleanup_add(ctx->request->pool, 0);
    if (cln == NULL) {
        json_decref(body);
        ngx_http_m40_error_set(err, NGX_HTTP_INTERNAL_SERVER_ERROR,
                               "server_error", NULL, NULL, "out of memory");
        return NULL;
    }

    cln->handler = ngx_http_m40_body_cleanup;
    cln->data = ctx;
    ctx->body = body;

    if (!json_is_object(body)) {
        ngx_http_m40_error_set(err, NGX_HTTP_BAD_REQUEST,
                               "invalid_request_error", NULL, "invalid_value",
                               "the request body must be a JSON object");
        return NULL;
    }

    return ctx->dialect->request(ctx, body, err);
}


/* The model a request names in its "model" field; the first (default) model when it
 * names none (or a "model" that is not a string, which the parameters' checks then
 * refuse). NULL and a 404 in err for a name no m40_model has. */
static ngx_http_m40_model_t *
ngx_http_m40_route(ngx_http_m40_main_conf_t *mcf, json_t *root,
    ngx_http_m40_error_t *err)
{
    u_char                *p, *last;
    json_t                *v;
    ngx_uint_t             i;
    ngx_http_m40_model_t  *models, *m;

    models = mcf->models.elts;

    v = json_is_object(root) ? json_object_get(root, "model") : NULL;
    if (!json_is_string(v)) {
        return &models[0];
    }

    m = ngx_http_m40_model_find(mcf, (u_char *) json_string_value(v),
                                json_string_length(v));
    if (m) {
        return m;
    }

    /* the message is written below: the name as JSON gave it (it may hold
     * anything, NULs included), then the served ones */
    ngx_http_m40_error_set(err, NGX_HTTP_NOT_FOUND, "invalid_request_error",
                           "model", "model_not_found", "%s", "");

    p = (u_char *) err->message;
    last = p + sizeof(err->message) - 1;
    p = ngx_slprintf(p, last, "The model '%*s' does not exist (this server "
                     "serves ", ngx_min(json_string_length(v), 128),
                     json_string_value(v));
    for (i = 0; i < mcf->models.nelts; i++) {
        p = ngx_slprintf(p, last, "%s'%V'", i ? ", " : "",
                         &models[i].model_name);
    }
    p = ngx_slprintf(p, last, ")");
    *p = '\0';

    return NULL;
}


static ngx_int_t
ngx_http_m40_start(ngx_http_request_t *r, ngx_http_m40_ctx_t *ctx)
{
    char                       err_buf[256];
    off_t                      size;
    u_char                    *data, *pr;
    size_t                     len;
    json_t                    *root;
    ngx_int_t                  rc;
    uint64_t                   seed;
    ngx_uint_t                 i;
    json_error_t               jerr;
    m40_engine_state           state;
    m40_engine_capacity        cap;
    int32_t                    n_vocab;
    ngx_pool_cleanup_t        *cln;
    m40_submit_status          st;
    m40_request_params         rp;
    ngx_http_m40_error_t       err, derr;
    ngx_http_m40_params_t      p;
    ngx_http_m40_choice_t     *ch;
    ngx_http_m40_model_t      *model;
    ngx_http_m40_main_conf_t  *mcf;

    mcf = ctx->mcf;

    if (ctx->json_parsed && ctx->json_failed) {
        return NGX_HTTP_INTERNAL_SERVER_ERROR;      /* logged */
    }

    if (ctx->json_parsed) {
        /* parsed on the JSON thread: the root (or the error) is ours now */
        ctx->json_parsed = 0;
        root = ctx->json_root;
        ctx->json_root = NULL;
        jerr = ctx->json_err;

    } else {
        size = ngx_http_m40_body_size(r);

        if (size == 0) {
            return ngx_http_m40_send_simple_error(r, NGX_HTTP_BAD_REQUEST,
                       "invalid_request_error", "invalid_json",
                       "the request body is empty (a JSON object is "
                       "expected)");
        }

        if (size >= NGX_HTTP_M40_JSON_THREAD_MIN) {
            rc = ngx_http_m40_json_wait(r, ctx, (size_t) size);
            if (rc != NGX_DECLINED) {
                return rc;
            }
        }

        if (ngx_http_m40_body(r, &data, &len) != NGX_OK) {
            return NGX_HTTP_INTERNAL_SERVER_ERROR;
        }

        root = json_loadb((const char *) data, len, 0, &jerr);
    }

    if (root == NULL) {
        return ngx_http_m40_send_simple_error(r, NGX_HTTP_BAD_REQUEST,
                   "invalid_request_error", "invalid_json",
                   "the request body is not valid JSON: %s (line %d, "
                   "column %d)", jerr.text, jerr.line, jerr.column);
    }

    /* the "model" field chooses the engine (every dialect has it at the top) */
    if (ctx->model == NULL) {
        ctx->model = ngx_http_m40_route(mcf, root, &err);
        if (ctx->model == NULL) {
            /* a dialect's own 400s come first, as they did when the model was
             * checked after the conversion (with one model) */
            if (ctx->dialect) {
                root = ngx_http_m40_dialect_request(ctx, root, &derr);
                if (root == NULL) {
                    return ngx_http_m40_send_error(r, &derr);
                }
            }
            json_decref(root);
            return ngx_http_m40_send_error(r, &err);
        }

        if (ngx_http_m40_model_use(r, ctx->model) != NGX_OK) {
            json_decref(root);
            return NGX_HTTP_INTERNAL_SERVER_ERROR;
        }
    }

    model = ctx->model;

    /* keep_alive: an unloaded model loads (room permitting, m40_max_resident) */
    ngx_http_m40_model_load(model);

    /* A request that arrives while its model loads (a new worker after a reload, or
     * right after start, or a model that waits for another on its GPU) waits for it,
     * up to m40_load_wait, instead of a 503. The parsed body waits with it. */
    if (ctx->load_waited < mcf->load_wait
        && ngx_http_m40_model_state(model, NULL, 0) == M40_ENGINE_LOADING)
    {
        if (!ctx->load_waiting) {
            ctx->load_waiting = 1;
            ctx->load_since = ngx_current_msec;
            model->mc.load_waits++;
        }

        ctx->json_root = root;
        ctx->json_parsed = 1;
        return ngx_http_m40_load_wait(r, ctx);
    }

    if (ctx->load_waiting) {        /* the wait shows in /metrics */
        ctx->load_waiting = 0;
        model->mc.load_wait_seconds +=
                            (double) (ngx_current_msec - ctx->load_since) / 1000.0;
        ngx_http_m40_shm_publish(model);
    }

    if (ctx->dialect) {
        root = ngx_http_m40_dialect_request(ctx, root, &err);
        if (root == NULL) {
            return ngx_http_m40_send_error(r, &err);
        }
    }

    if (ngx_http_m40_parse_params(r, mcf, model, ctx->kind, root, &p, &err)
        != NGX_OK)
    {
        goto failed;
    }

    state = ngx_http_m40_model_state(model, err_buf, sizeof(err_buf));
    if (state != M40_ENGINE_READY) {
        ngx_http_m40_error_set(&err, NGX_HTTP_SERVICE_UNAVAILABLE,
                               "server_error", NULL,
                               state == M40_ENGINE_LOADING ? "model_loading"
                                                           : "model_failed",
                               state == M40_ENGINE_LOADING
                               ? "the model is still loading"
                               : "the model failed to load (the server's "
                                 "error log says why)");
        goto failed;
    }

    /* token ids past the vocabulary: known only now that the model is loaded (the
     * engine refuses them too, without naming the parameter) */
    n_vocab = p.n_bias ? m40_engine_n_vocab(model->engine) : 0;
    for (i = 0; i < p.n_bias; i++) {
        if (p.bias_ids[i] >= n_vocab) {
            ngx_http_m40_error_set(&err, NGX_HTTP_BAD_REQUEST,
                                   "invalid_request_error", "logit_bias",
                                   "invalid_value",
                                   "logit_bias token id %D is outside the "
                                   "vocabulary (0..%D)", p.bias_ids[i],
                                   n_vocab - 1);
            goto failed;
        }
    }

    /* n choices enter the waiting queue together, before any of them gets a slot: more
     * than the queue holds could never all be admitted, so it is the request that is
     * wrong (400), not the load (429, which a retry could get past) */
    if (p.n > 1 && m40_engine_get_capacity(model->engine, &cap) == 0
        && p.n > (ngx_uint_t) cap.max_queue)
    {
        ngx_http_m40_error_set(&err, NGX_HTTP_BAD_REQUEST,
                               "invalid_request_error", "n", "invalid_value",
                               "n is %ui, more than the %D requests this "
                               "server queues (m40_max_queue)", p.n,
                               cap.max_queue);
        goto failed;
    }

    ngx_http_m40_output_mode(ctx, &p);

    if (ctx->forced_tools && (p.grammar || p.json_schema || p.json_object)) {
        ngx_http_m40_error_set(&err, NGX_HTTP_BAD_REQUEST,
                               "invalid_request_error", "tool_choice",
                               "invalid_value",
                               "'tool_choice' \"required\" or a named function "
                               "together with 'response_format' or 'grammar' is "
                               "not supported (both constrain the output)");
        goto failed;
    }

    if (ctx->dialect) {
        /* the dialects' answers are built from the parser's pieces */
        ctx->parse = 1;
    }

    ctx->n = p.n;
    ctx->stream = p.stream ? 1 : 0;
    ctx->include_usage = p.include_usage ? 1 : 0;
    ctx->logprobs = p.logprobs ? 1 : 0;
    ctx->n_top = (ngx_uint_t) p.top_logprobs;
    ctx->created = ngx_time();

    pr = (u_char *) ngx_sprintf((u_char *) ctx->id, "%s%08xD%08xD%08xD",
                                ctx->dialect ? "" : ctx->kind == NGX_HTTP_M40_CHAT
                                                    ? "chatcmpl-" : "cmpl-",
                                (uint32_t) ngx_random(), (uint32_t) ngx_random(),
                                (uint32_t) ngx_random());
    *pr = '\0';

    if (p.echo) {
        ctx->echo_prefix.len = p.prompt.len;
        ctx->echo_prefix.data = ngx_pnalloc(r->pool, p.prompt.len + 1);
        if (ctx->echo_prefix.data == NULL) {
            goto nomem;
        }
        ngx_memcpy(ctx->echo_prefix.data, p.prompt.data, p.prompt.len);
    }

    ctx->choices = ngx_pcalloc(r->pool, p.n * sizeof(ngx_http_m40_choice_t));
    if (ctx->choices == NULL) {
        goto nomem;
    }

    cln = ngx_pool_cleanup_add(r->pool, 0);
    if (cln == NULL) {
        goto nomem;
    }

    cln->handler = ngx_http_m40_cleanup;
    cln->data = ctx;

    ngx_memzero(&rp, sizeof(m40_request_params));
    if (ctx->kind == NGX_HTTP_M40_CHAT) {
        rp.messages = p.messages;
    } else {
        rp.prompt = (const char *) p.prompt.data;
        rp.prompt_len = p.prompt.len;
    }
    rp.add_generation_prompt = 1;
    rp.max_tokens = (int32_t) p.max_tokens;
    m40_sampler_params_default(&rp.sampling);
    rp.sampling.temperature = p.temperature;
    rp.sampling.top_k = (int32_t) p.top_k;
    rp.sampling.top_p = p.top_p;
    rp.sampling.min_p = p.min_p;
    rp.sampling.presence_penalty = p.presence_penalty;
    rp.sampling.frequency_penalty = p.frequency_penalty;
    rp.sampling.n_logit_bias = (int32_t) p.n_bias;
    rp.sampling.logit_bias_ids = p.bias_ids;
    rp.sampling.logit_bias_values = p.bias_values;
    rp.sampling.n_top_logprobs = (int32_t) p.top_logprobs;
    rp.stop = (const char *const *) p.stop;
    rp.n_stop = (int32_t) p.n_stop;
    rp.logprobs = p.logprobs ? 1 : 0;
    rp.ignore_eos = p.ignore_eos ? 1 : 0;
    rp.tools = p.tools;
    rp.template_kwargs = p.template_kwargs;
    rp.grammar = p.grammar;
    rp.json_schema = p.json_schema;
    rp.json_object = p.json_object ? 1 : 0;
    rp.tool_call_format = ctx->forced_tools ? (int) ctx->tool_format : 0;
    rp.tool_call_parallel = p.parallel_tool_calls ? 1 : 0;
    rp.count_only = ctx->count_only ? 1 : 0;

    seed = p.has_seed ? p.seed
                      : ((uint64_t) ngx_random() << 32) ^ (uint64_t) ngx_random();

    for (i = 0; i < p.n; i++) {
        ch = &ctx->choices[i];
        ch->ctx = ctx;
        ch->index = i;

        if (ctx->logprobs && !ctx->stream) {
            ch->logprobs = ctx->kind == NGX_HTTP_M40_CHAT
                           ? json_array()
                           : json_pack("{s:[],s:[],s:[],s:[]}", "tokens",
                                       "token_logprobs", "top_logprobs",
                                       "text_offset");
            if (ch->logprobs == NULL) {
                goto nomem;
            }
        }

        ngx_http_m40_choice_register(mcf, ch);

        rp.sampling.seed = seed + i;

        st = m40_engine_submit(model->engine, &rp,
                               (void *) (uintptr_t) ch->node.key,
                               &ch->req, err_buf, sizeof(err_buf));

        /* admitted or refused, the engine has counted it: every worker's
         * /metrics is to see it at once */
        ngx_http_m40_shm_publish(model);

        switch (st) {

        case M40_SUBMIT_OK:
            continue;

        case M40_SUBMIT_QUEUE_FULL:
            ngx_http_m40_error_set(&err, NGX_HTTP_TOO_MANY_REQUESTS,
                                   "rate_limit_error", NULL, "queue_full",
                                   "the server is busy: %s", err_buf);
            break;

        case M40_SUBMIT_NOT_READY:
            ngx_http_m40_error_set(&err, NGX_HTTP_SERVICE_UNAVAILABLE,
                                   "server_error", NULL, "model_not_ready",
                                   "%s", err_buf);
            break;

        case M40_SUBMIT_INVALID:
            ngx_http_m40_error_set(&err, NGX_HTTP_BAD_REQUEST,
                                   "invalid_request_error", NULL,
                                   "invalid_value", "%s", err_buf);
            break;

        default:
            ngx_http_m40_error_set(&err, NGX_HTTP_INTERNAL_SERVER_ERROR,
                                   "server_error", NULL, NULL,
                                   "cannot submit the request: %s", err_buf);
            break;
        }

        /* the cleanup releases the choices submitted so far */
        goto failed;
    }

    json_decref(root);
    if (p.messages) {
        json_decref(p.messages);
    }
    if (p.tools) {
        json_decref(p.tools);
    }
    if (p.template_kwargs) {
        json_decref(p.template_kwargs);
    }

    /* Notice a client that goes away while it waits, and keep a graceful
     * shutdown (reload) from ending this worker under a running generation:
     * nginx's worker exits once no non-cancelable timer is left. */
    r->read_event_handler = ngx_http_test_reading;
    r->write_event_handler = ngx_http_request_empty_handler;

    ctx->linger.handler = ngx_http_m40_linger;
    ctx->linger.data = ctx;
    ctx->linger.log = r->connection->log;
    ctx->linger.cancelable = 0;
    ngx_add_timer(&ctx->linger, NGX_HTTP_M40_LINGER_MS);

    return NGX_DONE;

nomem:

    ngx_http_m40_error_set(&err, NGX_HTTP_INTERNAL_SERVER_ERROR, "server_error",
                           NULL, NULL, "out of memory");

failed:

    json_decref(root);
    if (p.messages) {
        json_decref(p.messages);
    }
    if (p.tools) {
        json_decref(p.tools);
    }
    if (p.template_kwargs) {
        json_decref(p.template_kwargs);
    }

    return ngx_http_m40_send_error(r, &err);
}


static void
ngx_http_m40_load_retry(ngx_event_t *ev)
{
    ngx_connection_t    *c;
    ngx_http_request_t  *r;

    r = ev->data;
    c = r->connection;

    ngx_http_m40_body_handler(r);
    ngx_http_run_posted_requests(c);
}


static void
ngx_http_m40_load_wait_cleanup(void *data)
{
    ngx_http_m40_ctx_t *ctx = data;

    if (ctx->load_ev.timer_set) {
        ngx_del_timer(&ctx->load_ev);
    }

    if (ctx->json_root) {       /* the body of a request that left while it waited */
        json_decref(ctx->json_root);
        ctx->json_root = NULL;
    }
}


/* Looks at the engine again in NGX_HTTP_M40_LOAD_POLL_MS (the body stays read); a
 * client that leaves meanwhile ends the request, and the pool's cleanup the timer. */
static ngx_int_t
ngx_http_m40_load_wait(ngx_http_request_t *r, ngx_http_m40_ctx_t *ctx)
{
    ngx_pool_cleanup_t  *cln;

    if (ctx->load_ev.handler == NULL) {
        cln = ngx_pool_cleanup_add(r->pool, 0);
        if (cln == NULL) {
            return NGX_HTTP_INTERNAL_SERVER_ERROR;
        }
        cln->handler = ngx_http_m40_load_wait_cleanup;
        cln->data = ctx;

        ctx->load_ev.handler = ngx_http_m40_load_retry;
        ctx->load_ev.data = r;
        ctx->load_ev.log = r->connection->log;
        r->read_event_handler = ngx_http_test_reading;
    }

    ctx->load_waited += NGX_HTTP_M40_LOAD_POLL_MS;
    ngx_add_timer(&ctx->load_ev, NGX_HTTP_M40_LOAD_POLL_MS);

    return NGX_DONE;
}


static void
ngx_http_m40_linger(ngx_event_t *ev)
{
    ngx_add_timer(ev, NGX_HTTP_M40_LINGER_MS);
}


static void
ngx_http_m40_cleanup(void *data)
{
    ngx_http_m40_ctx_t *ctx = data;

    ngx_uint_t              i;
    ngx_http_m40_choice_t  *ch;

    for (i = 0; i < ctx->n && ctx->choices; i++) {
        ch = &ctx->choices[i];

        ngx_http_m40_choice_unregister(ctx->mcf, ch);

        if (ch->req) {
            ngx_log_debug2(NGX_LOG_DEBUG_HTTP, ctx->request->connection->log, 0,
                           "m40 %s: abandoning choice %ui", ctx->id, i);
            m40_request_release(ch->req);
            ch->req = NULL;
        }

        if (ch->logprobs) {
            json_decref(ch->logprobs);
            ch->logprobs = NULL;
        }

        ngx_http_m40_parser_free(ch);
    }

    if (ctx->linger.timer_set) {
        ngx_del_timer(&ctx->linger);
    }

    /* a release from the queue is counted now (cancelled): every worker's /metrics
     * is to see it */
    if (ctx->model) {
        ngx_http_m40_shm_publish(ctx->model);
    }
}


/* Called from the eventfd handler: a choice of this request has events. */
void
ngx_http_m40_ctx_wake(ngx_http_m40_ctx_t *ctx)
{
    ngx_int_t            rc;
    ngx_connection_t    *c;
    ngx_http_request_t  *r;

    r = ctx->request;
    c = r->connection;

    if (ctx->waiting_write) {
        return;         /* the writer resumes pulling once the client reads */
    }

    rc = ngx_http_m40_process(ctx);
    if (rc != NGX_DONE) {
        ngx_http_finalize_request(r, rc);
    }

    ngx_http_run_posted_requests(c);
}


ngx_int_t
ngx_http_m40_process(ngx_http_m40_ctx_t *ctx)
{
    if (ctx->finished) {
        return NGX_DONE;
    }

    return ctx->stream ? ngx_http_m40_pump(ctx) : ngx_http_m40_collect(ctx);
}


void
ngx_http_m40_choice_done(ngx_http_m40_ctx_t *ctx, ngx_http_m40_choice_t *ch,
    m40_event *ev)
{
    ch->done = 1;
    ch->finish = ev->finish;
    ch->prompt_tokens = ev->prompt_tokens;
    ch->cached_tokens = ev->cached_tokens;
    ch->completion_tokens = ev->completion_tokens;
    ch->stop_matched = ev->stop_matched;
    ctx->n_done++;

    ngx_http_m40_choice_unregister(ctx->mcf, ch);
    m40_request_release(ch->req);
    ch->req = NULL;
}


void
ngx_http_m40_event_error(ngx_http_m40_error_t *err, m40_event *ev)
{
    ngx_uint_t  status;

    status = ev->http_status >= 400 && ev->http_status < 600
             ? (ngx_uint_t) ev->http_status : NGX_HTTP_INTERNAL_SERVER_ERROR;

    ngx_http_m40_error_set(err, status,
                           status < 500 ? "invalid_request_error"
                                        : "server_error",
                           NULL,
                           status == NGX_HTTP_BAD_REQUEST ? "invalid_value"
                           : status == NGX_HTTP_SERVICE_UNAVAILABLE
                             ? "engine_stopping" : NULL,
                           "%s", ev->message[0] ? ev->message
                                                : "generation failed");
}


/* ---- non-streaming ---- */

ngx_int_t
ngx_http_m40_append(ngx_http_request_t *r, u_char **buf, size_t *blen,
    size_t *bcap, const char *text, size_t len)
{
    u_char  *p;
    size_t   cap;

    if (len == 0) {
        return NGX_OK;
    }

    if (*blen + len > *bcap) {
        cap = ngx_max(*bcap * 2, *blen + len);
        cap = ngx_max(cap, 256);

        p = ngx_pnalloc(r->pool, cap);
        if (p == NULL) {
            return NGX_ERROR;
        }

        if (*blen) {
            ngx_memcpy(p, *buf, *blen);
        }

        if (*buf) {
            ngx_pfree(r->pool, *buf);
        }

        *buf = p;
        *bcap = cap;
    }

    ngx_memcpy(*buf + *blen, text, len);
    *blen += len;

    return NGX_OK;
}


static ngx_int_t
ngx_http_m40_append_text(ngx_http_request_t *r, ngx_http_m40_choice_t *ch,
    const char *text, size_t len)
{
    return ngx_http_m40_append(r, &ch->text, &ch->text_len, &ch->text_cap,
                               text, len);
}


/* Output parser pieces of a non-streaming choice: content and reasoning are
 * gathered apart, tool calls become the message's tool_calls. */
static int
ngx_http_m40_collect_piece(void *ud, const m40_piece *pc)
{
    ngx_http_m40_choice_t *ch = ud;

    json_t              *c;
    ngx_http_request_t  *r;

    r = ch->ctx->request;

    switch (pc->kind) {

    case M40_PIECE_CONTENT:
        return ngx_http_m40_append_text(r, ch, pc->text, pc->len) == NGX_OK
               ? 0 : -1;

    case M40_PIECE_REASONING:
        return ngx_http_m40_append(r, &ch->reasoning, &ch->reasoning_len,
                                   &ch->reasoning_cap, pc->text, pc->len)
               == NGX_OK ? 0 : -1;

    default:
        if (!ch->ctx->parallel_tool_calls && ch->n_tool_calls > 0) {
            return 0;   /* parallel_tool_calls false: the first call only */
        }

        if (ch->tool_calls == NULL) {
            ch->tool_calls = json_array();
        }

        c = ngx_http_m40_tool_call_json(pc, 0);
        if (ch->tool_calls == NULL || c == NULL
            || json_array_append_new(ch->tool_calls, c) != 0)
        {
            return -1;
        }

        ch->n_tool_calls++;
        return 0;
    }
}


/* A chat choice: the message with its content (null when the answer is only tool
 * calls, as OpenAI's), reasoning_content when the template thinks and the mode is
 * separate, tool_calls when there are any (finish_reason "tool_calls" then, unless
 * the output was cut at max_tokens). Takes text and lp. */
static json_t *
ngx_http_m40_chat_choice(ngx_http_m40_ctx_t *ctx, ngx_http_m40_choice_t *ch,
    ngx_uint_t i, json_t *text, json_t *lp)
{
    size_t       k;
    json_t      *msg, *c;
    const char  *finish;

    msg = json_pack("{s:s}", "role", "assistant");
    if (msg == NULL || text == NULL) {
        json_decref(msg);
        json_decref(text);
        json_decref(lp);
        return NULL;
    }

    if (ch->tool_calls) {
        /* only blanks around the calls (a newline before "<tool_call>"): no content */
        for (k = 0; k < ch->text_len; k++) {
            if (ch->text[k] != ' ' && ch->text[k] != '\n' && ch->text[k] != '\r'
                && ch->text[k] != '\t')
            {
                break;
            }
        }

        if (k == ch->text_len) {
            json_decref(text);
            text = json_null();
        }
    }
    json_object_set_new(msg, "content", text);

    if (ctx->reasoning == M40_REASONING_SEPARATE) {
        json_object_set_new(msg, "reasoning_content",
                            ch->reasoning_len
                            ? ngx_http_m40_json_text((const char *) ch->reasoning,
                                                     ch->reasoning_len)
                            : json_null());
    }

    finish = ngx_http_m40_finish_reason(ch->finish);
    if (ch->tool_calls) {
        json_object_set(msg, "tool_calls", ch->tool_calls);
        if (ch->finish != M40_FINISH_LENGTH) {
            finish = "tool_calls";
        }
    }

    c = json_pack("{s:I,s:o,s:o,s:s}", "index", (json_int_t) i,
                  "message", msg, "logprobs", lp, "finish_reason", finish);

    return c;
}


static ngx_int_t
ngx_http_m40_send_completion(ngx_http_m40_ctx_t *ctx)
{
    u_char                 *p;
    json_t                 *choices, *c, *text, *root, *lp;
    ngx_int_t               rc;
    ngx_uint_t              i;
    ngx_http_request_t     *r;
    ngx_http_m40_choice_t  *ch;

    r = ctx->request;

    choices = json_array();
    if (choices == NULL) {
        return NGX_HTTP_INTERNAL_SERVER_ERROR;
    }

    for (i = 0; i < ctx->n; i++) {
        ch = &ctx->choices[i];

        if (ctx->echo_prefix.len) {
            /* completions echo: the prompt comes first */
            p = ngx_pnalloc(r->pool, ctx->echo_prefix.len + ch->text_len);
            if (p == NULL) {
                json_decref(choices);
                return NGX_HTTP_INTERNAL_SERVER_ERROR;
            }
            ngx_memcpy(p, ctx->echo_prefix.data, ctx->echo_prefix.len);
            if (ch->text_len) {
                ngx_memcpy(p + ctx->echo_prefix.len, ch->text, ch->text_len);
            }
            ch->text = p;
            ch->text_len += ctx->echo_prefix.len;
            ch->text_cap = ch->text_len;
        }

        text = ngx_http_m40_json_text((const char *) (ch->text ? ch->text
                                                      : (u_char *) ""),
                                      ch->text_len);

        if (ch->logprobs) {
            lp = ctx->kind == NGX_HTTP_M40_CHAT
                 ? json_pack("{s:O,s:n}", "content", ch->logprobs, "refusal")
                 : json_incref(ch->logprobs);
        } else {
            lp = json_null();
        }

        if (ctx->kind == NGX_HTTP_M40_CHAT) {
            c = ngx_http_m40_chat_choice(ctx, ch, i, text, lp);
        } else {
            c = json_pack("{s:I,s:o,s:o,s:s}",
                          "index", (json_int_t) i,
                          "text", text,
                          "logprobs", lp,
                          "finish_reason",
                          ngx_http_m40_finish_reason(ch->finish));
        }

        if (c == NULL || json_array_append_new(choices, c) != 0) {
            json_decref(choices);
            ngx_log_error(NGX_LOG_ERR, r->connection->log, 0,
                          "m40: cannot build the response");
            return NGX_HTTP_INTERNAL_SERVER_ERROR;
        }
    }

    root = ngx_http_m40_object(ctx, ctx->kind == NGX_HTTP_M40_CHAT
                                    ? "chat.completion" : "text_completion",
                               choices);
    if (root == NULL) {
        ngx_log_error(NGX_LOG_ERR, r->connection->log, 0,
                      "m40: cannot build the response");
        return NGX_HTTP_INTERNAL_SERVER_ERROR;
    }

    json_object_set_new(root, "usage", ngx_http_m40_usage_json(ctx));

    ctx->finished = 1;
    rc = ngx_http_m40_send_json(r, NGX_HTTP_OK, root);
    json_decref(root);

    return rc;
}


static ngx_int_t
ngx_http_m40_collect(ngx_http_m40_ctx_t *ctx)
{
    ngx_uint_t              i;
    m40_event               ev;
    ngx_http_request_t     *r;
    ngx_http_m40_error_t    err;
    ngx_http_m40_choice_t  *ch;

    r = ctx->request;

    for (i = 0; i < ctx->n; i++) {
        ch = &ctx->choices[i];

        while (!ch->done && m40_request_poll(ch->req, &ev)) {

            switch (ev.type) {

            case M40_EV_TEXT:
                if ((ctx->parse
                     ? ngx_http_m40_parser_feed(ctx, ch, &ev,
                                                ngx_http_m40_collect_piece, ch)
                     : ngx_http_m40_append_text(r, ch, ev.text, ev.text_len))
                    != NGX_OK
                    || (ch->logprobs
                        && ngx_http_m40_logprobs_add(ctx, ch, ch->logprobs,
                                                     &ev) != NGX_OK))
                {
                    m40_event_clear(&ev);
                    ngx_log_error(NGX_LOG_ERR, r->connection->log, 0,
                                  "m40: out of memory collecting the answer");
                    return NGX_HTTP_INTERNAL_SERVER_ERROR;
                }
                break;

            case M40_EV_DONE:
                if (ctx->parse
                    && ngx_http_m40_parser_feed(ctx, ch, &ev,
                                                ngx_http_m40_collect_piece, ch)
                       != NGX_OK)
                {
                    m40_event_clear(&ev);
                    ngx_log_error(NGX_LOG_ERR, r->connection->log, 0,
                                  "m40: out of memory parsing the answer");
                    return NGX_HTTP_INTERNAL_SERVER_ERROR;
                }
                ngx_http_m40_choice_done(ctx, ch, &ev);
                break;

            default: /* M40_EV_ERROR */
                ngx_http_m40_event_error(&err, &ev);
                m40_event_clear(&ev);
                ctx->finished = 1;
                return ngx_http_m40_send_error(r, &err);
            }

            m40_event_clear(&ev);
        }
    }

    if (ctx->n_done < ctx->n) {
        return NGX_DONE;
    }

    if (ctx->dialect) {
        ctx->finished = 1;
        return ctx->dialect->send(ctx);
    }

    return ngx_http_m40_send_completion(ctx);
}
