/* The pieces of sampling that must be the same bits on the host and the device, in one
 * place: the order of logits (one 32-bit key per float), the greedy pick's 64-bit key,
 * and the counter-based random number of a draw. The GPU kernels (sample.cu, the
 * folded pick of gemv_q8.cu), their CPU twins (kernels/ref/cpu_ref.c) and the engine's
 * CPU greedy picks include this header, so that a token the GPU picks is the token the
 * CPU picks, by construction rather than by copies kept in step. Plain C11 and CUDA alike: static inline
 * functions, host and device. */
#ifndef M40_SAMPLE_HD_H
#define M40_SAMPLE_HD_H

#include <math.h>
#include <stdint.h>

#ifdef __CUDACC__
#define M40K_HD __host__ __device__
#else
#define M40K_HD
#endif

/* x's bits as an unsigned key that orders as the values do, for x neither NaN nor -0:
 * the callers below first decide what those mean. */
static inline M40K_HD uint32_t m40k_float_order(float x)
{
    union {
        float f;
        uint32_t u;
    } c;
    c.f = x;
    return (c.u & 0x80000000u) ? ~c.u : (c.u | 0x80000000u);
}

/* The sampler's rank key of a logit: larger key, better rank (ties go to the lower
 * id); NaN ranks as -inf and -0 as +0 (kernels.h 9b). */
static inline M40K_HD uint32_t m40k_rank_key(float x)
{
    return m40k_float_order(x != x ? -INFINITY : x == 0.0f ? 0.0f : x);
}

/* The greedy pick as one 64-bit key (kernels.h 9c): the largest key is the largest
 * value, then the lowest id; NaN is never picked (key 0, which no value reaches). The
 * keys of rows of one vector can be combined with a plain max (an atomicMax on the GPU). */
static inline M40K_HD uint64_t m40k_argmax_key(float v, int32_t i)
{
    if (v != v)
        return 0; /* NaN: never picked */
    return ((uint64_t)m40k_float_order(v == 0.0f ? 0.0f : v) << 32) | (uint64_t)(0xFFFFFFFFu - (uint32_t)i);
}
/* The id in a key (-1: no entry that is not NaN). */
static inline M40K_HD int32_t m40k_argmax_key_id(uint64_t key)
{
    return key ? (int32_t)(0xFFFFFFFFu - (uint32_t)key) : -1;
}

/* The greedy pick of v[0..n) by those keys, in one thread (the CPU's greedy picks: the
 * engine's sampler, its CPU forward pass, m40 bench): 0 when every value is NaN. */
static inline M40K_HD int32_t m40k_argmax(const float *v, int32_t n)
{
    uint64_t best = 0;
    for (int32_t i = 0; i < n; i++) {
        const uint64_t k = m40k_argmax_key(v[i], i);
        if (k > best)
            best = k;
    }
    return best ? m40k_argmax_key_id(best) : 0;
}

/* The random number of a draw: a function of (seed, step) alone, counter-based, so that
 * the GPU draws each sequence's tokens in any order and a CPU twin gets the same 64 bits
 * (two splitmix64 finalizer rounds over the seed and the step). */
static inline M40K_HD uint64_t m40k_sample_random(uint64_t seed, uint64_t step)
{
    uint64_t z = seed + 0x9e3779b97f4a7c15ull * (step + 1);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    z += seed ^ 0x6a09e667f3bcc909ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

#endif
