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

/* Many rows without the int8 records (prefill chunks): a block a row, four elements a
 * thread and round in 16-byte loads, the thread's sums and weights held for the second
 * pass (rows up to 16 * blockDim.x wide), the F16 copy in 8-byte stores (rows o16_stride
 * apart). One element a thread at 1,024 threads ran at a quarter of the bandwidth in a
 * prefill chunk (BENCHMARKS.md). x_out may be x (each thread rewrites only what it read).
 * d and x_out NULL: the norm of x alone (m40k_rmsnorm's rows that allow 16-byte loads: a
 * prompt chunk's norm of a residual that cuBLAS added itself). */
#define AR4_V 4
__global__ void add_rmsnorm4_kernel(const float *x, float *x_out, int64_t x_stride, const float *d, int64_t d_stride,
                                    const float *__restrict__ w, float *out, int64_t out_stride, int dim, float eps,
                                    uint16_t *__restrict__ o16, int64_t o16_stride)
{
    m40k_pdl_begin();
    M40K_LAUNDER(x);
    M40K_LAUNDER(x_out);
    M40K_LAUNDER(d);
    M40K_LAUNDER(w);
    M40K_LAUNDER(out);
    M40K_LAUNDER(o16);
    __shared__ float partial[32];
    const int r = blockIdx.x, n4 = dim / 4;
    float4 xv[AR4_V], wv[AR4_V];
    float ss = 0.0f;
#pragma unroll
    for (int k = 0; k < AR4_V; k++) {
        const int j = threadIdx.x + k * blockDim.x;
        xv[k] = wv[k] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (j < n4) {
            float4 v = *reinterpret_cast<const float4 *>(x + r * x_stride + 4 * j);
            if (d) {
                const float4 b = *reinterpret_cast<const float4 *>(d + r * d_stride + 4 * j);
                v = make_float4(v.x + b.x, v.y + b.y, v.z + b.z, v.w + b.w);
            }
            if (x_out)
                *reinterpret_cast<float4 *>(x_out + r * x_stride + 4 * j) = v;
            ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
            xv[k] = v;
            wv[k] = *reinterpret_cast<const float4 *>(w + 4 * j);
        }
    }
    const float scale = rsqrtf(m40k_block_sum(ss, partial) / dim + eps);
#pragma unroll
    for (int k = 0; k < AR4_V; k++) {
        const int j = threadIdx.x + k * blockDim.x;
        if (j < n4) {
            const float4 o = make_float4(xv[k].x * scale * wv[k].x, xv[k].y * scale * wv[k].y,
                                         xv[k].z * scale * wv[k].z, xv[k].w * scale * wv[k].w);
            if (out)
                *reinterpret_cast<float4 *>(out + r * out_stride + 4 * j) = o;
            if (o16)
                *reinterpret_cast<uint2 *>(o16 + r * o16_stride + 4 * j) = m40k_pack_h4(o);
        }
    }
}

extern "C" int m40k_rmsnorm(const float *x, int64_t x_stride, const float *w, void *out, int out_type,
                            int64_t out_stride, int rows, int dim, float eps, m40k_stream stream)
{
    if (rows <= 0)
        return 0;
    if (dim <= 0 || (out_type != M40K_TYPE_F32 && out_type != M40K_TYPE_F16))
        return M40K_INVALID;
    const int f16 = out_type == M40K_TYPE_F16;
    if (dim % 4 == 0 && dim <= 4 * AR4_V * 1024 && x_stride % 4 == 0 && out_stride % 4 == 0 &&
        ((uintptr_t)x & 15) == 0 && ((uintptr_t)w & 15) == 0 && ((uintptr_t)out & (f16 ? 7 : 15)) == 0 &&
        (const void *)x != out) {
        const int t4 = (dim / 4 + AR4_V - 1) / AR4_V, nt4 = (t4 + 31) / 32 * 32;
        M40K_LAUNCH_PDL(add_rmsnorm4_kernel, rows, nt4, 0, stream, x, (float *)nullptr, x_stride, (const float *)nullptr,
                        (int64_t)0, w, f16 ? nullptr : (float *)out, out_stride, dim, eps,
                        f16 ? (uint16_t *)out : nullptr, out_stride);
        return m40k_launch_status();
    }
    int threads = dim >= 1024 ? 1024 : (dim + 31) / 32 * 32;
    M40K_LAUNCH_PDL(rmsnorm_kernel, rows, threads, 0, stream, x, x_stride, w, out, out_type == M40K_TYPE_F16,
                    out_stride, dim, eps);
    return m40k_launch_status();
}

