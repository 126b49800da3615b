/* Constrained decoding in the engine: a request's grammar (GBNF, a JSON Schema or "any
 * JSON object") is compiled on the tokenizer thread, beside its prompt, so a large schema
 * never delays anybody's step; the engine thread then only walks the compiled automaton
 * (engine/grammar). The vocabulary trie the masks walk is built once, by the tokenizer
 * thread, on the first constrained request (engines that never see one never pay for it);
 * the engine thread reaches it only through requests handed over under e->mu. */
#include "engine_impl.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static m40_token_trie *vocab_trie_build(const m40_tokenizer *tok)
{
    int32_t n = m40_tokenizer_n_vocab(tok);
    char **bytes = calloc((size_t)n, sizeof *bytes);
    int32_t *lens = calloc((size_t)n, sizeof *lens);
    uint8_t *eog = calloc((size_t)n, 1);
    m40_token_trie *t = NULL;
    if (!bytes || !lens || !eog)
        goto out;
    for (int32_t id = 0; id < n; id++) {
        char buf[256];
        eog[id] = (uint8_t)(m40_tokenizer_is_eog(tok, id) != 0);
        /* render_special 0: control tokens are no text and never match a grammar */
        int k = m40_token_to_bytes(tok, id, 0, buf, (int)sizeof buf);
        if (k <= 0 || k > (int)sizeof buf)
            continue; /* longer pieces than 256 bytes: left out (never allowed) */
        if (!(bytes[id] = malloc((size_t)k)))
            goto out;
        memcpy(bytes[id], buf, (size_t)k);
        lens[id] = k;
    }
    t = m40_token_trie_new(n, (const char *const *)bytes, lens, eog);
out:
    for (int32_t id = 0; bytes && id < n; id++)
        free(bytes[id]);
    free(bytes);
    free(lens);
    free(eog);
    return t;
}

/* The JSON Schema of one call object of any of the tools: {"name": <const>, <args>:
 * <the function's parameters>} in that order (the compiler keeps schema order, and the
 * parsers read either), with each tool's $defs hoisted to the root, where their "#/$defs/.."
 * references point. *why names a problem (a $defs name two tools use). */
static json_t *call_schema(const json_t *tools, const char *args_key, const char **why)
{
    json_t *any = json_array(), *defs = json_object();
    json_t *root = json_pack("{s:o,s:o}", "anyOf", any, "$defs", defs);
    size_t i;
    json_t *t;
    *why = "out of memory";
    if (!root)
        return NULL;
    json_array_foreach(tools, i, t)
    {
        json_t *fn = json_object_get(t, "function");
        json_t *name = json_object_get(fn, "name");
        json_t *params = json_object_get(fn, "parameters");
        if (!json_is_string(name)) {
            *why = "a tool has no function name";
            goto fail;
        }
        params = json_is_object(params) ? json_deep_copy(params) : json_pack("{s:s}", "type", "object");
        if (!params)
            goto fail;
        static const char *const def_keys[] = {"$defs", "definitions"};
        for (int k = 0; k < 2; k++) {
            json_t *d = json_object_get(params, def_keys[k]);
            const char *dn;
            json_t *dv;
            if (!json_is_object(d))
                continue;
            if (k == 1 && !json_object_get(root, "definitions"))
                json_object_set_new(root, "definitions", json_object());
            json_t *to = json_object_get(root, def_keys[k]);
            json_object_foreach(d, dn, dv)
            {
                if (json_object_get(to, dn)) {
                    json_decref(params);
                    *why = "two tools' parameters define the same name in '$defs'";
                    goto fail;
                }
                json_object_set(to, dn, dv);
            }
            json_object_del(params, def_keys[k]);
        }
        json_t *call = json_pack("{s:s,s:{s:{s:O},s:o},s:[s,s],s:b}", "type", "object", "properties", "name", "const",
                                 name, args_key, params, "required", "name", args_key, "additionalProperties", 0);
        if (!call || json_array_append_new(any, call) != 0)
            goto fail;
    }
    return root;
fail:
    json_decref(root);
    return NULL;
}

/* Appends the root rule to rules (taken): body, after "</think>" when the prompt left
 * a <think> open (DeepSeek-R1's templates): the constrained answer is the answer, not
 * reasoning, and the output parser finds the end of the thinking first. */
