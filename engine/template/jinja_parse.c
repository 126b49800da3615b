/* Lexer and parser: template source -> AST (jnode), following jinja2's lexer rules
 * with trim_blocks=True and lstrip_blocks=True and its expression grammar
 * (precedence from loosest: `x if c else y`, or, and, not, comparisons, + -, ~,
 * * / // %, **, unary -, then postfix . [] () and filters/tests).
 *
 * Node fields by kind (see jnode in jinja_int.h):
 *   N_TEXT val            N_OUTPUT a             N_IF a=cond kids=then kids2=else
 *   N_FOR names=targets a=iterable b=filter cond kids=body kids2=else
 *   N_SET a=target(N_NAME|N_TUPLE|N_ATTR) b=value   N_SETBLOCK a=target b=filters kids
 *   N_MACRO name names=params kids2=defaults(NULL=none) kids=body
 *   N_CALLBLOCK a=N_CALL names/kids2=caller params kids=body
 *   N_FILTERBLOCK b=filter chain on N_BLOCKVAL kids=body   N_BLOCK kids
 *   N_CONST val  N_NAME name  N_LIST/N_TUPLE kids  N_DICT kids=keys kids2=values
 *   N_ATTR a name  N_ITEM a b  N_SLICE a kids[3]  N_CALL a kids=args names/kids2=kwargs
 *   N_FILTER name a kids/names/kids2   N_TEST name a kids op=negated
 *   N_NEG/N_POS/N_NOT a  N_BINOP op a b  N_AND/N_OR a b  N_COMPARE a kids ops
 *   N_COND a=then b=cond c=else(NULL: undefined)  N_CONCAT kids */
#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "jinja_int.h"

/* ------------------------------------------------------------------ parser helpers */

static jtoken *cur(jparser *p) { return &p->toks[p->pos]; }
static jtoken *peek(jparser *p, size_t k)
{
    size_t i = p->pos + k;
    return &p->toks[i < p->ntoks ? i : p->ntoks - 1];
}
static int is_op(jtoken *t, const char *op) { return t->kind == T_OP && t->len == strlen(op) && memcmp(t->s, op, t->len) == 0; }
static int is_name(jtoken *t, const char *nm) { return t->kind == T_NAME && t->len == strlen(nm) && memcmp(t->s, nm, t->len) == 0; }

static const char *tok_desc(jtoken *t)
{
    switch (t->kind) {
    case T_DATA: return "template data";
    case T_VAR_BEGIN: return "'{{'";
    case T_VAR_END: return "'}}'";
    case T_BLOCK_BEGIN: return "'{%'";
    case T_BLOCK_END: return "'%}'";
    case T_NAME: return "a name";
    case T_STRING: return "a string";
    case T_INT: return "an integer";
    case T_FLOAT: return "a float";
    case T_OP: return "an operator";
    default: return "end of template";
    }
}

static void expect_op(jparser *p, const char *op)
{
    if (!is_op(cur(p), op))
        jp_fail(p, cur(p)->line, "expected '%s', got %s", op, tok_desc(cur(p)));
    p->pos++;
}

static int skip_op(jparser *p, const char *op)
{
    if (is_op(cur(p), op)) {
        p->pos++;
        return 1;
    }
    return 0;
}

static int skip_name(jparser *p, const char *nm)
{
    if (is_name(cur(p), nm)) {
        p->pos++;
        return 1;
    }
    return 0;
}

static const char *tok_name(jparser *p, jtoken *t)
{
    char *s = jp_alloc(p, t->len + 1);
    memcpy(s, t->s, t->len);
    s[t->len] = 0;
    return s;
}

static const char *expect_name(jparser *p)
{
    jtoken *t = cur(p);
    if (t->kind != T_NAME)
        jp_fail(p, t->line, "expected a name, got %s", tok_desc(t));
    p->pos++;
    return tok_name(p, t);
}

static void expect_block_end(jparser *p)
{
    if (cur(p)->kind != T_BLOCK_END)
        jp_fail(p, cur(p)->line, "expected end of statement '%%}', got %s", tok_desc(cur(p)));
    p->pos++;
}

static jnode *mk(jparser *p, enum jnode_kind k, int line)
{
    jnode *n = jp_alloc(p, sizeof *n);
    memset(n, 0, sizeof *n);
    n->kind = k;
    n->line = line;
    return n;
}

/* Growable node vector, copied into the arena when done. */
typedef struct {
    jnode **v;
    const char **names;
    size_t n, cap;
} nvec;

