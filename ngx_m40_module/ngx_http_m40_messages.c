/* POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API.
 *
 * The request becomes a chat completions request: `system` (a string or text blocks)
 * a system message; each message's blocks: text -> content, an assistant's tool_use
 * -> tool_calls (input as the arguments' JSON), a user's tool_result -> a "tool"
 * message before the user's text; tools ({name, description, input_schema}) and
 * tool_choice (auto, any -> required, tool -> the named function, none;
 * disable_parallel_tool_use) the chat ones; max_tokens (required), stop_sequences,
 * temperature, top_p, top_k as they are; thinking enabled/disabled ->
 * chat_template_kwargs.enable_thinking; output_config.format (a JSON Schema) ->
 * response_format json_schema (constrained decoding). The answer's content blocks come from the
 * output parser's pieces: reasoning -> "thinking", content -> "text", each call ->
 * "tool_use"; stop_reason end_turn, max_tokens, stop_sequence (with the string, which
 * the engine reports) or tool_use. Streaming sends Anthropic's events (message_start,
 * ping, content_block_start/delta/stop with text_delta, thinking_delta and
 * input_json_delta, message_delta with stop_reason and usage, message_stop). Every
 * error has Anthropic's shape: {"type": "error", "error": {"type", "message"}}.
 *
 * count_tokens renders and tokenizes the same request on the engine's tokenizer
 * thread and answers {"input_tokens": N}; nothing runs through the model. */
#include "ngx_http_m40_module.h"


#define ngx_http_m40_bad(err, param, ...)                                    \
    ngx_http_m40_error_set(err, NGX_HTTP_BAD_REQUEST,                          \
                           "invalid_request_error", param,                     \
                           "invalid_value", __VA_ARGS__)

#define NGX_HTTP_M40_BLOCK_NONE      0
#define NGX_HTTP_M40_BLOCK_TEXT      1
#define NGX_HTTP_M40_BLOCK_THINKING  2
#define NGX_HTTP_M40_BLOCK_TOOL_USE  3

typedef struct {
    ngx_uint_t   n_blocks;        /* content blocks started */
    ngx_uint_t   open;            /* NGX_HTTP_M40_BLOCK_* */
    u_char      *blank;           /* content held until a non-blank byte comes */
    size_t       blank_len;
    size_t       blank_cap;
} ngx_http_m40_msg_state_t;


static json_t *
ngx_http_m40_field(json_t *o, const char *name)
{
    json_t  *v;

    v = json_object_get(o, name);
    return (v == NULL || json_is_null(v)) ? NULL : v;
}


/* Anthropic's usage: input_tokens are the prompt tokens the model computed, those the
 * prefix cache held are cache_read_input_tokens (together: count_tokens' number); the
 * cache fills by itself, so nothing counts as a cache creation. */
static json_t *
ngx_http_m40_msg_usage(ngx_http_m40_choice_t *ch, int32_t output_tokens)
{
    return json_pack("{s:i,s:i,s:i,s:i}",
                     "input_tokens",
                     (int) (ch->prompt_tokens - ch->cached_tokens),
                     "cache_creation_input_tokens", 0,
                     "cache_read_input_tokens", (int) ch->cached_tokens,
                     "output_tokens", (int) output_tokens);
}


static ngx_int_t
ngx_http_m40_str_add(json_t **acc, const char *s, size_t len)
{
    size_t   a;
    char    *buf;

    if (*acc == NULL) {
        *acc = json_stringn(s, len);
        return *acc ? NGX_OK : NGX_ERROR;
    }

    a = json_string_length(*acc);
    buf = malloc(a + len + 1);
    if (buf == NULL) {
        return NGX_ERROR;
    }

    ngx_memcpy(buf, json_string_value(*acc), a);
    ngx_memcpy(buf + a, s, len);
    buf[a + len] = '\0';

    if (json_string_setn(*acc, buf, a + len) != 0) {
        free(buf);
        return NGX_ERROR;
    }

    free(buf);
    return NGX_OK;
}


