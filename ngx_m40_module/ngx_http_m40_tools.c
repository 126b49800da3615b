/* Tool calling and reasoning on /v1/chat/completions: the request side (tools,
 * tool_choice, parallel_tool_calls, chat_template_kwargs, the tool fields of
 * messages) and the glue between a choice's events and the output parser
 * (engine/m40_chat_parse.h: which convention, which reasoning mode).
 *
 * The definitions reach the chat template as its `tools` variable, exactly as the
 * client sent them (validated); the template decides how the model sees them.
 * tool_choice "required" and a named function are guaranteed by constrained decoding:
 * the named function is the only one the template shows, and the engine compiles a
 * grammar of calls to the tools shown (each call's arguments a sentence of its
 * parameters' JSON Schema) in the markup of the request's parser (Hermes, Llama 3,
 * Mistral, harmony or bare JSON), so even a model that would answer in prose returns a call
 * the parser takes (engine/serve/constrain.c). */
#include "ngx_http_m40_module.h"

#include "m40_chat_parse.h"


#define ngx_http_m40_bad(err, param, ...)                                    \
    ngx_http_m40_error_set(err, NGX_HTTP_BAD_REQUEST,                          \
                           "invalid_request_error", param,                     \
                           "invalid_value", __VA_ARGS__)


/* OpenAI's rule for function names: 1 to 64 of a-z, A-Z, 0-9, '_' and '-'. */
static ngx_int_t
ngx_http_m40_valid_name(const char *s, size_t len)
{
    size_t  i;

    if (len == 0 || len > 64) {
        return 0;
    }

    for (i = 0; i < len; i++) {
        if (!(s[i] == '_' || s[i] == '-' || (s[i] >= '0' && s[i] <= '9')
              || (s[i] >= 'a' && s[i] <= 'z') || (s[i] >= 'A' && s[i] <= 'Z')))
        {
            return 0;
        }
    }

    return 1;
}


static ngx_int_t
ngx_http_m40_check_tool(json_t *t, size_t i, ngx_http_m40_error_t *err)
{
    json_t  *type, *fn, *name, *v;

    type = json_object_get(t, "type");
    if (!json_is_object(t) || !json_is_string(type)
        || ngx_strcmp(json_string_value(type), "function") != 0)
    {
        ngx_http_m40_bad(err, "tools", "tools[%uz] must be an object with "
                         "\"type\": \"function\"", i);
        return NGX_ERROR;
    }

    fn = json_object_get(t, "function");
    if (!json_is_object(fn)) {
        ngx_http_m40_bad(err, "tools", "tools[%uz].function must be an object",
                         i);
        return NGX_ERROR;
    }

    name = json_object_get(fn, "name");
    if (!json_is_string(name)
        || !ngx_http_m40_valid_name(json_string_value(name),
                                    json_string_length(name)))
    {
        ngx_http_m40_bad(err, "tools", "tools[%uz].function.name must be a "
                         "string of 1 to 64 letters, digits, '_' or '-'", i);
        return NGX_ERROR;
    }

    v = json_object_get(fn, "description");
    if (v != NULL && !json_is_null(v) && !json_is_string(v)) {
        ngx_http_m40_bad(err, "tools", "tools[%uz].function.description must "
                         "be a string", i);
        return NGX_ERROR;
    }

    /* A JSON Schema is an object (or true/false, which no client sends for a
     * function's parameters: refusing them keeps templates' `.properties` safe). */
    v = json_object_get(fn, "parameters");
    if (v != NULL && !json_is_null(v) && !json_is_object(v)) {
        ngx_http_m40_bad(err, "tools", "tools[%uz].function.parameters must be "
                         "a JSON Schema object", i);
        return NGX_ERROR;
    }

    if (json_is_object(v)) {
        type = json_object_get(v, "type");
        if (type != NULL && !json_is_string(type) && !json_is_array(type)) {
            ngx_http_m40_bad(err, "tools", "tools[%uz].function.parameters."
                             "type must be a string or an array", i);
            return NGX_ERROR;
        }
        type = json_object_get(v, "properties");
        if (type != NULL && !json_is_object(type)) {
            ngx_http_m40_bad(err, "tools", "tools[%uz].function.parameters."
                             "properties must be an object", i);
            return NGX_ERROR;
        }
        type = json_object_get(v, "required");
        if (type != NULL && !json_is_array(type)) {
            ngx_http_m40_bad(err, "tools", "tools[%uz].function.parameters."
                             "required must be an array", i);
            return NGX_ERROR;
        }
    }

    v = json_object_get(fn, "strict");
    if (v != NULL && !json_is_null(v) && !json_is_boolean(v)) {
        ngx_http_m40_bad(err, "tools", "tools[%uz].function.strict must be a "
                         "boolean", i);
        return NGX_ERROR;
    }

    return NGX_OK;
}


