/* Evaluator: walks the AST with a chain of scopes, writing into a bounded buffer.
 *
 * Scoping follows jinja2: the template's top level is one scope; every for-loop
 * iteration, macro call and {% with %} opens a child scope, so `set` inside a loop
 * does not leak out (templates use namespace() for that); `if` opens none. A macro
 * reads free names from the scope it was defined in, at call time.
 *
 * Every loop iteration, call and output piece costs a step; steps, macro depth,
 * output bytes and arena bytes are all capped (m40_jinja_limits). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "jinja_int.h"

enum { X_OK = 0, X_ERR = -1, X_BREAK = 1, X_CONTINUE = 2 };

int jr_fail(jrender *r, int line, const char *fmt, ...)
{
    if (r->failed)
        return -1;
    r->failed = 1;
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (line > 0)
        snprintf(r->err, r->errlen, "line %d: %s", line, msg);
    else
        snprintf(r->err, r->errlen, "%s", msg);
    return -1;
}

int jr_oom(jrender *r)
{
    return jr_fail(r, 0, "template rendering exceeded its memory limit (%zu bytes)", r->lim.max_memory);
}

m40_jarena *jr_arena(jrender *r) { return r->arena; }
time_t jr_now(jrender *r) { return r->lim.now; }

void jr_buf_init(jrender *r, jbuf *b) { jbuf_init(b, r->lim.max_output); }

int jr_buf_value(jrender *r, jbuf *b, m40_jvalue *out)
{
    const int over = b->over, rc = jv_str_from_buf(r->arena, b, out);
    jbuf_free(b);
    if (over)
        return jr_fail(r, 0, "a string value exceeds %zu bytes (the output limit)", r->lim.max_output);
    return rc ? jr_oom(r) : 0;
}

int jr_step(jrender *r, int line)
{
    if (++r->steps > r->lim.max_steps)
        return jr_fail(r, line, "template ran more than %llu steps", (unsigned long long)r->lim.max_steps);
    return 0;
}

/* ------------------------------------------------------------------ scopes */

static jscope *scope_new(jrender *r, jscope *parent)
{
    jscope *s = m40_jarena_alloc(r->arena, sizeof *s);
    if (!s)
        return NULL;
    memset(s, 0, sizeof *s);
    s->parent = parent;
    return s;
}

static int scope_set(jrender *r, jscope *s, const char *name, m40_jvalue v)
{
    for (size_t i = 0; i < s->n; i++)
        if (!strcmp(s->names[i], name)) {
            s->vals[i] = v;
            return 0;
        }
    if (s->n == s->cap) {
        size_t nc = s->cap ? s->cap * 2 : 8;
        const char **nn = m40_jarena_alloc(r->arena, nc * sizeof *nn);
        m40_jvalue *nv = m40_jarena_alloc(r->arena, nc * sizeof *nv);
        if (!nn || !nv)
            return jr_oom(r);
        if (s->n) {
            memcpy(nn, s->names, s->n * sizeof *nn);
            memcpy(nv, s->vals, s->n * sizeof *nv);
        }
        s->names = nn;
        s->vals = nv;
        s->cap = nc;
    }
    s->names[s->n] = name;
    s->vals[s->n] = v;
    s->n++;
    return 0;
}

m40_jvalue jr_undefined(jrender *r, const char *name)
{
    m40_jvalue u = m40_jv_undefined();
    m40_jvalue s;
    /* remember the name for "'x' is undefined" messages */
    if (name && m40_jv_cstr(r->arena, name, &s) == 0)
        u.u.s = s.u.s;
    return u;
}

