/* m40_mkmodel_write: the tiny shape in every type is a valid GGUF with the expected
 * tensors, loads as a model whose forward pass gives finite, varied logits close to
 * the F32 model's (every type quantizes the same underlying weights), carries a
 * working vocabulary, and the bytes depend only on the seed. */
#include <dirent.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "check.h"
#include "ref/ggml_types.h"
#include "gguf/gguf.h"
#include "gguf/mkmodel.h"
#include "model/model.h"
#include "tokenizer/tokenizer.h"

static char dir[64];

static const char *tmp_path(const char *name)
{
    static char buf[4][384];
    static int k;
    k = (k + 1) % 4;
    snprintf(buf[k], sizeof buf[k], "%s/%s", dir, name);
    return buf[k];
}

static int make(const char *shape, m40_mkmodel_ftype ft, uint64_t seed, int layers, int threads, const char *path)
{
    m40_mkmodel_opts o = {.shape = m40_mkmodel_find_shape(shape), .ftype = ft, .seed = seed, .n_layers = layers,
                          .n_threads = threads};
    char err[512];
    m40_mkmodel_stats st;
    int rc = m40_mkmodel_write(&o, path, &st, err, sizeof err);
    CHECK(rc == 0, "mkmodel %s %s: %s", shape, m40_mkmodel_type_name(ft), err);
    if (rc == 0) {
        o.dry_run = 1;
        m40_mkmodel_stats dry;
        CHECK(m40_mkmodel_write(&o, "/nonexistent/dir/x.gguf", &dry, err, sizeof err) == 0 &&
                  dry.file_bytes == st.file_bytes,
              "dry run size %llu vs written %llu", (unsigned long long)dry.file_bytes,
              (unsigned long long)st.file_bytes);
    }
    return rc;
}

static unsigned char *slurp(const char *path, size_t *n)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    fseek(f, 0, SEEK_END);
    long sz = ftell(f);
    fseek(f, 0, SEEK_SET);
    unsigned char *p = malloc(sz > 0 ? (size_t)sz : 1);
    *n = p && fread(p, 1, (size_t)sz, f) == (size_t)sz ? (size_t)sz : 0;
    fclose(f);
    return p;
}

static int same_file(const char *a, const char *b)
{
    size_t na, nb;
    unsigned char *pa = slurp(a, &na), *pb = slurp(b, &nb);
    int same = pa && pb && na == nb && na > 0 && !memcmp(pa, pb, na);
    free(pa);
    free(pb);
    return same;
}