static void nv_push(jparser *p, nvec *v, jnode *x, const char *name)
{
    if (v->n == v->cap) {
        size_t nc = v->cap ? v->cap * 2 : 8;
        jnode **nn = jp_alloc(p, nc * sizeof *nn);
        const char **nm = jp_alloc(p, nc * sizeof *nm);
        if (v->n) {
            memcpy(nn, v->v, v->n * sizeof *nn);
            memcpy(nm, v->names, v->n * sizeof *nm);
        }
        v->v = nn;
        v->names = nm;
        v->cap = nc;
    }
    v->v[v->n] = x;
    v->names[v->n] = name;
    v->n++;
}

static void enter(jparser *p)
{
    if (++p->depth > JP_MAX_DEPTH)
        jp_fail(p, cur(p)->line, "template nests too deeply (more than %d levels)", JP_MAX_DEPTH);
}
static void leave(jparser *p) { p->depth--; }

/* ------------------------------------------------------------------ expressions */

static jnode *parse_expression(jparser *p, int with_condexpr);
static jnode *parse_tuple(jparser *p, int with_condexpr, int explicit_parens);
static jnode *parse_unary(jparser *p, int with_filter);
static jnode *parse_filter(jparser *p, jnode *node, int start_inline);

/* (args, kw=...) after the opening '(' has been seen at cur. */
static void parse_call_args(jparser *p, jnode *call)
{
    nvec args = {0}, kw = {0};
    expect_op(p, "(");
    while (!is_op(cur(p), ")")) {
        if (args.n || kw.n)
            expect_op(p, ",");
        if (is_op(cur(p), ")"))
            break;
        if (is_op(cur(p), "*") || is_op(cur(p), "**"))
            jp_fail(p, cur(p)->line, "*args and **kwargs in calls are not supported");
        if (cur(p)->kind == T_NAME && is_op(peek(p, 1), "=")) {
            const char *nm = expect_name(p);
            p->pos++;
            nv_push(p, &kw, parse_expression(p, 1), nm);
        } else {
            if (kw.n)
                jp_fail(p, cur(p)->line, "positional argument after keyword argument");
            nv_push(p, &args, parse_expression(p, 1), NULL);
        }
    }
    p->pos++;
    call->kids = args.v;
    call->nkids = args.n;
    call->kids2 = kw.v;
    call->names = kw.names;
    call->nkids2 = call->nnames = kw.n;
}

static jnode *parse_primary(jparser *p)
{
    jtoken *t = cur(p);
    jnode *n;
    enter(p);
    switch (t->kind) {
    case T_NAME:
        p->pos++;
        n = mk(p, N_CONST, t->line);
        if (is_name(t, "true") || is_name(t, "True"))
            n->val = m40_jv_bool(1);
        else if (is_name(t, "false") || is_name(t, "False"))
            n->val = m40_jv_bool(0);
        else if (is_name(t, "none") || is_name(t, "None"))
            n->val = m40_jv_none();
        else {
            n->kind = N_NAME;
            n->name = tok_name(p, t);
        }
        break;
    case T_STRING: {
        /* adjacent literals concatenate, as in Python */
        jbuf b;
        jbuf_init(&b, 0);
        while (cur(p)->kind == T_STRING) {
            jbuf_put(&b, cur(p)->s, cur(p)->len);
            p->pos++;
        }
        n = mk(p, N_CONST, t->line);
        int rc = b.failed ? -1 : m40_jv_str(p->arena, b.p ? b.p : "", b.len, &n->val);
        jbuf_free(&b);
        if (rc)
            jp_fail(p, t->line, "out of memory");
        break;
    }
    case T_INT:
        p->pos++;
        n = mk(p, N_CONST, t->line);
        n->val = m40_jv_int(t->i);
        break;
    case T_FLOAT:
        p->pos++;
        n = mk(p, N_CONST, t->line);
        n->val = m40_jv_float(t->f);
        break;
    case T_OP:
        if (is_op(t, "(")) {
            p->pos++;
            n = parse_tuple(p, 1, 1);
            expect_op(p, ")");
        } else if (is_op(t, "[")) {
            p->pos++;
            nvec items = {0};
            while (!is_op(cur(p), "]")) {
                if (items.n)
                    expect_op(p, ",");
                if (is_op(cur(p), "]"))
                    break;
                nv_push(p, &items, parse_expression(p, 1), NULL);
            }
            p->pos++;
            n = mk(p, N_LIST, t->line);
            n->kids = items.v;
            n->nkids = items.n;
        } else if (is_op(t, "{")) {
            p->pos++;
            nvec keys = {0}, vals = {0};
            while (!is_op(cur(p), "}")) {
                if (keys.n)
                    expect_op(p, ",");
                if (is_op(cur(p), "}"))
                    break;
                nv_push(p, &keys, parse_expression(p, 1), NULL);
                expect_op(p, ":");
                nv_push(p, &vals, parse_expression(p, 1), NULL);
            }
            p->pos++;
            n = mk(p, N_DICT, t->line);
            n->kids = keys.v;
            n->nkids = keys.n;
            n->kids2 = vals.v;
            n->nkids2 = vals.n;
        } else {
            jp_fail(p, t->line, "unexpected '%.*s'", (int)t->len, t->s);
        }
        break;
    default:
        jp_fail(p, t->line, "unexpected %s", tok_desc(t));
    }
    leave(p);
    return n;
}

