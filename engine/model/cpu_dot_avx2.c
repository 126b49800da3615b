/* The AVX2 instance of the x86 kernels (cpu_dot_x86.h): u8 x s8 products by maddubs
 * (int16 pairs) and madd with ones (int32 quads). Built with a target attribute, not
 * -mavx2: cpu_dot.c calls it only on a CPU that has AVX2, FMA and F16C. */
#include "cpu_dot.h"

#if defined(__x86_64__) || defined(__i386__)

#define X86_TARGET "avx2,fma,f16c"
#define X86_NAME(n) avx2_##n

#include <immintrin.h>

static inline __attribute__((target(X86_TARGET), always_inline)) __m256i x86_dot32(__m256i u, __m256i s)
{
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}

#include "cpu_dot_x86.h"

m40_dot_q_fn m40_dot_q_avx2(uint32_t type) { return avx2_table_q(type); }
m40_dot_q4_fn m40_dot_q4_avx2(uint32_t type) { return avx2_table_q4(type); }
m40_xq_quantize_fn m40_xq_quantize_avx2(void) { return avx2_quantize; }
m40_axpy_fn m40_axpy_avx2(void) { return avx2_axpy; }
m40_dot_f_fn m40_dot_f_avx2(uint32_t type) { return avx2_table_f(type); }

#else

m40_dot_q_fn m40_dot_q_avx2(uint32_t type) { (void)type; return NULL; }
m40_dot_q4_fn m40_dot_q4_avx2(uint32_t type) { (void)type; return NULL; }
m40_xq_quantize_fn m40_xq_quantize_avx2(void) { return NULL; }
m40_axpy_fn m40_axpy_avx2(void) { return NULL; }
m40_dot_f_fn m40_dot_f_avx2(uint32_t type) { (void)type; return NULL; }

#endif
