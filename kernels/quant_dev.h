/* Device-side dequantization of 8 consecutive elements of a GGUF-typed row, shared by
 * the embedding gather and the GEMV. Same block layouts as kernels/ref/quant.c:
 *   Q8_0 (34 B / 32):  d f16 | qs[32] int8
 *   Q4_0 (18 B / 32):  d f16 | qs[16]  (element j: low nibble of qs[j], j+16: high)
 *   Q4_1 (20 B / 32):  d f16 | m f16 | qs[16]  (w = d*q + m)
 *   Q5_0 (22 B / 32):  d f16 | qh[4] | qs[16]  (Q4_0 nibbles, bit j of qh is element j's
 *                      5th bit; w = d*(q - 16))
 *   Q5_1 (24 B / 32):  d f16 | m f16 | qh[4] | qs[16]  (w = d*q + m)
 *   Q2_K (84 B / 256): scales[16] (4-bit scale | 4-bit min) | qs[64] | d f16 | dmin f16
 *                      (2-bit field j of qs[32n + l] is element 128n + 32j + l;
 *                      w = d*sc*q - dmin*m per 16 elements)
 *   Q3_K (110 B / 256): hmask[32] | qs[64] | scales[12] | d f16  (Q2_K's 2 low bits,
 *                      bit 4n + j of hmask[l] the third, CLEAR = minus 4; 16 6-bit
 *                      scales minus 32; w = d*sc*q per 16 elements)
 *   Q4_K (144 B / 256): d f16 | dmin f16 | scales[12] | qs[128]
 *   Q5_K (176 B / 256): d f16 | dmin f16 | scales[12] | qh[32] | qs[128]  (Q4_K plus
 *                      the 5th bit of element e in bit e/32 of qh[e % 32])
 *   Q6_K (210 B / 256): ql[128] | qh[64] | scales[16] int8 | d f16
 *   BF16 (2 B / 1)
 *   MXFP4 (17 B / 32): e u8 (E8M0) | qs[16] (E2M1 nibbles in Q4_0's order; ggml's doubled
 *                      levels 0, 1, 2, 3, 4, 6, 8, 12 with the sign in bit 3, times
 *                      2^(e - 128)): q the SIGNED level (-12..12), scale 2^(e - 128) and
 *                      offset 0, the one type whose q can be negative
 * and the device layouts of kernels.h (0.): Q8_0_G8, Q6_K_G8 (regrouped), Q6_K_P (Q6_K
 * padded to 224 bytes a superblock), MXFP4_P (MXFP4 in 144-byte chunks of 8 blocks).
 * A group of 8 (first element e0, a multiple of 8) always lies in one scale sub-block,
 * so it comes back as small integers q[8] with one scale and one offset:
 * w[i] = scale * q[i] - offset. Sums of q*x are then scaled once per group. */
#ifndef M40_QUANT_DEV_H
#define M40_QUANT_DEV_H

#include "cuda_common.h"

template <int T> struct m40k_tinfo;
template <> struct m40k_tinfo<M40K_TYPE_F32> { enum { BE = 1, BB = 4 }; };
template <> struct m40k_tinfo<M40K_TYPE_F16> { enum { BE = 1, BB = 2 }; };
template <> struct m40k_tinfo<M40K_TYPE_Q8_0> { enum { BE = 32, BB = 34 }; };
template <> struct m40k_tinfo<M40K_TYPE_Q4_0> { enum { BE = 32, BB = 18 }; };
template <> struct m40k_tinfo<M40K_TYPE_Q4_1> { enum { BE = 32, BB = 20 }; };
template <> struct m40k_tinfo<M40K_TYPE_Q5_0> { enum { BE = 32, BB = 22 }; };
template <> struct m40k_tinfo<M40K_TYPE_Q5_1> { enum { BE = 32, BB = 24 }; };
template <> struct m40k_tinfo<M40K_TYPE_Q2_K> { enum { BE = 256, BB = 84 }; };
template <> struct m40k_tinfo<M40K_TYPE_Q3_K> { enum { BE = 256, BB = 110 }; };
template <> struct m40k_tinfo<M40K_TYPE_Q4_K> { enum { BE = 256, BB = 144 }; };
template <> struct m40k_tinfo<M40K_TYPE_Q5_K> { enum { BE = 256, BB = 176 }; };
template <> struct m40k_tinfo<M40K_TYPE_BF16> { enum { BE = 1, BB = 2 }; };
template <> struct m40k_tinfo<M40K_TYPE_Q6_K> { enum { BE = 256, BB = 210 }; };
template <> struct m40k_tinfo<M40K_TYPE_Q8_0_G8> { enum { BE = 256, BB = 272 }; };
template <> struct m40k_tinfo<M40K_TYPE_Q6_K_G8> { enum { BE = 2048, BB = 1680 }; };
template <> struct m40k_tinfo<M40K_TYPE_Q6_K_P> { enum { BE = 256, BB = 224 }; };
template <> struct m40k_tinfo<M40K_TYPE_MXFP4> { enum { BE = 32, BB = 17 }; };
template <> struct m40k_tinfo<M40K_TYPE_MXFP4_P> { enum { BE = 256, BB = 144 }; };

