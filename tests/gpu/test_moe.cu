/* The mixture-of-experts kernels (kernels.h 10) and MXFP4 in the dense kernels against
 * their CPU twins (kernels/ref/moe_ref.c, cpu_ref.c) on random inputs: expert counts 1..256,
 * top-k 1..8, odd sizes, tied and NaN logits, out-of-range ids, empty experts in a batch
 * and experts with more rows than a tile.
 *   test_moe            every comparison; ends with "N passed, N failed, N skipped"
 *   test_moe --bench    also one MoE layer at qwen3-30b-a3b's shape (dim 2048, 128
 *                       experts, top-8, expert ffn 768, Q4_K) and gpt-oss-20b's (dim 2880,
 *                       32 experts, top-4, ffn 2880, MXFP4), batch 1 (the GEMV path) and
 *                       64 (grouped), in us a layer and GB/s of the expert weights read
 *   test_moe --bench-only   the benchmarks alone
 * Without a GPU: prints why, "0 passed, 0 failed, 1 skipped", exit 0. */
#include <cuda_runtime.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <algorithm>
#include <vector>

extern "C" {
#include "ref/ggml_types.h"
#include "ref/quant.h"
}
#include "ref/cpu_ref.h"

#define GPU_CHECK_SEED 0x5DEECE66Dull
#include "gpu_check.h"

static void check(const char *what, bool ok)
{
    if (ok)
        n_pass++;
    else
        n_fail++, printf("FAIL %s\n", what);
}

static size_t row_bytes(int type, int n)
{
    const m40_type_info *ti = m40_type_get((uint32_t)type);
    return (size_t)n / ti->block_elems * ti->block_bytes;
}

/* rows x cols of type, fast: F16 / BF16 from random values, MXFP4 quantized from them,
 * the block types as random bytes whose F16 scale fields are set to small positive values
 * (every other bit pattern is a valid block). The kernels and the twins decode the same
 * bytes, so any block is as good a test as a quantizer's. */
static std::vector<uint8_t> quant_matrix(int type, int rows, int cols)
{
    const size_t rb = row_bytes(type, cols);
    std::vector<uint8_t> q(rb * rows);
    if (type == M40K_TYPE_F16 || type == M40K_TYPE_BF16 || type == M40K_TYPE_MXFP4) {
        std::vector<float> f(cols);
        for (int r = 0; r < rows; r++) {
            for (auto &v : f)
                v = frand(-1.0f, 1.0f);
            if (m40_quantize_row((uint32_t)type, f.data(), q.data() + r * rb, cols) != 0)
                abort();
        }
        return q;
    }
    std::vector<int> f16_at;
    switch (type) {
    case M40K_TYPE_Q8_0: case M40K_TYPE_Q4_0: case M40K_TYPE_Q5_0: f16_at = {0}; break;
    case M40K_TYPE_Q4_1: case M40K_TYPE_Q5_1: case M40K_TYPE_Q4_K: case M40K_TYPE_Q5_K: f16_at = {0, 2}; break;
    case M40K_TYPE_Q6_K: f16_at = {208}; break;
    case M40K_TYPE_Q2_K: f16_at = {80, 82}; break;
    case M40K_TYPE_Q3_K: f16_at = {108}; break;
    default: abort();
    }
    const int bb = m40_type_get((uint32_t)type)->block_bytes;
    for (size_t i = 0; i < q.size(); i++)
        q[i] = (uint8_t)rnd32();
    for (size_t b = 0; b + bb <= q.size(); b += bb)
        for (int o : f16_at) {
            const uint16_t h = m40_fp32_to_fp16(0.001f + 0.004f * (rnd32() % 1000) / 1000.0f);
            q[b + o] = (uint8_t)(h & 0xff), q[b + o + 1] = (uint8_t)(h >> 8);
        }
    return q;
}

/* |g - c| <= tol * scale everywhere, scale the largest |c| (at least 1e-3): the sums'
 * order differs between the two sides, so errors scale with the magnitude of the terms. */
static void compare_scaled(const char *what, const std::vector<float> &g, const std::vector<float> &c, double tol)
{
    double mx = 1e-3;
    for (float v : c)
        mx = std::max(mx, (double)fabsf(v));
    compare(what, g.data(), c.data(), c.size(), (float)(tol * mx), 0.0f);
}

/* ---------------------------------------------------------------- router */

static void test_router(void)
{
    const int expert_counts[] = {1, 2, 3, 8, 31, 32, 33, 64, 128, 200, 256};
    /* odd widths and strides take the 4-byte loads; widths and strides of 4 the 16-byte
     * ones (2048: whole rounds of four; 2880 and 516: a tail) */
    for (int E : expert_counts)
        for (int dim : {77, 2048 + 1, 2048, 2880, 516}) {
            const int T = E % 2 ? 9 : 20, ld = dim % 4 ? dim + 3 : dim + 4 * (E % 3);
            std::vector<float> wr = rand_vec((size_t)E * dim), x = rand_vec((size_t)T * ld), b = rand_vec(E);
            float *dwr = dup(wr), *dx = dup(x), *db = dup(b), *dl;
            CK(cudaMalloc(&dl, (size_t)T * E * 4));
            for (int with_bias = 0; with_bias < 2; with_bias++) {
                CK(m40k_moe_router_logits(dwr, with_bias ? db : nullptr, E, dim, dx, ld, T, dl, 0));
                std::vector<float> g = back(dl, (size_t)T * E), c((size_t)T * E);
                m40_ref_moe_router_logits(wr.data(), with_bias ? b.data() : nullptr, E, dim, x.data(), ld, T,
                                          c.data());
                char what[96];
                snprintf(what, sizeof what, "router logits E %d dim %d ld %d T %d bias %d", E, dim, ld, T, with_bias);
                compare(what, g.data(), c.data(), c.size(), 2e-4f, 1e-4f);
            }
            if (dim % 32 == 0) {
                /* 10a': the norm folded in before (x the residual, norm weights, its sums of
                 * squares per 32), against the twin on x * norm_w, times the factor */
                std::vector<float> nw = rand_vec(dim, 0.25f, 2.0f), ss((size_t)T * (dim / 32));
                /* o 1 (where the stride leaves room): x one float past an aligned start, the
                 * 4-byte loads */
                for (int o = 0; o < (ld > dim ? 2 : 1); o++) {
                std::vector<float> xn((size_t)T * ld, 0.0f);
                for (int t = 0; t < T; t++)
                    for (int j = 0; j < dim / 32; j++) {
                        double q = 0.0;
                        for (int i = 0; i < 32; i++) {
                            const float v = x[(size_t)t * ld + 32 * j + i + o];
                            q += (double)v * v;
                            xn[(size_t)t * ld + 32 * j + i] = v * nw[32 * j + i];
                        }
                        ss[(size_t)t * (dim / 32) + j] = (float)q;
                    }
                float *dnw = dup(nw), *dss = dup(ss);
                for (int with_bias = 0; with_bias < 2; with_bias++) {
                    CK(m40k_moe_router_logits_normed(dwr, with_bias ? db : nullptr, E, dim, dx + o, ld, dnw, dss, 1e-6f,
                                                     T, dl, 0));
                    std::vector<float> g = back(dl, (size_t)T * E), c((size_t)T * E);
                    m40_ref_moe_router_logits(wr.data(), nullptr, E, dim, xn.data(), ld, T, c.data());
                    for (int t = 0; t < T; t++) {
                        const float f = m40_ref_norm_factor(ss.data() + (size_t)t * (dim / 32), dim, 1e-6f);
                        for (int e = 0; e < E; e++)
                            c[(size_t)t * E + e] = c[(size_t)t * E + e] * f + (with_bias ? b[e] : 0.0f);
                    }
                    char what[112];
                    snprintf(what, sizeof what, "router logits normed E %d dim %d ld %d T %d bias %d x offset %d", E,
                             dim, ld, T, with_bias, o);
                    compare(what, g.data(), c.data(), c.size(), 2e-4f, 1e-4f);
                }
                check("router normed: norm_w without ss refused",
                      m40k_moe_router_logits_normed(dwr, nullptr, E, dim, dx, ld, dnw, nullptr, 1e-6f, T, dl, 0) != 0);
                cudaFree(dnw), cudaFree(dss);
                }
            }
            cudaFree(dwr), cudaFree(dx), cudaFree(db), cudaFree(dl);
        }
}

/* The selection score the twin uses, for judging a choice that differs (sigmoid's expf
 * may differ by an ulp between the two sides and swap near ties). */
static float sel_score(int gating, float l, float bias)
{
    if (l != l)
        l = -INFINITY;
    return gating == M40K_MOE_SIGMOID ? 1.0f / (1.0f + expf(-l)) + bias : l;
}

