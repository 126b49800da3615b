/* Teacher-forced comparison of the model with reference outputs (the shared fixtures'
 * ref/<model>.json, see ../shared/models/README.md). Used by `m40 eval` and the unit
 * tests, so the check the tests make is the one users can run.
 *
 * Reference format: a JSON array, one object per prompt:
 *   {"prompt": "...", "prompt_tokens": [...], "steps": [{"token": T, "top": [[id, logprob], ...]}, ...]}
 * Step 0 is the prediction after the whole prompt; step i+1 follows the prompt plus the
 * reference tokens 0..i. */
#ifndef M40_EVAL_H
#define M40_EVAL_H

#include <stddef.h>
#include <stdint.h>

#include "model.h"

#define M40_REF_MAX_TOP 20

typedef struct {
    int32_t token;                        /* the reference's (greedy) token at this step */
    int32_t n_top;
    int32_t top_ids[M40_REF_MAX_TOP];
    double top_logprobs[M40_REF_MAX_TOP];
} m40_ref_step;

typedef struct {
    char *prompt;                         /* NUL-terminated; prompt_len bytes (may hold NULs) */
    size_t prompt_len;
    int32_t *prompt_tokens;
    int32_t n_prompt_tokens;
    m40_ref_step *steps;
    int32_t n_steps;
} m40_ref_prompt;

typedef struct {
    m40_ref_prompt *prompts;
    int32_t n_prompts;
} m40_ref;

/* Parses and validates a reference file. -1 with err naming the file and the entry. */
int m40_ref_load(const char *path, m40_ref **out, char *err, size_t errlen);
void m40_ref_free(m40_ref *r);

typedef struct {
    int tokens_match;          /* our tokenization of the prompt equals prompt_tokens */
    int32_t n_our_tokens;
    int32_t first_token_diff;  /* first differing index, -1 when they match */
    int32_t n_steps;
    double max_abs_delta;      /* max over steps and reference top entries of |ours - ref| */
    int32_t worst_step;
    int32_t argmax_agree;      /* steps where our most likely token is the reference token */
} m40_eval_result;

/* Tokenizes the prompt (BOS when the vocabulary adds one, no special-token parsing) and
 * compares with the reference tokens; then feeds the reference's prompt tokens in one
 * forward call and the reference's step tokens one call each, comparing at every step
 * our log-softmax (temperature 1) for each reference top token. The comparison always
 * runs on the reference's tokens, so a tokenizer difference does not hide a forward
 * difference. 0 with *res filled (judging it is the caller's part), or -1 with err. */
int m40_eval_prompt(m40_model *m, const m40_ref_prompt *p, m40_eval_result *res, char *err, size_t errlen);

#endif
