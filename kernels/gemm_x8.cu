/* The int8 tensor-core GEMM (kernels.h 8f) for decode batches of 1..64 token rows in
 * Q4_K and Q8_0_G8: y[t][r] = sum_k W[r][k] x[t][k] with x quantized to int8 per block
 * of 32 (m40k_quantize_x8) and the weights' integer levels fed to mma.sync.m16n8k32.s8
 * as they are. Twin: m40_ref_gemm_x8 (kernels/ref/cpu_ref.c).
 *
 * Why a third kernel beside the register kernel (gemm_q_reg.cu): that one turns every
 * weight into F16 (a logic operation, a byte permute and a half multiply-add per pair)
 * and runs F16 mma.sync, whose rate at 64 token rows is about the weights' DRAM time
 * (BENCHMARKS.md, twentieth and twenty-first sessions); here a Q4_K weight costs a logic
 * operation per four (the nibbles masked in place), the int8 MMA has twice the F16 rate,
 * and the staged x tile is half the bytes. Measured, the epilogue below eats the gain at
 * 64 rows, and the engine does not call this kernel (kernels/README.md, BENCHMARKS.md).
 *
 * The price is an epilogue per 32 elements of K, where the scales live: a block of 32
 * has one weight scale (Q4_K: d * sc, Q8_0: d) and one activation scale dx, so the int32
 * sum I of an mma is scaled by both. The mma's accumulator input is the bit pattern of
 * 1.5 * 2^23 (0x4B400000): its int32 output is then the F32 bit pattern of 1.5 * 2^23 +
 * I (|I| < 2^22: 32 * 128 * 127 for Q8_0), and one exact subtraction gives I as a float,
 * instead of a conversion on the quarter-rate pipe. Q4_K's minimums, -dmin * m * (sum of
 * the block's x), are one TF32 mma a chunk (k = the chunk's 8 blocks).
 *
 * k order: a 64-wide step is two blocks of 32; lane (g, t) (g = lane / 4, t = lane % 4)
 * holds elements 8t .. 8t+7 of each block (the A fragment slots 4t .. 4t+3 take 8t ..
 * 8t+3, slots 16+4t .. 8t+4 .. 8t+7). The quantizer stores x permuted to match: a 64-wide
 * step's bytes 16t .. 16t+7 are block 0's elements 8t .. 8t+7, bytes 16t+8 .. its block
 * 1's, so one 16-byte load is the B fragments of both of a lane's mmas.
 *
 * Block, ring, splits and launch as the register kernel: 8 warps, each one m16 tile of
 * weight rows by all BM (16, 32, 64) token rows; chunks of 256 through a cp.async ring;
 * split-K by mq_split_end; programmatic dependent launch. */
#include "gemm_q_dev.h"

#define MX_XLD 320 /* bytes a row of the staged int8 x tile: 16-byte loads of two rows of a quarter warp hit 32 banks */
#define MX_DLD 20  /* floats a row of the staged scales: d[8], s[8], 4 of padding (rows 20 banks apart) */
#define MX_SMEM_MAX (227 * 1024)
#define MX_ROWS (MQ_WARPS * 16)
#define MX_MAGIC 0x4B400000 /* F32 1.5 * 2^23 */

template <int T, int BM> struct mx_smem {
    enum {
        RB = mq_stage<T>::RB,
        X = BM * MX_XLD + BM * MX_DLD * 4,
        BLOCKS = 2 * (MX_ROWS * RB + X) <= MX_SMEM_MAX / 2 - 1024 ? 2 : 1,
        CAP = BLOCKS == 2 ? MX_SMEM_MAX / 2 - 1024 : MX_SMEM_MAX,
        WLDP = RB % 128 == 16 ? RB + 16 : RB,
        NSP0 = CAP / (MX_ROWS * WLDP + X),
        NSU0 = CAP / (MX_ROWS * RB + X),
        NSP = NSP0 > 4 ? 4 : NSP0,
        NSU = NSU0 > 4 ? 4 : NSU0,
        PAD = NSP >= 3 || NSP == NSU,
        WLD = PAD ? WLDP : RB,
        NS = PAD ? NSP : NSU,
        STAGE = MX_ROWS * WLD + X,
        BYTES = NS * STAGE
    };
    static_assert(NS >= 2, "a ring of at least two stages");
    static_assert(MX_XLD * BM % 16 == 0, "scales 16-byte aligned");
};

