/* JSON Schema -> GBNF.
 *
 * The grammar generates a subset of what the schema accepts, never more: every sentence
 * must validate (a response under a schema always parses and validates). Where matching
 * the schema exactly would need much more machinery the grammar picks a safe subset:
 *   - objects: declared properties only, in schema order (required ones always, optional
 *     ones each skippable); extra keys only for map-like objects without properties;
 *   - numbers with bounds: integers inside the bounds; dates: years 1000-2999, days 01-28;
 *   - pattern: the regular expression's own language (a search for it then succeeds),
 *     character classes narrowed to characters that need no JSON escape (pattern.c);
 *   - oneOf is compiled as anyOf (branches are expected to be disjoint).
 * Any keyword that changes what validates and is not handled is an error naming it. */
#include <ctype.h>
#include <inttypes.h>
#include <jansson.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "grammar.h"
#include "schema_int.h"


typedef struct {
    sbuf out;            /* the rules */
    json_t *root;
    int n_rules;
    schema_err e;        /* the first error (schema_fail) */
    int depth;
    /* $ref targets already given a rule: pointer -> rule name */
    const char *ref_ptr[256];
    char ref_rule[256][24];
    int n_refs;
} jsg;

/* The shared primitives; rules nobody references are harmless. */
static const char *PRELUDE =
    "ws ::= | \" \" | \"\\n\" [ ]{0,8}\n"
    "jchar ::= [^\"\\\\\\x00-\\x1F] | \"\\\\\" ([\"\\\\/bfnrt] | \"u\" [0-9a-fA-F]{4})\n"
    /* one code point per character: what maxLength counts */
    "jchar1 ::= [^\"\\\\\\x00-\\x1F] | \"\\\\\" [\"\\\\/bfnrt]\n"
    "string ::= \"\\\"\" jchar* \"\\\"\"\n"
    "integer ::= \"-\"? (\"0\" | [1-9] [0-9]{0,15})\n"
    "number ::= integer (\".\" [0-9]{1,16})? ([eE] [-+]? [0-9]{1,3})?\n"
    "boolean ::= \"true\" | \"false\"\n"
    "null ::= \"null\"\n"
    "value ::= object | array | string | number | boolean | null\n"
    "object ::= \"{\" ws (string ws \":\" ws value ws (\",\" ws string ws \":\" ws value ws)*)? \"}\"\n"
    "array ::= \"[\" ws (value ws (\",\" ws value ws)*)? \"]\"\n"
    "date ::= [12] [0-9]{3} \"-\" (\"0\" [1-9] | \"1\" [0-2]) \"-\" (\"0\" [1-9] | \"1\" [0-9] | \"2\" [0-8])\n"
    "time ::= ([01] [0-9] | \"2\" [0-3]) \":\" [0-5] [0-9] \":\" [0-5] [0-9] (\".\" [0-9]{1,6})? "
    "(\"Z\" | [+-] ([01] [0-9] | \"2\" [0-3]) \":\" [0-5] [0-9])\n"
    "hex ::= [0-9a-f]\n"
    "uuid ::= hex{8} \"-\" hex{4} \"-\" hex{4} \"-\" hex{4} \"-\" hex{12}\n"
    "email ::= [a-zA-Z0-9_+-] [a-zA-Z0-9._+-]{0,30} \"@\" [a-zA-Z0-9] [a-zA-Z0-9-]{0,20} (\".\" [a-zA-Z] [a-zA-Z0-9-]{0,10}){1,3}\n";

static int gen(jsg *c, json_t *s, sbuf *expr);

/* A new rule "rN ::= body"; its name into name. A NULL body is a buffer that ran out of
 * memory: the output is marked so (the compile fails with that error). */
static void new_rule(jsg *c, char name[24], const char *body)
{
    snprintf(name, 24, "r%d", c->n_rules++);
    if (!body) {
        c->out.oom = 1;
        return;
    }
    sb_printf(&c->out, "%s ::= ", name);
    sb_puts(&c->out, body);
    sb_puts(&c->out, "\n");
}

static int is_annotation(const char *k)
{
    static const char *const ann[] = {"title", "description", "$schema", "$id", "default", "examples",
                                      "$comment", "deprecated", "readOnly", "writeOnly", "$defs",
                                      "definitions", "strict", "nullable_hint", NULL};
    for (int i = 0; ann[i]; i++)
        if (!strcmp(k, ann[i]))
            return 1;
    return 0;
}

