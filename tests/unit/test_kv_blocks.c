/* Paged KV block manager: directed cases, then long random workloads checked against a
 * naive reference model (prefixes kept as plain token arrays, LRU by timestamps) and
 * against a shadow KV pool the test "computes" into, so that attaching a wrong block
 * (hash collision, use after eviction, write into a shared block) shows up as a wrong
 * token at some computed position. */
#include "check.h"
#include "kv/kv_blocks.h"

#include <stdint.h>

static char err[256];

#define CHECK_KV(kv) CHECK(m40_kv_blocks_check(kv, err, sizeof err) == 0, "check: %s", err)

static m40_kv_blocks *mk(int32_t n_blocks, int32_t bs, int cache, int hash_bits)
{
    m40_kv_blocks_params p;
    m40_kv_blocks_params_default(&p, n_blocks);
    p.block_size = bs;
    p.prefix_cache = cache;
    p.hash_bits = hash_bits;
    return m40_kv_blocks_new(&p);
}

static void fill(int32_t *t, int32_t n, int32_t base)
{
    for (int32_t i = 0; i < n; i++)
        t[i] = base + i;
}

static void test_basic(void)
{
    m40_kv_blocks_params p;
    m40_kv_blocks_params_default(&p, 10);
    CHECK(p.block_size == 16 && p.prefix_cache == 1, "defaults");
    m40_kv_blocks *kv = m40_kv_blocks_new(&p);
    CHECK(kv && m40_kv_blocks_block_size(kv) == 16, "new");
    p.n_blocks = 0;
    CHECK(m40_kv_blocks_new(&p) == NULL, "zero blocks refused");
    CHECK_KV(kv);
    m40_kv_seq *a = m40_kv_seq_new(kv), *b = m40_kv_seq_new(kv), *e = m40_kv_seq_new(kv);
    CHECK(m40_kv_seq_append(a, 17) == 0 && m40_kv_seq_n_blocks(a) == 2, "17 tokens, 2 blocks");
    CHECK(m40_kv_seq_append(a, 15) == 0 && m40_kv_seq_n_blocks(a) == 2, "32 tokens, 2 blocks");
    CHECK(m40_kv_seq_append(a, 1) == 0 && m40_kv_seq_n_blocks(a) == 3, "33 tokens, 3 blocks");
    CHECK(m40_kv_seq_blocks_needed(a, 15) == 0 && m40_kv_seq_blocks_needed(a, 16) == 1, "needed");
    CHECK(m40_kv_seq_append(b, 1) == 0, "b");
    CHECK(m40_kv_blocks_n_used(kv) == 4 && m40_kv_blocks_n_free(kv) == 6, "accounting");
    CHECK_KV(kv);
    const int32_t *ab = m40_kv_seq_blocks(a);
    CHECK(m40_kv_seq_slot(a, 20) == (int64_t)ab[1] * 16 + 4, "slot");
    CHECK(m40_kv_seq_slot(a, 33) == -1 && m40_kv_seq_slot(a, -1) == -1, "slot out of range");

    const m40_kv_seq *batch[3] = {a, e, b};
    int32_t indptr[4], idx[8], lpl[3];
    CHECK(m40_kv_blocks_csr(batch, 3, indptr, idx, 3, lpl) == -1, "csr cap too small");
    CHECK(m40_kv_blocks_csr(batch, 3, indptr, idx, 8, lpl) == 4, "csr count");
    CHECK(indptr[0] == 0 && indptr[1] == 3 && indptr[2] == 3 && indptr[3] == 4, "indptr");
    CHECK(idx[0] == ab[0] && idx[1] == ab[1] && idx[2] == ab[2] &&
              idx[3] == m40_kv_seq_blocks(b)[0], "indices");
    CHECK(lpl[0] == 1 && lpl[1] == 0 && lpl[2] == 1, "last_page_len %d %d %d", lpl[0], lpl[1], lpl[2]);
    CHECK(m40_kv_seq_append(a, 15) == 0, "fill a to 48");
    m40_kv_blocks_csr(batch, 1, indptr, idx, 8, lpl);
    CHECK(lpl[0] == 16, "full last page is 16, got %d", lpl[0]);

    /* out of blocks: -1 and nothing changes */
    int32_t before_free = m40_kv_blocks_n_free(kv), before_len = m40_kv_seq_len(b);
    CHECK(m40_kv_seq_append(b, 16 * 7 + 1) == -1, "out of blocks");
    CHECK(m40_kv_blocks_n_free(kv) == before_free && m40_kv_seq_len(b) == before_len &&
              m40_kv_seq_n_blocks(b) == 1, "unchanged after -1");
    CHECK(m40_kv_seq_append(b, 16 * 6 + 15) == 0, "exactly all blocks");
    CHECK(m40_kv_blocks_n_free(kv) == 0 && m40_kv_blocks_n_available(kv) == 0, "pool empty");
    CHECK(m40_kv_seq_append(e, 1) == -1 && m40_kv_seq_n_blocks(e) == 0, "empty pool -1");
    CHECK(m40_kv_seq_append(b, 0) == 0 && m40_kv_seq_append(b, -1) == -1, "n 0 / negative");
    CHECK(m40_kv_seq_commit(a, NULL, 49) == -1 && m40_kv_seq_commit(a, NULL, 0) == 0, "commit bounds");
    CHECK_KV(kv);
    m40_kv_seq_free(a);
    m40_kv_seq_reset(b);
    CHECK(m40_kv_seq_len(b) == 0 && m40_kv_blocks_n_free(kv) == 10, "all back");
    CHECK_KV(kv);
    m40_kv_blocks_free(kv); /* frees b and e too */
}

