/* The int8 tensor-core GEMM (kernels.h 8f) for decode batches of 1..64 token rows in
 * Q4_K and Q8_0_G8: y[t][r] = sum_k W[r][k] x[t][k] with x quantized to int8 per chunk
 * of 256 (m40k_quantize_x8) and the weights' integer levels fed to mma.sync.m16n8k32.s8
 * as they are. Twin: m40_ref_gemm_x8 (kernels/ref/cpu_ref.c).
 *
 * Why a third kernel beside the register kernel (gemm_q_reg.cu): that one turns every
 * weight into F16 (a logic operation, a byte permute and a half multiply-add per pair)
 * and runs F16 mma.sync, whose rate at 64 token rows is about the weights' DRAM time
 * (BENCHMARKS.md, twentieth and twenty-first sessions); here a Q4_K weight costs a logic
 * operation per four (the nibbles masked in place), the int8 MMA has twice the F16 rate,
 * and the staged x tile is half the bytes.
 *
 * The scales. x has one scale dx per 256 elements (a Q4_K superblock, 8 blocks of
 * Q8_0), as llama.cpp's CPU path quantizes activations for the K-quants (Q8_K), so that
 * the weights' per-block scales are the only ones inside a chunk:
 *   Q4_K: a block's int32 sum I_j times its 6-bit scale sc_j is an integer multiply-add;
 *     once a chunk, e = F32(d * F32(sum_j sc_j I_j)) + sum_j F16(-dmin m_j) F16(s_j)
 *     (s_j: the block's sum of q; the minimum term is one F16 mma.m16n8k8 a chunk with
 *     e as its accumulator input), and y += dx * e.
 *   Q8_0: e = sum_j d_j I_j in F32 (I_j exactly: the mma's accumulator input is the bit
 *     pattern of 1.5 * 2^23, so its int32 output is the F32 pattern of 1.5 * 2^23 + I_j,
 *     |I_j| < 2^22, and one subtraction gives I_j), and y += dx * e.
 * The coarser rounding of x (a scale per 256 instead of 32) is not measured on the
 * shared references: the engine does not call this kernel (kernels/README.md says why).
 *
 * k order: a 64-wide step is two blocks of 32; lane (g, t) (g = lane / 4, t = lane % 4)
 * holds elements 8t .. 8t+7 of each block (the A fragment slots 4t .. 4t+3 take 8t ..
 * 8t+3, slots 16+4t .. 8t+4 .. 8t+7). The quantizer stores x permuted to match: a 64-wide
 * step's bytes 16t .. 16t+7 are block 0's elements 8t .. 8t+7, bytes 16t+8 .. its block
 * 1's, so one 16-byte load is the B fragments of both of a lane's mmas.
 *
 * Block, ring, splits and launch as the register kernel: 8 warps, 128 weight rows; chunks
 * of 256 through a cp.async ring; split-K by mq_split_end; programmatic dependent
 * launch. At 64 token rows a warp holds two m16 tiles of weight rows by 32 token rows
 * (TG = 2 token groups): every x fragment it loads feeds two mmas, which halves the
 * shared-memory reads of the x tile against one m16 tile by 64 rows. */
#include "gemm_q_dev.h"

#define MX_XLD 256  /* bytes a row of the staged x tile: 16-byte pieces swizzled by the row's parity */
#define MX_REC 32   /* bytes of a token's record a chunk: float dx, 12 zero bytes, F16 s[8] */
#define MX_SMEM_MAX (227 * 1024)
#define MX_ROWS (MQ_WARPS * 16)
#define MX_MAGIC 0x4B400000 /* F32 1.5 * 2^23 */

/* where logical 16-byte piece p of staged x row r lies: rows 2i and 2i + 1 keep their
 * pieces 64 bytes apart, so that a quarter warp's loads of two rows hit all 32 banks */
__device__ __forceinline__ int mx_swz(int r, int p) { return 16 * (p ^ ((r & 1) << 2)); }

template <int T, int BM> struct mx_smem {
    enum {
        RB = mq_stage<T>::RB,
        X = BM * MX_XLD + BM * MX_REC,
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
};

/* token groups a block splits its BM rows into (a warp's m16 tiles of weight rows: the same) */
template <int BM> struct mx_tg {
    enum { TG = BM == 64 ? 2 : 1 };
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

/* c[16x8] += a[16x8] b[8x8], F16 in, F32 accumulate */
__device__ __forceinline__ void mx_mma_h8(float (&c)[4], const uint32_t (&a)[2], uint32_t b)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(b));
#endif
}