/* d[16x8] = a[16x32] b[32x8] + c, int8 in, int32 out */
__device__ __forceinline__ void mx_mma_s8(int (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1, int c)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%10,%10,%10,%10};"
        : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "r"(c));
#else
    d[0] = d[1] = d[2] = d[3] = c;
#endif
}

/* c[16x8] += a[16x8] b[8x8], TF32 in, F32 accumulate */
__device__ __forceinline__ void mx_mma_tf32(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

/* F32 -> TF32, to nearest (ties away), as the twin rounds */
__device__ __forceinline__ uint32_t mx_tf32(float v)
{
    uint32_t r;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(v));
#else
    r = __float_as_uint(v);
#endif
    return r;
}

__device__ __forceinline__ float mx_i2f(int d) { return __int_as_float(d) - 12582912.0f; }

__device__ __forceinline__ uint32_t mx_byte(uint32_t w, int i) { return (w >> (8 * i)) & 0xFFu; }

/* Quantizer: one warp per block of 32 (as the dp4a GEMV's, q8_dev.h): d = max|x| / 127,
 * q = rint(x / d), s = d * sum q rounded to TF32. */
__global__ void mx_quantize_kernel(const uint16_t *__restrict__ x, int64_t x_stride, int K, int M, int8_t *q,
                                   float *ds)
{
    const int lane = threadIdx.x & 31;
    const int64_t blk = (int64_t)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int nb = K / 32;
    if (blk >= (int64_t)nb * M)
        return;
    const int t = (int)(blk / nb), b = (int)(blk % nb);
    const float v = m40k_h2f(x[(size_t)t * x_stride + 32 * b + lane]);
    const float d = m40k_warp_max(fabsf(v)) / 127.0f;
    const int a = d != 0.0f ? (int)fminf(127.0f, fmaxf(-127.0f, rintf(v / d))) : 0;
    int sa = a;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        sa += __shfl_xor_sync(0xffffffffu, sa, o);
    q[(size_t)t * K + 64 * (b >> 1) + 16 * (lane >> 3) + 8 * (b & 1) + (lane & 7)] = (int8_t)a;
    if (lane == 0) {
        float *r = ds + (size_t)t * (K / 16) + 16 * (b >> 3) + (b & 7);
        r[0] = d;
        r[8] = __uint_as_float(mx_tf32(d * (float)sa));
    }
}