static int lookup(jrender *r, jscope *s, const char *name, m40_jvalue *out)
{
    for (; s; s = s->parent)
        for (size_t i = s->n; i-- > 0;)
            if (!strcmp(s->names[i], name)) {
                *out = s->vals[i];
                return 0;
            }
    m40_jvalue v = m40_jv_dict_get_cstr(r->ctx, name);
    if (v.type != M40_JV_UNDEFINED) {
        *out = v;
        return 0;
    }
    int id = jb_global_id(name);
    if (id >= 0) {
        m40_jcallable *fn = m40_jarena_alloc(r->arena, sizeof *fn);
        if (!fn)
            return jr_oom(r);
        memset(fn, 0, sizeof *fn);
        fn->kind = JFN_BUILTIN;
        fn->id = id;
        fn->name = name;
        out->type = M40_JV_CALLABLE;
        out->u.fn = fn;
        return 0;
    }
    *out = jr_undefined(r, name);
    return 0;
}

int jr_undefined_error(jrender *r, int line, m40_jvalue u)
{
    if (u.u.s)
        return jr_fail(r, line, "'%s' is undefined", u.u.s->s);
    return jr_fail(r, line, "undefined value used");
}

static int eval(jrender *r, jscope *s, const jnode *n, m40_jvalue *out);

static int eval_slice(jrender *r, jscope *s, const jnode *n, m40_jvalue *out)
{
    m40_jvalue obj, parts[3];
    int has[3];
    int64_t iv[3] = {0, 0, 1};
    if (!n->a) /* the parser gives every slice its object; this only guards that */
        return jr_fail(r, n->line, "a slice without an object");
    if (eval(r, s, n->a, &obj))
        return -1;
    for (int k = 0; k < 3; k++) {
        has[k] = 0;
        if (!n->kids[k])
            continue;
        if (eval(r, s, n->kids[k], &parts[k]))
            return -1;
        if (parts[k].type == M40_JV_NONE)
            continue;
        if (parts[k].type == M40_JV_INT || parts[k].type == M40_JV_BOOL)
            iv[k] = parts[k].type == M40_JV_INT ? parts[k].u.i : parts[k].u.b;
        else
            return jr_fail(r, n->line, "slice indices must be integers or None");
        has[k] = 1;
    }
    return jr_slice(r, n->line, obj, has, iv, out);
}

/* ------------------------------------------------------------------ calls */

static int exec_block(jrender *r, jscope *s, jnode **kids, size_t n);

/* Render kids into a fresh buffer and return the text as a string value. */
static int capture(jrender *r, jscope *s, jnode **kids, size_t n, m40_jvalue *out)
{
    jbuf b, *saved = r->out;
    jbuf_init(&b, r->lim.max_output);
    r->out = &b;
    int rc = exec_block(r, s, kids, n);
    r->out = saved;
    if (rc == X_OK && b.failed)
        rc = jr_fail(r, 0, "rendered output exceeds %zu bytes", r->lim.max_output);
    else if (rc == X_BREAK || rc == X_CONTINUE)
        rc = jr_fail(r, 0, "break or continue outside of a loop");
    if (rc == X_OK && jv_str_from_buf(r->arena, &b, out))
        rc = jr_oom(r);
    jbuf_free(&b);
    return rc;
}

