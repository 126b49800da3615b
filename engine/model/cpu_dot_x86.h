/* The x86 SIMD kernels of the fast CPU path, written once and compiled twice: by
 * cpu_dot_avx2.c (AVX2: int16 products through pmaddwd) and by cpu_dot_avx512.c
 * (AVX-512 VNNI on 256-bit vectors: vpdpwssd). The includer defines
 *   X86_TARGET   the target attribute string (so the build needs no -march flag and the
 *                binary runs on any x86-64; the dispatch in cpu_dot.c checks the CPU),
 *   X86_NAME(n)  the kernel's name in this instance,
 *   x86_dotw     (lo, hi, q): the 16-bit weights lo (elements 0..15) and hi (16..31)
 *                times the record's int16 q -> 8 int32 lanes, each the sum of 4 products;
 *   x86_dotw_acc (acc, lo, hi, q): acc + x86_dotw(lo, hi, q),
 * and X86_MASKS where the target has AVX-512BW (its byte masks).
 * The twins are the portable kernels of cpu_dot.c: the same integers per block, the F32
 * sums in another order (8 lanes per block, added across blocks, reduced at the end). */
#include <immintrin.h>
#include <string.h>

#include "cpu_dot.h"
#include "ref/ggml_types.h"

#define X86_FN static inline __attribute__((target(X86_TARGET), always_inline))
#define X86_KERNEL static __attribute__((target(X86_TARGET)))

X86_FN float x86_f16(const uint8_t *p)
{
    uint16_t h;
    memcpy(&h, p, sizeof h);
    return _cvtsh_ss(h);
}

X86_FN float x86_hsum(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* acc += scale * (F32) int32 lanes */
X86_FN __m256 x86_acc(__m256 acc, float scale, __m256i p)
{
    return _mm256_fmadd_ps(_mm256_set1_ps(scale), _mm256_cvtepi32_ps(p), acc);
}

/* 16 bytes of nibbles into 32 levels: the low nibbles first (elements 0..15), the high
 * nibbles after (16..31), the order of Q4_0/Q4_1/Q5_0/Q5_1. */
X86_FN __m256i x86_nibbles(const uint8_t *qs)
{
    __m128i v = _mm_loadu_si128((const __m128i *)(const void *)qs);
    const __m128i m = _mm_set1_epi8(15);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), m), _mm_and_si128(v, m));
}

/* Bit i of qh as 0x10 in byte i (Q5_0/Q5_1's 5th bit): one byte-masked move where the
 * includer has AVX-512BW's mask registers (X86_MASKS), else a shuffle and a compare. */
X86_FN __m256i x86_bit5(const uint8_t *qh4)
{
    uint32_t qh;
    memcpy(&qh, qh4, sizeof qh);
#ifdef X86_MASKS
    return _mm256_maskz_mov_epi8((__mmask32)qh, _mm256_set1_epi8(0x10));
#else
    __m256i b = _mm256_shuffle_epi8(_mm256_set1_epi32((int)qh),
                                    _mm256_setr_epi64x(0, 0x0101010101010101LL, 0x0202020202020202LL,
                                                       0x0303030303030303LL));
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    b = _mm256_cmpeq_epi8(_mm256_and_si256(b, bit), bit);
    return _mm256_and_si256(b, _mm256_set1_epi8(0x10));
#endif
}

/* Software prefetch X86_PF bytes ahead of the block being read. The weights stream from
 * memory once per product (decode), and a block's few dozen instructions keep too few
 * cache lines in flight for the memory latency: without it a core reads a quarter of the
 * bandwidth a plain copy gets. The next rows follow the current one in memory, so
 * reading ahead across a row's end is useful too (and never faults). */
#define X86_PF 2048
X86_FN void x86_prefetch(const uint8_t *w, int bytes)
{
    for (int o = 0; o < bytes; o += 64)
        _mm_prefetch((const char *)(w + X86_PF + o), _MM_HINT_T0);
}

/* 32 unsigned 8-bit levels widened to 16 bits: elements 0..15 and 16..31. */
X86_FN void x86_widen(__m256i u, __m256i *lo, __m256i *hi)
{
    *lo = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(u));
    *hi = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(u, 1));
}

/* Each quantized kernel is written once for nt tokens (1, 4 or 8) of one weight row:
 * the weights are loaded and unpacked once per block and met by every token's record
 * (x + t * xs), and every token's sums take exactly the steps of the one-token kernel,
 * so a product is the same bits whichever computed it (batched and unbatched outputs
 * agree). */
