/* Filters: jinja2 3.1's builtin filters with HF's tojson; map/select/selectattr/
 * unique/items return generators as jinja2's do. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "jinja_int.h"

/* ------------------------------------------------------------------ filters */

/* select/reject/selectattr/rejectattr share this: keep items whose (attribute) value
 * passes test (or is truthy without one) == want. */
static int select_items(jrender *r, int line, m40_jvalue seq, const jb_args *a, int by_attr, int want,
                        m40_jvalue *out)
{
    m40_jvalue items, attr = m40_jv_undefined(), test = m40_jv_undefined();
    size_t first_test_arg = 0;
    if (by_attr) {
        if (!jb_arg(a, 0, NULL, &attr))
            return jr_fail(r, line, "selectattr/rejectattr need an attribute name");
        first_test_arg = 1;
    }
    int has_test = jb_arg(a, first_test_arg, NULL, &test);
    if (has_test && jb_need_str(r, line, test, "test name"))
        return -1;
    if (m40_jv_list(jr_arena(r), out))
        return jb_oom(r);
    out->u.l->kind = JL_GEN;
    if (!jv_truthy(seq)) /* jinja2 does `if value:` first, so none selects nothing */
        return 0;
    if (jb_to_list(r, line, seq, &items))
        return -1;
    for (size_t i = 0; i < items.u.l->n; i++) {
        m40_jvalue item = items.u.l->v[i], v = item;
        int res;
        if (jr_step(r, line))
            return -1;
        if (by_attr && jb_attr_path(r, line, item, attr, &v))
            return -1;
        if (has_test) {
            size_t skip = first_test_arg + 1;
            if (jb_test(r, line, test.u.s->s, v, a->args + (a->nargs > skip ? skip : a->nargs),
                        a->nargs > skip ? a->nargs - skip : 0, &res))
                return -1;
        } else {
            res = jv_truthy(v);
        }
        if (!!res == want && m40_jv_list_push(jr_arena(r), *out, item))
            return jb_oom(r);
    }
    return 0;
}

static int do_indent(jrender *r, int line, m40_jvalue v, const jb_args *a, m40_jvalue *out)
{
    m40_jvalue s, w, f, bl;
    jbuf ind;
    jr_buf_init(r, &ind);
    if (jb_str(r, v, &s))
        return -1;
    if (jb_arg(a, 0, "width", &w)) {
        if (w.type == M40_JV_STRING) {
            jbuf_put(&ind, w.u.s->s, w.u.s->len);
        } else {
            int64_t n = 0;
            if (jb_need_int(r, line, w, "indent width", &n))
                return -1;
            for (int64_t i = 0; i < n && i < 4096; i++)
                jbuf_putc(&ind, ' ');
        }
    } else {
        jbuf_puts(&ind, "    ");
    }
    int first = jb_arg(a, 1, "first", &f) && jv_truthy(f);
    int blank = jb_arg(a, 2, "blank", &bl) && jv_truthy(bl);
    if (ind.failed) {
        jbuf_free(&ind);
        return jb_oom(r);
    }
    /* jinja appends "\n" and uses str.splitlines(), which breaks on more than \n */
    jbuf b;
    jr_buf_init(r, &b);
    if (first)
        jbuf_put(&b, ind.p, ind.len);
    const char *p = s.u.s->s;
    size_t n = s.u.s->len, i = 0, line_start = 0, lineno = 0;
    while (i <= n) {
        size_t brk_len = 0;
        if (i == n) {
            brk_len = 1; /* the appended "\n" */
        } else {
            size_t k = i;
            uint32_t c = jutf8_next(p, n, &k);
            if (c == '\r' && k < n && p[k] == '\n')
                k++;
            if (c == '\n' || c == '\r' || c == 0x0B || c == 0x0C || c == 0x1C || c == 0x1D || c == 0x1E ||
                c == 0x85 || c == 0x2028 || c == 0x2029)
                brk_len = k - i;
            else {
                i = k;
                continue;
            }
        }
        size_t len = i - line_start;
        if (lineno > 0) {
            jbuf_putc(&b, '\n');
            if (blank || len > 0)
                jbuf_put(&b, ind.p, ind.len);
        }
        jbuf_put(&b, p + line_start, len);
        lineno++;
        if (i == n)
            break;
        i += brk_len;
        line_start = i;
    }
    jbuf_free(&ind);
    return jb_buf_result(r, &b, out);
}

