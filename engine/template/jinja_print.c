/* Python-compatible text of values: str(), repr() (floats in shortest round-trip
 * form, strings quoted as Python quotes them), json.dumps() as HF's tojson calls it,
 * markupsafe escaping; and JSON (jansson) -> values. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "jinja_int.h"

/* Python's str.isprintable(), approximated by the Unicode ranges that show up in
 * practice (controls, format characters, separators other than space, private use). */
static int py_isprintable(uint32_t c)
{
    if (c < 0x20 || (c >= 0x7F && c <= 0xA0) || c == 0xAD)
        return 0;
    if ((c >= 0x600 && c <= 0x605) || c == 0x61C || c == 0x6DD || c == 0x70F || c == 0x1680 ||
        c == 0x180E || (c >= 0x2000 && c <= 0x200F) || (c >= 0x2028 && c <= 0x202F) ||
        (c >= 0x205F && c <= 0x206F) || c == 0x3000 || (c >= 0xD800 && c <= 0xF8FF) ||
        c == 0xFEFF || (c >= 0xFFF9 && c <= 0xFFFB) || c >= 0xF0000)
        return 0;
    return 1;
}

/* ------------------------------------------------------------------ printing */

int jv_write_float(jbuf *b, double f)
{
    if (isnan(f))
        return jbuf_puts(b, "nan");
    if (isinf(f))
        return jbuf_puts(b, f < 0 ? "-inf" : "inf");
    /* Shortest digits that round-trip, then Python's repr layout: positional for
     * exponents in [-4, 16), scientific otherwise. */
    char tmp[40];
    int prec;
    for (prec = 1; prec <= 17; prec++) {
        snprintf(tmp, sizeof tmp, "%.*e", prec - 1, f);
        if (strtod(tmp, NULL) == f)
            break;
    }
    char digits[24];
    int nd = 0, neg = tmp[0] == '-';
    const char *p = tmp + neg;
    for (; *p && *p != 'e'; p++)
        if (*p >= '0' && *p <= '9')
            digits[nd++] = *p;
    int exp = atoi(p + 1);
    while (nd > 1 && digits[nd - 1] == '0')
        nd--;
    digits[nd] = 0;
    char out[64];
    size_t o = 0;
    if (neg)
        out[o++] = '-';
    if (exp >= -4 && exp < 16) {
        if (exp < 0) {
            out[o++] = '0';
            out[o++] = '.';
            for (int i = 0; i < -exp - 1; i++)
                out[o++] = '0';
            for (int i = 0; i < nd; i++)
                out[o++] = digits[i];
        } else {
            for (int i = 0; i <= exp; i++)
                out[o++] = i < nd ? digits[i] : '0';
            out[o++] = '.';
            if (nd > exp + 1)
                for (int i = exp + 1; i < nd; i++)
                    out[o++] = digits[i];
            else
                out[o++] = '0';
        }
        out[o] = 0;
    } else {
        out[o++] = digits[0];
        if (nd > 1) {
            out[o++] = '.';
            for (int i = 1; i < nd; i++)
                out[o++] = digits[i];
        }
        snprintf(out + o, sizeof out - o, "e%c%02d", exp < 0 ? '-' : '+', exp < 0 ? -exp : exp);
    }
    return jbuf_puts(b, out);
}

int jv_write_html_escaped(jbuf *b, const char *s, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        switch (s[i]) {
        case '&': jbuf_puts(b, "&amp;"); break;
        case '<': jbuf_puts(b, "&lt;"); break;
        case '>': jbuf_puts(b, "&gt;"); break;
        case '"': jbuf_puts(b, "&#34;"); break;
        case '\'': jbuf_puts(b, "&#39;"); break;
        default: jbuf_putc(b, s[i]);
        }
    }
    return b->failed ? -1 : 0;
}

static int write_py_string_repr(jbuf *b, const char *s, size_t len)
{
    char q = '\'';
    if (memchr(s, '\'', len) && !memchr(s, '"', len))
        q = '"';
    jbuf_putc(b, q);
    for (size_t i = 0; i < len;) {
        uint32_t c = jutf8_next(s, len, &i);
        if (c == (uint32_t)q || c == '\\') {
            jbuf_putc(b, '\\');
            jbuf_putc(b, (char)c);
        } else if (c == '\n') {
            jbuf_puts(b, "\\n");
        } else if (c == '\r') {
            jbuf_puts(b, "\\r");
        } else if (c == '\t') {
            jbuf_puts(b, "\\t");
        } else if (c < 0x80 && c >= 0x20 && c != 0x7F) {
            jbuf_putc(b, (char)c);
        } else if (py_isprintable(c)) {
            jutf8_put(b, c);
        } else if (c < 0x100) {
            jbuf_printf(b, "\\x%02x", c);
        } else if (c < 0x10000) {
            jbuf_printf(b, "\\u%04x", c);
        } else {
            jbuf_printf(b, "\\U%08x", c);
        }
    }
    return jbuf_putc(b, q);
}

