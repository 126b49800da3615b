/* Sampler: greedy, determinism per seed, truncation (top-k, top-p, min-p), the draw's
 * distribution, penalties, logit bias and the reported log-probabilities. */
#include <math.h>
#include <stdint.h>

#include "check.h"
#include "serve/sampler.h"

#define V 1000

/* Deterministic test logits (an LCG of our own, not the sampler's PRNG). */
static void fill_logits(float *l, int n, uint32_t seed)
{
    uint32_t x = seed;
    for (int i = 0; i < n; i++) {
        x = x * 1664525u + 1013904223u;
        l[i] = (float)((x >> 8) % 20000) / 2000.0f - 5.0f; /* [-5, 5) */
    }
}

static int argmax(const float *l, int n)
{
    int b = 0;
    for (int i = 1; i < n; i++)
        if (l[i] > l[b])
            b = i;
    return b;
}

/* Samples once from a copy of logits (the sampler modifies its input). */
static int32_t sample_copy(m40_sampler *s, const float *logits, int n, m40_sample_result *r)
{
    float tmp[V];
    memcpy(tmp, logits, (size_t)n * sizeof *tmp);
    m40_sampler_sample(s, tmp, r);
    return r->token;
}

static double log_z(const float *l, int n)
{
    double mx = l[argmax(l, n)], s = 0;
    for (int i = 0; i < n; i++)
        s += exp(l[i] - mx);
    return mx + log(s);
}

static void test_greedy(void)
{
    float l[V];
    m40_sampler_params p;
    m40_sampler_params_default(&p);
    p.temperature = 0;
    p.n_top_logprobs = 5;
    m40_sampler *s = m40_sampler_new(&p, V);
    CHECK(s != NULL, "sampler_new");
    int ok = 1;
    for (uint32_t seed = 1; seed <= 20; seed++) {
        fill_logits(l, V, seed);
        m40_sample_result r;
        sample_copy(s, l, V, &r);
        if (r.token != argmax(l, V) || fabs(r.logprob - (l[r.token] - log_z(l, V))) > 1e-5)
            ok = 0;
    }
    CHECK(ok, "temperature 0 picks the argmax and reports its log-softmax");
    m40_sampler_free(s);

    /* Without logprobs wanted: the same tokens, greedy and seeded, and no logprob. */
    for (int temp = 0; temp < 2; temp++) {
        m40_sampler_params q = p;
        q.n_top_logprobs = 0;
        q.temperature = temp ? 0.8f : 0.0f;
        q.seed = 99;
        m40_sampler *a = m40_sampler_new(&q, V);
        q.skip_logprob = 1;
        m40_sampler *b = m40_sampler_new(&q, V);
        int same = 1, nan = 1;
        for (uint32_t seed = 1; seed <= 20; seed++) {
            m40_sample_result ra, rb;
            fill_logits(l, V, seed);
            sample_copy(a, l, V, &ra);
            sample_copy(b, l, V, &rb);
            same &= ra.token == rb.token;
            nan &= isnan(rb.logprob) && !isnan(ra.logprob);
        }
        CHECK(same && nan, "skip_logprob (temperature %d): same tokens, logprob NaN only when skipped", temp);
        m40_sampler_free(a);
        m40_sampler_free(b);
    }

    /* Ties resolve to the lowest id. */
    float t[4] = {1, 3, 3, 2};
    s = m40_sampler_new(&p, 4);
    m40_sample_result r;
    m40_sampler_sample(s, t, &r);
    CHECK(r.token == 1, "tie -> lowest id, got %d", r.token);
    m40_sampler_free(s);
}

static void draw_sequence(uint64_t seed, const float *l, int32_t *out, int n)
{
    m40_sampler_params p;
    m40_sampler_params_default(&p);
    p.temperature = 1.0f;
    p.seed = seed;
    m40_sampler *s = m40_sampler_new(&p, V);
    for (int i = 0; i < n; i++) {
        m40_sample_result r;
        out[i] = sample_copy(s, l, V, &r);
    }
    m40_sampler_free(s);
}

static void test_seed(void)
{
    float l[V];
    /* A flat distribution so that different draws show. */
    fill_logits(l, V, 7);
    for (int i = 0; i < V; i++)
        l[i] *= 0.1f;
    int32_t a[200], b[200], c[200];
    draw_sequence(42, l, a, 200);
    draw_sequence(42, l, b, 200);
    draw_sequence(43, l, c, 200);
    CHECK(!memcmp(a, b, sizeof a), "same seed, same sequence");
    int diff = 0;
    for (int i = 0; i < 200; i++)
        diff += a[i] != c[i];
    CHECK(diff > 100, "a different seed gives a different sequence (%d of 200 differ)", diff);
    int distinct = 0;
    for (int i = 1; i < 200; i++)
        distinct += a[i] != a[0];
    CHECK(distinct > 100, "draws vary along the sequence (%d differ from the first)", distinct);
}

