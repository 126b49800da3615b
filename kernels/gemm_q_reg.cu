/* The register kernel of the quantized GEMM (kernels.h 8e) for decode batches of 1..64
 * token rows, in the types of the files people serve (Q4_K, the regrouped Q8_0_G8 and
 * Q6_K_G8 of Q8_0 and Q4_K_M files, and the padded Q6_K_P and MXFP4_P of the experts):
 * y[t][r] = sum_k W[r][k] x[t][k], the same F16 weights and F32 sums of F16 products as
 * the shared-memory kernel of gemm_q.cu (twin: m40_ref_gemm_q), summed in another order.
 *
 * Why a second kernel: the shared-memory kernel forms each 128 x 64 weight tile in F16
 * in shared memory, then every warp reads it back; its warps meet at a barrier every 64
 * elements of K, and at 16-64 token rows there is too little tensor work between the
 * barriers to hide them (BENCHMARKS.md: 10-30% of bandwidth, most cycles without an
 * eligible warp). Here a warp turns the raw quantized bytes straight into the A fragments
 * of its mma.sync, in registers, and the block meets once per 256 elements of K, to hand
 * over a stage of a ring of cp.async copies several chunks deep.
 *
 * The trick that makes the fragments cheap: a product sums over k, so A and B may take k
 * in any order as long as both take the same one. In a 64-wide step, lane (g, t) (g =
 * lane / 4, t = lane % 4) holds for its weight rows the 8 elements 8t .. 8t+7 of each
 * 32-wide half (one 8-byte load for Q4_K and Q8_0), and mma q of the step (two a half)
 * takes elements 4q' .. 4q'+3 of them in its fragment slots 2t, 2t+1, 2t+8, 2t+9; the B
 * fragment of token g is then x[g][8t + 4q' .. +3], one 16-byte load for two mmas.
 *
 * Block: 8 warps, each one m16 tile of weight rows (16) by all BM token rows (BM 16, 32
 * or 64: NT = BM/8 n8 tiles; two m16 tiles a warp halve the x reads an mma but took one
 * block an SM and were slower at 64 rows, BENCHMARKS.md). Stage: the chunk's raw weight bytes
 * (rows padded where 8-byte loads would collide in a bank) and its x tile (BM x 256 F16,
 * rows padded to 576 bytes so that the 16-byte loads of a quarter warp hit 32 banks). */
#include "gemm_q_dev.h"

#define MR_XLD (MQ_KC + 32) /* halves a row of the staged x tile: 576 bytes */
#define MR_SMEM_MAX (227 * 1024)

#define MR_ROWS (MQ_WARPS * 16) /* weight rows a block at most: one m16 tile a warp */

/* Shared memory of one stage and the ring. Two blocks an SM where two stages each fit,
 * one otherwise; as many stages as fit (at most 4). The weight rows are padded against
 * bank conflicts unless the padding costs a stage of a ring shorter than 3. */
template <int T, int BM> struct mr_smem {
    enum {
        RB = mq_stage<T>::RB,
        X = BM * MR_XLD * 2,
        BLOCKS = 2 * (MR_ROWS * RB + X) <= MR_SMEM_MAX / 2 - 1024 ? 2 : 1,
        CAP = BLOCKS == 2 ? MR_SMEM_MAX / 2 - 1024 : MR_SMEM_MAX,
        WLDP = RB % 128 == 16 ? RB + 16 : RB, /* 144 -> 160, 272 -> 288: rows 8 banks apart */
        NSP0 = CAP / (MR_ROWS * WLDP + X),
        NSU0 = CAP / (MR_ROWS * RB + X),
        NSP = NSP0 > 4 ? 4 : NSP0,
        NSU = NSU0 > 4 ? 4 : NSU0,
        PAD = NSP >= 3 || NSP == NSU,
        WLD = PAD ? WLDP : RB,
        NS = PAD ? NSP : NSU,
        STAGE = MR_ROWS * WLD + X,
        BYTES = NS * STAGE
    };
    static_assert(NS >= 2, "a ring of at least two stages");
};

