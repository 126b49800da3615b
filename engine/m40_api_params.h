/* The OpenAI request body (chat or completions JSON) -> validated generation parameters.
 *
 * Public beside m40_engine.h (the nginx module includes both and nothing deeper); the
 * code is engine/serve/api_params.c, plain C and jansson, no nginx headers, so that a
 * libFuzzer harness (tests/fuzz/fuzz_params.c) and unit tests drive exactly what the
 * module runs on every request. The module copies the result into its request pool.
 *
 * Unknown fields are ignored (clients send many); a known field with the wrong type or
 * out of range is a 400 naming the field in "param". null counts as absent. */
#ifndef M40_API_PARAMS_H
#define M40_API_PARAMS_H

#include <stddef.h>
#include <stdint.h>

#include <jansson.h>

#define M40_API_MAX_N     8
#define M40_API_MAX_STOP  4

#define M40_API_TOOL_CHOICE_AUTO      0
#define M40_API_TOOL_CHOICE_NONE      1
#define M40_API_TOOL_CHOICE_REQUIRED  2
#define M40_API_TOOL_CHOICE_NAMED     3

/* An OpenAI-shaped error: HTTP status, type, param, code and message. */
typedef struct {
    int status;
    const char *type;
    const char *param;          /* NULL: null */
    const char *code;           /* NULL: null */
    char message[512];          /* always NUL-terminated; may be cut inside a character */
} m40_api_error;

/* What the server allows. */
typedef struct {
    const char *model_name;     /* a request's "model" must be this (else 404) */
    size_t model_name_len;
    int64_t max_tokens_default; /* when the request names none */
    int64_t max_tokens_limit;   /* the most a request may ask for */
} m40_api_limits;

/* Strings point into the parsed JSON document (keep it alive) unless said otherwise;
 * the owned ones are released by m40_api_params_free. */
typedef struct {
    int chat;                   /* 1: /v1/chat/completions, 0: /v1/completions */
    json_t *messages;           /* chat: flattened copy (owned) */
    const char *prompt;         /* completions */
    size_t prompt_len;
    int64_t max_tokens;
    uint32_t n;
    float temperature;
    float top_p;
    float min_p;
    int64_t top_k;
    float presence_penalty;
    float frequency_penalty;
    int has_seed;
    uint64_t seed;
    const char *stop[M40_API_MAX_STOP];
    uint32_t n_stop;
    int32_t *bias_ids;          /* owned */
    float *bias_values;         /* owned */
    uint32_t n_bias;
    int logprobs;
    int64_t top_logprobs;
    int stream;
    int include_usage;
    int echo;                   /* completions: echo the prompt */
    int ignore_eos;             /* not OpenAI's: run to max_tokens */
    /* chat tools */
    json_t *tools;              /* for the template (owned); NULL: none */
    unsigned tool_choice;       /* M40_API_TOOL_CHOICE_* */
    int parallel_tool_calls;    /* default 1 */
    json_t *template_kwargs;    /* chat_template_kwargs (owned) */
    /* constrained decoding: at most one (compiled by the engine, which refuses a bad one) */
    char *grammar;              /* "grammar": GBNF source (owned) */
    char *json_schema;          /* response_format json_schema: the schema's text (owned) */
    int json_object;            /* response_format json_object */
} m40_api_params;

/* 0 and *p filled, or -1 with *err set (p's owned parts are released either way by
 * m40_api_params_free, which is safe on a zeroed or partly filled p). */
int m40_api_parse_params(json_t *root, int chat, const m40_api_limits *lim, m40_api_params *p, m40_api_error *err);
void m40_api_params_free(m40_api_params *p);

/* Sets *err (printf format). */
void m40_api_error_set(m40_api_error *err, int status, const char *type, const char *param, const char *code,
                       const char *fmt, ...) __attribute__((format(printf, 6, 7)));

#endif