static jnode *parse_subscribed(jparser *p)
{
    int line = cur(p)->line;
    jnode *args[3] = {NULL, NULL, NULL};
    if (is_op(cur(p), ":")) {
        p->pos++;
    } else {
        jnode *e = parse_expression(p, 1);
        if (!is_op(cur(p), ":"))
            return e;
        p->pos++;
        args[0] = e;
    }
    if (!is_op(cur(p), ":") && !is_op(cur(p), "]") && !is_op(cur(p), ","))
        args[1] = parse_expression(p, 1);
    if (skip_op(p, ":"))
        if (!is_op(cur(p), "]") && !is_op(cur(p), ","))
            args[2] = parse_expression(p, 1);
    jnode *s = mk(p, N_SLICE, line);
    s->kids = jp_alloc(p, 3 * sizeof(jnode *));
    memcpy(s->kids, args, sizeof args);
    s->nkids = 3;
    return s;
}

static jnode *parse_postfix(jparser *p, jnode *node)
{
    for (;;) {
        jtoken *t = cur(p);
        if (is_op(t, ".")) {
            p->pos++;
            jtoken *a = cur(p);
            if (a->kind == T_NAME) {
                jnode *n = mk(p, N_ATTR, t->line);
                n->a = node;
                n->name = expect_name(p);
                node = n;
            } else if (a->kind == T_INT) {
                p->pos++;
                jnode *n = mk(p, N_ITEM, t->line), *k = mk(p, N_CONST, t->line);
                k->val = m40_jv_int(a->i);
                n->a = node;
                n->b = k;
                node = n;
            } else {
                jp_fail(p, a->line, "expected a name after '.'");
            }
        } else if (is_op(t, "[")) {
            p->pos++;
            nvec idx = {0};
            while (!is_op(cur(p), "]")) {
                if (idx.n)
                    expect_op(p, ",");
                if (is_op(cur(p), "]"))
                    break;
                nv_push(p, &idx, parse_subscribed(p), NULL);
            }
            p->pos++;
            if (idx.n == 0)
                jp_fail(p, t->line, "empty subscript");
            jnode *n = mk(p, N_ITEM, t->line);
            n->a = node;
            if (idx.n == 1) {
                n->b = idx.v[0];
            } else {
                /* x[1, :]: a slice is a subscript of its own (its node holds the
                 * object), never an item of a tuple of subscripts */
                for (size_t k = 0; k < idx.n; k++)
                    if (idx.v[k]->kind == N_SLICE)
                        jp_fail(p, t->line, "a slice cannot be part of a tuple subscript");
                n->b = mk(p, N_TUPLE, t->line);
                n->b->kids = idx.v;
                n->b->nkids = idx.n;
            }
            if (n->b->kind == N_SLICE) { /* x[a:b] is its own node kind */
                n->b->a = node;
                node = n->b;
            } else {
                node = n;
            }
        } else if (is_op(t, "(")) {
            jnode *n = mk(p, N_CALL, t->line);
            n->a = node;
            parse_call_args(p, n);
            node = n;
        } else {
            return node;
        }
    }
}

static jnode *parse_test(jparser *p, jnode *node)
{
    int line = cur(p)->line;
    p->pos++; /* 'is' */
    int negated = skip_name(p, "not");
    jnode *n = mk(p, N_TEST, line);
    n->a = node;
    n->op = negated;
    jtoken *t = cur(p);
    if (t->kind != T_NAME)
        jp_fail(p, t->line, "expected a test name after 'is'");
    /* `none`, `true`, `false` are tests here, not constants */
    n->name = expect_name(p);
    while (skip_op(p, "."))
        n->name = expect_name(p); /* dotted names: the last part names the test */
    t = cur(p);
    if (is_op(t, "(")) {
        jnode tmp;
        memset(&tmp, 0, sizeof tmp);
        parse_call_args(p, &tmp);
        n->kids = tmp.kids;
        n->nkids = tmp.nkids;
        if (tmp.nkids2)
            jp_fail(p, line, "keyword arguments to tests are not supported");
    } else if ((t->kind == T_NAME || t->kind == T_STRING || t->kind == T_INT || t->kind == T_FLOAT ||
                is_op(t, "(") || is_op(t, "[") || is_op(t, "{")) &&
               !is_name(t, "else") && !is_name(t, "or") && !is_name(t, "and")) {
        if (is_name(t, "is"))
            jp_fail(p, t->line, "you cannot chain multiple tests with is");
        jnode *arg = parse_postfix(p, parse_primary(p));
        n->kids = jp_alloc(p, sizeof(jnode *));
        n->kids[0] = arg;
        n->nkids = 1;
    }
    return n;
}