static void test_topk(void)
{
    const int expert_counts[] = {1, 2, 3, 7, 8, 32, 33, 64, 100, 128, 255, 256};
    const int T = 37;
    int swapped = 0;
    for (int E : expert_counts)
        for (int gating = 0; gating < 3; gating++)
            for (int k = 1; k <= std::min(8, E); k += (k < 4 ? 1 : 2)) {
                std::vector<float> lg = rand_vec((size_t)T * E, -4.0f, 4.0f), sb = rand_vec(E, -0.1f, 0.1f);
                /* ties: token 1's logits are all equal, token 2's take 3 values, token 3
                 * has NaN among them, token 4 all -inf but one */
                for (int e = 0; e < E && T > 4; e++) {
                    lg[1 * E + e] = 0.5f;
                    lg[2 * E + e] = (float)(e % 3) * 0.25f;
                    if (e % 5 == 0)
                        lg[3 * E + e] = NAN;
                    lg[4 * E + e] = e == E / 2 ? 1.0f : -INFINITY;
                }
                for (int t = 5; t < T; t += 7) /* duplicate a token's best value elsewhere */
                    lg[t * E + (E - 1)] = *std::max_element(lg.begin() + t * E, lg.begin() + (t + 1) * E);
                const int norm = (E + k) % 2, use_bias = gating == M40K_MOE_SIGMOID && E % 2 == 0;
                const float scale = k % 3 == 0 ? 2.5f : 1.0f;
                float *dl = dup(lg), *dsb = dup(sb), *dw;
                int32_t *di;
                CK(cudaMalloc(&di, (size_t)T * k * 4));
                CK(cudaMalloc(&dw, (size_t)T * k * 4));
                CK(m40k_moe_topk(dl, T, E, k, gating, use_bias ? dsb : nullptr, norm, scale, di, dw, 0));
                std::vector<int32_t> gi = back(di, (size_t)T * k), ci((size_t)T * k);
                std::vector<float> gw = back(dw, (size_t)T * k), cw((size_t)T * k);
                m40_ref_moe_topk(lg.data(), T, E, k, gating, use_bias ? sb.data() : nullptr, norm, scale, ci.data(),
                                 cw.data());
                bool ids_ok = true, w_ok = true;
                for (int t = 0; t < T; t++)
                    for (int j = 0; j < k; j++) {
                        const size_t i = (size_t)t * k + j;
                        if (gi[i] == ci[i]) {
                            if (!(fabsf(gw[i] - cw[i]) <= 2e-6f + 2e-5f * fabsf(cw[i])))
                                w_ok = false;
                            continue;
                        }
                        if (gi[i] < 0 || gi[i] >= E) {
                            ids_ok = false;
                            continue;
                        }
                        const float a = sel_score(gating, lg[t * E + gi[i]], use_bias ? sb[gi[i]] : 0.0f);
                        const float b = sel_score(gating, lg[t * E + ci[i]], use_bias ? sb[ci[i]] : 0.0f);
                        if (fabsf(a - b) > 1e-6f * (1.0f + fabsf(b)))
                            ids_ok = false;
                        else
                            swapped++;
                    }
                char what[128];
                snprintf(what, sizeof what, "topk E %d k %d gating %d norm %d scale %g bias %d: ids", E, k, gating,
                         norm, scale, use_bias);
                check(what, ids_ok);
                snprintf(what, sizeof what, "topk E %d k %d gating %d norm %d scale %g bias %d: weights", E, k,
                         gating, norm, scale, use_bias);
                check(what, w_ok);
                cudaFree(dl), cudaFree(dsb), cudaFree(di), cudaFree(dw);
            }
    printf("topk: %d choices swapped within 1e-6 (near ties of sigmoid scores)\n", swapped);
    check("topk: at most a handful of near-tie swaps", swapped <= 8);
    /* refused shapes */
    check("topk refuses k 9", m40k_moe_topk(nullptr, 1, 16, 9, 0, nullptr, 0, 1.0f, nullptr, nullptr, 0) != 0);
    check("topk refuses k > n_expert", m40k_moe_topk(nullptr, 1, 2, 3, 0, nullptr, 0, 1.0f, nullptr, nullptr, 0) != 0);
    check("topk refuses 257 experts", m40k_moe_topk(nullptr, 1, 257, 2, 0, nullptr, 0, 1.0f, nullptr, nullptr, 0) != 0);
}

/* ---------------------------------------------------------------- expert GEMV (batch 1..) */

/* k distinct experts a token (as a router gives them), a few out of range where bad. */
static std::vector<int32_t> random_ids(int T, int k, int E, bool bad)
{
    std::vector<int32_t> ids((size_t)T * k);
    for (int t = 0; t < T; t++)
        for (int j = 0; j < k; j++) {
            int e;
            bool again;
            do {
                e = (int)(rnd32() % (uint32_t)E);
                again = false;
                for (int i = 0; i < j; i++)
                    again |= ids[(size_t)t * k + i] == e;
            } while (again && k <= E);
            ids[(size_t)t * k + j] = e;
        }
    if (bad && T * k > 2)
        ids[1] = -1, ids[(size_t)T * k - 1] = E + 3;
    return ids;
}

static const int gemv_types[] = {M40K_TYPE_F16,  M40K_TYPE_BF16, M40K_TYPE_Q8_0, M40K_TYPE_Q4_0,   M40K_TYPE_Q5_1,
                                 M40K_TYPE_Q4_K, M40K_TYPE_Q5_K, M40K_TYPE_Q6_K, M40K_TYPE_Q6_K_P, M40K_TYPE_MXFP4,
                                 M40K_TYPE_MXFP4_P};

/* 10c' and 10d' (the expert GEMVs on int8 records) against their twins: x quantized by
 * m40_ref_quantize_q8 (the same records as m40k_quantize_q8), each pair's gate and up rows
 * by m40_ref_gemv_q8, then act (out-of-range ids: zero rows); h's records as the twin
 * quantizes the kernel's h, byte for byte; then the down GEMV on those records against
 * m40_ref_gemv_q8 of each chosen expert's rows, weighted and summed, with its biases. */