/* The elements a row's length must be a multiple of (the type's block; MXFP4_P: whole
 * MXFP4 blocks, its rows padded to whole chunks of 256), and the bytes of such a row. */
template <int T> __host__ __device__ constexpr int m40k_kstep() { return T == M40K_TYPE_MXFP4_P ? 32 : (int)m40k_tinfo<T>::BE; }
template <int T> __host__ __device__ constexpr size_t m40k_row_bytes(int64_t K)
{
    return (size_t)((K + m40k_tinfo<T>::BE - 1) / m40k_tinfo<T>::BE) * (size_t)m40k_tinfo<T>::BB;
}

/* MXFP4: nibble v as its signed doubled E2M1 level (the magnitudes 0,1,2,3 | 4,6,8,12 are
 * the bytes of two words, picked by one byte permute), and the block scale 2^(e - 128)
 * built from its bits (e = 0 and 1: the subnormals 2^-128 and 2^-127). */
__device__ __forceinline__ float m40k_mxfp4_level(uint32_t v)
{
    /* no integer-to-float conversion (quarter rate): the 2^23 trick, then the sign bit */
    const uint32_t m = __byte_perm(0x03020100u, 0x0C080604u, v & 7u) & 0xFFu;
    return __uint_as_float(__float_as_uint(m40k_u8f(m)) | ((v & 8u) << 28));
}
__device__ __forceinline__ float m40k_e8m0_half(uint32_t e)
{
    return __uint_as_float(e < 2 ? 0x00200000u << e : (e - 1) << 23);
}

/* A group's q[0..7] . x (x in two float4s), summed in the order every GEMV here keeps
 * (a product, then seven fused multiply-adds), and the sum of the eight x (for the
 * group's offset). */
__device__ __forceinline__ float m40k_dot8(const float q[8], float4 xa, float4 xb)
{
    float t = q[0] * xa.x;
    t = fmaf(q[1], xa.y, t);
    t = fmaf(q[2], xa.z, t);
    t = fmaf(q[3], xa.w, t);
    t = fmaf(q[4], xb.x, t);
    t = fmaf(q[5], xb.y, t);
    t = fmaf(q[6], xb.z, t);
    return fmaf(q[7], xb.w, t);
}
__device__ __forceinline__ float m40k_sum8(float4 xa, float4 xb)
{
    return ((xa.x + xa.y) + (xa.z + xa.w)) + ((xb.x + xb.y) + (xb.z + xb.w));
}

__device__ __forceinline__ float m40k_ldh(const uint8_t *p) { return m40k_h2f((uint16_t)(p[0] | (p[1] << 8))); }

