/* The engine thread: loads the model, then runs the continuous-batching loop.
 *
 * One iteration ("step"):
 *   1. sequences whose submitter released them are cancelled and their slots freed,
 *      before anything is computed for them;
 *   2. queued requests are admitted into free slots (sampler and detokenizer
 *      created); they come already rendered and tokenized by the tokenizer thread
 *      (prompt.c), so that however long a prompt is, its tokenization never holds up
 *      a step;
 *   3. one m40_batch is built (m40_step_plan, prefill_policy.h): the next token of
 *      every decoding sequence, then prompt chunks of prefilling sequences, oldest
 *      admission first, at most prefill.chunk tokens each and prefill.budget in all, and
 *      while anything decodes no more than the ITL guard lets in (the step's predicted
 *      time within prefill.guard times a decode-only step's);
 *   4. one forward call, timed: the time goes into the guard's cost model; every
 *      sequence that got logits samples its next token with its own sampler, feeds it
 *      to its detokenizer, and emits text (held back while it could still be the start
 *      of a stop string);
 *   5. the requests that got events are listed as ready and the eventfd is written
 *      once; finished sequences give their slot back.
 * With nothing queued and nothing running the thread sleeps on a condition variable.
 *
 * A slot's KV cache is reused without clearing: a new sequence writes positions from
 * 0 and attends only to positions it has written itself. On a GPU model the cache is
 * a pool of blocks shared by the slots: a finished sequence's blocks go back at once
 * (m40_kv_slot_clear), and when a step needs more blocks than are free the forward
 * call says so (M40_FORWARD_NO_BLOCKS) and changes nothing; the youngest sequence is
 * then preempted (its blocks freed, its tokens so far, generated ones included,
 * become a prompt to recompute later) and the step is rebuilt, until it fits. The pool
 * is sized from the GPU's memory, not from max_seqs * ctx (kv_size), so this is the
 * normal way a full pool is shared: admission takes any free slot, the oldest sequence
 * always keeps going, and a young one waits (preempted again each step) until blocks
 * come back. A sequence alone that the pool cannot hold ends (make_room).
 *
 * Prefix caching (GPU pool, m40_kv_slot_match_prefix): when a sequence gets its first
 * prompt chunk, the full blocks of its prompt that are already cached are attached to
 * its slot and prefill starts after them; only the tokens actually run through the
 * model count as prompt_tokens_computed. A sequence whose prompt shares full blocks
 * that an older sequence is computing in this very step waits one step and then finds
 * them cached, so requests arriving together with one system prompt compute it once.
 * A preempted sequence usually finds its own blocks still cached (released blocks stay
 * cached until evicted) and recomputes little; a finished or cancelled one leaves its
 * full blocks to later requests. */
#include "engine_impl.h"
#include "kv/kv_blocks.h" /* M40_KV_BLOCK_SIZE_DEFAULT: the GPU pool's block size */

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>


/* ---------- slot bookkeeping ---------- */

static void slot_clear(m40_slot *s)
{
    m40_sampler_free(s->smp);
    m40_detok_free(s->detok);
    free(s->prompt);
    free(s->held);
    free(s->held_toks);
    memset(s, 0, sizeof *s);
}

static void ready_add(m40_engine *e, m40_request *r)
{
    for (int32_t i = 0; i < e->n_ready_batch; i++)
        if (e->ready_batch[i] == r)
            return;
    e->ready_batch[e->n_ready_batch++] = r;
}

/* Ends the sequence in slot i: its engine reference is dropped after this step's
 * notification (dropping first could free a request still in ready_batch). */
static void slot_finish(m40_engine *e, int32_t i)
{
    m40_slot *s = &e->slots[i];
    e->done_batch[e->n_done_batch++] = s->r;
    m40_kv_slot_clear(e->kv, i);
    slot_clear(s);
}

/* Pushes an event, or when even that fails for lack of memory, nothing can be told
 * to this submitter any more; the sequence is ended by the caller either way. */
static void push_or_drop(m40_engine *e, m40_request *r, m40_event *ev)
{
    if (m40_request_push_event(r, ev) != 0)
        m40_event_clear(ev);
    else
        ready_add(e, r);
}

static void push_error(m40_engine *e, m40_request *r, int http_status, const char *msg)
{
    m40_event ev;
    memset(&ev, 0, sizeof ev);
    ev.type = M40_EV_ERROR;
    ev.http_status = http_status;
    snprintf(ev.message, sizeof ev.message, "%s", msg);
    push_or_drop(e, r, &ev);
}

static void push_done(m40_engine *e, m40_slot *s, m40_finish finish)
{
    m40_event ev;
    memset(&ev, 0, sizeof ev);
    ev.type = M40_EV_DONE;
    ev.finish = finish;
    ev.prompt_tokens = s->n_prompt_user;
    ev.completion_tokens = s->n_gen;
    push_or_drop(e, s->r, &ev);
}

/* Flushes the step's notifications, then drops the references of finished requests. */
static void step_flush(m40_engine *e)
{
    m40_engine_notify(e, e->ready_batch, e->n_ready_batch);
    e->n_ready_batch = 0;
    for (int32_t i = 0; i < e->n_done_batch; i++)
        m40_engine_drop_request(e, e->done_batch[i]);
    e->n_done_batch = 0;
}

/* ---------- held text and stop strings ---------- */

static int held_append(m40_slot *s, const char *txt, size_t n)
{
    if (s->held_len + n + 1 > s->held_cap) {
        size_t ncap = s->held_cap ? s->held_cap : 64;
        while (ncap < s->held_len + n + 1)
            ncap *= 2;
        char *nh = realloc(s->held, ncap);
        if (!nh)
            return -1;
        s->held = nh;
        s->held_cap = ncap;
    }
    memcpy(s->held + s->held_len, txt, n);
    s->held_len += n;
    s->held[s->held_len] = '\0';
    return 0;
}

