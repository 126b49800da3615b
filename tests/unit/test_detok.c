/* Streaming detokenizer: token-by-token output never holds a partial code point, the
 * pieces concatenate to the whole decoded text, invalid bytes become U+FFFD (one per
 * maximal ill-formed subpart), control tokens are not rendered, the SPM dummy-prefix
 * space is dropped only at the start. Random id streams are compared with a whole-buffer
 * sanitizer written independently here. */
#include <stdint.h>

#include "check.h"
#include "gguf/gguf.h"
#include "gguf/gguf_writer.h"
#include "tokenizer/tokenizer.h"

#define FFFD "\xef\xbf\xbd"

/* Independent whole-buffer version: decode code points by their bit patterns, then
 * check range, overlong and surrogate rules. */
static int cp_len_ok(const unsigned char *s, size_t n, size_t *used)
{
    unsigned c = s[0];
    int need = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
    if (need == 0) {
        *used = 1;
        return 0;
    }
    uint32_t cp = need == 1 ? c : need == 2 ? (c & 0x1f) : need == 3 ? (c & 0x0f) : (c & 0x07);
    for (int i = 1; i < need; i++) {
        if ((size_t)i >= n || (s[i] & 0xc0) != 0x80) {
            *used = (size_t)i;
            return -1; /* truncated: caller decides how much was a valid prefix */
        }
        cp = (cp << 6) | (s[i] & 0x3f);
    }
    static const uint32_t min_cp[5] = {0, 0, 0x80, 0x800, 0x10000};
    *used = (size_t)need;
    return cp >= min_cp[need] && cp <= 0x10ffff && !(cp >= 0xd800 && cp <= 0xdfff);
}

/* 1 when s[0..n) is well-formed UTF-8. */
static int utf8_valid(const char *s, size_t n)
{
    size_t i = 0, u;
    while (i < n) {
        if (cp_len_ok((const unsigned char *)s + i, n - i, &u) != 1)
            return 0;
        i += u;
    }
    return 1;
}

/* Replaces maximal ill-formed subparts by U+FFFD: a lead byte plus the continuation
 * bytes that could still belong to a valid sequence form one replaced unit. */
static size_t sanitize(const unsigned char *s, size_t n, char *out)
{
    size_t i = 0, o = 0;
    while (i < n) {
        size_t u;
        if (cp_len_ok(s + i, n - i, &u) == 1) {
            memcpy(out + o, s + i, u);
            o += u;
            i += u;
            continue;
        }
        /* longest prefix s[i..i+k) that some valid sequence starts with */
        size_t k = 1;
        for (size_t len = 2; len <= 4 && i + len <= n; len++) {
            /* a prefix is viable when completing it with 0x80.. bytes can be valid */
            unsigned char tmp[4];
            memcpy(tmp, s + i, len);
            int viable = 0;
            for (unsigned fill = 0x80; fill <= 0xbf && !viable; fill++) {
                unsigned char t2[4];
                memcpy(t2, tmp, len);
                for (size_t z = len; z < 4; z++)
                    t2[z] = (unsigned char)fill;
                size_t uu;
                viable = cp_len_ok(t2, 4, &uu) == 1 && uu >= len;
            }
            if (!viable)
                break;
            k = len;
        }
        memcpy(out + o, FFFD, 3);
        o += 3;
        i += k;
    }
    return o;
}

typedef struct {
    char buf[1 << 16];
    size_t len;
    int chunks_invalid;
    int held; /* pushes that returned nothing while their token had bytes */
} collected;

static void push(m40_detok *d, const m40_tokenizer *t, int32_t id, collected *c)
{
    size_t n;
    const char *s = m40_detok_push(d, id, &n);
    if (!s) {
        c->chunks_invalid++;
        return;
    }
    if (!utf8_valid(s, n))
        c->chunks_invalid++;
    if (n == 0 && m40_token_to_bytes(t, id, 0, NULL, 0) > 0)
        c->held++;
    if (c->len + n <= sizeof c->buf) {
        memcpy(c->buf + c->len, s, n);
        c->len += n;
    }
}

