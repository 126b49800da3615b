/* The feed-forward blocks of the CPU forward pass: see ffn.h. */
#include "ffn.h"

#include <math.h>
#include <string.h>

#include "cpu_dot.h"
#include "model_priv.h"
#include "util/threadpool.h"

float m40_swiglu_oai(float gate, float up)
{
    /* fminf/fmaxf would turn a NaN into the limit; a NaN stays a NaN here, as in the
     * reference (a comparison with NaN is false). */
    float g = gate > M40_SWIGLU_OAI_LIMIT ? M40_SWIGLU_OAI_LIMIT : gate;
    const float lim = M40_SWIGLU_OAI_LIMIT;
    float u = up > lim ? lim : up < -lim ? -lim : up;
    return g / (1.0f + expf(-M40_SWIGLU_OAI_ALPHA * g)) * (u + 1.0f);
}

/* SiLU and GELU's tanh form (Gemma's hidden_activation gelu_pytorch_tanh): the portable
 * kernels of cpu_dot.c, one formula each for every path's reference. */
void m40_glu(m40_activation act, float *gate, const float *up, size_t n)
{
    if (act == M40_ACT_SWIGLU_OAI) {
        for (size_t i = 0; i < n; i++)
            gate[i] = m40_swiglu_oai(gate[i], up[i]);
        return;
    }
    m40_glu_kernel(act == M40_ACT_GELU_TANH ? M40_GLU_GELU_TANH : M40_GLU_SILU, M40_ISA_PORTABLE)(gate, up,
                                                                                                (int64_t)n);
}

typedef struct {
    m40_glu_fn fn; /* the fast path's SIMD kernel, or NULL: m40_glu */
    m40_activation act;
    float *gate;
    const float *up;
    size_t n, per;
} glu_job;

static void glu_task(void *ctx, int task, int thread)
{
    (void)thread;
    const glu_job *j = ctx;
    const size_t a = (size_t)task * j->per, b = a + j->per < j->n ? a + j->per : j->n;
    if (a >= b)
        return;
    if (j->fn)
        j->fn(j->gate + a, j->up + a, (int64_t)(b - a));
    else
        m40_glu(j->act, j->gate + a, j->up + a, b - a);
}

void m40_model_glu(m40_model *m, float *gate, const float *up, size_t n)
{
    const int act = m->act == M40_ACT_SILU ? M40_GLU_SILU : m->act == M40_ACT_GELU_TANH ? M40_GLU_GELU_TANH : -1;
    glu_job j = {.fn = m->fast && act >= 0 ? m40_glu_kernel(act, m40_cpu_isa()) : NULL,
                 .act = m->act, .gate = gate, .up = up, .n = n};
    /* elementwise: however it is split, each element is the same bits */
    const int tasks = m->n_threads > 1 && n >= 8192 ? m->n_threads : 1;
    j.per = ((n + (size_t)tasks - 1) / (size_t)tasks + 7) / 8 * 8;
    if (tasks == 1)
        glu_task(&j, 0, 0);
    else
        m40_threadpool_run(m->pool, tasks, glu_task, &j);
}

void m40_moe_route(const float *logits, int32_t n_experts, int32_t k, m40_gating gating, int norm, float scale,
                   int32_t *ids, float *w)
{
    float score[M40_MOE_MAX_EXPERTS];
    uint64_t taken[M40_MOE_MAX_EXPERTS / 64] = {0};
    if (gating == M40_GATING_SOFTMAX) {
        float max = -INFINITY;
        for (int32_t e = 0; e < n_experts; e++)
            if (logits[e] > max)
                max = logits[e];
        double sum = 0;
        for (int32_t e = 0; e < n_experts; e++)
            sum += score[e] = expf(logits[e] - max);
        float inv = (float)(1.0 / sum);
        for (int32_t e = 0; e < n_experts; e++)
            score[e] *= inv;
    } else if (gating == M40_GATING_SIGMOID) {
        for (int32_t e = 0; e < n_experts; e++)
            score[e] = 1.0f / (1.0f + expf(-logits[e]));
    } else {
        memcpy(score, logits, (size_t)n_experts * sizeof *score);
    }
    /* k passes of a strict "greater than": the first of equal scores wins, and a NaN
     * is taken only when nothing else is left. k <= 64 and n_experts <= 512 keep this
     * cheaper than sorting. */
    for (int32_t j = 0; j < k; j++) {
        int32_t best = -1;
        for (int32_t e = 0; e < n_experts; e++) {
            if (taken[e / 64] >> (e % 64) & 1)
                continue;
            if (best < 0 || (!isnan(score[e]) && (isnan(score[best]) || score[e] > score[best])))
                best = e;
        }
        taken[best / 64] |= 1ull << (best % 64);
        ids[j] = best;
        w[j] = score[best];
    }
    if (gating == M40_GATING_SOFTMAX_SELECTED) {
        /* ids[0] holds the largest logit */
        double sum = 0;
        for (int32_t j = 0; j < k; j++)
            sum += w[j] = expf(score[ids[j]] - score[ids[0]]);
        float inv = (float)(1.0 / sum);
        for (int32_t j = 0; j < k; j++)
            w[j] *= inv;
    }
    if (norm) {
        float sum = 0;
        for (int32_t j = 0; j < k; j++)
            sum += w[j];
        if (!(sum >= 6.103515625e-5f))
            sum = 6.103515625e-5f;
        for (int32_t j = 0; j < k; j++)
            w[j] /= sum;
    }
    if (scale != 1.0f)
        for (int32_t j = 0; j < k; j++)
            w[j] *= scale;
}

