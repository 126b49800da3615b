/* Tests, methods (str/dict) and global functions of the interpreter, plus the string
 * helpers the filters (jinja_filters.c) share, each matching what jinja2 3.1 (and
 * Python underneath it) does for the same call. */
#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "jinja_int.h"

/* ------------------------------------------------------------------ helpers */


/* Argument by position (0-based, after the piped value) or keyword name. */
int jb_arg(const jb_args *a, size_t pos, const char *name, m40_jvalue *out)
{
    if (pos < a->nargs) {
        *out = a->args[pos];
        return 1;
    }
    for (size_t i = 0; i < a->nkw; i++)
        if (name && !strcmp(a->kwnames[i], name)) {
            *out = a->kwvals[i];
            return 1;
        }
    return 0;
}

int jb_oom(jrender *r) { return jr_fail(r, 0, "template rendering exceeded its memory limit"); }

/* Python str(v) as an arena string. */
int jb_str(jrender *r, m40_jvalue v, m40_jvalue *out)
{
    if (v.type == M40_JV_STRING) {
        *out = v;
        return 0;
    }
    jbuf b;
    jr_buf_init(r, &b);
    jv_write_str(&b, v);
    return jr_buf_value(r, &b, out);
}

int jb_buf_result(jrender *r, jbuf *b, m40_jvalue *out)
{
    return jr_buf_value(r, b, out);
}

int jb_need_str(jrender *r, int line, m40_jvalue v, const char *what)
{
    if (v.type == M40_JV_STRING)
        return 0;
    return jr_fail(r, line, "%s: expected a string, got %s", what, jv_type_name(v));
}

int jb_need_int(jrender *r, int line, m40_jvalue v, const char *what, int64_t *out)
{
    if (v.type == M40_JV_INT || v.type == M40_JV_BOOL) {
        *out = v.type == M40_JV_INT ? v.u.i : v.u.b;
        return 0;
    }
    return jr_fail(r, line, "%s: expected an integer, got %s", what, jv_type_name(v));
}

/* Simple (one-to-one) case mapping for the scripts of European languages: ASCII,
 * Latin-1, Latin Extended-A and Additional, Greek, Cyrillic, Armenian, fullwidth
 * Latin. Other code points are caseless here. */
static uint32_t uc_lower(uint32_t c)
{
    if ((c >= 'A' && c <= 'Z') || (c >= 0xC0 && c <= 0xDE && c != 0xD7) || (c >= 0x391 && c <= 0x3AB && c != 0x3A2) ||
        (c >= 0x410 && c <= 0x42F) || (c >= 0xFF21 && c <= 0xFF3A))
        return c + 0x20;
    if (c >= 0x400 && c <= 0x40F)
        return c + 0x50;
    if (c >= 0x531 && c <= 0x556)
        return c + 0x30;
    if (c == 0x386) return 0x3AC;
    if (c >= 0x388 && c <= 0x38A) return c + 37;
    if (c == 0x38C) return 0x3CC;
    if (c == 0x38E || c == 0x38F) return c + 63;
    if (c == 0x178) return 0xFF;
    if (((c >= 0x100 && c <= 0x12F) || (c >= 0x132 && c <= 0x137) || (c >= 0x14A && c <= 0x177) ||
         (c >= 0x460 && c <= 0x481) || (c >= 0x48A && c <= 0x4BF) || (c >= 0x1E00 && c <= 0x1E95) ||
         (c >= 0x1EA0 && c <= 0x1EFF)) && !(c & 1))
        return c + 1;
    if (((c >= 0x139 && c <= 0x148) || (c >= 0x179 && c <= 0x17E)) && (c & 1))
        return c + 1;
    return c;
}