/* Residual add fused with the next RMSNorm (one block per row):
 *   x_out[r] = x[r] + d[r];  out[r] = x_out[r] / sqrt(mean(x_out[r]^2) + eps) * w
 * (x_out may be x). The first pass writes the sum to x_out, keeps its sum of squares and
 * holds the thread's first AR_REG sums and weights in registers (rows up to AR_REG *
 * blockDim.x, 8192 wide at 1024 threads), so that the second pass after the block
 * reduction has no dependent global loads; longer rows re-read the rest. out may be d. */
#define AR_REG 8
/* Element i of row r: its output o, and the int8 / F16 copies where asked (with xq:
 * dim % 32 == 0 and blockDim.x % 32 == 0, so a warp holds one whole block). */
__device__ __forceinline__ void ar_emit(int i, float o, int r, float *out, int64_t out_stride, int dim, gq_blk *xq,
                                        uint16_t *o16)
{
    if (out)
        out[r * out_stride + i] = o;
    if (xq)
        gq_quantize_block(o, threadIdx.x & 31, xq + (size_t)r * (dim / 32) + i / 32);
    if (o16)
        o16[(size_t)r * dim + i] = m40k_f2h(o);
}

/* Elements i0 + j, j = threadIdx.x + k*blockDim.x < n, k < AR_REG, of a row: x + d
 * written to xo (which may be xr), the sums and their weights held in xv / wv for the
 * second pass; returns the thread's sum of squares over them. */
__device__ __forceinline__ float ar_add_hold(const float *xr, float *xo, const float *dr, const float *w, int i0, int n,
                                             float (&xv)[AR_REG], float (&wv)[AR_REG])
{
    float ss = 0.0f;
#pragma unroll
    for (int k = 0; k < AR_REG; k++) {
        const int j = threadIdx.x + k * blockDim.x;
        xv[k] = wv[k] = 0.0f;
        if (j < n) {
            const float v = xr[i0 + j] + dr[i0 + j];
            xo[i0 + j] = v;
            ss += v * v;
            xv[k] = v;
            wv[k] = w[i0 + j];
        }
    }
    return ss;
}

/* The outputs of the elements ar_add_hold held, scaled (row r). */
__device__ __forceinline__ void ar_emit_held(const float (&xv)[AR_REG], const float (&wv)[AR_REG], float scale,
                                             int i0, int n, int r, float *out, int64_t out_stride, int dim,
                                             gq_blk *xq, uint16_t *o16)
{
#pragma unroll
    for (int k = 0; k < AR_REG; k++) {
        const int j = threadIdx.x + k * blockDim.x;
        if (j < n)
            ar_emit(i0 + j, xv[k] * scale * wv[k], r, out, out_stride, dim, xq, o16);
    }
}

