/* GET /v1/models, /health and /metrics.
 *
 * Each worker has its own engine, so /metrics describes the engine of the worker
 * that answers (with worker_processes 1, the whole server). */
#include "ngx_http_m40_module.h"

#include <fcntl.h>
#include <math.h>
#include <unistd.h>


/* GET /v1/models (id NULL) or /v1/models/{id}. */
ngx_int_t
ngx_http_m40_models_handler(ngx_http_request_t *r, ngx_str_t *id)
{
    json_t                    *root, *model;
    int32_t                    ctx_size;
    ngx_int_t                  rc;
    ngx_http_m40_main_conf_t  *mcf;

    mcf = ngx_http_get_module_main_conf(r, ngx_http_m40_module);

    if (id && (id->len != mcf->model_name.len
               || ngx_strncmp(id->data, mcf->model_name.data, id->len) != 0))
    {
        return ngx_http_m40_send_simple_error(r, NGX_HTTP_NOT_FOUND,
                   "invalid_request_error", "model_not_found",
                   "The model '%V' does not exist", id);
    }

    model = json_pack("{s:s%,s:s,s:I,s:s}",
                      "id", (const char *) mcf->model_name.data,
                      (size_t) mcf->model_name.len,
                      "object", "model",
                      "created", (json_int_t) mcf->start_time,
                      "owned_by", "m40");
    if (model == NULL) {
        ngx_log_error(NGX_LOG_ERR, r->connection->log, 0,
                      "m40: cannot build the model list");
        return NGX_HTTP_INTERNAL_SERVER_ERROR;
    }

    if (mcf->engine
        && m40_engine_get_state(mcf->engine, NULL, 0) == M40_ENGINE_READY)
    {
        ctx_size = m40_engine_ctx_size(mcf->engine);
        json_object_set_new(model, "max_model_len", json_integer(ctx_size));
    }

    root = id ? model : json_pack("{s:s,s:[o]}", "object", "list", "data", model);
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


/* What `m40 ps` shows of a ready engine: where it runs, the memory it holds and how
 * busy it is. memory_bytes on a GPU is the card's memory in use once the engine's KV
 * cache was allocated (other processes on the card included); on the CPU, the worker's
 * resident memory. */
static void
ngx_http_m40_health_usage(json_t *root, m40_engine *engine)
{
    char                  device[32];
    double                mem;
    m40_engine_stats      s;
    m40_engine_capacity   cap;

    if (m40_engine_get_capacity(engine, &cap) != 0) {
        return;
    }

    m40_engine_get_stats(engine, &s);

    if (cap.device >= 0) {
        ngx_snprintf((u_char *) device, sizeof(device) - 1, "cuda:%d%Z",
                     cap.device);
        mem = cap.gpu_in_use + cap.kv_bytes;

    } else {
        ngx_cpystrn((u_char *) device, (u_char *) "cpu", sizeof(device));
        mem = ngx_http_m40_resident_bytes();
    }

    json_object_set_new(root, "device", json_string(device));
    if (mem >= 0) {
        json_object_set_new(root, "memory_bytes",
                            json_integer((json_int_t) mem));
    }
    json_object_set_new(root, "ctx_size", json_integer(cap.ctx));
    json_object_set_new(root, "max_seqs", json_integer(cap.max_seqs));
    json_object_set_new(root, "running", json_integer(s.running));
    json_object_set_new(root, "queued", json_integer(s.queue_depth));
    json_object_set_new(root, "kv_tokens_used",
                        json_integer(s.kv_tokens_used));
    json_object_set_new(root, "kv_tokens_total",
                        json_integer(s.kv_tokens_total));
}


ngx_int_t
ngx_http_m40_health_handler(ngx_http_request_t *r)
{
    char                       err[256];
    json_t                    *root;
    ngx_int_t                  rc;
    ngx_uint_t                 status;
    m40_engine_state           state;
    ngx_http_m40_main_conf_t  *mcf;

    mcf = ngx_http_get_module_main_conf(r, ngx_http_m40_module);

    err[0] = '\0';
    if (mcf->engine == NULL) {
        state = M40_ENGINE_FAILED;
        ngx_cpystrn((u_char *) err,
                    (u_char *) "the engine could not be started (see the "
                    "error log)", sizeof(err));
    } else {
        state = m40_engine_get_state(mcf->engine, err, sizeof(err));
    }

    switch (state) {

    case M40_ENGINE_READY:
        status = NGX_HTTP_OK;
        root = json_pack("{s:s}", "status", "ready");
        break;

    case M40_ENGINE_LOADING:
        status = NGX_HTTP_SERVICE_UNAVAILABLE;
        root = json_pack("{s:s}", "status", "loading");
        break;

    default:
        /* the engine's reason names server files: it went to the error log at load,
         * the client gets only that it failed */
        status = NGX_HTTP_SERVICE_UNAVAILABLE;
        root = json_pack("{s:s,s:s}", "status", "failed", "error",
                         "the model failed to load (the server's error log "
                         "says why)");
        break;
    }

    if (root == NULL) {
        ngx_log_error(NGX_LOG_ERR, r->connection->log, 0,
                      "m40: cannot build the health response");
        return NGX_HTTP_INTERNAL_SERVER_ERROR;
    }

    json_object_set_new(root, "model",
                        json_stringn((const char *) mcf->model_name.data,
                                     mcf->model_name.len));

    if (state == M40_ENGINE_READY) {
        ngx_http_m40_health_usage(root, mcf->engine);
    }

    rc = ngx_http_m40_send_json(r, status, root);
    json_decref(root);

    return rc;
}


static u_char *
ngx_http_m40_histogram(u_char *p, u_char *end, const char *name,
    const char *help, const double *bounds, const uint64_t *counts, double sum)
{
    int  i, n;

    n = snprintf((char *) p, end - p, "# HELP %s %s\n# TYPE %s histogram\n",
                 name, help, name);
    p += (n > 0 && n < end - p) ? n : 0;

    for (i = 0; i < M40_HIST_BUCKETS; i++) {
        if (i == M40_HIST_BUCKETS - 1 || isinf(bounds[i])) {
            n = snprintf((char *) p, end - p, "%s_bucket{le=\"+Inf\"} %llu\n",
                         name, (unsigned long long) counts[i]);
            p += (n > 0 && n < end - p) ? n : 0;
            break;
        }

        n = snprintf((char *) p, end - p, "%s_bucket{le=\"%g\"} %llu\n", name,
                     bounds[i], (unsigned long long) counts[i]);
        p += (n > 0 && n < end - p) ? n : 0;
    }

    n = snprintf((char *) p, end - p, "%s_sum %.6f\n%s_count %llu\n", name,
                 sum, name, (unsigned long long) counts[M40_HIST_BUCKETS - 1]);
    p += (n > 0 && n < end - p) ? n : 0;

    return p;
}


#define ngx_http_m40_metric(p, end, type, name, help, fmt, value)             \
    (p) = ngx_slprintf(p, end, "# HELP " name " " help "\n# TYPE " name " "    \
                       type "\n" name " " fmt "\n", value)


ngx_int_t
ngx_http_m40_metrics_handler(ngx_http_request_t *r)
{
    int                        n;
    u_char                    *p, *end;
    double                     kv, hit;
    ngx_int_t                  rc, state;
    ngx_buf_t                 *b;
    ngx_chain_t                out;
    m40_engine_stats           s;
    ngx_http_m40_main_conf_t  *mcf;

    static const size_t        size = 8192;

    mcf = ngx_http_get_module_main_conf(r, ngx_http_m40_module);

    ngx_memzero(&s, sizeof(m40_engine_stats));
    state = -1;

    if (mcf->engine) {
        m40_engine_get_stats(mcf->engine, &s);
        state = m40_engine_get_state(mcf->engine, NULL, 0);
    }

    b = ngx_create_temp_buf(r->pool, size);
    if (b == NULL) {
        return NGX_HTTP_INTERNAL_SERVER_ERROR;
    }

    p = b->last;
    end = b->end;

    ngx_http_m40_metric(p, end, "gauge", "m40_engine_state",
                        "0 loading, 1 ready, 2 failed (-1: no engine)",
                        "%i", state);
    ngx_http_m40_metric(p, end, "counter", "m40_requests_total",
                        "Generation requests admitted by the engine",
                        "%uL", (uint64_t) s.requests_total);
    ngx_http_m40_metric(p, end, "counter", "m40_requests_rejected_total",
                        "Requests refused because the queue was full",
                        "%uL", (uint64_t) s.requests_rejected);
    ngx_http_m40_metric(p, end, "counter", "m40_requests_cancelled_total",
                        "Requests abandoned before they finished",
                        "%uL", (uint64_t) s.requests_cancelled);
    ngx_http_m40_metric(p, end, "counter", "m40_http_requests_total",
                        "HTTP requests to the API locations of this worker",
                        "%uA", mcf->http_requests);
    ngx_http_m40_metric(p, end, "counter", "m40_prompt_tokens_total",
                        "Prompt tokens of admitted requests",
                        "%uL", (uint64_t) s.prompt_tokens_total);
    ngx_http_m40_metric(p, end, "counter", "m40_prompt_tokens_computed_total",
                        "Prompt tokens run through the model",
                        "%uL", (uint64_t) s.prompt_tokens_computed);
    ngx_http_m40_metric(p, end, "counter", "m40_generation_tokens_total",
                        "Generated tokens",
                        "%uL", (uint64_t) s.completion_tokens_total);
    ngx_http_m40_metric(p, end, "counter", "m40_prefix_cache_queries_total",
                        "Prompt lookups in the KV prefix cache",
                        "%uL", (uint64_t) s.prefix_cache_queries);
    ngx_http_m40_metric(p, end, "counter",
                        "m40_prefix_cache_query_tokens_total",
                        "Prompt tokens looked up in the KV prefix cache",
                        "%uL", (uint64_t) s.prefix_cache_query_tokens);
    ngx_http_m40_metric(p, end, "counter", "m40_prefix_cache_hit_tokens_total",
                        "Prompt tokens found in the KV prefix cache "
                        "(not computed)",
                        "%uL", (uint64_t) s.prefix_cache_hit_tokens);

    hit = s.prefix_cache_query_tokens > 0
          ? (double) s.prefix_cache_hit_tokens
            / (double) s.prefix_cache_query_tokens
          : 0.0;

    n = snprintf((char *) p, end - p,
                 "# HELP m40_prefix_cache_hit_ratio Fraction of looked-up "
                 "prompt tokens found in the KV prefix cache\n"
                 "# TYPE m40_prefix_cache_hit_ratio gauge\n"
                 "m40_prefix_cache_hit_ratio %.6f\n",
                 hit);
    p += (n > 0 && n < end - p) ? n : 0;
    ngx_http_m40_metric(p, end, "gauge", "m40_queue_depth",
                        "Requests waiting for a sequence slot",
                        "%D", (int32_t) s.queue_depth);
    ngx_http_m40_metric(p, end, "gauge", "m40_running_sequences",
                        "Sequences being generated",
                        "%D", (int32_t) s.running);

    kv = s.kv_tokens_total > 0
         ? (double) s.kv_tokens_used / (double) s.kv_tokens_total : 0.0;

    n = snprintf((char *) p, end - p,
                 "# HELP m40_kv_usage_ratio Fraction of the KV cache in use\n"
                 "# TYPE m40_kv_usage_ratio gauge\nm40_kv_usage_ratio %.6f\n",
                 kv);
    p += (n > 0 && n < end - p) ? n : 0;

    ngx_http_m40_metric(p, end, "counter", "m40_engine_steps_total",
                        "Model steps (forward passes) the engine ran",
                        "%uL", (uint64_t) s.steps_total);
    ngx_http_m40_metric(p, end, "counter", "m40_engine_step_tokens_total",
                        "Tokens (batch rows) those steps carried",
                        "%uL", (uint64_t) s.step_tokens_total);

    n = snprintf((char *) p, end - p,
                 "# HELP m40_engine_seconds_total Engine thread time by phase: "
                 "forward pass, sampling and event delivery, scheduling\n"
                 "# TYPE m40_engine_seconds_total counter\n"
                 "m40_engine_seconds_total{phase=\"forward\"} %.6f\n"
                 "m40_engine_seconds_total{phase=\"sample\"} %.6f\n"
                 "m40_engine_seconds_total{phase=\"schedule\"} %.6f\n",
                 s.forward_seconds, s.sample_seconds, s.schedule_seconds);
    p += (n > 0 && n < end - p) ? n : 0;

    ngx_http_m40_metric(p, end, "counter", "m40_prefill_guard_limited_steps_total",
                        "Steps in which the ITL guard held prompt tokens back "
                        "to keep decoding sequences' steps short",
                        "%uL", (uint64_t) s.guard_limited_steps);
    ngx_http_m40_metric(p, end, "counter", "m40_prefill_guard_probe_steps_total",
                        "Steps run without prompt tokens to measure the "
                        "decode-only step time (part of the limited steps)",
                        "%uL", (uint64_t) s.guard_probe_steps);

    n = snprintf((char *) p, end - p,
                 "# HELP m40_decode_step_seconds The ITL guard's estimate of "
                 "a decode-only step of the running sequences\n"
                 "# TYPE m40_decode_step_seconds gauge\n"
                 "m40_decode_step_seconds %.6f\n",
                 s.decode_step_estimate);
    p += (n > 0 && n < end - p) ? n : 0;

    if (mcf->engine) {      /* the bucket bounds come from the engine */
        p = ngx_http_m40_histogram(p, end, "m40_time_to_first_token_seconds",
                                   "Time from submission to the first token",
                                   s.hist_bounds, s.ttft_counts, s.ttft_sum);
        p = ngx_http_m40_histogram(p, end, "m40_inter_token_latency_seconds",
                                   "Time between consecutive tokens of a "
                                   "sequence",
                                   s.hist_bounds, s.itl_counts, s.itl_sum);
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