static void test_prefix(void)
{
    m40_kv_blocks *kv = mk(16, 4, 1, 64);
    int32_t t[64];
    fill(t, 64, 100);
    m40_kv_seq *a = m40_kv_seq_new(kv);
    CHECK(m40_kv_seq_match_prefix(a, t, 10) == 0, "cold miss");
    CHECK(m40_kv_seq_append(a, 10) == 0, "reserve prompt");
    CHECK(m40_kv_seq_commit(a, t, 6) == 0 && m40_kv_blocks_n_cached(kv) == 1, "one full block");
    CHECK(m40_kv_seq_commit(a, t, 10) == 0 && m40_kv_blocks_n_cached(kv) == 2, "two full blocks");
    CHECK(m40_kv_seq_commit(a, t, 9) == -1, "computed count never goes back");
    CHECK(m40_kv_seq_match_prefix(a, t, 10) == -1, "match needs an empty sequence");
    CHECK_KV(kv);

    m40_kv_seq *b = m40_kv_seq_new(kv);
    CHECK(m40_kv_seq_match_prefix(b, t, 12) == 8, "hit 8");
    CHECK(m40_kv_seq_blocks(b)[0] == m40_kv_seq_blocks(a)[0] &&
              m40_kv_seq_blocks(b)[1] == m40_kv_seq_blocks(a)[1], "shares a's blocks");
    CHECK(m40_kv_seq_len(b) == 8 && m40_kv_seq_n_computed(b) == 8, "hit is reserved and computed");
    m40_kv_seq *c = m40_kv_seq_new(kv);
    CHECK(m40_kv_seq_match_prefix(c, t, 8) == 4, "never the whole prompt (8 tokens -> 4)");
    m40_kv_seq *d = m40_kv_seq_new(kv);
    CHECK(m40_kv_seq_match_prefix(d, t, 9) == 8, "9 tokens -> 8");
    m40_kv_seq *e = m40_kv_seq_new(kv);
    int32_t u[12];
    memcpy(u, t, sizeof u);
    u[5] = 7;
    CHECK(m40_kv_seq_match_prefix(e, u, 12) == 4, "diverges in block 1");
    m40_kv_seq *f = m40_kv_seq_new(kv);
    CHECK(m40_kv_seq_match_prefix(f, t + 4, 12) == 0, "same block tokens, other prefix: miss");
    CHECK_KV(kv);

    /* shared blocks are freed only when every holder releases them */
    int32_t blk0 = m40_kv_seq_blocks(a)[0];
    m40_kv_seq_free(a);
    m40_kv_seq_free(b);
    m40_kv_seq_free(d);
    CHECK_KV(kv);
    m40_kv_seq_free(c);
    CHECK(m40_kv_blocks_n_idle(kv) == 1, "block 1 idle, block 0 still held by e");
    m40_kv_seq_free(e);
    m40_kv_seq_free(f);
    CHECK(m40_kv_blocks_n_idle(kv) == 2 && m40_kv_blocks_n_free(kv) == 14, "both idle");
    CHECK_KV(kv);
    m40_kv_seq *g = m40_kv_seq_new(kv);
    CHECK(m40_kv_seq_match_prefix(g, t, 20) == 8 && m40_kv_seq_blocks(g)[0] == blk0, "idle hit");

    m40_kv_cache_stats st;
    m40_kv_blocks_stats(kv, &st);
    CHECK(st.queries == 7 && st.query_tokens == 10 + 12 + 8 + 9 + 12 + 12 + 20, "queries");
    CHECK(st.hit_tokens == 8 + 4 + 8 + 4 + 8, "hit tokens %lld", (long long)st.hit_tokens);
    CHECK(st.computed_tokens == 10, "computed %lld", (long long)st.computed_tokens);
    m40_kv_blocks_free(kv);

    /* prefix cache off */
    kv = mk(8, 4, 0, 64);
    a = m40_kv_seq_new(kv);
    m40_kv_seq_append(a, 9);
    CHECK(m40_kv_seq_commit(a, NULL, 9) == 0 && m40_kv_blocks_n_cached(kv) == 0, "no caching");
    m40_kv_seq_free(a);
    b = m40_kv_seq_new(kv);
    CHECK(m40_kv_seq_match_prefix(b, t, 9) == 0 && m40_kv_blocks_n_free(kv) == 8, "no hit");
    CHECK_KV(kv);
    m40_kv_blocks_free(kv);
}

