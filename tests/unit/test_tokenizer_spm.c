/* SentencePiece tokenizer and the tokenizer front end:
 *  - the 46 reference cases of each SPM vocabulary in ../shared/tokenizer (.inp/.out);
 *  - llama2-tokenizer.model (through libsentencepiece directly) gives the same ids as
 *    the proto we build from ggml-vocab-llama-spm.gguf; tok512.model vs stories260K;
 *  - prompt_tokens of the reference outputs in ../shared/models/ref;
 *  - special-token splitting, EOG ids, token bytes, error messages;
 *  - a synthetic vocabulary with the defects real files have (no UNKNOWN type, empty and
 *    repeated pieces, a misspelled byte piece, NaN scores) still loads and encodes;
 *  - byte-level BPE vocabularies through the same front end, when bpe.c handles them. */
#include <jansson.h>
#include <math.h>
#include <stdint.h>
#include <unistd.h>

#include "check.h"
#include "gguf/gguf.h"
#include "gguf/gguf_writer.h"
#include "tokenizer/spm.h"
#include "tokenizer/tokenizer.h"

#define SEP "\n__ggml_vocab_test__\n"

static char *read_all(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    size_t cap = 1 << 16, n = 0;
    char *buf = malloc(cap + 1);
    while (buf) {
        if (n == cap) {
            char *nb = realloc(buf, cap * 2 + 1);
            if (!nb) {
                free(buf);
                buf = NULL;
                break;
            }
            buf = nb;
            cap *= 2;
        }
        size_t got = fread(buf + n, 1, cap - n, f);
        if (!got)
            break;
        n += got;
    }
    fclose(f);
    if (buf) {
        buf[n] = 0;
        *len = n;
    }
    return buf;
}

/* The cases of one vocabulary: text pieces and expected id lists. */
typedef struct {
    int n;
    const char *text[64];
    size_t text_len[64];
    int32_t *want[64];
    int n_want[64];
    char *inp, *outp;
} vocab_cases;

static void cases_free(vocab_cases *c)
{
    for (int i = 0; i < c->n; i++)
        free(c->want[i]);
    free(c->inp);
    free(c->outp);
}

/* 0 on success, -1 when the files are absent. */
static int cases_load(const char *name, vocab_cases *c)
{
    char rel[256], path[4096];
    size_t inlen, outlen;
    memset(c, 0, sizeof *c);
    snprintf(rel, sizeof rel, "tokenizer/ggml-vocab-%s.gguf.inp", name);
    if (!check_shared_file(rel, path, sizeof path) || !(c->inp = read_all(path, &inlen)))
        return -1;
    snprintf(rel, sizeof rel, "tokenizer/ggml-vocab-%s.gguf.out", name);
    if (!check_shared_file(rel, path, sizeof path) || !(c->outp = read_all(path, &outlen))) {
        free(c->inp);
        return -1;
    }
    char *p = c->inp, *end = c->inp + inlen;
    while (p < end && c->n < 64) {
        char *s = strstr(p, SEP); /* .inp cases contain no NUL bytes */
        if (!s)
            break;
        c->text[c->n] = p;
        c->text_len[c->n] = (size_t)(s - p);
        c->n++;
        p = s + strlen(SEP);
    }
    char *line = c->outp;
    for (int i = 0; i < c->n; i++) {
        char *nl = strchr(line, '\n');
        if (nl)
            *nl = 0;
        c->want[i] = malloc(sizeof(int32_t) * (strlen(line) / 2 + 2));
        int k = 0;
        for (char *q = line; c->want[i] && *q;) {
            char *e;
            long v = strtol(q, &e, 10);
            if (e == q) {
                q++;
                continue;
            }
            c->want[i][k++] = (int32_t)v;
            q = e;
        }
        c->n_want[i] = k;
        line = nl ? nl + 1 : line + strlen(line);
    }
    return 0;
}

static int64_t encode(const m40_tokenizer *t, const char *s, size_t len, int bos, int special, int32_t *ids,
                      int64_t cap)
{
    char err[256];
    int64_t n = m40_tokenize(t, s, len, bos, special, ids, cap, err, sizeof err);
    if (n < 0)
        fprintf(stderr, "tokenize failed: %s\n", err);
    return n;
}

