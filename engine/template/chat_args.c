/* Tool-call arguments for templates (jinja.h: m40_chat_arguments_as_objects).
 *
 * The OpenAI API carries an assistant's tool_calls[].function.arguments as a JSON
 * string; the templates of Qwen2.5, Llama 3.x, Hermes and Mistral apply `| tojson` or
 * `.items()` to it as to a mapping, which is what vLLM and transformers hand them. A
 * few templates (DeepSeek-R1's) concatenate it as text instead, so the request path
 * renders with objects first and, when that fails, with the strings as sent.
 *
 * gpt-oss's harmony template wants an assistant's analysis as `thinking` and a tool-call
 * turn without a null content (m40_chat_harmony_messages): what the OpenAI API sends is
 * reshaped for it, as llama.cpp does. */
#include "jinja.h"

#include <string.h>

static int convertible(const json_t *call)
{
    json_t *args = json_object_get(json_object_get(call, "function"), "arguments");
    if (!json_is_string(args))
        return 0;
    json_t *v = json_loadb(json_string_value(args), json_string_length(args), 0, NULL);
    int ok = json_is_object(v);
    json_decref(v);
    return ok;
}

json_t *m40_chat_arguments_as_objects(const json_t *messages)
{
    size_t i, k;
    json_t *m, *c;
    int any = 0;
    json_array_foreach(messages, i, m)
    {
        json_array_foreach(json_object_get(m, "tool_calls"), k, c) any |= convertible(c);
    }
    if (!any)
        return NULL;
    json_t *copy = json_deep_copy(messages);
    if (!copy)
        return NULL;
    json_array_foreach(copy, i, m)
    {
        json_array_foreach(json_object_get(m, "tool_calls"), k, c)
        {
            if (!convertible(c))
                continue;
            json_t *fn = json_object_get(c, "function");
            json_t *args = json_object_get(fn, "arguments");
            json_t *obj = json_loadb(json_string_value(args), json_string_length(args), 0, NULL);
            if (!obj || json_object_set_new(fn, "arguments", obj) != 0) {
                json_decref(copy);
                return NULL;
            }
        }
    }
    return copy;
}

/* What m40_chat_harmony_messages changes in an assistant turn m: bit 1 its null content
 * goes, bit 2 its reasoning_content becomes thinking; 0 nothing. */
static int harmony_change(const json_t *m)
{
    const char *role = json_string_value(json_object_get(m, "role"));
    const json_t *calls = json_object_get(m, "tool_calls");
    if (!role || strcmp(role, "assistant") != 0 || !json_is_array(calls) || json_array_size(calls) == 0)
        return 0;
    const json_t *content = json_object_get(m, "content");
    const json_t *reasoning = json_object_get(m, "reasoning_content");
    int drop = content != NULL && json_is_null(content);
    int think = json_is_string(reasoning) && json_string_length(reasoning) > 0 && !json_object_get(m, "thinking") &&
                (!json_is_string(content) || json_string_length(content) == 0);
    return drop | think << 1;
}

json_t *m40_chat_harmony_messages(const json_t *messages)
{
    size_t i;
    json_t *m;
    int any = 0;
    json_array_foreach(messages, i, m) any |= harmony_change(m);
    if (!any)
        return NULL;
    json_t *copy = json_deep_copy(messages);
    if (!copy)
        return NULL;
    json_array_foreach(copy, i, m)
    {
        int c = harmony_change(m);
        if ((c & 2) && json_object_set(m, "thinking", json_object_get(m, "reasoning_content")) != 0) {
            json_decref(copy);
            return NULL;
        }
        if (c & 1)
            json_object_del(m, "content");
    }
    return copy;
}
