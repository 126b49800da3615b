/* Values of the Jinja interpreter: arena, byte buffers, UTF-8 helpers,
 * constructors, Python-compatible equality/hashing/truthiness, ordered dicts.
 * Their text forms (str/repr/json) are in jinja_print.c. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "jinja_int.h"

/* ------------------------------------------------------------------ arena */

struct jchunk {
    struct jchunk *next;
    size_t size, off;
    max_align_t data[];
};

struct m40_jarena {
    struct jchunk *head;
    size_t total, cap;
    int exhausted;
};

m40_jarena *m40_jarena_new(size_t cap_bytes)
{
    m40_jarena *a = calloc(1, sizeof *a);
    if (!a)
        return NULL;
    a->cap = cap_bytes ? cap_bytes : (size_t)256 << 20;
    return a;
}

void m40_jarena_free(m40_jarena *a)
{
    if (!a)
        return;
    struct jchunk *c = a->head;
    while (c) {
        struct jchunk *n = c->next;
        free(c);
        c = n;
    }
    free(a);
}

int m40_jarena_exhausted(const m40_jarena *a) { return a->exhausted; }

void *m40_jarena_alloc(m40_jarena *a, size_t n)
{
    n = (n + 15) & ~(size_t)15;
    if (n == 0)
        n = 16;
    struct jchunk *c = a->head;
    if (!c || c->size - c->off < n) {
        /* Big requests get a chunk of their own so the current one keeps its room. */
        size_t sz = n > 32768 ? n : 65536;
        if (a->total + sz > a->cap || a->total + sz < a->total) {
            a->exhausted = 1;
            return NULL;
        }
        struct jchunk *nc = malloc(sizeof *nc + sz);
        if (!nc) {
            a->exhausted = 1;
            return NULL;
        }
        nc->size = sz;
        nc->off = 0;
        a->total += sz;
        if (c && n > 32768) { /* keep filling the current small chunk afterwards */
            nc->next = c->next;
            c->next = nc;
            nc->off = n;
            return (char *)nc->data;
        }
        nc->next = c;
        a->head = c = nc;
    }
    void *p = (char *)c->data + c->off;
    c->off += n;
    return p;
}

/* ------------------------------------------------------------------ jbuf */

void jbuf_init(jbuf *b, size_t max)
{
    memset(b, 0, sizeof *b);
    b->max = max;
}

void jbuf_free(jbuf *b)
{
    free(b->p);
    memset(b, 0, sizeof *b);
}

int jbuf_put(jbuf *b, const char *s, size_t n)
{
    if (b->failed)
        return -1;
    if (b->max && b->len + n > b->max) {
        b->failed = b->over = 1;
        return -1;
    }
    if (b->len + n + 1 > b->cap) {
        size_t nc = b->cap ? b->cap * 2 : 256;
        while (nc < b->len + n + 1)
            nc *= 2;
        char *p = realloc(b->p, nc);
        if (!p) {
            b->failed = 1;
            return -1;
        }
        b->p = p;
        b->cap = nc;
    }
    if (n)
        memcpy(b->p + b->len, s, n);
    b->len += n;
    b->p[b->len] = 0;
    return 0;
}

int jbuf_puts(jbuf *b, const char *s) { return jbuf_put(b, s, strlen(s)); }
int jbuf_putc(jbuf *b, char c) { return jbuf_put(b, &c, 1); }

int jbuf_printf(jbuf *b, const char *fmt, ...)
{
    char tmp[256];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    if (n < 0)
        return -1;
    if ((size_t)n < sizeof tmp)
        return jbuf_put(b, tmp, (size_t)n);
    char *big = malloc((size_t)n + 1);
    if (!big) {
        b->failed = 1;
        return -1;
    }
    va_start(ap, fmt);
    vsnprintf(big, (size_t)n + 1, fmt, ap);
    va_end(ap);
    int rc = jbuf_put(b, big, (size_t)n);
    free(big);
    return rc;
}

/* ------------------------------------------------------------------ UTF-8 */

uint32_t jutf8_next(const char *s, size_t len, size_t *i)
{
    const unsigned char *u = (const unsigned char *)s;
    size_t p = *i;
    uint32_t c = u[p];
    int extra = c >= 0xF0 && c < 0xF8 ? 3 : c >= 0xE0 ? 2 : c >= 0xC0 ? 1 : 0;
    if (c >= 0xF8 || (c >= 0x80 && c < 0xC0))
        extra = 0;
    if (extra && p + (size_t)extra < len) {
        uint32_t cp = c & (0x3F >> extra);
        size_t k;
        for (k = 1; k <= (size_t)extra; k++) {
            if (p + k >= len || (u[p + k] & 0xC0) != 0x80)
                break;
            cp = (cp << 6) | (u[p + k] & 0x3F);
        }
        if (k > (size_t)extra) {
            *i = p + extra + 1;
            return cp;
        }
    }
    *i = p + 1;
    return c;
}