/* Every tensor of the tiny shape: name, row length, rows (1 for vectors). */
static void check_tensors(const m40_gguf *g, m40_mkmodel_ftype ft, const char *label)
{
    const m40_mkmodel_shape *s = m40_mkmodel_find_shape("tiny");
    uint64_t dim = 256, kv = 128, ffn = 768, vocab = 1024;
    CHECK(s && s->dim == 256 && s->n_kv_heads == 2 && s->n_heads == 4 && s->ffn_dim == 768 && s->n_vocab == 1024,
          "tiny shape as documented");
    CHECK(m40_gguf_n_tensors(g) == 3 + 9 * 2, "%s: %llu tensors", label, (unsigned long long)m40_gguf_n_tensors(g));
    struct {
        const char *name;
        uint64_t ne0, ne1;
    } want[] = {
        {"token_embd.weight", dim, vocab}, {"output_norm.weight", dim, 1}, {"output.weight", dim, vocab},
    };
    for (size_t i = 0; i < 3; i++) {
        const m40_gguf_tensor *t = m40_gguf_find_tensor(g, want[i].name);
        CHECK(t && t->ne[0] == want[i].ne0 && t->ne[1] == want[i].ne1 && t->n_dims == (want[i].ne1 > 1 ? 2u : 1u),
              "%s: %s shape", label, want[i].name);
        CHECK(t && t->type == m40_mkmodel_tensor_type(ft, want[i].name, 2), "%s: %s type %s", label, want[i].name,
              t ? m40_type_name(t->type) : "-");
    }
    struct {
        const char *suffix;
        uint64_t ne0, ne1;
    } blk[] = {
        {"attn_norm.weight", dim, 1}, {"attn_q.weight", dim, dim},     {"attn_k.weight", dim, kv},
        {"attn_v.weight", dim, kv},   {"attn_output.weight", dim, dim}, {"ffn_norm.weight", dim, 1},
        {"ffn_gate.weight", dim, ffn}, {"ffn_up.weight", dim, ffn},     {"ffn_down.weight", ffn, dim},
    };
    for (int l = 0; l < 2; l++)
        for (size_t i = 0; i < sizeof blk / sizeof blk[0]; i++) {
            char n[64];
            snprintf(n, sizeof n, "blk.%d.%s", l, blk[i].suffix);
            const m40_gguf_tensor *t = m40_gguf_find_tensor(g, n);
            CHECK(t && t->ne[0] == blk[i].ne0 && t->ne[1] == blk[i].ne1, "%s: %s shape", label, n);
            CHECK(t && t->type == m40_mkmodel_tensor_type(ft, n, 2), "%s: %s type %s", label, n,
                  t ? m40_type_name(t->type) : "-");
            if (t && strstr(n, "norm")) {
                const float *v = t->data;
                CHECK(t->type == M40_TYPE_F32 && v[0] == 1.0f && v[dim - 1] == 1.0f, "%s: %s is ones", label, n);
            }
        }
    /* the type each file type gives a plain matrix */
    const m40_gguf_tensor *q = m40_gguf_find_tensor(g, "blk.0.attn_q.weight");
    uint32_t plain = ft == M40_MK_F32 ? M40_TYPE_F32 : ft == M40_MK_F16 ? M40_TYPE_F16 : ft == M40_MK_BF16 ? M40_TYPE_BF16
                     : ft == M40_MK_Q8_0 ? M40_TYPE_Q8_0 : ft == M40_MK_Q6_K ? M40_TYPE_Q6_K
                     : ft == M40_MK_Q4_0 ? M40_TYPE_Q4_0 : M40_TYPE_Q4_K;
    CHECK(q && q->type == plain, "%s: attn_q is %s", label, q ? m40_type_name(q->type) : "-");

    uint32_t v;
    const char *arch = m40_gguf_arch(g);
    CHECK(arch && !strcmp(arch, "llama"), "%s: architecture", label);
    CHECK(m40_gguf_get_u32(g, "general.file_type", &v) == 0 && v == (uint32_t)ft, "%s: file_type", label);
    CHECK(m40_gguf_get_u32(g, "general.alignment", &v) == 0 && v == 32 && m40_gguf_alignment(g) == 32,
          "%s: alignment", label);
    CHECK(m40_gguf_get_u32(g, "llama.block_count", &v) == 0 && v == 2, "%s: block_count", label);
    CHECK(m40_gguf_get_u32(g, "llama.attention.head_count_kv", &v) == 0 && v == 2, "%s: head_count_kv", label);
    CHECK(m40_gguf_get_u32(g, "tokenizer.ggml.bos_token_id", &v) == 0 && v == 1, "%s: bos", label);
    CHECK(m40_gguf_get_u32(g, "tokenizer.ggml.eos_token_id", &v) == 0 && v == 2, "%s: eos", label);
    const char *name = m40_gguf_get_str(g, "general.name");
    CHECK(name && strstr(name, "tiny"), "%s: general.name", label);
}

