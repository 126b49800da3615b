/* m40 eval: teacher-forced comparison of the CPU forward pass with reference
 * log-probabilities (ref/<model>.json of the shared fixtures). Exit 0 when every
 * prompt tokenizes identically and every |Δ logprob| is within the tolerance. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "store.h"
#include "model/eval.h"
#include "model/model.h"

static void eval_usage(FILE *f)
{
    fprintf(f, "usage: m40 eval [--tol X] [--threads N] [--device D] [--tp N] [--fast] MODEL REF.json\n"
               "  --tol X      largest allowed |delta logprob| (default 1e-3)\n"
               "  --threads N  CPU threads (default: all)\n"
               "  --device D   cpu (default) or a CUDA device index; the GPU path is expected within 5e-2\n"
               "  --tp N       tensor parallelism over N ranks: GPUs D .. D+N-1 over NCCL, or on the CPU\n"
               "               N simulated ranks (the twin of the GPU's split)\n"
               "  --fast       CPU: measure the fast int16 path (run, bench and serve use it) instead of\n"
               "               the exact F32 reference; set --tol to the fast path's (BENCHMARKS.md)\n");
}

/* The prompt for a one-line report: at most 40 bytes, control bytes escaped. */
static void print_prompt(const char *s, size_t len)
{
    putchar('"');
    for (size_t i = 0; i < len && i < 40; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c == '\n')
            fputs("\\n", stdout);
        else if (c == '"' || c == '\\')
            printf("\\%c", c);
        else if (c < 0x20 || c == 0x7f)
            printf("\\x%02x", c);
        else
            putchar(c);
    }
    fputs(len > 40 ? "...\"" : "\"", stdout);
}

int m40_cmd_eval(int argc, char **argv)
{
    double tol = 1e-3;
    long threads = 0, device = -1, tp = 1;
    int fast = 0;
    const char *paths[2] = {NULL, NULL};
    int n_paths = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        char *end;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            eval_usage(stdout);
            return 0;
        } else if (!strcmp(a, "--tol")) {
            errno = 0;
            tol = i + 1 < argc ? strtod(argv[++i], &end) : -1;
            if (tol < 0 || errno || *end) {
                fprintf(stderr, "m40 eval: --tol needs a non-negative number\n");
                return 2;
            }
        } else if (!strcmp(a, "--threads")) {
            errno = 0;
            threads = i + 1 < argc ? strtol(argv[++i], &end, 10) : -1;
            if (threads < 0 || threads > 1024 || errno || *end) {
                fprintf(stderr, "m40 eval: --threads needs a number of threads\n");
                return 2;
            }
        } else if (!strcmp(a, "--fast")) {
            fast = 1;
        } else if (!strcmp(a, "--tp")) {
            errno = 0;
            tp = i + 1 < argc ? strtol(argv[++i], &end, 10) : -1;
            if (tp < 1 || tp > 64 || errno || *end) {
                fprintf(stderr, "m40 eval: --tp needs a number of ranks (1 to 64)\n");
                return 2;
            }
        } else if (!strcmp(a, "--device")) {
            const char *v = i + 1 < argc ? argv[++i] : "";
            errno = 0;
            device = !strcmp(v, "cpu") ? -1 : strtol(v, &end, 10);
            if (strcmp(v, "cpu") && (!*v || device < -1 || device > 1024 || errno || *end)) {
                fprintf(stderr, "m40 eval: --device must be cpu or a GPU index\n");
                return 2;
            }
        } else if (a[0] == '-' && a[1] != '\0') {
            fprintf(stderr, "m40 eval: unknown option '%s'\n", a);
            eval_usage(stderr);
            return 2;
        } else if (n_paths < 2) {
            paths[n_paths++] = a;
        } else {
            fprintf(stderr, "m40 eval: unexpected argument '%s'\n", a);
            eval_usage(stderr);
            return 2;
        }
    }
    if (n_paths != 2) {
        eval_usage(stderr);
        return 2;
    }

    char err[512];
    m40_ref *ref = NULL;
    if (m40_ref_load(paths[1], &ref, err, sizeof err)) {
        fprintf(stderr, "m40 eval: %s\n", err);
        return 1;
    }
    m40_model *m = NULL;
    m40_model_options mo = {.n_threads = (int)threads, .device = (int)device, .cpu_fast = fast, .tp = (int)tp};
    char stored[PATH_MAX];
    if (m40_model_load_opts(m40_model_arg("eval", paths[0], stored, sizeof stored), &mo, &m, err, sizeof err)) {
        fprintf(stderr, "m40 eval: %s\n", err);
        m40_ref_free(ref);
        return 1;
    }

    double overall = 0;
    int bad_tokens = 0, failed = 0;
    for (int32_t i = 0; i < ref->n_prompts; i++) {
        const m40_ref_prompt *p = &ref->prompts[i];
        m40_eval_result r;
        printf("prompt %d ", (int)i);
        print_prompt(p->prompt, p->prompt_len);
        if (m40_eval_prompt(m, p, &r, err, sizeof err)) {
            printf(": error\n");
            fprintf(stderr, "m40 eval: prompt %d: %s\n", (int)i, err);
            failed = 1;
            continue;
        }
        if (r.tokens_match) {
            printf(": %d tokens match", (int)r.n_our_tokens);
        } else {
            bad_tokens++;
            printf(": TOKENS DIFFER (ours %d, reference %d; first difference at index %d)", (int)r.n_our_tokens,
                   (int)p->n_prompt_tokens, (int)r.first_token_diff);
        }
        printf(", %d steps, max |dlogprob| %.3g (step %d), argmax agrees %d/%d%s\n", (int)r.n_steps,
               r.max_abs_delta, (int)r.worst_step, (int)r.argmax_agree, (int)r.n_steps,
               r.max_abs_delta > tol ? "  FAIL" : "");
        if (!(r.max_abs_delta <= overall))
            overall = r.max_abs_delta;
    }
    int ok = !failed && !bad_tokens && overall <= tol;
    printf("overall: max |dlogprob| %.3g over %d prompts (tolerance %g), tokenization %s: %s\n", overall,
           (int)ref->n_prompts, tol, bad_tokens ? "DIFFERS" : "identical", ok ? "PASS" : "FAIL");
    m40_model_free(m);
    m40_ref_free(ref);
    return ok ? 0 : 1;
}
