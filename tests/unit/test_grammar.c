/* engine/grammar: GBNF parsing, the byte matcher (accept/reject), token masks against a
 * brute-force check over a small vocabulary, and hostile input. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "grammar/grammar.h"
#include "sample_hd.h"

static uint64_t rng = 88172645463325252ull;
static uint32_t rnd(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (uint32_t)(rng >> 11);
}

static int accepts(const char *gsrc, const char *s, size_t n)
{
    char err[256];
    m40_grammar *g = m40_grammar_parse(gsrc, strlen(gsrc), err, sizeof err);
    if (!g) {
        fprintf(stderr, "parse failed: %s\n", err);
        return -1;
    }
    m40_gmatch *m = m40_gmatch_new(g);
    int r = m40_gmatch_full(m, s, n);
    m40_gmatch_free(m);
    m40_grammar_free(g);
    return r;
}

typedef struct {
    const char *grammar;
    const char *yes[8];
    const char *no[8];
} gcase;

static const gcase cases[] = {
    {"root ::= \"abc\"", {"abc"}, {"", "ab", "abcd", "abd"}},
    {"root ::= \"a\" | \"b\" | \"cd\"", {"a", "b", "cd"}, {"", "c", "ab", "d"}},
    {"root ::= x y\nx ::= \"x\"\ny ::= \"y\"+", {"xy", "xyyy"}, {"x", "yy", "xyx"}},
    {"root ::= (\"ab\" | \"c\")*", {"", "ab", "cabc", "ccc"}, {"a", "b", "abb"}},
    {"root ::= \"a\"? \"b\"", {"b", "ab"}, {"aab", "a", ""}},
    {"root ::= [a-c]{2,3}", {"ab", "abc", "cca"}, {"a", "abca", "ad"}},
    {"root ::= [0-9]{3}", {"123", "000"}, {"12", "1234"}},
    {"root ::= \"x\"{2,}", {"xx", "xxxxxx"}, {"x", ""}},
    {"root ::= \"x\"{0,2}", {"", "x", "xx"}, {"xxx"}},
    {"root ::= [^a-z]", {"A", "0", "\xc3\xa9", "\xf0\x9f\x98\x80"}, {"a", "z", "AB", "\xff", "\xed\xa0\x80"}},
    {"root ::= [a-zA-Z_] [a-zA-Z_0-9]*", {"x", "_a9", "Hello"}, {"9a", ""}},
    {"root ::= \"\\n\\t\\\\\\\"\"", {"\n\t\\\""}, {"ntx"}},
    {"root ::= \"\\x41\\u00e9\\U0001F600\"", {"A\xc3\xa9\xf0\x9f\x98\x80"}, {"A"}},
    {"root ::= [\\u0400-\\u04FF]+", {"\xd0\x96", "\xd0\x96\xd1\x8f"}, {"a", "\xd0"}},
    {"root ::= .", {"a", "\xe2\x82\xac", "\n"}, {"", "ab", "\x80"}},
    {"root ::= \"é\" [à-ÿ]", {"\xc3\xa9\xc3\xa0", "\xc3\xa9\xc3\xbf"}, {"\xc3\xa9" "a"}},
    {"# comment\nroot ::= a # trailing\n\na ::= \"1\"\n   | \"2\"", {"1", "2"}, {"3", "12"}},
    {"root ::= (\n  \"a\"\n  | \"b\"\n)", {"a", "b"}, {"ab"}},
    {"root ::= [-a]", {"-", "a"}, {"b"}},
    {"root ::= [a-]", {"-", "a"}, {"b"}},
    {"root ::= [\\]\\[]", {"]", "["}, {"\\"}},
    {"root ::= list\nlist ::= \"[\" (item (\",\" item)*)? \"]\"\nitem ::= [0-9]+ | list",
     {"[]", "[1]", "[1,[2,[]],33]", "[[[[[]]]]]"}, {"[", "[1,]", "[,1]", "[[]"}},
    {"root ::= \"(\" root \")\" | \"\"", {"", "()", "((()))"}, {"(", "())"}},
    {"root ::= ws \"{\" ws \"}\"\nws ::= [ \\t\\n]*", {"{}", "  { \n}"}, {"{", "{ x}"}},
    {"root ::= [^\"\\\\]*", {"", "abc", "\xc3\xa9t\xc3\xa9"}, {"\"", "\\", "\xc3"}},
    /* a user's rule named like a generated one stays the user's */
    {"root ::= (\"a\")* root-1\nroot-1 ::= \"z\"", {"z", "aaz"}, {"aa", "zz"}},
};

