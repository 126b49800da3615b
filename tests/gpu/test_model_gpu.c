/* The GPU forward pass (engine/model_cuda.c) and the engine on a GPU, on the shared
 * test models (run by tests/gpu/run.sh on a GPU host; skips without a GPU):
 *   1. every model with a reference (../shared/models/ref/<model>.json) agrees with it
 *      within 5e-2 in log-probability, tokenization identical;
 *   2. several prompts in one forward call (rows of different slots interleaved) give
 *      the same logits as each prompt alone, prefill and decode;
 *   3. the engine on device 0 serves 6 concurrent greedy requests whose outputs equal
 *      their solo outputs;
 *   4. with a KV pool far too small for all of them (M40_KV_BLOCKS), the engine
 *      preempts and recomputes and still finishes every request with the same text. */
#include <cuda_runtime.h>
#include <dirent.h>
#include <math.h>
#include <poll.h>
#include <stdint.h>
#include <time.h>
#include <unistd.h>

#include "check.h"
#include "eval.h"
#include "m40_engine.h"
#include "model.h"
#include "tokenizer.h"

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* ---------- 1. references ---------- */

static void test_refs(const char *shared)
{
    char dir[4096];
    snprintf(dir, sizeof dir, "%s/models/ref", shared);
    DIR *d = opendir(dir);
    if (!d) {
        SKIP("%s is absent", dir);
        return;
    }
    struct dirent *de;
    while ((de = readdir(d))) {
        size_t n = strlen(de->d_name);
        if (n < 6 || strcmp(de->d_name + n - 5, ".json") || strstr(de->d_name, ".native."))
            continue;
        char model[4096], ref_path[4096], err[512];
        snprintf(model, sizeof model, "%s/models/%.*s.gguf", shared, (int)(n - 5), de->d_name);
        snprintf(ref_path, sizeof ref_path, "%s/%s", dir, de->d_name);
        m40_ref *ref = NULL;
        m40_model *m = NULL;
        m40_model_options o = {.n_threads = 2, .device = 0};
        if (m40_ref_load(ref_path, &ref, err, sizeof err) || m40_model_load_opts(model, &o, &m, err, sizeof err)) {
            CHECK(0, "%s: %s", model, err);
            m40_ref_free(ref);
            continue;
        }
        double worst = 0;
        int ok = 1;
        for (int32_t i = 0; i < ref->n_prompts; i++) {
            m40_eval_result r;
            if (m40_eval_prompt(m, &ref->prompts[i], &r, err, sizeof err)) {
                CHECK(0, "%s prompt %d: %s", model, (int)i, err);
                ok = 0;
                continue;
            }
            CHECK(r.tokens_match, "%s prompt %d: tokenization differs", model, (int)i);
            if (r.max_abs_delta > worst)
                worst = r.max_abs_delta;
        }
        printf("ref %-32s max |dlogprob| %.4g over %d prompts (gpu)\n", de->d_name, worst, (int)ref->n_prompts);
        CHECK(ok && worst <= 5e-2, "%s: max |dlogprob| %g > 5e-2", model, worst);
        m40_model_free(m);
        m40_ref_free(ref);
    }
    closedir(d);
}

/* ---------- 2. batched == unbatched ---------- */

static double max_logprob_diff(const float *a, const float *b, int32_t n)
{
    double ma = -INFINITY, mb = -INFINITY, sa = 0, sb = 0, worst = 0;
    for (int32_t i = 0; i < n; i++) {
        if (a[i] > ma)
            ma = a[i];
        if (b[i] > mb)
            mb = b[i];
    }
    for (int32_t i = 0; i < n; i++) {
        sa += exp(a[i] - ma);
        sb += exp(b[i] - mb);
    }
    double la = ma + log(sa), lb = mb + log(sb);
    for (int32_t i = 0; i < n; i++) {
        double pa = a[i] - la;
        if (pa < -20) /* ignore the far tail: F16 noise on negligible probabilities */
            continue;
        double dd = fabs(pa - (b[i] - lb));
        if (dd > worst)
            worst = dd;
    }
    return worst;
}

#define NB 3
#define STEPS 6