#define X86_NT_MAX 8
/* (the token loops are unrolled: acc[] and corr[] then live in registers, not on the
 * stack, where each block's update would wait on a store) */

/* The 32-block types: Q8_0 (q8 1), Q4_0 (five 0, min 0), Q4_1 (min 1), Q5_0 (five 1),
 * Q5_1 (both); the block's bytes are d | [m] | [qh] | qs (Q8_0: d | 32 int8). Q4_0's
 * and Q5_0's offsets come off the widened levels, once a row and block for all the
 * tokens; Q4_1's and Q5_1's mins per block and token through the record's s. */
X86_FN void x86_q32(const uint8_t *w, const m40_xq *x, int64_t xs, int64_t kb0, int64_t kb1, int q8, int five,
                    int min, int nt, __m256 *acc, float *corr)
{
    const int64_t bytes = q8 ? 34 : 18 + (five ? 4 : 0) + (min ? 2 : 0);
    const int qs_off = 2 + (five ? 4 : 0) + (min ? 2 : 0), qh_off = min ? 4 : 2;
    w += bytes * kb0;
    for (int64_t b = kb0; b < kb1; b++, w += bytes) {
        x86_prefetch(w, (int)bytes);
        __m256i lo, hi;
        if (q8) {
            lo = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(const void *)(w + 2)));
            hi = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(const void *)(w + 18)));
        } else {
            __m256i u = x86_nibbles(w + qs_off);
            if (five)
                u = _mm256_or_si256(u, x86_bit5(w + qh_off));
            x86_widen(u, &lo, &hi);
            if (!min) {
                const __m256i o = _mm256_set1_epi16(five ? 16 : 8);
                lo = _mm256_sub_epi16(lo, o);
                hi = _mm256_sub_epi16(hi, o);
            }
        }
        const float d = x86_f16(w), m = min ? x86_f16(w + 2) : 0.0f;
        _Pragma("GCC unroll 8")
        for (int t = 0; t < nt; t++) {
            const m40_xq *xb = &x[t * xs + b];
            acc[t] = x86_acc(acc[t], d * xb->d, x86_dotw(lo, hi, xb->q));
            if (min)
                corr[t] += m * xb->s;
        }
    }
}

/* One block of 32 weights as 16-bit levels, less an offset, times their scales (the
 * K-quants' sub-block scales, small integers), and its product with an activation block
 * added into int32 lanes. 256-bit vectors in both instances: 512-bit ones, one
 * vpdpwssd a block, were slower on Zen 4 (BENCHMARKS.md, twenty-second session). */
typedef struct {
    __m256i lo, hi;
} x86_wblk;
X86_FN x86_wblk x86_wblk_make(__m256i u, int off, int s0, int s1)
{
    x86_wblk b;
    x86_widen(u, &b.lo, &b.hi);
    if (off) {
        b.lo = _mm256_sub_epi16(b.lo, _mm256_set1_epi16((short)off));
        b.hi = _mm256_sub_epi16(b.hi, _mm256_set1_epi16((short)off));
    }
    b.lo = _mm256_mullo_epi16(b.lo, _mm256_set1_epi16((short)s0));
    b.hi = _mm256_mullo_epi16(b.hi, _mm256_set1_epi16((short)s1));
    return b;
}
X86_FN __m256i x86_wblk_dot(__m256i a, x86_wblk w, const int16_t *q) { return x86_dotw_acc(a, w.lo, w.hi, q); }

/* Q4_K (five 0) and Q5_K: sub-block 2c + h takes the low (h 0) or high nibbles of
 * qs[32c..32c+32), Q5_K bit 2c + h of qh[l] as the 5th bit (cpu_dot.c, dot_qk_k). The
 * 6-bit sub-block scale multiplies the widened levels in 16 bits (63 * 31 fits), so the
 * whole super-block is one sum of int32 lanes (each lane 32 products of at most 1953 *
 * 32767: 2.05e9, no overflow) taken to F32 once, times d and the super-block's shared
 * activation scale (m40_xq_quantize); the mins come off as dmin * sum_j mn_j s_j, the
 * eight records' s one vector load from xsum (a gather from the records, or scalar
 * products, cost far more: BENCHMARKS.md). */
