/* Embedding gather: one block per token id, each thread dequantizes groups of 8. */
#include "quant_dev.h"

template <int T>
__global__ void embed_kernel(const uint8_t *__restrict__ table, size_t row_bytes, int64_t n_rows, int dim,
                             const int32_t *__restrict__ ids, void *__restrict__ out, int out_f16, int64_t out_stride)
{
    const int i = blockIdx.x;
    const int32_t id = ids[i];
    const bool valid = id >= 0 && id < n_rows;
    const uint8_t *row = table + (valid ? (size_t)id * row_bytes : 0);
    for (int e0 = 8 * threadIdx.x; e0 < dim; e0 += 8 * blockDim.x) {
        float q[8], sc = 0.0f, off = 0.0f;
        const int n = min(8, dim - e0);
        if (valid && n == 8)
            m40k_group8<T>(row, e0, q, sc, off);
#pragma unroll
        for (int k = 0; k < 8; k++)
            q[k] = valid ? (n == 8 ? sc * q[k] - off : 0.0f) : 0.0f;
        if (valid && n < 8) /* ragged tail of an F32/F16/BF16 row */
            for (int k = 0; k < n; k++)
                q[k] = T == M40K_TYPE_F32    ? reinterpret_cast<const float *>(row)[e0 + k]
                       : T == M40K_TYPE_BF16 ? m40k_bf2f((uint16_t)(row[2 * (e0 + k)] | (row[2 * (e0 + k) + 1] << 8)))
                                             : m40k_ldh(row + 2 * (e0 + k));
        if (out_f16) {
            uint16_t *o = (uint16_t *)out + (int64_t)i * out_stride + e0;
            for (int k = 0; k < n; k++)
                o[k] = m40k_f2h(q[k]);
        } else {
            float *o = (float *)out + (int64_t)i * out_stride + e0;
            for (int k = 0; k < n; k++)
                o[k] = q[k];
        }
    }
}

template <int T>
static int embed_launch(const void *table, int64_t n_rows, int dim, const int32_t *ids, int n_ids, void *out,
                        int out_f16, int64_t out_stride, cudaStream_t st)
{
    typedef m40k_tinfo<T> ti;
    if (dim % ti::BE)
        return M40K_INVALID;
    size_t row_bytes = (size_t)dim / ti::BE * ti::BB;
    int threads = min(256, max(32, (dim / 8 + 31) / 32 * 32));
    embed_kernel<T><<<n_ids, threads, 0, st>>>((const uint8_t *)table, row_bytes, n_rows, dim, ids, out, out_f16,
                                               out_stride);
    return m40k_launch_status();
}

extern "C" int m40k_embed(const void *table, int table_type, int64_t n_rows, int dim, const int32_t *ids, int n_ids,
                          void *out, int out_type, int64_t out_stride, m40k_stream stream)
{
    if (n_ids <= 0 || dim <= 0)
        return 0;
    if (out_type != M40K_TYPE_F32 && out_type != M40K_TYPE_F16)
        return M40K_INVALID;
    const int f16 = out_type == M40K_TYPE_F16;
    switch (table_type) {
    case M40K_TYPE_F32: return embed_launch<M40K_TYPE_F32>(table, n_rows, dim, ids, n_ids, out, f16, out_stride, stream);
    case M40K_TYPE_F16: return embed_launch<M40K_TYPE_F16>(table, n_rows, dim, ids, n_ids, out, f16, out_stride, stream);
    case M40K_TYPE_Q8_0: return embed_launch<M40K_TYPE_Q8_0>(table, n_rows, dim, ids, n_ids, out, f16, out_stride, stream);
    case M40K_TYPE_Q4_0: return embed_launch<M40K_TYPE_Q4_0>(table, n_rows, dim, ids, n_ids, out, f16, out_stride, stream);
    case M40K_TYPE_Q4_1: return embed_launch<M40K_TYPE_Q4_1>(table, n_rows, dim, ids, n_ids, out, f16, out_stride, stream);
    case M40K_TYPE_Q5_0: return embed_launch<M40K_TYPE_Q5_0>(table, n_rows, dim, ids, n_ids, out, f16, out_stride, stream);
    case M40K_TYPE_Q5_1: return embed_launch<M40K_TYPE_Q5_1>(table, n_rows, dim, ids, n_ids, out, f16, out_stride, stream);
    case M40K_TYPE_Q4_K: return embed_launch<M40K_TYPE_Q4_K>(table, n_rows, dim, ids, n_ids, out, f16, out_stride, stream);
    case M40K_TYPE_Q6_K: return embed_launch<M40K_TYPE_Q6_K>(table, n_rows, dim, ids, n_ids, out, f16, out_stride, stream);
    case M40K_TYPE_Q2_K: return embed_launch<M40K_TYPE_Q2_K>(table, n_rows, dim, ids, n_ids, out, f16, out_stride, stream);
    case M40K_TYPE_Q3_K: return embed_launch<M40K_TYPE_Q3_K>(table, n_rows, dim, ids, n_ids, out, f16, out_stride, stream);
    case M40K_TYPE_Q5_K: return embed_launch<M40K_TYPE_Q5_K>(table, n_rows, dim, ids, n_ids, out, f16, out_stride, stream);
    case M40K_TYPE_BF16: return embed_launch<M40K_TYPE_BF16>(table, n_rows, dim, ids, n_ids, out, f16, out_stride, stream);
    case M40K_TYPE_MXFP4: return embed_launch<M40K_TYPE_MXFP4>(table, n_rows, dim, ids, n_ids, out, f16, out_stride, stream);
    case M40K_TYPE_Q8_0_G8:
        return embed_launch<M40K_TYPE_Q8_0_G8>(table, n_rows, dim, ids, n_ids, out, f16, out_stride, stream);
    case M40K_TYPE_Q6_K_G8:
        return embed_launch<M40K_TYPE_Q6_K_G8>(table, n_rows, dim, ids, n_ids, out, f16, out_stride, stream);
    default: return M40K_INVALID;
    }
}
