/* RoPE's angle and rotation as device helpers (CUDA only; not part of the C API), shared
 * by rope_kernel (rope.cu) and the K rotation that kv_append_rope_kernel (kv_cache.cu)
 * does on its way into the cache: both must give the same bits, so that
 * m40k_kv_append_rope writes exactly what m40k_rope followed by m40k_kv_append writes.
 * Inlining the same source into two kernels does not promise that by itself (ptxas may
 * contract a multiply and an add into an FMA in one and not in the other), so every
 * step that could be contracted is spelled out with the _rn intrinsics; they are the
 * FMAs the compiler chose for rope_kernel before this header existed, so rope_kernel's
 * results did not change when it moved here. */
#ifndef M40_ROPE_DEV_H
#define M40_ROPE_DEV_H

#include "cuda_common.h"

/* cos and sin of rotation pair i (i < rot_dim/2) at position pos:
 * theta = pos * base^(-2i/rot_dim) / ff[i] (ff may be NULL), log2_base = log2((double)base)
 * as the host computes it. The angle is formed in double (positions in the hundreds of
 * thousands keep float accuracy), reduced to [-pi, pi] in double, and only then handed
 * to the float sincosf: a small argument never takes its slow path, and a double sincos
 * is avoided. */
__device__ __forceinline__ void m40k_rope_sincos(int32_t pos, int i, int rot_dim, double log2_base,
                                                 const float *__restrict__ ff, float *s, float *c)
{
    double theta = (double)pos * exp2(-2.0 * i / rot_dim * log2_base);
    if (ff)
        theta /= ff[i];
    const double r = __fma_rn(rint(theta * 0.15915494309189535), -6.283185307179586, theta);
    sincosf((float)r, s, c);
}

/* The rotated pair: y0 = x0*c - x1*s, y1 = x0*s + x1*c, each as one FMA over a rounded
 * product (x0 is the fused factor in both). */
__device__ __forceinline__ void m40k_rope_rotate(float x0, float x1, float c, float s, float *y0, float *y1)
{
    *y0 = __fmaf_rn(x0, c, -__fmul_rn(x1, s));
    *y1 = __fmaf_rn(x0, s, __fmul_rn(x1, c));
}

#endif