template <int T, int BM>
__global__ __launch_bounds__(MQ_WARPS * 32, mx_smem<T, BM>::BLOCKS) void mx_kernel(
    const uint8_t *__restrict__ w, size_t row_bytes, int N, int K, const int8_t *xq, const float *xds, int M,
    float *__restrict__ y, int64_t ldy, int S, float *ws, int *counters)
{
    typedef mx_smem<T, BM> sm;
    constexpr int NT = BM / 8;
    constexpr int RB = sm::RB, WLD = sm::WLD, NS = sm::NS;
    extern __shared__ __align__(16) uint8_t mx_sm[];
    /* stage b: weights at mx_sm + b * STAGE (ROWS rows of WLD bytes), then x (BM rows of
     * MX_XLD bytes), then the scales (BM rows of MX_DLD floats) */
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
    const int n0 = blockIdx.x * MX_ROWS, s = blockIdx.z;
    const int nc = K / MQ_KC;
    const int c0 = (int)((int64_t)s * nc / S), c1 = (int)((int64_t)(s + 1) * nc / S);

    constexpr int WP = RB / 16, KW = (MX_ROWS * WP + MQ_WARPS * 32 - 1) / (MQ_WARPS * 32);
    uint32_t woff[KW], wdst[KW];
#pragma unroll
    for (int k = 0; k < KW; k++) {
        const int i = tid + 256 * k, r = min(i / WP, MX_ROWS - 1), o = 16 * (i % WP);
        woff[k] = (uint32_t)((size_t)(min(n0 + r, N - 1) - n0) * row_bytes) + (uint32_t)o;
        wdst[k] = (uint32_t)(r * WLD + o);
    }
    const uint8_t *w0 = w + (size_t)n0 * row_bytes;
    /* x: 16 pieces a row (row tid / 16 + 16k); scales: 4 pieces a row (d[8], s[8]; row
     * tid / 4 + 64k, Q8_0_G8 only the first two) */
    constexpr int KXQ = (BM + 15) / 16, DP = T == M40K_TYPE_Q4_K ? 4 : 2;
    const int xr = tid >> 4, xp = tid & 15, dr = tid / DP, dp = tid % DP;
    const int64_t dsl = K / 16;

    auto issue_w = [&](int c, int b) {
        if (c < c1) {
            uint8_t *st = mx_sm + b * sm::STAGE;
#pragma unroll
            for (int k = 0; k < KW; k++)
                if ((MX_ROWS * WP) % 256 == 0 || k + 1 < KW || tid + 256 * k < MX_ROWS * WP)
                    mq_cp16(st + wdst[k], w0 + woff[k] + (size_t)c * RB, 16);
        }
    };
    auto issue_x = [&](int c, int b) {
        if (c < c1) {
            uint8_t *st = mx_sm + b * sm::STAGE + MX_ROWS * WLD;
#pragma unroll
            for (int k = 0; k < KXQ; k++) {
                const int r = xr + 16 * k;
                if (BM % 16 == 0 || r < BM) {
                    const bool in = r < M;
                    mq_cp16(st + r * MX_XLD + 16 * xp, in ? xq + (size_t)r * K + (size_t)c * MQ_KC + 16 * xp : xq,
                            in ? 16 : 0);
                }
            }
            if (dr < BM) {
                const bool in = dr < M;
                mq_cp16(st + BM * MX_XLD + dr * MX_DLD * 4 + 16 * dp,
                        in ? xds + (size_t)dr * dsl + 16 * c + 4 * dp : xds, in ? 16 : 0);
            }
        }
    };

    float acc[NT][4];
#pragma unroll
    for (int b = 0; b < NT; b++)
#pragma unroll
        for (int c = 0; c < 4; c++)
            acc[b][c] = 0.0f;

    const int wrow = warp * 16 + g;
    auto wait_x = [&] {
        xq = m40k_grid_wait_for(xq);
        xds = m40k_grid_wait_for(xds);
    };
    mq_ring<NS>(c0, c1, issue_w, wait_x, issue_x, [&](int c, int stage) {
        const uint8_t *st = mx_sm + stage * sm::STAGE;
        const uint8_t *xs = st + MX_ROWS * WLD;
        const float *dsm = reinterpret_cast<const float *>(xs + BM * MX_XLD);
        const uint8_t *row[2] = {st + wrow * WLD, st + (wrow + 8) * WLD};

        /* the weight scales of the chunk's blocks, rows g and g + 8: Q4_K d and the 6-bit
         * sc (turned into d * sc a pair of blocks at a time, below: 16 floats held across
         * the chunk spilled at 64 token rows), Q8_0_G8 d[8] as F16 */
        uint32_t sw[2][4];
        float dw[2];
        if constexpr (T == M40K_TYPE_Q4_K) {
            uint32_t am[4];
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const uint4 hd = *reinterpret_cast<const uint4 *>(row[h]); /* d, dmin | scales[12] */
                const uint32_t ma = hd.z & 0x3f3f3f3fu;
                const uint32_t mb = ((hd.w >> 4) & 0x0f0f0f0fu) | ((hd.z >> 6) & 0x03030303u) << 4;
                sw[h][0] = hd.y & 0x3f3f3f3fu;
                sw[h][1] = (hd.w & 0x0f0f0f0fu) | ((hd.y >> 6) & 0x03030303u) << 4;
                dw[h] = m40k_h2f((uint16_t)(hd.x & 0xFFFFu));
                const float dmin = m40k_h2f((uint16_t)(hd.x >> 16));
                /* the TF32 A fragment of the minimums: rows g (h 0), g + 8 (h 1); blocks t, t + 4 */
                am[h] = mx_tf32(-dmin * (float)mx_byte(ma, t4));
                am[2 + h] = mx_tf32(-dmin * (float)mx_byte(mb, t4));
            }
#pragma unroll
            for (int nt = 0; nt < NT; nt++) {
                const float *dr0 = dsm + (nt * 8 + g) * MX_DLD + 8;
                mx_mma_tf32(acc[nt], am, __float_as_uint(dr0[t4]), __float_as_uint(dr0[t4 + 4]));
            }
        } else {
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const uint4 hd = *reinterpret_cast<const uint4 *>(row[h]);
                sw[h][0] = hd.x, sw[h][1] = hd.y, sw[h][2] = hd.z, sw[h][3] = hd.w;
                dw[h] = 0.0f;
            }
        }

#pragma unroll
        for (int p = 0; p < 4; p++) { /* blocks 2p and 2p + 1 */
            uint32_t a[2][4];
#pragma unroll
            for (int h = 0; h < 2; h++) {
                if constexpr (T == M40K_TYPE_Q4_K) {
                    /* block 2p: the low nibbles of bytes 32p .. 32p + 31, block 2p + 1 the high ones */
                    const uint2 v = *reinterpret_cast<const uint2 *>(row[h] + 16 + 32 * p + 8 * t4);
                    a[0][h] = v.x & 0x0F0F0F0Fu;
                    a[0][2 + h] = v.y & 0x0F0F0F0Fu;
                    a[1][h] = (v.x >> 4) & 0x0F0F0F0Fu;
                    a[1][2 + h] = (v.y >> 4) & 0x0F0F0F0Fu;
                } else {
                    const uint2 v0 = *reinterpret_cast<const uint2 *>(row[h] + 16 + 64 * p + 8 * t4);
                    const uint2 v1 = *reinterpret_cast<const uint2 *>(row[h] + 48 + 64 * p + 8 * t4);
                    a[0][h] = v0.x;
                    a[0][2 + h] = v0.y;
                    a[1][h] = v1.x;
                    a[1][2 + h] = v1.y;
                }
            }
            float wsc[2][2]; /* rows g, g + 8; blocks 2p, 2p + 1 */
#pragma unroll
            for (int h = 0; h < 2; h++)
#pragma unroll
                for (int i = 0; i < 2; i++) {
                    if constexpr (T == M40K_TYPE_Q4_K)
                        wsc[h][i] = dw[h] * (float)mx_byte(sw[h][p >> 1], (2 * p + i) & 3);
                    else
                        wsc[h][i] = m40k_h2f((uint16_t)(sw[h][p] >> (16 * i)));
                }
#pragma unroll
            for (int nt = 0; nt < NT; nt++) {
                const uint4 b = *reinterpret_cast<const uint4 *>(xs + (nt * 8 + g) * MX_XLD + 64 * p + 16 * t4);
                int d0[4], d1[4];
                mx_mma_s8(d0, a[0], b.x, b.y, MX_MAGIC);
                mx_mma_s8(d1, a[1], b.z, b.w, MX_MAGIC);
                /* accumulator c: weight row g + 8*(c >> 1), token row 8*nt + 2*t4 + (c & 1) */
                const float2 x0 = *reinterpret_cast<const float2 *>(dsm + (nt * 8 + 2 * t4) * MX_DLD + 2 * p);
                const float2 x1 = *reinterpret_cast<const float2 *>(dsm + (nt * 8 + 2 * t4 + 1) * MX_DLD + 2 * p);
                acc[nt][0] = fmaf(mx_i2f(d0[0]), wsc[0][0] * x0.x, acc[nt][0]);
                acc[nt][1] = fmaf(mx_i2f(d0[1]), wsc[0][0] * x1.x, acc[nt][1]);
                acc[nt][2] = fmaf(mx_i2f(d0[2]), wsc[1][0] * x0.x, acc[nt][2]);
                acc[nt][3] = fmaf(mx_i2f(d0[3]), wsc[1][0] * x1.x, acc[nt][3]);
                acc[nt][0] = fmaf(mx_i2f(d1[0]), wsc[0][1] * x0.y, acc[nt][0]);
                acc[nt][1] = fmaf(mx_i2f(d1[1]), wsc[0][1] * x1.y, acc[nt][1]);
                acc[nt][2] = fmaf(mx_i2f(d1[2]), wsc[1][1] * x0.y, acc[nt][2]);
                acc[nt][3] = fmaf(mx_i2f(d1[3]), wsc[1][1] * x1.y, acc[nt][3]);
            }
        }
    });

    mq_frag_store<NT>(acc, n0, MX_ROWS, wrow, t4, N, M, y, ldy, S, s, ws, counters);
}