X86_FN void x86_qk_k(const uint8_t *w, const m40_xq *x, const float *xsum, int64_t xs, int64_t kb0, int64_t kb1,
                     int five, int nt, __m256 *acc, float *corr)
{
    (void)corr;
    const int64_t bytes = five ? 176 : 144;
    const __m256i m4 = _mm256_set1_epi8(15);
    w += bytes * (kb0 / 8);
    for (int64_t b = kb0 / 8; b < kb1 / 8; b++, w += bytes) {
        x86_prefetch(w, (int)bytes);
        const float d = x86_f16(w), dmin = x86_f16(w + 2);
        uint64_t sc, mn; /* byte j: sub-block j's scale, min */
        m40_q4_k_scales8(w, &sc, &mn);
        const __m256 mnv = _mm256_mul_ps(_mm256_set1_ps(dmin),
                                         _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)mn))));
        const uint8_t *qs = w + (five ? 48 : 16);
        const __m256i qh = five ? _mm256_loadu_si256((const __m256i *)(const void *)(w + 16)) : _mm256_setzero_si256();
        /* one token: the odd sub-blocks into a second sum (iacc2), so that two vpdpwssd
         * chains run instead of one: the sums' lanes add up to the same integers */
        __m256i iacc[X86_NT_MAX], iacc2 = _mm256_setzero_si256();
        _Pragma("GCC unroll 8")
        for (int t = 0; t < nt; t++)
            iacc[t] = _mm256_setzero_si256();
        for (int c = 0; c < 4; c++) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(const void *)(qs + 32 * c));
            __m256i u0 = _mm256_and_si256(v, m4), u1 = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
            if (five) {
                const __m256i b0 = _mm256_set1_epi8((char)(1 << (2 * c))), b1 = _mm256_set1_epi8((char)(2 << (2 * c)));
                const __m256i h5 = _mm256_set1_epi8(0x10);
                u0 = _mm256_or_si256(u0, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, b0), b0), h5));
                u1 = _mm256_or_si256(u1, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, b1), b1), h5));
            }
            const int s0 = (int)((sc >> (16 * c)) & 0xff), s1 = (int)((sc >> (16 * c + 8)) & 0xff);
            const x86_wblk w0 = x86_wblk_make(u0, 0, s0, s0), w1 = x86_wblk_make(u1, 0, s1, s1);
            _Pragma("GCC unroll 8")
            for (int t = 0; t < nt; t++) {
                const m40_xq *x0 = &x[t * xs + 8 * b + 2 * c];
                iacc[t] = x86_wblk_dot(iacc[t], w0, x0->q);
                if (nt == 1)
                    iacc2 = x86_wblk_dot(iacc2, w1, x0[1].q);
                else
                    iacc[t] = x86_wblk_dot(iacc[t], w1, x0[1].q);
            }
        }
        _Pragma("GCC unroll 8")
        for (int t = 0; t < nt; t++) {
            const m40_xq *xb = &x[t * xs + 8 * b];
            const __m256i sum = nt == 1 ? _mm256_add_epi32(iacc[t], iacc2) : iacc[t];
            acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(d * xb->d), _mm256_cvtepi32_ps(sum), acc[t]);
            acc[t] = _mm256_fnmadd_ps(mnv, _mm256_loadu_ps(xsum + t * xs + 8 * b), acc[t]);
        }
    }
}

/* Q6_K: quarter k of half n is activation block 4n + k (cpu_dot.c, dot_q6_k). Each
 * block's two halves of 16 take their own scales, applied to the widened signed levels
 * (level - 32) in 16 bits ((-32) * (-128) = 4096 fits), so there is no offset to take
 * off; a half super-block (4 blocks) is one sum of int32 lanes (each lane 16 products
 * of at most 4096 * 32767: 2,147,418,112, no overflow), taken to F32 once, times d and
 * the super-block's shared activation scale. */
