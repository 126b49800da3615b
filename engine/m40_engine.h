/* The engine's public API: the only engine header the nginx module includes.
 *
 * One engine per nginx worker (per GPU). m40_engine_create starts a dedicated engine
 * thread that loads the model, starts a tokenizer thread and then runs the scheduler
 * loop. A submitted request first waits for the tokenizer thread, which renders its
 * chat template and tokenizes it (off the event loop and off the engine thread, so a
 * huge prompt stalls nobody's decoding; a prompt that is too long or a template that
 * fails is answered from there, with the same ERROR events as ever), then waits for a
 * slot. The engine thread admits tokenized requests, batches every live sequence
 * through one forward call per step, samples, detokenizes incrementally (UTF-8 safe),
 * matches stop strings (held back until they can no longer match) and pushes events
 * into each request's queue. Whenever a request gets events the engine writes the
 * eventfd; the worker's event loop reads it, calls m40_engine_ready() to learn which
 * requests have news, and m40_request_poll()s them. No call here blocks on inference
 * or tokenization: every function is safe to call from the event loop.
 *
 * Ownership: a request is shared by the engine and its submitter. The submitter ends
 * its side with m40_request_release() (after the final event, or at any time to
 * abandon it: that drops a request still waiting, lets the tokenizer thread drop one
 * it is working on when it is done, and cancels a running sequence, whose KV memory
 * returns to the pool at the next step). m40_engine_destroy joins both threads. */
#ifndef M40_ENGINE_H
#define M40_ENGINE_H

#include <stddef.h>
#include <stdint.h>

#include <jansson.h>

typedef struct m40_engine m40_engine;
typedef struct m40_request m40_request;

typedef struct {
    const char *model_path;
    const char *model_name;        /* public name in the API ("model" field) */
    int device;                    /* -1: CPU; >= 0: GPU index */
    int tp;                        /* tensor parallelism over GPUs device .. device + tp - 1
                                    * (NCCL); 0 or 1: one GPU */
    int32_t ctx_size;              /* per-sequence context; 0: the model's trained context */
    int32_t max_seqs;              /* concurrent sequences (batch slots); 0: automatic (below) */
    int32_t max_queue;             /* requests waiting (for tokenization or a slot) before 429;
                                    * 0: M40_DEFAULT_MAX_QUEUE */
    int32_t n_threads;             /* CPU threads; 0: all */
    int cpu_fast;                  /* CPU: 1 the fast int16 products (m40_model_options.cpu_fast;
                                    * the nginx module's default), 0 the exact F32 reference */
    const char *chat_template;     /* Jinja source overriding the GGUF's; NULL: the GGUF's, else the fallback */
    int32_t prefill_chunk;         /* prompt tokens of one sequence in one step (at most the
                                    * budget); 0: M40_DEFAULT_PREFILL_CHUNK */
    int32_t prefill_budget;        /* prompt tokens of all sequences in one step; 0: automatic
                                    * (M40_DEFAULT_PREFILL_BUDGET on a GPU, prefill_chunk on the CPU) */
    float itl_guard;               /* while sequences decode, a step with prompt tokens may take
                                    * this many times a decode-only step (>= 1); 0: the default,
                                    * M40_DEFAULT_ITL_GUARD (off); negative: no guard (the budget alone) */
    float gpu_memory_fraction;     /* GPU: share of the card's memory this engine may fill, (0, 1];
                                    * 0: the KV pool's default, 0.90 */
    /* GPU, several models on one card (m40_model ... kv_share=): the KV pool takes kv_share
     * of the room it could take alone (gpu_memory_fraction of the card less what is in use
     * and the activation reserve), after kv_keep_bytes are set aside for what loads after
     * it (the weights of later models on the card). 0 (both): the whole room, as alone. */
    float kv_share;                /* [0, 1]; 0: 1 */
    int batch_invariant;           /* GPU: 1 computes every row of a step as it would be computed
                                    * alone (m40_model_options.batch_invariant): a greedy
                                    * request's text does not depend on what else runs; slower */
    int64_t kv_keep_bytes;         /* >= 0 */
} m40_engine_config;

/* Defaults of the configuration's zeros.
 *
 * The GPU KV cache is a pool of 16-token blocks shared by all sequences. It takes what
 * is left of gpu_memory_fraction of the card once the weights, the engine's other
 * allocations and anything else on the card are counted and a reserve for the largest
 * step's activations is set aside (at most what M40_AUTO_MAX_SEQS sequences, or
 * max_seqs when larger, of full context need; the rest would only ever hold cached
 * prefixes).
 *
 * max_seqs 0 (automatic): on the CPU M40_CPU_MAX_SEQS (each slot owns a full context
 * of F32 KV memory there, and the cores, not the batch, bound throughput); on a GPU
 * as many sequences of M40_AUTO_SEQ_TOKENS tokens (or of the whole context when that is
 * shorter) as the pool holds, at least 1 and at most M40_AUTO_MAX_SEQS. Sequences
 * longer than that share the pool: when it runs short, the youngest running sequence
 * is preempted and recomputed later (its output so far stays sent). */