template <int T> static int mx_prepare_type(void)
{
    return mq_smem_limits(mx_kernel<T, 16>, mx_smem<T, 16>::BYTES, mx_kernel<T, 32>, mx_smem<T, 32>::BYTES,
                          mx_kernel<T, 64>, mx_smem<T, 64>::BYTES);
}

int m40k_gemm_x8_prepare(void)
{
    static bool done[64];
    return mq_once_per_device(done, [] {
        int e = mx_prepare_type<M40K_TYPE_Q4_K>();
        if (!e)
            e = mx_prepare_type<M40K_TYPE_Q8_0_G8>();
        return e;
    });
}

typedef void (*mx_fn)(const uint8_t *, size_t, int, int, const int8_t *, const float *, int, float *, int64_t, int,
                      float *, int *);

template <int T, typename F> static int mx_with(int M, F f)
{
    switch (mq_frag_bm(M)) {
    case 16: return f(mx_kernel<T, 16>, (int)mx_smem<T, 16>::BLOCKS, (int)mx_smem<T, 16>::BYTES);
    case 32: return f(mx_kernel<T, 32>, (int)mx_smem<T, 32>::BLOCKS, (int)mx_smem<T, 32>::BYTES);
    default: return f(mx_kernel<T, 64>, (int)mx_smem<T, 64>::BLOCKS, (int)mx_smem<T, 64>::BYTES);
    }
}

