/* The fast CPU path's kernels (engine/model/cpu_dot.h, cpu_matmul_fast.h):
 *   - the activation quantizer: |x - d*q| <= d/2 per element, the sums as stated;
 *   - every SIMD kernel this CPU runs against its portable twin, every type, on random
 *     blocks (random bytes for the levels, scales and mins; random F16 block scales),
 *     K of several block counts: the same integers, so within F32 rounding of the sums;
 *   - the portable twin against the exact product (the dequantized row times the F32
 *     x, kernels/ref/quant.h) within the quantization bound of cpu_dot.h;
 *   - the threaded, tiled matmul over odd row and token counts against the per-row
 *     kernel, bit for bit, and one group of three matrices of one input;
 *   - a model on the fast path (shared tiny quantized models): a batch of 70 tokens
 *     gives the logits of the same tokens fed one by one, bit for bit (the piecewise
 *     kernels, the pool's quantization and the one-token kernels agree);
 *   - the K-quants at their integer extremes against the exact sum (no int32 overflow). */
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdint.h>
#include <stdlib.h>
#include <unistd.h>

#include "check.h"
#include "model/cpu_dot.h"
#include "model/cpu_matmul_fast.h"
#include "model/model.h"
#include "ref/ggml_types.h"
#include "ref/quant.h"
#include "util/threadpool.h"

static uint64_t rng = 0x9e3779b97f4a7c15ULL;
static uint32_t rnd(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (uint32_t)(rng >> 16);
}
static float urand(void) { return (float)(rnd() & 0xffffff) / 16777216.0f; } /* [0, 1) */

static void put_f16(uint8_t *p, float v)
{
    uint16_t h = m40_fp32_to_fp16(v);
    p[0] = (uint8_t)h;
    p[1] = (uint8_t)(h >> 8);
}

typedef struct {
    uint32_t type;
    int block, bytes;
} tinfo;

static const tinfo types[] = {
    {M40_TYPE_Q8_0, 32, 34},   {M40_TYPE_Q4_0, 32, 18},   {M40_TYPE_Q4_1, 32, 20},   {M40_TYPE_Q5_0, 32, 22},
    {M40_TYPE_Q5_1, 32, 24},   {M40_TYPE_Q4_K, 256, 144}, {M40_TYPE_Q5_K, 256, 176}, {M40_TYPE_Q6_K, 256, 210},
    {M40_TYPE_F16, 1, 2},      {M40_TYPE_F32, 1, 4},
};

/* A random row of K elements: random bytes, then the F16 scales (and mins) set to
 * finite values of either sign where the format has them. */
static void random_row(const tinfo *t, uint8_t *w, int64_t K)
{
    int64_t nb = K / t->block;
    for (int64_t i = 0; i < nb * t->bytes; i++)
        w[i] = (uint8_t)rnd();
    for (int64_t b = 0; b < nb; b++) {
        uint8_t *p = w + b * t->bytes;
        float s = (urand() * 2 - 1) * 0.05f, m = (urand() * 2 - 1) * 0.5f;
        switch (t->type) {
        case M40_TYPE_Q8_0: case M40_TYPE_Q4_0: case M40_TYPE_Q5_0: put_f16(p, s); break;
        case M40_TYPE_Q4_1: case M40_TYPE_Q5_1: put_f16(p, s); put_f16(p + 2, m); break;
        case M40_TYPE_Q4_K: case M40_TYPE_Q5_K: put_f16(p, s * 0.1f); put_f16(p + 2, fabsf(m) * 0.02f); break;
        case M40_TYPE_Q6_K: put_f16(p + 208, s * 0.05f); break;
        case M40_TYPE_F16: put_f16(p, (urand() * 2 - 1)); break;
        case M40_TYPE_F32: { float v = urand() * 2 - 1; memcpy(p, &v, 4); break; }
        }
    }
}

