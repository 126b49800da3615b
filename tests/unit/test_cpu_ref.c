/* CPU twins of the CUDA kernels (kernels/ref/cpu_ref.c) against direct formulas: paged
 * attention equals naive contiguous attention, prefill's last row equals decode, the KV
 * append lands where the page table says, RoPE matches the rotation formula, sliding
 * windows (Gemma 3) restrict attention to the last `window` positions. */
#include <math.h>
#include <string.h>

#include "check.h"
#include "ref/cpu_ref.h"
#include "ref/quant.h"

static uint32_t rs = 12345;
static float frand(void)
{
    rs = rs * 1664525u + 1013904223u;
    return (float)(rs >> 8) / 16777216.0f * 2.0f - 1.0f;
}

static void test_paged_attention(void)
{
    enum { HD = 64, NKV = 2, G = 4, NH = NKV * G };
    const int lens[3] = {1, 17, 40};
    /* pages of sequence s are given in reverse physical order to exercise the table */
    int32_t indptr[4] = {0}, indices[8], lpl[3];
    int nb = 0;
    for (int s = 0; s < 3; s++) {
        int pages = (lens[s] + 15) / 16;
        for (int p = 0; p < pages; p++)
            indices[indptr[s] + p] = 7 - (nb + p);
        nb += pages;
        indptr[s + 1] = nb;
        lpl[s] = lens[s] - (pages - 1) * 16;
    }
    CHECK(nb == 6, "pages %d", nb);
    static uint16_t kc[8 * NKV * 16 * HD], vc[8 * NKV * 16 * HD];
    static float k[3 * 40 * NKV * HD], v[3 * 40 * NKV * HD]; /* contiguous copy [s][t][h][d] */
    int32_t new_indptr[4] = {0};
    static float nk[97 * NKV * HD], nv[97 * NKV * HD];
    for (int s = 0, row = 0; s < 3; s++) {
        new_indptr[s + 1] = new_indptr[s] + lens[s];
        for (int t = 0; t < lens[s]; t++, row++)
            for (int j = 0; j < NKV * HD; j++) {
                float a = m40_fp16_to_fp32(m40_fp32_to_fp16(frand()));
                float b = m40_fp16_to_fp32(m40_fp32_to_fp16(frand()));
                nk[row * NKV * HD + j] = k[(s * 40 + t) * NKV * HD + j] = a;
                nv[row * NKV * HD + j] = v[(s * 40 + t) * NKV * HD + j] = b;
            }
    }
    m40_ref_kv_append(kc, vc, nk, NKV * HD, nv, NKV * HD, new_indptr, 3, new_indptr[3], indptr, indices, lpl, NKV, HD);
    /* token 20 of sequence 2, head 1, dim 5 sits in page indices[indptr[2] + 1], slot 4 */
    size_t at = (((size_t)indices[indptr[2] + 1] * NKV + 1) * 16 + 4) * HD + 5;
    CHECK(m40_fp16_to_fp32(kc[at]) == k[(2 * 40 + 20) * NKV * HD + 1 * HD + 5], "append position");

    float q[3 * NH * HD], out[3 * NH * HD];
    for (int i = 0; i < 3 * NH * HD; i++)
        q[i] = frand();
    const float scale = 0.125f;
    m40_ref_attn_decode(out, NH * HD, q, NH * HD, kc, vc, indptr, indices, lpl, 3, NH, NKV, HD, scale);
    double worst = 0;
    for (int s = 0; s < 3; s++)
        for (int h = 0; h < NH; h++) {
            const float *qh = q + (s * NH + h) * HD;
            double sc[40], mx = -1e30, sum = 0;
            for (int t = 0; t < lens[s]; t++) {
                double d = 0;
                for (int j = 0; j < HD; j++)
                    d += qh[j] * k[(s * 40 + t) * NKV * HD + (h / G) * HD + j];
                sc[t] = d * scale;
                mx = fmax(mx, sc[t]);
            }
            for (int t = 0; t < lens[s]; t++)
                sum += sc[t] = exp(sc[t] - mx);
            for (int j = 0; j < HD; j++) {
                double o = 0;
                for (int t = 0; t < lens[s]; t++)
                    o += sc[t] * v[(s * 40 + t) * NKV * HD + (h / G) * HD + j];
                worst = fmax(worst, fabs(o / sum - out[(s * NH + h) * HD + j]));
            }
        }
    CHECK(worst < 1e-5, "paged decode vs naive: max diff %g", worst);

    /* prefill with all 97 tokens as queries: each sequence's last row equals decode */
    static float pq[97 * NH * HD], po[97 * NH * HD];
    for (int s = 0; s < 3; s++)
        for (int i = 0; i < NH * HD; i++)
            for (int t = new_indptr[s]; t < new_indptr[s + 1]; t++)
                pq[t * NH * HD + i] = t == new_indptr[s + 1] - 1 ? q[s * NH * HD + i] : frand();
    m40_ref_attn_prefill(po, NH * HD, pq, NH * HD, new_indptr, 3, 97, kc, vc, indptr, indices, lpl, NH, NKV, HD,
                         scale);
    worst = 0;
    for (int s = 0; s < 3; s++)
        for (int i = 0; i < NH * HD; i++)
            worst = fmax(worst, fabs(po[(new_indptr[s + 1] - 1) * NH * HD + i] - out[s * NH * HD + i]));
    CHECK(worst < 1e-6, "prefill last row vs decode: %g", worst);
    /* the first token of a sequence attends only to itself: output = its V */
    worst = 0;
    for (int h = 0; h < NH; h++)
        for (int j = 0; j < HD; j++)
            worst = fmax(worst, fabs(po[new_indptr[1] * NH * HD + h * HD + j] - v[(1 * 40) * NKV * HD + (h / G) * HD + j]));
    CHECK(worst < 1e-6, "causal first row = V: %g", worst);

    /* sliding windows (Gemma 3's local layers) */
    static float wo[3 * NH * HD], wpo[97 * NH * HD], wgo[97 * NH * HD];
    m40_ref_attn_decode_window(wo, NH * HD, q, NH * HD, kc, vc, indptr, indices, lpl, 3, NH, NKV, HD, scale, 1000, 0.0f);
    CHECK(memcmp(wo, out, sizeof wo) == 0, "a window longer than the context changes decode");
    m40_ref_attn_decode_window(wo, NH * HD, q, NH * HD, kc, vc, indptr, indices, lpl, 3, NH, NKV, HD, scale, 1, 0.0f);
    worst = 0;
    for (int s = 0; s < 3; s++)
        for (int h = 0; h < NH; h++)
            for (int j = 0; j < HD; j++)
                worst = fmax(worst, fabs(wo[(s * NH + h) * HD + j] -
                                         v[(s * 40 + lens[s] - 1) * NKV * HD + (h / G) * HD + j]));
    CHECK(worst < 1e-6, "window 1: decode = the last V: %g", worst);
    /* window 5: decode vs naive over the last 5 positions, without and with a soft-cap
     * (Gemma 2's attn_logit_softcapping; 0.2 is within the scores' range here, so the
     * cap changes them) */
    for (int capped = 0; capped < 2; capped++) {
        const float cap = capped ? 0.2f : 0.0f;
        m40_ref_attn_decode_window(wo, NH * HD, q, NH * HD, kc, vc, indptr, indices, lpl, 3, NH, NKV, HD, scale, 5, cap);
        worst = 0;
        double moved = 0; /* how far the cap moved the scores */
        for (int s = 0; s < 3; s++)
            for (int h = 0; h < NH; h++) {
                const float *qh = q + (s * NH + h) * HD;
                int t0 = lens[s] > 5 ? lens[s] - 5 : 0;
                double sc[40], mx = -1e30, sum = 0;
                for (int t = t0; t < lens[s]; t++) {
                    double d = 0;
                    for (int j = 0; j < HD; j++)
                        d += qh[j] * k[(s * 40 + t) * NKV * HD + (h / G) * HD + j];
                    sc[t] = d * scale;
                    if (cap > 0) {
                        moved = fmax(moved, fabs(sc[t] - cap * tanh(sc[t] / cap)));
                        sc[t] = cap * tanh(sc[t] / cap);
                    }
                    mx = fmax(mx, sc[t]);
                }
                for (int t = t0; t < lens[s]; t++)
                    sum += sc[t] = exp(sc[t] - mx);
                for (int j = 0; j < HD; j++) {
                    double o = 0;
                    for (int t = t0; t < lens[s]; t++)
                        o += sc[t] * v[(s * 40 + t) * NKV * HD + (h / G) * HD + j];
                    worst = fmax(worst, fabs(o / sum - wo[(s * NH + h) * HD + j]));
                }
            }
        CHECK(worst < 1e-5, "window 5, cap %g: decode vs naive: %g", cap, worst);
        CHECK(!capped || moved > 1e-3, "the cap %g moved no score (max %g): the test cannot see it", cap, moved);
        /* prefill with window 5: last rows equal decode; generic with window 5 equals prefill */
        m40_ref_attn_prefill_window(wpo, NH * HD, pq, NH * HD, new_indptr, 3, 97, kc, vc, indptr, indices, lpl, NH, NKV,
                                    HD, scale, 5, cap);
        worst = 0;
        for (int s = 0; s < 3; s++)
            for (int i = 0; i < NH * HD; i++)
                worst = fmax(worst, fabs(wpo[(new_indptr[s + 1] - 1) * NH * HD + i] - wo[s * NH * HD + i]));
        CHECK(worst < 1e-6, "window 5: prefill last row vs decode: %g", worst);
        int32_t row_seq[97], row_pos[97];
        for (int s = 0; s < 3; s++)
            for (int t = new_indptr[s]; t < new_indptr[s + 1]; t++)
                row_seq[t] = s, row_pos[t] = t - new_indptr[s];
        m40_ref_attn_generic_window(wgo, NH * HD, pq, NH * HD, row_seq, row_pos, 97, kc, vc, indptr, indices, NH, NKV, HD,
                                    scale, 5, cap);
        CHECK(memcmp(wgo, wpo, sizeof wgo) == 0, "window 5, cap %g: generic differs from prefill", cap);
    }
}

