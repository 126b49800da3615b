/* ngx_http_m40_module: nginx side of m40 (shared declarations).
 *
 * Files:
 *   ngx_http_m40_module.c    directives, configuration, URI routing
 *   ngx_http_m40_engines.c   a worker's engines (one per m40_model): start, GPU load
 *                            order, keep_alive and m40_max_resident, eventfds
 *   ngx_http_m40_params.c    request body JSON -> validated generation parameters
 *                            (the checks, tools included: engine/serve/api_params.c)
 *   ngx_http_m40_generate.c  the request path of every generating endpoint: body,
 *                            (a dialect's conversion,) submission, engine wake-ups,
 *                            cleanup; chat and completions' JSON answers
 *   ngx_http_m40_stream.c    the same as Server-Sent Events, with back pressure
 *   ngx_http_m40_output.c    JSON to buffers, response objects (usage, logprobs),
 *                            OpenAI-shaped errors, UTF-8 repair
 *   ngx_http_m40_tools.c     the output parser's glue (the tool fields' checks are
 *                            in engine/serve/api_params.c)
 *   ngx_http_m40_responses.c /v1/responses (OpenAI Responses API): its request as a
 *                            chat request, its response object and typed SSE events
 *   ngx_http_m40_messages.c  /v1/messages and /v1/messages/count_tokens (Anthropic
 *                            Messages API): the same, and Anthropic's error shape
 *   ngx_http_m40_info.c      /v1/models, /health, /metrics
 *   ngx_http_m40_shm.c       the metrics zone: every worker's engines' counters and
 *                            states in shared memory, summed by model
 *   ngx_http_m40_errors.c    nginx's own error pages as OpenAI error JSON
 *   ngx_http_m40_json.c      large request bodies' JSON parsed on a thread of the
 *                            worker, off the event loop
 *   ngx_http_m40_eventfd.c   an eventfd as a pseudo connection in the event loop
 *                            (the engine's and the JSON thread's wake-ups)
 *
 * Each m40_model has an engine (engine/m40_engine.h) in every worker, with its own
 * thread; nothing here blocks on it. */
#ifndef NGX_HTTP_M40_MODULE_H
#define NGX_HTTP_M40_MODULE_H

#include <ngx_config.h>
#include <ngx_core.h>
#include <ngx_http.h>

#include <jansson.h>

#include "m40_engine.h"
#include "m40_chat_parse.h"

#define NGX_HTTP_M40_MAX_N     8
#define NGX_HTTP_M40_MAX_STOP  4
#define NGX_HTTP_M40_TOOL_PARSER_AUTO  99

typedef struct ngx_http_m40_main_conf_s  ngx_http_m40_main_conf_t;
typedef struct ngx_http_m40_shm_slot_s  ngx_http_m40_shm_slot_t;

/* Where a model's engine is in this worker. Engines on one GPU load one after the
 * other (each one's KV share is taken from what the earlier ones left), so a later one
 * can be PENDING while an earlier one loads. */
#define NGX_HTTP_M40_ENGINE_PENDING  0      /* not created yet */
#define NGX_HTTP_M40_ENGINE_STARTED  1      /* engine != NULL: its own state says more */
#define NGX_HTTP_M40_ENGINE_NONE     2      /* could not be created (logged) */
#define NGX_HTTP_M40_ENGINE_UNLOADED 3      /* keep_alive: not loaded until a request */

/* What the module counts of a model beside the engine's statistics (the loads that
 * keep_alive and m40_max_resident cause, and the requests that waited for one). */
typedef struct {
    uint64_t             loads;               /* engines started */
    uint64_t             unloads;             /* engines unloaded after keep_alive */
    uint64_t             load_waits;          /* requests that waited for a load */
    double               load_wait_seconds;   /* the time they waited */
} ngx_http_m40_mcounters_t;

/* One m40_model: its settings (each unset one takes the http block's m40_* directive)
 * and, per worker, its engine. */
