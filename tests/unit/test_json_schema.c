/* engine/grammar/json_schema.c: schemas compile into grammars that parse, accept what
 * they should and reject what they should; unsupported keywords are errors that name
 * them. With --sample FILE N it prints N random sentences of each schema's grammar as
 * "index<TAB>sample as a JSON string" lines (tests/cli/json_schema.sh validates them with Python's
 * jsonschema). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "grammar/grammar.h"

static uint64_t rng = 0x9E3779B97F4A7C15ull;
static uint32_t rnd(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (uint32_t)(rng >> 11);
}

static m40_grammar *compile(const char *schema, char *err, size_t errlen)
{
    char *src = m40_json_schema_to_gbnf(schema, schema ? strlen(schema) : 0, err, errlen);
    if (!src)
        return NULL;
    m40_grammar *g = m40_grammar_parse(src, strlen(src), err, errlen);
    if (!g)
        fprintf(stderr, "grammar of %s does not parse: %s\n%s\n", schema ? schema : "(json_object)", err, src);
    free(src);
    return g;
}

/* First byte of a shortest continuation to an accepting state (BFS), or -1. */
static int toward_end(m40_gmatch *m, int32_t s, int filter)
{
    enum { CAP = 1 << 16 };
    static int32_t q[CAP], first[CAP];
    static int32_t seen[1 << 17];
    memset(seen, 0xff, sizeof seen);
    int head = 0, tail = 0;
    q[tail] = s;
    first[tail++] = -1;
    seen[(uint32_t)s * 2654435761u % (1 << 17)] = s;
    while (head < tail) {
        int32_t st = q[head], fb = first[head];
        head++;
        /* plain printable bytes first; nesting, whitespace and the rest only where nothing
         * else may follow (keeps the search from wandering into ever deeper values) */
        int plain = 0;
        for (int b = 0x21; b < 0x7f && !plain && filter; b++)
            plain = b != '{' && b != '[' && m40_gmatch_next(m, st, (uint8_t)b) >= 0;
        for (int b = 0; b < 256; b++) {
            if (plain && (b < 0x21 || b >= 0x7f || b == '{' || b == '['))
                continue;
            int32_t n = m40_gmatch_next(m, st, (uint8_t)b);
            if (n < 0)
                continue;
            int f = fb < 0 ? b : fb;
            if (m40_gmatch_accepting(m, n))
                return f;
            uint32_t h = (uint32_t)n * 2654435761u % (1 << 17);
            while (seen[h] >= 0 && seen[h] != n)
                h = (h + 1) % (1 << 17);
            if (seen[h] == n || tail == CAP)
                continue;
            seen[h] = n;
            q[tail] = n;
            first[tail++] = f;
        }
    }
    return -1;
}

/* A random sentence: random allowed bytes until about `target` bytes, then the shortest
 * way to the end. Returns its length, or -1 when stuck (a bug). */
static int sample(m40_gmatch *m, char *out, int cap, int target)
{
    int32_t s = m40_gmatch_start(m);
    int n = 0;
    while (n < cap - 1) {
        if (m40_gmatch_accepting(m, s) && (n >= target || m40_gmatch_final(m, s) || rnd() % 16 == 0))
            break;
        int b;
        if (n >= target) { /* close what is open first: a BFS from deep nesting is costly */
            b = -1;
            for (const char *p = "\"]}"; *p && b < 0; p++)
                if (m40_gmatch_next(m, s, (uint8_t)*p) >= 0)
                    b = (uint8_t)*p;
            if (b < 0)
                b = toward_end(m, s, 1);
            if (b < 0)
                b = toward_end(m, s, 0);
        } else {
            int cand[256], nc = 0;
            for (int x = 0; x < 256; x++)
                if (m40_gmatch_next(m, s, (uint8_t)x) >= 0)
                    cand[nc++] = x;
            b = nc ? cand[rnd() % (uint32_t)nc] : -1;
        }
        if (b < 0) {
            out[n] = 0;
            if (getenv("DEBUG_SAMPLE"))
                fprintf(stderr, "stuck after %d bytes: ...%s\n", n, out + (n > 200 ? n - 200 : 0));
            return -1;
        }
        out[n++] = (char)b;
        s = m40_gmatch_next(m, s, (uint8_t)b);
    }
    out[n] = 0;
    if (!m40_gmatch_accepting(m, s) && getenv("DEBUG_SAMPLE"))
        fprintf(stderr, "not complete after %d bytes (%s): ...%s\n", n, m40_gmatch_error(m) ? m40_gmatch_error(m) : "",
                out + (n > 200 ? n - 200 : 0));
    return m40_gmatch_accepting(m, s) ? n : -1;
}

