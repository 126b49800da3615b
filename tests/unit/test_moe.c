/* The mixture of experts (engine/model/ffn.h): the router's top-k and weights against
 * an independent sort-based reference (every expert count up to 256, top-k 1..8, each
 * gating, ties, NaN, the weight normalization and scale); gpt-oss's SwiGLU-OAI with its
 * clamps; and a whole MoE layer through the loader and m40_model_forward against a
 * double-precision forward pass written here (a synthetic one-layer qwen3moe file with
 * a sigmoid-gated shared expert, under each gating and the metadata that overrides the
 * row: expert_gating_func, expert_weights_norm, expert_weights_scale). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <unistd.h>

#include "check.h"
#include "gguf/gguf_writer.h"
#include "model/ffn.h"
#include "model/model.h"
#include "ref/ggml_types.h"

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

/* ---- one MoE layer against a double-precision reference ---- */

enum { D = 32, HEADS = 2, HD = 16, E = 6, K = 2, F = 32, S = 32, NV = 3 + 256 + 4 };

typedef struct {
    float embd[NV][D], out[NV][D], out_norm[D];
    float attn_norm[D], q_norm[HD], k_norm[HD], ffn_norm[D];
    float wq[HEADS * HD][D], wk[HD][D], wv[HD][D], wo[D][HEADS * HD];
    float router[E][D], gate[E][F][D], up[E][F][D], down[E][D][F];
    float sh_gate[S][D], sh_up[S][D], sh_down[D][S], sh_gate_inp[D];
} moe_weights;

typedef struct {
    int gating;      /* 0: the row's default (softmax) */
    int norm;        /* -1: the row's default (renormalize) */
    float scale;     /* 0: absent */
    int shared;      /* shared expert tensors present */
} moe_variant;

static void fill(float *x, size_t n, double amp)
{
    for (size_t i = 0; i < n; i++)
        x[i] = (float)((uniform() * 2 - 1) * amp);
}

static void add_t(m40_gguf_writer *w, const char *name, const void *data, uint64_t n0, uint64_t n1, uint64_t n2)
{
    uint64_t ne[3] = {n0, n1, n2};
    m40_gguf_writer_add_tensor(w, name, M40_TYPE_F32, n2 > 1 ? 3 : n1 > 1 ? 2 : 1, ne, data,
                               n0 * n1 * n2 * sizeof(float));
}