typedef struct {
    ngx_str_t            model_path;
    ngx_str_t            model_name;
    ngx_uint_t           index;               /* in mcf->models; 0: the default */
    off_t                file_size;           /* the GGUF's: later models' weights, roughly */
    ngx_int_t            device;              /* -1: CPU, else base GPU index */
    ngx_int_t            tp;                  /* GPUs per engine (tensor parallelism) */
    ngx_int_t            ctx_size;
    ngx_int_t            max_seqs;
    ngx_int_t            max_queue;
    ngx_int_t            threads;
    double               gpu_memory_fraction; /* -1: unset; 0: the engine's default */
    double               kv_share;            /* -1: unset; then equal parts (README) */
    int64_t              kv_keep_bytes;       /* the weights of later models on the GPU */
    ngx_int_t            prefill_chunk;
    ngx_int_t            prefill_budget;
    double               itl_guard;           /* -2: unset; -1: off; 0: the engine's default */
    ngx_flag_t           batch_invariant;     /* every row computed as alone (GPU) */
    ngx_str_t            chat_template;       /* file content, NUL-terminated */
    ngx_uint_t           tool_parser;
    ngx_uint_t           reasoning;
    ngx_msec_t           keep_alive;          /* 0: loaded at start, never unloaded */

    /* Per worker (set in init_process, after fork). */
    ngx_http_m40_main_conf_t *mcf;
    ngx_uint_t           active;              /* requests routed to it, not ended */
    ngx_msec_t           last_used;           /* when the last one ended (LRU) */
    ngx_event_t          idle_ev;             /* keep_alive: unloads it when it fires */
    m40_engine_stats     base;                /* counters of its engines unloaded before */
    ngx_http_m40_mcounters_t  mc;
    m40_engine          *engine;
    ngx_uint_t           engine_status;       /* NGX_HTTP_M40_ENGINE_* */
    ngx_int_t            worker_device;       /* the device of this worker's engine */
    ngx_connection_t    *event_conn;          /* the engine's eventfd in the event loop */
    ngx_flag_t           load_logged;         /* READY or FAILED has been logged */
    ngx_http_m40_shm_slot_t *slot;            /* its counters in the metrics zone */
} ngx_http_m40_model_t;

struct ngx_http_m40_main_conf_s {
    ngx_array_t          models;              /* of ngx_http_m40_model_t; [0] the default */
    /* The http block's m40_* settings: every model's that it does not set itself. */
    ngx_int_t            device;              /* -1: CPU, else base GPU index */
    ngx_int_t            ctx_size;
    ngx_int_t            max_seqs;
    ngx_int_t            max_queue;
    ngx_int_t            max_tokens_default;
    ngx_int_t            max_tokens_limit;
    ngx_int_t            threads;
    ngx_flag_t           cpu_exact;           /* m40_cpu_exact: the CPU's exact products */
    ngx_flag_t           batch_invariant;     /* m40_batch_invariant */
    double               gpu_memory_fraction; /* -1: unset; 0: the engine's default */
    ngx_int_t            prefill_chunk;       /* 0: the engine's default */
    ngx_int_t            prefill_budget;      /* 0: automatic (the engine's) */
    double               itl_guard;           /* -2: unset; -1: off; 0: the engine's default */
    ngx_str_t            chat_template;       /* file content, NUL-terminated */
    ngx_flag_t           api_used;            /* some location has m40_api */
    ngx_msec_t           load_wait;           /* m40_load_wait: requests wait this long for a loading model */
    ngx_uint_t           tool_parser;         /* m40_tool_format, or ..._AUTO: from the template */
    ngx_uint_t           reasoning;           /* m40_reasoning_mode */
    ngx_uint_t           max_resident;        /* m40_max_resident; 0: no limit */
    ngx_shm_zone_t      *shm_zone;            /* the metrics zone (ngx_http_m40_shm.c) */

    /* Per worker (set in init_process, after fork). */
    ngx_rbtree_t         choices;             /* live engine requests by id (all engines) */
    ngx_rbtree_node_t    choices_sentinel;
    ngx_rbtree_key_t     next_id;
    time_t               start_time;
};

