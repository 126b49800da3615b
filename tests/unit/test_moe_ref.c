/* The CPU twins of the mixture-of-experts kernels (kernels/ref/moe_ref.c) on hand-made
 * cases whose answers are worked out here from the definitions in kernels.h 10: gating
 * kinds, ties and NaN, the grouping's tables, the activations, and a tiny layer in F32. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "check.h"
#include "ref/cpu_ref.h"

static int near(float a, float b) { return fabsf(a - b) <= 1e-6f * (1.0f + fabsf(b)); }

static void test_topk(void)
{
    const float lg[4] = {1.0f, 2.0f, 3.0f, 0.0f};
    int32_t ids[2];
    float w[2];
    const double den = exp(1) + exp(2) + exp(3) + exp(0);
    m40_ref_moe_topk(lg, 1, 4, 2, M40K_MOE_SOFTMAX, NULL, 0, 1.0f, ids, w);
    CHECK(ids[0] == 2 && ids[1] == 1 && near(w[0], (float)(exp(3) / den)) && near(w[1], (float)(exp(2) / den)),
          "softmax top-2: %d %d %g %g", ids[0], ids[1], w[0], w[1]);
    m40_ref_moe_topk(lg, 1, 4, 2, M40K_MOE_SOFTMAX, NULL, 1, 2.0f, ids, w);
    CHECK(near(w[0], (float)(2 * exp(3) / (exp(3) + exp(2)))) && near(w[1], (float)(2 * exp(2) / (exp(3) + exp(2)))),
          "softmax top-2 renormalized, scale 2: %g %g", w[0], w[1]);
    m40_ref_moe_topk(lg, 1, 4, 2, M40K_MOE_SOFTMAX_TOPK, NULL, 0, 1.0f, ids, w);
    CHECK(ids[0] == 2 && near(w[0], (float)(exp(1) / (exp(1) + 1))) && near(w[1], (float)(1 / (exp(1) + 1))),
          "softmax over the chosen (gpt-oss): %g %g", w[0], w[1]);
    /* sigmoid: the bias moves the choice, not the weight */
    const float lg2[2] = {0.0f, 0.1f}, bias[2] = {0.2f, 0.0f};
    m40_ref_moe_topk(lg2, 1, 2, 1, M40K_MOE_SIGMOID, bias, 0, 1.0f, ids, w);
    CHECK(ids[0] == 0 && near(w[0], 0.5f), "sigmoid with selection bias: %d %g", ids[0], w[0]);
    m40_ref_moe_topk(lg2, 1, 2, 1, M40K_MOE_SIGMOID, NULL, 0, 1.0f, ids, w);
    CHECK(ids[0] == 1 && near(w[0], 1.0f / (1.0f + expf(-0.1f))), "sigmoid without bias: %d %g", ids[0], w[0]);
    /* ties to the lower id; NaN after every number */
    const float tie[5] = {0.5f, NAN, 0.5f, 0.5f, -1.0f};
    int32_t id3[4];
    float w3[4];
    m40_ref_moe_topk(tie, 1, 5, 4, M40K_MOE_SOFTMAX, NULL, 0, 1.0f, id3, w3);
    CHECK(id3[0] == 0 && id3[1] == 2 && id3[2] == 3 && id3[3] == 4 && near(w3[0], w3[1]),
          "ties and NaN: %d %d %d %d", id3[0], id3[1], id3[2], id3[3]);
}

