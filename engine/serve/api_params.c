/* Request body validation: the OpenAI request JSON becomes m40_api_params
 * (m40_api_params.h). Plain C and jansson: the nginx module calls it on every request,
 * tests/fuzz/fuzz_params.c calls it on arbitrary bodies.
 *
 * Unknown fields are ignored (clients send many); a known field with the wrong type
 * or out of range is a 400 naming the field in "param". null counts as absent.
 *
 * Tools (chat): the definitions reach the chat template as its `tools` variable,
 * exactly as the client sent them (validated); the template decides how the model
 * sees them. With tool_choice naming a function, that function is the only one the
 * template shows. */
#include "m40_api_params.h"

#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define BAD(err, param, ...) m40_api_error_set(err, 400, "invalid_request_error", param, "invalid_value", __VA_ARGS__)

void m40_api_error_set(m40_api_error *err, int status, const char *type, const char *param, const char *code,
                       const char *fmt, ...)
{
    va_list ap;
    err->status = status;
    err->type = type;
    err->param = param;
    err->code = code;
    va_start(ap, fmt);
    vsnprintf(err->message, sizeof err->message, fmt, ap);
    va_end(ap);
}

static int nomem(m40_api_error *err)
{
    m40_api_error_set(err, 500, "server_error", NULL, NULL, "out of memory");
    return -1;
}

/* Field present and not null. */
static json_t *field(json_t *root, const char *name)
{
    json_t *v = json_object_get(root, name);
    return v == NULL || json_is_null(v) ? NULL : v;
}

static int get_number(json_t *root, const char *name, double lo, double hi, float *out, m40_api_error *err)
{
    json_t *v = field(root, name);
    if (v == NULL)
        return 0;
    if (!json_is_number(v)) {
        BAD(err, name, "'%s' must be a number", name);
        return -1;
    }
    double d = json_number_value(v);
    if (!isfinite(d) || d < lo || d > hi) {
        BAD(err, name, "'%s' must be between %.1f and %.1f", name, lo, hi);
        return -1;
    }
    *out = (float)d;
    return 0;
}

/* 0 with *out set, 1 when absent, -1 on error. */
static int get_integer(json_t *root, const char *name, json_int_t lo, json_int_t hi, int64_t *out, m40_api_error *err)
{
    json_t *v = field(root, name);
    if (v == NULL)
        return 1;
    if (!json_is_integer(v)) {
        BAD(err, name, "'%s' must be an integer", name);
        return -1;
    }
    json_int_t i = json_integer_value(v);
    if (i < lo || i > hi) {
        BAD(err, name, "'%s' must be between %lld and %lld", name, (long long)lo, (long long)hi);
        return -1;
    }
    *out = (int64_t)i;
    return 0;
}

static int get_bool(json_t *root, const char *name, int *out, m40_api_error *err)
{
    json_t *v = field(root, name);
    if (v == NULL)
        return 0;
    if (!json_is_boolean(v)) {
        BAD(err, name, "'%s' must be a boolean", name);
        return -1;
    }
    *out = json_is_true(v) ? 1 : 0;
    return 0;
}

/* ---------- messages ---------- */

/* A message content: a string, or an array of {"type":"text","text":...} parts
 * joined with newlines. Returns a new reference to a JSON string: the request's own
 * string when it is one (no copy: a 1 MB prompt is parsed on nginx's event loop, and
 * every pass over it there delays every stream's tokens). */
