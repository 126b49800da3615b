/* POST /v1/responses: the OpenAI Responses API, stateless (store false: no server-side
 * history, so previous_response_id and item references are refused).
 *
 * The request becomes a chat completions request: `instructions` a system message,
 * `input` (a string, or items: messages with text parts, function_call and
 * function_call_output) the messages, function `tools` and `tool_choice` the chat
 * ones, `text.format` the response_format, max_output_tokens max_tokens. The answer
 * is built from the output parser's pieces: reasoning -> a "reasoning" item, content
 * -> a "message" item with one output_text part, each tool call -> a "function_call"
 * item. Streaming sends the typed events the official SDK parses (response.created,
 * response.in_progress, response.output_item.added, response.content_part.added,
 * response.output_text.delta, ..., response.completed), each with its
 * sequence_number. Errors keep OpenAI's shape ({"error": {...}}); one after the
 * stream started is an "error" event. */
#include "ngx_http_m40_module.h"


#define ngx_http_m40_bad(err, param, ...)                                    \
    ngx_http_m40_error_set(err, NGX_HTTP_BAD_REQUEST,                          \
                           "invalid_request_error", param,                     \
                           "invalid_value", __VA_ARGS__)

/* the item open in a stream */
#define NGX_HTTP_M40_ITEM_NONE       0
#define NGX_HTTP_M40_ITEM_MESSAGE    1
#define NGX_HTTP_M40_ITEM_REASONING  2

typedef struct {
    json_t      *output;          /* items finished so far (streaming) */
    ngx_uint_t   seq;             /* the next sequence_number */
    ngx_uint_t   open;            /* NGX_HTTP_M40_ITEM_* */
    char         item_id[48];
    u_char      *text;            /* the open item's text so far */
    size_t       text_len;
    size_t       text_cap;
    u_char      *blank;           /* content held until a non-blank byte comes:
                                     blanks around calls make no message */
    size_t       blank_len;
    size_t       blank_cap;
    json_t      *call;            /* the call being streamed (its tool_call JSON) */
    char         call_item[64];   /* its item id */
    ngx_uint_t   call_index;      /* its output_index */
} ngx_http_m40_resp_state_t;


static int json_string_append(json_t *s, json_t *t);


static void
ngx_http_m40_resp_cleanup(void *data)
{
    ngx_http_m40_resp_state_t *st = data;

    if (st->output) {
        json_decref(st->output);
        st->output = NULL;
    }

    if (st->call) {
        json_decref(st->call);
        st->call = NULL;
    }
}


/* A field present and not null. */
static json_t *
ngx_http_m40_field(json_t *o, const char *name)
{
    json_t  *v;

    v = json_object_get(o, name);
    return (v == NULL || json_is_null(v)) ? NULL : v;
}


/* Text of a content given as a string or as parts ({"type": "input_text" |
 * "output_text" | "text", "text"}); a new string, or NULL with err set. */
static json_t *
ngx_http_m40_resp_text(json_t *content, const char *what, size_t i,
    ngx_http_m40_error_t *err)
{
    size_t       k;
    json_t      *part, *t, *text;
    const char  *type;

    if (json_is_string(content)) {
        return json_incref(content);
    }

    if (!json_is_array(content)) {
        ngx_http_m40_bad(err, "input", "input[%uz].%s must be a string or an "
                         "array of text parts", i, what);
        return NULL;
    }

    text = json_string("");
    if (text == NULL) {
        return NULL;
    }

    json_array_foreach(content, k, part) {
        type = json_string_value(json_object_get(part, "type"));
        t = json_object_get(part, "text");

        if (type == NULL || !json_is_string(t)
            || (ngx_strcmp(type, "input_text") != 0
                && ngx_strcmp(type, "output_text") != 0
                && ngx_strcmp(type, "text") != 0))
        {
            json_decref(text);
            ngx_http_m40_bad(err, "input", "input[%uz].%s[%uz]: only text "
                             "parts ({\"type\": \"input_text\", \"text\": ...}) "
                             "are supported%s%s", i, what, k,
                             type ? ", not " : "", type ? type : "");
            return NULL;
        }

        if (json_string_append(text, t) != 0) {
            json_decref(text);
            return NULL;
        }
    }

    return text;
}


/* jansson has no string concatenation of its own */
static int
json_string_append(json_t *s, json_t *t)
{
    size_t   a, b;
    char    *buf;
    int      rc;

    a = json_string_length(s);
    b = json_string_length(t);

    buf = malloc(a + b + 1);
    if (buf == NULL) {
        return -1;
    }

    ngx_memcpy(buf, json_string_value(s), a);
    ngx_memcpy(buf + a, json_string_value(t), b);
    buf[a + b] = '\0';

    rc = json_string_setn(s, buf, a + b);
    free(buf);

    return rc;
}