/* activations: mostly small, a few outliers per block as real ones have */
static void random_x(float *x, int64_t K)
{
    for (int64_t i = 0; i < K; i++) {
        x[i] = (urand() * 2 - 1) * 2.0f;
        if (rnd() % 31 == 0)
            x[i] *= 20.0f;
        if (rnd() % 97 == 0)
            x[i] = 0.0f;
    }
    if (K >= 64) /* a block of zeros: d = 0 */
        for (int i = 32; i < 64; i++)
            x[i] = 0.0f;
}

/* Whether isa s has kernels on this architecture (the x86 isas on AArch64, NEON on x86,
 * have none). */
static int isa_runs(int s) { return s == M40_ISA_PORTABLE || m40_xq_quantize_isa(s) != NULL; }

static void test_quantizer(void)
{
    float x[256];
    m40_xq q[8];
    int bad = 0;
    for (int rep = 0; rep < 200; rep++) {
        random_x(x, 256);
        m40_xq_quantize(x, 256, q);
        float amax = 0; /* K = 256: one scale for the super-block */
        for (int i = 0; i < 256; i++)
            amax = fmaxf(amax, fabsf(x[i]));
        for (int b = 0; b < 8; b++) {
            int s0 = 0, s1 = 0;
            for (int i = 0; i < 32; i++) {
                float e = fabsf(x[32 * b + i] - q[b].d * (float)q[b].q[i]);
                if (e > q[b].d * (0.5f + 0.01f) + 1e-30f || q[b].q[i] < -32767)
                    bad++;
                *(i < 16 ? &s0 : &s1) += q[b].q[i];
            }
            if (q[b].d != amax / 32767.0f || q[b].h[0] != s0 || q[b].h[1] != s1 ||
                q[b].s != q[b].d * (float)(s0 + s1))
                bad++;
        }
    }
    /* K not a multiple of 256: a scale a block */
    for (int rep = 0; rep < 200; rep++) {
        random_x(x, 96);
        m40_xq_quantize(x, 96, q);
        for (int b = 0; b < 3; b++) {
            float amax = 0;
            for (int i = 0; i < 32; i++)
                amax = fmaxf(amax, fabsf(x[32 * b + i]));
            bad += q[b].d != amax / 32767.0f;
        }
    }
    CHECK(bad == 0, "%d quantizer elements or records out of bound", bad);
    /* every isa's quantizer writes the portable one's records bit for bit (K of 13
     * blocks: a scale a block; of 16: a scale a super-block) */
    int isa = m40_cpu_isa(), differ = 0, runs = 0;
    float xs[32 * 16];
    m40_xq a[16], b[16];
    for (int s = M40_ISA_PORTABLE + 1; s <= isa; s++) if (isa_runs(s))
        for (int rep = 0; rep < 300; rep++) {
            const int64_t K = rep % 2 ? 32 * 13 : 32 * 16;
            random_x(xs, K);
            if (rep % 7 == 0) /* ties: halves of the step */
                for (int i = 0; i < 32; i++)
                    xs[i] = (float)(i - 16) * 0.5f;
            memset(a, 0, sizeof a);
            memset(b, 0, sizeof b);
            m40_xq_quantize_isa(M40_ISA_PORTABLE)(xs, K, a);
            m40_xq_quantize_isa(s)(xs, K, b);
            differ += memcmp(a, b, sizeof a) != 0;
            runs++;
        }
    CHECK(differ == 0, "%d of %d SIMD quantizations differ from the portable one", differ, runs);
}

