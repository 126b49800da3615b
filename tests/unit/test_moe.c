/* The mixture of experts' pure parts (engine/model/ffn.h): the router's top-k and
 * weights against an independent sort-based reference (every expert count up to 256,
 * top-k 1..8, each gating, ties, NaN, the weight normalization and scale), and
 * gpt-oss's SwiGLU-OAI with its clamps. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "check.h"
#include "model/ffn.h"

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static double uniform(void) /* [0, 1) */
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (double)(rng_state >> 11) / 9007199254740992.0;
}

/* The reference: scores in double, a stable sort by (score desc, id asc), weights in
 * double. */
static const double *sort_scores;
static int by_score(const void *a, const void *b)
{
    int i = *(const int *)a, j = *(const int *)b;
    if (sort_scores[i] != sort_scores[j])
        return sort_scores[i] > sort_scores[j] ? -1 : 1;
    return i - j;
}

static void ref_route(const float *logits, int E, int k, m40_gating g, int norm, double scale, int *ids, double *w)
{
    double s[256];
    int order[256];
    double max = -INFINITY, sum = 0;
    for (int e = 0; e < E; e++)
        max = fmax(max, logits[e]);
    for (int e = 0; e < E; e++) {
        if (g == M40_GATING_SOFTMAX)
            sum += s[e] = exp((double)logits[e] - max);
        else if (g == M40_GATING_SIGMOID)
            s[e] = 1.0 / (1.0 + exp(-(double)logits[e]));
        else
            s[e] = logits[e];
        order[e] = e;
    }
    if (g == M40_GATING_SOFTMAX)
        for (int e = 0; e < E; e++)
            s[e] /= sum;
    sort_scores = s;
    qsort(order, (size_t)E, sizeof *order, by_score);
    double wsum = 0;
    for (int j = 0; j < k; j++) {
        ids[j] = order[j];
        w[j] = g == M40_GATING_SOFTMAX_SELECTED ? exp(s[order[j]] - s[order[0]]) : s[order[j]];
        wsum += w[j];
    }
    for (int j = 0; j < k; j++) {
        if (g == M40_GATING_SOFTMAX_SELECTED)
            w[j] /= wsum;
    }
    if (norm) {
        double t = 0;
        for (int j = 0; j < k; j++)
            t += w[j];
        for (int j = 0; j < k; j++)
            w[j] /= fmax(t, 6.103515625e-5);
    }
    for (int j = 0; j < k; j++)
        w[j] *= scale;
}

static void test_random_routes(void)
{
    static const m40_gating gatings[] = {M40_GATING_SOFTMAX, M40_GATING_SIGMOID, M40_GATING_SOFTMAX_SELECTED};
    int cases = 0, id_bad = 0, w_bad = 0;
    double worst = 0;
    for (int E = 1; E <= 256; E += E < 16 ? 1 : E < 64 ? 7 : 19) {
        for (int k = 1; k <= 8 && k <= E; k++) {
            for (int gi = 0; gi < 3; gi++) {
                for (int rep = 0; rep < 3; rep++) {
                    float logits[256];
                    /* rep 2: coarse values (multiples of 1/4 in [-2, 2]) so many ties */
                    for (int e = 0; e < E; e++)
                        logits[e] = rep == 2 ? (float)((int)(uniform() * 17) - 8) / 4.0f
                                             : (float)(uniform() * 8.0 - 4.0);
                    int norm = rep == 1, ids_ref[8];
                    float scale = rep == 1 ? 2.5f : 1.0f, w[8];
                    double w_ref[8];
                    int32_t ids[8];
                    m40_moe_route(logits, E, k, gatings[gi], norm, scale, ids, w);
                    ref_route(logits, E, k, gatings[gi], norm, scale, ids_ref, w_ref);
                    cases++;
                    for (int j = 0; j < k; j++) {
                        if (ids[j] != ids_ref[j]) {
                            if (!id_bad++)
                                CHECK(0, "E %d k %d gating %d rep %d: choice %d is %d, reference %d", E, k,
                                      (int)gatings[gi], rep, j, ids[j], ids_ref[j]);
                            break;
                        }
                        double d = fabs(w[j] - w_ref[j]) / fmax(1e-30, fabs(w_ref[j]));
                        worst = fmax(worst, d);
                        if (!(d <= 2e-6) && !w_bad++)
                            CHECK(0, "E %d k %d gating %d rep %d: weight %d is %.9g, reference %.9g", E, k,
                                  (int)gatings[gi], rep, j, w[j], w_ref[j]);
                    }
                }
            }
        }
    }
    CHECK(id_bad == 0 && w_bad == 0, "%d of %d routings differ in ids, %d in weights", id_bad, cases, w_bad);
    printf("random routings: %d cases, worst relative weight error %.3g\n", cases, worst);
}

