/* Greedy sampling helpers: one block per row. Pass 1 finds the max (lowest id on ties)
 * and the log-sum-exp; each of the top_k further passes finds the largest entry that
 * comes after the previous pick in (value descending, id ascending) order, so no list
 * of taken ids is needed. NaN logits are never picked. */
#include "cuda_common.h"

#include <math.h>

#define SAMPLE_THREADS 1024

/* (value, id) a precedes b: larger value, or equal value and smaller id */
__device__ __forceinline__ bool s_before(float va, int ia, float vb, int ib)
{
    return va > vb || (va == vb && ia < ib);
}

/* block-wide best (value, id) among entries strictly after (pv, pi) */
__device__ void s_best_after(const float *l, int n, float pv, int pi, bool bounded, float *sv, int *si, float &bv,
                             int &bi)
{
    bv = -INFINITY;
    bi = -1;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const float v = l[i];
        if (v != v)
            continue;
        if (bounded && !s_before(pv, pi, v, i))
            continue;
        if (bi < 0 || s_before(v, i, bv, bi))
            bv = v, bi = i;
    }
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
        const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        if (oi >= 0 && (bi < 0 || s_before(ov, oi, bv, bi)))
            bv = ov, bi = oi;
    }
    const int w = threadIdx.x >> 5;
    __syncthreads();
    if ((threadIdx.x & 31) == 0)
        sv[w] = bv, si[w] = bi;
    __syncthreads();
    bv = -INFINITY, bi = -1;
    for (int j = 0; j < (int)(blockDim.x >> 5); j++)
        if (si[j] >= 0 && (bi < 0 || s_before(sv[j], si[j], bv, bi)))
            bv = sv[j], bi = si[j];
}

__global__ __launch_bounds__(SAMPLE_THREADS) void sample_greedy_kernel(const float *__restrict__ logits, int64_t stride,
                                                                       int n_vocab, int32_t *token, float *logprob,
                                                                       int top_k, int32_t *top_tokens,
                                                                       float *top_logprobs)
{
    __shared__ float sv[32];
    __shared__ int si[32];
    __shared__ float red[32];
    const float *l = logits + blockIdx.x * stride;
    float bv;
    int bi;
    s_best_after(l, n_vocab, 0.0f, 0, false, sv, si, bv, bi);
    const float mx = bi >= 0 ? bv : 0.0f;
    float sum = 0.0f;
    for (int i = threadIdx.x; i < n_vocab; i += blockDim.x)
        if (l[i] == l[i])
            sum += __expf(l[i] - mx);
    sum = m40k_warp_sum(sum);
    if ((threadIdx.x & 31) == 0)
        red[threadIdx.x >> 5] = sum;
    __syncthreads();
    float total = 0.0f;
    for (int j = 0; j < (int)(blockDim.x >> 5); j++)
        total += red[j];
    const float lse = mx + logf(total);
    if (threadIdx.x == 0) {
        token[blockIdx.x] = bi;
        logprob[blockIdx.x] = bi >= 0 ? bv - lse : -INFINITY;
    }
    float pv = bv;
    int pi = bi;
    for (int j = 0; j < top_k; j++) {
        if (j > 0)
            s_best_after(l, n_vocab, pv, pi, true, sv, si, pv, pi);
        if (threadIdx.x == 0) {
            top_tokens[blockIdx.x * top_k + j] = pi;
            top_logprobs[blockIdx.x * top_k + j] = pi >= 0 ? pv - lse : -INFINITY;
        }
        if (pi < 0)
            pv = -INFINITY; /* nothing left: the rest stay -1 */
    }
}

extern "C" int m40k_sample_greedy(const float *logits, int64_t stride, int rows, int n_vocab, int32_t *token,
                                  float *logprob, int top_k, int32_t *top_tokens, float *top_logprobs,
                                  m40k_stream stream)
{
    if (rows <= 0)
        return 0;
    if (n_vocab <= 0 || top_k < 0 || top_k > 32 || (top_k > 0 && (!top_tokens || !top_logprobs)))
        return M40K_INVALID;
    sample_greedy_kernel<<<rows, SAMPLE_THREADS, 0, stream>>>(logits, stride, n_vocab, token, logprob, top_k,
                                                              top_tokens, top_logprobs);
    return m40k_launch_status();
}
