/* The AVX-512 VNNI instance of the x86 kernels (cpu_dot_x86.h): int16 products summed
 * in pairs into int32 by vpdpwssd, on 256-bit vectors (AVX512VL), which keeps
 * the core out of the 512-bit frequency licence and the kernels shared with AVX2. Built
 * with a target attribute: cpu_dot.c calls it only on a CPU that has AVX512VL, AVX512BW
 * and AVX512_VNNI (and AVX2, FMA, F16C). */
#include "cpu_dot.h"

#if defined(__x86_64__) || defined(__i386__)

#define X86_TARGET "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni"
#define X86_NAME(n) avx512_##n

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

m40_dot_q_fn m40_dot_q_avx512(uint32_t type) { return avx512_table_q(type); }
m40_dot_part_fn m40_dot_part_avx512(uint32_t type) { return avx512_table_part(type); }
m40_dot_fin_fn m40_dot_fin_avx512(uint32_t type) { return avx512_table_fin(type); }
m40_xq_quantize_fn m40_xq_quantize_avx512(void) { return avx512_quantize; }
m40_axpy_fn m40_axpy_avx512(void) { return avx512_axpy; }
m40_dot_f_fn m40_dot_f_avx512(uint32_t type) { return avx512_table_f(type); }
m40_glu_fn m40_glu_avx512(int act) { return avx512_table_glu(act); }

#else

m40_dot_q_fn m40_dot_q_avx512(uint32_t type) { (void)type; return NULL; }
m40_dot_part_fn m40_dot_part_avx512(uint32_t type) { (void)type; return NULL; }
m40_dot_fin_fn m40_dot_fin_avx512(uint32_t type) { (void)type; return NULL; }
m40_xq_quantize_fn m40_xq_quantize_avx512(void) { return NULL; }
m40_axpy_fn m40_axpy_avx512(void) { return NULL; }
m40_dot_f_fn m40_dot_f_avx512(uint32_t type) { (void)type; return NULL; }
m40_glu_fn m40_glu_avx512(int act) { (void)act; return NULL; }

#endif