static void check_experts_q8(int type, int base, const std::vector<uint8_t> &wg, const std::vector<uint8_t> &wu,
                             const std::vector<uint8_t> &wd, int E, int n_ff, int dim, const float *gb,
                             const float *ub, const float *db, int act, const std::vector<float> &x, int64_t xs,
                             const float *dx, const std::vector<int32_t> &ids, const int32_t *dids,
                             const std::vector<float> &w, const float *dw, int T, int k, const uint8_t *dwg,
                             const uint8_t *dwu, const uint8_t *dwd, const float *dgb, const float *dub,
                             const float *ddb, bool bad)
{
    const int P = T * k;
    const int64_t hs = n_ff + 3, os = dim + 2;
    const m40_type_info *ti = m40_type_get((uint32_t)base);
    const size_t ws_bytes = m40k_gemv_q8_ws_bytes(dim, T), rb = (size_t)dim / ti->block_elems * ti->block_bytes;
    const size_t rbd = (size_t)n_ff / ti->block_elems * ti->block_bytes;
    const bool gate_up = m40k_moe_gate_up_q8_supported(type, dim), down = m40k_moe_down_q8_supported(type, n_ff);
    const size_t hq_bytes = m40k_moe_q8_records_bytes(P, n_ff);
    void *dws, *dhq = nullptr;
    float *dh, *dout;
    CK(cudaMalloc(&dws, ws_bytes));
    CK(cudaMalloc(&dh, (size_t)P * hs * 4));
    CK(cudaMalloc(&dout, (size_t)T * os * 4));
    if (hq_bytes)
        CK(cudaMalloc(&dhq, hq_bytes));
    char what[128];
    std::vector<float> gh((size_t)P * hs, 0.0f);
    if (gate_up) {
        CK(cudaMemset(dh, 0, (size_t)P * hs * 4));
        CK(m40k_quantize_q8(dx, xs, dim, T, dws, 0));
        CK(m40k_moe_gate_up_q8(dwg, dwu, type, E, n_ff, dim, dgb, dub, act, dws, dids, T, k, dh, hs, dhq, 0));
        gh = back(dh, (size_t)P * hs);
        std::vector<float> ch((size_t)P * hs, 0.0f), g(n_ff), u(n_ff);
        std::vector<uint8_t> ws(ws_bytes);
        m40_ref_quantize_q8(x.data(), xs, dim, T, ws.data());
        for (int p = 0; p < P; p++) {
            const int e = ids[p], t = p / k;
            if (e < 0 || e >= E)
                continue;
            const uint8_t *wst = ws.data() + (size_t)t * (dim / 32) * 80;
            m40_ref_gemv_q8(wg.data() + (size_t)e * n_ff * rb, base, n_ff, dim, wst, 1, g.data(), n_ff);
            m40_ref_gemv_q8(wu.data() + (size_t)e * n_ff * rb, base, n_ff, dim, wst, 1, u.data(), n_ff);
            for (int n = 0; n < n_ff; n++)
                ch[(size_t)p * hs + n] = m40_ref_moe_act(act, g[n] + (gb ? gb[(size_t)e * n_ff + n] : 0.0f),
                                                  u[n] + (ub ? ub[(size_t)e * n_ff + n] : 0.0f));
        }
        snprintf(what, sizeof what, "moe_gate_up_q8 %s E %d k %d T %d %s%s", m40_type_name(base), E, k, T,
                 act ? "swiglu_oai+bias" : "silu", bad ? " bad ids" : "");
        compare_scaled(what, gh, ch, 2e-5);
        {
            /* 10c'n: each token's products times its norm factor (random sums of squares),
             * before the biases and act */
            std::vector<float> ss = rand_vec((size_t)T * (dim / 32), 0.5f, 40.0f), nh((size_t)P * hs, 0.0f);
            float *dss = dup(ss);
            CK(cudaMemset(dh, 0, (size_t)P * hs * 4));
            CK(m40k_moe_gate_up_q8_normed(dwg, dwu, type, E, n_ff, dim, dgb, dub, act, dws, dss, 1e-5f, dids, T, k, dh,
                                          hs, nullptr, 0));
            std::vector<float> gn = back(dh, (size_t)P * hs);
            for (int p = 0; p < P; p++) {
                const int e = ids[p], t = p / k;
                if (e < 0 || e >= E)
                    continue;
                const float f = m40_ref_norm_factor(ss.data() + (size_t)t * (dim / 32), dim, 1e-5f);
                const uint8_t *wst = ws.data() + (size_t)t * (dim / 32) * 80;
                m40_ref_gemv_q8(wg.data() + (size_t)e * n_ff * rb, base, n_ff, dim, wst, 1, g.data(), n_ff);
                m40_ref_gemv_q8(wu.data() + (size_t)e * n_ff * rb, base, n_ff, dim, wst, 1, u.data(), n_ff);
                for (int n = 0; n < n_ff; n++)
                    nh[(size_t)p * hs + n] = m40_ref_moe_act(act, g[n] * f + (gb ? gb[(size_t)e * n_ff + n] : 0.0f),
                                                      u[n] * f + (ub ? ub[(size_t)e * n_ff + n] : 0.0f));
            }
            snprintf(what, sizeof what, "moe_gate_up_q8_normed %s E %d k %d T %d %s%s", m40_type_name(base), E, k, T,
                     act ? "swiglu_oai+bias" : "silu", bad ? " bad ids" : "");
            compare_scaled(what, gn, nh, 2e-5);
            cudaFree(dss);
        }
        if (dhq) { /* h's records: the twin's quantization of the kernel's h, byte for byte */
            std::vector<uint8_t> rq((size_t)P * (n_ff / 32) * 80);
            for (int p = 0; p < P; p++)
                m40_ref_quantize_q8(gh.data() + (size_t)p * hs, n_ff, n_ff, 1, rq.data() + (size_t)p * (n_ff / 32) * 80);
            snprintf(what, sizeof what, "moe_gate_up_q8 %s E %d k %d T %d: h's records", m40_type_name(base), E, k,
                     T);
            check(what, back((const uint8_t *)dhq, rq.size()) == rq);
        }
    }
    if (down && dhq) {
        if (!gate_up) { /* records of a random h */
            gh = rand_vec((size_t)P * hs);
            float *dh2 = dup(gh);
            for (int p = 0; p < P; p++)
                CK(m40k_quantize_q8(dh2 + (size_t)p * hs, n_ff, n_ff, 1, (uint8_t *)dhq + (size_t)80 * p * (n_ff / 32), 0));
            cudaFree(dh2);
        }
        std::vector<uint8_t> rq(80 * (size_t)(n_ff / 32));
        std::vector<float> y(dim);
        for (int acc = 0; acc < 2; acc++) {
            std::vector<float> o0 = rand_vec((size_t)T * os), co = o0;
            CK(cudaMemcpy(dout, o0.data(), o0.size() * 4, cudaMemcpyHostToDevice));
            CK(m40k_moe_down_q8(dwd, type, E, dim, n_ff, ddb, dhq, dids, dw, T, k, dout, os, acc, 0));
            for (int t = 0; t < T; t++) {
                std::vector<double> sum(dim, 0.0);
                for (int j = 0; j < k; j++) {
                    const int p = t * k + j, e = ids[p];
                    if (e < 0 || e >= E)
                        continue;
                    m40_ref_quantize_q8(gh.data() + (size_t)p * hs, n_ff, n_ff, 1, rq.data());
                    m40_ref_gemv_q8(wd.data() + (size_t)e * dim * rbd, base, dim, n_ff, rq.data(), 1, y.data(), dim);
                    for (int n = 0; n < dim; n++)
                        sum[n] += (double)w[p] * ((double)y[n] + (db ? db[(size_t)e * dim + n] : 0.0));
                }
                for (int n = 0; n < dim; n++)
                    co[(size_t)t * os + n] = (float)((acc ? (double)o0[(size_t)t * os + n] : 0.0) + sum[n]);
            }
            std::vector<float> go = back(dout, o0.size());
            snprintf(what, sizeof what, "moe_down_q8 %s E %d k %d T %d%s%s%s", m40_type_name(base), E, k, T,
                     db ? " +bias" : "", acc ? " accumulate" : "", bad ? " bad ids" : "");
            compare_scaled(what, go, co, 2e-5);
        }
    }
    cudaFree(dws), cudaFree(dh), cudaFree(dout), cudaFree(dhq);
}

