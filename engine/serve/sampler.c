/* Token sampler. Steps per call, in order: logit bias, penalties, log-probabilities
 * (reported), then temperature, top-k, top-p, min-p and a draw from what is left.
 *
 * Cost per call is O(V) plus small terms: top-k keeps a k-entry heap (O(V log k)),
 * top-p heapifies the candidates and pops only until the mass is reached (O(V + m log V)
 * for m kept), min-p is a linear filter. No full sort of the vocabulary happens. */
#include "sampler.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "sample_hd.h" /* m40k_argmax: the greedy pick as the GPU makes it */

typedef struct {
    int32_t id;
    float logit;
    float p;          /* unnormalized probability after temperature */
} cand;

struct m40_sampler {
    m40_sampler_params p;
    int32_t n_vocab;
    int32_t *bias_ids;
    float *bias_values;

    /* Penalty window: the last penalty_last_n accepted tokens (a ring), or all of them
     * (a growing array) when penalty_last_n < 0. Only kept when a penalty is on. */
    int penalties_on;
    int32_t *hist;
    size_t hist_len, hist_cap, hist_head;
    int32_t *counts;  /* occurrences of each token in the window */
    uint32_t *stamp;  /* stamp[t] == step: token t already penalized this call */
    uint32_t step;

    uint64_t rng[4];
    cand *cands;      /* n_vocab */
};

/* ---- PRNG: xoshiro256** seeded through splitmix64 (a zero state is impossible). ---- */