/* m40_kv_blocks_drop_idle (the engine's warm-up forgets its blocks with it): idle cached
 * blocks go back to the free list and are no longer found; what a sequence holds stays
 * cached and shared. */
static void test_drop_idle(void)
{
    m40_kv_blocks *kv = mk(16, 4, 1, 64);
    int32_t t[32], u[32];
    fill(t, 32, 100);
    fill(u, 32, 500);
    m40_kv_seq *a = m40_kv_seq_new(kv), *b = m40_kv_seq_new(kv);
    CHECK(m40_kv_seq_append(a, 13) == 0 && m40_kv_seq_commit(a, t, 13) == 0, "a: 3 full blocks");
    CHECK(m40_kv_seq_append(b, 9) == 0 && m40_kv_seq_commit(b, u, 9) == 0, "b: 2 full blocks");
    m40_kv_seq_free(a);
    CHECK(m40_kv_blocks_n_idle(kv) == 3 && m40_kv_blocks_n_cached(kv) == 5, "a's blocks idle");
    CHECK(m40_kv_blocks_drop_idle(kv) == 3, "three dropped");
    CHECK(m40_kv_blocks_n_idle(kv) == 0 && m40_kv_blocks_n_cached(kv) == 2 && m40_kv_blocks_n_free(kv) == 13,
          "free %d cached %d", (int)m40_kv_blocks_n_free(kv), (int)m40_kv_blocks_n_cached(kv));
    CHECK_KV(kv);
    m40_kv_seq *c = m40_kv_seq_new(kv), *d = m40_kv_seq_new(kv);
    CHECK(m40_kv_seq_match_prefix(c, t, 13) == 0, "a's prefix is forgotten");
    CHECK(m40_kv_seq_match_prefix(d, u, 12) == 8 && m40_kv_seq_blocks(d)[0] == m40_kv_seq_blocks(b)[0],
          "b's blocks are still shared");
    CHECK(m40_kv_blocks_drop_idle(kv) == 0, "nothing idle");
    CHECK_KV(kv);
    m40_kv_blocks_free(kv);
}