/* A string, or text blocks joined; *out a new string (NULL: nothing). */
static ngx_int_t
ngx_http_m40_blocks_text(json_t *v, const char *what, json_t **out,
    ngx_http_m40_error_t *err)
{
    size_t       k;
    json_t      *b, *t;
    const char  *type;

    *out = NULL;

    if (json_is_string(v)) {
        *out = json_incref(v);
        return NGX_OK;
    }

    if (!json_is_array(v)) {
        ngx_http_m40_bad(err, what, "%s must be a string or an array of text "
                         "blocks", what);
        return NGX_ERROR;
    }

    json_array_foreach(v, k, b) {
        type = json_string_value(json_object_get(b, "type"));
        t = json_object_get(b, "text");
        if (type == NULL || ngx_strcmp(type, "text") != 0 || !json_is_string(t))
        {
            json_decref(*out);
            *out = NULL;
            ngx_http_m40_bad(err, what, "%s[%uz] must be a text block "
                             "({\"type\": \"text\", \"text\": ...})", what, k);
            return NGX_ERROR;
        }

        if (ngx_http_m40_str_add(out, json_string_value(t),
                                 json_string_length(t)) != NGX_OK)
        {
            json_decref(*out);
            *out = NULL;
            goto nomem;
        }
    }

    return NGX_OK;

nomem:

    ngx_http_m40_error_set(err, NGX_HTTP_INTERNAL_SERVER_ERROR, "api_error",
                           NULL, NULL, "out of memory");
    return NGX_ERROR;
}


/* One message of the conversation -> chat messages appended to msgs. */
static ngx_int_t
ngx_http_m40_msg_convert(json_t *msgs, json_t *m, size_t i,
    ngx_http_m40_error_t *err)
{
    char         what[64];
    size_t       k;
    json_t      *content, *b, *text, *calls, *c, *v, *out, *rt;
    ngx_uint_t   user;
    const char  *role, *type;

    role = json_string_value(json_object_get(m, "role"));
    if (!json_is_object(m) || role == NULL
        || (ngx_strcmp(role, "user") != 0 && ngx_strcmp(role, "assistant") != 0))
    {
        ngx_http_m40_bad(err, "messages", "messages.%uz.role must be \"user\" "
                         "or \"assistant\"", i);
        return NGX_ERROR;
    }

    user = ngx_strcmp(role, "user") == 0;
    content = json_object_get(m, "content");
    text = NULL;
    calls = NULL;

    if (json_is_string(content)) {
        text = json_incref(content);

    } else if (!json_is_array(content)) {
        ngx_http_m40_bad(err, "messages", "messages.%uz.content must be a "
                         "string or an array of content blocks", i);
        return NGX_ERROR;
    }

    json_array_foreach(content, k, b) {
        type = json_string_value(json_object_get(b, "type"));
        if (!json_is_object(b) || type == NULL) {
            ngx_http_m40_bad(err, "messages", "messages.%uz.content.%uz must be "
                             "a block with a \"type\"", i, k);
            goto failed;
        }

        if (ngx_strcmp(type, "text") == 0) {
            v = json_object_get(b, "text");
            if (!json_is_string(v)) {
                ngx_http_m40_bad(err, "messages", "messages.%uz.content.%uz."
                                 "text must be a string", i, k);
                goto failed;
            }
            if (ngx_http_m40_str_add(&text, json_string_value(v),
                                     json_string_length(v)) != NGX_OK)
            {
                goto nomem;
            }
            continue;
        }

        if (!user && ngx_strcmp(type, "tool_use") == 0) {
            v = json_object_get(b, "input");
            if (!json_is_string(json_object_get(b, "id"))
                || !json_is_string(json_object_get(b, "name"))
                || !json_is_object(v))
            {
                ngx_http_m40_bad(err, "messages", "messages.%uz.content.%uz: a "
                                 "tool_use block needs a string id and name "
                                 "and an object input", i, k);
                goto failed;
            }

            if (calls == NULL && (calls = json_array()) == NULL) {
                goto nomem;
            }

            /* templates take the arguments as the JSON text clients send */
            {
                char *dump = json_dumps(v, JSON_COMPACT);

                rt = dump ? json_string(dump) : NULL;
                free(dump);
            }
            c = rt == NULL ? NULL
                : json_pack("{s:O,s:s,s:{s:O,s:o}}", "id",
                            json_object_get(b, "id"), "type", "function",
                            "function", "name", json_object_get(b, "name"),
                            "arguments", rt);
            if (c == NULL || json_array_append_new(calls, c) != 0) {
                goto nomem;
            }
            continue;
        }

        if (user && ngx_strcmp(type, "tool_result") == 0) {
            v = json_object_get(b, "tool_use_id");
            if (!json_is_string(v)) {
                ngx_http_m40_bad(err, "messages", "messages.%uz.content.%uz: a "
                                 "tool_result block needs a string "
                                 "tool_use_id", i, k);
                goto failed;
            }

            ngx_snprintf((u_char *) what, sizeof(what) - 1,
                         "messages.%uz.content.%uz.content%Z", i, k);
            rt = NULL;
            c = json_object_get(b, "content");
            if (c != NULL && !json_is_null(c)
                && ngx_http_m40_blocks_text(c, what, &rt, err) != NGX_OK)
            {
                err->param = "messages";
                goto failed;
            }

            /* the result before the user's words of the same turn, as tool
             * messages go in chat templates */
            out = json_pack("{s:s,s:O,s:o}", "role", "tool", "tool_call_id", v,
                            "content", rt ? rt : json_string(""));
            if (out == NULL) {
                goto nomem;
            }

            /* templates that name a result's function find it by the call */
            {
                size_t   a, d;
                json_t  *pm, *pc;

                json_array_foreach(msgs, a, pm) {
                    json_array_foreach(json_object_get(pm, "tool_calls"), d, pc)
                    {
                        if (json_equal(json_object_get(pc, "id"), v)) {
                            json_object_set(out, "name", json_object_get(
                                json_object_get(pc, "function"), "name"));
                        }
                    }
                }
            }

            if (json_array_append_new(msgs, out) != 0) {
                goto nomem;
            }
            continue;
        }

        if (ngx_strcmp(type, "thinking") == 0
            || ngx_strcmp(type, "redacted_thinking") == 0)
        {
            continue;   /* earlier thinking: chat templates drop it too */
        }

        ngx_http_m40_bad(err, "messages", "messages.%uz.content.%uz: blocks of "
                         "type \"%s\" are not supported in %s messages", i, k,
                         type, role);
        goto failed;
    }

    if (text == NULL && calls == NULL) {
        if (user && json_is_array(content) && json_array_size(content) > 0) {
            return NGX_OK;  /* tool results only */
        }
        text = json_string("");
        if (text == NULL) {
            goto nomem;
        }
    }

    out = json_pack("{s:s,s:o}", "role", role,
                    "content", text ? text : json_null());
    text = NULL;
    if (out == NULL) {
        goto nomem;
    }

    if (calls && json_object_set_new(out, "tool_calls", calls) != 0) {
        calls = NULL;
        json_decref(out);
        goto nomem;
    }
    calls = NULL;

    if (json_array_append_new(msgs, out) != 0) {
        goto nomem;
    }

    return NGX_OK;

nomem:

    ngx_http_m40_error_set(err, NGX_HTTP_INTERNAL_SERVER_ERROR, "api_error",
                           NULL, NULL, "out of memory");

failed:

    json_decref(text);
    json_decref(calls);
    return NGX_ERROR;
}


