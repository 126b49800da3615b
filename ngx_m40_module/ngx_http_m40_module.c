/* ngx_http_m40_module: directives, configuration, the per-worker engine and the
 * routing of API requests.
 *
 * Every worker process owns one engine (one model instance on one device). The
 * engine's eventfd is registered in the worker's event loop as a pseudo connection;
 * when it becomes readable, the worker asks the engine which requests have news and
 * lets each of them pull its events (ngx_http_m40_generate.c). Engine requests are
 * known to the engine by a numeric id, looked up in a red-black tree, so that a
 * notification for a request that has just gone away is ignored instead of touching
 * freed memory. */
#include "ngx_http_m40_module.h"

#if (NGX_LINUX)
#include <malloc.h>
#endif

static void *ngx_http_m40_create_main_conf(ngx_conf_t *cf);
static char *ngx_http_m40_init_main_conf(ngx_conf_t *cf, void *conf);
static void *ngx_http_m40_create_srv_conf(ngx_conf_t *cf);
static void *ngx_http_m40_create_loc_conf(ngx_conf_t *cf);
static char *ngx_http_m40_merge_loc_conf(ngx_conf_t *cf, void *parent,
    void *child);
static char *ngx_http_m40_model(ngx_conf_t *cf, ngx_command_t *cmd,
    void *conf);
static char *ngx_http_m40_device(ngx_conf_t *cf, ngx_command_t *cmd,
    void *conf);
static char *ngx_http_m40_chat_template(ngx_conf_t *cf, ngx_command_t *cmd,
    void *conf);
static char *ngx_http_m40_gpu_memory_fraction(ngx_conf_t *cf,
    ngx_command_t *cmd, void *conf);
static char *ngx_http_m40_itl_guard(ngx_conf_t *cf, ngx_command_t *cmd,
    void *conf);
static char *ngx_http_m40_api(ngx_conf_t *cf, ngx_command_t *cmd, void *conf);
static ngx_int_t ngx_http_m40_init_process(ngx_cycle_t *cycle);
static void ngx_http_m40_exit_process(ngx_cycle_t *cycle);
static void ngx_http_m40_engine_event(ngx_event_t *rev);
static ngx_int_t ngx_http_m40_handler(ngx_http_request_t *r);


static ngx_conf_num_bounds_t  ngx_http_m40_positive = {
    ngx_conf_check_num_bounds, 1, 0x7fffffff
};

static ngx_conf_num_bounds_t  ngx_http_m40_non_negative = {
    ngx_conf_check_num_bounds, 0, 0x7fffffff
};

static ngx_conf_num_bounds_t  ngx_http_m40_threads_bounds = {
    ngx_conf_check_num_bounds, 0, 1024
};

static ngx_conf_num_bounds_t  ngx_http_m40_prefill_bounds = {
    ngx_conf_check_num_bounds, 1, M40_MAX_PREFILL_TOKENS
};


/* m40_tool_parser: how tool calls are read from the output (m40_chat_parse.h);
 * "auto" chooses from the chat template's text. */
static ngx_conf_enum_t  ngx_http_m40_tool_parsers[] = {
    { ngx_string("auto"), NGX_HTTP_M40_TOOL_PARSER_AUTO },
    { ngx_string("hermes"), M40_TOOLS_HERMES },
    { ngx_string("llama3"), M40_TOOLS_LLAMA3 },
    { ngx_string("mistral"), M40_TOOLS_MISTRAL },
    { ngx_string("json"), M40_TOOLS_JSON },
    { ngx_string("harmony"), M40_TOOLS_HARMONY },
    { ngx_string("off"), M40_TOOLS_NONE },
    { ngx_null_string, 0 }
};

static ngx_conf_enum_t  ngx_http_m40_reasoning_modes[] = {
    { ngx_string("separate"), M40_REASONING_SEPARATE },
    { ngx_string("inline"), M40_REASONING_INLINE },
    { ngx_string("none"), M40_REASONING_NONE },
    { ngx_null_string, 0 }
};