static void test_lru_and_dedup(void)
{
    m40_kv_blocks *kv = mk(8, 4, 1, 64);
    int32_t ta[9], tb[9];
    fill(ta, 9, 1000);
    fill(tb, 9, 2000);
    m40_kv_seq *s = m40_kv_seq_new(kv);
    m40_kv_seq_append(s, 9);
    m40_kv_seq_commit(s, ta, 9);
    m40_kv_seq_free(s); /* LRU: A1 A0 */
    s = m40_kv_seq_new(kv);
    m40_kv_seq_append(s, 9);
    m40_kv_seq_commit(s, tb, 9);
    m40_kv_seq_free(s); /* LRU: A1 A0 B1 B0 */
    CHECK(m40_kv_blocks_n_idle(kv) == 4 && m40_kv_blocks_n_free(kv) == 4, "4 idle 4 free");
    CHECK_KV(kv);

    m40_kv_seq *c = m40_kv_seq_new(kv);
    CHECK(m40_kv_seq_append(c, 16) == 0, "free list first");
    m40_kv_cache_stats st;
    m40_kv_blocks_stats(kv, &st);
    CHECK(st.evictions == 0 && m40_kv_blocks_n_idle(kv) == 4, "no eviction while blocks are free");
    CHECK(m40_kv_seq_append(c, 4) == 0, "evicts one");
    m40_kv_blocks_stats(kv, &st);
    CHECK(st.evictions == 1, "one eviction");
    m40_kv_seq *d = m40_kv_seq_new(kv);
    CHECK(m40_kv_seq_match_prefix(d, ta, 9) == 4, "A1 (deepest, oldest) evicted first, A0 kept");
    m40_kv_seq_free(d); /* A0 released again: LRU: B1 B0 A0 */
    CHECK(m40_kv_seq_append(c, 4) == 0, "evicts B1");
    d = m40_kv_seq_new(kv);
    CHECK(m40_kv_seq_match_prefix(d, tb, 9) == 4, "B1 evicted, B0 kept");
    CHECK(m40_kv_seq_append(c, 4) == 0, "evicts A0 (B0 is held by d)");
    m40_kv_seq *e = m40_kv_seq_new(kv);
    CHECK(m40_kv_seq_match_prefix(e, ta, 9) == 0, "A0 gone");
    CHECK(m40_kv_seq_append(c, 4) == -1, "B0 in use is never evicted");
    CHECK(m40_kv_seq_len(c) == 28 && m40_kv_blocks_n_used(kv) == 8, "unchanged");
    CHECK_KV(kv);
    m40_kv_blocks_free(kv);

    /* two identical prompts computed side by side: one copy survives commit */
    kv = mk(8, 4, 1, 64);
    m40_kv_seq *x = m40_kv_seq_new(kv), *y = m40_kv_seq_new(kv);
    m40_kv_seq_append(x, 9);
    m40_kv_seq_append(y, 9);
    CHECK(m40_kv_blocks_n_used(kv) == 6, "6 private blocks");
    m40_kv_seq_commit(x, ta, 9);
    m40_kv_seq_commit(y, ta, 9);
    CHECK(m40_kv_blocks_n_used(kv) == 4 && m40_kv_blocks_n_cached(kv) == 2, "deduplicated");
    CHECK(m40_kv_seq_blocks(x)[0] == m40_kv_seq_blocks(y)[0] &&
              m40_kv_seq_blocks(x)[1] == m40_kv_seq_blocks(y)[1] &&
              m40_kv_seq_blocks(x)[2] != m40_kv_seq_blocks(y)[2], "full blocks shared, last private");
    m40_kv_blocks_stats(kv, &st);
    CHECK(st.dedups == 2, "2 dedups");
    CHECK_KV(kv);

    /* truncation into a shared block rounds down; into a private cached one unregisters */
    CHECK(m40_kv_seq_truncate(x, 6) == 4, "cut in shared block 1 -> 4");
    CHECK(m40_kv_seq_n_blocks(x) == 1 && m40_kv_seq_n_computed(x) == 4, "x keeps block 0");
    CHECK_KV(kv);
    CHECK(m40_kv_seq_truncate(y, 6) == 6, "block 1 now only y's: kept");
    CHECK(m40_kv_blocks_n_cached(kv) == 1 && m40_kv_seq_n_computed(y) == 6, "unregistered");
    CHECK_KV(kv);
    CHECK(m40_kv_seq_truncate(y, 2) == 0, "block 0 shared with x: round down to 0");
    CHECK(m40_kv_seq_truncate(y, 5) == 0, "truncate never grows");
    CHECK_KV(kv);
    m40_kv_blocks_free(kv);
}

/* ---- random workload against a reference model ------------------------------------- */

#define MAXTOK 256
#define MAXSEQ 12
#define NDOC 5

typedef struct {
    int32_t *prefix; /* depth * bs tokens */
    int32_t depth, rc;
    int64_t tick;
    int alive;
} ref_entry;

typedef struct {
    m40_kv_seq *s;
    int32_t tok[MAXTOK];
    int32_t ntok, len, nc, nreg, nblocks;
    int32_t ents[MAXTOK];
} tseq;