static int do_round(jrender *r, int line, m40_jvalue v, const jb_args *a, m40_jvalue *out)
{
    m40_jvalue p, m;
    int64_t prec = 0;
    const char *method = "common";
    if (jb_arg(a, 0, "precision", &p) && jb_need_int(r, line, p, "round precision", &prec))
        return -1;
    if (jb_arg(a, 1, "method", &m)) {
        if (jb_need_str(r, line, m, "round method"))
            return -1;
        method = m.u.s->s;
    }
    if (strcmp(method, "common") && strcmp(method, "ceil") && strcmp(method, "floor"))
        return jr_fail(r, line, "method must be common, ceil or floor");
    if (!jv_is_num(v))
        return jr_fail(r, line, "round: expected a number, got %s", jv_type_name(v));
    if (!strcmp(method, "common")) {
        if (v.type != M40_JV_FLOAT) { /* round(int, n) stays an int */
            *out = m40_jv_int(v.type == M40_JV_INT ? v.u.i : v.u.b);
            return 0;
        }
        if (prec > 300 || prec < -300 || !isfinite(v.u.f)) {
            *out = v;
            return 0;
        }
        if (prec < 0) {
            double f = pow(10, (double)-prec);
            *out = m40_jv_float(nearbyint(v.u.f / f) * f);
            return 0;
        }
        /* Python rounds the exact binary value to prec decimals, half to even:
         * printf's correctly rounded conversion does the same. */
        char tmp[400];
        snprintf(tmp, sizeof tmp, "%.*f", (int)prec, v.u.f);
        *out = m40_jv_float(strtod(tmp, NULL));
        return 0;
    }
    double f = pow(10, (double)prec), x = jv_num(v) * f;
    *out = m40_jv_float((!strcmp(method, "ceil") ? ceil(x) : floor(x)) / f);
    return 0;
}

static int do_map(jrender *r, int line, m40_jvalue seq, const jb_args *a, m40_jvalue *out)
{
    m40_jvalue items, attr = m40_jv_undefined(), def = m40_jv_undefined(), fname = m40_jv_undefined();
    if (m40_jv_list(jr_arena(r), out))
        return jb_oom(r);
    out->u.l->kind = JL_GEN;
    if (!jv_truthy(seq)) /* as select: `if value:` first */
        return 0;
    if (jb_to_list(r, line, seq, &items))
        return -1;
    int by_attr = 0, has_def = 0;
    for (size_t i = 0; i < a->nkw; i++) {
        if (!strcmp(a->kwnames[i], "attribute")) {
            attr = a->kwvals[i];
            by_attr = 1;
        } else if (!strcmp(a->kwnames[i], "default")) {
            def = a->kwvals[i];
            has_def = 1;
        }
    }
    if (!by_attr && (!a->nargs || jb_need_str(r, line, a->args[0], "map filter name")))
        return a->nargs ? -1 : jr_fail(r, line, "map needs a filter name or attribute=");
    if (!by_attr)
        fname = a->args[0];
    for (size_t i = 0; i < items.u.l->n; i++) {
        m40_jvalue v;
        if (jr_step(r, line))
            return -1;
        if (by_attr) {
            if (jb_attr_path(r, line, items.u.l->v[i], attr, &v))
                return -1;
            if (has_def && v.type == M40_JV_UNDEFINED)
                v = def;
        } else if (jb_filter(r, line, fname.u.s->s, items.u.l->v[i], a->args + 1, a->nargs - 1, a->kwnames,
                             a->kwvals, a->nkw, &v)) {
            return -1;
        }
        if (m40_jv_list_push(jr_arena(r), *out, v))
            return jb_oom(r);
    }
    return 0;
}