static ngx_int_t
ngx_http_m40_msg_tools(json_t *body, json_t *chat, ngx_http_m40_error_t *err)
{
    size_t       i;
    json_t      *tools, *t, *fn, *v, *out;
    const char  *type;

    tools = ngx_http_m40_field(body, "tools");
    if (tools != NULL) {
        if (!json_is_array(tools)) {
            ngx_http_m40_bad(err, "tools", "tools must be an array");
            return NGX_ERROR;
        }

        out = json_array();
        if (out == NULL || json_object_set_new(chat, "tools", out) != 0) {
            goto nomem;
        }

        json_array_foreach(tools, i, t) {
            type = json_string_value(json_object_get(t, "type"));
            if (!json_is_object(t)
                || (type != NULL && ngx_strcmp(type, "custom") != 0))
            {
                ngx_http_m40_bad(err, "tools", "tools.%uz: only client tools "
                                 "({name, description, input_schema}) are "
                                 "supported", i);
                return NGX_ERROR;
            }

            v = json_object_get(t, "input_schema");
            if (!json_is_object(v)) {
                ngx_http_m40_bad(err, "tools", "tools.%uz.input_schema must be "
                                 "a JSON Schema object", i);
                return NGX_ERROR;
            }

            /* name and description are checked as the chat request's are; in
             * OpenAI's order (templates dump the definitions as they are) */
            fn = json_pack("{s:O}", "name",
                           json_object_get(t, "name") ? json_object_get(t, "name")
                                                      : json_null());
            if (fn == NULL) {
                goto nomem;
            }
            if (json_object_get(t, "description") != NULL) {
                json_object_set(fn, "description",
                                json_object_get(t, "description"));
            }
            json_object_set(fn, "parameters", v);

            if (json_array_append_new(out, json_pack("{s:s,s:o}", "type",
                                                     "function", "function",
                                                     fn))
                != 0)
            {
                goto nomem;
            }
        }
    }

    v = ngx_http_m40_field(body, "tool_choice");
    if (v != NULL) {
        type = json_string_value(json_object_get(v, "type"));
        if (!json_is_object(v) || type == NULL) {
            ngx_http_m40_bad(err, "tool_choice", "tool_choice must be an object "
                             "with a \"type\" (auto, any, tool or none)");
            return NGX_ERROR;
        }

        t = json_object_get(v, "disable_parallel_tool_use");
        if (t != NULL && !json_is_null(t)) {
            if (!json_is_boolean(t)) {
                ngx_http_m40_bad(err, "tool_choice", "tool_choice."
                                 "disable_parallel_tool_use must be a boolean");
                return NGX_ERROR;
            }
            json_object_set_new(chat, "parallel_tool_calls",
                                json_boolean(!json_is_true(t)));
        }

        if (ngx_strcmp(type, "auto") == 0 || ngx_strcmp(type, "none") == 0) {
            out = json_string(type);

        } else if (ngx_strcmp(type, "any") == 0) {
            out = json_string("required");

        } else if (ngx_strcmp(type, "tool") == 0
                   && json_is_string(json_object_get(v, "name")))
        {
            out = json_pack("{s:s,s:{s:O}}", "type", "function", "function",
                            "name", json_object_get(v, "name"));

        } else {
            ngx_http_m40_bad(err, "tool_choice", "tool_choice.type must be "
                             "\"auto\", \"any\", \"none\" or \"tool\" (with a "
                             "name)");
            return NGX_ERROR;
        }

        if (out == NULL || json_object_set_new(chat, "tool_choice", out) != 0) {
            goto nomem;
        }
    }

    return NGX_OK;

nomem:

    ngx_http_m40_error_set(err, NGX_HTTP_INTERNAL_SERVER_ERROR, "api_error",
                           NULL, NULL, "out of memory");
    return NGX_ERROR;
}