static void token_info(const m40_tokenizer *tok, int32_t id, float logprob, m40_token_logprob *out)
{
    out->id = id;
    out->logprob = logprob;
    int n = id >= 0 ? m40_token_to_bytes(tok, id, 0, out->bytes, (int)sizeof out->bytes) : 0;
    out->n_bytes = n < 0 ? 0 : n > (int)sizeof out->bytes ? (int)sizeof out->bytes : n;
}

static int held_token_append(m40_engine *e, m40_slot *s, const m40_sample_result *res, int32_t n_top)
{
    if (s->n_held_toks == s->cap_held_toks) {
        int32_t ncap = s->cap_held_toks ? s->cap_held_toks * 2 : 4;
        m40_held_token *nt = realloc(s->held_toks, (size_t)ncap * sizeof *nt);
        if (!nt)
            return -1;
        s->held_toks = nt;
        s->cap_held_toks = ncap;
    }
    m40_held_token *h = &s->held_toks[s->n_held_toks++];
    token_info(e->tok, res->token, res->logprob, &h->tok);
    for (int32_t k = 0; k < n_top; k++) {
        if (k < res->n_top)
            token_info(e->tok, res->top_ids[k], res->top_logprobs[k], &h->top[k]);
        else
            token_info(e->tok, -1, -INFINITY, &h->top[k]); /* vocabulary smaller than asked */
    }
    h->text_end = s->held_len;
    return 0;
}

/* Emits held[0..nbytes) with the held tokens whose text ends there as one TEXT event
 * and keeps the rest. drop_rest: discard what stays (the stop string and after). */
static int emit_held(m40_engine *e, m40_slot *s, size_t nbytes, int drop_rest)
{
    m40_request *r = s->r;
    int32_t n_top = r->logprobs ? r->sampling.n_top_logprobs : 0;
    int32_t nt = 0;
    while (nt < s->n_held_toks && s->held_toks[nt].text_end <= nbytes)
        nt++;
    if (nbytes > 0 || nt > 0) {
        m40_event ev;
        memset(&ev, 0, sizeof ev);
        ev.type = M40_EV_TEXT;
        ev.text = malloc(nbytes + 1);
        if (!ev.text)
            return -1;
        memcpy(ev.text, s->held, nbytes);
        ev.text[nbytes] = '\0';
        ev.text_len = nbytes;
        if (nt > 0) {
            ev.tokens = malloc((size_t)nt * sizeof *ev.tokens);
            ev.top = n_top > 0 ? malloc((size_t)nt * (size_t)n_top * sizeof *ev.top) : NULL;
            if (!ev.tokens || (n_top > 0 && !ev.top)) {
                m40_event_clear(&ev);
                return -1;
            }
            for (int32_t k = 0; k < nt; k++) {
                ev.tokens[k] = s->held_toks[k].tok;
                if (n_top > 0)
                    memcpy(&ev.top[(size_t)k * (size_t)n_top], s->held_toks[k].top, (size_t)n_top * sizeof *ev.top);
            }
            ev.n_tokens = nt;
            ev.n_top = n_top;
        }
        if (m40_request_push_event(r, &ev) != 0) {
            m40_event_clear(&ev);
            return -1;
        }
        ready_add(e, r);
    }
    if (drop_rest) {
        s->held_len = 0;
        s->n_held_toks = 0;
    } else {
        if (s->held_len > nbytes)
            memmove(s->held, s->held + nbytes, s->held_len - nbytes);
        s->held_len -= nbytes;
        if (s->n_held_toks > nt)
            memmove(s->held_toks, s->held_toks + nt, (size_t)(s->n_held_toks - nt) * sizeof *s->held_toks);
        s->n_held_toks -= nt;
        for (int32_t k = 0; k < s->n_held_toks; k++)
            s->held_toks[k].text_end -= nbytes;
    }
    if (s->held)
        s->held[s->held_len] = '\0';
    return 0;
}

/* The stop strings of the sequence: the request's, plus the fallback template's
 * end-of-turn text when it is not a single token of the vocabulary. */
typedef struct {
    const char *s[M40_MAX_STOP_ALL];
    size_t len[M40_MAX_STOP_ALL];
    int n;
} stop_set;

static void stops_of(const m40_engine *e, const m40_slot *s, stop_set *out)
{
    const m40_request *r = s->r;
    out->n = 0;
    for (int i = 0; i < r->n_stop; i++) {
        out->s[out->n] = r->stop[i];
        out->len[out->n++] = r->stop_len[i];
    }
    if (s->fallback_chat && e->fallback_end_is_text) {
        out->s[out->n] = M40_FALLBACK_END;
        out->len[out->n++] = strlen(M40_FALLBACK_END);
    }
}

/* Earliest stop match in held text; -1 when none. */
static long stop_find(const stop_set *st, const char *text, size_t n)
{
    long best = -1;
    for (int i = 0; i < st->n; i++) {
        const char *p = memmem(text, n, st->s[i], st->len[i]);
        if (p && (best < 0 || p - text < best))
            best = (long)(p - text);
    }
    return best;
}

/* Length of the longest suffix of text that is a proper prefix of some stop string:
 * those bytes could still become a stop string and must be held. */
static size_t stop_holdback(const stop_set *st, const char *text, size_t n)
{
    size_t best = 0;
    for (int i = 0; i < st->n; i++) {
        size_t k = st->len[i] - 1 < n ? st->len[i] - 1 : n;
        for (; k > best; k--)
            if (memcmp(text + n - k, st->s[i], k) == 0) {
                best = k;
                break;
            }
    }
    return best;
}

/* ---------- admission ---------- */

/* Error before a slot was taken: answer and drop the engine's reference now. */
static void admit_fail(m40_engine *e, m40_request *r, int status, const char *msg)
{
    push_error(e, r, status, msg);
    step_flush(e);
    m40_engine_drop_request(e, r);
}