static uint32_t uc_upper(uint32_t c)
{
    if ((c >= 'a' && c <= 'z') || (c >= 0xE0 && c <= 0xFE && c != 0xF7) || (c >= 0x3B1 && c <= 0x3CB && c != 0x3C2) ||
        (c >= 0x430 && c <= 0x44F) || (c >= 0xFF41 && c <= 0xFF5A))
        return c - 0x20;
    if (c >= 0x450 && c <= 0x45F)
        return c - 0x50;
    if (c >= 0x561 && c <= 0x586)
        return c - 0x30;
    if (c == 0x3C2) return 0x3A3; /* final sigma */
    if (c == 0x3AC) return 0x386;
    if (c >= 0x3AD && c <= 0x3AF) return c - 37;
    if (c == 0x3CC) return 0x38C;
    if (c == 0x3CD || c == 0x3CE) return c - 63;
    if (c == 0xFF) return 0x178;
    if (c == 0xB5) return 0x39C;
    if (c == 0x131) return 'I';
    if (c == 0x17F) return 'S';
    if (((c >= 0x101 && c <= 0x12F) || (c >= 0x133 && c <= 0x137) || (c >= 0x14B && c <= 0x177) ||
         (c >= 0x461 && c <= 0x481) || (c >= 0x48B && c <= 0x4BF) || (c >= 0x1E01 && c <= 0x1E95) ||
         (c >= 0x1EA1 && c <= 0x1EFF)) && (c & 1))
        return c - 1;
    if (((c >= 0x13A && c <= 0x148) || (c >= 0x17A && c <= 0x17E)) && !(c & 1))
        return c - 1;
    return c;
}

static int uc_cased(uint32_t c) { return uc_lower(c) != c || uc_upper(c) != c || c == 0xDF || c == 0x130; }

/* Python's full mappings for the two letters whose case changes their length. */
static void put_upper(jbuf *b, uint32_t c)
{
    if (c == 0xDF)
        jbuf_puts(b, "SS");
    else
        jutf8_put(b, uc_upper(c));
}

static void put_lower(jbuf *b, uint32_t c)
{
    if (c == 0x130) {
        jbuf_putc(b, 'i');
        jutf8_put(b, 0x307);
    } else {
        jutf8_put(b, uc_lower(c));
    }
}


/* CASE_PYTITLE is str.title(): a cased letter after an uncased character starts a
 * word; CASE_JTITLE is jinja's title filter: words start after runs of -,
 * whitespace, ( { [ <. */
int jb_change_case(jrender *r, const m40_jstr *s, enum casemode mode, m40_jvalue *out)
{
    jbuf b;
    jr_buf_init(r, &b);
    int word_start = 1;
    for (size_t i = 0; i < s->len;) {
        uint32_t c = jutf8_next(s->s, s->len, &i);
        int up = 0;
        switch (mode) {
        case CASE_UPPER:
            up = 1;
            break;
        case CASE_LOWER:
            break;
        case CASE_CAPITALIZE:
            up = word_start;
            word_start = 0;
            break;
        case CASE_PYTITLE:
            up = word_start;
            word_start = !uc_cased(c);
            break;
        case CASE_JTITLE:
            if (c == '-' || c == '(' || c == '{' || c == '[' || c == '<' || jpy_isspace(c)) {
                word_start = 1;
                jutf8_put(&b, c);
                continue;
            }
            up = word_start;
            word_start = 0;
            break;
        }
        if (up)
            put_upper(&b, c);
        else
            put_lower(&b, c);
    }
    return jb_buf_result(r, &b, out);
}

/* Python strip family: which 1=left 2=right 3=both; chars NULL = whitespace. */
int jb_strip(jrender *r, const m40_jstr *s, const m40_jstr *chars, int which, m40_jvalue *out)
{
    size_t start = 0, end = s->len;
    if (which & 1) {
        while (start < end) {
            size_t k = start;
            uint32_t c = jutf8_next(s->s, end, &k);
            int in;
            if (chars) {
                in = 0;
                for (size_t j = 0; j < chars->len && !in;)
                    in = jutf8_next(chars->s, chars->len, &j) == c;
            } else {
                in = jpy_isspace(c);
            }
            if (!in)
                break;
            start = k;
        }
    }
    if (which & 2) {
        size_t keep = start;
        for (size_t i = start; i < end;) {
            uint32_t c = jutf8_next(s->s, end, &i);
            int in;
            if (chars) {
                in = 0;
                for (size_t j = 0; j < chars->len && !in;)
                    in = jutf8_next(chars->s, chars->len, &j) == c;
            } else {
                in = jpy_isspace(c);
            }
            if (!in)
                keep = i;
        }
        end = keep;
    }
    if (m40_jv_str(jr_arena(r), s->s + start, end - start, out))
        return jb_oom(r);
    return 0;
}

