/* ngx_http_m40_module: directives, configuration, the process hooks and the routing
 * of API requests.
 *
 * Every worker process owns one engine per m40_model (ngx_http_m40_engines.c); a
 * request's "model" field chooses among them (the first is the default). */
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
static ngx_int_t ngx_http_m40_models_merge(ngx_conf_t *cf,
    ngx_http_m40_main_conf_t *mcf);
static ngx_int_t ngx_http_m40_read_template(ngx_conf_t *cf, ngx_str_t *path,
    ngx_str_t *out);
static ngx_int_t ngx_http_m40_parse_double(ngx_str_t *v, double *f);
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
      NGX_HTTP_MAIN_CONF|NGX_CONF_1MORE,
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

    { ngx_string("m40_batch_invariant"),
      NGX_HTTP_MAIN_CONF|NGX_CONF_FLAG,
      ngx_conf_set_flag_slot,
      NGX_HTTP_MAIN_CONF_OFFSET,
      offsetof(ngx_http_m40_main_conf_t, batch_invariant),
      NULL },

    { ngx_string("m40_load_wait"),
      NGX_HTTP_MAIN_CONF|NGX_CONF_TAKE1,
      ngx_conf_set_msec_slot,
      NGX_HTTP_MAIN_CONF_OFFSET,
      offsetof(ngx_http_m40_main_conf_t, load_wait),
      NULL },

    { ngx_string("m40_max_resident"),
      NGX_HTTP_MAIN_CONF|NGX_CONF_TAKE1,
      ngx_conf_set_num_slot,
      NGX_HTTP_MAIN_CONF_OFFSET,
      offsetof(ngx_http_m40_main_conf_t, max_resident),
      &ngx_http_m40_non_negative },

    { ngx_string("m40_api"),
      NGX_HTTP_LOC_CONF|NGX_CONF_NOARGS,
      ngx_http_m40_api,
      NGX_HTTP_LOC_CONF_OFFSET,
      0,
      NULL },

    { ngx_string("m40_prefix_hash_bytes"),
      NGX_HTTP_MAIN_CONF|NGX_HTTP_SRV_CONF|NGX_HTTP_LOC_CONF|NGX_CONF_TAKE1,
      ngx_conf_set_size_slot,
      NGX_HTTP_LOC_CONF_OFFSET,
      offsetof(ngx_http_m40_loc_conf_t, prefix_hash_bytes),
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
    ngx_http_m40_prefix_add_variables,     /* preconfiguration */
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

    if (ngx_array_init(&mcf->models, cf->pool, 2, sizeof(ngx_http_m40_model_t))
        != NGX_OK)
    {
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
    mcf->batch_invariant = NGX_CONF_UNSET;
    mcf->gpu_memory_fraction = -1.0;
    mcf->prefill_chunk = NGX_CONF_UNSET;
    mcf->prefill_budget = NGX_CONF_UNSET;
    mcf->itl_guard = -2.0;
    mcf->tool_parser = NGX_CONF_UNSET_UINT;
    mcf->reasoning = NGX_CONF_UNSET_UINT;
    mcf->max_resident = NGX_CONF_UNSET_UINT;

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
    ngx_conf_init_uint_value(mcf->max_resident, 0);

    ngx_conf_init_value(mcf->max_tokens_default, 256);
    ngx_conf_init_value(mcf->max_tokens_limit, 4096);
    ngx_conf_init_value(mcf->threads, 0);
    ngx_conf_init_value(mcf->cpu_exact, 0);
    ngx_conf_init_value(mcf->batch_invariant, 0);

    if (mcf->max_tokens_default > mcf->max_tokens_limit) {
        ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                           "m40_max_tokens_default %i is larger than "
                           "m40_max_tokens_limit %i",
                           mcf->max_tokens_default, mcf->max_tokens_limit);
        return NGX_CONF_ERROR;
    }

    if (mcf->api_used && mcf->models.nelts == 0) {
        ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                           "\"m40_api\" is used but no \"m40_model\" is set "
                           "in the http block");
        return NGX_CONF_ERROR;
    }

    if (mcf->models.nelts == 0) {
        return NGX_CONF_OK;
    }

    if (ngx_http_m40_models_merge(cf, mcf) != NGX_OK) {
        return NGX_CONF_ERROR;
    }

    if (ngx_http_m40_shm_add(cf, mcf) != NGX_OK) {
        return NGX_CONF_ERROR;
    }

    return NGX_CONF_OK;
}


