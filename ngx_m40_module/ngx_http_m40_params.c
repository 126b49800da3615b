/* Request body validation: the OpenAI request JSON becomes ngx_http_m40_params_t.
 *
 * Unknown fields are ignored (clients send many); a known field with the wrong type
 * or out of range is a 400 naming the field in "param". null counts as absent. */
#include "ngx_http_m40_module.h"

#include <math.h>


#define ngx_http_m40_bad(err, param, ...)                                    \
    ngx_http_m40_error_set(err, NGX_HTTP_BAD_REQUEST,                          \
                           "invalid_request_error", param,                     \
                           "invalid_value", __VA_ARGS__)


/* Field present and not null. */
static json_t *
ngx_http_m40_field(json_t *root, const char *name)
{
    json_t  *v;

    v = json_object_get(root, name);
    if (v == NULL || json_is_null(v)) {
        return NULL;
    }

    return v;
}


static ngx_int_t
ngx_http_m40_get_number(json_t *root, const char *name, double lo, double hi,
    float *out, ngx_http_m40_error_t *err)
{
    double   d;
    json_t  *v;

    v = ngx_http_m40_field(root, name);
    if (v == NULL) {
        return NGX_OK;
    }

    if (!json_is_number(v)) {
        ngx_http_m40_bad(err, name, "'%s' must be a number", name);
        return NGX_ERROR;
    }

    d = json_number_value(v);
    if (!isfinite(d) || d < lo || d > hi) {
        ngx_http_m40_bad(err, name, "'%s' must be between %.1f and %.1f", name,
                         lo, hi);
        return NGX_ERROR;
    }

    *out = (float) d;
    return NGX_OK;
}


static ngx_int_t
ngx_http_m40_get_integer(json_t *root, const char *name, json_int_t lo,
    json_int_t hi, ngx_int_t *out, ngx_http_m40_error_t *err)
{
    json_t      *v;
    json_int_t   i;

    v = ngx_http_m40_field(root, name);
    if (v == NULL) {
        return NGX_DECLINED;
    }

    if (!json_is_integer(v)) {
        ngx_http_m40_bad(err, name, "'%s' must be an integer", name);
        return NGX_ERROR;
    }

    i = json_integer_value(v);
    if (i < lo || i > hi) {
        ngx_http_m40_bad(err, name, "'%s' must be between %L and %L", name,
                         (int64_t) lo, (int64_t) hi);
        return NGX_ERROR;
    }

    *out = (ngx_int_t) i;
    return NGX_OK;
}


static ngx_int_t
ngx_http_m40_get_bool(json_t *root, const char *name, ngx_flag_t *out,
    ngx_http_m40_error_t *err)
{
    json_t  *v;

    v = ngx_http_m40_field(root, name);
    if (v == NULL) {
        return NGX_OK;
    }

    if (!json_is_boolean(v)) {
        ngx_http_m40_bad(err, name, "'%s' must be a boolean", name);
        return NGX_ERROR;
    }

    *out = json_is_true(v) ? 1 : 0;
    return NGX_OK;
}


/* A message content: a string, or an array of {"type":"text","text":...} parts
 * joined with newlines. Returns a new JSON string. */