static void test_batched(const char *path)
{
    char err[512];
    m40_model *m = NULL;
    m40_model_options o = {.n_threads = 2, .device = 0};
    if (m40_model_load_opts(path, &o, &m, err, sizeof err)) {
        CHECK(0, "%s: %s", path, err);
        return;
    }
    const int32_t V = m40_model_get_params(m)->n_vocab;
    const int32_t lens[NB] = {23, 5, 40};
    int32_t toks[NB][64];
    uint64_t x = 12345;
    for (int s = 0; s < NB; s++)
        for (int i = 0; i < lens[s]; i++) {
            x = x * 6364136223846793005ULL + 1442695040888963407ULL;
            toks[s][i] = (int32_t)((x >> 33) % (uint64_t)V);
        }
    float *solo = malloc((size_t)NB * (STEPS + 1) * V * sizeof(float));
    float *bat = malloc((size_t)NB * (STEPS + 1) * V * sizeof(float));
    int32_t next[NB];
    /* Alone: prefill, then STEPS greedy decode steps. */
    for (int s = 0; s < NB; s++) {
        m40_kv *kv = m40_kv_new(m, 1, 128);
        int32_t pos[64], slot[64] = {0};
        for (int i = 0; i < lens[s]; i++)
            pos[i] = i;
        m40_batch b = {.n = lens[s], .tokens = toks[s], .pos = pos, .slot = slot};
        CHECK(m40_model_forward(m, kv, &b, solo + ((size_t)s * (STEPS + 1)) * V, err, sizeof err) == 0, "%s", err);
        for (int t = 0; t < STEPS; t++) {
            const float *l = solo + ((size_t)s * (STEPS + 1) + t) * V;
            int32_t best = 0;
            for (int32_t i = 1; i < V; i++)
                if (l[i] > l[best])
                    best = i;
            int32_t p1 = lens[s] + t, s0 = 0;
            m40_batch d = {.n = 1, .tokens = &best, .pos = &p1, .slot = &s0};
            CHECK(m40_model_forward(m, kv, &d, solo + ((size_t)s * (STEPS + 1) + t + 1) * V, err, sizeof err) == 0,
                  "%s", err);
        }
        m40_kv_free(kv);
    }
    /* Together: one prefill call with the prompts' rows interleaved (slot 2, 0, 1, ...),
     * then decode steps with the slots in reverse order. */
    m40_kv *kv = m40_kv_new(m, NB, 128);
    int32_t bt[NB * 64], bp[NB * 64], bs[NB * 64];
    uint8_t bw[NB * 64];
    int32_t n = 0, done[NB] = {0}, row_of[NB];
    for (int round = 0; n < lens[0] + lens[1] + lens[2]; round++)
        for (int k = 0; k < NB; k++) {
            int s = (k + 2) % NB;
            if (done[s] < lens[s]) {
                bt[n] = toks[s][done[s]];
                bp[n] = done[s];
                bs[n] = s;
                bw[n] = done[s] + 1 == lens[s];
                done[s]++;
                n++;
            }
        }
    float *out = malloc((size_t)NB * V * sizeof(float));
    m40_batch b = {.n = n, .tokens = bt, .pos = bp, .slot = bs, .want_logits = bw};
    CHECK(m40_model_forward(m, kv, &b, out, err, sizeof err) == 0, "batched prefill: %s", err);
    int32_t k = 0;
    for (int32_t i = 0; i < n; i++)
        if (bw[i])
            row_of[bs[i]] = k++;
    for (int s = 0; s < NB; s++)
        memcpy(bat + ((size_t)s * (STEPS + 1)) * V, out + (size_t)row_of[s] * V, (size_t)V * sizeof(float));
    for (int t = 0; t < STEPS; t++) {
        int32_t dt[NB], dp[NB], ds[NB];
        for (int j = 0; j < NB; j++) {
            int s = NB - 1 - j;
            const float *l = solo + ((size_t)s * (STEPS + 1) + t) * V; /* feed the solo run's tokens */
            int32_t best = 0;
            for (int32_t i = 1; i < V; i++)
                if (l[i] > l[best])
                    best = i;
            next[s] = best;
            dt[j] = best;
            dp[j] = lens[s] + t;
            ds[j] = s;
        }
        uint8_t w[NB] = {1, 1, 1};
        m40_batch d = {.n = NB, .tokens = dt, .pos = dp, .slot = ds, .want_logits = w};
        CHECK(m40_model_forward(m, kv, &d, out, err, sizeof err) == 0, "batched decode: %s", err);
        for (int j = 0; j < NB; j++)
            memcpy(bat + ((size_t)ds[j] * (STEPS + 1) + t + 1) * V, out + (size_t)j * V, (size_t)V * sizeof(float));
    }
    (void)next;
    double worst = 0;
    for (int s = 0; s < NB; s++)
        for (int t = 0; t <= STEPS; t++) {
            double dd = max_logprob_diff(solo + ((size_t)s * (STEPS + 1) + t) * V, bat + ((size_t)s * (STEPS + 1) + t) * V, V);
            if (dd > worst)
                worst = dd;
        }
    printf("batched vs alone %-40s max |dlogprob| %.3g\n", strrchr(path, '/') + 1, worst);
    CHECK(worst <= 2e-2, "%s: batched differs from alone by %g", path, worst);
    /* Restarting a slot at position 0 reuses it (blocks released and taken again). */
    int32_t p0 = 0, s1 = 1;
    m40_batch r = {.n = 1, .tokens = toks[1], .pos = &p0, .slot = &s1};
    CHECK(m40_model_forward(m, kv, &r, out, err, sizeof err) == 0, "restart: %s", err);
    free(out);
    m40_kv_free(kv);
    free(solo);
    free(bat);
    m40_model_free(m);
}

