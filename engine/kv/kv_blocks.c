/* Paged KV block manager: free list, reference counts, prefix cache with LRU eviction.
 * See kv_blocks.h for the model and the invariants; m40_kv_blocks_check() at the end
 * spells them out as code. */
#include "kv_blocks.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { BLOCK_FREE = 0, BLOCK_USED = 1, BLOCK_IDLE = 2 };

#define NO_BLOCK (-1)
#define ROOT_HASH 0x6d34305f6b765f30ull /* parent hash of a sequence's first block */

struct m40_kv_seq {
    m40_kv_blocks *kv;
    m40_kv_seq *prev, *next; /* live sequences of kv (check() walks them) */
    int32_t *blocks;
    int32_t n_blocks, cap;
    int32_t len;        /* reserved token slots */
    int32_t n_computed; /* tokens whose KV is final */
    int32_t n_reg;      /* leading blocks that are cached (committed or attached) */
};

struct m40_kv_blocks {
    int32_t n_blocks, bs;
    int prefix_cache;
    uint64_t hash_mask;

    /* per block */
    int32_t *refcount;
    uint8_t *state;      /* BLOCK_FREE / BLOCK_USED / BLOCK_IDLE */
    uint8_t *cached;     /* registered in the hash table */
    uint64_t *hash;      /* chain hash (valid when cached) */
    int32_t *parent;     /* previous block of the chain, NO_BLOCK for a first block */
    int32_t *n_children; /* cached blocks whose parent this is */
    int32_t *tokens;     /* n_blocks * bs: a cached block's tokens, to confirm hits */

    int32_t *free_stack; /* free list (LIFO: recently freed blocks are reused first) */
    int32_t n_free;

    int32_t *lru_prev, *lru_next; /* idle cached blocks, head = least recently released */
    int32_t lru_head, lru_tail, n_idle;

    int32_t *table; /* open addressing, linear probing, block ids, NO_BLOCK = empty */
    uint32_t table_mask;
    int32_t n_cached;

    m40_kv_seq *seqs;
    m40_kv_cache_stats stats;
};

/* ---- hashing -------------------------------------------------------------------- */

static uint64_t mix64(uint64_t x)
{
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ull;
    x ^= x >> 33;
    return x;
}

static uint64_t chain_hash(const m40_kv_blocks *kv, uint64_t parent_hash, const int32_t *tok)
{
    uint64_t h = mix64(parent_hash ^ 0x9e3779b97f4a7c15ull);
    for (int32_t i = 0; i < kv->bs; i++)
        h = mix64(h ^ ((uint64_t)(uint32_t)tok[i] + 0x9e3779b97f4a7c15ull * (uint64_t)(i + 1)));
    return h & kv->hash_mask;
}

static uint32_t table_home(const m40_kv_blocks *kv, uint64_t h)
{
    return (uint32_t)mix64(h + 0x2545f4914f6cdd1dull) & kv->table_mask;
}

/* The cached block with this chain hash, parent and tokens, or NO_BLOCK. */
static int32_t table_find(const m40_kv_blocks *kv, uint64_t h, int32_t parent, const int32_t *tok)
{
    for (uint32_t i = table_home(kv, h);; i = (i + 1) & kv->table_mask) {
        int32_t b = kv->table[i];
        if (b == NO_BLOCK)
            return NO_BLOCK;
        if (kv->hash[b] == h && kv->parent[b] == parent &&
            memcmp(kv->tokens + (size_t)b * kv->bs, tok, (size_t)kv->bs * sizeof *tok) == 0)
            return b;
    }
}

static void table_insert(m40_kv_blocks *kv, int32_t b)
{
    uint32_t i = table_home(kv, kv->hash[b]);
    while (kv->table[i] != NO_BLOCK)
        i = (i + 1) & kv->table_mask;
    kv->table[i] = b;
}

