/* The device option of the model API on any machine: a CPU model reports device -1,
 * has no KV pool and ignores m40_kv_slot_clear; asking for a GPU where there is none
 * (or in a build without CUDA) fails with a message naming the device, and an engine
 * configured for that device ends FAILED with that message instead of crashing.
 * The GPU side itself is tested by tests/gpu (make check-gpu). */
#include <unistd.h>

#include "check.h"
#include "m40_engine.h"
#include "model/model.h"

int main(void)
{
    char path[4096], err[512];
    if (!check_shared_file("models/stories260K.gguf", path, sizeof path)) {
        SKIP("../shared/models/stories260K.gguf is absent");
        return check_done();
    }
    m40_model *m = NULL;
    m40_model_options o = {.n_threads = 1, .device = -1};
    CHECK(m40_model_load_opts(path, &o, &m, err, sizeof err) == 0, "cpu load: %s", err);
    if (!m)
        return check_done();
    CHECK(m40_model_device(m) == -1, "device %d", m40_model_device(m));
    m40_kv *kv = m40_kv_new(m, 2, 64);
    CHECK(kv && m40_kv_pool_blocks(kv) == 0 && m40_kv_pool_free_blocks(kv) == 0, "cpu kv has no pool");
    int32_t toks[3] = {1, 2, 3}, pos[3] = {0, 1, 2}, slot[3] = {1, 1, 1};
    float a[512], b[512];
    m40_batch bt = {.n = 3, .tokens = toks, .pos = pos, .slot = slot};
    CHECK(m40_model_forward(m, kv, &bt, a, err, sizeof err) == 0, "%s", err);
    m40_kv_slot_clear(kv, 1);
    m40_kv_slot_clear(kv, 99); /* out of range: ignored */
    CHECK(m40_model_forward(m, kv, &bt, b, err, sizeof err) == 0, "%s", err);
    CHECK(memcmp(a, b, sizeof a) == 0, "slot clear changed a CPU result");
    /* No prefix cache on the CPU: nothing matches, even a prompt just computed, and the
     * slot is left as it was (its cache still continues at position 3). */
    CHECK(!m40_kv_prefix_cache_enabled(kv), "cpu kv claims a prefix cache");
    CHECK(m40_kv_slot_match_prefix(kv, 1, toks, 3) == 0, "cpu match");
    CHECK(m40_kv_slot_match_prefix(kv, 0, toks, 3) == 0 && m40_kv_slot_match_prefix(kv, 99, toks, 3) == 0 &&
              m40_kv_slot_match_prefix(kv, 0, NULL, 3) == 0,
          "cpu match on another slot, out of range, no tokens");
    m40_kv_prefix_stats ps;
    memset(&ps, 0xff, sizeof ps);
    m40_kv_get_prefix_stats(kv, &ps);
    CHECK(ps.queries == 0 && ps.query_tokens == 0 && ps.hit_tokens == 0, "cpu prefix stats not zero");
    int32_t p3 = 3, t3 = 4, s1 = 1;
    m40_batch next = {.n = 1, .tokens = &t3, .pos = &p3, .slot = &s1};
    CHECK(m40_model_forward(m, kv, &next, b, err, sizeof err) == 0, "continue after a cpu match: %s", err);
    m40_kv_free(kv);
    m40_model_free(m);

    /* Device 0: a GPU model where there is one, else a clear refusal. */
    o.device = 0;
    m = NULL;
    int rc = m40_model_load_opts(path, &o, &m, err, sizeof err);
    if (rc == 0) {
        CHECK(m40_model_device(m) == 0, "device %d", m40_model_device(m));
        m40_model_free(m);
        SKIP("a CUDA device is present: the refusal is not tested here");
    } else {
        CHECK(m == NULL, "model left behind");
        CHECK(strstr(err, "device 0") != NULL, "message does not name the device: %s", err);
        m40_engine_config cfg = {.model_path = path, .model_name = "t", .device = 0, .ctx_size = 64, .max_seqs = 2,
                                 .max_queue = 2, .n_threads = 1};
        m40_engine *e = NULL;
        CHECK(m40_engine_create(&cfg, &e, err, sizeof err) == 0, "create: %s", err);
        if (e) {
            m40_engine_state st;
            for (int i = 0; i < 2000 && (st = m40_engine_get_state(e, err, sizeof err)) == M40_ENGINE_LOADING; i++)
                usleep(5000);
            CHECK(st == M40_ENGINE_FAILED && strstr(err, "device 0"), "state %d: %s", (int)st, err);
            m40_engine_destroy(e);
        }
    }
    return check_done();
}
