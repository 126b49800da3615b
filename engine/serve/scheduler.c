/* The scheduler's step: which tokens of which sequences go into one forward call, and
 * what happens when the KV pool cannot hold them. The engine thread (engine_thread.c)
 * loads the model and runs the continuous-batching loop; admission.c does steps 1-2
 * below and output.c the events of steps 4-5.
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
 * (m40_kv_slot_clear), and before the forward call the pool is asked whether the step
 * fits (m40_kv_reserve, which takes its blocks); when it needs more blocks than are
 * free the answer is M40_FORWARD_NO_BLOCKS and nothing is taken; the youngest sequence
 * is then preempted (its blocks freed, its tokens so far, generated ones included,
 * become a prompt to recompute later) and the step is rebuilt, until it fits. The pool
 * is sized from the GPU's memory, not from max_seqs * ctx (kv_size, engine_thread.c),
 * so this is the normal way a full pool is shared: admission takes any free slot, the oldest sequence
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
#include "util/threadpool.h"

#include <stdio.h>
#include <stdlib.h>

/* ---------- one step ---------- */

/* ---------- the step's helper threads ----------
 *
 * A grammar-constrained row costs the engine thread its mask (a walk of the vocabulary
 * trie on a state's first visit, a lookup after), the sampler and the grammar's advance:
 * at 64 constrained streams on a GPU, host work of the order of the whole step
 * (BENCHMARKS.md, sixteenth session). On a GPU engine
 * the masks are computed on helper threads while the GPU runs the step (the state they
 * need is known before it), and the rows' picks then run on the same threads; only the
 * commit (detokenizing, stop strings, events) stays serial. The CPU engine keeps doing
 * both on its thread (its forward pass already has every core) unless M40_PICK_THREADS
 * asks for helpers (the tests do, to run this path without a GPU). */
enum { PICK_MIN_ROWS = 4 }; /* fewer rows' picks stay on the engine thread: waking helpers costs more */
enum { GPU_SAMPLE_MIN_ROWS = 8 };

static int pick_pool_ready(m40_engine *e)
{
    if (e->pick_pool)
        return 1;
    if (e->pick_pool_failed || e->pick_threads < 1)
        return 0;
    e->pick_rows = malloc((size_t)e->max_seqs * sizeof *e->pick_rows);
    e->pick_rc = malloc((size_t)e->max_seqs * sizeof *e->pick_rc);
    e->pick_res = malloc((size_t)e->max_seqs * sizeof *e->pick_res);
    /* the engine thread works on the jobs too: pick_threads helpers beside it */
    e->pick_pool = e->pick_rows && e->pick_rc && e->pick_res ? m40_threadpool_new(e->pick_threads + 1) : NULL;
    if (!e->pick_pool) {
        m40_pick_pool_free(e);
        e->pick_pool_failed = 1; /* the serial path serves every step from now on */
        return 0;
    }
    return 1;
}

void m40_pick_pool_free(m40_engine *e)
{
    m40_threadpool_free(e->pick_pool);
    free(e->pick_rows);
    free(e->pick_rc);
    free(e->pick_res);
    e->pick_pool = NULL;
    e->pick_rows = NULL;
    e->pick_rc = NULL;
    e->pick_res = NULL;
}

static void mask_task(void *ctx, int task, int thread)
{
    (void)thread;
    m40_engine *e = ctx;
    (void)m40_gconstraint_mask(e->slots[e->row_slot[e->pick_rows[task]]].gc); /* cached for the pick */
}

static void pick_task(void *ctx, int task, int thread)
{
    (void)thread;
    m40_engine *e = ctx;
    int32_t k = e->pick_rows[task];
    e->pick_rc[task] =
        m40_sequence_pick(e, e->row_slot[k], e->step_logits + (size_t)k * (size_t)e->n_vocab, &e->pick_res[task]);
}

/* Starts the constrained rows' masks on the helper threads (the caller then runs the
 * forward pass and m40_threadpool_wait); 0 when there is nothing to start. */
static int masks_start(m40_engine *e, int32_t rows)
{
    int32_t n = 0;
    for (int32_t k = 0; k < rows; k++) {
        const m40_slot *s = &e->slots[e->row_slot[k]];
        if (s->r && s->gc)
            n++;
    }
    /* one row is enough: the helpers work while the forward pass runs, their wake-up hidden */
    if (n < 1 || !pick_pool_ready(e))
        return 0;
    n = 0;
    for (int32_t k = 0; k < rows; k++) {
        const m40_slot *s = &e->slots[e->row_slot[k]];
        if (s->r && s->gc)
            e->pick_rows[n++] = k;
    }
    m40_threadpool_start(e->pick_pool, n, mask_task, e);
    return 1;
}