static json_t *flatten_content(json_t *content, size_t i, m40_api_error *err)
{
    if (json_is_string(content))
        return json_incref(content);
    if (!json_is_array(content)) {
        BAD(err, "messages", "messages[%zu].content must be a string or an array of content parts", i);
        return NULL;
    }
    size_t n = json_array_size(content), len = 0;
    for (size_t k = 0; k < n; k++) {
        json_t *part = json_array_get(content, k);
        json_t *type = json_object_get(part, "type");
        json_t *text = json_object_get(part, "text");
        if (!json_is_object(part) || !json_is_string(type)) {
            BAD(err, "messages", "messages[%zu].content[%zu] must be an object with a \"type\"", i, k);
            return NULL;
        }
        if (strcmp(json_string_value(type), "text") != 0) {
            BAD(err, "messages",
                "messages[%zu].content[%zu]: content type \"%s\" is not supported (only \"text\")", i, k,
                json_string_value(type));
            return NULL;
        }
        if (!json_is_string(text)) {
            BAD(err, "messages", "messages[%zu].content[%zu].text must be a string", i, k);
            return NULL;
        }
        len += json_string_length(text) + 1;
    }
    char *buf = malloc(len + 1), *p = buf;
    if (buf == NULL) {
        nomem(err);
        return NULL;
    }
    for (size_t k = 0; k < n; k++) {
        json_t *text = json_object_get(json_array_get(content, k), "text");
        size_t tl = json_string_length(text);
        if (k > 0)
            *p++ = '\n';
        memcpy(p, json_string_value(text), tl);
        p += tl;
    }
    json_t *s = json_stringn(buf, (size_t)(p - buf));
    free(buf);
    if (s == NULL)
        nomem(err);
    return s;
}

/* The fields beyond role and content that templates read: an assistant's tool_calls
 * (arguments stay the client's JSON string; the engine hands templates an object
 * when they can take one), a tool result's tool_call_id and name, and an
 * assistant's reasoning_content (Qwen3's template renders it back). */
static int message_tool_fields(json_t *m, size_t i, const char *role, json_t *out, m40_api_error *err)
{
    json_t *v, *id;
    if (strcmp(role, "tool") == 0) {
        id = json_object_get(m, "tool_call_id");
        if (!json_is_string(id)) {
            BAD(err, "messages", "messages[%zu].tool_call_id must be a string", i);
            return -1;
        }
        if (json_object_set(out, "tool_call_id", id) != 0)
            return nomem(err);
    }
    v = json_object_get(m, "name");
    if (json_is_string(v) && json_object_set(out, "name", v) != 0)
        return nomem(err);
    if (strcmp(role, "assistant") != 0)
        return 0;
    v = json_object_get(m, "reasoning_content");
    if (json_is_string(v) && json_object_set(out, "reasoning_content", v) != 0)
        return nomem(err);
    json_t *calls = json_object_get(m, "tool_calls");
    if (calls == NULL || json_is_null(calls))
        return 0;
    if (!json_is_array(calls)) {
        BAD(err, "messages", "messages[%zu].tool_calls must be an array", i);
        return -1;
    }
    json_t *copy = json_array();
    if (copy == NULL || json_object_set_new(out, "tool_calls", copy) != 0)
        return nomem(err);
    size_t k;
    json_t *c;
    json_array_foreach(calls, k, c) {
        json_t *fn = json_object_get(c, "function");
        json_t *name = json_object_get(fn, "name");
        json_t *args = json_object_get(fn, "arguments");
        id = json_object_get(c, "id");
        if (!json_is_object(c) || !json_is_object(fn) || !json_is_string(name)
            || (args != NULL && !json_is_string(args) && !json_is_object(args))
            || (id != NULL && !json_is_null(id) && !json_is_string(id))) {
            BAD(err, "messages",
                "messages[%zu].tool_calls[%zu] must be {\"id\", \"type\": \"function\", \"function\": "
                "{\"name\", \"arguments\"}}",
                i, k);
            return -1;
        }
        v = json_pack("{s:s,s:{s:O,s:o}}", "type", "function", "function", "name", name, "arguments",
                      args ? json_incref(args) : json_string("{}"));
        if (v == NULL)
            return nomem(err);
        if ((json_is_string(id) && json_object_set(v, "id", id) != 0) || json_array_append_new(copy, v) != 0)
            return nomem(err);
    }
    return 0;
}

