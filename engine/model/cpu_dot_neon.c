/* The AArch64 NEON instance of the fast CPU path's kernels (cpu_dot.h). NEON has no
 * 16-bit dot product instruction: the int16 activations meet the 16-bit weight levels
 * through vmlal_s16 / vmlal_high_s16, four products an instruction (AVX-512 VNNI's
 * vpdpwssd does sixteen), summed into 8 int32 lanes (two int32x4) that hold the same
 * products per lane as the x86 kernels' (so the same overflow bounds: cpu_dot_x86.h);
 * F16 and F32 rows through FMA. The same integers as the portable twins (cpu_dot.c),
 * the F32 sums in 8 lanes like the x86 kernels, so within F32 rounding of the twins;
 * the one-token and piecewise kernels run the same steps per token (the same bits).
 * Built on every target; without __aarch64__ its tables are empty. Tested under
 * qemu-aarch64 by tests/unit/neon.sh. */
#include "cpu_dot.h"

#if defined(__aarch64__)

#include <arm_neon.h>
#include <string.h>

#include "ref/ggml_types.h"
#include "ref/quant.h"

typedef struct {
    float32x4_t a, b;
} nf8; /* 8 F32 lanes */
typedef struct {
    int32x4_t a, b;
} ni8; /* 8 int32 lanes */
typedef struct {
    int16x8_t v[4];
} nw32; /* 32 16-bit weight levels */

static inline float n_f16(const uint8_t *p) { return m40_fp16_to_fp32((uint16_t)(p[0] | (p[1] << 8))); }

static inline nf8 n_zero(void) { return (nf8){vdupq_n_f32(0.0f), vdupq_n_f32(0.0f)}; }
static inline ni8 n_izero(void) { return (ni8){vdupq_n_s32(0), vdupq_n_s32(0)}; }

/* acc + the 32 levels times the record's q: lane i of a takes products 8j + i, lane i of
 * b products 8j + 4 + i (j < 4): 4 a lane, as a 256-bit vpdpwssd block gives */
static inline ni8 n_dot(ni8 acc, const nw32 *w, const int16_t *q)
{
    for (int j = 0; j < 4; j++) {
        const int16x8_t x = vld1q_s16(q + 8 * j);
        acc.a = vmlal_s16(acc.a, vget_low_s16(w->v[j]), vget_low_s16(x));
        acc.b = vmlal_high_s16(acc.b, w->v[j], x);
    }
    return acc;
}

/* acc + scale * (F32) p */
static inline nf8 n_acc(nf8 acc, float scale, ni8 p)
{
    acc.a = vfmaq_n_f32(acc.a, vcvtq_f32_s32(p.a), scale);
    acc.b = vfmaq_n_f32(acc.b, vcvtq_f32_s32(p.b), scale);
    return acc;
}

/* 32 unsigned 8-bit levels (lo: elements 0..15, hi: 16..31) less off, times s0
 * (elements 0..15) and s1 (16..31), as 16-bit lanes */
static inline nw32 n_levels(uint8x16_t lo, uint8x16_t hi, int off, int s0, int s1)
{
    nw32 w;
    w.v[0] = vreinterpretq_s16_u16(vmovl_u8(vget_low_u8(lo)));
    w.v[1] = vreinterpretq_s16_u16(vmovl_high_u8(lo));
    w.v[2] = vreinterpretq_s16_u16(vmovl_u8(vget_low_u8(hi)));
    w.v[3] = vreinterpretq_s16_u16(vmovl_high_u8(hi));
    for (int j = 0; j < 4; j++) {
        if (off)
            w.v[j] = vsubq_s16(w.v[j], vdupq_n_s16((int16_t)off));
        if (s0 != 1 || s1 != 1)
            w.v[j] = vmulq_n_s16(w.v[j], (int16_t)(j < 2 ? s0 : s1));
    }
    return w;
}