int jb_replace(jrender *r, const m40_jstr *s, const m40_jstr *old, const m40_jstr *new_,
                       int64_t count, m40_jvalue *out)
{
    jbuf b;
    jr_buf_init(r, &b);
    if (old->len == 0) { /* Python inserts `new` at every code point boundary */
        int64_t done = 0;
        size_t i = 0;
        for (;;) {
            if (count < 0 || done < count) {
                jbuf_put(&b, new_->s, new_->len);
                done++;
            }
            if (i >= s->len)
                break;
            size_t a = i;
            jutf8_next(s->s, s->len, &i);
            jbuf_put(&b, s->s + a, i - a);
        }
        return jb_buf_result(r, &b, out);
    }
    size_t i = 0;
    int64_t done = 0;
    while (i < s->len) {
        const char *hit = (count < 0 || done < count) ? memmem(s->s + i, s->len - i, old->s, old->len) : NULL;
        if (!hit) {
            jbuf_put(&b, s->s + i, s->len - i);
            break;
        }
        jbuf_put(&b, s->s + i, (size_t)(hit - (s->s + i)));
        jbuf_put(&b, new_->s, new_->len);
        i = (size_t)(hit - s->s) + old->len;
        done++;
    }
    return jb_buf_result(r, &b, out);
}

static int push_str(jrender *r, m40_jvalue list, const char *s, size_t n)
{
    m40_jvalue v;
    if (m40_jv_str(jr_arena(r), s, n, &v) || m40_jv_list_push(jr_arena(r), list, v))
        return jb_oom(r);
    return 0;
}

/* str.split(sep=None, maxsplit=-1) */
static int str_split(jrender *r, int line, const m40_jstr *s, m40_jvalue sep, int64_t maxsplit, m40_jvalue *out)
{
    if (m40_jv_list(jr_arena(r), out))
        return jb_oom(r);
    if (sep.type == M40_JV_NONE || sep.type == M40_JV_UNDEFINED) {
        size_t i = 0;
        int64_t splits = 0;
        for (;;) {
            while (i < s->len) { /* skip whitespace */
                size_t k = i;
                if (!jpy_isspace(jutf8_next(s->s, s->len, &k)))
                    break;
                i = k;
            }
            if (i >= s->len)
                break;
            if (maxsplit >= 0 && splits >= maxsplit) {
                size_t end = s->len; /* the rest, minus trailing whitespace */
                size_t keep = i;
                for (size_t k = i; k < end;) {
                    if (!jpy_isspace(jutf8_next(s->s, end, &k)))
                        keep = k;
                }
                return push_str(r, *out, s->s + i, keep - i);
            }
            size_t start = i;
            while (i < s->len) {
                size_t k = i;
                if (jpy_isspace(jutf8_next(s->s, s->len, &k)))
                    break;
                i = k;
            }
            if (push_str(r, *out, s->s + start, i - start))
                return -1;
            splits++;
        }
        return 0;
    }
    if (jb_need_str(r, line, sep, "split"))
        return -1;
    if (sep.u.s->len == 0)
        return jr_fail(r, line, "empty separator");
    size_t i = 0;
    int64_t splits = 0;
    for (;;) {
        const char *hit = (maxsplit < 0 || splits < maxsplit) ? memmem(s->s + i, s->len - i, sep.u.s->s, sep.u.s->len) : NULL;
        if (!hit)
            return push_str(r, *out, s->s + i, s->len - i);
        if (push_str(r, *out, s->s + i, (size_t)(hit - (s->s + i))))
            return -1;
        i = (size_t)(hit - s->s) + sep.u.s->len;
        splits++;
    }
}

