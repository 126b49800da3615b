/* Operators and access of the evaluator: attribute and item lookup with jinja2's
 * sandbox rules, slicing, arithmetic/comparison/membership with Python semantics
 * (floor division, int overflow checked, Markup + str escaping), iteration. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "jinja_int.h"

/* ------------------------------------------------------------------ attribute / item */

static int bound_method(jrender *r, m40_jvalue obj, const char *name, int id, m40_jvalue *out)
{
    m40_jcallable *fn = m40_jarena_alloc(r->arena, sizeof *fn);
    if (!fn)
        return jr_oom(r);
    memset(fn, 0, sizeof *fn);
    fn->kind = JFN_METHOD;
    fn->id = id;
    fn->name = name;
    fn->self = obj;
    out->type = M40_JV_CALLABLE;
    out->u.fn = fn;
    return 0;
}

static int loop_attr(jrender *r, const jloop *lp, const char *name, m40_jvalue *out)
{
    size_t i = lp->index0, n = lp->length;
    if (!strcmp(name, "index"))
        *out = m40_jv_int((int64_t)i + 1);
    else if (!strcmp(name, "index0"))
        *out = m40_jv_int((int64_t)i);
    else if (!strcmp(name, "revindex"))
        *out = m40_jv_int((int64_t)(n - i));
    else if (!strcmp(name, "revindex0"))
        *out = m40_jv_int((int64_t)(n - i - 1));
    else if (!strcmp(name, "first"))
        *out = m40_jv_bool(i == 0);
    else if (!strcmp(name, "last"))
        *out = m40_jv_bool(i + 1 == n);
    else if (!strcmp(name, "length"))
        *out = m40_jv_int((int64_t)n);
    else if (!strcmp(name, "depth"))
        *out = m40_jv_int(1);
    else if (!strcmp(name, "depth0"))
        *out = m40_jv_int(0);
    else if (!strcmp(name, "previtem"))
        *out = i > 0 ? lp->items->v[i - 1] : jr_undefined(r, "previtem");
    else if (!strcmp(name, "nextitem"))
        *out = i + 1 < n ? lp->items->v[i + 1] : jr_undefined(r, "nextitem");
    else
        *out = jr_undefined(r, name);
    return 0;
}

/* obj.name: Python attribute first (dict methods like items win over keys), then
 * the item, as jinja2's sandbox getattr does. */
int jr_getattr(jrender *r, int line, m40_jvalue obj, const char *name, m40_jvalue *out)
{
    switch (obj.type) {
    case M40_JV_UNDEFINED:
        return jr_undefined_error(r, line, obj);
    case M40_JV_NAMESPACE:
        *out = m40_jv_dict_get_cstr(obj, name);
        if (out->type == M40_JV_UNDEFINED)
            *out = jr_undefined(r, name);
        return 0;
    case M40_JV_CALLABLE:
        if (obj.u.fn->kind == (enum jfn_kind)JFN_LOOP) {
            if (!strcmp(name, "cycle"))
                return bound_method(r, obj, name, -1, out);
            return loop_attr(r, (const jloop *)(const void *)obj.u.fn->node, name, out);
        }
        *out = jr_undefined(r, name);
        return 0;
    default:
        break;
    }
    int id = jb_method_id(obj, name);
    if (id >= 0)
        return bound_method(r, obj, name, id, out);
    if (id == -2) { /* a mutating method: the immutable sandbox hides it */
        *out = jr_undefined(r, name);
        return 0;
    }
    if (obj.type == M40_JV_DICT) {
        *out = m40_jv_dict_get_cstr(obj, name);
        if (out->type != M40_JV_UNDEFINED)
            return 0;
    }
    *out = jr_undefined(r, name);
    return 0;
}

static int py_index(jrender *r, m40_jvalue key, int64_t *idx)
{
    (void)r;
    if (key.type == M40_JV_INT) {
        *idx = key.u.i;
        return 1;
    }
    if (key.type == M40_JV_BOOL) {
        *idx = key.u.b;
        return 1;
    }
    return 0;
}