__global__ void add_rmsnorm_kernel(const float *x, float *x_out, int64_t x_stride, const float *d, int64_t d_stride,
                                   const float *__restrict__ w, float *out, int64_t out_stride, int dim, float eps,
                                   gq_blk *__restrict__ xq, uint16_t *__restrict__ o16)
{
    m40k_pdl_begin(); /* PDL-launched; a PDL-launched kernel may follow */
    M40K_LAUNDER(x);
    M40K_LAUNDER(x_out);
    M40K_LAUNDER(d);
    M40K_LAUNDER(w);
    M40K_LAUNDER(out);
    M40K_LAUNDER(xq);
    M40K_LAUNDER(o16);
    __shared__ float partial[32];
    const float *xr = x + blockIdx.x * x_stride;
    float *xo = x_out + blockIdx.x * x_stride;
    const float *dr = d + blockIdx.x * d_stride;
    float xv[AR_REG], wv[AR_REG];
    float ss = ar_add_hold(xr, xo, dr, w, 0, dim, xv, wv);
    for (int i = threadIdx.x + AR_REG * blockDim.x; i < dim; i += blockDim.x) {
        const float v = xr[i] + dr[i];
        xo[i] = v;
        ss += v * v;
    }
    const float scale = rsqrtf(m40k_block_sum(ss, partial) / dim + eps);
    ar_emit_held(xv, wv, scale, 0, dim, blockIdx.x, out, out_stride, dim, xq, o16);
    for (int i = threadIdx.x + AR_REG * blockDim.x; i < dim; i += blockDim.x)
        ar_emit(i, xo[i] * scale * w[i], blockIdx.x, out, out_stride, dim, xq, o16);
}

#define AR_BLOCKS 16   /* blocks a row of the one-round kernel below */
#define AR_THREADS 256 /* its threads a block, at most */
#define AR_MAX_ROWS 16 /* more rows fill the GPU with the single-block kernel */
/* Rows of up to AR_MAX_ROWS, out of place (x_out and out apart from x and d), of a width
 * that is a multiple of 32*AR_BLOCKS and up to 4*AR_REG*AR_THREADS, at 16-byte strides:
 * AR_BLOCKS blocks a row. At one row the single-block kernel is bound by one SM's issue
 * rate (the quantization's warp reductions for all 4,096 elements); here each block reads
 * the WHOLE row in one round of 16-byte loads, sums its squares itself (every block the
 * same sum, in the same order: the same scale in all of them) and writes its slice, one
 * element a thread at 4,096 (a warp holds whole 32-element quantization blocks). The
 * blocks exchange nothing; the price is AR_BLOCKS reads of the row from L2 (32 KB at
 * 4,096). H100, Mistral-7B batch-1 decode, against the previous version (a cluster of 16
 * blocks exchanging their partial sums through distributed shared memory), one call:
 * Q4_K_M 393.5/394.4 -> 403.4/404.4 tok/s, Q8_0 302.4/302.0 -> 307.7/308.4, F16
 * 181.8/181.8 -> 186.2/186.1; 8 blocks a row measured 2% slower, 32 the same as 16. With
 * the row read as 16 scalar loads a thread, unrolled by 4 (four dependent rounds), it was
 * 5% SLOWER than the cluster: on the decode chain every dependent round trip of a small
 * kernel counts. In place, one block's writes of x (or of out = d) could reach another
 * block before that one read them: in-place calls take the single-block kernel. */
