/* The fast CPU path's activation quantizer, its portable C kernels (the twins every
 * SIMD kernel is tested against, and the kernels of a CPU without AVX2) and the choice
 * of kernel by the CPU's instruction set (cpu_dot.h).
 *
 * Each kernel forms, per block of 32 weights, the integer dot product of the weights'
 * levels with the activations' int16 values, times the weight's scale and the block's
 * activation scale (the K-quants: per super-block, or half of one, their sub-block
 * scales applied in integers); offsets and mins come off once per block through the
 * record's sums (cpu_dot.h). The SIMD kernels compute the same integers and differ only
 * in the order of the F32 sums. */
#include "cpu_dot.h"

#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "ref/ggml_types.h"
#include "ref/quant.h"

static void xq_quantize_portable(const float *x, int64_t K, m40_xq *out)
{
    const int span = K % 256 == 0 ? 8 : 1; /* blocks that share one scale (cpu_dot.h) */
    for (int64_t b0 = 0; b0 < K / 32; b0 += span) {
        float amax = 0.0f;
        for (int i = 0; i < 32 * span; i++) {
            float a = fabsf(x[32 * b0 + i]);
            amax = a > amax ? a : amax;
        }
        float d = amax / 32767.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
        for (int64_t b = b0; b < b0 + span; b++) {
            int sum_lo = 0, sum_hi = 0;
            m40_xq *r = &out[b];
            for (int i = 0; i < 32; i++) {
                /* |x * id| <= 32767 up to one rounding; the clamp keeps that rounding in range */
                float v = nearbyintf(x[32 * b + i] * id);
                int q = v > 32767.0f ? 32767 : v < -32767.0f ? -32767 : (int)v;
                r->q[i] = (int16_t)q;
                if (i < 16)
                    sum_lo += q;
                else
                    sum_hi += q;
            }
            r->d = d;
            r->s = d * (float)(sum_lo + sum_hi);
            r->h[0] = sum_lo;
            r->h[1] = sum_hi;
        }
    }
}

void m40_xq_sums(const m40_xq *xq, int64_t n, float *xsum)
{
    for (int64_t i = 0; i < n; i++)
        xsum[i] = xq[i].s;
}

/* ------------------------------------------------------ portable kernels */

static inline float f16(const uint8_t *p) { return m40_fp16_to_fp32((uint16_t)(p[0] | (p[1] << 8))); }

static inline uint32_t rd32(const uint8_t *p)
{
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}

/* Q4_0/Q4_1 level j: low nibble of qs[j] (j < 16), high nibble of qs[j - 16]; Q5 adds
 * bit j of qh as the 5th bit. */
static inline int nib_dot(const uint8_t *qs, uint32_t qh, const int16_t *q)
{
    int s = 0;
    for (int j = 0; j < 16; j++) {
        int lo = (qs[j] & 15) | (int)(((qh >> j) & 1u) << 4);
        int hi = (qs[j] >> 4) | (int)(((qh >> (j + 16)) & 1u) << 4);
        s += lo * q[j] + hi * q[j + 16];
    }
    return s;
}

static float dot_q8_0(const uint8_t *w, const m40_xq *x, const float *xsum, int64_t K)
{
    (void)xsum; /* the records' s serve the twins */
    float acc = 0.0f;
    for (int64_t b = 0; b < K / 32; b++, w += 34) {
        int s = 0;
        for (int j = 0; j < 32; j++)
            s += (int8_t)w[2 + j] * x[b].q[j];
        acc += f16(w) * x[b].d * (float)s;
    }
    return acc;
}

static float dot_q4_0(const uint8_t *w, const m40_xq *x, const float *xsum, int64_t K)
{
    (void)xsum; /* the records' s serve the twins */
    float acc = 0.0f, corr = 0.0f;
    for (int64_t b = 0; b < K / 32; b++, w += 18) {
        float d = f16(w);
        acc += d * x[b].d * (float)nib_dot(w + 2, 0, x[b].q);
        corr += d * x[b].s;
    }
    return acc - 8.0f * corr;
}

