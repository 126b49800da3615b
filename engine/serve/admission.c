/* Admission: requests the tokenizer thread has tokenized take free slots (sampler and
 * detokenizer created), oldest first; released ones are cancelled before a step
 * computes anything for them. */
#include "engine_impl.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

/* ---------- admission ---------- */

/* Error before a slot was taken: answer and drop the engine's reference now. */
void m40_admit_fail(m40_engine *e, m40_request *r, int status, const char *msg)
{
    m40_push_error(e, r, status, msg);
    m40_step_flush(e);
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
    if (r->grammar) { /* the constraint takes the compiled grammar over */
        s->gc = m40_gconstraint_new(r->grammar, e->vocab_trie);
        r->grammar = NULL;
    }
    if (s->gc && s->detok && n > 0) {
        /* The grammar matched the tokens' bytes as they are, a leading space included, so
         * the text must not lose SentencePiece's first space: the detokenizer starts after
         * the prompt's last token (its text, and any incomplete UTF-8 tail, thrown away). */
        size_t k;
        m40_detok_push(s->detok, ids[n - 1], &k);
        m40_detok_flush(s->detok, &k);
    }
    if (!s->smp || !s->detok || (r->grammar_src || r->json_schema || r->json_object || r->tool_call_format ? !s->gc : 0)) {
        free(ids);
        m40_slot_clear(s);
        m40_admit_fail(e, r, 500, "out of memory creating the sampler");
        return;
    }
    s->r = r;
    s->order = e->admit_counter++;
    s->prompt = ids;
    s->n_prompt = n;
    s->n_prompt_user = n;
    s->n_cached = -1; /* set at its first chunk (scheduler.c first_chunk) */
    s->cap_prompt = n;
    e->tstats.prompt_tokens_total += (uint64_t)n;
}

void m40_cancel_released(m40_engine *e)
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
            m40_slot_finish(e, i); /* no event: nobody is listening */
    m40_step_flush(e);
    /* no event tells the submitter, but its copy of the statistics (every worker's
     * /metrics) is to show the cancellation and the freed slots: a wake-up once the
     * step's statistics are out (engine_thread.c) */
    e->stats_wake = 1;
}

/* The oldest queued request, taken off the queue and now the engine's (NULL when the
 * queue is empty). Under e->mu. */
m40_request *m40_queue_pop_locked(m40_engine *e)
{
    m40_request *r = e->q_head;
    if (r) {
        m40_queue_unlink(&e->q_head, &e->q_tail, &e->q_n, r);
        e->stats.queue_depth = m40_engine_waiting_locked(e);
        r->phase = M40_REQ_ENGINE;
    }
    return r;
}

void m40_admit_queued(m40_engine *e)
{
    for (int32_t i = 0; i < e->max_seqs; i++) {
        while (!e->slots[i].r) {
            pthread_mutex_lock(&e->mu);
            m40_request *r = m40_queue_pop_locked(e);
            pthread_mutex_unlock(&e->mu);
            if (!r)
                return;
            admit(e, r, i);
        }
    }
}
