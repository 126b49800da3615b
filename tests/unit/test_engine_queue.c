/* The engine's waiting room (engine.c, prompt.c, scheduler.c) on the CPU with the tiny
 * stories260K model: the defaults of max_queue and max_seqs, the capacity the engine
 * reports at load, the validation of gpu_memory_fraction, a burst far larger than the
 * slots plus the old 64-deep queue that waits and completes instead of being refused,
 * and the tokenizer thread: while it works on a prompt (held there by the test hook, so
 * that nothing depends on timing) running streams keep getting tokens, the request at
 * work and those behind it count against max_queue, releasing them there is safe, and
 * destroy waits for it and answers the request with 503. */
#include <pthread.h>
#include <stdint.h>
#include <unistd.h>

#include "check.h"
#include "serve/engine_impl.h" /* m40_engine_set_tokenize_hook: the test seam */
#include "engine_jobs.h"
#include "m40_engine.h"

static const char *prompts[6] = {
    "Once upon a time",
    "The little dog",
    "Lily and Tom went to the park. They saw a big",
    "One day",
    "She was happy because",
    "A bird sat on a tree and sang a song to the sun",
};

static m40_engine *start(const char *path, int ctx, int max_seqs, int max_queue, float mem_fraction, char *err,
                         size_t errlen)
{
    m40_engine_config cfg = {.model_path = path,
                             .model_name = "stories",
                             .device = -1,
                             .ctx_size = ctx,
                             .max_seqs = max_seqs,
                             .max_queue = max_queue,
                             .n_threads = 2,
                             .gpu_memory_fraction = mem_fraction};
    m40_engine *e = NULL;
    if (m40_engine_create(&cfg, &e, err, errlen) != 0)
        return NULL;
    return e;
}

static int wait_ready(m40_engine *e, double timeout)
{
    double end = now_s() + timeout;
    m40_engine_state st;
    while ((st = m40_engine_get_state(e, NULL, 0)) == M40_ENGINE_LOADING && now_s() < end)
        usleep(2000);
    return st;
}

static void params_completion(m40_request_params *p, const char *prompt, int max_tokens)
{
    memset(p, 0, sizeof *p);
    p->prompt = prompt;
    p->prompt_len = strlen(prompt);
    p->max_tokens = max_tokens;
    m40_sampler_params_default(&p->sampling);
    p->sampling.temperature = 0.0f;
}

/* Waits until the stats say `running` sequences run (and returns them in st). */
static int wait_running(m40_engine *e, int running, double timeout, m40_engine_stats *st)
{
    double end = now_s() + timeout;
    do {
        m40_engine_get_stats(e, st);
        if (st->running == running)
            return 0;
        usleep(1000);
    } while (now_s() < end);
    return -1;
}

/* The GPU's automatic max_seqs and its log line, from numbers alone (no GPU here). */
static void test_gpu_rule(void)
{
    /* a 7B Mistral in F16 on an 80 GB card: ~29,000 blocks of 2 MiB */
    CHECK(m40_auto_max_seqs(29030, 16, 32768) == 256, "%d", (int)m40_auto_max_seqs(29030, 16, 32768));
    /* 1,000 blocks: 15 sequences of 1,024 tokens (64 blocks each) */
    CHECK(m40_auto_max_seqs(1000, 16, 32768) == 15, "%d", (int)m40_auto_max_seqs(1000, 16, 32768));
    /* a short context counts whole: 100 tokens take 7 blocks */
    CHECK(m40_auto_max_seqs(100, 16, 100) == 14, "%d", (int)m40_auto_max_seqs(100, 16, 100));
    /* never below 1 nor above 256 */
    CHECK(m40_auto_max_seqs(10, 16, 4096) == 1 && m40_auto_max_seqs(0, 16, 4096) == 1, "small pools");
    CHECK(m40_auto_max_seqs(5000, 16, 256) == 256, "%d", (int)m40_auto_max_seqs(5000, 16, 256));

    m40_engine_capacity c;
    memset(&c, 0, sizeof c);
    c.device = 0;
    c.ctx = 2048;
    c.max_seqs = 256;
    c.max_seqs_auto = 1;
    c.max_queue = 1024;
    c.kv_blocks = 1000;
    c.kv_block_size = 16;
    c.kv_tokens = 16000;
    c.full_ctx_seqs = 7;
    c.gpu_memory_fraction = 0.9f;
    c.gpu_total = 80.0 * 1073741824.0;
    c.gpu_in_use = 16.0 * 1073741824.0;
    c.gpu_reserve = 0.5 * 1073741824.0;
    c.kv_bytes = 2.0 * 1073741824.0;
    c.prefill_budget = 2048;
    c.prefill_budget_auto = 1;
    c.prefill_chunk = 512;
    c.itl_guard = 2.0f;
    char line[512];
    m40_engine_capacity_line(&c, line, sizeof line);
    CHECK(strcmp(line, "KV cache: 16000 tokens (1000 blocks of 16, 2.0 GiB: 0.90 of gpu 0's 80.0 GiB less 16.0 GiB in "
                       "use and 0.5 GiB kept for activations); 7 sequences of 2048 tokens fit; max_seqs 256 (automatic: "
                       "the 1024-token sequences the KV cache holds, 1 to 256); max_queue 1024; prefill 2048 tokens a "
                       "step (automatic: the GPU's), 512 a sequence; ITL guard 2x") == 0,
          "gpu line [%s]", line);
    c.prefill_budget = 4096;
    c.prefill_budget_auto = 0;
    c.itl_guard = 0.0f;
    m40_engine_capacity_line(&c, line, sizeof line);
    CHECK(strstr(line, "; max_queue 1024; prefill 4096 tokens a step, 512 a sequence; ITL guard off") != NULL,
          "given budget, no guard [%s]", line);
}

