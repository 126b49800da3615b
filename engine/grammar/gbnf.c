/* GBNF parser: the grammar syntax llama-server accepts, into byte-level rules.
 *
 *   name ::= alt | alt        rules; a rule ends at a newline outside parentheses (a
 *                             following line that starts with '|' continues it)
 *   "lit"  [a-z^...]  [^"]  . literal, class (ranges, negation), any character
 *   ( ... )  x?  x*  x+  x{m}  x{m,}  x{m,n}    groups and repetition
 *   # comment                 escapes: \n \r \t \\ \" \[ \] \xHH \uHHHH \UHHHHHHHH
 *
 * Repetition and groups become generated rules (right-recursive, so the matcher's stacks
 * do not grow with the repeat count). Character classes become alternatives of UTF-8
 * byte sequences (the classic range-splitting of UTF-8 automata), so the matcher never
 * decodes code points and can only ever produce valid UTF-8. */
#include <ctype.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "grammar_int.h"

typedef struct {
    char *name;
    int defined;
    m40_gelem *buf;      /* alternatives, each ended by GE_END */
    int32_t n, cap;
} prule;

typedef struct {
    const char *src, *p, *end;
    prule *rules;
    int32_t n_rules, cap_rules;
    uint32_t (*sets)[8];
    int32_t n_sets, cap_sets;
    int32_t *set_hash;   /* open addressing over sets, -1 empty */
    int32_t set_hash_cap;
    int32_t *name_hash;  /* open addressing over the user's rule names, -1 empty */
    int32_t name_hash_cap, n_named;
    int64_t total_el;
    char *err;
    size_t errlen;
    int failed;
} parser;

static int fail(parser *ps, const char *fmt, ...)
{
    if (ps->failed)
        return -1;
    ps->failed = 1;
    int line = 1;
    for (const char *q = ps->src; q < ps->p && q < ps->end; q++)
        line += *q == '\n';
    char msg[200];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (ps->err && ps->errlen)
        snprintf(ps->err, ps->errlen, "grammar: %s (line %d)", msg, line);
    return -1;
}

/* ---- rules and sets ---- */

static uint32_t name_hash(const char *s, size_t n)
{
    uint32_t h = 2166136261u;
    for (size_t i = 0; i < n; i++)
        h = (h ^ (uint8_t)s[i]) * 16777619u;
    return h;
}

/* Appends a rule named name[0..len); its index, or -1. */
static int32_t rule_append(parser *ps, const char *name, size_t len)
{
    if (ps->n_rules == ps->cap_rules) {
        int32_t cap = ps->cap_rules ? ps->cap_rules * 2 : 32;
        prule *r = realloc(ps->rules, (size_t)cap * sizeof *r);
        if (!r)
            return fail(ps, "out of memory");
        ps->rules = r;
        ps->cap_rules = cap;
    }
    prule *r = &ps->rules[ps->n_rules];
    memset(r, 0, sizeof *r);
    r->name = malloc(len + 1);
    if (!r->name)
        return fail(ps, "out of memory");
    memcpy(r->name, name, len);
    r->name[len] = 0;
    return ps->n_rules++;
}

/* The user's rule of that name, created on first mention (hashed: a hostile grammar with
 * many names must not cost a scan per reference). */