static void test_expert_gemv(void)
{
    struct { int E, k, T; bool bad; } cases[] = {{1, 1, 1, false}, {4, 2, 1, false}, {32, 4, 1, false},
                                                 {128, 8, 1, false}, {256, 8, 3, true}, {7, 3, 5, false}};
    for (int type : gemv_types) {
        const int base = dev_base(type); /* the twins read the GGUF type, the kernels its device layout */
        const int be = m40_type_get((uint32_t)base)->block_elems;
        for (auto cs : cases) {
            const int E = cs.E, k = cs.k, T = cs.T, P = T * k;
            /* dims: odd block counts, more than a 1024-element segment where the experts are
             * few; smaller where they are many (the test stays fast) */
            const bool many = E >= 64;
            const int dim = be == 256 ? (many ? 512 : 256 * 5) : be == 32 ? (many ? 32 * 13 : 32 * 37) : (many ? 8 * 67 : 8 * 131);
            const int n_ff = be == 256 ? (many ? 256 : 256 * 3) : be == 32 ? (many ? 32 * 5 : 32 * 9) : 8 * 21;
            std::vector<uint8_t> wg = quant_matrix(base, E * n_ff, dim), wu = quant_matrix(base, E * n_ff, dim),
                                 wd = quant_matrix(base, E * dim, n_ff);
            std::vector<float> gb = rand_vec((size_t)E * n_ff), ub = rand_vec((size_t)E * n_ff),
                               db = rand_vec((size_t)E * dim);
            const int64_t xs = dim + 4, hs = n_ff + 8, os = dim + 1;
            std::vector<float> x = rand_vec((size_t)T * xs), w = rand_vec((size_t)P, 0.0f, 1.0f);
            std::vector<int32_t> ids = random_ids(T, k, E, cs.bad);
            uint8_t *dwg = dup(dev_layout(type, wg, E * n_ff, dim)), *dwu = dup(dev_layout(type, wu, E * n_ff, dim)),
                    *dwd = dup(dev_layout(type, wd, E * dim, n_ff));
            float *dgb = dup(gb), *dub = dup(ub), *ddb = dup(db), *dx = dup(x), *dw = dup(w), *dh, *dout;
            int32_t *dids = dup(ids);
            CK(cudaMalloc(&dh, (size_t)P * hs * 4));
            CK(cudaMalloc(&dout, (size_t)T * os * 4));
            for (int act : {(int)M40K_GLU_SILU, (int)M40K_GLU_SWIGLU_OAI}) {
                const bool bias = act == M40K_GLU_SWIGLU_OAI;
                CK(m40k_moe_gate_up(dwg, dwu, type, E, n_ff, dim, bias ? dgb : nullptr, bias ? dub : nullptr, act, dx,
                                    xs, dids, T, k, dh, hs, 0));
                std::vector<float> gh = back(dh, (size_t)P * hs), ch((size_t)P * hs, 0.0f);
                m40_ref_moe_gate_up(wg.data(), wu.data(), base, E, n_ff, dim, bias ? gb.data() : nullptr,
                                    bias ? ub.data() : nullptr, act, x.data(), xs, ids.data(), T, k, ch.data(), hs);
                for (int p = 0; p < P; p++) /* the stride's padding is not written */
                    for (int n = n_ff; n < hs; n++)
                        gh[(size_t)p * hs + n] = ch[(size_t)p * hs + n] = 0.0f;
                char what[128];
                snprintf(what, sizeof what, "moe_gate_up %s%s E %d k %d T %d %s%s", m40_type_name(base),
                         dev_suffix(type), E, k, T, act ? "swiglu_oai+bias" : "silu", cs.bad ? " bad ids" : "");
                compare_scaled(what, gh, ch, 2e-5);
                if (m40k_moe_gate_up_q8_supported(type, dim) || m40k_moe_down_q8_supported(type, n_ff))
                    check_experts_q8(type, base, wg, wu, wd, E, n_ff, dim, bias ? gb.data() : nullptr,
                                     bias ? ub.data() : nullptr, bias ? db.data() : nullptr, act, x, xs, dx, ids,
                                     dids, w, dw, T, k, dwg, dwu, dwd, bias ? dgb : nullptr, bias ? dub : nullptr,
                                     bias ? ddb : nullptr, cs.bad);
                /* down on the twin's h (same input on both sides) */
                float *dch = dup(ch);
                for (int acc = 0; acc < 2; acc++) {
                    std::vector<float> o0 = rand_vec((size_t)T * os);
                    CK(cudaMemcpy(dout, o0.data(), o0.size() * 4, cudaMemcpyHostToDevice));
                    CK(m40k_moe_down(dwd, type, E, dim, n_ff, bias ? ddb : nullptr, dch, hs, dids, dw, T, k, dout, os,
                                     acc, 0));
                    std::vector<float> go = back(dout, o0.size()), co = o0;
                    m40_ref_moe_down(wd.data(), base, E, dim, n_ff, bias ? db.data() : nullptr, ch.data(), hs,
                                     ids.data(), w.data(), T, k, co.data(), os, acc);
                    snprintf(what, sizeof what, "moe_down %s%s E %d k %d T %d%s%s", m40_type_name(base),
                             dev_suffix(type), E, k, T, bias ? " +bias" : "", acc ? " accumulate" : "");
                    compare_scaled(what, go, co, 2e-5);
                }
                cudaFree(dch);
            }
            cudaFree(dwg), cudaFree(dwu), cudaFree(dwd), cudaFree(dgb), cudaFree(dub), cudaFree(ddb), cudaFree(dx);
            cudaFree(dw), cudaFree(dh), cudaFree(dout), cudaFree(dids);
        }
    }
    /* 10c' / 10d' refuse what they do not take, before any launch (aligned dummies) */
    alignas(16) static uint8_t a16[64];
    void *p = a16;
    int32_t *ip = (int32_t *)a16;
    float *fp = (float *)a16;
    check("gate_up_q8 refuses F16", m40k_moe_gate_up_q8(p, p, M40K_TYPE_F16, 8, 64, 256, nullptr, nullptr,
                                                       M40K_GLU_SILU, p, ip, 1, 2, fp, 64, nullptr, 0) != 0);
    check("gate_up_q8 refuses 9 tokens", m40k_moe_gate_up_q8(p, p, M40K_TYPE_Q4_K, 8, 64, 256, nullptr, nullptr,
                                                            M40K_GLU_SILU, p, ip, 9, 2, fp, 64, nullptr, 0) != 0);
    check("gate_up_q8 refuses a K-quant dim of 96", m40k_moe_gate_up_q8(p, p, M40K_TYPE_Q4_K, 8, 64, 96, nullptr,
                                                                       nullptr, M40K_GLU_SILU, p, ip, 1, 2, fp, 64,
                                                                       nullptr, 0) != 0);
    check("gate_up_q8 refuses misaligned x records",
          m40k_moe_gate_up_q8(p, p, M40K_TYPE_Q8_0, 8, 64, 256, nullptr, nullptr, M40K_GLU_SILU, a16 + 4, ip, 1, 2,
                              fp, 64, nullptr, 0) != 0);
    check("gate_up_q8 refuses h's records at n_ff 40", m40k_moe_gate_up_q8(p, p, M40K_TYPE_Q8_0, 8, 40, 256, nullptr,
                                                                          nullptr, M40K_GLU_SILU, p, ip, 1, 2, fp,
                                                                          40, p, 0) != 0);
    check("gate_up_q8 refuses an unknown activation", m40k_moe_gate_up_q8(p, p, M40K_TYPE_Q8_0, 8, 64, 256, nullptr,
                                                                         nullptr, 7, p, ip, 1, 2, fp, 64, nullptr,
                                                                         0) != 0);
    check("gate_up_q8_normed refuses a negative eps",
          m40k_moe_gate_up_q8_normed(p, p, M40K_TYPE_Q8_0, 8, 64, 256, nullptr, nullptr, M40K_GLU_SILU, p, fp, -1.0f,
                                     ip, 1, 2, fp, 64, nullptr, 0) != 0);
    check("down_q8 refuses no records", m40k_moe_down_q8(p, M40K_TYPE_Q4_K, 8, 64, 256, nullptr, nullptr, ip, fp, 1,
                                                         2, fp, 64, 0, 0) != 0);
    check("down_q8 refuses k 9", m40k_moe_down_q8(p, M40K_TYPE_Q4_K, 8, 64, 256, nullptr, p, ip, fp, 1, 9, fp, 64, 0,
                                                  0) != 0);
    check("down_q8 refuses MXFP4 in the file's layout", m40k_moe_down_q8(p, M40K_TYPE_MXFP4, 8, 64, 256, nullptr, p,
                                                                        ip, fp, 1, 2, fp, 64, 0, 0) != 0);
    check("down_q8 refuses an n_ff of 48", m40k_moe_down_q8(p, M40K_TYPE_Q8_0, 8, 64, 48, nullptr, p, ip, fp, 1, 2,
                                                           fp, 64, 0, 0) != 0);
}

/* ---------------------------------------------------------------- batches */

static void test_group(void)
{
    struct { int T, k, E; int skew; } cases[] = {{1, 1, 1, 0},    {1, 8, 256, 0},  {5, 2, 8, 0},   {64, 8, 128, 0},
                                                 {300, 4, 32, 0},  {97, 8, 256, 0}, {64, 8, 128, 1}, {40, 1, 3, 1},
                                                 {1500, 8, 64, 2}, {33, 3, 200, 2}};
    for (auto cs : cases)
        for (int bm : {16, 64}) {
            const int P = cs.T * cs.k, E = cs.E;
            std::vector<int32_t> ids = random_ids(cs.T, cs.k, E, cs.skew == 2);
            if (cs.skew == 1) /* most pairs on expert 0: a group of many tiles; most experts empty */
                for (int p = 0; p < P; p += cs.k)
                    ids[p] = 0;
            const int mt = m40k_moe_max_tiles(P, E, bm);
            int32_t *di = dup(ids), *dc, *doff, *dperm, *dinv, *dt;
            CK(cudaMalloc(&dc, E * 4));
            CK(cudaMalloc(&doff, (E + 1) * 4));
            CK(cudaMalloc(&dperm, P * 4));
            CK(cudaMalloc(&dinv, P * 4));
            CK(cudaMalloc(&dt, (size_t)mt * 8));
            CK(m40k_moe_group(di, P, E, bm, dc, doff, dperm, dinv, dt, 0));
            std::vector<int32_t> c(E), off(E + 1), perm(P), inv(P), tl((size_t)2 * mt);
            m40_ref_moe_group(ids.data(), P, E, bm, c.data(), off.data(), perm.data(), inv.data(), tl.data());
            char what[128];
            snprintf(what, sizeof what, "moe_group T %d k %d E %d bm %d%s: counts, offsets, perm, inv, tiles", cs.T,
                     cs.k, E, bm, cs.skew == 1 ? " skewed" : cs.skew == 2 ? " bad ids" : "");
            check(what, back(dc, E) == c && back(doff, E + 1) == off && back(dperm, P) == perm &&
                            back(dinv, P) == inv && back(dt, (size_t)2 * mt) == tl);
            cudaFree(di), cudaFree(dc), cudaFree(doff), cudaFree(dperm), cudaFree(dinv), cudaFree(dt);
        }
}

/* The whole batched layer: group, gather, grouped gate / up products, activation, grouped
 * down product, combine; each step against its twin on the GPU's input, and the result
 * against the batch-1 GEMV path (the same layer through m40k_moe_gate_up / down). */
