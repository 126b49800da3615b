/* Quantized GEMV with int8 activations: the decode matmul of Q8_0, Q4_0, Q4_K and Q6_K
 * weights, y[b][n] = W[n] . x[b] for batch 1..8 (kernels.h, 8b).
 *
 * 1. q8_quantize_kernel: one warp per 32-element block of x, two levels: x is rounded
 *    to d1*q1 (d1 = max|x|/127, q1 = rint(x/d1)), the residual r = x - d1*q1 to d2*q2
 *    (d2 = max|r|/127, q2 = rint(r/d2)); q = 0 where its d == 0. So
 *    x ~ d1*q1 + d2*q2 with |r| <= d1/2, hence d2 <= d1/254 and an error of at most
 *    d2/2 <= max|x|/254^2 per element, where one level alone had max|x|/254. Also the
 *    block sum s = d1*sum(q1) + d2*sum(q2) of the rounded x, for the weight offsets.
 *    Stored in the caller's workspace as one 80-byte record per block (gq_blk), blocks
 *    in x's order, so that one pointer per batch row reaches all of a block's data.
 * 2. gemv_q8_kernel<T, B, MINB>: integer dot products with __dp4a (4 int8 products per
 *    instruction) between the weight's small integers and q1 and q2, then the weight
 *    scales and d1, d2 in F32: per weight scale group with integer dots S1, S2, the
 *    group adds scale*(d1*S1 + d2*S2) (and offset*s). The weight is read once for all
 *    B batch rows.
 *
 * Work split. A lane's unit of work is one run of weights that shares its scales and
 * lines up with whole activation blocks: a Q8_0/Q4_0 block (32 elements), a Q4_K pair
 * of sub-blocks (64: the low and high nibbles of 32 qs bytes), a quarter of a Q6_K
 * superblock (64: four 16-element scale groups, 48 quant bytes). A warp takes R rows
 * at once (GQ_R = 2; Q4_K at batch 1: 4, gq_rows) and its lanes take consecutive units,
 * so each lane has R units (one per row) in flight, ~18..52 bytes each; x is loaded once
 * per unit and batch row, a weight scale group at a time (gq_row), and used for all R
 * rows. S warps of a block (1, 2 or 4, picked on the host from the shape, gq_split)
 * split a row's units round robin and meet in shared memory at the end.
 *
 * Loads. Every weight load is a streaming load (__ldcs) of an aligned chunk.
 * Q4_K superblocks (144 = 9 x 16 bytes) stay 16-byte aligned. Q8_0 (34 bytes), Q4_0
 * (18) and Q6_K (210) blocks start at any even offset: the 2 or 3 aligned chunks that
 * hold a piece are loaded whole and the piece's words are assembled in registers
 * (gq_window: a word shift by two levels of selects, then a funnel shift by 0 or 16
 * bits), no shared-memory staging, no byte loads. The engine uploads Q8_0 and Q6_K in
 * the regrouped layouts of kernels.h 0. where rows take whole groups (Q8_0_G8, Q6_K_G8:
 * 8 blocks with their scales gathered, every piece aligned, so one load a piece and no
 * assembly; Q6_K's unit then holds 15 words in flight instead of ~34). H100, mistral-7b
 * batch 1 (eleventh session): Q4_K_M 417.9 / 418.5 -> 425.5 / 426.1 tok/s with Q6_K_G8;
 * Q8_0_G8 alone 322.5 / 321.2 -> 320.3 / 319.4, but with the folded norm below 321.4 /
 * 319.5 -> 333.3 / 331.0.
 *
 * The folded RMSNorm (kernels.h 8d, batch 1). The producer (gemv_q8_norm_kernel) runs
 * blocks of 16 or 32 warps that hold one 32-row group each, the same warps a row and rows
 * a warp as the plain kernel: its epilogue adds the residual, quantizes the group's
 * x * norm weight with one warp and writes the group's sum of squares, with no exchange
 * between blocks. The consumer (the NIN instances) multiplies those records and scales
 * its rows by rsqrt(sum / K + eps), every block summing the same partial sums in the same
 * order. Two add+RMSNorm kernels a layer fewer: Q8_0 322.0 / 322.7 -> 328.9 / 329.1,
 * Q4_K_M 427.6 / 431.9 -> 442.9 / 443.3 tok/s. (The gated activation folded into the
 * gate/up GEMV the same way needs the two halves of a record from several blocks: with a
 * counter per record and the last block to arrive forming it, Q4_K_M fell to 386 / 391 and
 * Q8_0 to 320; not kept.)
 *
 * The greedy pick (kernels.h 9c, batch 1): after its store, warp 0 of each block forms the
 * keys of the block's rows from the same sums (m40k_argmax_key: value order, then the
 * lower id) and offers the largest to one 64-bit atomicMax, skipped when the key there is
 * already larger. Q4_K_M 446.9 / 449.2 / 448.5 -> 450.6 / 451.6 / 450.7 tok/s (the
 * sampling kernel gone from the end of the step; twelfth session).
 *
 * Dot products. __dp4a starts from the integer 0x4B400000 (the bits of the float
 * 1.5*2^23), so the accumulated bits ARE the float 1.5*2^23 + dot while
 * |dot| < 2^22 (largest here: 32*128*127 for Q8_0) and one FADD converts it. Nibbles are
 * unpacked with a mask and a shift per 4 bytes; Q6_K's 6-bit values get their bias of
 * 32 byte-wise as ((q + 0x60) ^ 0x80), no carries since q + 0x60 < 0x100. Per 32
 * weights and batch row: 16 dp4a (8 against q1, 8 against q2) and 5..6 F32 ops, plus
 * loads of x shared by the GQ_R rows. sm_90 SASS of the main loop, per byte of weight
 * streamed: batch 1 ~2.2 (Q8_0), 3.5 (Q4_K), 4.1 (Q4_0), 5.5 (Q6_K) instructions per
 * lane; batch 8 ~7.6, 22, 14.6, 16 (Q4_K and Q6_K with the batch loop rolled,
 * gq_rolled). An H100 issues ~11 per byte at 3 TB/s, so batch 1 is memory-bound and
 * batch 8 issue-bound.
 * On sm_90 at most 128 registers (GQ_MIN_BLOCKS), >= 16 warps per SM, no spills but 4
 * bytes in Q4_0's batch-7 instance (nvcc -Xptxas -v, CUDA 13). (Q4_K at
 * batch 1 had a 64-register instance of 8 blocks an SM for rows of K <= 4096: 32 warps,
 * twice the bytes in flight; four rows a warp, gq_rows, replaced it.)
 *
 * The CPU twin (m40_ref_quantize_q8 / m40_ref_gemv_q8 in kernels/ref/cpu_ref.c) writes the
 * same workspace bytes and forms the same integer dots and the same per-group F32
 * terms; only the order of the F32 additions differs. */
#include <string.h>

#include "quant_dev.h"
#include "q8_dev.h"
#include "moe_act_dev.h"

#define GQ_WARPS 4
#define GQ_R 2               /* rows per warp */
#define GQ_MAGIC 0x4B400000  /* bits of 1.5*2^23 */
/* blocks per SM for __launch_bounds__: 4 caps sm_90 at 128 registers with no spills;
 * the older targets' code needs a few more for the largest instances, 3 (168) avoids
 * their spills */
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#define GQ_MIN_BLOCKS 3
#else
#define GQ_MIN_BLOCKS 4
#endif

__device__ __forceinline__ float gq_f(int acc) { return __int_as_float(acc) - 12582912.0f; }

/* ------------------------------------------------------------------ x quantization */
__global__ __launch_bounds__(256) void q8_quantize_kernel(const float *__restrict__ x, int64_t x_stride, int K,
                                                           int nblk, gq_blk *__restrict__ out)
{
    m40k_pdl_begin(); /* PDL-launched; a PDL-launched kernel may follow */
    M40K_LAUNDER(x);
    M40K_LAUNDER(out);
    const int blk = blockIdx.x * 8 + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (blk >= nblk)
        return; /* whole warps only */
    const int per = K / 32, b = blk / per, j = blk % per;
    gq_quantize_block(x[b * x_stride + 32 * j + lane], lane, out + blk); /* block j of batch row b */
}

/* ------------------------------------------------------------------ weight loads */
/* Words out[i] = the 4 bytes at p + 4i (i < NW) of a piece of LEN bytes at an even
 * address p: the aligned 16-byte chunks holding p .. p+LEN-1 are loaded (never one
 * past them), the words of the window are shifted down by (p & 15) >> 2 with two levels
 * of selects, then funnel-shifted by 0 or 16 bits. Bytes of out past the piece are
 * unspecified. */
template <int LEN, int NW>
__device__ __forceinline__ void gq_window(const uint8_t *p, uint32_t (&out)[NW])
{
    constexpr int NC = (LEN + 14 + 15) / 16; /* chunks at the worst offset, 14 */
    const uint4 *a = reinterpret_cast<const uint4 *>((uintptr_t)p & ~(uintptr_t)15);
    const int o = (int)((uintptr_t)p & 15), q = o >> 2, sh = (o & 3) * 8;
    uint32_t w[4 * NC + 4];
#pragma unroll
    for (int c = 0; c < NC; c++) {
        uint4 v = make_uint4(0, 0, 0, 0);
        if (c == 0 || 16 * c < o + LEN)
            v = __ldcs(a + c);
        w[4 * c] = v.x, w[4 * c + 1] = v.y, w[4 * c + 2] = v.z, w[4 * c + 3] = v.w;
    }
#pragma unroll
    for (int i = 4 * NC; i < 4 * NC + 4; i++)
        w[i] = 0;
    uint32_t v[NW + 2], u[NW + 1];
#pragma unroll
    for (int j = 0; j < NW + 2; j++)
        v[j] = (q & 2) ? w[j + 2] : w[j];
#pragma unroll
    for (int j = 0; j < NW + 1; j++)
        u[j] = (q & 1) ? v[j + 1] : v[j];
#pragma unroll
    for (int i = 0; i < NW; i++)
        out[i] = __funnelshift_r(u[i], u[i + 1], sh);
}