/* 0x10 in byte i where bit i of the 16 bits (b0 | b1 << 8) is set (Q5's 5th bit) */
static inline uint8x16_t n_bit5(uint8_t b0, uint8_t b1)
{
    static const uint8_t bits[16] = {1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128};
    const uint8x16_t v = vcombine_u8(vdup_n_u8(b0), vdup_n_u8(b1));
    return vandq_u8(vtstq_u8(v, vld1q_u8(bits)), vdupq_n_u8(0x10));
}

/* Software prefetch ahead of the block being read (cpu_dot_x86.h's X86_PF) */
static inline void n_prefetch(const uint8_t *w, int bytes)
{
    for (int o = 0; o < bytes; o += 64)
        __builtin_prefetch(w + 2048 + o);
}

/* The 32-block types: Q8_0 (q8 1), Q4_0 (five 0, min 0), Q4_1 (min 1), Q5_0 (five 1),
 * Q5_1 (both); offsets off the levels, mins through the record's s (cpu_dot_x86.h). */
static inline void n_q32(const uint8_t *w, const m40_xq *x, int64_t xs, int64_t kb0, int64_t kb1, int q8, int five,
                         int min, int nt, nf8 *acc, float *corr)
{
    const int64_t bytes = q8 ? 34 : 18 + (five ? 4 : 0) + (min ? 2 : 0);
    const int qs_off = 2 + (five ? 4 : 0) + (min ? 2 : 0), qh_off = min ? 4 : 2;
    w += bytes * kb0;
    for (int64_t b = kb0; b < kb1; b++, w += bytes) {
        n_prefetch(w, (int)bytes);
        nw32 lv;
        if (q8) {
            const int8x16_t lo = vld1q_s8((const int8_t *)(w + 2)), hi = vld1q_s8((const int8_t *)(w + 18));
            lv.v[0] = vmovl_s8(vget_low_s8(lo));
            lv.v[1] = vmovl_high_s8(lo);
            lv.v[2] = vmovl_s8(vget_low_s8(hi));
            lv.v[3] = vmovl_high_s8(hi);
        } else {
            const uint8x16_t v = vld1q_u8(w + qs_off);
            uint8x16_t lo = vandq_u8(v, vdupq_n_u8(15)), hi = vshrq_n_u8(v, 4);
            if (five) {
                const uint8_t *qh = w + qh_off;
                lo = vorrq_u8(lo, n_bit5(qh[0], qh[1]));
                hi = vorrq_u8(hi, n_bit5(qh[2], qh[3]));
            }
            lv = n_levels(lo, hi, min ? 0 : five ? 16 : 8, 1, 1);
        }
        const float d = n_f16(w), m = min ? n_f16(w + 2) : 0.0f;
        for (int t = 0; t < nt; t++) {
            const m40_xq *xb = &x[t * xs + b];
            acc[t] = n_acc(acc[t], d * xb->d, n_dot(n_izero(), &lv, xb->q));
            if (min)
                corr[t] += m * xb->s;
        }
    }
}

/* Q4_K (five 0) and Q5_K: the sub-block scales in the 16-bit levels, a super-block one
 * int32 sum, the mins from xsum (cpu_dot_x86.h, x86_qk_k). */
