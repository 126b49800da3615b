/* Token sampling on the CPU (the reference for the GPU sampler). */
#ifndef M40_SAMPLER_H
#define M40_SAMPLER_H

#include <stddef.h>
#include <stdint.h>

typedef struct {
    float temperature;      /* 0: greedy */
    int32_t top_k;          /* <= 0: off */
    float top_p;            /* 1: off */
    float min_p;            /* 0: off */
    float repetition_penalty; /* 1: off (divides positive logits, multiplies negative) */
    float presence_penalty;   /* 0: off */
    float frequency_penalty;  /* 0: off */
    int32_t penalty_last_n;   /* window of recent tokens for penalties; <0: all */
    uint64_t seed;
    int32_t n_logit_bias;
    const int32_t *logit_bias_ids;
    const float *logit_bias_values;
    int32_t n_top_logprobs;   /* 0..20: how many top alternatives to report */
    int32_t skip_logprob;     /* 1: the chosen token's logprob is not wanted (reported as NaN;
                               * saves a pass of exp() over the vocabulary per token) */
} m40_sampler_params;

void m40_sampler_params_default(m40_sampler_params *p);

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

#endif