/* Fraction of n draws that fall on each of the first k tokens; tokens >= k counted in
 * *outside. */
static void histogram(const m40_sampler_params *p, const float *l, int nv, int n, double *freq, int k, int *outside)
{
    m40_sampler *s = m40_sampler_new(p, nv);
    *outside = 0;
    for (int i = 0; i < k; i++)
        freq[i] = 0;
    for (int i = 0; i < n; i++) {
        m40_sample_result r;
        int32_t t = sample_copy(s, l, nv, &r);
        if (t < k)
            freq[t] += 1.0 / n;
        else
            (*outside)++;
    }
    m40_sampler_free(s);
}

static void test_truncation(void)
{
    /* probabilities 0.5, 0.3, 0.15, 0.05 */
    const int nv = 4;
    float l[4] = {logf(0.5f), logf(0.3f), logf(0.15f), logf(0.05f)};
    m40_sampler_params p;
    m40_sampler_params_default(&p);
    p.seed = 1;
    double f[4];
    int outside;

    histogram(&p, l, nv, 20000, f, 4, &outside);
    CHECK(fabs(f[0] - 0.5) < 0.02 && fabs(f[1] - 0.3) < 0.02 && fabs(f[2] - 0.15) < 0.02 && fabs(f[3] - 0.05) < 0.01,
          "temperature 1 draws follow the softmax: %.3f %.3f %.3f %.3f", f[0], f[1], f[2], f[3]);

    p.temperature = 0.5f; /* p^2 renormalized: .25 .09 .0225 .0025 / .365 */
    histogram(&p, l, nv, 20000, f, 4, &outside);
    CHECK(fabs(f[0] - 0.25 / 0.365) < 0.02 && fabs(f[1] - 0.09 / 0.365) < 0.02,
          "temperature 0.5 sharpens: %.3f %.3f (want %.3f %.3f)", f[0], f[1], 0.25 / 0.365, 0.09 / 0.365);
    p.temperature = 1.0f;

    p.top_k = 2;
    histogram(&p, l, nv, 20000, f, 2, &outside);
    CHECK(outside == 0 && fabs(f[0] - 0.625) < 0.02, "top-k 2 keeps tokens 0 and 1 (0: %.3f, outside %d)", f[0],
          outside);
    p.top_k = 0;

    p.top_p = 0.7f; /* 0.5 < 0.7 <= 0.8: tokens 0 and 1 */
    histogram(&p, l, nv, 20000, f, 2, &outside);
    CHECK(outside == 0 && fabs(f[0] - 0.625) < 0.02, "top-p 0.7 keeps tokens 0 and 1 (0: %.3f, outside %d)", f[0],
          outside);
    p.top_p = 0.9f; /* 0.8 < 0.9 <= 0.95: tokens 0..2 */
    histogram(&p, l, nv, 20000, f, 3, &outside);
    CHECK(outside == 0 && f[2] > 0.1, "top-p 0.9 keeps tokens 0..2 (2: %.3f, outside %d)", f[2], outside);
    p.top_p = 1.0f;

    p.min_p = 0.5f; /* keep p >= 0.25: tokens 0 and 1 */
    histogram(&p, l, nv, 20000, f, 2, &outside);
    CHECK(outside == 0 && fabs(f[0] - 0.625) < 0.02 && f[1] > 0.3, "min-p 0.5 keeps tokens 0 and 1 (%.3f %.3f, outside %d)",
          f[0], f[1], outside);
    p.min_p = 0.2f; /* keep p >= 0.1: tokens 0..2 */
    histogram(&p, l, nv, 20000, f, 3, &outside);
    CHECK(outside == 0 && f[2] > 0.1, "min-p 0.2 keeps tokens 0..2 (outside %d)", outside);
    p.min_p = 0;

    /* top-k 1 and a tiny top-p are greedy, on a large random vocabulary. */
    float big[V];
    int ok_k = 1, ok_p = 1;
    for (uint32_t seed = 1; seed <= 20; seed++) {
        fill_logits(big, V, seed);
        m40_sample_result r;
        m40_sampler_params q;
        m40_sampler_params_default(&q);
        q.seed = seed;
        q.top_k = 1;
        m40_sampler *s = m40_sampler_new(&q, V);
        for (int i = 0; i < 5; i++)
            ok_k &= sample_copy(s, big, V, &r) == argmax(big, V);
        m40_sampler_free(s);
        q.top_k = 0;
        q.top_p = 1e-6f;
        s = m40_sampler_new(&q, V);
        for (int i = 0; i < 5; i++)
            ok_p &= sample_copy(s, big, V, &r) == argmax(big, V);
        m40_sampler_free(s);
    }
    CHECK(ok_k, "top-k 1 equals greedy");
    CHECK(ok_p, "top-p 1e-6 equals greedy");

    /* top-k 50 on a large vocabulary: every draw among the 50 best. */
    fill_logits(big, V, 99);
    float sorted_50th;
    {
        float tmp[V];
        memcpy(tmp, big, sizeof tmp);
        for (int i = 0; i < 50; i++) { /* partial selection sort: the 50th largest */
            int b = i;
            for (int j = i + 1; j < V; j++)
                if (tmp[j] > tmp[b])
                    b = j;
            float t = tmp[i];
            tmp[i] = tmp[b];
            tmp[b] = t;
        }
        sorted_50th = tmp[49];
    }
    m40_sampler_params q;
    m40_sampler_params_default(&q);
    q.top_k = 50;
    q.temperature = 5.0f; /* flatten, so the tail of the 50 is reached */
    m40_sampler *s = m40_sampler_new(&q, V);
    int in_top = 1, distinct = 0;
    unsigned char seen[V] = {0};
    for (int i = 0; i < 2000; i++) {
        m40_sample_result r;
        int32_t t = sample_copy(s, big, V, &r);
        in_top &= big[t] >= sorted_50th;
        distinct += !seen[t];
        seen[t] = 1;
    }
    m40_sampler_free(s);
    CHECK(in_top, "top-k 50: every draw among the 50 most likely");
    CHECK(distinct >= 45, "top-k 50 at temperature 5 reaches (nearly) all of the 50: %d distinct", distinct);
}

