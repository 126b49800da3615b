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

m40_dot_q_fn m40_dot_q_avx2(uint32_t type) { return avx2_table_q(type); }
m40_dot_part_fn m40_dot_part_avx2(uint32_t type) { return avx2_table_part(type); }
m40_dot_fin_fn m40_dot_fin_avx2(uint32_t type) { return avx2_table_fin(type); }
m40_xq_quantize_fn m40_xq_quantize_avx2(void) { return avx2_quantize; }
m40_axpy_fn m40_axpy_avx2(void) { return avx2_axpy; }
m40_dot_f_fn m40_dot_f_avx2(uint32_t type) { return avx2_table_f(type); }
m40_glu_fn m40_glu_avx2(int act) { return avx2_table_glu(act); }

#else

m40_dot_q_fn m40_dot_q_avx2(uint32_t type) { (void)type; return NULL; }
m40_dot_part_fn m40_dot_part_avx2(uint32_t type) { (void)type; return NULL; }
m40_dot_fin_fn m40_dot_fin_avx2(uint32_t type) { (void)type; return NULL; }
m40_xq_quantize_fn m40_xq_quantize_avx2(void) { return NULL; }
m40_axpy_fn m40_axpy_avx2(void) { return NULL; }
m40_dot_f_fn m40_dot_f_avx2(uint32_t type) { (void)type; return NULL; }
m40_glu_fn m40_glu_avx2(int act) { (void)act; return NULL; }

#endif
