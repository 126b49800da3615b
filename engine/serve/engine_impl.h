/* Internals shared by engine.c (public API, request lifetime, event queues, stats),
 * prompt.c (the tokenizer thread: chat-template rendering and tokenization) and
 * scheduler.c (the engine thread: load, admit, batch, sample, stop strings).
 * Not included by the nginx module.
 *
 * A request's way: submit puts it in the tokenizer queue (phase TOKENIZE); the
 * tokenizer thread takes it (TOKENIZING), renders and tokenizes it, and puts it in the
 * admission queue (QUEUED) with its token ids, or answers it with an error; the engine
 * thread admits it into a slot (ENGINE) and drops its reference when it ends (DONE).
 * The engine's reference travels with the request: whichever thread holds the request
 * in its phase owns that reference.
 *
 * Threads and locks:
 *   - e->mu guards everything the submitter's thread, the tokenizer thread and the
 *     engine thread share: state, both queues and the request being tokenized, the
 *     ready list, the list of live requests, each request's refs/released/phase, and
 *     the stats.
 *   - r->evmu guards one request's event queue (poll on one side, push on the other).
 *   Lock order: e->mu before r->evmu (no thread takes e->mu while holding evmu).
 *   - m40_slot and everything about a running sequence belong to the engine thread
 *     alone and are never locked. The tokenizer, the parsed template and the model's
 *     facts (ctx) are set before the tokenizer thread starts and only read afterwards
 *     (tokenizer and template are safe to use from several threads: tokenizer.h,
 *     jinja.h). */
#ifndef M40_ENGINE_IMPL_H
#define M40_ENGINE_IMPL_H

#include <pthread.h>
#include <stdint.h>
#include <stdio.h>

#include "grammar/grammar.h"
#include "template/jinja.h"
#include "m40_chat_parse.h"
#include "m40_engine.h"
#include "model/model.h"
#include "prefill_policy.h"
#include "sampler.h"
#include "tokenizer/tokenizer.h"

#define M40_MAX_STOP 4
/* One more stop than the caller may give: the fallback chat template adds its own
 * end-of-turn marker when the vocabulary has no such token (see scheduler.c). */
#define M40_MAX_STOP_ALL (M40_MAX_STOP + 1)
#define M40_MAX_STOP_LEN 1024
/* The fallback chat template's end-of-turn text (prompt.c renders it, scheduler.c stops
 * on it when it is no token of the vocabulary). */
#define M40_FALLBACK_END "<|im_end|>"

enum m40_req_phase {
    M40_REQ_TOKENIZE = 0, /* in e's tokenizer queue; release may unlink it directly */
    M40_REQ_TOKENIZING,   /* the tokenizer thread renders / tokenizes it */
    M40_REQ_QUEUED,       /* tokenized, in e's admission queue; release may unlink it directly */
    M40_REQ_ENGINE,       /* taken by the engine thread (admitting or running) */
    M40_REQ_DONE,         /* the engine has dropped its reference */
};

struct m40_request {
    m40_engine *e;       /* NULL once the engine is destroyed (only the submitter is left) */
    void *user;

    /* Guarded by e->mu. */
    int refs;            /* engine + submitter */
    int released;        /* the submitter is gone: cancel, never list as ready */
    int phase;
    int in_ready;
    m40_request *q_next, *q_prev;       /* the tokenizer queue or the admission queue */
    m40_request *rd_next, *rd_prev;     /* ready list */
    m40_request *live_next, *live_prev; /* every request not yet freed */

    /* Parameters, immutable after submit (owned copies). */
    json_t *messages;    /* the engine's own deep copy; dropped once rendered */
    json_t *tools;       /* chat: the template's tools (deep copy) or NULL; dropped with messages */
    json_t *template_kwargs; /* chat: more template variables (deep copy) or NULL */
    int reasoning_open;  /* the rendered prompt ends in an open "<think>" (events say so) */
    char *prompt;
    size_t prompt_len;
    int add_generation_prompt;
    int32_t max_tokens;
    m40_sampler_params sampling;
    char *stop[M40_MAX_STOP_ALL];
    size_t stop_len[M40_MAX_STOP_ALL];
    int n_stop;
    int logprobs;
    int ignore_eos;
    char *grammar_src;   /* constrained decoding: at most one of these three */
    char *json_schema;
    int json_object;
    int tool_call_format;  /* tool_choice required/named: calls of `tools` in this markup */
    int tool_call_parallel;
    int count_only;        /* /v1/messages/count_tokens: ends after tokenizing */
    double t_submit;     /* monotonic seconds, for time to first token */