/* What a lane decodes once per chunk and row: the F16 scales and negated offsets of its
 * groups, formed in F16 arithmetic (one rounding of an exact product, as the twin's
 * RN(scale) and RN(offset) are: F32 would hold the same products exactly, and the F32 to
 * F16 conversions it took cost a slow pipe four of the loop's instructions in ten).
 * Q4_K: s[i], o[i] the pairs of sub-blocks 2i, 2i+1 (scale, -offset); Q8_0_G8: s[i] the
 * pair d[2i], d[2i+1], o[i] the pair times -128; Q6_K_G8, Q6_K_P: s[0] = d, o[0] = -32 d
 * (each half); MXFP4_P: the chunk's 8 scale bytes e[8] in s[0], s[1]. */
struct mr_cs {
    uint32_t s[4], o[4];
};

__device__ __forceinline__ uint32_t mr_byte(uint32_t w, int i) { return (w >> (8 * i)) & 0xFFu; }
__device__ __forceinline__ uint32_t mr_h2u(__half2 h) { return *reinterpret_cast<const uint32_t *>(&h); }
__device__ __forceinline__ __half2 mr_u2h(uint32_t u) { return *reinterpret_cast<const __half2 *>(&u); }

/* bytes 2i, 2i+1 of w (each < 1024) as an F16 pair, exact: under 0x64 (1024 + b), minus 1024 */
__device__ __forceinline__ __half2 mr_byte_pair(uint32_t w, int i)
{
    const __half2 k1024 = __halves2half2(__ushort_as_half(0x6400), __ushort_as_half(0x6400));
    return __hsub2(mr_u2h(__byte_perm(w, 0x64, i ? 0x4342u : 0x4140u)), k1024);
}

template <int T> __device__ __forceinline__ mr_cs mr_chunk_scales(const uint8_t *p, int j)
{
    mr_cs cs;
    if constexpr (T == M40K_TYPE_Q4_K) {
        const uint4 h = *reinterpret_cast<const uint4 *>(p); /* d, dmin | scales[12] */
        const uint32_t sa = h.y & 0x3f3f3f3fu, mc = h.z & 0x3f3f3f3fu;
        const uint32_t sb = (h.w & 0x0f0f0f0fu) | ((h.y >> 6) & 0x03030303u) << 4;
        const uint32_t md = ((h.w >> 4) & 0x0f0f0f0fu) | ((h.z >> 6) & 0x03030303u) << 4;
        const __half2 d = mr_u2h(__byte_perm(h.x, 0, 0x1010));                 /* d, d */
        const __half2 nm = mr_u2h(__byte_perm(h.x, 0, 0x3232) ^ 0x80008000u); /* -dmin, -dmin */
#pragma unroll
        for (int i = 0; i < 2; i++) {
            cs.s[i] = mr_h2u(__hmul2(mr_byte_pair(sa, i), d));
            cs.s[2 + i] = mr_h2u(__hmul2(mr_byte_pair(sb, i), d));
            cs.o[i] = mr_h2u(__hmul2(mr_byte_pair(mc, i), nm));
            cs.o[2 + i] = mr_h2u(__hmul2(mr_byte_pair(md, i), nm));
        }
    } else if constexpr (T == M40K_TYPE_Q8_0_G8) {
        const uint4 h = *reinterpret_cast<const uint4 *>(p);
        const __half2 k = __float2half2_rn(-128.0f);
        cs.s[0] = h.x, cs.s[1] = h.y, cs.s[2] = h.z, cs.s[3] = h.w;
#pragma unroll
        for (int i = 0; i < 4; i++)
            cs.o[i] = mr_h2u(__hmul2(mr_u2h(cs.s[i]), k));
    } else if constexpr (T == M40K_TYPE_MXFP4_P) { /* the chunk's 8 scale bytes e[8] */
        const uint2 h = *reinterpret_cast<const uint2 *>(p + 128);
        cs.s[0] = h.x, cs.s[1] = h.y;
    } else { /* Q6_K_G8: the group's d[j]; Q6_K_P: the superblock's d */
        const uint32_t d = mq_lds16(p + 208 + (T == M40K_TYPE_Q6_K_G8 ? 2 * j : 0));
        cs.s[0] = __byte_perm(d, 0, 0x1010);
        cs.o[0] = mr_h2u(__hmul2(mr_u2h(cs.s[0]), __float2half2_rn(-32.0f))); /* exact below 2048 */
    }
    return cs;
}