/* 0..255 byte value (or a small signed int) to float without I2F, as gq_f. */
__device__ __forceinline__ float gq_i2f(int v) { return gq_f(GQ_MAGIC + v); }

/* ------------------------------------------------------------------ per type */

/* s + the dot of 4 weight words (16 int8) with 16 activation int8. */
__device__ __forceinline__ int gq_dot16(const uint32_t *w, int4 v, int s)
{
    s = __dp4a((int)w[0], v.x, s), s = __dp4a((int)w[1], v.y, s);
    s = __dp4a((int)w[2], v.z, s), s = __dp4a((int)w[3], v.w, s);
    return s;
}

/* d1*S1 + d2*S2 for the dp4a sums s1 (against q1) and s2 (against q2) of one group. */
__device__ __forceinline__ float gq_two(float d1, float d2, int s1, int s2)
{
    return fmaf(d1, gq_f(s1), d2 * gq_f(s2));
}

/* gq<T>: UE elements per unit, in G groups of one weight scale each; W = one unit of
 * one row, decoded (load_w); X = the activations of group g of one unit for one batch
 * row (load_x: v1 from q1, v2 from q2, UE/G bytes each, and the block's scales); dot
 * adds group g of W.X to acc. One group of x at a time is live, in registers shared by
 * the GQ_R rows. */
template <int T> struct gq;

/* Q8_0, unit = block u: d f16 | qs[32] int8 at 34u; adds d*(d1*S1 + d2*S2). */
template <> struct gq<M40K_TYPE_Q8_0> {
    enum { UE = 32, G = 1 };
    struct W {
        uint32_t q[8];
        float d;
    };
    struct X {
        int4 v1[2], v2[2];
        float2 d;
    };
    static __device__ __forceinline__ void load_w(const uint8_t *row, int u, W &w)
    {
        uint32_t t[9];
        gq_window<34, 9>(row + 34 * u, t);
        w.d = m40k_h2f((uint16_t)(t[0] & 0xFFFF));
#pragma unroll
        for (int i = 0; i < 8; i++)
            w.q[i] = __byte_perm(t[i], t[i + 1], 0x5432); /* bytes 2 + 4i .. 5 + 4i */
    }
    static __device__ __forceinline__ void load_x(const gq_blk *p, int u, int, X &x)
    {
        const int4 *q = reinterpret_cast<const int4 *>(p + u);
        x.v1[0] = __ldca(q), x.v1[1] = __ldca(q + 1), x.v2[0] = __ldca(q + 2), x.v2[1] = __ldca(q + 3);
        x.d = __ldca(reinterpret_cast<const float2 *>(&p[u].d1));
    }
    static __device__ __forceinline__ float dot(const W &w, const X &x, int, float acc)
    {
        const int s = gq_dot16(w.q + 4, x.v1[1], gq_dot16(w.q, x.v1[0], GQ_MAGIC));
        const int t = gq_dot16(w.q + 4, x.v2[1], gq_dot16(w.q, x.v2[0], GQ_MAGIC));
        return fmaf(w.d, gq_two(x.d.x, x.d.y, s, t), acc);
    }
};

/* Q4_0, unit = block u: d f16 | qs[16] at 18u; element j < 16 is the low nibble of
 * qs[j], j + 16 the high one; w = d*(q - 8), so W.X = d*(d1*S1 + d2*S2) - 8*d*s. */
template <> struct gq<M40K_TYPE_Q4_0> {
    enum { UE = 32, G = 1 };
    struct W {
        uint32_t lo[4], hi[4];
        float d, d8;
    };
    struct X {
        int4 v1[2], v2[2];
        float4 d; /* d1, d2, s, 0 */
    };
    static __device__ __forceinline__ void load_w(const uint8_t *row, int u, W &w)
    {
        uint32_t t[5];
        gq_window<18, 5>(row + 18 * u, t);
        w.d = m40k_h2f((uint16_t)(t[0] & 0xFFFF));
        w.d8 = -8.0f * w.d;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const uint32_t v = __byte_perm(t[i], t[i + 1], 0x5432);
            w.lo[i] = v & 0x0F0F0F0Fu;
            w.hi[i] = (v >> 4) & 0x0F0F0F0Fu;
        }
    }
    static __device__ __forceinline__ void load_x(const gq_blk *p, int u, int, X &x)
    {
        const int4 *q = reinterpret_cast<const int4 *>(p + u);
        x.v1[0] = __ldca(q), x.v1[1] = __ldca(q + 1), x.v2[0] = __ldca(q + 2), x.v2[1] = __ldca(q + 3);
        x.d = __ldca(reinterpret_cast<const float4 *>(q + 4));
    }
    static __device__ __forceinline__ float dot(const W &w, const X &x, int, float acc)
    {
        const int s = gq_dot16(w.hi, x.v1[1], gq_dot16(w.lo, x.v1[0], GQ_MAGIC));
        const int t = gq_dot16(w.hi, x.v2[1], gq_dot16(w.lo, x.v2[0], GQ_MAGIC));
        return fmaf(w.d, gq_two(x.d.x, x.d.y, s, t), fmaf(w.d8, x.d.z, acc));
    }
};

/* MXFP4_P (kernels.h 0., the experts' MXFP4 in chunks of 8 blocks: qs[8][16] | e[8] | 8
 * zero bytes), unit = block u: its 16 nibble bytes (element j < 16 the low nibble of
 * qs[j], j + 16 the high one) in one aligned load, its scale byte from the chunk's e
 * words. Each nibble becomes its signed doubled E2M1 level as an int8 by byte permutes
 * (gq_mxfp4_levels), w = level * 2^(e - 128), so W.X = 2^(e-128) * (d1*S1 + d2*S2): once
 * loaded, a unit is a Q8_0 block (its int8 values and one scale), whose records, product
 * and dot it takes. */
__device__ __forceinline__ void gq_mxfp4_levels(uint32_t w, uint32_t &lo, uint32_t &hi)
{
    /* per nibble: the magnitude's index (bits 0-2) picks a byte of the positive levels
     * 0,1,2,3 | 4,6,8,12 and of the negative ones; the sign (bit 3, moved to bit 2) then
     * picks between the two, byte by byte */
    const uint32_t m = w & 0x77777777u, sg = (w & 0x88888888u) >> 1;
    uint32_t r[2];
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const uint32_t mh = m >> (16 * h);
        const uint32_t pos = __byte_perm(0x03020100u, 0x0C080604u, mh);
        const uint32_t neg = __byte_perm(0xFDFEFF00u, 0xF4F8FAFCu, mh);
        r[h] = __byte_perm(pos, neg, 0x3210u | ((sg >> (16 * h)) & 0x4444u));
    }
    /* r holds the levels of the bytes' low, high, low, high nibbles: split them */
    lo = __byte_perm(r[0], r[1], 0x6420u);
    hi = __byte_perm(r[0], r[1], 0x7531u);
}

template <> struct gq<M40K_TYPE_MXFP4_P> : gq<M40K_TYPE_Q8_0> {
    static __device__ __forceinline__ void load_w(const uint8_t *row, int u, W &w)
    {
        const uint8_t *c = row + 144 * (u >> 3);
        const int j = u & 7;
        const uint4 qv = __ldcs(reinterpret_cast<const uint4 *>(c + 16 * j));
        const uint32_t ew = __ldcs(reinterpret_cast<const unsigned int *>(c + 128) + (j >> 2));
        w.d = m40k_e8m0_half((ew >> (8 * (j & 3))) & 0xFFu);
        const uint32_t qw[4] = {qv.x, qv.y, qv.z, qv.w};
#pragma unroll
        for (int i = 0; i < 4; i++)
            gq_mxfp4_levels(qw[i], w.q[i], w.q[4 + i]); /* elements 0-15, then 16-31 */
    }
};

/* Q4_K, unit u = chunk c = u & 3 of superblock u >> 2 (d f16 | dmin f16 | scales[12] |
 * qs[128], 144 bytes): qs[32c .. 32c+32) hold sub-block 2c in the low nibbles and 2c+1
 * in the high ones (x blocks 2u, 2u+1), w = d*sc*q - dmin*m per sub-block, so each
 * sub-block adds (d*sc)*(d1*S1 + d2*S2) - (dmin*m)*s. */