static void test_batched(void)
{
    struct { int type, T, k, E, act; } cases[] = {
        {M40K_TYPE_Q4_K, 64, 8, 128, M40K_GLU_SILU},        {M40K_TYPE_Q4_K, 3, 2, 256, M40K_GLU_SILU},
        {M40K_TYPE_MXFP4, 40, 4, 32, M40K_GLU_SWIGLU_OAI},  {M40K_TYPE_Q8_0, 130, 1, 4, M40K_GLU_SILU},
        {M40K_TYPE_Q6_K, 17, 8, 16, M40K_GLU_SILU},         {M40K_TYPE_F16, 25, 3, 5, M40K_GLU_SWIGLU_OAI},
        {M40K_TYPE_Q5_K, 9, 4, 64, M40K_GLU_SILU},          {M40K_TYPE_MXFP4, 1, 4, 1, M40K_GLU_SILU},
        {M40K_TYPE_Q4_K, 100, 2, 8, M40K_GLU_SILU},         {M40K_TYPE_Q4_K, 130, 4, 8, M40K_GLU_SILU},
        {M40K_TYPE_Q6_K_P, 64, 8, 128, M40K_GLU_SILU},      {M40K_TYPE_Q6_K_P, 17, 8, 16, M40K_GLU_SILU},
        {M40K_TYPE_Q6_K_P, 130, 4, 8, M40K_GLU_SILU},
        {M40K_TYPE_MXFP4_P, 40, 4, 32, M40K_GLU_SWIGLU_OAI}, {M40K_TYPE_MXFP4_P, 64, 4, 32, M40K_GLU_SWIGLU_OAI},
        {M40K_TYPE_MXFP4_P, 130, 4, 8, M40K_GLU_SILU},
    };
    for (auto cs : cases) {
        const int type = cs.type, T = cs.T, k = std::min(cs.k, cs.E), E = cs.E, P = T * k;
        const int base = dev_base(type); /* the twins read the GGUF type, the kernels its device layout */
        const int be = m40_type_get((uint32_t)base)->block_elems;
        /* Q6_K_P: down rows of 768 as Qwen3-30B-A3B's (no whole Q6_K_G8 group) */
        const int dim = be == 256 ? 512 : be == 32 ? 32 * 11 : 8 * 45,
                  n_ff = type == M40K_TYPE_Q6_K_P ? 768 : be == 256 ? 256 * 2 : be == 32 ? 32 * 7 : 8 * 29;
        const bool bias = cs.act == M40K_GLU_SWIGLU_OAI;
        std::vector<uint8_t> wg = quant_matrix(base, E * n_ff, dim), wu = quant_matrix(base, E * n_ff, dim),
                             wd = quant_matrix(base, E * dim, n_ff);
        std::vector<float> gb = rand_vec((size_t)E * n_ff), ub = rand_vec((size_t)E * n_ff),
                           db = rand_vec((size_t)E * dim);
        const int64_t xs = dim + 4, xs16 = dim + 8, ys = n_ff + 3, hs16 = n_ff + 8, ds = dim + 5, os = dim + 1;
        /* x of Q6_K layers in [-1/4, 1/4]: their random blocks' weights reach 20, and the
         * GLU of sums over 512 such terms would overflow the F16 rows the down product reads */
        const float xr = base == M40K_TYPE_Q6_K ? 0.25f : 1.0f;
        std::vector<float> x = rand_vec((size_t)T * xs, -xr, xr), w = rand_vec((size_t)P, 0.0f, 1.0f);
        std::vector<int32_t> ids = random_ids(T, k, E, false);
        if (T >= 32) /* one expert with more than one tile of rows */
            for (int t = 0; t < T; t++)
                ids[(size_t)t * k] = 0;
        /* the engine's tile rows (model_cuda_fwd.c) */
        const int bm = P / E <= 16 ? 16 : P / E <= 32 ? 32 : 64, mt = m40k_moe_max_tiles(P, E, bm);
        uint8_t *dwg = dup(dev_layout(type, wg, E * n_ff, dim)), *dwu = dup(dev_layout(type, wu, E * n_ff, dim)),
                *dwd = dup(dev_layout(type, wd, E * dim, n_ff));
        float *dgb = dup(gb), *dub = dup(ub), *ddb = dup(db), *dx = dup(x), *dw = dup(w);
        int32_t *dids = dup(ids), *dc, *doff, *dperm, *dinv, *dt;
        CK(cudaMalloc(&dc, E * 4));
        CK(cudaMalloc(&doff, (E + 1) * 4));
        CK(cudaMalloc(&dperm, P * 4));
        CK(cudaMalloc(&dinv, P * 4));
        CK(cudaMalloc(&dt, (size_t)mt * 8));
        CK(m40k_moe_group(dids, P, E, bm, dc, doff, dperm, dinv, dt, 0));
        std::vector<int32_t> off = back(doff, E + 1), perm = back(dperm, P), inv = back(dinv, P);
        char what[160];
        char tn[32];
        snprintf(tn, sizeof tn, "%s%s", m40_type_name(base), dev_suffix(type));
        /* gather */
        uint16_t *dxg, *dh16;
        CK(cudaMalloc(&dxg, (size_t)P * xs16 * 2));
        CK(cudaMemset(dxg, 0, (size_t)P * xs16 * 2));
        CK(m40k_moe_gather_f16(dx, xs, dim, dperm, P, k, dxg, xs16, 0));
        std::vector<uint16_t> xg = back(dxg, (size_t)P * xs16), cxg((size_t)P * xs16, 0);
        m40_ref_moe_gather_f16(x.data(), xs, dim, perm.data(), P, k, cxg.data(), xs16);
        snprintf(what, sizeof what, "moe_gather %s T %d k %d E %d: bit for bit", tn, T, k, E);
        check(what, xg == cxg);
        /* gate, up */
        float *dyg, *dyu, *dyd;
        CK(cudaMalloc(&dyg, (size_t)P * ys * 4));
        CK(cudaMalloc(&dyu, (size_t)P * ys * 4));
        CK(cudaMalloc(&dyd, (size_t)P * ds * 4));
        CK(cudaMemset(dyg, 0, (size_t)P * ys * 4));
        CK(cudaMemset(dyu, 0, (size_t)P * ys * 4));
        CK(cudaMemset(dyd, 0, (size_t)P * ds * 4));
        CK(m40k_moe_gemm_q(dwg, type, E, n_ff, dim, dxg, xs16, doff, dt, mt, bm, dyg, ys, 0));
        CK(m40k_moe_gemm_q(dwu, type, E, n_ff, dim, dxg, xs16, doff, dt, mt, bm, dyu, ys, 0));
        std::vector<float> yg = back(dyg, (size_t)P * ys), yu = back(dyu, (size_t)P * ys);
        std::vector<float> cyg((size_t)P * ys, 0.0f), cyu((size_t)P * ys, 0.0f);
        m40_ref_moe_gemm_q(wg.data(), base, E, n_ff, dim, xg.data(), xs16, off.data(), cyg.data(), ys);
        m40_ref_moe_gemm_q(wu.data(), base, E, n_ff, dim, xg.data(), xs16, off.data(), cyu.data(), ys);
        snprintf(what, sizeof what, "moe_gemm_q gate %s T %d k %d E %d bm %d", tn, T, k, E, bm);
        compare_scaled(what, yg, cyg, 1e-5);
        snprintf(what, sizeof what, "moe_gemm_q up %s T %d k %d E %d bm %d", tn, T, k, E, bm);
        compare_scaled(what, yu, cyu, 1e-5);
        if (m40k_gemm_q_kernel(type, dim, bm, dwg) == M40K_GEMM_Q_REGISTER) {
            /* the register kernel's grouped kernel took these: the shared-memory one too */
            m40k_moe_gemm_q_tune(0);
            CK(cudaMemset(dyu, 0, (size_t)P * ys * 4));
            CK(m40k_moe_gemm_q(dwg, type, E, n_ff, dim, dxg, xs16, doff, dt, mt, bm, dyu, ys, 0));
            snprintf(what, sizeof what, "moe_gemm_q gate %s T %d k %d E %d bm %d (shared-memory kernel)", tn, T, k, E,
                     bm);
            compare_scaled(what, back(dyu, (size_t)P * ys), cyg, 1e-5);
            m40k_moe_gemm_q_tune(64);
            CK(m40k_moe_gemm_q(dwu, type, E, n_ff, dim, dxg, xs16, doff, dt, mt, bm, dyu, ys, 0));
        }
        /* activation (on the GPU's products) */
        CK(cudaMalloc(&dh16, (size_t)P * hs16 * 2));
        CK(cudaMemset(dh16, 0, (size_t)P * hs16 * 2));
        CK(m40k_moe_glu_sorted(cs.act, dyg, dyu, ys, bias ? dgb : nullptr, bias ? dub : nullptr, dids, dperm, P, n_ff,
                               dh16, hs16, 0));
        std::vector<uint16_t> h16 = back(dh16, (size_t)P * hs16), ch16((size_t)P * hs16, 0);
        m40_ref_moe_glu_sorted(cs.act, yg.data(), yu.data(), ys, bias ? gb.data() : nullptr,
                               bias ? ub.data() : nullptr, ids.data(), perm.data(), P, n_ff, ch16.data(), hs16);
        {
            std::vector<float> a(h16.size()), b(h16.size());
            for (size_t i = 0; i < h16.size(); i++)
                a[i] = m40_fp16_to_fp32(h16[i]), b[i] = m40_fp16_to_fp32(ch16[i]);
            snprintf(what, sizeof what, "moe_glu_sorted %s T %d k %d E %d %s", tn, T, k, E, bias ? "oai+bias" : "silu");
            compare(what, a.data(), b.data(), a.size(), 1e-6f, 1e-3f); /* an F16 ulp where expf differs */
        }
        /* down, combine */
        CK(m40k_moe_gemm_q(dwd, type, E, dim, n_ff, dh16, hs16, doff, dt, mt, bm, dyd, ds, 0));
        std::vector<float> yd = back(dyd, (size_t)P * ds), cyd((size_t)P * ds, 0.0f);
        m40_ref_moe_gemm_q(wd.data(), base, E, dim, n_ff, h16.data(), hs16, off.data(), cyd.data(), ds);
        snprintf(what, sizeof what, "moe_gemm_q down %s T %d k %d E %d bm %d", tn, T, k, E, bm);
        compare_scaled(what, yd, cyd, 1e-5);
        float *dout;
        CK(cudaMalloc(&dout, (size_t)T * os * 4));
        std::vector<float> o0 = rand_vec((size_t)T * os);
        CK(cudaMemcpy(dout, o0.data(), o0.size() * 4, cudaMemcpyHostToDevice));
        CK(m40k_moe_combine(dyd, ds, dinv, dids, dw, bias ? ddb : nullptr, E, T, k, dim, dout, os, 1, 0));
        std::vector<float> go = back(dout, o0.size()), co = o0;
        m40_ref_moe_combine(yd.data(), ds, inv.data(), ids.data(), w.data(), bias ? db.data() : nullptr, E, T, k, dim,
                            co.data(), os, 1);
        snprintf(what, sizeof what, "moe_combine %s T %d k %d E %d (accumulate)", tn, T, k, E);
        {
            /* k weighted terms of up to max|y| each: float rounding of their sum */
            double ym = 0;
            for (float v : yd)
                ym = std::max(ym, (double)fabsf(v));
            compare(what, go.data(), co.data(), co.size(), (float)(1e-6 * k * ym) + 1e-5f, 1e-5f);
        }
        /* batched == alone: the GEMV path on the same layer (F32 activations there, F16
         * here: within a few 1e-3 of the output's scale) */
        if (T <= 64) {
            float *dhf, *dout2;
            CK(cudaMalloc(&dhf, (size_t)P * (n_ff + 4) * 4));
            CK(cudaMalloc(&dout2, (size_t)T * os * 4));
            CK(cudaMemcpy(dout2, o0.data(), o0.size() * 4, cudaMemcpyHostToDevice));
            CK(m40k_moe_gate_up(dwg, dwu, type, E, n_ff, dim, bias ? dgb : nullptr, bias ? dub : nullptr, cs.act, dx, xs,
                                dids, T, k, dhf, n_ff + 4, 0));
            CK(m40k_moe_down(dwd, type, E, dim, n_ff, bias ? ddb : nullptr, dhf, n_ff + 4, dids, dw, T, k, dout2, os, 1,
                             0));
            std::vector<float> g2 = back(dout2, o0.size());
            for (size_t i = 0; i < g2.size(); i++) /* the layer's part alone */
                g2[i] -= o0[i], go[i] -= o0[i];
            snprintf(what, sizeof what, "moe batched == alone %s T %d k %d E %d", tn, T, k, E);
            compare_scaled(what, go, g2, 1e-2);
            cudaFree(dhf), cudaFree(dout2);
        }
        cudaFree(dwg), cudaFree(dwu), cudaFree(dwd), cudaFree(dgb), cudaFree(dub), cudaFree(ddb), cudaFree(dx);
        cudaFree(dw), cudaFree(dids), cudaFree(dc), cudaFree(doff), cudaFree(dperm), cudaFree(dinv), cudaFree(dt);
        cudaFree(dxg), cudaFree(dh16), cudaFree(dyg), cudaFree(dyu), cudaFree(dyd), cudaFree(dout);
    }
}