/* Defaults and what the engine reports once loaded. */
static void test_defaults(const char *path)
{
    char err[512], line[512];
    CHECK(M40_DEFAULT_MAX_QUEUE >= 1024, "default max_queue %d", M40_DEFAULT_MAX_QUEUE);

    /* max_seqs 0 and max_queue 0: the defaults, and the engine says so */
    m40_engine *e = start(path, 256, 0, 0, 0.0f, err, sizeof err);
    CHECK(e != NULL, "create: %s", err);
    if (!e)
        return;
    CHECK(wait_ready(e, 30) == M40_ENGINE_READY, "not READY");
    m40_engine_capacity c;
    CHECK(m40_engine_get_capacity(e, &c) == 0, "capacity once READY");
    CHECK(c.device == -1 && c.ctx == 256, "device %d ctx %d", c.device, (int)c.ctx);
    CHECK(c.max_seqs == M40_CPU_MAX_SEQS && c.max_seqs_auto == 1, "cpu max_seqs %d auto %d", (int)c.max_seqs,
          c.max_seqs_auto);
    CHECK(c.max_queue == M40_DEFAULT_MAX_QUEUE, "max_queue %d", (int)c.max_queue);
    CHECK(c.kv_tokens == (int64_t)M40_CPU_MAX_SEQS * 256 && c.full_ctx_seqs == M40_CPU_MAX_SEQS && c.kv_blocks == 0,
          "kv tokens %lld, %lld full sequences, %d blocks", (long long)c.kv_tokens, (long long)c.full_ctx_seqs,
          (int)c.kv_blocks);
    m40_engine_capacity_line(&c, line, sizeof line);
    CHECK(strcmp(line, "KV cache: 1024 tokens (4 slots of 256 tokens in CPU memory); 4 sequences of 256 tokens fit; "
                       "max_seqs 4 (automatic: the CPU's); max_queue 1024; prefill 512 tokens a step (automatic: the "
                       "CPU's), 512 a sequence; ITL guard off") == 0,
          "capacity line [%s]", line);
    CHECK(c.prefill_budget == M40_DEFAULT_PREFILL_CHUNK && c.prefill_budget_auto && c.prefill_chunk == 512 &&
              c.itl_guard == M40_DEFAULT_ITL_GUARD,
          "cpu prefill: budget %d (auto %d), chunk %d, guard %g", (int)c.prefill_budget, c.prefill_budget_auto,
          (int)c.prefill_chunk, (double)c.itl_guard);
    m40_engine_stats st;
    m40_engine_get_stats(e, &st);
    CHECK(st.kv_tokens_total == c.kv_tokens, "stats kv total %lld", (long long)st.kv_tokens_total);
    m40_engine_destroy(e);

    /* given values are kept and not called automatic */
    e = start(path, 128, 3, 7, 0.5f, err, sizeof err);
    CHECK(e && wait_ready(e, 30) == M40_ENGINE_READY, "create: %s", err);
    if (e) {
        CHECK(m40_engine_get_capacity(e, &c) == 0 && c.max_seqs == 3 && !c.max_seqs_auto && c.max_queue == 7 &&
                  c.kv_tokens == 3 * 128,
              "max_seqs %d auto %d queue %d kv %lld", (int)c.max_seqs, c.max_seqs_auto, (int)c.max_queue,
              (long long)c.kv_tokens);
        m40_engine_capacity_line(&c, line, sizeof line);
        CHECK(strstr(line, "max_seqs 3; max_queue 7") != NULL, "line [%s]", line);
        m40_engine_destroy(e);
    }

    /* a fraction outside (0, 1] is refused at create, with the reason */
    const float bad[] = {-0.5f, 1.5f, 2.0f};
    for (int i = 0; i < 3; i++) {
        err[0] = '\0';
        e = start(path, 128, 1, 1, bad[i], err, sizeof err);
        CHECK(e == NULL && strstr(err, "gpu_memory_fraction"), "fraction %g: [%s]", (double)bad[i], err);
        if (e)
            m40_engine_destroy(e);
    }

    /* prefill settings: out-of-range ones refused with the reason; a chunk beyond the
     * budget is cut to it; a negative guard is off */
    {
        static const struct {
            int32_t chunk, budget;
            float guard;
            const char *why;
        } bad_prefill[] = {{-1, 0, 0.0f, "must not be negative"},
                           {0, -1, 0.0f, "must not be negative"},
                           {M40_MAX_PREFILL_TOKENS + 1, 0, 0.0f, "at most"},
                           {0, M40_MAX_PREFILL_TOKENS + 1, 0.0f, "at most"},
                           {0, 0, 0.5f, "itl_guard"},
                           {0, 0, 101.0f, "itl_guard"}};
        for (size_t i = 0; i < sizeof bad_prefill / sizeof bad_prefill[0]; i++) {
            m40_engine_config cfg = {.model_path = path, .device = -1, .ctx_size = 128, .n_threads = 1,
                                     .prefill_chunk = bad_prefill[i].chunk, .prefill_budget = bad_prefill[i].budget,
                                     .itl_guard = bad_prefill[i].guard};
            err[0] = '\0';
            e = NULL;
            CHECK(m40_engine_create(&cfg, &e, err, sizeof err) != 0 && e == NULL && strstr(err, bad_prefill[i].why),
                  "prefill case %zu: [%s]", i, err);
            if (e)
                m40_engine_destroy(e);
        }
        m40_engine_config cfg = {.model_path = path, .device = -1, .ctx_size = 128, .n_threads = 1,
                                 .prefill_chunk = 300, .prefill_budget = 100, .itl_guard = -1.0f};
        e = NULL;
        CHECK(m40_engine_create(&cfg, &e, err, sizeof err) == 0, "create: %s", err);
        if (e) {
            CHECK(wait_ready(e, 30) == M40_ENGINE_READY && m40_engine_get_capacity(e, &c) == 0 &&
                      c.prefill_budget == 100 && !c.prefill_budget_auto && c.prefill_chunk == 100 && c.itl_guard == 0.0f,
                  "budget %d chunk %d guard %g", (int)c.prefill_budget, (int)c.prefill_chunk, (double)c.itl_guard);
            m40_engine_destroy(e);
        }
    }

    /* nothing to report from an engine that failed to load */
    e = start("/nonexistent/model.gguf", 0, 0, 0, 0.0f, err, sizeof err);
    CHECK(e != NULL, "create with a bad path");
    if (e) {
        CHECK(wait_ready(e, 10) == M40_ENGINE_FAILED, "bad path not FAILED");
        CHECK(m40_engine_get_capacity(e, &c) == -1, "capacity of a failed engine");
        m40_engine_destroy(e);
    }
}