static json_t *
ngx_http_m40_msg_convert_request(ngx_http_m40_ctx_t *ctx, json_t *body,
    ngx_http_m40_error_t *err)
{
    size_t                     i;
    double                     d;
    json_t                    *chat, *msgs, *v, *m, *sys;
    const char                *type;
    ngx_http_m40_msg_state_t  *st;

    /* seed is not Anthropic's: taken for reproducible tests */
    static const char  *copied[] = { "model", "top_p", "top_k", "stream",
                                     "seed", NULL };

    st = ngx_pcalloc(ctx->request->pool, sizeof(ngx_http_m40_msg_state_t));
    if (st == NULL) {
        goto nomem;
    }
    ctx->dstate = st;

    chat = json_object();
    msgs = json_array();
    if (chat == NULL || msgs == NULL
        || json_object_set_new(chat, "messages", msgs) != 0)
    {
        json_decref(chat);
        goto nomem;
    }

    v = ngx_http_m40_field(body, "max_tokens");
    if (ctx->count_only) {
        json_object_set_new(chat, "max_tokens", json_integer(1));

    } else if (v == NULL) {
        ngx_http_m40_bad(err, "max_tokens", "max_tokens: Field required");
        goto failed;

    } else if (!json_is_integer(v) || json_integer_value(v) < 1) {
        ngx_http_m40_bad(err, "max_tokens", "max_tokens must be a positive "
                         "integer");
        goto failed;

    } else {
        json_object_set(chat, "max_tokens", v);
    }

    v = ngx_http_m40_field(body, "system");
    if (v != NULL) {
        if (ngx_http_m40_blocks_text(v, "system", &sys, err) != NGX_OK) {
            goto failed;
        }
        if (json_array_append_new(msgs, json_pack("{s:s,s:o}", "role",
                                                  "system", "content",
                                                  sys ? sys : json_string("")))
            != 0)
        {
            goto nomem_chat;
        }
    }

    v = ngx_http_m40_field(body, "messages");
    if (!json_is_array(v) || json_array_size(v) == 0) {
        ngx_http_m40_bad(err, "messages", "messages must be a non-empty array");
        goto failed;
    }

    json_array_foreach(v, i, m) {
        if (ngx_http_m40_msg_convert(msgs, m, i, err) != NGX_OK) {
            goto failed;
        }
    }

    for (i = 0; copied[i]; i++) {
        v = json_object_get(body, copied[i]);
        if (v != NULL && json_object_set(chat, copied[i], v) != 0) {
            goto nomem_chat;
        }
    }

    if (ctx->count_only) {
        json_object_del(chat, "stream");
    }

    v = ngx_http_m40_field(body, "temperature");
    if (v != NULL) {
        d = json_is_number(v) ? json_number_value(v) : -1;
        if (!(d >= 0.0 && d <= 1.0)) {
            ngx_http_m40_bad(err, "temperature", "temperature must be a number "
                             "between 0 and 1");
            goto failed;
        }
        json_object_set(chat, "temperature", v);
    }

    v = ngx_http_m40_field(body, "stop_sequences");
    if (v != NULL) {
        if (!json_is_array(v) || json_array_size(v) > NGX_HTTP_M40_MAX_STOP) {
            ngx_http_m40_bad(err, "stop_sequences", "stop_sequences must be an "
                             "array of at most %d strings",
                             NGX_HTTP_M40_MAX_STOP);
            goto failed;
        }
        json_array_foreach(v, i, m) {
            if (!json_is_string(m) || json_string_length(m) == 0) {
                ngx_http_m40_bad(err, "stop_sequences", "stop_sequences.%uz "
                                 "must be a non-empty string", i);
                goto failed;
            }
        }
        if (json_array_size(v) && json_object_set(chat, "stop", v) != 0) {
            goto nomem_chat;
        }
    }

    v = ngx_http_m40_field(body, "thinking");
    if (v != NULL) {
        type = json_string_value(json_object_get(v, "type"));
        if (type == NULL || (ngx_strcmp(type, "enabled") != 0
                             && ngx_strcmp(type, "disabled") != 0))
        {
            ngx_http_m40_bad(err, "thinking", "thinking.type must be "
                             "\"enabled\" or \"disabled\"");
            goto failed;
        }
        json_object_set_new(chat, "chat_template_kwargs",
                            json_pack("{s:b}", "enable_thinking",
                                      ngx_strcmp(type, "enabled") == 0));
    }

    /* structured outputs: output_config.format {"type": "json_schema", "schema"} */
    v = ngx_http_m40_field(ngx_http_m40_field(body, "output_config"), "format");
    if (v != NULL) {
        type = json_string_value(json_object_get(v, "type"));
        m = json_object_get(v, "schema");
        if (type == NULL || ngx_strcmp(type, "json_schema") != 0
            || !json_is_object(m))
        {
            ngx_http_m40_bad(err, "output_config", "output_config.format must "
                             "be {\"type\": \"json_schema\", \"schema\": "
                             "{...}}");
            goto failed;
        }
        if (json_object_set_new(chat, "response_format",
                                json_pack("{s:s,s:{s:s,s:O}}", "type",
                                          "json_schema", "json_schema", "name",
                                          "output", "schema", m))
            != 0)
        {
            goto nomem_chat;
        }
    }

    if (ngx_http_m40_msg_tools(body, chat, err) != NGX_OK) {
        goto failed;
    }

    return chat;

nomem_chat:

    json_decref(chat);

nomem:

    ngx_http_m40_error_set(err, NGX_HTTP_INTERNAL_SERVER_ERROR, "api_error",
                           NULL, NULL, "out of memory");
    return NULL;

failed:

    json_decref(chat);
    return NULL;
}