__global__ __launch_bounds__(AR_THREADS) void add_rmsnorm_rep_kernel(const float *x, float *x_out, int64_t x_stride,
                                                                        const float *d, int64_t d_stride,
                                                                        const float *__restrict__ w, float *out,
                                                                        int64_t out_stride, int dim, float eps,
                                                                        gq_blk *__restrict__ xq,
                                                                        uint16_t *__restrict__ o16)
{
    m40k_grid_launch_dependents(); /* a PDL-launched kernel may follow */
    const int row = blockIdx.y, slice = dim / AR_BLOCKS, i0 = (int)blockIdx.x * slice;
    float wv[AR_REG]; /* the slice's weights: no kernel of the step writes them, so before the wait */
#pragma unroll
    for (int k = 0; k < AR_REG; k++) {
        const int j = threadIdx.x + k * blockDim.x;
        wv[k] = j < slice ? w[i0 + j] : 0.0f;
    }
    m40k_grid_wait(); /* PDL-launched: x and d are the previous kernels' */
    M40K_LAUNDER(x);
    M40K_LAUNDER(x_out);
    M40K_LAUNDER(d);
    M40K_LAUNDER(out);
    M40K_LAUNDER(xq);
    M40K_LAUNDER(o16);
    __shared__ float partial[32];
    const float *xr = x + row * x_stride, *dr = d + row * d_stride;
    /* the whole row in one round of 16-byte loads (up to AR_REG a thread of x and of d) */
    const float4 *x4 = reinterpret_cast<const float4 *>(xr), *d4 = reinterpret_cast<const float4 *>(dr);
    float4 a[AR_REG], b[AR_REG];
#pragma unroll
    for (int k = 0; k < AR_REG; k++) {
        const int f = threadIdx.x + k * blockDim.x;
        if (f < dim / 4)
            a[k] = x4[f], b[k] = d4[f];
    }
    float ss = 0.0f;
#pragma unroll
    for (int k = 0; k < AR_REG; k++) {
        const int f = threadIdx.x + k * blockDim.x;
        if (f < dim / 4) {
            const float v0 = a[k].x + b[k].x, v1 = a[k].y + b[k].y, v2 = a[k].z + b[k].z, v3 = a[k].w + b[k].w;
            ss += v0 * v0;
            ss += v1 * v1;
            ss += v2 * v2;
            ss += v3 * v3;
        }
    }
    const float scale = rsqrtf(m40k_block_sum(ss, partial) / dim + eps);
#pragma unroll
    for (int k = 0; k < AR_REG; k++) {
        const int j = threadIdx.x + k * blockDim.x;
        if (j < slice) { /* whole warps: slice and blockDim.x are multiples of 32 */
            const float v = xr[i0 + j] + dr[i0 + j];
            x_out[row * x_stride + i0 + j] = v;
            ar_emit(i0 + j, v * scale * wv[k], row, out, out_stride, dim, xq, o16);
        }
    }
}

/* whether rows x [p, p + (rows-1)*stride + dim) of floats and of q overlap (never, for a
 * NULL p) */
static bool ar_overlap(const float *p, int64_t ps, const float *q, int64_t qs, int rows, int dim)
{
    if (!p)
        return false;
    const float *pe = p + (rows - 1) * ps + dim, *qe = q + (rows - 1) * qs + dim;
    return p < qe && q < pe;
}

