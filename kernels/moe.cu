/* Mixtures of experts (kernels.h 10): the router, the batch-1 expert GEMVs, and for
 * batches the grouping of the (token, choice) pairs by expert around the grouped quantized
 * product of gemm_q.cu (m40k_moe_gemm_q).
 *
 * Why these shapes:
 * - Routing stays on the device (logits, top-k, weights, the grouping's counts and
 *   offsets): no host round trip per layer, so a decode step stays one CUDA graph.
 * - Batch 1 (decode of one sequence) reads only the chosen experts' rows: a GEMV whose
 *   warp finds its expert's matrix from ids[] in device memory. Gate and up share x and
 *   are read together (two rows in flight a warp), the activation is applied on the way
 *   out, and the down projection sums the k experts of a token in one warp per output row
 *   in a fixed order (no atomics: the result does not depend on timing).
 * - Batches group the pairs by expert (stable: by pair index within an expert) and hand
 *   every expert's rows to one launch of the shared-memory quantized GEMM with a tile
 *   table; the combine step walks each token's k results in order j = 0..k-1 again.
 * The weights are dequantized by quant_dev.h's m40k_group8, the one definition the GEMV,
 * the embedding gather and the GEMM share. */
#include "gemv_fast_dev.h"
#include "moe_act_dev.h"

/* ------------------------------------------------------------------ router */

#define RT_THREADS 128
#define RT_TOK 8

/* 10a': the RMSNorm folded into the attention output projection before (kernels.h 8d):
 * x is the residual, w the norm's weights, ss its sums of squares per 32 (NULL: 10a). */
struct rt_norm {
    const float *w, *ss;
    float eps;
};

/* Four elements of x from i on (16-byte aligned), times the norm's weights where w */
__device__ __forceinline__ float4 rt_x4(const float *x, const float *w, int i)
{
    float4 v = *reinterpret_cast<const float4 *>(x);
    if (w) {
        const float4 n = *reinterpret_cast<const float4 *>(w + i);
        v.x *= n.x, v.y *= n.y, v.z *= n.z, v.w *= n.w;
    }
    return v;
}

/* Block (e, token tile): the router row e (F32) against up to 8 tokens; the row is read
 * once a block, each thread a strided share of it, then a block sum per token. Where the
 * row, x and its stride allow (vec), a thread's share is 16-byte pieces at a 512-element
 * stride, four of them loaded before any is used: for Qwen3-30B-A3B's 2048-wide rows that
 * is the whole share in flight at once, where 4-byte loads took 16 dependent trips a
 * thread (8.7 us of a decode step's layer for 1 MB, BENCHMARKS.md). */
__global__ __launch_bounds__(RT_THREADS) void router_logits_kernel(const float *__restrict__ wr,
                                                                   const float *__restrict__ bias, int n_expert,
                                                                   int dim, const float *__restrict__ x,
                                                                   int64_t x_stride, int n_tokens,
                                                                   float *__restrict__ logits, int vec,
                                                                   rt_norm nrm)
{
    __shared__ float part[RT_TOK][RT_THREADS / 32];
    __shared__ float sq[RT_TOK][RT_THREADS / 32]; /* nrm.ss's sums (10a') */
    const int e = blockIdx.x, t0 = blockIdx.y * RT_TOK, nt = min(RT_TOK, n_tokens - t0);
    const float *row = wr + (size_t)e * dim;
    const float *xt = x + (size_t)t0 * x_stride;
    float acc[RT_TOK];
#pragma unroll
    for (int t = 0; t < RT_TOK; t++)
        acc[t] = 0.0f;
    /* the PDL-launched top-k after it is scheduled now, its blocks waiting for this grid
     * (this kernel itself is launched plainly: with PDL and its rows loaded before the
     * wait, the step was no faster, and slower at batch 4, BENCHMARKS.md) */
    m40k_grid_launch_dependents();
    if (vec) {
        constexpr int U = 4, STEP = 4 * RT_THREADS;
        int i = 4 * threadIdx.x;
        for (; i + (U - 1) * STEP < dim; i += U * STEP) {
            float4 w[U];
#pragma unroll
            for (int u = 0; u < U; u++)
                w[u] = __ldg(reinterpret_cast<const float4 *>(row + i + u * STEP));
#pragma unroll
            for (int t = 0; t < RT_TOK; t++)
                if (t < nt)
#pragma unroll
                    for (int u = 0; u < U; u++) {
                        const float4 v = rt_x4(xt + (size_t)t * x_stride + i + u * STEP, nrm.w, i + u * STEP);
                        acc[t] = fmaf(w[u].w, v.w, fmaf(w[u].z, v.z, fmaf(w[u].y, v.y, fmaf(w[u].x, v.x, acc[t]))));
                    }
        }
        for (; i < dim; i += STEP) {
            const float4 w = __ldg(reinterpret_cast<const float4 *>(row + i));
#pragma unroll
            for (int t = 0; t < RT_TOK; t++)
                if (t < nt) {
                    const float4 v = rt_x4(xt + (size_t)t * x_stride + i, nrm.w, i);
                    acc[t] = fmaf(w.w, v.w, fmaf(w.z, v.z, fmaf(w.y, v.y, fmaf(w.x, v.x, acc[t]))));
                }
        }
    } else {
        for (int i = threadIdx.x; i < dim; i += RT_THREADS) {
            const float w = __ldg(row + i);
#pragma unroll
            for (int t = 0; t < RT_TOK; t++)
                if (t < nt)
                    acc[t] = fmaf(w, nrm.w ? xt[(size_t)t * x_stride + i] * nrm.w[i] : xt[(size_t)t * x_stride + i],
                                  acc[t]);
        }
    }
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
#pragma unroll
    for (int t = 0; t < RT_TOK; t++) {
        const float v = m40k_warp_sum(acc[t]);
        if (lane == 0)
            part[t][warp] = v;
    }
    if (nrm.ss) /* each token's sums of squares, every block in the same order */
        for (int t = 0; t < nt; t++) {
            const float *sst = nrm.ss + (size_t)(t0 + t) * (dim / 32);
            float v = 0.0f;
            for (int i = threadIdx.x; i < dim / 32; i += RT_THREADS)
                v += sst[i];
            v = m40k_warp_sum(v);
            if (lane == 0)
                sq[t][warp] = v;
        }
    __syncthreads();
    if (threadIdx.x < nt) {
        float v = 0.0f, q = 0.0f;
        for (int w = 0; w < RT_THREADS / 32; w++)
            v += part[threadIdx.x][w];
        if (nrm.ss) {
            for (int w = 0; w < RT_THREADS / 32; w++)
                q += sq[threadIdx.x][w];
            v *= rsqrtf(q / (float)dim + nrm.eps);
        }
        logits[(size_t)(t0 + threadIdx.x) * n_expert + e] = v + (bias ? bias[e] : 0.0f);
    }
}

