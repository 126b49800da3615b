/* The GPU forward pass (engine/gpu/model_cuda_fwd.c) and the engine on a GPU, on the shared
 * test models (run by tests/gpu/run.sh on a GPU host; skips without a GPU):
 *   1. every model with a reference (../shared/models/ref/<model>.json) agrees with it
 *      within 5e-2 in log-probability, tokenization identical;
 *   2. several prompts in one forward call (rows of different slots interleaved) give
 *      the same logits as each prompt alone, prefill and decode;
 *   3. the engine on device 0 serves 6 concurrent greedy requests whose outputs equal
 *      their solo outputs;
 *   4. with a KV pool far too small for all of them (M40_KV_BLOCKS), the engine
 *      preempts and recomputes and still finishes every request with the same text;
 *   5. Gemma 3: tiny synthetic gemma3 files (written here; head_dim 256 for the tuned
 *      attention kernels and 24 for the generic one, GQA, sliding window 40 with
 *      alternating local/global layers, linear RoPE scaling, logit soft-capping) give
 *      the CPU's teacher-forced log-probabilities within 5e-2 over a 150-token prompt
 *      (F32 weights, and Q8_0 ones for the GEMV and dequantizing paths),
 *      both prefilled at once and prefilled in part then decoded token by token; and
 *      the real Gemma 3 270M (models-cache/, scripts/fetch-gemma3.sh) agrees with its
 *      NumPy reference within 5e-2 when it is there. Needs no ../shared;
 *   6. automatic prefix caching: 8 requests sharing a 200-token prefix give the same
 *      texts as with M40_PREFIX_CACHE=0, compute the prefix once (prompt tokens computed
 *      <= prefix + suffixes + 16 per request), compute at most a block each when sent
 *      again, and stay correct under preemption in a 24-block pool and when half of
 *      them are cancelled mid-decode;
 *   7. batches of 2..8 rows on the quantized GEMM's register kernel (M40_GEMV_ROWS=1)
 *      give the logits of each row alone (a GEMV), as the GEMVs do (M40_GEMV_ROWS=8): tiny
 *      synthetic Q4_K_M and Q8_0 models (`m40 mkmodel --shape tiny`, written here), whose
 *      rows of 256 and 768 the register kernel reads;
 *   8. batch invariance: with m40_model_options.batch_invariant each sequence's logits are
 *      the same bits alone and in batches of other shapes (prompts in other chunks, decode
 *      rows beside prompts and other decode rows): tiny synthetic Q4_K_M, Q8_0 and F16
 *      models with F16 products, Q4_K_M with F32 ones, and the shared stories260K,
 *      tiny-llama-q4km, tiny-gemma2-f16, tiny-qwen3moe-q4km and tiny-gpt-oss-mxfp4
 *      (M40_TEST_BI_MODEL=PATH: 8, 8b and 8c alone, on PATH: a 7B file, say); 8b, a
 *      prompt's cached blocks reused in another slot, the same bits (stories260K,
 *      tiny-gemma2-f16); 8c, the engine with its prefix cache: a prompt of 16k + 1
 *      tokens alone on its cached blocks computes its last 17 and gives the text it
 *      gave among others. */
#include <cuda_runtime.h>
#include <dirent.h>
#include <math.h>
#include <poll.h>
#include <stdint.h>
#include <time.h>
#include <unistd.h>

#include "check.h"
#include "engine_jobs.h"
#include "model/arch.h"
#include "model/eval.h"
#include "ref/ggml_types.h"
#include "gguf/gguf_writer.h"
#include "gguf/mkmodel.h"
#include "ref/quant.h"
#include "m40_engine.h"
#include "model/model.h"
#include "model/model_internal.h" /* m40_row_sample_params */
#include "ref/cpu_ref.h"           /* m40_ref_sample */
#include "tokenizer/tokenizer.h"


/* ---------- 1. references ---------- */

/* Teacher-forced comparison of MODEL on the GPU with the reference file: every prompt
 * tokenizes identically and every |dlogprob| is within 5e-2. */