static float dot_q4_1(const uint8_t *w, const m40_xq *x, const float *xsum, int64_t K)
{
    (void)xsum; /* the records' s serve the twins */
    float acc = 0.0f, corr = 0.0f;
    for (int64_t b = 0; b < K / 32; b++, w += 20) {
        acc += f16(w) * x[b].d * (float)nib_dot(w + 4, 0, x[b].q);
        corr += f16(w + 2) * x[b].s;
    }
    return acc + corr;
}

static float dot_q5_0(const uint8_t *w, const m40_xq *x, const float *xsum, int64_t K)
{
    (void)xsum; /* the records' s serve the twins */
    float acc = 0.0f, corr = 0.0f;
    for (int64_t b = 0; b < K / 32; b++, w += 22) {
        float d = f16(w);
        acc += d * x[b].d * (float)nib_dot(w + 6, rd32(w + 2), x[b].q);
        corr += d * x[b].s;
    }
    return acc - 16.0f * corr;
}

static float dot_q5_1(const uint8_t *w, const m40_xq *x, const float *xsum, int64_t K)
{
    (void)xsum; /* the records' s serve the twins */
    float acc = 0.0f, corr = 0.0f;
    for (int64_t b = 0; b < K / 32; b++, w += 24) {
        acc += f16(w) * x[b].d * (float)nib_dot(w + 8, rd32(w + 4), x[b].q);
        corr += f16(w + 2) * x[b].s;
    }
    return acc + corr;
}

/* Q4_K/Q5_K's 6-bit (scale, min) pair j (quant.c, scale_min_k4). */
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

/* Q4_K (qh NULL) and Q5_K: sub-block j = 2c + h of a super-block takes the low (h 0) or
 * high (h 1) nibbles of qs[32c..32c+32), and Q5_K bit j of qh[l] as the 5th bit. The
 * super-block's records share one scale (m40_xq_quantize), so its sub-blocks' integer
 * sums, each times its 6-bit scale, add up in integers before the one F32 product. */
static float dot_qk_k(const uint8_t *w, const m40_xq *x, int64_t K, int five)
{
    float acc = 0.0f, corr = 0.0f;
    const size_t bytes = five ? 176 : 144;
    for (int64_t b = 0; b < K / M40_QK_K; b++, w += bytes, x += 8) {
        float d = f16(w), dmin = f16(w + 2);
        const uint8_t *qh = w + 16, *qs = w + (five ? 48 : 16);
        int64_t isum = 0;
        float c = 0.0f;
        for (int j = 0; j < 8; j++) {
            int sc, mn, s = 0;
            scale_min_k4(w + 4, j, &sc, &mn);
            const uint8_t *src = qs + 32 * (j / 2);
            for (int l = 0; l < 32; l++) {
                int v = (j & 1) ? src[l] >> 4 : src[l] & 15;
                if (five)
                    v |= ((qh[l] >> j) & 1) << 4;
                s += v * x[j].q[l];
            }
            isum += (int64_t)sc * s;
            c += (float)mn * x[j].s;
        }
        acc += d * x[0].d * (float)isum;
        corr += dmin * c;
    }
    return acc - corr;
}

static float dot_q4_k(const uint8_t *w, const m40_xq *x, const float *xsum, int64_t K)
{
    (void)xsum;
    return dot_qk_k(w, x, K, 0);
}
static float dot_q5_k(const uint8_t *w, const m40_xq *x, const float *xsum, int64_t K)
{
    (void)xsum;
    return dot_qk_k(w, x, K, 1);
}

/* Q6_K: activation block jb = 4n + k of a super-block is half n's quarter k
 * (quant.c, unpack_q6_k); its two halves of 16 take scales 2jb and 2jb + 1. The -32 of
 * every level comes off through the record's half sums, in integers; each half
 * super-block's integer sum (the records share one scale) takes one F32 product. */
