/* Paged KV-cache append: one block per new token. The block finds its sequence by binary
 * search over new_indptr, its position from the sequence length (the new tokens are the
 * last ones), its page through the CSR table, and writes every KV head's row as F16.
 *
 * m40k_kv_append_rope does the same and rotates K (RoPE) on the way, so the forward pass
 * needs no separate RoPE launch for K (m40k_rope then rotates Q alone): at batch 1 both
 * kernels are launch-latency bound, a few us each per layer. The block first forms the
 * (cos, sin) of each of its token's rot_dim/2 pairs in shared memory, once for all KV
 * heads, with rope_dev.h's helpers, the ones rope_kernel uses; it writes V meanwhile,
 * then each thread rotates its K element against its pair's partner (read from k, which
 * stays untouched) and stores it. The cache then holds the same bits m40k_rope on k
 * followed by m40k_kv_append would leave there. m40k_kv_append_rope_tab reads the pairs
 * from the table m40k_rope_table made once for the whole forward pass (rope.cu) instead
 * of forming them in every block of every layer. */
#include "cuda_common.h"
#include "rope_dev.h"

/* Block and slot of new token t in the cache, or -1 where its position would be
 * negative (a sequence shorter than its new tokens: nothing is written). */
__device__ __forceinline__ int64_t kv_row_block(int t, const int32_t *__restrict__ new_indptr, int n_seqs,
                                                const int32_t *__restrict__ indptr,
                                                const int32_t *__restrict__ indices,
                                                const int32_t *__restrict__ last_page_len, int *slot)
{
    t += new_indptr[0];          /* a slice of a larger table: its offsets as they are */
    int lo = 0, hi = n_seqs - 1; /* last s with new_indptr[s] <= t */
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (new_indptr[mid] <= t)
            lo = mid;
        else
            hi = mid - 1;
    }
    const int s = lo;
    const int pages = indptr[s + 1] - indptr[s];
    const int64_t len = pages > 0 ? (int64_t)(pages - 1) * M40K_PAGE + last_page_len[s] : 0;
    const int64_t p = len - (new_indptr[s + 1] - t);
    if (p < 0)
        return -1;
    *slot = (int)(p % M40K_PAGE);
    return indices[indptr[s] + p / M40K_PAGE];
}

__global__ void kv_append_kernel(uint16_t *__restrict__ kc, uint16_t *__restrict__ vc, const float *__restrict__ k,
                                 int64_t k_stride, const float *__restrict__ v, int64_t v_stride,
                                 const int32_t *__restrict__ new_indptr, int n_seqs, const int32_t *__restrict__ indptr,
                                 const int32_t *__restrict__ indices, const int32_t *__restrict__ last_page_len,
                                 int n_kv_heads, int head_dim)
{
    m40k_pdl_begin(); /* PDL-launched; a PDL-launched kernel may follow */
    M40K_LAUNDER(kc);
    M40K_LAUNDER(vc);
    M40K_LAUNDER(k);
    M40K_LAUNDER(v);
    M40K_LAUNDER(new_indptr);
    M40K_LAUNDER(indptr);
    M40K_LAUNDER(indices);
    M40K_LAUNDER(last_page_len);
    const int t = blockIdx.x;
    int slot;
    const int64_t blk = kv_row_block(t, new_indptr, n_seqs, indptr, indices, last_page_len, &slot);
    if (blk < 0)
        return;
    const int row = n_kv_heads * head_dim;
    for (int j = threadIdx.x; j < row; j += blockDim.x) {
        const int h = j / head_dim, d = j % head_dim;
        const size_t at = (((size_t)blk * n_kv_heads + h) * M40K_PAGE + slot) * head_dim + d;
        kc[at] = m40k_f2h(k[t * k_stride + j]);
        vc[at] = m40k_f2h(v[t * v_stride + j]);
    }
}

#define KVR_QH 4 /* Q heads a block of kv_append_rope_kernel rotates */

/* TAB false: the block forms its token's (cos, sin) pairs in dynamic shared memory
 * (rot_dim/2 float2); TAB true: it reads them from row t of the table tab (kernels.h 5c;
 * pos, log2_base and ff unused) and needs no shared memory and no barrier. */