/* ---------------------------------------------------------------- MXFP4 in the dense kernels */

/* The largest sum of |w| |x| over the rows and tokens of a product (W dequantized): the
 * scale of its F32 rounding, which the outputs themselves understate where the terms
 * cancel (a row of 2,880 terms summing to 0.34 differed by 5.5e-6 from the twin). */
static double product_mag(const std::vector<uint8_t> &w, int type, int N, int K, const std::vector<float> &x,
                          int64_t xs, int B)
{
    std::vector<float> row((size_t)K);
    const size_t rb = w.size() / (size_t)N;
    double mag = 0.0;
    for (int r = 0; r < N; r++) {
        m40_dequantize_row((uint32_t)type, w.data() + (size_t)r * rb, row.data(), K);
        for (int b = 0; b < B; b++) {
            double m = 0.0;
            for (int k = 0; k < K; k++)
                m += fabs((double)row[k] * x[(size_t)b * xs + k]);
            mag = std::max(mag, m);
        }
    }
    return mag;
}

static void test_mxfp4_dense(void)
{
    const int t = M40K_TYPE_MXFP4;
    char what_buf[96];
    for (int K : {32, 32 * 37, 2880, 512})
        for (int N : {1, 33, 130}) {
            std::vector<uint8_t> w = quant_matrix(t, N, K);
            uint8_t *dw = dup(w);
            char what[96];
            /* GEMV, batch 1 and 3 */
            for (int B : {1, 3}) {
                const int64_t xs = K + 4, ys = N + 1;
                std::vector<float> x = rand_vec((size_t)B * xs), c((size_t)B * ys, 0.0f);
                float *dx = dup(x), *dy;
                CK(cudaMalloc(&dy, c.size() * 4));
                CK(cudaMemset(dy, 0, c.size() * 4));
                CK(m40k_gemv(dw, t, N, K, dx, xs, dy, ys, B, 0));
                m40_ref_gemv(w.data(), t, N, K, x.data(), xs, c.data(), ys, B);
                std::vector<float> g = back(dy, c.size());
                snprintf(what, sizeof what, "gemv MXFP4 N %d K %d batch %d", N, K, B);
                compare(what, g.data(), c.data(), c.size(), (float)(2e-6 * product_mag(w, t, N, K, x, xs, B)), 1e-5f);
                cudaFree(dx), cudaFree(dy);
            }
            /* quantized GEMM: the file's layout on the direct kernel; the padded layout
             * MXFP4_P (kernels.h 0.) on the register kernel up to 64 rows (a last chunk past
             * K), the direct one above; split in two where K has two chunks */
            std::vector<uint8_t> wp = dev_layout(M40K_TYPE_MXFP4_P, w, N, K);
            uint8_t *dwp = dup(wp);
            for (int M : {1, 5, 9, 16, 40, 64, 65}) {
                const int64_t xs = K + 8, ldy = N + 3;
                std::vector<uint16_t> x((size_t)M * xs);
                for (auto &v : x)
                    v = m40_fp32_to_fp16(frand(-1.0f, 1.0f));
                std::vector<float> c((size_t)M * ldy, 0.0f);
                m40_ref_gemm_q(w.data(), t, N, K, x.data(), xs, M, c.data(), ldy);
                uint16_t *dx = dup(x);
                float *dy, *dws;
                const int S = K > 256 ? 2 : 1;
                int *dcnt = dup(std::vector<int>(m40k_gemm_q_counter_ints(N, M), 0));
                CK(cudaMalloc(&dy, c.size() * 4));
                CK(cudaMalloc(&dws, m40k_gemm_q_ws_floats(N, M, S) * 4 + 16));
                CK(cudaMemset(dy, 0, c.size() * 4));
                CK(m40k_gemm_q(dw, t, N, K, dx, xs, M, dy, ldy, 1, nullptr, nullptr, 0));
                snprintf(what, sizeof what, "gemm_q MXFP4 N %d K %d M %d", N, K, M);
                compare_scaled(what, back(dy, c.size()), c, 1e-5);
                const int kind = m40k_gemm_q_kernel(M40K_TYPE_MXFP4_P, K, M, dwp);
                const int want = M <= 64 ? M40K_GEMM_Q_REGISTER : M40K_GEMM_Q_DIRECT;
                snprintf(what, sizeof what, "gemm_q MXFP4_P N %d K %d M %d: kernel %d", N, K, M, want);
                check(what, kind == want);
                CK(m40k_gemm_q(dwp, M40K_TYPE_MXFP4_P, N, K, dx, xs, M, dy, ldy, S, dws, dcnt, 0));
                std::vector<float> g = back(dy, c.size());
                for (int tt = 0; tt < M; tt++) /* the register kernel leaves columns past N alone */
                    for (int64_t r = N; r < ldy; r++)
                        g[(size_t)tt * ldy + r] = c[(size_t)tt * ldy + r];
                snprintf(what, sizeof what, "gemm_q MXFP4_P N %d K %d M %d splits %d", N, K, M, S);
                compare_scaled(what, g, c, 1e-5);
                cudaFree(dx), cudaFree(dy), cudaFree(dws), cudaFree(dcnt);
            }
            cudaFree(dwp);
            /* embedding rows */
            std::vector<int32_t> ids = {0, N - 1, N / 2, -1, N};
            int32_t *di = dup(ids);
            float *de;
            CK(cudaMalloc(&de, ids.size() * K * 4));
            CK(m40k_embed(dw, t, N, K, di, (int)ids.size(), de, M40K_TYPE_F32, K, 0));
            std::vector<float> g = back(de, ids.size() * K), c(ids.size() * K);
            m40_ref_embed(w.data(), t, N, K, ids.data(), (int)ids.size(), c.data(), M40K_TYPE_F32, K);
            snprintf(what, sizeof what, "embed MXFP4 N %d K %d: bit for bit", N, K);
            check(what, g == c);
            cudaFree(di), cudaFree(de), cudaFree(dw);
        }
    check("gemm_q reads MXFP4 and MXFP4_P",
          m40k_gemm_q_supported(M40K_TYPE_MXFP4) == 1 && m40k_gemm_q_supported(M40K_TYPE_MXFP4_P) == 1);
    {
        /* neither is dequantized to F16 (no staged chunk: the direct kernel takes large products) */
        uint8_t *dw;
        uint16_t *dq;
        CK(cudaMalloc(&dw, 4 * 144 + 64));
        CK(cudaMalloc(&dq, 4 * 256 * 2));
        check("gemm_q_dequant refuses MXFP4 and MXFP4_P", m40k_gemm_q_dequant(dw, M40K_TYPE_MXFP4, 4, 256, dq, 0) != 0 &&
                                                              m40k_gemm_q_dequant(dw, M40K_TYPE_MXFP4_P, 4, 256, dq, 0) != 0);
        cudaFree(dw), cudaFree(dq);
    }
    {
        /* MXFP4_P: a row of 40 blocks (K 1,280: five chunks) and one of 3 (K 96: one chunk,
         * 5 blocks of zeros); the scales at 128 + j, nibbles at 16 j, zeros past K */
        for (int K : {1280, 96}) {
            std::vector<uint8_t> w = quant_matrix(t, 1, K), p = dev_layout(M40K_TYPE_MXFP4_P, w, 1, K);
            bool ok = p.size() == (size_t)(K + 255) / 256 * 144;
            for (int b = 0; b < (K + 255) / 256 * 8; b++) {
                const uint8_t *c = p.data() + (b / 8) * 144;
                for (int i = 0; i < 17; i++) {
                    const uint8_t want = b < K / 32 ? w[(size_t)17 * b + i] : 0;
                    ok = ok && (i == 0 ? c[128 + b % 8] : c[16 * (b % 8) + i - 1]) == want;
                }
            }
            for (size_t c = 0; c < p.size(); c += 144)
                for (int i = 136; i < 144; i++)
                    ok = ok && p[c + i] == 0;
            snprintf(what_buf, sizeof what_buf, "repack_mxfp4_p K %d: blocks, scales, zeros", K);
            check(what_buf, ok);
        }
        std::vector<uint8_t> w(17 * 3), p(144);
        check("repack_mxfp4_p refuses K 48", m40k_repack_mxfp4_p(w.data(), p.data(), 1, 48) == (int)cudaErrorInvalidValue);
    }
}

