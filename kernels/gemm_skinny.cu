/* F16 GEMV on the tensor cores for 1..16 token rows: y[t][r] = sum_k W[r][k] x[t][k],
 * the decode products of F16 weights where a row-per-warp GEMV leaves bandwidth unused
 * (long K, or several rows: measured on an H100 at N 4096 x K 14336, batch 1, 89.7% of
 * 3.02 TB/s against the GEMV's 79.4%; batch 8 86.8% against 47.5%).
 *
 * Block: 8 warps and 128 weight rows (16 a warp) up to 8 batch rows, 4 warps and 64
 * weight rows for 9..16 (two 8-row tiles of x), one range of K (split-K over blockIdx.y).
 * Each warp streams its 16 rows straight from global memory into mma.sync A fragments
 * (m16n8k16, F16 in, F32 accumulate), 16-byte loads one 128-wide K step ahead; no
 * shared-memory staging of the weights. The 16-element K of one product is permuted in
 * memory: lane (g = lane/4, q = lane%4) loads W[row g (+8)][32j + 8q .. 32j + 8q + 7]
 * and uses halves 0..3 for one product and 4..7 for the next; the B fragment (x) is read
 * with the same permutation (one 16-byte shared load per 32-wide K chunk), so the sum
 * over K is the same sum in another order. x (F32) is rounded to F16 on its way into
 * shared memory, 128 columns a step, two buffers, loaded one step ahead into registers,
 * one barrier a step. Batch rows past n are never written.
 *
 * Split-K: split s writes its partial [n][128 rows] to the workspace, fences, counts on
 * the row block's counter; the block that counts last sums the splits in order 0..S-1
 * (deterministic, independent of which block finished last), writes y and resets the
 * counter. */
#include "cuda_common.h"

#define SK_KC 128          /* K per step */
#define SK_XS (SK_KC + 32) /* halves per staged x row: 320 bytes, 64 mod 128 (no bank conflicts) */
#define SK_MAXN 16

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