static int parse_messages(json_t *root, m40_api_params *p, m40_api_error *err)
{
    json_t *msgs = field(root, "messages");
    if (msgs == NULL) {
        BAD(err, "messages", "'messages' is required");
        return -1;
    }
    if (!json_is_array(msgs) || json_array_size(msgs) == 0) {
        BAD(err, "messages", "'messages' must be a non-empty array");
        return -1;
    }
    size_t n = json_array_size(msgs);
    p->messages = json_array();
    if (p->messages == NULL)
        return nomem(err);
    for (size_t i = 0; i < n; i++) {
        json_t *m = json_array_get(msgs, i), *flat;
        if (!json_is_object(m)) {
            BAD(err, "messages", "messages[%zu] must be an object", i);
            return -1;
        }
        json_t *role = json_object_get(m, "role");
        if (!json_is_string(role)) {
            BAD(err, "messages", "messages[%zu].role must be a string", i);
            return -1;
        }
        const char *r = json_string_value(role);
        if (strcmp(r, "developer") == 0) {
            r = "system"; /* OpenAI's newer name for system */
        } else if (strcmp(r, "system") != 0 && strcmp(r, "user") != 0 && strcmp(r, "assistant") != 0
                   && strcmp(r, "tool") != 0) {
            BAD(err, "messages", "messages[%zu].role \"%s\" is not supported (system, user, assistant, tool)", i, r);
            return -1;
        }
        json_t *content = json_object_get(m, "content");
        if ((content == NULL || json_is_null(content)) && strcmp(r, "assistant") == 0) {
            /* A tool-call turn keeps its null: templates test "content is none"
             * there (DeepSeek-R1's), as vLLM passes it. */
            flat = json_array_size(json_object_get(m, "tool_calls")) > 0 ? json_null() : json_string("");
        } else if (content == NULL) {
            BAD(err, "messages", "messages[%zu].content is required", i);
            return -1;
        } else {
            flat = flatten_content(content, i, err);
            if (flat == NULL)
                return -1;
        }
        json_t *out = json_pack("{s:s,s:o}", "role", r, "content", flat);
        if (out == NULL || json_array_append_new(p->messages, out) != 0)
            return nomem(err);
        if (message_tool_fields(m, i, r, out, err) != 0)
            return -1;
    }
    return 0;
}

static int parse_prompt(json_t *root, m40_api_params *p, m40_api_error *err)
{
    json_t *v = field(root, "prompt");
    if (v == NULL) {
        BAD(err, "prompt", "'prompt' is required");
        return -1;
    }
    if (json_is_array(v)) {
        if (json_array_size(v) != 1 || !json_is_string(json_array_get(v, 0))) {
            BAD(err, "prompt",
                "'prompt' must be a string or an array of one string (batches and token arrays are not "
                "supported)");
            return -1;
        }
        v = json_array_get(v, 0);
    }
    if (!json_is_string(v)) {
        BAD(err, "prompt", "'prompt' must be a string");
        return -1;
    }
    p->prompt_len = json_string_length(v);
    p->prompt = json_string_value(v);
    return 0;
}

/* ---------- stop, logit_bias, formats ---------- */

static int add_stop(json_t *s, size_t i, m40_api_params *p, m40_api_error *err)
{
    if (!json_is_string(s)) {
        BAD(err, "stop", "stop[%zu] must be a string", i);
        return -1;
    }
    size_t len = json_string_length(s);
    if (len > 1024) {
        BAD(err, "stop", "a stop string is longer than 1024 bytes");
        return -1;
    }
    if (strlen(json_string_value(s)) != len) {
        BAD(err, "stop", "stop strings must not contain NUL");
        return -1;
    }
    if (len > 0) /* an empty stop string would end every answer */
        p->stop[p->n_stop++] = json_string_value(s);
    return 0;
}

static int parse_stop(json_t *root, m40_api_params *p, m40_api_error *err)
{
    json_t *v = field(root, "stop");
    if (v == NULL)
        return 0;
    if (json_is_string(v))
        return add_stop(v, 0, p, err);
    if (!json_is_array(v) || json_array_size(v) > M40_API_MAX_STOP) {
        BAD(err, "stop", "'stop' must be a string or an array of up to %d strings", M40_API_MAX_STOP);
        return -1;
    }
    for (size_t i = 0; i < json_array_size(v); i++)
        if (add_stop(json_array_get(v, i), i, p, err) != 0)
            return -1;
    return 0;
}

/* A token id: decimal digits only, at most 2^31 - 1 (as nginx's ngx_atoi took it). */
static int64_t token_id(const char *key)
{
    int64_t v = 0;
    if (!*key)
        return -1;
    for (const char *s = key; *s; s++) {
        if (*s < '0' || *s > '9')
            return -1;
        v = v * 10 + (*s - '0');
        if (v > 0x7fffffff)
            return -1;
    }
    return v;
}