/* A burst far beyond max_seqs + 64 (the old queue) waits and completes: 2 slots held by
 * two long generations (they cannot finish on their own within this test: thousands
 * of tokens of context left), 200 requests submitted behind them all wait, none is
 * refused, and once the slots free up every one of them completes with the text the
 * same prompt gets alone. */
#define BURST 200
static void test_burst(const char *path)
{
    char err[512];
    m40_engine *e = start(path, 16384, 2, 0, 0.0f, err, sizeof err);
    CHECK(e != NULL, "create: %s", err);
    if (!e)
        return;
    CHECK(wait_ready(e, 30) == M40_ENGINE_READY, "not READY");

    /* the text each prompt gets alone */
    static job solo[6];
    for (int i = 0; i < 6; i++) {
        m40_request_params p;
        params_completion(&p, prompts[i], 6);
        job *js[1] = {&solo[i]};
        CHECK(m40_engine_submit(e, &p, &solo[i], &solo[i].req, err, sizeof err) == M40_SUBMIT_OK, "solo: %s", err);
        CHECK(pump(e, js, 1, 20) == 0 && solo[i].err_status == 0, "solo %d did not finish", i);
    }

    /* two generations that hold both slots (end of sequence does not end them, no token
     * limit reached before thousands of steps) */
    static job hold[2];
    for (int i = 0; i < 2; i++) {
        m40_request_params p;
        params_completion(&p, prompts[i], 16000);
        p.ignore_eos = 1;
        CHECK(m40_engine_submit(e, &p, &hold[i], &hold[i].req, err, sizeof err) == M40_SUBMIT_OK, "hold: %s", err);
    }
    m40_engine_stats st;
    CHECK(wait_running(e, 2, 10, &st) == 0, "holders running: %d", st.running);

    static job burst[BURST];
    int ok = 0;
    for (int i = 0; i < BURST; i++) {
        m40_request_params p;
        params_completion(&p, prompts[i % 6], 6);
        ok += m40_engine_submit(e, &p, &burst[i], &burst[i].req, err, sizeof err) == M40_SUBMIT_OK;
    }
    CHECK(ok == BURST, "%d of %d submits accepted (last: %s)", ok, BURST, err);
    m40_engine_get_stats(e, &st);
    pump_once(e);
    if (!hold[0].done && !hold[1].done)
        CHECK(st.queue_depth == BURST && st.running == 2, "queue depth %d, running %d", st.queue_depth, st.running);
    CHECK(st.requests_rejected == 0, "rejected %llu", (unsigned long long)st.requests_rejected);

    m40_request_release(hold[0].req);
    m40_request_release(hold[1].req);
    job *js[BURST];
    for (int i = 0; i < BURST; i++)
        js[i] = &burst[i];
    CHECK(pump(e, js, BURST, 120) == 0, "the burst did not complete");
    int same = 0, failed = 0;
    for (int i = 0; i < BURST; i++) {
        failed += burst[i].err_status != 0;
        same += burst[i].done && strcmp(burst[i].text, solo[i % 6].text) == 0;
        m40_request_release(burst[i].req);
    }
    CHECK(failed == 0 && same == BURST, "%d failed, %d of %d equal to the same prompt alone", failed, same, BURST);
    settle_stats(e, &st);
    CHECK(st.requests_rejected == 0 && st.running == 0 && st.queue_depth == 0 && st.requests_cancelled == 2,
          "after the burst: rejected %llu running %d queue %d cancelled %llu",
          (unsigned long long)st.requests_rejected, st.running, st.queue_depth,
          (unsigned long long)st.requests_cancelled);
    for (int i = 0; i < 6; i++)
        m40_request_release(solo[i].req);
    m40_engine_destroy(e);
}