ngx_int_t
ngx_http_m40_parse_tools(json_t *root, ngx_http_m40_params_t *p,
    ngx_http_m40_error_t *err)
{
    size_t       i, k;
    json_t      *tools, *choice, *t, *fn, *name, *v;
    const char  *s, *want;

    p->parallel_tool_calls = 1;
    p->tool_choice = NGX_HTTP_M40_TOOL_CHOICE_AUTO;
    want = NULL;

    tools = json_object_get(root, "tools");
    if (tools != NULL && !json_is_null(tools)) {
        if (!json_is_array(tools)) {
            ngx_http_m40_bad(err, "tools", "'tools' must be an array");
            return NGX_ERROR;
        }

        json_array_foreach(tools, i, t) {
            if (ngx_http_m40_check_tool(t, i, err) != NGX_OK) {
                return NGX_ERROR;
            }

            s = json_string_value(json_object_get(json_object_get(t,
                                                  "function"), "name"));
            for (k = 0; k < i; k++) {
                fn = json_object_get(json_array_get(tools, k), "function");
                if (ngx_strcmp(json_string_value(json_object_get(fn, "name")),
                               s) == 0)
                {
                    ngx_http_m40_bad(err, "tools", "tools[%uz]: the function "
                                     "name \"%s\" is used twice", i, s);
                    return NGX_ERROR;
                }
            }
        }

        if (json_array_size(tools) == 0) {
            tools = NULL;
        }

    } else {
        tools = NULL;
    }

    choice = json_object_get(root, "tool_choice");
    if (choice != NULL && !json_is_null(choice)) {
        if (json_is_string(choice)) {
            s = json_string_value(choice);
            if (ngx_strcmp(s, "auto") == 0) {
                p->tool_choice = NGX_HTTP_M40_TOOL_CHOICE_AUTO;
            } else if (ngx_strcmp(s, "none") == 0) {
                p->tool_choice = NGX_HTTP_M40_TOOL_CHOICE_NONE;
            } else if (ngx_strcmp(s, "required") == 0) {
                p->tool_choice = NGX_HTTP_M40_TOOL_CHOICE_REQUIRED;
            } else {
                ngx_http_m40_bad(err, "tool_choice", "'tool_choice' must be "
                                 "\"none\", \"auto\", \"required\" or "
                                 "{\"type\": \"function\", \"function\": "
                                 "{\"name\": ...}}");
                return NGX_ERROR;
            }

        } else {
            fn = json_object_get(choice, "function");
            name = json_object_get(fn, "name");
            v = json_object_get(choice, "type");
            if (!json_is_object(choice) || !json_is_string(v)
                || ngx_strcmp(json_string_value(v), "function") != 0
                || !json_is_string(name))
            {
                ngx_http_m40_bad(err, "tool_choice", "'tool_choice' must be "
                                 "\"none\", \"auto\", \"required\" or "
                                 "{\"type\": \"function\", \"function\": "
                                 "{\"name\": ...}}");
                return NGX_ERROR;
            }
            p->tool_choice = NGX_HTTP_M40_TOOL_CHOICE_NAMED;
            want = json_string_value(name);
        }

        if (tools == NULL && p->tool_choice >= NGX_HTTP_M40_TOOL_CHOICE_REQUIRED)
        {
            ngx_http_m40_bad(err, "tool_choice", "'tool_choice' %s needs "
                             "'tools'", want ? "naming a function" : "required");
            return NGX_ERROR;
        }
    }

    v = json_object_get(root, "parallel_tool_calls");
    if (v != NULL && !json_is_null(v)) {
        if (!json_is_boolean(v)) {
            ngx_http_m40_bad(err, "parallel_tool_calls",
                             "'parallel_tool_calls' must be a boolean");
            return NGX_ERROR;
        }
        p->parallel_tool_calls = json_is_true(v) ? 1 : 0;
    }

    v = json_object_get(root, "chat_template_kwargs");
    if (v != NULL && !json_is_null(v)) {
        if (!json_is_object(v)) {
            ngx_http_m40_bad(err, "chat_template_kwargs",
                             "'chat_template_kwargs' must be an object");
            return NGX_ERROR;
        }
        p->template_kwargs = json_deep_copy(v);
        if (p->template_kwargs == NULL) {
            goto nomem;
        }
    }

    /* tool_choice none: the template does not see the tools and nothing is parsed
     * as a call (the answer is plain content). */
    if (tools == NULL || p->tool_choice == NGX_HTTP_M40_TOOL_CHOICE_NONE) {
        return NGX_OK;
    }

    if (want == NULL) {
        p->tools = json_deep_copy(tools);
        if (p->tools == NULL) {
            goto nomem;
        }
        return NGX_OK;
    }

    /* A named function: the only one the template shows. */
    json_array_foreach(tools, i, t) {
        fn = json_object_get(t, "function");
        if (ngx_strcmp(json_string_value(json_object_get(fn, "name")), want)
            == 0)
        {
            p->tools = json_pack("[O]", t);
            if (p->tools == NULL) {
                goto nomem;
            }
            return NGX_OK;
        }
    }

    ngx_http_m40_bad(err, "tool_choice", "'tool_choice' names the function "
                     "\"%s\", which is not among 'tools'", want);
    return NGX_ERROR;

nomem:

    ngx_http_m40_error_set(err, NGX_HTTP_INTERNAL_SERVER_ERROR,
                           "server_error", NULL, NULL, "out of memory");
    return NGX_ERROR;
}


