/* CPU twins of kernels/ (see cpu_ref.h). Each loop is the definition of the kernel's
 * result: F32 accumulation, F16 storage rounded to nearest even. */
#include "cpu_ref.h"

#include <math.h>
#include <string.h>

#include "ggml_types.h"
#include "quant.h"

static void store_out(void *out, int out_type, int64_t i, float v)
{
    if (out_type == M40K_TYPE_F16)
        ((uint16_t *)out)[i] = m40_fp32_to_fp16(v);
    else
        ((float *)out)[i] = v;
}

void m40_ref_embed(const void *table, int table_type, int64_t n_rows, int dim, const int32_t *ids, int n_ids,
                   void *out, int out_type, int64_t out_stride)
{
    const m40_type_info *ti = m40_type_get((uint32_t)table_type);
    size_t row_bytes = (size_t)dim / ti->block_elems * ti->block_bytes;
    float row[dim > 0 ? dim : 1];
    for (int i = 0; i < n_ids; i++) {
        if (ids[i] < 0 || ids[i] >= n_rows)
            memset(row, 0, sizeof row);
        else
            m40_dequantize_row((uint32_t)table_type, (const uint8_t *)table + (size_t)ids[i] * row_bytes, row, dim);
        for (int j = 0; j < dim; j++)
            store_out(out, out_type, (int64_t)i * out_stride + j, row[j]);
    }
}

void m40_ref_rmsnorm(const float *x, int64_t x_stride, const float *w, void *out, int out_type, int64_t out_stride,
                     int rows, int dim, float eps)
{
    for (int r = 0; r < rows; r++) {
        const float *xr = x + r * x_stride;
        double ss = 0;
        for (int i = 0; i < dim; i++)
            ss += (double)xr[i] * xr[i];
        float scale = 1.0f / sqrtf((float)(ss / dim) + eps);
        for (int i = 0; i < dim; i++)
            store_out(out, out_type, r * out_stride + i, xr[i] * scale * w[i]);
    }
}

static void rope_heads(float *x, int64_t stride, int n_heads, int head_dim, int rot_dim, int t, int i, float c,
                       float s, int neox)
{
    int half = rot_dim / 2;
    int a = neox ? i : 2 * i, b = neox ? i + half : 2 * i + 1;
    for (int h = 0; h < n_heads; h++) {
        float *v = x + t * stride + (int64_t)h * head_dim;
        float x0 = v[a], x1 = v[b];
        v[a] = x0 * c - x1 * s;
        v[b] = x0 * s + x1 * c;
    }
}

void m40_ref_rope(float *q, int64_t q_stride, int n_q_heads, float *k, int64_t k_stride, int n_k_heads,
                  int head_dim, int rot_dim, const int32_t *pos, int n_tokens, float base, const float *freq_factors,
                  int neox)
{
    int half = rot_dim / 2;
    for (int t = 0; t < n_tokens; t++)
        for (int i = 0; i < half; i++) {
            double theta = (double)pos[t] * pow((double)base, -2.0 * i / rot_dim);
            if (freq_factors)
                theta /= freq_factors[i];
            float c = (float)cos(theta), s = (float)sin(theta);
            rope_heads(q, q_stride, n_q_heads, head_dim, rot_dim, t, i, c, s, neox);
            if (k)
                rope_heads(k, k_stride, n_k_heads, head_dim, rot_dim, t, i, c, s, neox);
        }
}

float m40_ref_glu_act(int act, float g)
{
    if (act == M40K_GLU_GELU_TANH)
        return 0.5f * g * (1.0f + tanhf(0.7978845608028654f * (g + 0.044715f * g * g * g)));
    return g / (1.0f + expf(-g));
}

void m40_ref_glu(int act, const float *gate, const float *up, int64_t in_stride, float *out, int64_t out_stride,
                 int rows, int n)
{
    for (int r = 0; r < rows; r++)
        for (int i = 0; i < n; i++)
            out[r * out_stride + i] = m40_ref_glu_act(act, gate[r * in_stride + i]) * up[r * in_stride + i];
}

void m40_ref_add(float *out, const float *a, const float *b, int64_t n)
{
    for (int64_t i = 0; i < n; i++)
        out[i] = a[i] + b[i];
}

/* Element d of KV head h at position p of sequence s, in the paged layout. */
static size_t paged_index(const int32_t *indptr, const int32_t *indices, int s, int64_t p, int n_kv_heads,
                          int head_dim, int h, int d)
{
    int64_t blk = indices[indptr[s] + p / M40K_PAGE];
    return (((size_t)blk * n_kv_heads + h) * M40K_PAGE + (size_t)(p % M40K_PAGE)) * head_dim + d;
}

void m40_ref_kv_append(uint16_t *k_cache, uint16_t *v_cache, const float *k, int64_t k_stride, const float *v,
                       int64_t v_stride, const int32_t *new_indptr, int n_seqs, int n_tokens, const int32_t *indptr,
                       const int32_t *indices, const int32_t *last_page_len, int n_kv_heads, int head_dim)
{
    (void)n_tokens;
    for (int s = 0; s < n_seqs; s++) {
        int64_t len = m40_ref_seq_len(indptr, last_page_len, s);
        for (int t = new_indptr[s]; t < new_indptr[s + 1]; t++) {
            int64_t p = len - (new_indptr[s + 1] - t);
            for (int h = 0; h < n_kv_heads; h++)
                for (int d = 0; d < head_dim; d++) {
                    size_t at = paged_index(indptr, indices, s, p, n_kv_heads, head_dim, h, d);
                    k_cache[at] = m40_fp32_to_fp16(k[t * k_stride + h * head_dim + d]);
                    v_cache[at] = m40_fp32_to_fp16(v[t * v_stride + h * head_dim + d]);
                }
        }
    }
}