static int write_moe_model(const moe_weights *W, const moe_variant *v, const char *path)
{
    m40_gguf_writer *w = m40_gguf_writer_new();
    m40_gguf_writer_set_str(w, "general.architecture", "qwen3moe");
    m40_gguf_writer_set_u32(w, "qwen3moe.context_length", 64);
    m40_gguf_writer_set_u32(w, "qwen3moe.embedding_length", D);
    m40_gguf_writer_set_u32(w, "qwen3moe.block_count", 1);
    m40_gguf_writer_set_u32(w, "qwen3moe.feed_forward_length", 96);
    m40_gguf_writer_set_u32(w, "qwen3moe.attention.head_count", HEADS);
    m40_gguf_writer_set_u32(w, "qwen3moe.attention.head_count_kv", 1);
    m40_gguf_writer_set_u32(w, "qwen3moe.attention.key_length", HD);
    m40_gguf_writer_set_u32(w, "qwen3moe.attention.value_length", HD);
    m40_gguf_writer_set_f32(w, "qwen3moe.attention.layer_norm_rms_epsilon", 1e-6f);
    m40_gguf_writer_set_u32(w, "qwen3moe.expert_count", E);
    m40_gguf_writer_set_u32(w, "qwen3moe.expert_used_count", K);
    m40_gguf_writer_set_u32(w, "qwen3moe.expert_feed_forward_length", F);
    if (v->gating)
        m40_gguf_writer_set_u32(w, "qwen3moe.expert_gating_func", (uint32_t)v->gating);
    if (v->norm >= 0)
        m40_gguf_writer_set_bool(w, "qwen3moe.expert_weights_norm", v->norm);
    if (v->scale)
        m40_gguf_writer_set_f32(w, "qwen3moe.expert_weights_scale", v->scale);
    /* a SentencePiece-style vocabulary: specials, the 256 byte pieces, 4 words */
    const char *words[] = {"\xe2\x96\x81" "a", "\xe2\x96\x81" "b", "\xe2\x96\x81" "c", "\xe2\x96\x81" "d"};
    static char tok_text[NV][16];
    const char *toks[NV];
    float scores[NV];
    int32_t types[NV];
    for (int i = 0; i < NV; i++) {
        if (i < 3)
            snprintf(tok_text[i], 16, "%s", i == 0 ? "<unk>" : i == 1 ? "<s>" : "</s>");
        else if (i < 259)
            snprintf(tok_text[i], 16, "<0x%02X>", i - 3);
        else
            snprintf(tok_text[i], 16, "%s", words[i - 259]);
        toks[i] = tok_text[i];
        types[i] = i == 0 ? 2 : i < 3 ? 3 : i < 259 ? 6 : 1;
        scores[i] = i < 259 ? 0.0f : -(float)(i - 258);
    }
    m40_gguf_writer_set_str(w, "tokenizer.ggml.model", "llama");
    m40_gguf_writer_set_arr_str(w, "tokenizer.ggml.tokens", toks, NV);
    m40_gguf_writer_set_arr_f32(w, "tokenizer.ggml.scores", scores, NV);
    m40_gguf_writer_set_arr_i32(w, "tokenizer.ggml.token_type", types, NV);
    add_t(w, "token_embd.weight", W->embd, D, NV, 1);
    add_t(w, "output.weight", W->out, D, NV, 1);
    add_t(w, "output_norm.weight", W->out_norm, D, 1, 1);
    add_t(w, "blk.0.attn_norm.weight", W->attn_norm, D, 1, 1);
    add_t(w, "blk.0.attn_q_norm.weight", W->q_norm, HD, 1, 1);
    add_t(w, "blk.0.attn_k_norm.weight", W->k_norm, HD, 1, 1);
    add_t(w, "blk.0.ffn_norm.weight", W->ffn_norm, D, 1, 1);
    add_t(w, "blk.0.attn_q.weight", W->wq, D, HEADS * HD, 1);
    add_t(w, "blk.0.attn_k.weight", W->wk, D, HD, 1);
    add_t(w, "blk.0.attn_v.weight", W->wv, D, HD, 1);
    add_t(w, "blk.0.attn_output.weight", W->wo, HEADS * HD, D, 1);
    add_t(w, "blk.0.ffn_gate_inp.weight", W->router, D, E, 1);
    add_t(w, "blk.0.ffn_gate_exps.weight", W->gate, D, F, E);
    add_t(w, "blk.0.ffn_up_exps.weight", W->up, D, F, E);
    add_t(w, "blk.0.ffn_down_exps.weight", W->down, F, D, E);
    if (v->shared) {
        add_t(w, "blk.0.ffn_gate_shexp.weight", W->sh_gate, D, S, 1);
        add_t(w, "blk.0.ffn_up_shexp.weight", W->sh_up, D, S, 1);
        add_t(w, "blk.0.ffn_down_shexp.weight", W->sh_down, S, D, 1);
        add_t(w, "blk.0.ffn_gate_inp_shexp.weight", W->sh_gate_inp, D, 1, 1);
    }
    char err[256];
    int rc = m40_gguf_writer_write_file(w, path, err, sizeof err);
    CHECK(rc == 0, "writing the MoE model: %s", err);
    m40_gguf_writer_free(w);
    return rc;
}

static void rms(double *out, const double *x, const float *w, int n)
{
    double ss = 0;
    for (int i = 0; i < n; i++)
        ss += x[i] * x[i];
    double sc = 1.0 / sqrt(ss / n + 1e-6);
    for (int i = 0; i < n; i++)
        out[i] = x[i] * sc * w[i];
}

static double dsilu(double x) { return x / (1 + exp(-x)); }

/* One token at position 0: attention over itself is its own v in every head (the
 * softmax of one score is 1), so the layer is x + Wo [v, v], then the MoE. */