template <> struct gq<M40K_TYPE_Q4_K> {
    enum { UE = 64, G = 2 };
    struct W {
        uint32_t lo[8], hi[8];
        float a0, a1, m0, m1; /* d*sc and -dmin*m of sub-blocks 2c, 2c+1 */
    };
    struct X {
        int4 v1[2], v2[2]; /* sub-block 2c + g: x block 2u + g */
        float4 d;          /* d1, d2, s, 0 */
    };
    static __device__ __forceinline__ void load_w(const uint8_t *row, int u, W &w)
    {
        const uint4 *sb = reinterpret_cast<const uint4 *>(row + 144 * (u >> 2));
        const int c = u & 3;
        const uint4 h = __ldcs(sb), qa = __ldcs(sb + 1 + 2 * c), qb = __ldcs(sb + 2 + 2 * c);
        const uint32_t qw[8] = {qa.x, qa.y, qa.z, qa.w, qb.x, qb.y, qb.z, qb.w};
#pragma unroll
        for (int i = 0; i < 8; i++) {
            w.lo[i] = qw[i] & 0x0F0F0F0Fu;
            w.hi[i] = (qw[i] >> 4) & 0x0F0F0F0Fu;
        }
        /* scales[] = bytes of h.y, h.z, h.w. Sub-block t = 2c + e (e = 0, 1) sits in byte
         * j = t & 3 of each: t < 4: sc = scales[t] & 63, m = scales[t+4] & 63; t >= 4:
         * sc = scales[t+4] & 15 | (scales[t-4] >> 6) << 4, m = scales[t+4] >> 4 |
         * (scales[t] >> 6) << 4. Both sub-blocks at once in the low 2 bytes. */
        const int sh = 16 * (c & 1);
        const uint32_t y = h.y >> sh, z = h.z >> sh, x = h.w >> sh;
        const uint32_t sc = c < 2 ? y & 0x3F3Fu : (x & 0x0F0Fu) | ((y >> 2) & 0x3030u);
        const uint32_t mn = c < 2 ? z & 0x3F3Fu : ((x >> 4) & 0x0F0Fu) | ((z >> 2) & 0x3030u);
        const float d = m40k_h2f((uint16_t)(h.x & 0xFFFF)), dmin = m40k_h2f((uint16_t)(h.x >> 16));
        w.a0 = d * gq_i2f(sc & 0xFF), w.a1 = d * gq_i2f(sc >> 8);
        w.m0 = -(dmin * gq_i2f(mn & 0xFF)), w.m1 = -(dmin * gq_i2f(mn >> 8));
    }
    static __device__ __forceinline__ void load_x(const gq_blk *p, int u, int g, X &x)
    {
        const int4 *q = reinterpret_cast<const int4 *>(p + 2 * u + g);
        x.v1[0] = __ldca(q), x.v1[1] = __ldca(q + 1), x.v2[0] = __ldca(q + 2), x.v2[1] = __ldca(q + 3);
        x.d = __ldca(reinterpret_cast<const float4 *>(q + 4));
    }
    static __device__ __forceinline__ float dot(const W &w, const X &x, int g, float acc)
    {
        const uint32_t(&q)[8] = g ? w.hi : w.lo;
        const int s = gq_dot16(q + 4, x.v1[1], gq_dot16(q, x.v1[0], GQ_MAGIC));
        const int t = gq_dot16(q + 4, x.v2[1], gq_dot16(q, x.v2[0], GQ_MAGIC));
        return fmaf(g ? w.a1 : w.a0, gq_two(x.d.x, x.d.y, s, t), fmaf(g ? w.m1 : w.m0, x.d.z, acc));
    }
};

/* Q6_K, unit u = (superblock i = u >> 2, half n = (u >> 1) & 1, l0 = 16*(u & 1)) of
 * ql[128] | qh[64] | scales[16] int8 | d f16 (210 bytes): elements 128n + 32k + l0 + j
 * (k < 4, j < 16), one scale group (index 8n + 2k + (u & 1)) each, in x block
 * 8i + 4n + k. Element l of quarter k: low 4 bits from ql[64n + 32(k&1) + l] (low
 * nibble for k < 2, high for k >= 2), top 2 from bits 2k of qh[32n + l], bias 32. Each
 * group adds (d*sc)*(d1*S1 + d2*S2) with S = sum((q-32)*q1 or q2). */
template <> struct gq<M40K_TYPE_Q6_K> {
    enum { UE = 64, G = 4 };
    struct W {
        uint32_t q[4][4]; /* [k][word]: q - 32 as int8 */
        float a[4];       /* d*sc per k */
    };
    struct X {
        int4 v1, v2; /* quarter k = g: x block 8i + 4n + k */
        float2 d;
    };
    static __device__ __forceinline__ uint32_t bias32(uint32_t v) { return (v + 0x60606060u) ^ 0x80808080u; }
    /* unit (n, h) from its ql words A (low nibbles: k 0, high: k 2), Bq (k 1, 3), qh words
     * H, scale words s0 = scales[8n .. 8n+4), s1 = scales[8n+4 .. 8n+8) and d */
    static __device__ __forceinline__ void decode(const uint32_t (&A)[4], const uint32_t (&Bq)[4],
                                                  const uint32_t (&H)[4], uint32_t s0, uint32_t s1, int h, float d,
                                                  W &w)
    {
#pragma unroll
        for (int i = 0; i < 4; i++) {
            w.q[0][i] = bias32((A[i] & 0x0F0F0F0Fu) | ((H[i] << 4) & 0x30303030u));
            w.q[1][i] = bias32((Bq[i] & 0x0F0F0F0Fu) | ((H[i] << 2) & 0x30303030u));
            w.q[2][i] = bias32(((A[i] >> 4) & 0x0F0F0F0Fu) | (H[i] & 0x30303030u));
            w.q[3][i] = bias32(((Bq[i] >> 4) & 0x0F0F0F0Fu) | ((H[i] >> 2) & 0x30303030u));
        }
        /* group 8n + 2k + h: byte 2(k&1) + h of scale word 2n + (k >> 1) */
        s0 >>= 8 * h, s1 >>= 8 * h;
        w.a[0] = d * gq_i2f((int)(s0 << 24) >> 24), w.a[1] = d * gq_i2f((int)(s0 << 8) >> 24);
        w.a[2] = d * gq_i2f((int)(s1 << 24) >> 24), w.a[3] = d * gq_i2f((int)(s1 << 8) >> 24);
    }
    static __device__ __forceinline__ void load_w(const uint8_t *row, int u, W &w)
    {
        const uint8_t *sb = row + 210 * (u >> 2);
        const int n = (u >> 1) & 1, h = u & 1;
        uint32_t A[4], Bq[4], H[4], t[5];
        gq_window<16, 4>(sb + 64 * n + 16 * h, A);
        gq_window<16, 4>(sb + 64 * n + 32 + 16 * h, Bq);
        gq_window<16, 4>(sb + 128 + 32 * n + 16 * h, H);
        gq_window<18, 5>(sb + 192, t); /* scales[16] | d */
        decode(A, Bq, H, n ? t[2] : t[0], n ? t[3] : t[1], h, m40k_h2f((uint16_t)(t[4] & 0xFFFF)), w);
    }
    static __device__ __forceinline__ void load_x(const gq_blk *p, int u, int k, X &x)
    {
        const gq_blk *bk = p + 8 * (u >> 2) + 4 * ((u >> 1) & 1) + k;
        const int4 *q = reinterpret_cast<const int4 *>(bk) + (u & 1);
        x.v1 = __ldca(q), x.v2 = __ldca(q + 2);
        x.d = __ldca(reinterpret_cast<const float2 *>(&bk->d1));
    }
    static __device__ __forceinline__ float dot(const W &w, const X &x, int k, float acc)
    {
        const int s = gq_dot16(w.q[k], x.v1, GQ_MAGIC), t = gq_dot16(w.q[k], x.v2, GQ_MAGIC);
        return fmaf(w.a[k], gq_two(x.d.x, x.d.y, s, t), acc);
    }
};

/* Q8_0_G8 (kernels.h 0.), unit = block u, j = u & 7 of group u >> 3 (d[8] f16 |
 * qs[8][32], 272 bytes): its 32 quants in two aligned 16-byte loads, its d from the
 * aligned word it shares with block j ^ 1; the rest as Q8_0. */
template <> struct gq<M40K_TYPE_Q8_0_G8> : gq<M40K_TYPE_Q8_0> {
    static __device__ __forceinline__ void load_w(const uint8_t *row, int u, W &w)
    {
        const uint8_t *g = row + 272 * (u >> 3);
        const int j = u & 7;
        const uint4 *qs = reinterpret_cast<const uint4 *>(g + 16 + 32 * j);
        const uint4 a = __ldcs(qs), b = __ldcs(qs + 1);
        const uint32_t dw = __ldcs(reinterpret_cast<const unsigned int *>(g) + (j >> 1));
        w.d = m40k_h2f((uint16_t)(j & 1 ? dw >> 16 : dw & 0xFFFF));
        w.q[0] = a.x, w.q[1] = a.y, w.q[2] = a.z, w.q[3] = a.w;
        w.q[4] = b.x, w.q[5] = b.y, w.q[6] = b.z, w.q[7] = b.w;
    }
};

/* Q6_K_G8 (kernels.h 0.), unit u of superblock i = u >> 2 as Q6_K; the superblock's
 * ql | qh | scales (208 bytes) at 208 * (i & 7) of group i >> 3 (1680 bytes), its d at
 * 1664 + 2 * (i & 7): three aligned 16-byte loads of quants, one of 8 scale bytes, one
 * word holding d. */
template <> struct gq<M40K_TYPE_Q6_K_G8> : gq<M40K_TYPE_Q6_K> {
    static __device__ __forceinline__ void load_w(const uint8_t *row, int u, W &w)
    {
        const int i = u >> 2, n = (u >> 1) & 1, h = u & 1, j = i & 7;
        const uint8_t *g = row + 1680 * (i >> 3), *sb = g + 208 * j;
        const uint4 a = __ldcs(reinterpret_cast<const uint4 *>(sb + 64 * n + 16 * h));
        const uint4 b = __ldcs(reinterpret_cast<const uint4 *>(sb + 64 * n + 32 + 16 * h));
        const uint4 c = __ldcs(reinterpret_cast<const uint4 *>(sb + 128 + 32 * n + 16 * h));
        const uint2 sc = __ldcs(reinterpret_cast<const uint2 *>(sb + 192 + 8 * n));
        const uint32_t dw = __ldcs(reinterpret_cast<const unsigned int *>(g + 1664) + (j >> 1));
        const uint32_t A[4] = {a.x, a.y, a.z, a.w}, Bq[4] = {b.x, b.y, b.z, b.w}, H[4] = {c.x, c.y, c.z, c.w};
        decode(A, Bq, H, sc.x, sc.y, h, m40k_h2f((uint16_t)(j & 1 ? dw >> 16 : dw & 0xFFFF)), w);
    }
};