/* The request comes tokenized (prompt.c): its ids move into the slot. */
static void admit(m40_engine *e, m40_request *r, int32_t slot)
{
    int32_t *ids = r->ids, n = r->n_ids;
    r->ids = NULL;
    r->n_ids = 0;
    m40_slot *s = &e->slots[slot];
    memset(s, 0, sizeof *s);
    s->fallback_chat = r->fallback_chat;
    r->sampling.skip_logprob = !r->logprobs; /* only logprobs requests report it */
    s->smp = m40_sampler_new(&r->sampling, e->n_vocab);
    s->detok = m40_detok_new(e->tok);
    if (!s->smp || !s->detok) {
        free(ids);
        slot_clear(s);
        admit_fail(e, r, 500, "out of memory creating the sampler");
        return;
    }
    s->r = r;
    s->order = e->admit_counter++;
    s->prompt = ids;
    s->n_prompt = n;
    s->n_prompt_user = n;
    s->cap_prompt = n;
    e->tstats.prompt_tokens_total += (uint64_t)n;
}

/* ---------- one step ---------- */

static int32_t n_active(const m40_engine *e)
{
    int32_t n = 0;
    for (int32_t i = 0; i < e->max_seqs; i++)
        n += e->slots[i].r != NULL;
    return n;
}

static void cancel_released(m40_engine *e)
{
    int32_t cancelled = 0;
    pthread_mutex_lock(&e->mu);
    for (int32_t i = 0; i < e->max_seqs; i++)
        if (e->slots[i].r && e->slots[i].r->released) {
            /* Marked here under the lock, finished below without it. */
            e->slots[i].cancel = 1;
            cancelled++;
        }
    e->stats.requests_cancelled += (uint64_t)cancelled;
    pthread_mutex_unlock(&e->mu);
    if (!cancelled)
        return;
    for (int32_t i = 0; i < e->max_seqs; i++)
        if (e->slots[i].r && e->slots[i].cancel)
            slot_finish(e, i); /* no event: nobody is listening */
    step_flush(e);
}

/* The oldest queued request, taken off the queue and now the engine's (NULL when the
 * queue is empty). Under e->mu. */
static m40_request *queue_pop_locked(m40_engine *e)
{
    m40_request *r = e->q_head;
    if (r) {
        m40_queue_unlink(&e->q_head, &e->q_tail, &e->q_n, r);
        e->stats.queue_depth = m40_engine_waiting_locked(e);
        r->phase = M40_REQ_ENGINE;
    }
    return r;
}

static void admit_queued(m40_engine *e)
{
    for (int32_t i = 0; i < e->max_seqs; i++) {
        while (!e->slots[i].r) {
            pthread_mutex_lock(&e->mu);
            m40_request *r = queue_pop_locked(e);
            pthread_mutex_unlock(&e->mu);
            if (!r)
                return;
            admit(e, r, i);
        }
    }
}

/* A request whose next token is the plain argmax of the logits: greedy, nothing that
 * reshapes the logits, no logprobs to report. When every row of a step is such, the
 * model picks the tokens itself (on the GPU, without sending the logits back). */
static int greedy_only(const m40_request *r)
{
    const m40_sampler_params *p = &r->sampling;
    return (p->temperature <= 0.0f || p->top_k == 1) && p->n_logit_bias == 0 && p->repetition_penalty == 1.0f &&
           p->presence_penalty == 0.0f && p->frequency_penalty == 0.0f && !r->logprobs;
}

/* Handles the logits of slot i's newest position: sample (logits: the row to sample
 * from, or NULL when the model already picked `picked`), detokenize, stop strings,
 * finish conditions, events. */
static void sequence_advance(m40_engine *e, int32_t i, float *logits, int32_t picked)
{
    m40_slot *s = &e->slots[i];
    m40_request *r = s->r;
    m40_sample_result res;
    if (logits) {
        m40_sampler_sample(s->smp, logits, &res);
    } else {
        res.token = picked;
        res.logprob = NAN;
        res.n_top = 0;
    }
    m40_sampler_accept(s->smp, res.token);

    double now = m40_now();
    if (s->n_gen == 0) {
        m40_hist_observe(e->tstats.hist_bounds, e->tstats.ttft_counts, &e->tstats.ttft_sum, now - r->t_submit);
        s->t_first = now;
    } else
        m40_hist_observe(e->tstats.hist_bounds, e->tstats.itl_counts, &e->tstats.itl_sum, now - s->t_last);
    s->t_last = now;
    s->n_gen++;
    e->tstats.completion_tokens_total++;

    stop_set st;
    stops_of(e, s, &st);
    m40_finish finish = M40_FINISH_NONE;
    /* with ignore_eos an end-of-generation token is output like any other (a control
     * token renders as nothing) and the sequence goes on */
    int eog = !r->ignore_eos && m40_tokenizer_is_eog(e->tok, res.token);
    if (!eog) {
        size_t n = 0;
        const char *txt = m40_detok_push(s->detok, res.token, &n);
        if (held_append(s, txt, n) != 0 ||
            (r->logprobs && held_token_append(e, s, &res, r->sampling.n_top_logprobs) != 0))
            goto nomem;
    }
    if (eog)
        finish = M40_FINISH_STOP;
    else if (s->n_gen >= r->max_tokens || s->n_past >= e->ctx)
        finish = M40_FINISH_LENGTH; /* no room for another token, or the limit asked for */
    if (finish != M40_FINISH_NONE) {
        /* The stream ends: incomplete UTF-8 held by the detokenizer becomes U+FFFD. */
        size_t n = 0;
        const char *txt = m40_detok_flush(s->detok, &n);
        if (held_append(s, txt, n) != 0)
            goto nomem;
    }
    long at = stop_find(&st, s->held ? s->held : "", s->held_len);
    if (at >= 0) {
        if (emit_held(e, s, (size_t)at, 1) != 0)
            goto nomem;
        finish = M40_FINISH_STOP;
    } else {
        size_t keep = finish != M40_FINISH_NONE ? 0 : stop_holdback(&st, s->held, s->held_len);
        if (emit_held(e, s, s->held_len - keep, 0) != 0)
            goto nomem;
    }
    if (finish != M40_FINISH_NONE) {
        push_done(e, s, finish);
        slot_finish(e, i);
    } else {
        s->next_token = res.token;
    }
    return;
nomem:
    push_error(e, r, 500, "out of memory producing the response");
    slot_finish(e, i);
}

