/* The engine thread's life: load the model and size the KV cache and the slots, warm
 * the GPU up, run one step after another while there is work (sleeping otherwise),
 * publish the statistics after each, and on stop answer everything still waiting and
 * unload. */
#include "engine_impl.h"
#include "kv/kv_blocks.h" /* M40_KV_BLOCK_SIZE_DEFAULT: the GPU pool's block size */
#include "util/tuning.h"

#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
#include <string.h>
#include <time.h>

/* ---------- the loop's helpers ---------- */

static int32_t n_active(const m40_engine *e)
{
    int32_t n = 0;
    for (int32_t i = 0; i < e->max_seqs; i++)
        n += e->slots[i].r != NULL;
    return n;
}

void m40_stats_publish(m40_engine *e)
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
    o->grammar_wait_seconds = t->grammar_wait_seconds;
    o->pick_seconds = t->pick_seconds;
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
    if (gpu && ((e->kv_share > 0.0f && e->kv_share < 1.0f) || e->kv_keep_bytes > 0)) {
        /* Several models on one card: the pool just made shows the room (the pool
         * sizes itself from the card's free memory, which only allocating tells);
         * this model's share of it, less what later models' weights need, is a cap
         * on the tokens, and the pool is made again under it. */
        m40_kv_pool_info pi;
        m40_kv_get_pool_info(e->kv, &pi);
        const int32_t nb = m40_kv_pool_blocks(e->kv);
        const double block_bytes = nb > 0 ? pi.pool / (double)nb : 0.0;
        const double room = (double)pi.fraction * pi.total - pi.in_use - pi.reserve;
        const double share = e->kv_share > 0.0f ? (double)e->kv_share : 1.0;
        const double want = share * (room - (double)e->kv_keep_bytes);
        const int64_t want_blocks = block_bytes > 0.0 && want > 0.0 ? (int64_t)(want / block_bytes) : 0;
        if (want_blocks < 1) {
            snprintf(err, errlen,
                     "no room for this model's KV share: %.2f of %.2f GiB less %.2f GiB kept for the models "
                     "loaded after it on the card",
                     share, room / 1073741824.0, (double)e->kv_keep_bytes / 1073741824.0);
            m40_kv_free(e->kv);
            e->kv = NULL;
            return -1;
        }
        if (want_blocks < nb) {
            m40_kv_free(e->kv);
            ko.max_tokens = want_blocks * bs;
            e->kv = m40_kv_new_opts(e->model, slots, ctx, &ko, kerr, sizeof kerr);
            if (!e->kv) {
                snprintf(err, errlen, "cannot allocate the KV cache share for %d sequences of %d tokens: %s",
                         (int)slots, (int)ctx, kerr);
                return -1;
            }
        }
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
    m40_tuning tu;
    m40_tuning_from_env(&tu);
    e->gpu_sample = tu.gpu_sample;
    if (tu.pick_threads >= 0) {
        e->pick_threads = tu.pick_threads;
    } else if (e->device >= 0) {
        long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
        e->pick_threads = ncpu >= 4 ? (int)(ncpu / 2 < 8 ? ncpu / 2 : 8) : 2;
    } else {
        e->pick_threads = 0;
    }
    if (tu.load_delay_ms > 0) { /* M40_TEST_LOAD_DELAY_MS: a slow load, for tests */
        struct timespec ts = {tu.load_delay_ms / 1000, (long)(tu.load_delay_ms % 1000) * 1000000L};
        nanosleep(&ts, NULL);
    }
    m40_model_options mo = {.n_threads = e->n_threads, .device = e->device < 0 ? -1 : e->device, .log_progress = 1,
                            .ctx_size = e->ctx_cfg > 0 ? e->ctx_cfg : 0, .cpu_fast = e->cpu_fast,
                            .tp = e->device >= 0 ? e->tp : 1, .batch_invariant = e->batch_invariant};
    if (m40_model_load_opts(e->model_path, &mo, &e->model, merr, sizeof merr) != 0) {
        snprintf(err, errlen, "%s: %s", e->model_path, merr);
        return -1;
    }
    /* What the model loaded with: the directive, or M40_BATCH_INVARIANT=1, which the
     * scheduler's chunk rules (scheduler.c invariant_chunks, first_chunk) must follow too */
    e->batch_invariant = m40_model_tuning(e->model)->batch_invariant;
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
        e->tmpl_src = src;
        if (m40_jinja_parse(src, strlen(src), &e->tmpl, jerr, sizeof jerr) != 0) {
            e->tmpl = NULL;
    e->tmpl_src = NULL;
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
    e->row_sample = malloc((size_t)e->max_seqs * sizeof *e->row_sample); /* NULL: draws stay on the host */
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
    if (m40_model_device(e->model) < 0 || !m40_model_tuning(e->model)->warmup) /* M40_WARMUP=0 */
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
            m40_slot_clear(&e->slots[i]);
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
    free(e->row_sample);
    e->row_sample = NULL;
    m40_pick_pool_free(e);
    free(e->ready_batch);
    free(e->done_batch);
    m40_jinja_free(e->tmpl);
    m40_token_trie_free(e->vocab_trie); /* the tokenizer thread, its builder, has stopped */
    e->vocab_trie = NULL;
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
            m40_push_done(e, &e->slots[i], M40_FINISH_CANCELLED);
            m40_slot_finish(e, i);
            cancelled++;
        }
    m40_step_flush(e);
    for (;;) {
        pthread_mutex_lock(&e->mu);
        m40_request *r = m40_queue_pop_locked(e);
        e->stats.queue_depth = m40_engine_waiting_locked(e);
        e->stats.requests_cancelled += (uint64_t)cancelled;
        cancelled = 0;
        pthread_mutex_unlock(&e->mu);
        if (!r)
            break;
        m40_admit_fail(e, r, 503, "the engine is stopping");
    }
    m40_stats_publish(e);
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
    /* A test seam for the prefill policy: every step's shape, the cost model's
     * prediction and the measured forward time, appended to the file as CSV */
    const char *trace = getenv("M40_STEP_TRACE");
    if (trace && trace[0]) {
        e->step_trace = fopen(trace, "a");
        if (e->step_trace) {
            setvbuf(e->step_trace, NULL, _IOLBF, 0); /* readable while the server runs */
            e->trace_t0 = m40_now();
            fprintf(e->step_trace, "t_s,decode_rows,decode_keys,prompt_tokens,chunks,prompt_keys,guarded,limited,"
                                   "probe,predicted_ms,forward_ms\n");
        } else
            fprintf(stderr, "m40: M40_STEP_TRACE: cannot open %s\n", trace);
    }
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
        m40_cancel_released(e);
        m40_admit_queued(e);
        m40_run_step(e);
        m40_stats_publish(e);
        if (e->stats_wake) {
            e->stats_wake = 0;
            m40_engine_wake(e);
        }
        e->tstats.schedule_seconds += m40_now() - t0 - (e->tstats.forward_seconds + e->tstats.sample_seconds - busy0);
    }
    /* The tokenizer thread first: it answers what waits for it, and whatever it had
     * queued for admission before it saw the stop is answered by engine_shutdown. */
    m40_prompt_stop(e);
    engine_shutdown(e);
    engine_unload(e);
    if (e->step_trace)
        fclose(e->step_trace);
    e->step_trace = NULL;
    return NULL;
}