extern "C" int m40k_moe_router_logits(const float *wr, const float *bias, int n_expert, int dim, const float *x,
                                      int64_t x_stride, int n_tokens, float *logits, m40k_stream stream)
{
    return m40k_moe_router_logits_normed(wr, bias, n_expert, dim, x, x_stride, nullptr, nullptr, 0.0f, n_tokens,
                                         logits, stream);
}

extern "C" int m40k_moe_router_logits_normed(const float *wr, const float *bias, int n_expert, int dim, const float *x,
                                             int64_t x_stride, const float *norm_w, const float *ss, float eps,
                                             int n_tokens, float *logits, m40k_stream stream)
{
    if (n_tokens <= 0 || n_expert <= 0)
        return n_tokens < 0 || n_expert < 0 ? M40K_INVALID : 0;
    if (dim <= 0 || (n_tokens > 1 && x_stride < dim) || (n_tokens + RT_TOK - 1) / RT_TOK > 65535)
        return M40K_INVALID;
    if (!norm_w != !ss || (ss && (dim % 32 || !(eps >= 0.0f))))
        return M40K_INVALID;
    const int vec = dim % 4 == 0 && (n_tokens == 1 || x_stride % 4 == 0) && ((uintptr_t)wr & 15) == 0 &&
                    ((uintptr_t)x & 15) == 0 && ((uintptr_t)norm_w & 15) == 0;
    const dim3 grid((unsigned)n_expert, (unsigned)((n_tokens + RT_TOK - 1) / RT_TOK));
    router_logits_kernel<<<grid, RT_THREADS, 0, (cudaStream_t)stream>>>(wr, bias, n_expert, dim, x, x_stride, n_tokens,
                                                                        logits, vec, rt_norm{norm_w, ss, eps});
    return m40k_launch_status();
}

/* Top-k by rank, a thread block a token. It sits on the critical path of a decode step
 * (once a layer, between the router and the expert GEMVs), so it is built for latency:
 * an expert's place among the chosen is the number of experts before it in the order
 * (score descending, then id ascending), which four threads an expert count at once over
 * a quarter of the others each, on one 64-bit key per expert (the order-preserving bits
 * of the score above the complement of the id: one compare a pair); the k rounds of a
 * warp argmax this replaced were a chain of ~50 dependent shuffles (qwen3-30b-a3b, one
 * token: 6.05 -> 5.3-5.7 us under Nsight Compute, BENCHMARKS.md). The weights come from
 * one warp. */
#define MOE_ROUTE_MAX_E 256 /* experts a token can have (m40k_moe_topk refuses more) */
#define MOE_ROUTE_MAX_K 8

struct moe_route_sm {
    unsigned long long key[MOE_ROUTE_MAX_E]; /* larger key: chosen first */
    float l[MOE_ROUTE_MAX_E]; /* the value the weight comes from: the logit, or sigmoid's p */
    int id[MOE_ROUTE_MAX_K];  /* choice j's expert, in order of choice */
    float w[MOE_ROUTE_MAX_K]; /* its weight (times scale) */
};

/* Float bits whose unsigned order is the float's order (-0 taken as +0: they tie). */
__device__ __forceinline__ unsigned int moe_route_ordered(float f)
{
    const unsigned int u = __float_as_uint(f == 0.0f ? 0.0f : f);
    return u & 0x80000000u ? ~u : u | 0x80000000u;
}

/* Every thread of the block calls it (it synchronizes the block; blockDim.x a multiple
 * of 32). lg: the token's n_expert logits (n_expert <= 256, 1 <= k <= 8, k <= n_expert); on
 * return sm.id[0..k) holds the choices in order and sm.w[0..k) their weights, as
 * kernels.h 10b says. NaN logits and scores count as -inf. */
__device__ __forceinline__ void moe_route_block(const float *lg, int n_expert, int k, int gating,
                                                const float *sel_bias, int norm, float scale, moe_route_sm &sm)
{
    const int tid = threadIdx.x, nt = blockDim.x, lane = tid & 31, warp = tid >> 5;
    for (int e = tid; e < n_expert; e += nt) {
        float l = lg[e], sc;
        if (l != l)
            l = -INFINITY; /* NaN: never before a number */
        sc = l;
        if (gating == M40K_MOE_SIGMOID) {
            const float pr = 1.0f / (1.0f + expf(-l));
            sc = pr + (sel_bias ? sel_bias[e] : 0.0f);
            if (sc != sc)
                sc = -INFINITY;
            l = pr; /* the weight */
        }
        sm.key[e] = (unsigned long long)moe_route_ordered(sc) << 32 | (0xffffffffu - (unsigned int)e);
        sm.l[e] = l;
    }
    __syncthreads();
    /* rank: item 4e + q counts the experts i = q mod 4 that come before e (the four
     * quarters' reads at a step are adjacent keys: no bank conflict); whole warps run every
     * round (n_expert rounded up to 8), so the quarters meet by shuffles */
    const int items = 4 * ((n_expert + 7) / 8 * 8);
    for (int it = tid; it < items; it += nt) {
        const int e = it >> 2, q = it & 3;
        int c = 0;
        if (e < n_expert) {
            const unsigned long long ke = sm.key[e];
#pragma unroll 4
            for (int i = q; i < n_expert; i += 4)
                c += sm.key[i] > ke;
        }
        c += __shfl_xor_sync(0xffffffffu, c, 1);
        c += __shfl_xor_sync(0xffffffffu, c, 2);
        if (q == 0 && e < n_expert && c < k)
            sm.id[c] = e;
    }
    __syncthreads();
    /* softmax over all: its maximum is the first choice's logit; the sum of exp over every
     * expert by one warp, e = lane + 32 i in order and then across the warp (the same sum
     * whatever the block's size) */
    if (warp == 0) {
        float den = 1.0f, mx = -INFINITY;
        if (gating == M40K_MOE_SOFTMAX) {
            mx = sm.l[sm.id[0]];
            float s = 0.0f;
            for (int e = lane; e < n_expert; e += 32)
                s += expf(sm.l[e] == mx ? 0.0f : sm.l[e] - mx); /* all -inf: equal weights, not NaN */
            den = m40k_warp_sum(s);
        }
        const float my_val = lane < k ? sm.l[sm.id[lane]] : 0.0f;
        float w = 0.0f;
        if (gating == M40K_MOE_SOFTMAX)
            w = expf(my_val == mx ? 0.0f : my_val - mx) / den;
        else if (gating == M40K_MOE_SIGMOID)
            w = my_val;
        else { /* softmax over the k chosen logits; the first chosen is their maximum */
            const float m0 = __shfl_sync(0xffffffffu, my_val, 0);
            w = lane < k ? expf(my_val == m0 ? 0.0f : my_val - m0) : 0.0f;
            const float s = m40k_warp_sum(w);
            w = w / s;
        }
        if (lane >= k)
            w = 0.0f;
        if (norm) {
            const float s = m40k_warp_sum(w);
            w = s > 0.0f ? w / s : w;
        }
        if (lane < k)
            sm.w[lane] = w * scale;
    }
    __syncthreads();
}


