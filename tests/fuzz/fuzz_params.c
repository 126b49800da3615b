/* libFuzzer harness: the request parsing of the nginx module, JSON body -> generation
 * parameters (m40_api_parse_params, engine/serve/api_params.c: the module's
 * ngx_http_m40_parse_params calls it on every chat and completions request).
 *
 * The first byte picks the endpoint (chat or completions) and the limits; the rest is the
 * body as a client sends it, parsed by jansson as the module does (json_loadb, flags 0).
 * Checked: an accepted request's parameters are within their documented ranges (n 1..8,
 * temperature 0..2, top_p in (0, 1], at most 4 stop strings of 1..1024 bytes without
 * NUL, logit_bias ids >= 0 and values in -100..100, a chat's messages with a known role
 * and string or null content, a schema that is JSON, tools an array); a refused one has
 * a 4xx (or an out-of-memory 500), a type and a non-empty message. Everything is freed
 * (LeakSanitizer). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "m40_api_params.h"

#define CHECK(c, ...)                                                                                                  \
    do {                                                                                                               \
        if (!(c)) {                                                                                                    \
            fprintf(stderr, "fuzz_params: " __VA_ARGS__);                                                              \
            fprintf(stderr, "\n");                                                                                     \
            abort();                                                                                                   \
        }                                                                                                              \
    } while (0)

static void check_accepted(const m40_api_limits *lim, int chat, const m40_api_params *p)
{
    CHECK(p->chat == chat, "kind");
    CHECK(p->max_tokens >= 1 && p->max_tokens <= lim->max_tokens_limit, "max_tokens %lld", (long long)p->max_tokens);
    CHECK(p->n >= 1 && p->n <= M40_API_MAX_N, "n %u", p->n);
    CHECK(p->temperature >= 0 && p->temperature <= 2, "temperature %f", p->temperature);
    CHECK(p->top_p > 0 && p->top_p <= 1, "top_p %f", p->top_p);
    CHECK(p->min_p >= 0 && p->min_p <= 1, "min_p %f", p->min_p);
    CHECK(fabsf(p->presence_penalty) <= 2 && fabsf(p->frequency_penalty) <= 2, "penalties");
    CHECK(p->top_k >= 0 && p->top_k <= 1000000, "top_k %lld", (long long)p->top_k);
    CHECK(p->top_logprobs >= 0 && p->top_logprobs <= 20, "top_logprobs %lld", (long long)p->top_logprobs);
    CHECK(p->n_stop <= M40_API_MAX_STOP, "n_stop %u", p->n_stop);
    for (uint32_t i = 0; i < p->n_stop; i++) {
        size_t n = strlen(p->stop[i]);
        CHECK(n >= 1 && n <= 1024, "stop[%u] of %zu bytes", i, n);
    }
    CHECK(p->n_bias <= 1024, "n_bias %u", p->n_bias);
    for (uint32_t i = 0; i < p->n_bias; i++)
        CHECK(p->bias_ids[i] >= 0 && isfinite(p->bias_values[i]) && fabsf(p->bias_values[i]) <= 100, "logit_bias");
    if (chat) {
        CHECK(json_is_array(p->messages) && json_array_size(p->messages) > 0, "messages");
        size_t i;
        json_t *m;
        json_array_foreach(p->messages, i, m) {
            const char *role = json_string_value(json_object_get(m, "role"));
            json_t *c = json_object_get(m, "content");
            CHECK(role && (!strcmp(role, "system") || !strcmp(role, "user") || !strcmp(role, "assistant")
                           || !strcmp(role, "tool")), "messages[%zu].role", i);
            CHECK(json_is_string(c) || (json_is_null(c) && !strcmp(role, "assistant")), "messages[%zu].content", i);
        }
        CHECK(p->tools == NULL || (json_is_array(p->tools) && json_array_size(p->tools) > 0), "tools");
        CHECK(p->tool_choice <= M40_API_TOOL_CHOICE_NAMED, "tool_choice");
        CHECK(p->template_kwargs == NULL || json_is_object(p->template_kwargs), "chat_template_kwargs");
    } else {
        CHECK(p->prompt != NULL && !p->messages && !p->tools, "prompt");
    }
    CHECK((p->grammar != NULL) + (p->json_schema != NULL) + (p->json_object != 0) <= 1,
          "grammar and response_format together");
    if (p->json_schema) {
        json_t *s = json_loads(p->json_schema, JSON_DECODE_ANY, NULL);
        CHECK(s != NULL, "the schema text is not JSON: %s", p->json_schema);
        json_decref(s);
    }
}

static void check_refused(const m40_api_error *err)
{
    CHECK((err->status >= 400 && err->status < 500) || err->status == 500, "status %d", err->status);
    CHECK(err->type && *err->type, "no error type");
    CHECK(memchr(err->message, 0, sizeof err->message) != NULL && err->message[0], "empty message");
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1)
        return 0;
    const unsigned mode = data[0];
    json_error_t jerr;
    json_t *root = json_loadb((const char *)data + 1, size - 1, 0, &jerr);
    if (root == NULL)
        return 0; /* the module answers jansson's error itself */
    m40_api_limits lim = {.model_name = "tiny-model", .model_name_len = 10,
                          .max_tokens_default = (mode & 4) ? 1 : 256,
                          .max_tokens_limit = (mode & 2) ? 1 << 20 : 512};
    const int chat = !(mode & 1);
    m40_api_params p;
    m40_api_error err;
    memset(&err, 0, sizeof err);
    if (m40_api_parse_params(root, chat, &lim, &p, &err) == 0)
        check_accepted(&lim, chat, &p);
    else
        check_refused(&err);
    m40_api_params_free(&p);
    json_decref(root);
    return 0;
}