typedef struct {
    ngx_flag_t           api;
    ngx_flag_t           ui;                  /* m40_ui: the chat page */
    size_t               prefix_hash_bytes;   /* m40_prefix_hash_bytes ($m40_prefix_hash) */
} ngx_http_m40_loc_conf_t;

typedef struct {
    ngx_flag_t           json_errors;         /* a location of this server has m40_api */
} ngx_http_m40_srv_conf_t;

typedef enum {
    NGX_HTTP_M40_CHAT = 0,
    NGX_HTTP_M40_COMPLETIONS
} ngx_http_m40_kind_e;

/* Validated request, ready to be turned into m40_request_params. Strings point into
 * the parsed JSON document or the request pool. */
typedef struct {
    ngx_http_m40_kind_e  kind;
    json_t              *messages;            /* chat: flattened copy (owned) */
    ngx_str_t            prompt;              /* completions */
    ngx_int_t            max_tokens;
    ngx_uint_t           n;
    float                temperature;
    float                top_p;
    float                min_p;
    ngx_int_t            top_k;
    float                presence_penalty;
    float                frequency_penalty;
    ngx_flag_t           has_seed;
    uint64_t             seed;
    char                *stop[NGX_HTTP_M40_MAX_STOP];
    ngx_uint_t           n_stop;
    int32_t             *bias_ids;
    float               *bias_values;
    ngx_uint_t           n_bias;
    ngx_flag_t           logprobs;
    ngx_int_t            top_logprobs;
    ngx_flag_t           stream;
    ngx_flag_t           include_usage;
    ngx_flag_t           echo;                /* completions: echo the prompt */
    ngx_flag_t           ignore_eos;          /* not OpenAI's: run to max_tokens */
    /* chat tools (ngx_http_m40_tools.c) */
    json_t              *tools;               /* for the template (owned); NULL: none */
    ngx_uint_t           tool_choice;         /* NGX_HTTP_M40_TOOL_CHOICE_* */
    ngx_flag_t           parallel_tool_calls; /* default 1 */
    json_t              *template_kwargs;     /* chat_template_kwargs (owned) */
    /* constrained decoding: at most one (compiled by the engine, errors come as 400s) */
    char                *grammar;             /* "grammar": GBNF source */
    char                *json_schema;         /* response_format json_schema: schema text */
    ngx_flag_t           json_object;         /* response_format json_object */
} ngx_http_m40_params_t;

#define NGX_HTTP_M40_TOOL_CHOICE_AUTO      0
#define NGX_HTTP_M40_TOOL_CHOICE_NONE      1
#define NGX_HTTP_M40_TOOL_CHOICE_REQUIRED  2
#define NGX_HTTP_M40_TOOL_CHOICE_NAMED     3

/* An OpenAI-shaped error: HTTP status, message, type, param, code. */
typedef struct {
    ngx_uint_t           status;
    const char          *type;
    const char          *param;
    const char          *code;
    char                 message[512];
} ngx_http_m40_error_t;

/* A request body parsed on the JSON thread (ngx_http_m40_json.c). The thread owns
 * data until it has parsed it; the event loop owns everything else. */
typedef struct ngx_http_m40_json_job_s  ngx_http_m40_json_job_t;

struct ngx_http_m40_json_job_s {
    ngx_http_m40_json_job_t  *next;
    u_char                   *data;       /* malloc'd copy of the body */
    size_t                    len;
    /* a body in a temp file is read by the thread, through a dup of its fd (the
     * request's pool closes the file when the request ends): -1 when data is filled */
    ngx_fd_t                  fd;
    off_t                     file_pos;
    int                       read_err;   /* errno of that read (no JSON then) */
    json_t                   *root;       /* the result, or NULL and err */
    json_error_t              err;
    /* on the event loop once parsed, unless cancelled; may take root */
    void                    (*handler)(ngx_http_m40_json_job_t *job);
    void                     *ctx;
    ngx_uint_t                state;      /* under the thread's mutex */
    unsigned                  cancelled:1;
};

