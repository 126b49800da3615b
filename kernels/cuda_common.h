/* Device helpers shared by the kernel families (CUDA only; not part of the C API). */
#ifndef M40_CUDA_COMMON_H
#define M40_CUDA_COMMON_H

#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "kernels.h"

#define M40K_INVALID ((int)cudaErrorInvalidValue)

static inline int m40k_launch_status(void) { return (int)cudaGetLastError(); }

/* The count of a split-K block, called by every thread once its partial is stored:
 * whether it is the last of n blocks counted on *counter. Release: the barrier orders the
 * block's stores before thread 0's count, an acq_rel atomic at GPU scope (cumulative over
 * them: CUTLASS's semaphore pattern; a fence in every thread instead costs each block a
 * MEMBAR.SC.GPU). Acquire: the same atomic of the last block, then the barrier before its
 * loads, which read the partials through L2 (__ldcg). */
__device__ __forceinline__ bool m40k_split_last(int *counter, int n)
{
    __shared__ int last;
    __syncthreads();
    if (threadIdx.x == 0) {
        int old;
        asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], 1;" : "=r"(old) : "l"(counter) : "memory");
        last = old == n - 1;
    }
    __syncthreads();
    return last;
}

__device__ __forceinline__ float m40k_h2f(uint16_t h) { return __half2float(__ushort_as_half(h)); }
/* BF16 bits as a float (exact: the top half of the float's bits) */
__device__ __forceinline__ float m40k_bf2f(uint16_t h) { return __uint_as_float((uint32_t)h << 16); }
__device__ __forceinline__ uint16_t m40k_f2h(float f) { return __half_as_ushort(__float2half_rn(f)); }

/* 0..255 to float without the (quarter-rate) integer conversion: the bits of 2^23 + v. */
/* Attention sinks (gpt-oss): a learned logit sk per head joins the softmax with no value
 * behind it. An online softmax that ends with max m and sum l of exp(s - m) (output o
 * unnormalized) gives o * m40k_sink_norm(m, l, sk) instead of o / l: the denominator
 * l + exp(sk - m), both rescaled to max(m, sk) so neither overflows. m -inf (no
 * position seen) gives 0, as the kernels' l == 0 does. Log base e; kernels working in
 * base 2 pass m, sk in log2 units to m40k_sink_norm2. */
__device__ __forceinline__ float m40k_sink_norm(float m, float l, float sk)
{
    const float M = fmaxf(m, sk), e = expf(m - M), den = l * e + expf(sk - M);
    return den > 0.0f ? e / den : 0.0f;
}
__device__ __forceinline__ float m40k_sink_norm2(float m, float l, float sk)
{
    const float M = fmaxf(m, sk), e = exp2f(m - M), den = l * e + exp2f(sk - M);
    return den > 0.0f ? e / den : 0.0f;
}
__device__ __forceinline__ float m40k_u8f(uint32_t v) { return __int_as_float(0x4B000000 | v) - 8388608.0f; }

/* One gated activation: act(g) * u, act M40K_GLU_SILU (g / (1 + e^-g)) or
 * M40K_GLU_GELU_TANH. The one expression glu_kernel (act.cu) and the tensor-core GEMV's
 * fused input (gemm_skinny.cu) both use. */
__device__ __forceinline__ float m40k_glu_one(int act, float g, float u)
{
    const float a = act == M40K_GLU_GELU_TANH ? 0.5f * g * (1.0f + tanhf(0.7978845608028654f * (g + 0.044715f * g * g * g)))
                                              : g / (1.0f + expf(-g));
    return a * u;
}