size_t jutf8_count(const char *s, size_t len)
{
    size_t n = 0;
    for (size_t i = 0; i < len;) {
        jutf8_next(s, len, &i);
        n++;
    }
    return n;
}

size_t jutf8_offset(const char *s, size_t len, size_t cp_index)
{
    size_t i = 0;
    while (cp_index > 0 && i < len) {
        jutf8_next(s, len, &i);
        cp_index--;
    }
    return i;
}

int jutf8_put(jbuf *b, uint32_t cp)
{
    char t[4];
    if (cp < 0x80) {
        t[0] = (char)cp;
        return jbuf_put(b, t, 1);
    }
    if (cp < 0x800) {
        t[0] = (char)(0xC0 | (cp >> 6));
        t[1] = (char)(0x80 | (cp & 0x3F));
        return jbuf_put(b, t, 2);
    }
    if (cp < 0x10000) {
        t[0] = (char)(0xE0 | (cp >> 12));
        t[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
        t[2] = (char)(0x80 | (cp & 0x3F));
        return jbuf_put(b, t, 3);
    }
    t[0] = (char)(0xF0 | (cp >> 18));
    t[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
    t[2] = (char)(0x80 | ((cp >> 6) & 0x3F));
    t[3] = (char)(0x80 | (cp & 0x3F));
    return jbuf_put(b, t, 4);
}

int jpy_isspace(uint32_t c)
{
    return (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x20) || c == 0x85 || c == 0xA0 ||
           c == 0x1680 || (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 ||
           c == 0x202F || c == 0x205F || c == 0x3000;
}

/* ------------------------------------------------------------------ constructors */

m40_jvalue m40_jv_undefined(void) { m40_jvalue v = {.type = M40_JV_UNDEFINED}; return v; }
m40_jvalue m40_jv_none(void) { m40_jvalue v = {.type = M40_JV_NONE}; return v; }
m40_jvalue m40_jv_bool(int b) { m40_jvalue v = {.type = M40_JV_BOOL, .u.b = !!b}; return v; }
m40_jvalue m40_jv_int(int64_t i) { m40_jvalue v = {.type = M40_JV_INT, .u.i = i}; return v; }
m40_jvalue m40_jv_float(double f) { m40_jvalue v = {.type = M40_JV_FLOAT, .u.f = f}; return v; }

int m40_jv_str(m40_jarena *a, const char *s, size_t len, m40_jvalue *out)
{
    m40_jstr *js = m40_jarena_alloc(a, sizeof *js + len + 1);
    if (!js)
        return -1;
    js->len = len;
    js->markup = 0;
    if (len)
        memcpy(js->s, s, len);
    js->s[len] = 0;
    out->type = M40_JV_STRING;
    out->u.s = js;
    return 0;
}

int m40_jv_cstr(m40_jarena *a, const char *s, m40_jvalue *out) { return m40_jv_str(a, s, strlen(s), out); }

int jv_str_from_buf(m40_jarena *a, jbuf *b, m40_jvalue *out)
{
    if (b->failed)
        return -1;
    return m40_jv_str(a, b->p ? b->p : "", b->len, out);
}

int m40_jv_list(m40_jarena *a, m40_jvalue *out)
{
    m40_jlist *l = m40_jarena_alloc(a, sizeof *l);
    if (!l)
        return -1;
    memset(l, 0, sizeof *l);
    out->type = M40_JV_LIST;
    out->u.l = l;
    return 0;
}

int m40_jv_list_push(m40_jarena *a, m40_jvalue list, m40_jvalue item)
{
    m40_jlist *l = list.u.l;
    if (l->n == l->cap) {
        size_t nc = l->cap ? l->cap * 2 : 4;
        m40_jvalue *nv = m40_jarena_alloc(a, nc * sizeof *nv);
        if (!nv)
            return -1;
        if (l->n)
            memcpy(nv, l->v, l->n * sizeof *nv);
        l->v = nv;
        l->cap = nc;
    }
    l->v[l->n++] = item;
    return 0;
}

int jv_tuple2(m40_jarena *a, m40_jvalue x, m40_jvalue y, m40_jvalue *out)
{
    if (m40_jv_list(a, out) || m40_jv_list_push(a, *out, x) || m40_jv_list_push(a, *out, y))
        return -1;
    out->u.l->kind = JL_TUPLE;
    return 0;
}

int m40_jv_dict(m40_jarena *a, m40_jvalue *out)
{
    m40_jdict *d = m40_jarena_alloc(a, sizeof *d);
    if (!d)
        return -1;
    memset(d, 0, sizeof *d);
    out->type = M40_JV_DICT;
    out->u.d = d;
    return 0;
}

/* ------------------------------------------------------------------ equality, hash */

double jv_num(m40_jvalue v)
{
    return v.type == M40_JV_FLOAT ? v.u.f : v.type == M40_JV_INT ? (double)v.u.i : v.type == M40_JV_BOOL ? v.u.b : 0;
}

static int64_t jv_intval(m40_jvalue v) { return v.type == M40_JV_INT ? v.u.i : v.u.b; }

int jv_equal(m40_jvalue a, m40_jvalue b)
{
    if (jv_is_num(a) && jv_is_num(b)) {
        if (a.type == M40_JV_FLOAT || b.type == M40_JV_FLOAT)
            return jv_num(a) == jv_num(b);
        return jv_intval(a) == jv_intval(b);
    }
    if (a.type != b.type)
        return 0;
    switch (a.type) {
    case M40_JV_UNDEFINED:
    case M40_JV_NONE:
        return 1;
    case M40_JV_STRING:
        return a.u.s->len == b.u.s->len && memcmp(a.u.s->s, b.u.s->s, a.u.s->len) == 0;
    case M40_JV_LIST:
        if (!jl_is_seq(a.u.l) || !jl_is_seq(b.u.l))
            return a.u.l == b.u.l;
        if (a.u.l->kind != b.u.l->kind || a.u.l->n != b.u.l->n)
            return 0;
        for (size_t i = 0; i < a.u.l->n; i++)
            if (!jv_equal(a.u.l->v[i], b.u.l->v[i]))
                return 0;
        return 1;
    case M40_JV_DICT:
        if (a.u.d->n != b.u.d->n)
            return 0;
        for (size_t i = 0; i < a.u.d->n; i++) {
            int found;
            m40_jvalue bv = jv_dict_get(b, a.u.d->k[i], &found);
            if (!found || !jv_equal(a.u.d->v[i], bv))
                return 0;
        }
        return 1;
    case M40_JV_NAMESPACE:
        return a.u.d == b.u.d;
    case M40_JV_CALLABLE:
        return a.u.fn == b.u.fn;
    default:
        return 0;
    }
}

uint64_t jv_hash(m40_jvalue v)
{
    uint64_t h = 1469598103934665603ull;
    switch (v.type) {
    case M40_JV_STRING:
        for (size_t i = 0; i < v.u.s->len; i++) {
            h ^= (unsigned char)v.u.s->s[i];
            h *= 1099511628211ull;
        }
        return h;
    case M40_JV_INT:
    case M40_JV_BOOL:
        return (uint64_t)jv_intval(v) * 0x9E3779B97F4A7C15ull;
    case M40_JV_FLOAT:
        /* Equal numbers hash alike, as in Python: 1.0 and 1 are the same key. */
        if (v.u.f == floor(v.u.f) && fabs(v.u.f) < 9e18)
            return (uint64_t)(int64_t)v.u.f * 0x9E3779B97F4A7C15ull;
        {
            uint64_t bits;
            memcpy(&bits, &v.u.f, sizeof bits);
            return bits * 0x9E3779B97F4A7C15ull;
        }
    default:
        return (uint64_t)v.type;
    }
}

int jv_truthy(m40_jvalue v)
{
    switch (v.type) {
    case M40_JV_UNDEFINED:
    case M40_JV_NONE:
        return 0;
    case M40_JV_BOOL:
        return v.u.b;
    case M40_JV_INT:
        return v.u.i != 0;
    case M40_JV_FLOAT:
        return v.u.f != 0;
    case M40_JV_STRING:
        return v.u.s->len != 0;
    case M40_JV_LIST:
        return v.u.l->kind == JL_GEN || v.u.l->n != 0;
    case M40_JV_DICT:
        return v.u.d->n != 0;
    default:
        return 1;
    }
}

const char *jv_type_name(m40_jvalue v)
{
    static const char *names[] = {"Undefined", "NoneType", "bool", "int", "float", "str",
                                  "list", "dict", "Namespace", "function"};
    if (v.type == M40_JV_LIST) {
        static const char *kinds[] = {"list", "tuple", "generator", "dict_items", "dict_keys", "dict_values"};
        return kinds[v.u.l->kind];
    }
    return names[v.type];
}

/* ------------------------------------------------------------------ dicts */

static size_t dict_find(const m40_jdict *d, m40_jvalue key)
{
    if (d->idxcap) {
        size_t mask = d->idxcap - 1, s = (size_t)jv_hash(key) & mask;
        for (;;) {
            uint32_t e = d->idx[s];
            if (!e)
                return (size_t)-1;
            if (jv_equal(d->k[e - 1], key))
                return e - 1;
            s = (s + 1) & mask;
        }
    }
    for (size_t i = 0; i < d->n; i++)
        if (jv_equal(d->k[i], key))
            return i;
    return (size_t)-1;
}

static int dict_reindex(m40_jarena *a, m40_jdict *d, size_t want)
{
    size_t cap = 16;
    while (cap < want * 2)
        cap *= 2;
    uint32_t *idx = m40_jarena_alloc(a, cap * sizeof *idx);
    if (!idx)
        return -1;
    memset(idx, 0, cap * sizeof *idx);
    for (size_t i = 0; i < d->n; i++) {
        size_t s = (size_t)jv_hash(d->k[i]) & (cap - 1);
        while (idx[s])
            s = (s + 1) & (cap - 1);
        idx[s] = (uint32_t)(i + 1);
    }
    d->idx = idx;
    d->idxcap = cap;
    return 0;
}

m40_jvalue jv_dict_get(m40_jvalue dv, m40_jvalue key, int *found)
{
    const m40_jdict *d = dv.u.d;
    size_t i = dict_find(d, key);
    if (found)
        *found = i != (size_t)-1;
    return i == (size_t)-1 ? m40_jv_undefined() : d->v[i];
}

int jv_dict_has(m40_jvalue d, m40_jvalue key) { return dict_find(d.u.d, key) != (size_t)-1; }

int m40_jv_dict_set(m40_jarena *a, m40_jvalue dv, m40_jvalue key, m40_jvalue val)
{
    m40_jdict *d = dv.u.d;
    size_t i = dict_find(d, key);
    if (i != (size_t)-1) {
        d->v[i] = val;
        return 0;
    }
    if (d->n >= UINT32_MAX - 1)
        return -1;
    if (d->n == d->cap) {
        size_t nc = d->cap ? d->cap * 2 : 4;
        m40_jvalue *nk = m40_jarena_alloc(a, nc * sizeof *nk);
        m40_jvalue *nv = m40_jarena_alloc(a, nc * sizeof *nv);
        if (!nk || !nv)
            return -1;
        if (d->n) {
            memcpy(nk, d->k, d->n * sizeof *nk);
            memcpy(nv, d->v, d->n * sizeof *nv);
        }
        d->k = nk;
        d->v = nv;
        d->cap = nc;
    }
    d->k[d->n] = key;
    d->v[d->n] = val;
    d->n++;
    if (d->n > 8 && d->n * 2 > d->idxcap)
        return dict_reindex(a, d, d->n * 2);
    if (d->idxcap) {
        size_t s = (size_t)jv_hash(key) & (d->idxcap - 1);
        while (d->idx[s])
            s = (s + 1) & (d->idxcap - 1);
        d->idx[s] = (uint32_t)d->n;
    }
    return 0;
}

int m40_jv_dict_set_cstr(m40_jarena *a, m40_jvalue dict, const char *key, m40_jvalue val)
{
    m40_jvalue k;
    if (m40_jv_cstr(a, key, &k))
        return -1;
    return m40_jv_dict_set(a, dict, k, val);
}

m40_jvalue m40_jv_dict_get_cstr(m40_jvalue dict, const char *key)
{
    if (dict.type != M40_JV_DICT && dict.type != M40_JV_NAMESPACE)
        return m40_jv_undefined();
    /* a string header with room for the key behind it, on the stack (the header's
     * flexible array member runs into the room) */
    _Alignas(m40_jstr) unsigned char room[sizeof(m40_jstr) + 256];
    m40_jstr *h = (m40_jstr *)(void *)room;
    size_t n = strlen(key);
    if (n >= sizeof room - sizeof(m40_jstr))
        return m40_jv_undefined();
    h->len = n;
    h->markup = 0;
    memcpy(h->s, key, n + 1);
    m40_jvalue k = {.type = M40_JV_STRING, .u.s = h};
    return jv_dict_get(dict, k, NULL);
}