/* obj[key]: the item first, then (for string keys) the attribute. */
int jr_getitem(jrender *r, int line, m40_jvalue obj, m40_jvalue key, m40_jvalue *out)
{
    int64_t idx;
    switch (obj.type) {
    case M40_JV_UNDEFINED:
        return jr_undefined_error(r, line, obj);
    case M40_JV_DICT: {
        int found;
        *out = jv_dict_get(obj, key, &found);
        if (found)
            return 0;
        break;
    }
    case M40_JV_LIST:
        if (jl_is_seq(obj.u.l) && py_index(r, key, &idx)) {
            int64_t n = (int64_t)obj.u.l->n;
            if (idx < 0)
                idx += n;
            if (idx >= 0 && idx < n) {
                *out = obj.u.l->v[idx];
                return 0;
            }
            *out = jr_undefined(r, NULL);
            return 0;
        }
        break;
    case M40_JV_STRING:
        if (py_index(r, key, &idx)) {
            const m40_jstr *s = obj.u.s;
            int64_t n = (int64_t)jutf8_count(s->s, s->len);
            if (idx < 0)
                idx += n;
            if (idx >= 0 && idx < n) {
                size_t a = jutf8_offset(s->s, s->len, (size_t)idx);
                size_t b = a;
                jutf8_next(s->s, s->len, &b);
                if (m40_jv_str(r->arena, s->s + a, b - a, out))
                    return jr_oom(r);
                return 0;
            }
            *out = jr_undefined(r, NULL);
            return 0;
        }
        break;
    default:
        break;
    }
    if (key.type == M40_JV_STRING)
        return jr_getattr(r, line, obj, key.u.s->s, out);
    *out = jr_undefined(r, NULL);
    return 0;
}

/* Python slice indices for a sequence of length n. */
static void slice_bounds(int64_t n, int has_a, int64_t a, int has_b, int64_t b, int64_t step,
                         int64_t *start, int64_t *stop)
{
    if (step > 0) {
        *start = !has_a ? 0 : a < 0 ? (a + n < 0 ? 0 : a + n) : (a > n ? n : a);
        *stop = !has_b ? n : b < 0 ? (b + n < 0 ? 0 : b + n) : (b > n ? n : b);
    } else {
        *start = !has_a ? n - 1 : a < 0 ? (a + n < 0 ? -1 : a + n) : (a >= n ? n - 1 : a);
        *stop = !has_b ? -1 : b < 0 ? (b + n < 0 ? -1 : b + n) : (b >= n ? n - 1 : b);
    }
}

/* The index after c in a slice walk toward stop, or stop itself when the step would reach
 * or pass it: c + step must not be computed when it overflows (a step near INT64_MAX). */
static int64_t slice_next(int64_t c, int64_t stop, int64_t step)
{
    if (step > 0)
        return (uint64_t)(stop - c) > (uint64_t)step ? c + step : stop;
    return (uint64_t)(c - stop) > (uint64_t)0 - (uint64_t)step ? c + step : stop;
}

/* obj[a:b:c] with Python's index rules; has[k] 0 = that part was omitted/None. */
int jr_slice(jrender *r, int line, m40_jvalue obj, const int *has, int64_t *iv, m40_jvalue *out)
{
    if (!has[2])
        iv[2] = 1;
    if (iv[2] == 0)
        return jr_fail(r, line, "slice step cannot be zero");
    if (obj.type == M40_JV_UNDEFINED)
        return jr_undefined_error(r, line, obj);
    if (obj.type == M40_JV_LIST && jl_is_seq(obj.u.l)) {
        int64_t start, stop;
        slice_bounds((int64_t)obj.u.l->n, has[0], iv[0], has[1], iv[1], iv[2], &start, &stop);
        if (m40_jv_list(r->arena, out))
            return jr_oom(r);
        out->u.l->kind = obj.u.l->kind;
        for (int64_t i = start; iv[2] > 0 ? i < stop : i > stop; i = slice_next(i, stop, iv[2]))
            if (m40_jv_list_push(r->arena, *out, obj.u.l->v[i]))
                return jr_oom(r);
        return 0;
    }
    if (obj.type == M40_JV_STRING) {
        const m40_jstr *str = obj.u.s;
        int64_t n_cp = (int64_t)jutf8_count(str->s, str->len), start, stop;
        slice_bounds(n_cp, has[0], iv[0], has[1], iv[1], iv[2], &start, &stop);
        jbuf b;
        jr_buf_init(r, &b);
        if (iv[2] == 1) {
            if (start < stop) {
                size_t a = jutf8_offset(str->s, str->len, (size_t)start);
                size_t e = jutf8_offset(str->s, str->len, (size_t)stop);
                jbuf_put(&b, str->s + a, e - a);
            }
        } else {
            /* general step: index the code points once */
            size_t *offs = malloc(((size_t)n_cp + 1) * sizeof *offs);
            if (!offs)
                return jr_oom(r);
            size_t i = 0, k = 0;
            while (i < str->len) {
                offs[k++] = i;
                jutf8_next(str->s, str->len, &i);
            }
            offs[k] = str->len;
            for (int64_t c = start; iv[2] > 0 ? c < stop : c > stop; c = slice_next(c, stop, iv[2]))
                jbuf_put(&b, str->s + offs[c], offs[c + 1] - offs[c]);
            free(offs);
        }
        return jr_buf_value(r, &b, out);
    }
    /* jinja2's getitem turns the TypeError into an undefined value */
    *out = jr_undefined(r, NULL);
    return 0;
}