/* ---------- 3, 4. the engine ---------- */

typedef struct {
    m40_request *req;
    char text[8192];
    size_t len;
    int done, err_status;
    m40_finish finish;
    int completion_tokens;
    char err_msg[256];
} job;

static void job_take(job *j)
{
    m40_event ev;
    while (!j->done && m40_request_poll(j->req, &ev)) {
        if (ev.type == M40_EV_TEXT) {
            if (j->len + ev.text_len < sizeof j->text) {
                memcpy(j->text + j->len, ev.text, ev.text_len);
                j->len += ev.text_len;
                j->text[j->len] = '\0';
            }
        } else if (ev.type == M40_EV_DONE) {
            j->done = 1;
            j->finish = ev.finish;
            j->completion_tokens = ev.completion_tokens;
        } else {
            j->done = 1;
            j->err_status = ev.http_status;
            snprintf(j->err_msg, sizeof j->err_msg, "%s", ev.message);
        }
        m40_event_clear(&ev);
    }
}

static int pump(m40_engine *e, job **jobs, int n, double timeout)
{
    double end = now_s() + timeout;
    for (;;) {
        int open = 0;
        for (int i = 0; i < n; i++)
            open += !jobs[i]->done;
        if (!open)
            return 0;
        if (now_s() > end)
            return -1;
        struct pollfd pfd = {.fd = m40_engine_event_fd(e), .events = POLLIN};
        if (poll(&pfd, 1, 50) > 0) {
            uint64_t v;
            if (read(pfd.fd, &v, sizeof v) != (ssize_t)sizeof v)
                continue;
        }
        void *users[8];
        int got;
        do {
            got = m40_engine_ready(e, users, 8);
            for (int i = 0; i < got; i++)
                job_take(users[i]);
        } while (got == 8);
    }
}

static const char *prompts[6] = {
    "Once upon a time",
    "The little dog",
    "Lily and Tom went to the park. They saw a big",
    "One day",
    "She was happy because",
    "A bird sat on a tree and sang a song to the sun and the moon and the stars",
};

static int32_t ban_ids[1];
static float ban_vals[1] = {-1000.0f};

static void params(m40_request_params *p, const char *prompt, int max_tokens)
{
    memset(p, 0, sizeof *p);
    p->prompt = prompt;
    p->prompt_len = strlen(prompt);
    p->max_tokens = max_tokens;
    m40_sampler_params_default(&p->sampling);
    p->sampling.temperature = 0.0f;
    p->sampling.n_logit_bias = 1;
    p->sampling.logit_bias_ids = ban_ids;
    p->sampling.logit_bias_values = ban_vals;
}

static m40_engine *start(const char *path, int max_seqs, int chunk)
{
    m40_engine_config cfg = {.model_path = path, .model_name = "t", .device = 0, .ctx_size = 256,
                             .max_seqs = max_seqs, .max_queue = 16, .n_threads = 2, .prefill_chunk = chunk};
    m40_engine *e = NULL;
    char err[512];
    if (m40_engine_create(&cfg, &e, err, sizeof err)) {
        CHECK(0, "engine create: %s", err);
        return NULL;
    }
    double end = now_s() + 60;
    m40_engine_state st;
    while ((st = m40_engine_get_state(e, err, sizeof err)) == M40_ENGINE_LOADING && now_s() < end)
        usleep(5000);
    CHECK(st == M40_ENGINE_READY, "engine not ready: %s", err);
    if (st != M40_ENGINE_READY) {
        m40_engine_destroy(e);
        return NULL;
    }
    return e;
}

#define GEN 40

