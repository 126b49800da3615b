/* The engine thread and scheduler (engine.c, scheduler.c) on the CPU with the tiny
 * stories260K model: results equal a plain greedy loop over m40_model_forward,
 * batching and chunked prefill do not change them, and cancellation, queue limits,
 * stop strings, length limits, load failures and shutdown behave as m40_engine.h says. */
#include <poll.h>
#include <stdint.h>
#include <time.h>
#include <unistd.h>

#include "check.h"
#include "engine_jobs.h"
#include "m40_engine.h"
#include "model/model.h"
#include "tokenizer/tokenizer.h"


/* ---------- reference: a plain greedy loop ---------- */

static m40_model *ref_model;

static int32_t argmax(const float *x, int32_t n)
{
    int32_t best = 0;
    for (int32_t i = 1; i < n; i++)
        if (x[i] > x[best])
            best = i;
    return best;
}

/* Greedy text for a prompt (tokenized like the engine does for completions, or with
 * parse_special for rendered chat text); stops at an end-of-generation token or after
 * max_tokens. Returns a malloc'd string, n_tokens the generated count (EOG included). */
static size_t ref_bounds[1024]; /* byte offset of the end of each token's text (last greedy call) */

static char *greedy(const char *prompt, int parse_special, int max_tokens, int *n_tokens, int *hit_eog)
{
    const m40_tokenizer *tok = m40_model_tokenizer(ref_model);
    const m40_model_params *mp = m40_model_get_params(ref_model);
    int32_t ids[1024];
    char err[256];
    int64_t n = m40_tokenize(tok, prompt, strlen(prompt), m40_tokenizer_add_bos(tok), parse_special, ids, 1024, err,
                             sizeof err);
    if (n <= 0 || n > 1024)
        return NULL;
    m40_kv *kv = m40_kv_new(ref_model, 1, 512);
    float *logits = malloc((size_t)mp->n_vocab * sizeof *logits);
    m40_detok *d = m40_detok_new(tok);
    size_t cap = 4096, len = 0;
    char *out = malloc(cap);
    if (!kv || !logits || !d || !out)
        return NULL;
    int32_t pos[1024], slot[1024];
    for (int64_t i = 0; i < n; i++) {
        pos[i] = (int32_t)i;
        slot[i] = 0;
    }
    m40_batch b = {.n = (int32_t)n, .tokens = ids, .pos = pos, .slot = slot, .want_logits = NULL};
    *hit_eog = 0;
    *n_tokens = 0;
    int32_t p = (int32_t)n;
    int32_t one_tok, one_pos, one_slot = 0;
    while (m40_model_forward(ref_model, kv, &b, logits, err, sizeof err) == 0) {
        int32_t t = argmax(logits, mp->n_vocab);
        (*n_tokens)++;
        if (m40_tokenizer_is_eog(tok, t)) {
            *hit_eog = 1;
            break;
        }
        size_t k;
        const char *s = m40_detok_push(d, t, &k);
        if (len + k + 1 < cap) {
            memcpy(out + len, s, k);
            len += k;
        }
        ref_bounds[*n_tokens - 1] = len;
        if (*n_tokens >= max_tokens || p >= 512)
            break;
        one_tok = t;
        one_pos = p++;
        b = (m40_batch){.n = 1, .tokens = &one_tok, .pos = &one_pos, .slot = &one_slot, .want_logits = NULL};
    }
    size_t k;
    const char *s = m40_detok_flush(d, &k);
    if (len + k + 1 < cap) {
        memcpy(out + len, s, k);
        len += k;
    }
    out[len] = '\0';
    m40_detok_free(d);
    free(logits);
    m40_kv_free(kv);
    return out;
}

/* Requests are driven through the event fd and the ready list: engine_jobs.h. */

static int32_t g_eos;

static void params_completion(m40_request_params *p, const char *prompt, int max_tokens)
{
    memset(p, 0, sizeof *p);
    p->prompt = prompt;
    p->prompt_len = strlen(prompt);
    p->max_tokens = max_tokens;
    m40_sampler_params_default(&p->sampling);
    p->sampling.temperature = 0.0f;
}

/* Bans the end-of-sequence token so that a request surely runs to max_tokens. */
static int32_t ban_ids[1];
static float ban_vals[1] = {-1000.0f};
static void params_ban_eos(m40_request_params *p)
{
    ban_ids[0] = g_eos;
    p->sampling.n_logit_bias = 1;
    p->sampling.logit_bias_ids = ban_ids;
    p->sampling.logit_bias_values = ban_vals;
}

