/* The byte-level pushdown matcher, run as a lazily built DFA.
 *
 * A parse position is a stack of element indices (the top is the next element to match,
 * the ones below are where to continue when each enclosing rule's alternative ends). A
 * matcher state is the set of all stacks the input so far allows, each expanded until its
 * top is a byte set (or it is empty: the root rule is complete). The set is put in a
 * canonical order and interned, so a state is a small integer and the transition by one
 * byte is computed once per (state, byte) and then read from a 256-entry row. Masks over
 * the vocabulary (token_matcher.c) walk those cached transitions. */
#include <stdlib.h>
#include <string.h>

#include "grammar_int.h"

#define MAX_STATES 32768      /* beyond this the automaton reports an error (states read as dead) */
#define MAX_STACKS 4096       /* stacks in one state */
#define TRANS_UNKNOWN (-2)

typedef struct {
    int32_t *v;
    size_t n, cap;
} ivec;

static int ivec_push(ivec *a, int32_t x)
{
    if (a->n == a->cap) {
        size_t cap = a->cap ? a->cap * 2 : 256;
        int32_t *v = realloc(a->v, cap * sizeof *v);
        if (!v)
            return -1;
        a->v = v;
        a->cap = cap;
    }
    a->v[a->n++] = x;
    return 0;
}

typedef struct {
    size_t key;          /* offset in keys: [n_stacks, (len, elems...)...] */
    uint32_t hash;
    uint8_t accepting, final;
    int32_t *trans;      /* 256 entries, lazily */
} gstate;

struct m40_gmatch {
    const m40_grammar *g;
    ivec keys;
    gstate *states;
    int32_t n_states, cap_states;
    int32_t *table;      /* open addressing: state ids, -1 empty */
    int32_t table_cap;
    ivec out;            /* stacks produced by one transition: (len, elems...)... */
    ivec scratch;        /* the stack being expanded */
    size_t *order;
    size_t order_cap;
    int32_t start;
    const char *error;
    size_t emitted;      /* stacks emitted by the current transition */
};

/* Expands the stack scratch.v[base .. base+n) until its top is a byte set, appending each
 * resulting stack to out. Recursion is bounded: the parser refused left recursion, so a
 * chain of expansions without consuming a byte visits each rule at most once. */
static int expand(m40_gmatch *m, size_t base, size_t n, int depth)
{
    const m40_grammar *g = m->g;
    if (depth > M40_GRAMMAR_MAX_DEPTH || n > M40_GRAMMAR_MAX_DEPTH) {
        m->error = "grammar: stack too deep";
        return -1;
    }
    for (;;) {
        if (n == 0 || g->el[m->scratch.v[base + n - 1]].type == GE_SET) {
            /* duplicates are only dropped at intern(): an ambiguous grammar (r1 ::= r2 | r2,
             * r2 ::= r3 | r3, ...) could otherwise emit exponentially many copies */
            if (++m->emitted > MAX_STACKS * 16) {
                m->error = "grammar: too many parses at once (ambiguous grammar)";
                return -1;
            }
            if (ivec_push(&m->out, (int32_t)n))
                return -1;
            for (size_t i = 0; i < n; i++)
                if (ivec_push(&m->out, m->scratch.v[base + i]))
                    return -1;
            return 0;
        }
        int32_t pos = m->scratch.v[base + n - 1];
        if (g->el[pos].type == GE_END) {
            n--;
            continue;
        }
        /* REF: the continuation replaces the top (dropped when the alternative ends right
         * there: tail calls keep right recursion flat), then one copy per alternative */
        if (g->el[pos + 1].type == GE_END)
            n--;
        else
            m->scratch.v[base + n - 1] = pos + 1;
        int32_t r = g->el[pos].v;
        for (int32_t a = 0; a < g->rule_nalt[r]; a++) {
            size_t nb = m->scratch.n;
            for (size_t i = 0; i < n; i++)
                if (ivec_push(&m->scratch, m->scratch.v[base + i]))
                    return -1;
            if (ivec_push(&m->scratch, g->alts[g->rule_alt0[r] + a]))
                return -1;
            int rc = expand(m, nb, n + 1, depth + 1);
            m->scratch.n = nb;
            if (rc)
                return -1;
        }
        return 0;
    }
}

