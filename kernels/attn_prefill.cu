/* Prefill attention over the paged cache: causal, flash-attention-style tiled online
 * softmax on CUDA cores (SIMT; a tensor-core variant is future work).
 *
 * A block owns BM = 16 query rows of one sequence and one KV head; a row is (token,
 * head of the group), so the G query heads sharing a KV head share every K/V tile the
 * block loads. Per KV tile of BN tokens (32, or 16 for head_dim 256): K and V are
 * loaded with 16-byte vectors from their pages into shared memory as F32 (K rows padded
 * against bank conflicts), each thread computes a 2x2 (2x1) block of scores, a warp per
 * 4 rows does the online-softmax update, and each thread accumulates its rows x dims
 * slice of the output in registers. Tiles beyond the last row's position are skipped
 * (causality), so a chunk of n tokens after a prefix of p costs ~n*(p+n/2) work.
 * window > 0 (sliding-window layers): a row at position p sees p-window+1..p only;
 * tiles before the block's first window are skipped. softcap > 0 (Gemma 2): the warp
 * that updates a row's softmax caps its scores (c * tanh(s / c)) as it reads them.
 *
 * Blocks map to (sequence, row tile) by a scan over q_indptr: the grid is sized for the
 * worst case (n_rows*G/BM + n_seqs tiles) and surplus blocks exit. */
#include "cuda_common.h"

#include <math.h>

#define PF_THREADS 128
#define PF_BM 16

template <int D> struct pf_cfg {
    enum { BN = D == 256 ? 16 : 32, KS = D + 1 };
    static constexpr size_t smem = sizeof(float) * ((size_t)PF_BM * D + BN * KS + BN * D + PF_BM * (BN + 1) + 3 * PF_BM);
};

