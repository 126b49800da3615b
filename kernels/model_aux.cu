/* Helpers of the GPU forward pass; see model_aux.h. */
#include "cuda_common.h"
#include "model_aux.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* compute capability >= 9 (Hopper: PDL, thread block clusters) of the current device */
static int cc9_current(void)
{
    static signed char by_dev[64]; /* 0 unknown, 1 yes, -1 no */
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64)
        return 0;
    if (by_dev[dev] == 0) {
        int major = 0;
        by_dev[dev] = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) == cudaSuccess && major >= 9
                          ? 1
                          : -1;
    }
    return by_dev[dev] > 0;
}

/* The launch switches the engine passes in (m40k_set_launch_tuning): on until told
 * otherwise, so that a program that never calls it (the kernel tests) launches as the
 * engine does by default. */
static int pdl_on = 1, clusters_on = 1, head_split_on = 1;

extern "C" void m40k_set_launch_tuning(int pdl, int clusters, int head_split)
{
    pdl_on = pdl != 0;
    clusters_on = clusters != 0;
    head_split_on = head_split != 0;
}

int m40k_head_split_enabled(void) { return head_split_on; }

int m40k_pdl_enabled(void) { return pdl_on && cc9_current(); }

int m40k_clusters_enabled(void) { return clusters_on && cc9_current(); }

__global__ void f32_to_f16_kernel(const float *__restrict__ x, uint16_t *__restrict__ y, int64_t n)
{
    m40k_pdl_begin(); /* PDL-launched; a PDL-launched kernel may follow */
    M40K_LAUNDER(x);
    M40K_LAUNDER(y);
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        y[i] = m40k_f2h(x[i]);
}

/* Four elements a thread (a 16-byte load, an 8-byte store) where x and y allow: the
 * o-projection's input of a prefill chunk (512 x 4096) converted at 1.3 TB/s one element
 * a thread (BENCHMARKS.md). The same roundings. */
__global__ void f32_to_f16x4_kernel(const float4 *__restrict__ x, uint2 *__restrict__ y, int64_t n4)
{
    m40k_pdl_begin();
    M40K_LAUNDER(x);
    M40K_LAUNDER(y);
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n4; i += (int64_t)gridDim.x * blockDim.x) {
        const float4 v = x[i];
        y[i] = make_uint2(m40k_f2h(v.x) | (uint32_t)m40k_f2h(v.y) << 16, m40k_f2h(v.z) | (uint32_t)m40k_f2h(v.w) << 16);
    }
}

extern "C" int m40k_f32_to_f16(const float *x, uint16_t *y, int64_t n, m40k_stream stream)
{
    if (n <= 0)
        return 0;
    if (n % 4 == 0 && ((uintptr_t)x & 15) == 0 && ((uintptr_t)y & 7) == 0) {
        const int64_t b4 = (n / 4 + 255) / 256;
        M40K_LAUNCH_PDL(f32_to_f16x4_kernel, (int)(b4 < 65535 ? b4 : 65535), 256, 0, stream, (const float4 *)x,
                        (uint2 *)y, n / 4);
        return m40k_launch_status();
    }
    int64_t blocks = (n + 255) / 256;
    M40K_LAUNCH_PDL(f32_to_f16_kernel, (int)(blocks < 65535 ? blocks : 65535), 256, 0, stream, x, y, n);
    return m40k_launch_status();
}

__global__ void add_bias_kernel(float *__restrict__ y, int64_t ys, const float *__restrict__ b, int cols)
{
    float *row = y + (int64_t)blockIdx.x * ys;
    for (int c = threadIdx.x; c < cols; c += blockDim.x)
        row[c] += b[c];
}

extern "C" int m40k_add_bias(float *y, int64_t y_stride, const float *bias, int rows, int cols, m40k_stream stream)
{
    if (rows <= 0 || cols <= 0)
        return 0;
    add_bias_kernel<<<rows, 256, 0, stream>>>(y, y_stride, bias, cols);
    return m40k_launch_status();
}

__global__ void gather_rows_kernel(float *__restrict__ dst, int64_t ds, const float *__restrict__ src, int64_t ss,
                                   const int32_t *__restrict__ rows, int dim)
{
    const float *s = src + (int64_t)rows[blockIdx.x] * ss;
    float *d = dst + (int64_t)blockIdx.x * ds;
    for (int i = threadIdx.x; i < dim; i += blockDim.x)
        d[i] = s[i];
}

extern "C" int m40k_gather_rows(float *dst, int64_t dst_stride, const float *src, int64_t src_stride,
                                const int32_t *rows, int n, int dim, m40k_stream stream)
{
    if (n <= 0 || dim <= 0)
        return 0;
    gather_rows_kernel<<<n, 256, 0, stream>>>(dst, dst_stride, src, src_stride, rows, dim);
    return m40k_launch_status();
}

#define AG_T 128
#define AG_MAXD 512

