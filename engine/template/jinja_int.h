/* Internals of the Jinja interpreter, shared by its files:
 *   jinja_value.c  arena, buffers, UTF-8, values, dicts
 *   jinja_print.c  Python str()/repr()/json.dumps() of values, JSON -> values
 *   jinja_lex.c    source -> tokens (whitespace control)
 *   jinja_parse.c  tokens -> AST
 *   jinja_eval.c   statements, scopes, calls, the public render API
 *   jinja_ops.c    attribute/item access, slicing, operators
 *   jinja_builtins.c, jinja_filters.c  tests, methods, globals, filters */
#ifndef M40_JINJA_INT_H
#define M40_JINJA_INT_H

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include "jinja.h"

/* ---- heap objects ---- */

struct m40_jstr {
    size_t len;
    int markup; /* markupsafe.Markup (from |safe, |escape): `+` escapes the other side */
    char s[];   /* NUL-terminated, UTF-8 */
};

/* Python sequences that templates can observe apart: tuples print as (a, b);
 * generators (what map/select/selectattr/unique/items filters return) are truthy
 * even when empty, have no len(), cannot be indexed or JSON-encoded and are used
 * up by one iteration; dict views (d.items() ...) have a len() but no indexing or
 * JSON either. */
enum jlist_kind { JL_LIST, JL_TUPLE, JL_GEN, JL_ITEMS, JL_KEYS, JL_VALUES };

struct m40_jlist {
    size_t n, cap;
    m40_jvalue *v;
    int kind;
};

static inline int jl_is_seq(const struct m40_jlist *l) { return l->kind == JL_LIST || l->kind == JL_TUPLE; }

/* Insertion-ordered: keys/vals in order; idx is an open-addressed hash index (built
 * once the dict grows past a few entries) so big JSON objects stay O(1) per lookup. */
struct m40_jdict {
    size_t n, cap;
    m40_jvalue *k, *v;
    uint32_t *idx; /* slot -> position + 1, 0 empty */
    size_t idxcap; /* power of two, 0 when no index */
};

struct jnode;
struct jscope;

enum jfn_kind { JFN_MACRO, JFN_BUILTIN, JFN_METHOD };

struct m40_jcallable {
    enum jfn_kind kind;
    int id;                   /* builtin / method id */
    const char *name;         /* for messages */
    m40_jvalue self;          /* bound object of a method */
    const struct jnode *node; /* macro definition, or the {% call %} block for caller() */
    struct jscope *closure;   /* scope the macro or caller body reads free names from */
};

/* ---- arena ---- */
void *m40_jarena_alloc(m40_jarena *a, size_t n);
int m40_jarena_exhausted(const m40_jarena *a);

/* ---- growable byte buffer (malloc), bounded ---- */
typedef struct {
    char *p;
    size_t len, cap, max; /* max 0: unbounded */
    int failed;           /* 1: out of memory or over max */
    int over;             /* 1: over max */
} jbuf;