static void check_vocab(const m40_gguf *g)
{
    const m40_gguf_value *toks = m40_gguf_get_arr(g, "tokenizer.ggml.tokens", M40_GGUF_STRING);
    const m40_gguf_value *types = m40_gguf_get_arr(g, "tokenizer.ggml.token_type", M40_GGUF_INT32);
    const m40_gguf_value *scores = m40_gguf_get_arr(g, "tokenizer.ggml.scores", M40_GGUF_FLOAT32);
    CHECK(toks && toks->v.arr.n == 1024, "1024 tokens");
    CHECK(types && types->v.arr.n == 1024 && scores && scores->v.arr.n == 1024, "types and scores");
    if (!toks || toks->v.arr.n != 1024 || !types || !scores)
        return;
    const m40_gguf_value *t = toks->v.arr.items;
    CHECK(!strcmp(t[0].v.str.ptr, "<unk>") && !strcmp(t[1].v.str.ptr, "<s>") && !strcmp(t[2].v.str.ptr, "</s>"),
          "special pieces");
    CHECK(!strcmp(t[3].v.str.ptr, "<0x00>") && !strcmp(t[258].v.str.ptr, "<0xFF>") &&
              types->v.arr.items[3].v.i64 == 6 && types->v.arr.items[258].v.i64 == 6,
          "byte pieces");
    CHECK(types->v.arr.items[0].v.i64 == 2 && types->v.arr.items[1].v.i64 == 3 && types->v.arr.items[300].v.i64 == 1,
          "token types");
    int dup = 0;
    for (uint64_t i = 0; i < 1024 && !dup; i++)
        for (uint64_t j = i + 1; j < 1024; j++)
            if (!strcmp(t[i].v.str.ptr, t[j].v.str.ptr)) {
                dup = 1;
                break;
            }
    CHECK(!dup, "pieces are unique");
    int sorted = 1;
    for (uint64_t i = 260; i < 1024; i++)
        if (!(scores->v.arr.items[i].v.f64 < scores->v.arr.items[i - 1].v.f64))
            sorted = 0;
    CHECK(sorted, "merge scores decrease");
}

/* Forward pass over a short prompt: finite, varied last-token logits (copied to out). */
static int forward(const char *path, float *out, const char *label)
{
    m40_model *m = NULL;
    char err[512];
    if (m40_model_load(path, 2, &m, err, sizeof err) != 0) {
        CHECK(0, "%s: load: %s", label, err);
        return -1;
    }
    const m40_model_params *p = m40_model_get_params(m);
    CHECK(p->n_vocab == 1024 && p->n_layers == 2 && p->n_kv_heads == 2 && p->head_dim == 64, "%s: params", label);
    int32_t tok[5] = {1, 345, 678, 900, 17}, pos[5] = {0, 1, 2, 3, 4}, slot[5] = {0};
    m40_kv *kv = m40_kv_new(m, 1, 16);
    m40_batch b = {.n = 5, .tokens = tok, .pos = pos, .slot = slot};
    int rc = kv ? m40_model_forward(m, kv, &b, out, err, sizeof err) : -1;
    CHECK(rc == 0, "%s: forward: %s", label, kv ? err : "no kv");
    if (rc == 0) {
        int finite = 1, varied = 0;
        for (int i = 0; i < 1024; i++) {
            finite &= isfinite(out[i]) != 0;
            varied |= out[i] != out[0];
        }
        CHECK(finite, "%s: logits finite", label);
        CHECK(varied, "%s: logits not all equal", label);
    }
    m40_kv_free(kv);
    m40_model_free(m);
    return rc;
}

static double correlation(const float *a, const float *b, int n)
{
    double ma = 0, mb = 0, sab = 0, saa = 0, sbb = 0;
    for (int i = 0; i < n; i++) {
        ma += a[i];
        mb += b[i];
    }
    ma /= n;
    mb /= n;
    for (int i = 0; i < n; i++) {
        sab += (a[i] - ma) * (b[i] - mb);
        saa += (a[i] - ma) * (a[i] - ma);
        sbb += (b[i] - mb) * (b[i] - mb);
    }
    return saa > 0 && sbb > 0 ? sab / sqrt(saa * sbb) : 0;
}