/* Group s's F16 scale and negated offset, each in both halves, where mr_chunk_scales
 * holds them in pairs (Q4_K, Q8_0_G8: pair s / 2, half s % 2) */
__device__ __forceinline__ void mr_group_scale(const mr_cs &cs, int s, __half2 &sc, __half2 &noff)
{
    const __half2 sp = mr_u2h(cs.s[s >> 1]), op = mr_u2h(cs.o[s >> 1]);
    sc = (s & 1) ? __high2half2(sp) : __low2half2(sp);
    noff = (s & 1) ? __high2half2(op) : __low2half2(op);
}

/* The 8 elements 32*s + l .. +7 (l a multiple of 8 below 32; s a constant after
 * unrolling) of a staged chunk row p as 8 bytes q (the q of m40k_group8: t0 elements 0-3,
 * t1 4-7), with their group's F16 scale and negated offset, each in both halves; cs: the
 * row's mr_chunk_scales. */
template <int T>
__device__ __forceinline__ void mr_deq8(const uint8_t *p, int s, int l, const mr_cs &cs, uint32_t &t0, uint32_t &t1,
                                        __half2 &sc, __half2 &noff)
{
    const int e = 32 * s + l;
    if constexpr (T == M40K_TYPE_Q4_K) {
        /* sub-block s: the low nibbles of bytes 32*(s/2) .. +31 for even s, the high ones for odd */
        const uint2 v = *reinterpret_cast<const uint2 *>(p + 16 + 32 * (s >> 1) + l);
        const int sh = (s & 1) * 4;
        t0 = (v.x >> sh) & 0x0F0F0F0Fu;
        t1 = (v.y >> sh) & 0x0F0F0F0Fu;
        mr_group_scale(cs, s, sc, noff);
    } else if constexpr (T == M40K_TYPE_Q8_0_G8) {
        const uint2 v = *reinterpret_cast<const uint2 *>(p + 16 + e);
        t0 = v.x ^ 0x80808080u; /* int8 + 128 */
        t1 = v.y ^ 0x80808080u;
        mr_group_scale(cs, s, sc, noff);
    } else { /* Q6_K_G8, Q6_K_P: superblock ql[128] | qh[64] | scales[16] (quant_dev.h); MXFP4_P: mr_frag8 */
        const int n = s >> 2, k = s & 3;
        const uint2 lo = *reinterpret_cast<const uint2 *>(p + 64 * n + 32 * (k & 1) + l);
        const uint2 hi = *reinterpret_cast<const uint2 *>(p + 128 + 32 * n + l);
        const int shl = k < 2 ? 0 : 4, shh = 2 * k;
        t0 = ((lo.x >> shl) & 0x0F0F0F0Fu) | (((hi.x >> shh) & 0x03030303u) << 4);
        t1 = ((lo.y >> shl) & 0x0F0F0F0Fu) | (((hi.y >> shh) & 0x03030303u) << 4);
        /* the int8 scale as 1024 + (b + 128) in both halves, exact, minus 1152 */
        const __half2 b = __hsub2(mr_u2h(__byte_perm((uint32_t)p[192 + (e >> 4)] ^ 0x80u, 0x64, 0x4040u)),
                                  __float2half2_rn(1152.0f));
        sc = __hmul2(b, mr_u2h(cs.s[0]));
        noff = __hmul2(b, mr_u2h(cs.o[0]));
    }
}