static ngx_command_t  ngx_http_m40_commands[] = {

    { ngx_string("m40_model"),
      NGX_HTTP_MAIN_CONF|NGX_CONF_TAKE12,
      ngx_http_m40_model,
      NGX_HTTP_MAIN_CONF_OFFSET,
      0,
      NULL },

    { ngx_string("m40_device"),
      NGX_HTTP_MAIN_CONF|NGX_CONF_TAKE1,
      ngx_http_m40_device,
      NGX_HTTP_MAIN_CONF_OFFSET,
      0,
      NULL },

    { ngx_string("m40_ctx_size"),
      NGX_HTTP_MAIN_CONF|NGX_CONF_TAKE1,
      ngx_conf_set_num_slot,
      NGX_HTTP_MAIN_CONF_OFFSET,
      offsetof(ngx_http_m40_main_conf_t, ctx_size),
      &ngx_http_m40_non_negative },

    { ngx_string("m40_max_seqs"),
      NGX_HTTP_MAIN_CONF|NGX_CONF_TAKE1,
      ngx_conf_set_num_slot,
      NGX_HTTP_MAIN_CONF_OFFSET,
      offsetof(ngx_http_m40_main_conf_t, max_seqs),
      &ngx_http_m40_positive },

    { ngx_string("m40_max_queue"),
      NGX_HTTP_MAIN_CONF|NGX_CONF_TAKE1,
      ngx_conf_set_num_slot,
      NGX_HTTP_MAIN_CONF_OFFSET,
      offsetof(ngx_http_m40_main_conf_t, max_queue),
      &ngx_http_m40_positive },

    { ngx_string("m40_gpu_memory_fraction"),
      NGX_HTTP_MAIN_CONF|NGX_CONF_TAKE1,
      ngx_http_m40_gpu_memory_fraction,
      NGX_HTTP_MAIN_CONF_OFFSET,
      0,
      NULL },

    { ngx_string("m40_prefill_chunk"),
      NGX_HTTP_MAIN_CONF|NGX_CONF_TAKE1,
      ngx_conf_set_num_slot,
      NGX_HTTP_MAIN_CONF_OFFSET,
      offsetof(ngx_http_m40_main_conf_t, prefill_chunk),
      &ngx_http_m40_prefill_bounds },

    { ngx_string("m40_prefill_budget"),
      NGX_HTTP_MAIN_CONF|NGX_CONF_TAKE1,
      ngx_conf_set_num_slot,
      NGX_HTTP_MAIN_CONF_OFFSET,
      offsetof(ngx_http_m40_main_conf_t, prefill_budget),
      &ngx_http_m40_prefill_bounds },

    { ngx_string("m40_itl_guard"),
      NGX_HTTP_MAIN_CONF|NGX_CONF_TAKE1,
      ngx_http_m40_itl_guard,
      NGX_HTTP_MAIN_CONF_OFFSET,
      0,
      NULL },

    { ngx_string("m40_max_tokens_default"),
      NGX_HTTP_MAIN_CONF|NGX_CONF_TAKE1,
      ngx_conf_set_num_slot,
      NGX_HTTP_MAIN_CONF_OFFSET,
      offsetof(ngx_http_m40_main_conf_t, max_tokens_default),
      &ngx_http_m40_positive },

    { ngx_string("m40_max_tokens_limit"),
      NGX_HTTP_MAIN_CONF|NGX_CONF_TAKE1,
      ngx_conf_set_num_slot,
      NGX_HTTP_MAIN_CONF_OFFSET,
      offsetof(ngx_http_m40_main_conf_t, max_tokens_limit),
      &ngx_http_m40_positive },

    { ngx_string("m40_chat_template"),
      NGX_HTTP_MAIN_CONF|NGX_CONF_TAKE1,
      ngx_http_m40_chat_template,
      NGX_HTTP_MAIN_CONF_OFFSET,
      0,
      NULL },

    { ngx_string("m40_tool_parser"),
      NGX_HTTP_MAIN_CONF|NGX_CONF_TAKE1,
      ngx_conf_set_enum_slot,
      NGX_HTTP_MAIN_CONF_OFFSET,
      offsetof(ngx_http_m40_main_conf_t, tool_parser),
      &ngx_http_m40_tool_parsers },

    { ngx_string("m40_reasoning"),
      NGX_HTTP_MAIN_CONF|NGX_CONF_TAKE1,
      ngx_conf_set_enum_slot,
      NGX_HTTP_MAIN_CONF_OFFSET,
      offsetof(ngx_http_m40_main_conf_t, reasoning),
      &ngx_http_m40_reasoning_modes },

    { ngx_string("m40_threads"),
      NGX_HTTP_MAIN_CONF|NGX_CONF_TAKE1,
      ngx_conf_set_num_slot,
      NGX_HTTP_MAIN_CONF_OFFSET,
      offsetof(ngx_http_m40_main_conf_t, threads),
      &ngx_http_m40_threads_bounds },

    { ngx_string("m40_cpu_exact"),
      NGX_HTTP_MAIN_CONF|NGX_CONF_FLAG,
      ngx_conf_set_flag_slot,
      NGX_HTTP_MAIN_CONF_OFFSET,
      offsetof(ngx_http_m40_main_conf_t, cpu_exact),
      NULL },

    { ngx_string("m40_load_wait"),
      NGX_HTTP_MAIN_CONF|NGX_CONF_TAKE1,
      ngx_conf_set_msec_slot,
      NGX_HTTP_MAIN_CONF_OFFSET,
      offsetof(ngx_http_m40_main_conf_t, load_wait),
      NULL },

    { ngx_string("m40_api"),
      NGX_HTTP_LOC_CONF|NGX_CONF_NOARGS,
      ngx_http_m40_api,
      NGX_HTTP_LOC_CONF_OFFSET,
      0,
      NULL },

    { ngx_string("m40_ui"),
      NGX_HTTP_LOC_CONF|NGX_CONF_TAKE1,
      ngx_http_m40_ui,
      NGX_HTTP_LOC_CONF_OFFSET,
      0,
      NULL },

      ngx_null_command
};