X86_FN void x86_q6_k(const uint8_t *w, const m40_xq *x, const float *xsum, int64_t xs, int64_t kb0, int64_t kb1,
                     int nt, __m256 *acc, float *corr)
{
    (void)corr, (void)xsum;
    const __m256i m4 = _mm256_set1_epi8(15);
    w += 210 * (kb0 / 8);
    for (int64_t b = kb0 / 8; b < kb1 / 8; b++, w += 210) {
        x86_prefetch(w, 210);
        const int8_t *sc = (const int8_t *)(w + 192);
        float d = x86_f16(w + 208);
        for (int n = 0; n < 2; n++) {
            __m256i A = _mm256_loadu_si256((const __m256i *)(const void *)(w + 64 * n));
            __m256i B = _mm256_loadu_si256((const __m256i *)(const void *)(w + 64 * n + 32));
            __m256i H = _mm256_loadu_si256((const __m256i *)(const void *)(w + 128 + 32 * n));
            __m256i u[4];
            u[0] = _mm256_or_si256(_mm256_and_si256(A, m4), _mm256_slli_epi16(_mm256_and_si256(H, _mm256_set1_epi8(3)), 4));
            u[1] = _mm256_or_si256(_mm256_and_si256(B, m4),
                                   _mm256_slli_epi16(_mm256_and_si256(H, _mm256_set1_epi8(0x0c)), 2));
            u[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(A, 4), m4),
                                   _mm256_and_si256(H, _mm256_set1_epi8(0x30)));
            u[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(B, 4), m4),
                                   _mm256_srli_epi16(_mm256_and_si256(H, _mm256_set1_epi8((char)0xc0)), 2));
            __m256i iacc[X86_NT_MAX], iacc2 = _mm256_setzero_si256(); /* as in x86_qk_k */
            _Pragma("GCC unroll 8")
            for (int t = 0; t < nt; t++)
                iacc[t] = _mm256_setzero_si256();
            for (int k = 0; k < 4; k++) {
                const int jb = 4 * n + k;
                const x86_wblk wb = x86_wblk_make(u[k], 32, sc[2 * jb], sc[2 * jb + 1]);
                _Pragma("GCC unroll 8")
                for (int t = 0; t < nt; t++) {
                    if (nt == 1 && (k & 1))
                        iacc2 = x86_wblk_dot(iacc2, wb, x[t * xs + 8 * b + jb].q);
                    else
                        iacc[t] = x86_wblk_dot(iacc[t], wb, x[t * xs + 8 * b + jb].q);
                }
            }
            _Pragma("GCC unroll 8")
            for (int t = 0; t < nt; t++)
                acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(d * x[t * xs + 8 * b].d),
                                         _mm256_cvtepi32_ps(nt == 1 ? _mm256_add_epi32(iacc[t], iacc2) : iacc[t]),
                                         acc[t]);
        }
    }
}

/* A product's result from its state: the lanes summed (x86_hsum's order), plus the
 * min term where the type has one (min: Q4_1, Q5_1; the others keep theirs in the
 * lanes). */
X86_FN float x86_fin(__m256 acc, float corr, int min)
{
    const float s = x86_hsum(acc);
    return min ? s + corr : s;
}

/* One register tile of the piecewise kernel: the states of NTK tokens (st[0..NTK)) in,
 * the body (call) over the blocks, the states out. */
#define X86_PART_TILE(NTK, call)                                                                       \
    do {                                                                                               \
        __m256 acc[NTK];                                                                               \
        float corr[NTK];                                                                               \
        _Pragma("GCC unroll 8") for (int t = 0; t < NTK; t++) acc[t] = _mm256_loadu_ps(st[t].v),       \
                                                             corr[t] = st[t].corr;                     \
        const int nt = NTK;                                                                            \
        call;                                                                                          \
        _Pragma("GCC unroll 8") for (int t = 0; t < NTK; t++) _mm256_storeu_ps(st[t].v, acc[t]),       \
                                                             st[t].corr = corr[t];                     \
    } while (0)

/* Each type's kernels from its body: the one-token product over the whole row, and the
 * piecewise one (blocks [kb0, kb1) into the tokens' states, 8 or 4 tokens a register
 * tile, then one at a time). Both run the same operations per token in the same order,
 * so a product is the same bits whichever computed it, and however its row was cut. */