/* The 8 elements 32*s + l .. +7 of a staged chunk row p as F16, packed in mq_bytes_h2's
 * order (elements 0-1, 2-3, 4-5, 6-7 a word): w = RN(q * RN(scale) - RN(offset)) as
 * mq_pack forms it. MXFP4_P skips the bytes: an E2M1 nibble s|e1 e0|m placed as F16 bits
 * e1 e0 m at 11..9 and the sign at 15 IS its value times 2^-14 (e = 0, m = 1: the
 * subnormal 2^-15 = 0.5 * 2^-14), so one byte permute, two shifts and a logic op form two
 * weights; times 2^15 (exact) that is the doubled level q, then times RN(scale): the same
 * single rounding as mq_pack's with offset 0 (half the instructions of the byte lookup). */
template <int T> __device__ __forceinline__ uint4 mr_frag8(const uint8_t *p, int s, int l, const mr_cs &cs)
{
    if constexpr (T == M40K_TYPE_MXFP4_P) {
        const uint2 v = *reinterpret_cast<const uint2 *>(p + 16 * s + (l & 15));
        const int sh = l < 16 ? 0 : 4;
        const uint32_t w[2] = {v.x >> sh, v.y >> sh};
        const __half2 sc = __float2half2_rn(m40k_e8m0_half(mr_byte(cs.s[s >> 2], s & 3)));
        const __half2 k15 = __float2half2_rn(32768.0f);
        uint4 h;
        uint32_t *o = &h.x;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const uint32_t z = __byte_perm(w[i >> 1], 0u, (i & 1) ? 0x4342u : 0x4140u); /* two nibbles, a half each */
            const uint32_t f = ((z << 9) & 0x0E000E00u) | ((z << 12) & 0x80008000u);
            const __half2 r = __hmul2(__hmul2(*reinterpret_cast<const __half2 *>(&f), k15), sc);
            o[i] = *reinterpret_cast<const uint32_t *>(&r);
        }
        return h;
    } else {
        uint32_t t0, t1, q[4];
        __half2 sc, noff;
        mr_deq8<T>(p, s, l, cs, t0, t1, sc, noff);
        mq_bytes_h2(t0, t1, q);
        return mq_pack_h2(q, sc, noff);
    }
}

/* One block: weight rows R * bx .. +R of the product (R = rows: 96, 112 or 128, the first
 * R / 16 warps an m16 tile each, the others only copying), split s of S over K
 * (mr_kernel), or one tile of an expert's rows (mr_grouped_kernel, R 128, S 1). */
