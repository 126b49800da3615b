/* Byte-level BPE: the reference cases of every gpt2-model vocabulary in
 * ../shared/tokenizer, llama.cpp's ids for the one without tokenizer.ggml.pre
 * (gpt-neox), exact byte round trips (hostile bytes included), the prompts of the tiny
 * qwen2 model, and small synthetic vocabularies that pin down merge order, the byte
 * fallback, the missing-pre fallback and the error paths. */
#include <jansson.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "tokenizer/bpe.h"
#include "check.h"
#include "gguf/gguf.h"
#include "gguf/gguf_writer.h"
#include "tokenizer/tokenizer.h"

#include "bpe_default_cases.h"

#define SEP "\n__ggml_vocab_test__\n"

static char *read_file(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    size_t cap = 4096, n = 0;
    char *buf = malloc(cap + 1);
    while (buf) {
        size_t r = fread(buf + n, 1, cap - n, f);
        n += r;
        if (n < cap)
            break;
        char *nb = realloc(buf, cap * 2 + 1);
        if (!nb) {
            free(buf);
            buf = NULL;
            break;
        }
        buf = nb;
        cap *= 2;
    }
    fclose(f);
    if (buf) {
        buf[n] = '\0';
        *len = n;
    }
    return buf;
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* Encodes into a malloc'd array (two calls: the count contract of m40_bpe_encode). */
static int32_t *encode(const m40_bpe *b, const char *s, size_t n, int64_t *count)
{
    int64_t c = m40_bpe_encode(b, s, n, NULL, 0);
    *count = c;
    if (c < 0)
        return NULL;
    int32_t *ids = malloc((size_t)(c ? c : 1) * sizeof *ids);
    if (!ids)
        return NULL;
    int64_t c2 = m40_bpe_encode(b, s, n, ids, c);
    if (c2 != c) {
        free(ids);
        *count = -1;
        return NULL;
    }
    return ids;
}

/* Concatenated token bytes equal the input exactly. */
static int round_trips(const m40_bpe *b, const char *s, size_t n, const int32_t *ids, int64_t count)
{
    char *out = malloc(n + 1);
    size_t o = 0;
    int ok = out != NULL;
    for (int64_t i = 0; ok && i < count; i++) {
        char tmp[512];
        int k = m40_bpe_token_bytes(b, ids[i], tmp, (int)sizeof tmp);
        if (k < 0 || k > (int)sizeof tmp || o + (size_t)k > n)
            ok = 0;
        else {
            memcpy(out + o, tmp, (size_t)k);
            o += (size_t)k;
        }
    }
    ok = ok && o == n && memcmp(out, s, n) == 0;
    free(out);
    return ok;
}

static void fmt_ids(char *buf, size_t cap, const int32_t *ids, int64_t n)
{
    size_t o = 0;
    buf[0] = '\0';
    for (int64_t i = 0; i < n && o + 16 < cap; i++)
        o += (size_t)snprintf(buf + o, cap - o, "%s%d", i ? " " : "", ids[i]);
}

/* The caller's part (tokenizer.c): user-defined tokens (token_type 4, e.g. NeoX's
 * whitespace runs, DeepSeek's added Latin-1 letters) are plain-text pieces that the
 * reference tokenizers match before pre-tokenization, leftmost and longest first.
 * This splits them out and hands the text between them to m40_bpe_encode. */
typedef struct {
    const m40_gguf_value *toks;
    int32_t *ud; /* ids of user-defined tokens */
    int n_ud;
} specials;

static void specials_load(specials *sp, const m40_gguf *g)
{
    sp->toks = m40_gguf_get_arr(g, "tokenizer.ggml.tokens", M40_GGUF_STRING);
    const m40_gguf_value *tt = m40_gguf_get_arr(g, "tokenizer.ggml.token_type", M40_GGUF_INT32);
    sp->n_ud = 0;
    sp->ud = NULL;
    if (!sp->toks || !tt || tt->v.arr.n != sp->toks->v.arr.n)
        return;
    sp->ud = malloc(tt->v.arr.n * sizeof *sp->ud);
    for (uint64_t i = 0; sp->ud && i < tt->v.arr.n; i++)
        if (tt->v.arr.items[i].v.i64 == 4 && sp->toks->v.arr.items[i].v.str.len > 0)
            sp->ud[sp->n_ud++] = (int32_t)i;
}

static int32_t *encode_with_specials(const m40_bpe *b, const specials *sp, const char *s, size_t n,
                                     int64_t *count)
{
    size_t cap = n + 16, cnt = 0, seg = 0, i = 0;
    int32_t *out = malloc(cap * sizeof *out);
    if (!out) {
        *count = -1;
        return NULL;
    }
    while (i <= n) {
        int32_t best = -1;
        size_t best_len = 0;
        for (int k = 0; i < n && k < sp->n_ud; k++) {
            const m40_gguf_value *t = &sp->toks->v.arr.items[sp->ud[k]];
            if (t->v.str.len > best_len && t->v.str.len <= n - i && memcmp(s + i, t->v.str.ptr, t->v.str.len) == 0) {
                best = sp->ud[k];
                best_len = t->v.str.len;
            }
        }
        if (best < 0 && i < n) {
            i++;
            continue;
        }
        /* text before the match (or the tail) through BPE */
        int64_t m = m40_bpe_encode(b, s + seg, i - seg, out + cnt, (int64_t)(cap - cnt - 1));
        if (m < 0 || (size_t)m > cap - cnt - 1) {
            free(out);
            *count = -1;
            return NULL;
        }
        cnt += (size_t)m;
        if (best < 0)
            break;
        out[cnt++] = best;
        i += best_len;
        seg = i;
    }
    *count = (int64_t)cnt;
    return out;
}

/* Bytes whose mapped character is a normal token: only those can come back from a
 * bytewise encoding (falcon, for one, has no token for some control bytes, and
 * DeepSeek's tokens for bytes that never occur in UTF-8 are user-defined text). */
static int representable_bytes(const m40_gguf *g, unsigned char *ok);

static void test_vocab(const char *name, double *total_time)
{
    char rel[256], path[4096], inp_path[4096], out_path[4096];
    snprintf(rel, sizeof rel, "tokenizer/ggml-vocab-%s.gguf", name);
    if (!check_shared_file(rel, path, sizeof path)) {
        SKIP("%s absent (no ../shared/tokenizer)", rel);
        return;
    }
    m40_gguf *g = NULL;
    char err[256];
    if (m40_gguf_open(path, &g, err, sizeof err) != 0) {
        CHECK(0, "open %s: %s", path, err);
        return;
    }
    m40_bpe *b = m40_bpe_new(g, err, sizeof err);
    CHECK(b != NULL, "m40_bpe_new(%s): %s", name, err);
    if (!b) {
        m40_gguf_close(g);
        return;
    }
    specials sp;
    specials_load(&sp, g);
    const char *pre = m40_gguf_get_str(g, "tokenizer.ggml.pre");
    CHECK(strcmp(m40_bpe_pre_name(b), pre ? pre : "default") == 0, "pre name %s", m40_bpe_pre_name(b));
    /* A load warning exactly when the file lacks the key. */
    CHECK((m40_bpe_load_warning(b) != NULL) == (pre == NULL), "%s: load warning %s", name,
          m40_bpe_load_warning(b) ? m40_bpe_load_warning(b) : "(none)");

    snprintf(rel, sizeof rel, "tokenizer/ggml-vocab-%s.gguf.inp", name);
    const char *ip = check_shared_file(rel, inp_path, sizeof inp_path);
    snprintf(rel, sizeof rel, "tokenizer/ggml-vocab-%s.gguf.out", name);
    const char *op = check_shared_file(rel, out_path, sizeof out_path);
    size_t inp_len = 0, out_len = 0;
    char *inp = ip ? read_file(ip, &inp_len) : NULL;
    char *outs = op ? read_file(op, &out_len) : NULL;
    if (!inp || !outs) {
        /* gpt-neox ships no cases: still prove the vocab loads and round-trips. */
        const char *s = "Hello world, 123 \xF0\x9F\xA6\x99  \n\t x";
        int64_t n;
        int32_t *ids = encode(b, s, strlen(s), &n);
        CHECK(ids && n > 0 && round_trips(b, s, strlen(s), ids, n), "%s round trip", name);
        free(ids);
        printf("vocab %-15s (pre %s): no .inp/.out cases, loads and round-trips\n", name, m40_bpe_pre_name(b));
        free(inp);
        free(outs);
        free(sp.ud);
        m40_bpe_free(b);
        m40_gguf_close(g);
        return;
    }

    int cases = 0, passed = 0, rt_ok = 0;
    char *p = inp, *end = inp + inp_len, *line = outs;
    double enc_time = 0;
    for (;;) {
        char *sep = strstr(p, SEP);
        if (!sep)
            break;
        size_t n = (size_t)(sep - p);
        /* expected ids: the next line of .out, surrounding whitespace stripped */
        char *nl = strchr(line, '\n');
        char *lend = nl ? nl : line + strlen(line);
        int32_t want[1024];
        int64_t nwant = 0;
        for (char *q = line; q < lend && nwant < 1024;) {
            while (q < lend && (*q == ' ' || *q == '\r' || *q == '\t'))
                q++;
            if (q >= lend)
                break;
            want[nwant++] = (int32_t)strtol(q, &q, 10);
        }
        line = nl ? nl + 1 : lend;

        int64_t got_n;
        int32_t *got = encode_with_specials(b, &sp, p, n, &got_n);
        int ok = got && got_n == nwant && memcmp(got, want, (size_t)nwant * sizeof *got) == 0;
        if (!ok) {
            char a[2048], w[2048];
            fmt_ids(a, sizeof a, got, got ? got_n : 0);
            fmt_ids(w, sizeof w, want, nwant);
            CHECK(ok, "%s case %d %.*s:\n  got  %s\n  want %s", name, cases, (int)(n > 60 ? 60 : n), p, a, w);
        } else {
            CHECK(ok, "%s case %d", name, cases);
            passed++;
        }
        int rt = got && round_trips(b, p, n, got, got_n);
        CHECK(rt, "%s case %d does not round-trip", name, cases);
        rt_ok += rt;
        free(got);
        cases++;
        p = sep + strlen(SEP);
        if (p >= end)
            break;
    }
    CHECK(cases == 46, "%s: %d cases, expected 46", name, cases);

    /* The whole file at once (separators included): round trip at scale, and the
     * speed of m40_bpe_encode alone (ten passes over the file). */
    int64_t n_all;
    int32_t *all = encode_with_specials(b, &sp, inp, inp_len, &n_all);
    CHECK(all && round_trips(b, inp, inp_len, all, n_all), "%s whole .inp does not round-trip", name);
    free(all);
    double e0 = now_s();
    for (int rep = 0; rep < 10; rep++) {
        all = encode(b, inp, inp_len, &n_all);
        CHECK(all != NULL, "%s: encode of the whole .inp failed", name);
        free(all);
    }
    enc_time = (now_s() - e0) / 10;
    *total_time += enc_time;
    printf("vocab %-15s (pre %s): %d/%d cases match, %d/%d round-trip, encode %.2f ms\n", name,
           m40_bpe_pre_name(b), passed, cases, rt_ok, cases, enc_time * 1e3);

    /* Random bytes (invalid UTF-8, NULs, stray continuation bytes): never fails, and
     * the bytes come back exactly. */
    unsigned char rep[256];
    int n_rep = representable_bytes(g, rep);
    unsigned char pool[256];
    int np = 0;
    for (int c = 0; c < 256; c++)
        if (rep[c])
            pool[np++] = (unsigned char)c;
    CHECK(np > 200, "%s: only %d bytes have tokens", name, np);
    uint64_t x = 0x9E3779B97F4A7C15ULL;
    int rand_ok = 0;
    for (int it = 0; it < 200; it++) {
        char s[400];
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        size_t len = (size_t)(x % sizeof s);
        for (size_t i = 0; i < len; i++) {
            x ^= x << 13, x ^= x >> 7, x ^= x << 17;
            /* mix of plain ASCII (so that merges happen) and arbitrary bytes */
            s[i] = (x >> 40) % 3 ? (char)(" \nab1'.\xC3\xA9"[(x >> 20) % 10]) : (char)pool[(x >> 8) % (uint64_t)np];
        }
        int64_t n;
        int32_t *ids = encode(b, s, len, &n);
        rand_ok += ids && round_trips(b, s, len, ids, n);
        free(ids);
    }
    CHECK(rand_ok == 200, "%s: %d/200 random byte strings round-trip", name, rand_ok);
    printf("vocab %-15s %d/256 bytes have normal tokens; %d/200 random byte strings round-trip\n", name, n_rep,
           rand_ok);
    free(sp.ud);

    free(inp);
    free(outs);
    m40_bpe_free(b);
    m40_gguf_close(g);
}

/* gpt-neox has no tokenizer.ggml.pre: llama.cpp, and so Ollama, tokenize it with their
 * "default" pre-tokenizer, and so must we. The expected ids (bpe_default_cases.h) come
 * from tests/tokenizer/bpe_default_ref.py, which derives them from that pre-tokenizer's
 * definition with Python's regex module and the file's merges, and checks them against
 * Hugging Face tokenizers and llama.cpp (llama-cpp-python) where those are installed.
 * Through the whole tokenizer, as llama_tokenize(add_special = false, parse_special =
 * false) runs: NeoX's whitespace runs are user-defined tokens, split out before the
 * regexes see the text. */
static void test_gpt_neox_default(void)
{
    char path[4096], err[256];
    if (!check_shared_file("tokenizer/ggml-vocab-gpt-neox.gguf", path, sizeof path)) {
        SKIP("tokenizer/ggml-vocab-gpt-neox.gguf absent (no ../shared/tokenizer)");
        return;
    }
    m40_gguf *g = NULL;
    m40_tokenizer *t = NULL;
    if (m40_gguf_open(path, &g, err, sizeof err) != 0) {
        CHECK(0, "open %s: %s", path, err);
        return;
    }
    CHECK(m40_gguf_get(g, "tokenizer.ggml.pre") == NULL, "gpt-neox now has tokenizer.ggml.pre: pick another file");
    int rc = m40_tokenizer_from_gguf(g, &t, err, sizeof err);
    m40_gguf_close(g);
    CHECK(rc == 0, "gpt-neox tokenizer: %s", err);
    if (rc != 0)
        return;
    const char *w = m40_tokenizer_load_warning(t);
    CHECK(w && strstr(w, "tokenizer.ggml.pre is missing") && strstr(w, "\"default\""), "gpt-neox load warning: %s",
          w ? w : "(none)");

    int n_cases = (int)(sizeof bpe_default_cases / sizeof bpe_default_cases[0]), passed = 0;
    for (int i = 0; i < n_cases; i++) {
        const char *text = bpe_default_cases[i].text;
        int32_t got[256];
        int64_t n = m40_tokenize(t, text, strlen(text), 0, 0, got, 256, err, sizeof err);
        int ok = n == bpe_default_cases[i].n &&
                 memcmp(got, bpe_default_cases[i].ids, (size_t)n * sizeof got[0]) == 0;
        if (!ok) {
            char a[2048], b[2048];
            fmt_ids(a, sizeof a, got, n > 0 && n <= 256 ? n : 0);
            fmt_ids(b, sizeof b, bpe_default_cases[i].ids, bpe_default_cases[i].n);
            CHECK(ok, "gpt-neox default case %d '%s':\n  got  %s\n  want %s", i, text, a, b);
        } else {
            CHECK(ok, "gpt-neox default case %d", i);
            passed++;
        }
    }
    printf("vocab %-15s (pre missing -> default): %d/%d cases match llama.cpp's ids\n", "gpt-neox", passed,
           n_cases);
    m40_tokenizer_free(t);
}

static void test_qwen2_prompts(void)
{
    char path[4096], jpath[4096];
    if (!check_shared_file("models/tiny-qwen2-gpt2-f16.gguf", path, sizeof path) ||
        !check_shared_file("models/ref/tiny-qwen2-gpt2-f16.json", jpath, sizeof jpath)) {
        SKIP("tiny-qwen2-gpt2-f16 model or reference absent");
        return;
    }
    m40_gguf *g = NULL;
    char err[256];
    if (m40_gguf_open(path, &g, err, sizeof err) != 0) {
        CHECK(0, "open %s: %s", path, err);
        return;
    }
    m40_bpe *b = m40_bpe_new(g, err, sizeof err);
    CHECK(b != NULL, "m40_bpe_new(tiny-qwen2): %s", err);
    json_error_t je;
    json_t *root = json_load_file(jpath, 0, &je);
    CHECK(root && json_is_array(root), "parse %s: %s", jpath, root ? "not an array" : je.text);
    int prompts = 0, ok_n = 0;
    for (size_t i = 0; b && root && json_is_array(root) && i < json_array_size(root); i++) {
        json_t *e = json_array_get(root, i);
        json_t *pr = json_object_get(e, "prompt"), *pt = json_object_get(e, "prompt_tokens");
        if (!json_is_string(pr) || !json_is_array(pt)) {
            CHECK(0, "entry %zu lacks prompt/prompt_tokens", i);
            continue;
        }
        int64_t n;
        int32_t *ids = encode(b, json_string_value(pr), json_string_length(pr), &n);
        int ok = ids && (size_t)n == json_array_size(pt);
        for (size_t k = 0; ok && k < json_array_size(pt); k++)
            ok = json_integer_value(json_array_get(pt, k)) == ids[k];
        CHECK(ok, "tiny-qwen2 prompt %zu '%s' tokenizes differently", i, json_string_value(pr));
        ok_n += ok;
        prompts++;
        free(ids);
    }
    printf("tiny-qwen2-gpt2-f16: %d/%d prompts match prompt_tokens\n", ok_n, prompts);
    json_decref(root);
    m40_bpe_free(b);
    m40_gguf_close(g);
}

/* m40_tokenize_guarded (chat prompts: the messages' text is protected) on tiny-qwen2's
 * vocabulary, whose one control token is <|endoftext|> (50256): no ranges is
 * parse_special, one range over everything is plain text, a control string inside a
 * range or reaching into one stays text, one outside stays a control id; and every other
 * token is the same as whole-text tokenization gives. */
static void test_guarded(void)
{
    char path[4096], err[256];
    if (!check_shared_file("models/tiny-qwen2-gpt2-f16.gguf", path, sizeof path)) {
        SKIP("tiny-qwen2-gpt2-f16 absent");
        return;
    }
    m40_gguf *g = NULL;
    m40_tokenizer *t = NULL;
    if (m40_gguf_open(path, &g, err, sizeof err) != 0 || m40_tokenizer_from_gguf(g, &t, err, sizeof err) != 0) {
        CHECK(0, "load %s: %s", path, err);
        m40_gguf_close(g);
        return;
    }
    const char text[] = "<|endoftext|>user: hi<|endoftext|> there<|endoftext|>";
    const size_t len = sizeof text - 1, user = 13, user_end = 35; /* "user: hi<|endoftext|>" */
    int32_t a[64], b[64], c[64];
    const size_t all[2] = {0, len}, mid[2] = {user, user_end}, straddle[2] = {18, 20};
    int64_t na = m40_tokenize(t, text, len, 0, 1, a, 64, err, sizeof err);
    int64_t nb = m40_tokenize_guarded(t, text, len, 0, NULL, 0, b, 64, err, sizeof err);
    CHECK(na > 0 && na == nb && !memcmp(a, b, (size_t)na * 4), "no ranges: parse_special (%lld, %lld)", (long long)na,
          (long long)nb);
    na = m40_tokenize(t, text, len, 0, 0, a, 64, err, sizeof err);
    nb = m40_tokenize_guarded(t, text, len, 0, all, 1, b, 64, err, sizeof err);
    CHECK(na > 0 && na == nb && !memcmp(a, b, (size_t)na * 4), "one range over all: plain text");
    int64_t nc = m40_tokenize_guarded(t, text, len, 0, mid, 1, c, 64, err, sizeof err);
    int specials = 0;
    for (int64_t i = 0; i < nc; i++)
        specials += c[i] == 50256;
    CHECK(nc > 0 && specials == 2 && c[0] == 50256 && c[nc - 1] == 50256,
          "the protected one stays text, the two outside are control ids (%d)", specials);
    /* a control string that starts outside a range and reaches into it is text too */
    nc = m40_tokenize_guarded(t, text, len, 0, straddle, 1, c, 64, err, sizeof err);
    CHECK(nc > 0 && c[0] == 50256, "a range elsewhere leaves the first control id (%lld)", (long long)nc);
    const size_t into[2] = {5, 10};
    nc = m40_tokenize_guarded(t, text, len, 0, into, 1, c, 64, err, sizeof err);
    CHECK(nc > 1 && c[0] != 50256, "a control string reaching into a range is text");
    m40_tokenizer_free(t);
    m40_gguf_close(g);
}

/* The GPT-2 mapped form of a byte string (what vocab and merge strings are made of):
 * printable Latin-1 bytes stay, the other 68 go to U+0100.. in byte order. Written
 * independently of bpe.c's table so that a wrong table there shows up here. */
static void mapped(const char *s, char *out)
{
    size_t o = 0;
    for (; *s; s++) {
        unsigned c = (unsigned char)*s;
        int cp = 256;
        for (unsigned i = 0; i < c; i++)
            cp += !((i >= 0x21 && i <= 0x7E) || (i >= 0xA1 && i <= 0xAC) || i >= 0xAE);
        if ((c >= 0x21 && c <= 0x7E) || (c >= 0xA1 && c <= 0xAC) || c >= 0xAE)
            cp = (int)c;
        if (cp < 0x80)
            out[o++] = (char)cp;
        else {
            out[o++] = (char)(0xC0 | (cp >> 6));
            out[o++] = (char)(0x80 | (cp & 0x3F));
        }
    }
    out[o] = '\0';
}

static int representable_bytes(const m40_gguf *g, unsigned char *ok)
{
    const m40_gguf_value *toks = m40_gguf_get_arr(g, "tokenizer.ggml.tokens", M40_GGUF_STRING);
    const m40_gguf_value *tt = m40_gguf_get_arr(g, "tokenizer.ggml.token_type", M40_GGUF_INT32);
    int n = 0;
    for (int c = 0; c < 256; c++) {
        char one[2] = {(char)c, 0}, m[8];
        if (c == 0)
            strcpy(m, "\xC4\x80");
        else
            mapped(one, m);
        ok[c] = 0;
        for (uint64_t i = 0; toks && i < toks->v.arr.n && !ok[c]; i++)
            if (toks->v.arr.items[i].v.str.len == strlen(m) && memcmp(toks->v.arr.items[i].v.str.ptr, m, strlen(m)) == 0)
                ok[c] = !tt || tt->v.arr.n != toks->v.arr.n || tt->v.arr.items[i].v.i64 == 1;
        n += ok[c];
    }
    return n;
}

/* A tiny vocabulary: the 256 byte tokens, then extra tokens; merges as given. */
static m40_bpe *tiny_bpe(const char *pre, const char *const *extra, int n_extra, const char *const *merges,
                         int n_merges, void **mem, m40_gguf **g, char *err, size_t errlen)
{
    static char strs[256 + 16][64];
    const char *toks[256 + 16];
    for (int i = 0; i < 256; i++) {
        char one[2] = {(char)i, 0};
        if (i == 0) {
            /* NUL: mapped by hand (strings here are NUL-terminated): byte 0 -> U+0100 */
            strs[i][0] = (char)0xC4, strs[i][1] = (char)0x80, strs[i][2] = 0;
        } else
            mapped(one, strs[i]);
        toks[i] = strs[i];
    }
    for (int i = 0; i < n_extra; i++)
        toks[256 + i] = extra[i];
    m40_gguf_writer *w = m40_gguf_writer_new();
    *mem = NULL;
    *g = NULL;
    if (!w)
        return NULL;
    m40_gguf_writer_set_str(w, "tokenizer.ggml.model", "gpt2");
    if (pre)
        m40_gguf_writer_set_str(w, "tokenizer.ggml.pre", pre);
    m40_gguf_writer_set_arr_str(w, "tokenizer.ggml.tokens", toks, (uint64_t)(256 + n_extra));
    m40_gguf_writer_set_arr_str(w, "tokenizer.ggml.merges", merges, (uint64_t)n_merges);
    size_t size = 0;
    int rc = m40_gguf_writer_write_mem(w, mem, &size, err, errlen);
    m40_gguf_writer_free(w);
    if (rc != 0)
        return NULL;
    if (m40_gguf_open_mem(*mem, size, g, err, errlen) != 0)
        return NULL;
    return m40_bpe_new(*g, err, errlen);
}

static void test_synthetic(void)
{
    char err[256];
    void *mem;
    m40_gguf *g;
    char ab[8], bc[8], sp_a[8], mab[16], mbc[16], msp[16];
    mapped("ab", ab);
    mapped("bc", bc);
    mapped(" a", sp_a);

    /* Merge order is by rank, not position: "b c" (rank 0) beats "a b" (rank 1), so
     * "abc" becomes a + bc although "ab" sits further left. */
    snprintf(mab, sizeof mab, "a b");
    snprintf(mbc, sizeof mbc, "b c");
    snprintf(msp, sizeof msp, "\xC4\xA0 a"); /* " a": space maps to U+0120 */
    {
        const char *extra[] = {ab, bc, sp_a};
        const char *merges[] = {mbc, mab, msp};
        m40_bpe *b = tiny_bpe("gpt-2", extra, 3, merges, 3, &mem, &g, err, sizeof err);
        CHECK(b != NULL, "tiny vocab: %s", err);
        if (b) {
            int32_t ids[8];
            int64_t n = m40_bpe_encode(b, "abc", 3, ids, 8);
            /* ids: the byte tokens sit at their byte value, extras at 256.. */
            CHECK(n == 2 && ids[0] == 'a' && ids[1] == 257, "abc -> %lld ids [%d %d]", (long long)n, ids[0],
                  n > 1 ? ids[1] : -1);
            n = m40_bpe_encode(b, "ab", 2, ids, 8);
            CHECK(n == 1 && ids[0] == 256, "ab -> %lld ids [%d]", (long long)n, ids[0]);
            /* " a" is one pre-token and one merge: [258] */
            n = m40_bpe_encode(b, "x a", 3, ids, 8);
            CHECK(n == 2 && ids[0] == 'x' && ids[1] == 258, "'x a' -> %lld ids", (long long)n);
            /* cap smaller than the count: the total comes back, only cap ids written */
            int32_t one[1] = {-7};
            n = m40_bpe_encode(b, "a b c", 5, one, 1);
            CHECK(n == 5 && one[0] == 'a', "short buffer: %lld ids, first %d", (long long)n, one[0]);
            CHECK(m40_bpe_encode(b, "", 0, NULL, 0) == 0, "empty text gives no tokens");
            /* NUL and invalid bytes encode bytewise */
            n = m40_bpe_encode(b, "\0\xFF", 2, ids, 8);
            CHECK(n == 2 && ids[0] == 0 && ids[1] == 255, "NUL/0xFF -> %lld ids [%d %d]", (long long)n, ids[0],
                  n > 1 ? ids[1] : -1);
            char tb[4];
            CHECK(m40_bpe_token_bytes(b, 0, tb, 4) == 1 && tb[0] == 0, "token 0 is byte 0");
            CHECK(m40_bpe_token_bytes(b, 258, tb, 4) == 2 && memcmp(tb, " a", 2) == 0, "token 258 is ' a'");
            CHECK(m40_bpe_token_bytes(b, 258, tb, 1) == 2 && tb[0] == ' ', "token_bytes reports the full size");
            CHECK(m40_bpe_token_bytes(b, 259, tb, 4) == -1 && m40_bpe_token_bytes(b, -1, tb, 4) == -1,
                  "out-of-range ids give -1");
        }
        m40_bpe_free(b);
        m40_gguf_close(g);
        free(mem);
    }

    /* A merge whose result is no vocabulary token: the symbol falls back to its bytes. */
    {
        char mabc_merge[16];
        snprintf(mabc_merge, sizeof mabc_merge, "ab c");
        const char *extra[] = {ab};
        const char *merges[] = {mab, mabc_merge};
        m40_bpe *b = tiny_bpe(NULL, extra, 1, merges, 2, &mem, &g, err, sizeof err);
        CHECK(b != NULL, "fallback vocab: %s", err);
        if (b) {
            CHECK(strcmp(m40_bpe_pre_name(b), "default") == 0, "absent pre reads as 'default', got %s",
                  m40_bpe_pre_name(b));
            int32_t ids[8];
            int64_t n = m40_bpe_encode(b, "abc", 3, ids, 8);
            CHECK(n == 3 && ids[0] == 'a' && ids[1] == 'b' && ids[2] == 'c', "abc -> %lld ids (byte fallback)",
                  (long long)n);
        }
        m40_bpe_free(b);
        m40_gguf_close(g);
        free(mem);
    }

    /* The pre-tokenizer decides the words: tokens 12, 34, 45 with merges "3 4" (rank
     * 0), "1 2", "4 5". GPT-2 keeps "12345" one word: 3+4 first -> [12, 34, 5]. Llama 3
     * cuts digit runs into threes, "123" "45" -> [12, 3, 45]. Qwen2 takes single
     * digits -> [1, 2, 3, 4, 5]. */
    {
        char m34[8] = "3 4", m12[8] = "1 2", m45[8] = "4 5";
        const char *extra[] = {"12", "34", "45"};
        const char *merges[] = {m34, m12, m45};
        struct {
            const char *pre;
            int n;
            int32_t ids[5];
        } want[] = {{"gpt-2", 3, {256, 257, '5'}}, {"llama-bpe", 3, {256, '3', 258}},
                    {"qwen2", 5, {'1', '2', '3', '4', '5'}}};
        for (int k = 0; k < 3; k++) {
            m40_bpe *b = tiny_bpe(want[k].pre, extra, 3, merges, 3, &mem, &g, err, sizeof err);
            CHECK(b != NULL, "digits vocab %s: %s", want[k].pre, err);
            if (b) {
                int32_t ids[8];
                int64_t n = m40_bpe_encode(b, "12345", 5, ids, 8);
                int ok = n == want[k].n;
                for (int i = 0; ok && i < n; i++)
                    ok = ids[i] == want[k].ids[i];
                CHECK(ok, "'12345' with pre %s: %lld ids, first %d", want[k].pre, (long long)n, n ? ids[0] : -1);
            }
            m40_bpe_free(b);
            m40_gguf_close(g);
            free(mem);
        }
    }

    /* SuperBPE cuts digit runs into threes from the right: "1234567" -> "1" "234"
     * "567"; with tokens 12, 34, 56 that gives [1, 2, 34, 56, 7] (gpt-2: [12, 34, 56, 7]). */
    {
        char m12[8] = "1 2", m34[8] = "3 4", m56[8] = "5 6";
        const char *extra[] = {"12", "34", "56"};
        const char *merges[] = {m12, m34, m56};
        m40_bpe *b = tiny_bpe("superbpe", extra, 3, merges, 3, &mem, &g, err, sizeof err);
        int32_t ids[8];
        int64_t n = b ? m40_bpe_encode(b, "x1234567", 8, ids, 8) : -1;
        CHECK(n == 6 && ids[0] == 'x' && ids[1] == '1' && ids[2] == '2' && ids[3] == 257 && ids[4] == 258 &&
                  ids[5] == '7',
              "superbpe 'x1234567': %lld ids", (long long)n);
        /* a long digit run stays linear (the reference's lookahead form is quadratic) */
        size_t big = 1 << 20;
        char *digits = malloc(big);
        if (b && digits) {
            for (size_t i = 0; i < big; i++)
                digits[i] = (char)('0' + i % 10);
            double t0 = now_s();
            n = m40_bpe_encode(b, digits, big, NULL, 0);
            double dt = now_s() - t0;
            CHECK(n > 0 && dt < 2.0, "superbpe 1 MiB of digits: %lld ids in %.3f s", (long long)n, dt);
        }
        free(digits);
        m40_bpe_free(b);
        m40_gguf_close(g);
        free(mem);
    }

    /* Llama 3 looks whole words up before merging ("ignore_merges"): token "xyz" has no
     * merges leading to it, yet llama-bpe emits it; gpt-2 spells it bytewise. Also
     * GPT-2's "\s+(?!\S)": "a   b" -> "a", "  ", " b", the last a merge " b". */
    {
        char msb[8];
        snprintf(msb, sizeof msb, "\xC4\xA0 b");
        char sp_b[8];
        mapped(" b", sp_b);
        const char *extra[] = {"xyz", sp_b};
        const char *merges[] = {msb};
        int32_t ids[8];
        m40_bpe *b = tiny_bpe("llama-bpe", extra, 2, merges, 1, &mem, &g, err, sizeof err);
        CHECK(b && m40_bpe_encode(b, "xyz", 3, ids, 8) == 1 && ids[0] == 256, "llama-bpe 'xyz' is one token");
        m40_bpe_free(b);
        m40_gguf_close(g);
        free(mem);
        b = tiny_bpe("gpt-2", extra, 2, merges, 1, &mem, &g, err, sizeof err);
        CHECK(b && m40_bpe_encode(b, "xyz", 3, ids, 8) == 3 && ids[0] == 'x', "gpt-2 'xyz' is three bytes");
        int64_t n = b ? m40_bpe_encode(b, "a   b", 5, ids, 8) : -1;
        CHECK(n == 4 && ids[0] == 'a' && ids[1] == ' ' && ids[2] == ' ' && ids[3] == 257,
              "gpt-2 'a   b': %lld ids, last %d", (long long)n, n > 0 ? ids[n - 1] : -1);
        m40_bpe_free(b);
        m40_gguf_close(g);
        free(mem);
    }

    /* No tokenizer.ggml.pre: llama.cpp's "default" pre-tokenizer. Two of the ways it
     * differs from the GPT-2 regex alone, on tokens 12, 34, 45, " 1", "'t" with merges
     * "3 4" (rank 0), "1 2", "4 5", " 1", "' t". "x 12345": the number run loses its space
     * and is cut "123" "45" -> [x, ' ', 12, 3, 45], where gpt-2 merges " 12345" -> [' ',
     * 12, 34, 5] after x (" 1" never applies: "1 2" ranks first). "don't": the apostrophe is
     * punctuation, isolated before the contractions are looked for -> bytes only, where
     * gpt-2 takes "'t" whole. The value "default" itself is the same pre-tokenizer without
     * the warning; an empty value counts as missing (llama.cpp tests for an empty
     * string); a value that is not a string is an error. */
    {
        char sp1[8], m34[8] = "3 4", m12[8] = "1 2", m45[8] = "4 5", msp1[16], mqt[8] = "' t";
        mapped(" 1", sp1);
        snprintf(msp1, sizeof msp1, "\xC4\xA0 1");
        const char *extra[] = {"12", "34", "45", sp1, "'t"};
        const char *merges[] = {m34, m12, m45, msp1, mqt};
        struct {
            const char *pre, *text, *warning;
            int n;
            int32_t ids[8];
        } want[] = {
            {NULL, "x 12345", "tokenizer.ggml.pre is missing", 5, {'x', ' ', 256, '3', 258}},
            {"", "x 12345", "tokenizer.ggml.pre is empty", 5, {'x', ' ', 256, '3', 258}},
            {"default", "x 12345", NULL, 5, {'x', ' ', 256, '3', 258}},
            {"gpt-2", "x 12345", NULL, 5, {'x', ' ', 256, 257, '5'}},
            {NULL, "don't", "tokenizer.ggml.pre is missing", 5, {'d', 'o', 'n', '\'', 't'}},
            {"gpt-2", "don't", NULL, 4, {'d', 'o', 'n', 260}},
        };
        for (size_t k = 0; k < sizeof want / sizeof want[0]; k++) {
            m40_bpe *b = tiny_bpe(want[k].pre, extra, 5, merges, 5, &mem, &g, err, sizeof err);
            CHECK(b != NULL, "default-pre vocab (pre %s): %s", want[k].pre ? want[k].pre : "absent", err);
            if (b) {
                int32_t ids[16];
                int64_t n = m40_bpe_encode(b, want[k].text, strlen(want[k].text), ids, 16);
                int ok = n == want[k].n;
                for (int i = 0; ok && i < n; i++)
                    ok = ids[i] == want[k].ids[i];
                char a[256];
                fmt_ids(a, sizeof a, ids, n > 0 && n <= 16 ? n : 0);
                CHECK(ok, "'%s' with pre %s: [%s]", want[k].text, want[k].pre ? want[k].pre : "absent", a);
                const char *w = m40_bpe_load_warning(b);
                CHECK(want[k].warning ? w && strstr(w, want[k].warning) == w : w == NULL,
                      "pre %s: load warning %s", want[k].pre ? want[k].pre : "absent", w ? w : "(none)");
                CHECK(strcmp(m40_bpe_pre_name(b), want[k].pre && *want[k].pre ? want[k].pre : "default") == 0,
                      "pre name %s", m40_bpe_pre_name(b));
            }
            m40_bpe_free(b);
            m40_gguf_close(g);
            free(mem);
        }
    }
    {
        const char *toks[256];
        static char strs[256][8];
        for (int i = 0; i < 256; i++) {
            char one[2] = {(char)i, 0};
            if (i == 0)
                strcpy(strs[i], "\xC4\x80");
            else
                mapped(one, strs[i]);
            toks[i] = strs[i];
        }
        const char *merges[] = {mab};
        m40_gguf_writer *w = m40_gguf_writer_new();
        size_t size = 0;
        mem = NULL;
        g = NULL;
        int rc = w ? 0 : -1;
        rc = rc ? rc : m40_gguf_writer_set_str(w, "tokenizer.ggml.model", "gpt2");
        rc = rc ? rc : m40_gguf_writer_set_u32(w, "tokenizer.ggml.pre", 7);
        rc = rc ? rc : m40_gguf_writer_set_arr_str(w, "tokenizer.ggml.tokens", toks, 256);
        rc = rc ? rc : m40_gguf_writer_set_arr_str(w, "tokenizer.ggml.merges", merges, 1);
        rc = rc ? rc : m40_gguf_writer_write_mem(w, &mem, &size, err, sizeof err);
        rc = rc ? rc : m40_gguf_open_mem(mem, size, &g, err, sizeof err);
        CHECK(rc == 0, "gguf with a u32 pre: %s", err);
        m40_bpe *b = rc == 0 ? m40_bpe_new(g, err, sizeof err) : NULL;
        CHECK(rc != 0 || (b == NULL && strstr(err, "tokenizer.ggml.pre is not a string")), "u32 pre: %s",
              b ? "accepted" : err);
        m40_bpe_free(b);
        m40_gguf_writer_free(w);
        m40_gguf_close(g);
        free(mem);
    }

    /* Unknown pre-tokenizer names fail with the name in the message. */
    {
        const char *merges[] = {mab};
        m40_bpe *b = tiny_bpe("no-such-pre", NULL, 0, merges, 1, &mem, &g, err, sizeof err);
        CHECK(b == NULL && strstr(err, "unknown tokenizer.ggml.pre 'no-such-pre'"), "unknown pre: %s",
              b ? "accepted" : err);
        m40_bpe_free(b);
        m40_gguf_close(g);
        free(mem);
    }
    /* A merge string without a separating space is rejected, not misread. */
    {
        const char *merges[] = {"ab"};
        m40_bpe *b = tiny_bpe("gpt-2", NULL, 0, merges, 1, &mem, &g, err, sizeof err);
        CHECK(b == NULL && strstr(err, "merges[0]"), "bad merge: %s", b ? "accepted" : err);
        m40_bpe_free(b);
        m40_gguf_close(g);
        free(mem);
    }

    /* Every supported pre-tokenizer compiles and round-trips hostile bytes. */
    static const char *pres[] = {"default", "gpt2", "llama-bpe", "llama3", "qwen2", "deepseek-llm",
                                 "deepseek-coder", "deepseek-v3", "falcon", "mpt", "gpt-neox", "starcoder",
                                 "refact", "smollm", "stablelm2", "olmo", "dbrx", "command-r", "poro-chat",
                                 "viking", "jais", "tekken", "chatglm-bpe", "codeshell", "bloom",
                                 "gpt3-finnish", "exaone", "chameleon", "minerva-7b", "megrez", "gpt-4o",
                                 "superbpe", "trillion", "bailingmoe", "seed-coder"};
    const char hostile[] = "It's 12345 \xE4\xBD\xA0\xE5\xA5\xBD   \n\n\t\xFF\xC3(\0\x80 <sentinel:3> IMGIMGABZ"
                           " \xF0\x9F\xA6\x99 \xCE\xA9mega ABCdef 1234567 \r\n  ";
    for (size_t i = 0; i < sizeof pres / sizeof pres[0]; i++) {
        const char *merges[] = {mab};
        m40_bpe *b = tiny_bpe(pres[i], NULL, 0, merges, 1, &mem, &g, err, sizeof err);
        CHECK(b != NULL, "pre '%s': %s", pres[i], err);
        if (b) {
            int64_t n;
            int32_t *ids = encode(b, hostile, sizeof hostile - 1, &n);
            CHECK(ids && round_trips(b, hostile, sizeof hostile - 1, ids, n), "pre '%s' round trip", pres[i]);
            free(ids);
        }
        m40_bpe_free(b);
        m40_gguf_close(g);
        free(mem);
    }
}

int main(void)
{
    static const char *vocabs[] = {"gpt-2", "deepseek-llm", "deepseek-coder", "falcon", "mpt",
                                   "starcoder", "refact", "gpt-neox"};
    double t = 0;
    for (size_t i = 0; i < sizeof vocabs / sizeof vocabs[0]; i++)
        test_vocab(vocabs[i], &t);
    /* Milliseconds expected; the bound is loose for slow shared machines. */
    CHECK(t < 1.0, "encoding all .inp files took %.3f s", t);
    test_gpt_neox_default();
    test_qwen2_prompts();
    test_guarded();
    test_synthetic();
    return check_done();
}