template <typename F> static int mx_dispatch(int w_type, int M, F f)
{
    switch (w_type) {
    case M40K_TYPE_Q4_K: return mx_with<M40K_TYPE_Q4_K>(M, f);
    case M40K_TYPE_Q8_0_G8: return mx_with<M40K_TYPE_Q8_0_G8>(M, f);
    default: return M40K_INVALID;
    }
}

static size_t mx_row_bytes(int w_type, int K)
{
    const size_t rb = w_type == M40K_TYPE_Q4_K ? (size_t)mq_stage<M40K_TYPE_Q4_K>::RB
                                               : (size_t)mq_stage<M40K_TYPE_Q8_0_G8>::RB;
    return (size_t)K / MQ_KC * rb;
}

size_t m40k_x8_bytes(int K, int M)
{
    if (K <= 0 || K % 256 || M <= 0)
        return 0;
    return (size_t)M * K + (size_t)M * (K / 16) * 4;
}

int m40k_quantize_x8(const uint16_t *x, int64_t x_stride, int K, int M, void *xq, m40k_stream stream)
{
    if (!x || !xq || K <= 0 || K % 256 || M <= 0 || x_stride < K || ((uintptr_t)xq & 15))
        return M40K_INVALID;
    int8_t *q = (int8_t *)xq;
    float *ds = (float *)(q + (size_t)M * K);
    const int64_t blocks = (int64_t)M * (K / 32);
    mx_quantize_kernel<<<(unsigned)((blocks + 7) / 8), 256, 0, (cudaStream_t)stream>>>(x, x_stride, K, M, q, ds);
    return m40k_launch_status();
}

int m40k_gemm_x8_reads(int w_type, int K, int M, const void *w)
{
    return (w_type == M40K_TYPE_Q4_K || w_type == M40K_TYPE_Q8_0_G8) && M >= 1 && M <= 64 && K > 0 && K % 256 == 0 &&
           w && ((uintptr_t)w & 15) == 0;
}

int m40k_gemm_x8_pick_splits(int w_type, int N, int K, int M, int sm_count)
{
    if (!m40k_gemm_x8_reads(w_type, K, M, (const void *)16) || N <= 0)
        return 1;
    const int S = mx_dispatch(
        w_type, M, [&](mx_fn, int blocks, int) { return mq_one_wave_splits(blocks, sm_count, N, MX_ROWS, K); });
    return S < 1 ? 1 : S;
}

int m40k_gemm_x8(const void *w, int w_type, int N, int K, const void *xq, int M, float *y, int64_t ldy, int S,
                 float *ws, int *counters, m40k_stream stream)
{
    if (!m40k_gemm_x8_reads(w_type, K, M, w) || N <= 0 || !xq || ((uintptr_t)xq & 15) || !y || ldy < N || S < 1 ||
        S > K / MQ_KC || (S > 1 && (!ws || !counters)))
        return M40K_INVALID;
    const int e = m40k_gemm_x8_prepare();
    if (e)
        return e;
    const int8_t *q = (const int8_t *)xq;
    const float *ds = (const float *)(q + (size_t)M * K);
    const size_t rb = mx_row_bytes(w_type, K);
    return mx_dispatch(w_type, M, [&](mx_fn fn, int, int bytes) {
        const dim3 grid((unsigned)((N + MX_ROWS - 1) / MX_ROWS), 1, (unsigned)S);
        const int e2 = m40k_launch_pdl_smem(fn, grid, dim3(MQ_WARPS * 32), (size_t)bytes, (cudaStream_t)stream,
                                            (const uint8_t *)w, rb, N, K, q, ds, M, y, ldy, S, ws, counters);
        return e2 ? e2 : m40k_launch_status();
    });
}
