/* GET /v1/models, /health and /metrics.
 *
 * Each worker has its own engine of each model; the metrics zone (ngx_http_m40_shm.c)
 * holds all of their counters and states, so these describe the whole server, whichever
 * worker answers: counters and gauges are sums over the workers, a model is ready when
 * every worker's engine of it is. What only the answering worker knows (the device its
 * engine runs on, the memory it holds, the context and slots it sized) comes from its
 * own engine. */
#include "ngx_http_m40_module.h"

#include <fcntl.h>
#include <math.h>
#include <unistd.h>


/* A model's state over every worker: failed when one engine failed, loading while
 * one is still loading (or waits for its GPU), ready when one is loaded, else unloaded
 * (keep_alive). */
static const char *
ngx_http_m40_agg_state_name(ngx_http_m40_agg_t *agg)
{
    if (agg->failed) {
        return "failed";
    }

    if (agg->loading || agg->pending) {
        return "loading";
    }

    if (agg->ready) {
        return "ready";
    }

    /* keep_alive: loaded by its next request */
    return agg->unloaded ? "unloaded" : "loading";
}


static json_t *
ngx_http_m40_model_json(ngx_http_m40_model_t *m)
{
    json_t              *model;
    ngx_http_m40_agg_t   agg;

    ngx_http_m40_shm_model(m, &agg);

    model = json_pack("{s:s%,s:s,s:I,s:s,s:s}",
                      "id", (const char *) m->model_name.data,
                      (size_t) m->model_name.len,
                      "object", "model",
                      "created", (json_int_t) m->mcf->start_time,
                      "owned_by", "m40",
                      "state", ngx_http_m40_agg_state_name(&agg));
    if (model == NULL) {
        return NULL;
    }

    if (m->engine
        && m40_engine_get_state(m->engine, NULL, 0) == M40_ENGINE_READY)
    {
        json_object_set_new(model, "max_model_len",
                            json_integer(m40_engine_ctx_size(m->engine)));
    }

    return model;
}


/* GET /v1/models (id NULL) or /v1/models/{id}: every m40_model, the default first. */
ngx_int_t
ngx_http_m40_models_handler(ngx_http_request_t *r, ngx_str_t *id)
{
    json_t                    *root, *data, *model;
    ngx_int_t                  rc;
    ngx_uint_t                 i;
    ngx_http_m40_model_t      *models, *m;
    ngx_http_m40_main_conf_t  *mcf;

    mcf = ngx_http_get_module_main_conf(r, ngx_http_m40_module);
    models = mcf->models.elts;

    if (id) {
        m = ngx_http_m40_model_find(mcf, id->data, id->len);
        if (m == NULL) {
            return ngx_http_m40_send_simple_error(r, NGX_HTTP_NOT_FOUND,
                       "invalid_request_error", "model_not_found",
                       "The model '%V' does not exist", id);
        }

        root = ngx_http_m40_model_json(m);

    } else {
        data = json_array();
        root = json_pack("{s:s,s:o}", "object", "list", "data", data);

        for (i = 0; root && i < mcf->models.nelts; i++) {
            model = ngx_http_m40_model_json(&models[i]);
            if (model == NULL || json_array_append_new(data, model) != 0) {
                json_decref(root);
                root = NULL;
            }
        }
    }

    if (root == NULL) {
        ngx_log_error(NGX_LOG_ERR, r->connection->log, 0,
                      "m40: cannot build the model list");
        return NGX_HTTP_INTERNAL_SERVER_ERROR;
    }

    rc = ngx_http_m40_send_json(r, NGX_HTTP_OK, root);
    json_decref(root);

    return rc;
}


/* The resident memory of this worker process in bytes (the CPU engine's weights that
 * were touched, its KV cache and everything else), or -1: /proc/self/statm. */
static double
ngx_http_m40_resident_bytes(void)
{
    int      fd;
    char     buf[128];
    ssize_t  n;
    long     size, resident;

    fd = open("/proc/self/statm", O_RDONLY);
    if (fd == -1) {
        return -1;
    }

    n = read(fd, buf, sizeof(buf) - 1);
    close(fd);

    if (n <= 0) {
        return -1;
    }

    buf[n] = '\0';

    if (sscanf(buf, "%ld %ld", &size, &resident) != 2) {
        return -1;
    }

    return (double) resident * (double) ngx_pagesize;
}