/* Backward-shift deletion keeps probe chains intact without tombstones. */
static void table_remove(m40_kv_blocks *kv, int32_t b)
{
    uint32_t m = kv->table_mask, i = table_home(kv, kv->hash[b]);
    while (kv->table[i] != b)
        i = (i + 1) & m;
    for (uint32_t j = (i + 1) & m; kv->table[j] != NO_BLOCK; j = (j + 1) & m) {
        uint32_t home = table_home(kv, kv->hash[kv->table[j]]);
        if (((j - home) & m) >= ((j - i) & m)) {
            kv->table[i] = kv->table[j];
            i = j;
        }
    }
    kv->table[i] = NO_BLOCK;
}

/* ---- block lists ---------------------------------------------------------------- */

static void lru_push_tail(m40_kv_blocks *kv, int32_t b)
{
    kv->lru_prev[b] = kv->lru_tail;
    kv->lru_next[b] = NO_BLOCK;
    if (kv->lru_tail != NO_BLOCK)
        kv->lru_next[kv->lru_tail] = b;
    else
        kv->lru_head = b;
    kv->lru_tail = b;
    kv->n_idle++;
}

static void lru_unlink(m40_kv_blocks *kv, int32_t b)
{
    int32_t p = kv->lru_prev[b], n = kv->lru_next[b];
    if (p != NO_BLOCK)
        kv->lru_next[p] = n;
    else
        kv->lru_head = n;
    if (n != NO_BLOCK)
        kv->lru_prev[n] = p;
    else
        kv->lru_tail = p;
    kv->lru_prev[b] = kv->lru_next[b] = NO_BLOCK;
    kv->n_idle--;
}

static void block_register(m40_kv_blocks *kv, int32_t b, uint64_t h, int32_t parent,
                           const int32_t *tok)
{
    kv->cached[b] = 1;
    kv->hash[b] = h;
    kv->parent[b] = parent;
    memcpy(kv->tokens + (size_t)b * kv->bs, tok, (size_t)kv->bs * sizeof *tok);
    if (parent != NO_BLOCK)
        kv->n_children[parent]++;
    table_insert(kv, b);
    kv->n_cached++;
}

static void block_unregister(m40_kv_blocks *kv, int32_t b)
{
    table_remove(kv, b);
    if (kv->parent[b] != NO_BLOCK)
        kv->n_children[kv->parent[b]]--;
    kv->cached[b] = 0;
    kv->parent[b] = NO_BLOCK;
    kv->n_cached--;
}

/* One more reference to a cached block (it may be idle in the LRU list). */
static void block_ref(m40_kv_blocks *kv, int32_t b)
{
    if (kv->state[b] == BLOCK_IDLE) {
        lru_unlink(kv, b);
        kv->state[b] = BLOCK_USED;
    }
    kv->refcount[b]++;
}

static void block_unref(m40_kv_blocks *kv, int32_t b)
{
    if (--kv->refcount[b] > 0)
        return;
    if (kv->cached[b]) {
        kv->state[b] = BLOCK_IDLE;
        lru_push_tail(kv, b);
    } else {
        kv->state[b] = BLOCK_FREE;
        kv->free_stack[kv->n_free++] = b;
    }
}

/* A fresh private block (refcount 1); the caller checked n_available. */
static int32_t block_alloc(m40_kv_blocks *kv)
{
    int32_t b;
    if (kv->n_free > 0) {
        b = kv->free_stack[--kv->n_free];
    } else {
        /* Least recently released idle block. It has no cached children: holding a
         * child implies holding its parent, and releases go tail first, so a child
         * always enters the LRU list before its parent. */
        b = kv->lru_head;
        lru_unlink(kv, b);
        block_unregister(kv, b);
        kv->stats.evictions++;
    }
    kv->state[b] = BLOCK_USED;
    kv->refcount[b] = 1;
    return b;
}

int32_t m40_kv_blocks_drop_idle(m40_kv_blocks *kv)
{
    int32_t n = 0;
    while (kv->lru_head != NO_BLOCK) {
        int32_t b = kv->lru_head;
        lru_unlink(kv, b);
        block_unregister(kv, b);
        kv->state[b] = BLOCK_FREE;
        kv->free_stack[kv->n_free++] = b;
        n++;
    }
    return n;
}

