/* m40k_sample (kernels/sample.cu) against its CPU twin m40_ref_sample on random logits:
 * vocab sizes 1..262144 (odd ones), 1..9 sequences per batch with a different parameter
 * class per sequence (greedy, temperature, top-k, top-p, min-p, all of them, penalties
 * and logit bias, top_k 1, logits full of ties). Tokens and top ids must be equal, logprobs
 * within 1e-4, the biased/penalized logits bit-equal. Also: same seed same tokens,
 * different seeds differ, top_k 1 is greedy, penalties touch exactly the listed tokens.
 * Without a GPU: prints why, "0 passed, 0 failed, 1 skipped", exit 0. */
#include <cuda_runtime.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <vector>
#include <algorithm>

#include "ref/cpu_ref.h"

#define GPU_CHECK_SEED 0x243F6A8885A308D3ull
#include "gpu_check.h"

static void ok(bool c, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void ok(bool c, const char *fmt, ...)
{
    if (c) {
        n_pass++;
        return;
    }
    n_fail++;
    va_list ap;
    va_start(ap, fmt);
    printf("FAIL ");
    vprintf(fmt, ap);
    printf("\n");
    va_end(ap);
}

enum { C_GREEDY, C_TEMP, C_TOPK, C_TOPP, C_MINP, C_ALL, C_PEN, C_TOPK1, C_TIES, C_HOT, N_CLASS };
static const char *class_name[N_CLASS] = {"greedy", "temperature", "top-k", "top-p", "min-p",
                                          "k+p+min-p", "penalties+bias", "top_k=1", "ties", "cold/hot"};

struct batch {
    int n_seq, n_vocab, n_top;
    int64_t stride;
    std::vector<float> logits;
    std::vector<m40k_sample_params> params;
    std::vector<int32_t> bias_indptr, bias_ids, pen_indptr, pen_ids, pen_counts;
    std::vector<float> bias_values;
    std::vector<int> cls;
};

static m40k_sample_params params_for(int cls, int V)
{
    m40k_sample_params p;
    memset(&p, 0, sizeof p);
    p.temperature = 0.6f + frand(0.0f, 0.8f);
    p.top_k = 0;
    p.top_p = 1.0f;
    p.min_p = 0.0f;
    p.repetition_penalty = 1.0f;
    p.seed = ((uint64_t)rnd32() << 32) | rnd32();
    p.step = rnd32() % 1000;
    switch (cls) {
    case C_GREEDY: p.temperature = 0.0f; break;
    case C_TEMP: break;
    case C_TOPK: p.top_k = 1 + (int)(rnd32() % 64); break;
    case C_TOPP: p.top_p = frand(0.3f, 0.97f); break;
    case C_MINP: p.min_p = frand(0.01f, 0.3f); break;
    case C_ALL:
        p.top_k = 2 + (int)(rnd32() % 100);
        p.top_p = frand(0.5f, 0.95f);
        p.min_p = frand(0.01f, 0.1f);
        break;
    case C_PEN:
        p.repetition_penalty = 1.1f + frand(0.0f, 0.3f);
        p.presence_penalty = frand(0.0f, 1.0f);
        p.frequency_penalty = frand(0.0f, 0.5f);
        p.top_p = 0.9f;
        break;
    case C_TOPK1: p.top_k = 1; break;
    case C_TIES: p.top_k = (rnd32() & 1) ? 0 : 1 + (int)(rnd32() % 300); p.top_p = frand(0.5f, 1.0f); break;
    case C_HOT: p.temperature = (rnd32() & 1) ? 0.05f : 5.0f; p.min_p = (rnd32() & 1) ? 0.05f : 0.0f; break;
    }
    (void)V;
    return p;
}

/* sequence s gets class (first_class + s * class_step) % N_CLASS (class_step 0: all the same) */
static batch make_batch(int V, int n_seq, int first_class, int n_top, int class_step = 1)
{
    batch b;
    b.n_seq = n_seq, b.n_vocab = V, b.n_top = n_top;
    b.stride = V + (int64_t)(rnd32() % 5);
    b.logits.resize((size_t)b.stride * n_seq);
    b.bias_indptr.push_back(0);
    b.pen_indptr.push_back(0);
    for (int s = 0; s < n_seq; s++) {
        const int cls = (first_class + s * class_step) % N_CLASS;
        b.cls.push_back(cls);
        float *l = &b.logits[(size_t)s * b.stride];
        for (int64_t i = 0; i < b.stride; i++)
            l[i] = frand(-6.0f, 6.0f);
        if (cls == C_TIES) /* few distinct values: exercises equal keys */
            for (int i = 0; i < V; i++)
                l[i] = floorf(l[i]) * 0.5f;
        if (V > 1 && (rnd32() % 4) == 0)
            l[rnd32() % V] = NAN; /* counts as -inf */
        b.params.push_back(params_for(cls, V));
        if (cls == C_PEN) {
            std::vector<int32_t> seen;
            const int n = 1 + (int)(rnd32() % 80);
            for (int j = 0; j < n; j++) {
                int32_t t = (int32_t)(rnd32() % V);
                if (std::find(seen.begin(), seen.end(), t) != seen.end())
                    continue;
                seen.push_back(t);
                b.pen_ids.push_back(t);
                b.pen_counts.push_back(1 + (int32_t)(rnd32() % 4));
            }
            b.bias_ids.push_back((int32_t)(rnd32() % V));
            b.bias_values.push_back(frand(-3.0f, 3.0f));
            b.bias_ids.push_back(b.bias_ids.back()); /* duplicates add up */
            b.bias_values.push_back(2.0f);
            b.bias_ids.push_back(V + 3); /* ignored */
            b.bias_values.push_back(100.0f);
        }
        b.bias_indptr.push_back((int32_t)b.bias_ids.size());
        b.pen_indptr.push_back((int32_t)b.pen_ids.size());
    }
    return b;
}

struct result {
    std::vector<int32_t> token, top_ids;
    std::vector<float> logprob, top_lp, logits;
};

static result run_gpu(const batch &b)
{
    float *dl = dup(b.logits);
    m40k_sample_params *dp = dup(b.params);
    int32_t *dbi = dup(b.bias_indptr), *dbid = dup(b.bias_ids), *dpi = dup(b.pen_indptr), *dpid = dup(b.pen_ids),
            *dpc = dup(b.pen_counts);
    float *dbv = dup(b.bias_values);
    int32_t *dtok, *dtop;
    float *dlp, *dtlp;
    CK(cudaMalloc(&dtok, b.n_seq * sizeof(int32_t)));
    CK(cudaMalloc(&dlp, b.n_seq * sizeof(float)));
    CK(cudaMalloc(&dtop, std::max(1, b.n_seq * b.n_top) * sizeof(int32_t)));
    CK(cudaMalloc(&dtlp, std::max(1, b.n_seq * b.n_top) * sizeof(float)));
    CK(m40k_sample(dl, b.stride, b.n_seq, b.n_vocab, dp, dbi, dbid, dbv, dpi, dpid, dpc, dtok, dlp, b.n_top, dtop,
                   dtlp, 0));
    result r;
    r.token = back(dtok, b.n_seq);
    r.logprob = back(dlp, b.n_seq);
    r.top_ids = back(dtop, (size_t)b.n_seq * b.n_top);
    r.top_lp = back(dtlp, (size_t)b.n_seq * b.n_top);
    r.logits = back(dl, b.logits.size());
    cudaFree(dl), cudaFree(dp), cudaFree(dbi), cudaFree(dbid), cudaFree(dpi), cudaFree(dpid), cudaFree(dpc);
    cudaFree(dbv), cudaFree(dtok), cudaFree(dlp), cudaFree(dtop), cudaFree(dtlp);
    return r;
}

static result run_cpu(const batch &b)
{
    result r;
    r.logits = b.logits;
    r.token.resize(b.n_seq), r.logprob.resize(b.n_seq);
    r.top_ids.resize((size_t)b.n_seq * b.n_top), r.top_lp.resize((size_t)b.n_seq * b.n_top);
    m40_ref_sample(r.logits.data(), b.stride, b.n_seq, b.n_vocab, b.params.data(), b.bias_indptr.data(),
                   b.bias_ids.data(), b.bias_values.data(), b.pen_indptr.data(), b.pen_ids.data(),
                   b.pen_counts.data(), r.token.data(), r.logprob.data(), b.n_top, r.top_ids.data(),
                   r.top_lp.data());
    return r;
}

static bool close_lp(float g, float c) { return (isinf(g) && g == c) || fabsf(g - c) <= 1e-4f; }

static void compare(const batch &b, const result &g, const result &c)
{
    for (int s = 0; s < b.n_seq; s++) {
        const char *cn = class_name[b.cls[s]];
        ok(g.token[s] == c.token[s], "V=%d seq %d (%s): token gpu %d cpu %d", b.n_vocab, s, cn, g.token[s],
           c.token[s]);
        ok(close_lp(g.logprob[s], c.logprob[s]), "V=%d seq %d (%s): logprob gpu %g cpu %g", b.n_vocab, s, cn,
           g.logprob[s], c.logprob[s]);
        bool ids = true, lps = true;
        for (int j = 0; j < b.n_top; j++) {
            ids &= g.top_ids[s * b.n_top + j] == c.top_ids[s * b.n_top + j];
            lps &= close_lp(g.top_lp[s * b.n_top + j], c.top_lp[s * b.n_top + j]);
        }
        ok(ids, "V=%d seq %d (%s): top ids differ (first gpu %d cpu %d)", b.n_vocab, s, cn,
           b.n_top ? g.top_ids[s * b.n_top] : 0, b.n_top ? c.top_ids[s * b.n_top] : 0);
        ok(lps, "V=%d seq %d (%s): top logprobs differ", b.n_vocab, s, cn);
        ok(memcmp(&g.logits[(size_t)s * b.stride], &c.logits[(size_t)s * b.stride], b.n_vocab * sizeof(float)) == 0,
           "V=%d seq %d (%s): biased/penalized logits not bit-equal", b.n_vocab, s, cn);
    }
}

int main(void)
{
    int n_dev = 0;
    if (cudaGetDeviceCount(&n_dev) != cudaSuccess || n_dev == 0) {
        printf("no CUDA device: sampling test skipped\n0 passed, 0 failed, 1 skipped\n");
        return 0;
    }
    const int vocabs[] = {1, 7, 1000, 32000, 50257, 262144};
    int first_class = 0;
    for (int V : vocabs) {
        const int rounds = V >= 100000 ? 3 : 6;
        for (int rd = 0; rd < rounds; rd++) {
            const int n_seq = 1 + (int)(rnd32() % 9);
            const int n_top = (int)(rnd32() % 21);
            batch b = make_batch(V, n_seq, first_class, n_top);
            first_class = (first_class + n_seq) % N_CLASS;
            compare(b, run_gpu(b), run_cpu(b));
        }
        /* one batch of every class, top-20 */
        batch b = make_batch(V, N_CLASS, 0, 20);
        compare(b, run_gpu(b), run_cpu(b));
    }

    /* same seed: same token; different seeds: different tokens (flat logits, T=1) */
    {
        const int V = 32000, n = 9;
        batch b = make_batch(V, n, C_TEMP, 0);
        std::fill(b.bias_indptr.begin(), b.bias_indptr.end(), 0); /* plain rows, no penalties */
        std::fill(b.pen_indptr.begin(), b.pen_indptr.end(), 0);
        for (int s = 0; s < n; s++) {
            b.params[s] = params_for(C_TEMP, V);
            b.params[s].temperature = 1.0f;
            b.params[s].seed = 42;
            b.params[s].step = 7;
            memcpy(&b.logits[(size_t)s * b.stride], &b.logits[0], V * sizeof(float));
        }
        result r1 = run_gpu(b), r2 = run_gpu(b);
        bool same = true;
        for (int s = 0; s < n; s++)
            same &= r1.token[s] == r1.token[0] && r2.token[s] == r1.token[s];
        ok(same, "same seed and step gave different tokens");
        for (int s = 0; s < n; s++)
            b.params[s].seed = 1000 + s;
        result r3 = run_gpu(b), c3 = run_cpu(b);
        int distinct = 0;
        for (int s = 1; s < n; s++)
            distinct += r3.token[s] != r3.token[0];
        ok(distinct >= 5, "different seeds gave mostly the same token (%d of 8 differ)", distinct);
        ok(r3.token == c3.token, "different seeds: gpu and cpu disagree");
        for (int s = 0; s < n; s++)
            b.params[s].seed = 42, b.params[s].step = s;
        result r4 = run_gpu(b);
        distinct = 0;
        for (int s = 1; s < n; s++)
            distinct += r4.token[s] != r4.token[0];
        ok(distinct >= 5, "different steps gave mostly the same token (%d of 8 differ)", distinct);
    }

    /* top_k 1 and temperature 0 are the argmax (also for sharp and flat rows) */
    for (int V : {7, 50257}) {
        batch b = make_batch(V, 4, C_TOPK1, 1);
        b.params[1] = params_for(C_GREEDY, V);
        b.params[2] = params_for(C_TOPK1, V);
        b.params[3] = params_for(C_GREEDY, V);
        result r = run_gpu(b);
        for (int s = 0; s < 4; s++) {
            const float *l = &b.logits[(size_t)s * b.stride];
            int best = 0;
            for (int i = 1; i < V; i++)
                if (l[i] > l[best] || l[best] != l[best])
                    best = i;
            ok(r.token[s] == best && r.top_ids[s] == best, "V=%d seq %d: greedy gave %d, argmax %d", V, s,
               r.token[s], best);
        }
    }

    /* penalties change exactly the listed tokens, by the documented formula */
    {
        const int V = 50257;
        batch b = make_batch(V, 3, C_PEN, 0, 0); /* every sequence has a history and a bias */
        result r = run_gpu(b);
        for (int s = 0; s < 3; s++) {
            const float *before = &b.logits[(size_t)s * b.stride], *after = &r.logits[(size_t)s * b.stride];
            std::vector<char> listed(V, 0);
            for (int j = b.pen_indptr[s]; j < b.pen_indptr[s + 1]; j++)
                listed[b.pen_ids[j]] = 1;
            for (int j = b.bias_indptr[s]; j < b.bias_indptr[s + 1]; j++)
                if (b.bias_ids[j] < V)
                    listed[b.bias_ids[j]] = 1;
            int wrong = 0, n_listed = 0;
            for (int i = 0; i < V; i++) {
                const bool changed = memcmp(&before[i], &after[i], sizeof(float)) != 0;
                n_listed += listed[i];
                if (changed != (bool)listed[i] && before[i] == before[i])
                    wrong++;
            }
            ok(wrong == 0 && n_listed > 0, "seq %d: %d tokens changed against the history (%d listed)", s, wrong,
               n_listed);
        }
    }

    /* bad arguments */
    ok(m40k_sample(NULL, 10, 1, 10, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, 0, NULL, NULL, 0) != 0,
       "null pointers accepted");
    printf("%d passed, %d failed, 0 skipped\n", n_pass, n_fail);
    return n_fail ? 1 : 0;
}
