/* Skinny F16 GEMM on the tensor cores: the products of a step with 1..64 token rows
 * (the server's decode batches plus prompt chunks), where the weights are read once
 * and the work is memory-bound: y[t][r] = sum_k W[r][k] x16[t][k].
 *
 * Block: 8 warps, 128 weight rows (16 a warp), one range of K (split-K over blockIdx.y).
 * Each warp streams its 16 rows straight from global memory into mma.sync A fragments,
 * 16-byte loads one 128-wide K step ahead (no shared-memory staging of the weights).
 * The mapping of the 16-element K of an m16n8k16 product to memory is permuted: lane
 * (g = lane/4, q = lane%4) loads W[row g (+8)][32j + 8q .. 32j + 8q + 7] and uses halves
 * 0..3 for one product and 4..7 for the next. The B fragments (x) are read with the same
 * permutation (one 16-byte shared load per n-tile and 32-wide K chunk), so the sum over K
 * is the same sum in another order. x (already F16) is copied into shared memory with
 * cp.async, 128 columns at a time, three buffers deep, one barrier per step; the rows
 * past n are never read into the outputs that are written.
 *
 * Split-K: split s writes its partial [n][128 rows] to the workspace, fences, counts on
 * the row block's counter; the block that counts last sums the splits in order 0..S-1
 * (deterministic, independent of which block finished last), writes y and resets the
 * counter. Accumulation is F32 (the tensor cores' F32 accumulate), as in cuBLAS's
 * F16 x F16 -> F32 product this replaces for batches of up to 64 rows. */
#include "cuda_common.h"

#define SK_WARPS 8
#define SK_ROWS (SK_WARPS * 16) /* weight rows per block */
#define SK_KC 128               /* K per step */
#define SK_XS (SK_KC + 32)      /* halves per staged x row: 320 bytes, 64 mod 128 (no bank conflicts) */
#define SK_STAGES 3
/* resident blocks per SM: two up to 32 rows of x (<= 128 registers), one above */
#define SK_BPS(nt) ((nt) <= 4 ? 2 : 1)

__device__ __forceinline__ void sk_mma(float c[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                       uint32_t b1)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#endif
}

__device__ __forceinline__ void sk_cp16(void *smem, const void *gmem)
{
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(gmem) : "memory");
}
__device__ __forceinline__ void sk_commit(void) { asm volatile("cp.async.commit_group;" ::: "memory"); }
__device__ __forceinline__ void sk_wait1(void) { asm volatile("cp.async.wait_group 1;" ::: "memory"); }

template <int NT>
__global__ __launch_bounds__(SK_WARPS * 32, SK_BPS(NT)) void skinny_kernel(const uint16_t *__restrict__ w, int N, int K,
                                                               const uint16_t *x16, int n, float *__restrict__ y,
                                                               int64_t ldy, int S, float *ws, int *counters)
{
    m40k_grid_launch_dependents();
    extern __shared__ __align__(16) uint16_t xs[]; /* [SK_STAGES][NT * 8][SK_XS] */
    __shared__ int last;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
    const int rb = blockIdx.x, s = blockIdx.y;
    const int row0 = rb * SK_ROWS + warp * 16;
    const int nit = K / SK_KC;
    const int it0 = (int)((int64_t)s * nit / S), it1 = (int)((int64_t)(s + 1) * nit / S);
    /* rows past N read row N-1 (valid memory) and are never written */
    const uint4 *wa = reinterpret_cast<const uint4 *>(w + (size_t)min(row0 + g, N - 1) * K) + q;
    const uint4 *wb = reinterpret_cast<const uint4 *>(w + (size_t)min(row0 + 8 + g, N - 1) * K) + q;

    uint4 a[2][4];
#pragma unroll
    for (int j = 0; j < 4; j++) {
        a[0][j] = __ldcs(wa + (size_t)it0 * (SK_KC / 8) + 4 * j);
        a[1][j] = __ldcs(wb + (size_t)it0 * (SK_KC / 8) + 4 * j);
    }
    x16 = m40k_grid_wait_for(x16); /* x16 is the previous kernel's output (PDL launch) */

    auto stage_x = [&](int it, int buf) {
        if (it < it1) {
            uint16_t *dst = xs + (size_t)buf * (NT * 8 * SK_XS);
            for (int idx = threadIdx.x; idx < n * (SK_KC / 8); idx += SK_WARPS * 32) {
                const int r = idx / (SK_KC / 8), c = idx % (SK_KC / 8);
                sk_cp16(dst + r * SK_XS + 8 * c, x16 + (size_t)r * K + (size_t)it * SK_KC + 8 * c);
            }
        }
        sk_commit(); /* possibly empty: keeps one group per step */
    };
    stage_x(it0, 0);
    stage_x(it0 + 1, 1);

    float acc[NT][4];
#pragma unroll
    for (int t = 0; t < NT; t++)
        acc[t][0] = acc[t][1] = acc[t][2] = acc[t][3] = 0.0f;

    for (int it = it0; it < it1; it++) {
        const int i = it - it0;
        sk_wait1();      /* this thread's copies of step it have landed */
        __syncthreads(); /* everyone's have, and everyone is done with step it - 1's buffer */
        stage_x(it + 2, (i + 2) % SK_STAGES);
        uint4 an[2][4];
        if (it + 1 < it1) {
#pragma unroll
            for (int j = 0; j < 4; j++) {
                an[0][j] = __ldcs(wa + (size_t)(it + 1) * (SK_KC / 8) + 4 * j);
                an[1][j] = __ldcs(wb + (size_t)(it + 1) * (SK_KC / 8) + 4 * j);
            }
        }
        const uint16_t *xb = xs + (size_t)(i % SK_STAGES) * (NT * 8 * SK_XS);
#pragma unroll
        for (int j = 0; j < 4; j++) {
#pragma unroll
            for (int t = 0; t < NT; t++) {
                const uint4 b = *reinterpret_cast<const uint4 *>(xb + (t * 8 + g) * SK_XS + 32 * j + 8 * q);
                sk_mma(acc[t], a[0][j].x, a[1][j].x, a[0][j].y, a[1][j].y, b.x, b.y);
                sk_mma(acc[t], a[0][j].z, a[1][j].z, a[0][j].w, a[1][j].w, b.z, b.w);
            }
        }
        if (it + 1 < it1) {
#pragma unroll
            for (int j = 0; j < 4; j++)
                a[0][j] = an[0][j], a[1][j] = an[1][j];
        }
    }

    /* accumulator (m16n8): acc[t][0..1] row g, columns 2q, 2q+1; [2..3] row g + 8 */
    float *dst = S > 1 ? ws + (size_t)s * n * N : y;
    const int64_t ld = S > 1 ? N : ldy;
#pragma unroll
    for (int t = 0; t < NT; t++)
#pragma unroll
        for (int c = 0; c < 4; c++) {
            const int col = t * 8 + 2 * q + (c & 1), row = row0 + g + (c >> 1) * 8;
            if (col < n && row < N)
                dst[(size_t)col * ld + row] = acc[t][c];
        }
    if (S == 1)
        return;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        last = atomicAdd(counters + rb, 1) == S - 1;
    }
    __syncthreads();
    if (!last)
        return;
    __threadfence();
    const int rows = min(SK_ROWS, N - rb * SK_ROWS);
    for (int idx = threadIdx.x; idx < n * rows; idx += SK_WARPS * 32) {
        const int col = idx / rows, row = rb * SK_ROWS + idx % rows;
        float v = 0.0f;
        for (int k = 0; k < S; k++)
            v += __ldcg(ws + ((size_t)k * n + col) * N + row);
        y[(size_t)col * ldy + row] = v;
    }
    if (threadIdx.x == 0)
        atomicExch(counters + rb, 0); /* every split has counted: nothing else touches it now */
}