/* ------------------------------------------------------------------ operators */

static int type_error(jrender *r, int line, const char *op, m40_jvalue a, m40_jvalue b)
{
    if (a.type == M40_JV_UNDEFINED)
        return jr_undefined_error(r, line, a);
    if (b.type == M40_JV_UNDEFINED)
        return jr_undefined_error(r, line, b);
    return jr_fail(r, line, "unsupported operand type(s) for %s: '%s' and '%s'", op, jv_type_name(a),
                   jv_type_name(b));
}

static int concat_str(jrender *r, const m40_jstr *a, const m40_jstr *b, m40_jvalue *out)
{
    m40_jstr *js = m40_jarena_alloc(r->arena, sizeof *js + a->len + b->len + 1);
    if (!js)
        return jr_oom(r);
    js->len = a->len + b->len;
    memcpy(js->s, a->s, a->len);
    memcpy(js->s + a->len, b->s, b->len);
    js->s[js->len] = 0;
    out->type = M40_JV_STRING;
    out->u.s = js;
    return 0;
}

static int repeat(jrender *r, int line, m40_jvalue seq, int64_t times, m40_jvalue *out)
{
    if (times < 0)
        times = 0;
    /* an empty sequence repeated is empty however often: no loop over `times` (a
     * 10^15-fold '' * n used to spin for ever within the size bound) */
    if ((seq.type == M40_JV_STRING ? seq.u.s->len : seq.u.l->n) == 0)
        times = 0;
    if (seq.type == M40_JV_STRING) {
        size_t len = seq.u.s->len;
        if (len && (uint64_t)times > r->lim.max_output / len)
            return jr_fail(r, line, "string repetition too large");
        jbuf b;
        jr_buf_init(r, &b);
        for (int64_t i = 0; i < times; i++)
            jbuf_put(&b, seq.u.s->s, len);
        if (jr_buf_value(r, &b, out))
            return -1;
        out->u.s->markup = seq.u.s->markup;
        return 0;
    }
    if (seq.u.l->n && (uint64_t)times > r->lim.max_steps / seq.u.l->n)
        return jr_fail(r, line, "list repetition too large");
    if (m40_jv_list(r->arena, out))
        return jr_oom(r);
    out->u.l->kind = seq.u.l->kind;
    for (int64_t i = 0; i < times; i++)
        for (size_t k = 0; k < seq.u.l->n; k++)
            if (m40_jv_list_push(r->arena, *out, seq.u.l->v[k]))
                return jr_oom(r);
    return 0;
}

static int64_t as_int(m40_jvalue v) { return v.type == M40_JV_BOOL ? v.u.b : v.u.i; }