__device__ __forceinline__ float mx_i2f(int d) { return __int_as_float(d) - 12582912.0f; }

__device__ __forceinline__ int mx_byte(uint32_t w, int i) { return (int)((w >> (8 * i)) & 0xFFu); }

/* a warp's accumulators (tiles x n8 tiles x 4) cleared */
template <typename V, int A, int B> __device__ __forceinline__ void mx_zero(V (&v)[A][B][4])
{
#pragma unroll
    for (int i = 0; i < A; i++)
#pragma unroll
        for (int b = 0; b < B; b++)
#pragma unroll
            for (int e = 0; e < 4; e++)
                v[i][b][e] = 0;
}

/* The staged x's B fragments of lane (g, t) for blocks 2p and 2p + 1 of token row r (its
 * .x .y for block 2p's mma, .z .w for block 2p + 1's) */
__device__ __forceinline__ uint4 mx_xfrag(const uint8_t *xs, int r, int p, int t4)
{
    return *reinterpret_cast<const uint4 *>(xs + r * MX_XLD + mx_swz(r, 4 * p + t4));
}

/* The chunk's dx of token rows r + 2t and r + 2t + 1 (accumulators e & 1 = 0 and 1) */
__device__ __forceinline__ float2 mx_dx(const uint8_t *rs, int r, int t4)
{
    return make_float2(*reinterpret_cast<const float *>(rs + (r + 2 * t4) * MX_REC),
                       *reinterpret_cast<const float *>(rs + (r + 2 * t4 + 1) * MX_REC));
}

/* Quantizer: one warp per token and chunk of 256; lane l holds elements 8(l % 4) ..
 * 8(l % 4) + 7 of block l / 4. d = max|x| / 127 over the chunk, q = rint(x / d), s =
 * F16(sum of the block's q). */
__global__ void mx_quantize_kernel(const uint16_t *__restrict__ x, int64_t x_stride, int K, int M, int8_t *q,
                                   uint8_t *rec)
{
    const int lane = threadIdx.x & 31;
    const int64_t job = (int64_t)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int nc = K / MQ_KC;
    if (job >= (int64_t)nc * M)
        return;
    const int t = (int)(job / nc), c = (int)(job % nc), b = lane >> 2, u = lane & 3;
    const uint16_t *src = x + (size_t)t * x_stride + MQ_KC * c + 32 * b + 8 * u;
    float v[8], m = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; i++) {
        v[i] = m40k_h2f(src[i]);
        m = fmaxf(m, fabsf(v[i]));
    }
    const float d = m40k_warp_max(m) / 127.0f;
    uint32_t w[2] = {0, 0};
    int s = 0;
#pragma unroll
    for (int i = 0; i < 8; i++) {
        const int a = d != 0.0f ? (int)fminf(127.0f, fmaxf(-127.0f, rintf(v[i] / d))) : 0;
        s += a;
        w[i >> 2] |= (uint32_t)(a & 0xFF) << (8 * (i & 3));
    }
    s += __shfl_xor_sync(0xffffffffu, s, 1);
    s += __shfl_xor_sync(0xffffffffu, s, 2);
    *reinterpret_cast<uint2 *>(q + (size_t)t * K + MQ_KC * c + 64 * (b >> 1) + 16 * u + 8 * (b & 1)) =
        make_uint2(w[0], w[1]);
    uint8_t *r = rec + ((size_t)t * nc + c) * MX_REC;
    if (lane == 0)
        *reinterpret_cast<float4 *>(r) = make_float4(d, 0.0f, 0.0f, 0.0f);
    if (u == 0)
        *reinterpret_cast<__half *>(r + 16 + 2 * b) = __int2half_rn(s);
}