static void flush(m40_detok *d, collected *c)
{
    size_t n;
    const char *s = m40_detok_flush(d, &n);
    if (!s || !utf8_valid(s, n))
        c->chunks_invalid++;
    if (s && c->len + n <= sizeof c->buf) {
        memcpy(c->buf + c->len, s, n);
        c->len += n;
    }
}

static m40_tokenizer *load(const char *rel)
{
    char path[4096], err[512];
    m40_gguf *g;
    m40_tokenizer *t = NULL;
    if (!check_shared_file(rel, path, sizeof path)) {
        SKIP("%s absent", rel);
        return NULL;
    }
    if (m40_gguf_open(path, &g, err, sizeof err) != 0) {
        CHECK(0, "open %s: %s", rel, err);
        return NULL;
    }
    if (m40_tokenizer_from_gguf(g, &t, err, sizeof err) != 0) {
        SKIP("%s: tokenizer not available: %s", rel, err);
        t = NULL;
    }
    m40_gguf_close(g);
    return t;
}

static const char *multibyte_text =
    "Hello \xe4\xb8\x96\xe7\x95\x8c! \xf0\x9f\xa6\x99\xf0\x9f\x9a\x80 na\xc3\xafve \xe2\x80\x94 "
    "\xe6\x97\xa5\xe6\x9c\xac\xe8\xaa\x9e\xe3\x83\x86\xe3\x82\xad\xe3\x82\xb9\xe3\x83\x88 "
    "\xf0\x9f\x98\xb6\xe2\x80\x8d\xf0\x9f\x8c\xab\xef\xb8\x8f \xea\xb0\x80\xeb\x82\x98\xeb\x8b\xa4";

/* Encodes text and streams it back; returns the collected output. */
static void roundtrip(const m40_tokenizer *t, const char *name, const char *text, int add_bos, collected *c)
{
    int32_t ids[1024];
    char err[256];
    memset(c, 0, sizeof *c);
    int64_t n = m40_tokenize(t, text, strlen(text), add_bos, 0, ids, 1024, err, sizeof err);
    CHECK(n > 0 && n <= 1024, "%s: tokenize: %s", name, err);
    m40_detok *d = m40_detok_new(t);
    CHECK(d != NULL, "detok_new");
    if (!d || n <= 0)
        return;
    for (int64_t i = 0; i < n && i < 1024; i++)
        push(d, t, ids[i], c);
    flush(d, c);
    m40_detok_free(d);
    CHECK(c->chunks_invalid == 0, "%s: %d chunks were not whole UTF-8", name, c->chunks_invalid);
    CHECK(c->len == strlen(text) && !memcmp(c->buf, text, c->len), "%s: stream gives '%.*s'", name, (int)c->len,
          c->buf);
}