static jnode *parse_filter_expr(jparser *p, jnode *node)
{
    for (;;) {
        jtoken *t = cur(p);
        if (is_op(t, "|"))
            node = parse_filter(p, node, 0);
        else if (is_name(t, "is"))
            node = parse_test(p, node);
        else if (is_op(t, "(")) {
            jnode *n = mk(p, N_CALL, t->line);
            n->a = node;
            parse_call_args(p, n);
            node = n;
        } else
            return node;
    }
}

/* `| name(args)` chains; start_inline: the first name has no leading '|'. */
static jnode *parse_filter(jparser *p, jnode *node, int start_inline)
{
    while (is_op(cur(p), "|") || start_inline) {
        if (!start_inline)
            p->pos++;
        start_inline = 0;
        int line = cur(p)->line;
        jnode *f = mk(p, N_FILTER, line);
        f->name = expect_name(p);
        while (skip_op(p, "."))
            f->name = expect_name(p);
        f->a = node;
        if (is_op(cur(p), "(")) {
            jnode tmp;
            memset(&tmp, 0, sizeof tmp);
            parse_call_args(p, &tmp);
            f->kids = tmp.kids;
            f->nkids = tmp.nkids;
            f->kids2 = tmp.kids2;
            f->nkids2 = tmp.nkids2;
            f->names = tmp.names;
            f->nnames = tmp.nnames;
        }
        node = f;
    }
    return node;
}

static jnode *parse_unary(jparser *p, int with_filter)
{
    jtoken *t = cur(p);
    jnode *node;
    enter(p);
    if (is_op(t, "-") || is_op(t, "+")) {
        p->pos++;
        node = mk(p, is_op(t, "-") ? N_NEG : N_POS, t->line);
        node->a = parse_unary(p, 0);
    } else {
        node = parse_primary(p);
    }
    node = parse_postfix(p, node);
    if (with_filter)
        node = parse_filter_expr(p, node);
    leave(p);
    return node;
}

static jnode *binop(jparser *p, int op, jnode *a, jnode *b, int line)
{
    jnode *n = mk(p, N_BINOP, line);
    n->op = op;
    n->a = a;
    n->b = b;
    return n;
}

static jnode *parse_pow(jparser *p)
{
    jnode *left = parse_unary(p, 1);
    while (is_op(cur(p), "**")) {
        int line = cur(p)->line;
        p->pos++;
        left = binop(p, OP_POW, left, parse_unary(p, 1), line);
    }
    return left;
}

static jnode *parse_math2(jparser *p)
{
    jnode *left = parse_pow(p);
    for (;;) {
        jtoken *t = cur(p);
        int op = is_op(t, "*") ? OP_MUL : is_op(t, "/") ? OP_DIV : is_op(t, "//") ? OP_FLOORDIV
               : is_op(t, "%") ? OP_MOD : 0;
        if (!op)
            return left;
        p->pos++;
        left = binop(p, op, left, parse_pow(p), t->line);
    }
}

static jnode *parse_concat(jparser *p)
{
    int line = cur(p)->line;
    jnode *first = parse_math2(p);
    if (!is_op(cur(p), "~"))
        return first;
    nvec parts = {0};
    nv_push(p, &parts, first, NULL);
    while (skip_op(p, "~"))
        nv_push(p, &parts, parse_math2(p), NULL);
    jnode *n = mk(p, N_CONCAT, line);
    n->kids = parts.v;
    n->nkids = parts.n;
    return n;
}

static jnode *parse_math1(jparser *p)
{
    jnode *left = parse_concat(p);
    for (;;) {
        jtoken *t = cur(p);
        int op = is_op(t, "+") ? OP_ADD : is_op(t, "-") ? OP_SUB : 0;
        if (!op)
            return left;
        p->pos++;
        left = binop(p, op, left, parse_concat(p), t->line);
    }
}