/* ---------------------------------------------------------------- benchmarks */

/* Bytes of a row of cols elements in a device layout (kernels.h 0.) or a GGUF type. */
static size_t dev_row_bytes(int type, int cols)
{
    const int64_t padded = m40k_padded_row_bytes(type, cols);
    return padded ? (size_t)padded : row_bytes(dev_base(type), cols);
}

/* Weights for timing: random bytes, with every block's scale fields made sane (F16 scales
 * of Q4_K and Q6_K small and positive; MXFP4's exponent near 2^-6), filled on the host and
 * rewritten into the device layout. */
static uint8_t *bench_weights(int type, size_t rows, int cols)
{
    const int base = dev_base(type);
    const size_t rb = row_bytes(base, cols), n = rb * rows;
    std::vector<uint8_t> h(n);
    uint64_t s = 0x243F6A8885A308D3ull;
    for (size_t i = 0; i + 8 <= n; i += 8) {
        s ^= s << 13, s ^= s >> 7, s ^= s << 17;
        memcpy(&h[i], &s, 8);
    }
    const int bb = m40_type_get((uint32_t)base)->block_bytes;
    for (size_t b = 0; b + bb <= n; b += bb) {
        if (base == M40K_TYPE_Q4_K) {
            const uint16_t d = m40_fp32_to_fp16(0.002f), dm = m40_fp32_to_fp16(0.001f);
            memcpy(&h[b], &d, 2), memcpy(&h[b + 2], &dm, 2);
        } else if (base == M40K_TYPE_Q6_K) {
            const uint16_t d = m40_fp32_to_fp16(0.0005f);
            memcpy(&h[b + 208], &d, 2);
        } else if (base == M40K_TYPE_MXFP4) {
            h[b] = 122;
        }
    }
    const std::vector<uint8_t> dl = dev_layout(type, h, (int64_t)rows, cols);
    uint8_t *d;
    CK(cudaMalloc(&d, dl.size() + 64));
    CK(cudaMemcpy(d, dl.data(), dl.size(), cudaMemcpyHostToDevice));
    return d;
}