static json_t *
ngx_http_m40_msg_request(ngx_http_m40_ctx_t *ctx, json_t *body,
    ngx_http_m40_error_t *err)
{
    return ngx_http_m40_msg_convert_request(ctx, body, err);
}


static json_t *
ngx_http_m40_count_request(ngx_http_m40_ctx_t *ctx, json_t *body,
    ngx_http_m40_error_t *err)
{
    ctx->count_only = 1;
    return ngx_http_m40_msg_convert_request(ctx, body, err);
}


/* Anthropic's error type of an HTTP status (also for nginx's own error pages on
 * these paths, ngx_http_m40_errors.c). */
const char *
ngx_http_m40_anthropic_error_type(ngx_uint_t status)
{
    const char  *type;

    switch (status) {
    case NGX_HTTP_BAD_REQUEST:
        type = "invalid_request_error";
        break;
    case NGX_HTTP_UNAUTHORIZED:
        type = "authentication_error";
        break;
    case NGX_HTTP_FORBIDDEN:
        type = "permission_error";
        break;
    case NGX_HTTP_NOT_FOUND:
        type = "not_found_error";
        break;
    case NGX_HTTP_REQUEST_ENTITY_TOO_LARGE:
        type = "request_too_large";
        break;
    case NGX_HTTP_TOO_MANY_REQUESTS:
        type = "rate_limit_error";
        break;
    case NGX_HTTP_SERVICE_UNAVAILABLE:
        type = "overloaded_error";
        break;
    default:
        type = status < 500 ? "invalid_request_error" : "api_error";
        break;
    }

    return type;
}


/* {"type": "error", "error": {"type", "message"}}: the type from the status */
static json_t *
ngx_http_m40_msg_error_json(ngx_http_m40_error_t *err)
{
    return json_pack("{s:s,s:{s:s,s:o}}", "type", "error", "error",
                     "type", ngx_http_m40_anthropic_error_type(err->status),
                     "message",
                     ngx_http_m40_json_text(err->message,
                                            ngx_strlen(err->message)));
}


/* ---- the answer ---- */

static ngx_uint_t
ngx_http_m40_blank(const u_char *p, size_t n)
{
    size_t  i;

    for (i = 0; i < n; i++) {
        if (p[i] != ' ' && p[i] != '\n' && p[i] != '\r' && p[i] != '\t') {
            return 0;
        }
    }

    return 1;
}