#define M40_DEFAULT_MAX_QUEUE 1024
/* Prompt tokens a step (engine/serve/prefill_policy.h says how they are shared). Per sequence:
 * a long prompt shares the step with the prompts behind it. All sequences together:
 * 512 by default, on the GPU too, and no ITL guard by default: on an H100 with a 7B F16
 * model at 64 streams (BENCHMARKS.md, thirteenth session) a budget of 2048 raised the
 * throughput (5,210 -> 5,796 tok/s) and halved the long-prompt rows' time to first token
 * but doubled the inter-token p99 (30 -> 63 ms, past the 60 ms target of issue 5 and the
 * 30 of issue 21), and the guard (2x) cut the throughput to 4,339 and multiplied the
 * time to first token by 9 for 20x instead of 27x on the long prompt's ITL. Both are
 * there for operators whose load wants them (m40_prefill_budget, m40_itl_guard). */
#define M40_DEFAULT_PREFILL_CHUNK 512
#define M40_DEFAULT_PREFILL_BUDGET 512
#define M40_DEFAULT_ITL_GUARD 0.0f /* off */
#define M40_MAX_PREFILL_TOKENS 65536
#define M40_CPU_MAX_SEQS 4
#define M40_AUTO_MAX_SEQS 256
#define M40_AUTO_SEQ_TOKENS 1024

typedef enum { M40_ENGINE_LOADING = 0, M40_ENGINE_READY = 1, M40_ENGINE_FAILED = 2 } m40_engine_state;

/* Starts the engine thread; returns at once (state LOADING). -1 with err when the
 * thread or the eventfd cannot be created. */
int m40_engine_create(const m40_engine_config *cfg, m40_engine **out, char *err, size_t errlen);
/* Stops the thread (running requests end with finish reason "cancelled") and frees
 * everything not still held by a submitter. */
void m40_engine_destroy(m40_engine *e);
/* Non-blocking eventfd (EFD_NONBLOCK): readable when some request has new events. */
int m40_engine_event_fd(const m40_engine *e);
/* err gets the load error when FAILED. */
m40_engine_state m40_engine_get_state(m40_engine *e, char *err, size_t errlen);
/* Model facts for /v1/models and validation (valid once READY). */
int32_t m40_engine_ctx_size(m40_engine *e);
int32_t m40_engine_n_vocab(m40_engine *e);
const char *m40_engine_model_name(const m40_engine *e);

/* What the engine sized at load (valid once READY). */
typedef struct {
    int device;                    /* -1: the CPU, else the GPU index */
    int32_t ctx;                   /* tokens per sequence */
    int32_t max_seqs;              /* concurrent sequences (batch slots) */
    int max_seqs_auto;             /* 1: chosen by the engine (the configuration said 0) */
    int32_t max_queue;
    int32_t prefill_budget;        /* prompt tokens a step, all sequences */
    int prefill_budget_auto;       /* 1: chosen by the engine */
    int32_t prefill_chunk;         /* prompt tokens a step, one sequence */
    float itl_guard;               /* 0: off */
    int64_t kv_tokens;             /* KV cache capacity in tokens (all sequences together) */
    int32_t kv_blocks;             /* GPU: blocks of kv_block_size tokens; 0 on the CPU */
    int32_t kv_block_size;         /* GPU: 16; 0 on the CPU */
    int64_t full_ctx_seqs;         /* sequences of ctx tokens that fit at once */
    /* GPU memory accounting behind the pool, bytes (0 on the CPU) */
    float gpu_memory_fraction;
    double gpu_total, gpu_in_use, gpu_reserve, kv_bytes;
} m40_engine_capacity;
/* 0, or -1 (nothing written) unless READY. */
int m40_engine_get_capacity(m40_engine *e, m40_engine_capacity *out);
/* The capacity as one line for the log, vLLM style: "KV cache: N tokens (B blocks of
 * 16, ...); X sequences of C tokens fit; max_seqs S (automatic); max_queue Q; prefill
 * P tokens a step, K a sequence; ITL guard G". Returns what snprintf returns. */
int m40_engine_capacity_line(const m40_engine_capacity *c, char *buf, size_t len);

/* The chat template in use (the configuration's, else the GGUF's), NUL-terminated and
 * alive as long as the engine; NULL when there is none or the engine is not READY. The
 * submitter reads it to choose how to parse the model's output (m40_chat_parse.h). */
const char *m40_engine_chat_template(m40_engine *e);

