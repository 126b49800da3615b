/* Token-level matching: which vocabulary entries may come next.
 *
 * The vocabulary's token bytes form a trie (built once per model). The mask of a matcher
 * state is one depth-first walk of the trie in which each edge is a cached transition of
 * the byte DFA (matcher.c): a subtree is skipped as soon as its prefix is dead, and tokens
 * sharing a prefix share the work. Masks are cached per state, so a state seen before
 * (the inside of a string, the spot after a comma) costs a lookup. End-of-generation
 * tokens are allowed exactly in accepting states. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "grammar_int.h"

#define MAX_CACHED_MASKS 1024 /* past this the cache is dropped whole (masks are recomputable) */

typedef struct {
    int32_t first_child, next_sibling, tok_head;
    uint8_t byte;
} tnode;

struct m40_token_trie {
    int32_t n_vocab;
    tnode *nodes;
    int32_t n_nodes, cap_nodes;
    int32_t *tok_next;          /* tokens ending at the same node, linked */
    uint8_t *eog;
    char *text;                 /* every token's bytes, token i at text[off[i] .. off[i+1]) */
    int64_t *off;
};

static int32_t node_new(m40_token_trie *t, uint8_t byte)
{
    if (t->n_nodes == t->cap_nodes) {
        int32_t cap = t->cap_nodes ? t->cap_nodes * 2 : 1024;
        tnode *n = realloc(t->nodes, sizeof *n * (size_t)cap);
        if (!n)
            return -1;
        t->nodes = n;
        t->cap_nodes = cap;
    }
    t->nodes[t->n_nodes] = (tnode){-1, -1, -1, byte};
    return t->n_nodes++;
}

m40_token_trie *m40_token_trie_new(int32_t n_vocab, const char *const *bytes, const int32_t *lens,
                                   const uint8_t *eog)
{
    m40_token_trie *t = calloc(1, sizeof *t);
    if (!t || n_vocab <= 0)
        goto fail;
    t->n_vocab = n_vocab;
    t->tok_next = malloc(sizeof *t->tok_next * (size_t)n_vocab);
    t->eog = calloc((size_t)n_vocab, 1);
    t->off = malloc(sizeof *t->off * ((size_t)n_vocab + 1));
    if (!t->tok_next || !t->eog || !t->off || node_new(t, 0) < 0)
        goto fail;
    int64_t total = 0;
    for (int32_t id = 0; id < n_vocab; id++) {
        t->off[id] = total;
        if (bytes && bytes[id] && lens && lens[id] > 0 && !(eog && eog[id]))
            total += lens[id];
    }
    t->off[n_vocab] = total;
    if (!(t->text = malloc((size_t)total + 1)))
        goto fail;
    for (int32_t id = 0; id < n_vocab; id++)
        memcpy(t->text + t->off[id], bytes ? bytes[id] : "", (size_t)(t->off[id + 1] - t->off[id]));
    /* root's children are looked up often while building: a direct table */
    int32_t root_child[256];
    for (int i = 0; i < 256; i++)
        root_child[i] = -1;
    for (int32_t id = 0; id < n_vocab; id++) {
        t->tok_next[id] = -1;
        t->eog[id] = eog && eog[id];
        if (t->eog[id] || !bytes || !bytes[id] || !lens || lens[id] <= 0)
            continue; /* no text: never allowed by the trie walk */
        const uint8_t *b = (const uint8_t *)bytes[id];
        int32_t cur = root_child[b[0]];
        if (cur < 0) {
            if ((cur = node_new(t, b[0])) < 0)
                goto fail;
            t->nodes[cur].next_sibling = t->nodes[0].first_child;
            t->nodes[0].first_child = cur;
            root_child[b[0]] = cur;
        }
        for (int32_t i = 1; i < lens[id]; i++) {
            int32_t c = t->nodes[cur].first_child;
            while (c >= 0 && t->nodes[c].byte != b[i])
                c = t->nodes[c].next_sibling;
            if (c < 0) {
                if ((c = node_new(t, b[i])) < 0)
                    goto fail;
                t->nodes[c].next_sibling = t->nodes[cur].first_child;
                t->nodes[cur].first_child = c;
            }
            cur = c;
        }
        t->tok_next[id] = t->nodes[cur].tok_head;
        t->nodes[cur].tok_head = id;
    }
    return t;
fail:
    m40_token_trie_free(t);
    return NULL;
}