template <int D>
__global__ __launch_bounds__(PF_THREADS) void attn_prefill_kernel(
    float *__restrict__ out, int64_t out_stride, const float *__restrict__ q, int64_t q_stride,
    const int32_t *__restrict__ q_indptr, int n_seqs, const uint16_t *__restrict__ kc, const uint16_t *__restrict__ vc,
    const int32_t *__restrict__ indptr, const int32_t *__restrict__ indices, const int32_t *__restrict__ last_page_len,
    int n_heads, int n_kv_heads, float scale, int window, float softcap, const float *__restrict__ sinks)
{
    constexpr int BN = pf_cfg<D>::BN, KS = pf_cfg<D>::KS;
    extern __shared__ float smem[];
    float *Qs = smem;                 /* [BM][D], pre-scaled */
    float *Ks = Qs + PF_BM * D;       /* [BN][KS] */
    float *Vs = Ks + BN * KS;         /* [BN][D] */
    float *Ss = Vs + BN * D;          /* [BM][BN+1] */
    float *m_s = Ss + PF_BM * (BN + 1), *l_s = m_s + PF_BM, *a_s = l_s + PF_BM;

    const int G = n_heads / n_kv_heads, kvh = blockIdx.y, tid = threadIdx.x;

    /* find (sequence, tile) of this block */
    int s = -1, tile = blockIdx.x;
    for (int i = 0; i < n_seqs; i++) {
        const int nt = ((q_indptr[i + 1] - q_indptr[i]) * G + PF_BM - 1) / PF_BM;
        if (tile < nt) {
            s = i;
            break;
        }
        tile -= nt;
    }
    if (s < 0)
        return;
    const int q0 = q_indptr[s], nq = q_indptr[s + 1] - q0;
    const int page0 = indptr[s], npages = indptr[s + 1] - page0;
    const int len = npages > 0 ? (npages - 1) * M40K_PAGE + last_page_len[s] : 0;
    const int row0 = tile * PF_BM, nrows = min(PF_BM, nq * G - row0);
    /* row r: query token q0 + (row0 + r) / G at position len - nq + (row0 + r) / G, head kvh*G + (row0+r) % G */
    const int first_pos = len - nq + row0 / G, last_pos = len - nq + (row0 + nrows - 1) / G;

    for (int i = tid; i < PF_BM * D; i += PF_THREADS) {
        const int r = i / D, d = i % D;
        float v = 0.0f;
        if (r < nrows) {
            const int row = row0 + r, tok = q0 + row / G, h = kvh * G + row % G;
            v = q[tok * q_stride + (int64_t)h * D + d] * scale;
        }
        Qs[i] = v;
    }
    if (tid < PF_BM)
        m_s[tid] = -INFINITY, l_s[tid] = 0.0f;

    /* output slice: rows ro + 4k (k < 4), dims lane + 32j (j < D/32) */
    constexpr int DJ = D / 32;
    const int lane = tid & 31, ro = tid >> 5;
    float acc[4][DJ];
#pragma unroll
    for (int k = 0; k < 4; k++)
#pragma unroll
        for (int j = 0; j < DJ; j++)
            acc[k][j] = 0.0f;
    /* score slice: rows ty, ty+8; columns tx (and tx+16 when BN = 32) */
    const int ty = tid / 16, tx = tid % 16;

    const int kv_end = min(len, last_pos + 1);
    /* sliding window: tiles wholly before the first row's window are skipped */
    const int kv_begin = window > 0 ? max(0, first_pos - window + 1) / BN * BN : 0;
    for (int kv0 = kv_begin; kv0 < kv_end; kv0 += BN) {
        __syncthreads(); /* previous tile fully consumed */
        for (int i = tid; i < BN * D / 8; i += PF_THREADS) {
            const int n = i / (D / 8), c = i % (D / 8), t = kv0 + n;
            float kf[8], vf[8];
            if (t < kv_end) {
                const int64_t blk = indices[page0 + t / M40K_PAGE];
                const size_t at = (((size_t)blk * n_kv_heads + kvh) * M40K_PAGE + t % M40K_PAGE) * D + 8 * c;
                m40k_unpack_h8(__ldg(reinterpret_cast<const uint4 *>(kc + at)), kf);
                m40k_unpack_h8(__ldg(reinterpret_cast<const uint4 *>(vc + at)), vf);
            } else {
#pragma unroll
                for (int e = 0; e < 8; e++)
                    kf[e] = vf[e] = 0.0f;
            }
#pragma unroll
            for (int e = 0; e < 8; e++) {
                Ks[n * KS + 8 * c + e] = kf[e];
                Vs[n * D + 8 * c + e] = vf[e];
            }
        }
        __syncthreads();
        {
            float s00 = 0, s01 = 0, s10 = 0, s11 = 0;
            const float *qa = Qs + ty * D, *qb = Qs + (ty + 8) * D;
            const float *ka = Ks + tx * KS, *kb = Ks + (tx + 16) * KS;
#pragma unroll 8
            for (int d = 0; d < D; d++) {
                const float a = qa[d], b = qb[d], x = ka[d];
                s00 = fmaf(a, x, s00);
                s10 = fmaf(b, x, s10);
                if (BN == 32) {
                    const float y = kb[d];
                    s01 = fmaf(a, y, s01);
                    s11 = fmaf(b, y, s11);
                }
            }
            const int pa = len - nq + (row0 + ty) / G, pb = len - nq + (row0 + ty + 8) / G;
            const int ta = kv0 + tx, tb = kv0 + tx + 16;
            /* visible: causal, and inside the window when there is one (p - window < t <= p) */
            const int wa = window > 0 ? pa - window : -1, wb = window > 0 ? pb - window : -1;
            Ss[ty * (BN + 1) + tx] = ta <= pa && ta > wa ? s00 : -INFINITY;
            Ss[(ty + 8) * (BN + 1) + tx] = ta <= pb && ta > wb ? s10 : -INFINITY;
            if (BN == 32) {
                Ss[ty * (BN + 1) + tx + 16] = tb <= pa && tb > wa ? s01 : -INFINITY;
                Ss[(ty + 8) * (BN + 1) + tx + 16] = tb <= pb && tb > wb ? s11 : -INFINITY;
            }
        }
        __syncthreads();
        for (int r = ro; r < PF_BM; r += PF_THREADS / 32) {
            float v = lane < BN ? Ss[r * (BN + 1) + lane] : -INFINITY;
            if (softcap > 0.0f && v != -INFINITY) /* masked scores stay -inf */
                v = softcap * tanhf(v / softcap);
            const float mx = m40k_warp_max(v);
            const float m_old = m_s[r], m_new = fmaxf(m_old, mx);
            /* a row that has seen only masked scores keeps m = -inf: use 0 as the shift */
            const float shift = m_new == -INFINITY ? 0.0f : m_new;
            const float p = __expf(v - shift);
            if (lane < BN)
                Ss[r * (BN + 1) + lane] = p;
            const float sum = m40k_warp_sum(lane < BN ? p : 0.0f);
            if (lane == 0) {
                const float a = __expf(m_old - shift);
                a_s[r] = a;
                l_s[r] = l_s[r] * a + sum;
                m_s[r] = m_new;
            }
        }
        __syncthreads();
#pragma unroll
        for (int k = 0; k < 4; k++) {
            const int r = ro + 4 * k;
            const float a = a_s[r];
#pragma unroll
            for (int j = 0; j < DJ; j++)
                acc[k][j] *= a;
        }
        for (int n = 0; n < BN; n++) {
            float v[DJ];
#pragma unroll
            for (int j = 0; j < DJ; j++)
                v[j] = Vs[n * D + lane + 32 * j];
#pragma unroll
            for (int k = 0; k < 4; k++) {
                const float p = Ss[(ro + 4 * k) * (BN + 1) + n];
#pragma unroll
                for (int j = 0; j < DJ; j++)
                    acc[k][j] = fmaf(p, v[j], acc[k][j]);
            }
        }
    }
    __syncthreads();
#pragma unroll
    for (int k = 0; k < 4; k++) {
        const int r = ro + 4 * k;
        if (r >= nrows)
            continue;
        const int row = row0 + r, tok = q0 + row / G, h = kvh * G + row % G;
        const float l = l_s[r];
        const float inv = sinks ? m40k_sink_norm(m_s[r], l, sinks[h]) : l > 0.0f ? 1.0f / l : 0.0f;
#pragma unroll
        for (int j = 0; j < DJ; j++)
            out[tok * out_stride + (int64_t)h * D + lane + 32 * j] = acc[k][j] * inv;
    }
}