template <int T, int BM>
__global__ __launch_bounds__(MQ_WARPS * 32, mx_smem<T, BM>::BLOCKS) void mx_kernel(
    const uint8_t *__restrict__ w, size_t row_bytes, int N, int K, const int8_t *xq, const uint8_t *xrec, int M,
    float *__restrict__ y, int64_t ldy, int S, float *ws, int *counters)
{
    typedef mx_smem<T, BM> sm;
    constexpr int TG = mx_tg<BM>::TG, WR = TG, NT = BM / 8 / TG;
    constexpr int RB = sm::RB, WLD = sm::WLD, NS = sm::NS;
    extern __shared__ __align__(16) uint8_t mx_sm[];
    /* stage b: weights at mx_sm + b * STAGE (ROWS rows of WLD bytes), then x (BM rows of
     * MX_XLD bytes), then the records (BM of MX_REC bytes) */
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
    const int n0 = blockIdx.x * MX_ROWS, s = blockIdx.z;
    const int nc = K / MQ_KC;
    const int c0 = (int)((int64_t)s * nc / S), c1 = (int)((int64_t)(s + 1) * nc / S);
    /* this warp: weight rows rw .. rw + 16 WR - 1 of the block, token rows tb .. tb + 8 NT - 1 */
    const int rw = (warp / TG) * 16 * WR, tb = (warp % TG) * 8 * NT;

    /* the weight copies: piece tid + 256k of the block's ROWS x WP 16-byte pieces (their
     * offsets formed at each issue: registers are what the 64-row instance lacks) */
    constexpr int WP = RB / 16, KW = (MX_ROWS * WP + MQ_WARPS * 32 - 1) / (MQ_WARPS * 32);
    const uint8_t *w0 = w + (size_t)n0 * row_bytes;
    /* x: 16 pieces a row (row tid / 16 + 16k); records: 2 pieces a token (tid / 2) */
    constexpr int KXQ = (BM + 15) / 16;
    const int xr = tid >> 4, xp = tid & 15, dr = tid >> 1, dp = tid & 1;

    auto issue_w = [&](int c, int b) {
        if (c < c1) {
            uint8_t *st = mx_sm + b * sm::STAGE;
#pragma unroll
            for (int k = 0; k < KW; k++)
                if ((MX_ROWS * WP) % 256 == 0 || k + 1 < KW || tid + 256 * k < MX_ROWS * WP) {
                    const int i = tid + 256 * k, r = i / WP, o = 16 * (i % WP);
                    mq_cp16(st + r * WLD + o, w0 + (size_t)(min(n0 + r, N - 1) - n0) * row_bytes + (size_t)c * RB + o,
                            16);
                }
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
                    mq_cp16(st + r * MX_XLD + mx_swz(r, xp),
                            in ? xq + (size_t)r * K + (size_t)c * MQ_KC + 16 * xp : xq, in ? 16 : 0);
                }
            }
            if (dr < BM) {
                const bool in = dr < M;
                mq_cp16(st + BM * MX_XLD + dr * MX_REC + 16 * dp,
                        in ? xrec + ((size_t)dr * nc + c) * MX_REC + 16 * dp : xrec, in ? 16 : 0);
            }
        }
    };

    float acc[WR][NT][4];
    mx_zero(acc);

    auto wait_x = [&] {
        xq = m40k_grid_wait_for(xq);
        xrec = m40k_grid_wait_for(xrec);
    };
    mq_ring<NS>(c0, c1, issue_w, wait_x, issue_x, [&](int c, int stage) {
        const uint8_t *st = mx_sm + stage * sm::STAGE;
        const uint8_t *xs = st + MX_ROWS * WLD;
        const uint8_t *rs = xs + BM * MX_XLD;
        const uint8_t *row[WR][2];
#pragma unroll
        for (int i = 0; i < WR; i++)
#pragma unroll
            for (int h = 0; h < 2; h++)
                row[i][h] = st + (rw + 16 * i + 8 * h + g) * WLD;

        if constexpr (T == M40K_TYPE_Q4_K) {
            /* rows g and g + 8 of each tile: d, the 6-bit scales of the 8 blocks (two
             * words), and the minimums' F16 A fragment (-dmin * m of blocks 2t, 2t + 1) */
            float dw[WR][2];
            uint32_t sc[WR][2][2], am[WR][2];
#pragma unroll
            for (int i = 0; i < WR; i++)
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    const uint4 hd = *reinterpret_cast<const uint4 *>(row[i][h]); /* d, dmin | scales[12] */
                    sc[i][h][0] = hd.y & 0x3f3f3f3fu;
                    sc[i][h][1] = (hd.w & 0x0f0f0f0fu) | ((hd.y >> 6) & 0x03030303u) << 4;
                    const uint32_t mm = t4 < 2 ? hd.z & 0x3f3f3f3fu
                                               : ((hd.w >> 4) & 0x0f0f0f0fu) | ((hd.z >> 6) & 0x03030303u) << 4;
                    dw[i][h] = m40k_h2f((uint16_t)(hd.x & 0xFFFFu));
                    const float dmin = m40k_h2f((uint16_t)(hd.x >> 16));
                    am[i][h] = m40k_pack_h2(-dmin * (float)mx_byte(mm, (2 * t4) & 3), -dmin * (float)mx_byte(mm, (2 * t4 + 1) & 3));
                }
            int ai[WR][NT][4];
            mx_zero(ai);
#pragma unroll 1
            for (int p = 0; p < 4; p++) { /* blocks 2p and 2p + 1; kept a loop: unrolled, the
                                             * 64-row instance hoisted its loads and spilled */
                uint32_t a[WR][2][4];
                int s0[WR][2], s1[WR][2];
#pragma unroll
                for (int i = 0; i < WR; i++)
#pragma unroll
                    for (int h = 0; h < 2; h++) {
                        /* block 2p: the low nibbles of bytes 32p .. 32p + 31, block 2p + 1 the high ones */
                        const uint2 v = *reinterpret_cast<const uint2 *>(row[i][h] + 16 + 32 * p + 8 * t4);
                        a[i][0][h] = v.x & 0x0F0F0F0Fu;
                        a[i][0][2 + h] = v.y & 0x0F0F0F0Fu;
                        a[i][1][h] = (v.x >> 4) & 0x0F0F0F0Fu;
                        a[i][1][2 + h] = (v.y >> 4) & 0x0F0F0F0Fu;
                        const uint32_t sw = p >> 1 ? sc[i][h][1] : sc[i][h][0];
                        s0[i][h] = mx_byte(sw, (2 * p) & 3);
                        s1[i][h] = mx_byte(sw, (2 * p + 1) & 3);
                    }
#pragma unroll
                for (int nt = 0; nt < NT; nt++) {
                    const uint4 b = mx_xfrag(xs, tb + nt * 8 + g, p, t4);
#pragma unroll
                    for (int i = 0; i < WR; i++) {
                        int d0[4], d1[4];
                        mx_mma_s8(d0, a[i][0], b.x, b.y, 0);
                        mx_mma_s8(d1, a[i][1], b.z, b.w, 0);
                        /* accumulator e: weight row g + 8*(e >> 1), token row 2t + (e & 1) */
#pragma unroll
                        for (int e = 0; e < 4; e++)
                            ai[i][nt][e] += s0[i][e >> 1] * d0[e] + s1[i][e >> 1] * d1[e];
                    }
                }
            }
#pragma unroll
            for (int nt = 0; nt < NT; nt++) {
                const int r = tb + nt * 8;
                const float2 dx = mx_dx(rs, r, t4);
                const uint32_t sb = *reinterpret_cast<const uint32_t *>(rs + (r + g) * MX_REC + 16 + 4 * t4);
#pragma unroll
                for (int i = 0; i < WR; i++) {
                    float e[4];
#pragma unroll
                    for (int k = 0; k < 4; k++)
                        e[k] = dw[i][k >> 1] * (float)ai[i][nt][k];
                    mx_mma_h8(e, am[i], sb);
#pragma unroll
                    for (int k = 0; k < 4; k++)
                        acc[i][nt][k] = fmaf(k & 1 ? dx.y : dx.x, e[k], acc[i][nt][k]);
                }
            }
        } else {
            /* Q8_0_G8: the 8 blocks' d as F16 in the row's first 16 bytes (read a pair at a
             * time); block 2p at bytes 16 + 64p, block 2p + 1 at 48 + 64p */
            float ef[WR][NT][4];
            mx_zero(ef);
#pragma unroll 1
            for (int p = 0; p < 4; p++) {
                uint32_t a[WR][2][4];
                float d0w[WR][2], d1w[WR][2];
#pragma unroll
                for (int i = 0; i < WR; i++)
#pragma unroll
                    for (int h = 0; h < 2; h++) {
                        const uint2 v0 = *reinterpret_cast<const uint2 *>(row[i][h] + 16 + 64 * p + 8 * t4);
                        const uint2 v1 = *reinterpret_cast<const uint2 *>(row[i][h] + 48 + 64 * p + 8 * t4);
                        a[i][0][h] = v0.x;
                        a[i][0][2 + h] = v0.y;
                        a[i][1][h] = v1.x;
                        a[i][1][2 + h] = v1.y;
                        const uint32_t dp2 = *reinterpret_cast<const uint32_t *>(row[i][h] + 4 * p);
                        d0w[i][h] = m40k_h2f((uint16_t)(dp2 & 0xFFFFu));
                        d1w[i][h] = m40k_h2f((uint16_t)(dp2 >> 16));
                    }
#pragma unroll
                for (int nt = 0; nt < NT; nt++) {
                    const uint4 b = mx_xfrag(xs, tb + nt * 8 + g, p, t4);
#pragma unroll
                    for (int i = 0; i < WR; i++) {
                        int d0[4], d1[4];
                        mx_mma_s8(d0, a[i][0], b.x, b.y, MX_MAGIC);
                        mx_mma_s8(d1, a[i][1], b.z, b.w, MX_MAGIC);
#pragma unroll
                        for (int e = 0; e < 4; e++) {
                            ef[i][nt][e] = fmaf(mx_i2f(d0[e]), d0w[i][e >> 1], ef[i][nt][e]);
                            ef[i][nt][e] = fmaf(mx_i2f(d1[e]), d1w[i][e >> 1], ef[i][nt][e]);
                        }
                    }
                }
            }
#pragma unroll
            for (int nt = 0; nt < NT; nt++) {
                const int r = tb + nt * 8;
                const float2 dx = mx_dx(rs, r, t4);
#pragma unroll
                for (int i = 0; i < WR; i++)
#pragma unroll
                    for (int k = 0; k < 4; k++)
                        acc[i][nt][k] = fmaf(k & 1 ? dx.y : dx.x, ef[i][nt][k], acc[i][nt][k]);
            }
        }
    });

    /* accumulator k of tile (i, nt): weight row n0 + rw + 16i + g + 8(k >> 1), token row
     * tb + 8nt + 2t + (k & 1) */
    float *dst = S > 1 ? ws + (size_t)s * M * N : y;
    const int64_t ld = S > 1 ? N : ldy;