static void test_group(void)
{
    const int32_t ids[6] = {3, 1, 3, 0, -1, 1};
    int32_t counts[4], off[5], perm[6], inv[6], tiles[2 * 7];
    CHECK(m40k_moe_max_tiles(6, 4, 2) == 7, "max tiles %d", m40k_moe_max_tiles(6, 4, 2));
    m40_ref_moe_group(ids, 6, 4, 2, counts, off, perm, inv, tiles);
    const int32_t c_w[4] = {1, 2, 0, 2}, o_w[5] = {0, 1, 3, 3, 5}, p_w[6] = {3, 1, 5, 0, 2, -1},
                  i_w[6] = {3, 1, 4, 0, -1, 2}, t_w[14] = {0, 0, 1, 0, 3, 0, -1, 0, -1, 0, -1, 0, -1, 0};
    CHECK(!memcmp(counts, c_w, sizeof c_w) && !memcmp(off, o_w, sizeof o_w), "counts and offsets");
    CHECK(!memcmp(perm, p_w, sizeof p_w) && !memcmp(inv, i_w, sizeof i_w), "perm %d %d %d %d %d %d", perm[0], perm[1],
          perm[2], perm[3], perm[4], perm[5]);
    CHECK(!memcmp(tiles, t_w, sizeof t_w), "tiles");
    /* a group of 5 rows at bm 2: three tiles, rows 0, 2, 4 */
    const int32_t five[5] = {1, 1, 1, 1, 1};
    int32_t c2[2], o2[3], p2[5], i2[5], t2[2 * 7];
    m40_ref_moe_group(five, 5, 2, 2, c2, o2, p2, i2, t2);
    CHECK(t2[0] == 1 && t2[1] == 0 && t2[2] == 1 && t2[3] == 2 && t2[4] == 1 && t2[5] == 4 && t2[6] == -1,
          "tiles of a 5-row group");
}

static void test_act(void)
{
    CHECK(near(m40_ref_moe_act(M40K_GLU_SILU, 1.0f, 2.0f), 2.0f / (1.0f + expf(-1.0f))), "silu");
    /* clamped: g 10 -> 7, u -10 -> -7 */
    CHECK(near(m40_ref_moe_act(M40K_GLU_SWIGLU_OAI, 10.0f, -10.0f), 7.0f / (1.0f + expf(-1.702f * 7.0f)) * -6.0f),
          "swiglu_oai clamps");
    CHECK(near(m40_ref_moe_act(M40K_GLU_SWIGLU_OAI, -1.0f, 0.5f), -1.0f / (1.0f + expf(1.702f)) * 1.5f),
          "swiglu_oai inside the limits");
}

/* Two experts of F32 weights, n_ff 2, dim 2; one token routed to both. */
static void test_layer(void)
{
    const float wg[2][2][2] = {{{1, 0}, {0, 1}}, {{1, 1}, {2, 0}}}, wu[2][2][2] = {{{1, 1}, {1, -1}}, {{0, 1}, {1, 0}}};
    const float wd[2][2][2] = {{{1, 2}, {3, 4}}, {{-1, 0}, {0, 1}}}, gb[2][2] = {{0, 0}, {0.5f, 0}},
                db[2][2] = {{0, 0}, {1, 1}};
    const float x[2] = {1.0f, 2.0f}, wts[2] = {0.25f, 0.75f};
    const int32_t ids[2] = {1, 0};
    float h[2][2], out[2] = {10.0f, 20.0f};
    m40_ref_moe_gate_up(wg, wu, M40K_TYPE_F32, 2, 2, 2, &gb[0][0], NULL, M40K_GLU_SILU, x, 2, ids, 1, 2, &h[0][0], 2);
    /* pair 0, expert 1: g = (3 + 0.5, 2), u = (2, 1); pair 1, expert 0: g = (1, 2), u = (3, -1) */
    const float sg[4] = {3.5f, 2, 1, 2}, su[4] = {2, 1, 3, -1};
    int ok = 1;
    for (int i = 0; i < 4; i++)
        ok &= near((&h[0][0])[i], sg[i] / (1.0f + expf(-sg[i])) * su[i]);
    CHECK(ok, "gate_up: %g %g %g %g", h[0][0], h[0][1], h[1][0], h[1][1]);
    m40_ref_moe_down(wd, M40K_TYPE_F32, 2, 2, 2, &db[0][0], &h[0][0], 2, ids, wts, 1, 2, out, 2, 1);
    const float o0 = 10.0f + 0.25f * (-h[0][0] + 1) + 0.75f * (h[1][0] + 2 * h[1][1]);
    const float o1 = 20.0f + 0.25f * (h[0][1] + 1) + 0.75f * (3 * h[1][0] + 4 * h[1][1]);
    CHECK(near(out[0], o0) && near(out[1], o1), "down, weighted, biased, accumulated: %g %g (%g %g)", out[0], out[1],
          o0, o1);
}

int main(void)
{
    test_topk();
    test_group();
    test_act();
    test_layer();
    return check_done();
}