#define TK_THREADS 512 /* 128 experts: one round of the rank count */

/* A block a token: moe_route_block, then the token's k choices out. */
__global__ __launch_bounds__(TK_THREADS) void topk_kernel(const float *__restrict__ logits, int n_expert, int k,
                                                          int gating, const float *__restrict__ sel_bias, int norm,
                                                          float scale, int32_t *__restrict__ ids,
                                                          float *__restrict__ weights)
{
    __shared__ moe_route_sm sm;
    const size_t t = blockIdx.x;
    m40k_pdl_begin(); /* PDL-launched: waits for the router's logits; the expert GEMVs may follow */
    M40K_LAUNDER(logits);
    M40K_LAUNDER(ids);
    M40K_LAUNDER(weights);
    moe_route_block(logits + t * n_expert, n_expert, k, gating, sel_bias, norm, scale, sm);
    if ((int)threadIdx.x < k) {
        ids[t * k + threadIdx.x] = sm.id[threadIdx.x];
        weights[t * k + threadIdx.x] = sm.w[threadIdx.x];
    }
}

extern "C" int m40k_moe_topk(const float *logits, int n_tokens, int n_expert, int k, int gating,
                             const float *sel_bias, int norm, float scale, int32_t *ids, float *weights,
                             m40k_stream stream)
{
    if (n_tokens <= 0)
        return n_tokens < 0 ? M40K_INVALID : 0;
    if (n_expert < 1 || n_expert > MOE_ROUTE_MAX_E || k < 1 || k > MOE_ROUTE_MAX_K || k > n_expert || gating < 0 ||
        gating > M40K_MOE_SOFTMAX_TOPK)
        return M40K_INVALID;
    /* launched with PDL: scheduled while the router runs, it takes 1.5% off a qwen3-30b-a3b
     * step at batches 1 and 4 (BENCHMARKS.md twenty-ninth session) */
    M40K_LAUNCH_PDL(topk_kernel, n_tokens, TK_THREADS, 0, stream, logits, n_expert, k, gating, sel_bias, norm, scale,
                    ids, weights);
    return m40k_launch_status();
}

/* ------------------------------------------------------------------ expert GEMV */

#define MG_WARPS 4
#define MG_SEG 1024 /* elements of a row a warp stages at a time: whole blocks of every type */

template <int T> struct mg_cfg {
    typedef m40k_tinfo<T> ti;
    /* 16-byte chunks a lane holds for one row's segment (one more for a misaligned start);
     * RPW: output rows a warp of the gate/up kernel (2 rows each), NR: experts at a time
     * a warp of the down kernel. Where a segment is at most 2 chunks a lane (the 4- to
     * 6-bit types), 4 rows are in flight a warp: 8 loads of 16 bytes a lane. */
    enum {
        SEGB = MG_SEG / ti::BE * ti::BB,
        CH = ((SEGB + 15) / 16 + 1 + 31) / 32,
        RPW = CH <= 2 ? 2 : 1,
        NR = CH <= 2 ? 4 : 2
    };
};

/* The dot products of NR rows (rows[r], K elements of type T, any alignment) with
 * xs[r] (F32, 16-byte aligned) by one warp, returned in every lane. The segments of all
 * NR rows are loaded together with 16-byte streaming loads (NR * CH in flight a lane),
 * staged in the warp's buffer buf (NR * CH * 512 bytes) and decoded from there by
 * m40k_group8: lane l takes the 8 elements 8l + 256i, scaled once a group. A row that is
 * NULL is skipped (0). */
template <int T, int NR>
__device__ __forceinline__ void mg_warp_dot(const uint8_t *const (&rows)[NR], const float *const (&xs)[NR], int K,
                                            uint8_t *buf, float (&out)[NR])
{
    constexpr int CH = mg_cfg<T>::CH, SEGB = mg_cfg<T>::SEGB;
    const int lane = threadIdx.x & 31;
    const int nseg = (K + MG_SEG - 1) / MG_SEG;
    uint4 r[NR][CH];
    auto fetch = [&](int sg) {
        const int elems = min(MG_SEG, K - sg * MG_SEG);
#pragma unroll
        for (int q = 0; q < NR; q++) {
            if (!rows[q])
                continue;
            const uintptr_t b0 = (uintptr_t)(rows[q] + (size_t)sg * SEGB);
            const uintptr_t b1 = b0 + m40k_row_bytes<T>(elems);
            const uint4 *a0 = reinterpret_cast<const uint4 *>(b0 & ~(uintptr_t)15);
            const int nch = (int)((((b1 + 15) & ~(uintptr_t)15) - (b0 & ~(uintptr_t)15)) / 16);
#pragma unroll
            for (int c = 0; c < CH; c++)
                if (lane + 32 * c < nch)
                    r[q][c] = __ldcs(a0 + lane + 32 * c); /* streamed once: evict first */
        }
    };
    float acc[NR];
#pragma unroll
    for (int q = 0; q < NR; q++)
        acc[q] = 0.0f;
    fetch(0);
    for (int sg = 0; sg < nseg; sg++) {
#pragma unroll
        for (int q = 0; q < NR; q++)
#pragma unroll
            for (int c = 0; c < CH; c++)
                reinterpret_cast<uint4 *>(buf + q * CH * 512)[lane + 32 * c] = r[q][c];
        __syncwarp();
        if (sg + 1 < nseg)
            fetch(sg + 1);
        const int elems = min(MG_SEG, K - sg * MG_SEG);
#pragma unroll
        for (int q = 0; q < NR; q++) {
            if (!rows[q])
                continue;
            const int off = (int)((uintptr_t)(rows[q] + (size_t)sg * SEGB) & 15);
            const uint8_t *p = buf + q * CH * 512 + off;
            const float *x = xs[q] + (size_t)sg * MG_SEG;
#pragma unroll
            for (int i = 0; i < MG_SEG / 256; i++) {
                const int e0 = 8 * lane + 256 * i;
                if (e0 < elems) {
                    float v[8], s, o;
                    m40k_group8<T>(p, e0, v, s, o);
                    const float4 xa = __ldca(reinterpret_cast<const float4 *>(x + e0));
                    const float4 xb = __ldca(reinterpret_cast<const float4 *>(x + e0 + 4));
                    const float d = m40k_dot8(v, xa, xb);
                    if (T == M40K_TYPE_F16 || T == M40K_TYPE_BF16 || T == M40K_TYPE_MXFP4 ||
                        T == M40K_TYPE_MXFP4_P) {
                        acc[q] = fmaf(s, d, acc[q]); /* no offset */
                    } else {
                        const float sx = m40k_sum8(xa, xb);
                        acc[q] += fmaf(s, d, -o * sx);
                    }
                }
            }
        }
        __syncwarp();
    }
#pragma unroll
    for (int q = 0; q < NR; q++)
        out[q] = m40k_warp_sum(acc[q]);
}