static inline void n_qk_k(const uint8_t *w, const m40_xq *x, const float *xsum, int64_t xs, int64_t kb0,
                          int64_t kb1, int five, int nt, nf8 *acc)
{
    const int64_t bytes = five ? 176 : 144;
    w += bytes * (kb0 / 8);
    for (int64_t b = kb0 / 8; b < kb1 / 8; b++, w += bytes) {
        n_prefetch(w, (int)bytes);
        const float d = n_f16(w), dmin = n_f16(w + 2);
        const uint8_t *s = w + 4, *qs = w + (five ? 48 : 16), *qh = w + 16;
        uint8_t sc[8];
        float mn[8];
        for (int j = 0; j < 4; j++) {
            sc[j] = s[j] & 63;
            mn[j] = dmin * (float)(s[j + 4] & 63);
            sc[j + 4] = (uint8_t)((s[j + 8] & 15) | ((s[j] >> 6) << 4));
            mn[j + 4] = dmin * (float)((s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4));
        }
        const float32x4_t mna = vld1q_f32(mn), mnb = vld1q_f32(mn + 4);
        ni8 ia[4];
        for (int t = 0; t < nt; t++)
            ia[t] = n_izero();
        for (int c = 0; c < 4; c++) {
            const uint8x16_t p0 = vld1q_u8(qs + 32 * c), p1 = vld1q_u8(qs + 32 * c + 16);
            uint8x16_t a0 = vandq_u8(p0, vdupq_n_u8(15)), a1 = vandq_u8(p1, vdupq_n_u8(15));
            uint8x16_t b0 = vshrq_n_u8(p0, 4), b1 = vshrq_n_u8(p1, 4);
            if (five) {
                const uint8x16_t h0 = vld1q_u8(qh), h1 = vld1q_u8(qh + 16), f = vdupq_n_u8(0x10);
                const uint8x16_t m0 = vdupq_n_u8((uint8_t)(1 << (2 * c))), m1 = vdupq_n_u8((uint8_t)(2 << (2 * c)));
                a0 = vorrq_u8(a0, vandq_u8(vtstq_u8(h0, m0), f));
                a1 = vorrq_u8(a1, vandq_u8(vtstq_u8(h1, m0), f));
                b0 = vorrq_u8(b0, vandq_u8(vtstq_u8(h0, m1), f));
                b1 = vorrq_u8(b1, vandq_u8(vtstq_u8(h1, m1), f));
            }
            const nw32 w0 = n_levels(a0, a1, 0, sc[2 * c], sc[2 * c]);
            const nw32 w1 = n_levels(b0, b1, 0, sc[2 * c + 1], sc[2 * c + 1]);
            for (int t = 0; t < nt; t++) {
                const m40_xq *x0 = &x[t * xs + 8 * b + 2 * c];
                ia[t] = n_dot(ia[t], &w0, x0->q);
                ia[t] = n_dot(ia[t], &w1, x0[1].q);
            }
        }
        for (int t = 0; t < nt; t++) {
            const float *sv = xsum + t * xs + 8 * b;
            acc[t] = n_acc(acc[t], d * x[t * xs + 8 * b].d, ia[t]);
            acc[t].a = vfmsq_f32(acc[t].a, mna, vld1q_f32(sv));
            acc[t].b = vfmsq_f32(acc[t].b, mnb, vld1q_f32(sv + 4));
        }
    }
}

/* Q6_K: (level - 32) times each half block's scale in 16 bits, a half super-block one
 * int32 sum (cpu_dot_x86.h, x86_q6_k). */