static void eval_against_ref(const char *model, const char *ref_path, const char *label)
{
    char err[512];
    m40_ref *ref = NULL;
    m40_model *m = NULL;
    m40_model_options o = {.n_threads = 2, .device = 0};
    if (m40_ref_load(ref_path, &ref, err, sizeof err) || m40_model_load_opts(model, &o, &m, err, sizeof err)) {
        CHECK(0, "%s: %s", model, err);
        m40_ref_free(ref);
        return;
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
    printf("ref %-32s max |dlogprob| %.4g over %d prompts (gpu)\n", label, worst, (int)ref->n_prompts);
    CHECK(ok && worst <= 5e-2, "%s: max |dlogprob| %g > 5e-2", model, worst);
    m40_model_free(m);
    m40_ref_free(ref);
}

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
        char model[4096], ref_path[4096];
        snprintf(model, sizeof model, "%s/models/%.*s.gguf", shared, (int)(n - 5), de->d_name);
        snprintf(ref_path, sizeof ref_path, "%s/%s", dir, de->d_name);
        if (access(model, R_OK) != 0) { /* a partial copy of ../shared: skip, as for an absent directory */
            SKIP("%s is absent", model);
            continue;
        }
        eval_against_ref(model, ref_path, de->d_name);
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

/* The next of a test's random token ids below V (a 64-bit LCG, state x) */
static int32_t rand_tok(uint64_t *x, uint64_t V)
{
    *x = *x * 6364136223846793005ULL + 1442695040888963407ULL;
    return (int32_t)((*x >> 33) % V);
}

#define NB 3
#define STEPS 6

/* path loaded onto GPU 0 (batch_invariant: m40_model_options'); NULL after a SKIP (absent) or a
 * failed CHECK (load error) */
static m40_model *load_on_gpu_as(const char *path, int batch_invariant)
{
    char err[512];
    if (access(path, R_OK)) {
        SKIP("%s is absent", path);
        return NULL;
    }
    m40_model *m = NULL;
    m40_model_options o = {.n_threads = 2, .device = 0, .batch_invariant = batch_invariant};
    if (m40_model_load_opts(path, &o, &m, err, sizeof err)) {
        CHECK(0, "%s: %s", path, err);
        return NULL;
    }
    return m;
}

static m40_model *load_on_gpu(const char *path)
{
    return load_on_gpu_as(path, 0);
}


/* forward with b.argmax: the picks equal the argmax of the logits a plain forward returns
 * (3 interleaved prompts, then a decode step), and no logits buffer is needed. */
static int sampled_rows;
static void test_argmax(const char *path)
{
    char err[512];
    m40_model *m = load_on_gpu(path);
    if (!m)
        return;
    const int32_t V = m40_model_get_params(m)->n_vocab;
    int32_t tok[30], pos[30], slot[30];
    uint8_t want[30];
    for (int i = 0; i < 30; i++) {
        tok[i] = (int32_t)((i * 7919u + 13u) % (uint32_t)V);
        slot[i] = i % 3, pos[i] = i / 3, want[i] = i >= 27;
    }
    float *logits = malloc((size_t)3 * V * sizeof *logits), *row = malloc((size_t)V * sizeof *row);
    int32_t picks[3] = {-1, -1, -1}, want_ids[3], drawn[3];
    m40_kv *a = m40_kv_new(m, 3, 64), *b2 = m40_kv_new(m, 3, 64), *c3 = m40_kv_new(m, 3, 64);
    /* m40_batch.sample: the device's draws equal the CPU twin's (m40_ref_sample) on the
     * same logits, bit for bit (kernels.h 9b) */
    const m40_row_sample rs[3] = {{.temperature = 0.8f, .top_p = 0.95f, .seed = 11},
                                  {.temperature = 1.3f, .top_k = 40, .top_p = 1.0f, .min_p = 0.02f, .seed = 12},
                                  {.temperature = 0.0f, .top_p = 1.0f, .seed = 13}};
    m40_row_sample rstep[3];
    for (int step = 0; step < 2 && logits && row && a && b2 && c3; step++) {
        int n = step == 0 ? 30 : 3;
        m40_batch full = {.n = n, .tokens = tok, .pos = pos, .slot = slot, .want_logits = step == 0 ? want : NULL};
        if (step == 1) {
            for (int s = 0; s < 3; s++)
                tok[s] = picks[s], pos[s] = 10, slot[s] = s, want[s] = 1;
            full.want_logits = want;
        }
        CHECK(m40_model_forward(m, a, &full, logits, err, sizeof err) == 0, "%s", err);
        for (int k = 0; k < 3; k++) {
            want_ids[k] = 0;
            for (int32_t v = 1; v < V; v++)
                if (logits[(size_t)k * V + v] > logits[(size_t)k * V + want_ids[k]])
                    want_ids[k] = v;
        }
        m40_batch pick = full;
        pick.argmax = picks;
        CHECK(m40_model_forward(m, b2, &pick, NULL, err, sizeof err) == 0, "argmax forward: %s", err);
        CHECK(picks[0] == want_ids[0] && picks[1] == want_ids[1] && picks[2] == want_ids[2],
              "%s step %d: device picks %d %d %d, argmax of the logits %d %d %d", path, step, picks[0], picks[1],
              picks[2], want_ids[0], want_ids[1], want_ids[2]);
        m40_batch draw = full;
        draw.argmax = drawn;
        for (int k = 0; k < 3; k++)
            rstep[k] = rs[k], rstep[k].step = (uint64_t)(step * 7 + k);
        draw.sample = rstep;
        CHECK(m40_model_forward(m, c3, &draw, NULL, err, sizeof err) == 0, "sample forward: %s", err);
        for (int k = 0; k < 3; k++) {
            m40k_sample_params sp;
            m40_row_sample_params(&rstep[k], &sp);
            memcpy(row, logits + (size_t)k * V, (size_t)V * sizeof *row);
            int32_t want_tok = -1;
            float lp;
            m40_ref_sample(row, V, 1, V, &sp, NULL, NULL, NULL, NULL, NULL, NULL, &want_tok, &lp, 0, NULL, NULL);
            CHECK(drawn[k] == want_tok, "%s step %d row %d (T %g): device drew %d, the twin %d", path, step, k,
                  (double)rstep[k].temperature, drawn[k], want_tok);
            sampled_rows++;
        }
    }
    free(logits);
    free(row);
    m40_kv_free(a);
    m40_kv_free(b2);
    m40_kv_free(c3);
    m40_model_free(m);
}

static void test_batched(const char *path)
{
    char err[512];
    m40_model *m = load_on_gpu(path);
    if (!m)
        return;
    const int32_t V = m40_model_get_params(m)->n_vocab;
    const int32_t lens[NB] = {23, 5, 40};
    int32_t toks[NB][64];
    uint64_t x = 12345;
    for (int s = 0; s < NB; s++)
        for (int i = 0; i < lens[s]; i++)
            toks[s][i] = rand_tok(&x, (uint64_t)V);
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
    double worst = 0, worst_dec = 0; /* all rows; the decode steps' (t >= 1) */
    for (int s = 0; s < NB; s++)
        for (int t = 0; t <= STEPS; t++) {
            double dd = max_logprob_diff(solo + ((size_t)s * (STEPS + 1) + t) * V, bat + ((size_t)s * (STEPS + 1) + t) * V, V);
            if (dd > worst)
                worst = dd;
            if (t >= 1 && dd > worst_dec)
                worst_dec = dd;
        }
    printf("batched vs alone %-40s max |dlogprob| %.3g (decode steps %.3g)\n", strrchr(path, '/') + 1, worst,
           worst_dec);
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

/* Mixtures of experts: MS sequences of different prompts (their tokens routed to
 * different experts) prefilled in one call, rows interleaved, then MSTEPS decode steps of
 * all of them (more rows than the expert GEMVs take: the grouped products), against
 * each alone (its prefill grouped, its decode steps one row: the expert GEMVs). The
 * prompts cross gpt-oss-tiny's sliding window of 32. A row whose GPU path is not
 * validated runs only under the test seam M40_GPU_UNVALIDATED=1 (README: tuning). */
#define MS 12
#define MSTEPS 4
static int moe_allowed(const char *path, const char *arch)
{
    const m40_arch *a = m40_arch_find(arch);
    const char *seam = getenv("M40_GPU_UNVALIDATED");
    if (!a || (!a->gpu_validated && !(seam && !strcmp(seam, "1")))) {
        SKIP("%s: '%s' is not gpu_validated: run with M40_GPU_UNVALIDATED=1 to check it", path, arch);
        return 0;
    }
    return 1;
}

/* Every 5th token id, at position 0 of its own sequence (64 sequences a forward call),
 * on the GPU against the exact CPU model: the embedding rows and the first position's
 * path, which random prompts reach only in part. An MoE step can flip an expert choice
 * where the router's k-th and next logits nearly tie, and a flip moves the step by whole
 * nats (../shared/models/next/README.md). Measured on the H100 (session 16, every id):
 * 2 of 32,256 ids of tiny-qwen3moe-f16 over 7.5e-2, 40 of q4km, 18 of 50,257 of
 * gpt-oss-mxfp4; the worst of each had a CPU router gap of 9.6e-5, 4.2e-4 and 7.7e-5
 * (a typical id: 0.1-1). So at most 0.5% of the ids may miss the bound; a wrong expert
 * matrix, scale or routing would miss it on most of them. */
static void test_vocab_sweep(const char *path)
{
    char err[512];
    m40_model *g = load_on_gpu(path), *c = NULL;
    if (!g)
        return;
    if (m40_model_load(path, 4, &c, err, sizeof err) != 0) {
        CHECK(0, "cpu load: %s", err);
        m40_model_free(g);
        return;
    }
    enum { SW = 64 };
    const int32_t V = m40_model_get_params(g)->n_vocab;
    float *lg = malloc((size_t)SW * V * sizeof *lg), *lc = malloc((size_t)SW * V * sizeof *lc);
    double worst = 0;
    int32_t worst_id = -1, over = 0;
    int32_t swept = 0;
    for (int32_t t0 = 0; t0 < V && lg && lc; t0 += 5 * SW) {
        int32_t n = 0, tk[SW], ps[SW], sl[SW];
        uint8_t w[SW];
        for (int32_t id = t0; id < V && n < SW; id += 5)
            tk[n] = id, ps[n] = 0, sl[n] = n, w[n] = 1, n++;
        swept += n;
        m40_kv *kg = m40_kv_new(g, SW, 16), *kc = m40_kv_new(c, SW, 16);
        m40_batch b = {.n = n, .tokens = tk, .pos = ps, .slot = sl, .want_logits = w};
        int ok = kg && kc && m40_model_forward(g, kg, &b, lg, err, sizeof err) == 0 &&
                 m40_model_forward(c, kc, &b, lc, err, sizeof err) == 0;
        m40_kv_free(kg);
        m40_kv_free(kc);
        CHECK(ok, "vocab sweep at %d: %s", (int)t0, err);
        if (!ok)
            break;
        for (int i = 0; i < n; i++) {
            double d = max_logprob_diff(lg + (size_t)i * V, lc + (size_t)i * V, V);
            over += d > 7.5e-2;
            if (d > worst)
                worst = d, worst_id = tk[i];
        }
    }
    printf("vocab sweep %-30s %d token ids at position 0, gpu vs cpu: max |dlogprob| %.3g (id %d), %d over 7.5e-2\n",
           strrchr(path, '/') + 1, (int)swept, worst, (int)worst_id, (int)over);
    CHECK(swept > 0 && over * 200 <= swept, "%s: %d of %d token ids differ from the cpu by more than 7.5e-2 (worst %d: %g)",
          path, (int)over, (int)swept, (int)worst_id, worst);
    free(lg);
    free(lc);
    m40_model_free(c);
    m40_model_free(g);
}

static void test_moe_batched(const char *path)
{
    char err[512];
    m40_model *m = load_on_gpu(path);
    if (!m)
        return;
    const int32_t V = m40_model_get_params(m)->n_vocab;
    int32_t lens[MS], toks[MS][64];
    uint64_t x = 987654321;
    for (int s = 0; s < MS; s++) {
        lens[s] = 1 + (s * 17 + 5) % 60;
        for (int i = 0; i < lens[s]; i++)
            toks[s][i] = rand_tok(&x, (uint64_t)V);
    }
    float *solo = malloc((size_t)MS * (MSTEPS + 1) * V * sizeof(float));
    float *bat = malloc((size_t)MS * (MSTEPS + 1) * V * sizeof(float));
    float *out = malloc((size_t)MS * V * sizeof(float));
    int32_t fed[MS][MSTEPS];
    for (int s = 0; s < MS && solo && bat && out; s++) { /* alone: prefill, then greedy decode steps */
        m40_kv *kv = m40_kv_new(m, 1, 128);
        int32_t pos[64], slot[64] = {0};
        for (int i = 0; i < lens[s]; i++)
            pos[i] = i;
        m40_batch b = {.n = lens[s], .tokens = toks[s], .pos = pos, .slot = slot};
        CHECK(m40_model_forward(m, kv, &b, solo + ((size_t)s * (MSTEPS + 1)) * V, err, sizeof err) == 0, "%s", err);
        for (int t = 0; t < MSTEPS; t++) {
            const float *l = solo + ((size_t)s * (MSTEPS + 1) + t) * V;
            int32_t best = 0;
            for (int32_t i = 1; i < V; i++)
                if (l[i] > l[best])
                    best = i;
            fed[s][t] = best;
            int32_t p1 = lens[s] + t, s0 = 0;
            m40_batch d = {.n = 1, .tokens = &best, .pos = &p1, .slot = &s0};
            CHECK(m40_model_forward(m, kv, &d, solo + ((size_t)s * (MSTEPS + 1) + t + 1) * V, err, sizeof err) == 0,
                  "%s", err);
        }
        m40_kv_free(kv);
    }
    m40_kv *kv = m40_kv_new(m, MS, 128);
    int32_t bt[MS * 64], bp[MS * 64], bs[MS * 64], row_of[MS], done[MS] = {0}, total = 0, n = 0;
    uint8_t bw[MS * 64];
    for (int s = 0; s < MS; s++)
        total += lens[s];
    while (n < total) /* one row of each unfinished prompt in turn, starting from the last */
        for (int k = MS - 1; k >= 0; k--)
            if (done[k] < lens[k]) {
                bt[n] = toks[k][done[k]], bp[n] = done[k], bs[n] = k, bw[n] = done[k] + 1 == lens[k];
                done[k]++, n++;
            }
    m40_batch b = {.n = n, .tokens = bt, .pos = bp, .slot = bs, .want_logits = bw};
    CHECK(kv && m40_model_forward(m, kv, &b, out, err, sizeof err) == 0, "batched prefill: %s", err);
    for (int32_t i = 0, k = 0; i < n; i++)
        if (bw[i])
            row_of[bs[i]] = k++;
    for (int s = 0; s < MS; s++)
        memcpy(bat + ((size_t)s * (MSTEPS + 1)) * V, out + (size_t)row_of[s] * V, (size_t)V * sizeof(float));
    for (int t = 0; t < MSTEPS; t++) {
        int32_t dt[MS], dp[MS], ds[MS];
        uint8_t w[MS];
        for (int j = 0; j < MS; j++) { /* the slots in another order than the prefill's */
            int s = (j * 5 + 3) % MS;
            dt[j] = fed[s][t], dp[j] = lens[s] + t, ds[j] = s, w[j] = 1;
        }
        m40_batch d = {.n = MS, .tokens = dt, .pos = dp, .slot = ds, .want_logits = w};
        CHECK(m40_model_forward(m, kv, &d, out, err, sizeof err) == 0, "batched decode: %s", err);
        for (int j = 0; j < MS; j++)
            memcpy(bat + ((size_t)ds[j] * (MSTEPS + 1) + t + 1) * V, out + (size_t)j * V, (size_t)V * sizeof(float));
    }
    /* The exact F32 CPU model on the same tokens (the alone run's greedy choices fed):
     * each GPU path against it, as `m40 eval --device 0` holds the GPU to a reference. */
    float *cpu = malloc((size_t)MS * (MSTEPS + 1) * V * sizeof(float));
    m40_model *cm = NULL;
    CHECK(cpu && m40_model_load(path, 4, &cm, err, sizeof err) == 0, "cpu load: %s", err);
    for (int s = 0; s < MS && cm && cpu; s++) {
        m40_kv *ckv = m40_kv_new(cm, 1, 128);
        int32_t pos[64], slot[64] = {0};
        for (int i = 0; i < lens[s]; i++)
            pos[i] = i;
        m40_batch b = {.n = lens[s], .tokens = toks[s], .pos = pos, .slot = slot};
        CHECK(ckv && m40_model_forward(cm, ckv, &b, cpu + ((size_t)s * (MSTEPS + 1)) * V, err, sizeof err) == 0,
              "cpu: %s", err);
        for (int t = 0; t < MSTEPS && ckv; t++) {
            int32_t tk = fed[s][t], p1 = lens[s] + t, s0 = 0;
            m40_batch d = {.n = 1, .tokens = &tk, .pos = &p1, .slot = &s0};
            CHECK(m40_model_forward(cm, ckv, &d, cpu + ((size_t)s * (MSTEPS + 1) + t + 1) * V, err, sizeof err) == 0,
                  "cpu: %s", err);
        }
        m40_kv_free(ckv);
    }
    double worst = 0, worst_solo = 0, worst_bat = 0;
    int ws_at = 0, wt_at = 0, over_solo = 0, over_bat = 0;
    for (int s = 0; s < MS; s++)
        for (int t = 0; t <= MSTEPS; t++) {
            const size_t o = ((size_t)s * (MSTEPS + 1) + t) * V;
            double dd = max_logprob_diff(solo + o, bat + o, V);
            worst = dd > worst ? dd : worst;
            if (cm) {
                double ds = max_logprob_diff(solo + o, cpu + o, V), db = max_logprob_diff(bat + o, cpu + o, V);
                if (ds > worst_solo)
                    ws_at = s, wt_at = t;
                over_solo += ds > 7.5e-2;
                over_bat += db > 7.5e-2;
                worst_solo = ds > worst_solo ? ds : worst_solo;
                worst_bat = db > worst_bat ? db : worst_bat;
            }
        }
    printf("MoE batched (%d sequences) vs alone %-30s max |dlogprob| %.3g; against the cpu: alone %.3g, batched %.3g "
           "(alone's worst: sequence %d of %d tokens, step %d; rows over 7.5e-2: %d, %d of %d)\n",
           MS, strrchr(path, '/') + 1, worst, worst_solo, worst_bat, ws_at, (int)lens[ws_at], wt_at, over_solo, over_bat,
           MS * (MSTEPS + 1));
    /* Batched and alone run the same kernels on the same activations except the expert
     * products (GEMVs on F32 activations where M40_MOE_GEMV_ROWS leaves a step to them --
     * unset: one row, but for MXFP4 experts -- grouped products on F16 ones otherwise):
     * measured 0.0107 (f16), 0.0464 (q4km: with every row grouped 0.0165), 0.0171 (mxfp4,
     * before it was grouped alone too). Against the exact CPU model, an expert flipped at a near
     * tie (test_vocab_sweep) reaches the later tokens through attention (q4km: 0.31 at
     * sequence 2's last step, the same alone and batched): a row in ten may miss. */
    CHECK(worst <= 7.5e-2, "%s: batched differs from alone by %g", path, worst);
    CHECK(over_solo * 10 <= MS * (MSTEPS + 1) && over_bat * 10 <= MS * (MSTEPS + 1),
          "%s: against the cpu, %d (alone) and %d (batched) of %d rows over 7.5e-2", path, over_solo, over_bat,
          MS * (MSTEPS + 1));
    m40_model_free(cm);
    free(cpu);
    free(out);
    m40_kv_free(kv);
    free(solo);
    free(bat);
    m40_model_free(m);
}

/* Decode-step CUDA graphs (M40_CUDA_GRAPHS): the same steps with graphs off and on give
 * the same logits, and with graphs on the steps after the first of a shape (batch size,
 * split counts) are graph launches. 3 sequences of 23, 5 and 40 tokens decode 80 steps,
 * all three together except every fifth step (one of them alone): shapes of 1 and 3
 * sequences, their split counts changing as the lengths cross 32, 64 and 128; then the
 * pool is replaced (graphs read its pointers) and decoding goes on in a new one. */
static void test_graphs(const char *path)
{
    char err[512];
    setenv("M40_CUDA_GRAPHS", "0", 1);
    m40_model *plain = load_on_gpu(path);
    unsetenv("M40_CUDA_GRAPHS");
    m40_model *gm = plain ? load_on_gpu(path) : NULL;
    if (!plain || !gm) {
        m40_model_free(plain);
        return;
    }
    enum { GS = 3, GSTEPS = 80 };
    const int32_t V = m40_model_get_params(plain)->n_vocab;
    const int32_t lens[GS] = {23, 5, 40};
    float *la = malloc((size_t)GS * V * sizeof *la), *lb = malloc((size_t)GS * V * sizeof *lb);
    m40_kv *ka = m40_kv_new(plain, GS, 256), *kb = m40_kv_new(gm, GS, 256);
    int32_t len[GS], next[GS];
    double worst = 0;
    int rows = 0, same = 0, ok = la && lb && ka && kb;
    uint64_t x = 777;
    for (int s = 0; s < GS && ok; s++) {
        int32_t t[64], p[64], sl[64];
        for (int i = 0; i < lens[s]; i++)
            t[i] = rand_tok(&x, (uint64_t)V), p[i] = i, sl[i] = s;
        m40_batch b = {.n = lens[s], .tokens = t, .pos = p, .slot = sl};
        ok = m40_model_forward(plain, ka, &b, la, err, sizeof err) == 0 &&
             m40_model_forward(gm, kb, &b, lb, err, sizeof err) == 0;
        CHECK(ok, "prefill: %s", err);
        len[s] = lens[s];
        next[s] = 0;
        for (int32_t i = 1; i < V; i++)
            if (la[i] > la[next[s]])
                next[s] = i;
    }
    for (int t = 0; t < GSTEPS + 12 && ok; t++) {
        if (t == GSTEPS) { /* a new pool for the graph model; every slot restarts at position 0 in both */
            m40_kv_free(kb);
            kb = m40_kv_new(gm, GS, 256);
            ok = kb != NULL;
            for (int s = 0; s < GS && ok; s++) {
                int32_t tk = next[s], p0 = 0, sl = s;
                m40_batch b = {.n = 1, .tokens = &tk, .pos = &p0, .slot = &sl};
                ok = m40_model_forward(plain, ka, &b, la, err, sizeof err) == 0 &&
                     m40_model_forward(gm, kb, &b, lb, err, sizeof err) == 0;
                len[s] = 1;
            }
            CHECK(ok, "new pool: %s", err);
            continue;
        }
        int32_t tk[GS], ps[GS], sl[GS], n = 0;
        for (int s = 0; s < GS; s++)
            if (t % 5 != 4 || s == t % 3)
                tk[n] = next[s], ps[n] = len[s], sl[n] = s, n++;
        uint8_t want[GS] = {1, 1, 1};
        m40_batch b = {.n = n, .tokens = tk, .pos = ps, .slot = sl, .want_logits = want};
        ok = m40_model_forward(plain, ka, &b, la, err, sizeof err) == 0 &&
             m40_model_forward(gm, kb, &b, lb, err, sizeof err) == 0;
        CHECK(ok, "decode step %d (%d sequences): %s", t, (int)n, err);
        for (int j = 0; j < n && ok; j++) {
            const float *a = la + (size_t)j * V, *c = lb + (size_t)j * V;
            double d = max_logprob_diff(a, c, V);
            worst = d > worst ? d : worst;
            same += memcmp(a, c, (size_t)V * sizeof *a) == 0;
            rows++;
            int32_t best = 0;
            for (int32_t i = 1; i < V; i++)
                if (a[i] > a[best])
                    best = i;
            next[sl[j]] = best;
            len[sl[j]]++;
        }
    }
    int64_t cap = 0, launched = 0, cap0 = 0, launched0 = 0;
    m40_model_graph_stats(gm, &cap, &launched);
    m40_model_graph_stats(plain, &cap0, &launched0);
    printf("cuda graphs %-40s %d decode rows, %d bit-identical, max |dlogprob| %.3g; %lld graphs, %lld launches\n",
           strrchr(path, '/') + 1, rows, same, worst, (long long)cap, (long long)launched);
    CHECK(rows >= 3 * (GSTEPS * 4 / 5), "only %d decode rows compared", rows);
    CHECK(worst <= 1e-4, "%s: graph steps differ from plain launches by %g", path, worst);
    CHECK(cap0 == 0 && launched0 == 0, "M40_CUDA_GRAPHS=0 still captured %lld graphs", (long long)cap0);
    /* Graphs are taken only where decode attention has its tuned kernels (head_dim 64,
     * 128 or 256, at most 8 query heads a KV head: step_plan.c); elsewhere (the tiny MoE
     * files' head_dim 32) the steps must still agree above, and no graph is expected. */
    const m40_model_params *mp = m40_model_get_params(plain);
    const int hd = mp->head_dim, grp = mp->n_heads / mp->n_kv_heads;
    if ((hd == 64 || hd == 128 || hd == 256) && grp >= 1 && grp <= 8)
        CHECK(cap >= 2 && launched >= GSTEPS / 2, "graphs: %lld captured, %lld launched of %d steps", (long long)cap,
              (long long)launched, GSTEPS);
    else
        printf("cuda graphs %s: head_dim %d, %d query heads a KV head: no tuned decode attention, no graphs expected\n",
               strrchr(path, '/') + 1, hd, grp);
    m40_kv_free(ka);
    m40_kv_free(kb);
    free(la);
    free(lb);
    m40_model_free(plain);
    m40_model_free(gm);
}

/* ---------- 5. Gemma 3 ---------- */

enum { G3_DIM = 64, G3_HEADS = 4, G3_KV = 1, G3_FFN = 96, G3_LAYERS = 4, G3_WINDOW = 40, G3_SEQ = 150,
       G3_VOCAB = 300 };

static uint64_t g3_rng = 0x9e3779b97f4a7c15ull;
static float g3_frand(void) /* uniform in [-1, 1) */
{
    g3_rng ^= g3_rng << 13;
    g3_rng ^= g3_rng >> 7;
    g3_rng ^= g3_rng << 17;
    return (float)((g3_rng >> 11) * (1.0 / 9007199254740992.0)) * 2.0f - 1.0f;
}

static uint32_t g3_qtype = M40_TYPE_F32; /* type of the layers' matrices */

static void g3_add(m40_gguf_writer *wr, const char *name, uint64_t cols, uint64_t rows, float center, float spread)
{
    float *v = malloc(cols * rows * sizeof *v);
    for (uint64_t i = 0; i < cols * rows; i++)
        v[i] = center + spread * g3_frand();
    uint64_t ne[2] = {cols, rows}, row_bytes;
    if (rows > 1 && g3_qtype != M40_TYPE_F32 && strncmp(name, "blk.", 4) == 0 &&
        m40_type_nbytes(g3_qtype, cols, &row_bytes) == 0) {
        uint8_t *q = malloc(row_bytes * rows);
        for (uint64_t r = 0; r < rows; r++)
            m40_quantize_row(g3_qtype, v + r * cols, q + r * row_bytes, (int64_t)cols);
        m40_gguf_writer_add_tensor(wr, name, g3_qtype, 2, ne, q, row_bytes * rows);
        free(q);
    } else {
        m40_gguf_writer_add_tensor(wr, name, M40_TYPE_F32, rows > 1 ? 2 : 1, ne, v, cols * rows * sizeof(float));
    }
    free(v);
}

/* A tiny gemma3 GGUF: layers 0, 2 local (pattern period 2), 1, 3 global. window 0: a
 * window longer than the prompt (the same weights: the RNG is reseeded). */
static int g3_write(const char *path, int hd, int window, int scaled, float softcap)
{
    g3_rng = 0x9e3779b97f4a7c15ull + (uint64_t)hd;
    m40_gguf_writer *wr = m40_gguf_writer_new();
    m40_gguf_writer_set_str(wr, "general.architecture", "gemma3");
    m40_gguf_writer_set_str(wr, "general.name", "tiny gemma3 gpu test");
    m40_gguf_writer_set_u32(wr, "gemma3.context_length", 1024);
    m40_gguf_writer_set_u32(wr, "gemma3.embedding_length", G3_DIM);
    m40_gguf_writer_set_u32(wr, "gemma3.block_count", G3_LAYERS);
    m40_gguf_writer_set_u32(wr, "gemma3.feed_forward_length", G3_FFN);
    m40_gguf_writer_set_u32(wr, "gemma3.attention.head_count", G3_HEADS);
    m40_gguf_writer_set_u32(wr, "gemma3.attention.head_count_kv", G3_KV);
    m40_gguf_writer_set_u32(wr, "gemma3.attention.key_length", (uint32_t)hd);
    m40_gguf_writer_set_u32(wr, "gemma3.attention.value_length", (uint32_t)hd);
    m40_gguf_writer_set_u32(wr, "gemma3.attention.sliding_window", window > 0 ? (uint32_t)window : 100000);
    m40_gguf_writer_set_u32(wr, "gemma3.attention.sliding_window_pattern", 2);
    m40_gguf_writer_set_f32(wr, "gemma3.attention.layer_norm_rms_epsilon", 1e-6f);
    m40_gguf_writer_set_f32(wr, "gemma3.rope.freq_base", 1000000.0f);
    if (scaled) {
        m40_gguf_writer_set_str(wr, "gemma3.rope.scaling.type", "linear");
        m40_gguf_writer_set_f32(wr, "gemma3.rope.scaling.factor", 8.0f);
    }
    if (softcap > 0)
        m40_gguf_writer_set_f32(wr, "gemma3.final_logit_softcapping", softcap);
    /* vocabulary: <unk> <s> </s>, byte tokens, then filler pieces */
    char **toks = malloc(G3_VOCAB * sizeof *toks);
    float *scores = malloc(G3_VOCAB * sizeof *scores);
    int32_t *types = malloc(G3_VOCAB * sizeof *types);
    for (int i = 0; i < G3_VOCAB; i++) {
        toks[i] = malloc(16);
        if (i < 3)
            snprintf(toks[i], 16, "%s", i == 0 ? "<unk>" : i == 1 ? "<s>" : "</s>");
        else if (i < 259)
            snprintf(toks[i], 16, "<0x%02X>", i - 3);
        else
            snprintf(toks[i], 16, "\xe2\x96\x81w%d", i);
        types[i] = i == 0 ? 2 : i < 3 ? 3 : i < 259 ? 6 : 1;
        scores[i] = i < 259 ? 0.0f : -(float)(i - 259);
    }
    m40_gguf_writer_set_str(wr, "tokenizer.ggml.model", "llama");
    m40_gguf_writer_set_arr_str(wr, "tokenizer.ggml.tokens", (const char *const *)toks, G3_VOCAB);
    m40_gguf_writer_set_arr_f32(wr, "tokenizer.ggml.scores", scores, G3_VOCAB);
    m40_gguf_writer_set_arr_i32(wr, "tokenizer.ggml.token_type", types, G3_VOCAB);
    m40_gguf_writer_set_u32(wr, "tokenizer.ggml.unknown_token_id", 0);
    m40_gguf_writer_set_u32(wr, "tokenizer.ggml.bos_token_id", 1);
    m40_gguf_writer_set_u32(wr, "tokenizer.ggml.eos_token_id", 2);
    for (int i = 0; i < G3_VOCAB; i++)
        free(toks[i]);
    free(toks);
    free(scores);
    free(types);
    g3_add(wr, "token_embd.weight", G3_DIM, G3_VOCAB, 0, 0.5f);
    g3_add(wr, "output_norm.weight", G3_DIM, 1, 1, 0.3f);
    for (int l = 0; l < G3_LAYERS; l++) {
        char n[64];
#define T(s, cols, rows, c, sp) (snprintf(n, sizeof n, "blk.%d.%s", l, s), g3_add(wr, n, cols, rows, c, sp))
        T("attn_norm.weight", G3_DIM, 1, 1, 0.3f);
        T("attn_q_norm.weight", (uint64_t)hd, 1, 1, 0.3f);
        T("attn_k_norm.weight", (uint64_t)hd, 1, 1, 0.3f);
        T("post_attention_norm.weight", G3_DIM, 1, 1, 0.3f);
        T("ffn_norm.weight", G3_DIM, 1, 1, 0.3f);
        T("post_ffw_norm.weight", G3_DIM, 1, 1, 0.3f);
        T("attn_q.weight", G3_DIM, (uint64_t)G3_HEADS * hd, 0, 0.4f);
        T("attn_k.weight", G3_DIM, (uint64_t)G3_KV * hd, 0, 0.4f);
        T("attn_v.weight", G3_DIM, (uint64_t)G3_KV * hd, 0, 0.4f);
        T("attn_output.weight", (uint64_t)G3_HEADS * hd, G3_DIM, 0, 0.3f);
        T("ffn_gate.weight", G3_DIM, G3_FFN, 0, 0.4f);
        T("ffn_up.weight", G3_DIM, G3_FFN, 0, 0.4f);
        T("ffn_down.weight", G3_FFN, G3_DIM, 0, 0.3f);
#undef T
    }
    char err[256];
    int rc = m40_gguf_writer_write_file(wr, path, err, sizeof err);
    m40_gguf_writer_free(wr);
    if (rc)
        fprintf(stderr, "%s: %s\n", path, err);
    return rc;
}

/* Teacher-forced logits of toks[0..n) on a fresh slot: prefill `first` tokens in one
 * call (every row's logits), then one token per call. */
static int g3_logits(m40_model *m, const int32_t *toks, int n, int first, float *out)
{
    char err[512];
    int32_t V = m40_model_get_params(m)->n_vocab;
    m40_kv *kv = m40_kv_new(m, 1, 512);
    int32_t pos[G3_SEQ], slot[G3_SEQ] = {0};
    uint8_t want[G3_SEQ];
    for (int i = 0; i < n; i++)
        pos[i] = i, want[i] = 1;
    int rc = 0;
    m40_batch b = {.n = first, .tokens = toks, .pos = pos, .slot = slot, .want_logits = want};
    if (!kv || m40_model_forward(m, kv, &b, out, err, sizeof err)) {
        CHECK(0, "gemma3 prefill: %s", kv ? err : "no KV cache");
        rc = -1;
    }
    for (int i = first; rc == 0 && i < n; i++) {
        m40_batch d = {.n = 1, .tokens = toks + i, .pos = pos + i, .slot = slot};
        if (m40_model_forward(m, kv, &d, out + (size_t)i * V, err, sizeof err)) {
            CHECK(0, "gemma3 decode at %d: %s", i, err);
            rc = -1;
        }
    }
    m40_kv_free(kv);
    return rc;
}

static void test_gemma3_synthetic(int hd, int scaled, float softcap, uint32_t qtype)
{
    g3_qtype = qtype;
    char path[] = "/tmp/m40-gpu-gemma3-XXXXXX", path_nowin[] = "/tmp/m40-gpu-gemma3-nowin-XXXXXX", err[512];
    int fd = mkstemp(path), fd2 = mkstemp(path_nowin);
    if (fd < 0 || fd2 < 0) {
        CHECK(0, "mkstemp");
        return;
    }
    close(fd);
    close(fd2);
    if (g3_write(path, hd, G3_WINDOW, scaled, softcap) || g3_write(path_nowin, hd, 0, scaled, softcap)) {
        CHECK(0, "cannot write the gemma3 test model");
        return;
    }
    m40_model *cpu = NULL, *gpu = NULL, *cpu_nowin = NULL;
    m40_model_options oc = {.n_threads = 2, .device = -1}, og = {.n_threads = 2, .device = 0};
    if (m40_model_load_opts(path, &oc, &cpu, err, sizeof err) || m40_model_load_opts(path, &og, &gpu, err, sizeof err) ||
        m40_model_load_opts(path_nowin, &oc, &cpu_nowin, err, sizeof err)) {
        CHECK(0, "gemma3 load: %s", err);
        goto out;
    }
    int32_t toks[G3_SEQ];
    uint64_t x = 777;
    for (int i = 0; i < G3_SEQ; i++)
        toks[i] = 3 + rand_tok(&x, G3_VOCAB - 3);
    const size_t V = G3_VOCAB;
    float *lc = malloc(G3_SEQ * V * sizeof(float)), *lg = malloc(G3_SEQ * V * sizeof(float)),
          *lg2 = malloc(G3_SEQ * V * sizeof(float)), *lnw = malloc(G3_SEQ * V * sizeof(float));
    if (g3_logits(cpu, toks, G3_SEQ, G3_SEQ, lc) == 0 && g3_logits(gpu, toks, G3_SEQ, G3_SEQ, lg) == 0 &&
        g3_logits(gpu, toks, G3_SEQ, 50, lg2) == 0 && g3_logits(cpu_nowin, toks, G3_SEQ, G3_SEQ, lnw) == 0) {
        double w_pre = 0, w_dec = 0, w_nowin = 0;
        for (int i = 0; i < G3_SEQ; i++) {
            double a = max_logprob_diff(lg + i * V, lc + i * V, (int32_t)V);
            double b = max_logprob_diff(lg2 + i * V, lc + i * V, (int32_t)V);
            double c = max_logprob_diff(lnw + i * V, lc + i * V, (int32_t)V);
            w_pre = a > w_pre ? a : w_pre;
            w_dec = b > w_dec ? b : w_dec;
            w_nowin = c > w_nowin ? c : w_nowin;
        }
        printf("gemma3 tiny %s hd %d%s%s, %d tokens, window %d: gpu vs cpu max |dlogprob| %.3g (prefill), %.3g "
               "(prefill 50 + decode); cpu without the window differs by %.3g\n",
               m40_type_name(qtype), hd, scaled ? " linear-rope" : "", softcap > 0 ? " softcap" : "", G3_SEQ,
               G3_WINDOW, w_pre, w_dec, w_nowin);
        CHECK(w_pre <= 5e-2, "gemma3 hd %d: GPU prefill differs from the CPU by %g", hd, w_pre);
        CHECK(w_dec <= 5e-2, "gemma3 hd %d: GPU decode differs from the CPU by %g", hd, w_dec);
        CHECK(w_nowin > 0.2, "gemma3 hd %d: the window does not matter in this test (%g)", hd, w_nowin);
    }
    free(lc);
    free(lg);
    free(lg2);
    free(lnw);
out:
    m40_model_free(cpu);
    m40_model_free(gpu);
    m40_model_free(cpu_nowin);
    unlink(path);
    unlink(path_nowin);
}

/* A llama-shaped model (mkmodel's tiny, F16) with the F16 tiled path forced (M40_GEMM=f16)
 * through a 150-token prefill: the prompt-chunk paths that only models past 1B parameters
 * take otherwise (the residual added by cuBLAS itself, the gate/up product and the
 * attention's output in F16: M40_FUSE_RESIDUAL, M40_PREFILL_F16), against the CPU's F32
 * logits, and with those paths turned off. */
static void test_tiny_tiled(void)
{
    char path[64], err[512];
    snprintf(path, sizeof path, "/tmp/m40-gpu-tiny-f16-%d.gguf", (int)getpid());
    m40_mkmodel_opts o = {.shape = m40_mkmodel_find_shape("tiny"), .seed = 11, .n_threads = 2};
    if (!o.shape || m40_mkmodel_parse_type("F16", &o.ftype) || m40_mkmodel_write(&o, path, NULL, err, sizeof err)) {
        CHECK(0, "mkmodel tiny F16: %s", err);
        return;
    }
    m40_model *cpu = NULL, *on = NULL, *off = NULL;
    m40_model_options oc = {.n_threads = 2, .device = -1}, og = {.n_threads = 2, .device = 0};
    setenv("M40_GEMM", "f16", 1);
    int rc = m40_model_load_opts(path, &oc, &cpu, err, sizeof err) || m40_model_load_opts(path, &og, &on, err, sizeof err);
    setenv("M40_FUSE_RESIDUAL", "0", 1);
    setenv("M40_PREFILL_F16", "0", 1);
    rc = rc || m40_model_load_opts(path, &og, &off, err, sizeof err);
    unsetenv("M40_FUSE_RESIDUAL");
    unsetenv("M40_PREFILL_F16");
    unsetenv("M40_GEMM");
    if (rc) {
        CHECK(0, "tiny F16 load: %s", err);
        goto out;
    }
    {
        const int32_t V = m40_model_get_params(cpu)->n_vocab;
        int32_t toks[G3_SEQ];
        uint64_t x = 4242;
        for (int i = 0; i < G3_SEQ; i++)
            toks[i] = 3 + rand_tok(&x, (uint64_t)(V - 3));
        float *lc = malloc((size_t)G3_SEQ * V * sizeof(float)), *ln = malloc((size_t)G3_SEQ * V * sizeof(float)),
              *lf = malloc((size_t)G3_SEQ * V * sizeof(float)), *ld = malloc((size_t)G3_SEQ * V * sizeof(float));
        if (lc && ln && lf && ld && g3_logits(cpu, toks, G3_SEQ, G3_SEQ, lc) == 0 &&
            g3_logits(on, toks, G3_SEQ, G3_SEQ, ln) == 0 && g3_logits(off, toks, G3_SEQ, G3_SEQ, lf) == 0 &&
            g3_logits(on, toks, G3_SEQ, 50, ld) == 0) {
            double w_on = 0, w_off = 0, w_dec = 0;
            for (int i = 0; i < G3_SEQ; i++) {
                const double a = max_logprob_diff(ln + (size_t)i * V, lc + (size_t)i * V, V);
                const double b = max_logprob_diff(lf + (size_t)i * V, lc + (size_t)i * V, V);
                const double c = max_logprob_diff(ld + (size_t)i * V, lc + (size_t)i * V, V);
                w_on = a > w_on ? a : w_on;
                w_off = b > w_off ? b : w_off;
                w_dec = c > w_dec ? c : w_dec;
            }
            printf("tiny F16, M40_GEMM=f16, %d tokens: gpu vs cpu max |dlogprob| %.3g (prefill), %.3g (the fused "
                   "residual and F16 outputs off), %.3g (prefill 50 + decode)\n",
                   G3_SEQ, w_on, w_off, w_dec);
            CHECK(w_on <= 5e-2, "tiny F16 tiled prefill differs from the CPU by %g", w_on);
            CHECK(w_off <= 5e-2, "tiny F16 tiled prefill (paths off) differs from the CPU by %g", w_off);
            CHECK(w_dec <= 5e-2, "tiny F16 decode differs from the CPU by %g", w_dec);
        }
        free(lc);
        free(ln);
        free(lf);
        free(ld);
    }
out:
    m40_model_free(cpu);
    m40_model_free(on);
    m40_model_free(off);
    /* batched == alone through the same paths (the batched prefill: 68 interleaved rows) */
    setenv("M40_GEMM", "f16", 1);
    printf("tiny F16, M40_GEMM=f16:\n");
    test_batched(path);
    unsetenv("M40_GEMM");
    unlink(path);
}

/* The real Gemma 3 270M against its NumPy reference (scripts/fetch-gemma3.sh). */
static void test_gemma3_real(void)
{
    const char *model = "models-cache/gemma-3-270m-q4_k_m.gguf", *ref_path = "models-cache/gemma-3-270m-q4_k_m.ref.json";
    if (access(model, R_OK) || access(ref_path, R_OK)) {
        SKIP("%s or its reference is absent (scripts/fetch-gemma3.sh)", model);
        return;
    }
    eval_against_ref(model, ref_path, "gemma-3-270m-q4_k_m");
}

/* ---------- 3, 4. the engine ---------- */


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
    if (access(path, R_OK)) {
        SKIP("%s is absent", path);
        return;
    }
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

    /* Plain greedy requests (no logit bias): every step's tokens are picked on the device. */
    static job g1[6], g6[6];
    for (int i = 0; i < 6; i++) {
        m40_request_params p;
        params(&p, prompts[i], GEN);
        p.sampling.n_logit_bias = 0;
        job *one[1] = {&g1[i]};
        CHECK(m40_engine_submit(e, &p, &g1[i], &g1[i].req, err, sizeof err) == M40_SUBMIT_OK, "submit: %s", err);
        CHECK(pump(e, one, 1, 60) == 0, "greedy request %d did not finish", i);
    }
    for (int i = 0; i < 6; i++) {
        m40_request_params p;
        params(&p, prompts[i], GEN);
        p.sampling.n_logit_bias = 0;
        js[i] = &g6[i];
        CHECK(m40_engine_submit(e, &p, &g6[i], &g6[i].req, err, sizeof err) == M40_SUBMIT_OK, "submit: %s", err);
    }
    CHECK(pump(e, js, 6, 120) == 0, "concurrent greedy requests did not finish");
    for (int i = 0; i < 6; i++) {
        CHECK(g6[i].completion_tokens > 0 && strcmp(g6[i].text, g1[i].text) == 0,
              "device-picked greedy %d: concurrent differs from alone:\n  [%s]\n  [%s] %s", i, g6[i].text, g1[i].text,
              g6[i].err_msg);
        m40_request_release(g1[i].req);
        m40_request_release(g6[i].req);
    }
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
    settle_stats(e, &st);
    CHECK(st.running == 0, "running %d", (int)st.running);
    m40_engine_destroy(e);
}

/* ---------- 6. automatic prefix caching ---------- */

/* path loaded on the CPU for its tokenizer (the engine tests' prompts), the end-of-text
 * token banned by params(); NULL after a SKIP (absent) or a failed CHECK. */
static m40_model *tokens_model(const char *path)
{
    char err[512];
    m40_model *m = NULL;
    if (access(path, R_OK)) {
        SKIP("%s is absent", path);
        return NULL;
    }
    if (m40_model_load(path, 1, &m, err, sizeof err) != 0) {
        CHECK(0, "%s: %s", path, err);
        return NULL;
    }
    ban_ids[0] = m40_tokenizer_eos(m40_model_tokenizer(m));
    return m;
}

#define PC_N 8
#define PC_GEN 24

static m40_engine *pc_start_as(const char *path, int max_seqs, int chunk, const char *kv_blocks, int cache,
                               int invariant)
{
    if (kv_blocks)
        setenv("M40_KV_BLOCKS", kv_blocks, 1);
    if (!cache)
        setenv("M40_PREFIX_CACHE", "0", 1);
    m40_engine_config cfg = {.model_path = path, .model_name = "t", .device = 0, .ctx_size = 512,
                             .max_seqs = max_seqs, .max_queue = 32, .n_threads = 2, .prefill_chunk = chunk,
                             .batch_invariant = invariant};
    m40_engine *e = NULL;
    char err[512];
    int rc = m40_engine_create(&cfg, &e, err, sizeof err);
    m40_engine_state st = M40_ENGINE_FAILED;
    if (rc == 0) {
        double end = now_s() + 60;
        while ((st = m40_engine_get_state(e, err, sizeof err)) == M40_ENGINE_LOADING && now_s() < end)
            usleep(5000);
    }
    /* the pool reads both variables when the engine thread loads the model: unset after */
    unsetenv("M40_KV_BLOCKS");
    unsetenv("M40_PREFIX_CACHE");
    CHECK(rc == 0 && st == M40_ENGINE_READY, "engine create/ready: %s", err);
    if (rc == 0 && st != M40_ENGINE_READY) {
        m40_engine_destroy(e);
        e = NULL;
    }
    return rc == 0 ? e : NULL;
}

static m40_engine *pc_start(const char *path, int max_seqs, int chunk, const char *kv_blocks, int cache)
{
    return pc_start_as(path, max_seqs, chunk, kv_blocks, cache, 0);
}

/* Stats once the engine thread has published the step that finished the last request. */
/* Submits the PC_N prompts at once and waits for all; 0 when every one finished. */
static int pc_run(m40_engine *e, char prompts_[PC_N][2048], job *jobs)
{
    char err[512];
    job *js[PC_N];
    memset(jobs, 0, PC_N * sizeof *jobs);
    for (int i = 0; i < PC_N; i++) {
        m40_request_params p;
        params(&p, prompts_[i], PC_GEN);
        js[i] = &jobs[i];
        CHECK(m40_engine_submit(e, &p, &jobs[i], &jobs[i].req, err, sizeof err) == M40_SUBMIT_OK, "submit: %s", err);
    }
    int rc = pump(e, js, PC_N, 180);
    for (int i = 0; i < PC_N; i++)
        m40_request_release(jobs[i].req);
    return rc;
}

/* Like pc_run, but the odd requests are released (cancelled) as soon as they have
 * produced some text, in the middle of their decoding. */
static int pc_run_cancel(m40_engine *e, char prompts_[PC_N][2048], job *jobs)
{
    char err[512];
    memset(jobs, 0, PC_N * sizeof *jobs);
    for (int i = 0; i < PC_N; i++) {
        m40_request_params p;
        params(&p, prompts_[i], PC_GEN);
        CHECK(m40_engine_submit(e, &p, &jobs[i], &jobs[i].req, err, sizeof err) == M40_SUBMIT_OK, "submit: %s", err);
    }
    double end = now_s() + 180;
    int released[PC_N] = {0};
    for (;;) {
        int open = 0;
        for (int i = 0; i < PC_N; i++) {
            if (i % 2 == 1 && !released[i] && (jobs[i].len > 0 || jobs[i].done)) {
                m40_request_release(jobs[i].req);
                released[i] = 1;
            }
            open += !released[i] && !jobs[i].done;
        }
        if (!open || now_s() > end)
            break;
        pump_once(e);
    }
    int rc = 0;
    for (int i = 0; i < PC_N; i++) {
        if (!released[i]) {
            rc |= !jobs[i].done;
            m40_request_release(jobs[i].req);
        }
    }
    return rc ? -1 : 0;
}

/* Eight requests sharing a ~200-token prefix with distinct suffixes, all at once:
 *   - with caching off (M40_PREFIX_CACHE=0) every prompt token is computed;
 *   - with it on, the texts are the same and the prompt tokens computed are at most the
 *     shared prefix once, plus the suffixes, plus one block (16) per request; sent again,
 *     the same requests compute at most one block each (finished sequences' blocks
 *     stay cached);
 *   - under a pool far too small (M40_KV_BLOCKS=24: preemption while sharing blocks),
 *     the texts are still the same and the pool ends consistent (nothing running). */
static void test_prefix_cache(const char *path)
{
    char err[512];
    m40_model *m = tokens_model(path);
    if (!m)
        return;
    const m40_tokenizer *tok = m40_model_tokenizer(m);
    static char pr[PC_N][2048];
    static int32_t ids[PC_N][1024];
    static const char *sentences[] = {"Once upon a time there was a little girl named Lily. ",
                                      "She liked to play in the park with her red ball. ",
                                      "One day she saw a big dog near the old tree. ",
                                      "The dog was friendly and wanted to play too. "};
    static const char *suffixes[PC_N] = {"Then the sun", "Tom came and said", "The bird sang",
                                         "Lily was sad because", "Mom made a cake for",
                                         "They ran to the river and", "A cat jumped", "At night the stars"};
    /* a prefix of at least 200 tokens */
    char prefix[1536] = "";
    int64_t np = 0;
    for (int k = 0; np < 200 && strlen(prefix) + 64 < sizeof prefix; k++) {
        strcat(prefix, sentences[k % 4]);
        np = m40_tokenize(tok, prefix, strlen(prefix), m40_tokenizer_add_bos(tok), 0, ids[0], 1024, err, sizeof err);
    }
    int64_t n[PC_N], lcp = 1 << 30, sum_n = 0;
    for (int i = 0; i < PC_N; i++) {
        snprintf(pr[i], sizeof pr[i], "%s%s", prefix, suffixes[i]);
        n[i] = m40_tokenize(tok, pr[i], strlen(pr[i]), m40_tokenizer_add_bos(tok), 0, ids[i], 1024, err, sizeof err);
        sum_n += n[i];
    }
    for (int i = 1; i < PC_N; i++) {
        int64_t l = 0;
        while (l < n[0] && l < n[i] && ids[0][l] == ids[i][l])
            l++;
        if (l < lcp)
            lcp = l;
    }
    m40_model_free(m);
    CHECK(np >= 200 && lcp >= 190 && n[0] + PC_GEN < 512, "prefix %lld tokens, shared %lld, prompt %lld", (long long)np,
          (long long)lcp, (long long)n[0]);
    /* the target: the shared prefix once, the suffixes, one block per request */
    const int64_t bound = lcp + (sum_n - PC_N * lcp) + 16 * PC_N;

    static job off[PC_N], on[PC_N], again[PC_N], tight[PC_N];
    m40_engine_stats st0, st1, st2;
    m40_engine *e = pc_start(path, PC_N, 512, NULL, 0);
    if (!e)
        return;
    CHECK(pc_run(e, pr, off) == 0, "requests without the prefix cache did not finish");
    settle_stats(e, &st0);
    CHECK(st0.prompt_tokens_computed == (uint64_t)sum_n && st0.prefix_cache_hit_tokens == 0,
          "no cache: %llu computed of %lld, %llu hits", (unsigned long long)st0.prompt_tokens_computed,
          (long long)sum_n, (unsigned long long)st0.prefix_cache_hit_tokens);
    m40_engine_destroy(e);

    e = pc_start(path, PC_N, 512, NULL, 1);
    if (!e)
        return;
    CHECK(pc_run(e, pr, on) == 0, "requests with the prefix cache did not finish");
    settle_stats(e, &st1);
    int same = 0;
    for (int i = 0; i < PC_N; i++) {
        CHECK(off[i].finish == M40_FINISH_LENGTH && off[i].completion_tokens == PC_GEN, "no cache %d: finish %d %s",
              i, off[i].finish, off[i].err_msg);
        same += on[i].finish == M40_FINISH_LENGTH && strcmp(on[i].text, off[i].text) == 0;
        CHECK(on[i].finish == M40_FINISH_LENGTH && strcmp(on[i].text, off[i].text) == 0,
              "prefix cache %d: finish %d (%s), text:\n  [%s]\n  [%s]", i, on[i].finish, on[i].err_msg, on[i].text,
              off[i].text);
    }
    printf("prefix cache %s: %d/%d texts equal to uncached; prompt tokens computed %llu of %lld "
           "(bound %lld, shared prefix %lld), %llu queries, %llu/%llu tokens hit\n",
           strrchr(path, '/') + 1, same, PC_N, (unsigned long long)st1.prompt_tokens_computed, (long long)sum_n,
           (long long)bound, (long long)lcp, (unsigned long long)st1.prefix_cache_queries,
           (unsigned long long)st1.prefix_cache_hit_tokens, (unsigned long long)st1.prefix_cache_query_tokens);
    CHECK(st1.prompt_tokens_computed <= (uint64_t)bound, "computed %llu > bound %lld",
          (unsigned long long)st1.prompt_tokens_computed, (long long)bound);
    CHECK(st1.prompt_tokens_computed + st1.prefix_cache_hit_tokens == (uint64_t)sum_n,
          "computed %llu + hit %llu != prompt tokens %lld", (unsigned long long)st1.prompt_tokens_computed,
          (unsigned long long)st1.prefix_cache_hit_tokens, (long long)sum_n);
    CHECK(st1.prefix_cache_queries >= PC_N && st1.prefix_cache_hit_tokens <= st1.prefix_cache_query_tokens,
          "queries %llu", (unsigned long long)st1.prefix_cache_queries);
    /* usage's cached_tokens: each request's hit (no preemption here), none without the cache */
    int64_t cached_on = 0, cached_off = 0;
    for (int i = 0; i < PC_N; i++)
        cached_on += on[i].cached_tokens, cached_off += off[i].cached_tokens;
    CHECK(cached_off == 0 && cached_on == (int64_t)st1.prefix_cache_hit_tokens,
          "usage: %lld cached tokens with the cache (%llu hit), %lld without", (long long)cached_on,
          (unsigned long long)st1.prefix_cache_hit_tokens, (long long)cached_off);

    /* The same requests again: every full block of each prompt is cached by now. */
    CHECK(pc_run(e, pr, again) == 0, "repeated requests did not finish");
    settle_stats(e, &st2);
    uint64_t delta = st2.prompt_tokens_computed - st1.prompt_tokens_computed;
    for (int i = 0; i < PC_N; i++)
        CHECK(again[i].finish == M40_FINISH_LENGTH && strcmp(again[i].text, off[i].text) == 0,
              "repeated %d: finish %d (%s), text:\n  [%s]\n  [%s]", i, again[i].finish, again[i].err_msg,
              again[i].text, off[i].text);
    printf("prefix cache %s, same requests again: %llu prompt tokens computed\n", strrchr(path, '/') + 1,
           (unsigned long long)delta);
    CHECK(delta <= 16 * PC_N, "repeated requests computed %llu prompt tokens", (unsigned long long)delta);
    CHECK(st2.running == 0 && st2.kv_tokens_used == 0, "running %d", (int)st2.running);
    m40_engine_destroy(e);

    /* 24 blocks (384 tokens) for 8 sequences of ~240 tokens sharing ~12 blocks:
     * preemption while blocks are shared, recompute from the cache. */
    e = pc_start(path, PC_N, 512, "24", 1);
    if (!e)
        return;
    CHECK(pc_run(e, pr, tight) == 0, "requests under a tight pool with the prefix cache did not finish");
    same = 0;
    for (int i = 0; i < PC_N; i++) {
        same += tight[i].finish == M40_FINISH_LENGTH && strcmp(tight[i].text, off[i].text) == 0;
        CHECK(tight[i].finish == M40_FINISH_LENGTH && strcmp(tight[i].text, off[i].text) == 0,
              "tight pool, prefix cache %d: finish %d status %d (%s), text:\n  [%s]\n  [%s]", i, tight[i].finish,
              tight[i].err_status, tight[i].err_msg, tight[i].text, off[i].text);
    }
    m40_engine_stats st3;
    settle_stats(e, &st3);
    printf("prefix cache %s, 24-block pool: %d/%d texts equal to uncached, %llu prompt tokens computed, %llu hit\n",
           strrchr(path, '/') + 1, same, PC_N, (unsigned long long)st3.prompt_tokens_computed,
           (unsigned long long)st3.prefix_cache_hit_tokens);
    CHECK(st3.running == 0 && st3.kv_tokens_used == 0, "running %d", (int)st3.running);

    /* Cancellation mid-decode under the same pool: the requests left finish with the
     * same texts, then all eight once more (on blocks the cancelled ones left cached). */
    static job half[PC_N], after[PC_N];
    CHECK(pc_run_cancel(e, pr, half) == 0, "requests beside cancelled ones did not finish");
    for (int i = 0; i < PC_N; i += 2)
        CHECK(half[i].finish == M40_FINISH_LENGTH && strcmp(half[i].text, off[i].text) == 0,
              "beside cancelled ones %d: finish %d (%s), text:\n  [%s]\n  [%s]", i, half[i].finish, half[i].err_msg,
              half[i].text, off[i].text);
    CHECK(pc_run(e, pr, after) == 0, "requests after cancellations did not finish");
    same = 0;
    for (int i = 0; i < PC_N; i++) {
        same += after[i].finish == M40_FINISH_LENGTH && strcmp(after[i].text, off[i].text) == 0;
        CHECK(after[i].finish == M40_FINISH_LENGTH && strcmp(after[i].text, off[i].text) == 0,
              "after cancellations %d: finish %d (%s), text:\n  [%s]\n  [%s]", i, after[i].finish,
              after[i].err_msg, after[i].text, off[i].text);
    }
    settle_stats(e, &st3);
    printf("prefix cache %s, 24-block pool: 4 of 8 cancelled mid-decode, then %d/%d texts equal to uncached\n",
           strrchr(path, '/') + 1, same, PC_N);
    CHECK(st3.running == 0 && st3.kv_tokens_used == 0, "running %d, kv tokens used %lld", (int)st3.running,
          (long long)st3.kv_tokens_used);
    m40_engine_destroy(e);
}

/* 7. A tiny synthetic model of file type ft: batched vs alone with the GEMVs for every
 * product of up to 8 rows, then with the register kernel from 2 rows. */
static void test_small_batches_register(const char *ft)
{
    char path[64], err[512];
    snprintf(path, sizeof path, "/tmp/m40-gpu-tiny-%s-%d.gguf", ft, (int)getpid());
    m40_mkmodel_opts o = {.shape = m40_mkmodel_find_shape("tiny"), .seed = 7, .n_threads = 2};
    CHECK(o.shape && m40_mkmodel_parse_type(ft, &o.ftype) == 0, "mkmodel shape tiny / type %s", ft);
    if (!o.shape || m40_mkmodel_write(&o, path, NULL, err, sizeof err) != 0) {
        CHECK(0, "mkmodel tiny %s: %s", ft, err);
        return;
    }
    setenv("M40_GEMV_ROWS", "8", 1);
    printf("M40_GEMV_ROWS=8 (the GEMVs up to 8 rows):\n");
    test_batched(path);
    setenv("M40_GEMV_ROWS", "1", 1);
    printf("M40_GEMV_ROWS=1 (the register kernel from 2 rows):\n");
    test_batched(path);
    unsetenv("M40_GEMV_ROWS");
    unlink(path);
}

/* 8. Batch invariance (m40_model_options.batch_invariant): each sequence's logits, prefill
 * and every decode step, are the same bits alone and in batches of other shapes: its
 * prompt cut into two chunks beside other prompts, its decode rows beside prompt rows
 * and beside 2..4 other decode rows, in other row orders. */
#define BI_N 4     /* sequences: 0..2 compared, 3 only joins the batches */
#define BI_STEPS 5 /* greedy decode steps after the prompt */
static void test_batch_invariant(const char *path, const char *label)
{
    char err[512];
    m40_model *m = load_on_gpu_as(path, 1);
    if (!m)
        return;
    const int32_t V = m40_model_get_params(m)->n_vocab;
    const int32_t lens[BI_N] = {23, 5, 70, 37};
    int32_t toks[BI_N][80 + BI_STEPS];
    uint64_t x = 777;
    for (int s = 0; s < BI_N; s++)
        for (int i = 0; i < lens[s]; i++)
            toks[s][i] = rand_tok(&x, (uint64_t)V);
    const size_t per = (size_t)(BI_STEPS + 1) * V; /* a sequence's logits: prompt's last row, then each step */
    float *solo = malloc(3 * per * sizeof(float)), *bat = malloc(3 * per * sizeof(float));
    float *out = malloc((size_t)8 * V * sizeof(float));
    /* Alone: the prompt in one call, then greedy steps (their tokens appended to toks). */
    for (int s = 0; s < 3 && solo; s++) {
        m40_kv *kv = m40_kv_new(m, 1, 128);
        int32_t pos[128], slot[128] = {0};
        for (int i = 0; i < lens[s] + BI_STEPS; i++)
            pos[i] = i;
        m40_batch b = {.n = lens[s], .tokens = toks[s], .pos = pos, .slot = slot};
        CHECK(m40_model_forward(m, kv, &b, solo + s * per, err, sizeof err) == 0, "%s", err);
        for (int t = 0; t < BI_STEPS; t++) {
            const float *l = solo + s * per + (size_t)t * V;
            int32_t best = 0;
            for (int32_t i = 1; i < V; i++)
                if (l[i] > l[best])
                    best = i;
            toks[s][lens[s] + t] = best;
            m40_batch d = {.n = 1, .tokens = &toks[s][lens[s] + t], .pos = &pos[lens[s] + t], .slot = slot};
            CHECK(m40_model_forward(m, kv, &d, solo + s * per + (size_t)(t + 1) * V, err, sizeof err) == 0, "%s",
                  err);
        }
        m40_kv_free(kv);
    }
    for (int t = 0; t < BI_STEPS; t++) /* sequence 3's "generated" tokens: any */
        toks[3][lens[3] + t] = (toks[3][t] + 1) % V;
    /* Together. done[s]: tokens of s in the cache; step[s]: its logits rows written. */
    m40_kv *kv = m40_kv_new(m, BI_N, 128);
    int32_t done[BI_N] = {0}, step[BI_N] = {0};
    /* call c: how many tokens each sequence adds (0: none); a prompt may take several
     * calls, a decode row one token */
    static const int32_t plan[][BI_N] = {
        {10, 5, 33, 0}, /* 0: a first chunk, 1: its whole prompt, 2: a first chunk */
        {13, 1, 37, 0}, /* 0 and 2: the rest of their prompts beside 1's first decode row */
        {1, 1, 1, 37},  /* three decode rows beside a whole prompt (3) */
        {1, 1, 1, 1}, {1, 0, 1, 1}, {1, 1, 1, 0}, {1, 1, 0, 1}, {1, 1, 1, 1}, {0, 1, 1, 1}, {0, 0, 1, 0}};
    const int n_calls = (int)(sizeof plan / sizeof plan[0]);
    for (int c = 0; c < n_calls && bat; c++) {
        int32_t bt[256], bp[256], bs[256], n = 0, who[8];
        uint8_t bw[256];
        int n_out = 0;
        for (int k = 0; k < BI_N; k++) {
            const int s = (k + c) % BI_N; /* the sequences' order changes from call to call */
            const int32_t total = lens[s] + BI_STEPS;
            for (int32_t i = 0; i < plan[c][s] && done[s] < total; i++, n++) {
                bt[n] = toks[s][done[s]];
                bp[n] = done[s];
                bs[n] = s;
                done[s]++;
                bw[n] = done[s] >= lens[s] && i + 1 == plan[c][s]; /* the row that gives logits */
                if (bw[n])
                    who[n_out++] = s;
            }
        }
        if (n == 0) /* every sequence of the call done already */
            continue;
        m40_batch b = {.n = n, .tokens = bt, .pos = bp, .slot = bs, .want_logits = bw};
        const int rc = m40_model_forward(m, kv, &b, out, err, sizeof err);
        CHECK(rc == 0, "%s call %d: %s", label, c, err);
        if (rc)
            break;
        for (int j = 0; j < n_out; j++)
            if (who[j] < 3 && step[who[j]] <= BI_STEPS)
                memcpy(bat + who[j] * per + (size_t)step[who[j]]++ * V, out + (size_t)j * V, (size_t)V * 4);
    }
    int same = 0, rows = 0, first_s = -1, first_t = -1;
    for (int s = 0; s < 3 && bat && solo; s++) {
        CHECK(step[s] == BI_STEPS + 1, "%s: sequence %d got %d of %d logits rows", label, s, step[s], BI_STEPS + 1);
        for (int t = 0; t < step[s]; t++, rows++) {
            if (!memcmp(solo + s * per + (size_t)t * V, bat + s * per + (size_t)t * V, (size_t)V * 4)) {
                same++;
            } else {
                if (first_s < 0)
                    first_s = s, first_t = t;
                printf("  %s: sequence %d row %d differs (max |dlogprob| %.3g)\n", label, s, t,
                       max_logprob_diff(solo + s * per + (size_t)t * V, bat + s * per + (size_t)t * V, V));
            }
        }
    }
    printf("batch invariance %-28s %d of %d logits rows the same bits alone and batched\n", label, same, rows);
    CHECK(same == rows, "%s: %d of %d rows differ (first: sequence %d, row %d; max |dlogprob| there %.3g)", label,
          rows - same, rows, first_s, first_t,
          first_s < 0 ? 0.0
                      : max_logprob_diff(solo + first_s * per + (size_t)first_t * V,
                                         bat + first_s * per + (size_t)first_t * V, V));
    m40_kv_free(kv);
    free(solo);
    free(bat);
    free(out);
    m40_model_free(m);
}

/* 8b. Batch invariance with the prefix cache: a prompt computed in two chunks beside
 * another slot's rows, then greedy steps, against the same prompt in a second slot that
 * starts on the first one's cached blocks and computes only its tail: the logits, bit
 * for bit. */
static void test_batch_invariant_cached(const char *path, const char *label)
{
    char err[512];
    m40_model *m = load_on_gpu_as(path, 1);
    if (!m)
        return;
    enum { P = 45, OTHER = 30, NS = 5 }; /* prompt, the other slot's prompt, steps */
    const int32_t V = m40_model_get_params(m)->n_vocab;
    int32_t toks[P + NS], other[OTHER + NS + 1]; /* the other slot: its prompt, then a token a call */
    uint64_t x = 4242;
    for (int i = 0; i < P; i++)
        toks[i] = rand_tok(&x, (uint64_t)V);
    for (int i = 0; i < OTHER + NS + 1; i++)
        other[i] = rand_tok(&x, (uint64_t)V);
    float *first = malloc((size_t)(NS + 1) * V * 4), *again = malloc((size_t)(NS + 1) * V * 4),
          *out = malloc((size_t)4 * V * 4);
    m40_kv *kv = m40_kv_new(m, 3, 256);
    CHECK(kv && m40_kv_prefix_cache_enabled(kv), "%s: the prefix cache on under batch invariance", label);
    /* slot 0: the prompt in 28 + 17 tokens beside slot 2's prompt, then steps beside slot 2's */
    int32_t done = 0, odone = 0, t_out = 0;
    for (int c = 0; c < 2 + NS && kv && first && again && out; c++) {
        int32_t bt[96], bp[96], bs[96], n = 0;
        uint8_t bw[96];
        const int32_t mine = c == 0 ? 28 : c == 1 ? P - 28 : 1, theirs = c == 0 ? OTHER : 1;
        for (int32_t i = 0; i < theirs; i++, n++)
            bt[n] = other[odone], bp[n] = odone++, bs[n] = 2, bw[n] = 0;
        for (int32_t i = 0; i < mine; i++, n++) {
            bt[n] = toks[done], bp[n] = done++, bs[n] = 0, bw[n] = i + 1 == mine && done >= P;
        }
        if (m40_model_forward(m, kv, &(m40_batch){.n = n, .tokens = bt, .pos = bp, .slot = bs, .want_logits = bw}, out,
                              err, sizeof err)) {
            CHECK(0, "%s call %d: %s", label, c, err);
            break;
        }
        if (done >= P) {
            memcpy(first + (size_t)t_out * V, out, (size_t)V * 4);
            if (t_out < NS) { /* the greedy token, fed next */
                int32_t best = 0;
                for (int32_t i = 1; i < V; i++)
                    if (out[i] > out[best])
                        best = i;
                toks[P + t_out] = best;
            }
            t_out++;
        }
    }
    /* slot 1: the cached blocks of the prompt, its tail in one call, then the same tokens alone */
    const int32_t hit = kv ? m40_kv_slot_match_prefix(kv, 1, toks, P) : 0;
    CHECK(hit == 32, "%s: %d cached tokens of %d (want 32)", label, hit, P);
    int same = 0;
    for (int t = 0; t <= NS && kv && hit > 0; t++) {
        int32_t bt[64], bp[64], bs[64], n = 0;
        for (int32_t i = t == 0 ? hit : P + t - 1; i < (t == 0 ? P : P + t); i++, n++)
            bt[n] = toks[i], bp[n] = i, bs[n] = 1;
        if (m40_model_forward(m, kv, &(m40_batch){.n = n, .tokens = bt, .pos = bp, .slot = bs}, again + (size_t)t * V,
                              err, sizeof err)) {
            CHECK(0, "%s alone %d: %s", label, t, err);
            break;
        }
        if (!memcmp(again + (size_t)t * V, first + (size_t)t * V, (size_t)V * 4))
            same++;
        else
            printf("  %s: row %d differs on the cached prefix (max |dlogprob| %.3g)\n", label, t,
                   max_logprob_diff(again + (size_t)t * V, first + (size_t)t * V, V));
    }
    printf("batch invariance, cached prefix %-22s %d of %d logits rows the same bits\n", label, same, NS + 1);
    CHECK(same == NS + 1, "%s: %d of %d rows on the cached prefix differ", label, NS + 1 - same, NS + 1);
    if (kv)
        m40_kv_free(kv);
    free(first);
    free(again);
    free(out);
    m40_model_free(m);
}

/* 8c. The engine under batch invariance with its prefix cache: a prompt of 16k + 1 tokens
 * served among PC_N - 1 others, then alone on its cached blocks: the same greedy text,
 * and the alone request reuses 16(k - 1) of its tokens, not 16k (the scheduler leaves
 * two prompt tokens to compute: one alone would be computed as a decode query, not as
 * the chunk that computed it the first time; BENCHMARKS.md, thirty-fourth session).
 * via_env: the switch from M40_BATCH_INVARIANT=1 instead of the engine's configuration,
 * which the scheduler must follow too (it did not: thirty-fifth session). */
static void test_batch_invariant_engine(const char *path, int via_env)
{
    char err[512];
    m40_model *m = tokens_model(path);
    if (!m)
        return;
    const m40_tokenizer *tok = m40_model_tokenizer(m);
    static char pr[PC_N][2048];
    static int32_t ids[1024];
    static const char *words[] = {"the", "little", "dog", "ran", "to", "a", "park", "and", "saw", "big", "red", "ball"};
    /* prompt 0: words until its tokens are 16k + 1 with k >= 4 */
    int64_t n0 = 0;
    pr[0][0] = '\0';
    for (int w = 0; strlen(pr[0]) + 16 < sizeof pr[0] && !(n0 >= 65 && n0 % 16 == 1); w++) {
        strcat(pr[0], w ? " " : "");
        strcat(pr[0], words[(w * 7 + w / 12) % 12]);
        n0 = m40_tokenize(tok, pr[0], strlen(pr[0]), m40_tokenizer_add_bos(tok), 0, ids, 1024, err, sizeof err);
    }
    m40_model_free(m);
    CHECK(n0 >= 65 && n0 % 16 == 1, "a prompt of 16k + 1 tokens (%lld)", (long long)n0);
    for (int i = 1; i < PC_N; i++)
        snprintf(pr[i], sizeof pr[i], "%s %s %s and the %s", prompts[i % 6], words[i], words[(i * 5) % 12],
                 words[(i * 3) % 12]);
    static job conc[PC_N], alone;
    m40_engine_stats st0, st1;
    if (via_env)
        setenv("M40_BATCH_INVARIANT", "1", 1); /* read when the engine thread loads the model */
    m40_engine *e = pc_start_as(path, PC_N, 32, NULL, 1, !via_env);
    unsetenv("M40_BATCH_INVARIANT");
    if (!e)
        return;
    CHECK(pc_run(e, pr, conc) == 0, "batch invariant: the concurrent requests did not finish");
    settle_stats(e, &st0);
    m40_request_params p;
    params(&p, pr[0], PC_GEN);
    job *js[1] = {&alone};
    memset(&alone, 0, sizeof alone);
    CHECK(m40_engine_submit(e, &p, &alone, &alone.req, err, sizeof err) == M40_SUBMIT_OK, "submit: %s", err);
    CHECK(pump(e, js, 1, 60) == 0, "batch invariant: the request alone did not finish");
    m40_request_release(alone.req);
    settle_stats(e, &st1);
    const uint64_t hit = st1.prefix_cache_hit_tokens - st0.prefix_cache_hit_tokens;
    CHECK(hit == (uint64_t)(n0 - 17), "batch invariant: %llu cached tokens of a %lld-token prompt (want %lld)",
          (unsigned long long)hit, (long long)n0, (long long)(n0 - 17));
    CHECK(alone.prompt_tokens == n0 && alone.cached_tokens == n0 - 17 && conc[0].cached_tokens < alone.cached_tokens,
          "usage: the request alone %d of %d prompt tokens cached (among others %d)", alone.cached_tokens,
          alone.prompt_tokens, conc[0].cached_tokens);
    CHECK(alone.finish == M40_FINISH_LENGTH && conc[0].finish == M40_FINISH_LENGTH &&
              strcmp(alone.text, conc[0].text) == 0,
          "batch invariant: alone on the cached prefix differs from among others:\n  [%s]\n  [%s] %s", alone.text,
          conc[0].text, alone.err_msg);
    printf("batch invariance, engine %s%s: a %lld-token prompt alone on %llu cached tokens, %s among %d\n",
           strrchr(path, '/') + 1, via_env ? " (M40_BATCH_INVARIANT=1)" : "", (long long)n0, (unsigned long long)hit,
           strcmp(alone.text, conc[0].text) == 0 ? "the same text as" : "NOT the text of", PC_N);
    m40_engine_destroy(e);
}

/* 8 on small synthetic models (mkmodel shape) of file type ft; f16: the F16 products
 * forced (M40_GEMM=f16: the quantized GEMM and cuBLAS in F16, as a 7B model takes them;
 * else F32 products, as a model this small takes them) */
static void test_batch_invariant_tiny(const char *shape, const char *ft, int f16)
{
    char path[64], err[512], label[48];
    snprintf(path, sizeof path, "/tmp/m40-gpu-bi-%s-%s-%d.gguf", shape, ft, (int)getpid());
    m40_mkmodel_opts o = {.shape = m40_mkmodel_find_shape(shape), .seed = 11, .n_threads = 2};
    CHECK(o.shape && m40_mkmodel_parse_type(ft, &o.ftype) == 0, "mkmodel shape %s / type %s", shape, ft);
    if (!o.shape || m40_mkmodel_write(&o, path, NULL, err, sizeof err) != 0) {
        CHECK(0, "mkmodel %s %s: %s", shape, ft, err);
        return;
    }
    if (f16)
        setenv("M40_GEMM", "f16", 1);
    snprintf(label, sizeof label, "%s %s%s", shape, ft, f16 ? " (F16 products)" : "");
    test_batch_invariant(path, label);
    unsetenv("M40_GEMM");
    unlink(path);
}

int main(void)
{
    int ndev = 0;
    if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev == 0) {
        SKIP("no CUDA device");
        return check_done();
    }
    /* M40_TEST_BI_MODEL=PATH: tests 8, 8b and 8c alone, on that model (a 7B file, say) */
    const char *bi_model = getenv("M40_TEST_BI_MODEL");
    if (bi_model && *bi_model) {
        test_batch_invariant(bi_model, bi_model);
        test_batch_invariant_cached(bi_model, bi_model);
        test_batch_invariant_engine(bi_model, 0);
        return check_done();
    }
    test_gemma3_synthetic(256, 1, 0.0f, M40_TYPE_F32);
    test_gemma3_synthetic(24, 0, 30.0f, M40_TYPE_F32);
    test_gemma3_synthetic(256, 0, 0.0f, M40_TYPE_Q8_0); /* GEMV (decode) and dequantize + GEMM (prefill) */
    /* F16 layers with the F16 tiled path forced (M40_GEMM=f16; a model this small would
     * take F32 products): the decode steps read attn_output (K 1024 = 2 x 4 x 256 >= 2 x
     * N 64) with the tensor-core GEMV (m40k_gemm_skinny), the rest with m40k_gemv */
    setenv("M40_GEMM", "f16", 1);
    test_gemma3_synthetic(256, 0, 0.0f, M40_TYPE_F16);
    unsetenv("M40_GEMM");
    test_gemma3_real();
    test_tiny_tiled();
    test_small_batches_register("Q4_K_M");
    test_small_batches_register("Q8_0");
    test_batch_invariant_tiny("tiny", "Q4_K_M", 1);
    test_batch_invariant_tiny("tiny", "Q8_0", 1);
    test_batch_invariant_tiny("tiny", "F16", 1);
    test_batch_invariant_tiny("tiny", "Q4_K_M", 0);
    /* dim 1024, FFN 4096: cuBLAS's algorithms for products of that size (split K) */
    test_batch_invariant_tiny("tiny-tp", "F16", 1);
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
        test_argmax(path);
    }
    printf("device draws (m40_batch.sample): %d rows, each equal to the CPU twin's\n", sampled_rows);
    static const char *const moe_models[][2] = {{"tiny-qwen3moe-f16", "qwen3moe"},
                                                {"tiny-qwen3moe-q4km", "qwen3moe"},
                                                {"tiny-gpt-oss-mxfp4", "gpt-oss"}};
    for (size_t i = 0; i < sizeof moe_models / sizeof moe_models[0]; i++) {
        snprintf(path, sizeof path, "%s/models/next/%s.gguf", shared_copy, moe_models[i][0]);
        if (moe_allowed(path, moe_models[i][1])) {
            test_vocab_sweep(path);
            test_moe_batched(path);
            test_graphs(path); /* the expert kernels' decode steps captured in CUDA graphs */
        }
    }
    snprintf(path, sizeof path, "%s/models/tiny-llama-q8_0.gguf", shared_copy);
    test_graphs(path);
    snprintf(path, sizeof path, "%s/models/tiny-llama-q4km.gguf", shared_copy);
    test_graphs(path);
    snprintf(path, sizeof path, "%s/models/stories260K.gguf", shared_copy);
    test_batch_invariant(path, "stories260K");
    snprintf(path, sizeof path, "%s/models/tiny-llama-q4km.gguf", shared_copy);
    test_batch_invariant(path, "tiny-llama-q4km");
    snprintf(path, sizeof path, "%s/models/next/tiny-gemma2-f16.gguf", shared_copy);
    test_batch_invariant(path, "tiny-gemma2-f16"); /* sliding-window layers, soft-capping */
    snprintf(path, sizeof path, "%s/models/next/tiny-qwen3moe-q4km.gguf", shared_copy);
    if (moe_allowed(path, "qwen3moe"))
        test_batch_invariant(path, "tiny-qwen3moe-q4km");
    snprintf(path, sizeof path, "%s/models/next/tiny-gpt-oss-mxfp4.gguf", shared_copy);
    if (moe_allowed(path, "gpt-oss")) /* sinks, biases, windows of 128 */
        test_batch_invariant(path, "tiny-gpt-oss-mxfp4");
    snprintf(path, sizeof path, "%s/models/stories260K.gguf", shared_copy);
    test_batch_invariant_cached(path, "stories260K");
    test_batch_invariant_engine(path, 0);
    test_batch_invariant_engine(path, 1);
    snprintf(path, sizeof path, "%s/models/next/tiny-gemma2-f16.gguf", shared_copy);
    test_batch_invariant_cached(path, "tiny-gemma2-f16");
    snprintf(path, sizeof path, "%s/models/stories260K.gguf", shared_copy);
    test_engine(path);
    snprintf(path, sizeof path, "%s/models/tiny-llama-q8_0.gguf", shared_copy);
    test_engine(path);
    snprintf(path, sizeof path, "%s/models/stories260K.gguf", shared_copy);
    test_prefix_cache(path);
    snprintf(path, sizeof path, "%s/models/tiny-llama-q8_0.gguf", shared_copy);
    test_prefix_cache(path);
    return check_done();
}