static void test_gemma_helpers(void)
{
    enum { HD = 24, NH = 3, STRIDE = 100 };
    float x[2 * STRIDE], y[2 * STRIDE], w[HD];
    for (int i = 0; i < 2 * STRIDE; i++)
        x[i] = y[i] = 3 * frand();
    for (int i = 0; i < HD; i++)
        w[i] = 1 + frand() * 0.5f;
    m40_ref_rmsnorm_heads(x, STRIDE, NH, HD, w, 2, 1e-6f);
    double worst = 0;
    for (int r = 0; r < 2; r++) {
        for (int h = 0; h < NH; h++) {
            float o[HD];
            m40_ref_rmsnorm(y + r * STRIDE + h * HD, HD, w, o, M40K_TYPE_F32, HD, 1, HD, 1e-6f);
            for (int d = 0; d < HD; d++)
                worst = fmax(worst, fabs(o[d] - x[r * STRIDE + h * HD + d]));
        }
        for (int i = NH * HD; i < STRIDE; i++)
            CHECK(x[r * STRIDE + i] == y[r * STRIDE + i], "rmsnorm_heads wrote past its heads");
    }
    CHECK(worst < 1e-5, "rmsnorm_heads vs rmsnorm per head: %g", worst);
    float c[3] = {0.0f, 3.0f, -1000.0f};
    m40_ref_softcap(c, 3, 30.0f);
    CHECK(c[0] == 0.0f && fabsf(c[1] - 30.0f * tanhf(0.1f)) < 1e-6f && fabsf(c[2] + 30.0f) < 1e-4f, "softcap");
    m40_ref_scale(c, 3, 2.0f);
    CHECK(c[0] == 0.0f && fabsf(c[2] + 60.0f) < 2e-4f, "scale");
}

