/* The greedy pick's 64-bit key of kernels.h 9c (m40k_argmax_key, m40k_argmax_key_id,
 * plain C): the largest key over a row names the entry m40k_sample_greedy picks (largest
 * value, ties: lowest id; NaN skipped; -0 and +0 equal), and no entry (or only NaN)
 * reads back as -1. Checked against a direct scan on random rows with ties, zeros of
 * both signs, infinities and NaN. */
#include <math.h>
#include <stdint.h>

#include "check.h"
#include "kernels.h"

static uint32_t rng = 777u;
static uint32_t rnd(void)
{
    rng = rng * 1664525u + 1013904223u;
    return rng >> 8;
}

/* the pick of m40k_sample_greedy, directly */
static int32_t scan(const float *v, int n)
{
    int32_t best = -1;
    for (int i = 0; i < n; i++)
        if (v[i] == v[i] && (best < 0 || v[i] > v[best]))
            best = i;
    return best;
}

static int32_t by_key(const float *v, int n)
{
    uint64_t k = 0;
    for (int i = 0; i < n; i++) {
        const uint64_t t = m40k_argmax_key(v[i], i);
        k = t > k ? t : k;
    }
    return m40k_argmax_key_id(k);
}

int main(void)
{
    const float pool[] = {0.0f, -0.0f, 1.0f, -1.0f, 2.5f, -2.5f, 1e-38f, -1e-38f, 3e38f, -3e38f,
                          INFINITY, -INFINITY, NAN, 0.5f};
    const int np = (int)(sizeof pool / sizeof pool[0]);
    int bad = 0;
    for (int t = 0; t < 20000; t++) {
        float v[40];
        const int n = 1 + (int)(rnd() % 40);
        for (int i = 0; i < n; i++)
            v[i] = rnd() % 3 ? pool[rnd() % np] : ((float)(int)(rnd() % 2001) - 1000.0f) / 7.0f;
        bad += scan(v, n) != by_key(v, n);
    }
    CHECK(bad == 0, "the largest key names the scan's pick on 20,000 random rows (ties, +-0, +-inf, NaN)");
    const float nan3[3] = {NAN, NAN, NAN}, zeros[3] = {-0.0f, 0.0f, -0.0f}, ninf[3] = {NAN, -INFINITY, -INFINITY};
    CHECK(by_key(nan3, 3) == -1 && m40k_argmax_key_id(0) == -1, "only NaN, or no entry: -1");
    CHECK(by_key(zeros, 3) == 0, "-0 and +0 tie: the lowest id");
    CHECK(by_key(ninf, 3) == 1, "only -inf (and NaN): the first -inf");
    CHECK(m40k_argmax_key_id(m40k_argmax_key(1.0f, 31999)) == 31999 && m40k_argmax_key_id(m40k_argmax_key(-5.0f, 0)) == 0,
          "the id reads back");
    CHECK(m40k_argmax_key(1.0f, 5) > m40k_argmax_key(1.0f, 6) && m40k_argmax_key(2.0f, 9) > m40k_argmax_key(1.0f, 0),
          "ordered by value, then lower id first");
    /* m40k_argmax, the CPU's greedy pick (sampler, CPU forward, m40 bench): the key's pick */
    const float nan_first[4] = {NAN, 1.0f, 3.0f, 3.0f};
    CHECK(m40k_argmax(nan_first, 4) == 2, "NaN at id 0 is skipped; the tie goes to the lower id");
    CHECK(m40k_argmax(nan3, 3) == 0 && m40k_argmax(zeros, 3) == 0 && m40k_argmax(ninf, 3) == 1,
          "all NaN: 0; +-0: the first; -inf: the first -inf");
    return check_done();
}