static int do_unique(jrender *r, int line, m40_jvalue seq, const jb_args *a, m40_jvalue *out)
{
    m40_jvalue items, cs, attr, seen;
    int case_sensitive = jb_arg(a, 0, "case_sensitive", &cs) && jv_truthy(cs);
    int by_attr = jb_arg(a, 1, "attribute", &attr);
    if (jb_to_list(r, line, seq, &items))
        return -1;
    if (m40_jv_list(jr_arena(r), out) || m40_jv_dict(jr_arena(r), &seen))
        return jb_oom(r);
    out->u.l->kind = JL_GEN;
    for (size_t i = 0; i < items.u.l->n; i++) {
        m40_jvalue key = items.u.l->v[i];
        if (by_attr && jb_attr_path(r, line, key, attr, &key))
            return -1;
        if (!case_sensitive && key.type == M40_JV_STRING && jb_change_case(r, key.u.s, CASE_LOWER, &key))
            return -1;
        if (key.type == M40_JV_LIST || key.type == M40_JV_DICT)
            return jr_fail(r, line, "unhashable type: '%s'", jv_type_name(key));
        if (jv_dict_has(seen, key))
            continue;
        if (m40_jv_dict_set(jr_arena(r), seen, key, m40_jv_none()) ||
            m40_jv_list_push(jr_arena(r), *out, items.u.l->v[i]))
            return jb_oom(r);
    }
    return 0;
}

/* Markup results: |safe marks, |escape escapes and marks (Markup stays as is). */
static int make_markup(jrender *r, m40_jvalue v, int escape, m40_jvalue *out)
{
    m40_jvalue s;
    if (v.type == M40_JV_STRING && v.u.s->markup) {
        *out = v;
        return 0;
    }
    if (jb_str(r, v, &s))
        return -1;
    jbuf b;
    jr_buf_init(r, &b);
    if (escape)
        jv_write_html_escaped(&b, s.u.s->s, s.u.s->len);
    else
        jbuf_put(&b, s.u.s->s, s.u.s->len);
    if (jb_buf_result(r, &b, out))
        return -1;
    out->u.s->markup = 1;
    return 0;
}

/* markupsafe's string methods return Markup for Markup input. */
static int keep_markup(m40_jvalue in, int rc, m40_jvalue *out)
{
    if (rc == 0 && in.type == M40_JV_STRING && in.u.s->markup && out->type == M40_JV_STRING && !out->u.s->markup) {
        m40_jstr *copy = out->u.s; /* results here are always fresh strings */
        copy->markup = 1;
    }
    return rc;
}