static void test_kernels(void)
{
    const int isa = m40_cpu_isa();
    printf("CPU instruction set: %s\n", m40_cpu_isa_name(isa));
    static const int nblocks[] = {1, 2, 3, 5, 8, 13};
    for (size_t ti = 0; ti < sizeof types / sizeof types[0]; ti++) {
        const tinfo *t = &types[ti];
        int isq = t->block > 1;
        int bad_twin = 0, bad_exact = 0, n_cases = 0, n_simd = 0, bad_part = 0, n_part = 0;
        double worst_twin = 0, worst_exact = 0;
        for (size_t kb = 0; kb < sizeof nblocks / sizeof nblocks[0]; kb++) {
            /* K-quants: super-blocks; 32-blocks: blocks; floats: odd lengths too */
            int64_t K = isq ? (int64_t)nblocks[kb] * t->block : (int64_t)nblocks[kb] * 32 + (int64_t)(kb & 1) * 7;
            uint8_t *w = malloc((size_t)(K / t->block) * t->bytes);
            float *x = malloc((size_t)K * sizeof *x), *xd = malloc((size_t)K * sizeof *xd),
                  *wd = malloc((size_t)K * sizeof *wd);
            m40_xq *xq = malloc((size_t)(K / 32 + 1) * sizeof *xq);
            float *xsum = malloc((size_t)(K / 32 + 1) * sizeof *xsum);
            for (int rep = 0; rep < 40; rep++) {
                random_row(t, w, K);
                random_x(x, K);
                if (isq) {
                    m40_xq_quantize(x, K, xq);
                    m40_xq_sums(xq, K / 32, xsum);
                }
                m40_dequantize_row(t->type, w, wd, K);
                double mag = 0, qbound = 0; /* sum |w||x| and sum |w| d/2 */
                for (int64_t k = 0; k < K; k++) {
                    xd[k] = isq ? xq[k / 32].d * (float)xq[k / 32].q[k % 32] : x[k];
                    mag += fabs((double)wd[k] * x[k]);
                    if (isq)
                        qbound += fabs((double)wd[k]) * xq[k / 32].d * 0.51;
                }
                /* the twin: the portable kernel (F32 has none: the exact dot stands in) */
                m40_dot_q_fn tq = isq ? m40_dot_q_kernel(t->type, M40_ISA_PORTABLE) : NULL;
                m40_dot_f_fn tf = isq ? NULL : m40_dot_f_kernel(t->type, M40_ISA_PORTABLE);
                double twin = isq ? tq(w, xq, xsum, K) : tf ? tf(w, x, K) : m40_dot_row(t->type, w, x, K);
                double exact = m40_dot_row(t->type, w, x, K);
                /* twin vs exact: the quantization bound, plus F32 rounding of the sums */
                double e = fabs(twin - exact), tol = qbound * (1 + 1e-5) + 1e-5 * mag + 1e-30;
                if (e > tol)
                    bad_exact++;
                if (e / (tol > 0 ? tol : 1) > worst_exact)
                    worst_exact = e / (tol > 0 ? tol : 1);
                /* the twin's integers are exact: it equals the dot of the dequantized
                 * quantized x up to F32 rounding */
                if (isq) {
                    double ref = m40_dot_row(t->type, w, xd, K);
                    if (fabs(twin - ref) > 2e-5 * mag + 1e-30)
                        bad_exact++;
                }
                n_cases++;
                for (int s = M40_ISA_PORTABLE + 1; s <= isa; s++) if (isa_runs(s)) {
                    double v;
                    if (isq) {
                        m40_dot_q_fn k = m40_dot_q_kernel(t->type, s);
                        if (!k)
                            continue;
                        v = k(w, xq, xsum, K);
                    } else {
                        m40_dot_f_fn k = m40_dot_f_kernel(t->type, s);
                        if (!k)
                            continue;
                        v = k(w, x, K);
                    }
                    n_simd++;
                    if (isq && m40_dot_part_kernel(t->type, s) && K / 32 >= 1) {
                        /* the piecewise kernel: the one-token kernel's bits for each of 8
                         * tokens, the row cut at random block boundaries (super-block ones
                         * for K-quants), 1..8 tokens a call */
                        const int64_t nb = K / 32;
                        enum { NTK = 8 };
                        m40_xq *xk = malloc((size_t)nb * NTK * sizeof *xk);
                        float *xt = malloc((size_t)K * sizeof *xt), *sk = malloc((size_t)nb * NTK * sizeof *sk);
                        for (int tk = 0; tk < NTK; tk++) {
                            if (tk == 0)
                                memcpy(xk, xq, (size_t)nb * sizeof *xk);
                            else {
                                random_x(xt, K);
                                m40_xq_quantize(xt, K, xk + nb * tk);
                            }
                        }
                        m40_xq_sums(xk, nb * NTK, sk);
                        m40_dot_part_fn part = m40_dot_part_kernel(t->type, s);
                        m40_dot_fin_fn fin = m40_dot_fin_kernel(t->type, s);
                        m40_dot_state st[NTK];
                        memset(st, 0, sizeof st);
                        const int64_t unit = t->block == M40_QK_K ? 8 : 1;
                        const int ntok = 1 + rep % NTK;
                        for (int64_t kb = 0; kb < nb;) {
                            int64_t ke = kb + unit * (1 + (int64_t)(rnd() % 5));
                            ke = ke < nb ? ke : nb;
                            for (int tk = 0; tk < NTK; tk += ntok)
                                part(w, xk + nb * tk, sk + nb * tk, nb, kb, ke, NTK - tk < ntok ? NTK - tk : ntok,
                                     st + tk);
                            kb = ke;
                        }
                        for (int tk = 0; tk < NTK; tk++) {
                            float one = m40_dot_q_kernel(t->type, s)(w, xk + nb * tk, sk + nb * tk, K);
                            float pc = fin(&st[tk]);
                            if (memcmp(&one, &pc, sizeof one))
                                bad_part++;
                        }
                        n_part++;
                        free(xk);
                        free(xt);
                        free(sk);
                    }
                    double es = fabs(v - twin), tols = 2e-5 * mag + 1e-30;
                    if (es > tols) {
                        if (bad_twin < 3)
                            fprintf(stderr, "  %s K=%lld %s: simd %.9g twin %.9g\n", m40_type_name(t->type),
                                    (long long)K, m40_cpu_isa_name(s), v, twin);
                        bad_twin++;
                    }
                    if (es / tols > worst_twin)
                        worst_twin = es / tols;
                }
            }
            free(w);
            free(x);
            free(xd);
            free(wd);
            free(xq);
            free(xsum);
        }
        CHECK(bad_exact == 0, "%s: %d of %d twin products outside the quantization bound", m40_type_name(t->type),
              bad_exact, n_cases);
        CHECK(bad_twin == 0, "%s: %d of %d SIMD products differ from the twin", m40_type_name(t->type), bad_twin,
              n_simd);
        CHECK(bad_part == 0, "%s: %d piecewise products differ from the one-token kernel's bits (%d calls)",
              m40_type_name(t->type), bad_part, n_part);
        if (isa > M40_ISA_PORTABLE && isq)
            CHECK(n_part > 0, "%s: no piecewise kernel ran", m40_type_name(t->type));
        if (isa > M40_ISA_PORTABLE && t->type != M40_TYPE_F32)
            CHECK(n_simd > 0, "%s: no SIMD kernel ran on a CPU with %s", m40_type_name(t->type),
                  m40_cpu_isa_name(isa));
        printf("%-5s %3d products, %3d SIMD: worst twin/exact %.3f of its bound, SIMD/twin %.3f\n",
               m40_type_name(t->type), n_cases, n_simd, worst_exact, worst_twin);
    }
    /* axpy: every isa against the plain loop (one FMA per element: within 1 ulp of
     * the product's rounding) */
    {
        float y0[77], y1[77], xv[77];
        int bad_axpy = 0;
        for (int s = M40_ISA_PORTABLE; s <= isa; s++) if (isa_runs(s))
            for (int rep = 0; rep < 50; rep++) {
                int n = 1 + (int)(rnd() % 77);
                float a = urand() * 2 - 1;
                for (int i = 0; i < n; i++) {
                    y0[i] = y1[i] = urand() * 4 - 2;
                    xv[i] = urand() * 4 - 2;
                }
                m40_axpy_kernel(s)(y1, a, xv, n);
                for (int i = 0; i < n; i++) {
                    y0[i] += a * xv[i];
                    if (fabsf(y0[i] - y1[i]) > 1e-6f * (fabsf(y0[i]) + fabsf(a * xv[i])) + 1e-30f)
                        bad_axpy++;
                }
            }
        CHECK(bad_axpy == 0, "%d axpy elements differ", bad_axpy);
    }
    /* types without a fast kernel keep the exact path */
    uint32_t none[] = {M40_TYPE_Q2_K, M40_TYPE_Q3_K, M40_TYPE_BF16, M40_TYPE_MXFP4};
    for (size_t i = 0; i < sizeof none / sizeof none[0]; i++)
        for (int s = 0; s <= isa; s++)
            CHECK(!m40_dot_q_kernel(none[i], s) && !m40_dot_f_kernel(none[i], s), "%s has a fast kernel",
                  m40_type_name(none[i]));
}