static void check_tokenizer(const char *path)
{
    m40_model *m = NULL;
    char err[512];
    if (m40_model_load(path, 1, &m, err, sizeof err) != 0) {
        CHECK(0, "load: %s", err);
        return;
    }
    const m40_tokenizer *t = m40_model_tokenizer(m);
    CHECK(m40_tokenizer_kind(t) == M40_TOK_SPM && m40_tokenizer_n_vocab(t) == 1024, "SentencePiece, 1024 pieces");
    CHECK(m40_tokenizer_bos(t) == 1 && m40_tokenizer_eos(t) == 2, "bos 1, eos 2");
    const char *text = "hello world, the cat sat on the mat. Zebra 42 \xc3\xbc";
    int32_t ids[128];
    int64_t n = m40_tokenize(t, text, strlen(text), 1, 0, ids, 128, err, sizeof err);
    CHECK(n > 2 && n < 60 && ids[0] == 1, "tokenize: %lld ids", (long long)n);
    char buf[256];
    int len = 0;
    for (int64_t i = 1; i < n && i < 128; i++)
        len += m40_token_to_bytes(t, ids[i], 0, buf + len, (int)sizeof buf - len);
    CHECK(len == (int)strlen(text) + 1 && buf[0] == ' ' && !memcmp(buf + 1, text, strlen(text)),
          "detokenized text round-trips ('%.*s')", len, buf);
    int merged = 0;
    for (int64_t i = 1; i < n; i++)
        merged |= strlen(m40_tokenizer_piece(t, ids[i])) > 3;
    CHECK(merged, "multi-character pieces are used");
    m40_model_free(m);
}