static uint64_t splitmix64(uint64_t *x)
{
    uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

static uint64_t rng_next(uint64_t s[4])
{
    uint64_t result = rotl(s[1] * 5, 7) * 9;
    uint64_t t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return result;
}

/* Uniform in [0, 1) with 53 random bits. */
static double rng_uniform(uint64_t s[4]) { return (double)(rng_next(s) >> 11) * 0x1.0p-53; }

/* ---------------------------------------------------------------------------- */

void m40_sampler_params_default(m40_sampler_params *p)
{
    memset(p, 0, sizeof *p);
    p->temperature = 1.0f;
    p->top_k = 0;
    p->top_p = 1.0f;
    p->min_p = 0.0f;
    p->repetition_penalty = 1.0f;
    p->presence_penalty = 0.0f;
    p->frequency_penalty = 0.0f;
    p->penalty_last_n = 64;
    p->seed = 0;
    p->n_top_logprobs = 0;
}

m40_sampler *m40_sampler_new(const m40_sampler_params *p, int32_t n_vocab)
{
    if (n_vocab <= 0)
        return NULL;
    m40_sampler *s = calloc(1, sizeof *s);
    if (!s)
        return NULL;
    s->p = *p;
    s->n_vocab = n_vocab;
    if (s->p.n_top_logprobs < 0)
        s->p.n_top_logprobs = 0;
    if (s->p.n_top_logprobs > 20)
        s->p.n_top_logprobs = 20;
    s->cands = malloc((size_t)n_vocab * sizeof *s->cands);
    if (!s->cands)
        goto fail;
    if (p->n_logit_bias > 0) {
        s->bias_ids = malloc((size_t)p->n_logit_bias * sizeof *s->bias_ids);
        s->bias_values = malloc((size_t)p->n_logit_bias * sizeof *s->bias_values);
        if (!s->bias_ids || !s->bias_values)
            goto fail;
        memcpy(s->bias_ids, p->logit_bias_ids, (size_t)p->n_logit_bias * sizeof *s->bias_ids);
        memcpy(s->bias_values, p->logit_bias_values, (size_t)p->n_logit_bias * sizeof *s->bias_values);
    } else {
        s->p.n_logit_bias = 0;
    }
    s->p.logit_bias_ids = s->bias_ids;
    s->p.logit_bias_values = s->bias_values;

    s->penalties_on = p->penalty_last_n != 0 &&
                      (p->repetition_penalty != 1.0f || p->presence_penalty != 0.0f || p->frequency_penalty != 0.0f);
    if (s->penalties_on) {
        s->counts = calloc((size_t)n_vocab, sizeof *s->counts);
        s->stamp = calloc((size_t)n_vocab, sizeof *s->stamp);
        s->hist_cap = p->penalty_last_n > 0 ? (size_t)p->penalty_last_n : 64;
        s->hist = malloc(s->hist_cap * sizeof *s->hist);
        if (!s->counts || !s->stamp || !s->hist)
            goto fail;
    }
    uint64_t x = p->seed;
    for (int i = 0; i < 4; i++)
        s->rng[i] = splitmix64(&x);
    return s;
fail:
    m40_sampler_free(s);
    return NULL;
}

void m40_sampler_free(m40_sampler *s)
{
    if (!s)
        return;
    free(s->bias_ids);
    free(s->bias_values);
    free(s->hist);
    free(s->counts);
    free(s->stamp);
    free(s->cands);
    free(s);
}

void m40_sampler_accept(m40_sampler *s, int32_t token)
{
    if (!s->penalties_on || token < 0 || token >= s->n_vocab)
        return;
    if (s->p.penalty_last_n < 0) {
        /* Unbounded window: grow; on failure the oldest token is dropped instead, the
         * least harmful way to degrade. */
        if (s->hist_len == s->hist_cap) {
            int32_t *h = realloc(s->hist, 2 * s->hist_cap * sizeof *h);
            if (h) {
                s->hist = h;
                s->hist_cap *= 2;
            }
        }
    }
    if (s->hist_len < s->hist_cap) {
        s->hist[(s->hist_head + s->hist_len) % s->hist_cap] = token;
        s->hist_len++;
    } else {
        s->counts[s->hist[s->hist_head]]--;
        s->hist[s->hist_head] = token;
        s->hist_head = (s->hist_head + 1) % s->hist_cap;
    }
    s->counts[token]++;
}

static void apply_penalties(m40_sampler *s, float *logits)
{
    if (++s->step == 0) { /* stamp wrapped: clear so no stale mark matches */
        memset(s->stamp, 0, (size_t)s->n_vocab * sizeof *s->stamp);
        s->step = 1;
    }
    for (size_t i = 0; i < s->hist_len; i++) {
        int32_t t = s->hist[(s->hist_head + i) % s->hist_cap];
        if (s->stamp[t] == s->step)
            continue;
        s->stamp[t] = s->step;
        float l = logits[t];
        if (s->p.repetition_penalty != 1.0f)
            l = l > 0 ? l / s->p.repetition_penalty : l * s->p.repetition_penalty;
        l -= (float)s->counts[t] * s->p.frequency_penalty + s->p.presence_penalty;
        logits[t] = l;
    }
}

/* a ranks before b: higher logit, then lower id (so ties resolve the same way always). */
static int ranks_before(float la, int32_t ia, float lb, int32_t ib) { return la > lb || (la == lb && ia < ib); }

/* The n best (logit, id) in order, by insertion into a short sorted list: O(V n) worst
 * case, about O(V) in practice since most logits fail the first comparison. */
static void top_n(const float *logits, int32_t n_vocab, int n, int32_t *ids)
{
    int have = 0;
    for (int32_t i = 0; i < n_vocab; i++) {
        if (have == n && !ranks_before(logits[i], i, logits[ids[n - 1]], ids[n - 1]))
            continue;
        int j = have < n ? have++ : n - 1;
        while (j > 0 && ranks_before(logits[i], i, logits[ids[j - 1]], ids[j - 1])) {
            ids[j] = ids[j - 1];
            j--;
        }
        ids[j] = i;
    }
}

/* Min-heap on rank (the root is the worst candidate): keeps the k best. */
static void sift_down_worst(cand *h, size_t n, size_t i)
{
    for (;;) {
        size_t w = i, l = 2 * i + 1, r = l + 1;
        if (l < n && ranks_before(h[w].logit, h[w].id, h[l].logit, h[l].id))
            w = l;
        if (r < n && ranks_before(h[w].logit, h[w].id, h[r].logit, h[r].id))
            w = r;
        if (w == i)
            return;
        cand t = h[i];
        h[i] = h[w];
        h[w] = t;
        i = w;
    }
}

/* Max-heap on probability (ties: lower id first): pops the most likely candidate. */
static int more_likely(const cand *a, const cand *b) { return a->p > b->p || (a->p == b->p && a->id < b->id); }

static void sift_down_best(cand *h, size_t n, size_t i)
{
    for (;;) {
        size_t b = i, l = 2 * i + 1, r = l + 1;
        if (l < n && more_likely(&h[l], &h[b]))
            b = l;
        if (r < n && more_likely(&h[r], &h[b]))
            b = r;
        if (b == i)
            return;
        cand t = h[i];
        h[i] = h[b];
        h[b] = t;
        i = b;
    }
}

static int32_t sample_truncated(m40_sampler *s, const float *logits)
{
    const m40_sampler_params *p = &s->p;
    cand *c = s->cands;
    size_t n = 0;

    /* top-k: a heap of the k best, replaced at the root when something better comes. */
    size_t k = p->top_k > 0 && p->top_k < s->n_vocab ? (size_t)p->top_k : (size_t)s->n_vocab;
    for (int32_t i = 0; i < s->n_vocab; i++) {
        if (n < k) {
            c[n].id = i;
            c[n].logit = logits[i];
            n++;
            if (n == k && k < (size_t)s->n_vocab)
                for (size_t j = k / 2; j-- > 0;)
                    sift_down_worst(c, n, j);
        } else if (ranks_before(logits[i], i, c[0].logit, c[0].id)) {
            c[0].id = i;
            c[0].logit = logits[i];
            sift_down_worst(c, n, 0);
        }
    }

    /* temperature: p ~ exp((l - max) / T); normalization is left to the draw. */
    float max = -INFINITY;
    for (size_t i = 0; i < n; i++)
        if (c[i].logit > max)
            max = c[i].logit;
    if (!isfinite(max)) /* everything banned or not a number: nothing sensible to draw */
        return m40k_argmax(logits, s->n_vocab);
    double total = 0;
    for (size_t i = 0; i < n; i++) {
        c[i].p = expf((c[i].logit - max) / p->temperature);
        total += c[i].p;
    }

    /* top-p: pop the most likely until their mass reaches top_p; they collect at the
     * end of the array, which then becomes the candidate list. */
    if (p->top_p < 1.0f && n > 1) {
        for (size_t j = n / 2; j-- > 0;)
            sift_down_best(c, n, j);
        size_t heap = n;
        double mass = 0, target = (double)p->top_p * total;
        while (heap > 0) {
            mass += c[0].p;
            cand t = c[0];
            c[0] = c[heap - 1];
            c[heap - 1] = t;
            heap--;
            sift_down_best(c, heap, 0);
            if (mass >= target)
                break;
        }
        c += heap;
        n -= heap;
    }

    /* min-p: drop what is less likely than min_p times the most likely. */
    if (p->min_p > 0.0f) {
        float pmax = 0;
        for (size_t i = 0; i < n; i++)
            if (c[i].p > pmax)
                pmax = c[i].p;
        size_t kept = 0;
        for (size_t i = 0; i < n; i++)
            if (c[i].p >= p->min_p * pmax)
                c[kept++] = c[i];
        n = kept;
    }

    total = 0;
    for (size_t i = 0; i < n; i++)
        total += c[i].p;
    double r = rng_uniform(s->rng) * total, acc = 0;
    for (size_t i = 0; i < n; i++) {
        acc += c[i].p;
        if (r < acc)
            return c[i].id;
    }
    return c[n - 1].id; /* rounding left r at the very top */
}

int m40_sampler_plain_greedy(const m40_sampler *s)
{
    const m40_sampler_params *p = &s->p;
    return (p->temperature <= 0.0f || p->top_k == 1) && p->n_logit_bias == 0 && !s->penalties_on &&
           p->skip_logprob && p->n_top_logprobs <= 0;
}

void m40_sampler_sample(m40_sampler *s, float *logits, m40_sample_result *out)
{
    const m40_sampler_params *p = &s->p;
    for (int32_t i = 0; i < p->n_logit_bias; i++) {
        int32_t id = p->logit_bias_ids[i];
        if (id >= 0 && id < s->n_vocab)
            logits[id] += p->logit_bias_values[i];
    }
    if (s->penalties_on && s->hist_len > 0)
        apply_penalties(s, logits);

    /* log Z of the (biased, penalized) logits at temperature 1, for the logprobs: float
     * exponentials (arguments <= 0, results in [0, 1]) summed in double. */
    double log_z = NAN;
    if (!p->skip_logprob || p->n_top_logprobs > 0) {
        float max = logits[m40k_argmax(logits, s->n_vocab)];
        double sum = 0;
        for (int32_t i = 0; i < s->n_vocab; i++)
            sum += expf(logits[i] - max);
        log_z = isfinite(max) ? max + log(sum) : max;
    }

    int32_t token;
    if (p->temperature <= 0.0f || p->top_k == 1)
        token = m40k_argmax(logits, s->n_vocab);
    else
        token = sample_truncated(s, logits);

    out->token = token;
    out->logprob = (float)(logits[token] - log_z);
    out->n_top = p->n_top_logprobs < s->n_vocab ? p->n_top_logprobs : s->n_vocab;
    if (out->n_top > 0) {
        top_n(logits, s->n_vocab, out->n_top, out->top_ids);
        for (int i = 0; i < out->n_top; i++)
            out->top_logprobs[i] = (float)(logits[out->top_ids[i]] - log_z);
    }
}