static ngx_http_module_t  ngx_http_m40_module_ctx = {
    NULL,                                  /* preconfiguration */
    ngx_http_m40_errors_init,              /* postconfiguration */

    ngx_http_m40_create_main_conf,         /* create main configuration */
    ngx_http_m40_init_main_conf,           /* init main configuration */

    ngx_http_m40_create_srv_conf,          /* create server configuration */
    NULL,                                  /* merge server configuration */

    ngx_http_m40_create_loc_conf,          /* create location configuration */
    ngx_http_m40_merge_loc_conf            /* merge location configuration */
};


ngx_module_t  ngx_http_m40_module = {
    NGX_MODULE_V1,
    &ngx_http_m40_module_ctx,              /* module context */
    ngx_http_m40_commands,                 /* module directives */
    NGX_HTTP_MODULE,                       /* module type */
    NULL,                                  /* init master */
    NULL,                                  /* init module */
    ngx_http_m40_init_process,             /* init process */
    NULL,                                  /* init thread */
    NULL,                                  /* exit thread */
    ngx_http_m40_exit_process,             /* exit process */
    NULL,                                  /* exit master */
    NGX_MODULE_V1_PADDING
};


/* ---- configuration ---- */

static void *
ngx_http_m40_create_main_conf(ngx_conf_t *cf)
{
    ngx_http_m40_main_conf_t  *mcf;

    mcf = ngx_pcalloc(cf->pool, sizeof(ngx_http_m40_main_conf_t));
    if (mcf == NULL) {
        return NULL;
    }

    mcf->device = NGX_CONF_UNSET;
    mcf->ctx_size = NGX_CONF_UNSET;
    mcf->load_wait = NGX_CONF_UNSET_MSEC;
    mcf->max_seqs = NGX_CONF_UNSET;
    mcf->max_queue = NGX_CONF_UNSET;
    mcf->max_tokens_default = NGX_CONF_UNSET;
    mcf->max_tokens_limit = NGX_CONF_UNSET;
    mcf->threads = NGX_CONF_UNSET;
    mcf->cpu_exact = NGX_CONF_UNSET;
    mcf->gpu_memory_fraction = -1.0;
    mcf->prefill_chunk = NGX_CONF_UNSET;
    mcf->prefill_budget = NGX_CONF_UNSET;
    mcf->itl_guard = -2.0;
    mcf->tool_parser = NGX_CONF_UNSET_UINT;
    mcf->reasoning = NGX_CONF_UNSET_UINT;

    return mcf;
}


static char *
ngx_http_m40_init_main_conf(ngx_conf_t *cf, void *conf)
{
    ngx_http_m40_main_conf_t *mcf = conf;

    ngx_conf_init_value(mcf->device, -1);
    ngx_conf_init_value(mcf->ctx_size, 0);
    /* 0: the engine picks (m40_engine.h: 4 on the CPU, what the KV pool holds
     * on a GPU) and logs what it picked */
    ngx_conf_init_msec_value(mcf->load_wait, 60000);
    ngx_conf_init_value(mcf->max_seqs, 0);
    ngx_conf_init_value(mcf->max_queue, M40_DEFAULT_MAX_QUEUE);
    if (mcf->gpu_memory_fraction < 0.0) {
        mcf->gpu_memory_fraction = 0.0;     /* the engine's default, 0.90 */
    }
    /* 0: the engine's defaults (m40_engine.h), which it logs with the capacity */
    ngx_conf_init_value(mcf->prefill_chunk, 0);
    ngx_conf_init_value(mcf->prefill_budget, 0);
    if (mcf->itl_guard < -1.5) {
        mcf->itl_guard = 0.0;
    }
    ngx_conf_init_uint_value(mcf->tool_parser, NGX_HTTP_M40_TOOL_PARSER_AUTO);
    ngx_conf_init_uint_value(mcf->reasoning, M40_REASONING_SEPARATE);

    if (mcf->prefill_chunk > 0 && mcf->prefill_budget > 0
        && mcf->prefill_chunk > mcf->prefill_budget)
    {
        ngx_conf_log_error(NGX_LOG_WARN, cf, 0,
                           "m40_prefill_chunk %i is larger than "
                           "m40_prefill_budget %i: a sequence gets at most "
                           "the budget in a step",
                           mcf->prefill_chunk, mcf->prefill_budget);
    }

    ngx_conf_init_value(mcf->max_tokens_default, 256);
    ngx_conf_init_value(mcf->max_tokens_limit, 4096);
    ngx_conf_init_value(mcf->threads, 0);
    ngx_conf_init_value(mcf->cpu_exact, 0);

    if (mcf->max_tokens_default > mcf->max_tokens_limit) {
        ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                           "m40_max_tokens_default %i is larger than "
                           "m40_max_tokens_limit %i",
                           mcf->max_tokens_default, mcf->max_tokens_limit);
        return NGX_CONF_ERROR;
    }

    if (mcf->api_used && mcf->model_path.len == 0) {
        ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                           "\"m40_api\" is used but no \"m40_model\" is set "
                           "in the http block");
        return NGX_CONF_ERROR;
    }

    return NGX_CONF_OK;
}