static void test_spm(void)
{
    m40_tokenizer *t = load("tokenizer/ggml-vocab-llama-spm.gguf");
    if (!t)
        return;
    collected c;
    roundtrip(t, "llama-spm with BOS", multibyte_text, 1, &c);
    CHECK(c.held >= 3, "byte-fallback code points were held back (%d pushes empty)", c.held);
    roundtrip(t, "llama-spm without BOS", multibyte_text, 0, &c);
    roundtrip(t, "llama-spm ascii", "The quick brown fox.", 1, &c);

    /* Continuation: once a text token went by, a leading space is real text. */
    m40_detok *d = m40_detok_new(t);
    size_t n;
    const char *s = m40_detok_push(d, 15043, &n); /* ▁Hello */
    CHECK(n == 5 && !memcmp(s, "Hello", 5), "first piece loses the dummy space");
    s = m40_detok_push(d, 2, &n); /* </s> */
    CHECK(n == 0, "control token not rendered");
    s = m40_detok_push(d, 3186, &n); /* ▁world */
    CHECK(n == 6 && !memcmp(s, " world", 6), "later piece keeps its space");
    m40_detok_free(d);

    /* Invalid bytes through byte tokens (id 3 + byte in Llama's vocabulary). */
    static const struct {
        const char *name;
        unsigned char bytes[8];
        int nb;
        const char *want;
    } cases[] = {
        {"lone 0xFF", {0xff}, 1, FFFD},
        {"surrogate ED A0 80", {0xed, 0xa0, 0x80}, 3, FFFD FFFD FFFD},
        {"overlong C0 AF", {0xc0, 0xaf}, 2, FFFD FFFD},
        {"past U+10FFFF F4 90 80 80", {0xf4, 0x90, 0x80, 0x80}, 4, FFFD FFFD FFFD FFFD},
        {"truncated E4 B8 then A", {0xe4, 0xb8, 'A'}, 3, FFFD "A"},
        {"truncated at end F0 9F A6", {0xf0, 0x9f, 0xa6}, 3, FFFD},
        {"split 4-byte F0 9F A6 99", {0xf0, 0x9f, 0xa6, 0x99}, 4, "\xf0\x9f\xa6\x99"},
        {"C3 then ascii", {0xc3, ' ', 'x'}, 3, FFFD " x"},
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        memset(&c, 0, sizeof c);
        d = m40_detok_new(t);
        for (int i = 0; i < cases[k].nb; i++)
            push(d, t, 3 + cases[k].bytes[i], &c);
        flush(d, &c);
        m40_detok_free(d);
        CHECK(c.chunks_invalid == 0 && c.len == strlen(cases[k].want) && !memcmp(c.buf, cases[k].want, c.len),
              "%s: got %zu bytes", cases[k].name, c.len);
    }
    /* the held tail is released as soon as it completes */
    d = m40_detok_new(t);
    CHECK(m40_detok_push(d, 3 + 0xe4, &n) && n == 0, "E4 held");
    CHECK(m40_detok_push(d, 3 + 0xb8, &n) && n == 0, "E4 B8 held");
    s = m40_detok_push(d, 3 + 0x96, &n);
    CHECK(s && n == 3 && !memcmp(s, "\xe4\xb8\x96", 3), "U+4E16 released when complete");
    s = m40_detok_flush(d, &n);
    CHECK(s && n == 0, "nothing left to flush");
    m40_detok_free(d);

    /* Random id streams: chunks always whole, total equals the whole-buffer sanitizer. */
    uint64_t rng = 0x9e3779b97f4a7c15ull;
    static char raw[1 << 15], want[3 << 15];
    int bad_runs = 0;
    for (int run = 0; run < 200; run++) {
        memset(&c, 0, sizeof c);
        d = m40_detok_new(t);
        size_t rawn = 0;
        int started = 0;
        for (int i = 0; i < 40; i++) {
            rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
            /* mostly byte tokens (the hard part), some pieces and control tokens */
            int32_t id = (rng % 4) ? (int32_t)(3 + (rng >> 8) % 256) : (int32_t)((rng >> 8) % 32000);
            push(d, t, id, &c);
            char b[256];
            int bl = m40_token_to_bytes(t, id, 0, b, sizeof b);
            if (bl > 0 && !started) {
                started = 1;
                if (b[0] == ' ' && m40_tokenizer_token_type(t, id) != M40_TOKEN_BYTE)
                    memmove(b, b + 1, (size_t)--bl);
            }
            memcpy(raw + rawn, b, (size_t)bl);
            rawn += (size_t)bl;
        }
        flush(d, &c);
        m40_detok_free(d);
        size_t wn = sanitize((const unsigned char *)raw, rawn, want);
        if (c.chunks_invalid || c.len != wn || memcmp(c.buf, want, wn))
            bad_runs++;
    }
    CHECK(bad_runs == 0, "%d of 200 random streams differ from the whole-buffer sanitizer", bad_runs);
    m40_tokenizer_free(t);
}