/* NT: 8-row tiles of x (1: n <= 8, 2: n <= 16); W: warps per block (16 weight rows each) */
template <int NT, int W>
__global__ __launch_bounds__(W * 32, 16 / W) void skinny_kernel(const uint16_t *__restrict__ w, int N, int K,
                                                                const float *x, int64_t x_stride, int n,
                                                                float *__restrict__ y, int64_t ldy, int S, float *ws,
                                                                int *counters)
{
    m40k_grid_launch_dependents(); /* a PDL-launched kernel may follow */
    constexpr int ROWS = W * 16, XV = (NT * 8 * 32 + W * 32 - 1) / (W * 32); /* float4 of x a thread stages */
    __shared__ __align__(16) uint16_t xs[2][NT * 8][SK_XS];
    __shared__ int last;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
    const int rb = blockIdx.x, s = blockIdx.y;
    const int row0 = rb * ROWS + warp * 16;
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
    x = m40k_grid_wait_for(x); /* x is the previous kernel's output (PDL launch) */

    /* the thread's float4 number u of a step: batch row idx / 32, columns 4 * (idx % 32) */
    auto xidx = [&](int u) { return (int)threadIdx.x + u * W * 32; };
    auto put = [&](float4 v, int idx, int buf) {
        const __half2 lo = __floats2half2_rn(v.x, v.y), hi = __floats2half2_rn(v.z, v.w);
        uint2 t;
        t.x = *reinterpret_cast<const uint32_t *>(&lo);
        t.y = *reinterpret_cast<const uint32_t *>(&hi);
        *reinterpret_cast<uint2 *>(&xs[buf][idx >> 5][4 * (idx & 31)]) = t;
    };
    auto ldx = [&](int idx, int it) {
        return __ldca(reinterpret_cast<const float4 *>(x + (size_t)(idx >> 5) * x_stride + (size_t)it * SK_KC) +
                      (idx & 31));
    };
    float4 xv[XV];
#pragma unroll
    for (int u = 0; u < XV; u++) {
        const int idx = xidx(u);
        if (idx < n * 32) {
            put(ldx(idx, it0), idx, 0);
            if (it0 + 1 < it1)
                xv[u] = ldx(idx, it0 + 1);
        }
    }

    float acc[NT][4];
#pragma unroll
    for (int t = 0; t < NT; t++)
        acc[t][0] = acc[t][1] = acc[t][2] = acc[t][3] = 0.0f;
    for (int it = it0; it < it1; it++) {
        const int i = it - it0;
        __syncthreads(); /* step it's x is staged; everyone is done with step it - 1's buffer */
        if (it + 1 < it1) {
#pragma unroll
            for (int u = 0; u < XV; u++) {
                const int idx = xidx(u);
                if (idx < n * 32) {
                    put(xv[u], idx, (i + 1) & 1);
                    if (it + 2 < it1)
                        xv[u] = ldx(idx, it + 2);
                }
            }
        }
        uint4 an[2][4];
        if (it + 1 < it1) {
#pragma unroll
            for (int j = 0; j < 4; j++) {
                an[0][j] = __ldcs(wa + (size_t)(it + 1) * (SK_KC / 8) + 4 * j);
                an[1][j] = __ldcs(wb + (size_t)(it + 1) * (SK_KC / 8) + 4 * j);
            }
        }
#pragma unroll
        for (int j = 0; j < 4; j++)
#pragma unroll
            for (int t = 0; t < NT; t++) {
                const uint4 b = *reinterpret_cast<const uint4 *>(&xs[i & 1][t * 8 + g][32 * j + 8 * q]);
                sk_mma(acc[t], a[0][j].x, a[1][j].x, a[0][j].y, a[1][j].y, b.x, b.y);
                sk_mma(acc[t], a[0][j].z, a[1][j].z, a[0][j].w, a[1][j].w, b.z, b.w);
            }
        if (it + 1 < it1) {
#pragma unroll
            for (int j = 0; j < 4; j++)
                a[0][j] = an[0][j], a[1][j] = an[1][j];
        }
    }

    /* accumulator (m16n8): acc[t][0..1] weight row g, batch rows 8t + 2q, 8t + 2q + 1;
     * acc[t][2..3] row g + 8 (batch rows >= n hold products with unstaged x: not written) */
    float *dst = S > 1 ? ws + (size_t)s * n * N : y;
    const int64_t ld = S > 1 ? N : ldy;
#pragma unroll
    for (int t = 0; t < NT; t++)
#pragma unroll
        for (int c = 0; c < 4; c++) {
            const int col = 8 * t + 2 * q + (c & 1), row = row0 + g + (c >> 1) * 8;
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
    const int rows = min(ROWS, N - rb * ROWS);
    for (int idx = threadIdx.x; idx < n * rows; idx += W * 32) {
        const int col = idx / rows, row = rb * ROWS + idx % rows;
        float v = 0.0f;
        for (int k = 0; k < S; k++)
            v += __ldcg(ws + ((size_t)k * n + col) * N + row);
        y[(size_t)col * ldy + row] = v;
    }
    if (threadIdx.x == 0)
        atomicExch(counters + rb, 0); /* every split has counted: nothing else touches it now */
}

/* weight rows per block: 128 (8 warps) up to 8 batch rows, 64 (4 warps) above */
static int sk_rows(int n) { return n <= 8 ? 128 : 64; }

extern "C" size_t m40k_gemm_skinny_counter_ints(int N) { return N > 0 ? (size_t)(N + 63) / 64 : 0; }

extern "C" size_t m40k_gemm_skinny_ws_floats(int N, int n, int n_splits)
{
    return n_splits > 1 && N > 0 && n > 0 ? (size_t)n_splits * n * N : 0;
}

extern "C" int m40k_gemm_skinny_pick_splits(int N, int K, int n, int sm_count, size_t ws_floats, size_t counter_ints)
{
    if (N <= 0 || K < SK_KC || n <= 0 || n > SK_MAXN || sm_count <= 0 ||
        m40k_gemm_skinny_counter_ints(N) > counter_ints)
        return 1;
    const int R = sk_rows(n), rbs = (N + R - 1) / R, nit = K / SK_KC;
    /* one wave of resident blocks (16 warps an SM); at least two K steps a split */
    int S = (16 * 16 / R * sm_count) / rbs;
    S = min(S, nit / 2);
    while (S > 1 && m40k_gemm_skinny_ws_floats(N, n, S) > ws_floats)
        S--;
    return S < 1 ? 1 : S;
}

template <int NT, int W>
static int sk_launch(const uint16_t *w, int N, int K, const float *x, int64_t xs, int n, float *y, int64_t ldy, int S,
                     float *ws, int *cnt, m40k_stream stream)
{
    M40K_LAUNCH_PDL((skinny_kernel<NT, W>), dim3((unsigned)((N + W * 16 - 1) / (W * 16)), (unsigned)S), W * 32, 0,
                    stream, w, N, K, x, xs, n, y, ldy, S, ws, cnt);
    return m40k_launch_status();
}

extern "C" int m40k_gemm_skinny(const uint16_t *w, int N, int K, const float *x, int64_t x_stride, int n, float *y,
                                int64_t ldy, int n_splits, float *workspace, int *counters, m40k_stream stream)
{
    if (N <= 0 || n <= 0)
        return 0;
    if (n > SK_MAXN || K <= 0 || K % SK_KC || ldy < N || ((uintptr_t)w & 15) || ((uintptr_t)x & 15) ||
        x_stride % 4 || (n > 1 && x_stride < K) || n_splits < 1 || n_splits > K / SK_KC || n_splits > 65535 ||
        (n_splits > 1 && (!workspace || !counters)))
        return M40K_INVALID;
    if (n <= 8)
        return sk_launch<1, 8>(w, N, K, x, x_stride, n, y, ldy, n_splits, workspace, counters, stream);
    return sk_launch<2, 4>(w, N, K, x, x_stride, n, y, ldy, n_splits, workspace, counters, stream);
}