static void test_recipe(void)
{
    /* 32 layers: first and last eighth and every third layer in between */
    int want32[] = {0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31};
    int k = 0, ok = 1;
    for (int l = 0; l < 32; l++) {
        int more = m40_mkmodel_more_bits(l, 32);
        int expected = k < 16 && want32[k] == l;
        if (expected)
            k++;
        ok &= more == expected;
    }
    CHECK(ok && k == 16, "more_bits for 32 layers");
    CHECK(m40_mkmodel_tensor_type(M40_MK_Q4_K_M, "blk.6.attn_v.weight", 32) == M40_TYPE_Q6_K &&
              m40_mkmodel_tensor_type(M40_MK_Q4_K_M, "blk.7.attn_v.weight", 32) == M40_TYPE_Q4_K &&
              m40_mkmodel_tensor_type(M40_MK_Q4_K_M, "blk.9.ffn_down.weight", 32) == M40_TYPE_Q6_K &&
              m40_mkmodel_tensor_type(M40_MK_Q4_K_M, "blk.9.ffn_up.weight", 32) == M40_TYPE_Q4_K &&
              m40_mkmodel_tensor_type(M40_MK_Q4_K_M, "blk.9.attn_k.weight", 32) == M40_TYPE_Q4_K &&
              m40_mkmodel_tensor_type(M40_MK_Q4_K_M, "output.weight", 32) == M40_TYPE_Q6_K &&
              m40_mkmodel_tensor_type(M40_MK_Q4_K_M, "token_embd.weight", 32) == M40_TYPE_Q4_K &&
              m40_mkmodel_tensor_type(M40_MK_Q4_K_M, "blk.6.attn_norm.weight", 32) == M40_TYPE_F32,
          "Q4_K_M tensor types");
    /* the experts by the same rule; MXFP4 (MoE): experts MXFP4, other matrices Q8_0;
     * routers, biases and sinks F32 in every type */
    CHECK(m40_mkmodel_tensor_type(M40_MK_Q4_K_M, "blk.9.ffn_down_exps.weight", 32) == M40_TYPE_Q6_K &&
              m40_mkmodel_tensor_type(M40_MK_Q4_K_M, "blk.7.ffn_down_exps.weight", 32) == M40_TYPE_Q4_K &&
              m40_mkmodel_tensor_type(M40_MK_Q4_K_M, "blk.9.ffn_up_exps.weight", 32) == M40_TYPE_Q4_K &&
              m40_mkmodel_tensor_type(M40_MK_Q4_K_M, "blk.9.ffn_gate_inp.weight", 32) == M40_TYPE_F32 &&
              m40_mkmodel_tensor_type(M40_MK_MXFP4, "blk.0.ffn_gate_exps.weight", 24) == M40_TYPE_MXFP4 &&
              m40_mkmodel_tensor_type(M40_MK_MXFP4, "blk.0.ffn_down_exps.weight", 24) == M40_TYPE_MXFP4 &&
              m40_mkmodel_tensor_type(M40_MK_MXFP4, "blk.0.ffn_down_exps.bias", 24) == M40_TYPE_F32 &&
              m40_mkmodel_tensor_type(M40_MK_MXFP4, "blk.0.attn_q.weight", 24) == M40_TYPE_Q8_0 &&
              m40_mkmodel_tensor_type(M40_MK_MXFP4, "blk.0.attn_q.bias", 24) == M40_TYPE_F32 &&
              m40_mkmodel_tensor_type(M40_MK_MXFP4, "blk.0.attn_sinks.weight", 24) == M40_TYPE_F32 &&
              m40_mkmodel_tensor_type(M40_MK_MXFP4, "output.weight", 24) == M40_TYPE_Q8_0,
          "expert tensor types");
    CHECK(m40_mkmodel_tensor_type(M40_MK_Q4_0, "output.weight", 32) == M40_TYPE_Q6_K &&
              m40_mkmodel_tensor_type(M40_MK_Q8_0, "output.weight", 32) == M40_TYPE_Q8_0,
          "output.weight types");

    /* in a file: 8 layers, Q6_K exactly at layers 0, 3, 6, 7 for attn_v and ffn_down */
    const char *path = tmp_path("recipe8.gguf");
    if (make("tiny", M40_MK_Q4_K_M, 1, 8, 0, path) != 0)
        return;
    m40_gguf *g;
    char err[512];
    if (m40_gguf_open(path, &g, err, sizeof err) != 0) {
        CHECK(0, "open: %s", err);
        return;
    }
    int q6 = 0, bad = 0;
    for (uint64_t i = 0; i < m40_gguf_n_tensors(g); i++) {
        const m40_gguf_tensor *t = m40_gguf_tensor_at(g, i);
        int layer = -1;
        char rest[64] = "";
        sscanf(t->name, "blk.%d.%63s", &layer, rest);
        int more = (!strcmp(rest, "attn_v.weight") || !strcmp(rest, "ffn_down.weight")) &&
                   (layer == 0 || layer == 3 || layer == 6 || layer == 7);
        if (t->type == M40_TYPE_Q6_K)
            q6++;
        if (!strcmp(t->name, "output.weight") || more)
            bad |= t->type != M40_TYPE_Q6_K;
        else if (!strstr(t->name, "norm"))
            bad |= t->type != M40_TYPE_Q4_K;
    }
    CHECK(!bad && q6 == 9, "8-layer Q4_K_M file: %d Q6_K tensors", q6);
    m40_gguf_close(g);
}