static void batch_add(m40_engine *e, int32_t *n, int32_t tok, int32_t pos, int32_t slot, int want)
{
    e->b_tokens[*n] = tok;
    e->b_pos[*n] = pos;
    e->b_slot[*n] = slot;
    e->b_want[*n] = (uint8_t)want;
    (*n)++;
}

/* Keeps the token just fed at position s->n_past in s->prompt, so that a preempted
 * sequence can recompute its whole cache. -1 when out of memory. */
static int remember_token(m40_slot *s, int32_t tok)
{
    if (s->n_past >= s->cap_prompt) {
        int32_t cap = s->cap_prompt < 16 ? 32 : s->cap_prompt * 2;
        int32_t *p = realloc(s->prompt, (size_t)cap * sizeof *p);
        if (!p)
            return -1;
        s->prompt = p;
        s->cap_prompt = cap;
    }
    s->prompt[s->n_past] = tok;
    return 0;
}

/* Gives slot i's KV blocks back: its tokens so far (and the sampled token not yet fed)
 * become the prompt it prefills again later; output already emitted stays emitted. */
static int preempt(m40_engine *e, int32_t i)
{
    m40_slot *s = &e->slots[i];
    m40_kv_slot_clear(e->kv, i);
    if (s->n_prefilled == s->n_prompt && s->n_gen > 0) {
        if (remember_token(s, s->next_token) != 0)
            return -1;
        s->n_prompt = s->n_past + 1;
    }
    s->n_prefilled = 0;
    s->n_past = 0;
    s->preempted = 1;
    e->preemptions++;
    return 0;
}

/* Whether an older sequence in this step's batch is prefilling full blocks that slot c's
 * prompt shares and that are not cached yet: c then waits and finds them cached instead
 * of computing them a second time alongside. The older sequences get their chunks first
 * (FIFO), so c waits only while one of them is still computing the shared blocks. */
static int prefix_in_flight(const m40_engine *e, int32_t c)
{
    const int32_t bs = M40_KV_BLOCK_SIZE_DEFAULT;
    const m40_slot *sc = &e->slots[c];
    const int32_t max_blocks = (sc->n_prompt - 1) / bs; /* a match never covers the last token */
    for (int32_t o = 0; o < e->max_seqs; o++) {
        const m40_slot *so = &e->slots[o];
        if (o == c || !so->r || e->take[o] <= 0 || so->n_prefilled >= so->n_prompt)
            continue;
        int32_t lim = so->n_prefilled + e->take[o]; /* o's computed tokens after the step */
        if (lim > sc->n_prompt)
            lim = sc->n_prompt;
        int32_t l = 0;
        while (l < lim && so->prompt[l] == sc->prompt[l])
            l++;
        int32_t after = l / bs, now = (l < so->n_prefilled ? l : so->n_prefilled) / bs;
        if (after > max_blocks)
            after = max_blocks;
        if (after > now)
            return 1;
    }
    return 0;
}

/* Before a sequence's first chunk (new, or preempted and starting over): with the
 * prefix cache, wait while an older sequence computes blocks it shares, else attach
 * its cached prefix and start after it. */
static int first_chunk(void *ctx, int32_t i, int32_t *n_prefilled)
{
    m40_engine *e = ctx;
    m40_slot *s = &e->slots[i];
    if (!m40_kv_prefix_cache_enabled(e->kv))
        return 1;
    if (prefix_in_flight(e, i))
        return 0;
    int32_t hit = m40_kv_slot_match_prefix(e->kv, i, s->prompt, s->n_prompt);
    if (hit > 0 && hit < s->n_prompt)
        s->n_prefilled = s->n_past = *n_prefilled = hit;
    return 1;
}

/* Builds the step's batch from the slots' state; returns its size. */
static int32_t build_batch(m40_engine *e, int32_t *rows_out)
{
    int32_t n = 0, rows = 0;
    int32_t *take = e->take;
    for (int32_t i = 0; i < e->max_seqs; i++) {
        const m40_slot *s = &e->slots[i];
        e->plan[i] = (m40_plan_seq){.active = s->r != NULL && !s->preempted,
                                    .order = s->order,
                                    .n_past = s->n_past,
                                    .n_prompt = s->n_prompt,
                                    .n_prefilled = s->n_prefilled,
                                    .fresh = s->n_past == 0 && s->n_prefilled == 0,
                                    .arrived = s->r ? s->r->t_submit : 0.0,
                                    .streaming = s->t_first};
    }
    m40_step_plan(&e->prefill, &e->cost, e->plan, e->max_seqs, first_chunk, e, take, &e->shape, &e->plan_info);
    /* Decode rows first (the GPU forward orders them so anyway), then the chunks. */
    for (int32_t i = 0; i < e->max_seqs; i++) {
        const m40_slot *s = &e->slots[i];
        if (take[i] > 0 && s->n_prefilled >= s->n_prompt) {
            batch_add(e, &n, s->next_token, s->n_past, i, 1);
            e->row_slot[rows++] = i;
        }
    }
    for (int32_t i = 0; i < e->max_seqs; i++) {
        const m40_slot *s = &e->slots[i];
        if (take[i] <= 0 || s->n_prefilled >= s->n_prompt)
            continue;
        for (int32_t j = 0; j < take[i]; j++) {
            int last = s->n_prefilled + j + 1 == s->n_prompt;
            batch_add(e, &n, s->prompt[s->n_prefilled + j], s->n_prefilled + j, i, last);
            if (last)
                e->row_slot[rows++] = i;
        }
    }
    *rows_out = rows;
    return n;
}