static int parse_logit_bias(json_t *root, m40_api_params *p, m40_api_error *err)
{
    json_t *v = field(root, "logit_bias"), *val;
    const char *key;
    if (v == NULL)
        return 0;
    if (!json_is_object(v)) {
        BAD(err, "logit_bias", "'logit_bias' must be an object mapping token ids to numbers");
        return -1;
    }
    size_t n = json_object_size(v);
    if (n == 0)
        return 0;
    if (n > 1024) {
        BAD(err, "logit_bias", "'logit_bias' has more than 1024 entries");
        return -1;
    }
    p->bias_ids = malloc(n * sizeof(int32_t));
    p->bias_values = malloc(n * sizeof(float));
    if (p->bias_ids == NULL || p->bias_values == NULL)
        return nomem(err);
    json_object_foreach(v, key, val) {
        int64_t id = token_id(key);
        if (id < 0) {
            BAD(err, "logit_bias", "logit_bias key \"%s\" is not a token id", key);
            return -1;
        }
        if (!json_is_number(val)) {
            BAD(err, "logit_bias", "logit_bias[\"%s\"] must be a number", key);
            return -1;
        }
        double d = json_number_value(val);
        if (!isfinite(d) || d < -100.0 || d > 100.0) {
            BAD(err, "logit_bias", "logit_bias[\"%s\"] must be between -100 and 100", key);
            return -1;
        }
        p->bias_ids[p->n_bias] = (int32_t)id;
        p->bias_values[p->n_bias] = (float)d;
        p->n_bias++;
    }
    return 0;
}

/* "response_format" ({"type": "text" | "json_object" | "json_schema", "json_schema":
 * {"name", "schema", "strict"}}) and "grammar" (GBNF, as llama-server takes it). Only the
 * shape is checked here; the engine compiles the schema or grammar off the event loop
 * and answers a bad one with a 400 that names the problem. */
static int parse_format(json_t *root, m40_api_params *p, m40_api_error *err)
{
    json_t *v = field(root, "grammar");
    if (v != NULL) {
        if (!json_is_string(v)) {
            BAD(err, "grammar", "'grammar' must be a string");
            return -1;
        }
        size_t len = json_string_length(v);
        p->grammar = malloc(len + 1);
        if (p->grammar == NULL)
            return nomem(err);
        memcpy(p->grammar, json_string_value(v), len);
        p->grammar[len] = '\0';
    }
    json_t *rf = field(root, "response_format");
    if (rf == NULL)
        return 0;
    json_t *type = json_is_object(rf) ? json_object_get(rf, "type") : NULL;
    if (!json_is_string(type)) {
        BAD(err, "response_format", "'response_format' must be an object with a string 'type'");
        return -1;
    }
    const char *t = json_string_value(type);
    if (strcmp(t, "text") == 0)
        return 0;
    if (p->grammar != NULL) {
        BAD(err, "response_format", "'response_format' together with 'grammar' is not supported");
        return -1;
    }
    if (strcmp(t, "json_object") == 0) {
        p->json_object = 1;
        return 0;
    }
    if (strcmp(t, "json_schema") != 0) {
        BAD(err, "response_format.type", "'response_format.type' must be 'text', 'json_object' or 'json_schema'");
        return -1;
    }
    json_t *js = json_object_get(rf, "json_schema");
    if (!json_is_object(js)) {
        BAD(err, "response_format.json_schema", "'response_format.json_schema' must be an object");
        return -1;
    }
    v = json_object_get(js, "name");
    if (v != NULL && !json_is_string(v)) {
        BAD(err, "response_format.json_schema.name", "'response_format.json_schema.name' must be a string");
        return -1;
    }
    v = json_object_get(js, "strict");
    if (v != NULL && !json_is_null(v) && !json_is_boolean(v)) {
        BAD(err, "response_format.json_schema.strict", "'response_format.json_schema.strict' must be a boolean");
        return -1;
    }
    json_t *schema = field(js, "schema");
    if (schema == NULL) {
        p->json_object = 1; /* no schema: any JSON object */
        return 0;
    }
    if (!json_is_object(schema) && !json_is_boolean(schema)) {
        BAD(err, "response_format.json_schema.schema", "'response_format.json_schema.schema' must be an object");
        return -1;
    }
    p->json_schema = json_dumps(schema, JSON_COMPACT | JSON_ENCODE_ANY);
    return p->json_schema ? 0 : nomem(err);
}