static int32_t rule_get(parser *ps, const char *name, size_t len)
{
    if ((ps->n_named + 1) * 2 > ps->name_hash_cap) {
        int32_t cap = ps->name_hash_cap ? ps->name_hash_cap * 2 : 64;
        int32_t *h = malloc(sizeof *h * (size_t)cap);
        if (!h)
            return fail(ps, "out of memory");
        memset(h, 0xff, sizeof *h * (size_t)cap);
        for (int32_t i = 0; i < ps->name_hash_cap; i++) {
            int32_t r = ps->name_hash ? ps->name_hash[i] : -1;
            if (r < 0)
                continue;
            uint32_t k = name_hash(ps->rules[r].name, strlen(ps->rules[r].name)) & (uint32_t)(cap - 1);
            while (h[k] >= 0)
                k = (k + 1) & (uint32_t)(cap - 1);
            h[k] = r;
        }
        free(ps->name_hash);
        ps->name_hash = h;
        ps->name_hash_cap = cap;
    }
    uint32_t k = name_hash(name, len) & (uint32_t)(ps->name_hash_cap - 1);
    for (; ps->name_hash[k] >= 0; k = (k + 1) & (uint32_t)(ps->name_hash_cap - 1)) {
        const char *n = ps->rules[ps->name_hash[k]].name;
        if (strlen(n) == len && memcmp(n, name, len) == 0)
            return ps->name_hash[k];
    }
    int32_t r = rule_append(ps, name, len);
    if (r >= 0) {
        ps->name_hash[k] = r;
        ps->n_named++;
    }
    return r;
}

/* A fresh rule named after its parent ("value#3": '#' is no name character, so it never
 * meets a user's rule). */
static int32_t rule_new(parser *ps, int32_t parent)
{
    char name[160];
    snprintf(name, sizeof name, "%.120s#%d", ps->rules[parent].name, ps->n_rules);
    int32_t r = rule_append(ps, name, strlen(name));
    if (r >= 0)
        ps->rules[r].defined = 1;
    return r;
}

static int emit(parser *ps, int32_t rule, int32_t type, int32_t v)
{
    prule *r = &ps->rules[rule];
    if (++ps->total_el > M40_GRAMMAR_MAX_ELEMS)
        return fail(ps, "grammar too large (more than %d elements)", M40_GRAMMAR_MAX_ELEMS);
    if (r->n == r->cap) {
        int32_t cap = r->cap ? r->cap * 2 : 16;
        m40_gelem *b = realloc(r->buf, (size_t)cap * sizeof *b);
        if (!b)
            return fail(ps, "out of memory");
        r->buf = b;
        r->cap = cap;
    }
    r->buf[r->n].type = type;
    r->buf[r->n].v = v;
    r->n++;
    return 0;
}

static uint32_t set_hash(const uint32_t *s)
{
    uint32_t h = 2166136261u;
    for (int i = 0; i < 8; i++)
        h = (h ^ s[i]) * 16777619u;
    return h;
}

/* Interns a byte set; returns its index. */
static int32_t set_add(parser *ps, const uint32_t *s)
{
    if (ps->n_sets * 2 >= ps->set_hash_cap) {
        int32_t cap = ps->set_hash_cap ? ps->set_hash_cap * 2 : 256;
        int32_t *h = malloc((size_t)cap * sizeof *h);
        if (!h)
            return fail(ps, "out of memory");
        memset(h, 0xff, (size_t)cap * sizeof *h);
        for (int32_t i = 0; i < ps->n_sets; i++) {
            uint32_t k = set_hash(ps->sets[i]) & (uint32_t)(cap - 1);
            while (h[k] >= 0)
                k = (k + 1) & (uint32_t)(cap - 1);
            h[k] = i;
        }
        free(ps->set_hash);
        ps->set_hash = h;
        ps->set_hash_cap = cap;
    }
    uint32_t k = set_hash(s) & (uint32_t)(ps->set_hash_cap - 1);
    while (ps->set_hash[k] >= 0) {
        if (memcmp(ps->sets[ps->set_hash[k]], s, 32) == 0)
            return ps->set_hash[k];
        k = (k + 1) & (uint32_t)(ps->set_hash_cap - 1);
    }
    if (ps->n_sets == ps->cap_sets) {
        int32_t cap = ps->cap_sets ? ps->cap_sets * 2 : 64;
        uint32_t(*n)[8] = realloc(ps->sets, (size_t)cap * sizeof *n);
        if (!n)
            return fail(ps, "out of memory");
        ps->sets = n;
        ps->cap_sets = cap;
    }
    memcpy(ps->sets[ps->n_sets], s, 32);
    ps->set_hash[k] = ps->n_sets;
    return ps->n_sets++;
}