static int call_macro(jrender *r, int line, const m40_jcallable *fn, m40_jvalue *args, size_t nargs,
                      const char **kwnames, m40_jvalue *kwvals, size_t nkw, const m40_jcallable *caller,
                      m40_jvalue *out)
{
    const jnode *m = fn->node;
    if (nargs > m->nnames)
        return jr_fail(r, line, "macro '%s' takes not more than %zu argument(s)", fn->name, m->nnames);
    if (r->depth >= r->lim.max_depth)
        return jr_fail(r, line, "macro calls nest deeper than %d", r->lim.max_depth);
    if (jr_step(r, line))
        return -1;
    jscope *s = scope_new(r, fn->closure);
    if (!s)
        return jr_oom(r);
    for (size_t k = 0; k < nkw; k++) {
        size_t i;
        for (i = 0; i < m->nnames; i++)
            if (!strcmp(m->names[i], kwnames[k]))
                break;
        if (i == m->nnames)
            return jr_fail(r, line, "macro '%s' has no argument '%s'", fn->name, kwnames[k]);
        if (i < nargs)
            return jr_fail(r, line, "macro '%s' got multiple values for argument '%s'", fn->name, kwnames[k]);
    }
    for (size_t i = 0; i < m->nnames; i++) {
        m40_jvalue v;
        int have = 0;
        if (i < nargs) {
            v = args[i];
            have = 1;
        }
        for (size_t k = 0; !have && k < nkw; k++)
            if (!strcmp(m->names[i], kwnames[k])) {
                v = kwvals[k];
                have = 1;
            }
        if (!have) {
            if (m->kids2 && m->kids2[i]) {
                if (eval(r, s, m->kids2[i], &v))
                    return -1;
            } else {
                v = jr_undefined(r, m->names[i]);
            }
        }
        if (scope_set(r, s, m->names[i], v))
            return -1;
    }
    if (caller) {
        m40_jvalue cv = {.type = M40_JV_CALLABLE, .u.fn = (m40_jcallable *)caller};
        if (scope_set(r, s, "caller", cv))
            return -1;
    }
    r->depth++;
    int rc = capture(r, s, m->kids, m->nkids, out);
    r->depth--;
    return rc;
}

int jr_call(jrender *r, int line, m40_jvalue fn, m40_jvalue *args, size_t nargs, const char **kwnames,
            m40_jvalue *kwvals, size_t nkw, m40_jvalue *out)
{
    if (fn.type == M40_JV_UNDEFINED)
        return jr_undefined_error(r, line, fn);
    if (fn.type != M40_JV_CALLABLE)
        return jr_fail(r, line, "'%s' object is not callable", jv_type_name(fn));
    const m40_jcallable *f = fn.u.fn;
    switch ((int)f->kind) {
    case JFN_MACRO:
        return call_macro(r, line, f, args, nargs, kwnames, kwvals, nkw, NULL, out);
    case JFN_BUILTIN:
        return jb_call_global(r, line, f, args, nargs, kwnames, kwvals, nkw, out);
    case JFN_METHOD:
        if (f->self.type == M40_JV_CALLABLE && (int)f->self.u.fn->kind == JFN_LOOP) {
            /* loop.cycle(a, b, ...) */
            const jloop *lp = (const jloop *)(const void *)f->self.u.fn->node;
            if (!nargs)
                return jr_fail(r, line, "no items for cycling given");
            *out = args[lp->index0 % nargs];
            return 0;
        }
        return jb_call_method(r, line, f, args, nargs, kwnames, kwvals, nkw, out);
    default:
        return jr_fail(r, line, "'loop' object is not callable (recursive loops are not supported)");
    }
}

/* Evaluate call arguments of n (kids = positional, names/kids2 = keyword). */
static int eval_args(jrender *r, jscope *s, const jnode *n, m40_jvalue **args, m40_jvalue **kw)
{
    size_t total = n->nkids + n->nkids2;
    m40_jvalue *buf = m40_jarena_alloc(r->arena, (total ? total : 1) * sizeof *buf);
    if (!buf)
        return jr_oom(r);
    for (size_t i = 0; i < n->nkids; i++)
        if (eval(r, s, n->kids[i], &buf[i]))
            return -1;
    for (size_t i = 0; i < n->nkids2; i++)
        if (eval(r, s, n->kids2[i], &buf[n->nkids + i]))
            return -1;
    *args = buf;
    *kw = buf + n->nkids;
    return 0;
}

/* ------------------------------------------------------------------ expressions */

static int eval_node(jrender *r, jscope *s, const jnode *n, m40_jvalue *out);

/* Every expression evaluation passes here: the nesting bound keeps a hostile template
 * from running the thread's stack out. */
static int eval(jrender *r, jscope *s, const jnode *n, m40_jvalue *out)
{
    if (r->edepth >= JR_MAX_EVAL_DEPTH)
        return jr_fail(r, n->line, "expression nests deeper than %d levels", JR_MAX_EVAL_DEPTH);
    r->edepth++;
    const int rc = eval_node(r, s, n, out);
    r->edepth--;
    return rc;
}