typedef struct {
    m40_kv_blocks *kv;
    int32_t bs, n_blocks, cache, vocab;
    ref_entry *e;
    int32_t n_e;
    int32_t free_blocks;
    int64_t clock, evictions, hits, dedups;
    tseq seq[MAXSEQ];
    int32_t n_seq;
    int32_t *shadow; /* what the test wrote into each KV slot */
    int32_t doc[NDOC][MAXTOK];
    uint64_t rng;
} world;

static uint32_t rnd(world *w, uint32_t n)
{
    w->rng = w->rng * 6364136223846793005ull + 1442695040888963407ull;
    return (uint32_t)((w->rng >> 33) % n);
}

static int32_t ref_find(world *w, const int32_t *tok, int32_t depth)
{
    for (int32_t i = 0; i < w->n_e; i++)
        if (w->e[i].alive && w->e[i].depth == depth &&
            memcmp(w->e[i].prefix, tok, (size_t)depth * w->bs * sizeof *tok) == 0)
            return i;
    return -1;
}

static int ref_has_child(world *w, int32_t x)
{
    for (int32_t i = 0; i < w->n_e; i++)
        if (w->e[i].alive && w->e[i].depth == w->e[x].depth + 1 &&
            memcmp(w->e[i].prefix, w->e[x].prefix, (size_t)w->e[x].depth * w->bs * 4) == 0)
            return 1;
    return 0;
}

static int32_t ref_idle(world *w)
{
    int32_t n = 0;
    for (int32_t i = 0; i < w->n_e; i++)
        n += w->e[i].alive && w->e[i].rc == 0;
    return n;
}

static void ref_take_block(world *w)
{
    if (w->free_blocks > 0) {
        w->free_blocks--;
        return;
    }
    int32_t best = -1;
    for (int32_t i = 0; i < w->n_e; i++)
        if (w->e[i].alive && w->e[i].rc == 0 && (best < 0 || w->e[i].tick < w->e[best].tick))
            best = i;
    CHECK(best >= 0 && !ref_has_child(w, best), "reference: evicting an LRU block with children");
    if (best >= 0) {
        w->e[best].alive = 0;
        free(w->e[best].prefix);
        w->e[best].prefix = NULL;
    }
    w->evictions++;
}

static void ref_release_tail(world *w, tseq *t, int32_t keep)
{
    while (t->nblocks > keep) {
        int32_t k = --t->nblocks;
        if (k < t->nreg) {
            ref_entry *e = &w->e[t->ents[k]];
            if (--e->rc == 0)
                e->tick = ++w->clock;
        } else {
            w->free_blocks++;
        }
    }
}

static int32_t ref_new_entry(world *w, const int32_t *tok, int32_t depth)
{
    int32_t i = 0;
    while (i < w->n_e && w->e[i].alive)
        i++;
    if (i == w->n_e)
        w->n_e++;
    ref_entry *e = &w->e[i];
    e->prefix = malloc((size_t)depth * w->bs * sizeof *tok);
    memcpy(e->prefix, tok, (size_t)depth * w->bs * sizeof *tok);
    e->depth = depth;
    e->rc = 1;
    e->tick = 0;
    e->alive = 1;
    return i;
}

