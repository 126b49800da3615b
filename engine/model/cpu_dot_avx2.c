/* The AVX2 instance of the x86 kernels (cpu_dot_x86.h): int16 products summed in pairs
 * by pmaddwd, two of them added (int32 quads). Built with a target attribute, not
 * -mavx2: cpu_dot.c calls it only on a CPU that has AVX2, FMA and F16C. */
#include "cpu_dot.h"

#if defined(__x86_64__) || defined(__i386__)

#define X86_TARGET "avx2,fma,f16c"
#define X86_NAME(n) avx2_##n

#include <immintrin.h>

static inline __attribute__((target(X86_TARGET), always_inline)) __m256i x86_dotw(__m256i lo, __m256i hi,
                                                                              const int16_t *q)
{
    return _mm256_add_epi32(_mm256_madd_epi16(lo, _mm256_loadu_si256((const __m256i *)(const void *)q)),
                            _mm256_madd_epi16(hi, _mm256_loadu_si256((const __m256i *)(const void *)(q + 16))));
}

/* acc + x86_dotw(lo, hi, q) */
static inline __attribute__((target(X86_TARGET), always_inline)) __m256i x86_dotw_acc(__m256i acc, __m256i lo,
                                                                                  __m256i hi, const int16_t *q)
{
    return _mm256_add_epi32(acc, x86_dotw(lo, hi, q));
}

#include "cpu_dot_x86.h"

const m40_cpu_kernels *m40_cpu_kernels_avx2(void) { return &avx2_kernels; }

#else

const m40_cpu_kernels *m40_cpu_kernels_avx2(void) { return NULL; }

#endif