static int eval_node(jrender *r, jscope *s, const jnode *n, m40_jvalue *out)
{
    m40_jvalue a, b;
    switch (n->kind) {
    case N_CONST:
        *out = n->val;
        return 0;
    case N_NAME:
        return lookup(r, s, n->name, out);
    case N_BLOCKVAL:
        *out = r->blockval;
        return 0;
    case N_LIST:
    case N_TUPLE:
        if (m40_jv_list(r->arena, out))
            return jr_oom(r);
        out->u.l->kind = n->kind == N_TUPLE ? JL_TUPLE : JL_LIST;
        for (size_t i = 0; i < n->nkids; i++) {
            if (eval(r, s, n->kids[i], &a))
                return -1;
            if (m40_jv_list_push(r->arena, *out, a))
                return jr_oom(r);
        }
        return 0;
    case N_DICT:
        if (m40_jv_dict(r->arena, out))
            return jr_oom(r);
        for (size_t i = 0; i < n->nkids; i++) {
            if (eval(r, s, n->kids[i], &a) || eval(r, s, n->kids2[i], &b))
                return -1;
            if (a.type == M40_JV_LIST || a.type == M40_JV_DICT || a.type == M40_JV_NAMESPACE ||
                a.type == M40_JV_UNDEFINED)
                return jr_fail(r, n->line, "unhashable type: '%s'", jv_type_name(a));
            if (m40_jv_dict_set(r->arena, *out, a, b))
                return jr_oom(r);
        }
        return 0;
    case N_ATTR:
        if (eval(r, s, n->a, &a))
            return -1;
        return jr_getattr(r, n->line, a, n->name, out);
    case N_ITEM:
        if (eval(r, s, n->a, &a) || eval(r, s, n->b, &b))
            return -1;
        return jr_getitem(r, n->line, a, b, out);
    case N_SLICE:
        return eval_slice(r, s, n, out);
    case N_CALL: {
        m40_jvalue fn, *args, *kw;
        if (eval(r, s, n->a, &fn) || eval_args(r, s, n, &args, &kw))
            return -1;
        return jr_call(r, n->line, fn, args, n->nkids, n->names, kw, n->nkids2, out);
    }
    case N_FILTER: {
        m40_jvalue *args, *kw;
        if (eval(r, s, n->a, &a) || eval_args(r, s, n, &args, &kw))
            return -1;
        return jb_filter(r, n->line, n->name, a, args, n->nkids, n->names, kw, n->nkids2, out);
    }
    case N_TEST: {
        m40_jvalue *args, *kw;
        int res;
        if (eval(r, s, n->a, &a) || eval_args(r, s, n, &args, &kw))
            return -1;
        if (jb_test(r, n->line, n->name, a, args, n->nkids, &res))
            return -1;
        *out = m40_jv_bool(n->op ? !res : res);
        return 0;
    }
    case N_NEG:
    case N_POS:
        if (eval(r, s, n->a, &a))
            return -1;
        if (a.type == M40_JV_FLOAT)
            *out = m40_jv_float(n->kind == N_NEG ? -a.u.f : a.u.f);
        else if (a.type == M40_JV_INT || a.type == M40_JV_BOOL) {
            int64_t v = a.type == M40_JV_BOOL ? a.u.b : a.u.i;
            if (n->kind == N_NEG && v == INT64_MIN)
                return jr_fail(r, n->line, "integer overflow");
            *out = m40_jv_int(n->kind == N_NEG ? -v : v);
        } else if (a.type == M40_JV_UNDEFINED)
            return jr_undefined_error(r, n->line, a);
        else
            return jr_fail(r, n->line, "bad operand type for unary %c: '%s'", n->kind == N_NEG ? '-' : '+',
                           jv_type_name(a));
        return 0;
    case N_NOT:
        if (eval(r, s, n->a, &a))
            return -1;
        *out = m40_jv_bool(!jv_truthy(a));
        return 0;
    case N_AND:
        if (eval(r, s, n->a, &a))
            return -1;
        if (!jv_truthy(a)) {
            *out = a;
            return 0;
        }
        return eval(r, s, n->b, out);
    case N_OR:
        if (eval(r, s, n->a, &a))
            return -1;
        if (jv_truthy(a)) {
            *out = a;
            return 0;
        }
        return eval(r, s, n->b, out);
    case N_BINOP:
        if (eval(r, s, n->a, &a) || eval(r, s, n->b, &b))
            return -1;
        return jr_arith(r, n->line, n->op, a, b, out);
    case N_CONCAT: {
        jbuf buf;
        jbuf_init(&buf, r->lim.max_output);
        for (size_t i = 0; i < n->nkids; i++) {
            if (eval(r, s, n->kids[i], &a)) {
                jbuf_free(&buf);
                return -1;
            }
            jv_write_str(&buf, a);
        }
        int rc = buf.failed ? jr_fail(r, n->line, "string too long") : jv_str_from_buf(r->arena, &buf, out) ? jr_oom(r) : 0;
        jbuf_free(&buf);
        return rc;
    }
    case N_COMPARE: {
        if (eval(r, s, n->a, &a))
            return -1;
        for (size_t i = 0; i < n->nkids; i++) {
            int res = 0, cmp;
            if (eval(r, s, n->kids[i], &b))
                return -1;
            switch (n->ops[i]) {
            case OP_EQ: res = jv_equal(a, b); break;
            case OP_NE: res = !jv_equal(a, b); break;
            case OP_IN:
            case OP_NOTIN:
                if (jr_contains(r, n->line, a, b, &res))
                    return -1;
                if (n->ops[i] == OP_NOTIN)
                    res = !res;
                break;
            default: {
                static const char *nm[] = {[OP_LT] = "<", [OP_LE] = "<=", [OP_GT] = ">", [OP_GE] = ">="};
                if (jr_order(r, n->line, nm[n->ops[i]], a, b, &cmp))
                    return -1;
                if (cmp == 2)
                    res = 0;
                else
                    res = n->ops[i] == OP_LT ? cmp < 0 : n->ops[i] == OP_LE ? cmp <= 0
                        : n->ops[i] == OP_GT ? cmp > 0 : cmp >= 0;
            }
            }
            if (!res) {
                *out = m40_jv_bool(0);
                return 0;
            }
            a = b;
        }
        *out = m40_jv_bool(1);
        return 0;
    }
    case N_COND:
        if (eval(r, s, n->b, &a))
            return -1;
        if (jv_truthy(a))
            return eval(r, s, n->a, out);
        if (n->c)
            return eval(r, s, n->c, out);
        *out = m40_jv_undefined();
        return 0;
    default:
        return jr_fail(r, n->line, "internal error: statement node in expression");
    }
}