int jr_arith(jrender *r, int line, int op, m40_jvalue a, m40_jvalue b, m40_jvalue *out)
{
    static const char *names[] = {"", "+", "-", "*", "/", "//", "%", "**"};
    if (jv_is_num(a) && jv_is_num(b)) {
        int both_int = a.type != M40_JV_FLOAT && b.type != M40_JV_FLOAT;
        if (both_int) {
            int64_t x = as_int(a), y = as_int(b), z;
            switch (op) {
            case OP_ADD:
                if (__builtin_add_overflow(x, y, &z))
                    return jr_fail(r, line, "integer overflow");
                *out = m40_jv_int(z);
                return 0;
            case OP_SUB:
                if (__builtin_sub_overflow(x, y, &z))
                    return jr_fail(r, line, "integer overflow");
                *out = m40_jv_int(z);
                return 0;
            case OP_MUL:
                if (__builtin_mul_overflow(x, y, &z))
                    return jr_fail(r, line, "integer overflow");
                *out = m40_jv_int(z);
                return 0;
            case OP_FLOORDIV:
            case OP_MOD: {
                if (y == 0)
                    return jr_fail(r, line, "integer division or modulo by zero");
                if (x == INT64_MIN && y == -1)
                    return jr_fail(r, line, "integer overflow");
                int64_t q = x / y, m = x % y;
                if (m != 0 && ((m < 0) != (y < 0))) { /* Python floors */
                    q--;
                    m += y;
                }
                *out = m40_jv_int(op == OP_MOD ? m : q);
                return 0;
            }
            case OP_POW:
                if (y >= 0) {
                    int64_t acc = 1;
                    for (int64_t i = 0; i < y; i++) {
                        if (__builtin_mul_overflow(acc, x, &acc))
                            return jr_fail(r, line, "integer overflow");
                        if (acc == 0 || acc == 1)
                            break;
                    }
                    *out = m40_jv_int(acc);
                    return 0;
                }
                break; /* negative exponent: float */
            default:
                break;
            }
        }
        double x = jv_num(a), y = jv_num(b);
        switch (op) {
        case OP_ADD: *out = m40_jv_float(x + y); return 0;
        case OP_SUB: *out = m40_jv_float(x - y); return 0;
        case OP_MUL: *out = m40_jv_float(x * y); return 0;
        case OP_DIV:
            if (y == 0)
                return jr_fail(r, line, "division by zero");
            *out = m40_jv_float(x / y);
            return 0;
        case OP_FLOORDIV:
            if (y == 0)
                return jr_fail(r, line, "float floor division by zero");
            *out = m40_jv_float(floor(x / y));
            return 0;
        case OP_MOD: {
            if (y == 0)
                return jr_fail(r, line, "float modulo");
            double m = fmod(x, y);
            if (m != 0 && ((m < 0) != (y < 0)))
                m += y;
            *out = m40_jv_float(m);
            return 0;
        }
        case OP_POW:
            *out = m40_jv_float(pow(x, y));
            return 0;
        }
    }
    if (op == OP_ADD && a.type == M40_JV_STRING && b.type == M40_JV_STRING) {
        if (a.u.s->markup == b.u.s->markup) {
            if (concat_str(r, a.u.s, b.u.s, out))
                return -1;
            out->u.s->markup = a.u.s->markup;
            return 0;
        }
        /* Markup + str escapes the plain side (markupsafe), which is what HF renders
         * for templates that write "..."|safe + value. */
        jbuf buf;
        jr_buf_init(r, &buf);
        if (a.u.s->markup)
            jbuf_put(&buf, a.u.s->s, a.u.s->len);
        else
            jv_write_html_escaped(&buf, a.u.s->s, a.u.s->len);
        if (b.u.s->markup)
            jbuf_put(&buf, b.u.s->s, b.u.s->len);
        else
            jv_write_html_escaped(&buf, b.u.s->s, b.u.s->len);
        if (jr_buf_value(r, &buf, out))
            return -1;
        out->u.s->markup = 1;
        return 0;
    }
    if (op == OP_ADD && a.type == M40_JV_LIST && b.type == M40_JV_LIST && jl_is_seq(a.u.l) &&
        a.u.l->kind == b.u.l->kind) {
        if (m40_jv_list(r->arena, out))
            return jr_oom(r);
        out->u.l->kind = a.u.l->kind;
        for (size_t i = 0; i < a.u.l->n; i++)
            if (m40_jv_list_push(r->arena, *out, a.u.l->v[i]))
                return jr_oom(r);
        for (size_t i = 0; i < b.u.l->n; i++)
            if (m40_jv_list_push(r->arena, *out, b.u.l->v[i]))
                return jr_oom(r);
        return 0;
    }
    if (op == OP_MUL) {
        int a_int = a.type == M40_JV_INT || a.type == M40_JV_BOOL;
        int b_int = b.type == M40_JV_INT || b.type == M40_JV_BOOL;
        if ((a.type == M40_JV_STRING || (a.type == M40_JV_LIST && jl_is_seq(a.u.l))) && b_int)
            return repeat(r, line, a, as_int(b), out);
        if ((b.type == M40_JV_STRING || (b.type == M40_JV_LIST && jl_is_seq(b.u.l))) && a_int)
            return repeat(r, line, b, as_int(a), out);
    }
    if (op == OP_MOD && a.type == M40_JV_STRING)
        return jr_fail(r, line, "printf-style string formatting is not supported");
    return type_error(r, line, names[op], a, b);
}