__global__ __launch_bounds__(AG_T) void attn_generic_kernel(
    float *__restrict__ out, int64_t os, const float *__restrict__ q, int64_t qs, const int32_t *__restrict__ row_seq,
    const int32_t *__restrict__ row_pos, const uint16_t *__restrict__ kc, const uint16_t *__restrict__ vc,
    const int32_t *__restrict__ indptr, const int32_t *__restrict__ indices, int n_heads, int n_kv_heads, int hd,
    float scale, int window, float softcap, const float *__restrict__ sinks)
{
    __shared__ float qv[AG_MAXD], acc[AG_MAXD], p[AG_T], red_m[AG_T / 32], red_s[AG_T / 32];
    __shared__ float m_run, l_run, alpha_s;
    const int row = blockIdx.x, h = blockIdx.y, tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
    const int s = row_seq[row], pos = row_pos[row];
    const int kvh = h / (n_heads / n_kv_heads);
    const int page0 = indptr[s];
    for (int d = tid; d < hd; d += AG_T) {
        qv[d] = q[(int64_t)row * qs + (int64_t)h * hd + d] * scale;
        acc[d] = 0.0f;
    }
    if (tid == 0)
        m_run = -INFINITY, l_run = 0.0f, alpha_s = 0.0f;
    __syncthreads();
    const int first = window > 0 ? max(0, pos - window + 1) : 0;
    for (int t0 = first; t0 <= pos; t0 += AG_T) {
        const int t = t0 + tid;
        float sc = -INFINITY;
        if (t <= pos) {
            const int64_t blk = indices[page0 + t / M40K_PAGE];
            const uint16_t *kr = kc + (((size_t)blk * n_kv_heads + kvh) * M40K_PAGE + t % M40K_PAGE) * hd;
            float dsum = 0.0f;
            for (int d = 0; d < hd; d++)
                dsum = fmaf(qv[d], m40k_h2f(kr[d]), dsum);
            sc = softcap > 0.0f ? softcap * tanhf(dsum / softcap) : dsum; /* Gemma 2's q.k soft-cap */
        }
        float mx = m40k_warp_max(sc);
        if (lane == 0)
            red_m[w] = mx;
        __syncthreads();
        if (tid == 0) {
            float m = red_m[0];
            for (int i = 1; i < AG_T / 32; i++)
                m = fmaxf(m, red_m[i]);
            const float m_new = fmaxf(m_run, m);
            alpha_s = __expf(m_run - m_new);
            m_run = m_new;
        }
        __syncthreads();
        const float pv = t <= pos ? __expf(sc - m_run) : 0.0f;
        p[tid] = pv;
        const float ps = m40k_warp_sum(pv);
        if (lane == 0)
            red_s[w] = ps;
        __syncthreads();
        if (tid == 0) {
            float sum = 0.0f;
            for (int i = 0; i < AG_T / 32; i++)
                sum += red_s[i];
            l_run = l_run * alpha_s + sum;
        }
        const int cnt = min(AG_T, pos + 1 - t0);
        for (int d = tid; d < hd; d += AG_T) {
            float a = acc[d] * alpha_s;
            for (int j = 0; j < cnt; j++) {
                const int tt = t0 + j;
                const int64_t blk = indices[page0 + tt / M40K_PAGE];
                a = fmaf(p[j], m40k_h2f(vc[(((size_t)blk * n_kv_heads + kvh) * M40K_PAGE + tt % M40K_PAGE) * hd + d]),
                         a);
            }
            acc[d] = a;
        }
        __syncthreads();
    }
    const float f = sinks ? m40k_sink_norm(m_run, l_run, sinks[h]) : l_run > 0.0f ? 1.0f / l_run : 0.0f;
    for (int d = tid; d < hd; d += AG_T)
        out[(int64_t)row * os + (int64_t)h * hd + d] = acc[d] * f;
}

extern "C" int m40k_attn_generic_window(float *out, int64_t out_stride, const float *q, int64_t q_stride,
                                        const int32_t *row_seq, const int32_t *row_pos, int n_rows,
                                        const uint16_t *k_cache, const uint16_t *v_cache, const int32_t *indptr,
                                        const int32_t *indices, int n_heads, int n_kv_heads, int head_dim, float scale,
                                        int window, float softcap, m40k_stream stream)
{
    return m40k_attn_generic_sinks(out, out_stride, q, q_stride, row_seq, row_pos, n_rows, k_cache, v_cache, indptr,
                                   indices, n_heads, n_kv_heads, head_dim, scale, window, softcap, nullptr, stream);
}