/* ------------------------------------------------------------------ statements */

static int assign(jrender *r, jscope *s, const jnode *target, m40_jvalue v, int line)
{
    if (target->kind == N_NAME)
        return scope_set(r, s, target->name, v);
    if (target->kind == N_ATTR) {
        m40_jvalue obj;
        if (lookup(r, s, target->a->name, &obj))
            return -1;
        if (obj.type != M40_JV_NAMESPACE)
            return jr_fail(r, line, "cannot assign attribute on non-namespace object");
        m40_jvalue key;
        if (m40_jv_cstr(r->arena, target->name, &key) || m40_jv_dict_set(r->arena, obj, key, v))
            return jr_oom(r);
        return 0;
    }
    /* tuple unpacking */
    m40_jvalue items;
    if (jb_to_list(r, line, v, &items))
        return -1;
    if (items.u.l->n != target->nkids)
        return jr_fail(r, line, "cannot unpack %zu values into %zu names", items.u.l->n, target->nkids);
    for (size_t i = 0; i < target->nkids; i++)
        if (scope_set(r, s, target->kids[i]->name, items.u.l->v[i]))
            return -1;
    return 0;
}

static int bind_targets(jrender *r, jscope *s, const jnode *n, m40_jvalue item)
{
    if (!n->op)
        return scope_set(r, s, n->names[0], item);
    m40_jvalue parts;
    if (jb_to_list(r, n->line, item, &parts))
        return -1;
    if (parts.u.l->n != n->nnames)
        return jr_fail(r, n->line, "cannot unpack %zu values into %zu loop variables", parts.u.l->n, n->nnames);
    for (size_t i = 0; i < n->nnames; i++)
        if (scope_set(r, s, n->names[i], parts.u.l->v[i]))
            return -1;
    return 0;
}

