/* CPU forward pass: teacher-forced agreement with the shared reference outputs, batched
 * equals unbatched, batch validation, and load errors for broken GGUF files. */
#include <dirent.h>
#include <math.h>
#include <stdint.h>
#include <unistd.h>

#include "check.h"
#include "model/arch.h"
#include "model/eval.h"
#include "ref/ggml_types.h"
#include "gguf/gguf_writer.h"
#include "model/model.h"

/* Every model, F16 ones included: the forward pass rounds matmul inputs to F16 exactly
 * where the reference does (see rounds_input_to_f16 in engine/model/model.c). */
#define TOL 1e-3

/* dir/models/<sub>/<name>.gguf against dir/models/<sub>/ref/<name>.json (sub "" or "next/"). */
static void test_reference_in(const char *dir, const char *sub, const char *name)
{
    char model_path[4400], ref_path[4400], err[512];
    snprintf(model_path, sizeof model_path, "%s/models/%s%s.gguf", dir, sub, name);
    snprintf(ref_path, sizeof ref_path, "%s/models/%sref/%s.json", dir, sub, name);
    if (access(model_path, R_OK) != 0) {
        SKIP("%s: no model file", model_path);
        return;
    }
    m40_ref *ref = NULL;
    m40_model *m = NULL;
    int rc = m40_ref_load(ref_path, &ref, err, sizeof err);
    CHECK(rc == 0, "%s", err);
    if (rc)
        return;
    rc = m40_model_load(model_path, 2, &m, err, sizeof err);
    CHECK(rc == 0, "%s", err);
    if (rc) {
        m40_ref_free(ref);
        return;
    }
    double worst = 0;
    for (int32_t i = 0; i < ref->n_prompts; i++) {
        m40_eval_result r;
        rc = m40_eval_prompt(m, &ref->prompts[i], &r, err, sizeof err);
        CHECK(rc == 0, "%s prompt %d: %s", name, (int)i, err);
        if (rc)
            continue;
        CHECK(r.tokens_match, "%s prompt %d: tokenization differs at index %d", name, (int)i, (int)r.first_token_diff);
        CHECK(r.n_steps == ref->prompts[i].n_steps && r.n_steps > 0, "%s prompt %d: %d steps compared", name, (int)i,
              (int)r.n_steps);
        CHECK(r.max_abs_delta <= TOL, "%s prompt %d: max |dlogprob| %.3g at step %d", name, (int)i, r.max_abs_delta,
              (int)r.worst_step);
        if (r.max_abs_delta > worst)
            worst = r.max_abs_delta;
    }
    printf("%-28s max |dlogprob| %.3g over %d prompts\n", name, worst, (int)ref->n_prompts);
    m40_model_free(m);
    m40_ref_free(ref);
}

static void test_reference(const char *dir, const char *name) { test_reference_in(dir, "", name); }

/* ../shared/models/next holds fixtures of architectures that land one by one (its
 * README): each that loads here is listed, so a fixture of one still to come (the MoE
 * files) does not fail the suite. */
static const char *const next_landed[] = {
    "tiny-llama-hd-f16",   /* llama, head_dim 32 != 64 / 4 (attention.key_length) */
    "tiny-qwen3-gpt2-f16", /* qwen3: per-head Q/K norms, NeoX, head_dim 32 */
    "tiny-phi3-f16",       /* phi3: fused attn_qkv and gate+up */
    "tiny-gemma2-f16",     /* gemma2: sandwich norms, GeGLU, both soft-caps, SWA */
    "tiny-qwen3moe-f16",   /* qwen3moe: softmax router, top-2 renormalized, 3-D experts */
    "tiny-qwen3moe-q8_0",  /* the same, experts Q8_0 */
    "tiny-qwen3moe-q4km",  /* Q4_K/Q6_K experts, Q5_K, Q6_K tied head */
    "tiny-gpt-oss-mxfp4",  /* gpt-oss: MXFP4 experts, sinks, SWA/full, YaRN, biases, SwiGLU-OAI */
};

static void test_next_references(void)
{
    char buf[4096];
    if (!check_shared_file("models/next/ref", buf, sizeof buf)) {
        SKIP("../shared/models/next/ref is absent: no reference comparison of the newer architectures");
        return;
    }
    char dir[4096];
    snprintf(dir, sizeof dir, "%s", check_shared_dir());
    for (size_t i = 0; i < sizeof next_landed / sizeof next_landed[0]; i++)
        test_reference_in(dir, "next/", next_landed[i]);
}