static inline void n_q6_k(const uint8_t *w, const m40_xq *x, int64_t xs, int64_t kb0, int64_t kb1, int nt, nf8 *acc)
{
    w += 210 * (kb0 / 8);
    for (int64_t b = kb0 / 8; b < kb1 / 8; b++, w += 210) {
        n_prefetch(w, 210);
        const int8_t *sc = (const int8_t *)(w + 192);
        const float d = n_f16(w + 208);
        for (int n = 0; n < 2; n++) {
            uint8x16_t u[4][2];
            for (int h = 0; h < 2; h++) {
                const uint8x16_t A = vld1q_u8(w + 64 * n + 16 * h), B = vld1q_u8(w + 64 * n + 32 + 16 * h);
                const uint8x16_t H = vld1q_u8(w + 128 + 32 * n + 16 * h), m4 = vdupq_n_u8(15);
                u[0][h] = vorrq_u8(vandq_u8(A, m4), vshlq_n_u8(vandq_u8(H, vdupq_n_u8(3)), 4));
                u[1][h] = vorrq_u8(vandq_u8(B, m4), vshlq_n_u8(vandq_u8(H, vdupq_n_u8(0x0c)), 2));
                u[2][h] = vorrq_u8(vshrq_n_u8(A, 4), vandq_u8(H, vdupq_n_u8(0x30)));
                u[3][h] = vorrq_u8(vshrq_n_u8(B, 4), vshrq_n_u8(vandq_u8(H, vdupq_n_u8(0xc0)), 2));
            }
            ni8 ia[4];
            for (int t = 0; t < nt; t++)
                ia[t] = n_izero();
            for (int k = 0; k < 4; k++) {
                const int jb = 4 * n + k;
                const nw32 lv = n_levels(u[k][0], u[k][1], 32, sc[2 * jb], sc[2 * jb + 1]);
                for (int t = 0; t < nt; t++)
                    ia[t] = n_dot(ia[t], &lv, x[t * xs + 8 * b + jb].q);
            }
            for (int t = 0; t < nt; t++)
                acc[t] = n_acc(acc[t], d * x[t * xs + 8 * b].d, ia[t]);
        }
    }
}

/* The lanes summed in the x86 kernels' order (x86_hsum) */
static inline float n_hsum(nf8 v)
{
    const float32x4_t s = vaddq_f32(v.a, v.b);
    return (vgetq_lane_f32(s, 0) + vgetq_lane_f32(s, 2)) + (vgetq_lane_f32(s, 1) + vgetq_lane_f32(s, 3));
}

/* the lanes summed, plus the min term where the type has one (x86_fin) */
static inline float n_fin(nf8 acc, float corr, int min)
{
    const float s = n_hsum(acc);
    return min ? s + corr : s;
}

/* One register tile of the piecewise kernel (cpu_dot_x86.h, X86_PART_TILE) */
#define N_PART_TILE(NTK, call)                                                                         \
    do {                                                                                               \
        nf8 acc[NTK];                                                                                  \
        float corr[NTK];                                                                               \
        for (int t = 0; t < NTK; t++)                                                                  \
            acc[t] = (nf8){vld1q_f32(st[t].v), vld1q_f32(st[t].v + 4)}, corr[t] = st[t].corr;          \
        const int nt = NTK;                                                                            \
        call;                                                                                          \
        for (int t = 0; t < NTK; t++)                                                                  \
            vst1q_f32(st[t].v, acc[t].a), vst1q_f32(st[t].v + 4, acc[t].b), st[t].corr = corr[t];      \
    } while (0)

#define N_QUANT_KERNELS(name, min, call)                                                               \
    static float neon_##name(const uint8_t *w, const m40_xq *x, const float *xsum, int64_t K)          \
    {                                                                                                  \
        nf8 acc[1] = {n_zero()};                                                                       \
        float corr[1] = {0.0f};                                                                        \
        const int64_t xs = 0, kb0 = 0, kb1 = K / 32;                                                   \
        const int nt = 1;                                                                              \
        (void)xsum, (void)corr;                                                                        \
        call;                                                                                          \
        return n_fin(acc[0], corr[0], min);                                                            \
    }                                                                                                  \
    static void neon_##name##_part(const uint8_t *w, const m40_xq *x, const float *xsum, int64_t xs,   \
                                   int64_t kb0, int64_t kb1, int ntok, m40_dot_state *st)              \
    {                                                                                                  \
        (void)xsum;                                                                                    \
        for (; ntok >= 4; ntok -= 4, x += 4 * xs, xsum += 4 * xs, st += 4)                             \
            N_PART_TILE(4, call);                                                                      \
        for (; ntok > 0; ntok--, x += xs, xsum += xs, st++)                                            \
            N_PART_TILE(1, call);                                                                      \
    }                                                                                                  \
    static float neon_##name##_fin(const m40_dot_state *st)                                            \
    {                                                                                                  \
        return n_fin((nf8){vld1q_f32(st->v), vld1q_f32(st->v + 4)}, st->corr, min);                    \
    }