extern "C" int m40k_attn_generic_sinks(float *out, int64_t out_stride, const float *q, int64_t q_stride,
                                       const int32_t *row_seq, const int32_t *row_pos, int n_rows,
                                       const uint16_t *k_cache, const uint16_t *v_cache, const int32_t *indptr,
                                       const int32_t *indices, int n_heads, int n_kv_heads, int head_dim, float scale,
                                       int window, float softcap, const float *sinks, m40k_stream stream)
{
    if (n_rows <= 0)
        return 0;
    if (head_dim <= 0 || head_dim > AG_MAXD || n_kv_heads <= 0 || n_heads % n_kv_heads || window < 0 ||
        !(softcap >= 0.0f))
        return M40K_INVALID;
    dim3 grid(n_rows, n_heads);
    attn_generic_kernel<<<grid, AG_T, 0, stream>>>(out, out_stride, q, q_stride, row_seq, row_pos, k_cache, v_cache,
                                                   indptr, indices, n_heads, n_kv_heads, head_dim, scale, window,
                                                   softcap, sinks);
    return m40k_launch_status();
}

extern "C" int m40k_attn_generic(float *out, int64_t out_stride, const float *q, int64_t q_stride,
                                 const int32_t *row_seq, const int32_t *row_pos, int n_rows, const uint16_t *k_cache,
                                 const uint16_t *v_cache, const int32_t *indptr, const int32_t *indices, int n_heads,
                                 int n_kv_heads, int head_dim, float scale, m40k_stream stream)
{
    return m40k_attn_generic_window(out, out_stride, q, q_stride, row_seq, row_pos, n_rows, k_cache, v_cache, indptr,
                                    indices, n_heads, n_kv_heads, head_dim, scale, 0, 0.0f, stream);
}

/* Per-head RMSNorm over a row's q heads then its k heads (m40k_rmsnorm_qk; nk 0:
 * m40k_rmsnorm_heads): one warp per (row, head), its sum of squares by shuffles, then the
 * scale in place; PDL-launched, so it starts with the chain's handshake. */
__global__ void rmsnorm_qk_kernel(float *x, int64_t xs, int nq, int nk, int hd, const float *__restrict__ wq,
                                  const float *__restrict__ wk, int n_items, float eps)
{
    m40k_pdl_begin();
    M40K_LAUNDER(x);
    const int item = blockIdx.x * (blockDim.x / 32) + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (item >= n_items)
        return;
    const int nh = nq + nk, r = item / nh, h = item % nh;
    const float *w = h < nq ? wq : wk;
    float *v = x + (int64_t)r * xs + (int64_t)h * hd;
    float ss = 0.0f;
    for (int d = lane; d < hd; d += 32)
        ss = fmaf(v[d], v[d], ss);
    ss = m40k_warp_sum(ss);
    const float rs = rsqrtf(ss / (float)hd + eps);
    for (int d = lane; d < hd; d += 32)
        v[d] = v[d] * rs * w[d];
}

extern "C" int m40k_rmsnorm_qk(float *x, int64_t x_stride, int n_q_heads, int n_k_heads, int head_dim, const float *wq,
                               const float *wk, int rows, float eps, m40k_stream stream)
{
    if (rows <= 0 || n_q_heads + n_k_heads <= 0)
        return 0;
    if (head_dim <= 0 || n_q_heads < 0 || n_k_heads < 0)
        return M40K_INVALID;
    const int64_t items = (int64_t)rows * (n_q_heads + n_k_heads);
    if (items > 0x7fffffffL)
        return M40K_INVALID;
    const int e = m40k_launch_pdl_smem(rmsnorm_qk_kernel, dim3((unsigned)((items + 7) / 8)), dim3(256), 0,
                                       (cudaStream_t)stream, x, x_stride, n_q_heads, n_k_heads, head_dim, wq, wk,
                                       (int)items, eps);
    return e ? e : m40k_launch_status();
}

extern "C" int m40k_rmsnorm_heads(float *x, int64_t x_stride, int n_heads, int head_dim, const float *w, int rows,
                                  float eps, m40k_stream stream)
{
    return m40k_rmsnorm_qk(x, x_stride, n_heads, 0, head_dim, w, w, rows, eps, stream);
}

__global__ void scale_kernel(float *__restrict__ x, int64_t n, float s)
{
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        x[i] *= s;
}

extern "C" int m40k_scale(float *x, int64_t n, float s, m40k_stream stream)
{
    if (n <= 0)
        return 0;
    int64_t blocks = (n + 255) / 256;
    scale_kernel<<<(int)(blocks < 65535 ? blocks : 65535), 256, 0, stream>>>(x, n, s);
    return m40k_launch_status();
}

__global__ void softcap_kernel(float *__restrict__ x, int64_t n, float cap)
{
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        x[i] = cap * tanhf(x[i] / cap);
}

extern "C" int m40k_softcap(float *x, int64_t n, float cap, m40k_stream stream)
{
    if (n <= 0)
        return 0;
    if (!(cap > 0.0f))
        return M40K_INVALID;
    int64_t blocks = (n + 255) / 256;
    softcap_kernel<<<(int)(blocks < 65535 ? blocks : 65535), 256, 0, stream>>>(x, n, cap);
    return m40k_launch_status();
}
