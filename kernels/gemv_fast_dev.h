/* The decode of the fast GEMV path (gemv.cu's gemv_fast_kernel, and the experts' GEMV of
 * moe.cu): per type the segment a warp stages (SEG elements) and the sub-block scales it
 * decodes once a segment (NSC), the group decode gf_group (lane l's 8 elements 8l + 256i of
 * a staged segment as floats f with contribution A*sum(f*x) + C*sum(x)) and gf_scales.
 * The staged segment starts at byte off of the buffer (0 for F16, BF16, Q4_K, Q6_K_P and
 * MXFP4_P, whose rows the callers keep 16-byte aligned; any for the others). */
#ifndef M40_GEMV_FAST_DEV_H
#define M40_GEMV_FAST_DEV_H

#include "quant_dev.h"

template <int T> struct gf_cfg;
template <> struct gf_cfg<M40K_TYPE_F16> { enum { SEG = 512, NSC = 0 }; };
template <> struct gf_cfg<M40K_TYPE_BF16> { enum { SEG = 512, NSC = 0 }; };
template <> struct gf_cfg<M40K_TYPE_Q8_0> { enum { SEG = 1024, NSC = 0 }; };
template <> struct gf_cfg<M40K_TYPE_Q4_0> { enum { SEG = 2048, NSC = 0 }; };
template <> struct gf_cfg<M40K_TYPE_Q4_K> { enum { SEG = 2048, NSC = 64 }; };  /* (A, C) per 32-sub-block */
template <> struct gf_cfg<M40K_TYPE_Q6_K> { enum { SEG = 1024, NSC = 64 }; };  /* A per 16-sub-block */
template <> struct gf_cfg<M40K_TYPE_Q6_K_P> { enum { SEG = 1024, NSC = 64 }; }; /* the experts' GEMV only */
template <> struct gf_cfg<M40K_TYPE_MXFP4> { enum { SEG = 1024, NSC = 0 }; }; /* the experts' GEMV only */
template <> struct gf_cfg<M40K_TYPE_MXFP4_P> { enum { SEG = 1024, NSC = 0 }; }; /* the experts' GEMV only */

template <int T> struct gf_dims {
    typedef m40k_tinfo<T> ti;
    enum {
        SEG = gf_cfg<T>::SEG,
        SEGB = SEG / ti::BE * ti::BB,                              /* bytes of a full segment */
        NCH = (SEGB + 15) / 16 + (SEGB % 16 ? 1 : 0),               /* 16-byte chunks, worst offset */
        CH = (NCH + 31) / 32,                                       /* chunks per lane */
        SMB = CH * 512 + 16,                                        /* + slack for 3-word reads */
        NSC = gf_cfg<T>::NSC > 0 ? gf_cfg<T>::NSC : 1,
    };
};

/* 8 bytes at any byte offset a of a 4-byte aligned shared buffer: 3 word loads. */
__device__ __forceinline__ uint2 gf_ld8(const uint8_t *p, int a)
{
    const uint32_t *w = reinterpret_cast<const uint32_t *>(p + (a & ~3));
    const uint32_t w0 = w[0], w1 = w[1], w2 = w[2];
    const int sh = (a & 3) * 8;
    return make_uint2(__funnelshift_r(w0, w1, sh), __funnelshift_r(w1, w2, sh));
}
/* f16 at an even byte offset a */
__device__ __forceinline__ float gf_ldh(const uint8_t *p, int a)
{
    const uint32_t w = *reinterpret_cast<const uint32_t *>(p + (a & ~3));
    return m40k_h2f((uint16_t)(w >> ((a & 2) * 8)));
}
/* byte j of word u, under exponent 0x3F: 1 + (mantissa byte)/128 */
__device__ __forceinline__ float gf_b2f_one(uint32_t u, int j)
{
    return __int_as_float((int)__byte_perm(u, 0x3F000000u, 0x7044u | (j << 8)));
}
/* byte j of word u as an exact float 0..255 */
__device__ __forceinline__ float gf_b2f_int(uint32_t u, int j)
{
    return __int_as_float((int)__byte_perm(u, 0x4B000000u, 0x7440u | j)) - 8388608.0f;
}

/* Decode lane `lane`'s group of segment-relative element e0 = 8*lane + 256*i of one row
 * staged at p (data starts at byte off). Output: f[8] and A, C with
 * contribution = A*sum(f*x) + C*sum(x). */