static const char *
ngx_http_m40_stop_reason(ngx_http_m40_ctx_t *ctx, ngx_http_m40_choice_t *ch,
    json_t **seq)
{
    json_t  *v;

    *seq = json_null();

    if (ch->finish == M40_FINISH_LENGTH) {
        return "max_tokens";
    }

    if (ch->n_tool_calls > 0) {
        return "tool_use";
    }

    if (ch->stop_matched > 0) {
        v = json_array_get(ngx_http_m40_field(ctx->body, "stop_sequences"),
                           ch->stop_matched - 1);
        if (v != NULL) {
            *seq = json_incref(v);
            return "stop_sequence";
        }
    }

    return "end_turn";
}


/* A tool_use block: the call's arguments as the input object ({} if the model's
 * text is not an object: it comes from the parser, which only takes objects). */
static json_t *
ngx_http_m40_tool_use(json_t *call, ngx_flag_t with_input)
{
    char         id[64];
    json_t      *fn, *input;
    const char  *cid;

    fn = json_object_get(call, "function");
    cid = json_string_value(json_object_get(call, "id"));
    *ngx_snprintf((u_char *) id, sizeof(id) - 1, "toolu_%s",
                  cid ? cid + 5 : "") = '\0';   /* after "call_" */

    input = with_input
            ? json_loads(json_string_value(json_object_get(fn, "arguments")), 0,
                         NULL)
            : NULL;
    if (!json_is_object(input)) {
        json_decref(input);
        input = json_object();
    }

    return json_pack("{s:s,s:s,s:O,s:o}", "type", "tool_use", "id", id,
                     "name", json_object_get(fn, "name"), "input", input);
}


static ngx_int_t
ngx_http_m40_msg_send(ngx_http_m40_ctx_t *ctx)
{
    size_t                  i;
    json_t                 *content, *b, *call, *root, *seq;
    ngx_int_t               rc;
    const char             *reason;
    ngx_http_m40_choice_t  *ch;
    u_char                  id[64];

    ch = &ctx->choices[0];

    content = json_array();
    if (content == NULL) {
        return NGX_HTTP_INTERNAL_SERVER_ERROR;
    }

    if (ch->reasoning_len) {
        b = json_pack("{s:s,s:o,s:s}", "type", "thinking", "thinking",
                      ngx_http_m40_json_text((const char *) ch->reasoning,
                                             ch->reasoning_len),
                      "signature", "");
        if (b == NULL || json_array_append_new(content, b) != 0) {
            goto failed;
        }
    }

    /* blanks around tool calls are no answer; alone they are one */
    if (ch->text_len > 0
        && (ch->tool_calls == NULL || !ngx_http_m40_blank(ch->text, ch->text_len)))
    {
        b = json_pack("{s:s,s:o}", "type", "text", "text",
                      ngx_http_m40_json_text((const char *) ch->text,
                                             ch->text_len));
        if (b == NULL || json_array_append_new(content, b) != 0) {
            goto failed;
        }
    }

    json_array_foreach(ch->tool_calls, i, call) {
        b = ngx_http_m40_tool_use(call, 1);
        if (b == NULL || json_array_append_new(content, b) != 0) {
            goto failed;
        }
    }

    reason = ngx_http_m40_stop_reason(ctx, ch, &seq);
    *ngx_snprintf(id, sizeof(id) - 1, "msg_%s", ctx->id) = '\0';

    root = json_pack("{s:s,s:s,s:s,s:s%,s:o,s:s,s:o,s:o}",
                     "id", (char *) id, "type", "message", "role", "assistant",
                     "model", (const char *) ctx->model->model_name.data,
                     (size_t) ctx->model->model_name.len,
                     "content", content,
                     "stop_reason", reason,
                     "stop_sequence", seq,
                     "usage", ngx_http_m40_msg_usage(ch, ch->completion_tokens));
    if (root == NULL) {
        return NGX_HTTP_INTERNAL_SERVER_ERROR;
    }

    rc = ngx_http_m40_send_json(ctx->request, NGX_HTTP_OK, root);
    json_decref(root);

    return rc;

failed:

    json_decref(content);
    return NGX_HTTP_INTERNAL_SERVER_ERROR;
}


static ngx_int_t
ngx_http_m40_count_send(ngx_http_m40_ctx_t *ctx)
{
    ngx_int_t   rc;
    json_t     *root;

    root = json_pack("{s:i}", "input_tokens",
                     (int) ctx->choices[0].prompt_tokens);
    if (root == NULL) {
        return NGX_HTTP_INTERNAL_SERVER_ERROR;
    }

    rc = ngx_http_m40_send_json(ctx->request, NGX_HTTP_OK, root);
    json_decref(root);

    return rc;
}


/* ---- streaming ---- */