static int emit_byte_range(parser *ps, int32_t rule, unsigned lo, unsigned hi)
{
    uint32_t s[8] = {0};
    for (unsigned b = lo; b <= hi; b++)
        s[b >> 5] |= 1u << (b & 31);
    int32_t i = set_add(ps, s);
    return i < 0 ? -1 : emit(ps, rule, GE_SET, i);
}

static int utf8_encode(uint32_t cp, uint8_t *o)
{
    if (cp < 0x80) { o[0] = (uint8_t)cp; return 1; }
    if (cp < 0x800) { o[0] = 0xC0 | (cp >> 6); o[1] = 0x80 | (cp & 63); return 2; }
    if (cp < 0x10000) {
        o[0] = 0xE0 | (cp >> 12); o[1] = 0x80 | ((cp >> 6) & 63); o[2] = 0x80 | (cp & 63);
        return 3;
    }
    o[0] = 0xF0 | (cp >> 18); o[1] = 0x80 | ((cp >> 12) & 63); o[2] = 0x80 | ((cp >> 6) & 63);
    o[3] = 0x80 | (cp & 63);
    return 4;
}

/* Emits [lo, hi] (no surrogates, one encoded length) as alternatives of byte-range
 * sequences into rule: split until every byte position ranges independently. */
static int utf8_range(parser *ps, int32_t rule, uint32_t lo, uint32_t hi)
{
    static const uint32_t bounds[] = {0x7F, 0x7FF, 0xFFFF};
    for (int i = 0; i < 3; i++)
        if (lo <= bounds[i] && hi > bounds[i])
            return utf8_range(ps, rule, lo, bounds[i]) || utf8_range(ps, rule, bounds[i] + 1, hi) ? -1 : 0;
    uint8_t a[4], b[4];
    int n = utf8_encode(lo, a);
    utf8_encode(hi, b);
    for (int i = 1; i < n; i++) {
        uint32_t m = (1u << (6 * i)) - 1;
        if ((lo & ~m) != (hi & ~m)) {
            if ((lo & m) != 0)
                return utf8_range(ps, rule, lo, lo | m) || utf8_range(ps, rule, (lo | m) + 1, hi) ? -1 : 0;
            if ((hi & m) != m)
                return utf8_range(ps, rule, lo, (hi & ~m) - 1) || utf8_range(ps, rule, hi & ~m, hi) ? -1 : 0;
        }
    }
    for (int i = 0; i < n; i++)
        if (emit_byte_range(ps, rule, a[i], b[i]))
            return -1;
    return emit(ps, rule, GE_END, 0);
}

typedef struct { uint32_t lo, hi; } cprange;

static int cpr_cmp(const void *x, const void *y)
{
    const cprange *a = x, *b = y;
    return a->lo < b->lo ? -1 : a->lo > b->lo;
}

/* A character class into `rule`'s current sequence: one SET element when it is ASCII only,
 * else a reference to a new rule whose alternatives are its UTF-8 byte sequences. */