/* The KV pool cannot hold the step: preempt the youngest running sequence that holds
 * blocks or is in the batch, never the oldest one. When the oldest is alone and still
 * does not fit, it ends (finish "length" once it has generated, else an error). */
static void make_room(m40_engine *e)
{
    int32_t oldest = -1, youngest = -1;
    for (int32_t i = 0; i < e->max_seqs; i++) {
        m40_slot *s = &e->slots[i];
        if (!s->r || s->preempted)
            continue;
        if (oldest < 0 || s->order < e->slots[oldest].order)
            oldest = i;
    }
    for (int32_t i = 0; i < e->max_seqs; i++) {
        m40_slot *s = &e->slots[i];
        if (!s->r || s->preempted || i == oldest || (e->take[i] == 0 && s->n_past == 0))
            continue;
        if (youngest < 0 || s->order > e->slots[youngest].order)
            youngest = i;
    }
    if (youngest >= 0 && preempt(e, youngest) == 0)
        return;
    int32_t i = youngest >= 0 ? youngest : oldest;
    if (i < 0)
        return;
    m40_slot *s = &e->slots[i];
    if (youngest < 0 && s->n_gen > 0) {
        push_done(e, s, M40_FINISH_LENGTH);
    } else {
        char msg[200];
        snprintf(msg, sizeof msg, "the sequence (%d tokens) does not fit in the KV cache pool (%d blocks of 16)",
                 (int)(s->n_prompt), (int)m40_kv_pool_blocks(e->kv));
        push_error(e, s->r, youngest < 0 ? 400 : 500, msg);
    }
    slot_finish(e, i);
    step_flush(e);
}

static void run_step(m40_engine *e)
{
    int32_t n, rows;
    int32_t *take = e->take;
    int rc, picked = 0;
    char err[256];
    for (int32_t i = 0; i < e->max_seqs; i++)
        e->slots[i].preempted = 0;
    double t0 = 0, fwd = 0;
    for (;;) {
        n = build_batch(e, &rows);
        if (n == 0)
            return;
        m40_batch b = {.n = n, .tokens = e->b_tokens, .pos = e->b_pos, .slot = e->b_slot, .want_logits = e->b_want};
        int greedy = rows > 0;
        for (int32_t k = 0; k < rows && greedy; k++)
            greedy = greedy_only(e->slots[e->row_slot[k]].r);
        b.argmax = greedy ? e->picks : NULL;
        t0 = m40_now();
        rc = m40_model_forward(e->model, e->kv, &b, e->logits, err, sizeof err);
        fwd = m40_now() - t0;
        e->tstats.forward_seconds += fwd;
        picked = b.argmax != NULL;
        if (rc != M40_FORWARD_NO_BLOCKS)
            break;
        make_room(e);
    }
    e->tstats.steps_total++;
    e->tstats.step_tokens_total += (uint64_t)n;
    e->tstats.guard_limited_steps += (uint64_t)e->plan_info.limited;
    e->tstats.guard_probe_steps += (uint64_t)e->plan_info.probe;
    if (rc == 0) /* the cost model learns from the call that ran (a refused one changes nothing) */
        m40_step_cost_observe(&e->cost, &e->shape, fwd);
    e->tstats.decode_step_estimate = m40_step_cost_decode(&e->cost, e->shape.n_dec, e->shape.dec_keys);
    if (rc != 0) {
        char msg[300];
        snprintf(msg, sizeof msg, "forward pass failed: %s", err);
        for (int32_t i = 0; i < e->max_seqs; i++)
            if (take[i] > 0) {
                push_error(e, e->slots[i].r, 500, msg);
                slot_finish(e, i);
            }
        step_flush(e);
        return;
    }
    for (int32_t i = 0; i < e->max_seqs; i++) {
        m40_slot *s = &e->slots[i];
        if (take[i] == 0)
            continue;
        if (s->n_prefilled < s->n_prompt) {
            s->n_prefilled += take[i];
            e->tstats.prompt_tokens_computed += (uint64_t)take[i];
        } else if (remember_token(s, s->next_token) != 0) {
            push_error(e, s->r, 500, "out of memory");
            slot_finish(e, i);
            take[i] = 0;
            continue;
        }
        s->n_past += take[i];
    }
    t0 = m40_now();
    for (int32_t k = 0; k < rows; k++)
        if (e->slots[e->row_slot[k]].r && take[e->row_slot[k]] > 0)
            sequence_advance(e, e->row_slot[k], picked ? NULL : e->logits + (size_t)k * (size_t)e->n_vocab,
                             picked ? e->picks[k] : -1);
    step_flush(e);
    e->tstats.sample_seconds += m40_now() - t0;
}