static void test_bpe(void)
{
    m40_tokenizer *t = load("tokenizer/ggml-vocab-gpt-2.gguf");
    if (!t)
        return;
    collected c;
    roundtrip(t, "gpt-2", multibyte_text, 0, &c);
    CHECK(c.held >= 3, "gpt-2: partial code points held back (%d pushes empty)", c.held);
    roundtrip(t, "gpt-2 leading space kept", " leading space \xf0\x9f\xa6\x99", 0, &c);
    int32_t eot = m40_tokenizer_find_piece(t, "<|endoftext|>");
    CHECK(eot >= 0 && m40_tokenizer_is_eog(t, eot), "gpt-2 <|endoftext|> ends generation");
    m40_detok *d = m40_detok_new(t);
    size_t n;
    CHECK(m40_detok_push(d, eot, &n) && n == 0, "gpt-2 control token not rendered");
    /* the longest token goes through the growth path of the join buffer */
    int32_t longest = 0;
    int ll = 0;
    for (int32_t id = 0; id < m40_tokenizer_n_vocab(t); id++) {
        int l = m40_token_to_bytes(t, id, 0, NULL, 0);
        if (l > ll)
            ll = l, longest = id;
    }
    char *b = malloc((size_t)ll);
    m40_token_to_bytes(t, longest, 0, b, ll);
    memset(&c, 0, sizeof c);
    push(d, t, longest, &c);
    flush(d, &c);
    CHECK(ll > 64 && (!utf8_valid(b, (size_t)ll) || (c.len == (size_t)ll && !memcmp(c.buf, b, c.len))) &&
              c.chunks_invalid == 0,
          "longest token (%d bytes) streamed whole", ll);
    free(b);
    m40_detok_free(d);
    m40_tokenizer_free(t);
}

/* A byte-level BPE vocabulary (the 256 GPT-2 byte symbols, no merges) plus control
 * tokens, built in memory. */
static m40_tokenizer *harmony_vocab(const char *const *specials, int n_specials)
{
    static char sym[256][4];
    const char *toks[300];
    int32_t types[300];
    int n = 0;
    unsigned next = 256;
    for (int b = 0; b < 256; b++) {
        /* GPT-2's bytes_to_unicode: printable bytes are themselves, the rest 256, 257, ... */
        int printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
        unsigned cp = printable ? (unsigned)b : next++;
        if (cp < 0x80) {
            sym[b][0] = (char)cp;
            sym[b][1] = 0;
        } else {
            sym[b][0] = (char)(0xC0 | (cp >> 6));
            sym[b][1] = (char)(0x80 | (cp & 0x3F));
            sym[b][2] = 0;
        }
        toks[n] = sym[b];
        types[n++] = M40_TOKEN_NORMAL;
    }
    for (int i = 0; i < n_specials; i++) {
        toks[n] = specials[i];
        types[n++] = M40_TOKEN_CONTROL;
    }
    m40_gguf_writer *w = m40_gguf_writer_new();
    m40_gguf_writer_set_str(w, "general.architecture", "gpt-oss");
    m40_gguf_writer_set_str(w, "tokenizer.ggml.model", "gpt2");
    m40_gguf_writer_set_str(w, "tokenizer.ggml.pre", "gpt-4o");
    m40_gguf_writer_set_arr_str(w, "tokenizer.ggml.tokens", toks, (uint64_t)n);
    m40_gguf_writer_set_arr_i32(w, "tokenizer.ggml.token_type", types, (uint64_t)n);
    const char *merges[1] = {"a b"};
    m40_gguf_writer_set_arr_str(w, "tokenizer.ggml.merges", merges, 0);
    m40_gguf_writer_set_u32(w, "tokenizer.ggml.eos_token_id", 256); /* the first special */
    void *mem = NULL;
    size_t size = 0;
    char err[512];
    m40_gguf *g = NULL;
    m40_tokenizer *t = NULL;
    if (m40_gguf_writer_write_mem(w, &mem, &size, err, sizeof err) != 0 || m40_gguf_open_mem(mem, size, &g, err, sizeof err) != 0 ||
        m40_tokenizer_from_gguf(g, &t, err, sizeof err) != 0) {
        CHECK(0, "harmony vocabulary: %s", err);
        t = NULL;
    }
    if (g)
        m40_gguf_close(g);
    free(mem);
    m40_gguf_writer_free(w);
    return t;
}

