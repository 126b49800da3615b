/* Paged KV-cache append: one block per new token. The block finds its sequence by binary
 * search over new_indptr, its position from the sequence length (the new tokens are the
 * last ones), its page through the CSR table, and writes every KV head's row as F16. */
#include "cuda_common.h"

__global__ void kv_append_kernel(uint16_t *__restrict__ kc, uint16_t *__restrict__ vc, const float *__restrict__ k,
                                 int64_t k_stride, const float *__restrict__ v, int64_t v_stride,
                                 const int32_t *__restrict__ new_indptr, int n_seqs, const int32_t *__restrict__ indptr,
                                 const int32_t *__restrict__ indices, const int32_t *__restrict__ last_page_len,
                                 int n_kv_heads, int head_dim)
{
    const int t = blockIdx.x;
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
        return;
    const int64_t blk = indices[indptr[s] + p / M40K_PAGE];
    const int slot = (int)(p % M40K_PAGE);
    const int row = n_kv_heads * head_dim;
    for (int j = threadIdx.x; j < row; j += blockDim.x) {
        const int h = j / head_dim, d = j % head_dim;
        const size_t at = (((size_t)blk * n_kv_heads + h) * M40K_PAGE + slot) * head_dim + d;
        kc[at] = m40k_f2h(k[t * k_stride + j]);
        vc[at] = m40k_f2h(v[t * v_stride + j]);
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
    kv_append_kernel<<<n_tokens, threads, 0, stream>>>(k_cache, v_cache, k, k_stride, v, v_stride, new_indptr, n_seqs,
                                                       indptr, indices, last_page_len, n_kv_heads, head_dim);
    return m40k_launch_status();
}