static jnode *parse_compare(jparser *p)
{
    int line = cur(p)->line;
    jnode *expr = parse_math1(p);
    nvec operands = {0};
    int ops[64];
    for (;;) {
        jtoken *t = cur(p);
        int op = is_op(t, "==") ? OP_EQ : is_op(t, "!=") ? OP_NE : is_op(t, "<") ? OP_LT
               : is_op(t, "<=") ? OP_LE : is_op(t, ">") ? OP_GT : is_op(t, ">=") ? OP_GE : 0;
        if (op) {
            p->pos++;
        } else if (is_name(t, "in")) {
            op = OP_IN;
            p->pos++;
        } else if (is_name(t, "not") && is_name(peek(p, 1), "in")) {
            op = OP_NOTIN;
            p->pos += 2;
        } else {
            break;
        }
        if (operands.n >= 64)
            jp_fail(p, t->line, "too many chained comparisons");
        ops[operands.n] = op;
        nv_push(p, &operands, parse_math1(p), NULL);
    }
    if (!operands.n)
        return expr;
    jnode *n = mk(p, N_COMPARE, line);
    n->a = expr;
    n->kids = operands.v;
    n->nkids = operands.n;
    n->ops = jp_alloc(p, operands.n * sizeof(int));
    memcpy(n->ops, ops, operands.n * sizeof(int));
    return n;
}

static jnode *parse_not(jparser *p)
{
    if (is_name(cur(p), "not")) {
        jnode *n = mk(p, N_NOT, cur(p)->line);
        p->pos++;
        enter(p);
        n->a = parse_not(p);
        leave(p);
        return n;
    }
    return parse_compare(p);
}

static jnode *parse_and(jparser *p)
{
    jnode *left = parse_not(p);
    while (is_name(cur(p), "and")) {
        jnode *n = mk(p, N_AND, cur(p)->line);
        p->pos++;
        n->a = left;
        n->b = parse_not(p);
        left = n;
    }
    return left;
}

static jnode *parse_or(jparser *p)
{
    jnode *left = parse_and(p);
    while (is_name(cur(p), "or")) {
        jnode *n = mk(p, N_OR, cur(p)->line);
        p->pos++;
        n->a = left;
        n->b = parse_and(p);
        left = n;
    }
    return left;
}

static jnode *parse_condexpr(jparser *p)
{
    jnode *expr1 = parse_or(p);
    while (is_name(cur(p), "if")) {
        jnode *n = mk(p, N_COND, cur(p)->line);
        p->pos++;
        n->a = expr1;
        n->b = parse_or(p);
        if (skip_name(p, "else")) {
            enter(p);
            n->c = parse_condexpr(p);
            leave(p);
        }
        expr1 = n;
    }
    return expr1;
}

static jnode *parse_expression(jparser *p, int with_condexpr)
{
    enter(p);
    jnode *n = with_condexpr ? parse_condexpr(p) : parse_or(p);
    leave(p);
    return n;
}

static int tuple_end(jparser *p, const char *extra_end)
{
    jtoken *t = cur(p);
    if (t->kind == T_VAR_END || t->kind == T_BLOCK_END || is_op(t, ")"))
        return 1;
    return extra_end && is_name(t, extra_end);
}

static jnode *parse_tuple_ex(jparser *p, int with_condexpr, int explicit_parens, const char *extra_end)
{
    int line = cur(p)->line;
    nvec items = {0};
    int is_tuple = 0;
    for (;;) {
        if (items.n)
            expect_op(p, ",");
        if (tuple_end(p, extra_end))
            break;
        nv_push(p, &items, parse_expression(p, with_condexpr), NULL);
        if (is_op(cur(p), ","))
            is_tuple = 1;
        else
            break;
    }
    if (!is_tuple) {
        if (items.n)
            return items.v[0];
        if (!explicit_parens)
            jp_fail(p, line, "expected an expression, got %s", tok_desc(cur(p)));
    }
    jnode *n = mk(p, N_TUPLE, line);
    n->kids = items.v;
    n->nkids = items.n;
    return n;
}

static jnode *parse_tuple(jparser *p, int with_condexpr, int explicit_parens)
{
    return parse_tuple_ex(p, with_condexpr, explicit_parens, NULL);
}

/* for/set targets: name, `a, b`, `(a, b)`, and for set also `ns.attr`. */
static jnode *parse_assign_target(jparser *p, int with_namespace, const char *extra_end)
{
    int line = cur(p)->line;
    if (with_namespace && cur(p)->kind == T_NAME && is_op(peek(p, 1), ".")) {
        jnode *obj = mk(p, N_NAME, line);
        obj->name = expect_name(p);
        p->pos++;
        jnode *n = mk(p, N_ATTR, line);
        n->a = obj;
        n->name = expect_name(p);
        return n;
    }
    int parens = skip_op(p, "(");
    nvec names = {0};
    for (;;) {
        if (names.n)
            expect_op(p, ",");
        if ((!parens && extra_end && is_name(cur(p), extra_end)) || is_op(cur(p), ")") ||
            is_op(cur(p), "=") || cur(p)->kind == T_BLOCK_END || is_op(cur(p), "|"))
            break;
        jnode *nm = mk(p, N_NAME, cur(p)->line);
        nm->name = expect_name(p);
        nv_push(p, &names, nm, nm->name);
        if (!is_op(cur(p), ","))
            break;
    }
    if (parens)
        expect_op(p, ")");
    if (!names.n)
        jp_fail(p, line, "expected an assignment target");
    if (names.n == 1 && !parens)
        return names.v[0];
    jnode *n = mk(p, N_TUPLE, line);
    n->kids = names.v;
    n->nkids = names.n;
    return n;
}