/* Reads the eventfd and returns up to cap user pointers (as given to submit) of
 * requests that have unread events. Call until it returns < cap. */
int m40_engine_ready(m40_engine *e, void **users, int cap);

/* How a request samples its tokens (engine/serve/sampler.h applies them on the CPU, the GPU
 * sampler the same on the device). Defined here, not in sampler.h, because it is part of
 * the request's parameters: the public API includes nothing of the engine's internals. */
typedef struct {
    float temperature;      /* 0: greedy */
    int32_t top_k;          /* <= 0: off */
    float top_p;            /* 1: off */
    float min_p;            /* 0: off */
    float repetition_penalty; /* 1: off (divides positive logits, multiplies negative) */
    float presence_penalty;   /* 0: off */
    float frequency_penalty;  /* 0: off */
    int32_t penalty_last_n;   /* window of recent tokens for penalties; <0: all */
    uint64_t seed;
    int32_t n_logit_bias;
    const int32_t *logit_bias_ids;
    const float *logit_bias_values;
    int32_t n_top_logprobs;   /* 0..20: how many top alternatives to report */
    int32_t skip_logprob;     /* 1: the chosen token's logprob is not wanted (reported as NaN;
                               * saves a pass of exp() over the vocabulary per token) */
} m40_sampler_params;

void m40_sampler_params_default(m40_sampler_params *p);

typedef struct {
    /* Exactly one of: messages (chat; JSON array of {"role","content"} objects, content
     * a string — the submitter flattens text parts; the engine keeps a reference), or
     * prompt/prompt_len (completions; raw text, no template). */
    json_t *messages;
    const char *prompt;
    size_t prompt_len;
    int add_generation_prompt;     /* chat: 1 (default) */
    int32_t max_tokens;            /* > 0 */
    m40_sampler_params sampling;   /* logit bias arrays are copied at submit */
    const char *const *stop;       /* stop strings (copied at submit) */
    int32_t n_stop;                /* 0..4 */
    int logprobs;                  /* report logprobs of each chosen token */
    int ignore_eos;                /* end-of-generation tokens do not end the output (benchmarks:
                                    * every request runs to max_tokens or the context) */
    /* Chat only, both nullable (the engine keeps deep copies): the template's `tools`
     * variable (JSON array of {"type":"function","function":{...}}; NULL renders as
     * None, as Hugging Face passes it) and more template variables (a JSON object:
     * chat_template_kwargs such as enable_thinking). */
    json_t *tools;
    json_t *template_kwargs;
    /* Constrained decoding (engine/grammar), at most one of the three (copied at submit).
     * The output is then a sentence of the grammar: tokens it does not allow are never
     * sampled, and the sequence ends (finish "stop") once the grammar is complete. The
     * engine compiles it on the tokenizer thread: an invalid one is answered with an
     * ERROR event, status 400, whose message names the problem. */
    const char *grammar;           /* GBNF source (llama-server's "grammar" field) */
    const char *json_schema;       /* JSON Schema text (response_format "json_schema") */
    int json_object;               /* 1: any JSON object (response_format "json_object") */
    /* tool_choice "required" or one named function (chat with tools; exclusive with the
     * three above): the output is constrained to calls of `tools`, each one's arguments
     * a sentence of its "parameters" schema, in the markup of this m40_tool_format
     * (m40_chat_parse.h): Hermes "<tool_call>\n{"name": .., "arguments": ..}\n</tool_call>",
     * Llama 3 {"name": .., "parameters": ..}, Mistral "[TOOL_CALLS][...]", bare JSON,
     * harmony "<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{..}"
     * (one call; tool names of letters, digits, '_' and '-' only, else 400).
     * So even a model that would never call returns a call the output parser takes.
     * 0 (M40_TOOLS_NONE): not forced. Compiled like a grammar (400s the same way). */
    int tool_call_format;
    int tool_call_parallel;        /* with tool_call_format: one or more calls; 0: exactly one */
    /* Count the prompt only: the tokenizer thread renders and tokenizes it, and the
     * request ends there with DONE (finish "stop", prompt_tokens, no completion tokens);
     * nothing runs through the model (Anthropic's /v1/messages/count_tokens). */
    int count_only;
} m40_request_params;

typedef enum {
    M40_SUBMIT_OK = 0,
    M40_SUBMIT_QUEUE_FULL = 1,     /* -> HTTP 429 */
    M40_SUBMIT_NOT_READY = 2,      /* loading or failed -> HTTP 503 */
    M40_SUBMIT_INVALID = 3,        /* bad parameters -> HTTP 400 (err says why) */
    M40_SUBMIT_NOMEM = 4,          /* -> HTTP 500 */
} m40_submit_status;

m40_submit_status m40_engine_submit(m40_engine *e, const m40_request_params *p, void *user, m40_request **out,
                                    char *err, size_t errlen);

