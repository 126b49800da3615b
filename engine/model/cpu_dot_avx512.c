/* The AVX-512 VNNI instance of the x86 kernels (cpu_dot_x86.h): int16 products summed
 * in pairs into int32 by vpdpwssd, on 256-bit vectors (AVX512VL), which keeps
 * the core out of the 512-bit frequency licence and the kernels shared with AVX2. Built
 * with a target attribute: cpu_dot.c calls it only on a CPU that has AVX512VL, AVX512BW
 * and AVX512_VNNI (and AVX2, FMA, F16C). */
#include "cpu_dot.h"

#if defined(__x86_64__) || defined(__i386__)

#define X86_TARGET "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni"
#define X86_NAME(n) avx512_##n
#define X86_MASKS /* AVX-512BW's byte masks (x86_bit5) */

#include <immintrin.h>

static inline __attribute__((target(X86_TARGET), always_inline)) __m256i x86_dotw(__m256i lo, __m256i hi,
                                                                              const int16_t *q)
{
    __m256i a = _mm256_dpwssd_epi32(_mm256_setzero_si256(), lo, _mm256_loadu_si256((const __m256i *)(const void *)q));
    return _mm256_dpwssd_epi32(a, hi, _mm256_loadu_si256((const __m256i *)(const void *)(q + 16)));
}

/* acc + x86_dotw(lo, hi, q), accumulated in place */
static inline __attribute__((target(X86_TARGET), always_inline)) __m256i x86_dotw_acc(__m256i acc, __m256i lo,
                                                                                  __m256i hi, const int16_t *q)
{
    acc = _mm256_dpwssd_epi32(acc, lo, _mm256_loadu_si256((const __m256i *)(const void *)q));
    return _mm256_dpwssd_epi32(acc, hi, _mm256_loadu_si256((const __m256i *)(const void *)(q + 16)));
}

#include "cpu_dot_x86.h"

const m40_cpu_kernels *m40_cpu_kernels_avx512(void) { return &avx512_kernels; }

#else

const m40_cpu_kernels *m40_cpu_kernels_avx512(void) { return NULL; }

#endif