static int exec_for(jrender *r, jscope *s, const jnode *n)
{
    m40_jvalue it, items;
    if (eval(r, s, n->a, &it) || jb_to_list(r, n->line, it, &items))
        return X_ERR;
    if (n->b) { /* `for x in xs if cond`: filter first, so loop.length/last see the result */
        m40_jvalue kept;
        if (m40_jv_list(r->arena, &kept))
            return jr_oom(r);
        jscope *fs = scope_new(r, s);
        if (!fs)
            return jr_oom(r);
        for (size_t i = 0; i < items.u.l->n; i++) {
            m40_jvalue c;
            if (jr_step(r, n->line))
                return X_ERR;
            fs->n = 0;
            if (bind_targets(r, fs, n, items.u.l->v[i]) || eval(r, fs, n->b, &c))
                return X_ERR;
            if (jv_truthy(c) && m40_jv_list_push(r->arena, kept, items.u.l->v[i]))
                return jr_oom(r);
        }
        items = kept;
    }
    jloop *lp = m40_jarena_alloc(r->arena, sizeof *lp);
    m40_jcallable *lfn = m40_jarena_alloc(r->arena, sizeof *lfn);
    jscope *body = scope_new(r, s);
    if (!lp || !lfn || !body)
        return jr_oom(r);
    lp->items = items.u.l;
    lp->length = items.u.l->n;
    memset(lfn, 0, sizeof *lfn);
    lfn->kind = (enum jfn_kind)JFN_LOOP;
    lfn->name = "loop";
    lfn->node = (const jnode *)(const void *)lp;
    m40_jvalue loopv = {.type = M40_JV_CALLABLE, .u.fn = lfn};
    for (size_t i = 0; i < lp->length; i++) {
        if (jr_step(r, n->line))
            return X_ERR;
        lp->index0 = i;
        body->n = 0; /* each iteration starts from the outer values, as in jinja2 */
        if (scope_set(r, body, "loop", loopv) || bind_targets(r, body, n, lp->items->v[i]))
            return X_ERR;
        int rc = exec_block(r, body, n->kids, n->nkids);
        if (rc == X_ERR)
            return X_ERR;
        if (rc == X_BREAK)
            break;
    }
    if (lp->length == 0 && n->c)
        return exec_block(r, s, n->kids2, n->nkids2);
    return X_OK;
}