static int ids_equal(const int32_t *a, int64_t na, const int32_t *b, int64_t nb)
{
    return na == nb && (na == 0 || !memcmp(a, b, (size_t)na * sizeof *a));
}

static m40_tokenizer *load_gguf_tok(const char *rel, m40_gguf **gout)
{
    char path[4096], err[512];
    m40_gguf *g;
    m40_tokenizer *t;
    if (!check_shared_file(rel, path, sizeof path)) {
        SKIP("%s absent", rel);
        return NULL;
    }
    if (m40_gguf_open(path, &g, err, sizeof err) != 0) {
        CHECK(0, "open %s: %s", rel, err);
        return NULL;
    }
    int rc = m40_tokenizer_from_gguf(g, &t, err, sizeof err);
    CHECK(rc == 0, "tokenizer from %s: %s", rel, err);
    if (gout)
        *gout = g;
    else
        m40_gguf_close(g);
    return rc == 0 ? t : NULL;
}

/* Runs every case of vocabulary `name` through t; returns the number that match. */
static int run_cases(const char *name, const m40_tokenizer *t, const vocab_cases *c)
{
    int32_t ids[4096];
    int ok = 0;
    for (int i = 0; i < c->n; i++) {
        int64_t n = encode(t, c->text[i], c->text_len[i], 0, 0, ids, 4096);
        int good = ids_equal(ids, n, c->want[i], c->n_want[i]);
        CHECK(good, "%s case %d (%zu bytes): got %lld ids, want %d", name, i, c->text_len[i], (long long)n,
              c->n_want[i]);
        ok += good;
    }
    fprintf(stderr, "vocab %s: %d/%d cases match\n", name, ok, c->n);
    return ok;
}

static void test_spm_vocabs(void)
{
    static const char *const names[] = {"llama-spm", "phi-3", "baichuan"};
    for (size_t v = 0; v < sizeof names / sizeof names[0]; v++) {
        char rel[256];
        snprintf(rel, sizeof rel, "tokenizer/ggml-vocab-%s.gguf", names[v]);
        m40_tokenizer *t = load_gguf_tok(rel, NULL);
        if (!t)
            continue;
        CHECK(m40_tokenizer_kind(t) == M40_TOK_SPM, "%s kind %d", names[v], m40_tokenizer_kind(t));
        vocab_cases c;
        if (cases_load(names[v], &c) == 0) {
            CHECK(c.n == 46, "%s: %d cases", names[v], c.n);
            run_cases(names[v], t, &c);
            cases_free(&c);
        } else {
            fprintf(stderr, "vocab %s: no .inp/.out cases, load checked only\n", names[v]);
            /* Still must encode, and decode back to the text. */
            int32_t ids[64];
            int64_t n = encode(t, "Hello world", 11, 0, 0, ids, 64);
            char out[256];
            size_t len = 0;
            for (int64_t i = 0; i < n; i++)
                len += (size_t)m40_token_to_bytes(t, ids[i], 0, out + len, (int)(sizeof out - len));
            CHECK(n > 0 && len == 12 && !memcmp(out, " Hello world", 12), "%s: decode of encode: '%.*s'",
                  names[v], (int)len, out);
        }
        m40_tokenizer_free(t);
    }
}