static void decode(m40_tokenizer *t, const int32_t *ids, int n, char *out, size_t cap)
{
    m40_detok *d = m40_detok_new(t);
    size_t len = 0, k;
    out[0] = 0;
    for (int i = 0; i < n; i++) {
        const char *s = m40_detok_push(d, ids[i], &k);
        if (s && len + k < cap) {
            memcpy(out + len, s, k);
            len += k;
        }
    }
    const char *s = m40_detok_flush(d, &k);
    if (s && len + k < cap) {
        memcpy(out + len, s, k);
        len += k;
    }
    out[len] = 0;
    m40_detok_free(d);
}

/* gpt-oss's vocabulary: the turn ends at <|return|> or <|call|>, not at <|end|> (which
 * closes the analysis message before the answer); the header and end markers decode to
 * their text for the output parser, and still are no text in encoding; other
 * vocabularies keep <|end|> as an end (Phi-3) and render no control token. */
static void test_harmony_vocab(void)
{
    static const char *const sp[] = {"<|return|>", "<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|call|>",
                                     "<|constrain|>", "<|endoftext|>"};
    m40_tokenizer *t = harmony_vocab(sp, 8);
    if (!t)
        return;
    int32_t ret = 256, start = 257, chan = 258, msg = 259, end = 260, call = 261, cons = 262;
    CHECK(m40_tokenizer_is_eog(t, ret) && m40_tokenizer_is_eog(t, call) && !m40_tokenizer_is_eog(t, end) &&
              !m40_tokenizer_is_eog(t, chan) && !m40_tokenizer_is_eog(t, 'a'),
          "harmony: <|return|> and <|call|> end generation, <|end|> does not");
    int32_t ids[] = {chan, 'a', msg, 'x', end, start, 'b', chan, 'f', cons, 'j', msg, '{', '}', call, ret};
    char out[256];
    decode(t, ids, (int)(sizeof ids / sizeof *ids), out, sizeof out);
    CHECK(strcmp(out, "<|channel|>a<|message|>x<|end|><|start|>b<|channel|>f<|constrain|>j<|message|>{}") == 0,
          "harmony markers decode to text, <|call|> and <|return|> to nothing: [%s]", out);
    char err[256];
    int32_t enc[64];
    int64_t n = m40_tokenize(t, "<|channel|>", 11, 0, 0, enc, 64, err, sizeof err);
    CHECK(n == 11, "typed in user text, <|channel|> stays text (%lld ids)", (long long)n);
    n = m40_tokenize(t, "<|channel|>", 11, 0, 1, enc, 64, err, sizeof err);
    CHECK(n == 1 && enc[0] == chan, "in the template's markup it is the token");
    m40_tokenizer_free(t);

    static const char *const phi[] = {"<|endoftext|>", "<|end|>", "<|channel|>", "<|return|>"};
    t = harmony_vocab(phi, 4);
    if (!t)
        return;
    CHECK(m40_tokenizer_is_eog(t, 257) && !m40_tokenizer_is_eog(t, 259), "without <|call|>: <|end|> ends (Phi-3)");
    decode(t, (const int32_t[]){258, 'a', 257}, 3, out, sizeof out);
    CHECK(strcmp(out, "a") == 0, "without harmony no control token decodes to text: [%s]", out);
    m40_tokenizer_free(t);
}

int main(void)
{
    size_t n = 1;
    CHECK(m40_detok_new(NULL) == NULL, "detok_new(NULL)");
    CHECK(m40_detok_push(NULL, 1, &n) == NULL && n == 0, "push on NULL");
    m40_detok_free(NULL);
    test_harmony_vocab();
    if (!check_shared_dir())
        SKIP("shared fixtures absent: ../shared/tokenizer vocabularies needed");
    test_spm();
    test_bpe();
    return check_done();
}