template <int T>
__device__ __forceinline__ void gf_group(const uint8_t *p, int off, const float2 *sc, int lane, int i, float f[8],
                                         float &A, float &C)
{
    if (T == M40K_TYPE_F16) {
        const uint4 u = *reinterpret_cast<const uint4 *>(p + 16 * lane + 512 * i); /* off == 0 */
        m40k_unpack_h8(u, f);
        A = 1.0f, C = 0.0f;
    } else if (T == M40K_TYPE_BF16) { /* the top halves of floats: exact */
        const uint4 u = *reinterpret_cast<const uint4 *>(p + 16 * lane + 512 * i); /* off == 0 */
        const uint32_t wd[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
        for (int k = 0; k < 4; k++) {
            f[2 * k] = __uint_as_float(wd[k] << 16);
            f[2 * k + 1] = __uint_as_float(wd[k] & 0xFFFF0000u);
        }
        A = 1.0f, C = 0.0f;
    } else if (T == M40K_TYPE_Q8_0) {
        const int j = 8 * i + (lane >> 2), jj = 8 * (lane & 3);
        const int bo = off + 34 * j;
        uint2 v = gf_ld8(p, bo + 2 + jj);
        v.x ^= 0x80808080u, v.y ^= 0x80808080u;
#pragma unroll
        for (int k = 0; k < 4; k++) {
            f[k] = gf_b2f_int(v.x, k);
            f[4 + k] = gf_b2f_int(v.y, k);
        }
        const float d = gf_ldh(p, bo);
        A = d, C = -128.0f * d;
    } else if (T == M40K_TYPE_Q4_0) {
        const int j = 8 * i + (lane >> 2), jj = 8 * (lane & 3);
        const int bo = off + 18 * j;
        const uint2 v = gf_ld8(p, bo + 2 + (jj & 15));
        const int sh = jj < 16 ? 0 : 4;
        const uint32_t ux = ((v.x >> sh) & 0x0F0F0F0Fu) * 8u + 0x80808080u;
        const uint32_t uy = ((v.y >> sh) & 0x0F0F0F0Fu) * 8u + 0x80808080u;
#pragma unroll
        for (int k = 0; k < 4; k++) {
            f[k] = gf_b2f_one(ux, k);
            f[4 + k] = gf_b2f_one(uy, k);
        }
        const float d = gf_ldh(p, bo);
        A = 16.0f * d, C = -24.0f * d;
    } else if (T == M40K_TYPE_Q4_K) {
        /* block i (off == 0, 144-byte blocks stay 16-aligned); e = 8*lane */
        const int c = lane >> 3, l = 8 * (lane & 7), sh = l < 32 ? 0 : 4;
        const uint2 v = *reinterpret_cast<const uint2 *>(p + 144 * i + 16 + 32 * c + (l & 31));
        const uint32_t ux = ((v.x >> sh) & 0x0F0F0F0Fu) * 8u + 0x80808080u;
        const uint32_t uy = ((v.y >> sh) & 0x0F0F0F0Fu) * 8u + 0x80808080u;
#pragma unroll
        for (int k = 0; k < 4; k++) {
            f[k] = gf_b2f_one(ux, k);
            f[4 + k] = gf_b2f_one(uy, k);
        }
        const float2 ac = sc[8 * i + (lane >> 2)];
        A = ac.x, C = ac.y;
    } else if (T == M40K_TYPE_Q6_K || T == M40K_TYPE_Q6_K_P) {
        const int n = lane >> 4, r = 8 * (lane & 15), k = r >> 5, l = r & 31;
        const int bo = off + m40k_tinfo<T>::BB * i;
        uint2 ql, qh;
        if (T == M40K_TYPE_Q6_K_P) { /* off == 0, 224-byte superblocks: 8-byte loads */
            ql = *reinterpret_cast<const uint2 *>(p + bo + 64 * n + l + 32 * (k & 1));
            qh = *reinterpret_cast<const uint2 *>(p + bo + 128 + 32 * n + l);
        } else {
            ql = gf_ld8(p, bo + 64 * n + l + 32 * (k & 1));
            qh = gf_ld8(p, bo + 128 + 32 * n + l);
        }
        const int shl = k < 2 ? 0 : 4, shh = 2 * k;
        const uint32_t ux =
            (((ql.x >> shl) & 0x0F0F0F0Fu) | (((qh.x >> shh) & 0x03030303u) << 4)) * 2u + 0x80808080u;
        const uint32_t uy =
            (((ql.y >> shl) & 0x0F0F0F0Fu) | (((qh.y >> shh) & 0x03030303u) << 4)) * 2u + 0x80808080u;
#pragma unroll
        for (int kk = 0; kk < 4; kk++) {
            f[kk] = gf_b2f_one(ux, kk);
            f[4 + kk] = gf_b2f_one(uy, kk);
        }
        A = sc[16 * i + (lane >> 1)].x;
        C = -1.5f * A;
    } else if (T == M40K_TYPE_MXFP4 || T == M40K_TYPE_MXFP4_P) {
        /* block 8i + lane/4 of 17 bytes, its qs bytes 4q .. 4q+3 (q = lane % 4): elements
         * 4q .. 4q+3 (low nibbles: f[0..3]) and 16+4q .. 16+4q+3 (high: f[4..7]); x at
         * gf_xoff's offsets. Each level plus 12 (0..24) as a byte from a table by byte
         * permutes: the nibbles' low 3 bits select the magnitude from the table of positive
         * or of negative levels, their sign bit (bit 3: PTX prmt's sign-replicate flag, on
         * a table of 0x80 bytes) picks between the two. Then A = the scale, C = -12 A. */
        uint32_t w, e;
        if (T == M40K_TYPE_MXFP4_P) { /* off == 0: chunk i, its block lane/4 (kernels.h 0.) */
            w = *reinterpret_cast<const uint32_t *>(p + 144 * i + 16 * (lane >> 2) + 4 * (lane & 3));
            e = p[144 * i + 128 + (lane >> 2)];
        } else {
            const int j = 8 * i + (lane >> 2), bo = off + 17 * j;
            const int a = bo + 1 + 4 * (lane & 3);
            const uint32_t *wp = reinterpret_cast<const uint32_t *>(p + (a & ~3));
            w = __funnelshift_r(wp[0], wp[1], (a & 3) * 8);
            e = p[bo];
        }
        uint32_t u[2];
#pragma unroll
        for (int h = 0; h < 2; h++) { /* nibbles 4h .. 4h+3: elements 2h, 16+2h, 2h+1, 16+2h+1 */
            const uint32_t sel = (w >> (16 * h)) & 0xFFFFu;
            const uint32_t pos = __byte_perm(0x0F0E0D0Cu, 0x18141210u, sel & 0x7777u);
            const uint32_t neg = __byte_perm(0x090A0B0Cu, 0x00040608u, sel & 0x7777u);
            uint32_t m7; /* prmt's sign-replicate mode (selector bit 3), which __byte_perm masks off */
            asm("prmt.b32 %0, %1, %1, %2;" : "=r"(m7) : "r"(0x80808080u), "r"(sel));
            m7 ^= 0x80808080u; /* 0x7F: negative */
            const uint32_t m = m7 | (m7 << 1);
            u[h] = (pos & ~m) | (neg & m);
        }
        f[0] = gf_b2f_int(u[0], 0), f[1] = gf_b2f_int(u[0], 2), f[2] = gf_b2f_int(u[1], 0), f[3] = gf_b2f_int(u[1], 2);
        f[4] = gf_b2f_int(u[0], 1), f[5] = gf_b2f_int(u[0], 3), f[6] = gf_b2f_int(u[1], 1), f[7] = gf_b2f_int(u[1], 3);
        A = m40k_e8m0_half(e), C = -12.0f * A;
    }
}

/* The x of lane's group i (gf_group's f[0..3] and f[4..7]): elements oa .. oa+3 and
 * ob .. ob+3 of the segment; 8l + 256i and 4 more for every type but MXFP4. */
template <int T> __device__ __forceinline__ void gf_xoff(int lane, int i, int &oa, int &ob)
{
    if (T == M40K_TYPE_MXFP4 || T == M40K_TYPE_MXFP4_P) {
        oa = 32 * (8 * i + (lane >> 2)) + 4 * (lane & 3);
        ob = oa + 16;
    } else {
        oa = 8 * lane + 256 * i;
        ob = oa + 4;
    }
}

/* Per-segment scale decode (K-quants): sc[s] for every sub-block of the staged segment. */
template <int T>
__device__ __forceinline__ void gf_scales(const uint8_t *p, int off, float2 *sc, int lane)
{
    if (T == M40K_TYPE_Q4_K) {
#pragma unroll
        for (int idx = lane; idx < gf_cfg<T>::NSC; idx += 32) {
            const int blk = idx >> 3, s = idx & 7;
            const uint4 h = *reinterpret_cast<const uint4 *>(p + 144 * blk); /* off == 0 */
            const float d = m40k_h2f((uint16_t)(h.x & 0xFFFF)), dmin = m40k_h2f((uint16_t)(h.x >> 16));
            const int t = (s & 3) * 8;
            const uint32_t b1 = (h.y >> t) & 0xFF, b2 = (h.z >> t) & 0xFF, b3 = (h.w >> t) & 0xFF;
            int scv, mnv;
            if (s < 4) {
                scv = b1 & 63;
                mnv = b2 & 63;
            } else {
                scv = (b3 & 15) | ((b1 >> 6) << 4);
                mnv = (b3 >> 4) | ((b2 >> 6) << 4);
            }
            const float a = d * (float)scv, m = dmin * (float)mnv;
            sc[idx] = make_float2(16.0f * a, -(16.0f * a + m));
        }
    } else if (T == M40K_TYPE_Q6_K || T == M40K_TYPE_Q6_K_P) {
#pragma unroll
        for (int idx = lane; idx < gf_cfg<T>::NSC; idx += 32) {
            const int blk = idx >> 4, t = idx & 15;
            const uint8_t *b = p + off + m40k_tinfo<T>::BB * blk;
            const float d = m40k_h2f((uint16_t)(b[208] | (b[209] << 8)));
            sc[idx] = make_float2(64.0f * d * (float)(int8_t)b[192 + t], 0.0f);
        }
    }
}

#endif