static void ref_logits(const moe_weights *W, const moe_variant *v, int tok, double *logits)
{
    double x[D], n[D], val[HD], att[HEADS * HD], m[D], y[D] = {0};
    for (int i = 0; i < D; i++)
        x[i] = W->embd[tok][i];
    rms(n, x, W->attn_norm, D);
    for (int r = 0; r < HD; r++) {
        val[r] = 0;
        for (int c = 0; c < D; c++)
            val[r] += (double)W->wv[r][c] * n[c];
    }
    for (int h = 0; h < HEADS; h++)
        for (int d = 0; d < HD; d++)
            att[h * HD + d] = val[d];
    for (int r = 0; r < D; r++)
        for (int c = 0; c < HEADS * HD; c++)
            x[r] += (double)W->wo[r][c] * att[c];
    rms(m, x, W->ffn_norm, D);
    float lg[E];
    for (int e = 0; e < E; e++) {
        double a = 0;
        for (int c = 0; c < D; c++)
            a += (double)W->router[e][c] * m[c];
        lg[e] = (float)a;
    }
    int gating = v->gating ? v->gating : M40_GATING_SOFTMAX, ids[K];
    double wt[K];
    ref_route(lg, E, K, (m40_gating)gating, v->norm < 0 ? 1 : v->norm, v->scale ? v->scale : 1.0, ids, wt);
    for (int j = 0; j < K; j++) {
        int e = ids[j];
        double h[F];
        for (int f = 0; f < F; f++) {
            double g = 0, u = 0;
            for (int c = 0; c < D; c++) {
                g += (double)W->gate[e][f][c] * m[c];
                u += (double)W->up[e][f][c] * m[c];
            }
            h[f] = dsilu(g) * u;
        }
        for (int r = 0; r < D; r++) {
            double o = 0;
            for (int f = 0; f < F; f++)
                o += (double)W->down[e][r][f] * h[f];
            y[r] += wt[j] * o;
        }
    }
    if (v->shared) {
        double h[S], gsum = 0;
        for (int c = 0; c < D; c++)
            gsum += (double)W->sh_gate_inp[c] * m[c];
        double gate = 1 / (1 + exp(-gsum));
        for (int f = 0; f < S; f++) {
            double g = 0, u = 0;
            for (int c = 0; c < D; c++) {
                g += (double)W->sh_gate[f][c] * m[c];
                u += (double)W->sh_up[f][c] * m[c];
            }
            h[f] = dsilu(g) * u;
        }
        for (int r = 0; r < D; r++) {
            double o = 0;
            for (int f = 0; f < S; f++)
                o += (double)W->sh_down[r][f] * h[f];
            y[r] += gate * o;
        }
    }
    for (int i = 0; i < D; i++)
        x[i] += y[i];
    rms(n, x, W->out_norm, D);
    for (int t = 0; t < NV; t++) {
        double a = 0;
        for (int c = 0; c < D; c++)
            a += (double)W->out[t][c] * n[c];
        logits[t] = a;
    }
}