static int fix_affix(jrender *r, int line, const m40_jstr *s, m40_jvalue arg, int ends, int *res)
{
    *res = 0;
    if (arg.type == M40_JV_LIST && arg.u.l->kind == JL_TUPLE) {
        for (size_t i = 0; i < arg.u.l->n && !*res; i++)
            if (fix_affix(r, line, s, arg.u.l->v[i], ends, res))
                return -1;
        return 0;
    }
    if (arg.type != M40_JV_STRING)
        return jr_fail(r, line, "%s arg must be str or a tuple of str, not %s", ends ? "endswith" : "startswith",
                       jv_type_name(arg));
    size_t n = arg.u.s->len;
    *res = n <= s->len && memcmp(ends ? s->s + s->len - n : s->s, arg.u.s->s, n) == 0;
    return 0;
}

/* Python int(str) / float(str) with surrounding whitespace, as do_int/do_float. */
int jb_parse_int(const char *s, int64_t *out)
{
    while (*s && isspace((unsigned char)*s))
        s++;
    const char *p = s;
    if (*p == '+' || *p == '-')
        p++;
    if (!isdigit((unsigned char)*p))
        return 0;
    errno = 0;
    char *end;
    long long v = strtoll(s, &end, 10);
    if (errno)
        return 0;
    while (*end && isspace((unsigned char)*end))
        end++;
    if (*end)
        return 0;
    *out = v;
    return 1;
}

int jb_parse_float(const char *s, double *out)
{
    while (*s && isspace((unsigned char)*s))
        s++;
    if (!*s)
        return 0;
    /* strtod also takes hex floats, which Python's float() does not */
    const char *p = s + (*s == '+' || *s == '-');
    if (p[0] == '0' && (p[1] == 'x' || p[1] == 'X'))
        return 0;
    char *end;
    double v = strtod(s, &end);
    if (end == s)
        return 0;
    while (*end && isspace((unsigned char)*end))
        end++;
    if (*end)
        return 0;
    *out = v;
    return 1;
}

/* Item path "a.b.0" as jinja's make_attrgetter: getitem for each part. */
int jb_attr_path(jrender *r, int line, m40_jvalue obj, m40_jvalue attr, m40_jvalue *out)
{
    if (attr.type != M40_JV_STRING) {
        return jr_getitem(r, line, obj, attr, out);
    }
    const char *s = attr.u.s->s;
    *out = obj;
    for (;;) {
        const char *dot = strchr(s, '.');
        size_t n = dot ? (size_t)(dot - s) : strlen(s);
        m40_jvalue key;
        int64_t iv;
        char tmp[32];
        if (n > 0 && n < sizeof tmp) {
            memcpy(tmp, s, n);
            tmp[n] = 0;
        }
        if (n > 0 && n < 20 && strspn(s, "0123456789") >= n && jb_parse_int(tmp, &iv))
            key = m40_jv_int(iv);
        else if (m40_jv_str(jr_arena(r), s, n, &key))
            return jb_oom(r);
        if (jr_getitem(r, line, *out, key, out))
            return -1;
        if (!dot)
            return 0;
        s = dot + 1;
    }
}

int jb_list_copy(jrender *r, m40_jvalue src, m40_jvalue *out)
{
    if (m40_jv_list(jr_arena(r), out))
        return jb_oom(r);
    for (size_t i = 0; i < src.u.l->n; i++)
        if (m40_jv_list_push(jr_arena(r), *out, src.u.l->v[i]))
            return jb_oom(r);
    return 0;
}

/* ------------------------------------------------------------------ tests */