/* The GLU kernels: every isa's SiLU and GELU against the portable twin (the exact
 * path's formulas) on random gates over the range activations take, odd lengths (the
 * SIMD tails), and the extremes: large negative (e^x's clamp), large positive, zero,
 * within 4e-6 relative (the polynomial e^x: a few units of F32's last place). */
/* The K-quants' integer sums at their largest: every level and sub-block scale at its
 * extreme and every activation +-32767 of one sign (x all equal), so each int32 lane
 * reaches its bound (Q5_K 2.05e9, Q6_K 2,147,418,112 in a half super-block: cpu_dot_x86.h).
 * An overflow would be off by 2^32 d; the kernels must give the exact dot within F32
 * rounding, on every isa, one token and piecewise alike. */
static void test_extremes(void)
{
    const int64_t K = 1024;
    uint8_t w[4 * 210];
    float x[1024], wd[1024];
    m40_xq xq[32];
    float xsum[32];
    int bad = 0, runs = 0;
    for (int variant = 0; variant < 3; variant++)
        for (int sign = 0; sign < 2; sign++) {
            uint32_t type = variant == 0 ? M40_TYPE_Q4_K : variant == 1 ? M40_TYPE_Q5_K : M40_TYPE_Q6_K;
            int bytes = variant == 0 ? 144 : variant == 1 ? 176 : 210;
            for (int b = 0; b < 4; b++) {
                uint8_t *p = w + b * bytes;
                if (variant < 2) { /* d 1, dmin 0: scales 63, levels 15 (31), mins 0 */
                    put_f16(p, 1.0f);
                    put_f16(p + 2, 0.0f);
                    for (int j = 0; j < 12; j++) /* every sc 63 (scale_min_k4), every mn 0 */
                        p[4 + j] = j < 4 ? 0xff : j < 8 ? 0x00 : 0x0f;
                    memset(p + (variant ? 48 : 16), 0xff, 128);
                    if (variant)
                        memset(p + 16, 0xff, 32);
                } else { /* levels 0 (-32 after the offset), scales -128, d 1 */
                    memset(p, 0, 192);
                    memset(p + 192, 0x80, 16);
                    put_f16(p + 208, 1.0f);
                }
            }
            for (int64_t k = 0; k < K; k++)
                x[k] = sign ? -1.0f : 1.0f;
            m40_xq_quantize(x, K, xq);
            m40_xq_sums(xq, K / 32, xsum);
            m40_dequantize_row(type, w, wd, K);
            double exact = 0;
            for (int64_t k = 0; k < K; k++)
                exact += (double)wd[k] * xq[k / 32].d * xq[k / 32].q[k % 32];
            for (int s = M40_ISA_PORTABLE; s <= m40_cpu_isa(); s++) if (isa_runs(s)) {
                double v = m40_dot_q_kernel(type, s)(w, xq, xsum, K);
                runs++;
                if (fabs(v - exact) > 1e-5 * fabs(exact)) {
                    fprintf(stderr, "  %s %s sign %d: %.9g, exact %.9g\n", m40_type_name(type), m40_cpu_isa_name(s),
                            sign, v, exact);
                    bad++;
                }
                m40_dot_part_fn part = m40_dot_part_kernel(type, s);
                if (part) {
                    m40_dot_state st;
                    memset(&st, 0, sizeof st);
                    part(w, xq, xsum, 0, 0, 8, 1, &st);
                    part(w, xq, xsum, 0, 8, 32, 1, &st);
                    bad += fabs(m40_dot_fin_kernel(type, s)(&st) - exact) > 1e-5 * fabs(exact);
                }
            }
        }
    CHECK(bad == 0, "%d of %d extreme K-quant products off the exact sum (int32 overflow?)", bad, runs);
}