static void stats_publish(m40_engine *e)
{
    int64_t used = 0;
    int32_t running = 0;
    for (int32_t i = 0; i < e->max_seqs; i++)
        if (e->slots[i].r) {
            used += e->slots[i].n_past;
            running++;
        }
    /* A GPU pool: the blocks held by sequences (a block shared through the prefix cache
     * counts once; idle cached blocks count as free, they are evicted on demand). */
    if (m40_kv_pool_blocks(e->kv) > 0)
        used = (int64_t)(m40_kv_pool_blocks(e->kv) - m40_kv_pool_free_blocks(e->kv)) * 16;
    const m40_engine_stats *t = &e->tstats;
    m40_kv_prefix_stats ps;
    m40_kv_get_prefix_stats(e->kv, &ps);
    pthread_mutex_lock(&e->mu);
    m40_engine_stats *o = &e->stats;
    o->prompt_tokens_total = t->prompt_tokens_total;
    o->prompt_tokens_computed = t->prompt_tokens_computed;
    o->completion_tokens_total = t->completion_tokens_total;
    o->prefix_cache_queries = (uint64_t)ps.queries;
    o->prefix_cache_query_tokens = (uint64_t)ps.query_tokens;
    o->prefix_cache_hit_tokens = (uint64_t)ps.hit_tokens;
    o->steps_total = t->steps_total;
    o->step_tokens_total = t->step_tokens_total;
    o->forward_seconds = t->forward_seconds;
    o->sample_seconds = t->sample_seconds;
    o->schedule_seconds = t->schedule_seconds;
    o->guard_limited_steps = t->guard_limited_steps;
    o->guard_probe_steps = t->guard_probe_steps;
    o->decode_step_estimate = running > 0 ? t->decode_step_estimate : 0.0;
    o->running = running;
    o->kv_tokens_used = used;
    o->kv_tokens_total = m40_kv_pool_blocks(e->kv) > 0 ? (int64_t)m40_kv_pool_blocks(e->kv) * 16
                                                        : (int64_t)e->max_seqs * e->ctx;
    memcpy(o->ttft_counts, t->ttft_counts, sizeof o->ttft_counts);
    memcpy(o->itl_counts, t->itl_counts, sizeof o->itl_counts);
    o->ttft_sum = t->ttft_sum;
    o->itl_sum = t->itl_sum;
    pthread_mutex_unlock(&e->mu);
}

/* ---------- load and shutdown ---------- */

int32_t m40_auto_max_seqs(int64_t kv_blocks, int32_t block_size, int32_t ctx)
{
    /* sequences of M40_AUTO_SEQ_TOKENS (or of the whole context when shorter), each in
     * whole blocks */
    int64_t len = ctx < M40_AUTO_SEQ_TOKENS ? ctx : M40_AUTO_SEQ_TOKENS;
    int64_t per = block_size > 0 ? (len + block_size - 1) / block_size : 1;
    int64_t fit = kv_blocks / (per > 0 ? per : 1);
    return fit < 1 ? 1 : fit > M40_AUTO_MAX_SEQS ? M40_AUTO_MAX_SEQS : (int32_t)fit;
}

/* The KV cache and the number of slots (m40_engine.h says the rules). On a GPU the pool
 * is sized from the memory first, for the most slots the automatic choice could take
 * (the activation reserve grows with the slots), then an automatic max_seqs is what the
 * pool holds; the pool's slots past it stay unused (a few bytes each). The pool is
 * capped at what M40_AUTO_MAX_SEQS (or max_seqs, when larger) sequences of full
 * context need: more could only ever hold cached prefixes, and a small model on a big
 * card would otherwise get millions of blocks to keep track of. Fills e->capacity. */
static int kv_size(m40_engine *e, int32_t ctx, char *err, size_t errlen)
{
    const int gpu = m40_model_device(e->model) >= 0;
    const int automatic = e->max_seqs_cfg <= 0;
    int32_t slots = !automatic ? e->max_seqs_cfg : gpu ? M40_AUTO_MAX_SEQS : M40_CPU_MAX_SEQS;
    const int64_t bs = M40_KV_BLOCK_SIZE_DEFAULT, ctx_blocks = ((int64_t)ctx + bs - 1) / bs;
    m40_kv_options ko = {.gpu_memory_fraction = e->gpu_memory_fraction,
                         .max_tokens = (int64_t)(slots > M40_AUTO_MAX_SEQS ? slots : M40_AUTO_MAX_SEQS) * ctx_blocks * bs,
                         .max_step_rows = slots + e->prefill.budget,
                         .max_step_out = slots};
    char kerr[400];
    e->kv = m40_kv_new_opts(e->model, slots, ctx, &ko, kerr, sizeof kerr);
    if (!e->kv) {
        snprintf(err, errlen, "cannot allocate the KV cache for %d sequences of %d tokens: %s", (int)slots, (int)ctx,
                 kerr);
        return -1;
    }
    m40_engine_capacity c;
    memset(&c, 0, sizeof c);
    c.device = gpu ? m40_model_device(e->model) : -1;
    c.ctx = ctx;
    if (gpu) {
        m40_kv_pool_info pi;
        m40_kv_get_pool_info(e->kv, &pi);
        c.kv_blocks = m40_kv_pool_blocks(e->kv);
        c.kv_block_size = (int32_t)bs;
        c.kv_tokens = (int64_t)c.kv_blocks * bs;
        c.full_ctx_seqs = c.kv_blocks / ctx_blocks;
        c.gpu_memory_fraction = pi.fraction;
        c.gpu_total = pi.total;
        c.gpu_in_use = pi.in_use;
        c.gpu_reserve = pi.reserve;
        c.kv_bytes = pi.pool;
        if (automatic)
            slots = m40_auto_max_seqs(c.kv_blocks, (int32_t)bs, ctx);
    } else {
        c.kv_tokens = (int64_t)slots * ctx;
        c.full_ctx_seqs = slots;
    }
    e->max_seqs = slots;
    c.max_seqs = slots;
    c.max_seqs_auto = automatic;
    c.max_queue = e->max_queue;
    c.prefill_budget = e->prefill.budget;
    c.prefill_budget_auto = e->prefill_budget_auto;
    c.prefill_chunk = e->prefill.chunk;
    c.itl_guard = (float)e->prefill.guard;
    e->capacity = c; /* others read it (under e->mu) only once READY is set */
    return 0;
}

