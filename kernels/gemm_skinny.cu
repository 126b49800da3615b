/* F16 GEMV on the tensor cores for 1..8 token rows: y[t][r] = sum_k W[r][k] x[t][k],
 * the decode products of F16 weights where a row-per-warp GEMV leaves bandwidth unused
 * (long K, or several rows: measured on an H100 at N 4096 x K 14336, batch 1, 91.1% of
 * 3.02 TB/s against the GEMV's 79.7%; batch 8 87.1% against 47.2%).
 *
 * Block: 8 warps, 128 weight rows (16 a warp), one range of K (split-K over blockIdx.y).
 * Each warp streams its 16 rows straight from global memory into mma.sync A fragments
 * (m16n8k16, F16 in, F32 accumulate), 16-byte loads into two register buffers used in
 * turn (while one 128-wide K step is multiplied the next is in flight, and the buffer
 * just used is refilled two steps ahead); no shared-memory staging of the weights. The
 * 16-element K of one product is permuted in memory: lane (g = lane/4, q = lane%4) loads W[row g (+8)][32j + 8q .. 32j + 8q + 7]
 * and uses halves 0..3 for one product and 4..7 for the next; the B fragment (x) is read
 * with the same permutation (one 16-byte shared load per 32-wide K chunk), so the sum
 * over K is the same sum in another order. x (F32) is rounded to F16 on its way into
 * shared memory up to 16 steps (2,048 columns) at a time: at the usual shapes a split's
 * whole range, so the warps stream their weights with no barrier between steps (one
 * barrier a step before, which held every warp to the slowest one's loads: H100,
 * Mistral-7B F16 batch-1 decode 178.7 -> 180.2 tok/s, N 4096 x K 14336 alone 91.1 ->
 * 92.5% of the bandwidth). Batch rows past n are never written.
 *
 * m40k_gemm_skinny_glu: the same product of x = act(gate) * up (SwiGLU / GeGLU), formed
 * elementwise from the gate and up rows as they are staged (m40k_glu_one, the expression
 * glu_kernel writes), so the FFN's down projection needs no separate activation kernel
 * between the gate/up product and itself (one dependent launch less a layer at decode).
 *
 * Split-K: split s writes its partial [n][128 rows] to the workspace and counts on the
 * row block's counter (m40k_split_last); the block that counts last sums the splits in
 * order 0..S-1 (deterministic, independent of which block finished last), writes y and
 * resets the counter. */
#include "cuda_common.h"

#define SK_WARPS 8
#define SK_ROWS (SK_WARPS * 16) /* weight rows per block */
#define SK_KC 128               /* K per step */
#define SK_XC 16                /* K steps of x staged at once (even: see the step pairs) */
#define SK_XS (SK_XC * SK_KC + 32) /* halves per staged x row: 4,160 bytes, 64 mod 128 (no bank conflicts) */
#define SK_MAXN 8

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

/* ACT < 0: x itself; else x = m40k_glu_one(ACT, x, up) elementwise (gate in x) */
template <int ACT>
__global__ __launch_bounds__(SK_WARPS * 32, 2) void skinny_kernel(const uint16_t *__restrict__ w, int N, int K,
                                                                  const float *x, const float *up, int64_t x_stride,
                                                                  int n,
                                                                  float *__restrict__ y, int64_t ldy, int S, float *ws,
                                                                  int *counters)
{
    m40k_grid_launch_dependents(); /* a PDL-launched kernel may follow */
    __shared__ __align__(16) uint16_t xs[SK_MAXN][SK_XS];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
    const int rb = blockIdx.x, s = blockIdx.y;
    const int row0 = rb * SK_ROWS + warp * 16;
    const int nit = K / SK_KC;
    const int it0 = (int)((int64_t)s * nit / S), it1 = (int)((int64_t)(s + 1) * nit / S);
    /* rows past N read row N-1 (valid memory) and are never written */
    const uint4 *wa = reinterpret_cast<const uint4 *>(w + (size_t)min(row0 + g, N - 1) * K) + q;
    const uint4 *wb = reinterpret_cast<const uint4 *>(w + (size_t)min(row0 + 8 + g, N - 1) * K) + q;

    /* two buffers of a step's weights (16 rows x 128 K: 8 x 16 bytes a lane), used
     * alternately: while one step is multiplied the next is in flight, and its own
     * buffer is refilled (two steps ahead) right after */
    uint4 wA[2][4], wB[2][4];
    auto ldw = [&](uint4(&b)[2][4], int it) {
#pragma unroll
        for (int j = 0; j < 4; j++) {
            b[0][j] = __ldcs(wa + (size_t)it * (SK_KC / 8) + 4 * j);
            b[1][j] = __ldcs(wb + (size_t)it * (SK_KC / 8) + 4 * j);
        }
    };
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    auto mma = [&](const uint4(&b)[2][4], const uint16_t *xrow) { /* xrow: this step's x of batch row g */
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const uint4 v = *reinterpret_cast<const uint4 *>(xrow + 32 * j + 8 * q);
            sk_mma(acc, b[0][j].x, b[1][j].x, b[0][j].y, b[1][j].y, v.x, v.y);
            sk_mma(acc, b[0][j].z, b[1][j].z, b[0][j].w, b[1][j].w, v.z, v.w);
        }
    };
    ldw(wA, it0);
    if (it0 + 1 < it1)
        ldw(wB, it0 + 1);
    x = m40k_grid_wait_for(x); /* x is the previous kernel's output (PDL launch) */
    M40K_LAUNDER(up);

    /* x is staged a chunk of up to SK_XC steps at a time (the whole range of a split at
     * the usual shapes: one barrier, not one a step), rounded to F16 and, with ACT, formed
     * from gate and up on the way (m40k_glu_one, the expression glu_kernel writes) */
    for (int c0 = it0; c0 < it1; c0 += SK_XC) {
        const int c1 = min(it1, c0 + SK_XC), w4 = (c1 - c0) * (SK_KC / 4); /* float4 a batch row */
        if (c0 != it0)
            __syncthreads(); /* every warp is done with the previous chunk */
        for (int r = 0; r < n; r++) {
            const float4 *xp = reinterpret_cast<const float4 *>(x + (size_t)r * x_stride + (size_t)c0 * SK_KC);
            const float4 *up4 = reinterpret_cast<const float4 *>(up + (size_t)r * x_stride + (size_t)c0 * SK_KC);
#pragma unroll 2
            for (int f = threadIdx.x; f < w4; f += SK_WARPS * 32) {
                float4 v = __ldca(xp + f);
                if constexpr (ACT >= 0) {
                    const float4 u = __ldca(up4 + f);
                    v = make_float4(m40k_glu_one(ACT, v.x, u.x), m40k_glu_one(ACT, v.y, u.y),
                                    m40k_glu_one(ACT, v.z, u.z), m40k_glu_one(ACT, v.w, u.w));
                }
                const __half2 lo = __floats2half2_rn(v.x, v.y), hi = __floats2half2_rn(v.z, v.w);
                uint2 h;
                h.x = *reinterpret_cast<const uint32_t *>(&lo);
                h.y = *reinterpret_cast<const uint32_t *>(&hi);
                *reinterpret_cast<uint2 *>(&xs[r][4 * f]) = h;
            }
        }
        __syncthreads();
        /* steps in pairs (chunks start at an even offset from it0: a pair never straddles
         * one): wA holds step it, wB step it + 1 */
        for (int it = c0; it < c1; it += 2) {
            mma(wA, &xs[g][(it - c0) * SK_KC]);
            if (it + 2 < it1)
                ldw(wA, it + 2);
            if (it + 1 < c1) {
                mma(wB, &xs[g][(it + 1 - c0) * SK_KC]);
                if (it + 3 < it1)
                    ldw(wB, it + 3);
            }
        }
    }

    /* accumulator (m16n8): acc[0..1] weight row g, batch rows 2q, 2q+1; acc[2..3] row g + 8
     * (batch rows >= n hold products with unstaged x: never written) */
    float *dst = S > 1 ? ws + (size_t)s * n * N : y;
    const int64_t ld = S > 1 ? N : ldy;