int jb_filter(jrender *r, int line, const char *name, m40_jvalue v, m40_jvalue *args, size_t nargs,
              const char **kwnames, m40_jvalue *kwvals, size_t nkw, m40_jvalue *out)
{
    jb_args a = {args, nargs, kwnames, kwvals, nkw};
    m40_jvalue s, x, y;
    m40_jarena *ar = jr_arena(r);
#define IS(nm) (!strcmp(name, nm))
    if (IS("trim")) {
        if (jb_str(r, v, &s))
            return -1;
        const m40_jstr *chars = NULL;
        if (jb_arg(&a, 0, "chars", &x) && x.type != M40_JV_NONE) {
            if (jb_need_str(r, line, x, "trim chars"))
                return -1;
            chars = x.u.s;
        }
        return keep_markup(s, jb_strip(r, s.u.s, chars, 3, out), out);
    }
    if (IS("length") || IS("count")) {
        switch (v.type) {
        case M40_JV_STRING: *out = m40_jv_int((int64_t)jutf8_count(v.u.s->s, v.u.s->len)); return 0;
        case M40_JV_LIST:
            if (v.u.l->kind == JL_GEN)
                return jr_fail(r, line, "object of type 'generator' has no len()");
            *out = m40_jv_int((int64_t)v.u.l->n);
            return 0;
        case M40_JV_DICT: *out = m40_jv_int((int64_t)v.u.d->n); return 0;
        case M40_JV_UNDEFINED: *out = m40_jv_int(0); return 0;
        default: return jr_fail(r, line, "object of type '%s' has no len()", jv_type_name(v));
        }
    }
    if (IS("tojson")) {
        int indent = -1;
        if (jb_arg(&a, 1, "indent", &x) && x.type != M40_JV_NONE) {
            int64_t n = 0;
            if (jb_need_int(r, line, x, "tojson indent", &n))
                return -1;
            indent = n < 0 ? 0 : n > 64 ? 64 : (int)n;
        }
        if ((jb_arg(&a, 0, "ensure_ascii", &x) && jv_truthy(x)) || (jb_arg(&a, 3, "sort_keys", &x) && jv_truthy(x)) ||
            (jb_arg(&a, 2, "separators", &x) && x.type != M40_JV_NONE))
            return jr_fail(r, line, "tojson: only the indent option is supported");
        jbuf b;
        char err[160];
        jr_buf_init(r, &b);
        if (jv_write_json(&b, v, indent, err, sizeof err)) {
            jbuf_free(&b);
            return jr_fail(r, line, "tojson: %s", err);
        }
        return jb_buf_result(r, &b, out);
    }
    if (IS("upper") || IS("lower") || IS("capitalize") || IS("title")) {
        if (jb_str(r, v, &s))
            return -1;
        return keep_markup(s, jb_change_case(r, s.u.s, IS("upper") ? CASE_UPPER : IS("lower") ? CASE_LOWER
                                     : IS("capitalize") ? CASE_CAPITALIZE : CASE_JTITLE, out), out);
    }
    if (IS("replace")) {
        int64_t count = -1;
        if (jb_str(r, v, &s) || !jb_arg(&a, 0, "old", &x) || !jb_arg(&a, 1, "new", &y))
            return r ? (nargs < 2 && nkw == 0 ? jr_fail(r, line, "replace needs old and new") : -1) : -1;
        m40_jvalue c;
        if (jb_str(r, x, &x) || jb_str(r, y, &y))
            return -1;
        if (jb_arg(&a, 2, "count", &c) && c.type != M40_JV_NONE && jb_need_int(r, line, c, "replace count", &count))
            return -1;
        return jb_replace(r, s.u.s, x.u.s, y.u.s, count, out);
    }
    if (IS("join")) {
        m40_jvalue items, d, attr;
        int by_attr = jb_arg(&a, 1, "attribute", &attr) && attr.type != M40_JV_NONE;
        if (!jb_arg(&a, 0, "d", &d))
            d = m40_jv_undefined();
        if (jb_to_list(r, line, v, &items))
            return -1;
        jbuf b;
        jr_buf_init(r, &b);
        for (size_t i = 0; i < items.u.l->n; i++) {
            m40_jvalue it = items.u.l->v[i];
            if (by_attr && jb_attr_path(r, line, it, attr, &it)) {
                jbuf_free(&b);
                return -1;
            }
            if (i)
                jv_write_str(&b, d);
            jv_write_str(&b, it);
        }
        return jb_buf_result(r, &b, out);
    }
    if (IS("default") || IS("d")) {
        m40_jvalue def, boolean;
        if (!jb_arg(&a, 0, "default_value", &def) && !jb_arg(&a, 0, "value", &def)) {
            if (m40_jv_str(ar, "", 0, &def))
                return jb_oom(r);
        }
        int use_bool = jb_arg(&a, 1, "boolean", &boolean) && jv_truthy(boolean);
        *out = (v.type == M40_JV_UNDEFINED || (use_bool && !jv_truthy(v))) ? def : v;
        return 0;
    }
    if (IS("first") || IS("last")) {
        m40_jvalue items;
        if (v.type == M40_JV_LIST && v.u.l->kind == JL_GEN) {
            if (IS("last"))
                return jr_fail(r, line, "'generator' object is not reversible");
            if (!v.u.l->n) {
                *out = m40_jv_undefined();
                return 0;
            }
            *out = v.u.l->v[0]; /* next() takes one item off the generator */
            v.u.l->v++;
            v.u.l->n--;
            v.u.l->cap--;
            return 0;
        }
        if (jb_to_list(r, line, v, &items))
            return -1;
        if (!items.u.l->n) {
            *out = m40_jv_undefined();
            return 0;
        }
        *out = items.u.l->v[IS("first") ? 0 : items.u.l->n - 1];
        return 0;
    }
    if (IS("list")) {
        m40_jvalue items;
        if (jb_to_list(r, line, v, &items))
            return -1;
        return jb_list_copy(r, items, out);
    }
    if (IS("string"))
        return jb_str(r, v, out);
    if (IS("safe"))
        return make_markup(r, v, 0, out);
    if (IS("e") || IS("escape"))
        return make_markup(r, v, 1, out);
    if (IS("int")) {
        m40_jvalue def = m40_jv_int(0);
        jb_arg(&a, 0, "default", &def);
        int64_t iv;
        double fv;
        if (v.type == M40_JV_INT || v.type == M40_JV_BOOL)
            *out = m40_jv_int(v.type == M40_JV_INT ? v.u.i : v.u.b);
        else if (v.type == M40_JV_FLOAT && isfinite(v.u.f) && fabs(v.u.f) < 9.2e18)
            *out = m40_jv_int((int64_t)v.u.f);
        else if (v.type == M40_JV_STRING && jb_parse_int(v.u.s->s, &iv))
            *out = m40_jv_int(iv);
        else if (v.type == M40_JV_STRING && jb_parse_float(v.u.s->s, &fv) && isfinite(fv) && fabs(fv) < 9.2e18)
            *out = m40_jv_int((int64_t)fv);
        else
            *out = def;
        return 0;
    }
    if (IS("float")) {
        m40_jvalue def = m40_jv_float(0);
        jb_arg(&a, 0, "default", &def);
        double fv;
        if (jv_is_num(v))
            *out = m40_jv_float(jv_num(v));
        else if (v.type == M40_JV_STRING && jb_parse_float(v.u.s->s, &fv))
            *out = m40_jv_float(fv);
        else
            *out = def;
        return 0;
    }
    if (IS("abs")) {
        if (v.type == M40_JV_FLOAT)
            *out = m40_jv_float(fabs(v.u.f));
        else if (v.type == M40_JV_INT || v.type == M40_JV_BOOL) {
            int64_t iv = v.type == M40_JV_INT ? v.u.i : v.u.b;
            if (iv == INT64_MIN)
                return jr_fail(r, line, "integer overflow");
            *out = m40_jv_int(iv < 0 ? -iv : iv);
        } else
            return jr_fail(r, line, "bad operand type for abs(): '%s'", jv_type_name(v));
        return 0;
    }
    if (IS("round"))
        return do_round(r, line, v, &a, out);
    if (IS("items")) {
        if (m40_jv_list(ar, out))
            return jb_oom(r);
        out->u.l->kind = JL_GEN;
        if (v.type == M40_JV_UNDEFINED)
            return 0;
        if (v.type != M40_JV_DICT)
            return jr_fail(r, line, "Can only get item pairs from a mapping.");
        for (size_t i = 0; i < v.u.d->n; i++) {
            m40_jvalue t;
            if (jv_tuple2(ar, v.u.d->k[i], v.u.d->v[i], &t) || m40_jv_list_push(ar, *out, t))
                return jb_oom(r);
        }
        return 0;
    }
    if (IS("select") || IS("reject"))
        return select_items(r, line, v, &a, 0, IS("select"), out);
    if (IS("selectattr") || IS("rejectattr"))
        return select_items(r, line, v, &a, 1, IS("selectattr"), out);
    if (IS("map"))
        return do_map(r, line, v, &a, out);
    if (IS("unique"))
        return do_unique(r, line, v, &a, out);
    if (IS("indent"))
        return keep_markup(v, do_indent(r, line, v, &a, out), out);
    if (IS("reverse")) {
        if (v.type == M40_JV_STRING) {
            m40_jvalue chars;
            if (jb_to_list(r, line, v, &chars))
                return -1;
            jbuf b;
            jr_buf_init(r, &b);
            for (size_t i = chars.u.l->n; i-- > 0;)
                jbuf_put(&b, chars.u.l->v[i].u.s->s, chars.u.l->v[i].u.s->len);
            return jb_buf_result(r, &b, out);
        }
        m40_jvalue items;
        if (jb_to_list(r, line, v, &items))
            return -1;
        if (m40_jv_list(ar, out))
            return jb_oom(r);
        out->u.l->kind = JL_GEN; /* reversed() gives an iterator */
        for (size_t i = items.u.l->n; i-- > 0;)
            if (m40_jv_list_push(ar, *out, items.u.l->v[i]))
                return jb_oom(r);
        return 0;
    }
    if (IS("attr")) {
        if (!jb_arg(&a, 0, "name", &x) || jb_need_str(r, line, x, "attr name"))
            return nargs ? -1 : jr_fail(r, line, "attr needs a name");
        return jr_getattr(r, line, v, x.u.s->s, out);
    }
#undef IS
    return jr_fail(r, line, "no filter named '%s'", name);
}