/* Bodies this large or larger go to the JSON thread; smaller ones are parsed inline,
 * where a thread's round trip would cost more than the parse (jansson: about 10 ms
 * of CPU for 1 MB, so 64 KB is well under a millisecond). */
#define NGX_HTTP_M40_JSON_THREAD_MIN  (64 * 1024)

typedef struct ngx_http_m40_ctx_s  ngx_http_m40_ctx_t;
typedef struct ngx_http_m40_choice_s  ngx_http_m40_choice_t;

/* Where a streamed event goes: the round's output chain (ngx_http_m40_stream.c). */
typedef struct {
    ngx_http_m40_ctx_t      *ctx;
    ngx_http_m40_choice_t   *ch;
    ngx_chain_t           ***last;
    size_t                  *bytes;
} ngx_http_m40_sse_t;

/* An API dialect beside OpenAI's chat and completions (which need none): its request
 * becomes a chat completions request that goes through the one request path
 * (validation, submission, output parsing); only its bytes differ. Its output always
 * goes through the output parser (content, reasoning and tool call pieces). n is 1. */
typedef struct {
    const char  *name;                /* for the log */
    /* the body -> the chat request (a new reference); NULL with err set */
    json_t     *(*request)(ngx_http_m40_ctx_t *ctx, json_t *body,
                           ngx_http_m40_error_t *err);
    json_t     *(*error_json)(ngx_http_m40_error_t *err);  /* NULL: OpenAI's */
    ngx_int_t   (*send)(ngx_http_m40_ctx_t *ctx);          /* non-streaming answer */
    /* streaming: the opening events, each piece (ud: ngx_http_m40_sse_t), the end
     * of the output, and an error after the headers */
    ngx_int_t   (*open)(ngx_http_m40_sse_t *out);
    m40_piece_cb  piece;
    ngx_int_t   (*done)(ngx_http_m40_sse_t *out);
    ngx_int_t   (*fail)(ngx_http_m40_sse_t *out, ngx_http_m40_error_t *err);
} ngx_http_m40_dialect_t;

struct ngx_http_m40_choice_s {
    ngx_rbtree_node_t    node;                /* key: id given to the engine */
    ngx_http_m40_ctx_t  *ctx;
    m40_request         *req;
    ngx_uint_t           index;
    unsigned             done:1;
    unsigned             in_tree:1;
    m40_finish           finish;
    int32_t              prompt_tokens;
    int32_t              cached_tokens;     /* of prompt_tokens, from the prefix cache */
    int32_t              completion_tokens;
    /* Non-streaming: accumulated text and logprobs. */
    u_char              *text;
    size_t               text_len;
    size_t               text_cap;
    json_t              *logprobs;            /* chat: content array; completions: object */
    size_t               text_offset;         /* completions logprobs text_offset */
    /* Output parsing (ngx_http_m40_tools.c), when the request's ctx->parse. */
    m40_chat_parse      *parser;
    json_t              *tool_calls;          /* non-streaming: the calls so far */
    ngx_uint_t           n_tool_calls;        /* calls passed on (streaming too) */
    u_char              *reasoning;           /* non-streaming: reasoning text */
    size_t               reasoning_len;
    size_t               reasoning_cap;
    int32_t              stop_matched;        /* the DONE event's */
};