/* The .model file through libsentencepiece must agree with the proto we build. */
static void test_model_file_vs_gguf(void)
{
    char path[4096], err[512];
    if (!check_shared_file("tokenizer/llama2-tokenizer.model", path, sizeof path)) {
        SKIP("llama2-tokenizer.model absent");
        return;
    }
    m40_tokenizer *mf;
    int rc = m40_tokenizer_from_spm_file(path, &mf, err, sizeof err);
    CHECK(rc == 0, "load llama2-tokenizer.model: %s", err);
    if (rc)
        return;
    CHECK(m40_tokenizer_n_vocab(mf) == 32000, "n_vocab %d", m40_tokenizer_n_vocab(mf));
    CHECK(m40_tokenizer_bos(mf) == 1 && m40_tokenizer_eos(mf) == 2, "bos %d eos %d", m40_tokenizer_bos(mf),
          m40_tokenizer_eos(mf));
    CHECK(m40_tokenizer_token_type(mf, 0) == M40_TOKEN_UNKNOWN && m40_tokenizer_token_type(mf, 1) == M40_TOKEN_CONTROL &&
              m40_tokenizer_token_type(mf, 3) == M40_TOKEN_BYTE && m40_tokenizer_token_type(mf, 300) == M40_TOKEN_NORMAL,
          "types from the .model file");
    m40_tokenizer *gt = load_gguf_tok("tokenizer/ggml-vocab-llama-spm.gguf", NULL);
    vocab_cases c;
    if (gt && cases_load("llama-spm", &c) == 0) {
        int same = 0;
        for (int i = 0; i < c.n; i++) {
            int32_t a[4096], b[4096];
            int64_t na = encode(mf, c.text[i], c.text_len[i], 0, 0, a, 4096);
            int64_t nb = encode(gt, c.text[i], c.text_len[i], 0, 0, b, 4096);
            int eq = ids_equal(a, na, b, nb) && na >= 0;
            CHECK(eq, "case %d: .model gives %lld ids, GGUF proto %lld", i, (long long)na, (long long)nb);
            same += eq;
        }
        fprintf(stderr, "llama2-tokenizer.model vs ggml-vocab-llama-spm.gguf: %d/%d identical\n", same, c.n);
        run_cases("llama-spm via llama2-tokenizer.model", mf, &c);
        cases_free(&c);
        int32_t id = m40_tokenizer_find_piece(gt, "\xe2\x96\x81Hello");
        for (int32_t k = 0; k < 32000; k += 997) /* pieces agree between the two sources */
            CHECK(!strcmp(m40_tokenizer_piece(mf, k), m40_tokenizer_piece(gt, k)), "piece %d differs", k);
        CHECK(id == 15043 && m40_tokenizer_find_piece(mf, "\xe2\x96\x81Hello") == 15043, "find_piece ▁Hello: %d", id);
    }
    m40_tokenizer_free(gt);
    m40_tokenizer_free(mf);
}

static void test_tok512(void)
{
    char path[4096], err[512];
    if (!check_shared_file("tokenizer/tok512.model", path, sizeof path)) {
        SKIP("tok512.model absent");
        return;
    }
    m40_tokenizer *t;
    int rc = m40_tokenizer_from_spm_file(path, &t, err, sizeof err);
    CHECK(rc == 0, "load tok512.model: %s", err);
    if (rc)
        return;
    CHECK(m40_tokenizer_n_vocab(t) == 512, "n_vocab %d", m40_tokenizer_n_vocab(t));
    const char *text = "Once upon a time, a llama \xf0\x9f\xa6\x99 said \xe4\xbd\xa0\xe5\xa5\xbd.";
    int32_t ids[256];
    int64_t n = encode(t, text, strlen(text), 1, 0, ids, 256);
    CHECK(n > 2 && ids[0] == 1, "tok512 encode: %lld ids, first %d", (long long)n, n > 0 ? ids[0] : -1);
    int bytes = 0;
    for (int64_t i = 0; i < n; i++)
        bytes += m40_tokenizer_token_type(t, ids[i]) == M40_TOKEN_BYTE;
    CHECK(bytes >= 4, "the emoji and CJK go through byte fallback (%d byte tokens)", bytes);
    char out[512];
    size_t len = 0;
    for (int64_t i = 0; i < n; i++)
        len += (size_t)m40_token_to_bytes(t, ids[i], 0, out + len, (int)(sizeof out - len));
    CHECK(len == strlen(text) + 1 && out[0] == ' ' && !memcmp(out + 1, text, strlen(text)),
          "tok512 round trip: '%.*s'", (int)len, out);

    /* stories260K.gguf carries the same 512-piece vocabulary, but tok512.model's
     * normalizer leaves remove_extra_whitespaces at its default (true) while GGUF
     * "llama" vocabularies never drop spaces (Llama 2's own model sets it false). So
     * the two agree on text without leading, trailing or repeated spaces, and on the
     * rest the .model file must behave as its spec says. */
    m40_tokenizer *g = load_gguf_tok("models/stories260K.gguf", NULL);
    vocab_cases c;
    if (g && cases_load("llama-spm", &c) == 0) {
        int same = 0, compared = 0;
        for (int i = 0; i < c.n; i++) {
            const char *x = c.text[i];
            size_t xl = c.text_len[i];
            int spaces = xl > 0 && (x[0] == ' ' || x[xl - 1] == ' ');
            for (size_t k = 0; k + 1 < xl; k++)
                spaces |= x[k] == ' ' && x[k + 1] == ' ';
            if (spaces)
                continue;
            int32_t a[4096], b[4096];
            int64_t na = encode(t, x, xl, 0, 0, a, 4096);
            int64_t nb = encode(g, x, xl, 0, 0, b, 4096);
            same += ids_equal(a, na, b, nb) && na >= 0;
            compared++;
        }
        CHECK(compared >= 25 && same == compared, "tok512.model vs stories260K.gguf: %d/%d identical", same,
              compared);
        cases_free(&c);
        int32_t a[64], b[64];
        int64_t na = encode(t, "   Hello  world ", 16, 0, 0, a, 64);
        int64_t nb = encode(t, "Hello world", 11, 0, 0, b, 64);
        CHECK(ids_equal(a, na, b, nb), "tok512.model removes extra whitespace as its normalizer spec says");
        nb = encode(g, "   Hello  world ", 16, 0, 0, b, 64);
        CHECK(nb > na, "the GGUF vocabulary keeps every space (%lld vs %lld ids)", (long long)nb, (long long)na);
    }
    m40_tokenizer_free(g);
    m40_tokenizer_free(t);
}