static int exec_stmt(jrender *r, jscope *s, const jnode *n)
{
    m40_jvalue v;
    switch (n->kind) {
    case N_TEXT:
        if (jr_step(r, n->line))
            return X_ERR;
        if (jbuf_put(r->out, n->val.u.s->s, n->val.u.s->len))
            return jr_fail(r, 0, "rendered output exceeds %zu bytes", r->lim.max_output);
        return X_OK;
    case N_OUTPUT:
        if (jr_step(r, n->line) || eval(r, s, n->a, &v))
            return X_ERR;
        if (jv_write_str(r->out, v))
            return jr_fail(r, 0, "rendered output exceeds %zu bytes", r->lim.max_output);
        return X_OK;
    case N_IF:
        if (eval(r, s, n->a, &v))
            return X_ERR;
        if (jv_truthy(v))
            return exec_block(r, s, n->kids, n->nkids);
        return exec_block(r, s, n->kids2, n->nkids2);
    case N_FOR:
        return exec_for(r, s, n);
    case N_SET:
        if (eval(r, s, n->b, &v))
            return X_ERR;
        return assign(r, s, n->a, v, n->line) ? X_ERR : X_OK;
    case N_SETBLOCK:
    case N_FILTERBLOCK: {
        if (capture(r, s, n->kids, n->nkids, &v))
            return X_ERR;
        if (n->b) {
            m40_jvalue saved = r->blockval;
            r->blockval = v;
            int rc = eval(r, s, n->b, &v);
            r->blockval = saved;
            if (rc)
                return X_ERR;
        }
        if (n->kind == N_SETBLOCK)
            return assign(r, s, n->a, v, n->line) ? X_ERR : X_OK;
        if (jv_write_str(r->out, v))
            return jr_fail(r, 0, "rendered output exceeds %zu bytes", r->lim.max_output);
        return X_OK;
    }
    case N_MACRO: {
        m40_jcallable *fn = m40_jarena_alloc(r->arena, sizeof *fn);
        if (!fn)
            return jr_oom(r);
        memset(fn, 0, sizeof *fn);
        fn->kind = JFN_MACRO;
        fn->name = n->name;
        fn->node = n;
        fn->closure = s;
        m40_jvalue fv = {.type = M40_JV_CALLABLE, .u.fn = fn};
        return scope_set(r, s, n->name, fv) ? X_ERR : X_OK;
    }
    case N_CALLBLOCK: {
        /* caller() renders this block's body in the scope the block appears in */
        m40_jcallable *caller = m40_jarena_alloc(r->arena, sizeof *caller);
        if (!caller)
            return jr_oom(r);
        memset(caller, 0, sizeof *caller);
        caller->kind = JFN_MACRO;
        caller->name = "caller";
        caller->node = n;
        caller->closure = s;
        const jnode *call = n->a;
        m40_jvalue fn, *args, *kw;
        if (eval(r, s, call->a, &fn) || eval_args(r, s, call, &args, &kw))
            return X_ERR;
        if (fn.type != M40_JV_CALLABLE || fn.u.fn->kind != JFN_MACRO)
            return jr_fail(r, n->line, "{%% call %%} needs a macro");
        if (call_macro(r, n->line, fn.u.fn, args, call->nkids, call->names, kw, call->nkids2, caller, &v))
            return X_ERR;
        if (jv_write_str(r->out, v))
            return jr_fail(r, 0, "rendered output exceeds %zu bytes", r->lim.max_output);
        return X_OK;
    }
    case N_SCOPE: {
        jscope *inner = scope_new(r, s);
        if (!inner)
            return jr_oom(r);
        return exec_block(r, inner, n->kids, n->nkids);
    }
    case N_BLOCK:
        return exec_block(r, s, n->kids, n->nkids);
    case N_BREAK:
        return X_BREAK;
    case N_CONTINUE:
        return X_CONTINUE;
    default:
        return jr_fail(r, n->line, "internal error: expression node as statement");
    }
}

static int exec_block(jrender *r, jscope *s, jnode **kids, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        int rc = exec_stmt(r, s, kids[i]);
        if (rc != X_OK)
            return rc;
    }
    return X_OK;
}

/* ------------------------------------------------------------------ API */