/* Warp (rows n .. n+RPW-1, pair p = blockIdx.y): gate row and up row of expert ids[p]
 * for each. */
template <int T>
__global__ __launch_bounds__(MG_WARPS * 32) void moe_gate_up_kernel(
    const uint8_t *__restrict__ wg, const uint8_t *__restrict__ wu, size_t row_bytes, int n_expert, int n_ff, int dim,
    const float *__restrict__ gate_b, const float *__restrict__ up_b, int act, const float *__restrict__ x,
    int64_t x_stride, const int32_t *__restrict__ ids, int k, float *__restrict__ h, int64_t h_stride)
{
    constexpr int CH = mg_cfg<T>::CH, RPW = mg_cfg<T>::RPW;
    __shared__ __align__(16) uint8_t sbuf[MG_WARPS][2 * RPW * CH * 512];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int n0 = (blockIdx.x * MG_WARPS + warp) * RPW, p = blockIdx.y;
    if (n0 >= n_ff)
        return; /* no block-wide barrier below */
    const int e = ids[p];
    float *hp = h + (size_t)p * h_stride;
    if (e < 0 || e >= n_expert) {
        if (lane < RPW && n0 + lane < n_ff)
            hp[n0 + lane] = 0.0f;
        return;
    }
    const float *xt = x + (size_t)(p / k) * x_stride;
    const uint8_t *rows[2 * RPW];
    const float *xs[2 * RPW];
#pragma unroll
    for (int r = 0; r < RPW; r++) {
        const bool in = n0 + r < n_ff;
        const size_t ro = ((size_t)e * n_ff + n0 + r) * row_bytes;
        rows[2 * r] = in ? wg + ro : nullptr;
        rows[2 * r + 1] = in ? wu + ro : nullptr;
        xs[2 * r] = xs[2 * r + 1] = xt;
    }
    float d[2 * RPW];
    mg_warp_dot<T, 2 * RPW>(rows, xs, dim, sbuf[warp], d);
    if (lane == 0)
#pragma unroll
        for (int r = 0; r < RPW; r++)
            if (n0 + r < n_ff) {
                const size_t bi = (size_t)e * n_ff + n0 + r;
                hp[n0 + r] = moe_act(act, d[2 * r] + (gate_b ? gate_b[bi] : 0.0f), d[2 * r + 1] + (up_b ? up_b[bi] : 0.0f));
            }
}

/* Warp (row n, token t = blockIdx.y): row n of the k experts of t, NR at a time, each
 * against its own h row; the weighted sum in order j = 0..k-1. */
template <int T>
__global__ __launch_bounds__(MG_WARPS * 32) void moe_down_kernel(const uint8_t *__restrict__ wd, size_t row_bytes,
                                                                 int n_expert, int dim, int n_ff,
                                                                 const float *__restrict__ down_b,
                                                                 const float *__restrict__ h, int64_t h_stride,
                                                                 const int32_t *__restrict__ ids,
                                                                 const float *__restrict__ weights, int k,
                                                                 float *__restrict__ out, int64_t out_stride,
                                                                 int accumulate)
{
    constexpr int CH = mg_cfg<T>::CH, NR = mg_cfg<T>::NR;
    __shared__ __align__(16) uint8_t sbuf[MG_WARPS][NR * CH * 512];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int n = blockIdx.x * MG_WARPS + warp, t = blockIdx.y;
    if (n >= dim)
        return;
    float sum = 0.0f;
    for (int j = 0; j < k; j += NR) {
        const uint8_t *rows[NR];
        const float *xs[NR];
        int ee[NR];
#pragma unroll
        for (int q = 0; q < NR; q++) {
            rows[q] = nullptr, xs[q] = nullptr, ee[q] = -1;
            const int jj = j + q;
            if (jj < k) {
                const int e = ids[(size_t)t * k + jj];
                if (e >= 0 && e < n_expert) {
                    ee[q] = e;
                    rows[q] = wd + ((size_t)e * dim + n) * row_bytes;
                    xs[q] = h + ((size_t)t * k + jj) * h_stride;
                }
            }
        }
        float d[NR];
        mg_warp_dot<T, NR>(rows, xs, n_ff, sbuf[warp], d);
#pragma unroll
        for (int q = 0; q < NR; q++)
            if (ee[q] >= 0)
                sum += weights[(size_t)t * k + j + q] *
                       (d[q] + (down_b ? down_b[(size_t)ee[q] * dim + n] : 0.0f));
    }
    if (lane == 0) {
        float *o = out + (size_t)t * out_stride + n;
        *o = accumulate ? *o + sum : sum;
    }
}

/* ---- the fast expert GEMV: gemv.cu's fast path (gemv_fast_dev.h) with the rows a warp
 * takes found through ids[]. A warp keeps MF_R = 4 rows in flight (gate and up of two
 * output rows; or one output row of 4 experts), the work a warp does being a sequence of
 * (round, segment) units whose loads go out one unit ahead: the next round's rows load
 * while this one's last segment is summed. Types: F16, BF16, Q8_0, Q4_0, Q4_K, Q6_K,
 * Q6_K_P, MXFP4, MXFP4_P (rows 16-byte aligned for F16, BF16, Q4_K and the padded layouts;
 * any row for the others). */
#define MF_R 4

template <int T> struct mf_dims {
    typedef m40k_tinfo<T> ti;
    enum {
        SEG = gf_cfg<T>::SEG,
        SEGB = SEG / ti::BE * ti::BB,
        NCH = (SEGB + 15) / 16 + 1, /* one more for a row that starts mid-chunk */
        CH = (NCH + 31) / 32,
        SMB = CH * 512 + 16,
        NSC = gf_cfg<T>::NSC > 0 ? gf_cfg<T>::NSC : 1,
    };
};

/* rows(round, q): row q of a round (NULL: none); xs(round, q): its x (F32, 16-byte
 * aligned; SHARED_X: every row's is xs(round, 0), loaded once); end(round, d): d[q] = row
 * q's dot product, in every lane; ready(): called once the first unit's weight loads are
 * out, before any x is read (the PDL wait). */