/* A row whose GPU path is not validated is refused on a device with a message that
 * says so, before any CUDA call (so this holds with and without a GPU). The mechanism,
 * on every row forced unvalidated (a copy of the row: the table itself stays as built);
 * then the fixtures of ../shared/models/next as their rows stand: refused on device 0
 * where the row is not validated, and otherwise not refused (they may still fail to
 * load where no GPU is, for that reason). */
static void test_gpu_refusal(void)
{
    static const char *const rows[] = {"llama", "qwen2", "gemma3", "qwen3", "phi3", "gemma2", "qwen3moe", "gpt-oss"};
    for (size_t i = 0; i < sizeof rows / sizeof rows[0]; i++) {
        const m40_arch *a = m40_arch_find(rows[i]);
        CHECK(a != NULL, "row %s in the table", rows[i]);
        if (!a)
            continue;
        m40_arch forced = *a;
        forced.gpu_validated = 0;
        char err[256] = "", want[128];
        snprintf(want, sizeof want, "architecture '%s' runs on the CPU only", rows[i]);
        CHECK(m40_arch_device_ok(&forced, 0, err, sizeof err) == -1 && strstr(err, want) &&
                  strstr(err, "not validated"),
              "%s forced unvalidated, device 0: '%s'", rows[i], err);
        CHECK(m40_arch_device_ok(&forced, -1, err, sizeof err) == 0, "%s forced unvalidated, CPU: refused", rows[i]);
        CHECK(m40_arch_device_ok(a, 0, err, sizeof err) == (a->gpu_validated ? 0 : -1),
              "%s as built (gpu_validated %d), device 0", rows[i], a->gpu_validated);
    }
    static const char *const files[][2] = {{"tiny-llama-hd-f16", "llama"},     {"tiny-qwen3-gpt2-f16", "qwen3"},
                                           {"tiny-phi3-f16", "phi3"},          {"tiny-gemma2-f16", "gemma2"},
                                           {"tiny-qwen3moe-q4km", "qwen3moe"}, {"tiny-gpt-oss-mxfp4", "gpt-oss"}};
    for (size_t i = 0; i < sizeof files / sizeof files[0]; i++) {
        char rel[256], path[4096], err[512] = "", want[128];
        snprintf(rel, sizeof rel, "models/next/%s.gguf", files[i][0]);
        if (!check_shared_file(rel, path, sizeof path))
            continue;
        const m40_arch *a = m40_arch_find(files[i][1]);
        if (!a)
            continue; /* reported above */
        m40_model_options o = {.n_threads = 1, .device = 0};
        m40_model *m = NULL;
        int rc = m40_model_load_opts(path, &o, &m, err, sizeof err);
        snprintf(want, sizeof want, "architecture '%s' runs on the CPU only", files[i][1]);
        if (!a->gpu_validated)
            CHECK(rc == -1 && m == NULL && strstr(err, want) && strstr(err, "not validated"),
                  "%s on device 0: rc %d, '%s'", files[i][0], rc, rc ? err : "");
        else
            CHECK(rc == 0 || !strstr(err, want), "%s on device 0 refused although validated: '%s'", files[i][0], err);
        m40_model_free(m);
        m = NULL;
        if (!a->gpu_validated) {
            /* the test seam: M40_GPU_UNVALIDATED=1 lets the load go on to the GPU back end
             * (which, without a GPU here, fails for its own reason) */
            setenv("M40_GPU_UNVALIDATED", "1", 1);
            err[0] = '\0';
            rc = m40_model_load_opts(path, &o, &m, err, sizeof err);
            CHECK(rc == 0 || (err[0] && !strstr(err, want)), "%s on device 0 with M40_GPU_UNVALIDATED=1: rc %d, '%s'",
                  files[i][0], rc, rc ? err : "");
            unsetenv("M40_GPU_UNVALIDATED");
            m40_model_free(m);
            m = NULL;
        }
        o.device = -1; /* the same file loads on the CPU */
        rc = m40_model_load_opts(path, &o, &m, err, sizeof err);
        CHECK(rc == 0, "%s on the CPU: %s", files[i][0], err);
        m40_model_free(m);
    }
}