int jb_test(jrender *r, int line, const char *name, m40_jvalue v, m40_jvalue *args, size_t nargs, int *res)
{
    m40_jtype t = v.type;
    m40_jvalue a = nargs ? args[0] : m40_jv_undefined();
#define IS(nm) (!strcmp(name, nm))
    if (IS("defined")) *res = t != M40_JV_UNDEFINED;
    else if (IS("undefined")) *res = t == M40_JV_UNDEFINED;
    else if (IS("none")) *res = t == M40_JV_NONE;
    else if (IS("boolean")) *res = t == M40_JV_BOOL;
    else if (IS("true")) *res = t == M40_JV_BOOL && v.u.b;
    else if (IS("false")) *res = t == M40_JV_BOOL && !v.u.b;
    else if (IS("integer")) *res = t == M40_JV_INT;
    else if (IS("float")) *res = t == M40_JV_FLOAT;
    else if (IS("number")) *res = t == M40_JV_INT || t == M40_JV_FLOAT || t == M40_JV_BOOL;
    else if (IS("string")) *res = t == M40_JV_STRING;
    else if (IS("mapping")) *res = t == M40_JV_DICT;
    else if (IS("iterable")) *res = t == M40_JV_STRING || t == M40_JV_LIST || t == M40_JV_DICT || t == M40_JV_UNDEFINED;
    else if (IS("sequence")) *res = t == M40_JV_STRING || (t == M40_JV_LIST && jl_is_seq(v.u.l)) || t == M40_JV_DICT || t == M40_JV_UNDEFINED;
    else if (IS("callable")) *res = t == M40_JV_CALLABLE;
    else if (IS("escaped")) *res = 0;
    else if (IS("sameas")) {
        if (!nargs)
            return jr_fail(r, line, "test 'sameas' needs an argument");
        if (t != a.type) *res = 0;
        else if (t == M40_JV_STRING || t == M40_JV_LIST || t == M40_JV_DICT || t == M40_JV_NAMESPACE || t == M40_JV_CALLABLE)
            *res = v.u.s == a.u.s;
        else *res = jv_equal(v, a);
    } else if (IS("lower") || IS("upper")) {
        m40_jvalue s;
        if (jb_str(r, v, &s))
            return -1;
        int cased = 0, ok = 1;
        for (size_t i = 0; i < s.u.s->len;) {
            uint32_t c = jutf8_next(s.u.s->s, s.u.s->len, &i);
            if (uc_lower(c) != c) { cased = 1; if (IS("lower")) ok = 0; }
            if (uc_upper(c) != c) { cased = 1; if (IS("upper")) ok = 0; }
        }
        *res = cased && ok;
    } else if (IS("odd") || IS("even") || IS("divisibleby")) {
        int64_t x, d = 2;
        if (jb_need_int(r, line, v, name, &x))
            return -1;
        if (IS("divisibleby")) {
            if (!nargs || jb_need_int(r, line, a, name, &d))
                return nargs ? -1 : jr_fail(r, line, "test 'divisibleby' needs an argument");
            if (d == 0)
                return jr_fail(r, line, "integer division or modulo by zero");
            *res = x % d == 0;
        } else {
            int odd = (x % 2) != 0;
            *res = IS("odd") ? odd : !odd;
        }
    } else if (IS("eq") || IS("equalto") || IS("==") || IS("ne") || IS("!=")) {
        if (!nargs)
            return jr_fail(r, line, "test '%s' needs an argument", name);
        *res = jv_equal(v, a);
        if (IS("ne") || IS("!="))
            *res = !*res;
    } else if (IS("lt") || IS("lessthan") || IS("<") || IS("le") || IS("<=") || IS("gt") || IS("greaterthan") ||
               IS(">") || IS("ge") || IS(">=")) {
        if (!nargs)
            return jr_fail(r, line, "test '%s' needs an argument", name);
        if (!jv_is_num(v) || !jv_is_num(a)) {
            if (!(v.type == M40_JV_STRING && a.type == M40_JV_STRING))
                return jr_fail(r, line, "test '%s': cannot compare %s and %s", name, jv_type_name(v), jv_type_name(a));
            size_t n = v.u.s->len < a.u.s->len ? v.u.s->len : a.u.s->len;
            int c = memcmp(v.u.s->s, a.u.s->s, n);
            double cmp = c ? c : (double)v.u.s->len - (double)a.u.s->len;
            *res = (IS("lt") || IS("lessthan") || IS("<")) ? cmp < 0 : (IS("le") || IS("<=")) ? cmp <= 0
                 : (IS("gt") || IS("greaterthan") || IS(">")) ? cmp > 0 : cmp >= 0;
        } else {
            double x = jv_num(v), y = jv_num(a);
            *res = (IS("lt") || IS("lessthan") || IS("<")) ? x < y : (IS("le") || IS("<=")) ? x <= y
                 : (IS("gt") || IS("greaterthan") || IS(">")) ? x > y : x >= y;
        }
    } else if (IS("in")) {
        if (!nargs)
            return jr_fail(r, line, "test 'in' needs an argument");
        if (a.type == M40_JV_STRING) {
            if (v.type != M40_JV_STRING)
                return jr_fail(r, line, "'in <string>' requires string as left operand");
            *res = memmem(a.u.s->s, a.u.s->len, v.u.s->s, v.u.s->len) != NULL || v.u.s->len == 0;
        } else if (a.type == M40_JV_LIST) {
            *res = 0;
            for (size_t i = 0; i < a.u.l->n && !*res; i++)
                *res = jv_equal(a.u.l->v[i], v);
        } else if (a.type == M40_JV_DICT) {
            *res = jv_dict_has(a, v);
        } else if (a.type == M40_JV_UNDEFINED) {
            *res = 0;
        } else {
            return jr_fail(r, line, "argument of type '%s' is not iterable", jv_type_name(a));
        }
    } else {
        return jr_fail(r, line, "no test named '%s'", name);
    }
#undef IS
    return 0;
}