static void test_glu(void)
{
    const int isa = m40_cpu_isa();
    CHECK(m40_glu_kernel(M40_GLU_SILU, M40_ISA_PORTABLE) && m40_glu_kernel(M40_GLU_GELU_TANH, M40_ISA_PORTABLE),
          "portable GLU kernels");
    CHECK(!m40_glu_kernel(7, M40_ISA_PORTABLE), "no kernel for an unknown activation");
    static float g0[333], g1[333], up[333];
    for (int act = M40_GLU_SILU; act <= M40_GLU_GELU_TANH; act++)
        for (int s = M40_ISA_PORTABLE + 1; s <= isa; s++) if (isa_runs(s)) {
            m40_glu_fn simd = m40_glu_kernel(act, s), twin = m40_glu_kernel(act, M40_ISA_PORTABLE);
            CHECK(simd != NULL, "act %d: no %s kernel", act, m40_cpu_isa_name(s));
            if (!simd)
                continue;
            int bad = 0;
            double worst = 0;
            for (int rep = 0; rep < 200; rep++) {
                const int n = 1 + (int)(rnd() % 333);
                const float span = rep < 100 ? 8.0f : 60.0f;
                for (int i = 0; i < n; i++) {
                    g0[i] = g1[i] = (urand() * 2 - 1) * span;
                    up[i] = urand() * 4 - 2;
                }
                if (rep == 0 && n > 6) {
                    const float ext[] = {-200.0f, -88.0f, 0.0f, -0.0f, 89.0f, 300.0f};
                    for (int i = 0; i < 6; i++)
                        g0[i] = g1[i] = ext[i];
                }
                float xin[333];
                memcpy(xin, g0, sizeof(float) * (size_t)n);
                twin(g0, up, n);
                simd(g1, up, n);
                for (int i = 0; i < n; i++) {
                    /* GELU's twin forms 1 + tanh(y), which cancels where tanh is near -1:
                     * its own error there is up to ~2^-23 of 0.5 |x up| (the SIMD kernel,
                     * x sigmoid(2y), does not cancel) */
                    const double d = fabs((double)g0[i] - (double)g1[i]), r = d / (fabs((double)g0[i]) + 1e-30);
                    const double cancel = act == M40_GLU_GELU_TANH ? 2.4e-7 * fabs((double)xin[i] * up[i]) : 0.0;
                    if (d > 4e-6 * fabs((double)g0[i]) + cancel + 1e-30 || g1[i] != g1[i])
                        bad++;
                    else if (r > worst && fabs((double)g0[i]) >= 0.01 * fabs((double)xin[i] * up[i]) && g0[i] != 0.0f)
                        worst = r; /* away from GELU's cancellation */
                }
            }
            CHECK(bad == 0, "act %d %s: %d elements off the twin", act, m40_cpu_isa_name(s), bad);
            printf("glu act %d %s: worst %.2e relative to the twin\n", act, m40_cpu_isa_name(s), worst);
        }
}