static void bench_layer(const char *name, int type, int dim, int E, int k, int n_ff, int act, bool bias)
{
    const size_t rb_in = dev_row_bytes(type, dim), rb_ff = dev_row_bytes(type, n_ff);
    uint8_t *wg = bench_weights(type, (size_t)E * n_ff, dim), *wu = bench_weights(type, (size_t)E * n_ff, dim);
    uint8_t *wd = bench_weights(type, (size_t)E * dim, n_ff);
    const size_t expert_bytes = 2 * (size_t)n_ff * rb_in + (size_t)dim * rb_ff; /* gate + up + down */
    std::vector<float> wr = rand_vec((size_t)E * dim, -0.05f, 0.05f), gbh = rand_vec((size_t)E * n_ff, -0.1f, 0.1f),
                       dbh = rand_vec((size_t)E * dim, -0.1f, 0.1f);
    float *dwr = dup(wr), *dgb = dup(gbh), *dub = dup(gbh), *ddb = dup(dbh);
    for (int T : {1, 64}) {
        const int P = T * k, bm = P / E <= 16 ? 16 : P / E <= 32 ? 32 : 64, mt = m40k_moe_max_tiles(P, E, bm);
        std::vector<float> x = rand_vec((size_t)T * dim);
        float *dx = dup(x), *dl, *dw, *dh, *dout, *dyg, *dyu, *dyd;
        int32_t *di, *dc, *doff, *dperm, *dinv, *dt;
        uint16_t *dxg, *dh16;
        CK(cudaMalloc(&dl, (size_t)T * E * 4));
        CK(cudaMalloc(&dw, (size_t)P * 4));
        CK(cudaMalloc(&di, (size_t)P * 4));
        CK(cudaMalloc(&dh, (size_t)P * n_ff * 4));
        CK(cudaMalloc(&dout, (size_t)T * dim * 4));
        CK(cudaMalloc(&dyg, (size_t)P * n_ff * 4));
        CK(cudaMalloc(&dyu, (size_t)P * n_ff * 4));
        CK(cudaMalloc(&dyd, (size_t)P * dim * 4));
        CK(cudaMalloc(&dc, E * 4));
        CK(cudaMalloc(&doff, (E + 1) * 4));
        CK(cudaMalloc(&dperm, P * 4));
        CK(cudaMalloc(&dinv, P * 4));
        CK(cudaMalloc(&dt, (size_t)mt * 8));
        CK(cudaMalloc(&dxg, (size_t)P * dim * 2));
        CK(cudaMalloc(&dh16, (size_t)P * n_ff * 2));
        CK(cudaMemset(dout, 0, (size_t)T * dim * 4));
        const int gating = act == M40K_GLU_SWIGLU_OAI ? M40K_MOE_SOFTMAX_TOPK : M40K_MOE_SOFTMAX;
        cudaStream_t st = 0; /* the stream the paths launch on (a capturing one for the graphs) */
        auto route = [&] {
            CK(m40k_moe_router_logits(dwr, nullptr, E, dim, dx, dim, T, dl, st));
            CK(m40k_moe_topk(dl, T, E, k, gating, nullptr, gating == M40K_MOE_SOFTMAX, 1.0f, di, dw, st));
        };
        auto gemv_path = [&] {
            route();
            CK(m40k_moe_gate_up(wg, wu, type, E, n_ff, dim, bias ? dgb : nullptr, bias ? dub : nullptr, act, dx, dim,
                                di, T, k, dh, n_ff, st));
            CK(m40k_moe_down(wd, type, E, dim, n_ff, bias ? ddb : nullptr, dh, n_ff, di, dw, T, k, dout, dim, 1, st));
        };
        auto grouped_path = [&] {
            route();
            CK(m40k_moe_group(di, P, E, bm, dc, doff, dperm, dinv, dt, st));
            CK(m40k_moe_gather_f16(dx, dim, dim, dperm, P, k, dxg, dim, st));
            CK(m40k_moe_gemm_q(wg, type, E, n_ff, dim, dxg, dim, doff, dt, mt, bm, dyg, n_ff, st));
            CK(m40k_moe_gemm_q(wu, type, E, n_ff, dim, dxg, dim, doff, dt, mt, bm, dyu, n_ff, st));
            CK(m40k_moe_glu_sorted(act, dyg, dyu, n_ff, bias ? dgb : nullptr, bias ? dub : nullptr, di, dperm, P, n_ff,
                                   dh16, n_ff, st));
            CK(m40k_moe_gemm_q(wd, type, E, dim, n_ff, dh16, n_ff, doff, dt, mt, bm, dyd, dim, st));
            CK(m40k_moe_combine(dyd, dim, dinv, di, dw, bias ? ddb : nullptr, E, T, k, dim, dout, dim, 1, st));
        };
        /* the experts the routing picks (random weights: a spread of them) */
        route();
        std::vector<int32_t> ids = back(di, (size_t)P);
        std::vector<char> used(E, 0);
        for (int v : ids)
            used[v] = 1;
        const int n_used = (int)std::count(used.begin(), used.end(), 1);
        const double bytes = (double)n_used * expert_bytes + (double)E * dim * 4;
        auto report = [&](const char *path, double us) {
            printf("bench %-13s %-14s T %2d: %8.1f us a layer, %3d experts read (%.1f MB), %6.0f GB/s\n", name, path,
                   T, us, n_used, bytes / 1e6, bytes / us / 1e3);
        };
        /* each path plainly, then captured once in a CUDA graph (as a decode step runs: the
         * capture itself shows that nothing in it needs the host) */
        auto time_path = [&](const char *path, const char *gpath, auto fn) {
            report(path, time_us(fn, 50));
            cudaStream_t cs;
            CK(cudaStreamCreateWithFlags(&cs, cudaStreamNonBlocking));
            cudaGraph_t g;
            cudaGraphExec_t ge;
            st = cs;
            CK(cudaStreamBeginCapture(cs, cudaStreamCaptureModeGlobal));
            fn();
            CK(cudaStreamEndCapture(cs, &g));
            st = 0;
            CK(cudaGraphInstantiate(&ge, g, 0));
            report(gpath, time_us([&] { CK(cudaGraphLaunch(ge, 0)); }, 50));
            cudaGraphExecDestroy(ge), cudaGraphDestroy(g), cudaStreamDestroy(cs);
        };
        if (T <= 8)
            time_path("gemv", "gemv graph", gemv_path);
        time_path("grouped", "grouped graph", grouped_path);
        if (m40k_gemm_q_kernel(type, dim, bm, wg) == M40K_GEMM_Q_REGISTER) { /* against the shared-memory kernel */
            m40k_moe_gemm_q_tune(0);
            time_path("grouped smem", "gr. smem graph", grouped_path);
            m40k_moe_gemm_q_tune(64);
        }
        /* the pieces, one at a time (on the last routing) */
        const int it = 50;
        printf("  pieces: router logits %.1f us, topk %.1f", time_us([&] {
            CK(m40k_moe_router_logits(dwr, nullptr, E, dim, dx, dim, T, dl, 0)); }, it), time_us([&] {
            CK(m40k_moe_topk(dl, T, E, k, gating, nullptr, gating == M40K_MOE_SOFTMAX, 1.0f, di, dw, 0)); }, it));
        if (T <= 8)
            printf(", gate_up %.1f, down %.1f", time_us([&] {
                CK(m40k_moe_gate_up(wg, wu, type, E, n_ff, dim, bias ? dgb : nullptr, bias ? dub : nullptr, act, dx,
                                    dim, di, T, k, dh, n_ff, 0)); }, it), time_us([&] {
                CK(m40k_moe_down(wd, type, E, dim, n_ff, bias ? ddb : nullptr, dh, n_ff, di, dw, T, k, dout, dim, 1,
                                 0)); }, it));
        printf("; group %.1f, gather %.1f, gemm gate %.1f, gemm down %.1f, glu %.1f, combine %.1f\n", time_us([&] {
            CK(m40k_moe_group(di, P, E, bm, dc, doff, dperm, dinv, dt, 0)); }, it), time_us([&] {
            CK(m40k_moe_gather_f16(dx, dim, dim, dperm, P, k, dxg, dim, 0)); }, it), time_us([&] {
            CK(m40k_moe_gemm_q(wg, type, E, n_ff, dim, dxg, dim, doff, dt, mt, bm, dyg, n_ff, 0)); }, it), time_us([&] {
            CK(m40k_moe_gemm_q(wd, type, E, dim, n_ff, dh16, n_ff, doff, dt, mt, bm, dyd, dim, 0)); }, it), time_us([&] {
            CK(m40k_moe_glu_sorted(act, dyg, dyu, n_ff, bias ? dgb : nullptr, bias ? dub : nullptr, di, dperm, P, n_ff,
                                   dh16, n_ff, 0)); }, it), time_us([&] {
            CK(m40k_moe_combine(dyd, dim, dinv, di, dw, bias ? ddb : nullptr, E, T, k, dim, dout, dim, 1, 0)); }, it));
        cudaFree(dx), cudaFree(dl), cudaFree(dw), cudaFree(dh), cudaFree(dout), cudaFree(dyg), cudaFree(dyu);
        cudaFree(dyd), cudaFree(di), cudaFree(dc), cudaFree(doff), cudaFree(dperm), cudaFree(dinv), cudaFree(dt);
        cudaFree(dxg), cudaFree(dh16);
    }
    cudaFree(wg), cudaFree(wu), cudaFree(wd), cudaFree(dwr), cudaFree(dgb), cudaFree(dub), cudaFree(ddb);
}

static void bench(void)
{
    bench_layer("qwen3-30b-a3b", M40K_TYPE_Q4_K, 2048, 128, 8, 768, M40K_GLU_SILU, false);
    /* Q4_K_M files' Q6_K down experts: every matrix in the file's layout, then padded */
    bench_layer("qwen3 Q6_K", M40K_TYPE_Q6_K, 2048, 128, 8, 768, M40K_GLU_SILU, false);
    bench_layer("qwen3 Q6_K_P", M40K_TYPE_Q6_K_P, 2048, 128, 8, 768, M40K_GLU_SILU, false);
    bench_layer("gpt-oss-20b", M40K_TYPE_MXFP4, 2880, 32, 4, 2880, M40K_GLU_SWIGLU_OAI, true);
    bench_layer("gpt-oss MXFP4_P", M40K_TYPE_MXFP4_P, 2880, 32, 4, 2880, M40K_GLU_SWIGLU_OAI, true);
}

int main(int argc, char **argv)
{
    int ndev = 0;
    cudaError_t e = cudaGetDeviceCount(&ndev);
    if (e != cudaSuccess || ndev == 0) {
        printf("SKIP: no CUDA device (%s)\n", e != cudaSuccess ? cudaGetErrorString(e) : "0 devices");
        printf("0 passed, 0 failed, 1 skipped\n");
        return 0;
    }
    const bool bench_only = argc > 1 && strcmp(argv[1], "--bench-only") == 0;
    const bool do_bench = bench_only || (argc > 1 && strcmp(argv[1], "--bench") == 0);
    struct { const char *name; void (*fn)(void); } tests[] = {
        {"router", test_router}, {"topk", test_topk},       {"expert_gemv", test_expert_gemv},
        {"group", test_group},   {"batched", test_batched}, {"mxfp4_dense", test_mxfp4_dense},
    };
    const char *only = getenv("M40_TEST_ONLY");
    for (auto &t : tests) {
        if (bench_only)
            break;
        if (only && *only && !strstr(only, t.name))
            continue;
        const int f0 = n_fail, p0 = n_pass;
        t.fn();
        CK(cudaDeviceSynchronize());
        printf("%s %s (%d passed, %d failed)\n", n_fail > f0 ? "FAIL" : "PASS", t.name, n_pass - p0, n_fail - f0);
    }
    if (do_bench)
        bench();
    printf("%d passed, %d failed, %d skipped\n", n_pass, n_fail, n_skip);
    return n_fail ? 1 : 0;
}