static void test_engine(const char *path)
{
    char err[512];
    m40_model *m = NULL;
    if (m40_model_load(path, 1, &m, err, sizeof err) == 0) {
        ban_ids[0] = m40_tokenizer_eos(m40_model_tokenizer(m));
        m40_model_free(m);
    }
    static job solo[6], conc[6], tight[6];
    /* Solo: one request at a time. */
    m40_engine *e = start(path, 6, 64);
    if (!e)
        return;
    for (int i = 0; i < 6; i++) {
        m40_request_params p;
        params(&p, prompts[i], GEN);
        job *js[1] = {&solo[i]};
        CHECK(m40_engine_submit(e, &p, &solo[i], &solo[i].req, err, sizeof err) == M40_SUBMIT_OK, "submit: %s", err);
        CHECK(pump(e, js, 1, 60) == 0, "solo request %d did not finish", i);
        CHECK(solo[i].finish == M40_FINISH_LENGTH && solo[i].completion_tokens == GEN, "solo %d: finish %d, %d tokens %s",
              i, solo[i].finish, solo[i].completion_tokens, solo[i].err_msg);
        m40_request_release(solo[i].req);
    }
    /* Six at once. */
    job *js[6];
    for (int i = 0; i < 6; i++) {
        m40_request_params p;
        params(&p, prompts[i], GEN);
        js[i] = &conc[i];
        CHECK(m40_engine_submit(e, &p, &conc[i], &conc[i].req, err, sizeof err) == M40_SUBMIT_OK, "submit: %s", err);
    }
    CHECK(pump(e, js, 6, 120) == 0, "concurrent requests did not finish");
    int same = 0;
    for (int i = 0; i < 6; i++) {
        same += conc[i].finish == M40_FINISH_LENGTH && strcmp(conc[i].text, solo[i].text) == 0;
        CHECK(strcmp(conc[i].text, solo[i].text) == 0, "concurrent %d differs from solo:\n  [%s]\n  [%s] %s", i,
              conc[i].text, solo[i].text, conc[i].err_msg);
        m40_request_release(conc[i].req);
    }
    printf("engine gpu: 6 concurrent greedy requests, %d/6 equal to solo\n", same);
    m40_engine_destroy(e);

    /* A pool of 12 blocks (192 tokens) for 6 sequences of ~60 tokens (4 blocks each):
     * sequences must be preempted and recomputed. */
    setenv("M40_KV_BLOCKS", "12", 1);
    e = start(path, 6, 16);
    unsetenv("M40_KV_BLOCKS");
    if (!e)
        return;
    m40_engine_stats st;
    m40_engine_get_stats(e, &st);
    CHECK(st.kv_tokens_total == 12 * 16, "kv_tokens_total %lld", (long long)st.kv_tokens_total);
    for (int i = 0; i < 6; i++) {
        m40_request_params p;
        params(&p, prompts[i], GEN);
        js[i] = &tight[i];
        CHECK(m40_engine_submit(e, &p, &tight[i], &tight[i].req, err, sizeof err) == M40_SUBMIT_OK, "submit: %s", err);
    }
    CHECK(pump(e, js, 6, 120) == 0, "requests under a tight pool did not finish");
    same = 0;
    for (int i = 0; i < 6; i++) {
        same += tight[i].finish == M40_FINISH_LENGTH && strcmp(tight[i].text, solo[i].text) == 0;
        CHECK(tight[i].finish == M40_FINISH_LENGTH && strcmp(tight[i].text, solo[i].text) == 0,
              "tight pool %d: finish %d status %d (%s), text:\n  [%s]\n  [%s]", i, tight[i].finish,
              tight[i].err_status, tight[i].err_msg, tight[i].text, solo[i].text);
        m40_request_release(tight[i].req);
    }
    printf("engine gpu, 12-block pool: %d/6 requests complete and equal to solo (preemption)\n", same);
    m40_engine_get_stats(e, &st);
    CHECK(st.running == 0, "running %d", (int)st.running);
    m40_engine_destroy(e);
}

int main(void)
{
    int ndev = 0;
    if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev == 0) {
        SKIP("no CUDA device");
        return check_done();
    }
    const char *shared = check_shared_dir();
    if (!shared) {
        SKIP("../shared is absent");
        return check_done();
    }
    char shared_copy[4096];
    snprintf(shared_copy, sizeof shared_copy, "%s", shared);
    double t0 = now_s();
    test_refs(shared_copy);
    printf("refs: %.1f s\n", now_s() - t0);
    char path[4096];
    const char *batch_models[] = {"tiny-llama-q8_0.gguf", "tiny-llama-q4km.gguf", "stories260K.gguf",
                                  "tiny-qwen2-gpt2-f16.gguf"};
    for (size_t i = 0; i < sizeof batch_models / sizeof batch_models[0]; i++) {
        snprintf(path, sizeof path, "%s/models/%s", shared_copy, batch_models[i]);
        test_batched(path);
    }
    snprintf(path, sizeof path, "%s/models/stories260K.gguf", shared_copy);
    test_engine(path);
    snprintf(path, sizeof path, "%s/models/tiny-llama-q8_0.gguf", shared_copy);
    test_engine(path);
    return check_done();
}
