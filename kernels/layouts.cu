/* The device layouts of kernels.h 0. (host functions, no device work): the blocks of a
 * GGUF type rewritten so that the kernels' 16-byte loads and copies find them aligned.
 * The engine rewrites a matrix once, on its way to the device (engine/gpu/model_cuda.c);
 * the GPU tests rewrite their random matrices the same way and compare the kernels
 * against the twins on the file's layout. */
#include <string.h>

#include "cuda_common.h"

extern "C" int m40k_g8_type(int t, int64_t K)
{
    if (t == M40K_TYPE_Q8_0 && K > 0 && K % 256 == 0)
        return M40K_TYPE_Q8_0_G8;
    if (t == M40K_TYPE_Q6_K && K > 0 && K % 2048 == 0)
        return M40K_TYPE_Q6_K_G8;
    return t;
}

extern "C" int m40k_repack_g8(int t, const void *src, void *dst, int64_t rows, int64_t K)
{
    const int g8 = m40k_g8_type(t, K);
    if (g8 == t || rows < 0)
        return M40K_INVALID;
    /* a group: 8 blocks of bb bytes, each a head of hb bytes (d) and a body; the group
     * puts the 8 heads first (Q8_0: d at 0, head first) or last (Q6_K: d at 208, last) */
    const bool q8 = t == M40K_TYPE_Q8_0;
    const size_t bb = q8 ? 34 : 210, hb = 2, gb = 8 * bb, groups = (size_t)rows * (size_t)(K / (q8 ? 256 : 2048));
    const uint8_t *s = (const uint8_t *)src;
    uint8_t *d = (uint8_t *)dst;
    for (size_t gi = 0; gi < groups; gi++, s += gb, d += gb)
        for (int j = 0; j < 8; j++) {
            const uint8_t *b = s + j * bb;
            if (q8) {
                memcpy(d + hb * j, b, hb);                        /* d */
                memcpy(d + 8 * hb + (bb - hb) * j, b + hb, bb - hb); /* qs */
            } else {
                memcpy(d + (bb - hb) * j, b, bb - hb);                 /* ql | qh | scales */
                memcpy(d + 8 * (bb - hb) + hb * j, b + bb - hb, hb); /* d */
            }
        }
    return 0;
}

extern "C" int64_t m40k_padded_row_bytes(int t, int64_t K)
{
    if (t == M40K_TYPE_Q6_K_P && K > 0 && K % 256 == 0)
        return K / 256 * 224;
    if (t == M40K_TYPE_MXFP4_P && K > 0 && K % 32 == 0)
        return (K + 255) / 256 * 144;
    return 0;
}

extern "C" int m40k_repack_q6_k_p(const void *src, void *dst, int64_t rows, int64_t K)
{
    if (!m40k_padded_row_bytes(M40K_TYPE_Q6_K_P, K) || rows < 0)
        return M40K_INVALID;
    const size_t blocks = (size_t)rows * (size_t)(K / 256);
    const uint8_t *s = (const uint8_t *)src;
    uint8_t *d = (uint8_t *)dst;
    for (size_t b = 0; b < blocks; b++, s += 210, d += 224) {
        memcpy(d, s, 210);
        memset(d + 210, 0, 14);
    }
    return 0;
}

extern "C" int m40k_repack_mxfp4_p(const void *src, void *dst, int64_t rows, int64_t K)
{
    const int64_t out = m40k_padded_row_bytes(M40K_TYPE_MXFP4_P, K);
    if (!out || rows < 0)
        return M40K_INVALID;
    const int64_t blocks = K / 32;
    const uint8_t *s = (const uint8_t *)src;
    uint8_t *d = (uint8_t *)dst;
    for (int64_t r = 0; r < rows; r++, s += blocks * 17, d += out) {
        memset(d, 0, (size_t)out);
        for (int64_t b = 0; b < blocks; b++) {
            uint8_t *c = d + (b / 8) * 144;
            c[128 + b % 8] = s[b * 17];                 /* e */
            memcpy(c + 16 * (b % 8), s + b * 17 + 1, 16); /* qs */
        }
    }
    return 0;
}