/* ------------------------------------------------------------------ methods */

enum {
    M_STRIP, M_LSTRIP, M_RSTRIP, M_SPLIT, M_STARTSWITH, M_ENDSWITH, M_UPPER, M_LOWER, M_TITLE,
    M_CAPITALIZE, M_REPLACE, M_FIND, M_JOIN, M_ITEMS, M_KEYS, M_VALUES, M_GET,
};

static const char *str_methods[] = {[M_STRIP] = "strip", [M_LSTRIP] = "lstrip", [M_RSTRIP] = "rstrip",
                                    [M_SPLIT] = "split", [M_STARTSWITH] = "startswith", [M_ENDSWITH] = "endswith",
                                    [M_UPPER] = "upper", [M_LOWER] = "lower", [M_TITLE] = "title",
                                    [M_CAPITALIZE] = "capitalize", [M_REPLACE] = "replace", [M_FIND] = "find",
                                    [M_JOIN] = "join"};

int jb_method_id(m40_jvalue obj, const char *name)
{
    if (obj.type == M40_JV_STRING) {
        for (int i = M_STRIP; i <= M_JOIN; i++)
            if (!strcmp(str_methods[i], name))
                return i;
        return -1;
    }
    if (obj.type == M40_JV_DICT) {
        if (!strcmp(name, "items")) return M_ITEMS;
        if (!strcmp(name, "keys")) return M_KEYS;
        if (!strcmp(name, "values")) return M_VALUES;
        if (!strcmp(name, "get")) return M_GET;
        static const char *mutating[] = {"pop", "popitem", "setdefault", "update", "clear", NULL};
        for (int i = 0; mutating[i]; i++)
            if (!strcmp(name, mutating[i]))
                return -2;
        return -1;
    }
    if (obj.type == M40_JV_LIST) {
        static const char *mutating[] = {"append", "extend", "insert", "pop", "remove", "clear", "sort", "reverse", NULL};
        for (int i = 0; mutating[i]; i++)
            if (!strcmp(name, mutating[i]))
                return -2;
    }
    return -1;
}