static void test_errors(void)
{
    char err[512] = "";
    m40_mkmodel_opts o = {.shape = m40_mkmodel_find_shape("tiny"), .ftype = M40_MK_F16, .seed = 1};
    CHECK(m40_mkmodel_write(&o, "/nonexistent-dir/x.gguf", NULL, err, sizeof err) == -1 &&
              strstr(err, "/nonexistent-dir/x.gguf.part"),
          "unwritable path: %s", err);
    CHECK(m40_mkmodel_find_shape("llama-9000") == NULL && m40_mkmodel_find_shape("llama-2-7b") != NULL,
          "shape lookup");
    m40_mkmodel_ftype ft;
    CHECK(m40_mkmodel_parse_type("q4_k_m", &ft) == 0 && ft == M40_MK_Q4_K_M && m40_mkmodel_parse_type("Q3_K", &ft) == -1,
          "type names");
    /* dry runs: the real shapes lay out as the well-known files do */
    struct {
        const char *shape;
        m40_mkmodel_ftype ft;
        uint64_t params;
    } sizes[] = {
        {"tinyllama-1.1b", M40_MK_F16, 1100048384ull},
        {"llama-2-7b", M40_MK_Q4_K_M, 6738415616ull},
        {"mistral-7b", M40_MK_Q4_K_M, 7241732096ull},
        {"llama-3-8b", M40_MK_Q8_0, 8030261248ull},
    };
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
        m40_mkmodel_opts d = {.shape = m40_mkmodel_find_shape(sizes[i].shape), .ftype = sizes[i].ft, .dry_run = 1};
        m40_mkmodel_stats st;
        CHECK(d.shape && m40_mkmodel_write(&d, tmp_path("never.gguf"), &st, err, sizeof err) == 0 &&
                  st.n_params == sizes[i].params && st.n_tensors == 291 - 9 * (32 - (uint64_t)d.shape->n_layers),
              "%s: %llu parameters", sizes[i].shape, (unsigned long long)st.n_params);
    }
    CHECK(access(tmp_path("never.gguf"), F_OK) != 0, "a dry run writes nothing");
    /* MXFP4 quantizes experts: refused for a dense shape; gpt-oss-20b in it is the size of
     * the published MXFP4 file (12.1 GB) */
    m40_mkmodel_opts mx = {.shape = m40_mkmodel_find_shape("tiny"), .ftype = M40_MK_MXFP4, .dry_run = 1};
    m40_mkmodel_stats mst;
    CHECK(m40_mkmodel_write(&mx, tmp_path("never.gguf"), &mst, err, sizeof err) == -1 && strstr(err, "experts"),
          "MXFP4 on a dense shape: %s", err);
    mx.shape = m40_mkmodel_find_shape("gpt-oss-20b");
    CHECK(mx.shape && m40_mkmodel_write(&mx, tmp_path("never.gguf"), &mst, err, sizeof err) == 0 &&
              mst.file_bytes > 12000000000ull && mst.file_bytes < 12200000000ull,
          "gpt-oss-20b MXFP4: %llu bytes", (unsigned long long)mst.file_bytes);
    /* the other architectures: the parameter counts their model cards state (Qwen3 8B
     * 8.19B with 6.95B outside the embeddings, Gemma 2 9B 9,241,705,984 with its tied head) */
    struct {
        const char *shape;
        uint64_t params, tensors;
    } arch_sizes[] = {
        {"qwen3-8b", 8190735360ull, 3 + 36 * 11},
        {"qwen3-32b", 32762123264ull, 3 + 64 * 11},
        {"phi-4", 14659507200ull, 3 + 40 * 6},
        {"gemma2-9b", 9241705984ull, 2 + 42 * 11},
        /* the model cards' totals: Qwen3-30B-A3B 30,532,122,624 (12 tensors a layer: no
         * dense FFN); gpt-oss-20b 20,914,757,184 (19: biases and sinks) */
        {"qwen3-30b-a3b", 30532122624ull, 3 + 48 * 12},
        {"gpt-oss-20b", 20914757184ull, 3 + 24 * 19},
    };
    for (size_t i = 0; i < sizeof arch_sizes / sizeof arch_sizes[0]; i++) {
        m40_mkmodel_opts d = {.shape = m40_mkmodel_find_shape(arch_sizes[i].shape), .ftype = M40_MK_F16, .dry_run = 1};
        m40_mkmodel_stats st;
        CHECK(d.shape && m40_mkmodel_write(&d, tmp_path("never.gguf"), &st, err, sizeof err) == 0 &&
                  st.n_params == arch_sizes[i].params && st.n_tensors == arch_sizes[i].tensors,
              "%s: %llu parameters, %llu tensors", arch_sizes[i].shape, (unsigned long long)st.n_params,
              (unsigned long long)st.n_tensors);
    }
}