    /* Written by the tokenizer thread before it queues the request for admission,
     * then the engine thread's (which takes the ids into its slot). */
    int32_t *ids;        /* the prompt's token ids (chat: the rendered template) */
    int32_t n_ids;
    int fallback_chat;   /* rendered by the fallback template: its end marker stops */
    m40_grammar *grammar; /* compiled (constrain.c); moves into the slot's constraint at admission */

    /* Event queue, guarded by evmu: a ring of ev_cap entries from ev_head. */
    pthread_mutex_t evmu;
    m40_event *ev;
    size_t ev_head, ev_n, ev_cap;
};

/* A pending token of a running sequence whose text is still held back. */
typedef struct {
    m40_token_logprob tok;
    m40_token_logprob top[20];
    size_t text_end;     /* offset in the held text where this token's bytes end */
} m40_held_token;

/* One KV slot and the sequence running in it (engine thread only). */
typedef struct {
    m40_request *r;      /* NULL: free */
    uint64_t order;      /* admission counter: older sequences prefill first */
    int32_t *prompt;     /* prompt tokens, then the generated tokens fed so far */
    int32_t n_prompt;    /* tokens to prefill (grows when a preempted sequence recomputes) */
    int32_t n_prompt_user; /* the request's prompt length (usage) */
    int32_t n_cached;      /* of those, found in the prefix cache at its first chunk (usage's
                            * cached_tokens; not its own blocks found again after preemption) */
    int stop_matched;      /* 1 + index of the request's stop string that ended it, else 0 */
    int32_t cap_prompt;
    int32_t n_prefilled;
    int32_t n_past;      /* tokens in the KV cache */
    int32_t n_gen;       /* tokens sampled */
    int32_t next_token;  /* sampled, not yet fed through the model */
    m40_sampler *smp;
    m40_gconstraint *gc; /* constrained decoding: the grammar's state, NULL when free-running */
    m40_detok *detok;
    char *held;          /* decoded text not yet emitted (could start a stop string) */
    size_t held_len, held_cap;
    m40_held_token *held_toks;
    int32_t n_held_toks, cap_held_toks;
    double t_last;       /* when the previous token was sampled */
    double t_first;      /* when its first token was (the ITL guard protects it from prompts
                          * arriving later: prefill_policy.h) */
    int fallback_chat;   /* rendered by the fallback template: its end marker stops */
    int cancel;          /* released by the submitter, finish without events */
    int preempted;       /* KV blocks given back this step: not scheduled again until the next */
} m40_slot;

struct m40_engine {
    char *model_path;
    char *model_name;
    char *template_override;
    int device;
    int tp;               /* m40_engine_config.tp */
    int32_t ctx_cfg;
    int32_t max_seqs_cfg;         /* as configured; 0: automatic */
    int32_t max_seqs;             /* the engine thread's, set at load (slots) */
    int32_t max_queue;
    float gpu_memory_fraction;
    float kv_share;               /* GPU: share of the pool's room (0: all of it) */
    int64_t kv_keep_bytes;        /* GPU: kept out of that room for later models */
    int stats_wake;               /* engine thread: wake the submitter after the step's
                                   * statistics (a change no event carries) */
    int32_t n_threads;
    int cpu_fast;
    int batch_invariant; /* m40_engine_config.batch_invariant, or M40_BATCH_INVARIANT=1 (the model's, at load) */
    m40_prefill_policy prefill;   /* budget, chunk, floor, guard (0: off); set at create */
    int prefill_budget_auto;

    int efd;
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t cv;          /* the engine thread waits here */
    pthread_t tk_thread;        /* the tokenizer thread (prompt.c), started by the engine thread */
    int tk_started;
    pthread_cond_t tk_cv;       /* the tokenizer thread waits here */

    /* Guarded by mu. */
    int stop;
    m40_engine_state state;
    char load_err[512];
    int32_t ctx;         /* valid once READY */
    int32_t n_vocab;
    m40_engine_capacity capacity; /* valid once READY */
    m40_request *tq_head, *tq_tail; /* waiting for the tokenizer */
    int32_t tq_n;
    int32_t tk_busy;              /* requests the tokenizer thread is working on (0 or 1) */
    m40_request *q_head, *q_tail; /* tokenized, waiting for a slot */
    int32_t q_n;
    /* Test seam (m40_engine_set_tokenize_hook): called on the tokenizer thread, no lock
     * held, with a request's user pointer before it is rendered and tokenized. */
    void (*tokenize_hook)(void *ctx, void *user);
    void *tokenize_hook_ctx;
    m40_request *rd_head, *rd_tail;
    m40_request *live_head;
    m40_engine_stats stats;