/* The fields beyond role and content that templates read: an assistant's tool_calls
 * (arguments stay the client's JSON string; the engine hands templates an object
 * when they can take one), a tool result's tool_call_id and name, and an
 * assistant's reasoning_content (Qwen3's template renders it back). */
ngx_int_t
ngx_http_m40_message_tool_fields(json_t *m, size_t i, const char *role,
    json_t *out, ngx_http_m40_error_t *err)
{
    size_t   k;
    json_t  *calls, *c, *fn, *name, *args, *id, *copy, *v;

    if (ngx_strcmp(role, "tool") == 0) {
        id = json_object_get(m, "tool_call_id");
        if (!json_is_string(id)) {
            ngx_http_m40_bad(err, "messages", "messages[%uz].tool_call_id must "
                             "be a string", i);
            return NGX_ERROR;
        }
        if (json_object_set(out, "tool_call_id", id) != 0) {
            goto nomem;
        }
    }

    v = json_object_get(m, "name");
    if (json_is_string(v) && json_object_set(out, "name", v) != 0) {
        goto nomem;
    }

    if (ngx_strcmp(role, "assistant") != 0) {
        return NGX_OK;
    }

    v = json_object_get(m, "reasoning_content");
    if (json_is_string(v) && json_object_set(out, "reasoning_content", v) != 0) {
        goto nomem;
    }

    calls = json_object_get(m, "tool_calls");
    if (calls == NULL || json_is_null(calls)) {
        return NGX_OK;
    }

    if (!json_is_array(calls)) {
        ngx_http_m40_bad(err, "messages", "messages[%uz].tool_calls must be an "
                         "array", i);
        return NGX_ERROR;
    }

    copy = json_array();
    if (copy == NULL || json_object_set_new(out, "tool_calls", copy) != 0) {
        goto nomem;
    }

    json_array_foreach(calls, k, c) {
        fn = json_object_get(c, "function");
        name = json_object_get(fn, "name");
        args = json_object_get(fn, "arguments");
        id = json_object_get(c, "id");

        if (!json_is_object(c) || !json_is_object(fn) || !json_is_string(name)
            || (args != NULL && !json_is_string(args) && !json_is_object(args))
            || (id != NULL && !json_is_null(id) && !json_is_string(id)))
        {
            ngx_http_m40_bad(err, "messages", "messages[%uz].tool_calls[%uz] "
                             "must be {\"id\", \"type\": \"function\", "
                             "\"function\": {\"name\", \"arguments\"}}", i, k);
            return NGX_ERROR;
        }

        v = json_pack("{s:s,s:{s:O,s:o}}", "type", "function", "function",
                      "name", name, "arguments",
                      args ? json_incref(args) : json_string("{}"));
        if (v == NULL) {
            goto nomem;
        }
        if ((json_is_string(id) && json_object_set(v, "id", id) != 0)
            || json_array_append_new(copy, v) != 0)
        {
            goto nomem;
        }
    }

    return NGX_OK;

nomem:

    ngx_http_m40_error_set(err, NGX_HTTP_INTERNAL_SERVER_ERROR,
                           "server_error", NULL, NULL, "out of memory");
    return NGX_ERROR;
}