static int check_keywords(jsg *c, json_t *s, const char *const *allowed)
{
    const char *k;
    json_t *v;
    json_object_foreach(s, k, v) {
        if (is_annotation(k))
            continue;
        int ok = 0;
        for (int i = 0; allowed[i] && !ok; i++)
            ok = !strcmp(k, allowed[i]);
        if (!ok)
            return schema_fail(&c->e, "unsupported JSON Schema keyword '%s'", k);
    }
    return 0;
}

static void dump_literal(jsg *c, json_t *v, sbuf *e)
{
    char *j = json_dumps(v, JSON_COMPACT | JSON_ENCODE_ANY);
    if (!j) {
        c->e.failed = 1;
        return;
    }
    lit(e, j, strlen(j));
    free(j);
}

/* ---- integer ranges: digit-by-digit alternatives, as for regular expressions ---- */

/* Same-length decimal strings a <= b. */
static void digits_range(sbuf *e, const char *a, const char *b, int n)
{
    if (n == 0)
        return;
    if (n == 1) {
        sb_printf(e, "[%c-%c]", a[0], b[0]);
        return;
    }
    int all0 = 1, all9 = 1;
    for (int i = 1; i < n; i++) {
        all0 &= a[i] == '0';
        all9 &= b[i] == '9';
    }
    if (a[0] == b[0]) {
        sb_printf(e, "\"%c\" ", a[0]);
        digits_range(e, a + 1, b + 1, n - 1);
        return;
    }
    if (all0 && all9) {
        sb_printf(e, "[%c-%c] [0-9]{%d}", a[0], b[0], n - 1);
        return;
    }
    char nines[24], zeros[24];
    memset(nines, '9', sizeof nines);
    memset(zeros, '0', sizeof zeros);
    sb_puts(e, "(");
    char lo0 = a[0], hi0 = b[0];
    if (!all0) { /* a[0] followed by a[1..]..99 */
        sb_printf(e, "\"%c\" (", a[0]);
        digits_range(e, a + 1, nines, n - 1);
        sb_puts(e, ") | ");
        lo0++;
    }
    if (!all9)
        hi0--;
    if (lo0 <= hi0)
        sb_printf(e, "[%c-%c] [0-9]{%d} | ", lo0, hi0, n - 1);
    if (!all9) {
        sb_printf(e, "\"%c\" (", b[0]);
        digits_range(e, zeros, b + 1, n - 1);
        sb_puts(e, ") | ");
    }
    e->n -= 3; /* the last " | " */
    e->s[e->n] = 0;
    sb_puts(e, ")");
}

#define MAXDIGITS 16

/* Non-negative integers in [lo, hi] (hi < 0: unbounded), as alternatives appended to e. */
static void nonneg_range(sbuf *e, int64_t lo, int64_t hi)
{
    int first = 1;
    int64_t p = 1;
    for (int d = 1; d <= MAXDIGITS; d++, p *= 10) {
        int64_t dlo = d == 1 ? 0 : p, dhi = p * 10 - 1;
        if (hi >= 0 && dlo > hi)
            break;
        if (dhi < lo)
            continue;
        int64_t a = lo > dlo ? lo : dlo, b = (hi >= 0 && hi < dhi) ? hi : dhi;
        char as[24], bs[24];
        snprintf(as, sizeof as, "%0*" PRId64, d, a);
        snprintf(bs, sizeof bs, "%0*" PRId64, d, b);
        if (!first)
            sb_puts(e, " | ");
        first = 0;
        sb_puts(e, "(");
        digits_range(e, as, bs, d);
        sb_puts(e, ")");
    }
}

