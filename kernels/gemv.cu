/* Quantized GEMV for decode batches: y[b][n] = W[n] . x[b], batch 1..8.
 *
 * One warp per weight row, 4 warps per block. The row is walked in segments of 1024
 * elements (a whole number of quant blocks of every type). For each segment the warp
 * copies the segment's bytes, widened to 16-byte boundaries, with 16-byte loads into
 * its slice of shared memory; the loads of the NEXT segment are issued into registers
 * before the current one is computed, so a segment's latency hides behind the previous
 * segment's arithmetic. Quant blocks are 18/34/144/210 bytes, so staging is what lets
 * every global load be a full 16-byte vector whatever the block alignment.
 *
 * Lane l takes elements 8l + 256i (i < 4) of the segment: x is read as float4 pairs,
 * coalesced across the warp, and each group of 8 weights shares one scale sub-block, so
 * it is dequantized in registers as small integers (no I2F: the 2^23 trick in
 * quant_dev.h) and scaled once per group: scale*sum(q*x) - offset*sum(x). Partial sums
 * are F32, reduced over the warp at the end. */
#include "quant_dev.h"

#define GEMV_WARPS 4
#define GEMV_SEG 1024

template <int T> struct gemv_cfg {
    typedef m40k_tinfo<T> ti;
    enum { SEGB = GEMV_SEG / ti::BE * ti::BB, CH = ((SEGB + 15) / 16 + 1 + 31) / 32 };
};

template <int T, int B>
__global__ __launch_bounds__(GEMV_WARPS * 32) void gemv_kernel(const uint8_t *__restrict__ w, size_t row_bytes, int N,
                                                               int K, const float *__restrict__ x, int64_t x_stride,
                                                               float *__restrict__ y, int64_t y_stride)
{
    typedef m40k_tinfo<T> ti;
    constexpr int CH = gemv_cfg<T>::CH;
    __shared__ __align__(16) uint8_t sbuf[GEMV_WARPS][CH * 32 * 16];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int n = blockIdx.x * GEMV_WARPS + warp;
    if (n >= N)
        return; /* no block-wide barriers below */
    const uint8_t *row = w + (size_t)n * row_bytes;
    uint8_t *buf = sbuf[warp];
    const int nseg = (K + GEMV_SEG - 1) / GEMV_SEG;

    uint4 r[CH];
    auto fetch = [&](int sg) {
        const int elems = min(GEMV_SEG, K - sg * GEMV_SEG);
        const uintptr_t b0 = (uintptr_t)(row + (size_t)sg * (GEMV_SEG / ti::BE * ti::BB));
        const uintptr_t b1 = b0 + (size_t)elems / ti::BE * ti::BB;
        const uint4 *a0 = reinterpret_cast<const uint4 *>(b0 & ~(uintptr_t)15);
        const int nch = (int)((((b1 + 15) & ~(uintptr_t)15) - (b0 & ~(uintptr_t)15)) / 16);
#pragma unroll
        for (int c = 0; c < CH; c++)
            if (lane + 32 * c < nch)
                r[c] = __ldcs(a0 + lane + 32 * c); /* streamed once: evict first */
    };

    float acc[B];
#pragma unroll
    for (int b = 0; b < B; b++)
        acc[b] = 0.0f;
    fetch(0);
    for (int sg = 0; sg < nseg; sg++) {
#pragma unroll
        for (int c = 0; c < CH; c++)
            reinterpret_cast<uint4 *>(buf)[lane + 32 * c] = r[c];
        const int off = (int)((uintptr_t)(row + (size_t)sg * (GEMV_SEG / ti::BE * ti::BB)) & 15);
        const int elems = min(GEMV_SEG, K - sg * GEMV_SEG);
        __syncwarp();
        if (sg + 1 < nseg)
            fetch(sg + 1);
        const uint8_t *p = buf + off;
        const float *xs = x + (size_t)sg * GEMV_SEG;
#pragma unroll
        for (int i = 0; i < GEMV_SEG / 256; i++) {
            const int e0 = 8 * lane + 256 * i;
            if (e0 < elems) {
                float q[8], sc, of;
                m40k_group8<T>(p, e0, q, sc, of);
#pragma unroll
                for (int b = 0; b < B; b++) {
                    const float4 xa = __ldg(reinterpret_cast<const float4 *>(xs + b * x_stride + e0));
                    const float4 xb = __ldg(reinterpret_cast<const float4 *>(xs + b * x_stride + e0 + 4));
                    float sqx = q[0] * xa.x;
                    sqx = fmaf(q[1], xa.y, sqx);
                    sqx = fmaf(q[2], xa.z, sqx);
                    sqx = fmaf(q[3], xa.w, sqx);
                    sqx = fmaf(q[4], xb.x, sqx);
                    sqx = fmaf(q[5], xb.y, sqx);
                    sqx = fmaf(q[6], xb.z, sqx);
                    sqx = fmaf(q[7], xb.w, sqx);
                    if (T == M40K_TYPE_F16) {
                        acc[b] += sqx;
                    } else {
                        const float sx = ((xa.x + xa.y) + (xa.z + xa.w)) + ((xb.x + xb.y) + (xb.z + xb.w));
                        acc[b] += fmaf(sc, sqx, -of * sx);
                    }
                }
            }
        }
        __syncwarp();
    }
#pragma unroll
    for (int b = 0; b < B; b++) {
        const float v = m40k_warp_sum(acc[b]);
        if (lane == 0)
            y[b * y_stride + n] = v;
    }
}