#define X86_QUANT_KERNELS(name, min, call)                                                             \
    X86_KERNEL float X86_NAME(name)(const uint8_t *w, const m40_xq *x, const float *xsum, int64_t K)   \
    {                                                                                                  \
        __m256 acc[1] = {_mm256_setzero_ps()};                                                         \
        float corr[1] = {0.0f};                                                                        \
        const int64_t xs = 0, kb0 = 0, kb1 = K / 32;                                                   \
        const int nt = 1;                                                                              \
        call;                                                                                          \
        return x86_fin(acc[0], corr[0], min);                                                          \
    }                                                                                                  \
    X86_KERNEL void X86_NAME(name##_part)(const uint8_t *w, const m40_xq *x, const float *xsum, int64_t xs,    \
                                          int64_t kb0, int64_t kb1, int ntok, m40_dot_state *st)       \
    {                                                                                                  \
        for (; ntok >= 8; ntok -= 8, x += 8 * xs, xsum += 8 * xs, st += 8)                             \
            X86_PART_TILE(8, call);                                                                    \
        if (ntok >= 4) {                                                                               \
            X86_PART_TILE(4, call);                                                                    \
            ntok -= 4, x += 4 * xs, xsum += 4 * xs, st += 4;                                           \
        }                                                                                              \
        for (; ntok > 0; ntok--, x += xs, xsum += xs, st++)                                            \
            X86_PART_TILE(1, call);                                                                    \
    }                                                                                                  \
    X86_KERNEL float X86_NAME(name##_fin)(const m40_dot_state *st)                                     \
    {                                                                                                  \
        return x86_fin(_mm256_loadu_ps(st->v), st->corr, min);                                         \
    }

X86_QUANT_KERNELS(q8_0, 0, x86_q32(w, x, xs, kb0, kb1, 1, 0, 0, nt, acc, corr))
X86_QUANT_KERNELS(q4_0, 0, x86_q32(w, x, xs, kb0, kb1, 0, 0, 0, nt, acc, corr))
X86_QUANT_KERNELS(q4_1, 1, x86_q32(w, x, xs, kb0, kb1, 0, 0, 1, nt, acc, corr))
X86_QUANT_KERNELS(q5_0, 0, x86_q32(w, x, xs, kb0, kb1, 0, 1, 0, nt, acc, corr))
X86_QUANT_KERNELS(q5_1, 1, x86_q32(w, x, xs, kb0, kb1, 0, 1, 1, nt, acc, corr))
X86_QUANT_KERNELS(q4_k, 0, x86_qk_k(w, x, xsum, xs, kb0, kb1, 0, nt, acc, corr))
X86_QUANT_KERNELS(q5_k, 0, x86_qk_k(w, x, xsum, xs, kb0, kb1, 1, nt, acc, corr))

X86_QUANT_KERNELS(q6_k, 0, x86_q6_k(w, x, xsum, xs, kb0, kb1, nt, acc, corr))

X86_KERNEL float X86_NAME(f16)(const uint8_t *w, const float *x, int64_t K)
{
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
    int64_t i = 0;
#define F16_AT(o) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)(w + 2 * (i + (o)))))
    for (; i + 32 <= K; i += 32) {
        a0 = _mm256_fmadd_ps(F16_AT(0), _mm256_loadu_ps(x + i), a0);
        a1 = _mm256_fmadd_ps(F16_AT(8), _mm256_loadu_ps(x + i + 8), a1);
        a2 = _mm256_fmadd_ps(F16_AT(16), _mm256_loadu_ps(x + i + 16), a2);
        a3 = _mm256_fmadd_ps(F16_AT(24), _mm256_loadu_ps(x + i + 24), a3);
    }
    for (; i + 8 <= K; i += 8)
        a0 = _mm256_fmadd_ps(F16_AT(0), _mm256_loadu_ps(x + i), a0);
#undef F16_AT
    float s = x86_hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
    for (; i < K; i++)
        s += x86_f16(w + 2 * i) * x[i];
    return s;
}

X86_KERNEL float X86_NAME(f32)(const uint8_t *w, const float *x, int64_t K)
{
    const float *f = (const float *)(const void *)w;
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 32 <= K; i += 32) {
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(f + i), _mm256_loadu_ps(x + i), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(f + i + 8), _mm256_loadu_ps(x + i + 8), a1);
        a2 = _mm256_fmadd_ps(_mm256_loadu_ps(f + i + 16), _mm256_loadu_ps(x + i + 16), a2);
        a3 = _mm256_fmadd_ps(_mm256_loadu_ps(f + i + 24), _mm256_loadu_ps(x + i + 24), a3);
    }
    for (; i + 8 <= K; i += 8)
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(f + i), _mm256_loadu_ps(x + i), a0);
    float s = x86_hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
    for (; i < K; i++)
        s += f[i] * x[i];
    return s;
}

/* m40_xq_quantize's twin (cpu_dot.c), the same records bit for bit: the same amax (of
 * the block, or of its super-block of 8 where K is a multiple of 256), the same d =
 * amax / 32767 and id = 1 / d, x * id rounded to nearest even (as nearbyintf in the
 * default rounding mode) and clamped to +-32767. */
