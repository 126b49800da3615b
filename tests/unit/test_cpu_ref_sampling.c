/* The sampling twin m40_ref_sample (kernels/ref/cpu_ref.c, the definition m40k_sample must
 * match bit for bit) against direct formulas: its exp against exp(), greedy = argmax,
 * top-k / top-p / min-p keep exactly the sets engine/serve/sampler.c documents, the draw
 * follows the softmax at temperature T, seeds and steps reproduce, penalties and bias
 * touch only their tokens, logprobs and top-n are the log-softmax in rank order. */
#include <math.h>
#include <stdint.h>

#include "check.h"
#include "ref/cpu_ref.h"

static uint32_t rs = 777;
static float frand(float lo, float hi)
{
    rs = rs * 1664525u + 1013904223u;
    return lo + (hi - lo) * (float)(rs >> 8) / 16777216.0f;
}

static m40k_sample_params defaults(void)
{
    m40k_sample_params p;
    memset(&p, 0, sizeof p);
    p.temperature = 1.0f;
    p.top_p = 1.0f;
    p.repetition_penalty = 1.0f;
    return p;
}

static int32_t sample1(const float *logits, int V, const m40k_sample_params *p, float *lp)
{
    float *l = malloc((size_t)V * sizeof *l);
    memcpy(l, logits, (size_t)V * sizeof *l);
    int32_t tok;
    float lpv;
    m40_ref_sample(l, V, 1, V, p, NULL, NULL, NULL, NULL, NULL, NULL, &tok, &lpv, 0, NULL, NULL);
    if (lp)
        *lp = lpv;
    free(l);
    return tok;
}

/* rank of token t: how many rank before it (higher logit, or equal and lower id) */
static int rank_of(const float *l, int V, int t)
{
    int r = 0;
    for (int i = 0; i < V; i++)
        r += l[i] > l[t] || (l[i] == l[t] && i < t);
    return r;
}

static void test_exp(void)
{
    CHECK(m40_ref_sample_exp(0.0f) == 1.0f, "exp(0) = %g", m40_ref_sample_exp(0.0f));
    CHECK(m40_ref_sample_exp(-INFINITY) == 0.0f && m40_ref_sample_exp(NAN) == 0.0f, "exp(-inf/nan)");
    double worst = 0;
    for (float x = -31.9f; x <= 0.0f; x += 0.0137f) {
        double e = exp((double)x), d = fabs(m40_ref_sample_exp(x) - e) / e;
        if (d > worst)
            worst = d;
    }
    CHECK(worst < 1e-6, "relative error %g", worst);
    CHECK(m40_ref_sample_exp(-40.0f) == 0.0f, "below -32 is 0");
}

static void test_random(void)
{
    CHECK(m40k_sample_random(1, 2) == m40k_sample_random(1, 2), "deterministic");
    CHECK(m40k_sample_random(1, 2) != m40k_sample_random(2, 2), "seed matters");
    CHECK(m40k_sample_random(1, 2) != m40k_sample_random(1, 3), "step matters");
    /* roughly uniform top bit over steps */
    int ones = 0;
    for (uint64_t s = 0; s < 10000; s++)
        ones += (int)(m40k_sample_random(5, s) >> 63);
    CHECK(ones > 4700 && ones < 5300, "top bit set %d of 10000", ones);
}

static void test_greedy_and_logprobs(void)
{
    enum { V = 1000 };
    float l[V];
    for (int i = 0; i < V; i++)
        l[i] = frand(-5, 5);
    l[17] = l[400] = 7.0f; /* tie at the top: the lower id wins */
    m40k_sample_params p = defaults();
    p.temperature = 0.0f;
    float lp;
    CHECK(sample1(l, V, &p, &lp) == 17, "temperature 0 is argmax");
    double z = 0;
    for (int i = 0; i < V; i++)
        z += exp((double)l[i]);
    CHECK(fabs(lp - (7.0 - log(z))) < 1e-5, "logprob %g vs %g", lp, 7.0 - log(z));
    p = defaults();
    p.top_k = 1;
    p.seed = 9;
    CHECK(sample1(l, V, &p, NULL) == 17, "top_k 1 is argmax");
    l[3] = NAN;
    p.temperature = 0.0f;
    CHECK(sample1(l, V, &p, NULL) == 17, "NaN is never the argmax");

    /* top-n: the first n of the rank order with their log-softmax */
    int32_t tok, ids[20];
    float lpv, tl[20];
    float l2[V];
    memcpy(l2, l, sizeof l2);
    p = defaults();
    p.temperature = 0.0f;
    m40_ref_sample(l2, V, 1, V, &p, NULL, NULL, NULL, NULL, NULL, NULL, &tok, &lpv, 20, ids, tl);
    int sorted = 1;
    for (int j = 0; j < 20; j++) {
        sorted &= rank_of(l, V, ids[j]) == j;
        sorted &= fabsf(tl[j] - (float)(l[ids[j]] - log(z))) < 1e-4f || j == 0;
    }
    CHECK(sorted && ids[0] == 17 && ids[1] == 400, "top-20 in rank order");
}