static const char *bad_grammars[][2] = {
    {"", "no 'root' rule"},
    {"root ::= foo", "'foo' is used but not defined"},
    {"root ::= root \"a\" | \"b\"", "left-recursive"},
    {"root ::= x* \nx ::= \"a\"?", "left-recursive"},
    {"root ::= \"abc", "unterminated string"},
    {"root ::= [abc", "unterminated character class"},
    {"root ::= (\"a\"", "expected ')'"},
    {"root ::= \"a\" \"b\" }", "unexpected character"},
    {"root ::= *", "with nothing before it"},
    {"root ::= \"a\"{3,1}", "n < m"},
    {"root ::= \"a\"{99999}", "repetition count"},
    {"root ::= \"\\q\"", "unknown escape"},
    {"root ::= \"\\u12\"", "hex digits"},
    {"root ::= [z-a]", "out of order"},
    {"root ::= \"a\"\nroot ::= \"b\"", "defined twice"},
    {"root ::= \"\xff\"", "UTF-8"},
    {"root := \"a\"", "expected '::='"},
    {"root ::= []", "empty character class"},
};

static void test_accept_reject(void)
{
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        const gcase *c = &cases[i];
        for (int j = 0; j < 8 && c->yes[j]; j++)
            CHECK(accepts(c->grammar, c->yes[j], strlen(c->yes[j])) == 1, "grammar %zu should accept '%s'", i,
                  c->yes[j]);
        for (int j = 0; j < 8 && c->no[j]; j++)
            CHECK(accepts(c->grammar, c->no[j], strlen(c->no[j])) == 0, "grammar %zu should reject '%s'", i,
                  c->no[j]);
    }
    /* a NUL byte inside the input is just a byte */
    CHECK(accepts("root ::= \"a\" [\\x00] \"b\"", "a\0b", 3) == 1, "NUL byte");
}

static void test_errors(void)
{
    for (size_t i = 0; i < sizeof bad_grammars / sizeof *bad_grammars; i++) {
        char err[256] = "";
        m40_grammar *g = m40_grammar_parse(bad_grammars[i][0], strlen(bad_grammars[i][0]), err, sizeof err);
        CHECK(!g, "grammar %zu parsed", i);
        CHECK(strstr(err, bad_grammars[i][1]) != NULL, "grammar %zu: '%s' lacks '%s'", i, err, bad_grammars[i][1]);
        m40_grammar_free(g);
    }
}

/* Random bytes and random mutations of real grammars: never a crash, leak or hang. */
static void test_fuzz(void)
{
    static const char alphabet[] = "root::= \"ab|()[]^-*+?{},.\\\n#x0123456789ux";
    int parsed = 0;
    for (int it = 0; it < 20000; it++) {
        char src[96];
        size_t n = 8 + rnd() % 80;
        for (size_t i = 0; i < n; i++)
            src[i] = (it & 1) ? (char)(rnd() & 0xff) : alphabet[rnd() % (sizeof alphabet - 1)];
        if (it % 4 == 0)
            memcpy(src, "root ::= ", 9);
        char err[128];
        m40_grammar *g = m40_grammar_parse(src, n, err, sizeof err);
        if (g) {
            parsed++;
            m40_gmatch *m = m40_gmatch_new(g);
            int32_t s = m40_gmatch_start(m);
            for (int k = 0; k < 64 && s >= 0; k++)
                s = m40_gmatch_next(m, s, (uint8_t)alphabet[rnd() % (sizeof alphabet - 1)]);
            m40_gmatch_free(m);
            m40_grammar_free(g);
        }
    }
    CHECK(parsed > 100, "random grammars parsed: %d", parsed);
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        const char *src = cases[i].grammar;
        size_t n = strlen(src);
        for (int it = 0; it < 300; it++) {
            char buf[256];
            memcpy(buf, src, n);
            for (int k = 0; k < 3; k++)
                buf[rnd() % n] = alphabet[rnd() % (sizeof alphabet - 1)];
            m40_grammar *g = m40_grammar_parse(buf, n, NULL, 0);
            if (g) {
                m40_gmatch *m = m40_gmatch_new(g);
                char in[32];
                for (int k = 0; k < 32; k++)
                    in[k] = (char)(rnd() & 0xff);
                m40_gmatch_full(m, in, rnd() % 32);
                m40_gmatch_free(m);
                m40_grammar_free(g);
            }
        }
    }
    CHECK(1, "fuzz done");
}

/* A small vocabulary of ASCII pieces, UTF-8 fragments and whole characters, plus an EOG. */
#define NV 200
static char vbytes[NV][8];
static int32_t vlens[NV];
static uint8_t veog[NV];

