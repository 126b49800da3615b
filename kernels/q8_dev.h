/* The two-level int8 quantization of activations for the dp4a GEMV (kernels.h 8b),
 * one warp per 32-element block, shared by the standalone m40k_quantize_q8 and by the
 * kernels that produce a GEMV input and quantize it on the way out (add + RMSNorm,
 * gated activation): the same arithmetic, so the same workspace bytes. */
#ifndef M40_Q8_DEV_H
#define M40_Q8_DEV_H

#include "cuda_common.h"

/* The workspace record of one block of 32: x ~ d1*q1 + d2*q2, s the sum of that over
 * the block, z = 0. */
struct __align__(16) gq_blk {
    int8_t q1[32], q2[32];
    float d1, d2, s, z;
};
static_assert(sizeof(gq_blk) == 80, "gq_blk: 80 bytes");

/* rint(v/d) as an int (0 when d == 0). IEEE division and round-half-even, as the CPU
 * twin; the clamp only decides NaN. */
__device__ __forceinline__ int gq_round(float v, float d)
{
    return d != 0.0f ? (int)fminf(127.0f, fmaxf(-127.0f, rintf(v / d))) : 0;
}

__device__ __forceinline__ int gq_warp_isum(int v)
{
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

/* Lane `lane` of a whole warp holds element `lane` of a block: x is rounded to d1*q1
 * (d1 = max|x|/127), the residual r = x - d1*q1 to d2*q2 (d2 = max|r|/127); written to o. */
__device__ __forceinline__ void gq_quantize_block(float v, int lane, gq_blk *o)
{
    const float d1 = m40k_warp_max(fabsf(v)) / 127.0f;
    const int a = gq_round(v, d1);
    const float r = fmaf(-d1, (float)a, v); /* the residual x - d1*q1, rounded once */
    const float d2 = m40k_warp_max(fabsf(r)) / 127.0f;
    const int c = gq_round(r, d2);
    const int sa = gq_warp_isum(a), sc = gq_warp_isum(c);
    o->q1[lane] = (int8_t)a;
    o->q2[lane] = (int8_t)c;
    if (lane == 0)
        *reinterpret_cast<float4 *>(&o->d1) = make_float4(d1, d2, fmaf(d1, (float)sa, __fmul_rn(d2, (float)sc)), 0.0f);
}

#endif
