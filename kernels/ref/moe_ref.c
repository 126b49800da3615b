/* CPU twins of the mixture-of-experts kernels (kernels.h 10, kernels/moe.cu and the
 * grouped product of gemm_q.cu): the definitions the GPU results are compared with. */
#include <math.h>
#include <stdlib.h>

#include "cpu_ref.h"
#include "ggml_types.h"
#include "quant.h"

float m40_ref_moe_act(int act, float g, float u)
{
    if (act == M40K_GLU_SWIGLU_OAI) {
        const float gc = fminf(g, M40K_OAI_LIMIT), uc = fminf(fmaxf(u, -M40K_OAI_LIMIT), M40K_OAI_LIMIT);
        return gc / (1.0f + expf(-M40K_OAI_ALPHA * gc)) * (uc + 1.0f);
    }
    return g / (1.0f + expf(-g)) * u;
}

void m40_ref_moe_router_logits(const float *wr, const float *bias, int n_expert, int dim, const float *x,
                               int64_t x_stride, int n_tokens, float *logits)
{
    for (int t = 0; t < n_tokens; t++)
        for (int e = 0; e < n_expert; e++) {
            double s = 0.0;
            for (int i = 0; i < dim; i++)
                s += (double)wr[(size_t)e * dim + i] * x[(size_t)t * x_stride + i];
            logits[(size_t)t * n_expert + e] = (float)s + (bias ? bias[e] : 0.0f);
        }
}

/* Larger score first, then the lower id; NaN counts as -inf. */
static int better(float a, int ia, float b, int ib)
{
    return a > b || (a == b && ia < ib);
}

void m40_ref_moe_topk(const float *logits, int n_tokens, int n_expert, int k, int gating, const float *sel_bias,
                      int norm, float scale, int32_t *ids, float *weights)
{
    float *val = malloc((size_t)n_expert * sizeof *val), *sc = malloc((size_t)n_expert * sizeof *sc);
    char *taken = malloc((size_t)n_expert);
    if (!val || !sc || !taken)
        abort();
    for (int t = 0; t < n_tokens; t++) {
        const float *lg = logits + (size_t)t * n_expert;
        float mx = -INFINITY;
        for (int e = 0; e < n_expert; e++) {
            float l = lg[e] != lg[e] ? -INFINITY : lg[e];
            val[e] = sc[e] = l;
            if (gating == M40K_MOE_SIGMOID) {
                val[e] = 1.0f / (1.0f + expf(-l));
                sc[e] = val[e] + (sel_bias ? sel_bias[e] : 0.0f);
                if (sc[e] != sc[e])
                    sc[e] = -INFINITY;
            }
            mx = fmaxf(mx, l);
            taken[e] = 0;
        }
        float w[8], sum = 0.0f;
        for (int j = 0; j < k; j++) {
            int bi = -1;
            for (int e = 0; e < n_expert; e++)
                if (!taken[e] && (bi < 0 || better(sc[e], e, sc[bi], bi)))
                    bi = e;
            taken[bi] = 1;
            ids[(size_t)t * k + j] = bi;
            w[j] = val[bi];
        }
        if (gating == M40K_MOE_SOFTMAX) {
            double den = 0.0;
            for (int e = 0; e < n_expert; e++)
                den += expf(val[e] == mx ? 0.0f : val[e] - mx); /* all -inf: equal weights */
            for (int j = 0; j < k; j++)
                w[j] = expf(w[j] == mx ? 0.0f : w[j] - mx) / (float)den;
        } else if (gating == M40K_MOE_SOFTMAX_TOPK) {
            const float m0 = w[0];
            double den = 0.0;
            for (int j = 0; j < k; j++)
                den += (w[j] = expf(w[j] == m0 ? 0.0f : w[j] - m0));
            for (int j = 0; j < k; j++)
                w[j] /= (float)den;
        }
        for (int j = 0; j < k; j++)
            sum += w[j];
        for (int j = 0; j < k; j++)
            weights[(size_t)t * k + j] = (norm && sum > 0.0f ? w[j] / sum : w[j]) * scale;
    }
    free(val), free(sc), free(taken);
}

static size_t row_bytes(int type, int n)
{
    const m40_type_info *ti = m40_type_get((uint32_t)type);
    return (size_t)n / ti->block_elems * ti->block_bytes;
}

void m40_ref_moe_gate_up(const void *w_gate, const void *w_up, int w_type, int n_expert, int n_ff, int dim,
                         const float *gate_b, const float *up_b, int act, const float *x, int64_t x_stride,
                         const int32_t *ids, int n_tokens, int k, float *h, int64_t h_stride)
{
    const size_t rb = row_bytes(w_type, dim);
    for (int p = 0; p < n_tokens * k; p++) {
        const int e = ids[p];
        const float *xt = x + (size_t)(p / k) * x_stride;
        for (int n = 0; n < n_ff; n++) {
            float *o = h + (size_t)p * h_stride + n;
            if (e < 0 || e >= n_expert) {
                *o = 0.0f;
                continue;
            }
            const size_t ro = ((size_t)e * n_ff + n) * rb, bi = (size_t)e * n_ff + n;
            const float g = m40_dot_row((uint32_t)w_type, (const uint8_t *)w_gate + ro, xt, dim);
            const float u = m40_dot_row((uint32_t)w_type, (const uint8_t *)w_up + ro, xt, dim);
            *o = m40_ref_moe_act(act, g + (gate_b ? gate_b[bi] : 0.0f), u + (up_b ? up_b[bi] : 0.0f));
        }
    }
}