static void test_rope(void)
{
    enum { HD = 16, ROT = 8 };
    float x[2 * HD], y[2 * HD];
    int32_t pos = 1234;
    for (int neox = 0; neox <= 1; neox++) {
        for (int i = 0; i < 2 * HD; i++)
            x[i] = y[i] = frand();
        m40_ref_rope(y, 2 * HD, 2, NULL, 0, 0, HD, ROT, &pos, 1, 10000.0f, NULL, neox);
        double worst = 0;
        for (int h = 0; h < 2; h++)
            for (int i = 0; i < ROT / 2; i++) {
                double th = pos / pow(10000.0, 2.0 * i / ROT);
                int a = neox ? i : 2 * i, b = neox ? i + ROT / 2 : 2 * i + 1;
                double ra = x[h * HD + a] * cos(th) - x[h * HD + b] * sin(th);
                double rb = x[h * HD + a] * sin(th) + x[h * HD + b] * cos(th);
                worst = fmax(worst, fmax(fabs(ra - y[h * HD + a]), fabs(rb - y[h * HD + b])));
            }
        for (int h = 0; h < 2; h++)
            for (int i = ROT; i < HD; i++)
                worst = fmax(worst, fabs(x[h * HD + i] - y[h * HD + i])); /* beyond rot_dim: untouched */
        CHECK(worst < 1e-5, "rope neox %d: %g", neox, worst);
    }
}