/* a < b etc. for numbers, strings and lists (lexicographic). */
int jr_order(jrender *r, int line, const char *opname, m40_jvalue a, m40_jvalue b, int *cmp)
{
    if (jv_is_num(a) && jv_is_num(b)) {
        double x = jv_num(a), y = jv_num(b);
        if (a.type != M40_JV_FLOAT && b.type != M40_JV_FLOAT) {
            int64_t p = as_int(a), q = as_int(b);
            *cmp = p < q ? -1 : p > q;
        } else {
            *cmp = x < y ? -1 : x > y ? 1 : 0;
            if (isnan(x) || isnan(y))
                *cmp = 2; /* unordered: every comparison false */
        }
        return 0;
    }
    if (a.type == M40_JV_STRING && b.type == M40_JV_STRING) {
        size_t n = a.u.s->len < b.u.s->len ? a.u.s->len : b.u.s->len;
        int c = memcmp(a.u.s->s, b.u.s->s, n); /* UTF-8 byte order = code point order */
        *cmp = c < 0 ? -1 : c > 0 ? 1 : a.u.s->len < b.u.s->len ? -1 : a.u.s->len > b.u.s->len;
        return 0;
    }
    if (a.type == M40_JV_LIST && b.type == M40_JV_LIST) {
        size_t n = a.u.l->n < b.u.l->n ? a.u.l->n : b.u.l->n;
        for (size_t i = 0; i < n; i++) {
            if (jv_equal(a.u.l->v[i], b.u.l->v[i]))
                continue;
            return jr_order(r, line, opname, a.u.l->v[i], b.u.l->v[i], cmp);
        }
        *cmp = a.u.l->n < b.u.l->n ? -1 : a.u.l->n > b.u.l->n;
        return 0;
    }
    if (a.type == M40_JV_UNDEFINED)
        return jr_undefined_error(r, line, a);
    if (b.type == M40_JV_UNDEFINED)
        return jr_undefined_error(r, line, b);
    return jr_fail(r, line, "'%s' not supported between instances of '%s' and '%s'", opname,
                   jv_type_name(a), jv_type_name(b));
}

int jr_contains(jrender *r, int line, m40_jvalue needle, m40_jvalue hay, int *res)
{
    switch (hay.type) {
    case M40_JV_STRING:
        if (needle.type != M40_JV_STRING)
            return jr_fail(r, line, "'in <string>' requires string as left operand, not %s",
                           jv_type_name(needle));
        *res = needle.u.s->len == 0 ||
               memmem(hay.u.s->s, hay.u.s->len, needle.u.s->s, needle.u.s->len) != NULL;
        return 0;
    case M40_JV_LIST: {
        size_t i;
        *res = 0;
        for (i = 0; i < hay.u.l->n; i++)
            if (jv_equal(hay.u.l->v[i], needle)) {
                *res = 1;
                break;
            }
        if (hay.u.l->kind == JL_GEN && hay.u.l->n > 0) { /* `in` consumes a generator up to the match */
            size_t used = i < hay.u.l->n ? i + 1 : hay.u.l->n;
            hay.u.l->v += used;
            hay.u.l->n -= used;
            hay.u.l->cap -= used;
        }
        return 0;
    }
    case M40_JV_DICT:
        *res = jv_dict_has(hay, needle);
        return 0;
    case M40_JV_UNDEFINED: /* iterates as empty */
        *res = 0;
        return 0;
    default:
        return jr_fail(r, line, "argument of type '%s' is not iterable", jv_type_name(hay));
    }
}

int jb_to_list(jrender *r, int line, m40_jvalue v, m40_jvalue *out)
{
    switch (v.type) {
    case M40_JV_LIST:
        if (v.u.l->kind == JL_GEN) { /* one iteration uses a generator up */
            if (m40_jv_list(r->arena, out))
                return jr_oom(r);
            *out->u.l = *v.u.l;
            out->u.l->kind = JL_LIST;
            v.u.l->n = v.u.l->cap = 0;
            v.u.l->v = NULL;
            return 0;
        }
        *out = v;
        return 0;
    case M40_JV_UNDEFINED:
        if (m40_jv_list(r->arena, out))
            return jr_oom(r);
        return 0;
    case M40_JV_DICT:
        if (m40_jv_list(r->arena, out))
            return jr_oom(r);
        for (size_t i = 0; i < v.u.d->n; i++)
            if (m40_jv_list_push(r->arena, *out, v.u.d->k[i]))
                return jr_oom(r);
        return 0;
    case M40_JV_STRING: {
        if (m40_jv_list(r->arena, out))
            return jr_oom(r);
        const m40_jstr *s = v.u.s;
        for (size_t i = 0; i < s->len;) {
            size_t a = i;
            jutf8_next(s->s, s->len, &i);
            m40_jvalue c;
            if (jr_step(r, line)) /* a value a character: a step each */
                return -1;
            if (m40_jv_str(r->arena, s->s + a, i - a, &c) || m40_jv_list_push(r->arena, *out, c))
                return jr_oom(r);
        }
        return 0;
    }
    default:
        return jr_fail(r, line, "'%s' object is not iterable", jv_type_name(v));
    }
}