/* ---------- the tokenizer thread, held by the hook ---------- */

typedef struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    void *hold;          /* the user pointer to hold */
    int entered;         /* the tokenizer thread is in the hook with it */
    int go;              /* let it continue */
} gate;

static gate g_gate = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, NULL, 0, 0};

static void gate_hook(void *ctx, void *user)
{
    gate *g = ctx;
    pthread_mutex_lock(&g->mu);
    if (user == g->hold) {
        g->entered = 1;
        pthread_cond_broadcast(&g->cv);
        while (!g->go)
            pthread_cond_wait(&g->cv, &g->mu);
    }
    pthread_mutex_unlock(&g->mu);
}

static void gate_arm(gate *g, void *user)
{
    pthread_mutex_lock(&g->mu);
    g->hold = user;
    g->entered = 0;
    g->go = 0;
    pthread_mutex_unlock(&g->mu);
}

/* Waits (up to timeout s) until the tokenizer thread holds the armed request. */
static int gate_wait_entered(gate *g, double timeout)
{
    double end = now_s() + timeout;
    pthread_mutex_lock(&g->mu);
    while (!g->entered && now_s() < end) {
        pthread_mutex_unlock(&g->mu);
        usleep(1000);
        pthread_mutex_lock(&g->mu);
    }
    int in = g->entered;
    pthread_mutex_unlock(&g->mu);
    return in ? 0 : -1;
}