#include <jansson.h>

/* Each schema of a JSON array file: compile, and n samples each (printed when print). */
static void schemas_from_file(const char *path, int n, int print)
{
    json_error_t je;
    json_t *all = json_load_file(path, 0, &je);
    CHECK(json_is_array(all), "%s: %s", path, je.text);
    if (!json_is_array(all))
        return;
    static char buf[1 << 16];
    for (size_t i = 0; i < json_array_size(all); i++) {
        char *js = json_dumps(json_array_get(all, i), JSON_COMPACT | JSON_ENCODE_ANY);
        char err[256];
        m40_grammar *g = compile(js, err, sizeof err);
        CHECK(g != NULL, "schema %zu (%s): %s", i, js, err);
        if (g) {
            m40_gmatch *m = m40_gmatch_new(g);
            for (int k = 0; k < n; k++) {
                int len = sample(m, buf, sizeof buf, (int)(rnd() % 120));
                CHECK(len >= 0, "schema %zu: sampling got stuck", i);
                if (len >= 0 && print) { /* the sample as a JSON string: it may hold newlines */
                    json_t *str = json_stringn(buf, (size_t)len);
                    char *q = str ? json_dumps(str, JSON_ENCODE_ANY) : NULL;
                    CHECK(q != NULL, "schema %zu: sample is not UTF-8", i);
                    if (q)
                        printf("%zu\t%s\n", i, q);
                    free(q);
                    json_decref(str);
                }
            }
            m40_gmatch_free(m);
            m40_grammar_free(g);
        }
        free(js);
    }
    json_decref(all);
}

static const char *errors[][2] = {
    {"{\"type\": \"string\", \"not\": {}}", "unsupported JSON Schema keyword 'not'"},
    {"{\"allOf\": [{}]}", "unsupported JSON Schema keyword 'allOf'"},
    {"{\"type\": \"array\", \"uniqueItems\": true}", "'uniqueItems'"},
    {"{\"type\": \"number\", \"multipleOf\": 3}", "'multipleOf'"},
    {"{\"type\": \"object\", \"patternProperties\": {}}", "'patternProperties'"},
    {"{\"type\": \"array\", \"prefixItems\": []}", "'prefixItems'"},
    {"{\"type\": \"string\", \"format\": \"hostname\"}", "format 'hostname'"},
    {"{\"type\": \"frog\"}", "unknown JSON Schema type 'frog'"},
    {"{\"$ref\": \"#/$defs/missing\"}", "points to nothing"},
    {"{\"$ref\": \"http://example.com/s.json\"}", "local"},
    {"{\"type\": \"integer\", \"minimum\": 10, \"maximum\": 5}", "between minimum and maximum"},
    {"{\"type\": \"string\", \"pattern\": \"(?=x)\"}", "lookaround"},
    {"{\"type\": \"string\", \"pattern\": \"a\\\\bc\"}", "escape '\\b'"},
    {"{\"type\": \"object\", \"properties\": {\"a\": {}}, \"required\": [\"b\"]}", "'b' is not in 'properties'"},
    {"{\"enum\": []}", "non-empty"},
    {"false", "matches nothing"},
    {"{\"type\": ", "not valid JSON"},
    {"[1]", "must be an object"},
    {"{\"type\": \"integer\", \"minimum\": 1e300}", "beyond"},
};

typedef struct {
    const char *schema;
    const char *yes[4], *no[4];
} scase;

static const scase accept_cases[] = {
    {"{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"integer\"},\"b\":{\"type\":\"string\"}},\"required\":[\"a\"]}",
     {"{\"a\": 1}", "{\"a\":-3,\"b\":\"x\"}", "{ \"a\" : 0 , \"b\" : \"\" }"}, {"{}", "{\"b\":\"x\"}", "{\"a\":1.5}", "{\"a\":1,\"c\":2}"}},
    {"{\"type\":\"integer\",\"minimum\":7,\"maximum\":123}", {"7", "99", "123", "10"}, {"6", "124", "-7", "0123"}},
    {"{\"type\":\"integer\",\"minimum\":-20,\"maximum\":-3}", {"-3", "-20", "-11"}, {"-2", "-21", "3", "-0"}},
    {"{\"type\":\"string\",\"maxLength\":2}", {"\"\"", "\"ab\"", "\"\\n\\\"\""}, {"\"abc\"", "ab"}},
    {"{\"type\":\"string\",\"pattern\":\"^a+b?$\"}", {"\"a\"", "\"aab\""}, {"\"b\"", "\"abb\"", "\"\""}},
    {"{\"type\":\"array\",\"items\":{\"type\":\"boolean\"},\"minItems\":1,\"maxItems\":2}",
     {"[true]", "[true, false]"}, {"[]", "[true,true,true]", "[1]"}},
    {"{\"enum\":[\"x\",2,null]}", {"\"x\"", "2", "null"}, {"\"y\"", "3"}},
    {"{\"type\":\"string\",\"format\":\"uuid\"}", {"\"123e4567-e89b-12d3-a456-426614174000\""}, {"\"123\""}},
};