/* prompt_tokens of ../shared/models/ref/<model>.json for every model in the list. */
static void test_ref_prompts(const char *const *models, size_t n_models, int want_kind)
{
    for (size_t m = 0; m < n_models; m++) {
        char rel[256], path[4096];
        snprintf(rel, sizeof rel, "models/ref/%s.json", models[m]);
        if (!check_shared_file(rel, path, sizeof path)) {
            SKIP("%s absent", rel);
            continue;
        }
        json_error_t jerr;
        json_t *root = json_load_file(path, 0, &jerr);
        CHECK(root && json_is_array(root), "%s: %s", rel, jerr.text);
        if (!root)
            continue;
        snprintf(rel, sizeof rel, "models/%s.gguf", models[m]);
        m40_tokenizer *t = load_gguf_tok(rel, NULL);
        if (!t) {
            json_decref(root);
            continue;
        }
        CHECK(m40_tokenizer_kind(t) == want_kind, "%s: kind %d", models[m], m40_tokenizer_kind(t));
        size_t i;
        json_t *e;
        int same = 0, total = 0;
        json_array_foreach(root, i, e) {
            json_t *jp = json_object_get(e, "prompt"), *jt = json_object_get(e, "prompt_tokens");
            if (!json_is_string(jp) || !json_is_array(jt))
                continue;
            int32_t want[1024], got[1024];
            int64_t nw = 0;
            size_t k;
            json_t *v;
            json_array_foreach(jt, k, v) if (nw < 1024) want[nw++] = (int32_t)json_integer_value(v);
            int64_t ng = encode(t, json_string_value(jp), json_string_length(jp), m40_tokenizer_add_bos(t), 0, got,
                                1024);
            int eq = ids_equal(got, ng, want, nw);
            CHECK(eq, "%s prompt %zu: %lld ids, reference %lld", models[m], i, (long long)ng, (long long)nw);
            same += eq;
            total++;
        }
        CHECK(total > 0, "%s: no prompts", models[m]);
        fprintf(stderr, "ref %s: %d/%d prompts tokenized identically\n", models[m], same, total);
        m40_tokenizer_free(t);
        json_decref(root);
    }
}

