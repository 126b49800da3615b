/* The engine thread's output: from a sequence's new token to its request's events.
 * Each token is sampled, detokenized (UTF-8 safe), its text held back while it could
 * still be the start of a stop string, and emitted as TEXT events (with logprobs when
 * asked); a finished sequence gets its DONE event and gives its slot back. The
 * requests that got events are notified once a step (m40_step_flush). */
#include "engine_impl.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---------- slot bookkeeping ---------- */

void m40_slot_clear(m40_slot *s)
{
    m40_sampler_free(s->smp);
    m40_gconstraint_free(s->gc);
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
void m40_slot_finish(m40_engine *e, int32_t i)
{
    m40_slot *s = &e->slots[i];
    e->done_batch[e->n_done_batch++] = s->r;
    m40_kv_slot_clear(e->kv, i);
    m40_slot_clear(s);
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

void m40_push_error(m40_engine *e, m40_request *r, int http_status, const char *msg)
{
    m40_event ev;
    memset(&ev, 0, sizeof ev);
    ev.type = M40_EV_ERROR;
    ev.http_status = http_status;
    snprintf(ev.message, sizeof ev.message, "%s", msg);
    push_or_drop(e, r, &ev);
}

void m40_push_done(m40_engine *e, m40_slot *s, m40_finish finish)
{
    m40_event ev;
    memset(&ev, 0, sizeof ev);
    ev.type = M40_EV_DONE;
    ev.finish = finish;
    ev.prompt_tokens = s->n_prompt_user;
    ev.cached_tokens = s->n_cached > 0 ? s->n_cached : 0;
    ev.completion_tokens = s->n_gen;
    ev.stop_matched = finish == M40_FINISH_STOP ? s->stop_matched : 0;
    ev.reasoning_open = s->r->reasoning_open;
    push_or_drop(e, s->r, &ev);
}

/* Flushes the step's notifications, then drops the references of finished requests.
 * The statistics are published first: whoever sees an event (a worker that then
 * copies the counters for every worker's /metrics) finds the tokens it carries counted. */
void m40_step_flush(m40_engine *e)
{
    if (e->n_ready_batch > 0)
        m40_stats_publish(e);
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
        ev.reasoning_open = r->reasoning_open;
        ev.prompt_tokens = s->n_prompt_user;
        ev.cached_tokens = s->n_cached > 0 ? s->n_cached : 0;
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

/* Earliest stop match in held text; -1 when none. *which: the matching string's index. */
static long stop_find(const stop_set *st, const char *text, size_t n, int *which)
{
    long best = -1;
    for (int i = 0; i < st->n; i++) {
        const char *p = memmem(text, n, st->s[i], st->len[i]);
        if (p && (best < 0 || p - text < best)) {
            best = (long)(p - text);
            *which = i;
        }
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

/* ---------- a new token ---------- */

/* A constrained sequence that no token may continue: the automaton failed (an error), or
 * the grammar is complete and the vocabulary has no end-of-generation token (a stop). */
static void grammar_end(m40_engine *e, int32_t i)
{
    m40_slot *s = &e->slots[i];
    const char *why = m40_gconstraint_error(s->gc);
    if (why) {
        m40_push_error(e, s->r, 500, why);
    } else {
        size_t n = 0;
        const char *txt = m40_detok_flush(s->detok, &n);
        if (held_append(s, txt, n) != 0 || emit_held(e, s, s->held_len, 0) != 0)
            m40_push_error(e, s->r, 500, "out of memory producing the response");
        else
            m40_push_done(e, s, M40_FINISH_STOP);
    }
    m40_slot_finish(e, i);
}

int m40_sequence_pick(m40_engine *e, int32_t i, float *logits, m40_sample_result *res)
{
    m40_slot *s = &e->slots[i];
    if (s->gc && m40_sampler_plain_greedy(s->smp)) {
        /* greedy under a grammar: the best allowed token straight from the mask's words
         * (no -inf pass over the row, no second pass for the argmax) */
        int32_t t = m40_gconstraint_argmax(s->gc, logits);
        if (t < 0 || m40_gconstraint_accept(s->gc, t) != 0)
            return -1;
        res->token = t;
        res->logprob = NAN;
        res->n_top = 0;
        m40_sampler_accept(s->smp, t);
        return 0;
    }
    /* Constrained: what the grammar does not allow is -inf before the sampler sees the row
     * (constrained rows always bring their logits to the host: scheduler.c's greedy_only). */
    if (s->gc && m40_gconstraint_apply(s->gc, logits) == 0)
        return -1;
    m40_sampler_sample(s->smp, logits, res);
    if (s->gc && m40_gconstraint_accept(s->gc, res->token) != 0) {
        /* only a draw's rounding at the very top can land on a banned (zero-probability)
         * candidate: the most likely allowed token instead */
        int32_t best = 0;
        for (int32_t k = 1; k < e->n_vocab; k++)
            if (logits[k] > logits[best])
                best = k;
        res->token = best;
        res->n_top = 0;
        if (m40_gconstraint_accept(s->gc, best) != 0)
            return -1;
    }
    m40_sampler_accept(s->smp, res->token);
    return 0;
}

void m40_sequence_advance(m40_engine *e, int32_t i, float *logits, int32_t picked)
{
    m40_sample_result res;
    int rc = 0;
    if (logits) {
        rc = m40_sequence_pick(e, i, logits, &res);
    } else if (e->slots[i].gc) {
        rc = -1; /* a constrained row without its logits: nothing to mask (not reached) */
    } else {
        res.token = picked;
        res.logprob = NAN;
        res.n_top = 0;
        m40_sampler_accept(e->slots[i].smp, picked);
    }
    m40_sequence_commit(e, i, rc, &res);
}

void m40_sequence_commit(m40_engine *e, int32_t i, int pick_rc, const m40_sample_result *picked)
{
    m40_slot *s = &e->slots[i];
    m40_request *r = s->r;
    m40_sample_result res = *picked;
    if (pick_rc != 0) {
        grammar_end(e, i);
        return;
    }
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
    else if (s->gc && m40_gconstraint_done(s->gc))
        finish = M40_FINISH_STOP; /* the grammar is complete: only end-of-generation could follow */
    else if (s->n_gen >= r->max_tokens || s->n_past >= e->ctx)
        finish = M40_FINISH_LENGTH; /* no room for another token, or the limit asked for */
    if (finish != M40_FINISH_NONE) {
        /* The stream ends: incomplete UTF-8 held by the detokenizer becomes U+FFFD. */
        size_t n = 0;
        const char *txt = m40_detok_flush(s->detok, &n);
        if (held_append(s, txt, n) != 0)
            goto nomem;
    }
    int which = 0;
    long at = stop_find(&st, s->held ? s->held : "", s->held_len, &which);
    if (at >= 0) {
        /* the request's own strings come first in the set (Anthropic reports which) */
        s->stop_matched = which < r->n_stop ? which + 1 : 0;
        if (emit_held(e, s, (size_t)at, 1) != 0)
            goto nomem;
        finish = M40_FINISH_STOP;
    } else {
        size_t keep = finish != M40_FINISH_NONE ? 0 : stop_holdback(&st, s->held, s->held_len);
        if (emit_held(e, s, s->held_len - keep, 0) != 0)
            goto nomem;
    }
    if (finish != M40_FINISH_NONE) {
        m40_push_done(e, s, finish);
        m40_slot_finish(e, i);
    } else {
        s->next_token = res.token;
    }
    return;
nomem:
    m40_push_error(e, r, 500, "out of memory producing the response");
    m40_slot_finish(e, i);
}