/* ---- manager -------------------------------------------------------------------- */

void m40_kv_blocks_params_default(m40_kv_blocks_params *p, int32_t n_blocks)
{
    memset(p, 0, sizeof *p);
    p->n_blocks = n_blocks;
    p->block_size = M40_KV_BLOCK_SIZE_DEFAULT;
    p->prefix_cache = 1;
    p->hash_bits = 64;
}

m40_kv_blocks *m40_kv_blocks_new(const m40_kv_blocks_params *p)
{
    int32_t bs = p->block_size > 0 ? p->block_size : M40_KV_BLOCK_SIZE_DEFAULT;
    if (p->n_blocks <= 0 || p->n_blocks > (1 << 28) || bs > (1 << 16) || p->hash_bits < 0 ||
        p->hash_bits > 64)
        return NULL;
    m40_kv_blocks *kv = calloc(1, sizeof *kv);
    if (!kv)
        return NULL;
    int32_t n = p->n_blocks;
    kv->n_blocks = n;
    kv->bs = bs;
    kv->prefix_cache = p->prefix_cache != 0;
    kv->hash_mask = (p->hash_bits == 0 || p->hash_bits == 64) ? ~0ull
                                                              : (1ull << p->hash_bits) - 1;
    uint32_t tcap = 16;
    while (tcap < 2u * (uint32_t)n) /* load factor <= 1/2 */
        tcap <<= 1;
    kv->table_mask = tcap - 1;
    kv->refcount = calloc((size_t)n, sizeof *kv->refcount);
    kv->state = calloc((size_t)n, 1);
    kv->cached = calloc((size_t)n, 1);
    kv->hash = calloc((size_t)n, sizeof *kv->hash);
    kv->parent = malloc((size_t)n * sizeof *kv->parent);
    kv->n_children = calloc((size_t)n, sizeof *kv->n_children);
    kv->tokens = kv->prefix_cache ? malloc((size_t)n * bs * sizeof *kv->tokens) : NULL;
    kv->free_stack = malloc((size_t)n * sizeof *kv->free_stack);
    kv->lru_prev = malloc((size_t)n * sizeof *kv->lru_prev);
    kv->lru_next = malloc((size_t)n * sizeof *kv->lru_next);
    kv->table = malloc((size_t)tcap * sizeof *kv->table);
    if (!kv->refcount || !kv->state || !kv->cached || !kv->hash || !kv->parent ||
        !kv->n_children || (kv->prefix_cache && !kv->tokens) || !kv->free_stack ||
        !kv->lru_prev || !kv->lru_next || !kv->table) {
        m40_kv_blocks_free(kv);
        return NULL;
    }
    /* Stack order so that block 0 is handed out first. */
    for (int32_t i = 0; i < n; i++) {
        kv->free_stack[i] = n - 1 - i;
        kv->parent[i] = kv->lru_prev[i] = kv->lru_next[i] = NO_BLOCK;
    }
    kv->n_free = n;
    kv->lru_head = kv->lru_tail = NO_BLOCK;
    for (uint32_t i = 0; i < tcap; i++)
        kv->table[i] = NO_BLOCK;
    return kv;
}

void m40_kv_blocks_free(m40_kv_blocks *kv)
{
    if (!kv)
        return;
    while (kv->seqs)
        m40_kv_seq_free(kv->seqs);
    free(kv->refcount);
    free(kv->state);
    free(kv->cached);
    free(kv->hash);
    free(kv->parent);
    free(kv->n_children);
    free(kv->tokens);
    free(kv->free_stack);
    free(kv->lru_prev);
    free(kv->lru_next);
    free(kv->table);
    free(kv);
}