/* What `m40 ps` shows of a model: where this worker's engine runs, the memory it holds
 * and how busy the model is over every worker. memory_bytes on a GPU is the card's
 * memory in use once the engine's KV cache was allocated (other processes on the card
 * included); on the CPU, the worker's resident memory, given when the worker has no
 * other model (the models' parts of it cannot be told apart). */
static void
ngx_http_m40_health_usage(json_t *root, ngx_http_m40_model_t *m,
    ngx_http_m40_agg_t *agg)
{
    char                  device[32];
    double                mem;
    m40_engine_capacity   cap;

    json_object_set_new(root, "workers", json_integer((json_int_t) agg->engines));
    json_object_set_new(root, "workers_ready",
                        json_integer((json_int_t) agg->ready));

    if (m->engine == NULL || m40_engine_get_capacity(m->engine, &cap) != 0) {
        return;
    }

    if (cap.device >= 0) {
        ngx_snprintf((u_char *) device, sizeof(device) - 1, "cuda:%d%Z",
                     cap.device);
        mem = cap.gpu_in_use + cap.kv_bytes;

    } else {
        ngx_cpystrn((u_char *) device, (u_char *) "cpu", sizeof(device));
        mem = m->mcf->models.nelts == 1 ? ngx_http_m40_resident_bytes() : -1;
    }

    json_object_set_new(root, "device", json_string(device));
    if (mem >= 0) {
        json_object_set_new(root, "memory_bytes",
                            json_integer((json_int_t) mem));
    }
    json_object_set_new(root, "ctx_size", json_integer(cap.ctx));
    json_object_set_new(root, "max_seqs", json_integer(cap.max_seqs));
    json_object_set_new(root, "running", json_integer(agg->s.running));
    json_object_set_new(root, "queued", json_integer(agg->s.queue_depth));
    json_object_set_new(root, "kv_tokens_used",
                        json_integer(agg->s.kv_tokens_used));
    json_object_set_new(root, "kv_tokens_total",
                        json_integer(agg->s.kv_tokens_total));
}


static json_t *
ngx_http_m40_health_model(ngx_http_m40_model_t *m, const char **state)
{
    json_t              *root;
    ngx_http_m40_agg_t   agg;

    ngx_http_m40_shm_model(m, &agg);
    *state = ngx_http_m40_agg_state_name(&agg);

    root = json_pack("{s:s,s:s%}", "status", *state, "model",
                     (const char *) m->model_name.data,
                     (size_t) m->model_name.len);
    if (root == NULL) {
        return NULL;
    }

    if (agg.failed) {
        /* the engine's reason names server files: it went to the error log at
         * load, the client gets only that it failed */
        json_object_set_new(root, "error",
                            json_string("the model failed to load (the "
                                        "server's error log says why)"));
    }

    ngx_http_m40_health_usage(root, m, &agg);

    return root;
}


/* GET /health: 200 when every model is ready in every worker, else 503. The top level
 * is the default model's object (what it was with one model), with "status" the
 * server's: failed when a model failed, loading while one loads; "models" has every
 * model's. */