/* ---------- tools ---------- */

/* OpenAI's rule for function names: 1 to 64 of a-z, A-Z, 0-9, '_' and '-'. */
static int valid_name(const char *s, size_t len)
{
    if (len == 0 || len > 64)
        return 0;
    for (size_t i = 0; i < len; i++)
        if (!(s[i] == '_' || s[i] == '-' || (s[i] >= '0' && s[i] <= '9') || (s[i] >= 'a' && s[i] <= 'z')
              || (s[i] >= 'A' && s[i] <= 'Z')))
            return 0;
    return 1;
}

static int check_tool(json_t *t, size_t i, m40_api_error *err)
{
    json_t *type = json_object_get(t, "type");
    if (!json_is_object(t) || !json_is_string(type) || strcmp(json_string_value(type), "function") != 0) {
        BAD(err, "tools", "tools[%zu] must be an object with \"type\": \"function\"", i);
        return -1;
    }
    json_t *fn = json_object_get(t, "function");
    if (!json_is_object(fn)) {
        BAD(err, "tools", "tools[%zu].function must be an object", i);
        return -1;
    }
    json_t *name = json_object_get(fn, "name");
    if (!json_is_string(name) || !valid_name(json_string_value(name), json_string_length(name))) {
        BAD(err, "tools", "tools[%zu].function.name must be a string of 1 to 64 letters, digits, '_' or '-'", i);
        return -1;
    }
    json_t *v = json_object_get(fn, "description");
    if (v != NULL && !json_is_null(v) && !json_is_string(v)) {
        BAD(err, "tools", "tools[%zu].function.description must be a string", i);
        return -1;
    }
    /* A JSON Schema is an object (or true/false, which no client sends for a
     * function's parameters: refusing them keeps templates' `.properties` safe). */
    v = json_object_get(fn, "parameters");
    if (v != NULL && !json_is_null(v) && !json_is_object(v)) {
        BAD(err, "tools", "tools[%zu].function.parameters must be a JSON Schema object", i);
        return -1;
    }
    if (json_is_object(v)) {
        type = json_object_get(v, "type");
        if (type != NULL && !json_is_string(type) && !json_is_array(type)) {
            BAD(err, "tools", "tools[%zu].function.parameters.type must be a string or an array", i);
            return -1;
        }
        type = json_object_get(v, "properties");
        if (type != NULL && !json_is_object(type)) {
            BAD(err, "tools", "tools[%zu].function.parameters.properties must be an object", i);
            return -1;
        }
        type = json_object_get(v, "required");
        if (type != NULL && !json_is_array(type)) {
            BAD(err, "tools", "tools[%zu].function.parameters.required must be an array", i);
            return -1;
        }
    }
    v = json_object_get(fn, "strict");
    if (v != NULL && !json_is_null(v) && !json_is_boolean(v)) {
        BAD(err, "tools", "tools[%zu].function.strict must be a boolean", i);
        return -1;
    }
    return 0;
}

#define TOOL_CHOICE_SHAPE                                                                                              \
    "'tool_choice' must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", \"function\": {\"name\": "   \
    "...}}"

