/* CPU reference for GGUF weight types: scalar conversions, dequantization, fused
 * dot products and reference quantizers.
 *
 * Design notes:
 * - Blocks inside a GGUF tensor are not aligned to anything larger than a byte
 *   (an 18-byte Q4_0 block follows another), so every multi-byte field is read
 *   byte by byte in little-endian order; this is also what makes the code correct
 *   on a big-endian host.
 * - Every block type is "unpacked" into an array of small integers stored as
 *   floats, in element order, before any scale is applied. Dequantization then
 *   multiplies by the (sub-)block scale, and the dot product multiplies the scale
 *   into a per-sub-block partial sum instead, so the hot loop of the forward pass
 *   never writes the dequantized row anywhere but a stack buffer in L1.
 * - For every K-quant, the element e of a super-block belongs to sub-block e/16
 *   (Q2_K, Q3_K, Q6_K) or e/32 (Q4_K, Q5_K) once the element order is decoded;
 *   the unpack loops below perform exactly that decoding, so scales can be applied
 *   to contiguous runs.
 * - Float sums use 8 independent lanes: the compiler may not reorder a single
 *   float accumulator at -O2 (no -ffast-math), but it can vectorize 8 explicit
 *   lanes. */
#include "quant.h"

#include <math.h>
#include <string.h>

/* ---------------------------------------------------------------- scalars */