int jb_call_method(jrender *r, int line, const m40_jcallable *fn, m40_jvalue *args, size_t nargs,
                   const char **kwnames, m40_jvalue *kwvals, size_t nkw, m40_jvalue *out)
{
    jb_args a = {args, nargs, kwnames, kwvals, nkw};
    m40_jvalue self = fn->self, x, y;
    m40_jarena *ar = jr_arena(r);
    switch (fn->id) {
    case M_STRIP:
    case M_LSTRIP:
    case M_RSTRIP: {
        const m40_jstr *chars = NULL;
        if (jb_arg(&a, 0, "chars", &x) && x.type != M40_JV_NONE) {
            if (jb_need_str(r, line, x, fn->name))
                return -1;
            chars = x.u.s;
        }
        return jb_strip(r, self.u.s, chars, fn->id == M_STRIP ? 3 : fn->id == M_LSTRIP ? 1 : 2, out);
    }
    case M_SPLIT: {
        int64_t maxsplit = -1;
        if (!jb_arg(&a, 0, "sep", &x))
            x = m40_jv_none();
        if (jb_arg(&a, 1, "maxsplit", &y) && jb_need_int(r, line, y, "maxsplit", &maxsplit))
            return -1;
        return str_split(r, line, self.u.s, x, maxsplit, out);
    }
    case M_STARTSWITH:
    case M_ENDSWITH: {
        int res;
        if (!nargs)
            return jr_fail(r, line, "%s needs an argument", fn->name);
        if (fix_affix(r, line, self.u.s, args[0], fn->id == M_ENDSWITH, &res))
            return -1;
        *out = m40_jv_bool(res);
        return 0;
    }
    case M_UPPER: return jb_change_case(r, self.u.s, CASE_UPPER, out);
    case M_LOWER: return jb_change_case(r, self.u.s, CASE_LOWER, out);
    case M_TITLE: return jb_change_case(r, self.u.s, CASE_PYTITLE, out);
    case M_CAPITALIZE: return jb_change_case(r, self.u.s, CASE_CAPITALIZE, out);
    case M_REPLACE: {
        int64_t count = -1;
        if (nargs < 2 || jb_need_str(r, line, args[0], "replace") || jb_need_str(r, line, args[1], "replace"))
            return nargs < 2 ? jr_fail(r, line, "replace needs old and new") : -1;
        if (jb_arg(&a, 2, "count", &x) && jb_need_int(r, line, x, "replace count", &count))
            return -1;
        return jb_replace(r, self.u.s, args[0].u.s, args[1].u.s, count, out);
    }
    case M_FIND: {
        if (!nargs || jb_need_str(r, line, args[0], "find"))
            return nargs ? -1 : jr_fail(r, line, "find needs an argument");
        const char *hit = memmem(self.u.s->s, self.u.s->len, args[0].u.s->s, args[0].u.s->len);
        *out = m40_jv_int(hit ? (int64_t)jutf8_count(self.u.s->s, (size_t)(hit - self.u.s->s)) : -1);
        return 0;
    }
    case M_JOIN: {
        m40_jvalue items;
        if (!nargs || jb_to_list(r, line, args[0], &items))
            return nargs ? -1 : jr_fail(r, line, "join needs an argument");
        jbuf b;
        jr_buf_init(r, &b);
        for (size_t i = 0; i < items.u.l->n; i++) {
            if (items.u.l->v[i].type != M40_JV_STRING) {
                jbuf_free(&b);
                return jr_fail(r, line, "sequence item %zu: expected str instance, %s found", i,
                               jv_type_name(items.u.l->v[i]));
            }
            if (i)
                jbuf_put(&b, self.u.s->s, self.u.s->len);
            jbuf_put(&b, items.u.l->v[i].u.s->s, items.u.l->v[i].u.s->len);
        }
        return jb_buf_result(r, &b, out);
    }
    case M_ITEMS:
    case M_KEYS:
    case M_VALUES: {
        const m40_jdict *d = self.u.d;
        if (m40_jv_list(ar, out))
            return jb_oom(r);
        out->u.l->kind = fn->id == M_ITEMS ? JL_ITEMS : fn->id == M_KEYS ? JL_KEYS : JL_VALUES;
        for (size_t i = 0; i < d->n; i++) {
            m40_jvalue t = fn->id == M_KEYS ? d->k[i] : d->v[i];
            if (fn->id == M_ITEMS && jv_tuple2(ar, d->k[i], d->v[i], &t))
                return jb_oom(r);
            if (m40_jv_list_push(ar, *out, t))
                return jb_oom(r);
        }
        return 0;
    }
    case M_GET: {
        int found;
        if (!nargs)
            return jr_fail(r, line, "get expected at least 1 argument");
        if (args[0].type == M40_JV_LIST || args[0].type == M40_JV_DICT)
            return jr_fail(r, line, "unhashable type: '%s'", jv_type_name(args[0]));
        *out = jv_dict_get(self, args[0], &found);
        if (!found)
            *out = nargs > 1 ? args[1] : m40_jv_none();
        return 0;
    }
    }
    return jr_fail(r, line, "unknown method '%s'", fn->name);
}

