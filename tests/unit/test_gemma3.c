/* Gemma 3 on the CPU (engine/model/model.c, its arch.h row).
 *
 * A tiny synthetic gemma3 GGUF (random F32 weights, head_dim != n_embd / n_head, GQA,
 * sliding window 3 with every 3rd layer global, distinct local and global RoPE bases)
 * is run through m40_model_forward and compared with a naive full-sequence forward
 * pass written here from the Gemma 3 definition in double precision. Also: batched
 * equals unbatched bitwise, the window and the local RoPE base each matter (so the
 * comparison can fail), the metadata forms of the layer pattern, load errors, and the
 * real Gemma 3 270M when scripts/fetch-gemma3.sh has fetched it (its reference
 * comparison is tests/cli/gemma3.sh). */
#include <math.h>
#include <stdint.h>
#include <unistd.h>

#include "check.h"
#include "ref/ggml_types.h"
#include "gguf/gguf_writer.h"
#include "model/model.h"
#include "tokenizer/tokenizer.h"

enum { DIM = 32, HEADS = 2, KV_HEADS = 1, HD = 24, FFN = 48, LAYERS = 3, WINDOW = 3, SEQ = 9 };
#define GLOBAL_BASE 100.0
#define LOCAL_BASE 10000.0 /* Gemma 3's local base: the default when the file has none */
#define EPS 1e-6

/* ---- the synthetic model ---- */

typedef struct {
    int n_vocab;
    float *embd;                     /* [vocab][DIM] */
    float *out_norm;
    struct {
        float *attn_norm, *q_norm, *k_norm, *post_attn_norm, *ffn_norm, *post_ffw_norm;
        float *wq, *wk, *wv, *wo, *gate, *up, *down;   /* [rows][cols] */
    } l[LAYERS];
} weights;

static uint64_t rng = 0x9e3779b97f4a7c15ull;
static float frand(void) /* uniform in [-1, 1) */
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (float)((rng >> 11) * (1.0 / 9007199254740992.0)) * 2.0f - 1.0f;
}
static float *rand_vec(size_t n, float center, float spread)
{
    float *v = malloc(n * sizeof *v);
    for (size_t i = 0; i < n; i++)
        v[i] = center + spread * frand();
    return v;
}

static void make_weights(weights *w, int n_vocab)
{
    w->n_vocab = n_vocab;
    w->embd = rand_vec((size_t)n_vocab * DIM, 0, 0.5f);
    w->out_norm = rand_vec(DIM, 1, 0.3f);
    for (int l = 0; l < LAYERS; l++) {
        w->l[l].attn_norm = rand_vec(DIM, 1, 0.3f);
        w->l[l].q_norm = rand_vec(HD, 1, 0.3f);
        w->l[l].k_norm = rand_vec(HD, 1, 0.3f);
        w->l[l].post_attn_norm = rand_vec(DIM, 1, 0.3f);
        w->l[l].ffn_norm = rand_vec(DIM, 1, 0.3f);
        w->l[l].post_ffw_norm = rand_vec(DIM, 1, 0.3f);
        w->l[l].wq = rand_vec((size_t)HEADS * HD * DIM, 0, 0.4f);
        w->l[l].wk = rand_vec((size_t)KV_HEADS * HD * DIM, 0, 0.4f);
        w->l[l].wv = rand_vec((size_t)KV_HEADS * HD * DIM, 0, 0.4f);
        w->l[l].wo = rand_vec((size_t)DIM * HEADS * HD, 0, 0.3f);
        w->l[l].gate = rand_vec((size_t)FFN * DIM, 0, 0.4f);
        w->l[l].up = rand_vec((size_t)FFN * DIM, 0, 0.4f);
        w->l[l].down = rand_vec((size_t)DIM * FFN, 0, 0.3f);
    }
}

static void free_weights(weights *w)
{
    free(w->embd);
    free(w->out_norm);
    for (int l = 0; l < LAYERS; l++) {
        float *v[] = {w->l[l].attn_norm, w->l[l].q_norm, w->l[l].k_norm, w->l[l].post_attn_norm, w->l[l].ffn_norm,
                      w->l[l].post_ffw_norm, w->l[l].wq, w->l[l].wk, w->l[l].wv, w->l[l].wo, w->l[l].gate,
                      w->l[l].up, w->l[l].down};
        for (size_t i = 0; i < sizeof v / sizeof v[0]; i++)
            free(v[i]);
    }
}