static void make_vocab(void)
{
    static const char *fixed[] = {"{", "}", "\"", "[", "]", ",", ":", " ", "\n", "a", "ab", "abc", "b", "c", "x",
                                  "0", "1", "12", "-", ".", "e", "true", "fal", "se", "null", "\":", "\",",
                                  "\xc3", "\xa9", "\xc3\xa9", "\xe2\x82", "\xac", "\xf0\x9f\x98\x80", "\\", "\\n"};
    int n = (int)(sizeof fixed / sizeof *fixed);
    for (int i = 0; i < NV; i++) {
        if (i < n) {
            vlens[i] = (int32_t)strlen(fixed[i]);
            memcpy(vbytes[i], fixed[i], (size_t)vlens[i]);
        } else if (i == NV - 1) {
            veog[i] = 1;
        } else if (i == NV - 2) {
            vlens[i] = 0; /* a control token: no text */
        } else {
            static const char al[] = "abcxyz012{}[]\",: \xc3\xa9\x80\xff-.e";
            vlens[i] = 1 + (int32_t)(rnd() % 4);
            for (int k = 0; k < vlens[i]; k++)
                vbytes[i][k] = al[rnd() % (sizeof al - 1)];
        }
    }
}

static int brute_allowed(m40_gmatch *m, int32_t state, int id)
{
    if (veog[id])
        return m40_gmatch_accepting(m, state);
    if (!vlens[id])
        return 0;
    int32_t s = state;
    for (int k = 0; k < vlens[id] && s >= 0; k++)
        s = m40_gmatch_next(m, s, (uint8_t)vbytes[id][k]);
    return s >= 0;
}

static const char *mask_grammars[] = {
    "root ::= \"{\" ws (pair (ws \",\" ws pair)*)? ws \"}\"\npair ::= str ws \":\" ws val\n"
    "val ::= str | num | \"true\" | \"false\" | \"null\" | \"[\" ws (val (ws \",\" ws val)*)? ws \"]\"\n"
    "str ::= \"\\\"\" ([^\"\\\\] | \"\\\\\" [\"\\\\n])* \"\\\"\"\nnum ::= \"-\"? [0-9]+ (\".\" [0-9]+)? (\"e\" [0-9]+)?\n"
    "ws ::= [ \\n]{0,2}",
    "root ::= [a-c]+ \"x\"?",
    "root ::= \"\\\"\" [^\"]* \"\\\"\"",
    "root ::= (\"ab\" | \"abc\" | \"1\"){1,4}",
};

static void test_masks(void)
{
    const char *ptrs[NV];
    for (int i = 0; i < NV; i++)
        ptrs[i] = vbytes[i];
    m40_token_trie *trie = m40_token_trie_new(NV, ptrs, vlens, veog);
    CHECK(trie != NULL, "trie");
    int steps = 0, mismatches = 0, argmax_agree = 0, argmax_rows = 0;
    for (size_t gi = 0; gi < sizeof mask_grammars / sizeof *mask_grammars; gi++) {
        for (int walk = 0; walk < 30; walk++) {
            char err[256];
            m40_grammar *g = m40_grammar_parse(mask_grammars[gi], strlen(mask_grammars[gi]), err, sizeof err);
            CHECK(g != NULL, "mask grammar %zu: %s", gi, err);
            if (!g)
                break;
            m40_grammar *g2 = m40_grammar_parse(mask_grammars[gi], strlen(mask_grammars[gi]), err, sizeof err);
            m40_gmatch *ref = m40_gmatch_new(g2);
            int32_t rs = m40_gmatch_start(ref);
            m40_gconstraint *c = m40_gconstraint_new(g, trie);
            for (int step = 0; step < 40; step++) {
                const uint32_t *mask = m40_gconstraint_mask(c);
                if (!mask) {
                    CHECK(0, "no mask");
                    break;
                }
                int allowed[NV], na = 0;
                for (int id = 0; id < NV; id++) {
                    int a = (mask[id >> 5] >> (id & 31)) & 1;
                    if (a != brute_allowed(ref, rs, id))
                        mismatches++;
                    if (a)
                        allowed[na++] = id;
                }
                steps++;
                float logits[NV];
                /* the masked argmax against apply + argmax on random rows (ties, -inf and
                 * NaN among them), then apply's count on a row of zeros */
                for (int id = 0; id < NV; id++) {
                    uint32_t r = rnd() % 16;
                    logits[id] = r == 0 ? NAN : r == 1 ? -INFINITY : (float)(int)(rnd() % 7) - 3.0f;
                }
                float masked[NV];
                memcpy(masked, logits, sizeof masked);
                int32_t fused = m40_gconstraint_argmax(c, logits);
                int any = 0;
                if (m40_gconstraint_apply(c, masked) > 0)
                    for (int id = 0; id < NV; id++)
                        any |= ((mask[id >> 5] >> (id & 31)) & 1) && masked[id] > -INFINITY;
                if (any)
                    argmax_agree += fused == m40k_argmax(masked, NV);
                else
                    argmax_agree += fused == -1 || !(logits[fused] > -INFINITY);
                argmax_rows++;
                for (int id = 0; id < NV; id++)
                    logits[id] = 0;
                CHECK(m40_gconstraint_apply(c, logits) == na, "apply count");
                if (!na)
                    break;
                int id = allowed[rnd() % (uint32_t)na];
                CHECK(logits[id] == 0, "allowed token keeps its logit");
                if (veog[id]) {
                    CHECK(m40_gconstraint_can_end(c), "EOS allowed only where the grammar can end");
                    break;
                }
                CHECK(m40_gconstraint_accept(c, id) == 0, "accept allowed token");
                for (int k = 0; k < vlens[id]; k++)
                    rs = m40_gmatch_next(ref, rs, (uint8_t)vbytes[id][k]);
                if (m40_gconstraint_done(c)) {
                    const uint32_t *m2 = m40_gconstraint_mask(c);
                    int only_eog = 1;
                    for (int j = 0; j < NV; j++)
                        if (((m2[j >> 5] >> (j & 31)) & 1) && !veog[j])
                            only_eog = 0;
                    CHECK(only_eog && ((m2[(NV - 1) >> 5] >> ((NV - 1) & 31)) & 1), "done: only EOS");
                    break;
                }
            }
            /* a disallowed token is refused and changes nothing */
            for (int id = 0; id < NV; id++) {
                const uint32_t *mask = m40_gconstraint_mask(c);
                if (mask && !((mask[id >> 5] >> (id & 31)) & 1)) {
                    CHECK(m40_gconstraint_accept(c, id) == -1, "disallowed token refused");
                    break;
                }
            }
            m40_gconstraint_free(c);
            m40_gmatch_free(ref);
            m40_grammar_free(g2);
        }
    }
    CHECK(argmax_rows > 0 && argmax_agree == argmax_rows, "masked argmax: %d of %d rows as apply + argmax",
          argmax_agree, argmax_rows);
    CHECK(mismatches == 0, "masks differ from brute force in %d token decisions over %d steps", mismatches,
          steps);
    CHECK(steps > 500, "steps %d", steps);
    m40_token_trie_free(trie);
}