static int emit_class(parser *ps, int32_t rule, cprange *r, int n, int negate)
{
    qsort(r, (size_t)n, sizeof *r, cpr_cmp);
    /* merge, then complement if negated, then drop the surrogates */
    cprange *m = malloc(sizeof *m * (size_t)(2 * n + 4));
    if (!m)
        return fail(ps, "out of memory");
    int k = 0;
    for (int i = 0; i < n; i++) {
        if (k && r[i].lo <= m[k - 1].hi + 1) {
            if (r[i].hi > m[k - 1].hi)
                m[k - 1].hi = r[i].hi;
        } else
            m[k++] = r[i];
    }
    if (negate) {
        cprange *c = malloc(sizeof *c * (size_t)(k + 2));
        if (!c) {
            free(m);
            return fail(ps, "out of memory");
        }
        int kc = 0;
        uint32_t next = 0;
        for (int i = 0; i < k; i++) {
            if (m[i].lo > next)
                c[kc++] = (cprange){next, m[i].lo - 1};
            next = m[i].hi + 1;
        }
        if (next <= 0x10FFFF)
            c[kc++] = (cprange){next, 0x10FFFF};
        memcpy(m, c, sizeof *c * (size_t)kc);
        k = kc;
        free(c);
    }
    uint32_t ascii[8] = {0};
    int any_ascii = 0, any_high = 0;
    for (int i = 0; i < k; i++) {
        for (uint32_t c = m[i].lo; c <= m[i].hi && c < 0x80; c++) {
            ascii[c >> 5] |= 1u << (c & 31);
            any_ascii = 1;
        }
        if (m[i].hi >= 0x80)
            any_high = 1;
    }
    int rc = 0;
    if (!any_high) {
        if (!any_ascii) {
            free(m);
            return fail(ps, "empty character class");
        }
        int32_t s = set_add(ps, ascii);
        rc = s < 0 ? -1 : emit(ps, rule, GE_SET, s);
        free(m);
        return rc;
    }
    int32_t sub = rule_new(ps, rule);
    if (sub < 0) {
        free(m);
        return -1;
    }
    if (any_ascii) {
        int32_t s = set_add(ps, ascii);
        if (s < 0 || emit(ps, sub, GE_SET, s) || emit(ps, sub, GE_END, 0))
            rc = -1;
    }
    for (int i = 0; i < k && !rc; i++) {
        uint32_t lo = m[i].lo < 0x80 ? 0x80 : m[i].lo, hi = m[i].hi;
        if (hi < 0x80)
            continue;
        if (lo <= 0xDFFF && hi >= 0xD800) { /* surrogates are not characters */
            if (lo < 0xD800 && utf8_range(ps, sub, lo, 0xD7FF))
                rc = -1;
            if (!rc && hi > 0xDFFF && utf8_range(ps, sub, 0xE000, hi))
                rc = -1;
        } else if (utf8_range(ps, sub, lo, hi))
            rc = -1;
    }
    free(m);
    return rc ? -1 : emit(ps, rule, GE_REF, sub);
}

/* ---- lexing ---- */

static void skip_space(parser *ps, int newline_ok)
{
    while (ps->p < ps->end) {
        char c = *ps->p;
        if (c == ' ' || c == '\t' || c == '\r' || (newline_ok && c == '\n'))
            ps->p++;
        else if (c == '#') {
            while (ps->p < ps->end && *ps->p != '\n')
                ps->p++;
        } else
            break;
    }
}

static int is_name_char(char c) { return isalnum((unsigned char)c) || c == '-' || c == '_'; }