static int parse_tools(json_t *root, m40_api_params *p, m40_api_error *err)
{
    size_t i;
    json_t *t, *fn, *name, *v;
    const char *s, *want = NULL;

    p->parallel_tool_calls = 1;
    p->tool_choice = M40_API_TOOL_CHOICE_AUTO;

    json_t *tools = json_object_get(root, "tools");
    if (tools != NULL && !json_is_null(tools)) {
        if (!json_is_array(tools)) {
            BAD(err, "tools", "'tools' must be an array");
            return -1;
        }
        json_array_foreach(tools, i, t) {
            if (check_tool(t, i, err) != 0)
                return -1;
            s = json_string_value(json_object_get(json_object_get(t, "function"), "name"));
            for (size_t k = 0; k < i; k++) {
                fn = json_object_get(json_array_get(tools, k), "function");
                if (strcmp(json_string_value(json_object_get(fn, "name")), s) == 0) {
                    BAD(err, "tools", "tools[%zu]: the function name \"%s\" is used twice", i, s);
                    return -1;
                }
            }
        }
        if (json_array_size(tools) == 0)
            tools = NULL;
    } else {
        tools = NULL;
    }

    json_t *choice = json_object_get(root, "tool_choice");
    if (choice != NULL && !json_is_null(choice)) {
        if (json_is_string(choice)) {
            s = json_string_value(choice);
            if (strcmp(s, "auto") == 0) {
                p->tool_choice = M40_API_TOOL_CHOICE_AUTO;
            } else if (strcmp(s, "none") == 0) {
                p->tool_choice = M40_API_TOOL_CHOICE_NONE;
            } else if (strcmp(s, "required") == 0) {
                p->tool_choice = M40_API_TOOL_CHOICE_REQUIRED;
            } else {
                BAD(err, "tool_choice", TOOL_CHOICE_SHAPE);
                return -1;
            }
        } else {
            fn = json_object_get(choice, "function");
            name = json_object_get(fn, "name");
            v = json_object_get(choice, "type");
            if (!json_is_object(choice) || !json_is_string(v) || strcmp(json_string_value(v), "function") != 0
                || !json_is_string(name)) {
                BAD(err, "tool_choice", TOOL_CHOICE_SHAPE);
                return -1;
            }
            p->tool_choice = M40_API_TOOL_CHOICE_NAMED;
            want = json_string_value(name);
        }
        if (tools == NULL && p->tool_choice >= M40_API_TOOL_CHOICE_REQUIRED) {
            BAD(err, "tool_choice", "'tool_choice' %s needs 'tools'", want ? "naming a function" : "required");
            return -1;
        }
    }

    v = json_object_get(root, "parallel_tool_calls");
    if (v != NULL && !json_is_null(v)) {
        if (!json_is_boolean(v)) {
            BAD(err, "parallel_tool_calls", "'parallel_tool_calls' must be a boolean");
            return -1;
        }
        p->parallel_tool_calls = json_is_true(v) ? 1 : 0;
    }

    v = json_object_get(root, "chat_template_kwargs");
    if (v != NULL && !json_is_null(v)) {
        if (!json_is_object(v)) {
            BAD(err, "chat_template_kwargs", "'chat_template_kwargs' must be an object");
            return -1;
        }
        p->template_kwargs = json_deep_copy(v);
        if (p->template_kwargs == NULL)
            return nomem(err);
    }

    /* tool_choice none: the template does not see the tools and nothing is parsed
     * as a call (the answer is plain content). */
    if (tools == NULL || p->tool_choice == M40_API_TOOL_CHOICE_NONE)
        return 0;
    if (want == NULL) {
        p->tools = json_deep_copy(tools);
        return p->tools ? 0 : nomem(err);
    }
    /* A named function: the only one the template shows. */
    json_array_foreach(tools, i, t) {
        fn = json_object_get(t, "function");
        if (strcmp(json_string_value(json_object_get(fn, "name")), want) == 0) {
            p->tools = json_pack("[O]", t);
            return p->tools ? 0 : nomem(err);
        }
    }
    BAD(err, "tool_choice", "'tool_choice' names the function \"%s\", which is not among 'tools'", want);
    return -1;
}

/* ---------- the request ---------- */