static void test_special_and_ids(void)
{
    m40_tokenizer *t = load_gguf_tok("tokenizer/ggml-vocab-llama-spm.gguf", NULL);
    if (t) {
        int32_t ids[64];
        const char *s = "<s>Hello</s>[INST] hi";
        int64_t n = encode(t, s, strlen(s), 0, 1, ids, 64);
        /* every fragment gets the dummy prefix: "Hello" -> ▁Hello, "[INST]..." -> ▁[ ... */
        CHECK(n == 7 && ids[0] == 1 && ids[1] == 15043 && ids[2] == 2 && ids[3] == 518, "special split: n=%lld %d %d %d",
              (long long)n, ids[0], ids[1], ids[2]);
        n = encode(t, s, strlen(s), 0, 0, ids, 64);
        int ctl = 0;
        for (int64_t i = 0; i < n && i < 64; i++)
            ctl += m40_tokenizer_token_type(t, ids[i]) == M40_TOKEN_CONTROL;
        CHECK(n > 7 && ctl == 0, "without parse_special no control ids (%d of %lld)", ctl, (long long)n);
        /* add_bos, and the count-exceeds-cap convention */
        n = encode(t, "Hello world", 11, 1, 0, ids, 64);
        CHECK(n == 3 && ids[0] == 1 && ids[1] == 15043 && ids[2] == 3186, "Hello world: %lld ids", (long long)n);
        int32_t small[2] = {-7, -7};
        n = encode(t, "Hello world", 11, 1, 0, small, 1);
        CHECK(n == 3 && small[0] == 1 && small[1] == -7, "cap 1: n=%lld, nothing past cap", (long long)n);
        CHECK(encode(t, "", 0, 1, 0, ids, 64) == 1, "empty text with BOS");
        CHECK(encode(t, "", 0, 0, 1, ids, 64) == 0, "empty text");
        CHECK(m40_tokenizer_add_bos(t) == 1 && m40_tokenizer_bos(t) == 1 && m40_tokenizer_eos(t) == 2, "ids");
        CHECK(m40_tokenizer_is_eog(t, 2) && !m40_tokenizer_is_eog(t, 1) && !m40_tokenizer_is_eog(t, 15043), "eog");
        /* hostile bytes never crash; SentencePiece maps invalid UTF-8 to U+FFFD bytes */
        const char bad[] = "a\xff\xfe\x80 b\0c\xc3";
        n = encode(t, bad, sizeof bad - 1, 0, 0, ids, 64);
        CHECK(n > 0, "invalid UTF-8 and NUL encode: %lld", (long long)n);

        char buf[16];
        CHECK(m40_token_to_bytes(t, 15043, 0, buf, 16) == 6 && !memcmp(buf, " Hello", 6), "bytes of ▁Hello");
        CHECK(m40_token_to_bytes(t, 3 + 0xE4, 0, buf, 16) == 1 && (unsigned char)buf[0] == 0xE4, "byte token");
        CHECK(m40_token_to_bytes(t, 2, 0, buf, 16) == 0, "control not rendered");
        CHECK(m40_token_to_bytes(t, 2, 1, buf, 16) == 4 && !memcmp(buf, "</s>", 4), "control rendered");
        CHECK(m40_token_to_bytes(t, 15043, 0, buf, 2) == 6 && buf[0] == ' ' && buf[1] == 'H', "cap 2");
        CHECK(m40_token_to_bytes(t, 32000, 0, buf, 16) == 0 && m40_token_to_bytes(t, -1, 0, buf, 16) == 0, "range");
        CHECK(m40_tokenizer_piece(t, 32000) == NULL && m40_tokenizer_find_piece(t, "no such piece") == -1, "lookups");
        m40_tokenizer_free(t);
    }

    t = load_gguf_tok("tokenizer/ggml-vocab-phi-3.gguf", NULL);
    if (t) {
        int32_t ids[64];
        const char *s = "<|user|>\nHi<|end|>\n<|assistant|>";
        int64_t n = encode(t, s, strlen(s), 1, 1, ids, 64);
        CHECK(n >= 5 && ids[0] == 1 && ids[1] == 32010 && ids[n - 1] == 32001, "phi-3 chat: n=%lld", (long long)n);
        int found_end = 0;
        for (int64_t i = 0; i < n && i < 64; i++)
            found_end += ids[i] == 32007;
        CHECK(found_end == 1, "<|end|> split out");
        CHECK(m40_tokenizer_is_eog(t, 32000) && m40_tokenizer_is_eog(t, 32007) && !m40_tokenizer_is_eog(t, 32010),
              "phi-3 eog: <|endoftext|> and <|end|>");
        CHECK(m40_tokenizer_find_piece(t, "<|end|>") == 32007, "find <|end|>");
        /* "</s>" is USER_DEFINED in Phi-3: always one token, as in the reference */
        n = encode(t, "a</s>", 5, 0, 0, ids, 64);
        CHECK(n >= 2 && ids[n - 1] == 2, "phi-3 user-defined </s> split without parse_special");
        n = encode(t, "a<|end|>", 8, 0, 0, ids, 64);
        CHECK(n > 2 && ids[n - 1] != 32007, "phi-3 control <|end|> is text without parse_special");
        m40_tokenizer_free(t);
    }
}

