/* CPU twins of kernels/ (see cpu_ref.h). Each loop is the definition of the kernel's
 * result: F32 accumulation, F16 storage rounded to nearest even. */
#include "cpu_ref.h"

#include <math.h>
#include <stdlib.h>
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

void m40_ref_add_rmsnorm(float *x, int64_t x_stride, const float *d, int64_t d_stride, const float *w, float *out,
                         int64_t out_stride, int rows, int dim, float eps)
{
    for (int r = 0; r < rows; r++) {
        float *xr = x + r * x_stride;
        const float *dr = d + r * d_stride;
        for (int i = 0; i < dim; i++)
            xr[i] += dr[i];
    }
    m40_ref_rmsnorm(x, x_stride, w, out, M40K_TYPE_F32, out_stride, rows, dim, eps);
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
            int64_t p = len - (new_indptr[s + 1] - t), row = t - new_indptr[0];
            for (int h = 0; h < n_kv_heads; h++)
                for (int d = 0; d < head_dim; d++) {
                    size_t at = paged_index(indptr, indices, s, p, n_kv_heads, head_dim, h, d);
                    k_cache[at] = m40_fp32_to_fp16(k[row * k_stride + h * head_dim + d]);
                    v_cache[at] = m40_fp32_to_fp16(v[row * v_stride + h * head_dim + d]);
                }
        }
    }
}

/* softmax(scale * q.K[p0..n_ctx)) . V for one query head, two passes, F32 (scores in
 * double for the sum so the twin is at least as accurate as the kernel); cap > 0: each
 * score s becomes cap * tanh(s / cap) first (Gemma 2's attn_logit_softcapping). */
static void attend_one(float *o, const float *q, const uint16_t *k_cache, const uint16_t *v_cache,
                       const int32_t *indptr, const int32_t *indices, int s, int64_t p0, int64_t n_ctx,
                       int n_kv_heads, int head_dim, int kvh, float scale, float cap, const float *sink,
                       float *scores)
{
    /* a sink (gpt-oss): one more logit in the softmax, with no value behind it */
    float mx = sink ? *sink : -INFINITY;
    for (int64_t p = p0; p < n_ctx; p++) {
        size_t base = paged_index(indptr, indices, s, p, n_kv_heads, head_dim, kvh, 0);
        float dot = 0;
        for (int d = 0; d < head_dim; d++)
            dot += q[d] * m40_fp16_to_fp32(k_cache[base + d]);
        scores[p] = dot * scale;
        if (cap > 0)
            scores[p] = cap * tanhf(scores[p] / cap);
        if (scores[p] > mx)
            mx = scores[p];
    }
    double sum = sink ? expf(*sink - mx) : 0;
    for (int64_t p = p0; p < n_ctx; p++) {
        scores[p] = expf(scores[p] - mx);
        sum += scores[p];
    }
    for (int d = 0; d < head_dim; d++)
        o[d] = 0;
    for (int64_t p = p0; p < n_ctx; p++) {
        size_t base = paged_index(indptr, indices, s, p, n_kv_heads, head_dim, kvh, 0);
        for (int d = 0; d < head_dim; d++)
            o[d] += scores[p] * m40_fp16_to_fp32(v_cache[base + d]);
    }
    for (int d = 0; d < head_dim; d++)
        o[d] = n_ctx > p0 ? (float)(o[d] / sum) : 0.0f;
}

/* First visible position for a query at position p (window 0: no window). */
static int64_t window_first(int64_t p, int window)
{
    return window > 0 && p - window + 1 > 0 ? p - window + 1 : 0;
}

void m40_ref_attn_decode_window(float *out, int64_t out_stride, const float *q, int64_t q_stride,
                                const uint16_t *k_cache, const uint16_t *v_cache, const int32_t *indptr,
                                const int32_t *indices, const int32_t *last_page_len, int n_seqs, int n_heads,
                                int n_kv_heads, int head_dim, float scale, int window, float softcap)
{
    int group = n_heads / n_kv_heads;
    for (int s = 0; s < n_seqs; s++) {
        int64_t len = m40_ref_seq_len(indptr, last_page_len, s);
        float scores[len > 0 ? len : 1];
        for (int h = 0; h < n_heads; h++)
            attend_one(out + s * out_stride + (int64_t)h * head_dim, q + s * q_stride + (int64_t)h * head_dim, k_cache,
                       v_cache, indptr, indices, s, window_first(len - 1, window), len, n_kv_heads, head_dim,
                       h / group, scale, softcap, NULL, scores);
    }
}

void m40_ref_attn_decode(float *out, int64_t out_stride, const float *q, int64_t q_stride, const uint16_t *k_cache,
                         const uint16_t *v_cache, const int32_t *indptr, const int32_t *indices,
                         const int32_t *last_page_len, int n_seqs, int n_heads, int n_kv_heads, int head_dim,
                         float scale)
{
    m40_ref_attn_decode_window(out, out_stride, q, q_stride, k_cache, v_cache, indptr, indices, last_page_len, n_seqs,
                               n_heads, n_kv_heads, head_dim, scale, 0, 0.0f);
}