/* Rows [first, first + rows) of a stacked weight: one expert's matrix. */
static m40_matrix expert_rows(const m40_matrix *w, int64_t first, int64_t rows)
{
    m40_matrix r = *w;
    r.data = w->data + (size_t)first * w->row_bytes;
    r.rows = rows;
    r.ragged4 = r.rows % 4 != 0 || r.cols % 4 != 0; /* each expert is a product of its own */
    return r;
}

void m40_moe_ffn(m40_model *m, int32_t layer_index, int32_t n)
{
    const m40_layer *L = &m->layers[layer_index];
    const m40_model_params *p = &m->p;
    int32_t E = p->n_experts, K = p->n_experts_used;
    size_t D = (size_t)p->dim, F = (size_t)p->expert_ffn_dim;
    float *x = m->xb;

    m40_model_matmul(m, &L->router, x, n, m->moe_logits, L->router_b);
    for (int32_t t = 0; t < n; t++)
        m40_moe_route(m->moe_logits + (size_t)t * E, E, K, m->gating, m->norm_topk, m->expert_scale,
                      m->moe_ids + (size_t)t * K, m->moe_w + (size_t)t * K);

    for (int32_t e = 0; e < E; e++) {
        /* the (token, choice) rows this expert serves; a token picks an expert once */
        int32_t cnt = 0;
        for (int32_t r = 0; r < n * K; r++)
            if (m->moe_ids[r] == e)
                m->moe_rows[cnt++] = r;
        if (!cnt)
            continue;
        for (int32_t c = 0; c < cnt; c++)
            memcpy(m->moe_in + (size_t)c * D, x + (size_t)(m->moe_rows[c] / K) * D, D * sizeof *x);
        m40_matrix gate = expert_rows(&L->exp_gate, (int64_t)e * (int64_t)F, (int64_t)F);
        m40_matrix up = expert_rows(&L->exp_up, (int64_t)e * (int64_t)F, (int64_t)F);
        m40_matrix down = expert_rows(&L->exp_down, (int64_t)e * (int64_t)D, (int64_t)D);
        m40_model_matmul(m, &gate, m->moe_in, cnt, m->hb, L->exp_gate_b ? L->exp_gate_b + (size_t)e * F : NULL);
        m40_model_matmul(m, &up, m->moe_in, cnt, m->hb2, L->exp_up_b ? L->exp_up_b + (size_t)e * F : NULL);
        m40_model_glu(m, m->hb, m->hb2, (size_t)cnt * F);
        m40_model_matmul(m, &down, m->hb, cnt, m->moe_in, L->exp_down_b ? L->exp_down_b + (size_t)e * D : NULL);
        for (int32_t c = 0; c < cnt; c++) {
            int32_t r = m->moe_rows[c];
            const float *y = m->moe_in + (size_t)c * D;
            float *o = m->moe_out + (size_t)r * D, wr = m->moe_w[r];
            for (size_t d = 0; d < D; d++)
                o[d] = y[d] * wr;
        }
    }

    /* The shared expert reads x before it is overwritten: its output goes to moe_in. */
    const float *shared = NULL;
    if (L->sh_gate.data) {
        size_t S = (size_t)p->shared_ffn_dim;
        m40_model_matmul(m, &L->sh_gate, x, n, m->hb, NULL);
        m40_model_matmul(m, &L->sh_up, x, n, m->hb2, NULL);
        m40_model_glu(m, m->hb, m->hb2, (size_t)n * S);
        m40_model_matmul(m, &L->sh_down, m->hb, n, m->moe_in, NULL);
        if (L->sh_gate_inp)
            for (int32_t t = 0; t < n; t++) {
                float g = 0;
                for (size_t d = 0; d < D; d++)
                    g += L->sh_gate_inp[d] * x[(size_t)t * D + d];
                g = 1.0f / (1.0f + expf(-g));
                for (size_t d = 0; d < D; d++)
                    m->moe_in[(size_t)t * D + d] *= g;
            }
        shared = m->moe_in;
    }
    for (int32_t t = 0; t < n; t++) {
        float *o = x + (size_t)t * D;
        memcpy(o, m->moe_out + (size_t)t * K * D, D * sizeof *o);
        for (int32_t j = 1; j < K; j++) {
            const float *y = m->moe_out + ((size_t)t * K + (size_t)j) * D;
            for (size_t d = 0; d < D; d++)
                o[d] += y[d];
        }
        if (shared)
            for (size_t d = 0; d < D; d++)
                o[d] += shared[(size_t)t * D + d];
    }
}