static json_t *
ngx_http_m40_flatten_content(json_t *content, ngx_uint_t i,
    ngx_http_m40_error_t *err)
{
    char     *buf, *p;
    size_t    len, tl, k, n;
    json_t   *part, *type, *text, *s;

    if (json_is_string(content)) {
        return json_stringn(json_string_value(content),
                            json_string_length(content));
    }

    if (!json_is_array(content)) {
        ngx_http_m40_bad(err, "messages",
                         "messages[%ui].content must be a string or an array "
                         "of content parts", i);
        return NULL;
    }

    n = json_array_size(content);
    len = 0;

    for (k = 0; k < n; k++) {
        part = json_array_get(content, k);
        type = json_object_get(part, "type");
        text = json_object_get(part, "text");

        if (!json_is_object(part) || !json_is_string(type)) {
            ngx_http_m40_bad(err, "messages",
                             "messages[%ui].content[%uz] must be an object "
                             "with a \"type\"", i, k);
            return NULL;
        }

        if (ngx_strcmp(json_string_value(type), "text") != 0) {
            ngx_http_m40_bad(err, "messages",
                             "messages[%ui].content[%uz]: content type \"%s\" "
                             "is not supported (only \"text\")", i, k,
                             json_string_value(type));
            return NULL;
        }

        if (!json_is_string(text)) {
            ngx_http_m40_bad(err, "messages",
                             "messages[%ui].content[%uz].text must be a string",
                             i, k);
            return NULL;
        }

        len += json_string_length(text) + 1;
    }

    buf = malloc(len + 1);
    if (buf == NULL) {
        ngx_http_m40_error_set(err, NGX_HTTP_INTERNAL_SERVER_ERROR,
                               "server_error", NULL, NULL, "out of memory");
        return NULL;
    }

    p = buf;
    for (k = 0; k < n; k++) {
        text = json_object_get(json_array_get(content, k), "text");
        tl = json_string_length(text);
        if (k > 0) {
            *p++ = '\n';
        }
        ngx_memcpy(p, json_string_value(text), tl);
        p += tl;
    }

    s = json_stringn(buf, (size_t) (p - buf));
    free(buf);

    if (s == NULL) {
        ngx_http_m40_error_set(err, NGX_HTTP_INTERNAL_SERVER_ERROR,
                               "server_error", NULL, NULL, "out of memory");
    }

    return s;
}


static ngx_int_t
ngx_http_m40_parse_messages(json_t *root, ngx_http_m40_params_t *p,
    ngx_http_m40_error_t *err)
{
    size_t       i, n;
    json_t      *msgs, *m, *role, *content, *flat, *out;
    const char  *r;

    msgs = ngx_http_m40_field(root, "messages");
    if (msgs == NULL) {
        ngx_http_m40_bad(err, "messages", "'messages' is required");
        return NGX_ERROR;
    }

    if (!json_is_array(msgs) || json_array_size(msgs) == 0) {
        ngx_http_m40_bad(err, "messages",
                         "'messages' must be a non-empty array");
        return NGX_ERROR;
    }

    n = json_array_size(msgs);

    p->messages = json_array();
    if (p->messages == NULL) {
        goto nomem;
    }

    for (i = 0; i < n; i++) {
        m = json_array_get(msgs, i);

        if (!json_is_object(m)) {
            ngx_http_m40_bad(err, "messages", "messages[%uz] must be an object",
                             i);
            return NGX_ERROR;
        }

        role = json_object_get(m, "role");
        if (!json_is_string(role)) {
            ngx_http_m40_bad(err, "messages",
                             "messages[%uz].role must be a string", i);
            return NGX_ERROR;
        }

        r = json_string_value(role);
        if (ngx_strcmp(r, "developer") == 0) {
            r = "system";       /* OpenAI's newer name for system */

        } else if (ngx_strcmp(r, "system") != 0 && ngx_strcmp(r, "user") != 0
                   && ngx_strcmp(r, "assistant") != 0
                   && ngx_strcmp(r, "tool") != 0)
        {
            ngx_http_m40_bad(err, "messages",
                             "messages[%uz].role \"%s\" is not supported "
                             "(system, user, assistant, tool)", i, r);
            return NGX_ERROR;
        }

        content = json_object_get(m, "content");
        if ((content == NULL || json_is_null(content))
            && ngx_strcmp(r, "assistant") == 0)
        {
            /* A tool-call turn keeps its null: templates test "content is none"
             * there (DeepSeek-R1's), as vLLM passes it. */
            flat = json_array_size(json_object_get(m, "tool_calls")) > 0
                   ? json_null() : json_string("");

        } else if (content == NULL) {
            ngx_http_m40_bad(err, "messages",
                             "messages[%uz].content is required", i);
            return NGX_ERROR;

        } else {
            flat = ngx_http_m40_flatten_content(content, i, err);
            if (flat == NULL) {
                return NGX_ERROR;
            }
        }

        out = json_pack("{s:s,s:o}", "role", r, "content", flat);
        if (out == NULL || json_array_append_new(p->messages, out) != 0) {
            goto nomem;
        }

        /* tool_calls, tool_call_id, name, reasoning_content (tools.c) */
        if (ngx_http_m40_message_tool_fields(m, i, r, out, err) != NGX_OK) {
            return NGX_ERROR;
        }
    }

    return NGX_OK;

nomem:

    ngx_http_m40_error_set(err, NGX_HTTP_INTERNAL_SERVER_ERROR,
                           "server_error", NULL, NULL, "out of memory");
    return NGX_ERROR;
}