void m40_ref_attn_prefill_window(float *out, int64_t out_stride, const float *q, int64_t q_stride,
                                 const int32_t *q_indptr, int n_seqs, int n_rows, const uint16_t *k_cache,
                                 const uint16_t *v_cache, const int32_t *indptr, const int32_t *indices,
                                 const int32_t *last_page_len, int n_heads, int n_kv_heads, int head_dim, float scale,
                                 int window, float softcap)
{
    m40_ref_attn_prefill_sinks(out, out_stride, q, q_stride, q_indptr, n_seqs, n_rows, k_cache, v_cache, indptr,
                               indices, last_page_len, n_heads, n_kv_heads, head_dim, scale, window, softcap, NULL);
}

void m40_ref_attn_prefill_sinks(float *out, int64_t out_stride, const float *q, int64_t q_stride,
                                const int32_t *q_indptr, int n_seqs, int n_rows, const uint16_t *k_cache,
                                const uint16_t *v_cache, const int32_t *indptr, const int32_t *indices,
                                const int32_t *last_page_len, int n_heads, int n_kv_heads, int head_dim, float scale,
                                int window, float softcap, const float *sinks)
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
                           k_cache, v_cache, indptr, indices, s, window_first(p, window), p + 1, n_kv_heads, head_dim,
                           h / group, scale, softcap, sinks ? sinks + h : NULL, scores);
        }
    }
}

void m40_ref_attn_prefill(float *out, int64_t out_stride, const float *q, int64_t q_stride, const int32_t *q_indptr,
                          int n_seqs, int n_rows, const uint16_t *k_cache, const uint16_t *v_cache,
                          const int32_t *indptr, const int32_t *indices, const int32_t *last_page_len, int n_heads,
                          int n_kv_heads, int head_dim, float scale)
{
    m40_ref_attn_prefill_window(out, out_stride, q, q_stride, q_indptr, n_seqs, n_rows, k_cache, v_cache, indptr,
                                indices, last_page_len, n_heads, n_kv_heads, head_dim, scale, 0, 0.0f);
}

void m40_ref_attn_generic_window(float *out, int64_t out_stride, const float *q, int64_t q_stride,
                                 const int32_t *row_seq, const int32_t *row_pos, int n_rows, const uint16_t *k_cache,
                                 const uint16_t *v_cache, const int32_t *indptr, const int32_t *indices, int n_heads,
                                 int n_kv_heads, int head_dim, float scale, int window, float softcap)
{
    m40_ref_attn_generic_sinks(out, out_stride, q, q_stride, row_seq, row_pos, n_rows, k_cache, v_cache, indptr,
                               indices, n_heads, n_kv_heads, head_dim, scale, window, softcap, NULL);
}

void m40_ref_attn_generic_sinks(float *out, int64_t out_stride, const float *q, int64_t q_stride,
                                const int32_t *row_seq, const int32_t *row_pos, int n_rows, const uint16_t *k_cache,
                                const uint16_t *v_cache, const int32_t *indptr, const int32_t *indices, int n_heads,
                                int n_kv_heads, int head_dim, float scale, int window, float softcap,
                                const float *sinks)
{
    int group = n_heads / n_kv_heads;
    for (int i = 0; i < n_rows; i++) {
        int64_t p = row_pos[i];
        float *scores = malloc((size_t)(p + 1) * sizeof *scores);
        if (!scores)
            return;
        for (int h = 0; h < n_heads; h++)
            attend_one(out + i * out_stride + (int64_t)h * head_dim, q + i * q_stride + (int64_t)h * head_dim, k_cache,
                       v_cache, indptr, indices, row_seq[i], window_first(p, window), p + 1, n_kv_heads, head_dim,
                       h / group, scale, softcap, sinks ? sinks + h : NULL, scores);
        free(scores);
    }
}

void m40_ref_rmsnorm_heads(float *x, int64_t x_stride, int n_heads, int head_dim, const float *w, int rows, float eps)
{
    for (int r = 0; r < rows; r++)
        for (int h = 0; h < n_heads; h++) {
            float *v = x + r * x_stride + (int64_t)h * head_dim;
            double ss = 0;
            for (int d = 0; d < head_dim; d++)
                ss += (double)v[d] * v[d];
            float sc = (float)(1.0 / sqrt(ss / head_dim + eps));
            for (int d = 0; d < head_dim; d++)
                v[d] = v[d] * sc * w[d];
        }
}

void m40_ref_scale(float *x, int64_t n, float s)
{
    for (int64_t i = 0; i < n; i++)
        x[i] *= s;
}