struct ngx_http_m40_ctx_s {
    ngx_http_request_t       *request;
    ngx_http_m40_main_conf_t *mcf;
    ngx_http_m40_model_t     *model;          /* the request's "model" (NULL: not known yet) */
    ngx_http_m40_kind_e       kind;
    ngx_http_m40_choice_t    *choices;
    ngx_uint_t                n;
    ngx_uint_t                n_done;
    ngx_uint_t                n_top;
    unsigned                  stream:1;
    unsigned                  include_usage:1;
    unsigned                  logprobs:1;
    unsigned                  header_sent:1;
    unsigned                  finished:1;
    unsigned                  waiting_write:1;
    unsigned                  parse:1;        /* output goes through m40_chat_parse */
    unsigned                  parallel_tool_calls:1;
    ngx_uint_t                tool_format;    /* m40_tool_format */
    ngx_uint_t                reasoning;      /* m40_reasoning_mode */
    char                      id[40];
    time_t                    created;
    ngx_str_t                 echo_prefix;    /* completions echo */
    ngx_chain_t              *free;
    ngx_chain_t              *busy;
    ngx_event_t               linger;         /* holds off graceful shutdown */
    ngx_event_t               load_ev;        /* m40_load_wait: the next look at a loading engine */
    ngx_msec_t                load_waited;
    ngx_msec_t                load_since;     /* when it began to wait for its model */
    unsigned                  load_waiting:1;
    const ngx_http_m40_dialect_t *dialect;    /* NULL: OpenAI chat or completions */
    void                     *dstate;         /* the dialect's, in the request pool */
    json_t                   *body;           /* a dialect's original request (echoed) */
    ngx_http_m40_json_job_t  *json_job;       /* the body being parsed on the JSON thread */
    json_t                   *json_root;      /* its result, until start takes it */
    json_error_t              json_err;       /* its error when json_root is NULL */
    unsigned                  json_parsed:1;  /* json_root/json_err hold the body's parse */
    unsigned                  json_failed:1;  /* the thread could not read the body */
    unsigned                  count_only:1;   /* count_tokens: prompt only */
    unsigned                  forced_tools:1; /* tool_choice required/named: by grammar */
};

extern ngx_module_t  ngx_http_m40_module;

/* ngx_http_m40_module.c */
/* The model of that name; NULL when none has it. */
ngx_http_m40_model_t *ngx_http_m40_model_find(ngx_http_m40_main_conf_t *mcf,
    const u_char *name, size_t len);


/* ngx_http_m40_engines.c */
void ngx_http_m40_engines_init(ngx_cycle_t *cycle, ngx_http_m40_main_conf_t *mcf);
void ngx_http_m40_engines_exit(ngx_cycle_t *cycle, ngx_http_m40_main_conf_t *mcf);
/* Loading, ready or failed as m40_engine_state, for an engine of this worker that is
 * not created yet (PENDING: loading) or could not be (failed) too. */
m40_engine_state ngx_http_m40_model_state(ngx_http_m40_model_t *model,
    char *err, size_t errlen);
/* A request is routed to the model (NGX_OK; NGX_ERROR without memory): it stays in use
 * until the request ends, and an unloaded one (keep_alive) starts loading when
 * m40_max_resident leaves room. */
ngx_int_t ngx_http_m40_model_use(ngx_http_request_t *r, ngx_http_m40_model_t *m);
/* An unloaded model that waits for room (m40_max_resident): tries again. */
void ngx_http_m40_model_load(ngx_http_m40_model_t *m);
/* The engine's statistics with the counters of its unloaded predecessors. */
void ngx_http_m40_model_stats(ngx_http_m40_model_t *m, m40_engine_stats *s);
ngx_int_t ngx_http_m40_choice_register(ngx_http_m40_main_conf_t *mcf,
    ngx_http_m40_choice_t *ch);
void ngx_http_m40_choice_unregister(ngx_http_m40_main_conf_t *mcf,
    ngx_http_m40_choice_t *ch);

/* ngx_http_m40_eventfd.c */
ngx_connection_t *ngx_http_m40_eventfd_add(int fd, ngx_event_handler_pt handler,
    void *data, const char *what, ngx_log_t *log);
void ngx_http_m40_eventfd_drain(ngx_event_t *rev);
void ngx_http_m40_eventfd_rearm(ngx_event_t *rev);
void ngx_http_m40_eventfd_del(ngx_connection_t *c);

/* ngx_http_m40_json.c */
ngx_int_t ngx_http_m40_json_init(ngx_cycle_t *cycle);
void ngx_http_m40_json_exit(ngx_cycle_t *cycle);
/* A job with room for len bytes of body in data; NULL when the thread does not run
 * (the caller parses inline) or without memory. */
