/* LongRoPE (Phi-3 128k, Phi-3.5, Phi-4-mini files) on the CPU, checked by equivalences
 * with paths the shared references already cover, on tiny-phi3-f16 rewritten:
 *   - factors of 1 and no attention factor: the same logits as the file without them;
 *   - the long set F with attention factor sqrt(2) equals the plain file with
 *     rope_freqs.weight = F (Llama 3.1's divisors, the same rotation) and the q rows of
 *     attn_qkv doubled (q.k times attn_factor^2 = 2, exact in F16);
 *   - the context a sequence gets picks the set: above the original length the long
 *     one, at or below it the short one;
 *   - broken files are refused with the reason. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "check.h"
#include "gguf/gguf_writer.h"
#include "model/model.h"
#include "ref/ggml_types.h"
#include "ref/quant.h"

#define ORIG_CTX 1024

typedef struct {
    const float *lng, *sht; /* NULL: no such tensor */
    int lng_len;            /* elements of the long set (the right count: rope_dim / 2) */
    float attn_factor;      /* 0: the file's (none in the fixture) */
    int orig_ctx;           /* 0: the file's */
    const float *freqs;     /* rope_freqs.weight, or NULL */
    float q_scale;          /* multiplies the q rows of attn_qkv (1: as is) */
} variant;

static int write_variant(const m40_gguf *g, const m40_model_params *p, const variant *v, const char *out, char *err,
                         size_t errlen)
{
    m40_gguf_writer *w = m40_gguf_writer_new();
    if (!w)
        return -1;
    for (uint64_t i = 0; i < m40_gguf_n_kv(g); i++) {
        const m40_gguf_kv *kv = m40_gguf_kv_at(g, i);
        if ((v->attn_factor != 0 && !strcmp(kv->key, "phi3.rope.scaling.attn_factor")) ||
            (v->orig_ctx > 0 && !strcmp(kv->key, "phi3.rope.scaling.original_context_length")))
            continue;
        m40_gguf_writer_set_value(w, kv->key, &kv->value);
    }
    if (v->attn_factor != 0)
        m40_gguf_writer_set_f32(w, "phi3.rope.scaling.attn_factor", v->attn_factor);
    if (v->orig_ctx > 0)
        m40_gguf_writer_set_u32(w, "phi3.rope.scaling.original_context_length", (uint32_t)v->orig_ctx);
    const int32_t q_dim = p->n_heads * p->head_dim;
    uint16_t *scaled = NULL;
    for (uint64_t i = 0; i < m40_gguf_n_tensors(g); i++) {
        const m40_gguf_tensor *t = m40_gguf_tensor_at(g, i);
        const void *data = t->data;
        if (v->q_scale != 1.0f && strstr(t->name, "attn_qkv.weight") && t->type == M40_TYPE_F16) {
            free(scaled);
            scaled = malloc(t->nbytes);
            memcpy(scaled, t->data, t->nbytes);
            for (uint64_t j = 0; j < (uint64_t)q_dim * t->ne[0]; j++)
                scaled[j] = m40_fp32_to_fp16(m40_fp16_to_fp32(scaled[j]) * v->q_scale);
            data = scaled;
        }
        m40_gguf_writer_add_tensor(w, t->name, t->type, t->n_dims, t->ne, data, t->nbytes);
    }
    const uint64_t half = (uint64_t)p->rope_dim / 2, nl = (uint64_t)v->lng_len;
    if (v->lng)
        m40_gguf_writer_add_tensor(w, "rope_factors_long.weight", M40_TYPE_F32, 1, &nl, v->lng, nl * 4);
    if (v->sht)
        m40_gguf_writer_add_tensor(w, "rope_factors_short.weight", M40_TYPE_F32, 1, &half, v->sht, half * 4);
    if (v->freqs)
        m40_gguf_writer_add_tensor(w, "rope_freqs.weight", M40_TYPE_F32, 1, &half, v->freqs, half * 4);
    int rc = m40_gguf_writer_write_file(w, out, err, errlen);
    m40_gguf_writer_free(w);
    free(scaled);
    return rc;
}