static _Thread_local const int32_t *out_base; /* qsort has no context argument */
static int stack_cmp(const void *x, const void *y)
{
    const int32_t *a = out_base + *(const size_t *)x, *b = out_base + *(const size_t *)y;
    if (a[0] != b[0])
        return a[0] < b[0] ? -1 : 1;
    for (int32_t i = 1; i <= a[0]; i++)
        if (a[i] != b[i])
            return a[i] < b[i] ? -1 : 1;
    return 0;
}

static uint32_t hash_words(const int32_t *w, size_t n)
{
    uint32_t h = 2166136261u;
    for (size_t i = 0; i < n; i++)
        h = (h ^ (uint32_t)w[i]) * 16777619u;
    return h;
}

static int table_grow(m40_gmatch *m)
{
    int32_t cap = m->table_cap ? m->table_cap * 2 : 1024;
    int32_t *t = malloc(sizeof *t * (size_t)cap);
    if (!t)
        return -1;
    memset(t, 0xff, sizeof *t * (size_t)cap);
    for (int32_t i = 0; i < m->n_states; i++) {
        uint32_t k = m->states[i].hash & (uint32_t)(cap - 1);
        while (t[k] >= 0)
            k = (k + 1) & (uint32_t)(cap - 1);
        t[k] = i;
    }
    free(m->table);
    m->table = t;
    m->table_cap = cap;
    return 0;
}

/* Interns the set of stacks in m->out (canonical order, duplicates dropped). Returns the
 * state id, M40_GM_DEAD when there are no stacks, or -3 on an error. */
static int32_t intern(m40_gmatch *m)
{
    size_t ns = 0;
    for (size_t i = 0; i < m->out.n; i += (size_t)m->out.v[i] + 1)
        ns++;
    if (!ns)
        return M40_GM_DEAD;
    if (ns > MAX_STACKS) {
        m->error = "grammar: too many parses at once (ambiguous grammar)";
        return -3;
    }
    if (ns > m->order_cap) {
        size_t *o = realloc(m->order, ns * 2 * sizeof *o);
        if (!o)
            return -3;
        m->order = o;
        m->order_cap = ns * 2;
    }
    ns = 0;
    for (size_t i = 0; i < m->out.n; i += (size_t)m->out.v[i] + 1)
        m->order[ns++] = i;
    out_base = m->out.v;
    qsort(m->order, ns, sizeof *m->order, stack_cmp);
    /* the key goes at the end of keys; dropped again if the state already exists */
    size_t key = m->keys.n;
    if (ivec_push(&m->keys, 0))
        return -3;
    int32_t count = 0;
    int accepting = 0, all_empty = 1;
    for (size_t i = 0; i < ns; i++) {
        if (i && stack_cmp(&m->order[i - 1], &m->order[i]) == 0)
            continue;
        const int32_t *s = m->out.v + m->order[i];
        for (int32_t j = 0; j <= s[0]; j++)
            if (ivec_push(&m->keys, s[j]))
                return -3;
        count++;
        if (s[0] == 0)
            accepting = 1;
        else
            all_empty = 0;
    }
    m->keys.v[key] = count;
    size_t klen = m->keys.n - key;
    uint32_t h = hash_words(m->keys.v + key, klen);
    if (m->table_cap) {
        for (uint32_t k = h & (uint32_t)(m->table_cap - 1); m->table[k] >= 0; k = (k + 1) & (uint32_t)(m->table_cap - 1)) {
            gstate *st = &m->states[m->table[k]];
            if (st->hash != h)
                continue;
            /* compare the keys stack by stack */
            const int32_t *a = m->keys.v + st->key, *b = m->keys.v + key;
            size_t i = 0, ai = 1, bi = 1;
            if (a[0] != b[0])
                continue;
            for (i = 0; i < (size_t)a[0]; i++) {
                if (a[ai] != b[bi])
                    break;
                if (memcmp(a + ai, b + bi, sizeof(int32_t) * (size_t)(a[ai] + 1)) != 0)
                    break;
                ai += (size_t)a[ai] + 1;
                bi += (size_t)b[bi] + 1;
            }
            if (i == (size_t)a[0]) {
                m->keys.n = key;
                return m->table[k];
            }
        }
    }
    if (m->n_states >= MAX_STATES) {
        m->error = "grammar: automaton too large";
        m->keys.n = key;
        return -3;
    }
    if (m->n_states == m->cap_states) {
        int32_t cap = m->cap_states ? m->cap_states * 2 : 256;
        gstate *s = realloc(m->states, sizeof *s * (size_t)cap);
        if (!s)
            return -3;
        m->states = s;
        m->cap_states = cap;
    }
    if ((m->n_states + 1) * 2 > m->table_cap && table_grow(m))
        return -3;
    int32_t id = m->n_states++;
    m->states[id] = (gstate){.key = key, .hash = h, .accepting = (uint8_t)accepting,
                             .final = (uint8_t)(accepting && all_empty), .trans = NULL};
    uint32_t k = h & (uint32_t)(m->table_cap - 1);
    while (m->table[k] >= 0)
        k = (k + 1) & (uint32_t)(m->table_cap - 1);
    m->table[k] = id;
    return id;
}

