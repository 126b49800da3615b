/* The paged KV pool's reservations (kv/paged_kv.c), on the CPU: what the GPU forward
 * pass and the scheduler rely on without a GPU to show it. A step's rows are grouped by
 * slot with the decoding slots first; a step that does not fit takes no block and
 * says M40_KV_NO_BLOCKS; a reservation serves the one forward call made with the same
 * batch; a commit registers full blocks in the prefix cache so that a later sequence
 * with the same prompt starts on them; bad batches are refused with a reason. */
#include "check.h"
#include "kv/paged_kv.h"

#include <stdint.h>

static char err[256];

static void test_groups(void)
{
    m40_paged_kv *p = m40_paged_kv_new(4, 16, 16, 1);
    CHECK(p && m40_paged_kv_blocks_total(p) == 16 && m40_paged_kv_blocks_free(p) == 16, "new");
    /* slot 2 prefills 3 tokens, slot 0 one (a group of one row: decoding, for the
     * kernels), slot 3 two: the one-row groups come first */
    const int32_t tok[] = {5, 6, 7, 8, 9, 10};
    const int32_t pos[] = {0, 1, 2, 0, 0, 1};
    const int32_t slot[] = {2, 2, 2, 0, 3, 3};
    CHECK(m40_paged_kv_reserve(p, 6, tok, pos, slot, err, sizeof err) == 0, "reserve: %s", err);
    const m40_kv_step *st = m40_paged_kv_step(p);
    CHECK(st->n_grp == 3 && st->n_dec == 1, "groups %d, decoding %d", st->n_grp, st->n_dec);
    CHECK(st->slot[0] == 0 && st->n[0] == 1 && st->first[0] == 0, "the decoding slot first");
    CHECK(st->slot[1] == 2 && st->n[1] == 3 && st->slot[2] == 3 && st->n[2] == 2, "then in order of appearance");
    CHECK(m40_kv_seq_len(st->seq[1]) == 3 && m40_kv_seq_n_blocks(st->seq[1]) == 1, "slot 2's positions reserved");
    CHECK(m40_paged_kv_blocks_free(p) == 13, "three blocks taken: %d free", m40_paged_kv_blocks_free(p));
    /* the same arrays claim it once; other arrays or a second claim do not */
    const int32_t tok2[] = {5, 6, 7, 8, 9, 10};
    CHECK(!m40_paged_kv_claim(p, 6, tok2, pos, slot), "another batch does not claim it");
    CHECK(m40_paged_kv_reserve(p, 6, tok, pos, slot, err, sizeof err) == 0, "reserve again (restart): %s", err);
    CHECK(m40_paged_kv_blocks_free(p) == 13, "a restart at the same positions takes nothing more");
    CHECK(m40_paged_kv_claim(p, 6, tok, pos, slot), "the batch claims its reservation");
    CHECK(!m40_paged_kv_claim(p, 6, tok, pos, slot), "once");
    m40_paged_kv_commit(p);
    m40_paged_kv_free(p);
}

static void test_full_pool(void)
{
    m40_paged_kv *p = m40_paged_kv_new(2, 2, 16, 0);
    int32_t tok[40], pos[40], slot[40];
    for (int32_t i = 0; i < 40; i++)
        tok[i] = i, pos[i] = i, slot[i] = 0;
    CHECK(m40_paged_kv_reserve(p, 32, tok, pos, slot, err, sizeof err) == 0, "two blocks fit: %s", err);
    m40_paged_kv_commit(p);
    CHECK(m40_paged_kv_blocks_free(p) == 0, "pool used up");
    const int32_t t1[] = {1}, p1[] = {0}, s1[] = {1};
    CHECK(m40_paged_kv_reserve(p, 1, t1, p1, s1, err, sizeof err) == M40_KV_NO_BLOCKS, "no room: M40_KV_NO_BLOCKS");
    CHECK(strstr(err, "pool is full") != NULL, "says why: %s", err);
    CHECK(!m40_paged_kv_claim(p, 1, t1, p1, s1), "nothing to claim after a refusal");
    CHECK(m40_paged_kv_blocks_free(p) == 0 && m40_paged_kv_step(p)->n_grp == 0, "nothing taken, no step");
    m40_paged_kv_slot_clear(p, 0);
    CHECK(m40_paged_kv_blocks_free(p) == 2, "a cleared slot gives its blocks back");
    CHECK(m40_paged_kv_reserve(p, 1, t1, p1, s1, err, sizeof err) == 0, "then it fits: %s", err);
    m40_paged_kv_free(p);
}

static void test_prefix(void)
{
    m40_paged_kv *p = m40_paged_kv_new(2, 8, 16, 1);
    CHECK(m40_paged_kv_prefix_cache(p), "prefix cache on");
    int32_t tok[40], pos[40], slot[40];
    for (int32_t i = 0; i < 40; i++)
        tok[i] = 100 + i, pos[i] = i, slot[i] = 0;
    CHECK(m40_paged_kv_reserve(p, 40, tok, pos, slot, err, sizeof err) == 0, "reserve: %s", err);
    m40_paged_kv_commit(p); /* two full blocks registered under tokens 100..131 */
    CHECK(m40_paged_kv_match_prefix(p, 1, tok, 40) == 32, "slot 1 starts on the two cached blocks");
    int64_t q = 0, qt = 0, hit = 0;
    m40_paged_kv_prefix_stats(p, &q, &qt, &hit);
    CHECK(q == 1 && qt == 40 && hit == 32, "stats %lld %lld %lld", (long long)q, (long long)qt, (long long)hit);
    m40_paged_kv_slot_clear(p, 0);
    m40_paged_kv_slot_clear(p, 1);
    m40_paged_kv_prefix_forget(p);
    CHECK(m40_paged_kv_match_prefix(p, 1, tok, 40) == 0, "forgotten");
    m40_paged_kv_free(p);
    p = m40_paged_kv_new(2, 8, 16, 0);
    CHECK(!m40_paged_kv_prefix_cache(p), "prefix cache off");
    m40_paged_kv_free(p);
}

static void test_bad_batches(void)
{
    m40_paged_kv *p = m40_paged_kv_new(2, 8, 16, 1);
    const int32_t t[] = {1, 2}, bad_slot[] = {0, 2}, p01[] = {0, 1}, gap[] = {0, 2}, s00[] = {0, 0};
    CHECK(m40_paged_kv_reserve(p, 2, t, p01, bad_slot, err, sizeof err) == -1 && strstr(err, "out of range"),
          "slot out of range: %s", err);
    CHECK(m40_paged_kv_reserve(p, 2, t, gap, s00, err, sizeof err) == -1 && strstr(err, "consecutive"),
          "a gap: %s", err);
    const int32_t ahead[] = {5};
    CHECK(m40_paged_kv_reserve(p, 1, t, ahead, s00, err, sizeof err) == -1 && strstr(err, "skips ahead"),
          "past the slot's length: %s", err);
    CHECK(m40_paged_kv_blocks_free(p) == 8, "refused batches take nothing");
    m40_paged_kv_free(p);
}

int main(void)
{
    test_groups();
    test_full_pool();
    test_prefix();
    test_bad_batches();
    return check_done();
}
