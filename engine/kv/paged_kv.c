/* The paged KV pool's bookkeeping (see paged_kv.h). */
#include "paged_kv.h"

#include <stdlib.h>
#include <string.h>

#include "util/err.h"

struct m40_paged_kv {
    int32_t n_slots, n_blocks;
    m40_kv_blocks *mgr;
    m40_kv_seq **seqs;
    /* Prefix cache: the token id at every position of each slot (what m40_kv_seq_commit
     * keys the slot's full blocks by), grown with the slot's length. */
    int prefix_cache;
    int32_t **toks;
    int32_t *toks_cap;
    /* The reserved step: groups of at most n_slots slots (m40_kv_step) and the batch it
     * was reserved for, until a forward call claims it. */
    int32_t *grp_slot, *grp_first, *grp_n;
    m40_kv_seq **grp_seq;
    m40_kv_step step;
    int pending;
    int32_t pending_n;
    const int32_t *pending_tokens, *pending_pos, *pending_slot;
};

m40_paged_kv *m40_paged_kv_new(int32_t n_slots, int32_t n_blocks, int32_t block_size, int prefix_cache)
{
    if (n_slots <= 0 || n_blocks <= 0)
        return NULL;
    m40_paged_kv *p = calloc(1, sizeof *p);
    if (!p)
        return NULL;
    p->n_slots = n_slots;
    p->n_blocks = n_blocks;
    m40_kv_blocks_params bp;
    m40_kv_blocks_params_default(&bp, n_blocks);
    bp.block_size = block_size;
    bp.prefix_cache = p->prefix_cache = prefix_cache;
    p->mgr = m40_kv_blocks_new(&bp);
    p->seqs = calloc((size_t)n_slots, sizeof *p->seqs);
    p->toks = calloc((size_t)n_slots, sizeof *p->toks);
    p->toks_cap = calloc((size_t)n_slots, sizeof *p->toks_cap);
    p->grp_slot = malloc((size_t)n_slots * sizeof *p->grp_slot);
    p->grp_first = malloc((size_t)n_slots * sizeof *p->grp_first);
    p->grp_n = malloc((size_t)n_slots * sizeof *p->grp_n);
    p->grp_seq = malloc((size_t)n_slots * sizeof *p->grp_seq);
    if (!p->mgr || !p->seqs || !p->toks || !p->toks_cap || !p->grp_slot || !p->grp_first || !p->grp_n ||
        !p->grp_seq) {
        m40_paged_kv_free(p);
        return NULL;
    }
    for (int32_t i = 0; i < n_slots; i++)
        if (!(p->seqs[i] = m40_kv_seq_new(p->mgr))) {
            m40_paged_kv_free(p);
            return NULL;
        }
    p->step = (m40_kv_step){0, 0, p->grp_slot, p->grp_first, p->grp_n, p->grp_seq};
    return p;
}

void m40_paged_kv_free(m40_paged_kv *p)
{
    if (!p)
        return;
    if (p->seqs)
        for (int32_t i = 0; i < p->n_slots; i++)
            m40_kv_seq_free(p->seqs[i]);
    free(p->seqs);
    m40_kv_blocks_free(p->mgr);
    if (p->toks)
        for (int32_t i = 0; i < p->n_slots; i++)
            free(p->toks[i]);
    free(p->toks);
    free(p->toks_cap);
    free(p->grp_slot);
    free(p->grp_first);
    free(p->grp_n);
    free(p->grp_seq);
    free(p);
}

void m40_paged_kv_slot_clear(m40_paged_kv *p, int32_t slot)
{
    if (slot >= 0 && slot < p->n_slots)
        m40_kv_seq_reset(p->seqs[slot]);
}

int32_t m40_paged_kv_blocks_total(const m40_paged_kv *p) { return p->n_blocks; }
int32_t m40_paged_kv_blocks_free(const m40_paged_kv *p) { return m40_kv_blocks_n_available(p->mgr); }

/* Room for n token ids in slot's token record. -1 when out of memory. */
static int slot_toks_reserve(m40_paged_kv *p, int32_t slot, int32_t n)
{
    if (n <= p->toks_cap[slot])
        return 0;
    int32_t cap = p->toks_cap[slot] > 0 ? p->toks_cap[slot] : 64;
    while (cap < n)
        cap = cap > INT32_MAX / 2 ? n : cap * 2;
    int32_t *t = realloc(p->toks[slot], (size_t)cap * sizeof *t);
    if (!t)
        return -1;
    p->toks[slot] = t;
    p->toks_cap[slot] = cap;
    return 0;
}

int m40_paged_kv_prefix_cache(const m40_paged_kv *p) { return p->prefix_cache; }

int32_t m40_paged_kv_match_prefix(m40_paged_kv *p, int32_t slot, const int32_t *tokens, int32_t n)
{
    if (slot < 0 || slot >= p->n_slots || n <= 0 || m40_kv_seq_len(p->seqs[slot]) != 0)
        return 0;
    /* The record must hold the matched tokens before later commits read it; sized for
     * the whole prompt, which the coming prefill needs anyway. */
    if (p->prefix_cache && slot_toks_reserve(p, slot, n) != 0)
        return 0;
    int32_t got = m40_kv_seq_match_prefix(p->seqs[slot], tokens, n);
    if (got <= 0)
        return 0;
    memcpy(p->toks[slot], tokens, (size_t)got * sizeof *tokens);
    return got;
}

void m40_paged_kv_prefix_stats(const m40_paged_kv *p, int64_t *queries, int64_t *query_tokens, int64_t *hit_tokens)
{
    m40_kv_cache_stats st;
    m40_kv_blocks_stats(p->mgr, &st);
    *queries = st.queries;
    *query_tokens = st.query_tokens;
    *hit_tokens = st.hit_tokens;
}