X86_KERNEL void X86_NAME(quantize)(const float *x, int64_t K, m40_xq *out)
{
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const int span = K % 256 == 0 ? 8 : 1; /* blocks that share one scale */
    for (int64_t b0 = 0; b0 < K / 32; b0 += span) {
        __m256 m = _mm256_setzero_ps();
        for (int i = 0; i < 4 * span; i++)
            m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + 32 * b0 + 8 * i)));
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        h = _mm_max_ss(h, _mm_movehdup_ps(h));
        float amax = _mm_cvtss_f32(h);
        float d = amax / 32767.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
        __m256 vid = _mm256_set1_ps(id);
        const __m256 lim = _mm256_set1_ps(32767.0f), nlim = _mm256_set1_ps(-32767.0f);
        for (int64_t b = b0; b < b0 + span; b++) {
            __m256i q[4];
            for (int i = 0; i < 4; i++) {
                __m256 r = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x + 32 * b + 8 * i), vid),
                                           _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                q[i] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(r, nlim), lim));
            }
            /* int32 -> int16 in element order: packs works within 128-bit lanes, so the
             * permute puts the 64-bit quarters back in order */
            __m256i p16a = _mm256_permute4x64_epi64(_mm256_packs_epi32(q[0], q[1]), 0xd8);
            __m256i p16b = _mm256_permute4x64_epi64(_mm256_packs_epi32(q[2], q[3]), 0xd8);
            m40_xq *r = &out[b];
            _mm256_storeu_si256((__m256i *)(void *)r->q, p16a);
            _mm256_storeu_si256((__m256i *)(void *)(r->q + 16), p16b);
            /* the integer sums of each half */
            __m256i s32 = _mm256_add_epi32(q[0], q[1]), t32 = _mm256_add_epi32(q[2], q[3]);
            __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s32), _mm256_extracti128_si256(s32, 1));
            __m128i t4 = _mm_add_epi32(_mm256_castsi256_si128(t32), _mm256_extracti128_si256(t32, 1));
            s4 = _mm_hadd_epi32(s4, t4);
            s4 = _mm_hadd_epi32(s4, s4);
            int lo = _mm_cvtsi128_si32(s4), hi = _mm_extract_epi32(s4, 1);
            r->d = d;
            r->s = d * (float)(lo + hi);
            r->h[0] = lo;
            r->h[1] = hi;
        }
    }
}

/* y[i] += a * x[i] (the fast path's attention: probabilities times V rows). */
X86_KERNEL void X86_NAME(axpy)(float *y, float a, const float *x, int64_t n)
{
    __m256 va = _mm256_set1_ps(a);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
    for (; i < n; i++)
        y[i] += a * x[i];
}

/* e^x, 8 lanes: 2^n e^r with n = rint(x log2 e), r = x - n ln 2 (ln 2 in two parts, so r
 * is exact), e^r by its Taylor polynomial of degree 6 (|r| <= 0.35: error below 2^-24
 * relative); x clamped to [-87.3, 88.7] so that 2^n is a normal F32 (below, e^x is
 * within 2^-126 of 0; above, a finite 3.4e38 where expf gives inf: the callers divide by
 * 1 + e^x, and get 0 either way). */