static ngx_int_t
ngx_http_m40_parse_prompt(ngx_http_request_t *r, json_t *root,
    ngx_http_m40_params_t *p, ngx_http_m40_error_t *err)
{
    json_t  *v;

    v = ngx_http_m40_field(root, "prompt");
    if (v == NULL) {
        ngx_http_m40_bad(err, "prompt", "'prompt' is required");
        return NGX_ERROR;
    }

    if (json_is_array(v)) {
        if (json_array_size(v) != 1 || !json_is_string(json_array_get(v, 0))) {
            ngx_http_m40_bad(err, "prompt",
                             "'prompt' must be a string or an array of one "
                             "string (batches and token arrays are not "
                             "supported)");
            return NGX_ERROR;
        }

        v = json_array_get(v, 0);
    }

    if (!json_is_string(v)) {
        ngx_http_m40_bad(err, "prompt", "'prompt' must be a string");
        return NGX_ERROR;
    }

    p->prompt.len = json_string_length(v);
    p->prompt.data = (u_char *) json_string_value(v);

    return NGX_OK;
}


static ngx_int_t
ngx_http_m40_add_stop(json_t *s, size_t i, ngx_http_m40_params_t *p,
    ngx_http_m40_error_t *err)
{
    size_t  len;

    if (!json_is_string(s)) {
        ngx_http_m40_bad(err, "stop", "stop[%uz] must be a string", i);
        return NGX_ERROR;
    }

    len = json_string_length(s);

    if (len > 1024) {
        ngx_http_m40_bad(err, "stop", "a stop string is longer than 1024 bytes");
        return NGX_ERROR;
    }

    if (ngx_strlen(json_string_value(s)) != len) {
        ngx_http_m40_bad(err, "stop", "stop strings must not contain NUL");
        return NGX_ERROR;
    }

    if (len > 0) {          /* an empty stop string would end every answer */
        p->stop[p->n_stop++] = (char *) json_string_value(s);
    }

    return NGX_OK;
}


static ngx_int_t
ngx_http_m40_parse_stop(json_t *root, ngx_http_m40_params_t *p,
    ngx_http_m40_error_t *err)
{
    size_t   i;
    json_t  *v;

    v = ngx_http_m40_field(root, "stop");
    if (v == NULL) {
        return NGX_OK;
    }

    if (json_is_string(v)) {
        return ngx_http_m40_add_stop(v, 0, p, err);
    }

    if (!json_is_array(v) || json_array_size(v) > NGX_HTTP_M40_MAX_STOP) {
        ngx_http_m40_bad(err, "stop",
                         "'stop' must be a string or an array of up to %d "
                         "strings", NGX_HTTP_M40_MAX_STOP);
        return NGX_ERROR;
    }

    for (i = 0; i < json_array_size(v); i++) {
        if (ngx_http_m40_add_stop(json_array_get(v, i), i, p, err) != NGX_OK) {
            return NGX_ERROR;
        }
    }

    return NGX_OK;
}