typedef enum { M40_EV_TEXT = 1, M40_EV_DONE = 2, M40_EV_ERROR = 3 } m40_event_type;
typedef enum { M40_FINISH_NONE = 0, M40_FINISH_STOP, M40_FINISH_LENGTH, M40_FINISH_CANCELLED } m40_finish;

typedef struct {
    int32_t id;
    float logprob;
    char bytes[64];                /* the token's text bytes (may be a partial UTF-8 sequence) */
    int32_t n_bytes;
} m40_token_logprob;

typedef struct {
    m40_event_type type;
    /* TEXT: newly completed text (UTF-8, stop strings never included) and, when
     * logprobs were asked for, the tokens that produced it. */
    char *text;                    /* owned by the event; NUL-terminated */
    size_t text_len;
    int32_t n_tokens;
    m40_token_logprob *tokens;     /* n_tokens entries, or NULL */
    m40_token_logprob *top;        /* n_tokens * n_top entries, or NULL */
    int32_t n_top;
    /* DONE */
    m40_finish finish;
    int32_t prompt_tokens;         /* on TEXT events too (known once the prompt is) */
    int32_t cached_tokens;         /* of prompt_tokens, those found in the prefix cache (not
                                    * computed); 0 without one (CPU engine) */
    int32_t completion_tokens;
    int32_t stop_matched;          /* DONE: 1 + the index of the request's stop string that
                                    * ended the output; 0 when none did */
    /* ERROR: HTTP status to answer with (400 prompt too long, 500 internal, 503
     * engine stopping) and the message. */
    int http_status;
    char message[256];
    /* TEXT and DONE: 1 when the rendered chat prompt ends inside an open "<think>"
     * (DeepSeek-R1 distills' templates open it for the model), so the output starts
     * with reasoning and only its "</think>" shows where the answer begins. */
    int reasoning_open;
} m40_event;

/* 1: an event was moved into *ev (free it with m40_event_clear), 0: none pending. */
int m40_request_poll(m40_request *r, m40_event *ev);
void m40_event_clear(m40_event *ev);
/* Ends the submitter's side (cancels a request still running). */
void m40_request_release(m40_request *r);

/* Counters and gauges for /metrics. */
#define M40_HIST_BUCKETS 12
typedef struct {
    uint64_t requests_total;           /* admitted */
    uint64_t requests_rejected;        /* 429 */
    uint64_t requests_cancelled;
    uint64_t prompt_tokens_total;      /* prompt tokens of admitted requests */
    uint64_t prompt_tokens_computed;   /* prompt tokens actually run through the model */
    uint64_t completion_tokens_total;
    int32_t queue_depth;               /* waiting for the tokenizer or for a slot */
    int32_t running;
    int64_t kv_tokens_used;
    int64_t kv_tokens_total;
    /* Histograms in seconds, cumulative counts per upper bound (last bound is +Inf). */
    double hist_bounds[M40_HIST_BUCKETS];
    uint64_t ttft_counts[M40_HIST_BUCKETS];
    double ttft_sum;
    uint64_t itl_counts[M40_HIST_BUCKETS];
    double itl_sum;
    /* Automatic prefix caching (GPU engine; all 0 on the CPU): prompt lookups when
     * sequences start prefilling (again after a preemption), the tokens they presented,
     * and those found cached, which are not computed (hit ratio: hit / query tokens). */
    uint64_t prefix_cache_queries;
    uint64_t prefix_cache_query_tokens;
    uint64_t prefix_cache_hit_tokens;
    /* Where the engine thread's time goes: model steps run, the batch rows they carried
     * (tokens through the model), and seconds spent in the forward pass (GPU work and the
     * wait for it), in sampling + detokenizing + handing out events, and in the rest of
     * the loop (admission, batch building, cancellation, statistics). */
    uint64_t steps_total;
    uint64_t step_tokens_total;
    double forward_seconds;
    double sample_seconds;
    double schedule_seconds;
    /* Inside sample_seconds (GPU engines' helper threads, scheduler.c): the wait for
     * grammar masks that outlast the forward pass, and the parallel picks (mask, sampler,
     * grammar advance of every sampled row); the rest is the serial commit and events. */
    double grammar_wait_seconds;
    double pick_seconds;
    /* The ITL guard (engine/serve/prefill_policy.h): steps in which it held prompt tokens back,
     * the steps among them that carried none so that a decode-only step was measured,
     * and its current estimate of a decode-only step of the running sequences (0 when
     * nothing decodes). */
    uint64_t guard_limited_steps;
    uint64_t guard_probe_steps;
    double decode_step_estimate;
} m40_engine_stats;

void m40_engine_get_stats(m40_engine *e, m40_engine_stats *out);

#endif