/* xq: also the int8 quantization of out (dim a multiple of 32); o16: also its F16 copy */
/* any_rows: one kernel for every row count (2f), never the replicated one of few rows */
static int add_rmsnorm_launch(const float *x, float *x_out, int64_t x_stride, const float *d, int64_t d_stride,
                              const float *w, float *out, int64_t out_stride, int rows, int dim, float eps, gq_blk *xq,
                              uint16_t *o16, m40k_stream stream, bool any_rows = false)
{
    if (rows <= 0)
        return 0;
    if (dim <= 0 || (xq && dim % 32) || (!out && !xq && !o16))
        return M40K_INVALID;
    const int threads = dim / AR_BLOCKS < AR_THREADS ? dim / AR_BLOCKS : AR_THREADS;
    if (!any_rows && rows <= AR_MAX_ROWS && dim % (AR_BLOCKS * 32) == 0 && dim <= 4 * AR_REG * threads &&
        x_stride % 4 == 0 && d_stride % 4 == 0 && ((uintptr_t)x & 15) == 0 && ((uintptr_t)d & 15) == 0 &&
        !ar_overlap(x_out, x_stride, x, x_stride, rows, dim) && !ar_overlap(x_out, x_stride, d, d_stride, rows, dim) &&
        !ar_overlap(out, out_stride, x, x_stride, rows, dim) && !ar_overlap(out, out_stride, d, d_stride, rows, dim)) {
        M40K_LAUNCH_PDL(add_rmsnorm_rep_kernel, dim3(AR_BLOCKS, (unsigned)rows), threads, 0, stream, x, x_out,
                        x_stride, d, d_stride, w, out, out_stride, dim, eps, xq, o16);
        return m40k_launch_status();
    }
    if (!xq && (any_rows || rows > AR_MAX_ROWS) && dim % 4 == 0 && dim <= 16 * 1024 && x_stride % 4 == 0 &&
        d_stride % 4 == 0 && (!out || out_stride % 4 == 0) && ((uintptr_t)x & 15) == 0 &&
        ((uintptr_t)x_out & 15) == 0 && ((uintptr_t)d & 15) == 0 && ((uintptr_t)w & 15) == 0 &&
        ((uintptr_t)out & 15) == 0 && ((uintptr_t)o16 & 7) == 0 &&
        !(out && ar_overlap(out, out_stride, x, x_stride, rows, dim))) {
        const int t4 = (dim / 4 + AR4_V - 1) / AR4_V, nt4 = (t4 + 31) / 32 * 32;
        M40K_LAUNCH_PDL(add_rmsnorm4_kernel, rows, nt4, 0, stream, x, x_out, x_stride, d, d_stride, w, out, out_stride,
                        dim, eps, o16, (int64_t)dim);
        return m40k_launch_status();
    }
    int nt = dim >= 1024 ? 1024 : (dim + 31) / 32 * 32;
    M40K_LAUNCH_PDL(add_rmsnorm_kernel, rows, nt, 0, stream, x, x_out, x_stride, d, d_stride, w, out, out_stride, dim,
                    eps, xq, o16);
    return m40k_launch_status();
}

extern "C" int m40k_add_rmsnorm_to(const float *x, int64_t x_stride, const float *d, int64_t d_stride, float *x_out,
                                   const float *w, float *out, int64_t out_stride, int rows, int dim, float eps,
                                   void *xq, uint16_t *out16, m40k_stream stream)
{
    return add_rmsnorm_launch(x, x_out, x_stride, d, d_stride, w, out, out_stride, rows, dim, eps, (gq_blk *)xq, out16,
                              stream);
}

extern "C" int m40k_add_rmsnorm_to_any(const float *x, int64_t x_stride, const float *d, int64_t d_stride,
                                       float *x_out, const float *w, float *out, int64_t out_stride, int rows, int dim,
                                       float eps, uint16_t *out16, m40k_stream stream)
{
    return add_rmsnorm_launch(x, x_out, x_stride, d, d_stride, w, out, out_stride, rows, dim, eps, nullptr, out16,
                              stream, true);
}

extern "C" int m40k_add_rmsnorm(float *x, int64_t x_stride, const float *d, int64_t d_stride, const float *w,
                                float *out, int64_t out_stride, int rows, int dim, float eps, m40k_stream stream)
{
    return add_rmsnorm_launch(x, x, x_stride, d, d_stride, w, out, out_stride, rows, dim, eps, nullptr, nullptr, stream);
}

extern "C" int m40k_add_rmsnorm_q8(float *x, int64_t x_stride, const float *d, int64_t d_stride, const float *w,
                                   float *out, int64_t out_stride, int rows, int dim, float eps, void *xq,
                                   m40k_stream stream)
{
    if (!xq && rows > 0)
        return M40K_INVALID;
    return add_rmsnorm_launch(x, x, x_stride, d, d_stride, w, out, out_stride, rows, dim, eps, (gq_blk *)xq, nullptr,
                              stream);
}

extern "C" int m40k_add_rmsnorm_f16(float *x, int64_t x_stride, const float *d, int64_t d_stride, const float *w,
                                    float *out, int64_t out_stride, int rows, int dim, float eps, uint16_t *out16,
                                    m40k_stream stream)
{
    if (!out16 && rows > 0)
        return M40K_INVALID;
    return add_rmsnorm_launch(x, x, x_stride, d, d_stride, w, out, out_stride, rows, dim, eps, nullptr, out16, stream);
}
