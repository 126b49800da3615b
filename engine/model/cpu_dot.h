/* The fast CPU path's dot products (cpu_dot.c: the activation quantizer, the portable C
 * kernels and the dispatch; cpu_dot_x86.h instantiated by cpu_dot_avx2.c and
 * cpu_dot_avx512.c, and cpu_dot_neon.c: the SIMD kernels the portable ones are the twins
 * of). Private to engine/model/.
 *
 * Activations are quantized per block of 32 to int16 with one F32 scale per block, so a
 * weight block of 32 (or a K-quant's sub-block of 32) meets exactly one activation
 * block and its product is an integer dot product (pmaddwd / vpdpwssd) times two
 * scales. Where the row width is a multiple of 256 the eight blocks of each super-block
 * share one scale (the largest |x| of the 256): a K-quant's sub-block scales are small
 * integers, so its sub-blocks' products then add up in int32 and take one F32 multiply
 * a super-block instead of one a block (the prefill's instruction count). int16, not int8: with int8 (a / 254 per element) the errors of 30 layers moved
 * SmolLM2-135M's log-probabilities by up to 0.2 and flipped its greedy answer to the
 * README's question (the exact path's first-token margin is 0.08); int16 makes that
 * error 258 times smaller for about 1.5x the integer work per token, which decode, bound
 * by reading the weights, does not notice. The record keeps
 * the block's sums too: the types whose levels carry an offset (Q4_0's -8, Q5_0's -16,
 * Q6_K's -32) or a min (Q4_1, Q5_1, Q4_K, Q5_K) subtract it once per block as
 * offset * sum(x) instead of per element.
 *
 * Accuracy: with a = max|x| over a block (or its super-block), d = a / 32767 and q = rint(x * (1 / d)),
 * |x - d*q| <= d * (1/2 + 0.01) per element (the 0.01 bounds the F32 rounding of 1 / d
 * and of x * (1 / d) near 32767), so a product differs from the exact one (dequantized
 * weights times F32 x) by at most sum_k |W[k]| * d(k's block) * 0.51, plus F32 rounding
 * of the sums. */