static void test_all_references(void)
{
    char buf[4096];
    const char *refdir = check_shared_file("models/ref", buf, sizeof buf);
    if (!refdir) {
        SKIP("../shared/models/ref is absent: no reference comparison");
        return;
    }
    DIR *d = opendir(refdir);
    if (!d) {
        SKIP("cannot list %s", refdir);
        return;
    }
    char dir[4096];
    snprintf(dir, sizeof dir, "%s", check_shared_dir());
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d))) {
        size_t len = strlen(e->d_name);
        if (len < 6 || strcmp(e->d_name + len - 5, ".json") != 0)
            continue;
        if (len > 12 && !strcmp(e->d_name + len - 12, ".native.json"))
            continue; /* the reference's own 8-bit activation path: informational only */
        char name[256];
        snprintf(name, sizeof name, "%.*s", (int)(len - 5), e->d_name);
        test_reference(dir, name);
        n++;
    }
    closedir(d);
    CHECK(n > 0, "no reference files found in %s", refdir);
}

/* ---- batched equals unbatched ---- */

static double max_diff(const float *a, const float *b, size_t n)
{
    double d = 0;
    for (size_t i = 0; i < n; i++)
        if (!(fabs((double)a[i] - b[i]) <= d))
            d = isnan(a[i] - b[i]) ? INFINITY : fabs((double)a[i] - b[i]);
    return d;
}

/* Runs n tokens of one slot in one call, logits for every row. */
static int run_all_rows(m40_model *m, m40_kv *kv, const int32_t *tok, int n, int32_t first_pos, int32_t slot,
                        float *logits)
{
    int32_t pos[256], slots[256];
    uint8_t want[256];
    for (int i = 0; i < n; i++) {
        pos[i] = first_pos + i;
        slots[i] = slot;
        want[i] = 1;
    }
    m40_batch b = {.n = n, .tokens = tok, .pos = pos, .slot = slots, .want_logits = want};
    char err[256];
    int rc = m40_model_forward(m, kv, &b, logits, err, sizeof err);
    if (rc)
        fprintf(stderr, "forward: %s\n", err);
    return rc;
}

/* b.argmax on the CPU: every want row's pick is the argmax (lowest id on ties) of the
 * logits the same call leaves in the buffer, which equal a plain forward's. */
static void test_argmax(void)
{
    char path[4096], err[512];
    if (!check_shared_file("models/stories260K.gguf", path, sizeof path))
        return;
    m40_model *m = NULL;
    if (m40_model_load(path, 1, &m, err, sizeof err)) {
        CHECK(0, "load: %s", err);
        return;
    }
    const int32_t V = m40_model_get_params(m)->n_vocab;
    int32_t tok[12], pos[12], slot[12], picks[2] = {-1, -1};
    uint8_t want[12];
    for (int i = 0; i < 12; i++)
        tok[i] = (int32_t)((i * 31u + 7u) % (uint32_t)V), pos[i] = i / 2, slot[i] = i % 2, want[i] = i >= 10;
    float *plain = malloc((size_t)2 * V * sizeof *plain), *scratch = malloc((size_t)2 * V * sizeof *scratch);
    m40_kv *a = m40_kv_new(m, 2, 32), *b = m40_kv_new(m, 2, 32);
    m40_batch full = {.n = 12, .tokens = tok, .pos = pos, .slot = slot, .want_logits = want};
    CHECK(m40_model_forward(m, a, &full, plain, err, sizeof err) == 0, "%s", err);
    m40_batch pick = full;
    pick.argmax = picks;
    CHECK(m40_model_forward(m, b, &pick, NULL, err, sizeof err) != 0, "argmax on the CPU without a buffer is refused");
    CHECK(m40_model_forward(m, b, &pick, scratch, err, sizeof err) == 0, "%s", err);
    for (int k = 0; k < 2; k++) {
        int32_t best = 0;
        for (int32_t v = 1; v < V; v++)
            if (plain[(size_t)k * V + v] > plain[(size_t)k * V + best])
                best = v;
        CHECK(picks[k] == best, "row %d: pick %d, argmax %d", k, picks[k], best);
    }
    CHECK(memcmp(plain, scratch, (size_t)2 * V * sizeof *plain) == 0, "the argmax call leaves the same logits");
    free(plain);
    free(scratch);
    m40_kv_free(a);
    m40_kv_free(b);
    m40_model_free(m);
}