static void test_small(void)
{
    float x[5] = {1, -2, 3, -4, 5}, w[5] = {1, 1, 1, 1, 2}, o[5];
    m40_ref_rmsnorm(x, 5, w, o, M40K_TYPE_F32, 5, 1, 5, 0.0f);
    CHECK(fabsf(o[4] - 2 * 5 / sqrtf(11.0f)) < 1e-6f, "rmsnorm %g", o[4]);
    float g[2] = {0.0f, 2.0f}, u[2] = {3.0f, 3.0f}, r[2];
    m40_ref_glu(M40K_GLU_SILU, g, u, 2, r, 2, 1, 2);
    CHECK(r[0] == 0.0f && fabsf(r[1] - 3 * 2 / (1 + expf(-2))) < 1e-6f, "silu %g", r[1]);
    m40_ref_glu(M40K_GLU_GELU_TANH, g, u, 2, r, 2, 1, 2);
    CHECK(fabsf(r[1] - 3 * 1.9545977f) < 1e-4f, "gelu %g", r[1]);
    float logits[6] = {1, 5, 5, -2, 4, 0};
    int32_t tok, tt[3];
    float lp, tl[3];
    m40_ref_sample_greedy(logits, 6, 1, 6, &tok, &lp, 3, tt, tl);
    double lse = 0;
    for (int i = 0; i < 6; i++)
        lse += exp(logits[i]);
    CHECK(tok == 1 && fabs(lp - (5 - log(lse))) < 1e-5, "argmax %d %g", tok, lp);
    CHECK(tt[0] == 1 && tt[1] == 2 && tt[2] == 4, "top-k %d %d %d", tt[0], tt[1], tt[2]);
    /* gemv twin = dequantize then dot */
    float wrow[64], xv[64], deq[64];
    uint8_t q[2 * 34];
    for (int i = 0; i < 64; i++)
        wrow[i] = frand(), xv[i] = frand();
    m40_quantize_row(M40_TYPE_Q8_0, wrow, q, 64);
    m40_dequantize_row(M40_TYPE_Q8_0, q, deq, 64);
    double d = 0;
    for (int i = 0; i < 64; i++)
        d += deq[i] * xv[i];
    float yv;
    m40_ref_gemv(q, M40K_TYPE_Q8_0, 1, 64, xv, 64, &yv, 1, 1);
    CHECK(fabs(yv - d) < 1e-5, "gemv q8_0 %g vs %g", yv, d);
}

/* The two-level int8 activation quantizer (twin of m40k_quantize_q8): record layout,
 * rounding (ties to even) of both levels, zero blocks, huge and tiny scales, the error
 * bound max|x|/254^2 (kernels.h 8b); the GEMV twin against the dequantized weights times
 * the dequantized activations, and against the exact F32 GEMV within the documented
 * bound sum |w| * max|x of the block| / 254^2 * (1 + 2^-14). */