typedef struct {
    const char *drop_tensor;
    const char *drop_key;
    const char *rope_scaling;   /* gemma3.rope.scaling.type */
    int pattern;                /* 0: no pattern key (default period 6); >0: u32 period; -1: bool array */
} variant;

static void add_f32(m40_gguf_writer *wr, const char *name, const float *data, uint64_t cols, uint64_t rows,
                    const variant *v)
{
    if (v->drop_tensor && !strcmp(v->drop_tensor, name))
        return;
    uint64_t ne[2] = {cols, rows};
    m40_gguf_writer_add_tensor(wr, name, M40_TYPE_F32, rows > 1 ? 2 : 1, ne, data, cols * rows * sizeof(float));
}

static void set_u32(m40_gguf_writer *wr, const char *key, uint32_t val, const variant *v)
{
    if (!v->drop_key || strcmp(v->drop_key, key))
        m40_gguf_writer_set_u32(wr, key, val);
}

/* Vocabulary: <unk> <s> </s>, the 256 byte tokens, then a few words. */
static int write_model(const weights *w, const variant *v, const char *path, char *err, size_t errlen)
{
    m40_gguf_writer *wr = m40_gguf_writer_new();
    m40_gguf_writer_set_str(wr, "general.architecture", "gemma3");
    m40_gguf_writer_set_str(wr, "general.name", "tiny gemma3 test");
    set_u32(wr, "gemma3.context_length", 64, v);
    set_u32(wr, "gemma3.embedding_length", DIM, v);
    set_u32(wr, "gemma3.block_count", LAYERS, v);
    set_u32(wr, "gemma3.feed_forward_length", FFN, v);
    set_u32(wr, "gemma3.attention.head_count", HEADS, v);
    set_u32(wr, "gemma3.attention.head_count_kv", KV_HEADS, v);
    set_u32(wr, "gemma3.attention.key_length", HD, v);
    set_u32(wr, "gemma3.attention.value_length", HD, v);
    set_u32(wr, "gemma3.attention.sliding_window", WINDOW, v);
    m40_gguf_writer_set_f32(wr, "gemma3.attention.layer_norm_rms_epsilon", (float)EPS);
    m40_gguf_writer_set_f32(wr, "gemma3.rope.freq_base", (float)GLOBAL_BASE);
    if (v->rope_scaling)
        m40_gguf_writer_set_str(wr, "gemma3.rope.scaling.type", v->rope_scaling);
    if (v->pattern > 0) {
        m40_gguf_writer_set_u32(wr, "gemma3.attention.sliding_window_pattern", (uint32_t)v->pattern);
    } else if (v->pattern < 0) {
        uint8_t local[LAYERS];
        for (int l = 0; l < LAYERS; l++)
            local[l] = (l + 1) % 3 != 0;
        m40_gguf_writer_set_arr(wr, "gemma3.attention.sliding_window_pattern", M40_GGUF_BOOL, local, LAYERS);
    }

#define SP "\xe2\x96\x81" /* SentencePiece's space mark */
    const char *words[] = {SP "the", SP "cat", SP "sat", SP "on", SP "mat", SP "a", SP "dog", SP "ran"};
#undef SP
    int n_words = (int)(sizeof words / sizeof words[0]);
    int n = 3 + 256 + n_words;
    char **toks = malloc((size_t)n * sizeof *toks);
    float *scores = malloc((size_t)n * sizeof *scores);
    int32_t *types = malloc((size_t)n * sizeof *types);
    const char *special[] = {"<unk>", "<s>", "</s>"};
    for (int i = 0; i < n; i++) {
        toks[i] = malloc(16);
        if (i < 3) {
            snprintf(toks[i], 16, "%s", special[i]);
            types[i] = i == 0 ? 2 : 3;
        } else if (i < 259) {
            snprintf(toks[i], 16, "<0x%02X>", i - 3);
            types[i] = 6;
        } else {
            snprintf(toks[i], 16, "%s", words[i - 259]);
            types[i] = 1;
        }
        scores[i] = i < 259 ? 0.0f : -(float)(i - 259);
    }
    m40_gguf_writer_set_str(wr, "tokenizer.ggml.model", "llama");
    m40_gguf_writer_set_arr_str(wr, "tokenizer.ggml.tokens", (const char *const *)toks, (uint64_t)n);
    m40_gguf_writer_set_arr_f32(wr, "tokenizer.ggml.scores", scores, (uint64_t)n);
    m40_gguf_writer_set_arr_i32(wr, "tokenizer.ggml.token_type", types, (uint64_t)n);
    m40_gguf_writer_set_u32(wr, "tokenizer.ggml.unknown_token_id", 0);
    m40_gguf_writer_set_u32(wr, "tokenizer.ggml.bos_token_id", 1);
    m40_gguf_writer_set_u32(wr, "tokenizer.ggml.eos_token_id", 2);
    for (int i = 0; i < n; i++)
        free(toks[i]);
    free(toks);
    free(scores);
    free(types);

    add_f32(wr, "token_embd.weight", w->embd, DIM, (uint64_t)w->n_vocab, v);
    add_f32(wr, "output_norm.weight", w->out_norm, DIM, 1, v);
    for (int l = 0; l < LAYERS; l++) {
        char name[64];
#define T(s, data, cols, rows) (snprintf(name, sizeof name, "blk.%d.%s", l, s), add_f32(wr, name, data, cols, rows, v))
        T("attn_norm.weight", w->l[l].attn_norm, DIM, 1);
        T("attn_q_norm.weight", w->l[l].q_norm, HD, 1);
        T("attn_k_norm.weight", w->l[l].k_norm, HD, 1);
        T("post_attention_norm.weight", w->l[l].post_attn_norm, DIM, 1);
        T("ffn_norm.weight", w->l[l].ffn_norm, DIM, 1);
        T("post_ffw_norm.weight", w->l[l].post_ffw_norm, DIM, 1);
        T("attn_q.weight", w->l[l].wq, DIM, HEADS * HD);
        T("attn_k.weight", w->l[l].wk, DIM, KV_HEADS * HD);
        T("attn_v.weight", w->l[l].wv, DIM, KV_HEADS * HD);
        T("attn_output.weight", w->l[l].wo, HEADS * HD, DIM);
        T("ffn_gate.weight", w->l[l].gate, DIM, FFN);
        T("ffn_up.weight", w->l[l].up, DIM, FFN);
        T("ffn_down.weight", w->l[l].down, FFN, DIM);
#undef T
    }
    int rc = m40_gguf_writer_write_file(wr, path, err, errlen);
    m40_gguf_writer_free(wr);
    return rc;
}