template <int T, int BM>
__device__ __forceinline__ void mr_block(const uint8_t *__restrict__ w, size_t row_bytes, int N, int K,
                                         const uint16_t *x, int64_t x_stride, int M, float *__restrict__ y,
                                         int64_t ldy, int S, float *ws, int *counters, int bx, int s, int rows)
{
    typedef mr_smem<T, BM> sm;
    constexpr int NT = BM / 8;
    constexpr int RB = sm::RB, WLD = sm::WLD, NS = sm::NS;
    extern __shared__ __align__(16) uint8_t mr_sm[];
    /* stage b: weights at mr_sm + b * STAGE (ROWS rows of WLD bytes), then x (BM rows of
     * MR_XLD halves) */
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
    const int n0 = bx * rows;
    const int nc = (K + MQ_KC - 1) / MQ_KC; /* MXFP4_P: a last chunk past K (zero weights, zero x) */
    const int c0 = (int)((int64_t)s * nc / S), c1 = (int)((int64_t)(s + 1) * nc / S);

    /* Each thread's copies are the same pieces of every chunk (consecutive threads,
     * consecutive 16-byte pieces of a row: a warp's copies are a few whole rows), so
     * where they come from and go is worked out once here and a chunk adds only its
     * offset (the index arithmetic per chunk and copy was a quarter of the kernel's
     * instructions, BENCHMARKS.md). Weights: copy k of this thread is piece i = tid +
     * 256k of the MR_ROWS x WP pieces (rows past N read row N - 1, never written; rows
     * past R are zero-filled, read from nowhere: wsz's bit k clear). x: row
     * tid / 32 + 8k, piece tid % 32 of its 32 (rows past M zero-filled). */
    constexpr int WP = RB / 16, KW = (MR_ROWS * WP + MQ_WARPS * 32 - 1) / (MQ_WARPS * 32), KX = BM / 8;
    static_assert(MQ_WARPS * 32 == 256, "x: 8 rows a round of 256 threads");
    /* source offset from row n0's start for chunk 0 (bit 0, Q6_K_G8: a piece of the
     * superblock, which moves 208 bytes a chunk within its group), and stage offset */
    uint32_t woff[KW], wdst[KW], wsz = 0;
#pragma unroll
    for (int k = 0; k < KW; k++) {
        const int i = tid + 256 * k, r = min(i / WP, MR_ROWS - 1), o = 16 * (i % WP);
        wsz |= (uint32_t)(r < rows) << k;
        const uint32_t ro = (uint32_t)((size_t)(min(n0 + r, N - 1) - n0) * row_bytes);
        if constexpr (T == M40K_TYPE_Q6_K_G8)
            woff[k] = ro + (o < 208 ? (uint32_t)o + 1u : 1664u + (uint32_t)(o - 208));
        else
            woff[k] = ro + (uint32_t)o;
        wdst[k] = (uint32_t)(r * WLD + o);
    }
    const uint8_t *w0 = w + (size_t)n0 * row_bytes;
    const int xr0 = tid >> 5, xp = tid & 31;
    const uint16_t *x0 = nullptr; /* x + row xr0, piece xp, once the kernel before is done (rows below M only) */

    /* chunk c's weights / x tile into stage b (nothing past the split's end) */
    auto issue_w = [&](int c, int b) {
        if (c < c1) {
            uint8_t *st = mr_sm + b * sm::STAGE;
#pragma unroll
            for (int k = 0; k < KW; k++)
                if ((MR_ROWS * WP) % 256 == 0 || k + 1 < KW || tid + 256 * k < MR_ROWS * WP) {
                    size_t src;
                    if constexpr (T == M40K_TYPE_Q6_K_G8) /* mq_chunk_src's layout */
                        src = (woff[k] & ~1u) + (size_t)1680 * (c >> 3) + (woff[k] & 1u ? 208u * (c & 7) : 0u);
                    else
                        src = woff[k] + (size_t)c * RB;
                    mq_cp16(st + wdst[k], w0 + src, (wsz >> k & 1u) * 16);
                }
        }
    };
    auto issue_x = [&](int c, int b) {
        if (c < c1) {
            uint8_t *xs = mr_sm + b * sm::STAGE + MR_ROWS * WLD + 16 * xp;
#pragma unroll
            for (int k = 0; k < KX; k++) {
                const int r = xr0 + 8 * k;
                const bool in = r < M && c * MQ_KC + 8 * xp < K; /* past M or K: zeros, the source within x */
                mq_cp16(xs + 2 * r * MR_XLD, in ? x0 + (size_t)8 * k * x_stride + (size_t)c * MQ_KC : x, in ? 16 : 0);
            }
        }
    };

    float acc[NT][4];
#pragma unroll
    for (int b = 0; b < NT; b++)
#pragma unroll
        for (int c = 0; c < 4; c++)
            acc[b][c] = 0.0f;

    /* this lane's weight rows in a stage: g and g + 8 of its warp's m16 tile */
    const int wrow = warp * 16 + g;
    auto wait_x = [&] {
        x = m40k_grid_wait_for(x);
        x0 = x + (size_t)xr0 * x_stride + 8 * xp;
    };
    const bool active = warp * 16 < rows; /* warp-uniform */
    mq_ring<NS>(c0, c1, issue_w, wait_x, issue_x, [&](int c, int stage) {
        if (!active)
            return;
        const uint8_t *st = mr_sm + stage * sm::STAGE;
        const uint16_t *xs = reinterpret_cast<const uint16_t *>(st + MR_ROWS * WLD);
        const uint8_t *row[2] = {st + wrow * WLD, st + (wrow + 8) * WLD};
        const mr_cs cs[2] = {mr_chunk_scales<T>(row[0], c & 7), mr_chunk_scales<T>(row[1], c & 7)};
#pragma unroll
        for (int half = 0; half < MQ_KC / 32; half++) {
            uint4 a[2];
#pragma unroll
            for (int h = 0; h < 2; h++)
                a[h] = mr_frag8<T>(row[h], half, 8 * t4, cs[h]);
            /* mma 0 takes elements 8t .. 8t+3 of the half, mma 1 8t+4 .. 8t+7 */
            const uint32_t a0[4] = {a[0].x, a[1].x, a[0].y, a[1].y};
            const uint32_t a1[4] = {a[0].z, a[1].z, a[0].w, a[1].w};
#pragma unroll
            for (int nt = 0; nt < NT; nt++) {
                const uint4 b = *reinterpret_cast<const uint4 *>(xs + (nt * 8 + g) * MR_XLD + 32 * half + 8 * t4);
                mq_mma(acc[nt], a0, b.x, b.y);
                mq_mma(acc[nt], a1, b.z, b.w);
            }
        }
    });

    mq_frag_store<NT>(acc, n0, rows, wrow, t4, N, M, y, ldy, S, s, ws, counters, active);
}