/* ---- synthetic vocabularies (gguf_writer) ---- */

static m40_gguf *synth(const char *model, const char *const *toks, const float *scores, const int32_t *types, int n,
                       void **mem)
{
    char err[256];
    m40_gguf_writer *w = m40_gguf_writer_new();
    m40_gguf *g = NULL;
    size_t size;
    *mem = NULL;
    if (!w)
        return NULL;
    m40_gguf_writer_set_str(w, "general.architecture", "llama");
    if (model)
        m40_gguf_writer_set_str(w, "tokenizer.ggml.model", model);
    m40_gguf_writer_set_arr_str(w, "tokenizer.ggml.tokens", toks, (uint64_t)n);
    if (scores)
        m40_gguf_writer_set_arr_f32(w, "tokenizer.ggml.scores", scores, (uint64_t)n);
    if (types)
        m40_gguf_writer_set_arr_i32(w, "tokenizer.ggml.token_type", types, (uint64_t)n);
    if (m40_gguf_writer_write_mem(w, mem, &size, err, sizeof err) != 0 ||
        m40_gguf_open_mem(*mem, size, &g, err, sizeof err) != 0) {
        fprintf(stderr, "synthetic gguf: %s\n", err);
        g = NULL;
    }
    m40_gguf_writer_free(w);
    return g;
}