static void test_ties_and_edges(void)
{
    int32_t ids[8];
    float w[8];
    /* all equal: the lowest ids, in order, equal weights */
    float flat[256];
    for (int e = 0; e < 256; e++)
        flat[e] = 0.5f;
    m40_moe_route(flat, 256, 8, M40_GATING_SOFTMAX, 1, 1.0f, ids, w);
    int ok = 1;
    for (int j = 0; j < 8; j++)
        ok &= ids[j] == j && fabsf(w[j] - 0.125f) < 1e-7f;
    CHECK(ok, "256 equal logits, top-8: ids 0..7 with weight 1/8 each (got %d %d ... %d, %g)", ids[0], ids[1], ids[7],
          w[0]);
    /* a tie for the largest between 5 and 2: 2 first */
    float tie[8] = {0, 1, 3, 0, 2, 3, 1, -1};
    m40_moe_route(tie, 8, 3, M40_GATING_SOFTMAX_SELECTED, 0, 1.0f, ids, w);
    CHECK(ids[0] == 2 && ids[1] == 5 && ids[2] == 4, "tie of 2 and 5, then 4: got %d %d %d", ids[0], ids[1], ids[2]);
    double z = 2 * exp(0.0) + exp(-1.0);
    CHECK(fabs(w[0] - 1 / z) < 1e-6 && fabs(w[1] - 1 / z) < 1e-6 && fabs(w[2] - exp(-1.0) / z) < 1e-6,
          "softmax over the chosen logits: %g %g %g", w[0], w[1], w[2]);
    /* k == n_experts: every expert, by score */
    float few[3] = {-1, 4, 2};
    m40_moe_route(few, 3, 3, M40_GATING_SOFTMAX, 0, 1.0f, ids, w);
    CHECK(ids[0] == 1 && ids[1] == 2 && ids[2] == 0 && fabsf(w[0] + w[1] + w[2] - 1.0f) < 1e-6f,
          "k = n_experts = 3: %d %d %d, weights sum %g", ids[0], ids[1], ids[2], w[0] + w[1] + w[2]);
    /* one expert, top-1: weight 1 for softmax and softmax-selected, sigmoid(x) for sigmoid */
    float one = 0.3f;
    m40_moe_route(&one, 1, 1, M40_GATING_SOFTMAX, 0, 1.0f, ids, w);
    CHECK(ids[0] == 0 && w[0] == 1.0f, "one expert, softmax: weight %g", w[0]);
    m40_moe_route(&one, 1, 1, M40_GATING_SIGMOID, 0, 1.0f, ids, w);
    CHECK(fabsf(w[0] - 1.0f / (1.0f + expf(-0.3f))) < 1e-7f, "one expert, sigmoid: weight %g", w[0]);
    /* NaN logits are chosen last (softmax over the chosen: the others stay finite) */
    float nan_l[4] = {NAN, 1, NAN, 2};
    m40_moe_route(nan_l, 4, 3, M40_GATING_SOFTMAX_SELECTED, 0, 1.0f, ids, w);
    CHECK(ids[0] == 3 && ids[1] == 1 && ids[2] == 0, "NaN logits last: %d %d %d", ids[0], ids[1], ids[2]);
    /* sigmoid scores all near 0: the normalizing sum is clamped at 2^-14 */
    float low[4] = {-30, -31, -32, -33};
    m40_moe_route(low, 4, 2, M40_GATING_SIGMOID, 1, 1.0f, ids, w);
    double s0 = 1 / (1 + exp(30.0));
    CHECK(ids[0] == 0 && ids[1] == 1 && fabs(w[0] - s0 / 6.103515625e-5) < 1e-12,
          "a tiny sum is clamped: w0 %g, want %g", w[0], s0 / 6.103515625e-5);
    /* scale multiplies after the normalization */
    float two[2] = {1, 0};
    m40_moe_route(two, 2, 2, M40_GATING_SIGMOID, 1, 2.5f, ids, w);
    CHECK(fabsf(w[0] + w[1] - 2.5f) < 1e-6f, "normalized then scaled by 2.5: sum %g", w[0] + w[1]);
}