/* Each model's unset settings from the http block's, and the GPU memory plan of the
 * models that share a card (m40_engine.h, kv_share): models on one GPU load in the
 * order of the configuration, each after the weights of those before it; the weights
 * of those after it (their files' sizes, which is what they upload, near enough) are
 * set aside first, and by default the room left is shared equally: 1/N for the first
 * of N, 1/(N-1) for the next, the whole rest for the last. */
static ngx_int_t
ngx_http_m40_models_merge(ngx_conf_t *cf, ngx_http_m40_main_conf_t *mcf)
{
    ngx_uint_t             i, j, later;
    ngx_http_m40_model_t  *models, *m;

    models = mcf->models.elts;

    for (i = 0; i < mcf->models.nelts; i++) {
        m = &models[i];

        ngx_conf_merge_value(m->device, NGX_CONF_UNSET, mcf->device);

        if (m->tp > 1 && m->device < 0) {
            ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                               "m40_model \"%V\": tp=%i splits a model over "
                               "GPUs and needs a GPU device (device=N or "
                               "m40_device N)", &m->model_path, m->tp);
            return NGX_ERROR;
        }

        ngx_conf_merge_value(m->batch_invariant, NGX_CONF_UNSET,
                             mcf->batch_invariant);

        if (m->batch_invariant && m->tp > 1) {
            ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                               "m40_model \"%V\": batch_invariant does not "
                               "work with tensor parallelism (tp=%i): use "
                               "tp=1 or batch_invariant=off",
                               &m->model_path, m->tp);
            return NGX_ERROR;
        }

        ngx_conf_merge_value(m->ctx_size, NGX_CONF_UNSET, mcf->ctx_size);
        ngx_conf_merge_value(m->max_seqs, NGX_CONF_UNSET, mcf->max_seqs);
        ngx_conf_merge_value(m->max_queue, NGX_CONF_UNSET, mcf->max_queue);
        ngx_conf_merge_value(m->threads, NGX_CONF_UNSET, mcf->threads);
        ngx_conf_merge_value(m->prefill_chunk, NGX_CONF_UNSET,
                             mcf->prefill_chunk);
        ngx_conf_merge_value(m->prefill_budget, NGX_CONF_UNSET,
                             mcf->prefill_budget);
        ngx_conf_merge_uint_value(m->tool_parser, NGX_CONF_UNSET_UINT,
                                  mcf->tool_parser);
        ngx_conf_merge_uint_value(m->reasoning, NGX_CONF_UNSET_UINT,
                                  mcf->reasoning);

        if (m->gpu_memory_fraction < 0.0) {
            m->gpu_memory_fraction = mcf->gpu_memory_fraction;
        }

        if (m->itl_guard < -1.5) {
            m->itl_guard = mcf->itl_guard;
        }

        if (m->chat_template.data == NULL) {
            m->chat_template = mcf->chat_template;
        }

        if (m->prefill_chunk > 0 && m->prefill_budget > 0
            && m->prefill_chunk > m->prefill_budget)
        {
            ngx_conf_log_error(NGX_LOG_WARN, cf, 0,
                               "m40_prefill_chunk %i is larger than "
                               "m40_prefill_budget %i for \"%V\": a sequence "
                               "gets at most the budget in a step",
                               m->prefill_chunk, m->prefill_budget,
                               &m->model_name);
        }
    }

    for (i = 0; i < mcf->models.nelts; i++) {
        m = &models[i];
        m->kv_keep_bytes = 0;

        if (m->device < 0) {
            if (m->kv_share >= 0.0) {
                ngx_conf_log_error(NGX_LOG_WARN, cf, 0,
                                   "kv_share of \"%V\" has no effect on the "
                                   "cpu (each sequence has its own cache)",
                                   &m->model_name);
            }
            m->kv_share = 0.0;
            continue;
        }

        later = 0;
        for (j = i + 1; j < mcf->models.nelts; j++) {
            if (models[j].device == m->device) {
                later++;
                m->kv_keep_bytes += (int64_t) models[j].file_size;
            }
        }

        if (m->kv_share < 0.0) {
            m->kv_share = 1.0 / (double) (later + 1);
        }
    }

    return NGX_OK;
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
    lcf->prefix_hash_bytes = NGX_CONF_UNSET_SIZE;

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

    /* inherited, like any variable's setting: the front's hash is taken where
     * proxy_pass is */
    ngx_conf_merge_size_value(conf->prefix_hash_bytes, prev->prefix_hash_bytes,
                              2048);
    if (conf->prefix_hash_bytes == 0
        || conf->prefix_hash_bytes > NGX_HTTP_M40_PREFIX_HASH_BYTES_MAX)
    {
        ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                           "m40_prefix_hash_bytes must be from 1 to %d",
                           NGX_HTTP_M40_PREFIX_HASH_BYTES_MAX);
        return NGX_CONF_ERROR;
    }

    return NGX_CONF_OK;
}