static int write_repr(jbuf *b, m40_jvalue v, int depth);

static int write_str(jbuf *b, m40_jvalue v, int depth)
{
    switch (v.type) {
    case M40_JV_UNDEFINED:
        return b->failed ? -1 : 0;
    case M40_JV_STRING:
        return jbuf_put(b, v.u.s->s, v.u.s->len);
    default:
        return write_repr(b, v, depth);
    }
}

static int write_repr(jbuf *b, m40_jvalue v, int depth)
{
    if (depth > 200) { /* only a namespace holding itself can get here */
        b->failed = 1;
        return -1;
    }
    switch (v.type) {
    case M40_JV_UNDEFINED:
        return jbuf_puts(b, "Undefined");
    case M40_JV_NONE:
        return jbuf_puts(b, "None");
    case M40_JV_BOOL:
        return jbuf_puts(b, v.u.b ? "True" : "False");
    case M40_JV_INT:
        return jbuf_printf(b, "%lld", (long long)v.u.i);
    case M40_JV_FLOAT:
        return jv_write_float(b, v.u.f);
    case M40_JV_STRING:
        return write_py_string_repr(b, v.u.s->s, v.u.s->len);
    case M40_JV_LIST: {
        const m40_jlist *l = v.u.l;
        int tuple = l->kind == JL_TUPLE;
        if (l->kind == JL_GEN) /* Python adds an address here; no rendering can match it */
            return jbuf_puts(b, "<generator object>");
        if (!jl_is_seq(l)) {
            jbuf_puts(b, jv_type_name(v));
            jbuf_putc(b, '(');
        }
        jbuf_putc(b, tuple ? '(' : '[');
        for (size_t i = 0; i < l->n; i++) {
            if (i)
                jbuf_puts(b, ", ");
            write_repr(b, l->v[i], depth + 1);
        }
        if (tuple && l->n == 1)
            jbuf_putc(b, ',');
        jbuf_putc(b, tuple ? ')' : ']');
        return jl_is_seq(l) ? (b->failed ? -1 : 0) : jbuf_putc(b, ')');
    }
    case M40_JV_DICT:
    case M40_JV_NAMESPACE: {
        const m40_jdict *d = v.u.d;
        if (v.type == M40_JV_NAMESPACE)
            jbuf_puts(b, "<Namespace ");
        jbuf_putc(b, '{');
        for (size_t i = 0; i < d->n; i++) {
            if (i)
                jbuf_puts(b, ", ");
            write_repr(b, d->k[i], depth + 1);
            jbuf_puts(b, ": ");
            write_repr(b, d->v[i], depth + 1);
        }
        jbuf_putc(b, '}');
        return v.type == M40_JV_NAMESPACE ? jbuf_putc(b, '>') : (b->failed ? -1 : 0);
    }
    case M40_JV_CALLABLE:
        return jbuf_printf(b, "<function %s>", v.u.fn->name ? v.u.fn->name : "?");
    }
    return -1;
}

int jv_write_str(jbuf *b, m40_jvalue v) { return write_str(b, v, 0); }
int jv_write_repr(jbuf *b, m40_jvalue v) { return write_repr(b, v, 0); }

static int write_json_string(jbuf *b, const char *s, size_t len)
{
    jbuf_putc(b, '"');
    size_t start = 0;
    for (size_t i = 0; i < len; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c >= 0x20 && c != '"' && c != '\\')
            continue;
        jbuf_put(b, s + start, i - start);
        start = i + 1;
        switch (c) {
        case '"': jbuf_puts(b, "\\\""); break;
        case '\\': jbuf_puts(b, "\\\\"); break;
        case '\n': jbuf_puts(b, "\\n"); break;
        case '\r': jbuf_puts(b, "\\r"); break;
        case '\t': jbuf_puts(b, "\\t"); break;
        case '\b': jbuf_puts(b, "\\b"); break;
        case '\f': jbuf_puts(b, "\\f"); break;
        default: jbuf_printf(b, "\\u%04x", c); break;
        }
    }
    jbuf_put(b, s + start, len - start);
    return jbuf_putc(b, '"');
}

static int json_newline(jbuf *b, int indent, int level)
{
    jbuf_putc(b, '\n');
    for (int i = 0; i < indent * level; i++)
        jbuf_putc(b, ' ');
    return b->failed ? -1 : 0;
}