/* Sends event `type` (its data's "type" too); takes data. */
static ngx_int_t
ngx_http_m40_msg_event(ngx_http_m40_sse_t *out, const char *type, json_t *data)
{
    if (data == NULL) {
        return NGX_ERROR;
    }

    json_object_set_new(data, "type", json_string(type));

    return ngx_http_m40_sse_event(out, type, data);
}


static ngx_int_t
ngx_http_m40_msg_open(ngx_http_m40_sse_t *out)
{
    u_char  id[64];

    *ngx_snprintf(id, sizeof(id) - 1, "msg_%s", out->ctx->id) = '\0';

    if (ngx_http_m40_msg_event(out, "message_start",
            json_pack("{s:{s:s,s:s,s:s,s:s%,s:[],s:n,s:n,s:o}}",
                      "message", "id", (char *) id, "type", "message",
                      "role", "assistant",
                      "model", (const char *) out->ctx->model->model_name.data,
                      (size_t) out->ctx->model->model_name.len,
                      "content", "stop_reason", "stop_sequence",
                      "usage", ngx_http_m40_msg_usage(out->ch, 0)))
        != NGX_OK)
    {
        return NGX_ERROR;
    }

    return ngx_http_m40_msg_event(out, "ping", json_object());
}


static ngx_int_t
ngx_http_m40_msg_close_block(ngx_http_m40_sse_t *out)
{
    ngx_http_m40_msg_state_t  *st;

    st = out->ctx->dstate;

    if (st->open == NGX_HTTP_M40_BLOCK_NONE) {
        return NGX_OK;
    }

    st->open = NGX_HTTP_M40_BLOCK_NONE;

    return ngx_http_m40_msg_event(out, "content_block_stop",
               json_pack("{s:I}", "index", (json_int_t) (st->n_blocks - 1)));
}


static ngx_int_t
ngx_http_m40_msg_delta(ngx_http_m40_sse_t *out, ngx_uint_t kind,
    const char *text, size_t len)
{
    json_t                    *t;
    ngx_http_m40_msg_state_t  *st;

    st = out->ctx->dstate;

    if (st->open != kind) {
        if (ngx_http_m40_msg_close_block(out) != NGX_OK
            || ngx_http_m40_msg_event(out, "content_block_start",
                   json_pack("{s:I,s:o}", "index", (json_int_t) st->n_blocks,
                             "content_block",
                             kind == NGX_HTTP_M40_BLOCK_TEXT
                             ? json_pack("{s:s,s:s}", "type", "text",
                                         "text", "")
                             : json_pack("{s:s,s:s,s:s}", "type", "thinking",
                                         "thinking", "", "signature", "")))
               != NGX_OK)
        {
            return NGX_ERROR;
        }
        st->n_blocks++;
        st->open = kind;
    }

    t = ngx_http_m40_json_text(text, len);
    if (t == NULL) {
        return NGX_ERROR;
    }

    return ngx_http_m40_msg_event(out, "content_block_delta",
               json_pack("{s:I,s:{s:s,s:o}}",
                         "index", (json_int_t) (st->n_blocks - 1), "delta",
                         "type", kind == NGX_HTTP_M40_BLOCK_TEXT
                                 ? "text_delta" : "thinking_delta",
                         kind == NGX_HTTP_M40_BLOCK_TEXT ? "text" : "thinking",
                         t));
}


/* A tool_use block streamed as the call is written: content_block_start (input {})
 * when its name is known, an input_json_delta for each fragment of its arguments,
 * content_block_stop at its end. */
static ngx_int_t
ngx_http_m40_msg_call(ngx_http_m40_sse_t *out, const m40_piece *pc)
{
    json_t                    *call, *block, *t;
    ngx_uint_t                 index;
    ngx_http_m40_msg_state_t  *st;

    st = out->ctx->dstate;

    if (pc->kind == M40_PIECE_TOOL_BEGIN) {
        if (ngx_http_m40_msg_close_block(out) != NGX_OK) {
            return NGX_ERROR;
        }

        call = ngx_http_m40_tool_call_json(pc, 0);
        block = call ? ngx_http_m40_tool_use(call, 0) : NULL;
        json_decref(call);

        index = st->n_blocks++;
        st->open = NGX_HTTP_M40_BLOCK_TOOL_USE;

        return ngx_http_m40_msg_event(out, "content_block_start",
                   block == NULL ? NULL
                   : json_pack("{s:I,s:o}", "index", (json_int_t) index,
                               "content_block", block));
    }

    if (st->open != NGX_HTTP_M40_BLOCK_TOOL_USE) {
        return NGX_ERROR;   /* the parser gives a call's pieces in order */
    }

    if (pc->kind == M40_PIECE_TOOL_ARGS) {
        t = ngx_http_m40_json_text(pc->text, pc->len);

        return ngx_http_m40_msg_event(out, "content_block_delta",
                   t == NULL ? NULL
                   : json_pack("{s:I,s:{s:s,s:o}}",
                               "index", (json_int_t) (st->n_blocks - 1),
                               "delta", "type", "input_json_delta",
                               "partial_json", t));
    }

    return ngx_http_m40_msg_close_block(out);   /* TOOL_CALL: the end */
}