/* A request whose draw the GPU can make itself (m40_batch.sample: temperature, top-k,
 * top-p, min-p and the seed): nothing the device sampler does not do (logit bias,
 * penalties) and no logprobs to report. A grammar masks the logits on the host:
 * constrained rows always bring theirs back (forced tool calls too: without their logits
 * such a row ended at once, no token). A step whose rows are all such brings back only
 * the picks, not 64 rows of logits to sample on the host. */
static int device_sampleable(const m40_request *r)
{
    const m40_sampler_params *p = &r->sampling;
    return p->n_logit_bias == 0 && p->repetition_penalty == 1.0f && p->presence_penalty == 0.0f &&
           p->frequency_penalty == 0.0f && !r->logprobs && !r->grammar_src && !r->json_schema && !r->json_object &&
           !r->tool_call_format;
}

/* A request whose next token is the plain argmax of the logits: greedy, and otherwise
 * device_sampleable. When every row of a step is such, the model picks the tokens itself
 * (on the GPU, without sending the logits back). */
static int greedy_only(const m40_request *r)
{
    return (r->sampling.temperature <= 0.0f || r->sampling.top_k == 1) && device_sampleable(r);
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
    /* Batch invariance: a match that left one prompt token would have it computed alone,
     * as a decode query (invariant_chunks), where the prompt's first computation had it
     * in a chunk; so the match leaves at least two (it stops a block short where it
     * would have left one). */
    const int32_t n = e->batch_invariant && s->n_prompt > 2 ? s->n_prompt - 1 : s->n_prompt;
    int32_t hit = m40_kv_slot_match_prefix(e->kv, i, s->prompt, n);
    if (hit > 0 && hit < s->n_prompt)
        s->n_prefilled = s->n_past = *n_prefilled = hit;
    if (s->n_cached < 0)
        s->n_cached = hit > 0 && hit < s->n_prompt_user ? hit : 0;
    return 1;
}

/* Batch invariance (m40_engine_config.batch_invariant): the GPU computes a sequence's
 * one row in a step as a decode query (engine/kv/paged_kv.c) and the rows of a longer
 * group as a prompt chunk, which round differently; so that a prompt token is computed
 * the same way whatever else runs, no prompt chunk is one token unless the whole prompt
 * is, and none leaves one token behind: such a chunk is a token shorter, or waits a step
 * for a longer one while other rows go ahead (and a cached prefix leaves two tokens:
 * first_chunk). Not where the limits allow no better (prefill_chunk or budget 1; a prompt
 * of three tokens left under chunks of two; a sequence alone under a budget of two). */
static void invariant_chunks(const m40_engine *e, int32_t *take)
{
    if (e->prefill.chunk < 2 || e->prefill.budget < 2)
        return;
    int32_t rows = 0; /* the step's rows: a chunk waits only where others go ahead */
    for (int32_t i = 0; i < e->max_seqs; i++)
        rows += take[i] > 0 ? take[i] : 0;
    for (int32_t i = 0; i < e->max_seqs; i++) {
        const m40_slot *s = &e->slots[i];
        const int32_t left = s->n_prompt - s->n_prefilled;
        if (take[i] <= 0 || left < 2)
            continue;
        if (take[i] == left - 1 && take[i] >= 3) {
            take[i]--, rows--;
        } else if ((take[i] == 1 || (take[i] == 2 && left == 3 && e->prefill.chunk >= 3)) && rows > take[i]) {
            /* what the budget left this step: the whole rest in a later one (the oldest
             * prompt gets its full chunk), never a token alone */
            rows -= take[i];
            take[i] = 0;
        }
    }
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
    if (e->batch_invariant)
        invariant_chunks(e, take);
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
        m40_push_done(e, s, M40_FINISH_LENGTH);
    } else {
        char msg[200];
        snprintf(msg, sizeof msg, "the sequence (%d tokens) does not fit in the KV cache pool (%d blocks of 16)",
                 (int)(s->n_prompt), (int)m40_kv_pool_blocks(e->kv));
        m40_push_error(e, s->r, youngest < 0 ? 400 : 500, msg);
    }
    m40_slot_finish(e, i);
    m40_step_flush(e);
}