/* p: start of the row (or of a block-aligned piece of it); byte loads, any alignment. */
template <int T>
__device__ __forceinline__ void m40k_group8(const uint8_t *__restrict__ p, int e0, float q[8], float &scale,
                                            float &offset)
{
    if (T == M40K_TYPE_F32) {
        const float *f = reinterpret_cast<const float *>(p) + e0;
#pragma unroll
        for (int i = 0; i < 8; i++)
            q[i] = f[i];
        scale = 1.0f, offset = 0.0f;
    } else if (T == M40K_TYPE_F16) {
#pragma unroll
        for (int i = 0; i < 8; i++)
            q[i] = m40k_ldh(p + 2 * (e0 + i));
        scale = 1.0f, offset = 0.0f;
    } else if (T == M40K_TYPE_BF16) {
#pragma unroll
        for (int i = 0; i < 8; i++)
            q[i] = m40k_bf2f((uint16_t)(p[2 * (e0 + i)] | (p[2 * (e0 + i) + 1] << 8)));
        scale = 1.0f, offset = 0.0f;
    } else if (T == M40K_TYPE_Q2_K || T == M40K_TYPE_Q3_K) {
        /* q as unsigned: Q3_K's -4..3 plus 4 (offset 4*scale) */
        const uint8_t *b = p + m40k_tinfo<T>::BB * (e0 >> 8);
        const int e = e0 & 255, n = e >> 7, j = (e >> 5) & 3, l = e & 31, s = e >> 4;
        const uint8_t *qs = b + (T == M40K_TYPE_Q2_K ? 16 : 32) + 32 * n + l;
        if (T == M40K_TYPE_Q2_K) {
#pragma unroll
            for (int i = 0; i < 8; i++)
                q[i] = m40k_u8f((qs[i] >> (2 * j)) & 3u);
            scale = m40k_ldh(b + 80) * (float)(b[s] & 15);
            offset = m40k_ldh(b + 82) * (float)(b[s] >> 4);
        } else {
            const uint8_t *hm = b + l;
#pragma unroll
            for (int i = 0; i < 8; i++)
                q[i] = m40k_u8f(((qs[i] >> (2 * j)) & 3u) | (((hm[i] >> (4 * n + j)) & 1u) << 2));
            const uint8_t *sc = b + 96;
            const int lo = s < 8 ? (sc[s] & 15) : (sc[s - 8] >> 4), hi = (sc[8 + (s & 3)] >> (2 * (s >> 2))) & 3;
            scale = m40k_ldh(b + 108) * (float)((lo | (hi << 4)) - 32);
            offset = 4.0f * scale;
        }
    } else if (T == M40K_TYPE_Q8_0) {
        const uint8_t *b = p + 34 * (e0 >> 5);
        const int j = e0 & 31;
#pragma unroll
        for (int i = 0; i < 8; i++)
            q[i] = m40k_u8f(b[2 + j + i] ^ 0x80u); /* int8 + 128 */
        scale = m40k_ldh(b);
        offset = 128.0f * scale;
    } else if (T == M40K_TYPE_Q4_0) {
        const uint8_t *b = p + 18 * (e0 >> 5);
        const int j = e0 & 31, sh = j < 16 ? 0 : 4;
#pragma unroll
        for (int i = 0; i < 8; i++)
            q[i] = m40k_u8f((b[2 + (j & 15) + i] >> sh) & 15u);
        scale = m40k_ldh(b);
        offset = 8.0f * scale;
    } else if (T == M40K_TYPE_Q4_1 || T == M40K_TYPE_Q5_0 || T == M40K_TYPE_Q5_1) {
        constexpr int BB = m40k_tinfo<T>::BB, QS = T == M40K_TYPE_Q4_1 ? 4 : T == M40K_TYPE_Q5_0 ? 6 : 8;
        const uint8_t *b = p + BB * (e0 >> 5);
        const int j = e0 & 31, sh = j < 16 ? 0 : 4;
        uint32_t hb = 0;
        if (T != M40K_TYPE_Q4_1) {
            const uint8_t *qh = b + QS - 4;
            hb = (uint32_t)qh[0] | (uint32_t)qh[1] << 8 | (uint32_t)qh[2] << 16 | (uint32_t)qh[3] << 24;
            hb = (hb >> j) << 4; /* bit j+i of qh lands at bit 4+i */
        }
#pragma unroll
        for (int i = 0; i < 8; i++)
            q[i] = m40k_u8f(((b[QS + (j & 15) + i] >> sh) & 15u) | ((hb >> i) & 16u));
        scale = m40k_ldh(b);
        offset = T == M40K_TYPE_Q5_0 ? 16.0f * scale : -m40k_ldh(b + 2);
    } else if (T == M40K_TYPE_Q4_K || T == M40K_TYPE_Q5_K) {
        constexpr bool q5 = T == M40K_TYPE_Q5_K;
        const uint8_t *b = p + m40k_tinfo<T>::BB * (e0 >> 8);
        const int e = e0 & 255, s = e >> 5, c = e >> 6, l = e & 63, sh = l < 32 ? 0 : 4;
        const uint8_t *sc = b + 4;
        int scv, mnv;
        if (s < 4) {
            scv = sc[s] & 63;
            mnv = sc[s + 4] & 63;
        } else {
            scv = (sc[s + 4] & 15) | ((sc[s - 4] >> 6) << 4);
            mnv = (sc[s + 4] >> 4) | ((sc[s] >> 6) << 4);
        }
        const uint8_t *qs = b + (q5 ? 48 : 16) + 32 * c + (l & 31);
        const uint8_t *qh = b + 16 + (l & 31);
#pragma unroll
        for (int i = 0; i < 8; i++)
            q[i] = m40k_u8f(((qs[i] >> sh) & 15u) | (q5 ? ((qh[i] >> (2 * c + (sh ? 1 : 0))) & 1u) << 4 : 0u));
        scale = m40k_ldh(b) * (float)scv;
        offset = m40k_ldh(b + 2) * (float)mnv;
    } else if (T == M40K_TYPE_Q8_0_G8) {
        const uint8_t *g = p + 272 * (e0 >> 8);
        const int j = (e0 >> 5) & 7, l = e0 & 31;
#pragma unroll
        for (int i = 0; i < 8; i++)
            q[i] = m40k_u8f(g[16 + 32 * j + l + i] ^ 0x80u); /* int8 + 128 */
        scale = m40k_ldh(g + 2 * j);
        offset = 128.0f * scale;
    } else if (T == M40K_TYPE_Q6_K || T == M40K_TYPE_Q6_K_G8 || T == M40K_TYPE_Q6_K_P) {
        /* b: the superblock's ql | qh | scales; dp: its d */
        const uint8_t *b, *dp;
        if (T != M40K_TYPE_Q6_K_G8) {
            b = p + m40k_tinfo<T>::BB * (e0 >> 8);
            dp = b + 208;
        } else {
            const uint8_t *g = p + 1680 * (e0 >> 11);
            const int j = (e0 >> 8) & 7;
            b = g + 208 * j;
            dp = g + 1664 + 2 * j;
        }
        const int e = e0 & 255, n = e >> 7, r = e & 127, k = r >> 5, l = r & 31;
        const uint8_t *ql = b + 64 * n + l + 32 * (k & 1);
        const uint8_t *qh = b + 128 + 32 * n + l;
        const int shl = k < 2 ? 0 : 4, shh = 2 * k;
#pragma unroll
        for (int i = 0; i < 8; i++)
            q[i] = m40k_u8f(((ql[i] >> shl) & 15u) | (((qh[i] >> shh) & 3u) << 4));
        scale = m40k_ldh(dp) * (float)(int8_t)b[192 + (e >> 4)];
        offset = 32.0f * scale;
    } else if (T == M40K_TYPE_MXFP4) {
        const uint8_t *b = p + 17 * (e0 >> 5);
        const int j = e0 & 31, sh = j < 16 ? 0 : 4;
#pragma unroll
        for (int i = 0; i < 8; i++)
            q[i] = m40k_mxfp4_level((uint32_t)(b[1 + (j & 15) + i] >> sh));
        scale = m40k_e8m0_half(b[0]);
        offset = 0.0f;
    } else if (T == M40K_TYPE_MXFP4_P) {
        const uint8_t *c = p + 144 * (e0 >> 8);
        const int b = (e0 >> 5) & 7, j = e0 & 31, sh = j < 16 ? 0 : 4;
#pragma unroll
        for (int i = 0; i < 8; i++)
            q[i] = m40k_mxfp4_level((uint32_t)(c[16 * b + (j & 15) + i] >> sh));
        scale = m40k_e8m0_half(c[128 + b]);
        offset = 0.0f;
    }
}

