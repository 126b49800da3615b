/* Token sampling on the CPU (the reference for the GPU sampler). */
#ifndef M40_SAMPLER_H
#define M40_SAMPLER_H

#include <stddef.h>
#include <stdint.h>

#include "m40_engine.h" /* m40_sampler_params: the request's sampling fields are public API */

typedef struct m40_sampler m40_sampler;

typedef struct {
    int32_t token;
    float logprob;            /* of the chosen token: log-softmax at temperature 1 of the logits after
                               * logit_bias and penalties, before temperature and truncation (the
                               * model's distribution as the request shaped it, not the sampling one) */
    int32_t n_top;
    int32_t top_ids[20];
    float top_logprobs[20];
} m40_sample_result;

/* Copies p (logit bias arrays included). NULL when out of memory. */
m40_sampler *m40_sampler_new(const m40_sampler_params *p, int32_t n_vocab);
void m40_sampler_free(m40_sampler *s);
/* Remember a token (prompt or generated) for the penalties. */
void m40_sampler_accept(m40_sampler *s, int32_t token);
/* Sample from logits[n_vocab] (modified in place: logit_bias and penalties are applied
 * to it). Order: logit_bias -> penalties -> [logprobs taken here] -> temperature ->
 * top-k -> top-p -> min-p -> draw. Temperature 0 (or top_k 1) is greedy: the argmax,
 * lowest id on ties, and no random number is drawn. Same seed and same inputs give the
 * same token sequence. Does not accept the token: call m40_sampler_accept for it. */
void m40_sampler_sample(m40_sampler *s, float *logits, m40_sample_result *out);
/* m40_sampler_sample would take the plain argmax of the row as it is (greedy, no logit
 * bias, no penalties, no logprobs wanted): a caller may pick the token its own way (the
 * grammar's masked argmax) and report logprob NaN, no alternatives. */
int m40_sampler_plain_greedy(const m40_sampler *s);

#endif