/* A parameter's number: the whole of v, from min to max. */
static ngx_int_t
ngx_http_m40_param_int(ngx_conf_t *cf, ngx_str_t *param, ngx_str_t *v,
    ngx_int_t min, ngx_int_t max, ngx_int_t *out)
{
    ngx_int_t  n;

    n = ngx_atoi(v->data, v->len);
    if (n == NGX_ERROR || n < min || n > max) {
        ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                           "invalid m40_model parameter \"%V\": a number "
                           "from %i to %i expected", param, min, max);
        return NGX_ERROR;
    }

    *out = n;
    return NGX_OK;
}


static ngx_int_t
ngx_http_m40_param_enum(ngx_conf_t *cf, ngx_str_t *param, ngx_str_t *v,
    ngx_conf_enum_t *e, ngx_uint_t *out)
{
    for ( /* void */ ; e->name.len; e++) {
        if (e->name.len == v->len
            && ngx_strncasecmp(e->name.data, v->data, v->len) == 0)
        {
            *out = e->value;
            return NGX_OK;
        }
    }

    ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                       "invalid m40_model parameter \"%V\"", param);
    return NGX_ERROR;
}


/* m40_model PATH [name=NAME] [device=cpu|N] [tp=N] [ctx_size=N] [max_seqs=N] [max_queue=N]
 *     [threads=N] [kv_share=F] [gpu_memory_fraction=F] [chat_template=PATH]
 *     [tool_parser=P] [reasoning=R] [prefill_chunk=N] [prefill_budget=N]
 *     [itl_guard=F|off] [batch_invariant=on|off] [keep_alive=TIME|off]
 * May appear several times: the first model is the default (requests without a
 * "model" field). A parameter left out takes the http block's directive of the same
 * name (m40_device, m40_ctx_size, ...). */
