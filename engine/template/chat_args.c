/* Tool-call arguments for templates (jinja.h: m40_chat_arguments_as_objects).
 *
 * The OpenAI API carries an assistant's tool_calls[].function.arguments as a JSON
 * string; the templates of Qwen2.5, Llama 3.x, Hermes and Mistral apply `| tojson` or
 * `.items()` to it as to a mapping, which is what vLLM and transformers hand them. A
 * few templates (DeepSeek-R1's) concatenate it as text instead, so the request path
 * renders with objects first and, when that fails, with the strings as sent. */
#include "jinja.h"

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
