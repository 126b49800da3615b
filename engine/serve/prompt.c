/* The tokenizer thread: between submit and the admission queue, it renders each chat
 * request's template and tokenizes every prompt, off the nginx event loop and off the
 * engine thread, so that a 100,000-token prompt never stalls the decode steps of the
 * sequences already running (the engine thread's steps go on while it works).
 *
 * One thread, first come first served: a long prompt delays the admission of the
 * requests behind it by its tokenization time (their TTFT), never anybody's next token.
 * It takes the oldest request of e's tokenizer queue, works on it without holding the
 * lock, and then, under the lock:
 *   - the submitter released it meanwhile: drops the engine's reference (counted as
 *     cancelled);
 *   - rendering or tokenizing failed, or the prompt does not fit the context: answers
 *     it with an ERROR event (400 with the reason, as before this thread existed) and
 *     drops the reference;
 *   - the engine is stopping: answers 503;
 *   - else: hands it to the engine thread's admission queue with its token ids.
 * When the engine stops, the thread answers every request still in its queue with 503
 * and ends; the engine thread joins it before the model (tokenizer, template) goes. */
#include "engine_impl.h"
#include "util/thread_prio.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int64_t tokenize_alloc(const m40_tokenizer *tok, const char *text, size_t len, int add_bos,
                              int parse_special, const size_t *guard, size_t n_guard, int32_t **out, char *err,
                              size_t errlen)
{
    int64_t cap = (int64_t)len + 16;
    *out = NULL;
    for (int attempt = 0; attempt < 2; attempt++) {
        int32_t *ids = malloc((size_t)cap * sizeof *ids);
        if (!ids) {
            snprintf(err, errlen, "out of memory tokenizing %zu bytes", len);
            return -1;
        }
        int64_t n = n_guard ? m40_tokenize_guarded(tok, text, len, add_bos, guard, n_guard, ids, cap, err, errlen)
                            : m40_tokenize(tok, text, len, add_bos, parse_special, ids, cap, err, errlen);
        if (n < 0) {
            free(ids);
            return -1;
        }
        if (n <= cap) {
            *out = ids;
            return n;
        }
        free(ids);
        cap = n;
    }
    snprintf(err, errlen, "tokenizer returned inconsistent lengths");
    return -1;
}

/* The fallback when neither the GGUF nor the configuration has a chat template: a
 * ChatML-style rendering, the most common convention of instruction-tuned models:
 *   <|im_start|>{role}\n{content}<|im_end|>\n ... [<|im_start|>assistant\n]
 * Non-string content (null for tool-call turns) renders as empty text. */
static char *render_fallback(const json_t *messages, int add_generation_prompt, size_t *out_len)
{
    size_t cap = 64, len = 0;
    size_t i;
    json_t *m;
    json_array_foreach(messages, i, m)
    {
        const char *role = json_string_value(json_object_get(m, "role"));
        const char *content = json_string_value(json_object_get(m, "content"));
        cap += 32 + (role ? strlen(role) : 0) + (content ? strlen(content) : 0);
    }
    char *buf = malloc(cap);
    if (!buf)
        return NULL;
    json_array_foreach(messages, i, m)
    {
        const char *role = json_string_value(json_object_get(m, "role"));
        const char *content = json_string_value(json_object_get(m, "content"));
        len += (size_t)sprintf(buf + len, "<|im_start|>%s\n%s" M40_FALLBACK_END "\n", role ? role : "user",
                               content ? content : "");
    }
    if (add_generation_prompt)
        len += (size_t)sprintf(buf + len, "<|im_start|>assistant\n");
    *out_len = len;
    return buf;
}

/* 1 when the rendered prompt ends with "<think>" and only whitespace after it: the
 * template opened the model's reasoning (DeepSeek-R1 distills, Qwen3 thinking variants),
 * so the output begins inside it. */
static int ends_in_open_think(const char *text, size_t len)
{
    static const char tag[] = "<think>";
    while (len > 0 && (text[len - 1] == ' ' || text[len - 1] == '\n' || text[len - 1] == '\r' || text[len - 1] == '\t'))
        len--;
    return len >= sizeof tag - 1 && memcmp(text + len - (sizeof tag - 1), tag, sizeof tag - 1) == 0;
}

/* 1 (with the 400 in msg) when a text of len bytes cannot fit the context whatever it
 * says: every token is at most the vocabulary's longest piece, so it has at least
 * len / that many tokens. Checked before tokenizing, so that a 10 MB prompt is refused at
 * once instead of after seconds of work. */
static int surely_too_long(const m40_engine *e, size_t len, char *msg, size_t msglen)
{
    if (len < (size_t)e->ctx)
        return 0; /* never more tokens than bytes: no bound to find */
    const size_t at_least = len / m40_tokenizer_max_piece_len(e->tok);
    if (at_least < (size_t)e->ctx)
        return 0;
    snprintf(msg, msglen, "prompt has at least %zu tokens (%zu bytes) but the context size is %d", at_least, len,
             (int)e->ctx);
    return 1;
}