/* ---- naive reference: the whole sequence at once, double precision ---- */

static void nrms(double *x, const float *w, int n)
{
    double ss = 0;
    for (int i = 0; i < n; i++)
        ss += x[i] * x[i];
    double s = 1.0 / sqrt(ss / n + EPS);
    for (int i = 0; i < n; i++)
        x[i] = x[i] * s * w[i];
}

static void nmatvec(const float *W, int rows, int cols, const double *x, double *y)
{
    for (int r = 0; r < rows; r++) {
        double s = 0;
        for (int c = 0; c < cols; c++)
            s += (double)W[(size_t)r * cols + c] * x[c];
        y[r] = s;
    }
}

static void nrope(double *v, int pos, double base)
{
    for (int i = 0; i < HD / 2; i++) {
        double th = pos * pow(base, -2.0 * i / HD), a = v[i], b = v[i + HD / 2];
        v[i] = a * cos(th) - b * sin(th);
        v[i + HD / 2] = a * sin(th) + b * cos(th);
    }
}

/* Log-probabilities after each of the n tokens. window: the local layers' window (a
 * huge value turns it off); local_base: their RoPE base. Local layers: 0 and 1. */
static void naive_logprobs(const weights *w, const int32_t *tok, int n, int window, double local_base, double *lp)
{
    static double x[SEQ][DIM], K[SEQ][KV_HEADS * HD], V[SEQ][KV_HEADS * HD], Q[SEQ][HEADS * HD];
    for (int t = 0; t < n; t++)
        for (int d = 0; d < DIM; d++)
            x[t][d] = w->embd[(size_t)tok[t] * DIM + d] * sqrt((double)DIM);
    for (int l = 0; l < LAYERS; l++) {
        int local = l != 2;
        double base = local ? local_base : GLOBAL_BASE;
        for (int t = 0; t < n; t++) {
            double h[DIM];
            memcpy(h, x[t], sizeof h);
            nrms(h, w->l[l].attn_norm, DIM);
            nmatvec(w->l[l].wq, HEADS * HD, DIM, h, Q[t]);
            nmatvec(w->l[l].wk, KV_HEADS * HD, DIM, h, K[t]);
            nmatvec(w->l[l].wv, KV_HEADS * HD, DIM, h, V[t]);
            for (int hh = 0; hh < HEADS; hh++) {
                nrms(Q[t] + hh * HD, w->l[l].q_norm, HD);
                nrope(Q[t] + hh * HD, t, base);
            }
            for (int hh = 0; hh < KV_HEADS; hh++) {
                nrms(K[t] + hh * HD, w->l[l].k_norm, HD);
                nrope(K[t] + hh * HD, t, base);
            }
        }
        for (int t = 0; t < n; t++) {
            double att[HEADS * HD] = {0};
            for (int hh = 0; hh < HEADS; hh++) {
                int kh = hh / (HEADS / KV_HEADS);
                double sc[SEQ], mx = -INFINITY, sum = 0;
                int first = local && t - window + 1 > 0 ? t - window + 1 : 0;
                for (int s = first; s <= t; s++) {
                    double d = 0;
                    for (int i = 0; i < HD; i++)
                        d += Q[t][hh * HD + i] * K[s][kh * HD + i];
                    sc[s] = d / sqrt((double)HD);
                    mx = sc[s] > mx ? sc[s] : mx;
                }
                for (int s = first; s <= t; s++)
                    sum += (sc[s] = exp(sc[s] - mx));
                for (int s = first; s <= t; s++)
                    for (int i = 0; i < HD; i++)
                        att[hh * HD + i] += sc[s] / sum * V[s][kh * HD + i];
            }
            double o[DIM], h[DIM], g[FFN], u[FFN], dn[DIM];
            nmatvec(w->l[l].wo, DIM, HEADS * HD, att, o);
            nrms(o, w->l[l].post_attn_norm, DIM);
            for (int d = 0; d < DIM; d++)
                o[d] += x[t][d];           /* o is now h = x + post_norm(attn) */
            memcpy(h, o, sizeof h);
            nrms(h, w->l[l].ffn_norm, DIM);
            nmatvec(w->l[l].gate, FFN, DIM, h, g);
            nmatvec(w->l[l].up, FFN, DIM, h, u);
            for (int i = 0; i < FFN; i++)
                g[i] = 0.5 * g[i] * (1 + tanh(sqrt(2 / M_PI) * (g[i] + 0.044715 * g[i] * g[i] * g[i]))) * u[i];
            nmatvec(w->l[l].down, DIM, FFN, g, dn);
            nrms(dn, w->l[l].post_ffw_norm, DIM);
            /* x[t] is still needed by no later token of this layer (K/V are computed) */
            for (int d = 0; d < DIM; d++)
                x[t][d] = o[d] + dn[d];
        }
    }
    for (int t = 0; t < n; t++) {
        double h[DIM], mx = -INFINITY, sum = 0;
        memcpy(h, x[t], sizeof h);
        nrms(h, w->out_norm, DIM);
        double *out = lp + (size_t)t * w->n_vocab;
        nmatvec(w->embd, w->n_vocab, DIM, h, out);
        for (int i = 0; i < w->n_vocab; i++)
            mx = out[i] > mx ? out[i] : mx;
        for (int i = 0; i < w->n_vocab; i++)
            sum += exp(out[i] - mx);
        for (int i = 0; i < w->n_vocab; i++)
            out[i] -= mx + log(sum);
    }
}