static char *
ngx_http_m40_model(ngx_conf_t *cf, ngx_command_t *cmd, void *conf)
{
    ngx_http_m40_main_conf_t *mcf = conf;

    u_char                *p, *base, *end;
    double                 f;
    ngx_int_t              n;
    ngx_str_t             *value, v, path;
    ngx_uint_t             i;
    ngx_file_info_t        fi;
    ngx_http_m40_model_t  *m, *other;

    value = cf->args->elts;

    m = ngx_array_push(&mcf->models);
    if (m == NULL) {
        return NGX_CONF_ERROR;
    }

    ngx_memzero(m, sizeof(ngx_http_m40_model_t));
    m->index = mcf->models.nelts - 1;
    m->device = NGX_CONF_UNSET;
    m->tp = 1;
    m->ctx_size = NGX_CONF_UNSET;
    m->max_seqs = NGX_CONF_UNSET;
    m->max_queue = NGX_CONF_UNSET;
    m->threads = NGX_CONF_UNSET;
    m->prefill_chunk = NGX_CONF_UNSET;
    m->prefill_budget = NGX_CONF_UNSET;
    m->gpu_memory_fraction = -1.0;
    m->kv_share = -1.0;
    m->itl_guard = -2.0;
    m->batch_invariant = NGX_CONF_UNSET;
    m->tool_parser = NGX_CONF_UNSET_UINT;
    m->reasoning = NGX_CONF_UNSET_UINT;

    m->model_path = value[1];
    if (ngx_conf_full_name(cf->cycle, &m->model_path, 1) != NGX_OK) {
        return NGX_CONF_ERROR;
    }

    if (ngx_file_info(m->model_path.data, &fi) == NGX_FILE_ERROR) {
        ngx_conf_log_error(NGX_LOG_EMERG, cf, ngx_errno,
                           ngx_file_info_n " \"%V\" failed", &m->model_path);
        return NGX_CONF_ERROR;
    }

    if (!ngx_is_file(&fi)) {
        ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                           "m40_model \"%V\" is not a regular file",
                           &m->model_path);
        return NGX_CONF_ERROR;
    }

    m->file_size = ngx_file_size(&fi);

    for (i = 2; i < cf->args->nelts; i++) {
        p = ngx_strlchr(value[i].data, value[i].data + value[i].len, '=');
        if (p == NULL || p == value[i].data) {
            goto invalid;
        }

        v.data = p + 1;
        v.len = value[i].data + value[i].len - v.data;

#define ngx_http_m40_is(s)                                                    \
        ((size_t) (p - value[i].data) == sizeof(s) - 1                        \
         && ngx_strncmp(value[i].data, s, sizeof(s) - 1) == 0)

        if (ngx_http_m40_is("name")) {
            if (v.len == 0) {
                goto invalid;
            }
            m->model_name = v;      /* NUL-terminated: the argument's end */

        } else if (ngx_http_m40_is("device")) {
            if (v.len == 3 && ngx_strncasecmp(v.data, (u_char *) "cpu", 3) == 0) {
                m->device = -1;
            } else if (ngx_http_m40_param_int(cf, &value[i], &v, 0, 1024,
                                              &m->device) != NGX_OK)
            {
                return NGX_CONF_ERROR;
            }

        } else if (ngx_http_m40_is("tp")) {
            if (ngx_http_m40_param_int(cf, &value[i], &v, 1, 64, &m->tp)
                != NGX_OK)
            {
                return NGX_CONF_ERROR;
            }

        } else if (ngx_http_m40_is("ctx_size")) {
            if (ngx_http_m40_param_int(cf, &value[i], &v, 0, 0x7fffffff,
                                       &m->ctx_size) != NGX_OK)
            {
                return NGX_CONF_ERROR;
            }

        } else if (ngx_http_m40_is("max_seqs")) {
            if (ngx_http_m40_param_int(cf, &value[i], &v, 1, 0x7fffffff,
                                       &m->max_seqs) != NGX_OK)
            {
                return NGX_CONF_ERROR;
            }

        } else if (ngx_http_m40_is("max_queue")) {
            if (ngx_http_m40_param_int(cf, &value[i], &v, 1, 0x7fffffff,
                                       &m->max_queue) != NGX_OK)
            {
                return NGX_CONF_ERROR;
            }

        } else if (ngx_http_m40_is("threads")) {
            if (ngx_http_m40_param_int(cf, &value[i], &v, 0, 1024,
                                       &m->threads) != NGX_OK)
            {
                return NGX_CONF_ERROR;
            }

        } else if (ngx_http_m40_is("prefill_chunk")
                   || ngx_http_m40_is("prefill_budget"))
        {
            if (ngx_http_m40_param_int(cf, &value[i], &v, 1,
                                       M40_MAX_PREFILL_TOKENS, &n) != NGX_OK)
            {
                return NGX_CONF_ERROR;
            }
            if (value[i].data[8] == 'c') {
                m->prefill_chunk = n;
            } else {
                m->prefill_budget = n;
            }

        } else if (ngx_http_m40_is("kv_share")
                   || ngx_http_m40_is("gpu_memory_fraction"))
        {
            if (ngx_http_m40_parse_double(&v, &f) != NGX_OK
                || !(f > 0.0 && f <= 1.0))
            {
                ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                                   "invalid m40_model parameter \"%V\": a "
                                   "number greater than 0 and at most 1 "
                                   "expected", &value[i]);
                return NGX_CONF_ERROR;
            }
            if (value[i].data[0] == 'k') {
                m->kv_share = f;
            } else {
                m->gpu_memory_fraction = f;
            }

        } else if (ngx_http_m40_is("itl_guard")) {
            if (v.len == 3 && ngx_strncasecmp(v.data, (u_char *) "off", 3) == 0) {
                m->itl_guard = -1.0;
            } else if (ngx_http_m40_parse_double(&v, &f) != NGX_OK
                       || !(f >= 1.0 && f <= 100.0))
            {
                ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                                   "invalid m40_model parameter \"%V\": a "
                                   "number from 1 to 100 or \"off\" expected",
                                   &value[i]);
                return NGX_CONF_ERROR;
            } else {
                m->itl_guard = f;
            }

        } else if (ngx_http_m40_is("batch_invariant")) {
            if (v.len == 2
                && ngx_strncasecmp(v.data, (u_char *) "on", 2) == 0)
            {
                m->batch_invariant = 1;

            } else if (v.len == 3
                       && ngx_strncasecmp(v.data, (u_char *) "off", 3) == 0)
            {
                m->batch_invariant = 0;

            } else {
                ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                                   "invalid m40_model parameter \"%V\": "
                                   "\"on\" or \"off\" expected", &value[i]);
                return NGX_CONF_ERROR;
            }

        } else if (ngx_http_m40_is("chat_template")) {
            path = v;
            if (v.len == 0
                || ngx_conf_full_name(cf->cycle, &path, 1) != NGX_OK
                || ngx_http_m40_read_template(cf, &path, &m->chat_template)
                   != NGX_OK)
            {
                return NGX_CONF_ERROR;
            }

        } else if (ngx_http_m40_is("keep_alive")) {
            if (v.len == 3 && ngx_strncasecmp(v.data, (u_char *) "off", 3) == 0) {
                m->keep_alive = 0;
            } else {
                m->keep_alive = ngx_parse_time(&v, 0);
                if (m->keep_alive == (ngx_msec_t) NGX_ERROR
                    || m->keep_alive < 1000)
                {
                    ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                                       "invalid m40_model parameter \"%V\": "
                                       "a time of 1s or more (e.g. 5m) or "
                                       "\"off\" expected", &value[i]);
                    return NGX_CONF_ERROR;
                }
            }

        } else if (ngx_http_m40_is("tool_parser")) {
            if (ngx_http_m40_param_enum(cf, &value[i], &v,
                                        ngx_http_m40_tool_parsers,
                                        &m->tool_parser) != NGX_OK)
            {
                return NGX_CONF_ERROR;
            }

        } else if (ngx_http_m40_is("reasoning")) {
            if (ngx_http_m40_param_enum(cf, &value[i], &v,
                                        ngx_http_m40_reasoning_modes,
                                        &m->reasoning) != NGX_OK)
            {
                return NGX_CONF_ERROR;
            }

        } else {
            goto invalid;
        }

