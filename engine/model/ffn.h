/* The feed-forward blocks of the CPU forward pass (ffn.c): the gated activations, the
 * mixture of experts' router, and the mixture of experts itself. The router and the
 * activations are plain functions of their inputs (the unit tests and the GPU kernels'
 * twins check against them); m40_moe_ffn runs one layer's experts on the model's
 * scratch. Not public API. */
#ifndef M40_FFN_H
#define M40_FFN_H

#include <stddef.h>
#include <stdint.h>

#include "arch.h"

/* The largest expert count m40_moe_route takes (load_moe in model_load.c refuses more). */
#define M40_MOE_MAX_EXPERTS 512

#define M40_SWIGLU_OAI_ALPHA 1.702f
#define M40_SWIGLU_OAI_LIMIT 7.0f

/* gpt-oss's gated unit: the gate clamped above at 7, the linear input to [-7, 7],
 * g * sigmoid(1.702 g) * (u + 1). */
float m40_swiglu_oai(float gate, float up);

/* gate[i] = act(gate[i], up[i]) for the n elements: silu(g) * u, gelu_tanh(g) * u, or
 * m40_swiglu_oai(g, u). */
void m40_glu(m40_activation act, float *gate, const float *up, size_t n);
/* m40_glu with m's activation over m's thread pool, and on the fast path through the
 * widest SIMD kernel of cpu_dot.h (m40_glu_kernel); the exact path keeps m40_glu's
 * formulas, split over the threads (elementwise: the same bits). */
struct m40_model;
void m40_model_glu(struct m40_model *m, float *gate, const float *up, size_t n);

/* One token's routing: from its n_experts router logits (bias included), the k experts
 * it uses (ids, best first; equal scores: the lower expert id first; NaN scores last)
 * and their weights w, as the gating says (arch.h m40_gating): softmax or sigmoid
 * scores and the k largest of them, or the k largest logits and a softmax over those k.
 * norm: the weights are divided by their sum (at least 2^-14, as ggml clamps it); then
 * multiplied by scale. 1 <= k <= n_experts <= M40_MOE_MAX_EXPERTS. */
void m40_moe_route(const float *logits, int32_t n_experts, int32_t k, m40_gating gating, int norm, float scale,
                   int32_t *ids, float *w);

/* The layer's mixture of experts on the n normed token vectors in m->xb, replaced by
 * its output: each expert runs once on the tokens routed to it (every weight row read
 * once per call, as the dense matmuls do), and each token sums its experts' outputs in
 * routing order, weighted, plus the shared expert where the layer has one. A token's
 * result does not depend on the rest of the batch. */
struct m40_model;
void m40_moe_ffn(struct m40_model *m, int32_t layer_index, int32_t n);

#endif