static void test_synthetic(void)
{
    /* 3 specials, 256 bytes, then a few pieces with every defect at once */
    enum { NB = 256, NX = 10, N = 3 + NB + NX };
    static char bytebuf[NB][8];
    const char *toks[N];
    float scores[N];
    int32_t types[N];
    toks[0] = "<unk>", toks[1] = "<s>", toks[2] = "</s>";
    types[0] = M40_TOKEN_CONTROL; /* no UNKNOWN-typed token at all, as Phi-3's <unk> */
    types[1] = types[2] = M40_TOKEN_CONTROL;
    for (int i = 0; i < NB; i++) {
        snprintf(bytebuf[i], sizeof bytebuf[i], "<0x%02X>", i);
        toks[3 + i] = bytebuf[i];
        types[3 + i] = M40_TOKEN_BYTE;
    }
    const char *extra[NX] = {"\xe2\x96\x81", "a", "b", "\xe2\x96\x81" "a", "ab", "",
                             "a" /* repeat */, "<0xzz>" /* bad byte */, "<x>", "<x>y"};
    const int32_t xtypes[NX] = {1, 1, 1, 1, 1, 1, 1, M40_TOKEN_BYTE, M40_TOKEN_CONTROL, M40_TOKEN_CONTROL};
    for (int i = 0; i < N; i++)
        scores[i] = 0;
    for (int i = 0; i < NX; i++) {
        toks[3 + NB + i] = extra[i];
        types[3 + NB + i] = xtypes[i];
        scores[3 + NB + i] = -(float)i;
    }
    scores[3 + NB + 4] = NAN; /* "ab" */
    types[3 + NB + 2] = 99;  /* "b": undefined type, treated as normal */
    const int A = 3 + NB + 1, B = A + 1, SPA = 3 + NB + 3, X = 3 + NB + 8, XY = X + 1;

    void *mem;
    char err[512];
    m40_gguf *g = synth("llama", toks, scores, types, N, &mem);
    CHECK(g != NULL, "synthetic vocabulary written and read");
    if (g) {
        m40_tokenizer *t;
        int rc = m40_tokenizer_from_gguf(g, &t, err, sizeof err);
        CHECK(rc == 0, "defective vocabulary still loads: %s", err);
        m40_gguf_close(g);
        if (rc == 0) {
            int32_t ids[64];
            int64_t n = encode(t, "ab a", 4, 0, 0, ids, 64);
            /* "▁a" + "b" ("ab" has a NaN score and merges last, after ▁a) then "▁a" */
            CHECK(n == 3 && ids[0] == SPA && ids[1] == B && ids[2] == SPA, "synthetic encode: n=%lld first %d",
                  (long long)n, n > 0 ? ids[0] : -1);
            n = encode(t, "<x>yb", 5, 0, 1, ids, 64);
            CHECK(n == 3 && ids[0] == XY && ids[1] == 3 + NB && ids[2] == B, "longest special first: n=%lld id %d",
                  (long long)n, n > 0 ? ids[0] : -1);
            n = encode(t, "<x>", 3, 0, 1, ids, 64);
            CHECK(n == 1 && ids[0] == X, "shorter special: %d", n > 0 ? ids[0] : -1);
            n = encode(t, "z", 1, 0, 0, ids, 64);
            /* ▁ then byte fallback for z */
            CHECK(n == 2 && ids[0] == 3 + NB && ids[1] == 3 + 'z', "byte fallback: n=%lld", (long long)n);
            CHECK(m40_tokenizer_find_piece(t, "a") == A && m40_tokenizer_find_piece(t, "b") == B, "first id wins");
            m40_tokenizer_free(t);
        }
    }
    free(mem);

    g = synth("t5", toks, scores, types, N, &mem);
    if (g) {
        m40_tokenizer *t = NULL;
        CHECK(m40_tokenizer_from_gguf(g, &t, err, sizeof err) != 0 && strstr(err, "t5") && !t,
              "unknown tokenizer model named: %s", err);
        m40_gguf_close(g);
    }
    free(mem);
    g = synth(NULL, toks, scores, types, N, &mem);
    if (g) {
        m40_tokenizer *t = NULL;
        CHECK(m40_tokenizer_from_gguf(g, &t, err, sizeof err) != 0 && strstr(err, "tokenizer.ggml.model"),
              "missing model key: %s", err);
        m40_gguf_close(g);
    }
    free(mem);
    /* scores of the wrong length */
    g = synth("llama", toks, scores, types, N, &mem);
    if (g) {
        unsigned char *proto;
        size_t len;
        CHECK(m40_spm_proto_from_gguf(g, &proto, &len, err, sizeof err) == 0 && len > 0, "proto: %s", err);
        m40_spm *s = m40_spm_load_proto(proto, len, err, sizeof err);
        CHECK(s && m40_spm_n_pieces(s) == N && fabsf(m40_spm_score(s, SPA) + 3.0f) < 1e-6f, "proto loads, scores kept");
        m40_spm_free(s);
        free(proto);
        CHECK(m40_spm_load_proto("\x0a\xff\xff", 3, err, sizeof err) == NULL && err[0],
              "garbage proto refused: %s", err);
        m40_gguf_close(g);
    }
    free(mem);
    /* no unknown token at all */
    toks[0] = "<unkx>";
    g = synth("llama", toks, scores, NULL, N, &mem);
    if (g) {
        m40_tokenizer *t = NULL;
        CHECK(m40_tokenizer_from_gguf(g, &t, err, sizeof err) != 0 && strstr(err, "unknown"), "no unk: %s", err);
        m40_gguf_close(g);
    }
    free(mem);
    m40_tokenizer *t = NULL;
    CHECK(m40_tokenizer_from_spm_file("/nonexistent/x.model", &t, err, sizeof err) != 0 && strstr(err, "x.model"),
          "missing .model file: %s", err);
}

/* Damaged .model files (truncated, bytes flipped) load or fail with a message, and
 * whatever loads encodes without crashing. */
