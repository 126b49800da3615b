/* Quantized GEMV with int8 activations: the decode matmul of Q8_0, Q4_0, Q4_K and Q6_K
 * weights, y[b][n] = W[n] . x[b] for batch 1..8 (kernels.h, 8b).
 *
 * 1. q8_quantize_kernel: one warp per 32-element block of x: d = max|x|/127,
 *    q = rint(x/d) (0 when d == 0), s = d*sum(q), stored in the caller's workspace
 *    (int8 q[batch][K], then float2 (d, s)[batch][K/32]).
 * 2. gemv_q8_kernel<T, B>: integer dot products with __dp4a (4 int8 products per
 *    instruction) between the weight's small integers and q, then the weight scales and
 *    the activation scale d in F32. The weight is read once for all B batch rows.
 *
 * Work split. A lane's unit of work is one run of weights that shares its scales and
 * lines up with whole activation blocks: a Q8_0/Q4_0 block (32 elements), a Q4_K pair
 * of sub-blocks (64: the low and high nibbles of 32 qs bytes), a quarter of a Q6_K
 * superblock (64: four 16-element scale groups, 48 quant bytes). A warp takes
 * GQ_R rows at once and its lanes take consecutive units, so each lane has GQ_R units
 * (one per row) in flight, ~18..52 bytes each; x is loaded once per unit and batch row
 * and used for all GQ_R rows. S warps of a block (1, 2 or 4, picked on the host from
 * the shape) split a row's units round robin and meet in shared memory at the end.
 *
 * Loads. Every weight load is a 16-byte streaming load (__ldcs) of an aligned chunk.
 * Q4_K superblocks (144 = 9 x 16 bytes) stay 16-byte aligned. Q8_0 (34 bytes), Q4_0
 * (18) and Q6_K (210) blocks start at any even offset: the 2 or 3 aligned chunks that
 * hold a piece are loaded whole and the piece's words are assembled in registers
 * (gq_window: a word shift by two levels of selects, then a funnel shift by 0 or 16
 * bits), no shared-memory staging, no byte loads.
 *
 * Dot products. __dp4a starts from the integer 0x4B400000 (the bits of the float
 * 1.5*2^23), so the accumulated bits ARE the float 1.5*2^23 + dot while
 * |dot| < 2^22 (largest here: 32*128*127 for Q8_0) and one FADD converts it. Nibbles are
 * unpacked with a mask and a shift per 4 bytes; Q6_K's 6-bit values get their bias of
 * 32 byte-wise as ((q + 0x60) ^ 0x80), no carries since q + 0x60 < 0x100. Per 32
 * weights and batch row: 8 dp4a and 3..4 F32 ops, plus loads of x shared by the GQ_R
 * rows. sm_90 SASS of the main loop, per byte of weight streamed: batch 1 ~2 (Q8_0),
 * 3 (Q4_K), 3.5 (Q4_0), 5 (Q6_K) instructions per lane; batch 8 ~5, 8.5, 9.5, 9.5. An
 * H100 issues ~11 per byte at 3 TB/s, so batch 1 is memory-bound and batch 8 of the
 * 4-bit types is close to issue-bound (3.6 dp4a per weight byte).
 * On sm_90 at most 128 registers (GQ_MIN_BLOCKS), no spills, >= 16 warps per SM.
 *
 * The CPU twin (m40_ref_quantize_q8 / m40_ref_gemv_q8 in engine/cpu_ref.c) forms the
 * same integer dots and the same per-group F32 terms; only the order of the F32
 * additions differs. */