static int integer_range(jsg *c, json_t *s, int is_number, sbuf *e)
{
    const int64_t LIM = 999999999999999LL;
    int64_t lo = -LIM, hi = LIM;
    json_t *v;
    if ((v = json_object_get(s, "minimum"))) {
        if (!json_is_number(v))
            return schema_fail(&c->e, "'minimum' must be a number");
        double x = json_number_value(v);
        if (!(x > -1e15 && x < 1e15)) /* checked before the cast: a huge double does not fit */
            return schema_fail(&c->e, "minimum/maximum beyond %lld are not supported", (long long)LIM);
        int64_t k = (int64_t)x;
        if ((double)k < x)
            k++;
        lo = k;
    }
    if ((v = json_object_get(s, "exclusiveMinimum"))) {
        if (!json_is_number(v))
            return schema_fail(&c->e, "'exclusiveMinimum' must be a number");
        double x = json_number_value(v);
        if (!(x > -1e15 && x < 1e15)) /* checked before the cast: a huge double does not fit */
            return schema_fail(&c->e, "minimum/maximum beyond %lld are not supported", (long long)LIM);
        int64_t k = (int64_t)x;
        if ((double)k <= x)
            k++;
        if (k > lo)
            lo = k;
    }
    if ((v = json_object_get(s, "maximum"))) {
        if (!json_is_number(v))
            return schema_fail(&c->e, "'maximum' must be a number");
        double x = json_number_value(v);
        if (!(x > -1e15 && x < 1e15)) /* checked before the cast: a huge double does not fit */
            return schema_fail(&c->e, "minimum/maximum beyond %lld are not supported", (long long)LIM);
        int64_t k = (int64_t)x;
        if ((double)k > x)
            k--;
        hi = k;
    }
    if ((v = json_object_get(s, "exclusiveMaximum"))) {
        if (!json_is_number(v))
            return schema_fail(&c->e, "'exclusiveMaximum' must be a number");
        double x = json_number_value(v);
        if (!(x > -1e15 && x < 1e15)) /* checked before the cast: a huge double does not fit */
            return schema_fail(&c->e, "minimum/maximum beyond %lld are not supported", (long long)LIM);
        int64_t k = (int64_t)x;
        if ((double)k >= x)
            k--;
        if (k < hi)
            hi = k;
    }
    if (lo < -LIM || hi > LIM || lo > LIM || hi < -LIM)
        return schema_fail(&c->e, "minimum/maximum beyond %lld are not supported", (long long)LIM);
    if (lo > hi)
        return schema_fail(&c->e, "no %s lies between minimum and maximum", is_number ? "number" : "integer");
    sb_puts(e, "(");
    int any = 0;
    if (lo < 0) { /* negatives: "-" and the magnitude in [max(1, -hi), -lo] */
        sb_puts(e, "\"-\" (");
        nonneg_range(e, hi < 0 ? -hi : 1, -lo);
        sb_puts(e, ")");
        any = 1;
    }
    if (hi >= 0) {
        if (any)
            sb_puts(e, " | ");
        nonneg_range(e, lo > 0 ? lo : 0, hi);
    }
    sb_puts(e, ")");
    return 0;
}


/* ---- types ---- */

static int gen_string(jsg *c, json_t *s, sbuf *e)
{
    static const char *const kw[] = {"type", "minLength", "maxLength", "pattern", "format", NULL};
    if (check_keywords(c, s, kw))
        return -1;
    json_t *pat = json_object_get(s, "pattern"), *fmt = json_object_get(s, "format");
    json_t *mn = json_object_get(s, "minLength"), *mx = json_object_get(s, "maxLength");
    if ((pat || fmt) && (mn || mx))
        return schema_fail(&c->e, "minLength/maxLength together with pattern or format are not supported");
    if (pat && fmt)
        return schema_fail(&c->e, "pattern together with format is not supported");
    if (pat) {
        if (!json_is_string(pat))
            return schema_fail(&c->e, "'pattern' must be a string");
        char perr[200];
        sb_puts(e, "\"\\\"\" ");
        if (m40_pattern_to_gbnf(json_string_value(pat), json_string_length(pat), e, perr, sizeof perr))
            return schema_fail(&c->e, "%s", perr);
        sb_puts(e, " \"\\\"\"");
        return 0;
    }
    if (fmt) {
        const char *f = json_string_value(fmt);
        if (!f)
            return schema_fail(&c->e, "'format' must be a string");
        const char *rule = !strcmp(f, "date") ? "date" : !strcmp(f, "time") ? "time"
                         : !strcmp(f, "date-time") ? "date \"T\" time" : !strcmp(f, "uuid") ? "uuid"
                         : !strcmp(f, "email") ? "email" : NULL;
        if (!rule)
            return schema_fail(&c->e, "unsupported JSON Schema format '%s'", f);
        sb_printf(e, "\"\\\"\" %s \"\\\"\"", rule);
        return 0;
    }
    if (mn || mx) {
        json_int_t lo = 0, hi = -1;
        if (mn && (!json_is_integer(mn) || (lo = json_integer_value(mn)) < 0))
            return schema_fail(&c->e, "'minLength' must be a non-negative integer");
        if (mx && (!json_is_integer(mx) || (hi = json_integer_value(mx)) < 0))
            return schema_fail(&c->e, "'maxLength' must be a non-negative integer");
        if (lo > 4096 || hi > 4096)
            return schema_fail(&c->e, "minLength/maxLength above 4096 are not supported");
        if (hi >= 0 && hi < lo)
            return schema_fail(&c->e, "maxLength below minLength");
        if (hi >= 0)
            sb_printf(e, "\"\\\"\" jchar1{%lld,%lld} \"\\\"\"", (long long)lo, (long long)hi);
        else
            sb_printf(e, "\"\\\"\" jchar1{%lld,} \"\\\"\"", (long long)lo);
        return 0;
    }
    sb_puts(e, "string");
    return 0;
}