/* Everything the reference predicts, plus facts checked without the reference. */
static void verify(world *w, const char *op)
{
    m40_kv_blocks *kv = w->kv;
    CHECK(m40_kv_blocks_check(kv, err, sizeof err) == 0, "after %s: %s", op, err);
    int32_t alive = 0;
    for (int32_t i = 0; i < w->n_e; i++)
        alive += w->e[i].alive;
    m40_kv_cache_stats st;
    m40_kv_blocks_stats(kv, &st);
    int ok = m40_kv_blocks_n_free(kv) == w->free_blocks && m40_kv_blocks_n_idle(kv) == ref_idle(w) &&
             m40_kv_blocks_n_cached(kv) == alive && st.evictions == w->evictions &&
             st.hit_tokens == w->hits && st.dedups == w->dedups &&
             m40_kv_blocks_n_free(kv) + m40_kv_blocks_n_idle(kv) + m40_kv_blocks_n_used(kv) ==
                 w->n_blocks;
    CHECK(ok, "after %s: free %d/%d idle %d/%d cached %d/%d evictions %lld/%lld hits %lld/%lld", op,
          m40_kv_blocks_n_free(kv), w->free_blocks, m40_kv_blocks_n_idle(kv), ref_idle(w),
          m40_kv_blocks_n_cached(kv), alive, (long long)st.evictions, (long long)w->evictions,
          (long long)st.hit_tokens, (long long)w->hits);

    /* holders per block; sharing only for committed full blocks of the same prefix */
    int32_t *owner_seq = malloc((size_t)w->n_blocks * sizeof *owner_seq);
    int32_t *owner_ent = malloc((size_t)w->n_blocks * sizeof *owner_ent);
    int32_t used = 0, bad = 0;
    for (int32_t b = 0; b < w->n_blocks; b++)
        owner_seq[b] = -1;
    const m40_kv_seq *batch[MAXSEQ];
    int32_t total = 0;
    for (int32_t i = 0; i < w->n_seq; i++) {
        tseq *t = &w->seq[i];
        batch[i] = t->s;
        total += t->nblocks;
        if (m40_kv_seq_len(t->s) != t->len || m40_kv_seq_n_computed(t->s) != t->nc ||
            m40_kv_seq_n_blocks(t->s) != t->nblocks)
            bad++;
        const int32_t *bl = m40_kv_seq_blocks(t->s);
        for (int32_t k = 0; k < t->nblocks && k < m40_kv_seq_n_blocks(t->s); k++) {
            int32_t b = bl[k], ent = k < t->nreg ? t->ents[k] : -1;
            if (owner_seq[b] < 0) {
                owner_seq[b] = i;
                owner_ent[b] = ent;
                used++;
            } else if (ent < 0 || owner_ent[b] != ent) {
                bad++; /* shared, but not the same cached full block */
            }
        }
        for (int32_t p = 0; p < t->nc; p++)
            if (w->shadow[m40_kv_seq_slot(t->s, p)] != t->tok[p])
                bad++; /* this position's KV is not what the sequence computed */
    }
    /* two sequences with the same cached prefix must hold the same block */
    for (int32_t b = 0; b < w->n_blocks; b++)
        for (int32_t c = b + 1; c < w->n_blocks; c++)
            if (owner_seq[b] >= 0 && owner_seq[c] >= 0 && owner_ent[b] >= 0 &&
                owner_ent[b] == owner_ent[c])
                bad++;
    CHECK(bad == 0 && used == m40_kv_blocks_n_used(kv), "after %s: %d sequence mismatches, used %d/%d",
          op, bad, used, m40_kv_blocks_n_used(kv));

    int32_t indptr[MAXSEQ + 1], lpl[MAXSEQ];
    int32_t *idx = malloc((size_t)(total + 1) * sizeof *idx);
    int32_t got = m40_kv_blocks_csr(batch, w->n_seq, indptr, idx, total, lpl);
    int csr_ok = got == total && indptr[0] == 0;
    for (int32_t i = 0; i < w->n_seq && csr_ok; i++) {
        tseq *t = &w->seq[i];
        csr_ok = indptr[i + 1] - indptr[i] == t->nblocks &&
                 memcmp(idx + indptr[i], m40_kv_seq_blocks(t->s), (size_t)t->nblocks * 4) == 0 &&
                 lpl[i] == (t->len ? t->len - (t->nblocks - 1) * w->bs : 0);
    }
    CHECK(csr_ok, "after %s: CSR does not match the block lists", op);
    free(idx);
    free(owner_seq);
    free(owner_ent);
}

static void gen_tokens(world *w, tseq *t, int32_t upto)
{
    while (t->ntok < upto)
        t->tok[t->ntok++] = (int32_t)rnd(w, (uint32_t)w->vocab);
}

/* Prompt for a sequence: a random prefix of a shared document, then random tokens. */
static void new_prompt(world *w, tseq *t)
{
    int32_t n = 1 + (int32_t)rnd(w, 120);
    int32_t shared = (int32_t)rnd(w, (uint32_t)n + 1);
    const int32_t *d = w->doc[rnd(w, NDOC)];
    memcpy(t->tok, d, (size_t)shared * sizeof *d);
    t->ntok = shared;
    gen_tokens(w, t, n);
}

static void do_match(world *w, tseq *t)
{
    int32_t n = t->ntok;
    int32_t k = 0;
    if (w->cache)
        for (; k < (n - 1) / w->bs; k++) {
            int32_t e = ref_find(w, t->tok, k + 1);
            if (e < 0)
                break;
            w->e[e].rc++;
            t->ents[k] = e;
        }
    int32_t got = m40_kv_seq_match_prefix(t->s, t->tok, n);
    CHECK(got == k * w->bs, "match: %d tokens cached, reference says %d", got, k * w->bs);
    t->len = t->nc = k * w->bs;
    t->nreg = t->nblocks = k;
    w->hits += k * w->bs;
}