/* Logits of every position of a fixed token run, on the CPU, with the given context. */
static float *run(const char *path, int32_t ctx_size, int n, int32_t *n_vocab, char *err, size_t errlen)
{
    m40_model_options o = {.n_threads = 1, .device = -1, .ctx_size = ctx_size};
    m40_model *m = NULL;
    if (m40_model_load_opts(path, &o, &m, err, errlen))
        return NULL;
    const m40_model_params *p = m40_model_get_params(m);
    *n_vocab = p->n_vocab;
    m40_kv *kv = m40_kv_new(m, 1, 64);
    float *logits = malloc((size_t)n * p->n_vocab * sizeof *logits);
    int32_t tok[48], pos[48], slot[48];
    uint8_t want[48];
    for (int i = 0; i < n; i++)
        tok[i] = 1 + (i * 7919) % (p->n_vocab - 1), pos[i] = i, slot[i] = 0, want[i] = 1;
    m40_batch b = {.n = n, .tokens = tok, .pos = pos, .slot = slot, .want_logits = want};
    if (!kv || !logits || m40_model_forward(m, kv, &b, logits, err, errlen)) {
        free(logits);
        logits = NULL;
    }
    m40_kv_free(kv);
    m40_model_free(m);
    return logits;
}

static double max_diff(const float *a, const float *b, size_t n)
{
    double d = 0;
    for (size_t i = 0; i < n; i++) {
        double x = fabs((double)a[i] - b[i]);
        if (!(x <= d))
            d = isnan(x) ? INFINITY : x;
    }
    return d;
}

/* Writes v to a temporary file and returns the logits (NULL + err on a load error). */
static float *run_variant(const m40_gguf *g, const m40_model_params *p, const variant *v, int32_t ctx_size, int n,
                          char *err, size_t errlen)
{
    char tmpl[] = "/tmp/m40-test-longrope-XXXXXX";
    int fd = mkstemp(tmpl);
    if (fd < 0) {
        snprintf(err, errlen, "mkstemp failed");
        return NULL;
    }
    close(fd);
    float *l = NULL;
    int32_t nv;
    if (write_variant(g, p, v, tmpl, err, errlen) == 0)
        l = run(tmpl, ctx_size, n, &nv, err, errlen);
    unlink(tmpl);
    return l;
}