template <int T, bool SHARED_X, class RowF, class XF, class EndF, class ReadyF>
__device__ __forceinline__ void mf_warp(int rounds, int K, RowF rows, XF xs, EndF end, ReadyF ready,
                                        uint8_t (&sb)[MF_R][mf_dims<T>::SMB], float2 (&ssc)[MF_R][mf_dims<T>::NSC])
{
    typedef mf_dims<T> D;
    constexpr int SEG = D::SEG, SEGB = D::SEGB, CH = D::CH;
    const int lane = threadIdx.x & 31;
    const int nseg = (K + SEG - 1) / SEG, units = rounds * nseg;
    uint4 rg[MF_R][CH];
    auto fetch = [&](int u) {
        const int rd = u / nseg, sg = u % nseg;
        const int elems = min(SEG, K - sg * SEG);
#pragma unroll
        for (int q = 0; q < MF_R; q++) {
            const uint8_t *rp = rows(rd, q);
            if (!rp)
                continue;
            const uintptr_t b0 = (uintptr_t)(rp + (size_t)sg * SEGB), b1 = b0 + m40k_row_bytes<T>(elems);
            const uint4 *a0 = reinterpret_cast<const uint4 *>(b0 & ~(uintptr_t)15);
            const int nch = (int)((((b1 + 15) & ~(uintptr_t)15) - (b0 & ~(uintptr_t)15)) / 16);
#pragma unroll
            for (int c = 0; c < CH; c++)
                if (lane + 32 * c < nch)
                    rg[q][c] = __ldcs(a0 + lane + 32 * c);
        }
    };
    float acc[MF_R];
#pragma unroll
    for (int q = 0; q < MF_R; q++)
        acc[q] = 0.0f;
    if (units > 0)
        fetch(0);
    ready();
    for (int u = 0; u < units; u++) {
        const int rd = u / nseg, sg = u % nseg;
#pragma unroll
        for (int q = 0; q < MF_R; q++)
#pragma unroll
            for (int c = 0; c < CH; c++)
                reinterpret_cast<uint4 *>(sb[q])[lane + 32 * c] = rg[q][c];
        __syncwarp();
        if (u + 1 < units)
            fetch(u + 1);
        int off[MF_R];
#pragma unroll
        for (int q = 0; q < MF_R; q++) {
            const uint8_t *rp = rows(rd, q);
            off[q] = rp ? (int)((uintptr_t)(rp + (size_t)sg * SEGB) & 15) : 0;
        }
        if (gf_cfg<T>::NSC > 0) {
#pragma unroll
            for (int q = 0; q < MF_R; q++)
                if (rows(rd, q))
                    gf_scales<T>(sb[q], off[q], ssc[q], lane);
            __syncwarp();
        }
        const int elems = min(SEG, K - sg * SEG);
#pragma unroll
        for (int i = 0; i < SEG / 256; i++) {
            const int e0 = 8 * lane + 256 * i;
            if (e0 < elems) {
                float4 sxa = make_float4(0, 0, 0, 0), sxb = sxa;
                float ssx = 0.0f;
                int oa, ob;
                gf_xoff<T>(lane, i, oa, ob);
                if (SHARED_X) {
                    const float *xe = xs(rd, 0) + (size_t)sg * SEG;
                    sxa = __ldca(reinterpret_cast<const float4 *>(xe + oa));
                    sxb = __ldca(reinterpret_cast<const float4 *>(xe + ob));
                    ssx = ((sxa.x + sxa.y) + (sxa.z + sxa.w)) + ((sxb.x + sxb.y) + (sxb.z + sxb.w));
                }
#pragma unroll
                for (int q = 0; q < MF_R; q++) {
                    if (!rows(rd, q))
                        continue;
                    float f[8], A, C;
                    gf_group<T>(sb[q], off[q], ssc[q], lane, i, f, A, C);
                    float4 xa = sxa, xb = sxb;
                    if (!SHARED_X) {
                        const float *xe = xs(rd, q) + (size_t)sg * SEG;
                        xa = __ldca(reinterpret_cast<const float4 *>(xe + oa));
                        xb = __ldca(reinterpret_cast<const float4 *>(xe + ob));
                    }
                    const float t = m40k_dot8(f, xa, xb);
                    if (T == M40K_TYPE_F16 || T == M40K_TYPE_BF16) {
                        acc[q] += t;
                    } else {
                        const float sx =
                            SHARED_X ? ssx : m40k_sum8(xa, xb);
                        acc[q] = fmaf(A, t, fmaf(C, sx, acc[q]));
                    }
                }
            }
        }
        __syncwarp();
        if (sg == nseg - 1) {
            float d[MF_R];
#pragma unroll
            for (int q = 0; q < MF_R; q++) {
                d[q] = m40k_warp_sum(acc[q]);
                acc[q] = 0.0f;
            }
            end(rd, d);
        }
    }
}

template <int T>
__global__ __launch_bounds__(MG_WARPS * 32) void moe_gate_up_fast_kernel(
    const uint8_t *__restrict__ wg, const uint8_t *__restrict__ wu, size_t row_bytes, int n_expert, int n_ff, int dim,
    const float *__restrict__ gate_b, const float *__restrict__ up_b, int act, const float *__restrict__ x,
    int64_t x_stride, const int32_t *__restrict__ ids, int k, float *__restrict__ h, int64_t h_stride)
{
    typedef mf_dims<T> D;
    __shared__ __align__(16) uint8_t sbuf[MG_WARPS][MF_R][D::SMB];
    __shared__ __align__(16) float2 ssc[MG_WARPS][MF_R][D::NSC];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int n0 = (blockIdx.x * MG_WARPS + warp) * 2, p = blockIdx.y;
    /* PDL: the routing (the kernel before) is complete and visible before anything is
     * read; only then may the down projection after this kernel start (it reads ids
     * before its own wait) */
    m40k_grid_wait();
    m40k_grid_launch_dependents();
    if (n0 >= n_ff)
        return;
    const int e = ids[p];
    float *hp = h + (size_t)p * h_stride;
    if (e < 0 || e >= n_expert) {
        if (lane < 2 && n0 + lane < n_ff)
            hp[n0 + lane] = 0.0f;
        return;
    }
    const float *xt = x + (size_t)(p / k) * x_stride;
    const uint8_t *base[2] = {wg + ((size_t)e * n_ff + n0) * row_bytes, wu + ((size_t)e * n_ff + n0) * row_bytes};
    const bool two = n0 + 1 < n_ff;
    mf_warp<T, true>(
        1, dim,
        [&](int, int q) -> const uint8_t * { return q < 2 || two ? base[q & 1] + (q >> 1) * row_bytes : nullptr; },
        [&](int, int) { return xt; },
        [&](int, const float(&d)[MF_R]) {
            if (lane == 0)
                for (int r = 0; r < (two ? 2 : 1); r++) {
                    const size_t bi = (size_t)e * n_ff + n0 + r;
                    hp[n0 + r] = moe_act(act, d[2 * r] + (gate_b ? gate_b[bi] : 0.0f),
                                         d[2 * r + 1] + (up_b ? up_b[bi] : 0.0f));
                }
        },
        [] {}, sbuf[warp], ssc[warp]);
}

