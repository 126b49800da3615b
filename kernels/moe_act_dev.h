/* The experts' gated activation act(g, u) of kernels.h 10c, for every kernel that forms it
 * (the expert GEMVs of moe.cu and gemv_q8.cu, the grouped path's GLU). */
#ifndef M40_MOE_ACT_DEV_H
#define M40_MOE_ACT_DEV_H

#include "kernels.h"

/* SiLU-gated, or gpt-oss's clamped SwiGLU. expf, not __expf: the twin's values to a few
 * ulp. */
__device__ __forceinline__ float moe_act(int act, float g, float u)
{
    if (act == M40K_GLU_SWIGLU_OAI) {
        const float gc = fminf(g, M40K_OAI_LIMIT), uc = fminf(fmaxf(u, -M40K_OAI_LIMIT), M40K_OAI_LIMIT);
        return gc / (1.0f + expf(-M40K_OAI_ALPHA * gc)) * (uc + 1.0f);
    }
    return g / (1.0f + expf(-g)) * u;
}

#endif