static double swiglu_oai_ref(double g, double u)
{
    g = fmin(g, 7.0);
    u = fmax(-7.0, fmin(u, 7.0));
    return g / (1.0 + exp(-1.702 * g)) * (u + 1.0);
}

static void test_swiglu_oai(void)
{
    /* the clamps: gate only from above, up on both sides */
    CHECK(m40_swiglu_oai(10.0f, 0.0f) == m40_swiglu_oai(7.0f, 0.0f), "gate 10 acts as 7");
    CHECK(m40_swiglu_oai(-10.0f, 0.0f) != m40_swiglu_oai(-7.0f, 0.0f), "gate -10 is not clamped");
    CHECK(m40_swiglu_oai(1.0f, 9.0f) == m40_swiglu_oai(1.0f, 7.0f), "up 9 acts as 7");
    CHECK(m40_swiglu_oai(1.0f, -9.0f) == m40_swiglu_oai(1.0f, -7.0f), "up -9 acts as -7");
    CHECK(fabs(m40_swiglu_oai(1.0f, -9.0f) - swiglu_oai_ref(1, -7)) < 1e-6, "up -9: (u + 1) = -6");
    CHECK(m40_swiglu_oai(2.0f, -1.0f) == 0.0f, "up -1 gives 0");
    CHECK(m40_swiglu_oai(0.0f, 3.0f) == 0.0f, "gate 0 gives 0");
    CHECK(isnan(m40_swiglu_oai(NAN, 1.0f)) && isnan(m40_swiglu_oai(1.0f, NAN)), "NaN stays NaN");
    double worst = 0;
    int clamped = 0;
    for (int i = 0; i < 100000; i++) {
        float g = (float)(uniform() * 24 - 12), u = (float)(uniform() * 24 - 12);
        clamped += g > 7 || u > 7 || u < -7;
        double r = swiglu_oai_ref(g, u), d = fabs(m40_swiglu_oai(g, u) - r) / fmax(1.0, fabs(r));
        worst = fmax(worst, d);
    }
    CHECK(worst < 2e-6, "100000 random (gate, up) in [-12, 12]^2 (%d clamped): worst error %g", clamped, worst);
    /* m40_glu applies it elementwise */
    float gate[3] = {8, -1, 0.5f}, up[3] = {0, 8, -3};
    m40_glu(M40_ACT_SWIGLU_OAI, gate, up, 3);
    CHECK(gate[0] == m40_swiglu_oai(8, 0) && gate[1] == m40_swiglu_oai(-1, 8) && gate[2] == m40_swiglu_oai(0.5f, -3),
          "m40_glu(SWIGLU_OAI) is elementwise m40_swiglu_oai");
}

int main(void)
{
    test_random_routes();
    test_ties_and_edges();
    test_swiglu_oai();
    return check_done();
}