template <int T>
__global__ __launch_bounds__(MG_WARPS * 32) void moe_down_fast_kernel(const uint8_t *__restrict__ wd, size_t row_bytes,
                                                                      int n_expert, int dim, int n_ff,
                                                                      const float *__restrict__ down_b,
                                                                      const float *__restrict__ h, int64_t h_stride,
                                                                      const int32_t *__restrict__ ids,
                                                                      const float *__restrict__ weights, int k,
                                                                      float *__restrict__ out, int64_t out_stride,
                                                                      int accumulate)
{
    typedef mf_dims<T> D;
    __shared__ __align__(16) uint8_t sbuf[MG_WARPS][MF_R][D::SMB];
    __shared__ __align__(16) float2 ssc[MG_WARPS][MF_R][D::NSC];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int n = blockIdx.x * MG_WARPS + warp, t = blockIdx.y;
    m40k_grid_launch_dependents();
    if (n >= dim) {
        m40k_grid_wait();
        return;
    }
    /* ids are read before the PDL wait (kernels.h 10d: not the previous kernel's output),
     * so that the first experts' rows load while the gate/up kernel finishes */
    int ee[8];
#pragma unroll
    for (int j = 0; j < 8; j++) {
        const int e = j < k ? ids[(size_t)t * k + j] : -1;
        ee[j] = e >= 0 && e < n_expert ? e : -1;
    }
    float sum = 0.0f;
    mf_warp<T, false>(
        (k + MF_R - 1) / MF_R, n_ff,
        [&](int rd, int q) -> const uint8_t * {
            const int j = rd * MF_R + q;
            return j < k && ee[j] >= 0 ? wd + ((size_t)ee[j] * dim + n) * row_bytes : nullptr;
        },
        [&](int rd, int q) { return h + ((size_t)t * k + rd * MF_R + q) * h_stride; },
        [&](int rd, const float(&d)[MF_R]) {
#pragma unroll
            for (int q = 0; q < MF_R; q++) {
                const int j = rd * MF_R + q;
                if (j < k && ee[j] >= 0)
                    sum += weights[(size_t)t * k + j] * (d[q] + (down_b ? down_b[(size_t)ee[j] * dim + n] : 0.0f));
            }
        },
        [] { m40k_grid_wait(); }, sbuf[warp], ssc[warp]);
    if (lane == 0) {
        float *o = out + (size_t)t * out_stride + n;
        *o = accumulate ? *o + sum : sum;
    }
}

/* The types the fast kernels are built for (gemv_fast_dev.h's decode), and those of them
 * that read a row from byte 0 of its staged segment (rows 16-byte aligned). */
template <int T> static constexpr bool mf_typed()
{
    return T == M40K_TYPE_F16 || T == M40K_TYPE_BF16 || T == M40K_TYPE_Q8_0 || T == M40K_TYPE_Q4_0 ||
           T == M40K_TYPE_Q4_K || T == M40K_TYPE_Q6_K || T == M40K_TYPE_Q6_K_P || T == M40K_TYPE_MXFP4 ||
           T == M40K_TYPE_MXFP4_P;
}
template <int T> static constexpr bool mf_aligned_rows()
{
    return T == M40K_TYPE_F16 || T == M40K_TYPE_BF16 || T == M40K_TYPE_Q4_K || T == M40K_TYPE_Q6_K_P ||
           T == M40K_TYPE_MXFP4_P;
}

/* The fast kernels take the type where its rows allow. */
template <int T> static bool mf_takes(const void *w, size_t row_bytes)
{
    if (!mf_typed<T>() || ((uintptr_t)w & 15))
        return false;
    return !mf_aligned_rows<T>() || row_bytes % 16 == 0;
}

/* The types the expert GEMV reads: one list for both entries. */
#define MG_TYPES(X)                                                                                                    \
    X(M40K_TYPE_F16, 8)                                                                                                \
    X(M40K_TYPE_BF16, 8)                                                                                               \
    X(M40K_TYPE_Q8_0, 32)                                                                                              \
    X(M40K_TYPE_Q4_0, 32)                                                                                              \
    X(M40K_TYPE_Q4_1, 32)                                                                                              \
    X(M40K_TYPE_Q5_0, 32)                                                                                              \
    X(M40K_TYPE_Q5_1, 32)                                                                                              \
    X(M40K_TYPE_Q2_K, 256)                                                                                             \
    X(M40K_TYPE_Q3_K, 256)                                                                                             \
    X(M40K_TYPE_Q4_K, 256)                                                                                             \
    X(M40K_TYPE_Q5_K, 256)                                                                                             \
    X(M40K_TYPE_Q6_K, 256)                                                                                             \
    X(M40K_TYPE_Q6_K_P, 256)                                                                                           \
    X(M40K_TYPE_MXFP4, 32)                                                                                             \
    X(M40K_TYPE_MXFP4_P, 32)

/* Launches of the fast kernels (only instantiated for their types). */
template <int T>
static int mg_fast_gate_up(const void *wg, const void *wu, int n_expert, int n_ff, int dim, const float *gb,
                            const float *ub, int act, const float *x, int64_t xs, const int32_t *ids, int n_tokens,
                            int k, float *h, int64_t hs, cudaStream_t st)
{
    if constexpr (mf_typed<T>()) {
        const size_t rb = m40k_row_bytes<T>(dim);
        const dim3 grid((unsigned)((n_ff + 2 * MG_WARPS - 1) / (2 * MG_WARPS)), (unsigned)(n_tokens * k));
        return m40k_launch_pdl(moe_gate_up_fast_kernel<T>, grid, dim3(MG_WARPS * 32), st, (const uint8_t *)wg,
                               (const uint8_t *)wu, rb, n_expert, n_ff, dim, gb, ub, act, x, xs, ids, k, h, hs);
    }
    return M40K_INVALID;
}
template <int T>
static int mg_fast_down(const void *wd, int n_expert, int dim, int n_ff, const float *db, const float *h, int64_t hs,
                         const int32_t *ids, const float *w, int n_tokens, int k, float *out, int64_t os, int acc,
                         cudaStream_t st)
{
    if constexpr (mf_typed<T>()) {
        const size_t rb = m40k_row_bytes<T>(n_ff);
        const dim3 grid((unsigned)((dim + MG_WARPS - 1) / MG_WARPS), (unsigned)n_tokens);
        return m40k_launch_pdl(moe_down_fast_kernel<T>, grid, dim3(MG_WARPS * 32), st, (const uint8_t *)wd, rb,
                               n_expert, dim, n_ff, db, h, hs, ids, w, k, out, os, acc);
    }
    return M40K_INVALID;
}