/* Q6_K_P (kernels.h 0., the experts' padded Q6_K: 210 bytes and 14 zero bytes a
 * superblock), unit u as Q6_K: every piece 16-byte aligned, so three 16-byte loads of
 * quants, one of 8 scale bytes and the word holding d, as Q6_K_G8. */
template <> struct gq<M40K_TYPE_Q6_K_P> : gq<M40K_TYPE_Q6_K> {
    static __device__ __forceinline__ void load_w(const uint8_t *row, int u, W &w)
    {
        const int n = (u >> 1) & 1, h = u & 1;
        const uint8_t *sb = row + 224 * (u >> 2);
        const uint4 a = __ldcs(reinterpret_cast<const uint4 *>(sb + 64 * n + 16 * h));
        const uint4 b = __ldcs(reinterpret_cast<const uint4 *>(sb + 64 * n + 32 + 16 * h));
        const uint4 c = __ldcs(reinterpret_cast<const uint4 *>(sb + 128 + 32 * n + 16 * h));
        const uint2 sc = __ldcs(reinterpret_cast<const uint2 *>(sb + 192 + 8 * n));
        const uint32_t dw = __ldcs(reinterpret_cast<const unsigned int *>(sb + 208));
        const uint32_t A[4] = {a.x, a.y, a.z, a.w}, Bq[4] = {b.x, b.y, b.z, b.w}, H[4] = {c.x, c.y, c.z, c.w};
        decode(A, Bq, H, sc.x, sc.y, h, m40k_h2f((uint16_t)(dw & 0xFFFF)), w);
    }
};

/* The GGUF type whose blocks (and so whose arithmetic) a regrouped or padded layout has. */
__host__ __device__ constexpr int gq_base(int T)
{
    return T == M40K_TYPE_Q8_0_G8                                   ? M40K_TYPE_Q8_0
           : T == M40K_TYPE_Q6_K_G8 || T == M40K_TYPE_Q6_K_P ? M40K_TYPE_Q6_K
                                                                    : T;
}

/* ------------------------------------------------------------------ kernel */
/* acc[r] += unit u of row r of W (wr) . batch row xb of x, r < R, group by group. */
template <int T, int R>
__device__ __forceinline__ void gq_row(const typename gq<T>::W (&wr)[R], const gq_blk *xb, int u, float (&acc)[R])
{
#pragma unroll
    for (int g = 0; g < gq<T>::G; g++) {
        typename gq<T>::X xr;
        gq<T>::load_x(xb, u, g, xr);
#pragma unroll
        for (int r = 0; r < R; r++)
            acc[r] = gq<T>::dot(wr[r], xr, g, acc[r]);
    }
}

/* Whether the batch loop stays rolled. Unrolled, ptxas issues the x loads of later
 * batch rows early and, where the decoded weights are largest (Q4_K, Q6_K: 2 x 20
 * registers), spills the accumulators (Q6_K from batch 2, Q4_K from batch 3; at 168
 * registers too). Rolled, one batch row's x is in flight: <= 118 registers, no spills,
 * at a cost in sm_90 instructions per unit at batch 8 of +15% (Q6_K) and +60% (Q4_K,
 * whose nibble unpacking ptxas then redoes per batch row). */
__host__ __device__ constexpr bool gq_rolled(int T, int B)
{
    return (gq_base(T) == M40K_TYPE_Q6_K && B >= 2) || (T == M40K_TYPE_Q4_K && B >= 3);
}

/* Rows of each lane's first unit loaded before the PDL wait: both, but Q8_0's first row
 * only. Those loads go out while the kernels before the GEMV (norm, attention,
 * quantization) still run and compete with their loads. Measured per type (mistral-7b,
 * batch 1, H100, tokens/s, with the splits of gq_split): Q8_0 one row 322.1 / 321.1, two
 * 320.1 / 318.3, none 311.0; Q4_K one row 395.3 against 408.7 for two, Q6_K one row
 * 406.5 (BENCHMARKS.md, tenth session). */
__host__ __device__ constexpr int gq_early(int T, int R) { return gq_base(T) == M40K_TYPE_Q8_0 ? 1 : R; }

/* Rows a warp takes (R): 4 for Q4_K at batch 1, so that each lane has four units in flight
 * and a product half the blocks (126 registers, no spills); 2 for the other types and at
 * batch 2-8. Q4_K_M on an H100 (mistral-7b, tokens/s, one call): 407.6 with R 2 (and,
 * for rows of K <= 4096, the 64-register instance of 8 blocks an SM this replaced), 418.4
 * with R 4, 408.9 with R 4 on the long rows only; R 4 with two rows early 415.3. Q8_0
 * with R 4 measured slower (315.0 / 312.9 against 322.5 / 322.1), Q6_K spills at 4;
 * Q6_K_G8 fits four in 128 registers but measured slower (419.6 / 418.5 against 425.5 /
 * 426.1, eleventh session). */
__host__ __device__ constexpr int gq_rows(int T, int B) { return T == M40K_TYPE_Q4_K && B == 1 ? 4 : GQ_R; }

/* The RMSNorm of a decode layer folded into the int8 GEMVs around it (kernels.h 8d), at
 * batch 1. gq_nin, the consumer's side: x's records are of v = x_res * w_norm unscaled
 * and ss holds the sums of squares of x_res per 32-element group; the product is scaled
 * by rsqrt(sum(ss) / K + eps) at the end (the GEMV is linear in x). Every block sums ss
 * in the same order, so all of them apply the same factor. ss == NULL: no factor. */
struct gq_nin {
    const float *ss;
    float eps;
};

/* gq_nout, the producer's side: instead of y, the block (which holds whole 32-row groups)
 * writes x_out = x + (W.x + bias) for its rows, the records of x_out * w_norm into xq and
 * the sum of squares of x_out per group into ss. x == NULL: a plain product into y. */
struct gq_nout {
    const float *x, *w_norm, *bias; /* bias: [N] or NULL */
    float *x_out, *ss;
    gq_blk *xq;
};

/* The block's sum of v over all its threads, in a fixed order (the same in every block of
 * the same width). red: W floats of shared memory; one barrier. */
template <int W> __device__ __forceinline__ float gq_block_sum(float v, float *red)
{
    v = m40k_warp_sum(v);
    if ((threadIdx.x & 31) == 0)
        red[threadIdx.x >> 5] = v;
    __syncthreads();
    float t = 0.0f;
#pragma unroll
    for (int k = 0; k < W; k++)
        t += red[k];
    return t;
}

/* One block's share of y = W . x: block blk of the product's grid (blockIdx.x, or its
 * index within its own product in a launch of two, gemv_q8_pair_kernel), W warps. */