ngx_http_m40_json_job_t *ngx_http_m40_json_job_create(size_t len, ngx_log_t *log);
/* Queues a job (data, handler and ctx set). The handler runs on the event loop once
 * it is parsed, unless it was cancelled; this file frees the job afterwards. */
void ngx_http_m40_json_submit(ngx_http_m40_json_job_t *job);
/* A job that was never submitted, or one the caller got back. */
void ngx_http_m40_json_job_free(ngx_http_m40_json_job_t *job);
/* The request is gone: the job's result is freed when it comes, unparsed if it has
 * not started. */
void ngx_http_m40_json_cancel(ngx_http_m40_json_job_t *job);

/* ngx_http_m40_errors.c */
ngx_int_t ngx_http_m40_errors_init(ngx_conf_t *cf);

/* ngx_http_m40_prefix.c: $m40_prefix_hash, for a front balancing m40 hosts */
#define NGX_HTTP_M40_PREFIX_HASH_BYTES_MAX  (256 * 1024)
ngx_int_t ngx_http_m40_prefix_add_variables(ngx_conf_t *cf);

/* ngx_http_m40_ui.c: the m40_ui directive and the chat page */
char *ngx_http_m40_ui(ngx_conf_t *cf, ngx_command_t *cmd, void *conf);
ngx_int_t ngx_http_m40_ui_serve(ngx_http_request_t *r);

/* ngx_http_m40_params.c */
ngx_int_t ngx_http_m40_parse_params(ngx_http_request_t *r,
    ngx_http_m40_main_conf_t *mcf, ngx_http_m40_model_t *model,
    ngx_http_m40_kind_e kind, json_t *root,
    ngx_http_m40_params_t *p, ngx_http_m40_error_t *err);
void ngx_http_m40_error_set(ngx_http_m40_error_t *err, ngx_uint_t status,
    const char *type, const char *param, const char *code, const char *fmt, ...);

/* ngx_http_m40_generate.c */
ngx_int_t ngx_http_m40_generate_handler(ngx_http_request_t *r,
    ngx_http_m40_kind_e kind, const ngx_http_m40_dialect_t *dialect);
void ngx_http_m40_ctx_wake(ngx_http_m40_ctx_t *ctx);
ngx_int_t ngx_http_m40_process(ngx_http_m40_ctx_t *ctx);
void ngx_http_m40_choice_done(ngx_http_m40_ctx_t *ctx,
    ngx_http_m40_choice_t *ch, m40_event *ev);
void ngx_http_m40_event_error(ngx_http_m40_error_t *err, m40_event *ev);
/* Appends to a growing buffer of the request's pool. */
ngx_int_t ngx_http_m40_append(ngx_http_request_t *r, u_char **buf,
    size_t *blen, size_t *bcap, const char *text, size_t len);

/* ngx_http_m40_stream.c */
ngx_int_t ngx_http_m40_pump(ngx_http_m40_ctx_t *ctx);
ngx_int_t ngx_http_m40_sse_event(ngx_http_m40_sse_t *out, const char *event,
    json_t *data);

/* ngx_http_m40_responses.c, ngx_http_m40_messages.c */
extern const ngx_http_m40_dialect_t  ngx_http_m40_responses_dialect;
extern const ngx_http_m40_dialect_t  ngx_http_m40_messages_dialect;
extern const ngx_http_m40_dialect_t  ngx_http_m40_count_tokens_dialect;
const char *ngx_http_m40_anthropic_error_type(ngx_uint_t status);

/* ngx_http_m40_output.c */
ngx_buf_t *ngx_http_m40_json_buf(ngx_pool_t *pool, json_t *json,
    const char *prefix, const char *suffix);
size_t ngx_http_m40_json_write(json_t *json, ngx_buf_t *b, const char *prefix,
    const char *suffix);
json_t *ngx_http_m40_json_text(const char *s, size_t len);
ngx_int_t ngx_http_m40_send_json(ngx_http_request_t *r, ngx_uint_t status,
    json_t *json);
ngx_int_t ngx_http_m40_send_error(ngx_http_request_t *r,
    ngx_http_m40_error_t *err);