static char *with_root(char *rules, int reasoning_open, const char *body, char *err, size_t errlen)
{
    const char *close = reasoning_open ? "\"</think>\\n\\n\" " : "";
    size_t n = strlen(rules), m = strlen(body) + strlen(close) + 16;
    char *out = realloc(rules, n + m);
    if (!out) {
        free(rules);
        snprintf(err, errlen, "out of memory");
        return NULL;
    }
    snprintf(out + n, m, "root ::= %s(%s)\n", close, body);
    return out;
}

/* Harmony (gpt-oss): a call is a message whose header names the function, then its
 * arguments, so the name is outside the JSON and each tool's parameters get a rule of
 * their own (args-K). The recipient stands in the channel's header or before the channel
 * (gpt-oss writes both; the parser reads both), the content type optional, as llama.cpp's
 * grammar for gpt-oss has it. No analysis message first: a free-text rule would let a model
 * think until max_tokens. Always one call: gpt-oss ends its turn at <|call|>, so several
 * calls are never one output (parallel_tool_calls changes nothing). The output needs no
 * <|call|>: the sequence ends where the grammar does. */
static char *harmony_call_gbnf(const m40_request *r, char *err, size_t errlen)
{
    size_t n = json_array_size(r->tools), i;
    char **texts = calloc(n + 1, sizeof *texts);
    char **names = calloc(n + 1, sizeof *names);
    size_t *lens = calloc(n + 1, sizeof *lens);
    char *rules = NULL, *out = NULL;
    size_t cap = 256, len = 0;
    if (!texts || !names || !lens)
        goto oom;
    for (i = 0; i < n; i++) {
        json_t *fn = json_object_get(json_array_get(r->tools, i), "function");
        const char *name = json_string_value(json_object_get(fn, "name"));
        json_t *params = json_object_get(fn, "parameters");
        if (!name || !name[0]) {
            snprintf(err, errlen, "a tool has no function name");
            goto fail;
        }
        /* the name goes into a GBNF literal and a harmony header: OpenAI's characters only */
        for (const char *c = name; *c; c++)
            if (!(*c == '_' || *c == '-' || (*c >= '0' && *c <= '9') || (*c >= 'a' && *c <= 'z') ||
                  (*c >= 'A' && *c <= 'Z'))) {
                snprintf(err, errlen, "function name '%.64s' has characters other than letters, digits, '_', '-'",
                         name);
                goto fail;
            }
        cap += 2 * strlen(name) + 160; /* its call rule and its place in root */
        if (!(names[i] = malloc(32)))
            goto oom;
        snprintf(names[i], 32, "args-%zu", i);
        if (json_is_object(params)) {
            if (!(texts[i] = json_dumps(params, JSON_COMPACT | JSON_PRESERVE_ORDER)))
                goto oom;
            lens[i] = strlen(texts[i]);
        }
    }
    rules = m40_json_schema_to_gbnf_rules((const char *const *)texts, lens, (const char *const *)names, (int)n, err,
                                          errlen);
    if (!rules)
        goto fail;
    cap += strlen(rules);
    if (!(out = malloc(cap)))
        goto oom;
    len = (size_t)snprintf(out, cap,
                           "%sh-chan ::= \"<|channel|>\" \"commentary\"\n"
                           "h-type ::= (\" <|constrain|>json\" | \" json\")?\n",
                           rules);
    for (i = 0; i < n; i++) {
        const char *name = json_string_value(json_object_get(json_object_get(json_array_get(r->tools, i), "function"), "name"));
        len += (size_t)snprintf(out + len, cap - len,
                                "call-%zu ::= (h-chan \" to=functions.%s\" | \" to=functions.%s\" h-chan) h-type "
                                "\"<|message|>\" args-%zu\n",
                                i, name, name, i);
    }
    len += (size_t)snprintf(out + len, cap - len, "root ::=");
    for (i = 0; i < n; i++)
        len += (size_t)snprintf(out + len, cap - len, "%s call-%zu", i ? " |" : "", i);
    snprintf(out + len, cap - len, "\n");
    goto done;
oom:
    snprintf(err, errlen, "out of memory");
fail:
    free(out);
    out = NULL;
done:
    for (i = 0; texts && names && i < n; i++) {
        free(texts[i]);
        free(names[i]);
    }
    free(texts);
    free(names);
    free(lens);
    free(rules);
    return out;
}