template <int T, int B, int R, int W = GQ_WARPS>
__device__ __forceinline__ void gq_block(const uint8_t *__restrict__ w, size_t row_bytes, int N, int K, int S,
                                         const gq_blk *__restrict__ xs, float *__restrict__ y, int64_t y_stride,
                                         int blk, gq_nin nin = gq_nin{}, gq_nout nout = gq_nout{},
                                         unsigned long long *amax = nullptr)
{
    typedef gq<T> Q;
    constexpr int E = gq_early(T, R);
    __shared__ float red[W][R][B];
    __shared__ float nred[W];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int groups = W / S, g = warp / S, ks = warp % S;
    const int row0 = (blk * groups + g) * R;
    const uint8_t *rowp[R];
#pragma unroll
    for (int r = 0; r < R; r++)
        rowp[r] = w + (size_t)(unsigned)min(row0 + r, N - 1) * row_bytes; /* rows past N: computed, not written */
    const int nu = K / Q::UE;
    /* producer: lane l of warp 0 owns the block's row blk*32 + l (its norm weight and bias
     * are no kernel's output: loaded before the wait) */
    float wn = 0.0f, bn = 0.0f, xres = 0.0f, ssv = 0.0f;
    if (B == 1 && nout.x && warp == 0) {
        wn = nout.w_norm[blk * 32 + lane];
        if (nout.bias)
            bn = nout.bias[blk * 32 + lane];
    }

    float acc[R][B];
#pragma unroll
    for (int r = 0; r < R; r++)
#pragma unroll
        for (int b = 0; b < B; b++)
            acc[r][b] = 0.0f;
    auto body = [&](const typename Q::W (&wr)[R], int u) {
        if (gq_rolled(T, B)) {
            /* one batch row at a time: its sums into part, then into acc[.][b] by
             * predicated adds */
#pragma unroll 1
            for (int b = 0; b < B; b++) {
                float part[R] = {};
                gq_row<T, R>(wr, xs + (size_t)b * (K / 32), u, part);
#pragma unroll
                for (int c = 0; c < B; c++)
#pragma unroll
                    for (int r = 0; r < R; r++)
                        if (c == b)
                            acc[r][c] += part[r];
            }
        } else {
#pragma unroll
            for (int b = 0; b < B; b++) {
                float a[R];
#pragma unroll
                for (int r = 0; r < R; r++)
                    a[r] = acc[r][b];
                gq_row<T, R>(wr, xs + (size_t)b * (K / 32), u, a);
#pragma unroll
                for (int r = 0; r < R; r++)
                    acc[r][b] = a[r];
            }
        }
    };
    /* After the wait, before the main loop (so that they travel with its first x loads):
     * the consumer's partial sums of squares, the producer's residual row. */
    auto after_wait = [&]() {
        if (B == 1 && nin.ss)
            for (int i = threadIdx.x; i < K / 32; i += W * 32)
                ssv += __ldca(nin.ss + i);
        if (B == 1 && nout.x && warp == 0)
            xres = __ldca(nout.x + blk * 32 + lane);
    };
    /* The first unit's weights (of its first E rows, gq_early) are loaded before waiting
     * for the previous kernel (PDL launch: they do not depend on it); the rest as they
     * come. (Loading each next unit at the end of the previous iteration instead
     * measured 8% slower for Q4_K_M.) */
    int u = ks * 32 + lane;
    if (u < nu) {
        typename Q::W w0[R];
#pragma unroll
        for (int r = 0; r < E; r++)
            Q::load_w(rowp[r], u, w0[r]);
        xs = m40k_grid_wait_for(xs);
        after_wait();
#pragma unroll
        for (int r = E; r < R; r++)
            Q::load_w(rowp[r], u, w0[r]);
        body(w0, u);
        for (u += 32 * S; u < nu; u += 32 * S) {
            typename Q::W wr[R];
#pragma unroll
            for (int r = 0; r < R; r++)
                Q::load_w(rowp[r], u, wr[r]);
            body(wr, u);
        }
    } else {
        xs = m40k_grid_wait_for(xs);
        after_wait();
    }
    if (B == 1 && nin.ss) {
        const float f = rsqrtf(gq_block_sum<W>(ssv, nred) / (float)K + nin.eps);
#pragma unroll
        for (int r = 0; r < R; r++)
            acc[r][0] *= f;
    }
    if (B == 1 && nout.x) {
        /* the block's 32 rows: warp sums into red, then lane l of warp 0 adds row l's S
         * partial sums in warp order (as m40k_gemv_block_store), its residual, and
         * quantizes the group */
#pragma unroll
        for (int r = 0; r < R; r++) {
            const float v = m40k_warp_sum(acc[r][0]);
            if (lane == 0)
                red[warp][r][0] = v;
        }
        __syncthreads();
        if (warp == 0) {
            const int gg = lane / R, r = lane % R;
            float v = 0.0f;
            for (int k = 0; k < S; k++)
                v += red[gg * S + k][r][0];
            const float xn = xres + (nout.bias ? v + bn : v);
            nout.x_out[blk * 32 + lane] = xn;
            const float sq = m40k_warp_sum(xn * xn);
            if (lane == 0)
                nout.ss[blk] = sq;
            gq_quantize_block(xn * wn, lane, nout.xq + blk);
        }
        return;
    }
    m40k_gemv_block_store<W, R, B>(acc, red, S, N, y, y_stride, blk);
    if constexpr (B == 1 && W == GQ_WARPS) /* (the plain kernel's blocks: 9c is theirs only) */
    if (amax && warp == 0) {
        /* 9c: the keys of the block's rows (their sums formed again as the store formed
         * them: the same values), the largest offered to *amax; most blocks see a larger
         * key there already and skip the atomic */
        static_assert(W * R <= 32, "9c: a block's rows fit warp 0's lanes (W / S * R <= 32)");
        unsigned long long k = 0;
        if (lane < groups * R) {
            const int gg = lane / R, r = lane % R, n = (blk * groups + gg) * R + r;
            float v = 0.0f;
            for (int j = 0; j < S; j++)
                v += red[gg * S + j][r][0];
            if (n < N)
                k = m40k_argmax_key(v, n);
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const unsigned long long t = __shfl_xor_sync(0xffffffffu, k, o);
            k = t > k ? t : k;
        }
        if (lane == 0 && k > *(volatile unsigned long long *)amax)
            atomicMax(amax, k);
    }
}

/* NIN: the instance that applies the norm factor of gq_nin (batch 1; apart, so that the
 * plain instances keep their registers) */
template <int T, int B, int MINB, int R, bool NIN>
__global__ __launch_bounds__(GQ_WARPS * 32, MINB) void gemv_q8_kernel(
    const uint8_t *__restrict__ w, size_t row_bytes, int N, int K, int S, const gq_blk *__restrict__ xs,
    float *__restrict__ y, int64_t y_stride, gq_nin nin, unsigned long long *amax)
{
    m40k_grid_launch_dependents(); /* a PDL-launched GEMV may follow */
    gq_block<T, B, R>(w, row_bytes, N, K, S, xs, y, y_stride, blockIdx.x, NIN ? nin : gq_nin{}, gq_nout{},
                      B == 1 ? amax : nullptr);
}

/* The producer of 8d (batch 1): blocks of W warps of R rows, S = W * R / 32 warps a row,
 * so that a block holds one 32-row group (grid N / 32). */
template <int T, int W>
__global__ __launch_bounds__(W * 32, 1) void gemv_q8_norm_kernel(const uint8_t *__restrict__ w, size_t row_bytes,
                                                                 int N, int K, const gq_blk *__restrict__ xs,
                                                                 gq_nout nout)
{
    m40k_grid_launch_dependents(); /* a PDL-launched GEMV may follow */
    constexpr int R = gq_rows(T, 1);
    gq_block<T, 1, R, W>(w, row_bytes, N, K, W * R / 32, xs, nullptr, 0, blockIdx.x, gq_nin{}, nout);
}

/* One product of a launch of two (m40k_gemv_q8_pair): its weights, rows, split and the
 * number of blocks of the grid it takes. */
struct gq_part {
    const uint8_t *w;
    size_t row_bytes;
    int N, S, blocks;
    float *y;
};

/* Two products of the same x in one grid: blocks [0, p0.blocks) compute p0 (type T0),
 * the rest p1 (type T1). One launch and one kernel boundary on the decode chain fewer
 * than two GEMVs (Q4_K_M's attention input: [q; k] in Q4_K, v in Q6_K in a third of the
 * layers). */
template <int T0, int T1, int B, bool NIN>
__global__ __launch_bounds__(GQ_WARPS * 32, GQ_MIN_BLOCKS) void gemv_q8_pair_kernel(gq_part p0, gq_part p1, int K,
                                                                                    const gq_blk *__restrict__ xs,
                                                                                    int64_t y_stride, gq_nin nin)
{
    m40k_grid_launch_dependents(); /* a PDL-launched GEMV may follow */
    const gq_nin n = NIN ? nin : gq_nin{};
    if ((int)blockIdx.x < p0.blocks)
        gq_block<T0, B, gq_rows(T0, B)>(p0.w, p0.row_bytes, p0.N, K, p0.S, xs, p0.y, y_stride, blockIdx.x, n);
    else
        gq_block<T1, B, gq_rows(T1, B)>(p1.w, p1.row_bytes, p1.N, K, p1.S, xs, p1.y, y_stride, blockIdx.x - p0.blocks,
                                        n);
}

/* The experts' GEMVs on int8 records (kernels.h 10c', 10d'). Where the F32 kernels
 * (moe.cu) unpacked each weight to a float and multiplied it by an F32 x, ~7.6
 * instructions a weight (qwen3-30b-a3b's layer under Nsight Compute, BENCHMARKS.md), the
 * int8 dot products of gq take four weights an instruction. */
#define MQ_GU_WARPS 16 /* a gate/up block: 32 rows of h, one record of 32 */
#define MQ_DN_MAXW 8   /* a down block: at most this many warps */

/* Gate/up: block (b, pair p) forms h[32b .. 32b+32) of pair p (expert ids[p]), warp w its
 * rows 32b + 2w, +1, FR at a time: 2 FR matrix rows a warp in flight (FR 1 for Q4_K and
 * MXFP4_P, with MINB 2: at FR 2 they took 128 and 103 registers, one block an SM, where at
 * FR 1 they fit in 64 and 62, two blocks an SM: qwen3-30b-a3b's 192 blocks in one wave,
 * not 1.45, BENCHMARKS.md twenty-eighth and twenty-ninth sessions; FR 1 for the others,
 * Q6_K spills at 2), each lane its units of the gate and up rows (gq_row: x loaded once a
 * scale group for all of them); then warp 0 writes the 32 values' record for the down
 * GEMV (hq, when not NULL). */