static int submit(m40_engine *e, const m40_request_params *p, job *j)
{
    char err[256];
    memset(j, 0, sizeof *j);
    int st = m40_engine_submit(e, p, j, &j->req, err, sizeof err);
    if (st != M40_SUBMIT_OK)
        fprintf(stderr, "submit: %d %s\n", st, err);
    return st;
}

static int wait_ready(m40_engine *e, double timeout)
{
    double end = now_s() + timeout;
    char err[512];
    m40_engine_state st;
    while ((st = m40_engine_get_state(e, err, sizeof err)) == M40_ENGINE_LOADING && now_s() < end) {
        struct pollfd pfd = {.fd = m40_engine_event_fd(e), .events = POLLIN};
        poll(&pfd, 1, 20);
    }
    return st;
}

static int wait_stats(m40_engine *e, int running, int64_t kv_used, double timeout, m40_engine_stats *st)
{
    double end = now_s() + timeout;
    do {
        m40_engine_get_stats(e, st);
        if (st->running == running && st->kv_tokens_used == kv_used && st->queue_depth == 0)
            return 0;
        usleep(2000);
    } while (now_s() < end);
    return -1;
}

static m40_engine *start(const char *path, int ctx, int max_seqs, int max_queue, int prefill_chunk, const char *tmpl)
{
    m40_engine_config cfg = {.model_path = path,
                             .model_name = "stories",
                             .device = -1,
                             .ctx_size = ctx,
                             .max_seqs = max_seqs,
                             .max_queue = max_queue,
                             .n_threads = 2,
                             .chat_template = tmpl,
                             .prefill_chunk = prefill_chunk};
    m40_engine *e = NULL;
    char err[256];
    if (m40_engine_create(&cfg, &e, err, sizeof err) != 0) {
        fprintf(stderr, "create: %s\n", err);
        return NULL;
    }
    return e;
}

static const char *prompts[6] = {
    "Once upon a time",
    "The little dog",
    "Lily and Tom went to the park. They saw a big",
    "One day",
    "She was happy because",
    "A bird sat on a tree and sang a song to the sun",
};