extern "C" size_t m40k_gemm_skinny_counter_ints(int N) { return N > 0 ? (size_t)(N + SK_ROWS - 1) / SK_ROWS : 0; }

extern "C" size_t m40k_gemm_skinny_ws_floats(int N, int n, int n_splits)
{
    return n_splits > 1 && N > 0 && n > 0 ? (size_t)n_splits * n * N : 0;
}

extern "C" int m40k_gemm_skinny_pick_splits(int N, int K, int n, int sm_count, size_t ws_floats, size_t counter_ints)
{
    if (N <= 0 || K < SK_KC || n <= 0 || sm_count <= 0 || m40k_gemm_skinny_counter_ints(N) > counter_ints)
        return 1;
    const int rbs = (N + SK_ROWS - 1) / SK_ROWS, nit = K / SK_KC;
    /* one wave of resident blocks; at least two K steps a split */
    int S = (SK_BPS((n + 7) / 8) * sm_count) / rbs;
    S = min(S, nit / 2);
    while (S > 1 && m40k_gemm_skinny_ws_floats(N, n, S) > ws_floats)
        S--;
    return S < 1 ? 1 : S;
}

template <int NT>
static int skinny_launch(const uint16_t *w, int N, int K, const uint16_t *x16, int n, float *y, int64_t ldy, int S,
                         float *ws, int *counters, cudaStream_t st)
{
    const size_t smem = (size_t)SK_STAGES * NT * 8 * SK_XS * 2;
    if (smem > 48 * 1024) {
        const cudaError_t e =
            cudaFuncSetAttribute(skinny_kernel<NT>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
        if (e != cudaSuccess)
            return (int)e;
    }
    return m40k_launch_pdl_smem(skinny_kernel<NT>, dim3((unsigned)((N + SK_ROWS - 1) / SK_ROWS), (unsigned)S),
                                dim3(SK_WARPS * 32), smem, st, w, N, K, x16, n, y, ldy, S, ws, counters);
}

extern "C" int m40k_gemm_skinny(const uint16_t *w, int N, int K, const uint16_t *x16, int n, float *y, int64_t ldy,
                                int n_splits, float *workspace, int *counters, m40k_stream stream)
{
    if (N <= 0 || n <= 0)
        return 0;
    if (n > 64 || K <= 0 || K % SK_KC || ldy < N || ((uintptr_t)w & 15) || ((uintptr_t)x16 & 15) || n_splits < 1 ||
        n_splits > K / SK_KC || n_splits > 65535 || (n_splits > 1 && (!workspace || !counters)))
        return M40K_INVALID;
    cudaStream_t st = (cudaStream_t)stream;
    if (n <= 8)
        return skinny_launch<1>(w, N, K, x16, n, y, ldy, n_splits, workspace, counters, st);
    if (n <= 16)
        return skinny_launch<2>(w, N, K, x16, n, y, ldy, n_splits, workspace, counters, st);
    if (n <= 32)
        return skinny_launch<4>(w, N, K, x16, n, y, ldy, n_splits, workspace, counters, st);
    if (n <= 48)
        return skinny_launch<6>(w, N, K, x16, n, y, ldy, n_splits, workspace, counters, st);
    return skinny_launch<8>(w, N, K, x16, n, y, ldy, n_splits, workspace, counters, st);
}