/* The last message, when it is the assistant's (function calls join it). */
static json_t *
ngx_http_m40_resp_assistant(json_t *msgs)
{
    json_t  *m;

    m = json_array_get(msgs, json_array_size(msgs) - 1);
    if (m == NULL
        || ngx_strcmp(json_string_value(json_object_get(m, "role")),
                      "assistant") != 0)
    {
        m = json_pack("{s:s,s:n}", "role", "assistant", "content");
        if (m == NULL || json_array_append_new(msgs, m) != 0) {
            return NULL;
        }
    }

    return m;
}


static ngx_int_t
ngx_http_m40_resp_item(json_t *msgs, json_t *item, size_t i,
    ngx_http_m40_error_t *err)
{
    size_t       k;
    json_t      *role, *content, *text, *m, *calls, *c, *v, *id, *name;
    const char  *type, *r;

    type = json_string_value(json_object_get(item, "type"));
    role = json_object_get(item, "role");

    if (!json_is_object(item)) {
        ngx_http_m40_bad(err, "input", "input[%uz] must be an object", i);
        return NGX_ERROR;
    }

    if (type == NULL ? json_is_string(role) : ngx_strcmp(type, "message") == 0)
    {
        r = json_string_value(role);
        if (r == NULL
            || (ngx_strcmp(r, "user") != 0 && ngx_strcmp(r, "assistant") != 0
                && ngx_strcmp(r, "system") != 0
                && ngx_strcmp(r, "developer") != 0))
        {
            ngx_http_m40_bad(err, "input", "input[%uz].role must be \"user\", "
                             "\"assistant\", \"system\" or \"developer\"", i);
            return NGX_ERROR;
        }

        content = json_object_get(item, "content");
        text = ngx_http_m40_resp_text(content, "content", i, err);
        if (text == NULL) {
            return NGX_ERROR;
        }

        /* developer messages are the system prompt of chat templates */
        m = json_pack("{s:s,s:o}", "role",
                      ngx_strcmp(r, "developer") == 0 ? "system" : r,
                      "content", text);
        if (m == NULL || json_array_append_new(msgs, m) != 0) {
            goto nomem;
        }
        return NGX_OK;
    }

    if (type == NULL) {
        ngx_http_m40_bad(err, "input", "input[%uz] needs a \"type\" (or a "
                         "\"role\")", i);
        return NGX_ERROR;
    }

    if (ngx_strcmp(type, "function_call") == 0) {
        id = json_object_get(item, "call_id");
        name = json_object_get(item, "name");
        v = json_object_get(item, "arguments");
        if (!json_is_string(id) || !json_is_string(name) || !json_is_string(v))
        {
            ngx_http_m40_bad(err, "input", "input[%uz]: a function_call needs "
                             "string call_id, name and arguments", i);
            return NGX_ERROR;
        }

        m = ngx_http_m40_resp_assistant(msgs);
        if (m == NULL) {
            goto nomem;
        }

        calls = json_object_get(m, "tool_calls");
        if (calls == NULL) {
            calls = json_array();
            if (calls == NULL
                || json_object_set_new(m, "tool_calls", calls) != 0)
            {
                goto nomem;
            }
        }

        c = json_pack("{s:O,s:s,s:{s:O,s:O}}", "id", id, "type", "function",
                      "function", "name", name, "arguments", v);
        if (c == NULL || json_array_append_new(calls, c) != 0) {
            goto nomem;
        }
        return NGX_OK;
    }

    if (ngx_strcmp(type, "function_call_output") == 0) {
        id = json_object_get(item, "call_id");
        if (!json_is_string(id)) {
            ngx_http_m40_bad(err, "input", "input[%uz]: a function_call_output "
                             "needs a string call_id", i);
            return NGX_ERROR;
        }

        text = ngx_http_m40_resp_text(json_object_get(item, "output"), "output",
                                      i, err);
        if (text == NULL) {
            return NGX_ERROR;
        }

        m = json_pack("{s:s,s:O,s:o}", "role", "tool", "tool_call_id", id,
                      "content", text);
        if (m == NULL) {
            goto nomem;
        }

        /* templates that name a tool result's function find it by the call */
        json_array_foreach(msgs, k, v) {
            size_t  j;

            calls = json_object_get(v, "tool_calls");
            json_array_foreach(calls, j, c) {
                if (json_equal(json_object_get(c, "id"), id)) {
                    json_object_set(m, "name", json_object_get(
                        json_object_get(c, "function"), "name"));
                }
            }
        }

        if (json_array_append_new(msgs, m) != 0) {
            goto nomem;
        }
        return NGX_OK;
    }

    if (ngx_strcmp(type, "reasoning") == 0) {
        return NGX_OK;  /* earlier thinking: templates drop it from the history */
    }

    if (ngx_strcmp(type, "item_reference") == 0) {
        ngx_http_m40_bad(err, "input", "input[%uz]: item references need "
                         "stored responses, and this server stores none", i);
        return NGX_ERROR;
    }

    ngx_http_m40_bad(err, "input", "input[%uz]: items of type \"%s\" are not "
                     "supported (message, function_call, function_call_output "
                     "and reasoning are)", i, type);
    return NGX_ERROR;

nomem:

    ngx_http_m40_error_set(err, NGX_HTTP_INTERNAL_SERVER_ERROR, "server_error",
                           NULL, NULL, "out of memory");
    return NGX_ERROR;
}