static void do_append(world *w, tseq *t, int32_t n)
{
    if (t->len + n > MAXTOK)
        n = MAXTOK - t->len;
    int32_t need = (t->len + n + w->bs - 1) / w->bs - t->nblocks;
    int expect_ok = need <= w->free_blocks + ref_idle(w);
    int32_t free0 = m40_kv_blocks_n_free(w->kv), idle0 = m40_kv_blocks_n_idle(w->kv);
    int r = m40_kv_seq_append(t->s, n);
    CHECK(r == (expect_ok ? 0 : -1), "append %d (need %d): got %d", n, need, r);
    if (!expect_ok) {
        CHECK(m40_kv_blocks_n_free(w->kv) == free0 && m40_kv_blocks_n_idle(w->kv) == idle0 &&
                  m40_kv_seq_len(t->s) == t->len, "failed append changed state");
        return;
    }
    for (int32_t i = 0; i < need; i++)
        ref_take_block(w);
    t->nblocks += need;
    t->len += n;
    gen_tokens(w, t, t->len);
}

static void do_commit(world *w, tseq *t, int32_t nc)
{
    for (int32_t p = t->nc; p < nc; p++) /* "compute" the KV into our own slots */
        w->shadow[m40_kv_seq_slot(t->s, p)] = t->tok[p];
    CHECK(m40_kv_seq_commit(t->s, t->tok, nc) == 0, "commit");
    t->nc = nc;
    if (!w->cache)
        return;
    for (int32_t k = t->nreg; k < nc / w->bs; k++) {
        int32_t e = ref_find(w, t->tok, k + 1);
        if (e >= 0) {
            w->e[e].rc++;
            w->free_blocks++;
            w->dedups++;
        } else {
            e = ref_new_entry(w, t->tok, k + 1);
        }
        t->ents[k] = e;
    }
    if (nc / w->bs > t->nreg)
        t->nreg = nc / w->bs;
}

static void do_truncate(world *w, tseq *t, int32_t n)
{
    int32_t expect = n;
    if (n < t->len) {
        int32_t keep = (n + w->bs - 1) / w->bs;
        if (n % w->bs && keep - 1 < t->nreg) {
            int32_t e = t->ents[keep - 1];
            if (w->e[e].rc == 1 && !ref_has_child(w, e)) {
                w->e[e].alive = 0; /* unregistered, stays as the sequence's private block */
                free(w->e[e].prefix);
                w->e[e].prefix = NULL;
            } else {
                keep--;
                expect = keep * w->bs;
            }
        }
        ref_release_tail(w, t, keep);
    } else {
        expect = t->len;
    }
    int32_t got = m40_kv_seq_truncate(t->s, n);
    CHECK(got == expect, "truncate %d: got %d, reference %d", n, got, expect);
    t->len = expect;
    if (t->nc > expect)
        t->nc = expect;
    if (t->nreg > expect / w->bs)
        t->nreg = expect / w->bs;
    if (t->ntok > expect)
        t->ntok = expect; /* rolled back: later tokens are generated afresh */
}

static void remove_seq(world *w, int32_t i)
{
    tseq *t = &w->seq[i];
    ref_release_tail(w, t, 0);
    m40_kv_seq_free(t->s);
    w->seq[i] = w->seq[--w->n_seq];
}