int m40_api_parse_params(json_t *root, int chat, const m40_api_limits *lim, m40_api_params *p, m40_api_error *err)
{
    json_t *v, *so;
    int64_t i;
    int rc;

    memset(p, 0, sizeof *p);
    p->chat = chat;
    p->max_tokens = lim->max_tokens_default;
    p->n = 1;
    p->temperature = 1.0f;
    p->top_p = 1.0f;

    if (!json_is_object(root)) {
        BAD(err, NULL, "the request body must be a JSON object");
        return -1;
    }

    /* model first: a wrong model is a 404 whatever else is wrong */
    v = field(root, "model");
    if (v != NULL) {
        if (!json_is_string(v)) {
            BAD(err, "model", "'model' must be a string");
            return -1;
        }
        if (json_string_length(v) != lim->model_name_len
            || memcmp(json_string_value(v), lim->model_name, lim->model_name_len) != 0) {
            m40_api_error_set(err, 404, "invalid_request_error", "model", "model_not_found",
                              "The model '%s' does not exist (this server serves '%.*s')", json_string_value(v),
                              (int)lim->model_name_len, lim->model_name);
            return -1;
        }
    }

    if (chat ? parse_messages(root, p, err) : parse_prompt(root, p, err))
        return -1;

    if (get_integer(root, "max_tokens", 1, lim->max_tokens_limit, &p->max_tokens, err) < 0
        || get_integer(root, "max_completion_tokens", 1, lim->max_tokens_limit, &p->max_tokens, err) < 0)
        return -1;

    i = 1;
    if (get_integer(root, "n", 1, M40_API_MAX_N, &i, err) < 0)
        return -1;
    p->n = (uint32_t)i;

    if (get_number(root, "temperature", 0.0, 2.0, &p->temperature, err)
        || get_number(root, "top_p", 0.0, 1.0, &p->top_p, err) || get_number(root, "min_p", 0.0, 1.0, &p->min_p, err)
        || get_number(root, "presence_penalty", -2.0, 2.0, &p->presence_penalty, err)
        || get_number(root, "frequency_penalty", -2.0, 2.0, &p->frequency_penalty, err))
        return -1;

    if (p->top_p <= 0.0f) {
        /* top_p 0 means "only the most likely token" in practice */
        p->top_p = 1.0f;
        p->top_k = 1;
    }

    i = 0;
    rc = get_integer(root, "top_k", -1, 1000000, &i, err);
    if (rc < 0)
        return -1;
    if (rc == 0)
        p->top_k = i < 0 ? 0 : i;

    v = field(root, "seed");
    if (v != NULL) {
        if (!json_is_integer(v)) {
            BAD(err, "seed", "'seed' must be an integer");
            return -1;
        }
        p->has_seed = 1;
        p->seed = (uint64_t)json_integer_value(v);
    }

    if (parse_stop(root, p, err) || parse_logit_bias(root, p, err))
        return -1;

    if (chat) {
        if (get_bool(root, "logprobs", &p->logprobs, err))
            return -1;
        i = 0;
        rc = get_integer(root, "top_logprobs", 0, 20, &i, err);
        if (rc < 0)
            return -1;
        p->top_logprobs = i;
        if (rc == 0 && i > 0 && !p->logprobs) {
            BAD(err, "top_logprobs", "'top_logprobs' requires 'logprobs' to be true");
            return -1;
        }
    } else {
        /* legacy completions: "logprobs" is the number of alternatives */
        i = 0;
        rc = get_integer(root, "logprobs", 0, 20, &i, err);
        if (rc < 0)
            return -1;
        if (rc == 0) {
            p->logprobs = 1;
            p->top_logprobs = i;
        }
        if (get_bool(root, "echo", &p->echo, err))
            return -1;
        if (p->echo && p->logprobs) {
            BAD(err, "echo", "'echo' together with 'logprobs' is not supported");
            return -1;
        }
    }

    if (get_bool(root, "ignore_eos", &p->ignore_eos, err) || parse_format(root, p, err)
        || get_bool(root, "stream", &p->stream, err))
        return -1;

    so = field(root, "stream_options");
    if (so != NULL) {
        if (!json_is_object(so)) {
            BAD(err, "stream_options", "'stream_options' must be an object");
            return -1;
        }
        if (get_bool(so, "include_usage", &p->include_usage, err)) {
            err->param = "stream_options.include_usage";
            return -1;
        }
    }

    if (chat && parse_tools(root, p, err))
        return -1;

    v = field(root, "user");
    if (v != NULL && !json_is_string(v)) {
        BAD(err, "user", "'user' must be a string");
        return -1;
    }
    return 0;
}

void m40_api_params_free(m40_api_params *p)
{
    json_decref(p->messages);
    json_decref(p->tools);
    json_decref(p->template_kwargs);
    free(p->bias_ids);
    free(p->bias_values);
    free(p->grammar);
    free(p->json_schema);
    memset(p, 0, sizeof *p);
}