/* every draw lies in the set the CPU sampler documents for top-k / top-p / min-p */
static void test_truncation(void)
{
    enum { V = 3000 };
    float l[V];
    for (int i = 0; i < V; i++)
        l[i] = frand(-4, 4) * frand(0, 2);
    int bad_k = 0, bad_p = 0, bad_m = 0;
    for (int step = 0; step < 400; step++) {
        m40k_sample_params p = defaults();
        p.seed = 123;
        p.step = (uint64_t)step;
        p.temperature = 0.7f;
        p.top_k = 25;
        bad_k += rank_of(l, V, sample1(l, V, &p, NULL)) >= 25;

        p = defaults();
        p.seed = 5, p.step = (uint64_t)step, p.temperature = 1.3f, p.top_p = 0.6f;
        int t = sample1(l, V, &p, NULL);
        /* mass of everything ranked strictly before t must be < top_p of the total */
        double before = 0, total = 0, mx = -INFINITY;
        for (int i = 0; i < V; i++)
            mx = l[i] > mx ? l[i] : mx;
        for (int i = 0; i < V; i++) {
            double e = exp((l[i] - mx) / 1.3);
            total += e;
            if (l[i] > l[t] || (l[i] == l[t] && i < t))
                before += e;
        }
        bad_p += before >= 0.6 * total * (1 + 1e-6);

        p = defaults();
        p.seed = 6, p.step = (uint64_t)step, p.temperature = 2.0f, p.min_p = 0.2f;
        t = sample1(l, V, &p, NULL);
        bad_m += exp((l[t] - mx) / 2.0) < 0.2 * (1 - 1e-6);
    }
    CHECK(bad_k == 0, "%d draws outside top-k", bad_k);
    CHECK(bad_p == 0, "%d draws outside top-p", bad_p);
    CHECK(bad_m == 0, "%d draws below min-p", bad_m);
}

/* frequencies follow softmax(l / T) */
static void test_distribution(void)
{
    const float l[5] = {1.0f, 0.0f, 2.0f, -1.0f, 0.5f};
    const float T = 0.8f;
    int counts[5] = {0};
    const int N = 40000;
    for (int s = 0; s < N; s++) {
        m40k_sample_params p = defaults();
        p.temperature = T;
        p.seed = 99, p.step = (uint64_t)s;
        counts[sample1(l, 5, &p, NULL)]++;
    }
    double z = 0;
    for (int i = 0; i < 5; i++)
        z += exp(l[i] / T);
    double chi2 = 0;
    for (int i = 0; i < 5; i++) {
        double e = N * exp(l[i] / T) / z;
        chi2 += (counts[i] - e) * (counts[i] - e) / e;
    }
    CHECK(chi2 < 25.0, "chi2 %g (4 dof)", chi2); /* p ~ 5e-5 */
}

static void test_reproducible(void)
{
    enum { V = 50257 };
    float *l = malloc(V * sizeof *l);
    for (int i = 0; i < V; i++)
        l[i] = frand(-3, 3);
    m40k_sample_params p = defaults();
    p.seed = 42, p.step = 3;
    int a = sample1(l, V, &p, NULL), b = sample1(l, V, &p, NULL), diff = 0;
    CHECK(a == b, "same seed: %d vs %d", a, b);
    for (uint64_t s = 0; s < 10; s++) {
        p.seed = 1000 + s;
        diff += sample1(l, V, &p, NULL) != a;
    }
    CHECK(diff >= 8, "different seeds: only %d of 10 differ", diff);
    free(l);
}

static void test_penalties(void)
{
    enum { V = 100 };
    float l[2 * V], orig[2 * V];
    for (int i = 0; i < 2 * V; i++)
        orig[i] = l[i] = frand(-3, 3);
    l[5] = orig[5] = 2.0f;
    l[6] = orig[6] = -2.0f;
    m40k_sample_params p[2] = {defaults(), defaults()};
    p[0].repetition_penalty = 1.5f, p[0].presence_penalty = 0.25f, p[0].frequency_penalty = 0.5f;
    p[0].temperature = 0.0f;
    p[1] = p[0];
    const int32_t pen_indptr[3] = {0, 2, 3}, pen_ids[3] = {5, 6, 7}, pen_counts[3] = {3, 1, 2};
    const int32_t bias_indptr[3] = {0, 0, 3}, bias_ids[3] = {9, 9, 500};
    const float bias_values[3] = {1.0f, 0.5f, 9.0f};
    int32_t tok[2];
    float lp[2];
    m40_ref_sample(l, V, 2, V, p, bias_indptr, bias_ids, bias_values, pen_indptr, pen_ids, pen_counts, tok, lp, 0,
                   NULL, NULL);
    CHECK(l[5] == 2.0f / 1.5f - (3 * 0.5f + 0.25f), "positive logit: %g", l[5]);
    CHECK(l[6] == -2.0f * 1.5f - (1 * 0.5f + 0.25f), "negative logit: %g", l[6]);
    int others = 0;
    for (int i = 0; i < V; i++)
        others += i != 5 && i != 6 && l[i] != orig[i];
    CHECK(others == 0, "seq 0: %d other logits changed", others);
    CHECK(l[V + 9] == (orig[V + 9] + 1.0f) + 0.5f, "bias duplicates add up");
    CHECK(l[V + 7] != orig[V + 7], "seq 1 penalty");
    others = 0;
    for (int i = 0; i < V; i++)
        others += i != 7 && i != 9 && l[V + i] != orig[V + i];
    CHECK(others == 0, "seq 1: %d other logits changed", others);
    /* the logprob is taken after the penalties */
    double z = 0;
    for (int i = 0; i < V; i++)
        z += exp((double)l[i]);
    CHECK(fabs(lp[0] - (l[tok[0]] - log(z))) < 1e-5, "logprob after penalties");
}

int main(void)
{
    test_exp();
    test_random();
    test_greedy_and_logprobs();
    test_truncation();
    test_distribution();
    test_reproducible();
    test_penalties();
    return check_done();
}