template <int T, int BM>
__global__ __launch_bounds__(MQ_WARPS * 32, mr_smem<T, BM>::BLOCKS) void mr_kernel(
    const uint8_t *__restrict__ w, size_t row_bytes, int N, int K, const uint16_t *x, int64_t x_stride,
    int M, float *__restrict__ y, int64_t ldy, int S, float *ws, int *counters, int rows)
{
    mr_block<T, BM>(w, row_bytes, N, K, x, x_stride, M, y, ldy, S, ws, counters, blockIdx.x, blockIdx.z, rows);
}

/* The experts' grouped product on the register kernel (kernels.h 10g; the tile table of
 * m40k_moe_group with tiles of at most BM rows): block (bx, i) takes tile i, (expert e,
 * its first row m0), and computes weight rows 128 * bx .. of expert e for rows m0 ..
 * m0 + BM of e's group (rows offsets[e] .. offsets[e+1] of x and y), as mr_kernel's block
 * bx of that expert's product with no split of K. The tile table is the product of an
 * earlier kernel: read after the grid dependency wait (a no-op on a plain launch), so no
 * weight copy goes out before it. */
template <int T, int BM>
__global__ __launch_bounds__(MQ_WARPS * 32, mr_smem<T, BM>::BLOCKS) void mr_grouped_kernel(
    const uint8_t *__restrict__ w, size_t row_bytes, size_t expert_bytes, int n_expert, int N, int K,
    const uint16_t *x, int64_t x_stride, const int32_t *offsets, const int32_t *tiles, float *__restrict__ y,
    int64_t ldy)
{
    m40k_grid_wait();
    M40K_LAUNDER(tiles);
    M40K_LAUNDER(offsets);
    int e, m0, base, M;
    if (!mq_group_tile(tiles, offsets, n_expert, blockIdx.y, e, m0, base, M))
        return;
    mr_block<T, BM>(w + (size_t)e * expert_bytes, row_bytes, N, K, x + (size_t)(base + m0) * x_stride, x_stride,
                    min(M - m0, BM), y + (size_t)(base + m0) * ldy, ldy, 1, nullptr, nullptr, blockIdx.x, 0, MR_ROWS);
}

int mr_reads(int w_type, int K, int M, const void *w, size_t row_bytes)
{
    return (w_type == M40K_TYPE_Q4_K || w_type == M40K_TYPE_Q8_0_G8 || w_type == M40K_TYPE_Q6_K_G8 ||
            w_type == M40K_TYPE_Q6_K_P || w_type == M40K_TYPE_MXFP4_P) && M >= 1 &&
           M <= 64 && K % (w_type == M40K_TYPE_Q6_K_G8 ? 2048 : w_type == M40K_TYPE_MXFP4_P ? 32 : MQ_KC) == 0 &&
           row_bytes % 16 == 0 &&
           ((uintptr_t)w & 15) == 0;
}

