/* m40 run: generate text from a prompt on the CPU, streaming it as it is produced. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cli.h"
#include "store.h"
#include "model/model.h"
#include "serve/sampler.h"
#include "tokenizer/tokenizer.h"

static void run_usage(FILE *f)
{
    fprintf(f, "usage: m40 run MODEL -p PROMPT [-n N] [--temp T] [--top-p P] [--top-k K] [--min-p P]\n"
               "                 [--seed S] [--threads N] [--device D] [--tp N] [--exact] [--batch-invariant]\n"
               "  -n N         tokens to generate (default 128)\n"
               "  --temp T     temperature (default 0.8; 0 = greedy)\n"
               "  --top-p P    nucleus sampling mass (default 1 = off)\n"
               "  --top-k K    keep the K most likely tokens (default 0 = off)\n"
               "  --min-p P    drop tokens below P times the most likely (default 0 = off)\n"
               "  --seed S     random seed (default: from the clock)\n"
               "  --threads N  CPU threads (default: all)\n"
               "  --device D   cpu (default) or a CUDA device index\n"
               "  --tp N       tensor parallelism: GPUs D .. D+N-1 (NCCL), or N simulated CPU ranks\n"
               "  --exact      CPU: the exact F32 reference products (as m40 eval) instead of the\n"
               "               fast int16 path\n"
               "  --batch-invariant\n"
               "               GPU: every row computed as if the batch held it alone, as m40 serve\n"
               "               --batch-invariant does (slower; not with --tp; no change on the cpu)\n");
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* Strict number parsing: the whole argument must be a number. */
static int parse_double(const char *s, double *out)
{
    char *end;
    errno = 0;
    *out = strtod(s, &end);
    return end != s && *end == '\0' && errno == 0 ? 0 : -1;
}

static int parse_long(const char *s, long long *out)
{
    char *end;
    errno = 0;
    *out = strtoll(s, &end, 10);
    return end != s && *end == '\0' && errno == 0 ? 0 : -1;
}