int main(void)
{
    char path[4096], err[512];
    if (!check_shared_file("models/next/tiny-phi3-f16.gguf", path, sizeof path)) {
        SKIP("models/next/tiny-phi3-f16.gguf absent: no LongRoPE checks");
        return check_done();
    }
    m40_model *m0 = NULL;
    m40_model_options o = {.n_threads = 1, .device = -1};
    if (m40_model_load_opts(path, &o, &m0, err, sizeof err)) {
        CHECK(0, "%s", err);
        return check_done();
    }
    m40_model_params p = *m40_model_get_params(m0);
    m40_gguf *g;
    if (m40_gguf_open(path, &g, err, sizeof err)) {
        CHECK(0, "%s", err);
        m40_model_free(m0);
        return check_done();
    }
    CHECK(p.ctx_train > ORIG_CTX, "the fixture's context %d exceeds %d", (int)p.ctx_train, ORIG_CTX);
    const int n = 40, half = p.rope_dim / 2;
    const size_t nl = (size_t)n * p.n_vocab;
    int32_t nv;
    float *base = run(path, 0, n, &nv, err, sizeof err);
    CHECK(base != NULL, "plain file: %s", err);

    float *ones = malloc((size_t)half * sizeof *ones), *f = calloc((size_t)half + 1, sizeof *f);
    for (int i = 0; i < half; i++)
        ones[i] = 1.0f, f[i] = 1.0f + (float)((i * 37) % 11) * 0.7f; /* 1 .. 8 */
    f[0] = 1.0f; /* (the fastest pair keeps its angle: as real files have it) */

    /* 1. neutral factors: identical logits */
    variant neutral = {.lng = ones, .sht = ones, .lng_len = half, .attn_factor = 1.0f, .orig_ctx = ORIG_CTX,
                       .q_scale = 1.0f};
    float *l = run_variant(g, &p, &neutral, 0, n, err, sizeof err);
    CHECK(l && base && max_diff(l, base, nl) == 0.0, "factors of 1: logits as without them (%s)", l ? "" : err);
    free(l);

    /* 2. the long set with attn_factor sqrt(2) == rope_freqs F with q doubled */
    variant lr = {.lng = f, .sht = ones, .lng_len = half, .attn_factor = sqrtf(2.0f), .orig_ctx = ORIG_CTX,
                  .q_scale = 1.0f};
    variant eq_long = {.freqs = f, .q_scale = 2.0f};
    variant eq_short = {.q_scale = 2.0f};
    float *want_long = run_variant(g, &p, &eq_long, 0, n, err, sizeof err);
    float *want_short = run_variant(g, &p, &eq_short, 0, n, err, sizeof err);
    CHECK(want_long && want_short, "equivalent files: %s", err);
    const int32_t ctxs[] = {0, ORIG_CTX + 1, 8 * ORIG_CTX, ORIG_CTX, 64};
    for (size_t c = 0; c < sizeof ctxs / sizeof ctxs[0] && want_long && want_short; c++) {
        const int32_t ctx = ctxs[c];
        const int is_long = (ctx > 0 ? ctx : p.ctx_train) > ORIG_CTX;
        l = run_variant(g, &p, &lr, ctx, n, err, sizeof err);
        double d = l ? max_diff(l, is_long ? want_long : want_short, nl) : INFINITY;
        double other = l ? max_diff(l, is_long ? want_short : want_long, nl) : 0;
        CHECK(d < 1e-4, "context %d: LongRoPE (%s set) vs its equivalent: max |dlogit| %g (%s)", (int)ctx,
              is_long ? "long" : "short", d, l ? "" : err);
        CHECK(other > 1e-2, "context %d: the other set differs (max |dlogit| %g)", (int)ctx, other);
        free(l);
    }
    free(want_long);
    free(want_short);

    /* 3. rope_freqs.weight wins over LongRoPE's sets (as in llama.cpp) */
    variant both = {.lng = f, .sht = ones, .lng_len = half, .orig_ctx = ORIG_CTX, .freqs = ones, .q_scale = 1.0f};
    l = run_variant(g, &p, &both, 0, n, err, sizeof err);
    CHECK(l && base && max_diff(l, base, nl) == 0.0, "rope_freqs.weight (ones) wins over the long set (%s)",
          l ? "" : err);
    free(l);

    /* 4. broken files */
    struct {
        variant v;
        const char *want;
    } bad[] = {
        {{.lng = f, .lng_len = half, .q_scale = 1.0f}, "needs both"},
        {{.sht = ones, .q_scale = 1.0f}, "needs both"},
        {{.lng = f, .sht = ones, .lng_len = half + 1, .q_scale = 1.0f}, "rope_factors_long.weight"},
        {{.lng = f, .sht = ones, .lng_len = half, .attn_factor = -1.0f, .q_scale = 1.0f}, "attn_factor"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        err[0] = 0;
        l = run_variant(g, &p, &bad[i].v, 0, n, err, sizeof err);
        CHECK(!l && strstr(err, bad[i].want), "broken file %zu refused naming '%s': '%s'", i, bad[i].want, err);
        free(l);
    }
    float negf[256];
    for (int i = 0; i < half; i++)
        negf[i] = i == 3 ? 0.0f : 1.0f;
    variant zero = {.lng = negf, .sht = ones, .lng_len = half, .q_scale = 1.0f};
    err[0] = 0;
    l = run_variant(g, &p, &zero, 0, n, err, sizeof err);
    CHECK(!l && strstr(err, "LongRoPE factor 3"), "a zero factor is refused: '%s'", err);
    free(l);

    free(ones);
    free(f);
    free(base);
    m40_gguf_close(g);
    m40_model_free(m0);
    return check_done();
}