ngx_int_t
ngx_http_m40_health_handler(ngx_http_request_t *r)
{
    json_t                    *root, *list, *one;
    ngx_int_t                  rc;
    ngx_uint_t                 i, failed, loading;
    const char                *state;
    ngx_http_m40_model_t      *models;
    ngx_http_m40_main_conf_t  *mcf;

    mcf = ngx_http_get_module_main_conf(r, ngx_http_m40_module);
    models = mcf->models.elts;

    root = NULL;
    list = json_array();
    failed = 0;
    loading = 0;

    for (i = 0; list && i < mcf->models.nelts; i++) {
        one = ngx_http_m40_health_model(&models[i], &state);
        if (one == NULL) {
            goto failed;
        }

        failed += (state[0] == 'f');
        loading += (state[0] == 'l');

        if (i == 0) {
            root = json_deep_copy(one);
            if (root == NULL) {
                json_decref(one);
                goto failed;
            }
        }

        if (json_array_append_new(list, one) != 0) {
            goto failed;
        }
    }

    if (root == NULL || list == NULL) {
        goto failed;
    }

    json_object_set_new(root, "status", json_string(failed ? "failed"
                                                    : loading ? "loading"
                                                    : "ready"));
    if (failed && json_object_get(root, "error") == NULL) {
        json_object_set_new(root, "error",
                            json_string("a model failed to load (the "
                                        "server's error log says why)"));
    }
    json_object_set_new(root, "models", list);

    rc = ngx_http_m40_send_json(r, (failed || loading)
                                   ? NGX_HTTP_SERVICE_UNAVAILABLE
                                   : NGX_HTTP_OK, root);
    json_decref(root);

    return rc;

failed:

    if (root) {
        json_decref(root);
    }
    if (list) {
        json_decref(list);
    }

    ngx_log_error(NGX_LOG_ERR, r->connection->log, 0,
                  "m40: cannot build the health response");
    return NGX_HTTP_INTERNAL_SERVER_ERROR;
}


/* One row of /metrics: a model (its label, escaped) and its sum over the workers;
 * the first row is the server's total, without a label. */
typedef struct {
    ngx_str_t            label;       /* {model="..."} or empty */
    ngx_str_t            hlabel;      /* model="...", (before le=) or empty */
    ngx_http_m40_agg_t   agg;
} ngx_http_m40_mrow_t;

typedef struct {
    ngx_pool_t          *pool;
    ngx_array_t         *rows;
    ngx_int_t            failed;
} ngx_http_m40_mrows_t;


static void
ngx_http_m40_metrics_row(void *data, const u_char *name, size_t len,
    ngx_http_m40_agg_t *agg)
{
    ngx_http_m40_mrows_t *mr = data;

    u_char               *p, *q;
    size_t                i;
    ngx_http_m40_mrow_t  *row, *total;

    row = ngx_array_push(mr->rows);
    if (row == NULL) {
        mr->failed = 1;
        return;
    }

    row->agg = *agg;

    /* the label value with \, " and newlines escaped (the text format's rules) */
    p = ngx_pnalloc(mr->pool, 2 * (2 * len + sizeof("{model=\"\"}")));
    if (p == NULL) {
        mr->failed = 1;
        return;
    }

    row->label.data = p;
    p = ngx_cpymem(p, "{model=\"", sizeof("{model=\"") - 1);
    q = p;
    for (i = 0; i < len; i++) {
        if (name[i] == '\\' || name[i] == '"') {
            *p++ = '\\';
            *p++ = name[i];
        } else if (name[i] == '\n') {
            *p++ = '\\';
            *p++ = 'n';
        } else {
            *p++ = name[i];
        }
    }
    row->hlabel.len = p - q;
    p = ngx_cpymem(p, "\"}", 2);
    row->label.len = p - row->label.data;

    /* model="...", for the histograms' buckets */
    row->hlabel.data = p;
    p = ngx_cpymem(p, "model=\"", sizeof("model=\"") - 1);
    p = ngx_cpymem(p, q, row->hlabel.len);
    p = ngx_cpymem(p, "\",", 2);
    row->hlabel.len = p - row->hlabel.data;

    total = mr->rows->elts;
    ngx_http_m40_stats_add(&total->agg.s, &agg->s, 1);
    total->agg.engines += agg->engines;
    total->agg.pending += agg->pending;
    total->agg.loading += agg->loading;
    total->agg.ready += agg->ready;
    total->agg.failed += agg->failed;
    total->agg.unloaded += agg->unloaded;
    ngx_http_m40_mc_add(&total->agg.mc, &agg->mc);
}


/* 0 loading, 1 ready, 2 failed, 3 unloaded; -1: no engine at all */
static ngx_int_t
ngx_http_m40_agg_state_value(ngx_http_m40_agg_t *agg)
{
    if (agg->engines == 0) {
        return -1;
    }

    return agg->failed ? 2 : (agg->loading || agg->pending) ? 0
           : agg->ready ? 1 : 3;
}