/* ------------------------------------------------------------------ statements */

static jnode *parse_body(jparser *p, const char **end_tags, const char **which);

static int at_tag(jparser *p, const char **tags)
{
    if (cur(p)->kind != T_BLOCK_BEGIN)
        return 0;
    jtoken *t = peek(p, 1);
    for (int i = 0; tags[i]; i++)
        if (is_name(t, tags[i]))
            return 1;
    return 0;
}

static void set_body(jnode *n, jnode *block, int second)
{
    if (second) {
        n->kids2 = block->kids;
        n->nkids2 = block->nkids;
    } else {
        n->kids = block->kids;
        n->nkids = block->nkids;
    }
}

static jnode *parse_if(jparser *p, int line)
{
    jnode *n = mk(p, N_IF, line);
    n->a = parse_tuple(p, 0, 0);
    expect_block_end(p);
    static const char *ends[] = {"elif", "else", "endif", NULL};
    const char *which;
    set_body(n, parse_body(p, ends, &which), 0);
    if (!strcmp(which, "elif")) {
        int l2 = cur(p)->line;
        jnode *e = parse_if(p, l2); /* consumes through endif */
        n->kids2 = jp_alloc(p, sizeof(jnode *));
        n->kids2[0] = e;
        n->nkids2 = 1;
        return n;
    }
    if (!strcmp(which, "else")) {
        expect_block_end(p);
        static const char *ends2[] = {"endif", NULL};
        set_body(n, parse_body(p, ends2, &which), 1);
    }
    expect_block_end(p);
    return n;
}

static jnode *parse_for(jparser *p, int line)
{
    jnode *n = mk(p, N_FOR, line);
    jnode *target = parse_assign_target(p, 0, "in");
    if (target->kind == N_TUPLE) {
        n->nnames = target->nkids;
        n->names = jp_alloc(p, n->nnames * sizeof(char *));
        for (size_t i = 0; i < n->nnames; i++)
            n->names[i] = target->kids[i]->name;
        n->op = 1; /* unpack */
    } else {
        n->nnames = 1;
        n->names = jp_alloc(p, sizeof(char *));
        n->names[0] = target->name;
    }
    if (!skip_name(p, "in"))
        jp_fail(p, cur(p)->line, "expected 'in' in for loop");
    n->a = parse_tuple_ex(p, 0, 0, "recursive");
    if (skip_name(p, "if"))
        n->b = parse_expression(p, 1);
    if (is_name(cur(p), "recursive"))
        jp_fail(p, cur(p)->line, "recursive loops are not supported");
    expect_block_end(p);
    static const char *ends[] = {"else", "endfor", NULL};
    const char *which;
    set_body(n, parse_body(p, ends, &which), 0);
    if (!strcmp(which, "else")) {
        expect_block_end(p);
        static const char *ends2[] = {"endfor", NULL};
        set_body(n, parse_body(p, ends2, &which), 1);
        n->c = n; /* marks "has else" even when the else body is empty */
    }
    expect_block_end(p);
    return n;
}

static jnode *parse_set(jparser *p, int line)
{
    jnode *target = parse_assign_target(p, 1, NULL);
    if (skip_op(p, "=")) {
        jnode *n = mk(p, N_SET, line);
        n->a = target;
        n->b = parse_tuple(p, 1, 0);
        expect_block_end(p);
        return n;
    }
    jnode *n = mk(p, N_SETBLOCK, line);
    n->a = target;
    if (is_op(cur(p), "|"))
        n->b = parse_filter(p, mk(p, N_BLOCKVAL, line), 0);
    expect_block_end(p);
    static const char *ends[] = {"endset", NULL};
    const char *which;
    set_body(n, parse_body(p, ends, &which), 0);
    expect_block_end(p);
    return n;
}

/* (a, b=default, ...) of macros and call blocks */
static void parse_signature(jparser *p, jnode *n)
{
    nvec params = {0}, defs = {0};
    expect_op(p, "(");
    while (!is_op(cur(p), ")")) {
        if (params.n)
            expect_op(p, ",");
        if (is_op(cur(p), ")"))
            break;
        const char *nm = expect_name(p);
        jnode *def = NULL;
        if (skip_op(p, "="))
            def = parse_expression(p, 1);
        else if (defs.n && defs.v[defs.n - 1])
            jp_fail(p, cur(p)->line, "non-default argument follows default argument");
        nv_push(p, &params, NULL, nm);
        nv_push(p, &defs, def, NULL);
    }
    p->pos++;
    n->names = params.names;
    n->nnames = params.n;
    n->kids2 = defs.v;
    n->nkids2 = defs.n;
}