template <int T, int FR, int MINB = 1>
__global__ __launch_bounds__(MQ_GU_WARPS * 32, MINB) void moe_gate_up_q8_kernel(
    const uint8_t *__restrict__ wg, const uint8_t *__restrict__ wu, size_t row_bytes, int n_expert, int n_ff, int K,
    const float *__restrict__ gate_b, const float *__restrict__ up_b, int act, const gq_blk *xs, const int32_t *ids,
    int k, float *__restrict__ h, int64_t h_stride, gq_blk *hq, gq_nin nin)
{
    typedef gq<T> Q;
    constexpr int R = 2 * FR;
    __shared__ float hs[32];
    __shared__ float red[MQ_GU_WARPS];
    /* PDL: the routing (the kernel before) is complete and visible before ids or x are
     * read; only then may the down projection start (it reads ids before its own wait) */
    m40k_grid_wait();
    m40k_grid_launch_dependents();
    M40K_LAUNDER(xs);
    M40K_LAUNDER(ids);
    M40K_LAUNDER(hq);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, p = blockIdx.y;
    const int e = ids[p];
    const bool valid = e >= 0 && e < n_expert;
    float *hp = h + (size_t)p * h_stride;
    const gq_blk *xb = xs + (size_t)(p / k) * (size_t)(K / 32);
    /* the folded norm's sums of squares of the pair's token (10c'n), loaded with the first
     * weights and summed after the products */
    float ssv = 0.0f;
    if (nin.ss)
        for (int i = threadIdx.x; i < K / 32; i += MQ_GU_WARPS * 32)
            ssv += __ldca(nin.ss + (size_t)(p / k) * (size_t)(K / 32) + i);
    float kg0 = 0.0f, ku0 = 0.0f, kg1 = 0.0f, ku1 = 0.0f; /* lane 0: its rows' gate and up sums */
#pragma unroll 1
    for (int f0 = 0; f0 < 2; f0 += FR) {
        const int n0 = blockIdx.x * 32 + 2 * warp + f0; /* rows n0 .. n0 + FR */
        float acc[R];
#pragma unroll
        for (int r = 0; r < R; r++)
            acc[r] = 0.0f;
        if (valid && n0 < n_ff) {
            const uint8_t *rowp[R];
#pragma unroll
            for (int f = 0; f < FR; f++) { /* rows past n_ff: computed, not written */
                const size_t r = (size_t)e * n_ff + (size_t)min(n0 + f, n_ff - 1);
                rowp[f] = wg + r * row_bytes;
                rowp[FR + f] = wu + r * row_bytes;
            }
            for (int u = lane; u < K / Q::UE; u += 32) {
                typename Q::W wr[R];
#pragma unroll
                for (int r = 0; r < R; r++)
                    Q::load_w(rowp[r], u, wr[r]);
                gq_row<T, R>(wr, xb, u, acc);
            }
#pragma unroll
            for (int r = 0; r < R; r++)
                acc[r] = m40k_warp_sum(acc[r]);
        }
#pragma unroll
        for (int f = 0; f < FR; f++) /* (no array indexed by f0: it would live in local memory) */
            if (f0 + f == 0)
                kg0 = acc[f], ku0 = acc[FR + f];
            else
                kg1 = acc[f], ku1 = acc[FR + f];
    }
    const float fac = nin.ss ? rsqrtf(gq_block_sum<MQ_GU_WARPS>(ssv, red) / (float)K + nin.eps) : 1.0f;
    if (lane == 0)
#pragma unroll
        for (int j = 0; j < 2; j++) {
            const int n = blockIdx.x * 32 + 2 * warp + j;
            float v = 0.0f; /* a pair whose id is out of range: a zero row */
            if (valid && n < n_ff) {
                const size_t bi = (size_t)e * n_ff + n;
                v = moe_act(act, (j ? kg1 : kg0) * fac + (gate_b ? gate_b[bi] : 0.0f),
                            (j ? ku1 : ku0) * fac + (up_b ? up_b[bi] : 0.0f));
            }
            if (n < n_ff)
                hp[n] = v;
            hs[2 * warp + j] = v;
        }
    if (!hq)
        return;
    __syncthreads();
    if (warp == 0) /* (hq only where n_ff is a multiple of 32) */
        gq_quantize_block(hs[lane], lane, hq + (size_t)p * (size_t)(n_ff / 32) + blockIdx.x);
}

/* Down: block (b, token t) forms out[R*b .. R*b + R) of token t. Its W warps (W*32 >=
 * k * units a row, up to MQ_DN_MAXW) share the (expert j, unit u) pairs of those rows, one
 * a lane (at qwen3-30b-a3b's 8 x 12 all of them in flight at once, loaded before the PDL
 * wait: ids are not the previous kernel's output, kernels.h 10d); a lane's sum of a pair
 * is weighted by weights[t*k + j]; the warps' sums meet in shared memory in warp order, and
 * thread r adds row r's biases (in order j) and writes it. */
template <int T, int R>
__global__ __launch_bounds__(MQ_DN_MAXW * 32) void moe_down_q8_kernel(
    const uint8_t *__restrict__ wd, size_t row_bytes, int n_expert, int dim, int n_ff,
    const float *__restrict__ down_b, const gq_blk *hq, const int32_t *__restrict__ ids,
    const float *__restrict__ weights, int k, float *__restrict__ out, int64_t out_stride, int accumulate)
{
    typedef gq<T> Q;
    __shared__ float red[MQ_DN_MAXW][R];
    m40k_grid_launch_dependents();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, W = blockDim.x >> 5;
    const int n0 = blockIdx.x * R, t = blockIdx.y, nu = n_ff / Q::UE;
    float acc[R];
#pragma unroll
    for (int r = 0; r < R; r++)
        acc[r] = 0.0f;
    const int total = k * nu;
    /* pair q's (expert j, unit u) weights of the block's rows into wr; e = -1 where the
     * id is out of range (nothing loaded, nothing added) */
    typename Q::W wr[R];
    int j = 0, u = 0, e = -1;
    auto fetch = [&](int q) {
        j = q / nu, u = q % nu;
        e = ids[(size_t)t * k + j];
        if (e < 0 || e >= n_expert) {
            e = -1;
            return;
        }
#pragma unroll
        for (int r = 0; r < R; r++)
            Q::load_w(wd + ((size_t)e * dim + (size_t)min(n0 + r, dim - 1)) * row_bytes, u, wr[r]);
    };
    int q = (int)threadIdx.x;
    if (q < total)
        fetch(q); /* the first pair, before the wait */
    m40k_grid_wait(); /* h's records: the gate/up kernel's output */
    M40K_LAUNDER(hq);
    M40K_LAUNDER(out);
    for (; q < total; q += W * 32) {
        if (q != (int)threadIdx.x)
            fetch(q);
        if (e < 0)
            continue;
        float part[R];
#pragma unroll
        for (int r = 0; r < R; r++)
            part[r] = 0.0f;
        gq_row<T, R>(wr, hq + ((size_t)t * k + j) * (size_t)(n_ff / 32), u, part);
        const float wj = weights[(size_t)t * k + j];
#pragma unroll
        for (int r = 0; r < R; r++)
            acc[r] = fmaf(wj, part[r], acc[r]);
    }
#pragma unroll
    for (int r = 0; r < R; r++) {
        const float v = m40k_warp_sum(acc[r]);
        if (lane == 0)
            red[warp][r] = v;
    }
    __syncthreads();
    if ((int)threadIdx.x < R && n0 + (int)threadIdx.x < dim) {
        const int r = threadIdx.x, n = n0 + r;
        float v = 0.0f;
        for (int w = 0; w < W; w++)
            v += red[w][r];
        if (down_b)
            for (int jj = 0; jj < k; jj++) {
                const int ej = ids[(size_t)t * k + jj];
                if (ej >= 0 && ej < n_expert)
                    v = fmaf(weights[(size_t)t * k + jj], down_b[(size_t)ej * dim + n], v);
            }
        float *o = out + (size_t)t * out_stride + n;
        *o = accumulate ? *o + v : v;
    }
}

/* The split S (warps a row) of a product: m40k_gemv_pick_split, but for Q8_0 at batch 1,
 * measured on the model (mistral-7b, H100, tokens/s, against the pick: 4 at K 4096, 2 at
 * 14336): S 2 where K <= 4096 (half the blocks, two iterations a warp) and the grid still
 * fills the GPU, 310.7 -> 320.1; also S 4 at K > 4096 (two rows a block, two waves of
 * blocks), 319.4 -> 321.6; S 1 at K 4096 306.8, at 14336 308.9. With two rows a warp
 * (before gq_rows's four), Q4_K_M took none of these (S 1 at K 4096: 402 -> 388; S 2
 * or 4 at 14336, with or without the 64-register instance: 387-400). */
template <int T, int B>
static int gq_split(int N, int K, int R)
{
    int S = m40k_gemv_pick_split(K / gq<T>::UE, 32, N, GQ_WARPS, R);
    if constexpr (gq_base(T) == M40K_TYPE_Q8_0 && B == 1) {
        const int blocks2 = (N + GQ_WARPS / 2 * R - 1) / (GQ_WARPS / 2 * R);
        if (K > 4096)
            S = 4;
        else if (S > 2 && blocks2 * GQ_WARPS >= 2112) /* ~2112 warps resident on an H100 */
            S = 2;
    }
    /* Q4_K at batch 1 (four rows a warp, gq_rows), rows longer than 4096 (ffn_down): two
     * warps a row (eight rows a block: one wave of 512 blocks at 4096 rows) instead of the
     * pick's four (two waves): 420.2 -> 422.6 tok/s (three rounds in one call; in another
     * 417.8 -> 423.5, one warp 420.7) */
    if constexpr (T == M40K_TYPE_Q4_K && B == 1)
        if (K > 4096 && R == 4)
            S = 2;
    return S;
}

/* The grid of one product: its split S (gq_split) over warps of gq_rows(T, B) rows, and the
 * blocks that takes (each row's units split over S warps: 32 units a warp and iteration,
 * one a lane) */
template <int T, int B>
static gq_part gq_part_of(const uint8_t *w, int N, int K, float *y)
{
    typedef m40k_tinfo<T> ti;
    constexpr int R = gq_rows(T, B);
    gq_part p;
    p.w = w;
    p.row_bytes = (size_t)K / ti::BE * ti::BB;
    p.N = N;
    p.S = gq_split<T, B>(N, K, R);
    const int rows_per_block = GQ_WARPS / p.S * R;
    p.blocks = (N + rows_per_block - 1) / rows_per_block;
    p.y = y;
    return p;
}

template <int T, int B>
static int gq_launch_b(const uint8_t *w, int N, int K, const gq_blk *xs, float *y, int64_t ys, gq_nin nin,
                       unsigned long long *amax, cudaStream_t st)
{
    const gq_part p = gq_part_of<T, B>(w, N, K, y);
    const dim3 grid((unsigned)p.blocks), block(GQ_WARPS * 32);
    /* the normed instances (batch 1 only: no others are compiled) of Q8_0 held to 64
     * registers, as the plain one (8 blocks an SM) */
    constexpr int MN = gq_base(T) == M40K_TYPE_Q8_0 ? 8 : GQ_MIN_BLOCKS;
    if constexpr (B == 1)
        if (nin.ss)
            return m40k_launch_pdl(gemv_q8_kernel<T, B, MN, gq_rows(T, B), true>, grid, block, st, w, p.row_bytes, N,
                                   K, p.S, xs, y, ys, nin, amax);
    return m40k_launch_pdl(gemv_q8_kernel<T, B, GQ_MIN_BLOCKS, gq_rows(T, B), false>, grid, block, st, w, p.row_bytes,
                           N, K, p.S, xs, y, ys, nin, amax);
}