template <int T> static int mr_prepare_type(void)
{
    int e = mq_smem_limits(mr_kernel<T, 16>, mr_smem<T, 16>::BYTES, mr_kernel<T, 32>, mr_smem<T, 32>::BYTES,
                           mr_kernel<T, 64>, mr_smem<T, 64>::BYTES);
    if (!e)
        e = mq_smem_limits(mr_grouped_kernel<T, 16>, mr_smem<T, 16>::BYTES, mr_grouped_kernel<T, 32>,
                           mr_smem<T, 32>::BYTES, mr_grouped_kernel<T, 64>, mr_smem<T, 64>::BYTES);
    return e;
}

/* Raises the shared-memory limit of every instance on the current device, once. */
int mr_prepare(void)
{
    static bool done[64];
    return mq_once_per_device(done, [] {
        int e = mr_prepare_type<M40K_TYPE_Q4_K>();
        if (!e)
            e = mr_prepare_type<M40K_TYPE_Q8_0_G8>();
        if (!e)
            e = mr_prepare_type<M40K_TYPE_Q6_K_G8>();
        if (!e)
            e = mr_prepare_type<M40K_TYPE_Q6_K_P>();
        if (!e)
            e = mr_prepare_type<M40K_TYPE_MXFP4_P>();
        return e;
    });
}

typedef void (*mr_fn)(const uint8_t *, size_t, int, int, const uint16_t *, int64_t, int, float *, int64_t, int, float *,
                      int *, int);
typedef void (*mr_grouped_fn)(const uint8_t *, size_t, size_t, int, int, int, const uint16_t *, int64_t,
                              const int32_t *, const int32_t *, float *, int64_t);

/* f(kernel, its grouped kernel, blocks an SM, shared-memory bytes) for the instance of the
 * type and M rows */
template <int T, typename F> static int mr_with(int M, F f)
{
    switch (mq_frag_bm(M)) {
    case 16:
        return f(mr_kernel<T, 16>, mr_grouped_kernel<T, 16>, (int)mr_smem<T, 16>::BLOCKS, (int)mr_smem<T, 16>::BYTES);
    case 32:
        return f(mr_kernel<T, 32>, mr_grouped_kernel<T, 32>, (int)mr_smem<T, 32>::BLOCKS, (int)mr_smem<T, 32>::BYTES);
    default:
        return f(mr_kernel<T, 64>, mr_grouped_kernel<T, 64>, (int)mr_smem<T, 64>::BLOCKS, (int)mr_smem<T, 64>::BYTES);
    }
}

template <typename F> static int mr_dispatch(int w_type, int M, F f)
{
    switch (w_type) {
    case M40K_TYPE_Q4_K: return mr_with<M40K_TYPE_Q4_K>(M, f);
    case M40K_TYPE_Q8_0_G8: return mr_with<M40K_TYPE_Q8_0_G8>(M, f);
    case M40K_TYPE_Q6_K_G8: return mr_with<M40K_TYPE_Q6_K_G8>(M, f);
    case M40K_TYPE_Q6_K_P: return mr_with<M40K_TYPE_Q6_K_P>(M, f);
    case M40K_TYPE_MXFP4_P: return mr_with<M40K_TYPE_MXFP4_P>(M, f);
    default: return M40K_INVALID;
    }
}

/* The rows a block R and the splits S of a product: for each R (128, 112, 96), S as many
 * as fill the slots with one wave of blocks (mq_one_wave_splits); of those pairs, the one
 * whose busiest SM has the least work (its blocks times R times a split's chunks), the
 * larger R on a tie. Fewer rows than 128 even out a product whose 128-row blocks leave
 * SMs with one block while others hold two (28672 rows: 224 blocks on 264 slots of 132
 * SMs; at 112 rows, 256), or whose splits take uneven chunks (6144 x 4096: 48 blocks by
 * 5 splits of 3 or 4 chunks; at 96 rows, 64 by 4 of 4). Split counts past one wave, or
 * ones that leave half the slots empty, were slower at every shape measured
 * (BENCHMARKS.md, sessions 21 and 30). */