int main(void)
{
    char path[4096], err[512];
    if (!check_shared_file("models/stories260K.gguf", path, sizeof path)) {
        SKIP("../shared/models/stories260K.gguf is absent");
        return check_done();
    }
    if (m40_model_load(path, 2, &ref_model, err, sizeof err) != 0) {
        CHECK(0, "reference load: %s", err);
        return check_done();
    }
    const m40_tokenizer *tok = m40_model_tokenizer(ref_model);
    g_eos = m40_tokenizer_eos(tok);

    /* prefill_chunk 3: prompts go through in several chunks, mixed with decoding.
     * ctx 512 (the file says 128): room for long requests, and the override is used. */
    /* this engine also writes the step trace (M40_STEP_TRACE, read when it loads) */
    char trace[] = "/tmp/m40-test-trace-XXXXXX";
    const int trace_fd = mkstemp(trace);
    CHECK(trace_fd >= 0, "mkstemp");
    if (trace_fd >= 0) {
        close(trace_fd);
        setenv("M40_STEP_TRACE", trace, 1);
    }
    m40_engine *e = start(path, 512, 4, 8, 3, NULL);
    CHECK(e != NULL, "engine create");
    if (!e)
        return check_done();
    CHECK(wait_ready(e, 30) == M40_ENGINE_READY, "engine not READY");
    unsetenv("M40_STEP_TRACE");
    CHECK(m40_engine_ctx_size(e) == 512, "ctx %d", (int)m40_engine_ctx_size(e));
    CHECK(m40_engine_n_vocab(e) == 512, "n_vocab %d", (int)m40_engine_n_vocab(e));
    CHECK(strcmp(m40_engine_model_name(e), "stories") == 0, "model name");

    /* (1) One request at temperature 0 equals the plain greedy loop. */
    int ref_n, ref_eog;
    char *ref0 = greedy(prompts[0], 0, 40, &ref_n, &ref_eog);
    size_t ref0_bounds[1024];
    memcpy(ref0_bounds, ref_bounds, sizeof ref_bounds);
    CHECK(ref0 != NULL && ref0[0], "greedy reference");
    {
        m40_request_params p;
        params_completion(&p, prompts[0], 40);
        p.logprobs = 1;
        p.sampling.n_top_logprobs = 3;
        job j, *js[1] = {&j};
        CHECK(submit(e, &p, &j) == M40_SUBMIT_OK, "submit");
        CHECK(pump(e, js, 1, 20) == 0, "request did not finish");
        CHECK(ref0 && strcmp(j.text, ref0) == 0, "engine text\n  [%s]\n differs from greedy\n  [%s]", j.text,
              ref0 ? ref0 : "");
        CHECK(j.finish == (ref_eog ? M40_FINISH_STOP : M40_FINISH_LENGTH), "finish %d", j.finish);
        CHECK(j.completion_tokens == ref_n, "completion_tokens %d vs %d", j.completion_tokens, ref_n);
        int32_t ids[64];
        int64_t np = m40_tokenize(tok, prompts[0], strlen(prompts[0]), m40_tokenizer_add_bos(tok), 0, ids, 64, err,
                                  sizeof err);
        CHECK(j.prompt_tokens == np, "prompt_tokens %d vs %lld", j.prompt_tokens, (long long)np);
        CHECK(j.cached_tokens == 0, "cached_tokens %d without a prefix cache", j.cached_tokens);
        CHECK(j.n_logprob_tokens == ref_n - ref_eog, "logprob tokens %d for %d text tokens", j.n_logprob_tokens,
              ref_n - ref_eog);
        m40_request_release(j.req);
        m40_engine_stats st;
        CHECK(wait_stats(e, 0, 0, 5, &st) == 0, "stats after one request: running %d kv %lld", st.running,
              (long long)st.kv_tokens_used);
        CHECK(st.requests_total == 1 && st.completion_tokens_total == (uint64_t)ref_n, "totals %llu %llu",
              (unsigned long long)st.requests_total, (unsigned long long)st.completion_tokens_total);
        CHECK(st.prompt_tokens_computed == (uint64_t)np, "prompt tokens computed %llu",
              (unsigned long long)st.prompt_tokens_computed);
        /* The CPU engine has no prefix cache: every prompt token is computed. */
        CHECK(st.prefix_cache_hit_tokens == 0 && st.prefix_cache_queries == 0 && st.prefix_cache_query_tokens == 0,
              "cpu prefix cache counters %llu %llu", (unsigned long long)st.prefix_cache_queries,
              (unsigned long long)st.prefix_cache_hit_tokens);
        CHECK(st.ttft_counts[M40_HIST_BUCKETS - 1] == 1, "one TTFT sample");
        CHECK(st.itl_counts[M40_HIST_BUCKETS - 1] == (uint64_t)ref_n - 1, "ITL samples %llu",
              (unsigned long long)st.itl_counts[M40_HIST_BUCKETS - 1]);
        CHECK(st.kv_tokens_total == 4 * 512, "kv total %lld", (long long)st.kv_tokens_total);

        /* The step trace: a header, then a line a step whose prompt tokens add up to the
         * prompt (chunks of 3) and whose decode rows give every token after the first */
        FILE *tf = trace_fd >= 0 ? fopen(trace, "r") : NULL;
        CHECK(tf != NULL, "step trace %s", trace);
        if (tf) {
            char line[512];
            int lines = 0, bad = 0, prompt = 0, decode = 0, chunks = 0;
            CHECK(fgets(line, sizeof line, tf) && strncmp(line, "t_s,decode_rows,", 16) == 0, "trace header");
            while (fgets(line, sizeof line, tf)) {
                double t, dk, pk, pred, fwd;
                int dr, pt, nc, g, l, pr;
                if (sscanf(line, "%lf,%d,%lf,%d,%d,%lf,%d,%d,%d,%lf,%lf", &t, &dr, &dk, &pt, &nc, &pk, &g, &l, &pr,
                           &pred, &fwd) != 11 || !(fwd > 0.0) || pt > 3 || dr > 1)
                    bad++;
                else
                    prompt += pt, decode += dr, chunks += nc;
                lines++;
            }
            fclose(tf);
            CHECK(bad == 0 && prompt == np && decode == ref_n - 1 && chunks == (int)((np + 2) / 3),
                  "trace: %d lines (%d bad), %d prompt tokens in %d chunks, %d decode rows", lines, bad, prompt,
                  chunks, decode);
        }
        unlink(trace);
    }

    /* (2) Six concurrent requests over four slots: each equals its solo greedy result. */
    {
        job jobs[6], *js[6];
        char *refs[6];
        for (int i = 0; i < 6; i++) {
            int n, eog;
            refs[i] = greedy(prompts[i], 0, 24, &n, &eog);
            m40_request_params p;
            params_completion(&p, prompts[i], 24);
            js[i] = &jobs[i];
            CHECK(submit(e, &p, &jobs[i]) == M40_SUBMIT_OK, "submit %d", i);
        }
        CHECK(pump(e, js, 6, 30) == 0, "concurrent requests did not finish");
        for (int i = 0; i < 6; i++) {
            CHECK(refs[i] && strcmp(jobs[i].text, refs[i]) == 0, "request %d batched\n  [%s]\n solo\n  [%s]", i,
                  jobs[i].text, refs[i] ? refs[i] : "");
            CHECK(jobs[i].n_text_events > 1, "request %d streamed in %d events", i, jobs[i].n_text_events);
            m40_request_release(jobs[i].req);
            free(refs[i]);
        }
    }

    /* (3) Release mid-stream frees the slot; the engine goes on. */
    {
        m40_request_params p;
        params_completion(&p, prompts[1], 400);
        params_ban_eos(&p);
        job j, *js[1] = {&j};
        m40_engine_stats st0, st;
        m40_engine_get_stats(e, &st0);
        CHECK(submit(e, &p, &j) == M40_SUBMIT_OK, "submit");
        double end = now_s() + 10;
        while (j.n_text_events == 0 && !j.done && now_s() < end) {
            pump(e, js, 1, 0.02);
        }
        CHECK(j.n_text_events > 0 && !j.done, "streaming before release (done %d)", j.done);
        m40_request_release(j.req);
        CHECK(wait_stats(e, 0, 0, 5, &st) == 0, "after release: running %d kv %lld", st.running,
              (long long)st.kv_tokens_used);
        CHECK(st.requests_cancelled == st0.requests_cancelled + 1, "cancelled %llu",
              (unsigned long long)st.requests_cancelled);
        job k, *ks[1] = {&k};
        params_completion(&p, prompts[0], 40);
        CHECK(submit(e, &p, &k) == M40_SUBMIT_OK, "submit after release");
        CHECK(pump(e, ks, 1, 20) == 0 && ref0 && strcmp(k.text, ref0) == 0, "request after release: [%s]", k.text);
        m40_request_release(k.req);
    }

    /* (4) Queue full: 4 slots busy, 8 waiting, the next one is refused. */
    {
        m40_request_params p;
        params_completion(&p, prompts[2], 450);
        params_ban_eos(&p);
        job jobs[13];
        m40_engine_stats st;
        for (int i = 0; i < 4; i++)
            CHECK(submit(e, &p, &jobs[i]) == M40_SUBMIT_OK, "submit %d", i);
        double end = now_s() + 10;
        do
            m40_engine_get_stats(e, &st);
        while ((st.running < 4 || st.queue_depth > 0) && now_s() < end && usleep(1000) == 0);
        CHECK(st.running == 4, "running %d", st.running);
        for (int i = 4; i < 12; i++)
            CHECK(submit(e, &p, &jobs[i]) == M40_SUBMIT_OK, "queued submit %d", i);
        memset(&jobs[12], 0, sizeof jobs[12]);
        int st12 = m40_engine_submit(e, &p, &jobs[12], &jobs[12].req, err, sizeof err);
        CHECK(st12 == M40_SUBMIT_QUEUE_FULL && jobs[12].req == NULL, "13th submit: %d", st12);
        m40_engine_get_stats(e, &st);
        CHECK(st.requests_rejected == 1 && st.queue_depth == 8, "rejected %llu queue %d",
              (unsigned long long)st.requests_rejected, st.queue_depth);
        /* Releasing queued and running requests alike returns everything. */
        for (int i = 0; i < 12; i++)
            m40_request_release(jobs[i].req);
        CHECK(wait_stats(e, 0, 0, 5, &st) == 0, "after releasing all: running %d kv %lld queue %d", st.running,
              (long long)st.kv_tokens_used, st.queue_depth);
    }

    /* (5) A prompt that leaves no room: 400 naming both numbers. */
    {
        static char big[8192];
        big[0] = '\0';
        for (int i = 0; i < 300; i++)
            strcat(big, "cat dog ");
        int32_t *ids = malloc(4096 * sizeof *ids);
        int64_t n = ids ? m40_tokenize(tok, big, strlen(big), m40_tokenizer_add_bos(tok), 0, ids, 4096, err, sizeof err)
                        : -1;
        free(ids);
        CHECK(n > 512, "long prompt has %lld tokens", (long long)n);
        m40_request_params p;
        params_completion(&p, big, 10);
        job j, *js[1] = {&j};
        CHECK(submit(e, &p, &j) == M40_SUBMIT_OK, "submit");
        CHECK(pump(e, js, 1, 10) == 0, "no answer");
        char want[128];
        snprintf(want, sizeof want, "prompt has %lld tokens but the context size is 512", (long long)n);
        CHECK(j.err_status == 400 && strstr(j.err_msg, want), "error %d [%s]", j.err_status, j.err_msg);
        m40_request_release(j.req);
    }

    /* (6) Stop string taken from the known greedy output, straddling a token boundary
     * (so that it is only seen by holding text back): the text ends right before its
     * first occurrence, finish STOP, the stop string never shows. */
    size_t L = ref0 ? strlen(ref0) : 0;
    int cut_tok = -1;
    for (int t = ref_n / 2; t < ref_n - 1 && cut_tok < 0; t++)
        if (ref0_bounds[t] >= 2 && ref0_bounds[t] + 2 <= L && ref0_bounds[t] > ref0_bounds[t - 1] &&
            ref0_bounds[t + 1] > ref0_bounds[t])
            cut_tok = t;
    if (cut_tok >= 0) {
        char stop[5];
        memcpy(stop, ref0 + ref0_bounds[cut_tok] - 2, 4);
        stop[4] = '\0';
        size_t first = (size_t)(strstr(ref0, stop) - ref0);
        m40_request_params p;
        params_completion(&p, prompts[0], 40);
        const char *stops[2] = {"#never#", stop};
        p.stop = stops;
        p.n_stop = 2;
        job j, *js[1] = {&j};
        CHECK(submit(e, &p, &j) == M40_SUBMIT_OK, "submit");
        CHECK(pump(e, js, 1, 20) == 0, "no answer");
        CHECK(j.finish == M40_FINISH_STOP, "finish %d", j.finish);
        CHECK(j.len == first && strncmp(j.text, ref0, first) == 0, "stop [%s]: got [%s], want the first %zu bytes of [%s]",
              stop, j.text, first, ref0);
        CHECK(strstr(j.text, stop) == NULL, "stop string in the output");
        m40_request_release(j.req);

        /* Stop strings whose beginnings occur but never the whole (one mid-text, one
         * at the very end): held text is released, at the latest when the stream
         * ends, and nothing is lost. */
        char near[8], tail[8];
        memcpy(near, ref0 + ref0_bounds[cut_tok] - 2, 4);
        memcpy(near + 4, "\x7f\x7f", 3);
        memcpy(tail, ref0 + L - 2, 2);
        memcpy(tail + 2, "\x7f\x7f", 3);
        const char *stops2[2] = {near, tail};
        p.stop = stops2;
        p.n_stop = 2;
        CHECK(submit(e, &p, &j) == M40_SUBMIT_OK, "submit");
        CHECK(pump(e, js, 1, 20) == 0, "no answer");
        CHECK(strcmp(j.text, ref0) == 0 && j.finish != M40_FINISH_STOP, "near-miss stop: got [%s] finish %d", j.text,
              j.finish);
        m40_request_release(j.req);
    } else {
        CHECK(0, "greedy reference has no token boundary to put a stop string on");
    }

    /* (7) max_tokens -> LENGTH with exactly that many tokens. */
    {
        m40_request_params p;
        params_completion(&p, prompts[3], 7);
        params_ban_eos(&p);
        job j, *js[1] = {&j};
        CHECK(submit(e, &p, &j) == M40_SUBMIT_OK, "submit");
        CHECK(pump(e, js, 1, 10) == 0, "no answer");
        CHECK(j.finish == M40_FINISH_LENGTH && j.completion_tokens == 7, "finish %d, %d tokens", j.finish,
              j.completion_tokens);
        m40_request_release(j.req);
    }

    /* (8) ignore_eos: with end-of-sequence forced by a logit bias, a request stops at
     * once; with ignore_eos it runs to max_tokens (the control token renders as nothing). */
    for (int ignore = 0; ignore < 2; ignore++) {
        static int32_t force_ids[1];
        static float force_vals[1] = {100.0f};
        force_ids[0] = g_eos;
        m40_request_params p;
        params_completion(&p, prompts[1], 6);
        p.sampling.n_logit_bias = 1;
        p.sampling.logit_bias_ids = force_ids;
        p.sampling.logit_bias_values = force_vals;
        p.ignore_eos = ignore;
        job j, *js[1] = {&j};
        CHECK(submit(e, &p, &j) == M40_SUBMIT_OK, "submit");
        CHECK(pump(e, js, 1, 10) == 0, "no answer");
        if (ignore)
            CHECK(j.finish == M40_FINISH_LENGTH && j.completion_tokens == 6 && j.len == 0,
                  "ignore_eos: finish %d, %d tokens, %zu bytes", j.finish, j.completion_tokens, j.len);
        else
            CHECK(j.finish == M40_FINISH_STOP && j.completion_tokens == 1 && j.len == 0,
                  "forced eos: finish %d, %d tokens, %zu bytes", j.finish, j.completion_tokens, j.len);
        m40_request_release(j.req);
    }

    /* Invalid parameters are refused at submit. */
    {
        m40_request_params p;
        params_completion(&p, prompts[0], 0);
        m40_request *r = NULL;
        CHECK(m40_engine_submit(e, &p, NULL, &r, err, sizeof err) == M40_SUBMIT_INVALID && r == NULL, "max_tokens 0");
        params_completion(&p, prompts[0], 5);
        int32_t bad_id = 100000;
        p.sampling.n_logit_bias = 1;
        p.sampling.logit_bias_ids = &bad_id;
        p.sampling.logit_bias_values = ban_vals;
        CHECK(m40_engine_submit(e, &p, NULL, &r, err, sizeof err) == M40_SUBMIT_INVALID && strstr(err, "100000"),
              "logit bias id out of range: %s", err);
    }

    /* Chat without a template in the GGUF: the fallback ChatML rendering. */
    {
        const char *rendered = "<|im_start|>user\nTell me a story<|im_end|>\n<|im_start|>assistant\n";
        int n, eog;
        char *want = greedy(rendered, 1, 30, &n, &eog);
        char *cut = want ? strstr(want, "<|im_end|>") : NULL; /* the fallback's end marker stops */
        if (cut)
            *cut = '\0';
        json_t *msgs = json_pack("[{s:s, s:s}]", "role", "user", "content", "Tell me a story");
        m40_request_params p;
        memset(&p, 0, sizeof p);
        p.messages = msgs;
        p.add_generation_prompt = 1;
        p.max_tokens = 30;
        m40_sampler_params_default(&p.sampling);
        p.sampling.temperature = 0;
        job j, *js[1] = {&j};
        CHECK(submit(e, &p, &j) == M40_SUBMIT_OK, "chat submit");
        json_decref(msgs); /* the engine keeps its own */
        CHECK(pump(e, js, 1, 20) == 0, "chat did not finish");
        CHECK(want && strcmp(j.text, want) == 0, "chat [%s] vs greedy over the fallback rendering [%s]", j.text,
              want ? want : "");
        int32_t ids[128];
        int64_t np = m40_tokenize(tok, rendered, strlen(rendered), m40_tokenizer_add_bos(tok), 1, ids, 128, err,
                                  sizeof err);
        CHECK(j.prompt_tokens == np, "chat prompt tokens %d vs %lld", j.prompt_tokens, (long long)np);
        m40_request_release(j.req);
        free(want);
    }

    /* (9) Destroy with requests running and queued: no hang; held requests get their
     * final event and can still be polled and released afterwards. */
    {
        m40_request_params p;
        params_completion(&p, prompts[4], 450);
        params_ban_eos(&p);
        job jobs[6], *js[1] = {&jobs[0]};
        for (int i = 0; i < 6; i++)
            CHECK(submit(e, &p, &jobs[i]) == M40_SUBMIT_OK, "submit %d", i);
        double end = now_s() + 10;
        while (jobs[0].n_text_events == 0 && now_s() < end)
            pump(e, js, 1, 0.02);
        double t0 = now_s();
        m40_engine_destroy(e);
        CHECK(now_s() - t0 < 5, "destroy took %.1f s", now_s() - t0);
        int cancelled = 0, stopping = 0;
        for (int i = 0; i < 6; i++) {
            job_take(&jobs[i]);
            cancelled += jobs[i].done && jobs[i].finish == M40_FINISH_CANCELLED;
            stopping += jobs[i].done && jobs[i].err_status == 503;
            m40_request_release(jobs[i].req);
        }
        CHECK(cancelled == 4 && stopping == 2, "after destroy: %d cancelled, %d refused with 503", cancelled, stopping);
    }

    /* A chat template given in the configuration overrides the (absent) GGUF one. */
    {
        const char *tmpl = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
                           "{% if add_generation_prompt %}assistant:{% endif %}";
        m40_engine *e2 = start(path, 0, 1, 4, 0, tmpl);
        CHECK(e2 && wait_ready(e2, 30) == M40_ENGINE_READY, "override engine READY");
        if (e2) {
            CHECK(m40_engine_ctx_size(e2) == m40_model_get_params(ref_model)->ctx_train, "ctx 0 -> the model's: %d",
                  (int)m40_engine_ctx_size(e2));
            int n, eog;
            char *want = greedy("user: Hi there\nassistant:", 1, 20, &n, &eog);
            json_t *msgs = json_pack("[{s:s, s:s}]", "role", "user", "content", "Hi there");
            m40_request_params p;
            memset(&p, 0, sizeof p);
            p.messages = msgs;
            p.add_generation_prompt = 1;
            p.max_tokens = 20;
            m40_sampler_params_default(&p.sampling);
            p.sampling.temperature = 0;
            job j, *js[1] = {&j};
            CHECK(submit(e2, &p, &j) == M40_SUBMIT_OK, "submit");
            json_decref(msgs);
            CHECK(pump(e2, js, 1, 20) == 0, "no answer");
            CHECK(want && strcmp(j.text, want) == 0, "template chat [%s] vs [%s]", j.text, want ? want : "");
            m40_request_release(j.req);
            free(want);
            m40_engine_destroy(e2);
        }
        /* A template that does not parse fails the load with the parser's message. */
        e2 = start(path, 0, 1, 4, 0, "{% for m in messages %}");
        CHECK(e2 && wait_ready(e2, 30) == M40_ENGINE_FAILED, "broken template must fail the load");
        if (e2) {
            m40_engine_get_state(e2, err, sizeof err);
            CHECK(strstr(err, "chat template") != NULL, "message [%s]", err);
            m40_engine_destroy(e2);
        }
    }

    /* (8) A bad model path: FAILED with a message naming it, submit -> NOT_READY. */
    {
        m40_engine *bad = start("/nonexistent/model.gguf", 0, 2, 4, 0, NULL);
        CHECK(bad != NULL, "create with a bad path still starts");
        if (bad) {
            CHECK(wait_ready(bad, 10) == M40_ENGINE_FAILED, "bad path not FAILED");
            m40_engine_get_state(bad, err, sizeof err);
            CHECK(strstr(err, "/nonexistent/model.gguf") != NULL, "message [%s]", err);
            m40_request_params p;
            params_completion(&p, "x", 5);
            m40_request *r = NULL;
            CHECK(m40_engine_submit(bad, &p, NULL, &r, err, sizeof err) == M40_SUBMIT_NOT_READY && r == NULL,
                  "submit on a failed engine");
            m40_engine_destroy(bad);
        }
    }

    /* (9) A step trace that cannot be opened (M40_STEP_TRACE in a missing folder): the
     * engine says so in the log and serves as without it. */
    {
        setenv("M40_STEP_TRACE", "/nonexistent-m40-dir/steps.csv", 1);
        m40_engine *t = start(path, 0, 1, 4, 0, NULL);
        CHECK(t != NULL && wait_ready(t, 30) == M40_ENGINE_READY, "an unopenable step trace must not fail the load");
        unsetenv("M40_STEP_TRACE");
        if (t) {
            m40_request_params p;
            params_completion(&p, prompts[0], 8);
            job j, *js[1] = {&j};
            CHECK(submit(t, &p, &j) == M40_SUBMIT_OK && pump(t, js, 1, 20) == 0 && j.completion_tokens > 0,
                  "a request without the trace");
            m40_request_release(j.req);
            m40_engine_destroy(t);
        }
    }

    free(ref0);
    m40_model_free(ref_model);
    return check_done();
}