/* The tiny shapes of the other architectures load as their row (arch.h) and run a greedy
 * smoke test on the CPU (the mixtures of experts too, qwen3moe in F32 and Q4_K_M, gpt-oss
 * with MXFP4 experts): finite logits, a prompt longer than the windows of 8, the
 * same logits batched and one token at a time, and greedy picks in the vocabulary. */
static void test_arch_shapes(void)
{
    static const struct {
        const char *shape, *arch;
        int32_t head_dim;
        int tied;
        m40_mkmodel_ftype ft;
        int32_t experts, used;
    } arches[] = {{"tiny-qwen3", "qwen3", 128, 0, M40_MK_F32, 0, 0},
                  {"tiny-phi3", "phi3", 64, 0, M40_MK_F32, 0, 0},
                  {"tiny-gemma2", "gemma2", 64, 1, M40_MK_F32, 0, 0},
                  {"tiny-qwen3moe", "qwen3moe", 64, 0, M40_MK_F32, 8, 2},
                  {"tiny-qwen3moe", "qwen3moe", 64, 0, M40_MK_Q4_K_M, 8, 2},
                  {"tiny-gpt-oss", "gpt-oss", 64, 0, M40_MK_MXFP4, 8, 4}};
    enum { N = 12, GEN = 6 };
    for (size_t a = 0; a < sizeof arches / sizeof arches[0]; a++) {
        char fname[64], err[512];
        snprintf(fname, sizeof fname, "%s-%s.gguf", arches[a].shape, m40_mkmodel_type_name(arches[a].ft));
        const char *path = tmp_path(fname);
        if (make(arches[a].shape, arches[a].ft, 3, 0, 0, path) != 0)
            continue;
        m40_model *m = NULL;
        if (m40_model_load(path, 2, &m, err, sizeof err) != 0) {
            CHECK(0, "%s: load: %s", arches[a].shape, err);
            continue;
        }
        const m40_model_params *p = m40_model_get_params(m);
        CHECK(!strcmp(p->arch, arches[a].arch) && p->head_dim == arches[a].head_dim && p->n_vocab == 1024 &&
                  p->tied_output == arches[a].tied && p->n_experts == arches[a].experts &&
                  p->n_experts_used == arches[a].used,
              "%s: arch %s, head_dim %d, tied %d, %d experts (%d used)", arches[a].shape, p->arch, (int)p->head_dim,
              p->tied_output, (int)p->n_experts, (int)p->n_experts_used);
        int32_t tok[N + GEN], pos[N + GEN], slot[N + GEN] = {0};
        for (int i = 0; i < N + GEN; i++) {
            tok[i] = (int32_t)((i * 389 + 7) % 1024);
            pos[i] = i;
        }
        uint8_t want[N];
        memset(want, 1, sizeof want);
        static float all[N][1024], one[1024];
        m40_kv *kv = m40_kv_new(m, 2, 32);
        m40_batch b = {.n = N, .tokens = tok, .pos = pos, .slot = slot, .want_logits = want};
        int rc = kv ? m40_model_forward(m, kv, &b, &all[0][0], err, sizeof err) : -1;
        CHECK(rc == 0, "%s: batched forward: %s", arches[a].shape, err);
        int same = rc == 0, finite = 1;
        int32_t slot1[1] = {1};
        for (int i = 0; rc == 0 && i < N; i++) {
            m40_batch s1 = {.n = 1, .tokens = &tok[i], .pos = &pos[i], .slot = slot1};
            if (m40_model_forward(m, kv, &s1, one, err, sizeof err) != 0) {
                same = 0;
                break;
            }
            same &= memcmp(one, all[i], sizeof one) == 0;
            for (int v = 0; v < 1024; v++)
                finite &= isfinite(all[i][v]) != 0;
        }
        CHECK(same, "%s: one token at a time equals the batch bitwise", arches[a].shape);
        CHECK(finite, "%s: logits finite", arches[a].shape);
        /* greedy decode on slot 0 after the prompt: the prompt's pick, then each pick fed back */
        int ok = rc == 0, best = 0;
        for (int v = 1; v < 1024; v++)
            best = all[N - 1][v] > all[N - 1][best] ? v : best;
        tok[N] = best;
        for (int i = N; ok && i < N + GEN; i++) {
            int32_t pick = -1;
            m40_batch g = {.n = 1, .tokens = &tok[i], .pos = &pos[i], .slot = slot, .argmax = &pick};
            ok = m40_model_forward(m, kv, &g, one, err, sizeof err) == 0 && pick >= 0 && pick < 1024;
            if (ok && i + 1 < N + GEN)
                tok[i + 1] = pick;
        }
        CHECK(ok, "%s: greedy decode: %s", arches[a].shape, err);
        m40_kv_free(kv);
        m40_model_free(m);
    }
}

