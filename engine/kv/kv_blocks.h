/* Paged KV block manager: pure bookkeeping over a physical pool of n_blocks KV blocks
 * that the caller owns (GPU or CPU memory). Block ids are indices into that pool; a
 * token at position `pos` of a sequence lives in slot (block_id * block_size +
 * pos % block_size). Nothing here touches device memory.
 *
 * Blocks are reference counted. A block is in exactly one of three places:
 *   free list   refcount 0, holds nothing useful;
 *   in use      refcount > 0, held by that many live sequences;
 *   idle cache  refcount 0 but registered in the prefix cache, kept in an LRU list
 *               and evicted (least recently released first) only when the free list
 *               is empty.
 * m40_kv_blocks_check() verifies all of it (tests call it after every operation).
 *
 * Automatic prefix caching: a FULL block whose tokens are all computed is registered
 * under a chain hash of its whole token prefix: h = H(parent block's h, tokens of this
 * block). A hit is confirmed by comparing the parent block id and the block's tokens,
 * so a 64-bit hash collision can never attach the wrong KV (by induction from the
 * first block, matching parent id + tokens means matching the whole prefix). Only full
 * blocks are shared and nobody writes into a shared block: a sequence's last, partial
 * block is always private, so no copy-on-write is needed.
 *
 * Invariants worth knowing (checked):
 *  - a sequence's committed full blocks blocks[0..n_committed_blocks) are all cached,
 *    each one the chain parent of the next; later blocks are private (refcount 1);
 *  - a cached block's parent is cached; sequences release blocks tail first, so in
 *    the LRU list a child is always older than its parent and eviction never orphans
 *    a cached child;
 *  - at most one cached block per token prefix: when a sequence commits a block whose
 *    prefix is already cached (two identical prompts computed in the same step), its
 *    private copy is returned to the free list and the sequence switches to the cached
 *    block (identical contents), so block ids of committed blocks may change at commit.
 *
 * Not thread safe: the engine thread owns the manager. All operations are O(1) or
 * O(blocks touched) (hash lookups are O(1) expected), except m40_kv_blocks_check. */
#ifndef M40_KV_BLOCKS_H
#define M40_KV_BLOCKS_H

#include <stddef.h>
#include <stdint.h>

#define M40_KV_BLOCK_SIZE_DEFAULT 16

typedef struct m40_kv_blocks m40_kv_blocks;
typedef struct m40_kv_seq m40_kv_seq;

typedef struct {
    int32_t n_blocks;      /* physical pool size (> 0) */
    int32_t block_size;    /* tokens per block; <= 0 means M40_KV_BLOCK_SIZE_DEFAULT */
    int prefix_cache;      /* 0: no prefix caching (released blocks go straight back) */
    int hash_bits;         /* 0 or 64: full 64-bit hashes; 1..63 keep only that many
                            * bits (a test seam that makes collisions common) */
} m40_kv_blocks_params;

typedef struct {
    int64_t queries;         /* m40_kv_seq_match_prefix calls */
    int64_t query_tokens;    /* prompt tokens presented to them */
    int64_t hit_tokens;      /* prompt tokens found already cached */
    int64_t computed_tokens; /* tokens committed as computed (not taken from the cache) */
    int64_t evictions;       /* idle cached blocks reclaimed for new allocations */
    int64_t dedups;          /* committed blocks merged into an identical cached block */
} m40_kv_cache_stats;

/* Defaults: block_size 16, prefix_cache on, 64-bit hashes. */
void m40_kv_blocks_params_default(m40_kv_blocks_params *p, int32_t n_blocks);
/* NULL on bad parameters or out of memory. */
m40_kv_blocks *m40_kv_blocks_new(const m40_kv_blocks_params *p);
/* Frees the manager and every sequence still attached to it. */
void m40_kv_blocks_free(m40_kv_blocks *kv);

int32_t m40_kv_blocks_block_size(const m40_kv_blocks *kv);
int32_t m40_kv_blocks_n_total(const m40_kv_blocks *kv);
int32_t m40_kv_blocks_n_free(const m40_kv_blocks *kv);      /* on the free list */
int32_t m40_kv_blocks_n_idle(const m40_kv_blocks *kv);      /* cached, refcount 0 (evictable) */
int32_t m40_kv_blocks_n_used(const m40_kv_blocks *kv);      /* refcount > 0 */
int32_t m40_kv_blocks_n_cached(const m40_kv_blocks *kv);    /* registered, used or idle */
/* Blocks an allocation may take: free + idle. */
int32_t m40_kv_blocks_n_available(const m40_kv_blocks *kv);
void m40_kv_blocks_stats(const m40_kv_blocks *kv, m40_kv_cache_stats *out);
/* Forget every idle cached block (unregistered, back on the free list); blocks that a
 * sequence holds stay as they are. Returns how many were dropped. */