static void test_batching(void)
{
    char path[4096], rpath[4096], err[512];
    if (!check_shared_file("models/stories260K.gguf", path, sizeof path) ||
        !check_shared_file("models/ref/stories260K.json", rpath, sizeof rpath)) {
        SKIP("stories260K.gguf or its reference absent: no batching test");
        return;
    }
    m40_model *m;
    m40_ref *ref;
    if (m40_model_load(path, 2, &m, err, sizeof err) || m40_ref_load(rpath, &ref, err, sizeof err)) {
        CHECK(0, "%s", err);
        return;
    }
    int32_t V = m40_model_get_params(m)->n_vocab;
    const m40_ref_prompt *A = &ref->prompts[0], *B = &ref->prompts[1];
    int nA = A->n_prompt_tokens, nB = B->n_prompt_tokens;
    float *sepA = malloc((size_t)(nA + 1) * V * sizeof(float));
    float *sepB = malloc((size_t)(nB + 1) * V * sizeof(float));
    float *one = malloc((size_t)(nA + 1) * V * sizeof(float));
    float *both = malloc((size_t)(nA + nB + 2) * V * sizeof(float));
    m40_kv *kvA = m40_kv_new(m, 1, 64), *kvB = m40_kv_new(m, 1, 64), *kv2 = m40_kv_new(m, 2, 64),
           *kv1 = m40_kv_new(m, 1, 64);
    if (!sepA || !sepB || !one || !both || !kvA || !kvB || !kv2 || !kv1 || nA > 60 || nB > 60) {
        CHECK(0, "setup");
        goto out;
    }

    /* Separate prefills, every row's logits. */
    CHECK(run_all_rows(m, kvA, A->prompt_tokens, nA, 0, 0, sepA) == 0, "prefill A");
    CHECK(run_all_rows(m, kvB, B->prompt_tokens, nB, 0, 0, sepB) == 0, "prefill B");

    /* A token by token: the decode path gives the prefill's rows. */
    double d = 0;
    for (int i = 0; i < nA; i++) {
        CHECK(run_all_rows(m, kv1, A->prompt_tokens + i, 1, i, 0, one + (size_t)i * V) == 0, "step %d", i);
    }
    d = max_diff(one, sepA, (size_t)nA * V);
    CHECK(d <= 1e-5, "one token per call vs one prefill call: max |dlogit| %g", d);

    /* Both prompts interleaved in one call on two slots: A0 B0 A1 B1 ... */
    int32_t tok[128], pos[128], slot[128];
    int n = 0, ia = 0, ib = 0;
    while (ia < nA || ib < nB) {
        if (ia < nA) {
            tok[n] = A->prompt_tokens[ia];
            pos[n] = ia++;
            slot[n++] = 0;
        }
        if (ib < nB) {
            tok[n] = B->prompt_tokens[ib];
            pos[n] = ib++;
            slot[n++] = 1;
        }
    }
    uint8_t want[128];
    memset(want, 1, sizeof want);
    m40_batch b = {.n = n, .tokens = tok, .pos = pos, .slot = slot, .want_logits = want};
    CHECK(m40_model_forward(m, kv2, &b, both, err, sizeof err) == 0, "interleaved prefill: %s", err);
    double dA = 0, dB = 0;
    for (int i = 0; i < n; i++) {
        const float *ref_row = slot[i] == 0 ? sepA + (size_t)pos[i] * V : sepB + (size_t)pos[i] * V;
        double di = max_diff(both + (size_t)i * V, ref_row, (size_t)V);
        if (slot[i] == 0 && di > dA)
            dA = di;
        if (slot[i] == 1 && di > dB)
            dB = di;
    }
    CHECK(dA <= 1e-5 && dB <= 1e-5, "two slots in one call vs separate calls: max |dlogit| %g (A), %g (B)", dA, dB);

    /* One decode step for both slots in one call, logits of the last row only
     * (want_logits NULL) and of both rows. */
    int32_t tA = A->steps[0].token, tB = B->steps[0].token;
    CHECK(run_all_rows(m, kvA, &tA, 1, nA, 0, sepA) == 0, "decode A");
    CHECK(run_all_rows(m, kvB, &tB, 1, nB, 0, sepB) == 0, "decode B");
    int32_t dt[2] = {tA, tB}, dp[2] = {nA, nB}, ds[2] = {0, 1};
    m40_batch db = {.n = 2, .tokens = dt, .pos = dp, .slot = ds, .want_logits = want};
    CHECK(m40_model_forward(m, kv2, &db, both, err, sizeof err) == 0, "decode both: %s", err);
    d = fmax(max_diff(both, sepA, (size_t)V), max_diff(both + V, sepB, (size_t)V));
    CHECK(d <= 1e-5, "batched decode step vs separate: max |dlogit| %g", d);

    /* want_logits NULL: only the last row comes back (slot 1's), and recomputing the
     * same positions gives the same answer (overwriting the cache entries). */
    db.want_logits = NULL;
    CHECK(m40_model_forward(m, kv2, &db, both, err, sizeof err) == 0, "decode again: %s", err);
    d = max_diff(both, sepB, (size_t)V);
    CHECK(d <= 1e-5, "want_logits NULL returns the last row: max |dlogit| %g", d);

    /* Bad batches are refused with a message. */
    int32_t bad_pos = 64, bad_slot = 2, bad_tok = V, zero = 0, ok_tok = 1;
    m40_batch e1 = {.n = 1, .tokens = &ok_tok, .pos = &bad_pos, .slot = &zero};
    m40_batch e2 = {.n = 1, .tokens = &ok_tok, .pos = &zero, .slot = &bad_slot};
    m40_batch e3 = {.n = 1, .tokens = &bad_tok, .pos = &zero, .slot = &zero};
    err[0] = 0;
    CHECK(m40_model_forward(m, kv2, &e1, both, err, sizeof err) == -1 && strstr(err, "position"),
          "position beyond ctx refused: '%s'", err);
    err[0] = 0;
    CHECK(m40_model_forward(m, kv2, &e2, both, err, sizeof err) == -1 && strstr(err, "slot"),
          "slot out of range refused: '%s'", err);
    err[0] = 0;
    CHECK(m40_model_forward(m, kv2, &e3, both, err, sizeof err) == -1 && strstr(err, "token"),
          "token out of range refused: '%s'", err);

out:
    free(sepA);
    free(sepB);
    free(one);
    free(both);
    m40_kv_free(kvA);
    m40_kv_free(kvB);
    m40_kv_free(kv2);
    m40_kv_free(kv1);
    m40_ref_free(ref);
    m40_model_free(m);
}