ngx_int_t ngx_http_m40_send_simple_error(ngx_http_request_t *r,
    ngx_uint_t status, const char *type, const char *code, const char *fmt, ...);
json_t *ngx_http_m40_error_json(ngx_http_m40_error_t *err);
const char *ngx_http_m40_finish_reason(m40_finish f);
json_t *ngx_http_m40_usage_json(ngx_http_m40_ctx_t *ctx);
json_t *ngx_http_m40_object(ngx_http_m40_ctx_t *ctx, const char *object,
    json_t *choices);
ngx_int_t ngx_http_m40_logprobs_add(ngx_http_m40_ctx_t *ctx,
    ngx_http_m40_choice_t *ch, json_t *lp, m40_event *ev);

/* ngx_http_m40_tools.c */
void ngx_http_m40_output_mode(ngx_http_m40_ctx_t *ctx,
    ngx_http_m40_params_t *p);
ngx_int_t ngx_http_m40_parser_feed(ngx_http_m40_ctx_t *ctx,
    ngx_http_m40_choice_t *ch, m40_event *ev, m40_piece_cb cb, void *ud);
json_t *ngx_http_m40_tool_call_json(const m40_piece *pc, ngx_flag_t with_index);
void ngx_http_m40_parser_free(ngx_http_m40_choice_t *ch);

/* ngx_http_m40_shm.c */
#define NGX_HTTP_M40_SHM_SLOTS   512      /* engines of all workers, reloads included */
#define NGX_HTTP_M40_SHM_NAMES   64       /* model names whose retired counters are kept */
#define NGX_HTTP_M40_NAME_MAX    128

/* A model's engines over every worker, for /metrics, /health and /v1/models. */
typedef struct {
    m40_engine_stats     s;                   /* counters summed, gauges summed */
    ngx_http_m40_mcounters_t  mc;
    ngx_uint_t           engines;             /* live slots (one per worker) */
    ngx_uint_t           pending, loading, ready, failed, unloaded;
} ngx_http_m40_agg_t;

ngx_int_t ngx_http_m40_shm_add(ngx_conf_t *cf, ngx_http_m40_main_conf_t *mcf);
void ngx_http_m40_shm_attach(ngx_cycle_t *cycle, ngx_http_m40_main_conf_t *mcf);
void ngx_http_m40_shm_publish(ngx_http_m40_model_t *model);
void ngx_http_m40_shm_detach(ngx_http_m40_main_conf_t *mcf);
void ngx_http_m40_shm_count_http(ngx_http_m40_main_conf_t *mcf);
uint64_t ngx_http_m40_shm_http_requests(ngx_http_m40_main_conf_t *mcf);
/* Every model name the zone knows (the configured ones first, then those of older
 * configurations' engines still counted): calls cb with each one's sum. */
typedef void (*ngx_http_m40_agg_cb)(void *data, const u_char *name, size_t len,
    ngx_http_m40_agg_t *agg);
void ngx_http_m40_shm_collect(ngx_http_m40_main_conf_t *mcf,
    ngx_http_m40_agg_cb cb, void *data);
/* to += s: the counters, and the gauges too when gauges is set. */
void ngx_http_m40_stats_add(m40_engine_stats *to, const m40_engine_stats *s,
    ngx_flag_t gauges);
void ngx_http_m40_mc_add(ngx_http_m40_mcounters_t *to,
    const ngx_http_m40_mcounters_t *mc);
/* One model's sum; the engines of this worker that are not in the zone (a full
 * zone) are counted from their own state. */
void ngx_http_m40_shm_model(ngx_http_m40_model_t *model, ngx_http_m40_agg_t *agg);

/* ngx_http_m40_info.c */
ngx_int_t ngx_http_m40_models_handler(ngx_http_request_t *r, ngx_str_t *id);
ngx_int_t ngx_http_m40_health_handler(ngx_http_request_t *r);
ngx_int_t ngx_http_m40_metrics_handler(ngx_http_request_t *r);

#endif