typedef enum {
    NGX_HTTP_M40_U64 = 0,
    NGX_HTTP_M40_I32,
    NGX_HTTP_M40_I64,
    NGX_HTTP_M40_DBL,
    NGX_HTTP_M40_STATE,           /* from the engines' states */
    NGX_HTTP_M40_HIT_RATIO,
    NGX_HTTP_M40_KV_RATIO,
    NGX_HTTP_M40_MC_U64,          /* ngx_http_m40_mcounters_t's */
    NGX_HTTP_M40_MC_DBL,
    NGX_HTTP_M40_LOADED           /* engines loaded or loading */
} ngx_http_m40_mkind_e;

typedef struct {
    const char            *name;
    const char            *type;
    const char            *help;
    ngx_http_m40_mkind_e   kind;
    size_t                 off;   /* in m40_engine_stats */
} ngx_http_m40_family_t;

#define ngx_http_m40_off(f)  offsetof(m40_engine_stats, f)

static ngx_http_m40_family_t  ngx_http_m40_families[] = {
    { "m40_engine_state", "gauge",
      "0 loading, 1 ready, 2 failed, 3 unloaded (keep_alive; -1: no engine); "
      "of a model: failed when a worker's engine failed, loading while one "
      "loads; unlabelled: the same over every model", NGX_HTTP_M40_STATE, 0 },
    { "m40_engines_loaded", "gauge",
      "Engines loaded or loading (one per model and worker, less those "
      "keep_alive unloaded or that failed)", NGX_HTTP_M40_LOADED, 0 },
    { "m40_model_loads_total", "counter",
      "Engines started (at start, after a reload, and each load keep_alive or "
      "m40_max_resident caused)", NGX_HTTP_M40_MC_U64,
      offsetof(ngx_http_m40_mcounters_t, loads) },
    { "m40_model_unloads_total", "counter",
      "Engines unloaded (keep_alive, m40_max_resident)", NGX_HTTP_M40_MC_U64,
      offsetof(ngx_http_m40_mcounters_t, unloads) },
    { "m40_model_load_waits_total", "counter",
      "Requests that waited for their model to load", NGX_HTTP_M40_MC_U64,
      offsetof(ngx_http_m40_mcounters_t, load_waits) },
    { "m40_model_load_wait_seconds_total", "counter",
      "Time those requests waited (counted when the model was there)",
      NGX_HTTP_M40_MC_DBL, offsetof(ngx_http_m40_mcounters_t, load_wait_seconds) },
    { "m40_requests_total", "counter",
      "Generation requests admitted by the engines",
      NGX_HTTP_M40_U64, ngx_http_m40_off(requests_total) },
    { "m40_requests_rejected_total", "counter",
      "Requests refused because the queue was full",
      NGX_HTTP_M40_U64, ngx_http_m40_off(requests_rejected) },
    { "m40_requests_cancelled_total", "counter",
      "Requests abandoned before they finished",
      NGX_HTTP_M40_U64, ngx_http_m40_off(requests_cancelled) },
    { "m40_prompt_tokens_total", "counter",
      "Prompt tokens of admitted requests",
      NGX_HTTP_M40_U64, ngx_http_m40_off(prompt_tokens_total) },
    { "m40_prompt_tokens_computed_total", "counter",
      "Prompt tokens run through the model",
      NGX_HTTP_M40_U64, ngx_http_m40_off(prompt_tokens_computed) },
    { "m40_generation_tokens_total", "counter", "Generated tokens",
      NGX_HTTP_M40_U64, ngx_http_m40_off(completion_tokens_total) },
    { "m40_prefix_cache_queries_total", "counter",
      "Prompt lookups in the KV prefix cache",
      NGX_HTTP_M40_U64, ngx_http_m40_off(prefix_cache_queries) },
    { "m40_prefix_cache_query_tokens_total", "counter",
      "Prompt tokens looked up in the KV prefix cache",
      NGX_HTTP_M40_U64, ngx_http_m40_off(prefix_cache_query_tokens) },
    { "m40_prefix_cache_hit_tokens_total", "counter",
      "Prompt tokens found in the KV prefix cache (not computed)",
      NGX_HTTP_M40_U64, ngx_http_m40_off(prefix_cache_hit_tokens) },
    { "m40_prefix_cache_hit_ratio", "gauge",
      "Fraction of looked-up prompt tokens found in the KV prefix cache",
      NGX_HTTP_M40_HIT_RATIO, 0 },
    { "m40_queue_depth", "gauge", "Requests waiting for a sequence slot",
      NGX_HTTP_M40_I32, ngx_http_m40_off(queue_depth) },
    { "m40_running_sequences", "gauge", "Sequences being generated",
      NGX_HTTP_M40_I32, ngx_http_m40_off(running) },
    { "m40_kv_usage_ratio", "gauge",
      "Fraction of the KV cache in use (all the engines' caches together)",
      NGX_HTTP_M40_KV_RATIO, 0 },
    { "m40_engine_steps_total", "counter",
      "Model steps (forward passes) the engines ran",
      NGX_HTTP_M40_U64, ngx_http_m40_off(steps_total) },
    { "m40_engine_step_tokens_total", "counter",
      "Tokens (batch rows) those steps carried",
      NGX_HTTP_M40_U64, ngx_http_m40_off(step_tokens_total) },
    { "m40_prefill_guard_limited_steps_total", "counter",
      "Steps in which the ITL guard held prompt tokens back to keep decoding "
      "sequences' steps short",
      NGX_HTTP_M40_U64, ngx_http_m40_off(guard_limited_steps) },
    { "m40_prefill_guard_probe_steps_total", "counter",
      "Steps run without prompt tokens to measure the decode-only step time "
      "(part of the limited steps)",
      NGX_HTTP_M40_U64, ngx_http_m40_off(guard_probe_steps) },
    { "m40_decode_step_seconds", "gauge",
      "The ITL guard's estimate of a decode-only step of the running "
      "sequences (the slowest engine's)",
      NGX_HTTP_M40_DBL, ngx_http_m40_off(decode_step_estimate) },
};