static int hexval(char c)
{
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

/* Decodes one UTF-8 character of the source (validated up front). */
static uint32_t src_char(parser *ps)
{
    const uint8_t *s = (const uint8_t *)ps->p;
    uint32_t c = s[0];
    int n = c < 0x80 ? 1 : c < 0xE0 ? 2 : c < 0xF0 ? 3 : 4;
    if (n == 2) c &= 0x1F; else if (n == 3) c &= 0x0F; else if (n == 4) c &= 0x07;
    for (int i = 1; i < n; i++)
        c = (c << 6) | (s[i] & 63);
    ps->p += n;
    return c;
}

/* One character of a literal or class, escapes decoded. -1 on error. */
static int64_t parse_char(parser *ps)
{
    if (ps->p >= ps->end)
        return fail(ps, "unexpected end of grammar");
    if (*ps->p != '\\')
        return src_char(ps);
    ps->p++;
    if (ps->p >= ps->end)
        return fail(ps, "unexpected end after '\\'");
    char c = *ps->p++;
    int digits = c == 'x' ? 2 : c == 'u' ? 4 : c == 'U' ? 8 : 0;
    if (digits) {
        uint32_t v = 0;
        for (int i = 0; i < digits; i++) {
            int h = ps->p < ps->end ? hexval(*ps->p) : -1;
            if (h < 0)
                return fail(ps, "bad \\%c escape (needs %d hex digits)", c, digits);
            v = v * 16 + (uint32_t)h;
            ps->p++;
        }
        if (v > 0x10FFFF || (v >= 0xD800 && v <= 0xDFFF))
            return fail(ps, "escape \\%c names no character (U+%X)", c, v);
        return v;
    }
    switch (c) {
    case 'n': return '\n';
    case 'r': return '\r';
    case 't': return '\t';
    case '0': return 0;
    default:
        if (ispunct((unsigned char)c) || c == ' ')
            return (unsigned char)c;
        return fail(ps, "unknown escape '\\%c'", c);
    }
}

static int parse_alternatives(parser *ps, int32_t rule, int nested, int depth);

/* Moves buf[start..n) of rule into a new rule's first alternative and leaves a REF. */
static int32_t extract_item(parser *ps, int32_t rule, int32_t start, m40_gelem **item, int32_t *n_item)
{
    prule *r = &ps->rules[rule];
    *n_item = r->n - start;
    *item = malloc(sizeof **item * (size_t)(*n_item ? *n_item : 1));
    if (!*item)
        return fail(ps, "out of memory");
    if (*n_item) /* an empty rule has no buffer yet */
        memcpy(*item, r->buf + start, sizeof **item * (size_t)*n_item);
    r->n = start;
    return 0;
}

static int emit_item(parser *ps, int32_t rule, const m40_gelem *item, int32_t n)
{
    for (int32_t i = 0; i < n; i++)
        if (emit(ps, rule, item[i].type, item[i].v))
            return -1;
    return 0;
}

/* x{min,max} (max -1: unbounded) applied to buf[start..) of rule. */
static int repeat(parser *ps, int32_t rule, int32_t start, long min, long max)
{
    m40_gelem *item;
    int32_t n;
    if (extract_item(ps, rule, start, &item, &n))
        return -1;
    int rc = 0;
    for (long i = 0; i < min && !rc; i++)
        rc = emit_item(ps, rule, item, n);
    if (!rc && max < 0) { /* star ::= item star | () */
        int32_t star = rule_new(ps, rule);
        rc = star < 0 || emit_item(ps, star, item, n) || emit(ps, star, GE_REF, star) ||
             emit(ps, star, GE_END, 0) || emit(ps, star, GE_END, 0) || emit(ps, rule, GE_REF, star);
    } else if (!rc && max > min) { /* opt_k ::= item opt_{k-1} | () ; opt_1 ::= item | () */
        int32_t prev = -1;
        for (long k = 0; k < max - min && !rc; k++) {
            int32_t opt = rule_new(ps, rule);
            rc = opt < 0 || emit_item(ps, opt, item, n) || (prev >= 0 && emit(ps, opt, GE_REF, prev)) ||
                 emit(ps, opt, GE_END, 0) || emit(ps, opt, GE_END, 0);
            prev = opt;
        }
        if (!rc)
            rc = emit(ps, rule, GE_REF, prev);
    }
    free(item);
    return rc ? -1 : 0;
}

static int parse_number(parser *ps, long *v)
{
    if (ps->p >= ps->end || !isdigit((unsigned char)*ps->p))
        return fail(ps, "expected a number in {m,n}");
    long x = 0;
    while (ps->p < ps->end && isdigit((unsigned char)*ps->p)) {
        x = x * 10 + (*ps->p++ - '0');
        if (x > M40_GRAMMAR_MAX_REPEAT)
            return fail(ps, "repetition count above %d", M40_GRAMMAR_MAX_REPEAT);
    }
    *v = x;
    return 0;
}

static int parse_sequence(parser *ps, int32_t rule, int nested, int depth)
{
    int32_t last = -1; /* start of the last item in rule's buffer, for postfix operators */
    while (ps->p < ps->end && !ps->failed) {
        char c = *ps->p;
        int32_t here = ps->rules[rule].n;
        if (c == '"') {
            ps->p++;
            while (ps->p < ps->end && *ps->p != '"') {
                int64_t ch = parse_char(ps);
                if (ch < 0)
                    return -1;
                uint8_t u[4];
                int k = utf8_encode((uint32_t)ch, u);
                for (int i = 0; i < k; i++)
                    if (emit_byte_range(ps, rule, u[i], u[i]))
                        return -1;
            }
            if (ps->p >= ps->end)
                return fail(ps, "unterminated string literal");
            ps->p++;
            last = here;
        } else if (c == '[') {
            ps->p++;
            int negate = 0;
            if (ps->p < ps->end && *ps->p == '^') {
                negate = 1;
                ps->p++;
            }
            cprange *r = NULL;
            int n = 0, cap = 0;
            while (ps->p < ps->end && *ps->p != ']') {
                int64_t lo = parse_char(ps), hi;
                if (lo < 0) {
                    free(r);
                    return -1;
                }
                hi = lo;
                if (ps->p + 1 < ps->end && *ps->p == '-' && ps->p[1] != ']') {
                    ps->p++;
                    hi = parse_char(ps);
                    if (hi < 0) {
                        free(r);
                        return -1;
                    }
                    if (hi < lo) {
                        free(r);
                        return fail(ps, "character range out of order");
                    }
                }
                if (n == cap) {
                    cap = cap ? cap * 2 : 8;
                    cprange *nr = realloc(r, sizeof *r * (size_t)cap);
                    if (!nr) {
                        free(r);
                        return fail(ps, "out of memory");
                    }
                    r = nr;
                }
                r[n++] = (cprange){(uint32_t)lo, (uint32_t)hi};
            }
            if (ps->p >= ps->end) {
                free(r);
                return fail(ps, "unterminated character class");
            }
            ps->p++;
            if (!n && !negate) {
                free(r);
                return fail(ps, "empty character class");
            }
            int rc = emit_class(ps, rule, r ? r : (cprange[1]){{0, 0}}, n, negate);
            free(r);
            if (rc)
                return -1;
            last = here;
        } else if (c == '.') {
            ps->p++;
            cprange none = {0, 0};
            if (emit_class(ps, rule, &none, 0, 1))
                return -1;
            last = here;
        } else if (c == '(') {
            ps->p++;
            if (depth > 200)
                return fail(ps, "groups nested too deeply");
            int32_t sub = rule_new(ps, rule);
            if (sub < 0)
                return -1;
            skip_space(ps, 1);
            if (parse_alternatives(ps, sub, 1, depth + 1))
                return -1;
            if (ps->p >= ps->end || *ps->p != ')')
                return fail(ps, "expected ')'");
            ps->p++;
            if (emit(ps, rule, GE_REF, sub))
                return -1;
            last = here;
        } else if (is_name_char(c)) {
            const char *s = ps->p;
            while (ps->p < ps->end && is_name_char(*ps->p))
                ps->p++;
            /* "name ::=" starts the next rule: this sequence is over */
            const char *save = ps->p;
            skip_space(ps, 0);
            if (ps->end - ps->p >= 3 && memcmp(ps->p, "::=", 3) == 0) {
                ps->p = s;
                return 0;
            }
            ps->p = save;
            int32_t ref = rule_get(ps, s, (size_t)(ps->p - s));
            if (ref < 0 || emit(ps, rule, GE_REF, ref))
                return -1;
            last = here;
        } else if (c == '*' || c == '+' || c == '?' || c == '{') {
            if (last < 0)
                return fail(ps, "'%c' with nothing before it", c);
            ps->p++;
            long min = 0, max = -1;
            if (c == '+')
                min = 1;
            else if (c == '?')
                max = 1;
            else if (c == '{') {
                if (parse_number(ps, &min))
                    return -1;
                max = min;
                if (ps->p < ps->end && *ps->p == ',') {
                    ps->p++;
                    max = -1;
                    if (ps->p < ps->end && *ps->p != '}' && parse_number(ps, &max))
                        return -1;
                }
                if (ps->p >= ps->end || *ps->p != '}')
                    return fail(ps, "expected '}'");
                ps->p++;
                if (max >= 0 && max < min)
                    return fail(ps, "{m,n} with n < m");
            }
            if (repeat(ps, rule, last, min, max))
                return -1;
            last = -1; /* x** is an error, as in llama.cpp */
        } else if (c == '|' || c == ')' || c == '\n')
            break;
        else
            return fail(ps, "unexpected character '%c'", c);
        skip_space(ps, nested);
    }
    return ps->failed ? -1 : 0;
}

static int parse_alternatives(parser *ps, int32_t rule, int nested, int depth)
{
    for (;;) {
        if (parse_sequence(ps, rule, nested, depth) || emit(ps, rule, GE_END, 0))
            return -1;
        if (!nested) { /* a following line starting with '|' continues the rule */
            const char *save = ps->p;
            skip_space(ps, 1);
            if (ps->p < ps->end && *ps->p == '|') {
            } else {
                ps->p = save;
                return 0;
            }
        }
        if (ps->p >= ps->end || *ps->p != '|')
            return 0;
        ps->p++;
        skip_space(ps, 1);
    }
}

/* ---- checks and flattening ---- */

static int valid_utf8(const uint8_t *s, size_t n)
{
    for (size_t i = 0; i < n;) {
        uint8_t c = s[i];
        int k = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
        if (!k || i + (size_t)k > n)
            return 0;
        for (int j = 1; j < k; j++)
            if ((s[i + j] & 0xC0) != 0x80)
                return 0;
        i += (size_t)k;
    }
    return 1;
}

/* Left recursion (a rule reaching itself before consuming a byte, also through rules that
 * can match nothing) would make the matcher's closure loop forever: refused here. */
static int check_left_recursion(parser *ps, const m40_grammar *g)
{
    int32_t R = g->n_rules;
    uint8_t *nullable = calloc((size_t)R, 1), *color = calloc((size_t)R, 1);
    int32_t *stack = malloc(sizeof *stack * (size_t)R * 2 + 8);
    int rc = 0;
    if (!nullable || !color || !stack) {
        rc = fail(ps, "out of memory");
        goto out;
    }
    for (int changed = 1; changed;) {
        changed = 0;
        for (int32_t r = 0; r < R; r++) {
            if (nullable[r])
                continue;
            for (int32_t a = 0; a < g->rule_nalt[r] && !nullable[r]; a++) {
                int32_t p = g->alts[g->rule_alt0[r] + a];
                while (g->el[p].type == GE_REF && nullable[g->el[p].v])
                    p++;
                if (g->el[p].type == GE_END)
                    nullable[r] = changed = 1;
            }
        }
    }
    /* iterative DFS over "r may start with s" edges; color 1 on the path, 2 done */
    for (int32_t s0 = 0; s0 < R && !rc; s0++) {
        if (color[s0])
            continue;
        int32_t sp = 0;
        stack[sp++] = s0;
        stack[sp++] = 0; /* next alternative-element cursor, encoded as an index into el */
        color[s0] = 1;
        while (sp && !rc) {
            int32_t r = stack[sp - 2], *cur = &stack[sp - 1];
            /* enumerate left-edges of r: for each alternative, REFs up to the first
             * non-nullable element. cur counts edges already visited. */
            int32_t idx = 0, next = -1;
            for (int32_t a = 0; a < g->rule_nalt[r] && next < 0; a++) {
                for (int32_t p = g->alts[g->rule_alt0[r] + a]; g->el[p].type == GE_REF; p++) {
                    if (idx++ == *cur) {
                        next = g->el[p].v;
                        break;
                    }
                    if (!nullable[g->el[p].v])
                        break;
                }
            }
            if (next < 0) {
                color[r] = 2;
                sp -= 2;
                continue;
            }
            (*cur)++;
            if (color[next] == 1) {
                rc = fail(ps, "rule '%s' is left-recursive (it can reach itself before matching a "
                              "character, perhaps through a repetition of something that can be empty)",
                          ps->rules[next].name);
            } else if (!color[next]) {
                color[next] = 1;
                stack[sp++] = next;
                stack[sp++] = 0;
            }
        }
    }
out:
    free(nullable);
    free(color);
    free(stack);
    return rc;
}

m40_grammar *m40_grammar_parse(const char *src, size_t len, char *err, size_t errlen)
{
    parser ps = {.src = src, .p = src, .end = src + len, .err = err, .errlen = errlen};
    m40_grammar *g = NULL;
    if (err && errlen)
        err[0] = 0;
    if (!src || !valid_utf8((const uint8_t *)src, len)) {
        fail(&ps, "not valid UTF-8");
        return NULL;
    }
    skip_space(&ps, 1);
    while (ps.p < ps.end && !ps.failed) {
        const char *s = ps.p;
        while (ps.p < ps.end && is_name_char(*ps.p))
            ps.p++;
        if (ps.p == s) {
            fail(&ps, "expected a rule name");
            break;
        }
        int32_t r = rule_get(&ps, s, (size_t)(ps.p - s));
        if (r < 0)
            break;
        if (ps.rules[r].defined) {
            fail(&ps, "rule '%s' defined twice", ps.rules[r].name);
            break;
        }
        ps.rules[r].defined = 1;
        skip_space(&ps, 0);
        if (ps.end - ps.p < 3 || memcmp(ps.p, "::=", 3) != 0) {
            fail(&ps, "expected '::=' after '%s'", ps.rules[r].name);
            break;
        }
        ps.p += 3;
        skip_space(&ps, 1);
        if (parse_alternatives(&ps, r, 0, 0))
            break;
        skip_space(&ps, 1);
    }
    int32_t root = -1;
    for (int32_t i = 0; i < ps.n_rules && !ps.failed; i++) {
        if (!ps.rules[i].defined) {
            ps.p = ps.end;
            fail(&ps, "rule '%s' is used but not defined", ps.rules[i].name);
        }
        if (!strcmp(ps.rules[i].name, "root"))
            root = i;
    }
    if (!ps.failed && root < 0)
        fail(&ps, "no 'root' rule");
    if (ps.failed)
        goto done;

    g = calloc(1, sizeof *g);
    if (!g) {
        fail(&ps, "out of memory");
        goto done;
    }
    g->n_rules = ps.n_rules;
    g->root = root;
    int64_t n_el = 0, n_alts = 0;
    for (int32_t i = 0; i < ps.n_rules; i++) {
        n_el += ps.rules[i].n;
        for (int32_t j = 0; j < ps.rules[i].n; j++)
            n_alts += ps.rules[i].buf[j].type == GE_END;
    }
    g->el = malloc(sizeof *g->el * (size_t)(n_el + 1));
    g->alts = malloc(sizeof *g->alts * (size_t)(n_alts + 1));
    g->rule_alt0 = malloc(sizeof(int32_t) * (size_t)ps.n_rules);
    g->rule_nalt = malloc(sizeof(int32_t) * (size_t)ps.n_rules);
    if (!g->el || !g->alts || !g->rule_alt0 || !g->rule_nalt) {
        fail(&ps, "out of memory");
        goto done;
    }
    for (int32_t i = 0; i < ps.n_rules; i++) {
        prule *r = &ps.rules[i];
        g->rule_alt0[i] = g->n_alts;
        g->rule_nalt[i] = 0;
        int32_t start = g->n_el;
        for (int32_t j = 0; j < r->n; j++) {
            g->el[g->n_el++] = r->buf[j];
            if (r->buf[j].type == GE_END) {
                g->alts[g->n_alts++] = start;
                g->rule_nalt[i]++;
                start = g->n_el;
            }
        }
    }
    g->sets = ps.sets;
    g->n_sets = ps.n_sets;
    ps.sets = NULL;
    check_left_recursion(&ps, g);
done:
    for (int32_t i = 0; i < ps.n_rules; i++) {
        free(ps.rules[i].name);
        free(ps.rules[i].buf);
    }
    free(ps.rules);
    free(ps.sets);
    free(ps.set_hash);
    free(ps.name_hash);
    if (ps.failed) {
        m40_grammar_free(g);
        return NULL;
    }
    return g;
}

void m40_grammar_free(m40_grammar *g)
{
    if (!g)
        return;
    free(g->el);
    free(g->alts);
    free(g->rule_alt0);
    free(g->rule_nalt);
    free(g->sets);
    free(g);
}