static jnode *parse_macro(jparser *p, int line)
{
    jnode *n = mk(p, N_MACRO, line);
    n->name = expect_name(p);
    parse_signature(p, n);
    expect_block_end(p);
    static const char *ends[] = {"endmacro", NULL};
    const char *which;
    set_body(n, parse_body(p, ends, &which), 0);
    if (cur(p)->kind == T_NAME) /* {% endmacro name %} */
        p->pos++;
    expect_block_end(p);
    return n;
}

static jnode *parse_call_block(jparser *p, int line)
{
    jnode *n = mk(p, N_CALLBLOCK, line);
    if (is_op(cur(p), "("))
        parse_signature(p, n);
    n->a = parse_expression(p, 1);
    if (n->a->kind != N_CALL)
        jp_fail(p, line, "expected a call expression in {%% call %%}");
    expect_block_end(p);
    static const char *ends[] = {"endcall", NULL};
    const char *which;
    set_body(n, parse_body(p, ends, &which), 0);
    expect_block_end(p);
    return n;
}

static jnode *parse_filter_block(jparser *p, int line)
{
    jnode *n = mk(p, N_FILTERBLOCK, line);
    n->b = parse_filter(p, mk(p, N_BLOCKVAL, line), 1);
    expect_block_end(p);
    static const char *ends[] = {"endfilter", NULL};
    const char *which;
    set_body(n, parse_body(p, ends, &which), 0);
    expect_block_end(p);
    return n;
}

static jnode *parse_statement(jparser *p)
{
    jtoken *b = cur(p);
    p->pos++; /* {% */
    jtoken *t = cur(p);
    if (t->kind != T_NAME)
        jp_fail(p, t->line, "expected a statement name, got %s", tok_desc(t));
    p->pos++;
    int line = t->line;
    jnode *n;
    enter(p);
    if (is_name(t, "if"))
        n = parse_if(p, line);
    else if (is_name(t, "for"))
        n = parse_for(p, line);
    else if (is_name(t, "set"))
        n = parse_set(p, line);
    else if (is_name(t, "macro"))
        n = parse_macro(p, line);
    else if (is_name(t, "call"))
        n = parse_call_block(p, line);
    else if (is_name(t, "filter"))
        n = parse_filter_block(p, line);
    else if (is_name(t, "break") || is_name(t, "continue")) {
        n = mk(p, is_name(t, "break") ? N_BREAK : N_CONTINUE, line);
        expect_block_end(p);
    } else if (is_name(t, "generation")) {
        /* HF's AssistantTracker marks assistant spans; rendering shows just the body. */
        expect_block_end(p);
        static const char *ends[] = {"endgeneration", NULL};
        const char *which;
        n = parse_body(p, ends, &which);
        n->kind = N_SCOPE; /* HF wraps it in a call block: its sets stay inside */
        expect_block_end(p);
    } else if (is_name(t, "with")) {
        /* {% with a = x, b = y %}: a scope with those names */
        n = mk(p, N_SCOPE, line);
        nvec sets = {0};
        while (cur(p)->kind != T_BLOCK_END) {
            if (sets.n)
                expect_op(p, ",");
            jnode *s = mk(p, N_SET, cur(p)->line);
            s->a = parse_assign_target(p, 0, NULL);
            expect_op(p, "=");
            s->b = parse_expression(p, 1);
            nv_push(p, &sets, s, NULL);
        }
        expect_block_end(p);
        static const char *ends[] = {"endwith", NULL};
        const char *which;
        jnode *body = parse_body(p, ends, &which);
        expect_block_end(p);
        for (size_t i = 0; i < body->nkids; i++)
            nv_push(p, &sets, body->kids[i], NULL);
        n->kids = sets.v;
        n->nkids = sets.n;
    } else {
        jp_fail(p, b->line, "unknown or unsupported tag '%.*s'", (int)t->len, t->s);
    }
    leave(p);
    return n;
}

/* Statements until one of end_tags (left at "{% tag", tag consumed) or EOF when
 * end_tags is NULL. */