void m40_token_trie_free(m40_token_trie *t)
{
    if (!t)
        return;
    free(t->nodes);
    free(t->tok_next);
    free(t->eog);
    free(t->text);
    free(t->off);
    free(t);
}

int32_t m40_token_trie_n_vocab(const m40_token_trie *t) { return t->n_vocab; }

struct m40_gconstraint {
    m40_grammar *g;
    const m40_token_trie *t;
    m40_gmatch *m;
    int32_t state;
    int32_t words;
    uint32_t **masks;           /* by state id */
    int32_t masks_cap, masks_live;
    int32_t *dfs;               /* (node, state) pairs */
    int oom;
};

m40_gconstraint *m40_gconstraint_new(m40_grammar *g, const m40_token_trie *t)
{
    m40_gconstraint *c = calloc(1, sizeof *c);
    if (!c) {
        m40_grammar_free(g);
        return NULL;
    }
    c->g = g;
    c->t = t;
    c->words = (t->n_vocab + 31) / 32;
    c->m = m40_gmatch_new(g);
    c->dfs = malloc(sizeof *c->dfs * 2 * (size_t)t->n_nodes);
    if (!c->m || !c->dfs) {
        m40_gconstraint_free(c);
        return NULL;
    }
    c->state = m40_gmatch_start(c->m);
    return c;
}

void m40_gconstraint_free(m40_gconstraint *c)
{
    if (!c)
        return;
    for (int32_t i = 0; i < c->masks_cap; i++)
        free(c->masks[i]);
    free(c->masks);
    free(c->dfs);
    m40_gmatch_free(c->m);
    m40_grammar_free(c->g);
    free(c);
}

static void compute_mask(m40_gconstraint *c, int32_t state, uint32_t *mask)
{
    const m40_token_trie *t = c->t;
    memset(mask, 0, sizeof *mask * (size_t)c->words);
    if (m40_gmatch_accepting(c->m, state))
        for (int32_t id = 0; id < t->n_vocab; id++)
            if (t->eog[id])
                mask[id >> 5] |= 1u << (id & 31);
    size_t sp = 0;
    c->dfs[sp++] = 0;
    c->dfs[sp++] = state;
    while (sp) {
        int32_t s = c->dfs[--sp], node = c->dfs[--sp];
        for (int32_t ch = t->nodes[node].first_child; ch >= 0; ch = t->nodes[ch].next_sibling) {
            int32_t ns = m40_gmatch_next(c->m, s, t->nodes[ch].byte);
            if (ns < 0)
                continue;
            for (int32_t id = t->nodes[ch].tok_head; id >= 0; id = t->tok_next[id])
                mask[id >> 5] |= 1u << (id & 31);
            if (t->nodes[ch].first_child >= 0) {
                c->dfs[sp++] = ch;
                c->dfs[sp++] = ns;
            }
        }
    }
}

const uint32_t *m40_gconstraint_mask(m40_gconstraint *c)
{
    if (c->state < 0 || m40_gmatch_error(c->m))
        return NULL;
    if (c->state >= c->masks_cap) {
        int32_t cap = c->masks_cap ? c->masks_cap : 64;
        while (cap <= c->state)
            cap *= 2;
        uint32_t **m = realloc(c->masks, sizeof *m * (size_t)cap);
        if (!m) {
            c->oom = 1;
            return NULL;
        }
        memset(m + c->masks_cap, 0, sizeof *m * (size_t)(cap - c->masks_cap));
        c->masks = m;
        c->masks_cap = cap;
    }
    if (!c->masks[c->state]) {
        if (c->masks_live >= MAX_CACHED_MASKS) {
            for (int32_t i = 0; i < c->masks_cap; i++) {
                free(c->masks[i]);
                c->masks[i] = NULL;
            }
            c->masks_live = 0;
        }
        uint32_t *mask = malloc(sizeof *mask * (size_t)c->words);
        if (!mask) {
            c->oom = 1;
            return NULL;
        }
        compute_mask(c, c->state, mask);
        if (m40_gmatch_error(c->m)) {
            free(mask);
            return NULL;
        }
        c->masks[c->state] = mask;
        c->masks_live++;
    }
    return c->masks[c->state];
}