int main(void)
{
    snprintf(dir, sizeof dir, "/tmp/m40-test-mkmodel-XXXXXX");
    if (!mkdtemp(dir)) {
        CHECK(0, "mkdtemp");
        return check_done();
    }
    const m40_mkmodel_ftype types[] = {M40_MK_F32, M40_MK_F16, M40_MK_BF16, M40_MK_Q8_0,
                                       M40_MK_Q6_K, M40_MK_Q4_K_M, M40_MK_Q4_0};
    /* minimum correlation of each type's logits with the F32 model's */
    const double min_corr[] = {1.0, 0.9999, 0.999, 0.999, 0.995, 0.97, 0.95};
    static float logits[7][1024];
    for (size_t i = 0; i < sizeof types / sizeof types[0]; i++) {
        const char *label = m40_mkmodel_type_name(types[i]);
        char fname[64];
        snprintf(fname, sizeof fname, "tiny-%s.gguf", label);
        const char *path = tmp_path(fname);
        if (make("tiny", types[i], 1, 0, 0, path) != 0)
            continue;
        m40_gguf *g;
        char err[512];
        if (m40_gguf_open(path, &g, err, sizeof err) != 0) {
            CHECK(0, "%s: open: %s", label, err);
            continue;
        }
        check_tensors(g, types[i], label);
        if (types[i] == M40_MK_F32)
            check_vocab(g);
        m40_gguf_close(g);
        if (forward(path, logits[i], label) == 0 && i > 0) {
            double c = correlation(logits[0], logits[i], 1024);
            CHECK(c >= min_corr[i], "%s: logits correlate %.5f with F32's (want >= %.3f)", label, c, min_corr[i]);
        }
    }
    check_tokenizer(tmp_path("tiny-Q8_0.gguf"));

    /* same seed, same bytes, whatever the thread count; another seed, other bytes */
    make("tiny", M40_MK_Q4_K_M, 7, 0, 1, tmp_path("s7a.gguf"));
    make("tiny", M40_MK_Q4_K_M, 7, 0, 2, tmp_path("s7b.gguf"));
    make("tiny", M40_MK_Q4_K_M, 8, 0, 2, tmp_path("s8.gguf"));
    CHECK(same_file(tmp_path("s7a.gguf"), tmp_path("s7b.gguf")), "seed 7 twice: identical bytes");
    CHECK(!same_file(tmp_path("s7a.gguf"), tmp_path("s8.gguf")), "seeds 7 and 8 differ");

    test_recipe();
    test_errors();
    test_arch_shapes();

    /* nothing but finished files in the directory (no .part left), then clean up */
    DIR *d = opendir(dir);
    int parts = 0;
    struct dirent *e;
    while (d && (e = readdir(d))) {
        if (strstr(e->d_name, ".part"))
            parts++;
        if (e->d_name[0] != '.')
            unlink(tmp_path(e->d_name));
    }
    if (d)
        closedir(d);
    CHECK(parts == 0, "%d .part files left", parts);
    rmdir(dir);
    return check_done();
}
