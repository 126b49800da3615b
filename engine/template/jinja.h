/* Chat-template interpreter: the Jinja2 subset that real chat templates use
 * (tokenizer.chat_template in GGUF files).
 *
 * Semantics follow Python jinja2 as Hugging Face's apply_chat_template configures
 * it, because that rendering is what models were trained on:
 *   ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
 *   extensions=[loopcontrols, generation tracker]), default Undefined,
 *   keep_trailing_newline=False, tojson = json.dumps(x, ensure_ascii=False,
 *   indent=indent) (insertion order, no key sorting), raise_exception(msg),
 *   strftime_now(fmt).
 * Values print the way Python's str() prints them (None, True, ['a', 1], 1.0).
 *
 * Lifetime and threads: a parsed m40_jinja is immutable; any number of threads may
 * render it at once. Each render allocates from its own arena, bounded by
 * m40_jinja_limits, so a hostile template (deep nesting, runaway loops, huge output)
 * ends with an error message instead of exhausting the worker.
 *
 * Not supported (parse error naming the tag): extends/block/include/import,
 * recursive loops, macro varargs/kwargs, printf-style `%` on strings. Case mapping
 * (upper/lower/title/capitalize) covers Latin, Greek, Cyrillic and Armenian letters;
 * other scripts pass through unchanged. */
#ifndef M40_JINJA_H
#define M40_JINJA_H

#include <stddef.h>
#include <stdint.h>
#include <time.h>

#include <jansson.h>

typedef struct m40_jinja m40_jinja;
typedef struct m40_jarena m40_jarena;

typedef enum {
    M40_JV_UNDEFINED = 0, /* jinja2's Undefined: prints "", falsy, iterates empty */
    M40_JV_NONE,
    M40_JV_BOOL,
    M40_JV_INT,
    M40_JV_FLOAT,
    M40_JV_STRING,
    M40_JV_LIST,      /* also tuples (flag on the list): repr "(a, b)" */
    M40_JV_DICT,      /* insertion-ordered, like Python dicts */
    M40_JV_NAMESPACE, /* namespace(): mutable attribute bag, shared by reference */
    M40_JV_CALLABLE,  /* macros, builtins, bound methods (msg.items) */
} m40_jtype;

typedef struct m40_jstr m40_jstr;
typedef struct m40_jlist m40_jlist;
typedef struct m40_jdict m40_jdict;
typedef struct m40_jcallable m40_jcallable;

/* A small tagged value, passed by value; strings/lists/dicts live in an arena. */
typedef struct m40_jvalue {
    m40_jtype type;
    union {
        int b;
        int64_t i;
        double f;
        m40_jstr *s;
        m40_jlist *l;
        m40_jdict *d;
        m40_jcallable *fn;
    } u;
} m40_jvalue;

/* ---- arena: every non-scalar value is allocated from one ---- */

/* cap_bytes bounds the total allocated (0: 256 MiB). NULL when out of memory. */
m40_jarena *m40_jarena_new(size_t cap_bytes);
void m40_jarena_free(m40_jarena *a);

/* ---- constructors ---- */
m40_jvalue m40_jv_undefined(void);
m40_jvalue m40_jv_none(void);
m40_jvalue m40_jv_bool(int b);
m40_jvalue m40_jv_int(int64_t i);
m40_jvalue m40_jv_float(double f);
/* The heap constructors return 0, or -1 when the arena is exhausted. Strings are
 * UTF-8 and copied. */
int m40_jv_str(m40_jarena *a, const char *s, size_t len, m40_jvalue *out);
int m40_jv_cstr(m40_jarena *a, const char *s, m40_jvalue *out);
int m40_jv_list(m40_jarena *a, m40_jvalue *out);
int m40_jv_list_push(m40_jarena *a, m40_jvalue list, m40_jvalue item);
int m40_jv_dict(m40_jarena *a, m40_jvalue *out);
/* Insert or replace (replacing keeps the key's position, as Python does). */
int m40_jv_dict_set(m40_jarena *a, m40_jvalue dict, m40_jvalue key, m40_jvalue val);
int m40_jv_dict_set_cstr(m40_jarena *a, m40_jvalue dict, const char *key, m40_jvalue val);
/* Lookup; returns UNDEFINED when absent. */
m40_jvalue m40_jv_dict_get_cstr(m40_jvalue dict, const char *key);

