/* RoPE in place. One thread per (token, rotation pair i): the angle (double precision,
 * so positions in the hundreds of thousands keep float accuracy) is computed once and
 * applied to that pair of every Q and K head of the token. */
#include "cuda_common.h"

__global__ void rope_kernel(float *__restrict__ q, int64_t q_stride, int n_q_heads, float *__restrict__ k,
                            int64_t k_stride, int n_k_heads, int head_dim, int rot_dim, const int32_t *__restrict__ pos,
                            int n_tokens, float base, const float *__restrict__ ff, int neox)
{
    const int half = rot_dim / 2;
    const int64_t id = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (id >= (int64_t)n_tokens * half)
        return;
    const int t = (int)(id / half), i = (int)(id % half);
    double theta = (double)pos[t] * exp2(-2.0 * i / rot_dim * log2((double)base));
    if (ff)
        theta /= ff[i];
    double sd, cd;
    sincos(theta, &sd, &cd);
    const float c = (float)cd, s = (float)sd;
    const int a = neox ? i : 2 * i, b = neox ? i + half : 2 * i + 1;
    for (int h = 0; h < n_q_heads; h++) {
        float *v = q + t * q_stride + (int64_t)h * head_dim;
        float x0 = v[a], x1 = v[b];
        v[a] = x0 * c - x1 * s;
        v[b] = x0 * s + x1 * c;
    }
    if (k)
        for (int h = 0; h < n_k_heads; h++) {
            float *v = k + t * k_stride + (int64_t)h * head_dim;
            float x0 = v[a], x1 = v[b];
            v[a] = x0 * c - x1 * s;
            v[b] = x0 * s + x1 * c;
        }
}

extern "C" int m40k_rope(float *q, int64_t q_stride, int n_q_heads, float *k, int64_t k_stride, int n_k_heads,
                         int head_dim, int rot_dim, const int32_t *pos, int n_tokens, float base,
                         const float *freq_factors, int neox, m40k_stream stream)
{
    if (n_tokens <= 0 || rot_dim == 0)
        return 0;
    if (rot_dim < 0 || rot_dim % 2 || rot_dim > head_dim || !(base > 0.0f))
        return M40K_INVALID;
    int64_t n = (int64_t)n_tokens * (rot_dim / 2);
    rope_kernel<<<(unsigned)((n + 127) / 128), 128, 0, stream>>>(q, q_stride, n_q_heads, k, k_stride, n_k_heads,
                                                                 head_dim, rot_dim, pos, n_tokens, base, freq_factors,
                                                                 neox);
    return m40k_launch_status();
}