#include "quant_dev.h"

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
                                                           int nblk, int8_t *__restrict__ q, float2 *__restrict__ ds)
{
    const int blk = blockIdx.x * 8 + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (blk >= nblk)
        return; /* whole warps only */
    const int per = K / 32, b = blk / per, j = blk % per;
    const float v = x[b * x_stride + 32 * j + lane];
    const float d = m40k_warp_max(fabsf(v)) / 127.0f;
    /* IEEE division and round-half-even, as the CPU twin; the clamp only decides NaN */
    const int qi = d != 0.0f ? (int)fminf(127.0f, fmaxf(-127.0f, rintf(v / d))) : 0;
    int sum = qi;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        sum += __shfl_xor_sync(0xffffffffu, sum, o);
    q[32 * (size_t)blk + lane] = (int8_t)qi; /* q[b][32j + lane] */
    if (lane == 0)
        ds[blk] = make_float2(d, d * (float)sum);
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
/* gq<T>: UE elements per unit; W = one unit of one row, decoded (load_w); X = the
 * activations of one unit for one batch row (load_x); dot adds W.X to acc.
 * xq: this batch row's int8 q (K bytes); xd: its (d, s) per block. */
template <int T> struct gq;

/* Q8_0, unit = block u: d f16 | qs[32] int8 at 34u. */
template <> struct gq<M40K_TYPE_Q8_0> {
    enum { UE = 32 };
    struct W {
        uint32_t q[8];
        float d;
    };
    struct X {
        int4 a, b;
        float d;
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
    static __device__ __forceinline__ void load_x(const int8_t *xq, const float2 *xd, int u, X &x)
    {
        const int4 *p = reinterpret_cast<const int4 *>(xq + 32 * u);
        x.a = __ldg(p), x.b = __ldg(p + 1);
        x.d = __ldg(&xd[u].x);
    }
    static __device__ __forceinline__ float dot(const W &w, const X &x, float acc)
    {
        int s = GQ_MAGIC;
        s = __dp4a((int)w.q[0], x.a.x, s), s = __dp4a((int)w.q[1], x.a.y, s);
        s = __dp4a((int)w.q[2], x.a.z, s), s = __dp4a((int)w.q[3], x.a.w, s);
        s = __dp4a((int)w.q[4], x.b.x, s), s = __dp4a((int)w.q[5], x.b.y, s);
        s = __dp4a((int)w.q[6], x.b.z, s), s = __dp4a((int)w.q[7], x.b.w, s);
        return fmaf(w.d * x.d, gq_f(s), acc);
    }
};

/* Q4_0, unit = block u: d f16 | qs[16] at 18u; element j < 16 is the low nibble of
 * qs[j], j + 16 the high one; w = d*(q - 8), so W.X = d*(dx*sum(q*qx) - 8*s). */
template <> struct gq<M40K_TYPE_Q4_0> {
    enum { UE = 32 };
    struct W {
        uint32_t lo[4], hi[4];
        float d, d8;
    };
    struct X {
        int4 a, b;
        float2 ds;
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
    static __device__ __forceinline__ void load_x(const int8_t *xq, const float2 *xd, int u, X &x)
    {
        const int4 *p = reinterpret_cast<const int4 *>(xq + 32 * u);
        x.a = __ldg(p), x.b = __ldg(p + 1);
        x.ds = __ldg(&xd[u]);
    }
    static __device__ __forceinline__ float dot(const W &w, const X &x, float acc)
    {
        int s = GQ_MAGIC;
        s = __dp4a((int)w.lo[0], x.a.x, s), s = __dp4a((int)w.lo[1], x.a.y, s);
        s = __dp4a((int)w.lo[2], x.a.z, s), s = __dp4a((int)w.lo[3], x.a.w, s);
        s = __dp4a((int)w.hi[0], x.b.x, s), s = __dp4a((int)w.hi[1], x.b.y, s);
        s = __dp4a((int)w.hi[2], x.b.z, s), s = __dp4a((int)w.hi[3], x.b.w, s);
        return fmaf(w.d * x.ds.x, gq_f(s), fmaf(w.d8, x.ds.y, acc));
    }
};

/* Q4_K, unit u = chunk c = u & 3 of superblock u >> 2 (d f16 | dmin f16 | scales[12] |
 * qs[128], 144 bytes): qs[32c .. 32c+32) hold sub-block 2c in the low nibbles and 2c+1
 * in the high ones, w = d*sc*q - dmin*m per sub-block, so each sub-block adds
 * (d*sc)*dx*sum(q*qx) - (dmin*m)*s. */
template <> struct gq<M40K_TYPE_Q4_K> {
    enum { UE = 64 };
    struct W {
        uint32_t lo[8], hi[8];
        float a0, a1, m0, m1; /* d*sc and -dmin*m of sub-blocks 2c, 2c+1 */
    };
    struct X {
        int4 a0, a1, b0, b1;
        float4 ds; /* (d, s) of x blocks 2c, 2c+1 */
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
    static __device__ __forceinline__ void load_x(const int8_t *xq, const float2 *xd, int u, X &x)
    {
        const int4 *p = reinterpret_cast<const int4 *>(xq + 64 * u);
        x.a0 = __ldg(p), x.a1 = __ldg(p + 1), x.b0 = __ldg(p + 2), x.b1 = __ldg(p + 3);
        x.ds = __ldg(reinterpret_cast<const float4 *>(xd + 2 * u));
    }
    static __device__ __forceinline__ float dot(const W &w, const X &x, float acc)
    {
        int s = GQ_MAGIC, t = GQ_MAGIC;
        s = __dp4a((int)w.lo[0], x.a0.x, s), s = __dp4a((int)w.lo[1], x.a0.y, s);
        s = __dp4a((int)w.lo[2], x.a0.z, s), s = __dp4a((int)w.lo[3], x.a0.w, s);
        s = __dp4a((int)w.lo[4], x.a1.x, s), s = __dp4a((int)w.lo[5], x.a1.y, s);
        s = __dp4a((int)w.lo[6], x.a1.z, s), s = __dp4a((int)w.lo[7], x.a1.w, s);
        t = __dp4a((int)w.hi[0], x.b0.x, t), t = __dp4a((int)w.hi[1], x.b0.y, t);
        t = __dp4a((int)w.hi[2], x.b0.z, t), t = __dp4a((int)w.hi[3], x.b0.w, t);
        t = __dp4a((int)w.hi[4], x.b1.x, t), t = __dp4a((int)w.hi[5], x.b1.y, t);
        t = __dp4a((int)w.hi[6], x.b1.z, t), t = __dp4a((int)w.hi[7], x.b1.w, t);
        acc = fmaf(w.a0 * x.ds.x, gq_f(s), fmaf(w.m0, x.ds.y, acc));
        return fmaf(w.a1 * x.ds.z, gq_f(t), fmaf(w.m1, x.ds.w, acc));
    }
};

/* Q6_K, unit u = (superblock i = u >> 2, half n = (u >> 1) & 1, l0 = 16*(u & 1)) of
 * ql[128] | qh[64] | scales[16] int8 | d f16 (210 bytes): elements 128n + 32k + l0 + j
 * (k < 4, j < 16), one scale group (index 8n + 2k + (u & 1)) each. Element l of quarter
 * k: low 4 bits from ql[64n + 32(k&1) + l] (low nibble for k < 2, high for k >= 2), top
 * 2 from bits 2k of qh[32n + l], bias 32. Each group adds (d*sc)*dx*sum((q-32)*qx). */
template <> struct gq<M40K_TYPE_Q6_K> {
    enum { UE = 64 };
    struct W {
        uint32_t q[4][4]; /* [k][word]: q - 32 as int8 */
        float a[4];       /* d*sc per k */
    };
    struct X {
        int4 x[4];
        float4 ds01, ds23; /* (d, s) of x blocks 4n .. 4n+3 of the superblock */
    };
    static __device__ __forceinline__ uint32_t bias32(uint32_t v) { return (v + 0x60606060u) ^ 0x80808080u; }
    static __device__ __forceinline__ void load_w(const uint8_t *row, int u, W &w)
    {
        const uint8_t *sb = row + 210 * (u >> 2);
        const int n = (u >> 1) & 1, h = u & 1;
        uint32_t A[4], Bq[4], H[4], t[5];
        gq_window<16, 4>(sb + 64 * n + 16 * h, A);
        gq_window<16, 4>(sb + 64 * n + 32 + 16 * h, Bq);
        gq_window<16, 4>(sb + 128 + 32 * n + 16 * h, H);
        gq_window<18, 5>(sb + 192, t); /* scales[16] | d */
#pragma unroll
        for (int i = 0; i < 4; i++) {
            w.q[0][i] = bias32((A[i] & 0x0F0F0F0Fu) | ((H[i] << 4) & 0x30303030u));
            w.q[1][i] = bias32((Bq[i] & 0x0F0F0F0Fu) | ((H[i] << 2) & 0x30303030u));
            w.q[2][i] = bias32(((A[i] >> 4) & 0x0F0F0F0Fu) | (H[i] & 0x30303030u));
            w.q[3][i] = bias32(((Bq[i] >> 4) & 0x0F0F0F0Fu) | ((H[i] >> 2) & 0x30303030u));
        }
        /* group 8n + 2k + h: byte 2(k&1) + h of scale word 2n + (k >> 1) */
        const uint32_t s0 = (n ? t[2] : t[0]) >> (8 * h), s1 = (n ? t[3] : t[1]) >> (8 * h);
        const float d = m40k_h2f((uint16_t)(t[4] & 0xFFFF));
        w.a[0] = d * gq_i2f((int)(s0 << 24) >> 24), w.a[1] = d * gq_i2f((int)(s0 << 8) >> 24);
        w.a[2] = d * gq_i2f((int)(s1 << 24) >> 24), w.a[3] = d * gq_i2f((int)(s1 << 8) >> 24);
    }
    static __device__ __forceinline__ void load_x(const int8_t *xq, const float2 *xd, int u, X &x)
    {
        const int i = u >> 2, n = (u >> 1) & 1, h = u & 1;
        const int8_t *p = xq + 256 * i + 128 * n + 16 * h;
#pragma unroll
        for (int k = 0; k < 4; k++)
            x.x[k] = __ldg(reinterpret_cast<const int4 *>(p + 32 * k));
        const float4 *dp = reinterpret_cast<const float4 *>(xd + 8 * i + 4 * n);
        x.ds01 = __ldg(dp), x.ds23 = __ldg(dp + 1);
    }
    static __device__ __forceinline__ float dot(const W &w, const X &x, float acc)
    {
        const float dx[4] = {x.ds01.x, x.ds01.z, x.ds23.x, x.ds23.z};
#pragma unroll
        for (int k = 0; k < 4; k++) {
            int s = GQ_MAGIC;
            s = __dp4a((int)w.q[k][0], x.x[k].x, s), s = __dp4a((int)w.q[k][1], x.x[k].y, s);
            s = __dp4a((int)w.q[k][2], x.x[k].z, s), s = __dp4a((int)w.q[k][3], x.x[k].w, s);
            acc = fmaf(w.a[k] * dx[k], gq_f(s), acc);
        }
        return acc;
    }
};

/* ------------------------------------------------------------------ kernel */
template <int T, int B>
__global__ __launch_bounds__(GQ_WARPS * 32, GQ_MIN_BLOCKS) void gemv_q8_kernel(
    const uint8_t *__restrict__ w, size_t row_bytes, int N, int K, int S, const int8_t *__restrict__ xq,
    const float2 *__restrict__ xd, float *__restrict__ y, int64_t y_stride)
{
    typedef gq<T> Q;
    constexpr int R = GQ_R;
    __shared__ float red[GQ_WARPS][R][B];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int groups = GQ_WARPS / S, g = warp / S, ks = warp % S;
    const int row0 = (blockIdx.x * groups + g) * R;
    const uint8_t *rowp[R];
#pragma unroll
    for (int r = 0; r < R; r++)
        rowp[r] = w + (size_t)(unsigned)min(row0 + r, N - 1) * row_bytes; /* rows past N: computed, not written */
    const int nu = K / Q::UE;

    float acc[R][B];
#pragma unroll
    for (int r = 0; r < R; r++)
#pragma unroll
        for (int b = 0; b < B; b++)
            acc[r][b] = 0.0f;
    for (int u = ks * 32 + lane; u < nu; u += 32 * S) {
        typename Q::W wr[R];
#pragma unroll
        for (int r = 0; r < R; r++)
            Q::load_w(rowp[r], u, wr[r]);
#pragma unroll
        for (int b = 0; b < B; b++) {
            typename Q::X xr;
            Q::load_x(xq + (size_t)b * K, xd + (size_t)b * (K / 32), u, xr);
#pragma unroll
            for (int r = 0; r < R; r++)
                acc[r][b] = Q::dot(wr[r], xr, acc[r][b]);
        }
    }
#pragma unroll
    for (int r = 0; r < R; r++)
#pragma unroll
        for (int b = 0; b < B; b++) {
            const float v = m40k_warp_sum(acc[r][b]);
            if (lane == 0)
                red[warp][r][b] = v;
        }
    __syncthreads();
    for (int t = threadIdx.x; t < groups * R * B; t += blockDim.x) {
        const int gg = t / (R * B), r = (t / B) % R, b = t % B;
        float v = 0.0f;
        for (int k = 0; k < S; k++)
            v += red[gg * S + k][r][b];
        const int n = (blockIdx.x * groups + gg) * R + r;
        if (n < N)
            y[b * y_stride + n] = v;
    }
}

template <int T, int B>
static int gq_launch_b(const uint8_t *w, int N, int K, const int8_t *xq, const float2 *xd, float *y, int64_t ys,
                       cudaStream_t st)
{
    typedef m40k_tinfo<T> ti;
    const size_t row_bytes = (size_t)K / ti::BE * ti::BB;
    /* S warps per row group: score = share of lane-iterations doing work (units split
     * evenly?) x how well the grid fills the GPU (about 2100 warps resident on an H100:
     * 132 SMs x 16); ties go to the larger S (fewer serial iterations per warp). */
    const int nu = K / gq<T>::UE;
    int S = 1;
    double best = -1.0;
    for (int s = 4; s >= 1; s >>= 1) {
        const double even = (double)nu / (double)(((nu + 32 * s - 1) / (32 * s)) * 32 * s);
        const double warps = (double)((N + GQ_WARPS / s * GQ_R - 1) / (GQ_WARPS / s * GQ_R)) * GQ_WARPS;
        const double score = even * (warps >= 2112.0 ? 1.0 : warps / 2112.0);
        if (score > best + 1e-9)
            best = score, S = s;
    }
    const int rows_per_block = GQ_WARPS / S * GQ_R;
    gemv_q8_kernel<T, B><<<(N + rows_per_block - 1) / rows_per_block, GQ_WARPS * 32, 0, st>>>(w, row_bytes, N, K, S,
                                                                                             xq, xd, y, ys);
    return m40k_launch_status();
}

template <int T>
static int gq_launch(const uint8_t *w, int N, int K, const int8_t *xq, const float2 *xd, float *y, int64_t ys,
                     int batch, cudaStream_t st)
{
    switch (batch) {
    case 1: return gq_launch_b<T, 1>(w, N, K, xq, xd, y, ys, st);
    case 2: return gq_launch_b<T, 2>(w, N, K, xq, xd, y, ys, st);
    case 3: return gq_launch_b<T, 3>(w, N, K, xq, xd, y, ys, st);
    case 4: return gq_launch_b<T, 4>(w, N, K, xq, xd, y, ys, st);
    case 5: return gq_launch_b<T, 5>(w, N, K, xq, xd, y, ys, st);
    case 6: return gq_launch_b<T, 6>(w, N, K, xq, xd, y, ys, st);
    case 7: return gq_launch_b<T, 7>(w, N, K, xq, xd, y, ys, st);
    case 8: return gq_launch_b<T, 8>(w, N, K, xq, xd, y, ys, st);
    default: return M40K_INVALID;
    }
}

extern "C" size_t m40k_gemv_q8_ws_bytes(int K, int batch)
{
    return K > 0 && batch > 0 ? (size_t)batch * (size_t)K / 32 * (32 + sizeof(float2)) : 0;
}

extern "C" int m40k_quantize_q8(const float *x, int64_t x_stride, int K, int batch, void *ws, m40k_stream stream)
{
    if (batch <= 0)
        return 0;
    if (K <= 0 || K % 32 || batch > 8 || ((uintptr_t)ws & 15))
        return M40K_INVALID;
    const int nblk = batch * (K / 32);
    int8_t *q = (int8_t *)ws;
    q8_quantize_kernel<<<(nblk + 7) / 8, 256, 0, stream>>>(x, x_stride, K, nblk, q,
                                                           (float2 *)(q + (size_t)batch * K));
    return m40k_launch_status();
}

extern "C" int m40k_gemv_q8(const void *w, int w_type, int N, int K, const void *ws, int batch, float *y,
                            int64_t y_stride, m40k_stream stream)
{
    if (N <= 0 || batch <= 0)
        return 0;
    if (K <= 0 || batch > 8 || ((uintptr_t)w & 15) || ((uintptr_t)ws & 15))
        return M40K_INVALID;
    const uint8_t *wb = (const uint8_t *)w;
    const int8_t *xq = (const int8_t *)ws;
    const float2 *xd = (const float2 *)(xq + (size_t)batch * K);
    if (K % (w_type == M40K_TYPE_Q4_K || w_type == M40K_TYPE_Q6_K ? 256 : 32))
        return M40K_INVALID;
    switch (w_type) {
    case M40K_TYPE_Q8_0: return gq_launch<M40K_TYPE_Q8_0>(wb, N, K, xq, xd, y, y_stride, batch, stream);
    case M40K_TYPE_Q4_0: return gq_launch<M40K_TYPE_Q4_0>(wb, N, K, xq, xd, y, y_stride, batch, stream);
    case M40K_TYPE_Q4_K: return gq_launch<M40K_TYPE_Q4_K>(wb, N, K, xq, xd, y, y_stride, batch, stream);
    case M40K_TYPE_Q6_K: return gq_launch<M40K_TYPE_Q6_K>(wb, N, K, xq, xd, y, y_stride, batch, stream);
    default: return M40K_INVALID;
    }
}