static void gate_open(gate *g)
{
    pthread_mutex_lock(&g->mu);
    g->go = 1;
    pthread_cond_broadcast(&g->cv);
    pthread_mutex_unlock(&g->mu);
}

static void *destroy_thread(void *arg)
{
    m40_engine_destroy(arg);
    return NULL;
}

static void test_tokenizer_thread(const char *path)
{
    char err[512];
    /* max_queue 2: the request being tokenized and one behind it fill it */
    m40_engine *e = start(path, 4096, 2, 2, 0.0f, err, sizeof err);
    CHECK(e != NULL, "create: %s", err);
    if (!e)
        return;
    CHECK(wait_ready(e, 30) == M40_ENGINE_READY, "not READY");
    m40_engine_set_tokenize_hook(e, gate_hook, &g_gate);

    /* A: a stream that runs for thousands of steps */
    static job a, b, c, d, f;
    m40_request_params p;
    params_completion(&p, prompts[2], 4000);
    p.ignore_eos = 1;
    CHECK(m40_engine_submit(e, &p, &a, &a.req, err, sizeof err) == M40_SUBMIT_OK, "submit A: %s", err);
    job *ja[1] = {&a};
    double end = now_s() + 10;
    while (a.n_text_events < 2 && !a.done && now_s() < end)
        pump(e, ja, 1, 0.02);
    CHECK(a.n_text_events >= 2 && !a.done, "A streaming (%d events)", a.n_text_events);

    /* B: a huge prompt (about 120,000 tokens, far more than the context), held by the
     * hook at the start of its tokenization */
    size_t big_len = 600000;
    char *big = malloc(big_len + 1);
    CHECK(big != NULL, "malloc");
    if (!big)
        return;
    for (size_t i = 0; i < big_len; i += 8)
        memcpy(big + i, "cat dog ", big_len - i < 8 ? big_len - i : 8);
    big[big_len] = '\0';
    gate_arm(&g_gate, &b);
    params_completion(&p, big, 8);
    CHECK(m40_engine_submit(e, &p, &b, &b.req, err, sizeof err) == M40_SUBMIT_OK, "submit B: %s", err);
    CHECK(gate_wait_entered(&g_gate, 10) == 0, "the tokenizer thread never took B");

    /* While B is being tokenized, A's steps go on: 50 more tokens of it arrive. With the
     * tokenization on the engine thread none would (the hook holds it). */
    int a0 = a.n_text_events;
    end = now_s() + 30;
    while (a.n_text_events < a0 + 50 && !a.done && now_s() < end)
        pump(e, ja, 1, 0.02);
    CHECK(a.n_text_events >= a0 + 50, "A got %d tokens while B was being tokenized", a.n_text_events - a0);
    m40_engine_stats st;
    m40_engine_get_stats(e, &st);
    CHECK(st.queue_depth == 1 && st.running == 1, "while B is tokenized: queue depth %d, running %d", st.queue_depth,
          st.running);

    /* C waits behind B; D finds the queue (max_queue 2) full: B counts while tokenized. */
    params_completion(&p, prompts[0], 4);
    CHECK(m40_engine_submit(e, &p, &c, &c.req, err, sizeof err) == M40_SUBMIT_OK, "submit C: %s", err);
    int std = m40_engine_submit(e, &p, &d, &d.req, err, sizeof err);
    CHECK(std == M40_SUBMIT_QUEUE_FULL && d.req == NULL, "D: %d (%s)", std, err);
    m40_engine_get_stats(e, &st);
    CHECK(st.queue_depth == 2 && st.requests_rejected == 1, "queue depth %d, rejected %llu", st.queue_depth,
          (unsigned long long)st.requests_rejected);
    /* releasing C while it waits for the tokenizer */
    m40_request_release(c.req);
    m40_engine_get_stats(e, &st);
    CHECK(st.queue_depth == 1 && st.requests_cancelled == 1, "after releasing C: queue depth %d, cancelled %llu",
          st.queue_depth, (unsigned long long)st.requests_cancelled);

    /* B goes on: the 400 that names both numbers, as when the engine thread tokenized */
    gate_open(&g_gate);
    job *jb[1] = {&b};
    CHECK(pump(e, jb, 1, 30) == 0, "B not answered");
    CHECK(b.err_status == 400 && strstr(b.err_msg, "but the context size is 4096") && strstr(b.err_msg, "prompt has "),
          "B: %d [%s]", b.err_status, b.err_msg);
    m40_request_release(b.req);
    free(big);

    /* E: released while being tokenized; the tokenizer thread drops it when done (no
     * event for it, nothing admitted) */
    static job ej;
    gate_arm(&g_gate, &ej);
    params_completion(&p, prompts[1], 4);
    CHECK(m40_engine_submit(e, &p, &ej, &ej.req, err, sizeof err) == M40_SUBMIT_OK, "submit E: %s", err);
    CHECK(gate_wait_entered(&g_gate, 10) == 0, "the tokenizer thread never took E");
    m40_request_release(ej.req);
    gate_open(&g_gate);
    end = now_s() + 10;
    do
        m40_engine_get_stats(e, &st);
    while ((st.queue_depth != 0 || st.requests_cancelled != 2) && now_s() < end && usleep(1000) == 0);
    CHECK(st.queue_depth == 0 && st.requests_cancelled == 2 && st.running == 1,
          "after releasing E mid-tokenization: queue depth %d, cancelled %llu, running %d", st.queue_depth,
          (unsigned long long)st.requests_cancelled, st.running);
    /* the pipeline still works: a request after it completes */
    static job g2;
    params_completion(&p, prompts[3], 4);
    job *jg[1] = {&g2};
    CHECK(m40_engine_submit(e, &p, &g2, &g2.req, err, sizeof err) == M40_SUBMIT_OK, "submit G: %s", err);
    CHECK(pump(e, jg, 1, 20) == 0 && g2.err_status == 0 && g2.completion_tokens > 0, "G: %d [%s]", g2.err_status,
          g2.err_msg);
    m40_request_release(g2.req);

    /* F held in the tokenizer while the engine is destroyed: destroy waits for it (the
     * engine thread joins the tokenizer thread), F is answered 503, A ends cancelled. */
    gate_arm(&g_gate, &f);
    params_completion(&p, prompts[4], 4);
    CHECK(m40_engine_submit(e, &p, &f, &f.req, err, sizeof err) == M40_SUBMIT_OK, "submit F: %s", err);
    CHECK(gate_wait_entered(&g_gate, 10) == 0, "the tokenizer thread never took F");
    pthread_t dt;
    CHECK(pthread_create(&dt, NULL, destroy_thread, e) == 0, "destroy thread");
    /* the engine is stopping once submit says so (it cannot be freed before F is let go) */
    end = now_s() + 10;
    int stopping = 0;
    while (!stopping && now_s() < end) {
        static job probe;
        params_completion(&p, prompts[0], 1);
        m40_submit_status ps = m40_engine_submit(e, &p, &probe, &probe.req, err, sizeof err);
        if (ps == M40_SUBMIT_OK)
            m40_request_release(probe.req);
        stopping = ps == M40_SUBMIT_NOT_READY;
        if (!stopping)
            usleep(1000);
    }
    CHECK(stopping, "destroy did not start");
    gate_open(&g_gate);
    pthread_join(dt, NULL);
    job_take(&f);
    job_take(&a);
    CHECK(f.done && f.err_status == 503 && strstr(f.err_msg, "stopping"), "F after destroy: done %d, %d [%s]", f.done,
          f.err_status, f.err_msg);
    CHECK(a.done && a.finish == M40_FINISH_CANCELLED, "A after destroy: done %d finish %d", a.done, a.finish);
    m40_request_release(f.req);
    m40_request_release(a.req);
}

int main(void)
{
    char path[4096];
    test_gpu_rule();
    if (!check_shared_file("models/stories260K.gguf", path, sizeof path)) {
        SKIP("../shared/models/stories260K.gguf is absent");
        return check_done();
    }
    test_defaults(path);
    test_burst(path);
    test_tokenizer_thread(path);
    return check_done();
}