static void test_penalties(void)
{
    float l[8] = {0.5f, 1.0f, -0.5f, 4.0f, 0.0f, -1.0f, 2.0f, 3.0f};
    float want[8];
    memcpy(want, l, sizeof l);
    m40_sampler_params p;
    m40_sampler_params_default(&p);
    p.temperature = 0;
    p.repetition_penalty = 2.0f;
    p.presence_penalty = 0.5f;
    p.frequency_penalty = 0.25f;
    p.penalty_last_n = -1;
    m40_sampler *s = m40_sampler_new(&p, 8);
    m40_sampler_accept(s, 3);
    m40_sampler_accept(s, 3);
    m40_sampler_accept(s, 5);
    m40_sample_result r;
    m40_sampler_sample(s, l, &r);
    want[3] = 4.0f / 2 - (2 * 0.25f + 0.5f); /* 1.0: positive logits are divided */
    want[5] = -1.0f * 2 - (1 * 0.25f + 0.5f); /* -2.75: negative ones multiplied */
    int ok = 1;
    for (int i = 0; i < 8; i++)
        ok &= fabsf(l[i] - want[i]) < 1e-6f;
    CHECK(ok, "penalties: token 3 -> %g (want 1), token 5 -> %g (want -2.75), others unchanged", l[3], l[5]);
    CHECK(r.token == 7, "after penalties the argmax moves to token 7, got %d", r.token);
    m40_sampler_free(s);

    /* A window of 2 sees only the last two tokens (3 once, 5 once). */
    float l2[8] = {0.5f, 1.0f, -0.5f, 4.0f, 0.0f, -1.0f, 2.0f, 3.0f};
    p.penalty_last_n = 2;
    s = m40_sampler_new(&p, 8);
    m40_sampler_accept(s, 3);
    m40_sampler_accept(s, 3);
    m40_sampler_accept(s, 5);
    m40_sampler_sample(s, l2, &r);
    CHECK(fabsf(l2[3] - (2.0f - 0.75f)) < 1e-6f && fabsf(l2[5] - (-2.0f - 0.75f)) < 1e-6f,
          "penalty window of 2: token 3 -> %g (want 1.25), token 5 -> %g (want -2.75)", l2[3], l2[5]);
    m40_sampler_free(s);

    /* Penalties off: nothing changes even with history. */
    float l3[8] = {0.5f, 1.0f, -0.5f, 4.0f, 0.0f, -1.0f, 2.0f, 3.0f};
    m40_sampler_params_default(&p);
    p.temperature = 0;
    s = m40_sampler_new(&p, 8);
    m40_sampler_accept(s, 3);
    m40_sampler_sample(s, l3, &r);
    CHECK(l3[3] == 4.0f && r.token == 3, "no penalties by default");
    m40_sampler_free(s);
}