static void test_damaged_model_file(void)
{
    char path[4096], err[512];
    size_t len;
    if (!check_shared_file("tokenizer/tok512.model", path, sizeof path)) {
        SKIP("tok512.model absent");
        return;
    }
    char *orig = read_all(path, &len);
    char tmpl[] = "/tmp/m40_test_spm_XXXXXX";
    int fd = orig ? mkstemp(tmpl) : -1;
    CHECK(fd >= 0, "temporary file");
    if (fd < 0) {
        free(orig);
        return;
    }
    close(fd);
    char *buf = malloc(len);
    uint64_t rng = 88172645463325252ull;
    int loaded = 0, refused = 0, silent = 0;
    for (int k = 0; buf && k < 60; k++) {
        memcpy(buf, orig, len);
        size_t n = len;
        rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
        if (k % 2)
            n = (size_t)(rng % len);
        else
            for (int f = 0; f < 1 + k % 3; f++) {
                rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
                buf[rng % len] ^= (char)(1 + (rng >> 32) % 255);
            }
        FILE *f = fopen(tmpl, "wb");
        if (!f || fwrite(buf, 1, n, f) != n) {
            if (f)
                fclose(f);
            continue;
        }
        fclose(f);
        m40_tokenizer *t = NULL;
        err[0] = 0;
        if (m40_tokenizer_from_spm_file(tmpl, &t, err, sizeof err) == 0) {
            int32_t ids[256];
            loaded += encode(t, "Once upon a time \xf0\x9f\xa6\x99", 21, 1, 1, ids, 256) >= 0;
            m40_tokenizer_free(t);
        } else {
            refused++;
            silent += err[0] == 0;
        }
    }
    fprintf(stderr, "damaged .model files: %d loaded, %d refused\n", loaded, refused);
    CHECK(silent == 0 && loaded + refused > 0, "damaged .model: %d loaded, %d refused, %d without message", loaded,
          refused, silent);
    unlink(tmpl);
    free(buf);
    free(orig);
}

/* Byte-level BPE vocabularies through the front end (the backend's own tests are in
 * test_bpe.c): only meaningful once bpe.c encodes these, so a vocabulary whose
 * tokenizer fails to load is reported as a skip with its message. */
static void test_bpe_front_end(void)
{
    static const char *const names[] = {"gpt-2", "deepseek-llm", "deepseek-coder", "falcon", "mpt", "starcoder",
                                         "refact"};
    for (size_t v = 0; v < sizeof names / sizeof names[0]; v++) {
        char rel[256], path[4096], err[512];
        snprintf(rel, sizeof rel, "tokenizer/ggml-vocab-%s.gguf", names[v]);
        if (!check_shared_file(rel, path, sizeof path)) {
            SKIP("%s absent", rel);
            continue;
        }
        m40_gguf *g;
        m40_tokenizer *t;
        if (m40_gguf_open(path, &g, err, sizeof err) != 0) {
            CHECK(0, "open %s: %s", rel, err);
            continue;
        }
        int rc = m40_tokenizer_from_gguf(g, &t, err, sizeof err);
        m40_gguf_close(g);
        if (rc != 0) {
            SKIP("%s: BPE tokenizer not available: %s", names[v], err);
            continue;
        }
        CHECK(m40_tokenizer_kind(t) == M40_TOK_BPE, "%s: BPE", names[v]);
        vocab_cases c;
        if (cases_load(names[v], &c) == 0) {
            run_cases(names[v], t, &c);
            cases_free(&c);
        }
        if (!strcmp(names[v], "gpt-2")) {
            int32_t ids[64];
            const char *s = "hi<|endoftext|>";
            int64_t n = encode(t, s, strlen(s), 0, 0, ids, 64);
            int ctl = 0;
            for (int64_t i = 0; i < n && i < 64; i++)
                ctl += ids[i] == 50256;
            CHECK(n > 2 && ctl == 0, "gpt-2: <|endoftext|> is text without parse_special");
            n = encode(t, s, strlen(s), 0, 1, ids, 64);
            CHECK(n == 2 && ids[1] == 50256, "gpt-2: <|endoftext|> split with parse_special (n=%lld)", (long long)n);
        }
        m40_tokenizer_free(t);
    }
}

int main(void)
{
    if (!check_shared_dir())
        SKIP("shared fixtures absent: only synthetic vocabularies tested");
    test_spm_vocabs();
    test_model_file_vs_gguf();
    test_tok512();
    static const char *const spm_models[] = {"stories260K", "aidreams260K", "tiny-llama-spm-f32",
                                             "tiny-llama-spm-gqa-f16", "tiny-llama-q8_0"};
    test_ref_prompts(spm_models, sizeof spm_models / sizeof spm_models[0], M40_TOK_SPM);
    test_special_and_ids();
    test_synthetic();
    test_damaged_model_file();
    test_bpe_front_end();
    static const char *const bpe_models[] = {"tiny-qwen2-gpt2-f16"};
    test_ref_prompts(bpe_models, sizeof bpe_models / sizeof bpe_models[0], M40_TOK_BPE);
    return check_done();
}