#undef ngx_http_m40_is
    }

    if (m->model_name.len == 0) {
        /* Default public name: the file name without its directory and ".gguf". */
        end = m->model_path.data + m->model_path.len;
        base = m->model_path.data;
        for (p = base; p < end; p++) {
            if (*p == '/') {
                base = p + 1;
            }
        }

        if (end - base > 5
            && ngx_strncasecmp(end - 5, (u_char *) ".gguf", 5) == 0)
        {
            end -= 5;
        }

        m->model_name.len = end - base;
        m->model_name.data = ngx_pnalloc(cf->pool, m->model_name.len + 1);
        if (m->model_name.data == NULL) {
            return NGX_CONF_ERROR;
        }
        ngx_cpystrn(m->model_name.data, base, m->model_name.len + 1);
    }

    if (m->model_name.len >= NGX_HTTP_M40_NAME_MAX) {
        ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                           "the model name \"%V\" is longer than %d bytes",
                           &m->model_name, NGX_HTTP_M40_NAME_MAX - 1);
        return NGX_CONF_ERROR;
    }

    other = ngx_http_m40_model_find(mcf, m->model_name.data,
                                    m->model_name.len);
    if (other != m) {
        ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                           "duplicate model name \"%V\" (give one of the "
                           "m40_model directives another name=)",
                           &m->model_name);
        return NGX_CONF_ERROR;
    }

    return NGX_CONF_OK;