/* The pool's matmul: odd rows, odd token counts, tiles and chunks, a group of three. */
static void test_matmul(void)
{
    m40_threadpool *pool = m40_threadpool_new(3);
    CHECK(pool != NULL, "pool");
    if (!pool)
        return;
    static const uint32_t mt[] = {M40_TYPE_Q4_K, M40_TYPE_Q5_K, M40_TYPE_Q6_K, M40_TYPE_Q8_0, M40_TYPE_Q4_0,
                                  M40_TYPE_Q4_1, M40_TYPE_Q5_0, M40_TYPE_Q5_1, M40_TYPE_F16};
    /* 1201 (K-quants, 19 tokens, K 8192): a chunk of more rows than AMX stages at once */
    static const int rows_list[] = {1, 17, 37, 301, 1201};
    /* 4 and more: AMX's tiles where the CPU has them (16 tokens a tile, 33: a third
     * tile of one token), the one-token kernel's bits all the same */
    static const int n_list[] = {1, 3, 4, 19, 33};
    int bad = 0, cases = 0;
    for (size_t ti = 0; ti < sizeof mt / sizeof mt[0]; ti++) {
        const tinfo *t = NULL;
        for (size_t i = 0; i < sizeof types / sizeof types[0]; i++)
            if (types[i].type == mt[ti])
                t = &types[i];
        const int isq = t->block > 1;
        for (size_t ri = 0; ri < sizeof rows_list / sizeof rows_list[0]; ri++)
            for (size_t ni = 0; ni < sizeof n_list / sizeof n_list[0]; ni++) {
                int rows = rows_list[ri], n = n_list[ni];
                if (rows > 301 && (t->block != 256 || n != 19))
                    continue;
                /* 1536: more than one range of the piecewise products (48 blocks); 640:
                 * records without shared super-block scales, 20 blocks (not 8k) */
                const int64_t K = rows > 301 ? 8192 : (ri + ni) % 2 ? 1536 : t->block == 32 ? 640 : 512;
                size_t rb = (size_t)(K / t->block) * t->bytes;
                uint8_t *wd = malloc(rb * rows * 3);
                for (int r = 0; r < rows * 3; r++)
                    random_row(t, wd + rb * r, K);
                float *x = malloc(sizeof *x * K * n), *out = malloc(sizeof *out * rows * n * 3);
                m40_xq *xq = malloc(sizeof *xq * (K / 32) * n);
                float *xsum = malloc(sizeof *xsum * (K / 32) * n);
                for (int i = 0; i < n; i++)
                    random_x(x + K * i, K);
                m40_fast_quantize(pool, x, n, K, xq, xsum);
                m40_matrix m3[3];
                const m40_matrix *ws[3];
                float *outs[3];
                for (int g = 0; g < 3; g++) {
                    m3[g] = (m40_matrix){.data = wd + rb * rows * g, .type = t->type, .rows = rows - g * (rows > 2),
                                         .cols = K, .row_bytes = rb};
                    ws[g] = &m3[g];
                    outs[g] = out + (size_t)rows * n * g;
                    int quant = -1;
                    CHECK(m40_fast_supported(ws[g], &quant) && quant == isq, "%s supported", m40_type_name(t->type));
                }
                m40_fast_matmul(pool, 3, ws, outs, 3, x, xq, xsum, n);
                int isa = m40_cpu_isa();
                for (int g = 0; g < 3; g++)
                    for (int tk = 0; tk < n; tk++)
                        for (int64_t r = 0; r < m3[g].rows; r++) {
                            const uint8_t *row = m3[g].data + rb * r;
                            float want = isq ? m40_dot_q_kernel(t->type, isa)(row, xq + (K / 32) * tk,
                                                                             xsum + (K / 32) * tk, K)
                                             : m40_dot_f_kernel(t->type, isa)(row, x + K * tk, K);
                            if (memcmp(&want, &outs[g][(size_t)tk * m3[g].rows + r], sizeof want))
                                bad++;
                        }
                cases++;
                free(wd);
                free(x);
                free(out);
                free(xq);
                free(xsum);
            }
    }
    CHECK(bad == 0, "%d matmul outputs differ from their row's kernel (%d cases)", bad, cases);
    m40_threadpool_free(pool);
}