int main(int argc, char **argv)
{
    if (argc == 4 && !strcmp(argv[1], "--sample")) {
        rng ^= (uint64_t)strtoull(getenv("SEED") ? getenv("SEED") : "1", NULL, 10) * 0x100000001B3ull;
        schemas_from_file(argv[2], atoi(argv[3]), 1);
        return check_failed ? 1 : 0;
    }
    for (size_t i = 0; i < sizeof errors / sizeof *errors; i++) {
        char err[256] = "";
        char *src = m40_json_schema_to_gbnf(errors[i][0], strlen(errors[i][0]), err, sizeof err);
        CHECK(!src, "schema %s compiled", errors[i][0]);
        CHECK(strstr(err, errors[i][1]) != NULL, "schema %s: '%s' lacks '%s'", errors[i][0], err, errors[i][1]);
        free(src);
    }
    for (size_t i = 0; i < sizeof accept_cases / sizeof *accept_cases; i++) {
        char err[256];
        m40_grammar *g = compile(accept_cases[i].schema, err, sizeof err);
        CHECK(g != NULL, "%s: %s", accept_cases[i].schema, err);
        if (!g)
            continue;
        m40_gmatch *m = m40_gmatch_new(g);
        for (int k = 0; k < 4 && accept_cases[i].yes[k]; k++)
            CHECK(m40_gmatch_full(m, accept_cases[i].yes[k], strlen(accept_cases[i].yes[k])),
                  "%s should accept %s", accept_cases[i].schema, accept_cases[i].yes[k]);
        for (int k = 0; k < 4 && accept_cases[i].no[k]; k++)
            CHECK(!m40_gmatch_full(m, accept_cases[i].no[k], strlen(accept_cases[i].no[k])),
                  "%s should reject %s", accept_cases[i].schema, accept_cases[i].no[k]);
        m40_gmatch_free(m);
        m40_grammar_free(g);
    }
    /* Sub-schemas whose expressions run past 512 bytes (long enum strings), in every place
     * a sub-schema's expression is spliced into a rule: array items, an object's property,
     * additionalProperties, a $ref target. fuzz_grammar found the array case: the rule body
     * went through a 512-byte formatting buffer, came out NULL and was dereferenced. */
    {
        char word[701];
        memset(word, 'w', 700);
        word[700] = 0;
        const char *shapes[] = {
            "{\"type\":\"array\",\"items\":{\"enum\":[\"%s\"]},\"maxItems\":2}",
            "{\"type\":\"object\",\"properties\":{\"k\":{\"enum\":[\"%s\"]}},\"required\":[\"k\"]}",
            "{\"type\":\"object\",\"additionalProperties\":{\"enum\":[\"%s\"]}}",
            "{\"$defs\":{\"d\":{\"enum\":[\"%s\"]}},\"$ref\":\"#/$defs/d\"}",
            /* the fuzzer's own shape: an array of one long enum that may hold no item */
            "{\"type\":\"object\",\"properties\":{\"tags\":{\"type\":\"array\",\"items\":{\"enum\":[\"%s\"]},"
            "\"maxItems\":0}}}"};
        const char *docs[] = {"[\"%s\", \"%s\"]", "{\"k\": \"%s\"}", "{\"a\": \"%s\"}", "\"%s\"", "{\"tags\": []}"};
        for (size_t k = 0; k < sizeof shapes / sizeof *shapes; k++) {
            char schema[1024], doc[1600], err[256] = "";
            snprintf(schema, sizeof schema, shapes[k], word);
            snprintf(doc, sizeof doc, docs[k], word, word);
            m40_grammar *g = compile(schema, err, sizeof err);
            CHECK(g != NULL, "long enum, shape %zu: %s", k, err);
            if (!g)
                continue;
            m40_gmatch *m = m40_gmatch_new(g);
            CHECK(m40_gmatch_full(m, doc, strlen(doc)), "long enum, shape %zu: accepts its document", k);
            char *wch = strchr(doc, 'w'); /* one letter of the enum's string changed: not allowed */
            if (wch)
                *wch = 'v';
            if (k != 4)
                CHECK(!m40_gmatch_full(m, doc, strlen(doc)), "long enum, shape %zu: rejects a wrong document", k);
            m40_gmatch_free(m);
            m40_grammar_free(g);
        }
    }
    /* several schemas in one grammar (harmony's forced calls): each rule is its own
     * schema, $refs resolve within their own root, no rule is defined twice */
    {
        const char *sch[3] = {"{\"$defs\":{\"d\":{\"enum\":[1,2]}},\"type\":\"object\",\"properties\":{\"x\":"
                              "{\"$ref\":\"#/$defs/d\"}},\"required\":[\"x\"],\"additionalProperties\":false}",
                              "{\"$defs\":{\"d\":{\"type\":\"string\"}},\"type\":\"object\",\"properties\":{\"y\":"
                              "{\"$ref\":\"#/$defs/d\"}},\"required\":[\"y\"],\"additionalProperties\":false}",
                              NULL};
        size_t lens[3] = {strlen(sch[0]), strlen(sch[1]), 0};
        const char *names[3] = {"a0", "a1", "a2"};
        char err[256];
        char *src = m40_json_schema_to_gbnf_rules(sch, lens, names, 3, err, sizeof err);
        CHECK(src != NULL, "rules: %s", err);
        static const char *const roots[] = {"root ::= \"A\" a0\n", "root ::= \"B\" a1\n", "root ::= \"C\" a2\n"};
        static const char *const yes[] = {"A{\"x\": 2}", "B{\"y\": \"s\"}", "C{\"z\": [1]}"};
        static const char *const no[] = {"A{\"x\": \"s\"}", "B{\"y\": 2}", "C[1]"};
        for (int k = 0; k < 3 && src; k++) {
            size_t n = strlen(src) + strlen(roots[k]) + 1;
            char *full = malloc(n);
            snprintf(full, n, "%s%s", src, roots[k]);
            m40_grammar *g = m40_grammar_parse(full, strlen(full), err, sizeof err);
            CHECK(g != NULL, "rules %d do not parse: %s", k, err);
            if (g) {
                m40_gmatch *m = m40_gmatch_new(g);
                CHECK(m40_gmatch_full(m, yes[k], strlen(yes[k])), "rule %d accepts %s", k, yes[k]);
                CHECK(!m40_gmatch_full(m, no[k], strlen(no[k])), "rule %d rejects %s", k, no[k]);
                m40_gmatch_free(m);
                m40_grammar_free(g);
            }
            free(full);
        }
        free(src);
        const char *bad[1] = {"{\"type\": "};
        size_t bl = strlen(bad[0]);
        src = m40_json_schema_to_gbnf_rules(bad, &bl, names, 1, err, sizeof err);
        CHECK(!src && strstr(err, "not valid JSON"), "rules: bad schema: %s", err);
        free(src);
    }
    /* json_object: any object, nothing else */
    char err[256];
    m40_grammar *g = compile(NULL, err, sizeof err);
    CHECK(g != NULL, "json_object: %s", err);
    if (g) {
        m40_gmatch *m = m40_gmatch_new(g);
        CHECK(m40_gmatch_full(m, "{\"a\": [1, {\"b\": null}], \"c\": \"\\u00e9\"}", 38), "object");
        CHECK(!m40_gmatch_full(m, "[1]", 3), "array is not an object");
        m40_gmatch_free(m);
        m40_grammar_free(g);
    }
    /* integer ranges against every value nearby */
    static const int64_t ranges[][2] = {{0, 0}, {0, 9}, {5, 5}, {3, 47}, {-15, 15}, {99, 1001}, {-1000, -999}, {19, 91}};
    for (size_t i = 0; i < sizeof ranges / sizeof *ranges; i++) {
        char schema[128];
        snprintf(schema, sizeof schema, "{\"type\":\"integer\",\"minimum\":%lld,\"maximum\":%lld}",
                 (long long)ranges[i][0], (long long)ranges[i][1]);
        g = compile(schema, err, sizeof err);
        CHECK(g != NULL, "%s: %s", schema, err);
        if (!g)
            continue;
        m40_gmatch *m = m40_gmatch_new(g);
        int bad = 0;
        for (int64_t v = -1100; v <= 1100; v++) {
            char s[32];
            int n = snprintf(s, sizeof s, "%lld", (long long)v);
            int want = v >= ranges[i][0] && v <= ranges[i][1];
            bad += m40_gmatch_full(m, s, (size_t)n) != want;
        }
        CHECK(bad == 0, "%s: %d wrong", schema, bad);
        m40_gmatch_free(m);
        m40_grammar_free(g);
    }
    schemas_from_file("tests/grammar/schemas.json", 20, 0);
    return check_done();
}