    /* Engine thread only. */
    m40_model *model;
    m40_kv *kv;
    /* Set at load, before the tokenizer thread starts; read by both threads after. */
    const m40_tokenizer *tok;
    m40_jinja *tmpl;              /* parsed chat template, NULL: fallback rendering */
    const char *tmpl_src;         /* its source (the override or the GGUF's string) */
    char tmpl_err[256];           /* non-empty: the model's template did not parse */
    int fallback_end_is_text;     /* the fallback's end marker is no token: stop on its text */
    /* The vocabulary as a trie of token bytes for grammar masks: built by the tokenizer
     * thread on the first constrained request (constrain.c), read by the engine thread
     * only through requests handed over under mu; freed after both threads stopped. */
    m40_token_trie *vocab_trie;
    m40_slot *slots;
    uint64_t admit_counter;
    int32_t *b_tokens, *b_pos, *b_slot;
    uint8_t *b_want;
    int32_t *row_slot;            /* logits row -> slot */
    int32_t *picks;               /* the model's greedy picks, per logits row (all-greedy steps) */
    int32_t *take;                /* tokens of each slot in the current batch */
    m40_plan_seq *plan;           /* the slots as the step planner sees them */
    m40_step_cost cost;           /* step times measured so far, fitted (the guard's model) */
    m40_step_shape shape;         /* what the current batch carries, for that model */
    m40_plan_info plan_info;
    FILE *step_trace;             /* M40_STEP_TRACE: a line a step (scheduler.c), or NULL */
    double trace_t0;              /* when the trace began */
    float *logits;
    float *step_logits;           /* where the step's rows are: logits, or the GPU's pinned buffer */
    m40_row_sample *row_sample;   /* the rows' draws when the GPU samples them (scheduler.c) */
    int gpu_sample;               /* M40_GPU_SAMPLE (tuning.h): 0 keeps every draw on the host */
    /* Helper threads of a GPU engine's steps (scheduler.c, created at the first step that
     * needs them): the grammar masks of constrained rows computed while the GPU runs
     * the forward pass, then every sampled row's pick (m40_sequence_pick) in parallel. */
    struct m40_threadpool *pick_pool;
    int pick_threads;             /* M40_PICK_THREADS, or the default for the device (tuning.h) */
    int pick_pool_failed;
    int32_t *pick_rows;           /* the step's rows handed to the pool */
    int *pick_rc;
    m40_sample_result *pick_res;
    m40_request **ready_batch;    /* requests that got events this step */
    int32_t n_ready_batch;
    m40_request **done_batch;     /* requests whose engine reference goes after notify */
    int32_t n_done_batch;
    /* The counters only the engine thread writes; copied into stats (under mu) at the
     * end of every step, so that per-token updates take no lock. */
    m40_engine_stats tstats;
    uint64_t preemptions;         /* sequences sent back to recompute for lack of KV blocks */
};

/* engine.c: helpers the scheduler uses. */
double m40_now(void);
/* Appends ev (ownership of its buffers moves into the queue). -1 when out of memory. */
int m40_request_push_event(m40_request *r, m40_event *ev);
/* Lists requests in the ready list (skipping released ones) and writes the eventfd once. */
void m40_engine_notify(m40_engine *e, m40_request **rs, int32_t n);
/* Writes the eventfd (state changes: READY, FAILED). */
void m40_engine_wake(m40_engine *e);
/* The engine thread drops its reference (phase DONE); frees r when the submitter is gone. */
void m40_engine_drop_request(m40_engine *e, m40_request *r);
void m40_hist_observe(const double *bounds, uint64_t *counts, double *sum, double v);

/* The tokenizer queue and the admission queue (under e->mu): FIFO lists through
 * q_next / q_prev; a request is in at most one. */
void m40_queue_push(m40_request **head, m40_request **tail, int32_t *n, m40_request *r);
void m40_queue_unlink(m40_request **head, m40_request **tail, int32_t *n, m40_request *r);
/* Requests waiting for tokenization or for a slot: what max_queue limits and the
 * queue_depth gauge shows. Under e->mu. */
int32_t m40_engine_waiting_locked(const m40_engine *e);
/* Ends a request the engine holds that never got a slot: pushes an ERROR event, lists
 * it as ready and drops the engine's reference (any thread; no lock held). */
void m40_engine_fail_request(m40_engine *e, m40_request *r, int http_status, const char *msg);
/* Ends a count_only request the same way (tokenizer thread): DONE with its prompt's length. */
void m40_engine_count_done(m40_engine *e, m40_request *r, int32_t n_prompt);

