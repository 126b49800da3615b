/* Request body validation: the OpenAI request JSON becomes ngx_http_m40_params_t.
 *
 * The checks themselves are engine/serve/api_params.c (m40_api_params.h: plain C and
 * jansson, fuzzed by tests/fuzz/fuzz_params.c); this file gives them the server's
 * limits and moves the result into the request's pool. */
#include "ngx_http_m40_module.h"

#include "m40_api_params.h"

#if (NGX_HTTP_M40_MAX_N != M40_API_MAX_N || NGX_HTTP_M40_MAX_STOP != M40_API_MAX_STOP \
     || NGX_HTTP_M40_TOOL_CHOICE_NAMED != M40_API_TOOL_CHOICE_NAMED                   \
     || NGX_HTTP_M40_TOOL_CHOICE_REQUIRED != M40_API_TOOL_CHOICE_REQUIRED             \
     || NGX_HTTP_M40_TOOL_CHOICE_NONE != M40_API_TOOL_CHOICE_NONE)
#error "ngx_http_m40_module.h and m40_api_params.h disagree"
#endif


/* A copy of s (NUL-terminated) in the pool; NULL stays NULL. */
static ngx_int_t
ngx_http_m40_pool_str(ngx_pool_t *pool, const char *s, char **out)
{
    size_t  len;

    *out = NULL;
    if (s == NULL) {
        return NGX_OK;
    }

    len = ngx_strlen(s);
    *out = ngx_pnalloc(pool, len + 1);
    if (*out == NULL) {
        return NGX_ERROR;
    }

    ngx_memcpy(*out, s, len + 1);
    return NGX_OK;
}


ngx_int_t
ngx_http_m40_parse_params(ngx_http_request_t *r, ngx_http_m40_main_conf_t *mcf,
    ngx_http_m40_model_t *model, ngx_http_m40_kind_e kind, json_t *root,
    ngx_http_m40_params_t *p, ngx_http_m40_error_t *err)
{
    ngx_uint_t      i;
    m40_api_error   e;
    m40_api_limits  lim;
    m40_api_params  a;

    ngx_memzero(p, sizeof(ngx_http_m40_params_t));
    p->kind = kind;

    lim.model_name = (const char *) model->model_name.data;
    lim.model_name_len = model->model_name.len;
    lim.max_tokens_default = mcf->max_tokens_default;
    lim.max_tokens_limit = mcf->max_tokens_limit;

    if (m40_api_parse_params(root, kind == NGX_HTTP_M40_CHAT, &lim, &a, &e)
        != 0)
    {
        m40_api_params_free(&a);
        err->status = (ngx_uint_t) e.status;
        err->type = e.type;
        err->param = e.param;
        err->code = e.code;
        ngx_cpystrn((u_char *) err->message, (u_char *) e.message,
                    sizeof(err->message));
        return NGX_ERROR;
    }

    /* the JSON values move over (the caller releases them), strings that point
     * into root stay there, the rest is copied into the pool */
    p->messages = a.messages;
    p->tools = a.tools;
    p->template_kwargs = a.template_kwargs;
    a.messages = a.tools = a.template_kwargs = NULL;

    p->prompt.data = (u_char *) a.prompt;
    p->prompt.len = a.prompt_len;
    p->max_tokens = (ngx_int_t) a.max_tokens;
    p->n = a.n;
    p->temperature = a.temperature;
    p->top_p = a.top_p;
    p->min_p = a.min_p;
    p->top_k = (ngx_int_t) a.top_k;
    p->presence_penalty = a.presence_penalty;
    p->frequency_penalty = a.frequency_penalty;
    p->has_seed = a.has_seed;
    p->seed = a.seed;
    p->n_stop = a.n_stop;
    for (i = 0; i < a.n_stop; i++) {
        p->stop[i] = (char *) a.stop[i];
    }
    p->logprobs = a.logprobs;
    p->top_logprobs = (ngx_int_t) a.top_logprobs;
    p->stream = a.stream;
    p->include_usage = a.include_usage;
    p->echo = a.echo;
    p->ignore_eos = a.ignore_eos;
    p->tool_choice = a.tool_choice;
    p->parallel_tool_calls = a.parallel_tool_calls;
    p->json_object = a.json_object;

    if (a.n_bias) {
        p->bias_ids = ngx_palloc(r->pool, a.n_bias * sizeof(int32_t));
        p->bias_values = ngx_palloc(r->pool, a.n_bias * sizeof(float));
        if (p->bias_ids == NULL || p->bias_values == NULL) {
            goto nomem;
        }
        ngx_memcpy(p->bias_ids, a.bias_ids, a.n_bias * sizeof(int32_t));
        ngx_memcpy(p->bias_values, a.bias_values, a.n_bias * sizeof(float));
        p->n_bias = a.n_bias;
    }

    if (ngx_http_m40_pool_str(r->pool, a.grammar, &p->grammar) != NGX_OK
        || ngx_http_m40_pool_str(r->pool, a.json_schema, &p->json_schema)
           != NGX_OK)
    {
        goto nomem;
    }

    m40_api_params_free(&a);
    return NGX_OK;

nomem:

    m40_api_params_free(&a);
    ngx_http_m40_error_set(err, NGX_HTTP_INTERNAL_SERVER_ERROR, "server_error",
                           NULL, NULL, "out of memory");
    return NGX_ERROR;
}