static float dot_q6_k(const uint8_t *w, const m40_xq *x, const float *xsum, int64_t K)
{
    (void)xsum; /* the records' s serve the twins */
    float acc = 0.0f;
    for (int64_t b = 0; b < K / M40_QK_K; b++, w += 210, x += 8) {
        const uint8_t *ql = w, *qh = w + 128;
        const int8_t *sc = (const int8_t *)(w + 192);
        float d = f16(w + 208);
        for (int n = 0; n < 2; n++) {
            int64_t sumi = 0; /* reaches 127 * 16 * 95 * 32767 * 8: int64 */
            for (int k = 0; k < 4; k++) {
                int jb = 4 * n + k;
                int64_t s[2] = {0, 0};
                for (int l = 0; l < 32; l++) {
                    uint8_t a = ql[64 * n + l + 32 * (k & 1)], h = qh[32 * n + l];
                    int v = (k < 2 ? a & 15 : a >> 4) | (((h >> (2 * k)) & 3) << 4);
                    s[l / 16] += v * x[jb].q[l];
                }
                sumi += sc[2 * jb] * (s[0] - 32 * (int64_t)x[jb].h[0]) + sc[2 * jb + 1] * (s[1] - 32 * (int64_t)x[jb].h[1]);
            }
            acc += d * x[0].d * (float)sumi;
        }
    }
    return acc;
}

static float dot_f16(const uint8_t *w, const float *x, int64_t K)
{
    float s[8] = {0};
    int64_t i = 0;
    for (; i + 8 <= K; i += 8)
        for (int j = 0; j < 8; j++)
            s[j] += f16(w + 2 * (i + j)) * x[i + j];
    for (; i < K; i++)
        s[0] += f16(w + 2 * i) * x[i];
    return ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
}

static m40_dot_q_fn portable_q(uint32_t type)
{
    switch (type) {
    case M40_TYPE_Q8_0: return dot_q8_0;
    case M40_TYPE_Q4_0: return dot_q4_0;
    case M40_TYPE_Q4_1: return dot_q4_1;
    case M40_TYPE_Q5_0: return dot_q5_0;
    case M40_TYPE_Q5_1: return dot_q5_1;
    case M40_TYPE_Q4_K: return dot_q4_k;
    case M40_TYPE_Q5_K: return dot_q5_k;
    case M40_TYPE_Q6_K: return dot_q6_k;
    default: return NULL;
    }
}

/* ------------------------------------------------------------- scratch */

typedef struct {
    void *p[2];
    size_t cap[2];
} thread_scratch;

static pthread_key_t scratch_key;
static pthread_once_t scratch_once = PTHREAD_ONCE_INIT;
static int scratch_ok;

static void scratch_free(void *v)
{
    thread_scratch *s = v;
    free(s->p[0]);
    free(s->p[1]);
    free(s);
}

static void scratch_init(void) { scratch_ok = pthread_key_create(&scratch_key, scratch_free) == 0; }

void *m40_thread_scratch(int slot, size_t bytes)
{
    pthread_once(&scratch_once, scratch_init);
    if (!scratch_ok || slot < 0 || slot > 1)
        return NULL;
    thread_scratch *s = pthread_getspecific(scratch_key);
    if (!s) {
        s = calloc(1, sizeof *s);
        if (!s || pthread_setspecific(scratch_key, s) != 0) {
            free(s);
            return NULL;
        }
    }
    if (bytes > s->cap[slot]) {
        const size_t n = (bytes + 63) / 64 * 64;
        free(s->p[slot]);
        s->p[slot] = aligned_alloc(64, n);
        s->cap[slot] = s->p[slot] ? n : 0;
    }
    return s->p[slot];
}

/* ------------------------------------------------------------- dispatch */

int m40_cpu_isa(void)
{
#if defined(__x86_64__) || defined(__i386__)
    static int isa = -1;
    if (isa < 0) { /* benign race: every thread computes the same value */
        __builtin_cpu_init();
        int v = M40_ISA_PORTABLE;
        if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
            v = M40_ISA_AVX2;
        if (v == M40_ISA_AVX2 && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bw") &&
            __builtin_cpu_supports("avx512vnni"))
            v = M40_ISA_AVX512VNNI;
        if (v == M40_ISA_AVX512VNNI && m40_amx_usable())
            v = M40_ISA_AMX;
        isa = v;
    }
    return isa;
#elif defined(__aarch64__)
    return M40_ISA_NEON; /* every AArch64 CPU has Advanced SIMD */
#else
    return M40_ISA_PORTABLE;
#endif
}