template <int T, int B>
static int gemv_launch_b(const void *w, int N, int K, const float *x, int64_t xs, float *y, int64_t ys,
                         cudaStream_t st)
{
    typedef m40k_tinfo<T> ti;
    const size_t row_bytes = (size_t)K / ti::BE * ti::BB;
    gemv_kernel<T, B><<<(N + GEMV_WARPS - 1) / GEMV_WARPS, GEMV_WARPS * 32, 0, st>>>((const uint8_t *)w, row_bytes, N,
                                                                                    K, x, xs, y, ys);
    return m40k_launch_status();
}

template <int T>
static int gemv_launch(const void *w, int N, int K, const float *x, int64_t xs, float *y, int64_t ys, int batch,
                       cudaStream_t st)
{
    switch (batch) {
    case 1: return gemv_launch_b<T, 1>(w, N, K, x, xs, y, ys, st);
    case 2: return gemv_launch_b<T, 2>(w, N, K, x, xs, y, ys, st);
    case 3: return gemv_launch_b<T, 3>(w, N, K, x, xs, y, ys, st);
    case 4: return gemv_launch_b<T, 4>(w, N, K, x, xs, y, ys, st);
    case 5: return gemv_launch_b<T, 5>(w, N, K, x, xs, y, ys, st);
    case 6: return gemv_launch_b<T, 6>(w, N, K, x, xs, y, ys, st);
    case 7: return gemv_launch_b<T, 7>(w, N, K, x, xs, y, ys, st);
    case 8: return gemv_launch_b<T, 8>(w, N, K, x, xs, y, ys, st);
    default: return M40K_INVALID;
    }
}

extern "C" int m40k_gemv(const void *w, int w_type, int N, int K, const float *x, int64_t x_stride, float *y,
                         int64_t y_stride, int batch, m40k_stream stream)
{
    if (N <= 0 || batch <= 0)
        return 0;
    if (K <= 0 || batch > 8 || x_stride % 4 || ((uintptr_t)x & 15))
        return M40K_INVALID;
    switch (w_type) {
    case M40K_TYPE_F16: return K % 8 ? M40K_INVALID : gemv_launch<M40K_TYPE_F16>(w, N, K, x, x_stride, y, y_stride, batch, stream);
    case M40K_TYPE_Q8_0: return K % 32 ? M40K_INVALID : gemv_launch<M40K_TYPE_Q8_0>(w, N, K, x, x_stride, y, y_stride, batch, stream);
    case M40K_TYPE_Q4_0: return K % 32 ? M40K_INVALID : gemv_launch<M40K_TYPE_Q4_0>(w, N, K, x, x_stride, y, y_stride, batch, stream);
    case M40K_TYPE_Q4_K: return K % 256 ? M40K_INVALID : gemv_launch<M40K_TYPE_Q4_K>(w, N, K, x, x_stride, y, y_stride, batch, stream);
    case M40K_TYPE_Q6_K: return K % 256 ? M40K_INVALID : gemv_launch<M40K_TYPE_Q6_K>(w, N, K, x, x_stride, y, y_stride, batch, stream);
    default: return M40K_INVALID;
    }
}