template <bool TAB>
__global__ void kv_append_rope_kernel(float *__restrict__ q, int64_t q_stride, int n_q_heads,
                                      uint16_t *__restrict__ kc, uint16_t *__restrict__ vc,
                                      const float *__restrict__ k, int64_t k_stride, const float *__restrict__ v,
                                      int64_t v_stride, const int32_t *__restrict__ new_indptr, int n_seqs,
                                      const int32_t *__restrict__ indptr, const int32_t *__restrict__ indices,
                                      const int32_t *__restrict__ last_page_len, int n_kv_heads, int head_dim,
                                      const int32_t *__restrict__ pos, int rot_dim, double log2_base,
                                      const float *__restrict__ ff, int neox, const float2 *__restrict__ tab)
{
    m40k_pdl_begin(); /* PDL-launched; a PDL-launched kernel may follow */
    M40K_LAUNDER(q);
    M40K_LAUNDER(kc);
    M40K_LAUNDER(vc);
    M40K_LAUNDER(k);
    M40K_LAUNDER(v);
    M40K_LAUNDER(new_indptr);
    M40K_LAUNDER(indptr);
    M40K_LAUNDER(indices);
    M40K_LAUNDER(last_page_len);
    M40K_LAUNDER(pos);
    M40K_LAUNDER(ff);
    M40K_LAUNDER(tab);
    extern __shared__ float2 cs_sm[];
    /* blockIdx.y 0: token t's K and V; 1, 2, ...: KVR_QH of its Q heads each (so that one
     * decode token is several blocks, not one) */
    const int t = blockIdx.x, part = blockIdx.y;
    int slot = 0;
    /* blk < 0 (a token outside every sequence) is the same for the whole block: its K/V
     * go nowhere, its Q is still rotated (as m40k_rope would) */
    const int64_t blk = part == 0 ? kv_row_block(t, new_indptr, n_seqs, indptr, indices, last_page_len, &slot) : -1;
    const int half = rot_dim / 2, row = n_kv_heads * head_dim;
    const float2 *cs = TAB ? tab + (size_t)t * half : cs_sm;
    if (!TAB) {
        const int32_t pt = pos[t];
        for (int i = threadIdx.x; i < half; i += blockDim.x) {
            float s, c;
            m40k_rope_sincos(pt, i, rot_dim, log2_base, ff, &s, &c);
            cs_sm[i] = make_float2(c, s);
        }
    }
    const float *kr = k + t * k_stride;
    if (blk >= 0)
        for (int j = threadIdx.x; j < row; j += blockDim.x) {
            const int h = j / head_dim, d = j % head_dim;
            vc[(((size_t)blk * n_kv_heads + h) * M40K_PAGE + slot) * head_dim + d] = m40k_f2h(v[t * v_stride + j]);
        }
    if (!TAB)
        __syncthreads();
    if (part > 0) { /* Q in place, one rotation pair a thread */
        const int h0 = (part - 1) * KVR_QH, nh = min(KVR_QH, n_q_heads - h0);
        for (int j = threadIdx.x; j < nh * half; j += blockDim.x) {
            const int h = h0 + j / half, i = j % half;
            const int a = neox ? i : 2 * i, b = neox ? i + half : 2 * i + 1;
            float *qh = q + t * q_stride + (int64_t)h * head_dim;
            const float2 r = cs[i];
            float y0, y1;
            m40k_rope_rotate(qh[a], qh[b], r.x, r.y, &y0, &y1);
            qh[a] = y0;
            qh[b] = y1;
        }
        return;
    }
    if (blk < 0)
        return;
    for (int j = threadIdx.x; j < row; j += blockDim.x) {
        const int h = j / head_dim, d = j % head_dim;
        float y = kr[j];
        if (d < rot_dim) {
            /* this element's pair (a, b) and which of the two it is; as rope_kernel:
             * normal pairs (2i, 2i+1), neox pairs (i, i + half) */
            const bool first = neox ? d < half : (d & 1) == 0;
            const int i = neox ? (first ? d : d - half) : d >> 1;
            const int a = neox ? i : 2 * i, b = neox ? i + half : 2 * i + 1;
            const float *kh = kr + (int64_t)h * head_dim;
            const float2 r = cs[i];
            float y0, y1;
            m40k_rope_rotate(kh[a], kh[b], r.x, r.y, &y0, &y1);
            y = first ? y0 : y1;
        }
        kc[(((size_t)blk * n_kv_heads + h) * M40K_PAGE + slot) * head_dim + d] = m40k_f2h(y);
    }
}