static ngx_int_t
ngx_http_m40_parse_logit_bias(ngx_http_request_t *r, json_t *root,
    ngx_http_m40_params_t *p, ngx_http_m40_error_t *err)
{
    double       d;
    size_t       n;
    json_t      *v, *val;
    ngx_int_t    id;
    const char  *key;

    v = ngx_http_m40_field(root, "logit_bias");
    if (v == NULL) {
        return NGX_OK;
    }

    if (!json_is_object(v)) {
        ngx_http_m40_bad(err, "logit_bias",
                         "'logit_bias' must be an object mapping token ids to "
                         "numbers");
        return NGX_ERROR;
    }

    n = json_object_size(v);
    if (n == 0) {
        return NGX_OK;
    }

    if (n > 1024) {
        ngx_http_m40_bad(err, "logit_bias",
                         "'logit_bias' has more than 1024 entries");
        return NGX_ERROR;
    }

    p->bias_ids = ngx_palloc(r->pool, n * sizeof(int32_t));
    p->bias_values = ngx_palloc(r->pool, n * sizeof(float));
    if (p->bias_ids == NULL || p->bias_values == NULL) {
        ngx_http_m40_error_set(err, NGX_HTTP_INTERNAL_SERVER_ERROR,
                               "server_error", NULL, NULL, "out of memory");
        return NGX_ERROR;
    }

    json_object_foreach(v, key, val) {
        id = ngx_atoi((u_char *) key, ngx_strlen(key));
        if (id == NGX_ERROR || id > 0x7fffffff) {
            ngx_http_m40_bad(err, "logit_bias",
                             "logit_bias key \"%s\" is not a token id", key);
            return NGX_ERROR;
        }

        if (!json_is_number(val)) {
            ngx_http_m40_bad(err, "logit_bias",
                             "logit_bias[\"%s\"] must be a number", key);
            return NGX_ERROR;
        }

        d = json_number_value(val);
        if (!isfinite(d) || d < -100.0 || d > 100.0) {
            ngx_http_m40_bad(err, "logit_bias",
                             "logit_bias[\"%s\"] must be between -100 and 100",
                             key);
            return NGX_ERROR;
        }

        p->bias_ids[p->n_bias] = (int32_t) id;
        p->bias_values[p->n_bias] = (float) d;
        p->n_bias++;
    }

    return NGX_OK;
}


/* "response_format" ({"type": "text" | "json_object" | "json_schema", "json_schema":
 * {"name", "schema", "strict"}}) and "grammar" (GBNF, as llama-server takes it). Only the
 * shape is checked here; the engine compiles the schema or grammar off the event loop
 * and answers a bad one with a 400 that names the problem. */
static ngx_int_t
ngx_http_m40_parse_format(ngx_http_request_t *r, json_t *root,
    ngx_http_m40_params_t *p, ngx_http_m40_error_t *err)
{
    char        *dump;
    size_t       len;
    json_t      *rf, *type, *js, *schema, *v;
    const char  *t;

    v = ngx_http_m40_field(root, "grammar");
    if (v != NULL) {
        if (!json_is_string(v)) {
            ngx_http_m40_bad(err, "grammar", "'grammar' must be a string");
            return NGX_ERROR;
        }
        len = json_string_length(v);
        p->grammar = ngx_pnalloc(r->pool, len + 1);
        if (p->grammar == NULL) {
            goto nomem;
        }
        ngx_memcpy(p->grammar, json_string_value(v), len);
        p->grammar[len] = '\0';
    }

    rf = ngx_http_m40_field(root, "response_format");
    if (rf == NULL) {
        return NGX_OK;
    }

    type = json_is_object(rf) ? json_object_get(rf, "type") : NULL;
    if (!json_is_string(type)) {
        ngx_http_m40_bad(err, "response_format",
                         "'response_format' must be an object with a string "
                         "'type'");
        return NGX_ERROR;
    }

    t = json_string_value(type);
    if (ngx_strcmp(t, "text") == 0) {
        return NGX_OK;
    }

    if (p->grammar != NULL) {
        ngx_http_m40_bad(err, "response_format",
                         "'response_format' together with 'grammar' is not "
                         "supported");
        return NGX_ERROR;
    }

    if (ngx_strcmp(t, "json_object") == 0) {
        p->json_object = 1;
        return NGX_OK;
    }

    if (ngx_strcmp(t, "json_schema") != 0) {
        ngx_http_m40_bad(err, "response_format.type",
                         "'response_format.type' must be 'text', "
                         "'json_object' or 'json_schema'");
        return NGX_ERROR;
    }

    js = json_object_get(rf, "json_schema");
    if (!json_is_object(js)) {
        ngx_http_m40_bad(err, "response_format.json_schema",
                         "'response_format.json_schema' must be an object");
        return NGX_ERROR;
    }

    v = json_object_get(js, "name");
    if (v != NULL && !json_is_string(v)) {
        ngx_http_m40_bad(err, "response_format.json_schema.name",
                         "'response_format.json_schema.name' must be a string");
        return NGX_ERROR;
    }

    v = json_object_get(js, "strict");
    if (v != NULL && !json_is_null(v) && !json_is_boolean(v)) {
        ngx_http_m40_bad(err, "response_format.json_schema.strict",
                         "'response_format.json_schema.strict' must be a "
                         "boolean");
        return NGX_ERROR;
    }

    schema = ngx_http_m40_field(js, "schema");
    if (schema == NULL) {
        p->json_object = 1;     /* no schema: any JSON object */
        return NGX_OK;
    }

    if (!json_is_object(schema) && !json_is_boolean(schema)) {
        ngx_http_m40_bad(err, "response_format.json_schema.schema",
                         "'response_format.json_schema.schema' must be an "
                         "object");
        return NGX_ERROR;
    }

    dump = json_dumps(schema, JSON_COMPACT | JSON_ENCODE_ANY);
    if (dump == NULL) {
        goto nomem;
    }

    len = ngx_strlen(dump);
    p->json_schema = ngx_pnalloc(r->pool, len + 1);
    if (p->json_schema != NULL) {
        ngx_memcpy(p->json_schema, dump, len + 1);
    }

    free(dump);

    if (p->json_schema != NULL) {
        return NGX_OK;
    }

nomem:

    ngx_http_m40_error_set(err, NGX_HTTP_INTERNAL_SERVER_ERROR, "server_error",
                           NULL, NULL, "out of memory");
    return NGX_ERROR;
}