static void *
ngx_http_m40_create_srv_conf(ngx_conf_t *cf)
{
    /* json_errors 0 until m40_api appears in one of the server's locations */
    return ngx_pcalloc(cf->pool, sizeof(ngx_http_m40_srv_conf_t));
}


static void *
ngx_http_m40_create_loc_conf(ngx_conf_t *cf)
{
    ngx_http_m40_loc_conf_t  *lcf;

    lcf = ngx_pcalloc(cf->pool, sizeof(ngx_http_m40_loc_conf_t));
    if (lcf == NULL) {
        return NULL;
    }

    lcf->api = NGX_CONF_UNSET;
    lcf->ui = NGX_CONF_UNSET;

    return lcf;
}


static char *
ngx_http_m40_merge_loc_conf(ngx_conf_t *cf, void *parent, void *child)
{
    ngx_http_m40_loc_conf_t *prev = parent;
    ngx_http_m40_loc_conf_t *conf = child;

    /* Not inherited: like proxy_pass, m40_api installs the content handler of
     * the location it appears in only. */
    ngx_conf_init_value(conf->api, 0);
    ngx_conf_init_value(conf->ui, 0);
    (void) prev;

    return NGX_CONF_OK;
}


/* m40_model PATH [name=NAME] */
static char *
ngx_http_m40_model(ngx_conf_t *cf, ngx_command_t *cmd, void *conf)
{
    ngx_http_m40_main_conf_t *mcf = conf;

    u_char           *p, *base, *end;
    ngx_str_t        *value;
    ngx_file_info_t   fi;

    if (mcf->model_path.data) {
        return "is duplicate";
    }

    value = cf->args->elts;

    mcf->model_path = value[1];
    if (ngx_conf_full_name(cf->cycle, &mcf->model_path, 1) != NGX_OK) {
        return NGX_CONF_ERROR;
    }

    if (ngx_file_info(mcf->model_path.data, &fi) == NGX_FILE_ERROR) {
        ngx_conf_log_error(NGX_LOG_EMERG, cf, ngx_errno,
                           ngx_file_info_n " \"%V\" failed", &mcf->model_path);
        return NGX_CONF_ERROR;
    }

    if (!ngx_is_file(&fi)) {
        ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                           "m40_model \"%V\" is not a regular file",
                           &mcf->model_path);
        return NGX_CONF_ERROR;
    }

    if (cf->args->nelts == 3) {
        if (value[2].len <= 5
            || ngx_strncmp(value[2].data, "name=", 5) != 0)
        {
            ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                               "invalid parameter \"%V\"", &value[2]);
            return NGX_CONF_ERROR;
        }

        mcf->model_name.len = value[2].len - 5;
        mcf->model_name.data = value[2].data + 5;   /* NUL-terminated */
        return NGX_CONF_OK;
    }

    /* Default public name: the file name without its directory and ".gguf". */
    end = mcf->model_path.data + mcf->model_path.len;
    base = mcf->model_path.data;
    for (p = base; p < end; p++) {
        if (*p == '/') {
            base = p + 1;
        }
    }

    if (end - base > 5 && ngx_strncasecmp(end - 5, (u_char *) ".gguf", 5) == 0) {
        end -= 5;
    }

    mcf->model_name.len = end - base;
    mcf->model_name.data = ngx_pnalloc(cf->pool, mcf->model_name.len + 1);
    if (mcf->model_name.data == NULL) {
        return NGX_CONF_ERROR;
    }
    ngx_cpystrn(mcf->model_name.data, base, mcf->model_name.len + 1);

    return NGX_CONF_OK;
}


/* m40_device cpu|N */
static char *
ngx_http_m40_device(ngx_conf_t *cf, ngx_command_t *cmd, void *conf)
{
    ngx_http_m40_main_conf_t *mcf = conf;

    ngx_int_t   n;
    ngx_str_t  *value;

    if (mcf->device != NGX_CONF_UNSET) {
        return "is duplicate";
    }

    value = cf->args->elts;

    if (value[1].len == 3 && ngx_strncasecmp(value[1].data, (u_char *) "cpu", 3) == 0) {
        mcf->device = -1;
        return NGX_CONF_OK;
    }

    n = ngx_atoi(value[1].data, value[1].len);
    if (n == NGX_ERROR || n > 1024) {
        ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                           "invalid m40_device \"%V\": \"cpu\" or a GPU index "
                           "expected", &value[1]);
        return NGX_CONF_ERROR;
    }

    mcf->device = n;

    return NGX_CONF_OK;
}


/* The whole of a directive's argument as a number: NGX_OK and *f, or NGX_ERROR for an
 * empty value, trailing text or a value out of double's range. Configuration arguments
 * are NUL-terminated. */
static ngx_int_t
ngx_http_m40_parse_double(ngx_str_t *v, double *f)
{
    char  *end;

    errno = 0;
    *f = strtod((const char *) v->data, &end);

    return (v->len == 0 || *end != '\0' || errno != 0) ? NGX_ERROR : NGX_OK;
}