static void mr_pick(int N, int K, int blocks_per_sm, int sm_count, int &R_out, int &S_out)
{
    const int nc = (K + MQ_KC - 1) / MQ_KC;
    long best = -1;
    R_out = MR_ROWS, S_out = 1;
    for (int R = MR_ROWS; R >= MR_MIN_ROWS; R -= 16) {
        const int S = mq_one_wave_splits(blocks_per_sm, sm_count, N, R, K);
        const long blocks = (long)((N + R - 1) / R) * S;
        const long load = (blocks + sm_count - 1) / sm_count * R * ((nc + S - 1) / S);
        if (best < 0 || load < best)
            best = load, R_out = R, S_out = S;
    }
}

static int mr_blocks_per_sm(int w_type, int M)
{
    return mr_dispatch(w_type, M, [&](mr_fn, mr_grouped_fn, int blocks, int) { return blocks; });
}

int mr_pick_splits(int w_type, int N, int K, int M, int sm_count)
{
    int R, S;
    const int bps = mr_blocks_per_sm(w_type, M);
    if (bps <= 0 || sm_count <= 0)
        return 1;
    mr_pick(N, K, bps, sm_count, R, S);
    return S;
}

static int mr_forced_rows; /* m40k_gemm_q_rows */

extern "C" void m40k_gemm_q_rows(int rows)
{
    mr_forced_rows = rows == 96 || rows == 112 || rows == 128 ? rows : 0;
}

int mr_gemm(int w_type, const void *w, size_t row_bytes, int N, int K, const uint16_t *x, int64_t x_stride, int M,
            float *y, int64_t ldy, int S, float *ws, int *counters, cudaStream_t st)
{
    const int e = mr_prepare(); /* once per device */
    if (e)
        return e;
    const int sms = mq_sm_count();
    /* the picked rows where S is the picked split count (the caller's workspace may have
     * asked fewer), else 128 */
    int R = MR_ROWS, Rp, Sp;
    const int bps = mr_blocks_per_sm(w_type, M);
    if (mr_forced_rows)
        R = mr_forced_rows;
    else if (sms > 0 && bps > 0) {
        mr_pick(N, K, bps, sms, Rp, Sp);
        if (Sp == S)
            R = Rp;
    }
    return mr_dispatch(w_type, M, [&](mr_fn fn, mr_grouped_fn, int, int bytes) {
        const dim3 grid((unsigned)((N + R - 1) / R), 1, (unsigned)S);
        const int e2 = m40k_launch_pdl_smem(fn, grid, dim3(MQ_WARPS * 32), (size_t)bytes, st, (const uint8_t *)w,
                                            row_bytes, N, K, x, x_stride, M, y, ldy, S, ws, counters, R);
        return e2 ? e2 : m40k_launch_status();
    });
}

int mr_grouped(int w_type, const void *w, size_t row_bytes, size_t expert_bytes, int n_expert, int N, int K,
               const uint16_t *x, int64_t x_stride, const int32_t *offsets, const int32_t *tiles, int max_tiles, int bm,
               float *y, int64_t ldy, cudaStream_t st)
{
    if (bm != 16 && bm != 32 && bm != 64) /* the tiles must be one of the token tiles */
        return M40K_INVALID;
    const int e = mr_prepare(); /* once per device */
    if (e)
        return e;
    return mr_dispatch(w_type, bm, [&](mr_fn, mr_grouped_fn fn, int, int bytes) {
        const dim3 grid((unsigned)((N + MR_ROWS - 1) / MR_ROWS), (unsigned)max_tiles);
        fn<<<grid, MQ_WARPS * 32, (size_t)bytes, st>>>((const uint8_t *)w, row_bytes, expert_bytes, n_expert, N, K, x,
                                                       x_stride, offsets, tiles, y, ldy);
        return m40k_launch_status();
    });
}