/* GBNF for tool_choice "required" or a named function: one call (or, when parallel calls
 * are allowed, one or more) in the markup the model's template teaches and the output
 * parser reads (chat_parse.c), so the parser always finds calls. */
static char *tool_call_gbnf(const m40_request *r, char *err, size_t errlen)
{
    if (r->tool_call_format == M40_TOOLS_HARMONY)
        return harmony_call_gbnf(r, err, errlen);
    const char *args_key = r->tool_call_format == M40_TOOLS_LLAMA3 ? "parameters" : "arguments";
    const char *why;
    json_t *schema = call_schema(r->tools, args_key, &why);
    if (!schema) {
        snprintf(err, errlen, "%s", why);
        return NULL;
    }
    char *text = json_dumps(schema, JSON_COMPACT | JSON_PRESERVE_ORDER);
    json_decref(schema);
    if (!text) {
        snprintf(err, errlen, "out of memory");
        return NULL;
    }
    char *rules = m40_json_schema_to_gbnf_rule(text, strlen(text), "tool-call", err, errlen);
    free(text);
    if (!rules)
        return NULL;
    const char *calls;
    int par = r->tool_call_parallel;
    switch (r->tool_call_format) {
    case M40_TOOLS_HERMES:
        calls = par ? "\"<tool_call>\\n\" tool-call \"\\n</tool_call>\" (\"\\n<tool_call>\\n\" tool-call "
                      "\"\\n</tool_call>\")*"
                    : "\"<tool_call>\\n\" tool-call \"\\n</tool_call>\"";
        break;
    case M40_TOOLS_LLAMA3: /* several calls are joined by "; " (the parser splits on ';') */
        calls = par ? "tool-call (\"; \" tool-call)*" : "tool-call";
        break;
    case M40_TOOLS_MISTRAL:
        calls = par ? "\"[TOOL_CALLS][\" tool-call (\", \" tool-call)* \"]\"" : "\"[TOOL_CALLS][\" tool-call \"]\"";
        break;
    default: /* M40_TOOLS_JSON: the whole output a call, or an array of them */
        calls = par ? "tool-call | \"[\" tool-call (\", \" tool-call)* \"]\"" : "tool-call";
        break;
    }
    return with_root(rules, r->reasoning_open, calls, err, errlen);
}

int m40_request_compile_grammar(m40_engine *e, m40_request *r, int *status, char *msg, size_t msglen)
{
    if (!r->grammar_src && !r->json_schema && !r->json_object && !r->tool_call_format)
        return 0;
    char err[256] = "";
    const char *field = r->grammar_src ? "grammar" : r->tool_call_format ? "tools" : "response_format";
    char *src = NULL;
    *status = 400;
    if (r->tool_call_format) {
        if (!(src = tool_call_gbnf(r, err, sizeof err))) {
            snprintf(msg, msglen, "invalid '%s' for tool_choice: %.200s", field, err);
            return -1;
        }
    } else if (!r->grammar_src) {
        src = m40_json_schema_to_gbnf_rule(r->json_schema, r->json_schema ? strlen(r->json_schema) : 0, "answer", err,
                                           sizeof err);
        if (src)
            src = with_root(src, r->reasoning_open, "answer", err, sizeof err);
        if (!src) {
            snprintf(msg, msglen, "invalid '%s': %.200s", field, err);
            return -1;
        }
    }
    const char *g = src ? src : r->grammar_src;
    r->grammar = m40_grammar_parse(g, strlen(g), err, sizeof err);
    free(src);
    if (!r->grammar) {
        snprintf(msg, msglen, "invalid '%s': %.200s", field, err);
        return -1;
    }
    /* The start state once here: a grammar too ambiguous or deep to even start is the
     * caller's 400 now, not the engine thread's 500 later. */
    m40_gmatch *probe = m40_gmatch_new(r->grammar);
    const char *why = probe ? m40_gmatch_error(probe) : "grammar: out of memory";
    if (why) {
        snprintf(msg, msglen, "invalid '%s': %.200s", field, why);
        m40_gmatch_free(probe);
        return -1;
    }
    m40_gmatch_free(probe);
    if (!e->vocab_trie && !(e->vocab_trie = vocab_trie_build(e->tok))) {
        *status = 500;
        snprintf(msg, msglen, "out of memory building the vocabulary trie");
        return -1;
    }
    return 0;
}