#pragma unroll
    for (int i = 0; i < WR; i++)
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
#pragma unroll
            for (int k = 0; k < 4; k++) {
                const int r = n0 + rw + 16 * i + g + 8 * (k >> 1), t = tb + nt * 8 + 2 * t4 + (k & 1);
                if (r < N && t < M)
                    dst[(size_t)t * ld + r] = acc[i][nt][k];
            }
    if (S > 1)
        mq_split_end(S, N, M, n0, 0, min(MX_ROWS, N - n0), M, y, ldy, ws, counters, blockIdx.x);
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

typedef void (*mx_fn)(const uint8_t *, size_t, int, int, const int8_t *, const uint8_t *, int, float *, int64_t, int,
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
    if (K <= 0 || K % MQ_KC || M <= 0)
        return 0;
    return (size_t)M * K + (size_t)M * (K / MQ_KC) * MX_REC;
}

int m40k_quantize_x8(const uint16_t *x, int64_t x_stride, int K, int M, void *xq, m40k_stream stream)
{
    if (!x || !xq || K <= 0 || K % MQ_KC || M <= 0 || x_stride < K || ((uintptr_t)xq & 15))
        return M40K_INVALID;
    int8_t *q = (int8_t *)xq;
    const int64_t jobs = (int64_t)M * (K / MQ_KC);
    mx_quantize_kernel<<<(unsigned)((jobs + 7) / 8), 256, 0, (cudaStream_t)stream>>>(x, x_stride, K, M, q,
                                                                                     (uint8_t *)(q + (size_t)M * K));
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
    const uint8_t *rec = (const uint8_t *)(q + (size_t)M * K);
    const size_t rb = mx_row_bytes(w_type, K);
    return mx_dispatch(w_type, M, [&](mx_fn fn, int, int bytes) {
        const dim3 grid((unsigned)((N + MX_ROWS - 1) / MX_ROWS), 1, (unsigned)S);
        const int e2 = m40k_launch_pdl_smem(fn, grid, dim3(MQ_WARPS * 32), (size_t)bytes, (cudaStream_t)stream,
                                            (const uint8_t *)w, rb, N, K, q, rec, M, y, ldy, S, ws, counters);
        return e2 ? e2 : m40k_launch_status();
    });
}