int32_t m40_kv_blocks_block_size(const m40_kv_blocks *kv) { return kv->bs; }
int32_t m40_kv_blocks_n_total(const m40_kv_blocks *kv) { return kv->n_blocks; }
int32_t m40_kv_blocks_n_free(const m40_kv_blocks *kv) { return kv->n_free; }
int32_t m40_kv_blocks_n_idle(const m40_kv_blocks *kv) { return kv->n_idle; }
int32_t m40_kv_blocks_n_used(const m40_kv_blocks *kv) { return kv->n_blocks - kv->n_free - kv->n_idle; }
int32_t m40_kv_blocks_n_cached(const m40_kv_blocks *kv) { return kv->n_cached; }
int32_t m40_kv_blocks_n_available(const m40_kv_blocks *kv) { return kv->n_free + kv->n_idle; }
void m40_kv_blocks_stats(const m40_kv_blocks *kv, m40_kv_cache_stats *out) { *out = kv->stats; }

/* ---- sequences ------------------------------------------------------------------ */

m40_kv_seq *m40_kv_seq_new(m40_kv_blocks *kv)
{
    m40_kv_seq *s = calloc(1, sizeof *s);
    if (!s)
        return NULL;
    s->kv = kv;
    s->next = kv->seqs;
    if (kv->seqs)
        kv->seqs->prev = s;
    kv->seqs = s;
    return s;
}

void m40_kv_seq_free(m40_kv_seq *seq)
{
    if (!seq)
        return;
    m40_kv_blocks *kv = seq->kv;
    m40_kv_seq_reset(seq);
    if (seq->prev)
        seq->prev->next = seq->next;
    else
        kv->seqs = seq->next;
    if (seq->next)
        seq->next->prev = seq->prev;
    free(seq->blocks);
    free(seq);
}

static int seq_reserve(m40_kv_seq *seq, int32_t n_blocks)
{
    if (n_blocks <= seq->cap)
        return 0;
    int32_t cap = seq->cap ? seq->cap : 8;
    while (cap < n_blocks)
        cap *= 2;
    int32_t *b = realloc(seq->blocks, (size_t)cap * sizeof *b);
    if (!b)
        return -1;
    seq->blocks = b;
    seq->cap = cap;
    return 0;
}

int32_t m40_kv_seq_match_prefix(m40_kv_seq *seq, const int32_t *tokens, int32_t n)
{
    m40_kv_blocks *kv = seq->kv;
    if (seq->len != 0 || seq->n_blocks != 0 || n < 0)
        return -1;
    kv->stats.queries++;
    kv->stats.query_tokens += n;
    if (!kv->prefix_cache || n <= 1)
        return 0;
    int32_t max_blocks = (n - 1) / kv->bs; /* the last token is always computed */
    if (seq_reserve(seq, max_blocks) != 0)
        return 0; /* out of memory: a miss is always correct */
    uint64_t h = ROOT_HASH & kv->hash_mask;
    int32_t parent = NO_BLOCK, k = 0;
    for (; k < max_blocks; k++) {
        const int32_t *tok = tokens + (size_t)k * kv->bs;
        uint64_t hk = chain_hash(kv, h, tok);
        int32_t b = table_find(kv, hk, parent, tok);
        if (b == NO_BLOCK)
            break;
        block_ref(kv, b);
        seq->blocks[k] = b;
        parent = b;
        h = hk;
    }
    seq->n_blocks = seq->n_reg = k;
    seq->len = seq->n_computed = k * kv->bs;
    kv->stats.hit_tokens += seq->len;
    return seq->len;
}

int32_t m40_kv_seq_blocks_needed(const m40_kv_seq *seq, int32_t n)
{
    int64_t want = ((int64_t)seq->len + (n > 0 ? n : 0) + seq->kv->bs - 1) / seq->kv->bs;
    int64_t need = want - seq->n_blocks;
    return need > INT32_MAX ? INT32_MAX : (int32_t)need;
}

int m40_kv_seq_append(m40_kv_seq *seq, int32_t n)
{
    m40_kv_blocks *kv = seq->kv;
    if (n < 0 || (int64_t)seq->len + n > INT32_MAX - kv->bs)
        return -1;
    int32_t need = m40_kv_seq_blocks_needed(seq, n);
    if (need > m40_kv_blocks_n_available(kv) || seq_reserve(seq, seq->n_blocks + need) != 0)
        return -1;
    for (int32_t i = 0; i < need; i++)
        seq->blocks[seq->n_blocks++] = block_alloc(kv);
    seq->len += n;
    return 0;
}