static int gen_number(jsg *c, json_t *s, int integer, sbuf *e)
{
    static const char *const kw[] = {"type", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", NULL};
    if (check_keywords(c, s, kw))
        return -1;
    if (json_object_get(s, "minimum") || json_object_get(s, "maximum") || json_object_get(s, "exclusiveMinimum") ||
        json_object_get(s, "exclusiveMaximum"))
        return integer_range(c, s, !integer, e); /* bounded numbers: the integers in bounds */
    sb_puts(e, integer ? "integer" : "number");
    return 0;
}

static int gen_array(jsg *c, json_t *s, sbuf *e)
{
    static const char *const kw[] = {"type", "items", "minItems", "maxItems", "uniqueItems", NULL};
    if (check_keywords(c, s, kw))
        return -1;
    json_t *u = json_object_get(s, "uniqueItems");
    if (u && !json_is_false(u))
        return schema_fail(&c->e, "unsupported JSON Schema keyword 'uniqueItems'");
    sbuf item = {0};
    json_t *items = json_object_get(s, "items");
    if (items) {
        if (gen(c, items, &item)) {
            free(item.s);
            return -1;
        }
    } else
        sb_puts(&item, "value");
    json_int_t lo = 0, hi = -1;
    json_t *mn = json_object_get(s, "minItems"), *mx = json_object_get(s, "maxItems");
    if (mn && (!json_is_integer(mn) || (lo = json_integer_value(mn)) < 0))
        return free(item.s), schema_fail(&c->e, "'minItems' must be a non-negative integer");
    if (mx && (!json_is_integer(mx) || (hi = json_integer_value(mx)) < 0))
        return free(item.s), schema_fail(&c->e, "'maxItems' must be a non-negative integer");
    if (lo > 1000 || hi > 1000)
        return free(item.s), schema_fail(&c->e, "minItems/maxItems above 1000 are not supported");
    if (hi >= 0 && hi < lo)
        return free(item.s), schema_fail(&c->e, "maxItems below minItems");
    char name[24];
    sbuf body = {0};
    sb_puts(&body, item.s ? item.s : "value");
    new_rule(c, name, body.s);
    free(body.s);
    free(item.s);
    /* "[" (item ("," item){lo-1, hi-1})? "]" with the outer ? only when lo == 0 */
    if (hi == 0) {
        sb_puts(e, "\"[\" ws \"]\"");
        return 0;
    }
    sb_printf(e, "\"[\" ws (%s ws (\",\" ws %s ws)", name, name);
    long rlo = lo > 0 ? (long)lo - 1 : 0;
    if (hi < 0)
        sb_printf(e, "{%ld,}", rlo);
    else
        sb_printf(e, "{%ld,%ld}", rlo, (long)hi - 1);
    sb_puts(e, lo > 0 ? ") \"]\"" : ")? \"]\"");
    return 0;
}

static int gen_object(jsg *c, json_t *s, sbuf *e)
{
    static const char *const kw[] = {"type", "properties", "required", "additionalProperties", NULL};
    if (check_keywords(c, s, kw))
        return -1;
    json_t *props = json_object_get(s, "properties"), *req = json_object_get(s, "required");
    json_t *addl = json_object_get(s, "additionalProperties");
    if (props && !json_is_object(props))
        return schema_fail(&c->e, "'properties' must be an object");
    if (req && !json_is_array(req))
        return schema_fail(&c->e, "'required' must be an array");
    if (addl && !json_is_boolean(addl) && !json_is_object(addl))
        return schema_fail(&c->e, "'additionalProperties' must be a boolean or a schema");
    size_t np = props ? json_object_size(props) : 0;
    if (!np) {
        size_t nreq = req ? json_array_size(req) : 0;
        if (nreq)
            return schema_fail(&c->e, "'required' names properties that 'properties' does not declare");
        if (addl && json_is_false(addl)) {
            sb_puts(e, "\"{\" ws \"}\"");
            return 0;
        }
        if (!addl || json_is_true(addl)) {
            sb_puts(e, "object");
            return 0;
        }
        sbuf v = {0};
        if (gen(c, addl, &v))
            return free(v.s), -1;
        char name[24];
        sbuf body = {0};
        sb_puts(&body, "string ws \":\" ws ");
        sb_puts(&body, v.s ? v.s : "value");
        new_rule(c, name, body.s);
        free(body.s);
        free(v.s);
        sb_printf(e, "\"{\" ws (%s ws (\",\" ws %s ws)*)? \"}\"", name, name);
        return 0;
    }
    for (size_t i = 0; req && i < json_array_size(req); i++) {
        json_t *r = json_array_get(req, i);
        if (!json_is_string(r))
            return schema_fail(&c->e, "'required' must list strings");
        if (!json_object_get(props, json_string_value(r)))
            return schema_fail(&c->e, "required property '%s' is not in 'properties'", json_string_value(r));
    }
    /* one rule per property: "key" ws ":" ws value */
    char (*kv)[24] = calloc(np, 24);
    int *isreq = calloc(np, sizeof(int));
    if (!kv || !isreq) {
        free(kv);
        free(isreq);
        return schema_fail(&c->e, "out of memory");
    }
    size_t i = 0;
    const char *k;
    json_t *v;
    json_object_foreach(props, k, v) {
        sbuf val = {0}, body = {0};
        if (gen(c, v, &val)) {
            free(val.s);
            break;
        }
        json_t *key = json_string(k);
        dump_literal(c, key, &body);
        json_decref(key);
        sb_puts(&body, " ws \":\" ws ");
        sb_puts(&body, val.s ? val.s : "value");
        new_rule(c, kv[i], body.s);
        free(body.s);
        free(val.s);
        for (size_t j = 0; req && j < json_array_size(req); j++)
            if (!strcmp(json_string_value(json_array_get(req, j)), k))
                isreq[i] = 1;
        i++;
    }
    if (c->e.failed) {
        free(kv);
        free(isreq);
        return -1;
    }
    /* required ones first (schema order), then each optional one skippable */
    sb_puts(e, "\"{\" ws ");
    int n_req = 0;
    for (i = 0; i < np; i++)
        if (isreq[i])
            sb_printf(e, "%s%s ws ", n_req++ ? "\",\" ws " : "", kv[i]);
    if (n_req) {
        for (i = 0; i < np; i++)
            if (!isreq[i])
                sb_printf(e, "(\",\" ws %s ws)? ", kv[i]);
    } else {
        /* no required key: the first present optional one has no comma before it */
        sb_puts(e, "(");
        int first = 1;
        for (i = 0; i < np; i++) {
            sb_printf(e, "%s%s ws ", first ? "" : "| ", kv[i]);
            first = 0;
            for (size_t j = i + 1; j < np; j++)
                sb_printf(e, "(\",\" ws %s ws)? ", kv[j]);
        }
        sb_puts(e, ")? ");
    }
    sb_puts(e, "\"}\"");
    free(kv);
    free(isreq);
    return 0;
}

static int gen_ref(jsg *c, json_t *s, sbuf *e)
{
    static const char *const kw[] = {"$ref", NULL};
    if (check_keywords(c, s, kw))
        return -1;
    const char *ref = json_string_value(json_object_get(s, "$ref"));
    if (!ref || ref[0] != '#')
        return schema_fail(&c->e, "only local '$ref's (\"#/$defs/...\") are supported");
    json_t *t = c->root;
    const char *p = ref + 1;
    while (*p == '/') {
        p++;
        const char *q = strchr(p, '/');
        size_t n = q ? (size_t)(q - p) : strlen(p);
        char key[256];
        if (n >= sizeof key)
            return schema_fail(&c->e, "'$ref' %s: name too long", ref);
        /* JSON pointer escapes: ~1 is '/', ~0 is '~' */
        size_t kn = 0;
        for (size_t i = 0; i < n; i++) {
            if (p[i] == '~' && i + 1 < n && (p[i + 1] == '0' || p[i + 1] == '1')) {
                key[kn++] = p[i + 1] == '0' ? '~' : '/';
                i++;
            } else
                key[kn++] = p[i];
        }
        key[kn] = 0;
        t = json_is_object(t) ? json_object_get(t, key) : NULL;
        if (!t)
            return schema_fail(&c->e, "'$ref' %s points to nothing", ref);
        p += n;
    }
    if (*p)
        return schema_fail(&c->e, "'$ref' %s is not a JSON pointer", ref);
    for (int i = 0; i < c->n_refs; i++)
        if (c->ref_ptr[i] == (const char *)t) {
            sb_puts(e, c->ref_rule[i]);
            return 0;
        }
    if (c->n_refs == 256)
        return schema_fail(&c->e, "too many '$ref' targets");
    /* name the rule before compiling it: the target may refer to itself */
    int slot = c->n_refs++;
    c->ref_ptr[slot] = (const char *)t;
    snprintf(c->ref_rule[slot], 24, "r%d", c->n_rules++);
    sbuf body = {0};
    if (gen(c, t, &body))
        return free(body.s), -1;
    sb_puts(&c->out, c->ref_rule[slot]);
    sb_puts(&c->out, " ::= ");
    sb_puts(&c->out, body.s ? body.s : "value");
    sb_puts(&c->out, "\n");
    free(body.s);
    sb_puts(e, c->ref_rule[slot]);
    return 0;
}

static int gen_type(jsg *c, json_t *s, const char *type, sbuf *e)
{
    if (!strcmp(type, "string"))
        return gen_string(c, s, e);
    if (!strcmp(type, "integer"))
        return gen_number(c, s, 1, e);
    if (!strcmp(type, "number"))
        return gen_number(c, s, 0, e);
    if (!strcmp(type, "boolean") || !strcmp(type, "null")) {
        static const char *const kw[] = {"type", NULL};
        if (check_keywords(c, s, kw))
            return -1;
        sb_puts(e, type);
        return 0;
    }
    if (!strcmp(type, "array"))
        return gen_array(c, s, e);
    if (!strcmp(type, "object"))
        return gen_object(c, s, e);
    return schema_fail(&c->e, "unknown JSON Schema type '%s'", type);
}

static int gen(jsg *c, json_t *s, sbuf *e)
{
    if (c->e.failed)
        return -1;
    if (++c->depth > 64) {
        c->depth--;
        return schema_fail(&c->e, "schema nested too deeply");
    }
    int rc = 0;
    json_t *v;
    if (json_is_true(s) || (json_is_object(s) && json_object_size(s) == 0)) {
        sb_puts(e, "value");
    } else if (!json_is_object(s)) {
        rc = schema_fail(&c->e, json_is_false(s) ? "schema 'false' matches nothing" : "a schema must be an object or a boolean");
    } else if (json_object_get(s, "$ref")) {
        rc = gen_ref(c, s, e);
    } else if ((v = json_object_get(s, "const"))) {
        static const char *const kw[] = {"const", "type", NULL};
        if (!(rc = check_keywords(c, s, kw)))
            dump_literal(c, v, e);
    } else if ((v = json_object_get(s, "enum"))) {
        static const char *const kw[] = {"enum", "type", NULL};
        if (!(rc = check_keywords(c, s, kw))) {
            if (!json_is_array(v) || !json_array_size(v))
                rc = schema_fail(&c->e, "'enum' must be a non-empty array");
            sb_puts(e, "(");
            for (size_t i = 0; !rc && i < json_array_size(v); i++) {
                if (i)
                    sb_puts(e, " | ");
                dump_literal(c, json_array_get(v, i), e);
            }
            sb_puts(e, ")");
        }
    } else if ((v = json_object_get(s, "anyOf")) || (v = json_object_get(s, "oneOf"))) {
        static const char *const kw[] = {"anyOf", "oneOf", NULL};
        if (json_object_get(s, "anyOf") && json_object_get(s, "oneOf"))
            rc = schema_fail(&c->e, "anyOf together with oneOf is not supported");
        else if (!(rc = check_keywords(c, s, kw))) {
            if (!json_is_array(v) || !json_array_size(v))
                rc = schema_fail(&c->e, "'anyOf'/'oneOf' must be a non-empty array");
            sb_puts(e, "(");
            for (size_t i = 0; !rc && i < json_array_size(v); i++) {
                if (i)
                    sb_puts(e, " | ");
                rc = gen(c, json_array_get(v, i), e);
            }
            sb_puts(e, ")");
        }
    } else if ((v = json_object_get(s, "type"))) {
        if (json_is_string(v))
            rc = gen_type(c, s, json_string_value(v), e);
        else if (json_is_array(v) && json_array_size(v)) {
            sb_puts(e, "(");
            for (size_t i = 0; !rc && i < json_array_size(v); i++) {
                const char *t = json_string_value(json_array_get(v, i));
                if (!t) {
                    rc = schema_fail(&c->e, "'type' must list strings");
                    break;
                }
                if (i)
                    sb_puts(e, " | ");
                /* keywords of the other types are fine here: check each type's own */
                json_t *copy = json_copy(s);
                const char *k;
                json_t *x;
                void *tmp;
                static const char *const own[] = {"minLength", "maxLength", "pattern", "format", "minimum", "maximum",
                                                  "exclusiveMinimum", "exclusiveMaximum", "items", "minItems",
                                                  "maxItems", "uniqueItems", "properties", "required",
                                                  "additionalProperties", NULL};
                static const char *const owner[] = {"string", "string", "string", "string", "number", "number",
                                                    "number", "number", "array", "array", "array", "array",
                                                    "object", "object", "object"};
                json_object_foreach_safe(copy, tmp, k, x) {
                    for (int j = 0; own[j]; j++)
                        if (!strcmp(k, own[j]) && strcmp(owner[j], t) &&
                            !(!strcmp(owner[j], "number") && !strcmp(t, "integer"))) {
                            json_object_del(copy, k); /* k is freed with it */
                            break;
                        }
                }
                rc = gen_type(c, copy, t, e);
                json_decref(copy);
            }
            sb_puts(e, ")");
        } else
            rc = schema_fail(&c->e, "'type' must be a string or an array of strings");
    } else if (json_object_get(s, "properties") || json_object_get(s, "required") ||
               json_object_get(s, "additionalProperties")) {
        rc = gen_object(c, s, e);
    } else if (json_object_get(s, "items")) {
        rc = gen_array(c, s, e);
    } else {
        static const char *const kw[] = {NULL};
        if (!(rc = check_keywords(c, s, kw)))
            sb_puts(e, "value");
    }
    c->depth--;
    if (e->oom)
        rc = schema_fail(&c->e, "out of memory");
    return rc ? -1 : 0;
}

char *m40_json_schema_to_gbnf(const char *schema_json, size_t len, char *err, size_t errlen)
{
    return m40_json_schema_to_gbnf_rule(schema_json, len, "root", err, errlen);
}

char *m40_json_schema_to_gbnf_rule(const char *schema_json, size_t len, const char *rule, char *err, size_t errlen)
{
    return m40_json_schema_to_gbnf_rules(&schema_json, &len, &rule, 1, err, errlen);
}

char *m40_json_schema_to_gbnf_rules(const char *const *schemas, const size_t *lens, const char *const *rules, int n,
                                    char *err, size_t errlen)
{
    jsg c = {.e = {.err = err, .errlen = errlen}};
    if (err && errlen)
        err[0] = 0;
    sb_puts(&c.out, PRELUDE);
    for (int i = 0; i < n && !c.e.failed; i++) {
        if (!schemas[i]) {
            sb_puts(&c.out, rules[i]);
            sb_puts(&c.out, " ::= object\n");
            continue;
        }
        json_error_t je;
        c.root = json_loadb(schemas[i], lens[i], JSON_DECODE_ANY, &je);
        if (!c.root) {
            free(c.out.s);
            snprintf(err, errlen, "schema is not valid JSON: %s", je.text);
            return NULL;
        }
        /* $ref targets are nodes of this root: the next schema's may reuse the addresses
         * (the rule counter goes on, so no name repeats) */
        c.n_refs = 0;
        sbuf root = {0};
        if (gen(&c, c.root, &root) == 0) {
            sb_puts(&c.out, rules[i]);
            sb_puts(&c.out, " ::= ");
            sb_puts(&c.out, root.s ? root.s : "value");
            sb_puts(&c.out, "\n");
        }
        json_decref(c.root);
        c.root = NULL;
        free(root.s);
    }
    if (c.out.oom && !c.e.failed)
        schema_fail(&c.e, "out of memory");
    if (c.e.failed) {
        free(c.out.s);
        return NULL;
    }
    return c.out.s;
}