void m40_paged_kv_prefix_forget(m40_paged_kv *p) { m40_kv_blocks_drop_idle(p->mgr); }

int m40_paged_kv_reserve(m40_paged_kv *p, int32_t n, const int32_t *tokens, const int32_t *pos, const int32_t *slot,
                         char *err, size_t errlen)
{
    p->pending = 0;
    p->step.n_grp = p->step.n_dec = 0;
    /* Group rows by slot, in order of first appearance; check each slot's positions. */
    int32_t n_grp = 0;
    for (int32_t i = 0; i < n; i++) {
        if (slot[i] < 0 || slot[i] >= p->n_slots) { /* groups never outnumber the slots */
            m40_set_err(err, errlen, "batch entry %d: slot %d out of range (%d slots)", (int)i, (int)slot[i],
                        (int)p->n_slots);
            return -1;
        }
        int32_t j = 0;
        while (j < n_grp && p->grp_slot[j] != slot[i])
            j++;
        if (j == n_grp) {
            p->grp_slot[n_grp] = slot[i];
            p->grp_first[n_grp] = pos[i];
            p->grp_n[n_grp] = 0;
            n_grp++;
        }
        if (pos[i] != p->grp_first[j] + p->grp_n[j]) {
            m40_set_err(err, errlen, "batch entry %d: slot %d's positions must be consecutive (got %d after %d)", (int)i,
                    (int)slot[i], (int)pos[i], (int)(p->grp_first[j] + p->grp_n[j] - 1));
            return -1;
        }
        p->grp_n[j]++;
    }
    /* Decoding groups (one token) first, in order, then the prompt chunks: the first n_dec
     * rows of the step are then one decode query each, for the decode attention kernel,
     * and the prefill kernel takes the rest (a mixed step no longer runs its decode rows
     * through prefill tiles of one query without split-K). */
    int32_t n_dec = 0;
    for (int32_t j = 0; j < n_grp; j++)
        if (p->grp_n[j] == 1) {
            int32_t sl = p->grp_slot[j], fi = p->grp_first[j];
            memmove(p->grp_slot + n_dec + 1, p->grp_slot + n_dec, (size_t)(j - n_dec) * sizeof *p->grp_slot);
            memmove(p->grp_first + n_dec + 1, p->grp_first + n_dec, (size_t)(j - n_dec) * sizeof *p->grp_first);
            memmove(p->grp_n + n_dec + 1, p->grp_n + n_dec, (size_t)(j - n_dec) * sizeof *p->grp_n);
            p->grp_slot[n_dec] = sl, p->grp_first[n_dec] = fi, p->grp_n[n_dec] = 1;
            n_dec++;
        }
    /* A slot's tokens continue its cache; a first position below its length restarts
     * the slot there (a new sequence in a reused slot). */
    int64_t need = 0;
    for (int32_t j = 0; j < n_grp; j++) {
        m40_kv_seq *s = p->seqs[p->grp_slot[j]];
        int32_t len = m40_kv_seq_len(s);
        if (p->grp_first[j] > len) {
            m40_set_err(err, errlen, "slot %d: position %d skips ahead of its cache (%d tokens)", (int)p->grp_slot[j],
                    (int)p->grp_first[j], (int)len);
            return -1;
        }
        if (p->grp_first[j] < len && m40_kv_seq_truncate(s, p->grp_first[j]) != p->grp_first[j]) {
            m40_set_err(err, errlen, "slot %d: cannot restart at position %d", (int)p->grp_slot[j], (int)p->grp_first[j]);
            return -1;
        }
        if (p->prefix_cache && slot_toks_reserve(p, p->grp_slot[j], p->grp_first[j] + p->grp_n[j]) != 0) {
            m40_set_err(err, errlen, "out of memory for slot %d's token record", (int)p->grp_slot[j]);
            return -1;
        }
        need += m40_kv_seq_blocks_needed(s, p->grp_n[j]);
        p->grp_seq[j] = s;
    }
    if (need > m40_kv_blocks_n_available(p->mgr)) {
        m40_set_err(err, errlen, "the KV cache pool is full: this step needs %lld blocks, %d are free of %d",
                (long long)need, (int)m40_kv_blocks_n_available(p->mgr), (int)p->n_blocks);
        return M40_KV_NO_BLOCKS;
    }
    for (int32_t j = 0; j < n_grp; j++)
        if (m40_kv_seq_append(p->grp_seq[j], p->grp_n[j]) != 0) {
            m40_set_err(err, errlen, "KV block allocation failed");
            return -1;
        }
    if (p->prefix_cache) /* the ids the commit keys full blocks by */
        for (int32_t i = 0; i < n; i++)
            p->toks[slot[i]][pos[i]] = tokens[i];
    p->step.n_grp = n_grp;
    p->step.n_dec = n_dec;
    p->pending = 1;
    p->pending_n = n;
    p->pending_tokens = tokens;
    p->pending_pos = pos;
    p->pending_slot = slot;
    return 0;
}

int m40_paged_kv_claim(m40_paged_kv *p, int32_t n, const int32_t *tokens, const int32_t *pos, const int32_t *slot)
{
    int mine = p->pending && p->pending_n == n && p->pending_tokens == tokens && p->pending_pos == pos &&
               p->pending_slot == slot;
    p->pending = 0;
    return mine;
}

const m40_kv_step *m40_paged_kv_step(const m40_paged_kv *p) { return &p->step; }

void m40_paged_kv_commit(m40_paged_kv *p)
{
    for (int32_t j = 0; j < p->step.n_grp; j++)
        m40_kv_seq_commit(p->grp_seq[j], p->prefix_cache ? p->toks[p->grp_slot[j]] : NULL,
                          m40_kv_seq_len(p->grp_seq[j]));
}