/* ------------------------------------------------------------------ globals */

enum { G_RANGE, G_NAMESPACE, G_DICT, G_RAISE, G_STRFTIME };

int jb_global_id(const char *name)
{
    if (!strcmp(name, "range")) return G_RANGE;
    if (!strcmp(name, "namespace")) return G_NAMESPACE;
    if (!strcmp(name, "dict")) return G_DICT;
    if (!strcmp(name, "raise_exception")) return G_RAISE;
    if (!strcmp(name, "strftime_now")) return G_STRFTIME;
    return -1;
}

int jb_call_global(jrender *r, int line, const m40_jcallable *fn, m40_jvalue *args, size_t nargs,
                   const char **kwnames, m40_jvalue *kwvals, size_t nkw, m40_jvalue *out)
{
    m40_jarena *ar = jr_arena(r);
    switch (fn->id) {
    case G_RANGE: {
        int64_t v[3] = {0, 0, 1};
        if (nargs < 1 || nargs > 3 || nkw)
            return jr_fail(r, line, "range expected 1 to 3 integer arguments");
        for (size_t i = 0; i < nargs; i++)
            if (jb_need_int(r, line, args[i], "range", &v[i]))
                return -1;
        int64_t start = nargs == 1 ? 0 : v[0], stop = nargs == 1 ? v[0] : v[1], step = nargs == 3 ? v[2] : 1;
        if (step == 0)
            return jr_fail(r, line, "range() arg 3 must not be zero");
        if (m40_jv_list(ar, out))
            return jb_oom(r);
        for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) {
            if (jr_step(r, line))
                return -1;
            if (m40_jv_list_push(ar, *out, m40_jv_int(i)))
                return jb_oom(r);
            if ((step > 0 && i > INT64_MAX - step) || (step < 0 && i < INT64_MIN - step))
                break;
        }
        return 0;
    }
    case G_NAMESPACE:
    case G_DICT: {
        if (m40_jv_dict(ar, out))
            return jb_oom(r);
        if (nargs > 1)
            return jr_fail(r, line, "%s expected at most 1 positional argument", fn->name);
        if (nargs == 1) {
            if (args[0].type != M40_JV_DICT)
                return jr_fail(r, line, "%s: positional argument must be a mapping", fn->name);
            for (size_t i = 0; i < args[0].u.d->n; i++)
                if (m40_jv_dict_set(ar, *out, args[0].u.d->k[i], args[0].u.d->v[i]))
                    return jb_oom(r);
        }
        for (size_t i = 0; i < nkw; i++)
            if (m40_jv_dict_set_cstr(ar, *out, kwnames[i], kwvals[i]))
                return jb_oom(r);
        if (fn->id == G_NAMESPACE)
            out->type = M40_JV_NAMESPACE;
        return 0;
    }
    case G_RAISE: {
        m40_jvalue msg = nargs ? args[0] : m40_jv_undefined();
        if (jb_str(r, msg, &msg))
            return -1;
        return jr_fail(r, 0, "%s", msg.u.s->s);
    }
    case G_STRFTIME: {
        if (nargs != 1 || jb_need_str(r, line, args[0], "strftime_now"))
            return nargs != 1 ? jr_fail(r, line, "strftime_now expects one format string") : -1;
        time_t now = jr_now(r);
        struct tm tm;
        if (now)
            gmtime_r(&now, &tm);
        else {
            now = time(NULL);
            localtime_r(&now, &tm);
        }
        char buf[512];
        size_t n = args[0].u.s->len ? strftime(buf, sizeof buf, args[0].u.s->s, &tm) : 0;
        if (n == 0 && args[0].u.s->len)
            return jr_fail(r, line, "strftime_now: format produced nothing or too much");
        return m40_jv_str(ar, buf, n, out) ? jb_oom(r) : 0;
    }
    }
    return jr_fail(r, line, "unknown function '%s'", fn->name);
}
