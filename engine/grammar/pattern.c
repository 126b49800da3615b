/* JSON Schema "pattern" -> GBNF: the regular-expression subset structured outputs need
 * (literals, ".", classes with ranges and negation, \d \w \s and their negations, groups
 * and (?:...), alternation, * + ? {m,n}, lazy quantifiers, ^ and $ anchors). The grammar
 * produces the JSON-escaped text of strings the expression matches, and only a subset:
 * classes and "." are narrowed to printable ASCII that needs no JSON escape, so every
 * output validates however Python's or JavaScript's engine reads the class. */
#include <ctype.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "schema_int.h"

typedef schema_err jsg; /* the pattern compiler's state is its error */

/* A class member set narrowed to printable ASCII that needs no JSON escape. */
typedef struct { uint8_t has[128]; } cset;

static void cset_add_range(cset *s, int lo, int hi)
{
    for (int c = lo; c <= hi && c < 128; c++)
        s->has[c] = 1;
}

static void cset_emit(sbuf *e, const cset *s, int negate)
{
    sb_puts(e, "[");
    int any = 0;
    for (int c = 0x20; c < 0x7f; c++) {
        int in = s->has[c] ^ negate;
        if (!in || c == '"' || c == '\\')
            continue;
        any = 1;
        if (c == ']' || c == '[' || c == '-' || c == '^')
            sb_printf(e, "\\%c", c);
        else
            sb_add(e, (const char *)&(char){(char)c}, 1);
    }
    if (!any)
        sb_puts(e, "\\x01"); /* caught below: an empty class cannot be produced */
    sb_puts(e, "]");
}

static int class_escape(cset *s, char c)
{
    switch (c) {
    case 'd': cset_add_range(s, '0', '9'); return 1;
    case 'w': cset_add_range(s, 'a', 'z'); cset_add_range(s, 'A', 'Z'); cset_add_range(s, '0', '9'); s->has['_'] = 1; return 1;
    case 's': s->has[' '] = 1; return 1;
    default: return 0;
    }
}

typedef struct {
    const char *p, *end;
} rx;

static int rx_alt(jsg *c, rx *r, sbuf *e, int depth);

static int rx_atom(jsg *c, rx *r, sbuf *e, int depth)
{
    char ch = *r->p++;
    if (ch == '(') {
        if (r->end - r->p >= 2 && r->p[0] == '?' && r->p[1] == ':')
            r->p += 2;
        else if (r->p < r->end && r->p[0] == '?')
            return schema_fail(c, "pattern: lookaround and other (?...) groups are not supported");
        if (depth > 50)
            return schema_fail(c, "pattern nested too deeply");
        sb_puts(e, "(");
        if (rx_alt(c, r, e, depth + 1))
            return -1;
        if (r->p >= r->end || *r->p != ')')
            return schema_fail(c, "pattern: missing ')'");
        r->p++;
        sb_puts(e, ")");
        return 0;
    }
    if (ch == '[') {
        cset s = {{0}};
        int negate = 0;
        if (r->p < r->end && *r->p == '^') {
            negate = 1;
            r->p++;
        }
        int first = 1;
        while (r->p < r->end && (*r->p != ']' || first)) {
            first = 0;
            int lo = (unsigned char)*r->p++;
            if (lo == '\\') {
                if (r->p >= r->end)
                    return schema_fail(c, "pattern: '\\' at the end");
                char x = *r->p++;
                if (class_escape(&s, x))
                    continue;
                if (x == 'D' || x == 'W' || x == 'S')
                    return schema_fail(c, "pattern: \\%c inside a class is not supported", x);
                lo = x == 'n' ? '\n' : x == 't' ? '\t' : (unsigned char)x;
            }
            int hi = lo;
            if (r->end - r->p >= 2 && *r->p == '-' && r->p[1] != ']') {
                r->p++;
                hi = (unsigned char)*r->p++;
                if (hi == '\\') {
                    if (r->p >= r->end)
                        return schema_fail(c, "pattern: '\\' at the end");
                    hi = (unsigned char)*r->p++;
                }
                if (hi < lo)
                    return schema_fail(c, "pattern: character range out of order");
            }
            cset_add_range(&s, lo, hi);
        }
        if (r->p >= r->end)
            return schema_fail(c, "pattern: missing ']'");
        r->p++;
        size_t at = e->n;
        cset_emit(e, &s, negate);
        if (strstr(e->s + at, "\\x01"))
            return schema_fail(c, "pattern: a character class with no printable ASCII character is not supported");
        return 0;
    }
    if (ch == '.') {
        cset s = {{0}};
        cset_emit(e, &s, 1);
        return 0;
    }
    if (ch == '\\') {
        if (r->p >= r->end)
            return schema_fail(c, "pattern: '\\' at the end");
        char x = *r->p++;
        cset s = {{0}};
        if (class_escape(&s, x)) {
            cset_emit(e, &s, 0);
            return 0;
        }
        if (x == 'D' || x == 'W' || x == 'S') {
            class_escape(&s, (char)tolower((unsigned char)x));
            cset_emit(e, &s, 1);
            return 0;
        }
        if (isalnum((unsigned char)x))
            return schema_fail(c, "pattern: escape '\\%c' is not supported", x);
        ch = x;
    } else if (ch == '*' || ch == '+' || ch == '?' || ch == '{')
        return schema_fail(c, "pattern: '%c' with nothing before it", ch);
    /* a literal character, JSON-escaped where the string needs it */
    if (ch == '"')
        sb_puts(e, "\"\\\\\\\"\"");
    else if (ch == '\\')
        sb_puts(e, "\"\\\\\\\\\"");
    else if ((unsigned char)ch < 0x20)
        return schema_fail(c, "pattern: control characters are not supported");
    else
        lit(e, &ch, 1);
    return 0;
}