__device__ __forceinline__ float m40k_warp_sum(float v)
{
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float m40k_warp_max(float v)
{
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

/* Sum of v over the whole block (blockDim.x a multiple of 32, at most 1024), returned
 * to every thread: warp sums into partial[32] (shared), then the first warp sums those.
 * Contains two __syncthreads: every thread of the block must call it. */
__device__ __forceinline__ float m40k_block_sum(float v, float *partial)
{
    v = m40k_warp_sum(v);
    if ((threadIdx.x & 31) == 0)
        partial[threadIdx.x >> 5] = v;
    __syncthreads();
    if (threadIdx.x < 32) {
        float t = threadIdx.x < (blockDim.x >> 5) ? partial[threadIdx.x] : 0.0f;
        t = m40k_warp_sum(t);
        if (threadIdx.x == 0)
            partial[0] = t;
    }
    __syncthreads();
    return partial[0];
}

/* Programmatic dependent launch (Hopper and later). The decode GEMVs are launched with
 * programmatic stream serialization (m40k_launch_pdl): such a kernel may start while the
 * kernel before it on the stream is still finishing, so it first issues what does not
 * depend on that kernel (its first weight loads) and then waits (m40k_grid_wait) before
 * it reads its input or writes anything. Kernels that come before a GEMV call
 * m40k_grid_launch_dependents at their start: the GEMV is then scheduled once every
 * block of theirs has started. Both are no-ops before sm_90 and on a normal launch.
 * The engine's M40_PDL=0 turns the attribute off (for measuring it), through
 * m40k_set_launch_tuning (model_aux.h). */
__device__ __forceinline__ void m40k_grid_wait(void)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void m40k_grid_launch_dependents(void)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
}

/* The wait, returning p laundered through an empty asm: loads through the result depend
 * on the asm's output, so the compiler can not hoist them above the wait (plain
 * const __restrict__ / __ldg loads count as invariant and may be hoisted). Inputs a PDL
 * kernel reads after the wait use coherent loads (__ldca), not the read-only path. */
template <typename P> __device__ __forceinline__ P *m40k_grid_wait_for(P *p)
{
    m40k_grid_wait();
    asm volatile("" : "+l"(p)::"memory");
    return p;
}

/* The start of a small kernel of the decode chain launched with PDL (m40k_launch_pdl):
 * lets the kernel after it be scheduled, then waits until the one before it is done and
 * its writes are visible. Every pointer the kernel reads or writes through is then
 * passed through M40K_LAUNDER (see m40k_grid_wait_for) so that no access moves above
 * the wait. */
__device__ __forceinline__ void m40k_pdl_begin(void)
{
    m40k_grid_launch_dependents();
    m40k_grid_wait();
}
#define M40K_LAUNDER(p) asm volatile("" : "+l"(p)::"memory")

int m40k_pdl_enabled(void);      /* model_aux.cu: compute capability >= 9 and PDL not turned off */
int m40k_clusters_enabled(void); /* model_aux.cu: compute capability >= 9 and clusters not turned off */
int m40k_head_split_enabled(void); /* model_aux.cu: the decode attention's head split not turned off */

/* kernel<<<grid, block, smem, st>>>(args) through cudaLaunchKernelEx: with programmatic
 * stream serialization (when m40k_pdl_enabled), and in thread block clusters of
 * cluster_x blocks along x when cluster_x > 1 (sm_90; the caller checks
 * m40k_clusters_enabled first). */
template <typename... KArgs, typename... Args>
static inline int m40k_launch_ex(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem, unsigned cluster_x,
                                 cudaStream_t st, Args... args)
{
    cudaLaunchAttribute at[2];
    unsigned na = 0;
    if (cluster_x > 1) {
        at[na].id = cudaLaunchAttributeClusterDimension;
        at[na].val.clusterDim.x = cluster_x;
        at[na].val.clusterDim.y = 1;
        at[na].val.clusterDim.z = 1;
        na++;
    }
    if (m40k_pdl_enabled()) {
        at[na].id = cudaLaunchAttributeProgrammaticStreamSerialization;
        at[na].val.programmaticStreamSerializationAllowed = 1;
        na++;
    }
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = st;
    cfg.attrs = at;
    cfg.numAttrs = na;
    return (int)cudaLaunchKernelEx(&cfg, kernel, static_cast<KArgs>(args)...);
}
/* Which cluster size of kernel's blocks (`threads` each, static shared memory only) the
 * current device takes: size, else 8, 4, 2 down to min_size, the first of which one
 * cluster fits (cudaOccupancyMaxActiveClusters); sizes over 8 (non-portable) are allowed
 * on the kernel first. 0 when none does, or when the kernel's code here was not compiled
 * from compute_90 or later (ptxVersion: a build for older targets also runs on a Hopper
 * GPU, as its own machine code or JIT-compiled from older PTX, and there a cluster
 * kernel's body is empty). cudaFunc* calls: callers ask once per kernel and device. */
template <typename... KArgs>
static inline int m40k_cluster_size_fit(void (*kernel)(KArgs...), int size, int min_size, unsigned threads)
{
    cudaFuncAttributes a;
    int best = 0;
    if (cudaFuncGetAttributes(&a, kernel) == cudaSuccess && a.ptxVersion >= 90 && a.binaryVersion >= 90) {
        if (size > 8)
            (void)cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
        for (int c = size; c >= min_size && c >= 2 && !best; c = c > 8 ? 8 : c / 2) {
            cudaLaunchAttribute at;
            at.id = cudaLaunchAttributeClusterDimension;
            at.val.clusterDim.x = (unsigned)c, at.val.clusterDim.y = 1, at.val.clusterDim.z = 1;
            cudaLaunchConfig_t cfg = {};
            cfg.gridDim = dim3((unsigned)c);
            cfg.blockDim = dim3(threads);
            cfg.attrs = &at;
            cfg.numAttrs = 1;
            int n = 0;
            if (cudaOccupancyMaxActiveClusters(&n, kernel, &cfg) == cudaSuccess && n > 0)
                best = c;
        }
    }
    (void)cudaGetLastError();
    return best;
}

template <typename... KArgs, typename... Args>
static inline int m40k_launch_pdl_smem(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t st,
                                       Args... args)
{
    return m40k_launch_ex(kernel, grid, block, smem, 0, st, args...);
}
template <typename... KArgs, typename... Args>
static inline int m40k_launch_pdl(void (*kernel)(KArgs...), dim3 grid, dim3 block, cudaStream_t st, Args... args)
{
    return m40k_launch_ex(kernel, grid, block, 0, 0, st, args...);
}

/* kernel<<<grid, block, smem, st>>>(args) with programmatic stream serialization (the
 * kernel must begin with m40k_pdl_begin or m40k_grid_wait_for); returns the launch
 * error from the enclosing function. */
#define M40K_LAUNCH_PDL(kernel, grid, block, smem, st, ...)                                                           \
    do {                                                                                                               \
        const int e_ = m40k_launch_pdl_smem(kernel, dim3(grid), dim3(block), (size_t)(smem), (cudaStream_t)(st),       \
                                            __VA_ARGS__);                                                              \
        if (e_)                                                                                                        \
            return e_;                                                                                                 \
    } while (0)

/* Two floats to F16 (round to nearest, as m40k_f2h), lo in the low half: one paired
 * conversion instruction on sm_80+. */
__device__ __forceinline__ uint32_t m40k_pack_h2(float lo, float hi)
{
    const __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t *>(&h);
}

/* Four floats to F16, packed in a uint2 (an 8-byte store). */
__device__ __forceinline__ uint2 m40k_pack_h4(float4 v) { return make_uint2(m40k_pack_h2(v.x, v.y), m40k_pack_h2(v.z, v.w)); }

/* Eight floats to F16, packed in a uint4. */
__device__ __forceinline__ uint4 m40k_pack_h8(const float f[8])
{
    uint32_t w[4];
#pragma unroll
    for (int i = 0; i < 4; i++)
        w[i] = m40k_pack_h2(f[2 * i], f[2 * i + 1]);
    return make_uint4(w[0], w[1], w[2], w[3]);
}

/* Eight F16 values packed in a uint4, to float. */
__device__ __forceinline__ void m40k_unpack_h8(uint4 u, float f[8])
{
    const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        float2 t = __half22float2(*reinterpret_cast<const __half2 *>(&w[i]));
        f[2 * i] = t.x;
        f[2 * i + 1] = t.y;
    }
}

#endif