/* The two decode GEMV kernels (gemv.cu's fast kernel, gemv_q8.cu) share their work split
 * and their end. A block of W warps takes W/S row groups of R rows; the S warps of a group
 * walk the same rows' units of work round robin, per_iter units a warp and iteration.
 *
 * m40k_gemv_pick_split: S in {4, 2, 1} by score = share of warp iterations doing work
 * (units split evenly?) x how well the grid fills the GPU (about 2112 warps resident on
 * an H100: 132 SMs x 16); ties go to the larger S (fewer serial iterations a warp). */
static inline int m40k_gemv_pick_split(int units, int per_iter, int N, int W, int R)
{
    int S = 1;
    double best = -1.0;
    for (int s = 4; s >= 1; s >>= 1) {
        const double even = (double)units / (double)(((units + per_iter * s - 1) / (per_iter * s)) * per_iter * s);
        const double warps = (double)((N + W / s * R - 1) / (W / s * R)) * W;
        const double score = even * (warps >= 2112.0 ? 1.0 : warps / 2112.0);
        if (score > best + 1e-9)
            best = score, S = s;
    }
    return S;
}

/* The block's end: each warp's sums over its lanes into red (shared), then the S partial
 * sums of a row added in warp order and stored as y[b*y_stride + row] (rows >= N: not
 * written); blk: the block's index in its product (blockIdx.x but in a launch of two
 * products). Every thread of the block calls it (one barrier). */
template <int W, int R, int B>
__device__ __forceinline__ void m40k_gemv_block_store(const float (&acc)[R][B], float (&red)[W][R][B], int S, int N,
                                                      float *__restrict__ y, int64_t y_stride, int blk)
{
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, groups = W / S;
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
        const int n = (blk * groups + gg) * R + r;
        if (n < N)
            y[b * y_stride + n] = v;
    }
}

#endif