/* ---- engine side ---- */

static double max_lp_diff(const float *logits, const double *lp, int rows, int n_vocab)
{
    double worst = 0;
    for (int t = 0; t < rows; t++) {
        const float *y = logits + (size_t)t * n_vocab;
        double mx = -INFINITY, sum = 0;
        for (int i = 0; i < n_vocab; i++)
            mx = y[i] > mx ? y[i] : mx;
        for (int i = 0; i < n_vocab; i++)
            sum += exp(y[i] - mx);
        for (int i = 0; i < n_vocab; i++) {
            double d = fabs(y[i] - mx - log(sum) - lp[(size_t)t * n_vocab + i]);
            if (!(d <= worst))
                worst = isnan(d) ? INFINITY : d;
        }
    }
    return worst;
}

static int forward_rows(m40_model *m, m40_kv *kv, const int32_t *tok, int n, int pos0, float *logits)
{
    int32_t pos[SEQ], slot[SEQ];
    uint8_t want[SEQ];
    for (int i = 0; i < n; i++) {
        pos[i] = pos0 + i;
        slot[i] = 0;
        want[i] = 1;
    }
    m40_batch b = {.n = n, .tokens = tok, .pos = pos, .slot = slot, .want_logits = want};
    char err[256];
    int rc = m40_model_forward(m, kv, &b, logits, err, sizeof err);
    if (rc)
        fprintf(stderr, "forward: %s\n", err);
    return rc;
}