/* m40_gpu_memory_fraction F: the share of each GPU's memory its engine may fill
 * (weights, activations and the KV cache that takes the rest), 0 < F <= 1. */
static char *
ngx_http_m40_gpu_memory_fraction(ngx_conf_t *cf, ngx_command_t *cmd,
    void *conf)
{
    ngx_http_m40_main_conf_t *mcf = conf;

    double      f;
    ngx_str_t  *value;

    if (mcf->gpu_memory_fraction >= 0.0) {
        return "is duplicate";
    }

    value = cf->args->elts;

    if (ngx_http_m40_parse_double(&value[1], &f) != NGX_OK
        || !(f > 0.0 && f <= 1.0))
    {
        ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                           "invalid m40_gpu_memory_fraction \"%V\": a number "
                           "greater than 0 and at most 1 expected "
                           "(e.g. 0.90)", &value[1]);
        return NGX_CONF_ERROR;
    }

    mcf->gpu_memory_fraction = f;

    return NGX_CONF_OK;
}


/* m40_itl_guard F | off: while sequences are decoding, a step that also carries
 * prompt tokens may take up to F times the time of the same step without them
 * (1 <= F <= 100); "off" leaves the prompt tokens of a step to m40_prefill_budget
 * alone. */
static char *
ngx_http_m40_itl_guard(ngx_conf_t *cf, ngx_command_t *cmd, void *conf)
{
    ngx_http_m40_main_conf_t *mcf = conf;

    double      f;
    ngx_str_t  *value;

    if (mcf->itl_guard > -1.5) {
        return "is duplicate";
    }

    value = cf->args->elts;

    if (value[1].len == 3 && ngx_strncasecmp(value[1].data, (u_char *) "off", 3) == 0) {
        mcf->itl_guard = -1.0;
        return NGX_CONF_OK;
    }

    if (ngx_http_m40_parse_double(&value[1], &f) != NGX_OK
        || !(f >= 1.0 && f <= 100.0))
    {
        ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                           "invalid m40_itl_guard \"%V\": a number from 1 "
                           "to 100 (e.g. 2) or \"off\" expected", &value[1]);
        return NGX_CONF_ERROR;
    }

    mcf->itl_guard = f;

    return NGX_CONF_OK;
}


/* m40_chat_template PATH: the file is read here, at configuration time, so that
 * workers never do file I/O for it. */
static char *
ngx_http_m40_chat_template(ngx_conf_t *cf, ngx_command_t *cmd, void *conf)
{
    ngx_http_m40_main_conf_t *mcf = conf;

    off_t        size;
    ssize_t      n;
    ngx_str_t   *value;
    ngx_file_t   file;

    if (mcf->chat_template.data) {
        return "is duplicate";
    }

    value = cf->args->elts;

    mcf->chat_template_path = value[1];
    if (ngx_conf_full_name(cf->cycle, &mcf->chat_template_path, 1) != NGX_OK) {
        return NGX_CONF_ERROR;
    }

    ngx_memzero(&file, sizeof(ngx_file_t));
    file.name = mcf->chat_template_path;
    file.log = cf->log;

    file.fd = ngx_open_file(file.name.data, NGX_FILE_RDONLY, NGX_FILE_OPEN, 0);
    if (file.fd == NGX_INVALID_FILE) {
        ngx_conf_log_error(NGX_LOG_EMERG, cf, ngx_errno,
                           ngx_open_file_n " \"%V\" failed", &file.name);
        return NGX_CONF_ERROR;
    }

    if (ngx_fd_info(file.fd, &file.info) == NGX_FILE_ERROR) {
        ngx_conf_log_error(NGX_LOG_EMERG, cf, ngx_errno,
                           ngx_fd_info_n " \"%V\" failed", &file.name);
        goto failed;
    }

    size = ngx_file_size(&file.info);
    if (size <= 0 || size > 1024 * 1024) {
        ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                           "chat template \"%V\" is empty or larger than 1M",
                           &file.name);
        goto failed;
    }

    mcf->chat_template.data = ngx_pnalloc(cf->pool, (size_t) size + 1);
    if (mcf->chat_template.data == NULL) {
        goto failed;
    }

    n = ngx_read_file(&file, mcf->chat_template.data, (size_t) size, 0);
    if (n != size) {
        ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                           ngx_read_file_n " \"%V\" returned only %z bytes",
                           &file.name, n);
        goto failed;
    }

    mcf->chat_template.len = (size_t) size;
    mcf->chat_template.data[size] = '\0';

    if (ngx_close_file(file.fd) == NGX_FILE_ERROR) {
        ngx_log_error(NGX_LOG_ALERT, cf->log, ngx_errno,
                      ngx_close_file_n " \"%V\" failed", &file.name);
    }

    return NGX_CONF_OK;