/* tools, tool_choice and text.format in their chat spelling */
static ngx_int_t
ngx_http_m40_resp_tools(json_t *body, json_t *chat, ngx_http_m40_error_t *err)
{
    size_t       i;
    json_t      *tools, *t, *fn, *v, *out;
    const char  *type, *key;

    tools = ngx_http_m40_field(body, "tools");
    if (tools != NULL) {
        if (!json_is_array(tools)) {
            ngx_http_m40_bad(err, "tools", "'tools' must be an array");
            return NGX_ERROR;
        }

        out = json_array();
        if (out == NULL || json_object_set_new(chat, "tools", out) != 0) {
            goto nomem;
        }

        json_array_foreach(tools, i, t) {
            type = json_string_value(json_object_get(t, "type"));
            if (type == NULL || ngx_strcmp(type, "function") != 0) {
                ngx_http_m40_bad(err, "tools", "tools[%uz]: only "
                                 "{\"type\": \"function\"} tools are "
                                 "supported", i);
                return NGX_ERROR;
            }

            /* the chat request's check (ngx_http_m40_tools.c) validates these */
            fn = json_object();
            if (fn == NULL) {
                goto nomem;
            }
            json_object_foreach(t, key, v) {
                if (ngx_strcmp(key, "type") != 0) {
                    json_object_set(fn, key, v);
                }
            }

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
        if (json_is_object(v)) {
            type = json_string_value(json_object_get(v, "type"));
            if (type == NULL || ngx_strcmp(type, "function") != 0
                || !json_is_string(json_object_get(v, "name")))
            {
                ngx_http_m40_bad(err, "tool_choice", "'tool_choice' must be "
                                 "\"none\", \"auto\", \"required\" or "
                                 "{\"type\": \"function\", \"name\": ...}");
                return NGX_ERROR;
            }
            v = json_pack("{s:s,s:{s:O}}", "type", "function", "function",
                          "name", json_object_get(v, "name"));
            if (v == NULL || json_object_set_new(chat, "tool_choice", v) != 0)
            {
                goto nomem;
            }

        } else if (json_object_set(chat, "tool_choice", v) != 0) {
            goto nomem;
        }
    }

    v = ngx_http_m40_field(body, "text");
    if (v != NULL) {
        if (!json_is_object(v)) {
            ngx_http_m40_bad(err, "text", "'text' must be an object");
            return NGX_ERROR;
        }

        t = ngx_http_m40_field(v, "format");
        if (t == NULL) {
            return NGX_OK;
        }

        type = json_string_value(json_object_get(t, "type"));
        if (type == NULL) {
            ngx_http_m40_bad(err, "text.format", "'text.format' must be an "
                             "object with a string 'type'");
            return NGX_ERROR;
        }

        if (ngx_strcmp(type, "json_schema") == 0) {
            /* {"type", "name", "schema", "strict"} -> chat's nested spelling;
             * response_format's check names what is wrong */
            fn = json_object();
            if (fn == NULL) {
                goto nomem;
            }
            json_object_foreach(t, key, v) {
                if (ngx_strcmp(key, "type") != 0) {
                    json_object_set(fn, key, v);
                }
            }
            out = json_pack("{s:s,s:o}", "type", "json_schema", "json_schema",
                            fn);

        } else if (ngx_strcmp(type, "text") == 0
                   || ngx_strcmp(type, "json_object") == 0)
        {
            out = json_pack("{s:s}", "type", type);

        } else {
            ngx_http_m40_bad(err, "text.format.type", "'text.format.type' must "
                             "be \"text\", \"json_object\" or "
                             "\"json_schema\"");
            return NGX_ERROR;
        }

        if (out == NULL
            || json_object_set_new(chat, "response_format", out) != 0)
        {
            goto nomem;
        }
    }

    return NGX_OK;

nomem:

    ngx_http_m40_error_set(err, NGX_HTTP_INTERNAL_SERVER_ERROR, "server_error",
                           NULL, NULL, "out of memory");
    return NGX_ERROR;
}


static json_t *
ngx_http_m40_resp_request(ngx_http_m40_ctx_t *ctx, json_t *body,
    ngx_http_m40_error_t *err)
{
    size_t                      i;
    json_t                     *chat, *msgs, *input, *v, *item;
    ngx_pool_cleanup_t         *cln;
    ngx_http_m40_resp_state_t  *st;

    static const char  *copied[] = { "model", "temperature", "top_p", "stream",
                                     "parallel_tool_calls", "user", "seed",
                                     "top_k", "min_p", "presence_penalty",
                                     "frequency_penalty", NULL };

    st = ngx_pcalloc(ctx->request->pool, sizeof(ngx_http_m40_resp_state_t));
    cln = ngx_pool_cleanup_add(ctx->request->pool, 0);
    if (st == NULL || cln == NULL) {
        goto nomem;
    }
    cln->handler = ngx_http_m40_resp_cleanup;
    cln->data = st;
    ctx->dstate = st;

    st->output = json_array();
    chat = json_object();
    msgs = json_array();
    if (st->output == NULL || chat == NULL || msgs == NULL
        || json_object_set_new(chat, "messages", msgs) != 0)
    {
        json_decref(chat);
        goto nomem;
    }

    if (ngx_http_m40_field(body, "previous_response_id") != NULL) {
        ngx_http_m40_bad(err, "previous_response_id", "'previous_response_id' "
                         "needs stored responses, and this server stores none: "
                         "send the whole conversation in 'input'");
        goto failed;
    }

    v = ngx_http_m40_field(body, "background");
    if (v != NULL && json_is_true(v)) {
        ngx_http_m40_bad(err, "background", "'background' responses are not "
                         "supported");
        goto failed;
    }

    v = ngx_http_m40_field(body, "instructions");
    if (v != NULL) {
        if (!json_is_string(v)) {
            ngx_http_m40_bad(err, "instructions", "'instructions' must be a "
                             "string");
            goto failed;
        }
        if (json_array_append_new(msgs, json_pack("{s:s,s:O}", "role",
                                                  "system", "content", v))
            != 0)
        {
            goto nomem_chat;
        }
    }

    input = ngx_http_m40_field(body, "input");
    if (input == NULL) {
        ngx_http_m40_bad(err, "input", "'input' is required");
        goto failed;
    }

    if (json_is_string(input)) {
        if (json_array_append_new(msgs, json_pack("{s:s,s:O}", "role", "user",
                                                  "content", input))
            != 0)
        {
            goto nomem_chat;
        }

    } else if (json_is_array(input) && json_array_size(input) > 0) {
        json_array_foreach(input, i, item) {
            if (ngx_http_m40_resp_item(msgs, item, i, err) != NGX_OK) {
                goto failed;
            }
        }

    } else {
        ngx_http_m40_bad(err, "input", "'input' must be a string or a "
                         "non-empty array of items");
        goto failed;
    }

    if (json_array_size(msgs) == 0) {
        ngx_http_m40_bad(err, "input", "'input' holds no message");
        goto failed;
    }

    for (i = 0; copied[i]; i++) {
        v = json_object_get(body, copied[i]);
        if (v != NULL && json_object_set(chat, copied[i], v) != 0) {
            goto nomem_chat;
        }
    }

    v = ngx_http_m40_field(body, "max_output_tokens");
    if (v != NULL) {
        if (!json_is_integer(v) || json_integer_value(v) < 1) {
            ngx_http_m40_bad(err, "max_output_tokens", "'max_output_tokens' "
                             "must be a positive integer");
            goto failed;
        }
        if (json_object_set(chat, "max_tokens", v) != 0) {
            goto nomem_chat;
        }
    }

    v = ngx_http_m40_field(body, "metadata");
    if (v != NULL && !json_is_object(v)) {
        ngx_http_m40_bad(err, "metadata", "'metadata' must be an object");
        goto failed;
    }

    if (ngx_http_m40_resp_tools(body, chat, err) != NGX_OK) {
        goto failed;
    }

    return chat;

nomem_chat:

    json_decref(chat);

nomem:

    ngx_http_m40_error_set(err, NGX_HTTP_INTERNAL_SERVER_ERROR, "server_error",
                           NULL, NULL, "out of memory");
    return NULL;

failed:

    json_decref(chat);
    return NULL;
}


/* ---- the response object ---- */

static json_t *
ngx_http_m40_echo(ngx_http_m40_ctx_t *ctx, const char *name, json_t *dflt)
{
    json_t  *v;

    v = ngx_http_m40_field(ctx->body, name);
    if (v == NULL) {
        return dflt;
    }

    json_decref(dflt);
    return json_incref(v);
}


static json_t *
ngx_http_m40_resp_usage(ngx_http_m40_choice_t *ch)
{
    /* reasoning tokens are not counted apart from the others by the engine */
    return json_pack("{s:i,s:{s:i},s:i,s:{s:i},s:i}",
                     "input_tokens", (int) ch->prompt_tokens,
                     "input_tokens_details", "cached_tokens",
                     (int) ch->cached_tokens,
                     "output_tokens", (int) ch->completion_tokens,
                     "output_tokens_details", "reasoning_tokens", 0,
                     "total_tokens",
                     (int) (ch->prompt_tokens + ch->completion_tokens));
}


/* The response with its status ("in_progress", "completed", "incomplete"); takes
 * output. usage when the output is complete. */
static json_t *
ngx_http_m40_resp_object(ngx_http_m40_ctx_t *ctx, const char *status,
    json_t *output)
{
    json_t                 *o, *v;
    ngx_http_m40_choice_t  *ch;
    u_char                  id[64];

    ch = &ctx->choices[0];
    *ngx_snprintf(id, sizeof(id) - 1, "resp_%s", ctx->id) = '\0';

    o = json_pack("{s:s,s:s,s:I,s:s,s:n,s:o,s:o,s:o,s:s%,s:o,s:o,s:n,"
                  "s:{s:n,s:n},s:b,s:o,s:o,s:o,s:o,s:o,s:s,s:o,s:o}",
                  "id", (char *) id,
                  "object", "response",
                  "created_at", (json_int_t) ctx->created,
                  "status", status,
                  "error",
                  "incomplete_details",
                  ngx_strcmp(status, "incomplete") == 0
                  ? json_pack("{s:s}", "reason", "max_output_tokens")
                  : json_null(),
                  "instructions", ngx_http_m40_echo(ctx, "instructions",
                                                    json_null()),
                  "max_output_tokens", ngx_http_m40_echo(ctx,
                                                         "max_output_tokens",
                                                         json_null()),
                  "model", (const char *) ctx->model->model_name.data,
                  (size_t) ctx->model->model_name.len,
                  "output", output,
                  "parallel_tool_calls",
                  json_boolean(ctx->parallel_tool_calls),
                  "previous_response_id",
                  "reasoning", "effort", "summary",
                  "store", 0,
                  "temperature", ngx_http_m40_echo(ctx, "temperature",
                                                   json_real(1.0)),
                  "text", ngx_http_m40_echo(ctx, "text",
                                            json_pack("{s:{s:s}}", "format",
                                                      "type", "text")),
                  "tool_choice", ngx_http_m40_echo(ctx, "tool_choice",
                                                   json_string("auto")),
                  "tools", ngx_http_m40_echo(ctx, "tools", json_array()),
                  "top_p", ngx_http_m40_echo(ctx, "top_p", json_real(1.0)),
                  "truncation", "disabled",
                  "usage", ctx->n_done ? ngx_http_m40_resp_usage(ch)
                                       : json_null(),
                  "metadata", ngx_http_m40_echo(ctx, "metadata",
                                                json_object()));
    if (o == NULL) {
        return NULL;
    }

    v = ngx_http_m40_field(ctx->body, "user");
    if (v != NULL) {
        json_object_set(o, "user", v);
    }

    return o;
}


static const char *
ngx_http_m40_resp_status(ngx_http_m40_choice_t *ch)
{
    return ch->finish == M40_FINISH_LENGTH ? "incomplete" : "completed";
}


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


static void
ngx_http_m40_item_id(ngx_http_m40_ctx_t *ctx, const char *prefix, char *buf,
    size_t size, ngx_uint_t index)
{
    *ngx_snprintf((u_char *) buf, size - 1, "%s_%s%02ui", prefix, ctx->id,
                  index) = '\0';
}


static json_t *
ngx_http_m40_message_item(const char *id, const char *status, json_t *text)
{
    return json_pack("{s:s,s:s,s:s,s:s,s:[{s:s,s:o,s:[],s:[]}]}",
                     "type", "message", "id", id, "status", status,
                     "role", "assistant",
                     "content", "type", "output_text", "text", text,
                     "annotations", "logprobs");
}


static json_t *
ngx_http_m40_reasoning_item(const char *id, json_t *text)
{
    return json_pack("{s:s,s:s,s:[],s:[{s:s,s:o}]}",
                     "type", "reasoning", "id", id, "summary",
                     "content", "type", "reasoning_text", "text", text);
}


static json_t *
ngx_http_m40_call_item(const char *id, const char *status, json_t *call,
    ngx_flag_t with_args)
{
    json_t  *fn;

    fn = json_object_get(call, "function");

    return json_pack("{s:s,s:s,s:O,s:O,s:o,s:s}",
                     "type", "function_call", "id", id,
                     "call_id", json_object_get(call, "id"),
                     "name", json_object_get(fn, "name"),
                     "arguments", with_args
                                  ? json_incref(json_object_get(fn, "arguments"))
                                  : json_string(""),
                     "status", status);
}


static ngx_int_t
ngx_http_m40_resp_send(ngx_http_m40_ctx_t *ctx)
{
    char                    id[64];
    size_t                  i;
    json_t                 *output, *item, *call, *root;
    ngx_int_t               rc;
    ngx_uint_t              n;
    ngx_http_m40_choice_t  *ch;

    ch = &ctx->choices[0];
    n = 0;

    output = json_array();
    if (output == NULL) {
        return NGX_HTTP_INTERNAL_SERVER_ERROR;
    }

    if (ch->reasoning_len) {
        ngx_http_m40_item_id(ctx, "rs", id, sizeof(id), n++);
        item = ngx_http_m40_reasoning_item(id,
                   ngx_http_m40_json_text((const char *) ch->reasoning,
                                          ch->reasoning_len));
        if (item == NULL || json_array_append_new(output, item) != 0) {
            goto failed;
        }
    }

    /* blanks around tool calls are no answer; alone they are one */
    if (ch->text_len > 0
        && (ch->tool_calls == NULL || !ngx_http_m40_blank(ch->text, ch->text_len)))
    {
        ngx_http_m40_item_id(ctx, "msg", id, sizeof(id), n++);
        item = ngx_http_m40_message_item(id, ngx_http_m40_resp_status(ch),
                   ngx_http_m40_json_text((const char *) ch->text,
                                          ch->text_len));
        if (item == NULL || json_array_append_new(output, item) != 0) {
            goto failed;
        }
    }

    json_array_foreach(ch->tool_calls, i, call) {
        ngx_http_m40_item_id(ctx, "fc", id, sizeof(id), n++);
        item = ngx_http_m40_call_item(id, "completed", call, 1);
        if (item == NULL || json_array_append_new(output, item) != 0) {
            goto failed;
        }
    }

    root = ngx_http_m40_resp_object(ctx, ngx_http_m40_resp_status(ch), output);
    if (root == NULL) {
        return NGX_HTTP_INTERNAL_SERVER_ERROR;
    }

    rc = ngx_http_m40_send_json(ctx->request, NGX_HTTP_OK, root);
    json_decref(root);

    return rc;

failed:

    json_decref(output);
    return NGX_HTTP_INTERNAL_SERVER_ERROR;
}


/* ---- streaming ---- */

/* Sends event `type` with these fields (taken), numbered. */
static ngx_int_t
ngx_http_m40_resp_event(ngx_http_m40_sse_t *out, const char *type,
    json_t *data)
{
    ngx_http_m40_resp_state_t  *st;

    st = out->ctx->dstate;

    if (data == NULL) {
        return NGX_ERROR;
    }

    json_object_set_new(data, "type", json_string(type));
    json_object_set_new(data, "sequence_number", json_integer(st->seq++));

    return ngx_http_m40_sse_event(out, type, data);
}


static ngx_int_t
ngx_http_m40_resp_open(ngx_http_m40_sse_t *out)
{
    json_t  *r;

    r = ngx_http_m40_resp_object(out->ctx, "in_progress", json_array());

    if (ngx_http_m40_resp_event(out, "response.created",
                                json_pack("{s:O}", "response", r))
        != NGX_OK)
    {
        json_decref(r);
        return NGX_ERROR;
    }

    return ngx_http_m40_resp_event(out, "response.in_progress",
                                   json_pack("{s:o}", "response", r));
}


/* Ends the item open now: its done events and output_item.done. */
static ngx_int_t
ngx_http_m40_resp_close_item(ngx_http_m40_sse_t *out)
{
    json_t                     *text, *item, *part;
    ngx_uint_t                  index, kind;
    ngx_http_m40_resp_state_t  *st;

    st = out->ctx->dstate;
    kind = st->open;

    if (kind == NGX_HTTP_M40_ITEM_NONE) {
        return NGX_OK;
    }

    st->open = NGX_HTTP_M40_ITEM_NONE;
    index = json_array_size(st->output);

    text = ngx_http_m40_json_text((const char *) st->text, st->text_len);
    st->text_len = 0;
    if (text == NULL) {
        return NGX_ERROR;
    }

    if (kind == NGX_HTTP_M40_ITEM_MESSAGE) {
        part = json_pack("{s:s,s:O,s:[],s:[]}", "type", "output_text", "text",
                         text, "annotations", "logprobs");
        item = ngx_http_m40_message_item(st->item_id,
                   ngx_http_m40_resp_status(out->ch), json_incref(text));

        if (ngx_http_m40_resp_event(out, "response.output_text.done",
                json_pack("{s:s,s:I,s:i,s:O,s:[]}", "item_id", st->item_id,
                          "output_index", (json_int_t) index,
                          "content_index", 0, "text", text, "logprobs"))
            != NGX_OK)
        {
            goto failed;
        }

    } else {
        part = json_pack("{s:s,s:O}", "type", "reasoning_text", "text", text);
        item = ngx_http_m40_reasoning_item(st->item_id, json_incref(text));

        if (ngx_http_m40_resp_event(out, "response.reasoning_text.done",
                json_pack("{s:s,s:I,s:i,s:O}", "item_id", st->item_id,
                          "output_index", (json_int_t) index,
                          "content_index", 0, "text", text))
            != NGX_OK)
        {
            goto failed;
        }
    }

    json_decref(text);
    text = NULL;

    if (part == NULL || item == NULL
        || ngx_http_m40_resp_event(out, "response.content_part.done",
               json_pack("{s:s,s:I,s:i,s:O}", "item_id", st->item_id,
                         "output_index", (json_int_t) index,
                         "content_index", 0, "part", part))
           != NGX_OK
        || ngx_http_m40_resp_event(out, "response.output_item.done",
               json_pack("{s:I,s:O}", "output_index", (json_int_t) index,
                         "item", item))
           != NGX_OK
        || json_array_append(st->output, item) != 0)
    {
        goto failed;
    }

    json_decref(part);
    json_decref(item);
    return NGX_OK;

failed:

    json_decref(text);
    json_decref(part);
    json_decref(item);
    return NGX_ERROR;
}


/* Opens a message or reasoning item: output_item.added, content_part.added. */
static ngx_int_t
ngx_http_m40_resp_open_item(ngx_http_m40_sse_t *out, ngx_uint_t kind)
{
    json_t                     *item, *part;
    ngx_uint_t                  index;
    ngx_http_m40_resp_state_t  *st;

    st = out->ctx->dstate;

    if (ngx_http_m40_resp_close_item(out) != NGX_OK) {
        return NGX_ERROR;
    }

    index = json_array_size(st->output);
    st->open = kind;
    st->text_len = 0;

    if (kind == NGX_HTTP_M40_ITEM_MESSAGE) {
        ngx_http_m40_item_id(out->ctx, "msg", st->item_id,
                             sizeof(st->item_id), index);
        item = json_pack("{s:s,s:s,s:s,s:s,s:[]}", "type", "message",
                         "id", st->item_id, "status", "in_progress",
                         "role", "assistant", "content");
        part = json_pack("{s:s,s:s,s:[],s:[]}", "type", "output_text",
                         "text", "", "annotations", "logprobs");

    } else {
        ngx_http_m40_item_id(out->ctx, "rs", st->item_id, sizeof(st->item_id),
                             index);
        item = json_pack("{s:s,s:s,s:[],s:[]}", "type", "reasoning",
                         "id", st->item_id, "summary", "content");
        part = json_pack("{s:s,s:s}", "type", "reasoning_text", "text", "");
    }

    if (item == NULL || part == NULL) {
        json_decref(item);
        json_decref(part);
        return NGX_ERROR;
    }

    if (ngx_http_m40_resp_event(out, "response.output_item.added",
            json_pack("{s:I,s:o}", "output_index", (json_int_t) index,
                      "item", item))
        != NGX_OK)
    {
        json_decref(part);
        return NGX_ERROR;
    }

    return ngx_http_m40_resp_event(out, "response.content_part.added",
               json_pack("{s:s,s:I,s:i,s:o}", "item_id", st->item_id,
                         "output_index", (json_int_t) index,
                         "content_index", 0, "part", part));
}


static ngx_int_t
ngx_http_m40_resp_text_delta(ngx_http_m40_sse_t *out, ngx_uint_t kind,
    const char *text, size_t len)
{
    json_t                     *t;
    ngx_http_m40_resp_state_t  *st;

    st = out->ctx->dstate;

    if (st->open != kind
        && ngx_http_m40_resp_open_item(out, kind) != NGX_OK)
    {
        return NGX_ERROR;
    }

    if (ngx_http_m40_append(out->ctx->request, &st->text, &st->text_len,
                            &st->text_cap, text, len)
        != NGX_OK)
    {
        return NGX_ERROR;
    }

    t = ngx_http_m40_json_text(text, len);
    if (t == NULL) {
        return NGX_ERROR;
    }

    if (kind == NGX_HTTP_M40_ITEM_MESSAGE) {
        return ngx_http_m40_resp_event(out, "response.output_text.delta",
                   json_pack("{s:s,s:I,s:i,s:o,s:[]}", "item_id", st->item_id,
                             "output_index",
                             (json_int_t) json_array_size(st->output),
                             "content_index", 0, "delta", t, "logprobs"));
    }

    return ngx_http_m40_resp_event(out, "response.reasoning_text.delta",
               json_pack("{s:s,s:I,s:i,s:o}", "item_id", st->item_id,
                         "output_index",
                         (json_int_t) json_array_size(st->output),
                         "content_index", 0, "delta", t));
}


/* A function call streamed as it is written: output_item.added (arguments "") when
 * its name is known, function_call_arguments.delta for each fragment of its
 * arguments, and at its end function_call_arguments.done and output_item.done with
 * the whole arguments (the deltas joined). */
static ngx_int_t
ngx_http_m40_resp_call(ngx_http_m40_sse_t *out, const m40_piece *pc)
{
    json_t                     *item, *args;
    ngx_http_m40_resp_state_t  *st;

    st = out->ctx->dstate;

    if (pc->kind == M40_PIECE_TOOL_BEGIN) {
        if (ngx_http_m40_resp_close_item(out) != NGX_OK) {
            return NGX_ERROR;
        }

        json_decref(st->call);
        st->call_index = json_array_size(st->output);
        ngx_http_m40_item_id(out->ctx, "fc", st->call_item,
                             sizeof(st->call_item), st->call_index);

        st->call = ngx_http_m40_tool_call_json(pc, 0);
        item = st->call ? ngx_http_m40_call_item(st->call_item, "in_progress",
                                                 st->call, 0)
                        : NULL;

        return ngx_http_m40_resp_event(out, "response.output_item.added",
                   item == NULL ? NULL
                   : json_pack("{s:I,s:o}", "output_index",
                               (json_int_t) st->call_index, "item", item));
    }

    if (st->call == NULL) {
        return NGX_ERROR;   /* the parser gives a call's pieces in order */
    }

    if (pc->kind == M40_PIECE_TOOL_ARGS) {
        args = ngx_http_m40_json_text(pc->text, pc->len);

        return ngx_http_m40_resp_event(out,
                   "response.function_call_arguments.delta",
                   args == NULL ? NULL
                   : json_pack("{s:s,s:I,s:o}", "item_id", st->call_item,
                               "output_index", (json_int_t) st->call_index,
                               "delta", args));
    }

    /* TOOL_CALL: the end */
    args = json_string(pc->arguments);
    if (args == NULL
        || json_object_set(json_object_get(st->call, "function"), "arguments",
                           args) != 0)
    {
        json_decref(args);
        return NGX_ERROR;
    }

    item = ngx_http_m40_call_item(st->call_item, "completed", st->call, 1);
    json_decref(st->call);
    st->call = NULL;

    if (item == NULL
        || ngx_http_m40_resp_event(out, "response.function_call_arguments.done",
               json_pack("{s:s,s:I,s:O,s:s}", "item_id", st->call_item,
                         "output_index", (json_int_t) st->call_index,
                         "arguments", args, "name", pc->name))
           != NGX_OK
        || ngx_http_m40_resp_event(out, "response.output_item.done",
               json_pack("{s:I,s:O}", "output_index",
                         (json_int_t) st->call_index, "item", item))
           != NGX_OK
        || json_array_append(st->output, item) != 0)
    {
        json_decref(args);
        json_decref(item);
        return NGX_ERROR;
    }

    json_decref(args);
    json_decref(item);
    return NGX_OK;
}


static int
ngx_http_m40_resp_piece(void *ud, const m40_piece *pc)
{
    ngx_http_m40_sse_t *out = ud;

    ngx_http_m40_resp_state_t  *st;

    st = out->ctx->dstate;

    switch (pc->kind) {

    case M40_PIECE_REASONING:
        return ngx_http_m40_resp_text_delta(out, NGX_HTTP_M40_ITEM_REASONING,
                                            pc->text, pc->len) == NGX_OK
               ? 0 : -1;

    case M40_PIECE_CONTENT:
        if (st->open != NGX_HTTP_M40_ITEM_MESSAGE
            && ngx_http_m40_blank((const u_char *) pc->text, pc->len))
        {
            /* held: blanks alone (around calls) make no message */
            return ngx_http_m40_append(out->ctx->request, &st->blank,
                                       &st->blank_len, &st->blank_cap,
                                       pc->text, pc->len) == NGX_OK ? 0 : -1;
        }

        if (st->open != NGX_HTTP_M40_ITEM_MESSAGE && st->blank_len) {
            if (ngx_http_m40_resp_text_delta(out, NGX_HTTP_M40_ITEM_MESSAGE,
                                             (const char *) st->blank,
                                             st->blank_len)
                != NGX_OK)
            {
                return -1;
            }
            st->blank_len = 0;
        }

        return ngx_http_m40_resp_text_delta(out, NGX_HTTP_M40_ITEM_MESSAGE,
                                            pc->text, pc->len) == NGX_OK
               ? 0 : -1;

    default:
        if (!out->ctx->parallel_tool_calls && pc->index > 0) {
            return 0;   /* parallel_tool_calls false: the first call only */
        }
        if (pc->kind == M40_PIECE_TOOL_BEGIN) {
            out->ch->n_tool_calls++;
            st->blank_len = 0;
        }
        return ngx_http_m40_resp_call(out, pc) == NGX_OK ? 0 : -1;
    }
}


static ngx_int_t
ngx_http_m40_resp_done(ngx_http_m40_sse_t *out)
{
    json_t                     *r;
    const char                 *status;
    ngx_http_m40_resp_state_t  *st;

    st = out->ctx->dstate;

    /* blanks held for a call that never came: they are the answer */
    if (st->blank_len && out->ch->n_tool_calls == 0
        && st->open != NGX_HTTP_M40_ITEM_MESSAGE
        && ngx_http_m40_resp_text_delta(out, NGX_HTTP_M40_ITEM_MESSAGE,
                                        (const char *) st->blank,
                                        st->blank_len)
           != NGX_OK)
    {
        return NGX_ERROR;
    }

    if (ngx_http_m40_resp_close_item(out) != NGX_OK) {
        return NGX_ERROR;
    }

    status = ngx_http_m40_resp_status(out->ch);
    r = ngx_http_m40_resp_object(out->ctx, status, json_incref(st->output));

    return ngx_http_m40_resp_event(out, ngx_strcmp(status, "completed") == 0
                                        ? "response.completed"
                                        : "response.incomplete",
                                   json_pack("{s:o}", "response", r));
}


static ngx_int_t
ngx_http_m40_resp_fail(ngx_http_m40_sse_t *out, ngx_http_m40_error_t *err)
{
    return ngx_http_m40_resp_event(out, "error",
               json_pack("{s:s?,s:s,s:s?}", "code", err->code,
                         "message", err->message, "param", err->param));
}


const ngx_http_m40_dialect_t  ngx_http_m40_responses_dialect = {
    "responses",
    ngx_http_m40_resp_request,
    NULL,
    ngx_http_m40_resp_send,
    ngx_http_m40_resp_open,
    ngx_http_m40_resp_piece,
    ngx_http_m40_resp_done,
    ngx_http_m40_resp_fail,
};
