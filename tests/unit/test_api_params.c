/* Request body -> parameters (engine/m40_api_params.h), the checks the nginx module runs
 * on every chat and completions request: defaults, every field taken over, the error
 * (status, param, message) of each kind of bad field, and ownership (LeakSanitizer in
 * fuzz_params; here every result is freed the same way). */
#include <math.h>

#include "check.h"
#include "m40_api_params.h"

static const m40_api_limits LIM = {"tiny", 4, 256, 512};

/* Parses body for chat (1) or completions (0); returns the parser's result. */
static int parse(const char *body, int chat, m40_api_params *p, m40_api_error *e)
{
    json_error_t jerr;
    json_t *root = json_loads(body, 0, &jerr);
    if (!root) {
        fprintf(stderr, "bad test JSON %s: %s\n", body, jerr.text);
        exit(2);
    }
    memset(e, 0, sizeof *e);
    int rc = m40_api_parse_params(root, chat, &LIM, p, e);
    if (rc == 0 && !chat && p->prompt) {
        /* the prompt points into root: keep a copy to compare after root goes */
        static char keep[256];
        snprintf(keep, sizeof keep, "%.*s", (int)p->prompt_len, p->prompt);
        p->prompt = keep;
    }
    if (rc == 0)
        for (uint32_t i = 0; i < p->n_stop; i++) {
            static char stops[M40_API_MAX_STOP][64];
            snprintf(stops[i], sizeof stops[i], "%s", p->stop[i]);
            p->stop[i] = stops[i];
        }
    json_decref(root);
    return rc;
}

/* body must be refused with status and param (NULL: null), the message containing what. */
static void refused(const char *body, int chat, int status, const char *param, const char *what)
{
    m40_api_params p;
    m40_api_error e;
    int rc = parse(body, chat, &p, &e);
    CHECK(rc == -1, "%s accepted", body);
    CHECK(e.status == status, "%s: status %d, want %d", body, e.status, status);
    CHECK(param ? e.param && !strcmp(e.param, param) : e.param == NULL, "%s: param %s, want %s", body,
          e.param ? e.param : "null", param ? param : "null");
    CHECK(strstr(e.message, what) != NULL, "%s: message \"%s\" lacks \"%s\"", body, e.message, what);
    CHECK(e.type && !strcmp(e.type, status == 500 ? "server_error" : "invalid_request_error"), "%s: type", body);
    m40_api_params_free(&p);
}

static void test_defaults(void)
{
    m40_api_params p;
    m40_api_error e;
    CHECK(parse("{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}]}", 1, &p, &e) == 0, "%s", e.message);
    CHECK(p.chat == 1 && p.max_tokens == 256 && p.n == 1 && p.temperature == 1.0f && p.top_p == 1.0f, "defaults");
    CHECK(p.top_k == 0 && p.n_stop == 0 && p.n_bias == 0 && !p.stream && !p.logprobs && !p.has_seed, "defaults");
    CHECK(p.parallel_tool_calls == 1 && p.tool_choice == M40_API_TOOL_CHOICE_AUTO && !p.tools, "tool defaults");
    CHECK(json_array_size(p.messages) == 1, "one message");
    m40_api_params_free(&p);
}

static void test_fields(void)
{
    m40_api_params p;
    m40_api_error e;
    CHECK(parse("{\"model\":\"tiny\",\"messages\":[{\"role\":\"developer\",\"content\":[{\"type\":\"text\",\"text\":\"a\"},"
                "{\"type\":\"text\",\"text\":\"b\"}]},{\"role\":\"assistant\",\"content\":null,\"tool_calls\":[{\"id\":\"c\","
                "\"type\":\"function\",\"function\":{\"name\":\"f\",\"arguments\":\"{}\"}}]},{\"role\":\"tool\","
                "\"tool_call_id\":\"c\",\"content\":\"ok\"}],\"max_completion_tokens\":7,\"n\":3,\"temperature\":0.5,"
                "\"top_p\":0,\"min_p\":0.1,\"seed\":-1,\"stop\":[\"x\",\"\",\"yz\"],\"logit_bias\":{\"5\":1.5,\"7\":-100},"
                "\"logprobs\":true,\"top_logprobs\":4,\"stream\":true,\"stream_options\":{\"include_usage\":true},"
                "\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"f\"}},{\"type\":\"function\",\"function\":"
                "{\"name\":\"g\"}}],\"tool_choice\":{\"type\":\"function\",\"function\":{\"name\":\"g\"}},"
                "\"parallel_tool_calls\":false,\"chat_template_kwargs\":{\"k\":1},\"response_format\":"
                "{\"type\":\"json_schema\",\"json_schema\":{\"schema\":{\"type\":\"object\"}}},\"user\":\"u\"}",
                1, &p, &e) == 0,
          "%s", e.message);
    json_t *m0 = json_array_get(p.messages, 0), *m1 = json_array_get(p.messages, 1);
    CHECK(!strcmp(json_string_value(json_object_get(m0, "role")), "system"), "developer is system");
    CHECK(!strcmp(json_string_value(json_object_get(m0, "content")), "a\nb"), "parts joined with newlines");
    CHECK(json_is_null(json_object_get(m1, "content")) && json_array_size(json_object_get(m1, "tool_calls")) == 1,
          "a tool-call turn keeps its null content");
    CHECK(p.max_tokens == 7 && p.n == 3 && fabsf(p.temperature - 0.5f) < 1e-6f && fabsf(p.min_p - 0.1f) < 1e-6f,
          "numbers");
    CHECK(p.top_p == 1.0f && p.top_k == 1, "top_p 0 is greedy");
    CHECK(p.has_seed && p.seed == UINT64_MAX, "seed -1");
    CHECK(p.n_stop == 2 && !strcmp(p.stop[0], "x") && !strcmp(p.stop[1], "yz"), "empty stop string dropped");
    CHECK(p.n_bias == 2 && p.bias_ids[0] == 5 && p.bias_values[1] == -100.0f, "logit_bias");
    CHECK(p.logprobs && p.top_logprobs == 4 && p.stream && p.include_usage, "flags");
    CHECK(json_array_size(p.tools) == 1 && p.tool_choice == M40_API_TOOL_CHOICE_NAMED && !p.parallel_tool_calls,
          "a named function is the only tool shown");
    CHECK(!strcmp(json_string_value(json_object_get(json_object_get(json_array_get(p.tools, 0), "function"), "name")),
                  "g"),
          "the named one");
    CHECK(json_is_object(p.template_kwargs) && p.json_schema && !strcmp(p.json_schema, "{\"type\":\"object\"}"),
          "schema text");
    m40_api_params_free(&p);

    CHECK(parse("{\"prompt\":[\"Once\"],\"logprobs\":2,\"echo\":false,\"stop\":\"\\n\",\"grammar\":\"root ::= \\\"a\\\"\"}", 0,
                &p, &e) == 0,
          "%s", e.message);
    CHECK(!strcmp(p.prompt, "Once") && p.logprobs && p.top_logprobs == 2 && p.n_stop == 1, "completions fields");
    CHECK(p.grammar && !strcmp(p.grammar, "root ::= \"a\"") && !p.messages, "grammar");
    m40_api_params_free(&p);
}