failed:

    if (ngx_close_file(file.fd) == NGX_FILE_ERROR) {
        ngx_log_error(NGX_LOG_ALERT, cf->log, ngx_errno,
                      ngx_close_file_n " \"%V\" failed", &file.name);
    }

    return NGX_CONF_ERROR;
}


/* m40_api: this location serves the OpenAI-compatible API. */
static char *
ngx_http_m40_api(ngx_conf_t *cf, ngx_command_t *cmd, void *conf)
{
    ngx_http_m40_loc_conf_t *lcf = conf;

    ngx_http_core_loc_conf_t  *clcf;
    ngx_http_m40_main_conf_t  *mcf;
    ngx_http_m40_srv_conf_t   *scf;

    if (lcf->api != NGX_CONF_UNSET) {
        return "is duplicate";
    }

    lcf->api = 1;

    scf = ngx_http_conf_get_module_srv_conf(cf, ngx_http_m40_module);
    scf->json_errors = 1;

    clcf = ngx_http_conf_get_module_loc_conf(cf, ngx_http_core_module);
    clcf->handler = ngx_http_m40_handler;

    mcf = ngx_http_conf_get_module_main_conf(cf, ngx_http_m40_module);
    mcf->api_used = 1;

    return NGX_CONF_OK;
}


/* ---- per-worker engine ---- */

static ngx_int_t
ngx_http_m40_init_process(ngx_cycle_t *cycle)
{
    char                       err[512];
    ngx_connection_t          *c;
    m40_engine_config          ec;
    ngx_http_m40_main_conf_t  *mcf;

    if (ngx_process != NGX_PROCESS_WORKER && ngx_process != NGX_PROCESS_SINGLE) {
        return NGX_OK;      /* cache manager and loader have no use for a model */
    }

#if (NGX_LINUX) && defined(M_MMAP_THRESHOLD)
    /* glibc raises its mmap threshold to the size of each large block freed (up to
     * 32 MB): after one big request (a 16 MB body, its JSON, the prompt's copies) later
     * blocks of that size come from the heap and stay resident once freed. The worker
     * kept 33 MB more after four refused 16 MB prompts (tests/stress, phase memory).
     * A fixed threshold turns the raising off: a block of 1 MB or more is mapped, and
     * unmapped when freed, whatever came before. */
    mallopt(M_MMAP_THRESHOLD, 1024 * 1024);
#endif

    if (cycle->conf_ctx[ngx_http_module.index] == NULL) {
        return NGX_OK;
    }

    mcf = ngx_http_cycle_get_module_main_conf(cycle, ngx_http_m40_module);
    if (mcf == NULL || mcf->model_path.len == 0) {
        return NGX_OK;
    }

    ngx_rbtree_init(&mcf->choices, &mcf->choices_sentinel,
                    ngx_rbtree_insert_value);
    mcf->next_id = 1;
    mcf->start_time = ngx_time();

    ngx_memzero(&ec, sizeof(m40_engine_config));
    ec.model_path = (const char *) mcf->model_path.data;
    ec.model_name = (const char *) mcf->model_name.data;
    ec.device = mcf->device < 0 ? -1 : (int) (mcf->device + ngx_worker);
    ec.ctx_size = (int32_t) mcf->ctx_size;
    ec.max_seqs = (int32_t) mcf->max_seqs;
    ec.max_queue = (int32_t) mcf->max_queue;
    ec.n_threads = (int32_t) mcf->threads;
    ec.cpu_fast = !mcf->cpu_exact;
    ec.gpu_memory_fraction = (float) mcf->gpu_memory_fraction;
    ec.prefill_chunk = (int32_t) mcf->prefill_chunk;
    ec.prefill_budget = (int32_t) mcf->prefill_budget;
    ec.itl_guard = (float) mcf->itl_guard;
    ec.chat_template = mcf->chat_template.len
                       ? (const char *) mcf->chat_template.data : NULL;

    err[0] = '\0';
    if (m40_engine_create(&ec, &mcf->engine, err, sizeof(err)) != 0) {
        /* The worker keeps serving: /health reports "failed", generation 503. */
        ngx_log_error(NGX_LOG_EMERG, cycle->log, 0,
                      "m40: cannot start the engine for \"%V\": %s",
                      &mcf->model_path, err);
        mcf->engine = NULL;
        return NGX_OK;
    }

    c = ngx_http_m40_eventfd_add(m40_engine_event_fd(mcf->engine),
                                 ngx_http_m40_engine_event, mcf, "engine's",
                                 cycle->log);
    if (c == NULL) {
        goto failed;
    }

    mcf->event_conn = c;

    /* large request bodies are parsed off the event loop (ngx_http_m40_json.c);
     * without its thread they are parsed inline */
    (void) ngx_http_m40_json_init(cycle);

    if (ec.device < 0) {
        ngx_log_error(NGX_LOG_NOTICE, cycle->log, 0,
                      "m40: worker %ui loading \"%V\" as \"%V\" on the cpu",
                      ngx_worker, &mcf->model_path, &mcf->model_name);
    } else {
        ngx_log_error(NGX_LOG_NOTICE, cycle->log, 0,
                      "m40: worker %ui loading \"%V\" as \"%V\" on gpu %d",
                      ngx_worker, &mcf->model_path, &mcf->model_name,
                      ec.device);
    }

    return NGX_OK;

failed:

    m40_engine_destroy(mcf->engine);
    mcf->engine = NULL;
    return NGX_OK;
}