extern "C" int m40k_kv_append(uint16_t *k_cache, uint16_t *v_cache, const float *k, int64_t k_stride, const float *v,
                              int64_t v_stride, const int32_t *new_indptr, int n_seqs, int n_tokens,
                              const int32_t *indptr, const int32_t *indices, const int32_t *last_page_len,
                              int n_kv_heads, int head_dim, m40k_stream stream)
{
    if (n_tokens <= 0 || n_seqs <= 0)
        return 0;
    int threads = min(256, (n_kv_heads * head_dim + 31) / 32 * 32);
    M40K_LAUNCH_PDL(kv_append_kernel, n_tokens, threads, 0, stream, k_cache, v_cache, k, k_stride, v, v_stride,
                    new_indptr, n_seqs, indptr, indices, last_page_len, n_kv_heads, head_dim);
    return m40k_launch_status();
}

extern "C" int m40k_kv_append_rope(float *q, int64_t q_stride, int n_q_heads, uint16_t *k_cache, uint16_t *v_cache,
                                   const float *k, int64_t k_stride, const float *v, int64_t v_stride,
                                   const int32_t *new_indptr, int n_seqs, int n_tokens, const int32_t *indptr,
                                   const int32_t *indices, const int32_t *last_page_len, int n_kv_heads, int head_dim,
                                   const int32_t *pos, int rot_dim, float base, const float *freq_factors, int neox,
                                   m40k_stream stream)
{
    if (n_tokens <= 0 || n_seqs <= 0)
        return 0;
    /* m40k_rope's checks, in its order: rot_dim 0 rotates nothing (pos is not read) */
    if (rot_dim == 0)
        return m40k_kv_append(k_cache, v_cache, k, k_stride, v, v_stride, new_indptr, n_seqs, n_tokens, indptr, indices,
                              last_page_len, n_kv_heads, head_dim, stream);
    if (rot_dim < 0 || rot_dim % 2 || rot_dim > head_dim || !(base > 0.0f) ||
        (q && (n_q_heads < 0 || n_q_heads > 65534 * KVR_QH)))
        return M40K_INVALID;
    int threads = min(256, (n_kv_heads * head_dim + 31) / 32 * 32);
    const size_t smem = (size_t)(rot_dim / 2) * sizeof(float2);
    const int qparts = q ? (n_q_heads + KVR_QH - 1) / KVR_QH : 0;
    M40K_LAUNCH_PDL(kv_append_rope_kernel<false>, dim3((unsigned)n_tokens, (unsigned)(1 + qparts)), threads, smem,
                    stream, q, q_stride, q ? n_q_heads : 0, k_cache, v_cache, k, k_stride, v, v_stride, new_indptr,
                    n_seqs, indptr, indices, last_page_len, n_kv_heads, head_dim, pos, rot_dim, log2((double)base),
                    freq_factors, neox, (const float2 *)nullptr);
    return m40k_launch_status();
}

extern "C" int m40k_kv_append_rope_tab(float *q, int64_t q_stride, int n_q_heads, uint16_t *k_cache,
                                       uint16_t *v_cache, const float *k, int64_t k_stride, const float *v,
                                       int64_t v_stride, const int32_t *new_indptr, int n_seqs, int n_tokens,
                                       const int32_t *indptr, const int32_t *indices, const int32_t *last_page_len,
                                       int n_kv_heads, int head_dim, int rot_dim, const float *cs, int neox,
                                       m40k_stream stream)
{
    if (n_tokens <= 0 || n_seqs <= 0)
        return 0;
    if (rot_dim == 0)
        return m40k_kv_append(k_cache, v_cache, k, k_stride, v, v_stride, new_indptr, n_seqs, n_tokens, indptr, indices,
                              last_page_len, n_kv_heads, head_dim, stream);
    if (rot_dim < 0 || rot_dim % 2 || rot_dim > head_dim || !cs || ((uintptr_t)cs & 7) ||
        (q && (n_q_heads < 0 || n_q_heads > 65534 * KVR_QH)))
        return M40K_INVALID;
    int threads = min(256, (n_kv_heads * head_dim + 31) / 32 * 32);
    const int qparts = q ? (n_q_heads + KVR_QH - 1) / KVR_QH : 0;
    M40K_LAUNCH_PDL(kv_append_rope_kernel<true>, dim3((unsigned)n_tokens, (unsigned)(1 + qparts)), threads, 0, stream,
                    q, q_stride, q ? n_q_heads : 0, k_cache, v_cache, k, k_stride, v, v_stride, new_indptr, n_seqs,
                    indptr, indices, last_page_len, n_kv_heads, head_dim, (const int32_t *)nullptr, rot_dim, 0.0,
                    (const float *)nullptr, neox, reinterpret_cast<const float2 *>(cs));
    return m40k_launch_status();
}