X86_FN __m256 x86_exp(__m256 x)
{
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.7f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.0f / 720.0f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/* 8 lanes of gate = gate * up / (1 + e^(-a(gate))) */
X86_FN __m256 x86_glu8(__m256 x, __m256 u, int gelu)
{
    const __m256 one = _mm256_set1_ps(1.0f), c2 = _mm256_set1_ps(2.0f * 0.7978845608028654f),
                 k = _mm256_set1_ps(0.044715f);
    __m256 a = x;
    if (gelu)
        a = _mm256_mul_ps(c2, _mm256_fmadd_ps(_mm256_mul_ps(k, x), _mm256_mul_ps(x, x), x));
    const __m256 d = _mm256_add_ps(one, x86_exp(_mm256_sub_ps(_mm256_setzero_ps(), a)));
    return _mm256_div_ps(_mm256_mul_ps(x, u), d);
}

/* gate = gate * up / (1 + e^(-a(gate))): SiLU (a = x), GELU's tanh form (a = 2c(x +
 * 0.044715 x^3)). The tail of n % 8 takes the same lanes (through a zero-padded copy),
 * so every element gets the same bits wherever the call's range starts and ends: a row
 * of the FFN is the same alone and among a prompt's rows (m40_batch_invariant's promise
 * on the CPU; the portable formula, with expf, rounds otherwise). */
X86_FN void x86_glu(float *gate, const float *up, int64_t n, int gelu)
{
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(gate + i, x86_glu8(_mm256_loadu_ps(gate + i), _mm256_loadu_ps(up + i), gelu));
    if (i < n) {
        float g[8] = {0}, u[8] = {0};
        memcpy(g, gate + i, (size_t)(n - i) * sizeof *g);
        memcpy(u, up + i, (size_t)(n - i) * sizeof *u);
        _mm256_storeu_ps(g, x86_glu8(_mm256_loadu_ps(g), _mm256_loadu_ps(u), gelu));
        memcpy(gate + i, g, (size_t)(n - i) * sizeof *g);
    }
}

X86_KERNEL void X86_NAME(glu_silu)(float *gate, const float *up, int64_t n) { x86_glu(gate, up, n, 0); }
X86_KERNEL void X86_NAME(glu_gelu)(float *gate, const float *up, int64_t n) { x86_glu(gate, up, n, 1); }

static m40_glu_fn X86_NAME(table_glu)(int act)
{
    return act == M40_GLU_SILU ? X86_NAME(glu_silu) : act == M40_GLU_GELU_TANH ? X86_NAME(glu_gelu) : NULL;
}

static m40_dot_q_fn X86_NAME(table_q)(uint32_t type)
{
    switch (type) {
    case M40_TYPE_Q8_0: return X86_NAME(q8_0);
    case M40_TYPE_Q4_0: return X86_NAME(q4_0);
    case M40_TYPE_Q4_1: return X86_NAME(q4_1);
    case M40_TYPE_Q5_0: return X86_NAME(q5_0);
    case M40_TYPE_Q5_1: return X86_NAME(q5_1);
    case M40_TYPE_Q4_K: return X86_NAME(q4_k);
    case M40_TYPE_Q5_K: return X86_NAME(q5_k);
    case M40_TYPE_Q6_K: return X86_NAME(q6_k);
    default: return NULL;
    }
}

static m40_dot_part_fn X86_NAME(table_part)(uint32_t type)
{
    switch (type) {
    case M40_TYPE_Q8_0: return X86_NAME(q8_0_part);
    case M40_TYPE_Q4_0: return X86_NAME(q4_0_part);
    case M40_TYPE_Q4_1: return X86_NAME(q4_1_part);
    case M40_TYPE_Q5_0: return X86_NAME(q5_0_part);
    case M40_TYPE_Q5_1: return X86_NAME(q5_1_part);
    case M40_TYPE_Q4_K: return X86_NAME(q4_k_part);
    case M40_TYPE_Q5_K: return X86_NAME(q5_k_part);
    case M40_TYPE_Q6_K: return X86_NAME(q6_k_part);
    default: return NULL;
    }
}

static m40_dot_fin_fn X86_NAME(table_fin)(uint32_t type)
{
    switch (type) {
    case M40_TYPE_Q8_0: return X86_NAME(q8_0_fin);
    case M40_TYPE_Q4_0: return X86_NAME(q4_0_fin);
    case M40_TYPE_Q4_1: return X86_NAME(q4_1_fin);
    case M40_TYPE_Q5_0: return X86_NAME(q5_0_fin);
    case M40_TYPE_Q5_1: return X86_NAME(q5_1_fin);
    case M40_TYPE_Q4_K: return X86_NAME(q4_k_fin);
    case M40_TYPE_Q5_K: return X86_NAME(q5_k_fin);
    case M40_TYPE_Q6_K: return X86_NAME(q6_k_fin);
    default: return NULL;
    }
}

static m40_dot_f_fn X86_NAME(table_f)(uint32_t type)
{
    return type == M40_TYPE_F16 ? X86_NAME(f16) : type == M40_TYPE_F32 ? X86_NAME(f32) : NULL;
}

static const m40_cpu_kernels X86_NAME(kernels) = {
    .q = X86_NAME(table_q),
    .part = X86_NAME(table_part),
    .fin = X86_NAME(table_fin),
    .f = X86_NAME(table_f),
    .glu = X86_NAME(table_glu),
    .quantize = X86_NAME(quantize),
    .axpy = X86_NAME(axpy),
};