void m40_ref_moe_down(const void *w_down, int w_type, int n_expert, int dim, int n_ff, const float *down_b,
                      const float *h, int64_t h_stride, const int32_t *ids, const float *weights, int n_tokens, int k,
                      float *out, int64_t out_stride, int accumulate)
{
    const size_t rb = row_bytes(w_type, n_ff);
    for (int t = 0; t < n_tokens; t++)
        for (int n = 0; n < dim; n++) {
            float s = 0.0f;
            for (int j = 0; j < k; j++) {
                const int p = t * k + j, e = ids[p];
                if (e < 0 || e >= n_expert)
                    continue;
                const float d = m40_dot_row((uint32_t)w_type, (const uint8_t *)w_down + ((size_t)e * dim + n) * rb,
                                            h + (size_t)p * h_stride, n_ff);
                s += weights[p] * (d + (down_b ? down_b[(size_t)e * dim + n] : 0.0f));
            }
            float *o = out + (size_t)t * out_stride + n;
            *o = accumulate ? *o + s : s;
        }
}

void m40_ref_moe_group(const int32_t *ids, int n_pairs, int n_expert, int bm, int32_t *counts, int32_t *offsets,
                       int32_t *perm, int32_t *inv, int32_t *tiles)
{
    const int max_tiles = m40k_moe_max_tiles(n_pairs, n_expert, bm);
    for (int e = 0; e < n_expert; e++)
        counts[e] = 0;
    for (int p = 0; p < n_pairs; p++)
        if (ids[p] >= 0 && ids[p] < n_expert)
            counts[ids[p]]++;
    int o = 0, ti = 0;
    for (int e = 0; e < n_expert; e++) {
        offsets[e] = o;
        for (int m0 = 0; m0 < counts[e]; m0 += bm, ti++)
            tiles[2 * ti] = e, tiles[2 * ti + 1] = m0;
        o += counts[e];
    }
    offsets[n_expert] = o;
    for (; ti < max_tiles; ti++)
        tiles[2 * ti] = -1, tiles[2 * ti + 1] = 0;
    /* stable: within an expert, in pair order */
    int pos = 0;
    for (int e = 0; e < n_expert; e++)
        for (int p = 0; p < n_pairs; p++)
            if (ids[p] == e)
                perm[pos] = p, inv[p] = pos++;
    for (int p = 0; p < n_pairs; p++)
        if (ids[p] < 0 || ids[p] >= n_expert)
            inv[p] = -1;
    for (; pos < n_pairs; pos++)
        perm[pos] = -1;
}

void m40_ref_moe_gather_f16(const float *x, int64_t x_stride, int dim, const int32_t *perm, int n_pairs, int k,
                            uint16_t *out16, int64_t out_stride)
{
    for (int i = 0; i < n_pairs; i++)
        for (int c = 0; c < dim; c++)
            out16[(size_t)i * out_stride + c] =
                perm[i] >= 0 ? m40_fp32_to_fp16(x[(size_t)(perm[i] / k) * x_stride + c]) : 0;
}

void m40_ref_moe_gemm_q(const void *w, int w_type, int n_expert, int N, int K, const uint16_t *x, int64_t x_stride,
                        const int32_t *offsets, float *y, int64_t ldy)
{
    const size_t eb = row_bytes(w_type, K) * (size_t)N;
    for (int e = 0; e < n_expert; e++) {
        const int m = offsets[e + 1] - offsets[e];
        if (m > 0)
            m40_ref_gemm_q((const uint8_t *)w + (size_t)e * eb, w_type, N, K, x + (size_t)offsets[e] * x_stride,
                           x_stride, m, y + (size_t)offsets[e] * ldy, ldy);
    }
}

void m40_ref_moe_glu_sorted(int act, const float *gate, const float *up, int64_t in_stride, const float *gate_b,
                            const float *up_b, const int32_t *ids, const int32_t *perm, int n_pairs, int n_ff,
                            uint16_t *out16, int64_t out_stride)
{
    for (int i = 0; i < n_pairs; i++) {
        if (perm[i] < 0)
            continue;
        const int e = ids[perm[i]];
        for (int n = 0; n < n_ff; n++) {
            const size_t bi = (size_t)e * n_ff + n;
            out16[(size_t)i * out_stride + n] = m40_fp32_to_fp16(
                m40_ref_moe_act(act, gate[(size_t)i * in_stride + n] + (gate_b ? gate_b[bi] : 0.0f),
                                up[(size_t)i * in_stride + n] + (up_b ? up_b[bi] : 0.0f)));
        }
    }
}

void m40_ref_moe_combine(const float *y, int64_t ldy, const int32_t *inv, const int32_t *ids, const float *weights,
                         const float *down_b, int n_expert, int n_tokens, int k, int dim, float *out,
                         int64_t out_stride, int accumulate)
{
    for (int t = 0; t < n_tokens; t++)
        for (int n = 0; n < dim; n++) {
            float s = 0.0f;
            for (int j = 0; j < k; j++) {
                const int pos = inv[t * k + j];
                if (pos < 0)
                    continue;
                const int e = ids[t * k + j];
                s += weights[t * k + j] * (y[(size_t)pos * ldy + n] + (down_b ? down_b[(size_t)e * dim + n] : 0.0f));
            }
            float *o = out + (size_t)t * out_stride + n;
            *o = accumulate ? *o + s : s;
        }
}