int32_t m40_gconstraint_apply(m40_gconstraint *c, float *logits)
{
    const uint32_t *mask = m40_gconstraint_mask(c);
    const int32_t n = c->t->n_vocab;
    int32_t allowed = 0;
    /* a mask word at a time: whole words allowed (inside strings) or banned (most of the
     * vocabulary elsewhere) cost one test for 32 tokens */
    for (int32_t w = 0; w < c->words; w++) {
        uint32_t m = mask ? mask[w] : 0;
        int32_t base = w * 32, end = base + 32 < n ? base + 32 : n;
        if (m == 0xffffffffu && end - base == 32) {
            allowed += 32;
        } else if (m == 0) {
            for (int32_t id = base; id < end; id++)
                logits[id] = -INFINITY;
        } else {
            for (int32_t id = base; id < end; id++) {
                if ((m >> (id - base)) & 1)
                    allowed++;
                else
                    logits[id] = -INFINITY;
            }
        }
    }
    return allowed;
}

/* Two passes instead of m40k_argmax_key per element (the keys' bit games cost ~4x the
 * plain comparisons on the host): the largest allowed value (NaN never wins a `>`;
 * eight running maxima so the comparisons do not wait on each other), then the first
 * allowed id holding it. The same pick as the keys: -0 equals +0, ties go to the
 * lowest id, and an allowed -inf is a value like any other. */
int32_t m40_gconstraint_argmax(m40_gconstraint *c, const float *logits)
{
    const uint32_t *mask = m40_gconstraint_mask(c);
    if (!mask)
        return -1;
    const int32_t n = c->t->n_vocab;
    float best = -INFINITY;
    for (int32_t w = 0; w < c->words; w++) {
        uint32_t m = mask[w];
        const int32_t base = w * 32;
        if (m == 0xffffffffu && base + 32 <= n) { /* inside strings: every token of the word */
            const float *p = logits + base;
            float a[8];
            for (int q = 0; q < 8; q++)
                a[q] = best;
            for (int j = 0; j < 32; j += 8)
                for (int q = 0; q < 8; q++)
                    a[q] = p[j + q] > a[q] ? p[j + q] : a[q];
            for (int q = 0; q < 8; q++)
                best = a[q] > best ? a[q] : best;
            continue;
        }
        while (m) {
            int32_t id = base + __builtin_ctz(m);
            m &= m - 1;
            if (id >= n)
                break;
            best = logits[id] > best ? logits[id] : best;
        }
    }
    for (int32_t w = 0; w < c->words; w++) {
        uint32_t m = mask[w];
        while (m) {
            int32_t id = w * 32 + __builtin_ctz(m);
            m &= m - 1;
            if (id >= n)
                break;
            if (logits[id] == best)
                return id;
        }
    }
    return -1; /* nothing allowed, or only NaN */
}

int m40_gconstraint_accept(m40_gconstraint *c, int32_t token)
{
    const m40_token_trie *t = c->t;
    if (token < 0 || token >= t->n_vocab || c->state < 0)
        return -1;
    if (t->eog[token])
        return m40_gmatch_accepting(c->m, c->state) ? 0 : -1;
    int32_t st = c->state;
    for (int64_t i = t->off[token]; i < t->off[token + 1] && st >= 0; i++)
        st = m40_gmatch_next(c->m, st, (uint8_t)t->text[i]);
    if (st < 0 || t->off[token] == t->off[token + 1])
        return -1;
    c->state = st;
    return 0;
}

const char *m40_gconstraint_error(const m40_gconstraint *c)
{
    return m40_gmatch_error(c->m) ? m40_gmatch_error(c->m) : c->oom ? "grammar: out of memory" : NULL;
}

int m40_gconstraint_done(const m40_gconstraint *c) { return m40_gmatch_final(c->m, c->state); }
int m40_gconstraint_can_end(const m40_gconstraint *c) { return m40_gmatch_accepting(c->m, c->state); }