static char tmp_path[] = "/tmp/m40-test-gemma3-XXXXXX";

static m40_model *load_variant(const weights *w, const variant *v, char *err, size_t errlen)
{
    if (write_model(w, v, tmp_path, err, errlen)) {
        CHECK(0, "writing the model: %s", err);
        return NULL;
    }
    m40_model *m = NULL;
    if (m40_model_load(tmp_path, 2, &m, err, errlen))
        return NULL;
    return m;
}

static void test_synthetic(const weights *w)
{
    static const int32_t tok[SEQ] = {1, 259, 260, 261, 262, 100, 263, 264, 265};
    char err[512];
    int nv = w->n_vocab;
    double *lp = malloc((size_t)SEQ * nv * sizeof *lp), *lp_nowin = malloc((size_t)SEQ * nv * sizeof *lp),
           *lp_base = malloc((size_t)SEQ * nv * sizeof *lp);
    float *all = malloc((size_t)SEQ * nv * sizeof *all), *one = malloc((size_t)SEQ * nv * sizeof *one);
    naive_logprobs(w, tok, SEQ, WINDOW, LOCAL_BASE, lp);
    naive_logprobs(w, tok, SEQ, 1 << 20, LOCAL_BASE, lp_nowin);
    naive_logprobs(w, tok, SEQ, WINDOW, GLOBAL_BASE, lp_base);

    /* The layer pattern as a period of 3 and as a bool array: the same model. */
    variant forms[] = {{.pattern = 3}, {.pattern = -1}};
    for (size_t f = 0; f < sizeof forms / sizeof forms[0]; f++) {
        m40_model *m = load_variant(w, &forms[f], err, sizeof err);
        CHECK(m != NULL, "load (pattern form %zu): %s", f, err);
        if (!m)
            continue;
        const m40_model_params *p = m40_model_get_params(m);
        CHECK(!strcmp(p->arch, "gemma3") && p->head_dim == HD && p->n_kv_heads == KV_HEADS && p->tied_output &&
                  p->rope_neox && p->n_vocab == nv,
              "params: arch %s head_dim %d kv_heads %d tied %d neox %d", p->arch, p->head_dim, p->n_kv_heads,
              p->tied_output, p->rope_neox);
        m40_kv *kv = m40_kv_new(m, 1, 16);
        CHECK(kv && forward_rows(m, kv, tok, SEQ, 0, all) == 0, "batched forward");
        double d = max_lp_diff(all, lp, SEQ, nv);
        CHECK(d < 1e-4, "pattern form %zu: max |dlogprob| vs naive %.3g", f, d);
        if (f == 0) {
            printf("tiny gemma3: max |dlogprob| vs naive %.3g; vs naive without the window %.3g, "
                   "with the global base on local layers %.3g\n",
                   d, max_lp_diff(all, lp_nowin, SEQ, nv), max_lp_diff(all, lp_base, SEQ, nv));
            /* the comparison can fail: the window and the local base each change the result */
            CHECK(max_lp_diff(all, lp_nowin, SEQ, nv) > 1e-2, "the window does not matter in this test");
            CHECK(max_lp_diff(all, lp_base, SEQ, nv) > 1e-2, "the local RoPE base does not matter in this test");
            /* one token per call equals the whole batch, bitwise */
            int ok = 1;
            for (int i = 0; i < SEQ && ok; i++)
                ok = forward_rows(m, kv, tok + i, 1, i, one + (size_t)i * nv) == 0;
            CHECK(ok && memcmp(all, one, (size_t)SEQ * nv * sizeof *all) == 0, "unbatched differs from batched");
            /* a token beyond the context is refused */
            int32_t t1 = 5, p1 = 16, s1 = 0;
            m40_batch bad = {.n = 1, .tokens = &t1, .pos = &p1, .slot = &s1};
            CHECK(m40_model_forward(m, kv, &bad, all, err, sizeof err) == -1, "position 16 of a 16-token cache");
        }
        m40_kv_free(kv);
        m40_model_free(m);
    }

    /* Without the pattern key, Gemma 3's period of 6 applies: all 3 layers are local,
     * which differs from the model above in its last layer. */
    variant dflt = {0};
    m40_model *m = load_variant(w, &dflt, err, sizeof err);
    CHECK(m != NULL, "load (no pattern key): %s", err);
    if (m) {
        m40_kv *kv = m40_kv_new(m, 1, 16);
        CHECK(kv && forward_rows(m, kv, tok, SEQ, 0, all) == 0, "forward");
        CHECK(max_lp_diff(all, lp, SEQ, nv) > 1e-3, "default pattern should make layer 2 local");
        m40_kv_free(kv);
        m40_model_free(m);
    }
    free(lp);
    free(lp_nowin);
    free(lp_base);
    free(all);
    free(one);
}