invalid:

    ngx_conf_log_error(NGX_LOG_EMERG, cf, 0, "invalid m40_model parameter "
                       "\"%V\"", &value[i]);
    return NGX_CONF_ERROR;
}


ngx_http_m40_model_t *
ngx_http_m40_model_find(ngx_http_m40_main_conf_t *mcf, const u_char *name,
    size_t len)
{
    ngx_uint_t             i;
    ngx_http_m40_model_t  *models;

    models = mcf->models.elts;

    for (i = 0; i < mcf->models.nelts; i++) {
        if (models[i].model_name.len == len
            && ngx_memcmp(models[i].model_name.data, name, len) == 0)
        {
            return &models[i];
        }
    }

    return NULL;
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

    ngx_str_t  *value, path;

    if (mcf->chat_template.data) {
        return "is duplicate";
    }

    value = cf->args->elts;

    path = value[1];
    if (ngx_conf_full_name(cf->cycle, &path, 1) != NGX_OK) {
        return NGX_CONF_ERROR;
    }

    if (ngx_http_m40_read_template(cf, &path, &mcf->chat_template) != NGX_OK) {
        return NGX_CONF_ERROR;
    }

    return NGX_CONF_OK;
}


/* A chat template file's content, NUL-terminated, in the configuration's pool. */
static ngx_int_t
ngx_http_m40_read_template(ngx_conf_t *cf, ngx_str_t *path, ngx_str_t *out)
{
    off_t        size;
    ssize_t      n;
    ngx_file_t   file;

    ngx_memzero(&file, sizeof(ngx_file_t));
    file.name = *path;
    file.log = cf->log;

    file.fd = ngx_open_file(file.name.data, NGX_FILE_RDONLY, NGX_FILE_OPEN, 0);
    if (file.fd == NGX_INVALID_FILE) {
        ngx_conf_log_error(NGX_LOG_EMERG, cf, ngx_errno,
                           ngx_open_file_n " \"%V\" failed", &file.name);
        return NGX_ERROR;
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

    out->data = ngx_pnalloc(cf->pool, (size_t) size + 1);
    if (out->data == NULL) {
        goto failed;
    }

    n = ngx_read_file(&file, out->data, (size_t) size, 0);
    if (n != size) {
        ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                           ngx_read_file_n " \"%V\" returned only %z bytes",
                           &file.name, n);
        out->data = NULL;
        goto failed;
    }

    out->len = (size_t) size;
    out->data[size] = '\0';

    if (ngx_close_file(file.fd) == NGX_FILE_ERROR) {
        ngx_log_error(NGX_LOG_ALERT, cf->log, ngx_errno,
                      ngx_close_file_n " \"%V\" failed", &file.name);
    }

    return NGX_OK;

failed:

    if (ngx_close_file(file.fd) == NGX_FILE_ERROR) {
        ngx_log_error(NGX_LOG_ALERT, cf->log, ngx_errno,
                      ngx_close_file_n " \"%V\" failed", &file.name);
    }

    return NGX_ERROR;
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


/* ---- per-worker engines (ngx_http_m40_engines.c) ---- */

static ngx_int_t
ngx_http_m40_init_process(ngx_cycle_t *cycle)
{
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
    if (mcf == NULL || mcf->models.nelts == 0) {
        return NGX_OK;
    }

    ngx_http_m40_engines_init(cycle, mcf);

    return NGX_OK;
}


static void
ngx_http_m40_exit_process(ngx_cycle_t *cycle)
{
    ngx_http_m40_main_conf_t  *mcf;

    if (cycle->conf_ctx[ngx_http_module.index] == NULL) {
        return;
    }

    mcf = ngx_http_cycle_get_module_main_conf(cycle, ngx_http_m40_module);
    if (mcf == NULL || mcf->models.nelts == 0) {
        return;
    }

    if (ngx_process != NGX_PROCESS_WORKER && ngx_process != NGX_PROCESS_SINGLE) {
        return;
    }

    ngx_http_m40_engines_exit(cycle, mcf);
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
    ngx_http_m40_shm_count_http(mcf);

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