N_QUANT_KERNELS(q8_0, 0, n_q32(w, x, xs, kb0, kb1, 1, 0, 0, nt, acc, corr))
N_QUANT_KERNELS(q4_0, 0, n_q32(w, x, xs, kb0, kb1, 0, 0, 0, nt, acc, corr))
N_QUANT_KERNELS(q4_1, 1, n_q32(w, x, xs, kb0, kb1, 0, 0, 1, nt, acc, corr))
N_QUANT_KERNELS(q5_0, 0, n_q32(w, x, xs, kb0, kb1, 0, 1, 0, nt, acc, corr))
N_QUANT_KERNELS(q5_1, 1, n_q32(w, x, xs, kb0, kb1, 0, 1, 1, nt, acc, corr))
N_QUANT_KERNELS(q4_k, 0, n_qk_k(w, x, xsum, xs, kb0, kb1, 0, nt, acc))
N_QUANT_KERNELS(q5_k, 0, n_qk_k(w, x, xsum, xs, kb0, kb1, 1, nt, acc))
N_QUANT_KERNELS(q6_k, 0, n_q6_k(w, x, xs, kb0, kb1, nt, acc))

static float neon_f16(const uint8_t *w, const float *x, int64_t K)
{
    float32x4_t a0 = vdupq_n_f32(0.0f), a1 = a0;
    int64_t i = 0;
    for (; i + 8 <= K; i += 8) {
        const float16x8_t h = vreinterpretq_f16_u8(vld1q_u8(w + 2 * i));
        a0 = vfmaq_f32(a0, vcvt_f32_f16(vget_low_f16(h)), vld1q_f32(x + i));
        a1 = vfmaq_f32(a1, vcvt_high_f32_f16(h), vld1q_f32(x + i + 4));
    }
    float s = vaddvq_f32(vaddq_f32(a0, a1));
    for (; i < K; i++)
        s += n_f16(w + 2 * i) * x[i];
    return s;
}

static float neon_f32(const uint8_t *w, const float *x, int64_t K)
{
    const float *f = (const float *)(const void *)w;
    float32x4_t a0 = vdupq_n_f32(0.0f), a1 = a0;
    int64_t i = 0;
    for (; i + 8 <= K; i += 8) {
        a0 = vfmaq_f32(a0, vld1q_f32(f + i), vld1q_f32(x + i));
        a1 = vfmaq_f32(a1, vld1q_f32(f + i + 4), vld1q_f32(x + i + 4));
    }
    float s = vaddvq_f32(vaddq_f32(a0, a1));
    for (; i < K; i++)
        s += f[i] * x[i];
    return s;
}

/* m40_xq_quantize's twin (cpu_dot.c), the same records bit for bit: the same amax, d
 * and id, x * id rounded to nearest even (vrndnq: as nearbyintf in the default mode),
 * clamped to +-32767. */
static void neon_quantize(const float *x, int64_t K, m40_xq *out)
{
    const int span = K % 256 == 0 ? 8 : 1;
    for (int64_t b0 = 0; b0 < K / 32; b0 += span) {
        float32x4_t m = vdupq_n_f32(0.0f);
        for (int i = 0; i < 8 * span; i++)
            m = vmaxq_f32(m, vabsq_f32(vld1q_f32(x + 32 * b0 + 4 * i)));
        const float amax = vmaxvq_f32(m);
        const float d = amax / 32767.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
        for (int64_t b = b0; b < b0 + span; b++) {
            m40_xq *r = &out[b];
            int32x4_t s_lo = vdupq_n_s32(0), s_hi = vdupq_n_s32(0);
            for (int i = 0; i < 8; i++) {
                float32x4_t v = vrndnq_f32(vmulq_n_f32(vld1q_f32(x + 32 * b + 4 * i), id));
                v = vminq_f32(vmaxq_f32(v, vdupq_n_f32(-32767.0f)), vdupq_n_f32(32767.0f));
                const int32x4_t q = vcvtq_s32_f32(v);
                vst1_s16(r->q + 4 * i, vmovn_s32(q));
                if (i < 4)
                    s_lo = vaddq_s32(s_lo, q);
                else
                    s_hi = vaddq_s32(s_hi, q);
            }
            const int lo = vaddvq_s32(s_lo), hi = vaddvq_s32(s_hi);
            r->d = d;
            r->s = d * (float)(lo + hi);
            r->h[0] = lo;
            r->h[1] = hi;
        }
    }
}