/* A prompt prefilled in one call, one token per call, and interleaved with another
 * slot's prompt in one call give the same logits, bit for bit: mixtures of experts route
 * each token on its own (the two prompts routed to different experts; gpt-oss's long
 * prompt, 75 tokens, passes its 32-token window, so the sliding-window layers are in
 * it), and the CPU's products, exact or fast (fast: m40_model_options.cpu_fast, its
 * one-token kernels against its tiles of several tokens), compute a row the same way
 * at any batch size: what the README says of m40_batch_invariant on the CPU. dir: the
 * model's folder under ../shared. */
static void test_rows_alone(const char *dir, const char *name, int fast)
{
    char rel[256], path[4096], rpath[4096], err[512];
    snprintf(rel, sizeof rel, "%s/%s.gguf", dir, name);
    if (!check_shared_file(rel, path, sizeof path)) {
        SKIP("%s absent: no batching test", rel);
        return;
    }
    snprintf(rel, sizeof rel, "%s/ref/%s.json", dir, name);
    m40_model *m = NULL;
    m40_ref *ref = NULL;
    const m40_model_options o = {.n_threads = 2, .device = -1, .cpu_fast = fast};
    if (!check_shared_file(rel, rpath, sizeof rpath) || m40_model_load_opts(path, &o, &m, err, sizeof err) ||
        m40_ref_load(rpath, &ref, err, sizeof err)) {
        CHECK(0, "%s: %s", name, err);
        m40_model_free(m);
        return;
    }
    int32_t V = m40_model_get_params(m)->n_vocab;
    const m40_ref_prompt *A = &ref->prompts[1], *B = &ref->prompts[ref->n_prompts - 1];
    int nA = A->n_prompt_tokens, nB = B->n_prompt_tokens, n = nA + nB;
    float *sepA = malloc((size_t)nA * V * sizeof(float)), *sepB = malloc((size_t)nB * V * sizeof(float));
    float *one = malloc((size_t)nB * V * sizeof(float)), *both = malloc((size_t)n * V * sizeof(float));
    m40_kv *kvA = m40_kv_new(m, 1, 128), *kvB = m40_kv_new(m, 1, 128), *kv1 = m40_kv_new(m, 1, 128),
           *kv2 = m40_kv_new(m, 2, 128);
    if (!sepA || !sepB || !one || !both || !kvA || !kvB || !kv1 || !kv2 || nB > 100 || nA > 100 || nB < 2) {
        CHECK(0, "%s: setup (prompts of %d and %d tokens)", name, nA, nB);
        goto out;
    }
    CHECK(run_all_rows(m, kvA, A->prompt_tokens, nA, 0, 0, sepA) == 0, "%s: prefill A", name);
    CHECK(run_all_rows(m, kvB, B->prompt_tokens, nB, 0, 0, sepB) == 0, "%s: prefill B", name);
    for (int i = 0; i < nB; i++)
        CHECK(run_all_rows(m, kv1, B->prompt_tokens + i, 1, i, 0, one + (size_t)i * V) == 0, "%s: step %d", name, i);
    double d = max_diff(one, sepB, (size_t)nB * V);
    CHECK(d == 0, "%s: %d tokens one per call vs one prefill call: max |dlogit| %g", name, nB, d);
    int32_t tok[256], pos[256], slot[256];
    uint8_t want[256];
    int k = 0;
    for (int i = 0; i < nA || i < nB; i++) {
        if (i < nA)
            tok[k] = A->prompt_tokens[i], pos[k] = i, slot[k++] = 0;
        if (i < nB)
            tok[k] = B->prompt_tokens[i], pos[k] = i, slot[k++] = 1;
    }
    memset(want, 1, sizeof want);
    m40_batch b = {.n = n, .tokens = tok, .pos = pos, .slot = slot, .want_logits = want};
    CHECK(m40_model_forward(m, kv2, &b, both, err, sizeof err) == 0, "%s: interleaved: %s", name, err);
    d = 0;
    for (int i = 0; i < n; i++)
        d = fmax(d, max_diff(both + (size_t)i * V, (slot[i] ? sepB : sepA) + (size_t)pos[i] * V, (size_t)V));
    CHECK(d == 0, "%s: two slots interleaved in one call vs alone: max |dlogit| %g", name, d);
out:
    free(sepA);
    free(sepB);
    free(one);
    free(both);
    m40_kv_free(kvA);
    m40_kv_free(kvB);
    m40_kv_free(kv1);
    m40_kv_free(kv2);
    m40_ref_free(ref);
    m40_model_free(m);
}