int m40_cmd_run(int argc, char **argv)
{
    const char *model_path = NULL, *prompt = NULL;
    long long n_gen = 128, threads = 0, top_k = 0, seed = -1, device = -1, tp = 1;
    double temp = 0.8, top_p = 1.0, min_p = 0.0;
    int exact = 0, batch_invariant = 0;

    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        int has_val = i + 1 < argc;
        int bad = 0;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            run_usage(stdout);
            return 0;
        } else if (!strcmp(a, "-p") || !strcmp(a, "--prompt")) {
            bad = !has_val;
            if (has_val)
                prompt = argv[++i];
        } else if (!strcmp(a, "-n")) {
            bad = !has_val || parse_long(argv[++i], &n_gen) || n_gen < 0;
        } else if (!strcmp(a, "--temp")) {
            bad = !has_val || parse_double(argv[++i], &temp) || temp < 0;
        } else if (!strcmp(a, "--top-p")) {
            bad = !has_val || parse_double(argv[++i], &top_p) || top_p <= 0 || top_p > 1;
        } else if (!strcmp(a, "--top-k")) {
            bad = !has_val || parse_long(argv[++i], &top_k) || top_k < 0 || top_k > INT32_MAX;
        } else if (!strcmp(a, "--min-p")) {
            bad = !has_val || parse_double(argv[++i], &min_p) || min_p < 0 || min_p > 1;
        } else if (!strcmp(a, "--seed")) {
            bad = !has_val || parse_long(argv[++i], &seed);
        } else if (!strcmp(a, "--threads")) {
            bad = !has_val || parse_long(argv[++i], &threads) || threads < 0 || threads > 1024;
        } else if (!strcmp(a, "--exact")) {
            exact = 1;
        } else if (!strcmp(a, "--batch-invariant")) {
            batch_invariant = 1;
        } else if (!strcmp(a, "--tp")) {
            bad = !has_val || parse_long(argv[++i], &tp) || tp < 1 || tp > 64;
        } else if (!strcmp(a, "--device")) {
            if (has_val && !strcmp(argv[i + 1], "cpu"))
                device = -1, i++;
            else
                bad = !has_val || parse_long(argv[++i], &device) || device < -1 || device > 1024;
        } else if (a[0] == '-' && a[1] != '\0') {
            fprintf(stderr, "m40 run: unknown option '%s'\n", a);
            run_usage(stderr);
            return 2;
        } else if (!model_path) {
            model_path = a;
        } else {
            fprintf(stderr, "m40 run: unexpected argument '%s'\n", a);
            run_usage(stderr);
            return 2;
        }
        if (bad) {
            fprintf(stderr, "m40 run: %s needs a valid value\n", a);
            run_usage(stderr);
            return 2;
        }
    }
    if (!model_path || !prompt) {
        fprintf(stderr, "m40 run: a MODEL and -p PROMPT are required\n");
        run_usage(stderr);
        return 2;
    }

    char err[512], stored[PATH_MAX];
    model_path = m40_model_arg("run", model_path, stored, sizeof stored);
    m40_model *m = NULL;
    m40_model_options mo = {.n_threads = (int)threads,
                            .device = (int)device,
                            .log_progress = 1,
                            .cpu_fast = !exact,
                            .tp = (int)tp,
                            .batch_invariant = batch_invariant};
    if (m40_model_load_opts(model_path, &mo, &m, err, sizeof err)) {
        fprintf(stderr, "m40 run: %s\n", err);
        return 1;
    }
    const m40_model_params *mp = m40_model_get_params(m);
    const m40_tokenizer *tok = m40_model_tokenizer(m);
    int rc = 1;
    int32_t *ids = NULL, *pos = NULL, *slot = NULL;
    float *logits = NULL;
    m40_kv *kv = NULL;
    m40_sampler *sampler = NULL;
    m40_detok *detok = NULL;

    size_t plen = strlen(prompt);
    int64_t cap = (int64_t)plen + 8, n_prompt;
    for (;;) {
        free(ids);
        ids = malloc((size_t)cap * sizeof *ids);
        if (!ids) {
            fprintf(stderr, "m40 run: out of memory\n");
            goto done;
        }
        n_prompt = m40_tokenize(tok, prompt, plen, m40_tokenizer_add_bos(tok), 0, ids, cap, err, sizeof err);
        if (n_prompt < 0) {
            fprintf(stderr, "m40 run: tokenize: %s\n", err);
            goto done;
        }
        if (n_prompt <= cap)
            break;
        cap = n_prompt;
    }
    if (n_prompt == 0) {
        fprintf(stderr, "m40 run: the prompt gives no tokens (and the vocabulary adds no BOS)\n");
        goto done;
    }
    if (n_prompt >= mp->ctx_train) {
        fprintf(stderr, "m40 run: the prompt has %lld tokens; the model's context is %d\n", (long long)n_prompt,
                (int)mp->ctx_train);
        goto done;
    }
    /* The KV cache holds exactly what this run can use. */
    int64_t n_ctx = n_prompt + n_gen < mp->ctx_train ? n_prompt + n_gen : mp->ctx_train;
    if (n_ctx < n_prompt + 1)
        n_ctx = n_prompt + 1;
    kv = m40_kv_new(m, 1, (int32_t)n_ctx);
    pos = malloc((size_t)n_prompt * sizeof *pos);
    slot = calloc((size_t)n_prompt, sizeof *slot);
    logits = malloc((size_t)mp->n_vocab * sizeof *logits);
    if (!kv || !pos || !slot || !logits) {
        fprintf(stderr, "m40 run: out of memory (KV cache for %lld tokens)\n", (long long)n_ctx);
        goto done;
    }

    m40_sampler_params sp;
    m40_sampler_params_default(&sp);
    sp.temperature = (float)temp;
    sp.top_k = (int32_t)top_k;
    sp.top_p = (float)top_p;
    sp.min_p = (float)min_p;
    sp.seed = seed >= 0 ? (uint64_t)seed : (uint64_t)time(NULL) ^ ((uint64_t)clock() << 32);
    sampler = m40_sampler_new(&sp, mp->n_vocab);
    detok = m40_detok_new(tok);
    if (!sampler || !detok) {
        fprintf(stderr, "m40 run: out of memory\n");
        goto done;
    }
    for (int64_t i = 0; i < n_prompt; i++) {
        pos[i] = (int32_t)i;
        m40_sampler_accept(sampler, ids[i]);
        /* The prompt goes through the detokenizer too (its text is not printed) so that
         * SentencePiece's rule of dropping the first piece's leading space applies to
         * the prompt, not to the first generated token. */
        size_t ignored;
        m40_detok_push(detok, ids[i], &ignored);
    }

    double t0 = now_s();
    m40_batch b = {.n = (int32_t)n_prompt, .tokens = ids, .pos = pos, .slot = slot, .want_logits = NULL};
    if (m40_model_forward(m, kv, &b, logits, err, sizeof err)) {
        fprintf(stderr, "m40 run: %s\n", err);
        goto done;
    }
    double t_prefill = now_s() - t0;

    int64_t n_done = 0;
    const char *stop = "length";
    double t1 = now_s();
    int32_t cur_pos = (int32_t)n_prompt;
    for (;;) {
        m40_sample_result r;
        m40_sampler_sample(sampler, logits, &r);
        if (m40_tokenizer_is_eog(tok, r.token)) {
            stop = "end of text";
            break;
        }
        m40_sampler_accept(sampler, r.token);
        size_t n;
        const char *text = m40_detok_push(detok, r.token, &n);
        if (n) {
            fwrite(text, 1, n, stdout);
            fflush(stdout);
        }
        n_done++;
        if (n_done >= n_gen)
            break;
        if (cur_pos >= mp->ctx_train) {
            stop = "context full";
            break;
        }
        int32_t one_slot = 0;
        m40_batch d = {.n = 1, .tokens = &r.token, .pos = &cur_pos, .slot = &one_slot, .want_logits = NULL};
        if (m40_model_forward(m, kv, &d, logits, err, sizeof err)) {
            fprintf(stderr, "\nm40 run: %s\n", err);
            goto done;
        }
        cur_pos++;
    }
    size_t n;
    const char *tail = m40_detok_flush(detok, &n);
    if (n)
        fwrite(tail, 1, n, stdout);
    fputc('\n', stdout);
    fflush(stdout);
    double t_decode = now_s() - t1;

    /* Decode speed counts the forward calls after the prefill (n_done - 1 of them: the
     * first generated token came from the prefill's logits). */
    int64_t n_dec = n_done > 1 ? n_done - 1 : 0;
    fprintf(stderr, "prompt: %lld tokens, %.1f tok/s | generated: %lld tokens, %.1f tok/s (stop: %s)\n",
            (long long)n_prompt, t_prefill > 0 ? n_prompt / t_prefill : 0.0, (long long)n_done,
            n_dec && t_decode > 0 ? n_dec / t_decode : 0.0, stop);
    rc = 0;
done:
    m40_detok_free(detok);
    m40_sampler_free(sampler);
    m40_kv_free(kv);
    free(logits);
    free(ids);
    free(pos);
    free(slot);
    m40_model_free(m);
    return rc;
}