#ifndef M40_CPU_DOT_H
#define M40_CPU_DOT_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* One block of 32 quantized activations: x[i] ~ d * q[i]. s = d * sum(q) (F32), h[0]
 * and h[1] the integer sums of q[0..16) and q[16..32) (Q6_K's scales cover 16). q is
 * first: records are 32-byte multiples apart only by their size (80), so loads are
 * unaligned. */
typedef struct m40_xq {
    int16_t q[32];
    float d;
    float s;
    int32_t h[2];
} m40_xq;

/* x[0..K) (K a multiple of 32) into K/32 records: d = max|x| / 32767 (over the block, or
 * over its super-block of 8 blocks where K is a multiple of 256: the records of a
 * super-block then have the same d), q = x * (1 / d) rounded to nearest even.
 * m40_xq_quantize: the widest isa's quantizer (the same records bit for bit as
 * m40_xq_quantize_isa(M40_ISA_PORTABLE)). */
typedef void (*m40_xq_quantize_fn)(const float *x, int64_t K, m40_xq *out);
void m40_xq_quantize(const float *x, int64_t K, m40_xq *out);
m40_xq_quantize_fn m40_xq_quantize_isa(int isa); /* NULL: not on this CPU */

/* The 6-bit (scale, min) pairs of the Q4_K or Q5_K super-block at w (scale_min_k4), as
 * bytes: byte j of *sc and *mn is sub-block j's (the SIMD kernels read them as vectors;
 * byte stores read back as one word stalled store forwarding). */
static inline void m40_q4_k_scales8(const uint8_t *w, uint64_t *sc, uint64_t *mn)
{
    uint32_t sw0, sw1, sw2;
    memcpy(&sw0, w + 4, 4);
    memcpy(&sw1, w + 8, 4);
    memcpy(&sw2, w + 12, 4);
    *sc = (uint64_t)(sw0 & 0x3f3f3f3fu) | (uint64_t)((sw2 & 0x0f0f0f0fu) | (((sw0 >> 6) & 0x03030303u) << 4)) << 32;
    *mn = (uint64_t)(sw1 & 0x3f3f3f3fu) | (uint64_t)(((sw2 >> 4) & 0x0f0f0f0fu) | (((sw1 >> 6) & 0x03030303u) << 4))
                                              << 32;
}

/* Instruction sets: the x86 ones widest last, then AArch64's. m40_cpu_isa gives the one
 * this CPU runs best; asking for an isa below it of the other architecture gives NULL. */
enum {
    M40_ISA_PORTABLE = 0,
    M40_ISA_AVX2 = 1,
    M40_ISA_AVX512VNNI = 2,
    M40_ISA_AMX = 3, /* AVX-512 VNNI with AMX-INT8 tiles (cpu_dot_amx.c) */
    M40_ISA_NEON = 4,
    M40_ISA_COUNT
};

/* 1 when this CPU has AMX-INT8, the OS saves its tile state and grants it to this
 * process (asked for here, once); 0 too with M40_CPU_AMX=0 (cpu_dot_amx.c). */
int m40_amx_usable(void);

/* The widest this CPU runs (checked once at run time). */
int m40_cpu_isa(void);
const char *m40_cpu_isa_name(int isa);

/* The records' s in a row (xsum[i] = xq[i].s, i < n): the K-quant kernels read a
 * super-block's eight with one vector load. */
void m40_xq_sums(const m40_xq *xq, int64_t n, float *xsum);

/* dot(one weight row of K elements at w, its activations): xq holds K/32 records and
 * xsum their s (m40_xq_sums). F16 and F32 rows take the F32 activations x instead. */
typedef float (*m40_dot_q_fn)(const uint8_t *w, const m40_xq *xq, const float *xsum, int64_t K);
typedef float (*m40_dot_f_fn)(const uint8_t *w, const float *x, int64_t K);

/* A product cut into ranges of blocks (prefill: the activations of a few tokens over a
 * range stay in L1 while many weight rows meet them). The state of one (row, token)
 * product between ranges: zero it, run the ranges in order, then finish it. */
typedef struct m40_dot_state {
    float v[8];  /* the SIMD kernel's F32 lanes */
    float corr;  /* its min term (Q4_1, Q5_1) */
} m40_dot_state;
/* Blocks [kb0, kb1) (32-element units; multiples of 8 for K-quants, whose super-blocks
 * are 8 blocks) of the row at w (its start) against ntok tokens' records (x: token
 * 0's record 0, xsum their s; x_stride records (and sums) between tokens), into
 * st[0..ntok). */
typedef void (*m40_dot_part_fn)(const uint8_t *w, const m40_xq *x, const float *xsum, int64_t x_stride, int64_t kb0,
                                int64_t kb1, int ntok, m40_dot_state *st);
/* The product from its state: the same bits as the one-token kernel of that isa over the
 * whole row, however the row was cut. */
typedef float (*m40_dot_fin_fn)(const m40_dot_state *st);

/* The kernel of `type` for `isa`; NULL when that type has no fast kernel (the caller
 * keeps the exact path) or the isa is not compiled in / not run by this CPU. Quantized
 * types: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K; float types: F16 (and F32). */
m40_dot_q_fn m40_dot_q_kernel(uint32_t type, int isa);
m40_dot_f_fn m40_dot_f_kernel(uint32_t type, int isa);

/* The piecewise kernel of `type` for `isa` and its finish (SIMD isas only; NULL
 * otherwise). */
m40_dot_part_fn m40_dot_part_kernel(uint32_t type, int isa);
m40_dot_fin_fn m40_dot_fin_kernel(uint32_t type, int isa);

/* Tiles (M40_ISA_AMX): the products of nrows weight rows (row r at w + r * row_bytes)
 * with n tokens at once, out[t * ostride + r], the same bits as the isa's one-token
 * kernel for each (row, token). The tokens' records are prepared first, once for all
 * the rows: m40_dot_tile_prep writes tile `tile` (tokens 16 tile .. 16 tile + 15) of
 * the n tokens' records x [n][nb] and sums xsum [n][nb] into out, which holds
 * m40_dot_tile_prep_bytes(n, K) bytes for all the tiles. -1: no memory (the caller
 * takes the one-token kernel). */
typedef int (*m40_dot_tile_fn)(const uint8_t *w, size_t row_bytes, int nrows, int64_t K, const void *xp, int32_t n,
                               float *out, int64_t ostride);
m40_dot_tile_fn m40_dot_tile_kernel(uint32_t type, int isa); /* NULL: none for that type or isa */
size_t m40_dot_tile_prep_bytes(int32_t n, int64_t K);
void m40_dot_tile_prep(const m40_xq *x, const float *xsum, int64_t nb, int32_t n, int32_t tile, void *out);

/* Split records (M40_ISA_AMX's one-token kernels): each record's int16s as their low
 * bytes (unsigned) and high bytes (signed), q = 256 hi + lo, so a product of unsigned
 * levels takes two VPDPBUSD a unit where the int16s need two widenings, an extract and
 * two VPDPWSSD; the same integer sums, so the same bits as the isa's m40_dot_q_fn. A
 * token's nb records take m40_dot_split_bytes(nb) bytes (a multiple of 64), written by
 * m40_dot_split_prep from its records: [nb][lo 32, hi 32], then d [nb], h [nb][2] and
 * h[0] + h[1] [nb]. */
size_t m40_dot_split_bytes(int64_t nb);
void m40_dot_split_prep(const m40_xq *x, int64_t nb, void *out);
typedef float (*m40_dot_s_fn)(const uint8_t *w, const void *xs, const float *xsum, int64_t K);
m40_dot_s_fn m40_dot_s_kernel(uint32_t type, int isa); /* NULL: none for that type or isa */

/* A 64-byte aligned buffer of at least `bytes` for the calling thread (slot 0 or 1: two
 * independent ones), grown, never shrunk, and freed when the thread exits (the pool's
 * threads end with their model); NULL: no memory. The tiles' staging and prepared
 * records live there, so a step allocates nothing once the largest has run. */
void *m40_thread_scratch(int slot, size_t bytes);

/* y[i] += a * x[i], i < n, for `isa` (NULL where absent; the portable one is plain C). */
typedef void (*m40_axpy_fn)(float *y, float a, const float *x, int64_t n);
m40_axpy_fn m40_axpy_kernel(int isa);

/* The gated activations, elementwise: gate[i] = act(gate[i]) * up[i], i < n, for
 * M40_GLU_SILU (x / (1 + e^-x)) and M40_GLU_GELU_TANH (0.5 x (1 + tanh(c (x + 0.044715
 * x^3))), c = sqrt(2/pi), computed as x / (1 + e^(-2 c (x + 0.044715 x^3))), the same
 * function). The portable kernel is the exact path's formulas (expf, tanhf: ffn.c); the
 * SIMD ones take e^x from a polynomial (2^n e^r, |r| <= ln2 / 2, degree 6: relative error
 * within a few units of F32's last place), 8 lanes at a time. NULL: no kernel for the act
 * or isa (the caller keeps ffn.c's m40_glu). */
enum { M40_GLU_SILU = 0, M40_GLU_GELU_TANH = 1 };
typedef void (*m40_glu_fn)(float *gate, const float *up, int64_t n);
m40_glu_fn m40_glu_kernel(int act, int isa);

/* One SIMD instance's kernels, by type where they depend on it (NULL: no kernel for
 * that type); glu NULL: the portable GLU. */
typedef struct {
    m40_dot_q_fn (*q)(uint32_t type);
    m40_dot_part_fn (*part)(uint32_t type);
    m40_dot_fin_fn (*fin)(uint32_t type);
    m40_dot_f_fn (*f)(uint32_t type);
    m40_glu_fn (*glu)(int act);
    m40_xq_quantize_fn quantize;
    m40_axpy_fn axpy;
    m40_dot_tile_fn (*tile)(uint32_t type); /* NULL but in the AMX instance */
    m40_dot_s_fn (*split)(uint32_t type);   /* NULL but in the AMX instance */
} m40_cpu_kernels;
/* The instances (cpu_dot_avx2.c, cpu_dot_avx512.c: cpu_dot_x86.h's; cpu_dot_neon.c);
 * NULL where the instance is not built for this architecture. */
const m40_cpu_kernels *m40_cpu_kernels_avx2(void);
const m40_cpu_kernels *m40_cpu_kernels_avx512(void);
const m40_cpu_kernels *m40_cpu_kernels_amx(void); /* cpu_dot_amx.c: AVX-512's, its tiled types' own */
const m40_cpu_kernels *m40_cpu_kernels_neon(void);

#endif