/* softmax(scale * q.K[0..n_ctx)) . V for one query head, two passes, F32 (scores in
 * double for the sum so the twin is at least as accurate as the kernel). */
static void attend_one(float *o, const float *q, const uint16_t *k_cache, const uint16_t *v_cache,
                       const int32_t *indptr, const int32_t *indices, int s, int64_t n_ctx, int n_kv_heads,
                       int head_dim, int kvh, float scale, float *scores)
{
    float mx = -INFINITY;
    for (int64_t p = 0; p < n_ctx; p++) {
        size_t base = paged_index(indptr, indices, s, p, n_kv_heads, head_dim, kvh, 0);
        float dot = 0;
        for (int d = 0; d < head_dim; d++)
            dot += q[d] * m40_fp16_to_fp32(k_cache[base + d]);
        scores[p] = dot * scale;
        if (scores[p] > mx)
            mx = scores[p];
    }
    double sum = 0;
    for (int64_t p = 0; p < n_ctx; p++) {
        scores[p] = expf(scores[p] - mx);
        sum += scores[p];
    }
    for (int d = 0; d < head_dim; d++)
        o[d] = 0;
    for (int64_t p = 0; p < n_ctx; p++) {
        size_t base = paged_index(indptr, indices, s, p, n_kv_heads, head_dim, kvh, 0);
        for (int d = 0; d < head_dim; d++)
            o[d] += scores[p] * m40_fp16_to_fp32(v_cache[base + d]);
    }
    for (int d = 0; d < head_dim; d++)
        o[d] = n_ctx > 0 ? (float)(o[d] / sum) : 0.0f;
}

void m40_ref_attn_decode(float *out, int64_t out_stride, const float *q, int64_t q_stride, const uint16_t *k_cache,
                         const uint16_t *v_cache, const int32_t *indptr, const int32_t *indices,
                         const int32_t *last_page_len, int n_seqs, int n_heads, int n_kv_heads, int head_dim,
                         float scale)
{
    int group = n_heads / n_kv_heads;
    for (int s = 0; s < n_seqs; s++) {
        int64_t len = m40_ref_seq_len(indptr, last_page_len, s);
        float scores[len > 0 ? len : 1];
        for (int h = 0; h < n_heads; h++)
            attend_one(out + s * out_stride + (int64_t)h * head_dim, q + s * q_stride + (int64_t)h * head_dim, k_cache,
                       v_cache, indptr, indices, s, len, n_kv_heads, head_dim, h / group, scale, scores);
    }
}

void m40_ref_attn_prefill(float *out, int64_t out_stride, const float *q, int64_t q_stride, const int32_t *q_indptr,
                          int n_seqs, int n_rows, const uint16_t *k_cache, const uint16_t *v_cache,
                          const int32_t *indptr, const int32_t *indices, const int32_t *last_page_len, int n_heads,
                          int n_kv_heads, int head_dim, float scale)
{
    (void)n_rows;
    int group = n_heads / n_kv_heads;
    for (int s = 0; s < n_seqs; s++) {
        int64_t len = m40_ref_seq_len(indptr, last_page_len, s);
        float scores[len > 0 ? len : 1];
        for (int i = q_indptr[s]; i < q_indptr[s + 1]; i++) {
            int64_t p = len - (q_indptr[s + 1] - i);
            for (int h = 0; h < n_heads; h++)
                attend_one(out + i * out_stride + (int64_t)h * head_dim, q + i * q_stride + (int64_t)h * head_dim,
                           k_cache, v_cache, indptr, indices, s, p + 1, n_kv_heads, head_dim, h / group, scale,
                           scores);
        }
    }
}

void m40_ref_gemv(const void *w, int w_type, int N, int K, const float *x, int64_t x_stride, float *y,
                  int64_t y_stride, int batch)
{
    const m40_type_info *ti = m40_type_get((uint32_t)w_type);
    size_t row_bytes = (size_t)K / ti->block_elems * ti->block_bytes;
    for (int b = 0; b < batch; b++)
        for (int n = 0; n < N; n++)
            y[b * y_stride + n] = m40_dot_row((uint32_t)w_type, (const uint8_t *)w + (size_t)n * row_bytes,
                                              x + b * x_stride, K);
}

void m40_ref_sample_greedy(const float *logits, int64_t stride, int rows, int n_vocab, int32_t *token,
                           float *logprob, int top_k, int32_t *top_tokens, float *top_logprobs)
{
    for (int r = 0; r < rows; r++) {
        const float *l = logits + r * stride;
        int best = 0;
        for (int i = 1; i < n_vocab; i++)
            if (l[i] > l[best])
                best = i;
        double sum = 0;
        for (int i = 0; i < n_vocab; i++)
            sum += exp((double)l[i] - l[best]);
        float lse = l[best] + (float)log(sum);
        token[r] = best;
        logprob[r] = l[best] - lse;
        /* top-k by repeated selection: the largest value not yet taken, lowest id first */
        for (int j = 0; j < top_k; j++) {
            int pick = -1;
            for (int i = 0; i < n_vocab; i++) {
                int taken = 0;
                for (int u = 0; u < j; u++)
                    taken |= top_tokens[r * top_k + u] == i;
                if (!taken && (pick < 0 || l[i] > l[pick]))
                    pick = i;
            }
            top_tokens[r * top_k + j] = pick;
            top_logprobs[r * top_k + j] = pick >= 0 ? l[pick] - lse : -INFINITY;
        }
    }
}