static void test_moe_layer(void)
{
    static moe_weights W;
    fill(&W.embd[0][0], sizeof W.embd / sizeof(float), 1.0);
    fill(&W.out[0][0], sizeof W.out / sizeof(float), 0.3);
    float *ones[] = {W.out_norm, W.attn_norm, W.ffn_norm};
    for (int i = 0; i < 3; i++)
        for (int d = 0; d < D; d++)
            ones[i][d] = (float)(1.0 + 0.2 * (uniform() - 0.5));
    for (int d = 0; d < HD; d++)
        W.q_norm[d] = W.k_norm[d] = 1.0f;
    fill(&W.wq[0][0], sizeof W.wq / sizeof(float), 0.3);
    fill(&W.wk[0][0], sizeof W.wk / sizeof(float), 0.3);
    fill(&W.wv[0][0], sizeof W.wv / sizeof(float), 0.3);
    fill(&W.wo[0][0], sizeof W.wo / sizeof(float), 0.2);
    fill(&W.router[0][0], sizeof W.router / sizeof(float), 0.6);
    fill(&W.gate[0][0][0], sizeof W.gate / sizeof(float), 0.3);
    fill(&W.up[0][0][0], sizeof W.up / sizeof(float), 0.3);
    fill(&W.down[0][0][0], sizeof W.down / sizeof(float), 0.3);
    fill(&W.sh_gate[0][0], sizeof W.sh_gate / sizeof(float), 0.3);
    fill(&W.sh_up[0][0], sizeof W.sh_up / sizeof(float), 0.3);
    fill(&W.sh_down[0][0], sizeof W.sh_down / sizeof(float), 0.3);
    fill(W.sh_gate_inp, D, 0.3);
    static const moe_variant variants[] = {
        {0, -1, 0, 1},                       /* the row: softmax, renormalized, shared expert */
        {0, -1, 0, 0},                       /* without the shared expert */
        {M40_GATING_SIGMOID, 0, 2.5f, 1},    /* sigmoid, not normalized, scaled by 2.5 */
        /* a softmax over the chosen logits is the renormalized softmax of the row: the
         * scale 0.5 makes the reference differ from the first */
        {M40_GATING_SOFTMAX_SELECTED, 0, 0.5f, 1},
        {M40_GATING_SOFTMAX, 0, 0, 0},       /* softmax probabilities as they are */
    };
    char path[] = "/tmp/m40-test-moe-XXXXXX";
    int fd = mkstemp(path);
    if (fd < 0) {
        SKIP("cannot create a temporary file");
        return;
    }
    close(fd);
    static double ref[5][NV];
    static float got[NV][NV];
    for (size_t vi = 0; vi < sizeof variants / sizeof variants[0]; vi++) {
        const moe_variant *v = &variants[vi];
        if (write_moe_model(&W, v, path))
            continue;
        m40_model *m = NULL;
        char err[512];
        if (m40_model_load(path, 2, &m, err, sizeof err)) {
            CHECK(0, "variant %zu: load: %s", vi, err);
            continue;
        }
        const m40_model_params *p = m40_model_get_params(m);
        CHECK(p->n_experts == E && p->n_experts_used == K && p->expert_ffn_dim == F &&
                  p->shared_ffn_dim == (v->shared ? S : 0),
              "variant %zu: %d experts, %d used, ffn %d, shared %d", vi, (int)p->n_experts, (int)p->n_experts_used,
              (int)p->expert_ffn_dim, (int)p->shared_ffn_dim);
        /* every token of the vocabulary at position 0 of its own slot, in one call */
        int32_t tok[NV], pos[NV] = {0}, slot[NV];
        uint8_t want[NV];
        for (int t = 0; t < NV; t++)
            tok[t] = t, slot[t] = t, want[t] = 1;
        m40_kv *kv = m40_kv_new(m, NV, 4);
        m40_batch b = {.n = NV, .tokens = tok, .pos = pos, .slot = slot, .want_logits = want};
        int rc = kv ? m40_model_forward(m, kv, &b, &got[0][0], err, sizeof err) : -1;
        CHECK(rc == 0, "variant %zu: forward: %s", vi, err);
        double worst = 0, spread = 0;
        for (int t = 0; rc == 0 && t < NV; t++) {
            double r[NV];
            ref_logits(&W, v, t, r);
            if (t == 5)
                for (int i = 0; i < NV; i++)
                    ref[vi][i] = r[i];
            for (int i = 0; i < NV; i++) {
                worst = fmax(worst, fabs(got[t][i] - r[i]));
                spread = fmax(spread, fabs(r[i]));
            }
        }
        CHECK(rc == 0 && worst < 1e-4 * fmax(1.0, spread),
              "variant %zu: %d tokens, max |dlogit| %.3g (logits up to %.3g)", vi, NV, worst, spread);
        printf("MoE layer variant %zu (gating %d, norm %d, scale %g, shared %d): max |dlogit| %.3g over %d tokens\n",
               vi, v->gating, v->norm, v->scale, v->shared, worst, NV);
        m40_kv_free(kv);
        m40_model_free(m);
    }
    /* each variant's reference differs from the first's, so each comparison can fail */
    for (int vi = 1; vi < 5; vi++) {
        double d = 0;
        for (int i = 0; i < NV; i++)
            d = fmax(d, fabs(ref[vi][i] - ref[0][i]));
        CHECK(d > 1e-2, "variant %d's logits differ from variant 0's (max %.3g)", vi, d);
    }
    unlink(path);
}

int main(void)
{
    test_moe_layer();
    test_random_routes();
    test_ties_and_edges();
    test_swiglu_oai();
    return check_done();
}