/* m40_thread_scratch: a thread's buffers go with it (a model's pool threads end when it
 * unloads: 64 threads that each touched 8 MB must leave the resident size as it was) */
static void *scratch_thread(void *arg)
{
    (void)arg;
    for (int slot = 0; slot < 2; slot++) {
        uint8_t *p = m40_thread_scratch(slot, (size_t)4 << 20);
        if (!p)
            return (void *)1;
        memset(p, 1, (size_t)4 << 20);
        if (m40_thread_scratch(slot, 100) != (void *)p) /* grown, never shrunk */
            return (void *)1;
    }
    return NULL;
}

static long resident_kb(void)
{
    long pages = 0, res = 0;
    FILE *f = fopen("/proc/self/statm", "r");
    if (!f)
        return -1;
    if (fscanf(f, "%ld %ld", &pages, &res) != 2)
        res = -1;
    fclose(f);
    return res < 0 ? -1 : res * (sysconf(_SC_PAGESIZE) / 1024);
}

static void test_thread_scratch(void)
{
    CHECK(m40_thread_scratch(2, 64) == NULL && m40_thread_scratch(-1, 64) == NULL, "slots 0 and 1 only");
    const long before = resident_kb();
    int bad = 0;
    for (int i = 0; i < 64; i++) {
        pthread_t t;
        void *rc = (void *)1;
        if (pthread_create(&t, NULL, scratch_thread, NULL) != 0 || pthread_join(t, &rc) != 0 || rc)
            bad++;
    }
    const long after = resident_kb();
    CHECK(bad == 0, "%d scratch threads failed", bad);
    if (before >= 0 && after >= 0)
        CHECK(after - before < 64 * 1024, "resident %ld kB -> %ld kB after 64 threads of 8 MB scratch", before, after);
}