/* ---- load errors: stories260K rewritten with one thing broken ---- */

typedef struct {
    const char *drop_tensor;
    const char *swap_dims_tensor;  /* ne[0] <-> ne[1] */
    const char *retype_tensor;     /* to Q8_1 (a GGUF type the CPU backend lacks) */
    const char *drop_key;
    const char *arch;              /* replaces general.architecture */
    const char *flatten_tensor;    /* 3-D [a, b, c] -> 2-D [a, b * c] */
    const char *set_u32_key;       /* set to set_u32 (UINT32) */
    uint32_t set_u32;
} variant;

static int write_variant(const m40_gguf *g, const variant *v, const char *out, char *err, size_t errlen)
{
    m40_gguf_writer *w = m40_gguf_writer_new();
    if (!w) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    for (uint64_t i = 0; i < m40_gguf_n_kv(g); i++) {
        const m40_gguf_kv *kv = m40_gguf_kv_at(g, i);
        if (v->drop_key && !strcmp(kv->key, v->drop_key))
            continue;
        if (v->arch && !strcmp(kv->key, "general.architecture"))
            m40_gguf_writer_set_str(w, kv->key, v->arch);
        else if (v->set_u32_key && !strcmp(kv->key, v->set_u32_key))
            m40_gguf_writer_set_u32(w, kv->key, v->set_u32);
        else
            m40_gguf_writer_set_value(w, kv->key, &kv->value);
    }
    for (uint64_t i = 0; i < m40_gguf_n_tensors(g); i++) {
        const m40_gguf_tensor *t = m40_gguf_tensor_at(g, i);
        uint64_t ne[M40_GGUF_MAX_DIMS];
        memcpy(ne, t->ne, sizeof ne);
        if (v->drop_tensor && !strcmp(t->name, v->drop_tensor))
            continue;
        if (v->swap_dims_tensor && !strcmp(t->name, v->swap_dims_tensor)) {
            ne[0] = t->ne[1];
            ne[1] = t->ne[0];
        }
        if (v->flatten_tensor && !strcmp(t->name, v->flatten_tensor)) {
            ne[1] *= ne[2];
            ne[2] = 1;
            m40_gguf_writer_add_tensor(w, t->name, t->type, 2, ne, t->data, t->nbytes);
            continue;
        }
        if (v->retype_tensor && !strcmp(t->name, v->retype_tensor)) {
            uint64_t nbytes;
            m40_type_nbytes(M40_TYPE_Q8_1, t->n_elems, &nbytes);
            m40_gguf_writer_add_tensor(w, t->name, M40_TYPE_Q8_1, t->n_dims, ne, NULL, nbytes);
            continue;
        }
        m40_gguf_writer_add_tensor(w, t->name, t->type, t->n_dims, ne, t->data, t->nbytes);
    }
    int rc = m40_gguf_writer_write_file(w, out, err, errlen);
    m40_gguf_writer_free(w);
    return rc;
}

