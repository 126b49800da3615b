/* RoPE in place. One thread per (token, rotation pair i, chunk of ROPE_HC heads): Q
 * heads first, then K heads, so a decode token's 40 heads x 64 pairs spread over 640
 * threads instead of walking the heads serially (that took 18 us a layer on an H100).
 * The angle (formed in double, reduced to [-pi, pi], then a float sincosf) and the
 * rotation are rope_dev.h's, shared with m40k_kv_append_rope (kv_cache.cu), which
 * rotates K on its way into the cache bit for bit as this kernel does; the model's
 * forward pass calls this one for Q only. */
#include "cuda_common.h"
#include "rope_dev.h"

#define ROPE_HC 4 /* heads per thread */

__global__ void rope_kernel(float *__restrict__ q, int64_t q_stride, int n_q_heads, float *__restrict__ k,
                            int64_t k_stride, int n_k_heads, int head_dim, int rot_dim, const int32_t *__restrict__ pos,
                            int n_tokens, double log2_base, const float *__restrict__ ff, int neox)
{
    m40k_pdl_begin(); /* PDL-launched; a PDL-launched kernel may follow */
    M40K_LAUNDER(q);
    M40K_LAUNDER(k);
    M40K_LAUNDER(pos);
    M40K_LAUNDER(ff);
    const int half = rot_dim / 2;
    const int qc = (n_q_heads + ROPE_HC - 1) / ROPE_HC, nc = qc + (k ? (n_k_heads + ROPE_HC - 1) / ROPE_HC : 0);
    const int64_t id = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (id >= (int64_t)n_tokens * half * nc)
        return;
    const int chunk = (int)(id % nc), i = (int)(id / nc % half), t = (int)(id / nc / half);
    float s, c;
    m40k_rope_sincos(pos[t], i, rot_dim, log2_base, ff, &s, &c);
    const int a = neox ? i : 2 * i, b = neox ? i + half : 2 * i + 1;
    float *base;
    int h0, h1;
    if (chunk < qc) {
        base = q + t * q_stride, h0 = chunk * ROPE_HC, h1 = min(n_q_heads, h0 + ROPE_HC);
    } else {
        base = k + t * k_stride, h0 = (chunk - qc) * ROPE_HC, h1 = min(n_k_heads, h0 + ROPE_HC);
    }
    for (int h = h0; h < h1; h++) {
        float *v = base + (int64_t)h * head_dim;
        m40k_rope_rotate(v[a], v[b], c, s, &v[a], &v[b]);
    }
}

extern "C" int m40k_rope(float *q, int64_t q_stride, int n_q_heads, float *k, int64_t k_stride, int n_k_heads,
                         int head_dim, int rot_dim, const int32_t *pos, int n_tokens, float base,
                         const float *freq_factors, int neox, m40k_stream stream)
{
    if (n_tokens <= 0 || rot_dim == 0)
        return 0;
    if (rot_dim < 0 || rot_dim % 2 || rot_dim > head_dim || !(base > 0.0f) || n_q_heads < 0 || n_k_heads < 0)
        return M40K_INVALID;
    const int nc = (n_q_heads + ROPE_HC - 1) / ROPE_HC + (k ? (n_k_heads + ROPE_HC - 1) / ROPE_HC : 0);
    if (nc == 0)
        return 0;
    const int64_t n = (int64_t)n_tokens * (rot_dim / 2) * nc;
    M40K_LAUNCH_PDL(rope_kernel, (unsigned)((n + 127) / 128), 128, 0, stream, q, q_stride, n_q_heads, k, k_stride,
                    n_k_heads, head_dim, rot_dim, pos, n_tokens, log2((double)base), freq_factors, neox);
    return m40k_launch_status();
}

/* One thread an entry (token t, pair i) of the angle table (kernels.h 5c). */
__global__ void rope_table_kernel(const int32_t *__restrict__ pos, int n_tokens, int rot_dim, double log2_base,
                                  const float *__restrict__ ff, float2 *__restrict__ cs)
{
    m40k_pdl_begin(); /* PDL-launched; a PDL-launched kernel may follow */
    M40K_LAUNDER(pos);
    M40K_LAUNDER(ff);
    M40K_LAUNDER(cs);
    const int half = rot_dim / 2;
    const int64_t id = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (id >= (int64_t)n_tokens * half)
        return;
    const int t = (int)(id / half), i = (int)(id % half);
    float s, c;
    m40k_rope_sincos(pos[t], i, rot_dim, log2_base, ff, &s, &c);
    cs[id] = make_float2(c, s);
}

extern "C" int m40k_rope_table(const int32_t *pos, int n_tokens, int rot_dim, float base, const float *freq_factors,
                               float *cs, m40k_stream stream)
{
    if (n_tokens <= 0 || rot_dim == 0)
        return 0;
    if (rot_dim < 0 || rot_dim % 2 || !(base > 0.0f) || ((uintptr_t)cs & 7))
        return M40K_INVALID;
    const int64_t n = (int64_t)n_tokens * (rot_dim / 2);
    M40K_LAUNCH_PDL(rope_table_kernel, (unsigned)((n + 255) / 256), 256, 0, stream, pos, n_tokens, rot_dim,
                    log2((double)base), freq_factors, reinterpret_cast<float2 *>(cs));
    return m40k_launch_status();
}