static void test_logit_bias(void)
{
    float l[V];
    fill_logits(l, V, 5);
    int best = argmax(l, V);
    int32_t ids[2] = {best, 3};
    float vals[2] = {-100.0f, 0.0f};
    m40_sampler_params p;
    m40_sampler_params_default(&p);
    p.n_logit_bias = 2;
    p.logit_bias_ids = ids;
    p.logit_bias_values = vals;
    p.temperature = 0;
    m40_sampler *g = m40_sampler_new(&p, V);
    ids[0] = -1; /* the sampler keeps its own copy */
    m40_sample_result r;
    sample_copy(g, l, V, &r);
    float tmp[V];
    memcpy(tmp, l, sizeof tmp);
    tmp[best] = -1e30f;
    CHECK(r.token == argmax(tmp, V) && r.token != best, "bias -100 bans the argmax; greedy takes the runner-up");
    m40_sampler_free(g);

    ids[0] = best;
    p.temperature = 1.0f;
    p.seed = 3;
    for (int i = 0; i < V; i++)
        l[i] *= 0.05f; /* nearly flat: without the ban, `best` would come up often */
    m40_sampler *s = m40_sampler_new(&p, V);
    int hits = 0;
    for (int i = 0; i < 5000; i++)
        hits += sample_copy(s, l, V, &r) == best;
    CHECK(hits == 0, "banned token drawn %d times in 5000", hits);
    m40_sampler_free(s);

    /* A positive bias forces a token. */
    int32_t up_id = 17;
    float up_val = 100.0f;
    p.n_logit_bias = 1;
    p.logit_bias_ids = &up_id;
    p.logit_bias_values = &up_val;
    s = m40_sampler_new(&p, V);
    int forced = 1;
    for (int i = 0; i < 100; i++)
        forced &= sample_copy(s, l, V, &r) == 17;
    CHECK(forced, "bias +100 forces the token");
    m40_sampler_free(s);
}

static void test_logprobs(void)
{
    enum { NV = 20 };
    float l[NV];
    fill_logits(l, NV, 11);
    m40_sampler_params p;
    m40_sampler_params_default(&p);
    p.n_top_logprobs = 20;
    p.seed = 9;
    p.temperature = 0.7f;
    m40_sampler *s = m40_sampler_new(&p, NV);
    m40_sample_result r;
    float tmp[NV];
    memcpy(tmp, l, sizeof tmp);
    m40_sampler_sample(s, tmp, &r);
    CHECK(r.n_top == 20, "20 top logprobs, got %d", r.n_top);
    double sum = 0;
    int sorted = 1, found = 0, distinct = 1;
    for (int i = 0; i < r.n_top; i++) {
        sum += exp(r.top_logprobs[i]);
        if (i && r.top_logprobs[i] > r.top_logprobs[i - 1])
            sorted = 0;
        for (int j = 0; j < i; j++)
            if (r.top_ids[j] == r.top_ids[i])
                distinct = 0;
        if (r.top_ids[i] == r.token) {
            found = 1;
            CHECK(r.top_logprobs[i] == r.logprob, "chosen token's logprob matches its top entry");
        }
    }
    CHECK(fabs(sum - 1.0) < 1e-5, "exp(logprobs) over the whole vocabulary sums to 1 (%.7f)", sum);
    CHECK(sorted && distinct && found, "top logprobs sorted, distinct, and include the chosen token");
    CHECK(r.top_ids[0] == argmax(l, NV), "top entry is the argmax");
    /* logprobs are at temperature 1, not at the sampling temperature */
    CHECK(fabs(r.top_logprobs[0] - (l[r.top_ids[0]] - log_z(l, NV))) < 1e-5,
          "logprobs are the temperature-1 log-softmax");
    m40_sampler_free(s);

    /* Fewer asked for: the best ones, in order. */
    p.n_top_logprobs = 3;
    float big[V];
    fill_logits(big, V, 12);
    s = m40_sampler_new(&p, V);
    sample_copy(s, big, V, &r);
    float tmp2[V];
    memcpy(tmp2, big, sizeof tmp2);
    int ok = r.n_top == 3;
    for (int i = 0; i < 3 && ok; i++) {
        int b = argmax(tmp2, V);
        ok = r.top_ids[i] == b;
        tmp2[b] = -1e30f;
    }
    CHECK(ok, "top-3 of 1000 are the three largest, in order");
    m40_sampler_free(s);
}

int main(void)
{
    test_greedy();
    test_seed();
    test_truncation();
    test_penalties();
    test_logit_bias();
    test_logprobs();
    return check_done();
}