#ifndef M40_CPU_DOT_ONLY /* tests/unit/neon.sh builds the kernels' checks alone */
static void test_model_batched(const char *rel)
{
    char path[4096], err[512];
    if (!check_shared_file(rel, path, sizeof path)) {
        SKIP("%s absent", rel);
        return;
    }
    m40_model_options o = {.n_threads = 2, .device = -1, .cpu_fast = 1};
    m40_model *m = NULL;
    if (m40_model_load_opts(path, &o, &m, err, sizeof err)) {
        CHECK(0, "load %s: %s", rel, err);
        return;
    }
    CHECK(!strncmp(m40_model_cpu_path(m), "fast", 4), "%s: path %s", rel, m40_model_cpu_path(m));
    const int n = 70;
    const int32_t V = m40_model_get_params(m)->n_vocab;
    m40_kv *kv = m40_kv_new(m, 2, 128);
    float *all = malloc(sizeof *all * (size_t)V * n), *one = malloc(sizeof *one * (size_t)V);
    int32_t tok[70], pos[70], slot[70];
    uint8_t want[70];
    for (int i = 0; i < n; i++) {
        tok[i] = (int32_t)(rnd() % (uint32_t)V);
        pos[i] = i;
        slot[i] = 0;
        want[i] = 1;
    }
    m40_batch b = {.n = n, .tokens = tok, .pos = pos, .slot = slot, .want_logits = want};
    int rc = kv && all && one ? m40_model_forward(m, kv, &b, all, err, sizeof err) : -1;
    CHECK(rc == 0, "%s: batch forward: %s", rel, err);
    int differ = 0;
    for (int i = 0; rc == 0 && i < n; i++) {
        int32_t s1 = 1;
        m40_batch b1 = {.n = 1, .tokens = &tok[i], .pos = &pos[i], .slot = &s1};
        rc = m40_model_forward(m, kv, &b1, one, err, sizeof err);
        differ += rc == 0 && memcmp(one, all + (size_t)i * V, sizeof *one * (size_t)V) != 0;
    }
    CHECK(rc == 0 && differ == 0, "%s: %d of %d rows differ between the batch and one by one (%s)", rel, differ, n,
          rc ? err : "");
    free(all);
    free(one);
    m40_kv_free(kv);
    m40_model_free(m);
}

#endif

int main(void)
{
    test_quantizer();
    test_kernels();
    test_extremes();
    test_glu();
    test_matmul();
    test_thread_scratch();
#ifndef M40_CPU_DOT_ONLY
    test_model_batched("models/tiny-llama-q4km.gguf");
    test_model_batched("models/tiny-llama-q4_0.gguf");
    test_model_batched("models/tiny-llama-q8_0.gguf");
    test_model_batched("models/next/tiny-qwen3moe-q4km.gguf");
#endif
    return check_done();
}