ngx_int_t
ngx_http_m40_parse_params(ngx_http_request_t *r, ngx_http_m40_main_conf_t *mcf,
    ngx_http_m40_kind_e kind, json_t *root, ngx_http_m40_params_t *p,
    ngx_http_m40_error_t *err)
{
    json_t     *v, *so;
    ngx_int_t   i, rc;

    ngx_memzero(p, sizeof(ngx_http_m40_params_t));
    p->kind = kind;
    p->max_tokens = mcf->max_tokens_default;
    p->n = 1;
    p->temperature = 1.0f;
    p->top_p = 1.0f;

    if (!json_is_object(root)) {
        ngx_http_m40_bad(err, NULL, "the request body must be a JSON object");
        return NGX_ERROR;
    }

    /* model first: a wrong model is a 404 whatever else is wrong */
    v = ngx_http_m40_field(root, "model");
    if (v != NULL) {
        if (!json_is_string(v)) {
            ngx_http_m40_bad(err, "model", "'model' must be a string");
            return NGX_ERROR;
        }

        if (json_string_length(v) != mcf->model_name.len
            || ngx_strncmp(json_string_value(v), mcf->model_name.data,
                           mcf->model_name.len) != 0)
        {
            ngx_http_m40_error_set(err, NGX_HTTP_NOT_FOUND,
                                   "invalid_request_error", "model",
                                   "model_not_found",
                                   "The model '%s' does not exist (this server "
                                   "serves '%V')", json_string_value(v),
                                   &mcf->model_name);
            return NGX_ERROR;
        }
    }

    if (kind == NGX_HTTP_M40_CHAT) {
        if (ngx_http_m40_parse_messages(root, p, err) != NGX_OK) {
            return NGX_ERROR;
        }

    } else if (ngx_http_m40_parse_prompt(r, root, p, err) != NGX_OK) {
        return NGX_ERROR;
    }

    rc = ngx_http_m40_get_integer(root, "max_tokens", 1, mcf->max_tokens_limit,
                                  &p->max_tokens, err);
    if (rc == NGX_ERROR) {
        return NGX_ERROR;
    }

    rc = ngx_http_m40_get_integer(root, "max_completion_tokens", 1,
                                  mcf->max_tokens_limit, &p->max_tokens, err);
    if (rc == NGX_ERROR) {
        return NGX_ERROR;
    }

    i = 1;
    if (ngx_http_m40_get_integer(root, "n", 1, NGX_HTTP_M40_MAX_N, &i, err)
        == NGX_ERROR)
    {
        return NGX_ERROR;
    }
    p->n = (ngx_uint_t) i;

    if (ngx_http_m40_get_number(root, "temperature", 0.0, 2.0,
                                &p->temperature, err) != NGX_OK
        || ngx_http_m40_get_number(root, "top_p", 0.0, 1.0, &p->top_p, err)
           != NGX_OK
        || ngx_http_m40_get_number(root, "min_p", 0.0, 1.0, &p->min_p, err)
           != NGX_OK
        || ngx_http_m40_get_number(root, "presence_penalty", -2.0, 2.0,
                                   &p->presence_penalty, err) != NGX_OK
        || ngx_http_m40_get_number(root, "frequency_penalty", -2.0, 2.0,
                                   &p->frequency_penalty, err) != NGX_OK)
    {
        return NGX_ERROR;
    }

    if (p->top_p <= 0.0f) {
        /* top_p 0 means "only the most likely token" in practice */
        p->top_p = 1.0f;
        p->top_k = 1;
    }

    i = 0;
    rc = ngx_http_m40_get_integer(root, "top_k", -1, 1000000, &i, err);
    if (rc == NGX_ERROR) {
        return NGX_ERROR;
    }
    if (rc == NGX_OK) {
        p->top_k = i < 0 ? 0 : i;
    }

    v = ngx_http_m40_field(root, "seed");
    if (v != NULL) {
        if (!json_is_integer(v)) {
            ngx_http_m40_bad(err, "seed", "'seed' must be an integer");
            return NGX_ERROR;
        }
        p->has_seed = 1;
        p->seed = (uint64_t) json_integer_value(v);
    }

    if (ngx_http_m40_parse_stop(root, p, err) != NGX_OK
        || ngx_http_m40_parse_logit_bias(r, root, p, err) != NGX_OK)
    {
        return NGX_ERROR;
    }

    if (kind == NGX_HTTP_M40_CHAT) {
        if (ngx_http_m40_get_bool(root, "logprobs", &p->logprobs, err)
            != NGX_OK)
        {
            return NGX_ERROR;
        }

        i = 0;
        rc = ngx_http_m40_get_integer(root, "top_logprobs", 0, 20, &i, err);
        if (rc == NGX_ERROR) {
            return NGX_ERROR;
        }
        p->top_logprobs = i;

        if (rc == NGX_OK && i > 0 && !p->logprobs) {
            ngx_http_m40_bad(err, "top_logprobs",
                             "'top_logprobs' requires 'logprobs' to be true");
            return NGX_ERROR;
        }

    } else {
        /* legacy completions: "logprobs" is the number of alternatives */
        i = 0;
        rc = ngx_http_m40_get_integer(root, "logprobs", 0, 20, &i, err);
        if (rc == NGX_ERROR) {
            return NGX_ERROR;
        }
        if (rc == NGX_OK) {
            p->logprobs = 1;
            p->top_logprobs = i;
        }

        if (ngx_http_m40_get_bool(root, "echo", &p->echo, err) != NGX_OK) {
            return NGX_ERROR;
        }

        if (p->echo && p->logprobs) {
            ngx_http_m40_bad(err, "echo",
                             "'echo' together with 'logprobs' is not "
                             "supported");
            return NGX_ERROR;
        }
    }

    if (ngx_http_m40_get_bool(root, "ignore_eos", &p->ignore_eos, err)
        != NGX_OK)
    {
        return NGX_ERROR;
    }

    if (ngx_http_m40_parse_format(r, root, p, err) != NGX_OK) {
        return NGX_ERROR;
    }

    if (ngx_http_m40_get_bool(root, "stream", &p->stream, err) != NGX_OK) {
        return NGX_ERROR;
    }

    so = ngx_http_m40_field(root, "stream_options");
    if (so != NULL) {
        if (!json_is_object(so)) {
            ngx_http_m40_bad(err, "stream_options",
                             "'stream_options' must be an object");
            return NGX_ERROR;
        }

        if (ngx_http_m40_get_bool(so, "include_usage", &p->include_usage, err)
            != NGX_OK)
        {
            err->param = "stream_options.include_usage";
            return NGX_ERROR;
        }
    }

    if (kind == NGX_HTTP_M40_CHAT
        && ngx_http_m40_parse_tools(root, p, err) != NGX_OK)
    {
        return NGX_ERROR;
    }

    v = ngx_http_m40_field(root, "user");
    if (v != NULL && !json_is_string(v)) {
        ngx_http_m40_bad(err, "user", "'user' must be a string");
        return NGX_ERROR;
    }

    return NGX_OK;
}