static const float *q8_rec(const uint8_t *ws, int K, int b, int j, const int8_t **q1, const int8_t **q2)
{
    const uint8_t *r = ws + 80 * ((size_t)b * (K / 32) + j);
    *q1 = (const int8_t *)r;
    *q2 = *q1 + 32;
    return (const float *)(r + 64);
}

static void test_quantize_q8(void)
{
    enum { K = 96, BATCH = 3, XS = K + 5 };
    static float x[BATCH * XS];
    static uint8_t ws[BATCH * K / 32 * 80];
    for (int i = 0; i < BATCH * XS; i++)
        x[i] = frand();
    /* row 0, block 0: max 127 gives d1 = 1, so q1 = rint(x) with ties to even; the
     * residuals are 0 and +-0.5 (so d2 = 0.5/127, q2 = +-127) and 0.125 (q2 = 32) */
    const float ties[8] = {127.0f, 2.5f, 3.5f, -2.5f, -0.5f, 0.5f, 1.5f, -126.5f};
    const int want1[8] = {127, 2, 4, -2, 0, 0, 2, -126}, want2[8] = {0, 127, -127, -127, -127, 127, -127, -127};
    for (int i = 0; i < 32; i++)
        x[i] = i < 8 ? ties[i] : 0.125f;
    for (int i = 32; i < 64; i++) /* row 0, block 1: zero */
        x[i] = 0.0f;
    for (int i = 0; i < K; i++) /* row 1: huge in block 0, tiny in block 1, mixed in block 2 */
        x[XS + i] *= i < 32 ? 1e30f : i < 64 ? 1e-30f : (i == 70 ? 1e4f : 1e-4f);
    memset(ws, 0xAB, sizeof ws);
    m40_ref_quantize_q8(x, XS, K, BATCH, ws);
    const int8_t *q1, *q2;
    const float *f = q8_rec(ws, K, 0, 0, &q1, &q2);
    int ok = f[0] == 1.0f && f[1] == 0.5f / 127.0f && f[3] == 0.0f && q1[8] == 0 && q2[8] == 32;
    for (int i = 0; i < 8; i++)
        ok &= q1[i] == want1[i] && q2[i] == want2[i];
    CHECK(ok, "ties to even: d1 %g d2 %g, q1 %d %d %d %d, q2 %d %d %d %d", f[0], f[1], q1[1], q1[2], q1[4], q1[7],
          q2[1], q2[2], q2[4], q2[8]);
    f = q8_rec(ws, K, 0, 1, &q1, &q2);
    int zero = f[0] == 0.0f && f[1] == 0.0f && f[2] == 0.0f && f[3] == 0.0f;
    for (int i = 0; i < 32; i++)
        zero &= q1[i] == 0 && q2[i] == 0;
    CHECK(zero, "zero block: d1 %g d2 %g s %g", f[0], f[1], f[2]);
    int worst_q = 0, bound_ok = 1, sum_ok = 1, max_ok = 1;
    double worst_err = 0;
    for (int b = 0; b < BATCH; b++)
        for (int j = 0; j < K / 32; j++) {
            f = q8_rec(ws, K, b, j, &q1, &q2);
            float amax = 0.0f, rmax = 0.0f;
            int s1 = 0, s2 = 0, m1 = 0, m2 = 0;
            for (int i = 0; i < 32; i++) {
                const float v = x[b * XS + 32 * j + i];
                amax = fmaxf(amax, fabsf(v));
                rmax = fmaxf(rmax, fabsf(fmaf(-f[0], (float)q1[i], v)));
                s1 += q1[i], s2 += q2[i];
                m1 = abs(q1[i]) > m1 ? abs(q1[i]) : m1;
                m2 = abs(q2[i]) > m2 ? abs(q2[i]) : m2;
            }
            for (int i = 0; i < 32; i++) {
                const double v = x[b * XS + 32 * j + i], e = fabs(v - ((double)f[0] * q1[i] + (double)f[1] * q2[i]));
                bound_ok &= e <= amax / (254.0 * 254.0) * (1 + 1.0 / 16384);
                if (amax > 0)
                    worst_err = fmax(worst_err, e / amax * 254.0 * 254.0);
            }
            worst_q = m1 > worst_q ? m1 : m2 > worst_q ? m2 : worst_q;
            sum_ok &= f[0] == amax / 127.0f && f[1] == rmax / 127.0f &&
                      f[2] == fmaf(f[0], (float)s1, f[1] * (float)s2) && f[3] == 0.0f;
            max_ok &= (amax == 0.0f ? m1 == 0 : m1 == 127) && (rmax == 0.0f ? m2 == 0 : m2 == 127);
        }
    CHECK(worst_q <= 127 && bound_ok, "|x - d1 q1 - d2 q2| <= max|x|/254^2 (worst %.4f of it), |q| <= 127 (%d)",
          worst_err, worst_q);
    CHECK(sum_ok, "d1 = max|x|/127, d2 = max|r|/127, s = d1 sum(q1) + d2 sum(q2) in every block");
    CHECK(max_ok, "the largest |x| and the largest |r| of a block map to +-127");

    /* GEMV twin: equals sum deq(W) * (d1 q1 + d2 q2); within the bound of the exact F32
     * GEMV */
    const int types[4] = {M40K_TYPE_Q8_0, M40K_TYPE_Q4_0, M40K_TYPE_Q4_K, M40K_TYPE_Q6_K};
    for (int t = 0; t < 4; t++) {
        enum { KK = 512, N = 3 };
        static float wf[N * KK], deq[N * KK], xx[BATCH * KK], yq[BATCH * N], ye[BATCH * N];
        static uint8_t wq[N * KK / 32 * 34], ws2[BATCH * KK / 32 * 80];
        const m40_type_info *ti = m40_type_get((uint32_t)types[t]);
        const size_t rb = (size_t)KK / ti->block_elems * ti->block_bytes;
        for (int i = 0; i < N * KK; i++)
            wf[i] = frand();
        for (int i = 0; i < BATCH * KK; i++)
            xx[i] = frand() * (i % 64 == 5 ? 30.0f : 1.0f);
        for (int n = 0; n < N; n++) {
            m40_quantize_row((uint32_t)types[t], wf + n * KK, wq + n * rb, KK);
            m40_dequantize_row((uint32_t)types[t], wq + n * rb, deq + n * KK, KK);
        }
        m40_ref_quantize_q8(xx, KK, KK, BATCH, ws2);
        m40_ref_gemv_q8(wq, types[t], N, KK, ws2, BATCH, yq, N);
        m40_ref_gemv(wq, types[t], N, KK, xx, KK, ye, N, BATCH);
        double worst_twin = 0, worst_bound = 0, worst_rel = 0;
        for (int b = 0; b < BATCH; b++)
            for (int n = 0; n < N; n++) {
                double direct = 0, mag = 0, bound = 0;
                for (int k = 0; k < KK; k++) {
                    const float *g = q8_rec(ws2, KK, b, k / 32, &q1, &q2);
                    const double xh = (double)g[0] * q1[k % 32] + (double)g[1] * q2[k % 32];
                    direct += (double)deq[n * KK + k] * xh;
                    mag += fabs(deq[n * KK + k] * xx[b * KK + k]);
                    bound += fabs(deq[n * KK + k]) * (double)g[0] * 127.0 / (254.0 * 254.0) * (1 + 1.0 / 16384);
                }
                const double err = fabs(yq[b * N + n] - ye[b * N + n]);
                worst_twin = fmax(worst_twin, fabs(yq[b * N + n] - direct) / mag);
                worst_bound = fmax(worst_bound, err / (bound + 1e-6 * mag));
                worst_rel = fmax(worst_rel, err / mag);
            }
        CHECK(worst_twin < 1e-6, "gemv_q8 twin %s vs deq(W).deq(x): %g of sum |w x|", ti->name, worst_twin);
        CHECK(worst_bound <= 1.0 && worst_rel < 1e-4, "gemv_q8 twin %s vs exact: %g of the bound, %g of sum |w x|",
              ti->name, worst_bound, worst_rel);
    }
}

