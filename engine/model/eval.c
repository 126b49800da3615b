/* Reference files and the teacher-forced comparison (see eval.h). */
#include "eval.h"

#include <jansson.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model_internal.h"

static int token_id(const json_t *j, int32_t *out)
{
    if (!json_is_integer(j) || json_integer_value(j) < 0 || json_integer_value(j) > INT32_MAX)
        return -1;
    *out = (int32_t)json_integer_value(j);
    return 0;
}

static int parse_prompt(const json_t *e, m40_ref_prompt *p, char *err, size_t errlen)
{
    const json_t *prompt = json_object_get(e, "prompt");
    const json_t *toks = json_object_get(e, "prompt_tokens");
    const json_t *steps = json_object_get(e, "steps");
    if (!json_is_string(prompt) || !json_is_array(toks) || !json_is_array(steps)) {
        m40_set_err(err, errlen, "needs \"prompt\" (string), \"prompt_tokens\" and \"steps\" (arrays)");
        return -1;
    }
    p->prompt_len = json_string_length(prompt);
    p->prompt = malloc(p->prompt_len + 1);
    p->n_prompt_tokens = (int32_t)json_array_size(toks);
    p->prompt_tokens = malloc((json_array_size(toks) + 1) * sizeof *p->prompt_tokens);
    p->n_steps = (int32_t)json_array_size(steps);
    p->steps = calloc(json_array_size(steps) + 1, sizeof *p->steps);
    if (!p->prompt || !p->prompt_tokens || !p->steps) {
        m40_set_err(err, errlen, "out of memory");
        return -1;
    }
    memcpy(p->prompt, json_string_value(prompt), p->prompt_len + 1);
    if (p->n_prompt_tokens == 0) {
        m40_set_err(err, errlen, "prompt_tokens is empty");
        return -1;
    }
    for (int32_t i = 0; i < p->n_prompt_tokens; i++)
        if (token_id(json_array_get(toks, (size_t)i), &p->prompt_tokens[i])) {
            m40_set_err(err, errlen, "prompt_tokens[%d] is not a token id", (int)i);
            return -1;
        }
    for (int32_t s = 0; s < p->n_steps; s++) {
        const json_t *st = json_array_get(steps, (size_t)s);
        const json_t *top = json_object_get(st, "top");
        m40_ref_step *rs = &p->steps[s];
        if (token_id(json_object_get(st, "token"), &rs->token) || !json_is_array(top) ||
            json_array_size(top) > M40_REF_MAX_TOP) {
            m40_set_err(err, errlen, "steps[%d] needs \"token\" (id) and \"top\" (at most %d pairs)", (int)s,
                    M40_REF_MAX_TOP);
            return -1;
        }
        rs->n_top = (int32_t)json_array_size(top);
        for (int32_t k = 0; k < rs->n_top; k++) {
            const json_t *pair = json_array_get(top, (size_t)k);
            if (!json_is_array(pair) || json_array_size(pair) != 2 ||
                token_id(json_array_get(pair, 0), &rs->top_ids[k]) || !json_is_number(json_array_get(pair, 1))) {
                m40_set_err(err, errlen, "steps[%d].top[%d] is not [token, logprob]", (int)s, (int)k);
                return -1;
            }
            rs->top_logprobs[k] = json_number_value(json_array_get(pair, 1));
        }
    }
    return 0;
}

int m40_ref_load(const char *path, m40_ref **out, char *err, size_t errlen)
{
    *out = NULL;
    json_error_t jerr;
    json_t *root = json_load_file(path, 0, &jerr);
    if (!root) {
        m40_set_err(err, errlen, "%s: %s (line %d)", path, jerr.text, jerr.line);
        return -1;
    }
    if (!json_is_array(root) || json_array_size(root) == 0) {
        m40_set_err(err, errlen, "%s: expected a non-empty JSON array of prompts", path);
        json_decref(root);
        return -1;
    }
    m40_ref *r = calloc(1, sizeof *r);
    if (r)
        r->prompts = calloc(json_array_size(root), sizeof *r->prompts);
    if (!r || !r->prompts) {
        m40_set_err(err, errlen, "out of memory");
        free(r);
        json_decref(root);
        return -1;
    }
    for (size_t i = 0; i < json_array_size(root); i++) {
        char sub[256];
        r->n_prompts++; /* counted first so that m40_ref_free releases a half-parsed entry */
        if (parse_prompt(json_array_get(root, i), &r->prompts[i], sub, sizeof sub)) {
            m40_set_err(err, errlen, "%s: entry %zu: %s", path, i, sub);
            m40_ref_free(r);
            json_decref(root);
            return -1;
        }
    }
    json_decref(root);
    *out = r;
    return 0;
}