void m40_run_step(m40_engine *e)
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
        m40_batch b = {.n = n, .tokens = e->b_tokens, .pos = e->b_pos, .slot = e->b_slot, .want_logits = e->b_want,
                       .logits_at = &e->step_logits};
        /* the device's draw costs about the same however few rows (one block a row over
         * the vocabulary), the host's grows with the rows: below GPU_SAMPLE_MIN_ROWS the
         * host is faster (BENCHMARKS.md, sixteenth session) */
        int greedy = rows > 0, drawn = rows >= GPU_SAMPLE_MIN_ROWS && e->device >= 0 && e->gpu_sample && e->row_sample;
        for (int32_t k = 0; k < rows && (greedy || drawn); k++) {
            const m40_slot *s = &e->slots[e->row_slot[k]];
            greedy = greedy && greedy_only(s->r);
            drawn = drawn && device_sampleable(s->r);
        }
        if (!greedy && drawn) { /* every row drawn on the device (M40_GPU_SAMPLE) */
            for (int32_t k = 0; k < rows; k++) {
                const m40_slot *s = &e->slots[e->row_slot[k]];
                const m40_sampler_params *sp = &s->r->sampling;
                e->row_sample[k] = (m40_row_sample){.temperature = sp->temperature, .top_k = sp->top_k,
                                                    .top_p = sp->top_p, .min_p = sp->min_p, .seed = sp->seed,
                                                    .step = (uint64_t)s->n_gen};
            }
            b.sample = e->row_sample;
        }
        b.argmax = greedy || drawn ? e->picks : NULL;
        t0 = m40_now();
        int masking = !greedy && masks_start(e, rows);
        /* kv/ says first whether the step's new positions fit (and takes their blocks) */
        rc = m40_kv_reserve(e->kv, &b, err, sizeof err);
        if (rc == 0)
            rc = m40_model_forward(e->model, e->kv, &b, e->logits, err, sizeof err);
        fwd = m40_now() - t0;
        if (masking) { /* masks that outlast the forward pass count as sampling time */
            double tw = m40_now();
            m40_threadpool_wait(e->pick_pool);
            e->tstats.sample_seconds += m40_now() - tw;
            e->tstats.grammar_wait_seconds += m40_now() - tw;
        }
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
    if (rc == 0 && e->step_trace) /* the prediction the plan was made with, before it learns */
        fprintf(e->step_trace, "%.6f,%d,%.0f,%d,%d,%.0f,%d,%d,%d,%.4f,%.4f\n", m40_now() - e->trace_t0,
                (int)e->shape.n_dec, e->shape.dec_keys, (int)e->shape.prefill, (int)e->shape.n_chunks,
                e->shape.pre_keys, e->plan_info.guarded, e->plan_info.limited, e->plan_info.probe,
                1e3 * m40_step_cost_predict(&e->cost, &e->shape), 1e3 * fwd);
    if (rc == 0) /* the cost model learns from the call that ran (a refused one changes nothing) */
        m40_step_cost_observe(&e->cost, &e->shape, fwd);
    e->tstats.decode_step_estimate = m40_step_cost_decode(&e->cost, e->shape.n_dec, e->shape.dec_keys);
    if (rc != 0) {
        char msg[300];
        snprintf(msg, sizeof msg, "forward pass failed: %s", err);
        for (int32_t i = 0; i < e->max_seqs; i++)
            if (take[i] > 0) {
                m40_push_error(e, e->slots[i].r, 500, msg);
                m40_slot_finish(e, i);
            }
        m40_step_flush(e);
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
            m40_push_error(e, s->r, 500, "out of memory");
            m40_slot_finish(e, i);
            take[i] = 0;
            continue;
        }
        s->n_past += take[i];
    }
    t0 = m40_now();
    int32_t n_live = 0;
    for (int32_t k = 0; k < rows; k++)
        n_live += e->slots[e->row_slot[k]].r && take[e->row_slot[k]] > 0;
    if (!picked && n_live >= PICK_MIN_ROWS && pick_pool_ready(e)) {
        /* every row's pick on the helper threads (distinct slots: nothing shared), then
         * the commits in row order on this thread, as the serial loop below does them */
        int32_t n = 0;
        for (int32_t k = 0; k < rows; k++)
            if (e->slots[e->row_slot[k]].r && take[e->row_slot[k]] > 0)
                e->pick_rows[n++] = k;
        double tp = m40_now();
        m40_threadpool_run(e->pick_pool, n, pick_task, e);
        e->tstats.pick_seconds += m40_now() - tp;
        for (int32_t j = 0; j < n; j++)
            m40_sequence_commit(e, e->row_slot[e->pick_rows[j]], e->pick_rc[j], &e->pick_res[j]);
    } else {
        for (int32_t k = 0; k < rows; k++)
            if (e->slots[e->row_slot[k]].r && take[e->row_slot[k]] > 0)
                m40_sequence_advance(e, e->row_slot[k], picked ? NULL : e->step_logits + (size_t)k * (size_t)e->n_vocab,
                                     picked ? e->picks[k] : -1);
    }
    m40_step_flush(e);
    e->tstats.sample_seconds += m40_now() - t0;
}
