/* The paged KV pool of a model whose cache is one pool of blocks shared by its slots
 * (the GPU back end): the one owner of which block holds what. It keeps the block
 * manager (kv_blocks.h), one block sequence per slot, the token id of every position
 * (what the prefix cache keys full blocks by) and the reservation of the coming step.
 * The memory behind the blocks (K and V on the device) belongs to whoever sized the
 * pool (gpu/gpu_kv.c); it reads the step's groups and block tables from here.
 *
 * A step: m40_paged_kv_reserve takes the blocks of the batch's new positions (or says
 * M40_KV_NO_BLOCKS and takes none: the scheduler then preempts a sequence and asks
 * again), the forward pass writes their K and V, then m40_paged_kv_commit registers
 * every block that became full in the prefix cache. The scheduler asks before it calls
 * the forward pass (m40_kv_reserve, model.h); a forward call that nobody reserved for
 * reserves by itself, so direct callers (tests, m40 eval, m40 bench) need not ask.
 *
 * Not thread safe: the engine thread owns it. No CUDA here. */
#ifndef M40_PAGED_KV_H
#define M40_PAGED_KV_H

#include <stddef.h>
#include <stdint.h>

#include "kv_blocks.h"

/* The pool lacks the blocks a batch needs (the same value as model.h's
 * M40_FORWARD_NO_BLOCKS, which forward calls return for it). */
#define M40_KV_NO_BLOCKS (-2)

typedef struct m40_paged_kv m40_paged_kv;

/* A reserved step: the batch's rows grouped by slot, the decoding slots (one new
 * position) first, then the others, each in order of first appearance (the order the
 * forward pass lays the step's rows out in: the decode attention takes the first n_dec
 * groups). Group j holds positions first[j] .. first[j] + n[j] - 1 of slot[j], whose
 * blocks are seq[j]'s. Valid until the next reservation. */
typedef struct {
    int32_t n_grp, n_dec;
    const int32_t *slot, *first, *n;
    m40_kv_seq *const *seq;
} m40_kv_step;

/* n_blocks blocks of block_size positions (the attention kernels' page) for n_slots
 * slots; prefix_cache 0 turns the prefix cache off. NULL when out of memory. */
m40_paged_kv *m40_paged_kv_new(int32_t n_slots, int32_t n_blocks, int32_t block_size, int prefix_cache);
void m40_paged_kv_free(m40_paged_kv *p);

int32_t m40_paged_kv_blocks_total(const m40_paged_kv *p);
/* Blocks a reservation may take: free, or cached and held by no sequence (evictable). */
int32_t m40_paged_kv_blocks_free(const m40_paged_kv *p);
/* The slot's sequence is over (or preempted): its blocks go back, cached ones stay cached. */
void m40_paged_kv_slot_clear(m40_paged_kv *p, int32_t slot);

/* The prefix cache (model.h, m40_kv_slot_match_prefix, says what it does). */
int m40_paged_kv_prefix_cache(const m40_paged_kv *p);
int32_t m40_paged_kv_match_prefix(m40_paged_kv *p, int32_t slot, const int32_t *tokens, int32_t n);
void m40_paged_kv_prefix_stats(const m40_paged_kv *p, int64_t *queries, int64_t *query_tokens, int64_t *hit_tokens);
void m40_paged_kv_prefix_forget(m40_paged_kv *p);

/* Reserves the blocks of a batch of n rows (row i: token tokens[i] at position pos[i]
 * of slot slot[i]; a slot's rows at consecutive positions that continue its sequence,
 * or restart it lower: a new sequence in a reused slot). 0: reserved, and the step's
 * groups are m40_paged_kv_step's; M40_KV_NO_BLOCKS with err: the pool lacks blocks and
 * none were taken; -1 with err: a bad batch (or out of memory). */
int m40_paged_kv_reserve(m40_paged_kv *p, int32_t n, const int32_t *tokens, const int32_t *pos, const int32_t *slot,
                         char *err, size_t errlen);
/* Whether the last reservation was made for this very batch (the same arrays and n) and
 * not yet claimed; claims it either way, so that a reservation serves one forward call. */
int m40_paged_kv_claim(m40_paged_kv *p, int32_t n, const int32_t *tokens, const int32_t *pos, const int32_t *slot);
const m40_kv_step *m40_paged_kv_step(const m40_paged_kv *p);
/* After the step's K and V are written: every position reserved is computed; with the
 * prefix cache each block now full is registered under its token prefix (or merged into
 * an identical cached block: block ids may change, the next step re-exports the tables). */
void m40_paged_kv_commit(m40_paged_kv *p);

#endif