void m40_ref_softcap(float *x, int64_t n, float cap)
{
    for (int64_t i = 0; i < n; i++)
        x[i] = cap * tanhf(x[i] / cap);
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

static float ldh(const uint8_t *p) { return m40_fp16_to_fp32((uint16_t)(p[0] | p[1] << 8)); }

/* An MXFP4 nibble's E2M1 value doubled (sign bit 3, magnitude 0, 0.5, 1, 1.5, 2, 3, 4, 6):
 * an integer, times the block's 2^(e - 128) */
static const int8_t ref_mxfp4_level[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

/* 8 elements e0 .. e0+7 of a row of type t as the GPU's m40k_group8 (kernels/quant_dev.h)
 * gives them: small integers q with one scale and one offset, w = scale * q - offset. */
/* Q4_K's and Q5_K's 6-bit scale and min of sub-block sb from their 12 bytes sc: pairs
 * 0-3 in the low 6 bits of bytes 0-3 (scales) and 4-7 (mins), pairs 4-7 in the nibbles
 * of bytes 8-11 with their top 2 bits in the top bits of bytes 0-7. */
static void ref_scale_min_k4(const uint8_t *sc, int sb, int *scv, int *mnv)
{
    if (sb < 4) {
        *scv = sc[sb] & 63;
        *mnv = sc[sb + 4] & 63;
    } else {
        *scv = (sc[sb + 4] & 15) | ((sc[sb - 4] >> 6) << 4);
        *mnv = (sc[sb + 4] >> 4) | ((sc[sb] >> 6) << 4);
    }
}

static void ref_group8(int t, const uint8_t *p, int e0, float q[8], float *scale, float *offset)
{
    const uint8_t *b;
    const int j = e0 & 31;
    switch (t) {
    case M40K_TYPE_F16:
        for (int i = 0; i < 8; i++)
            q[i] = m40_fp16_to_fp32((uint16_t)(p[2 * (e0 + i)] | p[2 * (e0 + i) + 1] << 8));
        *scale = 1.0f, *offset = 0.0f;
        return;
    case M40K_TYPE_BF16:
        for (int i = 0; i < 8; i++)
            q[i] = m40_bf16_to_fp32((uint16_t)(p[2 * (e0 + i)] | p[2 * (e0 + i) + 1] << 8));
        *scale = 1.0f, *offset = 0.0f;
        return;
    case M40K_TYPE_Q2_K: { /* scales[16] | qs[64] | d | dmin; 16 elements a scale */
        b = p + 84 * (size_t)(e0 >> 8);
        const int e = e0 & 255, half = e / 128, field = (e / 32) % 4, sub = e / 16;
        for (int i = 0; i < 8; i++)
            q[i] = (float)((b[16 + 32 * half + (e % 32) + i] >> (2 * field)) & 3);
        *scale = ldh(b + 80) * (float)(b[sub] % 16), *offset = ldh(b + 82) * (float)(b[sub] / 16);
        return;
    }
    case M40K_TYPE_Q3_K: { /* hmask[32] | qs[64] | scales[12] | d; q - (-4) */
        b = p + 110 * (size_t)(e0 >> 8);
        const int e = e0 & 255, half = e / 128, field = (e / 32) % 4, sub = e / 16;
        for (int i = 0; i < 8; i++) {
            const int lo = (b[32 + 32 * half + (e % 32) + i] >> (2 * field)) & 3;
            const int hi = (b[(e % 32) + i] >> (4 * half + field)) & 1;
            q[i] = (float)(lo + 4 * hi); /* (lo - 4 * !hi) + 4 */
        }
        const uint8_t *sc = b + 96;
        const int low4 = sub < 8 ? sc[sub] & 15 : sc[sub - 8] >> 4, top2 = (sc[8 + sub % 4] >> (2 * (sub / 4))) & 3;
        *scale = ldh(b + 108) * (float)((low4 + 16 * top2) - 32), *offset = 4.0f * *scale;
        return;
    }
    case M40K_TYPE_Q5_K: { /* d | dmin | scales[12] | qh[32] | qs[128] */
        b = p + 176 * (size_t)(e0 >> 8);
        const int e = e0 & 255, sb = e / 32, pair = e / 64, l = e % 32;
        int scv, mnv;
        ref_scale_min_k4(b + 4, sb, &scv, &mnv);
        for (int i = 0; i < 8; i++) {
            const int nib = (b[48 + 32 * pair + l + i] >> (sb % 2 ? 4 : 0)) & 15;
            q[i] = (float)(nib + 16 * ((b[16 + l + i] >> sb) & 1));
        }
        *scale = ldh(b) * (float)scv, *offset = ldh(b + 2) * (float)mnv;
        return;
    }
    case M40K_TYPE_Q8_0:
        b = p + 34 * (size_t)(e0 >> 5);
        for (int i = 0; i < 8; i++)
            q[i] = (float)(b[2 + j + i] ^ 0x80u);
        *scale = ldh(b), *offset = 128.0f * *scale;
        return;
    case M40K_TYPE_Q4_0:
        b = p + 18 * (size_t)(e0 >> 5);
        for (int i = 0; i < 8; i++)
            q[i] = (float)((b[2 + (j & 15) + i] >> (j < 16 ? 0 : 4)) & 15u);
        *scale = ldh(b), *offset = 8.0f * *scale;
        return;
    case M40K_TYPE_Q4_1:
    case M40K_TYPE_Q5_0:
    case M40K_TYPE_Q5_1: {
        const int BB = t == M40K_TYPE_Q4_1 ? 20 : t == M40K_TYPE_Q5_0 ? 22 : 24;
        const int QS = t == M40K_TYPE_Q4_1 ? 4 : t == M40K_TYPE_Q5_0 ? 6 : 8;
        b = p + BB * (size_t)(e0 >> 5);
        uint32_t hb = 0;
        if (t != M40K_TYPE_Q4_1) {
            const uint8_t *qh = b + QS - 4;
            hb = (uint32_t)qh[0] | (uint32_t)qh[1] << 8 | (uint32_t)qh[2] << 16 | (uint32_t)qh[3] << 24;
        }
        for (int i = 0; i < 8; i++)
            q[i] = (float)(((b[QS + (j & 15) + i] >> (j < 16 ? 0 : 4)) & 15u) | (((hb >> (j + i)) & 1u) << 4));
        *scale = ldh(b);
        *offset = t == M40K_TYPE_Q5_0 ? 16.0f * *scale : -ldh(b + 2);
        return;
    }
    case M40K_TYPE_Q4_K: {
        b = p + 144 * (size_t)(e0 >> 8);
        const int e = e0 & 255, sb = e >> 5, c = e >> 6, l = e & 63;
        int scv, mnv;
        ref_scale_min_k4(b + 4, sb, &scv, &mnv);
        for (int i = 0; i < 8; i++)
            q[i] = (float)((b[16 + 32 * c + (l & 31) + i] >> (l < 32 ? 0 : 4)) & 15u);
        *scale = ldh(b) * (float)scv, *offset = ldh(b + 2) * (float)mnv;
        return;
    }
    case M40K_TYPE_Q6_K: {
        b = p + 210 * (size_t)(e0 >> 8);
        const int e = e0 & 255, n = e >> 7, r = e & 127, k = r >> 5, l = r & 31;
        for (int i = 0; i < 8; i++) {
            const uint8_t ql = b[64 * n + 32 * (k & 1) + l + i], qh = b[128 + 32 * n + l + i];
            q[i] = (float)(((ql >> (k < 2 ? 0 : 4)) & 15u) | (((qh >> (2 * k)) & 3u) << 4));
        }
        *scale = ldh(b + 208) * (float)(int8_t)b[192 + (e >> 4)], *offset = 32.0f * *scale;
        return;
    }
    case M40K_TYPE_MXFP4: { /* e | qs[16]: the signed doubled E2M1 level, times 2^(e - 128) */
        b = p + 17 * (size_t)(e0 >> 5);
        for (int i = 0; i < 8; i++)
            q[i] = (float)ref_mxfp4_level[(b[1 + (j & 15) + i] >> (j < 16 ? 0 : 4)) & 15u];
        *scale = ldexpf(1.0f, (int)b[0] - 128), *offset = 0.0f;
        return;
    }
    default:
        abort(); /* the twin covers the GGUF types m40k_gemm_q reads */
    }
}

/* Row r of W as the F16 weights the GPU forms: F16(q * F16(scale) - F16(offset)), one
 * rounding of the exact value (as the GPU's F16 fused multiply-add; every product here is
 * exact in double). */
static void ref_row_f16(const void *w, int w_type, size_t row_bytes, int r, int K, uint16_t *out)
{
    const uint8_t *row = (const uint8_t *)w + (size_t)r * row_bytes;
    for (int e0 = 0; e0 < K; e0 += 8) {
        float q[8], sc, off;
        ref_group8(w_type, row, e0, q, &sc, &off);
        const double s16 = m40_fp16_to_fp32(m40_fp32_to_fp16(sc)), o16 = m40_fp16_to_fp32(m40_fp32_to_fp16(off));
        for (int i = 0; i < 8; i++)
            out[e0 + i] = m40_fp32_to_fp16((float)((double)q[i] * s16 - o16));
    }
}

static size_t ref_row_bytes(int w_type, int K)
{
    const m40_type_info *ti = m40_type_get((uint32_t)w_type);
    return (size_t)K / ti->block_elems * ti->block_bytes;
}

void m40_ref_gemm_q_dequant(const void *w, int w_type, int N, int K, uint16_t *out)
{
    for (int r = 0; r < N; r++)
        ref_row_f16(w, w_type, ref_row_bytes(w_type, K), r, K, out + (size_t)r * K);
}

void m40_ref_gemm_q(const void *w, int w_type, int N, int K, const uint16_t *x, int64_t x_stride, int M, float *y,
                    int64_t ldy)
{
    uint16_t *wr = malloc((size_t)K * sizeof *wr);
    if (!wr)
        abort();
    for (int r = 0; r < N; r++) {
        ref_row_f16(w, w_type, ref_row_bytes(w_type, K), r, K, wr);
        for (int t = 0; t < M; t++) {
            double acc = 0.0;
            for (int k = 0; k < K; k++)
                acc += (double)m40_fp16_to_fp32(wr[k]) * (double)m40_fp16_to_fp32(x[(size_t)t * x_stride + k]);
            y[(size_t)t * ldy + r] = (float)acc;
        }
    }
    free(wr);
}

/* rint(v/d) as an int (0 when d == 0; the clamp only decides NaN), as the GPU's. */
static int q8_round(float v, float d)
{
    return d != 0.0f ? (int)fminf(127.0f, fmaxf(-127.0f, rintf(v / d))) : 0;
}

/* max |v[i]|, starting from the first element so that NaN behaves as in the GPU's fmaxf
 * tree */
static float q8_amax(const float *v)
{
    float m = fabsf(v[0]);
    for (int i = 1; i < 32; i++)
        m = fmaxf(m, fabsf(v[i]));
    return m;
}

/* kernels.h 8b: per block of 32 elements one 80-byte record q1[32] | q2[32] | float d1,
 * d2, s, 0: d1 = max|x|/127, q1 = rint(x/d1), the residual r = fma(-d1, q1, x) (rounded
 * once), d2 = max|r|/127, q2 = rint(r/d2), s = fma(d1, sum(q1), d2*sum(q2)). */
void m40_ref_quantize_q8(const float *x, int64_t x_stride, int K, int batch, void *ws)
{
    uint8_t *rec = ws;
    for (int b = 0; b < batch; b++)
        for (int j = 0; j < K / 32; j++, rec += 80) {
            const float *v = x + b * x_stride + 32 * j;
            int8_t *q1 = (int8_t *)rec, *q2 = q1 + 32;
            float r[32], f[4];
            f[0] = q8_amax(v) / 127.0f;
            int s1 = 0, s2 = 0;
            for (int i = 0; i < 32; i++) {
                q1[i] = (int8_t)q8_round(v[i], f[0]);
                r[i] = fmaf(-f[0], (float)q1[i], v[i]);
                s1 += q1[i];
            }
            f[1] = q8_amax(r) / 127.0f;
            for (int i = 0; i < 32; i++) {
                q2[i] = (int8_t)q8_round(r[i], f[1]);
                s2 += q2[i];
            }
            f[2] = fmaf(f[0], (float)s1, f[1] * (float)s2);
            f[3] = 0.0f;
            memcpy(rec + 64, f, sizeof f);
        }
}


/* One weight scale group against its activations: d1*S1 + d2*S2 of the integer dots
 * S1 = sum(w*q1), S2 = sum(w*q2), in F32 as the GPU forms it. */
static float q8_two(float d1, float d2, int s1, int s2) { return fmaf(d1, (float)s1, d2 * (float)s2); }

/* Contribution of x block j (record xb: q1, q2, d1, d2, s) to one row of W: per weight
 * scale group, scale * (d1*S1 + d2*S2) plus the offset term (coefficient * s) of
 * Q4_0/Q4_K; each product exact in double, as the GPU's fmaf leaves it unrounded. */
static double q8_block_term(int type, const uint8_t *row, int j, const uint8_t *xb)
{
    const int8_t *q1 = (const int8_t *)xb, *q2 = q1 + 32;
    float f[4];
    memcpy(f, xb + 64, sizeof f);
    const float d1 = f[0], d2 = f[1], sx = f[2];
    switch (type) {
    case M40K_TYPE_Q8_0: {
        const uint8_t *blk = row + 34 * (size_t)j;
        int s1 = 0, s2 = 0;
        for (int i = 0; i < 32; i++) {
            s1 += (int8_t)blk[2 + i] * q1[i];
            s2 += (int8_t)blk[2 + i] * q2[i];
        }
        return (double)ldh(blk) * q8_two(d1, d2, s1, s2);
    }
    case M40K_TYPE_Q4_0: {
        const uint8_t *blk = row + 18 * (size_t)j;
        int s1 = 0, s2 = 0;
        for (int i = 0; i < 16; i++) {
            const int lo = blk[2 + i] & 15, hi = blk[2 + i] >> 4;
            s1 += lo * q1[i] + hi * q1[16 + i];
            s2 += lo * q2[i] + hi * q2[16 + i];
        }
        const float d = ldh(blk);
        return (double)d * q8_two(d1, d2, s1, s2) + (double)(-8.0f * d) * sx;
    }
    case M40K_TYPE_MXFP4: { /* e | qs[16]: the signed doubled E2M1 levels, times 2^(e - 128) */
        const uint8_t *blk = row + 17 * (size_t)j;
        int s1 = 0, s2 = 0;
        for (int i = 0; i < 16; i++) {
            const int lo = ref_mxfp4_level[blk[1 + i] & 15], hi = ref_mxfp4_level[blk[1 + i] >> 4];
            s1 += lo * q1[i] + hi * q1[16 + i];
            s2 += lo * q2[i] + hi * q2[16 + i];
        }
        return (double)ldexpf(1.0f, (int)blk[0] - 128) * q8_two(d1, d2, s1, s2);
    }
    case M40K_TYPE_Q4_K: { /* sub-block t of superblock j/8 */
        const uint8_t *sb = row + 144 * (size_t)(j / 8);
        const int t = j % 8;
        int scv, mnv;
        ref_scale_min_k4(sb + 4, t, &scv, &mnv);
        const uint8_t *qs = sb + 16 + 32 * (t / 2);
        int s1 = 0, s2 = 0;
        for (int l = 0; l < 32; l++) {
            const int w = (qs[l] >> (4 * (t & 1))) & 15;
            s1 += w * q1[l];
            s2 += w * q2[l];
        }
        const float a = ldh(sb) * (float)scv, m = -(ldh(sb + 2) * (float)mnv);
        return (double)a * q8_two(d1, d2, s1, s2) + (double)m * sx;
    }
    case M40K_TYPE_Q6_K: { /* scale groups 2t, 2t+1 of superblock j/8 */
        const uint8_t *sb = row + 210 * (size_t)(j / 8);
        const int t = j % 8;
        const float d = ldh(sb + 208);
        double term = 0;
        for (int e = 0; e < 2; e++) {
            int s1 = 0, s2 = 0;
            for (int i = 0; i < 16; i++) {
                const int el = 32 * t + 16 * e + i, n = el >> 7, k = (el & 127) >> 5, l = el & 31;
                const uint8_t ql = sb[64 * n + 32 * (k & 1) + l];
                const int lo = k < 2 ? ql & 15 : ql >> 4, hi = (sb[128 + 32 * n + l] >> (2 * k)) & 3;
                const int w = (lo | hi << 4) - 32;
                s1 += w * q1[16 * e + i];
                s2 += w * q2[16 * e + i];
            }
            const float a = d * (float)(int8_t)sb[192 + 2 * t + e];
            term += (double)a * q8_two(d1, d2, s1, s2);
        }
        return term;
    }
    default:
        return 0.0;
    }
}

void m40_ref_gemv_q8(const void *w, int w_type, int N, int K, const void *ws, int batch, float *y, int64_t y_stride)
{
    const m40_type_info *ti = m40_type_get((uint32_t)w_type);
    const size_t row_bytes = (size_t)K / ti->block_elems * ti->block_bytes;
    for (int b = 0; b < batch; b++)
        for (int n = 0; n < N; n++) {
            const uint8_t *row = (const uint8_t *)w + (size_t)n * row_bytes;
            double acc = 0;
            for (int j = 0; j < K / 32; j++)
                acc += q8_block_term(w_type, row, j, (const uint8_t *)ws + 80 * ((size_t)b * (K / 32) + j));
            y[b * y_stride + n] = (float)acc;
        }
}

void m40_ref_quantize_x8(const uint16_t *x, int64_t x_stride, int K, int M, void *xq)
{
    int8_t *q = xq;
    uint8_t *rec = (uint8_t *)(q + (size_t)M * K);
    const int nc = K / 256;
    for (int t = 0; t < M; t++)
        for (int c = 0; c < nc; c++) {
            float v[256], m = 0.0f;
            for (int i = 0; i < 256; i++) {
                v[i] = m40_fp16_to_fp32(x[(size_t)t * x_stride + 256 * c + i]);
                m = fmaxf(m, fabsf(v[i]));
            }
            const float d = m / 127.0f;
            uint8_t *r = rec + ((size_t)t * nc + c) * 32;
            memset(r, 0, 16);
            memcpy(r, &d, 4);
            for (int b = 0; b < 8; b++) {
                int sum = 0;
                for (int i = 0; i < 32; i++) {
                    const int a = q8_round(v[32 * b + i], d);
                    sum += a;
                    q[(size_t)t * K + 256 * c + 64 * (b / 2) + 16 * (i / 8) + 8 * (b % 2) + i % 8] = (int8_t)a;
                }
                const uint16_t h = m40_fp32_to_fp16((float)sum);
                memcpy(r + 16 + 2 * b, &h, 2);
            }
        }
}

void m40_ref_gemm_x8(const void *w, int w_type, int N, int K, const void *xq, int M, float *y, int64_t ldy)
{
    const int8_t *q = xq;
    const uint8_t *rec = (const uint8_t *)(q + (size_t)M * K);
    const int nc = K / 256;
    const size_t rb = w_type == M40K_TYPE_Q4_K ? (size_t)nc * 144 : (size_t)K / 32 * 34;
    for (int t = 0; t < M; t++)
        for (int n = 0; n < N; n++) {
            const uint8_t *row = (const uint8_t *)w + (size_t)n * rb;
            double acc = 0;
            for (int c = 0; c < nc; c++) {
                const uint8_t *r = rec + ((size_t)t * nc + c) * 32;
                float dx;
                memcpy(&dx, r, 4);
                const int8_t *qc = q + (size_t)t * K + 256 * c;
                long long isum = 0; /* Q4_K: sum of sc_j * dot_j */
                double e = 0;       /* Q4_K: the minimum terms; Q8_0: sum of d_j * dot_j */
                for (int j = 0; j < 8; j++) {
                    int lv[32]; /* block j's integer levels */
                    const int b = 8 * c + j;
                    int scv = 0, mnv = 0;
                    if (w_type == M40K_TYPE_Q4_K) {
                        const uint8_t *sb = row + 144 * (size_t)c;
                        ref_scale_min_k4(sb + 4, j, &scv, &mnv);
                        for (int l = 0; l < 32; l++)
                            lv[l] = (sb[16 + 32 * (j / 2) + l] >> (4 * (j & 1))) & 15;
                    } else {
                        const uint8_t *blk = row + 34 * (size_t)b;
                        for (int l = 0; l < 32; l++)
                            lv[l] = (int8_t)blk[2 + l];
                    }
                    int dot = 0;
                    for (int l = 0; l < 32; l++)
                        dot += lv[l] * qc[64 * (j / 2) + 16 * (l / 8) + 8 * (j % 2) + l % 8];
                    if (w_type == M40K_TYPE_Q4_K) {
                        const uint8_t *sb = row + 144 * (size_t)c;
                        uint16_t sh;
                        memcpy(&sh, r + 16 + 2 * j, 2);
                        const float mn = m40_fp16_to_fp32(m40_fp32_to_fp16(-(ldh(sb + 2) * (float)mnv)));
                        isum += (long long)scv * dot;
                        e += (double)mn * m40_fp16_to_fp32(sh);
                    } else {
                        e += (double)ldh(row + 34 * (size_t)b) * dot;
                    }
                }
                if (w_type == M40K_TYPE_Q4_K)
                    e += (double)(ldh(row + 144 * (size_t)c) * (float)isum);
                acc += (double)dx * e;
            }
            y[(size_t)t * ldy + n] = (float)acc;
        }
}

void m40_ref_gemv_q8_add_norm(const void *w, int w_type, int N, int K, const void *ws, const float *bias,
                              const float *x, float *x_out, const float *norm_w, void *xq_out, float *ss_out)
{
    float *y = malloc((size_t)N * sizeof *y), *v = malloc((size_t)N * sizeof *v);
    if (!y || !v) {
        free(y);
        free(v);
        return;
    }
    m40_ref_gemv_q8(w, w_type, N, K, ws, 1, y, N);
    for (int n = 0; n < N; n++) {
        x_out[n] = x[n] + (bias ? y[n] + bias[n] : y[n]);
        v[n] = x_out[n] * norm_w[n];
    }
    m40_ref_quantize_q8(v, N, N, 1, xq_out);
    for (int j = 0; j < N / 32; j++) {
        double s = 0;
        for (int i = 0; i < 32; i++)
            s += (double)x_out[32 * j + i] * x_out[32 * j + i];
        ss_out[j] = (float)s;
    }
    free(y);
    free(v);
}

float m40_ref_norm_factor(const float *ss, int K, float eps)
{
    double s = 0;
    for (int j = 0; j < K / 32; j++)
        s += ss[j];
    return (float)(1.0 / sqrt(s / K + eps));
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

/* ---- full sampling (m40k_sample) ----
 * Every step that decides the token is exact: probabilities come from m40_ref_sample_exp
 * (IEEE single operations in a fixed order; the C standard mode keeps the compiler from
 * fusing them, nvcc gets explicit __f*_rn), masses are 2^-40 fixed-point integers whose
 * sums do not depend on order, and the draw is an integer. Only the reported logprobs
 * carry float rounding. */

float m40_ref_sample_exp(float x)
{
    if (!(x > -32.0f))
        return 0.0f;
    float n = rintf(x * 1.44269504f);
    float r = x - n * 0.693145751953125f; /* ln 2 high part: n * it is exact */
    r = r - n * 1.42860677e-06f;
    float p = 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    uint32_t bits = (uint32_t)(127 + (int)n) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

static inline float sample_lv(float x) { return x != x ? -INFINITY : x == 0.0f ? 0.0f : x; }

typedef struct {
    uint32_t key;
    int32_t id;
} sample_rank;

static int sample_rank_cmp(const void *a, const void *b)
{
    const sample_rank *x = a, *y = b;
    if (x->key != y->key)
        return x->key > y->key ? -1 : 1;
    return x->id < y->id ? -1 : x->id > y->id;
}

void m40_ref_sample(float *logits, int64_t stride, int n_seq, int n_vocab, const m40k_sample_params *params,
                    const int32_t *bias_indptr, const int32_t *bias_ids, const float *bias_values,
                    const int32_t *pen_indptr, const int32_t *pen_ids, const int32_t *pen_counts, int32_t *token,
                    float *logprob, int n_top, int32_t *top_ids, float *top_logprobs)
{
    sample_rank *rank = malloc((size_t)n_vocab * sizeof *rank);
    uint64_t *cum = malloc((size_t)n_vocab * sizeof *cum);
    if (!rank || !cum) {
        free(rank);
        free(cum);
        return;
    }
    for (int s = 0; s < n_seq; s++) {
        float *l = logits + (int64_t)s * stride;
        const m40k_sample_params *p = &params[s];
        if (bias_indptr)
            for (int32_t j = bias_indptr[s]; j < bias_indptr[s + 1]; j++)
                if (bias_ids[j] >= 0 && bias_ids[j] < n_vocab)
                    l[bias_ids[j]] += bias_values[j];
        if (pen_indptr)
            for (int32_t j = pen_indptr[s]; j < pen_indptr[s + 1]; j++) {
                int32_t t = pen_ids[j];
                if (t < 0 || t >= n_vocab)
                    continue;
                float x = l[t];
                if (p->repetition_penalty != 1.0f)
                    x = x > 0 ? x / p->repetition_penalty : x * p->repetition_penalty;
                float d = (float)pen_counts[j] * p->frequency_penalty;
                d = d + p->presence_penalty;
                l[t] = x - d;
            }

        for (int i = 0; i < n_vocab; i++)
            rank[i] = (sample_rank){m40k_rank_key(l[i]), i};
        qsort(rank, (size_t)n_vocab, sizeof *rank, sample_rank_cmp);
        const float max = sample_lv(l[rank[0].id]);
        double sum = 0;
        for (int i = 0; i < n_vocab; i++)
            sum += exp((double)sample_lv(l[i]) - max);
        const double lse = isfinite(max) ? max + log(sum) : max;

        int32_t tok = rank[0].id;
        if (p->temperature > 0.0f && p->top_k != 1 && isfinite(max)) {
            uint64_t acc = 0;
            for (int i = 0; i < n_vocab; i++) {
                float pr = m40_ref_sample_exp((sample_lv(l[rank[i].id]) - max) / p->temperature);
                acc += (uint64_t)(pr * 1099511627776.0f);
                cum[i] = acc;
            }
            int keep = p->top_k > 0 && p->top_k < n_vocab ? p->top_k : n_vocab;
            if (p->top_p < 1.0f) {
                const uint64_t total = cum[keep - 1];
                double t = ceil((double)p->top_p * (double)total);
                uint64_t thr = t < 1.0 ? 1 : t >= (double)total ? total : (uint64_t)t;
                int n = 0;
                while (cum[n] < thr)
                    n++;
                keep = n + 1;
            }
            if (p->min_p > 0.0f) {
                const float min_p = p->min_p < 1.0f ? p->min_p : 1.0f;
                int n = 1; /* the first has p = 1; the prefix ends at the first p < min_p */
                while (n < keep &&
                       m40_ref_sample_exp((sample_lv(l[rank[n].id]) - max) / p->temperature) >= min_p)
                    n++;
                keep = n;
            }
            const uint64_t mass = cum[keep - 1];
            const uint64_t r = (uint64_t)(((unsigned __int128)m40k_sample_random(p->seed, p->step) * mass) >> 64);
            int n = 0;
            while (cum[n] <= r)
                n++;
            tok = rank[n].id;
        }
        token[s] = tok;
        logprob[s] = (float)(sample_lv(l[tok]) - lse);
        for (int j = 0; j < n_top; j++) {
            top_ids[s * n_top + j] = j < n_vocab ? rank[j].id : -1;
            top_logprobs[s * n_top + j] = j < n_vocab ? (float)(sample_lv(l[rank[j].id]) - lse) : -INFINITY;
        }
    }
    free(rank);
    free(cum);
}

void m40_ref_tp_allreduce(const float *const *in, int n_ranks, float *out, int64_t count)
{
    for (int64_t i = 0; i < count; i++) {
        float s = in[0][i];
        for (int r = 1; r < n_ranks; r++)
            s += in[r][i];
        out[i] = s;
    }
}