const char *m40_cpu_isa_name(int isa)
{
    static const char *const names[M40_ISA_COUNT] = {"portable C", "AVX2", "AVX-512 VNNI", "AMX", "NEON"};
    return isa >= 0 && isa < M40_ISA_COUNT ? names[isa] : "?";
}

/* The kernels of a SIMD isa this CPU runs (NULL: the portable isa, or one it does not
 * run, or one of the other architecture) */
static const m40_cpu_kernels *simd(int isa)
{
    if (isa <= M40_ISA_PORTABLE || isa > m40_cpu_isa())
        return NULL;
    switch (isa) {
    case M40_ISA_AVX2: return m40_cpu_kernels_avx2();
    case M40_ISA_AVX512VNNI: return m40_cpu_kernels_avx512();
    case M40_ISA_AMX: return m40_cpu_kernels_amx();
    case M40_ISA_NEON: return m40_cpu_kernels_neon();
    default: return NULL;
    }
}

/* isa is the portable one (always runs) */
static int portable(int isa) { return isa == M40_ISA_PORTABLE; }

m40_dot_q_fn m40_dot_q_kernel(uint32_t type, int isa)
{
    const m40_cpu_kernels *k = simd(isa);
    return k ? k->q(type) : portable(isa) ? portable_q(type) : NULL;
}

m40_xq_quantize_fn m40_xq_quantize_isa(int isa)
{
    const m40_cpu_kernels *k = simd(isa);
    return k ? k->quantize : portable(isa) ? xq_quantize_portable : NULL;
}

void m40_xq_quantize(const float *x, int64_t K, m40_xq *out)
{
    static m40_xq_quantize_fn fn; /* benign race: every thread finds the same one */
    if (!fn)
        fn = m40_xq_quantize_isa(m40_cpu_isa());
    fn(x, K, out);
}

static void axpy_portable(float *y, float a, const float *x, int64_t n)
{
    for (int64_t i = 0; i < n; i++)
        y[i] += a * x[i];
}

m40_axpy_fn m40_axpy_kernel(int isa)
{
    const m40_cpu_kernels *k = simd(isa);
    return k ? k->axpy : portable(isa) ? axpy_portable : NULL;
}

/* The portable GLU kernels: the exact path's formulas (ffn.c), one element at a time. */
static void glu_silu_portable(float *gate, const float *up, int64_t n)
{
    for (int64_t i = 0; i < n; i++)
        gate[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
}

static void glu_gelu_portable(float *gate, const float *up, int64_t n)
{
    const float c = 0.7978845608028654f; /* sqrt(2 / pi) */
    for (int64_t i = 0; i < n; i++) {
        const float x = gate[i];
        gate[i] = 0.5f * x * (1.0f + tanhf(c * (x + 0.044715f * x * x * x))) * up[i];
    }
}

m40_glu_fn m40_glu_kernel(int act, int isa)
{
    if (act != M40_GLU_SILU && act != M40_GLU_GELU_TANH)
        return NULL;
    const m40_cpu_kernels *k = simd(isa);
    if (k && k->glu)
        return k->glu(act);
    if (!k && !portable(isa))
        return NULL;
    return act == M40_GLU_SILU ? glu_silu_portable : glu_gelu_portable; /* portable, or an isa without its own */
}

m40_dot_f_fn m40_dot_f_kernel(uint32_t type, int isa)
{
    const m40_cpu_kernels *k = simd(isa);
    return k ? k->f(type) : portable(isa) && type == M40_TYPE_F16 ? dot_f16 : NULL;
}

m40_dot_part_fn m40_dot_part_kernel(uint32_t type, int isa)
{
    const m40_cpu_kernels *k = simd(isa);
    return k ? k->part(type) : NULL;
}

m40_dot_fin_fn m40_dot_fin_kernel(uint32_t type, int isa)
{
    const m40_cpu_kernels *k = simd(isa);
    return k ? k->fin(type) : NULL;
}

m40_dot_tile_fn m40_dot_tile_kernel(uint32_t type, int isa)
{
    const m40_cpu_kernels *k = simd(isa);
    return k && k->tile ? k->tile(type) : NULL;
}

m40_dot_s_fn m40_dot_s_kernel(uint32_t type, int isa)
{
    const m40_cpu_kernels *k = simd(isa);
    return k && k->split ? k->split(type) : NULL;
}
