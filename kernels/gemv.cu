/* Quantized GEMV for decode batches: y[b][n] = W[n] . x[b], batch 1..8.
 *
 * Fast path (F16, BF16, Q8_0, Q4_0, Q4_K, Q6_K with W 16-byte aligned and rows a multiple of
 * 16 bytes: every K that is a multiple of 256, so most real model shapes):
 * gemv_fast_kernel below. Q4_1, Q5_0 and Q5_1 (the fallbacks of K-quant files for rows
 * that are not a multiple of 256, e.g. Gemma 3 270M's 640) take the generic kernel. A block of 4 warps
 * owns 4/S groups of R = 4 rows; the S warps of a group split the row's segments
 * (round robin) and their partial sums meet in shared memory at the end. Each warp
 * walks its segments (512..2048 elements, ~1 KB of each of its R rows) the same way:
 *   - the segment of all R rows is fetched with 16-byte streaming loads into registers
 *     one segment ahead (R*CH loads of 16 B in flight per lane), stored to the warp's
 *     shared buffer, and read back with 32/64/128-bit shared loads (never byte loads);
 *   - lane l takes the 8 elements 8l + 256i of the segment, so x is read as two float4
 *     per batch row, coalesced, ONCE for all R rows (R-fold reuse of x from L1/L2);
 *   - K-quant scales are decoded once per sub-block per segment into shared memory
 *     (one lane per sub-block), not once per group;
 *   - 4- and 6-bit quants become floats with one byte permute each: the byte
 *     0x80|q<<3 (or q<<1) under exponent 0x3F gives f = 1 + q/16 (1 + q/64) exactly, so
 *     sum(q*x) = 16*(sum(f*x) - sum(x)); with w = a*q - m every group folds into
 *     acc += A*sum(f*x) + C*sum(x). F16, BF16 and Q8_0 convert exactly as before.
 * Accumulation is F32 throughout (the CPU twin's semantics; rounding differs only in
 * order). Other alignments take the generic kernel that follows, which is the
 * original one-warp-per-row design (byte-granular staging).
 *
 * Generic kernel: one warp per weight row, 4 warps per block. The row is walked in segments of 1024
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
#include "gemv_fast_dev.h"

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
    m40k_grid_launch_dependents(); /* a PDL-launched GEMV may follow */
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
    x = m40k_grid_wait_for(x); /* x is the previous kernel's output (PDL launch) */
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
                    const float4 xa = __ldca(reinterpret_cast<const float4 *>(xs + b * x_stride + e0));
                    const float4 xb = __ldca(reinterpret_cast<const float4 *>(xs + b * x_stride + e0 + 4));
                    const float sqx = m40k_dot8(q, xa, xb);
                    if (T == M40K_TYPE_F16 || T == M40K_TYPE_BF16) {
                        acc[b] += sqx;
                    } else {
                        const float sx = m40k_sum8(xa, xb);
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

/* ------------------------------------------------------------------ fast path */
/* The fast kernel's pieces (its types' segment sizes, the group decode and the per-segment
 * scales) are in gemv_fast_dev.h, shared with the experts' GEMV (moe.cu). */
#define GF_WARPS 4
#define GF_R 4

template <int T, int B, int MINB>
__global__ __launch_bounds__(GF_WARPS * 32, MINB) void gemv_fast_kernel(const uint8_t *__restrict__ w, size_t row_bytes,
                                                                  int N, int K, int S, const float *__restrict__ x,
                                                                  int64_t x_stride, float *__restrict__ y,
                                                                  int64_t y_stride)
{
    m40k_grid_launch_dependents(); /* a PDL-launched GEMV may follow */
    typedef gf_dims<T> D;
    constexpr int R = GF_R, SEG = D::SEG, SEGB = D::SEGB, CH = D::CH;
    __shared__ __align__(16) uint8_t sbuf[GF_WARPS][R][D::SMB];
    __shared__ __align__(16) float2 ssc[GF_WARPS][R][D::NSC];
    __shared__ float red[GF_WARPS][R][B];

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int groups = GF_WARPS / S, g = warp / S, ks = warp % S;
    const int row0 = (blockIdx.x * groups + g) * R;
    const uint8_t *rowp[R];
#pragma unroll
    for (int r = 0; r < R; r++)
        rowp[r] = w + (size_t)min(row0 + r, N - 1) * row_bytes; /* rows past N: recomputed, not written */
    const int nseg = (K + SEG - 1) / SEG;

    uint4 rg[R][CH];
    auto fetch = [&](int sg) {
        const int elems = min(SEG, K - sg * SEG);
        const size_t s0 = (size_t)sg * SEGB, s1 = s0 + (size_t)elems / m40k_tinfo<T>::BE * m40k_tinfo<T>::BB;
#pragma unroll
        for (int r = 0; r < R; r++) {
            const uintptr_t b0 = (uintptr_t)(rowp[r] + s0), b1 = (uintptr_t)(rowp[r] + s1);
            const uint4 *a0 = reinterpret_cast<const uint4 *>(b0 & ~(uintptr_t)15);
            const int nch = (int)((((b1 + 15) & ~(uintptr_t)15) - (b0 & ~(uintptr_t)15)) / 16);
#pragma unroll
            for (int c = 0; c < CH; c++)
                if (lane + 32 * c < nch)
                    rg[r][c] = __ldcs(a0 + lane + 32 * c);
        }
    };

    float acc[R][B];
#pragma unroll
    for (int r = 0; r < R; r++)
#pragma unroll
        for (int b = 0; b < B; b++)
            acc[r][b] = 0.0f;

    if (ks < nseg)
        fetch(ks);
    x = m40k_grid_wait_for(x); /* x is the previous kernel's output (PDL launch) */
    for (int sg = ks; sg < nseg; sg += S) {
#pragma unroll
        for (int r = 0; r < R; r++)
#pragma unroll
            for (int c = 0; c < CH; c++)
                reinterpret_cast<uint4 *>(sbuf[warp][r])[lane + 32 * c] = rg[r][c];
        __syncwarp();
        if (sg + S < nseg)
            fetch(sg + S);
        const int off = (int)((uintptr_t)(rowp[0] + (size_t)sg * SEGB) & 15); /* same for every row */
        const int elems = min(SEG, K - sg * SEG);
        if (gf_cfg<T>::NSC > 0) {
#pragma unroll
            for (int r = 0; r < R; r++)
                gf_scales<T>(sbuf[warp][r], off, ssc[warp][r], lane);
            __syncwarp();
        }
        const float *xs = x + (size_t)sg * SEG;
#pragma unroll
        for (int i = 0; i < SEG / 256; i++) {
            const int e0 = 8 * lane + 256 * i;
            if (e0 < elems) {
                float f[R][8], A[R], C[R];
#pragma unroll
                for (int r = 0; r < R; r++)
                    gf_group<T>(sbuf[warp][r], off, ssc[warp][r], lane, i, f[r], A[r], C[r]);
#pragma unroll
                for (int b = 0; b < B; b++) {
                    const float4 xa = __ldca(reinterpret_cast<const float4 *>(xs + b * x_stride + e0));
                    const float4 xb = __ldca(reinterpret_cast<const float4 *>(xs + b * x_stride + e0 + 4));
                    const float sx = m40k_sum8(xa, xb);
#pragma unroll
                    for (int r = 0; r < R; r++) {
                        const float t = m40k_dot8(f[r], xa, xb);
                        if (T == M40K_TYPE_F16 || T == M40K_TYPE_BF16)
                            acc[r][b] += t;
                        else
                            acc[r][b] = fmaf(A[r], t, fmaf(C[r], sx, acc[r][b]));
                    }
                }
            }
        }
        __syncwarp();
    }
    m40k_gemv_block_store<GF_WARPS, R, B>(acc, red, S, N, y, y_stride, blockIdx.x);
}

template <int T, int B>
static int gemv_launch_b(const void *w, int N, int K, const float *x, int64_t xs, float *y, int64_t ys,
                         cudaStream_t st)
{
    typedef m40k_tinfo<T> ti;
    const size_t row_bytes = (size_t)K / ti::BE * ti::BB;
    constexpr bool has_fast = T == M40K_TYPE_F16 || T == M40K_TYPE_BF16 || T == M40K_TYPE_Q8_0 ||
                              T == M40K_TYPE_Q4_0 || T == M40K_TYPE_Q4_K || T == M40K_TYPE_Q6_K;
    if constexpr (has_fast) {
    if (((uintptr_t)w & 15) == 0 && row_bytes % 16 == 0) {
        /* each row's segments split over S warps (one segment a warp and iteration) */
        const int nseg = (K + gf_dims<T>::SEG - 1) / gf_dims<T>::SEG;
        const int S = m40k_gemv_pick_split(nseg, 1, N, GF_WARPS, GF_R);
        const int rows_per_block = GF_WARPS / S * GF_R;
        const dim3 grid((unsigned)((N + rows_per_block - 1) / rows_per_block)), block(GF_WARPS * 32);
        /* F16 at batch 1, products up to 4096 x 4096 (attention output): 8 blocks an SM
         * (64 registers, 72 unbounded). H100, test_kernels --bench skinny: 4096 x 4096
         * 15.5 -> 13.4 us; larger ones measured slower that way (6144 x 4096 19.6 ->
         * 21.0, 28672 x 4096 78.5 -> 82.3 us), so they keep the unbounded instance. */
        if constexpr (T == M40K_TYPE_F16 && B == 1)
            if ((int64_t)N * K <= (int64_t)4096 * 4096)
                return m40k_launch_pdl(gemv_fast_kernel<T, B, 8>, grid, block, st, (const uint8_t *)w, row_bytes, N,
                                       K, S, x, xs, y, ys);
        return m40k_launch_pdl(gemv_fast_kernel<T, B, 0>, grid, block, st, (const uint8_t *)w, row_bytes, N, K, S, x,
                               xs, y, ys);
    }
    }
    return m40k_launch_pdl(gemv_kernel<T, B>, dim3((unsigned)((N + GEMV_WARPS - 1) / GEMV_WARPS)),
                           dim3(GEMV_WARPS * 32), st, (const uint8_t *)w, row_bytes, N, K, x, xs, y, ys);
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
    case M40K_TYPE_Q4_1: return K % 32 ? M40K_INVALID : gemv_launch<M40K_TYPE_Q4_1>(w, N, K, x, x_stride, y, y_stride, batch, stream);
    case M40K_TYPE_Q5_0: return K % 32 ? M40K_INVALID : gemv_launch<M40K_TYPE_Q5_0>(w, N, K, x, x_stride, y, y_stride, batch, stream);
    case M40K_TYPE_Q5_1: return K % 32 ? M40K_INVALID : gemv_launch<M40K_TYPE_Q5_1>(w, N, K, x, x_stride, y, y_stride, batch, stream);
    case M40K_TYPE_Q4_K: return K % 256 ? M40K_INVALID : gemv_launch<M40K_TYPE_Q4_K>(w, N, K, x, x_stride, y, y_stride, batch, stream);
    case M40K_TYPE_Q6_K: return K % 256 ? M40K_INVALID : gemv_launch<M40K_TYPE_Q6_K>(w, N, K, x, x_stride, y, y_stride, batch, stream);
    case M40K_TYPE_Q2_K: return K % 256 ? M40K_INVALID : gemv_launch<M40K_TYPE_Q2_K>(w, N, K, x, x_stride, y, y_stride, batch, stream);
    case M40K_TYPE_Q3_K: return K % 256 ? M40K_INVALID : gemv_launch<M40K_TYPE_Q3_K>(w, N, K, x, x_stride, y, y_stride, batch, stream);
    case M40K_TYPE_Q5_K: return K % 256 ? M40K_INVALID : gemv_launch<M40K_TYPE_Q5_K>(w, N, K, x, x_stride, y, y_stride, batch, stream);
    case M40K_TYPE_BF16: return K % 8 ? M40K_INVALID : gemv_launch<M40K_TYPE_BF16>(w, N, K, x, x_stride, y, y_stride, batch, stream);
    case M40K_TYPE_MXFP4: return K % 32 ? M40K_INVALID : gemv_launch<M40K_TYPE_MXFP4>(w, N, K, x, x_stride, y, y_stride, batch, stream);
    default: return M40K_INVALID;
    }
}