static u_char *
ngx_http_m40_family(u_char *p, u_char *end, ngx_http_m40_family_t *f,
    ngx_http_m40_mrow_t *rows, ngx_uint_t n)
{
    u_char            *v;
    double             d;
    ngx_uint_t         i;
    m40_engine_stats  *s;

    p = ngx_slprintf(p, end, "# HELP %s %s\n# TYPE %s %s\n", f->name, f->help,
                     f->name, f->type);

    for (i = 0; i < n; i++) {
        s = &rows[i].agg.s;
        v = (u_char *) s + f->off;

        p = ngx_slprintf(p, end, "%s%V ", f->name, &rows[i].label);

        switch (f->kind) {

        case NGX_HTTP_M40_U64:
            p = ngx_slprintf(p, end, "%uL\n", *(uint64_t *) v);
            break;

        case NGX_HTTP_M40_I32:
            p = ngx_slprintf(p, end, "%D\n", *(int32_t *) v);
            break;

        case NGX_HTTP_M40_I64:
            p = ngx_slprintf(p, end, "%L\n", *(int64_t *) v);
            break;

        case NGX_HTTP_M40_STATE:
            p = ngx_slprintf(p, end, "%i\n",
                             ngx_http_m40_agg_state_value(&rows[i].agg));
            break;

        case NGX_HTTP_M40_LOADED:
            p = ngx_slprintf(p, end, "%ui\n", rows[i].agg.ready
                             + rows[i].agg.loading + rows[i].agg.pending);
            break;

        case NGX_HTTP_M40_MC_U64:
            p = ngx_slprintf(p, end, "%uL\n",
                             *(uint64_t *) ((u_char *) &rows[i].agg.mc + f->off));
            break;

        case NGX_HTTP_M40_MC_DBL:
            p = ngx_slprintf(p, end, "%.6f\n",
                             *(double *) ((u_char *) &rows[i].agg.mc + f->off));
            break;

        default:
            if (f->kind == NGX_HTTP_M40_HIT_RATIO) {
                d = s->prefix_cache_query_tokens > 0
                    ? (double) s->prefix_cache_hit_tokens
                      / (double) s->prefix_cache_query_tokens : 0.0;
            } else if (f->kind == NGX_HTTP_M40_KV_RATIO) {
                d = s->kv_tokens_total > 0
                    ? (double) s->kv_tokens_used / (double) s->kv_tokens_total
                    : 0.0;
            } else {
                d = *(double *) v;
            }
            /* ngx_slprintf's %f has no exponent: plain digits are enough here */
            p = ngx_slprintf(p, end, "%.6f\n", d);
            break;
        }
    }

    return p;
}