extern "C" int m40k_moe_gate_up(const void *w_gate, const void *w_up, int w_type, int n_expert, int n_ff, int dim,
                                const float *gate_b, const float *up_b, int act, const float *x, int64_t x_stride,
                                const int32_t *ids, int n_tokens, int k, float *h, int64_t h_stride,
                                m40k_stream stream)
{
    if (n_tokens <= 0 || n_ff <= 0)
        return n_tokens < 0 || n_ff < 0 ? M40K_INVALID : 0;
    if (n_expert <= 0 || dim <= 0 || k < 1 || k > 8 || ((uintptr_t)x & 15) || x_stride % 4 ||
        (act != M40K_GLU_SILU && act != M40K_GLU_SWIGLU_OAI) || (int64_t)n_tokens * k > 65535)
        return M40K_INVALID;
    cudaStream_t st = (cudaStream_t)stream;
    switch (w_type) {
#define MG_CASE(t, be)                                                                                                 \
    case t:                                                                                                            \
        if (dim % be)                                                                                                  \
            return M40K_INVALID;                                                                                       \
        if (mf_takes<t>(w_gate, m40k_row_bytes<t>(dim)) &&                                                             \
            mf_takes<t>(w_up, m40k_row_bytes<t>(dim))) {                                                               \
            return mg_fast_gate_up<t>(w_gate, w_up, n_expert, n_ff, dim, gate_b, up_b, act, x, x_stride, ids, n_tokens, \
                                      k, h, h_stride, st);                                                             \
        }                                                                                                              \
        moe_gate_up_kernel<t><<<dim3((unsigned)((n_ff + MG_WARPS * mg_cfg<t>::RPW - 1) / (MG_WARPS * mg_cfg<t>::RPW)), \
                                     (unsigned)(n_tokens * k)),                                                        \
                                MG_WARPS * 32, 0, st>>>(                                                               \
            (const uint8_t *)w_gate, (const uint8_t *)w_up, m40k_row_bytes<t>(dim),                                    \
            n_expert, n_ff, dim, gate_b, up_b, act, x, x_stride, ids, k, h, h_stride);                                 \
        return m40k_launch_status();
        MG_TYPES(MG_CASE)
#undef MG_CASE
    default: return M40K_INVALID;
    }
}

extern "C" int m40k_moe_down(const void *w_down, int w_type, int n_expert, int dim, int n_ff, const float *down_b,
                             const float *h, int64_t h_stride, const int32_t *ids, const float *weights, int n_tokens,
                             int k, float *out, int64_t out_stride, int accumulate, m40k_stream stream)
{
    if (n_tokens <= 0 || dim <= 0)
        return n_tokens < 0 || dim < 0 ? M40K_INVALID : 0;
    if (n_expert <= 0 || n_ff <= 0 || k < 1 || k > 8 || ((uintptr_t)h & 15) || h_stride % 4 || n_tokens > 65535)
        return M40K_INVALID;
    const dim3 grid((unsigned)((dim + MG_WARPS - 1) / MG_WARPS), (unsigned)n_tokens);
    cudaStream_t st = (cudaStream_t)stream;
    switch (w_type) {
#define MG_CASE(t, be)                                                                                                 \
    case t:                                                                                                            \
        if (n_ff % be)                                                                                                 \
            return M40K_INVALID;                                                                                       \
        if (mf_takes<t>(w_down, m40k_row_bytes<t>(n_ff))) {                                                            \
            return mg_fast_down<t>(w_down, n_expert, dim, n_ff, down_b, h, h_stride, ids, weights, n_tokens, k, out,  \
                                   out_stride, accumulate, st);                                                        \
        }                                                                                                              \
        moe_down_kernel<t><<<grid, MG_WARPS * 32, 0, st>>>(                                                            \
            (const uint8_t *)w_down, m40k_row_bytes<t>(n_ff), n_expert, dim, n_ff, down_b,                             \
            h, h_stride, ids, weights, k, out, out_stride, accumulate);                                                \
        return m40k_launch_status();
        MG_TYPES(MG_CASE)
#undef MG_CASE
    default: return M40K_INVALID;
    }
}

/* ------------------------------------------------------------------ grouping */

#define GR_THREADS 1024
#define GR_MAX_EXPERT 256

/* One block of 1024 threads. Counts by shared atomics (order-free); the offsets, the tile
 * table and the stable positions from them: pairs are placed 1024 at a time, each pair's
 * rank among the pairs of its warp with the same expert from __match_any_sync, the warps
 * of a chunk ordered through per-warp counts, the chunks in order through a running count
 * per expert. */
__global__ __launch_bounds__(GR_THREADS) void moe_group_kernel(const int32_t *__restrict__ ids, int n_pairs,
                                                               int n_expert, int bm, int max_tiles,
                                                               int32_t *__restrict__ counts,
                                                               int32_t *__restrict__ offsets,
                                                               int32_t *__restrict__ perm, int32_t *__restrict__ inv,
                                                               int32_t *__restrict__ tiles)
{
    __shared__ int cnt[GR_MAX_EXPERT], off[GR_MAX_EXPERT + 1], run[GR_MAX_EXPERT], tstart[GR_MAX_EXPERT + 1];
    __shared__ int wcnt[GR_THREADS / 32][GR_MAX_EXPERT];
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    for (int e = tid; e < n_expert; e += GR_THREADS)
        cnt[e] = 0, run[e] = 0;
    __syncthreads();
    for (int p = tid; p < n_pairs; p += GR_THREADS) {
        const int e = ids[p];
        if (e >= 0 && e < n_expert)
            atomicAdd(&cnt[e], 1);
    }
    __syncthreads();
    if (warp == 0) { /* exclusive scans of the counts and the tiles: 8 experts a lane */
        int c[8], o = 0, ts = 0;
#pragma unroll
        for (int i = 0; i < 8; i++) {
            const int e = 8 * lane + i;
            c[i] = e < n_expert ? cnt[e] : 0;
            o += c[i], ts += (c[i] + bm - 1) / bm;
        }
        int io = o, its = ts; /* inclusive over lanes */
#pragma unroll
        for (int d = 1; d < 32; d <<= 1) {
            const int a = __shfl_up_sync(0xffffffffu, io, d), b = __shfl_up_sync(0xffffffffu, its, d);
            if (lane >= d)
                io += a, its += b;
        }
        if (lane == 31) /* the totals */
            off[n_expert] = io, tstart[n_expert] = its;
        o = io - o, ts = its - ts;
#pragma unroll
        for (int i = 0; i < 8; i++) {
            const int e = 8 * lane + i;
            if (e < n_expert)
                off[e] = o, tstart[e] = ts;
            o += c[i], ts += (c[i] + bm - 1) / bm;
        }
    }
    __syncthreads();
    for (int e = tid; e <= n_expert; e += GR_THREADS) {
        offsets[e] = off[e];
        if (e < n_expert) {
            counts[e] = cnt[e];
            for (int m0 = 0, i = tstart[e]; m0 < cnt[e]; m0 += bm, i++)
                tiles[2 * i] = e, tiles[2 * i + 1] = m0;
        }
    }
    for (int i = tstart[n_expert] + tid; i < max_tiles; i += GR_THREADS)
        tiles[2 * i] = -1, tiles[2 * i + 1] = 0;
    for (int i = off[n_expert] + tid; i < n_pairs; i += GR_THREADS)
        perm[i] = -1;
    const unsigned lt = (1u << lane) - 1u;
    for (int c = 0; c < n_pairs; c += GR_THREADS) {
        for (int i = lane; i < n_expert; i += 32)
            wcnt[warp][i] = 0;
        __syncthreads();
        const int p = c + tid;
        int e = p < n_pairs ? ids[p] : -1;
        if (e < 0 || e >= n_expert)
            e = -1;
        const unsigned peers = __match_any_sync(0xffffffffu, e);
        const int rank = __popc(peers & lt);
        if (e >= 0 && rank == 0)
            wcnt[warp][e] = __popc(peers);
        __syncthreads();
        if (e >= 0) {
            int pos = off[e] + run[e] + rank;
            for (int w = 0; w < warp; w++)
                pos += wcnt[w][e];
            perm[pos] = p;
            inv[p] = pos;
        } else if (p < n_pairs) {
            inv[p] = -1;
        }
        __syncthreads();
        for (int i = tid; i < n_expert; i += GR_THREADS) {
            int s = 0;
            for (int w = 0; w < GR_THREADS / 32; w++)
                s += wcnt[w][i];
            run[i] += s;
        }
        __syncthreads();
    }
}