int32_t m40_kv_blocks_drop_idle(m40_kv_blocks *kv);

/* Full consistency check (O(n_blocks + held blocks)). 0 when consistent, else -1 with
 * the first violation described in err. */
int m40_kv_blocks_check(const m40_kv_blocks *kv, char *err, size_t errsz);

/* A sequence starts empty (length 0). NULL when out of memory. */
m40_kv_seq *m40_kv_seq_new(m40_kv_blocks *kv);
/* Releases every block (finish, cancel) and frees the sequence. NULL is a no-op. */
void m40_kv_seq_free(m40_kv_seq *seq);

/* For a new (empty) sequence about to prefill tokens[0..n): attach the longest chain
 * of cached full blocks that prefixes it, and mark those tokens reserved and computed.
 * Never covers the whole prompt (at most (n-1)/block_size blocks) so that at least the
 * last token is computed and produces logits. Returns the number of cached tokens
 * (a multiple of block_size), 0 without prefix caching, -1 if the sequence is not
 * empty. Needs no free block: it cannot fail for lack of memory. */
int32_t m40_kv_seq_match_prefix(m40_kv_seq *seq, const int32_t *tokens, int32_t n);

/* New blocks that reserving n more token slots would take (0 if they fit). */
int32_t m40_kv_seq_blocks_needed(const m40_kv_seq *seq, int32_t n);
/* Reserve slots for n more tokens (positions len..len+n-1), allocating blocks from the
 * free list, then by evicting idle cached blocks. 0 on success; -1 when not enough
 * blocks (or memory) — nothing changes then, so the scheduler can preempt and retry. */
int m40_kv_seq_append(m40_kv_seq *seq, int32_t n);

/* Declare tokens[0..n_computed) computed (their KV written). tokens is the sequence's
 * token list (at least n_computed entries; may be NULL without prefix caching).
 * Every block that is now full and computed is registered in the prefix cache, or
 * merged into an identical cached block (its block id changes). n_computed must lie
 * between the current computed count and the length. 0, or -1 on bad arguments. */
int m40_kv_seq_commit(m40_kv_seq *seq, const int32_t *tokens, int32_t n_computed);

/* Shrink to at most n_tokens (rollback of speculative tokens, stop sequences).
 * Returns the new length: n_tokens, or less when the cut falls inside a full block
 * that other sequences share or that has cached successors — such a block is never
 * written again, so it is released and the length rounded down to its start; the
 * caller recomputes from there. A cut inside a cached block held only by this
 * sequence unregisters it and keeps it. n_tokens >= length changes nothing. */
int32_t m40_kv_seq_truncate(m40_kv_seq *seq, int32_t n_tokens);
/* Release every block, length 0 (preemption by recompute: the sequence re-prefills
 * later, typically after m40_kv_seq_match_prefix finds its own blocks cached). */
void m40_kv_seq_reset(m40_kv_seq *seq);

int32_t m40_kv_seq_len(const m40_kv_seq *seq);        /* reserved token slots */
int32_t m40_kv_seq_n_computed(const m40_kv_seq *seq); /* committed tokens */
int32_t m40_kv_seq_n_blocks(const m40_kv_seq *seq);
/* The sequence's block ids, in order (valid until the next call that changes it). */
const int32_t *m40_kv_seq_blocks(const m40_kv_seq *seq);
/* Physical slot of position pos (block * block_size + offset); -1 out of range. */
int64_t m40_kv_seq_slot(const m40_kv_seq *seq, int32_t pos);

/* Block tables of a batch in CSR form (FlashInfer paged layout): sequence i owns
 * indices[indptr[i] .. indptr[i+1]), and last_page_len[i] tokens of its last block are
 * valid (1..block_size; 0 for an empty sequence). indptr has n_seq+1 entries. Returns
 * the number of indices written, or -1 when cap_indices is too small (nothing written
 * into indices then). */
int32_t m40_kv_blocks_csr(const m40_kv_seq *const *seqs, int32_t n_seq, int32_t *indptr,
                          int32_t *indices, int32_t cap_indices, int32_t *last_page_len);

#endif