void jbuf_init(jbuf *b, size_t max);
void jbuf_free(jbuf *b);
int jbuf_put(jbuf *b, const char *s, size_t n);
int jbuf_puts(jbuf *b, const char *s);
int jbuf_putc(jbuf *b, char c);
int jbuf_printf(jbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* ---- values ---- */
static inline int jv_is_str(m40_jvalue v) { return v.type == M40_JV_STRING; }
static inline int jv_is_num(m40_jvalue v)
{
    return v.type == M40_JV_INT || v.type == M40_JV_FLOAT || v.type == M40_JV_BOOL;
}
int jv_truthy(m40_jvalue v);
int jv_equal(m40_jvalue a, m40_jvalue b);
uint64_t jv_hash(m40_jvalue v);
double jv_num(m40_jvalue v); /* int/float/bool as double */
const char *jv_type_name(m40_jvalue v);

/* Python str(v) appended to b (strings raw, others as repr). */
int jv_write_str(jbuf *b, m40_jvalue v);
/* Python repr(v). */
int jv_write_repr(jbuf *b, m40_jvalue v);
/* json.dumps(v, ensure_ascii=False, indent=indent) (indent < 0: None). -1 when v
 * holds something JSON cannot encode; the offending type goes to err. */
int jv_write_json(jbuf *b, m40_jvalue v, int indent, char *err, size_t errlen);
int jv_write_float(jbuf *b, double f); /* Python repr(float) */
/* markupsafe.escape: & < > " ' as entities. */
int jv_write_html_escaped(jbuf *b, const char *s, size_t n);

int jv_str_from_buf(m40_jarena *a, jbuf *b, m40_jvalue *out);
int jv_tuple2(m40_jarena *a, m40_jvalue x, m40_jvalue y, m40_jvalue *out);

/* Dict/namespace access (d.type DICT or NAMESPACE). */
m40_jvalue jv_dict_get(m40_jvalue d, m40_jvalue key, int *found);
int jv_dict_has(m40_jvalue d, m40_jvalue key);

/* UTF-8 */
size_t jutf8_count(const char *s, size_t len);
size_t jutf8_offset(const char *s, size_t len, size_t cp_index); /* byte offset */
/* Decode one code point at s[*i] (advances *i); invalid bytes decode as themselves. */
uint32_t jutf8_next(const char *s, size_t len, size_t *i);
int jutf8_put(jbuf *b, uint32_t cp);
int jpy_isspace(uint32_t cp); /* Python str.isspace() */

/* ---- AST ---- */
enum jnode_kind {
    /* statements */
    N_TEXT, N_OUTPUT, N_IF, N_FOR, N_SET, N_SETBLOCK, N_MACRO, N_CALLBLOCK, N_FILTERBLOCK,
    N_BREAK, N_CONTINUE, N_SCOPE, N_BLOCK,
    /* expressions */
    N_CONST, N_NAME, N_LIST, N_TUPLE, N_DICT, N_ATTR, N_ITEM, N_SLICE, N_CALL, N_FILTER,
    N_TEST, N_NEG, N_POS, N_BINOP, N_AND, N_OR, N_NOT, N_COMPARE, N_COND, N_CONCAT,
    N_BLOCKVAL,
};

enum jop {
    OP_ADD = 1, OP_SUB, OP_MUL, OP_DIV, OP_FLOORDIV, OP_MOD, OP_POW,
    OP_EQ, OP_NE, OP_LT, OP_LE, OP_GT, OP_GE, OP_IN, OP_NOTIN,
};

/* One node shape for every kind; the comment on each kind in jinja_parse.c says which
 * fields it uses. A small uniform shape keeps the parser and evaluator short. */
typedef struct jnode {
    enum jnode_kind kind;
    int line;
    int op;                /* operator; N_TEST: negated; N_FOR: has else */
    const char *name;      /* identifier / attribute / filter / test / macro name */
    struct jnode *a, *b, *c;
    struct jnode **kids;   /* body, items, args, operands */
    size_t nkids;
    struct jnode **kids2;  /* else body, dict values, kwarg values, macro defaults */
    size_t nkids2;
    const char **names;    /* kwarg names, macro params, for/set targets */
    size_t nnames;
    int *ops;              /* N_COMPARE operators (nkids of them) */
    m40_jvalue val;        /* N_CONST */
} jnode;

struct m40_jinja {
    m40_jarena *arena; /* AST, constants */
    jnode *root;       /* N_BLOCK */
};

/* ---- evaluation (jinja_eval.c, jinja_ops.c), used by the builtins ---- */
typedef struct jscope {
    struct jscope *parent;
    size_t n, cap;
    const char **names;
    m40_jvalue *vals;
} jscope;

/* State of the innermost running loop, exposed as `loop`. */
typedef struct jloop {
    size_t index0, length;
    m40_jlist *items;
} jloop;

typedef struct jrender {
    m40_jarena *arena;
    m40_jinja_limits lim;
    jbuf *out;
    uint64_t steps;
    int depth;
    int edepth; /* nested eval() calls (JR_MAX_EVAL_DEPTH) */
    char *err;
    size_t errlen;
    int failed;
    jscope *root;
    m40_jvalue ctx;
    m40_jvalue blockval;          /* input of {% filter %} / {% set x | f %} chains */
} jrender;

#define JFN_LOOP 99 /* m40_jcallable kind for `loop`; its node field holds the jloop */

int jr_oom(jrender *r);
/* An undefined value remembering its name for "'x' is undefined". */
m40_jvalue jr_undefined(jrender *r, const char *name);
int jr_undefined_error(jrender *r, int line, m40_jvalue u);
int jr_slice(jrender *r, int line, m40_jvalue obj, const int *has, int64_t *iv, m40_jvalue *out);
int jr_arith(jrender *r, int line, int op, m40_jvalue a, m40_jvalue b, m40_jvalue *out);
/* a <=> b for numbers, strings, lists: *cmp -1/0/1, 2 when unordered (NaN). */
int jr_order(jrender *r, int line, const char *opname, m40_jvalue a, m40_jvalue b, int *cmp);
int jr_contains(jrender *r, int line, m40_jvalue needle, m40_jvalue hay, int *res);
int jr_fail(jrender *r, int line, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
m40_jarena *jr_arena(jrender *r);
int jr_call(jrender *r, int line, m40_jvalue fn, m40_jvalue *args, size_t nargs,
            const char **kwnames, m40_jvalue *kwvals, size_t nkw, m40_jvalue *out);
int jr_getattr(jrender *r, int line, m40_jvalue obj, const char *name, m40_jvalue *out);
int jr_getitem(jrender *r, int line, m40_jvalue obj, m40_jvalue key, m40_jvalue *out);
time_t jr_now(jrender *r);
int jr_step(jrender *r, int line);
/* A buffer for a string value made while rendering: no value grows past the output
 * limit (what could ever be written; a filter chain that keeps lengthening a string fails
 * there instead of filling the memory limit). */
void jr_buf_init(jrender *r, jbuf *b);
/* b as an arena string in out, b freed; the error names the limit where b went past it */
int jr_buf_value(jrender *r, jbuf *b, m40_jvalue *out);

/* ---- builtins (jinja_builtins.c: helpers, tests, methods, globals; jinja_filters.c) ---- */
typedef struct {
    m40_jvalue *args;
    size_t nargs;
    const char **kwnames;
    m40_jvalue *kwvals;
    size_t nkw;
} jb_args;
/* Argument by position (0-based, after the piped value) or keyword name; 1 if given. */
int jb_arg(const jb_args *a, size_t pos, const char *name, m40_jvalue *out);
int jb_oom(jrender *r);
int jb_str(jrender *r, m40_jvalue v, m40_jvalue *out); /* Python str() */
int jb_buf_result(jrender *r, jbuf *b, m40_jvalue *out); /* frees b */
int jb_need_str(jrender *r, int line, m40_jvalue v, const char *what);
int jb_need_int(jrender *r, int line, m40_jvalue v, const char *what, int64_t *out);
enum casemode { CASE_UPPER, CASE_LOWER, CASE_CAPITALIZE, CASE_PYTITLE, CASE_JTITLE };
int jb_change_case(jrender *r, const m40_jstr *s, enum casemode mode, m40_jvalue *out);
/* which: 1 left, 2 right, 3 both; chars NULL = whitespace */
int jb_strip(jrender *r, const m40_jstr *s, const m40_jstr *chars, int which, m40_jvalue *out);
int jb_replace(jrender *r, const m40_jstr *s, const m40_jstr *old, const m40_jstr *new_, int64_t count,
               m40_jvalue *out);
/* "a.b.0" item path, as jinja's attribute= arguments */
int jb_attr_path(jrender *r, int line, m40_jvalue obj, m40_jvalue attr, m40_jvalue *out);
int jb_list_copy(jrender *r, m40_jvalue src, m40_jvalue *out);
int jb_parse_int(const char *s, int64_t *out);   /* Python int(str) */
int jb_parse_float(const char *s, double *out);  /* Python float(str) */
/* Apply filter `name` to v. */
int jb_filter(jrender *r, int line, const char *name, m40_jvalue v, m40_jvalue *args, size_t nargs,
              const char **kwnames, m40_jvalue *kwvals, size_t nkw, m40_jvalue *out);
/* Test `name`; *res 0/1. */
int jb_test(jrender *r, int line, const char *name, m40_jvalue v, m40_jvalue *args, size_t nargs,
            int *res);
/* Bound method lookup: id >= 0 when obj has method `name`. */
int jb_method_id(m40_jvalue obj, const char *name);
int jb_call_method(jrender *r, int line, const m40_jcallable *fn, m40_jvalue *args, size_t nargs,
                   const char **kwnames, m40_jvalue *kwvals, size_t nkw, m40_jvalue *out);
/* Global functions: range, namespace, dict, raise_exception, strftime_now. */
int jb_global_id(const char *name);
int jb_call_global(jrender *r, int line, const m40_jcallable *fn, m40_jvalue *args, size_t nargs,
                   const char **kwnames, m40_jvalue *kwvals, size_t nkw, m40_jvalue *out);
/* Iterate: list -> items, dict -> keys, string -> characters, undefined -> nothing. */
int jb_to_list(jrender *r, int line, m40_jvalue v, m40_jvalue *out);

/* ---- parsing (jinja_lex.c, jinja_parse.c) ---- */


enum tok_kind { T_DATA, T_VAR_BEGIN, T_VAR_END, T_BLOCK_BEGIN, T_BLOCK_END, T_NAME, T_STRING,
                T_INT, T_FLOAT, T_OP, T_EOF };

typedef struct {
    enum tok_kind kind;
    int line;
    const char *s; /* name / op text / data / decoded string (arena) */
    size_t len;
    int64_t i;
    double f;
} jtoken;

typedef struct {
    m40_jarena *arena;
    const char *src; /* newline-normalized source */
    size_t len;
    jtoken *toks;    /* malloc'd; freed when parsing ends */
    size_t ntoks, cap, pos;
    int depth;
    char *err;
    size_t errlen;
    jmp_buf fail; /* parse errors unwind to m40_jinja_parse; the AST lives in the arena */
} jparser;

#define JP_MAX_DEPTH 200 /* nesting of brackets, expressions and statements */
/* Height of the syntax tree: left-associative chains (a + b + c ..., a.b.c ..., x|f|g ...)
 * are parsed by loops, not recursion, but evaluated recursively, one level a link, so
 * their length is bounded too (real templates stay below 30). */
#define JP_MAX_HEIGHT 500
/* Largest template source: real chat templates are 1-30 KB; one embedded in a GGUF file
 * has no other bound. */
#define JP_MAX_SOURCE ((size_t)1 << 20)
/* Nested evaluations at render time: the backstop of JP_MAX_HEIGHT for trees grown by
 * macro calls and the like (each level a few hundred bytes of stack). */
#define JR_MAX_EVAL_DEPTH 2000

_Noreturn void jp_fail(jparser *p, int line, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
void *jp_alloc(jparser *p, size_t n);
/* Source -> tokens, applying trim_blocks/lstrip_blocks and whitespace control. */
void jp_lex(jparser *p);

#endif