static inline uint32_t f32_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static inline float bits_f32(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Branch-free so that loops over it vectorize: the 15 exponent+mantissa bits are
 * placed at the top of a float's exponent/mantissa fields and the result rescaled
 * by 2^(127-15); subnormal halves become subnormal floats which the multiply
 * normalizes exactly. Inf/NaN (exponent 31) then get the float's all-ones exponent
 * with their mantissa (NaN payload) kept. */
static inline float fp16_to_fp32_inline(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t em = (uint32_t)(h & 0x7fffu) << 13;
    uint32_t r = f32_bits(bits_f32(em) * 0x1p112f);
    r |= ((h & 0x7c00u) == 0x7c00u) ? 0x7f800000u : 0u;
    return bits_f32(r | sign);
}

float m40_fp16_to_fp32(uint16_t h)
{
    return fp16_to_fp32_inline(h);
}

uint16_t m40_fp32_to_fp16(float f)
{
    uint32_t x = f32_bits(f);
    uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    x &= 0x7fffffffu;
    if (x >= 0x7f800000u) {
        if (x == 0x7f800000u)
            return sign | 0x7c00u;
        /* NaN: keep the top payload bits and force the quiet bit so the result
         * cannot collapse into an infinity. */
        return sign | 0x7e00u | (uint16_t)((x >> 13) & 0x3ffu);
    }
    /* 65520 is the midpoint between the largest half (65504) and 2^16; ties go to
     * the even neighbour, which is the infinity. */
    if (x >= 0x477ff000u)
        return sign | 0x7c00u;
    if (x < 0x38800000u) {
        /* Below 2^-14: the half is subnormal with a unit of 2^-24. Adding 0.5
         * (whose float ulp is also 2^-24) lets the FPU do the round-to-nearest-even;
         * the mantissa of the sum is the half mantissa (0x400 means the rounding
         * carried into the smallest normal, which is the right encoding too). */
        float s = bits_f32(x) + 0.5f;
        return sign | (uint16_t)(f32_bits(s) - 0x3f000000u);
    }
    /* Normal: rebias the exponent (127 -> 15) and round the 13 dropped bits to
     * nearest even; a carry propagates into the exponent as it should. */
    uint32_t odd = (x >> 13) & 1u;
    x += 0xc8000000u + 0xfffu + odd; /* 0xc8000000 = -(112 << 23) mod 2^32 */
    return sign | (uint16_t)(x >> 13);
}

float m40_bf16_to_fp32(uint16_t h)
{
    return bits_f32((uint32_t)h << 16);
}

uint16_t m40_fp32_to_bf16(float f)
{
    uint32_t x = f32_bits(f);
    if ((x & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((x >> 16) | 0x40u); /* quiet NaN, never rounds to inf */
    x += 0x7fffu + ((x >> 16) & 1u);
    return (uint16_t)(x >> 16);
}

/* ---------------------------------------------------------------- helpers */

static inline uint16_t rd16(const uint8_t *p)
{
    return (uint16_t)(p[0] | (p[1] << 8));
}

static inline uint32_t rd32(const uint8_t *p)
{
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}

static inline void wr16(uint8_t *p, uint16_t v)
{
    p[0] = (uint8_t)(v & 0xff);
    p[1] = (uint8_t)(v >> 8);
}

static inline float rdh(const uint8_t *p)
{
    return fp16_to_fp32_inline(rd16(p));
}

/* Fixed-length conversions of 256 halves: GCC's -O2 cost model only vectorizes
 * loops whose trip count is a known multiple of the vector width and whose
 * pointers cannot alias, hence the constant count and restrict. */
static void f16_chunk(const uint8_t *restrict r, float *restrict q)
{
    for (int j = 0; j < M40_QK_K; j++)
        q[j] = fp16_to_fp32_inline(rd16(r + 2 * j));
}

static void bf16_chunk(const uint8_t *restrict r, float *restrict q)
{
    for (int j = 0; j < M40_QK_K; j++)
        q[j] = bits_f32((uint32_t)rd16(r + 2 * j) << 16);
}

/* n is a multiple of 8 here (sub-blocks are 16 or 32 elements). */
static inline float dot8(const float *a, const float *b, int n)
{
    float acc[8] = {0};
    for (int i = 0; i < n; i += 8)
        for (int k = 0; k < 8; k++)
            acc[k] += a[i + k] * b[i + k];
    return ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
}

static inline float sum8(const float *a, int n)
{
    float acc[8] = {0};
    for (int i = 0; i < n; i += 8)
        for (int k = 0; k < 8; k++)
            acc[k] += a[i + k];
    return ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
}

/* Any length; used for the plain float types. */
static float dot_any(const float *a, const float *b, int64_t n)
{
    float acc[8] = {0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int k = 0; k < 8; k++)
            acc[k] += a[i + k] * b[i + k];
    float tail = 0.0f;
    for (; i < n; i++)
        tail += a[i] * b[i];
    return ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail;
}

/* ------------------------------------------------------ block definitions
 * Byte offsets inside each block (GGUF/ggml layouts):
 *   Q4_0 (18):  d f16 | qs[16]
 *   Q4_1 (20):  d f16 | m f16 | qs[16]
 *   Q5_0 (22):  d f16 | qh[4] | qs[16]
 *   Q5_1 (24):  d f16 | m f16 | qh[4] | qs[16]
 *   Q8_0 (34):  d f16 | qs[32] int8
 *   Q2_K (84):  scales[16] | qs[64] | d f16 | dmin f16
 *   Q3_K (110): hmask[32] | qs[64] | scales[12] | d f16
 *   Q4_K (144): d f16 | dmin f16 | scales[12] | qs[128]
 *   Q5_K (176): d f16 | dmin f16 | scales[12] | qh[32] | qs[128]
 *   Q6_K (210): ql[128] | qh[64] | scales[16] int8 | d f16
 *   MXFP4 (17): e u8 (E8M0) | qs[16] (E2M1 nibbles) */

/* Q4_0/Q4_1: nibble j of byte j is element j, the high nibble element j+16. */
static inline void unpack_q4(const uint8_t *qs, float *q, float offset)
{
    for (int j = 0; j < 16; j++) {
        q[j] = (float)(qs[j] & 15) - offset;
        q[j + 16] = (float)(qs[j] >> 4) - offset;
    }
}

/* Q5_0/Q5_1: as Q4 plus bit j of the 32-bit qh as 5th bit of element j. */
static inline void unpack_q5(const uint8_t *qh4, const uint8_t *qs, float *q, float offset)
{
    uint32_t qh = rd32(qh4);
    for (int j = 0; j < 16; j++) {
        int lo = (qs[j] & 15) | (int)(((qh >> j) & 1u) << 4);
        int hi = (qs[j] >> 4) | (int)(((qh >> (j + 16)) & 1u) << 4);
        q[j] = (float)lo - offset;
        q[j + 16] = (float)hi - offset;
    }
}

static inline void unpack_q8_0(const uint8_t *qs, float *q)
{
    for (int j = 0; j < 32; j++)
        q[j] = (float)(int8_t)qs[j];
}

/* Q2_K: two halves of 128; in half n, 2-bit field j (bits 2j..2j+1) of byte
 * qs[32n + l] is element 128n + 32j + l. */
static inline void unpack_q2_k(const uint8_t *qs, float *q)
{
    for (int n = 0; n < 2; n++)
        for (int j = 0; j < 4; j++)
            for (int l = 0; l < 32; l++)
                q[128 * n + 32 * j + l] = (float)((qs[32 * n + l] >> (2 * j)) & 3);
}

/* Q3_K: low 2 bits as in Q2_K; bit (4n + j) of hmask[l] is the 3rd bit, and a
 * CLEAR high bit means "subtract 4" (values -4..3). */
static inline void unpack_q3_k(const uint8_t *hm, const uint8_t *qs, float *q)
{
    for (int n = 0; n < 2; n++)
        for (int j = 0; j < 4; j++)
            for (int l = 0; l < 32; l++) {
                int lo = (qs[32 * n + l] >> (2 * j)) & 3;
                int hb = (hm[l] >> (4 * n + j)) & 1;
                q[128 * n + 32 * j + l] = (float)(lo - (hb ? 0 : 4));
            }
}

/* Q3_K's 16 6-bit signed scales: low 4 bits are the low (i < 8) or high (i >= 8)
 * nibble of byte i % 8; the top 2 bits are field i / 4 of byte 8 + i % 4; bias 32. */
static inline void scales_q3_k(const uint8_t *s, int *out)
{
    for (int i = 0; i < 16; i++) {
        int lo = i < 8 ? (s[i] & 15) : (s[i - 8] >> 4);
        int hi = (s[8 + (i & 3)] >> (2 * (i >> 2))) & 3;
        out[i] = (lo | (hi << 4)) - 32;
    }
}

/* Q4_K/Q5_K: 8 pairs (scale, min) of 6 bits in 12 bytes. Pairs 0..3 sit in the low
 * 6 bits of bytes 0..3 (scales) and 4..7 (mins); pairs 4..7 keep their low 4 bits in
 * the nibbles of bytes 8..11 and their top 2 bits in the top bits of bytes 0..7. */
static inline void scale_min_k4(const uint8_t *s, int j, int *sc, int *mn)
{
    if (j < 4) {
        *sc = s[j] & 63;
        *mn = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
        *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

/* Q4_K: four chunks of 64; in chunk c, low nibbles of qs[32c..32c+32) are elements
 * 64c..64c+32 and high nibbles the next 32. */
static inline void unpack_q4_k(const uint8_t *qs, float *q)
{
    for (int c = 0; c < 4; c++)
        for (int l = 0; l < 32; l++) {
            q[64 * c + l] = (float)(qs[32 * c + l] & 15);
            q[64 * c + 32 + l] = (float)(qs[32 * c + l] >> 4);
        }
}

/* Q5_K: as Q4_K plus the 5th bit of element e in bit e/32 of qh[e % 32]. */
static inline void unpack_q5_k(const uint8_t *qh, const uint8_t *qs, float *q)
{
    for (int c = 0; c < 4; c++)
        for (int l = 0; l < 32; l++) {
            int lo = (qs[32 * c + l] & 15) | (((qh[l] >> (2 * c)) & 1) << 4);
            int hi = (qs[32 * c + l] >> 4) | (((qh[l] >> (2 * c + 1)) & 1) << 4);
            q[64 * c + l] = (float)lo;
            q[64 * c + 32 + l] = (float)hi;
        }
}

/* Q6_K: two halves of 128; in half n, quarter k (32 elements, l = 0..31) takes its
 * low 4 bits from ql[64n + l + 32(k&1)] (low nibble for k < 2, high for k >= 2) and
 * its top 2 bits from bits 2k..2k+1 of qh[32n + l]; bias 32 (values -32..31). */
static inline void unpack_q6_k(const uint8_t *ql, const uint8_t *qh, float *q)
{
    for (int n = 0; n < 2; n++)
        for (int l = 0; l < 32; l++) {
            const uint8_t a = ql[64 * n + l], b = ql[64 * n + l + 32], h = qh[32 * n + l];
            q[128 * n + l] = (float)((a & 15) | ((h & 3) << 4)) - 32.0f;
            q[128 * n + 32 + l] = (float)((b & 15) | (((h >> 2) & 3) << 4)) - 32.0f;
            q[128 * n + 64 + l] = (float)((a >> 4) | (((h >> 4) & 3) << 4)) - 32.0f;
            q[128 * n + 96 + l] = (float)((b >> 4) | (((h >> 6) & 3) << 4)) - 32.0f;
        }
}

/* MXFP4 (OCP microscaling FP4, as ggml stores it): element j < 16 is the low nibble of
 * qs[j], element j + 16 its high nibble (the Q4_0 order). A nibble is E2M1: sign bit 3,
 * magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6. ggml keeps them doubled as integers (0..12) and
 * halves the scale instead, so the block scale is 2^(e - 128) rather than the spec's
 * 2^(e - 127) and every level is an exact small integer; the products are the same.
 * e = 255 (NaN in the OCP spec) is read as ggml reads it, 2^127. */
static const float mxfp4_levels[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

static inline float mxfp4_scale(uint8_t e)
{
    return ldexpf(1.0f, (int)e - 128); /* exact: 2^-128 is a float subnormal */
}

static inline void unpack_mxfp4(const uint8_t *qs, float *q)
{
    for (int j = 0; j < 16; j++) {
        q[j] = mxfp4_levels[qs[j] & 15];
        q[j + 16] = mxfp4_levels[qs[j] >> 4];
    }
}

/* ------------------------------------------------------------- public API */

int m40_type_supported(uint32_t type)
{
    switch (type) {
    case M40_TYPE_F32:
    case M40_TYPE_F16:
    case M40_TYPE_BF16:
    case M40_TYPE_Q4_0:
    case M40_TYPE_Q4_1:
    case M40_TYPE_Q5_0:
    case M40_TYPE_Q5_1:
    case M40_TYPE_Q8_0:
    case M40_TYPE_Q2_K:
    case M40_TYPE_Q3_K:
    case M40_TYPE_Q4_K:
    case M40_TYPE_Q5_K:
    case M40_TYPE_Q6_K:
    case M40_TYPE_MXFP4:
        return 1;
    default:
        return 0;
    }
}

/* Unsupported types leave dst zeroed: callers are expected to have checked
 * m40_type_supported (the model loader rejects such tensors with a message), and
 * zeros are at least deterministic rather than stale memory. */
void m40_dequantize_row(uint32_t type, const void *src, float *dst, int64_t n)
{
    const uint8_t *p = src;
    float q[M40_QK_K];

    switch (type) {
    case M40_TYPE_F32:
        memcpy(dst, src, (size_t)n * sizeof(float));
        return;
    case M40_TYPE_F16:
    case M40_TYPE_BF16: {
        const int bf = type == M40_TYPE_BF16;
        int64_t i = 0;
        for (; i + M40_QK_K <= n; i += M40_QK_K)
            (bf ? bf16_chunk : f16_chunk)(p + 2 * i, dst + i);
        for (; i < n; i++)
            dst[i] = bf ? m40_bf16_to_fp32(rd16(p + 2 * i)) : rdh(p + 2 * i);
        return;
    }
    case M40_TYPE_Q4_0:
        for (int64_t b = 0; b < n / 32; b++, p += 18, dst += 32) {
            float d = rdh(p);
            unpack_q4(p + 2, q, 8.0f);
            for (int j = 0; j < 32; j++)
                dst[j] = d * q[j];
        }
        return;
    case M40_TYPE_Q4_1:
        for (int64_t b = 0; b < n / 32; b++, p += 20, dst += 32) {
            float d = rdh(p), m = rdh(p + 2);
            unpack_q4(p + 4, q, 0.0f);
            for (int j = 0; j < 32; j++)
                dst[j] = d * q[j] + m;
        }
        return;
    case M40_TYPE_Q5_0:
        for (int64_t b = 0; b < n / 32; b++, p += 22, dst += 32) {
            float d = rdh(p);
            unpack_q5(p + 2, p + 6, q, 16.0f);
            for (int j = 0; j < 32; j++)
                dst[j] = d * q[j];
        }
        return;
    case M40_TYPE_Q5_1:
        for (int64_t b = 0; b < n / 32; b++, p += 24, dst += 32) {
            float d = rdh(p), m = rdh(p + 2);
            unpack_q5(p + 4, p + 8, q, 0.0f);
            for (int j = 0; j < 32; j++)
                dst[j] = d * q[j] + m;
        }
        return;
    case M40_TYPE_Q8_0:
        for (int64_t b = 0; b < n / 32; b++, p += 34, dst += 32) {
            float d = rdh(p);
            unpack_q8_0(p + 2, q);
            for (int j = 0; j < 32; j++)
                dst[j] = d * q[j];
        }
        return;
    case M40_TYPE_Q2_K:
        for (int64_t b = 0; b < n / M40_QK_K; b++, p += 84, dst += M40_QK_K) {
            float d = rdh(p + 80), dmin = rdh(p + 82);
            unpack_q2_k(p + 16, q);
            for (int s = 0; s < 16; s++) {
                float dl = d * (float)(p[s] & 15), ml = dmin * (float)(p[s] >> 4);
                for (int j = 0; j < 16; j++)
                    dst[16 * s + j] = dl * q[16 * s + j] - ml;
            }
        }
        return;
    case M40_TYPE_Q3_K:
        for (int64_t b = 0; b < n / M40_QK_K; b++, p += 110, dst += M40_QK_K) {
            float d = rdh(p + 108);
            int sc[16];
            scales_q3_k(p + 96, sc);
            unpack_q3_k(p, p + 32, q);
            for (int s = 0; s < 16; s++) {
                float dl = d * (float)sc[s];
                for (int j = 0; j < 16; j++)
                    dst[16 * s + j] = dl * q[16 * s + j];
            }
        }
        return;
    case M40_TYPE_Q4_K:
    case M40_TYPE_Q5_K: {
        const int q5 = type == M40_TYPE_Q5_K;
        const int bs = q5 ? 176 : 144;
        for (int64_t b = 0; b < n / M40_QK_K; b++, p += bs, dst += M40_QK_K) {
            float d = rdh(p), dmin = rdh(p + 2);
            if (q5)
                unpack_q5_k(p + 16, p + 48, q);
            else
                unpack_q4_k(p + 16, q);
            for (int s = 0; s < 8; s++) {
                int sc, mn;
                scale_min_k4(p + 4, s, &sc, &mn);
                float dl = d * (float)sc, ml = dmin * (float)mn;
                for (int j = 0; j < 32; j++)
                    dst[32 * s + j] = dl * q[32 * s + j] - ml;
            }
        }
        return;
    }
    case M40_TYPE_Q6_K:
        for (int64_t b = 0; b < n / M40_QK_K; b++, p += 210, dst += M40_QK_K) {
            float d = rdh(p + 208);
            const int8_t *sc = (const int8_t *)(p + 192);
            unpack_q6_k(p, p + 128, q);
            for (int s = 0; s < 16; s++) {
                float dl = d * (float)sc[s];
                for (int j = 0; j < 16; j++)
                    dst[16 * s + j] = dl * q[16 * s + j];
            }
        }
        return;
    case M40_TYPE_MXFP4:
        for (int64_t b = 0; b < n / 32; b++, p += 17, dst += 32) {
            float d = mxfp4_scale(p[0]);
            unpack_mxfp4(p + 1, q);
            for (int j = 0; j < 32; j++)
                dst[j] = d * q[j];
        }
        return;
    default:
        memset(dst, 0, (size_t)(n > 0 ? n : 0) * sizeof(float));
        return;
    }
}

/* Per block: unpack the integers, take their dot with x per sub-block, then apply
 * the sub-block scale (and min) once: d*sc*sum(q*x) - dmin*m*sum(x). Each block's
 * contribution is a float; the blocks are summed in float too (a row is at most a
 * few hundred blocks, well within float's precision for this purpose). */
float m40_dot_row(uint32_t type, const void *src, const float *x, int64_t n)
{
    const uint8_t *p = src;
    float q[M40_QK_K];
    float total = 0.0f;

    switch (type) {
    case M40_TYPE_F32: {
        float a[M40_QK_K];
        /* Copy through a buffer: src may be unaligned inside the mapping. */
        for (int64_t i = 0; i < n; i += M40_QK_K) {
            int64_t m = n - i < M40_QK_K ? n - i : M40_QK_K;
            memcpy(a, p + 4 * i, (size_t)m * sizeof(float));
            total += dot_any(a, x + i, m);
        }
        return total;
    }
    case M40_TYPE_F16:
    case M40_TYPE_BF16: {
        const int bf = type == M40_TYPE_BF16;
        int64_t i = 0;
        for (; i + M40_QK_K <= n; i += M40_QK_K) {
            (bf ? bf16_chunk : f16_chunk)(p + 2 * i, q);
            total += dot8(q, x + i, M40_QK_K);
        }
        if (i < n) {
            for (int64_t j = 0; j < n - i; j++)
                q[j] = bf ? m40_bf16_to_fp32(rd16(p + 2 * (i + j))) : rdh(p + 2 * (i + j));
            total += dot_any(q, x + i, n - i);
        }
        return total;
    }
    case M40_TYPE_Q4_0:
        for (int64_t b = 0; b < n / 32; b++, p += 18, x += 32) {
            unpack_q4(p + 2, q, 8.0f);
            total += rdh(p) * dot8(q, x, 32);
        }
        return total;
    case M40_TYPE_Q4_1:
        for (int64_t b = 0; b < n / 32; b++, p += 20, x += 32) {
            unpack_q4(p + 4, q, 0.0f);
            total += rdh(p) * dot8(q, x, 32) + rdh(p + 2) * sum8(x, 32);
        }
        return total;
    case M40_TYPE_Q5_0:
        for (int64_t b = 0; b < n / 32; b++, p += 22, x += 32) {
            unpack_q5(p + 2, p + 6, q, 16.0f);
            total += rdh(p) * dot8(q, x, 32);
        }
        return total;
    case M40_TYPE_Q5_1:
        for (int64_t b = 0; b < n / 32; b++, p += 24, x += 32) {
            unpack_q5(p + 4, p + 8, q, 0.0f);
            total += rdh(p) * dot8(q, x, 32) + rdh(p + 2) * sum8(x, 32);
        }
        return total;
    case M40_TYPE_Q8_0:
        for (int64_t b = 0; b < n / 32; b++, p += 34, x += 32) {
            unpack_q8_0(p + 2, q);
            total += rdh(p) * dot8(q, x, 32);
        }
        return total;
    case M40_TYPE_Q2_K:
        for (int64_t b = 0; b < n / M40_QK_K; b++, p += 84, x += M40_QK_K) {
            float d = rdh(p + 80), dmin = rdh(p + 82), acc = 0.0f;
            unpack_q2_k(p + 16, q);
            for (int s = 0; s < 16; s++)
                acc += d * (float)(p[s] & 15) * dot8(q + 16 * s, x + 16 * s, 16) -
                       dmin * (float)(p[s] >> 4) * sum8(x + 16 * s, 16);
            total += acc;
        }
        return total;
    case M40_TYPE_Q3_K:
        for (int64_t b = 0; b < n / M40_QK_K; b++, p += 110, x += M40_QK_K) {
            float d = rdh(p + 108), acc = 0.0f;
            int sc[16];
            scales_q3_k(p + 96, sc);
            unpack_q3_k(p, p + 32, q);
            for (int s = 0; s < 16; s++)
                acc += (float)sc[s] * dot8(q + 16 * s, x + 16 * s, 16);
            total += d * acc;
        }
        return total;
    case M40_TYPE_Q4_K:
    case M40_TYPE_Q5_K: {
        const int q5 = type == M40_TYPE_Q5_K;
        const int bs = q5 ? 176 : 144;
        for (int64_t b = 0; b < n / M40_QK_K; b++, p += bs, x += M40_QK_K) {
            float d = rdh(p), dmin = rdh(p + 2), accq = 0.0f, accm = 0.0f;
            if (q5)
                unpack_q5_k(p + 16, p + 48, q);
            else
                unpack_q4_k(p + 16, q);
            for (int s = 0; s < 8; s++) {
                int sc, mn;
                scale_min_k4(p + 4, s, &sc, &mn);
                accq += (float)sc * dot8(q + 32 * s, x + 32 * s, 32);
                accm += (float)mn * sum8(x + 32 * s, 32);
            }
            total += d * accq - dmin * accm;
        }
        return total;
    }
    case M40_TYPE_Q6_K:
        for (int64_t b = 0; b < n / M40_QK_K; b++, p += 210, x += M40_QK_K) {
            float d = rdh(p + 208), acc = 0.0f;
            const int8_t *sc = (const int8_t *)(p + 192);
            unpack_q6_k(p, p + 128, q);
            for (int s = 0; s < 16; s++)
                acc += (float)sc[s] * dot8(q + 16 * s, x + 16 * s, 16);
            total += d * acc;
        }
        return total;
    case M40_TYPE_MXFP4:
        for (int64_t b = 0; b < n / 32; b++, p += 17, x += 32) {
            unpack_mxfp4(p + 1, q);
            total += mxfp4_scale(p[0]) * dot8(q, x, 32);
        }
        return total;
    default:
        return 0.0f;
    }
}

/* ------------------------------------------------------------- quantizers */

/* Largest sub-block the scale fits see (Q4_K: 32, Q6_K: 16). */
#define QK_FIT_MAX 32

static inline int clampi(int v, int lo, int hi)
{
    return v < lo ? lo : v > hi ? hi : v;
}

/* Round half away from zero; the exact tie rule does not matter for quality and
 * this is independent of the current rounding mode. */
static inline int roundi(float v)
{
    return (int)lroundf(v);
}

static void quantize_q8_0(const float *x, uint8_t *y, int64_t nb)
{
    for (int64_t b = 0; b < nb; b++, x += 32, y += 34) {
        float amax = 0.0f;
        for (int j = 0; j < 32; j++)
            amax = fmaxf(amax, fabsf(x[j]));
        uint16_t dh = m40_fp32_to_fp16(amax / 127.0f);
        /* Quantize against the scale as stored, so rounding of d is not an
         * extra systematic error. */
        float d = m40_fp16_to_fp32(dh), id = d != 0.0f ? 1.0f / d : 0.0f;
        wr16(y, dh);
        for (int j = 0; j < 32; j++)
            y[2 + j] = (uint8_t)(int8_t)clampi(roundi(x[j] * id), -127, 127);
    }
}

/* Q4_0 has 16 levels, -8..7: the element of largest magnitude is mapped to -8 so
 * that its sign gets the extra level, and the scale's sign follows it. */
static void quantize_q4_0(const float *x, uint8_t *y, int64_t nb)
{
    for (int64_t b = 0; b < nb; b++, x += 32, y += 18) {
        float vmax = 0.0f;
        for (int j = 0; j < 32; j++)
            if (fabsf(x[j]) > fabsf(vmax))
                vmax = x[j];
        uint16_t dh = m40_fp32_to_fp16(vmax / -8.0f);
        float d = m40_fp16_to_fp32(dh), id = d != 0.0f ? 1.0f / d : 0.0f;
        wr16(y, dh);
        for (int j = 0; j < 16; j++) {
            int a = clampi(roundi(x[j] * id) + 8, 0, 15);
            int c = clampi(roundi(x[j + 16] * id) + 8, 0, 15);
            y[2 + j] = (uint8_t)(a | (c << 4));
        }
    }
}

/* Q5_0 has 32 levels, -16..15: as Q4_0, the element of largest magnitude maps to -16.
 * The 5th bit of element j goes to bit j of qh (stored little-endian). */
static void quantize_q5_0(const float *x, uint8_t *y, int64_t nb)
{
    for (int64_t b = 0; b < nb; b++, x += 32, y += 22) {
        float vmax = 0.0f;
        for (int j = 0; j < 32; j++)
            if (fabsf(x[j]) > fabsf(vmax))
                vmax = x[j];
        uint16_t dh = m40_fp32_to_fp16(vmax / -16.0f);
        float d = m40_fp16_to_fp32(dh), id = d != 0.0f ? 1.0f / d : 0.0f;
        uint32_t qh = 0;
        wr16(y, dh);
        for (int j = 0; j < 16; j++) {
            int a = clampi(roundi(x[j] * id) + 16, 0, 31);
            int c = clampi(roundi(x[j + 16] * id) + 16, 0, 31);
            y[6 + j] = (uint8_t)((a & 15) | ((c & 15) << 4));
            qh |= (uint32_t)(a >> 4) << j | (uint32_t)(c >> 4) << (j + 16);
        }
        for (int k = 0; k < 4; k++)
            y[2 + k] = (uint8_t)(qh >> (8 * k));
    }
}

/* Q4_1 / Q5_1: x ~= d*L + m with L in 0..15 (0..31), m = min, d = (max - min)/levels,
 * levels chosen against d and m as stored in f16. */
static void quantize_q4_1_q5_1(const float *x, uint8_t *y, int64_t nb, int five)
{
    const int nmax = five ? 31 : 15, bb = five ? 24 : 20, qs_off = five ? 8 : 4;
    for (int64_t b = 0; b < nb; b++, x += 32, y += bb) {
        float lo = x[0], hi = x[0];
        for (int j = 1; j < 32; j++) {
            lo = fminf(lo, x[j]);
            hi = fmaxf(hi, x[j]);
        }
        uint16_t dh = m40_fp32_to_fp16((hi - lo) / (float)nmax), mh = m40_fp32_to_fp16(lo);
        float d = m40_fp16_to_fp32(dh), m = m40_fp16_to_fp32(mh), id = d != 0.0f ? 1.0f / d : 0.0f;
        uint32_t qh = 0;
        wr16(y, dh);
        wr16(y + 2, mh);
        for (int j = 0; j < 16; j++) {
            int a = clampi(roundi((x[j] - m) * id), 0, nmax);
            int c = clampi(roundi((x[j + 16] - m) * id), 0, nmax);
            y[qs_off + j] = (uint8_t)((a & 15) | ((c & 15) << 4));
            qh |= (uint32_t)(a >> 4) << j | (uint32_t)(c >> 4) << (j + 16);
        }
        if (five)
            for (int k = 0; k < 4; k++)
                y[4 + k] = (uint8_t)(qh >> (8 * k));
    }
}

/* Fit x ~= s*L - m with L in 0..nmax, s >= 0, m >= 0 (the K-quant "scale and
 * min" form). A handful of candidate steps around (max-min)/nmax are tried; for
 * each, levels are assigned and (s, m) refit by least squares; the lowest squared
 * error wins. */
static void fit_scale_min(const float *x, int n, int nmax, int steps, float *s_out, float *m_out)
{
    float xmin = 0.0f, xmax = x[0];
    for (int i = 0; i < n; i++) {
        xmin = fminf(xmin, x[i]);
        xmax = fmaxf(xmax, x[i]);
    }
    if (!(xmax > xmin)) { /* all zero or all equal and negative */
        *s_out = 0.0f;
        *m_out = -xmin;
        return;
    }
    float best_s = (xmax - xmin) / (float)nmax, best_m = -xmin, best_err = INFINITY;
    for (int step = -steps; step <= steps; step++) {
        float iscale = ((float)nmax + 0.1f * (float)step) / (xmax - xmin);
        double sl = 0, sll = 0, sx = 0, slx = 0;
        int L[QK_FIT_MAX];
        for (int i = 0; i < n; i++) {
            L[i] = clampi(roundi(iscale * (x[i] - xmin)), 0, nmax);
            sl += L[i];
            sll += (double)L[i] * L[i];
            sx += x[i];
            slx += (double)L[i] * x[i];
        }
        double det = n * sll - sl * sl, s, off;
        if (det <= 0)
            continue;
        s = (n * slx - sl * sx) / det;
        off = (sll * sx - sl * slx) / det; /* x ~= s*L + off */
        if (off > 0) { /* a positive offset is not representable (m >= 0) */
            off = 0;
            s = sll > 0 ? slx / sll : 0;
        }
        if (s < 0)
            continue;
        double err = 0;
        for (int i = 0; i < n; i++) {
            double e = s * L[i] + off - x[i];
            err += e * e;
        }
        if (err < best_err) {
            best_err = (float)err;
            best_s = (float)s;
            best_m = (float)-off;
        }
    }
    *s_out = best_s;
    *m_out = best_m;
}

static void quantize_q4_k(const float *x, uint8_t *y, int64_t nb, int search)
{
    for (int64_t b = 0; b < nb; b++, x += M40_QK_K, y += 144) {
        float s[8], m[8], smax = 0.0f, mmax = 0.0f;
        for (int j = 0; j < 8; j++) {
            fit_scale_min(x + 32 * j, 32, 15, search ? 8 : 0, &s[j], &m[j]);
            smax = fmaxf(smax, s[j]);
            mmax = fmaxf(mmax, m[j]);
        }
        uint16_t dh = m40_fp32_to_fp16(smax / 63.0f), mh = m40_fp32_to_fp16(mmax / 63.0f);
        float d = m40_fp16_to_fp32(dh), dmin = m40_fp16_to_fp32(mh);
        int sc[8], mn[8];
        for (int j = 0; j < 8; j++) {
            sc[j] = d > 0.0f ? clampi(roundi(s[j] / d), 0, 63) : 0;
            mn[j] = dmin > 0.0f ? clampi(roundi(m[j] / dmin), 0, 63) : 0;
        }
        wr16(y, dh);
        wr16(y + 2, mh);
        uint8_t *sb = y + 4;
        for (int j = 0; j < 4; j++) {
            sb[j] = (uint8_t)((sc[j] & 63) | ((sc[j + 4] >> 4) << 6));
            sb[j + 4] = (uint8_t)((mn[j] & 63) | ((mn[j + 4] >> 4) << 6));
            sb[j + 8] = (uint8_t)((sc[j + 4] & 15) | ((mn[j + 4] & 15) << 4));
        }
        /* Levels are chosen against the scales as stored (6-bit, fp16 super
         * scales), not the ideal ones, so the rounding of scales costs little. */
        uint8_t L[M40_QK_K];
        for (int j = 0; j < 8; j++) {
            float dl = d * (float)sc[j], ml = dmin * (float)mn[j];
            for (int i = 0; i < 32; i++)
                L[32 * j + i] = dl > 0.0f ? (uint8_t)clampi(roundi((x[32 * j + i] + ml) / dl), 0, 15) : 0;
        }
        uint8_t *qs = y + 16;
        for (int c = 0; c < 4; c++)
            for (int l = 0; l < 32; l++)
                qs[32 * c + l] = (uint8_t)(L[64 * c + l] | (L[64 * c + 32 + l] << 4));
    }
}

/* Symmetric fit x ~= s*L with L in -nmax..nmax-1: candidates map the largest
 * magnitude near -nmax (the extra negative level), each refit by least squares. */
static float fit_scale_sym(const float *x, int n, int nmax, int steps)
{
    float vmax = 0.0f;
    for (int i = 0; i < n; i++)
        if (fabsf(x[i]) > fabsf(vmax))
            vmax = x[i];
    if (vmax == 0.0f)
        return 0.0f;
    float best_s = vmax / (float)-nmax, best_err = INFINITY;
    for (int step = -steps; step <= steps; step++) {
        float iscale = -((float)nmax + 0.1f * (float)step) / vmax;
        double slx = 0, sll = 0;
        int L[QK_FIT_MAX];
        for (int i = 0; i < n; i++) {
            L[i] = clampi(roundi(iscale * x[i]), -nmax, nmax - 1);
            slx += (double)L[i] * x[i];
            sll += (double)L[i] * L[i];
        }
        if (sll <= 0)
            continue;
        double s = slx / sll, err = 0;
        for (int i = 0; i < n; i++) {
            double e = s * L[i] - x[i];
            err += e * e;
        }
        if (err < best_err) {
            best_err = (float)err;
            best_s = (float)s;
        }
    }
    return best_s;
}

static void quantize_q6_k(const float *x, uint8_t *y, int64_t nb, int search)
{
    for (int64_t b = 0; b < nb; b++, x += M40_QK_K, y += 210) {
        float s[16], amax = 0.0f;
        for (int j = 0; j < 16; j++) {
            s[j] = fit_scale_sym(x + 16 * j, 16, 32, search ? 6 : 0);
            amax = fmaxf(amax, fabsf(s[j]));
        }
        uint16_t dh = m40_fp32_to_fp16(amax / 127.0f);
        float d = m40_fp16_to_fp32(dh);
        int8_t *sc = (int8_t *)(y + 192);
        uint8_t L[M40_QK_K];
        for (int j = 0; j < 16; j++) {
            int v = d > 0.0f ? clampi(roundi(s[j] / d), -127, 127) : 0;
            sc[j] = (int8_t)v;
            float dl = d * (float)v;
            for (int i = 0; i < 16; i++)
                L[16 * j + i] =
                    (uint8_t)(dl != 0.0f ? clampi(roundi(x[16 * j + i] / dl), -32, 31) + 32 : 32);
        }
        wr16(y + 208, dh);
        uint8_t *ql = y, *qh = y + 128;
        memset(y, 0, 192);
        for (int e = 0; e < M40_QK_K; e++) {
            int n = e / 128, w = e % 128, k = w / 32, l = w % 32;
            int v = L[e];
            ql[64 * n + l + 32 * (k & 1)] |= (uint8_t)((v & 15) << (k >= 2 ? 4 : 0));
            qh[32 * n + l] |= (uint8_t)((v >> 4) << (2 * k));
        }
    }
}

/* Nearest MXFP4 nibble to v (in units of the block scale): the magnitude by comparing
 * with the midpoints of the levels 0, 1, 2, 3, 4, 6, 8, 12 (a tie goes to the smaller),
 * the sign bit only for a non-zero magnitude so that 0 is always nibble 0. */
static inline int mxfp4_nearest(float v)
{
    static const float mid[7] = {0.5f, 1.5f, 2.5f, 3.5f, 5.0f, 7.0f, 10.0f};
    float a = fabsf(v);
    int m = 0;
    while (m < 7 && a > mid[m])
        m++;
    return m && v < 0 ? m | 8 : m;
}

/* Per block the scale is a power of two, so the only choice is e. With amax / 12 in
 * [2^(k-1), 2^k), the smallest e with 12 * 2^(e-128) >= amax (every element in range) is
 * k + 128, or k + 127 when amax / 12 is exactly 2^(k-1); one less than that trades
 * clipping the largest for finer steps elsewhere, and k + 129 guards against the
 * rounding of amax / 12. Each candidate is scored by its squared error and the best
 * kept (ties: the smaller e). */
static void quantize_mxfp4(const float *x, uint8_t *y, int64_t nb)
{
    for (int64_t b = 0; b < nb; b++, x += 32, y += 17) {
        float amax = 0.0f;
        for (int j = 0; j < 32; j++)
            amax = fmaxf(amax, fabsf(x[j]));
        memset(y, 0, 17);
        if (!(amax > 0.0f) || !isfinite(amax))
            continue; /* zeros (or garbage): scale 2^-128, all levels 0 */
        int k;
        frexpf(amax / 12.0f, &k); /* amax / 12 in [2^(k-1), 2^k) */
        int best_e = clampi(k + 128, 0, 254);
        double best_err = INFINITY;
        for (int e = k + 126; e <= k + 129; e++) {
            int ec = clampi(e, 0, 254);
            /* x / d, not x * (1 / d): 1 / 2^-128 overflows; dividing by a power of two is exact */
            float d = mxfp4_scale((uint8_t)ec);
            double err = 0;
            for (int j = 0; j < 32; j++) {
                double r = (double)x[j] - (double)d * mxfp4_levels[mxfp4_nearest(x[j] / d)];
                err += r * r;
            }
            if (err < best_err) {
                best_err = err;
                best_e = ec;
            }
        }
        float d = mxfp4_scale((uint8_t)best_e);
        y[0] = (uint8_t)best_e;
        for (int j = 0; j < 16; j++)
            y[1 + j] = (uint8_t)(mxfp4_nearest(x[j] / d) | (mxfp4_nearest(x[j + 16] / d) << 4));
    }
}

static int quantize_row(uint32_t type, const float *src, void *dst, int64_t n, int search)
{
    uint8_t *y = dst;
    switch (type) {
    case M40_TYPE_F32:
        memcpy(dst, src, (size_t)n * sizeof(float));
        return 0;
    case M40_TYPE_F16:
        for (int64_t i = 0; i < n; i++)
            wr16(y + 2 * i, m40_fp32_to_fp16(src[i]));
        return 0;
    case M40_TYPE_BF16:
        for (int64_t i = 0; i < n; i++)
            wr16(y + 2 * i, m40_fp32_to_bf16(src[i]));
        return 0;
    case M40_TYPE_Q8_0:
        if (n % 32)
            return -1;
        quantize_q8_0(src, y, n / 32);
        return 0;
    case M40_TYPE_Q4_0:
        if (n % 32)
            return -1;
        quantize_q4_0(src, y, n / 32);
        return 0;
    case M40_TYPE_Q4_1:
    case M40_TYPE_Q5_1:
        if (n % 32)
            return -1;
        quantize_q4_1_q5_1(src, y, n / 32, type == M40_TYPE_Q5_1);
        return 0;
    case M40_TYPE_Q5_0:
        if (n % 32)
            return -1;
        quantize_q5_0(src, y, n / 32);
        return 0;
    case M40_TYPE_Q4_K:
        if (n % M40_QK_K)
            return -1;
        quantize_q4_k(src, y, n / M40_QK_K, search);
        return 0;
    case M40_TYPE_Q6_K:
        if (n % M40_QK_K)
            return -1;
        quantize_q6_k(src, y, n / M40_QK_K, search);
        return 0;
    case M40_TYPE_MXFP4:
        if (n % 32)
            return -1;
        quantize_mxfp4(src, y, n / 32);
        return 0;
    default:
        return -1;
    }
}

int m40_quantize_row(uint32_t type, const float *src, void *dst, int64_t n)
{
    return quantize_row(type, src, dst, n, 1);
}

int m40_quantize_row_quick(uint32_t type, const float *src, void *dst, int64_t n)
{
    return quantize_row(type, src, dst, n, 0);
}