static void run_world(int32_t n_blocks, int32_t bs, int cache, int hash_bits, int32_t vocab,
                      uint64_t seed, int n_ops)
{
    static world w;
    memset(&w, 0, sizeof w);
    w.kv = mk(n_blocks, bs, cache, hash_bits);
    w.bs = bs;
    w.n_blocks = w.free_blocks = n_blocks;
    w.cache = cache;
    w.vocab = vocab;
    w.rng = seed;
    w.e = calloc((size_t)n_blocks + 1, sizeof *w.e);
    w.shadow = malloc((size_t)n_blocks * bs * sizeof *w.shadow);
    for (int32_t i = 0; i < n_blocks * bs; i++)
        w.shadow[i] = -1;
    for (int d = 0; d < NDOC; d++)
        for (int i = 0; i < MAXTOK; i++)
            w.doc[d][i] = (int32_t)rnd(&w, (uint32_t)vocab);
    int fails0 = check_failed;
    int64_t appends_failed = 0;
    for (int op = 0; op < n_ops && check_failed == fails0; op++) {
        uint32_t r = rnd(&w, 100);
        const char *name;
        if (w.n_seq == 0 || (r < 15 && w.n_seq < MAXSEQ)) {
            name = "new";
            tseq *t = &w.seq[w.n_seq++];
            memset(t, 0, sizeof *t);
            t->s = m40_kv_seq_new(w.kv);
            new_prompt(&w, t);
            do_match(&w, t);
            verify(&w, "match");
            int32_t want = t->ntok - t->len;
            do_append(&w, t, want);
        } else {
            int32_t i = (int32_t)rnd(&w, (uint32_t)w.n_seq);
            tseq *t = &w.seq[i];
            if (t->len == 0 && t->ntok > 0 && r < 70) {
                name = "resume"; /* preempted earlier: re-prefill, reusing the cache */
                do_match(&w, t);
                verify(&w, "resume match");
                do_append(&w, t, t->ntok - t->len);
            } else if (r < 45) {
                name = "append";
                int32_t free0 = m40_kv_blocks_n_free(w.kv) + m40_kv_blocks_n_idle(w.kv);
                do_append(&w, t, rnd(&w, 3) ? 1 : 1 + (int32_t)rnd(&w, 40));
                if (free0 == m40_kv_blocks_n_free(w.kv) + m40_kv_blocks_n_idle(w.kv))
                    appends_failed++;
            } else if (r < 70) {
                name = "commit";
                do_commit(&w, t, t->nc + (int32_t)rnd(&w, (uint32_t)(t->len - t->nc + 1)));
            } else if (r < 78) {
                name = "finish";
                remove_seq(&w, i);
            } else if (r < 84) {
                name = "cancel";
                remove_seq(&w, i);
            } else if (r < 92) {
                name = "preempt";
                ref_release_tail(&w, t, 0);
                m40_kv_seq_reset(t->s);
                t->len = t->nc = t->nreg = 0;
            } else {
                name = "truncate";
                do_truncate(&w, t, (int32_t)rnd(&w, (uint32_t)t->len + 1));
            }
        }
        verify(&w, name);
        if (check_failed != fails0)
            fprintf(stderr, "  world(n_blocks %d bs %d cache %d hash_bits %d) failed at op %d (%s)\n",
                    n_blocks, bs, cache, hash_bits, op, name);
    }
    m40_kv_cache_stats st;
    m40_kv_blocks_stats(w.kv, &st);
    fprintf(stderr, "world n_blocks %d bs %d cache %d hash_bits %d: %d ops, %lld queries, "
                    "%lld/%lld tokens hit, %lld computed, %lld evictions, %lld dedups, %lld appends refused\n",
            n_blocks, bs, cache, hash_bits, n_ops, (long long)st.queries,
            (long long)st.hit_tokens, (long long)st.query_tokens, (long long)st.computed_tokens,
            (long long)st.evictions, (long long)st.dedups, (long long)appends_failed);
    CHECK(!cache || (st.hit_tokens > 0 && st.evictions > 0), "workload exercised hits and eviction");
    CHECK(appends_failed > 0, "workload ran out of blocks");
    while (w.n_seq)
        remove_seq(&w, 0);
    CHECK(m40_kv_blocks_n_used(w.kv) == 0 &&
              m40_kv_blocks_n_free(w.kv) + m40_kv_blocks_n_idle(w.kv) == n_blocks,
          "all blocks back after the last sequence");
    CHECK_KV(w.kv);
    m40_kv_blocks_free(w.kv);
    for (int32_t i = 0; i < w.n_e; i++)
        free(w.e[i].prefix);
    free(w.e);
    free(w.shadow);
}

int main(void)
{
    test_basic();
    test_prefix();
    test_drop_idle();
    test_lru_and_dedup();
    run_world(64, 16, 1, 64, 50, 1, 4000);
    run_world(48, 4, 1, 64, 4, 2, 4000);   /* tiny vocab: same block tokens under many prefixes */
    run_world(40, 4, 1, 3, 4, 3, 4000);    /* 3-bit hashes: collisions everywhere */
    run_world(24, 1, 1, 64, 3, 4, 3000);   /* one token per block */
    run_world(32, 16, 0, 64, 50, 5, 2000); /* prefix cache off */
    return check_done();
}