template <int T>
static int gq_launch(const uint8_t *w, int N, int K, const gq_blk *xs, float *y, int64_t ys, int batch, gq_nin nin,
                     unsigned long long *amax, cudaStream_t st)
{
    switch (batch) {
    case 1: return gq_launch_b<T, 1>(w, N, K, xs, y, ys, nin, amax, st);
    case 2: return gq_launch_b<T, 2>(w, N, K, xs, y, ys, nin, nullptr, st);
    case 3: return gq_launch_b<T, 3>(w, N, K, xs, y, ys, nin, nullptr, st);
    case 4: return gq_launch_b<T, 4>(w, N, K, xs, y, ys, nin, nullptr, st);
    case 5: return gq_launch_b<T, 5>(w, N, K, xs, y, ys, nin, nullptr, st);
    case 6: return gq_launch_b<T, 6>(w, N, K, xs, y, ys, nin, nullptr, st);
    case 7: return gq_launch_b<T, 7>(w, N, K, xs, y, ys, nin, nullptr, st);
    case 8: return gq_launch_b<T, 8>(w, N, K, xs, y, ys, nin, nullptr, st);
    default: return M40K_INVALID;
    }
}

template <int T0, int T1>
static int gq_launch_pair(const uint8_t *w0, int N0, const uint8_t *w1, int N1, int K, const gq_blk *xs, float *y,
                          int64_t ys, gq_nin nin, cudaStream_t st)
{
    const gq_part p0 = gq_part_of<T0, 1>(w0, N0, K, y), p1 = gq_part_of<T1, 1>(w1, N1, K, y + N0);
    if (nin.ss)
        return m40k_launch_pdl(gemv_q8_pair_kernel<T0, T1, 1, true>, dim3((unsigned)(p0.blocks + p1.blocks)),
                               dim3(GQ_WARPS * 32), st, p0, p1, K, xs, ys, nin);
    return m40k_launch_pdl(gemv_q8_pair_kernel<T0, T1, 1, false>, dim3((unsigned)(p0.blocks + p1.blocks)),
                           dim3(GQ_WARPS * 32), st, p0, p1, K, xs, ys, nin);
}

/* Warps a block of the 8d producer: 32 rows a block at R rows a warp, S = W * R / 32 warps
 * a row; 32 warps (two a row at two rows a warp) where the instance fits 64 registers
 * (Q8_0, Q4_0 at batch 1), else 16 (Q4_K: two warps a row of four rows; Q6_K: one). */
__host__ __device__ constexpr int gq_norm_warps(int T)
{
    return gq_base(T) == M40K_TYPE_Q8_0 || T == M40K_TYPE_Q4_0 ? 32 : 16;
}

template <int T>
static int gq_launch_norm(const uint8_t *w, int N, int K, const gq_blk *xs, gq_nout nout, cudaStream_t st)
{
    constexpr int W = gq_norm_warps(T);
    const size_t row_bytes = (size_t)K / m40k_tinfo<T>::BE * m40k_tinfo<T>::BB;
    return m40k_launch_pdl(gemv_q8_norm_kernel<T, W>, dim3((unsigned)(N / 32)), dim3(W * 32), st, w, row_bytes, N,
                           K, xs, nout);
}

extern "C" size_t m40k_gemv_q8_ws_bytes(int K, int batch)
{
    return K > 0 && batch > 0 ? (size_t)batch * (size_t)K / 32 * sizeof(gq_blk) : 0;
}

extern "C" int m40k_quantize_q8(const float *x, int64_t x_stride, int K, int batch, void *ws, m40k_stream stream)
{
    if (batch <= 0)
        return 0;
    if (K <= 0 || K % 32 || batch > 8 || ((uintptr_t)ws & 15))
        return M40K_INVALID;
    const int nblk = batch * (K / 32);
    M40K_LAUNCH_PDL(q8_quantize_kernel, (nblk + 7) / 8, 256, 0, stream, x, x_stride, K, nblk, (gq_blk *)ws);
    return m40k_launch_status();
}

/* Whether m40k_gemv_q8 takes w_type at width K (K > 0): the block of its layout divides K. */
static bool gq_takes(int w_type, int K)
{
    switch (w_type) {
    case M40K_TYPE_Q8_0:
    case M40K_TYPE_Q4_0: return K % 32 == 0;
    case M40K_TYPE_Q4_K:
    case M40K_TYPE_Q6_K:
    case M40K_TYPE_Q8_0_G8: return K % 256 == 0;
    case M40K_TYPE_Q6_K_G8: return K % 2048 == 0;
    default: return false;
    }
}

static int gq_dispatch(const void *w, int w_type, int N, int K, const void *ws, int batch, float *y, int64_t y_stride,
                       gq_nin nin, cudaStream_t stream, unsigned long long *amax = nullptr)
{
    if (N <= 0 || batch <= 0)
        return 0;
    if (K <= 0 || batch > 8 || ((uintptr_t)w & 15) || ((uintptr_t)ws & 15) || !gq_takes(w_type, K))
        return M40K_INVALID;
    const uint8_t *wb = (const uint8_t *)w;
    const gq_blk *xs = (const gq_blk *)ws;
    switch (w_type) {
    case M40K_TYPE_Q8_0: return gq_launch<M40K_TYPE_Q8_0>(wb, N, K, xs, y, y_stride, batch, nin, amax, stream);
    case M40K_TYPE_Q4_0: return gq_launch<M40K_TYPE_Q4_0>(wb, N, K, xs, y, y_stride, batch, nin, amax, stream);
    case M40K_TYPE_Q4_K: return gq_launch<M40K_TYPE_Q4_K>(wb, N, K, xs, y, y_stride, batch, nin, amax, stream);
    case M40K_TYPE_Q6_K: return gq_launch<M40K_TYPE_Q6_K>(wb, N, K, xs, y, y_stride, batch, nin, amax, stream);
    case M40K_TYPE_Q8_0_G8: return gq_launch<M40K_TYPE_Q8_0_G8>(wb, N, K, xs, y, y_stride, batch, nin, amax, stream);
    case M40K_TYPE_Q6_K_G8: return gq_launch<M40K_TYPE_Q6_K_G8>(wb, N, K, xs, y, y_stride, batch, nin, amax, stream);
    default: return M40K_INVALID;
    }
}

extern "C" int m40k_moe_gate_up_q8_supported(int w_type, int dim)
{
    if (w_type == M40K_TYPE_MXFP4_P)
        return dim > 0 && dim % 32 == 0;
    return dim > 0 &&
           (w_type == M40K_TYPE_Q8_0 || w_type == M40K_TYPE_Q4_0 || w_type == M40K_TYPE_Q4_K ||
            w_type == M40K_TYPE_Q6_K) &&
           gq_takes(w_type, dim);
}

extern "C" int m40k_moe_down_q8_supported(int w_type, int n_ff)
{
    if (n_ff <= 0 || n_ff % 32)
        return 0;
    if (w_type == M40K_TYPE_Q6_K_P)
        return n_ff % 256 == 0;
    if (w_type == M40K_TYPE_MXFP4_P)
        return 1;
    return (w_type == M40K_TYPE_Q8_0 || w_type == M40K_TYPE_Q4_0 || w_type == M40K_TYPE_Q4_K ||
            w_type == M40K_TYPE_Q6_K) &&
           gq_takes(w_type, n_ff);
}

extern "C" size_t m40k_moe_q8_records_bytes(int n_pairs, int n_ff)
{
    return n_pairs > 0 && n_ff > 0 && n_ff % 32 == 0 ? (size_t)n_pairs * (size_t)(n_ff / 32) * sizeof(gq_blk) : 0;
}

template <int T, int FR, int MINB = 1>
static int gq_moe_gu_launch(const void *wg, const void *wu, int n_expert, int n_ff, int dim, const float *gb,
                            const float *ub, int act, const void *xq, const int32_t *ids, int pairs, int k, float *h,
                            int64_t h_stride, void *hq, gq_nin nin, cudaStream_t st)
{
    const size_t row_bytes = m40k_row_bytes<T>(dim); /* MXFP4_P: rows of whole chunks */
    const dim3 grid((unsigned)((n_ff + 31) / 32), (unsigned)pairs);
    M40K_LAUNCH_PDL((moe_gate_up_q8_kernel<T, FR, MINB>), grid, MQ_GU_WARPS * 32, 0, st, (const uint8_t *)wg,
                    (const uint8_t *)wu, row_bytes, n_expert, n_ff, dim, gb, ub, act, (const gq_blk *)xq, ids, k, h,
                    h_stride, (gq_blk *)hq, nin);
    return m40k_launch_status();
}

extern "C" int m40k_moe_gate_up_q8(const void *wg, const void *wu, int w_type, int n_expert, int n_ff, int dim,
                                   const float *gate_b, const float *up_b, int act, const void *xq,
                                   const int32_t *ids, int n_tokens, int k, float *h, int64_t h_stride, void *hq,
                                   m40k_stream stream)
{
    return m40k_moe_gate_up_q8_normed(wg, wu, w_type, n_expert, n_ff, dim, gate_b, up_b, act, xq, nullptr, 0.0f, ids,
                                      n_tokens, k, h, h_stride, hq, stream);
}