/* Renders (chat) and tokenizes the request's prompt; sets r->fallback_chat. On failure
 * returns -1 with the HTTP status and message to answer with. Reads only what is
 * immutable while the thread runs (e->tok, e->tmpl, e->tmpl_err, e->ctx) and the
 * request's own parameters. */
static int request_tokens(m40_engine *e, m40_request *r, int32_t **ids_out, int32_t *n_out, int *status, char *msg,
                          size_t msglen)
{
    const m40_tokenizer *tok = e->tok;
    char err[256];
    int64_t n;
    int32_t *ids = NULL;
    *status = 500;
    if (r->messages) {
        char *text = NULL;
        size_t len = 0, *guard = NULL, n_guard = 0;
        if (e->tmpl_err[0]) {
            snprintf(msg, msglen, "the model's chat template cannot be used: %.200s", e->tmpl_err);
            return -1;
        }
        if (e->tmpl) {
            int32_t bos = m40_tokenizer_bos(tok), eos = m40_tokenizer_eos(tok);
            const char *bos_s = bos >= 0 ? m40_tokenizer_piece(tok, bos) : NULL;
            const char *eos_s = eos >= 0 ? m40_tokenizer_piece(tok, eos) : NULL;
            /* gpt-oss's template wants its analysis as `thinking` and no null content
             * (template/chat_args.c); then arguments as objects first (most templates), as
             * the client's text when the template refuses them. */
            json_t *hm = m40_tool_format_detect(e->tmpl_src) == M40_TOOLS_HARMONY
                             ? m40_chat_harmony_messages(r->messages)
                             : NULL;
            const json_t *msgs = hm ? hm : r->messages;
            json_t *objs = m40_chat_arguments_as_objects(msgs);
            const json_t *used = objs;
            int rc = -1;
            if (objs)
                rc = m40_chat_template_render_parsed(e->tmpl, objs, r->tools, r->add_generation_prompt, bos_s,
                                                     eos_s, r->template_kwargs, NULL, &text, &len, err, sizeof err);
            if (rc != 0) {
                used = msgs;
                rc = m40_chat_template_render_parsed(e->tmpl, msgs, r->tools, r->add_generation_prompt, bos_s, eos_s,
                                                     r->template_kwargs, NULL, &text, &len, err, sizeof err);
            }
            if (rc != 0) {
                json_decref(objs);
                json_decref(hm);
                /* raise_exception() in templates rejects the conversation itself. */
                *status = 400;
                snprintf(msg, msglen, "chat template: %.230s", err);
                return -1;
            }
            /* Where the messages' own text landed: control-token strings typed there
             * stay text (prompt_guard.c). */
            rc = m40_prompt_guard(tok, e->tmpl, used, r->tools, r->add_generation_prompt, bos_s, eos_s,
                                  r->template_kwargs, text, len, &guard, &n_guard, err, sizeof err);
            json_decref(objs);
            json_decref(hm);
            if (rc != 0) {
                free(text);
                *status = 400;
                snprintf(msg, msglen, "%.250s", err);
                return -1;
            }
        } else {
            text = render_fallback(r->messages, r->add_generation_prompt, &len);
            r->fallback_chat = 1;
            if (!text) {
                snprintf(msg, msglen, "out of memory rendering the chat");
                return -1;
            }
        }
        if (surely_too_long(e, len, msg, msglen)) {
            free(text);
            free(guard);
            *status = 400;
            return -1;
        }
        r->reasoning_open = ends_in_open_think(text, len);
        /* Template output is trusted: its control-token strings become single ids; the
         * messages' own text never does (guard: where it landed, when it holds one). */
        n = tokenize_alloc(tok, text, len, 0, 1, guard, n_guard, &ids, err, sizeof err);
        free(text);
        free(guard);
        if (n < 0) {
            snprintf(msg, msglen, "tokenizer: %.230s", err);
            return -1;
        }
        int32_t bos = m40_tokenizer_bos(tok);
        if (m40_tokenizer_add_bos(tok) && bos >= 0 && (n == 0 || ids[0] != bos)) {
            int32_t *nids = realloc(ids, (size_t)(n + 1) * sizeof *nids);
            if (!nids) {
                free(ids);
                snprintf(msg, msglen, "out of memory");
                return -1;
            }
            ids = nids;
            memmove(ids + 1, ids, (size_t)n * sizeof *ids);
            ids[0] = bos;
            n++;
        }
    } else {
        if (surely_too_long(e, r->prompt_len, msg, msglen)) {
            *status = 400;
            return -1;
        }
        /* User text: control-token strings stay text. */
        n = tokenize_alloc(tok, r->prompt, r->prompt_len, m40_tokenizer_add_bos(tok), 0, NULL, 0, &ids, err,
                           sizeof err);
        if (n < 0) {
            snprintf(msg, msglen, "tokenizer: %.230s", err);
            return -1;
        }
    }
    if (n >= e->ctx) {
        free(ids);
        *status = 400;
        snprintf(msg, msglen, "prompt has %lld tokens but the context size is %d", (long long)n, (int)e->ctx);
        return -1;
    }
    if (n == 0) {
        free(ids);
        *status = 400;
        snprintf(msg, msglen, "prompt is empty (no tokens to start from)");
        return -1;
    }
    *ids_out = ids;
    *n_out = (int32_t)n;
    return 0;
}