#pragma unroll
    for (int c = 0; c < 4; c++) {
        const int col = 2 * q + (c & 1), row = row0 + g + (c >> 1) * 8;
        if (col < n && row < N)
            dst[(size_t)col * ld + row] = acc[c];
    }
    if (S == 1)
        return;
    if (!m40k_split_last(counters + rb, S))
        return;
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
    /* one wave of two resident blocks per SM; at least two K steps a split */
    int S = (2 * sm_count) / rbs;
    S = min(S, nit / 2);
    while (S > 1 && m40k_gemm_skinny_ws_floats(N, n, S) > ws_floats)
        S--;
    return S < 1 ? 1 : S;
}

static int skinny_launch(int act, const uint16_t *w, int N, int K, const float *x, const float *up, int64_t x_stride,
                         int n, float *y, int64_t ldy, int n_splits, float *workspace, int *counters, m40k_stream stream)
{
    if (N <= 0 || n <= 0)
        return 0;
    if (n > SK_MAXN || K <= 0 || K % SK_KC || ldy < N || ((uintptr_t)w & 15) || ((uintptr_t)x & 15) ||
        ((uintptr_t)up & 15) || x_stride % 4 || (n > 1 && x_stride < K) || n_splits < 1 || n_splits > K / SK_KC ||
        n_splits > 65535 || (n_splits > 1 && (!workspace || !counters)))
        return M40K_INVALID;
    const dim3 grid((unsigned)((N + SK_ROWS - 1) / SK_ROWS), (unsigned)n_splits);
    switch (act) {
    case -1:
        M40K_LAUNCH_PDL(skinny_kernel<-1>, grid, SK_WARPS * 32, 0, stream, w, N, K, x, up, x_stride, n, y, ldy,
                        n_splits, workspace, counters);
        break;
    case M40K_GLU_SILU:
        M40K_LAUNCH_PDL(skinny_kernel<M40K_GLU_SILU>, grid, SK_WARPS * 32, 0, stream, w, N, K, x, up, x_stride, n, y,
                        ldy, n_splits, workspace, counters);
        break;
    case M40K_GLU_GELU_TANH:
        M40K_LAUNCH_PDL(skinny_kernel<M40K_GLU_GELU_TANH>, grid, SK_WARPS * 32, 0, stream, w, N, K, x, up, x_stride, n,
                        y, ldy, n_splits, workspace, counters);
        break;
    default: return M40K_INVALID;
    }
    return m40k_launch_status();
}

extern "C" int m40k_gemm_skinny(const uint16_t *w, int N, int K, const float *x, int64_t x_stride, int n, float *y,
                                int64_t ldy, int n_splits, float *workspace, int *counters, m40k_stream stream)
{
    return skinny_launch(-1, w, N, K, x, x, x_stride, n, y, ldy, n_splits, workspace, counters, stream);
}

extern "C" int m40k_gemm_skinny_glu(int act, const uint16_t *w, int N, int K, const float *gate, const float *up,
                                    int64_t in_stride, int n, float *y, int64_t ldy, int n_splits, float *workspace,
                                    int *counters, m40k_stream stream)
{
    if (act != M40K_GLU_SILU && act != M40K_GLU_GELU_TANH)
        return M40K_INVALID;
    return skinny_launch(act, w, N, K, gate, up, in_stride, n, y, ldy, n_splits, workspace, counters, stream);
}