static void expect_load_error(const m40_gguf *g, const variant *v, const char *want1, const char *want2)
{
    char tmpl[] = "/tmp/m40-test-model-XXXXXX";
    int fd = mkstemp(tmpl);
    if (fd < 0) {
        SKIP("cannot create a temporary file");
        return;
    }
    close(fd);
    char err[512] = "";
    if (write_variant(g, v, tmpl, err, sizeof err) != 0) {
        CHECK(0, "writing the variant: %s", err);
        unlink(tmpl);
        return;
    }
    m40_model *m = NULL;
    err[0] = 0;
    int rc = m40_model_load(tmpl, 1, &m, err, sizeof err);
    CHECK(rc == -1 && m == NULL, "load of a broken model must fail (expected '%s')", want1);
    CHECK(strstr(err, want1) && (!want2 || strstr(err, want2)), "error '%s' should name '%s'%s%s", err, want1,
          want2 ? " and " : "", want2 ? want2 : "");
    m40_model_free(m);
    unlink(tmpl);
}

static void test_load_errors(void)
{
    char path[4096], err[512];
    if (!check_shared_file("models/stories260K.gguf", path, sizeof path)) {
        SKIP("stories260K.gguf absent: no load-error tests");
        return;
    }
    m40_gguf *g;
    if (m40_gguf_open(path, &g, err, sizeof err)) {
        CHECK(0, "%s", err);
        return;
    }
    /* The unmodified copy loads: the variants below fail for their one change only. */
    variant same = {0};
    char tmpl[] = "/tmp/m40-test-model-XXXXXX";
    int fd = mkstemp(tmpl);
    if (fd >= 0) {
        close(fd);
        m40_model *m = NULL;
        CHECK(write_variant(g, &same, tmpl, err, sizeof err) == 0 && m40_model_load(tmpl, 1, &m, err, sizeof err) == 0,
              "unmodified rewrite loads: %s", err);
        m40_model_free(m);
        unlink(tmpl);
    }
    expect_load_error(g, &(variant){.drop_tensor = "blk.1.ffn_up.weight"}, "blk.1.ffn_up.weight", "missing");
    expect_load_error(g, &(variant){.drop_tensor = "output_norm.weight"}, "output_norm.weight", "missing");
    expect_load_error(g, &(variant){.swap_dims_tensor = "blk.0.attn_k.weight"}, "blk.0.attn_k.weight", "shape");
    expect_load_error(g, &(variant){.swap_dims_tensor = "blk.2.ffn_down.weight"}, "blk.2.ffn_down.weight", "shape");
    expect_load_error(g, &(variant){.retype_tensor = "blk.0.attn_q.weight"}, "blk.0.attn_q.weight",
                      "Q8_1 which is not supported");
    expect_load_error(g, &(variant){.drop_key = "llama.block_count"}, "llama.block_count", "missing");
    expect_load_error(g, &(variant){.arch = "mamba"}, "mamba", "not supported");
    m40_gguf_close(g);

    m40_model *m = NULL;
    CHECK(m40_model_load("/nonexistent/model.gguf", 1, &m, err, sizeof err) == -1 && strstr(err, "/nonexistent"),
          "missing file: '%s'", err);
}

/* The mixture-of-experts metadata and tensors, each broken alone in tiny-gpt-oss-mxfp4:
 * a clear error, never a crash or an out-of-bounds read. */