m40_gmatch *m40_gmatch_new(const m40_grammar *g)
{
    m40_gmatch *m = calloc(1, sizeof *m);
    if (!m)
        return NULL;
    m->g = g;
    m->start = M40_GM_DEAD;
    /* the start state: the root rule's alternatives */
    int32_t r = g->root;
    for (int32_t a = 0; a < g->rule_nalt[r]; a++) {
        m->scratch.n = 0;
        if (ivec_push(&m->scratch, g->alts[g->rule_alt0[r] + a]) || expand(m, 0, 1, 0)) {
            if (!m->error)
                m->error = "grammar: out of memory";
            return m;
        }
    }
    int32_t s = intern(m);
    m->out.n = 0;
    if (s >= 0)
        m->start = s;
    else if (!m->error)
        m->error = "grammar: the root rule matches nothing";
    return m;
}

void m40_gmatch_free(m40_gmatch *m)
{
    if (!m)
        return;
    for (int32_t i = 0; i < m->n_states; i++)
        free(m->states[i].trans);
    free(m->states);
    free(m->table);
    free(m->keys.v);
    free(m->out.v);
    free(m->scratch.v);
    free(m->order);
    free(m);
}

int32_t m40_gmatch_start(m40_gmatch *m) { return m->start; }
const char *m40_gmatch_error(const m40_gmatch *m) { return m->error; }
int m40_gmatch_accepting(const m40_gmatch *m, int32_t s) { return s >= 0 && m->states[s].accepting; }
int m40_gmatch_final(const m40_gmatch *m, int32_t s) { return s >= 0 && m->states[s].final; }

int32_t m40_gmatch_next(m40_gmatch *m, int32_t s, uint8_t byte)
{
    if (s < 0 || s >= m->n_states)
        return M40_GM_DEAD;
    if (m->states[s].trans && m->states[s].trans[byte] != TRANS_UNKNOWN)
        return m->states[s].trans[byte];
    if (m->error)
        return M40_GM_DEAD;
    if (!m->states[s].trans) {
        int32_t *t = malloc(256 * sizeof *t);
        if (!t) {
            m->error = "grammar: out of memory";
            return M40_GM_DEAD;
        }
        for (int i = 0; i < 256; i++)
            t[i] = TRANS_UNKNOWN;
        m->states[s].trans = t;
    }
    const m40_grammar *g = m->g;
    m->out.n = 0;
    m->emitted = 0;
    size_t p = m->states[s].key;
    int32_t count = m->keys.v[p++];
    for (int32_t i = 0; i < count; i++) {
        int32_t len = m->keys.v[p];
        const size_t sp = p + 1;
        p += (size_t)len + 1;
        if (!len)
            continue;
        int32_t top = m->keys.v[sp + (size_t)len - 1];
        if (!m40_gset_has(g->sets[g->el[top].v], byte))
            continue;
        m->scratch.n = 0;
        for (int32_t j = 0; j < len; j++)
            if (ivec_push(&m->scratch, m->keys.v[sp + (size_t)j])) {
                m->error = "grammar: out of memory";
                return M40_GM_DEAD;
            }
        m->scratch.v[len - 1] = top + 1;
        if (expand(m, 0, (size_t)len, 0)) {
            if (!m->error)
                m->error = "grammar: out of memory";
            return M40_GM_DEAD;
        }
    }
    int32_t t = intern(m);
    m->out.n = 0;
    if (t == -3) {
        if (!m->error)
            m->error = "grammar: out of memory";
        return M40_GM_DEAD;
    }
    m->states[s].trans[byte] = t;
    return t;
}

int m40_gmatch_full(m40_gmatch *m, const char *str, size_t n)
{
    int32_t s = m40_gmatch_start(m);
    for (size_t i = 0; i < n && s >= 0; i++)
        s = m40_gmatch_next(m, s, (uint8_t)str[i]);
    return m40_gmatch_accepting(m, s);
}