int m40_kv_seq_commit(m40_kv_seq *seq, const int32_t *tokens, int32_t n_computed)
{
    m40_kv_blocks *kv = seq->kv;
    if (n_computed < seq->n_computed || n_computed > seq->len ||
        (kv->prefix_cache && !tokens && n_computed >= kv->bs))
        return -1;
    kv->stats.computed_tokens += n_computed - seq->n_computed;
    seq->n_computed = n_computed;
    if (!kv->prefix_cache)
        return 0;
    int32_t full = n_computed / kv->bs;
    for (int32_t k = seq->n_reg; k < full; k++) {
        int32_t parent = k > 0 ? seq->blocks[k - 1] : NO_BLOCK;
        uint64_t ph = parent != NO_BLOCK ? kv->hash[parent] : (ROOT_HASH & kv->hash_mask);
        const int32_t *tok = tokens + (size_t)k * kv->bs;
        uint64_t h = chain_hash(kv, ph, tok);
        int32_t b = seq->blocks[k];
        int32_t dup = table_find(kv, h, parent, tok);
        if (dup == NO_BLOCK) {
            block_register(kv, b, h, parent, tok);
        } else {
            /* Same prefix computed twice (e.g. identical prompts in one step): keep
             * one copy. Our block is private (refcount 1), so this frees it. */
            block_ref(kv, dup);
            block_unref(kv, b);
            seq->blocks[k] = dup;
            kv->stats.dedups++;
        }
    }
    if (full > seq->n_reg)
        seq->n_reg = full;
    return 0;
}

int32_t m40_kv_seq_truncate(m40_kv_seq *seq, int32_t n_tokens)
{
    m40_kv_blocks *kv = seq->kv;
    if (n_tokens < 0)
        n_tokens = 0;
    if (n_tokens >= seq->len)
        return seq->len;
    int32_t keep = (n_tokens + kv->bs - 1) / kv->bs;
    if (n_tokens % kv->bs != 0) {
        /* The cut leaves block keep-1 partial: it will be written again, which is only
         * allowed for a private block. */
        int32_t b = seq->blocks[keep - 1];
        if (kv->cached[b]) {
            if (kv->refcount[b] == 1 && kv->n_children[b] == 0) {
                block_unregister(kv, b);
            } else {
                keep--;
                n_tokens = keep * kv->bs;
            }
        }
    }
    while (seq->n_blocks > keep) /* tail first: keeps children older than parents in LRU */
        block_unref(kv, seq->blocks[--seq->n_blocks]);
    seq->len = n_tokens;
    if (seq->n_computed > n_tokens)
        seq->n_computed = n_tokens;
    if (seq->n_reg > n_tokens / kv->bs)
        seq->n_reg = n_tokens / kv->bs;
    return n_tokens;
}

void m40_kv_seq_reset(m40_kv_seq *seq)
{
    m40_kv_seq_truncate(seq, 0);
}

int32_t m40_kv_seq_len(const m40_kv_seq *seq) { return seq->len; }
int32_t m40_kv_seq_n_computed(const m40_kv_seq *seq) { return seq->n_computed; }
int32_t m40_kv_seq_n_blocks(const m40_kv_seq *seq) { return seq->n_blocks; }
const int32_t *m40_kv_seq_blocks(const m40_kv_seq *seq) { return seq->blocks; }

int64_t m40_kv_seq_slot(const m40_kv_seq *seq, int32_t pos)
{
    if (pos < 0 || pos >= seq->len)
        return -1;
    int32_t bs = seq->kv->bs;
    return (int64_t)seq->blocks[pos / bs] * bs + pos % bs;
}

