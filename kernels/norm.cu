/* RMSNorm: one block per row; sum of squares in F32 per thread, block reduction, then
 * a second pass over the (cache-hot) row writes the scaled output. Any dim. */
#include "cuda_common.h"
#include "q8_dev.h"

__global__ void rmsnorm_kernel(const float *__restrict__ x, int64_t x_stride, const float *__restrict__ w,
                               void *__restrict__ out, int out_f16, int64_t out_stride, int dim, float eps)
{
    m40k_pdl_begin(); /* PDL-launched; a PDL-launched kernel may follow */
    M40K_LAUNDER(x);
    M40K_LAUNDER(w);
    M40K_LAUNDER(out);
    __shared__ float partial[32];
    const float *xr = x + blockIdx.x * x_stride;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x)
        ss += xr[i] * xr[i];
    const float scale = rsqrtf(m40k_block_sum(ss, partial) / dim + eps);
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        float v = xr[i] * scale * w[i];
        if (out_f16)
            ((uint16_t *)out)[blockIdx.x * out_stride + i] = m40k_f2h(v);
        else
            ((float *)out)[blockIdx.x * out_stride + i] = v;
    }
}

extern "C" int m40k_rmsnorm(const float *x, int64_t x_stride, const float *w, void *out, int out_type,
                            int64_t out_stride, int rows, int dim, float eps, m40k_stream stream)
{
    if (rows <= 0)
        return 0;
    if (dim <= 0 || (out_type != M40K_TYPE_F32 && out_type != M40K_TYPE_F16))
        return M40K_INVALID;
    int threads = dim >= 1024 ? 1024 : (dim + 31) / 32 * 32;
    M40K_LAUNCH_PDL(rmsnorm_kernel, rows, threads, 0, stream, x, x_stride, w, out, out_type == M40K_TYPE_F16,
                    out_stride, dim, eps);
    return m40k_launch_status();
}

/* Residual add fused with the next RMSNorm (one block per row):
 *   x[r] += d[r];  out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w
 * The first pass writes the sum back to x, keeps its sum of squares and holds the
 * thread's first AR_REG sums and weights in registers (rows up to AR_REG * blockDim.x,
 * 8192 wide at 1024 threads), so that the second pass after the block reduction has no
 * dependent global loads; longer rows re-read the rest. out may be d. */
#define AR_REG 8
__global__ void add_rmsnorm_kernel(float *__restrict__ x, int64_t x_stride, const float *d, int64_t d_stride,
                                   const float *__restrict__ w, float *out, int64_t out_stride, int dim, float eps,
                                   gq_blk *__restrict__ xq, uint16_t *__restrict__ o16)
{
    m40k_pdl_begin(); /* PDL-launched; a PDL-launched kernel may follow */
    M40K_LAUNDER(x);
    M40K_LAUNDER(d);
    M40K_LAUNDER(w);
    M40K_LAUNDER(out);
    M40K_LAUNDER(xq);
    M40K_LAUNDER(o16);
    __shared__ float partial[32];
    float *xr = x + blockIdx.x * x_stride;
    const float *dr = d + blockIdx.x * d_stride;
    float ss = 0.0f, xv[AR_REG], wv[AR_REG];
#pragma unroll
    for (int k = 0; k < AR_REG; k++) {
        const int i = threadIdx.x + k * blockDim.x;
        xv[k] = wv[k] = 0.0f;
        if (i < dim) {
            const float v = xr[i] + dr[i];
            xr[i] = v;
            ss += v * v;
            xv[k] = v;
            wv[k] = w[i];
        }
    }
    for (int i = threadIdx.x + AR_REG * blockDim.x; i < dim; i += blockDim.x) {
        const float v = xr[i] + dr[i];
        xr[i] = v;
        ss += v * v;
    }
    const float scale = rsqrtf(m40k_block_sum(ss, partial) / dim + eps);
    float *orow = out + blockIdx.x * out_stride;
    /* element i's output o, and its int8 / F16 copies where asked (with xq: dim % 32 == 0
     * and blockDim.x % 32 == 0, so a warp holds one whole block) */
    auto emit = [&](int i, float o) {
        orow[i] = o;
        if (xq)
            gq_quantize_block(o, threadIdx.x & 31, xq + (size_t)blockIdx.x * (dim / 32) + i / 32);
        if (o16)
            o16[(size_t)blockIdx.x * dim + i] = m40k_f2h(o);
    };
#pragma unroll
    for (int k = 0; k < AR_REG; k++) {
        const int i = threadIdx.x + k * blockDim.x;
        if (i < dim)
            emit(i, xv[k] * scale * wv[k]);
    }
    for (int i = threadIdx.x + AR_REG * blockDim.x; i < dim; i += blockDim.x)
        emit(i, xr[i] * scale * w[i]);
}

/* xq: also the int8 quantization of out (dim a multiple of 32); o16: also its F16 copy */
static int add_rmsnorm_launch(float *x, int64_t x_stride, const float *d, int64_t d_stride, const float *w, float *out,
                              int64_t out_stride, int rows, int dim, float eps, gq_blk *xq, uint16_t *o16,
                              m40k_stream stream)
{
    if (rows <= 0)
        return 0;
    if (dim <= 0 || (xq && dim % 32))
        return M40K_INVALID;
    int threads = dim >= 1024 ? 1024 : (dim + 31) / 32 * 32;
    M40K_LAUNCH_PDL(add_rmsnorm_kernel, rows, threads, 0, stream, x, x_stride, d, d_stride, w, out, out_stride, dim,
                    eps, xq, o16);
    return m40k_launch_status();
}

extern "C" int m40k_add_rmsnorm(float *x, int64_t x_stride, const float *d, int64_t d_stride, const float *w,
                                float *out, int64_t out_stride, int rows, int dim, float eps, m40k_stream stream)
{
    return add_rmsnorm_launch(x, x_stride, d, d_stride, w, out, out_stride, rows, dim, eps, nullptr, nullptr, stream);
}

extern "C" int m40k_add_rmsnorm_q8(float *x, int64_t x_stride, const float *d, int64_t d_stride, const float *w,
                                   float *out, int64_t out_stride, int rows, int dim, float eps, void *xq,
                                   m40k_stream stream)
{
    if (!xq && rows > 0)
        return M40K_INVALID;
    return add_rmsnorm_launch(x, x_stride, d, d_stride, w, out, out_stride, rows, dim, eps, (gq_blk *)xq, nullptr,
                              stream);
}

extern "C" int m40k_add_rmsnorm_f16(float *x, int64_t x_stride, const float *d, int64_t d_stride, const float *w,
                                    float *out, int64_t out_stride, int rows, int dim, float eps, uint16_t *out16,
                                    m40k_stream stream)
{
    if (!out16 && rows > 0)
        return M40K_INVALID;
    return add_rmsnorm_launch(x, x_stride, d, d_stride, w, out, out_stride, rows, dim, eps, nullptr, out16, stream);
}