void m40_ref_free(m40_ref *r)
{
    if (!r)
        return;
    for (int32_t i = 0; i < r->n_prompts; i++) {
        free(r->prompts[i].prompt);
        free(r->prompts[i].prompt_tokens);
        free(r->prompts[i].steps);
    }
    free(r->prompts);
    free(r);
}

/* Compares one step's logits with the reference, updating res. */
static void compare_step(const float *logits, int32_t n_vocab, const m40_ref_step *st, int32_t step,
                         m40_eval_result *res)
{
    int32_t best = 0;
    for (int32_t i = 1; i < n_vocab; i++)
        if (logits[i] > logits[best])
            best = i;
    double sum = 0;
    for (int32_t i = 0; i < n_vocab; i++)
        sum += exp((double)logits[i] - logits[best]);
    double log_z = logits[best] + log(sum);
    for (int32_t k = 0; k < st->n_top; k++) {
        double d = st->top_ids[k] < n_vocab ? fabs((logits[st->top_ids[k]] - log_z) - st->top_logprobs[k]) : INFINITY;
        if (!(d <= res->max_abs_delta)) { /* also catches NaN */
            res->max_abs_delta = isnan(d) ? INFINITY : d;
            res->worst_step = step;
        }
    }
    if (best == st->token)
        res->argmax_agree++;
}

int m40_eval_prompt(m40_model *m, const m40_ref_prompt *p, m40_eval_result *res, char *err, size_t errlen)
{
    memset(res, 0, sizeof *res);
    res->first_token_diff = -1;
    res->worst_step = -1;
    const m40_tokenizer *tok = m40_model_tokenizer(m);
    int32_t n_vocab = m40_model_get_params(m)->n_vocab;
    int32_t np = p->n_prompt_tokens;
    int rc = -1;
    int32_t *ours = NULL, *tokens = NULL, *pos = NULL, *slot = NULL;
    float *logits = NULL;
    m40_kv *kv = NULL;

    /* Tokenization check: a buffer larger than the reference's, retried if short. */
    int64_t cap = (int64_t)p->prompt_len + np + 16, got;
    for (;;) {
        free(ours);
        ours = malloc((size_t)cap * sizeof *ours);
        if (!ours) {
            m40_set_err(err, errlen, "out of memory");
            goto done;
        }
        got = m40_tokenize(tok, p->prompt, p->prompt_len, m40_tokenizer_add_bos(tok), 0, ours, cap, err, errlen);
        if (got < 0)
            goto done;
        if (got <= cap)
            break;
        cap = got;
    }
    res->n_our_tokens = (int32_t)got;
    for (int32_t i = 0; i < np || i < got; i++)
        if (i >= np || i >= got || ours[i] != p->prompt_tokens[i]) {
            res->first_token_diff = i;
            break;
        }
    res->tokens_match = res->first_token_diff < 0;

    /* Teacher forcing on the reference's tokens. */
    int32_t n_ctx = np + (p->n_steps > 0 ? p->n_steps : 1);
    kv = m40_kv_new(m, 1, n_ctx);
    tokens = malloc((size_t)np * sizeof *tokens);
    pos = malloc((size_t)np * sizeof *pos);
    slot = calloc((size_t)np, sizeof *slot);
    logits = malloc((size_t)n_vocab * sizeof *logits);
    if (!kv || !tokens || !pos || !slot || !logits) {
        m40_set_err(err, errlen, "out of memory (KV cache for %d tokens)", (int)n_ctx);
        goto done;
    }
    for (int32_t i = 0; i < np; i++) {
        tokens[i] = p->prompt_tokens[i];
        pos[i] = i;
    }
    m40_batch b = {.n = np, .tokens = tokens, .pos = pos, .slot = slot, .want_logits = NULL};
    for (int32_t s = 0; s < p->n_steps; s++) {
        if (s > 0) { /* one token per call: the decode path */
            tokens[0] = p->steps[s - 1].token;
            pos[0] = np + s - 1;
            b.n = 1;
        }
        if (m40_model_forward(m, kv, &b, logits, err, errlen))
            goto done;
        compare_step(logits, n_vocab, &p->steps[s], s, res);
        res->n_steps++;
    }
    rc = 0;
done:
    free(ours);
    free(tokens);
    free(pos);
    free(slot);
    free(logits);
    m40_kv_free(kv);
    return rc;
}