static void test_errors(void)
{
    refused("[1]", 1, 400, NULL, "must be a JSON object");
    refused("{\"model\":\"other\",\"messages\":5}", 1, 404, "model", "The model 'other' does not exist (this server "
                                                                     "serves 'tiny')");
    refused("{\"messages\":[]}", 1, 400, "messages", "non-empty array");
    refused("{\"messages\":[{\"role\":\"wizard\",\"content\":\"x\"}]}", 1, 400, "messages",
            "messages[0].role \"wizard\" is not supported");
    refused("{\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"image_url\"}]}]}", 1, 400, "messages",
            "messages[0].content[0]: content type \"image_url\"");
    refused("{\"messages\":[{\"role\":\"tool\",\"content\":\"x\"}]}", 1, 400, "messages",
            "messages[0].tool_call_id must be a string");
    refused("{\"prompt\":[\"a\",\"b\"]}", 0, 400, "prompt", "array of one string");
    refused("{\"prompt\":\"a\",\"max_tokens\":513}", 0, 400, "max_tokens", "'max_tokens' must be between 1 and 512");
    refused("{\"prompt\":\"a\",\"n\":9}", 0, 400, "n", "'n' must be between 1 and 8");
    refused("{\"prompt\":\"a\",\"temperature\":\"hot\"}", 0, 400, "temperature", "must be a number");
    refused("{\"prompt\":\"a\",\"top_p\":1.5}", 0, 400, "top_p", "between 0.0 and 1.0");
    refused("{\"prompt\":\"a\",\"stop\":[\"a\",\"b\",\"c\",\"d\",\"e\"]}", 0, 400, "stop", "up to 4 strings");
    refused("{\"prompt\":\"a\",\"logit_bias\":{\"2147483648\":1}}", 0, 400, "logit_bias", "is not a token id");
    refused("{\"prompt\":\"a\",\"logit_bias\":{\"-1\":1}}", 0, 400, "logit_bias", "is not a token id");
    refused("{\"prompt\":\"a\",\"logit_bias\":{\"5\":101}}", 0, 400, "logit_bias", "between -100 and 100");
    refused("{\"prompt\":\"a\",\"echo\":true,\"logprobs\":1}", 0, 400, "echo", "not supported");
    refused("{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"top_logprobs\":2}", 1, 400, "top_logprobs",
            "requires 'logprobs'");
    refused("{\"prompt\":\"a\",\"stream_options\":{\"include_usage\":1}}", 0, 400, "stream_options.include_usage",
            "must be a boolean");
    refused("{\"prompt\":\"a\",\"grammar\":\"x\",\"response_format\":{\"type\":\"json_object\"}}", 0, 400,
            "response_format", "together with 'grammar'");
    refused("{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"tools\":[{\"type\":\"function\",\"function\":"
            "{\"name\":\"f\"}},{\"type\":\"function\",\"function\":{\"name\":\"f\"}}]}",
            1, 400, "tools", "tools[1]: the function name \"f\" is used twice");
    refused("{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"tool_choice\":\"required\"}", 1, 400,
            "tool_choice", "'tool_choice' required needs 'tools'");
    refused("{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"tools\":[{\"type\":\"function\",\"function\":"
            "{\"name\":\"f\"}}],\"tool_choice\":{\"type\":\"function\",\"function\":{\"name\":\"g\"}}}",
            1, 400, "tool_choice", "names the function \"g\", which is not among 'tools'");
    refused("{\"prompt\":\"a\",\"user\":5}", 0, 400, "user", "'user' must be a string");
    /* a long role in a message is cut, never overflowed, and the message stays a string */
    char body[2048];
    snprintf(body, sizeof body, "{\"messages\":[{\"role\":\"%0900d\",\"content\":\"x\"}]}", 0);
    refused(body, 1, 400, "messages", "messages[0].role \"000");
}

int main(void)
{
    test_defaults();
    test_fields();
    test_errors();
    return check_done();
}