static void expect_error(const weights *w, const variant *v, const char *want)
{
    char err[512] = "";
    m40_model *m = load_variant(w, v, err, sizeof err);
    CHECK(m == NULL && strstr(err, want), "expected a load error naming '%s', got '%s'", want, err);
    m40_model_free(m);
}

static void test_load_errors(const weights *w)
{
    expect_error(w, &(variant){.drop_tensor = "blk.1.post_ffw_norm.weight"}, "blk.1.post_ffw_norm.weight");
    expect_error(w, &(variant){.drop_tensor = "blk.0.attn_k_norm.weight"}, "blk.0.attn_k_norm.weight");
    expect_error(w, &(variant){.drop_key = "gemma3.attention.sliding_window"}, "gemma3.attention.sliding_window");
    expect_error(w, &(variant){.rope_scaling = "yarn"}, "yarn");
    expect_error(w, &(variant){.pattern = 3, .drop_tensor = "blk.2.ffn_up.weight"}, "blk.2.ffn_up.weight");
}

/* ---- the real model, when fetched ---- */

static void test_real_model(void)
{
    const char *path = getenv("M40_GEMMA3");
    if (!path || !*path)
        path = "models-cache/gemma-3-270m-q4_k_m.gguf";
    if (access(path, R_OK) != 0) {
        SKIP("%s absent (scripts/fetch-gemma3.sh): no real-model checks", path);
        return;
    }
    char err[512];
    m40_model *m = NULL;
    int rc = m40_model_load(path, 2, &m, err, sizeof err);
    CHECK(rc == 0, "%s", err);
    if (rc)
        return;
    const m40_model_params *p = m40_model_get_params(m);
    CHECK(!strcmp(p->arch, "gemma3") && p->dim == 640 && p->n_layers == 18 && p->n_heads == 4 &&
              p->n_kv_heads == 1 && p->head_dim == 256 && p->tied_output && p->n_vocab == 262144,
          "Gemma 3 270M params: %s dim %d layers %d heads %d/%d head_dim %d vocab %d", p->arch, p->dim, p->n_layers,
          p->n_heads, p->n_kv_heads, p->head_dim, p->n_vocab);
    /* <bos> then SentencePiece pieces without a dummy prefix (ids as the Python
     * sentencepiece package gives them for a proto built from this vocabulary). */
    int32_t ids[16];
    int64_t n = m40_tokenize(m40_model_tokenizer(m), "The capital of France is", 24, 1, 0, ids, 16, err, sizeof err);
    static const int32_t want[] = {2, 818, 5279, 529, 7001, 563};
    CHECK(n == 6 && !memcmp(ids, want, sizeof want), "tokenization: %lld tokens, first %d %d", (long long)n, ids[0], ids[1]);
    m40_model_free(m);
}

int main(void)
{
    int fd = mkstemp(tmp_path);
    if (fd < 0) {
        SKIP("cannot create a temporary file");
        return check_done();
    }
    close(fd);
    weights w;
    make_weights(&w, 3 + 256 + 8);
    test_synthetic(&w);
    test_load_errors(&w);
    free_weights(&w);
    unlink(tmp_path);
    test_real_model();
    return check_done();
}