/* Test seam: fn(ctx, user) runs on the tokenizer thread before each request is
 * rendered and tokenized, with no lock held; a test blocks in it to hold a request
 * "being tokenized" while it checks what the engine thread does meanwhile. NULL: none. */
void m40_engine_set_tokenize_hook(m40_engine *e, void (*fn)(void *ctx, void *user), void *ctx);

/* prompt.c: the tokenizer thread. Started by the engine thread once the model is loaded
 * (-1 with err when the thread cannot be created); stopped (joined) by it after e->stop
 * is set, before the model goes: requests still waiting for it are answered with 503. */
int m40_prompt_start(m40_engine *e, char *err, size_t errlen);
void m40_prompt_stop(m40_engine *e);
/* prompt_guard.c: the byte ranges of the rendered prompt real where the messages' texts
 * landed, for m40_tokenize_guarded; none (0, *n_ranges 0) when no message text holds a
 * control-token string. -1 with err (a 400) when such a text cannot be located. */
int m40_prompt_guard(const m40_tokenizer *tok, const m40_jinja *tmpl, const json_t *messages, const json_t *tools,
                     int add_generation_prompt, const char *bos, const char *eos, const json_t *kwargs,
                     const char *real, size_t real_len, size_t **ranges, size_t *n_ranges, char *err, size_t errlen);

/* constrain.c (tokenizer thread): compiles the request's grammar, schema or json_object
 * into r->grammar (and builds e->vocab_trie the first time). 0 (also when the request
 * has none), or -1 with the HTTP status and message to answer with. */
int m40_request_compile_grammar(m40_engine *e, m40_request *r, int *status, char *msg, size_t msglen);

/* The engine thread, in four files by job; everything below runs on it alone.
 * engine_thread.c: an automatic max_seqs on a GPU (m40_engine.h): the sequences of
 * M40_AUTO_SEQ_TOKENS (or ctx when shorter) that kv_blocks blocks hold, 1 to
 * M40_AUTO_MAX_SEQS. */
int32_t m40_auto_max_seqs(int64_t kv_blocks, int32_t block_size, int32_t ctx);
/* engine_thread.c: the engine thread's body. */
void *m40_engine_thread_main(void *arg);

/* admission.c: cancel the sequences whose submitter released them (no event: nobody
 * listens), then fill free slots from the admission queue. */
void m40_cancel_released(m40_engine *e);
void m40_admit_queued(m40_engine *e);
/* The oldest queued request, taken off the queue and now the engine's (NULL when the
 * queue is empty). Under e->mu. */
m40_request *m40_queue_pop_locked(m40_engine *e);
/* Error before a slot was taken: answer and drop the engine's reference now. */
void m40_admit_fail(m40_engine *e, m40_request *r, int status, const char *msg);

/* scheduler.c: one step (build the batch, make room in the KV pool, forward, hand
 * each new token to m40_sequence_advance). */
void m40_run_step(m40_engine *e);
/* The step's helper threads and their arrays, freed (the engine thread's end). */
void m40_pick_pool_free(m40_engine *e);

/* output.c: a slot's buffers freed and zeroed. */
void m40_slot_clear(m40_slot *s);
/* Ends the sequence in slot i: its KV blocks go back now, its engine reference after
 * this step's notification (m40_step_flush). */
void m40_slot_finish(m40_engine *e, int32_t i);
void m40_push_error(m40_engine *e, m40_request *r, int http_status, const char *msg);
void m40_push_done(m40_engine *e, m40_slot *s, m40_finish finish);
/* Notifies the requests that got events this step, then drops finished ones. */
void m40_step_flush(m40_engine *e);
/* engine_thread.c: the engine thread's statistics into e->stats (under e->mu), what
 * m40_engine_get_stats reads. */
void m40_stats_publish(m40_engine *e);
/* The two halves of m40_sequence_advance, for steps that pick several rows' tokens at
 * once on the engine's helper threads (scheduler.c): m40_sequence_pick masks (grammar),
 * samples and lets the grammar take the token, touching only slot i's own sampler and
 * constraint (so distinct slots may run it concurrently); 0, or -1 when no token may
 * follow. m40_sequence_commit (the engine thread only) does the rest with that result:
 * detokenize, stop strings, finish conditions, events. */
int m40_sequence_pick(m40_engine *e, int32_t i, float *logits, m40_sample_result *res);
void m40_sequence_commit(m40_engine *e, int32_t i, int pick_rc, const m40_sample_result *res);
/* Slot i's newest logits (or the token the model `picked` when logits is NULL):
 * sample, detokenize, stop strings, finish conditions, events. */
void m40_sequence_advance(m40_engine *e, int32_t i, float *logits, int32_t picked);

#endif