static int
ngx_http_m40_msg_piece(void *ud, const m40_piece *pc)
{
    ngx_http_m40_sse_t *out = ud;

    ngx_http_m40_msg_state_t  *st;

    st = out->ctx->dstate;

    switch (pc->kind) {

    case M40_PIECE_REASONING:
        return ngx_http_m40_msg_delta(out, NGX_HTTP_M40_BLOCK_THINKING,
                                      pc->text, pc->len) == NGX_OK ? 0 : -1;

    case M40_PIECE_CONTENT:
        if (st->open != NGX_HTTP_M40_BLOCK_TEXT
            && ngx_http_m40_blank((const u_char *) pc->text, pc->len))
        {
            /* held: blanks alone (around calls) make no text block */
            return ngx_http_m40_append(out->ctx->request, &st->blank,
                                       &st->blank_len, &st->blank_cap,
                                       pc->text, pc->len) == NGX_OK ? 0 : -1;
        }

        if (st->open != NGX_HTTP_M40_BLOCK_TEXT && st->blank_len) {
            if (ngx_http_m40_msg_delta(out, NGX_HTTP_M40_BLOCK_TEXT,
                                       (const char *) st->blank,
                                       st->blank_len)
                != NGX_OK)
            {
                return -1;
            }
            st->blank_len = 0;
        }

        return ngx_http_m40_msg_delta(out, NGX_HTTP_M40_BLOCK_TEXT, pc->text,
                                      pc->len) == NGX_OK ? 0 : -1;

    default:
        if (!out->ctx->parallel_tool_calls && pc->index > 0) {
            return 0;   /* disable_parallel_tool_use: the first call only */
        }
        if (pc->kind == M40_PIECE_TOOL_BEGIN) {
            out->ch->n_tool_calls++;
            st->blank_len = 0;
        }
        return ngx_http_m40_msg_call(out, pc) == NGX_OK ? 0 : -1;
    }
}


static ngx_int_t
ngx_http_m40_msg_done(ngx_http_m40_sse_t *out)
{
    json_t                    *seq;
    const char                *reason;
    ngx_http_m40_msg_state_t  *st;

    st = out->ctx->dstate;

    /* blanks held for a call that never came: they are the answer */
    if (st->blank_len && out->ch->n_tool_calls == 0
        && st->open != NGX_HTTP_M40_BLOCK_TEXT
        && ngx_http_m40_msg_delta(out, NGX_HTTP_M40_BLOCK_TEXT,
                                  (const char *) st->blank, st->blank_len)
           != NGX_OK)
    {
        return NGX_ERROR;
    }

    if (ngx_http_m40_msg_close_block(out) != NGX_OK) {
        return NGX_ERROR;
    }

    reason = ngx_http_m40_stop_reason(out->ctx, out->ch, &seq);

    if (ngx_http_m40_msg_event(out, "message_delta",
            json_pack("{s:{s:s,s:o},s:o}", "delta",
                      "stop_reason", reason, "stop_sequence", seq,
                      "usage", ngx_http_m40_msg_usage(out->ch,
                                                      out->ch->completion_tokens)))
        != NGX_OK)
    {
        return NGX_ERROR;
    }

    return ngx_http_m40_msg_event(out, "message_stop", json_object());
}


static ngx_int_t
ngx_http_m40_msg_fail(ngx_http_m40_sse_t *out, ngx_http_m40_error_t *err)
{
    return ngx_http_m40_sse_event(out, "error",
                                  ngx_http_m40_msg_error_json(err));
}


const ngx_http_m40_dialect_t  ngx_http_m40_messages_dialect = {
    "messages",
    ngx_http_m40_msg_request,
    ngx_http_m40_msg_error_json,
    ngx_http_m40_msg_send,
    ngx_http_m40_msg_open,
    ngx_http_m40_msg_piece,
    ngx_http_m40_msg_done,
    ngx_http_m40_msg_fail,
};


const ngx_http_m40_dialect_t  ngx_http_m40_count_tokens_dialect = {
    "count_tokens",
    ngx_http_m40_count_request,
    ngx_http_m40_msg_error_json,
    ngx_http_m40_count_send,
    ngx_http_m40_msg_open,
    ngx_http_m40_msg_piece,
    ngx_http_m40_msg_done,
    ngx_http_m40_msg_fail,
};