template <int D>
static int prefill_launch(float *out, int64_t os, const float *q, int64_t qs, const int32_t *q_indptr, int n_seqs,
                          int n_rows, const uint16_t *kc, const uint16_t *vc, const int32_t *indptr,
                          const int32_t *indices, const int32_t *lpl, int n_heads, int n_kv_heads, float scale,
                          int window, float softcap, const float *sinks, cudaStream_t st)
{
    const size_t smem = pf_cfg<D>::smem;
    static int attr_set; /* per instantiation; setting it twice is harmless */
    if (!attr_set && smem > 48 * 1024) {
        cudaError_t e = cudaFuncSetAttribute(attn_prefill_kernel<D>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
        if (e != cudaSuccess)
            return (int)e;
        attr_set = 1;
    }
    const int G = n_heads / n_kv_heads;
    const long tiles = ((long)n_rows * G + PF_BM - 1) / PF_BM + n_seqs;
    if (tiles > 0x7fffffffL || n_kv_heads > 65535)
        return M40K_INVALID;
    attn_prefill_kernel<D><<<dim3((unsigned)tiles, (unsigned)n_kv_heads), PF_THREADS, smem, st>>>(
        out, os, q, qs, q_indptr, n_seqs, kc, vc, indptr, indices, lpl, n_heads, n_kv_heads, scale, window, softcap,
        sinks);
    return m40k_launch_status();
}

extern "C" int m40k_attn_prefill_window(float *out, int64_t out_stride, const float *q, int64_t q_stride,
                                        const int32_t *q_indptr, int n_seqs, int n_rows, const uint16_t *k_cache,
                                        const uint16_t *v_cache, const int32_t *indptr, const int32_t *indices,
                                        const int32_t *last_page_len, int n_heads, int n_kv_heads, int head_dim,
                                        float scale, int window, float softcap, m40k_stream stream)
{
    return m40k_attn_prefill_sinks(out, out_stride, q, q_stride, q_indptr, n_seqs, n_rows, k_cache, v_cache, indptr,
                                   indices, last_page_len, n_heads, n_kv_heads, head_dim, scale, window, softcap,
                                   nullptr, stream);
}

extern "C" int m40k_attn_prefill_sinks(float *out, int64_t out_stride, const float *q, int64_t q_stride,
                                       const int32_t *q_indptr, int n_seqs, int n_rows, const uint16_t *k_cache,
                                       const uint16_t *v_cache, const int32_t *indptr, const int32_t *indices,
                                       const int32_t *last_page_len, int n_heads, int n_kv_heads, int head_dim,
                                       float scale, int window, float softcap, const float *sinks, m40k_stream stream)
{
    if (n_seqs <= 0 || n_rows <= 0)
        return 0;
    if (n_kv_heads <= 0 || n_heads % n_kv_heads || n_heads / n_kv_heads > 8 || window < 0 || !(softcap >= 0.0f))
        return M40K_INVALID;
    switch (head_dim) {
    case 64: return prefill_launch<64>(out, out_stride, q, q_stride, q_indptr, n_seqs, n_rows, k_cache, v_cache, indptr, indices, last_page_len, n_heads, n_kv_heads, scale, window, softcap, sinks, stream);
    case 128: return prefill_launch<128>(out, out_stride, q, q_stride, q_indptr, n_seqs, n_rows, k_cache, v_cache, indptr, indices, last_page_len, n_heads, n_kv_heads, scale, window, softcap, sinks, stream);
    case 256: return prefill_launch<256>(out, out_stride, q, q_stride, q_indptr, n_seqs, n_rows, k_cache, v_cache, indptr, indices, last_page_len, n_heads, n_kv_heads, scale, window, softcap, sinks, stream);
    default: return M40K_INVALID;
    }
}

extern "C" int m40k_attn_prefill(float *out, int64_t out_stride, const float *q, int64_t q_stride,
                                 const int32_t *q_indptr, int n_seqs, int n_rows, const uint16_t *k_cache,
                                 const uint16_t *v_cache, const int32_t *indptr, const int32_t *indices,
                                 const int32_t *last_page_len, int n_heads, int n_kv_heads, int head_dim, float scale,
                                 m40k_stream stream)
{
    return m40k_attn_prefill_window(out, out_stride, q, q_stride, q_indptr, n_seqs, n_rows, k_cache, v_cache, indptr,
                                    indices, last_page_len, n_heads, n_kv_heads, head_dim, scale, 0, 0.0f, stream);
}