static void test_moe_load_errors(void)
{
    char path[4096], err[512];
    if (!check_shared_file("models/next/tiny-gpt-oss-mxfp4.gguf", path, sizeof path)) {
        SKIP("tiny-gpt-oss-mxfp4.gguf absent: no MoE load-error tests");
        return;
    }
    m40_gguf *g;
    if (m40_gguf_open(path, &g, err, sizeof err)) {
        CHECK(0, "%s", err);
        return;
    }
    char tmpl[] = "/tmp/m40-test-model-XXXXXX";
    int fd = mkstemp(tmpl);
    if (fd >= 0) {
        close(fd);
        m40_model *m = NULL;
        CHECK(write_variant(g, &(variant){0}, tmpl, err, sizeof err) == 0 &&
                  m40_model_load(tmpl, 1, &m, err, sizeof err) == 0,
              "unmodified rewrite loads: %s", err);
        m40_model_free(m);
        unlink(tmpl);
    }
    expect_load_error(g, &(variant){.drop_tensor = "blk.2.ffn_up_exps.weight"}, "blk.2.ffn_up_exps.weight",
                      "missing");
    expect_load_error(g, &(variant){.drop_tensor = "blk.0.ffn_gate_inp.weight"}, "ffn_gate_inp.weight", "missing");
    expect_load_error(g, &(variant){.drop_tensor = "blk.1.ffn_down_exps.bias"}, "ffn_down_exps.bias", "missing");
    expect_load_error(g, &(variant){.drop_tensor = "blk.3.attn_sinks.weight"}, "attn_sinks.weight", "missing");
    expect_load_error(g, &(variant){.drop_tensor = "blk.0.attn_output.bias"}, "attn_output.bias", "missing");
    expect_load_error(g, &(variant){.flatten_tensor = "blk.1.ffn_gate_exps.weight"}, "ffn_gate_exps.weight",
                      "expected [64, 64, 8]");
    expect_load_error(g, &(variant){.retype_tensor = "blk.0.ffn_down_exps.weight"}, "ffn_down_exps.weight",
                      "not supported");
    expect_load_error(g, &(variant){.set_u32_key = "gpt-oss.expert_count", .set_u32 = 4000000000u},
                      "gpt-oss.expert_count", "out of range");
    expect_load_error(g, &(variant){.set_u32_key = "gpt-oss.expert_count", .set_u32 = 1024}, "mixture of experts",
                      "expert_count 1024");
    expect_load_error(g, &(variant){.set_u32_key = "gpt-oss.expert_count", .set_u32 = 16}, "ffn_gate_inp.weight",
                      "shape");
    expect_load_error(g, &(variant){.set_u32_key = "gpt-oss.expert_used_count", .set_u32 = 9}, "mixture of experts",
                      "expert_used_count 9");
    expect_load_error(g, &(variant){.set_u32_key = "gpt-oss.expert_used_count", .set_u32 = 0}, "mixture of experts",
                      "expert_used_count 0");
    expect_load_error(g, &(variant){.set_u32_key = "gpt-oss.expert_feed_forward_length", .set_u32 = 128},
                      "ffn_gate_exps.weight", "shape");
    expect_load_error(g, &(variant){.drop_key = "gpt-oss.expert_count"}, "gpt-oss.expert_count", "missing");
    expect_load_error(g, &(variant){.drop_key = "gpt-oss.rope.scaling.factor"}, "rope.scaling.factor", "missing");
    expect_load_error(g, &(variant){.set_u32_key = "gpt-oss.rope.scaling.original_context_length", .set_u32 = 0},
                      "YaRN", "original_context_length 0");
    m40_gguf_close(g);
}

int main(void)
{
    test_all_references();
    test_next_references();
    test_gpu_refusal();
    test_batching();
    test_rows_alone("models/next", "tiny-qwen3moe-q4km", 0);
    test_rows_alone("models/next", "tiny-gpt-oss-mxfp4", 0);
    static const char *const fast_dense[] = {"tiny-llama-q4km", "tiny-llama-q8_0", "tiny-llama-q4_0",
                                             "tiny-qwen2-gpt2-f16", "stories260K"};
    for (size_t i = 0; i < sizeof fast_dense / sizeof fast_dense[0]; i++)
        test_rows_alone("models", fast_dense[i], 1);
    test_rows_alone("models/next", "tiny-qwen3moe-q4km", 1);
    test_rows_alone("models/next", "tiny-gpt-oss-mxfp4", 1);
    test_rows_alone("models/next", "tiny-gemma2-f16", 1);
    test_rows_alone("models", "stories260K", 0);
    test_argmax();
    test_load_errors();
    test_moe_load_errors();
    return check_done();
}