static int write_json(jbuf *b, m40_jvalue v, int indent, int level, char *err, size_t errlen)
{
    if (level > 200) {
        snprintf(err, errlen, "value nests too deeply for tojson");
        return -1;
    }
    switch (v.type) {
    case M40_JV_NONE:
        return jbuf_puts(b, "null");
    case M40_JV_BOOL:
        return jbuf_puts(b, v.u.b ? "true" : "false");
    case M40_JV_INT:
        return jbuf_printf(b, "%lld", (long long)v.u.i);
    case M40_JV_FLOAT:
        if (isnan(v.u.f))
            return jbuf_puts(b, "NaN");
        if (isinf(v.u.f))
            return jbuf_puts(b, v.u.f < 0 ? "-Infinity" : "Infinity");
        return jv_write_float(b, v.u.f);
    case M40_JV_STRING:
        return write_json_string(b, v.u.s->s, v.u.s->len);
    case M40_JV_LIST: {
        const m40_jlist *l = v.u.l;
        if (!jl_is_seq(l)) {
            snprintf(err, errlen, "Object of type %s is not JSON serializable", jv_type_name(v));
            return -1;
        }
        if (l->n == 0)
            return jbuf_puts(b, "[]");
        jbuf_putc(b, '[');
        for (size_t i = 0; i < l->n; i++) {
            if (i)
                jbuf_puts(b, indent >= 0 ? "," : ", ");
            if (indent >= 0)
                json_newline(b, indent, level + 1);
            if (write_json(b, l->v[i], indent, level + 1, err, errlen))
                return -1;
        }
        if (indent >= 0)
            json_newline(b, indent, level);
        return jbuf_putc(b, ']');
    }
    case M40_JV_DICT: {
        const m40_jdict *d = v.u.d;
        if (d->n == 0)
            return jbuf_puts(b, "{}");
        jbuf_putc(b, '{');
        for (size_t i = 0; i < d->n; i++) {
            if (i)
                jbuf_puts(b, indent >= 0 ? "," : ", ");
            if (indent >= 0)
                json_newline(b, indent, level + 1);
            m40_jvalue k = d->k[i];
            /* json.dumps turns scalar keys into strings the way JSON spells them. */
            if (k.type == M40_JV_STRING) {
                write_json_string(b, k.u.s->s, k.u.s->len);
            } else if (k.type == M40_JV_INT || k.type == M40_JV_BOOL || k.type == M40_JV_NONE ||
                       k.type == M40_JV_FLOAT) {
                jbuf_putc(b, '"');
                write_json(b, k, -1, level + 1, err, errlen);
                jbuf_putc(b, '"');
            } else {
                snprintf(err, errlen, "keys must be str, int, float, bool or None, not %s",
                         jv_type_name(k));
                return -1;
            }
            jbuf_puts(b, ": ");
            if (write_json(b, d->v[i], indent, level + 1, err, errlen))
                return -1;
        }
        if (indent >= 0)
            json_newline(b, indent, level);
        return jbuf_putc(b, '}');
    }
    default:
        snprintf(err, errlen, "Object of type %s is not JSON serializable", jv_type_name(v));
        return -1;
    }
}

int jv_write_json(jbuf *b, m40_jvalue v, int indent, char *err, size_t errlen)
{
    if (write_json(b, v, indent, 0, err, errlen))
        return -1;
    if (b->failed) {
        snprintf(err, errlen, "tojson output too large");
        return -1;
    }
    return 0;
}

/* ------------------------------------------------------------------ JSON in */

static int from_json(m40_jarena *a, const json_t *j, m40_jvalue *out, int depth, char *err, size_t errlen)
{
    if (depth > 512) {
        snprintf(err, errlen, "JSON nests too deeply");
        return -1;
    }
    switch (json_typeof(j)) {
    case JSON_OBJECT: {
        if (m40_jv_dict(a, out))
            goto oom;
        const char *key;
        json_t *val;
        json_object_foreach((json_t *)j, key, val) {
            m40_jvalue k, v;
            if (m40_jv_cstr(a, key, &k))
                goto oom;
            if (from_json(a, val, &v, depth + 1, err, errlen))
                return -1;
            if (m40_jv_dict_set(a, *out, k, v))
                goto oom;
        }
        return 0;
    }
    case JSON_ARRAY: {
        if (m40_jv_list(a, out))
            goto oom;
        size_t i;
        json_t *val;
        json_array_foreach(j, i, val) {
            m40_jvalue v;
            if (from_json(a, val, &v, depth + 1, err, errlen))
                return -1;
            if (m40_jv_list_push(a, *out, v))
                goto oom;
        }
        return 0;
    }
    case JSON_STRING:
        if (m40_jv_str(a, json_string_value(j), json_string_length(j), out))
            goto oom;
        return 0;
    case JSON_INTEGER:
        *out = m40_jv_int((int64_t)json_integer_value(j));
        return 0;
    case JSON_REAL:
        *out = m40_jv_float(json_real_value(j));
        return 0;
    case JSON_TRUE:
        *out = m40_jv_bool(1);
        return 0;
    case JSON_FALSE:
        *out = m40_jv_bool(0);
        return 0;
    case JSON_NULL:
        *out = m40_jv_none();
        return 0;
    }
    snprintf(err, errlen, "unknown JSON type");
    return -1;
oom:
    snprintf(err, errlen, "out of memory converting JSON");
    return -1;
}

int m40_jv_from_json(m40_jarena *a, const json_t *j, m40_jvalue *out, char *err, size_t errlen)
{
    if (!j) {
        *out = m40_jv_none();
        return 0;
    }
    return from_json(a, j, out, 0, err, errlen);
}