static u_char *
ngx_http_m40_histogram(u_char *p, u_char *end, const char *name,
    const char *help, ngx_http_m40_mrow_t *rows, ngx_uint_t n, size_t counts_off,
    size_t sum_off)
{
    int                i;
    char               le[32];
    ngx_uint_t         k;
    const double      *bounds;
    const uint64_t    *counts;
    m40_engine_stats  *s;

    p = ngx_slprintf(p, end, "# HELP %s %s\n# TYPE %s histogram\n", name, help,
                     name);

    for (k = 0; k < n; k++) {
        s = &rows[k].agg.s;
        bounds = s->hist_bounds;
        counts = (const uint64_t *) ((u_char *) s + counts_off);

        for (i = 0; i < M40_HIST_BUCKETS; i++) {
            if (i == M40_HIST_BUCKETS - 1 || isinf(bounds[i])) {
                p = ngx_slprintf(p, end, "%s_bucket{%Vle=\"+Inf\"} %uL\n",
                                 name, &rows[k].hlabel, counts[i]);
                break;
            }

            /* the bound as Prometheus clients print it (%g: 0.005, 1e-05) */
            (void) snprintf(le, sizeof(le), "%g", bounds[i]);
            p = ngx_slprintf(p, end, "%s_bucket{%Vle=\"%s\"} %uL\n", name,
                             &rows[k].hlabel, le, counts[i]);
        }

        p = ngx_slprintf(p, end, "%s_sum%V %.6f\n%s_count%V %uL\n",
                         name, &rows[k].label,
                         *(double *) ((u_char *) s + sum_off),
                         name, &rows[k].label, counts[M40_HIST_BUCKETS - 1]);
    }

    return p;
}


/* GET /metrics: each family has the server's total (no label) and a series per model
 * (label model), both summed over every worker. */