/* Many rule names: parsing stays fast (names are hashed) and the chain matches. */
static void test_many_rules(void)
{
    enum { N = 20000 };
    size_t cap = (size_t)N * 40, n = 0;
    char *src = malloc(cap);
    n += (size_t)snprintf(src + n, cap - n, "root ::= r0\n");
    for (int i = 0; i < N; i++)
        n += (size_t)snprintf(src + n, cap - n, i + 1 < N ? "r%d ::= \"a\" r%d | \"b\"\n" : "r%d ::= \"b\"\n", i, i + 1);
    char err[256];
    m40_grammar *g = m40_grammar_parse(src, n, err, sizeof err);
    CHECK(g != NULL, "20000 rules: %s", err);
    if (g) {
        m40_gmatch *m = m40_gmatch_new(g);
        CHECK(m40_gmatch_full(m, "aab", 3) && m40_gmatch_full(m, "b", 1) && !m40_gmatch_full(m, "ba", 2), "chain");
        m40_gmatch_free(m);
        m40_grammar_free(g);
    }
    free(src);
}

/* Exponentially ambiguous: every level doubles the parses. An error, not a hang. */
static void test_ambiguous(void)
{
    char src[4096];
    size_t n = (size_t)snprintf(src, sizeof src, "root ::= a0 \"x\"\n");
    for (int i = 0; i < 40; i++)
        n += (size_t)snprintf(src + n, sizeof src - n, "a%d ::= a%d | a%d\n", i, i + 1, i + 1);
    n += (size_t)snprintf(src + n, sizeof src - n, "a40 ::= \"y\"\n");
    char err[256];
    m40_grammar *g = m40_grammar_parse(src, n, err, sizeof err);
    CHECK(g != NULL, "ambiguous grammar parses: %s", err);
    if (g) {
        m40_gmatch *m = m40_gmatch_new(g);
        CHECK(!m40_gmatch_full(m, "yx", 2) && m40_gmatch_error(m) && strstr(m40_gmatch_error(m), "ambiguous"),
              "ambiguity reported: %s", m40_gmatch_error(m) ? m40_gmatch_error(m) : "(none)");
        m40_gmatch_free(m);
        m40_grammar_free(g);
    }
}

int main(void)
{
    make_vocab();
    test_accept_reject();
    test_errors();
    test_masks();
    test_fuzz();
    test_many_rules();
    test_ambiguous();
    return check_done();
}