static jnode *parse_body(jparser *p, const char **end_tags, const char **which)
{
    int line = cur(p)->line;
    nvec body = {0};
    for (;;) {
        jtoken *t = cur(p);
        if (t->kind == T_EOF) {
            if (end_tags)
                jp_fail(p, t->line, "unexpected end of template, expected '%s'", end_tags[0]);
            break;
        }
        if (end_tags && at_tag(p, end_tags)) {
            p->pos++;
            for (int i = 0; end_tags[i]; i++)
                if (is_name(cur(p), end_tags[i]))
                    *which = end_tags[i];
            p->pos++;
            break;
        }
        if (t->kind == T_DATA) {
            jnode *n = mk(p, N_TEXT, t->line);
            if (m40_jv_str(p->arena, t->s, t->len, &n->val))
                jp_fail(p, t->line, "out of memory");
            nv_push(p, &body, n, NULL);
            p->pos++;
        } else if (t->kind == T_VAR_BEGIN) {
            p->pos++;
            jnode *n = mk(p, N_OUTPUT, t->line);
            n->a = parse_tuple(p, 1, 0);
            if (cur(p)->kind != T_VAR_END)
                jp_fail(p, cur(p)->line, "expected '}}', got %s", tok_desc(cur(p)));
            p->pos++;
            nv_push(p, &body, n, NULL);
        } else if (t->kind == T_BLOCK_BEGIN) {
            jtoken *nm = peek(p, 1);
            static const char *stray[] = {"endif", "endfor", "else", "elif", "endmacro", "endset",
                                          "endcall", "endfilter", "endgeneration", "endwith", NULL};
            for (int i = 0; stray[i]; i++)
                if (is_name(nm, stray[i]))
                    jp_fail(p, nm->line, "unexpected '%s'", stray[i]);
            nv_push(p, &body, parse_statement(p), NULL);
        } else {
            jp_fail(p, t->line, "unexpected %s", tok_desc(t));
        }
    }
    jnode *n = mk(p, N_BLOCK, line);
    n->kids = body.v;
    n->nkids = body.n;
    return n;
}

/* The tree's height, without recursion (an explicit stack of (node, next child) frames):
 * fails the parse past JP_MAX_HEIGHT, so that a template the evaluator could not walk
 * without exhausting the stack is refused at load, naming the limit. */
static void check_height(jparser *p, jnode *root)
{
    typedef struct {
        jnode *n;
        size_t next; /* children visited: a, b, c, then kids, then kids2 */
    } frame;
    frame st[JP_MAX_HEIGHT + 1];
    int top = 0;
    st[0].n = root, st[0].next = 0;
    while (top >= 0) {
        frame *f = &st[top];
        jnode *n = f->n, *child = NULL;
        while (!child && f->next < 3 + n->nkids + n->nkids2) {
            const size_t i = f->next++;
            child = i == 0 ? n->a : i == 1 ? n->b : i == 2 ? n->c : i - 3 < n->nkids ? n->kids[i - 3]
                                                                                        : n->kids2[i - 3 - n->nkids];
            if (child == n) /* N_FOR's c = itself marks "has else" */
                child = NULL;
        }
        if (!child) {
            top--;
            continue;
        }
        if (top + 1 > JP_MAX_HEIGHT)
            jp_fail(p, child->line, "template nests too deeply (an expression or statement more than %d levels deep)",
                    JP_MAX_HEIGHT);
        st[++top].n = child, st[top].next = 0;
    }
}

int m40_jinja_parse(const char *src, size_t len, m40_jinja **out, char *err, size_t errlen)
{
    *out = NULL;
    if (len > JP_MAX_SOURCE) {
        snprintf(err, errlen, "template is %zu bytes, more than the %zu-byte limit", len, JP_MAX_SOURCE);
        return -1;
    }
    m40_jinja *t = calloc(1, sizeof *t);
    if (!t) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    /* The AST of a 12 KB template takes a few hundred KB; the cap only stops a
     * pathological source from taking the worker down. */
    t->arena = m40_jarena_new(len * 64 + ((size_t)4 << 20));
    if (!t->arena) {
        free(t);
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    jparser *p = calloc(1, sizeof *p);
    if (!p) {
        m40_jinja_free(t);
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    p->arena = t->arena;
    p->err = err;
    p->errlen = errlen;
    if (setjmp(p->fail)) {
        free(p->toks);
        free(p);
        m40_jinja_free(t);
        return -1;
    }
    /* jinja2 normalizes every newline sequence to "\n" and drops one trailing
     * newline (keep_trailing_newline=False). */
    char *norm = jp_alloc(p, len + 1);
    size_t n = 0;
    for (size_t i = 0; i < len; i++) {
        if (src[i] == '\r') {
            norm[n++] = '\n';
            if (i + 1 < len && src[i + 1] == '\n')
                i++;
        } else {
            norm[n++] = src[i];
        }
    }
    if (n > 0 && norm[n - 1] == '\n')
        n--;
    norm[n] = 0;
    p->src = norm;
    p->len = n;
    jp_lex(p);
    const char *which = NULL;
    t->root = parse_body(p, NULL, &which);
    check_height(p, t->root);
    free(p->toks);
    free(p);
    *out = t;
    return 0;
}

void m40_jinja_free(m40_jinja *t)
{
    if (!t)
        return;
    m40_jarena_free(t->arena);
    free(t);
}