ngx_int_t
ngx_http_m40_metrics_handler(ngx_http_request_t *r)
{
    u_char                    *p, *end;
    size_t                     size;
    ngx_int_t                  rc;
    ngx_buf_t                 *b;
    ngx_uint_t                 i, n;
    ngx_chain_t                out;
    ngx_http_m40_mrow_t       *rows, *total;
    ngx_http_m40_mrows_t       mr;
    ngx_http_m40_main_conf_t  *mcf;

    mcf = ngx_http_get_module_main_conf(r, ngx_http_m40_module);

    mr.pool = r->pool;
    mr.failed = 0;
    mr.rows = ngx_array_create(r->pool, mcf->models.nelts + 2,
                               sizeof(ngx_http_m40_mrow_t));
    if (mr.rows == NULL) {
        return NGX_HTTP_INTERNAL_SERVER_ERROR;
    }

    total = ngx_array_push(mr.rows);
    if (total == NULL) {
        return NGX_HTTP_INTERNAL_SERVER_ERROR;
    }
    ngx_memzero(total, sizeof(ngx_http_m40_mrow_t));

    ngx_http_m40_shm_collect(mcf, ngx_http_m40_metrics_row, &mr);
    if (mr.failed) {
        return NGX_HTTP_INTERNAL_SERVER_ERROR;
    }

    rows = mr.rows->elts;
    n = mr.rows->nelts;

    /* about 120 bytes a line, 30 lines a model and the total, and the label */
    size = 4096;
    for (i = 0; i < n; i++) {
        size += 8192 + 60 * rows[i].label.len;
    }

    b = ngx_create_temp_buf(r->pool, size);
    if (b == NULL) {
        return NGX_HTTP_INTERNAL_SERVER_ERROR;
    }

    p = b->last;
    end = b->end;

    for (i = 0; i < sizeof(ngx_http_m40_families)
                    / sizeof(ngx_http_m40_families[0]); i++)
    {
        p = ngx_http_m40_family(p, end, &ngx_http_m40_families[i], rows, n);

        if (i == 0) {
            /* HTTP requests are counted before their model is known */
            p = ngx_slprintf(p, end,
                             "# HELP m40_http_requests_total HTTP requests to "
                             "the API locations (every worker)\n"
                             "# TYPE m40_http_requests_total counter\n"
                             "m40_http_requests_total %uL\n",
                             ngx_http_m40_shm_http_requests(mcf));
        }
    }

    p = ngx_slprintf(p, end,
                     "# HELP m40_engine_seconds_total Engine thread time by "
                     "phase: forward pass, sampling and event delivery, "
                     "scheduling\n# TYPE m40_engine_seconds_total counter\n");
    for (i = 0; i < n; i++) {
        p = ngx_slprintf(p, end,
                 "m40_engine_seconds_total{%Vphase=\"forward\"} %.6f\n"
                 "m40_engine_seconds_total{%Vphase=\"sample\"} %.6f\n"
                 "m40_engine_seconds_total{%Vphase=\"schedule\"} %.6f\n",
                 &rows[i].hlabel, rows[i].agg.s.forward_seconds,
                 &rows[i].hlabel, rows[i].agg.s.sample_seconds,
                 &rows[i].hlabel, rows[i].agg.s.schedule_seconds);
    }

    p = ngx_slprintf(p, end,
                     "# HELP m40_engine_sample_seconds_total Parts of the "
                     "sample phase on a GPU engine's helper threads: waiting for "
                     "grammar masks that outlast the forward pass, the rows' "
                     "parallel picks\n"
                     "# TYPE m40_engine_sample_seconds_total counter\n");
    for (i = 0; i < n; i++) {
        p = ngx_slprintf(p, end,
                 "m40_engine_sample_seconds_total{%Vpart=\"grammar_wait\"} %.6f\n"
                 "m40_engine_sample_seconds_total{%Vpart=\"pick\"} %.6f\n",
                 &rows[i].hlabel, rows[i].agg.s.grammar_wait_seconds,
                 &rows[i].hlabel, rows[i].agg.s.pick_seconds);
    }

    p = ngx_http_m40_histogram(p, end, "m40_time_to_first_token_seconds",
                               "Time from submission to the first token",
                               rows, n, offsetof(m40_engine_stats, ttft_counts),
                               offsetof(m40_engine_stats, ttft_sum));
    p = ngx_http_m40_histogram(p, end, "m40_inter_token_latency_seconds",
                               "Time between consecutive tokens of a sequence",
                               rows, n, offsetof(m40_engine_stats, itl_counts),
                               offsetof(m40_engine_stats, itl_sum));

    if (p == end) {
        ngx_log_error(NGX_LOG_ALERT, r->connection->log, 0,
                      "m40: /metrics outgrew its buffer of %uz bytes", size);
        return NGX_HTTP_INTERNAL_SERVER_ERROR;
    }

    b->last = p;
    b->last_buf = (r == r->main) ? 1 : 0;
    b->last_in_chain = 1;

    r->headers_out.status = NGX_HTTP_OK;
    r->headers_out.content_length_n = b->last - b->pos;
    ngx_str_set(&r->headers_out.content_type,
                "text/plain; version=0.0.4; charset=utf-8");
    r->headers_out.content_type_len = r->headers_out.content_type.len;
    r->headers_out.content_type_lowcase = NULL;

    rc = ngx_http_send_header(r);
    if (rc == NGX_ERROR || rc > NGX_OK || r->header_only) {
        return rc;
    }

    out.buf = b;
    out.next = NULL;

    return ngx_http_output_filter(r, &out);
}