/* Convert JSON: object -> dict (key order kept), array -> list, integer -> int,
 * real -> float, true/false -> bool, null -> none. 0, or -1 with a message. */
int m40_jv_from_json(m40_jarena *a, const json_t *j, m40_jvalue *out, char *err, size_t errlen);

/* ---- templates ---- */

typedef struct {
    size_t max_output;  /* bytes of rendered text (0: 4 MiB) */
    size_t max_memory;  /* bytes of values made while rendering (0: 64 MiB) */
    uint64_t max_steps; /* loop iterations + calls + output pieces (0: 10 million) */
    int max_depth;      /* nested macro calls (0: 64) */
    /* strftime_now(): 0 -> the current local time; otherwise this instant, in UTC
     * (tests fix the date this way). */
    time_t now;
} m40_jinja_limits;

/* Parse once. 0, or -1 with "line N: message" in err. */
int m40_jinja_parse(const char *src, size_t len, m40_jinja **out, char *err, size_t errlen);
void m40_jinja_free(m40_jinja *t);

/* Render with ctx, a dict of variables (its values are only read). limits may be
 * NULL. On success *out is a malloc'd NUL-terminated string (free() it) and
 * *out_len its length. On failure -1 with the message in err; raise_exception(msg)
 * produces exactly msg. */
int m40_jinja_render(const m40_jinja *t, m40_jvalue ctx, const m40_jinja_limits *limits,
                     char **out, size_t *out_len, char *err, size_t errlen);

/* Convenience for the request path: parse and render a chat template with the
 * variables Hugging Face's apply_chat_template passes: messages (JSON array of
 * {role, content, ...}), tools (NULL -> none, as HF passes None), add_generation_prompt,
 * bos_token, eos_token (NULL -> ""), plus every member of extra (nullable JSON object:
 * documents, date_string, enable_thinking, ...). raise_exception and strftime_now are
 * always available. */
int m40_chat_template_render(const char *template_src, const json_t *messages,
                             const json_t *tools, int add_generation_prompt,
                             const char *bos, const char *eos, const json_t *extra,
                             const m40_jinja_limits *limits, char **out, size_t *out_len,
                             char *err, size_t errlen);

/* OpenAI messages carry tool_calls[].function.arguments as JSON text; most templates
 * want the object (vLLM and transformers pass one). A deep copy of messages with every
 * such text that holds a JSON object replaced by the object, or NULL when none does
 * (or out of memory): then render messages as they are. chat_args.c says why the
 * caller falls back to the text when a template refuses the objects. */
json_t *m40_chat_arguments_as_objects(const json_t *messages);
/* gpt-oss's (harmony) template reads an assistant's analysis from `thinking` and tests
 * `"<|channel|>..." in message.content`, which a null content fails; OpenAI clients send
 * the analysis back as reasoning_content and a tool-call turn's content as null. A deep
 * copy for that template, as llama.cpp prepares it: on assistant turns with tool_calls, a
 * null content is left out, and reasoning_content becomes `thinking` when the turn has
 * none and no content (the template refuses both at once). NULL when nothing changes (or
 * out of memory): render messages as they are. */
json_t *m40_chat_harmony_messages(const json_t *messages);

/* Same with an already parsed template (the engine parses once per model). */
int m40_chat_template_render_parsed(const m40_jinja *t, const json_t *messages,
                                    const json_t *tools, int add_generation_prompt,
                                    const char *bos, const char *eos, const json_t *extra,
                                    const m40_jinja_limits *limits, char **out,
                                    size_t *out_len, char *err, size_t errlen);

#endif