static int rx_seq(jsg *c, rx *r, sbuf *e, int depth)
{
    sb_puts(e, "(\"\"");
    while (r->p < r->end && *r->p != '|' && *r->p != ')') {
        if (*r->p == '^' || *r->p == '$') { /* anchors: the grammar is anchored already */
            r->p++;
            continue;
        }
        sb_puts(e, " ");
        size_t at = e->n;
        if (rx_atom(c, r, e, depth))
            return -1;
        if (r->p < r->end && (*r->p == '*' || *r->p == '+' || *r->p == '?' || *r->p == '{')) {
            /* wrap the atom so the quantifier applies to all of it */
            sbuf atom = {0};
            sb_add(&atom, e->s + at, e->n - at);
            e->n = at;
            sb_puts(e, "(");
            sb_add(e, atom.s ? atom.s : "", atom.n);
            sb_puts(e, ")");
            free(atom.s);
            char q = *r->p++;
            if (q == '{') {
                const char *s = r->p;
                while (r->p < r->end && *r->p != '}')
                    r->p++;
                if (r->p >= r->end)
                    return schema_fail(c, "pattern: missing '}'");
                sb_puts(e, "{");
                for (const char *k = s; k < r->p; k++) {
                    if (!isdigit((unsigned char)*k) && *k != ',')
                        return schema_fail(c, "pattern: bad {m,n}");
                    sb_add(e, k, 1);
                }
                sb_puts(e, "}");
                r->p++;
            } else
                sb_add(e, &q, 1);
            if (r->p < r->end && *r->p == '?') /* lazy: the same language */
                r->p++;
        }
    }
    sb_puts(e, ")");
    return 0;
}

static int rx_alt(jsg *c, rx *r, sbuf *e, int depth)
{
    if (rx_seq(c, r, e, depth))
        return -1;
    while (r->p < r->end && *r->p == '|') {
        r->p++;
        sb_puts(e, " | ");
        if (rx_seq(c, r, e, depth))
            return -1;
    }
    return 0;
}
int m40_pattern_to_gbnf(const char *re, size_t len, sbuf *e, char *err, size_t errlen)
{
    jsg c = {err, errlen, 0};
    rx r = {re, re + len};
    if (rx_alt(&c, &r, e, 0))
        return -1;
    if (r.p < r.end)
        return schema_fail(&c, "pattern: unbalanced ')'");
    return e->oom ? schema_fail(&c, "out of memory") : 0;
}