/* Decides once per request how its output is parsed. */
void
ngx_http_m40_output_mode(ngx_http_m40_ctx_t *ctx, ngx_http_m40_params_t *p)
{
    const char                *tmpl;
    ngx_uint_t                 fmt;
    ngx_http_m40_main_conf_t  *mcf;

    mcf = ctx->mcf;
    ctx->tool_format = M40_TOOLS_NONE;
    ctx->reasoning = M40_REASONING_INLINE;
    ctx->parallel_tool_calls = p->parallel_tool_calls ? 1 : 0;

    if (ctx->kind != NGX_HTTP_M40_CHAT || mcf->engine == NULL) {
        return;
    }

    tmpl = m40_engine_chat_template(mcf->engine);

    fmt = mcf->tool_parser != NGX_HTTP_M40_TOOL_PARSER_AUTO
          ? mcf->tool_parser : (ngx_uint_t) m40_tool_format_detect(tmpl);

    /* Harmony's channels are the whole output's structure, not only its calls:
     * they are parsed with or without tools. */
    if (p->tools != NULL || fmt == M40_TOOLS_HARMONY) {
        ctx->tool_format = fmt;
    }

    /* Only templates that think get their output split: elsewhere a literal
     * "<think>" in an answer stays an answer. */
    if (m40_template_thinks(tmpl)) {
        ctx->reasoning = mcf->reasoning;
    }

    ctx->parse = ctx->tool_format != M40_TOOLS_NONE
                 || ctx->reasoning != M40_REASONING_INLINE;

    /* m40_tool_format none: no markup to force, the output is content */
    ctx->forced_tools = p->tools != NULL && ctx->tool_format != M40_TOOLS_NONE
                        && !ctx->count_only
                        && (p->tool_choice == NGX_HTTP_M40_TOOL_CHOICE_REQUIRED
                            || p->tool_choice == NGX_HTTP_M40_TOOL_CHOICE_NAMED);
}


ngx_int_t
ngx_http_m40_parser_feed(ngx_http_m40_ctx_t *ctx, ngx_http_m40_choice_t *ch,
    m40_event *ev, m40_piece_cb cb, void *ud)
{
    if (ch->parser == NULL) {
        ch->parser = m40_chat_parse_new((m40_tool_format) ctx->tool_format,
                                        (m40_reasoning_mode) ctx->reasoning,
                                        ev->reasoning_open);
        if (ch->parser == NULL) {
            return NGX_ERROR;
        }
    }

    if (ev->type == M40_EV_DONE) {
        return m40_chat_parse_finish(ch->parser, cb, ud) == 0 ? NGX_OK
                                                               : NGX_ERROR;
    }

    return m40_chat_parse_feed(ch->parser, ev->text ? ev->text : "",
                               ev->text_len, cb, ud) == 0 ? NGX_OK : NGX_ERROR;
}


/* A tool call of the response: {"id", "type", "function": {"name", "arguments"}};
 * the id is "call_" and 24 random letters and digits, as OpenAI's look. */
json_t *
ngx_http_m40_tool_call_json(const m40_piece *pc, ngx_flag_t with_index)
{
    static const char  alnum[] = "abcdefghijklmnopqrstuvwxyz"
                                 "ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
    char               id[5 + 24 + 1];
    ngx_uint_t         i;
    json_t            *c;

    ngx_memcpy(id, "call_", 5);
    for (i = 0; i < 24; i++) {
        id[5 + i] = alnum[(ngx_uint_t) ngx_random() % (sizeof(alnum) - 1)];
    }
    id[29] = '\0';

    c = json_pack("{s:s,s:s,s:{s:s,s:s}}", "id", id, "type", "function",
                  "function", "name", pc->name, "arguments", pc->arguments);
    if (c != NULL && with_index) {
        json_object_set_new(c, "index", json_integer(pc->index));
    }

    return c;
}


void
ngx_http_m40_parser_free(ngx_http_m40_choice_t *ch)
{
    if (ch->parser) {
        m40_chat_parse_free(ch->parser);
        ch->parser = NULL;
    }

    if (ch->tool_calls) {
        json_decref(ch->tool_calls);
        ch->tool_calls = NULL;
    }
}