int32_t m40_kv_blocks_csr(const m40_kv_seq *const *seqs, int32_t n_seq, int32_t *indptr,
                          int32_t *indices, int32_t cap_indices, int32_t *last_page_len)
{
    int64_t total = 0;
    for (int32_t i = 0; i < n_seq; i++)
        total += seqs[i]->n_blocks;
    if (total > cap_indices)
        return -1;
    int32_t at = 0;
    indptr[0] = 0;
    for (int32_t i = 0; i < n_seq; i++) {
        const m40_kv_seq *s = seqs[i];
        int32_t bs = s->kv->bs;
        memcpy(indices + at, s->blocks, (size_t)s->n_blocks * sizeof *indices);
        at += s->n_blocks;
        indptr[i + 1] = at;
        last_page_len[i] = s->len == 0 ? 0 : s->len - (s->n_blocks - 1) * bs;
    }
    return at;
}

/* ---- consistency ---------------------------------------------------------------- */

static int fail(char *err, size_t errsz, const char *fmt, ...)
{
    if (err && errsz) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err, errsz, fmt, ap);
        va_end(ap);
    }
    return -1;
}

#define FAIL(...) do { rc = fail(err, errsz, __VA_ARGS__); goto out; } while (0)

int m40_kv_blocks_check(const m40_kv_blocks *kv, char *err, size_t errsz)
{
    int32_t n = kv->n_blocks, bs = kv->bs;
    int rc = 0;
    int32_t *held = calloc((size_t)n, sizeof *held);   /* references from live sequences */
    int32_t *seen = calloc((size_t)n, sizeof *seen);   /* list membership / LRU position */
    int32_t *kids = calloc((size_t)n, sizeof *kids);
    if (!held || !seen || !kids) {
        rc = fail(err, errsz, "out of memory");
        goto out;
    }

    /* sequences */
    for (const m40_kv_seq *s = kv->seqs; s; s = s->next) {
        if (s->kv != kv || (s->next && s->next->prev != s) || (!s->prev && kv->seqs != s))
            FAIL("sequence list corrupt");
        if (s->len < 0 || s->n_blocks != (s->len + bs - 1) / bs)
            FAIL("sequence of %d tokens holds %d blocks", s->len, s->n_blocks);
        if (s->n_computed < 0 || s->n_computed > s->len)
            FAIL("sequence computed %d of %d tokens", s->n_computed, s->len);
        if (s->n_reg != (kv->prefix_cache ? s->n_computed / bs : 0))
            FAIL("sequence has %d cached blocks, %d computed tokens", s->n_reg, s->n_computed);
        for (int32_t k = 0; k < s->n_blocks; k++) {
            int32_t b = s->blocks[k];
            if (b < 0 || b >= n)
                FAIL("sequence block %d out of range", b);
            if (seen[b] == 1)
                FAIL("block %d appears twice in one sequence", b);
            seen[b] = 1;
            held[b]++;
            if (k < s->n_reg) {
                if (!kv->cached[b] || kv->parent[b] != (k ? s->blocks[k - 1] : NO_BLOCK))
                    FAIL("committed block %d (index %d) not cached in chain", b, k);
            } else if (kv->cached[b] || kv->refcount[b] != 1) {
                FAIL("uncommitted block %d (index %d) not private (rc %d, cached %d)", b, k,
                     kv->refcount[b], kv->cached[b]);
            }
        }
        for (int32_t k = 0; k < s->n_blocks; k++)
            seen[s->blocks[k]] = 0;
    }

    /* free list */
    if (kv->n_free < 0 || kv->n_free > n)
        FAIL("free count %d", kv->n_free);
    for (int32_t i = 0; i < kv->n_free; i++) {
        int32_t b = kv->free_stack[i];
        if (b < 0 || b >= n || seen[b])
            FAIL("free list entry %d bad or repeated", b);
        seen[b] = -1;
        if (kv->state[b] != BLOCK_FREE || kv->refcount[b] != 0 || kv->cached[b])
            FAIL("free block %d: state %d rc %d cached %d", b, kv->state[b], kv->refcount[b],
                 kv->cached[b]);
    }

    /* LRU list: seen[] = position + 1 */
    int32_t pos = 0, prev = NO_BLOCK;
    for (int32_t b = kv->lru_head; b != NO_BLOCK; prev = b, b = kv->lru_next[b]) {
        if (b < 0 || b >= n || seen[b] || pos >= n)
            FAIL("LRU list entry %d bad or repeated", b);
        if (kv->lru_prev[b] != prev)
            FAIL("LRU back link of %d", b);
        seen[b] = ++pos;
        if (kv->state[b] != BLOCK_IDLE || kv->refcount[b] != 0 || !kv->cached[b])
            FAIL("idle block %d: state %d rc %d cached %d", b, kv->state[b], kv->refcount[b],
                 kv->cached[b]);
    }
    if (prev != kv->lru_tail || pos != kv->n_idle)
        FAIL("LRU tail or count (%d listed, %d counted)", pos, kv->n_idle);

    /* every block: exactly one place, refcount == references from sequences */
    int32_t n_used = 0, n_cached = 0;
    for (int32_t b = 0; b < n; b++) {
        if (kv->refcount[b] != held[b])
            FAIL("block %d refcount %d but %d sequence references", b, kv->refcount[b], held[b]);
        if (held[b] > 0) {
            if (kv->state[b] != BLOCK_USED || seen[b])
                FAIL("held block %d is on a list (state %d)", b, kv->state[b]);
            n_used++;
            if (held[b] > 1 && !kv->cached[b])
                FAIL("block %d shared by %d sequences but not a cached full block", b, held[b]);
        } else if (!seen[b]) {
            FAIL("block %d leaked: unreferenced and on no list", b);
        }
        if (kv->cached[b]) {
            n_cached++;
            int32_t p = kv->parent[b];
            if (p != NO_BLOCK) {
                if (p < 0 || p >= n || !kv->cached[p])
                    FAIL("cached block %d has uncached parent %d", b, p);
                kids[p]++;
                if (seen[b] > 0 && seen[p] > 0 && seen[b] > seen[p])
                    FAIL("idle block %d is newer in LRU than its parent %d", b, p);
            }
            uint64_t ph = p != NO_BLOCK ? kv->hash[p] : (ROOT_HASH & kv->hash_mask);
            if (chain_hash(kv, ph, kv->tokens + (size_t)b * bs) != kv->hash[b])
                FAIL("cached block %d hash does not match its chain", b);
            if (table_find(kv, kv->hash[b], p, kv->tokens + (size_t)b * bs) != b)
                FAIL("cached block %d not found in the table (or a duplicate is)", b);
        } else if (kv->parent[b] != NO_BLOCK) {
            FAIL("uncached block %d keeps a parent", b);
        }
    }
    if (n_used != m40_kv_blocks_n_used(kv) || n_used + kv->n_free + kv->n_idle != n)
        FAIL("accounting: used %d free %d idle %d total %d", n_used, kv->n_free, kv->n_idle, n);
    if (n_cached != kv->n_cached)
        FAIL("cached count %d, counted %d", kv->n_cached, n_cached);
    for (int32_t b = 0; b < n; b++)
        if (kids[b] != kv->n_children[b])
            FAIL("block %d child count %d, counted %d", b, kv->n_children[b], kids[b]);
    int32_t in_table = 0;
    for (uint32_t i = 0; i <= kv->table_mask; i++) {
        int32_t b = kv->table[i];
        if (b == NO_BLOCK)
            continue;
        if (b < 0 || b >= n || !kv->cached[b])
            FAIL("table slot %u holds uncached block %d", i, b);
        in_table++;
    }
    if (in_table != kv->n_cached)
        FAIL("table holds %d entries, %d cached blocks", in_table, kv->n_cached);
    if (kv->stats.hit_tokens > kv->stats.query_tokens || kv->stats.hit_tokens < 0)
        FAIL("stats: %lld hit of %lld queried tokens", (long long)kv->stats.hit_tokens,
             (long long)kv->stats.query_tokens);
out:
    free(held);
    free(seen);
    free(kids);
    return rc;
}