static void *prompt_thread_main(void *arg)
{
    m40_engine *e = arg;
    m40_thread_background(M40_BACKGROUND_NICE); /* the engine thread first (thread_prio.h) */
    pthread_mutex_lock(&e->mu);
    for (;;) {
        while (!e->stop && !e->tq_head)
            pthread_cond_wait(&e->tk_cv, &e->mu);
        m40_request *r = e->tq_head;
        if (!r)
            break; /* stopping, nothing left */
        m40_queue_unlink(&e->tq_head, &e->tq_tail, &e->tq_n, r);
        /* Ours now: release only marks it (phase ENGINE), the reference is dropped here. */
        r->phase = M40_REQ_ENGINE;
        if (e->stop) {
            e->stats.queue_depth = m40_engine_waiting_locked(e);
            pthread_mutex_unlock(&e->mu);
            m40_engine_fail_request(e, r, 503, "the engine is stopping");
            pthread_mutex_lock(&e->mu);
            continue;
        }
        r->phase = M40_REQ_TOKENIZING;
        e->tk_busy++;
        void (*hook)(void *, void *) = e->tokenize_hook;
        void *hook_ctx = e->tokenize_hook_ctx;
        pthread_mutex_unlock(&e->mu);

        if (hook)
            hook(hook_ctx, r->user);
        int32_t *ids = NULL, n = 0;
        int status = 500;
        char msg[256];
        int rc = request_tokens(e, r, &ids, &n, &status, msg, sizeof msg);
        if (rc == 0 && (rc = m40_request_compile_grammar(e, r, &status, msg, sizeof msg)) != 0) {
            free(ids);
            ids = NULL;
        }
        /* Rendered: only this thread ever read the messages (the engine's deep copy). */
        if (r->messages) {
            json_decref(r->messages);
            r->messages = NULL;
        }
        if (r->tools) {
            json_decref(r->tools);
            r->tools = NULL;
        }
        if (r->template_kwargs) {
            json_decref(r->template_kwargs);
            r->template_kwargs = NULL;
        }

        pthread_mutex_lock(&e->mu);
        e->tk_busy--;
        if (r->released || rc != 0 || e->stop) {
            int released = r->released;
            if (released)
                e->stats.requests_cancelled++;
            r->phase = M40_REQ_ENGINE;
            e->stats.queue_depth = m40_engine_waiting_locked(e);
            pthread_mutex_unlock(&e->mu);
            free(ids);
            if (released) {
                m40_engine_drop_request(e, r); /* nobody listens: no event */
                m40_engine_wake(e);            /* but the counters changed */
            }
            else if (rc != 0)
                m40_engine_fail_request(e, r, status, msg);
            else
                m40_engine_fail_request(e, r, 503, "the engine is stopping");
            pthread_mutex_lock(&e->mu);
            continue;
        }
        if (r->count_only) {
            /* counted: the answer is the prompt's length; no slot, no model */
            r->phase = M40_REQ_ENGINE;
            e->stats.queue_depth = m40_engine_waiting_locked(e);
            pthread_mutex_unlock(&e->mu);
            free(ids);
            m40_engine_count_done(e, r, n);
            pthread_mutex_lock(&e->mu);
            continue;
        }
        r->ids = ids;
        r->n_ids = n;
        r->phase = M40_REQ_QUEUED;
        m40_queue_push(&e->q_head, &e->q_tail, &e->q_n, r);
        e->stats.queue_depth = m40_engine_waiting_locked(e);
        pthread_cond_signal(&e->cv);
    }
    pthread_mutex_unlock(&e->mu);
    return NULL;
}

int m40_prompt_start(m40_engine *e, char *err, size_t errlen)
{
    /* Created by the engine thread, whose signal mask (everything blocked) it inherits:
     * nginx's signals stay on nginx's thread. */
    int rc = pthread_create(&e->tk_thread, NULL, prompt_thread_main, e);
    if (rc != 0) {
        snprintf(err, errlen, "cannot start the tokenizer thread: %s", strerror(rc));
        return -1;
    }
    e->tk_started = 1;
    return 0;
}

void m40_prompt_stop(m40_engine *e)
{
    if (!e->tk_started)
        return;
    pthread_mutex_lock(&e->mu);
    e->stop = 1;
    pthread_cond_signal(&e->tk_cv);
    pthread_mutex_unlock(&e->mu);
    pthread_join(e->tk_thread, NULL);
    e->tk_started = 0;
}