static int engine_load(m40_engine *e, char *err, size_t errlen)
{
    char merr[384];
    m40_model_options mo = {.n_threads = e->n_threads, .device = e->device < 0 ? -1 : e->device, .log_progress = 1};
    if (m40_model_load_opts(e->model_path, &mo, &e->model, merr, sizeof merr) != 0) {
        snprintf(err, errlen, "%s: %s", e->model_path, merr);
        return -1;
    }
    const m40_model_params *mp = m40_model_get_params(e->model);
    int32_t ctx = e->ctx_cfg > 0 ? e->ctx_cfg : mp->ctx_train;
    if (ctx <= 0) {
        snprintf(err, errlen, "the model does not state its context length; set a context size");
        return -1;
    }
    /* Under the lock: the submitter's thread reads these (valid once READY). */
    pthread_mutex_lock(&e->mu);
    e->ctx = ctx;
    e->n_vocab = mp->n_vocab;
    pthread_mutex_unlock(&e->mu);
    e->tok = m40_model_tokenizer(e->model);
    /* When "<|im_end|>" is a token it is an end-of-generation id already (or plain
     * control text the model was trained to emit as one id); when it is not, the
     * model can only spell it out, and the fallback template stops on that text. */
    e->fallback_end_is_text = m40_tokenizer_find_piece(e->tok, M40_FALLBACK_END) < 0;
    if (kv_size(e, ctx, err, errlen) != 0)
        return -1;

    const char *src = e->template_override;
    if (!src)
        src = m40_gguf_get_str(m40_model_gguf(e->model), "tokenizer.chat_template");
    if (src) {
        char jerr[200];
        if (m40_jinja_parse(src, strlen(src), &e->tmpl, jerr, sizeof jerr) != 0) {
            e->tmpl = NULL;
            if (e->template_override) {
                snprintf(err, errlen, "chat template: %s", jerr);
                return -1;
            }
            /* The model's own template: completions still work; chat requests are
             * answered with this message rather than a silently different prompt. */
            snprintf(e->tmpl_err, sizeof e->tmpl_err, "%s", jerr);
        }
    }

    /* every slot decoding (one row each) or prefilling (within the budget in all) */
    size_t bcap = (size_t)e->max_seqs + (size_t)e->prefill.budget;
    e->slots = calloc((size_t)e->max_seqs, sizeof *e->slots);
    e->b_tokens = malloc(bcap * sizeof *e->b_tokens);
    e->b_pos = malloc(bcap * sizeof *e->b_pos);
    e->b_slot = malloc(bcap * sizeof *e->b_slot);
    e->b_want = malloc(bcap);
    e->row_slot = malloc((size_t)e->max_seqs * sizeof *e->row_slot);
    e->picks = malloc((size_t)e->max_seqs * sizeof *e->picks);
    e->take = malloc((size_t)e->max_seqs * sizeof *e->take);
    e->plan = malloc((size_t)e->max_seqs * sizeof *e->plan);
    m40_step_cost_init(&e->cost);
    e->logits = malloc((size_t)e->max_seqs * (size_t)e->n_vocab * sizeof *e->logits);
    e->ready_batch = malloc((size_t)e->max_seqs * sizeof *e->ready_batch);
    e->done_batch = malloc((size_t)e->max_seqs * sizeof *e->done_batch);
    if (!e->slots || !e->b_tokens || !e->b_pos || !e->b_slot || !e->b_want || !e->row_slot || !e->picks || !e->take ||
        !e->plan || !e->logits || !e->ready_batch || !e->done_batch) {
        snprintf(err, errlen, "out of memory allocating the scheduler's buffers");
        return -1;
    }
    return 0;
}

/* GPU warm-up, before the engine reports READY: forward passes over the batch shapes that
 * serving produces, so that the first requests do not pay for what the first pass of
 * each shape costs (an H100 with a 7B F16 model, the first 16-stream benchmark after a
 * start: 1,953 tokens/s without warm-up, 2,014 / 2,025 / 2,041 with it; BENCHMARKS.md).
 * CUDA loads a kernel at its first launch, cuBLAS picks other kernels for other
 * row counts, the GEMVs are instantiated per batch size, the attention kernels differ
 * for one query and for many, and the device scratch grows to the largest step.
 * Shapes, largest first: the largest step (the prefill budget as chunks of
 * prefill.chunk tokens in as many slots, one decode token in every other slot), the
 * same chunks alone, one chunk alone of prefill.chunk, 512, 256, ..., 32 tokens, then
 * every decode batch of 1..min(max_seqs, 64) tokens (one a slot) and the powers of two
 * above up to max_seqs. Greedy (device argmax) and full-logits passes alternate.
 * Afterwards every slot is cleared and the prefix cache forgets the warm-up's blocks.
 * M40_WARMUP=0 skips it (to measure it); the CPU backend has nothing to warm. */