/* The F16 weights the quantized GEMM forms (m40_ref_gemm_q_dequant, its twin's) against
 * the reference dequantizer, for every type m40k_gemm_q reads: within the rounding of the
 * scale and offset to F16 and of the weight to F16 (relative 2^-10 of the block's largest
 * term, so 2e-3 of max |w| is the bound used). Random blocks with small F16 scales: every
 * other bit pattern is a valid block. */
static void test_gemm_q_weights(void)
{
    const int types[] = {M40_TYPE_F16,  M40_TYPE_BF16, M40_TYPE_Q8_0, M40_TYPE_Q4_0, M40_TYPE_Q4_1,
                         M40_TYPE_Q5_0, M40_TYPE_Q5_1, M40_TYPE_Q2_K, M40_TYPE_Q3_K, M40_TYPE_Q4_K,
                         M40_TYPE_Q5_K, M40_TYPE_Q6_K};
    enum { K = 512, N = 3 };
    for (size_t ti = 0; ti < sizeof types / sizeof types[0]; ti++) {
        const int t = types[ti];
        const m40_type_info *inf = m40_type_get((uint32_t)t);
        const size_t rb = (size_t)K / inf->block_elems * inf->block_bytes;
        static uint8_t w[N * 1024];
        static uint16_t out[N * K];
        static float d[K];
        for (size_t i = 0; i < rb * N; i++)
            w[i] = (uint8_t)(frand() * 127.0f + 128.0f);
        /* F16 fields (scales and mins) at these offsets of each block; F16/BF16 values kept finite */
        int offs[2] = {-1, -1};
        switch (t) {
        case M40_TYPE_Q2_K: offs[0] = 80, offs[1] = 82; break;
        case M40_TYPE_Q3_K: offs[0] = 108; break;
        case M40_TYPE_Q4_K:
        case M40_TYPE_Q5_K:
        case M40_TYPE_Q4_1:
        case M40_TYPE_Q5_1: offs[0] = 0, offs[1] = 2; break;
        case M40_TYPE_Q6_K: offs[0] = 208; break;
        case M40_TYPE_Q8_0:
        case M40_TYPE_Q4_0:
        case M40_TYPE_Q5_0: offs[0] = 0; break;
        default: /* F16, BF16: exponent bits tamed */
            for (size_t i = 1; i < rb * N; i += 2)
                w[i] = (uint8_t)((w[i] & 0x83) | (t == M40_TYPE_BF16 ? 0x3c : 0x38));
        }
        for (size_t b = 0; b < rb * N; b += inf->block_bytes)
            for (int j = 0; j < 2; j++)
                if (offs[j] >= 0) {
                    const uint16_t h = m40_fp32_to_fp16(0.001f + 0.004f * (frand() * 0.5f + 0.5f));
                    w[b + offs[j]] = (uint8_t)(h & 255), w[b + offs[j] + 1] = (uint8_t)(h >> 8);
                }
        m40_ref_gemm_q_dequant(w, t, N, K, out);
        double worst = 0, mag = 0;
        for (int r = 0; r < N; r++) {
            m40_dequantize_row((uint32_t)t, w + r * rb, d, K);
            for (int k = 0; k < K; k++) {
                worst = fmax(worst, fabs((double)m40_fp16_to_fp32(out[r * K + k]) - d[k]));
                mag = fmax(mag, fabs(d[k]));
            }
        }
        CHECK(mag > 0 && worst <= 2e-3 * mag, "gemm_q weights %s: max |twin - dequantized| %g, max |w| %g", inf->name,
              worst, mag);
    }
}

int main(void)
{
    test_paged_attention();
    test_rope();
    test_small();
    test_gemma_helpers();
    test_quantize_q8();
    test_gemm_q_weights();
    return check_done();
}