int m40_jinja_render(const m40_jinja *t, m40_jvalue ctx, const m40_jinja_limits *limits, char **out,
                     size_t *out_len, char *err, size_t errlen)
{
    *out = NULL;
    if (out_len)
        *out_len = 0;
    jrender r;
    memset(&r, 0, sizeof r);
    if (limits)
        r.lim = *limits;
    if (!r.lim.max_output)
        r.lim.max_output = (size_t)4 << 20;
    if (!r.lim.max_memory)
        r.lim.max_memory = (size_t)64 << 20;
    if (!r.lim.max_steps)
        r.lim.max_steps = 10000000;
    if (!r.lim.max_depth)
        r.lim.max_depth = 64;
    r.err = err;
    r.errlen = errlen;
    if (ctx.type != M40_JV_DICT) {
        snprintf(err, errlen, "render context must be a dict");
        return -1;
    }
    r.ctx = ctx;
    r.arena = m40_jarena_new(r.lim.max_memory);
    if (!r.arena) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    jbuf b;
    jbuf_init(&b, r.lim.max_output);
    r.out = &b;
    r.root = scope_new(&r, NULL);
    int rc = r.root ? exec_block(&r, r.root, t->root->kids, t->root->nkids) : jr_oom(&r);
    if (rc == X_BREAK || rc == X_CONTINUE)
        rc = jr_fail(&r, 0, "break or continue outside of a loop");
    if (rc == X_OK && b.failed)
        rc = jr_fail(&r, 0, "rendered output exceeds %zu bytes", r.lim.max_output);
    m40_jarena_free(r.arena);
    if (rc != X_OK) {
        jbuf_free(&b);
        return -1;
    }
    if (!b.p && jbuf_put(&b, "", 0)) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    *out = b.p;
    if (out_len)
        *out_len = b.len;
    return 0;
}

int m40_chat_template_render_parsed(const m40_jinja *t, const json_t *messages, const json_t *tools,
                                    int add_generation_prompt, const char *bos, const char *eos,
                                    const json_t *extra, const m40_jinja_limits *limits, char **out,
                                    size_t *out_len, char *err, size_t errlen)
{
    *out = NULL;
    m40_jarena *a = m40_jarena_new(0);
    if (!a) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    m40_jvalue ctx, v;
    int rc = -1;
    if (m40_jv_dict(a, &ctx))
        goto oom;
    if (extra) {
        if (!json_is_object(extra)) {
            snprintf(err, errlen, "extra template variables must be a JSON object");
            goto done;
        }
        const char *key;
        json_t *val;
        json_object_foreach((json_t *)extra, key, val) {
            if (m40_jv_from_json(a, val, &v, err, errlen))
                goto done;
            if (m40_jv_dict_set_cstr(a, ctx, key, v))
                goto oom;
        }
    }
    if (m40_jv_from_json(a, messages, &v, err, errlen))
        goto done;
    if (m40_jv_dict_set_cstr(a, ctx, "messages", v))
        goto oom;
    /* HF passes tools=None when there are none, so `tools is defined` holds and
     * `tools is none` tells them apart. */
    if (m40_jv_from_json(a, tools, &v, err, errlen))
        goto done;
    if (m40_jv_dict_set_cstr(a, ctx, "tools", v) ||
        m40_jv_dict_set_cstr(a, ctx, "add_generation_prompt", m40_jv_bool(add_generation_prompt)) ||
        m40_jv_cstr(a, bos ? bos : "", &v) || m40_jv_dict_set_cstr(a, ctx, "bos_token", v) ||
        m40_jv_cstr(a, eos ? eos : "", &v) || m40_jv_dict_set_cstr(a, ctx, "eos_token", v))
        goto oom;
    rc = m40_jinja_render(t, ctx, limits, out, out_len, err, errlen);
    goto done;
oom:
    snprintf(err, errlen, "out of memory building the template context");
done:
    m40_jarena_free(a);
    return rc;
}

int m40_chat_template_render(const char *template_src, const json_t *messages, const json_t *tools,
                             int add_generation_prompt, const char *bos, const char *eos,
                             const json_t *extra, const m40_jinja_limits *limits, char **out,
                             size_t *out_len, char *err, size_t errlen)
{
    m40_jinja *t;
    *out = NULL;
    if (m40_jinja_parse(template_src, strlen(template_src), &t, err, errlen))
        return -1;
    int rc = m40_chat_template_render_parsed(t, messages, tools, add_generation_prompt, bos, eos, extra,
                                             limits, out, out_len, err, errlen);
    m40_jinja_free(t);
    return rc;
}