extern "C" int m40k_moe_gate_up_q8_normed(const void *wg, const void *wu, int w_type, int n_expert, int n_ff, int dim,
                                          const float *gate_b, const float *up_b, int act, const void *xq,
                                          const float *ss, float eps, const int32_t *ids, int n_tokens, int k,
                                          float *h, int64_t h_stride, void *hq, m40k_stream stream)
{
    if (n_tokens <= 0 || n_ff <= 0)
        return n_tokens < 0 || n_ff < 0 ? M40K_INVALID : 0;
    if (ss && !(eps >= 0.0f))
        return M40K_INVALID;
    if (!m40k_moe_gate_up_q8_supported(w_type, dim) || n_expert < 1 || k < 1 || n_tokens > 8 ||
        (act != M40K_GLU_SILU && act != M40K_GLU_SWIGLU_OAI) || h_stride < n_ff || ((uintptr_t)wg & 15) ||
        ((uintptr_t)wu & 15) || ((uintptr_t)xq & 15) || ((uintptr_t)hq & 15) || (hq && n_ff % 32) ||
        (int64_t)n_tokens * k > 65535)
        return M40K_INVALID;
    /* the instance for the type: FR and blocks an SM as moe_gate_up_q8_kernel's comment says */
    int (*launch)(const void *, const void *, int, int, int, const float *, const float *, int, const void *,
                  const int32_t *, int, int, float *, int64_t, void *, gq_nin, cudaStream_t);
    switch (w_type) {
    case M40K_TYPE_Q8_0: launch = gq_moe_gu_launch<M40K_TYPE_Q8_0, 1>; break;
    case M40K_TYPE_Q4_0: launch = gq_moe_gu_launch<M40K_TYPE_Q4_0, 1>; break;
    case M40K_TYPE_Q4_K: launch = gq_moe_gu_launch<M40K_TYPE_Q4_K, 1, 2>; break;
    case M40K_TYPE_MXFP4_P: launch = gq_moe_gu_launch<M40K_TYPE_MXFP4_P, 1, 2>; break;
    default: launch = gq_moe_gu_launch<M40K_TYPE_Q6_K, 1>; break;
    }
    return launch(wg, wu, n_expert, n_ff, dim, gate_b, up_b, act, xq, ids, n_tokens * k, k, h, h_stride, hq,
                  ss ? gq_nin{ss, eps} : gq_nin{}, (cudaStream_t)stream);
}

/* Rows a down block takes: 4 for Q4_K (its registers allow, as gq_rows) and MXFP4_P, 2 for
 * the rest. */
template <int T, int R>
static int gq_moe_dn_launch(const void *wd, int n_expert, int dim, int n_ff, const float *db, const void *hq,
                            const int32_t *ids, const float *w, int n_tokens, int k, float *out, int64_t os, int acc,
                            cudaStream_t st)
{
    const size_t row_bytes = m40k_row_bytes<T>(n_ff); /* MXFP4_P: rows of whole chunks */
    const int total = k * (n_ff / gq<T>::UE), W = min(MQ_DN_MAXW, (total + 31) / 32);
    const dim3 grid((unsigned)((dim + R - 1) / R), (unsigned)n_tokens);
    M40K_LAUNCH_PDL((moe_down_q8_kernel<T, R>), grid, W * 32, 0, st, (const uint8_t *)wd, row_bytes, n_expert, dim,
                    n_ff, db, (const gq_blk *)hq, ids, w, k, out, os, acc);
    return m40k_launch_status();
}

extern "C" int m40k_moe_down_q8(const void *wd, int w_type, int n_expert, int dim, int n_ff, const float *down_b,
                                const void *hq, const int32_t *ids, const float *weights, int n_tokens, int k,
                                float *out, int64_t out_stride, int accumulate, m40k_stream stream)
{
    if (n_tokens <= 0 || dim <= 0)
        return n_tokens < 0 || dim < 0 ? M40K_INVALID : 0;
    if (!m40k_moe_down_q8_supported(w_type, n_ff) || n_expert < 1 || k < 1 || k > 8 || n_tokens > 65535 ||
        out_stride < dim || ((uintptr_t)wd & 15) || !hq || ((uintptr_t)hq & 15))
        return M40K_INVALID;
    int (*launch)(const void *, int, int, int, const float *, const void *, const int32_t *, const float *, int,
                  int, float *, int64_t, int, cudaStream_t);
    switch (w_type) {
    case M40K_TYPE_Q8_0: launch = gq_moe_dn_launch<M40K_TYPE_Q8_0, 2>; break;
    case M40K_TYPE_Q4_0: launch = gq_moe_dn_launch<M40K_TYPE_Q4_0, 2>; break;
    case M40K_TYPE_Q4_K: launch = gq_moe_dn_launch<M40K_TYPE_Q4_K, 4>; break;
    case M40K_TYPE_MXFP4_P: launch = gq_moe_dn_launch<M40K_TYPE_MXFP4_P, 4>; break;
    case M40K_TYPE_Q6_K_P: launch = gq_moe_dn_launch<M40K_TYPE_Q6_K_P, 2>; break;
    default: launch = gq_moe_dn_launch<M40K_TYPE_Q6_K, 2>; break;
    }
    return launch(wd, n_expert, dim, n_ff, down_b, hq, ids, weights, n_tokens, k, out, out_stride, accumulate,
                  (cudaStream_t)stream);
}

extern "C" int m40k_gemv_q8(const void *w, int w_type, int N, int K, const void *ws, int batch, float *y,
                            int64_t y_stride, m40k_stream stream)
{
    return gq_dispatch(w, w_type, N, K, ws, batch, y, y_stride, gq_nin{}, stream);
}

extern "C" int m40k_gemv_q8_argmax(const void *w, int w_type, int N, int K, const void *ws, const float *ss,
                                   float eps, float *y, uint64_t *key, m40k_stream stream)
{
    if (N <= 0)
        return 0;
    if (!key || ((uintptr_t)key & 7))
        return M40K_INVALID;
    return gq_dispatch(w, w_type, N, K, ws, 1, y, N, ss ? gq_nin{ss, eps} : gq_nin{}, stream,
                       reinterpret_cast<unsigned long long *>(key));
}

extern "C" int m40k_gemv_q8_normed(const void *w, int w_type, int N, int K, const void *ws, const float *ss,
                                   float eps, float *y, int64_t y_stride, m40k_stream stream)
{
    if (!ss)
        return M40K_INVALID;
    return gq_dispatch(w, w_type, N, K, ws, 1, y, y_stride, gq_nin{ss, eps}, stream);
}

static int gq_pair(const void *w0, int type0, int N0, const void *w1, int type1, int N1, int K, const void *ws,
                   int batch, float *y, int64_t y_stride, gq_nin nin, cudaStream_t stream)
{
    if (batch != 1 || type0 != M40K_TYPE_Q4_K || (type1 != M40K_TYPE_Q6_K && type1 != M40K_TYPE_Q6_K_G8))
        return M40K_INVALID;
    if (N0 <= 0 || N1 <= 0 || K <= 0 || !gq_takes(type0, K) || !gq_takes(type1, K) || ((uintptr_t)w0 & 15) ||
        ((uintptr_t)w1 & 15) || ((uintptr_t)ws & 15))
        return M40K_INVALID;
    if (type1 == M40K_TYPE_Q6_K_G8)
        return gq_launch_pair<M40K_TYPE_Q4_K, M40K_TYPE_Q6_K_G8>((const uint8_t *)w0, N0, (const uint8_t *)w1, N1, K,
                                                                 (const gq_blk *)ws, y, y_stride, nin, stream);
    return gq_launch_pair<M40K_TYPE_Q4_K, M40K_TYPE_Q6_K>((const uint8_t *)w0, N0, (const uint8_t *)w1, N1, K,
                                                          (const gq_blk *)ws, y, y_stride, nin, stream);
}

extern "C" int m40k_gemv_q8_pair(const void *w0, int type0, int N0, const void *w1, int type1, int N1, int K,
                                 const void *ws, int batch, float *y, int64_t y_stride, m40k_stream stream)
{
    return gq_pair(w0, type0, N0, w1, type1, N1, K, ws, batch, y, y_stride, gq_nin{}, stream);
}

extern "C" int m40k_gemv_q8_pair_normed(const void *w0, int type0, int N0, const void *w1, int type1, int N1, int K,
                                        const void *ws, const float *ss, float eps, float *y, int64_t y_stride,
                                        m40k_stream stream)
{
    if (!ss)
        return M40K_INVALID;
    return gq_pair(w0, type0, N0, w1, type1, N1, K, ws, 1, y, y_stride, gq_nin{ss, eps}, stream);
}

extern "C" int m40k_gemv_q8_add_norm(const void *w, int w_type, int N, int K, const void *ws, const float *bias,
                                     const float *x, float *x_out, const float *norm_w, void *xq_out, float *ss_out,
                                     m40k_stream stream)
{
    if (N <= 0)
        return 0;
    if (N % 32 || K <= 0 || !gq_takes(w_type, K) || !x || !x_out || !norm_w || !xq_out || !ss_out ||
        ((uintptr_t)w & 15) || ((uintptr_t)ws & 15) || ((uintptr_t)xq_out & 15) || xq_out == ws)
        return M40K_INVALID;
    const uint8_t *wb = (const uint8_t *)w;
    const gq_blk *xs = (const gq_blk *)ws;
    const gq_nout nout{x, norm_w, bias, x_out, ss_out, (gq_blk *)xq_out};
    switch (w_type) {
    case M40K_TYPE_Q8_0: return gq_launch_norm<M40K_TYPE_Q8_0>(wb, N, K, xs, nout, stream);
    case M40K_TYPE_Q4_0: return gq_launch_norm<M40K_TYPE_Q4_0>(wb, N, K, xs, nout, stream);
    case M40K_TYPE_Q4_K: return gq_launch_norm<M40K_TYPE_Q4_K>(wb, N, K, xs, nout, stream);
    case M40K_TYPE_Q6_K: return gq_launch_norm<M40K_TYPE_Q6_K>(wb, N, K, xs, nout, stream);
    case M40K_TYPE_Q8_0_G8: return gq_launch_norm<M40K_TYPE_Q8_0_G8>(wb, N, K, xs, nout, stream);
    case M40K_TYPE_Q6_K_G8: return gq_launch_norm<M40K_TYPE_Q6_K_G8>(wb, N, K, xs, nout, stream);
    default: return M40K_INVALID;
    }
}