extern "C" int m40k_moe_group(const int32_t *ids, int n_pairs, int n_expert, int bm, int32_t *counts,
                              int32_t *offsets, int32_t *perm, int32_t *inv, int32_t *tiles, m40k_stream stream)
{
    if (n_expert < 1 || n_expert > GR_MAX_EXPERT || n_pairs < 0 || (bm != 16 && bm != 32 && bm != 64 && bm != 128))
        return M40K_INVALID;
    moe_group_kernel<<<1, GR_THREADS, 0, (cudaStream_t)stream>>>(ids, n_pairs, n_expert, bm,
                                                                 m40k_moe_max_tiles(n_pairs, n_expert, bm), counts,
                                                                 offsets, perm, inv, tiles);
    return m40k_launch_status();
}

/* ------------------------------------------------------------------ gather, activation, combine */

__global__ void moe_gather_kernel(const float *__restrict__ x, int64_t x_stride, int dim,
                                  const int32_t *__restrict__ perm, int k, uint16_t *__restrict__ out16,
                                  int64_t out_stride)
{
    const int i = blockIdx.y, p = perm[i], c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c < dim)
        out16[(size_t)i * out_stride + c] = p >= 0 ? m40k_f2h(x[(size_t)(p / k) * x_stride + c]) : (uint16_t)0;
}

extern "C" int m40k_moe_gather_f16(const float *x, int64_t x_stride, int dim, const int32_t *perm, int n_pairs, int k,
                                   uint16_t *out16, int64_t out_stride, m40k_stream stream)
{
    if (n_pairs <= 0 || dim <= 0)
        return n_pairs < 0 || dim < 0 ? M40K_INVALID : 0;
    if (k < 1 || out_stride < dim)
        return M40K_INVALID;
    if (n_pairs > 65535)
        return M40K_INVALID;
    moe_gather_kernel<<<dim3((unsigned)((dim + 255) / 256), (unsigned)n_pairs), 256, 0, (cudaStream_t)stream>>>(x, x_stride, dim, perm, k, out16, out_stride);
    return m40k_launch_status();
}

__global__ void moe_glu_sorted_kernel(int act, const float *__restrict__ gate, const float *__restrict__ up,
                                      int64_t in_stride, const float *__restrict__ gate_b,
                                      const float *__restrict__ up_b, const int32_t *__restrict__ ids,
                                      const int32_t *__restrict__ perm, int n_ff, uint16_t *__restrict__ out16,
                                      int64_t out_stride)
{
    const int i = blockIdx.y, p = perm[i], n = blockIdx.x * blockDim.x + threadIdx.x;
    if (p < 0 || n >= n_ff)
        return;
    const int e = ids[p];
    const float *g = gate + (size_t)i * in_stride, *u = up + (size_t)i * in_stride;
    {
        const size_t bi = (size_t)e * n_ff + n;
        out16[(size_t)i * out_stride + n] =
            m40k_f2h(moe_act(act, g[n] + (gate_b ? gate_b[bi] : 0.0f), u[n] + (up_b ? up_b[bi] : 0.0f)));
    }
}

extern "C" int m40k_moe_glu_sorted(int act, const float *gate, const float *up, int64_t in_stride,
                                   const float *gate_b, const float *up_b, const int32_t *ids, const int32_t *perm,
                                   int n_pairs, int n_ff, uint16_t *out16, int64_t out_stride, m40k_stream stream)
{
    if (n_pairs <= 0 || n_ff <= 0)
        return n_pairs < 0 || n_ff < 0 ? M40K_INVALID : 0;
    if ((act != M40K_GLU_SILU && act != M40K_GLU_SWIGLU_OAI) || out_stride < n_ff)
        return M40K_INVALID;
    if (n_pairs > 65535)
        return M40K_INVALID;
    moe_glu_sorted_kernel<<<dim3((unsigned)((n_ff + 255) / 256), (unsigned)n_pairs), 256, 0, (cudaStream_t)stream>>>(act, gate, up, in_stride, gate_b, up_b, ids, perm,
                                                                    n_ff, out16, out_stride);
    return m40k_launch_status();
}

__global__ void moe_combine_kernel(const float *__restrict__ y, int64_t ldy, const int32_t *__restrict__ inv,
                                   const int32_t *__restrict__ ids, const float *__restrict__ weights,
                                   const float *__restrict__ down_b, int k, int dim, float *__restrict__ out,
                                   int64_t out_stride, int accumulate)
{
    const int t = blockIdx.y, n = blockIdx.x * blockDim.x + threadIdx.x;
    if (n < dim) {
        float s = 0.0f;
        for (int j = 0; j < k; j++) {
            const int pos = inv[(size_t)t * k + j];
            if (pos < 0)
                continue;
            const int e = ids[(size_t)t * k + j];
            s += weights[(size_t)t * k + j] *
                 (y[(size_t)pos * ldy + n] + (down_b ? down_b[(size_t)e * dim + n] : 0.0f));
        }
        float *o = out + (size_t)t * out_stride + n;
        *o = accumulate ? *o + s : s;
    }
}

extern "C" int m40k_moe_combine(const float *y, int64_t ldy, const int32_t *inv, const int32_t *ids,
                                const float *weights, const float *down_b, int n_expert, int n_tokens, int k, int dim,
                                float *out, int64_t out_stride, int accumulate, m40k_stream stream)
{
    if (n_tokens <= 0 || dim <= 0)
        return n_tokens < 0 || dim < 0 ? M40K_INVALID : 0;
    if (k < 1 || k > 8 || n_expert < 1 || ldy < dim)
        return M40K_INVALID;
    if (n_tokens > 65535)
        return M40K_INVALID;
    moe_combine_kernel<<<dim3((unsigned)((dim + 127) / 128), (unsigned)n_tokens), 128, 0, (cudaStream_t)stream>>>(y, ldy, inv, ids, weights, down_b, k, dim, out,
                                                                  out_stride, accumulate);
    return m40k_launch_status();
}