static void engine_warmup(m40_engine *e)
{
    const char *env = getenv("M40_WARMUP");
    if (m40_model_device(e->model) < 0 || (env && !strcmp(env, "0")))
        return;
    const int32_t S = e->max_seqs, chunk = e->prefill.chunk < e->ctx ? e->prefill.chunk : e->ctx;
    int32_t n_full = (e->prefill.budget + chunk - 1) / chunk;
    if (n_full > S)
        n_full = S;
    const int32_t full = e->prefill.budget < n_full * chunk ? e->prefill.budget : n_full * chunk;
    /* per shape: prompt chunks in slots 0..chunks-1 (`prompt` tokens in all, `chunk`
     * each but the last), then one decode token in each of the next `dec` slots */
    int32_t chunks[96], prompt[96], dec[96], ns = 0;
    chunks[ns] = n_full, prompt[ns] = full, dec[ns++] = S - n_full;
    if (S - n_full > 0)
        chunks[ns] = n_full, prompt[ns] = full, dec[ns++] = 0;
    if (n_full > 1)
        chunks[ns] = 1, prompt[ns] = chunk, dec[ns++] = 0;
    for (int32_t c = 512; c >= 32; c /= 2)
        if (c < chunk)
            chunks[ns] = 1, prompt[ns] = c, dec[ns++] = 0;
    for (int32_t d = 1; d <= S && d <= 64; d++)
        chunks[ns] = 0, prompt[ns] = 0, dec[ns++] = d;
    for (int32_t d = 128; d < S && ns < 95; d *= 2)
        chunks[ns] = 0, prompt[ns] = 0, dec[ns++] = d;
    if (S > 64)
        chunks[ns] = 0, prompt[ns] = 0, dec[ns++] = S;
    const double t0 = m40_now();
    char err[256];
    int done = 0;
    for (int k = 0; k < ns; k++) {
        int32_t n = 0;
        for (int32_t j = 0; j < chunks[k]; j++) {
            const int32_t len = prompt[k] - j * chunk < chunk ? prompt[k] - j * chunk : chunk;
            for (int32_t p = 0; p < len; p++, n++) {
                e->b_tokens[n] = (int32_t)(((int64_t)n * 31 + 7) % e->n_vocab);
                e->b_pos[n] = p;
                e->b_slot[n] = j;
                e->b_want[n] = p == len - 1;
            }
        }
        for (int32_t d = 0; d < dec[k]; d++, n++) {
            e->b_tokens[n] = (int32_t)(((int64_t)n * 31 + 7) % e->n_vocab);
            e->b_pos[n] = 0;
            e->b_slot[n] = chunks[k] + d;
            e->b_want[n] = 1;
        }
        m40_batch b = {.n = n, .tokens = e->b_tokens, .pos = e->b_pos, .slot = e->b_slot, .want_logits = e->b_want};
        b.argmax = k % 2 ? e->picks : NULL;
        if (m40_model_forward(e->model, e->kv, &b, e->logits, err, sizeof err) != 0) {
            fprintf(stderr, "m40: warm-up stopped at a batch of %d tokens: %s\n", (int)n, err);
            break;
        }
        done++;
    }
    for (int32_t i = 0; i < S; i++)
        m40_kv_slot_clear(e->kv, i);
    m40_kv_prefix_forget(e->kv);
    fprintf(stderr, "m40: warm-up: %d forward passes (batches of 1..%d tokens) in %.0f ms\n", done,
            (int)(full + S - n_full), (m40_now() - t0) * 1e3);
}

static void engine_unload(m40_engine *e)
{
    if (e->slots)
        for (int32_t i = 0; i < e->max_seqs; i++)
            slot_clear(&e->slots[i]);
    free(e->slots);
    free(e->b_tokens);
    free(e->b_pos);
    free(e->b_slot);
    free(e->b_want);
    free(e->row_slot);
    free(e->picks);
    free(e->take);
    free(e->plan);
    free(e->logits);
    free(e->ready_batch);
    free(e->done_batch);
    m40_jinja_free(e->tmpl);
    m40_kv_free(e->kv);
    m40_model_free(e->model);
    e->slots = NULL;
    e->tmpl = NULL;
    e->kv = NULL;
    e->model = NULL;
}

/* Stop: running sequences end with finish "cancelled", queued requests with 503. */
static void engine_shutdown(m40_engine *e)
{
    int32_t cancelled = 0;
    for (int32_t i = 0; i < e->max_seqs; i++)
        if (e->slots[i].r) {
            push_done(e, &e->slots[i], M40_FINISH_CANCELLED);
            slot_finish(e, i);
            cancelled++;
        }
    step_flush(e);
    for (;;) {
        pthread_mutex_lock(&e->mu);
        m40_request *r = queue_pop_locked(e);
        e->stats.queue_depth = m40_engine_waiting_locked(e);
        e->stats.requests_cancelled += (uint64_t)cancelled;
        cancelled = 0;
        pthread_mutex_unlock(&e->mu);
        if (!r)
            break;
        admit_fail(e, r, 503, "the engine is stopping");
    }
    stats_publish(e);
}

/* The engine could not start: what was loaded goes, the state says FAILED with why. */
static void *engine_fail_start(m40_engine *e, const char *err)
{
    engine_unload(e);
    pthread_mutex_lock(&e->mu);
    e->state = M40_ENGINE_FAILED;
    snprintf(e->load_err, sizeof e->load_err, "%s", err);
    pthread_mutex_unlock(&e->mu);
    m40_engine_wake(e);
    return NULL;
}

void *m40_engine_thread_main(void *arg)
{
    m40_engine *e = arg;
    char err[512];
    memcpy(e->tstats.hist_bounds, e->stats.hist_bounds, sizeof e->tstats.hist_bounds);
    if (engine_load(e, err, sizeof err) != 0)
        return engine_fail_start(e, err);
    engine_warmup(e);
    if (m40_prompt_start(e, err, sizeof err) != 0)
        return engine_fail_start(e, err);
    pthread_mutex_lock(&e->mu);
    e->state = M40_ENGINE_READY;
    e->stats.kv_tokens_total = m40_kv_pool_blocks(e->kv) > 0 ? (int64_t)m40_kv_pool_blocks(e->kv) * 16
                                                               : (int64_t)e->max_seqs * e->ctx;
    pthread_mutex_unlock(&e->mu);
    m40_engine_wake(e);

    for (;;) {
        pthread_mutex_lock(&e->mu);
        while (!e->stop && e->q_n == 0 && n_active(e) == 0)
            pthread_cond_wait(&e->cv, &e->mu);
        int stop = e->stop;
        pthread_mutex_unlock(&e->mu);
        if (stop)
            break;
        double t0 = m40_now(), busy0 = e->tstats.forward_seconds + e->tstats.sample_seconds;
        cancel_released(e);
        admit_queued(e);
        run_step(e);
        stats_publish(e);
        e->tstats.schedule_seconds += m40_now() - t0 - (e->tstats.forward_seconds + e->tstats.sample_seconds - busy0);
    }
    /* The tokenizer thread first: it answers what waits for it, and whatever it had
     * queued for admission before it saw the stop is answered by engine_shutdown. */
    m40_prompt_stop(e);
    engine_shutdown(e);
    engine_unload(e);
    return NULL;
}
