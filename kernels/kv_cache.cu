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

#define KVR_QH4 8 /* Q heads a block of kv_append_rope_tab4_kernel rotates */

/* kv_append_rope_kernel<true> four elements a thread: 16-byte loads of q, k, v and of the
 * table, 8-byte stores into the cache, for rows whose strides, head size and rotary
 * width allow them (m40k_kv_append_rope_tab picks it). Normal RoPE: a float4 holds two
 * pairs; neox: elements i .. i+3 of the first half and their partners i + rot_dim/2 ..
 * (rot_dim a multiple of 8 there, so a float4 never straddles a half). Every element is
 * the same m40k_rope_rotate of the same operands as the scalar kernel: the same bits. */
template <bool NEOX>
__global__ void kv_append_rope_tab4_kernel(float *__restrict__ q, int64_t q_stride, int n_q_heads,
                                           uint16_t *__restrict__ kc, uint16_t *__restrict__ vc,
                                           const float *__restrict__ k, int64_t k_stride, const float *__restrict__ v,
                                           int64_t v_stride, const int32_t *__restrict__ new_indptr, int n_seqs,
                                           const int32_t *__restrict__ indptr, const int32_t *__restrict__ indices,
                                           const int32_t *__restrict__ last_page_len, int n_kv_heads, int head_dim,
                                           int rot_dim, const float2 *__restrict__ tab)
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
    M40K_LAUNDER(tab);
    const int t = blockIdx.x, part = blockIdx.y, half = rot_dim / 2, hd4 = head_dim / 4;
    const float *cs = reinterpret_cast<const float *>(tab + (size_t)t * half); /* cos, sin of pair i at 2i */
    if (part > 0) { /* Q in place: units of 4 elements (normal) or of 4 pairs (neox) */
        const int h0 = (part - 1) * KVR_QH4, nh = min(KVR_QH4, n_q_heads - h0), per = NEOX ? half / 4 : rot_dim / 4;
        for (int j = threadIdx.x; j < nh * per; j += blockDim.x) {
            const int h = h0 + j / per, u = j % per;
            float *qh = q + t * q_stride + (int64_t)h * head_dim;
            if (!NEOX) {
                float4 x = *reinterpret_cast<const float4 *>(qh + 4 * u);
                const float4 c = *reinterpret_cast<const float4 *>(cs + 4 * u); /* pairs 2u, 2u + 1 */
                m40k_rope_rotate(x.x, x.y, c.x, c.y, &x.x, &x.y);
                m40k_rope_rotate(x.z, x.w, c.z, c.w, &x.z, &x.w);
                *reinterpret_cast<float4 *>(qh + 4 * u) = x;
            } else {
                float4 a = *reinterpret_cast<const float4 *>(qh + 4 * u);
                float4 b = *reinterpret_cast<const float4 *>(qh + half + 4 * u);
                const float4 c0 = *reinterpret_cast<const float4 *>(cs + 8 * u);     /* pairs 4u, 4u + 1 */
                const float4 c1 = *reinterpret_cast<const float4 *>(cs + 8 * u + 4); /* 4u + 2, 4u + 3 */
                m40k_rope_rotate(a.x, b.x, c0.x, c0.y, &a.x, &b.x);
                m40k_rope_rotate(a.y, b.y, c0.z, c0.w, &a.y, &b.y);
                m40k_rope_rotate(a.z, b.z, c1.x, c1.y, &a.z, &b.z);
                m40k_rope_rotate(a.w, b.w, c1.z, c1.w, &a.w, &b.w);
                *reinterpret_cast<float4 *>(qh + 4 * u) = a;
                *reinterpret_cast<float4 *>(qh + half + 4 * u) = b;
            }
        }
        return;
    }
    int slot = 0;
    const int64_t blk = kv_row_block(t, new_indptr, n_seqs, indptr, indices, last_page_len, &slot);
    if (blk < 0)
        return;
    const float *kr = k + t * k_stride;
    for (int j = threadIdx.x; j < n_kv_heads * hd4; j += blockDim.x) {
        const int h = j / hd4, d = 4 * (j % hd4);
        const size_t at = (((size_t)blk * n_kv_heads + h) * M40K_PAGE + slot) * head_dim + d;
        *reinterpret_cast<uint2 *>(vc + at) = m40k_pack_h4(*reinterpret_cast<const float4 *>(v + t * v_stride + 4 * j));
        float4 x = *reinterpret_cast<const float4 *>(kr + 4 * j);
        if (d < rot_dim) {
            const float *kh = kr + (int64_t)h * head_dim;
            float y0, y1;
            if (!NEOX) { /* pairs d/2, d/2 + 1 */
                const float4 c = *reinterpret_cast<const float4 *>(cs + d);
                m40k_rope_rotate(x.x, x.y, c.x, c.y, &y0, &y1);
                x.x = y0, x.y = y1;
                m40k_rope_rotate(x.z, x.w, c.z, c.w, &y0, &y1);
                x.z = y0, x.w = y1;
            } else { /* pairs i .. i+3: this float4 is their first (d < half) or second element */
                const bool first = d < half;
                const int i = first ? d : d - half;
                const float4 p = *reinterpret_cast<const float4 *>(kh + (first ? i + half : i));
                const float4 c0 = *reinterpret_cast<const float4 *>(cs + 2 * i);
                const float4 c1 = *reinterpret_cast<const float4 *>(cs + 2 * i + 4);
                const float xs[4] = {x.x, x.y, x.z, x.w}, ps[4] = {p.x, p.y, p.z, p.w};
                const float cc[4] = {c0.x, c0.z, c1.x, c1.z}, ss[4] = {c0.y, c0.w, c1.y, c1.w};
                float o[4];
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    if (first)
                        m40k_rope_rotate(xs[e], ps[e], cc[e], ss[e], &o[e], &y1);
                    else
                        m40k_rope_rotate(ps[e], xs[e], cc[e], ss[e], &y0, &o[e]);
                }
                x = make_float4(o[0], o[1], o[2], o[3]);
            }
        }
        *reinterpret_cast<uint2 *>(kc + at) = m40k_pack_h4(x);
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
    /* four elements a thread where every row, head and rotary half allows 16-byte access */
    const uintptr_t al = (uintptr_t)q | (uintptr_t)k | (uintptr_t)v | (uintptr_t)cs;
    if (head_dim % 4 == 0 && rot_dim % (neox ? 8 : 4) == 0 && (al & 15) == 0 && k_stride % 4 == 0 &&
        v_stride % 4 == 0 && (!q || q_stride % 4 == 0)) {
        const int threads = min(256, (n_kv_heads * head_dim / 4 + 31) / 32 * 32);
        const int qparts = q ? (n_q_heads + KVR_QH4 - 1) / KVR_QH4 : 0;
        const dim3 grid((unsigned)n_tokens, (unsigned)(1 + qparts));
        if (neox)
            M40K_LAUNCH_PDL(kv_append_rope_tab4_kernel<true>, grid, threads, 0, stream, q, q_stride, q ? n_q_heads : 0,
                            k_cache, v_cache, k, k_stride, v, v_stride, new_indptr, n_seqs, indptr, indices,
                            last_page_len, n_kv_heads, head_dim, rot_dim, reinterpret_cast<const float2 *>(cs));
        else
            M40K_LAUNCH_PDL(kv_append_rope_tab4_kernel<false>, grid, threads, 0, stream, q, q_stride, q ? n_q_heads : 0,
                            k_cache, v_cache, k, k_stride, v, v_stride, new_indptr, n_seqs, indptr, indices,
                            last_page_len, n_kv_heads, head_dim, rot_dim, reinterpret_cast<const float2 *>(cs));
        return m40k_launch_status();
    }
    int threads = min(256, (n_kv_heads * head_dim + 31) / 32 * 32);
    const int qparts = q ? (n_q_heads + KVR_QH - 1) / KVR_QH : 0;
    M40K_LAUNCH_PDL(kv_append_rope_kernel<true>, dim3((unsigned)n_tokens, (unsigned)(1 + qparts)), threads, 0, stream,
                    q, q_stride, q ? n_q_heads : 0, k_cache, v_cache, k, k_stride, v, v_stride, new_indptr, n_seqs,
                    indptr, indices, last_page_len, n_kv_heads, head_dim, (const int32_t *)nullptr, rot_dim, 0.0,
                    (const float *)nullptr, neox, reinterpret_cast<const float2 *>(cs));
    return m40k_launch_status();
}
