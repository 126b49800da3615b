/* Grammar masks on real vocabularies (the shared models' SentencePiece and byte-level BPE
 * tokenizers): along random constrained walks the trie masks equal a brute-force check
 * of every token, and the time per token (mask + apply + accept) is printed, the cost
 * constrained decoding adds to the sampler. Skips without ../shared. */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "check.h"
#include "gguf/gguf.h"
#include "grammar/grammar.h"
#include "tokenizer/tokenizer.h"

static uint64_t rng = 0x2545F4914F6CDD1Dull;
static uint32_t rnd(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (uint32_t)(rng >> 11);
}

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

typedef struct {
    int32_t n;
    char **bytes;
    int32_t *lens;
    uint8_t *eog;
} vocab;

static int load_vocab(const char *path, vocab *v)
{
    char err[256];
    m40_gguf *g = NULL;
    m40_tokenizer *t = NULL;
    if (m40_gguf_open(path, &g, err, sizeof err) != 0)
        return -1;
    if (m40_tokenizer_from_gguf(g, &t, err, sizeof err) != 0) {
        m40_gguf_close(g);
        return -1;
    }
    m40_gguf_close(g);
    v->n = m40_tokenizer_n_vocab(t);
    v->bytes = calloc((size_t)v->n, sizeof *v->bytes);
    v->lens = calloc((size_t)v->n, sizeof *v->lens);
    v->eog = calloc((size_t)v->n, 1);
    for (int32_t id = 0; id < v->n; id++) {
        char buf[256];
        int k = m40_token_to_bytes(t, id, 0, buf, (int)sizeof buf);
        v->eog[id] = (uint8_t)(m40_tokenizer_is_eog(t, id) != 0);
        if (k > 0 && k <= (int)sizeof buf) {
            v->bytes[id] = malloc((size_t)k);
            memcpy(v->bytes[id], buf, (size_t)k);
            v->lens[id] = k;
        }
    }
    m40_tokenizer_free(t);
    return 0;
}

static void free_vocab(vocab *v)
{
    for (int32_t i = 0; i < v->n; i++)
        free(v->bytes[i]);
    free(v->bytes);
    free(v->lens);
    free(v->eog);
}

static const char *SCHEMA =
    "{\"type\":\"object\",\"properties\":{\"name\":{\"type\":\"string\"},\"age\":{\"type\":\"integer\","
    "\"minimum\":0,\"maximum\":150},\"tags\":{\"type\":\"array\",\"items\":{\"type\":\"string\"}},"
    "\"ok\":{\"type\":\"boolean\"}},\"required\":[\"name\",\"age\",\"tags\",\"ok\"]}";

static void walk(const char *label, const vocab *v, const m40_token_trie *trie, const char *schema, int brute_steps)
{
    char err[256];
    char *src = m40_json_schema_to_gbnf(schema, schema ? strlen(schema) : 0, err, sizeof err);
    CHECK(src != NULL, "%s", err);
    if (!src)
        return;
    float *logits = malloc(sizeof *logits * (size_t)v->n);
    int32_t *allowed = malloc(sizeof *allowed * (size_t)v->n);
    double t_mask = 0;
    int tokens = 0, mismatches = 0, walks = 0;
    for (int w = 0; w < 8; w++, walks++) {
        m40_grammar *g = m40_grammar_parse(src, strlen(src), err, sizeof err);
        m40_grammar *g2 = m40_grammar_parse(src, strlen(src), err, sizeof err);
        m40_gconstraint *c = m40_gconstraint_new(g, trie);
        m40_gmatch *ref = m40_gmatch_new(g2);
        int32_t rs = m40_gmatch_start(ref);
        for (int step = 0; step < 300; step++) {
            for (int32_t i = 0; i < v->n; i++)
                logits[i] = 0;
            double t0 = now();
            int32_t na = m40_gconstraint_apply(c, logits);
            t_mask += now() - t0;
            if (na <= 0)
                break;
            int32_t k = 0;
            for (int32_t i = 0; i < v->n; i++)
                if (logits[i] == 0)
                    allowed[k++] = i;
            if (step < brute_steps) {
                for (int32_t id = 0; id < v->n; id++) {
                    int want;
                    if (v->eog[id])
                        want = m40_gmatch_accepting(ref, rs);
                    else if (!v->lens[id])
                        want = 0;
                    else {
                        int32_t s = rs;
                        for (int32_t b = 0; b < v->lens[id] && s >= 0; b++)
                            s = m40_gmatch_next(ref, s, (uint8_t)v->bytes[id][b]);
                        want = s >= 0;
                    }
                    mismatches += want != (logits[id] == 0);
                }
            }
            int32_t id = allowed[rnd() % (uint32_t)k];
            if (v->eog[id])
                break;
            t0 = now();
            CHECK(m40_gconstraint_accept(c, id) == 0, "accept");
            t_mask += now() - t0;
            for (int32_t b = 0; b < v->lens[id]; b++)
                rs = m40_gmatch_next(ref, rs, (uint8_t)v->bytes[id][b]);
            tokens++;
            if (m40_gconstraint_done(c))
                break;
        }
        m40_gconstraint_free(c);
        m40_gmatch_free(ref);
        m40_grammar_free(g2);
    }
    CHECK(mismatches == 0, "%s: %d mask decisions differ from brute force", label, mismatches);
    CHECK(tokens > 100, "%s: only %d tokens", label, tokens);
    printf("%s: %d tokens over %d walks, %.1f us/token for mask + apply + accept (vocabulary %d)\n", label, tokens,
           walks, tokens ? t_mask / tokens * 1e6 : 0.0, v->n);
    free(src);
    free(logits);
    free(allowed);
}

int main(void)
{
    const char *shared = check_shared_dir();
    if (!shared) {
        SKIP("../shared absent");
        return check_done();
    }
    static const char *models[] = {"models/tiny-llama-q4km.gguf", "models/tiny-qwen2-gpt2-f16.gguf"};
    for (size_t i = 0; i < sizeof models / sizeof *models; i++) {
        char path[2048];
        snprintf(path, sizeof path, "%.1900s/%s", shared, models[i]);
        vocab v;
        if (load_vocab(path, &v) != 0) {
            SKIP("%s: cannot load its vocabulary", path);
            continue;
        }
        double t0 = now();
        m40_token_trie *trie = m40_token_trie_new(v.n, (const char *const *)v.bytes, v.lens, v.eog);
        printf("%s: trie built in %.1f ms\n", models[i], (now() - t0) * 1e3);
        CHECK(trie != NULL, "trie");
        if (trie) {
            char label[256];
            snprintf(label, sizeof label, "%.200s json_schema", models[i]);
            walk(label, &v, trie, SCHEMA, 40);
            snprintf(label, sizeof label, "%.200s json_object", models[i]);
            walk(label, &v, trie, NULL, 40);
        }
        m40_token_trie_free(trie);
        free_vocab(&v);
    }
    return check_done();
}