static void neon_axpy(float *y, float a, const float *x, int64_t n)
{
    int64_t i = 0;
    for (; i + 4 <= n; i += 4)
        vst1q_f32(y + i, vfmaq_n_f32(vld1q_f32(y + i), vld1q_f32(x + i), a));
    for (; i < n; i++)
        y[i] += a * x[i];
}

static m40_dot_q_fn neon_table_q(uint32_t type)
{
    switch (type) {
    case M40_TYPE_Q8_0: return neon_q8_0;
    case M40_TYPE_Q4_0: return neon_q4_0;
    case M40_TYPE_Q4_1: return neon_q4_1;
    case M40_TYPE_Q5_0: return neon_q5_0;
    case M40_TYPE_Q5_1: return neon_q5_1;
    case M40_TYPE_Q4_K: return neon_q4_k;
    case M40_TYPE_Q5_K: return neon_q5_k;
    case M40_TYPE_Q6_K: return neon_q6_k;
    default: return NULL;
    }
}

static m40_dot_part_fn neon_table_part(uint32_t type)
{
    switch (type) {
    case M40_TYPE_Q8_0: return neon_q8_0_part;
    case M40_TYPE_Q4_0: return neon_q4_0_part;
    case M40_TYPE_Q4_1: return neon_q4_1_part;
    case M40_TYPE_Q5_0: return neon_q5_0_part;
    case M40_TYPE_Q5_1: return neon_q5_1_part;
    case M40_TYPE_Q4_K: return neon_q4_k_part;
    case M40_TYPE_Q5_K: return neon_q5_k_part;
    case M40_TYPE_Q6_K: return neon_q6_k_part;
    default: return NULL;
    }
}

static m40_dot_fin_fn neon_table_fin(uint32_t type)
{
    switch (type) {
    case M40_TYPE_Q8_0: return neon_q8_0_fin;
    case M40_TYPE_Q4_0: return neon_q4_0_fin;
    case M40_TYPE_Q4_1: return neon_q4_1_fin;
    case M40_TYPE_Q5_0: return neon_q5_0_fin;
    case M40_TYPE_Q5_1: return neon_q5_1_fin;
    case M40_TYPE_Q4_K: return neon_q4_k_fin;
    case M40_TYPE_Q5_K: return neon_q5_k_fin;
    case M40_TYPE_Q6_K: return neon_q6_k_fin;
    default: return NULL;
    }
}

static m40_dot_f_fn neon_table_f(uint32_t type)
{
    return type == M40_TYPE_F16 ? neon_f16 : type == M40_TYPE_F32 ? neon_f32 : NULL;
}

/* (the GLU: the portable kernels) */
static const m40_cpu_kernels neon_kernels = {
    .q = neon_table_q,
    .part = neon_table_part,
    .fin = neon_table_fin,
    .f = neon_table_f,
    .glu = NULL,
    .quantize = neon_quantize,
    .axpy = neon_axpy,
};

const m40_cpu_kernels *m40_cpu_kernels_neon(void) { return &neon_kernels; }

#else

const m40_cpu_kernels *m40_cpu_kernels_neon(void) { return NULL; }

#endif