static void
ngx_http_m40_exit_process(ngx_cycle_t *cycle)
{
    ngx_connection_t          *c;
    ngx_http_m40_main_conf_t  *mcf;

    if (cycle->conf_ctx[ngx_http_module.index] == NULL) {
        return;
    }

    mcf = ngx_http_cycle_get_module_main_conf(cycle, ngx_http_m40_module);
    if (mcf == NULL || mcf->engine == NULL) {
        return;
    }

    ngx_http_m40_json_exit(cycle);

    c = mcf->event_conn;
    if (c) {
        /* The engine owns and closes the fd. */
        ngx_http_m40_eventfd_del(c);
        mcf->event_conn = NULL;
    }

    m40_engine_destroy(mcf->engine);
    mcf->engine = NULL;
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
ngx_http_m40_log_load(ngx_http_m40_main_conf_t *mcf, ngx_log_t *log)
{
    char                   line[768];
    m40_engine_state       state;
    m40_engine_capacity    cap;

    state = m40_engine_get_state(mcf->engine, line, sizeof(line));

    if (state == M40_ENGINE_FAILED) {
        ngx_log_error(NGX_LOG_ERR, log, 0, "m40: \"%V\" failed to load: %s",
                      &mcf->model_path, line);
        mcf->load_logged = 1;
        return;
    }

    if (state != M40_ENGINE_READY
        || m40_engine_get_capacity(mcf->engine, &cap) != 0)
    {
        return;
    }

    mcf->load_logged = 1;

    m40_engine_capacity_line(&cap, line, sizeof(line));
    ngx_log_error(NGX_LOG_NOTICE, log, 0, "m40: \"%V\" ready; %s",
                  &mcf->model_name, line);

    if (cap.full_ctx_seqs < 1) {
        ngx_log_error(NGX_LOG_WARN, log, 0,
                      "m40: the KV cache holds %L tokens, less than one "
                      "sequence of the full context (%d tokens): longer "
                      "sequences end early; lower m40_ctx_size or raise "
                      "m40_gpu_memory_fraction",
                      (int64_t) cap.kv_tokens, (int) cap.ctx);
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
    ngx_http_m40_main_conf_t  *mcf;

    c = rev->data;
    mcf = c->data;

    if (!mcf->load_logged) {
        ngx_http_m40_log_load(mcf, rev->log);
    }

    ngx_http_m40_eventfd_drain(rev);

    do {
        n = m40_engine_ready(mcf->engine, users, NGX_HTTP_M40_READY_BATCH);

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

    ngx_http_m40_eventfd_rearm(rev);
}


/* ---- routing ---- */

typedef enum {
    NGX_HTTP_M40_EP_CHAT = 0,
    NGX_HTTP_M40_EP_COMPLETIONS,
    NGX_HTTP_M40_EP_RESPONSES,
    NGX_HTTP_M40_EP_MESSAGES,
    NGX_HTTP_M40_EP_COUNT_TOKENS,
    NGX_HTTP_M40_EP_MODELS,
    NGX_HTTP_M40_EP_HEALTH,
    NGX_HTTP_M40_EP_METRICS
} ngx_http_m40_endpoint_e;

typedef struct {
    ngx_str_t                 suffix;
    ngx_uint_t                methods;
    ngx_http_m40_endpoint_e   endpoint;
} ngx_http_m40_route_t;

static ngx_http_m40_route_t  ngx_http_m40_routes[] = {
    { ngx_string("/v1/chat/completions"), NGX_HTTP_POST,
      NGX_HTTP_M40_EP_CHAT },
    { ngx_string("/v1/completions"), NGX_HTTP_POST,
      NGX_HTTP_M40_EP_COMPLETIONS },
    { ngx_string("/v1/responses"), NGX_HTTP_POST,
      NGX_HTTP_M40_EP_RESPONSES },
    { ngx_string("/v1/messages"), NGX_HTTP_POST,
      NGX_HTTP_M40_EP_MESSAGES },
    { ngx_string("/v1/messages/count_tokens"), NGX_HTTP_POST,
      NGX_HTTP_M40_EP_COUNT_TOKENS },
    { ngx_string("/v1/models"), NGX_HTTP_GET|NGX_HTTP_HEAD,
      NGX_HTTP_M40_EP_MODELS },
    { ngx_string("/health"), NGX_HTTP_GET|NGX_HTTP_HEAD,
      NGX_HTTP_M40_EP_HEALTH },
    { ngx_string("/metrics"), NGX_HTTP_GET|NGX_HTTP_HEAD,
      NGX_HTTP_M40_EP_METRICS },
};


static ngx_int_t
ngx_http_m40_not_allowed(ngx_http_request_t *r, const char *methods)
{
    ngx_table_elt_t  *allow;

    allow = ngx_list_push(&r->headers_out.headers);
    if (allow == NULL) {
        return NGX_HTTP_INTERNAL_SERVER_ERROR;
    }

    allow->hash = 1;
    ngx_str_set(&allow->key, "Allow");
    allow->value.data = (u_char *) methods;
    allow->value.len = ngx_strlen(methods);

    return ngx_http_m40_send_simple_error(r, NGX_HTTP_NOT_ALLOWED,
               "invalid_request_error", "method_not_allowed",
               "method %V is not allowed here (allowed: %s)", &r->method_name,
               methods);
}


static ngx_int_t
ngx_http_m40_handler(ngx_http_request_t *r)
{
    u_char                    *p, *last;
    ngx_int_t                  rc;
    ngx_str_t                  model_id;
    ngx_uint_t                 i;
    ngx_http_m40_route_t      *route;
    ngx_http_m40_loc_conf_t   *lcf;
    ngx_http_m40_main_conf_t  *mcf;

    /* m40_ui in this location too: the page at the location's URI */
    lcf = ngx_http_get_module_loc_conf(r, ngx_http_m40_module);
    if (lcf->ui) {
        rc = ngx_http_m40_ui_serve(r);
        if (rc != NGX_DECLINED) {
            return rc;
        }
    }

    mcf = ngx_http_get_module_main_conf(r, ngx_http_m40_module);
    mcf->http_requests++;

    /* GET /v1/models/{id} */
    model_id.len = 0;
    for (p = r->uri.data, last = r->uri.data + r->uri.len;
         (size_t) (last - p) > sizeof("/v1/models/") - 1;
         p++)
    {
        if (ngx_strncmp(p, "/v1/models/", sizeof("/v1/models/") - 1) == 0) {
            model_id.data = p + sizeof("/v1/models/") - 1;
            model_id.len = last - model_id.data;
        }
    }

    if (model_id.len) {
        rc = ngx_http_discard_request_body(r);
        if (rc != NGX_OK) {
            return rc;
        }

        if (!(r->method & (NGX_HTTP_GET|NGX_HTTP_HEAD))) {
            return ngx_http_m40_not_allowed(r, "GET, HEAD");
        }

        return ngx_http_m40_models_handler(r, &model_id);
    }

    route = NULL;
    for (i = 0; i < sizeof(ngx_http_m40_routes) / sizeof(ngx_http_m40_routes[0]); i++) {
        if (r->uri.len >= ngx_http_m40_routes[i].suffix.len
            && ngx_strncmp(r->uri.data + r->uri.len
                           - ngx_http_m40_routes[i].suffix.len,
                           ngx_http_m40_routes[i].suffix.data,
                           ngx_http_m40_routes[i].suffix.len) == 0)
        {
            route = &ngx_http_m40_routes[i];
            break;
        }
    }

    if (route == NULL) {
        rc = ngx_http_discard_request_body(r);
        if (rc != NGX_OK) {
            return rc;
        }

        return ngx_http_m40_send_simple_error(r, NGX_HTTP_NOT_FOUND,
                   "invalid_request_error", "not_found",
                   "no API endpoint at %V", &r->uri);
    }

    if (!(r->method & route->methods)) {
        rc = ngx_http_discard_request_body(r);
        if (rc != NGX_OK) {
            return rc;
        }

        return ngx_http_m40_not_allowed(r, (route->methods & NGX_HTTP_POST)
                                           ? "POST" : "GET, HEAD");
    }

    switch (route->endpoint) {

    case NGX_HTTP_M40_EP_CHAT:
        return ngx_http_m40_generate_handler(r, NGX_HTTP_M40_CHAT, NULL);

    case NGX_HTTP_M40_EP_COMPLETIONS:
        return ngx_http_m40_generate_handler(r, NGX_HTTP_M40_COMPLETIONS, NULL);

    case NGX_HTTP_M40_EP_RESPONSES:
        return ngx_http_m40_generate_handler(r, NGX_HTTP_M40_CHAT,
                                             &ngx_http_m40_responses_dialect);

    case NGX_HTTP_M40_EP_MESSAGES:
        return ngx_http_m40_generate_handler(r, NGX_HTTP_M40_CHAT,
                                             &ngx_http_m40_messages_dialect);

    case NGX_HTTP_M40_EP_COUNT_TOKENS:
        return ngx_http_m40_generate_handler(r, NGX_HTTP_M40_CHAT,
                                        &ngx_http_m40_count_tokens_dialect);

    default:
        break;
    }

    rc = ngx_http_discard_request_body(r);
    if (rc != NGX_OK) {
        return rc;
    }

    switch (route->endpoint) {

    case NGX_HTTP_M40_EP_MODELS:
        return ngx_http_m40_models_handler(r, NULL);

    case NGX_HTTP_M40_EP_HEALTH:
        return ngx_http_m40_health_handler(r);

    default: /* NGX_HTTP_M40_EP_METRICS */
        return ngx_http_m40_metrics_handler(r);
    }
}
